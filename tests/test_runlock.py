"""common.runlock: one live run per run folder. A lock names its holder; a live one on this host
is refused, a dead one taken over with a line, one from another host refused unless it is an
earlier attempt of the same Slurm job or --force-unlock says so, and of several processes racing
for a dead holder's lock exactly one wins. (tests/test_preemption.py starts a second grpo.py on a
live run's folder; tests/test_bad_input.py runs every recipe on a locked folder.)"""

import json
import logging
import multiprocessing
import os
import socket
import subprocess
import sys

import pytest

from common.errors import UsageError
from common.runlock import claim_output, describe, holder, process_start_of, release, take_lock


def lock_of(path, **changes) -> dict:
    """A holder as take_lock writes it, with `changes`, written to path."""
    held = {**holder(), "command": "python recipes/grpo.py --output-dir x", **changes}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(held))
    return held


@pytest.fixture
def sleeper():
    """A live process of this host that is not this one."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_lock_names_its_holder_and_is_removed_when_it_ends(tmp_path):
    lock = tmp_path / "run.lock"
    take_lock(lock, "run folder x", "--output-dir")
    held = json.loads(lock.read_text())
    assert held == holder() | {"started": held["started"]}
    assert held["host"] == socket.gethostname() and held["pid"] == os.getpid()
    release(lock, held)
    assert not lock.exists()


def test_a_live_run_on_this_host_is_refused_naming_it(tmp_path, sleeper):
    lock = tmp_path / "run.lock"
    held = lock_of(lock, pid=sleeper.pid, process_start=process_start_of(sleeper.pid))
    with pytest.raises(UsageError) as e:
        take_lock(lock, "run folder x", "--output-dir")
    assert str(e.value).startswith("run folder x is in use by a live run: " + describe(held))
    assert f"kill {sleeper.pid}" in str(e.value) and "another --output-dir" in str(e.value)
    assert json.loads(lock.read_text()) == held, "the live run's lock is left alone"


def test_a_dead_or_reused_pid_is_taken_over_with_a_line(tmp_path, sleeper, caplog):
    """A killed run's pid is gone; a pid the system gave to another process since is not the run
    (its process started at another time). An earlier run in this same process is taken over
    without a word (a test or a notebook calling main twice)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock = tmp_path / "run.lock"
    for pid, start in ((int(dead.stdout), None), (sleeper.pid, "another-boot:123")):
        gone = lock_of(lock, pid=pid, process_start=start)
        with caplog.at_level(logging.WARNING, logger="common.runlock"):
            take_lock(lock, "run folder x", "--output-dir")
        assert f"run folder x: taking over the lock of {describe(gone)}: its process {pid} is gone" in caplog.text
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        caplog.clear()
    take_lock(lock, "run folder x", "--output-dir")
    assert not caplog.records


def test_another_hosts_lock_needs_the_same_slurm_job_or_force_unlock(tmp_path, monkeypatch, caplog):
    lock = tmp_path / "run.lock"
    lock_of(lock, host="gpu-b07", pid=4242, slurm_job="9001", slurm_restart=0)
    with pytest.raises(UsageError) as e:
        take_lock(lock, "run folder x", "--output-dir")
    message = str(e.value)
    assert message.startswith("run folder x is locked by a run on another host: pid 4242 on gpu-b07, Slurm job 9001")
    assert "pass --force-unlock" in message
    # The same job on another node, not a later attempt of it: as unknowable as any other host's run.
    monkeypatch.setenv("SLURM_JOB_ID", "9001")
    with pytest.raises(UsageError, match="locked by a run on another host"):
        take_lock(lock, "run folder x", "--output-dir")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the requeued attempt: Slurm ended the first one
    with caplog.at_level(logging.WARNING, logger="common.runlock"):
        take_lock(lock, "run folder x", "--output-dir")
    assert "an earlier attempt of Slurm job 9001, which has ended" in caplog.text
    monkeypatch.delenv("SLURM_JOB_ID")
    lock_of(lock, host="gpu-b07", pid=4242)
    take_lock(lock, "run folder x", "--output-dir", force=True)
    assert json.loads(lock.read_text())["host"] == socket.gethostname()


def test_an_unreadable_lock_is_refused_unless_forced(tmp_path):
    lock = tmp_path / "run.lock"
    lock.write_text("{not json")
    with pytest.raises(UsageError, match="a lock file that cannot be read"):
        take_lock(lock, "run folder x", "--output-dir")
    take_lock(lock, "run folder x", "--output-dir", force=True)
    assert json.loads(lock.read_text())["pid"] == os.getpid()


def test_release_leaves_a_lock_another_run_took_over(tmp_path):
    lock = tmp_path / "run.lock"
    take_lock(lock, "run folder x", "--output-dir")
    mine = json.loads(lock.read_text())
    theirs = lock_of(lock, pid=mine["pid"] + 1)
    release(lock, mine)
    assert json.loads(lock.read_text()) == theirs


def _contend(lock, start, results, hold):
    start.wait()
    try:
        take_lock(lock, "run folder x", "--output-dir")
        results.put("took")
    except UsageError as e:
        results.put("live" if "in use by a live run" in str(e) else str(e))
    hold.wait()  # stay alive until every contender has looked: a live winner must be refused


def test_of_processes_racing_for_a_dead_runs_lock_one_wins(tmp_path):
    lock = tmp_path / "run.lock"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock_of(lock, pid=int(dead.stdout), process_start=None)
    ctx = multiprocessing.get_context("fork")
    start, hold, results = ctx.Barrier(6), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(lock, start, results, hold)) for _ in range(6)]
    for p in procs:
        p.start()
    outcomes = sorted(results.get(timeout=60) for _ in procs)
    hold.set()
    for p in procs:
        p.join(timeout=60)
    assert outcomes == ["live"] * 5 + ["took"], outcomes
    assert json.loads(lock.read_text())["pid"] in {p.pid for p in procs}
    assert sorted(x.name for x in tmp_path.iterdir()) == ["run.lock"], "no lock set aside is left behind"


def test_an_output_file_is_locked_beside_it(tmp_path, sleeper):
    out = tmp_path / "gen.parquet"
    lock_of(out.with_name("gen.parquet.lock"), pid=sleeper.pid, process_start=process_start_of(sleeper.pid))
    with pytest.raises(UsageError, match=r"output .*gen.parquet is in use by a live run: .* another --output-json"):
        claim_output(out, flag="--output-json")


def test_a_takeover_spares_a_lock_that_changed_since_it_was_judged(tmp_path, caplog):
    """The check between judging a holder dead and replacing its lock: a lock swapped in since
    (another process's takeover) stays. A turn file a killed takeover left is cleared after 30 s."""
    from common.runlock import _take_over

    lock = tmp_path / "run.lock"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock_of(lock, pid=int(dead.stdout), process_start=None)
    judged = lock.stat()
    lock_of(tmp_path / "newer", pid=os.getppid(), process_start=process_start_of(os.getppid()))
    os.replace(tmp_path / "newer", lock)
    assert not _take_over(lock, judged, holder())
    assert json.loads(lock.read_text())["pid"] == os.getppid()

    lock_of(lock, pid=int(dead.stdout), process_start=None)
    turn = tmp_path / "run.lock.takeover"
    turn.write_text("")
    os.utime(turn, (0, 0))
    take_lock(lock, "run folder x", "--output-dir")
    assert json.loads(lock.read_text())["pid"] == os.getpid() and not turn.exists()


def test_evaluate_refuses_an_output_another_run_writes(tmp_path, sleeper):
    """evaluate.py locks each file it writes: its JSON and, with --output-scores, the scores too."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import load_recipe

    ev = load_recipe("evaluate")
    data = tmp_path / "gen.parquet"
    row = {
        "data_source": "bundled/addition",
        "reward_model": {"ground_truth": "3"},
        "responses": ["<answer>3</answer>"],
    }
    pq.write_table(pa.Table.from_pylist([row]), data)
    scores = tmp_path / "scores.parquet"
    lock_of(scores.with_name("scores.parquet.lock"), pid=sleeper.pid, process_start=process_start_of(sleeper.pid))
    with pytest.raises(
        UsageError, match=r"output .*scores.parquet is in use by a live run: .* another --output-scores"
    ):
        ev.main(ev.Args(data_path=str(data), output_scores=str(scores)))
    assert not scores.exists() and not (tmp_path / "gen.eval.json").exists()
