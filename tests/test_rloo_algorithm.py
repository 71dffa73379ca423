"""Known-answer tests for RLOO's algorithm functions: the leave-one-out advantage and the KL in the reward."""

import pytest
import torch
from conftest import load_recipe, make_args

rloo = load_recipe("rloo")
compute_advantages, apply_kl_penalty = rloo.compute_advantages, rloo.apply_kl_penalty


def test_leave_one_out_baseline_with_padding_and_a_group_of_one():
    rewards = torch.tensor([1.0, 0.0, 1.0, 2.0, 5.0, 4.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 2, 2])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    adv = compute_advantages(rewards, groups, mask)
    # group 0 = [1, 0, 1, 2]: each minus the mean of the other three
    expected = [1 - (0 + 1 + 2) / 3, 0 - (1 + 1 + 2) / 3, 1 - (1 + 0 + 2) / 3, 2 - (1 + 0 + 1) / 3]
    expected += [5.0]  # a group of one keeps its raw score
    expected += [4 - 0, 0 - 4]  # a pair: each minus the other
    for i, value in enumerate(expected):
        assert adv[i].tolist() == pytest.approx([value * m for m in mask[i].tolist()])
    assert adv[1, 1].item() == 0.0 and adv[0, 2].item() == 0.0  # padding
    assert adv.dtype == torch.float32 and adv.shape == mask.shape


def test_interleaved_groups_and_the_n_over_n_minus_1_identity():
    rewards = torch.tensor([3.0, 1.0, 0.0, 1.0, 2.0])
    groups = torch.tensor([7, 2, 7, 2, 7])  # group 7 = [3, 0, 2], group 2 = [1, 1]
    adv = compute_advantages(rewards, groups, torch.ones(5, 1))[:, 0]
    # r_i - mean(others) = n / (n - 1) * (r_i - mean(group)): group 7 has mean 5/3, n = 3
    assert adv.tolist() == pytest.approx([1.5 * (3 - 5 / 3), 0.0, 1.5 * (0 - 5 / 3), 0.0, 1.5 * (2 - 5 / 3)])
    # equal rewards in a group give zero advantage
    assert compute_advantages(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), torch.ones(2, 2)).abs().sum() == 0


def kl_args(**over):
    """rloo's Args with the KL in the reward on and these KL knobs."""
    knobs = {"use_kl_in_reward": True, "kl_penalty": "kl", "kl_ctrl": "fixed", "target_kl": 0.1, "horizon": 10000}
    return make_args(rloo.Args, **{**knobs, **over})


def penalty(args, scores, old_logprobs, ref_logprobs, mask, kl_coef):
    """apply_kl_penalty with the knobs of args and the coefficient kl_coef, as the recipe's main passes them.
    Returns (rewards, the coefficient of the next step, metrics)."""
    state = {"kl_coef": kl_coef}
    rewards, metrics = apply_kl_penalty(scores, old_logprobs, ref_logprobs, None, mask, state, args)
    return rewards, state["kl_coef"], metrics


OLD = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.0, 0.0]])
REF = torch.tensor([[-1.5, -1.0, -9.0], [-1.0, -1.0, -7.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_kl_in_reward_sums_the_valid_tokens():
    scores = torch.tensor([1.0, 0.0])
    rewards, coef, metrics = penalty(kl_args(), scores, OLD, REF, MASK, kl_coef=0.1)
    # k1 = old - ref on valid tokens: row 0 [0.5, -1.0] (sum -0.5), row 1 [0.5] (sum 0.5); padding ignored
    assert rewards.tolist() == pytest.approx([1.0 - 0.1 * -0.5, 0.0 - 0.1 * 0.5])
    assert coef == 0.1  # fixed controller
    # the step's KL: the mean over sequences of each one's token mean, (-0.25 + 0.5) / 2
    assert metrics["reward/kl_penalty"] == pytest.approx(0.125)
    assert metrics["policy/kl_coef"] == 0.1
    # other estimators: abs gives row sums 1.5 and 0.5
    rewards, _, _ = penalty(kl_args(kl_penalty="abs"), scores, OLD, REF, MASK, kl_coef=0.1)
    assert rewards.tolist() == pytest.approx([1.0 - 0.15, 0.0 - 0.05])


def test_adaptive_controller_moves_the_coefficient_after_the_step():
    scores = torch.tensor([1.0, 0.0])
    args = kl_args(kl_ctrl="adaptive", target_kl=0.1, horizon=10)
    rewards, coef, metrics = penalty(args, scores, OLD, REF, MASK, kl_coef=0.1)
    # kl 0.125 over target 0.1: error 0.25 clipped to 0.2; 2 sequences over horizon 10 -> * 1.04
    assert coef == pytest.approx(0.1 * (1 + 0.2 * 2 / 10))
    assert metrics["policy/kl_coef"] == 0.1  # the coefficient this step used
    assert rewards.tolist() == pytest.approx([1.05, -0.05])
    low = kl_args(kl_ctrl="adaptive", target_kl=1.0, horizon=10)
    _, coef, _ = penalty(low, scores, OLD, REF, MASK, kl_coef=0.1)
    assert coef == pytest.approx(0.1 * (1 - 0.2 * 2 / 10))  # kl far below target: error clipped to -0.2


def test_kl_off_leaves_the_scores_alone():
    scores = torch.tensor([1.0, 0.0])
    rewards, coef, metrics = penalty(kl_args(use_kl_in_reward=False), scores, None, None, MASK, 0.1)
    assert rewards is scores and coef == 0.1 and metrics == {}


def test_kl_in_reward_and_in_loss_are_refused_together():
    with pytest.raises(ValueError, match="not both"):
        rloo.Args(use_kl_in_reward=True, use_kl_loss=True)
    defaults = rloo.Args()
    assert not defaults.use_kl_in_reward  # as verl: no KL unless asked
    assert (defaults.kl_coef, defaults.kl_penalty, defaults.kl_ctrl, defaults.target_kl, defaults.horizon) == (
        0.001,
        "kl",
        "fixed",
        0.1,
        10000,
    )
