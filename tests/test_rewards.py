import logging
import math
import os
import time

import pytest
import torch
from conftest import TINY

from common.rewards import RewardPool, Scored
from common.scoring import default_compute_score, gsm8k_score, load_reward_fn, math_score, score_value
from common.shaping.reward_model import RewardModel

BAD_FN = """
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        while True:
            pass
    if solution_str == "sleep":
        time.sleep(60)
    if solution_str == "boom":
        raise RuntimeError("boom in reward")
    if solution_str == "exit":
        os._exit(3)
    if solution_str == "text":
        return "not a number"
    if solution_str in ("nan", "inf", "1e39"):
        return {"score": float(solution_str)}
    return {"score": float(solution_str == ground_truth), "acc": 1.0, "note": "ignored"}
"""


@pytest.fixture
def bad_fn(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(BAD_FN)
    return str(path)


def test_builtins():
    assert default_compute_score("bundled/addition", "<answer>12</answer>", "12") == 1.0
    assert default_compute_score("bundled/addition", "<answer>1</answer><answer>12</answer>", "12") == 1.0
    assert default_compute_score("bundled/addition", "12", "12") == 0.0
    assert gsm8k_score("so #### 1,234.", "1234") == 1.0
    assert gsm8k_score("the answer is 72", "72") == 0.0
    assert gsm8k_score("the answer is 72", "72", method="flexible") == 1.0
    assert default_compute_score("openai/gsm8k", "#### 5", "6") == 0.0
    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
    assert gsm8k_score("#### 72", solution) == 1.0 and gsm8k_score("#### 24", solution) == 0.0  # GSM8K's own column
    assert math_score("thus $\\boxed{\\frac{1}{2}}$", "0.5") == 1.0
    assert default_compute_score("lighteval/MATH", "\\boxed{3}", "4") == 0.0
    assert default_compute_score("format", " <answer>x</answer> ", None) == 1.0
    with pytest.raises(ValueError, match="no built-in reward for data_source='mystery'.*--reward-fn"):
        default_compute_score("mystery", "a", "b")


def test_score_value_rejects_non_numbers():
    assert score_value({"score": 1, "acc": 0}) == 1.0
    assert math.isnan(score_value(float("nan")))  # a number: RewardPool.score counts and zeroes it
    for bad in ("1", None, {"acc": 1}, True):
        with pytest.raises((TypeError, KeyError)):
            score_value(bad)


def test_load_reward_fn_errors(tmp_path, bad_fn):
    assert load_reward_fn(None) is default_compute_score
    assert load_reward_fn(bad_fn)("d", "1", "1") == {"score": 1.0, "acc": 1.0, "note": "ignored"}
    with pytest.raises(ValueError, match="does not exist"):
        load_reward_fn(str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="defines no function 'nope'"):
        load_reward_fn(f"{bad_fn}:nope")


def test_dry_run_fails_when_every_row_fails_and_warns_otherwise(bad_fn, caplog):
    rows = [
        {"data_source": "d", "ground_truth": g, "extra_info": None, "file": "f.parquet", "row": 3}
        for g in ("boom", "hang")
    ]
    pool = RewardPool(bad_fn, workers=2, timeout=0.5)
    try:
        with pytest.raises(
            ValueError,
            match=r"reward dry run failed .* every row tried for data_source='d', e.g. f.parquet row 3: RuntimeError: boom",
        ):
            pool.dry_run(rows)
        # one data_source that scores does not hide another that never does
        with pytest.raises(ValueError, match=r"data_source='e'"):
            pool.dry_run([dict(rows[0], ground_truth="7"), dict(rows[0], data_source="e")])
        with caplog.at_level(logging.WARNING, logger="common.rewards"):
            pool.dry_run(rows[:1] + [dict(rows[0], ground_truth="7")])
        assert "1 of 2 rows failed" in caplog.text
        with pytest.raises(ValueError, match="must be a number or a dict"):
            pool.dry_run([dict(rows[0], ground_truth="text")])
    finally:
        pool.close()


@pytest.mark.e2e
def test_pool_survives_hangs_exceptions_exits_and_bad_returns(bad_fn, caplog):
    pool = RewardPool(bad_fn, workers=2, timeout=1.0)
    try:
        tasks = [("d", s, "1", None) for s in ("1", "hang", "boom", "exit", "sleep", "text", "0")] + [
            ("d", "1", "1", None)
        ] * 20
        with caplog.at_level(logging.ERROR, logger="common.rewards"):
            out = pool.score(tasks)
            again = pool.score([("d", "boom", "1", None), ("d", "1", "1", None)])
        assert out.scores[:7] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0] and out.scores[7:] == [1.0] * 20
        assert (out.timeouts, out.errors) == (2, 3)
        assert out.extras[0] == {"acc": 1.0} and out.extras[1] == {}
        assert "boom in reward" in out.first_error
        assert out.seconds < 10, "hung samples must cost about one timeout, not block"
        assert again.scores == [0.0, 1.0] and again.errors == 1
        assert sum("boom in reward" in r.message for r in caplog.records) == 1, "traceback printed once"
        # a non-finite reward (1e39 is one as the float32 rewards train in) is zeroed and counted
        # apart from errors, so it never reaches the advantages; the first is shown once
        with caplog.at_level(logging.WARNING, logger="common.rewards"):
            tasks = [("d", s, "1", None) for s in ("nan", "inf", "1e39", "1")]
            nonfinite, again = pool.score(tasks), pool.score(tasks[:1])
        assert nonfinite.scores == [0.0, 0.0, 0.0, 1.0] and (nonfinite.nonfinite, nonfinite.errors) == (3, 0)
        assert again.nonfinite == 1 and caplog.text.count("counted in reward/nonfinite") == 1
        assert "returned {'score': nan} for data_source='d'" in caplog.text
        merged = Scored.merge([nonfinite, again], [0.0], [{}])
        assert merged.nonfinite == 4
    finally:
        pool.close()


def test_reward_model_reuses_or_retemplates(tmp_path, tokenizer):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(TINY, num_labels=1)
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_config(config)
    same_dir, other_dir = tmp_path / "rm_same", tmp_path / "rm_other"
    rm.save_pretrained(same_dir)
    tokenizer.save_pretrained(same_dir)
    rm.save_pretrained(other_dir)
    other = type(tokenizer).from_pretrained(TINY)
    other.chat_template = "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    other.save_pretrained(other_dir)

    messages = [[{"role": "user", "content": "1+2=?"}]]
    prompt_ids = [tokenizer.apply_chat_template(messages[0], add_generation_prompt=True, tokenize=False)]
    prompt_ids = [tokenizer(prompt_ids[0], add_special_tokens=False)["input_ids"]]
    response_ids = [tokenizer("<answer>3</answer>", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]

    same = RewardModel(str(same_dir), tokenizer, device="cpu")
    assert same.same_tokens
    assert same.inputs(messages, ["<answer>3</answer>"], prompt_ids, response_ids) == [prompt_ids[0] + response_ids[0]]
    retemplated = RewardModel(str(other_dir), tokenizer, device="cpu")
    assert not retemplated.same_tokens
    (ids,) = retemplated.inputs(messages, ["<answer>3</answer>"], prompt_ids, response_ids)
    assert other.decode(ids) == "### user: 1+2=?\n### assistant: <answer>3</answer>\n"
    score = retemplated.score(messages, ["<answer>3</answer>"], prompt_ids, response_ids)
    with torch.no_grad():
        direct = rm(input_ids=torch.tensor([ids])).logits[0, 0].float()
    assert score.shape == (1,) and torch.allclose(score[0], direct, atol=1e-5)


def test_a_packed_reward_model_scores_as_the_padded_one(tmp_path, tokenizer):
    """--use-remove-padding on the reward model: the conversations of a batch in one row, each scored
    at the token transformers' classifier reads (the last one that is not the pad token, so a
    response ending in pad tokens is read before them), equal to the padded scores."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from common.model import pack_mode

    config = AutoConfig.from_pretrained(TINY, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    g = torch.Generator().manual_seed(0)
    prompt_ids = [tokenizer("1+2=?", add_special_tokens=False)["input_ids"]] * 4
    response_ids = [torch.randint(10, 200, (n,), generator=g).tolist() for n in (1, 40, 7, 25)]
    response_ids[2] += [tokenizer.pad_token_id] * 2
    args = ([[{"role": "user", "content": "1+2=?"}]] * 4, [""] * 4, prompt_ids, response_ids)
    padded = RewardModel(str(tmp_path / "rm"), tokenizer, device="cpu", remove_padding=False)
    scores = {}
    for mode in (True, "auto"):
        packed = RewardModel(str(tmp_path / "rm"), tokenizer, device="cpu", remove_padding=mode)
        assert pack_mode(packed.model) == mode
        scores[mode] = packed.score(*args)
    want = padded.score(*args)
    assert torch.allclose(scores[True], want, atol=1e-5) and torch.allclose(scores["auto"], want, atol=1e-5)
    assert len(set(want.tolist())) == 4
    # Its forwards take --micro-batch-size-per-gpu sequences, as every forward here (verl's
    # reward_model.micro_batch_size_per_gpu is said to follow it): 4 conversations, 3 a forward.
    from conftest import make_args

    from common.config import RLArgs
    from common.parallel import Dist
    from common.rollout import load_reward_model

    rl = make_args(RLArgs, micro_batch_size_per_gpu=3, reward_model=str(tmp_path / "rm"), use_remove_padding=False)
    dist = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    small = load_reward_model(rl.reward, rl.model, tokenizer, dist, rl.actor.micro_batch_size_per_gpu)
    assert small.batch_size == 3
    calls = []
    small.model.register_forward_hook(lambda *_: calls.append(1))
    assert torch.allclose(small.score(*args), want, atol=1e-5) and len(calls) == 2


@pytest.mark.e2e
def test_a_reward_file_runs_only_in_workers_and_a_hang_at_import_is_an_error(tmp_path, monkeypatch):
    """The user's file is imported in the worker processes, never in the trainer's; one that hangs
    while importing ends as a UsageError after the start-up timeout instead of stopping the run."""
    import common.rewards as rewards
    from common.errors import UsageError

    marker = tmp_path / "imported_by"
    spy = tmp_path / "spy.py"
    spy.write_text(
        f"import os\nopen({str(marker)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    pool = rewards.reward_pool(str(spy), 2, 5.0)
    pool.close()
    pids = marker.read_text().split()
    assert len(pids) == 2 and str(os.getpid()) not in pids
    hangs = tmp_path / "hangs.py"
    hangs.write_text("import time\ntime.sleep(600)\n")
    monkeypatch.setattr(rewards, "STARTUP_TIMEOUT", 3.0)
    t0 = time.time()
    with pytest.raises(UsageError, match="importing it did not finish in 3s"):
        rewards.reward_pool(str(hangs), 1, 5.0)
    assert time.time() - t0 < 30


def test_what_reward_workers_print_goes_to_a_capped_log_file(tmp_path, monkeypatch, capfd):
    import common.rewards as rewards

    chatty = tmp_path / "chatty.py"
    chatty.write_text(
        "import sys\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    print('scoring', solution_str, 'x' * 200, flush=True)\n"
        "    print('a warning', file=sys.stderr, flush=True)\n"
        "    return 1.0\n"
    )
    monkeypatch.setattr(rewards._WorkerOutput, "MAX_BYTES", 2000)
    log_path = tmp_path / "run" / "reward_workers.log"
    pool = rewards.reward_pool(str(chatty), 2, 5.0, log_path=log_path)
    pool.score([("d", str(i), "1", None) for i in range(40)])  # about 9 kB of output
    pool.close()
    for _ in range(100):  # the copying threads finish once the workers' pipes close
        if log_path.is_file() and "dropped" in log_path.read_text():
            break
        time.sleep(0.1)
    text = log_path.read_text()
    assert "scoring " in text and "a warning" in text  # stdout and stderr (the two workers interleave)
    assert len(text.encode()) <= 2000 + 100 and text.count("beyond 10 MB dropped") == 1
    assert "scoring" not in capfd.readouterr().out, "worker output stays off the console"


def test_workers_leave_stop_signals_to_the_trainer():
    """torchrun and Slurm signal every process of a job; the reward workers ignore SIGUSR1 and
    SIGTERM (the trainer saves and stops, then closes them), so the step being scored finishes."""
    import signal

    pool = RewardPool(None, workers=2, timeout=5.0)
    try:
        for proc, _ in pool.workers:
            os.kill(proc.pid, signal.SIGUSR1)
            os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert all(proc.poll() is None for proc, _ in pool.workers)
        out = pool.score([("bundled/addition", "<answer>2</answer>", "2", None)] * 4)
        assert out.scores == [1.0] * 4 and out.errors == out.timeouts == 0
    finally:
        pool.close()


BATCH_FN = """
import os, time

def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
    with open(os.environ["BATCH_CALLS"], "a") as f:
        f.write(f"{len(solution_strs)}\\n")
    if "hang" in solution_strs:
        time.sleep(60)
    if "short" in solution_strs:
        return [1.0]
    return [{"score": float(s == g), "len": len(s)} for s, g in zip(solution_strs, ground_truths)]
"""


def test_the_batch_reward_manager_calls_once_a_step_with_lists(tmp_path, monkeypatch):
    """--reward-manager batch: one call per scoring with verl's batch signature; its dicts' extra
    keys become metrics; a call that hangs or returns the wrong number of scores fails (and zeroes)
    every sample of the call, counted, and the next call runs."""
    (tmp_path / "batch_reward.py").write_text(BATCH_FN)
    calls = tmp_path / "calls"
    monkeypatch.setenv("BATCH_CALLS", str(calls))
    from common.rewards import reward_pool

    pool = reward_pool(str(tmp_path / "batch_reward.py"), 2, 2.0, batch=True)
    try:
        out = pool.score([("d", s, "12", {"i": i}) for i, s in enumerate(["12", "7", "12"])])
        assert out.scores == [1.0, 0.0, 1.0] and [e["len"] for e in out.extras] == [2, 1, 2]
        assert (out.errors, out.timeouts) == (0, 0)
        short = pool.score([("d", s, "12", None) for s in ("short", "12")])
        assert (
            short.scores == [0.0, 0.0] and short.errors == 2 and "returned 1 scores for 2 samples" in short.first_error
        )
        hung = pool.score([("d", s, "12", None) for s in ("hang", "12", "12")])
        assert hung.scores == [0.0] * 3 and hung.timeouts == 3 and hung.seconds < 10
        assert pool.score([("d", "12", "12", None)]).scores == [1.0]
        assert calls.read_text().split() == ["3", "2", "3", "1"]
    finally:
        pool.close()


def test_a_reward_function_is_called_by_name_as_verl_calls_it(tmp_path):
    """verl's reward managers pass compute_score's arguments by name (data_source=, solution_str=,
    ground_truth=, extra_info=; a batch's in the plural), so a function that lists them in another
    order gets each where it asked for it, one sample at a time and as a batch."""
    from common.rewards import reward_pool

    (tmp_path / "any_order.py").write_text(
        "def compute_score(extra_info, ground_truth, solution_str, data_source):\n"
        "    return {'score': float(solution_str == ground_truth), 'src': float(data_source == 'src'), 'i': extra_info['i']}\n"
        "def batch(ground_truths, extra_infos, data_sources, solution_strs):\n"
        "    return [float(s == g) + 10 * e['i'] for s, g, e in zip(solution_strs, ground_truths, extra_infos)]\n"
    )
    tasks = [("src", s, "12", {"i": i}) for i, s in enumerate(["12", "7"])]
    pool = reward_pool(str(tmp_path / "any_order.py"), 1, 5.0)
    try:
        out = pool.score(tasks)
        assert out.scores == [1.0, 0.0] and [(e["src"], e["i"]) for e in out.extras] == [(1.0, 0), (1.0, 1)]
    finally:
        pool.close()
    pool = reward_pool(f"{tmp_path / 'any_order.py'}:batch", 1, 5.0, batch=True)
    try:
        assert pool.score(tasks).scores == [1.0, 10.0]
    finally:
        pool.close()
