"""A stop signal (SIGUSR1 / SIGTERM, what Slurm sends before a job's time limit or on preemption)
ends a run after the step it is in, with a checkpoint and exit status 0; the same command started
again continues exactly as a run that was never stopped. One process and two (torchrun: a signal
to one rank stops both after the same step; a signal to torchrun reaches both ranks when it is told
to forward SIGUSR1, as launch/ does)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, read_metrics, run_recipe, run_recipes_together

RL = ["--train-batch-size", "8", "--rollout-n", "4", "--test-freq", "0", "--no-val-before-train"]
SFT = ["--train-batch-size", "16", "--micro-batch-size-per-gpu", "16", "--test-freq", "0"]
STEPS = 8  # the signal comes once 2 steps are logged; the run stops after the step it is in, well before 8


def command(recipe, out, flags, nproc):
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                   str(29500 + os.getpid() % 1000)]  # fmt: skip
    return [*launch, str(ROOT / "recipes" / f"{recipe}.py"), "--output-dir", str(out),
            "--total-training-steps", str(STEPS), "--save-freq", "0", *flags]  # fmt: skip


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # a process that ended while we looked
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def run(cmd, env=None, signal_after=None, sig=signal.SIGUSR1, target="launcher", timeout=600):
    """Run cmd; with signal_after=k, send `sig` once k steps are logged, to the process started
    (launcher) or to its last child (one rank of a torchrun). Returns (exit status, output)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = Path(cmd[cmd.index("--output-dir") + 1]) / "metrics.jsonl"
    if signal_after is not None:
        deadline = time.time() + timeout
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= signal_after):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.time() < deadline, "no steps logged in time"
            time.sleep(0.02)
        os.kill(proc.pid if target == "launcher" else children(proc.pid)[-1], sig)
    output = proc.communicate(timeout=timeout)[0]
    return proc.returncode, output


def stop_then_resume(tmp_path, recipe, flags, nproc=1, **signal_kw):
    """An uninterrupted run, then one stopped by a signal (a process of its own) and the same command
    again: the stop saved the step it ended on, and the resumed steps equal the uninterrupted run's.
    The runs but the stopped one are made in this process when they are one process (the same code
    path as a new process, without its start-up), else in one torchrun launch (tests/run_together.py)."""
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    if nproc == 1:
        run_recipe(recipe, *command(recipe, whole, flags, 1)[2:])
    code, output = run(command(recipe, stopped, flags, nproc), signal_after=2, **signal_kw)
    logged = [r["step"] for r in read_metrics(stopped)]
    k = logged[-1]
    assert 2 <= k < STEPS and logged == list(range(1, k + 1)), (logged, output[-2000:])
    assert f"stopped by a signal after step {k} of {STEPS}" in output
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == [f"step_{k}"]  # saved, --save-freq 0
    assert (stopped / "checkpoints" / f"step_{k}" / "hf" / "model.safetensors").is_file()

    if nproc == 1:
        done = run_recipe(recipe, *command(recipe, stopped, flags, 1)[2:], check=False)
        code_again, output = done.returncode, done.stdout + done.stderr
    else:
        codes = run_recipes_together([(recipe, command(recipe, out, flags, 1)[2:]) for out in (whole, stopped)],
                                     tmp_path, nproc)  # fmt: skip
        assert codes[0] == 0, "the uninterrupted run"
        code_again, output = codes[1], (tmp_path / "runs.out").read_text()
    assert code_again == 0, output[-3000:]
    assert f"resumed from {stopped / 'checkpoints' / f'step_{k}'}" in output
    want, got = read_metrics(whole), read_metrics(stopped)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        for key in ("train/loss", "train/grad_norm", "reward/mean"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-6), (key, a["step"], k)
    return code, output


def test_one_process_grpo_stops_saved_and_resumes_exactly(tmp_path, small_files):
    code, _ = stop_then_resume(tmp_path, "grpo", [*RL, *small_files])
    assert code == 0


def test_one_process_sft_stops_on_sigterm(tmp_path, small_files):
    code, _ = stop_then_resume(tmp_path, "sft", [*SFT, *small_files], sig=signal.SIGTERM)
    assert code == 0


def test_two_processes_stop_together_when_one_rank_is_signalled(tmp_path, small_files):
    """Only one rank gets SIGUSR1; both stop after the same step (else one would wait forever in
    the next step's collectives and the run would hit the time limit), and torchrun exits 0."""
    code, _ = stop_then_resume(tmp_path, "grpo", [*RL, *small_files], nproc=2, target="rank")
    assert code == 0


def test_torchrun_forwards_the_signal_when_told_to(tmp_path, small_files):
    """launch/ starts torchrun with PET_SIGNALS_TO_HANDLE including SIGUSR1: torchrun passes the
    signal to its ranks (and exits non-zero itself, a SignalException: the Slurm script decides on
    requeueing from the signal it trapped, not from this status); the ranks save and stop."""
    env = {"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}
    out = tmp_path / "forwarded"
    code, output = run(command("grpo", out, [*RL, *small_files], 2), env=env, signal_after=2)
    k = read_metrics(out)[-1]["step"]
    assert code != 0 and "SignalException" in output
    assert f"stopped by a signal after step {k} of {STEPS}" in output and k < STEPS
    assert (out / "checkpoints" / f"step_{k}" / "trainer_state.json").is_file()
