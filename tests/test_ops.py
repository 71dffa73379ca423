import math

import pytest
import torch

from common import flags, kl_reward, ops, shaping
from common.kl_reward import KLRewardArgs
from common.shaping import CorrectionArgs, correction
from common.shaping.conditioning import topr_loss


def rollout_correction(old, rollout, mask, advantages=None, *, mode=None, threshold=2.0, batch_normalize=False, **rest):
    """common.shaping.rollout_correction with the correction group of these knobs: mode --rollout-is, threshold
    --rollout-is-threshold, batch_normalize --rollout-is-batch-normalize, and in rest rs --rollout-rs, rs_threshold
    --rollout-rs-threshold, opsm --off-policy-mask-threshold."""
    names = {"rs": "rollout_rs", "rs_threshold": "rollout_rs_threshold", "opsm": "off_policy_mask_threshold"}
    knobs = dict(rollout_is=mode, rollout_is_threshold=threshold, rollout_is_batch_normalize=batch_normalize)
    c = CorrectionArgs(**knobs, **{names[k]: v for k, v in rest.items()})
    return shaping.rollout_correction(old, rollout, mask, advantages, c)


def test_masked_mean_sum_with_explicit_denominator():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert ops.masked_sum(x, mask).item() == 7.0
    assert ops.masked_mean(x, mask).item() == pytest.approx(7 / 3)
    assert ops.masked_mean(x, mask, denom=10).item() == pytest.approx(0.7)
    assert torch.allclose(ops.masked_mean(x, mask, dim=1), torch.tensor([1.5, 4.0]))
    assert ops.masked_mean(x, torch.zeros_like(mask)).item() == 0.0
    # an emptied mini-batch passes its own (zero) count: 0, not NaN
    assert ops.masked_mean(x, torch.zeros_like(mask), denom=0).item() == 0.0
    assert ops.masked_mean(x, torch.zeros_like(mask), denom=torch.tensor(0.0)).item() == 0.0
    assert ops.masked_mean(x, torch.zeros_like(mask), dim=1).tolist() == [0.0, 0.0]


def test_masked_whiten_matches_naive():
    torch.manual_seed(0)
    x = torch.randn(4, 7)
    mask = torch.rand(4, 7) > 0.3
    vals = x[mask]
    naive = (x - vals.mean()) / torch.sqrt(vals.var(unbiased=True) + 1e-8)
    out = ops.masked_whiten(x, mask)
    assert torch.allclose(out[mask], naive[mask], atol=1e-6)
    kept = ops.masked_whiten(x, mask, shift_mean=False)
    assert torch.allclose(kept[mask], naive[mask] + vals.mean(), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_match_log_softmax_across_chunks(monkeypatch, dtype):
    monkeypatch.setattr(ops, "CHUNK_ROWS", 5)  # 3 x 7 = 21 rows: several chunks and a partial one
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11).to(dtype).requires_grad_()
    labels = torch.randint(0, 11, (3, 7))
    out = ops.logprobs_from_logits(logits, labels)
    ref_logits = logits.detach().float().requires_grad_()
    ref = torch.log_softmax(ref_logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert out.dtype == torch.float32 and out.shape == (3, 7)
    assert torch.allclose(out, ref, atol=1e-5)
    out.sum().backward()
    ref.sum().backward()
    assert torch.allclose(logits.grad.float(), ref_logits.grad, atol=1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_entropy_matches_naive(monkeypatch):
    monkeypatch.setattr(ops, "CHUNK_ROWS", 4)
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 13) * 3
    p = torch.softmax(logits, -1)
    naive = -(p * torch.log_softmax(logits, -1)).sum(-1)
    _, entropy = ops.logprobs_and_entropy(logits, torch.zeros(2, 5, dtype=torch.long))
    assert torch.allclose(entropy, naive, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_exact_kl_over_the_vocabulary_and_its_gradient(monkeypatch, dtype):
    """kl_from_logits (kl_penalty full) is sum_v p_v (log p_v - log q_v) at every position, across
    chunks and a partial one, with the gradient of that formula flowing to the policy's logits only
    (each chunk is recomputed in the backward); it is 0 where the two distributions agree."""
    monkeypatch.setattr(ops, "CHUNK_ROWS", 4)  # 3 x 5 = 15 rows: four chunks, the last one partial
    torch.manual_seed(2)
    logits = (torch.randn(3, 5, 9) * 2).to(dtype).requires_grad_()
    ref_logits = (torch.randn(3, 5, 9) * 2).to(dtype)
    ref_logits[0, 0] = logits[0, 0].detach()  # one position where policy and reference agree
    out = ops.kl_from_logits(logits, ref_logits)
    x = logits.detach().float().requires_grad_()
    logp, logq = torch.log_softmax(x, -1), torch.log_softmax(ref_logits.float(), -1)
    formula = (logp.exp() * (logp - logq)).sum(-1)
    categorical = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=x.detach()), torch.distributions.Categorical(logits=ref_logits.float())
    )
    assert out.dtype == torch.float32 and out.shape == (3, 5)
    assert torch.allclose(out, formula, atol=1e-5) and torch.allclose(out, categorical, atol=1e-5)
    assert (out >= -1e-6).all() and abs(out[0, 0].item()) < 1e-6 and out.min() < out.max()
    weights = torch.rand(3, 5)  # a weighted sum, so each position's gradient is checked
    (out * weights).sum().backward()
    (formula * weights).sum().backward()
    assert torch.allclose(logits.grad.float(), x.grad, atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    with torch.no_grad():  # no graph, no recomputation: the same numbers
        assert torch.equal(ops.kl_from_logits(logits, ref_logits), out.detach())
    with pytest.raises(ValueError, match="kl_from_logits"):
        ops.kl_penalty(out, out, "full")


def test_adaptive_kl_controller_follows_its_update_rule():
    # kl above target by more than 20%: the proportional error is clipped at +0.2
    assert kl_reward.update_kl_coef(
        0.1, 0.5, kind="adaptive", target_kl=0.1, horizon=1000, n_steps=100
    ) == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000))
    # within the clip: error = 0.11 / 0.1 - 1 = 0.1; below target: clipped at -0.2
    assert kl_reward.update_kl_coef(0.1, 0.11, kind="adaptive", target_kl=0.1, horizon=50, n_steps=10) == pytest.approx(
        0.1 * (1 + 0.1 * 10 / 50)
    )
    assert kl_reward.update_kl_coef(0.1, 0.0, kind="adaptive", target_kl=0.1, horizon=50, n_steps=10) == pytest.approx(
        0.1 * (1 - 0.2 * 10 / 50)
    )
    assert kl_reward.update_kl_coef(0.1, 5.0, kind="fixed", target_kl=0.1, horizon=50, n_steps=10) == 0.1
    with pytest.raises(ValueError, match="kl_ctrl"):
        kl_reward.update_kl_coef(0.1, 0.0, kind="pid", target_kl=0.1, horizon=50, n_steps=10)


def test_masked_whiten_all_ranks_matches_masked_whiten_in_one_process():
    torch.manual_seed(0)
    x, mask = torch.randn(4, 7), torch.rand(4, 7) > 0.3
    got = ops.masked_whiten_all_ranks(x, mask)
    assert torch.allclose(got[mask], ops.masked_whiten(x, mask)[mask], atol=1e-6)
    assert got[~mask].abs().sum() == 0
    assert ops.masked_whiten_all_ranks(x, torch.zeros_like(mask)).abs().sum() == 0  # nothing valid: zeros, no NaN


def test_kl_controller_step_uses_the_mean_of_sequence_means():
    """One process: the step's KL is the mean over sequences of each one's mean token KL (padding
    out), n_steps the sequences; the metrics report the coefficient the step used."""
    kl = torch.tensor([[0.2, 0.4, 9.0], [0.1, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    want_kl = (0.3 + 0.1) / 2
    adaptive, fixed = (KLRewardArgs(kl_ctrl=kind, target_kl=0.1, horizon=20) for kind in ("adaptive", "fixed"))
    coef, metrics = kl_reward.kl_controller_step(0.05, kl, mask, adaptive)
    assert coef == pytest.approx(
        kl_reward.update_kl_coef(0.05, want_kl, kind="adaptive", target_kl=0.1, horizon=20, n_steps=2)
    )
    assert coef != 0.05 and metrics == {"policy/kl_coef": 0.05, "reward/kl_penalty": pytest.approx(want_kl)}
    assert kl_reward.kl_controller_step(0.05, kl, mask, fixed)[0] == 0.05


def test_rollout_is_weights_token_and_sequence_against_a_loop():
    torch.manual_seed(0)
    old = -torch.rand(3, 5) * 2
    rollout = old + torch.randn(3, 5) * 0.5
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    rollout[1, 2:] = 99.0  # padding holds junk; it must not reach a sequence's sum
    threshold = 1.3
    token = correction.rollout_is_weights(old.requires_grad_(), rollout, mask, "token", threshold)
    seq = correction.rollout_is_weights(old, rollout, mask, "sequence", threshold)
    assert not token.requires_grad and not seq.requires_grad
    for b in range(3):
        valid = [t for t in range(5) if mask[b, t]]
        seq_w = min(math.exp(sum(old[b, t].item() - rollout[b, t].item() for t in valid)), threshold)
        for t in range(5):
            want_token = min(math.exp(old[b, t].item() - rollout[b, t].item()), threshold) if mask[b, t] else 0.0
            assert token[b, t].item() == pytest.approx(want_token, rel=1e-5)
            assert seq[b, t].item() == pytest.approx(seq_w if mask[b, t] else 0.0, rel=1e-5)
    assert (token[mask.bool()] < threshold).any() and (token == threshold).any()  # both sides of the cap seen


def test_rollout_is_weights_stay_finite_and_keep_small_weights():
    old, rollout, mask = torch.tensor([[0.0, -50.0, 0.0]]), torch.tensor([[-50.0, 0.0, 0.0]]), torch.ones(1, 3)
    w = correction.rollout_is_weights(old, rollout, mask, "token", 2.0)
    # exp(50) truncated at the threshold; exp(-50) bounded below at exp(-20), not rounded to 0
    assert w.tolist()[0] == pytest.approx([2.0, math.exp(-20), 1.0])
    assert correction.rollout_is_weights(old, rollout, mask, "sequence", 2.0).tolist()[0] == pytest.approx([1.0] * 3)
    with pytest.raises(ValueError, match="token or sequence"):
        correction.rollout_is_weights(old, rollout, mask, "geometric", 2.0)


def test_rollout_correction_gives_the_weights_and_their_metrics_only_when_on():
    old, rollout = torch.tensor([[-1.0, -0.2, 0.0]]), torch.tensor([[-2.0, -0.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights, loss_mask, metrics = rollout_correction(old, rollout, mask, mode="token", threshold=2.0)
    assert torch.equal(weights, correction.rollout_is_weights(old, rollout, mask, "token", 2.0)) and loss_mask is mask
    assert (
        metrics == correction.rollout_is_metrics(weights, mask, 2.0) and metrics["rollout_corr/rollout_is_max"] == 2.0
    )
    weights, loss_mask, metrics = rollout_correction(None, rollout, mask, mode=None, threshold=2.0)
    assert torch.equal(weights, mask) and loss_mask is mask and metrics == {}


def test_a_lo_hi_band_zeroes_the_weights_outside_it():
    """verl's "lo_hi" rollout_is_threshold (IcePop): weights inside [lo, hi] kept as they are, the
    rest 0; the response mask is unchanged, and the zeroed share is logged."""
    log_w = torch.tensor([[math.log(0.4), math.log(0.6), math.log(4.0), math.log(6.0), 0.0]])
    old, rollout, mask = log_w, torch.zeros(1, 5), torch.tensor([[1.0, 1, 1, 1, 0]])
    w = correction.rollout_is_weights(old, rollout, mask, "token", "0.5_5.0")
    assert w.tolist()[0] == pytest.approx([0.0, 0.6, 4.0, 0.0, 0.0])
    weights, loss_mask, metrics = rollout_correction(old, rollout, mask, mode="token", threshold="0.5_5.0")
    assert loss_mask is mask and metrics["rollout_corr/rollout_is_oob_ratio"] == 0.5
    assert "rollout_corr/rollout_is_ratio_fraction_high" not in metrics
    assert flags.parse_band(2.0) == (None, 2.0) and flags.parse_band("0.5_5") == (0.5, 5.0)


def test_batch_normalize_rescales_the_weights_to_mean_one():
    old, rollout = torch.tensor([[0.2, 0.0, 0.0], [-0.3, 0.1, 9.0]]), torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    raw = correction.rollout_is_weights(old, rollout, mask, "token", 2.0)
    weights, _, metrics = rollout_correction(old, rollout, mask, mode="token", threshold=2.0, batch_normalize=True)
    factor = raw[mask.bool()].mean().item()
    torch.testing.assert_close(weights, raw / factor)
    assert weights[mask.bool()].mean().item() == pytest.approx(1.0)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(factor)
    # sequence weights: the mean over responses of each response's weight
    raw = correction.rollout_is_weights(old, rollout, mask, "sequence", 2.0)
    weights, _, _ = rollout_correction(old, rollout, mask, mode="sequence", threshold=2.0, batch_normalize=True)
    torch.testing.assert_close(weights, raw / ((raw[0, 0] + raw[1, 0]) / 2))


def test_rejection_against_each_statistic():
    """rollout_rejection_mask's options on hand-computed cases, r = old - rollout per token:
    k1 = -r, k2 = r^2 / 2, k3 = exp(r) - 1 - r; token options reject tokens, sequence options
    whole responses; several options must all keep a token."""
    r = torch.tensor([[0.1, -0.1, 0.0, 0.0], [0.5, 0.0, 0.0, 9.0], [-0.05, 0.05, 0.01, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    old, rollout = r, torch.zeros_like(r)

    def keep(options, thresholds):
        return correction.rollout_rejection_mask(old, rollout, mask, options, thresholds).tolist()

    # token_k1 with 0.9_1.2: keep log(0.9) <= -r <= log(1.2), i.e. r in [-0.182, 0.105]
    assert keep("token_k1", "0.9_1.2") == [[1, 1, 1, 0], [0, 1, 1, 0], [1, 1, 1, 1]]
    # a bare bound u means [1/u, u]
    assert keep("token_k1", "1.2") == keep("token_k1", f"{1 / 1.2}_1.2")
    # seq_mean_k1: the geometric mean ratio; row 1's mean log-ratio is 0.5/3 = 0.167, out of log(1.1) = 0.095
    assert keep("seq_mean_k1", "1.1") == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    # seq_sum_k2: row 0 sums 0.01, row 1 0.125, row 2 0.0025 (padding's 9.0 never counts)
    assert keep("seq_sum_k2", "0.05") == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert keep("seq_sum_k2", "0.005") == [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    # seq_max_k3 and token_k3: k3(0.5) = exp(0.5) - 1.5 = 0.1487, k3(0.1) = 0.00517
    assert keep("seq_max_k3", "0.1") == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert keep("token_k3", "0.005") == [[0, 1, 1, 0], [0, 1, 1, 0], [1, 1, 1, 1]]
    # two options, one bound each: a token is kept when both keep it
    assert keep("token_k3,seq_mean_k1", "0.005,1.1") == [[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    _, loss_mask, metrics = rollout_correction(
        old, rollout, mask, mode=None, threshold=2.0, rs="seq_mean_k1", rs_threshold="1.1"
    )
    assert loss_mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert metrics == {
        "rollout_corr/rollout_rs_masked_fraction": pytest.approx(3 / 10),
        "rollout_corr/rollout_rs_seq_masked_fraction": pytest.approx(1 / 3),
    }


def test_topr_loss_against_its_formula():
    """loss_t = -A_t * w_t * log pi_t: w = 1 on a positive response; on a negative one
    clamp(pi / pi_old, 0, 1), detached, so its gradient is -A_t * w_t * grad log pi_t."""
    new = torch.tensor([[-1.0, -2.0], [-1.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-0.5, -2.5], [-0.5, -1.0]])
    advantages = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    positive = torch.tensor([[1.0], [0.0]])
    loss = topr_loss(new, old, advantages, positive)
    w_negative = [math.exp(-1.0 + 0.5), 1.0]  # pi / pi_old = exp(-0.5), and exp(0.5) clamped to 1
    want = [[1.0, 2.0], [-2.0 * w_negative[0], -0.5 * 2 * w_negative[1]]]
    assert loss.tolist() == [pytest.approx(row) for row in want]
    loss.sum().backward()
    assert new.grad.tolist() == [pytest.approx([-1.0, -1.0]), pytest.approx([2 * w_negative[0], 2.0])]


# --- verl's rollout correction, written out from its definitions, on random batches -------------------
# Each reference below is a plain per-row loop in float64 over verl's formulas (decoupled mode, its
# rollout_corr_helper), so a vectorised shortcut in common.ops that changed the numbers would show.
# Notation: lr_t = old_t - rollout_t on the response tokens; SAFETY = 20 bounds every exponent.


def verl_is_weights(old, rollout, mask, level, threshold, batch_normalize):
    """rollout_is token / sequence: w_t = exp(clamp(lr_t)) or exp(clamp(sum_t lr_t)) on every token
    of the row; a number u truncates (min(w, u), TIS), "lo_hi" zeroes the weights outside [lo, hi]
    (IcePop); zero on padding; batch_normalize divides by the masked mean weight (token) or the
    mean over non-empty rows of each row's mean weight (sequence), when that mean is above 1e-8."""
    rows, cols = len(mask), len(mask[0])
    band = [float(x) for x in threshold.split("_")] if isinstance(threshold, str) else None
    w = [[0.0] * cols for _ in range(rows)]
    for b in range(rows):
        row_sum = sum(old[b][t] - rollout[b][t] for t in range(cols) if mask[b][t])
        for t in range(cols):
            if not mask[b][t]:
                continue
            x = row_sum if level == "sequence" else old[b][t] - rollout[b][t]
            raw = math.exp(min(max(x, -20.0), 20.0))
            w[b][t] = min(raw, threshold) if band is None else (raw if band[0] <= raw <= band[1] else 0.0)
    if batch_normalize:
        if level == "token":
            valid = [w[b][t] for b in range(rows) for t in range(cols) if mask[b][t]]
            mean = sum(valid) / len(valid)
        else:
            row_means = [
                sum(w[b][t] for t in range(cols) if mask[b][t]) / sum(mask[b]) for b in range(rows) if sum(mask[b])
            ]
            mean = sum(row_means) / len(row_means)
        if mean > 1e-8:
            w = [[x / mean for x in row] for row in w]
    return w


def verl_rejection_keep(old, rollout, mask, option, bound):
    """rollout_rs option: k1 = -lr, k2 = lr^2 / 2, k3 = exp(lr) - 1 - lr with lr clamped to +-20; the
    token value, or the row's masked sum / mean / max (0 for an empty row); k1 keeps
    log(lo) <= value <= log(hi) ("lo_hi", or a bare u: lo = 1/u), k2 and k3 keep value <= u."""
    level, k = option.rsplit("_", 1)
    keep = [[0] * len(mask[0]) for _ in mask]
    for b, row in enumerate(mask):
        stats = []
        for t, m in enumerate(row):
            lr = min(max(old[b][t] - rollout[b][t], -20.0), 20.0)
            stats.append({"k1": -lr, "k2": lr * lr / 2, "k3": math.exp(lr) - 1 - lr}[k] if m else None)
        valid = [s for s in stats if s is not None]
        if level == "seq_sum":
            seq = sum(valid)
        elif level == "seq_mean":
            seq = sum(valid) / len(valid) if valid else 0.0
        elif level == "seq_max":
            seq = max(valid) if valid else 0.0
        for t, m in enumerate(row):
            value = stats[t] if level == "token" else seq
            if not m:
                continue
            if k == "k1":
                lo, hi = (float(x) for x in bound.split("_")) if "_" in bound else (1 / float(bound), float(bound))
                keep[b][t] = int(math.log(lo) <= value <= math.log(hi))
            else:
                keep[b][t] = int(value <= float(bound))
    return keep


def random_batch(seed):
    """Old and rollout logprobs a few tenths of a nat apart, rows of random lengths (one empty), junk
    on the padding."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = 6, 9
    old = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 3
    rollout = old + torch.randn(rows, cols, generator=g, dtype=torch.float64) * 0.3
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    lengths[seed % rows] = 0
    mask = (torch.arange(cols)[None] < lengths[:, None]).double()
    rollout = torch.where(mask > 0, rollout, torch.full_like(rollout, 50.0))
    return old, rollout, mask


@pytest.mark.parametrize("seed", range(4))
def test_the_off_policy_sequence_mask_equals_deepseek_v32s(seed):
    """DeepSeek-V3.2's mask as TRL's off_policy_mask_threshold applies it, per row in float64: a token is dropped
    (weight 0) where its advantage is negative and its response's mean log(pi_rollout / pi_old) over its tokens is
    above the threshold; the loss mask keeps every token (they still count in the loss's denominator)."""
    old, rollout, mask = random_batch(seed)
    g = torch.Generator().manual_seed(seed)
    advantages = torch.randn(mask.shape, generator=g, dtype=torch.float64)  # per token, as GAE's
    fractions = []
    for threshold in (-0.1, 0.01, 0.05, 0.2):
        weights, loss_mask, metrics = rollout_correction(
            old, rollout, mask, advantages, mode=None, threshold=2.0, opsm=threshold
        )
        want, dropped = [], 0
        for i in range(mask.shape[0]):
            valid = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
            gap = sum(rollout[i, t].item() - old[i, t].item() for t in valid) / len(valid) if valid else 0.0
            row = [
                0.0 if (mask[i, t] > 0 and advantages[i, t] < 0 and gap > threshold) else mask[i, t].item()
                for t in range(mask.shape[1])
            ]
            dropped += sum(1 for t in valid if row[t] == 0.0)
            want.append(row)
        torch.testing.assert_close(weights.double(), torch.tensor(want, dtype=torch.float64))
        assert loss_mask is mask
        assert metrics["rollout_corr/off_policy_masked_fraction"] == pytest.approx(dropped / mask.sum().item())
        fractions.append(dropped)
    assert fractions[0] > fractions[-1] and fractions[0] > 0  # a lower threshold drops more
    # with importance weights normalised over the step, the mask drops tokens after the normalisation
    keep, _, _ = rollout_correction(old, rollout, mask, advantages, mode=None, threshold=2.0, opsm=-0.1)
    both, _, with_mask = rollout_correction(
        old, rollout, mask, advantages, mode="token", threshold=2.0, batch_normalize=True, opsm=-0.1
    )
    alone, _, without = rollout_correction(old, rollout, mask, mode="token", threshold=2.0, batch_normalize=True)
    key = "rollout_corr/rollout_is_batch_norm_factor"
    assert with_mask[key] == without[key]
    torch.testing.assert_close(both, alone * keep)


@pytest.mark.parametrize("seed", range(4))
def test_rollout_is_weights_equal_verls_on_random_batches(seed):
    old, rollout, mask = random_batch(seed)
    as_lists = (old.tolist(), rollout.tolist(), mask.int().tolist())
    cases = [
        (level, threshold, norm)
        for level in ("token", "sequence")
        for threshold in (1.2, 2.0, "0.8_1.25")
        for norm in (False, True)
    ]
    for level, threshold, norm in cases:
        weights, loss_mask, metrics = rollout_correction(
            old, rollout, mask, mode=level, threshold=threshold, batch_normalize=norm
        )
        want = torch.tensor(verl_is_weights(*as_lists, level, threshold, norm), dtype=torch.float64)
        torch.testing.assert_close(weights.double(), want, rtol=1e-6, atol=1e-7, msg=f"{level} {threshold} {norm}")
        assert loss_mask is mask  # the weights never change the loss mask
        w = want[mask.bool()]  # verl's effective sample size, 1 / mean((w / mean w)^2): unchanged by the rescale
        ess = 1 / ((w / w.mean()).square().mean()).item()
        assert metrics["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(ess, rel=1e-6)
    token = torch.tensor(verl_is_weights(*as_lists, "token", 1.2, False))[mask.bool()]
    assert (token == 1.2).any() and ((token > 0) & (token < 1.2)).any()  # the cap binds on some tokens only


@pytest.mark.parametrize("seed", range(4))
def test_rollout_rejection_equals_verls_on_random_batches(seed):
    old, rollout, mask = random_batch(seed)
    as_lists = (old.tolist(), rollout.tolist(), mask.int().tolist())
    bounds = {"k1": ("0.8_1.25", "1.1", "0.95_1.5"), "k2": ("0.01", "0.05"), "k3": ("0.01", "0.05")}
    seen = set()
    for option in correction.RS_OPTIONS:
        for bound in bounds[option.rsplit("_", 1)[1]]:
            got = correction.rollout_rejection_mask(old, rollout, mask, option, bound)
            want = verl_rejection_keep(*as_lists, option, bound)
            assert got.int().tolist() == want, (option, bound)
            seen.add(sum(map(sum, want)))
    assert len(seen) > 3  # the bounds really split the batches: kept counts vary across options
    # two options together keep what both keep
    both = correction.rollout_rejection_mask(old, rollout, mask, "token_k1,seq_mean_k3", "0.8_1.25,0.01")
    a, b = verl_rejection_keep(*as_lists, "token_k1", "0.8_1.25"), verl_rejection_keep(*as_lists, "seq_mean_k3", "0.01")
    assert both.int().tolist() == [[x & y for x, y in zip(r, s)] for r, s in zip(a, b)]


def test_logprobs_and_entropy_equal_the_op_by_op_ones_with_their_gradients():
    """The fused pass (a written-out backward, padding skipped) against autograd through
    log_softmax, in float64: values and the gradient of any mix of the two; zero at padding."""
    from common.ops import logprobs_and_entropy

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 40, generator=g, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, 40, (3, 5), generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    w_lp, w_h = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64)
    logp = torch.log_softmax(logits, -1)
    ref_lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1) * mask
    ref_h = -(logp.exp() * logp).sum(-1) * mask
    for a, b in ((1.0, 0.0), (0.0, 1.0), (1.0, 0.5)):
        ref_grad = torch.autograd.grad((a * w_lp * ref_lp + b * w_h * ref_h).sum(), logits, retain_graph=True)[0]
        lp, h = logprobs_and_entropy(logits, labels, mask)
        grad = torch.autograd.grad((a * w_lp * lp + b * w_h * h).sum(), logits)[0]
        assert torch.allclose(lp, ref_lp) and torch.allclose(h, ref_h)
        assert torch.allclose(grad, ref_grad)
        assert (grad[~mask] == 0).all()
    lp, h = logprobs_and_entropy(logits, labels, with_entropy=False)
    assert h is None and torch.allclose(lp, logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1))


def test_logprobs_and_entropy_keep_bfloat16_logits_in_float32_maths():
    from common.ops import logprobs_and_entropy, logprobs_from_logits

    logits = (4 * torch.randn(64, 300, generator=torch.Generator().manual_seed(1))).bfloat16().requires_grad_()
    labels = torch.randint(0, 300, (64,))
    lp, h = logprobs_and_entropy(logits, labels)
    assert lp.dtype == h.dtype == torch.float32
    assert torch.allclose(lp, logprobs_from_logits(logits, labels), atol=1e-5)
    logp = torch.log_softmax(logits.float(), -1)
    assert torch.allclose(h, -(logp.exp() * logp).sum(-1), atol=1e-4)
    (lp.sum() + h.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16 and logits.grad.abs().sum() > 0


@pytest.mark.parametrize("head", [False, True])
def test_the_kept_set_replays_transformers_truncation_with_its_gradient(head):
    """kept (the sampler's kept count) makes each logprob the one transformers' top-k / top-p / min-p warpers
    sample from, label inside the set; the gradient is autograd's through those masked logits; entropy stays
    whole; kept 0 is the whole vocabulary. With head=(weight, bias, dtype) the same from hidden states."""
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from common.ops import logprobs_and_entropy

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 6, 8, generator=g, dtype=torch.float64)
    weight = (torch.randn(40, 8, generator=g, dtype=torch.float64)).requires_grad_()
    bias = torch.randn(40, generator=g, dtype=torch.float64)
    logits = torch.nn.functional.linear(hidden, weight, bias)
    # the sampler's processed logits: temperature 0.7, then one truncation per row (top-p 1.0 keeps all)
    warpers = [TopKLogitsWarper(5), TopPLogitsWarper(0.8), MinPLogitsWarper(0.1), TopPLogitsWarper(1.0)]
    flat = logits.detach().reshape(-1, 40) / 0.7
    warped = torch.cat([warpers[i % 4](None, row[None].clone()) for i, row in enumerate(flat)])
    kept = torch.isfinite(warped).sum(-1).reshape(2, 6)
    kept[kept == 40] = 0
    labels = torch.multinomial(warped.softmax(-1), 1, generator=g).reshape(2, 6)
    # the reference: autograd through the masked logits
    masked = (logits / 0.7).masked_fill(~torch.isfinite(warped).reshape(2, 6, 40), float("-inf"))
    ref = torch.log_softmax(masked, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_grad = torch.autograd.grad(ref.sum(), weight, retain_graph=True)[0]
    whole = torch.log_softmax(logits / 0.7, -1)
    if head:
        lp, h = logprobs_and_entropy(hidden, labels, temperature=0.7, head=(weight, bias, None), kept=kept)
    else:
        lp, h = logprobs_and_entropy(logits, labels, temperature=0.7, kept=kept)
    assert torch.allclose(lp, ref, atol=1e-12)
    assert torch.allclose(h, -(whole.exp() * whole).sum(-1), atol=1e-12)
    assert (lp[kept > 0] > whole.gather(-1, labels.unsqueeze(-1)).squeeze(-1)[kept > 0]).all()
    assert torch.allclose(torch.autograd.grad(lp.sum(), weight)[0], ref_grad, atol=1e-12)
    # a label ranked just outside its kept count (a last-bit ranking difference) stays in the set
    one = torch.tensor([[2.0, 1.0, 0.5, -1.0]], dtype=torch.float64)
    lp, _ = logprobs_and_entropy(one, torch.tensor([2]), kept=torch.tensor([2]), with_entropy=False)
    assert torch.allclose(lp, torch.log_softmax(one[:, :3], -1)[:, 2])


def test_the_kept_count_is_found_again_from_the_engines_logprob():
    """vLLM reports the processed logprob, not the set: kept_from_logprobs finds the count from the logits and that
    logprob, exactly where the logits are the engine's and it truncated; the replayed logprobs then meet the
    engine's (a whole distribution may come back less its least likely tokens, whose mass is below rounding)."""
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from common.ops import logprobs_and_entropy
    from common.serving.replay import kept_from_logprobs

    g = torch.Generator().manual_seed(5)
    logits = 2 * torch.randn(64, 300, generator=g, dtype=torch.float64)
    warpers = [TopPLogitsWarper(0.8), MinPLogitsWarper(0.05), TopPLogitsWarper(0.95), TopKLogitsWarper(300)]
    warped = torch.cat([warpers[i % 4](None, row[None].clone()) for i, row in enumerate(logits)])
    labels = torch.multinomial(warped.softmax(-1), 1, generator=g).squeeze(-1)
    engine = torch.log_softmax(warped, -1).gather(-1, labels[:, None]).squeeze(-1)
    truth = torch.isfinite(warped).sum(-1)
    truth[truth == 300] = 0
    kept = kept_from_logprobs(logits, labels, engine)
    cut = truth > 0
    assert cut.sum() >= 40 and torch.equal(kept[cut], truth[cut])
    replayed, _ = logprobs_and_entropy(logits, labels, kept=kept, with_entropy=False)
    assert torch.allclose(replayed, engine, atol=1e-10)
    # the trainer's logits a float32 rounding away from the engine's: the same logprobs, to that rounding
    near = kept_from_logprobs(logits.float().double(), labels, engine.float())
    replayed, _ = logprobs_and_entropy(logits, labels, kept=near, with_entropy=False)
    assert torch.allclose(replayed, engine, atol=1e-5)
