"""common.shaping.conditioning: ROLL's reward and advantage conditioning, each against its formula on
hand-computed values, every knob off leaving rewards and advantages untouched, and the flags'
checks. (Across ranks and through a resumed run: tests/test_rl_recipes.py.)"""

import functools
import json
import math

import pytest
import torch
from conftest import ROOT, load_recipe, make_args, torchrun_plan

from common.errors import UsageError
from common.ops import agg_loss
from common.rollout import load_rl_data
from common.shaping import ConditioningArgs, roll_terms
from common.shaping.conditioning import (
    RunningMoments,
    condition_advantages,
    condition_rewards,
    length_reward,
    topr_loss,
)


def batch_of(group_ids, lengths=None, difficulties=None):
    n = len(group_ids)
    lengths = lengths or [3] * n
    mask = torch.zeros(n, max(lengths))
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    rows = [({"data_source": "t", "difficulty": d}, None) for d in (difficulties or [None] * n)]
    return {"group_ids": torch.tensor(group_ids), "response_mask": mask, "rows": rows}


def knobs(**flags) -> ConditioningArgs:
    """The conditioning group with these knobs on (every other one off, its default)."""
    return ConditioningArgs(**flags)


def roll_loss(terms, metrics, new, old, adv, mask, agg, rewards, **flags):
    """common.shaping.conditioning.roll_terms with these knobs, its terms summed as update sums them."""
    from common.shaping.conditioning import roll_terms as reweigh

    return sum(reweigh(terms, metrics, new, old, adv, mask, agg, rewards, knobs(**flags)).values())


def test_running_moments_merge_batches_into_the_moments_of_all_values_and_round_trip_exactly():
    running = RunningMoments()
    assert running.std == 1.0  # nothing seen yet
    running.update(torch.tensor([1.0, 2.0]))
    running.update(torch.tensor([3.0, 4.0, 10.0]))
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    mean = sum(values) / 5
    assert running.mean == pytest.approx(mean, abs=1e-12)
    assert running.std == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in values) / 4), abs=1e-12)
    again = RunningMoments.from_state(json.loads(json.dumps(running.state())))  # as trainer_state.json keeps it
    assert again == running
    again.update(torch.tensor([7.0]))
    running.update(torch.tensor([7.0]))
    assert again == running


def test_length_reward_is_kimis():
    # lengths 2, 4, 6 in one group: lambda = 0.5, 0, -0.5; the wrong one keeps min(0, lambda)
    scores, lengths = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0]), torch.tensor([2, 4, 6, 2, 6, 5])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    bonus = length_reward(scores, lengths, groups)
    assert bonus[:3].tolist() == [0.5, 0.0, -0.5]
    assert bonus[3:5].tolist() == [0.0, -0.5]  # a short wrong answer gains nothing
    assert bonus[5].item() == 0.0  # one length: no spread


def test_every_knob_off_changes_nothing():
    rewards, batch = torch.tensor([1.0, 0.0, 2.0, 5.0]), batch_of([0, 0, 1, 1])
    assert condition_rewards(rewards, batch, {}, knobs()) is rewards
    advantages = torch.randn(4, 3)
    assert condition_advantages(advantages, batch["response_mask"], batch, knobs()) is advantages
    assert batch["conditioning"] == {}


def test_reward_norm_batch_group_shift_scale_against_their_formulas():
    r = torch.tensor([1.0, 3.0, 2.0, 2.0])
    batch = batch_of([0, 0, 1, 1])
    mean, std = 2.0, math.sqrt((1 + 1 + 0 + 0) / 3)
    got = condition_rewards(r, batch, {}, knobs(reward_norm="batch"))
    assert got.tolist() == pytest.approx([(v - mean) / (std + 1e-6) for v in r.tolist()], abs=1e-6)
    got = condition_rewards(r, batch, {}, knobs(reward_norm="batch", reward_shift=True))
    assert got.tolist() == pytest.approx([v - mean for v in r.tolist()], abs=1e-6)
    got = condition_rewards(r, batch, {}, knobs(reward_norm="batch", reward_scale=True))
    assert got.tolist() == pytest.approx([v / (std + 1e-6) for v in r.tolist()], abs=1e-6)
    # group: group 0 has mean 2, std sqrt(2); group 1 has no spread, so (r - mean) / (0 + eps) = 0
    got = condition_rewards(r, batch, {}, knobs(reward_norm="group"))
    assert got.tolist() == pytest.approx([-1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6), 0.0, 0.0], abs=1e-6)
    # a group of one keeps its reward (mean 0, std 1), as grpo.py's advantage treats it
    got = condition_rewards(torch.tensor([4.0, 1.0, 3.0]), batch_of([0, 1, 1]), {}, knobs(reward_norm="group"))
    assert got[0].item() == pytest.approx(4.0 / (1 + 1e-6))


def test_running_norm_uses_every_reward_so_far_this_step_included():
    state, batch = {}, batch_of([0, 0])  # the trainer state: its reward_stats are the running moments
    first = condition_rewards(torch.tensor([0.0, 2.0]), batch, state, knobs(reward_norm="running"))
    eps = torch.finfo(torch.float32).eps
    assert first.tolist() == pytest.approx([-1 / (math.sqrt(2) + eps), 1 / (math.sqrt(2) + eps)], abs=1e-6)
    second = condition_rewards(torch.tensor([4.0, 6.0]), batch, state, knobs(reward_norm="running"))
    seen = [0.0, 2.0, 4.0, 6.0]
    mean, std = 3.0, math.sqrt(sum((v - 3.0) ** 2 for v in seen) / 3)
    assert second.tolist() == pytest.approx([(4 - mean) / (std + eps), (6 - mean) / (std + eps)], abs=1e-6)
    assert RunningMoments.from_state(state["reward_stats"]).count == 4


def test_length_reward_whitening_and_clip_in_order():
    r = torch.tensor([1.0, 0.0, 1.0, 3.0])
    batch = batch_of([0, 0, 0, 1], lengths=[2, 4, 6, 3])
    got = condition_rewards(r, batch, {}, knobs(add_len_reward=True, len_reward_coef=2.0))
    assert got.tolist() == pytest.approx([1 + 2 * 0.5, 0.0, 1 - 2 * 0.5, 3.0])
    assert batch["conditioning"]["reward/len_reward_mean"] == pytest.approx(0.0)
    whitened = condition_rewards(r, batch_of([0, 0, 0, 1]), {}, knobs(whiten_rewards=True))
    mean, var = 1.25, sum((v - 1.25) ** 2 for v in r.tolist()) / 3
    assert whitened.tolist() == pytest.approx([(v - mean) / math.sqrt(var + 1e-8) for v in r.tolist()], abs=1e-6)
    batch = batch_of([0, 0, 0, 1])
    clipped = condition_rewards(r, batch, {}, knobs(reward_clip=1.5))
    assert clipped.tolist() == [1.0, 0.0, 1.0, 1.5] and batch["conditioning"]["reward/clip_frac"] == 0.25
    # both: clipped first, then whitened (ROLL clips in its reward post-processing, whitens in its advantage step)
    both = condition_rewards(r, batch_of([0, 0, 0, 1]), {}, knobs(reward_clip=1.5, whiten_rewards=True))
    c = [1.0, 0.0, 1.0, 1.5]
    mean, var = sum(c) / 4, sum((v - sum(c) / 4) ** 2 for v in c) / 3
    assert both.tolist() == pytest.approx([(v - mean) / math.sqrt(var + 1e-8) for v in c], abs=1e-6)


def test_advantage_whitening_clip_and_weights():
    batch = batch_of([0, 0, 1, 1], lengths=[1, 2, 3, 3], difficulties=[0.0, 1.0, 0.5, 2.0])
    mask = batch["response_mask"]
    advantages = torch.tensor([[1.0, 9, 9], [2, -2, 9], [3, 0, 1], [-4, 5, 0]]) * mask
    tokens = advantages[mask > 0]
    mean, var = tokens.mean().item(), tokens.var().item()
    whitened = condition_advantages(advantages, mask, batch, knobs(whiten_advantages=True))
    assert whitened[mask > 0].tolist() == pytest.approx(((tokens - mean) / math.sqrt(var + 1e-8)).tolist(), abs=1e-6)
    assert (whitened[mask == 0] == 0).all()
    clipped = condition_advantages(advantages, mask, batch, knobs(advantage_clip=2.5))
    assert clipped.tolist()[3][:2] == [-2.5, 2.5] and batch["conditioning"]["advantage/clip_frac"] == pytest.approx(
        3 / 9
    )
    # difficulty 0, 1, 0.5, 2 (clamped to 1): weights 0.5, 2, 1.25, 2, rescaled to mean 1
    weighted = condition_advantages(advantages, mask, batch, knobs(difficulty_loss_weight=True))
    w = torch.tensor([0.5, 2.0, 1.25, 2.0])
    torch.testing.assert_close(weighted, advantages * (w * 4 / w.sum()).unsqueeze(-1))
    # lengths 1, 2, 3, 3 scaled to 0, 0.5, 1, 1: weights 1.5, 1, 0.5, 0.5, rescaled to mean 1
    weighted = condition_advantages(advantages, mask, batch, knobs(length_loss_weight=True))
    w = torch.tensor([1.5, 1.0, 0.5, 0.5])
    torch.testing.assert_close(weighted, advantages * (w * 4 / w.sum()).unsqueeze(-1))
    assert batch["conditioning"]["advantage/weight_mean"] == pytest.approx(1.0)


def test_the_flags_are_checked_before_anything_loads():
    args = functools.partial(make_args, load_recipe("grpo").Args)  # flags are checked as they are parsed
    with pytest.raises(UsageError, match="--reward-shift True would change nothing in this run: add --reward-norm"):
        args(reward_shift=True)
    with pytest.raises(UsageError, match="--reward-shift with --reward-scale"):
        args(reward_norm="batch", reward_shift=True, reward_scale=True)
    with pytest.raises(UsageError, match="--len-reward-coef 2.0 would change nothing"):
        args(len_reward_coef=2.0)
    with pytest.raises(UsageError, match="--reward-clip 0.0: must be > 0"):
        args(reward_clip=0.0)
    args(reward_norm="running", reward_scale=True, reward_clip=5.0, add_len_reward=True)


def test_difficulty_weighting_needs_a_difficulty_on_every_training_row(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "t",
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "reward_model": {"style": "rule", "ground_truth": "1"},
            "extra_info": {"difficulty": 0.5},
        }
        for i in range(4)
    ]
    rows[2]["extra_info"] = {"index": 2}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    files = dict(train_files=(str(tmp_path / "train.parquet"),), val_files=())
    flags = dict(prompt_key="prompt", max_prompt_length=64, truncation="error", filter_overlong_prompts=False)

    def load(**conditioning):
        a = make_args(load_recipe("grpo").Args, **files, **flags, train_batch_size=2, **conditioning)
        return load_rl_data(a.data, tokenizer, a.reward, a.agent, a.env, a.conditioning)

    train, _, _ = load()
    assert [r["difficulty"] for r in train] == [0.5, 0.5, None, 0.5]
    with pytest.raises(UsageError, match=r"train.parquet row 2 column 'difficulty'.*got None"):
        load(difficulty_loss_weight=True)


TWO_RANKS = """
import json, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from test_conditioning import batch_of, conditioned

if not dist.is_initialized():  # a run before it in the same launch may have started the group
    dist.init_process_group("gloo")
rank = dist.get_rank()
with open(f"{sys.argv[2]}/rank{rank}.json", "w") as f:
    json.dump(conditioned(slice(0, 3) if rank == 0 else slice(3, 8)), f)
"""

REWARDS = [1.0, 0.0, 3.0, 2.0, 2.0, 5.0, 0.0, 1.0]
LENGTHS = [1, 2, 3, 3, 2, 1, 3, 2]


def conditioned(part: slice) -> dict:
    """This part of the batch conditioned twice (running moments over two steps), every statistic
    spanning ranks switched on; rank 0 holds 3 rows, rank 1 the other 5."""
    state, out = {}, {}  # the trainer state: its reward_stats are the running moments
    for step in range(2):
        batch = batch_of(list(range(8))[part], LENGTHS[part])
        rewards = torch.tensor(REWARDS[part]) * (step + 1)
        c = knobs(reward_norm="running", whiten_rewards=True, reward_clip=1.2)
        out[f"rewards{step}"] = condition_rewards(rewards, batch, state, c).tolist()
    advantages = torch.tensor(REWARDS[part]).unsqueeze(-1) * batch["response_mask"]
    c = knobs(whiten_advantages=True, advantage_clip=1.5, length_loss_weight=True)
    out["advantages"] = condition_advantages(advantages, batch["response_mask"], batch, c).tolist()
    out["batch"] = condition_rewards(torch.tensor(REWARDS[part]), batch, {}, knobs(reward_norm="batch")).tolist()
    out["metrics"] = batch["conditioning"]
    return out


def test_roll_loss_terms_against_rolls_composition():
    """roll_loss: rl_loss_coef * (pg + kl) + entropy + sft_loss_coef * the NLL of the responses that
    scored > 0, TOPR's loss in place of pg; with every knob off the group's loss is the terms' plain sum
    without consulting common.shaping.conditioning (a default run never loads it: tests/test_layers.py)."""
    new = torch.tensor([[-1.0, -2.0], [-0.5, -0.3]], requires_grad=True)
    old, adv, mask = (
        torch.tensor([[-1.2, -1.5], [-0.4, -0.6]]),
        torch.tensor([[1.0, 1.0], [-2.0, -2.0]]),
        torch.ones(2, 2),
    )
    rewards, agg = torch.tensor([1.0, 0.0]), {"mode": "token-mean"}

    def terms():
        return {"pg": (new * adv).mean(), "entropy": torch.tensor(-0.3), "kl": (new - old).mean() * 0.1}

    plain = terms()
    off = roll_terms(dict(plain), {}, new, old, adv, mask, agg, rewards, ConditioningArgs())
    assert sum(off.values()) == sum(plain.values())
    metrics = {}
    got = roll_loss(terms(), metrics, new, old, adv, mask, agg, rewards, rl_loss_coef=0.5, sft_loss_coef=2.0)
    nll = agg_loss(-new, mask * torch.tensor([[1.0], [0.0]]), mode="token-mean")
    want = 0.5 * (plain["pg"] + plain["kl"]) + plain["entropy"] + 2.0 * nll
    assert got.item() == pytest.approx(want.item()) and metrics["policy/sft_loss"].item() == pytest.approx(nll.item())
    topr = roll_loss(terms(), {}, new, old, adv, mask, agg, rewards, use_topr_loss=True)
    pg = agg_loss(topr_loss(new, old, adv, torch.tensor([[1.0], [0.0]])), mask, mode="token-mean")
    assert topr.item() == pytest.approx((pg + plain["entropy"] + plain["kl"]).item())
    on = sum(roll_terms(terms(), {}, new, old, adv, mask, agg, rewards, ConditioningArgs(use_topr_loss=True)).values())
    assert on.item() == pytest.approx(topr.item())


def test_the_sft_term_is_the_nll_of_the_responses_that_scored_above_0():
    """--sft-loss-coef c adds c times the negative log-likelihood of the response tokens of the
    responses whose reward is > 0 (0 and negative ones stay out), aggregated as the policy loss is:
    checked by hand, row by row in float64, on rows of unequal length (one empty) with junk on the
    padding, for token-mean over the step's own count and over a count given (the mini-batch's), and
    for seq-mean-token-mean."""
    lengths, rewards = [3, 1, 4, 0, 2], [1.0, 0.0, -0.5, 2.0, 0.25]  # row 3: an empty response that scored
    g = torch.Generator().manual_seed(0)
    new = -torch.rand(5, 4, generator=g, dtype=torch.float64) * 3
    mask = torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in lengths], dtype=torch.float64)
    new = torch.where(mask > 0, new, torch.full_like(new, 1e6))  # junk on the padding
    picked = [i for i, r in enumerate(rewards) if r > 0]
    tokens = [-new[i, t].item() for i in picked for t in range(lengths[i])]
    by_row = [sum(-new[i, t].item() for t in range(lengths[i])) / lengths[i] for i in picked if lengths[i]]
    for agg, want in (
        ({"mode": "token-mean"}, sum(tokens) / len(tokens)),
        ({"mode": "token-mean", "num_tokens": 10.0}, sum(tokens) / 10.0),
        ({"mode": "seq-mean-token-mean"}, sum(by_row) / len(by_row)),
    ):
        zero = torch.tensor(0.0, dtype=torch.float64)
        metrics = {}
        loss = roll_loss(
            {"pg": zero, "entropy": zero, "kl": zero},
            metrics,
            new,
            new,
            torch.zeros_like(new),
            mask,
            agg,
            torch.tensor(rewards),
            sft_loss_coef=0.5,
        )
        assert metrics["policy/sft_loss"].item() == pytest.approx(want, abs=1e-9), agg
        assert loss.item() == pytest.approx(0.5 * want, abs=1e-9), agg


@torchrun_plan
def two_rank_plan(folder, fixture):
    (folder / "probe.py").write_text(TWO_RANKS)
    return {"probe": (folder / "probe.py", [ROOT / "tests", folder])}


def test_statistics_span_every_rank(torchrun_runs):
    """Split over 2 processes (3 rows and 5), the batch, running and whitening statistics, the clip
    fractions and the length weights are those of the whole batch in one process."""
    folder, codes = torchrun_runs[__name__]
    assert codes == {"probe": 0}
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]
    whole = conditioned(slice(0, 8))
    flat = {key: torch.tensor(ranks[0][key] + ranks[1][key]).flatten().tolist() for key in whole if key != "metrics"}
    for key, values in flat.items():
        assert values == pytest.approx(torch.tensor(whole[key]).flatten().tolist(), abs=1e-6), key
    assert ranks[0]["metrics"] == pytest.approx(whole["metrics"]) == ranks[1]["metrics"]
