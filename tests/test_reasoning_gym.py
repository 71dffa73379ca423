"""reasoning-gym tasks as data (common.formats.reasoning_gym): --train-files reasoning-gym:NAME?size=&seed=&... makes
verl-format rows of the task's generated problems, scored by the task's own score_answer, against the real package."""

import re

import pytest
from conftest import read_metrics, run_recipe

pytest.importorskip("reasoning_gym", reason='reasoning-gym is not installed: pip install -e ".[reasoning-gym]"')

from common.errors import UsageError  # noqa: E402
from common.formats.reasoning_gym import read  # noqa: E402
from common.scoring import default_compute_score  # noqa: E402


def test_a_task_becomes_verl_rows_of_its_problems_with_their_config_and_seed():
    """size rows of the task's problems, seeded (the same seed the same rows, another seed others), the task's config
    passed through (two terms a problem), the package's default system prompt first unless system_prompt=none."""
    import reasoning_gym

    rows = read("reasoning-gym:basic_arithmetic?size=8&seed=3&min_terms=2&max_terms=2", "--train-files")
    problems = reasoning_gym.create_dataset("basic_arithmetic", size=8, seed=3, min_terms=2, max_terms=2)
    assert len(rows) == 8 and all(r["data_source"] == "reasoning_gym/basic_arithmetic" for r in rows)
    assert [r["reward_model"]["ground_truth"] for r in rows] == [str(p["answer"]) for p in problems]
    assert [r["prompt"][-1]["content"] for r in rows] == [p["question"] for p in problems]
    assert rows[0]["prompt"][0] == {"role": "system", "content": reasoning_gym.utils.SYSTEM_PROMPTS["default"]}
    assert all(p["metadata"]["num_terms"] == 2 for p in problems)  # the config reached the task
    assert rows == read("reasoning-gym:basic_arithmetic?size=8&seed=3&min_terms=2&max_terms=2", "--train-files")
    other = read("reasoning-gym:basic_arithmetic?size=8&seed=4&system_prompt=none", "--train-files")
    assert [r["prompt"] for r in other] != [r["prompt"][1:] for r in rows] and len(other[0]["prompt"]) == 1


def test_a_response_is_scored_by_the_tasks_own_score_answer():
    (row,) = read("reasoning-gym:basic_arithmetic?size=1&seed=5", "--train-files")
    answer, extra = row["reward_model"]["ground_truth"], row["extra_info"]
    score = lambda text: default_compute_score(row["data_source"], text, answer, extra)  # noqa: E731
    assert score(f"so <answer>{answer}</answer>") == 1.0
    assert score("<answer>12345678</answer>") == 0.0 and score(answer) == 0.0  # wrong, or no answer tags
    with pytest.raises(ValueError, match="no reasoning_gym entry"):
        default_compute_score(row["data_source"], f"<answer>{answer}</answer>", answer, {})


@pytest.mark.parametrize(
    "spec, said",
    [
        ("reasoning-gym:basic_arithmetc", "no task 'basic_arithmetc'; did you mean basic_arithmetic"),
        ("reasoning-gym:basic_arithmetic?size=-3", "size must be a whole number >= 0, got -3"),
        ("reasoning-gym:basic_arithmetic?nonsense=3", "reasoning-gym refuses the config (TypeError"),
        ("reasoning-gym:basic_arithmetic?system_prompt=fancy", "system_prompt 'fancy' is none of"),
    ],
)
def test_an_unknown_task_or_a_config_it_refuses_is_one_line_naming_it(spec, said):
    with pytest.raises(UsageError, match=re.escape(said)):
        read(spec, "--train-files")


@pytest.mark.e2e
def test_grpo_trains_on_a_reasoning_gym_task_scored_by_the_task(tmp_path):
    """grpo.py with reasoning-gym training and validation data: the launch's reward dry run scores its rows with the
    task's own scorer, and 2 steps train; an unknown task stops the launch in one line (exit 2)."""
    spec = "reasoning-gym:basic_arithmetic?size=64&seed={}&system_prompt=none&max_terms=2"
    flags = ["--max-prompt-length", "128", "--max-response-length", "32", "--train-batch-size", "8", "--rollout-n", "4",
             "--total-training-steps", "2", "--test-freq", "2", "--save-freq", "0"]  # fmt: skip
    proc = run_recipe(
        "grpo", "--train-files", spec.format(1), "--val-files", spec.format(2), *flags, "--output-dir", tmp_path
    )
    assert "built-in rewards scored 2 of 2 real rows" in proc.stdout
    steps = [m for m in read_metrics(tmp_path) if "train/loss" in m]
    assert len(steps) == 2 and steps[-1]["reward/errors"] == 0 and "val/accuracy" in steps[-1]
    bad = run_recipe("grpo", "--train-files", "reasoning-gym:no_such_task", "--output-dir", tmp_path / "b", check=False)
    assert bad.returncode == 2 and "reasoning-gym has no task 'no_such_task'" in bad.stderr
