"""Remote rollout engines (common.serving.remote): HF engines in Ray actors, their weight stream, the
staleness bound, engine faults, and grpo.py with --rollout-placement remote.

One trainer process (this one) and two engine actors share a Ray started for the module; the
recipe tests start their own. No Ray process may outlive a test that started Ray."""

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TASK_TRAIN, TINY

from common.data import RLDataArgs, StepPrompts
from common.engines import HFEngine, Sampling
from common.errors import RunStopped
from common.parallel import Dist

pytestmark = pytest.mark.e2e  # Ray: the suite's end-to-end tier (pytest -m e2e)

SFT = ROOT / "bundled" / "tiny-qwen2-sft"
SAMPLING = Sampling(n=4, max_tokens=8)
BATCH = 8  # prompts per step


def ray_processes(include_shared: bool = False) -> list[str]:
    """Ray's own processes (raylet, gcs_server, workers) that belong to this user, but for those of
    the shared cluster (conftest's ray_cluster) unless include_shared."""
    from conftest import SHARED_RAY

    from common.serving.remote import _descendants

    shared = set() if include_shared else {*SHARED_RAY, *(p for root in SHARED_RAY for p in _descendants(root, ""))}
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in shared:
            continue
        try:
            if proc.stat().st_uid != os.getuid():
                continue
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(k in cmd for k in ("raylet", "gcs_server", "ray::", "default_worker.py", "ray/dashboard")):
            found.append(f"{proc.name}: {cmd[:120]}")
    return found


def wait_until_no_ray(seconds: float = 30) -> list[str]:
    deadline = time.time() + seconds
    while (left := ray_processes()) and time.time() < deadline:
        time.sleep(0.5)
    return left


DATA = RLDataArgs(
    train_files=(str(TASK_TRAIN),),
    val_files=(),
    prompt_key="prompt",
    max_prompt_length=64,
    truncation="error",
    filter_overlong_prompts=False,
    train_batch_size=BATCH,
    shuffle=True,
)


@pytest.fixture(scope="module")
def task(tokenizer):
    from common.agents import AgentArgs, EnvArgs
    from common.rewards import RewardArgs
    from common.rollout import load_rl_data
    from common.shaping import ConditioningArgs

    train, _, _ = load_rl_data(DATA, tokenizer, RewardArgs(), AgentArgs(), EnvArgs(), ConditioningArgs())
    return train


def step_prompts(task, steps: int) -> StepPrompts:
    """The prompts of each training step as the RL recipes' rollout takes them (seed 7, shuffled)."""
    return StepPrompts(task, DATA, 7, steps)


def prompts_of(schedule: StepPrompts, step: int) -> list[list[int]]:
    """Step `step`'s prompt ids of every rank, in rank order (one rank here)."""
    return [row["prompt_ids"] for share in schedule.step(step, 1)[1] for row in share]


def start(model, tokenizer, *, model_path=SFT, engines=2, staleness=0, timeout=120, schedule=None, steps=0, **kw):
    from common.serving.remote import RemoteEngines

    return RemoteEngines(
        model,
        Dist(0, 1, 0, torch.device("cpu")),
        0,
        model_path=str(model_path),
        num_engines=engines,
        engine_num_cpus=1,
        engine_num_gpus=0,
        ray_address=None,
        max_staleness=staleness,
        timeout=timeout,
        seed=7,
        dtype="float32",
        trust_remote_code=False,
        pad_id=tokenizer.pad_token_id,
        eos_ids=[tokenizer.eos_token_id],
        batch_size=64,
        schedule=schedule,
        total_steps=steps,
        **kw,
    )


@pytest.fixture
def ray_session(ray_cluster):
    """The module's in-process tests drive the session's shared Ray (conftest's ray_cluster)."""
    yield ray_cluster


def test_the_shared_ray_is_this_process_and_leaves_nothing_of_a_run_behind(ray_session, tokenizer):
    """The shared cluster's processes all descend from its own (so ray_processes can tell them
    from a Ray a run starts itself), and engines closed on it leave no process of theirs."""
    from common.model import load_policy

    shared = ray_processes(include_shared=True)
    assert shared and not ray_processes(), shared
    engines = start(load_policy(str(SFT)), tokenizer, engines=1)
    actors = [p for p in ray_processes(include_shared=True) if "EngineActor" in p]
    assert actors, "the engine actor runs in the shared cluster"
    engines.close()
    deadline = time.time() + 30
    while any(p.split(":")[0] in {a.split(":")[0] for a in actors} for p in ray_processes(include_shared=True)):
        assert time.time() < deadline, "the engine's process outlived close()"
        time.sleep(0.5)


def checksums(model) -> dict[str, float]:
    from common.serving.weight_sync import hf_weights

    return {name: float(t.double().sum()) for name, t in hf_weights(model)}


def nudge(model, step: int) -> None:
    """A stand-in for an optimizer step: every weight moves, differently each time."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(1e-3 * ((i + step) % 5 - 2))


def test_engines_hold_the_trainers_weights_after_every_sync(ray_session, tokenizer):
    """Checksums of every weight equal the trainer's, at start and after a step; versions match;
    and greedy outputs equal the trainer's own HF engine on the same weights (the engines really
    generate with what they were sent)."""
    from common.model import load_policy

    model = load_policy(str(SFT))
    engines = start(model, tokenizer)
    try:
        assert engines.checksums() == [checksums(model)] * 2 and engines.versions() == [0, 0]
        nudge(model, 1)
        engines.update_weights(1)
        assert engines.checksums() == [checksums(model)] * 2 and engines.versions() == [1, 1]
        assert engines.weight_version == 1
        prompts = [[tokenizer.bos_token_id or 1, 20 + i, 30 + i] for i in range(6)]
        greedy = Sampling(n=1, temperature=0, max_tokens=6)
        local = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cpu")
        remote = engines.generate(prompts, greedy)
        assert [g[0].token_ids for g in remote] == [g[0].token_ids for g in local.generate(prompts, greedy)]
        assert {g[0].version for g in remote} == {1}
    finally:
        engines.close()


@pytest.mark.parametrize("change", ["shape", "name"])
def test_a_weight_mismatch_is_an_error_on_both_sides_within_the_timeout(ray_session, tokenizer, tmp_path, change):
    """An engine model whose weights differ from the trainer's (one more MLP unit, or one more
    layer) stops the start: the engine raises (its own message, naming itself and the weight) and
    the trainer stops the run with it, well within the timeout; no tensor is sent."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.model import load_policy

    config = AutoConfig.from_pretrained(TINY)
    if change == "shape":
        config.intermediate_size += 1
    else:
        config.num_hidden_layers += 1
        config.layer_types = [*config.layer_types, config.layer_types[-1]]
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "other")
    t = time.time()
    with pytest.raises(RunStopped) as caught:
        start(load_policy(str(SFT)), tokenizer, model_path=tmp_path / "other", timeout=60)
    message = str(caught.value)
    assert message.startswith("rollout engine 0 failed to agree on the weights: rollout engine 0:"), message
    if change == "shape":
        assert "model.layers.0.mlp.gate_proj.weight has shape" in message and "in the trainer's" in message
    else:
        last = config.num_hidden_layers - 1
        assert f"the trainer never sends model.layers.{last}." in message
    assert time.time() - t < 60


def test_a_hung_engine_is_named_within_the_timeout(ray_session, tokenizer):
    import ray

    from common.model import load_policy

    engines = start(load_policy(str(SFT)), tokenizer, engines=1)
    engines.timeout = 4  # after the start, which loads the model (--engine-timeout covers it too)
    try:
        ray.get(engines.actors[0].slow_down.remote(60))
        t = time.time()
        with pytest.raises(RunStopped, match=r"rollout engine 0 did not generate within --engine-timeout 4s") as e:
            engines.generate([[1, 2, 3]], SAMPLING)
        assert time.time() - t < 15
        # who waits on whom: this rank, the wait and its caller, the engines' queues (common.watchdog)
        assert re.search(
            r"\nrank 0 \(pid \d+ on [^)]+\): step None, policy version 0\n  waits in rollout engine 0 "
            r"to generate \(Ray\) since \d+\.\ds ago \(from common/serving/remote.py:\d+ in \w+",
            str(e.value),
        ), e.value
        assert (
            "rollout engines: 1 engines holding weights version 0; the generate waited on awaits 1 of 1 chunk(s) "
            "from engines [0]; asked ahead: none; 0 restarts"
        ) in str(e.value)
    finally:
        engines.close()


def test_a_weight_stream_to_a_hung_engine_is_named_within_the_timeout(ray_session, tokenizer):
    """An engine that hangs instead of taking the weights (planted): the stream's gloo sends and the
    wait for its receipt each end within --engine-timeout, and the run stops naming the engine,
    with who waits on whom."""
    import ray

    from common.model import load_policy

    engines = start(load_policy(str(SFT)), tokenizer, engines=1)
    try:
        engines.timeout = 4  # after the start; the stream's group joined again with it
        engines.groups = [engines._join(i) for i in range(len(engines.actors))]
        ray.get(engines.actors[0].slow_down.remote(60, ("receive",)))
        t = time.time()
        with pytest.raises(
            RunStopped, match=r"rollout engine 0 did not take the weights within --engine-timeout 4s"
        ) as e:
            engines.update_weights(1)
        assert time.time() - t < 20
        assert "waits in rollout engine 0 to take the weights (Ray) since" in str(e.value), e.value
        assert "rollout engines: 1 engines holding weights version 0" in str(e.value)
    finally:
        engines.close()


def run_steps(engines, model, task, steps, trainer_seconds=0.0):
    """A trainer loop: each step asks for its prompts' completions, 'trains' and syncs. Returns
    per step (the versions that sampled, the completions, the seconds it waited)."""
    schedule = step_prompts(task, steps)
    seen = []
    for step in range(steps):
        prompts = prompts_of(schedule, step)
        t = time.time()
        groups = engines.generate(prompts, SAMPLING)
        waited = time.time() - t
        assert len(groups) == BATCH and all(len(g) == SAMPLING.n for g in groups)
        seen.append(({c.version for g in groups for c in g}, groups, waited))
        time.sleep(trainer_seconds)
        nudge(model, step + 1)
        engines.update_weights(step + 1)
    return seen


@pytest.mark.parametrize(("staleness", "slow"), [(2, "trainer"), (1, "engine")])
def test_no_sample_is_older_than_the_staleness_bound(ray_session, tokenizer, task, staleness, slow):
    """Step t trains only on samples of versions t-k .. t, under a slow trainer (the engines run
    ahead as far as allowed: exactly t-k once the pipeline is full) and a slow engine."""
    import ray

    from common.model import load_policy

    model = load_policy(str(SFT))
    schedule = step_prompts(task, 6)
    engines = start(model, tokenizer, staleness=staleness, schedule=(schedule, SAMPLING), steps=6)
    try:
        if slow == "engine":
            ray.get([a.slow_down.remote(0.5) for a in engines.actors])
        seen = run_steps(engines, model, task, 6, trainer_seconds=1.0 if slow == "trainer" else 0.0)
        for step, (versions, _, _) in enumerate(seen):
            assert min(versions) >= step - staleness and max(versions) <= step, (step, versions)
            assert versions == {max(0, step - staleness)}  # every sample as stale as allowed, no more
        assert engines.stats()["rollout/prefetch_misses"] == 0 and engines.stats()["rollout/stale_resent"] == 0
    finally:
        engines.close()


def test_a_killed_engine_is_restarted_synced_and_loses_no_prompt(ray_session, tokenizer, task):
    """Kill one engine's process while it generates a step's request (--max-staleness 1): Ray
    restarts it, it gets the current weights before it generates again, and its prompts are
    generated again: every prompt comes back once, the chunk sampled as the chunk's fixed seed
    samples it on the current weights, the other engine's chunk as it was."""
    import ray

    from common.model import load_policy

    model = load_policy(str(SFT))
    schedule = step_prompts(task, 4)
    engines = start(model, tokenizer, staleness=1, schedule=(schedule, SAMPLING), steps=4)
    try:
        step0 = engines.generate(prompts_of(schedule, 0), SAMPLING)
        pid = ray.get(engines.actors[1].slow_down.remote(3.0))
        nudge(model, 1)
        engines.update_weights(1)  # sends step 2's request: engine 1 sleeps in its chunk
        os.kill(pid, signal.SIGKILL)
        step1 = engines.generate(prompts_of(schedule, 1), SAMPLING)  # sent before the kill: unharmed
        nudge(model, 2)
        engines.update_weights(2)  # engine 1 is found dead here, restarted and streamed version 2
        assert engines.stats()["rollout/engine_restarts"] == 1
        assert engines.checksums() == [checksums(model)] * 2 and engines.versions() == [2, 2]
        prompts = prompts_of(schedule, 2)
        step2 = engines.generate(prompts, SAMPLING)
        assert engines.stats()["rollout/engine_restarts"] == 1  # one death, counted once
        assert [len(g) for g in step2] == [SAMPLING.n] * BATCH
        half = BATCH // 2  # engine 0 sampled prompts 0-3 on version 1; engine 1's (4-7) again on version 2
        assert {c.version for g in step2[:half] for c in g} == {1}
        assert {c.version for g in step2[half:] for c in g} == {2}
        local = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cpu")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the engine: the same sums, so the same samples
        try:
            torch.manual_seed(engines._seed(2) + 1)
            again = local.generate(prompts[half:], SAMPLING)
        finally:
            torch.set_num_threads(threads)
        assert [[c.token_ids for c in g] for g in step2[half:]] == [[c.token_ids for c in g] for g in again]
        assert len(step0) == len(step1) == BATCH
    finally:
        engines.close()


def test_a_teacher_engine_scores_its_own_weights_and_survives_a_kill(ray_session, tokenizer, task):
    """Engines with no policy (distill.py's --teacher-placement remote) serve model_path as it is:
    their logprobs of given responses are the HF engine's on that model (split over both engines,
    at a temperature), with no weight sync. An engine killed while it scores is restarted, loads
    the model again and scores its chunk again: the same numbers, one restart counted."""
    import threading

    import ray

    from common.model import load_policy

    teacher = ROOT / "bundled" / "tiny-qwen2-teacher"
    engines = start(None, tokenizer, model_path=teacher, role="teacher engine")
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [row["prompt_ids"] for row in task[:6]]
        responses = [torch.randint(10, 100, (n,), generator=g).tolist() for n in (3, 9, 1, 7, 5, 2)]
        local = HFEngine(
            load_policy(str(teacher)), pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cpu"
        ).score(prompts, responses, 0.7)
        served = engines.score(prompts, responses, 0.7)
        assert [len(s) for s in served] == [len(r) for r in responses]
        assert torch.allclose(torch.tensor(sum(served, [])), torch.tensor(sum(local, [])), atol=1e-5)
        assert engines.versions() == [0, 0] and engines.stats()["rollout/engine_restarts"] == 0
        pid = ray.get(engines.actors[1].slow_down.remote(3.0))  # engine 1 sleeps in its chunk: killed there
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        again = engines.score(prompts, responses, 0.7)
        assert engines.stats()["rollout/engine_restarts"] == 1
        assert torch.allclose(torch.tensor(sum(again, [])), torch.tensor(sum(local, [])), atol=1e-5)
    finally:
        engines.close()
