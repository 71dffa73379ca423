import json
import os
import re
import sys

import pytest

from common.config import TrainerArgs
from common.tracking import Tracker, read_metrics


def tracker(run_dir, start_step=0, total_steps=0, is_main=True, *, loggers=("console",), flags=None, **trainer):
    """A Tracker of recipe "grpo" with these flags (config.json's) and --logger, the rest of its trainer group's
    flags by name (project_name, experiment_name, stop_on_nonfinite_reward, ...); no --log-interval lines."""
    group = TrainerArgs(logger=tuple(loggers), **{"log_interval": 0, **trainer})
    return Tracker(run_dir, start_step, total_steps, is_main, group, "grpo", flags or {}, {})


def test_metrics_jsonl_resume_drops_steps_after_the_checkpoint(tmp_path):
    t = tracker(tmp_path, loggers=(), flags={"lr": 1.0}, total_steps=5)
    for step in range(1, 6):
        t.log({"train/loss": 1.0 / step, "val/accuracy": 0.1 * step}, step=step)
    png = t.close(plot_keys=("train/loss", "val/*"))
    assert png is not None and png.stat().st_size > 1000
    assert json.loads((tmp_path / "config.json").read_text()) == {"lr": 1.0, "recipe": "grpo", "run": {}}
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]

    # A run killed after logging step 5 but resumed from its step-3 checkpoint logs 4 and 5 again.
    t = tracker(tmp_path, loggers=(), start_step=3, total_steps=5)
    t.log({"train/loss": 0.0}, step=4)
    t.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_fresh_run_starts_a_new_file_and_other_ranks_write_nothing(tmp_path):
    tracker(tmp_path, loggers=()).log({"a": 1}, step=1)
    t = tracker(tmp_path, loggers=())
    t.log({"a": 2}, step=1)
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "a": 2}]
    other = tmp_path / "rank1"
    tracker(other, loggers=(), is_main=False).log({"a": 3}, step=1)
    assert not other.exists()


def test_tensorboard_logger(tmp_path):
    t = tracker(tmp_path, loggers=("tensorboard",))
    t.log({"train/loss": 0.5}, step=1)
    t.close()
    assert any((tmp_path / "tensorboard").iterdir())


def test_wandb_logger_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    t = tracker(tmp_path, loggers=("wandb",), project_name="p", experiment_name="e", flags={"lr": 1.0})
    t.log({"train/loss": 0.5}, step=1)
    gens = [{"data_source": "d", "prompt": "1+1=", "response": "<answer>2</answer>", "ground_truth": "2", "score": 1.0}]
    t.log({"val/accuracy": 1.0, "val/generations": gens}, step=2)  # --log-val-generations: a wandb table
    t.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    (table,) = runs[0].glob("files/media/table/val/generations_*.table.json")
    written = json.loads(table.read_text())
    assert written["columns"] == list(gens[0]) and written["data"] == [list(gens[0].values())]


def test_tracker_kwargs_reach_the_trackers_that_take_them(tmp_path, monkeypatch):
    """--tracker-kwargs (ROLL's tracker_kwargs): wandb.init gets its keys (the offline run's tags and notes), and
    tensorboard's SummaryWriter its own (the event file's suffix), each only the keys its constructor takes."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    extra = '{"tags": ["ablation"], "notes": "lr sweep", "filename_suffix": ".sweep"}'
    t = tracker(tmp_path, loggers=("wandb", "tensorboard"), tracker_kwargs=extra)
    assert t.loggers.wandb.tags == ("ablation",) and t.loggers.wandb.notes == "lr sweep"
    t.log({"train/loss": 0.5}, step=1)
    t.close()
    assert [f.name.endswith(".sweep") for f in (tmp_path / "tensorboard").iterdir()] == [True]


@pytest.mark.parametrize(
    "extra, said",
    [
        ('{"flush_secs": 5, "tagz": ["a"]}', "'tagz' is an argument of none of wandb, tensorboard's constructors"),
        ('{"project": "other"}', "'project' is set by the run (--project-name); set it there"),
        ("{entity: team}", "not JSON (Expecting property name enclosed in double quotes)"),
        ('["a"]', "a JSON list; pass an object of arguments"),
    ],
)
def test_tracker_kwargs_that_no_tracker_takes_are_refused_before_anything_loads(extra, said):
    from common.config import check_flags
    from common.errors import UsageError

    with pytest.raises(UsageError, match=re.escape(said)):
        check_flags(TrainerArgs(logger=("wandb", "tensorboard"), tracker_kwargs=extra))


def test_system_envs_are_set_before_the_recipe_reads_anything(monkeypatch):
    """--system-envs NAME=VALUE (ROLL's system_envs) lands in the environment as the flags are parsed; a pair
    without NAME= is refused."""
    from conftest import load_recipe, make_args

    from common.config import cli
    from common.errors import UsageError

    args_class = load_recipe("grpo").Args
    monkeypatch.delenv("RECIPES_TEST_ENV", raising=False)
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--system-envs", "RECIPES_TEST_ENV=a=b", "HF_HUB_OFFLINE=1"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    cli(args_class, "grpo", "grpo")
    assert os.environ["RECIPES_TEST_ENV"] == "a=b" and os.environ["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(UsageError, match="--system-envs.*NAME=VALUE pairs"):
        make_args(args_class, system_envs=("USE_MODELSCOPE",))


def test_finish_reports_the_validation_before_training_and_the_latest(tmp_path, capsys):
    """The closing summary pairs the step-0 validation with the last one logged; a run whose first
    validation comes later (or a resumed run) has no "before"."""
    t = tracker(tmp_path, 0, 4, loggers=())
    t.log({"val/accuracy": 0.25}, step=0)
    t.log({"train/loss": 1.0, "val/accuracy": 0.5}, step=2)
    t.log({"train/loss": 0.5}, step=3)
    t.log({"train/loss": 0.4, "val/accuracy": 0.75}, step=4)
    summary = t.finish()
    assert summary["val/accuracy"] == 0.75 and summary["steps"] == 4
    assert "val accuracy 25.0% -> 75.0%" in capsys.readouterr().out
    t = tracker(tmp_path / "later", 2, 4, loggers=())
    t.log({"val/accuracy": 0.5}, step=4)
    assert t.finish()["steps"] == 2
    out = capsys.readouterr().out
    assert "val accuracy 50.0%" in out and "->" not in out  # no "before" to compare with


def test_a_non_finite_loss_stops_the_run_at_its_step_on_every_rank(tmp_path):
    import pytest

    from common.tracking import NonFiniteError

    for is_main in (True, False):  # every rank raises, so none waits in a collective for the others
        t = tracker(tmp_path / str(is_main), 0, 5, loggers=(), is_main=is_main)
        t.log({"train/loss": 0.5, "train/grad_norm": 1.0}, step=1)
        with pytest.raises(NonFiniteError, match=r"step 2: train/grad_norm = nan.*lower --lr"):
            t.log({"train/loss": 0.5, "train/grad_norm": float("nan")}, step=2)
    with pytest.raises(NonFiniteError, match=r"step 3: reward/mean = inf"):
        t.log({"reward/mean": float("inf")}, step=3)
    with pytest.raises(NonFiniteError, match=r"step 4: critic/advantages/mean = nan"):
        t.log({"reward/mean": 1.0, "critic/advantages/mean": float("nan")}, step=4)


def test_nonfinite_rewards_stop_the_run_only_when_asked(tmp_path):
    import pytest

    from common.tracking import NonFiniteError

    counted = tracker(tmp_path / "counted", 0, 5, loggers=())
    counted.log({"reward/mean": 0.5, "reward/nonfinite": 2.0}, step=1)  # zeroed by the pool: the run goes on
    assert '"reward/nonfinite": 2.0' in (tmp_path / "counted" / "metrics.jsonl").read_text()
    stops = tracker(tmp_path / "stops", 0, 5, loggers=(), stop_on_nonfinite_reward=True)
    stops.log({"reward/mean": 0.5, "reward/nonfinite": 0.0, "val/reward/nonfinite": 0}, step=1)
    with pytest.raises(NonFiniteError, match=r"step 2: val/reward/nonfinite = 1 .*--stop-on-nonfinite-reward"):
        stops.log({"reward/mean": 0.5, "reward/nonfinite": 0.0, "val/reward/nonfinite": 1}, step=2)


def test_advantage_metrics_over_response_tokens_keep_a_nan():
    import math

    import torch

    from common.tracking import advantage_metrics

    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    per_sequence = advantage_metrics(torch.tensor([1.0, -2.0]), mask)  # (B,): every response token carries it
    assert per_sequence == {"critic/advantages/mean": 0.0, "critic/advantages/max": 1.0, "critic/advantages/min": -2.0}
    per_token = advantage_metrics(torch.tensor([[0.5, 1.5, 99.0], [-1.0, 99.0, 99.0]]), mask)  # masked 99s ignored
    assert per_token == {"critic/advantages/mean": 1 / 3, "critic/advantages/max": 1.5, "critic/advantages/min": -1.0}
    assert all(math.isnan(v) for v in advantage_metrics(torch.tensor([float("nan"), 1.0]), mask).values())


def test_steps_without_a_gradient_are_reported_once(tmp_path, caplog):
    t = tracker(tmp_path, 0, 9, loggers=())
    with caplog.at_level("WARNING"):
        for step, norm in enumerate([0.0, 0.0, 0.5, 0.0, 0.0], 1):  # never three in a row
            t.log({"train/grad_norm": norm, "reward/mean": 0.0}, step=step)
        assert "no gradient" not in caplog.text
        for step in (6, 7, 8, 9):
            t.log({"train/grad_norm": 0.0, "reward/mean": 0.0}, step=step)
    assert caplog.text.count("no gradient") == 1 and "steps 4-6" in caplog.text
    assert "answer format" in caplog.text


def test_logprob_diff_metrics_over_response_tokens():
    import torch

    from common.tracking import logprob_diff_metrics

    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    trainer = torch.tensor([[-0.5, -1.0, -9.0], [-2.0, -9.0, -9.0]])
    engine = torch.tensor([[-0.4, -1.0, 0.0], [-2.3, 0.0, 0.0]])  # past a response's end: padding, not counted
    got = logprob_diff_metrics(trainer, engine, mask)
    assert got["rollout/logprob_diff_mean"] == pytest.approx(0.4 / 3) and got[
        "rollout/logprob_diff_max"
    ] == pytest.approx(0.3)


def test_rollout_is_metrics_over_response_tokens():
    import torch

    from common.tracking import rollout_is_metrics

    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    weights = torch.tensor([[0.5, 2.0, 0.0], [1.0, 0.0, 0.0]])  # 2.0 sits at the threshold: truncated
    got = rollout_is_metrics(weights, mask, threshold=2.0)
    assert got == pytest.approx(
        {
            "rollout_corr/rollout_is_mean": 3.5 / 3,
            "rollout_corr/rollout_is_max": 2.0,
            "rollout_corr/rollout_is_min": 0.5,
            "rollout_corr/rollout_is_ratio_fraction_high": 1 / 3,
            "rollout_corr/rollout_is_eff_sample_size": 3.5**2 / (3 * 5.25),
        }
    )
    assert rollout_is_metrics(weights, torch.zeros_like(mask), threshold=2.0) == {}


def test_logged_generations_go_to_their_own_file_and_resume_like_the_metrics(tmp_path):
    gens = [{"data_source": "d", "prompt": "1+1=", "response": "<answer>2</answer>", "ground_truth": "2", "score": 1.0}]
    t = tracker(tmp_path, loggers=(), total_steps=3)
    for step in (1, 2, 3):
        t.log({"val/accuracy": 0.5, "val/generations": gens * step}, step=step)
    t.close()
    lines = [json.loads(x) for x in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert [g["step"] for g in lines] == [1, 2, 2, 3, 3, 3] and lines[0]["response"] == "<answer>2</answer>"
    assert all("val/generations" not in r for r in read_metrics(tmp_path / "metrics.jsonl"))
    tracker(tmp_path, loggers=(), start_step=2, total_steps=3).close()  # resumed from step 2's checkpoint
    lines = [json.loads(x) for x in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert [g["step"] for g in lines] == [1, 2, 2]


def test_a_logged_engine_gap_past_its_bound_saves_and_stops_the_run(tmp_path, caplog):
    """The mean trainer-engine gap of the sampled tokens (rollout/logprob_diff_mean) within the bound goes
    on, whatever one rare token's gap; past it the run's StopSignal reports a failure naming the gap and
    the bound, so the step saves and the run ends with exit status 1; under --check warn it is a warning
    and the run goes on."""
    import torch

    from common.check import Check
    from common.config import Sync
    from common.parallel import Dist, StopSignal

    dist = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    # an engine with its own weights whose logged gap proves the sync, bounded by float32's TOLERANCE (mean 1e-4)
    sync = Sync(
        own_weights=True,
        old_logprobs="pass",
        trainer_dtype=torch.float32,
        gap_dtype=torch.float32,
        gap_proves_sync=True,
        freq=10,
    )
    stop, check = StopSignal(dist), Check("fast", sync)
    check.during(1, stop, {"rollout/logprob_diff_max": 0.02, "rollout/logprob_diff_mean": 5e-5})  # one rare token
    assert not stop.requested() and stop.failure is None
    check.during(2, stop, {"rollout/logprob_diff_max": 5e-4, "rollout/logprob_diff_mean": 3e-3})
    assert stop.requested() and "step 2: the engine's logprobs of its sampled tokens are 0.003 (mean" in stop.failure
    assert "past the float32 bound 0.0001" in stop.failure
    warned = StopSignal(dist)
    Check("warn", sync).during(1, warned, {"rollout/logprob_diff_max": 0.5, "rollout/logprob_diff_mean": 0.1})
    assert not warned.requested() and "the engine no longer samples" in caplog.text.lower()
