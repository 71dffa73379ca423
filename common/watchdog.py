"""No silent hang: a run stuck for --wait-timeout seconds says who waits on whom and exits HANG_EXIT.

Every cross-process wait in common/ (collectives, engine requests, remote engines' Ray calls and
weight stream, checkpoint saves) runs inside `waiting(what)`; compute in between calls `progress()`.
A daemon thread looks once a second: after the timeout with no progress (or a wait's own longer
deadline, like --check full's child runs) it prints the dump to stderr and ends the process. The
dump names this rank, its step and policy version (`note`), its wait, since when and its caller in
the recipe, the last collective completed, live figures other modules register (`probe`) and where
every other rank is (each rank writes its state to the run folder every second), so a rank stuck in
compute is named by its peers. Torch's collectives and kernels release the interpreter, so the
thread runs while a rank blocks in one."""

import contextlib
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

HANG_EXIT = 124  # as timeout(1) exits

_lock = threading.Lock()
_state: dict = {"rank": 0, "step": None, "version": None}
_waits: list[SimpleNamespace] = []  # the waits in progress (what, timeout, start, caller), every thread's, oldest first
_last_collective: list = [None]  # (what, caller, finished at)
_probes: dict = {}
_armed: dict = {"timeout": None, "progress": 0.0, "folder": None, "shared_since": 0.0, "thread": None, "generation": 0}


def _caller() -> str:
    """Who asked for the wait: the first frame outside this module, parallel.py and contextlib."""
    skip = (__file__, os.path.join(os.path.dirname(__file__), "parallel.py"), contextlib.__file__)
    found = []
    for frame, line in traceback.walk_stack(sys._getframe(1)):
        name = frame.f_code.co_filename
        if name not in skip and (not found or f"{os.sep}recipes{os.sep}" in name):
            found.append(f"{_short(name)}:{line} in {frame.f_code.co_name}")
            if len(found) == 2 or f"{os.sep}recipes{os.sep}" in name:
                break
    return ", called from ".join(found) or "?"


def _short(path: str) -> str:
    parts = Path(path).parts
    anchor = next((a for a in ("recipes", "common", "tests") if a in parts), None)
    return "/".join(parts[parts.index(anchor) :]) if anchor else Path(path).name


def arm(timeout: float, rank: int = 0) -> None:
    """Start watching this process (the recipes: init_distributed, from --wait-timeout)."""
    with _lock:
        _armed.update(timeout=float(timeout), progress=time.monotonic(), generation=_armed["generation"] + 1)
        _state["rank"] = rank
        if _armed["thread"] is None or not _armed["thread"].is_alive():
            _armed["thread"] = threading.Thread(target=_watch, name="watchdog", daemon=True)
            _armed["thread"].start()


def disarm() -> None:
    """Stop watching (the run ended; an in-process caller goes on with other work)."""
    with _lock:
        if _armed["folder"] is not None:
            with contextlib.suppress(OSError):
                (_armed["folder"] / f"rank_{_state['rank']}.json").unlink(missing_ok=True)
        _armed.update(timeout=None, folder=None)
        _state.update(step=None, version=None)
        _probes.clear()
        _last_collective[0] = None  # a later run in this process starts with none


def share_state_in(folder) -> None:
    """Where the ranks of this launch write their state for each other's dumps (the run folder)."""
    path = Path(folder) / ".watchdog"
    path.mkdir(parents=True, exist_ok=True)
    _armed.update(folder=path, shared_since=time.time())


def note(**state) -> None:
    """The run's position for the dump: step=, version= (the policy version the engine serves)."""
    _state.update(state)
    progress()


def probe(name: str, figures) -> None:
    """A live figure for the dump: figures() -> str (queue depths, requests in flight, ...)."""
    _probes[name] = figures


def progress() -> None:
    _armed["progress"] = time.monotonic()


@contextlib.contextmanager
def waiting(what: str, timeout: float | None = None, collective: bool = False):
    """A wait on another process. `timeout`: its own deadline from the wait's start, longer than --wait-timeout."""
    wait = SimpleNamespace(what=what, timeout=timeout, start=time.monotonic(), caller=_caller())
    with _lock:
        _waits.append(wait)
    progress()
    try:
        yield
    finally:
        with _lock:
            _waits.remove(wait)
        if collective:
            _last_collective[0] = (what, wait.caller, time.monotonic())
        progress()


def _deadline() -> float | None:
    with _lock:  # disarm() may clear the timeout meanwhile: read it once, under the lock
        timeout = _armed["timeout"]
        if timeout is None:
            return None
        return max([_armed["progress"] + timeout, *(w.start + w.timeout for w in _waits if w.timeout)])


def _ago(t: float) -> str:
    return f"{time.monotonic() - t:.1f}s ago"


def _where() -> dict:
    """This rank's state, as its peers read it."""
    with _lock:
        wait = _waits[-1] if _waits else None
    return {
        "rank": _state["rank"],
        "step": _state["step"],
        "version": _state["version"],
        "pid": os.getpid(),
        "host": os.uname().nodename,
        "wait": wait and f"{wait.what} (from {wait.caller})",
        "waiting_s": wait and round(time.monotonic() - wait.start, 1),
        "idle_s": round(time.monotonic() - _armed["progress"], 1),
        "at": time.time(),
    }


def report(stack: bool = True) -> str:
    """Who waits on whom, as this rank sees it (also in other modules' timeout messages), and the main
    thread's innermost frames if `stack`."""
    me = _where()
    lines = [f"rank {me['rank']} (pid {me['pid']} on {me['host']}): step {me['step']}, policy version {me['version']}"]
    with _lock:
        waits = [f"  waits in {w.what} since {_ago(w.start)} (from {w.caller})" for w in _waits]
    lines += waits or [f"  in no wait on another process; no progress for {me['idle_s']}s (its stack below)"]
    last = _last_collective[0]
    lines.append(
        f"  last collective completed: {last[0]} (from {last[1]}), {_ago(last[2])}"
        if last
        else "  last collective completed: none yet"
    )
    for name, figures in list(_probes.items()):
        try:
            lines.append(f"  {name}: {figures()}")
        except Exception as e:  # a probe of a half-broken engine must not hide the rest of the dump
            lines.append(f"  {name}: unavailable ({type(e).__name__}: {e})")
    lines += _peers(me["rank"])
    if stack:
        frames = traceback.format_stack(sys._current_frames().get(threading.main_thread().ident))
        lines.append("  main thread's stack (innermost last):")
        lines += ["    " + line.strip().replace("\n", "\n    ") for line in frames[-6:]]
    return "\n".join(lines)


def _peers(rank: int) -> list[str]:
    folder = _armed["folder"]
    if folder is None:
        return []
    out = []
    for path in sorted(folder.glob("rank_*.json"), key=lambda p: int(p.stem.split("_")[1])):
        try:
            peer = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if peer["rank"] == rank or peer["at"] < _armed["shared_since"] - 10:  # an earlier run's
            continue
        where = (
            f"waits in {peer['wait']} for {peer['waiting_s']}s"
            if peer["wait"]
            else (f"in no wait; no progress for {peer['idle_s']}s")
        )
        out.append(
            f"  rank {peer['rank']} (pid {peer['pid']} on {peer['host']}, as of {time.time() - peer['at']:.0f}s "
            f"ago): step {peer['step']}, {where}"
        )
    return out


def _publish() -> None:
    folder = _armed["folder"]
    if folder is None:
        return
    path = folder / f"rank_{_state['rank']}.json"
    with contextlib.suppress(OSError):  # the run folder went away: the dump has this rank's own state
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(_where()))
        tmp.replace(path)


def _watch() -> None:
    while True:
        time.sleep(1.0)
        deadline = _deadline()
        if deadline is None:
            continue
        _publish()
        generation, timeout = _armed["generation"], _armed["timeout"]
        if deadline > time.monotonic() or timeout is None:  # None: disarmed since the deadline was read
            continue
        message = (
            f"\nerror: no progress for {timeout:g}s (--wait-timeout): the run is stuck waiting, and "
            f"ends here (exit {HANG_EXIT}) instead of blocking forever.\n{report()}\n"
            f"Raise --wait-timeout if a step's phase legitimately takes longer (a long generation, a large save)."
        )
        if _armed["generation"] != generation or _deadline() is None:
            continue  # re-armed or disarmed meanwhile
        _publish()
        print(message, file=sys.stderr, flush=True)
        os._exit(HANG_EXIT)
