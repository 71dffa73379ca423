"""Supervised fine-tuning: next-token cross-entropy on assistant / response tokens only.

How this file departs from the textbook loop:
1. The loss is the summed negative log-likelihood of response tokens divided by the response-token
   count of the whole global batch (every micro-batch on every rank), so splitting the batch into
   micro-batches or processes does not change the gradient.
2. Validation reports the loss and, when rows carry reward_model.ground_truth, greedy accuracy:
   the generated response scored by the data_source's built-in reward (the bundled task: the
   <answer> tag must equal the ground truth exactly), or by exact match for other sources.
3. The data position is a function of the step (seeded permutation per epoch), so a resumed run
   reads exactly the batches an uninterrupted run would.

Run (the tests run the same commands, shortened):
    python recipes/sft.py                      # bundled task from random init: ~100% in ~2 min
    torchrun --nproc_per_node 2 recipes/sft.py --strategy fsdp2              # 2 CPU processes
    accelerate launch --config_file configs/fsdp2.yaml recipes/sft.py --model Qwen/Qwen2.5-0.5B-Instruct \
        --train-files ~/data/gsm8k/train.parquet --response-key extra_info.answer --lr 1e-5
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
from tyro.conf import OmitArgPrefixes

from common.check import prove_resume, trainer_check
from common.checkpoint import find_resume, resume, save_checkpoint
from common.config import BUNDLED, ModelArgs, OptimArgs, TrainerArgs, check_flags, cli, group, is_due, plan_batches
from common.data import pad, step_rows
from common.engines import hf_generate_greedy
from common.errors import UsageError, usage_errors
from common.flags import flag, flag_values
from common.model import load_tokenizer, load_trained_model, sequence_logits
from common.ops import logprobs_from_logits
from common.optim import trainable
from common.parallel import (
    StopSignal,
    all_reduce_sum,
    clip_grad_norm,
    gather_objects,
    grad_sync,
    init_distributed,
    seed_everything,
    shard_evenly,
)
from common.runlock import claim_run_dir
from common.scoring import builtin_scorer, exact_match
from common.sft_data import SFTDataArgs, load_sft
from common.tracking import Tracker, describe_run

RECIPE = Path(__file__).stem  # names the run and owns its checkpoints: a copy of this file is its own experiment
PLOTS = ("val/accuracy", "val/loss", "train/loss", "train/lr")  # panels of curves.png


# --- config ---------------------------------------------------------------------------------------
@dataclass
class Args:  # sft.py's own knobs, then its flag groups: args.model, args.data, args.optim, args.trainer
    max_new_tokens: int = flag(16, ge=1)
    """validation accuracy: greedy tokens generated per prompt"""
    val_batch_size: int = flag(256, ge=1)
    """validation: prompts per generate / forward call on one process"""
    model: Annotated[ModelArgs, OmitArgPrefixes] = group(ModelArgs, path=str(BUNDLED / "tiny-qwen2"))
    """the model trained (common.model)"""
    data: Annotated[SFTDataArgs, OmitArgPrefixes] = group(SFTDataArgs)
    """the examples: files, columns, length, a step's batch (common.sft_data)"""
    optim: Annotated[OptimArgs, OmitArgPrefixes] = group(
        OptimArgs, lr=2e-3, lr_warmup_steps_ratio=0.05, lr_scheduler="cosine", weight_decay=0.0
    )
    """AdamW and the lr schedule (common.optim)"""
    trainer: Annotated[TrainerArgs, OmitArgPrefixes] = group(TrainerArgs, total_epochs=6, test_freq=100)
    """the run: its folder, length, checkpoints, logs and launch check (common.config)"""

    def __post_init__(self):  # every flag checked as the flags are parsed, before anything loads
        check_flags(self)


# --- the loss ---------------------------------------------------------------------------------------
def compute_loss(logits, input_ids, loss_mask, num_tokens):
    """Summed NLL of masked next tokens divided by `num_tokens` (the global batch's token count).

    logits (B, L, V), input_ids / loss_mask (B, L); position t predicts token t+1.
    Returns (loss, nll_sum) with nll_sum detached for logging.
    """
    logprobs = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:])  # (B, L-1)
    mask = loss_mask[:, 1:].to(logprobs.dtype)
    nll_sum = -(logprobs * mask).sum()
    return nll_sum / num_tokens, nll_sum.detach()


def collate(examples, pad_id, device):
    ids = pad([e["input_ids"] for e in examples], pad_id).to(device)
    attention = pad([[1] * len(e["input_ids"]) for e in examples], 0).to(device)
    loss_mask = pad([e["loss_mask"] for e in examples], 0).to(device)
    return ids, attention, loss_mask


# --- validation ---------------------------------------------------------------------------------------
def validate(model, tokenizer, val, dist, *, batch_size, max_new_tokens):
    """Token-mean loss over all val examples; greedy accuracy over those with a ground truth
    (max_new_tokens generated); batch_size examples per forward / generate call."""
    started, (local, n_real) = time.time(), shard_evenly(val, dist)
    # Padding copies count no tokens: their loss mask is zeroed.
    local = local[:n_real] + [dict(e, loss_mask=[0] * len(e["loss_mask"])) for e in local[n_real:]]
    nll, tokens = torch.zeros((), device=dist.device), torch.zeros((), device=dist.device)
    model.eval()
    with torch.no_grad():
        for start in range(0, len(local), batch_size):
            batch = local[start : start + batch_size]
            ids, attention, loss_mask = collate(batch, tokenizer.pad_token_id, dist.device)
            logits = sequence_logits(model, ids, attention)  # padding-free with --use-remove-padding
            nll += compute_loss(logits, ids, loss_mask, 1.0)[1]
            tokens += loss_mask[:, 1:].sum()
    metrics = {"val/loss": (all_reduce_sum(nll) / all_reduce_sum(tokens).clamp(min=1)).item()}

    scored = [e for e in val if e["ground_truth"] is not None]
    if scored:
        local, n_real = shard_evenly(scored, dist)
        completions = hf_generate_greedy(
            model,
            [e["prompt_ids"] for e in local],
            pad_id=tokenizer.pad_token_id,
            eos_id=tokenizer.eos_token_id,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            device=dist.device,
            world_size=dist.world_size,
        )
        texts = tokenizer.batch_decode(completions[:n_real], skip_special_tokens=True)
        # Rows whose data_source has no built-in reward are scored by exact match.
        results = [
            (e["data_source"], (builtin_scorer(e["data_source"]) or exact_match)(text, e["ground_truth"]))
            for e, text in zip(local[:n_real], texts)
        ]
        results = [r for part in gather_objects(results) for r in part]
        metrics["val/accuracy"] = sum(s for _, s in results) / len(results)
        for source in sorted({d for d, _ in results}):
            hits = [s for d, s in results if d == source]
            metrics[f"val/accuracy/{source}"] = sum(hits) / len(hits)
    model.train()
    return {**metrics, "perf/validate_s": time.time() - started}


# --- one step ---------------------------------------------------------------------------------------
def train_step(policy, mine, epoch, pad_id, dist, micro_batch_size, grad_clip) -> dict:
    """Steps 2-3 on this rank's examples of the global batch (`mine`, of `epoch`): forward / backward
    over micro-batches of micro_batch_size, then one clipped optimizer step of policy (model,
    optimizer, scheduler)."""
    t0, (model, optimizer, scheduler) = time.time(), policy
    # The loss divides by the token count of the whole global batch, not of one micro-batch.
    num_tokens = all_reduce_sum(torch.tensor(float(sum(sum(e["loss_mask"][1:]) for e in mine)), device=dist.device))

    # 2. forward / backward over micro-batches; gradients sync on the last one only
    nll_total = torch.zeros((), device=dist.device)
    micro_batches = [mine[k : k + micro_batch_size] for k in range(0, len(mine), micro_batch_size)]
    for k, examples in enumerate(micro_batches):
        ids, attention, loss_mask = collate(examples, pad_id, dist.device)
        with grad_sync(model, enabled=k == len(micro_batches) - 1):
            logits = sequence_logits(model, ids, attention)  # padding-free with --use-remove-padding
            loss, nll_sum = compute_loss(logits, ids, loss_mask, num_tokens)
            # DDP and FSDP2 average gradients over ranks; the loss is already a global mean.
            (loss * dist.world_size).backward()
        nll_total += nll_sum

    # 3. optimizer step
    grad_norm = clip_grad_norm(model, grad_clip)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    step_s = time.time() - t0
    return {
        "train/loss": (all_reduce_sum(nll_total) / num_tokens).item(),
        "train/grad_norm": grad_norm,
        "train/lr": lr,
        "train/epoch": epoch,
        "train/tokens": num_tokens.item(),
        "perf/step_s": step_s,
        "perf/update_s": step_s,
        "perf/tokens_per_s": num_tokens.item() / step_s,
    }


# --- main ---------------------------------------------------------------------------------------
def main(args: Args) -> dict:
    # Setup: process group, batch arithmetic (before any model loads), run folder, seeds.
    dist = init_distributed(args.trainer.wait_timeout)
    batch_size, micro_batch_size = args.data.train_batch_size, args.data.micro_batch_size_per_gpu
    plan = plan_batches(
        world_size=dist.world_size, train_batch_size=batch_size, micro_batch_size_per_gpu=micro_batch_size
    )
    run_dir = claim_run_dir(args.trainer.run_dir(RECIPE), dist, args.trainer.force_unlock)
    seed_everything(args.trainer.seed + dist.rank)
    flags = flag_values(args)  # every flag by its name: what a checkpoint records and a resume compares

    # Data, read and checked before the model so bad rows fail in seconds; then the run to resume.
    tokenizer = load_tokenizer(args.model.tokenizer or args.model.path, args.model.trust_remote_code)
    train, stats = load_sft(args.data.train_files, tokenizer, args.data, "train_files")
    val = load_sft(args.data.val_files, tokenizer, args.data, "val_files")[0] if args.data.val_files else []
    steps_per_epoch = len(train) // batch_size
    if steps_per_epoch == 0:
        raise UsageError(f"train_files hold {len(train)} examples, fewer than train_batch_size={batch_size}")
    total_steps = args.trainer.total_steps(steps_per_epoch)
    checkpoint = find_resume(args.trainer.resume, run_dir, RECIPE, total_steps, flags)

    # Model, optimizer, schedule; then resume.
    resumed = prove_resume(args.trainer.check, dist)  # --check full: save, resume, a step, in child runs
    model, run_info = load_trained_model(args.model, dist)
    policy = trainable(model, args.optim, total_steps)  # the model with its AdamW and lr schedule
    start_step = resume(checkpoint, policy, dist=dist)["step"]
    bar = ("train/loss", "val/accuracy")
    tracker = Tracker(
        run_dir, start_step, total_steps, dist.is_main, args.trainer, RECIPE, flags, run_info, bar_keys=bar
    )
    tracker.write(describe_run(stats.summary("train"), total_steps, checkpoint, args.model.path, run_info, plan))
    trainer_check(args.trainer.check, tracker, resumed, dist.is_main, tokenizer)  # versions, template, resume

    validation = dict(batch_size=args.val_batch_size, max_new_tokens=args.max_new_tokens)
    if val and args.trainer.val_before_train and start_step == 0:
        tracker.log(validate(model, tokenizer, val, dist, **validation), step=0)
    model.train()
    stop = StopSignal(dist)  # SIGUSR1 / SIGTERM (Slurm, before the time limit): save after this step, exit 0
    for step in range(start_step, total_steps):
        # 1. this rank's slice of the global batch (a seeded order per epoch)
        epoch, ranks = step_rows(step, train, batch_size, args.trainer.seed, args.data.shuffle, dist.world_size)

        # 2-3. forward / backward over micro-batches, optimizer step
        grad_clip = args.optim.grad_clip
        metrics = train_step(policy, ranks[dist.rank], epoch, tokenizer.pad_token_id, dist, micro_batch_size, grad_clip)

        # 4. validate / save (and, after a stop signal, save and end the run here)
        done = step + 1
        if val and is_due(done, args.trainer.test_freq, total_steps):
            metrics.update(validate(model, tokenizer, val, dist, **validation))
        tracker.log(metrics, step=done)
        if (stopping := stop.requested()) or is_due(done, args.trainer.save_freq, total_steps):  # every rank at once
            position = {"epoch": done // steps_per_epoch, "batch_in_epoch": done % steps_per_epoch}
            save_checkpoint(run_dir, done, policy, dist, tokenizer, RECIPE, args.trainer, flags, position)
        if stopping:
            break
    return tracker.finish(PLOTS, stopped=stop.stopping)


if __name__ == "__main__":
    with usage_errors():  # a bad flag, path or file: one line naming it, exit status 2
        main(cli(Args, RECIPE, trainer="sft"))  # verl's key=value arguments work too
