"""grpo.py lifts a real pretrained model: SmolLM2-135M-Instruct on the plain-answer sums of bundled/plain-addition.

Builds the model folder (bundled/real_model.py, the real extra) unless --model names one, trains it with grpo.py
(8 prompts x 8 samples of up to 12 tokens a step, lr 1e-5 constant, full fine-tuning, float32, CPU), and prints the
held-out greedy accuracy on the 200 test sums before and after, with the median step time and the run's phases.

    pip install -e ".[real]"
    python bench/real_task.py                  # 15 steps: about 4-6 minutes on 2 CPU cores
    python bench/real_task.py --steps 30
"""

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASK = ROOT / "bundled" / "plain-addition"


def real_model() -> Path:
    spec = importlib.util.spec_from_file_location("real_model", ROOT / "bundled" / "real_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default: bundled/real_model.py's)")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--lr", default="1e-5")
    cli = parser.parse_args()
    model = cli.model or str(real_model())
    with tempfile.TemporaryDirectory() as out:
        flags = [
            *("--model", model, "--train-files", TASK / "train.parquet", "--val-files", TASK / "test.parquet"),
            *("--train-batch-size", 8, "--ppo-mini-batch-size", 8, "--rollout-n", 8, "--max-response-length", 12),
            *("--total-training-steps", cli.steps, "--test-freq", cli.steps, "--lr", cli.lr),
            *("--lr-scheduler", "constant", "--save-freq", 0, "--output-dir", out, "--logger"),
        ]
        proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "grpo.py"), *map(str, flags)], text=True)
        if proc.returncode:
            sys.exit(proc.returncode)
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line]
    val = [r for r in records if "val/accuracy" in r]
    steps = [r for r in records if "perf/step_s" in r]
    step_s = statistics.median(r["perf/step_s"] for r in steps)
    print(
        f"\nreal model ({Path(model).name}), {cli.steps} steps of 8 x 8: held-out greedy accuracy "
        f"{val[0]['val/accuracy']:.1%} -> {val[-1]['val/accuracy']:.1%}; sampled reward "
        f"{steps[0]['reward/mean']:.3f} at step 1, {steps[-1]['reward/mean']:.3f} at step {steps[-1]['step']}; "
        f"median step {step_s:.1f} s"
    )


if __name__ == "__main__":
    main()
