"""The policy losses of grpo.py's forks against their formulas (issue: "each equal to its reference").

Each reference below is a plain loop over rows and tokens in float64, written from the paper and
verl's loss of the same name (verl/trainer/ppo/core_algos.py, actor_rollout_ref.actor.policy_loss.loss_mode);
the recipe's compute_loss runs on random batches with rows of unequal length, one empty row and junk
on the padding, and must give the same loss and the same gradient to 1e-6."""

import dataclasses
import math

import pytest
import torch
from conftest import load_recipe, make_args

SEEDS = range(4)


def random_batch(seed, spread=0.3):
    """new / old logprobs `spread` nats apart, one advantage a row (outcome rewards), random lengths with
    one empty row and holes (a tool's tokens), and junk (50, and 9 for the advantage) on the padding."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = 6, 9
    old = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 3
    new = torch.clamp(old + torch.randn(rows, cols, generator=g, dtype=torch.float64) * spread, max=-0.01)  # log p < 0
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, cols).clone()
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    lengths[seed % rows] = 0
    mask = (torch.arange(cols)[None] < lengths[:, None]).double()
    mask[lengths >= 4, 1] = 0  # a hole, as a tool's reply leaves in an agent loop's response
    junk = lambda x, value: torch.where(mask > 0, x, torch.full_like(x, value))  # noqa: E731
    return junk(new, 50.0), junk(old, 50.0), junk(adv, 9.0), mask


def tokens(mask):
    """(row, token) of every valid token, row by row."""
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t] > 0]


def run(recipe, new, old, adv, mask, mode="token-mean", **knobs):
    """compute_loss's loss (its terms summed, as update sums them), its gradient in new, and its metrics. knobs:
    the recipe's Args fields compute_loss reads, set on its default Args as they are given (the formulas are
    checked past what the flags' ranges let a run set too: a negative --clip-cov-lb, a --clip-ratio-low of 9)."""
    args = recipe.Args()
    unknown = set(knobs) - {f.name for f in dataclasses.fields(args)}
    assert not unknown, f"{recipe.__name__}.Args has no {sorted(unknown)}"
    for name, value in knobs.items():
        setattr(args, name, value)
    new = new.clone().requires_grad_(True)
    terms, metrics = recipe.compute_loss(new, old, adv, mask, dict(mode=mode), args)
    loss = sum(terms.values())
    loss.backward()
    return loss.item(), new.grad, metrics


def assert_equal(got, want_loss, want_grad, mask):
    loss, grad, _ = got
    assert loss == pytest.approx(want_loss, rel=1e-6, abs=1e-9)
    torch.testing.assert_close(grad * mask, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-6, atol=1e-9)
    assert torch.all(grad[mask == 0] == 0), "no gradient reaches the padding"


# --- CISPO (recipes/cispo.py) ---------------------------------------------------------------------------
cispo = load_recipe("cispo")


def cispo_reference(new, old, adv, mask, low, high):
    """loss_t = -sg(clip(r_t, 1 - low, 1 + high)) * A_t * new_t, r_t = exp(clamp(new_t - old_t, +-20)), token-mean;
    its gradient in new_t is -w_t * A_t / N (nothing flows through the weight)."""
    valid = tokens(mask)
    grad = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    total = 0.0
    for i, t in valid:
        r = math.exp(min(max(new[i, t].item() - old[i, t].item(), -20.0), 20.0))
        w = min(max(r, 1 - low), 1 + high)
        total += -w * adv[i, t].item() * new[i, t].item()
        grad[i][t] = -w * adv[i, t].item() / len(valid)
    return total / len(valid), grad


@pytest.mark.parametrize("seed", SEEDS)
def test_cispo_equals_its_formula(seed):
    new, old, adv, mask = random_batch(seed)
    for low, high in [(0.2, 0.2), (10.0, 0.2), (0.05, 0.1)]:  # verl's default, the paper's open lower side
        got = run(cispo, new, old, adv, mask, clip_ratio_low=low, clip_ratio_high=high)
        assert_equal(got, *cispo_reference(new, old, adv, mask, low, high), mask)


def test_cispo_caps_the_weight_without_dropping_the_token():
    """A token whose ratio left the range still has a gradient (PPO's clip would give it none), scaled by
    the capped weight; clipfrac counts the capped tokens."""
    mask = torch.ones(1, 2, dtype=torch.float64)
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[math.log(2.0), 0.0]], dtype=torch.float64)  # ratios 2 and 1
    adv = torch.ones(1, 2, dtype=torch.float64)
    _, grad, metrics = run(cispo, new, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    torch.testing.assert_close(grad, torch.tensor([[-1.2 / 2, -1.0 / 2]], dtype=torch.float64))
    assert metrics["policy/clipfrac"].item() == 0.5
    args = cispo.Args()
    assert (args.clip_ratio, args.clip_ratio_low, args.clip_ratio_high) == (0.2, None, None), "verl's defaults"


def sequence_means(per_token, mask):
    """The mean over non-empty rows of each row's mean of per_token[i][t] (seq-mean-token-mean), and the
    factor d loss / d per_token[i][t] = 1 / (n_i * rows)."""
    rows = [i for i in range(mask.shape[0]) if mask[i].sum() > 0]
    n = {i: int(mask[i].sum().item()) for i in rows}
    value = sum(sum(per_token[i].values()) / n[i] for i in rows) / len(rows)
    return value, {i: 1.0 / (n[i] * len(rows)) for i in rows}


# --- SAPO (recipes/sapo.py) ----------------------------------------------------------------------------
sapo = load_recipe("sapo")


def sapo_reference(new, old, adv, mask, tau_pos, tau_neg):
    """loss_t = -A * sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos where A > 0 else tau_neg, r = exp(clamp(new - old,
    +-20)), seq-mean-token-mean; d loss_t / d new_t = -A * 4 * s * (1 - s) * r."""
    per_token, slope = {}, {}
    for i, t in tokens(mask):
        a = adv[i, t].item()
        tau = tau_pos if a > 0 else tau_neg
        r = math.exp(min(max(new[i, t].item() - old[i, t].item(), -20.0), 20.0))
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        per_token.setdefault(i, {})[t], slope[i, t] = -a * s * 4 / tau, -a * 4 * s * (1 - s) * r
    value, factor = sequence_means(per_token, mask)
    grad = [
        [slope[i, t] * factor[i] if (i, t) in slope else 0.0 for t in range(mask.shape[1])] for i in range(len(mask))
    ]
    return value, grad


@pytest.mark.parametrize("seed", SEEDS)
def test_sapo_equals_its_formula(seed):
    new, old, adv, mask = random_batch(seed, spread=0.5)
    for tau_pos, tau_neg in [(1.0, 1.05), (0.5, 2.0)]:
        got = run(sapo, new, old, adv, mask, "seq-mean-token-mean", tau_pos=tau_pos, tau_neg=tau_neg)
        assert_equal(got, *sapo_reference(new, old, adv, mask, tau_pos, tau_neg), mask)
    args = sapo.Args()
    assert (args.tau_pos, args.tau_neg, args.loss_agg_mode) == (1.0, 1.05, "seq-mean-token-mean")


# --- GMPO (recipes/gmpo.py) ----------------------------------------------------------------------------
gmpo = load_recipe("gmpo")


def gmpo_reference(new, old, adv, mask, low, high):
    """Per row, l_t = min(d_t, high) where A > 0, max(d_t, -low) where A < 0 (d = new - old); rho = exp(mean_t l_t);
    loss_i = -A * rho, the mean over non-empty rows; d loss_i / d new_t = -A * rho / n_i where l_t is not capped."""
    per_token, slope = {}, {}
    for i in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        if not valid:
            continue
        a = adv[i, valid[0]].item()
        d = [new[i, t].item() - old[i, t].item() for t in valid]
        capped = [min(x, high) if a > 0 else max(x, -low) for x in d]
        rho = math.exp(sum(capped) / len(valid))
        for t, x, c in zip(valid, d, capped):
            per_token.setdefault(i, {})[t] = -a * rho
            slope[i, t] = -a * rho if c == x else 0.0  # a capped log-ratio passes no gradient
    value, factor = sequence_means(per_token, mask)  # d rho / d new_t = rho / n_i: factor's 1 / (n_i * rows)
    grad = [
        [slope[i, t] * factor[i] if (i, t) in slope else 0.0 for t in range(mask.shape[1])] for i in range(len(mask))
    ]
    return value, grad


@pytest.mark.parametrize("seed", SEEDS)
def test_gmpo_equals_its_formula(seed):
    new, old, adv, mask = random_batch(seed)
    for low, high in [(0.2, 0.2), (0.4, 0.4), (0.1, 0.3)]:  # verl's default, the paper's, asymmetric
        got = run(gmpo, new, old, adv, mask, "seq-mean-token-mean", clip_ratio_low=low, clip_ratio_high=high)
        assert_equal(got, *gmpo_reference(new, old, adv, mask, low, high), mask)


def covariances(new, adv, mask):
    """{(row, token): (A_t - mean A) * (new_t - mean new)}, the means over the valid tokens."""
    valid = tokens(mask)
    mean_a = sum(adv[i, t].item() for i, t in valid) / len(valid)
    mean_p = sum(new[i, t].item() for i, t in valid) / len(valid)
    return {(i, t): (adv[i, t].item() - mean_a) * (new[i, t].item() - mean_p) for i, t in valid}


def token_mean(per_token, slope, mask):
    """sum of per_token over the valid tokens / their count, and its gradient from each token's slope."""
    n = len(tokens(mask))
    grad = [[slope.get((i, t), 0.0) / n for t in range(mask.shape[1])] for i in range(mask.shape[0])]
    return sum(per_token.values()) / n, grad


# --- Clip-Cov (recipes/clip_cov.py) ----------------------------------------------------------------------
clip_cov = load_recipe("clip_cov")


def clip_cov_reference(new, old, adv, mask, low, high, lb, ub):
    """PPO's clipped loss per token (no dual-clip), with every candidate cut to 0 (a share of 1: each of them is
    picked): a token is a candidate when PPO did not clip it and lb < cov_t < ub; token-mean over every valid token."""
    cov, per_token, slope = covariances(new, adv, mask), {}, {}
    for i, t in tokens(mask):
        a = adv[i, t].item()
        r = math.exp(min(max(new[i, t].item() - old[i, t].item(), -20.0), 20.0))
        unclipped, clipped = -a * r, -a * min(max(r, 1 - low), 1 + high)
        if clipped > unclipped:  # PPO's clip binds: no gradient
            per_token[i, t], slope[i, t] = clipped, 0.0
        elif lb < cov[i, t] < ub:  # Clip-Cov's cut
            per_token[i, t], slope[i, t] = 0.0, 0.0
        else:
            per_token[i, t], slope[i, t] = unclipped, -a * r
    return token_mean(per_token, slope, mask)


@pytest.mark.parametrize("seed", SEEDS)
def test_clip_cov_equals_its_formula(seed):
    new, old, adv, mask = random_batch(seed)
    knobs = dict(clip_ratio_low=0.2, clip_ratio_high=0.2)
    for lb, ub in [(0.0, 5.0), (-0.3, 0.2), (1.0, 5.0)]:
        got = run(clip_cov, new, old, adv, mask, clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub, **knobs)
        assert_equal(got, *clip_cov_reference(new, old, adv, mask, 0.2, 0.2, lb, ub), mask)


def test_clip_cov_cuts_a_share_of_the_tokens_at_random_among_the_candidates():
    """max(1, int(share * tokens)) tokens are cut, each a candidate, the pick seeded by torch's generator."""
    new, old, adv, mask = random_batch(0)
    cov = covariances(new, adv, mask)
    candidates = {k for k, c in cov.items() if 0.0 < c < 5.0}
    picks = []
    for seed in (1, 2, 1):
        torch.manual_seed(seed)
        cut_knobs = dict(clip_cov_ratio=0.1, clip_cov_lb=0.0, clip_cov_ub=5.0, clip_ratio_low=9.0, clip_ratio_high=9.0)
        _, grad, metrics = run(clip_cov, new, old, adv, mask, **cut_knobs)
        cut = {(i, t) for i, t in tokens(mask) if grad[i, t] == 0}
        assert len(cut) == max(1, int(0.1 * len(tokens(mask)))) and cut <= candidates
        assert metrics["policy/covfrac"].item() == pytest.approx(len(cut) / len(tokens(mask)))
        picks.append(cut)
    assert picks[0] == picks[2] and picks[0] != picks[1]
    with pytest.raises(Exception, match="must be below --clip-cov-ub"):
        clip_cov.Args(clip_cov_lb=5.0, clip_cov_ub=1.0)


# --- KL-Cov (recipes/kl_cov.py) -----------------------------------------------------------------------
kl_cov = load_recipe("kl_cov")


def kl_cov_reference(new, old, adv, mask, share, coef):
    """-A * r per token (no clip), plus coef * |new - old| on the max(1, int(share * tokens)) tokens of the largest
    covariance; token-mean."""
    cov, per_token, slope = covariances(new, adv, mask), {}, {}
    top = sorted(cov, key=cov.get, reverse=True)[: max(1, int(share * len(cov)))]
    for i, t in tokens(mask):
        a, d = adv[i, t].item(), new[i, t].item() - old[i, t].item()
        r = math.exp(d)
        per_token[i, t], slope[i, t] = -a * r, -a * r
        if (i, t) in top:
            per_token[i, t] += coef * abs(d)
            slope[i, t] += coef * math.copysign(1.0, d)
    return token_mean(per_token, slope, mask)


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_cov_equals_its_formula(seed):
    new, old, adv, mask = random_batch(seed)
    for share, coef in [(2e-4, 0.1), (0.3, 1.0), (1.0, 0.5)]:  # verl's default: one token; the paper's beta
        got = run(kl_cov, new, old, adv, mask, kl_cov_ratio=share, ppo_kl_coef=coef)
        assert_equal(got, *kl_cov_reference(new, old, adv, mask, share, coef), mask)


# --- DPPO (recipes/dppo.py) -----------------------------------------------------------------------------
dppo = load_recipe("dppo")


def dppo_reference(new, old, adv, mask, divergence, low, high, cap):
    """-A * min(r, cap) * new on the tokens kept (the weight detached), token-mean. p = exp(new), q = exp(old): kept
    unless tv: p - q > high (A > 0) or q - p > low (A <= 0); kl: KL_bin(q || p) > high and p > q (A > 0), or > low
    and p < q (A <= 0), KL_bin(q || p) = q log(q / p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8))."""
    per_token, slope = {}, {}
    for i, t in tokens(mask):
        a, lp, lq = adv[i, t].item(), new[i, t].item(), old[i, t].item()
        p, q = math.exp(lp), math.exp(lq)
        if divergence == "dppo_tv":
            out = p - q > high if a > 0 else q - p > low
        else:
            kl = q * (lq - lp) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
            out = (kl > high and p > q) if a > 0 else (kl > low and p < q)
        w = min(math.exp(min(max(lp - lq, -20.0), 20.0)), cap)
        per_token[i, t], slope[i, t] = (0.0, 0.0) if out else (-a * w * lp, -a * w)
    return token_mean(per_token, slope, mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("divergence", ["dppo_tv", "dppo_kl"])
def test_dppo_equals_its_formula(seed, divergence):
    new, old, adv, mask = random_batch(seed, spread=0.6)
    for low, high, cap in [(0.2, 0.2, 3.0), (0.05, 0.15, 1.2), (0.02, 0.01, 1e4)]:
        knobs = dict(loss_mode=divergence, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=cap)
        got = run(dppo, new, old, adv, mask, **knobs)
        assert_equal(got, *dppo_reference(new, old, adv, mask, divergence, low, high, cap), mask)
        assert 0 < got[2]["policy/clipfrac"].item() < 1 or (low, high) == (0.2, 0.2)


# --- DRO (recipes/dro.py) ------------------------------------------------------------------------------
dro = load_recipe("dro")


@pytest.mark.parametrize("seed", SEEDS)
def test_dro_equals_its_formula(seed):
    """loss_t = -A * new + beta / 2 * (new - old)^2, token-mean; d / d new_t = -A + beta * (new - old)."""
    new, old, adv, mask = random_batch(seed)
    for beta in (0.05, 1.0):
        per_token, slope = {}, {}
        for i, t in tokens(mask):
            a, d = adv[i, t].item(), new[i, t].item() - old[i, t].item()
            per_token[i, t], slope[i, t] = -a * new[i, t].item() + beta / 2 * d * d, -a + beta * d
        assert_equal(run(dro, new, old, adv, mask, dro_beta=beta), *token_mean(per_token, slope, mask), mask)


def test_dro_matches_verls_worked_case():
    """verl's own check of its dro loss: 0.126 by hand."""
    old = torch.tensor([[-1.0, -0.7, -0.2]], dtype=torch.float64)
    new = torch.tensor([[-0.8, -0.9, -0.1]], dtype=torch.float64)
    adv, mask = torch.tensor([[2.0, -1.5, 9.0]], dtype=torch.float64), torch.tensor([[1.0, 1.0, 0.0]])
    assert run(dro, new, old, adv, mask.double(), dro_beta=0.05)[0] == pytest.approx(0.126)


# --- GPG (recipes/gpg.py) ------------------------------------------------------------------------------
gpg = load_recipe("gpg")


@pytest.mark.parametrize("seed", SEEDS)
def test_gpg_loss_equals_its_formula(seed):
    """loss_t = -A * new, token-mean, whatever the old logprobs: d / d new_t = -A."""
    new, old, adv, mask = random_batch(seed)
    per_token = {(i, t): -adv[i, t].item() * new[i, t].item() for i, t in tokens(mask)}
    slope = {(i, t): -adv[i, t].item() for i, t in tokens(mask)}
    assert_equal(run(gpg, new, old, adv, mask), *token_mean(per_token, slope, mask), mask)
    assert run(gpg, new, old + 1.0, adv, mask)[0] == pytest.approx(run(gpg, new, old, adv, mask)[0])


# --- the advantages -----------------------------------------------------------------------------------------
def random_groups(seed):
    """Rewards of 4 groups (sizes 4, 4, 5 and a group of one) with repeats and ties, random lengths (one empty
    response), the group ids shuffled."""
    g = torch.Generator().manual_seed(seed)
    group_ids = torch.tensor([0] * 4 + [1] * 4 + [2] * 5 + [3])[torch.randperm(14, generator=g)]
    rewards = torch.tensor([0.0, 1.0, 0.5, -1.0])[torch.randint(0, 4, (14,), generator=g)]
    lengths = torch.randint(1, 8, (14,), generator=g)
    lengths[seed] = 0
    mask = (torch.arange(7)[None] < lengths[:, None]).float()
    return rewards, group_ids, mask


def broadcast(score, mask):
    return torch.tensor(score, dtype=torch.float64)[:, None] * mask.double()


def assert_advantages(got, want, mask):
    torch.testing.assert_close(got.double(), broadcast(want, mask), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_gpg_advantage_equals_its_formula(seed):
    """alpha * (r - mean_g) (a group of one: mean 0), alpha = B / max(#nonzero rewards, 1); with the std (the
    paper's F_norm = std), over (std_g + 1e-6), the std unbiased (1 for a group of one)."""
    rewards, groups, mask = random_groups(seed)
    r, g = rewards.tolist(), groups.tolist()
    alpha = len(r) / max(sum(1 for x in r if x != 0), 1)
    for norm in (False, True):
        want = []
        for i in range(len(r)):
            group = [r[j] for j in range(len(r)) if g[j] == g[i]]
            mean = sum(group) / len(group) if len(group) > 1 else 0.0
            std = (sum((x - mean) ** 2 for x in group) / (len(group) - 1)) ** 0.5 if len(group) > 1 else 1.0
            want.append(alpha * (r[i] - mean) / ((std + 1e-6) if norm else 1.0))
        assert_advantages(gpg.compute_advantages(rewards, groups, mask, norm_by_std=norm), want, mask)
    assert gpg.Args().norm_adv_by_std_in_grpo is False, "verl's F_norm = 1"
    all_zero = gpg.compute_advantages(torch.zeros(4), torch.tensor([0, 0, 1, 1]), torch.ones(4, 2), norm_by_std=False)
    assert torch.all(all_zero == 0)


opo = load_recipe("opo")


@pytest.mark.parametrize("seed", SEEDS)
def test_opo_advantage_equals_its_formula(seed):
    """r - b_g, b_g = sum_i l_i r_i / sum_i l_i over the group (l_i the response's tokens); a group of one: b = 0."""
    rewards, groups, mask = random_groups(seed)
    r, g, lengths = rewards.tolist(), groups.tolist(), mask.sum(-1).tolist()
    want = []
    for i in range(len(r)):
        members = [j for j in range(len(r)) if g[j] == g[i]]
        weight = sum(lengths[j] for j in members)
        b = sum(lengths[j] * r[j] for j in members) / weight if len(members) > 1 else 0.0
        want.append(r[i] - b)
    assert_advantages(opo.compute_advantages(rewards, groups, mask), want, mask)
    example = opo.compute_advantages(
        torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([[1.0] * 2 + [0] * 2, [1.0] * 4])
    )
    torch.testing.assert_close(example[:, 0], torch.tensor([2 / 3, -1 / 3]))  # b = (2 * 1 + 4 * 0) / 6


passk = load_recipe("grpo_passk")


@pytest.mark.parametrize("seed", SEEDS)
def test_passk_advantage_equals_its_formula(seed):
    """Only the best response of each group (the first on a tie) gets (r_max - r_2nd) / (std_g + 1e-6), the std
    unbiased (without it: r_max - r_2nd); every other response 0."""
    rewards, groups, mask = random_groups(seed)
    keep = groups != 3  # pass@k needs 2 responses a group
    rewards, groups, mask = rewards[keep], groups[keep], mask[keep]
    r, g = rewards.tolist(), groups.tolist()
    for norm in (False, True):
        want = [0.0] * len(r)
        for group in set(g):
            members = [j for j in range(len(r)) if g[j] == group]
            ranked = sorted(members, key=lambda j: -r[j])  # stable: the first of equal rewards leads
            lead = r[ranked[0]] - r[ranked[1]]
            mean = sum(r[j] for j in members) / len(members)
            std = (sum((r[j] - mean) ** 2 for j in members) / (len(members) - 1)) ** 0.5
            want[ranked[0]] = lead / (std + 1e-6) if norm else lead
        got = passk.compute_advantages(rewards, groups, mask, norm_by_std=norm)
        assert_advantages(got, want, mask)
    one = passk.compute_advantages(
        torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long), torch.ones(4, 1)
    )
    assert one[:, 0].tolist() == pytest.approx([1 / (0.5 + 1e-6), 0, 0, 0])  # verl's worked case
    with pytest.raises(Exception, match="pass@k needs 2 or more responses"):
        make_args(passk.Args, rollout_n=1)


remax = load_recipe("remax")


@pytest.mark.parametrize("seed", SEEDS)
def test_remax_advantage_equals_its_formula(seed):
    """r - b_g, b_g the reward of the greedy response to group g's prompt; no std, no group mean."""
    rewards, groups, mask = random_groups(seed)
    baselines = torch.tensor([0.5, -1.0, 1.0, 0.0])[torch.randperm(4, generator=torch.Generator().manual_seed(seed))]
    want = [r - baselines[g].item() for r, g in zip(rewards.tolist(), groups.tolist())]
    assert_advantages(remax.compute_advantages(rewards, groups, mask, baselines), want, mask)
    with pytest.raises(Exception, match="greedy baseline needs the engine in the trainer"):
        make_args(remax.Args, rollout_placement="remote")


def test_the_greedy_baseline_samples_this_steps_prompts_once_greedily(monkeypatch):
    """remax.greedy_rewards: one greedy response (n 1, temperature 0, no top-p / top-k) to each of this rank's
    prompts of the step (the ones Rollout.step() samples), scored by the same pool; its time adds to the step's."""
    import common.rollout as rollout
    from common.data import RLDataArgs, StepPrompts, step_rows
    from common.engines import Sampling
    from common.parallel import Dist

    calls = []

    def fake(prompts, engine, sampling, *rest):
        calls.append((prompts, sampling))
        return {"rewards": torch.arange(float(len(prompts))), "timing": {"perf/generate_s": 1.0, "perf/score_s": 2.0}}

    monkeypatch.setattr(remax, "generate_and_score", fake)  # what greedy_rewards calls (rollout.generate_and_score)
    train = [{"prompt_ids": [i]} for i in range(20)]
    sampling = Sampling(n=4, temperature=0.9, top_p=0.8, top_k=5, max_tokens=7)
    prompts = StepPrompts(train, RLDataArgs(train_batch_size=8, shuffle=True), seed=3, total_steps=10)
    dist = Dist(1, 2, 1, torch.device("cpu"))
    run = rollout.Rollout(prompts, [], None, None, None, dist, sampling, rollout.ValidationArgs())
    batch = {"timing": {"perf/generate_s": 0.5, "perf/score_s": 0.25}}
    baselines = remax.greedy_rewards(run, 5, batch)
    prompts, greedy = calls[0]
    assert prompts == step_rows(5, train, 8, 3, True, 2)[1][1] and len(baselines) == len(prompts) == 4
    assert (greedy.n, greedy.temperature, greedy.top_p, greedy.top_k, greedy.max_tokens) == (1, 0.0, 1.0, -1, 7)
    assert batch["timing"] == {"perf/generate_s": 1.5, "perf/score_s": 2.25}


gdpo = load_recipe("gdpo")


@pytest.mark.parametrize("seed", SEEDS)
def test_gdpo_advantage_equals_its_formula(seed):
    """Each reward standardised in its group ((r - mean) / (unbiased std + 1e-6); a group of one: r / (1 + 1e-6)),
    the weighted sum broadcast over the tokens, whitened over every valid token (token-weighted mean, unbiased
    variance, 1e-8 under the root)."""
    _, groups, mask = random_groups(seed)
    g = torch.Generator().manual_seed(seed)
    columns = torch.randint(0, 2, (len(groups), 3), generator=g).float()
    weights = [1.0, 0.5, 2.0]
    total = []
    for i, group in enumerate(groups.tolist()):
        value = 0.0
        for k, w in enumerate(weights):
            members = [columns[j, k].item() for j in range(len(groups)) if groups[j] == group]
            mean = sum(members) / len(members) if len(members) > 1 else 0.0
            std = (sum((x - mean) ** 2 for x in members) / (len(members) - 1)) ** 0.5 if len(members) > 1 else 1.0
            value += w * (columns[i, k].item() - mean) / (std + 1e-6)
        total.append(value)
    tokens_ = [(total[i], mask[i, t].item()) for i in range(len(total)) for t in range(mask.shape[1]) if mask[i, t] > 0]
    mean = sum(v for v, _ in tokens_) / len(tokens_)
    var = sum((v - mean) ** 2 for v, _ in tokens_) / (len(tokens_) - 1)
    want = [
        [(total[i] - mean) / (var + 1e-8) ** 0.5 if mask[i, t] > 0 else 0.0 for t in range(mask.shape[1])]
        for i in range(len(total))
    ]
    got = gdpo.compute_advantages(columns, groups, mask, weights)
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_gdpo_matches_verls_worked_case():
    """verl's own check: groups a, a, b, b; acc 1, 0, 0, 1; format 0, 1, 0, 1; two tokens each."""
    got = gdpo.compute_advantages(
        torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0]]),
        torch.tensor([0, 0, 1, 1]),
        torch.ones(4, 2),
        [1.0, 1.0],
    )
    torch.testing.assert_close(got[:, 0], torch.tensor([0.0, 0.0, -1.3228757, 1.3228757]), rtol=1e-5, atol=1e-6)


otb = load_recipe("otb")


def random_token_stats(seed, mask, holes=True):
    """Per token: the old logprob of a token drawn from a random 5-way distribution, that distribution's
    sum_v pi_v^2 and a --rollout-is weight, junk (50, 9, 7) off the mask; with holes, a tool's tokens cut into
    the longer responses."""
    g = torch.Generator().manual_seed(100 + seed)
    if holes:
        mask = mask.clone()
        mask[mask.sum(-1) >= 4, 2] = 0
    probs = torch.softmax(torch.randn(*mask.shape, 5, generator=g, dtype=torch.float64) * 2, -1)
    drawn = torch.multinomial(probs.reshape(-1, 5), 1, generator=g).reshape(mask.shape)
    old = probs.gather(-1, drawn[..., None]).squeeze(-1).log()
    weights = torch.rand(mask.shape, generator=g, dtype=torch.float64) * 2
    junk = lambda x, value: torch.where(mask > 0, x, torch.full_like(x, value))  # noqa: E731
    return mask, junk(old, 50.0), junk(probs.square().sum(-1), 9.0), junk(weights, 7.0)


def otb_reference(r, g, mask, old, pi2, weights):
    """r_i - b_t at the t-th of row i's own tokens, b_t = sum_i r_i W_i,t / (sum_i W_i,t + 1e-8) over the group's
    rows that have a t-th token, W_i,t = sum of (1 - 2 exp(old) + pi2) * weight^2 over its first t + 1 tokens;
    b_t = 0 where one row alone has a t-th token. Returns (B, T) lists."""
    own = [[t for t in range(mask.shape[1]) if mask[i, t] > 0] for i in range(len(r))]
    energy = []
    for i, places in enumerate(own):
        total, row = 0.0, []
        for t in places:
            total += (1 - 2 * math.exp(old[i, t].item()) + pi2[i, t].item()) * weights[i, t].item() ** 2
            row.append(total)
        energy.append(row)
    want = [[0.0] * mask.shape[1] for _ in r]
    for i, places in enumerate(own):
        members = [j for j in range(len(r)) if g[j] == g[i]]
        for k, t in enumerate(places):
            reach = [j for j in members if len(own[j]) > k]
            num = sum(r[j] * energy[j][k] for j in reach)
            b = num / (sum(energy[j][k] for j in reach) + 1e-8) if len(reach) > 1 else 0.0
            want[i][t] = r[i] - b
    return want


@pytest.mark.parametrize("seed", SEEDS)
def test_otb_advantage_equals_its_formula(seed):
    rewards, groups, mask = random_groups(seed)
    mask, old, pi2, weights = random_token_stats(seed, mask)
    want = torch.tensor(otb_reference(rewards.tolist(), groups.tolist(), mask, old, pi2, weights), dtype=torch.float64)
    got = otb.compute_advantages(rewards, groups, mask, old, pi2, weights)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.all(got[mask == 0] == 0)


def verl_otb(r, g, mask, old, pi2):
    """verl's optimal_token_baseline as its documentation and code describe it, for responses without holes: b_t
    over the columns, a group of one with no baseline, and handle_zero_tail (on): where the longest response is
    unique and longer than the second, its baseline from the second's length on is 0."""
    w = ((1 - 2 * old.exp() + pi2) * mask).cumsum(-1)
    baseline = torch.zeros_like(w)
    for group in set(g):
        rows = [i for i in range(len(r)) if g[i] == group]
        if len(rows) == 1:
            continue
        m, wg = mask[rows], w[rows]
        returns = torch.tensor([r[i] for i in rows], dtype=torch.float64)[:, None] * m
        baseline[rows] = ((returns * wg * m).sum(0) / ((wg * m).sum(0) + 1e-8)).expand(len(rows), -1)
        lengths = sorted(int(x) for x in m.sum(-1))
        if lengths.count(lengths[-1]) == 1 and lengths[-1] > lengths[-2]:
            longest = rows[int(m.sum(-1).argmax())]
            baseline[longest, lengths[-2] :] = 0.0
    return (torch.tensor(r, dtype=torch.float64)[:, None] - baseline) * mask


@pytest.mark.parametrize("seed", SEEDS)
def test_otb_equals_verls_column_baseline_without_tool_turns(seed):
    """Without holes a token's place is its column, and "b = 0 where one row alone has a t-th token" is verl's
    group-of-one rule and handle_zero_tail: verl's two estimators and this recipe agree."""
    rewards, groups, mask = random_groups(seed)
    mask, old, pi2, _ = random_token_stats(seed, mask, holes=False)
    got = otb.compute_advantages(rewards, groups, mask, old, pi2, torch.ones_like(mask))
    want = verl_otb(rewards.tolist(), groups.tolist(), mask, old, pi2)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_otb_by_hand():
    """Two responses of lengths 2 and 1, rewards 1 and 0, every token with pi_j = 0.5 and sum_v pi_v^2 = 0.5, so each
    token adds 1 - 1 + 0.5 = 0.5 to W: at t = 0 both have W = 0.5 and b = 0.5; at t = 1 the first is alone: b = 0."""
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    half = torch.full((2, 2), 0.5)
    got = otb.compute_advantages(
        torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask, half.log(), half, torch.ones(2, 2)
    )
    torch.testing.assert_close(got, torch.tensor([[0.5, 1.0], [-0.5, 0.0]]))
