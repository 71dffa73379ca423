"""ppo.py end to end, run as users run it (subprocess): what the critic adds to the shared recipe
tests of test_rl_recipes.py (smoke, resume, micro-batches, 2 processes, learning)."""

import shutil

import pytest
import torch
from conftest import ROOT, read_metrics, run_recipe
from safetensors.torch import load_file

SFT = ROOT / "bundled" / "tiny-qwen2-sft"
FAST = "--train-batch-size 8 --ppo-mini-batch-size 8 --rollout-n 4 --save-freq 0 --no-val-before-train".split()


def weights(path):
    return {k: v.float() for k, v in load_file(path / "model.safetensors").items()}


def test_critic_warmup_keeps_the_policy_and_resume_restores_the_critic(tmp_path, small_files):
    """Two warmup steps train only the critic: the policy exported after them is the starting
    model, the critic moved. Killed after step 4's log and before its save, the run resumes from
    step 2 and repeats steps 3-4, the critic's numbers and the adaptive KL coefficient included."""
    out = tmp_path / "run"
    flags = [*FAST, *small_files, "--output-dir", out, "--total-training-steps", 4, "--test-freq", 0]
    flags += ["--critic-warmup", 2, "--save-freq", 2, "--max-ckpt-to-keep", 0, "--kl-ctrl", "adaptive"]
    run_recipe("ppo", *flags, "--resume", "disable")
    want = read_metrics(out)
    assert [r["step"] for r in want] == [1, 2, 3, 4]
    assert all(r["critic/vf_loss"] > 0 for r in want)
    assert ["train/loss" in r for r in want] == [False, False, True, True], "the policy waits for the critic"
    start, ckpt = weights(SFT), out / "checkpoints"
    warm = weights(ckpt / "step_2" / "hf")
    assert set(warm) == set(start) and all(torch.equal(warm[k], start[k]) for k in start), "policy changed in warmup"
    critic = weights(ckpt / "step_2" / "hf_critic")
    assert not torch.equal(critic["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"])
    trained = weights(ckpt / "step_4" / "hf")
    assert not all(torch.equal(trained[k], start[k]) for k in start), "the policy trains after the warmup"
    assert want[3]["policy/kl_coef"] != want[2]["policy/kl_coef"], "the adaptive coefficient moves"

    shutil.rmtree(ckpt / "step_4")
    run_recipe("ppo", *flags, "--resume", "auto")
    got = read_metrics(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    keys = ("reward/mean", "train/loss", "train/grad_norm", "critic/vf_loss", "critic/grad_norm")
    keys += ("critic/values_mean", "critic/vf_explained_var", "policy/kl_coef", "reward/kl_penalty")
    for a, b in zip(got[2:], want[2:]):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-6), (key, a["step"])
