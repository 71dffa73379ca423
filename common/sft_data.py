"""sft.py's examples: chat conversations or prompt / response rows, tokenized with a loss mask on
the assistant's tokens only. The RL recipes never load it (their prompts: common.data.load_prompts).
"""

import logging

from common.data import (
    DataError,
    LoadStats,
    as_messages,
    as_tools,
    get_field,
    has_column,
    read_rows,
    template_reads,
    too_long,
    truncate,
)

log = logging.getLogger(__name__)


def _chat_texts(tokenizer, messages: list[dict], tools) -> tuple[list[str], list[int]]:
    """The template texts an SFT conversation is cut by (the whole conversation, then for each
    assistant turn the prompt before it and the conversation up to its end) and those turns."""

    def render(upto, add_generation_prompt):
        return tokenizer.apply_chat_template(messages[:upto], tools=tools, add_generation_prompt=add_generation_prompt,
                                             tokenize=False)  # fmt: skip

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


def _sft_texts(tokenizer, row, file, i, chat, with_tools, keys) -> tuple[list[str], list[int]]:
    """The texts one SFT row is tokenized from: _chat_texts' for a conversation, or the templated
    prompt and the response (and no turns)."""
    messages_key, prompt_key, response_key, tools_key = keys
    if chat:
        value = get_field(row, messages_key, file, i, "messages_key")
        messages = as_messages(value, file, i, messages_key, template_reads(tokenizer))
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{file} row {i} column {messages_key!r}: no assistant message to train on")
        tools = as_tools(get_field(row, tools_key, file, i), file, i, tools_key) if with_tools else None
        return _chat_texts(tokenizer, messages, tools)
    value = get_field(row, prompt_key, file, i, "prompt_key")
    messages = as_messages(value, file, i, prompt_key, template_reads(tokenizer))
    response = get_field(row, response_key, file, i, "response_key")
    if not isinstance(response, str):
        raise DataError(
            f"{file} row {i} column {response_key!r}: expected a string response, "
            f"got {type(response).__name__}: {str(response)[:80]!r}"
        )
    return [tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), response], []


def load_sft(
    files,
    tokenizer,
    *,
    max_length: int,
    messages_key: str = "messages",
    prompt_key: str = "prompt",
    response_key: str = "response",
    tools_key: str = "tools",
    truncation: str = "error",
    what: str = "train_files",
) -> tuple[list[dict], LoadStats]:
    """SFT examples: `input_ids` and `loss_mask` (1 on assistant/response tokens only).

    A file with a `messages_key` column is read as chat conversations (loss on every assistant
    turn, tool turns masked; a `tools_key` column lists the tool schemas the template shows);
    otherwise prompt_key/response_key are read (dotted keys reach into structs, as in
    extra_info.answer) and the response is followed by the tokenizer's eos. Each example also keeps
    `prompt_ids` (the prompt up to the last assistant turn), `data_source` and `ground_truth`
    (None without reward_model) for generation-based validation.
    """
    stats = LoadStats()
    out = []
    eos = tokenizer.eos_token_id
    keys = (messages_key, prompt_key, response_key, tools_key)
    for file, rows in read_rows(files, what):
        stats.per_file[file] = len(rows)
        chat = has_column(rows, messages_key)
        with_tools = chat and has_column(rows, tools_key)
        if not chat and not has_column(rows, prompt_key):
            raise DataError(
                f"{file}: neither a {messages_key!r} column (chat) nor a {prompt_key!r} column "
                f"(prompt/response) found; columns are {sorted(rows[0])}; set --messages-key or "
                f"--prompt-key/--response-key"
            )
        # As in load_prompts: template every row, tokenize all the texts in one batched call (about
        # three times as fast as call by call), and raise a row that failed to template only after
        # the rows before it are checked, so the first bad row in the file is the one named.
        texts, failed = [], None
        for i, row in enumerate(rows):
            try:
                texts.append(_sft_texts(tokenizer, row, file, i, chat, with_tools, keys))
            except DataError as e:
                failed = e
                break
        flat = [t for row_texts, _ in texts for t in row_texts]
        flat = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
        at = 0
        for i, (row_texts, turns) in enumerate(texts):
            pieces, at = flat[at : at + len(row_texts)], at + len(row_texts)
            row = rows[i]
            stats.rows += 1
            if chat:
                ids, mask, prompt_ids = _assistant_spans(pieces, turns, file, i)
            else:
                prompt_ids, response_ids = pieces[0], pieces[1] + [eos]
                ids = prompt_ids + response_ids
                mask = [0] * len(prompt_ids) + [1] * len(response_ids)
            if len(ids) > max_length:
                if truncation == "error":
                    raise too_long(file, i, len(ids), max_length, "max_length", " (prompt + response)")
                ids, mask = (
                    truncate(ids, max_length, truncation),
                    truncate(mask, max_length, truncation),
                )
                stats.truncated += 1
            if not any(mask):
                stats.no_loss_tokens += 1
                continue
            reward_model = row.get("reward_model")
            out.append(
                {
                    "input_ids": ids,
                    "loss_mask": mask,
                    "prompt_ids": prompt_ids,
                    "data_source": row.get("data_source") or "unknown",
                    "ground_truth": reward_model.get("ground_truth") if isinstance(reward_model, dict) else None,
                }
            )
            stats.kept += 1
        if failed is not None:
            raise failed
    if stats.no_loss_tokens:
        log.warning(
            "%s: %d example(s) had no response token left after truncation=%s and were left out",
            what,
            stats.no_loss_tokens,
            truncation,
        )
    if not out:
        raise DataError(f"{what}: no examples left ({stats.summary(what)})")
    return out, stats
