"""Prompt rows of large data, or any data with --data-workers above 1 (a feature: common.data templates a small
parquet file in the trainer's process, as the bundled runs do).

Each input is read through datasets (common.formats.sources: memory-mapped Arrow) and templated by a datasets map of
common.data.prompt_records, the function the in-process path runs, over --data-workers processes (verl's
filter_overlong_prompts_workers). The map is cached by a fingerprint of the input, the columns and length rules, the
tokenizer and this code, so the next start on the same data and flags reads the cache instead of templating again.
The rows stay on disk: MappedRows makes a row (common.data.prompt_row, as in process) when a batch asks for it.
sft.py's examples (common.sft_data) take the same road."""

import bisect
import hashlib
import itertools
import json
import logging
import os
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from common.data import (
    BAD,
    FILTERED,
    LARGE_ROWS,
    MULTIMODAL_COLUMNS,
    TRUNCATED,
    LoadStats,
    PromptSpec,
    as_files,
    file_prompts,
    in_process,
    is_agent_row,
    multimodal_error,
    prompt_records,
    prompt_row,
)
from common.errors import DataError
from common.formats.sources import dotted, nested, open_source
from common.parallel import barrier

log = logging.getLogger(__name__)
COLUMNS = ("fate", "error", "row", "prompt_ids", "messages", "data_source", "no_truth", "agent")  # the map's


def load_prompts(files, tokenizer, *, what: str = "train_files", data_workers: int = 1, **spec) -> tuple:
    """common.data.load_prompts' rows and LoadStats, as one PromptRows sequence (load_inputs: which input is templated
    in this process as there, and which by the cached map)."""
    spec, stats = PromptSpec(**spec), LoadStats()
    parts = load_inputs(
        files,
        what,
        data_workers,
        lambda file: file_prompts(file, tokenizer, spec, what, stats),
        lambda data, file: mapped_prompts(data, file, tokenizer, spec, what, data_workers, stats),
    )
    if not stats.kept:
        raise DataError(f"{what}: no rows left after filtering ({stats.summary(what)})")
    return PromptRows(parts), stats


def load_inputs(files, what: str, workers: int, here, mapped) -> list:
    """here(file) for an input under LARGE_ROWS rows with one worker (read whole, made in this process), mapped(data,
    file) for any other (data: the input as a memory-mapped Dataset). Under a launcher, each node's first process
    (LOCAL_RANK 0) runs the maps; the node's others wait, then read its cache."""
    files = as_files(files, what)
    opened = [None if in_process([file], workers) else open_source(str(file), what) for file in files]
    large = [data is not None and (workers > 1 or len(data) >= LARGE_ROWS) for data in opened]
    follower = any(large) and os.environ.get("LOCAL_RANK", "0") != "0"
    if follower:
        barrier()  # the node's first process maps into the cache, which this one then reads
    parts = [mapped(data, str(file)) if big else here(file) for file, data, big in zip(files, opened, large)]
    if any(large) and not follower:
        barrier()
    return parts


def mapped_prompts(data, file: str, tokenizer, spec: PromptSpec, what: str, workers: int, stats: LoadStats):
    """The kept rows of one input as MappedRows, counted in stats; the first bad row (in file order) raises."""
    first = first_row(data, file, what)
    spec = spec.for_file(file, list(first), first, what)
    stats.per_file[file] = len(data)
    stats.columns.setdefault(spec.describe(), []).append(file)
    columns = dict(
        row="int64", prompt_ids="int32[]", messages="string", data_source="string", no_truth="bool", agent="bool"
    )
    done = cached_map(
        data,
        file,
        _map_batch,
        dict(tokenizer=tokenizer, spec=spec, dotted=dotted(data)),
        columns,
        [repr(spec), tokenizer_identity(tokenizer)],
        workers,
    )
    fates, kept = fates_of(done)
    no_truth, agent = (done.data.column(c).to_numpy(zero_copy_only=False) for c in ("no_truth", "agent"))
    stats.rows += len(fates)
    stats.kept += len(kept)
    stats.filtered_overlong += len(fates) - len(kept)
    stats.truncated += int((fates == TRUNCATED).sum())
    stats.no_ground_truth += int(no_truth.sum())
    stats.agent_rows += int(agent.sum())
    done = done.select_columns(["row", "prompt_ids", "messages", "data_source"])
    return MappedRows(done, None if len(kept) == len(fates) else kept, partial(_prompt_of, data, file, spec))


def first_row(data, file: str, what: str) -> dict:
    """An input's first row (nested as verl's structs are), once it is known to have rows and no images or videos."""
    if not len(data):
        raise DataError(f"{what}: {file!r} has no rows")
    for column in [c for c in MULTIMODAL_COLUMNS if c in data.column_names]:  # read as Arrow: a Column is slow to walk
        if held := sum(1 for value in data.data.column(column).to_pylist() if value):
            raise multimodal_error(what, file, column, held, len(data))
    return nested(data[0]) if dotted(data) else data[0]


def fates_of(done) -> tuple:
    """(every row's fate, the kept rows' indices) of a map's result; the first bad row (in file order) raises."""
    fates = done.data.column("fate").to_numpy()
    if (bad := (fates == BAD).nonzero()[0]).size:
        raise DataError(done[int(bad[0])]["error"])
    return fates, (fates != FILTERED).nonzero()[0]


def cached_map(data, file: str, fn, fn_kwargs: dict, columns: dict, key: list, workers: int):
    """data.map(fn) over `workers` processes into `columns` (name -> type; "int32[]": a list of them) beside each
    row's fate and error, cached by a fingerprint of the input, `key` (the flags and tokenizer that make the rows)
    and the code that makes them: read back from the datasets cache where the same map ran before."""
    import datasets

    modules = {__file__, prompt_row.__code__.co_filename, fn.__code__.co_filename}
    code = [hashlib.sha256(Path(m).read_bytes()).hexdigest() for m in sorted(modules)]
    fingerprint = hashlib.sha256(json.dumps([data._fingerprint, file, *key, *code]).encode()).hexdigest()[:32]
    cache = Path(datasets.config.HF_DATASETS_CACHE) / "recipes_prompts" / f"{fingerprint}.arrow"
    cache.parent.mkdir(parents=True, exist_ok=True)
    shards = [cache.with_stem(f"{fingerprint}_{rank:05d}_of_{workers:05d}") for rank in range(workers)]
    if all(shard.exists() for shard in (shards if workers > 1 else [cache])):
        log.info("%s: %d rows, templated before: read from the cache %s", file, len(data), cache.parent)
    else:
        log.info("%s: templating %d rows in %d process(es), cached in %s", file, len(data), workers, cache.parent)
        datasets.enable_progress_bars()  # a long first start shows its progress
    types = {"fate": "int8", "error": "string", **columns}
    features = datasets.Features(
        {
            name: datasets.Sequence(datasets.Value(t[:-2])) if t.endswith("[]") else datasets.Value(t)
            for name, t in types.items()
        }
    )
    try:
        return data.map(
            fn,
            batched=True,
            batch_size=1000,
            with_indices=True,
            features=features,
            fn_kwargs={**fn_kwargs, "file": file},
            remove_columns=data.column_names,
            num_proc=workers if workers > 1 else None,
            new_fingerprint=fingerprint,
            cache_file_name=str(cache),
        )
    finally:
        datasets.disable_progress_bars()


def _map_batch(batch: dict, indices: list[int], *, tokenizer, spec: PromptSpec, dotted: bool, file: str) -> dict:
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    out = {k: [] for k in COLUMNS}
    records = prompt_records([nested(r) for r in rows] if dotted else rows, file, tokenizer, spec, indices[0])
    for i, (fate, record) in zip(indices, records):
        kept = {} if fate in (BAD, FILTERED) else record
        values = (
            fate,
            record if fate == BAD else None,
            i,
            kept.get("prompt_ids", []),
            json.dumps(kept.get("messages")),
            kept.get("data_source"),
            bool(kept) and kept["ground_truth"] is None,
            bool(kept) and is_agent_row(kept),
        )
        for column, value in zip(COLUMNS, values):
            out[column].append(value)
    return out


def _prompt_of(data, file: str, spec: PromptSpec, done: dict) -> dict:
    """A kept row, made by common.data.prompt_row (as in process) from the map's columns and the input's own row."""
    row = nested(data[done["row"]]) if dotted(data) else data[done["row"]]
    made = (None, json.loads(done["messages"]), row.get("agent_name") or "single_turn_agent")
    return prompt_row(row, done["row"], file, done["prompt_ids"], made, spec)[1]


def tokenizer_identity(tokenizer) -> str:
    """What makes a tokenizer's ids: its vocabulary and rules (a fast tokenizer's JSON), special tokens, chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    return hashlib.sha256((body + template + repr(tokenizer.all_special_tokens)).encode()).hexdigest()


class MappedRows(Sequence):
    """One input's rows kept on disk (a map's result, memory-mapped): make(its row of the map) is the row, made when
    asked for, so a million rows hold no Python objects."""

    def __init__(self, done, kept, make):
        """done: the map's rows, of which `kept` (indices; None: all) are the rows, in order."""
        self.done, self.kept, self.make = done, kept, make

    def __len__(self) -> int:
        return len(self.done) if self.kept is None else len(self.kept)

    def __getitem__(self, i: int) -> dict:
        return self.make(self.done[int(i if self.kept is None else self.kept[i])])

    def column(self, key: str) -> list:
        """One field of every row: data_source straight from the map's Arrow column, any other by making the rows."""
        if key != "data_source":
            return [row[key] for row in self]
        column = self.done.data.column(key)
        return (column if self.kept is None else column.take(self.kept)).to_pylist()


class PromptRows(Sequence):
    """The prompt rows of several inputs as one sequence (lists made in process, MappedRows), read as a list is:
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
        return [v for p in self.parts for v in (p.column(key) if isinstance(p, MappedRows) else [r[key] for r in p])]
