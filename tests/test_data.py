import copy
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import TASK_TEST, TASK_TRAIN

from common.data import DataError, batch_indices, load_prompts, pack_sequences, pad, step_rows, truncate
from common.sft_data import SFTDataArgs, load_sft


def sft_data(**flags) -> SFTDataArgs:
    """sft.py's data group with these flags, reading the response from a "response" column unless told."""
    return SFTDataArgs(**{"response_key": "response", **flags})


def write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_bundled_task_is_verl_format(tokenizer):
    rows, stats = load_prompts([TASK_TEST], tokenizer, max_prompt_length=64)
    assert stats.kept == stats.rows == 500 and len(rows) == 500
    row = rows[0]
    assert row["data_source"] == "bundled/addition" and row["ground_truth"].isdigit()
    text = tokenizer.decode(row["prompt_ids"])
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    assert row["extra_info"]["split"] == "test"


def test_many_files_and_string_prompts(tmp_path, tokenizer):
    a = write(tmp_path / "a.parquet", [{"prompt": "hi", "data_source": "x"}])
    b = write(
        tmp_path / "b.parquet",
        [{"prompt": "yo", "data_source": "y"}, {"prompt": "ok", "data_source": "y"}],
    )
    rows, stats = load_prompts([a, b], tokenizer, max_prompt_length=64)
    assert [r["data_source"] for r in rows] == ["x", "y", "y"]
    assert stats.per_file == {a: 1, b: 2}
    assert rows[1]["messages"] == [{"role": "user", "content": "yo"}]
    assert rows[0]["ground_truth"] is None


def test_missing_column_names_file_row_column_and_flag(tmp_path, tokenizer):
    f = write(tmp_path / "q.parquet", [{"question": "hi"}])
    with pytest.raises(DataError) as err:
        load_prompts([f], tokenizer, max_prompt_length=64)
    msg = str(err.value)
    assert f in msg and "'prompt' not found (its columns: question)" in msg and "--prompt-key" in msg


def test_wrong_type_names_row_and_type(tmp_path, tokenizer):
    f = write(tmp_path / "t.parquet", [{"prompt": [1, 2]}, {"prompt": [3]}])
    with pytest.raises(
        DataError,
        match=r"t.parquet row 0 column 'prompt': expected a string or a non-empty list .* got list",
    ):
        load_prompts([f], tokenizer, max_prompt_length=64)


def test_empty_missing_and_broken_files(tmp_path, tokenizer):
    empty = tmp_path / "e.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty)
    with pytest.raises(DataError, match="e.parquet' has no rows"):
        load_prompts([empty], tokenizer, max_prompt_length=64)
    with pytest.raises(DataError, match="does not exist"):
        load_prompts([tmp_path / "nope.parquet"], tokenizer, max_prompt_length=64, what="val_files")
    junk = tmp_path / "j.parquet"
    junk.write_text("not parquet")
    with pytest.raises(DataError, match="not a readable parquet file"):
        load_prompts([junk], tokenizer, max_prompt_length=64)


def test_overlong_prompt_error_filter_and_truncate(tmp_path, tokenizer):
    f = write(tmp_path / "l.parquet", [{"prompt": "short"}, {"prompt": "x" * 100}])
    with pytest.raises(DataError) as err:
        load_prompts([f], tokenizer, max_prompt_length=40)
    assert (
        "row 1" in str(err.value)
        and "max_prompt_length=40" in str(err.value)
        and "--filter-overlong-prompts" in str(err.value)
    )
    rows, stats = load_prompts([f], tokenizer, max_prompt_length=40, filter_overlong_prompts=True)
    assert len(rows) == 1 and stats.filtered_overlong == 1 and "filtered" in stats.summary("train")
    rows, stats = load_prompts([f], tokenizer, max_prompt_length=40, truncation="left")
    assert len(rows[1]["prompt_ids"]) == 40 and stats.truncated == 1
    assert tokenizer.decode(rows[1]["prompt_ids"]).endswith("<|im_start|>assistant\n")


def test_truncate_modes():
    ids = list(range(10))
    assert truncate(ids, 4, "left") == [6, 7, 8, 9]
    assert truncate(ids, 4, "right") == [0, 1, 2, 3]
    assert truncate(ids, 5, "middle") == [0, 1, 7, 8, 9]
    assert truncate(ids, 20, "error") == ids


def test_sft_prompt_response_masks_response_and_eos(tokenizer):
    rows, _ = load_sft([TASK_TEST], tokenizer, sft_data(max_length=128, response_key="extra_info.answer"))
    ex = rows[0]
    masked = [t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m]
    assert tokenizer.decode(masked) == f"<answer>{ex['ground_truth']}</answer><|im_end|>"
    assert ex["input_ids"][: len(ex["prompt_ids"])] == ex["prompt_ids"]
    assert not any(ex["loss_mask"][: len(ex["prompt_ids"])])


def test_sft_messages_trains_on_every_assistant_turn_only(tmp_path, tokenizer):
    conv = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+1"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2"},
        {"role": "assistant", "content": "4"},
    ]
    f = write(tmp_path / "m.parquet", [{"messages": conv}])
    (ex,), _ = load_sft([f], tokenizer, sft_data(max_length=128))
    masked = tokenizer.decode([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m])
    assert masked == "2<|im_end|>\n4<|im_end|>\n"
    assert tokenizer.decode(ex["prompt_ids"]).endswith("2+2<|im_end|>\n<|im_start|>assistant\n")


def test_sft_tool_conversations_show_the_tools_and_train_on_assistant_turns_only(tmp_path, tokenizer):
    """The bundled tool-use set: the tools column (JSON, verl's tools_key) is listed by the chat
    template, the tool's reply is masked out, both assistant turns are trained on; and the RL
    prompt of the same question, templated with --tool-config's schemas, is the same prefix."""
    from conftest import BUNDLED

    from common.agents.tools import read_tool_config

    sft = tmp_path / "sft.parquet"  # its first rows: templating all 8,000 took 6-8 s
    pq.write_table(pq.read_table(BUNDLED / "calculator" / "sft.parquet").slice(0, 4), sft)
    (ex, *_), _ = load_sft([sft], tokenizer, sft_data(max_length=256))
    row = pq.read_table(sft).slice(0, 1).to_pylist()[0]
    a, b = row["extra_info"]["question"].split("=")[0].split("*")
    text = tokenizer.decode(ex["input_ids"])
    assert text.startswith("<|im_start|>system\n<tools>\ncalculator: ")
    masked = tokenizer.decode([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m])
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}</tool_call>'
    assert masked == f"{call}<|im_end|>\n<answer>{int(a) * int(b)}</answer><|im_end|>\n"
    schemas = read_tool_config(str(BUNDLED / "calculator" / "tools.yaml")).schemas
    rows, _ = load_prompts([sft], tokenizer, max_prompt_length=256, tools=schemas)
    assert ex["input_ids"][: len(rows[0]["prompt_ids"])] == rows[0]["prompt_ids"]
    bad = write(tmp_path / "t.parquet", [{"messages": row["messages"], "tools": "[{oops"}])
    with pytest.raises(DataError, match="row 0 column 'tools': not valid JSON"):
        load_sft([bad], tokenizer, sft_data(max_length=256))


def test_sft_errors(tmp_path, tokenizer):
    f = write(tmp_path / "n.parquet", [{"text": "a"}])
    with pytest.raises(DataError, match="neither a 'messages' column .* nor a 'prompt' column"):
        load_sft([f], tokenizer, sft_data(max_length=64))
    g = write(tmp_path / "r.parquet", [{"prompt": "a", "response": 5}])
    with pytest.raises(DataError, match="row 0 column 'response': expected a string response, got int"):
        load_sft([g], tokenizer, sft_data(max_length=64))
    h = write(tmp_path / "h.parquet", [{"prompt": "a", "response": "b" * 200}])
    with pytest.raises(DataError, match=r"row 0: \d+ tokens > max_length=64"):
        load_sft([h], tokenizer, sft_data(max_length=64))
    rows, stats = load_sft([h], tokenizer, sft_data(max_length=64, truncation="right"))
    assert len(rows[0]["input_ids"]) == 64 and stats.truncated == 1


def test_sft_rows_without_loss_tokens_are_counted(tmp_path, tokenizer):
    f = write(
        tmp_path / "c.parquet",
        [{"prompt": "a" * 60, "response": "b"}, {"prompt": "a", "response": "b"}],
    )
    rows, stats = load_sft([f], tokenizer, sft_data(max_length=40, truncation="right"))
    assert len(rows) == 1 and stats.no_loss_tokens == 1 and "1 left out" in stats.summary("train")


def test_batch_order_is_a_function_of_the_step():
    n, bs = 10, 3
    seen = [batch_indices(s, n, bs, seed=0, shuffle=True) for s in range(6)]
    assert [e for e, _ in seen] == [0, 0, 0, 1, 1, 1]
    epoch0 = [i for _, b in seen[:3] for i in b]
    assert len(set(epoch0)) == 9
    assert seen[0][1] != seen[3][1]
    assert batch_indices(4, n, bs, seed=0, shuffle=True) == seen[4]
    assert batch_indices(0, n, bs, seed=0, shuffle=False) == (0, [0, 1, 2])
    with pytest.raises(DataError, match="cannot fill one batch"):
        batch_indices(0, 2, 3, seed=0, shuffle=True)


def test_pad_sides():
    assert pad([[1, 2], [3]], 0).tolist() == [[1, 2], [3, 0]]
    assert pad([[1, 2], [3]], 0, side="left").tolist() == [[1, 2], [0, 3]]


def test_train_split_disjoint_from_test(tokenizer):
    train, _ = load_prompts([TASK_TRAIN], tokenizer, max_prompt_length=64)
    test, _ = load_prompts([TASK_TEST], tokenizer, max_prompt_length=64)
    assert not {r["messages"][0]["content"] for r in train} & {r["messages"][0]["content"] for r in test}


def test_micro_batches_cap_and_token_budget():
    from common.data import micro_batches

    prompts, responses = [4, 4, 4, 6, 6, 6, 2], [3, 9, 1, 2, 8, 5, 1]
    fixed = micro_batches(prompts, responses, max_seqs=3)
    assert [t.tolist() for t in fixed] == [[0, 1, 2], [3, 4, 5], [6]]  # the last one smaller
    packed = micro_batches(prompts, responses, max_seqs=3, max_tokens=30)
    assert sorted(i for t in packed for i in t.tolist()) == list(range(7))  # every row exactly once
    for t in packed:
        rows = t.tolist()
        assert rows == sorted(rows)  # ascending: a prompt's responses stay adjacent
        width = max(prompts[i] for i in rows) + max(responses[i] for i in rows)
        assert len(rows) * width <= 30
    # every rank makes as many micro-batches as the rank that needs the most (FSDP2 forwards are collective)
    assert len(micro_batches(prompts, responses, max_seqs=3, max_tokens=1000)) == 1
    more = micro_batches(prompts, responses, max_seqs=3, max_tokens=1000, min_count=4)
    assert len(more) == 4 and sorted(i for t in more for i in t.tolist()) == list(range(7))


def test_take_rows_trims_shared_padding_and_keeps_positions():
    from common.data import take_rows

    batch = pack_sequences([[1, 2, 3, 4], [5], [6, 7]], [[8], [9, 10, 11], [12, 13]], pad_id=0)
    batch["group_ids"] = torch.tensor([0, 1, 2])
    mb = take_rows(batch, torch.tensor([1, 2]))
    # longest prompt there is 2, longest response 3: columns that are padding in both rows are gone
    assert mb["input_ids"].tolist() == [[0, 5, 9, 10, 11], [6, 7, 12, 13, 0]]
    assert mb["position_ids"].tolist() == [[0, 0, 1, 2, 3], [0, 1, 2, 3, 3]]
    assert mb["responses"].tolist() == [[9, 10, 11], [12, 13, 0]] and mb["group_ids"].tolist() == [1, 2]


def test_step_rows_shards_the_global_batch_by_rank():
    """Rank r takes every world_size-th row of batch_indices' global batch, from r: together the
    ranks hold the batch exactly once, and the epoch is batch_indices'."""
    rows = [{"i": i} for i in range(50)]
    for step in (0, 7, 12):
        epoch, indices = batch_indices(step, 50, 8, seed=3, shuffle=True)
        got_epoch, ranks = step_rows(step, rows, 8, 3, True, world_size=2)
        assert got_epoch == epoch and len(ranks) == 2
        assert [r["i"] for r in ranks[0]] == indices[0::2] and [r["i"] for r in ranks[1]] == indices[1::2]
    assert step_rows(0, rows, 8, 3, True, world_size=1)[1][0] == [rows[i] for i in batch_indices(0, 50, 8, 3, True)[1]]


def test_messages_keep_tool_calls_and_refuse_what_a_template_would_drop(tmp_path, tokenizer):
    """A message's tool_calls / tool_call_id / name reach a chat template that renders them (an
    assistant turn that only calls a tool has content None in OpenAI's form); a role the template
    does not know, a field it never reads (the bundled template has no tool_calls) or a field no
    template reads is an error naming the row, not a message silently left out or reduced."""
    call = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    chat = [
        {"role": "user", "content": "1+2?", "tool_calls": None},
        {"role": "assistant", "content": None, "tool_calls": call},
        {"role": "tool", "content": "3", "tool_calls": None},
    ]
    f = write(tmp_path / "c.parquet", [{"prompt": chat}])
    with pytest.raises(
        DataError, match="row 0 column 'prompt': message 1 has tool_calls, which the chat template never"
    ):
        load_prompts([f], tokenizer, max_prompt_length=200)
    renders = copy.deepcopy(tokenizer)
    renders.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
        "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    rows, _ = load_prompts([f], renders, max_prompt_length=200)
    assert rows[0]["messages"][1] == {"role": "assistant", "content": "", "tool_calls": call}
    assert "tool_calls" not in rows[0]["messages"][0]  # parquet's null for the rows without
    assert '"name": "add"' in renders.decode(rows[0]["prompt_ids"])
    for bad, words in (
        ({"role": "bot"}, "message 0 has role 'bot', which the chat template does not know"),
        ({"weight": 0.5}, "message 0 has the field(s) 'weight', which no chat template here reads"),
    ):
        f = write(tmp_path / "bad.parquet", [{"prompt": [{"role": "user", "content": "hi", **bad}]}])
        with pytest.raises(DataError, match=re.escape(f"bad.parquet row 0 column 'prompt': {words}")):
            load_prompts([f], tokenizer, max_prompt_length=64)


def domain_rows() -> list[dict]:
    """60 rows of "math", 30 of "code" and 10 of "chat", interleaved in the file."""
    sources = ["math"] * 60 + ["code"] * 30 + ["chat"] * 10
    return [{"data_source": s, "i": i} for i, s in enumerate(sorted(sources, key=lambda s: hash(s) % 7))]


def test_domain_interleave_probs_draw_each_step_by_data_source_and_resume_exactly():
    """--domain-interleave-probs (ROLL's domain_interleave_probs): over 200 steps of 16 the domains' shares come out
    at the probabilities (chat's 10 rows drawn at 0.5 repeat, each pass over them a new order, while none of math's
    60 at 0.2 comes twice in the first 10 steps); a sampler made at step 150, as a resumed run makes it, draws what the run drew, and
    the ranks share a step's rows as without the flag."""
    from common.data import RLDataArgs, StepPrompts

    rows = domain_rows()
    data = RLDataArgs(train_batch_size=16, domain_interleave_probs=("math=0.2", "code=0.3", "chat=0.5"))
    prompts = StepPrompts(rows, data, seed=3, total_steps=200)
    steps = [prompts.step(s, 1)[1][0] for s in range(200)]
    drawn = [row["data_source"] for step in steps for row in step]
    for name, p in (("math", 0.2), ("code", 0.3), ("chat", 0.5)):
        assert abs(drawn.count(name) / len(drawn) - p) < 0.02, (name, drawn.count(name))
    chat = [row["i"] for step in steps for row in step if row["data_source"] == "chat"]
    passes = [chat[k : k + 10] for k in range(0, 50, 10)]
    assert all(sorted(p) == sorted(passes[0]) for p in passes) and len({tuple(p) for p in passes}) == 5
    math = [row["i"] for step in steps[:10] for row in step if row["data_source"] == "math"]
    assert len(set(math)) == len(math)  # about 32 math draws in 10 steps, of 60 rows: none twice
    resumed = StepPrompts(rows, data, seed=3, total_steps=200)
    assert [resumed.step(s, 1)[1][0] for s in (150, 151, 199)] == [steps[150], steps[151], steps[199]]
    epoch, ranks = resumed.step(7, 2)
    assert ranks[0] + ranks[1] != [] and sorted(ranks[0] + ranks[1], key=str) == sorted(steps[7], key=str)
    assert epoch == 7 * 16 // len(rows)


@pytest.mark.parametrize(
    "pairs, said",
    [
        (("math=0.5", "code=0.5"), "data_source 'chat' of the training rows has no probability; add chat=P"),
        (("math=0.5", "code=0.3", "chat=0.1", "poetry=0.1"), "no training row has data_source 'poetry'"),
        (("math=0.5", "code=0.3", "chat=0.1"), "the probabilities sum to 0.9, not 1"),
        (("math=half", "code=0.5", "chat=0"), "'half' is not a number"),
        (("math=0.5", "math=0.5", "chat=0"), "named twice"),
    ],
)
def test_domain_interleave_probs_that_leave_rows_out_or_do_not_add_up_are_refused(pairs, said):
    from common.errors import UsageError
    from common.shaping.domains import check_domains

    with pytest.raises(UsageError, match=re.escape(said)):
        check_domains(pairs, domain_rows())
    check_domains(("math=0.5", "code=0.5", "chat=0"), domain_rows())  # 0: the rows are there, never drawn
