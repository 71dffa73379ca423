"""ROLL's reward and advantage conditioning: what every RL recipe may do to its rewards before its own
advantage (step 3) and to the advantages after it (step 5), each knob off by default.

condition_rewards, in this order (each step only when its flag asks for it):
1. length reward (--add-len-reward): ROLL declares add_len_reward without defining it, so this is
   Kimi k1.5's (arXiv:2501.12599, section 2.3.3): within a prompt's group, with L_min and L_max its
   shortest and longest response, lambda_i = 0.5 - (L_i - L_min) / (L_max - L_min) (0 when every
   length is equal); a correct response (score > 0) gets + coef * lambda_i, a wrong one
   + coef * min(0, lambda_i).
2. ROLL's agentic reward_normalization (--reward-normalization-grouping / -method, group_normalize).
3. ROLL's reward_norm (--reward-norm batch | group | running): (r - mean) / (std + eps) with the mean
   and unbiased std of the step's rewards over every rank (batch), of the prompt's group (group), or
   of every reward seen so far, this step's included (running: RunningMoments, kept in the
   checkpoint); eps 1e-6, and for running the float32 machine epsilon, as ROLL. --reward-shift only
   subtracts the mean, --reward-scale only divides by the std. A group of one (or a batch of one)
   has mean 0 and std 1, as grpo.py's advantage treats it.
4. --reward-clip c: clamp to [-c, c] (metric reward/clip_frac), before the whitening, as ROLL clips in
   its reward post-processing and whitens later, in its advantage step.
5. --whiten-rewards: (r - mean) / sqrt(var + 1e-8) over every rank's rewards, unbiased var. ROLL
   whitens its token-level rewards, where the score sits on the last token and zeros fill the rest;
   here the rewards are one per response, so this whitens the responses' rewards.

condition_advantages (B, T), in this order:
1. --whiten-advantages: (A - mean) / sqrt(var + 1e-8) over every response token of every rank.
2. --advantage-clip c: clamp to [-c, c] (metric advantage/clip_frac over response tokens).
3. per-response loss weights w, ROLL's compute_sample_weights, multiplying the advantages (the
   policy-gradient loss is linear in them, so this weights that term alone, as ROLL does; the KL
   and entropy terms are not weighted): --difficulty-loss-weight w *= 0.5 + 1.5 * clamp(d, 0, 1),
   d the row's `difficulty` column (or extra_info.difficulty); --length-loss-weight w *= 1.5 - l,
   l = (L - L_min) / (L_max - L_min + 1e-8) the response length scaled over the step; then w is
   rescaled to mean 1. ROLL takes L_min, L_max and the mean over each micro-batch; here over the
   whole step (every rank), so splitting a batch never changes the gradient.

Both write their metrics in batch["conditioning"] (common.tracking.step_metrics logs them).

roll_terms: ROLL's loss terms (--rl-loss-coef, --sft-loss-coef, --use-topr-loss) around a recipe's
compute_loss terms. Each takes the conditioning group (common.shaping.ConditioningArgs), whose calls load this
module only when a knob of it is on.
"""

from dataclasses import dataclass

import torch
import torch.distributed as tdist

from common.ops import agg_loss, masked_whiten_all_ranks
from common.parallel import all_reduce_sum, gather_objects

EPS = 1e-6


@dataclass
class RunningMoments:
    """Count, mean and sum of squared deviations of every value seen (Chan et al.'s parallel merge, exact in
    float64; ROLL's RunningMoments keeps the same). state() is plain JSON, so a checkpoint restores it exactly."""

    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    def update(self, values: torch.Tensor) -> None:
        x = values.double().flatten()
        n = x.numel()
        if n == 0:
            return
        batch_mean = x.mean().item()
        batch_m2 = ((x - batch_mean) ** 2).sum().item()
        total = self.count + n
        delta = batch_mean - self.mean
        self.m2 += batch_m2 + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.count = total

    @property
    def std(self) -> float:
        """The unbiased standard deviation of every value seen (1 before two values)."""
        return (self.m2 / (self.count - 1)) ** 0.5 if self.count > 1 else 1.0

    def state(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    @classmethod
    def from_state(cls, state: dict | None) -> "RunningMoments":
        return cls(**(state or {}))


def length_reward(scores: torch.Tensor, lengths: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Kimi k1.5's length reward (B,): lambda = 0.5 - (L - L_min) / (L_max - L_min) within each
    group; lambda for a correct response (score > 0), min(0, lambda) for a wrong one; 0 where the
    group's lengths are all equal."""
    out = torch.zeros_like(scores, dtype=torch.float32)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        length = lengths[idx].float()
        spread = length.max() - length.min()
        if spread > 0:
            lam = 0.5 - (length - length.min()) / spread
            out[idx] = torch.where(scores[idx] > 0, lam, lam.clamp(max=0.0))
    return out


def group_normalize(scores: torch.Tensor, keys: list, method: str) -> torch.Tensor:
    """ROLL's reward normalisation (its agentic pipeline's reward_normalization.method) of scores (B,) within
    the groups that equal keys (B hashables) form, as float32 (B,):
        identity   x
        mean_std   (x - mean_g) / (std_g + 1e-6), std unbiased (n - 1); 0 for a group of one or whose std is
                   at most 1e-6 (nothing to tell apart)
        asym_clip  mean_std clamped to [-1, 3]: a bad sample is pushed down at most 1, a good one up at most 3"""
    scores = scores.float()
    if method == "identity":
        return scores
    out = torch.zeros_like(scores)
    for key in dict.fromkeys(keys):
        idx = torch.tensor([k == key for k in keys], device=scores.device)
        x = scores[idx]
        std = x.std() if x.numel() > 1 else x.new_tensor(0.0)
        if std > 1e-6:
            out[idx] = (x - x.mean()) / (std + 1e-6)
    return out.clamp(min=-1.0, max=3.0) if method == "asym_clip" else out


def normalize_rewards(rewards, batch: dict, *, grouping: str = "state", method: str = "identity"):
    """ROLL's agentic reward_normalization (group_normalize) of a step's rewards (B,),
    grouped by `grouping`: state, the samples of one prompt or environment seed (the GRPO group);
    inductive, the samples of one data_source (an environment's tag); batch, the whole step over
    every rank. identity (the default) returns the rewards themselves. Collective unless grouping
    is state or method identity."""
    if method == "identity":
        return rewards
    if grouping == "state":  # a group never spans ranks
        return group_normalize(rewards, batch["group_ids"].tolist(), method)
    keys = ["batch"] * len(rewards) if grouping == "batch" else [p["data_source"] for p, _ in batch["rows"]]
    every, every_keys, start = _gather(rewards, keys)
    return group_normalize(every, every_keys, method)[start : start + len(rewards)].to(rewards.device)


def condition_rewards(rewards: torch.Tensor, batch: dict, state: dict, c) -> torch.Tensor:
    """Step 3's conditioning of the rewards (B,) by the group c, in the module docstring's order; --reward-norm
    running keeps its moments (RunningMoments) in state["reward_stats"]. Collective when a statistic spans ranks
    (batch, running, whitening)."""
    metrics = batch.setdefault("conditioning", {})
    rewards = rewards.float()
    if c.add_len_reward:
        bonus = length_reward(rewards, batch["response_mask"].sum(-1), batch["group_ids"])
        rewards = rewards + c.len_reward_coef * bonus
        metrics["reward/len_reward_mean"] = _mean_every_rank(bonus)
    grouping, method = c.reward_normalization_grouping, c.reward_normalization_method
    rewards = normalize_rewards(rewards, batch, grouping=grouping, method=method)
    if c.reward_norm is not None:
        running = RunningMoments.from_state(state.get("reward_stats"))
        mean, std, eps = _reward_stats(rewards, batch["group_ids"], running, c.reward_norm)
        state["reward_stats"] = running.state()
        rewards = rewards - (0.0 if c.reward_scale else mean)
        rewards = rewards if c.reward_shift else rewards / (std + eps)
    if c.reward_clip is not None:
        metrics["reward/clip_frac"] = _mean_every_rank((rewards.abs() > c.reward_clip).float())
        rewards = rewards.clamp(-c.reward_clip, c.reward_clip)
    if c.whiten_rewards:
        rewards = masked_whiten_all_ranks(rewards, torch.ones_like(rewards))
    return rewards


def _reward_stats(rewards, group_ids, running: RunningMoments, mode: str):
    """(mean, std, eps) of reward_norm's mode, as tensors broadcasting against rewards (B,)."""
    if mode == "group":  # a group never spans ranks
        mean, std = torch.zeros_like(rewards), torch.ones_like(rewards)
        for g in torch.unique(group_ids):
            idx = group_ids == g
            if idx.sum() > 1:
                mean[idx], std[idx] = rewards[idx].mean(), rewards[idx].std()
        return mean, std, EPS
    every, _, _ = _gather(rewards)
    if mode == "running":
        running.update(every)
        return torch.tensor(running.mean), torch.tensor(running.std), torch.finfo(torch.float32).eps
    if every.numel() < 2:
        return torch.tensor(0.0), torch.tensor(1.0), EPS
    return every.mean(), every.std(), EPS


def condition_advantages(advantages: torch.Tensor, response_mask: torch.Tensor, batch: dict, c) -> torch.Tensor:
    """Step 5's conditioning of the advantages (B, T) by the group c, after the recipe's own, in the module
    docstring's order. Collective."""
    metrics = batch.setdefault("conditioning", {})
    if c.whiten_advantages:
        advantages = masked_whiten_all_ranks(advantages, response_mask)
    if c.advantage_clip is not None:
        outside = ((advantages.abs() > c.advantage_clip) & (response_mask > 0)).float()
        metrics["advantage/clip_frac"] = _mean_every_rank(outside[response_mask > 0])
        advantages = advantages.clamp(-c.advantage_clip, c.advantage_clip)
    if c.difficulty_loss_weight or c.length_loss_weight:
        weights = torch.ones(len(advantages))
        if c.difficulty_loss_weight:
            difficulty = torch.tensor([float(row["difficulty"]) for row, _ in batch["rows"]])
            weights = weights * (0.5 + 1.5 * difficulty.clamp(0.0, 1.0))
        if c.length_loss_weight:
            lengths, _, start = _gather(response_mask.sum(-1))
            scaled = (lengths - lengths.min()) / (lengths.max() - lengths.min() + 1e-8)
            weights = weights * (1.5 - scaled[start : start + len(advantages)])
        every, _, start = _gather(weights)
        every = every * every.numel() / (every.sum() + 1e-8) if every.sum() > 0 else every
        weights = every[start : start + len(advantages)]
        metrics.update(
            {
                "advantage/weight_mean": every.mean().item(),
                "advantage/weight_min": every.min().item(),
                "advantage/weight_max": every.max().item(),
            }
        )
        advantages = advantages * weights.to(advantages.device, advantages.dtype).unsqueeze(-1)
    return advantages


def this_rank() -> int:
    return tdist.get_rank() if tdist.is_available() and tdist.is_initialized() else 0


def _gather(values: torch.Tensor, keys: list | None = None) -> tuple[torch.Tensor, list, int]:
    """(every rank's values in rank order, their keys, where this rank's values start). Collective."""
    parts = gather_objects((values.tolist(), keys or []))
    start = sum(len(part) for part, _ in parts[: this_rank()])
    every = torch.tensor([v for part, _ in parts for v in part], dtype=torch.float32)
    return every, [k for _, ks in parts for k in ks], start


def _mean_every_rank(values: torch.Tensor) -> float:
    """The mean of every rank's values (0 for none). Collective."""
    total, count = all_reduce_sum(
        torch.stack([values.float().sum(), values.new_tensor(float(values.numel()), dtype=torch.float32)])
    ).tolist()
    return total / count if count else 0.0


def topr_loss(new_logprobs, old_logprobs, advantages, positive) -> torch.Tensor:
    """TOPR's per-token loss (Tapered Off-Policy REINFORCE, Le Roux et al. 2025, arXiv:2503.14286),
    in ROLL's token-level form. The paper's gradient over sequences y sampled from mu:
        sum_{R(y) >= 0} R(y) grad log pi(y)  +  sum_{R(y) < 0} [pi(y) / mu(y)]_0^1 R(y) grad log pi(y)
    Here, per token, with the recipe's advantage A_t for R and positive (B, 1) the responses that
    scored > 0: loss_t = -A_t * w_t * log pi_t, w_t = 1 on a positive response and
    clamp(exp(log pi_t - old_t), 0, 1) (detached) on the others: a positive sample is pushed up as
    in plain REINFORCE, a negative one pushed down only as far as the policy still agrees with the
    one that sampled it."""
    ratio = torch.exp(torch.clamp(new_logprobs.detach() - old_logprobs, -20.0, 20.0)).clamp(max=1.0)
    weight = torch.where(positive > 0, torch.ones_like(ratio), ratio)
    return -advantages * weight * new_logprobs


def roll_terms(
    terms: dict, metrics: dict, new_logprobs, old_logprobs, advantages, response_mask, agg: dict, rewards, c
):
    """ROLL's loss terms (the group c's) around a recipe's compute_loss terms {pg, entropy, kl} (each already
    aggregated by agg, common.ops.agg_loss's mode and counts), as ROLL's actor composes them; their sum is
        loss = rl_loss_coef * (pg + kl) + entropy + sft_loss_coef * agg(-new on the responses that scored > 0)
    --use-topr-loss puts TOPR's per-token loss (topr_loss) in place of pg; rewards (b,) tell the responses that
    scored > 0 (TOPR's positive samples, the SFT term's). Updates metrics (policy/pg_loss, policy/sft_loss) in
    place; returns the terms."""
    positive = (rewards > 0).float().unsqueeze(-1)
    if c.use_topr_loss:
        terms["pg"] = agg_loss(topr_loss(new_logprobs, old_logprobs, advantages, positive), response_mask, **agg)
    terms = {k: c.rl_loss_coef * v if k in ("pg", "kl") else v for k, v in terms.items()}
    metrics["policy/pg_loss"] = terms["pg"].detach()
    if c.sft_loss_coef:
        sft = agg_loss(-new_logprobs, response_mask * positive, **agg)
        terms["sft"] = c.sft_loss_coef * sft
        metrics["policy/sft_loss"] = sft.detach()
    return terms
