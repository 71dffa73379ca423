"""What may reshape an RL recipe's learning signal beyond its own advantage and loss, a feature, every knob off by
default: verl's rollout correction (correction), ROLL's reward, advantage and loss conditioning (conditioning) and a
reward model's scores (reward_model). This file holds the first two's flag groups, which every run parses, and the
four calls a recipe makes at its steps (steps 3, 5 and 6, and its loss); each returns its input with its knobs off
and loads its module only when one is on."""

from dataclasses import dataclass, fields
from typing import Literal

import torch

from common.errors import UsageError
from common.flags import band_ok, flag

BAND_RULE = "a cap >= 1, or lo_hi with 0 < lo <= 1 <= hi (else even an on-policy token's weight of 1 is cut)"
# When the run reads a flag (common.flags.flag's only_with), for flags that share it
BYPASS = (lambda a: not a.bypass_mode, "drop --bypass-mode (the old policy is then the engine's: no gap to mask)")
CORRECTING = (lambda a: a.rollout_is is not None, "add --rollout-is token|sequence")
NORMALISING = (
    lambda a: a.reward_normalization_method != "identity",
    "add --reward-normalization-method mean_std or asym_clip",
)
REWARD_NORM = (lambda a: a.reward_norm is not None, "add --reward-norm batch, group or running")


@dataclass
class CorrectionArgs:
    """verl's algorithm.rollout_correction: the engine that sampled is not exactly the old policy (common.shaping
    .correction)."""

    rollout_is: Literal["token", "sequence"] | None = None
    """rollout correction: weight each token by the truncated pi_old / pi_rollout, per token or per response"""
    rollout_is_threshold: float | str = flag(2.0, rule=(band_ok, BAND_RULE), only_with=CORRECTING)
    """rollout correction: the cap on those importance weights, or lo_hi (e.g. 0.5_5.0): weights outside are zeroed"""
    rollout_is_batch_normalize: bool = flag(False, only_with=CORRECTING)
    """rollout correction: rescale the importance weights to mean 1 over the step"""
    rollout_rs: str | None = None
    """rollout rejection: drop tokens / responses whose trainer-engine gap leaves the band, e.g. token_k1,seq_mean_k3"""
    rollout_rs_threshold: str | None = flag(None, only_with=(lambda a: a.rollout_rs is not None, "add --rollout-rs"))
    """rollout rejection's bounds, one or one per option: lo_hi for k1 (e.g. 0.5_2.0), an upper bound for k2 / k3"""
    off_policy_mask_threshold: float | None = flag(None, gt=0, only_with=BYPASS)
    """off-policy sequence mask (DeepSeek-V3.2; TRL's): a negative-advantage token of a response whose mean
    log(pi_rollout / pi_old) is above this gets no gradient (e.g. 0.5; off: None)"""
    bypass_mode: bool = False
    """take the engine's logprobs as the old policy (saves the trainer's old-logprob pass)"""

    def __post_init__(self):
        if self.bypass_mode and self.rollout_is:
            raise UsageError(
                f"--bypass-mode with --rollout-is {self.rollout_is}: in bypass mode the engine's logprobs are the old "
                f"policy, so pi_old / pi_rollout is 1 and the weights change nothing (the PPO ratio pi / pi_rollout "
                f"does the correcting); drop one of the two flags"
            )

    @property
    def on(self) -> bool:
        """Whether anything weighs or masks the loss by the trainer-engine gap."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.off_policy_mask_threshold is not None


@dataclass
class ConditioningArgs:
    """ROLL's reward and advantage conditioning and loss terms (common.shaping.conditioning), all off by default."""

    reward_normalization_grouping: Literal["state", "batch", "inductive"] = flag("state", only_with=NORMALISING)
    """ROLL's reward_normalization.grouping: normalise per prompt (seed) group, per step, or per data_source (tag)"""
    reward_normalization_method: Literal["identity", "mean_std", "asym_clip"] = "identity"
    """ROLL's reward_normalization.method: identity (off), mean_std, or mean_std clipped to [-1, 3]"""
    add_len_reward: bool = False
    """ROLL's add_len_reward, as Kimi k1.5 defines it: within a group, shorter correct responses gain up to +0.5 and
    longer ones lose up to -0.5 (wrong ones only lose), times --len-reward-coef"""
    len_reward_coef: float = flag(1.0, gt=0, only_with="add_len_reward")
    """weight of the length reward"""
    reward_norm: Literal["batch", "group", "running"] | None = None
    """ROLL's reward_norm: (r - mean) / std over the step (every rank), the prompt's group, or every reward so far"""
    reward_shift: bool = flag(False, only_with=REWARD_NORM)
    """with --reward-norm: only subtract the mean"""
    reward_scale: bool = flag(False, only_with=REWARD_NORM)
    """with --reward-norm: only divide by the std"""
    whiten_rewards: bool = False
    """whiten the step's rewards (every rank) before the advantage"""
    reward_clip: float | None = flag(None, gt=0, note="rewards are clamped to [-c, c]")
    """clamp the conditioned rewards to [-c, c]"""
    whiten_advantages: bool = False
    """whiten the advantages over every response token of the step"""
    advantage_clip: float | None = flag(None, gt=0, note="advantages are clamped to [-c, c]")
    """clamp the advantages to [-c, c] (after any whitening)"""
    difficulty_loss_weight: bool = False
    """weight each response's policy-gradient loss by 0.5 + 1.5 * its row's difficulty (a column in [0, 1])"""
    length_loss_weight: bool = False
    """weight each response's policy-gradient loss by 1.5 - its length scaled to [0, 1] over the step"""
    rl_loss_coef: float = flag(1.0, ge=0)
    """ROLL's rl_loss_coef: weight of the policy-gradient term (and of the KL loss with it)"""
    sft_loss_coef: float = flag(0.0, ge=0, note="a negative weight would push the good responses down")
    """ROLL's sft_loss_coef: add this times the negative log-likelihood of the responses that scored > 0"""
    use_topr_loss: bool = False
    """ROLL's use_topr_loss: TOPR's truncated-importance REINFORCE instead of the clipped surrogate"""

    def __post_init__(self):
        if self.rl_loss_coef == 0 and self.sft_loss_coef == 0:
            raise UsageError("--rl-loss-coef 0 with --sft-loss-coef 0: the loss would have no term left to learn from")
        if self.reward_shift and self.reward_scale:
            raise UsageError(
                "--reward-shift with --reward-scale: shift only subtracts the mean and scale only divides by the "
                "std; for both, drop the two flags (--reward-norm alone does both)"
            )

    def changed(self, *names: str) -> bool:
        """Whether any of these knobs is off its default."""
        defaults = {f.name: f.default for f in fields(self)}
        return any(getattr(self, n) != defaults[n] for n in names)


REWARD_KNOBS = ("reward_normalization_grouping", "reward_normalization_method", "add_len_reward", "len_reward_coef")
REWARD_KNOBS += ("reward_norm", "reward_shift", "reward_scale", "whiten_rewards", "reward_clip")
ADVANTAGE_KNOBS = ("whiten_advantages", "advantage_clip", "difficulty_loss_weight", "length_loss_weight")
LOSS_KNOBS = ("rl_loss_coef", "sft_loss_coef", "use_topr_loss")


def condition_rewards(rewards: torch.Tensor, batch: dict, state: dict, conditioning: ConditioningArgs):
    """Step 3's conditioning of the rewards (B,), as float32; --reward-norm running keeps its moments in `state`,
    the checkpointed trainer state."""
    if not conditioning.changed(*REWARD_KNOBS):
        return rewards.float()
    from common.shaping.conditioning import condition_rewards as condition

    return condition(rewards, batch, state, conditioning)


def condition_advantages(advantages: torch.Tensor, response_mask, batch: dict, conditioning: ConditioningArgs):
    """Step 5's conditioning of the advantages (B, T), after the recipe's own."""
    if not conditioning.changed(*ADVANTAGE_KNOBS):
        return advantages
    from common.shaping.conditioning import condition_advantages as condition

    return condition(advantages, response_mask, batch, conditioning)


def roll_terms(terms: dict, metrics: dict, new_logprobs, old_logprobs, advantages, mask, agg, rewards, conditioning):
    """A recipe's compute_loss terms reweighed and extended by the conditioning group's ROLL loss terms
    (common.shaping.conditioning.roll_terms); the terms themselves when --rl-loss-coef, --sft-loss-coef and
    --use-topr-loss are at their defaults."""
    if not conditioning.changed(*LOSS_KNOBS):
        return terms
    from common.shaping.conditioning import roll_terms as reweigh

    return reweigh(terms, metrics, new_logprobs, old_logprobs, advantages, mask, agg, rewards, conditioning)


def rollout_correction(old_logprobs, rollout_logprobs, response_mask: torch.Tensor, advantages, correction):
    """(weights, loss mask, metrics) of the correction group (common.shaping.correction.correct): the importance
    weights (1 without --rollout-is, 0 where the off-policy mask drops a token), the response mask less what
    --rollout-rs rejects, and rollout_corr/* metrics. Off (the default): ones, the mask, no metrics."""
    if not correction.on:
        return response_mask.to(torch.float32), response_mask, {}
    from common.shaping.correction import correct

    return correct(old_logprobs, rollout_logprobs, response_mask, advantages, correction)
