"""grpo.py with --rollout-placement remote: it learns with --max-staleness 1, runs under two trainer
processes, and a trainer that stops (the stop signal, Ctrl-C) leaves no Ray process behind. The runs
join the session's shared Ray (conftest's ray_cluster), one process of them inside this one, but for
the stopped trainers, which start their own: what they must leave behind is nothing of it."""

import os
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ROOT, SHIPPED_ACCURACY, read_metrics, run_recipe, running, stop_side_by_side
from test_remote import ray_processes, wait_until_no_ray

pytestmark = pytest.mark.e2e  # Ray: the suite's end-to-end tier (pytest -m e2e)

REMOTE = ["--rollout-placement", "remote", "--num-rollout-engines", "2"]
# Runs that need not learn: 8 prompts x 4 samples a step, no validation.
SMALL_STEPS = ["--train-batch-size", "8", "--ppo-mini-batch-size", "8", "--rollout-n", "4", "--no-val-before-train"]


@pytest.fixture(autouse=True)
def no_ray_before_or_after():
    assert not wait_until_no_ray(), f"Ray processes from before this test: {ray_processes()}"
    yield
    assert not wait_until_no_ray(), f"Ray processes left by the run: {ray_processes()}"


def test_grpo_with_remote_engines_and_staleness_1_learns(tmp_path, ray_cluster):
    """Every step after the first trains on samples exactly one weight version old (the engines
    sample step t+1 while the trainer trains step t), and validation accuracy still climbs: by
    +8.8 / +14.6 / +7.0 points with seeds 1-3 at 12 samples per prompt (at 8, seed 1 gained +5.0),
    against a bar of 4."""
    run_recipe(
        "grpo",
        *REMOTE,
        "--max-staleness",
        "1",
        "--total-training-steps",
        "20",
        "--save-freq",
        "0",
        "--rollout-n",
        "12",
        "--output-dir",
        tmp_path / "run",
        "--ray-address",
        ray_cluster,
    )
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


def test_two_trainer_processes_share_the_remote_engines(tmp_path, ray_cluster, small_files):
    """torchrun with 2 FSDP2 processes: rank 0 serves both ranks' prompts through the engines,
    and every sync gathers the sharded weights on all ranks; the staleness bound holds."""
    run_recipe(
        "grpo",
        *REMOTE,
        "--max-staleness",
        "1",
        "--strategy",
        "fsdp2",
        "--total-training-steps",
        "4",
        "--test-freq",
        "0",
        "--save-freq",
        "0",
        "--output-dir",
        tmp_path / "run",
        "--ray-address",
        ray_cluster,
        *small_files,
        *SMALL_STEPS,
        nproc=2,
    )
    steps = [m for m in read_metrics(tmp_path / "run") if "train/loss" in m]
    assert len(steps) == 4 and [m["rollout/staleness_max"] for m in steps] == [0, 1, 1, 1]


def test_grpo_plays_the_games_on_remote_engines(tmp_path, ray_cluster):
    """The environment manager over the Ray engines: every turn of every trajectory is served by
    them (synchronously: an environment's next prompt exists only once it has stepped), the weights
    reach them after each step, and the games' metrics come out as with the HF engine."""
    from test_envs import PLAY

    run_recipe(
        "grpo", *REMOTE, *PLAY, "--save-freq", "0", "--output-dir", tmp_path / "run", "--ray-address", ray_cluster
    )
    steps = [m for m in read_metrics(tmp_path / "run") if "train/loss" in m]
    assert [m["rollout/weight_version"] for m in steps] == [0, 1]
    assert all(m["rollout/engine_restarts"] == 0 and m["rollout/staleness_max"] == 0 for m in steps)
    assert all(
        f"env/{tag}/steps" in steps[-1] and f"val/env/{tag}/success" in steps[-1]
        for tag in ("FrozenLake", "SimpleSokoban")
    )
    assert steps[-1]["env/FrozenLake/steps"] + steps[-1]["env/SimpleSokoban/steps"] > 0


def kill_an_engine_after(folder, steps: int, killed: list) -> None:
    """Once `steps` training steps are logged in folder, SIGKILL one rollout engine's process (a
    Ray actor of the shared Ray, found by the process title Ray gives it); its pid goes in killed."""
    from common.serving.remote import _descendants

    deadline = time.time() + 600
    while time.time() < deadline and len([m for m in read_metrics_if_any(folder) if "train/loss" in m]) < steps:
        time.sleep(0.1)
    engines = _descendants(os.getpid(), "ray::EngineActor")
    if engines:
        os.kill(engines[0], signal.SIGKILL)
        killed.append(engines[0])


def read_metrics_if_any(folder) -> list[dict]:
    return read_metrics(folder) if (folder / "metrics.jsonl").is_file() else []


def test_a_resumed_run_with_synchronous_remote_engines_repeats_the_steps_exactly(tmp_path, ray_cluster, small_files):
    """With --max-staleness 0 every chunk is sampled under a seed fixed by (run seed, step, chunk)
    on the weights of that step, so a run resumed from step 2 repeats steps 3-4 exactly (a LoRA
    policy: its adapter restored, the engines given the merged weights again). In the
    first run one engine's process is killed after step 2: Ray restarts it, it is given the weights
    again and its prompts are sampled again, so steps 3-4 still equal the resumed run's, which
    lost no engine (a prompt lost or sampled twice would change the loss), and the run says so."""
    flags = [
        *REMOTE,
        "--total-training-steps",
        "4",
        "--test-freq",
        "0",
        "--save-freq",
        "2",
        "--output-dir",
        tmp_path,
        "--ray-address",
        ray_cluster,
        *small_files,
        *SMALL_STEPS,
        "--lora-rank",
        "8",
        "--lora-alpha",
        "16",
    ]
    killed = []
    killer = threading.Thread(target=kill_an_engine_after, args=(tmp_path, 2, killed), daemon=True)
    killer.start()
    proc = run_recipe("grpo", *flags)
    killer.join(timeout=5)
    assert killed, "no engine process was found to kill"
    assert "rollout engine" in proc.stderr and "died and was restarted" in proc.stderr
    keys = ("train/loss", "train/grad_norm", "reward/mean", "rollout/logprob_diff_max")
    first = [[m[k] for k in keys] for m in read_metrics(tmp_path) if "train/loss" in m]
    assert [m["rollout/engine_restarts"] for m in read_metrics(tmp_path) if "train/loss" in m][-1] == 1
    shutil.rmtree(tmp_path / "checkpoints" / "step_4")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "metrics.jsonl").write_text("".join(lines[:-2]))
    proc = run_recipe("grpo", *flags)
    assert "resumed from" in proc.stdout + proc.stderr
    again = [[m[k] for k in keys] for m in read_metrics(tmp_path) if "train/loss" in m]
    assert len(first) == 4 and again == first


STOPS = ("SIGUSR1", "SIGINT")
# Runs the command in argv as a terminal would, Ctrl-C included: a shell's background job (CI
# started with `&`) ignores SIGINT, and a process started so ignores it too unless it is reset.
AS_FROM_A_TERMINAL = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory, small_files):
    """A trainer stopped by each of STOPS once 2 steps are logged, the two runs side by side
    (conftest's stop_side_by_side: each starts its own Ray and engines, about 13 s to its first
    step on 2 cores, much of it waiting on start-ups that overlap). {signal: (exit status or None,
    output, run folder, {pid: command line} of the processes below the trainer just before the
    signal, or None if it was never sent)}."""
    from common.serving.remote import _cmdline, _descendants

    assert not wait_until_no_ray(), f"Ray processes from before this test: {ray_processes()}"
    runs = {}
    for how in STOPS:
        folder = tmp_path_factory.mktemp(how)
        cmd = [
            sys.executable,
            "-c",
            AS_FROM_A_TERMINAL,
            str(ROOT / "recipes" / "grpo.py"),
            *REMOTE,
            "--max-staleness",
            "1",
            "--total-training-steps",
            "200",
            "--test-freq",
            "0",
            "--save-freq",
            "0",
            "--output-dir",
            str(folder / "run"),
            *small_files,
            *SMALL_STEPS,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
        runs[how] = (cmd, env, folder / "run", getattr(signal, how), None)
    done = stop_side_by_side(
        runs, before=lambda how, proc: {pid: _cmdline(pid) for pid in _descendants(proc.pid, "")}, timeout=300
    )
    wait_until_no_ray()  # each test checks its own run's processes; the autouse fixture, all of Ray
    return {how: (code, output, runs[how][2], below) for how, (code, output, below) in done.items()}


@pytest.mark.parametrize("how", STOPS)
def test_a_stopped_trainer_leaves_no_ray_process(stopped_runs, how):
    """The stop signal saves and exits 0; Ctrl-C ends the run at once. Either way the engines and
    the Ray the run started are gone (every process below the trainer when it was signalled, and,
    the fixture checks, every Ray process)."""
    code, output, run, below = stopped_runs[how]
    assert below is not None, f"the run ended before 2 steps were logged:\n{output[-3000:]}"
    assert code is not None, f"still running 120 s after {how}:\n{output[-6000:]}"
    assert any("raylet" in cmd for cmd in below.values()), f"the run started no Ray of its own: {below}"
    left = [f"{pid}: {cmd[:120]}" for pid, cmd in below.items() if running(pid)]
    assert not left, f"processes the run started outlived it: {left}"
    if how == "SIGUSR1":
        assert code == 0, output[-3000:]
        assert list((run / "checkpoints").glob("step_*"))
    else:
        assert code != 0


def test_distill_with_a_remote_teacher_trains_as_with_the_teacher_in_the_trainer(tmp_path, ray_cluster):
    """--teacher-placement remote under 2 FSDP2 trainer processes: two Ray engines serve the teacher's
    logprobs of both ranks' sampled tokens (through rank 0), and the run's every number is the run's
    with the teacher's sharded forward passes in the trainer (the same samples, the same teacher
    logprobs to float precision, so the same update)."""
    short = ["--total-training-steps", "2", *SMALL_STEPS, "--test-freq", "0", "--save-freq", "0", "--strategy", "fsdp2"]
    remote = ["--teacher-placement", "remote", "--teacher-num-engines", "2", "--ray-address", ray_cluster]
    with ThreadPoolExecutor(2) as pool:  # side by side: their start-ups (torchrun, imports, Ray actors) overlap
        runs = [
            pool.submit(run_recipe, "distill", *short, "--output-dir", tmp_path / name, *more, nproc=2)
            for name, more in (("local", []), ("remote", remote))
        ]
        for run in runs:
            run.result()
    local, remote = ([m for m in read_metrics(tmp_path / run) if "train/loss" in m] for run in ("local", "remote"))
    assert len(local) == len(remote) == 2
    for a, b in zip(local, remote):
        assert a["reward/mean"] == b["reward/mean"] and a["response/length_mean"] == b["response/length_mean"]
        for key in ("distill/reverse_kl", "train/loss", "train/grad_norm", "policy/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert local[1]["distill/reverse_kl"] != local[0]["distill/reverse_kl"]  # the second step's samples are new


@pytest.mark.parametrize("plant", [None, "stale", "lora", "stale-warn"])
def test_the_launch_check_proves_the_remote_engines_sync(tmp_path, ray_cluster, monkeypatch, plant):
    """--check (on by default) before step 1: with the sync sound (a LoRA policy's merged weights),
    every item passes and prints its figure; with a planted stale sync (the engines keep their first
    weights) or a planted LoRA sync that sends the base weights without the adapter, the weight-sync
    item fails and the run stops (exit 1) with what to check; under --check warn the stale run goes
    on, warned. (A LoRA run resumed on remote engines: the resume test below.)"""
    import common.serving.weight_sync
    from common.serving.remote import RemoteEngines

    if plant and plant.startswith("stale"):
        real = RemoteEngines.update_weights

        def stale(self, version, engines=None):  # the first sync (at start) only
            if self.weight_version < 0:
                return real(self, version, engines)
            self.weight_version = version if engines is None else self.weight_version

        monkeypatch.setattr(RemoteEngines, "update_weights", stale)
    if plant == "lora":
        monkeypatch.setattr(common.serving.weight_sync, "_delta", lambda layer: 0.0)
    lora = ["--lora-rank", "8", "--lora-alpha", "16"] if plant in (None, "lora") else []
    warn = {"stale-warn": ["--check", "warn"]}.get(plant, [])
    proc = run_recipe(
        "grpo",
        "--rollout-placement",
        "remote",
        "--num-rollout-engines",
        "1",
        "--total-training-steps",
        "1",
        *SMALL_STEPS,
        "--test-freq",
        "0",
        "--save-freq",
        "0",
        "--output-dir",
        tmp_path,
        "--ray-address",
        ray_cluster,
        *lora,
        *warn,
        check=plant in (None, "stale-warn"),
    )
    if plant is None:
        for item in ("engine logprobs", "weight sync", "packing", "rewards"):
            assert f"check {item:<16} pass" in proc.stdout, proc.stdout
        served = float(proc.stdout.split("after the sync the engine is ")[1].split(" ")[0])
        assert served < 1e-5, proc.stdout  # the LoRA's merged weights, within float32 rounding
        return
    if plant == "stale-warn":
        assert (
            "check weight sync      FAIL" in proc.stdout and "warning: weight sync: the engine does not" in proc.stdout
        )
        assert "1 steps in" in proc.stdout
        return
    assert proc.returncode == 1 and "check weight sync      FAIL" in proc.stderr, proc.stderr[-2000:]
    assert "weight sync: the engine does not serve the weights the trainer synced" in proc.stderr
    assert ("without the trainer's current adapter" in proc.stderr) == (plant == "lora")
    assert (
        "train/loss" not in (tmp_path / "metrics.jsonl").read_text() if (tmp_path / "metrics.jsonl").exists() else True
    )


@pytest.mark.parametrize(
    "sampling",
    [["--check-freq", "3"], ["--check-freq", "3", "--top-k", "50"], ["--rollout-is", "token"], []],
    ids=["gap-whole", "gap-top-k", "probe-rollout-is", "probe"],
)
def test_check_freq_stops_a_run_whose_engine_went_stale_with_a_checkpoint(tmp_path, ray_cluster, monkeypatch, sampling):
    """The syncs after the launch check send the start's weights again (planted), so the engine holds the version it
    was sent with stale weights. The probe after every sync (--check-freq 1, the default) catches it at once: the run
    stops after step 1, before the engine samples again, naming the engine and the version it claims. With the probe
    every 3 syncs, the gap the run logs each step proves it a step later, sampling the whole distribution or a
    truncated one (--top-k: the trainer replays the kept set): step 2's samples (the engine's old weights) are away
    from the trainer's step-1 weights past the float32 bounds, and the run saves step 2's checkpoint and stops (exit
    1) naming the gap. Under --rollout-is the run expects a gap, so only the probe proves the sync."""
    from conftest import read_metrics

    import common.serving.remote

    real, first = common.serving.remote.hf_weights, []

    def stale_after_the_check(model):  # the start's sync and the check's two send the trainer's weights
        first.append(len(first) or [(name, tensor.detach().clone()) for name, tensor in real(model)])
        return iter(first[0]) if len(first) > 3 else real(model)  # later syncs: the start's weights again

    monkeypatch.setattr(common.serving.remote, "hf_weights", stale_after_the_check)
    proc = run_recipe(
        "grpo",
        "--rollout-placement",
        "remote",
        "--num-rollout-engines",
        "1",
        "--total-training-steps",
        "4",
        *SMALL_STEPS,
        "--test-freq",
        "0",
        "--save-freq",
        "0",
        "--output-dir",
        tmp_path,
        "--ray-address",
        ray_cluster,
        *sampling,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    steps = [m for m in read_metrics(tmp_path) if "train/loss" in m]
    if "--check-freq" in sampling:
        assert "step 2: the engine's logprobs of its sampled tokens are" in proc.stderr, proc.stderr[-2000:]
        assert "past the float32 bound 0.0001" in proc.stderr
        assert "stopped after step 2 of 4; checkpoint" in proc.stderr and (tmp_path / "checkpoints" / "step_2").is_dir()
        assert len(steps) == 2 and steps[1]["rollout/logprob_diff_mean"] > 1e-4 >= steps[0]["rollout/logprob_diff_mean"]
        assert "check/engine_gap_mean" not in steps[0]  # no probe: the logged gap is the proof
        return
    assert "step 1: after the sync to version 1, RemoteEngines's logprobs of the probe" in proc.stderr
    assert "the engine holds version 1" in proc.stderr and "stopped after step 1 of 4; checkpoint" in proc.stderr
    assert (tmp_path / "checkpoints" / "step_1").is_dir()
    assert len(steps) == 1 and steps[0]["check/engine_gap_mean"] > 1e-3
