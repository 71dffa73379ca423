"""ppo.py's critic: a value at every position on top of the base model (verl's critic), loaded and
wrapped as the policy is, and its values of a batch's response tokens at the positions the policy's
logprobs use. Only ppo.py loads it.
"""

import logging

import torch

from common.model import DTYPES, check_packs, check_source, register_varlen, response_outputs
from common.parallel import resolve_strategy, wrap_model

log = logging.getLogger(__name__)


def load_critic(policy, dist, path: str | None = None):
    """verl's critic: AutoModelForTokenClassification with num_labels=1, a scalar value at every
    position on top of the base model, wrapped for DDP / FSDP2 (always the full model, no LoRA).
    From a causal-LM folder (PPO's default: the policy's) the backbone is loaded and the value head
    (`score`) is freshly initialised; a critic exported by a PPO checkpoint (hf_critic/) loads
    whole. Dropout before the head is off, as verl sets it, so values are not noisy. The policy group gives its
    dtype, precision, packing, checkpointing and strategy; path (--critic-model), default the policy's model."""
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    path = path or policy.path
    trust_remote_code, remove_padding = policy.trust_remote_code, policy.use_remove_padding
    source = check_source(path, "critic model")
    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    config.num_labels, config.classifier_dropout = 1, 0.0
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report of the missing head is replaced by the line below
    try:
        model, info = AutoModelForTokenClassification.from_pretrained(
            source,
            config=config,
            dtype=DTYPES[policy.dtype],
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            **({"attn_implementation": register_varlen()} if remove_padding else {}),
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    check_packs(model, path, remove_padding)
    fresh = sorted(k for k in info["missing_keys"] if not k.startswith("model."))
    if fresh:
        log.info("critic %s: value head %s freshly initialised (not in the checkpoint)", path, ", ".join(fresh))
    model.config.use_cache = False
    if policy.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return wrap_model(model, resolve_strategy(policy.strategy), dist, policy.mixed_precision)


def response_values(critic, batch: dict, share_prompts: bool = True) -> torch.Tensor:
    """The values of a load_critic model for each response token of a (micro-)batch, shape (b, T):
    the output at the position that predicts token t, the positions response_logits uses, with the
    same shared-prompt forward."""
    return response_outputs(critic, batch, share_prompts, keep_logits=False)[..., 0]
