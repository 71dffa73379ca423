"""Data-parallel scaling on CPU: sft.py and grpo.py with 1 process and with 2 (torchrun, DDP and
FSDP2), one torch thread per process, the same global batch. For each it reports the median step
time and tokens/s over the steps after --warmup, and the speed-up of 2 processes over 1 measured in
the same invocation (a ratio: this machine is shared and its absolute speed varies).

    python bench/scaling.py --steps 12
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
RUNS = {  # recipe -> flags: a fixed global batch, no validation or checkpoints
    "sft": ["--train-batch-size", "64", "--micro-batch-size-per-gpu", "32", "--test-freq", "0", "--save-freq", "0"],
    "grpo": ["--train-batch-size", "16", "--rollout-n", "8", "--test-freq", "0", "--no-val-before-train",
             "--save-freq", "0"],
}  # fmt: skip


def run(recipe: str, nproc: int, strategy: str, steps: int, out: Path) -> list[dict]:
    launch = (
        [sys.executable]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(29400 + os.getpid() % 500),
        ]
    )
    cmd = [
        *launch,
        str(ROOT / "recipes" / f"{recipe}.py"),
        *RUNS[recipe],
        "--total-training-steps",
        str(steps),
        "--strategy",
        strategy,
        "--output-dir",
        str(out),
        "--resume",
        "disable",
        "--log-interval",
        "0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}  # one thread per process
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    args = parser.parse_args()
    print(f"{'recipe':<6} {'processes':<16} {'step s':>8} {'tokens/s':>10} {'x 1 process':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in RUNS:
            base = None
            for nproc, strategy in ((1, "ddp"), (2, "ddp"), (2, "fsdp2")):
                records = run(recipe, nproc, strategy, args.steps, Path(tmp) / f"{recipe}-{nproc}-{strategy}")
                timed = [r for r in records if r.get("step", 0) > args.warmup and "perf/step_s" in r]
                step_s = statistics.median(r["perf/step_s"] for r in timed)
                tokens = statistics.median(r["perf/tokens_per_s"] for r in timed)
                base = base or tokens
                label = "1" if nproc == 1 else f"{nproc} ({strategy})"
                print(f"{recipe:<6} {label:<16} {step_s:>8.3f} {tokens:>10.0f} {tokens / base:>12.2f}")


if __name__ == "__main__":
    main()
