"""--check's weight sync item (a feature: only an engine with its own copy of the policy, vLLM or remote,
loads it): the trainable weights are moved and synced, the engine's logprobs of the probe must follow them,
then come back with the restored weights. common.check reports it as the launch check's weight sync item.
"""

import torch

from common.model import is_lora, trainer_logprobs
from common.ops import logprob_gap
from common.parallel import unwrap
from common.rollout import TOLERANCE, engine_logprobs


def check_weight_sync(model, engine, batch, version: int, dtype) -> tuple[bool, str, str]:
    """Move the trainable weights, sync, and the engine must serve the moved model; then restore."""
    from torch.distributed.tensor import DTensor

    bound = TOLERANCE[dtype]
    before = trainer_logprobs(model, batch, 1.0)
    trained = [p for p in unwrap(model).parameters() if p.requires_grad]  # LoRA: the adapter's
    tensors = [p.to_local() if isinstance(p, DTensor) else p.data for p in trained]  # this rank's share, in place
    saved = [t.detach().to("cpu", copy=True) for t in tensors]
    g = torch.Generator().manual_seed(1234)
    try:
        for scale in (0.05, 0.2, 0.8, 3.2):  # larger moves until the trainer's own logprobs move clearly past the bound
            with torch.no_grad():
                for t, copy in zip(tensors, saved):
                    size = copy.float().abs().mean().item() or 0.02  # a LoRA B starts at zero
                    noise = torch.randn(copy.shape, generator=g) * scale * size
                    t.copy_((copy.float() + noise).to(t.dtype))
            after = trainer_logprobs(model, batch, 1.0)
            moved = logprob_gap(after, before, batch)[1]
            if moved > 4 * bound[1]:
                break
        engine.update_weights(version)
        served = engine_logprobs(engine, batch, 1.0)
    finally:
        with torch.no_grad():
            for t, copy in zip(tensors, saved):
                t.copy_(copy.to(t.device))
    engine.update_weights(version)
    back = engine_logprobs(engine, batch, 1.0)
    new_gap, old_gap, back_gap = (
        logprob_gap(served, after, batch),
        logprob_gap(served, before, batch),
        logprob_gap(back, before, batch),
    )
    ok = new_gap[0] <= bound[0] and new_gap[1] <= bound[1] and back_gap[1] <= bound[1] and moved > 4 * bound[1]
    figure = (
        f"weights moved the probe's logprobs by {moved:.2g} (mean); after the sync the engine is {new_gap[1]:.2g} "
        f"from the moved model, {old_gap[1]:.2g} from the old; restored: {back_gap[1]:.2g}"
    )
    lora = (
        " (a LoRA policy: the engine may be serving the base weights without the trainer's current adapter)"
        if is_lora(unwrap(model))
        else ""
    )
    advice = (
        f"the engine does not serve the weights the trainer synced{lora}: its rollouts would come from stale "
        f"weights; check the engine's weight loading (common.serving.weight_sync) for this model and engine version"
    )
    return ok, figure, advice
