"""recipes/grpo.py against TRL's GRPOTrainer, side by side in one run, on the same setup.

Same model (bundled SFT checkpoint, or --model: a real one on bundled/plain-addition), data (bundled addition task),
prompts per step, group size,
response length, learning rate (constant), clip, loss (token-mean; TRL's loss_type="dapo"), no KL,
no gradient checkpointing, no weight decay, grad clip 1.0, CPU. Each side runs in its own
process, one after the other, and both final models are scored by the same greedy evaluation on
the 500-row test split. Prints, for each side and their ratio, the steady step time measured from
outside (the wall time of a 40-step run less that of a 10-step run, over 30: everything a step costs,
none of the start-up), the wall time of the 10-step run (start-up included) and the median step
inside the loop; then our phases and the accuracy before and after. The sides alternate: short,
short, long, long.

    pip install -e ".[bench]"
    python bench/grpo_vs_trl.py                        # 16 prompts x 4 samples, 12 new tokens
    python bench/grpo_vs_trl.py --model ~/.cache/recipes-posttrain/SmolLM2-135M-Instruct --steps 20 --prompts 8 \
        --group 8 --lr 1e-5                            # a real model (bundled/real_model.py) on plain-answer sums
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SFT = ROOT / "bundled" / "tiny-qwen2-sft"
TASKS = {  # the model -> (train, test): the bundled one's own task, or the one a real instruct model can start on
    "bundled": (ROOT / "bundled" / "addition" / "train.parquet", ROOT / "bundled" / "addition" / "test.parquet"),
    "real": (
        ROOT / "bundled" / "plain-addition" / "train.parquet",
        ROOT / "bundled" / "plain-addition" / "test.parquet",
    ),
}


def task(args) -> tuple[Path, Path]:
    return TASKS["bundled" if args.model == str(SFT) else "real"]


def greedy_accuracy(model_dir, test: Path, max_new_tokens: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from common.data import load_prompts
    from common.engines import hf_generate_greedy
    from common.model import load_tokenizer
    from common.scoring import default_compute_score

    tokenizer = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows, _ = load_prompts([test], tokenizer, max_prompt_length=256)
    completions = hf_generate_greedy(
        model,
        [r["prompt_ids"] for r in rows],
        pad_id=tokenizer.pad_token_id,
        eos_id=tokenizer.eos_token_id,
        max_new_tokens=max_new_tokens,
        batch_size=100,
        device="cpu",
    )
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    return sum(default_compute_score(r["data_source"], t, r["ground_truth"]) for r, t in zip(rows, texts)) / len(rows)


def run_logged(cmd, log: Path) -> None:
    with log.open("w") as f:
        proc = subprocess.run(
            cmd, cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled"}, stdout=f, stderr=subprocess.STDOUT
        )
    if proc.returncode:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{log.read_text()[-4000:]}")


def run_ours(args, out: Path, steps: int) -> dict:
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / "grpo.py"),
        "--output-dir",
        str(out),
        "--model",
        args.model,
        "--train-files",
        str(task(args)[0]),
        "--resume",
        "disable",
        "--total-training-steps",
        str(steps),
        "--train-batch-size",
        str(args.prompts),
        "--ppo-mini-batch-size",
        str(args.prompts),
        "--rollout-n",
        str(args.group),
        "--micro-batch-size-per-gpu",
        str(args.prompts * args.group),
        "--max-response-length",
        str(args.max_tokens),
        "--lr",
        str(args.lr),
        "--lr-scheduler",
        "constant",
        "--weight-decay",
        "0",
        "--test-freq",
        "0",
        "--no-val-before-train",
        "--save-freq",
        str(steps),
        "--seed",
        str(args.seed),
        "--logger",
    ]
    start = time.time()
    run_logged(cmd, out.parent / f"ours-{steps}.log")
    wall = time.time() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    phases = ("generate", "score", "logprobs", "update")
    return {
        "step_s": [r["perf/step_s"] for r in records],
        "phases": {p: statistics.median(r[f"perf/{p}_s"] for r in records) for p in phases},
        "model": out / "checkpoints" / f"step_{steps}" / "hf",
        "wall": wall,
    }


def trl_worker(args, out: Path) -> None:
    """Runs in its own process: TRL's GRPOTrainer with the matching configuration."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from common.data import read_rows
    from common.model import load_tokenizer
    from common.scoring import default_compute_score

    rows = read_rows([task(args)[0]])[0][1]
    data = Dataset.from_list(
        [
            {"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"], "source": r["data_source"]}
            for r in rows
        ]
    )

    def reward(prompts, completions, ground_truth, source, **kwargs):  # the scorer grpo.py picks by data_source
        return [default_compute_score(s, c[0]["content"], g) for c, g, s in zip(completions, ground_truth, source)]

    times = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.time()

        def on_step_end(self, *a, **k):
            times.append(time.time() - self.t0)

    config = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        max_steps=args.worker_steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        seed=args.seed,
        per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        steps_per_generation=1,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        gradient_checkpointing=False,
        logging_steps=args.worker_steps,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
    )
    tokenizer = load_tokenizer(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    trainer.train()
    trainer.model.save_pretrained(out / "final")
    tokenizer.save_pretrained(out / "final")
    (out / "times.json").write_text(json.dumps(times))


def run_trl(args, out: Path, steps: int) -> dict:
    start = time.time()
    cmd = [sys.executable, __file__, "--trl-worker", str(out), "--worker-steps", str(steps), *sys.argv[1:]]
    run_logged(cmd, out.parent / f"trl-{steps}.log")
    wall = time.time() - start
    return {"step_s": json.loads((out / "times.json").read_text()), "model": out / "final", "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SFT), help="a Hugging Face folder (default: the bundled SFT model)")
    parser.add_argument("--steps", type=int, default=40, help="steps of the long run (the short one runs 10)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-steps", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(args, Path(args.trl_worker))
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit('TRL is not installed: pip install -e ".[bench]"')

    short = 10
    with tempfile.TemporaryDirectory() as tmp:
        # Short and long runs of each side, the sides alternating, so a drift of the machine's speed
        # falls on both; the long runs train the models that are scored.
        ours_short = run_ours(args, Path(tmp) / "ours-short", short)
        trl_short = run_trl(args, Path(tmp) / "trl-short", short)
        ours = run_ours(args, Path(tmp) / "ours", args.steps)
        theirs = run_trl(args, Path(tmp) / "trl", args.steps)
        test, new_tokens = task(args)[1], max(16, args.max_tokens)
        before = greedy_accuracy(args.model, test, new_tokens)
        acc_ours, acc_trl = (greedy_accuracy(side["model"], test, new_tokens) for side in (ours, theirs))
    # From outside: the long run's wall less the short one's is args.steps - 10 steady steps, with
    # everything a step costs (logging, probes, collectives), and none of the start-up.
    steady = [
        (long["wall"] - first["wall"]) / (args.steps - short)
        for long, first in ((ours, ours_short), (theirs, trl_short))
    ]
    med_ours, med_trl = statistics.median(ours["step_s"][1:]), statistics.median(theirs["step_s"][1:])
    print(
        f"\nGRPO, {Path(args.model).name} on {task(args)[0].parent.name}, {args.prompts} prompts x {args.group} samples,"
    )
    print(f"{args.max_tokens} new tokens, lr {args.lr}, CPU")
    print(f"{'':40}{'recipes/grpo.py':>18}{'TRL GRPOTrainer':>18}{'ratio':>8}")
    rows = (
        (f"steady step, s (wall {args.steps} - wall {short}) / {args.steps - short}", *steady),
        (f"first {short} steps, s (wall of {short}, start-up in)", ours_short["wall"], trl_short["wall"]),
        ("median step inside the loop, s", med_ours, med_trl),
    )
    for label, a, b in rows:
        print(f"{label:40}{a:>18.3f}{b:>18.3f}{a / b:>8.2f}")
    print(f"{'greedy accuracy':40}{f'{before:.1%} -> {acc_ours:.1%}':>18}{f'{before:.1%} -> {acc_trl:.1%}':>18}")
    print(
        f"steady-state ratio ours / TRL: {steady[0] / steady[1]:.2f}; first {short} steps: "
        f"{ours_short['wall'] / trl_short['wall']:.2f}"
    )
    print("our phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in ours["phases"].items()))


if __name__ == "__main__":
    main()
