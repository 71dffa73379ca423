"""Evaluate: score a parquet of responses per data_source (verl's main_eval), with pass@k and maj@k.

The input is verl-format rows with a column of n responses per prompt (recipes/generate.py writes
one; every row must hold the same n). Each response is scored by the reward training uses: the
built-in for the row's data_source, or --reward-fn path.py[:name] with verl's compute_score
signature, in the same hang-proof worker pool (a timeout, an exception or a NaN scores 0 and is
counted), after the same dry run, so a data_source nothing can score stops it before any work.
Where generate.py ran conversations through the agent loop, its response_extra_info column (what
each conversation adds to extra_info: num_turns, rollout_reward_scores) reaches the reward as in
training.

Reported per data_source and over all rows:
    mean_score             mean score of every response
    pass@k, k = 1..n       Chen et al. 2021 (arXiv:2107.03374), unbiased: the mean over prompts of
                           1 - C(n - c, k) / C(n, k), c the prompt's correct responses. Correct: the
                           result's "acc" when the reward returns a dict with one, else score > 0,
                           as training's val/accuracy counts, so greedy pass@1 is that accuracy.
    maj@k, k = 1..n        where answers can be extracted (a dict result's "pred", else the
                           built-in reward's own reading): the most common answer among a prompt's
                           first k responses (a tie: the one seen first) is correct when the
                           responses giving it are; prompts without any answer count as wrong.
    response_length_mean   in tokens (the file's response_ids), else response_chars_mean
    truncated_fraction     responses cut at the length limit (the file's finish_reasons)
    scoring_failures       responses whose scoring raised or timed out
Trajectories played in environments (generate.py --env-config) score their own return, and count
as correct when the game was won; per tag (data_source) come also steps_mean,
format_errors_mean, invalid_actions_mean, env_errors and env_timeouts.
Output: a table on the console; JSON at --output-json shaped {"all": {...}, "<data_source>":
{...}}; with --output-scores, the input rows plus per-response scores and correctness.

Run:
    python recipes/generate.py --n-samples 8 && python recipes/evaluate.py --data-path runs/generate/test_n8.parquet
    python recipes/evaluate.py --data-path ~/gen/gsm8k_step80.parquet --reward-fn my_reward.py:compute_score
"""

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from common.config import check_flags, cli
from common.errors import UsageError, usage_errors
from common.flags import flag
from common.parallel import setup_logging
from common.rewards import Scored, reward_pool
from common.runlock import claim_output
from common.scoring import extract_answer, hit

RECIPE = Path(__file__).stem


# --- config ---------------------------------------------------------------------------------------
@dataclass
class Args:
    data_path: str = "runs/generate/test_n8.parquet"
    """parquet of prompts with their responses (recipes/generate.py's output)"""
    response_key: str = "responses"
    """column holding each row's list of n responses"""
    data_source_key: str = "data_source"
    """column naming each row's data source: metrics are split by it, and it picks the built-in reward"""
    reward_model_key: str = "reward_model"
    """column holding {"ground_truth": ...} for the reward"""
    reward_fn: str | None = None
    """path/to/file.py[:name] with verl's compute_score signature (default: built-ins by data_source)"""
    reward_timeout: float = flag(10.0, gt=0, unit="seconds")
    """seconds one sample may take to score before it gets 0"""
    reward_workers: int = flag(2, ge=1)
    """reward worker processes per rank"""
    output_json: str = ""
    """metrics file (default: beside the input, <input name>.eval.json)"""
    output_scores: str = ""
    """also write the input rows with per-response scores and correctness to this parquet (default: no)"""
    force_unlock: bool = False
    """take the lock of the run folder (or output file) even when a run on another host holds it: only when that
    run is known to be gone (its job ended, its node died); two live runs on one folder corrupt each other's files"""

    def __post_init__(self):  # checked as the flags are parsed, before anything is read
        check_flags(self)
        if not Path(self.data_path).expanduser().is_file():
            raise UsageError(
                f"--data-path {self.data_path}: no such file; write one with recipes/generate.py (see its --help)"
            )
        outputs = [("--output-json", self.json_path())] + [("--output-scores", Path(self.output_scores))] * bool(
            self.output_scores
        )
        for name, path in outputs:
            blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
            if blocking is not None:
                raise UsageError(f"{name} {path}: {blocking} is a file, so the folder cannot be created")

    def json_path(self) -> Path:
        data = Path(self.data_path).expanduser()
        return Path(self.output_json) if self.output_json else data.with_name(data.stem + ".eval.json")


# --- the metrics ----------------------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with n responses, c of them correct: 1 - C(n-c, k) / C(n, k),
    as the product 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never forms the large binomials."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def maj_at_k(answers: list[str | None], correct: list[bool], k: int) -> bool:
    """Majority vote over the first k responses: the most common extracted answer (a tie goes to
    the answer seen first), correct when a response giving it was scored correct."""
    first = [(a, ok) for a, ok in zip(answers[:k], correct[:k]) if a is not None]
    if not first:
        return False
    counts = Counter(a for a, _ in first)
    top = max(counts.values())
    winner = next(a for a, _ in first if counts[a] == top)
    return any(ok for a, ok in first if a == winner)


def summarise(prompts: list[dict], n: int) -> dict:
    """The metrics of a set of prompts, each {"scores", "correct", "answers", "lengths", "reasons",
    "failed"} lists of n."""
    out = {"prompts": len(prompts), "responses": len(prompts) * n}
    out["mean_score"] = sum(s for p in prompts for s in p["scores"]) / out["responses"]
    for k in range(1, n + 1):
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(p["correct"]), k) for p in prompts) / len(prompts)
    if any(a is not None for p in prompts for a in p["answers"]):
        for k in range(1, n + 1):
            out[f"maj@{k}"] = sum(maj_at_k(p["answers"], p["correct"], k) for p in prompts) / len(prompts)
    lengths = [x for p in prompts for x in p["lengths"]]
    if lengths:
        key = "response_length_mean" if prompts[0]["length_unit"] == "tokens" else "response_chars_mean"
        out[key] = sum(lengths) / len(lengths)
    reasons = [r for p in prompts for r in p["reasons"]]
    if reasons:
        out["truncated_fraction"] = reasons.count("length") / len(reasons)
    out["scoring_failures"] = sum(p["failed"] for p in prompts)
    played = [e for p in prompts for e in p.get("env") or []]  # environment trajectories (common.agents.env_manager)
    for key in ("steps", "format_errors", "invalid_actions") if played else ():
        out[f"{key}_mean"] = sum(e[key] for e in played) / len(played)
    if played:
        out["env_errors"], out["env_timeouts"] = sum(e["errors"] for e in played), sum(e["timeouts"] for e in played)
    return out


def table(results: dict, n: int) -> str:
    """The console tables, one line per data_source then all: pass@k, then maj@k where answers
    were extracted, for every k up to 8 (beyond: 1, 2, 4, ... and n)."""
    ks = list(range(1, n + 1)) if n <= 8 else sorted({2**i for i in range(n.bit_length()) if 2**i <= n} | {n})
    width = max(len(s) for s in results) + 2
    blocks = []
    for metric in ("pass", "maj"):
        cols = [c for c in (f"{metric}@{k}" for k in ks) if any(c in r for r in results.values())]
        if not cols:
            continue
        head = ["prompts", "mean_score"] if metric == "pass" else []
        lines = ["".ljust(width) + "".join(c.rjust(11) for c in head + cols)]
        for source, r in results.items():
            cells = [f"{r[c]:.4f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in head + cols]
            lines.append(source.ljust(width) + "".join(x.rjust(11) for x in cells))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


# --- reading -----------------------------------------------------------------------------------------
def read_rows(data_path: str, response_key: str, data_source_key: str, reward_model_key: str) -> tuple[list[dict], int]:
    """(per row {data_source, ground_truth, extra_info, extra_infos (each response's, with what its
    conversation added), responses, lengths, reasons}, n) from the --data-path parquet, its columns
    named by the --*-key flags. Every row must hold a list of the same number of response strings."""
    from common.data import DataError, get_field, has_column, read_rows

    ((file, rows),) = read_rows([data_path], "data_path")
    if not has_column(rows, response_key):
        raise DataError(
            f"{file}: no column {response_key!r} (it has {sorted(rows[0])}); generate responses with "
            f"recipes/generate.py, or set --response-key"
        )
    n = None
    parsed = []
    for i, row in enumerate(rows):
        responses = get_field(row, response_key, file, i, "response_key")
        if not isinstance(responses, list) or not all(isinstance(x, str) for x in responses) or not responses:
            raise DataError(f"{file} row {i}: {response_key!r} must be a non-empty list of strings")
        n = len(responses) if n is None else n
        if len(responses) != n:
            raise DataError(
                f"{file} row {i}: {len(responses)} responses where row 0 has {n}; pass@k needs the same n for "
                f"every prompt (regenerate, or split the file by n)"
            )
        reward = get_field(row, reward_model_key, file, i, "reward_model_key") if reward_model_key in row else None
        ids, reasons = row.get("response_ids"), row.get("finish_reasons")
        added = read_added(row.get("response_extra_info"), n, file, i)
        parsed.append(
            {
                "data_source": str(get_field(row, data_source_key, file, i, "data_source_key")),
                "ground_truth": reward.get("ground_truth") if isinstance(reward, dict) else None,
                "extra_infos": [
                    row.get("extra_info") if x is None else {**(row.get("extra_info") or {}), **x} for x in added
                ],
                "responses": responses,
                "lengths": [len(x) for x in ids]
                if isinstance(ids, list) and len(ids) == n
                else [len(x) for x in responses],
                "length_unit": "tokens" if isinstance(ids, list) and len(ids) == n else "chars",
                "reasons": reasons if isinstance(reasons, list) and len(reasons) == n else [],
                "file": file,
                "row": i,
            }
        )
        parsed[-1]["extra_info"] = parsed[-1]["extra_infos"][0]  # what the reward dry run scores
    return parsed, n


def read_added(column, n: int, file: str, i: int) -> list[dict | None]:
    """A row's response_extra_info (generate.py: n JSON strings of what each conversation added to
    extra_info, "null" for none); n Nones when the file has no such column."""
    from common.data import DataError

    if column is None:
        return [None] * n
    try:
        added = [json.loads(x) for x in column] if isinstance(column, list) and len(column) == n else None
    except (TypeError, ValueError):
        added = None
    if added is None or not all(x is None or isinstance(x, dict) for x in added):
        raise DataError(
            f"{file} row {i}: 'response_extra_info' must be {n} JSON strings of objects (or \"null\"), one per "
            f"response, as recipes/generate.py writes; drop the column to score without it"
        )
    return added


def score_all(args: Args, parsed: list[dict], tasks: list[tuple], out_json: Path) -> tuple[list[Scored], bool]:
    """Every response scored (a list of Scored, in order), and whether they are trajectories played in
    environments (generate.py --env-config), which score their own return; else in the reward
    pool, after its dry run, a chunk at a time for the progress bar."""
    played = all(isinstance(x, dict) and "env" in x for *_, x in tasks)  # generate.py --env-config: scored as played
    if played and args.reward_fn:
        raise UsageError(
            f"--reward-fn: {args.data_path} holds trajectories played in environments, which score "
            f"their own return; drop the flag"
        )
    if played:
        results = [x["env"] for *_, x in tasks]
        parts = [
            Scored(
                [e["return"] for e in results],
                [{"acc": float(e["success"])} for e in results],
                ok=[True] * len(results),
                preds=[None] * len(results),
            )
        ]
    else:  # score every response, a chunk at a time for the progress bar
        log_path = out_json.with_suffix(".reward_workers.log")
        pool = reward_pool(args.reward_fn, args.reward_workers, args.reward_timeout, log_path)
        if parsed:
            pool.dry_run(parsed)  # each data_source's first rows, before the whole file
        parts, step = [], 1024
        with tqdm(total=len(tasks), unit="response", desc="score") as bar:
            for start in range(0, len(tasks), step):
                parts.append(pool.score(tasks[start : start + step]))
                bar.update(len(parts[-1].scores))
        pool.close()
    return parts, played


# --- main ---------------------------------------------------------------------------------------
def main(args: Args) -> dict:
    setup_logging(0)
    parsed, n = read_rows(args.data_path, args.response_key, args.data_source_key, args.reward_model_key)
    out_json = claim_output(args.json_path(), force_unlock=args.force_unlock, flag="--output-json")
    if args.output_scores:  # one live run per output file, this one too
        claim_output(args.output_scores, force_unlock=args.force_unlock, flag="--output-scores")
    tasks = [
        (p["data_source"], r, p["ground_truth"], x) for p in parsed for r, x in zip(p["responses"], p["extra_infos"])
    ]
    parts, played = score_all(args, parsed, tasks, out_json)
    scored = Scored.merge(parts, [s for p in parts for s in p.scores], [e for p in parts for e in p.extras])
    ok = [o for p in parts for o in p.ok]
    preds = [x for p in parts for x in p.preds]

    # Group back by prompt, then by data_source.
    prompts = []
    for i, p in enumerate(parsed):
        span = range(i * n, (i + 1) * n)
        prompts.append(
            dict(
                p,
                scores=[scored.scores[j] for j in span],
                correct=[bool(hit(scored.scores[j], scored.extras[j])) for j in span],
                answers=[
                    preds[j] if preds[j] is not None else extract_answer(p["data_source"], tasks[j][1]) for j in span
                ],
                failed=sum(not ok[j] for j in span),
                env=[tasks[j][3]["env"] for j in span] if played else None,
            )
        )
    results = {"all": summarise(prompts, n)}
    results["all"].update(errors=scored.errors, timeouts=scored.timeouts, nonfinite=scored.nonfinite)
    for source in sorted({p["data_source"] for p in prompts}):
        results[source] = summarise([p for p in prompts if p["data_source"] == source], n)

    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(results, indent=1))
    print(table(results, n))
    print(f"{len(prompts)} prompts x {n} responses from {args.data_path}; metrics -> {out_json}")
    if scored.errors or scored.timeouts or scored.nonfinite:
        print(f"scoring: {scored.errors} errors, {scored.timeouts} timeouts, {scored.nonfinite} NaN / inf (scored 0)")
    if args.output_scores:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from common.data import read_rows as read_input

        path = Path(
            args.data_path
        ).expanduser()  # a parquet keeps its schema; JSONL, CSV, a datasets folder: their rows
        table_out = pq.read_table(path) if path.suffix == ".parquet" else pa.Table.from_pylist(read_input([path])[0][1])
        table_out = table_out.append_column("scores", pa.array([p["scores"] for p in prompts]))
        table_out = table_out.append_column("correct", pa.array([p["correct"] for p in prompts]))
        Path(args.output_scores).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table_out, args.output_scores)
        print(f"per-response scores -> {args.output_scores}")
    return results


if __name__ == "__main__":
    with usage_errors():  # a bad flag, path or file: one line naming it, exit status 2
        main(cli(Args, RECIPE))  # verl's main_eval keys work too
