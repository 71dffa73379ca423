"""Known-answer tests for PPO's algorithm functions: GAE, the clipped value loss, the KL in the reward."""

import inspect
import statistics

import pytest
import torch
from conftest import load_recipe, make_args

ppo = load_recipe("ppo")
compute_gae, compute_value_loss, apply_kl_penalty = ppo.compute_gae, ppo.compute_value_loss, ppo.apply_kl_penalty


def close(got, want):
    torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype), rtol=0, atol=1e-6)


def test_gae_by_hand_with_padding_gamma_and_lambda():
    gamma, lam = 0.9, 0.8  # gamma * lam = 0.72
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0], [1.0, 5.0, 0.5, 0.25]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])  # row 0 right-padded; row 1 has a hole at t=1
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    # Row 0, backward: t=3 is padding (skipped); t=2: delta = 1 - 0.7 = 0.3, A = 0.3;
    # t=1: delta = 0.9 * 0.7 - 0.6 = 0.03, A = 0.03 + 0.72 * 0.3 = 0.246;
    # t=0: delta = 0.9 * 0.6 - 0.5 = 0.04, A = 0.04 + 0.72 * 0.246 = 0.21712.
    # Row 1: t=3: delta = 2 - 0.25 = 1.75; t=2: delta = 0.9 * 0.25 - 0.5 = -0.275, A = -0.275 + 0.72 * 1.75
    # = 0.985; t=1 padding passes V = 0.5 and A = 0.985 through; t=0: delta = 0.9 * 0.5 - 1 = -0.55,
    # A = -0.55 + 0.72 * 0.985 = 0.1592.
    raw = [[0.21712, 0.246, 0.3, None], [0.1592, None, 0.985, 1.75]]
    want_ret = [[0.71712, 0.846, 1.0, 0.0], [1.1592, 0.0, 1.485, 2.0]]  # A + V, zero on padding
    close(ret, want_ret)
    valid = [a for row in raw for a in row if a is not None]
    mean, std = statistics.mean(valid), statistics.stdev(valid)  # unbiased, as masked_whiten
    for i, row in enumerate(raw):
        for t, a in enumerate(row):
            want = 0.0 if a is None else (a - mean) / std
            assert adv[i, t].item() == pytest.approx(want, abs=1e-5), (i, t)


def test_gae_limits_monte_carlo_and_td():
    rewards = torch.tensor([[0.5, 0.0, 1.0]])
    values = torch.tensor([[0.3, -0.2, 0.4]])
    mask = torch.ones(1, 3)
    _, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    close(ret, [[1.5, 1.0, 1.0]])  # the reward-to-go, whatever the values
    _, ret = compute_gae(rewards, values, mask, gamma=0.5, lam=0.0)
    close(ret, [[0.5 + 0.5 * -0.2, 0.0 + 0.5 * 0.4, 1.0]])  # one-step TD targets


def value_loss_case():
    new = torch.tensor([[1.0, 0.0, 2.0, 0.2, 10.0]])
    old = torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0]])
    ret = torch.tensor([[2.0, -1.0, 1.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return new, old, ret, mask


def test_value_loss_clips_on_both_sides():
    new, old, ret, mask = value_loss_case()
    loss, clipfrac = compute_value_loss(new, old, ret, mask, 0.5, "token-mean")
    # token 0: v moved up past old + 0.5: clipped 0.5, errors (1-2)^2 = 1 and (0.5-2)^2 = 2.25 -> 2.25
    # token 1: v moved down past old - 0.5: clipped 0.5, errors (0+1)^2 = 1 and (0.5+1)^2 = 2.25 -> 2.25
    # token 2: clipped 1.5, errors (2-1)^2 = 1 and (1.5-1)^2 = 0.25 -> the unclipped 1 is larger
    # token 3: within the range, 0.8^2 = 0.64 both; token 4 is padding
    per_token = [2.25, 2.25, 1.0, 0.64]
    assert loss.item() == pytest.approx(0.5 * sum(per_token) / 4)
    assert clipfrac.item() == pytest.approx(2 / 4)
    # the mini-batch's count, not this micro-batch's, is the denominator
    loss8, _ = compute_value_loss(new, old, ret, mask, 0.5, "token-mean", num_tokens=8)
    assert loss8.item() == pytest.approx(0.5 * sum(per_token) / 8)
    # where the clipped error wins, the value gets no gradient (it sits outside the trust region)
    new.requires_grad_(True)
    compute_value_loss(new, old, ret, mask, 0.5, "token-mean")[0].backward()
    assert new.grad[0, :2].tolist() == [0.0, 0.0]
    assert new.grad[0, 2].item() == pytest.approx(0.5 * 2 * (2.0 - 1.0) / 4)
    assert new.grad[0, 4].item() == 0.0


def test_value_loss_sequence_aggregation():
    new, old, ret, mask = value_loss_case()
    two = [torch.cat([x, x[:, [1, 0, 2, 3, 4]] * torch.tensor([[1, 1, 1, 1, 0]])]) for x in (new, old, ret)]
    mask2 = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    loss, _ = compute_value_loss(*two, mask2, 0.5, "seq-mean-token-mean")
    # row 0: mean(2.25, 2.25, 1, 0.64) = 1.535; row 1 holds tokens 1 and 0: mean(2.25, 2.25) = 2.25
    assert loss.item() == pytest.approx(0.5 * (1.535 + 2.25) / 2)
    loss, _ = compute_value_loss(*two, mask2, 0.5, "seq-mean-token-sum")
    assert loss.item() == pytest.approx(0.5 * (6.14 + 4.5) / 2)


def kl_args(**over):
    """ppo's Args with the KL in the reward on and these KL knobs."""
    knobs = {"use_kl_in_reward": True, "kl_penalty": "kl", "kl_ctrl": "fixed", **over}
    if (
        knobs["kl_ctrl"] == "adaptive"
    ):  # target_kl and horizon only the adaptive controller reads (Args refuses them else)
        knobs = {"target_kl": 0.1, "horizon": 100, **knobs}
    return make_args(ppo.Args, **knobs)


def penalty(args, scores, old_logprobs, ref_logprobs, mask, kl_coef):
    """apply_kl_penalty with the knobs of args and the coefficient kl_coef, as the recipe's main passes them.
    Returns (token rewards, the coefficient of the next step, metrics)."""
    state = {"kl_coef": kl_coef}
    rewards, metrics = apply_kl_penalty(scores, old_logprobs, ref_logprobs, None, mask, state, args)
    return rewards, state["kl_coef"], metrics


def test_token_rewards_score_on_the_last_token_minus_the_kl():
    scores = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).float()
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, -1.0, -9.0], [-0.5, -1.0, -9.0, -9.0]])
    rewards, coef, metrics = penalty(kl_args(use_kl_in_reward=False), scores, old, ref, mask, 0.1)
    assert rewards.tolist() == [[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]] and coef == 0.1 and metrics == {}
    rewards, coef, metrics = penalty(kl_args(), scores, old, ref, mask, 0.1)
    # k1 = old - ref per valid token: row 0 [0.5, 0, 0.5], row 1 [-0.5, 0]; padding gets no penalty
    close(rewards, [[-0.05, 0.0, 1.0 - 0.05, 0.0], [0.05, 0.0, 0.0, 0.0]])
    seq_kl = (1.0 / 3 + -0.5 / 2) / 2  # the mean over sequences of each sequence's mean KL
    assert metrics["reward/kl_penalty"] == pytest.approx(seq_kl) and metrics["policy/kl_coef"] == 0.1
    assert coef == 0.1  # fixed
    # adaptive: coef * (1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon), n = sequences in the step
    _, coef, _ = penalty(kl_args(kl_ctrl="adaptive", target_kl=0.04), scores, old, ref, mask, 0.1)
    assert coef == pytest.approx(0.1 * (1 + (seq_kl / 0.04 - 1) * 2 / 100))  # kl / target - 1 = 0.042
    _, coef, _ = penalty(kl_args(kl_ctrl="adaptive", target_kl=0.01), scores, old, ref, mask, 0.1)
    assert coef == pytest.approx(0.1 * (1 + 0.2 * 2 / 100))  # clipped at +0.2
    _, coef, _ = penalty(kl_args(kl_ctrl="adaptive", target_kl=1.0), scores, old, ref, mask, 0.1)
    assert coef == pytest.approx(0.1 * (1 - 0.2 * 2 / 100))  # clipped at -0.2


def test_the_score_lands_on_the_last_sampled_token_of_a_multi_turn_mask():
    """A conversation's mask has holes where the tool answered: the outcome goes on the policy's
    last token (index 5), not at the mask's length (index 3, a tool token GAE passes over)."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]]).float()
    zeros = torch.zeros_like(mask)
    rewards, _, _ = penalty(kl_args(use_kl_in_reward=False), torch.tensor([2.0]), zeros, zeros, mask, 0.1)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0]]
    _, returns = compute_gae(rewards, zeros, mask, gamma=1.0, lam=1.0)
    assert returns.tolist() == [[2.0, 2.0, 0.0, 0.0, 2.0, 2.0, 0.0]]  # every sampled token sees the score


def test_kl_in_reward_and_in_loss_are_refused_together():
    with pytest.raises(ValueError, match="put the KL in one place"):
        ppo.Args(use_kl_loss=True)
    args = ppo.Args(use_kl_loss=True, use_kl_in_reward=False)
    assert args.use_kl_loss and not args.use_kl_in_reward


def test_policy_loss_is_grpos_word_for_word():
    grpo = load_recipe("grpo")
    assert inspect.getsource(ppo.compute_loss) == inspect.getsource(grpo.compute_loss)


def test_critic_values_at_the_policys_positions_with_the_shared_prompt():
    """common.critic.response_values: the value for response token t is the critic's output at the
    position that predicts t (the one-pass reference below); the shared-prompt forward agrees."""
    from conftest import TINY

    from common.critic import load_critic, response_values
    from common.data import pack_sequences
    from common.model import ModelArgs
    from common.parallel import Dist

    torch.manual_seed(0)
    policy = ModelArgs(path=str(TINY), strategy="ddp", use_remove_padding=False)
    critic = load_critic(policy, dist=Dist(0, 1, 0, torch.device("cpu")))
    prompts, responses = [[1, 2, 3, 4]] * 2 + [[5, 6]] * 2, [[7, 8, 9], [10], [11, 12], [13, 14, 15, 16]]
    batch = pack_sequences(prompts, responses, pad_id=0)
    batch["group_ids"] = torch.tensor([0, 0, 1, 1])
    mask = batch["response_mask"]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        alone = critic(input_ids=torch.tensor([p + r])).logits[0, :, 0]  # (len(p) + len(r),)
        want = alone[len(p) - 1 : len(p) + len(r) - 1]  # position len(p) - 1 + t predicts token t
        for shared in (True, False):
            got = response_values(critic, batch, share_prompts=shared)[i, : len(r)]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert response_values(critic, batch).shape == mask.shape
