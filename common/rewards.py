"""The worker pool that makes reward functions (common.scoring) hang-proof, and the agent loop's
tools and interactions (common.agents.tools, common.agents.agent) too.

Scoring runs in worker processes under a per-sample timeout: a function that raises or never
returns costs that sample a 0 and is counted, never the run."""

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Literal

from common import watchdog
from common.errors import UsageError
from common.flags import flag
from common.scoring import builtin_scorer as builtin_scorer  # re-exported for older forks
from common.scoring import exact_match as exact_match  # re-exported for older forks
from common.scoring import extract_answer as extract_answer  # re-exported for older forks
from common.scoring import finite, load_reward_fn, score_value
from common.scoring import hit as hit  # re-exported for older forks

log = logging.getLogger(__name__)


@dataclass
class Scored:
    scores: list[float]
    extras: list[dict]  # the other numeric keys of dict results
    errors: int = 0
    timeouts: int = 0
    first_error: str | None = None
    seconds: float = 0.0
    ok: list[bool] | None = None  # per sample: scored without an error or a timeout
    nonfinite: int = 0  # scores that were NaN or infinite (as float32), zeroed
    preds: list[str | None] | None = None  # per sample: a dict result's "pred" string (verl's extracted answer)

    @classmethod
    def merge(cls, parts: list["Scored"], scores: list[float], extras: list[dict]) -> "Scored":
        """The scores and extras kept from several scoring calls (DAPO's re-sampling), with every
        call's errors, timeouts and seconds counted."""
        return cls(
            scores=list(scores),
            extras=list(extras),
            errors=sum(p.errors for p in parts),
            timeouts=sum(p.timeouts for p in parts),
            seconds=sum(p.seconds for p in parts),
            first_error=next((p.first_error for p in parts if p.first_error), None),
            nonfinite=sum(p.nonfinite for p in parts),
        )


TOOLS_PREFIX = "tools:"  # a pool spec naming a --tool-config file rather than a reward function
INTERACTIONS_PREFIX = "interactions:"  # ... or an --interaction-config file
ENVS_PREFIX = "envs:"  # ... or the environments of an --env-config file (common.agents.envs.EnvHost)
BATCH_PREFIX = "batch:"  # a reward function called once with lists (--reward-manager batch)
JUDGE_PREFIX = "judge:"  # an LLM judge behind a URL (--judge-url; common.shaping.judge)
AGENT_PREFIX = "agent:"  # an --agent-fn agent, called with an openai client (common.agents.endpoint)
JUDGE_MESSAGES = "judge_messages"  # the extra_info key that brings the judge a prompt's messages
VERL_NAMES = ("data_source", "solution_str", "ground_truth", "extra_info")  # compute_score's, as verl passes them
SIDE_POOLS = {
    TOOLS_PREFIX: "--tool-config",
    INTERACTIONS_PREFIX: "--interaction-config",
    ENVS_PREFIX: "--env-config",
    JUDGE_PREFIX: "--judge-url",
    AGENT_PREFIX: "--agent-fn",
}


def _by_name(fn, plural: str = ""):
    """fn called as verl's reward managers call compute_score: by name (a batch's: data_sources, ...), in any order."""
    return lambda *args: fn(**{name + plural: arg for name, arg in zip(VERL_NAMES, args)})


def _check_batch(result) -> None:
    if not isinstance(result, list | tuple):
        raise TypeError(f"a batch reward function must return a list (one score or dict a sample), got {result!r}")
    for item in result:
        score_value(item)


def _worker_main(fd: int, spec: str) -> None:
    # torchrun and Slurm send stop signals to every process of the job; they are the trainer's to act on
    # (common.parallel.StopSignal), and a killed worker would fail the step being scored. Workers end on EOF.
    for name in ("SIGUSR1", "SIGTERM"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    conn = Connection(fd)
    try:
        if spec.startswith(TOOLS_PREFIX):  # a tool pool (common.agents.agent): results are the tools' text
            from common.agents.tools import load_tools

            fn, check = load_tools(spec.removeprefix(TOOLS_PREFIX)), lambda result: None  # load_tools checks
        elif spec.startswith(INTERACTIONS_PREFIX):  # interactions: load_interactions checks results
            from common.agents.tools import load_interactions

            fn, check = load_interactions(spec.removeprefix(INTERACTIONS_PREFIX)), lambda result: None
        elif spec.startswith(ENVS_PREFIX):  # environments: EnvHost checks what they return
            from common.agents.envs import load_env_host

            fn, check = load_env_host(spec.removeprefix(ENVS_PREFIX)), lambda result: None
        elif spec.startswith(BATCH_PREFIX):
            fn, check = _by_name(load_reward_fn(spec.removeprefix(BATCH_PREFIX)), "s"), _check_batch
        elif spec.startswith(AGENT_PREFIX):  # --agent-fn: the user's agent, its return the reward
            from common.agents.caller import load_agent

            fn, check = load_agent(spec.removeprefix(AGENT_PREFIX)), score_value
        elif spec.startswith(JUDGE_PREFIX):  # --judge-url: common.shaping.judge's compute_score
            from common.shaping.judge import load_judge

            fn, check = load_judge(spec.removeprefix(JUDGE_PREFIX), JUDGE_MESSAGES), score_value
        else:
            fn, check = _by_name(load_reward_fn(spec)), score_value
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the trainer went away
            return
        if task is None:
            return
        index, args = task
        try:
            result = fn(*args)
            check(result)
            reply = (index, "ok", result)
        except BaseException:  # a reward function may raise anything, SystemExit included
            reply = (index, "error", traceback.format_exc())
        try:
            conn.send(reply)
        except Exception:
            conn.send((index, "error", traceback.format_exc()))


class _WorkerOutput:
    """What the workers print (a reward function's debugging, a library's warnings), copied to one log
    file in the run folder instead of the console, up to MAX_BYTES; the rest is read and dropped, said
    in one line, so it can neither fill a disk nor block a worker on a full pipe. No path: all dropped."""

    MAX_BYTES = 10 * 2**20

    def __init__(self, path):
        self.path, self.written, self.lock = (Path(path) if path else None), 0, threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def follow(self, stream) -> None:
        threading.Thread(target=self._copy, args=(stream,), daemon=True).start()

    def _copy(self, stream) -> None:
        for line in iter(stream.readline, b""):
            if self.path is None:
                continue
            with self.lock:
                fits = self.written + len(line) <= self.MAX_BYTES
                if self.written < self.MAX_BYTES:
                    with open(self.path, "ab") as f:
                        f.write(line if fits else b"[reward worker output beyond 10 MB dropped]\n")
                    self.written = self.written + len(line) if fits else self.MAX_BYTES
        stream.close()


STARTUP_TIMEOUT = 120.0  # seconds a new worker may take to import the reward function (a hang at import ends here)


class RewardPool:
    """Scores (data_source, solution_str, ground_truth, extra_info) tuples in worker processes, one
    task per worker at a time, so every sample gets its own timeout. A sample that overruns (its worker
    is killed and replaced), raises, or scores NaN or infinity gets 0 and is counted; the first traceback
    and the first such score are logged once. --stop-on-nonfinite-reward stops the run at a NaN or
    infinite score instead (common.tracking)."""

    def __init__(self, spec: str | None = None, workers: int = 2, timeout: float = 10.0, log_path=None):
        self.spec, self.timeout = spec, timeout
        self.judged = bool(spec and spec.startswith(JUDGE_PREFIX))  # its tasks carry the prompt's messages
        self.tools = self.interactions = self.envs = self.agents = None  # side pools: start_agent_pools, start_env_pool
        self.dry_run_report = None  # (every row scored, what dry_run scored in words): common.check
        self.dry_run_extras = None  # the dry run's results' other keys, one dict a row (gdpo.py reads their names)
        self.output = _WorkerOutput(log_path)
        self.workers = [self._start() for _ in range(max(1, workers))]
        self.restarts = [0] * len(self.workers)  # per worker slot: how often it was replaced
        self.printed_error = self.printed_nonfinite = False

    def _start(self):
        """A new worker, once it has loaded its function (start-up never counts against a timeout): a
        fresh interpreter running only this module, no fork of a multi-threaded trainer or re-import of the recipe."""
        mine, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        code = "import sys; from common.rewards import _worker_main; _worker_main(int(sys.argv[1]), sys.argv[2])"
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno()), self.spec or ""],
            pass_fds=[theirs.fileno()],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self.output.follow(proc.stdout)
        theirs.close()
        conn = Connection(mine.detach())
        with watchdog.waiting("a reward worker to start (its own deadline)", timeout=STARTUP_TIMEOUT):
            status, detail = conn.recv() if conn.poll(STARTUP_TIMEOUT) else ("hung", "")
        if status != "ready":
            proc.kill()
            proc.wait()
            if not self.spec:
                raise RuntimeError(f"reward worker for the built-in rewards failed to start: {detail}")
            prefix = next((p for p in SIDE_POOLS if self.spec.startswith(p)), "")
            flag, shown = SIDE_POOLS.get(prefix, "--reward-fn"), self.spec.removeprefix(prefix)
            shown = shown.partition(":")[2] if flag == "--env-config" else shown  # past max_traj_per_env
            if status == "hung":
                raise UsageError(f"{flag} {shown}: importing it did not finish in {STARTUP_TIMEOUT:.0f}s (it hangs?)")
            last = detail.strip().splitlines()[-1] if detail.strip() else "no reason given"
            ours = f"{UsageError.__module__}.{UsageError.__qualname__}: "  # common.scoring's message names the flag
            raise UsageError(
                last.removeprefix(ours) if last.startswith(ours) else f"{flag} {shown}: importing it failed: {last}"
            )
        return [proc, conn]

    def _replace(self, slot: int) -> None:
        worker = self.workers[slot]
        worker[0].kill()
        worker[0].wait()
        worker[1].close()
        worker[:] = self._start()
        self.restarts[slot] += 1

    def score(self, tasks: list[tuple]) -> Scored:
        t0 = time.time()
        run = self._run_batch if self.spec and self.spec.startswith(BATCH_PREFIX) else self.run
        results, failures, first_error = run(tasks)
        timeouts = sum(1 for f in failures.values() if f == "timeout")
        errors = len(failures) - timeouts
        if first_error and not self.printed_error:
            self.printed_error = True
            shown = first_error.strip().splitlines()[-1] if self.judged else first_error  # our code: its last line
            log.error("reward function raised (scored 0, counted in reward/errors; shown once):\n%s", shown)
        if timeouts:
            log.warning("%d sample(s) exceeded the %.1fs reward timeout and scored 0", timeouts, self.timeout)
        scores = [0.0 if r is None else score_value(r) for r in results]
        nonfinite = [i for i, s in enumerate(scores) if not finite(s)]
        if nonfinite and not self.printed_nonfinite:
            self.printed_nonfinite = True
            log.warning(
                "reward function returned %r for data_source=%r (scored 0, counted in reward/nonfinite; shown once)",
                results[nonfinite[0]],
                tasks[nonfinite[0]][0],
            )
        scores = [s if finite(s) else 0.0 for s in scores]
        dicts = [r if isinstance(r, dict) else {} for r in results]
        extras = [{k: float(v) for k, v in d.items() if k != "score" and isinstance(v, int | float)} for d in dicts]
        ok = [r is not None for r in results]
        preds = [d.get("pred") if isinstance(d.get("pred"), str) else None for d in dicts]
        return Scored(scores, extras, errors, timeouts, first_error, time.time() - t0, ok, len(nonfinite), preds)

    def _run_batch(self, tasks: list[tuple]) -> tuple[list, dict[int, str], str | None]:
        """verl's batch reward manager: one call with the step's lists (data_sources, solution_strs,
        ground_truths, extra_infos) under the timeout; a call that fails, overruns or returns a
        list of another length fails every sample of it."""
        if not tasks:
            return [], {}, None
        (result,), failures, first_error = self.run([tuple(list(column) for column in zip(*tasks))])
        if not failures and len(result) != len(tasks):
            failures = {0: f"returned {len(result)} scores for {len(tasks)} samples"}
            first_error = f"the batch reward function {failures[0]}"
        if failures:
            return [None] * len(tasks), {i: failures[0] for i in range(len(tasks))}, first_error
        return list(result), {}, None

    def run(self, tasks: list[tuple], slots: list[int] | None = None) -> tuple[list, dict[int, str], str | None]:
        """Each task's arguments through the workers' function, one task per worker at a time. Returns
        (results, None where a task failed; {task index: "timeout" or the last line it raised}; the first
        traceback). slots: each task's worker (modulo the workers), in order, as stateful hosts need
        (common.agents.envs.EnvHost); default: any free one. A worker that dies or overruns is replaced (restarts)."""
        results: list = [None] * len(tasks)
        anywhere: deque = deque()
        pinned: list[deque] = [deque() for _ in self.workers]
        for i, args in enumerate(tasks):
            (anywhere if slots is None else pinned[slots[i] % len(self.workers)]).append((i, args))
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (task index, start time)
        failures, first_error = {}, None
        while anywhere or any(pinned) or busy:
            for slot, worker in enumerate(self.workers):
                queue = pinned[slot] or anywhere
                if slot not in busy and queue:
                    index, args = queue.popleft()
                    worker[1].send((index, args))
                    busy[slot] = (index, time.time())
            deadline = min(start for _, start in busy.values()) + self.timeout
            ready = wait([self.workers[s][1] for s in busy], timeout=max(0.0, deadline - time.time()))
            watchdog.progress()  # a worker answered or overran (--reward-timeout): this wait has its own deadline
            for slot in list(busy):
                worker, (index, start) = self.workers[slot], busy[slot]
                if worker[1] in ready:
                    try:
                        _, status, payload = worker[1].recv()
                    except (EOFError, OSError):  # the worker died (os._exit, segfault)
                        try:
                            code = worker[0].wait(timeout=5)
                        except subprocess.TimeoutExpired:
                            code = None
                        status, payload = "error", f"the worker process exited with code {code} (replaced)"
                        self._replace(slot)
                    del busy[slot]
                    if status == "ok":
                        results[index] = payload
                    else:
                        failures[index] = (payload.strip().splitlines() or ["failed"])[-1]
                        first_error = first_error or payload
                elif time.time() - start >= self.timeout:
                    self._replace(slot)
                    del busy[slot]
                    failures[index] = "timeout"
        return results, failures, first_error

    def dry_run(self, rows: list[dict], per_source: int = 2) -> None:
        """Before the first step, score up to `per_source` rows of each data_source, the ground truth
        standing in for a response, under the training timeout. A data_source whose every tried row fails
        (a bad signature or return type, no built-in, no ground truth) is a UsageError naming it rather
        than a run of zeros; some rows failing is a warning."""
        tried: dict[str, list[dict]] = {}
        column = getattr(
            rows, "column", None
        )  # common.formats.prompt_cache's rows: the column without making every row
        for i, source in enumerate(column("data_source") if column else (r["data_source"] for r in rows)):
            if len(tried.setdefault(source, [])) < per_source:
                tried[source].append(rows[i])
        picked = [r for group in tried.values() for r in group]
        name = (self.spec or "built-in rewards").removeprefix(BATCH_PREFIX)
        if self.judged:
            name = "--judge-url " + json.loads(self.spec.removeprefix(JUDGE_PREFIX))["url"]
        start = time.time()
        extras = [r.get("extra_info") for r in picked]  # tool_agent rows: with what a conversation adds
        if any(r.get("agent_name") == "tool_agent" for r in picked):
            from common.agents.tools import conversation_extra_info

            extras = [
                {**(e or {}), **conversation_extra_info(r)} if conversation_extra_info(r) else e
                for r, e in zip(picked, extras)
            ]
        if self.judged:
            extras = [{**(e or {}), JUDGE_MESSAGES: r["messages"]} for r, e in zip(picked, extras)]
        scored = self.score(
            [(r["data_source"], str(r["ground_truth"]), r["ground_truth"], e) for r, e in zip(picked, extras)]
        )
        reason = (scored.first_error or "").strip().splitlines()[-1:] or [f"timed out after {self.timeout}s"]
        ok = {r["data_source"] for r, score_ok in zip(picked, scored.ok) if score_ok}
        for source, group in tried.items():
            if source not in ok:
                raise UsageError(
                    f"reward dry run failed ({name}) on every row tried for data_source={source!r}, e.g. "
                    f"{group[0].get('file', '?')} row {group[0].get('row', '?')}: {reason[0]}"
                )
        self.dry_run_extras, failed = scored.extras, scored.errors + scored.timeouts
        if failed:
            log.warning("reward dry run (%s): %d of %d rows failed: %s", name, failed, len(picked), reason[0])
        self.dry_run_report = (
            failed == 0,
            (
                f"{name} scored {len(picked) - failed} of {len(picked)} real rows ({len(tried)} data_source"
                f"{'s' if len(tried) > 1 else ''}) in {time.time() - start:.1f}s (--reward-timeout {self.timeout:g}s)"
                + (f"; {scored.errors} raised, {scored.timeouts} timed out: {reason[0]}" if failed else "")
            ),
        )

    def close(self) -> None:
        for side in (self.tools, self.interactions, self.envs, self.agents):
            if side is not None:
                side.close()
        for proc, conn in self.workers:
            with contextlib.suppress(OSError):
                conn.send(None)
            try:
                proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            conn.close()
        self.workers = []


def start_reward_pool(reward: "RewardArgs", agent, env, data, run_dir, tokenizer, rows: list[dict]) -> RewardPool:
    """The worker pool that scores responses as the reward group says (reward_pool), checked before any model
    loads: a dry run scores `rows` of each data_source (common.data's prompt rows; none when a reward model
    scores). The workers print to <run_dir>/reward_workers.log (.rank<N> past rank 0). The agent group's tools and
    interactions (pool.tools, pool.interactions) and the env group's environments (pool.envs, checked on `rows`
    with the tokenizer and the data group's --max-prompt-length) get pools of their own (common.agents)."""
    rank = os.environ.get("RANK", "0")
    log_path = Path(run_dir) / ("reward_workers.log" if rank == "0" else f"reward_workers.rank{rank}.log")
    batch = reward.reward_manager == "batch"
    if reward.judge_url:
        from common.shaping.judge import judge_config  # a feature: loaded where its flag asks for it

        pool = RewardPool(JUDGE_PREFIX + judge_config(reward), reward.reward_workers, reward.reward_timeout, log_path)
    else:
        pool = reward_pool(reward.reward_fn, reward.reward_workers, reward.reward_timeout, log_path, batch)
    if env.env_config:
        pool.envs = start_env_pool(env, data.max_prompt_length, rows, tokenizer, log_path)
    elif rows and not reward.reward_model and not getattr(agent, "agent_fn", None):  # an agent's reward: its own
        pool.dry_run(rows)
    if agent.on:
        pool.tools, pool.interactions = start_agent_pools(agent, reward.reward_workers, log_path)
    if getattr(agent, "agent_fn", None):
        pool.agents = RewardPool(AGENT_PREFIX + agent.agent_fn, agent.agent_workers, agent.agent_timeout, log_path)
    return pool


def reward_pool(reward_fn: str | None, workers: int, timeout: float, log_path=None, batch: bool = False) -> RewardPool:
    """The pool for --reward-fn (or the built-ins, without one): a missing file fails with its name; the file is
    imported only in the workers (its code never runs in the trainer; a hang or error at import is a UsageError,
    not a stuck run). What the workers print goes to log_path (_WorkerOutput). batch (--reward-manager batch): one
    worker, called once a step with lists."""
    if reward_fn and not Path(reward_fn.partition(":")[0]).expanduser().is_file():
        raise UsageError(f"--reward-fn {reward_fn}: file {reward_fn.partition(':')[0]!r} does not exist")
    spec = BATCH_PREFIX + reward_fn if batch and reward_fn else reward_fn
    return RewardPool(spec, workers=1 if batch else workers, timeout=timeout, log_path=log_path)


def start_agent_pools(agent, workers: int, log_path=None) -> tuple[RewardPool | None, RewardPool | None]:
    """The agent loop's pools (common.agents.agent), each None without its flag of the agent group: --tool-config's
    tools (`workers` workers) and --interaction-config's interactions (one worker: it holds every interaction's
    state). Started now, so an import that fails or hangs is an error before any model loads."""

    def pool(prefix: str, config: str | None, workers: int) -> RewardPool | None:
        return (
            RewardPool(prefix + config, workers=workers, timeout=agent.tool_timeout, log_path=log_path)
            if config
            else None
        )

    return pool(TOOLS_PREFIX, agent.tool_config, workers), pool(INTERACTIONS_PREFIX, agent.interaction_config, 1)


def start_env_pool(env, max_prompt_length: int, rows: list[dict], tokenizer, log_path=None) -> RewardPool:
    """The environment workers of an --env-config run (common.agents.envs.EnvHost, the env group's --env-workers of
    them), checked before any model loads on the rows to be played (common.agents.envs.check_envs)."""
    from common.agents.envs import check_envs, read_env_config  # a feature: an --env-config run's

    spec = f"{ENVS_PREFIX}{env.max_traj_per_env}:{env.env_config}"
    pool = RewardPool(spec, workers=env.env_workers, timeout=env.env_timeout, log_path=log_path)
    try:
        check_envs(pool, read_env_config(env.env_config), rows, tokenizer, max_prompt_length)
    except BaseException:
        pool.close()
        raise
    return pool


BATCHED = (
    lambda a: (a.reward_fn and not getattr(a, "reward_model", None)) or a.reward_manager != "batch",
    "add --reward-fn (the built-in scorers and a reward model take one sample at a time)",
)


@dataclass
class RewardArgs:
    """What scores a response: built-in rules, --reward-fn or a --reward-model (common.rewards)."""

    reward_fn: str | None = None
    """path/to/file.py[:name] with verl's compute_score signature (default: built-ins by data_source)"""
    reward_timeout: float = flag(10.0, gt=0, unit="seconds")
    """seconds one sample (with --reward-manager batch: one step's call) may take to score before it gets 0 (verl
    waits without a limit)"""
    reward_manager: Literal["naive", "prime", "batch"] = flag("naive", only_with=BATCHED)
    """verl's reward_model.reward_manager: naive and prime score each sample in the worker pool (in
    parallel, each under --reward-timeout: verl's prime); batch calls --reward-fn once a step with
    lists, compute_score(data_sources, solution_strs, ground_truths, extra_infos) -> one score or dict each"""
    reward_workers: int = flag(2, ge=1)
    """reward worker processes per rank"""
    reward_model: str | None = None
    """AutoModelForSequenceClassification folder / hub name; replaces the rule-based score"""
    judge_url: str | None = None
    """an OpenAI-compatible server's base URL (e.g. http://127.0.0.1:8000/v1) whose model judges each response: an
    LLM-judge reward in place of the rule-based one, in the reward workers ($OPENAI_API_KEY is sent when set)"""
    judge_model: str = flag("judge", only_with="judge_url")
    """the judge's model name, as its server knows it"""
    judge_prompt: str | None = flag(None, only_with="judge_url")
    """a text file: the judge's instructions with {prompt}, {response} and {ground_truth}, asking for a reply that
    ends in Score: N (default: a short instruction on a 0-10 scale)"""
    judge_max_score: float = flag(10.0, gt=0, only_with="judge_url")
    """the judge's top score: the reward is N / this"""

    def __post_init__(self):
        if self.judge_url and (self.reward_fn or self.reward_model):
            other = "--reward-fn" if self.reward_fn else "--reward-model"
            raise UsageError(f"--judge-url with {other}: each replaces the rule-based score; give one of them")
