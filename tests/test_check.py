"""common.check (--check): each item passes on a sound stack and fails on the fault it is there to
catch. The engine with weights of its own (remote here; vLLM in tests/test_vllm.py) gets a planted
stale sync and a planted LoRA-not-merged sync, each caught before step 1 with what to do; --check
warn goes on. Every RL recipe run in the suite runs the fast check, so a check that failed on a
sound stack would fail them all."""

import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import BUNDLED, ROOT

from common.check import Check, check_engine_logprobs, launch_check
from common.config import Sync, engine_sync
from common.data import load_prompts
from common.engines import HFEngine, Sampling
from common.errors import RunStopped
from common.model import load_policy
from common.parallel import Dist

SFT = str(BUNDLED / "tiny-qwen2-sft")
TEACHER = str(BUNDLED / "tiny-qwen2-teacher")
ONE_STEP = ["--total-training-steps", "1", "--no-val-before-train", "--test-freq", "0", "--save-freq", "0"]


class Written:
    """A stand-in for common.tracking.Tracker's write."""

    def __init__(self):
        self.text = ""

    def write(self, message: str) -> None:
        self.text += message + "\n"


def sync_of(freq: int = 0) -> Sync:
    """The HF engine's sync in a float32 run (the trainer's own weights): what common.config.engine_sync gives."""
    return Sync(
        False, "when-stale", trainer_dtype=torch.float32, gap_dtype=torch.float32, gap_proves_sync=False, freq=freq
    )


def gap_bound(args) -> dict | None:
    """The bound Check.during holds a step's logged gap (rollout/logprob_diff_mean) to, found by handing it gaps
    either side of the dtype's TOLERANCE: dict(mean, dtype, warn), or None where it holds none."""
    from common.rollout import TOLERANCE

    sync = engine_sync(args.model, args.rollout, args.placement, args.correction)
    bound = TOLERANCE[sync.gap_dtype][1]

    def stops(mean: float) -> bool:
        failed = []
        gaps = {"rollout/logprob_diff_mean": mean, "rollout/logprob_diff_max": mean}
        Check(args.trainer.check, sync).during(1, SimpleNamespace(fail=failed.append), gaps)
        return bool(failed)

    if not stops(bound * 1.5):
        return None
    assert not stops(bound)
    return dict(mean=bound, dtype=str(sync.gap_dtype).removeprefix("torch."), warn=args.trainer.check == "warn")


def rollout_of(engine, tokenizer, sampling: Sampling | None = None):
    rows, _ = load_prompts([BUNDLED / "addition" / "test.parquet"], tokenizer, max_prompt_length=64)
    pool = SimpleNamespace(dry_run_report=(True, "2 of 2 rows"))
    return SimpleNamespace(
        val=rows[:8],
        train=[],
        tokenizer=tokenizer,
        sampling=sampling or Sampling(),
        dist=Dist(0, 1, 0, torch.device("cpu")),
        pool=pool,
    )


def test_an_engine_serving_another_model_fails_the_logprob_item(tokenizer):
    """The engine's own logprobs of its samples against the trainer's pass: the same model passes far
    inside the float32 bound; an engine serving another model (here the teacher checkpoint, as a
    stale or wrongly loaded engine would) fails, and the run stops naming the item and what to check,
    or under --check warn goes on with a warning."""
    from common.check import _probe

    policy = load_policy(SFT)
    rollout = rollout_of(None, tokenizer)
    for served, want in ((policy, True), (load_policy(TEACHER), False)):
        engine = HFEngine(served, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cpu")
        batch, reported = _probe(engine, tokenizer, [r["prompt_ids"] for r in rollout.val[:4]], Sampling(), "cpu")
        item = check_engine_logprobs(policy, batch, reported, 1.0, torch.float32)
        assert item.ok is want, item.figure
        rollout.engine = engine
        if want:
            assert float(item.figure.split("max gap ")[1].split(",")[0]) < 1e-4
            continue
        with pytest.raises(
            RunStopped, match=r"(?s)engine logprobs +FAIL +max gap .*engine logprobs: the engine's logprobs"
        ):
            launch_check("fast", policy, engine, rollout, Written(), None, sync_of())
        written = Written()
        launch_check("warn", policy, engine, rollout, written, None, sync_of())
        assert "FAIL" in written.text and "warning: engine logprobs" in written.text


def replayed_truncation(policy, tokenizer, prompts) -> str:
    """--top-p 0.8 --top-k 20, and --min-p: the probe samples as the run does, the engine reports the logprobs it
    sampled with (over the kept tokens) and the trainer replays the kept set, so the engine item passes far inside
    the float32 bound; the same probe over the whole vocabulary (the trainer before the replay) is past it. Returns
    the launch check's report at --top-p 0.8 --top-k 20."""
    from common.check import _probe, _whole

    engine = HFEngine(policy, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cpu")
    for sampling in (Sampling(top_p=0.8, top_k=20), Sampling(temperature=0.7, min_p=0.05)):
        batch, reported = _probe(engine, tokenizer, prompts, sampling, "cpu")
        assert (batch["kept"][batch["response_mask"].bool()] > 0).float().mean() > 0.5  # most tokens truncated
        item = check_engine_logprobs(policy, batch, reported, sampling.temperature, torch.float32)
        assert item.ok is True and float(item.figure.split("max gap ")[1].split(",")[0]) < 1e-4, item.figure
        whole = check_engine_logprobs(policy, _whole(batch), reported, sampling.temperature, torch.float32)
        assert whole.ok is False, whole.figure
    written, rollout = Written(), rollout_of(engine, tokenizer, Sampling(top_p=0.8, top_k=20))
    rollout.val = [{"prompt_ids": p} for p in prompts]
    launch_check("fast", policy, engine, rollout, written, None, sync_of())
    return written.text


def test_the_engine_item_passes_under_truncated_sampling_by_replaying_it(tokenizer):
    prompts = [r["prompt_ids"] for r in rollout_of(None, tokenizer).val[:4]]
    assert re.search(r"check engine logprobs +pass", replayed_truncation(load_policy(SFT), tokenizer, prompts))


def test_the_check_leaves_the_samplers_generator_where_it_was(tokenizer):
    """The check samples its probe with the run's engine; the run then samples as it would have without
    it (so a resumed run, which checks again, samples as the run it resumes)."""
    policy = load_policy(SFT)
    engine = HFEngine(policy, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cpu")
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    launch_check("fast", policy, engine, rollout_of(engine, tokenizer), Written(), None, sync_of())
    assert torch.equal(torch.rand(4), want)


def test_the_packing_item_holds_each_layout_to_the_compute_dtypes_bound(tokenizer, monkeypatch):
    """Packed against padded logprobs of the probe, within TOLERANCE for the dtype the passes compute in. Under
    --mixed-precision bf16 the weights stay float32 while both passes run in bf16: the H100 found the item failing
    every such run at the float32 bound (the flash-attention varlen kernel 0.012 from the padded pass at most). A
    packed pass that disagrees past the dtype's bound still fails."""
    import common.check as check
    from common.check import _probe, check_packing

    policy = load_policy(SFT, remove_padding=True)
    engine = HFEngine(policy, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cpu")
    rows = rollout_of(engine, tokenizer).val[:4]
    batch, _ = _probe(engine, tokenizer, [r["prompt_ids"] for r in rows], Sampling(), "cpu")
    item = check_packing(policy, batch, torch.float32)
    assert item.ok is True and "float32 bounds 0.001, 0.0001" in item.figure
    trainer_logprobs = check.trainer_logprobs
    for planted, dtype, want in (
        (0.012, torch.float32, False),
        (0.012, torch.bfloat16, True),
        (0.2, torch.bfloat16, False),
    ):
        monkeypatch.setattr(
            check, "trainer_logprobs", lambda m, b, t, d=planted: trainer_logprobs(m, b, t) + d * m.padding_free
        )
        item = check_packing(policy, batch, dtype)
        assert item.ok is want, (planted, dtype, item.figure)
    assert policy.padding_free is True  # the item puts the model's layout back


def test_check_off_and_warn_are_flags_of_every_rl_recipe():
    from conftest import RL_RECIPES, load_recipe, make_args

    def sync(args) -> Sync:
        return engine_sync(args.model, args.rollout, args.placement, args.correction)

    for name in RL_RECIPES:
        args = make_args(load_recipe(name).Args, check="warn")
        s = sync(args)
        got = dict(dtype=s.gap_dtype, own_weights=s.own_weights, freq=Check("warn", s).freq, trainer=s.trainer_dtype)
        want = dict(dtype=torch.float32, own_weights=False, freq=0, trainer=torch.float32)  # HF: nothing to re-probe
        assert args.trainer.check == "warn" and got == want
    # an engine with its own weights: the probe after every sync, and the logged gap bounded where it proves the sync
    grpo = load_recipe("grpo").Args
    remote = make_args(grpo, rollout_placement="remote")
    assert Check(remote.trainer.check, sync(remote)).freq == 1 and gap_bound(remote) == dict(
        mean=1e-4, dtype="float32", warn=False
    )
    for truncated in (dict(top_k=50), dict(top_p=0.9), dict(min_p=0.05)):  # replayed by the trainer: still bounded
        args = make_args(grpo, rollout_placement="remote", **truncated)
        assert gap_bound(args) == dict(mean=1e-4, dtype="float32", warn=False), truncated
    for unusable in (
        dict(max_staleness=1),
        dict(bypass_mode=True),
        dict(rollout_is="token"),
        dict(rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"),
    ):
        args = make_args(grpo, rollout_placement="remote", **unusable)
        assert Check(args.trainer.check, sync(args)).freq == 1 and gap_bound(args) is None, unusable
    assert gap_bound(make_args(grpo, rollout_placement="remote", check_freq=0)) is None


def test_every_training_recipe_takes_the_resume_proofs_flags_last():
    """--check full's children run the user's command line with RESUME_FLAGS after it: every recipe
    that trains (sft too) parses them, and they win over the user's own."""
    import tyro
    from conftest import RL_RECIPES, load_recipe

    from common.flags import flag_values
    from common.proofs.resume_proof import RESUME_FLAGS

    for name in [*RL_RECIPES, "sft"]:
        user = ["--total-training-steps", "50", "--save-freq", "10", "--check", "full", "--logger", "wandb"]
        args = flag_values(tyro.cli(load_recipe(name).Args, args=[*user, *RESUME_FLAGS, "--output-dir", "x"]))
        assert (args["total_training_steps"], args["save_freq"], args["check"], args["logger"]) == (
            2,
            1,
            "off",
            ("console",),
        )
        assert args["max_ckpt_to_keep"] == 0 and args["test_freq"] == 0 and not args["val_before_train"], name


def test_the_tested_versions_hold_for_this_environment():
    """common.check.TESTED declares the versions the CI runs the suite on; this environment (the CI's
    when .ci/run runs it) must lie inside, or the table is wrong: widen it once the suite passes."""
    from common.check import TESTED, _minor, environment_report, installed

    for name in TESTED:
        version = installed(name)
        if version is not None:
            low, high = TESTED[name]
            assert _minor(low) <= _minor(version) <= _minor(high), f"{name} {version}: widen common.check.TESTED"
    lines, warnings = environment_report()
    assert not warnings and any(line.split()[0] == "torch" and "tested" in line for line in lines), lines


def test_an_untested_version_is_a_warning_with_the_range(monkeypatch):
    import common.check

    monkeypatch.setattr(common.check, "installed", lambda name: "9.1.0" if name == "transformers" else None)
    lines, warnings = common.check.environment_report()
    assert "  transformers  9.1.0          UNTESTED (CI: 5.19-5.24)" in lines
    assert warnings == ["transformers 9.1.0 is outside the versions the CI has tested (5.19-5.24)"]


def test_python_m_common_check_runs_a_recipe_up_to_its_check(tmp_path, capsys, monkeypatch):
    """`python -m common.check grpo FLAGS`: the recipe's own setup with the user's flags, its launch
    check printed, and no step trained (exit 0); an item that fails exits 1 with what to do; --env
    prints the report alone. Without a --check of the user's the tool runs --check full (checked
    without running it: the command line the recipe is handed)."""
    import common.check
    import common.errors

    assert common.check.main(["--env"]) == 0 and "torch" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)
    assert common.check.main(["grpo", "--check", "fast", "--output-dir", str(tmp_path / "ok")]) == 0
    out = capsys.readouterr().out
    assert "check engine logprobs  pass" in out and "check rewards          pass" in out
    assert (
        not (tmp_path / "ok" / "metrics.jsonl").exists()
        or "train/loss" not in (tmp_path / "ok" / "metrics.jsonl").read_text()
    )
    probe = common.check._probe
    monkeypatch.setattr(common.check, "_probe", lambda *a: (lambda b, r: (b, r - 0.5))(*probe(*a)))  # a wrong engine
    assert common.check.main(["grpo", "--check", "fast", "--output-dir", str(tmp_path / "bad")]) == 1
    assert "engine logprobs: the engine's logprobs" in capsys.readouterr().err
    assert common.check.main(["nosuch"]) == 2 and "no recipe 'nosuch'" in capsys.readouterr().err
    handed = []
    monkeypatch.setattr("runpy.run_path", lambda *a, **k: handed.append(list(sys.argv)) or sys.exit(0))
    assert common.check.main(["grpo", "--lr", "1e-4"]) == 0 and common.check.main(["grpo", "--check=warn"]) == 0
    assert handed[0][1:5] == ["--lr", "1e-4", "--check", "full"] and "full" not in handed[1]
    assert common.errors.STOP_AFTER_CHECK not in os.environ  # the recipes this process runs next train


def test_check_freq_measures_the_engine_and_stops_a_run_that_diverged(tokenizer, monkeypatch):
    """Check.during every --check-freq steps: the HF engine's fresh samples of the probe prompts against
    the trainer's pass, logged as check/engine_gap_*; when the engine no longer serves the trainer's
    model, the stop signal is asked to end the run after this step's checkpoint, with a message naming
    the engine and its version (under --check warn, nothing stops)."""
    from common.parallel import StopSignal

    policy = load_policy(SFT)
    engine = HFEngine(policy, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cpu")
    rollout = rollout_of(engine, tokenizer)
    # The HF engine's probe every 2 steps: a run's Check re-probes only an engine with its own weights (Check.freq),
    # so the HF branch of Check.during is reached by giving this Check the frequency itself.
    monkeypatch.setattr(Check, "freq", property(lambda self: self.sync.freq))
    check = launch_check("fast", policy, engine, rollout, Written(), None, sync_of(freq=2))
    stop = StopSignal(rollout.dist)
    assert check.during(1, stop, {}) == {}  # not due
    metrics = check.during(2, stop, {})
    assert set(metrics) == {"check/engine_gap_max", "check/engine_gap_mean"} and metrics["check/engine_gap_max"] < 1e-4
    assert stop.failure is None and not stop.requested()
    check.engine = HFEngine(
        load_policy(TEACHER), pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cpu"
    )
    assert check.during(4, stop, {})["check/engine_gap_mean"] > 1e-2
    assert stop.requested() and "step 4: after the sync to version 4, HFEngine's logprobs of the probe" in stop.failure
    warned = StopSignal(rollout.dist)
    check.mode = "warn"
    check.during(6, warned, {})
    assert warned.failure is None and not warned.requested()


SMALL = ["--train-batch-size", "8", "--ppo-mini-batch-size", "8", "--rollout-n", "4", "--micro-batch-size-per-gpu",
         "16", "--no-val-before-train", "--test-freq", "0"]  # fmt: skip


@pytest.mark.e2e
def test_check_full_proves_a_resumed_step_equals_the_uninterrupted_one(tmp_path, capsys, small_files):
    """--check full: two child runs of the command line (2 steps; a fresh process resumed from step
    1's checkpoint) give the same step 2, metrics and weights, before the run's models load. A resume
    that forgets torch's generator (planted in the children) samples another step 2: the item fails
    naming what differs and keeps the children's folders, the run stops with exit 1."""
    import subprocess

    import common.check

    flags = ["grpo", "--check", "full", *small_files, *SMALL]
    plant = tmp_path / "plant"
    plant.mkdir()  # the children import it at start-up (sitecustomize), before the recipe
    (plant / "sitecustomize.py").write_text(
        "import common.checkpoint\ncommon.checkpoint._set_rng_state = lambda s: None\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plant), os.environ.get("PYTHONPATH", "")])}
    # The planted run is the tool's own command line in a process of its own, beside the sound one
    # here: the two sets of child runs overlap their start-ups.
    bad = subprocess.Popen(
        [sys.executable, "-m", "common.check", *flags, "--output-dir", str(tmp_path / "bad")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert common.check.main([*flags, "--output-dir", str(tmp_path / "ok")]) == 0
        out = capsys.readouterr().out
    finally:
        _, err = bad.communicate(timeout=900)
    line = next(x for x in out.splitlines() if "check resume" in x)
    assert "pass" in line and "step 2 resumed from step 1's checkpoint vs uninterrupted (1 process;" in line
    assert "largest gaps 0 (relative) and 0" in line, line

    assert bad.returncode == 1, err[-3000:]
    line = next(x for x in err.splitlines() if "check resume" in x)
    assert "FAIL" in line and "a repeat of the uninterrupted run differs by 0 and 0" in line, line
    assert "resume: a run resumed from its checkpoint does not continue as the uninterrupted run (most:" in err
    kept = err.split("the child runs' folders are kept in ")[1].split()[0]
    assert (Path(kept) / "resumed" / "console.log").is_file()
    metrics = tmp_path / "bad" / "metrics.jsonl"
    assert not metrics.exists() or "train/loss" not in metrics.read_text(), "the run stopped before its first step"


ZERO_REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"


def test_the_reward_signal_item_says_before_step_1_when_no_sample_can_be_rewarded(tmp_path, small_files):
    """A reward that is always 0: the launch check's probe (training prompts sampled as the run samples) says so
    with the usual causes and a scored sample; each step logs reward/equal_groups 1 and the closing summary counts
    the steps without signal; --check strict stops before step 1. The shipped model on its task passes the item."""
    from conftest import read_metrics, run_recipe

    zero = tmp_path / "zero.py"
    zero.write_text(ZERO_REWARD)
    flags = [*small_files, "--train-batch-size", "4", "--rollout-n", "4", *ONE_STEP[2:], "--total-training-steps"]
    proc = run_recipe("grpo", *flags, "2", "--reward-fn", zero, "--output-dir", tmp_path / "zero")
    assert (
        "check reward signal    warn  16 samples of 4 training prompts as the run samples: rewards 0 x16" in proc.stdout
    )
    assert "    reward 0: '" in proc.stdout and "warning: reward signal: every probe sample scored 0" in proc.stdout
    assert "--check strict stops the run here" in proc.stdout
    steps = [m for m in read_metrics(tmp_path / "zero") if "train/loss" in m]
    assert [m["reward/equal_groups"] for m in steps] == [1.0, 1.0]
    assert "2 of 2 steps had no reward signal: every group's rewards were equal" in proc.stdout

    strict = run_recipe(
        "grpo", *flags, "2", "--reward-fn", zero, "--check", "strict", "--output-dir", tmp_path / "s", check=False
    )
    assert strict.returncode == 1 and "error: launch check" in strict.stderr
    assert "reward signal: every probe sample scored 0" in strict.stderr and "Traceback" not in strict.stderr
    assert not any("train/loss" in m for m in read_metrics(tmp_path / "s"))

    proc = run_recipe("grpo", *flags, "2", "--output-dir", tmp_path / "ok")
    assert "check reward signal    pass  16 samples of 4 training prompts" in proc.stdout
    steps = [m for m in read_metrics(tmp_path / "ok") if "train/loss" in m]
    assert all(0 <= m["reward/equal_groups"] < 1 for m in steps) and "no reward signal" not in proc.stdout


BROKEN_TEMPLATES = {  # each breaks one thing training needs, as real templates have
    "eos": "{% for m in messages %}{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "<|im_start|>assistant\n{% else %}{{ m.content }}\n{% endif %}{% endfor %}",  # GLM: the turn ends untrained
    "history": "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and not loop.last %}"
    "<think></think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",  # past turns re-rendered
    "prompt": "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}<think></think>"
    "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}",  # the generation prompt stops short of what the assistant's turn renders
}


def broken_tokenizer(tokenizer, kind: str):
    import copy

    broken = copy.deepcopy(tokenizer)
    broken.chat_template = BROKEN_TEMPLATES[kind]
    return broken


def test_the_chat_template_item_names_what_a_broken_template_gets_wrong(tokenizer):
    """The bundled template passes; each broken one is named by its one problem: a stop for sft.py (its masks come
    from the template), a warning for an RL run."""
    from common.check import check_template

    assert check_template(tokenizer, stops=True).ok is True
    words = {"eos": "falls outside the assistant's loss mask", "history": "does not extend", "prompt": "renders as"}
    for kind, said in words.items():
        item = check_template(broken_tokenizer(tokenizer, kind), stops=True)
        assert item.ok is False and len(item.detail) == 1 and said in item.detail[0], (kind, item.detail)
        assert check_template(broken_tokenizer(tokenizer, kind), stops=False).ok == "warn"


def test_sft_stops_at_the_launch_check_on_a_template_that_never_trains_the_end_of_turn(tmp_path, tokenizer):
    from conftest import run_recipe

    folder = tmp_path / "tokenizer"
    broken_tokenizer(tokenizer, "eos").save_pretrained(folder)
    flags = ("--tokenizer", folder, "--total-training-steps", 1, "--output-dir", tmp_path / "run", "--test-freq", 0)
    done = run_recipe("sft", *flags, check=False)
    assert done.returncode == 1 and "check chat template    FAIL" in done.stderr + done.stdout, done.stderr[-3000:]
    assert "falls outside the assistant's loss mask" in done.stderr + done.stdout
    assert not (tmp_path / "run" / "checkpoints").exists()
