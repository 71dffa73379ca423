"""reasoning-gym's procedural tasks as data (--train-files reasoning-gym:NAME?size=...&seed=...), a feature: each row is
one of the task's generated problems in verl's columns, scored by the task's own score_answer on the answer the
response gives in <answer></answer> (data_source reasoning_gym/NAME; common.scoring routes it here). The reward
workers make the same dataset again from the row's task, config and index, so no generated object travels through
the data. pip install -e ".[reasoning-gym]"."""

import difflib
import functools
import json
from urllib.parse import parse_qsl

from common.errors import UsageError

PREFIX = "reasoning-gym:"
SOURCE = "reasoning_gym/"  # data_source prefix of its rows
OWN = ("size", "seed", "system_prompt")  # the query's keys that are not the task's config


def _package():
    try:
        import reasoning_gym
    except ImportError:
        raise UsageError(f'{PREFIX} data needs the reasoning-gym package: pip install -e ".[reasoning-gym]"') from None
    return reasoning_gym


def _value(text: str):
    """A query value as JSON where it parses (numbers, true / false, lists), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse(spec: str, what: str) -> tuple[str, dict, str]:
    """(task name, create_dataset's keyword arguments, system prompt name) of `reasoning-gym:NAME?key=value&...`."""
    name, _, query = spec.removeprefix(PREFIX).partition("?")
    pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    config = {key: _value(value) for key, value in pairs}
    rg = _package()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        near = difflib.get_close_matches(name, DATASETS, n=3)
        hint = (
            f"; did you mean {', '.join(near)}?"
            if near
            else f"; its {len(DATASETS)} tasks include {', '.join(sorted(DATASETS)[:5])}, ..."
        )
        raise UsageError(f"{what} {spec}: reasoning-gym has no task {name!r}{hint}")
    prompt = config.pop("system_prompt", "default")
    if prompt not in (*rg.utils.SYSTEM_PROMPTS, "none"):
        raise UsageError(
            f"{what} {spec}: system_prompt {prompt!r} is none of {', '.join(rg.utils.SYSTEM_PROMPTS)}, none"
        )
    for key in ("size", "seed"):
        if key in config and (isinstance(config[key], bool) or not isinstance(config[key], int) or config[key] < 0):
            raise UsageError(f"{what} {spec}: {key} must be a whole number >= 0, got {config[key]!r}")
    return name, config, prompt


@functools.cache
def dataset(name: str, config_json: str):
    """The task's dataset for this config (JSON of create_dataset's keyword arguments), made once per process."""
    return _package().create_dataset(name, **json.loads(config_json))


def read(spec: str, what: str) -> list[dict]:
    """The rows of a reasoning-gym spec, in verl's columns; a config the task refuses is a UsageError naming it."""
    name, config, prompt = parse(spec, what)
    config = {"size": 500, "seed": 1, **config}
    config_json = json.dumps(config, sort_keys=True)
    try:
        problems = dataset(name, config_json)
    except (TypeError, ValueError, AssertionError) as e:
        raise UsageError(f"{what} {spec}: reasoning-gym refuses the config ({type(e).__name__}: {e})") from None
    system = [] if prompt == "none" else [{"role": "system", "content": _package().utils.SYSTEM_PROMPTS[prompt]}]
    return [
        {
            "data_source": SOURCE + name,
            "prompt": system + [{"role": "user", "content": entry["question"]}],
            "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
            "extra_info": {"reasoning_gym": {"task": name, "config": config_json, "index": i}},
        }
        for i, entry in enumerate(problems)
    ]


def score(data_source: str, solution_str: str, extra_info) -> float:
    """The task's score_answer of the response's <answer></answer> (0 without one), against the row's own entry."""
    rg = _package()
    where = (extra_info or {}).get("reasoning_gym")
    if not where:
        raise ValueError(
            f"data_source {data_source!r}: the row's extra_info has no reasoning_gym entry to score against"
        )
    problems = dataset(where["task"], where["config"])
    answer = rg.utils.extract_answer(solution_str)
    return float(problems.score_answer(answer=answer, entry=problems[where["index"]])) if answer is not None else 0.0
