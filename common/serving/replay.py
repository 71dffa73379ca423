"""The kept set of an engine that reports none (a feature: only vLLM and remote engines need it). vLLM returns the
logprob it sampled each token with after top-k / top-p / min-p (its processed logprobs), not the tokens it kept
(0.32's sampling mask needs its V2 model runner and top-k), while the trainer replays that set
(common.ops.logprobs_and_entropy's kept): replay_kept finds each token's kept count on the trainer's logits.
"""

import torch

from common.data import pack_sequences
from common.engines import Completion, Sampling
from common.model import response_logits
from common.ops import CHUNK_ROWS
from common.parallel import all_reduce_max, is_fsdp, unwrap


@torch.no_grad()
def replay_kept(model, prompts, groups: list[list[Completion]], sampling: Sampling, pad_id: int, rows: int = 4):
    """Give each completion of an engine that reports no kept set (vLLM: 0.32's sampling mask needs its V2 model
    runner and top-k) its kept counts, from a no-grad pass of the trainer's `model`: top-k alone keeps k; with
    top-p or min-p, the count whose set gives each token the engine's logprob (kept_from_logprobs, below), on
    weights the engine was just synced with. Under FSDP2 every rank makes as many passes (they are collective)."""
    pairs = [(p, c) for p, group in zip(prompts, groups) for c in group if c.kept is None and c.token_ids]
    if not sampling.truncated or not pairs and not is_fsdp(model):
        return groups
    if sampling.top_p == 1 and sampling.min_p == 0:
        for _, c in pairs:
            c.kept = [sampling.top_k] * len(c.token_ids)
        return groups
    inner, device = unwrap(model), next(unwrap(model).parameters()).device
    was_training = inner.training
    inner.eval()
    passes = -(-len(pairs) // rows)
    for i in range(all_reduce_max(passes) if is_fsdp(model) else passes):
        # a rank out of rows passes a filler and drops its result
        chunk = pairs[i * rows : (i + 1) * rows] or [([pad_id], Completion([pad_id], [0.0], "length"))]
        batch = pack_sequences([p for p, _ in chunk], [c.token_ids for _, c in chunk], pad_id, device)
        batch["group_ids"] = torch.arange(len(chunk), device=device)
        logits = response_logits(inner, batch, share_prompts=False)
        width = batch["responses"].shape[1]
        reported = torch.tensor([c.logprobs + [0.0] * (width - len(c.logprobs)) for _, c in chunk], device=device)
        kept = kept_from_logprobs(logits / sampling.temperature, batch["responses"], reported).tolist()
        for (_, c), row in zip(chunk if i < passes else (), kept):
            c.kept = row[: len(c.token_ids)]
    inner.train(was_training)
    return groups


@torch.no_grad()
def kept_from_logprobs(logits: torch.Tensor, labels: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """(...) long: for an engine that reports the logprob it sampled each label with after top-p / min-p (vLLM's
    processed logprobs) but not the set it kept, the count m whose top-m tokens of `logits` (the trainer's, divided
    by the temperature) give the label the logprob nearest the engine's, the label among them; 0 where that is the
    whole vocabulary. The set's logsumexp grows with m, so the nearest m is found by bisection."""
    flat, flat_labels, flat_lp = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), logprobs.reshape(-1)
    out, vocab = torch.zeros(flat_labels.shape, dtype=torch.long, device=flat.device), flat.shape[-1]
    for start in range(0, flat.shape[0], CHUNK_ROWS):
        rows = slice(start, start + CHUNK_ROWS)
        x = flat[rows].float()
        label = x.gather(-1, flat_labels[rows].unsqueeze(-1)).squeeze(-1)
        sums = torch.logcumsumexp(x.sort(-1, descending=True).values, -1)  # sums[:, j]: the top j + 1 tokens'
        target = (label - flat_lp[rows].float()).unsqueeze(-1)  # the kept set's logsumexp, from the engine's logprob
        above = torch.searchsorted(sums, target).clamp(max=vocab - 1)
        below = (above - 1).clamp(min=0)
        nearer = (sums.gather(-1, below) - target).abs() < (sums.gather(-1, above) - target).abs()
        m = torch.where(nearer, below, above).squeeze(-1) + 1
        m = torch.maximum(m, (x > label.unsqueeze(-1)).sum(-1) + 1)  # the label is in the set
        out[rows] = m.masked_fill(m >= vocab, 0)
    return out.reshape(labels.shape)
