"""Data files that are not parquet (common.formats.sources, through Hugging Face datasets): each format gives the rows the
same data gives as parquet, a recipe trains on them, and a bad input is named with what to give instead."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq
import pytest
from conftest import TASK_TRAIN, run_recipe

from common.data import read_rows
from common.errors import DataError

ROWS = 40


@pytest.fixture(scope="module")
def rows():
    """The first ROWS rows of the bundled train split, as parquet holds them (the prompt a chat list, reward_model
    a struct)."""
    return pq.read_table(TASK_TRAIN).slice(0, ROWS).to_pylist()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, rows):
    """The same rows as JSONL, a JSON array, CSV (the prompt as its text, the struct as a dotted column), an Arrow
    file, and save_to_disk folders of one split and of two."""
    import datasets

    d = tmp_path_factory.mktemp("sources")
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "rows.json").write_text(json.dumps(rows))
    flat = [
        {
            "prompt": r["prompt"][0]["content"],
            "data_source": r["data_source"],
            "reward_model.ground_truth": r["reward_model"]["ground_truth"],
        }
        for r in rows
    ]
    pa.csv.write_csv(pa.Table.from_pylist(flat), d / "rows.csv")
    with (
        pa.OSFile(str(d / "rows.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, pa.Table.from_pylist(rows).schema) as w,
    ):
        w.write_table(pa.Table.from_pylist(rows))
    data = datasets.Dataset.from_list(rows)
    data.save_to_disk(str(d / "one"))
    datasets.DatasetDict({"train": data, "test": data.select(range(8))}).save_to_disk(str(d / "two"))
    return d


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json", "rows.arrow", "one", "two@train"])
def test_each_format_gives_the_rows_parquet_gives(saved, rows, name):
    ((file, got),) = read_rows([str(saved / name)])
    assert file == str(saved / name) and got == rows


def test_a_csv_nests_its_dotted_columns_as_verls_structs(saved, rows):
    ((_, got),) = read_rows([str(saved / "rows.csv")])
    assert [r["reward_model"]["ground_truth"] for r in got] == [int(r["reward_model"]["ground_truth"]) for r in rows]
    assert [r["prompt"] for r in got] == [r["prompt"][0]["content"] for r in rows]


def test_a_folder_of_two_splits_gives_the_one_named(saved):
    ((_, test),) = read_rows([str(saved / "two@test")])
    assert len(test) == 8


@pytest.mark.parametrize(
    "name, message",
    [
        ("two", "'{d}/two' it holds the splits train, test; name one as {d}/two@train"),
        ("two@dev", "'{d}/two@dev' has no split 'dev': it holds the splits train, test"),
        ("one@test", "the folder holds one split, not 'test'; drop @test"),
        ("rows.jsonl@train", "@train picks a split of a save_to_disk folder; a file is one split"),
        ("missing.jsonl", "file '{d}/missing.jsonl' does not exist (give a parquet, JSON / JSONL"),
        ("rows.txt", "is not a data file this library reads (suffix '.txt'); give a parquet, JSON / JSONL, CSV"),
        ("bad.jsonl", "'{d}/bad.jsonl' is not a readable JSON file (line 3 is not valid JSON: Expecting"),
        ("lists.jsonl", "(line 2 is a JSON list, not an object: JSON Lines hold one row, an object, a line)"),
        ("empty.csv", "'{d}/empty.csv' is not a readable CSV file (it is empty: a CSV file needs a header line"),
        ("plain", "'{d}/plain' is a folder that datasets' save_to_disk did not write"),
    ],
)
def test_a_bad_input_is_named_with_what_to_give(saved, name, message):
    (saved / "rows.txt").write_text("x")
    (saved / "bad.jsonl").write_text('{"prompt": "1+1="}\n\n{not json\n')  # the file's line 3, past a blank one
    (saved / "lists.jsonl").write_text('{"prompt": "1+1="}\n[1, 2]\n')
    (saved / "empty.csv").write_text("")
    (saved / "plain").mkdir(exist_ok=True)
    with pytest.raises(DataError) as error:
        read_rows([str(saved / name)], "train_files")
    assert str(error.value).startswith("train_files: ") and message.format(d=saved) in str(error.value)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch, rows):
    """A dataset named someorg/addition (subset main, split train) in a temporary Hugging Face cache, laid out as a
    download leaves it (ORG___NAME/SUBSET/0.0.0/HASH/NAME-SPLIT.arrow beside dataset_info.json), with datasets and
    the Hub offline: a name resolves from the cache alone."""
    import datasets
    import huggingface_hub
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    cache = tmp_path / "hf-datasets"
    source = tmp_path / "addition.parquet"
    pq.write_table(pa.Table.from_pylist(rows), source)
    files = DataFilesDict.from_patterns({"train": [str(source)]})
    builder = Parquet(
        cache_dir=str(cache), dataset_name="someorg___addition", config_name="main", data_files=files, hash="0123abcd"
    )
    builder.download_and_prepare()
    prepared = Path(builder.cache_dir)  # .../someorg___addition/main-<data files' hash>/0.0.0/0123abcd
    (prepared / "someorg___addition-train.arrow").rename(prepared / "addition-train.arrow")
    prepared.parent.parent.rename(prepared.parent.parent.parent / "main")
    for module, names in (
        (datasets.config, ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")),
        (huggingface_hub.constants, ("HF_HUB_OFFLINE",)),
    ):
        for name in names:
            monkeypatch.setattr(module, name, True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


@pytest.mark.parametrize("spec", ["someorg/addition", "someorg/addition:main", "someorg/addition@train"])
def test_a_dataset_name_resolves_from_the_local_cache(hf_cache, rows, spec):
    ((name, got),) = read_rows([spec])
    assert name == spec and got == rows


@pytest.mark.parametrize(
    "spec, message",
    [
        ("someorg/addition@dev", "'someorg/addition@dev': Unknown split \"dev\""),
        ("other/missing", "'other/missing' is neither a file nor a dataset in the local Hugging Face cache"),
    ],
)
def test_a_name_the_cache_cannot_serve_is_named(hf_cache, spec, message):
    with pytest.raises(DataError) as error:
        read_rows([spec], "train_files")
    assert message in str(error.value)


def test_grpo_trains_on_a_mixed_list_of_formats(saved, hf_cache, tmp_path):
    """JSONL, CSV and a cached dataset's name for training, a save_to_disk split for validation: two steps, the
    rows of every input counted."""
    out = tmp_path / "run"
    done = run_recipe(
        "grpo",
        "--train-files",
        saved / "rows.jsonl",
        saved / "rows.csv",
        "someorg/addition",
        "--val-files",
        saved / "two@test",
        "--output-dir",
        out,
        "--total-training-steps",
        2,
        "--train-batch-size",
        8,
        "--rollout-n",
        2,
        "--test-freq",
        2,
        "--save-freq",
        0,
        "--logger",
    )
    assert f"train: {3 * ROWS}/{3 * ROWS} rows from 3 file(s)" in done.stdout + done.stderr
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "train/loss" in m] == [1, 2] and "val/accuracy" in metrics[-1]


def test_a_malformed_line_deep_in_a_large_jsonl_is_named_by_its_line(tmp_path):
    """datasets names the row of the chunk it was parsing ("row 8032" for line 40,000); the message names the
    file's own line."""
    lines = [json.dumps({"prompt": f"{i}+1=", "data_source": "t"}) for i in range(39_999)] + ['{"prompt": "x"']
    (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"big.jsonl' is not a readable JSON file \(line 40000 is not valid JSON"):
        read_rows([str(tmp_path / "big.jsonl")], "train_files")


def test_with_the_hub_out_of_reach_a_name_is_read_from_the_cache_at_once(hf_cache, rows, monkeypatch):
    """Without HF_HUB_OFFLINE, datasets retried an unreachable Hub for 33 s before answering. When a connection to
    the Hub's host does not open, the name is read from the cache alone at once (a cached dataset loads; a missing
    one is named, with HF_HUB_OFFLINE=1 said), and the offline flags are as they were afterwards."""
    import datasets
    import huggingface_hub

    import common.formats.sources as sources

    for module, name in ((datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE")):
        monkeypatch.setattr(module, name, False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(sources, "_hub_reachable", lambda seconds=3.0: False)
    seen, load = [], datasets.load_dataset

    def recorded(*args, **kwargs):
        seen.append((datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE))
        return load(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", recorded)
    ((_, got),) = read_rows(["someorg/addition"])
    assert got == rows and seen == [(True, True)]
    with pytest.raises(DataError, match="out of reach .*HF_HUB_OFFLINE=1 reads the cache without trying the Hub"):
        read_rows(["other/missing"], "train_files")
    assert not datasets.config.HF_HUB_OFFLINE and not huggingface_hub.constants.HF_HUB_OFFLINE
