"""grpo.py beyond what tests/test_rl_recipes.py checks for every RL recipe: parameters all move,
the shared-prompt forward under DDP / FSDP2, verl-style reward files, timeouts, options, reward model."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import ROOT, load_recipe_refusing_models, make_args, read_metrics, run_recipe, torchrun_plan
from safetensors.torch import load_file

from common.scoring import extract_answer_tag

SFT = ROOT / "bundled" / "tiny-qwen2-sft"
FAST = "--train-batch-size 8 --ppo-mini-batch-size 8 --rollout-n 4 --micro-batch-size-per-gpu 16 --save-freq 0 --no-val-before-train"


def grpo(out, small_files, flags="", **kw):
    return run_recipe("grpo", "--output-dir", out, *small_files, "--resume", "disable", *flags.split(), **kw)


def test_every_trainable_parameter_changes(tmp_path, small_files):
    out = tmp_path / "params"
    grpo(out, small_files, f"{FAST} --total-training-steps 2 --test-freq 0 --save-freq 2 --weight-decay 0 --lr 1e-3")
    before = load_file(SFT / "model.safetensors")
    after = load_file(out / "checkpoints" / "step_2" / "hf" / "model.safetensors")
    assert set(before) == set(after)
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged, unchanged


def two_process_flags(strategy: str) -> str:
    flags = f"{FAST} --strategy {strategy} --use-kl-loss --resume disable"
    if strategy == "fsdp2":  # ranks must agree on the micro-batch count and on the forward calls in each
        flags += " --use-dynamic-bsz --ppo-max-token-len-per-gpu 150"
    return flags


@torchrun_plan
def two_process_plan(folder, fixture):
    """Under DDP and FSDP2 with 2 processes: 2 steps with validation, generations logged and a
    checkpoint, and 1 step with one forward pass per sequence."""
    runs = {}
    for strategy in ("ddp", "fsdp2"):
        flags = two_process_flags(strategy)
        runs[strategy] = f"{flags} --total-training-steps 2 --test-freq 2 --save-freq 2 --log-val-generations 40"
        runs[f"{strategy}-plain"] = f"{flags} --total-training-steps 1 --test-freq 0 --no-shared-prompt-forward"
    runs["fsdp2-packed"] = (
        f"{two_process_flags('fsdp2')} --total-training-steps 1 --test-freq 0 --use-remove-padding True"
    )
    return {
        name: ("grpo", ["--output-dir", folder / name, *fixture("small_files"), *flags.split()])
        for name, flags in runs.items()
    }


@pytest.fixture(scope="module")
def two_process_runs(torchrun_runs):
    """{name: (run folder, exit status)} of two_process_plan's runs."""
    folder, codes = torchrun_runs[__name__]
    return {name: (folder / name, code) for name, code in codes.items()}


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes(two_process_runs, small_val, strategy):
    (out, code), (plain, plain_code) = two_process_runs[strategy], two_process_runs[f"{strategy}-plain"]
    assert code == 0 and plain_code == 0, (code, plain_code)
    run = json.loads((out / "config.json").read_text())["run"]
    assert run["world_size"] == 2 and run["strategy"] == strategy
    if strategy == "fsdp2":
        assert all(n < 0.6 * run["params_full"] for n in run["params_local_per_rank"])
    last = read_metrics(out)[-1]
    assert "val/accuracy" in last and last["policy/kl_ref"] >= 0
    assert (out / "checkpoints" / "step_2" / "hf" / "model.safetensors").is_file()
    # The first 40 validation rows in file order: rank 0 holds 32 of them, rank 1 the other 8.
    logged = [json.loads(line) for line in (out / "val_generations.jsonl").read_text().splitlines()]
    questions = [r["extra_info"]["question"] for r in pq.read_table(small_val).to_pylist()[:40]]
    assert [g["step"] for g in logged] == [2] * 40
    assert all(q in g["prompt"] for q, g in zip(questions, logged))
    assert all(g["score"] == float(extract_answer_tag(g["response"]) == g["ground_truth"]) for g in logged)
    # The shared-prompt forward calls the wrapped model twice per micro-batch; gradient sync must
    # still give what one pass per sequence gives (same seed, so the same samples at step 1).
    a, b = read_metrics(out)[0], read_metrics(plain)[0]
    assert a["reward/mean"] == b["reward/mean"]
    assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)
    assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-7)
    if strategy == "fsdp2":  # padding-free: one packed forward per micro-batch on each rank, the same step
        packed, packed_code = two_process_runs["fsdp2-packed"]
        c = read_metrics(packed)[0]
        assert packed_code == 0 and c["reward/mean"] == b["reward/mean"]
        assert c["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)
        assert c["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-7)


def test_verl_style_reward_file_and_failures_are_counted(tmp_path, small_files):
    reward = tmp_path / "verl_reward.py"
    reward.write_text(
        "import re\n"
        "def my_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if extra_info['index'] % 4 == 0:\n"
        "        raise ValueError('flaky reward')\n"
        "    if extra_info['index'] % 4 == 1:\n"
        "        return float('nan')\n"
        "    m = re.search(r'<answer>(.*?)</answer>', solution_str)\n"
        "    ok = bool(m) and m.group(1).strip() == ground_truth\n"
        "    return {'score': float(ok), 'acc': float(ok), 'formatted': float(bool(m))}\n"
    )
    out = tmp_path / "custom"
    proc = grpo(out, small_files, f"{FAST} --total-training-steps 2 --test-freq 2 --reward-fn {reward}:my_score")
    last = read_metrics(out)[-1]
    assert last["reward/errors"] > 0, "rows with index % 4 == 0 raised and must be counted"
    assert last["reward/nonfinite"] > 0 and last["val/reward/nonfinite"] > 0, "index % 4 == 1 gave NaN"
    assert all(r["reward/nonfinite"] > 0 and r["reward/mean"] >= 0 for r in read_metrics(out)), "zeroed, run on"
    assert 0 <= last["reward/extra/formatted"] <= 1, "other keys of a dict result become metrics"
    assert "reward/extra/acc" in last and 0 <= last["reward/accuracy"] <= 1
    assert "ValueError: flaky reward" in proc.stderr
    assert proc.stderr.count("Traceback (most recent call last)") == 1, "the traceback is printed once"
    assert 0 <= last["val/accuracy"] <= 1
    assert last["val/reward/errors"] > 0 and last["val/reward/timeouts"] == 0, "validation counts them too"


def test_a_nan_reward_stops_the_run_when_asked(tmp_path, small_files):
    reward = tmp_path / "nan_reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0 if solution_str == ground_truth else float('nan')\n"  # the dry run's ground truths pass
    )
    out = tmp_path / "stops"
    flags = f"{FAST} --total-training-steps 2 --test-freq 0 --reward-fn {reward} --stop-on-nonfinite-reward"
    proc = grpo(out, small_files, flags.replace("--save-freq 0", "--save-freq 1"), check=False)
    assert proc.returncode == 1 and "error: step 1: reward/nonfinite = " in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (out / "checkpoints").exists(), "stopped before saving step 1"


@pytest.mark.e2e
def test_reward_timeouts_do_not_hang_the_run(tmp_path, small_files):
    reward = tmp_path / "slow.py"
    reward.write_text(
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if extra_info['index'] % 8 == 1:\n"
        "        time.sleep(600)\n"
        "    return 0.0\n"
    )
    out = tmp_path / "slow"
    grpo(
        out,
        small_files,
        f"{FAST} --total-training-steps 1 --test-freq 0 --reward-fn {reward} --reward-timeout 0.5",
        timeout=120,
    )
    assert read_metrics(out)[-1]["reward/timeouts"] > 0


# --- errors before any model loads -----------------------------------------------------------


@pytest.fixture
def grpo_no_model(monkeypatch):
    return load_recipe_refusing_models("grpo", monkeypatch)


def test_unknown_data_source_fails_before_model_loads(tmp_path, grpo_no_model):
    f = tmp_path / "d.parquet"
    rows = [
        {
            "data_source": "my/task",
            "prompt": [{"role": "user", "content": "hi"}],
            "reward_model": {"style": "rule", "ground_truth": "1"},
        }
    ] * 16
    pq.write_table(pa.Table.from_pylist(rows), f)
    with pytest.raises(ValueError, match="no built-in reward for data_source='my/task'"):
        grpo_no_model.main(make_args(grpo_no_model.Args, train_files=(str(f),), val_files=(), output_dir=str(tmp_path)))


def test_options_and_lora_reference_run(tmp_path, small_files):
    """Every optional branch once: clip-higher, Dr.GRPO, seq-mean-token-sum-norm, several
    mini-batches and epochs (separate old-logprob pass), dynamic batching, and the KL loss against
    the LoRA adapter-disabled base."""
    out = tmp_path / "options"
    flags = (
        "--train-batch-size 8 --ppo-mini-batch-size 4 --rollout-n 4 --micro-batch-size-per-gpu 8 --ppo-epochs 2 "
        "--clip-ratio-high 0.28 --no-norm-adv-by-std-in-grpo --loss-agg-mode seq-mean-token-sum-norm "
        "--use-kl-loss --kl-loss-type k3 --entropy-coeff 0.01 --use-dynamic-bsz --ppo-max-token-len-per-gpu 300 "
        "--lora-rank 4 --lora-alpha 8 --lr 5e-3 --total-training-steps 2 --test-freq 2 --save-freq 2 --no-val-before-train"
    )
    grpo(out, small_files, flags)
    last = read_metrics(out)[-1]
    assert last["policy/kl_ref"] > 0, "the adapter moved the policy away from the adapter-disabled base"
    assert last["policy/approx_kl"] != 0, "second epoch / mini-batch ran on moved weights"
    assert (out / "checkpoints" / "step_2" / "hf" / "adapter_model.safetensors").is_file()


def test_reward_model_and_sampled_validation(tmp_path, small_files, tokenizer):
    """A sequence-classification reward model replaces the rule score; validation samples 2 per prompt."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    rm_dir = tmp_path / "rm"
    config = AutoConfig.from_pretrained(SFT, num_labels=1)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    out = tmp_path / "rm_run"
    grpo(
        out,
        small_files,
        f"{FAST} --total-training-steps 1 --test-freq 1 --reward-model {rm_dir} --val-n 2 --val-temperature 1.0",
    )
    last = read_metrics(out)[-1]
    assert last["reward/std"] > 0 and last["reward/mean"] not in (0.0, 1.0), "continuous reward-model scores"
    assert "val/accuracy" in last
