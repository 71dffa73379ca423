"""--judge-url (common.shaping.judge): an LLM judge behind an OpenAI-compatible URL scores each response in the
reward workers. The judge here is a real HTTP server on 127.0.0.1 speaking /v1/chat/completions: it grades by
whether the response holds the reference answer, and can be told to hang, to reply without a score, or to fail."""

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import TASK_TRAIN, read_metrics, run_recipe

from common.errors import UsageError
from common.rewards import JUDGE_MESSAGES, JUDGE_PREFIX, RewardArgs, RewardPool
from common.shaping.judge import judge_config, read_template


@pytest.fixture
def judge():
    """The server and what it saw: each request's body and Authorization header; `mode` sets how it answers."""
    seen = {"requests": [], "mode": "grade"}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen["requests"].append((self.path, body, self.headers.get("Authorization")))
            if seen["mode"] == "hang":
                time.sleep(5)
            if seen["mode"] == "fail":
                self.send_response(500)
                self.end_headers()
                self.wfile.write(b"overloaded")
                return
            text = body["messages"][0]["content"]
            truth = re.search(r"Reference answer: (.*)", text).group(1).strip()
            response = text.split("Response:\n", 1)[1].split("\n\nEnd your reply", 1)[0]
            grade = 10 if truth and truth in response else 2
            content = "It looks right." if seen["mode"] == "no score" else f"Reasoning...\nScore: {grade}"
            reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    seen["url"] = f"http://127.0.0.1:{server.server_address[1]}/v1"
    yield seen
    server.shutdown()


def pool_for(url, timeout=5.0, **flags):
    return RewardPool(
        JUDGE_PREFIX + judge_config(RewardArgs(judge_url=url, reward_timeout=timeout, **flags)), 2, timeout
    )


def test_the_judge_reads_the_task_the_response_and_the_answer_and_its_score_is_the_reward(judge, monkeypatch):
    """Each sample is one request to /v1/chat/completions at temperature 0 naming --judge-model, holding the
    prompt's messages, the response and the reference answer, with $OPENAI_API_KEY as the bearer; the reply's last
    "Score: N" over --judge-max-score is the reward."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    pool = pool_for(judge["url"], judge_model="qwen-judge")
    messages = [{"role": "user", "content": "What is 2+3?"}]
    scored = pool.score(
        [
            ("addition", "<answer>5</answer>", "5", {JUDGE_MESSAGES: messages}),
            ("addition", "<answer>6</answer>", "5", {JUDGE_MESSAGES: messages}),
        ]
    )
    pool.close()
    assert scored.scores == [1.0, 0.2] and scored.errors == 0
    path, body, auth = judge["requests"][0]
    assert path == "/v1/chat/completions" and body["model"] == "qwen-judge" and body["temperature"] == 0
    assert "user: What is 2+3?" in body["messages"][0]["content"] and auth == "Bearer sk-test"


@pytest.mark.parametrize("mode, counted", [("hang", "timeouts"), ("no score", "errors"), ("fail", "errors")])
def test_a_judge_that_hangs_or_answers_without_a_score_costs_only_its_sample(judge, mode, counted):
    """Hang-proof like every reward: a judge that outlives --reward-timeout, replies without a score, or fails
    (HTTP 500) scores 0 and is counted; the pool goes on."""
    judge["mode"] = mode
    pool = pool_for(judge["url"], timeout=1.0)
    scored = pool.score([("addition", "5", "5", {JUDGE_MESSAGES: "2+3?"})])
    judge["mode"] = "grade"
    after = pool.score([("addition", "5", "5", {JUDGE_MESSAGES: "2+3?"})])
    pool.close()
    assert scored.scores == [0.0] and getattr(scored, counted) == 1
    assert after.scores == [1.0]


def test_a_judge_prompt_with_a_wrong_place_or_no_response_is_refused(tmp_path):
    good, wrong, blind = (tmp_path / f"{n}.txt" for n in ("good", "wrong", "blind"))
    good.write_text("Q: {prompt}\nA: {response}\nRef: {ground_truth}\nScore: N")
    wrong.write_text("Q: {question}\nA: {response}")
    blind.write_text("Q: {prompt}")
    assert read_template(str(good)).startswith("Q: {prompt}")
    with pytest.raises(UsageError, match=r"\{question\} is not a place to fill; use \{prompt\}"):
        read_template(str(wrong))
    with pytest.raises(UsageError, match=r"it never shows the \{response\}"):
        read_template(str(blind))
    with pytest.raises(UsageError, match="cannot be read"):
        read_template(str(tmp_path / "missing.txt"))


@pytest.mark.e2e
def test_grpo_trains_on_the_judges_scores_and_an_unreachable_judge_stops_before_the_model_loads(judge, tmp_path):
    """grpo.py --judge-url: 2 steps whose rewards are the judge's (every request holds a sampled response), the
    launch's dry run asking the judge first; a URL nothing listens on is one line, exit 2, before any model loads;
    --judge-url with --reward-fn is refused."""
    short = ["--total-training-steps", "2", "--train-batch-size", "4", "--rollout-n", "4", "--no-val-before-train",
             "--test-freq", "0", "--save-freq", "0", "--judge-model", "grader"]  # fmt: skip
    run_recipe("grpo", *short, "--judge-url", judge["url"], "--output-dir", tmp_path / "run")
    steps = [m for m in read_metrics(tmp_path / "run") if "train/loss" in m]
    assert len(steps) == 2 and all(m["reward/errors"] == 0 for m in steps if "reward/errors" in m)
    assert len(judge["requests"]) >= 2 * 16 and all(b["model"] == "grader" for _, b, _ in judge["requests"])
    gone = run_recipe(
        "grpo", *short, "--judge-url", "http://127.0.0.1:9/v1", "--output-dir", tmp_path / "gone", check=False
    )
    assert gone.returncode == 2 and "cannot be reached" in gone.stderr and "Traceback" not in gone.stderr
    both = run_recipe("grpo", *short, "--judge-url", judge["url"], "--reward-fn", str(TASK_TRAIN), check=False)
    assert both.returncode == 2 and "--judge-url with --reward-fn" in both.stderr
