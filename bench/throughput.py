"""A reference table of recipes/grpo.py's speed on the machine at hand: for each model, engine,
launch and layout that runs here, a short real run of grpo.py and its steady state (the median of
the steps after the first): step time, generated and trained tokens a second, and the update's MFU
(perf/mfu: common.perf). Compare your own run's perf/* figures with the row nearest to it.

Models: the bundled tiny checkpoint, and random-initialised models of real shapes (no weights are
downloaded: the shape is the public configuration's, the weights are random, the tokenizer is the
bundled one). A random model never samples its end token, so every response is
--max-response-length tokens long. Rows: the HF engine in one process; on a CPU also two processes
(torchrun, DDP) and, where vLLM is installed, the vLLM engine; on a GPU each model padded and
padding-free (--use-remove-padding False / True).

    python bench/throughput.py                                      # CPU: the bundled model, SmolLM2-135M's shape
    python bench/throughput.py --models qwen2.5-0.5b qwen2.5-1.5b --mixed-precision bf16   # a GPU
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "bundled"

# Public configurations (each model's config.json on the Hugging Face hub), less what the bundled
# tokenizer sets (its special tokens); the vocabulary keeps the real size, so the output layer costs
# what it costs in the real model.
SHAPES = {
    "qwen2.5-0.5b": (
        "tiny-qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
        ),
    ),
    "qwen2.5-1.5b": (
        "tiny-qwen2",
        dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
        ),
    ),
    "smollm2-135m": (
        "tiny-llama",
        dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            vocab_size=49152,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
        ),
    ),
}


def random_model(shape: str, folder: Path) -> Path:
    """A folder holding a random-initialised model of `shape` (SHAPES) in bfloat16 and the bundled
    tokenizer; made once, kept for later calls."""
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(shape_config(shape), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(BUNDLED / SHAPES[shape][0] / name, folder / name)
    return folder


def shape_config(shape: str):
    """The transformers config of `shape` (SHAPES): the bundled model's, with the public configuration's fields."""
    from transformers import AutoConfig

    base, fields = SHAPES[shape]
    config = AutoConfig.from_pretrained(BUNDLED / base)
    for key, value in fields.items():
        setattr(config, key, value)
    config.head_dim = fields.get("head_dim", config.hidden_size // config.num_attention_heads)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    return config


def run(model: Path, out: Path, flags: list[str], processes: int) -> list[dict]:
    """One grpo.py run into `out`; its metrics.jsonl records."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    cmd = [
        *(launch if processes > 1 else [sys.executable]),
        str(ROOT / "recipes" / "grpo.py"),
        "--model",
        str(model),
        "--output-dir",
        str(out),
        *flags,
    ]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    with (out.parent / f"{out.name}.log").open("w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        tail = (out.parent / f"{out.name}.log").read_text()[-3000:]
        raise SystemExit(f"{' '.join(cmd)} failed (exit {code}):\n{tail}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]


def steady(records: list[dict]) -> dict:
    """The median of each perf/ figure over the steps after the first (its warm-up: kernels
    compiled, caches filled)."""
    steps = [r for r in records if r.get("step", 0) >= 2 and "perf/step_s" in r]
    keys = ("perf/step_s", "perf/generate_tokens_per_s", "perf/train_tokens_per_s", "perf/mfu", "perf/generate_s",
            "perf/update_s")  # fmt: skip
    return {k: statistics.median(r[k] for r in steps) for k in keys if all(k in r for r in steps)}


def rows(args, cuda: bool, vllm: bool) -> list[tuple]:
    """(model, engine, processes, layout) for every row this machine runs."""
    out = []
    for model in args.models:
        layouts = args.layouts or (["padded", "padding-free"] if cuda else ["auto"])
        for layout in layouts:
            out.append((model, "hf", 1, layout))
        if not cuda and model == "bundled":
            out.append((model, "hf", 2, "auto"))
            if vllm:
                out.append((model, "vllm", 1, "auto"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, help=f"bundled and/or {', '.join(SHAPES)}")
    parser.add_argument("--layouts", nargs="+", choices=["auto", "padded", "padding-free"], default=None)
    parser.add_argument("--steps", type=int, default=4, help="steps a run (the first is not counted)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts a step (--train-batch-size)")
    parser.add_argument("--group", type=int, default=4, help="responses a prompt (--rollout-n)")
    parser.add_argument(
        "--response-length",
        type=int,
        default=0,
        help="--max-response-length (0: 16 bundled, 32 on a CPU, 256 on a GPU)",
    )
    parser.add_argument("--micro-batch", type=int, default=16, help="--micro-batch-size-per-gpu")
    parser.add_argument("--mixed-precision", choices=["no", "bf16"], default="no")
    parser.add_argument(
        "--torch-compile",
        action="store_true",
        help="--use-torch-compile: each decoder layer compiled (the first step, which compiles, is not counted)",
    )
    parser.add_argument(
        "--cache",
        default=str(Path(tempfile.gettempdir()) / "recipes-throughput"),
        help="where the random-initialised models are kept",
    )
    parser.add_argument("--json", default=None, help="also write the table here")
    args = parser.parse_args()

    import importlib.util

    import torch

    cuda = torch.cuda.is_available()
    vllm = importlib.util.find_spec("vllm") is not None
    args.models = args.models or (["bundled", "smollm2-135m"] if not cuda else ["qwen2.5-0.5b", "qwen2.5-1.5b"])
    device = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"grpo.py on {device}, torch {torch.__version__}; {args.prompts} prompts x {args.group} responses a step, "
        f"median of steps 2-{args.steps}, --mixed-precision {args.mixed_precision}, {args.micro_batch} sequences "
        f"a micro-batch{', compiled layers' if args.torch_compile else ''}"
    )
    header = (
        f"{'model':<14} {'engine':<6} {'launch':<11} {'layout':<12} {'step s':>7} {'gen tok/s':>10} "
        f"{'train tok/s':>12} {'MFU':>6}"
    )
    print(header)
    table, work = [], Path(tempfile.mkdtemp(prefix="throughput-"))
    for model, engine, processes, layout in rows(args, cuda, vllm):
        path = BUNDLED / "tiny-qwen2-sft" if model == "bundled" else random_model(model, Path(args.cache) / model)
        length = args.response_length or (16 if model == "bundled" else 256 if cuda else 32)
        remove_padding = {"auto": "auto", "padded": "False", "padding-free": "True"}[layout]
        flags = [
            "--total-training-steps",
            str(args.steps),
            "--save-freq",
            "0",
            "--test-freq",
            "0",
            "--no-val-before-train",
            "--check",
            "off",
            "--lr-scheduler",
            "constant",
            "--train-batch-size",
            str(args.prompts),
            "--ppo-mini-batch-size",
            str(args.prompts),
            "--rollout-n",
            str(args.group),
            "--max-response-length",
            str(length),
            "--micro-batch-size-per-gpu",
            str(args.micro_batch),
            "--mixed-precision",
            args.mixed_precision,
            "--use-remove-padding",
            remove_padding,
            "--rollout-name",
            engine,
            *(["--use-torch-compile"] if args.torch_compile else []),
        ]
        name = f"{model}-{engine}-{processes}-{layout}{'-compiled' if args.torch_compile else ''}"
        figures = steady(run(path, work / name, flags, processes))
        launch = "1 process" if processes == 1 else f"{processes} (DDP)"
        row = {
            "model": model,
            "engine": engine,
            "launch": launch,
            "layout": layout,
            "response_length": length,
            "micro_batch": args.micro_batch,
            "torch_compile": args.torch_compile,
            **figures,
        }
        table.append(row)
        print(
            f"{model:<14} {engine:<6} {launch:<11} {layout:<12} {figures['perf/step_s']:>7.3f} "
            f"{figures.get('perf/generate_tokens_per_s', 0):>10.0f} {figures.get('perf/train_tokens_per_s', 0):>12.0f} "
            f"{figures.get('perf/mfu', float('nan')):>6.1%}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": table}, indent=1))


if __name__ == "__main__":
    main()
