"""The two exceptions every layer raises, and how a recipe reports them (the bottom layer)."""

import contextlib
import os
import sys


class UsageError(ValueError):
    """Input the user can fix (a flag, a path, a file, a row): reported as one short message that
    names it and says what to change, without a traceback, and exit status 2 (usage_errors)."""


class RunStopped(RuntimeError):
    """A run that cannot go on, for a reason its message explains in full (a NaN loss at step N,
    say): reported like a UsageError but with exit status 1."""


@contextlib.contextmanager
def usage_errors():
    """Wraps a recipe's `main(tyro.cli(Args))`: a UsageError is printed as `error: <message>` on
    stderr (once, by rank 0) and the process exits with status 2, as tyro does for a bad flag; a
    RunStopped is printed the same way, with status 1. Any other exception keeps its traceback."""
    try:
        yield
    except (UsageError, RunStopped) as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2 if isinstance(e, UsageError) else 1) from None
