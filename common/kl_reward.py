"""The KL penalty in the reward of rloo.py, reinforce_pp.py and ppo.py: verl's algorithm.kl_ctrl knobs
(KLRewardArgs, a part of those recipes' own Args) and the controller that steps the coefficient after each step.
Where the KL goes (--use-kl-in-reward) stays each recipe's own; the recipes that never put it in the reward never
load this."""

from dataclasses import dataclass
from typing import Literal

import torch

from common.flags import flag
from common.ops import KLEstimator, masked_mean
from common.parallel import all_reduce_sum


def update_kl_coef(coef: float, kl: float, *, kind: str, target_kl: float, horizon: int, n_steps: int) -> float:
    """verl's kl_ctrl for a KL penalty in the reward, after each step. fixed: coef; adaptive (Ziegler et al. 2019,
    arXiv:1909.08593): coef * (1 + clip(kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon), n_steps: sequences."""
    if kind == "fixed":
        return coef
    if kind != "adaptive":
        raise ValueError(f"kl_ctrl {kind!r}; use fixed or adaptive")
    error = min(max(kl / target_kl - 1, -0.2), 0.2)
    return coef * (1 + error * n_steps / horizon)


def kl_controller_step(coef: float, kl: torch.Tensor, response_mask: torch.Tensor, knobs) -> tuple[float, dict]:
    """update_kl_coef after a step by the knobs' --kl-ctrl, --target-kl and --horizon (KLRewardArgs), kl the mean
    over every rank's sequences of their mean token KL (kl, response_mask: (B, T)) and n_steps those sequences.
    Collective. Returns (next coef, metrics: this step's coefficient and KL)."""
    seq_kl = masked_mean(kl, response_mask, dim=-1)  # (B,)
    total, n_seqs = all_reduce_sum(torch.stack([seq_kl.sum(), seq_kl.new_tensor(len(seq_kl))])).tolist()
    mean_kl = total / max(n_seqs, 1)
    ctrl = dict(kind=knobs.kl_ctrl, target_kl=knobs.target_kl, horizon=knobs.horizon)
    next_coef = update_kl_coef(coef, mean_kl, **ctrl, n_steps=int(n_seqs))
    return next_coef, {"policy/kl_coef": coef, "reward/kl_penalty": mean_kl}


ADAPTIVE = (lambda a: a.kl_ctrl == "adaptive", "add --kl-ctrl adaptive")  # when target_kl and horizon are read


@dataclass
class KLRewardArgs:
    """verl's algorithm.kl_ctrl knobs, for the recipes that can put a KL penalty in the reward
    (rloo, reinforce_pp, ppo); where the KL goes (--use-kl-in-reward) stays each recipe's own."""

    kl_coef: float = flag(0.001, ge=0, only_with="use_kl_in_reward")
    """weight of the KL penalty in the reward (the adaptive controller's starting value)"""
    kl_penalty: KLEstimator = flag("kl", only_with="use_kl_in_reward")
    """KL estimator for the reward penalty (see common.ops.kl_penalty; full: the exact KL over the vocabulary)"""
    kl_ctrl: Literal["fixed", "adaptive"] = flag("fixed", only_with="use_kl_in_reward")
    """KL-in-reward coefficient: fixed, or adaptive toward target_kl (Ziegler et al. 2019, as verl)"""
    target_kl: float = flag(0.1, gt=0, only_with=ADAPTIVE)
    """adaptive kl_ctrl: the mean per-token KL the coefficient steers toward"""
    horizon: int = flag(10000, ge=1, only_with=ADAPTIVE)
    """adaptive kl_ctrl: sequences over which the coefficient moves by at most a factor 1.2"""
