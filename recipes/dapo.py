"""DAPO: decoupled clip and dynamic sampling policy optimisation (Yu et al. 2025, arXiv:2503.14476).

For every prompt, sample rollout_n responses; a response's advantage is its reward set against its
group's (point 2), and the policy climbs a surrogate of it (point 3). How this file departs from
the paper (and matches verl's defaults):
1. Outcome reward only: one score per response, broadcast to every response token.
2. Advantage (r - mean_group) / (std_group + eps) with the unbiased std; a group of one uses mean 0
   and std 1; --no-norm-adv-by-std-in-grpo gives Dr.GRPO's r - mean.
3. No KL by default (--use-kl-loss adds it to the loss, never to the reward); the clip may be
   asymmetric (clip-higher) and negative advantages get dual-clip at clip_ratio_c.
4. The loss is aggregated by --loss-agg-mode with the token / sequence count of the whole
   mini-batch (all micro-batches, all ranks), so splitting a batch never changes the gradient.
5. Old logprobs come from the trainer: the detached logprobs of the update pass when each sample
   is used once at unchanged weights (one mini-batch, one epoch), else one no-grad pass first.
   Rollout correction (verl's algorithm.rollout_correction, off by default): the engine that
   sampled (pi_rollout: vLLM's or a remote engine's own copy, other kernels; with --max-staleness k,
   weights up to k steps older) is not exactly pi_old. --rollout-is token
   scales each token's advantage by w_t = min(exp(old_t - rollout_t), --rollout-is-threshold),
   sequence by min(exp(sum_t (old_t - rollout_t)), threshold) on all its tokens (log ratios
   clamped to +-20); w is detached and positive, so this weights each token's loss as verl does.
   --rollout-is-threshold lo_hi zeroes the weights outside [lo, hi] instead (IcePop), and
   --rollout-rs drops the tokens or responses whose gap leaves its band from the loss.
   --bypass-mode takes the engine's logprobs as the old ones: ratio pi / pi_rollout, no old pass.
DAPO, a fork of grpo.py (verl's recipe/dapo defaults; the overlong buffer scaled to 16-token responses):
6. Dynamic sampling: re-sample until train_batch_size groups have unequal rewards (dynamic_sampling).
7. Clip-higher (0.2 / 0.28), token-mean loss and the overlong penalty (eq. 13); no KL.

Run (the tests run the same commands, shortened):
    python recipes/dapo.py                    # bundled SFT checkpoint + addition task, CPU
    torchrun --nproc_per_node 2 recipes/dapo.py --strategy fsdp2
    accelerate launch --config_file configs/fsdp2.yaml recipes/dapo.py --model Qwen/Qwen2.5-0.5B-Instruct \
        --train-files ~/data/gsm8k/train.parquet --val-files ~/data/gsm8k/test.parquet --lr 1e-6
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from common.check import launch_check, prove_resume
from common.checkpoint import find_resume, resume, save_checkpoint
from common.config import RLArgs, cli, engine_sync, is_due, plan_rl_batches
from common.data import StepPrompts, split_rows, take_rows
from common.errors import UsageError, usage_errors
from common.flags import flag, flag_values
from common.model import load_tokenizer, response_logprobs
from common.ops import KLEstimator, agg_loss, kl_penalty, masked_mean
from common.optim import trainable
from common.parallel import StopSignal, all_reduce_sum, clip_grad_norm, gather_objects, grad_sync, init_distributed
from common.rewards import start_reward_pool
from common.rollout import Rollout, load_reward_model, load_rl_data, load_rl_models, regroup, start_engine, with_agents
from common.runlock import claim_run_dir
from common.shaping import condition_advantages, condition_rewards, roll_terms, rollout_correction
from common.tracking import Tracker, describe_run, step_metrics

RECIPE = Path(__file__).stem  # names the run and owns its checkpoints: a copy of this file is its own experiment
PLOTS = ("val/accuracy", "reward/mean", "response/length_mean", "policy/*", "train/grad_norm")  # panels of curves.png
CHANGED = {  # grpo.py's functions this file changes, with why (tests/test_rl_recipes.py holds the rest to grpo.py's)
    "main": "step 4 samples until enough groups have mixed rewards (overlong penalty too); data counts batches",
}


# --- config ---------------------------------------------------------------------------------------
@dataclass
class Args(RLArgs):  # the flag groups (args.model, args.data, args.rollout, ...) come from RLArgs
    norm_adv_by_std_in_grpo: bool = True
    """divide by the group std (off: Dr.GRPO)"""
    clip_ratio: float = flag(0.2, gt=0)
    """PPO clip range of both sides unless clip_ratio_low / clip_ratio_high set one (verl configs that pin those at 0.2
    move neither with clip_ratio alone: docs/configuration.md)"""
    clip_ratio_low: float | None = flag(None, gt=0, le=1, note="the ratio is kept above 1 - clip_ratio_low")
    """lower clip range: the ratio is kept above 1 - clip_ratio_low (default clip_ratio)"""
    clip_ratio_high: float | None = flag(0.28, gt=0)  # DAPO: clip-higher leaves room for unlikely tokens to rise
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
    max_num_gen_batches: int = flag(10, ge=0, note="0: no limit")  # DAPO: as verl's DAPO scripts
    """dynamic sampling: most generation batches per step (0: no limit); then the step trains on the groups found
    (verl stops the run there)"""
    overlong_buffer_len: int = flag(4, ge=0, le="max_response_length", note="0: off")  # DAPO (paper: 4096 of 20480)
    """overlong penalty: the last N tokens before max_response_length, where it ramps up (0: off)"""
    overlong_penalty_factor: float = flag(
        1.0, ge=0, only_with=(lambda a: a.overlong_buffer_len > 0, "set --overlong-buffer-len above 0")
    )  # DAPO
    """overlong penalty at max_response_length"""

    def __post_init__(self):  # DAPO: dynamic sampling draws batches as its filter asks, so none ahead of the policy
        super().__post_init__()
        if n := self.placement.max_staleness:
            raise UsageError(f"--max-staleness {n}: must be 0: dynamic sampling draws batches as its filter asks")


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


def compute_loss(new_logprobs, old_logprobs, advantages, response_mask, agg, args, entropy=None, kl=None):
    """Clipped surrogate with dual-clip, plus optional KL-to-reference and entropy terms.

    All tensors (B, T). ratio = exp(clamp(new - old, +-20)); per token, with low / high args.clip_ratio_low /
    _high (each args.clip_ratio when unset) and c args.clip_ratio_c,
        pg = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))
        pg = min(pg, -A * c)  where A < 0  (dual-clip bounds the loss of bad samples)
    loss = agg(pg) - args.entropy_coeff * agg(entropy) + args.kl_loss_coef * agg(kl), each agg by
    common.ops.agg_loss with agg's mode and counts (the whole mini-batch's tokens / sequences); kl is the per-token
    KL to the reference (update picks its estimator). Returns ({term: value}, metrics): the loss is the terms' sum.
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
    return terms, metrics


def overlong_penalty(lengths, max_len, buffer_len, factor):  # DAPO
    """DAPO's soft overlong punishment (eq. 13) for the reward: 0 up to max_len - buffer_len tokens, then
    down linearly to -factor at max_len. lengths (B,) -> (B,)."""
    over = (lengths.float() - (max_len - buffer_len)).clamp(min=0)
    return -factor * over / max(buffer_len, 1)


def select_groups(group_rewards, want):  # DAPO
    """Dynamic sampling's pick of groups [[reward]], in order: the first `want` with unequal rewards (the rewards with
    the overlong penalty: verl's default metric, seq_reward; a group of one counts, as in verl), then zero-variance
    fillers. Returns (indices, spread flags)."""
    spread = [len(r) == 1 or max(r) > min(r) for r in group_rewards]
    chosen = sorted(sorted(range(len(spread)), key=lambda i: not spread[i])[:want])  # a stable sort
    return chosen, [spread[i] for i in chosen]


# --- the steps of the loop ------------------------------------------------------------------------
def forward_logprobs(model, batch, rows, plan, with_entropy=False, kl_ref=None):
    """Logprobs (and entropy) of the response tokens of batch[rows] under the model, (b, T).
    The logits are divided by the sampling temperature, as the sampler did. With kl_ref (the
    reference model) also the exact KL(model || kl_ref) of each token's whole next-token
    distribution (kl_loss_type full), (b, T). Returns (logprobs, entropy or None, KL or None)."""
    mb = take_rows(batch, rows)  # padding columns trimmed; widened back to T below
    out = response_logprobs(model, mb, plan.share_prompts, plan.temperature, with_entropy, kl_ref)
    widen = (0, batch["responses"].shape[1] - mb["responses"].shape[1])
    return tuple(None if x is None else F.pad(x, widen) for x in out)


def dynamic_sampling(rollout, gen_batches, max_batches, buffer_len, factor):  # DAPO
    """Steps 1-3, DAPO's way: batches of rollout.step (overlong_penalty in the rewards) from gen_batches on until
    select_groups finds over all ranks rollout.batch_size groups with unequal rewards (or fillers after max_batches)."""
    n, dist, groups, parts, spread = rollout.sampling.n, rollout.dist, [], [], [False]
    while not all(spread) and (len(parts) < max_batches or max_batches <= 0):
        part = rollout.step(gen_batches + len(parts))
        lengths = part["attention_mask"][:, -part["responses"].shape[1] :].sum(-1)  # tool tokens too (verl: its mask)
        part["rewards"] = part["rewards"] + overlong_penalty(lengths, rollout.sampling.max_tokens, buffer_len, factor)
        parts.append(part)
        mine = list(zip(part["rows"], part["rewards"].tolist(), part["scored"].scores, part["scored"].extras))
        groups += [g for rank in gather_objects([mine[k : k + n] for k in range(0, len(mine), n)]) for g in rank]
        chosen, spread = select_groups([[r for _, r, _, _ in g] for g in groups], rollout.batch_size)
    batch = regroup([groups[i] for i in chosen[dist.rank :: dist.world_size]], parts, rollout.tokenizer, dist.device)
    batch["epoch"] = part["epoch"]
    batch["spread"] = torch.tensor(spread[dist.rank :: dist.world_size], device=dist.device).repeat_interleave(n)
    kept = sum(spread)
    batch["dapo"] = {"dapo/gen_batches": len(parts), "dapo/kept_groups": kept, "dapo/filler_groups": len(spread) - kept}
    return batch


@torch.no_grad()
def old_ref_logprobs(model, ref, batch, plan, source, args):
    """Step 4, in micro-batches. Old logprobs (source: common.config.Sync.old_logprobs) from a pass when
    they are needed before the update or set against the engine's ("pass"), or when the policy
    moves before a sample is used (several mini-batches or epochs); otherwise the update pass's
    detached logprobs are exact. "engine" (--bypass-mode) takes the engine's logprobs as the old
    ones, with no pass. Reference logprobs when the KL term estimates from them (--use-kl-loss, but
    for --kl-loss-type full; under LoRA the reference is the policy with its adapter off:
    common.model.AdapterOff)."""
    t, old_logprobs, ref_logprobs = time.time(), None, None
    with_ref = args.use_kl_loss and args.kl_loss_type != "full"  # a KL estimated from the sampled tokens
    micro = split_rows(batch, **plan.micro)
    order = torch.cat(micro).argsort()  # micro-batches may be length-sorted: back to row order
    if source == "engine":  # the engine's logprobs are the old policy: no pass
        old_logprobs = batch["rollout_logprobs"]
    elif source == "pass" or plan.mini_batches_per_step > 1 or plan.epochs > 1:
        old_logprobs = torch.cat([forward_logprobs(model, batch, rows, plan)[0] for rows in micro])[order]
    if with_ref:
        ref_logprobs = torch.cat([forward_logprobs(ref, batch, rows, plan)[0] for rows in micro])[order]
    batch["timing"]["perf/logprobs_s"] = time.time() - t
    return old_logprobs, ref_logprobs


def update(policy, ref, plan, batch, advantages, loss_mask, old_logprobs, ref_logprobs, args):
    """Step 6: plan.epochs x mini-batches x micro-batches, one optimizer step per mini-batch; then one lr-schedule
    step. The rollout correction (args.correction, off by default) weighs each token's advantage by the truncated
    pi_old / pi_rollout, and its rejection drops the tokens it rejects from the loss mask. The KL in the loss
    (--use-kl-loss) is estimated from step 4's ref_logprobs by --kl-loss-type; full runs the reference (ref) on
    each micro-batch for the exact KL instead. ROLL's loss terms (args.conditioning, off by default) reweigh
    compute_loss's before they are summed into the loss backward() sees."""
    model, optimizer, scheduler = policy
    kl_type = args.kl_loss_type if args.use_kl_loss else None  # the KL term's estimator; None: no KL term
    kl_ref = ref if kl_type == "full" else None  # the exact KL: the reference on each micro-batch
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
                    new_logprobs, entropy, full_kl = forward_logprobs(model, batch, rows, plan, True, kl_ref)
                    # On-policy (one mini-batch, one epoch): old = new at unchanged weights, ratio 1.
                    old = old_logprobs[rows] if old_logprobs is not None else new_logprobs.detach()
                    estimated = kl_type not in (None, "full")  # else the exact KL, or none
                    kl = kl_penalty(new_logprobs, ref_logprobs[rows], kl_type) if estimated else full_kl
                    adv, mask, rewards = advantages[rows], loss_mask[rows], batch["rewards"][rows]
                    terms, metrics = compute_loss(new_logprobs, old, adv, mask, whole, args, entropy, kl)
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
    train, stats, val = load_rl_data(args.data, tokenizer, args.reward, args.agent, args.env, args.conditioning)
    total_steps = args.trainer.total_steps(len(train) // args.data.train_batch_size)
    checkpoint = find_resume(args.trainer.resume, run_dir, RECIPE, total_steps, flags)
    pool = start_reward_pool(args.reward, args.agent, args.env, args.data, run_dir, tokenizer, train + val)
    resumed = prove_resume(args.trainer.check, dist)  # --check full: save, resume, a step, in child runs
    model, ref, run_info = load_rl_models(args.model, dist, with_reference=args.use_kl_loss)  # GRPO: KL in the loss
    reward_model = load_reward_model(args.reward, args.model, tokenizer, dist, args.actor.micro_batch_size_per_gpu)
    policy = trainable(model, args.optim, total_steps)  # the policy with its AdamW and lr schedule
    state = resume(checkpoint, policy, dist=dist)  # the trainer state: step 0, or the checkpoint's
    gen_batches = state.get("gen_batches", 0)  # DAPO: the data position counts generation batches
    prompts = StepPrompts(train, args.data, args.trainer.seed, total_steps)  # each step's rows, in a seeded order
    engine = start_engine(model, tokenizer, dist, state["step"], args.model, args.rollout, args.placement, prompts)
    engine = with_agents(engine, tokenizer, pool, args.agent, args.env, prompts.max_length)  # tools, environments
    rollout = Rollout(prompts, val, engine, pool, tokenizer, dist, args.rollout.sampling, args.validation, reward_model)
    tracker = Tracker(run_dir, state["step"], total_steps, dist.is_main, args.trainer, RECIPE, flags, run_info, plan)
    tracker.write(describe_run(stats.summary("train"), total_steps, checkpoint, args.model.path, run_info, plan))
    sync = engine_sync(args.model, args.rollout, args.placement, args.correction)
    check = launch_check(args.trainer.check, model, engine, rollout, tracker, resumed, sync)
    if state["step"] == 0 and val and args.trainer.val_before_train:
        tracker.log(rollout.validate(), step=0)
    stop = StopSignal(dist)  # SIGUSR1 / SIGTERM (Slurm, before the time limit): save after this step, exit 0
    for step in stop.steps(state["step"], total_steps):  # to the end, or the step a stop signal came in
        # 1-3. sample prompts (this rank's share), generate rollout_n responses each, score them
        batch = dynamic_sampling(
            rollout, gen_batches, args.max_num_gen_batches, args.overlong_buffer_len, args.overlong_penalty_factor
        )
        gen_batches += batch["dapo"]["dapo/gen_batches"]  # DAPO: the data position counts generation batches
        rewards, group_ids, mask = batch["rewards"], batch["group_ids"], batch["response_mask"].float()  # B, B, B x T
        rewards = condition_rewards(rewards, batch, state, args.conditioning)  # ROLL's knobs (off by default)
        mask = mask * batch["spread"][:, None]  # DAPO: the filler groups stay out of the loss

        # 4. old / ref logprobs
        old_logprobs, ref_logprobs = old_ref_logprobs(model, ref, batch, plan, sync.old_logprobs, args)

        # 5. advantages: standardised within each prompt's group; then ROLL's conditioning
        advantages = compute_advantages(rewards, group_ids, mask, norm_by_std=args.norm_adv_by_std_in_grpo)
        advantages = condition_advantages(advantages, mask, batch, args.conditioning)

        # 6. update (with the rollout correction, if asked), then hand the new weights to the engine
        metrics = update(policy, ref, plan, batch, advantages, mask, old_logprobs, ref_logprobs, args)
        engine.update_weights(step + 1)

        # 7. log
        metrics.update(step_metrics(batch, rewards, advantages, old_logprobs), **batch["dapo"])
        metrics.update(check.during(step + 1, stop, metrics))  # --check-freq: the engine still serves the trainer

        # 8. validate / save (and, after a stop signal, save and end the run here)
        if val and is_due(step + 1, args.trainer.test_freq, total_steps):
            metrics.update(rollout.validate())
        tracker.log(metrics, step=step + 1)
        if stop.requested() or is_due(step + 1, args.trainer.save_freq, total_steps):  # every rank stops together
            trainer_state = dict(epoch=batch["epoch"], gen_batches=gen_batches, reward_stats=state.get("reward_stats"))
            save_checkpoint(run_dir, step + 1, policy, dist, tokenizer, RECIPE, args.trainer, flags, trainer_state)
    pool.close()
    return tracker.finish(PLOTS, stopped=stop.stopping, failure=stop.failure)


if __name__ == "__main__":
    with usage_errors():  # a bad flag, path or file: one line naming it, exit status 2
        main(cli(Args, RECIPE, "grpo"))  # verl's key=value arguments work too
