"""--check full's resume proof (a feature: only --check full, or python -m common.check, loads it):
two short child runs of the run's own command line, one resumed in a fresh process from the other's
step-1 checkpoint, must train the same step 2 (metrics and weights). common.check reports it as the
launch check's resume item.
"""

import os
import sys
import time

from common import watchdog
from common.config import LAST_WINS
from common.errors import STOP_AFTER_CHECK
from common.parallel import broadcast_object

# --check full's resume proof: two short child runs of the run's own command line, these flags last.
RESUME_FLAGS = ["--total-training-steps", "2", "--save-freq", "1", "--max-ckpt-to-keep", "0", "--test-freq", "0",
                "--no-val-before-train", "--check", "off", "--logger", "console", "--log-interval", "0"]  # fmt: skip
RESUME_TIMEOUT = 3600.0  # seconds each child run may take
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # fmt: skip


def prove_resume(dist) -> tuple[bool | None, str, str]:
    """Save -> resume -> one step reproduces the uninterrupted step, proven by child runs of this
    command line (the recipe, its flags, the launch on this node) in a temporary folder: A trains 2
    steps, saving each; B resumes from A's step-1 checkpoint in a fresh process and trains step 2.
    Their step-2 metrics and saved weights must agree. Where they differ, a repeat of A measures
    the stack's own nondeterminism (GPU kernels), and B must be no further from A than that repeat.
    Rank 0 runs the children; the others wait (collective). Returns (ok, figure, advice), the
    launch check's resume item (common.check)."""
    if dist.is_main:
        with watchdog.waiting("--check full's child runs", timeout=3 * RESUME_TIMEOUT):
            item = _prove_resume(dist)
    return broadcast_object(item if dist.is_main else None, wait_s=3 * RESUME_TIMEOUT + 60)


def _child_command(dist) -> tuple[list[str], dict, str]:
    """The command that runs this recipe again with this process's flags (under a launcher: as many
    processes on this node, torchrun --standalone), its environment, and what it spans."""
    recipe = sys.modules["__main__"].__file__
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}
    env.pop(STOP_AFTER_CHECK, None)
    env[LAST_WINS] = "1"  # RESUME_FLAGS follow the user's own and replace theirs
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size))
    if dist.world_size == 1:
        return [sys.executable, recipe, *sys.argv[1:]], env, "1 process"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(local), recipe]
    span = f"{local} processes" + ("" if local == dist.world_size else f" (this node's; the run has {dist.world_size})")
    return [*cmd, *sys.argv[1:]], env, span


def _child(cmd: list[str], env: dict, folder, *extra: str) -> str | None:
    """Run one child into `folder`; None when it exited 0, else the tail of its output."""
    import subprocess

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "console.log", "w") as out:
        try:
            code = subprocess.run(
                [*cmd, *RESUME_FLAGS, "--output-dir", str(folder), *extra],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=RESUME_TIMEOUT,
            ).returncode
        except subprocess.TimeoutExpired:
            code = f"no end within {RESUME_TIMEOUT:.0f}s"
    if code == 0:
        return None
    tail = (folder / "console.log").read_text().strip().splitlines()[-3:]
    return f"exit {code}: " + " | ".join(tail)


def _step_two(folder) -> tuple[dict, dict]:
    """Step 2's metrics (numbers, without the timings) and its saved weights, of one child run."""
    import json

    from safetensors.torch import load_file

    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line]
    row = next(r for r in rows if r.get("step") == 2)
    metrics = {
        k: float(v) for k, v in row.items() if isinstance(v, int | float) and not k.startswith(("perf/", "time"))
    }
    weights = {}
    for path in sorted((folder / "checkpoints" / "step_2" / "hf").glob("*.safetensors")):
        weights.update({f"{path.name}:{k}": v for k, v in load_file(path).items()})
    return metrics, weights


def _run_gap(a, b) -> tuple[float, float, list[str], str]:
    """(largest relative gap of the step-2 metrics, largest gap of the weights, the keys that differ
    most, what was compared)."""
    (ma, wa), (mb, wb) = _step_two(a), _step_two(b)
    if ma.keys() != mb.keys() or wa.keys() != wb.keys():
        missing = sorted((ma.keys() ^ mb.keys()) | (wa.keys() ^ wb.keys()))
        return float("inf"), float("inf"), missing[:5], "different metrics or weights"
    rel = {k: abs(ma[k] - mb[k]) / max(abs(ma[k]), abs(mb[k]), 1e-8) for k in ma}
    rel = {k: v for k, v in rel.items() if v == v}  # NaN on both sides is the same
    weight = max(((wa[k].float() - wb[k].float()).abs().max().item() for k in wa if wa[k].numel()), default=0.0)
    differ = [k for k, v in sorted(rel.items(), key=lambda kv: -kv[1]) if v][:3]
    return max(rel.values(), default=0.0), weight, differ, f"{len(ma)} metrics, {len(wa)} weight tensors"


def _prove_resume(dist) -> tuple[bool | None, str, str]:
    import shutil
    import tempfile
    from pathlib import Path

    if not hasattr(sys.modules["__main__"], "Args"):
        return None, "the run was not started as a recipe's command line (python recipes/X.py)", ""
    t = time.time()
    cmd, env, span = _child_command(dist)
    root = Path(tempfile.mkdtemp(prefix="check-resume-"))
    advice = f"the child runs' folders are kept in {root} (console.log in each)"
    if error := _child(cmd, env, root / "uninterrupted", "--resume", "disable"):
        return False, f"the uninterrupted 2-step run failed: {error}", advice
    (root / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(root / "uninterrupted" / "checkpoints" / "step_1", root / "resumed" / "checkpoints" / "step_1")
    if error := _child(cmd, env, root / "resumed", "--resume", "auto"):
        return False, f"the run resumed from step 1 failed: {error}", advice
    metric_gap, weight_gap, keys, compared = _run_gap(root / "uninterrupted", root / "resumed")
    figure = (
        f"step 2 resumed from step 1's checkpoint vs uninterrupted ({span}; {compared}): largest gaps "
        f"{metric_gap:.2g} (relative) and {weight_gap:.2g}"
    )
    ok = metric_gap <= 1e-5 and weight_gap <= 1e-6
    if not ok:  # the stack's own nondeterminism: an uninterrupted repeat
        if error := _child(cmd, env, root / "repeat", "--resume", "disable"):
            return False, f"{figure}; a repeat of the uninterrupted run failed: {error}", advice
        noise_metric, noise_weight, _, _ = _run_gap(root / "uninterrupted", root / "repeat")
        figure += f"; a repeat of the uninterrupted run differs by {noise_metric:.2g} and {noise_weight:.2g}"
        ok = metric_gap <= max(2 * noise_metric, 1e-5) and weight_gap <= max(2 * noise_weight, 1e-6)
    figure += f" ({time.time() - t:.0f}s)"
    if ok:
        shutil.rmtree(root, ignore_errors=True)
        return True, figure, ""
    differ = f" (most: {', '.join(keys)})" if keys else ""
    return (
        False,
        figure,
        (
            f"a run resumed from its checkpoint does not continue as the uninterrupted run{differ}: a preempted run "
            f"would change course; {advice}"
        ),
    )
