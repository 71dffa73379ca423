"""Padding-free forward passes (--use-remove-padding) against padded ones, in one process on the same
batches: the trainer's forward and backward over one micro-batch (response logits, logprobs and
entropy, as every RL recipe's update computes them), median seconds of --repeats after a warm-up.
Prints for each batch the padded and packed times, their ratio, response tokens per second, the
share of the padded batch's tokens that were padding and the layout the default (auto) picks; with
--profile, the share of each pass's CPU time spent in attention.

Four batches: "spread" (responses of 8-512 tokens, as a reasoning run's lengths spread), "uniform"
(the bundled addition task's answers, nearly all one length), and each of them in GRPO's groups of
8 responses to one prompt, whose prompt the padded pass runs once per group
(--shared-prompt-forward, the default) while the packed one runs it with every response.

    python bench/packing.py                          # the bundled tiny model
    python bench/packing.py --hidden 256 --layers 6  # a larger random-weight Qwen2 of the same shape family
    python bench/packing.py --shape qwen2.5-0.5b --device cuda --dtype bfloat16 --profile   # a GPU
    python bench/packing.py --compile --batches spread      # each decoder layer compiled (--use-torch-compile)

On a GPU each pass also reports its MFU (the model FLOPs of the work the batch needs a second, over
the device's peak: common.perf), and --profile the top kernels of the spread batch's passes by GPU
time.
"""

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.data import load_prompts, pack_sequences  # noqa: E402
from common.model import (  # noqa: E402
    forward_layout,
    load_policy,
    load_tokenizer,
    register_varlen,
    response_logits,
)
from common.ops import logprobs_and_entropy  # noqa: E402
from common.perf import device_peak, flop_terms, needed_tokens, update_flops  # noqa: E402
from common.scaling.compile import compile_layers  # noqa: E402

SFT = ROOT / "bundled" / "tiny-qwen2-sft"
TEST = ROOT / "bundled" / "addition" / "test.parquet"


def models(args, tokenizer):
    """The padded and the packed model, the same weights."""
    if args.shape:
        from throughput import random_model

        path = str(random_model(args.shape, Path(args.cache) / args.shape))
        return load_policy(path, dtype=args.dtype), load_policy(path, dtype=args.dtype, remove_padding=True)
    if not args.hidden:
        return load_policy(str(SFT), dtype=args.dtype), load_policy(str(SFT), dtype=args.dtype, remove_padding=True)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(SFT))
    config.hidden_size, config.num_hidden_layers = args.hidden, args.layers
    config.intermediate_size, config.num_attention_heads, config.num_key_value_heads = 4 * args.hidden, 8, 4
    config.head_dim, config.layer_types = args.hidden // 8, ["full_attention"] * args.layers
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    padded = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=dtype)
    packed = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=register_varlen(), dtype=dtype)
    packed.load_state_dict(padded.state_dict())
    return padded, packed


def batches(args, tokenizer, seqs: int) -> dict:
    rows, _ = load_prompts([TEST], tokenizer, max_prompt_length=64)
    prompts = [r["prompt_ids"] for r in rows[:seqs]]
    g = torch.Generator().manual_seed(0)
    spread = [
        torch.randint(10, 100, (int(n),), generator=g).tolist() for n in torch.randint(8, 513, (seqs,), generator=g)
    ]
    answers = [
        tokenizer(f"<answer>{r['ground_truth']}</answer>", add_special_tokens=False)["input_ids"] for r in rows[:seqs]
    ]
    out = {}
    for name, responses in (("spread", spread), ("uniform", answers)):
        batch = pack_sequences(prompts, responses, tokenizer.pad_token_id, args.device)
        batch["group_ids"] = torch.arange(len(prompts), device=args.device)
        out[name] = batch
    # GRPO's layout: groups of 8 responses to one prompt, which the padded pass runs once per group
    grouped = [p for p in prompts[: seqs // 8] for _ in range(8)]
    for name, responses in (("uniform", answers), ("spread", spread)):
        batch = pack_sequences(grouped, responses[: len(grouped)], tokenizer.pad_token_id, args.device)
        batch["group_ids"] = torch.arange(len(grouped), device=args.device) // 8
        out[f"{name}, groups of 8 sharing a prompt"] = batch
    return {k: v for k, v in out.items() if not args.batches or short(k) in args.batches}


def short(name: str) -> str:
    return name.replace(", groups of 8 sharing a prompt", "-groups")


def step(model, batch) -> None:
    logits = response_logits(model, batch, share_prompts=True)  # the recipes' default (--shared-prompt-forward)
    mask = batch["response_mask"].bool()
    logprobs, entropy = logprobs_and_entropy(logits, batch["responses"], mask)  # the recipes' update, as they call it
    loss = logprobs[mask].sum() + entropy[mask].sum()
    loss.backward()


def auto_layout(packed, batch) -> str:
    """The layout the default, --use-remove-padding auto, gives this batch."""
    packed.padding_free = "auto"
    try:
        return forward_layout(packed, batch)
    finally:
        packed.padding_free = True


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    """The median of `repeats` calls after a first one (which compiles, under --compile: its time is said)."""
    start = time.perf_counter()
    fn()
    sync()
    if time.perf_counter() - start > 5:
        print(f"  (first call {time.perf_counter() - start:.1f} s)", flush=True)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def top_kernels(fn, limit: int = 12) -> str:
    """The kernels of one call that took the most GPU time, as torch.profiler's table."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    return prof.key_averages().table(sort_by="self_device_time_total", row_limit=limit, max_name_column_width=60)


def attention_share(fn) -> float:
    """The share of one call's CPU time spent in scaled_dot_product_attention, forward and backward."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    attention = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key or "attention" in e.key)
    return attention / total if total else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--seqs",
        type=int,
        nargs="+",
        default=[16],
        help="sequences in the micro-batch (several: each batch at each size)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--hidden", type=int, default=0, help="build a random Qwen2 of this width (0: the bundled model)"
    )
    parser.add_argument("--layers", type=int, default=6, help="with --hidden: its depth")
    parser.add_argument(
        "--shape",
        default=None,
        help="a random-initialised model of a real shape: "
        "bench/throughput.py's SHAPES (qwen2.5-0.5b, qwen2.5-1.5b, smollm2-135m)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the weights' dtype")
    parser.add_argument(
        "--cache",
        default=str(Path(tempfile.gettempdir()) / "recipes-throughput"),
        help="with --shape: where its random-initialised model is kept",
    )
    parser.add_argument(
        "--batches",
        nargs="+",
        choices=["spread", "uniform", "uniform-groups", "spread-groups"],
        help="only these batches (default: all four)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="each decoder layer compiled, as --use-torch-compile does (common.scaling.compile.compile_layers)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also report the attention's share of the time (on a GPU: the top kernels of the spread batch's passes)",
    )
    args = parser.parse_args()

    tokenizer = load_tokenizer(str(SFT))
    padded, packed = models(args, tokenizer)
    padded, packed = padded.to(args.device).train(), packed.to(args.device).train()
    if args.compile:
        padded, packed = compile_layers(padded), compile_layers(packed)
    params = sum(p.numel() for p in padded.parameters()) / 1e6
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU threads {torch.get_num_threads()}"
    terms, dtype = flop_terms(padded), getattr(torch, args.dtype)
    peak, source = device_peak(args.device, dtype, torch.cuda.current_device() if args.device == "cuda" else 0)
    print(
        f"model: {params:.2f}M params ({args.shape or 'bundled' if not args.hidden else f'hidden {args.hidden}'}, "
        f"{args.dtype}{', compiled layers' if args.compile else ''}), {'/'.join(map(str, args.seqs))} sequences a micro-batch, median of {args.repeats}, {where}; peak "
        f"{peak / 1e12:.4g} TFLOP/s ({source})"
    )
    every = [
        (f"{name}{f' x {n}' if len(args.seqs) > 1 else ''}", batch, name, n)
        for n in args.seqs
        for name, batch in batches(args, tokenizer, n).items()
    ]
    for name, batch, kind, n in every:
        tokens = int(batch["attention_mask"].sum())
        padding = 1 - tokens / batch["attention_mask"].numel()
        response_tokens = int(batch["response_mask"].sum())
        t_padded = timed(lambda: step(padded, batch), args.repeats)  # noqa: B023
        t_packed = timed(lambda: step(packed, batch), args.repeats)  # noqa: B023
        lengths = batch["attention_mask"].sum(-1).double()
        work = update_flops(
            terms, *needed_tokens(lengths, lengths - batch["response_mask"].sum(-1), batch["group_ids"])
        )
        print(
            f"{name}: {tokens} tokens, {padding:.0%} of the padded batch was padding; fwd+bwd padded "
            f"{t_padded:.3f} s, packed {t_packed:.3f} s: {t_padded / t_packed:.2f}x; response tokens/s "
            f"{response_tokens / t_padded:.0f} -> {response_tokens / t_packed:.0f}; MFU "
            f"{float(work) / t_padded / peak:.1%} -> {float(work) / t_packed / peak:.1%}; auto runs it "
            f"{auto_layout(packed, batch)}"
        )
        if args.profile and args.device == "cuda" and kind == "spread" and n == max(args.seqs):  # the largest pass
            for label, m in (("padded", padded), ("packed", packed)):
                print(f"  top kernels, {label}:\n{top_kernels(lambda m=m: step(m, batch))}")  # noqa: B023
        elif args.profile:
            shares = [attention_share(lambda m=m: step(m, batch)) for m in (padded, packed)]  # noqa: B023
            print(f"  attention's share of the time: padded {shares[0]:.0%}, packed {shares[1]:.0%}")


if __name__ == "__main__":
    main()
