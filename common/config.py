"""The flags every recipe builds on: TrainerArgs, RLArgs (every RL flag group, each declared beside the code it
configures: OptimArgs in common.optim, EngineArgs in common.engines, ...) and check_flags, the checks that span
groups, run as the flags are parsed; a flag's range and when the run reads it live on its field (common.flags.flag),
and the rules between RL flags in RLArgs.__post_init__. Recipes inherit these; the flags of every group (a field
such as RLArgs.placement) keep their flat names (`--lr`, `--max-staleness`). A recipe's own `Args` adds its
algorithm's knobs and may change defaults."""

import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Literal

import tyro

from common.data import DataArgs, PromptArgs
from common.data import plan_batches as plan_batches  # re-exported for older forks
from common.engines import EngineArgs
from common.errors import ORIGINS, UsageError
from common.errors import usage_errors as usage_errors  # re-exported for older forks
from common.flags import BUNDLED, check_ranges, check_used, flag, flag_name, flag_values
from common.flags import flag_types as flag_types  # re-exported: tests/test_docs.py reads flags with it
from common.model import DTYPES, LORA, ModelArgs, looks_local
from common.ops import KLRewardArgs as KLRewardArgs  # re-exported: recipes build on it
from common.optim import OptimArgs
from common.parallel import WaitArgs
from common.rewards import RewardArgs
from common.rollout import TOLERANCE, AgentArgs, ConditioningArgs, EnvArgs, PlacementArgs, RolloutArgs, ValidationArgs
from common.rollout import EnvPlayArgs as EnvPlayArgs  # re-exported: recipes build on it

# What only common.verl reads: a verl key=value (its OVERRIDE) and the flags that name a verl config.
VERL_KEY = re.compile(r"^\+{0,2}[A-Za-z_][\w-]*(?:\.[\w-]+)+=")
VERL_FLAGS = ("--verl-config", "--config-path", "-cp", "--config-name", "-cn", "--print-verl-translation")


def cli_args(args_class, adv_estimator: str | None = None, trainer: str | None = None, loss_mode="vanilla"):
    """sys.argv[1:] for tyro; a verl key=value or verl config flag has common.verl (a feature) translate it
    (adv_estimator and loss_mode: the verl estimator and policy loss the recipe runs)."""
    argv = sys.argv[1:]
    if any(VERL_KEY.match(a) or a.split("=", 1)[0] in VERL_FLAGS for a in argv):
        from common.verl import verl_args

        return verl_args(args_class, adv_estimator, trainer=trainer, loss_mode=loss_mode)
    ORIGINS.clear()  # no flag came from a verl key (an earlier run in this process may have set some)
    return argv


def check_flags(args) -> None:
    """Every flag's range and when it is read (common.flags), the rules that span flag groups, and the paths that
    can be checked without loading anything (a local model folder, --output-dir). Raises UsageError naming the flag."""
    check_ranges(args)  # each flag's range, declared on its field (common.flags)
    check_used(args)
    values = flag_values(args)  # every flag by its name, a group's (args.agent.tool_config) too
    for name in ("model", "reward_model", "critic_model", "teacher_model"):
        path = values.get(name)
        if not path or not looks_local(path):
            continue
        folder = Path(path).expanduser()
        where = f"{flag_name(name)} {path}"
        if not folder.is_dir():
            raise UsageError(
                f"{where}: folder does not exist; pass a Hugging Face folder (config.json, weights, tokenizer "
                f"files) or a hub name such as Qwen/Qwen2.5-0.5B-Instruct"
            )
        if not (folder / "config.json").is_file():
            raise UsageError(f"{where}: no config.json in that folder, so it is not a Hugging Face model")
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UsageError(f"{where}: {folder / 'config.json'} cannot be read as JSON ({e}); the folder's copy "
                             f"is damaged, so copy or save the model again") from None  # fmt: skip
        if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
            raise UsageError(f"{where}: {folder / 'config.json'} has no model_type, so transformers cannot tell "
                             f"the architecture; save the model with save_pretrained")  # fmt: skip
    tools, interactions = values.get("tool_config"), values.get("interaction_config")  # args.agent's
    if tools or interactions:
        from common.tools import read_interaction_config, read_tool_config  # a feature: loaded where asked for

        if tools:
            read_tool_config(tools)  # its YAML and files; the functions are imported in the tool workers
        if interactions:
            read_interaction_config(interactions)  # likewise: the classes are imported in a worker
    if values.get("env_config"):  # args.env's
        from common.envs import check_env  # a feature: the environments are made in their workers

        check_env(args)
    if values.get("rollout_name") == "vllm":
        from common.vllm_engine import check_vllm  # a feature: loaded where asked for

        check_vllm(args, "--rollout-name vllm")
    if values.get("rollout_rs") is not None:
        from common.correction import check_rejection  # a feature: loaded where asked for

        check_rejection(args)
    out = Path(getattr(args, "output_dir", "") or ".").expanduser()
    if out.is_file():
        raise UsageError(f"--output-dir {args.output_dir}: is a file; pass a folder (it is created if missing)")
    blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UsageError(f"--output-dir {args.output_dir}: {blocking} is a file, so the folder cannot be created")


@dataclass
class TrainerArgs(WaitArgs):
    check: Literal["fast", "full", "warn", "off"] = "fast"
    """before step 1, prove on this stack what the run relies on (common.check; the RL recipes: that the engine
    samples what the trainer trains): fast stops the run on a failed item, full also proves that a resumed step
    equals the uninterrupted one (two short child runs first), warn only says so"""
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
    save_freq: int | None = None
    """save a checkpoint every N steps and after the last (unset: only after the last; 0 or below: never, as in verl)"""
    test_freq: int | None = None
    """validate every N steps and after the last (unset: only after the last; 0 or below: never, as in verl)"""
    val_before_train: bool = False
    """validate once before the first step (not again on resume; verl validates at each start)"""
    resume: str = "auto"
    """auto (latest checkpoint in output_dir), disable, or a path to a checkpoint folder"""
    max_ckpt_to_keep: int = flag(2, ge=0, note="0 keeps all")
    """keep only the newest K checkpoints (0 keeps all)"""
    export_merged_lora: bool = flag(False, only_with=LORA)
    """with LoRA: also save a merged full model under hf/ next to the adapter"""
    logger: tuple[Literal["console", "wandb", "tensorboard"], ...] = ("console",)
    """where metrics go besides metrics.jsonl"""
    log_interval: int = flag(10, ge=0, note="0: only the progress bar")
    """print one line of key metrics every N steps (0: only the progress bar)"""
    strategy: Literal["auto", "ddp", "fsdp2"] = "auto"
    """data parallelism: auto is fsdp2 under an accelerate FSDP config, else ddp"""

    def __post_init__(self):  # every recipe's Args: flags checked as they are parsed (a recipe's own
        check_flags(self)  # __post_init__ calls super().__post_init__() first)

    def run_dir(self, recipe: str) -> Path:
        return Path(self.output_dir or f"runs/{self.experiment_name or recipe}")

    def tracker_kwargs(self, recipe: str, run_info: dict) -> dict:
        """common.tracking.Tracker's keyword arguments; its config holds every flag, the recipe and run_info."""
        return dict(
            loggers=self.logger, project=self.project_name, experiment=self.experiment_name or recipe,
            log_interval=self.log_interval, config={**asdict(self), "recipe": recipe, "run": run_info},
        )  # fmt: skip

    def total_steps(self, steps_per_epoch: int) -> int:
        """--total-training-steps, else --total-epochs passes (verl stops at whichever ends first: see the refusal)."""
        epochs, steps = self.total_epochs * steps_per_epoch, self.total_training_steps
        if steps and steps > epochs and ORIGINS.get("total_training_steps"):
            raise UsageError(
                f"{ORIGINS['total_training_steps']}: verl would stop after {self.total_epochs} epochs "
                f"({ORIGINS.get('total_epochs', '--total-epochs')}), {epochs} steps of {steps_per_epoch}, and here "
                f"it would train all {steps}; give trainer.total_training_steps={epochs}, or trainer.total_epochs="
                f"{-(-steps // max(1, steps_per_epoch))} for all {steps}"
            )
        return steps or epochs

    def save_kwargs(self, recipe: str) -> dict:
        """common.checkpoint.save_checkpoint's keyword arguments: the recipe (the checkpoint's owner), the flags."""
        return dict(recipe=recipe, keep=self.max_ckpt_to_keep, merged_lora=self.export_merged_lora, flags=asdict(self))


@dataclass
class RLArgs(RolloutArgs, EngineArgs, TrainerArgs, PromptArgs, DataArgs, ModelArgs):
    """The flags every RL recipe shares, with RL defaults for the bundled task. They are listed model, data,
    optim, trainer, rollout, engine, then the groups (validation, reward, ...); a recipe's own knobs follow."""

    model: str = str(BUNDLED / "tiny-qwen2-sft")
    """policy: a local Hugging Face folder or a hub name"""
    optim: Annotated[OptimArgs, tyro.conf.OmitArgPrefixes] = field(
        default_factory=partial(OptimArgs, lr=2e-4, lr_scheduler="cosine")
    )
    """AdamW and the lr schedule (common.optim)"""
    total_training_steps: int | None = 80
    """stop after this many optimizer steps (overrides total_epochs)"""
    test_freq: int | None = 20
    """validate every N steps and after the last (unset: only after the last; 0 or below: never, as in verl)"""
    val_before_train: bool = True
    """validate once before the first step (not again on resume; verl validates at each start)"""
    validation: Annotated[ValidationArgs, tyro.conf.OmitArgPrefixes] = field(default_factory=ValidationArgs)
    """how each validation samples and what it logs (common.rollout.evaluate)"""
    reward: Annotated[RewardArgs, tyro.conf.OmitArgPrefixes] = field(default_factory=RewardArgs)
    """what scores a response: built-in rules, --reward-fn or a --reward-model (common.rewards)"""
    env: Annotated[EnvArgs, tyro.conf.OmitArgPrefixes] = field(default_factory=EnvArgs)
    """Gymnasium environments played instead of prompts (common.envs), off without --env-config"""
    agent: Annotated[AgentArgs, tyro.conf.OmitArgPrefixes] = field(default_factory=AgentArgs)
    """multi-turn rollouts: tools and interactions (common.agent), off without --tool-config / --interaction-config"""
    placement: Annotated[PlacementArgs, tyro.conf.OmitArgPrefixes] = field(default_factory=PlacementArgs)
    """where the rollout engines run: in the trainer's processes, or remote in Ray actors (common.remote)"""
    conditioning: Annotated[ConditioningArgs, tyro.conf.OmitArgPrefixes] = field(default_factory=ConditioningArgs)
    """ROLL's reward and advantage conditioning and loss terms (common.conditioning), all off by default"""

    def __post_init__(self):  # the rules between RL flags, after every flag's own (TrainerArgs.__post_init__)
        super().__post_init__()
        if self.temperature == 0:
            raise UsageError(
                "--temperature 0: greedy rollouts give every response of a group the same text, so there is nothing "
                "to compare; training samples (e.g. 1.0). Greedy validation is --val-temperature 0 (the default)"
            )
        if self.bypass_mode and self.rollout_is:
            raise UsageError(
                f"--bypass-mode with --rollout-is {self.rollout_is}: in bypass mode the engine's logprobs are the old "
                f"policy, so pi_old / pi_rollout is 1 and the weights change nothing (the PPO ratio pi / pi_rollout "
                f"does the correcting); drop one of the two flags"
            )

    # Derived values, computed from the flags above (no side effects).
    def data_kwargs(self) -> dict:
        """common.rollout.load_rl_data's keyword arguments. A row's ground truth is required by the built-in
        rewards (they score against it), optional for a user's --reward-fn and unused by a --reward-model."""
        names = ("prompt_key", "label_key", "data_source", "apply_chat_template", "max_prompt_length", "truncation",
                 "filter_overlong_prompts", "data_workers", "train_batch_size")  # fmt: skip
        env, reward = self.env, self.reward
        return {
            **{k: getattr(self, k) for k in names},
            "ground_truth": "unused" if reward.reward_model else "optional" if reward.reward_fn else "required",
            "tools": self.agent.tool_schemas(),
            "interactions": self.agent.interaction_names(),
            "tool_classes": self.agent.tool_class_names(),
            "env": dict(zip(("tags", "n_groups"), env.env_groups(self.train_batch_size)), config=env.env_config,
                        train_seeds=env.env_train_seeds, val_seeds=env.env_val_seeds) if env.env_config else None,
            "difficulty": self.conditioning.difficulty_loss_weight,
        }  # fmt: skip

    def reward_kwargs(self, run_dir: Path, tokenizer=None, rows: list[dict] = ()) -> dict:
        """common.rewards.start_reward_pool's keyword arguments: its dry run's rows (none for a reward model), the
        tokenizer for environments' prompts and the log <run_dir>/reward_workers.log (.rank<N> past rank 0)."""
        rank = os.environ.get("RANK", "0")
        name = "reward_workers.log" if rank == "0" else f"reward_workers.rank{rank}.log"
        reward, agent = self.reward, self.agent
        return dict(reward_fn=reward.reward_fn, batch=reward.reward_manager == "batch", workers=reward.reward_workers,
                    timeout=reward.reward_timeout, log_path=Path(run_dir) / name, tool_config=agent.tool_config,
                    tool_timeout=agent.tool_timeout, interaction_config=agent.interaction_config,
                    env=self.env.env_pool_kwargs(self.max_prompt_length), tokenizer=tokenizer,
                    dry_run_rows=[] if reward.reward_model else rows)  # fmt: skip

    def tracker_kwargs(self, recipe: str, run_info: dict) -> dict:
        """TrainerArgs.tracker_kwargs, plus whether a NaN or infinite reward stops the run, what perf/mfu needs
        (run_info, the passes over a step), the flags common.perf.verdict reads and the trainer-engine gap's bound."""
        plan = self.batch_plan(run_info["world_size"])
        values = flag_values(self)  # a group's flags (--max-staleness) by their names too
        facts = ("rollout_name", "rollout_placement", "max_staleness", "reward_workers", "use_remove_padding",
                 "micro_batch_size_per_gpu", "gradient_checkpointing", "mixed_precision", "dtype", "lora_rank",
                 "use_torch_compile")  # fmt: skip
        run = {**{k: values[k] for k in facts}, "device": run_info["device"],
               "micro_batches": plan.grad_accum}  # a mini-batch's passes (0: by a token budget)  # fmt: skip
        return {**super().tracker_kwargs(recipe, run_info),
                "stop_on_nonfinite_reward": self.reward.stop_on_nonfinite_reward,
                "perf": {**run_info, "epochs": self.ppo_epochs, "run": run},
                "gap_bound": self.gap_bound(self.gap_dtype)}  # fmt: skip

    def engine_kwargs(self, train: list, total_steps: int, pool) -> dict:
        """EngineArgs.engine_kwargs (validation's prompts per generate call as the batch), the placement group with
        remote engines' schedule of `train`'s prompts (none for an environment's, which come as it plays), the agent
        loop's (its tools run in the reward pool's tool workers) and the environments'."""
        schedule = None
        if self.placement.rollout_placement == "remote" and not self.env.env_config:
            from common.remote import StepPrompts  # a feature: loaded where --rollout-placement remote asks for it

            schedule = StepPrompts(train, self.train_batch_size, self.seed, self.shuffle, self.samplings()[0])
        lengths = self.max_prompt_length, self.max_response_length
        return {**super().engine_kwargs(self.validation.val_batch_size), "placement": self.placement,
                "schedule": schedule, "total_steps": total_steps, **self.env.env_kwargs(pool, *lengths),
                **self.agent.agent_kwargs(pool.tools, pool.interactions, lengths[1])}  # fmt: skip

    def check_kwargs(self, version: int) -> dict:
        """common.check.launch_check's keyword arguments (an engine with weights of its own has its sync checked)."""
        return dict(dtype=self.gap_dtype, own_weights=self.engine_holds_own_weights, version=version,
                    freq=self.probe_freq, trainer_dtype=self.trainer_dtype)  # fmt: skip

    def model_kwargs(self) -> dict:
        """common.rollout.load_rl_models's keyword arguments, a frozen reference among them when a KL term needs one."""
        return {**self.policy_kwargs(), "strategy": self.strategy, "reward_model": self.reward.reward_model,
                "with_reference": self.needs_ref, "micro_batch_size": self.micro_batch_size_per_gpu}  # fmt: skip

    @property
    def gap_dtype(self):
        """The dtype whose TOLERANCE bounds the engine-trainer gap: the coarser of the trainer's and --rollout-dtype."""
        engine = self.trainer_dtype if self.rollout_dtype == "auto" else DTYPES[self.rollout_dtype]
        return max(self.trainer_dtype, engine, key=lambda dtype: TOLERANCE[dtype][1])

    @property
    def needs_ref(self) -> bool:
        """Whether a KL term, in the loss (--use-kl-loss) or the reward (--use-kl-in-reward), needs the reference."""
        return getattr(self, "use_kl_loss", False) or getattr(self, "use_kl_in_reward", False)

    @property
    def ref_pass(self) -> bool:
        """Whether step 4 computes the reference's logprobs of the sampled tokens, for a KL estimated from them;
        the exact KL (kl_penalty / kl_loss_type full) runs the reference beside the policy, on the same micro-batch."""
        in_loss = getattr(self, "use_kl_loss", False) and getattr(self, "kl_loss_type", "") != "full"
        return in_loss or getattr(self, "use_kl_in_reward", False) and getattr(self, "kl_penalty", "") != "full"

    def total_steps(self, train_rows: int) -> int:
        return super().total_steps(train_rows // self.train_batch_size)


def is_due(step: int, freq: int | None, last_step: int) -> bool:
    """Whether an action runs after `step`: every freq steps and at last_step (None: only there; <= 0: never)."""
    return step == last_step if freq is None else freq > 0 and (step == last_step or step % freq == 0)
