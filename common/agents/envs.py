"""Environments for agentic RL (ROLL's env-manager pipeline) on Gymnasium's API: what --env-config
declares, read and checked without running any of it; the adapter that makes a Gymnasium
environment with discrete actions a text one; the action a model's reply names; and the host that
an environment worker process runs (common.rewards' pool, common.agents.env_manager's loop).

A text environment is a `gymnasium.Env` whose observations and actions are strings:
`reset(seed=s) -> (observation, info)` and `step(action) -> (observation, reward, terminated,
truncated, info)`. Its reset must be deterministic in the seed: the members of a group start from
one seed and must see the same first observation. --env-config names them by tag (YAML):

    envs:
      FrozenLake:                                    # the tag: its rows' data_source, its metrics' key
        env: bundled/envs/frozen_lake.py:TextFrozenLake   # path/to/file.py:Class, or a Gymnasium id
        kwargs: {size: 4}                            # constructor kwargs (gymnasium.make's for an id)
        system_prompt: Reach G. Answer <answer>left|down|right|up</answer>.   # optional
        action_pattern: <answer>(.*?)</answer>       # a regex whose first group is the action (this default)
        actions: [left, down, right, up]             # the action names; with an id, of actions 0..n-1
        render: path/to/file.py:function             # with an id: function(env, observation) -> text

An id's environment (any registered one, e.g. FrozenLake-v1) is wrapped by TextAdapter: actions by
name, observations as `render`'s text, else its ansi rendering, else str(observation). A reply
whose action does not parse (no match of the pattern, or a name not in `actions`) does not step
the environment: the turn gets --format-penalty and the model sees the observation again.
"""

import math
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from common.agents.tools import read_yaml_section
from common.errors import UsageError
from common.flags import flag_defaults, flag_name, flag_values
from common.scoring import load_from_file

DEFAULT_ACTION_PATTERN = r"<answer>(.*?)</answer>"  # ROLL's and RAGEN's answer tags
ENTRY_KEYS = ("env", "kwargs", "system_prompt", "action_pattern", "actions", "render", "invalid_action_text")
DEFAULT_INVALID_ACTION_TEXT = "Invalid action."


@dataclass
class EnvSpec:
    """One tag of --env-config."""

    tag: str
    env: str  # "/abs/path/file.py:Class", or a Gymnasium id
    kwargs: dict
    system_prompt: str | None = None
    action_pattern: str = DEFAULT_ACTION_PATTERN
    actions: list[str] | None = None
    render: str | None = None  # "/abs/path/file.py:function"
    invalid_action_text: str = DEFAULT_INVALID_ACTION_TEXT

    @property
    def from_file(self) -> bool:
        return _is_file_target(self.env)


@dataclass
class EnvConfig:
    path: str
    specs: dict[str, EnvSpec]

    @property
    def tags(self) -> list[str]:
        return list(self.specs)


def _is_file_target(target: str) -> bool:
    return target.partition(":")[0].endswith(".py")


def _resolve(target: str, base: Path, where: str, what: str) -> str:
    source = Path(target.partition(":")[0]).expanduser()
    source = source if source.is_absolute() else base / source
    if not source.is_file():
        raise UsageError(f"{where}: {what} file {target.partition(':')[0]!r} does not exist")
    if not target.partition(":")[2]:
        raise UsageError(f"{where}: {what} {target!r} needs the name after the colon: path/to/file.py:Name")
    return f"{source}:{target.partition(':')[2]}"


def read_env_config(path: str) -> EnvConfig:
    """Read and check --env-config without importing any environment (the workers do)."""
    flag = f"--env-config {path}"
    file, envs = read_yaml_section(
        path, "--env-config", "envs", dict, "mapping of tag -> environment, with at least one"
    )
    specs = {}
    for tag, entry in envs.items():
        where = f"{flag}: envs.{tag}"
        if not isinstance(tag, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", tag):
            raise UsageError(
                f"{flag}: tag {tag!r} must be a name of letters, digits, '_', '.' or '-' (it keys metrics)"
            )
        if not isinstance(entry, dict):
            raise UsageError(f"{where}: expected a mapping with env: path/to/file.py:Class or a Gymnasium id")
        if other := sorted(set(entry) - set(ENTRY_KEYS)):
            raise UsageError(
                f"{where}: unknown key(s) {', '.join(map(str, other))}; an entry has {', '.join(ENTRY_KEYS)}"
            )
        target = entry.get("env")
        if not isinstance(target, str) or not target:
            raise UsageError(f"{where}: needs env: path/to/file.py:Class or a registered Gymnasium id")
        kwargs = entry.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise UsageError(f"{where}: kwargs must be a mapping")
        texts = {k: entry.get(k) for k in ("system_prompt", "action_pattern", "invalid_action_text")}
        for key, value in texts.items():
            if value is not None and not isinstance(value, str):
                raise UsageError(f"{where}: {key} must be text")
        pattern = texts["action_pattern"] or DEFAULT_ACTION_PATTERN
        try:
            groups = re.compile(pattern).groups
        except re.error as e:
            raise UsageError(f"{where}: action_pattern {pattern!r} is not a regular expression ({e})") from None
        if groups < 1:
            raise UsageError(f"{where}: action_pattern {pattern!r} needs a group around the action, e.g. <a>(.*?)</a>")
        actions = entry.get("actions")
        if actions is not None and (
            not isinstance(actions, list) or not actions or not all(isinstance(a, str) and a for a in actions)
        ):
            raise UsageError(f"{where}: actions must be a list of action names")
        if actions is not None and len({a.lower() for a in actions}) < len(actions):
            raise UsageError(f"{where}: actions {actions} repeat a name (they are matched ignoring case)")
        render = entry.get("render")
        if _is_file_target(target):
            target = _resolve(target, file.parent, where, "env")
            if render is not None:
                raise UsageError(f"{where}: render applies to a Gymnasium id; a text environment returns its own text")
        else:
            if not actions:
                raise UsageError(
                    f"{where}: a Gymnasium id ({target}) needs actions: [the names of its actions 0..n-1], which the "
                    f"model answers with"
                )
            if render is not None:
                if not isinstance(render, str) or ":" not in render:
                    raise UsageError(f"{where}: render must be path/to/file.py:function")
                render = _resolve(render, file.parent, where, "render")
        specs[tag] = EnvSpec(
            tag,
            target,
            kwargs,
            texts["system_prompt"],
            pattern,
            actions,
            render,
            texts["invalid_action_text"] or DEFAULT_INVALID_ACTION_TEXT,
        )
    return EnvConfig(str(file), specs)


# Flags an --env-config run has no use for: its rows are environment seeds and its rewards the returns.
ENV_UNUSED = ("train_files", "val_files", "data_path", "prompt_key", "truncation", "filter_overlong_prompts",
              "reward_fn", "reward_model", "tool_config", "interaction_config")  # fmt: skip


def check_env(args) -> None:
    """--env-config: the file, the tags and their groups (summing to the train batch), and no flag the run ignores."""
    defaults, values = flag_defaults(args), flag_values(args)
    args = SimpleNamespace(**values)  # every flag by its name, its group's (--env-tags: args.env) too
    config = read_env_config(args.env_config)
    for name in ENV_UNUSED:
        if name in defaults and values[name] != defaults[name]:
            raise UsageError(
                f"{flag_name(name)} does nothing in an --env-config run (its rows are environment seeds, "
                f"its rewards their returns); drop it"
            )
    if values.get("max_staleness", 0) > 0:  # generate.py has no placement group
        raise UsageError(
            "--max-staleness: an environment's next prompt is known only once it has stepped, so "
            "nothing can be sampled ahead; use 0 with --env-config"
        )
    unknown = [t for t in args.env_tags if t not in config.specs]
    if unknown:
        raise UsageError(
            f"--env-tags {' '.join(unknown)}: not in --env-config {args.env_config} "
            f"(its tags: {', '.join(config.tags)})"
        )
    tags = list(args.env_tags) or config.tags
    if len(set(tags)) < len(tags):
        raise UsageError(f"--env-tags {' '.join(tags)}: a tag is named twice")
    groups = values.get("env_n_groups")  # None in generate.py, which plays every tag's held-out seeds
    if groups:
        if len(groups) != len(tags):
            raise UsageError(f"--env-n-groups {' '.join(map(str, groups))}: one number per tag ({', '.join(tags)})")
        if sum(groups) != args.train_batch_size:
            raise UsageError(
                f"--env-n-groups {' '.join(map(str, groups))}: sums to {sum(groups)}, not "
                f"--train-batch-size {args.train_batch_size} (groups a step)"
            )
    elif groups is not None and args.train_batch_size % len(tags):  # no --env-n-groups: an even split
        raise UsageError(
            f"--train-batch-size {args.train_batch_size} groups cannot be split evenly over the "
            f"{len(tags)} tags {', '.join(tags)}; pass --env-n-groups with one number per tag"
        )
    if values.get("env_train_seeds", 0) >= 10**9:
        raise UsageError(f"--env-train-seeds {args.env_train_seeds}: must be below 10^9, where validation seeds begin")
    if args.env_manager:
        file, _, cls = args.env_manager.partition(":")
        if not Path(file).expanduser().is_file() or not cls:
            raise UsageError(f"--env-manager {args.env_manager}: expected path/to/file.py:Class of an existing file")


def parse_action(text: str, spec: EnvSpec) -> str | None:
    """The action a reply names: the first match of the tag's action_pattern (its first group,
    stripped), as the tag's own spelling when it lists `actions` (matched ignoring case); None when
    nothing parses."""
    match = re.search(spec.action_pattern, text, re.DOTALL)
    if match is None or match.group(1) is None:
        return None
    action = match.group(1).strip()
    if spec.actions is None:
        return action or None
    return next((a for a in spec.actions if a.lower() == action.lower()), None)


def first_messages(spec: EnvSpec, observation: str) -> list[dict]:
    """A trajectory's prompt: the tag's system prompt, when it has one, then the first observation."""
    system = [{"role": "system", "content": spec.system_prompt}] if spec.system_prompt else []
    return system + [{"role": "user", "content": observation}]


def check_envs(pool, config: EnvConfig, rows: list[dict], tokenizer, max_prompt_length: int) -> None:
    """Before any model loads: every tag of `rows` (training and validation, from
    common.agents.envs.env_rows) resets twice with its first seed of each split in the environment
    workers, and must give the same text both times (a group shares its start); with listed
    actions, one step with the first of them; the first prompt must fit --max-prompt-length.
    Anything else is a UsageError naming the tag, the seed and what went wrong."""
    from common.data import render_chat  # the trainer's (torch); a worker imports this module without it

    picked = {}
    for row in rows:
        picked.setdefault((row["data_source"], row["extra_info"]["split"]), row)
    tasks = []
    for k, row in enumerate(picked.values()):
        tag, seed = row["data_source"], row["env_seed"]
        tasks += [("reset", f"check-{k}-a", tag, seed), ("reset", f"check-{k}-b", tag, seed)]
    results, failures, _ = pool.run(tasks, slots=[0] * len(tasks))
    steps = []
    for k, row in enumerate(picked.values()):
        tag, seed = row["data_source"], row["env_seed"]
        where = f"--env-config {config.path}: envs.{tag}"
        for i in (2 * k, 2 * k + 1):
            if i in failures:
                reason = "it did not answer within the --env-timeout" if failures[i] == "timeout" else failures[i]
                raise UsageError(f"{where}: reset(seed={seed}) failed in its worker: {reason}")
        (first, _), (second, _) = results[2 * k], results[2 * k + 1]
        if first != second:
            raise UsageError(
                f"{where}: reset(seed={seed}) twice gave two observations ({first[:40]!r}, {second[:40]!r}); a group "
                f"shares one seed, so reset must be deterministic in the seed"
            )
        prompt = render_chat(tokenizer, first_messages(config.specs[tag], first), add_generation_prompt=True)
        if len(prompt) > max_prompt_length:
            raise UsageError(
                f"{where}: the first prompt (system prompt and the observation of seed {seed}) is {len(prompt)} "
                f"tokens, over --max-prompt-length {max_prompt_length}; raise it"
            )
        if config.specs[tag].actions:
            steps.append((where, config.specs[tag].actions[0], ("step", f"check-{k}-a", config.specs[tag].actions[0])))
    results, failures, _ = pool.run([task for *_, task in steps], slots=[0] * len(steps))
    for i, (where, action, _) in enumerate(steps):
        if i in failures:
            reason = "it did not answer within the --env-timeout" if failures[i] == "timeout" else failures[i]
            raise UsageError(f"{where}: step({action!r}) after a reset failed in its worker: {reason}")
    pool.run([("close", f"check-{k}-{x}") for k in range(len(picked)) for x in "ab"], slots=[0] * 2 * len(picked))


# --- the environments, in a worker process ------------------------------------------------------------
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _text_adapter_class():
    import gymnasium

    class TextAdapter(gymnasium.Wrapper):
        """A Gymnasium environment with a Discrete action space as a text one: the action is one
        of `actions` by name (action i is the i-th name), the observation is render(env,
        observation) when given, else the environment's ansi rendering (colour codes removed),
        else str(observation)."""

        def __init__(self, env, actions: list[str], render=None):
            super().__init__(env)
            if not isinstance(env.action_space, gymnasium.spaces.Discrete):
                raise TypeError(f"its action space is {env.action_space}, not Discrete: write a text environment")
            if env.action_space.n != len(actions):
                raise TypeError(f"it has {env.action_space.n} actions, and actions: names {len(actions)}")
            self.names, self.render_text = [a.lower() for a in actions], render

        def text(self, observation) -> str:
            if self.render_text is not None:
                return self.render_text(self.env, observation)
            if self.env.render_mode == "ansi":
                return _ANSI.sub("", self.env.render())
            return str(observation)

        def reset(self, *, seed=None, options=None):
            observation, info = self.env.reset(seed=seed, options=options)
            return self.text(observation), info

        def step(self, action: str):
            observation, reward, terminated, truncated, info = self.env.step(self.names.index(action.lower()))
            return self.text(observation), reward, terminated, truncated, info

    return TextAdapter


def make_env(spec: EnvSpec):
    """A new environment of `spec` (in a worker: this imports the user's file or Gymnasium's id)."""
    if spec.from_file:
        return load_from_file(spec.env, "--env-config", "", kind="class")(**spec.kwargs)
    import gymnasium

    try:
        env = gymnasium.make(spec.env, **spec.kwargs)
    except gymnasium.error.Error as e:
        raise UsageError(f"--env-config: envs.{spec.tag}: gymnasium.make({spec.env!r}) failed: {e}") from None
    render = load_from_file(spec.render, "--env-config", "") if spec.render else None
    return _text_adapter_class()(env, spec.actions, render)


def _plain_info(info) -> dict:
    """The JSON-like scalars of an info dict (numpy scalars as Python's): what leaves the worker."""
    out = {}
    for key, value in (info or {}).items():
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            value = value.item()
        if isinstance(value, bool | int | float | str):
            out[str(key)] = value
    return out


def _observation(spec: EnvSpec, value, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(
            f"envs.{spec.tag}: {where} returned a {type(value).__name__} observation, not text; a text environment "
            f"returns str (or give a Gymnasium id with actions: and render:)"
        )
    return value


class EnvHost:
    """What an environment worker runs: the live environments of the trajectories pinned to this
    worker, by trajectory id. Environments are reused across trajectories (reset with the next
    seed) up to max_traj_per_env times (-1: no limit), then closed and made anew. Every result
    is plain data: text, floats, bools and info's scalars."""

    LOST = "trajectory not in this worker"  # its worker was replaced since: rebuilt by replay

    def __init__(self, config_path: str, max_traj_per_env: int = -1):
        self.specs = read_env_config(config_path).specs
        self.max_traj = max_traj_per_env
        self.live: dict[str, tuple[str, object]] = {}  # trajectory id -> (tag, env)
        self.idle: dict[str, list] = {}  # tag -> environments free for another trajectory
        self.uses: dict[int, int] = {}  # id(env) -> trajectories started on it

    def __call__(self, method: str, trajectory: str, *args):
        if method == "reset":
            return self.reset(trajectory, *args)
        if method == "step":
            return self.step(trajectory, *args)
        if method == "replay":
            return self.replay(trajectory, *args)
        if method == "close":
            return self.close(trajectory)
        raise ValueError(f"unknown method {method!r}")

    def _take(self, tag: str):
        free = self.idle.get(tag) or []
        env = free.pop() if free else make_env(self.specs[tag])
        self.uses[id(env)] = self.uses.get(id(env), 0) + 1
        return env

    def reset(self, trajectory: str, tag: str, seed: int) -> tuple[str, dict]:
        self.close(trajectory)
        env = self._take(tag)
        self.live[trajectory] = (tag, env)
        observation, info = env.reset(seed=seed)
        return _observation(self.specs[tag], observation, f"reset(seed={seed})"), _plain_info(info)

    def step(self, trajectory: str, action: str) -> tuple[str, float, bool, bool, dict]:
        if trajectory not in self.live:
            raise LookupError(self.LOST)
        tag, env = self.live[trajectory]
        observation, reward, terminated, truncated, info = env.step(action)
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"envs.{tag}: step({action!r}) returned the reward {reward}")
        text = _observation(self.specs[tag], observation, f"step({action!r})")
        return text, reward, bool(terminated), bool(truncated), _plain_info(info)

    def replay(self, trajectory: str, tag: str, seed: int, actions: list[str]) -> tuple[list[str], tuple | None]:
        """Rebuild a trajectory whose environment was lost with its worker: reset(seed), then its
        actions again. Returns every observation along the way and the last step's result."""
        observation, _ = self.reset(trajectory, tag, seed)
        observations, last = [observation], None
        for action in actions:
            last = self.step(trajectory, action)
            observations.append(last[0])
        return observations, last

    def close(self, trajectory: str) -> str:
        tag, env = self.live.pop(trajectory, (None, None))
        if env is None:
            return ""
        if self.max_traj < 0 or self.uses[id(env)] < self.max_traj:
            self.idle.setdefault(tag, []).append(env)
        else:
            self.uses.pop(id(env), None)
            env.close()
        return ""


def load_env_host(spec: str) -> EnvHost:
    """In a worker process: the EnvHost of a pool spec "<max_traj_per_env>:<config path>"."""
    max_traj, _, path = spec.partition(":")
    return EnvHost(path, int(max_traj))


VAL_SEED_OFFSET = 10**9  # an environment run's validation seeds start here; training seeds stay below


def env_tags(env) -> list[str]:
    """The env group's --env-tags, else every tag of its --env-config."""
    return list(env.env_tags) or read_env_config(env.env_config).tags


def play_rows(env, train_batch_size: int) -> tuple:
    """env_rows of the env group's run: its tags, their groups a step (--env-n-groups, or train_batch_size split
    evenly over the tags) and its training and validation seeds."""
    tags = env_tags(env)
    groups = list(env.env_n_groups) or [train_batch_size // len(tags)] * len(tags)
    return env_rows(env.env_config, tags, groups, env.env_train_seeds, env.env_val_seeds)


def env_rows(config: str, tags: list[str], n_groups: list[int], train_seeds: int, val_seeds: int) -> tuple:
    """(training rows, LoadStats, validation rows) of an --env-config run: one row per tag and seed,
    played by common.agents.env_manager (sampling.n trajectories a row, all reset with its seed).
    Training rows come in batches of sum(n_groups) rows, n_groups[k] of tags[k] (ROLL's n_groups),
    with the seeds 0 .. train_seeds-1 in row order, so each step's batch holds every tag's share and
    each seed is played once an epoch (train in this order: the seeds are the randomness).
    Validation: val_seeds held-out seeds of every tag, from VAL_SEED_OFFSET."""
    from common.data import DataError, LoadStats  # the trainer's (torch); a worker imports this module without it

    batch = sum(n_groups)
    if train_seeds < batch:
        raise DataError(f"--env-train-seeds {train_seeds}: fewer than one batch of {batch} groups")

    def row(tag: str, seed: int, split: str, index: int) -> dict:
        return {
            "data_source": tag,
            "agent_name": "env",
            "env_seed": seed,
            "ground_truth": None,
            "extra_info": {"split": split, "index": index},
            "prompt_ids": None,
            "messages": None,
            "file": f"--env-config {config}",
            "row": index,
        }

    train = []
    for b in range(train_seeds // batch):
        shares = [(tag, sum(n_groups[:k]), n) for k, (tag, n) in enumerate(zip(tags, n_groups))]
        train += [
            row(tag, b * batch + start + i, "train", b * batch + start + i)
            for tag, start, n in shares
            for i in range(n)
        ]
    val = [
        row(tag, VAL_SEED_OFFSET + i, "val", k * val_seeds + i) for k, tag in enumerate(tags) for i in range(val_seeds)
    ]
    shares = ", ".join(f"{n} {tag}" for tag, n in zip(tags, n_groups))
    stats = LoadStats(
        rows=len(train),
        kept=len(train),
        described=f"{len(train)} environment seeds, groups a step: "
        f"{shares}; validation: {val_seeds} held-out seeds a tag",
    )
    return train, stats, val


def env_metrics(rows: list[tuple], prefix: str = "env") -> dict:
    """Per tag, over the trajectories of every rank (common.agents.env_manager): <prefix>/<tag>/success
    (the share that succeeded), return and env_return (the environment's own rewards, without
    penalties or discount), steps (environment steps), format_errors (replies whose action did not
    parse) and invalid_actions (steps the environment called invalid), per trajectory; errors and
    timeouts (trajectories whose environment failed), counts. Collective."""
    from common.parallel import gather_objects  # the trainer's (torch); a worker imports this module without it

    mine = [c.extra_info["env"] for _, c in rows]
    played = [e for part in gather_objects(mine) for e in part]
    metrics = {}
    for tag in sorted({e["tag"] for e in played}):
        of = [e for e in played if e["tag"] == tag]
        for key in ("success", "return", "env_return", "steps", "format_errors", "invalid_actions"):
            metrics[f"{prefix}/{tag}/{key}"] = sum(float(e[key]) for e in of) / len(of)
        for key in ("errors", "timeouts"):
            metrics[f"{prefix}/{tag}/{key}"] = sum(e[key] for e in of)
    return metrics
