"""Engines with their own copy of the policy, a feature: vLLM in the trainer's processes (vllm_engine), engines in
Ray actors (remote), the weight stream to both (weight_sync) and the launch check's proof that they follow it
(sync_check). This file holds their flag groups, which every run parses; the modules load only where a flag asks
for them (common.rollout.start_engine, common.check.launch_check)."""

from dataclasses import dataclass
from typing import Literal

from common.flags import flag

VLLM = (
    lambda a: a.rollout_name == "vllm" or getattr(a, "teacher_engine", "hf") == "vllm",
    "add --rollout-name vllm (or --teacher-engine vllm)",
)  # when the vLLM knobs are read
REMOTE = (lambda a: a.rollout_placement == "remote", "add --rollout-placement remote")  # when remote knobs are read
VLLM_LORA = (
    lambda a: a.rollout_name == "vllm" and getattr(a, "lora_rank", 0) > 0,
    "add --rollout-name vllm and --lora-rank",
)  # when the vLLM engine gets a LoRA policy
ANY_REMOTE = (
    lambda a: a.rollout_placement == "remote" or getattr(a, "teacher_placement", "") == "remote",
    "add --rollout-placement remote (or distill.py's --teacher-placement remote)",
)


@dataclass
class VLLMArgs:
    """vLLM's engine knobs: common.serving.vllm_engine.VLLMEngine takes them whole (a vLLM teacher too)."""

    gpu_memory_utilization: float = flag(
        0.5, gt=0, le=1, only_with=(lambda a: a.rollout_name == "vllm", "add --rollout-name vllm")
    )
    """vllm: fraction of GPU memory its engine may take (weights and KV cache)"""
    tensor_parallel_size: int = flag(1, ge=1, only_with=VLLM)
    """vllm: GPUs one engine spans (verl's tensor_model_parallel_size)"""
    enforce_eager: bool = flag(True, only_with=VLLM)
    """vllm: no CUDA graphs (less memory and start-up time beside a trainer)"""
    max_num_seqs: int = flag(1024, ge=1, only_with=VLLM)
    """vllm: most sequences in one engine step"""
    max_num_batched_tokens: int = flag(8192, ge=1, only_with=VLLM)
    """vllm: most tokens in one engine step"""
    block_size: int | None = flag(None, rule=(lambda v: v is None or v >= 1, ">= 1"), only_with=VLLM)
    """vllm: tokens per KV-cache block (ROLL's strategy_config.block_size; default: vLLM's own for the device)"""
    enable_sleep_mode: bool = flag(False, only_with=VLLM)
    """vllm (GPU): free the engine's memory between rollouts (verl's free_cache_engine)"""
    lora_sync: Literal["auto", "adapter", "merged"] = flag("auto", only_with=VLLM_LORA)
    """vllm with LoRA: sync the adapter alone (vLLM's LoRA), or merged into the full weights; auto: the adapter
    where vLLM's LoRA serves the model and its layers, merged otherwise (said at launch)"""


@dataclass
class PlacementArgs:
    """Where the rollout engines run: in the trainer's processes, or remote in Ray actors (common.serving.remote)."""

    rollout_placement: Literal["colocated", "remote"] = "colocated"
    """colocated: the engine runs in the trainer's processes; remote: in Ray actors with their own copy of the
    weights, streamed to them after every step"""
    num_rollout_engines: int = flag(2, ge=1, only_with=REMOTE)
    """remote: engine processes (Ray actors)"""
    engine_num_cpus: float = flag(1.0, gt=0, only_with=REMOTE)
    """remote: CPUs Ray reserves for each engine (its torch threads)"""
    engine_num_gpus: float = flag(0.0, ge=0, only_with=REMOTE)
    """remote: GPUs Ray reserves for each engine"""
    ray_address: str | None = flag(None, only_with=ANY_REMOTE)
    """remote: the Ray cluster to join (default: $RAY_ADDRESS, else Ray starts inside this job)"""
    max_staleness: int = flag(0, ge=0, note="0 is synchronous", only_with=REMOTE)
    """remote: most weight versions a sample may lag the policy it trains (rollouts generated ahead; 0: synchronous)"""
    engine_timeout: float = flag(300.0, gt=0, unit="seconds", only_with=ANY_REMOTE)
    """remote: seconds any wait on an engine may last before the run stops, naming the engine"""

    @property
    def remote(self) -> bool:
        return self.rollout_placement == "remote"
