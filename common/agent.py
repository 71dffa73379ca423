"""Multi-turn rollouts with tools (verl's agent loop), on any engine of common.rollout.

A row's `agent_name` column picks its loop, as in verl: `single_turn_agent` (the default) samples
one response; `tool_agent` samples an assistant turn, runs the tool calls it makes, appends their
results as tool messages with the model's chat template, and samples again, until a turn makes no
call, --max-assistant-turns is reached or the response-length budget is spent. The trainer sees
the whole conversation after the prompt as one response; its mask marks only the tokens the
policy sampled, so tool tokens never enter the loss, the KL or the entropy, and the engine's
logprobs line up with the sampled tokens (0 elsewhere).

Tools are an OpenAI-style function schema plus a Python function, listed in --tool-config (YAML):

    tools:
      - function: tools/calculator.py:add          # path/to/file.py:function_name
        tool_schema:                               # verl's key, OpenAI's function schema
          type: function
          function: {name: add, description: Add two integers, parameters: {...}}

They run in the hang-proof worker pool of the rewards (common.rewards.RewardPool): a tool that
raises, hangs past --tool-timeout or crashes its worker answers the model with an error message,
and is counted. Calls are read from the text in the Hermes format Qwen uses,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; a malformed call is answered with an
error message too, and counted, never a crash.

Tokenisation: the conversation is built turn by turn from the sampled tokens themselves and the
template's tokens between turns; --tokenization-sanity-check-mode (verl's: strict,
ignore_strippable, off) compares it with the whole conversation tokenised at once and reports a
mismatch with the turn and both token strings.
"""

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from common.config import UsageError
from common.data import render_chat
from common.parallel import all_reduce_max
from common.rollout import Completion, Sampling

log = logging.getLogger(__name__)

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


# --- tool calls -------------------------------------------------------------------------------------
def parse_tool_calls(text: str) -> tuple[list[dict], list[str]]:
    """The Hermes-format calls in an assistant turn: ([{"name", "arguments"}], [what was wrong
    with each malformed one])."""
    calls, errors = [], []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(f"the tool call is not valid JSON ({e.msg}): {body.strip()[:200]}")
            continue
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some models send the arguments JSON-encoded once more
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            errors.append(f'a tool call needs {{"name": "...", "arguments": {{...}}}}, got: {body.strip()[:200]}')
            continue
        calls.append({"name": call["name"], "arguments": arguments})
    if text.count("<tool_call>") > text.count("</tool_call>"):
        errors.append("a <tool_call> was not closed with </tool_call>")
    return calls, errors


@dataclass
class ToolConfig:
    """What --tool-config declares: the schemas (for the chat template and the checks here) and
    where each function lives (imported only in the worker processes)."""

    path: str
    schemas: list[dict]
    functions: dict[str, str]  # tool name -> "file.py:function"

    @property
    def names(self) -> list[str]:
        return list(self.functions)


def read_tool_config(path: str) -> ToolConfig:
    """Read and check --tool-config without running any of its code."""
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        raise UsageError(f"--tool-config {path}: file does not exist")
    try:
        config = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        raise UsageError(f"--tool-config {path}: not valid YAML ({e})") from None
    tools = config.get("tools") if isinstance(config, dict) else None
    if not isinstance(tools, list) or not tools:
        raise UsageError(f"--tool-config {path}: expected a top-level `tools:` list with at least one tool")
    schemas, functions = [], {}
    for i, tool in enumerate(tools):
        where = f"--tool-config {path}: tools[{i}]"
        schema = tool.get("tool_schema") if isinstance(tool, dict) else None
        name = ((schema or {}).get("function") or {}).get("name") if isinstance(schema, dict) else None
        if not isinstance(name, str) or not name:
            raise UsageError(f"{where}: needs tool_schema: {{type: function, function: {{name: ..., ...}}}}")
        target = tool.get("function")
        if not isinstance(target, str) or ":" not in target:
            raise UsageError(f"{where} ({name}): needs function: path/to/file.py:function_name")
        source = Path(target.partition(":")[0]).expanduser()
        if not source.is_absolute():
            source = file.parent / source
        if not source.is_file():
            raise UsageError(f"{where} ({name}): file {target.partition(':')[0]!r} does not exist")
        if name in functions:
            raise UsageError(f"{where}: a second tool named {name!r}")
        schemas.append(schema)
        functions[name] = f"{source}:{target.partition(':')[2]}"
    return ToolConfig(str(file), schemas, functions)


def load_tool_functions(path: str):
    """In a worker process: call(name, arguments) running the named tool of --tool-config."""
    from common.rewards import load_reward_fn

    config = read_tool_config(path)
    loaded = {name: load_reward_fn(target) for name, target in config.functions.items()}

    def call(name: str, arguments: dict) -> str:
        return loaded[name](**arguments)

    return call


# --- conversations ----------------------------------------------------------------------------------
@dataclass
class Conversation:
    """One sampled conversation: everything after the prompt, with the sampled-token mask."""

    row: dict
    messages: list[dict]  # the chat so far, prompt included
    tokens: list[int] = field(default_factory=list)  # after the prompt
    mask: list[int] = field(default_factory=list)  # 1: sampled by the policy
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0 where not sampled
    assistant_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    malformed_calls: int = 0
    finish_reason: str = "stop"
    done: bool = False

    def add(self, tokens: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.tokens += tokens
        self.mask += [int(sampled)] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)

    def completion(self) -> Completion:
        return Completion(self.tokens, self.logprobs, self.finish_reason, mask=self.mask)


def between_turns(tokenizer, messages: list[dict], new: list[dict], eos_id: int, tools=None) -> list[int]:
    """The template's tokens after an assistant turn that ended with eos (what it renders after
    the eos, such as a newline), then the `new` messages, then the next assistant turn's prompt.
    The template must render the conversation so far as a prefix of the longer one."""
    before = render_chat(tokenizer, messages, add_generation_prompt=False, tools=tools)
    after = render_chat(tokenizer, messages + new, add_generation_prompt=True, tools=tools)
    if after[: len(before)] != before:
        raise ValueError("the chat template does not render the conversation so far as a prefix of the longer one")
    last_eos = max(i for i, t in enumerate(before) if t == eos_id)
    return before[last_eos + 1 :] + after[len(before) :]


def check_tokenization(tokenizer, conversation: Conversation, prompt_ids: list[int], mode: str, tools=None):
    """None when the turn-by-turn tokens equal the whole conversation tokenised at once (up to
    whitespace-only tokens with ignore_strippable; always with off); else what differs, with the
    turn and both token strings."""
    if mode == "off":
        return None
    built = prompt_ids + conversation.tokens
    whole = render_chat(tokenizer, conversation.messages, add_generation_prompt=False, tools=tools)[: len(built)]

    def keep(ids):
        return [t for t in ids if tokenizer.decode([t]).strip()] if mode == "ignore_strippable" else ids

    if keep(built) == keep(whole):
        return None
    first = next((i for i, (a, b) in enumerate(zip(built, whole)) if a != b), min(len(built), len(whole)))
    turn = _turn_at(tokenizer, conversation, first, tools)
    return (
        f"turn {turn}: built turn by turn {tokenizer.decode(built[first : first + 20])!r}, "
        f"tokenised whole {tokenizer.decode(whole[first : first + 20])!r} (token {first})"
    )


def _turn_at(tokenizer, conversation: Conversation, position: int, tools=None) -> int:
    """Which message of the conversation holds token `position` of the whole rendering."""
    for turn in range(1, len(conversation.messages) + 1):
        if (
            len(render_chat(tokenizer, conversation.messages[:turn], add_generation_prompt=False, tools=tools))
            > position
        ):
            return turn - 1
    return len(conversation.messages) - 1


# --- the loop ---------------------------------------------------------------------------------------
@dataclass
class AgentStats:
    conversations: int = 0
    assistant_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    malformed_calls: int = 0
    tokenization_mismatches: int = 0
    policy_tokens: int = 0
    tokens: int = 0

    def metrics(self) -> dict:
        n = max(1, self.conversations)
        return {
            "agent/turns_mean": self.assistant_turns / n,
            "agent/tool_calls_mean": self.tool_calls / n,
            "agent/tool_errors": self.tool_errors,
            "agent/tool_timeouts": self.tool_timeouts,
            "agent/malformed_calls": self.malformed_calls,
            "agent/tokenization_mismatches": self.tokenization_mismatches,
            "agent/policy_token_share": self.policy_tokens / max(1, self.tokens),
        }


class AgentLoop:
    """The agent loop over an engine. generate_rows(rows, sampling) runs each row's agent;
    everything else (generate, update_weights, the lifecycle, weight_version) is the engine's."""

    def __init__(self, engine, tokenizer, *, tools: ToolConfig | None, pool, max_assistant_turns: int,
                 max_response_length: int, check_mode: str = "strict"):  # fmt: skip
        self.engine, self.tokenizer, self.tools, self.pool = engine, tokenizer, tools, pool
        self.max_turns, self.max_length, self.check_mode = max_assistant_turns, max_response_length, check_mode
        self.eos_id = tokenizer.eos_token_id
        self.stats_since = AgentStats()
        self.reported_mismatch = False

    def __getattr__(self, name):  # update_weights, sleep, wake_up, reset_cache, weight_version, ...
        return getattr(self.engine, name)

    def stats(self) -> dict:
        stats = self.engine.stats() if hasattr(self.engine, "stats") else {}
        stats.update(self.stats_since.metrics())
        self.stats_since = AgentStats()
        return stats

    def generate(self, prompts, sampling: Sampling):
        return self.engine.generate(prompts, sampling)

    def generate_rows(self, rows: list[dict], sampling: Sampling) -> list[list[Completion]]:
        """sampling.n conversations per row, each as one Completion whose mask marks the sampled
        tokens. Rows of single_turn_agent are sampled as the engine samples them."""
        first = self.engine.generate([r["prompt_ids"] for r in rows], sampling)
        conversations = []
        for row, group in zip(rows, first):
            for c in group:
                conversation = Conversation(row, list(row["messages"]))
                conversation.add(c.token_ids, True, c.logprobs)
                conversation.finish_reason = c.finish_reason
                conversation.assistant_turns = 1
                self._after_turn(conversation, c.token_ids, row.get("agent_name") or "single_turn_agent")
                conversations.append(conversation)
        while True:
            active = [c for c in conversations if not c.done]
            budget = [self.max_length - len(c.tokens) for c in active]
            # Every rank samples the same number of times with as many prompts (the engines'
            # generate may be collective: FSDP2's forwards, remote engines); fillers are dropped.
            count = all_reduce_max(len(active))
            if count == 0:
                break
            more = Sampling(n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                            max_tokens=all_reduce_max(max(budget, default=1)))  # fmt: skip
            inputs = [c.row["prompt_ids"] + c.tokens for c in active]
            outs = self.engine.generate(inputs + [rows[0]["prompt_ids"]] * (count - len(inputs)), more)
            for conversation, left, (out,) in zip(active, budget, outs):
                ids, logprobs = out.token_ids[:left], out.logprobs[:left]
                conversation.add(ids, True, logprobs)
                conversation.assistant_turns += 1
                conversation.finish_reason = "length" if len(ids) < len(out.token_ids) else out.finish_reason
                self._after_turn(conversation, ids, "tool_agent")
        for conversation in conversations:
            self._account(conversation)
        n = sampling.n
        done = [c.completion() for c in conversations]
        return [done[i * n : (i + 1) * n] for i in range(len(rows))]

    def _after_turn(self, conversation: Conversation, ids: list[int], agent: str) -> None:
        """Record the turn; with tool_agent, run its calls and append their results, or end."""
        text = self.tokenizer.decode([t for t in ids if t != self.eos_id])
        conversation.messages.append({"role": "assistant", "content": text})
        if agent != "tool_agent" or conversation.finish_reason != "stop":
            conversation.done = True
            return
        calls, malformed = parse_tool_calls(text)
        if not calls and not malformed:  # an answer
            conversation.done = True
            return
        if conversation.assistant_turns >= self.max_turns:
            conversation.done = True
            return
        conversation.malformed_calls += len(malformed)
        replies = [f"Error: {m}" for m in malformed] + self._run(conversation, calls)
        new = [{"role": "tool", "content": reply} for reply in replies]
        between = between_turns(self.tokenizer, conversation.messages, new, self.eos_id, self._schemas())
        conversation.messages.extend(new)
        if len(conversation.tokens) + len(between) >= self.max_length:  # no room left to answer
            conversation.finish_reason, conversation.done = "length", True
            conversation.messages = conversation.messages[: -len(new)]
            return
        conversation.add(between, False)

    def _run(self, conversation: Conversation, calls: list[dict]) -> list[str]:
        known = [c for c in calls if self.tools is not None and c["name"] in self.tools.functions]
        replies = {}
        for c in calls:
            if c not in known:
                conversation.tool_errors += 1
                names = ", ".join(self.tools.names) if self.tools else "none"
                replies[id(c)] = f"Error: no tool named {c['name']!r} (tools: {names})"
        if known:
            results, failures, _ = self.pool.run([(c["name"], c["arguments"]) for c in known])
            for i, c in enumerate(known):
                conversation.tool_calls += 1
                if failures.get(i) == "timeout":
                    conversation.tool_timeouts += 1
                    replies[id(c)] = f"Error: the tool {c['name']} did not answer within {self.pool.timeout:g}s"
                elif i in failures:
                    conversation.tool_errors += 1
                    replies[id(c)] = f"Error: the tool {c['name']} failed: {failures[i]}"
                else:
                    replies[id(c)] = results[i]
        return [replies[id(c)] for c in calls]

    def _schemas(self):
        return self.tools.schemas if self.tools else None

    def _account(self, conversation: Conversation) -> None:
        s = self.stats_since
        s.conversations += 1
        s.assistant_turns += conversation.assistant_turns
        s.tool_calls += conversation.tool_calls
        s.tool_errors += conversation.tool_errors
        s.tool_timeouts += conversation.tool_timeouts
        s.malformed_calls += conversation.malformed_calls
        s.policy_tokens += sum(conversation.mask)
        s.tokens += len(conversation.mask)
        if conversation.assistant_turns > 1 and conversation.finish_reason == "stop":
            problem = check_tokenization(
                self.tokenizer, conversation, conversation.row["prompt_ids"], self.check_mode, self._schemas()
            )
            if problem:
                s.tokenization_mismatches += 1
                if not self.reported_mismatch:
                    self.reported_mismatch = True
                    log.warning("tokenization sanity check (%s): %s (counted in agent/tokenization_mismatches; "
                                "shown once)", self.check_mode, problem)  # fmt: skip
