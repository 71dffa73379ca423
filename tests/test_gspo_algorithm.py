"""Known-answer tests for GSPO's sequence-level ratio and clip (recipes/gspo.py compute_loss)."""

import math

import pytest
import torch
from conftest import load_recipe, make_args

gspo = load_recipe("gspo")


def compute_loss(new, old, adv, mask, loss_agg_mode="token-mean", **knobs):
    """gspo.compute_loss with agg_loss's mode and the Args of these knobs, its terms summed as update sums them."""
    terms, metrics = gspo.compute_loss(new, old, adv, mask, dict(mode=loss_agg_mode), make_args(gspo.Args, **knobs))
    return sum(terms.values()), metrics


# Two sequences of 3 and 2 valid tokens; the padding logprobs are wild on purpose: they must not count.
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, 0.0]])
DELTA = torch.tensor([[0.1, 0.2, 0.3], [-0.3, -0.1, 50.0]])  # new - old: sequence means 0.2 and -0.2
NEW = OLD + DELTA
S = [math.exp(0.2), math.exp(-0.2)]  # the sequence ratios s_i, 1.2214 and 0.8187


def loss_args(**over):
    args = dict(clip_ratio_low=0.1, clip_ratio_high=0.1, clip_ratio_c=3.0, loss_agg_mode="seq-mean-token-mean")
    return {**args, **over}


def advantages(a0, a1):
    return torch.tensor([[a0] * 3, [a1] * 3]) * MASK


def test_defaults_are_the_papers():
    args = gspo.Args()
    assert (args.clip_ratio_low, args.clip_ratio_high) == (3e-4, 4e-4)
    assert args.loss_agg_mode == "seq-mean-token-mean"


def test_sequence_ratio_clipped_on_both_sides():
    # seq 0: A = +1, s = 1.2214 > 1.1 -> clipped to -1.1; seq 1: A = -1, s = 0.8187 < 0.9 -> clipped to 0.9
    loss, m = compute_loss(NEW, OLD, advantages(1.0, -1.0), MASK, **loss_args())
    assert loss.item() == pytest.approx((-1.1 + 0.9) / 2)  # mean over sequences of each sequence's loss
    assert m["policy/clipfrac"].item() == pytest.approx(1.0)  # every valid token sits in a clipped sequence
    assert m["policy/approx_kl"].item() == pytest.approx(-(0.1 + 0.2 + 0.3 - 0.3 - 0.1) / 5)  # per token
    # token-mean counts each sequence's loss once per valid token: (3 * -1.1 + 2 * 0.9) / 5
    loss_tok, _ = compute_loss(NEW, OLD, advantages(1.0, -1.0), MASK, **loss_args(loss_agg_mode="token-mean"))
    assert loss_tok.item() == pytest.approx((3 * -1.1 + 2 * 0.9) / 5)
    # the paper's ranges clip both: 1 + 4e-4 and 1 - 3e-4
    loss_paper, _ = compute_loss(
        NEW, OLD, advantages(1.0, -1.0), MASK, **loss_args(clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    )
    assert loss_paper.item() == pytest.approx((-(1 + 4e-4) + (1 - 3e-4)) / 2, abs=1e-7)  # float32


def test_unclipped_side_keeps_the_sequence_ratio():
    # seq 0: A = -1, s = 1.2214: max(1.2214, 1.1) = 1.2214; seq 1: A = +1, s = 0.8187: max(-0.8187, -0.9)
    loss, m = compute_loss(NEW, OLD, advantages(-1.0, 1.0), MASK, **loss_args())
    assert loss.item() == pytest.approx((S[0] - S[1]) / 2)
    assert m["policy/clipfrac"].item() == 0.0


def test_gradient_is_the_gspo_token_forms():
    """d loss / d new_t = -A_i * s_i / |y_i| / (number of sequences) on valid tokens, 0 on padding;
    the same as the GSPO-token form sg[s_i] * exp(new_t - sg[new_t]) gives, for any aggregation."""
    adv = advantages(-1.0, 1.0)  # unclipped: the gradient flows
    for mode in ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum"):
        new = NEW.clone().requires_grad_(True)
        compute_loss(new, OLD, adv, MASK, **loss_args(loss_agg_mode=mode))[0].backward()
        token_form = NEW.clone().requires_grad_(True)
        s = torch.tensor(S).unsqueeze(-1) * torch.exp(token_form - token_form.detach())
        pg = torch.maximum(-adv * s, -adv * torch.clamp(s, 0.9, 1.1))
        gspo.agg_loss(pg, MASK, mode).backward()
        assert torch.allclose(new.grad, token_form.grad, atol=1e-6), mode
    new = NEW.clone().requires_grad_(True)
    compute_loss(new, OLD, adv, MASK, **loss_args())[0].backward()
    want = torch.tensor([[S[0] / 3 / 2] * 3, [-S[1] / 2 / 2] * 2 + [0.0]])
    assert torch.allclose(new.grad, want, atol=1e-6)


def test_empty_sequence_has_ratio_one_and_dual_clip_bounds_bad_samples():
    mask = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    new, old = torch.log(torch.tensor([[9.0, 9.0], [4.0, 4.0]])), torch.zeros(2, 2)  # seq 1: s = 4
    adv = torch.tensor([[0.0, 0.0], [-1.0, -1.0]])
    loss, m = compute_loss(new, old, adv, mask, **loss_args())
    # seq 1: max(4, 1.1) = 4, bounded by dual-clip at clip_ratio_c = 3; the empty sequence counts nowhere
    assert loss.item() == pytest.approx(3.0)
    assert m["policy/clipfrac_dual"].item() == pytest.approx(1.0)
    assert not torch.isnan(loss)
