"""`python -m common.check`: the launch check as a tool, without training (common.check's docstring).

python -m common.check --env                 # the environment report alone
python -m common.check grpo [grpo.py's flags] # the recipe up to its launch check, every probe and
                                              # --check full's child runs, then exit (0: passed)
"""

import os
import sys

from common.errors import STOP_AFTER_CHECK


def main(argv: list[str], environment_report) -> int:
    """`--env`: print the environment report. `RECIPE [FLAGS]`: run recipes/RECIPE.py with FLAGS up to the
    end of its launch check (data, models, engine as the flags say) and exit: 0 when every item passed,
    1 (with what to do) when one failed. Every probe runs, --check full's child runs included, unless
    FLAGS name another --check (fast: the probes a training run makes; warn is honoured). Without
    --output-dir the run folder is a temporary one, so no run of the user's is touched. environment_report:
    common.check's, handed down (this feature sits above it)."""
    import runpy
    import tempfile
    from pathlib import Path

    if not argv or argv[0] in ("-h", "--help"):
        print(main.__doc__)
        return 0
    if argv[0] == "--env":
        lines, warnings = environment_report()
        print("\n".join(["environment:", *lines, *(f"  warning: {w}" for w in warnings)]))
        return 0
    recipe = Path(__file__).resolve().parents[2] / "recipes" / f"{argv[0].removesuffix('.py')}.py"
    if not recipe.is_file():
        print(f"error: no recipe {argv[0]!r}: name one of recipes/*.py, e.g. grpo", file=sys.stderr)
        return 2
    flags = argv[1:]
    if not any(f == "--check" or f.startswith("--check=") for f in flags):
        flags += ["--check", "full"]  # the tool proves everything; a training run's own --check is fast
    if not any(f == "--output-dir" or f.startswith("--output-dir=") for f in flags):
        flags += ["--output-dir", tempfile.mkdtemp(prefix="check-")]
    os.environ[STOP_AFTER_CHECK], argv_before = "1", sys.argv
    sys.argv = [str(recipe), *flags]
    try:
        runpy.run_path(str(recipe), run_name="__main__")
    except SystemExit as done:  # the check's end (0), or the run stopped by a failed item or bad input
        return done.code if isinstance(done.code, int) else 1
    finally:  # an in-process caller (the tests) goes on with recipes that train
        del os.environ[STOP_AFTER_CHECK]
        sys.argv = argv_before
    print(f"error: {recipe.name} ran to its end without a launch check (--check off?)", file=sys.stderr)
    return 2
