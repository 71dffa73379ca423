"""The conventions users bring (TRL's and OpenRLHF's columns, mapped by flags with their names) and large data
(common.formats.prompt_cache): the cached map over several processes gives the rows the in-process path gives, a second
start reads the cache instead of templating, and a bad row is named as the in-process path names it."""

import json
import logging
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import TASK_TRAIN, run_recipe

import common.formats.prompt_cache as prompt_cache
from common.data import DataError, load_prompts

ROWS = 300


@pytest.fixture(scope="module")
def verl_rows():
    return pq.read_table(TASK_TRAIN).slice(0, ROWS).to_pylist()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A temporary datasets cache: what one test maps, no other test reads."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    return tmp_path / "hf-datasets"


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def trl(rows):
    """TRL's columns: the prompt as text, the answer in solution, no data_source."""
    return [{"prompt": r["prompt"][0]["content"], "solution": r["reward_model"]["ground_truth"]} for r in rows]


def test_trls_columns_give_the_rows_verls_give(tmp_path, tokenizer, verl_rows):
    verl = write_parquet(tmp_path / "verl.parquet", verl_rows)
    mine, stats = load_prompts([verl], tokenizer, max_prompt_length=64, ground_truth="required")
    theirs, trl_stats = load_prompts(
        [jsonl(tmp_path / "trl.jsonl", trl(verl_rows))],
        tokenizer,
        max_prompt_length=64,
        ground_truth="required",
        data_source="bundled/addition",
    )
    keys = ("prompt_ids", "messages", "data_source", "ground_truth")
    assert [{k: r[k] for k in keys} for r in theirs] == [{k: r[k] for k in keys} for r in mine]
    (said,) = trl_stats.columns
    assert (
        said == "prompt <- 'prompt' (chat-templated), ground truth <- 'solution', data_source <- --data-source "
        "'bundled/addition'"
    )
    (said,) = stats.columns
    assert (
        said == "prompt <- 'prompt' (chat-templated), ground truth <- 'reward_model.ground_truth', data_source <- "
        "'data_source'"
    )


def test_openrlhfs_keys_and_a_prompt_fed_as_written(tmp_path, tokenizer):
    f = jsonl(tmp_path / "o.jsonl", [{"input": "2+2=", "label": "4"}, {"input": "3+3=", "label": "6"}])
    rows, _ = load_prompts(
        [f],
        tokenizer,
        prompt_key="input",
        label_key="label",
        data_source="bundled/addition",
        apply_chat_template=False,
        ground_truth="required",
        max_prompt_length=64,
    )
    assert [r["ground_truth"] for r in rows] == ["4", "6"]
    assert rows[0]["prompt_ids"] == tokenizer("2+2=", add_special_tokens=False)["input_ids"]
    templated, _ = load_prompts([f], tokenizer, prompt_key="input", max_prompt_length=64)
    assert templated[0]["prompt_ids"] != rows[0]["prompt_ids"]
    assert tokenizer.decode(templated[0]["prompt_ids"]).startswith("<|im_start|>user\n2+2=")


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            dict(prompt_key="input", label_key="label"),
            "o.jsonl' has no data_source column (its columns: input, label), which picks each row's reward; "
            "name the task with --data-source",
        ),
        (
            dict(data_source="x"),
            "column 'prompt' not found (its columns: input, label); name the column "
            "with --prompt-key (OpenRLHF's --input-key)",
        ),
        (
            dict(data_source="x", prompt_key="input", label_key="answer"),
            "column 'answer' not found (its columns: input, label); name the column with --label-key",
        ),
        (
            dict(data_source="x", prompt_key="input", label_key=None),
            "has no ground-truth column (its columns: input, "
            "label), which the built-in rewards score "
            "against; name it with --label-key",
        ),
    ],
)
def test_a_missing_column_names_the_file_its_columns_and_the_flag(tmp_path, tokenizer, flags, message):
    f = jsonl(tmp_path / "o.jsonl", [{"input": "2+2=", "label": "4"}])
    with pytest.raises(DataError) as error:
        load_prompts([f], tokenizer, max_prompt_length=64, ground_truth="required", **flags)
    assert message in str(error.value)


def test_a_chat_list_is_refused_as_written(tmp_path, tokenizer, verl_rows):
    f = write_parquet(tmp_path / "chat.parquet", verl_rows[:3])
    with pytest.raises(DataError, match=r"row 0 column 'prompt': --no-apply-chat-template feeds a single-turn prompt"):
        load_prompts([f], tokenizer, max_prompt_length=64, apply_chat_template=False)


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_the_cached_map_gives_the_in_process_rows_and_is_read_back(tmp_path, tokenizer, cache, monkeypatch, caplog):
    """Two workers over the bundled train split: every row equal to the in-process path's, counts equal; a second
    load does not template (prompt_records fails if called) and gives the same rows; a changed flag templates again."""
    limits = dict(max_prompt_length=22, truncation="left", ground_truth="required")
    here, here_stats = load_prompts([TASK_TRAIN], tokenizer, **limits)
    caplog.set_level(logging.INFO, "common.formats.prompt_cache")
    mapped, stats = prompt_cache.load_prompts([TASK_TRAIN], tokenizer, data_workers=2, **limits)
    assert "templating 7600 rows in 2 process(es), cached in" in caplog.text
    assert here_stats.truncated > 0 and (stats.rows, stats.kept, stats.truncated) == (
        here_stats.rows,
        here_stats.kept,
        here_stats.truncated,
    )
    assert len(mapped) == len(here) and list(mapped) == here
    assert mapped.column("data_source") == [r["data_source"] for r in here]

    def templating(*args, **kwargs):
        raise AssertionError("templated again")

    monkeypatch.setattr(prompt_cache, "prompt_records", templating)
    again, _ = prompt_cache.load_prompts([TASK_TRAIN], tokenizer, data_workers=2, **limits)
    assert "7600 rows, templated before: read from the cache" in caplog.text
    assert [again[i] for i in (0, 1234, -1)] == [here[i] for i in (0, 1234, -1)]
    with pytest.raises(AssertionError, match="templated again"):
        prompt_cache.load_prompts([TASK_TRAIN], tokenizer, data_workers=2, **dict(limits, max_prompt_length=23))


def test_the_map_names_the_first_bad_row_and_filters_as_in_process(tmp_path, tokenizer, cache, verl_rows):
    rows = [dict(r) for r in verl_rows]
    for i in (250, 120):  # one in each worker's half: the first in the file is named
        rows[i]["prompt"] = [{"role": "human", "content": "hi"}]
    f = write_parquet(tmp_path / "bad.parquet", rows)
    for load in (load_prompts, prompt_cache.load_prompts):
        with pytest.raises(DataError, match=r"bad.parquet row 120 column 'prompt': message 0 has role 'human'"):
            load([f], tokenizer, max_prompt_length=64, **({"data_workers": 2} if load != load_prompts else {}))
    rows = [
        dict(r, prompt=[{"role": "user", "content": "Think. " + r["prompt"][0]["content"]}]) if i % 3 else r
        for i, r in enumerate(verl_rows)
    ]
    f = write_parquet(tmp_path / "good.parquet", rows)
    here, here_stats = load_prompts([f], tokenizer, max_prompt_length=40, filter_overlong_prompts=True)
    mapped, stats = prompt_cache.load_prompts(
        [f], tokenizer, max_prompt_length=40, filter_overlong_prompts=True, data_workers=2
    )
    assert 0 < stats.filtered_overlong == here_stats.filtered_overlong and list(mapped) == here


def test_prompt_rows_read_as_a_list(tmp_path, tokenizer, cache, verl_rows):
    f = write_parquet(tmp_path / "a.parquet", verl_rows[:5])
    mapped, _ = prompt_cache.load_prompts([f, f], tokenizer, max_prompt_length=64, data_workers=2)
    here, _ = load_prompts([f, f], tokenizer, max_prompt_length=64)
    assert len(mapped) == 10 and mapped[-1] == here[-1] and mapped[3:7] == here[3:7]
    joined = here[:2] + mapped + here[:1]
    assert len(joined) == 13 and joined[2] == here[0] and joined[-1] == here[0]
    with pytest.raises(IndexError):
        mapped[10]


def test_grpo_trains_two_steps_on_trls_columns(tmp_path, cache, verl_rows):
    """python recipes/grpo.py --train-files data.jsonl with TRL's columns (through the cached map: --data-workers 2)
    trains two steps, and says how it read the columns."""
    data = jsonl(tmp_path / "data.jsonl", trl(verl_rows))
    out = tmp_path / "run"
    done = run_recipe(
        "grpo",
        "--train-files",
        data,
        "--val-files",
        "--data-source",
        "bundled/addition",
        "--data-workers",
        2,
        "--output-dir",
        out,
        "--total-training-steps",
        2,
        "--train-batch-size",
        8,
        "--rollout-n",
        2,
        "--save-freq",
        0,
        "--logger",
        env={"HF_DATASETS_CACHE": str(cache)},
    )
    said = done.stdout + done.stderr
    assert f"train: {ROWS}/{ROWS} rows from 1 file(s)" in said
    assert "columns of data.jsonl: prompt <- 'prompt' (chat-templated), ground truth <- 'solution'" in said
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "train/loss" in m] == [1, 2]


def test_grpo_takes_openrlhfs_flags(tmp_path, cache):
    data = jsonl(
        tmp_path / "o.jsonl",
        [{"input": f"{a}+{a}=? Answer in <answer></answer>.", "label": str(2 * a)} for a in range(16)],
    )
    out = tmp_path / "run"
    done = run_recipe(
        "grpo",
        "--train-files",
        data,
        "--val-files",
        "--input-key",
        "input",
        "--label-key",
        "label",
        "--apply-chat-template",
        "--data-source",
        "bundled/addition",
        "--output-dir",
        out,
        "--total-training-steps",
        1,
        "--train-batch-size",
        8,
        "--rollout-n",
        2,
        "--save-freq",
        0,
        "--logger",
        env={"HF_DATASETS_CACHE": str(cache)},
    )
    assert (
        "columns of o.jsonl: prompt <- 'input' (chat-templated), ground truth <- 'label'" in done.stdout + done.stderr
    )


def test_a_long_file_is_mapped_with_one_worker(tmp_path, tokenizer, cache, verl_rows, monkeypatch):
    """A parquet file of LARGE_ROWS rows or more goes to the map (in one process), not read whole; the rows agree."""
    from conftest import make_args

    import common.data
    from common.config import RLArgs
    from common.rollout import load_rl_data

    def rl_data(**flags):
        a = make_args(RLArgs, train_files=(f,), val_files=(), train_batch_size=8, max_prompt_length=64, **flags)
        return load_rl_data(a.data, tokenizer, a.reward, a.agent, a.env, a.conditioning)

    f = write_parquet(tmp_path / "long.parquet", verl_rows)
    here, _ = load_prompts([f], tokenizer, max_prompt_length=64)
    monkeypatch.setattr(common.data, "LARGE_ROWS", ROWS)
    monkeypatch.setattr(prompt_cache, "LARGE_ROWS", ROWS)
    train, stats, val = rl_data(data_workers=1)
    assert isinstance(train.parts[0], prompt_cache.MappedRows) and list(train) == here and stats.kept == ROWS
    monkeypatch.setattr(common.data, "LARGE_ROWS", ROWS + 1)
    assert isinstance(rl_data()[0], list)


def test_validation_rows_filtered_as_over_long_are_said(tmp_path, tokenizer, verl_rows, caplog):
    """--filter-overlong-prompts drops validation rows too: a warning says how many, as the header does for training."""
    from conftest import make_args

    from common.config import RLArgs
    from common.rollout import load_rl_data

    longer = [  # every other prompt a few tokens longer
        dict(r, prompt=[{**m, "content": m["content"] + " Show the sum." * (i % 2)} for m in r["prompt"]])
        for i, r in enumerate(verl_rows)
    ]
    f = write_parquet(tmp_path / "a.parquet", longer)
    longest = max(len(r["prompt_ids"]) for r in load_prompts([f], tokenizer, max_prompt_length=4096)[0])

    def rl_data(max_prompt_length):
        flags = dict(train_files=(f,), val_files=(f,), train_batch_size=1, filter_overlong_prompts=True)
        a = make_args(RLArgs, max_prompt_length=max_prompt_length, **flags)
        return load_rl_data(a.data, tokenizer, a.reward, a.agent, a.env, a.conditioning)

    with caplog.at_level("WARNING", logger="common.rollout"):
        _, stats, val = rl_data(longest - 1)
    dropped = stats.filtered_overlong
    assert dropped == len(longer) // 2 and len(val) == stats.kept
    said = [r.message for r in caplog.records if "val_files" in r.message]
    assert said and f"{dropped} over-long rows filtered out" in said[0] and "validation scores the rows kept" in said[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="common.rollout"):
        rl_data(longest)
    assert not [r for r in caplog.records if "val_files" in r.message], "nothing filtered, nothing said"


def test_under_a_launcher_the_nodes_first_process_maps_and_the_others_read_its_cache(
    tmp_path, tokenizer, cache, verl_rows, monkeypatch
):
    """LOCAL_RANK 0 maps, then meets the others at a barrier; any other process meets it first, then reads the cache
    (templating there fails this test). A small file with one worker needs no barrier: every process reads it.
    LOCAL_RANK is set by hand, not by monkeypatch: a map over processes replaces os.environ with a copy of itself
    (datasets' Dataset.map), so monkeypatch would restore the old object and leave the variable set for later tests."""
    f = write_parquet(tmp_path / "a.parquet", verl_rows)
    met = []
    monkeypatch.setattr(prompt_cache, "barrier", lambda: met.append(len(list(cache.glob("recipes_prompts/*.arrow")))))

    def templating(*args, **kwargs):
        raise AssertionError("templated again")

    try:
        os.environ["LOCAL_RANK"] = "0"
        first, _ = prompt_cache.load_prompts([f], tokenizer, max_prompt_length=64, data_workers=2)
        assert met == [2]  # after the map was written, one file per worker
        monkeypatch.setattr(prompt_cache, "prompt_records", templating)
        os.environ["LOCAL_RANK"] = "1"
        other, _ = prompt_cache.load_prompts([f], tokenizer, max_prompt_length=64, data_workers=2)
        assert met == [2, 2] and list(other) == list(first)  # it met the first before reading
        prompt_cache.load_prompts([f], tokenizer, max_prompt_length=64, data_workers=1)  # in process, through data's
        assert met == [2, 2]
    finally:
        os.environ.pop("LOCAL_RANK", None)


def test_sft_examples_through_the_map_equal_the_in_process_ones(tmp_path, tokenizer, cache, verl_rows, monkeypatch):
    """sft.py's examples, prompt / response rows and conversations, through the map (two workers): the same examples
    and counts as in process (rows truncated, rows that lost every response token); read back from the cache."""
    import common.sft_data as sft_data

    rows = [
        dict(r, prompt=[{"role": "user", "content": r["prompt"][0]["content"][:8]}]) if i % 2 else r
        for i, r in enumerate(verl_rows)
    ]
    chats = [{"messages": [*r["prompt"], {"role": "assistant", "content": r["extra_info"]["answer"]}]} for r in rows]
    for name, data in (("pairs", rows), ("chats", chats)):
        f = write_parquet(tmp_path / f"{name}.parquet", data)
        kw = dict(max_length=40, response_key="extra_info.answer", truncation="right")
        here, here_stats = sft_data.load_sft([f], tokenizer, sft_data.SFTDataArgs(**kw))
        mapped, stats = sft_data.load_sft([f], tokenizer, sft_data.SFTDataArgs(**kw, data_workers=2))
        counts = [(s.rows, s.kept, s.truncated, s.no_loss_tokens) for s in (stats, here_stats)]
        assert counts[0] == counts[1] and 0 < stats.no_loss_tokens < stats.rows and stats.truncated > 0, counts
        assert list(mapped) == here and mapped[-1]["ground_truth"] == here[-1]["ground_truth"]
    monkeypatch.setattr(sft_data, "sft_records", lambda *a, **k: (_ for _ in ()).throw(AssertionError("again")))
    again, _ = sft_data.load_sft([f], tokenizer, sft_data.SFTDataArgs(**kw, data_workers=2))
    assert list(again) == here


def test_the_map_refuses_images_and_reads_an_empty_images_column(tmp_path, tokenizer, cache, verl_rows):
    rows = [dict(r, images=[]) for r in verl_rows[:6]]
    f = write_parquet(tmp_path / "empty.parquet", rows)
    mapped, _ = prompt_cache.load_prompts([f], tokenizer, max_prompt_length=64, data_workers=2)
    assert len(mapped) == 6
    rows[3]["images"] = ["a.png"]
    f = write_parquet(tmp_path / "held.parquet", rows)
    with pytest.raises(DataError, match=r"column 'images' holds images in 1 of 6 rows"):
        prompt_cache.load_prompts([f], tokenizer, max_prompt_length=64, data_workers=2)
