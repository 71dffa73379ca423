"""Prompt rows of large data, or any data with --data-workers above 1 (a feature: common.data templates a small
parquet file in the trainer's process, as the bundled runs do).

Each input is read through datasets (common.sources: memory-mapped Arrow) and templated by a datasets map of
common.data.prompt_records, the function the in-process path runs, over --data-workers processes (verl's
filter_overlong_prompts_workers). The map is cached by a fingerprint of the input, the columns and length rules, the
tokenizer and this code, so the next start on the same data and flags reads the cache instead of templating again.
The rows stay on disk: FileRows makes a row (common.data._prompt_row, as in process) when a batch asks for it."""

import bisect
import hashlib
import itertools
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from common.data import (
    BAD,
    FILTERED,
    LARGE_ROWS,
    MULTIMODAL_COLUMNS,
    TRUNCATED,
    LoadStats,
    PromptSpec,
    _prompt_row,
    as_files,
    file_prompts,
    in_process,
    is_agent_row,
    multimodal_error,
    prompt_records,
)
from common.errors import DataError
from common.parallel import barrier
from common.sources import dotted, nested, open_source

log = logging.getLogger(__name__)
COLUMNS = ("fate", "error", "row", "prompt_ids", "messages", "data_source", "no_truth", "agent")  # the map's


def load_prompts(files, tokenizer, *, what: str = "train_files", data_workers: int = 1, **spec) -> tuple:
    """common.data.load_prompts' rows and LoadStats, as one PromptRows sequence: a file under LARGE_ROWS rows with
    one worker is templated in this process as there; any other, by the cached map (mapped_prompts). Under a
    launcher, each node's first process (LOCAL_RANK 0) runs the map; the node's others wait, then read its cache."""
    spec, stats, files = PromptSpec(**spec), LoadStats(), as_files(files, what)
    opened = [None if in_process([file], data_workers) else open_source(str(file), what) for file in files]
    mapped = [data is not None and (data_workers > 1 or len(data) >= LARGE_ROWS) for data in opened]
    follower = any(mapped) and os.environ.get("LOCAL_RANK", "0") != "0"
    if follower:
        barrier()  # the node's first process maps into the cache, which this one then reads
    parts = [mapped_prompts(data, str(file), tokenizer, spec, what, data_workers, stats) if large
             else file_prompts(file, tokenizer, spec, what, stats)
             for file, data, large in zip(files, opened, mapped)]  # fmt: skip
    if any(mapped) and not follower:
        barrier()
    if not stats.kept:
        raise DataError(f"{what}: no rows left after filtering ({stats.summary(what)})")
    return PromptRows(parts), stats


def mapped_prompts(data, file: str, tokenizer, spec: PromptSpec, what: str, workers: int, stats: LoadStats):
    """The kept rows of one input as FileRows, counted in stats; the first bad row (in file order) raises."""
    if not len(data):
        raise DataError(f"{what}: {file!r} has no rows")
    for column in [c for c in MULTIMODAL_COLUMNS if c in data.column_names]:
        if held := sum(1 for value in data[column] if value):
            raise multimodal_error(what, file, column, held, len(data))
    first = nested(data[0]) if dotted(data) else data[0]
    spec = spec.for_file(file, list(first), first, what)
    stats.per_file[file] = len(data)
    stats.columns.setdefault(spec.describe(), []).append(file)
    done = _templated(data, file, tokenizer, spec, workers)
    fates, no_truth, agent = (done.data.column(c).to_numpy(zero_copy_only=False) for c in ("fate", "no_truth", "agent"))
    if (bad := (fates == BAD).nonzero()[0]).size:
        raise DataError(done[int(bad[0])]["error"])
    kept = (fates != FILTERED).nonzero()[0]
    stats.rows += len(fates)
    stats.kept += len(kept)
    stats.filtered_overlong += len(fates) - len(kept)
    stats.truncated += int((fates == TRUNCATED).sum())
    stats.no_ground_truth += int(no_truth.sum())
    stats.agent_rows += int(agent.sum())
    done = done.select_columns(["row", "prompt_ids", "messages", "data_source"])
    return FileRows(data, done, None if len(kept) == len(fates) else kept, file, spec)


def _templated(data, file: str, tokenizer, spec: PromptSpec, workers: int):
    """The map of prompt_records over `data` (COLUMNS: each row's fate and error, and for a kept row its prompt_ids,
    messages as JSON and data_source), read back from the datasets cache where the same map ran before."""
    import datasets

    code = [hashlib.sha256(Path(m).read_bytes()).hexdigest() for m in (__file__, _prompt_row.__code__.co_filename)]
    key = json.dumps([data._fingerprint, file, repr(spec), tokenizer_identity(tokenizer), *code])
    fingerprint = hashlib.sha256(key.encode()).hexdigest()[:32]
    cache = Path(datasets.config.HF_DATASETS_CACHE) / "recipes_prompts" / f"{fingerprint}.arrow"
    cache.parent.mkdir(parents=True, exist_ok=True)
    shards = [cache.with_stem(f"{fingerprint}_{rank:05d}_of_{workers:05d}") for rank in range(workers)]
    if all(shard.exists() for shard in (shards if workers > 1 else [cache])):
        log.info("%s: %d rows, templated before: read from the cache %s", file, len(data), cache.parent)
    else:
        log.info("%s: templating %d rows in %d process(es), cached in %s", file, len(data), workers, cache.parent)
        datasets.enable_progress_bars()  # a long first start shows its progress
    features = dict(fate="int8", error="string", row="int64", messages="string", data_source="string")
    features = datasets.Features({**{k: datasets.Value(v) for k, v in features.items()},
                                  "prompt_ids": datasets.Sequence(datasets.Value("int32")),
                                  "no_truth": datasets.Value("bool"), "agent": datasets.Value("bool")})  # fmt: skip
    try:
        return data.map(_map_batch, batched=True, batch_size=1000, with_indices=True, features=features,
                        remove_columns=data.column_names, num_proc=workers if workers > 1 else None,
                        new_fingerprint=fingerprint, cache_file_name=str(cache),
                        fn_kwargs=dict(file=file, tokenizer=tokenizer, spec=spec, dotted=dotted(data)))  # fmt: skip
    finally:
        datasets.disable_progress_bars()


def _map_batch(batch: dict, indices: list[int], *, file: str, tokenizer, spec: PromptSpec, dotted: bool) -> dict:
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    out = {k: [] for k in COLUMNS}
    records = prompt_records([nested(r) for r in rows] if dotted else rows, file, tokenizer, spec, indices[0])
    for i, (fate, record) in zip(indices, records):
        kept = {} if fate in (BAD, FILTERED) else record
        values = (fate, record if fate == BAD else None, i, kept.get("prompt_ids", []),
                  json.dumps(kept.get("messages")), kept.get("data_source"),
                  bool(kept) and kept["ground_truth"] is None, bool(kept) and is_agent_row(kept))  # fmt: skip
        for column, value in zip(COLUMNS, values):
            out[column].append(value)
    return out


def tokenizer_identity(tokenizer) -> str:
    """What makes a tokenizer's ids: its vocabulary and rules (a fast tokenizer's JSON), special tokens, chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    return hashlib.sha256((body + template + repr(tokenizer.all_special_tokens)).encode()).hexdigest()


class FileRows(Sequence):
    """One input's templated prompt rows, memory-mapped: a row is made by common.data._prompt_row (as in process)
    from the map's columns and the input's own row when asked for, so a million rows hold no Python objects."""

    def __init__(self, data, done, kept, file: str, spec: PromptSpec):
        """done: the map's rows, of which `kept` (indices; None: all) are the rows, in order."""
        self.data, self.done, self.kept, self.file, self.spec, self.dotted = data, done, kept, file, spec, dotted(data)

    def __len__(self) -> int:
        return len(self.done) if self.kept is None else len(self.kept)

    def __getitem__(self, i: int) -> dict:
        done = self.done[int(i if self.kept is None else self.kept[i])]
        row = nested(self.data[done["row"]]) if self.dotted else self.data[done["row"]]
        made = (None, json.loads(done["messages"]), row.get("agent_name") or "single_turn_agent")
        return _prompt_row(row, done["row"], self.file, done["prompt_ids"], made, self.spec)[1]

    def column(self, key: str) -> list:
        """One field of every row: data_source straight from the map's Arrow column, any other by making the rows."""
        if key != "data_source":
            return [row[key] for row in self]
        column = self.done.data.column(key)
        return (column if self.kept is None else column.take(self.kept)).to_pylist()


class PromptRows(Sequence):
    """The prompt rows of several inputs as one sequence (lists templated in process, FileRows), read as a list is:
    by index or slice, and joined with + (train + val)."""

    def __init__(self, parts):
        self.parts = [p for part in parts for p in (part.parts if isinstance(part, PromptRows) else [part])]
        self.ends = list(itertools.accumulate(len(p) for p in self.parts))

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = i + len(self) if i < 0 else i
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = bisect.bisect_right(self.ends, i)
        return self.parts[k][i - (self.ends[k - 1] if k else 0)]

    def __add__(self, other):
        return PromptRows([self, other])

    def __radd__(self, other):
        return PromptRows([other, self])

    def column(self, key: str) -> list:
        return [v for p in self.parts for v in (p.column(key) if isinstance(p, FileRows) else [r[key] for r in p])]
