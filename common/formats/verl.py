"""verl's command-line overrides and config files, translated into this library's flags.

A verl user's script says `python3 -m verl.trainer.main_ppo data.train_batch_size=64
actor_rollout_ref.actor.optim.lr=1e-6 ...`; here the same arguments follow `python recipes/grpo.py`
(main_generation's and main_eval's follow generate.py and evaluate.py), a verl config file
follows --verl-config, and a Hydra launch (--config-path DIR --config-name NAME) is composed from
its defaults list. The keys a verl command leaves out take verl's defaults (VERL_DEFAULTS).
VERL_KEYS is the one table of what each verl key becomes (docs/configuration.md's "Coming from
verl" table is checked against it):
- Flag: one of our flags, the value carried over (a Hydra list `[a,b]` becomes several values, a
  boolean `--x` / `--no-x`);
- NoOp: a key with nothing to do here (Ray's resources, a memory-only micro-batch); they are said
  once, in one line, so the user knows they were read;
- Fixed: a key whose verl value must be what this library always does; another value is refused;
- Refused: a verl feature not built here, refused whatever its value.
A key not in the table is refused too. Nothing a user wrote is silently dropped, and every refusal
is a UsageError before anything loads. Two settings of one flag (two verl keys, or a verl key and
our own flag) must agree, or the run is refused naming both: every value given is read. The command
line wins over a config file, as in Hydra, and says so.
"""

import itertools
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from common.errors import ORIGINS, UsageError
from common.flags import env_flag, flag_defaults, flag_types


@dataclass(frozen=True)
class Flag:
    flag: str  # our field name (the flag is --field-name)


@dataclass(frozen=True)
class NoOp:
    why: str


@dataclass(frozen=True)
class Fixed:
    value: object  # the only value accepted
    why: str


@dataclass(frozen=True)
class Refused:
    why: str


# Flags whose meaning differs from their verl keys' in a detail (docs/configuration.md says each): said when a key
# that sets one is given.
DIFFERS = {
    "weight_decay": "biases and norm weights are not decayed here",
    "lr_warmup_steps_ratio": "the first warm-up step runs at peak / warm-up steps here, at 0 in verl",
    "grad_clip": "0 turns clipping off here; a non-finite norm stops the run, where verl skips that step",
    "ppo_max_token_len_per_gpu": "the budget bounds a micro-batch's padded size here, its real tokens in verl",
    "max_num_gen_batches": "at the limit the step trains on the groups found here; verl stops the run",
    "critic_lr": "the critic takes the policy's schedule and warm-up here; verl's critic has its own",
    "val_before_train": "not again on a resumed run here; verl validates at each start",
    "reward_fn": "each call within --reward-timeout here, else scored 0 and counted; verl waits",
    "use_torch_compile": "each decoder layer is compiled here; verl compiles its logprob and entropy function",
}
LAUNCHER = "processes and GPUs come from the launcher here (accelerate / torchrun / launch/)"
MICRO = "a memory-only micro-batch; --micro-batch-size-per-gpu sets every forward's here"
OFFLOAD = (
    "offload here is the launch's and covers every sharded model (configs/fsdp2_offload.yaml, FSDP_OFFLOAD_PARAMS=true)"
)
# The trained model's offload keys: on, they need that launch (without it they are refused, naming it).
OFFLOAD_KEYS = ("actor_rollout_ref.actor.fsdp_config.param_offload", "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
                "model.fsdp_config.cpu_offload", "model.fsdp_config.offload_params")  # fmt: skip
SP = "sequence parallelism is not built"
WRAP = "FSDP2 wraps each decoder layer"
REWARD_WHOLE = "the reward model loads whole onto each process's device, neither sharded nor offloaded"
CKPT = "a checkpoint holds the model, the optimizer and the rest of the state, with hf/ beside it"
MEGATRON_OPTIM_KEYS = ("lr_warmup_init", "lr_decay_steps", "lr_decay_style", "min_lr", "weight_decay_incr_style",
                       "lr_wsd_decay_style", "lr_wsd_decay_steps", "use_checkpoint_opt_param_scheduler")  # fmt: skip
MEGATRON_OPTIM = (
    "Megatron's optimizer scheduler key (actor.strategy megatron is refused); the schedule here is "
    "optim.warmup_style, lr_warmup_steps_ratio and min_lr_ratio"
)
ENGINE_KWARGS = "engine keyword arguments are not passed through; the vLLM knobs here are the rollout.* keys"

# verl's trainer config keys (ppo_trainer.yaml for the RL recipes, sft_trainer.yaml for sft.py),
# dotted from the root.
EXTERNAL = "importing a module named in the config would run its code"
TOKEN_IDS = "the engines here take token ids; the chat is rendered once"
OVERRIDE_CONFIG = "a model config override is not built; edit config.json"
AGENT_LOOP = "the agent loop runs when --tool-config or --interaction-config is given"
STRATEGY = "fsdp / fsdp2: one process group, --strategy auto picks DDP or FSDP2 from the launch (megatron is refused)"
TRUST = "one --trust-remote-code (actor_rollout_ref.model.trust_remote_code) covers every model and tokenizer"
EOS = "generation stops at the tokenizer's eos"
DATASET_CLASS = "a dataset class named by path would run code from the config"
ACTOR, ROLLOUT = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
VERL_KEYS: dict[str, Flag | NoOp | Fixed | Refused] = {
    # data
    "data.train_files": Flag("train_files"),
    "data.val_files": Flag("val_files"),
    "data.prompt_key": Flag("prompt_key"),
    "data.response_key": Flag("response_key"),
    "data.multiturn.messages_key": Flag("messages_key"),
    "data.multiturn.tools_key": Flag("tools_key"),
    "data.multiturn.enable": NoOp("sft.py reads --messages-key when the rows have it"),
    "data.max_length": Flag("max_length"),
    "data.max_prompt_length": Flag("max_prompt_length"),
    "data.max_response_length": Flag("max_response_length"),
    "data.truncation": Flag("truncation"),
    "data.filter_overlong_prompts": Flag("filter_overlong_prompts"),
    "data.train_batch_size": Flag("train_batch_size"),
    "data.val_batch_size": Flag("val_batch_size"),
    "data.micro_batch_size_per_gpu": Flag("micro_batch_size_per_gpu"),
    "data.shuffle": Flag("shuffle"),
    "data.tokenizer": Flag("tokenizer"),
    "data.return_raw_chat": NoOp(TOKEN_IDS),
    "data.return_raw_input_ids": NoOp(TOKEN_IDS),
    "data.reward_fn_key": Fixed("data_source", "rewards are chosen by the data_source column"),
    "data.image_key": NoOp("multimodal input is not built: columns named images or videos are refused, others unread"),
    "data.custom_cls.path": Fixed(None, DATASET_CLASS),
    # the policy
    "actor_rollout_ref.model.path": Flag("model"),
    "model.partial_pretrain": Flag("model"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": Flag("gradient_checkpointing"),
    "model.enable_gradient_checkpointing": Flag("gradient_checkpointing"),
    "actor_rollout_ref.model.trust_remote_code": Flag("trust_remote_code"),
    "model.trust_remote_code": Flag("trust_remote_code"),
    "actor_rollout_ref.model.lora_rank": Flag("lora_rank"),
    "model.lora_rank": Flag("lora_rank"),
    "actor_rollout_ref.model.lora_alpha": Flag("lora_alpha"),
    "model.lora_alpha": Flag("lora_alpha"),
    "actor_rollout_ref.model.target_modules": Flag("target_modules"),
    "model.target_modules": Flag("target_modules"),
    "actor_rollout_ref.model.use_remove_padding": Flag("use_remove_padding"),
    "critic.model.use_remove_padding": Flag("use_remove_padding"),  # one switch here for policy and critic
    "use_remove_padding": Flag("use_remove_padding"),  # verl's SFT trainer
    "reward_model.model.use_remove_padding": Flag("use_remove_padding"),
    "model.use_liger": Fixed(False, "Liger kernels are not built"),
    "actor_rollout_ref.model.use_liger": Fixed(False, "Liger kernels are not built"),
    "actor_rollout_ref.model.external_lib": Fixed(None, EXTERNAL),
    "model.external_lib": Fixed(None, EXTERNAL),
    "actor_rollout_ref.model.override_config": Fixed({}, OVERRIDE_CONFIG),
    "actor_rollout_ref.hybrid_engine": Fixed(
        True, "the engine shares the trainer's processes unless --rollout-placement remote"
    ),
    # the actor's update
    ACTOR + "strategy": NoOp(STRATEGY),
    ACTOR + "optim.lr": Flag("lr"),
    "optim.lr": Flag("lr"),
    ACTOR + "optim.weight_decay": Flag("weight_decay"),
    "optim.weight_decay": Flag("weight_decay"),
    ACTOR + "optim.betas": Flag("betas"),
    "optim.betas": Flag("betas"),
    ACTOR + "optim.lr_warmup_steps_ratio": Flag("lr_warmup_steps_ratio"),
    "optim.warmup_steps_ratio": Flag("lr_warmup_steps_ratio"),
    "optim.lr_warmup_steps_ratio": Flag("lr_warmup_steps_ratio"),
    ACTOR + "optim.lr_warmup_steps": Flag("lr_warmup_steps"),
    ACTOR + "optim.warmup_style": Flag("lr_scheduler"),
    ACTOR + "optim.lr_scheduler_type": Flag("lr_scheduler"),
    "optim.lr_scheduler": Flag("lr_scheduler"),
    "optim.warmup_style": Flag("lr_scheduler"),
    ACTOR + "optim.min_lr_ratio": Flag("min_lr_ratio"),
    "optim.min_lr_ratio": Flag("min_lr_ratio"),
    ACTOR + "optim.total_training_steps": NoOp("verl fills it in from the run's length"),
    ACTOR + "optim.clip_grad": Flag("grad_clip"),  # Megatron's name of actor.grad_clip
    ACTOR + "optim.optimizer": Fixed("AdamW", "the optimizer is torch's AdamW (decoupled weight decay)"),
    **{ACTOR + f"optim.{key}": Refused(MEGATRON_OPTIM) for key in MEGATRON_OPTIM_KEYS},
    ACTOR + "grad_clip": Flag("grad_clip"),
    "optim.clip_grad": Flag("grad_clip"),
    ACTOR + "ppo_mini_batch_size": Flag("ppo_mini_batch_size"),
    ACTOR + "ppo_micro_batch_size_per_gpu": Flag("micro_batch_size_per_gpu"),
    ACTOR + "ppo_micro_batch_size": Fixed(
        None, "verl's global micro-batch is deprecated; give ppo_micro_batch_size_per_gpu"
    ),
    ACTOR + "use_dynamic_bsz": Flag("use_dynamic_bsz"),
    ACTOR + "ppo_max_token_len_per_gpu": Flag("ppo_max_token_len_per_gpu"),
    ACTOR + "ppo_epochs": Flag("ppo_epochs"),
    ACTOR + "shuffle": Flag("shuffle_mini_batches"),
    ACTOR + "clip_ratio": Flag("clip_ratio"),
    ACTOR + "clip_ratio_low": Flag("clip_ratio_low"),
    ACTOR + "clip_ratio_high": Flag("clip_ratio_high"),
    ACTOR + "clip_ratio_c": Flag("clip_ratio_c"),
    ACTOR + "policy_loss.loss_mode": NoOp("the recipe file is the loss"),  # checked against the recipe
    ACTOR + "tau_pos": Flag("tau_pos"),
    ACTOR + "tau_neg": Flag("tau_neg"),
    ACTOR + "policy_loss.clip_cov_ratio": Flag("clip_cov_ratio"),
    ACTOR + "policy_loss.clip_cov_lb": Flag("clip_cov_lb"),
    ACTOR + "policy_loss.clip_cov_ub": Flag("clip_cov_ub"),
    ACTOR + "policy_loss.kl_cov_ratio": Flag("kl_cov_ratio"),
    ACTOR + "policy_loss.ppo_kl_coef": Flag("ppo_kl_coef"),
    ACTOR + "policy_loss.dro_beta": Flag("dro_beta"),
    ACTOR + "loss_agg_mode": Flag("loss_agg_mode"),
    ACTOR + "entropy_coeff": Flag("entropy_coeff"),
    ACTOR + "entropy_from_logits_with_chunking": NoOp("the entropy is always computed in chunks of rows here"),
    ACTOR + "calculate_sum_pi_squared": NoOp("otb.py's step 4 always measures it, and nothing else reads it"),
    ACTOR + "entropy_checkpointing": NoOp("the entropy's backward recomputes from the logits; no softmax is kept"),
    ACTOR + "use_kl_loss": Flag("use_kl_loss"),
    ACTOR + "kl_loss_coef": Flag("kl_loss_coef"),
    ACTOR + "kl_loss_type": Flag("kl_loss_type"),
    ACTOR + "ulysses_sequence_parallel_size": Fixed(1, SP),
    "ulysses_sequence_parallel_size": Fixed(1, SP),
    ACTOR + "fsdp_config.param_offload": NoOp(OFFLOAD),
    ACTOR + "fsdp_config.forward_prefetch": NoOp("FSDP2's own prefetching of the next layer's parameters"),
    ACTOR + "fsdp_config.optimizer_offload": NoOp(OFFLOAD),
    ACTOR + "fsdp_config.model_dtype": Flag("dtype"),
    ACTOR + "fsdp_config.mixed_precision.*": Refused("give --mixed-precision bf16 (bf16 parameters, fp32 reductions)"),
    "actor_rollout_ref.ref.fsdp_config.param_offload": NoOp(OFFLOAD),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": NoOp(MICRO),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": NoOp(MICRO),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": Fixed(1, SP),
    # the rollout
    ROLLOUT + "name": Flag("rollout_name"),
    ROLLOUT + "n": Flag("rollout_n"),
    ROLLOUT + "temperature": Flag("temperature"),
    ROLLOUT + "top_p": Flag("top_p"),
    ROLLOUT + "top_k": Flag("top_k"),
    ROLLOUT + "gpu_memory_utilization": Flag("gpu_memory_utilization"),
    ROLLOUT + "enforce_eager": Flag("enforce_eager"),
    ROLLOUT + "max_num_seqs": Flag("max_num_seqs"),
    ROLLOUT + "max_num_batched_tokens": Flag("max_num_batched_tokens"),
    ROLLOUT + "free_cache_engine": Flag("enable_sleep_mode"),
    ROLLOUT + "tensor_model_parallel_size": Flag("tensor_parallel_size"),
    ROLLOUT + "log_prob_micro_batch_size_per_gpu": NoOp(MICRO),
    ROLLOUT + "log_prob_micro_batch_size": NoOp(MICRO),
    ROLLOUT + "prompt_length": Flag("max_prompt_length"),  # verl's default: data.max_prompt_length's value
    ROLLOUT + "response_length": Flag("max_response_length"),  # (another value is refused: one length here)
    ROLLOUT + "load_format": NoOp("the engine's weights come from the trainer at each sync"),
    ROLLOUT + "mode": NoOp("the engine is called in-process, or through Ray with --rollout-placement remote"),
    ROLLOUT + "calculate_log_probs": NoOp("the engine's logprobs are always kept"),
    ROLLOUT + "enable_chunked_prefill": NoOp("vLLM's default (chunked prefill on) is kept"),
    ROLLOUT + "disable_log_stats": NoOp("the engine in the trainer logs no vLLM stats"),
    ROLLOUT + "val_kwargs.temperature": Flag("val_temperature"),
    ROLLOUT + "val_kwargs.n": Flag("val_n"),
    ROLLOUT + "val_kwargs.top_k": Flag("val_top_k"),
    ROLLOUT + "val_kwargs.top_p": Flag("val_top_p"),
    ROLLOUT + "val_kwargs.do_sample": Flag("val_temperature"),  # False: greedy, --val-temperature 0
    ROLLOUT + "multi_turn.enable": NoOp(AGENT_LOOP),
    ROLLOUT + "multi_turn.tool_config_path": Flag("tool_config"),
    ROLLOUT + "multi_turn.interaction_config_path": Flag("interaction_config"),
    ROLLOUT + "multi_turn.max_assistant_turns": Flag("max_assistant_turns"),
    ROLLOUT + "multi_turn.max_user_turns": Flag("max_user_turns"),
    ROLLOUT + "multi_turn.tokenization_sanity_check_mode": Flag("tokenization_sanity_check_mode"),
    # the algorithm
    "algorithm.adv_estimator": NoOp("the recipe file is the estimator"),  # checked against the recipe
    "algorithm.gamma": Flag("gamma"),
    "algorithm.lam": Flag("lam"),
    "algorithm.norm_adv_by_std_in_grpo": Flag("norm_adv_by_std_in_grpo"),
    "algorithm.gdpo_reward_keys": Flag("gdpo_reward_keys"),
    "algorithm.gdpo_reward_weights": Flag("gdpo_reward_weights"),
    "algorithm.use_kl_in_reward": Flag("use_kl_in_reward"),
    "algorithm.kl_penalty": Flag("kl_penalty"),
    "algorithm.kl_ctrl.type": Flag("kl_ctrl"),
    "algorithm.kl_ctrl.kl_coef": Flag("kl_coef"),
    "algorithm.kl_ctrl.target_kl": Flag("target_kl"),
    "algorithm.kl_ctrl.horizon": Flag("horizon"),
    "algorithm.rollout_correction.rollout_is": Flag("rollout_is"),
    "algorithm.rollout_correction.rollout_is_threshold": Flag("rollout_is_threshold"),
    "algorithm.rollout_correction.bypass_mode": Flag("bypass_mode"),
    "algorithm.rollout_correction.rollout_is_batch_normalize": Flag("rollout_is_batch_normalize"),
    "algorithm.rollout_correction.rollout_rs": Flag("rollout_rs"),
    "algorithm.rollout_correction.rollout_rs_threshold": Flag("rollout_rs_threshold"),
    "algorithm.rollout_correction.loss_type": Fixed(
        "ppo_clip",
        "bypass mode's loss is the clipped surrogate with ratio pi / pi_rollout; its REINFORCE form is not built",
    ),
    "algorithm.filter_groups.enable": Fixed(
        True, "dapo.py always filters groups; the other recipes never do"
    ),  # False elsewhere
    "algorithm.filter_groups.max_num_gen_batches": Flag("max_num_gen_batches"),
    # the critic (ppo.py)
    "critic.model.path": Flag("critic_model"),
    "critic.optim.lr": Flag("critic_lr"),
    "critic.cliprange_value": Flag("cliprange_value"),
    "critic.ppo_micro_batch_size_per_gpu": NoOp(MICRO),
    # rewards
    "custom_reward_function.path": Flag("reward_fn"),  # with .name: --reward-fn path:name
    "custom_reward_function.name": Flag("reward_fn"),
    "reward_model.model.path": Flag("reward_model"),
    "reward_model.enable": NoOp("a reward model is used when --reward-model is given"),
    "reward_model.reward_manager": Flag("reward_manager"),  # naive, prime, batch; dapo is dapo.py's own
    "reward_model.overlong_buffer.enable": Flag("overlong_buffer_len"),  # False: 0, off; True: dapo.py's buffer
    "reward_model.overlong_buffer.len": Flag("overlong_buffer_len"),
    "reward_model.overlong_buffer.penalty_factor": Flag("overlong_penalty_factor"),
    # the trainer
    "trainer.total_epochs": Flag("total_epochs"),
    "trainer.total_training_steps": Flag("total_training_steps"),
    "trainer.save_freq": Flag("save_freq"),
    "trainer.test_freq": Flag("test_freq"),
    "trainer.val_before_train": Flag("val_before_train"),
    "trainer.project_name": Flag("project_name"),
    "trainer.experiment_name": Flag("experiment_name"),
    "trainer.logger": Flag("logger"),
    "trainer.default_local_dir": Flag("output_dir"),
    "trainer.critic_warmup": Flag("critic_warmup"),
    "trainer.log_val_generations": Flag("log_val_generations"),
    "trainer.rollout_data_dir": Fixed(None, "every rollout's dump is not built; metrics.jsonl has each step's"),
    "trainer.validation_data_dir": Fixed(
        None, "validation's generations go to <run folder>/val_generations.jsonl (--log-val-generations N)"
    ),
    "trainer.max_actor_ckpt_to_keep": Flag("max_ckpt_to_keep"),
    "trainer.resume_mode": Flag("resume"),  # auto, disable; resume_path takes trainer.resume_from_path
    "trainer.resume_from_path": Flag("resume"),
    "trainer.seed": Flag("seed"),
    "trainer.nnodes": NoOp(LAUNCHER),
    "trainer.n_gpus_per_node": NoOp(LAUNCHER),
    "trainer.device": NoOp("the device is CUDA when there is one, else the CPU"),
    "trainer.balance_batch": NoOp("sequences are spread over processes by count, not length"),
    "trainer.default_hdfs_dir": Fixed(None, "checkpoints are written to --output-dir only"),
    "trainer.val_only": Fixed(False, "validation alone is evaluate.py (with generate.py)"),
    # keys whose default a saved config holds, classified so that none is unknown
    "data.return_full_prompt": NoOp(TOKEN_IDS),
    "data.filter_overlong_prompts_workers": Flag("data_workers"),
    "data.trust_remote_code": NoOp(TRUST),
    "data.custom_cls.name": Fixed(None, DATASET_CLASS),
    "actor_rollout_ref.model.external_libs": Fixed(None, EXTERNAL),
    "actor_rollout_ref.model.override_config.model_config": Fixed({}, OVERRIDE_CONFIG),
    "actor_rollout_ref.model.override_config.moe_config.freeze_moe_router": Fixed(
        False, "MoE router freezing is not built"
    ),
    "actor_rollout_ref.model.override_config.*": Refused(OVERRIDE_CONFIG),
    "actor_rollout_ref.model.enable_activation_offload": NoOp(
        "activation offload is not built; --gradient-checkpointing saves the activations' memory"
    ),
    ACTOR + "use_torch_compile": Flag("use_torch_compile"),
    ACTOR + "data_loader_seed": NoOp("a step's mini-batches come in its order; --seed orders the prompts"),
    ACTOR + "optim.num_cycles": Fixed(0.5, "the cosine schedule is half a cycle"),
    ACTOR + "fsdp_config.wrap_policy.min_num_params": NoOp(WRAP),
    ACTOR + "fsdp_config.fsdp_size": Fixed(-1, "FSDP shards over every process (hybrid sharding is not built)"),
    ACTOR + "checkpoint.save_contents": NoOp(CKPT),
    ACTOR + "checkpoint.load_contents": NoOp(CKPT),
    ACTOR + "checkpoint.contents": NoOp(CKPT),
    "actor_rollout_ref.ref.fsdp_config.wrap_policy.min_num_params": NoOp(WRAP),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": NoOp(MICRO),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": NoOp(MICRO),
    ROLLOUT + "log_prob_use_dynamic_bsz": NoOp(MICRO),
    ROLLOUT + "log_prob_max_token_len_per_gpu": NoOp(MICRO),
    ROLLOUT + "dtype": Flag("rollout_dtype"),
    ROLLOUT + "ignore_eos": Fixed(False, EOS),
    ROLLOUT + "do_sample": Fixed(True, "training always samples; greedy validation is val_kwargs.do_sample=False"),
    ROLLOUT + "engine_kwargs.vllm.swap_space": Fixed(None, ENGINE_KWARGS),
    ROLLOUT + "engine_kwargs.swap_space": Fixed(None, ENGINE_KWARGS),
    ROLLOUT + "engine_kwargs.sglang.*": NoOp("SGLang is not an engine here (rollout.name=sglang is refused)"),
    ROLLOUT + "engine_kwargs.*": Refused(ENGINE_KWARGS),
    ROLLOUT + "multi_turn": NoOp(AGENT_LOOP),
    ROLLOUT + "tool_kwargs.tools_config_file": Flag("tool_config"),
    ROLLOUT + "interaction_config_file": Flag("interaction_config"),
    "critic.strategy": NoOp(STRATEGY),
    "critic.ppo_epochs": Fixed(1, "the critic updates with the actor's --ppo-epochs"),  # the actor's, in translate
    "critic.grad_clip": Fixed(1.0, "the critic's gradients are clipped at the actor's --grad-clip"),  # likewise
    "reward_model.strategy": NoOp(REWARD_WHOLE),
    "reward_model.model.input_tokenizer": NoOp(
        "the reward model re-renders the decoded conversation with its own tokenizer"
    ),
    "reward_model.model.external_lib": Fixed(None, EXTERNAL),
    "reward_model.model.trust_remote_code": NoOp(TRUST),
    "reward_model.model.fsdp_config.min_num_params": NoOp(REWARD_WHOLE),
    "reward_model.model.fsdp_config.param_offload": NoOp(REWARD_WHOLE),
    "reward_model.micro_batch_size_per_gpu": NoOp(MICRO),
    "reward_model.max_length": Fixed(None, "the reward model reads the whole prompt and response"),
    "custom_reward_function.reward_kwargs.*": Refused(
        "keyword arguments for the reward function are not passed; give them defaults in its file"
    ),
    "trainer.remove_previous_ckpt_in_save": Fixed(
        False, "trainer.max_actor_ckpt_to_keep (--max-ckpt-to-keep) prunes old checkpoints"
    ),
    "trainer.del_local_ckpt_after_load": Fixed(False, "a checkpoint is never deleted after it is loaded"),
    "trainer.ray_wait_register_center_timeout": NoOp("no Ray workers train here"),
    "trainer.profile_steps": Fixed(None, "the profiler hooks are not built; bench/ measures speed"),
    "actor_rollout_ref.profiler.*": NoOp("the profiler's settings act only with trainer.profile_steps"),
    "trainer.controller_nsight_options.*": NoOp("Nsight options act only with trainer.profile_steps"),
    "hydra.*": NoOp("Hydra's own settings (search path, run folder); the config is composed here from --config-path"),
    "ray_init.num_cpus": NoOp("Ray starts only for remote engines (--rollout-placement remote, --ray-address)"),
    "ray_init.timeline_json_file": Fixed(None, "Ray's timeline is not written"),
    # verl's main_generation (generate.py) and main_eval (evaluate.py)
    "data.path": Flag("data_path"),
    "data.n_samples": Flag("n_samples"),
    "data.output_path": Flag("output_path"),
    "data.batch_size": Flag("batch_size"),
    "data.data_source_key": Flag("data_source_key"),
    "data.reward_model_key": Flag("reward_model_key"),
    "model.path": Flag("model"),
    "rollout.name": Flag("rollout_name"),
    "rollout.temperature": Flag("temperature"),
    "rollout.top_k": Flag("top_k"),
    "rollout.top_p": Flag("top_p"),
    "rollout.do_sample": Flag("do_sample"),
    "rollout.prompt_length": Flag("max_prompt_length"),
    "rollout.response_length": Flag("max_response_length"),
    "rollout.dtype": Flag("dtype"),
    "rollout.gpu_memory_utilization": Flag("gpu_memory_utilization"),
    "rollout.enforce_eager": Flag("enforce_eager"),
    "rollout.max_num_seqs": Flag("max_num_seqs"),
    "rollout.max_num_batched_tokens": Flag("max_num_batched_tokens"),
    "rollout.tensor_model_parallel_size": Flag("tensor_parallel_size"),
    "rollout.free_cache_engine": Flag("enable_sleep_mode"),
    "rollout.ignore_eos": Fixed(False, EOS),
    "rollout.load_format": NoOp("the engine loads the model folder it is given"),
    "rollout.mode": NoOp("the engine is called in-process"),
    "rollout.n": Fixed(1, "generate.py samples data.n_samples responses per prompt"),
    "rollout.enable_chunked_prefill": NoOp("vLLM's default (chunked prefill on) is kept"),
    "rollout.disable_log_stats": NoOp("generate.py logs no vLLM stats"),
    "rollout.calculate_log_probs": NoOp("generate.py writes the responses, not their logprobs"),
    "rollout.log_prob_micro_batch_size_per_gpu": NoOp(MICRO),
    # generation.yaml's actor block configures a trainer main_generation never builds
    **{
        "actor." + key: NoOp("generate.py trains nothing: verl's generation.yaml carries the actor's keys unread")
        for key in (
            "strategy",
            "ulysses_sequence_parallel_size",
            "entropy_from_logits_with_chunking",
            "entropy_checkpointing",
            "fsdp_config.fsdp_size",
            "fsdp_config.forward_prefetch",
        )
    },
    "model.fsdp_config.model_dtype": Flag("dtype"),
    "model.fsdp_config.wrap_policy.min_num_params": NoOp(WRAP),
    "model.fsdp_config.cpu_offload": NoOp(OFFLOAD),
    "model.fsdp_config.offload_params": NoOp(OFFLOAD),
}

# verl's defaults (its trainer configs, as the guides list them) for the keys that change what a run
# does and where this library's default differs: a verl command means them for every key it leaves
# out, so they apply whenever a command has verl keys, unless our own flag sets the same thing.
# Paths (model, data, output) and where things run (engine, logger) keep this library's defaults.
VERL_DEFAULTS: dict[str, dict[str, object]] = {
    "ppo": {
        "data.max_prompt_length": 512,
        "data.max_response_length": 512,
        "data.train_batch_size": 1024,
        ACTOR + "ppo_mini_batch_size": 256,
        ACTOR + "optim.lr": 1e-6,
        ACTOR + "optim.warmup_style": "constant",
        ROLLOUT + "n": 1,
        "trainer.total_epochs": 30,
        "trainer.save_freq": -1,  # never: verl saves only when asked
        "trainer.total_training_steps": None,  # verl's null: total_epochs passes over the data decide
        "critic.optim.lr": 1e-5,
        "algorithm.use_kl_in_reward": False,
        "algorithm.kl_ctrl.kl_coef": 0.001,
        "reward_model.overlong_buffer.enable": False,  # not the guides': verl's DAPO config (dapo.py reads it alone)
    },
    "sft": {
        "optim.lr": 1e-5,
        "optim.weight_decay": 0.01,
        "optim.warmup_steps_ratio": 0.1,
        # not in the guides: verl's sft_trainer.yaml (this library's own defaults fit the bundled task)
        "optim.betas": [0.9, 0.95],
        "data.train_batch_size": 256,
        "data.micro_batch_size_per_gpu": 4,
        "data.max_length": 1024,
        "data.truncation": "error",
        "trainer.total_epochs": 4,
        "trainer.total_training_steps": None,
        "trainer.save_freq": -1,
        "trainer.test_freq": -1,
    },
}

OVERRIDE = re.compile(  # dotted, or one of the top-level keys of verl's sft_trainer.yaml
    r"^\+{0,2}([A-Za-z_][\w-]*(?:\.[\w-]+)+|use_remove_padding|ulysses_sequence_parallel_size)=(.*)$", re.DOTALL
)


# critic keys whose value is the actor's here: (our flag, the actor's verl keys)
SHARED_WITH_ACTOR = {
    "critic.ppo_epochs": ("ppo_epochs", [ACTOR + "ppo_epochs"]),
    "critic.grad_clip": ("grad_clip", [ACTOR + "grad_clip", ACTOR + "optim.clip_grad"]),
}


def lookup(key: str):
    """The table's entry for key: its own, else that of the longest `prefix.*` at or above it, else None."""
    if key in VERL_KEYS:
        return VERL_KEYS[key]
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        entry = VERL_KEYS.get(".".join(parts[:n]) + ".*")
        if entry is not None:
            return entry
    return None


def is_override(arg: str) -> bool:
    """A verl `key=value` argument (Hydra's `+key=` and `++key=` included); our flags start with --."""
    return OVERRIDE.match(arg) is not None


def parse_value(text: str):
    """A Hydra value as verl's scripts write it: [a,b] a list, {} an empty mapping, null/None/~ None, true/false
    a bool, anything else the text (quotes removed)."""
    text = text.strip()
    if text == "{}":
        return {}
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        return [parse_value(item) for item in inner.split(",")] if inner else []
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.lower() in ("null", "none", "~"):
        return None
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def _same(given, expected) -> bool:
    if isinstance(expected, bool) or isinstance(given, bool):
        return given == expected
    try:
        return float(given) == float(expected)
    except (TypeError, ValueError):
        return str(given) == str(expected)


def _given(argv: list[str], field: str) -> list[str]:
    """Our own flag's tokens on the command line (the last time it is given): [--x, values...], [--x] or [--no-x]."""
    flag, found = "--" + field.replace("_", "-"), []
    for i, arg in enumerate(argv):
        if arg in (flag, "--no-" + flag[2:]):
            found = [arg, *itertools.takewhile(lambda a: not a.startswith("--"), argv[i + 1 :])]
        elif arg.startswith(flag + "="):
            found = [flag, arg.split("=", 1)[1]]
    return found


def _vllm(ours: list[str], overrides: dict) -> bool:
    """Whether the run's engine is vLLM, by our flag or verl's key."""
    named = overrides.get(ROLLOUT + "name") or overrides.get("rollout.name") or (None, "hf")  # generation.yaml's
    return (_given(ours, "rollout_name")[1:] or [named[1]]) == ["vllm"]


def _own_weights(ours: list[str], overrides: dict) -> bool:
    """Whether the run's engine holds weights of its own (vLLM, or remote engines), by our flags or verl's key."""
    return _vllm(ours, overrides) or _given(ours, "rollout_placement")[1:] == ["remote"]


def _agree(a: list[str], b: list[str]) -> bool:
    """Whether two settings of one flag, as tokens, say the same: a switch's form, then each value (1e-6 is 0.000001,
    True is true)."""

    def plain(token: str) -> str:
        return token.lower() if token.lower() in ("true", "false") else token

    return len(a) == len(b) and a[0] == b[0] and all(_same(plain(x), plain(y)) for x, y in zip(a[1:], b[1:]))


def _is_bool(kind) -> bool:
    return kind is bool or kind == "bool"


def _tokens(field: str, kind, value) -> list[str]:
    flag = "--" + field.replace("_", "-")
    if _is_bool(kind):
        if not isinstance(value, bool):
            raise ValueError(f"true or false, not {value!r}")
        return [flag] if value else ["--no-" + field.replace("_", "-")]
    if value is None:
        return [flag, "None"]
    if isinstance(value, list):
        return [flag, *(str(v) for v in value)]
    return [flag, str(value)]


def translate(
    argv: list[str],
    args_class,
    adv_estimator: str | None,
    recipe: str,
    config: dict | None = None,
    source: str = "",
    trainer: str | None = None,
    origins: dict[str, str] | None = None,
    loss_mode: str = "vanilla",
) -> tuple[list[str], list[str]]:
    """(argv with every verl key replaced by our flags, the lines to say). `config` holds the
    dotted keys of a --verl-config file (read from `source`); the command line's keys win over
    it, and our own flags over both. `trainer` ("ppo", "sft" or None) names the VERL_DEFAULTS that
    fill the keys left out; `origins`, when given, gets each flag set from a verl key: the key as
    the user gave it (or the default), for usage errors to name (common.errors). Raises one UsageError naming every key that is unknown, refused, fixed
    to another value, or sets a flag `recipe` does not have, and an algorithm.adv_estimator that is
    not this recipe's (an actor.policy_loss.loss_mode likewise: `loss_mode` is the recipe's)."""
    fields, defaults = flag_types(args_class), flag_defaults(args_class)  # a group's flags (--lr) too
    ours, overrides = [], {key: (f"{source}: {key}={value}", value) for key, value in (config or {}).items()}
    filed = {arg for arg, _ in overrides.values()}  # a config file's settings: the command line's win over them
    for arg in argv:
        match = OVERRIDE.match(arg)
        if match is None:
            ours.append(arg)
        else:
            overrides[match.group(1)] = (arg, parse_value(match.group(2)))
    if not overrides:
        return argv, []
    given = {
        a.split("=", 1)[0].removeprefix("--").removeprefix("no-").replace("-", "_") for a in ours if a.startswith("--")
    }
    unread = _unread_by_verl(overrides, adv_estimator, loss_mode, fields)
    flags, noops, problems, origin, overridden, differs = {}, [], [], {}, [], []
    for key, (arg, value) in overrides.items():
        entry = lookup(key)
        if key in unread:
            noops.append(f"{key} ({unread[key]})")
            continue
        if entry is None:
            problems.append(f"{arg}: not a verl key this library reads")
            continue
        if value == {} and isinstance(entry, (Refused, NoOp)):  # verl's empty section (engine_kwargs.vllm: {})
            noops.append(f"{key} (empty: it sets nothing)")
            continue
        if isinstance(entry, Refused):
            problems.append(f"{arg}: not supported here: {entry.why}")
            continue
        if key in ("critic.ppo_epochs", "critic.grad_clip"):  # the actor's setting, which the critic shares
            field = entry.why.split("--")[-1].replace("-", "_")
            named = (
                [ACTOR + "ppo_epochs"] if field == "ppo_epochs" else [ACTOR + "grad_clip", ACTOR + "optim.clip_grad"]
            )
            actor = next((overrides[k] for k in named if k in overrides), (None, defaults.get(field)))[1]
            entry = Fixed(actor, entry.why)
        if key == "algorithm.filter_groups.enable":
            entry = Fixed("max_num_gen_batches" in fields, entry.why)  # True only in dapo.py
        if isinstance(entry, Fixed):
            if not _same(value, entry.value):
                problems.append(f"{arg}: only {key}={entry.value} is supported here: {entry.why}")
            else:
                noops.append(key)
            continue
        if key in OFFLOAD_KEYS and value is True and not env_flag("FSDP_OFFLOAD_PARAMS"):  # the launch's offload
            problems.append(
                f"{arg}: CPU offload here is the launch's: accelerate launch --config_file "
                f"configs/fsdp2_offload.yaml (or FSDP_OFFLOAD_PARAMS=true torchrun), which keeps "
                f"parameters, gradients and the optimizer step of every model in CPU memory"
            )
            continue
        if key.endswith("strategy") and value == "megatron":
            problems.append(
                f"{arg}: Megatron is not built here; FSDP2 shards the model (--strategy fsdp2, or an "
                f"accelerate FSDP config: configs/fsdp2.yaml)"
            )
            continue
        if isinstance(entry, NoOp):
            if key == "algorithm.adv_estimator":
                problem = _check_estimator(arg, value, adv_estimator, recipe)
                if problem:
                    problems.append(problem)
                    continue
                if value == "reinforce_plus_plus_baseline":
                    flags["group_baseline"] = ["--group-baseline"]
                    continue
            if key == ACTOR + "policy_loss.loss_mode":
                problem = _check_loss_mode(arg, value, loss_mode, recipe)
                if problem:
                    problems.append(problem)
                    continue
                mine = _given(ours, "loss_mode") if "loss_mode" in given else None
                if mine and mine[1:] != [str(value)]:  # --loss-mode dppo_kl beside loss_mode=dppo_tv
                    problems.append(
                        f"{arg} and {' '.join(mine)} both set --loss-mode, to different values ({value} and "
                        f"{' '.join(mine[1:])}); keep one"
                    )
                    continue
                if value != loss_mode and not mine:  # the recipe's other loss (cov.py's kl_cov, dppo.py's dppo_kl)
                    flags["loss_mode"] = ["--loss-mode", value]
                    continue
            noops.append(key)
            continue
        field = entry.flag
        if field == "rollout_dtype" and not _own_weights(ours, overrides):  # verl's HF rollout runs in the policy's
            noops.append(f"{key} (the HF engine runs in the policy's dtype, --dtype)")
            continue
        if field == "tensor_parallel_size" and not _vllm(ours, overrides) and value not in (1, "1"):
            noops.append(f"{key} (the HF engine generates unsharded, on each trainer process; only vLLM shards)")
            continue
        if field not in fields and value in (False, None, "0", "0.0", 0):
            noops.append(key)  # switched off, and this recipe has nothing of it to switch
            continue
        if field not in fields:
            problems.append(f"{arg}: it sets --{field.replace('_', '-')}, which {recipe} does not have")
            continue
        if key == "reward_model.reward_manager" and value == "dapo":
            if "overlong_buffer_len" not in fields:
                problems.append(f"{arg}: the dapo reward manager's overlong penalty is dapo.py's; run recipes/dapo.py")
                continue
            value = "naive"  # dapo.py applies the overlong buffer to each sample's score itself
        try:
            value = _special(key, value, overrides)
            tokens = None if value is _SKIP else _tokens(field, fields[field], value)
        except (UsageError, ValueError) as e:
            problems.append(f"{arg}: {e}")
            continue
        if tokens is None:
            continue
        if field in DIFFERS:
            differs.append(f"{key} ({DIFFERS[field]})")
        # Two settings of one flag: equal ones are one setting; the command line (our flag or a verl key) wins over a
        # config file, as in Hydra; any other two that differ are refused, naming both.
        other = _given(ours, field) if field in given else flags.get(field)
        other_filed = field not in given and origin.get(field) in filed
        said_by = " ".join(other or ()) if field in given else origin.get(field)
        if other is None:
            flags[field], origin[field] = tokens, arg
        elif _agree(tokens, other):
            pass
        elif other_filed and arg not in filed:  # the command line's verl key replaces the file's
            overridden.append(f"{said_by} (by {arg})")
            flags[field], origin[field] = tokens, arg
        elif arg in filed and not other_filed:  # the file's setting under the command line's
            overridden.append(f"{arg} (by {said_by})")
        else:
            problems.append(
                f"{arg} and {said_by} both set --{field.replace('_', '-')}, to different values "
                f"({' '.join(tokens[1:]) or tokens[0]} and {' '.join(other[1:]) or other[0]}); keep one"
            )
    if problems:
        head = (
            "a verl key cannot be run here" if len(problems) == 1 else f"{len(problems)} verl keys cannot be run here"
        )
        raise UsageError(f'{head} (docs/configuration.md, "Coming from verl"):\n  ' + "\n  ".join(problems))
    # verl's val_kwargs.do_sample=False is greedy validation, whatever the temperature says
    if overrides.get(ROLLOUT + "val_kwargs.do_sample", (None, None))[1] is False and "val_temperature" not in given:
        flags["val_temperature"] = ["--val-temperature", "0"]
    defaulted = []
    for key, value in VERL_DEFAULTS.get(trainer, {}).items():
        field = VERL_KEYS[key].flag
        if key in overrides or field not in fields or field in given or field in flags:
            continue
        if key in _unread_by_verl({**overrides, key: (key, value)}, adv_estimator, loss_mode):
            continue  # verl would not read it either (the critic's lr without GAE, ...)
        flags[field] = _tokens(field, fields[field], _special(key, value, overrides))
        defaulted.append(f"{key}={value}")
        origin[field] = f"verl's default {key}={value}, a key this command leaves out"
    if origins is not None:
        origins.update(origin)
    said = []
    if defaulted:
        said.append("verl's defaults for the keys this command leaves out: " + ", ".join(defaulted))
    if noops:
        said.append("verl keys read, with nothing to change here: " + ", ".join(noops))
    if overridden:
        said.append("verl config keys the command line overrides: " + "; ".join(overridden))
    if differs:
        said.append("verl keys whose meaning here differs in a detail (docs/configuration.md): " + "; ".join(differs))
    return [token for tokens in flags.values() for token in tokens] + ours, said


def _unread_by_verl(overrides: dict, adv_estimator: str | None, loss_mode: str = "vanilla", fields=()) -> dict:
    """Keys verl itself does not read in this run, with why: the critic without GAE, the reward
    model's section unless reward_model.enable=True, the in-reward KL controller unless
    algorithm.use_kl_in_reward=True (both False by verl's default), another loss's knobs (READ_BY),
    main_eval's prompt key (`fields`: the script's flags, evaluate.py's responses without prompts).
    A verl config file holds every section whatever the run."""
    value = {key: v for key, (_, v) in overrides.items()}
    mode = value.get(ACTOR + "policy_loss.loss_mode", loss_mode)
    unread = {}
    for key in value:
        knob = key.removeprefix(ACTOR).removeprefix("policy_loss.")
        if key.startswith(ACTOR) and knob in READ_BY and mode not in READ_BY[knob]:
            unread[key] = f"verl's {mode} loss does not read it"
        elif (key.startswith("critic.") or key == "trainer.critic_warmup") and adv_estimator != "gae":
            unread[key] = "verl reads the critic only with adv_estimator=gae"
        elif key in ("algorithm.gamma", "algorithm.lam") and adv_estimator in ("grpo", "rloo"):
            unread[key] = f"verl's {adv_estimator} does not discount"
        elif key == "data.prompt_key" and "response_key" in fields and "prompt_key" not in fields:
            unread[key] = "verl's main_eval scores the responses column; it reads no prompts"
        elif key.startswith("algorithm.gdpo_") and adv_estimator != "gdpo":
            unread[key] = "verl reads it only with adv_estimator=gdpo"
        elif key == "algorithm.norm_adv_by_std_in_grpo" and adv_estimator not in ("grpo", "grpo_passk"):
            unread[key] = "verl reads it only with adv_estimator=grpo or grpo_passk"
        elif key.startswith("reward_model.model.") or key in (
            "reward_model.micro_batch_size_per_gpu",
            "reward_model.max_length",
        ):
            if value.get("reward_model.enable") is not True:
                unread[key] = "verl reads it only with reward_model.enable=True"
        elif key.startswith("algorithm.kl_ctrl.") or key == "algorithm.kl_penalty":
            if value.get("algorithm.use_kl_in_reward") is not True:
                unread[key] = "verl reads it only with algorithm.use_kl_in_reward=True"
        elif key in ("reward_model.overlong_buffer.len", "reward_model.overlong_buffer.penalty_factor"):
            if value.get("reward_model.overlong_buffer.enable") is not True:  # verl's default is False
                unread[key] = "verl reads it only with reward_model.overlong_buffer.enable=True"
    return unread


_SKIP = object()


def _special(key: str, value, overrides: dict):
    """The keys that are not one value for one flag: do_sample, the reward function's path and
    name, and verl's resume mode with its path."""
    if key == ROLLOUT + "val_kwargs.do_sample":
        if not isinstance(value, bool):
            raise UsageError("true or false")
        return _SKIP  # False is greedy, set after the loop; True follows from val_kwargs.temperature > 0
    if key == "custom_reward_function.name":
        if "custom_reward_function.path" not in overrides:
            raise UsageError("give custom_reward_function.path as well")
        return _SKIP  # read with the path (a null path: the built-in scorers, whatever the name)
    if key == "custom_reward_function.path" and value is None:
        return _SKIP  # no custom reward function: the built-in scorers
    if key == "custom_reward_function.path":
        name = overrides.get("custom_reward_function.name", (None, "compute_score"))[1]
        return f"{value}:{name}"
    if key == "reward_model.overlong_buffer.enable":  # off is a buffer of 0; on keeps the buffer's own setting
        return 0 if value is False else _SKIP
    if key == "trainer.critic_warmup":  # verl's actor first updates at its step N (counted from 1): N - 1 alone
        return max(0, int(value) - 1)
    if key == "trainer.max_actor_ckpt_to_keep" and value is None:
        return 0  # verl's null keeps every checkpoint: --max-ckpt-to-keep 0
    if key.endswith("fsdp_config.model_dtype") or key == ROLLOUT + "dtype":
        return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(value, value)
    if key == "trainer.resume_from_path" and overrides.get("trainer.resume_mode", (None, "auto"))[1] != "resume_path":
        return _SKIP  # verl reads the path only with resume_mode=resume_path
    if key == "trainer.resume_mode":
        if value == "resume_path":
            if "trainer.resume_from_path" not in overrides:
                raise UsageError("give trainer.resume_from_path as well")
            return _SKIP
        return value
    return value


# The recipe that runs each of verl's advantage estimators (algorithm.adv_estimator) and policy losses
# (actor_rollout_ref.actor.policy_loss.loss_mode) built here; a recipe names its own in common.config.cli_args.
ESTIMATORS = {"grpo": "grpo.py (or a fork of it: dapo.py, gspo.py, cispo.py, sapo.py, ...)", "rloo": "rloo.py",
              "reinforce_plus_plus": "reinforce_pp.py", "reinforce_plus_plus_baseline": "reinforce_pp.py",
              "gae": "ppo.py", "gpg": "gpg.py", "opo": "opo.py", "grpo_passk": "grpo_passk.py",
              "remax": "remax.py", "gdpo": "gdpo.py", "optimal_token_baseline": "otb.py",
              "tir_optimal_token_baseline": "otb.py"}  # fmt: skip
LOSS_MODES = {"vanilla": "grpo.py (or rloo.py, reinforce_pp.py, ppo.py, dapo.py, opo.py, otb.py, grpo_passk.py, ...)",
              "gspo": "gspo.py", "cispo": "cispo.py", "sapo": "sapo.py", "geo_mean": "gmpo.py", "clip_cov": "clip_cov.py",
              "kl_cov": "kl_cov.py", "dppo_tv": "dppo.py", "dppo_kl": "dppo.py", "dro": "dro.py", "gpg": "gpg.py"}  # fmt: skip
# The policy-loss knobs, and verl's loss modes that read them: another mode leaves them unread (a verl config file
# holds them all).
CLIPPED = ("vanilla", "gspo", "cispo", "geo_mean", "clip_cov", "dppo_tv", "dppo_kl")
READ_BY = {
    "clip_ratio": CLIPPED,
    "clip_ratio_low": CLIPPED,
    "clip_ratio_high": CLIPPED,
    "clip_ratio_c": ("vanilla", "gspo", "dppo_tv", "dppo_kl"),
    "tau_pos": ("sapo",),
    "tau_neg": ("sapo",),
    "clip_cov_ratio": ("clip_cov",),
    "clip_cov_lb": ("clip_cov",),
    "clip_cov_ub": ("clip_cov",),
    "kl_cov_ratio": ("kl_cov",),
    "ppo_kl_coef": ("kl_cov",),
    "dro_beta": ("dro",),
}


def _check_estimator(arg: str, value, adv_estimator: str | None, recipe: str) -> str | None:
    if value not in ESTIMATORS:
        return f"{arg}: not an estimator built here (built: {', '.join(ESTIMATORS)})"
    if ESTIMATORS[value] != ESTIMATORS.get(adv_estimator):
        return f"{arg}: {recipe} does not run that estimator; run recipes/{ESTIMATORS[value].split()[0]} with the same arguments"
    return None


def _check_loss_mode(arg: str, value, loss_mode: str, recipe: str) -> str | None:
    if value not in LOSS_MODES:
        return f"{arg}: not a policy loss built here (built: {', '.join(LOSS_MODES)})"
    if LOSS_MODES[value] != LOSS_MODES[loss_mode]:
        return f"{arg}: {recipe} does not compute that loss; run recipes/{LOSS_MODES[value].split()[0]} with the same arguments"
    return None


def read_verl_config(path: str) -> dict:
    """The dotted keys of a verl config file (YAML, nested as verl's trainer configs are; a run's
    saved config too), with `${a.b}` references to other keys resolved."""
    return _flatten(_load_yaml(Path(path), f"--verl-config {path}"), f"--verl-config {path}")


# verl's own configs a user's Hydra config may name in its defaults list (they live in verl's
# package, found through hydra.searchpath): the keys they hold are verl's defaults, which the keys a
# config leaves out take here anyway (VERL_DEFAULTS); the trainer whose defaults they are.
VERL_BASE_CONFIGS = {"ppo_trainer": "ppo", "sft_trainer": "sft", "generation": None, "evaluation": None}


def compose_hydra_config(config_path: str, config_name: str, trainer: str | None) -> dict:
    """The dotted keys of verl's Hydra launch `--config-path DIR --config-name NAME`: DIR/NAME.yaml
    composed with its `defaults:` list as Hydra does (each entry in order, the file's own keys where
    `_self_` stands, else last; later entries win). An entry that is another file of DIR is read;
    verl's own base config (ppo_trainer, ...) adds nothing, its keys being verl's defaults; a config
    group or anything else is refused. `hydra:` settings become hydra.* keys (read, no effect)."""
    where = Path(config_path or ".")
    flag = f"--config-path {config_path} --config-name {config_name}"

    def compose(name: str, seen: tuple) -> dict:
        if name in seen:
            raise UsageError(f"{flag}: the defaults lists name {name} in a circle ({' -> '.join((*seen, name))})")
        file = where / (name if name.endswith(".yaml") else f"{name}.yaml")
        if not file.is_file() and name in VERL_BASE_CONFIGS:
            if VERL_BASE_CONFIGS[name] != trainer:
                raise UsageError(f"{flag}: {name} is verl's config for another entry point than this script")
            return {}
        if not file.is_file():
            raise UsageError(f"{flag}: no file {file} (a defaults entry or the config itself)")
        tree = _load_yaml(file, flag)
        defaults = tree.pop("defaults", [])
        if not isinstance(defaults, list):
            raise UsageError(f"{flag}: {file}: defaults must be a list")
        parts, has_self = [], "_self_" in defaults
        for entry in defaults:
            if entry == "_self_":
                parts.append(tree)
            elif isinstance(entry, str):
                parts.append(compose(entry.removeprefix("optional "), (*seen, name)))
            else:
                raise UsageError(
                    f"{flag}: {file}: defaults entry {entry!r}: config groups are not composed here; "
                    "name verl's base config (ppo_trainer) and your own files of the same folder"
                )
        merged = {}
        for part in parts if has_self else [*parts, tree]:
            _merge(merged, part)
        return merged

    return _flatten(compose(config_name, ()), flag)


def _merge(into: dict, tree: dict) -> None:
    for key, value in tree.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _load_yaml(file: Path, flag: str) -> dict:
    try:
        tree = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"{flag}: {file} cannot be read as YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(tree, dict):
        raise UsageError(f"{flag}: {file} is not a mapping of verl's config sections (data, actor_rollout_ref, ...)")
    return tree


def _flatten(tree: dict, flag: str) -> dict:
    """Dotted keys, with `${a.b}` references to other keys resolved (inside longer text too)."""
    flat = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = node

    walk("", tree)

    def resolve(key: str, value, seen: tuple = ()):
        if not isinstance(value, str) or "${" not in value:
            return value
        for ref in re.findall(r"\$\{([^}]*)\}", value):
            if ref not in flat or ref in seen:
                raise UsageError(f"{flag}: {key}={value}: ${{{ref}}} names no key of the config")
        whole = re.fullmatch(r"\$\{([^}]*)\}", value)
        if whole:
            return resolve(whole.group(1), flat[whole.group(1)], (*seen, key))
        return re.sub(r"\$\{([^}]*)\}", lambda m: str(resolve(m.group(1), flat[m.group(1)], (*seen, key))), value)

    return {key: resolve(key, value) for key, value in flat.items()}


def verl_args(
    args_class,
    adv_estimator: str | None = None,
    argv: list[str] | None = None,
    trainer: str | None = None,
    loss_mode: str = "vanilla",
) -> list[str]:
    """The argument list tyro should read: sys.argv[1:] with verl's key=value arguments and a
    verl config translated (what was read without effect and verl's defaults applied, said on
    rank 0). The config is a file (--verl-config FILE) or Hydra's launch of one
    (--config-path DIR --config-name NAME, as verl's example scripts start main_ppo). `trainer`
    picks the defaults: "ppo" (the default for a recipe with an adv_estimator), "sft", or None
    (generate.py, evaluate.py). --print-verl-translation prints the translated command and exits."""
    trainer = trainer or ("ppo" if adv_estimator else None)
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe = os.path.basename(sys.argv[0]) or "this recipe"
    show = "--print-verl-translation" in argv
    argv = [a for a in argv if a != "--print-verl-translation"]
    file, argv = _take(argv, "--verl-config")
    config_path, argv = _take(argv, "--config-path", "-cp")
    config_name, argv = _take(argv, "--config-name", "-cn")
    config, source = None, ""
    if file is not None and (config_path or config_name) is not None:
        raise UsageError("give --verl-config FILE or Hydra's --config-path / --config-name, not both")
    if file is not None:
        config, source = read_verl_config(file), file
    elif config_name is not None:
        config, source = compose_hydra_config(config_path, config_name, trainer), f"--config-name {config_name}"
    elif config_path is not None:
        raise UsageError("--config-path: give --config-name as well (the config file of that folder, without .yaml)")
    ORIGINS.clear()
    translated, said = translate(argv, args_class, adv_estimator, recipe, config, source, trainer, ORIGINS, loss_mode)
    if show:
        print(shlex.join(["python", sys.argv[0], *translated]))
        raise SystemExit(0)
    if os.environ.get("RANK", "0") == "0":
        for line in said:
            print(line, file=sys.stderr)
    return translated


def _take(argv: list[str], *names: str) -> tuple[str | None, list[str]]:
    """(the value of the flag `names` spell, as `--x value` or `--x=value`; argv without it)."""
    for i, arg in enumerate(argv):
        name = arg.split("=", 1)[0]
        if name in names:
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            if not value or value.startswith("-"):
                raise UsageError(f"{names[0]}: give a value")
            return value, argv[:i] + argv[i + (1 if "=" in arg else 2) :]
    return None, argv


def refuse_longer_run(total_epochs: int, steps_per_epoch: int, steps: int) -> None:
    """trainer.total_training_steps past trainer.total_epochs' steps: verl stops at whichever ends first, so a verl
    command that trained `steps` here would train longer than it does in verl; refused, saying both ways out."""
    epochs = total_epochs * steps_per_epoch
    raise UsageError(
        f"{ORIGINS['total_training_steps']}: verl would stop after {total_epochs} epochs "
        f"({ORIGINS.get('total_epochs', '--total-epochs')}), {epochs} steps of {steps_per_epoch}, and here "
        f"it would train all {steps}; give trainer.total_training_steps={epochs}, or trainer.total_epochs="
        f"{-(-steps // max(1, steps_per_epoch))} for all {steps}"
    )
