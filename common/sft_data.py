"""sft.py's examples: chat conversations or prompt / response rows, tokenized with a loss mask on
the assistant's tokens only. The RL recipes never load it (their prompts: common.data.load_prompts).
"""

import json
import logging
from dataclasses import dataclass, replace
from typing import Annotated

import tyro

from common.data import (
    BAD,
    FILTERED,
    KEPT,
    TRUNCATED,
    DataArgs,
    DataError,
    LoadStats,
    as_files,
    as_messages,
    caught,
    get_field,
    has_column,
    in_process,
    read_rows,
    template_reads,
    too_long,
    truncate,
)
from common.flags import flag

log = logging.getLogger(__name__)


def as_tools(value, file: str, index: int, key: str) -> list[dict] | None:
    """A tools cell (verl's multiturn tools_key) as the OpenAI function schemas a chat template
    lists: a list of them, or that list as a JSON string; None or empty for no tools."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as e:
            raise DataError(f"{file} row {index} column {key!r}: not valid JSON ({e.msg})") from None
    if value is None or (isinstance(value, list | tuple) and not value):
        return None
    if isinstance(value, list | tuple) and all(
        isinstance(t, dict) and isinstance((t.get("function") or {}).get("name"), str) for t in value
    ):
        return [dict(t) for t in value]
    raise DataError(
        f"{file} row {index} column {key!r}: expected a list of OpenAI tool schemas "
        f"({{'type': 'function', 'function': {{'name': ..., ...}}}}), or that list as JSON, got: {str(value)[:80]!r}"
    )


def _chat_texts(tokenizer, messages: list[dict], tools) -> tuple[list[str], list[int]]:
    """The template texts an SFT conversation is cut by (the whole conversation, then for each
    assistant turn the prompt before it and the conversation up to its end) and those turns."""

    def render(upto, add_generation_prompt):
        return tokenizer.apply_chat_template(
            messages[:upto], tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    turns = [t for t, message in enumerate(messages) if message["role"] == "assistant"]
    return [
        render(len(messages), False),
        *(text for t in turns for text in (render(t, True), render(t + 1, False))),
    ], turns


def _assistant_spans(pieces: list[list[int]], turns: list[int], file, index) -> tuple[list, list, list]:
    """Token ids, loss mask and the last assistant turn's prompt from _chat_texts' texts, tokenized."""
    full, spans = pieces[0], pieces[1:]
    mask = [0] * len(full)
    for k, turn in enumerate(turns):
        start, end = spans[2 * k], spans[2 * k + 1]
        if full[: len(start)] != start or full[: len(end)] != end:
            raise DataError(
                f"{file} row {index}: the chat template does not render turn {turn} as a prefix "
                f"of the whole conversation, so assistant tokens cannot be located; use "
                f"prompt/response columns or a template that renders history unchanged"
            )
        mask[len(start) : len(end)] = [1] * (len(end) - len(start))
    return full, mask, spans[-2]


RESPONSE_KEY = "extra_info.answer"  # sft.py's default response column (--response-key)


@dataclass(frozen=True)
class SftSpec:
    """What sft_records makes of a file's rows: its columns, and whether they hold conversations (for_file)."""

    max_length: int
    messages_key: str = "messages"
    prompt_key: str = "prompt"
    response_key: str = "response"
    tools_key: str = "tools"
    truncation: str = "error"
    chat: bool = False
    with_tools: bool = False

    def for_file(self, file: str, first: dict) -> "SftSpec":
        chat = has_column([first], self.messages_key)
        if chat and self.response_key not in (RESPONSE_KEY, "response"):  # the flag given, and never read
            raise DataError(
                f"{file}: a {self.messages_key!r} column makes each row a conversation, so --response-key "
                f"{self.response_key!r} would not be read; drop --response-key, or name another --messages-key"
            )
        if not chat and not has_column([first], self.prompt_key):
            raise DataError(
                f"{file}: neither a {self.messages_key!r} column (chat) nor a {self.prompt_key!r} column "
                f"(prompt/response) found; columns are {sorted(first)}; set --messages-key or "
                f"--prompt-key/--response-key"
            )
        return replace(self, chat=chat, with_tools=chat and has_column([first], self.tools_key))


def _sft_texts(tokenizer, row, file, i, spec: SftSpec) -> tuple[list[str], list[int]]:
    """The texts one SFT row is tokenized from: _chat_texts' for a conversation, or the templated
    prompt and the response (and no turns)."""
    if spec.chat:
        value = get_field(row, spec.messages_key, file, i, "messages_key")
        messages = as_messages(value, file, i, spec.messages_key, template_reads(tokenizer))
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{file} row {i} column {spec.messages_key!r}: no assistant message to train on")
        empty = [
            t for t, m in enumerate(messages) if m["role"] == "assistant" and not str(m.get("content") or "").strip()
        ]
        if any(not messages[t].get("tool_calls") for t in empty):  # a turn of tool calls alone has no text
            raise DataError(
                f"{file} row {i} column {spec.messages_key!r}: assistant turn {empty[0]} is empty, which would "
                f"train the model to answer nothing; fill it or drop the row"
            )
        tools = as_tools(get_field(row, spec.tools_key, file, i), file, i, spec.tools_key) if spec.with_tools else None
        return _chat_texts(tokenizer, messages, tools)
    value = get_field(row, spec.prompt_key, file, i, "prompt_key")
    messages = as_messages(value, file, i, spec.prompt_key, template_reads(tokenizer))
    response = get_field(row, spec.response_key, file, i, "response_key")
    if not isinstance(response, str):
        raise DataError(
            f"{file} row {i} column {spec.response_key!r}: expected a string response, "
            f"got {type(response).__name__}: {str(response)[:80]!r}"
        )
    return [tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), response], []


def sft_records(rows, file: str, tokenizer, spec: SftSpec, start: int = 0) -> list[tuple[int, dict | str]]:
    """(fate, the example; for BAD, the error's message) of each row, numbered from `start`, as
    common.data.prompt_records gives prompts: every row templated, then all texts tokenized in one batched
    call (about three times as fast as call by call). A FILTERED row lost every response token to truncation."""
    texts = [caught(_sft_texts, tokenizer, row, file, i, spec) for i, row in enumerate(rows, start)]
    flat = [text for made in texts if not isinstance(made, str) for text in made[0]]
    pieces = iter(tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else ())
    eos = tokenizer.eos_token_id
    made = [
        t if isinstance(t, str) else caught(_example, row, i, file, [next(pieces) for _ in t[0]], t[1], spec, eos)
        for i, (row, t) in enumerate(zip(rows, texts), start)
    ]
    return [(BAD, m) if isinstance(m, str) else m for m in made]


def _example(row: dict, i: int, file: str, pieces: list, turns: list, spec: SftSpec, eos: int) -> tuple[int, dict]:
    if spec.chat:
        ids, mask, prompt_ids = _assistant_spans(pieces, turns, file, i)
    else:
        prompt_ids, response_ids = pieces[0], pieces[1] + [eos]
        ids = prompt_ids + response_ids
        mask = [0] * len(prompt_ids) + [1] * len(response_ids)
    fate = KEPT
    if len(ids) > spec.max_length:
        if spec.truncation == "error":
            raise too_long(file, i, len(ids), spec.max_length, "max_length", " (prompt + response)")
        ids, mask, fate = (
            truncate(ids, spec.max_length, spec.truncation),
            truncate(mask, spec.max_length, spec.truncation),
            TRUNCATED,
        )
    if not any(mask):
        return FILTERED, {"truncated": fate == TRUNCATED}
    reward_model = row.get("reward_model")
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    return fate, dict(
        input_ids=ids,
        loss_mask=mask,
        prompt_ids=prompt_ids,
        data_source=row.get("data_source") or "unknown",
        ground_truth=truth,
    )


def load_sft(files, tokenizer, data: "SFTDataArgs", what: str = "train_files") -> tuple[list[dict], LoadStats]:
    """SFT examples: `input_ids` and `loss_mask` (1 on assistant/response tokens only).

    A file with a `messages_key` column is read as chat conversations (loss on every assistant
    turn, tool turns masked; a `tools_key` column lists the tool schemas the template shows);
    otherwise prompt_key/response_key are read (dotted keys reach into structs, as in
    extra_info.answer) and the response is followed by the tokenizer's eos; the data group says which columns, and
    max_length and truncation. Each example also keeps `prompt_ids` (the prompt up to the last assistant turn),
    `data_source` and `ground_truth` (None without reward_model) for generation-based validation. Large data, or
    --data-workers above 1: a cached datasets map, the examples kept on disk (common.formats.prompt_cache.load_inputs).
    """
    columns = data.messages_key, data.prompt_key, data.response_key, data.tools_key
    spec, stats = SftSpec(data.max_length, *columns, data.truncation), LoadStats()
    data_workers, truncation = data.data_workers, data.truncation
    if in_process(as_files(files, what), data_workers):
        parts = [_examples_here(file, tokenizer, spec, what, stats) for file in as_files(files, what)]
    else:
        from common.formats.prompt_cache import PromptRows, load_inputs  # a feature: large data

        parts = [
            PromptRows(
                load_inputs(
                    files,
                    what,
                    data_workers,
                    lambda file: _examples_here(file, tokenizer, spec, what, stats),
                    lambda data, file: _examples_mapped(data, file, tokenizer, spec, what, data_workers, stats),
                )
            )
        ]
    if stats.no_loss_tokens:
        log.warning(
            "%s: %d example(s) had no response token left after truncation=%s and were left out",
            what,
            stats.no_loss_tokens,
            truncation,
        )
    if not stats.kept:
        raise DataError(f"{what}: no examples left ({stats.summary(what)})")
    return parts[0] if len(parts) == 1 else [e for part in parts for e in part], stats


def _examples_here(file, tokenizer, spec: SftSpec, what: str, stats: LoadStats) -> list[dict]:
    ((file, rows),) = read_rows([file], what)
    stats.per_file[file] = len(rows)
    out = []
    for fate, record in sft_records(rows, file, tokenizer, spec.for_file(file, rows[0])):
        if fate == BAD:
            raise DataError(record)
        stats.rows += 1
        stats.truncated += fate == TRUNCATED or record.get("truncated", False)
        stats.no_loss_tokens += fate == FILTERED
        if fate != FILTERED:
            stats.kept += 1
            out.append(record)
    return out


SFT_COLUMNS = ("fate", "error", "input_ids", "loss_mask", "prompt_ids", "data_source", "ground_truth", "truncated")


def _examples_mapped(data, file: str, tokenizer, spec: SftSpec, what: str, workers: int, stats: LoadStats):
    from common.formats.prompt_cache import MappedRows, cached_map, fates_of, first_row, tokenizer_identity
    from common.formats.sources import dotted

    spec = spec.for_file(file, first_row(data, file, what))
    stats.per_file[file] = len(data)
    columns = dict(
        input_ids="int32[]",
        loss_mask="int8[]",
        prompt_ids="int32[]",
        data_source="string",
        ground_truth="string",
        truncated="bool",
    )
    done = cached_map(
        data,
        file,
        _map_examples,
        dict(tokenizer=tokenizer, spec=spec, dotted=dotted(data)),
        columns,
        [repr(spec), tokenizer_identity(tokenizer)],
        workers,
    )
    fates, kept = fates_of(done)
    stats.rows += len(fates)
    stats.kept += len(kept)
    stats.no_loss_tokens += len(fates) - len(kept)
    stats.truncated += int(done.data.column("truncated").to_numpy(zero_copy_only=False).sum())
    done = done.select_columns(["input_ids", "loss_mask", "prompt_ids", "data_source", "ground_truth"])
    return MappedRows(done, None if len(kept) == len(fates) else kept, _example_of)


def _map_examples(batch: dict, indices: list[int], *, tokenizer, spec: SftSpec, dotted: bool, file: str) -> dict:
    from common.formats.sources import nested

    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    out = {k: [] for k in SFT_COLUMNS}
    for fate, record in sft_records([nested(r) for r in rows] if dotted else rows, file, tokenizer, spec, indices[0]):
        kept = {} if fate in (BAD, FILTERED) else record
        values = (
            fate,
            record if fate == BAD else None,
            kept.get("input_ids", []),
            kept.get("loss_mask", []),
            kept.get("prompt_ids", []),
            kept.get("data_source"),
            json.dumps(kept.get("ground_truth")),
            fate == TRUNCATED or (fate == FILTERED and record["truncated"]),
        )
        for column, value in zip(SFT_COLUMNS, values):
            out[column].append(value)
    return out


def _example_of(done: dict) -> dict:
    return {**done, "ground_truth": json.loads(done["ground_truth"])}


@dataclass
class SFTDataArgs(DataArgs):
    """sft.py's data: DataArgs with its columns, its sequence length and its batch (verl's SFT data section)."""

    response_key: Annotated[str, tyro.conf.arg(aliases=("--output-key",))] = RESPONSE_KEY
    """column holding the response (dotted keys reach into structs; OpenRLHF's --output-key)"""
    messages_key: str = "messages"
    """chat column; used instead of prompt/response when a file has it"""
    tools_key: str = "tools"
    """column of a chat row's tool schemas (OpenAI format, a list or JSON), shown by the chat template"""
    max_length: int = flag(128, ge=1)
    """longest prompt + response in tokens (longer rows follow --truncation)"""
    train_batch_size: int = flag(64, ge=1)
    """examples per optimizer step, over all processes"""
    micro_batch_size_per_gpu: int = flag(32, ge=1)
    """examples per forward/backward pass on one process"""
