"""Process group setup through accelerate, and data parallelism: DDP or FSDP2 (`fully_shard`).

FSDP2 is applied by this module rather than by accelerate's plugin, so the very same code path runs
on CPU with gloo (in the tests) and on GPUs with NCCL."""

import contextlib
import logging
import os
import random
import signal
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as tdist
from torch import nn

from common import watchdog
from common.errors import UsageError
from common.flags import env_flag, flag


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    seed: int = 0  # the run's seed (--seed); each rank's generators are seeded with seed + rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s", force=True)
    for noisy in ("httpx", "urllib3", "filelock", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Our progress bar is the only one: library bars (weight loading, shard writing) would interleave with it.
    import transformers

    transformers.utils.logging.disable_progress_bar()


def init_distributed(wait_timeout: float = 1800.0, seed: int | None = None) -> Dist:
    """Start (or join) the process group via accelerate (`accelerate launch` or `torchrun`), check it matches
    the launcher's, set up logging and arm the watchdog: no progress for wait_timeout seconds (--wait-timeout)
    ends the process with who waits on whom, a minute before the process group's timeout would. A seed seeds
    each rank with seed + rank (ranks sample different responses). Without CUDA it asks for CPU/gloo: left to
    decide, accelerate gives torchrun's CPU processes no process group, each silently alone (no gradient sync)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if "ACCELERATE_MIXED_PRECISION" in os.environ:  # set by accelerate launch: its config file is checked
        from common.scaling.accelerate import check_accelerate_config

        check_accelerate_config(launched)
    from accelerate import PartialState

    cpu = os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes") or not torch.cuda.is_available()
    # FSDP2's CPU offload reduces CPU tensors (gradient norms), which NCCL cannot: give them gloo.
    backend = {"backend": "cuda:nccl,cpu:gloo"} if fsdp_options()["offload"] and not cpu else {}
    state = PartialState(cpu=cpu, timeout=timedelta(seconds=wait_timeout + 60), **backend)
    if state.num_processes != launched:
        raise UsageError(
            f"the launcher started {launched} processes but the process group has {state.num_processes}; on CPU "
            "launch with `torchrun --nproc_per_node N ...` (accelerate launch --cpu --num_processes N starts only one)"
        )
    if state.device.type == "cpu" and state.num_processes > 1:
        # Two busy processes with two threads each on two cores ran several times slower.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    setup_logging(state.process_index)
    watchdog.arm(wait_timeout, state.process_index)
    if seed is not None:
        seed_everything(seed + state.process_index)
    return Dist(state.process_index, state.num_processes, state.local_process_index, state.device, seed or 0)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def fsdp_options() -> dict:
    """The FSDP settings an accelerate FSDP config exports (under torchrun, set them yourself).
    FSDP_OFFLOAD_PARAMS keeps parameters, gradients and the optimizer step in CPU memory, moving each
    block's parameters to the accelerator for its forward and backward (verl's fsdp_config.param_offload +
    optimizer_offload); FSDP_RESHARD_AFTER_FORWARD=false keeps the gathered parameters from forward to
    backward (faster, more memory). Settings the recipes would not apply are refused, not ignored."""
    if env_flag("ACCELERATE_USE_FSDP") and os.environ.get("FSDP_VERSION", "2") != "2":
        raise UsageError(
            f"the accelerate config asks for FSDP version {os.environ['FSDP_VERSION']}; the recipes shard with "
            "FSDP2 (torch's fully_shard): set fsdp_version: 2 in its fsdp_config, as configs/fsdp2.yaml does"
        )
    if env_flag("FSDP_ACTIVATION_CHECKPOINTING"):
        raise UsageError(
            "the accelerate config sets fsdp_activation_checkpointing, which the recipes do not read: "
            "remove it from the config and pass --gradient-checkpointing"
        )
    return dict(
        offload=env_flag("FSDP_OFFLOAD_PARAMS"), reshard_after_forward=env_flag("FSDP_RESHARD_AFTER_FORWARD", "true")
    )


def resolve_strategy(strategy: str) -> str:
    """--strategy auto: fsdp2 under an accelerate FSDP config or FSDP_OFFLOAD_PARAMS, else ddp. A UsageError:
    either with --strategy ddp (it would replicate what the config shards), or offload without a process group."""
    use_fsdp = env_flag("ACCELERATE_USE_FSDP")
    offload = fsdp_options()["offload"]
    if strategy == "ddp" and (use_fsdp or offload):
        what = "an accelerate FSDP config" if use_fsdp else "FSDP_OFFLOAD_PARAMS=true"
        raise UsageError(
            f"--strategy ddp under {what}: drop --strategy (auto follows the config) or launch with configs/ddp.yaml"
        )
    if offload and not (tdist.is_available() and tdist.is_initialized()):
        raise UsageError(
            "CPU offload (FSDP_OFFLOAD_PARAMS=true) shards with FSDP2, which needs a launcher: "
            "accelerate launch --config_file configs/fsdp2_offload.yaml ..., or torchrun --nproc_per_node N ..."
        )
    if strategy != "auto":
        return strategy
    return "fsdp2" if use_fsdp or offload else "ddp"


def wrap_model(model: nn.Module, strategy: str, dist: Dist, mixed_precision: str = "no") -> nn.Module:
    """Data-parallel wrap: DDP, or FSDP2 with one shard unit per transformer block (offloaded to CPU
    memory when fsdp_options() says so, then also for one process); otherwise a single process keeps the
    model as it is. mixed_precision "bf16" computes in bfloat16 over the model's own (master) weights: FSDP2
    casts the gathered parameters and reduces gradients in float32; otherwise forward (generate's too) autocasts."""
    options = fsdp_options() if strategy == "fsdp2" else {"offload": False}
    # With offload, FSDP2 pays even for one process: the weights live in CPU memory.
    fsdp = strategy == "fsdp2" and (dist.world_size > 1 or options["offload"])
    if not options["offload"]:
        model.to(dist.device)
    if mixed_precision == "bf16" and not fsdp:
        model.forward = torch.autocast(device_type=dist.device.type, dtype=torch.bfloat16)(model.forward)
        model.autocast_dtype = torch.bfloat16  # the dtype common.model.response_logprobs's fused LM head computes in
    elif mixed_precision not in ("no", "bf16"):
        raise ValueError(f"mixed_precision={mixed_precision!r}; use no or bf16")
    if not fsdp and (dist.world_size == 1 or strategy == "none"):  # "none": a frozen model each rank keeps whole
        return model
    if strategy == "ddp":
        ids = [dist.device.index] if dist.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if strategy != "fsdp2":
        raise ValueError(f"unknown strategy {strategy!r}; use ddp or fsdp2")
    from common.scaling.fsdp import shard  # a feature: loaded where --strategy fsdp2 asks for it

    return shard(model, dist, mixed_precision, options)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def is_fsdp(model: nn.Module) -> bool:
    return hasattr(model, "set_requires_gradient_sync")


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool):
    """Skip the gradient all-reduce / reduce-scatter on accumulation micro-batches. The block (a micro-batch's
    forward and backward) waits on the other ranks for the watchdog: FSDP2 gathers and reduces, DDP all-reduces."""
    with watchdog.waiting("a micro-batch's forward and backward (FSDP2 / DDP collectives)", collective=True):
        if isinstance(model, nn.parallel.DistributedDataParallel) and not enabled:
            with model.no_sync():
                yield
        elif is_fsdp(model):
            model.set_requires_gradient_sync(enabled)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        else:
            yield


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Global grad norm (over all ranks and shards), clipped to max_norm when max_norm > 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    with watchdog.waiting("clip_grad_norm (the global norm's all-reduce)", collective=True):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
    return float(norm)


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if tdist.is_available() and tdist.is_initialized():
        value = value.clone()
        with watchdog.waiting("all_reduce_sum", collective=True):
            tdist.all_reduce(value, op=tdist.ReduceOp.SUM)
    return value


def all_reduce_max(value: int | float) -> int | float:
    """The largest of every rank's number (e.g. a micro-batch count every rank must then use), of its type."""
    if tdist.is_available() and tdist.is_initialized():
        # NCCL reduces only CUDA tensors; gloo only CPU ones.
        device = torch.device("cuda", torch.cuda.current_device()) if tdist.get_backend() == "nccl" else "cpu"
        kind = float if isinstance(value, float) else int
        t = torch.tensor([value], dtype=torch.float64 if kind is float else torch.long, device=device)
        with watchdog.waiting("all_reduce_max", collective=True):
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        value = kind(t.item())
    return value


def gather_objects(obj) -> list:
    """Every rank's obj, in rank order, on every rank."""
    if not (tdist.is_available() and tdist.is_initialized()):
        return [obj]
    out = [None] * tdist.get_world_size()
    with watchdog.waiting("gather_objects (all_gather_object)", collective=True):
        tdist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, wait_s: float | None = None):
    """Rank 0's obj, on every rank. wait_s: how long the others may wait for it, when rank 0 has a
    longer job first than the process group's timeout allows (a gloo group of its own waits)."""
    if not (tdist.is_available() and tdist.is_initialized()):
        return obj
    box = [obj]
    group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=wait_s)) if wait_s else None
    with watchdog.waiting("broadcast_object from rank 0", timeout=wait_s, collective=True):
        tdist.broadcast_object_list(box, src=0, group=group)
    if group is not None:
        tdist.destroy_process_group(group)
    return box[0]


def barrier() -> None:
    if tdist.is_available() and tdist.is_initialized():
        with watchdog.waiting("barrier", collective=True):
            tdist.barrier()


def sharding_report(model: nn.Module, strategy: str, dist: Dist) -> dict:
    """What is really in effect: world size, strategy and the parameter elements each rank holds."""
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    return {
        "world_size": dist.world_size,
        "device": dist.device.type,
        "strategy": strategy if dist.world_size > 1 or is_fsdp(model) else "single",
        "param_offload": is_fsdp(model) and fsdp_options()["offload"],
        "params_full": sum(p.numel() for p in model.parameters()),  # a DTensor's numel is the global one
        "params_trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "params_local_per_rank": gather_objects(local),
    }


def shard_evenly(items: list, dist: Dist) -> tuple[list, int]:
    """This rank's contiguous share, padded with copies of items[0] to the same length on every
    rank (FSDP2 forward passes are collective, call for call). Returns (share, real_count)."""
    per_rank = -(-len(items) // dist.world_size)
    mine = items[dist.rank * per_rank : (dist.rank + 1) * per_rank]
    return mine + [items[0]] * (per_rank - len(mine)), len(mine)


class StopSignal:
    """SIGUSR1 or SIGTERM (what Slurm sends before a time limit with --signal, or on preemption) asks a training
    run to stop after the step it is in, saving a checkpoint (even with --save-freq 0), and exit 0, so the requeued
    job resumes there with --resume auto. The handlers only set a flag; requested() is collective, so every rank
    stops after the same step even when one got the signal (one stopping alone would hang the others)."""

    def __init__(self, dist: Dist):
        self.device, self.received, self.stopping, self.failure = dist.device, None, False, None
        for name in ("SIGUSR1", "SIGTERM"):
            signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def fail(self, message: str) -> None:
        """Stop after this step's checkpoint as a signal would, but as a failure: the run ends with
        `message` and exit status 1 (common.tracking.Tracker.finish; common.check's --check-freq)."""
        self.received, self.failure = self.received or "failure", message

    def steps(self, start: int, stop: int):
        """start .. stop - 1, ending after the step whose requested() said stop (it saves first: recipe step 8)."""
        for step in range(start, stop):
            yield step
            if self.stopping:
                return

    def requested(self) -> bool:
        """Whether any rank got a signal, on every rank (once true, it stays true)."""
        flag = torch.tensor(float(self.received is not None), device=self.device)
        self.stopping = self.stopping or all_reduce_sum(flag).item() > 0
        return self.stopping


@dataclass
class WaitArgs:
    wait_timeout: float = flag(1800.0, gt=0, unit="seconds")
    """seconds without progress (stuck in a collective, an engine request, a sync, a save) before the run prints
    who waits on whom and ends with exit status 124 instead of blocking forever (common.watchdog)"""
