"""What --tool-config and --interaction-config declare, read and checked without running any of
their code; the loaders that import it (in worker processes only); and the tool calls a model
writes. The agent loop that uses them is common.agents.agent.

Tools are an OpenAI-style function schema plus a Python function, listed in --tool-config (YAML):

    tools:
      - function: tools/calculator.py:add          # path/to/file.py:function_name
        tool_schema:                               # verl's key, OpenAI's function schema
          type: function
          function: {name: add, description: Add two integers, parameters: {...}}

or, as verl writes them, a tool class with verl's lifecycle (create / execute / calc_reward /
release, plain or async), one instance per conversation, given the row's extra_info.tools_kwargs:

      - class_name: tools/search.py:SearchTool     # path/to/file.py:Class, or package.module.Class
        config: {top_k: 3}                         # the class's config
        tool_schema: {...}

Calls are read from the text in the Hermes format Qwen uses,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
"""

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import UsageError
from common.scoring import load_from_file

log = logging.getLogger(__name__)

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


# --- tool calls -------------------------------------------------------------------------------------
def parse_tool_calls(text: str) -> tuple[list[dict], list[str]]:
    """The Hermes-format calls in an assistant turn: ([{"name", "arguments"}], [what was wrong
    with each malformed one])."""
    calls, errors = [], []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(f"the tool call is not valid JSON ({e.msg}): {body.strip()[:200]}")
            continue
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some models send the arguments JSON-encoded once more
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            errors.append(f'a tool call needs {{"name": "...", "arguments": {{...}}}}, got: {body.strip()[:200]}')
            continue
        calls.append({"name": call["name"], "arguments": arguments})
    if text.count("<tool_call>") > text.count("</tool_call>"):
        errors.append("a <tool_call> was not closed with </tool_call>")
    return calls, errors


@dataclass
class ToolConfig:
    """What --tool-config declares: the schemas (for the chat template and the checks here) and
    where each function lives (imported only in the worker processes)."""

    path: str
    schemas: list[dict]
    functions: dict[str, str]  # tool name -> "file.py:function"
    classes: dict[str, tuple[str, dict]] = field(default_factory=dict)  # tool name -> (its class, the class's config)

    @property
    def names(self) -> list[str]:
        return [*self.functions, *self.classes]


def read_yaml_section(path: str, flag: str, key: str, kind: type, expected: str) -> tuple[Path, list | dict]:
    """The config file and its top-level `key:` (a non-empty `kind`, list or dict), read without
    running anything; any other top-level key is refused. `expected` says what `key:` should hold."""
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        raise UsageError(f"{flag} {path}: file does not exist")
    try:
        config = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        raise UsageError(f"{flag} {path}: not valid YAML ({e})") from None
    items = config.get(key) if isinstance(config, dict) else None
    if not isinstance(items, kind) or not items:
        raise UsageError(f"{flag} {path}: expected a top-level `{key}:` {expected}")
    if other := sorted(set(config) - {key}, key=str):
        raise UsageError(f"{flag} {path}: unknown top-level key(s) {', '.join(map(str, other))}; only `{key}:` is read")
    return file, items


def _only_keys(item, allowed: tuple[str, ...], where: str) -> None:
    """An entry's keys that nothing reads are an error, not silently ignored."""
    if isinstance(item, dict) and (other := sorted(set(item) - set(allowed))):
        raise UsageError(f"{where}: unknown key(s) {', '.join(map(str, other))}; an entry has {', '.join(allowed)}")


def class_target(target, file: Path, where: str, name: str) -> str:
    """A class_name as the worker loads it: path/to/file.py:Class (relative to the config file,
    which must exist) or verl's package.module.Class, checked without importing anything."""
    if not isinstance(target, str) or not target:
        raise UsageError(f"{where} ({name}): class_name must be path/to/file.py:Class or package.module.Class")
    if ":" in target:
        source = Path(target.partition(":")[0]).expanduser()
        source = source if source.is_absolute() else file.parent / source
        if not source.is_file():
            raise UsageError(f"{where} ({name}): file {target.partition(':')[0]!r} does not exist")
        return f"{source}:{target.partition(':')[2]}"
    if "." not in target:
        raise UsageError(f"{where} ({name}): class_name {target!r} is neither file.py:Class nor package.module.Class")
    return target


def load_class(target: str, flag: str):
    """In a worker process: the class a class_target names, imported (the user's own code)."""
    import importlib

    if ":" in target:
        return load_from_file(target, flag, "", kind="class")
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)


def read_tool_config(path: str) -> ToolConfig:
    """Read and check --tool-config without running any of its code."""
    file, tools = read_yaml_section(path, "--tool-config", "tools", list, "list with at least one tool")
    schemas, functions, classes = [], {}, {}
    for i, tool in enumerate(tools):
        where = f"--tool-config {path}: tools[{i}]"
        _only_keys(tool, ("function", "class_name", "config", "tool_schema"), where)
        schema = tool.get("tool_schema") if isinstance(tool, dict) else None
        name = ((schema or {}).get("function") or {}).get("name") if isinstance(schema, dict) else None
        if not isinstance(name, str) or not name:
            raise UsageError(f"{where}: needs tool_schema: {{type: function, function: {{name: ..., ...}}}}")
        if name in functions or name in classes:
            raise UsageError(f"{where}: a second tool named {name!r}")
        if ("function" in tool) == ("class_name" in tool):
            raise UsageError(
                f"{where} ({name}): needs function: path/to/file.py:function_name, or verl's "
                f"class_name: path/to/file.py:Class (or package.module.Class), not both"
            )
        if "class_name" in tool:
            settings = tool.get("config") or {}
            if not isinstance(settings, dict):
                raise UsageError(f"{where} ({name}): config must be a mapping")
            classes[name] = (class_target(tool["class_name"], file, where, name), settings)
        else:
            if "config" in tool:
                raise UsageError(f"{where} ({name}): config is a tool class's; a function tool takes none")
            target = tool.get("function")
            if not isinstance(target, str) or ":" not in target:
                raise UsageError(f"{where} ({name}): needs function: path/to/file.py:function_name")
            source = Path(target.partition(":")[0]).expanduser()
            if not source.is_absolute():
                source = file.parent / source
            if not source.is_file():
                raise UsageError(f"{where} ({name}): file {target.partition(':')[0]!r} does not exist")
            functions[name] = f"{source}:{target.partition(':')[2]}"
        schemas.append(schema)
    return ToolConfig(str(file), schemas, functions, classes)


def _runner():
    """run(value): value itself, or an awaitable's result on one event loop kept for the worker's
    life (verl's tools and interactions may be async and keep loop-bound state)."""
    import asyncio
    import inspect

    loop = asyncio.new_event_loop()

    def run(value):
        return loop.run_until_complete(value) if inspect.isawaitable(value) else value

    return run


class ToolSchema(dict):
    """The tool_schema handed to a verl tool class, which reads it as verl's pydantic
    OpenAIFunctionToolSchema (schema.function.name, schema.model_dump()); used when verl is not
    installed (with verl, verl's own class is built)."""

    def __getattr__(self, key):
        try:
            value = self[key]
        except KeyError:
            raise AttributeError(key) from None
        return ToolSchema(value) if isinstance(value, dict) else value

    def model_dump(self, **_) -> dict:
        return dict(self)


def load_tools(path: str):
    """In a worker process: call(op, name, instance_id, arguments, kwargs) on the named tool of
    --tool-config. A function tool answers op "execute" with fn(**arguments) (text) and has no
    other step. A tool class is made once per worker, Class(config, tool_schema), and every
    conversation gets its own instance through verl's methods (plain or async, on one event loop
    for the worker's life): "create" -> create(instance_id, **kwargs), its id; "execute" ->
    execute(instance_id, arguments, **kwargs) as (text, step reward, numeric metrics); "calc_reward"
    -> calc_reward(instance_id, **kwargs) as a float; "release" -> release(instance_id, **kwargs)."""
    import math

    config = read_tool_config(path)
    functions = {name: load_from_file(target, "--tool-config", "") for name, target in config.functions.items()}
    try:
        from verl.tools.schemas import OpenAIFunctionToolSchema as schema_class  # noqa: N813
    except ImportError:
        schema_class = None
    by_name = {s["function"]["name"]: s for s in config.schemas}
    instances = {}
    for name, (target, settings) in config.classes.items():
        schema = schema_class.model_validate(by_name[name]) if schema_class else ToolSchema(by_name[name])
        instances[name] = load_class(target, "--tool-config")(settings, schema)
    run = _runner()

    def text_of(value, what: str) -> str:
        value = getattr(value, "text", value)  # newer verl answers with a ToolResponse
        if not isinstance(value, str):
            raise TypeError(f"{what} must return a str (the text the model reads), got {type(value).__name__}")
        return value

    def call(op: str, name: str, instance_id: str | None, arguments: dict | None, kwargs: dict):
        if name in functions:
            return text_of(functions[name](**arguments), "a tool") if op == "execute" else None
        tool = instances[name]
        if op == "create":
            made = run(tool.create(instance_id, **kwargs))
            made = made[0] if isinstance(made, tuple) else made  # newer verl: (instance_id, ToolResponse)
            return made if isinstance(made, str) and made else instance_id
        if op == "execute":
            result = run(tool.execute(instance_id, arguments, **kwargs))
            if not (isinstance(result, tuple | list) and len(result) == 3):
                raise TypeError(f"{name}.execute must return (response, step reward, metrics), got {str(result)[:120]}")
            reward = float(result[1] or 0.0)
            if not math.isfinite(reward):
                raise ValueError(f"{name}.execute returned the step reward {reward}")
            metrics = {k: float(v) for k, v in (result[2] or {}).items() if isinstance(v, int | float)}
            return text_of(result[0], f"{name}.execute"), reward, metrics
        if op == "calc_reward":
            reward = float(run(tool.calc_reward(instance_id, **kwargs)))
            if not math.isfinite(reward):
                raise ValueError(f"{name}.calc_reward returned {reward}")
            return reward
        run(tool.release(instance_id, **kwargs))
        return None

    return call


# --- interactions -----------------------------------------------------------------------------------
@dataclass
class InteractionConfig:
    """What --interaction-config declares (verl's layout): per name, the class and its config."""

    path: str
    classes: dict[str, tuple[str, dict]]  # name -> ("file.py:Class" or "package.module.Class", config)

    @property
    def names(self) -> list[str]:
        return list(self.classes)


def read_interaction_config(path: str) -> InteractionConfig:
    """Read and check --interaction-config without importing any of its classes:

    interaction:
      - name: grader                           # what a row's extra_info.interaction_kwargs.name picks
        class_name: grader.py:RetryGrader      # path/to/file.py:Class, or verl's package.module.Class
        config: {}                             # passed to the class, with its name added
    """
    file, items = read_yaml_section(path, "--interaction-config", "interaction", list, "list with at least one entry")
    classes = {}
    for i, item in enumerate(items):
        where = f"--interaction-config {path}: interaction[{i}]"
        _only_keys(item, ("name", "class_name", "config"), where)
        name = item.get("name") if isinstance(item, dict) else None
        target = item.get("class_name") if isinstance(item, dict) else None
        if not isinstance(name, str) or not name or not isinstance(target, str) or not target:
            raise UsageError(
                f"{where}: needs name: ... and class_name: path/to/file.py:Class (or package.module.Class)"
            )
        target = class_target(target, file, where, name)
        settings = item.get("config") or {}
        if not isinstance(settings, dict):
            raise UsageError(f"{where} ({name}): config must be a mapping")
        if name in classes:
            raise UsageError(f"{where}: a second interaction named {name!r}")
        classes[name] = (target, settings)
    return InteractionConfig(str(file), classes)


def load_interactions(path: str):
    """In a worker process: call(method, name, instance_id, messages, kwargs) on the named
    interaction of --interaction-config, with verl's methods (plain or async): "start" ->
    start_interaction(instance_id, **kwargs); "respond" -> generate_response(instance_id, messages,
    **kwargs), checked to be (done, message, score, extra) and returned as (done, message, score);
    "finalize" -> finalize_interaction(instance_id, **kwargs) when it takes them."""
    import inspect
    import math

    config = read_interaction_config(path)
    instances = {
        name: load_class(target, "--interaction-config")({**settings, "name": name})
        for name, (target, settings) in config.classes.items()
    }
    run = _runner()

    def call(method: str, name: str, instance_id: str, messages, kwargs: dict):
        interaction = instances[name]
        if method == "start":
            return str(run(interaction.start_interaction(instance_id, **kwargs)) or instance_id)
        if method == "respond":
            result = run(interaction.generate_response(instance_id, messages, **kwargs))
            if not (isinstance(result, tuple | list) and len(result) == 4 and isinstance(result[1], str)):
                raise TypeError(
                    f"{name}.generate_response must return (done, message: str, score, extra), got {str(result)[:120]}"
                )
            score = float(result[2])
            if not math.isfinite(score):
                raise ValueError(f"{name}.generate_response returned the score {score}")
            return bool(result[0]), result[1], score
        finalize = interaction.finalize_interaction
        takes_id = bool(inspect.signature(finalize).parameters)  # verl's base class takes none
        run(finalize(instance_id, **kwargs) if takes_id else finalize())
        return ""

    return call


# --- what a conversation tells the reward ---------------------------------------------------------
def conversation_extra_info(
    row: dict, user_turns: int = 0, assistant_turns: int = 1, turn_scores=(), tool_rewards=None, tool_step_rewards=None
) -> dict | None:
    """What a tool_agent conversation adds to its row's extra_info for the reward function, under
    verl's names: num_turns and rollout_reward_scores (each tool class's calc_reward by tool name,
    and the interaction's user_turn_rewards); and, when a tool class was called, tool_step_rewards,
    each tool class's execute rewards by tool name. None for other rows. The defaults describe a one-turn answer, as the
    reward dry run scores."""
    if (row.get("agent_name") or "single_turn_agent") != "tool_agent":
        return None
    scores = dict(tool_rewards or {})
    if row.get("interaction_kwargs"):
        scores["user_turn_rewards"] = list(turn_scores)
    extra = {"num_turns": user_turns + assistant_turns + 1, "rollout_reward_scores": scores}
    if tool_step_rewards:
        extra["tool_step_rewards"] = {k: list(v) for k, v in tool_step_rewards.items()}
    return extra


def check_agent_rows(
    rows: list[dict], tools: list[dict] | None, interactions: list[str] | None, tool_classes: list[str] = ()
) -> None:
    """What the agent loop (common.agents.agent) needs of prompt rows: a tool_agent row needs tools or
    interactions to act on; a row whose extra_info holds interaction_kwargs (verl's) must be a
    tool_agent row naming an interaction of --interaction-config (the name may be left out when
    there is one). Sets each row's interaction_kwargs (None without), its name filled in.
    extra_info.tools_kwargs (verl's per-row arguments to a tool class's create / execute /
    calc_reward / release, by tool name) must name tool classes of --tool-config (tool_classes) on
    a tool_agent row: a function tool takes only the arguments the model writes; rows that run no
    tools (as in verl, which reads it only in its tool agent) are counted in a warning."""
    from common.data import DataError  # the trainer's (torch); a worker imports this module without it

    idle_tools_kwargs = 0
    steps = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")
    for r in rows:
        where = f"{r['file']} row {r['row']}"
        extra = r["extra_info"] if isinstance(r["extra_info"], dict) else {}
        per_tool = extra.get("tools_kwargs")
        if per_tool and r["agent_name"] == "tool_agent":
            column = f"{where} column 'extra_info.tools_kwargs'"
            if not isinstance(per_tool, dict):
                raise DataError(f"{column}: expected a mapping of tool name -> {{create_kwargs: ..., ...}}")
            for name, kwargs in per_tool.items():
                if name not in tool_classes:
                    functions = {t["function"]["name"] for t in tools or ()}
                    kind = "not a tool of --tool-config"
                    if name in functions:
                        kind = "a function tool, which takes only the arguments the model writes"
                    raise DataError(
                        f"{column}: {name!r} is {kind}; per-row arguments go to verl's tool classes "
                        f"(class_name in --tool-config; they have: {', '.join(tool_classes) or 'none'})"
                    )
                if not isinstance(kwargs, dict) or not all(
                    k in steps and isinstance(v, dict | None) for k, v in kwargs.items()
                ):
                    raise DataError(
                        f"{column}.{name}: expected a mapping with any of {', '.join(steps)}, each a "
                        f"mapping, got {str(kwargs)[:80]!r}"
                    )
        idle_tools_kwargs += bool(per_tool) and r["agent_name"] != "tool_agent"
        kwargs = extra.get("interaction_kwargs")
        r["interaction_kwargs"] = None
        if kwargs is not None:
            if not isinstance(kwargs, dict):
                raise DataError(
                    f"{where} column 'extra_info.interaction_kwargs': expected a mapping with a name, "
                    f"got {str(kwargs)[:80]!r}"
                )
            if not interactions:
                raise DataError(
                    f"{where}: extra_info.interaction_kwargs names an interaction; pass "
                    f"--interaction-config interactions.yaml (docs/multi-turn.md describes the file)"
                )
            name = kwargs.get("name") or (interactions[0] if len(interactions) == 1 else None)
            if name not in interactions:
                raise DataError(
                    f"{where} column 'extra_info.interaction_kwargs.name': {name!r} is not in "
                    f"--interaction-config (it has {', '.join(interactions)})"
                )
            if r["agent_name"] != "tool_agent":
                raise DataError(
                    f"{where}: interaction_kwargs need agent_name tool_agent (the agent that runs "
                    f"interactions), not {r['agent_name']}"
                )
            r["interaction_kwargs"] = {**kwargs, "name": name}
        if r["agent_name"] == "tool_agent" and not tools and not interactions:
            raise DataError(
                f"{where} column 'agent_name': tool_agent rows need tools or interactions: pass "
                f"--tool-config tools.yaml and/or --interaction-config (docs/multi-turn.md describes "
                f"both files)"
            )
    if idle_tools_kwargs:
        log.warning(
            "%d rows carry extra_info.tools_kwargs but are not tool_agent rows, so no tool runs for them and it "
            "is unused (as in verl); set agent_name tool_agent to run tools",
            idle_tools_kwargs,
        )


def check_rows(rows: list[dict], agent) -> None:
    """check_agent_rows against the agent group's --tool-config and --interaction-config."""
    tools = read_tool_config(agent.tool_config) if agent.tool_config else None
    interactions = read_interaction_config(agent.interaction_config).names if agent.interaction_config else None
    check_agent_rows(rows, tools.schemas if tools else None, interactions, list(tools.classes) if tools else [])
