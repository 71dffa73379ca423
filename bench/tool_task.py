"""The bundled tool task with and without the calculator: a 3-digit number times a 2-digit one.

    tool     bundled/tiny-qwen2-tools (step 700 of SFT from the random-init bundled/tiny-qwen2 on
             sft.parquet, half of whose conversations call the tool), then GRPO on train.parquet
             with --tool-config bundled/calculator/tools.yaml
    no tool  SFT from bundled/tiny-qwen2 on the same prompts with the answer alone (sft.parquet's
             prompt and extra_info.answer) for each of --sft-steps (700: as many steps as the
             tool checkpoint's, its lr schedule ending there, which favours it; 3000: over four
             times as many, in about two-thirds of the tool checkpoint's SFT time, as its
             sequences are shorter), then GRPO on train.parquet's rows as single-turn rows

Both GRPO runs take the same flags (the README's tool-task command) and steps. It reports the
greedy accuracy and tool calls per conversation on the first --val-prompts test prompts after
SFT and after GRPO, and the sampled reward and tool calls over the first and last --window GRPO
steps.

    python bench/tool_task.py                     # about 18 minutes on 2 CPU cores
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bundled" / "calculator"
GRPO_FLAGS = ["--max-prompt-length", "128", "--max-response-length", "128", "--max-assistant-turns", "3",
              "--lr", "5e-5"]  # fmt: skip


def run(recipe: str, flags: list) -> None:
    cmd = [sys.executable, str(ROOT / "recipes" / f"{recipe}.py"), *map(str, flags)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def single_turn_copy(name: str, tmp: Path) -> Path:
    """The split's rows without agent_name: single_turn_agent, no tool in the prompt."""
    import pyarrow.parquet as pq

    table = pq.read_table(DATA / name)
    out = tmp / name
    pq.write_table(table.drop_columns(["agent_name"]), out)
    return out


def arm(sft_steps: int | None, args, tmp: Path) -> dict:
    """The tool arm (sft_steps None: the shipped checkpoint) or a no-tool arm of sft_steps SFT steps."""
    tool = sft_steps is None
    name = "tool" if tool else f"no-tool {sft_steps}"
    model = ROOT / "bundled" / "tiny-qwen2-tools"
    if not tool:  # the conversations' messages left unread: each prompt and its answer alone
        run(
            "sft",
            [
                "--model",
                ROOT / "bundled" / "tiny-qwen2",
                "--train-files",
                DATA / "sft.parquet",
                "--val-files",
                "--messages-key",
                "no-messages",
                "--total-training-steps",
                sft_steps,
                "--output-dir",
                tmp / f"sft-{sft_steps}",
                "--resume",
                "disable",
            ],
        )
        model = tmp / f"sft-{sft_steps}" / "checkpoints" / f"step_{sft_steps}" / "hf"
    train, test = DATA / "train.parquet", DATA / "test.parquet"
    if not tool:
        train, test = single_turn_copy("train.parquet", tmp), single_turn_copy("test.parquet", tmp)
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(test).slice(0, args.val_prompts), tmp / f"val-{name}.parquet")
    out = tmp / f"grpo-{name.replace(' ', '-')}"
    run(
        "grpo",
        [
            "--model",
            model,
            "--train-files",
            train,
            "--val-files",
            tmp / f"val-{name}.parquet",
            *GRPO_FLAGS,
            *(["--tool-config", DATA / "tools.yaml"] if tool else []),
            "--total-training-steps",
            args.grpo_steps,
            "--test-freq",
            args.grpo_steps,
            "--save-freq",
            "0",
            "--output-dir",
            out,
            "--resume",
            "disable",
            "--log-interval",
            "0",
            *args.grpo_flags,
        ],
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    val = [r for r in records if "val/accuracy" in r]
    steps = [r for r in records if "reward/mean" in r]
    w = args.window
    return {
        "arm": name,
        "after SFT": val[0]["val/accuracy"],
        "after GRPO": val[-1]["val/accuracy"],
        "greedy calls SFT": val[0].get("val/agent/tool_calls_mean", 0.0),
        "greedy calls GRPO": val[-1].get("val/agent/tool_calls_mean", 0.0),
        "reward first": sum(r["reward/mean"] for r in steps[:w]) / w,
        "reward last": sum(r["reward/mean"] for r in steps[-w:]) / w,
        "calls first": sum(r.get("agent/tool_calls_mean", 0.0) for r in steps[:w]) / w,
        "calls last": sum(r.get("agent/tool_calls_mean", 0.0) for r in steps[-w:]) / w,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sft-steps",
        type=int,
        nargs="+",
        default=[700, 3000],
        help="no-tool SFT runs, each this many steps (700: the tool checkpoint's)",
    )
    parser.add_argument("--grpo-steps", type=int, default=20)
    parser.add_argument("--val-prompts", type=int, default=256, help="first test prompts validated (greedy)")
    parser.add_argument("--window", type=int, default=5, help="steps averaged for the first / last reward")
    parser.add_argument("grpo_flags", nargs="*", help="more grpo.py flags for both arms (after --)")
    args = parser.parse_args()
    # Each arm's row as soon as it is measured: a later arm failing loses nothing before it.
    print(
        f"{'arm':<13} {'after SFT':>9} {'after GRPO':>10} {'reward first':>12} {'reward last':>11} "
        f"{'calls first':>11} {'calls last':>10} {'greedy calls':>12}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        for steps in [None, *args.sft_steps]:
            r = arm(steps, args, Path(tmp))
            print(
                f"{r['arm']:<13} {r['after SFT']:>9.1%} {r['after GRPO']:>10.1%} {r['reward first']:>12.3f} "
                f"{r['reward last']:>11.3f} {r['calls first']:>11.2f} {r['calls last']:>10.2f} "
                f"{r['greedy calls SFT']:>5.2f} {r['greedy calls GRPO']:>5.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
