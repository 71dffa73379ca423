"""common.watchdog (--wait-timeout): no silent hang. A run that stops making progress prints who
waits on whom (rank, step, policy version, the wait it is in and its caller, the last collective,
the other ranks) and ends with exit status 124 within the deadline. Planted hangs: a rank stuck
outside any wait while its peer waits in a collective (here); a remote engine that never answers
(tests/test_remote.py::test_a_hung_engine_is_named_within_the_timeout) or never takes the weights
(::test_a_weight_stream_to_a_hung_engine_is_named_within_the_timeout); the vLLM engine's generate
(tests/test_vllm.py::test_a_hung_vllm_generate_ends_the_run_with_the_dump). Reward, tool and
environment workers have their own deadlines that end a call, never the run (tests/test_rewards.py,
tests/test_agent.py, tests/test_envs.py)."""

import json
import os
import re
import time

import pytest
from conftest import run_recipe

from common import watchdog


def wait_in_a_collective(what: str) -> str:
    with watchdog.waiting(what, collective=True):
        return watchdog.report()


def test_the_report_names_the_wait_its_caller_the_step_and_the_last_collective(tmp_path):
    watchdog.arm(1000.0, rank=3)
    try:
        watchdog.note(step=7, version=6)
        watchdog.probe("rollout engines", lambda: "2 engines; step 8: 1 chunk(s) in flight")
        watchdog.probe("broken", lambda: 1 / 0)
        inside = wait_in_a_collective("all_reduce_sum")
        assert "rank 3 (pid" in inside and "step 7, policy version 6" in inside
        assert re.search(
            r"waits in all_reduce_sum since \d+\.\ds ago \(from tests/test_watchdog.py:\d+ in wait_in_a_c", inside
        ), inside
        assert "last collective completed: none yet" in inside
        assert "rollout engines: 2 engines; step 8: 1 chunk(s) in flight" in inside
        assert "broken: unavailable (ZeroDivisionError" in inside, "a failing probe hides nothing else"
        after = watchdog.report()
        assert "in no wait on another process" in after and "main thread's stack" in after
        assert "last collective completed: all_reduce_sum (from tests/test_watchdog.py:" in after
    finally:
        watchdog.disarm()


def test_the_deadline_counts_from_the_last_progress_and_a_longer_wait_holds_it_off():
    assert watchdog._deadline() is None, "disarmed: no deadline"
    start = time.monotonic()
    watchdog.arm(10.0)
    try:
        assert start <= watchdog._deadline() - 10.0 <= time.monotonic()
        with watchdog.waiting("--check full's child runs", timeout=500.0):
            assert watchdog._deadline() >= start + 500.0
        watchdog._armed["progress"] -= 30.0  # as if 30 s passed without progress
        assert watchdog._deadline() < time.monotonic()
    finally:
        watchdog.disarm()


class DisarmedOnSecondRead(dict):
    """The watchdog's settings as the watching thread sees them when disarm() runs in the main
    thread between two of its reads of the timeout."""

    reads = 0

    def __getitem__(self, key):
        if key == "timeout":
            self.reads += 1
            if self.reads > 1:
                return None
        return super().__getitem__(key)


def test_a_disarm_racing_the_watching_thread_reads_as_disarmed(monkeypatch):
    """The watching thread reads the deadline once a second while a run in this process may end
    (disarm) at any moment: the deadline is one reading of the timeout, never a sum with the None a
    disarm leaves (in CI this killed the thread with a TypeError, leaving later runs unwatched)."""
    armed = DisarmedOnSecondRead(watchdog._armed, timeout=5.0, progress=time.monotonic())
    monkeypatch.setattr(watchdog, "_armed", armed)
    assert watchdog._deadline() == armed["progress"] + 5.0
    assert watchdog._deadline() is None


def test_every_rank_writes_where_it_is_for_the_others(tmp_path):
    watchdog.arm(1000.0, rank=1)
    try:
        watchdog.share_state_in(tmp_path)
        watchdog.note(step=2)
        with watchdog.waiting("barrier", collective=True):
            watchdog._publish()
        state = json.loads((tmp_path / ".watchdog" / "rank_1.json").read_text())
        assert state["rank"] == 1 and state["step"] == 2 and state["wait"].startswith("barrier (from tests/")
        other = dict(state, rank=0, wait=None, idle_s=12.5)
        (tmp_path / ".watchdog" / "rank_0.json").write_text(json.dumps(other))
        old = dict(other, rank=5, at=time.time() - 3600)  # an earlier run's, in the same folder
        (tmp_path / ".watchdog" / "rank_5.json").write_text(json.dumps(old))
        peers = watchdog._peers(1)
        assert len(peers) == 1 and "rank 0 (pid" in peers[0] and "step 2, in no wait; no progress for 12.5s" in peers[0]
    finally:
        watchdog.disarm()
    assert not (tmp_path / ".watchdog" / "rank_1.json").exists(), "a run that ended leaves no state behind"


PLANT = """
import os, time
if os.environ.get("RANK") == "1":  # rank 1 stops in step 2's rollout, outside any wait
    import common.rollout
    from common import watchdog
    real = common.rollout.generate_and_score
    def generate_and_score(*args, **kwargs):
        if watchdog._state["step"] == 2:
            open(os.environ["PLANT_MARK"], "w").write(str(time.time()))
            time.sleep(600)
        return real(*args, **kwargs)
    common.rollout.generate_and_score = generate_and_score
"""


@pytest.mark.e2e
def test_a_rank_stuck_outside_a_wait_ends_the_launch_within_the_deadline_with_who_waits_on_whom(tmp_path, small_files):
    """2 processes; rank 1 hangs in step 2 (a planted sleep). Rank 0 waits for it in a collective.
    After --wait-timeout 8 s without progress a rank prints the dump and exits 124, and torchrun
    ends the launch: the dump shows rank 0 in its collective with its caller in the recipe and
    rank 1 in no wait at step 2 (each rank's own line, or the other's from its state file). It
    ends within the deadline plus start-up slack, not after the planted 600 s."""
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(PLANT)
    mark = tmp_path / "hung_at"
    env = {"PYTHONPATH": os.pathsep.join([str(plant), os.environ.get("PYTHONPATH", "")]), "PLANT_MARK": str(mark)}
    proc = run_recipe(
        "grpo",
        "--output-dir",
        tmp_path / "run",
        *small_files,
        "--train-batch-size",
        "8",
        "--rollout-n",
        "4",
        "--no-val-before-train",
        "--test-freq",
        "0",
        "--save-freq",
        "0",
        "--total-training-steps",
        "3",
        "--wait-timeout",
        "8",
        nproc=2,
        env=env,
        check=False,
        timeout=400,
    )
    ended = time.time()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and mark.exists(), out[-3000:]
    assert ended - float(mark.read_text()) < 8 + 45, "ended long after the deadline"
    assert "exitcode  : 124" in out or "exitcode: 124" in out.replace("  ", " "), out[-3000:]
    assert "error: no progress for 8s (--wait-timeout)" in out, out[-3000:]
    # Whichever rank's watchdog speaks first (rank 1, idle longest, usually) names the other from
    # its state file, and torchrun may end the other before it speaks: read the dumps together.
    dumps = "".join(out.split("error: no progress for 8s")[1:])
    assert re.search(
        r"rank 0 \(pid \d+ on [^)]+\): step 2, policy version 1\n  waits in [^\n]+called from "
        r"recipes/grpo.py:\d+ in \w+",
        dumps,
    ) or re.search(
        r"rank 0 \(pid \d+ on [^,]+, as of \d+s ago\): "
        r"step 2, waits in [^\n]+called from recipes/grpo.py:\d+ in \w+",
        dumps,
    ), dumps[:3000]
    assert re.search(
        r"rank 1 \(pid \d+ on [^)]+\): step 2, policy version 1\n  in no wait on another process", dumps
    ) or re.search(
        r"rank 1 \(pid \d+ on [^,]+, as of \d+s ago\): step 2, in no wait; no "
        r"progress for",
        dumps,
    ), dumps[:3000]
    if "\nrank 1 (pid" in dumps:  # rank 1's own dump shows where it is stuck
        assert "sitecustomize.py" in dumps.split("\nrank 1 (pid")[1], dumps[:3000]
