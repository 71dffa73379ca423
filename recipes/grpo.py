"""GRPO: group-relative policy optimisation (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

For every prompt, sample rollout_n responses; a response's advantage is its reward standardised
within its group, and the policy climbs a PPO-style clipped surrogate. How this file departs
from the paper (and matches verl's defaults):
1. Outcome reward only: one score per response, broadcast to every response token.
2. Advantage (r - mean_group) / (std_group + eps) with the unbiased std; a group of one uses mean 0
   and std 1; --no-norm-adv-by-std-in-grpo gives Dr.GRPO's r - mean.
3. No KL by default (--use-kl-loss adds it to the loss, never to the reward); the clip may be
   asymmetric (DAPO clip-higher) and negative advantages get dual-clip at clip_ratio_c.
4. The loss is aggregated by --loss-agg-mode with the token / sequence count of the whole
   mini-batch (all micro-batches, all ranks), so splitting a batch never changes the gradient.
5. Old logprobs come from the trainer: the detached logprobs of the update pass when each sample
   is used once at unchanged weights (one mini-batch, one epoch), else one no-grad pass first.
6. Optional DAPO pieces: overlong penalty (--overlong-buffer-len) and leaving zero-variance
   groups out of the loss (--filter-groups, without re-sampling to refill the batch).

Run (the tests run the same commands, shortened):
    python recipes/grpo.py                    # bundled SFT checkpoint + addition task, CPU
    torchrun --nproc_per_node 2 recipes/grpo.py --strategy fsdp2
    accelerate launch --config_file configs/fsdp2.yaml recipes/grpo.py --model Qwen/Qwen2.5-0.5B-Instruct \
        --train-files ~/data/gsm8k/train.parquet --val-files ~/data/gsm8k/test.parquet --lr 1e-6
"""

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro

from common.checkpoint import resume, save_checkpoint
from common.config import BUNDLED, DataArgs, ModelArgs, OptimArgs, TrainerArgs, is_due, plan_batches
from common.data import batch_indices, load_prompts, pack_sequences
from common.model import count_parameters, load_policy, load_tokenizer, response_logits
from common.ops import agg_loss, entropy_from_logits, kl_penalty, logprobs_from_logits, masked_mean
from common.optim import build_optimizer, build_scheduler
from common.parallel import (
    all_reduce_sum,
    barrier,
    clip_grad_norm,
    grad_sync,
    init_distributed,
    resolve_strategy,
    seed_everything,
    sharding_report,
    unwrap,
    wrap_model,
)
from common.rewards import RewardModel, RewardPool, load_reward_fn
from common.rollout import HFEngine, Sampling, evaluate
from common.tracking import Tracker, describe_run, rollout_metrics, setup_logging


# --- config ---------------------------------------------------------------------------------------
@dataclass
class Args(TrainerArgs, OptimArgs, DataArgs, ModelArgs):  # flags listed model, data, optim, trainer
    model: str = str(BUNDLED / "tiny-qwen2-sft")
    """policy: a local Hugging Face folder or a hub name"""
    max_prompt_length: int = 64
    """prompt tokens after the chat template (longer ones follow --truncation)"""
    max_response_length: int = 16
    """generated tokens per response"""
    filter_overlong_prompts: bool = False
    """drop (and count) prompts longer than max_prompt_length instead of truncating / failing"""
    train_batch_size: int = 16
    """prompts per step, over all processes"""
    rollout_n: int = 16
    """responses sampled per prompt (the group)"""
    ppo_mini_batch_size: int = 16
    """prompts per optimizer step; train_batch_size / ppo_mini_batch_size updates per step"""
    micro_batch_size_per_gpu: int = 64
    """sequences per forward/backward pass on one process"""
    ppo_epochs: int = 1
    """passes over each step's samples"""
    temperature: float = 1.0
    """sampling temperature (the trainer scales logits by it too)"""
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k"""
    val_temperature: float = 0.0
    """validation sampling; 0 is greedy"""
    val_n: int = 1
    """validation responses per prompt"""
    norm_adv_by_std_in_grpo: bool = True
    """divide by the group std (off: Dr.GRPO)"""
    clip_ratio: float = 0.2
    """PPO clip range; clip_ratio_low / clip_ratio_high override each side"""
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    """DAPO clip-higher uses e.g. 0.28"""
    clip_ratio_c: float = 3.0
    """dual-clip bound for negative advantages (> 1)"""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """how per-token losses become one number"""
    use_kl_loss: bool = False
    """add a KL(policy || reference) term to the loss"""
    kl_loss_coef: float = 0.001
    kl_loss_type: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "low_var_kl"
    entropy_coeff: float = 0.0
    """entropy bonus weight"""
    overlong_buffer_len: int = 0
    """DAPO overlong penalty: tokens before max_response_length where the penalty ramps up (0: off)"""
    overlong_penalty_factor: float = 1.0
    """DAPO overlong penalty at max_response_length"""
    filter_groups: bool = False
    """leave groups whose rewards are all equal (zero advantage) out of the loss denominators"""
    reward_fn: str | None = None
    """path/to/file.py[:name] with verl's compute_score signature (default: built-ins by data_source)"""
    reward_timeout: float = 10.0
    """seconds one sample may take to score before it gets 0"""
    reward_workers: int = 2
    """reward worker processes per rank"""
    reward_model: str | None = None
    """AutoModelForSequenceClassification folder / hub name; replaces the rule-based score"""
    lr: float = 2e-4
    """peak learning rate (AdamW)"""
    lr_scheduler: Literal["constant", "cosine", "wsd"] = "cosine"
    """lr after warmup: constant, cosine decay, or warmup-stable-decay"""
    total_training_steps: int | None = 80
    """stop after this many steps (None: total_epochs over the training prompts)"""
    test_freq: int = 20
    """validate every N steps (-1: only at the end); 0 never validates"""
    val_before_train: bool = True
    """validate once before the first step"""
    val_batch_size: int = 256
    """prompts per generate call in validation"""
    shared_prompt_forward: bool = True
    """trainer passes run each group's shared prompt once (same numbers; off: one pass per sequence)"""


# --- the algorithm ------------------------------------------------------------------------------------
def compute_advantages(rewards, group_ids, response_mask, norm_by_std=True, eps=1e-6):
    """GRPO outcome advantage: (r - mean_g) / (std_g + eps), broadcast over response tokens.

    rewards (B,), group_ids (B,) ints (equal for responses to the same prompt), response_mask
    (B, T). std is unbiased (n-1); a group of one has mean 0, std 1. norm_by_std=False: r - mean_g.
    Returns (B, T), zero on padding.
    """
    scores = torch.zeros_like(rewards, dtype=torch.float32)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx].float()
        mean, std = (r.mean(), r.std()) if r.numel() > 1 else (r.new_tensor(0.0), r.new_tensor(1.0))
        scores[idx] = (r - mean) / (std + eps) if norm_by_std else r - mean
    return scores.unsqueeze(-1) * response_mask


def compute_loss(
    new_logprobs, old_logprobs, advantages, response_mask, *, clip_ratio_low, clip_ratio_high,
    clip_ratio_c, loss_agg_mode, ref_logprobs=None, kl_loss_coef=0.0, kl_loss_type="low_var_kl",
    entropy=None, entropy_coeff=0.0, num_tokens=None, num_seqs=None, norm_constant=None,
):  # fmt: skip
    """Clipped surrogate with dual-clip, plus optional KL-to-reference and entropy terms.

    All tensors (B, T). ratio = exp(clamp(new - old, +-20)); per token
        pg = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))
        pg = min(pg, -A * clip_ratio_c)  where A < 0  (dual-clip bounds the loss of bad samples)
    loss = agg(pg) - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl(new, ref)), each agg
    by loss_agg_mode over num_tokens / num_seqs (see common.ops.agg_loss). Returns (loss, metrics).
    """
    mask = response_mask
    agg = dict(mode=loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_constant=norm_constant)
    log_ratio = torch.clamp(new_logprobs - old_logprobs, min=-20.0, max=20.0)  # exp overflow guard
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg = torch.maximum(loss_unclipped, loss_clipped)
    dual = -advantages * clip_ratio_c
    pg_dual = torch.where(advantages < 0, torch.minimum(pg, dual), pg)
    loss = agg_loss(pg_dual, mask, **agg)
    metrics = {
        "policy/pg_loss": loss.detach(),
        "policy/clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask),
        "policy/clipfrac_dual": masked_mean(((pg > dual) & (advantages < 0)).float(), mask),
        "policy/approx_kl": masked_mean(-log_ratio.detach(), mask),
    }
    if entropy is not None:
        if entropy_coeff:
            loss = loss - entropy_coeff * agg_loss(entropy, mask, **agg)
        metrics["policy/entropy"] = masked_mean(entropy.detach(), mask)
    if ref_logprobs is not None:
        kl = kl_penalty(new_logprobs, ref_logprobs, kl_loss_type)
        loss = loss + kl_loss_coef * agg_loss(kl, mask, **agg)
        metrics["policy/kl_ref"] = masked_mean(kl.detach(), mask)
    return loss, metrics


def overlong_penalty(lengths, max_len, buffer_len, factor):
    """DAPO soft overlong punishment: 0 until max_len - buffer_len, then down linearly to -factor."""
    over = (lengths.float() - (max_len - buffer_len)).clamp(min=0)
    return -factor * over / buffer_len


# --- the steps of the loop ------------------------------------------------------------------------
def forward_logprobs(model, batch, rows, args, with_entropy=False):
    """Logprobs (and entropy) of the response tokens of batch[rows] under the model, (b, T).
    The logits are divided by the sampling temperature, as the sampler did."""
    logits = response_logits(model, batch, rows, share_prompts=args.shared_prompt_forward) / args.temperature
    logprobs = logprobs_from_logits(logits, batch["responses"][rows])
    return logprobs, (entropy_from_logits(logits) if with_entropy else None)


def rollout(step, args, train, engine, sampling, pool, reward_model, tokenizer, dist, timing):
    """Steps 1-3 for this rank: sample prompts, generate rollout_n responses each, score them."""
    # 1. sample prompts: this rank's share of the global batch
    epoch, indices = batch_indices(step, len(train), args.train_batch_size, args.seed, args.shuffle)
    prompts = [train[i] for i in indices[dist.rank :: dist.world_size]]

    # 2. generate with the live policy
    t = time.time()
    groups = engine.generate([p["prompt_ids"] for p in prompts], sampling)
    rows = [(p, c) for p, group in zip(prompts, groups) for c in group]  # group g = rows g*n .. g*n+n-1
    responses = [c.token_ids for _, c in rows]
    batch = pack_sequences([p["prompt_ids"] for p, _ in rows], responses, tokenizer.pad_token_id, dist.device)
    batch.update(
        epoch=epoch,
        rows=rows,
        group_ids=torch.arange(len(prompts), device=dist.device).repeat_interleave(args.rollout_n),
    )
    timing["perf/generate_s"] = time.time() - t

    # 3. score: rule-based (verl's compute_score) in the worker pool, or the reward model
    t = time.time()
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    batch["scored"] = pool.score(
        [(p["data_source"], x, p["ground_truth"], p["extra_info"]) for (p, _), x in zip(rows, texts)]
    )
    rewards = torch.tensor(batch["scored"].scores, device=dist.device)  # (B,)
    if reward_model is not None:
        prompt_ids, messages = [p["prompt_ids"] for p, _ in rows], [p["messages"] for p, _ in rows]
        rewards = reward_model.score(messages, texts, prompt_ids, responses).to(dist.device)
    if args.overlong_buffer_len:  # DAPO: soft penalty for responses running into the length limit
        lengths = batch["response_mask"].sum(-1)
        rewards = rewards + overlong_penalty(
            lengths, args.max_response_length, args.overlong_buffer_len, args.overlong_penalty_factor
        )
    batch["rewards"] = rewards
    timing["perf/score_s"] = time.time() - t
    return batch


@torch.no_grad()
def old_and_ref_logprobs(args, model, ref, batch, separate_old_pass):
    """Step 4, in micro-batches. Old logprobs only when the policy moves before a sample is used
    (several mini-batches or epochs); otherwise the update pass's detached logprobs are exact."""
    chunks = [
        slice(k, k + args.micro_batch_size_per_gpu) for k in range(0, len(batch["rows"]), args.micro_batch_size_per_gpu)
    ]
    old_logprobs = ref_logprobs = None
    if separate_old_pass:
        old_logprobs = torch.cat([forward_logprobs(model, batch, s, args)[0] for s in chunks])
    if args.use_kl_loss:  # with LoRA the reference is the base model: the adapter switched off
        with unwrap(model).disable_adapter() if ref is None else contextlib.nullcontext():
            ref_logprobs = torch.cat([forward_logprobs(ref or model, batch, s, args)[0] for s in chunks])
    return old_logprobs, ref_logprobs


def update(args, plan, model, optimizer, batch, advantages, loss_mask, old_logprobs, ref_logprobs, dist):
    """Step 6: ppo_epochs x mini-batches x micro-batches, one optimizer step per mini-batch."""
    clip_low = args.clip_ratio if args.clip_ratio_low is None else args.clip_ratio_low
    clip_high = args.clip_ratio if args.clip_ratio_high is None else args.clip_ratio_high
    micro = args.micro_batch_size_per_gpu
    stats, grad_norms, loss_sum = [], [], 0.0
    for _ in range(args.ppo_epochs):
        for m in range(plan.mini_batches_per_step):
            mb = slice(m * plan.local_mini_batch, (m + 1) * plan.local_mini_batch)
            # Normalise by the whole mini-batch (every micro-batch, every rank), not per micro-batch.
            num_tokens = all_reduce_sum(loss_mask[mb].sum())
            num_seqs = all_reduce_sum((loss_mask[mb].sum(-1) > 0).sum().float())
            micro_slices = [slice(k, min(k + micro, mb.stop)) for k in range(mb.start, mb.stop, micro)]
            for k, s in enumerate(micro_slices):
                with grad_sync(model, enabled=k == len(micro_slices) - 1):
                    new_logprobs, entropy = forward_logprobs(model, batch, s, args, with_entropy=True)
                    old = old_logprobs[s] if old_logprobs is not None else new_logprobs.detach()
                    loss, metrics = compute_loss(
                        new_logprobs, old, advantages[s], loss_mask[s], clip_ratio_low=clip_low,
                        clip_ratio_high=clip_high, clip_ratio_c=args.clip_ratio_c,
                        loss_agg_mode=args.loss_agg_mode, entropy=entropy, entropy_coeff=args.entropy_coeff,
                        ref_logprobs=None if ref_logprobs is None else ref_logprobs[s],
                        kl_loss_coef=args.kl_loss_coef, kl_loss_type=args.kl_loss_type,
                        num_tokens=num_tokens, num_seqs=num_seqs, norm_constant=args.max_response_length,
                    )  # fmt: skip
                    # DDP and FSDP2 average gradients over ranks; the loss is already a global mean.
                    (loss * dist.world_size).backward()
                stats.append((batch["response_mask"][s].sum().item(), {k: float(v) for k, v in metrics.items()}))
                loss_sum += loss.item()
            grad_norms.append(clip_grad_norm(model, args.grad_clip))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    weight = sum(w for w, _ in stats) or 1.0
    metrics = {k: sum(w * m[k] for w, m in stats) / weight for k in stats[0][1]}
    metrics["train/loss"] = all_reduce_sum(torch.tensor(loss_sum)).item() / len(grad_norms)
    metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
    return metrics


def load_data_and_rewards(args, tokenizer):
    """Training / validation prompts and the reward pool, with a reward dry run on a few rows."""
    data_kwargs = dict(prompt_key=args.prompt_key, max_prompt_length=args.max_prompt_length, truncation=args.truncation)
    data_kwargs["filter_overlong_prompts"] = args.filter_overlong_prompts
    train, train_stats = load_prompts(args.train_files, tokenizer, **data_kwargs, what="train_files")
    if len(train) < args.train_batch_size:
        raise ValueError(f"train_files hold {len(train)} prompts, fewer than train_batch_size={args.train_batch_size}")
    val = load_prompts(args.val_files, tokenizer, **data_kwargs, what="val_files")[0] if args.val_files else []
    load_reward_fn(args.reward_fn)  # a missing file or function fails here, with its name
    pool = RewardPool(args.reward_fn, workers=args.reward_workers, timeout=args.reward_timeout)
    if args.reward_model is None:
        pool.dry_run(train[:2] + val[:2])
    return train, train_stats, val, pool


def load_models(args, tokenizer, strategy, dist):
    """The policy (wrapped for DDP / FSDP2), the frozen reference only for the KL loss (with LoRA
    none: the adapter-disabled policy is the reference), and the optional reward model."""
    model_kwargs = dict(dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    model = load_policy(
        args.model, **model_kwargs, gradient_checkpointing=args.gradient_checkpointing,
        lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=args.target_modules,
    )  # fmt: skip
    counts = count_parameters(model)
    model = wrap_model(model, strategy, dist, args.mixed_precision)
    ref = None
    if args.use_kl_loss and args.lora_rank == 0:
        ref = load_policy(args.model, **model_kwargs).eval().requires_grad_(False)
        ref = wrap_model(ref, "fsdp2" if strategy == "fsdp2" else "none", dist, args.mixed_precision)
    reward_model = RewardModel(args.reward_model, tokenizer, dist.device) if args.reward_model else None
    return model, ref, reward_model, counts


# --- main ---------------------------------------------------------------------------------------
def main(args: Args) -> dict:
    # Setup: process group, batch arithmetic (before any model loads), seeds.
    dist = init_distributed()
    setup_logging(dist.rank)
    plan = plan_batches(
        world_size=dist.world_size, train_batch_size=args.train_batch_size, rollout_n=args.rollout_n,
        mini_batch_size=args.ppo_mini_batch_size, micro_batch_size_per_gpu=args.micro_batch_size_per_gpu,
    )  # fmt: skip
    if args.clip_ratio_c <= 1:
        raise ValueError(f"clip_ratio_c={args.clip_ratio_c} must be > 1 (dual-clip bound)")
    name = args.experiment_name or "grpo"
    run_dir = Path(args.output_dir or f"runs/{name}")
    seed_everything(args.seed + dist.rank)  # ranks sample different responses

    # Data and rewards, checked before the model loads; then the models.
    tokenizer = load_tokenizer(args.tokenizer or args.model, args.trust_remote_code)
    train, stats, val, pool = load_data_and_rewards(args, tokenizer)
    total_steps = args.total_training_steps or args.total_epochs * (len(train) // args.train_batch_size)
    strategy = resolve_strategy(args.strategy)
    model, ref, reward_model, counts = load_models(args, tokenizer, strategy, dist)
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device=dist.device,
                      world_size=dist.world_size, batch_size=args.val_batch_size)  # fmt: skip
    common_sampling = dict(top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_response_length)
    sampling = Sampling(n=args.rollout_n, temperature=args.temperature, **common_sampling)
    val_sampling = Sampling(n=args.val_n, temperature=args.val_temperature, **common_sampling)

    optimizer = build_optimizer(model, args.lr, args.weight_decay, args.betas)
    scheduler = build_scheduler(optimizer, kind=args.lr_scheduler, total_steps=total_steps,
                                warmup_ratio=args.lr_warmup_steps_ratio, min_lr_ratio=args.min_lr_ratio)  # fmt: skip
    start_step, resume_from = resume(
        args.resume, run_dir, total_steps, model=model, optimizer=optimizer, scheduler=scheduler, dist=dist
    )
    if start_step >= total_steps:
        return pool.close() or {"steps": 0}
    run_info = sharding_report(model, strategy, dist)
    tracker = Tracker(
        run_dir, loggers=args.logger, project=args.project_name, experiment=name, is_main=dist.is_main,
        config={**dataclasses.asdict(args), "run": run_info}, total_steps=total_steps,
        start_step=start_step, bar_keys=("reward/mean", "val/accuracy"),
    )  # fmt: skip
    tracker.write(describe_run(stats.summary("train"), total_steps, resume_from, args.model, counts, run_info, plan))

    first_val, val_metrics, t_start = {}, {}, time.time()
    if val and args.val_before_train and start_step == 0:
        first_val = val_metrics = evaluate(engine, pool, tokenizer, val, val_sampling, dist)
        tracker.log(val_metrics, step=0)
    separate_old_pass = plan.mini_batches_per_step > 1 or args.ppo_epochs > 1
    for step in range(start_step, total_steps):
        timing, t0 = {}, time.time()
        # 1-3. sample prompts, generate, score
        batch = rollout(step, args, train, engine, sampling, pool, reward_model, tokenizer, dist, timing)
        rewards, group_ids = batch["rewards"], batch["group_ids"]  # (B,), (B,)
        mask = batch["response_mask"].float()  # (B, T)

        # 4. old / ref logprobs
        t = time.time()
        old_logprobs, ref_logprobs = old_and_ref_logprobs(args, model, ref, batch, separate_old_pass)
        timing["perf/logprobs_s"] = time.time() - t

        # 5. advantages: standardised within each prompt's group
        advantages = compute_advantages(rewards, group_ids, mask, norm_by_std=args.norm_adv_by_std_in_grpo)
        loss_mask = mask.clone()
        if args.filter_groups:  # DAPO: all-equal groups carry no signal; keep them out of the means
            flat = rewards.view(-1, args.rollout_n)
            loss_mask[(flat == flat[:, :1]).all(-1).repeat_interleave(args.rollout_n)] = 0

        # 6. update
        t = time.time()
        metrics = update(args, plan, model, optimizer, batch, advantages, loss_mask, old_logprobs, ref_logprobs, dist)
        metrics["train/lr"] = scheduler.get_last_lr()[0]
        scheduler.step()
        engine.update_weights(step + 1)
        timing["perf/update_s"] = time.time() - t

        # 7. log
        truncated = [c.finish_reason == "length" for _, c in batch["rows"]]
        sources = [p["data_source"] for p, _ in batch["rows"]]
        metrics.update(rollout_metrics(rewards.tolist(), mask.sum(-1).tolist(), truncated, sources, batch["scored"]))
        tokens = all_reduce_sum(batch["attention_mask"].sum().float()).item()
        metrics.update(
            timing,
            **{
                "train/epoch": batch["epoch"],
                "perf/step_s": time.time() - t0,
                "perf/tokens_per_s": tokens / (time.time() - t0),
            },
        )

        # 8. validate / save
        done = step + 1
        if val and is_due(done, args.test_freq, total_steps):
            val_metrics = evaluate(engine, pool, tokenizer, val, val_sampling, dist)
            metrics.update(val_metrics)
        tracker.log(metrics, step=done)
        tracker.advance()
        if is_due(done, args.save_freq, total_steps):
            save_checkpoint(
                run_dir, done, model=model, optimizer=optimizer, scheduler=scheduler, tokenizer=tokenizer, dist=dist,
                keep=args.max_ckpt_to_keep, merged_lora=args.export_merged_lora, trainer_state={"epoch": batch["epoch"]},
            )  # fmt: skip

    barrier()
    pool.close()
    summary = {"steps": total_steps - start_step, "seconds": time.time() - t_start, **val_metrics}
    tracker.finish(
        summary,
        first_val,
        plot_keys=("val/accuracy", "reward/mean", "response/length_mean", "policy/*", "train/grad_norm"),
    )
    return summary


if __name__ == "__main__":
    main(tyro.cli(Args))
