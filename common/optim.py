"""AdamW and the learning-rate schedules users know from verl: constant, cosine, wsd, with warmup."""

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch.optim.lr_scheduler import LambdaLR

from common.flags import flag

# wsd: the lr stays at its peak until this fraction of the steps, then decays (cosine) to min_lr.
WSD_STABLE_RATIO = 0.9


class Trainable(NamedTuple):
    """A model with its optimizer and lr schedule: what an update steps together, and what a
    checkpoint saves and a resume restores together (the policy; PPO's critic)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR


def build_optimizer(model, lr: float, weight_decay: float, betas=(0.9, 0.999), l2: float = 0.0) -> torch.optim.AdamW:
    """AdamW over trainable parameters; biases and norm weights (1-D) get no weight decay. PyTorch's
    fused kernel where the parameters are floating point on a CPU or GPU: one kernel for every tensor
    instead of a loop over them (on 2 CPU cores 0.5 ms a step for the bundled model, 2.2 ms looped).
    l2 > 0 adds l2 * w to the weight matrices' gradients before each step: the gradient of an L2 term
    l2 / 2 * |w|^2 in the loss (torch's Adam weight_decay), which Adam's scaling then reaches, unlike
    the decoupled decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay, no_decay = [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=tuple(betas), fused=fused or None)
    if l2 > 0:

        def l2_term(*_):
            for p in decay:
                if p.grad is not None:
                    p.grad.add_(p.detach(), alpha=l2)

        optimizer.register_step_pre_hook(l2_term)
    return optimizer


def lr_factor(step: int, *, kind: str, total_steps: int, warmup_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based). Warmup is linear and reaches the peak on
    step warmup_steps-1, so no step runs with lr 0."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        decay_start = warmup_steps
    elif kind == "wsd":
        decay_start = max(warmup_steps, int(WSD_STABLE_RATIO * total_steps))
    else:
        raise ValueError(f"lr_scheduler={kind!r}; use constant, cosine or wsd")
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer, *, kind: str, total_steps: int, warmup_ratio: float, min_lr_ratio: float = 0.0, warmup_steps: int = -1
) -> LambdaLR:
    """warmup_steps > 0: that many warm-up steps (verl's lr_warmup_steps, ROLL's warmup_steps), else the ratio's."""
    if not 0 <= warmup_ratio <= 1:
        raise ValueError(f"lr_warmup_steps_ratio={warmup_ratio} must be within [0, 1]")
    warmup = min(warmup_steps, total_steps) if warmup_steps > 0 else int(warmup_ratio * total_steps)
    return LambdaLR(
        optimizer,
        lambda s: lr_factor(s, kind=kind, total_steps=total_steps, warmup_steps=warmup, min_lr_ratio=min_lr_ratio),
    )


@dataclass
class OptimArgs:
    lr: float = flag(1e-5, gt=0)
    """peak learning rate (AdamW)"""
    weight_decay: float = flag(0.01, ge=0)
    """AdamW weight decay, on the weight matrices (biases and norms get none; verl decays every parameter)"""
    betas: tuple[float, float] = flag(
        (0.9, 0.999), rule=(lambda v: all(0 <= b < 1 for b in v), "two numbers in [0, 1)")
    )
    """AdamW betas"""
    lr_warmup_steps_ratio: float = flag(0.0, ge=0, le=1)
    """fraction of the total steps warming the lr up linearly: step k of w at (k + 1) / w of the peak (verl: k / w)"""
    lr_warmup_steps: int = flag(-1, rule=(lambda v: v == -1 or v >= 1, "-1 (the ratio decides) or >= 1"))
    """warm-up steps as a count, over --lr-warmup-steps-ratio (verl's lr_warmup_steps, ROLL's warmup_steps; -1:
    the ratio decides)"""
    lr_scheduler: Literal["constant", "cosine", "wsd"] = "constant"
    """lr after warmup: constant, cosine decay, or warmup-stable-decay"""
    min_lr_ratio: float = flag(
        0.0, ge=0, le=1, only_with=(lambda a: a.lr_scheduler != "constant", "add --lr-scheduler cosine or wsd")
    )
    """cosine / wsd: the final lr as a fraction of the peak"""
    l2: float = flag(0.0, ge=0, note="0: none")
    """an L2 term l2 / 2 * |w|^2 in the loss on the weight matrices (ROLL's l2; its gradient goes through Adam,
    where --weight-decay's is decoupled from it)"""
    grad_clip: float = flag(1.0, ge=0, note="0 disables clipping")
    """clip the global grad norm to this (0 disables; verl's 0 would zero every gradient)"""


def trainable(model, optim: OptimArgs, total_steps: int) -> Trainable:
    """The model with the AdamW (build_optimizer) and lr schedule over total_steps that the optim group describes."""
    optimizer = build_optimizer(model, optim.lr, optim.weight_decay, optim.betas, optim.l2)
    scheduler = build_scheduler(
        optimizer,
        kind=optim.lr_scheduler,
        total_steps=total_steps,
        warmup_ratio=optim.lr_warmup_steps_ratio,
        min_lr_ratio=optim.min_lr_ratio,
        warmup_steps=optim.lr_warmup_steps,
    )
    return Trainable(model, optimizer, scheduler)
