"""The update's work over the vocabulary, alone: each response token's logprob and entropy from its
logits, forward and backward, as the recipes ran it op by op (logprobs_from_logits and
entropy_from_logits, every position, padding included) against common.ops.logprobs_and_entropy (one
pass a chunk, a written-out backward, padding skipped). At a real vocabulary this work moves more
bytes than the model's matmuls (docs/benchmarks.md, the GPU tier's profile).

Prints the median seconds of each way, their ratio, and the largest difference of their results.

    python bench/vocab_ops.py                                       # CPU, Qwen2.5's vocabulary
    python bench/vocab_ops.py --device cuda --dtype bfloat16 --rows 16384
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from packing import timed  # noqa: E402  (bench/: the median of timed repeats, synchronised on a GPU)

from common.ops import _row_chunks, logprobs_and_entropy, logprobs_from_logits  # noqa: E402


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """The entropy as the recipes ran it before logprobs_and_entropy (common.ops had it): a pass of its own over
    every position, chunked over the rows, its backward through autograd. (..., V) -> (...), float32."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for rows in _row_chunks(flat.shape[0]):
        chunk = flat[rows].float()
        logz = torch.logsumexp(chunk, dim=-1, keepdim=True)
        probs = torch.exp(chunk - logz)
        out.append(logz.squeeze(-1) - (probs * chunk).sum(-1))
    return torch.cat(out).reshape(logits.shape[:-1]) if out else flat.new_zeros(logits.shape[:-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2048, help="positions in the micro-batch (sequences x tokens)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--padding", type=float, default=0.4, help="the share of positions that are padding")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(args.rows, args.vocab, generator=g)).to(args.device, getattr(torch, args.dtype))
    logits.requires_grad_()
    labels = torch.randint(0, args.vocab, (args.rows,), generator=g).to(args.device)
    mask = (torch.rand(args.rows, generator=g) >= args.padding).to(args.device)
    weights = torch.randn(args.rows, generator=g).to(args.device)

    def op_by_op(entropy_coeff):
        logprobs, entropy = logprobs_from_logits(logits, labels), entropy_from_logits(logits)
        loss = (logprobs * weights * mask).sum() + entropy_coeff * (entropy * mask).sum()
        loss.backward()
        logits.grad = None
        return logprobs * mask, entropy * mask

    def fused(entropy_coeff):
        logprobs, entropy = logprobs_and_entropy(logits, labels, mask)
        loss = (logprobs * weights).sum() + entropy_coeff * entropy.sum()
        loss.backward()
        logits.grad = None
        return logprobs, entropy

    print(
        f"{args.rows} positions ({args.padding:.0%} padding) x {args.vocab} vocabulary, {args.dtype} on "
        f"{args.device}, median of {args.repeats}, forward and backward"
    )
    for coeff, label in ((0.0, "entropy as a metric (entropy_coeff 0)"), (0.01, "entropy in the loss")):
        before = timed(lambda c=coeff: op_by_op(c), args.repeats)
        after = timed(lambda c=coeff: fused(c), args.repeats)
        gap = max((a - b).abs().max().item() for a, b in zip(op_by_op(coeff), fused(coeff)))
        print(f"{label}: op by op {before:.3f} s, fused {after:.3f} s: {before / after:.2f}x; largest gap {gap:.2g}")


if __name__ == "__main__":
    main()
