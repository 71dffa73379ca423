"""Plumbing shared by the recipes. Nothing here decides how a recipe learns (advantage, loss,
aggregation): that stays in the recipe.

How a value reaches the code that uses it, in five steps:
1. The command line names a flag: `python recipes/grpo.py --temperature 0.7` (or verl's key, translated).
2. common.config.cli parses it into the recipe's Args: its own knobs (args.clip_ratio), and every shared flag in
   the group declared beside the code it configures (args.rollout.temperature: common.engines.RolloutArgs).
3. Each group checks its flags as it is made; common.config.check_flags checks the rules across groups.
4. The recipe's main passes the group whole, or a value, to the function that uses it:
   start_engine(model, tokenizer, dist, step, args.model, args.rollout, args.placement, prompts).
5. That function reads the flag: sampling at rollout.temperature; no group method assembles another's arguments.

The layout says what the code is. The core sits flat in this folder: what a default run loads, and the part a
recipe of its own always loads (sft_data, kl_reward, critic, teacher). The features sit above it, in subpackages
named by what they add: serving/ (engines with their own copy of the weights: vLLM, Ray-remote, the weight stream,
its check), agents/ (tools, the agent loop, environments), shaping/ (verl's rollout correction, ROLL's
conditioning, a reward model), formats/ (verl's keys, data read through datasets, large prompt sets, wandb and
tensorboard), scaling/ (FSDP2, the accelerate launcher's config, torch.compile) and proofs/ (--check full). A
feature package's __init__ holds its flag groups, which every run parses (and shaping's, the calls a recipe makes
at its steps); its modules load only where a flag asks for them.

Read it bottom-up. LAYERS lists the core's modules from the bottom and FEATURES the features' above them: a module
imports (at top level or inside a function) only modules listed before it, so there is no import circle, but for
the core reaching a feature, which it does only inside the function its flag routes to (start_engine imports
common.serving.vllm_engine under --rollout-name vllm). tests/test_layers.py enforces both. Recipes sit on top and
import from any layer; nothing here imports a recipe.
"""

LAYERS = (  # the core, bottom-up
    "watchdog",  # no silent hang: waits under a deadline (--wait-timeout), and who waits on whom when one passes
    "errors",  # UsageError, DataError, RunStopped and usage_errors: what every layer raises, how recipes report it
    "flags",  # flag(): a knob's field with its range rule; check_ranges reads the rules back
    "serving",  # the flag groups of engines with their own weights: vLLM's knobs (VLLMArgs), placement (PlacementArgs)
    "agents",  # the flag groups of multi-turn rollouts: tools and interactions (AgentArgs), environments (EnvArgs)
    "optim",  # AdamW and the lr schedules, and their flags (OptimArgs)
    "parallel",  # the process group, DDP / FSDP2 wrapping, collectives, the stop signal, logging setup (WaitArgs)
    "runlock",  # one live run per run folder (and per generate / evaluate output): the lock and its holder
    "scoring",  # verl's compute_score built-ins and the loaders of user code (no processes)
    "data",  # parquet rows; verl's, TRL's and OpenRLHF's columns, templating, batches (DataArgs, RLDataArgs, ActorArgs)
    "sft_data",  # sft.py's examples: conversations or prompt / response rows with their loss masks (SFTDataArgs)
    "ops",  # masked maths, logprobs and entropy, KL estimators, loss aggregation
    "kl_reward",  # the KL penalty in the reward of rloo, reinforce_pp and ppo: its knobs (KLRewardArgs), its controller
    "shaping",  # the flag groups of the rollout correction and ROLL's conditioning, and the steps' calls to them
    "perf",  # the update's model FLOPs, the device's peak, MFU
    "model",  # policy, reference and tokenizer loading (ModelArgs); response logits and values
    "critic",  # ppo.py's critic: verl's value model, and its values of the response tokens
    "tracking",  # metrics.jsonl, the console, wandb / tensorboard, curves
    "checkpoint",  # save, check, resume, hf/ export
    "rewards",  # the hang-proof worker pool that runs reward functions, tools and interactions (RewardArgs)
    "engines",  # Sampling, Completion, the HF engine, the engine and rollout flags (EngineArgs, RolloutArgs)
    "rollout",  # start_engine, a step's sampled and scored batch, validation (ValidationArgs), an RL run's loading
    "teacher",  # distill.py's teacher: where it runs (TeacherArgs), its checks, start_teacher
    "config",  # TrainerArgs and RLArgs, which every recipe builds on, cli, and what several groups decide together
    "check",  # --check: the launch-time proof that the engine samples what the trainer trains, on this stack
)

FEATURES = (  # above the core, bottom-up: each loads only where a flag asks for it
    "formats",  # other libraries' keys and files
    "formats.reasoning_gym",  # reasoning-gym's tasks as data (--train-files reasoning-gym:NAME), scored by their own
    "formats.sources",  # data through datasets: JSON / JSONL, CSV, Arrow, save_to_disk, dataset names, large parquet
    "formats.prompt_cache",  # prompts of large data (--data-workers): a cached datasets map, rows memory-mapped
    "formats.verl",  # verl's key=value overrides translated into our flags: the one table of verl's keys
    "formats.loggers",  # --logger wandb / tensorboard
    "shaping.correction",  # verl's rollout correction: importance weights and rejection over the engine's logprobs
    "shaping.conditioning",  # ROLL's reward and advantage conditioning and loss terms
    "shaping.domains",  # ROLL's domain_interleave_probs: each step's prompts drawn by data_source
    "shaping.reward_model",  # --reward-model: a sequence classifier that scores whole conversations
    "shaping.judge",  # --judge-url: an LLM judge behind an OpenAI-compatible URL, run in the reward workers
    "agents.tools",  # --tool-config / --interaction-config read without running them; tool calls in text; their pools
    "agents.envs",  # --env-config read without running it; the text adapter, the action of a reply, a worker's host
    "agents.agent",  # the multi-turn loop with tools and interactions over any engine
    "agents.caller",  # --agent-fn in the workers: the user's agent called with an openai client
    "agents.endpoint",  # --agent-fn: the OpenAI-compatible endpoint over the run's engine, and the loop of agent calls
    "agents.env_manager",  # ROLL's environment manager: groups of Gymnasium environments played over any engine
    "serving.weight_sync",  # the trainer's weights under checkpoint names, for engines with their own copy
    "serving.replay",  # the kept set of top-k / top-p / min-p for engines that report none (vLLM), from the trainer
    "serving.vllm_engine",  # vLLM's engine in the trainer process (--rollout-name vllm), synced through weight_sync
    "serving.remote",  # engines in Ray actors, the weight stream to them, bounded staleness
    "serving.sync_check",  # --check's weight sync item, for engines with their own copy (vLLM, remote)
    "scaling",  # beyond one process running eager passes
    "scaling.fsdp",  # FSDP2 sharding and CPU offload (--strategy fsdp2)
    "scaling.accelerate",  # the config file of accelerate launch --config_file, checked against the machine
    "scaling.compile",  # torch.compile of each decoder layer (--use-torch-compile)
    "proofs",  # what --check full proves
    "proofs.resume_proof",  # --check full's child runs: a run resumed from its checkpoint trains the same next step
    "proofs.tool",  # python -m common.check: the recipe up to its launch check, every probe, then exit
)
