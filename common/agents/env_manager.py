"""ROLL's environment manager on Gymnasium's API, over any engine of common.engines.

Rows of an --env-config run (common.agents.envs.env_rows) each name a tag and a seed. For every row,
sampling.n trajectories (the group: train_batch_size groups of rollout_n, ROLL's env_groups x
group_size) reset with the row's seed, so a group starts from one state. Each turn, every live
trajectory of every group samples an assistant reply at once; the action it names
(common.agents.envs.parse_action) steps its environment in the environment workers, and the observation
comes back as the next user message, until the environment terminates or truncates, the
trajectory has had --max-env-steps turns, or the response budget (--max-response-length) is spent.
A reply whose action does not parse does not step the environment: its turn gets --format-penalty
and the model sees the observation again, behind the tag's invalid_action_text.

The trainer sees each trajectory as one response after the prompt (system prompt and first
observation); its mask marks only the tokens the policy sampled, so observations never enter the
loss. Its reward is the return: sum over turns t of gamma^t (r_t + penalty_t), r_t the
environment's reward (--env-gamma, default 1: the plain sum).

Environments run in worker processes (common.rewards.RewardPool with common.agents.envs.EnvHost), each
trajectory pinned to one worker for its life. An environment that raises, hangs past
--env-timeout or kills its worker ends that trajectory, counted in env/<tag>/errors or timeouts,
and the trajectory is left out of the loss (its mask is zeroed: the policy did nothing wrong).
The other trajectories of a replaced worker are rebuilt in the new one by replay (reset with their
seed, then their actions again), checked against the observations they saw; one whose replay
differs ends as an error too.

A user's own manager (--env-manager path/to/file.py:Class, ROLL's worker_cls) subclasses EnvLoop
and overrides what it changes: first_messages (the prompt), next_message (what a turn shows), or
parse (the action of a reply).
"""

import logging
import uuid
from dataclasses import dataclass, field, replace

from common.agents.agent import between_turns
from common.agents.envs import EnvHost, EnvSpec, first_messages, parse_action, read_env_config
from common.data import render_chat
from common.engines import Completion, Sampling
from common.errors import UsageError
from common.parallel import all_reduce_max

log = logging.getLogger(__name__)


@dataclass
class Trajectory:
    """One trajectory: its environment's history and everything after the prompt."""

    row: dict
    id: str
    slot: int  # the environment worker holding its environment
    spec: EnvSpec
    messages: list[dict] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # after the prompt
    mask: list[int] = field(default_factory=list)  # 1: sampled by the policy
    logprobs: list[float] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)  # the engine's kept counts (common.engines.Completion), 0: all
    observations: list[str] = field(default_factory=list)  # the first, then one per environment step
    actions: list[str] = field(default_factory=list)  # the actions that stepped the environment
    turn_rewards: list[float] = field(default_factory=list)  # per turn: the environment's reward and penalty
    env_rewards: list[float] = field(default_factory=list)  # per environment step, as it gave them
    format_errors: int = 0  # turns whose action did not parse
    invalid_actions: int = 0  # steps the environment called invalid (info["action_is_valid"] False)
    error: str | None = None  # "error" or "timeout": its environment failed, and it ends
    pending: str | None = None  # the action of the last reply, None when it named none
    success: bool = False
    finish_reason: str = "stop"
    done: bool = False

    @property
    def tag(self) -> str:
        return self.spec.tag

    @property
    def seed(self) -> int:
        return self.row["env_seed"]

    def add(self, tokens: list[int], sampled: bool, logprobs: list[float] | None = None, kept=None) -> None:
        self.tokens += tokens
        self.mask += [int(sampled)] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.kept += kept if kept is not None else [0] * len(tokens)

    def completion(self, gamma: float, eos_id: int) -> Completion:
        """As the trainer takes it: extra_info["env"] holds the return and the counts. A trajectory
        whose environment failed keeps its tokens but none in the loss."""
        ret = sum(gamma**t * r for t, r in enumerate(self.turn_rewards))
        tokens, logprobs, kept = (self.tokens, self.logprobs, self.kept) if self.tokens else ([eos_id], [0.0], [0])
        mask = [0] * len(tokens) if self.error or not self.tokens else self.mask
        env = dict(
            tag=self.tag,
            seed=self.seed,
            success=bool(self.success),
            steps=len(self.actions),
            turns=len(self.turn_rewards),
            format_errors=self.format_errors,
            invalid_actions=self.invalid_actions,
            env_return=sum(self.env_rewards),
            errors=int(self.error == "error"),
            timeouts=int(self.error == "timeout"),
        )
        env["return"] = ret
        kept = kept if any(kept) else None
        return Completion(tokens, logprobs, self.finish_reason, mask=mask, extra_info={"env": env}, kept=kept)


class EnvLoop:
    """The environment manager over an engine: generate_rows(rows, sampling) plays env rows;
    everything else (generate, update_weights, the lifecycle, weight_version) is the engine's.

    env: the env group (--env-config's environments, --max-env-steps, --format-penalty, --env-gamma); pool: the
    environment workers (common.rewards.RewardPool over an EnvHost); max_prompt_length: the longest first prompt
    (system prompt and first observation) a trajectory may have (common.agents.envs.check_envs tries a seed per tag
    and split before the run; any other seed is held to it here); lockstep: every rank calls the engine equally
    often (needed when its generate is collective, as in training)."""

    def __init__(self, engine, tokenizer, env, pool, max_prompt_length: int | None = None, lockstep: bool = True):
        self.engine, self.tokenizer, self.config, self.pool = engine, tokenizer, read_env_config(env.env_config), pool
        self.max_steps, self.penalty, self.gamma = env.max_env_steps, env.format_penalty, env.env_gamma
        self.max_length, self.max_prompt, self.lockstep = 0, max_prompt_length, lockstep
        self.eos_id = tokenizer.eos_token_id
        self.reported = set()  # failures already shown once

    def __getattr__(self, name):  # update_weights, sleep, wake_up, reset_cache, weight_version, stats, ...
        return getattr(self.engine, name)

    def generate(self, prompts, sampling: Sampling):
        return self.engine.generate(prompts, sampling)

    # --- what a user's manager may override ---------------------------------------------------------
    def first_messages(self, spec: EnvSpec, observation: str) -> list[dict]:
        """The prompt of a trajectory (common.agents.envs.first_messages: system prompt, first observation)."""
        return first_messages(spec, observation)

    def next_message(self, trajectory: Trajectory, observation: str, parsed: bool) -> dict:
        """The user message after a turn: the new observation, or after a reply whose action did
        not parse, the tag's invalid_action_text and the observation again."""
        text = observation if parsed else f"{trajectory.spec.invalid_action_text}\n{observation}"
        return {"role": "user", "content": text}

    def parse(self, trajectory: Trajectory, reply: str) -> str | None:
        """The action a reply names, None when it names none (common.agents.envs.parse_action)."""
        return parse_action(reply, trajectory.spec)

    # --- the loop -------------------------------------------------------------------------------------
    def generate_rows(self, rows: list[dict], sampling: Sampling) -> list[list[Completion]]:
        """sampling.n trajectories per row, each as one Completion of at most sampling.max_tokens tokens; sets each
        row's prompt_ids and messages (the group's shared start)."""
        n, workers = sampling.n, len(self.pool.workers)
        self.max_length = sampling.max_tokens  # a trajectory's room, observations included
        trajectories = [
            Trajectory(row, uuid.uuid4().hex, k % workers, self.config.specs[row["data_source"]])
            for k, row in enumerate(r for r in rows for _ in range(n))
        ]
        self._run([("reset", t.id, t.tag, t.seed) for t in trajectories], trajectories, self._reset)
        for i, row in enumerate(rows):
            self._set_prompt(row, trajectories[i * n : (i + 1) * n])
        reduce = all_reduce_max if self.lockstep else (lambda value: value)
        while True:
            active = [t for t in trajectories if not t.done]
            count = reduce(len(active))  # every rank samples as often, with as many prompts (fillers dropped)
            if count == 0:
                break
            budget = [self.max_length - len(t.tokens) for t in active]
            # Each conversation generates at most its own room left (a filler 1 token: it is dropped).
            more = replace(
                sampling,
                n=1,
                max_tokens=reduce(max(budget, default=1)),
                budgets=tuple(budget) + (1,) * (count - len(active)),
            )
            filler = rows[0]["prompt_ids"] if rows else [self.eos_id]
            outs = self.engine.generate(
                [t.row["prompt_ids"] + t.tokens for t in active] + [filler] * (count - len(active)), more
            )
            stepping = []
            for t, left, (out,) in zip(active, budget, outs):
                cut = len(out.token_ids) > left or out.finish_reason == "length"
                if self._replied(t, out.token_ids[:left], out.logprobs[:left], cut, out.kept and out.kept[:left]):
                    stepping.append(t)
            self._run([("step", t.id, t.pending) for t in stepping], stepping, self._stepped)
            for t in active:
                self._next_turn(t)
        self._run([("close", t.id) for t in trajectories], trajectories, lambda t, result, failure: None)
        done = [t.completion(self.gamma, self.eos_id) for t in trajectories]
        return [done[i * n : (i + 1) * n] for i in range(len(rows))]

    def _set_prompt(self, row: dict, group: list[Trajectory]) -> None:
        """The group's prompt from its first observation; members that could not reset end empty."""
        started = [t for t in group if t.observations]
        if not started:  # every member's reset failed: an empty prompt-only row, out of the loss
            row["messages"] = self.first_messages(group[0].spec, "")
        else:
            firsts = {t.observations[0] for t in started}
            if len(firsts) > 1:
                raise UsageError(
                    f"--env-config: envs.{row['data_source']}: reset(seed={row['env_seed']}) gave the members of one "
                    f"group different observations; a group shares one seed, so reset must be deterministic in the seed"
                )
            row["messages"] = self.first_messages(group[0].spec, started[0].observations[0])
        row["prompt_ids"] = render_chat(self.tokenizer, row["messages"], add_generation_prompt=True)
        if self.max_prompt is not None and len(row["prompt_ids"]) > self.max_prompt:  # the checks tried other seeds
            raise UsageError(
                f"--env-config: envs.{row['data_source']}: the first prompt of seed {row['env_seed']} is "
                f"{len(row['prompt_ids'])} tokens, over --max-prompt-length {self.max_prompt}; raise it"
            )
        for t in group:
            t.messages = list(row["messages"])

    def _replied(self, t: Trajectory, ids: list[int], logprobs: list[float], cut: bool, kept=None) -> bool:
        """Record a sampled reply; True when its action is to step the environment."""
        t.add(ids, True, logprobs, kept)
        text = self.tokenizer.decode([i for i in ids if i != self.eos_id])
        t.messages.append({"role": "assistant", "content": text})
        t.turn_rewards.append(0.0)
        if cut:  # the reply ran out of budget: no action, and no room for another turn
            t.finish_reason, t.done = "length", True
            return False
        action = self.parse(t, text)
        if action is None:
            t.format_errors += 1
            t.turn_rewards[-1] += self.penalty
            t.pending = None
            return False
        t.pending = action
        return True

    def _reset(self, t: Trajectory, result, failure) -> None:
        if failure:
            self._failed(t, failure, "reset")
            return
        t.observations.append(result[0])

    def _stepped(self, t: Trajectory, result, failure) -> None:
        if failure:
            self._failed(t, failure, f"step({t.pending!r})")
            return
        observation, reward, terminated, truncated, info = result
        t.actions.append(t.pending)
        t.observations.append(observation)
        t.env_rewards.append(reward)
        t.turn_rewards[-1] += reward
        t.invalid_actions += info.get("action_is_valid", True) is False
        if terminated or truncated:
            t.done = True
            t.success = bool(info["success"]) if "success" in info else terminated and sum(t.env_rewards) > 0

    def _failed(self, t: Trajectory, failure: str, what: str) -> None:
        t.error, t.done = ("timeout" if failure == "timeout" else "error"), True
        if (t.tag, t.error) not in self.reported:
            self.reported.add((t.tag, t.error))
            reason = f"no answer within {self.pool.timeout:g}s" if failure == "timeout" else failure
            log.error(
                "envs.%s: %s failed for seed %s (%s); the trajectory ends and is left out of the loss (counted "
                "in env/%s/%ss; shown once)",
                t.tag,
                what,
                t.seed,
                reason,
                t.tag,
                t.error,
            )

    def _next_turn(self, t: Trajectory) -> None:
        """After a turn: the trajectory ends at its turn limit, else the next observation follows."""
        if t.done:
            return
        if len(t.turn_rewards) >= self.max_steps:
            t.done = True
            return
        parsed = t.pending is not None
        message = self.next_message(t, t.observations[-1], parsed)
        between = between_turns(self.tokenizer, t.messages, [message], self.eos_id)
        if len(t.tokens) + len(between) >= self.max_length:
            t.finish_reason, t.done = "length", True
            return
        t.messages.append(message)
        t.add(between, False)

    def _run(self, tasks: list[tuple], trajectories: list[Trajectory], then) -> None:
        """The tasks (one per trajectory) in the environment workers, each on its trajectory's;
        then(trajectory, result, failure) for each. A trajectory whose environment is gone (its
        worker was replaced after another environment there hung or died) is rebuilt by replay:
        its seed and actions again, then this task's."""
        todo, outcome = [(i, False) for i in range(len(tasks))], {}
        for _ in range(3):  # a replay may meet another replacement
            sends = []
            for i, replay in todo:
                t, task = trajectories[i], tasks[i]
                if replay and task[0] == "close":  # nothing left to close
                    outcome[i] = (None, None)
                elif replay:
                    actions = t.actions + ([task[2]] if task[0] == "step" else [])
                    sends.append((i, True, ("replay", t.id, t.tag, t.seed, actions)))
                else:
                    sends.append((i, False, task))
            results, failures, _ = self.pool.run(
                [s for *_, s in sends], slots=[trajectories[i].slot for i, *_ in sends]
            )
            todo = []
            for k, (i, replay, _) in enumerate(sends):
                failure = failures.get(k)
                if failure and EnvHost.LOST in failure and not replay:
                    todo.append((i, True))
                elif replay:
                    outcome[i] = self._replayed(trajectories[i], tasks[i], results[k], failure)
                else:
                    outcome[i] = (results[k], failure)
            if not todo:
                break
        for i, t in enumerate(trajectories):
            then(t, *outcome.get(i, (None, "its worker kept being replaced")))

    @staticmethod
    def _replayed(t: Trajectory, task: tuple, result, failure) -> tuple:
        """(result, failure) of `task` from its replay, which must retrace the observations seen."""
        if failure:
            return None, failure if failure == "timeout" else f"its worker was replaced; replaying it failed: {failure}"
        observations, last = result
        if observations[: len(t.observations)] != t.observations:
            return None, "its worker was replaced; replaying its actions gave other observations"
        return ((observations[0], {}) if task[0] == "reset" else last), None
