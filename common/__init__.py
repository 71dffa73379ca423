"""Plumbing shared by the recipes. Nothing here decides how a recipe learns (advantage, loss,
aggregation): that stays in the recipe.

Read it bottom-up. LAYERS lists the modules from the bottom: a module imports (at top level or
inside a function) only modules listed before it, so there is no import circle and each module
can be read knowing only those below it. tests/test_layers.py enforces this; a new module takes
the lowest place its imports allow. Recipes sit on top and import from any layer; nothing here
imports a recipe.
"""

LAYERS = (
    "watchdog",  # no silent hang: waits under a deadline (--wait-timeout), and who waits on whom when one passes
    "errors",  # UsageError, DataError, RunStopped and usage_errors: what every layer raises, how recipes report it
    "flags",  # flag(): a knob's field with its range rule; check_ranges reads the rules back
    "verl",  # verl's key=value overrides translated into our flags: the one table of verl's keys
    "optim",  # AdamW and the lr schedules, and their flags (OptimArgs)
    "parallel",  # the process group, DDP / FSDP2 wrapping, collectives, the stop signal, logging setup (WaitArgs)
    "resume_proof",  # --check full's child runs: a run resumed from its checkpoint trains the same next step
    "runlock",  # one live run per run folder (and per generate / evaluate output): the lock and its holder
    "sources",  # data through datasets: JSON / JSONL, CSV, Arrow, save_to_disk, dataset names, large parquet
    "data",  # parquet rows; verl's, TRL's and OpenRLHF's columns, chat templating, truncation, micro-batches (DataArgs)
    "prompt_cache",  # prompts of large data (--data-workers): a cached datasets map, rows memory-mapped
    "sft_data",  # sft.py's examples: conversations or prompt / response rows with their loss masks
    "correction",  # verl's rollout correction: importance weights and rejection over the engine's logprobs
    "ops",  # masked maths, logprobs and entropy, KL estimators and controller (KLRewardArgs), loss aggregation
    "perf",  # the update's model FLOPs, the device's peak, MFU
    "conditioning",  # ROLL's reward and advantage conditioning: length reward, normalisation, whitening, clip, weights
    "scoring",  # verl's compute_score built-ins and the loaders of user code (no processes)
    "tools",  # --tool-config / --interaction-config read without running them; tool calls in text
    "envs",  # --env-config read without running it; the text adapter, the action of a reply, a worker's host
    "model",  # policy, critic, reward model and tokenizer loading (ModelArgs); response logits and values
    "reward_model",  # --reward-model: a sequence classifier that scores whole conversations
    "critic",  # ppo.py's critic: verl's value model, and its values of the response tokens
    "tracking",  # metrics.jsonl, the console, wandb / tensorboard, curves
    "checkpoint",  # save, check, resume, hf/ export
    "weight_sync",  # the trainer's weights under checkpoint names, for engines with their own copy
    "rewards",  # the hang-proof worker pool that runs reward functions, tools and interactions (RewardArgs)
    "engines",  # Sampling, Completion, the HF engine (EngineArgs)
    "vllm_engine",  # vLLM's engine in the trainer process (--rollout-name vllm), synced through weight_sync
    "remote",  # engines in Ray actors, the weight stream to them, bounded staleness
    "agent",  # the multi-turn loop with tools and interactions over any engine
    "env_manager",  # ROLL's environment manager: groups of Gymnasium environments played over any engine
    "rollout",  # start_engine, a step's sampled and scored batch, validation; the rollout's flag groups
    "sync_check",  # --check's weight sync item, for engines with their own copy (vLLM, remote)
    "teacher",  # distill.py's teacher: where it runs (TeacherArgs), its checks, start_teacher
    "config",  # TrainerArgs and RLArgs, which every recipe builds on, and the checks that span flag groups
    "check",  # --check: the launch-time proof that the engine samples what the trainer trains, on this stack
)

# Opt-in features: only a flag that asks for one loads it (tools and the agent loop, environments,
# remote Ray engines, the vLLM engine, its weight sync and its check, ROLL's conditioning:
# common.config.ConditioningArgs, the verl translation: common.config.cli_args, --check full's
# child runs), so a default run reads and imports the rest, the core. A module outside this list
# imports these only inside the function that serves the flag (tests/test_layers.py). The launch
# check's fast probes (common.check) run in every run (--check fast) and are core.
FEATURES = ("tools", "envs", "agent", "env_manager", "remote", "vllm_engine", "weight_sync", "sync_check",
            "conditioning", "resume_proof", "reward_model", "correction", "verl", "sources", "prompt_cache")  # fmt: skip

# The names the recipes import, by module: the surface a fork builds on. tests/test_layers.py holds
# the recipes to it, so that every name a recipe uses is named here and every name here is used.
PUBLIC = {
    "check": "launch_check prove_resume trainer_check",
    "checkpoint": "find_resume resume save_checkpoint",
    "config": "AgentArgs BUNDLED DataArgs EngineArgs EnvPlayArgs KLRewardArgs ModelArgs OptimArgs RLArgs TrainerArgs "
    "WaitArgs check_flags cli_args is_due plan_batches",
    "critic": "load_critic response_values",
    "data": "DataError get_field has_column pad read_rows split_rows step_rows take_rows",
    "engines": "Sampling hf_generate_greedy",
    "envs": "env_rows",
    "errors": "UsageError usage_errors",
    "flags": "flag flag_values",
    "model": "load_policy load_tokenizer load_trained_model response_logits sequence_logits",
    "ops": "KLEstimator agg_loss jsd_from_logits kl_controller_step kl_from_logits kl_penalty logprobs_and_entropy "
    "logprobs_from_logits masked_mean masked_mean_all_ranks masked_var masked_whiten masked_whiten_all_ranks "
    "rollout_correction",
    "prompt_cache": "load_prompts",
    "parallel": "StopSignal all_reduce_sum barrier clip_grad_norm gather_objects grad_sync init_distributed "
    "resolve_strategy seed_everything setup_logging shard_evenly",
    "rewards": "Scored start_agent_pools start_env_pool start_reward_pool",
    "rollout": "Rollout engine_logprobs load_rl_data load_rl_models regroup sample start_engine",
    "runlock": "claim_output claim_run_dir",
    "scoring": "builtin_scorer exact_match extract_answer hit",
    "sft_data": "load_sft",
    "sources": "open_source",
    "teacher": "TeacherArgs check_teacher start_teacher",
    "tools": "check_agent_rows",
    "tracking": "Tracker describe_run step_metrics",
}
