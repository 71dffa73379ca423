"""Known-answer tests for REINFORCE++'s algorithm functions: token rewards with the KL in them, the
discounted reward-to-go, the group baseline and the whitening over every rank's valid tokens."""

import math
import threading

import pytest
import torch
from conftest import load_recipe, make_args

from common.ops import masked_whiten

rpp = load_recipe("reinforce_pp")
compute_advantages, apply_kl_penalty = rpp.compute_advantages, rpp.apply_kl_penalty


def whitened(values):
    """(v - mean) / sqrt(unbiased var + 1e-8) of a plain list, written out by hand."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_discounted_reward_to_go_whitened_with_unbiased_variance():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = compute_advantages(rewards, mask, gamma=0.5)
    # returns: row 0 [0.25, 0.5, 1], row 1 [1, 2, pad]; valid values 0.25 0.5 1 1 2, mean 0.95,
    # squared deviations sum 1.8, unbiased var 1.8 / 4 = 0.45
    expected = whitened([0.25, 0.5, 1.0, 1.0, 2.0])
    assert expected[0] == pytest.approx((0.25 - 0.95) / math.sqrt(0.45))
    assert adv[mask.bool()].tolist() == pytest.approx(expected, rel=1e-5)
    assert adv[1, 2].item() == 0.0  # padding
    biased = (0.25 - 0.95) / math.sqrt(1.8 / 5)
    assert adv[0, 0].item() != pytest.approx(biased, rel=1e-3)  # the variance is the unbiased one


def test_gamma_one_gives_suffix_sums_and_padding_rewards_are_ignored():
    # a KL penalty on every token and the score on the last valid one; junk on the padding
    rewards = torch.tensor([[-0.1, -0.2, 1.0, 9.0], [0.3, -0.5, 9.0, 9.0], [2.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
    adv = compute_advantages(rewards, mask, gamma=1.0)
    returns = [-0.1 - 0.2 + 1.0, -0.2 + 1.0, 1.0, 0.3 - 0.5, -0.5, 2.0]
    assert adv[mask.bool()].tolist() == pytest.approx(whitened(returns), rel=1e-5)
    assert adv[~mask.bool()].abs().sum().item() == 0.0


def test_group_baseline_broadcast_then_whitened():
    rewards = torch.tensor([[0.1, 0.9, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])  # sums 1, 0, 3
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    groups = torch.tensor([0, 0, 1])
    adv = compute_advantages(rewards, mask, gamma=1.0, group_ids=groups)
    # group 0 mean 0.5: +0.5 and -0.5; group 1 is alone and keeps its sum 3; no std division
    per_token = [0.5, 0.5, -0.5, 3.0, 3.0, 3.0]
    assert adv[mask.bool()].tolist() == pytest.approx(whitened(per_token), rel=1e-5)
    assert adv[0, 2].item() == 0.0
    # the baseline variant ignores gamma (verl): the score is the plain sum of the token rewards
    assert torch.equal(compute_advantages(rewards, mask, gamma=0.5, group_ids=groups), adv)


def test_rollout_n_one_and_tiny_batches():
    rewards, mask = torch.tensor([[1.0, 0.0], [0.0, 3.0]]), torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    adv = compute_advantages(rewards, mask, gamma=1.0, group_ids=torch.tensor([0, 1]))  # groups of one
    assert adv[mask.bool()].tolist() == pytest.approx(whitened([1.0, 3.0, 3.0]), rel=1e-5)
    # a single valid token (and an empty batch) whiten to 0, never NaN
    one = compute_advantages(torch.tensor([[5.0, 0.0]]), torch.tensor([[1.0, 0.0]]), gamma=1.0)
    assert one.tolist() == [[0.0, 0.0]]
    assert compute_advantages(torch.zeros(1, 2), torch.zeros(1, 2), gamma=1.0).tolist() == [[0.0, 0.0]]


def test_whitening_is_global_over_ranks(monkeypatch):
    """Two ranks holding halves of a batch whiten it exactly as one process holding all of it."""
    torch.manual_seed(0)
    rewards = torch.randn(6, 5)
    mask = (torch.arange(5) < torch.tensor([5, 2, 4, 1, 3, 5]).unsqueeze(-1)).float()  # right padding
    returns = torch.flip(torch.cumsum(torch.flip(rewards * mask, [1]), 1), [1]) * mask  # suffix sums, gamma 1
    expected = masked_whiten(returns, mask) * mask  # common.ops' single-process reference
    assert torch.allclose(compute_advantages(rewards, mask, gamma=1.0), expected, atol=1e-6)

    slots, barrier, local = [None, None], threading.Barrier(2), threading.local()

    def all_reduce_sum(value):  # what gloo's all_reduce does for two ranks
        slots[local.rank] = value.clone()
        barrier.wait()
        total = slots[0] + slots[1]
        barrier.wait()
        return total

    import common.ops

    monkeypatch.setattr(common.ops, "all_reduce_sum", all_reduce_sum)  # where masked_whiten_all_ranks looks it up

    out = [None, None]

    def rank_main(rank):
        local.rank = rank
        rows = slice(0, 2) if rank == 0 else slice(2, 6)  # unequal shares: the counts are all-reduced too
        out[rank] = compute_advantages(rewards[rows], mask[rows], gamma=1.0)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    assert torch.allclose(torch.cat(out), expected, atol=1e-6)
    # whitening each half alone would differ
    assert not torch.allclose(masked_whiten(returns[:2], mask[:2]) * mask[:2], expected[:2], atol=1e-3)


def kl_args(**over):
    """reinforce_pp's Args with the KL in the reward on and these KL knobs."""
    knobs = {"use_kl_in_reward": True, "kl_penalty": "kl", "kl_ctrl": "fixed", "target_kl": 0.1, "horizon": 10000}
    return make_args(rpp.Args, **{**knobs, **over})


def penalty(args, scores, old_logprobs, ref_logprobs, mask, kl_coef):
    """apply_kl_penalty with the knobs of args and the coefficient kl_coef, as the recipe's main passes them.
    Returns (token rewards, the coefficient of the next step, metrics)."""
    state = {"kl_coef": kl_coef}
    rewards, metrics = apply_kl_penalty(scores, old_logprobs, ref_logprobs, None, mask, state, args)
    return rewards, state["kl_coef"], metrics


OLD = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.0, 0.0], [-1.0, -1.0, -1.0]])
REF = torch.tensor([[-1.5, -1.0, -9.0], [-1.0, -1.0, -7.0], [0.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # the last response is empty


def test_token_rewards_score_on_the_last_valid_token():
    scores = torch.tensor([1.0, 2.0, 7.0])
    rewards, coef, metrics = penalty(kl_args(use_kl_in_reward=False), scores, None, None, MASK, 0.1)
    assert rewards.tolist() == [[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert coef == 0.1 and metrics == {}


def test_token_level_kl_in_the_reward_and_the_controller():
    scores = torch.tensor([1.0, 2.0, 7.0])
    rewards, coef, metrics = penalty(kl_args(), scores, OLD, REF, MASK, kl_coef=0.1)
    # k1 = old - ref: row 0 [0.5, -1.0, pad], row 1 [0.5, pad, pad]; the score sits on the last valid token
    expected = [[-0.05, 1.0 + 0.1, 0.0], [2.0 - 0.05, 0.0, 0.0], [0.0, 0.0, 0.0]]
    torch.testing.assert_close(rewards, torch.tensor(expected))
    # the step's KL: mean over sequences of each one's token mean, (-0.25 + 0.5 + 0) / 3
    assert metrics["reward/kl_penalty"] == pytest.approx(0.25 / 3) and metrics["policy/kl_coef"] == 0.1
    assert coef == 0.1
    # k3 estimator on row 1's one token: exp(-0.5) + 0.5 - 1
    rewards, _, _ = penalty(kl_args(kl_penalty="low_var_kl"), scores, OLD, REF, MASK, kl_coef=0.1)
    assert rewards[1, 0].item() == pytest.approx(2.0 - 0.1 * (math.exp(-0.5) + 0.5 - 1))
    # adaptive: kl 0.0833 against target 0.1 -> error -0.1667, 3 sequences over horizon 10
    _, coef, _ = penalty(kl_args(kl_ctrl="adaptive", horizon=10), scores, OLD, REF, MASK, kl_coef=0.1)
    assert coef == pytest.approx(0.1 * (1 + (0.25 / 3 / 0.1 - 1) * 3 / 10))


def test_kl_in_the_reward_is_the_default_and_refused_with_the_kl_loss():
    assert rpp.Args().use_kl_in_reward and rpp.Args().gamma == 1.0 and not rpp.Args().group_baseline
    with pytest.raises(ValueError, match="no-use-kl-in-reward"):
        rpp.Args(use_kl_loss=True)
    assert rpp.Args(use_kl_loss=True, use_kl_in_reward=False).use_kl_loss
