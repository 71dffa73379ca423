"""The agent loop (common.agents.agent) with a scripted engine: which tokens are the policy's, what the
model is told when a tool hangs, raises, returns garbage or a call is malformed, and the
tokenisation check."""

import json
import math

import pytest
from conftest import OWN_PLUMBING, torchrun_plan

from common.agents import AgentArgs
from common.agents.agent import AgentLoop, Conversation, check_tokenization
from common.agents.tools import parse_tool_calls, read_tool_config
from common.engines import Completion, Sampling
from common.errors import UsageError
from common.rewards import TOOLS_PREFIX, RewardPool
from common.rollout import pack_groups

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


def write_tool_config(folder) -> str:
    """TOOLS and a tool config naming each of them, written in folder; returns the config's path."""
    (folder / "tools.py").write_text(TOOLS)
    tools = [{"function": f"tools.py:{n}", "tool_schema": schema(n)} for n in TOOL_NAMES]
    (folder / "tools.yaml").write_text(json.dumps({"tools": tools}))  # JSON is YAML
    return str(folder / "tools.yaml")


@pytest.fixture
def tool_config(tmp_path):
    return write_tool_config(tmp_path)


@pytest.fixture
def pool(tool_config):
    pool = RewardPool(TOOLS_PREFIX + tool_config, workers=2, timeout=2.0)
    yield pool
    pool.close()


class Scripted:
    """An engine that answers from a script: text by the number of tool and user replies in the
    prompt after the first user message."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.weight_version, self.calls = tokenizer, script, 0, []

    def generate(self, prompts, sampling):
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            self.calls.append(text)
            turn = text.count("<|im_start|>tool") + text.count("<|im_start|>user") - 1  # replies so far
            reply = self.script[min(turn, len(self.script) - 1)]
            tokens = self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            tokens = tokens[: sampling.max_tokens]
            done = tokens[-1] == self.tokenizer.eos_token_id
            kept = [sampling.top_k] * len(tokens) if sampling.truncated else None  # as an engine under --top-k
            out.append(
                [Completion(tokens, [-0.25] * len(tokens), "stop" if done else "length", kept=kept)] * sampling.n
            )
        return out


TOOL_NAMES = ("add", "hang", "fail", "garbage", "crash")  # the tool_config fixture's


def row(tokenizer, agent="tool_agent", interaction=None):
    """A prompt row as common.data.load_prompts makes it (tool_agent: the fixture's tools listed)."""
    from common.data import render_chat

    messages = [{"role": "user", "content": "What is 2+3?"}]
    tools = [schema(n) for n in TOOL_NAMES] if agent == "tool_agent" else None
    return {
        "prompt_ids": render_chat(tokenizer, messages, True, tools=tools),
        "messages": messages,
        "agent_name": agent,
        "data_source": "t",
        "ground_truth": "5",
        "extra_info": {},
        "interaction_kwargs": interaction,
    }


def loop(tokenizer, script, pool, tool_config, **kw):
    """The agent loop over a Scripted engine; its conversations' budget is the generate call's max_tokens."""
    engine = Scripted(tokenizer, script)
    group = AgentArgs(
        tool_config=tool_config,
        max_assistant_turns=kw.pop("turns", 4),
        tokenization_sanity_check_mode=kw.pop("check", "strict"),
    )
    return AgentLoop(engine, tokenizer, group, pool), engine


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


def test_the_engines_kept_counts_follow_the_sampled_tokens_through_the_turns(tokenizer, pool, tool_config):
    """Under --top-k the engine's kept counts sit on the tokens it sampled in every turn (0, the whole vocabulary,
    on the tool's), so the trainer replays each turn's truncation; without truncation there are none."""
    agent, _ = loop(tokenizer, [CALL, "<answer>5</answer>"], pool, tool_config)
    r = row(tokenizer)
    (c,) = agent.generate_rows([r], Sampling(n=1, top_k=7, max_tokens=200))[0]
    assert c.kept == [7 * m for m in c.mask] and sum(c.mask) < len(c.mask)
    assert pack_groups([(r, c)], 1, tokenizer, "cpu")["kept"][0, : len(c.kept)].tolist() == c.kept
    (c,) = agent.generate_rows([r], Sampling(n=1, max_tokens=200))[0]
    assert c.kept is None and "kept" not in pack_groups([(r, c)], 1, tokenizer, "cpu")


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
        ("crash", "failed: the worker process exited with code 3 (replaced)", "agent/tool_errors"),
        ("missing", "no tool named 'missing'", "agent/tool_errors"),
    ],
)
def test_a_failing_tool_answers_the_model_with_an_error(tokenizer, pool, tool_config, tool, told, counter):
    call = CALL.replace('"add"', f'"{tool}"')
    agent, engine = loop(tokenizer, [call, "<answer>5</answer>"], pool, tool_config)
    (c,) = agent.generate_rows([row(tokenizer)], Sampling(n=1, max_tokens=200))[0]
    assert told in engine.calls[1] and "Error:" in tokenizer.decode(c.token_ids)
    assert agent.stats()[counter] == 1
    assert pool.run([("execute", "add", None, {"a": 1, "b": 1}, {})])[0] == [
        "2"
    ]  # the pool still works (a dead worker is replaced)


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
    agent, engine = loop(tokenizer, [CALL], pool, tool_config, turns=10)
    (c,) = agent.generate_rows([row(tokenizer)], Sampling(n=1, max_tokens=130))[0]
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
        "tools: [{class_name: Tool, tool_schema: {type: function, function: {name: f}}}]": "neither file.py:Class nor package.module.Class",
        "tools: [{class_name: nope.py:Tool, tool_schema: {type: function, function: {name: f}}}]": "file 'nope.py' does not exist",
        "tools: [{class_name: t.py:T, function: 't.py:f', tool_schema: {type: function, function: {name: f}}}]": "not both",
        "tools: [{class_name: t.py:T, config: [1], tool_schema: {type: function, function: {name: f}}}]": "config must be a mapping",
        "tools: [{function: 't.py:f', config: {type: native}, tool_schema: {type: function, function: {name: f}}}]": "config is a tool class's; a function tool takes none",
        "tools: [{function: 't.py:f', kwargs: {}, tool_schema: {type: function, function: {name: f}}}]": r"tools\[0\]: unknown key\(s\) kwargs; an entry has function, class_name, config, tool_schema",
        "tools: [{function: 't.py:f', tool_schema: {type: function, function: {name: f}}}]\nmax_turns: 3": r"unknown top-level key\(s\) max_turns; only `tools:` is read",
    }
    for text, words in cases.items():
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(UsageError, match=words):
            read_tool_config(str(tmp_path / "c.yaml"))


def tool_task(tmp_path, tool_config_text=None, interaction=None):
    """The bundled addition task (512 train and 64 test rows: enough for runs of a few steps) with
    every row a tool_agent row, and a calculator tool; with `interaction`, each row's extra_info
    names it with the row's ground truth (as verl's GSM8K interaction data does)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import TASK_TEST, TASK_TRAIN

    out = {}
    for name, source, size in (("train", TASK_TRAIN, 512), ("test", TASK_TEST, 64)):
        rows = pq.read_table(source).slice(0, size).to_pylist()
        for r in rows:
            r["agent_name"] = "tool_agent"
            if interaction:
                r["extra_info"]["interaction_kwargs"] = {
                    "name": interaction,
                    "ground_truth": r["reward_model"]["ground_truth"],
                }
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
        out[name] = str(tmp_path / f"{name}.parquet")
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return str(int(a) + int(b))\n")
    tools = [{"function": "calc.py:add", "tool_schema": schema("add")}]
    (tmp_path / "tools.yaml").write_text(tool_config_text or json.dumps({"tools": tools}))
    return out["train"], out["test"], str(tmp_path / "tools.yaml")


def test_grpo_runs_tool_agent_rows_through_the_agent_loop(tmp_path):
    """The recipe takes the agent loop without a change to its algorithm: tool_agent rows and
    --tool-config train for a few steps and log the agent's metrics (the bundled model makes no
    calls yet, so every conversation is one turn)."""
    from conftest import read_metrics, run_recipe

    train, test, tools = tool_task(tmp_path)
    run_recipe(
        "grpo",
        "--train-files",
        train,
        "--val-files",
        test,
        "--tool-config",
        tools,
        "--total-training-steps",
        "2",
        "--test-freq",
        "0",
        "--no-val-before-train",
        "--save-freq",
        "0",
        "--max-prompt-length",
        "96",
        "--output-dir",
        tmp_path / "run",
    )
    steps = [m for m in read_metrics(tmp_path / "run") if "train/loss" in m]
    assert len(steps) == 2 and all(m["agent/turns_mean"] >= 1 for m in steps)
    assert all(m["agent/policy_token_share"] == 1 for m in steps)  # no tool turn: every token sampled


@pytest.mark.e2e
@pytest.mark.parametrize("recipe", OWN_PLUMBING)  # a fork with grpo.py's plumbing: grpo.py's run
def test_every_rl_recipe_trains_on_tool_conversations(tmp_path, recipe):
    """Each RL recipe takes the agent loop as it is (no change to its algorithm functions): one
    step on the bundled tool task from the tool checkpoint, whose conversations call the
    calculator, so the trainer sees masks with the tool's tokens left out."""
    import pyarrow.parquet as pq
    from conftest import BUNDLED, read_metrics, run_recipe

    task = BUNDLED / "calculator"
    pq.write_table(pq.read_table(task / "train.parquet").slice(0, 64), tmp_path / "train.parquet")
    run_recipe(
        recipe,
        "--model",
        BUNDLED / "tiny-qwen2-tools",
        "--train-files",
        tmp_path / "train.parquet",
        "--val-files",
        tmp_path / "train.parquet",
        "--tool-config",
        task / "tools.yaml",
        "--max-prompt-length",
        "128",
        "--max-response-length",
        "128",
        "--max-assistant-turns",
        "3",
        "--train-batch-size",
        "8",
        "--rollout-n",
        "4",
        "--total-training-steps",
        "1",
        "--test-freq",
        "0",
        "--no-val-before-train",
        "--save-freq",
        "0",
        "--output-dir",
        tmp_path / "run",
    )
    (step,) = [m for m in read_metrics(tmp_path / "run") if "train/loss" in m]
    assert step["agent/tool_calls_mean"] > 0 and step["agent/policy_token_share"] < 1
    assert all(math.isfinite(step[k]) for k in ("train/loss", "train/grad_norm"))


def test_grpo_runs_an_interaction_and_its_scores_reach_the_reward(tmp_path):
    """grpo.py with the bundled grader (bundled/calculator/interactions.yaml): every answer is
    graded, wrong ones are told so and answered again, and a reward function reading verl's
    extra_info["rollout_reward_scores"] trains on the grader's last score."""
    from conftest import ROOT, read_metrics, run_recipe

    train, test, tools = tool_task(tmp_path, interaction="grader")
    (tmp_path / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    scores = extra_info['rollout_reward_scores']['user_turn_rewards']\n"
        "    return {'score': scores[-1] if scores else 0.0, 'turns': extra_info['num_turns']}\n"
    )
    run_recipe(
        "grpo",
        "--train-files",
        train,
        "--val-files",
        test,
        "--tool-config",
        tools,
        "--interaction-config",
        ROOT / "bundled/calculator/interactions.yaml",
        "--max-user-turns",
        "2",
        "--reward-fn",
        tmp_path / "reward.py",
        "--total-training-steps",
        "2",
        "--test-freq",
        "0",
        "--save-freq",
        "0",
        "--max-prompt-length",
        "96",
        "--max-response-length",
        "48",
        "--output-dir",
        tmp_path / "run",
    )
    steps = [m for m in read_metrics(tmp_path / "run") if "train/loss" in m]
    assert len(steps) == 2
    for m in steps:
        assert 1 <= m["agent/user_turns_mean"] <= 2 and m["agent/interaction_errors"] == 0
        assert m["reward/errors"] == 0  # the reward function found rollout_reward_scores in every extra_info
        turns = m["agent/turns_mean"] + m["agent/user_turns_mean"] + 1  # verl's num_turns, as the reward saw it
        assert m["reward/extra/turns"] == pytest.approx(turns)
        assert 0 <= m["reward/mean"] <= 1 and "agent/interaction_score_mean" in m
        assert m["agent/policy_token_share"] < 1  # the grader's replies are not the policy's tokens
    val = [m for m in read_metrics(tmp_path / "run") if "val/accuracy" in m]  # validation before the first step
    assert val and val[0]["val/agent/user_turns_mean"] >= 1  # its conversations counted apart from training's


def test_tool_agent_rows_without_tools_and_a_bad_tool_config_stop_before_loading(tmp_path):
    from conftest import run_recipe

    train, test, tools = tool_task(tmp_path)
    proc = run_recipe("grpo", "--train-files", train, "--val-files", test, "--output-dir", tmp_path / "a", check=False)
    assert proc.returncode == 2 and "tool_agent rows need tools or interactions: pass --tool-config" in proc.stderr
    (tmp_path / "broken.py").write_text("raise ImportError('no calculator here')\n")
    (tmp_path / "broken.yaml").write_text(
        json.dumps({"tools": [{"function": "broken.py:add", "tool_schema": schema("add")}]})
    )
    proc = run_recipe(
        "grpo",
        "--train-files",
        train,
        "--val-files",
        test,
        "--tool-config",
        tmp_path / "broken.yaml",
        "--max-prompt-length",
        "96",
        "--output-dir",
        tmp_path / "b",
        check=False,
    )
    assert proc.returncode == 2 and "--tool-config" in proc.stderr and "no calculator here" in proc.stderr
    assert "params" not in proc.stdout  # no model was loaded
    proc = run_recipe("generate", "--data-path", test, "--output-path", tmp_path / "out.parquet", check=False)
    assert proc.returncode == 2 and "tool_agent rows need tools or interactions" in proc.stderr  # not one turn


COLLECTIVE = """
import json, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from test_agent import Scripted, row, CALL
from common.agents import AgentArgs
from common.agents.agent import AgentLoop
from common.model import load_tokenizer
from common.rewards import TOOLS_PREFIX, RewardPool
from common.engines import Sampling

if not dist.is_initialized():  # a run before it in the same launch may have started the group
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
agent = AgentLoop(engine, tokenizer, AgentArgs(tool_config=sys.argv[3], max_assistant_turns=5), pool)
groups = agent.generate_rows([row(tokenizer)], Sampling(n=2, max_tokens=400))
pool.close()
# One file per rank: two processes printing to one pipe can interleave their lines.
with open(f"{sys.argv[4]}/rank{rank}.json", "w") as f:
    json.dump({"rank": rank, "calls": engine.rounds, "turns": agent.stats()["agent/turns_mean"],
               "n": [len(g) for g in groups]}, f)
"""


@torchrun_plan
def collective_plan(folder, fixture):
    """COLLECTIVE under 2 processes, each writing its rank's counts in folder."""
    from conftest import ROOT, TINY

    (folder / "probe.py").write_text(COLLECTIVE)
    return {"probe": (folder / "probe.py", [ROOT / "tests", TINY, write_tool_config(folder), folder])}


def test_two_processes_sample_in_step_when_their_conversations_differ(torchrun_runs):
    """Rank 0's conversations take three turns, rank 1's one: rank 1 keeps sampling (fillers,
    dropped) so that a collective engine sees both ranks call it as often with as many prompts
    (collective_plan)."""
    tmp_path, codes = torchrun_runs[__name__]
    assert codes == {"probe": 0}
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["calls"] for r in results] == [3, 3]  # rank 1: its one turn, then two rounds of fillers
    assert [r["turns"] for r in results] == [3, 1] and [r["n"] for r in results] == [[2], [2]]


def test_tool_calls_of_every_conversation_run_together(tokenizer, pool, tool_config):
    """Two rows, two conversations each, every one calling once: the tool pool is asked once,
    with the four calls (so a slow tool costs one round, not one per conversation)."""
    agent, engine = loop(tokenizer, [CALL, "<answer>5</answer>"], pool, tool_config)
    batches = []
    run = pool.run
    pool.run = lambda tasks, slots=None: batches.append(len(tasks)) or run(tasks, slots)
    groups = agent.generate_rows([row(tokenizer), row(tokenizer)], Sampling(n=2, max_tokens=200))
    assert batches == [4] and [len(g) for g in groups] == [2, 2]
    assert agent.stats()["agent/tool_calls_mean"] == 1


# --- interactions ----------------------------------------------------------------------------------
INTERACTIONS = """
import time


class RetryGrader:
    # verl's interface, async as verl's are: a right answer ends the conversation with 1.0, a
    # wrong one is told so (0.0) and the model answers again.
    def __init__(self, config):
        self.config, self.truth = config, {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        self.truth[instance_id] = ground_truth
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        if f"<answer>{self.truth[instance_id]}</answer>" in messages[-1]["content"]:
            return True, "Correct.", 1.0, {}
        return False, "Wrong, try again.", 0.0, {}

    async def finalize_interaction(self, instance_id, **kwargs):
        del self.truth[instance_id]


class Plain:
    # Plain methods, and verl's base-class finalize that takes no arguments.
    def __init__(self, config):
        self.config = config

    def start_interaction(self, instance_id, **kwargs):
        return instance_id

    def generate_response(self, instance_id, messages, mode=None, **kwargs):
        if mode == "hang":
            time.sleep(60)
        if mode == "raise":
            raise RuntimeError("the grader is on fire")
        if mode == "garbage":
            return "not a tuple"
        return False, "Again.", 0.5, {}

    def finalize_interaction(self):
        pass
"""


@pytest.fixture
def interaction_pool(tmp_path):
    from common.rewards import INTERACTIONS_PREFIX

    (tmp_path / "interactions.py").write_text(INTERACTIONS)
    (tmp_path / "interactions.yaml").write_text(
        "interaction:\n  - {name: grader, class_name: interactions.py:RetryGrader, config: {}}\n"
        "  - {name: plain, class_name: interactions.py:Plain}\n"
    )
    pool = RewardPool(INTERACTIONS_PREFIX + str(tmp_path / "interactions.yaml"), workers=1, timeout=2.0)
    yield pool
    pool.close()


def interacting(tokenizer, script, pool, interaction_pool, tool_config, **kw):
    engine = Scripted(tokenizer, script)
    group = AgentArgs(
        tool_config=tool_config,
        interaction_config=interaction_pool.spec.split(":", 1)[1],
        max_assistant_turns=5,
        max_user_turns=kw.pop("user_turns", 5),
    )
    return AgentLoop(engine, tokenizer, group, pool, interaction_pool), engine


def test_an_interaction_replies_until_the_answer_is_right(tokenizer, pool, interaction_pool, tool_config):
    """A wrong answer gets the grader's reply as a user turn (not the policy's tokens) and the
    model answers again; the right one ends it. The turn scores reach the reward function where
    verl's reward functions read them."""
    from common.rollout import reward_task

    agent, engine = interacting(
        tokenizer, ["<answer>4</answer>", "<answer>5</answer>"], pool, interaction_pool, tool_config
    )
    r = row(tokenizer, interaction={"name": "grader", "ground_truth": "5"})
    (c,) = agent.generate_rows([r], Sampling(n=1, max_tokens=200))[0]
    eos = tokenizer.eos_token_id
    turns = [
        tokenizer(t, add_special_tokens=False)["input_ids"] + [eos]
        for t in ("<answer>4</answer>", "<answer>5</answer>")
    ]
    assert [t for t, m in zip(c.token_ids, c.mask) if m] == turns[0] + turns[1]
    assert tokenizer.decode(c.token_ids[len(turns[0]) : -len(turns[1])]) == (
        "\n<|im_start|>user\nWrong, try again.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "Correct." not in tokenizer.decode(c.token_ids)  # the closing reply is not part of the sequence
    # verl counts num_turns as user turns (both replies) + assistant turns + 1 (the prompt)
    assert c.extra_info == {"num_turns": 5, "rollout_reward_scores": {"user_turn_rewards": [0.0, 1.0]}}
    extra = reward_task(r, c, "text")[3]
    assert extra["rollout_reward_scores"]["user_turn_rewards"][-1] == 1.0 and r["extra_info"] == {}  # a copy
    stats = agent.stats()
    assert stats["agent/user_turns_mean"] == 2 and stats["agent/interaction_score_mean"] == 0.5
    assert stats["agent/turns_mean"] == 2 and stats["agent/interaction_errors"] == 0


def test_max_user_turns_ends_the_conversation(tokenizer, pool, interaction_pool, tool_config):
    agent, engine = interacting(tokenizer, ["<answer>4</answer>"], pool, interaction_pool, tool_config, user_turns=2)
    r = row(tokenizer, interaction={"name": "grader", "ground_truth": "5"})
    (c,) = agent.generate_rows([r], Sampling(n=1, max_tokens=200))[0]
    assert c.extra_info["rollout_reward_scores"]["user_turn_rewards"] == [0.0, 0.0]
    assert len(engine.calls) == 3  # answer, told, answer, told, answer: not graded again


@pytest.mark.parametrize("mode", ["hang", "raise", "garbage"])
def test_a_failing_interaction_ends_its_conversation_counted(tokenizer, pool, interaction_pool, tool_config, mode):
    agent, engine = interacting(tokenizer, ["<answer>4</answer>"], pool, interaction_pool, tool_config)
    (c,) = agent.generate_rows([row(tokenizer, interaction={"name": "plain", "mode": mode})], Sampling(n=1))[0]
    assert len(engine.calls) == 1 and agent.stats()["agent/interaction_errors"] == 1
    works = row(tokenizer, interaction={"name": "plain", "mode": None})  # the pool still works after it
    agent, engine = interacting(tokenizer, ["<answer>4</answer>"], pool, interaction_pool, tool_config, user_turns=1)
    (c,) = agent.generate_rows([works], Sampling(n=1, max_tokens=200))[0]
    assert c.extra_info["rollout_reward_scores"]["user_turn_rewards"] == [0.5]
    assert agent.stats()["agent/interaction_errors"] == 0  # its finalize_interaction() takes no arguments


def test_interaction_rows_and_configs_are_checked(tmp_path):
    from common.agents.tools import check_agent_rows, read_interaction_config
    from common.data import DataError

    (tmp_path / "g.py").write_text("class G:\n    pass\n")
    cases = {
        "interaction: []": "at least one entry",
        "interaction: [{name: g}]": "needs name: ... and class_name",
        "interaction: [{name: g, class_name: nope.py:G}]": "does not exist",
        "interaction: [{name: g, class_name: G}]": "neither file.py:Class nor package.module.Class",
        "interaction: [{name: g, class_name: g.py:G}, {name: g, class_name: g.py:G}]": "a second interaction",
        "interaction: [{name: g, class_name: g.py:G, kwargs: {}}]": r"unknown key\(s\) kwargs; an entry has name",
    }
    for text, words in cases.items():
        (tmp_path / "i.yaml").write_text(text)
        with pytest.raises(UsageError, match=words):
            read_interaction_config(str(tmp_path / "i.yaml"))

    def rows(kwargs, agent="tool_agent"):
        return [{"file": "f.parquet", "row": 3, "agent_name": agent, "extra_info": {"interaction_kwargs": kwargs}}]

    with pytest.raises(DataError, match="f.parquet row 3: .*pass --interaction-config"):
        check_agent_rows(rows({"name": "g"}), None, None)
    with pytest.raises(DataError, match="'nope' is not in --interaction-config"):
        check_agent_rows(rows({"name": "nope"}), None, ["g", "h"])
    with pytest.raises(DataError, match="need agent_name tool_agent"):
        check_agent_rows(rows({"name": "g"}, "single_turn_agent"), None, ["g"])
    with pytest.raises(DataError, match="tool_agent rows need tools or interactions"):
        check_agent_rows(rows(None), None, None)
    one = rows({"query": "q"})  # no name, one interaction: it is that one
    check_agent_rows(one, None, ["g"])
    assert one[0]["interaction_kwargs"] == {"query": "q", "name": "g"}


def test_generate_keeps_what_each_conversation_adds_and_evaluate_scores_with_it(tmp_path):
    """generate.py writes each conversation's num_turns and rollout_reward_scores (response_extra_info)
    and evaluate.py hands them to the reward as training does; without the column such a reward
    cannot score the file, and evaluate says so before scoring."""
    import pyarrow.parquet as pq
    from conftest import ROOT, run_recipe

    _, test, tools = tool_task(tmp_path, interaction="grader")
    pq.write_table(pq.read_table(test).slice(0, 48), test)
    out = tmp_path / "gen.parquet"
    run_recipe(
        "generate",
        "--data-path",
        test,
        "--output-path",
        out,
        "--tool-config",
        tools,
        "--interaction-config",
        ROOT / "bundled/calculator/interactions.yaml",
        "--max-user-turns",
        "2",
        "--n-samples",
        "2",
        "--max-prompt-length",
        "96",
        "--max-response-length",
        "48",
    )
    rows = pq.read_table(out).to_pylist()
    added = [json.loads(x) for r in rows for x in r["response_extra_info"]]
    assert len(added) == 96 and all(len(a["rollout_reward_scores"]["user_turn_rewards"]) >= 1 for a in added)
    assert {a["num_turns"] for a in added} > {3}  # one answer graded, and some answered again after "wrong"
    (tmp_path / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return extra_info['num_turns'] + extra_info['rollout_reward_scores']['user_turn_rewards'][-1]\n"
    )
    run_recipe("evaluate", "--data-path", out, "--reward-fn", tmp_path / "reward.py")
    result = json.loads(out.with_name("gen.eval.json").read_text())["all"]
    expected = sum(a["num_turns"] + a["rollout_reward_scores"]["user_turn_rewards"][-1] for a in added) / 96
    assert result["scoring_failures"] == 0 and result["mean_score"] == pytest.approx(expected)
    pq.write_table(pq.read_table(out).drop_columns(["response_extra_info"]), tmp_path / "bare.parquet")
    proc = run_recipe(
        "evaluate", "--data-path", tmp_path / "bare.parquet", "--reward-fn", tmp_path / "reward.py", check=False
    )
    assert proc.returncode == 2 and "reward dry run failed" in proc.stderr


@pytest.mark.e2e
def test_a_killed_multi_turn_run_resumes_exactly(tmp_path):
    """Conversations of several turns (the grader answers each wrong answer) resume as single-turn
    runs do: killed after step 4's log and before its save, the run resumed from step 2's
    checkpoint repeats steps 3-4, its conversations turn for turn."""
    import shutil

    from conftest import ROOT, read_metrics, run_recipe

    train, test, tools = tool_task(tmp_path, interaction="grader")
    out = tmp_path / "run"
    flags = [
        "--train-files",
        train,
        "--val-files",
        test,
        "--tool-config",
        tools,
        "--interaction-config",
        ROOT / "bundled/calculator/interactions.yaml",
        "--max-user-turns",
        "2",
        "--max-prompt-length",
        "96",
        "--max-response-length",
        "48",
        "--train-batch-size",
        "8",
        "--rollout-n",
        "4",
        "--total-training-steps",
        "4",
        "--save-freq",
        "2",
        "--test-freq",
        "0",
        "--no-val-before-train",
        "--max-ckpt-to-keep",
        "0",
        "--output-dir",
        out,
    ]
    run_recipe("grpo", *flags)
    want = read_metrics(out)
    assert min(m["agent/user_turns_mean"] for m in want) > 0  # the grader replied: several turns to resume
    shutil.rmtree(out / "checkpoints" / "step_4")
    run_recipe("grpo", *flags)  # --resume auto: from step 2
    got = read_metrics(out)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    for a, b in zip(got[2:], want[2:]):
        for key in (
            "reward/mean",
            "train/loss",
            "train/grad_norm",
            "agent/user_turns_mean",
            "agent/policy_token_share",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-6), (key, a["step"])


@pytest.mark.e2e
def test_grpo_learns_to_call_the_calculator(tmp_path, capsys):
    """The bundled tool task (docs/multi-turn.md): bundled/tiny-qwen2-tools calls its calculator on
    about half its sampled answers but, greedy, answers at once (and its own products are wrong).
    One seeded GRPO step of 16 prompts x 4 samples teaches it to call: greedy, it calls on (nearly)
    every one of the first 128 test prompts, and its accuracy rises by a wide margin (the bar is 30
    points; the bench measured 2.3% -> 86.3% on 256 prompts after 20 steps). The margin, measured
    with seeds 1-3: with 16 samples per prompt after 1, 2, 4 and 6 steps, and with 4 or 8 after 1
    and 3 steps, alike, accuracy 2.3% -> 89.1% and greedy calls 0.02 -> 1.00 per conversation: the
    flip takes one step."""
    import pyarrow.parquet as pq
    from conftest import BUNDLED, read_metrics, run_recipe

    task = BUNDLED / "calculator"
    pq.write_table(pq.read_table(task / "test.parquet").slice(0, 128), tmp_path / "val.parquet")
    out = tmp_path / "run"
    run_recipe(
        "grpo",
        "--model",
        BUNDLED / "tiny-qwen2-tools",
        "--train-files",
        task / "train.parquet",
        "--val-files",
        tmp_path / "val.parquet",
        "--tool-config",
        task / "tools.yaml",
        "--max-prompt-length",
        "128",
        "--max-response-length",
        "128",
        "--max-assistant-turns",
        "3",
        "--lr",
        "5e-5",
        "--rollout-n",
        "4",
        "--total-training-steps",
        "1",
        "--test-freq",
        "1",
        "--save-freq",
        "0",
        "--output-dir",
        out,
    )
    metrics = read_metrics(out)
    before, after = metrics[0], metrics[-1]
    with capsys.disabled():
        print(
            f"\ntool task: val accuracy {before['val/accuracy']:.1%} -> {after['val/accuracy']:.1%}, greedy calls "
            f"{before['val/agent/tool_calls_mean']:.2f} -> {after['val/agent/tool_calls_mean']:.2f}"
        )
    assert before["val/agent/tool_calls_mean"] <= 0.2 and after["val/agent/tool_calls_mean"] >= 0.9
    assert after["val/accuracy"] >= before["val/accuracy"] + 0.3


def test_per_row_tools_kwargs_go_to_tool_classes_only_and_are_counted_elsewhere(caplog):
    """verl's extra_info.tools_kwargs on a tool_agent row must name tool classes (a function tool
    takes only what the model writes: an error naming the row); on rows that run no tools it is
    unused (as in verl) and counted aloud."""
    from common.agents.tools import check_agent_rows
    from common.data import DataError

    kwargs = {"add": {"create_kwargs": {"ground_truth": "7"}}}

    def rows(agent, n=1, kwargs=kwargs):
        return [
            {"file": "f.parquet", "row": i, "agent_name": agent, "extra_info": {"tools_kwargs": kwargs}}
            for i in range(n)
        ]

    with pytest.raises(DataError, match="f.parquet row 0 column 'extra_info.tools_kwargs': 'add' is a function tool"):
        check_agent_rows(rows("tool_agent"), [schema("add")], None)
    with pytest.raises(DataError, match="'nope' is not a tool of --tool-config"):
        check_agent_rows(rows("tool_agent", kwargs={"nope": {}}), [schema("add")], None, ["add"])
    with pytest.raises(DataError, match="expected a mapping with any of create_kwargs"):
        check_agent_rows(rows("tool_agent", kwargs={"add": {"kwargs": {}}}), [schema("add")], None, ["add"])
    check_agent_rows(rows("tool_agent"), [schema("add")], None, ["add"])  # a tool class takes them
    with caplog.at_level("WARNING", logger="common.agents.tools"):
        check_agent_rows(rows("single_turn_agent", 3), None, None)
    assert "3 rows carry extra_info.tools_kwargs but are not tool_agent rows" in caplog.text
    caplog.clear()
    check_agent_rows([{**rows("tool_agent")[0], "extra_info": {"tools_kwargs": {}}}], [schema("add")], None)
    assert "tools_kwargs" not in caplog.text  # an empty one (verl's preprocessing writes {}) is nothing dropped


VERL_TOOL = """
import asyncio, os
from uuid import uuid4

class Gsm8kLikeTool:
    \"\"\"verl's tool lifecycle, async as verl's tools are: a per-conversation answer checked on demand.\"\"\"

    def __init__(self, config, tool_schema):
        self.config, self.name, self._state = config, tool_schema.function.name, {}

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id = instance_id or str(uuid4())
        self._state[instance_id] = {"truth": ground_truth, "reward": 0.0, "pid": os.getpid()}
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(0)
        state = self._state[instance_id]
        if state["pid"] != os.getpid():
            raise RuntimeError("another worker")
        if parameters.get("answer") == "boom":
            raise RuntimeError("the checker is on fire")
        state["reward"] = float(str(parameters.get("answer")) == state["truth"])
        return f"{self.config['prefix']} {state['reward']}", state["reward"] * kwargs.get("scale", 1.0), {"checked": 1}

    async def calc_reward(self, instance_id, **kwargs):
        return self._state[instance_id]["reward"] + kwargs.get("bonus", 0.0)

    async def release(self, instance_id, **kwargs):
        log = os.environ.get("RELEASED")
        if log:
            with open(log, "a") as f:
                f.write(instance_id + "\\n")
        del self._state[instance_id]
"""


# verl's tool base class and schema, as verl's package lays them out (verl.tools.base_tool.BaseTool,
# verl.tools.schemas.OpenAIFunctionToolSchema) and with its defaults: verl itself is not installed
# here, so this stands in for it on the import path.
VERL_PACKAGE = {
    "verl/__init__.py": "",
    "verl/tools/__init__.py": "",
    "verl/tools/schemas.py": """
from types import SimpleNamespace

class OpenAIFunctionToolSchema:
    def __init__(self, data):
        self.type, self.function = data["type"], SimpleNamespace(**data["function"])

    @classmethod
    def model_validate(cls, data):
        return cls(data)
""",
    "verl/tools/base_tool.py": """
from uuid import uuid4

class BaseTool:
    def __init__(self, config, tool_schema):
        self.config, self.tool_schema, self.name = config, tool_schema, tool_schema.function.name

    async def create(self, instance_id=None, **kwargs):
        return instance_id or str(uuid4())

    async def execute(self, instance_id, parameters, **kwargs):
        return "Updated the tool state.", 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.0

    async def release(self, instance_id, **kwargs):
        pass
""",
}


def test_a_tool_class_on_verls_base_class_loads_where_verl_is_installed(tmp_path, monkeypatch):
    """A tool written against verl's BaseTool (importing it, inheriting its create / calc_reward /
    release) loads where verl's package is importable, and is given verl's own schema class."""
    import sys

    from common.agents.tools import load_tools

    for name, text in VERL_PACKAGE.items():
        (tmp_path / "site" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "site" / name).write_text(text)
    (tmp_path / "echo_tool.py").write_text(
        "from verl.tools.base_tool import BaseTool\n\n"
        "class EchoTool(BaseTool):\n"
        "    async def execute(self, instance_id, parameters, **kwargs):\n"
        "        return f\"{self.name} {type(self.tool_schema).__module__}: {parameters['x']}\", 0.25, {'n': 1}\n"
    )
    config = {"tools": [{"class_name": "echo_tool.py:EchoTool", "config": {}, "tool_schema": schema("echo")}]}
    (tmp_path / "tools.yaml").write_text(json.dumps(config))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    try:
        call = load_tools(str(tmp_path / "tools.yaml"))
        assert call("create", "echo", "conversation-1", None, {}) == "conversation-1"
        assert call("execute", "echo", "conversation-1", {"x": 3}, {}) == (
            "echo verl.tools.schemas: 3",
            0.25,
            {"n": 1.0},
        )
        assert call("calc_reward", "echo", "conversation-1", None, {}) == 0.0  # verl's base class's
        assert call("release", "echo", "conversation-1", None, {}) is None
    finally:
        for module in [m for m in sys.modules if m == "verl" or m.startswith("verl.") or m.startswith("echo_tool")]:
            del sys.modules[module]


def test_a_verl_tool_class_lives_one_instance_per_conversation(tokenizer, tmp_path, monkeypatch):
    """A verl tool class (async create / execute / calc_reward / release) with per-row
    tools_kwargs: each conversation gets its own instance, in one worker, given its row's
    create / execute / calc_reward kwargs; execute's text is the tool message, its step rewards and
    calc_reward reach the reward's extra_info (verl's rollout_reward_scores); every instance is
    released; a raising execute is a counted tool error that ends nothing else."""
    from common.data import render_chat

    monkeypatch.setenv("RELEASED", str(tmp_path / "released"))
    (tmp_path / "verl_tool.py").write_text(VERL_TOOL)
    config = {
        "tools": [
            {
                "class_name": "verl_tool.py:Gsm8kLikeTool",
                "config": {"prefix": "checked:"},
                "tool_schema": schema("check"),
            }
        ]
    }
    (tmp_path / "tools.yaml").write_text(json.dumps(config))
    tool_config = str(tmp_path / "tools.yaml")
    assert read_tool_config(tool_config).classes["check"][1] == {"prefix": "checked:"}
    pool = RewardPool(TOOLS_PREFIX + tool_config, workers=2, timeout=5.0)
    try:

        def script_row(truth, bonus):
            messages = [{"role": "user", "content": f"Say {truth}"}]
            extra = {
                "tools_kwargs": {
                    "check": {
                        "create_kwargs": {"ground_truth": truth},
                        "execute_kwargs": {"scale": 2.0},
                        "calc_reward_kwargs": {"bonus": bonus},
                    }
                }
            }
            return {
                "prompt_ids": render_chat(tokenizer, messages, True, tools=[schema("check")]),
                "messages": messages,
                "agent_name": "tool_agent",
                "data_source": "t",
                "ground_truth": truth,
                "extra_info": extra,
                "interaction_kwargs": None,
            }

        calls = [
            '<tool_call>{"name": "check", "arguments": {"answer": "7"}}</tool_call>',
            '<tool_call>{"name": "check", "arguments": {"answer": "boom"}}</tool_call>',
            "<answer>7</answer>",
        ]
        agent, engine = loop(tokenizer, calls, pool, tool_config, length=400)
        groups = agent.generate_rows([script_row("7", 0.5), script_row("8", 0.0)], Sampling(n=2, max_tokens=400))
    finally:
        pool.close()
    for group, (reward, step) in zip(groups, [(1.5, 2.0), (0.0, 0.0)]):
        for c in group:
            text = tokenizer.decode(c.token_ids)
            assert (
                f"checked: {step / 2}" in text and "the tool check failed: RuntimeError: the checker is on fire" in text
            )
            assert c.extra_info["rollout_reward_scores"] == {"check": reward}
            assert c.extra_info["tool_step_rewards"] == {"check": [step]}
    released = (tmp_path / "released").read_text().split()
    assert len(released) == 4 and len(set(released)) == 4  # one instance per conversation, each released
    stats = agent.stats()
    assert stats["agent/tool_calls_mean"] == 2 and stats["agent/tool_errors"] == 4
