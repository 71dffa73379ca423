"""The exceptions every layer raises (a usage error, bad data, a stopped run), and how a recipe reports them."""

import contextlib
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from common import watchdog

# Flags whose value the user gave another way (common.formats.verl: a verl key, or verl's default for a key
# the command left out) -> how, so that a usage error naming the flag names what the user typed.
ORIGINS: dict[str, str] = {}
# Set by `python -m common.check RECIPE`: the run ends after its launch check (exit 0); the check's
# own child runs (common.proofs.resume_proof) are started without it.
STOP_AFTER_CHECK = "RECIPES_STOP_AFTER_CHECK"


class UsageError(ValueError):
    """Input the user can fix (a flag, a path, a file, a row): reported as one short message that
    names it and says what to change, without a traceback, and exit status 2 (usage_errors)."""


class DataError(UsageError):
    """A data file or row that cannot be used as given (the message names it)."""


class RunStopped(RuntimeError):
    """A run that cannot go on, for a reason its message explains in full (a NaN loss at step N,
    say): reported like a UsageError but with exit status 1."""


@contextlib.contextmanager
def usage_errors():
    """Wraps a recipe's `main(tyro.cli(Args))`: a UsageError is printed as `error: <message>` on stderr
    (once per launch: report_once) with exit status 2, as tyro does for a bad flag; a RunStopped likewise,
    with status 1. Other exceptions keep their traceback. The watchdog is disarmed however the run ends."""
    try:
        yield
    except (UsageError, RunStopped) as e:
        named = [(flag.replace("_", "-"), how) for flag, how in ORIGINS.items() if _names(str(e), flag)]
        report_once(f"error: {e}" + "".join(f"\n  (--{flag} came from {how})" for flag, how in named))
        raise SystemExit(2 if isinstance(e, UsageError) else 1) from None
    finally:
        watchdog.disarm()


def _names(message: str, field: str) -> bool:
    """Whether message names the flag of `field` (as --the-flag or the_field, a word of its own)."""
    return bool(re.search(rf"(?<![\w-])(--{re.escape(field.replace('_', '-'))}|{re.escape(field)})(?![\w-])", message))


def report_once(line: str, wait: float = 10.0) -> None:
    """Print `line` on stderr once for all the processes of one launch on this machine. Every rank
    usually meets the same bad input; if only rank 0 printed, a rank that exits first gets rank 0
    killed by the launcher before it prints. So the first to create a marker file prints, and the
    others wait (up to `wait` seconds) until it has, so that their exit cannot cut it off."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        print(line, file=sys.stderr, flush=True)
        return
    folder = Path(tempfile.gettempdir()) / f"recipes-reported-{os.getuid()}"
    marker = folder / _launch_id()
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and marker.stat().st_size == 0:
            time.sleep(0.02)
        return
    except OSError:  # no temporary folder to agree in: each rank prints
        print(line, file=sys.stderr, flush=True)
        return
    print(line, file=sys.stderr, flush=True)
    os.write(fd, b"printed\n")
    os.close(fd)
    for old in folder.iterdir():  # earlier launches' markers: no later launch shares their names
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_mtime > 86400:
                old.unlink()


def _launch_id() -> str:
    """What the processes of one launch on one machine share and no other launch does: their
    launcher (the parent process, with its start time, as pids are reused) and its run id and port."""
    parent = os.getppid()
    try:  # field 22 of /proc/<pid>/stat, after the parenthesised command name
        started = Path(f"/proc/{parent}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        started = "?"
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return f"{run}-{parent}-{started}-{os.environ.get('MASTER_PORT', '')}"
