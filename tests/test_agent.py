"""The agent loop (common.agent) with a scripted engine: which tokens are the policy's, what the
model is told when a tool hangs, raises, returns garbage or a call is malformed, and the
tokenisation check."""

import json

import pytest

from common.agent import AgentLoop, Conversation, check_tokenization, parse_tool_calls, read_tool_config
from common.config import UsageError
from common.rewards import TOOLS_PREFIX, RewardPool
from common.rollout import Completion, Sampling, pack_groups

TOOLS = """
import os, time

def add(a, b):
    return str(int(a) + int(b))

def hang(**kwargs):
    time.sleep(60)

def fail(**kwargs):
    raise RuntimeError("the calculator is on fire")

def garbage(**kwargs):
    return {"not": "text"}

def crash(**kwargs):
    os._exit(3)
"""


def schema(name):
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {"type": "object"}}}


@pytest.fixture
def tool_config(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS)
    tools = [
        {"function": f"tools.py:{n}", "tool_schema": schema(n)} for n in ("add", "hang", "fail", "garbage", "crash")
    ]
    (tmp_path / "tools.yaml").write_text(json.dumps({"tools": tools}))  # JSON is YAML
    return str(tmp_path / "tools.yaml")


@pytest.fixture
def pool(tool_config):
    pool = RewardPool(TOOLS_PREFIX + tool_config, workers=2, timeout=2.0)
    yield pool
    pool.close()


class Scripted:
    """An engine that answers from a script: text by the number of tool replies in the prompt."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.weight_version, self.calls = tokenizer, script, 0, []

    def generate(self, prompts, sampling):
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            self.calls.append(text)
            reply = self.script[min(text.count("<|im_start|>tool"), len(self.script) - 1)]
            tokens = self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            tokens = tokens[: sampling.max_tokens]
            done = tokens[-1] == self.tokenizer.eos_token_id
            out.append([Completion(tokens, [-0.25] * len(tokens), "stop" if done else "length")] * sampling.n)
        return out


def row(tokenizer, agent="tool_agent"):
    from common.data import render_chat

    messages = [{"role": "user", "content": "What is 2+3?"}]
    return {"prompt_ids": render_chat(tokenizer, messages, True), "messages": messages, "agent_name": agent,
            "data_source": "t", "ground_truth": "5", "extra_info": {}}  # fmt: skip


def loop(tokenizer, script, pool, tool_config, **kw):
    engine = Scripted(tokenizer, script)
    tools = read_tool_config(tool_config) if tool_config else None
    agent = AgentLoop(engine, tokenizer, tools=tools, pool=pool, max_assistant_turns=kw.pop("turns", 4),
                      max_response_length=kw.pop("length", 200), check_mode=kw.pop("check", "strict"))  # fmt: skip
    return agent, engine


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def test_parse_tool_calls():
    assert parse_tool_calls(f"x {CALL} y") == ([{"name": "add", "arguments": {"a": 2, "b": 3}}], [])
    encoded = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse_tool_calls(encoded)[0] == [{"name": "add", "arguments": {"a": 1}}]
    assert parse_tool_calls("no call")[0] == [] and parse_tool_calls("no call")[1] == []
    calls, errors = parse_tool_calls("<tool_call>{oops</tool_call><tool_call>[1]</tool_call><tool_call>{")
    assert calls == [] and len(errors) == 3
    assert "not valid JSON" in errors[0] and '"name"' in errors[1] and "not closed" in errors[2]


def test_the_mask_covers_exactly_the_sampled_tokens(tokenizer, pool, tool_config):
    """A known conversation: a call, the tool's reply, an answer. The sampled tokens are the two
    scripted turns, in order, and nothing else; the tool's text sits in the masked-out part;
    the engine's logprobs are where the mask is 1, zeros elsewhere."""
    agent, engine = loop(tokenizer, [CALL, "<answer>5</answer>"], pool, tool_config)
    r = row(tokenizer)
    (c,) = agent.generate_rows([r], Sampling(n=1, max_tokens=200))[0]
    eos = tokenizer.eos_token_id
    turn1 = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [eos]
    turn2 = tokenizer("<answer>5</answer>", add_special_tokens=False)["input_ids"] + [eos]
    sampled = [t for t, m in zip(c.token_ids, c.mask) if m]
    assert sampled == turn1 + turn2
    assert c.token_ids[: len(turn1)] == turn1 and c.token_ids[-len(turn2) :] == turn2
    between = tokenizer.decode(c.token_ids[len(turn1) : -len(turn2)])
    assert between == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert all((lp != 0) == bool(m) for lp, m in zip(c.logprobs, c.mask))
    assert len(engine.calls) == 2 and engine.calls[1].endswith("<|im_start|>assistant\n")
    stats = agent.stats()
    assert stats["agent/tool_calls_mean"] == 1 and stats["agent/turns_mean"] == 2
    assert stats["agent/tokenization_mismatches"] == 0
    assert stats["agent/policy_token_share"] == pytest.approx(len(sampled) / len(c.token_ids))
    # The trainer's tensors: response_mask is the conversation's mask.
    batch = pack_groups([(r, c)], 1, tokenizer, "cpu")
    assert batch["response_mask"][0, : len(c.mask)].tolist() == c.mask
    assert batch["response_mask"][0].sum().item() == len(sampled)


def test_single_turn_rows_are_sampled_once(tokenizer, pool, tool_config):
    agent, engine = loop(tokenizer, [CALL, "<answer>5</answer>"], pool, tool_config)
    (c,) = agent.generate_rows([row(tokenizer, "single_turn_agent")], Sampling(n=1, max_tokens=200))[0]
    assert len(engine.calls) == 1 and c.mask == [1] * len(c.token_ids)


@pytest.mark.parametrize(
    ("tool", "told", "counter"),
    [
        ("hang", "did not answer within 2s", "agent/tool_timeouts"),
        ("fail", "failed: RuntimeError: the calculator is on fire", "agent/tool_errors"),
        ("garbage", "a tool must return a str", "agent/tool_errors"),
        ("crash", "failed: reward worker exited with code 3", "agent/tool_errors"),
        ("missing", "no tool named 'missing'", "agent/tool_errors"),
    ],
)
def test_a_failing_tool_answers_the_model_with_an_error(tokenizer, pool, tool_config, tool, told, counter):
    call = CALL.replace('"add"', f'"{tool}"')
    agent, engine = loop(tokenizer, [call, "<answer>5</answer>"], pool, tool_config)
    (c,) = agent.generate_rows([row(tokenizer)], Sampling(n=1, max_tokens=200))[0]
    assert told in engine.calls[1] and "Error:" in tokenizer.decode(c.token_ids)
    assert agent.stats()[counter] == 1
    assert pool.run([("add", {"a": 1, "b": 1})])[0] == ["2"]  # the pool still works (a dead worker is replaced)


def test_a_malformed_call_is_an_error_message_not_a_crash(tokenizer, pool, tool_config):
    agent, engine = loop(tokenizer, ["<tool_call>{add 2 3}</tool_call>", "<answer>5</answer>"], pool, tool_config)
    (c,) = agent.generate_rows([row(tokenizer)], Sampling(n=1, max_tokens=200))[0]
    assert "Error: the tool call is not valid JSON" in engine.calls[1]
    stats = agent.stats()
    assert stats["agent/malformed_calls"] == 1 and stats["agent/tool_calls_mean"] == 0


def test_turn_and_length_limits_end_the_conversation(tokenizer, pool, tool_config):
    agent, engine = loop(tokenizer, [CALL], pool, tool_config, turns=3)  # the model never stops calling
    (c,) = agent.generate_rows([row(tokenizer)], Sampling(n=1, max_tokens=200))[0]
    assert len(engine.calls) == 3 and agent.stats()["agent/turns_mean"] == 3
    agent, engine = loop(tokenizer, [CALL], pool, tool_config, turns=10, length=130)
    (c,) = agent.generate_rows([row(tokenizer)], Sampling(n=1, max_tokens=200))[0]
    assert len(c.token_ids) <= 130 and c.finish_reason == "length"


def test_the_tokenisation_check_names_the_turn_of_a_planted_mismatch(tokenizer):
    """The conversation as built must equal the whole rendering; a turn whose recorded text
    differs from its tokens is caught, naming the turn and both strings."""
    from common.data import render_chat

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ab"},
                {"role": "tool", "content": "7"}, {"role": "assistant", "content": "cd"}]  # fmt: skip
    prompt = render_chat(tokenizer, messages[:1], True)
    whole = render_chat(tokenizer, messages, False)
    conversation = Conversation({}, messages, tokens=whole[len(prompt) : -1])  # built as the loop builds it
    assert check_tokenization(tokenizer, conversation, prompt, "strict") is None
    planted = list(conversation.tokens)
    position = len(planted) - 3  # inside the last assistant turn: "cd" recorded, "cx" tokenised
    planted[position] = tokenizer("x", add_special_tokens=False)["input_ids"][0]
    conversation.tokens = planted
    problem = check_tokenization(tokenizer, conversation, prompt, "strict")
    assert problem.startswith("turn 3:") and "'xd<|im_end|>'" in problem and "'cd<|im_end|>'" in problem
    assert check_tokenization(tokenizer, conversation, prompt, "off") is None


def test_bad_tool_configs_are_refused(tmp_path):
    (tmp_path / "t.py").write_text("def f(): return 'x'\n")
    cases = {
        "tools: []": "at least one tool",
        "tools: [{function: 't.py:f'}]": "needs tool_schema",
        "tools: [{tool_schema: {type: function, function: {name: f}}}]": "needs function: path/to/file.py",
        "tools: [{function: 'nope.py:f', tool_schema: {type: function, function: {name: f}}}]": "does not exist",
        "tools: [: bad": "not valid YAML",
    }
    for text, words in cases.items():
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(UsageError, match=words):
            read_tool_config(str(tmp_path / "c.yaml"))


def tool_task(tmp_path, tool_config_text=None):
    """The bundled addition task with every row a tool_agent row, and a calculator tool."""
    import pyarrow.parquet as pq
    from conftest import TASK_TEST, TASK_TRAIN

    out = {}
    for name, source in (("train", TASK_TRAIN), ("test", TASK_TEST)):
        table = pq.read_table(source)
        table = table.append_column("agent_name", pa_strings(["tool_agent"] * table.num_rows))
        pq.write_table(table, tmp_path / f"{name}.parquet")
        out[name] = str(tmp_path / f"{name}.parquet")
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return str(int(a) + int(b))\n")
    tools = [{"function": "calc.py:add", "tool_schema": schema("add")}]
    (tmp_path / "tools.yaml").write_text(tool_config_text or json.dumps({"tools": tools}))
    return out["train"], out["test"], str(tmp_path / "tools.yaml")


def pa_strings(values):
    import pyarrow as pa

    return pa.array(values, type=pa.string())


def test_grpo_runs_tool_agent_rows_through_the_agent_loop(tmp_path):
    """The recipe takes the agent loop without a change to its algorithm: tool_agent rows and
    --tool-config train for a few steps and log the agent's metrics (the bundled model makes no
    calls yet, so every conversation is one turn)."""
    from conftest import read_metrics, run_recipe

    train, test, tools = tool_task(tmp_path)
    run_recipe("grpo", "--train-files", train, "--val-files", test, "--tool-config", tools, "--total-training-steps",
               "2", "--test-freq", "0", "--save-freq", "0", "--output-dir", tmp_path / "run")  # fmt: skip
    steps = [m for m in read_metrics(tmp_path / "run") if "train/loss" in m]
    assert len(steps) == 2 and all(m["agent/turns_mean"] >= 1 for m in steps)
    assert all(m["agent/policy_token_share"] == 1 for m in steps)  # no tool turn: every token sampled


def test_tool_agent_rows_without_tools_and_a_bad_tool_config_stop_before_loading(tmp_path):
    from conftest import run_recipe

    train, test, tools = tool_task(tmp_path)
    proc = run_recipe("grpo", "--train-files", train, "--val-files", test, "--output-dir", tmp_path / "a", check=False)
    assert proc.returncode == 2 and "tool_agent rows need tools: pass --tool-config" in proc.stderr
    (tmp_path / "broken.py").write_text("raise ImportError('no calculator here')\n")
    (tmp_path / "broken.yaml").write_text(
        json.dumps({"tools": [{"function": "broken.py:add", "tool_schema": schema("add")}]})
    )
    proc = run_recipe("grpo", "--train-files", train, "--val-files", test, "--tool-config", tmp_path / "broken.yaml",
                      "--output-dir", tmp_path / "b", check=False)  # fmt: skip
    assert proc.returncode == 2 and "--tool-config" in proc.stderr and "no calculator here" in proc.stderr
    assert "params" not in proc.stdout  # no model was loaded
    proc = run_recipe("generate", "--data-path", test, "--output-path", tmp_path / "out.parquet", check=False)
    assert proc.returncode == 2 and "tool_agent rows need the agent loop" in proc.stderr  # not sampled as one turn


COLLECTIVE = """
import json, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from test_agent import Scripted, row, CALL
from common.agent import AgentLoop, read_tool_config
from common.model import load_tokenizer
from common.rewards import TOOLS_PREFIX, RewardPool
from common.rollout import Sampling

dist.init_process_group("gloo")
rank = dist.get_rank()


class Collective(Scripted):
    # A collective generate, as FSDP2's forwards and remote engines are: every rank must call it
    # as often, with as many prompts, or the all_gather below fails or hangs.
    rounds = 0

    def generate(self, prompts, sampling):
        sizes = [None, None]
        dist.all_gather_object(sizes, len(prompts))
        assert sizes[0] == sizes[1], sizes
        self.rounds += 1
        return super().generate(prompts, sampling)


tokenizer = load_tokenizer(sys.argv[2])
script = [CALL, CALL, "<answer>5</answer>"] if rank == 0 else ["<answer>5</answer>"]  # 3 turns on rank 0, 1 on rank 1
pool = RewardPool(TOOLS_PREFIX + sys.argv[3], workers=1, timeout=5)
engine = Collective(tokenizer, script)
agent = AgentLoop(engine, tokenizer, tools=read_tool_config(sys.argv[3]), pool=pool, max_assistant_turns=5,
                  max_response_length=400)
groups = agent.generate_rows([row(tokenizer)], Sampling(n=2, max_tokens=200))
pool.close()
print(json.dumps({"rank": rank, "calls": engine.rounds, "turns": agent.stats()["agent/turns_mean"],
                  "n": [len(g) for g in groups]}))
"""


def test_two_processes_sample_in_step_when_their_conversations_differ(tmp_path, tool_config):
    """Rank 0's conversations take three turns, rank 1's one: rank 1 keeps sampling (fillers,
    dropped) so that a collective engine sees both ranks call it as often with as many prompts."""
    import subprocess
    import sys

    from conftest import ROOT, TINY

    (tmp_path / "probe.py").write_text(COLLECTIVE)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29731",
         str(tmp_path / "probe.py"), str(ROOT / "tests"), str(TINY), tool_config],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted(
        (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"]
    )
    assert [r["calls"] for r in results] == [3, 3]  # rank 1: its one turn, then two rounds of fillers
    assert [r["turns"] for r in results] == [3, 1] and [r["n"] for r in results] == [[2], [2]]
