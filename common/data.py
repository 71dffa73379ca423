"""RL prompts and SFT data from parquet (other formats: common.formats.sources), chat templating, truncation, batching.
Every error names the file, the row and the column, and says what to change."""

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
import tyro

from common.errors import DataError, UsageError
from common.flags import BUNDLED, flag
from common.parallel import all_reduce_max

TRUNCATION_MODES = ("error", "left", "right", "middle")


# --- reading -----------------------------------------------------------------------------------
# verl's image_key and video_key, and TRL's singular columns: refused, never silently dropped
MULTIMODAL_COLUMNS = ("images", "videos", "image", "video")


def read_rows(files, what: str = "train_files") -> list[tuple[str, list[dict]]]:
    """[(file, rows)] for one or many inputs; rows are plain dicts (structs become dicts). A parquet file is read
    here; JSON / JSONL, CSV, Arrow and save_to_disk folders through datasets (common.formats.sources, which names them).
    Rows with images or videos (MULTIMODAL_COLUMNS) are refused: a text-only run would drop them."""
    if isinstance(files, str | Path):
        files = [files]
    if not files:
        raise DataError(f"{what} is empty; pass at least one data file")
    out = []
    for file in files:
        path = Path(file).expanduser()
        if path.suffix != ".parquet" or not path.is_file():  # a missing file is named there too
            from common.formats.sources import read_source

            rows = read_source(str(file), what)
        else:
            import pyarrow.parquet as pq

            try:
                rows = pq.ParquetFile(path).read().to_pylist()  # read_table would import pyarrow.dataset: 0.3 s
            except Exception as e:  # pyarrow raises several types for a bad file
                raise DataError(f"{what}: {str(file)!r} is not a readable parquet file ({e})") from e
        if not rows:
            raise DataError(f"{what}: {str(file)!r} has no rows")
        for column in MULTIMODAL_COLUMNS:
            if held := sum(1 for row in rows if row.get(column)):
                raise multimodal_error(what, file, column, held, len(rows))
        out.append((str(file), rows))
    return out


def multimodal_error(what: str, file, column: str, held: int, rows: int) -> DataError:
    return DataError(
        f"{what}: {str(file)!r} column {column!r} holds {column.removesuffix('s')}s in {held} of {rows} rows; the recipes "
        f"train text-only models, so those rows would be trained without them. Drop the column (or "
        f"empty it) to use the text alone"
    )


read_parquet = read_rows  # its name before the other formats: a fork made earlier still imports it


def has_column(rows: list[dict], key: str) -> bool:
    value = rows[0]
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return True


def get_field(row: dict, key: str, file: str, index: int, flag: str | None = None):
    """row[key], where a dotted key reaches into struct columns (e.g. reward_model.ground_truth)."""
    value = row
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(value, dict) or part not in value:
            have = sorted(value) if isinstance(value, dict) else type(value).__name__
            where = ".".join(parts[:depth]) or "the file"
            hint = f"; set --{flag.replace('_', '-')} to the right column" if flag else ""
            raise DataError(f"{file} row {index}: column {key!r} not found ({where} has {have}){hint}")
        value = value[part]
    return value


# Message fields a chat template reads besides role and content (OpenAI's and verl's multi-turn
# rows); they are kept, and any other field that holds a value is refused rather than dropped.
MESSAGE_FIELDS = ("tool_calls", "tool_call_id", "name", "reasoning_content")
ROLES = ("system", "user", "assistant", "tool")


def template_reads(tokenizer) -> tuple[set[str], set[str]]:
    """What a chat template knows: the roles (OpenAI's four, and any other it names as a quoted
    string, e.g. Llama 3.1's ipython) and which of MESSAGE_FIELDS its source reads."""
    source = getattr(tokenizer, "chat_template", None)
    return _template_facts(source if isinstance(source, str) else "")


@functools.cache
def _template_facts(template: str) -> tuple[set[str], set[str]]:
    roles = set(ROLES) | set(re.findall(r"""role\W{1,12}['"](\w+)['"]""", template))
    return roles, {f for f in MESSAGE_FIELDS if f in template}


def as_messages(value, file: str, index: int, key: str, template: tuple | None = None) -> list[dict]:
    """A prompt cell as a chat list (a plain string: one user message). With `template` (template_reads),
    a role it does not know or a field it does not read is an error: the model would not see the row."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    where = f"{file} row {index} column {key!r}"
    if isinstance(value, list | tuple) and value and all(isinstance(m, dict) for m in value):
        messages = []
        for n, m in enumerate(value):
            content = m.get("content")
            if content is None and m.get("tool_calls"):
                content = ""  # OpenAI's form of an assistant turn that only calls tools
            if not (isinstance(m.get("role"), str) and isinstance(content, str)):
                break
            roles, reads = template or (None, MESSAGE_FIELDS)
            if roles is not None and m["role"] not in roles:
                hint = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}.get(m["role"])
                raise DataError(
                    f"{where}: message {n} has role {m['role']!r}, which the chat template does not know (it knows "
                    f"{', '.join(sorted(roles))}); "
                    + (f"rename it to {hint!r} (ShareGPT's names)" if hint else "rename it to one of those")
                )
            extra = sorted(k for k, v in m.items() if k not in ("role", "content", *MESSAGE_FIELDS) and v is not None)
            if extra:
                raise DataError(
                    f"{where}: message {n} has the field(s) {', '.join(map(repr, extra))}, which no chat template "
                    f"here reads (kept: role, content, {', '.join(MESSAGE_FIELDS)}); drop them from the data"
                )
            kept = {k: m[k] for k in MESSAGE_FIELDS if m.get(k) is not None}
            if unread := sorted(set(kept) - set(reads)):
                raise DataError(
                    f"{where}: message {n} has {', '.join(unread)}, which the chat template never reads, so it would "
                    f"be left out of the text; use a tokenizer whose template renders it (e.g. --tokenizer), or "
                    f"write it into the content"
                )
            messages.append({"role": m["role"], "content": content, **kept})
        else:
            return messages
    raise DataError(
        f"{where}: expected a string or a non-empty list of "
        f"{{'role': str, 'content': str}} messages, got {type(value).__name__}: {str(value)[:80]!r}"
    )


# --- templating and truncation -------------------------------------------------------------------
def render_chat(
    tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None
) -> list[int]:
    """Token ids of the chat template's text (with `tools`, the OpenAI schemas it lists)."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def truncate(ids: list, max_len: int, mode: str) -> list:
    """Shorten to max_len: left keeps the end, right keeps the start, middle keeps both ends."""
    if len(ids) <= max_len:
        return ids
    if mode == "left":
        return ids[len(ids) - max_len :]
    if mode == "right":
        return ids[:max_len]
    if mode == "middle":
        head = max_len // 2
        return ids[:head] + ids[len(ids) - (max_len - head) :]
    raise ValueError(f"truncation={mode!r}; use one of {TRUNCATION_MODES}")


# --- RL prompts (verl format) ----------------------------------------------------------------------
AGENTS = ("single_turn_agent", "tool_agent")  # a row's agent_name: the loop that samples it (common.agents.agent)


@dataclass
class LoadStats:
    rows: int = 0
    kept: int = 0
    filtered_overlong: int = 0
    truncated: int = 0
    no_loss_tokens: int = 0
    no_ground_truth: int = 0
    agent_rows: int = 0  # rows for the agent loop (common.agents.tools.check_agent_rows checks them)
    per_file: dict = field(default_factory=dict)
    columns: dict = field(default_factory=dict)  # PromptSpec.describe() -> the files read that way
    described: str | None = None  # rows that come from no file (environment seeds): what they are

    def count(self, fate: int, row: dict) -> None:
        self.rows += 1
        self.filtered_overlong += fate == FILTERED
        self.truncated += fate == TRUNCATED
        if fate != FILTERED:
            self.kept += 1
            self.no_ground_truth += row["ground_truth"] is None
            self.agent_rows += is_agent_row(row)

    def summary(self, what: str) -> str:
        if self.described:
            return f"{what}: {self.described}"
        parts = [f"{what}: {self.kept}/{self.rows} rows from {len(self.per_file)} file(s)"]
        if self.filtered_overlong:
            parts.append(f"{self.filtered_overlong} over-long rows filtered out")
        if self.truncated:
            parts.append(f"{self.truncated} truncated")
        if self.no_loss_tokens:
            parts.append(f"{self.no_loss_tokens} left out: no response token survived truncation")
        return "; ".join(parts)


def is_agent_row(row: dict) -> bool:
    """Whether a prompt row asks for the agent loop (common.agents.tools.check_agent_rows checks what it needs)."""
    extra = row["extra_info"] if isinstance(row["extra_info"], dict) else {}
    return row["agent_name"] == "tool_agent" or "tools_kwargs" in extra or "interaction_kwargs" in extra


def too_long(file, index, n, limit, limit_flag, extra=""):
    return DataError(
        f"{file} row {index}: {n} tokens > {limit_flag}={limit}{extra}; raise "
        f"--{limit_flag.replace('_', '-')}, set --truncation left/right/middle"
        + (", or --filter-overlong-prompts" if limit_flag == "max_prompt_length" else "")
    )


LABELS = ("reward_model", "solution", "answer")  # where the ground truth is found: verl's column, then TRL's two
KEPT, TRUNCATED, FILTERED, BAD = range(4)  # a prompt row's fate (prompt_records)
LARGE_ROWS = 100_000  # a file this long is templated as a cached datasets map (common.formats.prompt_cache)


@dataclass(frozen=True)
class PromptSpec:
    """What prompt_records makes of a file's rows: its columns (for_file finds verl's, TRL's or OpenRLHF's), the
    length rules, and what the reward needs of a row (ground_truth: required, optional or unused; difficulty)."""

    prompt_key: str = "prompt"
    label_key: str | None = None
    data_source: str | None = None  # for rows without a data_source column
    source_column: bool = True  # whether the file has one (for_file)
    apply_chat_template: bool = True
    max_prompt_length: int = 1024
    truncation: str = "error"
    filter_overlong_prompts: bool = False
    tools: list | None = None
    ground_truth: str = "unused"
    difficulty: bool = False

    def for_file(self, file: str, columns: list[str], first: dict, what: str) -> "PromptSpec":
        """This spec with the file's ground-truth column found; a missing column names the flag that maps it."""
        have = f"its columns: {', '.join(columns)}"
        for key, option in (self.prompt_key, "--prompt-key (OpenRLHF's --input-key)"), (self.label_key, "--label-key"):
            if key and not has_column([first], key):
                raise DataError(f"{what}: {file!r}: column {key!r} not found ({have}); name the column with {option}")
        label = self.label_key or next((c for c in LABELS if c in columns), None)
        if label is None and self.ground_truth == "required":
            raise DataError(
                f"{what}: {file!r} has no ground-truth column ({have}), which the built-in rewards score "
                f"against; name it with --label-key, or pass --reward-fn or --reward-model"
            )
        if "data_source" not in columns and not self.data_source and self.ground_truth != "unused":
            raise DataError(
                f"{what}: {file!r} has no data_source column ({have}), which picks each row's reward; "
                f"name the task with --data-source (openai/gsm8k for the built-in GSM8K reward, or a "
                f"name your --reward-fn reads)"
            )
        return dataclasses.replace(self, label_key=label, source_column="data_source" in columns)

    def describe(self) -> str:
        """The mapping said once at start: which column (or flag) gives the prompt, the ground truth, data_source."""
        form = "chat-templated" if self.apply_chat_template else "as written"
        truth = {None: "none", "reward_model": "'reward_model.ground_truth'"}.get(self.label_key, repr(self.label_key))
        fallback = f"--data-source {self.data_source!r}" if self.data_source else None
        source = " else ".join(filter(None, ["'data_source'" if self.source_column else None, fallback])) or "none"
        return f"prompt <- {self.prompt_key!r} ({form}), ground truth <- {truth}, data_source <- {source}"


def _prompt_text(tokenizer, row: dict, file: str, index: int, spec: PromptSpec) -> tuple[str, list, str]:
    """(the text to tokenize, messages, agent_name) of a prompt row; tool_agent rows list the spec's tools."""
    value = get_field(row, spec.prompt_key, file, index, "prompt_key")
    agent = row.get("agent_name") or "single_turn_agent"
    if agent not in AGENTS:
        raise DataError(
            f"{file} row {index} column 'agent_name': {agent!r} is not an agent here; use single_turn_agent "
            f"(the default) or tool_agent"
        )
    if not spec.apply_chat_template:  # TRL's standard format, OpenRLHF without --apply-chat-template
        if isinstance(value, str) and agent == "single_turn_agent":
            return value, [{"role": "user", "content": value}], agent
        raise DataError(
            f"{file} row {index} column {spec.prompt_key!r}: --no-apply-chat-template feeds a single-turn "
            f"prompt as written, and this one is {type(value).__name__} for {agent}; drop the flag"
        )
    messages = as_messages(value, file, index, spec.prompt_key, template_reads(tokenizer))
    tools = spec.tools if agent == "tool_agent" else None
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return text, messages, agent


def prompt_records(rows, file: str, tokenizer, spec: PromptSpec, start: int = 0) -> list[tuple[int, dict | str]]:
    """(fate, the prompt row; for BAD, the error's message) of each row, numbered from `start`. Every row is
    templated, then all are tokenized in one batched call (about twice as fast as row by row)."""
    texts = [caught(_prompt_text, tokenizer, row, file, i, spec) for i, row in enumerate(rows, start)]
    good = [t[0] for t in texts if not isinstance(t, str)]
    ids_of = iter(tokenizer(good, add_special_tokens=False)["input_ids"] if good else ())
    made = [
        t if isinstance(t, str) else caught(prompt_row, row, i, file, next(ids_of), t, spec)
        for i, (row, t) in enumerate(zip(rows, texts), start)
    ]
    return [(BAD, m) if isinstance(m, str) else m for m in made]


def caught(fn, *args):
    """fn(*args), or the message of the DataError it raised."""
    try:
        return fn(*args)
    except DataError as e:
        return str(e)


def prompt_row(row: dict, i: int, file: str, ids: list, text: tuple, spec: PromptSpec) -> tuple[int, dict]:
    """(fate, the prompt row) of row i from its token ids and _prompt_text's (text, messages, agent); a check the row
    fails (its length, data_source, ground truth, difficulty) raises a DataError naming it."""
    fate = KEPT
    if len(ids) > spec.max_prompt_length:
        if spec.filter_overlong_prompts:
            return FILTERED, {}
        if spec.truncation == "error":
            raise too_long(file, i, len(ids), spec.max_prompt_length, "max_prompt_length")
        ids, fate = truncate(ids, spec.max_prompt_length, spec.truncation), TRUNCATED
    source = row.get("data_source") or spec.data_source
    if spec.ground_truth != "unused" and not (isinstance(source, str) and source):
        raise DataError(
            f"{file} row {i} column 'data_source': expected the task's name, a string such as "
            f"openai/gsm8k that picks the reward function, got {source!r}"
        )
    truth, where = _ground_truth(row, i, file, spec.label_key)
    if spec.ground_truth == "required" and not isinstance(truth, str | int | float):
        raise DataError(
            f"{file} row {i}: {where} is missing or null; the built-in rewards score against it. Fill it in, or "
            f"pass --reward-fn (a function that needs none) or --reward-model"
            if truth is None
            else f"{file} row {i} column {where!r}: the built-in rewards compare against one answer, got "
            f"{type(truth).__name__}: {str(truth)[:60]!r} (as text it would never match); store one answer, or "
            f"pass --reward-fn with a function that reads this form"
        )
    extra = row.get("extra_info")
    difficulty = row.get("difficulty", (extra if isinstance(extra, dict) else {}).get("difficulty"))
    if spec.difficulty and (
        isinstance(difficulty, bool) or not isinstance(difficulty, int | float) or not math.isfinite(difficulty)
    ):
        raise DataError(
            f"{file} row {i} column 'difficulty': --difficulty-loss-weight weights each row by its "
            f"difficulty, a number in [0, 1] (as a column or in extra_info), got {difficulty!r}"
        )
    _, messages, agent = text
    return fate, dict(
        prompt_ids=ids,
        messages=messages,
        data_source=source or "unknown",
        ground_truth=truth,
        extra_info=extra,
        difficulty=difficulty,
        agent_name=agent,
        file=file,
        row=i,
    )


def _ground_truth(row: dict, i: int, file: str, label: str | None) -> tuple:
    """(the row's ground truth, the column it came from): verl's reward_model struct, or the column `label` names."""
    if label != "reward_model":
        return (None if label is None else get_field(row, label, file, i, "label_key")), label
    reward_model = row.get("reward_model") or {}
    if not isinstance(reward_model, dict):
        raise DataError(
            f"{file} row {i} column 'reward_model': expected verl's struct {{style, ground_truth}}, "
            f"got {type(reward_model).__name__}: {str(reward_model)[:80]!r}"
        )
    return reward_model.get("ground_truth"), "reward_model.ground_truth"


def template_rows(rows: list[dict], file: str, tokenizer, spec: PromptSpec, stats: "LoadStats") -> list[dict]:
    """The kept prompt rows of one file, templated in this process, counted in stats; the first bad row raises."""
    out = []
    for fate, record in prompt_records(rows, file, tokenizer, spec):
        if fate == BAD:
            raise DataError(record)
        stats.count(fate, record)
        out.append(record) if fate != FILTERED else None
    return out


def load_prompts(files, tokenizer, *, what: str = "train_files", **spec) -> tuple[list[dict], LoadStats]:
    """Prompt rows (dicts of templated `prompt_ids`, the raw `messages`, data_source, ground_truth, extra_info,
    difficulty, agent_name, file, row) of any inputs read_rows reads, with verl's, TRL's or OpenRLHF's columns
    (PromptSpec: its fields are the keyword arguments), templated in this process. common.formats.prompt_cache's load_prompts
    does the same for large data, as a cached datasets map over several processes."""
    spec, stats = PromptSpec(**spec), LoadStats()
    rows = [row for file in as_files(files, what) for row in file_prompts(file, tokenizer, spec, what, stats)]
    if not stats.kept:
        raise DataError(f"{what}: no rows left after filtering ({stats.summary(what)})")
    return rows, stats


def file_prompts(file, tokenizer, spec: PromptSpec, what: str, stats: LoadStats) -> list[dict]:
    ((file, rows),) = read_rows([file], what)
    stats.per_file[file] = len(rows)
    spec = spec.for_file(file, list(rows[0]), rows[0], what)
    stats.columns.setdefault(spec.describe(), []).append(file)
    return template_rows(rows, file, tokenizer, spec, stats)


def as_files(files, what: str) -> list:
    if not (files := [files] if isinstance(files, str | Path) else list(files or ())):
        raise DataError(f"{what} is empty; pass at least one data file")
    return files


def in_process(files, data_workers: int) -> bool:
    """Whether load_prompts serves `files` (else common.formats.prompt_cache's): one worker and small parquet files."""
    return data_workers <= 1 and all(_rows_in(Path(f).expanduser()) < LARGE_ROWS for f in files)


def _rows_in(path: Path) -> float:
    """A parquet file's row count from its footer; inf for any other input (0 for a bad file: read_rows names it)."""
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path).num_rows if path.suffix == ".parquet" and path.is_file() else math.inf
    except Exception:  # pyarrow raises several types for a bad file
        return 0


# --- order and batching ----------------------------------------------------------------------------
def batch_indices(step: int, n: int, batch_size: int, seed: int, shuffle: bool) -> tuple[int, list[int]]:
    """(epoch, example indices) of global batch `step` (0-based): a pure function of the step, so a resumed run
    reads the batches an uninterrupted one would. The n % batch_size left over in an epoch wait for a later one."""
    per_epoch = n // batch_size
    if per_epoch == 0:
        raise DataError(f"{n} examples cannot fill one batch of {batch_size}; lower the batch size")
    epoch, k = divmod(step, per_epoch)
    order = list(range(n))
    if shuffle:  # a permutation seeded by (seed, epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
    return epoch, order[k * batch_size : (k + 1) * batch_size]


def step_rows(step: int, rows: list, batch_size: int, seed: int, shuffle: bool, world_size: int) -> tuple[int, list]:
    """(epoch, [each rank's rows]) of training step `step`: batch_indices' global batch, rank r
    taking every world_size-th row from r (the order every recipe trains in)."""
    epoch, indices = batch_indices(step, len(rows), batch_size, seed, shuffle)
    return epoch, [[rows[i] for i in indices[r::world_size]] for r in range(world_size)]


def pad(seqs: list[list[int]], value: int, side: str = "right", width: int | None = None) -> torch.Tensor:
    width = width or max(len(s) for s in seqs)
    rows = [([value] * (width - len(s)) + s) if side == "left" else (s + [value] * (width - len(s))) for s in seqs]
    return torch.tensor(rows, dtype=torch.long)


def pack_sequences(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device=None) -> dict:
    """Left-padded prompts followed by right-padded responses, for a trainer forward pass:
    input_ids / attention_mask / position_ids (B, P+T), responses / response_mask (B, T), P and T the
    longest prompt and response. Positions count real tokens only, as the sampler saw them."""
    prompt_ids = pad(prompts, pad_id, side="left")
    response_ids = pad(responses, pad_id, side="right", width=max(1, max(len(r) for r in responses)))
    prompt_mask = pad([[1] * len(p) for p in prompts], 0, side="left")
    response_mask = pad([[1] * len(r) for r in responses], 0, side="right", width=response_ids.shape[1])
    attention = torch.cat([prompt_mask, response_mask], 1)
    batch = {
        "input_ids": torch.cat([prompt_ids, response_ids], 1),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
        "responses": response_ids,
        "response_mask": response_mask,
    }
    return {k: v.to(device) for k, v in batch.items()} if device is not None else batch


def take_rows(batch: dict, rows) -> dict:
    """The trainer tensors of batch[rows] (a slice or index tensor), less the columns that are padding in
    every chosen row (left of the prompts, right of the responses); positions are kept as the sampler saw them."""
    T = batch["responses"].shape[1]
    P = batch["input_ids"].shape[1] - T
    attention = batch["attention_mask"][rows]
    prompt_width = int(attention[:, :P].sum(-1).max())
    response_width = max(1, int(attention[:, P:].sum(-1).max()))
    columns = slice(P - prompt_width, P + response_width)
    out = {k: batch[k][rows][:, columns] for k in ("input_ids", "attention_mask", "position_ids")}
    out |= {k: batch[k][rows][:, :response_width] for k in ("responses", "response_mask", "kept") if k in batch}
    if "group_ids" in batch:
        out["group_ids"] = batch["group_ids"][rows]
    return out


def micro_batches(
    prompt_lengths, response_lengths, *, max_seqs: int, max_tokens: int | None = None, min_count: int = 1
) -> list[torch.Tensor]:
    """Split the rows 0..n-1 of a mini-batch into micro-batches: ascending index tensors, so the responses
    to one prompt stay adjacent (the shared-prompt forward relies on it). Without max_tokens, runs of max_seqs
    rows; with it (verl's use_dynamic_bsz), rows sorted by length are packed so a micro-batch's padded size,
    rows x (longest prompt + longest response), stays within max_tokens. The largest are then halved until
    there are at least min_count (pass the largest count of any rank: FSDP2 forwards are collective, call
    for call). Any split gives the same gradient, since the loss is normalised over the whole mini-batch."""
    n = len(prompt_lengths)
    if max_tokens is None:
        chunks = [list(range(k, min(k + max_seqs, n))) for k in range(0, n, max_seqs)]
    else:
        chunks, current, widest = [], [], (0, 0)
        for i in sorted(range(n), key=lambda i: -(prompt_lengths[i] + response_lengths[i])):  # longest first
            wide = (max(widest[0], prompt_lengths[i]), max(widest[1], response_lengths[i]))
            if current and (len(current) + 1) * sum(wide) > max_tokens:
                chunks.append(current)
                current, wide = [], (prompt_lengths[i], response_lengths[i])
            current.append(i)
            widest = wide
        chunks.append(current)
    while len(chunks) < min(min_count, n):
        chunks.sort(key=len)
        largest = chunks.pop()
        chunks += [largest[: len(largest) // 2], largest[len(largest) // 2 :]]
    return sorted((torch.tensor(sorted(c), dtype=torch.long) for c in chunks if c), key=lambda t: int(t[0]))


def split_rows(batch: dict, rows: torch.Tensor | None = None, *, max_seqs: int, max_tokens: int | None = None):
    """micro_batches over the given rows of a packed batch (all of them by default), each an ascending tensor of
    row indices, with as many micro-batches on this rank as on the rank that needs the most."""
    rows = torch.arange(batch["responses"].shape[0]) if rows is None else rows.cpu()
    T = batch["responses"].shape[1]
    prompt_lengths = batch["attention_mask"][rows, :-T].sum(-1).tolist()
    response_lengths = batch["response_mask"][rows].sum(-1).tolist()
    limits = dict(max_seqs=max_seqs, max_tokens=max_tokens)
    count = all_reduce_max(len(micro_batches(prompt_lengths, response_lengths, **limits)))
    picked = micro_batches(prompt_lengths, response_lengths, **limits, min_count=count)
    return [rows[p].sort().values for p in picked]


@dataclass
class DataArgs:
    """The data files and the columns a recipe reads (verl's data section)."""

    train_files: tuple[str, ...] = (str(BUNDLED / "addition" / "train.parquet"),)
    """training data: parquet, JSON / JSONL, CSV or Arrow files, save_to_disk folders (FOLDER@SPLIT), dataset names"""
    val_files: tuple[str, ...] = (str(BUNDLED / "addition" / "test.parquet"),)
    """validation data, in the same forms as --train-files; empty to skip validation"""
    prompt_key: Annotated[str, tyro.conf.arg(aliases=("--input-key",))] = "prompt"
    """column holding the prompt: a chat list of {role, content} or a plain string (OpenRLHF's --input-key)"""
    truncation: Literal["error", "left", "right", "middle"] = "error"
    """too-long input: error, or keep the end (left), the start (right), or both ends (middle)"""
    shuffle: bool = True
    """shuffle the training data every epoch (seeded)"""
    data_workers: int = flag(1, ge=1)
    """processes that template the data (verl's filter_overlong_prompts_workers); above 1, or for large data, as a
    datasets map cached by fingerprint: the next start on the same data and flags reads the cache"""


@dataclass
class RLDataArgs(DataArgs):
    """An RL recipe's prompts: DataArgs with TRL's and OpenRLHF's columns, the prompt length and a step's prompts."""

    label_key: str | None = None
    """column holding the ground truth (OpenRLHF's --label-key; unset: verl's reward_model, else solution or answer)"""
    data_source: str | None = None
    """data_source of rows without one (TRL's and OpenRLHF's data): the task whose built-in reward scores them"""
    apply_chat_template: bool = True
    """template prompts with the tokenizer's chat template; off: a plain-string prompt is fed as written"""
    max_prompt_length: int = flag(64, ge=1)
    """prompt tokens after the chat template (longer ones follow --truncation)"""
    filter_overlong_prompts: bool = False
    """drop (and count) prompts longer than max_prompt_length instead of truncating / failing"""
    train_batch_size: int = flag(16, ge=1)
    """prompts per step, over all processes"""
    domain_interleave_probs: tuple[str, ...] = flag((), rule=(lambda v: all("=" in p for p in v), "NAME=P pairs"))
    """draw each step's prompts by data_source with these probabilities, e.g. math=0.7 code=0.3 (ROLL's
    domain_interleave_probs; each source's rows in their own seeded order; unset: the rows' order)"""


@dataclass
class ActorArgs:
    """How the update splits a step's samples: mini-batches (one optimizer step each), micro-batches, epochs (verl's
    actor_rollout_ref.actor batch keys)."""

    ppo_mini_batch_size: int | None = flag(None, ge=1, note="or left unset: the train batch")
    """prompts per optimizer step, so train_batch_size / ppo_mini_batch_size updates per step (default: all)"""
    micro_batch_size_per_gpu: int = flag(64, ge=1)
    """most sequences per forward/backward pass on one process (the last micro-batch may be smaller)"""
    use_dynamic_bsz: bool = False
    """pack micro-batches by a token budget (--ppo-max-token-len-per-gpu) instead of a sequence count"""
    ppo_max_token_len_per_gpu: int = flag(16384, ge=1, only_with="use_dynamic_bsz")
    """with --use-dynamic-bsz: most padded tokens (rows x longest) per micro-batch on one process (verl: real ones)"""
    ppo_epochs: int = flag(1, ge=1)
    """passes over each step's samples"""
    shuffle_mini_batches: bool = False
    """each epoch, deal whole groups into the mini-batches (--ppo-mini-batch-size) in a new seeded order (verl's
    actor.shuffle); off: in the order sampled"""
    shared_prompt_forward: bool = True
    """trainer passes run each group's shared prompt once (same numbers; off: one pass per sequence)"""


@dataclass(frozen=True)
class StepPrompts:
    """The prompt rows of every training step: step_rows over `rows`, data.train_batch_size a step in a seeded order
    per epoch (data.shuffle; an environment's seeds play in order, each batch holding every tag's share). What the
    rollout samples at each step, and what remote engines request ahead of it."""

    rows: list
    data: RLDataArgs
    seed: int
    total_steps: int

    @property
    def max_length(self) -> int:
        """The most tokens a prompt may hold (--max-prompt-length)."""
        return self.data.max_prompt_length

    def step(self, step: int, world_size: int) -> tuple[int, list]:
        """(epoch, [each rank's rows]) of training step `step`."""
        if self.data.domain_interleave_probs:
            epoch, indices = self.domains.indices(step)
            return epoch, [[self.rows[i] for i in indices[r::world_size]] for r in range(world_size)]
        shuffle = self.data.shuffle and not (self.rows and self.rows[0].get("agent_name") == "env")
        return step_rows(step, self.rows, self.data.train_batch_size, self.seed, shuffle, world_size)

    @functools.cached_property
    def domains(self):
        from common.shaping.domains import DomainSampler  # a feature: loaded where its flag asks for it

        d = self.data
        return DomainSampler(self.rows, d.domain_interleave_probs, d.train_batch_size, self.seed, d.shuffle)


# --- the batch arithmetic: checked against the world size before any model loads
@dataclass(frozen=True)
class BatchPlan:
    """Derived batch sizes; `local_` means per rank."""

    world_size: int
    sequences_per_step: int
    local_sequences_per_step: int
    mini_batches_per_step: int
    local_mini_batch: int
    grad_accum: int  # micro-batches per optimizer step on one process (0: packed by a token budget, as needed)
    epochs: int = 1  # passes over a step's sequences (ppo_epochs), each in mini_batches_per_step optimizer steps
    micro: dict = field(default_factory=dict)  # split_rows' limits: max_seqs, and max_tokens with dynamic batching
    temperature: float = 1.0  # the sampling temperature: the trainer's passes divide the logits by it too
    share_prompts: bool = True  # the trainer's passes run each group's shared prompt once (model.response_logits)
    shuffle: bool = False  # mini-batches of whole groups in a new order each epoch (verl's actor.shuffle)

    def mini_batches(self, group_ids: torch.Tensor) -> list[torch.Tensor]:
        """This rank's rows of each mini-batch of an epoch: as sampled, or (shuffle, several mini-batches) whole groups
        in a new order drawn from torch's generator, which a checkpoint keeps, so a resumed run draws the same."""
        rows = torch.arange(len(group_ids))
        if self.shuffle and self.mini_batches_per_step > 1:
            groups, which = torch.unique(group_ids.cpu(), return_inverse=True)
            place = torch.randperm(len(groups)).argsort()  # each group's place in the new order
            rows = rows[torch.argsort(place[which], stable=True)]  # a group's rows stay together, in their order
        return list(rows.split(self.local_mini_batch))


def plan_batches(
    *,
    world_size: int,
    train_batch_size: int,
    micro_batch_size_per_gpu: int,
    mini_batch_size: int | None = None,
    rollout_n: int = 1,
    use_dynamic_bsz: bool = False,
    max_token_len_per_gpu: int | None = None,
    max_sequence_length: int | None = None,
    epochs: int = 1,
    temperature: float = 1.0,
    share_prompts: bool = True,
    shuffle: bool = False,
) -> BatchPlan:
    """Check that the global batch splits evenly into mini-batches and ranks, before any model loads;
    raises UsageError naming the numbers to change. train_batch_size and mini_batch_size count prompts
    (SFT: examples), each yielding rollout_n sequences. micro_batch_size_per_gpu counts sequences and is a
    cap (a memory knob), never a divisor: the last micro-batch may be smaller, the loss being normalised
    over the whole mini-batch. With dynamic batching the token budget must hold the longest sequence."""
    mini = train_batch_size if mini_batch_size is None else mini_batch_size
    names = ("train_batch_size", "micro_batch_size_per_gpu", "ppo_mini_batch_size", "rollout_n")
    for name, value in zip(names, (train_batch_size, micro_batch_size_per_gpu, mini, rollout_n), strict=True):
        if value < 1:
            raise UsageError(f"{name}={value} must be at least 1")
    if train_batch_size % mini:
        divisors = [d for d in range(1, train_batch_size + 1) if train_batch_size % d == 0]
        nearby = sorted(sorted(divisors, key=lambda d: (abs(d - mini), d))[:3])  # the three closest to mini
        raise UsageError(
            f"train_batch_size={train_batch_size} prompts is not divisible by ppo_mini_batch_size={mini}; try "
            f"ppo_mini_batch_size={' or '.join(map(str, nearby))}"
        )
    if train_batch_size % world_size:
        raise UsageError(
            f"train_batch_size={train_batch_size} cannot be split evenly over {world_size} "
            f"processes; use a multiple of {world_size}"
        )
    mini_sequences = mini * rollout_n
    if mini_sequences % world_size:
        raise UsageError(
            f"a mini-batch of {mini}x{rollout_n}={mini_sequences} sequences cannot be split evenly over "
            f"{world_size} processes; make ppo_mini_batch_size*rollout_n a multiple of {world_size}"
        )
    if use_dynamic_bsz and max_sequence_length and (max_token_len_per_gpu or 0) < max_sequence_length:
        raise UsageError(
            f"ppo_max_token_len_per_gpu={max_token_len_per_gpu} cannot hold one sequence of up to "
            f"{max_sequence_length} tokens (max_prompt_length + max_response_length); raise it to at "
            f"least {max_sequence_length}"
        )
    local_mini = mini_sequences // world_size
    sequences = train_batch_size * rollout_n
    return BatchPlan(
        world_size=world_size,
        sequences_per_step=sequences,
        local_sequences_per_step=sequences // world_size,
        mini_batches_per_step=train_batch_size // mini,
        local_mini_batch=local_mini,
        grad_accum=0 if use_dynamic_bsz else -(-local_mini // micro_batch_size_per_gpu),
        epochs=epochs,
        micro={"max_seqs": micro_batch_size_per_gpu, "max_tokens": max_token_len_per_gpu if use_dynamic_bsz else None},
        temperature=temperature,
        share_prompts=share_prompts,
        shuffle=shuffle,
    )


PROBE_CHAT = (
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "8"},
)


def template_problems(tokenizer) -> list[str]:
    """What the tokenizer's chat template gets wrong for training, one line each, on a fixed two-turn chat: a later
    turn's render that does not extend the earlier tokens (multi-turn history would differ from what was sampled, and
    SFT's masks could not be cut); an end-of-turn token (the eos the engine stops at) outside an assistant turn's
    loss mask, so the model never learns to stop (GLM's template); an assistant turn whose render after the
    generation prompt does not start with its content, so the engine samples from another point than the trainer
    trains (a template that adds an empty think block to past turns only)."""
    turns, chat = [t for t, message in enumerate(PROBE_CHAT) if message["role"] == "assistant"], list(PROBE_CHAT)
    try:  # the whole chat, then each assistant turn's prompt and the chat to its end (sft.py's cuts)
        full = render_chat(tokenizer, chat, False)
        spans = [render_chat(tokenizer, chat[: t + end], not end) for t in turns for end in (0, 1)]
    except Exception as e:  # a template that cannot render a plain chat
        return [f"it fails to render a plain two-turn chat: {type(e).__name__}: {e}"]
    if any(full[: len(part)] != part for part in spans):
        return ["a later turn's render does not extend the tokens of the turns before it (history renders differently)"]
    problems = {}
    for turn, start, end in zip(turns, spans[0::2], spans[1::2]):
        trained = full[len(start) : len(end)]
        if tokenizer.eos_token_id not in trained:
            problems["eos"] = (
                f"the end-of-turn token {tokenizer.eos_token!r} (the eos the engine stops at) falls outside the "
                f"assistant's loss mask (turn {turn}): the model would never learn to stop"
            )
        if not tokenizer.decode(trained).lstrip().startswith(PROBE_CHAT[turn]["content"]):
            problems["prompt"] = (
                f"after the generation prompt the assistant's turn {turn} renders as {tokenizer.decode(trained)!r}, "
                f"not its content first: the engine starts sampling elsewhere than the trainer trains"
            )
    return list(problems.values())
