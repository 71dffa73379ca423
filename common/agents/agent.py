"""Multi-turn rollouts with tools (verl's agent loop), on any engine of common.engines.

A row's `agent_name` column picks its loop, as in verl: `single_turn_agent` (the default) samples
one response; `tool_agent` samples an assistant turn, runs the tool calls it makes, appends their
results as tool messages with the model's chat template, and samples again, until a turn makes no
call, --max-assistant-turns is reached or the response-length budget is spent. The trainer sees
the whole conversation after the prompt as one response; its mask marks only the tokens the
policy sampled, so tool tokens never enter the loss, the KL or the entropy, and the engine's
logprobs line up with the sampled tokens (0 elsewhere).

Tools and interactions are declared in --tool-config and --interaction-config (common.agents.tools reads
both files, and the Hermes-format calls in a turn). They run in the hang-proof worker pool of the
rewards (common.rewards.RewardPool): a tool that raises, hangs past --tool-timeout or crashes its
worker answers the model with an error message, and is counted; a malformed call is answered with
an error message too, and counted, never a crash.

Tokenisation: the conversation is built turn by turn from the sampled tokens themselves and the
template's tokens between turns; --tokenization-sanity-check-mode (verl's: strict,
ignore_strippable, off) compares it with the whole conversation tokenised at once and reports a
mismatch with the turn and both token strings.
"""

import logging
import uuid
from dataclasses import dataclass, field, replace

from common.agents.tools import (
    conversation_extra_info,
    parse_tool_calls,
    read_interaction_config,
    read_tool_config,
)
from common.data import render_chat
from common.engines import Completion, Sampling
from common.parallel import all_reduce_max

log = logging.getLogger(__name__)


# --- conversations ----------------------------------------------------------------------------------
@dataclass
class Conversation:
    """One sampled conversation: everything after the prompt, with the sampled-token mask."""

    row: dict
    messages: list[dict]  # the chat so far, prompt included
    tokens: list[int] = field(default_factory=list)  # after the prompt
    mask: list[int] = field(default_factory=list)  # 1: sampled by the policy
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0 where not sampled
    kept: list[int] = field(default_factory=list)  # the engine's kept counts (common.engines.Completion), 0: all
    assistant_turns: int = 0
    user_turns: int = 0  # the interaction's replies
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    malformed_calls: int = 0
    slot: int = 0  # the tool worker its tool-class instances live in (they keep state between calls)
    tool_instances: dict[str, str] = field(default_factory=dict)  # tool class name -> its instance's id
    tool_rewards: dict[str, float] = field(default_factory=dict)  # tool class name -> calc_reward at the end
    tool_step_rewards: dict[str, list[float]] = field(default_factory=dict)  # tool class name -> execute's rewards
    interaction: str | None = None  # the instance id of its interaction, when it has one running
    interaction_errors: int = 0
    turn_scores: list[float] = field(default_factory=list)  # the interaction's, one per reply
    finish_reason: str = "stop"
    done: bool = False

    def add(self, tokens: list[int], sampled: bool, logprobs: list[float] | None = None, kept=None) -> None:
        self.tokens += tokens
        self.mask += [int(sampled)] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.kept += kept if kept is not None else [0] * len(tokens)

    @property
    def agent(self) -> str:
        return self.row.get("agent_name") or "single_turn_agent"

    def completion(self) -> Completion:
        """As the trainer takes it, with conversation_extra_info."""
        extra = conversation_extra_info(
            self.row, self.user_turns, self.assistant_turns, self.turn_scores, self.tool_rewards, self.tool_step_rewards
        )
        kept = self.kept if any(self.kept) else None
        return Completion(self.tokens, self.logprobs, self.finish_reason, mask=self.mask, extra_info=extra, kept=kept)


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
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    malformed_calls: int = 0
    interaction_errors: int = 0
    turn_scores: list[float] = field(default_factory=list)
    tokenization_mismatches: int = 0
    policy_tokens: int = 0
    tokens: int = 0

    def metrics(self) -> dict:
        n = max(1, self.conversations)
        metrics = {
            "agent/turns_mean": self.assistant_turns / n,
            "agent/user_turns_mean": self.user_turns / n,
            "agent/tool_calls_mean": self.tool_calls / n,
            "agent/tool_errors": self.tool_errors,
            "agent/tool_timeouts": self.tool_timeouts,
            "agent/malformed_calls": self.malformed_calls,
            "agent/interaction_errors": self.interaction_errors,
            "agent/tokenization_mismatches": self.tokenization_mismatches,
            "agent/policy_token_share": self.policy_tokens / max(1, self.tokens),
        }
        if self.turn_scores:
            metrics["agent/interaction_score_mean"] = sum(self.turn_scores) / len(self.turn_scores)
        return metrics


class AgentLoop:
    """The agent loop over an engine. generate_rows(rows, sampling) runs each row's agent;
    everything else (generate, update_weights, the lifecycle, weight_version) is the engine's.

    agent: the agent group (--tool-config's tools, --interaction-config's interactions, the turn limits and the
    tokenization check); pool / interaction_pool: the worker pools running the tools and the interactions (one
    worker, which holds every running interaction's state). lockstep: every rank calls the engine equally often
    (needed when its generate is collective, as in training; generate.py's ranks work alone)."""

    def __init__(self, engine, tokenizer, agent, pool, interaction_pool=None, lockstep: bool = True):
        self.engine, self.tokenizer, self.pool, self.interaction_pool = engine, tokenizer, pool, interaction_pool
        self.tools = read_tool_config(agent.tool_config) if agent.tool_config else None
        self.interactions = read_interaction_config(agent.interaction_config) if agent.interaction_config else None
        self.max_turns, self.max_user_turns, self.max_length = agent.max_assistant_turns, agent.max_user_turns, 0
        self.check_mode, self.lockstep = agent.tokenization_sanity_check_mode, lockstep
        self.eos_id = tokenizer.eos_token_id
        self.stats_since = AgentStats()
        self.reported_mismatch = self.reported_interaction_error = self.reported_tool_lifecycle_error = False

    def __getattr__(self, name):  # update_weights, sleep, wake_up, reset_cache, weight_version, ...
        return getattr(self.engine, name)

    def stats(self) -> dict:
        """The engine's counters and agent/* over the conversations since the last call."""
        stats = self.engine.stats() if hasattr(self.engine, "stats") else {}
        stats.update(self.agent_metrics())
        return stats

    def agent_metrics(self) -> dict:
        """agent/* over the conversations since the last call (validation takes its own)."""
        metrics, self.stats_since = self.stats_since.metrics(), AgentStats()
        return metrics

    def generate(self, prompts, sampling: Sampling):
        return self.engine.generate(prompts, sampling)

    def generate_rows(self, rows: list[dict], sampling: Sampling) -> list[list[Completion]]:
        """sampling.n conversations per row, each as one Completion whose mask marks the sampled
        tokens, its tokens at most sampling.max_tokens. Rows of single_turn_agent are sampled as the
        engine samples them."""
        self.max_length = sampling.max_tokens  # a conversation's room, tool results included
        first = self.engine.generate([r["prompt_ids"] for r in rows], sampling)
        conversations = [Conversation(row, list(row["messages"])) for row, group in zip(rows, first) for _ in group]
        for slot, conversation in enumerate(conversations):
            conversation.slot = slot
        self._start_interactions(conversations)
        for conversation, c in zip(conversations, (c for group in first for c in group)):
            self._sampled(conversation, c.token_ids, c.logprobs, c.finish_reason, c.kept)
        self._after_turns(conversations)
        reduce = all_reduce_max if self.lockstep else (lambda value: value)
        while True:
            active = [c for c in conversations if not c.done]
            budget = [self.max_length - len(c.tokens) for c in active]
            # Every rank samples the same number of times with as many prompts (the engines'
            # generate may be collective: FSDP2's forwards, remote engines); fillers are dropped.
            count = reduce(len(active))
            if count == 0:
                break
            # Each conversation generates at most its own room left (a filler 1 token: it is dropped).
            more = replace(
                sampling,
                n=1,
                max_tokens=reduce(max(budget, default=1)),
                budgets=tuple(budget) + (1,) * (count - len(active)),
            )
            inputs = [c.row["prompt_ids"] + c.tokens for c in active]
            outs = self.engine.generate(inputs + [rows[0]["prompt_ids"]] * (count - len(inputs)), more)
            for conversation, left, (out,) in zip(active, budget, outs):
                cut = len(out.token_ids) > left
                finish, kept = "length" if cut else out.finish_reason, out.kept and out.kept[:left]
                self._sampled(conversation, out.token_ids[:left], out.logprobs[:left], finish, kept)
            self._after_turns(active)
        self._finish_tools(conversations)
        self._finish_interactions(conversations)
        for conversation in conversations:
            self._account(conversation)
        n = sampling.n
        done = [c.completion() for c in conversations]
        return [done[i * n : (i + 1) * n] for i in range(len(rows))]

    def _sampled(self, conversation: Conversation, ids, logprobs, finish_reason: str, kept=None) -> None:
        conversation.add(ids, True, logprobs, kept)
        conversation.assistant_turns += 1
        conversation.finish_reason = finish_reason
        text = self.tokenizer.decode([t for t in ids if t != self.eos_id])
        conversation.messages.append({"role": "assistant", "content": text})

    def _after_turns(self, conversations: list[Conversation]) -> None:
        """After each conversation's new assistant turn: run the calls it made (every
        conversation's at once in the tool pool) and append their results; or, when it answered
        and has an interaction, append the interaction's reply; else it is done."""
        calling, answered = [], []
        for c in conversations:
            if c.agent != "tool_agent" or c.finish_reason != "stop" or c.assistant_turns >= self.max_turns:
                c.done = True
                continue
            calls, malformed = parse_tool_calls(c.messages[-1]["content"])
            if calls or malformed:
                calling.append((c, calls, malformed))
            elif c.interaction is not None and c.user_turns < self.max_user_turns:
                answered.append(c)
            else:
                c.done = True
        for (c, _, malformed), replies in zip(calling, self._run_tools(calling)):
            c.malformed_calls += len(malformed)
            self._append(c, [{"role": "tool", "content": reply} for reply in replies])
        for c, result in zip(answered, self._interact(answered)):
            c.user_turns += 1
            if result is None:  # the interaction failed: counted once, and the conversation ends
                c.interaction_errors += 1
                c.done, c.interaction = True, None  # its state may be gone with the worker: no finalize
                continue
            done, message, score = result
            c.turn_scores.append(score)
            if done:
                c.done = True
            else:
                self._append(c, [{"role": "user", "content": message}])

    def _append(self, conversation: Conversation, new: list[dict]) -> None:
        """Append messages through the chat template (unsampled tokens), with the next assistant
        turn's prompt; a conversation with no room left to answer ends before them."""
        between = between_turns(self.tokenizer, conversation.messages, new, self.eos_id, self._schemas())
        if len(conversation.tokens) + len(between) >= self.max_length:
            conversation.finish_reason, conversation.done = "length", True
            return
        conversation.messages.extend(new)
        conversation.add(between, False)

    def _run_tools(self, calling: list[tuple]) -> list[list[str]]:
        """The replies to every conversation's calls (an error text for a malformed call, an
        unknown tool, a tool that raised, timed out or crashed), the known calls run together,
        each in its conversation's worker. A tool class's instance is created for a conversation
        at its first call of that tool."""
        replies = [[f"Error: {m}" for m in malformed] for _, _, malformed in calling]
        known, owners = [], []
        for k, (c, calls, _) in enumerate(calling):
            for call in calls:
                if self.tools is not None and call["name"] in self.tools.names:
                    known.append((c, call))
                    owners.append((k, len(replies[k])))
                    replies[k].append("")
                else:
                    c.tool_errors += 1
                    names = ", ".join(self.tools.names) if self.tools else "none"
                    replies[k].append(f"Error: no tool named {call['name']!r} (tools: {names})")
        if not known:
            return replies
        creating = list(
            {
                (id(c), call["name"]): (c, call["name"])
                for c, call in known
                if call["name"] in self.tools.classes and call["name"] not in c.tool_instances
            }.values()
        )
        made, failed, _ = self._tool_lifecycle("create", creating, lambda c, name: uuid.uuid4().hex)
        for (c, name), instance in zip(creating, made):
            if instance is not None:
                c.tool_instances[name] = instance
        runnable = [
            i
            for i, (c, call) in enumerate(known)
            if call["name"] not in self.tools.classes or call["name"] in c.tool_instances
        ]
        tasks = [
            (
                "execute",
                call["name"],
                c.tool_instances.get(call["name"]),
                call["arguments"],
                self._tools_kwargs(c, call["name"], "execute"),
            )
            for c, call in (known[i] for i in runnable)
        ]
        ran, ran_failures, _ = (
            self.pool.run(tasks, slots=[known[i][0].slot for i in runnable]) if tasks else ([], {}, None)
        )
        results = {i: ran[j] for j, i in enumerate(runnable)}
        failures = {runnable[j]: why for j, why in ran_failures.items()}
        for i, ((k, at), (c, call)) in enumerate(zip(owners, known)):
            name = call["name"]
            c.tool_calls += 1
            if i not in results:
                c.tool_errors += 1
                replies[k][at] = f"Error: the tool {name} could not be created: {failed.get((id(c), name), 'failed')}"
            elif failures.get(i) == "timeout":
                c.tool_timeouts += 1
                replies[k][at] = f"Error: the tool {name} did not answer within {self.pool.timeout:g}s"
            elif i in failures:
                c.tool_errors += 1
                replies[k][at] = f"Error: the tool {name} failed: {failures[i]}"
            elif name in self.tools.classes:
                replies[k][at], step_reward, _ = results[i]
                c.tool_step_rewards.setdefault(name, []).append(step_reward)
            else:
                replies[k][at] = results[i]
        return replies

    def _tools_kwargs(self, c: Conversation, name: str, step: str) -> dict:
        """verl's per-row arguments for a tool class's step: extra_info.tools_kwargs[name][step + "_kwargs"]."""
        extra = c.row.get("extra_info") if isinstance(c.row.get("extra_info"), dict) else {}
        return dict(((extra.get("tools_kwargs") or {}).get(name) or {}).get(f"{step}_kwargs") or {})

    def _tool_lifecycle(self, step: str, pairs: list[tuple], instance_id) -> tuple[list, dict, str | None]:
        """One lifecycle step (create, calc_reward, release) of a tool class for each (conversation,
        tool name), in the conversation's worker: (results, None where it failed; {(id(conversation),
        name): why it failed}; the first traceback). A failure counts as a tool error."""
        if not pairs:
            return [], {}, None
        tasks = [(step, name, instance_id(c, name), None, self._tools_kwargs(c, name, step)) for c, name in pairs]
        results, failures, first_error = self.pool.run(tasks, slots=[c.slot for c, _ in pairs])
        why = {}
        for i, (c, name) in enumerate(pairs):
            if i in failures:
                results[i] = None
                why[(id(c), name)] = failures[i]
                if step != "create":  # a failed create is counted with the call that needed it
                    c.tool_errors += 1
        if failures and not self.reported_tool_lifecycle_error:
            self.reported_tool_lifecycle_error = True
            log.error(
                "a tool class's %s failed (counted in agent/tool_errors; shown once):\n%s",
                step,
                first_error or f"no answer within {self.pool.timeout:g}s",
            )
        return results, why, first_error

    def _finish_tools(self, conversations: list[Conversation]) -> None:
        """At a conversation's end, each tool class instance it created: calc_reward (its score
        reaches the reward function as extra_info.rollout_reward_scores[name]), then release."""
        pairs = [(c, name) for c in conversations for name in c.tool_instances]
        rewards, _, _ = self._tool_lifecycle("calc_reward", pairs, lambda c, name: c.tool_instances[name])
        for (c, name), reward in zip(pairs, rewards):
            if reward is not None:
                c.tool_rewards[name] = reward
        self._tool_lifecycle("release", pairs, lambda c, name: c.tool_instances[name])

    # Interactions run in their pool's one worker; a call that fails or hangs (then the worker is
    # replaced, and every interaction's state with it) ends that conversation, counted.
    def _call_interactions(self, method: str, conversations: list[Conversation]) -> list:
        tasks = []
        for c in conversations:
            kwargs = c.row["interaction_kwargs"]
            tasks.append((method, kwargs["name"], c.interaction, c.messages if method == "respond" else None, kwargs))
        results, failures, first_error = self.interaction_pool.run(tasks) if tasks else ([], {}, None)
        if failures and not self.reported_interaction_error:
            self.reported_interaction_error = True
            reason = first_error or f"no answer within {self.interaction_pool.timeout:g}s"
            log.error(
                "an interaction's %s failed (the conversation ends; counted in agent/interaction_errors; "
                "shown once):\n%s",
                method,
                reason,
            )
        return [None if i in failures else r for i, r in enumerate(results)]

    def _start_interactions(self, conversations: list[Conversation]) -> None:
        starting = [c for c in conversations if c.agent == "tool_agent" and c.row.get("interaction_kwargs")]
        for c in starting:
            c.interaction = uuid.uuid4().hex
        for c, instance in zip(starting, self._call_interactions("start", starting)):
            if instance is None:
                c.interaction_errors += 1
            c.interaction = instance

    def _interact(self, conversations: list[Conversation]) -> list:
        return self._call_interactions("respond", conversations)

    def _finish_interactions(self, conversations: list[Conversation]) -> None:
        running = [c for c in conversations if c.interaction is not None]
        for c, result in zip(running, self._call_interactions("finalize", running)):
            c.interaction_errors += result is None

    def _schemas(self):
        return self.tools.schemas if self.tools else None

    def _account(self, conversation: Conversation) -> None:
        s = self.stats_since
        s.conversations += 1
        s.assistant_turns += conversation.assistant_turns
        s.user_turns += conversation.user_turns
        s.tool_calls += conversation.tool_calls
        s.tool_errors += conversation.tool_errors
        s.tool_timeouts += conversation.tool_timeouts
        s.malformed_calls += conversation.malformed_calls
        s.interaction_errors += conversation.interaction_errors
        s.turn_scores += conversation.turn_scores
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
                    log.warning(
                        "tokenization sanity check (%s): %s (counted in agent/tokenization_mismatches; shown once)",
                        self.check_mode,
                        problem,
                    )
