"""Reward functions with verl's signature, and the loaders of user code (no processes here).

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

A dict carries the score under "score"; its other numeric keys become metrics. Without --reward-fn
each row's data_source picks a built-in. common.rewards runs these in hang-proof workers."""

import importlib.util
import math
import re
import sys
from pathlib import Path

from common.errors import UsageError

BUNDLED_SOURCES = ("bundled/addition", "bundled/calculator")  # the bundled tasks: 2-digit, and 3-digit with a tool
PLAIN_SOURCES = ("bundled/plain_addition",)  # the real model's task: a plain answer, its last number read
GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
MATH_SOURCES = (
    "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math",
    "math_dapo", "aime", "aime24", "aime25", "amc", "olympiad_bench",
)  # fmt: skip
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
FLOAT32_MAX = 3.4028234663852886e38  # rewards train as float32: a larger score would be infinite there


def extract_answer_tag(text: str) -> str | None:
    """The content of the last <answer>...</answer>, stripped; None without one."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def addition_score(solution_str: str, ground_truth) -> float:
    """Bundled task: 1.0 when the last <answer> tag holds exactly the ground truth, else 0.0."""
    return float(extract_answer_tag(solution_str) == str(ground_truth).strip())


def _gsm8k_answer(text: str, method: str = "strict") -> str | None:
    """The number after '#### ' (strict) or the last number (flexible) in text[-300:], less commas and a final dot."""
    tail = text[-300:]
    found = _GSM8K_STRICT.findall(tail) if method == "strict" else [n for n in _NUMBER.findall(tail) if n != "."]
    return found[-1].replace(",", "").rstrip(".") if found else None


def gsm8k_score(
    solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """verl's GSM8K rule on the answer _gsm8k_answer reads; format_score for an answer that is wrong. The ground
    truth is the number, or GSM8K's whole solution (its number after '#### ')."""
    answer = _gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    truth = _gsm8k_answer(str(ground_truth)) or str(ground_truth)  # GSM8K's own answer column ends "#### 72"
    return score if answer == truth.replace(",", "").strip() else format_score


def last_number_score(solution_str: str, ground_truth) -> float:
    """Plain-answer task: 1.0 when the reply's last number is the ground truth ("27 + 48 = 75."; GSM8K's flexible rule)."""
    return gsm8k_score(solution_str, ground_truth, method="flexible")


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


def builtin_scorer(data_source: str):
    """The built-in (solution_str, ground_truth) -> score for a data_source, or None."""
    if data_source in BUNDLED_SOURCES:
        return addition_score
    if data_source in PLAIN_SOURCES:
        return last_number_score
    if data_source in GSM8K_SOURCES:
        return gsm8k_score
    if data_source in MATH_SOURCES or data_source.startswith(("math", "aime")):
        return math_score
    if data_source == "format":
        return lambda solution_str, ground_truth: format_score(solution_str)
    return None


def extract_answer(data_source: str, text: str) -> str | None:
    """The final answer a built-in reward reads from a response (for maj@k votes in recipes/evaluate.py), or None."""
    readers = {addition_score: extract_answer_tag, gsm8k_score: _gsm8k_answer, math_score: last_boxed}
    readers[last_number_score] = lambda text: _gsm8k_answer(text, "flexible")
    read = readers.get(builtin_scorer(data_source))
    return read(text) if read else None


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if str(data_source).startswith("reasoning_gym/"):  # its task's own score_answer (common.formats.reasoning_gym)
        from common.formats.reasoning_gym import score

        return score(data_source, solution_str, extra_info)
    scorer = builtin_scorer(data_source)
    if scorer is None:
        raise ValueError(
            f"no built-in reward for data_source={data_source!r} (built-ins: {', '.join(BUNDLED_SOURCES + PLAIN_SOURCES)}, "
            f"{', '.join(GSM8K_SOURCES)}, math sources such as {MATH_SOURCES[0]}, format); pass "
            f"--reward-fn path/to/file.py:compute_score"
        )
    return scorer(solution_str, ground_truth)


def load_reward_fn(spec: str | None):
    """`path/to/file.py[:name]` -> the function (name defaults to compute_score); None -> built-ins."""
    return load_from_file(spec, "--reward-fn", "compute_score") if spec else default_compute_score


def load_from_file(spec: str, flag: str, default_name: str, kind: str = "function"):
    """`path/to/file.py[:name]` -> that function (or class: kind), the file run as its own module; errors name flag."""
    path, _, name = spec.partition(":")
    name = name or default_name
    file = Path(path).expanduser()
    if not file.is_file():
        raise UsageError(f"{flag} {spec}: file {path!r} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"_user_code_{abs(hash(str(file.resolve())))}", file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    found = getattr(module, name, None)
    if not callable(found):
        raise UsageError(f"{flag} {spec}: {path!r} defines no {kind} {name!r}")
    return found


def hit(score: float, extras: dict) -> float:
    """Whether a sample counts as correct: the result's own "acc" key when it has one, else score > 0."""
    return float(extras.get("acc", score > 0))


def score_value(result) -> float:
    """The float score of a number or a dict's "score"; NaN and infinity pass (RewardPool.score zeroes them)."""
    value = result["score"] if isinstance(result, dict) else result
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"reward must be a number or a dict with a numeric 'score', got {result!r}")
    return float(value)


def finite(score: float) -> bool:
    """Whether a score is a usable reward: a number that stays finite as a float32."""
    return math.isfinite(score) and abs(score) <= FLOAT32_MAX
