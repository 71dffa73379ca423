"""Reward functions with verl's signature, and the worker pool that makes them hang-proof.

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

A dict carries the score under "score"; its other numeric keys become metrics. `--reward-fn
path/to/file.py:name` loads a user function (name defaults to compute_score); without it the
built-in for each row's data_source is used. Scoring runs in worker processes with a per-sample
timeout: a function that raises or never returns costs that sample a 0 and is counted, never the run.
"""

import importlib.util
import logging
import math
import os
import re
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

from common.config import UsageError

log = logging.getLogger(__name__)

# --- built-in scorers --------------------------------------------------------------------------

BUNDLED_SOURCES = ("bundled/addition", "bundled/calculator")  # the bundled tasks: 2-digit, and 3-digit with a tool
GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
MATH_SOURCES = (
    "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math",
    "math_dapo", "aime", "aime24", "aime25", "amc", "olympiad_bench",
)  # fmt: skip
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_answer_tag(text: str) -> str | None:
    """The content of the last <answer>...</answer>, stripped; None without one."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def addition_score(solution_str: str, ground_truth) -> float:
    """Bundled task: 1.0 when the last <answer> tag holds exactly the ground truth, else 0.0."""
    return float(extract_answer_tag(solution_str) == str(ground_truth).strip())


def gsm8k_score(
    solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """verl's GSM8K rule: strict reads the number after '#### ', flexible the last number in the
    text; commas and a trailing period are ignored. format_score for an answer that is wrong."""
    if method == "strict":
        found = _GSM8K_STRICT.findall(solution_str[-300:])
        answer = found[-1] if found else None
    else:
        numbers = [n for n in _NUMBER.findall(solution_str[-300:]) if n not in ("", ".")]
        answer = numbers[-1] if numbers else None
    if answer is None:
        return 0.0
    clean = answer.replace(",", "").rstrip(".")
    return score if clean == str(ground_truth).replace(",", "").strip() else format_score


def math_score(solution_str: str, ground_truth) -> float:
    """Checks the \\boxed{} (or last) answer against the ground truth with math-verify."""
    from math_verify import parse, verify

    gold = parse(str(ground_truth) if "$" in str(ground_truth) or "\\" in str(ground_truth) else f"${ground_truth}$")
    return float(verify(gold, parse(solution_str)))


def format_score(solution_str: str, pattern: str = r"^\s*<answer>.*?</answer>\s*$") -> float:
    """1.0 when the whole response matches `pattern` (default: a single <answer>...</answer>)."""
    return float(re.match(pattern, solution_str, re.DOTALL) is not None)


def exact_match(solution_str: str, ground_truth) -> float:
    return float(solution_str.strip() == str(ground_truth).strip())


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (nested braces kept), stripped; None without one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def extract_answer(data_source: str, text: str) -> str | None:
    """The final answer a built-in reward reads from a response, as a string to vote on (maj@k in
    recipes/evaluate.py): the <answer> tag (bundled task), the number after '#### ' (GSM8K, commas
    dropped), the last \\boxed{} (math sources). None when there is none or no built-in."""
    if data_source in BUNDLED_SOURCES:
        return extract_answer_tag(text)
    if data_source in GSM8K_SOURCES:
        found = _GSM8K_STRICT.findall(text[-300:])
        return found[-1].replace(",", "").rstrip(".") if found else None
    if data_source in MATH_SOURCES or data_source.startswith(("math", "aime")):
        return last_boxed(text)
    return None


def builtin_scorer(data_source: str):
    """The built-in (solution_str, ground_truth) -> score for a data_source, or None."""
    if data_source in BUNDLED_SOURCES:
        return addition_score
    if data_source in GSM8K_SOURCES:
        return gsm8k_score
    if data_source in MATH_SOURCES or data_source.startswith(("math", "aime")):
        return math_score
    if data_source == "format":
        return lambda solution_str, ground_truth: format_score(solution_str)
    return None


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    scorer = builtin_scorer(data_source)
    if scorer is None:
        raise ValueError(
            f"no built-in reward for data_source={data_source!r} (built-ins: {', '.join(BUNDLED_SOURCES)}, "
            f"{', '.join(GSM8K_SOURCES)}, math sources such as {MATH_SOURCES[0]}, format); pass "
            f"--reward-fn path/to/file.py:compute_score"
        )
    return scorer(solution_str, ground_truth)


# --- user reward functions ----------------------------------------------------------------------


def load_reward_fn(spec: str | None):
    """`path/to/file.py[:name]` -> the function (name defaults to compute_score); None -> built-ins."""
    return load_from_file(spec, "--reward-fn", "compute_score") if spec else default_compute_score


def load_from_file(spec: str, flag: str, default_name: str, kind: str = "function"):
    """`path/to/file.py[:name]` -> the function (or class: kind) the file names so, the file run
    as a module of its own; errors name `flag`."""
    path, _, name = spec.partition(":")
    name = name or default_name
    file = Path(path).expanduser()
    if not file.is_file():
        raise UsageError(f"{flag} {spec}: file {path!r} does not exist")
    module_name = f"_user_code_{abs(hash(str(file.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    module_spec.loader.exec_module(module)
    found = getattr(module, name, None)
    if not callable(found):
        raise UsageError(f"{flag} {spec}: {path!r} defines no {kind} {name!r}")
    return found


def hit(score: float, extras: dict) -> float:
    """Whether a sample counts as correct: the result's own "acc" key when it has one, else score > 0."""
    return float(extras.get("acc", score > 0))


def score_value(result) -> float:
    """The float score of a reward result (a number, or a dict with a 'score' key). It may be NaN
    or infinite: RewardPool.score counts and zeroes those."""
    value = result["score"] if isinstance(result, dict) else result
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"reward must be a number or a dict with a numeric 'score', got {result!r}")
    return float(value)


FLOAT32_MAX = 3.4028234663852886e38  # rewards train as float32: a larger score would be infinite there


def finite(score: float) -> bool:
    """Whether a score is a usable reward: a number that stays finite as a float32."""
    return math.isfinite(score) and abs(score) <= FLOAT32_MAX


# --- the worker pool ----------------------------------------------------------------------------


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
            scores=list(scores), extras=list(extras), errors=sum(p.errors for p in parts),
            timeouts=sum(p.timeouts for p in parts), seconds=sum(p.seconds for p in parts),
            first_error=next((p.first_error for p in parts if p.first_error), None),
            nonfinite=sum(p.nonfinite for p in parts),
        )  # fmt: skip


TOOLS_PREFIX = "tools:"  # a pool spec naming a --tool-config file rather than a reward function
INTERACTIONS_PREFIX = "interactions:"  # ... or an --interaction-config file
SIDE_POOLS = ((TOOLS_PREFIX, "--tool-config"), (INTERACTIONS_PREFIX, "--interaction-config"))


def _check_text(result) -> None:
    if not isinstance(result, str):
        raise TypeError(f"a tool must return a str (the text the model reads), got {type(result).__name__}")


def _worker_main(fd: int, spec: str) -> None:
    # A stop signal is the trainer's to act on (common.parallel.StopSignal); torchrun and Slurm send it
    # to every process of the job, and a worker it killed would fail the step being scored. Workers
    # end when the trainer closes the pool or goes away (EOF).
    for name in ("SIGUSR1", "SIGTERM"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    _worker(Connection(fd), spec or None)


def _worker(conn, spec):
    try:
        if spec and spec.startswith(TOOLS_PREFIX):  # a tool pool (common.agent): results are the tools' text
            from common.agent import load_tool_functions

            fn, check = load_tool_functions(spec.removeprefix(TOOLS_PREFIX)), _check_text
        elif spec and spec.startswith(INTERACTIONS_PREFIX):  # interactions: load_interactions checks results
            from common.agent import load_interactions

            fn, check = load_interactions(spec.removeprefix(INTERACTIONS_PREFIX)), lambda result: None
        else:
            fn, check = load_reward_fn(spec), score_value
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
    """Whatever the workers print (a chatty reward function's debugging, a library's warnings),
    copied into one log file in the run folder instead of the console, up to MAX_BYTES; past
    that it is read and dropped, with one line saying so, so it can neither fill a disk nor
    block a worker on a full pipe. Without a path the output is dropped."""

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
                if self.written < self.MAX_BYTES:
                    kept = (
                        line
                        if self.written + len(line) <= self.MAX_BYTES
                        else b"[reward worker output beyond 10 MB dropped]\n"
                    )
                    with open(self.path, "ab") as f:
                        f.write(kept)
                    self.written = self.written + len(line) if kept is line else self.MAX_BYTES
        stream.close()


STARTUP_TIMEOUT = 120.0  # seconds a new worker may take to import the reward function (a hang at import ends here)


class RewardPool:
    """Scores (data_source, solution_str, ground_truth, extra_info) tuples in worker processes.

    One task per worker at a time, so every sample gets its own timeout: a worker that overruns
    is killed and replaced, and the sample scores 0. Exceptions score 0 as well; both are counted
    and the first traceback is printed once per run. So do NaN or infinite scores (counted in
    Scored.nonfinite, the sample shown once); a run that would rather stop on them says so with
    --stop-on-nonfinite-reward (common.tracking stops it at that step).
    """

    def __init__(self, spec: str | None = None, workers: int = 2, timeout: float = 10.0, log_path=None):
        self.spec, self.timeout = spec, timeout
        self.tools = self.interactions = None  # the agent loop's pools (start_agent_pools), closed with this one
        self.output = _WorkerOutput(log_path)
        self.workers = [self._start() for _ in range(max(1, workers))]
        self.printed_error = self.printed_nonfinite = False

    def _start(self):
        """A new worker, returned once it has loaded the reward function, so that start-up time
        never counts against a sample's timeout. Workers are fresh interpreters running only this
        module: no fork of a multi-threaded trainer, no re-import of the recipe."""
        mine, theirs = socket.socketpair()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]
            ),
        }
        code = "import sys; from common.rewards import _worker_main; _worker_main(int(sys.argv[1]), sys.argv[2])"
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno()), self.spec or ""], pass_fds=[theirs.fileno()], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        self.output.follow(proc.stdout)
        theirs.close()
        conn = Connection(mine.detach())
        status, detail = conn.recv() if conn.poll(STARTUP_TIMEOUT) else ("hung", "")
        if status != "ready":
            proc.kill()
            proc.wait()
            if not self.spec:
                raise RuntimeError(f"reward worker for the built-in rewards failed to start: {detail}")
            flag, shown = next(
                ((flag, self.spec.removeprefix(prefix)) for prefix, flag in SIDE_POOLS if self.spec.startswith(prefix)),
                ("--reward-fn", self.spec),
            )
            if status == "hung":
                raise UsageError(f"{flag} {shown}: importing it did not finish in {STARTUP_TIMEOUT:.0f}s (it hangs?)")
            last = detail.strip().splitlines()[-1] if detail.strip() else "no reason given"
            ours = "common.config.UsageError: "  # load_reward_fn's own message already names the flag
            raise UsageError(
                last.removeprefix(ours) if last.startswith(ours) else f"{flag} {shown}: importing it failed: {last}"
            )
        return [proc, conn]

    def _replace(self, worker) -> None:
        worker[0].kill()
        worker[0].wait()
        worker[1].close()
        worker[:] = self._start()

    def score(self, tasks: list[tuple]) -> Scored:
        t0 = time.time()
        results, failures, first_error = self.run(tasks)
        timeouts = sum(1 for f in failures.values() if f == "timeout")
        errors = len(failures) - timeouts
        if first_error and not self.printed_error:
            self.printed_error = True
            log.error("reward function raised (scored 0, counted in reward/errors; shown once):\n%s", first_error)
        if timeouts:
            log.warning("%d sample(s) exceeded the %.1fs reward timeout and scored 0", timeouts, self.timeout)
        scores = [0.0 if r is None else score_value(r) for r in results]
        nonfinite = [i for i, s in enumerate(scores) if not finite(s)]
        if nonfinite and not self.printed_nonfinite:
            self.printed_nonfinite = True
            i = nonfinite[0]
            log.warning("reward function returned %r for data_source=%r (scored 0, counted in reward/nonfinite; "
                        "shown once)", results[i], tasks[i][0])  # fmt: skip
        scores = [s if finite(s) else 0.0 for s in scores]
        extras = [
            {k: float(v) for k, v in r.items() if k != "score" and isinstance(v, int | float)}
            if isinstance(r, dict)
            else {}
            for r in results
        ]
        ok = [r is not None for r in results]
        preds = [r.get("pred") if isinstance(r, dict) and isinstance(r.get("pred"), str) else None for r in results]
        return Scored(scores, extras, errors, timeouts, first_error, time.time() - t0, ok, len(nonfinite), preds)

    def run(self, tasks: list[tuple]) -> tuple[list, dict[int, str], str | None]:
        """Each task's arguments through the workers' function, one task per worker at a time:
        (results, None where it failed; {task index: "timeout" or the last line of what it
        raised}; the first traceback)."""
        results: list = [None] * len(tasks)
        pending = deque(enumerate(tasks))
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (task index, start time)
        failures, first_error = {}, None
        while pending or busy:
            for slot, worker in enumerate(self.workers):
                if slot not in busy and pending:
                    index, args = pending.popleft()
                    worker[1].send((index, args))
                    busy[slot] = (index, time.time())
            deadline = min(start for _, start in busy.values()) + self.timeout
            ready = wait([self.workers[s][1] for s in busy], timeout=max(0.0, deadline - time.time()))
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
                        status, payload = "error", f"reward worker exited with code {code}"
                        self._replace(worker)
                    del busy[slot]
                    if status == "ok":
                        results[index] = payload
                    else:
                        failures[index] = (payload.strip().splitlines() or ["failed"])[-1]
                        first_error = first_error or payload
                elif time.time() - start >= self.timeout:
                    self._replace(worker)
                    del busy[slot]
                    failures[index] = "timeout"
        return results, failures, first_error

    def dry_run(self, rows: list[dict], per_source: int = 2) -> None:
        """Score up to `per_source` rows of every data_source among `rows` before the first step,
        each row's ground truth standing in for a response, under the same timeout as training. A
        data_source whose every tried row fails (a bad signature or return type, a data_source
        without a built-in, a missing ground truth) is an error now, naming it, rather than a run of
        zeros; some rows failing is a warning."""
        tried: dict[str, list[dict]] = {}
        for r in rows:
            if len(tried.setdefault(r["data_source"], [])) < per_source:
                tried[r["data_source"]].append(r)
        from common.agent import conversation_extra_info

        picked = [r for group in tried.values() for r in group]
        name = self.spec or "built-in rewards"
        extras = [r.get("extra_info") for r in picked]  # tool_agent rows: with what a conversation adds
        extras = [{**(e or {}), **conversation_extra_info(r)} if conversation_extra_info(r) else e
                  for r, e in zip(picked, extras)]  # fmt: skip
        scored = self.score(
            [(r["data_source"], str(r["ground_truth"]), r["ground_truth"], e) for r, e in zip(picked, extras)]
        )
        reason = (scored.first_error or "").strip().splitlines()[-1:] or [f"timed out after {self.timeout}s"]
        ok = {r["data_source"] for r, score_ok in zip(picked, scored.ok) if score_ok}
        for source, group in tried.items():
            if source not in ok:
                where = f"{group[0].get('file', '?')} row {group[0].get('row', '?')}"
                raise UsageError(
                    f"reward dry run failed ({name}) on every row tried for data_source={source!r}, e.g. "
                    f"{where}: {reason[0]}"
                )
        if scored.errors + scored.timeouts:
            log.warning("reward dry run (%s): %d of %d rows failed: %s", name,
                        scored.errors + scored.timeouts, len(picked), reason[0])  # fmt: skip

    def close(self) -> None:
        for side in (self.tools, self.interactions):
            if side is not None:
                side.close()
        for proc, conn in self.workers:
            try:
                conn.send(None)
            except OSError:
                pass
            try:
                proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            conn.close()
        self.workers = []


# --- reward model -------------------------------------------------------------------------------


class RewardModel:
    """An AutoModelForSequenceClassification scoring whole conversations (one logit each).

    With the policy's tokenizer and chat template, the sampled token ids are scored as they are;
    otherwise each conversation is decoded to text and re-rendered with the reward model's own
    chat template and tokenizer (verl's return_raw_input_ids case).
    """

    def __init__(self, path: str, policy_tokenizer, device, trust_remote_code: bool = False, batch_size: int = 64):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch, self.device, self.batch_size = torch, device, batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.model.to(device).eval().requires_grad_(False)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.same_tokens = (
            self.tokenizer.get_vocab() == policy_tokenizer.get_vocab()
            and self.tokenizer.chat_template == policy_tokenizer.chat_template
        )

    def inputs(self, messages: list[list[dict]], responses: list[str], prompt_ids, response_ids) -> list[list[int]]:
        if self.same_tokens:
            return [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
        texts = [
            self.tokenizer.apply_chat_template(m + [{"role": "assistant", "content": r}], tokenize=False)
            for m, r in zip(messages, responses)
        ]
        return [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]

    def score(self, messages, responses, prompt_ids, response_ids):
        from common.data import pad

        ids = self.inputs(messages, responses, prompt_ids, response_ids)
        out = []
        with self.torch.no_grad():
            for start in range(0, len(ids), self.batch_size):
                chunk = ids[start : start + self.batch_size]
                input_ids = pad(chunk, self.model.config.pad_token_id).to(self.device)
                attention = pad([[1] * len(x) for x in chunk], 0).to(self.device)
                out.append(self.model(input_ids=input_ids, attention_mask=attention).logits[:, 0].float())
        return self.torch.cat(out)


def start_reward_pool(
    reward_fn: str | None,
    *,
    workers: int,
    timeout: float,
    dry_run_rows: list[dict],
    log_path=None,
    tool_config: str | None = None,
    tool_timeout: float = 10.0,
    interaction_config: str | None = None,
) -> RewardPool:
    """The worker pool for --reward-fn (or the built-ins), checked before any model loads: a
    missing file fails with its name; the file is imported only in the workers (its code never
    runs in the trainer, and a hang or error at import is a UsageError, not a stuck run); a dry
    run scores rows of every data_source in dry_run_rows (prompt rows from common.data) with their
    ground truths. Pass no rows when a reward model scores instead. What the workers print goes
    to log_path (see _WorkerOutput)."""
    if reward_fn and not Path(reward_fn.partition(":")[0]).expanduser().is_file():
        raise UsageError(f"--reward-fn {reward_fn}: file {reward_fn.partition(':')[0]!r} does not exist")
    pool = RewardPool(reward_fn, workers=workers, timeout=timeout, log_path=log_path)
    if dry_run_rows:
        pool.dry_run(dry_run_rows)
    pool.tools, pool.interactions = start_agent_pools(tool_config, interaction_config, workers=workers,
                                                      timeout=tool_timeout, log_path=log_path)  # fmt: skip
    return pool


def start_agent_pools(tool_config: str | None, interaction_config: str | None, *, workers: int, timeout: float,
                      log_path=None) -> tuple[RewardPool | None, RewardPool | None]:  # fmt: skip
    """The agent loop's worker pools (common.agent), each None without its flag: the tools of
    --tool-config (`workers` of them) and the interactions of --interaction-config (one worker,
    which holds every running interaction's state). Started now, so an import that fails or hangs
    is an error before any model loads."""
    tools = (
        RewardPool(TOOLS_PREFIX + tool_config, workers=workers, timeout=timeout, log_path=log_path)
        if tool_config
        else None
    )
    interactions = (
        RewardPool(INTERACTIONS_PREFIX + interaction_config, workers=1, timeout=timeout, log_path=log_path)
        if interaction_config
        else None
    )
    return tools, interactions
