"""PPO: proximal policy optimisation with a learned critic (Schulman et al. 2017, arXiv:1707.06347;
for language models Ziegler et al. 2019), as verl's main_ppo.

A critic (the base model with a scalar value head) predicts each response token's return; GAE turns
rewards and values into advantages; the policy climbs the clipped surrogate while the critic
regresses onto the returns. How this file departs from the paper (and matches verl's defaults):
1. Outcome score on the last response token, and by default a per-token KL penalty in the reward:
   r_t = score * [t last] - kl_coef * KL_t(old || ref), --kl-ctrl fixed or adaptive; --no-use-kl-in-reward
   --use-kl-loss puts it in the loss instead (grpo.py's compute_loss, word for word), never both.
2. GAE (gamma, lam) over response tokens, whitened over the valid tokens of the global batch (all
   ranks, as verl's driver); returns = raw advantages + values. On the bundled task verl's gamma = lam
   = 1 and lam 0.95 learn alike (20 steps: 48.8% -> 64.8% and 64.4%), with grpo.py's shapes (16
   prompts x 16 samples; verl's PPO habit is rollout_n 1) and a critic lr 5x the policy's.
3. Critic: AutoModelForTokenClassification, num_labels=1, from --critic-model (default: the policy's
   folder, so the value head starts freshly initialised), its own AdamW at --critic-lr, the same
   micro-batches and shared-prompt forward; value loss clipped at --cliprange-value around the
   rollout's values. It trains every step; the policy after --critic-warmup steps (its lr schedule
   spans its own updates).
4. Losses are aggregated by --loss-agg-mode with the token / sequence count of the whole mini-batch
   (all micro-batches, all ranks), so splitting a batch never changes the gradient.
5. Old logprobs (for the KL in the reward) and values come from no-grad passes before the update.
   Rollout correction (verl's algorithm.rollout_correction, off by default): the engine that
   sampled (pi_rollout: vLLM's or a remote engine's own copy, other kernels; with --max-staleness k,
   weights up to k steps older) is not exactly pi_old. --rollout-is token
   scales each token's advantage by w_t = min(exp(old_t - rollout_t), --rollout-is-threshold),
   sequence by min(exp(sum_t (old_t - rollout_t)), threshold) on all its tokens (log ratios
   clamped to +-20); w is detached and positive, so this weights each token's loss as verl does.
   --rollout-is-threshold lo_hi zeroes the weights outside [lo, hi] instead (IcePop), and
   --rollout-rs drops the tokens or responses whose gap leaves its band from the loss.
   --bypass-mode takes the engine's logprobs as the old ones: ratio pi / pi_rollout, no old pass.

Run (the tests run the same commands, shortened):
    python recipes/ppo.py                     # bundled SFT checkpoint + addition task, CPU
    torchrun --nproc_per_node 2 recipes/ppo.py --strategy fsdp2
    accelerate launch --config_file configs/fsdp2.yaml recipes/ppo.py --model Qwen/Qwen2.5-0.5B-Instruct \
        --train-files ~/data/gsm8k/train.parquet --val-files ~/data/gsm8k/test.parquet --lr 1e-6 --critic-lr 1e-5
"""

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from common.check import launch_check, prove_resume
from common.checkpoint import find_resume, resume, save_checkpoint
from common.config import RLArgs, cli, engine_sync, is_due, plan_rl_batches
from common.critic import load_critic, response_values
from common.data import StepPrompts, split_rows, take_rows
from common.errors import UsageError, usage_errors
from common.flags import flag, flag_values
from common.kl_reward import KLRewardArgs, kl_controller_step
from common.model import load_tokenizer, response_logprobs
from common.ops import (
    KLEstimator,
    agg_loss,
    kl_penalty,
    masked_mean,
    masked_var,
    masked_whiten,
)
from common.optim import trainable
from common.parallel import StopSignal, all_reduce_sum, clip_grad_norm, gather_objects, grad_sync, init_distributed
from common.rewards import start_reward_pool
from common.rollout import Rollout, load_reward_model, load_rl_data, load_rl_models, start_engine, with_agents
from common.runlock import claim_run_dir
from common.shaping import condition_advantages, condition_rewards, roll_terms, rollout_correction
from common.tracking import Tracker, describe_run, step_metrics

RECIPE = Path(__file__).stem  # names the run and owns its checkpoints: a copy of this file is its own experiment
PLOTS = (
    "val/accuracy",
    "reward/mean",
    "response/length_mean",
    "policy/*",
    "critic/*",
    "train/grad_norm",
)  # panels of curves.png
CHANGED = {  # grpo.py's functions this file changes, with why (tests/test_rl_recipes.py holds the rest to grpo.py's)
    "old_ref_logprobs": "the reference's logprobs (or the exact KL) for the KL penalty in the reward; the critic's values",
    "main": "a critic: GAE advantages, its own update, a warmup, saved with the policy",
}


# --- config ---------------------------------------------------------------------------------------
@dataclass
class Args(KLRewardArgs, RLArgs):  # the flag groups come from RLArgs, the KL controller's knobs from KLRewardArgs
    gamma: float = flag(1.0, ge=0, le=1)
    """GAE discount over response tokens"""
    lam: float = flag(1.0, ge=0, le=1)
    """GAE lambda: 1 uses the whole observed return (verl's default), lower leans on the critic's values"""
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
    use_kl_in_reward: bool = True  # PPO: verl's KL penalty in the reward, per token
    """subtract kl_coef * KL(old policy || reference) from each token's reward"""
    entropy_coeff: float = flag(0.0, ge=0, note="a negative bonus would reward collapsing the entropy")
    """entropy bonus weight"""
    critic_model: str | None = None
    """critic: a local Hugging Face folder or a hub name (default: the policy's; its value head starts fresh)"""
    critic_lr: float = flag(1e-3, gt=0)
    """peak learning rate of the critic (AdamW; the schedule and other optimizer flags are the policy's, where verl's
    critic has its own)"""
    cliprange_value: float = flag(0.5, gt=0)
    """value clip: a new value may move at most this far from the rollout's value (verl: 0.5)"""
    critic_warmup: int = flag(0, ge=0, note="steps that train the critic alone")
    """train only the critic for the first N steps (the policy stays unchanged), as ROLL's critic_warmup; verl's
    trainer.critic_warmup=N is N - 1 here (verl's actor first updates at its step N, counting from 1)"""

    def __post_init__(self):  # checked as the flags are parsed, before anything loads
        super().__post_init__()  # the shared flags (common.config.check_flags)
        if self.use_kl_in_reward and self.use_kl_loss:  # PPO: the KL goes in one place
            raise UsageError(
                "--use-kl-loss with the KL already in the reward (the default here): put the KL in one place, "
                "--no-use-kl-in-reward --use-kl-loss for the loss, or drop --use-kl-loss"
            )


# --- the algorithm ------------------------------------------------------------------------------------
def compute_gae(token_rewards, values, response_mask, gamma, lam):
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438), backward over tokens:
        delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next
    where V_next / A_next belong to the next valid token (0 after the last): a padding position passes
    the running values through unchanged (as verl). returns = A + V, the critic's targets; advantages
    are A whitened over the valid tokens of the batch (common.ops.masked_whiten: mean 0, unbiased
    variance 1). All (B, T); both outputs zero on padding.
    """
    mask = response_mask.to(values.dtype)
    next_value, next_adv = torch.zeros_like(values[:, 0]), torch.zeros_like(values[:, 0])
    reversed_adv = []
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_value = values[:, t] * mask[:, t] + next_value * (1 - mask[:, t])
        next_adv = adv * mask[:, t] + next_adv * (1 - mask[:, t])
        reversed_adv.append(next_adv)
    raw = torch.stack(reversed_adv[::-1], dim=1)
    returns = (raw + values) * mask
    return masked_whiten(raw, mask) * mask, returns


def apply_kl_penalty(scores, old_logprobs, ref_logprobs, full_kl, mask, state, args):
    """Token rewards (verl's PPO): the outcome score on each response's last valid token, and with the
    KL in the reward (--use-kl-in-reward) - kl_coef * KL_t(old || ref) on every token. scores (B,), the rest
    (B, T). Returns (token_rewards (B, T), metrics); state["kl_coef"] (from --kl-coef) steps by verl's kl_ctrl
    (--kl-ctrl, --target-kl, --horizon) from the all-rank mean of sequence KLs. --kl-penalty full takes full_kl,
    step 4's exact KL over the vocabulary, in place of an estimate."""
    kl_coef = state.setdefault("kl_coef", args.kl_coef)
    # The last sampled token, not the mask's length: a multi-turn mask has holes (tool tokens).
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) * mask  # (B, T)
    token_rewards = scores.float().unsqueeze(-1) * last
    if not args.use_kl_in_reward:
        return token_rewards, {}
    estimator = args.kl_penalty
    kl = (full_kl if estimator == "full" else kl_penalty(old_logprobs, ref_logprobs, estimator)) * mask
    state["kl_coef"], metrics = kl_controller_step(kl_coef, kl, mask, args)  # --kl-ctrl, --target-kl, --horizon
    return token_rewards - kl_coef * kl, metrics


def compute_value_loss(
    new_values,
    old_values,
    returns,
    response_mask,
    cliprange_value,
    loss_agg_mode,
    *,
    num_tokens=None,
    num_seqs=None,
    norm_constant=None,
):
    """Clipped value loss (PPO2 baselines, verl): the new value counts as at most cliprange_value away
    from the rollout's value, and the larger squared error of the two is kept:
        loss = 0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2))
    All tensors (B, T); agg by loss_agg_mode over num_tokens / num_seqs (see common.ops.agg_loss).
    Returns (loss, clipfrac: the fraction of valid tokens where the clipped error is the larger)."""
    clipped = torch.clamp(new_values, old_values - cliprange_value, old_values + cliprange_value)
    loss_unclipped = (new_values - returns).square()
    loss_clipped = (clipped - returns).square()
    agg = dict(mode=loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_constant=norm_constant)
    loss = 0.5 * agg_loss(torch.maximum(loss_unclipped, loss_clipped), response_mask, **agg)
    return loss, masked_mean((loss_clipped > loss_unclipped).float(), response_mask)


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


def forward_values(critic, batch, rows, plan):
    """The critic's values of the response tokens of batch[rows], (b, T), zero on padding: its output
    at the position that predicts token t, where the policy's logits for token t come from."""
    mb = take_rows(batch, rows)  # padding columns trimmed; widened back to T below
    values = response_values(critic, mb, share_prompts=plan.share_prompts).float() * mb["response_mask"]
    return F.pad(values, (0, batch["responses"].shape[1] - values.shape[1]))


@torch.no_grad()
def old_ref_logprobs(model, ref, critic, batch, plan, source, args):
    """Step 4, in micro-batches. Old logprobs (source: common.config.Sync.old_logprobs) from a pass when
    they are needed before the update or set against the engine's ("pass"), or when the policy
    moves before a sample is used (several mini-batches or epochs); otherwise the update pass's
    detached logprobs are exact. "engine" (--bypass-mode) takes the engine's logprobs as the old
    ones, with no pass. Reference logprobs when a KL term estimates from them (--use-kl-loss but for
    --kl-loss-type full, --use-kl-in-reward but for --kl-penalty full; under LoRA the reference is the
    policy with its adapter off: common.model.AdapterOff). --use-kl-in-reward --kl-penalty full: the
    exact KL(policy || ref) at each token, from a pass of both. PPO: the critic's values at rollout
    (old_values). (B, T) each."""
    t, old_logprobs, ref_logprobs, full_kl = time.time(), None, None, None
    in_loss = args.use_kl_loss and args.kl_loss_type != "full"  # a KL in the loss or in the reward
    with_ref = in_loss or args.use_kl_in_reward and args.kl_penalty != "full"
    with_full_kl = args.use_kl_in_reward and args.kl_penalty == "full"
    micro = split_rows(batch, **plan.micro)
    order = torch.cat(micro).argsort()  # micro-batches may be length-sorted: back to row order
    if source == "engine":  # the engine's logprobs are the old policy: no pass
        old_logprobs = batch["rollout_logprobs"]
    elif source == "pass" or plan.mini_batches_per_step > 1 or plan.epochs > 1:
        old_logprobs = torch.cat([forward_logprobs(model, batch, rows, plan)[0] for rows in micro])[order]
    if with_ref:
        ref_logprobs = torch.cat([forward_logprobs(ref, batch, rows, plan)[0] for rows in micro])[order]
    if with_full_kl:
        full_kl = torch.cat([forward_logprobs(model, batch, rows, plan, kl_ref=ref)[2] for rows in micro])[order]
    batch["timing"]["perf/logprobs_s"] = time.time() - t
    return old_logprobs, ref_logprobs, full_kl, old_values(critic, batch, plan)


@torch.no_grad()
def old_values(critic, batch, plan):
    """Step 4 for the critic: its values at rollout, in micro-batches, (B, T)."""
    t = time.time()
    micro = split_rows(batch, **plan.micro)
    values = torch.cat([forward_values(critic, batch, rows, plan) for rows in micro])[torch.cat(micro).argsort()]
    batch["timing"]["perf/values_s"] = time.time() - t
    return values


def gae_over_batch(token_rewards, values, mask, gamma, lam, dist):
    """Step 5: compute_gae over every rank's rows at once (the whitening spans the global batch, as
    verl's driver does; one process or many give the same numbers), then this rank's rows. Also the
    critic's explained variance, 1 - var(R - V) / var(R) over valid tokens (+1e-5 as verl)."""
    parts = gather_objects([x.cpu() for x in (token_rewards, values, mask)])
    width = max(p[0].shape[1] for p in parts)
    r, v, m = (torch.cat([F.pad(p[i], (0, width - p[i].shape[1])) for p in parts]).to(values.device) for i in range(3))
    advantages, returns = compute_gae(r, v, m, gamma, lam)
    metrics = {
        "critic/vf_explained_var": (1 - masked_var(returns - v, m) / (masked_var(returns, m) + 1e-5)).item(),
        "critic/values_mean": masked_mean(v, m).item(),
        "critic/returns_mean": masked_mean(returns, m).item(),
    }
    mine = slice(dist.rank * len(values), (dist.rank + 1) * len(values))
    return advantages[mine, : values.shape[1]], returns[mine, : values.shape[1]], metrics


def update_critic(critic, plan, batch, values, returns, loss_mask, args):
    """Step 6 for the critic (model, optimizer, scheduler): the clipped value loss (--cliprange-value, aggregated
    as the policy's: --loss-agg-mode) over the policy's epochs x mini-batches x micro-batches, one optimizer step
    per mini-batch, clipped at --grad-clip; then one lr-schedule step."""
    model, optimizer, scheduler = critic
    agg = dict(loss_agg_mode=args.loss_agg_mode, norm_constant=args.rollout.max_response_length)
    t, stats, grad_norms, loss_sum = time.time(), [], [], 0.0
    for _ in range(plan.epochs):
        for mini in plan.mini_batches(batch["group_ids"]):  # this rank's rows of each (--shuffle-mini-batches)
            # Normalise by the whole mini-batch (every micro-batch, every rank), as the policy loss.
            num_tokens = all_reduce_sum(loss_mask[mini].sum())
            num_seqs = all_reduce_sum((loss_mask[mini].sum(-1) > 0).sum().float())
            micro = split_rows(batch, mini, **plan.micro)
            for k, rows in enumerate(micro):
                with grad_sync(model, enabled=k == len(micro) - 1):
                    loss, clipfrac = compute_value_loss(
                        forward_values(model, batch, rows, plan),
                        values[rows],
                        returns[rows],
                        loss_mask[rows],
                        args.cliprange_value,
                        num_tokens=num_tokens,
                        num_seqs=num_seqs,
                        **agg,
                    )
                    (loss * plan.world_size).backward()
                stats.append((batch["response_mask"][rows].sum().item(), float(clipfrac)))
                loss_sum += loss.item()
            grad_norms.append(clip_grad_norm(model, args.optim.grad_clip))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    batch["timing"]["perf/update_critic_s"] = time.time() - t
    return {
        "critic/vf_loss": all_reduce_sum(torch.tensor(loss_sum)).item() / len(grad_norms),
        "critic/vf_clipfrac": sum(w * c for w, c in stats) / (sum(w for w, _ in stats) or 1.0),
        "critic/grad_norm": sum(grad_norms) / len(grad_norms),
    }


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

    # Data, the run to resume and rewards (a reward dry run), then the models, engine and optimizers.
    tokenizer = load_tokenizer(args.model.tokenizer or args.model.path, args.model.trust_remote_code)
    train, stats, val = load_rl_data(args.data, tokenizer, args.reward, args.agent, args.env, args.conditioning)
    total_steps = args.trainer.total_steps(len(train) // args.data.train_batch_size)
    checkpoint = find_resume(args.trainer.resume, run_dir, RECIPE, total_steps, flags)
    pool = start_reward_pool(args.reward, args.agent, args.env, args.data, run_dir, tokenizer, train + val)
    resumed = prove_resume(args.trainer.check, dist)  # --check full: save, resume, a step, in child runs
    model, ref, run_info = load_rl_models(args.model, dist, with_reference=args.use_kl_loss or args.use_kl_in_reward)
    reward_model = load_reward_model(args.reward, args.model, tokenizer, dist, args.actor.micro_batch_size_per_gpu)
    policy = trainable(model, args.optim, max(1, total_steps - args.critic_warmup))  # PPO: schedule after warmup
    critic_optim = replace(args.optim, lr=args.critic_lr)  # PPO: the policy's AdamW and schedule at --critic-lr
    critic = trainable(load_critic(args.model, dist, args.critic_model), critic_optim, total_steps)  # PPO
    state = resume(checkpoint, policy, dist=dist, extra_models={"critic": critic})
    prompts = StepPrompts(train, args.data, args.trainer.seed, total_steps)  # each step's rows, in a seeded order
    engine = start_engine(model, tokenizer, dist, state["step"], args.model, args.rollout, args.placement, prompts)
    engine = with_agents(engine, tokenizer, pool, args.agent, args.env, prompts.max_length)  # tools, environments
    rollout = Rollout(prompts, val, engine, pool, tokenizer, dist, args.rollout.sampling, args.validation, reward_model)
    tracker = Tracker(run_dir, state["step"], total_steps, dist.is_main, args.trainer, RECIPE, flags, run_info, plan)
    tracker.write(describe_run(stats.summary("train"), total_steps, checkpoint, args.model.path, run_info, plan))
    sync = engine_sync(args.model, args.rollout, args.placement, args.correction, args.use_kl_in_reward)
    check = launch_check(args.trainer.check, model, engine, rollout, tracker, resumed, sync)
    if state["step"] == 0 and val and args.trainer.val_before_train:
        tracker.log(rollout.validate(), step=0)
    stop = StopSignal(dist)  # SIGUSR1 / SIGTERM (Slurm, before the time limit): save after this step, exit 0
    for step in stop.steps(state["step"], total_steps):  # to the end, or the step a stop signal came in
        # 1-3. sample prompts (this rank's share), generate rollout_n responses each, score them
        batch = rollout.step(step)
        rewards, mask = batch["rewards"], batch["response_mask"].float()  # (B,), (B, T)
        rewards = condition_rewards(rewards, batch, state, args.conditioning)  # ROLL's knobs (off by default)

        # 4. old / ref logprobs, and the critic's values
        logprobs = old_ref_logprobs(model, ref, critic.model, batch, plan, sync.old_logprobs, args)
        old_logprobs, ref_logprobs, full_kl, values = logprobs

        # 5. advantages: token rewards (score minus the KL penalty), GAE over the global batch, ROLL's conditioning
        token_rewards, kl_metrics = apply_kl_penalty(rewards, old_logprobs, ref_logprobs, full_kl, mask, state, args)
        advantages, returns, metrics = gae_over_batch(token_rewards, values, mask, args.gamma, args.lam, dist)
        advantages = condition_advantages(advantages, mask, batch, args.conditioning)

        # 6. update the critic; the policy after the critic warmup, then hand its weights to the engine
        metrics |= update_critic(critic, plan, batch, values, returns, mask, args)
        if step >= args.critic_warmup:  # PPO: the critic trains alone first
            metrics |= update(policy, ref, plan, batch, advantages, mask, old_logprobs, ref_logprobs, args)
            engine.update_weights(step + 1)

        # 7. log (and --check-freq: the engine still serves the trainer's weights)
        metrics |= kl_metrics | step_metrics(batch, rewards, advantages, old_logprobs)
        metrics |= check.during(step + 1, stop, metrics)

        # 8. validate / save (and, after a stop signal, save and end the run here)
        if val and is_due(step + 1, args.trainer.test_freq, total_steps):
            metrics.update(rollout.validate())
        tracker.log(metrics, step=step + 1)
        if stop.requested() or is_due(step + 1, args.trainer.save_freq, total_steps):  # every rank stops together
            trainer_state = dict(epoch=batch["epoch"], kl_coef=state["kl_coef"], reward_stats=state.get("reward_stats"))
            models = {"critic": critic}  # PPO: the critic is saved with the policy
            save_checkpoint(
                run_dir, step + 1, policy, dist, tokenizer, RECIPE, args.trainer, flags, trainer_state, models
            )
    pool.close()
    return tracker.finish(PLOTS, stopped=stop.stopping, failure=stop.failure)


if __name__ == "__main__":
    with usage_errors():  # a bad flag, path or file: one line naming it, exit status 2
        main(cli(Args, RECIPE, "gae"))  # verl's key=value arguments work too
