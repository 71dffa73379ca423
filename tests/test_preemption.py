"""A stop signal (SIGUSR1 / SIGTERM, what Slurm sends before a job's time limit or on preemption)
ends a run after the step it is in, with a checkpoint and exit status 0; the same command started
again continues exactly as a run that was never stopped. One process and two (torchrun: a signal
to one rank stops both after the same step; a signal to torchrun reaches both ranks when it is told
to forward SIGUSR1, as launch/ does)."""

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, read_metrics, run_recipe, run_recipes_together, stop_side_by_side

pytestmark = pytest.mark.e2e  # signals to running launches: the suite's end-to-end tier (pytest -m e2e)

RL = ["--train-batch-size", "8", "--rollout-n", "4", "--test-freq", "0", "--no-val-before-train"]
SFT = ["--train-batch-size", "16", "--micro-batch-size-per-gpu", "16", "--test-freq", "0"]
STEPS = 8  # the signal comes once 2 steps are logged; the run stops after the step it is in, well before 8


def command(recipe, out, flags, nproc, port=0):
    launch = [sys.executable]
    if nproc > 1:
        launch += [
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(29500 + os.getpid() % 1000 + port),
        ]
    return [
        *launch,
        str(ROOT / "recipes" / f"{recipe}.py"),
        "--output-dir",
        str(out),
        "--total-training-steps",
        str(STEPS),
        "--save-freq",
        "0",
        *flags,
    ]


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


# The runs a signal stops: (recipe, flags but the data, processes, signal, sent to the launcher or
# to one rank of a torchrun, environment).
FORWARD = {"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}  # what launch/ exports
STOPPED = {
    "grpo": ("grpo", RL, 1, signal.SIGUSR1, "launcher", {}),
    "sft": ("sft", SFT, 1, signal.SIGTERM, "launcher", {}),
    "grpo-one-rank": ("grpo", RL, 2, signal.SIGUSR1, "rank", {}),
    "grpo-forwarded": ("grpo", RL, 2, signal.SIGUSR1, "launcher", FORWARD),
}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, small_files):
    """Every run of STOPPED started side by side (conftest's stop_side_by_side; each gets its own
    port) and sent its signal once 2 steps are logged. {name: (run folder, exit status, output)};
    the status is None for a run that ended before its signal or did not exit after it. Before
    grpo's signal its command is run again (in this process) on its live folder: "again" holds
    that run's CompletedProcess, its seconds and the live run's pid."""
    runs = {}
    for port, (name, (recipe, flags, nproc, sig, target, env)) in enumerate(STOPPED.items()):
        out = tmp_path_factory.mktemp(name) / "stopped"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", **env}
        cmd = command(recipe, out, [*flags, *small_files], nproc, port)
        runs[name] = (cmd, env, out, sig, None if target == "launcher" else lambda proc: children(proc.pid)[-1])

    def again(name, proc):  # the same command again while the run goes on: refused
        if name == "grpo":
            t = time.time()
            second = run_recipe("grpo", *proc.args[2:], check=False)
            return second, time.time() - t, proc.pid

    done = stop_side_by_side(runs, before=again)
    return {
        "again": done["grpo"][2],
        **{name: (runs[name][2], code, output) for name, (code, output, _) in done.items()},
    }


def stop_then_resume(stopped, tmp_path, name, small_files):
    """The run that STOPPED[name]'s signal stopped (the stopped fixture) saved the step it ended on,
    and the same command started again continues it exactly as an uninterrupted run makes those
    steps. The uninterrupted and resumed runs are made in this process when they are one process
    (the same code path as a new process, without its start-up), else in one torchrun launch
    (tests/run_together.py). Returns the stopped run's exit status."""
    stopped_dir, code, output = stopped[name]
    recipe, flags, nproc, *_ = STOPPED[name]
    flags = [*flags, *small_files]
    assert code is not None, f"no exit after the signal (or none sent):\n{output[-3000:]}"
    whole = tmp_path / "whole"
    if nproc == 1:
        run_recipe(recipe, *command(recipe, whole, flags, 1)[2:])
    logged = [r["step"] for r in read_metrics(stopped_dir)]
    k = logged[-1]
    assert 2 <= k < STEPS and logged == list(range(1, k + 1)), (logged, output[-2000:])
    assert f"stopped by a signal after step {k} of {STEPS}" in output
    assert sorted(p.name for p in (stopped_dir / "checkpoints").iterdir()) == [f"step_{k}"]  # saved, --save-freq 0
    assert (stopped_dir / "checkpoints" / f"step_{k}" / "hf" / "model.safetensors").is_file()
    assert not (stopped_dir / "run.lock").exists(), "the run's lock goes with it"

    if nproc == 1:
        done = run_recipe(recipe, *command(recipe, stopped_dir, flags, 1)[2:], check=False)
        code_again, output = done.returncode, done.stdout + done.stderr
    else:
        runs = [(recipe, command(recipe, out, flags, 1)[2:]) for out in (whole, stopped_dir)]
        codes = run_recipes_together(runs, tmp_path, nproc)
        assert codes[0] == 0, "the uninterrupted run"
        code_again, output = codes[1], (tmp_path / "runs.out").read_text()
    assert code_again == 0, output[-3000:]
    assert f"resumed from {stopped_dir / 'checkpoints' / f'step_{k}'}" in output
    want, got = read_metrics(whole), read_metrics(stopped_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        for key in ("train/loss", "train/grad_norm", "reward/mean"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-6), (key, a["step"], k)
    return code


def test_one_process_grpo_stops_saved_and_resumes_exactly(stopped, tmp_path, small_files):
    assert stop_then_resume(stopped, tmp_path, "grpo", small_files) == 0


def test_a_second_run_on_a_live_runs_folder_is_refused_and_changes_nothing(stopped):
    """The same command started again while grpo's run goes on stops at once, before any model
    loads, naming the live run; the live run's metrics and checkpoints stay exactly those of an
    uninterrupted run (test_one_process_grpo_stops_saved_and_resumes_exactly compares them)."""
    assert stopped["again"] is not None, "grpo's run ended before 2 steps were logged"
    second, seconds, pid = stopped["again"]
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"is in use by a live run: pid {pid} on " in second.stderr and f"kill {pid}" in second.stderr
    assert "M params" not in second.stdout and seconds < 10  # no model loaded


def test_one_process_sft_stops_on_sigterm(stopped, tmp_path, small_files):
    assert stop_then_resume(stopped, tmp_path, "sft", small_files) == 0


def test_two_processes_stop_together_when_one_rank_is_signalled(stopped, tmp_path, small_files):
    """Only one rank gets SIGUSR1; both stop after the same step (else one would wait forever in
    the next step's collectives and the run would hit the time limit), and torchrun exits 0."""
    assert stop_then_resume(stopped, tmp_path, "grpo-one-rank", small_files) == 0


def test_torchrun_forwards_the_signal_when_told_to(stopped):
    """launch/ starts torchrun with PET_SIGNALS_TO_HANDLE including SIGUSR1: torchrun passes the
    signal to its ranks (and exits non-zero itself, a SignalException: the Slurm script decides on
    requeueing from the signal it trapped, not from this status); the ranks save and stop."""
    out, code, output = stopped["grpo-forwarded"]
    k = read_metrics(out)[-1]["step"]
    assert code not in (0, None) and "SignalException" in output, output[-3000:]
    assert f"stopped by a signal after step {k} of {STEPS}" in output and k < STEPS
    assert (out / "checkpoints" / f"step_{k}" / "trainer_state.json").is_file()
