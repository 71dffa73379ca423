"""Colocated vs remote rollout engines: grpo.py with the HF engine in the trainer, with remote HF
engines synchronously (--max-staleness 0), and one step off (--max-staleness 1). For each it reports
the median step time and tokens/s over the steps after --warmup, the generation time the engines
spent per step against the time the trainer waited on them (the share hidden behind training), and
validation accuracy after the same number of steps; speeds also as ratios to the colocated run
measured in the same invocation (this machine is shared and its absolute speed varies).

    python bench/async_rollout.py --steps 20
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = {
    "colocated": [],
    "remote k=0": ["--rollout-placement", "remote", "--num-rollout-engines", "2", "--max-staleness", "0"],
    "remote k=1": ["--rollout-placement", "remote", "--num-rollout-engines", "2", "--max-staleness", "1"],
}


def run(flags: list[str], steps: int, out: Path) -> list[dict]:
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / "grpo.py"),
        *flags,
        "--total-training-steps",
        str(steps),
        "--test-freq",
        str(steps),
        "--save-freq",
        "0",
        "--output-dir",
        str(out),
        "--resume",
        "disable",
        "--log-interval",
        "0",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    args = parser.parse_args()
    print(
        f"{'placement':<11} {'step s':>7} {'tokens/s':>9} {'x colocated':>11} {'generate s':>10} {'waited s':>9} "
        f"{'hidden':>7} {'val acc':>8}"
    )
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in RUNS.items():
            records = run(flags, args.steps, Path(tmp) / name.replace(" ", "-").replace("=", ""))
            timed = [r for r in records if r.get("step", 0) > args.warmup and "perf/step_s" in r]
            step_s = statistics.median(r["perf/step_s"] for r in timed)
            tokens = statistics.median(r["perf/tokens_per_s"] for r in timed)
            base = base or tokens
            if "perf/engine_generate_s" in timed[0]:  # remote: the engines' time against the trainer's wait
                generate = statistics.median(r["perf/engine_generate_s"] for r in timed)
                waited = statistics.median(r["perf/rollout_wait_s"] for r in timed)
            else:  # colocated: the trainer generates itself, nothing is hidden
                generate = waited = statistics.median(r["perf/generate_s"] for r in timed)
            hidden = max(0.0, 1 - waited / generate)
            accuracy = [r["val/accuracy"] for r in records if "val/accuracy" in r][-1]
            print(
                f"{name:<11} {step_s:>7.3f} {tokens:>9.0f} {tokens / base:>11.2f} {generate:>10.3f} {waited:>9.3f} "
                f"{hidden:>7.0%} {accuracy:>8.1%}"
            )


if __name__ == "__main__":
    main()
