"""dapo.py: known answers for the overlong penalty and dynamic sampling's choice of groups, and
short runs (subprocess, as users run it) that show re-sampling, the fill-up when the generation
batches run out, and a resume that repeats the uninterrupted steps and their data."""

import json
import shutil

import pytest
import torch
from conftest import load_recipe, make_args, read_metrics, run_recipe

dapo = load_recipe("dapo")
FAST = "--train-batch-size 8 --ppo-mini-batch-size 8 --rollout-n 4 --save-freq 0 --no-val-before-train --test-freq 0"


def run(out, files, flags, **kw):
    return run_recipe("dapo", "--output-dir", out, *files, *flags.split(), **kw)


def test_defaults_are_dapos():
    args = dapo.Args()
    assert (args.clip_ratio_low or args.clip_ratio, args.clip_ratio_high) == (0.2, 0.28)  # clip-higher
    assert args.loss_agg_mode == "token-mean"
    assert (args.max_num_gen_batches, args.overlong_buffer_len, args.overlong_penalty_factor) == (10, 4, 1.0)
    assert not args.use_kl_loss


def test_overlong_penalty_ramps_to_the_factor():
    lengths = torch.tensor([5, 12, 13, 14, 16])  # max 16, buffer 4: the ramp starts after 12 tokens
    pen = dapo.overlong_penalty(lengths, max_len=16, buffer_len=4, factor=1.0)
    assert pen.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert dapo.overlong_penalty(lengths, 16, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
    assert dapo.overlong_penalty(lengths, 16, 0, 1.0).tolist() == [0.0] * 5  # buffer 0: off


def test_the_overlong_penalty_counts_a_conversations_tool_tokens(monkeypatch):
    """A multi-turn response's length is the whole conversation after the prompt, as verl counts
    it (the response's attention mask), not only the tokens the policy sampled: a 16-token
    conversation (max 16) whose middle 8 tokens the tool wrote gets the full penalty."""
    from types import SimpleNamespace

    mask = torch.tensor([[1] * 4 + [0] * 8 + [1] * 4, [1] * 8 + [0] * 8])  # holes; a short single-turn row
    attention = torch.cat([torch.ones(2, 3), torch.tensor([[1] * 16, [1] * 8 + [0] * 8])], 1)  # prompt 3
    batch = {
        "responses": torch.zeros(2, 16, dtype=torch.long),
        "response_mask": mask,
        "attention_mask": attention,
        "rewards": torch.ones(2),
        "rows": [None, None],
        "epoch": 0,
        "scored": SimpleNamespace(scores=[1.0, 1.0], extras=[{}, {}]),
    }
    kept = {}
    monkeypatch.setattr(dapo, "regroup", lambda groups, *rest: kept.update(groups=groups) or {})
    dist = SimpleNamespace(rank=0, world_size=1, device="cpu")
    rollout = SimpleNamespace(
        step=lambda i: batch, sampling=SimpleNamespace(n=1, max_tokens=16), dist=dist, batch_size=2, tokenizer=None
    )
    dapo.dynamic_sampling(rollout, 0, 1, 4, 1.0)  # overlong buffer 4: the ramp starts at 12
    assert [reward for group in kept["groups"] for _, reward, _, _ in group] == [0.0, 1.0]  # 16 tokens: -1


def test_select_groups_takes_the_first_groups_with_a_reward_spread():
    rewards = [[1, 1, 1], [0, 1, 0], [0, 0, 0], [1.0, 0.75, 1.0], [1, 0, 1], [0.5]]
    # group 3 differs only by an overlong penalty: that is a spread too; a group of one counts (verl)
    assert dapo.select_groups(rewards, 2) == ([1, 3], [True, True])
    assert dapo.select_groups(rewards, 4) == ([1, 3, 4, 5], [True] * 4)


def test_select_groups_fills_up_with_zero_variance_groups_in_order():
    rewards = [[1, 1], [0, 1], [0, 0], [1, 1], [1, 0]]
    # two groups with a spread (1, 4); the first zero-variance groups (0, 2) fill the batch of 4
    assert dapo.select_groups(rewards, 4) == ([0, 1, 2, 4], [False, True, False, True])
    assert dapo.select_groups([[0, 0], [1, 1]], 2) == ([0, 1], [False, False])


def test_resampling_and_exact_resume(tmp_path, small_files):
    """With 4 samples per prompt some groups are all right or all wrong, so steps need a second
    generation batch; the checkpoint keeps the generation-batch count, so a run killed after step 4's
    log (before its save) and resumed from step 2 reads the same prompts and repeats steps 3-4."""
    out = tmp_path / "run"
    flags = f"{FAST} --total-training-steps 4 --save-freq 2 --max-ckpt-to-keep 0"
    run(out, small_files, flags + " --resume disable")
    want = read_metrics(out)
    assert max(r["dapo/gen_batches"] for r in want) > 1, "dynamic sampling re-sampled"
    assert all(r["dapo/kept_groups"] == 8 and r["dapo/filler_groups"] == 0 for r in want)
    state = json.loads((out / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert state["gen_batches"] == want[0]["dapo/gen_batches"] + want[1]["dapo/gen_batches"]

    shutil.rmtree(out / "checkpoints" / "step_4")
    run(out, small_files, flags + " --resume auto")
    got = read_metrics(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(got[2:], want[2:]):
        for key in ("reward/mean", "train/loss", "train/grad_norm", "response/length_mean", "dapo/gen_batches"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), (key, a["step"])


def test_out_of_generation_batches_trains_on_the_groups_found(tmp_path, small_files):
    """--max-num-gen-batches 1 with pairs: fewer than 8 groups have a spread, so the batch is filled
    with zero-variance groups (kept out of the loss) and the step still trains."""
    out = tmp_path / "short"
    run(out, small_files, f"{FAST} --rollout-n 2 --max-num-gen-batches 1 --total-training-steps 1 --resume disable")
    (record,) = read_metrics(out)
    assert record["dapo/gen_batches"] == 1
    assert record["dapo/filler_groups"] > 0 and record["dapo/kept_groups"] + record["dapo/filler_groups"] == 8
    assert record["train/grad_norm"] > 0 and record["train/loss"] == record["train/loss"]  # not NaN


def test_dapos_own_flags_are_checked_as_they_are_parsed():
    from common.errors import UsageError

    with pytest.raises(UsageError, match=r"--overlong-buffer-len 17: must be in \[0, --max-response-length \(16\)\]"):
        dapo.Args(overlong_buffer_len=17)
    make_args(dapo.Args, overlong_buffer_len=32, max_response_length=32)  # the bound is the flag's value in this run
    with pytest.raises(UsageError, match="--max-staleness 1: must be 0: dynamic sampling draws batches as its filter"):
        make_args(dapo.Args, rollout_placement="remote", max_staleness=1)
    with pytest.raises(UsageError, match=r"--overlong-penalty-factor 2.0 would change nothing in this run"):
        dapo.Args(overlong_buffer_len=0, overlong_penalty_factor=2.0)
