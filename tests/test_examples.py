"""examples/: the scripts that bring a user's data to the recipes, on rows made here."""

import importlib.util
import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from conftest import ROOT, read_metrics, run_recipe

from common.scoring import default_compute_score

ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A shop sells 1,200 pens a day. How many in 2 days?", "answer": "1,200 * 2 = 2,400\n#### 2,400"},
    {"question": "It is 5 degrees and drops 8. What is it now?", "answer": "5 - 8 = -3\n#### -3"},
]


def write(tmp_path, rows):
    source = tmp_path / "gsm8k.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return source, tmp_path / "gsm8k.parquet"


def convert(tmp_path, rows, split="train"):
    """examples/gsm8k.py's main in this process (its command line is test_a_row_without_a_final_answer_is_named's)."""
    spec = importlib.util.spec_from_file_location("gsm8k_example", ROOT / "examples" / "gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    source, out = write(tmp_path, rows)
    return module.main(module.Args(input=str(source), output=str(out), split=split)), out


def test_gsm8k_rows_become_verl_rows_the_builtin_reward_scores(tmp_path):
    """Each row: data_source openai/gsm8k, the question with verl's instruction, the number after '####' (commas
    dropped, a sign kept) as ground truth, the rest in extra_info; a response ending in that number scores 1 with
    the built-in reward the data_source picks, another number 0."""
    count, out = convert(tmp_path, ROWS, split="test")
    assert count == 3
    rows = pq.read_table(out).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "2400", "-3"]
    assert {r["data_source"] for r in rows} == {"openai/gsm8k"}
    assert rows[0]["prompt"] == [
        {
            "role": "user",
            "content": ROWS[0]["question"] + ' Let\'s think step by step and output the final answer after "####".',
        }
    ]
    assert rows[1]["extra_info"] == {
        "split": "test",
        "index": 1,
        "question": ROWS[1]["question"],
        "answer": ROWS[1]["answer"],
    }
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        assert default_compute_score(row["data_source"], f"So the total is\n#### {truth}", truth) == 1.0
        assert default_compute_score(row["data_source"], "So the total is\n#### 12345", truth) == 0.0


def test_a_row_without_a_final_answer_is_named(tmp_path):
    """From the command line, as a user runs it: one line naming the row, exit status 2, nothing written."""
    source, out = write(tmp_path, [ROWS[0], {"question": "q", "answer": "no final line"}])
    done = subprocess.run(
        [sys.executable, "examples/gsm8k.py", "--input", str(source), "--output", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and not out.exists()
    assert "gsm8k.jsonl row 1 column 'answer': no final answer after '#### '" in done.stderr


@pytest.mark.e2e
def test_the_converted_file_trains_grpo(tmp_path):
    """One command between a GSM8K-style file and recipes/grpo.py: two steps on its output."""
    _, out = convert(tmp_path, ROWS * 4)
    run = tmp_path / "run"
    run_recipe(
        "grpo",
        "--train-files",
        out,
        "--val-files",
        out,
        "--output-dir",
        run,
        "--total-training-steps",
        2,
        "--train-batch-size",
        4,
        "--rollout-n",
        2,
        "--max-prompt-length",
        256,
        "--test-freq",
        2,
        "--save-freq",
        0,
        "--no-val-before-train",
        "--logger",
    )
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2] and "val/accuracy" in metrics[-1]
