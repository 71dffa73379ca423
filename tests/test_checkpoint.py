import random

import numpy as np
import pytest
import torch
from conftest import TINY

from common.checkpoint import find_resume, list_checkpoints, load_checkpoint, resume, save_checkpoint
from common.model import load_policy
from common.optim import build_optimizer, build_scheduler
from common.parallel import Dist

DIST = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


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
    save_checkpoint(
        tmp_path,
        1,
        model=model,
        optimizer=opt,
        scheduler=sched,
        tokenizer=tokenizer,
        dist=DIST,
        recipe="grpo",
        trainer_state={"epoch": 0},
    )
    expected_rng = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    train_step(model, opt, sched)  # the uninterrupted run's next step
    want = model.state_dict()

    ckpt = tmp_path / "checkpoints" / "step_1"
    fresh, fresh_opt, fresh_sched = make()
    state = load_checkpoint(ckpt, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, dist=DIST)
    assert state["step"] == 1 and state["epoch"] == 0 and fresh_sched.last_epoch == 1
    train_step(fresh, fresh_opt, fresh_sched)  # same weights, moments, lr and random batch
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k

    load_checkpoint(ckpt, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, dist=DIST)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected_rng


def test_keep_last_k_and_tmp_folders_are_not_checkpoints(tmp_path, tokenizer):
    model, opt, sched = make()
    for step in (1, 2, 3):
        save_checkpoint(
            tmp_path,
            step,
            model=model,
            optimizer=opt,
            scheduler=sched,
            tokenizer=tokenizer,
            dist=DIST,
            recipe="grpo",
            trainer_state={},
            keep=2,
        )
    (tmp_path / "checkpoints" / "step_9.tmp").mkdir()  # a save that was killed half-way
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_3"]
    assert find_resume("auto", tmp_path, "grpo").name == "step_3"
    assert (tmp_path / "checkpoints" / "step_3" / "hf" / "model.safetensors").is_file()
    with pytest.raises(FileNotFoundError):
        find_resume(str(tmp_path / "checkpoints" / "step_9.tmp"), tmp_path, "grpo")
    # another recipe's checkpoint (a fork run in its parent's folder) is refused, saying what to do
    for flag in ("auto", str(tmp_path / "checkpoints" / "step_2")):
        with pytest.raises(
            ValueError, match=r"written by recipes/grpo.py, not my_algo.py.*fresh --output-dir.*--model"
        ):
            find_resume(flag, tmp_path, "my_algo")
    assert find_resume("disable", tmp_path, "my_algo") is None


def test_a_completed_run_exits_before_any_model_loads(tmp_path, caplog):
    """find_resume knows the run's length: a checkpoint at or past it ends the process with exit
    status 0 and a sentence saying what to do; a shorter one is resumed."""
    (tmp_path / "checkpoints" / "step_3").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_3" / "trainer_state.json").write_text('{"step": 3, "recipe": "grpo"}')
    assert find_resume("auto", tmp_path, "grpo", total_steps=4).name == "step_3"
    for total in (3, 2):
        with caplog.at_level("INFO"), pytest.raises(SystemExit) as stop:
            find_resume("auto", tmp_path, "grpo", total_steps=total)
        assert stop.value.code == 0
        assert f"already completed all {total} steps: nothing to train" in caplog.text
        assert "--total-training-steps" in caplog.text


def make_critic():
    from common.model import load_critic

    critic = load_critic(str(TINY), dist=DIST, strategy="ddp")
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
        tmp_path, 1, model=policy[0], optimizer=policy[1], scheduler=policy[2], tokenizer=tokenizer, dist=DIST,
        recipe="ppo", trainer_state={"kl_coef": 0.25}, extra_models={"critic": critic},
    )  # fmt: skip
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
        ckpt, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2], dist=DIST,
        extra_models={"critic": fresh_critic},
    )  # fmt: skip
    assert state["step"] == 1 and state["kl_coef"] == 0.25
    assert fresh[2].last_epoch == 1 and fresh_critic[2].last_epoch == 2
    torch.manual_seed(7)
    train_step(*fresh), critic_step(*fresh_critic)  # same weights, moments, lrs and batches
    for got, want in ((fresh[0].state_dict(), want_policy), (fresh_critic[0].state_dict(), want_critic)):
        for k, v in got.items():
            assert torch.equal(v, want[k]), k

    # a checkpoint saved without the critic cannot silently resume a run that has one
    save_checkpoint(
        tmp_path, 2, model=policy[0], optimizer=policy[1], scheduler=policy[2], tokenizer=tokenizer, dist=DIST,
        recipe="ppo", trainer_state={},
    )  # fmt: skip
    with pytest.raises(ValueError, match="saved without critic"):
        resume(
            tmp_path / "checkpoints" / "step_2", model=fresh[0], optimizer=fresh[1], scheduler=fresh[2],
            dist=DIST, extra_models={"critic": fresh_critic},
        )  # fmt: skip
