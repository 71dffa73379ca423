"""One live run per run folder (and per generate / evaluate output): a lock file that names the
process holding it, taken before a run reads or writes anything there, removed when it exits.

Why not an OS lock alone: folders shared between nodes sit on NFS, Lustre or GPFS, where advisory
locks are sometimes off (NFS mounted `nolock`, Lustre without `-o flock`) and then silently succeed.
On its host, the holder's pid and process start time say whether it still runs: a killed run's lock
is taken over, with a line. From another host nothing can tell, so only a later attempt of the same
Slurm job (same SLURM_JOB_ID, higher SLURM_RESTART_COUNT: Slurm requeues once the last attempt has
ended) or --force-unlock takes it over. The lock is created with O_EXCL and taken over in one
rename, both atomic across nodes on NFS (v3 and later), Lustre and GPFS."""

import atexit
import contextlib
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from common import watchdog
from common.errors import UsageError
from common.parallel import Dist, broadcast_object

log = logging.getLogger(__name__)


def claim_run_dir(folder, dist: Dist, force_unlock: bool = False) -> Path:
    """Take `folder`/run.lock for this run (claim); the ranks' watchdogs now share their state there."""
    folder = Path(folder)
    claim(folder / "run.lock", f"run folder {folder}", "--output-dir", dist, force_unlock)
    watchdog.share_state_in(folder)
    return folder


def claim_output(path, dist: Dist | None = None, force_unlock: bool = False, flag: str = "--output-path") -> Path:
    """Take <path>.lock for a generate / evaluate output file (claim; `flag` names the file)."""
    path = Path(path)
    claim(path.with_name(path.name + ".lock"), f"output {path}", flag, dist, force_unlock)
    return path


def claim(lock: Path, what: str, flag: str, dist: Dist | None, force_unlock: bool) -> None:
    """Process 0 takes the lock (take_lock); every process raises the same UsageError if it is refused."""
    refused = None
    if dist is None or dist.is_main:
        try:
            take_lock(lock, what, flag, force_unlock)
        except UsageError as e:
            refused = str(e)
    if dist is not None:
        refused = broadcast_object(refused)
    if refused:
        raise UsageError(refused)


def take_lock(path: Path, what: str, flag: str, force: bool = False) -> None:
    """Create the lock file `path` naming this process, or take over one whose holder is gone; a live or
    unknowable holder is a UsageError saying what to do (`flag` picks another place). Released at exit."""
    me = holder()
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(200):  # each pass takes the lock, refuses, or finds another process taking it over
        with contextlib.suppress(FileExistsError):
            with os.fdopen(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644), "w") as f:
                _write(f, me)
            break
        held, seen = _read(path)
        if seen is None:  # released meanwhile
            continue
        reason = _gone(held, me, force)
        if reason is None:
            raise UsageError(_refusal(what, flag, held, me))
        if _take_over(path, seen, me):
            if held is None or held.get("pid") != me["pid"] or held.get("host") != me["host"]:
                taken = f"the lock of {describe(held)}" if held else "an unreadable lock"
                log.warning("%s: taking over %s: %s", what, taken, reason)
            break
        time.sleep(0.05)
    else:
        raise UsageError(f"{what}: {path} kept changing while this run looked; start one run at a time")
    atexit.register(release, path, me)


def release(path: Path, me: dict) -> None:
    """Remove the lock if it is still this process's (a run that took it over since keeps it)."""
    if _read(path)[0] == me:
        path.unlink(missing_ok=True)


def holder() -> dict:
    """This process as a lock names it."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start": process_start_of(os.getpid()),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "command": " ".join(sys.argv)[:300],
    }


def describe(held: dict) -> str:
    job = f", Slurm job {held['slurm_job']}" if held.get("slurm_job") else ""
    command = held.get("command") or "command unknown"
    return f"pid {held.get('pid')} on {held.get('host')}{job}, started {held.get('started')} ({command})"


def _gone(held: dict | None, me: dict, force: bool) -> str | None:
    """Why the holder's lock may be taken over (it no longer runs, or --force-unlock), or None."""
    if held is None:
        return "--force-unlock (the lock file is unreadable)" if force else None
    if held.get("host") == me["host"]:
        if held.get("pid") == me["pid"] and held.get("process_start") == me["process_start"]:
            return "an earlier run in this same process"  # a notebook or a test calling main again
        return None if _alive(held.get("pid"), held.get("process_start")) else f"its process {held.get('pid')} is gone"
    same_job = me["slurm_job"] is not None and held.get("slurm_job") == me["slurm_job"]
    if same_job and isinstance(held.get("slurm_restart"), int) and held["slurm_restart"] < me["slurm_restart"]:
        return f"an earlier attempt of Slurm job {me['slurm_job']}, which has ended (this is a requeued attempt)"
    return "--force-unlock" if force else None


def _refusal(what: str, flag: str, held: dict | None, me: dict) -> str:
    if held is None:
        return (
            f"{what} has a lock file that cannot be read (damaged, or written this instant); if no run uses "
            f"it, pass --force-unlock, else give this run another {flag}"
        )
    if held.get("host") == me["host"]:
        return (
            f"{what} is in use by a live run: {describe(held)}. Wait for it to end, stop it (kill "
            f"{held.get('pid')}), or give this run another {flag}"
        )
    return (
        f"{what} is locked by a run on another host: {describe(held)}; from {me['host']} there is no telling "
        f"whether it still runs. If it does not (its job ended, its node died), pass --force-unlock; else "
        f"give this run another {flag}"
    )


def _read(path: Path) -> tuple[dict | None, os.stat_result | None]:
    """The lock's holder (None if unreadable) and the file's identity (None if there is no lock).
    A lock is written right after it is created: an empty one is given a moment to fill."""
    for _ in range(20):
        try:
            seen = path.stat()
            text = path.read_text()
        except FileNotFoundError:
            return None, None
        try:
            held = json.loads(text)
            return (held if isinstance(held, dict) else None), seen
        except ValueError:
            time.sleep(0.05)
    return None, seen


def _write(f, me: dict) -> None:
    json.dump(me, f)
    f.flush()
    os.fsync(f.fileno())


def _take_over(path: Path, seen: os.stat_result, me: dict) -> bool:
    """Replace the lock judged dead with this process's unless it changed since; one process at a time
    (path.takeover, made with O_EXCL, is the turn), in one rename, so no run finds the folder unlocked."""
    turn = path.with_name(path.name + ".takeover")
    try:
        os.close(os.open(turn, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        # a takeover takes milliseconds: an old turn file is one a killed process left
        with contextlib.suppress(FileNotFoundError):
            if time.time() - turn.stat().st_mtime > 30:
                turn.unlink(missing_ok=True)
        return False
    try:
        try:
            now = path.stat()
        except FileNotFoundError:
            return False
        if (now.st_ino, now.st_size, now.st_mtime_ns) != (seen.st_ino, seen.st_size, seen.st_mtime_ns):
            return False
        mine = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}")
        with open(mine, "w") as f:
            _write(f, me)
        os.replace(mine, path)
        return True
    finally:
        turn.unlink(missing_ok=True)


def process_start_of(pid: int) -> str | None:
    """Boot id and start tick of `pid`, to tell it from a later process with its pid; None where /proc cannot say."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ticks = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
    return f"{boot}:{ticks}"


def _alive(pid, process_start: str | None) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        pass
    with contextlib.suppress(OSError, IndexError):  # a killed process its parent has not reaped yet is gone too
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return process_start is None or process_start_of(pid) in (None, process_start)
