"""Generation with the live policy through transformers' generate."""

import torch

from common.data import pad
from common.parallel import is_fsdp, unwrap


@torch.no_grad()
def hf_generate_greedy(
    model,
    prompts: list[list[int]],
    *,
    pad_id: int,
    eos_id: int,
    max_new_tokens: int,
    batch_size: int,
    device,
    world_size: int = 1,
) -> list[list[int]]:
    """Greedy completions (token ids up to and including eos) for left-padded prompt batches.

    Under FSDP2 every rank must make the same number of calls; `synced_gpus` keeps the forward
    passes in step when one rank finishes its sequences early.
    """
    inner = unwrap(model)
    was_training = inner.training
    inner.eval()
    out = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        ids = pad(batch, pad_id, side="left").to(device)
        attention = pad([[1] * len(p) for p in batch], 0, side="left").to(device)
        generated = inner.generate(
            input_ids=ids,
            attention_mask=attention,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            use_cache=True,
            synced_gpus=is_fsdp(model) and world_size > 1,
        )
        for row in generated[:, ids.shape[1] :].tolist():
            cut = row.index(eos_id) + 1 if eos_id in row else len(row)
            out.append(row[:cut])
    inner.train(was_training)
    return out
