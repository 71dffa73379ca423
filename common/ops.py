"""Masked tensor maths, memory-safe logprobs and entropy. Every reduction takes an explicit mask and, where it
matters, an explicit denominator, so a recipe can normalise by the token count of a whole mini-batch."""

import functools
from typing import Literal, get_args

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from common.parallel import all_reduce_max, all_reduce_sum

# Rows of (N, V) logits processed at once in float32: bounds the temporary to CHUNK x V floats.
CHUNK_ROWS = 1024
# The fused LM head's chunk (logprobs_and_entropy's head): at most HEAD_CHUNK logits, 128 MB in float32, as a
# chunk's logits, probabilities and gradient exist together in its backward.
HEAD_CHUNK = 2**25


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (x * mask).sum(dim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim=None, denom: float | torch.Tensor | None = None
) -> torch.Tensor:
    """sum(x * mask) / denom (default mask.sum()); 0, never NaN, at a zero count (e.g. every group filtered out)."""
    total = masked_sum(x, mask, dim)
    denom = torch.as_tensor(mask.sum(dim) if denom is None else denom, dtype=total.dtype, device=total.device)
    return torch.where(denom != 0, total / torch.where(denom != 0, denom, 1), 0)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The unbiased (n - 1) variance over the masked elements; ValueError under two of them."""
    var = masked_mean((x - masked_mean(x, mask)) ** 2, mask)
    n = mask.sum()
    if n < 2:
        raise ValueError(f"unbiased variance needs at least 2 valid elements, got {int(n)}")
    return var * n / (n - 1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked elements (unbiased var); mean added back if not shift_mean."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    return out if shift_mean else out + mean


def masked_mean_all_ranks(x: torch.Tensor, mask: torch.Tensor) -> float:
    """The mean of x over the masked elements of every rank (0 where there are none). Collective."""
    mask = mask.to(x.dtype)
    total, n = all_reduce_sum(torch.stack([(x * mask).sum(), mask.sum()])).tolist()
    return total / n if n else 0.0


def masked_whiten_all_ranks(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """masked_whiten over every rank's masked elements together, as verl whitens the whole batch on its driver:
    unbiased var (0 under two elements), zero where mask is 0. Collective: every rank calls it."""
    mask = mask.to(x.dtype)
    total, n = all_reduce_sum(torch.stack([(x * mask).sum(), mask.sum()])).tolist()
    centred = (x - total / max(n, 1)) * mask
    var = all_reduce_sum(centred.square().sum()).item() / max(n - 1, 1)
    return centred / (var + eps) ** 0.5


def logprob_gap(a: torch.Tensor, b: torch.Tensor, batch: dict) -> tuple[float, float]:
    """(largest, mean) |a - b| over the response tokens of every rank."""
    mask = batch["response_mask"].float()
    diff = (a - b).abs() * mask
    largest = all_reduce_max(float(diff.max()))
    total = all_reduce_sum(torch.stack([diff.sum(), mask.sum()]).double())
    return largest, float(total[0] / total[1].clamp(min=1))


def _row_chunks(n: int, size: int = CHUNK_ROWS) -> list[slice]:
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[labels] for (..., V) logits and (...) labels, in float32; differentiable. Chunked over
    the rows: only CHUNK_ROWS x V float32 values exist at a time, never a float32 copy of the whole micro-batch."""
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    out = []
    for rows in _row_chunks(flat_logits.shape[0]):
        chunk = flat_logits[rows].float()
        picked = chunk.gather(-1, flat_labels[rows].unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(out).reshape(labels.shape) if out else flat_logits.new_zeros(labels.shape)


def logprobs_and_entropy(
    logits, labels, mask=None, with_entropy: bool = True, temperature: float = 1.0, head=None, kept=None
):
    """(log softmax(logits / temperature)[labels], entropy of that softmax or None) for (..., V) logits and (...)
    labels, in float32 (float64 logits: float64), where mask (...) is true (0 elsewhere; everywhere without a mask).

    At a real vocabulary (151,936 for Qwen2.5) these per-token sums over V move more bytes than the model's
    matmuls, so one float32 copy and logsumexp per chunk of rows serve both results, the backward is written out
    (d logprob / dx = onehot - p, d entropy / dx = -p (log p + H)), padding rows are never read, and an entropy
    nobody differentiates (the metric, at entropy_coeff 0) adds nothing to the backward.

    head=(weight, bias, dtype): `logits` are the hidden states (..., H) the LM head would take, and each chunk's
    logits are made there (x @ weight.T + bias, in dtype, as autocast would) and remade in the backward, which
    returns the gradients of the hidden states, weight and bias: no (..., V) tensor exists, nor its gradient.

    kept (...) int: the sampler's truncation replayed (top-k, top-p and min-p each keep the most likely tokens),
    each logprob over the `kept` tokens of highest logit, the label among them (0: the whole vocabulary), as the
    engine's logprob was; the entropy stays the whole distribution's."""
    flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    rows = None if mask is None else mask.reshape(-1).nonzero().squeeze(-1)
    weight, bias, dtype = head or (None, None, None)
    kept = None if kept is None else kept.reshape(-1)
    args = (flat, flat_labels, rows, with_entropy, temperature, weight, bias, dtype, kept)
    logprobs, entropy = _LogprobEntropy.apply(*args)
    return logprobs.reshape(labels.shape), (entropy.reshape(labels.shape) if with_entropy else None)


def _chunk_logits(inputs, index, temperature, head) -> torch.Tensor:
    """The float32 (or float64) logits / temperature of rows `index`: inputs' own, or made by head (weight, bias)."""
    x = inputs[index] if head is None else F.linear(inputs[index].to(head[0].dtype), *head)
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x if temperature == 1 else x.div_(temperature)


def _kept_floor(x: torch.Tensor, kept: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """(n,) the lowest logit of each row's kept set: its kept-th highest, or the label's if that is lower (a
    last-bit difference from the engine's ranking keeps the sampled token in); -inf where kept is 0."""
    k = kept.clamp(max=x.shape[-1])
    top = x.topk(max(1, int(k.max())), dim=-1).values.gather(-1, (k - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(k > 0, torch.minimum(top, picked), torch.full_like(top, float("-inf")))


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs, labels, rows, with_entropy, temperature, weight, bias, dtype, kept):
        ctx.set_materialize_grads(False)
        dtype = dtype or (None if weight is None else weight.dtype)
        head = None if weight is None else (weight.to(dtype), None if bias is None else bias.to(dtype))
        n = inputs.shape[0]
        picked = torch.arange(n, device=inputs.device) if rows is None else rows
        float_type = torch.promote_types(inputs.dtype if head is None else head[0].dtype, torch.float32)
        logprobs, entropy, lse = (inputs.new_zeros(n, dtype=float_type) for _ in range(3))
        floor, kept_lse = (None, None) if kept is None else (torch.zeros_like(lse), torch.zeros_like(lse))
        ctx.size = CHUNK_ROWS if head is None else max(1, HEAD_CHUNK // head[0].shape[0])
        for part in _row_chunks(len(picked), ctx.size):
            index = picked[part]
            x = _chunk_logits(inputs, index, temperature, head)
            z = torch.logsumexp(x, dim=-1)
            lse[index] = z
            label = x.gather(-1, labels[index].unsqueeze(-1)).squeeze(-1)
            if kept is not None:  # over the kept set (a floor of -inf where the sampler kept every token)
                low = floor[index] = _kept_floor(x, kept[index], label)
                kept_lse[index] = torch.logsumexp(x.masked_fill(x < low.unsqueeze(-1), float("-inf")), dim=-1)
            logprobs[index] = label - (z if kept is None else kept_lse[index])
            if with_entropy:
                logp = x.sub_(z.unsqueeze(-1))
                entropy[index] = -(logp.exp() * logp).sum(-1)
        ctx.temperature, ctx.dtypes = temperature, [None if t is None else t.dtype for t in (weight, bias)]
        ctx.truncated = kept is not None
        truncation = () if kept is None else (floor, kept_lse)
        ctx.save_for_backward(inputs, labels, picked, lse, entropy, *truncation, *(head or ()))
        ctx.mark_non_differentiable(*(() if with_entropy else (entropy,)))
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        inputs, labels, picked, lse, entropy, *rest = ctx.saved_tensors
        (floor, kept_lse), head = (rest[:2], rest[2:]) if ctx.truncated else ((None, None), rest)
        head = tuple(head) or None  # (weight, bias) in the head's dtype
        wants_inputs, wants_weight, wants_bias = (ctx.needs_input_grad[i] for i in (0, 5, 6))
        grad = torch.zeros_like(inputs) if wants_inputs else None
        grad_weight = torch.zeros_like(head[0], dtype=lse.dtype) if wants_weight else None  # summed over chunks
        grad_bias = torch.zeros(head[0].shape[0], dtype=lse.dtype, device=lse.device) if wants_bias else None
        if grad_logprobs is None and grad_entropy is None:
            return grad, None, None, None, None, grad_weight, grad_bias, None, None
        for part in _row_chunks(len(picked), ctx.size):
            index = picked[part]
            x = _chunk_logits(inputs, index, ctx.temperature, head)
            outside = None if floor is None or grad_logprobs is None else x < floor[index].unsqueeze(-1)
            logp = x.sub_(lse[index].unsqueeze(-1))
            p = logp.exp()
            q = p  # the kept set's softmax where truncated: p rescaled, 0 outside the set
            if outside is not None:
                q = (logp + (lse[index] - kept_lse[index]).unsqueeze(-1)).exp_().masked_fill_(outside, 0)
            if grad_entropy is not None:  # -g_H p (log p + H)
                g = logp.add_(entropy[index].unsqueeze(-1)).mul_(p).mul_(-grad_entropy[index].unsqueeze(-1))
            else:
                g = torch.zeros_like(p)
            if grad_logprobs is not None:  # g_lp (onehot - q)
                g_lp = grad_logprobs[index].unsqueeze(-1)
                g.sub_(q.mul_(g_lp)).scatter_add_(-1, labels[index].unsqueeze(-1), g_lp)
            if ctx.temperature != 1:  # through x / temperature
                g.div_(ctx.temperature)
            if head is None:
                grad[index] = g.to(grad.dtype)
                continue
            g = g.to(head[0].dtype)  # through x @ weight.T + bias, in the head's dtype
            if wants_inputs:
                grad[index] = (g @ head[0]).to(grad.dtype)
            if wants_weight:  # in place where the dtypes allow: no second (V, H) tensor
                x = inputs[index].to(g.dtype)
                grad_weight.addmm_(g.T, x) if grad_weight.dtype == g.dtype else grad_weight.add_(g.T @ x)
            if wants_bias:
                grad_bias += g.sum(0)
        if wants_weight:
            grad_weight = grad_weight.to(ctx.dtypes[0])
        if wants_bias:
            grad_bias = grad_bias.to(ctx.dtypes[1])
        return grad, None, None, None, None, grad_weight, grad_bias, None, None


def _kl_rows(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    logp, ref = torch.log_softmax(logits.float(), dim=-1), torch.log_softmax(ref_logits.float(), dim=-1)
    return (logp.exp() * (logp - ref)).sum(-1)


def kl_from_logits(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """The exact KL(p || q) = sum_v p_v (log p_v - log q_v) of each position's next-token distribution, p =
    softmax(logits), q = softmax(ref_logits): (..., V) -> (...), float32 (kl_penalty "full": ROLL's KL over the
    vocabulary). Chunked and recomputed in the backward (rowwise); the gradient flows to logits only."""
    return rowwise(_kl_rows, logits, ref_logits)


def rowwise(fn, logits: torch.Tensor, other: torch.Tensor, *extra) -> torch.Tensor:
    """fn(rows of logits, the same rows of other, *extra) -> (rows,), chunk by chunk over the rows
    (each recomputed in the backward when logits need a gradient); other is constant."""
    flat, flat_other = logits.reshape(-1, logits.shape[-1]), other.detach().reshape(-1, other.shape[-1])
    if flat.shape != flat_other.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and the other model's {tuple(other.shape)} differ")
    if torch.is_grad_enabled() and flat.requires_grad:
        fn = functools.partial(torch.utils.checkpoint.checkpoint, fn, use_reentrant=False)
    out = [fn(flat[rows], flat_other[rows], *extra) for rows in _row_chunks(flat.shape[0])]
    return torch.cat(out).reshape(logits.shape[:-1]) if out else flat.new_zeros(logits.shape[:-1], dtype=torch.float32)


# --- KL estimators and loss aggregation (same formulas as verl, so numbers carry over) ----------

KLEstimator = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full"]  # a KL flag's values
KL_KINDS = get_args(KLEstimator)[:-1]  # kl_penalty's; "full" is the exact KL over the vocabulary (kl_from_logits)
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(policy || ref) estimate from sampled-token logprobs, (B, T) -> (B, T).

    kl/k1: logp - ref;  abs: |logp - ref|;  mse/k2: (logp - ref)^2 / 2;  low_var_kl/k3 (Schulman's k3):
    exp(ref - logp) - (ref - logp) - 1, ref - logp clamped to +-20 before the exp, the result to +-10, as verl."""
    if kind in ("kl", "k1"):
        return logprobs - ref_logprobs
    if kind == "abs":
        return (logprobs - ref_logprobs).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logprobs - ref_logprobs).square()
    if kind in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref_logprobs - logprobs, min=-20, max=20)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)
    if kind == "full":
        raise ValueError("kl kind 'full' is the exact KL over the vocabulary: kl_from_logits, from both models' logits")
    raise ValueError(f"kl kind {kind!r}; use one of {KL_KINDS}")


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    token-mean:               sum(loss * mask) / num_tokens
    seq-mean-token-sum:       sum_seq(sum_t loss) / num_seqs
    seq-mean-token-mean:      sum_seq(mean_t loss) / num_seqs
    seq-mean-token-sum-norm:  seq-mean-token-sum / norm_constant (default: T, the padded width)

    num_tokens / num_seqs default to this batch's valid tokens / non-empty sequences (empty ones stay out of sequence
    means). Pass the whole mini-batch's counts (all micro-batches and ranks) so micro-batches add up to one pass."""
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return (loss_mat * mask).sum() / torch.clamp(torch.as_tensor(denom, dtype=loss_mat.dtype), min=1)
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode {mode!r}; use one of {AGG_MODES}")
    lengths = mask.sum(-1)
    valid = lengths > 0
    seq = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        seq = seq / torch.clamp(lengths, min=1)
    denom = valid.sum() if num_seqs is None else num_seqs
    out = seq[valid].sum() / torch.clamp(torch.as_tensor(denom, dtype=loss_mat.dtype), min=1)
    if mode == "seq-mean-token-sum-norm":
        out = out / (mask.shape[-1] if norm_constant is None else norm_constant)
    return out
