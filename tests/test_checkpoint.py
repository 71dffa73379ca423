import dataclasses
import json
import random

import numpy as np
import pytest
import torch
from conftest import BUNDLED, TINY

from common.checkpoint import find_resume, list_checkpoints, load_checkpoint, resume, save_checkpoint
from common.config import TrainerArgs
from common.model import ModelArgs, load_policy
from common.optim import build_optimizer, build_scheduler
from common.parallel import Dist

DIST = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def keeping(keep: int = 2) -> TrainerArgs:
    """The trainer group of a run that keeps the newest `keep` checkpoints (0: all), as --max-ckpt-to-keep."""
    return TrainerArgs(max_ckpt_to_keep=keep)


def make():
    model = load_policy(str(TINY))
    opt = build_optimizer(model, 1e-2, 0.0)
    sched = build_scheduler(opt, kind="cosine", total_steps=10, warmup_ratio=0.2)
    return model, opt, sched


def train_step(model, opt, sched):
    ids = torch.randint(0, 200, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_roundtrip_continues_exactly(tmp_path, tokenizer):
    torch.manual_seed(0)
    model, opt, sched = make()
    train_step(model, opt, sched)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    save_checkpoint(tmp_path, 1, (model, opt, sched), DIST, tokenizer, "grpo", keeping(), None, {"epoch": 0})
    expected_rng = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    train_step(model, opt, sched)  # the uninterrupted run's next step
    want = model.state_dict()

    ckpt = tmp_path / "checkpoints" / "step_1"
    fresh, fresh_opt, fresh_sched = make()
    state = load_checkpoint(ckpt, (fresh, fresh_opt, fresh_sched), dist=DIST)
    assert state["step"] == 1 and state["epoch"] == 0 and fresh_sched.last_epoch == 1
    train_step(fresh, fresh_opt, fresh_sched)  # same weights, moments, lr and random batch
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k

    load_checkpoint(ckpt, (fresh, fresh_opt, fresh_sched), dist=DIST)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected_rng


def test_keep_last_k_and_tmp_folders_are_not_checkpoints(tmp_path, tokenizer):
    model, opt, sched = make()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, (model, opt, sched), DIST, tokenizer, "grpo", keeping(2), None, {})
    (tmp_path / "checkpoints" / "step_9.tmp").mkdir()  # a save that was killed half-way
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_3"]
    assert find_resume("auto", tmp_path, "grpo").name == "step_3"
    assert (tmp_path / "checkpoints" / "step_3" / "hf" / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        find_resume(str(tmp_path / "checkpoints" / "step_9.tmp"), tmp_path, "grpo")
    # another recipe's checkpoint (a fork run in its parent's folder) is refused, saying what to do
    for flag in ("auto", str(tmp_path / "checkpoints" / "step_2")):
        with pytest.raises(
            ValueError, match=r"written by recipes/grpo.py, not my_algo.py.*fresh --output-dir.*--model"
        ):
            find_resume(flag, tmp_path, "my_algo")
    assert find_resume("disable", tmp_path, "my_algo") is None


def test_a_completed_run_exits_before_any_model_loads(tmp_path, tokenizer, caplog):
    """find_resume knows the run's length: a checkpoint at or past it ends the process with exit
    status 0 and a sentence saying what to do; a shorter one is resumed."""
    _save(tmp_path, tokenizer, (3,))
    assert find_resume("auto", tmp_path, "grpo", total_steps=4).name == "step_3"
    for total in (3, 2):
        with caplog.at_level("INFO"), pytest.raises(SystemExit) as stop:
            find_resume("auto", tmp_path, "grpo", total_steps=total)
        assert stop.value.code == 0
        assert f"already completed all {total} steps: nothing to train" in caplog.text
        assert "--total-training-steps" in caplog.text


def make_critic():
    from common.critic import load_critic

    critic = load_critic(ModelArgs(path=str(TINY), strategy="ddp", use_remove_padding=False), DIST)
    opt = build_optimizer(critic, 1e-2, 0.0)
    return critic, opt, build_scheduler(opt, kind="cosine", total_steps=10, warmup_ratio=0.2)


def critic_step(critic, opt, sched):
    ids = torch.randint(0, 200, (2, 8))
    critic(input_ids=ids).logits.square().mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_extra_models_roundtrip_with_the_policy(tmp_path, tokenizer):
    """A second (model, optimizer, scheduler), PPO's critic, is saved in the same state and
    restored with the policy: both continue exactly as the uninterrupted run."""
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(0)
    policy, critic = make(), make_critic()
    train_step(*policy), critic_step(*critic), critic_step(*critic)
    save_checkpoint(
        tmp_path, 1, policy, DIST, tokenizer, "ppo", keeping(), None, {"kl_coef": 0.25}, extra_models={"critic": critic}
    )
    torch.manual_seed(7)
    train_step(*policy), critic_step(*critic)
    want_policy, want_critic = policy[0].state_dict(), critic[0].state_dict()

    ckpt = tmp_path / "checkpoints" / "step_1"
    exported = AutoModelForTokenClassification.from_pretrained(ckpt / "hf_critic")
    assert exported.config.num_labels == 1 and (ckpt / "hf" / "model.safetensors").is_file()
    torch.manual_seed(1)
    fresh, fresh_critic = make(), make_critic()
    assert not torch.equal(fresh_critic[0].score.weight, critic[0].score.weight)
    state = resume(
        ckpt,
        fresh,
        dist=DIST,
        extra_models={"critic": fresh_critic},
    )
    assert state["step"] == 1 and state["kl_coef"] == 0.25
    assert fresh[2].last_epoch == 1 and fresh_critic[2].last_epoch == 2
    torch.manual_seed(7)
    train_step(*fresh), critic_step(*fresh_critic)  # same weights, moments, lrs and batches
    for got, want in ((fresh[0].state_dict(), want_policy), (fresh_critic[0].state_dict(), want_critic)):
        for k, v in got.items():
            assert torch.equal(v, want[k]), k

    # a checkpoint saved without the critic cannot silently resume a run that has one
    save_checkpoint(tmp_path, 2, policy, DIST, tokenizer, "ppo", keeping(), None, {})
    with pytest.raises(ValueError, match="saved without critic"):
        resume(
            tmp_path / "checkpoints" / "step_2",
            fresh,
            dist=DIST,
            extra_models={"critic": fresh_critic},
        )


class _RunsCode:
    """A pickle payload that, unpickled without restriction, creates a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _plant(kind: str, ckpt, marker) -> str:
    """Replace one kind of file (or item) a checkpoint holds with a malicious pickle; returns the
    name the refusal must mention."""
    import pickle

    payload = pickle.dumps(_RunsCode(marker), protocol=2)
    state = ckpt / "state"
    if kind == "metadata":
        (state / ".metadata").write_bytes(payload)
        return ".metadata"
    if kind == "rng":
        torch.save({"python": _RunsCode(marker)}, ckpt / "rng_0.pt")
        return "rng_0.pt"
    # a non-tensor item (the optimizer's hyperparameters) pointed at a payload appended to the data
    # file; the metadata stays a well-formed one (only torch's classes), so the reader gets that far
    with open(state / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own, trusted file
    index = next(i for i in metadata.storage_data if "param_groups" in i.fqn)
    info = metadata.storage_data[index]
    data_file = state / info.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(payload)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload))
    with open(state / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return "param_groups"


@pytest.mark.parametrize("kind", ["metadata", "optimizer item", "rng"])
def test_a_malicious_checkpoint_is_refused_and_runs_nothing(tmp_path, tokenizer, kind):
    """Every file a resume reads is parsed without unpickling arbitrary objects: a pickle that would
    run code, planted in the distributed checkpoint's metadata, in one of its non-tensor items, or in
    an RNG file, is refused with a message naming it, and the code never runs."""
    from common.checkpoint import UnsafeCheckpoint, _manifest

    model, opt, sched = make()
    train_step(model, opt, sched)
    save_checkpoint(tmp_path, 1, (model, opt, sched), DIST, tokenizer, "grpo", keeping(), None, {})
    ckpt = tmp_path / "checkpoints" / "step_1"
    marker = tmp_path / "pwned"
    name = _plant(kind, ckpt, marker)
    # the attacker also rewrites the recorded sizes and checksums, so only the reader stands in the way
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["files"] = _manifest(ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    fresh = make()
    with pytest.raises(UnsafeCheckpoint, match=name) as refusal:
        resume(find_resume("auto", tmp_path, "grpo"), fresh, dist=DIST)
    assert "refusing to load it" in str(refusal.value) and "--resume disable" in str(refusal.value)
    assert not marker.exists(), "the planted code ran"


def _save(tmp_path, tokenizer, steps, keep=0, model=None):
    model, opt, sched = model or make()
    for step in steps:
        save_checkpoint(tmp_path, step, (model, opt, sched), DIST, tokenizer, "grpo", keeping(keep), None, {})
    return tmp_path / "checkpoints"


def _truncate(f):
    f.write_bytes(f.read_bytes()[:-7])


def _flip_a_byte(f):
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


DAMAGE = {  # how a checkpoint gets damaged -> the file the message must name
    "a state file cut short": (lambda c: _truncate(next((c / "state").glob("*.distcp"))), ".distcp"),
    "a weight changed": (lambda c: _flip_a_byte(c / "hf" / "model.safetensors"), "model.safetensors"),
    "an rng file missing": (lambda c: (c / "rng_0.pt").unlink(), "rng_0.pt"),
    "a torn trainer state": (lambda c: _truncate(c / "trainer_state.json"), "trainer_state.json"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one(tmp_path, tokenizer, caplog, damage):
    """`--resume auto` takes the newest checkpoint that validates and says which it skipped and
    why; naming the damaged one with --resume PATH is an error that names the bad file."""
    from common.checkpoint import DamagedCheckpoint

    root = _save(tmp_path, tokenizer, (1, 2))
    harm, bad_file = DAMAGE[damage]
    harm(root / "step_2")
    with caplog.at_level("WARNING"):
        assert find_resume("auto", tmp_path, "grpo") == root / "step_1"
    assert "skipping" in caplog.text and "step_2" in caplog.text and bad_file in caplog.text
    with pytest.raises(DamagedCheckpoint, match=bad_file):
        find_resume(str(root / "step_2"), tmp_path, "grpo")
    fresh = make()  # the older one loads
    assert resume(root / "step_1", fresh, dist=DIST)["step"] == 1
    harm(root / "step_1")
    with pytest.raises(DamagedCheckpoint, match=r"no checkpoint .* validates.*--resume disable"):
        find_resume("auto", tmp_path, "grpo")


def test_stale_tmp_folders_go_and_saves_after_an_earlier_resume_replace_the_later_ones(tmp_path, tokenizer, caplog):
    root = _save(tmp_path, tokenizer, (2, 4, 6))
    (root / "step_8.tmp").mkdir()  # a save that was killed half-way
    with caplog.at_level("INFO"):
        assert find_resume(str(root / "step_2"), tmp_path, "grpo") == root / "step_2"
    assert not (root / "step_8.tmp").exists() and "step_8.tmp" in caplog.text
    assert "step_4, step_6" in caplog.text and "first save removes them" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        _save(tmp_path, tokenizer, (3,), keep=2)  # the resumed run's first save
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_3"]
    assert "removed" in caplog.text and "step_6" in caplog.text
    assert find_resume("auto", tmp_path, "grpo").name == "step_3"  # auto continues this run


def test_a_torn_metrics_line_is_dropped_with_a_warning(tmp_path, caplog):
    from common.tracking import Tracker, read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a"')
    with caplog.at_level("WARNING"):
        Tracker(tmp_path, 2, 5, True, TrainerArgs(logger=()), "grpo", {}, {})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "a": 1}, {"step": 2, "a": 2}]
    assert "line 3 is torn" in caplog.text


def test_an_export_that_does_not_read_back_is_an_error(tmp_path, tokenizer):
    from common.checkpoint import DamagedCheckpoint, _check_export

    model = load_policy(str(TINY))
    model.save_pretrained(tmp_path)
    _check_export(tmp_path)
    _truncate(tmp_path / "model.safetensors")
    with pytest.raises(DamagedCheckpoint, match="did not read back"):
        _check_export(tmp_path)


def test_resume_refuses_a_checkpoint_trained_with_other_settings(tmp_path, tokenizer):
    """--resume auto continues only the same run: changed algorithm or data flags are named, with
    the two ways out; changing how long or how often (or the memory layout) is a resume."""
    from common.errors import UsageError

    model, opt, sched = make()
    flags = {"lr": 1e-3, "rollout_n": 4, "train_files": ("a.parquet",), "total_training_steps": 5, "logger": (),
             "use_torch_compile": False}  # fmt: skip
    save_checkpoint(tmp_path, 1, (model, opt, sched), DIST, tokenizer, "grpo", keeping(), flags, {})
    assert find_resume("auto", tmp_path, "grpo", flags=flags).name == "step_1"
    longer = {**flags, "total_training_steps": 9, "logger": ("wandb",), "use_torch_compile": True}
    assert find_resume("auto", tmp_path, "grpo", flags=longer).name == "step_1"
    # a flag a newer version of the library added (or an older one had) is not a changed setting
    newer = {**flags, "a_flag_added_since": True}
    del newer["rollout_n"]
    assert find_resume("auto", tmp_path, "grpo", flags=newer).name == "step_1"
    with pytest.raises(UsageError) as refused:
        find_resume("auto", tmp_path, "grpo", flags={**flags, "lr": 2e-3, "train_files": ("b.parquet",)})
    message = str(refused.value)
    assert "--lr 0.001 (now 0.002)" in message and "--train-files ['a.parquet'] (now ['b.parquet'])" in message
    assert "--rollout-n" not in message and "--output-dir" in message and "--resume disable" in message
    # the same bundled model and data from a checkout moved elsewhere: the run resumes; another bundled task does not
    moved = {
        **flags,
        "model": "/old/place/bundled/tiny-qwen2-sft",
        "train_files": ("/old/place/bundled/addition/train.parquet",),
    }
    save_checkpoint(tmp_path / "moved", 1, (model, opt, sched), DIST, tokenizer, "grpo", keeping(), moved, {})
    here = {
        **moved,
        "model": str(BUNDLED / "tiny-qwen2-sft"),
        "train_files": (str(BUNDLED / "addition" / "train.parquet"),),
    }
    assert find_resume("auto", tmp_path / "moved", "grpo", flags=here).name == "step_1"
    with pytest.raises(
        UsageError, match=r"--model '/old/place/bundled/tiny-qwen2-sft' \(now '/old/place/bundled/nope'\)"
    ):
        find_resume("auto", tmp_path / "moved", "grpo", flags={**moved, "model": "/old/place/bundled/nope"})
