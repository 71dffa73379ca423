"""--agent-fn, a feature: a user's agent program talks to the policy through an OpenAI-compatible endpoint over the
run's engine, and each call of it becomes one trajectory of its group, trained token for token.

The endpoint is FastAPI under uvicorn in a thread of the trainer's process: the stack vLLM's own OpenAI server runs
on, so requests and errors take the OpenAI API's shapes that clients expect. It serves /v1/chat/completions and
/v1/completions on 127.0.0.1 (--endpoint-host) with a key made for the run; each agent call gets a base_url of its
own, .../t/<trajectory>/v1, so every request names its trajectory. The engine stays on the trainer's main thread: the
server queues each request, and the main thread answers the queue in batches while the agents run in worker
processes (common.rewards.RewardPool, under --agent-timeout: an agent that raises, hangs or returns no reward ends
only its own trajectory, counted, its tokens kept out of the loss).

Tokens are recorded as sampled. A request that continues its trajectory (the messages so far, the reply as it was
returned, then new ones) gets the earlier tokens exactly and the template's tokens for the new messages
(common.agents.agent.between_turns): the model's own reply is never tokenised again. A request that does not continue
(history rewritten, a reply edited, a turn cut at its length) starts the trajectory anew, counted in agent/restarts and
said once; its last chain is what trains. The run's sampling settings (--temperature, --top-p, ...) are the ones the
trainer replays, so a request's own are not used: counted in agent/sampling_overridden.
"""

import asyncio
import concurrent.futures
import importlib.util
import json
import logging
import queue
import secrets
import socket
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path

from common.agents.agent import between_turns
from common.agents.caller import EXTRA
from common.agents.tools import parse_tool_calls
from common.data import render_chat
from common.engines import Completion, Sampling
from common.errors import UsageError

log = logging.getLogger(__name__)
KNOBS = {"temperature": "temperature", "top_p": "top_p"}  # a request's sampling keys -> Sampling's fields


def _imports():
    try:
        import fastapi
        import uvicorn
    except ImportError:
        raise UsageError(f"--agent-fn: the endpoint needs FastAPI and uvicorn; {EXTRA}") from None
    return fastapi, uvicorn


def check_agent_fn(args) -> None:
    """--agent-fn's flags (the flat view of every flag), before anything loads: its file, what the agent does alone,
    the packages, the port."""
    path = args.agent_fn.partition(":")[0]
    if not Path(path).expanduser().is_file():
        raise UsageError(f"--agent-fn {args.agent_fn}: file {path!r} does not exist")
    for other in ("tool_config", "interaction_config", "env_config", "reward_fn", "reward_model", "judge_url"):
        if getattr(args, other, None):
            flag = "--" + other.replace("_", "-")
            raise UsageError(
                f"--agent-fn with {flag}: the agent plays the conversation and returns the reward; drop {flag}"
            )
    if getattr(args, "rollout_placement", "colocated") == "remote":
        raise UsageError(
            "--agent-fn with --rollout-placement remote: not built yet; the endpoint serves a colocated engine"
        )
    if getattr(args, "strategy", "") == "fsdp2":
        raise UsageError(
            "--agent-fn with --strategy fsdp2: FSDP2's generate is collective while each process's agents ask when "
            "they like; use --strategy ddp"
        )
    _imports()
    if importlib.util.find_spec("openai") is None:
        raise UsageError(f"--agent-fn: agents get an openai client; {EXTRA}")
    check_port(args.endpoint_host, args.endpoint_port)


def check_port(host: str, port: int) -> None:
    """A port that cannot be bound is a UsageError now, before any model loads (0: any free one)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise UsageError(
                f"--endpoint-port {port}: {host}:{port} cannot be bound ({e.strerror}); pick another, or 0"
            ) from None


@dataclass
class Trajectory:
    """One agent call's tokens after its first prompt, as sampled, with the chat as rendered and as returned."""

    row: dict
    prompt_ids: list[int] | None = None  # its first request's, or its latest chain's
    history: list[dict] = field(default_factory=list)  # the chat as rendered: the assistant's turns as sampled
    returned: list[dict] = field(default_factory=list)  # the chat as the agent holds it: our replies as sent
    prompt_text: str = ""  # /v1/completions: the prompt and the text returned so far
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    tools: list | None = None
    requests: int = 0
    restarts: int = 0

    def restart(self, prompt_ids: list[int]) -> None:
        self.prompt_ids, self.tokens, self.mask, self.logprobs, self.kept = prompt_ids, [], [], [], []
        self.restarts += 1

    def add(self, tokens, sampled: bool, logprobs=None, kept=None) -> None:
        self.tokens += tokens
        self.mask += [int(sampled)] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.kept += kept if kept is not None else [0] * len(tokens)


def _canonical(message) -> tuple:
    """What a chat message says, for telling whether a request continues: role, text, tool calls (ids left out)."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments")
        calls.append((function.get("name"), json.loads(arguments) if isinstance(arguments, str) else arguments))
    return message.get("role"), message.get("content") or "", calls


def _error(message: str, status: int = 400) -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}


class Endpoint:
    """The server and its queue; the main thread answers the queue (serve_until) with `engine` and `tokenizer`."""

    def __init__(self, engine, tokenizer, host: str, port: int, max_prompt_length: int, model_name: str):
        fastapi, uvicorn = _imports()
        self.engine, self.tokenizer, self.max_prompt_length = engine, tokenizer, max_prompt_length
        self.key, self.model_name, self.queue = "sk-" + secrets.token_hex(16), model_name, queue.Queue()
        self.trajectories: dict[str, Trajectory] = {}
        self.sampling = Sampling()
        self.overridden = self.refused = 0
        self.said_restart = self.said_override = False
        app = fastapi.FastAPI()

        async def answer(tid: str, kind: str, request: fastapi.Request):
            if request.headers.get("authorization") != f"Bearer {self.key}":
                return fastapi.responses.JSONResponse(_error("wrong API key", 401)[1], status_code=401)
            try:
                body = await request.json()
            except ValueError:
                return fastapi.responses.JSONResponse(_error("the body is not JSON")[1], status_code=400)
            future = concurrent.futures.Future()
            self.queue.put((tid, kind, body, future))
            status, reply = await asyncio.wrap_future(future)
            return fastapi.responses.JSONResponse(reply, status_code=status)

        @app.post("/t/{tid}/v1/chat/completions")
        async def chat(tid: str, request: fastapi.Request):
            return await answer(tid, "chat", request)

        @app.post("/t/{tid}/v1/completions")
        async def completions(tid: str, request: fastapi.Request):
            return await answer(tid, "text", request)

        @app.get("/t/{tid}/v1/models")
        async def models(tid: str, request: fastapi.Request):
            if request.headers.get("authorization") != f"Bearer {self.key}":
                return fastapi.responses.JSONResponse(_error("wrong API key", 401)[1], status_code=401)
            return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "recipes"}]}

        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise UsageError(f"--endpoint-port {port}: {host}:{port} cannot be bound ({e.strerror})") from None
        self.host, self.port = host, sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and self.thread.is_alive() and time.time() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError(f"the agent endpoint did not start on {host}:{self.port}")

    def url(self, tid: str) -> str:
        return f"http://{self.host}:{self.port}/t/{tid}/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine = None  # a vLLM engine tears down process-wide state when it goes: now, not at a later collection

    # --- the main thread's side -----------------------------------------------------------------------------
    def serve_until(self, done: threading.Event) -> None:
        """Answer queued requests in batches (those that arrive within a few ms together) until `done` is set."""
        while not done.is_set() or not self.queue.empty():
            try:
                batch = [self.queue.get(timeout=0.005)]
            except queue.Empty:
                continue
            time.sleep(0.003)  # agents that run together ask together: one generate for them
            while True:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            self._answer(batch)

    def _answer(self, batch: list) -> None:
        ready = []  # (trajectory, kind, body, future, prompt ids, budget)
        for tid, kind, body, future in batch:
            trajectory = self.trajectories.get(tid)
            try:
                if trajectory is None:
                    raise ValueError(f"no trajectory {tid} is running (its agent call ended?)")
                ids, budget = self._prompt(trajectory, kind, body)
            except (ValueError, KeyError, TypeError) as e:
                self.refused += 1
                future.set_result(_error(str(e)))
                continue
            ready.append((trajectory, kind, body, future, ids, budget))
        if not ready:
            return
        budgets = [r[5] for r in ready]
        sampling = replace(self.sampling, n=1, max_tokens=max(budgets), budgets=tuple(budgets))
        try:
            outs = self.engine.generate([r[4] for r in ready], sampling)
        except BaseException:  # the run stops; no agent waits for an answer that cannot come
            for r in ready:
                r[3].set_result(_error("the engine failed; the run is stopping", 500))
            raise
        for (trajectory, kind, body, future, ids, budget), (out,) in zip(ready, outs):
            future.set_result((200, self._reply(trajectory, kind, body, ids, out, budget)))

    def _prompt(self, t: Trajectory, kind: str, body: dict) -> tuple[list[int], int]:
        """The request's prompt ids (the trajectory's tokens where it continues) and how many tokens it may sample;
        what the template adds for new messages joins the trajectory, out of the loss."""
        if body.get("n", 1) != 1:
            raise ValueError("n > 1: an agent call is one trajectory; --rollout-n makes the group")
        knobs = {k: body[k] for k in KNOBS if body.get(k) is not None}
        if any(getattr(self.sampling, KNOBS[k]) != v for k, v in knobs.items()):
            self.overridden += 1
            if not self.said_override:
                self.said_override = True
                log.warning("an agent asked for %s: sampled at the run's (the trainer replays those; counted)", knobs)
        t.requests += 1
        if kind == "chat":
            new = self._chat_prompt(t, body)
        else:
            new = self._text_prompt(t, body)
        left = self.sampling.max_tokens - len(t.tokens)
        cap = body.get("max_completion_tokens") or body.get("max_tokens") or left
        return new, min(int(cap), left)

    def _room(self, t: Trajectory, added: list[int]) -> None:
        """The new messages and at least one token to sample fit the trajectory's --max-response-length."""
        if len(t.tokens) + len(added) >= self.sampling.max_tokens:
            raise ValueError(
                f"the trajectory's --max-response-length {self.sampling.max_tokens} is spent ({len(t.tokens)} tokens "
                f"so far, {len(added)} more for the new messages)"
            )

    def _start(self, t: Trajectory, ids: list[int]) -> list[int]:
        if len(ids) > self.max_prompt_length:
            raise ValueError(
                f"a first prompt of {len(ids)} tokens is past --max-prompt-length {self.max_prompt_length}"
            )
        if t.prompt_ids is not None:
            t.restart(ids)
            if not self.said_restart:
                self.said_restart = True
                log.warning("an agent's request did not continue its trajectory: it starts anew (agent/restarts)")
        t.prompt_ids = ids
        return ids

    def _chat_prompt(self, t: Trajectory, body: dict) -> list[int]:
        messages, tools = body["messages"], body.get("tools")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of objects")
        said = [_canonical(m) for m in messages[: len(t.returned)]]
        ended = bool(t.tokens) and t.tokens[-1] == self.tokenizer.eos_token_id  # the template's turn end sampled
        if ended and tools == t.tools and said == [_canonical(m) for m in t.returned]:
            new = messages[len(t.returned) :]
            added = between_turns(self.tokenizer, t.history, new, self.tokenizer.eos_token_id, tools=tools)
            self._room(t, added)
            t.add(added, sampled=False)
            t.history, t.returned = t.history + new, list(messages)
            return t.prompt_ids + t.tokens
        t.history, t.returned, t.tools = list(messages), list(messages), tools
        return self._start(t, render_chat(self.tokenizer, messages, add_generation_prompt=True, tools=tools))

    def _text_prompt(self, t: Trajectory, body: dict) -> list[int]:
        prompt = body["prompt"]
        if isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):  # token ids
            so_far = (t.prompt_ids or []) + t.tokens
            if t.prompt_ids is not None and prompt[: len(so_far)] == so_far:
                self._room(t, prompt[len(so_far) :])
                t.add(prompt[len(so_far) :], sampled=False)
                return prompt
            return self._start(t, list(prompt))
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string or a list of token ids")
        if t.prompt_ids is not None and t.prompt_text and prompt.startswith(t.prompt_text):
            added = self.tokenizer(prompt[len(t.prompt_text) :], add_special_tokens=False)["input_ids"]
            self._room(t, added)
            t.add(added, sampled=False)
            t.prompt_text = prompt
            return t.prompt_ids + t.tokens
        t.prompt_text = prompt
        return self._start(t, self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def _reply(self, t: Trajectory, kind: str, body: dict, ids: list[int], out: Completion, budget: int) -> dict:
        tokens, logprobs = out.token_ids[:budget], out.logprobs[:budget]
        kept = out.kept[:budget] if out.kept else None
        finish = "length" if len(out.token_ids) > budget else out.finish_reason
        stops = body.get("stop") or []
        text, cut = self._text(tokens, [stops] if isinstance(stops, str) else stops)
        if cut < len(tokens):
            tokens, logprobs, kept, finish = tokens[:cut], logprobs[:cut], kept and kept[:cut], "stop"
        t.add(tokens, sampled=True, logprobs=logprobs, kept=kept)
        t.finish_reason = finish
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens)}
        head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": self.model_name}
        if kind == "text":
            t.prompt_text += text
            lp = {"tokens": [self.tokenizer.decode([i]) for i in tokens], "token_logprobs": logprobs}
            choice = {
                "index": 0,
                "text": text,
                "finish_reason": finish,
                "logprobs": lp if body.get("logprobs") else None,
            }
            return {**head, "object": "text_completion", "choices": [choice], "usage": usage}
        raw = self.tokenizer.decode([i for i in tokens if i != self.tokenizer.eos_token_id])
        t.history.append({"role": "assistant", "content": raw})
        message = {"role": "assistant", "content": text}
        calls, _ = parse_tool_calls(text) if body.get("tools") else ([], [])
        if calls:
            message["content"] = text[: text.index("<tool_call>")].strip() or None
            message["tool_calls"] = [
                {
                    "id": f"call_{k}",
                    "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
                }
                for k, c in enumerate(calls)
            ]
            finish = "tool_calls" if finish == "stop" else finish
        t.returned.append(message)
        content = [
            {"token": self.tokenizer.decode([i]), "logprob": lp, "bytes": None, "top_logprobs": []}
            for i, lp in zip(tokens, logprobs)
        ]
        choice = {"index": 0, "message": message, "finish_reason": finish}
        choice["logprobs"] = {"content": content} if body.get("logprobs") else None
        return {**head, "object": "chat.completion", "choices": [choice], "usage": usage}

    def _text(self, tokens: list[int], stops: list[str]) -> tuple[str, int]:
        """The reply's text (eos left out) and how many tokens it keeps: up to the first token that completes a stop
        string, the string itself left out of the text."""
        eos = self.tokenizer.eos_token_id
        if stops:
            for end in range(1, len(tokens) + 1):
                text = self.tokenizer.decode([i for i in tokens[:end] if i != eos])
                hits = [text.index(s) for s in stops if s in text]
                if hits:
                    return text[: min(hits)], end
        return self.tokenizer.decode([i for i in tokens if i != eos]), len(tokens)


class AgentFnLoop:
    """The engine behind --agent-fn: each row's sampling.n trajectories are calls of the user's agent (its pool's
    workers) with their own base_url on the endpoint; generate_rows returns them as Completions (mask: the sampled
    tokens; prompt_ids: each trajectory's own first prompt) whose extra_info["agent_fn"] holds the reward."""

    def __init__(self, engine, tokenizer, agent, pool, max_prompt_length: int):
        self.engine, self.tokenizer, self.pool, self.timeout = engine, tokenizer, pool, agent.agent_timeout
        host, port = agent.endpoint_host, agent.endpoint_port
        self.endpoint = Endpoint(engine, tokenizer, host, port, max_prompt_length, model_name="policy")
        weakref.finalize(self, self.endpoint.close)  # the run's end: the server and its port go with the loop
        self.since = {"calls": 0, "failed": 0, "requests": 0, "restarts": 0, "no_requests": 0}

    def __getattr__(self, name):  # update_weights, sleep, wake_up, weight_version, ...
        return getattr(self.engine, name)

    def generate(self, prompts, sampling: Sampling):
        return self.engine.generate(prompts, sampling)

    def stats(self) -> dict:
        stats = self.engine.stats() if hasattr(self.engine, "stats") else {}
        stats.update(self.agent_metrics())
        return stats

    def agent_metrics(self) -> dict:
        s, e = self.since, self.endpoint
        calls = max(1, s["calls"])
        metrics = {
            "agent/fn_calls": s["calls"],
            "agent/fn_failed": s["failed"],
            "agent/requests_mean": s["requests"] / calls,
            "agent/restarts": s["restarts"],
            "agent/no_requests": s["no_requests"],
            "agent/refused_requests": e.refused,
            "agent/sampling_overridden": e.overridden,
        }
        self.since = dict.fromkeys(s, 0)
        e.refused = e.overridden = 0
        return metrics

    def generate_rows(self, rows: list[dict], sampling: Sampling) -> list[list[Completion]]:
        endpoint, n = self.endpoint, sampling.n
        endpoint.sampling = sampling
        ids = [uuid.uuid4().hex for _ in range(len(rows) * n)]
        for tid, row in zip(ids, (r for r in rows for _ in range(n))):
            endpoint.trajectories[tid] = Trajectory(row)
        public = [{k: row.get(k) for k in ("messages", "ground_truth", "data_source", "extra_info")} for row in rows]
        tasks = [(endpoint.url(tid), endpoint.key, public[i // n], self.timeout) for i, tid in enumerate(ids)]
        done, result = threading.Event(), []

        def run():
            try:
                result.append(self.pool.score(tasks))
            except BaseException as e:
                result.append(e)
            finally:
                done.set()

        threading.Thread(target=run, daemon=True).start()
        endpoint.serve_until(done)
        trajectories = [endpoint.trajectories.pop(tid) for tid in ids]
        if isinstance(result[0], BaseException):
            raise result[0]
        scored, eos = result[0], self.tokenizer.eos_token_id
        completions = []
        for t, score, extra, ok in zip(trajectories, scored.scores, scored.extras, scored.ok):
            empty = not t.tokens
            tokens, logprobs, kept = (t.tokens, t.logprobs, t.kept) if t.tokens else ([eos], [0.0], [0])
            mask = [0] * len(tokens) if not ok or empty else t.mask
            info = {"reward": score, "extras": extra, "failed": not ok, "requests": t.requests, "restarts": t.restarts}
            self.since["calls"] += 1
            self.since["failed"] += int(not ok)
            self.since["requests"] += t.requests
            self.since["restarts"] += t.restarts
            self.since["no_requests"] += int(t.requests == 0)
            prompt = t.prompt_ids if t.prompt_ids is not None else t.row["prompt_ids"]
            completions.append(
                Completion(
                    tokens,
                    logprobs,
                    t.finish_reason,
                    mask=mask,
                    extra_info={"agent_fn": info},
                    kept=kept if any(kept) else None,
                    prompt_ids=prompt,
                )
            )
        self.scored = scored
        return [completions[i * n : (i + 1) * n] for i in range(len(rows))]
