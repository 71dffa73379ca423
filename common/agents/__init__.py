"""Multi-turn rollouts, a feature: tools and interactions read from verl's YAML (tools), the loop that plays a
conversation with them over any engine (agent), Gymnasium text environments (envs) and ROLL's environment manager
that plays groups of them (env_manager). This file holds their flag groups, which every run parses; the modules
load only where --tool-config, --interaction-config or --env-config asks (common.rollout, common.rewards)."""

from dataclasses import dataclass
from typing import Literal

from common.flags import flag

TOOLS = (lambda a: a.tool_config or a.interaction_config, "add --tool-config or --interaction-config")
AGENT_FN = "agent_fn"  # the switch of the agent endpoint's knobs
ENV = "env_config"  # the switch of every environment knob (common.flags.flag's only_with)


@dataclass
class AgentArgs:
    """Multi-turn rollouts with tools and interactions (common.agents.agent)."""

    tool_config: str | None = None
    """YAML of tool_agent rows' tools: OpenAI function schemas and path/to/file.py:function (verl's tool config)"""
    interaction_config: str | None = None
    """YAML listing the interactions a row's extra_info.interaction_kwargs names (verl's interaction config)"""
    max_assistant_turns: int = flag(5, ge=1, only_with=TOOLS)
    """tool_agent: most assistant turns in one conversation"""
    max_user_turns: int = flag(5, ge=1, only_with="interaction_config")
    """tool_agent: most interaction replies in one conversation"""
    tool_timeout: float = flag(10.0, gt=0, unit="seconds", only_with=TOOLS)
    """tool_agent: seconds a tool call may take before the model is told (an interaction's ends the conversation)"""
    tokenization_sanity_check_mode: Literal["strict", "ignore_strippable", "off"] = flag("strict", only_with=TOOLS)
    """tool_agent: compare the turn-by-turn tokens with the whole conversation tokenised at once"""

    @property
    def on(self) -> bool:
        return bool(self.tool_config or self.interaction_config)


@dataclass
class RLAgentArgs(AgentArgs):
    """RLArgs' `agent` group: the agent loop's tools and interactions, or an agent of the user's on the run's endpoint."""

    agent_fn: str | None = None
    """path/to/file.py:function, your agent: fn(client, row) talks to the policy through an openai client on the
    run's OpenAI-compatible endpoint and returns the reward; each row's --rollout-n calls are its group, trained token
    for token (common.agents.endpoint; pip install -e ".[agents]")"""
    agent_timeout: float = flag(300.0, gt=0, unit="seconds", only_with=AGENT_FN)
    """agent: seconds one call may take before its trajectory ends, counted (its tokens kept out of the loss)"""
    agent_workers: int = flag(8, ge=1, only_with=AGENT_FN)
    """agent: worker processes per rank that run the calls, as many at once"""
    endpoint_host: str = flag("127.0.0.1", only_with=AGENT_FN)
    """agent: the address the endpoint listens on (127.0.0.1: this machine only; every request needs the run's key)"""
    endpoint_port: int = flag(0, ge=0, le=65535, note="0: any free port", only_with=AGENT_FN)
    """agent: the endpoint's port (0: any free one)"""


@dataclass
class EnvPlayArgs:
    """How environments are played (common.agents.envs, common.agents.env_manager): generate.py's `env` group."""

    env_config: str | None = None
    """YAML naming Gymnasium environments to play instead of prompts: tag -> path/to/file.py:Class or a Gymnasium
    id (ROLL's custom_envs; docs/environments.md)"""
    env_tags: tuple[str, ...] = flag((), only_with=ENV)
    """environment: the tags of --env-config to play (default: all; ROLL's tags)"""
    env_val_seeds: int = flag(64, ge=0, note="0: no validation", only_with=ENV)
    """environment: held-out seeds of each tag played in each validation (generate.py: played in all)"""
    max_env_steps: int = flag(10, ge=1, only_with=ENV)
    """environment: most turns (actions) of a trajectory (ROLL's max_actions_per_traj)"""
    format_penalty: float = flag(0.0, le=0, note="a penalty: ROLL's is negative", only_with=ENV)
    """environment: reward added to a turn whose action does not parse, <= 0 (ROLL's format_penalty)"""
    max_traj_per_env: int = flag(-1, rule=(lambda v: v == -1 or v >= 1, "-1 (no limit) or >= 1"), only_with=ENV)
    """environment: trajectories per environment before it is made anew (-1: no limit; ROLL's max_traj_per_env)"""
    env_manager: str | None = flag(None, only_with=ENV)
    """environment: path/to/file.py:Class subclassing common.agents.env_manager.EnvLoop, to play instead (ROLL's
    worker_cls)"""
    env_gamma: float = flag(1.0, ge=0, le=1, only_with=ENV)
    """environment: discount of the per-turn rewards in a trajectory's return"""
    env_timeout: float = flag(10.0, gt=0, unit="seconds", only_with=ENV)
    """environment: seconds a reset or step may take before its trajectory ends, counted in env/<tag>/timeouts"""
    env_workers: int = flag(2, ge=1, only_with=ENV)
    """environment: worker processes per rank that run the environments"""


@dataclass
class EnvArgs(EnvPlayArgs):
    """RLArgs' `env` group: how environments are played, a step's groups and an epoch's seeds."""

    env_n_groups: tuple[int, ...] = flag((), ge=1, only_with=ENV)
    """environment: groups a step of each tag, summing to --train-batch-size (default: split evenly; ROLL's
    n_groups)"""
    env_train_seeds: int = flag(10000, ge=1, only_with=ENV)
    """environment: training seeds 0..N-1, each played once an epoch"""
