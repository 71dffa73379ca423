"""On-policy distillation: the student samples, a teacher scores every sampled token, and the
student climbs the per-token reverse KL to the teacher on its own samples (Agarwal et al. 2024,
GKD, arXiv:2306.13649; Gu et al. 2024, MiniLLM, arXiv:2306.08543; as Qwen3's and Thinking
Machines' on-policy distillation run it).

A fork of grpo.py that differs in the advantage and the loss:
1. Advantage per token: A_t = -(log pi_old(y_t) - log pi_teacher(y_t)) on the student's sampled
   token y_t, the negative of a one-sample estimate of the reverse KL there; --kl-discount gamma
   sums the rest of the sequence into it, A_t = sum_{k>=t} gamma^(k-t) A_k (0: each token its own).
   --beta mixes in a task reward where the data has one: + beta x GRPO's group-standardised reward.
2. Loss: grpo.py's clipped surrogate on those advantages (ratio pi / pi_old). --loss gkd instead
   takes GKD's generalised Jensen-Shannon divergence to the teacher over the whole next-token
   distribution (--jsd-beta 0: forward KL(teacher || student), 1: reverse KL(student || teacher))
   on the student's samples, plus the surrogate on beta x the task advantage.
3. The teacher is any causal LM with the student's tokenizer (refused before any model loads
   otherwise; a larger vocabulary head is cut to the smaller one's width for gkd). It runs like the
   reference: micro-batched forward passes, no gradient, sharded under FSDP2; or, for reverse_kl, an
   engine serves it (--teacher-engine vllm, --teacher-placement remote: common.teacher.TeacherArgs).
4. Old logprobs come from a no-grad pass before the update (the advantage is made from them), or
   from the engine under --bypass-mode; --loss gkd takes them as grpo.py does.
--beta is not TRL's GKD beta, the divergence's interpolation: that one is --jsd-beta here.

Run (the tests run the same commands, shortened):
    python recipes/distill.py                 # bundled SFT student, its GRPO-trained teacher, CPU
    python recipes/distill.py --teacher-model Qwen/Qwen2.5-7B-Instruct --model Qwen/Qwen2.5-0.5B-Instruct \
        --train-files ~/data/gsm8k/train.parquet --val-files ~/data/gsm8k/test.parquet --lr 1e-6
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from tyro.conf import OmitArgPrefixes

from common.check import launch_check, prove_resume
from common.checkpoint import find_resume, resume, save_checkpoint
from common.config import RLArgs, TrainerArgs, cli, engine_sync, group, is_due, plan_rl_batches
from common.data import RLDataArgs, StepPrompts, split_rows, take_rows
from common.engines import RolloutArgs
from common.errors import usage_errors
from common.flags import flag, flag_values
from common.model import load_tokenizer, response_logits, response_logprobs
from common.ops import (
    KLEstimator,
    agg_loss,
    kl_from_logits,
    kl_penalty,
    logprobs_and_entropy,
    masked_mean,
    masked_mean_all_ranks,
)
from common.optim import trainable
from common.parallel import StopSignal, all_reduce_sum, clip_grad_norm, grad_sync, init_distributed
from common.rewards import start_reward_pool
from common.rollout import (
    Rollout,
    engine_logprobs,
    load_reward_model,
    load_rl_data,
    load_rl_models,
    start_engine,
    with_agents,
)
from common.runlock import claim_run_dir
from common.shaping import condition_advantages, condition_rewards, roll_terms, rollout_correction
from common.teacher import TeacherArgs, check_teacher, check_teacher_engine, jsd_from_logits, start_teacher
from common.tracking import Tracker, describe_run, step_metrics

RECIPE = Path(__file__).stem  # names the run and owns its checkpoints: a copy of this file is its own experiment
PLOTS = ("val/accuracy", "reward/mean", "distill/*", "policy/*", "train/grad_norm")  # panels of curves.png
CHANGED = {  # grpo.py's functions this file changes, with why (tests/test_rl_recipes.py holds the rest to grpo.py's)
    "compute_loss": "adds --loss gkd's divergence to the teacher",
    "forward_logprobs": "the teacher's divergence (--loss gkd) beside the reference's KL",
    "old_ref_logprobs": "the teacher's logprobs of the sampled tokens, for its advantage",
    "update": "the teacher on each micro-batch under --loss gkd",
    "main": "starts the teacher; step 5 makes the teacher's advantage",
}


# --- config ---------------------------------------------------------------------------------------
@dataclass
class Args(RLArgs):  # the flag groups (args.model, args.data, args.rollout, ...) come from RLArgs
    loss: Literal["reverse_kl", "gkd"] = "reverse_kl"
    """reverse_kl: the clipped surrogate on -(log student - log teacher) of each sampled token; gkd: GKD's
    generalised JSD to the teacher over the whole vocabulary"""
    jsd_beta: float = flag(
        0.5, ge=0, le=1, note="0: forward KL, 1: reverse KL", only_with=(lambda a: a.loss == "gkd", "add --loss gkd")
    )
    """--loss gkd: 0 the forward KL(teacher || student), 1 the reverse KL(student || teacher), between: the JSD"""
    kl_discount: float = flag(
        0.0, ge=0, le=1, only_with=(lambda a: a.loss == "reverse_kl", "drop --loss gkd (its divergence is per token)")
    )
    """gamma: a token's advantage adds the teacher's advantages of the tokens after it, discounted (0: its own)"""
    beta: float = flag(0.0, ge=0, note="the task reward's weight beside the teacher's")
    """weight of the task reward's GRPO advantage (--norm-adv-by-std-in-grpo) beside the teacher's (0: none)"""
    norm_adv_by_std_in_grpo: bool = True
    """divide by the group std (off: Dr.GRPO)"""
    clip_ratio: float = flag(0.2, gt=0)
    """PPO clip range of both sides unless clip_ratio_low / clip_ratio_high set one (verl configs that pin those at 0.2
    move neither with clip_ratio alone: docs/configuration.md)"""
    clip_ratio_low: float | None = flag(None, gt=0, le=1, note="the ratio is kept above 1 - clip_ratio_low")
    """lower clip range: the ratio is kept above 1 - clip_ratio_low (default clip_ratio)"""
    clip_ratio_high: float | None = flag(None, gt=0)
    """upper clip range: the ratio is kept below 1 + clip_ratio_high (DAPO clip-higher uses e.g. 0.28)"""
    clip_ratio_c: float = flag(3.0, gt=1, note="the dual-clip bound, 3 in verl")
    """dual-clip bound for negative advantages (> 1; 3 as in Ye et al. 2020, arXiv:1912.09729, and verl)"""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """how per-token losses become one number"""
    use_kl_loss: bool = False
    """add a KL(policy || reference) term to the loss"""
    kl_loss_coef: float = flag(
        0.001, ge=0, note="a negative weight would push the policy away from the reference", only_with="use_kl_loss"
    )
    """weight of the KL term in the loss"""
    kl_loss_type: KLEstimator = flag("low_var_kl", only_with="use_kl_loss")
    """KL estimator for the loss term (see common.ops.kl_penalty; full: the exact KL over the vocabulary)"""
    entropy_coeff: float = flag(0.0, ge=0, note="a negative bonus would reward collapsing the entropy")
    """entropy bonus weight"""
    teacher: Annotated[TeacherArgs, OmitArgPrefixes] = group(TeacherArgs)  # distill: the teacher
    """the teacher and where it runs: in the trainer, a vLLM engine, or Ray actors (common.teacher)"""
    # distill: with no groups to compare, more prompts and fewer samples of each; a shorter run
    data: Annotated[RLDataArgs, OmitArgPrefixes] = group(RLDataArgs, train_batch_size=64)
    """the prompts: files, columns, length, a step's share (common.data)"""
    rollout: Annotated[RolloutArgs, OmitArgPrefixes] = group(RolloutArgs, rollout_n=4)
    """the engine and how it samples (common.engines)"""
    trainer: Annotated[TrainerArgs, OmitArgPrefixes] = group(
        TrainerArgs, total_training_steps=30, test_freq=10, val_before_train=True
    )
    """the run: its folder, length, checkpoints, logs and launch check (common.config)"""

    def __post_init__(self):  # what an engine serving the teacher can give, before anything loads
        super().__post_init__()
        check_teacher_engine(self.teacher, self.loss, self.rollout)


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


def teacher_advantages(old_logprobs, teacher_logprobs, response_mask, kl_discount=0.0):
    """The teacher's per-token advantage on the student's sampled tokens: A_t = -(old_t - teacher_t),
    the negative of a one-sample estimate of KL(student || teacher) at t; with kl_discount gamma,
    A_t = sum_{k>=t} gamma^(k-t) A_k within each response. All (B, T); zero on padding, and zero
    everywhere without teacher_logprobs (--loss gkd: the teacher's divergence is the loss instead)."""
    if teacher_logprobs is None:
        return response_mask * 0
    advantages = -(old_logprobs - teacher_logprobs) * response_mask
    if kl_discount:
        running = torch.zeros_like(advantages[:, 0])
        for t in reversed(range(advantages.shape[1])):
            running = advantages[:, t] + kl_discount * running
            advantages[:, t] = running
    return advantages * response_mask


def reverse_kl(old_logprobs, teacher_logprobs, mask) -> dict:
    """distill/reverse_kl: KL(student || teacher) by its one-sample estimate on the student's tokens."""
    gap = None if teacher_logprobs is None else masked_mean_all_ranks(old_logprobs - teacher_logprobs, mask)
    return {} if gap is None else {"distill/reverse_kl": gap}


def compute_loss(new_logprobs, old_logprobs, advantages, response_mask, agg, args, entropy=None, kl=None, jsd=None):
    """Clipped surrogate with dual-clip, plus optional KL-to-reference and entropy terms.

    All tensors (B, T). ratio = exp(clamp(new - old, +-20)); per token, with low / high args.clip_ratio_low /
    _high (each args.clip_ratio when unset) and c args.clip_ratio_c,
        pg = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))
        pg = min(pg, -A * c)  where A < 0  (dual-clip bounds the loss of bad samples)
    loss = agg(pg) - args.entropy_coeff * agg(entropy) + args.kl_loss_coef * agg(kl), each agg by
    common.ops.agg_loss with agg's mode and counts (the whole mini-batch's tokens / sequences); kl is the per-token
    KL to the reference (update picks its estimator); --loss gkd adds jsd, the per-token divergence to the teacher
    (forward_logprobs), aggregated the same way. Returns ({term: value}, metrics): the loss is the terms' sum.
    """
    mask, low, high = response_mask, args.clip_ratio_low or args.clip_ratio, args.clip_ratio_high or args.clip_ratio
    log_ratio = torch.clamp(new_logprobs - old_logprobs, min=-20.0, max=20.0)  # exp overflow guard
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    pg = torch.maximum(loss_unclipped, loss_clipped)
    dual = -advantages * args.clip_ratio_c
    pg_dual = torch.where(advantages < 0, torch.minimum(pg, dual), pg)
    terms = {"pg": agg_loss(pg_dual, mask, **agg)}
    metrics = {
        "policy/pg_loss": terms["pg"].detach(),
        "policy/clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask),
        "policy/clipfrac_dual": masked_mean(((pg > dual) & (advantages < 0)).float(), mask),
        "policy/approx_kl": masked_mean(-log_ratio.detach(), mask),
    }
    if entropy is not None:
        if args.entropy_coeff:
            terms["entropy"] = -args.entropy_coeff * agg_loss(entropy, mask, **agg)
        metrics["policy/entropy"] = masked_mean(entropy.detach(), mask)
    if kl is not None:
        terms["kl"] = args.kl_loss_coef * agg_loss(kl, mask, **agg)
        metrics["policy/kl_ref"] = masked_mean(kl.detach(), mask)
    if jsd is not None:  # --loss gkd: the divergence to the teacher over the vocabulary
        terms["jsd"] = agg_loss(jsd, mask, **agg)
        metrics["distill/jsd"] = masked_mean(jsd.detach(), mask)
    return terms, metrics


# --- the steps of the loop ------------------------------------------------------------------------
def forward_logprobs(model, batch, rows, plan, with_entropy=False, kl_ref=None, teacher=None, jsd_beta=None):
    """Logprobs (and entropy) of the response tokens of batch[rows] under the model, (b, T).
    The logits are divided by the sampling temperature, as the sampler did. With kl_ref (the
    reference model) also the exact KL(model || kl_ref) of each token's whole next-token
    distribution (kl_loss_type full), (b, T); with teacher (--loss gkd) GKD's divergence to it,
    over the vocabulary both heads have. Returns (logprobs, entropy or None, KL or None, JSD or None)."""
    mb = take_rows(batch, rows)  # padding columns trimmed; widened back to T below
    widen = (0, batch["responses"].shape[1] - mb["responses"].shape[1])
    if teacher is None:  # grpo.py's pass, the LM head fused with the logprob
        out = response_logprobs(model, mb, plan.share_prompts, plan.temperature, with_entropy, kl_ref)
        return *(None if x is None else F.pad(x, widen) for x in out), None
    with torch.no_grad():  # the other models' first: one forward each, outside the policy's graph
        ref_logits = None if kl_ref is None else response_logits(kl_ref, mb, plan.share_prompts) / plan.temperature
        teacher_logits = response_logits(teacher, mb, plan.share_prompts)
    logits = response_logits(model, mb, share_prompts=plan.share_prompts) / plan.temperature  # GKD needs them whole
    logprobs, entropy = logprobs_and_entropy(logits, mb["responses"], mb["response_mask"], with_entropy)
    kl = None if kl_ref is None else kl_from_logits(logits, ref_logits)
    width = min(logits.shape[-1], teacher_logits.shape[-1])  # a head padded past the tokenizer's ids is cut
    jsd = jsd_from_logits(logits[..., :width], teacher_logits[..., :width] / plan.temperature, jsd_beta)
    return tuple(None if x is None else F.pad(x, widen) for x in (logprobs, entropy, kl, jsd))


@torch.no_grad()
def old_ref_logprobs(model, ref, teacher, batch, plan, source, args):
    """Step 4, in micro-batches. Old logprobs (source: common.config.Sync.old_logprobs) from a pass when
    they are needed before the update or set against the engine's ("pass"), or when the policy
    moves before a sample is used (several mini-batches or epochs); otherwise the update pass's
    detached logprobs are exact. "engine" (--bypass-mode) takes the engine's logprobs as the old
    ones, with no pass. Reference logprobs when the KL term estimates from them (--use-kl-loss, but
    for --kl-loss-type full; under LoRA the reference is the policy with its adapter off:
    common.model.AdapterOff); the teacher's of the sampled tokens for its advantage (--loss
    reverse_kl), from its passes or the engine serving it."""
    t, old_logprobs, ref_logprobs, teacher_logprobs = time.time(), None, None, None
    with_ref = args.use_kl_loss and args.kl_loss_type != "full"  # a KL estimated from the sampled tokens
    with_teacher = args.loss == "reverse_kl"  # distill: the teacher's advantage is made from its logprobs
    micro = split_rows(batch, **plan.micro)
    order = torch.cat(micro).argsort()  # micro-batches may be length-sorted: back to row order
    if source == "engine":  # the engine's logprobs are the old policy: no pass
        old_logprobs = batch["rollout_logprobs"]
    elif source == "pass" or plan.mini_batches_per_step > 1 or plan.epochs > 1:
        old_logprobs = torch.cat([forward_logprobs(model, batch, rows, plan)[0] for rows in micro])[order]
    if with_ref:
        ref_logprobs = torch.cat([forward_logprobs(ref, batch, rows, plan)[0] for rows in micro])[order]
    if with_teacher and isinstance(teacher, torch.nn.Module):
        teacher_logprobs = torch.cat([forward_logprobs(teacher, batch, rows, plan)[0] for rows in micro])[order]
    elif with_teacher:  # an engine serves the teacher (--teacher-engine vllm, --teacher-placement remote)
        teacher_logprobs = engine_logprobs(teacher, batch, plan.temperature)
    batch["timing"]["perf/logprobs_s"] = time.time() - t
    return old_logprobs, ref_logprobs, teacher_logprobs


def update(policy, ref, teacher, plan, batch, advantages, loss_mask, old_logprobs, ref_logprobs, args):
    """Step 6: plan.epochs x mini-batches x micro-batches, one optimizer step per mini-batch; then one lr-schedule
    step. The rollout correction (args.correction, off by default) weighs each token's advantage by the truncated
    pi_old / pi_rollout, and its rejection drops the tokens it rejects from the loss mask. The KL in the loss
    (--use-kl-loss) is estimated from step 4's ref_logprobs by --kl-loss-type; full runs the reference (ref) on
    each micro-batch for the exact KL instead. ROLL's loss terms (args.conditioning, off by default) reweigh
    compute_loss's before they are summed into the loss backward() sees. --loss gkd runs the teacher on each
    micro-batch, for its divergence (--jsd-beta)."""
    model, optimizer, scheduler = policy
    kl_type = args.kl_loss_type if args.use_kl_loss else None  # the KL term's estimator; None: no KL term
    kl_ref = ref if kl_type == "full" else None  # the exact KL: the reference on each micro-batch
    gkd = teacher if args.loss == "gkd" else None  # distill: the teacher on each micro-batch, for its divergence
    correction = rollout_correction(old_logprobs, batch["rollout_logprobs"], loss_mask, advantages, args.correction)
    is_weights, loss_mask, is_metrics = correction
    advantages = advantages * is_weights  # the advantages themselves when the correction is off
    agg = dict(mode=args.loss_agg_mode, norm_constant=args.rollout.max_response_length)
    t, stats, grad_norms, loss_sum = time.time(), [], [], 0.0
    for _ in range(plan.epochs):
        for mini in plan.mini_batches(batch["group_ids"]):  # this rank's rows of each (--shuffle-mini-batches)
            # Normalise by the whole mini-batch (every micro-batch, every rank), not per micro-batch.
            num_tokens = all_reduce_sum(loss_mask[mini].sum())
            num_seqs = all_reduce_sum((loss_mask[mini].sum(-1) > 0).sum().float())
            whole = dict(agg, num_tokens=num_tokens, num_seqs=num_seqs)  # agg_loss's mode and the counts
            micro = split_rows(batch, mini, **plan.micro)
            for k, rows in enumerate(micro):
                with grad_sync(model, enabled=k == len(micro) - 1):
                    passes = forward_logprobs(model, batch, rows, plan, True, kl_ref, gkd, args.jsd_beta)
                    new_logprobs, entropy, full_kl, jsd = passes
                    # On-policy (one mini-batch, one epoch): old = new at unchanged weights, ratio 1.
                    old = old_logprobs[rows] if old_logprobs is not None else new_logprobs.detach()
                    estimated = kl_type not in (None, "full")  # else the exact KL, or none
                    kl = kl_penalty(new_logprobs, ref_logprobs[rows], kl_type) if estimated else full_kl
                    adv, mask, rewards = advantages[rows], loss_mask[rows], batch["rewards"][rows]
                    terms, metrics = compute_loss(new_logprobs, old, adv, mask, whole, args, entropy, kl, jsd)
                    # ROLL's loss terms reweigh and extend compute_loss's (off by default: the same terms)
                    terms = roll_terms(terms, metrics, new_logprobs, old, adv, mask, whole, rewards, args.conditioning)
                    loss_mb = sum(terms.values())
                    # DDP and FSDP2 average gradients over ranks; the loss is already a global mean.
                    (loss_mb * plan.world_size).backward()
                stats.append((batch["response_mask"][rows].sum().item(), {k: float(v) for k, v in metrics.items()}))
                loss_sum += loss_mb.item()
            grad_norms.append(clip_grad_norm(model, args.optim.grad_clip))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    weight = sum(w for w, _ in stats) or 1.0
    metrics = {k: sum(w * m[k] for w, m in stats) / weight for k in stats[0][1]}
    metrics["train/loss"] = all_reduce_sum(torch.tensor(loss_sum)).item() / len(grad_norms)
    metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["train/lr"] = scheduler.get_last_lr()[0]
    metrics.update(is_metrics)
    scheduler.step()
    batch["timing"]["perf/update_s"] = time.time() - t
    return metrics


# --- main ---------------------------------------------------------------------------------------
def main(args: Args) -> dict:
    # Setup: process group; batch arithmetic and flags checked before anything loads.
    dist = init_distributed(args.trainer.wait_timeout, args.trainer.seed)  # seed + rank: ranks sample differently
    plan = plan_rl_batches(args.data, args.actor, args.rollout, dist.world_size)
    run_dir = claim_run_dir(args.trainer.run_dir(RECIPE), dist, args.trainer.force_unlock)
    flags = flag_values(args)  # every flag by its name: what a checkpoint records and a resume compares

    # Data, the run to resume and rewards (a reward dry run), then the models, engine and optimizer.
    tokenizer = load_tokenizer(args.model.tokenizer or args.model.path, args.model.trust_remote_code)
    check_teacher(args.teacher.teacher_model, tokenizer, args.model.trust_remote_code)  # the student's token ids
    train, stats, val = load_rl_data(args.data, tokenizer, args.reward, args.agent, args.env, args.conditioning)
    total_steps = args.trainer.total_steps(len(train) // args.data.train_batch_size)
    checkpoint = find_resume(args.trainer.resume, run_dir, RECIPE, total_steps, flags)
    pool = start_reward_pool(args.reward, args.agent, args.env, args.data, run_dir, tokenizer, train + val)
    resumed = prove_resume(args.trainer.check, dist)  # --check full: save, resume, a step, in child runs
    model, ref, run_info = load_rl_models(args.model, dist, with_reference=args.use_kl_loss)  # GRPO: KL in the loss
    reward_model = load_reward_model(args.reward, args.model, tokenizer, dist, args.actor.micro_batch_size_per_gpu)
    teacher = start_teacher(
        args.teacher, args.model, args.data, args.rollout, args.actor, args.placement, dist, tokenizer
    )
    policy = trainable(model, args.optim, total_steps)  # the policy with its AdamW and lr schedule
    state = resume(checkpoint, policy, dist=dist)  # the trainer state: step 0, or the checkpoint's
    prompts = StepPrompts(train, args.data, args.trainer.seed, total_steps)  # each step's rows, in a seeded order
    engine = start_engine(model, tokenizer, dist, state["step"], args.model, args.rollout, args.placement, prompts)
    engine = with_agents(engine, tokenizer, pool, args.agent, args.env, prompts.max_length)  # tools, environments
    rollout = Rollout(prompts, val, engine, pool, tokenizer, dist, args.rollout.sampling, args.validation, reward_model)
    tracker = Tracker(run_dir, state["step"], total_steps, dist.is_main, args.trainer, RECIPE, flags, run_info, plan)
    tracker.write(describe_run(stats.summary("train"), total_steps, checkpoint, args.model.path, run_info, plan))
    sync = engine_sync(args.model, args.rollout, args.placement, args.correction, args.loss == "reverse_kl")
    check = launch_check(args.trainer.check, model, engine, rollout, tracker, resumed, sync)
    if state["step"] == 0 and val and args.trainer.val_before_train:
        tracker.log(rollout.validate(), step=0)
    stop = StopSignal(dist)  # SIGUSR1 / SIGTERM (Slurm, before the time limit): save after this step, exit 0
    for step in stop.steps(state["step"], total_steps):  # to the end, or the step a stop signal came in
        # 1-3. sample prompts (this rank's share), generate rollout_n responses each, score them
        batch = rollout.step(step)
        rewards, group_ids, mask = batch["rewards"], batch["group_ids"], batch["response_mask"].float()  # B, B, B x T
        rewards = condition_rewards(rewards, batch, state, args.conditioning)  # ROLL's knobs (off by default)

        # 4. old / ref / teacher logprobs (the teacher's of the sampled tokens, for --loss reverse_kl)
        logprobs = old_ref_logprobs(model, ref, teacher, batch, plan, sync.old_logprobs, args)
        old_logprobs, ref_logprobs, teacher_logprobs = logprobs

        # 5. advantages: the teacher's per token, beta x GRPO's on the task reward; then ROLL's conditioning
        task = compute_advantages(rewards, group_ids, mask, norm_by_std=args.norm_adv_by_std_in_grpo)  # GRPO's
        advantages = teacher_advantages(old_logprobs, teacher_logprobs, mask, args.kl_discount) + args.beta * task
        advantages = condition_advantages(advantages, mask, batch, args.conditioning)

        # 6. update (with the rollout correction, if asked), then hand the new weights to the engine
        metrics = update(policy, ref, teacher, plan, batch, advantages, mask, old_logprobs, ref_logprobs, args)
        engine.update_weights(step + 1)

        # 7. log (the reverse KL to the teacher: its one-sample estimate on the student's tokens)
        metrics.update(step_metrics(batch, rewards, advantages, old_logprobs))
        metrics.update(reverse_kl(old_logprobs, teacher_logprobs, mask))
        metrics.update(check.during(step + 1, stop, metrics))  # --check-freq: the engine still serves the trainer

        # 8. validate / save (and, after a stop signal, save and end the run here)
        if val and is_due(step + 1, args.trainer.test_freq, total_steps):
            metrics.update(rollout.validate())
        tracker.log(metrics, step=step + 1)
        if stop.requested() or is_due(step + 1, args.trainer.save_freq, total_steps):  # every rank stops together
            trainer_state = dict(epoch=batch["epoch"], reward_stats=state.get("reward_stats"))
            save_checkpoint(run_dir, step + 1, policy, dist, tokenizer, RECIPE, args.trainer, flags, trainer_state)
    pool.close()
    return tracker.finish(PLOTS, stopped=stop.stopping, failure=stop.failure)


if __name__ == "__main__":
    with usage_errors():  # a bad flag, path or file: one line naming it, exit status 2
        main(cli(Args, RECIPE, "grpo"))  # verl's key=value arguments work too
