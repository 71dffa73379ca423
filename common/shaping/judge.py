"""An LLM-judge reward (--judge-url), a feature: a model served behind an OpenAI-compatible URL reads the task, the
response and the reference answer and replies with a score. It runs in the reward workers (common.rewards), so each
call is under --reward-timeout like every reward: a judge that hangs or fails costs that sample a 0, counted, never
the run. One POST a sample through the standard library: no client library is needed for it."""

import json
import os
import re
import string
import urllib.error
import urllib.request

from common.errors import UsageError

PLACES = {"prompt", "response", "ground_truth"}
DEFAULT_PROMPT = """Judge the response to the task below against the reference answer (which may be empty).

Task:
{prompt}

Reference answer: {ground_truth}

Response:
{response}

End your reply with one line "Score: N", N from 0 (wrong) to 10 (fully correct)."""
SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


def judge_config(reward) -> str:
    """The reward group's judge flags as the JSON that load_judge reads in a worker."""
    config = dict(
        url=reward.judge_url.rstrip("/"),
        model=reward.judge_model,
        prompt=reward.judge_prompt,
        max_score=reward.judge_max_score,
        timeout=reward.reward_timeout,
    )
    return json.dumps(config)


def read_template(path: str | None) -> str:
    """The judge's instructions: the file at `path` (or the default), with only {prompt}, {response} and
    {ground_truth} as places to fill; UsageError naming the file otherwise."""
    if path is None:
        return DEFAULT_PROMPT
    try:
        text = open(os.path.expanduser(path), encoding="utf-8").read()
    except OSError as e:
        raise UsageError(f"--judge-prompt {path}: cannot be read ({e.strerror})") from None
    try:
        places = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as e:
        raise UsageError(f"--judge-prompt {path}: {e}; write a literal brace as {{{{ or }}}}") from None
    if places - PLACES or "response" not in places:
        wrong = sorted(places - PLACES)
        raise UsageError(
            f"--judge-prompt {path}: "
            + (f"{{{wrong[0]}}} is not a place to fill" if wrong else "it never shows the {response}")
            + "; use {prompt}, {response} and {ground_truth}"
        )
    return text


def _prompt_text(messages) -> str:
    """The task as the judge reads it: the prompt's messages, role by role (a plain string as it is)."""
    if isinstance(messages, str):
        return messages
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in messages or [])


def load_judge(spec: str, messages_key: str):
    """The reward function of judge_config's JSON, verl's signature (extra_info[messages_key] holding the prompt's
    messages): it fills the template, asks the judge at temperature 0 and returns the last "Score: N" of its reply
    over max_score; a reply without one, or past max_score, raises."""
    config = json.loads(spec)
    template, url = read_template(config["prompt"]), config["url"] + "/chat/completions"
    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        messages = (extra_info or {}).get(messages_key)
        text = template.format(
            prompt=_prompt_text(messages),
            response=solution_str,
            ground_truth="" if ground_truth is None else ground_truth,
        )
        body = dict(model=config["model"], messages=[{"role": "user", "content": text}], temperature=0)
        request = urllib.request.Request(url, json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=config["timeout"]) as reply:
                answer = json.loads(reply.read())["choices"][0]["message"]["content"]
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"the judge at {url} answered HTTP {e.code}: {e.read()[:200]!r}") from None
        except (urllib.error.URLError, OSError) as e:
            raise RuntimeError(f"the judge at {url} cannot be reached: {getattr(e, 'reason', e)}") from None
        found = SCORE.findall(answer or "")
        if not found or not 0 <= float(found[-1]) <= config["max_score"]:
            raise ValueError(f"the judge's reply holds no score in [0, {config['max_score']:g}]: {answer[-200:]!r}")
        return float(found[-1]) / config["max_score"]

    return compute_score
