"""Masked tensor maths, memory-safe logprobs and entropy.

Every reduction takes an explicit mask and, where it matters, an explicit denominator, so a recipe
can normalise by the token count of a whole mini-batch rather than of one micro-batch.
"""

import torch

# Rows of (N, V) logits processed at once in float32: bounds the temporary to CHUNK x V floats.
CHUNK_ROWS = 1024


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    x = x * mask
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim=None, denom: float | torch.Tensor | None = None
) -> torch.Tensor:
    """sum(x * mask) / denom; denom defaults to mask.sum() (clamped to 1 so an empty mask gives 0)."""
    total = masked_sum(x, mask, dim)
    if denom is None:
        denom = mask.sum() if dim is None else mask.sum(dim)
        denom = torch.clamp(denom, min=1)
    return total / denom


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n < 2:
            raise ValueError(f"unbiased variance needs at least 2 valid elements, got {int(n)}")
        var = var * n / (n - 1)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked elements (unbiased var); mean added back if not shift_mean."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    return out if shift_mean else out + mean


def _row_chunks(n: int):
    for start in range(0, n, CHUNK_ROWS):
        yield slice(start, min(start + CHUNK_ROWS, n))


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[labels] for (..., V) logits and (...) labels, returned in float32.

    Works chunk by chunk over the rows so only CHUNK_ROWS x V float32 values exist at a time,
    instead of a full-vocabulary float32 copy of the whole micro-batch. Differentiable.
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    out = []
    for rows in _row_chunks(flat_logits.shape[0]):
        chunk = flat_logits[rows].float()
        picked = chunk.gather(-1, flat_labels[rows].unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(out).reshape(labels.shape) if out else flat_logits.new_zeros(labels.shape)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, (..., V) -> (...), float32, chunked."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for rows in _row_chunks(flat.shape[0]):
        chunk = flat[rows].float()
        logz = torch.logsumexp(chunk, dim=-1, keepdim=True)
        probs = torch.exp(chunk - logz)
        out.append(logz.squeeze(-1) - (probs * chunk).sum(-1))
    return torch.cat(out).reshape(logits.shape[:-1]) if out else flat.new_zeros(logits.shape[:-1])
