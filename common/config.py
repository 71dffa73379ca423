"""The flags every recipe builds on: TrainerArgs (a run's folder, length, saving, logging and checks), RLArgs (the
groups every RL recipe shares, each declared beside the code it configures: ModelArgs in common.model, RLDataArgs and
ActorArgs in common.data, RolloutArgs in common.engines, ...), cli (the command line into a recipe's Args, flags
flat: tyro's OmitArgPrefixes), check_flags (the rules across groups), and what several groups decide together
(plan_rl_batches, engine_sync). How a value travels from the command line to its code: common/__init__.py."""

import dataclasses
import json
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Literal

import torch
import tyro
from tyro.conf import OmitArgPrefixes

from common.agents import AgentArgs as AgentArgs  # re-exported: generate.py builds on it
from common.agents import EnvArgs, RLAgentArgs
from common.agents import EnvPlayArgs as EnvPlayArgs  # re-exported: recipes build on it
from common.data import ActorArgs, BatchPlan, RLDataArgs, plan_batches
from common.data import DataArgs as DataArgs  # re-exported for older forks
from common.engines import EngineArgs as EngineArgs  # re-exported: recipes build on it
from common.engines import RolloutArgs
from common.errors import ORIGINS, UsageError
from common.errors import usage_errors as usage_errors  # re-exported for older forks
from common.flags import BUNDLED, check_ranges, check_used, flag, flag_name, flag_values
from common.flags import flag_types as flag_types  # re-exported: tests/test_docs.py reads flags with it
from common.model import DTYPES, LORA, ModelArgs, looks_local
from common.optim import OptimArgs
from common.parallel import WaitArgs
from common.rewards import RewardArgs
from common.rollout import TOLERANCE, ValidationArgs
from common.serving import PlacementArgs
from common.shaping import ConditioningArgs, CorrectionArgs

# What only common.formats.verl reads: a verl key=value (its OVERRIDE) and the flags that name a verl config.
# verl's keys are dotted but for sft_trainer.yaml's top-level two (common.formats.verl.VERL_KEYS says so).
VERL_KEY = re.compile(r"^\+{0,2}(?:[A-Za-z_][\w-]*(?:\.[\w-]+)+|use_remove_padding|ulysses_sequence_parallel_size)=")
VERL_FLAGS = ("--verl-config", "--config-path", "-cp", "--config-name", "-cn", "--print-verl-translation")


def cli(args_class, recipe: str, adv_estimator: str | None = None, trainer: str | None = None, loss_mode="vanilla"):
    """The recipe's Args from the command line (cli_args: verl's key=value arguments too). --help shows the recipe's
    own knobs first, in a box named after the recipe, then one box per flag group."""
    root = dataclasses.make_dataclass(recipe, [(recipe, Annotated[args_class, OmitArgPrefixes])])
    about = (getattr(sys.modules.get(args_class.__module__), "__doc__", None) or "").split("\n")[0]  # its first line
    if not os.environ.get(LAST_WINS):
        refuse_repeats(sys.argv[1:], args_class)
    argv = cli_args(args_class, adv_estimator, trainer, loss_mode)
    refuse_foreign(argv)
    args = getattr(tyro.cli(root, args=argv, description=about), recipe)
    for pair in flag_values(args).get("system_envs") or ():  # before anything reads them: a hub, a library
        os.environ[pair.partition("=")[0]] = pair.partition("=")[2]
    return args


TRACKERS = (lambda a: {"wandb", "tensorboard"} & set(a.logger), "add --logger wandb or tensorboard")
ENV_PAIR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
LAST_WINS = "RECIPES_LAST_FLAG_WINS"  # set by --check full's child runs, which append flags over the user's


# Values our users' other tools take that cannot run here, with the reason (a verl key arrives as its flag)
FOREIGN = {
    ("--rollout-name", "sglang"): "SGLang is not an engine here; --rollout-name vllm or hf",
    (
        "--strategy",
        "deepspeed",
    ): "DeepSpeed cannot run here; --strategy ddp or fsdp2 (configs/fsdp2_offload.yaml for ZeRO-3 offload)",
    ("--strategy", "megatron"): "Megatron cannot run here; FSDP2 shards the model (--strategy fsdp2)",
}


def refuse_foreign(argv: list[str]) -> None:
    """A value of FOREIGN is a UsageError giving its reason, not the parser's list of choices."""
    pairs = [tuple(a.split("=", 1)) if "=" in a else (a, b) for a, b in zip(argv, [*argv[1:], ""])]
    for name, value in pairs:
        if (name, value.lower()) in FOREIGN:
            raise UsageError(f"{name} {value}: {FOREIGN[name, value.lower()]}")


def refuse_repeats(argv: list[str], args_class) -> None:
    """A flag given twice, or under two spellings (--input-key and --prompt-key; --x and --no-x), is refused naming
    both: argparse keeps the last in silence."""
    aliases, said = _aliases(args_class), {}
    for token in (t.split("=", 1)[0] for t in argv if t.startswith("--")):
        name = aliases.get(token, token)
        name = "--" + name.removeprefix("--no-") if name.startswith("--no-") else name
        if name in said:
            twice = f"{token} is given twice" if said[name] == token else f"{said[name]} and {token} both set {name}"
            raise UsageError(f"{twice}; give it once (the command line would keep the last in silence)")
        said[name] = token


def _aliases(cls) -> dict[str, str]:
    """{alias: flag} of the tyro aliases of cls's flags and of its groups' (common.data's --input-key)."""
    out = {}
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        out |= {a: flag_name(name) for m in getattr(hint, "__metadata__", ()) for a in getattr(m, "aliases", ()) or ()}
        inner = typing.get_args(hint)[0] if hasattr(hint, "__metadata__") else hint
        if dataclasses.is_dataclass(inner):
            out |= _aliases(inner)
    return out


def cli_args(args_class, adv_estimator: str | None = None, trainer: str | None = None, loss_mode="vanilla"):
    """sys.argv[1:] for tyro; a verl key=value or verl config flag has common.formats.verl (a feature) translate it
    (adv_estimator and loss_mode: the verl estimator and policy loss the recipe runs)."""
    argv = sys.argv[1:]
    if any(VERL_KEY.match(a) or a.split("=", 1)[0] in VERL_FLAGS for a in argv):
        from common.formats.verl import verl_args

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
            raise UsageError(
                f"{where}: {folder / 'config.json'} cannot be read as JSON ({e}); the folder's copy "
                f"is damaged, so copy or save the model again"
            ) from None
        if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
            raise UsageError(
                f"{where}: {folder / 'config.json'} has no model_type, so transformers cannot tell "
                f"the architecture; save the model with save_pretrained"
            )
    tools, interactions = values.get("tool_config"), values.get("interaction_config")  # args.agent's
    if tools or interactions:
        from common.agents.tools import read_interaction_config, read_tool_config  # a feature: loaded where asked for

        if tools:
            read_tool_config(tools)  # its YAML and files; the functions are imported in the tool workers
        if interactions:
            read_interaction_config(interactions)  # likewise: the classes are imported in a worker
    if values.get("agent_fn"):
        from common.agents.endpoint import check_agent_fn  # a feature: loaded where asked for

        check_agent_fn(SimpleNamespace(**values))
    if values.get("env_config"):  # args.env's
        from common.agents.envs import check_env  # a feature: the environments are made in their workers

        check_env(args)
    view = SimpleNamespace(**values)
    if values.get("rollout_name") == "vllm":
        from common.serving.vllm_engine import check_vllm  # a feature: loaded where asked for

        check_vllm(view, "--rollout-name vllm")
    if values.get("tracker_kwargs"):
        from common.formats.loggers import tracker_kwargs  # a feature: loaded where asked for

        tracker_kwargs(values["tracker_kwargs"], values["logger"])
    if values.get("rollout_rs") is not None:
        from common.shaping.correction import check_rejection  # a feature: loaded where asked for

        check_rejection(view)
    given = values.get("output_dir")
    out = Path(given or ".").expanduser()
    if out.is_file():
        raise UsageError(f"--output-dir {given}: is a file; pass a folder (it is created if missing)")
    blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UsageError(f"--output-dir {given}: {blocking} is a file, so the folder cannot be created")


@dataclass
class TrainerArgs(WaitArgs):
    """A run's folder, its length, its checkpoints and logs, and what it proves before step 1 (verl's trainer)."""

    check: Literal["fast", "full", "strict", "warn", "off"] = "fast"
    """before step 1, prove on this stack what the run relies on (common.check; the RL recipes: that the engine
    samples what the trainer trains, and that the policy's samples can get different rewards): fast stops the run
    on a failed item, full also proves that a resumed step equals the uninterrupted one (two short child runs
    first), strict also stops when every probe sample scores the same, warn only says so"""
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
    tracker_kwargs: str | None = flag(None, only_with=TRACKERS)
    """a JSON object of more arguments for the --logger trackers (ROLL's tracker_kwargs): each key goes to those of
    wandb.init and tensorboard's SummaryWriter that take it, e.g. '{"entity": "team", "tags": ["ablation"]}'"""
    system_envs: tuple[str, ...] = flag((), rule=(lambda v: all(ENV_PAIR.match(p) for p in v), "NAME=VALUE pairs"))
    """environment variables the run sets before anything loads (ROLL's system_envs), as NAME=VALUE pairs; they
    replace the launch's own values and reach every process the run starts"""
    log_interval: int = flag(10, ge=0, note="0: only the progress bar")
    """print one line of key metrics every N steps (0: only the progress bar)"""
    stop_on_nonfinite_reward: bool = False
    """stop the run at a NaN or infinite reward (default: it scores 0, counted in reward/nonfinite)"""

    def run_dir(self, recipe: str) -> Path:
        return Path(self.output_dir or f"runs/{self.experiment_name or recipe}")

    def total_steps(self, steps_per_epoch: int) -> int:
        """--total-training-steps, else --total-epochs passes (verl stops at whichever ends first: see the refusal)."""
        epochs, steps = self.total_epochs * steps_per_epoch, self.total_training_steps
        if steps and steps > epochs and ORIGINS.get("total_training_steps"):  # set by a verl key: verl's length
            from common.formats.verl import refuse_longer_run

            refuse_longer_run(self.total_epochs, steps_per_epoch, steps)
        return steps or epochs


def group(cls, **defaults):
    """A flag group of Args (its flags keep their flat names), with these defaults of the group's own."""
    return field(default_factory=partial(cls, **defaults) if defaults else cls)


@dataclass
class RLArgs:
    """The flag groups every RL recipe shares, with RL defaults for the bundled task, in --help's order after the
    recipe's own knobs (its Args' fields)."""

    model: Annotated[ModelArgs, OmitArgPrefixes] = group(ModelArgs, path=str(BUNDLED / "tiny-qwen2-sft"))
    """the policy's model (common.model)"""
    data: Annotated[RLDataArgs, OmitArgPrefixes] = group(RLDataArgs)
    """the prompts: files, columns, length, a step's share (common.data)"""
    rollout: Annotated[RolloutArgs, OmitArgPrefixes] = group(RolloutArgs)
    """the engine and how it samples (common.engines)"""
    actor: Annotated[ActorArgs, OmitArgPrefixes] = group(ActorArgs)
    """how the update splits a step's samples (common.data.plan_batches)"""
    optim: Annotated[OptimArgs, OmitArgPrefixes] = group(OptimArgs, lr=2e-4, lr_scheduler="cosine")
    """AdamW and the lr schedule (common.optim)"""
    trainer: Annotated[TrainerArgs, OmitArgPrefixes] = group(
        TrainerArgs, total_training_steps=80, test_freq=20, val_before_train=True
    )
    """the run: its folder, length, checkpoints, logs and launch check (common.config)"""
    validation: Annotated[ValidationArgs, OmitArgPrefixes] = group(ValidationArgs)
    """how each validation samples and what it logs (common.rollout.evaluate)"""
    reward: Annotated[RewardArgs, OmitArgPrefixes] = group(RewardArgs)
    """what scores a response: built-in rules, --reward-fn or a --reward-model (common.rewards)"""
    correction: Annotated[CorrectionArgs, OmitArgPrefixes] = group(CorrectionArgs)
    """verl's rollout correction against the engine's logprobs (common.shaping.correction), off by default"""
    placement: Annotated[PlacementArgs, OmitArgPrefixes] = group(PlacementArgs)
    """where the rollout engines run: in the trainer's processes, or remote in Ray actors (common.serving.remote)"""
    agent: Annotated[RLAgentArgs, OmitArgPrefixes] = group(RLAgentArgs)
    """multi-turn rollouts: tools and interactions (common.agents), off without --tool-config / --interaction-config"""
    env: Annotated[EnvArgs, OmitArgPrefixes] = group(EnvArgs)
    """Gymnasium environments played instead of prompts (common.agents.envs), off without --env-config"""
    conditioning: Annotated[ConditioningArgs, OmitArgPrefixes] = group(ConditioningArgs)
    """ROLL's reward and advantage conditioning and loss terms (common.shaping.conditioning), all off by default"""

    def __post_init__(self):  # a recipe's own __post_init__ calls super().__post_init__() first
        check_flags(self)


# --- what several groups decide together
def plan_rl_batches(data: RLDataArgs, actor: ActorArgs, rollout: RolloutArgs, world_size: int) -> BatchPlan:
    """The checked batch arithmetic of an RL run (common.data.plan_batches) for this many processes: data's prompts a
    step, rollout's samples of each, actor's mini- and micro-batches and epochs, the trainer passes' temperature."""
    return plan_batches(
        world_size=world_size,
        train_batch_size=data.train_batch_size,
        rollout_n=rollout.rollout_n,
        mini_batch_size=actor.ppo_mini_batch_size,
        micro_batch_size_per_gpu=actor.micro_batch_size_per_gpu,
        use_dynamic_bsz=actor.use_dynamic_bsz,
        max_token_len_per_gpu=actor.ppo_max_token_len_per_gpu,
        max_sequence_length=data.max_prompt_length + rollout.max_response_length,
        epochs=actor.ppo_epochs,
        temperature=rollout.temperature,
        share_prompts=actor.shared_prompt_forward,
        shuffle=actor.shuffle_mini_batches,
    )


@dataclass(frozen=True)
class Sync:
    """How the engine and the trainer are kept to the same policy, and how the run proves it (engine_sync)."""

    own_weights: bool  # the engine samples with its own copy of the policy (vLLM, remote), synced each step
    old_logprobs: Literal["engine", "pass", "when-stale"]  # where step 4's old logprobs come from
    trainer_dtype: torch.dtype  # what the trainer computes in
    gap_dtype: torch.dtype  # whose TOLERANCE bounds the engine-trainer gap: the coarser of the trainer's and engine's
    gap_proves_sync: bool  # the logged per-step gap proves the weight sync
    freq: int  # --check-freq


def engine_sync(policy: ModelArgs, rollout: RolloutArgs, placement, correction, needed_before_update=False) -> Sync:
    """Sync of an RL run. Old logprobs come from the engine with --bypass-mode; from a no-grad trainer pass when they
    are needed before the update (a KL penalty in the reward, distill's teacher advantage) or set against the engine's (an engine
    with its own weights, a rollout correction); else ("when-stale") a pass only for a sample the policy moved past,
    the update's own logprobs being exact for the rest. The logged gap proves the sync where an engine with its own
    weights samples on policy (no --max-staleness or --model-update-frequency: the trainer replays top-k / top-p /
    min-p), against the
    trainer's old logprobs (no --bypass-mode), in a run that expects no gap (no --rollout-is / --rollout-rs)."""
    own = rollout.rollout_name != "hf" or placement.remote
    before = needed_before_update or own or correction.on
    old = "engine" if correction.bypass_mode else "pass" if before else "when-stale"
    trainer = policy.trainer_dtype
    engine = trainer if rollout.rollout_dtype == "auto" else DTYPES[rollout.rollout_dtype]
    expected = correction.bypass_mode or correction.rollout_is or correction.rollout_rs
    proves = own and not placement.max_staleness and rollout.model_update_frequency == 1 and not expected
    gap = max(trainer, engine, key=lambda dtype: TOLERANCE[dtype][1])
    return Sync(own, old, trainer, gap, proves, rollout.check_freq)


def is_due(step: int, freq: int | None, last_step: int) -> bool:
    """Whether an action runs after `step`: every freq steps and at last_step (None: only there; <= 0: never)."""
    return step == last_step if freq is None else freq > 0 and (step == last_step or step % freq == 0)


def __getattr__(name: str):  # older forks import KLRewardArgs from here; it lives with the KL controller now
    if name == "KLRewardArgs":
        from common.kl_reward import KLRewardArgs

        return KLRewardArgs
    raise AttributeError(f"module 'common.config' has no attribute {name!r}")
