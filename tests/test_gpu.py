"""On a CUDA machine (`pytest -m gpu`; skipped without CUDA, see conftest.py): every recipe trains,
checkpoints and exports on one GPU, in float32 and under bf16 mixed precision, and the engine's
sampled logprobs equal the trainer's forward there, as they do on CPU."""

import json
import math

import pytest
import torch
from conftest import RL_RECIPES, ROOT, TASK_TEST, read_metrics, run_recipe

pytestmark = pytest.mark.gpu
STEPS = "--total-training-steps 3 --save-freq 3 --test-freq 3 --no-val-before-train".split()
RL_SHAPE = "--train-batch-size 8 --rollout-n 4".split()


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("recipe", RL_RECIPES + ["sft"])
def test_recipe_trains_on_one_gpu(tmp_path, small_files, recipe, precision):
    shape = [] if recipe == "sft" else RL_SHAPE
    run_recipe(recipe, "--output-dir", tmp_path, *small_files, "--mixed-precision", precision, *STEPS, *shape)
    run = json.loads((tmp_path / "config.json").read_text())["run"]
    assert str(run["device"]).startswith("cuda"), run
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3]
    bad = {k: v for r in records for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
    assert not bad, bad
    assert "val/accuracy" in records[-1]
    assert (tmp_path / "checkpoints" / "step_3" / "hf" / "model.safetensors").is_file()


def test_engine_logprobs_match_the_trainer_forward_on_gpu(tokenizer):
    from common.data import load_prompts, pack_sequences
    from common.engines import HFEngine, Sampling
    from common.model import load_policy
    from common.ops import logprobs_from_logits

    model = load_policy(str(ROOT / "bundled" / "tiny-qwen2-sft")).cuda()
    rows, _ = load_prompts([TASK_TEST], tokenizer, max_prompt_length=64)
    prompts = [r["prompt_ids"] for r in rows[:8]]
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cuda")
    torch.manual_seed(0)
    flat = [c for g in engine.generate(prompts, Sampling(n=4, temperature=1.0, max_tokens=16)) for c in g]
    batch = pack_sequences(
        [p for p in prompts for _ in range(4)], [c.token_ids for c in flat], tokenizer.pad_token_id, "cuda"
    )
    T = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    trainer = logprobs_from_logits(logits[:, -T - 1 : -1], batch["responses"]).cpu()
    worst = max(
        (trainer[i, : len(c.logprobs)] - torch.tensor(c.logprobs)).abs().max().item() for i, c in enumerate(flat)
    )
    print(f"\nlargest |engine - trainer| logprob difference on {torch.cuda.get_device_name()}: {worst:.2e}")
    assert worst < 1e-4


def packed_and_padded(tokenizer, device: str, layouts, torch_compile: bool = False) -> dict:
    """{(dtype, remove_padding): (logprobs of the response tokens, flat gradients)} of the bundled SFT
    model on 8 random responses of 2-300 tokens, for each (dtype, remove_padding) in layouts."""
    from common.data import load_prompts, pack_sequences
    from common.model import load_policy, response_logits
    from common.ops import logprobs_from_logits

    sft = str(ROOT / "bundled" / "tiny-qwen2-sft")
    rows, _ = load_prompts([TASK_TEST], tokenizer, max_prompt_length=64)
    g = torch.Generator().manual_seed(0)
    responses = [
        torch.randint(10, 100, (int(n),), generator=g).tolist() for n in torch.randint(2, 300, (8,), generator=g)
    ]
    batch = pack_sequences([r["prompt_ids"] for r in rows[:8]], responses, tokenizer.pad_token_id, device)
    batch["group_ids"] = torch.arange(8, device=device)
    mask = batch["response_mask"].bool()
    results = {}
    for dtype, remove_padding in layouts:
        model = load_policy(sft, dtype=dtype, remove_padding=remove_padding, torch_compile=torch_compile)
        model = model.to(device).train()
        logprobs = logprobs_from_logits(response_logits(model, batch).float(), batch["responses"])[mask]
        grads = torch.autograd.grad(logprobs.sum(), list(model.parameters()))
        results[dtype, remove_padding] = (logprobs.detach(), torch.cat([x.float().flatten() for x in grads]))
    return results


def test_a_packed_forward_equals_the_padded_one_on_gpu(tokenizer):
    """--use-remove-padding on a GPU: bfloat16 runs PyTorch's flash-attention varlen kernel
    (common.model.VARLEN), float32 the per-sequence attention. float32: the logprobs and gradients
    equal the padded pass's within float32 rounding. bfloat16 rounds each layout differently (on an
    H100 a token's logprob moved by up to 0.32 between them, as bfloat16 padded moves from float32 by
    up to 0.77 on a CPU), so each bfloat16 layout is held to the float32 result: the packed one may
    be no further from it than the padded one, give or take half (twice, for the one largest token
    gap); a kernel that attended across sequences or ignored causality missed by several nats."""
    layouts = [("float32", False), ("float32", True), ("bfloat16", False), ("bfloat16", True)]
    results = packed_and_padded(tokenizer, "cuda", layouts)
    (lp, grad), (packed_lp, packed_grad) = results["float32", False], results["float32", True]
    print(f"\nfloat32: largest |packed - padded| logprob difference {(packed_lp - lp).abs().max().item():.2e}")
    assert (packed_lp - lp).abs().max().item() < 1e-4
    assert (packed_grad - grad).norm() <= 1e-3 * grad.norm()
    errors = {}
    for remove_padding in (False, True):
        half_lp, half_grad = results["bfloat16", remove_padding]
        gap = (half_lp - lp).abs()
        errors[remove_padding] = (gap.mean().item(), gap.max().item(), ((half_grad - grad).norm() / grad.norm()).item())
    print(
        f"bfloat16 against float32 (mean, max logprob gap, relative gradient gap): padded {errors[False]}, "
        f"packed {errors[True]}"
    )
    (mean, largest, gradient), (packed_mean, packed_largest, packed_gradient) = errors[False], errors[True]
    assert packed_mean <= 1.5 * mean and packed_gradient <= 1.5 * gradient
    assert packed_largest <= 2 * largest  # one token's rounding: the loosest of the three


def test_compiled_layers_give_the_eager_pass_on_gpu(tokenizer):
    """--use-torch-compile (common.scaling.compile.compile_layers) on a GPU, padded and packed: the compiled layers'
    logprobs and gradients equal the eager ones within float32 rounding (fused kernels round in another
    order; a wrong fusion or a layer left out of its graph misses by far more)."""
    layouts = [("float32", False), ("float32", True)]
    eager = packed_and_padded(tokenizer, "cuda", layouts)
    compiled = packed_and_padded(tokenizer, "cuda", layouts, torch_compile=True)
    for layout in layouts:
        (lp, grad), (compiled_lp, compiled_grad) = eager[layout], compiled[layout]
        gaps = (compiled_lp - lp).abs().max().item(), ((compiled_grad - grad).norm() / grad.norm()).item()
        print(
            f"\n{layout}: compiled against eager, largest logprob gap {gaps[0]:.2e}, relative gradient gap "
            f"{gaps[1]:.2e}"
        )
        assert gaps[0] < 1e-4 and gaps[1] < 1e-3
