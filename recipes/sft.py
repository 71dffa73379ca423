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

import dataclasses
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated

import torch
import tyro

from common.check import prove_resume, trainer_check
from common.checkpoint import find_resume, resume, save_checkpoint
from common.config import DataArgs, ModelArgs, OptimArgs, TrainerArgs, cli_args, is_due, plan_batches
from common.data import pad, step_rows
from common.engines import hf_generate_greedy
from common.errors import UsageError, usage_errors
from common.flags import flag
from common.model import load_tokenizer, load_trained_model, sequence_logits
from common.ops import logprobs_from_logits
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
from common.sft_data import load_sft
from common.tracking import Tracker, describe_run

RECIPE = Path(__file__).stem  # names the run and owns its checkpoints: a copy of this file is its own experiment
PLOTS = ("val/accuracy", "val/loss", "train/loss", "train/lr")  # panels of curves.png


# --- config ---------------------------------------------------------------------------------------
@dataclass
class Args(TrainerArgs, DataArgs, ModelArgs):  # flags listed model, data, trainer; optim is a group
    response_key: Annotated[str, tyro.conf.arg(aliases=("--output-key",))] = "extra_info.answer"
    """column holding the response (dotted keys reach into structs; OpenRLHF's --output-key)"""
    messages_key: str = "messages"
    """chat column; used instead of prompt/response when a file has it"""
    tools_key: str = "tools"
    """column of a chat row's tool schemas (OpenAI format, a list or JSON), shown by the chat template"""
    max_length: int = flag(128, ge=1)
    """longest prompt + response in tokens (longer rows follow --truncation)"""
    train_batch_size: int = flag(64, ge=1)
    """examples per optimizer step, over all processes"""
    micro_batch_size_per_gpu: int = flag(32, ge=1)
    """examples per forward/backward pass on one process"""
    optim: Annotated[OptimArgs, tyro.conf.OmitArgPrefixes] = field(
        default_factory=partial(OptimArgs, lr=2e-3, lr_warmup_steps_ratio=0.05, lr_scheduler="cosine", weight_decay=0.0)
    )
    """AdamW and the lr schedule (common.optim)"""
    total_epochs: int = 6
    """passes over the training data (ignored when total_training_steps is set)"""
    test_freq: int | None = 100
    """validate every N steps and after the last (unset: only after the last; 0 or below: never, as in verl)"""
    max_new_tokens: int = flag(16, ge=1)
    """validation accuracy: greedy tokens generated per prompt"""
    val_batch_size: int = flag(256, ge=1)
    """validation: prompts per generate / forward call on one process"""


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
            model, [e["prompt_ids"] for e in local], pad_id=tokenizer.pad_token_id,
            eos_id=tokenizer.eos_token_id, max_new_tokens=max_new_tokens,
            batch_size=batch_size, device=dist.device, world_size=dist.world_size,
        )  # fmt: skip
        texts = tokenizer.batch_decode(completions[:n_real], skip_special_tokens=True)
        # Rows whose data_source has no built-in reward are scored by exact match.
        results = [
            (e["data_source"], (builtin_scorer(e["data_source"]) or exact_match)(text, e["ground_truth"]))
            for e, text in zip(local[:n_real], texts)
        ]  # fmt: skip
        results = [r for part in gather_objects(results) for r in part]
        metrics["val/accuracy"] = sum(s for _, s in results) / len(results)
        for source in sorted({d for d, _ in results}):
            hits = [s for d, s in results if d == source]
            metrics[f"val/accuracy/{source}"] = sum(hits) / len(hits)
    model.train()
    return {**metrics, "perf/validate_s": time.time() - started}


# --- one step ---------------------------------------------------------------------------------------
def train_step(policy, mine, epoch, pad_id, dist, *, micro_batch_size, grad_clip) -> dict:
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
        "train/loss": (all_reduce_sum(nll_total) / num_tokens).item(), "train/grad_norm": grad_norm,
        "train/lr": lr, "train/epoch": epoch, "train/tokens": num_tokens.item(),
        "perf/step_s": step_s, "perf/update_s": step_s, "perf/tokens_per_s": num_tokens.item() / step_s,
    }  # fmt: skip


# --- main ---------------------------------------------------------------------------------------
def main(args: Args) -> dict:
    # Setup: process group, batch arithmetic (before any model loads), run folder, seeds.
    dist = init_distributed(args.wait_timeout)
    plan = plan_batches(world_size=dist.world_size, train_batch_size=args.train_batch_size,
                        micro_batch_size_per_gpu=args.micro_batch_size_per_gpu)  # fmt: skip
    run_dir = claim_run_dir(args.run_dir(RECIPE), dist, args.force_unlock)
    seed_everything(args.seed + dist.rank)

    # Data, read and checked before the model so bad rows fail in seconds; then the run to resume.
    tokenizer = load_tokenizer(args.tokenizer or args.model, args.trust_remote_code)
    data_kwargs = dict(max_length=args.max_length, messages_key=args.messages_key, prompt_key=args.prompt_key,
                       response_key=args.response_key, tools_key=args.tools_key, truncation=args.truncation,
                       data_workers=args.data_workers)  # fmt: skip
    train, stats = load_sft(args.train_files, tokenizer, **data_kwargs, what="train_files")
    val = load_sft(args.val_files, tokenizer, **data_kwargs, what="val_files")[0] if args.val_files else []
    steps_per_epoch = len(train) // args.train_batch_size
    if steps_per_epoch == 0:
        raise UsageError(f"train_files hold {len(train)} examples, fewer than train_batch_size={args.train_batch_size}")
    total_steps = args.total_steps(steps_per_epoch)
    checkpoint = find_resume(args.resume, run_dir, RECIPE, total_steps, flags=dataclasses.asdict(args))

    # Model, optimizer, schedule; then resume.
    resumed = prove_resume(args.check, dist)  # --check full: save, resume, a step, in child runs of this command
    model, run_info = load_trained_model(args.model, dist, strategy=args.strategy, **args.policy_kwargs())
    policy = args.optim.trainable(model, total_steps)  # the model with its AdamW and lr schedule
    start_step = resume(checkpoint, policy, dist=dist)["step"]
    tracker = Tracker(run_dir, start_step, total_steps, is_main=dist.is_main, bar_keys=("train/loss", "val/accuracy"),
                      **args.tracker_kwargs(RECIPE, run_info))  # fmt: skip
    tracker.write(describe_run(stats.summary("train"), total_steps, checkpoint, args.model, run_info, plan))
    trainer_check(args.check, tracker, resumed, dist.is_main)  # the stack's versions; resume under --check full

    validation = dict(batch_size=args.val_batch_size, max_new_tokens=args.max_new_tokens)
    if val and args.val_before_train and start_step == 0:
        tracker.log(validate(model, tokenizer, val, dist, **validation), step=0)
    model.train()
    stop = StopSignal(dist)  # SIGUSR1 / SIGTERM (Slurm, before the time limit): save after this step, exit 0
    for step in range(start_step, total_steps):
        # 1. this rank's slice of the global batch (a seeded order per epoch)
        epoch, ranks = step_rows(step, train, args.train_batch_size, args.seed, args.shuffle, dist.world_size)

        # 2-3. forward / backward over micro-batches, optimizer step
        metrics = train_step(policy, ranks[dist.rank], epoch, tokenizer.pad_token_id, dist,
                             micro_batch_size=args.micro_batch_size_per_gpu, grad_clip=args.optim.grad_clip)  # fmt: skip

        # 4. validate / save (and, after a stop signal, save and end the run here)
        done = step + 1
        if val and is_due(done, args.test_freq, total_steps):
            metrics.update(validate(model, tokenizer, val, dist, **validation))
        tracker.log(metrics, step=done)
        if (stopping := stop.requested()) or is_due(done, args.save_freq, total_steps):  # every rank stops together
            position = {"epoch": done // steps_per_epoch, "batch_in_epoch": done % steps_per_epoch}
            save_checkpoint(run_dir, done, policy, dist=dist, tokenizer=tokenizer, trainer_state=position,
                            **args.save_kwargs(RECIPE))  # fmt: skip
        if stopping:
            break
    return tracker.finish(PLOTS, stopped=stop.stopping)


if __name__ == "__main__":
    with usage_errors():  # a bad flag, path or file: one line naming it, exit status 2
        main(tyro.cli(Args, args=cli_args(Args, trainer="sft")))  # verl's key=value arguments work too
