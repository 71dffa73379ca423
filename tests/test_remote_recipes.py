"""grpo.py with --rollout-placement remote: it learns with --max-staleness 1, runs under two trainer
processes, and a trainer that stops (the stop signal, Ctrl-C) leaves no Ray process behind. The runs
join the session's shared Ray (conftest's ray_cluster), one process of them inside this one, but for
the stopped trainers, which start their own: what they must leave behind is nothing of it."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, SHIPPED_ACCURACY, read_metrics, run_recipe
from test_remote import ray_processes, wait_until_no_ray

REMOTE = ["--rollout-placement", "remote", "--num-rollout-engines", "2"]
# Runs that need not learn: 8 prompts x 4 samples a step, no validation.
SMALL_STEPS = ["--train-batch-size", "8", "--ppo-mini-batch-size", "8", "--rollout-n", "4", "--no-val-before-train"]


@pytest.fixture(autouse=True)
def no_ray_before_or_after():
    assert not wait_until_no_ray(), f"Ray processes from before this test: {ray_processes()}"
    yield
    assert not wait_until_no_ray(), f"Ray processes left by the run: {ray_processes()}"


@pytest.mark.slow
def test_grpo_with_remote_engines_and_staleness_1_learns(tmp_path, ray_cluster):
    """Every step after the first trains on samples exactly one weight version old (the engines
    sample step t+1 while the trainer trains step t), and validation accuracy still climbs."""
    run_recipe("grpo", *REMOTE, "--max-staleness", "1", "--total-training-steps", "20", "--save-freq", "0",
               "--output-dir", tmp_path / "run", "--ray-address", ray_cluster)  # fmt: skip
    metrics = read_metrics(tmp_path / "run")
    steps = [m for m in metrics if "train/loss" in m]
    assert len(steps) == 20
    assert steps[0]["rollout/staleness_max"] == 0  # the first step's samples come from the start's weights
    assert all(m["rollout/staleness_mean"] == 1 and m["rollout/staleness_max"] == 1 for m in steps[1:])
    assert all(m["rollout/engine_restarts"] == 0 and m["rollout/prefetch_misses"] == 0 for m in steps)
    # The engines' logprobs lag the trainer's by one step, which the trainer's old-logprob pass measures.
    assert all(m["rollout/logprob_diff_max"] > 1e-3 for m in steps[1:])
    final = [m["val/accuracy"] for m in metrics if "val/accuracy" in m]
    assert final[0] == pytest.approx(SHIPPED_ACCURACY) and final[-1] >= SHIPPED_ACCURACY + 0.04, final


@pytest.mark.slow
def test_two_trainer_processes_share_the_remote_engines(tmp_path, ray_cluster, small_files):
    """torchrun with 2 FSDP2 processes: rank 0 serves both ranks' prompts through the engines,
    and every sync gathers the sharded weights on all ranks; the staleness bound holds."""
    run_recipe("grpo", *REMOTE, "--max-staleness", "1", "--strategy", "fsdp2", "--total-training-steps", "4",
               "--test-freq", "0", "--save-freq", "0", "--output-dir", tmp_path / "run", "--ray-address", ray_cluster,
               *small_files, *SMALL_STEPS, nproc=2)  # fmt: skip
    steps = [m for m in read_metrics(tmp_path / "run") if "train/loss" in m]
    assert len(steps) == 4 and [m["rollout/staleness_max"] for m in steps] == [0, 1, 1, 1]


@pytest.mark.slow
def test_a_resumed_run_with_synchronous_remote_engines_repeats_the_steps_exactly(tmp_path, ray_cluster, small_files):
    """With --max-staleness 0 every chunk is sampled under a seed fixed by (run seed, step, chunk)
    on the weights of that step, so a run resumed from step 2 repeats steps 3-4 exactly."""
    flags = [*REMOTE, "--total-training-steps", "4", "--test-freq", "0", "--save-freq", "2", "--output-dir", tmp_path,
             "--ray-address", ray_cluster, *small_files, *SMALL_STEPS]  # fmt: skip
    run_recipe("grpo", *flags)
    keys = ("train/loss", "train/grad_norm", "reward/mean", "rollout/logprob_diff_max")
    first = [[m[k] for k in keys] for m in read_metrics(tmp_path) if "train/loss" in m]
    shutil.rmtree(tmp_path / "checkpoints" / "step_4")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "metrics.jsonl").write_text("".join(lines[:-2]))
    proc = run_recipe("grpo", *flags)
    assert "resumed from" in proc.stdout + proc.stderr
    again = [[m[k] for k in keys] for m in read_metrics(tmp_path) if "train/loss" in m]
    assert len(first) == 4 and again == first


@pytest.mark.parametrize("how", ["SIGUSR1", "SIGINT"])
def test_a_stopped_trainer_leaves_no_ray_process(tmp_path, small_files, how):
    """The stop signal saves and exits 0; Ctrl-C ends the run at once. Either way the engines and
    the Ray the run started are gone (the fixture checks)."""
    cmd = [sys.executable, str(ROOT / "recipes" / "grpo.py"), *REMOTE, "--max-staleness", "1",
           "--total-training-steps", "200", "--test-freq", "0", "--save-freq", "0",
           "--output-dir", str(tmp_path / "run"), *small_files, *SMALL_STEPS]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            metrics = tmp_path / "run" / "metrics.jsonl"
            if metrics.exists() and sum(1 for line in metrics.read_text().splitlines() if '"train/loss"' in line) >= 2:
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(getattr(signal, how))
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # where it hangs: faulthandler prints every thread's stack on SIGABRT
            proc.send_signal(signal.SIGABRT)
            raise AssertionError(f"still running 120 s after {how}:\n{proc.communicate()[0][-6000:]}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
    if how == "SIGUSR1":
        assert proc.returncode == 0, out[-3000:]
        assert list((tmp_path / "run" / "checkpoints").glob("step_*"))
    else:
        assert proc.returncode != 0
