"""sft.py end to end: runs as users make them (in this process through the `python recipes/sft.py`
code path, and in a new process where a kill or a start-up matters), plus bad-input checks."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import (
    ROOT,
    SHIPPED_ACCURACY,
    TASK_TEST,
    TINY,
    load_recipe,
    load_recipe_refusing_models,
    make_args,
    read_metrics,
    run_recipe,
    torchrun_plan,
)
from safetensors.torch import load_file

from common.data import DataError
from common.sft_data import SFTDataArgs, load_sft


def base_flags(out, files, extra: str = ""):
    """files: the --train-files / --val-files flags (conftest's small_files, or this module's odd_files)."""
    return ["--output-dir", out, *files, "--resume", "disable", *extra.split()]


def losses(run_dir, key="train/loss"):
    return [r[key] for r in read_metrics(run_dir) if key in r]


def test_help_renders():
    proc = run_recipe("sft", "--help")
    for flag in (
        "--train-batch-size",
        "--micro-batch-size-per-gpu",
        "--lr-scheduler",
        "--lora-rank",
        "--resume",
        "--truncation",
    ):
        assert flag in proc.stdout


def test_smoke_checkpoint_and_export_reload(tmp_path, small_files, small_val, tokenizer):
    out = tmp_path / "run"
    proc = run_recipe(
        "sft",
        *base_flags(
            out,
            small_files,
            "--total-training-steps 6 --save-freq 2 --test-freq 3 --max-ckpt-to-keep 2",
        ),
    )  # in this process: kill_and_resume below and test_preemption.py start sft.py as a new process
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert "val/accuracy" in records[2] and "val/loss" in records[5]
    # the closing block names the update and validation, not "other" (each step's perf/update_s, each
    # validation's perf/validate_s)
    assert all(r["perf/update_s"] > 0 for r in records) and records[2]["perf/validate_s"] > 0
    block = (proc.stdout + proc.stderr).split("where the time went")[1].splitlines()[0]
    assert "update" in block and "validate" in block, block
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_4", "step_6"]
    assert (out / "curves.png").stat().st_size > 1000
    ckpt = out / "checkpoints" / "step_6"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert (state["step"], state["epoch"], state["batch_in_epoch"]) == (6, 0, 6)

    # The HF export is the trained model: its val loss equals the one the live model logged.
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(ckpt / "hf")
    val, _ = load_sft([small_val], tokenizer, SFTDataArgs(max_length=128, response_key="extra_info.answer"))
    sft = load_recipe("sft")
    ids, attention, mask = sft.collate(val, tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        logits = exported(input_ids=ids, attention_mask=attention).logits
    _, nll = sft.compute_loss(logits, ids, mask, 1.0)
    assert nll.item() / mask[:, 1:].sum().item() == pytest.approx(records[5]["val/loss"], rel=1e-5)

    # ... and equals the model restored from the sharded training state.
    from common.checkpoint import load_checkpoint
    from common.model import load_policy
    from common.optim import build_optimizer, build_scheduler
    from common.parallel import Dist

    restored = load_policy(str(TINY))
    opt = build_optimizer(restored, 1e-3, 0.0)
    sched = build_scheduler(opt, kind="constant", total_steps=6, warmup_ratio=0)
    dist = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    load_checkpoint(ckpt, (restored, opt, sched), dist=dist)
    with torch.no_grad():
        assert torch.allclose(restored(input_ids=ids, attention_mask=attention).logits, logits, atol=1e-5)
    assert sched.last_epoch == 6 and len(opt.state) > 0


@pytest.mark.e2e
def test_kill_and_resume_continues_exactly(tmp_path, small_files):
    flags = "--total-training-steps 20 --train-batch-size 16 --save-freq 5 --test-freq 0 --max-ckpt-to-keep 0 "
    flags += "--lr-scheduler cosine"
    ref = tmp_path / "ref"
    run_recipe("sft", *base_flags(ref, small_files, flags))

    run = tmp_path / "killed"
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / "sft.py"),
        *map(str, base_flags(run, small_files, flags)),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not (run / "checkpoints" / "step_5").is_dir() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    still_running = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert still_running, "the run finished before it could be killed; the test would prove nothing"
    saved = sorted(
        int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*") if not p.name.endswith(".tmp")
    )
    resumed_from = saved[-1]
    assert 5 <= resumed_from < 20

    # `--resume auto` (the default) picks the newest checkpoint up.
    run_recipe("sft", "--output-dir", run, *small_files, *flags.split())
    got, want = read_metrics(run), read_metrics(ref)
    assert [r["step"] for r in got] == list(range(1, 21)), "every step logged once, none replayed"
    for a, b in zip(got, want):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-6, abs=1e-7), a["step"]
        assert a["train/lr"] == pytest.approx(b["train/lr"], rel=1e-9)
    assert got[-1]["train/grad_norm"] == pytest.approx(want[-1]["train/grad_norm"], rel=1e-5)


@pytest.fixture(scope="module")
def odd_files(small_train, odd_val):
    return ["--train-files", str(small_train), "--val-files", str(odd_val)]


# 16 examples a step: bf16 matmuls are emulated on CPUs without bf16 instructions (~40x float32)
STEPS3 = "--total-training-steps 3 --test-freq 3 --val-batch-size 16 --train-batch-size 16"


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory, odd_files):
    out = tmp_path_factory.mktemp("single")
    run_recipe(
        "sft",
        *base_flags(out, odd_files, f"{STEPS3} --micro-batch-size-per-gpu 16 --save-freq 0 --use-remove-padding False"),
    )
    return out


def test_micro_batch_and_checkpointing_invariance(tmp_path, small_files, single_process_run):
    out = tmp_path / "micro"
    run_recipe(
        "sft",
        *base_flags(
            out,
            small_files,
            "--total-training-steps 3 --train-batch-size 16 --micro-batch-size-per-gpu 4 --gradient-checkpointing "
            "--test-freq 0 --save-freq 0",
        ),
    )
    assert losses(out) == pytest.approx(losses(single_process_run), rel=1e-5)
    assert losses(out, "train/grad_norm") == pytest.approx(losses(single_process_run, "train/grad_norm"), rel=1e-4)


def test_a_padding_free_run_equals_the_padded_one(tmp_path, odd_files, single_process_run):
    """--use-remove-padding packs each micro-batch's examples into one row (common.model.sequence_logits):
    the same training and validation losses and gradients as the padded run."""
    out = tmp_path / "packed"
    run_recipe(
        "sft",
        *base_flags(out, odd_files, f"{STEPS3} --micro-batch-size-per-gpu 8 --save-freq 0 --use-remove-padding True"),
    )
    assert losses(out) == pytest.approx(losses(single_process_run), rel=1e-5)
    assert losses(out, "train/grad_norm") == pytest.approx(losses(single_process_run, "train/grad_norm"), rel=1e-4)
    assert losses(out, "val/loss") == pytest.approx(losses(single_process_run, "val/loss"), rel=1e-5)


@torchrun_plan
def two_process_plan(folder, fixture):
    """sft.py with 2 processes: DDP and FSDP2 in float32, and FSDP2 under bf16 mixed precision with
    the float32 reference's micro-batch layout."""
    runs = {
        strategy: f"{STEPS3} --micro-batch-size-per-gpu 4 --strategy {strategy} --save-freq 3"
        for strategy in ("ddp", "fsdp2")
    }
    runs["bf16-fsdp2"] = f"{STEPS3} --micro-batch-size-per-gpu 8 --save-freq 3 --mixed-precision bf16 --strategy fsdp2"
    files = ["--train-files", fixture("small_train"), "--val-files", fixture("odd_val")]  # as odd_files
    return {name: ("sft", base_flags(folder / name, files, flags)) for name, flags in runs.items()}


@pytest.fixture(scope="module")
def two_process_runs(torchrun_runs):
    """{name: (run folder, exit status)} of two_process_plan's runs."""
    folder, codes = torchrun_runs[__name__]
    return {name: (folder / name, code) for name, code in codes.items()}


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_match_one(two_process_runs, single_process_run, strategy):
    out, code = two_process_runs[strategy]
    assert code == 0, f"sft.py exited {code}"
    run = json.loads((out / "config.json").read_text())["run"]
    assert run["world_size"] == 2 and run["strategy"] == strategy
    local = run["params_local_per_rank"]
    if strategy == "fsdp2":
        assert all(n < 0.6 * run["params_full"] for n in local) and sum(local) == run["params_full"]
    else:
        assert local == [run["params_full"]] * 2
    assert losses(out) == pytest.approx(losses(single_process_run), rel=1e-4)
    assert losses(out, "train/grad_norm") == pytest.approx(losses(single_process_run, "train/grad_norm"), rel=1e-3)
    assert (out / "checkpoints" / "step_3" / "hf" / "model.safetensors").is_file()
    got, want = read_metrics(out)[-1], read_metrics(single_process_run)[-1]
    assert got["val/loss"] == pytest.approx(want["val/loss"], rel=1e-4)
    assert got["val/accuracy"] == want["val/accuracy"]


def test_lora_adapter_and_merged_export(tmp_path, small_files):
    out = tmp_path / "lora"
    run_recipe(
        "sft",
        *base_flags(
            out,
            small_files,
            "--total-training-steps 4 --lora-rank 8 --lora-alpha 16 --lr 1e-2 --export-merged-lora --test-freq 0",
        ),
    )
    hf = out / "checkpoints" / "step_4" / "hf"
    assert (hf / "adapter_config.json").is_file() and (hf / "adapter_model.safetensors").is_file()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    ids = torch.tensor([[257, 84, 82, 68, 81, 198, 16, 17, 10]])
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(base, hf)(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(hf / "merged")(ids).logits
    assert torch.allclose(merged, adapted, atol=1e-4)
    assert not torch.allclose(adapted, base_logits, atol=1e-3), "the adapter learned nothing"


@pytest.mark.e2e
def test_loss_falls_from_random_init(tmp_path, small_val):
    """Shortened form of the command that made bundled/tiny-qwen2-sft (bundled/README.md). Measured
    with seeds 1-3 (final train and val loss over the first train loss): 0.233-0.237 at 30 steps,
    0.328-0.331 at 20 and 0.166-0.175 at 60, so 30 steps keeps a clear margin under the bars."""
    out = tmp_path / "learn"
    run_recipe(
        "sft",
        *base_flags(out, ["--val-files", small_val], "--total-training-steps 30 --test-freq 30 --save-freq 0"),
    )
    train = losses(out)
    assert train[-1] < 0.35 * train[0]
    assert read_metrics(out)[-1]["val/loss"] < 0.4 * train[0]


def test_shipped_checkpoint_sits_at_moderate_accuracy(tokenizer):
    from transformers import AutoModelForCausalLM

    from common.data import load_prompts
    from common.engines import hf_generate_greedy
    from common.scoring import default_compute_score

    model = AutoModelForCausalLM.from_pretrained(ROOT / "bundled" / "tiny-qwen2-sft", dtype=torch.float32)
    rows, _ = load_prompts([TASK_TEST], tokenizer, max_prompt_length=64)
    completions = hf_generate_greedy(
        model,
        [r["prompt_ids"] for r in rows],
        pad_id=tokenizer.pad_token_id,
        eos_id=tokenizer.eos_token_id,
        max_new_tokens=16,
        batch_size=500,
        device="cpu",
    )
    scores = [
        default_compute_score(r["data_source"], tokenizer.decode(c, skip_special_tokens=True), r["ground_truth"])
        for r, c in zip(rows, completions)
    ]
    assert sum(scores) / len(scores) == pytest.approx(SHIPPED_ACCURACY)  # the RL learning tests start from it


# --- bad input: a clear error, before any model loads -------------------------------------------


@pytest.fixture
def sft_no_model(monkeypatch):
    return load_recipe_refusing_models("sft", monkeypatch)


def write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.parametrize(
    "rows, flags, expected",
    [
        ([{"question": "a", "answer": "b"}], {}, "neither a 'messages' column"),
        (
            [{"prompt": "a", "extra_info": {"answer": 3}}],
            {},
            "column 'extra_info.answer': expected a string response, got int",
        ),
        ([{"prompt": "a" * 300, "extra_info": {"answer": "b"}}], {}, "row 0: 3"),
        (
            [{"prompt": "a", "extra_info": {"answer": "b"}}] * 10,
            {"train_batch_size": 10, "micro_batch_size_per_gpu": 0},
            "--micro-batch-size-per-gpu 0: must be >= 1",
        ),
        (
            [{"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": " "}]}] * 10,
            {"train_batch_size": 10},
            "column 'messages': assistant turn 1 is empty, which would train the model to answer nothing",
        ),
        (
            [{"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}], "a": "2"}],
            {"response_key": "a"},
            "a 'messages' column makes each row a conversation, so --response-key 'a' would not be read",
        ),
    ],
    ids=["missing-column", "wrong-type", "too-long", "zero-micro-batch", "empty-turn", "response-key-unread"],
)
def test_bad_input_fails_before_model_loads(tmp_path, sft_no_model, rows, flags, expected):
    f = write(tmp_path / "bad.parquet", rows)
    with pytest.raises((DataError, ValueError)) as err:  # a flag's range is checked as Args parses it
        sft_no_model.main(
            make_args(sft_no_model.Args, train_files=(f,), val_files=(), output_dir=str(tmp_path / "o"), **flags)
        )
    assert expected in str(err.value)
    if "row" in expected or "column" in expected:
        assert "bad.parquet" in str(err.value)


def test_empty_file_fails_before_model_loads(tmp_path, sft_no_model):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty)
    with pytest.raises(DataError, match="empty.parquet' has no rows"):
        sft_no_model.main(make_args(sft_no_model.Args, train_files=(str(empty),), output_dir=str(tmp_path / "o")))


def test_missing_model_folder_is_named(tmp_path):
    sft = load_recipe("sft")
    with pytest.raises(ValueError, match="--model ./no/such/model: folder does not exist"):
        sft.main(make_args(sft.Args, model="./no/such/model", output_dir=str(tmp_path / "o")))


def test_resume_path_must_be_a_checkpoint(tmp_path):
    from common.checkpoint import find_resume

    with pytest.raises(ValueError, match="not a checkpoint folder"):
        find_resume(str(tmp_path), tmp_path, "sft")
    assert find_resume("auto", tmp_path, "sft") is None and find_resume("disable", tmp_path, "sft") is None
    assert Path(tmp_path).is_dir()


def test_rerun_of_a_finished_run_says_so(tmp_path, small_files):
    out = tmp_path / "done"
    flags = ["--output-dir", out, *small_files, "--total-training-steps", 2, "--test-freq", 0]
    run_recipe("sft", *flags)
    again = run_recipe("sft", *flags)
    assert "already completed all 2 steps: nothing to train" in again.stderr and "M params" not in again.stdout
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


@pytest.mark.parametrize("nproc, strategy", [(1, "ddp"), (2, "fsdp2")])
def test_bf16_mixed_precision_keeps_float32_master_weights(
    tmp_path, odd_files, single_process_run, two_process_runs, nproc, strategy
):
    """bf16 compute (autocast, or FSDP2's param_dtype) tracks the float32 run closely, and the
    weights that are trained and exported stay float32."""
    if nproc == 1:  # the float32 reference's layout on one process
        out = tmp_path / f"bf16-{strategy}"
        flags = f"{STEPS3} --micro-batch-size-per-gpu 16 --save-freq 3 --mixed-precision bf16 --strategy {strategy}"
        run_recipe("sft", *base_flags(out, odd_files, flags))
    else:
        out, code = two_process_runs["bf16-fsdp2"]  # micro-batches of 8 per process: that layout again
        assert code == 0, f"sft.py exited {code}"
    assert losses(out) == pytest.approx(losses(single_process_run), rel=1e-2)
    if nproc == 1:  # same layout as the float32 run: any difference comes from bf16 compute
        assert losses(out) != losses(single_process_run)
    exported = load_file(out / "checkpoints" / "step_3" / "hf" / "model.safetensors")
    assert {t.dtype for t in exported.values()} == {torch.float32}


def test_openrlhfs_input_and_output_keys_name_the_prompt_and_response_columns():
    import tyro

    args = tyro.cli(load_recipe("sft").Args, args=["--input-key", "question", "--output-key", "answer"])
    assert (args.data.prompt_key, args.data.response_key) == ("question", "answer")
