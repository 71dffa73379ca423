"""The update's model FLOPs, the device's peak and their ratio: MFU, model FLOPs utilisation.

FLOPs are counted as PaLM's appendix B (Chowdhery et al. 2022, arXiv:2204.02311) and verl's FlopsCounter
count them, so an MFU here reads like theirs. Forward and backward of a dense decoder, for n tokens:
    6 * N * n                      every weight matrix: 2 FLOPs a weight a token forward, 4 backward
  + 12 * layers * heads * head_dim * n^2   attention's QK^T and AV (forward 4 * ... * n^2, backward twice that)
N, the weights that multiply activations: every parameter but the input embedding, plus the output projection
(lm_head) even when tied to it. The attention term counts each token against the whole sequence, as PaLM and
verl do; a causal kernel does about half of it. Only needed work counts, a group's prompt once (needed_tokens):
padding, prompts run again (packed, --no-shared-prompt-forward) and recomputed activations (checkpointing) lower MFU.
"""

import contextlib
import functools
import os
import time
from collections import Counter

import torch

# Dense (no structured sparsity) datasheet peak TFLOP/s: bfloat16 / float16 on the tensor cores, float32 without
# them (torch's default) and TF32 (float32 under set_float32_matmul_precision("high")). The first name contained
# in torch.cuda.get_device_name() wins, so variants come first; a row without figures is measured (device_peak).
PEAK_TFLOPS = (  # name, bf16 (= fp16), fp32, tf32
    ("H100 PCIe", 756.0, 51.0, 378.0),  # NVIDIA H100 datasheet (PCIe)
    ("H100 NVL", 835.0, 60.0, 418.0),  # NVIDIA H100 datasheet (NVL)
    ("H200 NVL", 835.0, 60.0, 418.0),  # NVIDIA H200 datasheet (NVL)
    ("H100", 989.4, 67.0, 494.7),  # NVIDIA H100 datasheet (SXM5)
    ("H800", 989.4, 67.0, 494.7),  # as the H100 SXM5
    ("H200", 989.4, 67.0, 494.7),  # NVIDIA H200 datasheet (SXM)
    ("A100", 312.0, 19.5, 156.0),  # NVIDIA A100 datasheet
    ("A800", 312.0, 19.5, 156.0),  # as the A100
    ("L40S", 362.05, 91.6, 183.0),  # NVIDIA L40S datasheet
    ("L40", None, None, None),  # not the L4's figures: measured
    ("L4", 121.0, 30.3, 60.0),  # NVIDIA L4 datasheet
    ("A10G", None, None, None),  # not the A10's figures: measured
    ("A10", 125.0, 31.2, 62.5),  # NVIDIA A10 datasheet
    ("RTX 4090", 165.2, 82.6, 82.6),  # NVIDIA Ada Lovelace architecture whitepaper (fp32 accumulate)
    ("MI300X", 1307.4, 163.4, 653.7),  # AMD Instinct MI300X datasheet (matrix cores)
)


def matmul_parameters(model) -> int:
    """N above, through DDP, PEFT and FSDP2 (a DTensor's numel is the global one)."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    total = sum(p.numel() for p in inner.parameters())  # a tied weight is listed once
    embedding, head = inner.get_input_embeddings(), inner.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    return total - (0 if tied else embedding.weight.numel())


def flop_terms(model) -> dict:
    """The two coefficients above: per token (6 N) and per squared sequence length (12 layers heads head_dim)."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    config = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {"per_token": 6 * matmul_parameters(model), "per_token_sq": 12 * config.num_hidden_layers * heads * head_dim}


def update_flops(terms: dict, sum_tokens: float, sum_tokens_sq: float) -> float:
    """Forward and backward FLOPs of sequences whose lengths sum to sum_tokens, their squares to sum_tokens_sq."""
    return terms["per_token"] * sum_tokens + terms["per_token_sq"] * sum_tokens_sq


def needed_tokens(lengths, prompt_lengths, group_ids) -> tuple:
    """The summed tokens and squared lengths (two 0-d tensors) an update over these sequences needs, each group's
    prompt once (--shared-prompt-forward). lengths, prompt_lengths (B,): real tokens; group_ids (B,): the group."""
    groups, owner = torch.unique(group_ids, return_inverse=True)
    rows = torch.arange(len(group_ids), device=group_ids.device)
    first = torch.full((len(groups),), len(rows), device=rows.device).scatter_reduce(0, owner, rows, "amin")
    repeated = torch.where(rows == first[owner], 0, prompt_lengths).to(lengths.dtype)
    return lengths.sum() - repeated.sum(), (lengths**2).sum() - (repeated**2).sum()


def compute_dtype(dtype: str, mixed_precision: str) -> torch.dtype:
    """The dtype the matmuls run in: bfloat16 under --mixed-precision bf16, else the weights'."""
    return torch.bfloat16 if mixed_precision == "bf16" else getattr(torch, dtype)


def device_peak(device_type: str, dtype: torch.dtype, index: int = 0) -> tuple[float, str]:
    """(FLOP/s, its source) for one device computing in dtype: a GPU's datasheet peak in PEAK_TFLOPS, else
    (a CPU, an unlisted GPU) the best of a short matmul probe on it, which a run can reach but not pass."""
    if device_type == "cuda":
        name = torch.cuda.get_device_name(index)
        half, fp32, tf32 = next((row[1:] for row in PEAK_TFLOPS if row[0] in name), (None, None, None))
        if half is not None and dtype in (torch.bfloat16, torch.float16):
            return half * 1e12, f"{name} datasheet, dense {str(dtype).removeprefix('torch.')}"
        if half is not None:
            high = torch.get_float32_matmul_precision() != "highest"
            return (tf32 if high else fp32) * 1e12, f"{name} datasheet, dense {'tf32' if high else 'fp32'}"
    device = torch.device(device_type, index) if device_type == "cuda" else torch.device(device_type)
    return matmul_probe(device, dtype), f"measured by a {str(dtype).removeprefix('torch.')} matmul on {device_type}"


@functools.cache  # once a process: a run's trackers and benchmarks ask again
def matmul_probe(device: torch.device, dtype: torch.dtype, seconds: float = 0.25) -> float:
    """The best FLOP/s of square matmuls (2048 on a CPU, 8192 on a GPU) over about `seconds`, after
    one warm-up. Work running beside it on the same cores lowers it (and so raises MFU)."""
    size = 8192 if device.type == "cuda" else 2048
    g = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(size, size, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


# --- where a run's time went: phases outside a recipe's own timings, and the closing block's verdict -------------
PHASES: Counter = Counter()  # seconds of the weight sync and checkpoint saves (timed), for common.tracking


@contextlib.contextmanager
def timed(phase: str):
    """Add the seconds of the block to PHASES[phase]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        PHASES[phase] += time.perf_counter() - start


# The closing block's phases: its name, the perf/ timings summed into it, and which kind of bound it makes a run.
TIME_PHASES = (
    ("generate", ("perf/generate_s",), "generation"),
    ("waiting on remote engines", ("perf/rollout_wait_s",), "generation"),
    ("score", ("perf/score_s",), "reward"),
    ("old / ref logprobs", ("perf/logprobs_s", "perf/values_s"), "trainer"),
    ("update", ("perf/update_s", "perf/update_critic_s"), "trainer"),
    ("weight sync", ("perf/sync_s",), "sync"),
    ("validate", ("perf/validate_s",), None),
    ("save", ("perf/save_s",), None),
)


def phase_seconds(totals: dict) -> dict:
    """{phase: seconds} from the summed perf/*_s (TIME_PHASES), with a remote engine's wait taken out of generate."""
    seconds = {name: sum(totals.get(k, 0.0) for k in keys) for name, keys, _ in TIME_PHASES}
    seconds["generate"] = max(0.0, seconds["generate"] - seconds["waiting on remote engines"])
    return seconds


def verdict(seconds: dict, wall: float, run: dict) -> tuple[str, str]:
    """(what bounds the run, what would help it and why) from its phase seconds, wall time and `run`, its flags
    (common.tracking.Tracker.run_facts). The bound is the kind whose phases took most; advice taken is left out."""
    kinds = {}
    for name, _, kind in TIME_PHASES:
        if kind:
            kinds[kind] = kinds.get(kind, 0.0) + seconds.get(name, 0.0)
    bound = max(kinds, key=kinds.get)
    share = {k: v / wall for k, v in kinds.items()} if wall > 0 else dict.fromkeys(kinds, 0.0)
    advice = []
    if bound == "generation":
        if run.get("rollout_name") == "hf":
            advice.append("a vLLM engine (--rollout-name vllm): HF generate decodes one token a step in Python")
        overlap = min(share["generation"], share["trainer"])
        if run.get("rollout_placement") != "remote":
            advice.append(
                f"remote engines sampling while the trainer trains (--rollout-placement remote "
                f"--max-staleness 1): at most the update's {overlap:.0%} of the wall time can overlap"
            )
        elif not run.get("max_staleness"):
            advice.append(
                f"--max-staleness 1, so the engines sample the next step while this one trains (at most "
                f"the update's {overlap:.0%} can overlap)"
            )
        else:
            advice.append("more engines (--num-rollout-engines), or shorter responses (--max-response-length)")
    elif bound == "trainer":
        if run.get("padding", 0) >= 0.2 and run.get("use_remove_padding") is False:
            advice.append(
                f"padding-free passes (--use-remove-padding auto): {run['padding']:.0%} of the trained "
                "tokens were padding"
            )
        if run.get("device") == "cuda" and run.get("mixed_precision") == "no" and run.get("dtype") == "float32":
            advice.append("--mixed-precision bf16: the tensor cores run bfloat16 at many times float32's rate")
        if run.get("device") == "cuda" and not run.get("use_torch_compile"):
            advice.append("--use-torch-compile: norms, rotary and activations fused, 1.24-1.42x a 0.5B pass on an H100")
        if run.get("gradient_checkpointing"):
            advice.append("no --gradient-checkpointing if memory allows: it runs every forward twice")
        if run.get("micro_batches", 1) > 1:
            advice.append(
                f"a larger --micro-batch-size-per-gpu (now {run.get('micro_batch_size_per_gpu')}) if "
                f"memory allows: {run['micro_batches']} micro-batches an optimizer step, each a pass of its own"
            )
        if not advice:
            advice.append("more GPUs (torchrun --nproc_per_node N) or a smaller model: the trainer has no flag left")
    elif bound == "reward":
        advice.append(
            f"more reward workers (--reward-workers, now {run.get('reward_workers')}, on {os.cpu_count()} "
            "cores): each scores its share in parallel"
        )
        advice.append("a faster reward function, or one call a step for the whole batch (--reward-manager batch)")
    else:
        if not run.get("lora_rank"):
            advice.append("LoRA (--lora-rank): a sync then moves the adapter, not every weight")
        if run.get("rollout_placement") == "remote":
            advice.append("a colocated engine (--rollout-placement colocated): its sync stays inside the process")
        elif run.get("rollout_name") != "hf":
            advice.append("the HF engine (--rollout-name hf) samples with the trainer's own weights: no sync")
    return f"{bound}-bound ({share[bound]:.0%} of the time)", "; or ".join(advice)
