"""recipes/generate.py and recipes/evaluate.py: pass@k and maj@k against brute force, greedy
accuracy equal to training's validation, 1 process = 2 processes, resume after a kill, and bad
input refused before any model loads."""

import itertools
import json
import math
import re

import pyarrow.parquet as pq
import pytest
from conftest import (
    BUNDLED,
    SHIPPED_ACCURACY,
    TASK_TEST,
    load_recipe,
    load_recipe_refusing_models,
    run_recipe,
    torchrun_plan,
)

from common.errors import UsageError

SFT = str(BUNDLED / "tiny-qwen2-sft")


@pytest.fixture(scope="module")
def gen():
    return load_recipe("generate")


@pytest.fixture(scope="module")
def ev():
    return load_recipe("evaluate")


# --- the estimators -------------------------------------------------------------------------------------
def test_pass_at_k_equals_brute_force_over_every_subset(ev):
    """The probability that a random k of the n responses holds a correct one, counted subset by subset."""
    for n in range(1, 7):
        for c in range(n + 1):
            correct = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(correct, k))
                want = sum(any(s) for s in subsets) / len(subsets)
                assert ev.pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)
    # large n: no overflow, and the closed form 1 - C(n-c, k) / C(n, k)
    assert ev.pass_at_k(1000, 3, 100) == pytest.approx(1 - math.comb(997, 100) / math.comb(1000, 100))


def test_maj_at_k_votes_among_the_first_k_answers(ev):
    answers, correct = ["7", "5", "5", None, "7"], [True, False, False, False, True]
    assert ev.maj_at_k(answers, correct, 1) is True  # "7"
    assert ev.maj_at_k(answers, correct, 2) is True  # a tie: "7" was seen first
    assert ev.maj_at_k(answers, correct, 3) is False  # "5" twice
    assert ev.maj_at_k(answers, correct, 4) is False  # the missing answer does not vote
    assert ev.maj_at_k(answers, correct, 5) is True  # "7" and "5" tie at 2: "7" was seen first
    assert ev.maj_at_k([None, None], [True, True], 2) is False  # no answer to vote on


# --- generate, then evaluate ------------------------------------------------------------------------------
def test_greedy_pass_at_1_equals_the_training_validation(tmp_path, gen, ev):
    """generate --temperature 0 then evaluate on the bundled test split gives exactly the accuracy
    the RL recipes' validation (--val-temperature 0: common.rollout.evaluate, same engine, same batch
    of 256) reports; --no-do-sample is the same greedy decoding."""
    from common.data import load_prompts
    from common.engines import HFEngine, Sampling
    from common.model import load_policy, load_tokenizer
    from common.parallel import Dist
    from common.rewards import reward_pool
    from common.rollout import evaluate

    out = tmp_path / "greedy.parquet"
    gen.main(gen.Args(output_path=str(out), temperature=0.0, batch_size=256))
    results = ev.main(ev.Args(data_path=str(out)))
    written = json.loads(out.with_name("greedy.eval.json").read_text())
    assert written == results and set(written) == {"all", "bundled/addition"}
    assert results["all"]["prompts"] == 500 and results["all"]["responses"] == 500

    tokenizer = load_tokenizer(SFT)
    rows, _ = load_prompts([TASK_TEST], tokenizer, max_prompt_length=64)
    dist = Dist(rank=0, world_size=1, local_rank=0, device="cpu")
    engine = HFEngine.for_policy(load_policy(SFT), tokenizer, dist, batch_size=256)
    pool = reward_pool(None, 2, 10.0)
    pool.dry_run(rows)
    validation = evaluate(engine, pool, tokenizer, rows, Sampling(n=1, temperature=0, max_tokens=16), dist)
    pool.close()
    assert results["all"]["pass@1"] == validation["val/accuracy"] == SHIPPED_ACCURACY
    assert results["bundled/addition"]["maj@1"] == results["all"]["pass@1"]  # one answer each: the vote is it
    assert results["all"]["mean_score"] == validation["val/reward/mean"]
    pq.write_table(pq.read_table(TASK_TEST).slice(0, 24), tmp_path / "first.parquet")
    greedy = {}
    for name, flags in (("zero", dict(temperature=0.0)), ("off", dict(do_sample=False))):
        gen.main(
            gen.Args(data_path=str(tmp_path / "first.parquet"), output_path=str(tmp_path / f"{name}.parquet"), **flags)
        )
        greedy[name] = pq.read_table(tmp_path / f"{name}.parquet").column("responses").to_pylist()
    assert greedy["zero"] == greedy["off"] and len(greedy["zero"]) == 24


SAMPLED = dict(n_samples=4, batch_size=48, temperature=1.0)  # 5 chunks of 48 for 200 rows x 4 samples


@torchrun_plan
def two_process_plan(folder, fixture):
    """generate.py under torchrun with 2 processes, sampling SAMPLED."""
    flags = {**SAMPLED, "data_path": fixture("val200"), "output_path": folder / "two.parquet"}
    return {"two": ("generate", [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()])}


def test_sampled_generation_two_processes_equal_one_and_evaluate(tmp_path, gen, ev, val200, torchrun_runs, capsys):
    """n=4 sampled responses in chunks of 48 (5 chunks, 3 for one process and 2 for the other):
    torchrun with 2 processes (two_process_plan) writes the rows, responses, ids and finish reasons
    one process writes, in input order; evaluate then reports pass@1..4 and maj@1..4 per data_source."""
    folder, codes = torchrun_runs[__name__]
    assert codes == {"two": 0}
    one, two = tmp_path / "one.parquet", folder / "two.parquet"
    gen.main(gen.Args(data_path=str(val200), output_path=str(one), **SAMPLED))
    a, b = pq.read_table(one).to_pylist(), pq.read_table(two).to_pylist()
    source = pq.read_table(val200).to_pylist()
    assert a == b and len(a) == 200
    assert [{k: r[k] for k in source[0]} for r in a] == source  # every input column kept, rows in order
    assert all(len(r["responses"]) == len(r["response_ids"]) == len(r["finish_reasons"]) == 4 for r in a)
    assert len({tuple(r["responses"]) for r in a}) > 100 and any(len(set(r["responses"])) > 1 for r in a)
    assert not (tmp_path / "one.parquet.parts").exists() and not (folder / "two.parquet.parts").exists()

    capsys.readouterr()
    results = ev.main(ev.Args(data_path=str(one), output_scores=str(tmp_path / "scores.parquet")))
    console = capsys.readouterr().out.splitlines()
    header = next(line for line in console if "pass@1" in line).split()
    assert header == ["prompts", "mean_score", "pass@1", "pass@2", "pass@3", "pass@4"]
    row = next(line for line in console if line.startswith("bundled/addition")).split()
    assert float(row[3]) == pytest.approx(results["bundled/addition"]["pass@1"], abs=1e-4)
    all_ = results["all"]
    assert [f"pass@{k}" in all_ and f"maj@{k}" in all_ for k in range(1, 5)] == [True] * 4
    assert 0 < all_["pass@1"] < all_["pass@2"] < all_["pass@4"] <= 1  # more samples, more chances
    assert all_["response_length_mean"] > 0 and all_["truncated_fraction"] >= 0 and all_["scoring_failures"] == 0
    scores = pq.read_table(tmp_path / "scores.parquet").to_pylist()
    hits = sum(sum(r["correct"]) for r in scores)
    assert all_["pass@1"] == pytest.approx(hits / 800)  # pass@1 is the share of correct responses
    jsonl = tmp_path / "one.jsonl"  # the same rows as JSONL: --output-scores reads them as the scoring did
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in a))
    from_jsonl = ev.main(ev.Args(data_path=str(jsonl), output_scores=str(tmp_path / "scores-jsonl.parquet")))
    assert [from_jsonl["all"][f"pass@{k}"] for k in range(1, 5)] == [all_[f"pass@{k}"] for k in range(1, 5)]
    again = pq.read_table(tmp_path / "scores-jsonl.parquet").to_pylist()
    assert [(r["responses"], r["scores"], r["correct"]) for r in again] == [
        (r["responses"], r["scores"], r["correct"]) for r in scores
    ]


@pytest.mark.e2e
def test_a_killed_generation_resumes_from_its_finished_chunks(tmp_path, gen, val200, monkeypatch):
    """Killed after its second of five chunks, a run started again generates only the other three
    and writes what an uninterrupted run writes; the same folder with other flags is refused."""
    flags = dict(data_path=str(val200), n_samples=2, batch_size=48)
    whole = tmp_path / "whole.parquet"
    gen.main(gen.Args(output_path=str(whole), **flags))

    out = tmp_path / "killed.parquet"
    written, real_write = [], gen.write_chunk

    def dies_after_two(parts, c, *rest):
        if len(written) == 2:
            raise KeyboardInterrupt  # as a kill between chunks
        real_write(parts, c, *rest)
        written.append(c)

    monkeypatch.setattr(gen, "write_chunk", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        gen.main(gen.Args(output_path=str(out), **flags))
    assert written == [0, 1] and not out.exists()
    with pytest.raises(UsageError, match=r"other flags \(n_samples\)"):
        gen.main(gen.Args(output_path=str(out), **{**flags, "n_samples": 3}))

    written.clear()
    monkeypatch.setattr(gen, "write_chunk", lambda parts, c, *rest: (written.append(c), real_write(parts, c, *rest)))
    gen.main(gen.Args(output_path=str(out), **flags))
    assert written == [2, 3, 4]
    assert pq.read_table(out).to_pylist() == pq.read_table(whole).to_pylist()


def test_chunks_from_an_older_generate_are_refused_by_name(tmp_path, gen):
    """A parts folder written before generate.py kept response_extra_info cannot be merged with
    new chunks: resuming it is a usage error naming the folder, not a KeyError at the end."""
    from types import SimpleNamespace

    import pyarrow as pa

    parts, flags = tmp_path / "out.parquet.parts", {"n_samples": 2}
    parts.mkdir()
    (parts / "flags.json").write_text(json.dumps(flags))
    pq.write_table(pa.table({"row": [0], "responses": [["a", "b"]]}), parts / "chunk_000000.parquet")
    with pytest.raises(UsageError, match=re.escape(f"{parts} holds chunks from an older generate.py")):
        gen.open_parts(parts, flags, 3, SimpleNamespace(is_main=True))
    pq.write_table(pa.table({"row": [0], "response_extra_info": [["null", "null"]]}), parts / "chunk_000000.parquet")
    assert gen.open_parts(parts, flags, 3, SimpleNamespace(is_main=True)) == {0}


# --- bad input ---------------------------------------------------------------------------------------
def test_bad_input_is_refused_before_any_model_loads_or_score(tmp_path, monkeypatch, ev):
    gen = load_recipe_refusing_models("generate", monkeypatch)
    with pytest.raises(UsageError, match="--data-path nope.parquet: no such file"):
        gen.Args(data_path="nope.parquet")
    with pytest.raises(UsageError, match="--n-samples 0: must be >= 1"):
        gen.Args(n_samples=0)
    with pytest.raises(UsageError, match="is the input file"):
        gen.Args(output_path=str(TASK_TEST))
    (tmp_path / "afile").write_text("")
    with pytest.raises(UsageError, match="afile is a file"):
        gen.Args(output_path=str(tmp_path / "afile" / "out.parquet"))
    with pytest.raises(UsageError, match="row 0: 40 tokens > max_prompt_length=8"):
        gen.main(gen.Args(max_prompt_length=8, output_path=str(tmp_path / "o.parquet")))

    rows = pq.read_table(TASK_TEST).slice(0, 4).to_pylist()
    cases = {
        "no responses column": (rows, "no column 'responses'"),
        "a list of the wrong length": (
            [dict(r, responses=["a", "b"] if i != 2 else ["a"]) for i, r in enumerate(rows)],
            "row 2: 1 responses where row 0 has 2",
        ),
        "not a list": ([dict(r, responses="a") for r in rows], "must be a non-empty list of strings"),
        "an unknown data_source": (
            [dict(r, responses=["a"], data_source="my/task") for r in rows],
            "no built-in reward for data_source='my/task'",
        ),
    }
    import pyarrow as pa

    for name, (table, words) in cases.items():
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(table), path)
        with pytest.raises(UsageError, match=words):
            ev.main(ev.Args(data_path=str(path)))
    with pytest.raises(UsageError, match="write one with recipes/generate.py"):
        ev.Args(data_path=str(tmp_path / "missing.parquet"))


def test_the_command_line_prints_one_line(tmp_path):
    proc = run_recipe(
        "evaluate", "--data-path", str(TASK_TEST), "--output-json", str(tmp_path / "m.json"), check=False, fresh=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and "no column 'responses'" in proc.stderr


def test_generate_reads_jsonl_and_copies_its_columns(tmp_path, gen):
    """--data-path in another format than parquet (here JSONL, through datasets): the output holds the input's own
    columns beside the responses, row for row, as a parquet input's does."""
    rows = pq.read_table(BUNDLED / "addition" / "test.parquet").slice(0, 6).to_pylist()
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.parquet"
    gen.main(gen.Args(data_path=str(data), output_path=str(out), temperature=0.0, batch_size=4))
    table = pq.read_table(out)
    assert table.num_rows == 6 and {"data_source", "prompt", "reward_model", "responses"} <= set(table.column_names)
    assert table.column("extra_info").to_pylist() == [r["extra_info"] for r in rows]


def test_generate_reads_a_save_to_disk_folder_as_its_help_says(tmp_path, gen):
    """--data-path a folder written by datasets' save_to_disk (its help: "as --train-files takes them"): the
    folder's rows, each with its responses, where a missing path is still refused as the flags are parsed."""
    from datasets import Dataset

    rows = pq.read_table(BUNDLED / "addition" / "test.parquet").slice(0, 4).to_pylist()
    folder = tmp_path / "saved"
    Dataset.from_list(rows).save_to_disk(str(folder))
    out = tmp_path / "out.parquet"
    gen.main(gen.Args(data_path=str(folder), output_path=str(out), temperature=0.0, batch_size=4))
    table = pq.read_table(out).to_pylist()
    assert [r["extra_info"] for r in table] == [r["extra_info"] for r in rows]
    assert all(len(r["responses"]) == 1 for r in table)
    with pytest.raises(UsageError, match="no such file or folder; pass a parquet"):
        gen.Args(data_path=str(tmp_path / "missing"))
    renamed = tmp_path / "renamed.jsonl"  # OpenRLHF's --input-key, which the missing-column message names, is taken
    renamed.write_text("".join(json.dumps({"question": r.pop("prompt"), **r}) + "\n" for r in rows))
    with pytest.raises(Exception, match="--input-key"):
        gen.main(gen.Args(data_path=str(renamed), output_path=str(tmp_path / "none.parquet")))
    run_recipe("generate", "--data-path", renamed, "--input-key", "question", "--output-path", out, "--temperature", 0)
    questions = [json.loads(line)["question"] for line in renamed.read_text().splitlines()]
    assert [r["question"] for r in pq.read_table(out).to_pylist()] == questions


def test_generate_samples_under_min_p_as_training_does(tmp_path, gen):
    """--min-p reaches the sampler: at 0.99 only the most likely token survives each step, so every sampled
    response is the greedy one; at 0 (off) the same seed's samples differ."""
    data = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(BUNDLED / "addition" / "test.parquet").slice(0, 6), data)

    def responses(name, **knobs):
        out = tmp_path / f"{name}.parquet"
        gen.main(gen.Args(data_path=str(data), output_path=str(out), batch_size=6, max_response_length=12, **knobs))
        return [r["responses"] for r in pq.read_table(out).to_pylist()]

    greedy = responses("greedy", temperature=0.0)
    assert responses("min_p", temperature=1.5, n_samples=4, min_p=0.99) == [g * 4 for g in greedy]
    assert responses("whole", temperature=1.5, n_samples=4) != [g * 4 for g in greedy]
