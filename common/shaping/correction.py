"""verl's rollout correction (algorithm.rollout_correction: --rollout-is, --rollout-rs), a feature:
common.shaping.rollout_correction loads it only where a flag turns the correction on. The engine that
sampled (pi_rollout) is not exactly the trainer's old policy (pi_old); importance weights of one
over the other, and a rejection of the tokens or responses whose gap leaves a band.
"""

import math

import torch

from common.errors import UsageError
from common.flags import parse_band
from common.parallel import all_reduce_sum, gather_objects


def _masked_mean_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of each row over its masked positions; 0 for a row with none."""
    count = mask.sum(-1)
    return torch.where(count != 0, (x * mask).sum(-1) / torch.where(count != 0, count, 1), 0)


def rollout_is_weights(
    old_logprobs: torch.Tensor | None,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str | None,
    threshold: float | str,
) -> torch.Tensor:
    """Importance weights of the trainer's old policy over the engine that sampled, (B, T),
    detached, zero on padding (verl's decoupled rollout correction):

    token:     w_t = exp(clamp(old_t - rollout_t, +-20))
    sequence:  w_t = exp(clamp(sum_t' (old_t' - rollout_t'), +-20)), the same on every token of a
               response
    then, by parse_band(threshold): truncated, min(w, u) (TIS: only the top is cut, so a small
    weight stays unbiased), or masked, w where lo <= w <= hi and 0 elsewhere (IcePop: a token far
    off the engine's distribution drops out of the loss but still counts in its denominator).

    level None (the correction off): 1 on every response token. The +-20 clamp keeps exp finite.
    Weights are non-negative, so scaling a token's advantage by w_t scales its clipped-surrogate
    loss (dual-clip included) by w_t: the same gradient as weighting the loss, as verl does."""
    mask = response_mask.to(torch.float32)
    if level is None:
        return mask
    log_ratio = (old_logprobs.detach().float() - rollout_logprobs.float()) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(mask)
    elif level != "token":
        raise ValueError(f"rollout_is {level!r}; use token or sequence")
    weights = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    lo, hi = parse_band(threshold)
    if lo is None:
        return weights.clamp(max=hi) * mask
    return torch.where((weights >= lo) & (weights <= hi), weights, 0.0) * mask


RS_OPTIONS = tuple(f"{level}_{k}" for level in ("token", "seq_sum", "seq_mean") for k in ("k1", "k2", "k3")) + (
    "seq_max_k2",
    "seq_max_k3",
)


def rollout_rejection_mask(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    options: str,
    thresholds: str,
) -> torch.Tensor:
    """verl's rollout rejection sampling: the tokens (B, T) to keep, 1 or 0, zero on padding.

    With r_t = clamp(old_t - rollout_t, +-20), each option (comma-separated) measures
        k1 = -r_t = log(pi_rollout / pi_old),  k2 = r_t^2 / 2,  k3 = exp(r_t) - 1 - r_t
    per token (token_k*), or per response as the masked sum (seq_sum_k*), mean (seq_mean_k*: for
    k1, the log of the geometric-mean ratio) or max (seq_max_k2, seq_max_k3; an empty response
    scores 0). thresholds: one entry for every option, or one per option (comma-separated): for k1
    "lo_hi" keeps log(lo) <= k1 <= log(hi) (a bare number u means lo = 1/u); for k2 and k3 a number
    u keeps the statistic <= u. A token option rejects tokens, a sequence option whole responses;
    a token is kept when every option keeps it."""
    mask = response_mask.to(torch.float32)
    names = [o.strip() for o in options.split(",")]
    bounds = [t.strip() for t in str(thresholds).split(",")]
    bounds = bounds * len(names) if len(bounds) == 1 else bounds
    r = torch.clamp(old_logprobs.detach().float() - rollout_logprobs.float(), -20.0, 20.0) * mask
    stats = {"k1": -r, "k2": 0.5 * r.square(), "k3": torch.exp(r) - 1 - r}
    keep = mask.clone()
    for name, bound in zip(names, bounds):
        level, k = name.rsplit("_", 1)
        x = stats[k] * mask
        if level == "seq_sum":
            x = x.sum(-1, keepdim=True)
        elif level == "seq_mean":
            x = _masked_mean_rows(x, mask).unsqueeze(-1)
        elif level == "seq_max":
            x = torch.where(mask > 0, x, torch.full_like(x, -torch.inf)).amax(-1, keepdim=True).clamp(min=0.0)
        if k == "k1":
            lo, hi = bound.split("_", 1) if "_" in bound else (1 / float(bound), bound)
            ok = (x >= math.log(float(lo))) & (x <= math.log(float(hi)))
        else:
            ok = x <= float(bound)
        keep = keep * ok.expand_as(mask).float()
    return keep


def rollout_is_metrics(weights, response_mask, threshold: float | str) -> dict:
    """verl's rollout_corr/* for the rollout correction's weights (B, T) over the response tokens of
    every rank: rollout_is_mean, _max, _min, rollout_is_ratio_fraction_high (the share truncated at
    the threshold; for a band, the share zeroed: rollout_is_oob_ratio) and
    rollout_is_eff_sample_size ((sum w)^2 / (n sum w^2), 1 when every weight is equal)."""
    lo, hi = parse_band(threshold)
    w = weights[response_mask.bool()]
    high = (w >= hi).sum().item() if lo is None else (w == 0).sum().item()  # in the weights' own dtype
    w = w.double()
    local = (
        w.sum().item(),
        w.square().sum().item(),
        len(w),
        high,
        w.max().item() if len(w) else None,
        w.min().item() if len(w) else None,
    )
    parts = gather_objects(local)
    total, squares, count, high = (sum(p[i] for p in parts) for i in range(4))
    if not count:
        return {}
    return {
        "rollout_corr/rollout_is_mean": total / count,
        "rollout_corr/rollout_is_max": max(p[4] for p in parts if p[2]),
        "rollout_corr/rollout_is_min": min(p[5] for p in parts if p[2]),
        "rollout_corr/" + ("rollout_is_ratio_fraction_high" if lo is None else "rollout_is_oob_ratio"): high / count,
        "rollout_corr/rollout_is_eff_sample_size": total**2 / (count * squares) if squares else 0.0,
    }


def off_policy_sequence_mask(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    advantages: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's off_policy_mask_threshold), (B, T) of 0 / 1: 0 on a token with a
    negative advantage in a response whose mean over its tokens of log(pi_rollout / pi_old) is above threshold (the
    engine sampled it where the policy has since turned away: learning from its failure is unreliable), 1 elsewhere.
    An empty response has mean 0. It multiplies the importance weights, not the loss mask: a dropped token still
    counts in the loss's denominator, as in TRL."""
    mask = response_mask.float()
    gap = _masked_mean_rows((rollout_logprobs.float() - old_logprobs.detach().float()) * mask, mask)
    return 1.0 - ((advantages < 0) & (gap[:, None] > threshold)).float() * mask


def correct(old_logprobs, rollout_logprobs, response_mask: torch.Tensor, advantages, c):
    """common.shaping.rollout_correction with the correction group c on (--rollout-is, --rollout-rs or
    --off-policy-mask-threshold set)."""
    mode, threshold, rs, opsm = c.rollout_is, c.rollout_is_threshold, c.rollout_rs, c.off_policy_mask_threshold
    weights = rollout_is_weights(old_logprobs, rollout_logprobs, response_mask, mode, threshold)
    metrics = rollout_is_metrics(weights, response_mask, threshold) if mode else {}
    if mode and c.rollout_is_batch_normalize:
        mask = response_mask.float()
        per_row = _masked_mean_rows(weights, mask) if mode == "sequence" else weights
        rows = (mask.sum(-1) > 0).float() if mode == "sequence" else mask
        total, count = all_reduce_sum(torch.stack([(per_row * rows).sum(), rows.sum()])).tolist()
        factor = total / count if count else 1.0
        weights = weights / factor if factor > 1e-8 else weights
        metrics["rollout_corr/rollout_is_batch_norm_factor"] = factor if factor > 1e-8 else 1.0
    if opsm is not None:  # after the IS metrics and normalisation: the weights' own
        keep = off_policy_sequence_mask(old_logprobs, rollout_logprobs, response_mask, advantages, opsm)
        dropped, tokens = all_reduce_sum(torch.stack([(1 - keep).sum(), response_mask.float().sum()])).tolist()
        metrics["rollout_corr/off_policy_masked_fraction"] = dropped / max(tokens, 1)
        weights = weights * keep
    if rs is None:
        return weights, response_mask, metrics
    keep = rollout_rejection_mask(old_logprobs, rollout_logprobs, response_mask, rs, c.rollout_rs_threshold)
    mask = response_mask.float()
    rejected = mask - keep
    counts = all_reduce_sum(
        torch.stack(
            [rejected.sum(), mask.sum(), (rejected.sum(-1) > 0).float().sum(), mask.new_tensor(float(len(mask)))]
        )
    )
    metrics["rollout_corr/rollout_rs_masked_fraction"] = (counts[0] / counts[1].clamp(min=1)).item()
    metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = (counts[2] / counts[3].clamp(min=1)).item()
    return weights * keep, response_mask * keep.to(response_mask.dtype), metrics


def check_rejection(args) -> None:
    """--rollout-rs: known options, one bound or one per option, each of its statistic's form."""
    options = [o.strip() for o in args.rollout_rs.split(",")]
    unknown = [o for o in options if o not in RS_OPTIONS]
    if unknown:
        raise UsageError(
            f"--rollout-rs {args.rollout_rs}: {unknown[0]!r} is not an option; choose among "
            f"{', '.join(RS_OPTIONS)} (comma-separated)"
        )
    if args.rollout_rs_threshold is None:
        raise UsageError(
            f"--rollout-rs {args.rollout_rs}: give --rollout-rs-threshold (e.g. 0.5_2.0 for a k1 "
            f"option, 0.01 for k2 / k3)"
        )
    bounds = [b.strip() for b in str(args.rollout_rs_threshold).split(",")]
    if len(bounds) not in (1, len(options)):
        raise UsageError(
            f"--rollout-rs-threshold {args.rollout_rs_threshold}: give one bound, or one per option "
            f"of --rollout-rs ({len(options)})"
        )
    for option, bound in zip(options, bounds * len(options) if len(bounds) == 1 else bounds):
        try:
            values = [float(x) for x in bound.split("_", 1)]
        except ValueError:
            values = []
        ok = (len(values) == 2 and 0 < values[0] <= values[1]) if "_" in bound else len(values) == 1
        ok = ok and all(v > 0 and math.isfinite(v) for v in values) and (option.endswith("k1") or "_" not in bound)
        if not ok:
            want = (
                "lo_hi with 0 < lo <= hi, or an upper ratio u (lo = 1/u)" if option.endswith("k1") else "a number > 0"
            )
            raise UsageError(
                f"--rollout-rs-threshold {args.rollout_rs_threshold}: {bound!r} for {option}: must be {want}"
            )
    if args.bypass_mode:
        raise UsageError(
            "--bypass-mode with --rollout-rs: in bypass mode the engine's logprobs are the old policy, so "
            "there is no gap between them to reject on; drop one of the two flags"
        )
