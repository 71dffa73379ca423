"""Known-answer tests for GRPO's algorithm functions and the shared KL / aggregation ops."""

import math

import pytest
import torch
from conftest import load_recipe, make_args

from common.ops import agg_loss, kl_penalty

grpo = load_recipe("grpo")
compute_advantages = grpo.compute_advantages


def compute_loss(new, old, adv, mask, loss_agg_mode="token-mean", num_tokens=None, entropy=None, kl=None, **knobs):
    """grpo.compute_loss with agg_loss's mode and token count and the Args of these knobs, its terms summed as
    update sums them."""
    agg, args = dict(mode=loss_agg_mode, num_tokens=num_tokens), make_args(grpo.Args, **knobs)
    terms, metrics = grpo.compute_loss(new, old, adv, mask, agg, args, entropy, kl)
    return sum(terms.values()), metrics


def test_advantages_group_standardised_with_unbiased_std():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 5.0])
    groups = torch.tensor([0, 0, 0, 1, 2])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    adv = compute_advantages(rewards, groups, mask, eps=0.0)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 1]: mean 2/3, sum sq dev 2/3, / (n-1)
    assert adv[0, 0].item() == pytest.approx((1 - 2 / 3) / std)
    assert adv[1, 0].item() == pytest.approx((0 - 2 / 3) / std)
    assert adv[0, 2].item() == 0.0 and adv[1, 1].item() == 0.0  # padding
    # groups of one: mean 0, std 1
    assert adv[3, 0].item() == pytest.approx(1.0) and adv[4, 0].item() == pytest.approx(5.0)
    assert torch.allclose(adv[2], torch.full((3,), (1 - 2 / 3) / std))


def test_advantages_eps_on_std_and_dr_grpo():
    rewards, groups, mask = torch.tensor([2.0, 2.0, 4.0, 0.0]), torch.tensor([0, 0, 1, 1]), torch.ones(4, 2)
    adv = compute_advantages(rewards, groups, mask, eps=1e-6)
    assert torch.all(adv[:2] == 0)  # equal rewards: zero advantage, no division blow-up
    assert adv[2, 0].item() == pytest.approx(2 / (math.sqrt(8) + 1e-6))
    dr = compute_advantages(rewards, groups, mask, norm_by_std=False)
    assert dr[:, 0].tolist() == [0.0, 0.0, 2.0, -2.0]


def loss_args(**over):
    args = dict(clip_ratio=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean")
    return {**args, **over}


def test_loss_clip_branches_and_metrics():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.5]]))  # ratios
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, m = compute_loss(new, old, adv, mask, **loss_args())
    # per token: +A clipped at 1.2 -> -1.2; -A with ratio .5 -> max(.5, .8) = .8; 1.1 unclipped -> -1.1;
    # -A with ratio 1.5 -> max(1.5, 1.2) = 1.5
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 1.1 + 1.5) / 4)
    assert m["policy/clipfrac"].item() == pytest.approx(2 / 4)  # tokens 0 and 1 took the clipped value
    assert m["policy/approx_kl"].item() == pytest.approx(-new.mean().item())
    # clip-higher: a wider upper bound lets token 0 keep ratio 1.5
    loss_hi, _ = compute_loss(new, old, adv, mask, **loss_args(clip_ratio_high=0.6))
    assert loss_hi.item() == pytest.approx((-1.5 + 0.8 - 1.1 + 1.5) / 4)


def test_dual_clip_bounds_negative_advantages():
    new, old = torch.log(torch.tensor([[10.0, 10.0]])), torch.zeros(1, 2)
    adv, mask = torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2)
    loss, m = compute_loss(new, old, adv, mask, **loss_args())
    # A<0, ratio 10: max(10, 1.2) = 10, dual-clip caps it at 3; A>0: -1.2
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)
    assert m["policy/clipfrac_dual"].item() == pytest.approx(0.5)
    # the dual clip passes no gradient through the capped token
    new.requires_grad_(True)
    loss, _ = compute_loss(new, old, adv, mask, **loss_args())
    loss.backward()
    assert new.grad[0, 0].item() == 0.0


def test_log_ratio_clamped_before_exp():
    new, old = torch.tensor([[100.0]]), torch.tensor([[0.0]])
    loss, m = compute_loss(new, old, torch.tensor([[-1.0]]), torch.ones(1, 1), **loss_args(clip_ratio_c=1e12))
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(math.exp(20), rel=1e-5)


def test_kl_and_entropy_terms():
    new = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    ent = torch.tensor([[0.3, 0.7]])
    mask, adv = torch.ones(1, 2), torch.zeros(1, 2)
    base, _ = compute_loss(new, new, adv, mask, **loss_args())
    loss, m = compute_loss(
        new,
        new,
        adv,
        mask,
        **loss_args(),
        kl=kl_penalty(new, ref, "k1"),
        use_kl_loss=True,
        kl_loss_coef=0.5,
        entropy=ent,
        entropy_coeff=0.1,
    )
    assert base.item() == 0.0
    assert loss.item() == pytest.approx(0.5 * ((0.5 - 1.0) / 2) - 0.1 * 0.5)
    assert m["policy/kl_ref"].item() == pytest.approx(-0.25) and m["policy/entropy"].item() == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("kl", [0.5, -1.0]),
        ("k1", [0.5, -1.0]),
        ("abs", [0.5, 1.0]),
        ("mse", [0.125, 0.5]),
        ("k2", [0.125, 0.5]),
        ("low_var_kl", [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]),
        ("k3", [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]),
    ],
)
def test_kl_penalty_kinds(kind, expected):
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert kl_penalty(logp, ref, kind).tolist() == pytest.approx(expected)


def test_low_var_kl_clamps():
    out = kl_penalty(torch.tensor([-100.0, 0.0]), torch.tensor([0.0, -100.0]), "low_var_kl")
    # log-ratios +-100 are clamped to +-20 before exp (finite), and both results are capped at 10
    assert out.tolist() == pytest.approx([10.0, 10.0])
    mild = kl_penalty(torch.tensor([-2.0]), torch.tensor([0.0]), "low_var_kl")
    assert mild.item() == pytest.approx(math.exp(2.0) - 2.0 - 1)  # below the cap: unchanged
    with pytest.raises(ValueError):
        kl_penalty(out, out, "k4")


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])  # the last sequence is empty


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 4 + 5 + 6) / 5),
        ("seq-mean-token-sum", (3 + 15) / 2),
        ("seq-mean-token-mean", (1.5 + 5) / 2),
        ("seq-mean-token-sum-norm", (3 + 15) / 2 / 3),
    ],
)
def test_agg_loss_modes_leave_empty_sequences_out(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_agg_loss_split_with_global_counts_equals_one_pass(mode):
    torch.manual_seed(0)
    loss, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.4).float()
    mask[2] = 0
    whole = agg_loss(loss, mask, mode)
    counts = dict(num_tokens=mask.sum(), num_seqs=(mask.sum(-1) > 0).sum(), norm_constant=5)
    parts = sum(agg_loss(loss[s], mask[s], mode, **counts) for s in (slice(0, 2), slice(2, 3), slice(3, 6)))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)
    assert agg_loss(loss[:2], mask[:2], "seq-mean-token-sum-norm", norm_constant=10).item() == pytest.approx(
        agg_loss(loss[:2], mask[:2], "seq-mean-token-sum").item() / 10
    )


def test_is_weights_on_the_advantage_weight_each_tokens_loss():
    """Rollout correction scales each token's advantage by its positive weight; that must equal
    scaling each token's loss (verl weights the loss), on the clipped, unclipped and dual-clipped
    branches alike, in value and gradient."""
    old = torch.zeros(1, 5)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, -2.0]])
    weights = torch.tensor([[0.5, 2.0, 1.3, 0.1, 1.7]])
    mask = torch.ones(1, 5)

    def loss_and_grad(per_token):
        new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.5, 10.0]])).requires_grad_(True)  # clip, clip, none, none, dual
        per_token(new).backward()
        return new.grad.clone(), per_token(new.detach()).item()

    weighted_adv = loss_and_grad(lambda new: compute_loss(new, old, adv * weights, mask, **loss_args())[0])
    weighted_loss = loss_and_grad(
        lambda new: sum(
            weights[0, t]
            * compute_loss(
                new[:, t : t + 1], old[:, t : t + 1], adv[:, t : t + 1], mask[:, t : t + 1], **loss_args(), num_tokens=5
            )[0]
            for t in range(5)
        )
    )
    assert weighted_adv[1] == pytest.approx(weighted_loss[1])
    assert torch.allclose(weighted_adv[0], weighted_loss[0])
    assert weighted_adv[0][0, 4] == 0  # the dual clip held on the last token
