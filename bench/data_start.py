"""How long the prompts of a large dataset take to be ready, and the memory they take: a generated JSONL file of
--rows rows with TRL's columns (the bundled addition task's questions, 1,000,000 by default), read three ways, each
in a process of its own so that its peak memory is its own:

- in-process: common.data.load_prompts, the loader a small parquet file takes (every row read whole and templated in
  the trainer's process), on the same rows written as verl's parquet: the floor the others are measured against;
- first start: common.formats.prompt_cache.load_prompts with --workers processes and an empty datasets cache (the JSONL
  file turned into Arrow, then the templating map written to the cache);
- cached start: the same call again, served from the cache.

Prints each one's seconds (from the call to the rows a step reads; imports and the tokenizer come before) and peak
resident memory (the process's peak plus its largest worker's), and their ratios to the in-process loader measured
in this run. The data and the cache live in a temporary folder that is removed at the end.

    python bench/data_start.py                         # a million rows, two workers
    python bench/data_start.py --rows 100000 --workers 4
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "bundled" / "tiny-qwen2"

CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
from common.model import load_tokenizer
tokenizer = load_tokenizer({tokenizer!r})
start = time.perf_counter()
if {mapped!r}:
    from common.formats.prompt_cache import load_prompts
    rows, stats = load_prompts([{path!r}], tokenizer, data_workers={workers}, data_source="bundled/addition",
                               max_prompt_length=64, ground_truth="required")
else:
    from common.data import load_prompts
    rows, stats = load_prompts([{path!r}], tokenizer, max_prompt_length=64, ground_truth="required")
sample = [rows[i]["prompt_ids"] for i in (0, len(rows) // 2, len(rows) - 1)]  # what a step reads
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps(dict(seconds=seconds, peak_mib=peak / 1024, kept=stats.kept, sample=sample)))
"""


def write_rows(folder: Path, n: int, seed: int) -> tuple[Path, Path]:
    """The same n questions as TRL's JSONL (prompt text, solution, data_source) and as verl's parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(n)]
    texts = [f"{a}+{b}=? Answer in <answer></answer>." for a, b in pairs]
    answers = [str(a + b) for a, b in pairs]
    jsonl = folder / "rows.jsonl"
    with jsonl.open("w") as f:
        for text, answer in zip(texts, answers):
            f.write(json.dumps({"prompt": text, "solution": answer}) + "\n")
    table = pa.table(
        {
            "data_source": ["bundled/addition"] * n,
            "prompt": [[{"role": "user", "content": t}] for t in texts],
            "reward_model": [{"style": "rule", "ground_truth": a} for a in answers],
        }
    )
    parquet = folder / "rows.parquet"
    pq.write_table(table, parquet)
    return jsonl, parquet


def measure(path: Path, mapped: bool, workers: int, cache: Path) -> dict:
    code = CHILD.format(root=str(ROOT), tokenizer=str(TOKENIZER), mapped=mapped, path=str(path), workers=workers)
    env = dict(os.environ, HF_DATASETS_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the measured process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="data_start_") as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        jsonl, parquet = write_rows(folder, args.rows, args.seed)
        print(
            f"{args.rows:,} rows written in {time.perf_counter() - start:.0f} s "
            f"(JSONL {jsonl.stat().st_size / 2**20:.0f} MiB, parquet {parquet.stat().st_size / 2**20:.0f} MiB)"
        )
        runs = {
            "in-process (parquet)": measure(parquet, False, 1, folder / "cache"),
            f"first start ({args.workers} workers)": measure(jsonl, True, args.workers, folder / "cache"),
            f"cached start ({args.workers} workers)": measure(jsonl, True, args.workers, folder / "cache"),
        }
    floor = runs["in-process (parquet)"]
    samples = {json.dumps(r["sample"]) for r in runs.values()}
    assert len(samples) == 1 and len({r["kept"] for r in runs.values()}) == 1, "the loaders disagree on the rows"
    print(f"{'':26} {'seconds':>8} {'x in-process':>13} {'peak MiB':>9} {'x in-process':>13}")
    for name, r in runs.items():
        print(
            f"{name:26} {r['seconds']:8.1f} {r['seconds'] / floor['seconds']:13.2f} {r['peak_mib']:9.0f} "
            f"{r['peak_mib'] / floor['peak_mib']:13.2f}"
        )
    print(
        f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}; python bench/data_start.py --rows {args.rows} "
        f"--workers {args.workers}"
    )


if __name__ == "__main__":
    main()
