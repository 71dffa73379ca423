"""GSM8K-style data (a question, and an answer that ends in "#### N") in this library's format, verl's.

    python examples/gsm8k.py --input gsm8k/train.jsonl --output ~/data/gsm8k/train.parquet
    python examples/gsm8k.py --input gsm8k/test.jsonl --output ~/data/gsm8k/test.parquet --split test
    python recipes/grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --max-response-length 512 \
        --train-files ~/data/gsm8k/train.parquet --val-files ~/data/gsm8k/test.parquet

--input is anything --train-files reads: parquet, JSON / JSONL, CSV or Arrow, or a save_to_disk folder
(FOLDER@SPLIT), e.g. the GSM8K you saved with datasets. Each row becomes:
    data_source       openai/gsm8k, which picks the matching built-in reward: verl's GSM8K rule
                      (common.scoring.gsm8k_score), 1 when the number after "#### " in the response is the answer
    prompt            the question and verl's instruction to end with "#### N", as one user message
    reward_model      {style: rule, ground_truth: N}, N read from the answer as the reward reads a response
    extra_info        the split, the row's index, the question and the whole answer (its reasoning)
A row whose answer has no "#### N" is an error naming it: it could never be scored right.
"""

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import tyro

from common.data import DataError, get_field, read_rows
from common.errors import usage_errors
from common.scoring import extract_answer

SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's, so its models match


@dataclass
class Args:
    input: str
    """the GSM8K-style data: a file or save_to_disk folder (FOLDER@SPLIT)"""
    output: str
    """the parquet file to write"""
    question_key: str = "question"
    """column holding the question"""
    answer_key: str = "answer"
    """column holding the answer, which ends in '#### N'"""
    split: str = "train"
    """the split's name, kept in extra_info"""


def convert(rows: list[dict], file: str, args: Args) -> list[dict]:
    """verl-format rows of GSM8K-style ones (the module's docstring says what each column holds)."""
    out = []
    for i, row in enumerate(rows):
        question = str(get_field(row, args.question_key, file, i, "question_key"))
        answer = str(get_field(row, args.answer_key, file, i, "answer_key"))
        truth = extract_answer(SOURCE, answer)  # the number after "#### ", as the reward reads a response's
        if truth is None:
            raise DataError(
                f"{file} row {i} column {args.answer_key!r}: no final answer after '#### ' in "
                f"{answer[-80:]!r}; GSM8K's answers end in '#### N'"
            )
        out.append(
            {
                "data_source": SOURCE,
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {"split": args.split, "index": i, "question": question, "answer": answer},
            }
        )
    return out


def main(args: Args) -> int:
    rows = [r for file, part in read_rows([args.input], "--input") for r in convert(part, file, args)]
    output = Path(args.output).expanduser()
    output.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), output)
    print(f"{len(rows)} rows -> {output} (data_source {SOURCE}: the built-in GSM8K reward scores them)")
    return len(rows)


if __name__ == "__main__":
    with usage_errors():  # a missing file or a row without "#### N": one line naming it, exit status 2
        main(tyro.cli(Args))
