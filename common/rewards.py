"""Reward functions with verl's signature: compute_score(data_source, solution_str, ground_truth, extra_info=None).

A score is a float, or a dict with a `score` key whose other keys become metrics.
"""

import re

BUNDLED_ADDITION = "bundled/addition"
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer_tag(text: str) -> str | None:
    """The content of the last <answer>...</answer>, stripped; None without one."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def addition_score(solution_str: str, ground_truth: str) -> float:
    """Bundled task: 1.0 when the last <answer> tag holds exactly the ground truth, else 0.0."""
    return float(extract_answer_tag(solution_str) == str(ground_truth).strip())


def exact_match(solution_str: str, ground_truth: str) -> float:
    return float(solution_str.strip() == str(ground_truth).strip())


def default_compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None):
    """Built-in scorer chosen by data_source; unknown sources are scored by exact match."""
    if data_source == BUNDLED_ADDITION:
        return addition_score(solution_str, ground_truth)
    return exact_match(solution_str, ground_truth)


def score_value(result) -> float:
    return float(result["score"] if isinstance(result, dict) else result)
