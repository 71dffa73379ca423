"""--agent-fn (common.agents.endpoint): a user's agent talks to the policy through the OpenAI-compatible endpoint over
the run's engine, with the real `openai` package as its client, and each call becomes one trajectory trained token for
token. The engine here is the real HF engine on the bundled tool model; a spy on its generate records what it sampled,
which the trajectories must hold exactly."""

import importlib.util
import threading

import pytest
import torch
from conftest import BUNDLED, ROOT, read_metrics, run_recipe

pytest.importorskip("openai", reason='the agent endpoint needs its extra: pip install -e ".[agents]"')
pytest.importorskip("fastapi", reason='the agent endpoint needs its extra: pip install -e ".[agents]"')

from common.engines import HFEngine  # noqa: E402
from common.model import load_policy, load_tokenizer  # noqa: E402

MODEL = BUNDLED / "tiny-qwen2-tools"
TASK = BUNDLED / "calculator"
AGENT = ROOT / "tests" / "data" / "calculator_agent.py"


def calculator_agent():
    spec = importlib.util.spec_from_file_location("calculator_agent", AGENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def served():
    """An Endpoint over the HF engine of the tool model, and the (prompts, completions) its generate returned."""
    from common.agents.endpoint import Endpoint
    from common.engines import Sampling

    tokenizer = load_tokenizer(str(MODEL))
    engine = HFEngine(
        load_policy(str(MODEL)), pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cpu"
    )
    calls, real = [], engine.generate

    def spy(prompts, sampling):
        out = real(prompts, sampling)
        calls.append((prompts, out))
        return out

    engine.generate = spy
    endpoint = Endpoint(engine, tokenizer, "127.0.0.1", 0, max_prompt_length=128, model_name="policy")
    endpoint.sampling = Sampling(n=1, temperature=1.0, max_tokens=128)
    yield endpoint, tokenizer, calls
    endpoint.close()


def play(endpoint, agent, rows):
    """Each row's agent call in a thread, with its own trajectory, while this thread answers the endpoint."""
    import openai

    from common.agents.endpoint import Trajectory

    results, done = [None] * len(rows), threading.Event()
    ids = [f"t{i}" for i in range(len(rows))]
    for tid, row in zip(ids, rows):
        endpoint.trajectories[tid] = Trajectory(row)

    def run(i):
        client = openai.OpenAI(base_url=endpoint.url(ids[i]), api_key=endpoint.key, max_retries=0)
        results[i] = agent(client, rows[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(rows))]
    for t in threads:
        t.start()
    waiter = threading.Thread(target=lambda: [t.join() for t in threads] and None or done.set())
    waiter.start()
    endpoint.serve_until(done)
    return results, [endpoint.trajectories.pop(tid) for tid in ids]


def calculator_rows(n: int, tokenizer) -> list[dict]:
    import pyarrow.parquet as pq

    return [
        {"messages": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"], "prompt_ids": None}
        for r in pq.read_table(TASK / "test.parquet").slice(0, n).to_pylist()
    ]


def test_an_agents_trajectories_hold_exactly_the_tokens_the_engine_sampled(served):
    """Four calculator agents at once through the openai client, several turns each with the tool: every token the
    trajectory marks as sampled is one the engine returned for that request, with its logprob, in order; every
    request after the first was the trajectory so far (no re-tokenisation), and the tokens between are the
    template's for the tool's reply, out of the loss."""
    endpoint, tokenizer, calls = served
    torch.manual_seed(0)
    calls.clear()
    rewards, trajectories = play(endpoint, calculator_agent().run, calculator_rows(4, tokenizer))
    assert all(r in (0.0, 1.0) for r in rewards)
    sampled = {}  # the engine's completion of each prompt it was asked
    for prompts, outs in calls:
        for prompt, (out,) in zip(prompts, outs):
            sampled[tuple(prompt)] = out
    assert sum(t.requests for t in trajectories) == sum(len(p) for p, _ in calls) > 4  # some agents called the tool
    for t in trajectories:
        assert t.restarts == 0 and t.requests >= 1
        seen, at = 0, 0
        while at < len(t.tokens):  # each run of sampled tokens continues the prompt it was sampled after
            if t.mask[at]:
                out = sampled[tuple(t.prompt_ids + t.tokens[:at])]
                n = len(out.token_ids) if at + len(out.token_ids) <= len(t.tokens) else len(t.tokens) - at
                assert t.tokens[at : at + n] == out.token_ids[:n] and t.logprobs[at : at + n] == out.logprobs[:n]
                assert all(t.mask[at : at + n])
                at, seen = at + n, seen + 1
            else:
                at += 1
        assert seen == t.requests


def test_a_request_that_rewrites_history_starts_anew_and_wrong_requests_are_refused(served):
    """An agent that edits the model's reply before its next turn gets a new chain (agent/restarts), counted; n > 1
    and a wrong key are HTTP errors the client raises (400, 401), the trajectory going on."""
    import openai

    endpoint, tokenizer, _ = served

    def editing(client, row):
        first = client.chat.completions.create(model="policy", messages=row["messages"])
        edited = {"role": "assistant", "content": first.choices[0].message.content + " (edited)"}
        client.chat.completions.create(
            model="policy", messages=[*row["messages"], edited, {"role": "user", "content": "again"}]
        )
        errors = []
        try:
            client.chat.completions.create(model="policy", messages=row["messages"], n=2)
        except openai.BadRequestError as e:
            errors.append(e.message)
        try:
            openai.OpenAI(base_url=client.base_url, api_key="sk-wrong", max_retries=0).models.list()
        except openai.AuthenticationError:
            errors.append("key")
        return errors

    (errors,), (t,) = play(endpoint, editing, calculator_rows(1, tokenizer))
    assert t.restarts >= 1 and any("n > 1" in e for e in errors) and "key" in errors


FAILING = """
def run(client, row):
    reply = client.chat.completions.create(model="policy", messages=row["messages"])
    if "1" in row["ground_truth"][-1:]:
        raise RuntimeError("the agent's own bug")
    if "2" in row["ground_truth"][-1:]:
        return None  # no reward
    return float(row["ground_truth"] in (reply.choices[0].message.content or ""))
"""
# relative to the checkout, where run_recipe runs
SHORT = ["--model", "bundled/tiny-qwen2-tools", "--train-files", "bundled/calculator/train.parquet",
         "--val-files", "bundled/calculator/test.parquet",
         "--max-prompt-length", "128", "--max-response-length", "128", "--train-batch-size", "4", "--rollout-n", "4",
         "--no-val-before-train", "--test-freq", "0", "--save-freq", "0"]  # fmt: skip


@pytest.mark.e2e
def test_grpo_trains_two_steps_through_an_agent_and_a_failing_agent_ends_only_its_trajectory(tmp_path):
    """grpo.py --agent-fn: 2 steps of 4 prompts x 4 calls of the calculator agent, every call a trajectory with its
    reward; an agent that raises for some rows and returns no reward for others ends only those trajectories
    (agent/fn_failed, reward/errors), the run going on."""
    run_recipe(
        "grpo", *SHORT, "--total-training-steps", "2", "--agent-fn", f"{AGENT}:run", "--output-dir", tmp_path / "a"
    )
    steps = [m for m in read_metrics(tmp_path / "a") if "train/loss" in m]
    assert len(steps) == 2 and all(m["agent/fn_calls"] == 16 and m["agent/fn_failed"] == 0 for m in steps)
    assert all(m["agent/requests_mean"] >= 1 and m["agent/restarts"] == 0 for m in steps)
    (tmp_path / "failing.py").write_text(FAILING)
    run_recipe(
        "grpo",
        *SHORT,
        "--total-training-steps",
        "2",
        "--agent-fn",
        tmp_path / "failing.py",
        "--output-dir",
        tmp_path / "b",
    )
    steps = [m for m in read_metrics(tmp_path / "b") if "train/loss" in m]
    assert len(steps) == 2 and sum(m["agent/fn_failed"] for m in steps) > 0
    assert all(m["reward/errors"] == m["agent/fn_failed"] for m in steps)


def test_an_agent_file_without_the_function_or_a_port_in_use_stops_before_the_model_loads(tmp_path):
    import socket

    (tmp_path / "agent.py").write_text("def play(client, row):\n    return 0.0\n")
    proc = run_recipe("grpo", *SHORT, "--agent-fn", tmp_path / "agent.py", "--output-dir", tmp_path / "a", check=False)
    assert proc.returncode == 2 and "defines no function 'run'" in proc.stderr and "Traceback" not in proc.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        proc = run_recipe("grpo", *SHORT, "--agent-fn", f"{AGENT}:run", "--endpoint-port", port, check=False)
    assert proc.returncode == 2 and f"--endpoint-port {port}" in proc.stderr and "cannot be bound" in proc.stderr
    proc = run_recipe("grpo", *SHORT, "--agent-fn", f"{AGENT}:run", "--tool-config", TASK / "tools.yaml", check=False)
    assert proc.returncode == 2 and "--agent-fn with --tool-config" in proc.stderr


@pytest.mark.e2e
def test_grpo_learns_the_calculator_task_through_an_agent(tmp_path, capsys):
    """The bundled tool task, played by tests/data/calculator_agent.py through the endpoint instead of the agent
    loop: one seeded GRPO step of 16 prompts x 4 calls teaches the tool model to call the calculator, as it does with
    --tool-config (tests/test_agent.py: 2.3% -> 89.1%); held-out greedy accuracy on 128 test prompts rises by at
    least 30 points."""
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(TASK / "test.parquet").slice(0, 128), tmp_path / "val.parquet")
    flags = [f for f in SHORT if f not in ("--no-val-before-train",)]
    run_recipe(
        "grpo",
        *flags,
        "--val-files",
        tmp_path / "val.parquet",
        "--train-batch-size",
        "16",
        "--lr",
        "5e-5",
        "--total-training-steps",
        "1",
        "--test-freq",
        "1",
        "--val-before-train",
        "--agent-fn",
        f"{AGENT}:run",
        "--output-dir",
        tmp_path / "run",
    )
    metrics = read_metrics(tmp_path / "run")
    before, after = metrics[0], metrics[-1]
    with capsys.disabled():
        print(f"\nagent path, calculator: val accuracy {before['val/accuracy']:.1%} -> {after['val/accuracy']:.1%}")
    assert after["val/accuracy"] - before["val/accuracy"] >= 0.30
