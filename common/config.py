"""Base dataclasses for the flags every recipe shares, and the batch arithmetic check.

Recipes inherit from these so the flags stay flat (`--lr`, `--model`, `--train-files`); a recipe's
own `Args` adds its algorithm's knobs and may override defaults.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

BUNDLED = Path(__file__).resolve().parent.parent / "bundled"


@dataclass
class ModelArgs:
    model: str = str(BUNDLED / "tiny-qwen2")
    """policy: a local Hugging Face folder or a hub name"""
    tokenizer: str | None = None
    """tokenizer folder or hub name (default: the model's)"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype the weights are loaded and trained in"""
    trust_remote_code: bool = False
    """allow model code from the model folder / hub (off: only transformers' own architectures)"""
    mixed_precision: Literal["no", "bf16"] = "no"
    """bf16: compute in bfloat16 over the --dtype master weights (FSDP2: bf16 params, float32
    gradient reduction; DDP / one process: autocast)"""
    gradient_checkpointing: bool = False
    """recompute activations in backward to save memory"""
    lora_rank: int = 0
    """LoRA rank; 0 trains the full model"""
    lora_alpha: int = 16
    """LoRA scaling numerator (scale = lora_alpha / lora_rank)"""
    target_modules: tuple[str, ...] = ("all-linear",)
    """modules that get LoRA adapters: 'all-linear' or names such as q_proj v_proj"""


@dataclass
class DataArgs:
    train_files: tuple[str, ...] = (str(BUNDLED / "addition" / "train.parquet"),)
    """training parquet file(s)"""
    val_files: tuple[str, ...] = (str(BUNDLED / "addition" / "test.parquet"),)
    """validation parquet file(s); empty to skip validation"""
    prompt_key: str = "prompt"
    """column holding the prompt: a chat list of {role, content} or a plain string"""
    truncation: Literal["error", "left", "right", "middle"] = "error"
    """too-long input: error, or keep the end (left), the start (right), or both ends (middle)"""
    shuffle: bool = True
    """shuffle the training data every epoch (seeded)"""


@dataclass
class OptimArgs:
    lr: float = 1e-5
    """peak learning rate (AdamW)"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas"""
    lr_warmup_steps_ratio: float = 0.0
    """fraction of the total steps spent warming the lr up linearly from 0"""
    lr_scheduler: Literal["constant", "cosine", "wsd"] = "constant"
    """lr after warmup: constant, cosine decay, or warmup-stable-decay"""
    min_lr_ratio: float = 0.0
    """cosine / wsd: the final lr as a fraction of the peak"""
    grad_clip: float = 1.0
    """clip the global grad norm to this (0 disables)"""


@dataclass
class TrainerArgs:
    output_dir: str = ""
    """run folder (default: runs/<experiment_name>)"""
    project_name: str = "recipes"
    """wandb / tensorboard project"""
    experiment_name: str = ""
    """run name (default: the recipe name)"""
    seed: int = 1
    """seed for init, data order and sampling"""
    total_epochs: int = 1
    """passes over the training data (ignored when total_training_steps is set)"""
    total_training_steps: int | None = None
    """stop after this many optimizer steps (overrides total_epochs)"""
    save_freq: int = -1
    """save a checkpoint every N steps (-1: only at the end); 0 never saves"""
    test_freq: int = -1
    """validate every N steps (-1: only at the end); 0 never validates"""
    val_before_train: bool = False
    """validate once before the first step"""
    resume: str = "auto"
    """auto (latest checkpoint in output_dir), disable, or a path to a checkpoint folder"""
    max_ckpt_to_keep: int = 2
    """keep only the newest K checkpoints (0 keeps all)"""
    export_merged_lora: bool = False
    """with LoRA: also save a merged full model under hf/ next to the adapter"""
    logger: tuple[Literal["console", "wandb", "tensorboard"], ...] = ("console",)
    """where metrics go besides metrics.jsonl"""
    strategy: Literal["auto", "ddp", "fsdp2"] = "auto"
    """data parallelism: auto is fsdp2 under an accelerate FSDP config, else ddp"""


@dataclass(frozen=True)
class BatchPlan:
    """Derived batch sizes; `local_` means per rank."""

    world_size: int
    sequences_per_step: int
    local_sequences_per_step: int
    mini_batches_per_step: int
    local_mini_batch: int
    grad_accum: int


def _nearby_divisors(n: int, around: int, count: int = 3) -> list[int]:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return sorted(sorted(divisors, key=lambda d: (abs(d - around), d))[:count])


def plan_batches(
    *,
    world_size: int,
    train_batch_size: int,
    micro_batch_size_per_gpu: int,
    mini_batch_size: int | None = None,
    rollout_n: int = 1,
) -> BatchPlan:
    """Check that the global batch splits evenly into mini-batches, ranks and micro-batches.

    train_batch_size and mini_batch_size count prompts (SFT: examples); each prompt yields
    rollout_n sequences; micro_batch_size_per_gpu counts sequences. Raises ValueError naming the
    numbers to change. Call it before any model loads.
    """
    mini = train_batch_size if mini_batch_size is None else mini_batch_size
    for name, value in [
        ("train_batch_size", train_batch_size),
        ("micro_batch_size_per_gpu", micro_batch_size_per_gpu),
        ("ppo_mini_batch_size", mini),
        ("rollout_n", rollout_n),
    ]:
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    if train_batch_size % mini:
        raise ValueError(
            f"train_batch_size={train_batch_size} prompts is not divisible by "
            f"ppo_mini_batch_size={mini}; try ppo_mini_batch_size="
            + " or ".join(map(str, _nearby_divisors(train_batch_size, mini)))
        )
    if train_batch_size % world_size:
        raise ValueError(
            f"train_batch_size={train_batch_size} cannot be split evenly over {world_size} "
            f"processes; use a multiple of {world_size}"
        )
    mini_sequences = mini * rollout_n
    if mini_sequences % world_size:
        raise ValueError(
            f"a mini-batch of {mini}x{rollout_n}={mini_sequences} sequences cannot be split "
            f"evenly over {world_size} processes; make ppo_mini_batch_size*rollout_n a multiple "
            f"of {world_size}"
        )
    local_mini = mini_sequences // world_size
    if local_mini % micro_batch_size_per_gpu:
        raise ValueError(
            f"each process gets {local_mini} sequences per optimizer step "
            f"({mini}x{rollout_n} over {world_size} processes), which is not divisible by "
            f"micro_batch_size_per_gpu={micro_batch_size_per_gpu}; try "
            f"micro_batch_size_per_gpu=" + " or ".join(map(str, _nearby_divisors(local_mini, micro_batch_size_per_gpu)))
        )
    sequences = train_batch_size * rollout_n
    return BatchPlan(
        world_size=world_size,
        sequences_per_step=sequences,
        local_sequences_per_step=sequences // world_size,
        mini_batches_per_step=train_batch_size // mini,
        local_mini_batch=local_mini,
        grad_accum=local_mini // micro_batch_size_per_gpu,
    )


def is_due(step: int, freq: int, last_step: int) -> bool:
    """Whether a periodic action (save, validate) runs after `step`: every `freq` steps and at the
    last step; freq -1 means only at the last step, 0 never."""
    return freq != 0 and (step == last_step or (freq > 0 and step % freq == 0))
