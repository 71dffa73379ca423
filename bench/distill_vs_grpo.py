"""recipes/distill.py against recipes/grpo.py on the bundled addition task, side by side: the same
student (the shipped SFT checkpoint), prompts, samples per step, steps, learning rate and schedule;
distill.py learns from the bundled teacher (tiny-qwen2-teacher, step 80 of the default GRPO run),
grpo.py from the task's reward. Prints each run's greedy accuracy on the 500 held-out sums every
--test-freq steps, the teacher's, the share of the student-to-teacher gap each run closed and the
seconds each took, and plots both accuracy curves to --plot.

    python bench/distill_vs_grpo.py                       # 30 steps, seed 1
    python bench/distill_vs_grpo.py --seeds 1 2 3 --plot docs/img/distill-vs-grpo.png
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEACHER_ACCURACY = 0.756  # bundled/README.md: the default GRPO run's step 80, which the teacher is


def run(recipe: str, out: Path, args, seed: int) -> list[dict]:
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / f"{recipe}.py"),
        "--output-dir",
        str(out),
        "--seed",
        str(seed),
        "--total-training-steps",
        str(args.steps),
        "--test-freq",
        str(args.test_freq),
        "--train-batch-size",
        str(args.prompts),
        "--rollout-n",
        str(args.samples),
        "--save-freq",
        "0",
        "--logger",
    ]
    log = out.parent / f"{recipe}-{seed}.log"
    with log.open("w") as f:
        proc = subprocess.run(cmd, env={**os.environ, "WANDB_MODE": "disabled"}, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{log.read_text()[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--test-freq", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per step (distill.py's default)")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (distill.py's default)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--plot", default="", help="save both accuracy curves to this PNG")
    args = parser.parse_args()

    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for recipe in ("distill", "grpo"):
                records = run(recipe, Path(tmp) / f"{recipe}-{seed}", args, seed)
                accuracy = {r["step"]: r["val/accuracy"] for r in records if "val/accuracy" in r}
                seconds = sum(r["perf/step_s"] for r in records if "perf/step_s" in r)
                curves[recipe, seed] = (accuracy, seconds)
    print(
        f"\n{args.steps} steps of {args.prompts} prompts x {args.samples} samples; greedy accuracy on the 500 "
        f"held-out sums (teacher {TEACHER_ACCURACY:.1%})"
    )
    for (recipe, seed), (accuracy, seconds) in curves.items():
        start, end = accuracy[0], accuracy[max(accuracy)]
        gap = (end - start) / (TEACHER_ACCURACY - start)
        points = "  ".join(f"{step}: {a:.1%}" for step, a in sorted(accuracy.items()))
        print(f"{recipe:8} seed {seed}  {points}  ({gap:.0%} of the gap, steps {seconds:.0f} s)")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for (recipe, seed), (accuracy, _) in curves.items():
            steps = sorted(accuracy)
            ax.plot(
                steps,
                [accuracy[s] for s in steps],
                marker="o",
                color="C0" if recipe == "distill" else "C1",
                label=f"{recipe}.py" if seed == args.seeds[0] else None,
                alpha=0.8,
            )
        ax.axhline(TEACHER_ACCURACY, color="gray", linestyle="--", label="teacher")
        ax.set_xlabel("step")
        ax.set_ylabel("greedy accuracy, 500 held-out sums")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
