"""A step's batch, whichever engine samples it: start_engine builds the engine the flags ask for; generate_and_score
samples, scores and packs one rank's prompts for the trainer; evaluate gives val/*; Rollout holds what steps 1-3 and
validation use together. Also the rollout's flag groups, with their cross-flag checks."""

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from common import data, watchdog
from common.data import BatchPlan, DataError, LoadStats, load_prompts, pack_sequences, plan_batches, step_rows
from common.engines import Completion, HFEngine, Sampling
from common.engines import hf_generate_greedy as hf_generate_greedy  # re-exported for older forks
from common.errors import UsageError
from common.flags import band_ok, flag
from common.model import FROZEN_KNOBS, AdapterOff, load_frozen, load_trained_model
from common.ops import RunningMoments
from common.parallel import Dist, gather_objects, shard_evenly
from common.rewards import Scored
from common.scoring import hit, load_from_file

log = logging.getLogger(__name__)

# The largest and mean |trainer - engine| logprob over the probe's response tokens that pass, by the trainer's dtype.
# float32: the bundled model measures 2e-6 to 7e-6 (vLLM) and below 1e-5 (HF), so a real gap (stale weights, a wrong
# position, another chat template) is orders above the bound. Half precision rounds each side differently: a token's
# logprob may move by tenths of a nat, the mean far less.
TOLERANCE = {torch.float32: (1e-3, 1e-4), torch.bfloat16: (0.5, 0.05), torch.float16: (0.25, 0.02)}


def load_rl_models(path: str, dist, tokenizer=None, *, strategy: str, with_reference: bool = False,
                   reward_model: str | None = None, micro_batch_size: int = 64, **policy):  # fmt: skip
    """(policy, reference or None, reward model or None, run_info); `policy`: load_policy's knobs (policy_kwargs).
    The reference, for KL terms, is a frozen copy (with LoRA: AdapterOff, the policy with its adapter off); the
    reward model scores micro_batch_size texts a pass."""
    model, run_info = load_trained_model(path, dist, strategy=strategy, **policy)
    ref = AdapterOff(model) if with_reference and policy["lora_rank"] else None
    if with_reference and not policy["lora_rank"]:
        ref = load_frozen(path, dist, strategy=strategy, **{k: policy[k] for k in FROZEN_KNOBS})
    rm = None
    if reward_model:
        from common.reward_model import RewardModel  # a feature: loaded where --reward-model asks for it

        rm = RewardModel(reward_model, tokenizer, dist.device, policy["trust_remote_code"], micro_batch_size,
                         policy["remove_padding"])  # fmt: skip
    return model, ref, rm, run_info


def load_rl_data(
    train_files, val_files, tokenizer, *, train_batch_size: int, ground_truth: str = "required",
    tools: list[dict] | None = None, interactions: list[str] | None = None, tool_classes: list[str] = (),
    env: dict | None = None, difficulty: bool = False, **spec,
) -> tuple[list[dict], LoadStats, list[dict]]:  # fmt: skip
    """(train, its LoadStats, val) prompts of an RL recipe; too few training prompts for one batch fail here, before
    any model loads. ground_truth: "required" (the built-in rewards score against it: a row without one is an error),
    "optional" (a user's reward function may not need one: a warning counts rows without) or "unused" (a reward model
    scores). tools, interactions, tool_classes: what common.tools.check_agent_rows holds agent rows to. env: the
    arguments of common.envs.env_rows, whose rows replace the files'. difficulty: every training row needs a number.
    spec: common.data.load_prompts' (the columns, the length rules, data_workers)."""
    if env is not None:
        if difficulty:
            raise DataError("--difficulty-loss-weight: environment rows have no difficulty column; drop the flag")
        from common.envs import env_rows

        return env_rows(**env)
    spec.update(tools=tools, ground_truth=ground_truth)
    load = load_prompts  # small parquet files, templated here; the rest as a cached map (common.prompt_cache)
    if not data.in_process([*train_files, *val_files], spec.get("data_workers", 1)):
        from common.prompt_cache import load_prompts as load
    else:
        spec.pop("data_workers", None)
    train, stats = load(train_files, tokenizer, **spec, difficulty=difficulty, what="train_files")
    if len(train) < train_batch_size:
        raise DataError(f"train_files hold {len(train)} prompts, fewer than train_batch_size={train_batch_size}")
    val, val_stats = load(val_files, tokenizer, **spec, what="val_files") if val_files else ([], LoadStats())
    for described in dict.fromkeys([*stats.columns, *val_stats.columns]):  # one line per mapping, said once
        files = [Path(f).name for f in stats.columns.get(described, []) + val_stats.columns.get(described, [])]
        log.info("columns of %s: %s", ", ".join(files), described)
    if tools or interactions or stats.agent_rows or val_stats.agent_rows:
        from common.tools import check_agent_rows

        train, val = list(train), list(val)  # it fills in each row's interaction_kwargs
        check_agent_rows(train + val, tools, interactions, tool_classes)
    if missing := stats.no_ground_truth + val_stats.no_ground_truth if ground_truth == "optional" else 0:
        log.warning("%d rows have no ground truth: the reward function gets None", missing)
    return train, stats, val


def reward_task(row: dict, completion: Completion, text: str) -> tuple:
    """The reward pool's (data_source, solution_str, ground_truth, extra_info), with a conversation's extra_info."""
    extra_info = {**(row["extra_info"] or {}), **completion.extra_info} if completion.extra_info else row["extra_info"]
    return row["data_source"], text, row["ground_truth"], extra_info


def start_engine(model, tokenizer, dist, version: int = 0, *, rollout_name: str = "hf", batch_size: int = 256,
                 placement: "PlacementArgs | None" = None, schedule=None, total_steps: int = 0,
                 agent: dict | None = None, env: dict | None = None, **vllm_kwargs):  # fmt: skip
    """The engine the flags ask for, holding weights `version` (the step the run starts from): HFEngine on the live
    policy (the vLLM flags unused), a VLLMEngine loaded from model_path, or with --rollout-placement remote (the
    `placement` group) common.remote.RemoteEngines (HF or vLLM engines in Ray actors, generating the `schedule`'s
    prompts ahead over total_steps). One with its own weights syncs with `model` at once: call this after a resume
    has loaded them. `agent` / `env` (AgentArgs.agent_kwargs / EnvPlayArgs.env_kwargs) put it behind
    common.agent.AgentLoop / common.env_manager.EnvLoop (or the --env-manager subclass)."""
    if env is not None or agent is not None:
        inner = start_engine(model, tokenizer, dist, version, rollout_name=rollout_name, batch_size=batch_size,
                             placement=placement, schedule=schedule, total_steps=total_steps,
                             **vllm_kwargs)  # fmt: skip
        if env is None:
            from common.agent import AgentLoop

            return AgentLoop(inner, tokenizer, **agent)
        from common.env_manager import EnvLoop

        manager = load_from_file(env["manager"], "--env-manager", "", kind="class") if env["manager"] else EnvLoop
        return manager(inner, tokenizer, **{k: v for k, v in env.items() if k != "manager"})
    if placement is not None and placement.rollout_placement == "remote":
        from common.remote import start_remote_engines

        return start_remote_engines(model, tokenizer, dist, version, rollout_name, batch_size, placement, schedule,
                                    total_steps, vllm_kwargs)  # fmt: skip
    if rollout_name == "hf":
        engine = HFEngine.for_policy(model, tokenizer, dist, batch_size=batch_size)
        engine.update_weights(version)
        return engine
    from common.vllm_engine import VLLMEngine

    return VLLMEngine(model, eos_ids=[tokenizer.eos_token_id], dist=dist, version=version, **vllm_kwargs)


def engine_logprobs(engine, batch: dict, temperature: float) -> torch.Tensor:
    """The engine's logprob of each response token of a trainer batch (its score of each row's prompt and response),
    (B, T) float32 on the batch's device, 0 past each response. Collective for remote engines, as generate is."""
    T = batch["responses"].shape[1]
    P = batch["input_ids"].shape[1] - T
    ids, real = batch["input_ids"].cpu(), batch["attention_mask"].cpu().bool()
    prompts = [row[:P][keep[:P]].tolist() for row, keep in zip(ids, real)]
    responses = [row[P:][keep[P:]].tolist() for row, keep in zip(ids, real)]
    padded = [logprobs + [0.0] * (T - len(logprobs)) for logprobs in engine.score(prompts, responses, temperature)]
    return torch.tensor(padded, dtype=torch.float32, device=batch["responses"].device)


def pack_groups(rows: list[tuple], n: int, tokenizer, device) -> dict:
    """The trainer tensors (common.data.pack_sequences) of rows [(prompt row, Completion)], group g at rows g*n ..
    g*n+n-1, plus those rows, group_ids (B,) and rollout_logprobs (B, T): the engine's (0 past a response's end)."""
    prompts, responses = [p["prompt_ids"] for p, _ in rows], [c.token_ids for _, c in rows]
    batch = pack_sequences(prompts, responses, tokenizer.pad_token_id, device)
    width = batch["responses"].shape[1]
    batch["rollout_logprobs"] = torch.tensor(
        [c.logprobs + [0.0] * (width - len(c.logprobs)) for _, c in rows], dtype=torch.float32, device=device
    )
    for i, (_, c) in enumerate(rows):  # multi-turn: only the sampled tokens are the policy's (common.agent)
        if c.mask is not None:
            batch["response_mask"][i, : len(c.mask)] = torch.tensor(c.mask, dtype=batch["response_mask"].dtype)
    batch["rows"] = list(rows)
    batch["group_ids"] = torch.arange(len(rows) // n, device=device).repeat_interleave(n)
    return batch


def regroup(groups: list[list[tuple]], parts: list[dict], tokenizer, device) -> dict:
    """One batch of the groups [(row, reward, score, extra)] DAPO's dynamic sampling keeps from several
    generate_and_score batches (parts, of any rank); the parts' scoring counts (errors, timeouts) and timing add up."""
    rows, rewards, scores, extras = zip(*(member for group in groups for member in group))
    batch = pack_groups(rows, len(groups[0]), tokenizer, device)
    batch["rewards"] = torch.tensor(rewards, dtype=torch.float32, device=device)
    batch["scored"] = Scored.merge([p["scored"] for p in parts], list(scores), list(extras))
    batch["timing"] = {k: sum(p["timing"][k] for p in parts) for k in parts[0]["timing"]}
    batch["started"] = parts[0]["started"]
    batch["weight_version"] = parts[0]["weight_version"]
    batch["engine_stats"] = parts[-1].get("engine_stats", {})
    return batch


def sample(engine, prompts: list[dict], sampling: Sampling) -> list[list[Completion]]:
    """sampling.n completions of each prompt row, through the agent loop (each row's agent_name) if there is one."""
    if hasattr(engine, "generate_rows"):
        return engine.generate_rows(prompts, sampling)
    return engine.generate([p["prompt_ids"] for p in prompts], sampling)


def score(pool, rows: list[tuple], texts: list[str]) -> Scored:
    """The pool's scores of [(prompt row, Completion)]; an environment's trajectory scores its return (won: correct)."""
    if rows and rows[0][0].get("agent_name") == "env":
        results = [c.extra_info["env"] for _, c in rows]
        return Scored([e["return"] for e in results], [{"acc": float(e["success"])} for e in results],
                      ok=[True] * len(rows))  # fmt: skip
    return pool.score([reward_task(p, c, x) for (p, c), x in zip(rows, texts)])


def generate_and_score(prompts, engine, sampling, pool, tokenizer, device, reward_model=None) -> dict:
    """Steps 2-3 for this rank's prompts: sampling.n responses each, packed (pack_groups), scored by the reward pool
    (verl's compute_score) or the reward model. Adds weight_version (the engine's), engine_stats, scored (the pool's
    Scored: errors, timeouts, nonfinite, extra keys), rewards (B,) float32, timing {perf/generate_s, perf/score_s} and
    started (when generation began: perf/step_s counts from it)."""
    t = time.time()
    rows = [(p, c) for p, group in zip(prompts, sample(engine, prompts, sampling)) for c in group]
    responses = [c.token_ids for _, c in rows]
    batch = pack_groups(rows, sampling.n, tokenizer, device)
    batch["started"], batch["timing"] = t, {"perf/generate_s": time.time() - t}
    batch["weight_version"] = engine.weight_version  # held now (a Completion's version: the weights that sampled it)
    batch["engine_stats"] = engine.stats() if hasattr(engine, "stats") else {}

    t = time.time()
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    batch["scored"] = score(pool, rows, texts)
    rewards = torch.tensor(batch["scored"].scores, dtype=torch.float32, device=device)
    if reward_model is not None:
        prompt_ids, messages = [p["prompt_ids"] for p, _ in rows], [p["messages"] for p, _ in rows]
        rewards = reward_model.score(messages, texts, prompt_ids, responses).to(device)
        bad = ~torch.isfinite(rewards)  # zeroed and counted, as the pool does with a function's NaN
        batch["scored"].nonfinite += int(bad.sum())
        rewards = rewards.masked_fill(bad, 0.0)
    batch["rewards"] = rewards
    batch["timing"]["perf/score_s"] = time.time() - t
    return batch


def evaluate(engine, pool, tokenizer, rows: list[dict], sampling: Sampling, dist, log_generations: int = 0) -> dict:
    """val/* of every row's responses (sharded over ranks): the mean reward, the accuracy overall and per data_source
    (hit: a result's "acc", else score > 0), and the samples whose scoring raised, timed out or gave NaN (they score 0,
    so must not pass for wrong answers). log_generations N (verl's trainer.log_val_generations): val/generations holds
    the first N rows' prompt, first response, ground truth and score. With the agent loop, val/agent/*: this rank's."""
    local, n_real = shard_evenly(rows, dist)
    completions = sample(engine, local, sampling)[:n_real]
    agent = engine.agent_metrics() if hasattr(engine, "agent_metrics") else {}  # this rank's conversations
    pairs = [(row, c) for row, group in zip(local[:n_real], completions) for c in group]
    texts = tokenizer.batch_decode([c.token_ids for _, c in pairs], skip_special_tokens=True)
    scored = score(pool, pairs, texts)
    mine = [(r["data_source"], s, hit(s, e)) for (r, _), s, e in zip(pairs, scored.scores, scored.extras)]
    results = [x for part in gather_objects(mine) for x in part]
    failures = [sum(c) for c in zip(*gather_objects((scored.errors, scored.timeouts, scored.nonfinite)))]
    metrics = {
        "val/reward/mean": sum(s for _, s, _ in results) / len(results),
        "val/accuracy": sum(h for *_, h in results) / len(results),
        **dict(zip(("val/reward/errors", "val/reward/timeouts", "val/reward/nonfinite"), failures)),
        **{f"val/{k}": v for k, v in agent.items()},
    }
    if local and local[0].get("agent_name") == "env":
        from common.envs import env_metrics

        metrics.update(env_metrics(pairs, "val/env"))
    for source in sorted({d for d, *_ in results}):
        hits_d = [h for d, _, h in results if d == source]
        metrics[f"val/accuracy/{source}"] = sum(hits_d) / len(hits_d)
    if (n := sampling.n) > 1:  # verl's best@n of the accuracy: a prompt counts once any of its n responses hits
        solved = sum(gather_objects(sum(any(h for *_, h in mine[i : i + n]) for i in range(0, len(mine), n))))
        metrics[f"val/pass@{n}"] = solved / (len(results) // n)
    if log_generations:  # rank 0 holds the first rows (shard_evenly is contiguous); every rank sends its first N
        mine = [{"data_source": row["data_source"], "prompt": tokenizer.decode(row["prompt_ids"]),
                 "response": texts[i * n], "ground_truth": str(row["ground_truth"]), "score": scored.scores[i * n]}
                for i, row in enumerate(local[:n_real][:log_generations])]  # fmt: skip
        metrics["val/generations"] = [g for part in gather_objects(mine) for g in part][:log_generations]
    return metrics


@dataclass
class Rollout:
    """Steps 1-3 and validation of every RL recipe, over what they use together. step(i): this rank's share of step
    i's prompts (common.data.step_rows: batch_size a step, in a seeded order per epoch), sampled and scored
    (generate_and_score), with the step's epoch. validate(): val/* over `val` (evaluate) and perf/validate_s."""

    train: list[dict]
    val: list[dict]
    engine: object
    pool: object
    tokenizer: object
    dist: Dist
    sampling: Sampling
    val_sampling: Sampling
    batch_size: int
    seed: int
    shuffle: bool
    reward_model: object = None
    log_val_generations: int = 0

    def step(self, step: int) -> dict:
        watchdog.note(step=step + 1)
        epoch, ranks = step_rows(step, self.train, self.batch_size, self.seed, self.shuffle, self.dist.world_size)
        batch = generate_and_score(ranks[self.dist.rank], self.engine, self.sampling, self.pool, self.tokenizer,
                                   self.dist.device, self.reward_model)  # fmt: skip
        batch["epoch"] = epoch
        return batch

    def greedy_rewards(self, step: int, batch: dict) -> torch.Tensor:
        """The reward of one greedy response to each of this rank's prompts of `step` (batch's), scored as step's
        are, (prompts,): ReMax's baseline. Its responses are not trained on; its time counts in batch's."""
        _, ranks = step_rows(step, self.train, self.batch_size, self.seed, self.shuffle, self.dist.world_size)
        greedy = replace(self.sampling, n=1, temperature=0.0, top_p=1.0, top_k=-1)
        out = generate_and_score(ranks[self.dist.rank], self.engine, greedy, self.pool, self.tokenizer,
                                 self.dist.device, self.reward_model)  # fmt: skip
        for key in ("perf/generate_s", "perf/score_s"):
            batch["timing"][key] += out["timing"][key]
        return out["rewards"]

    def validate(self) -> dict:
        start = time.time()
        metrics = evaluate(self.engine, self.pool, self.tokenizer, self.val, self.val_sampling, self.dist,
                           self.log_val_generations)  # fmt: skip
        return {**metrics, "perf/validate_s": time.time() - start}


# --- the rollout's flag groups: placement, sampling and batches, ROLL's conditioning, agent, environments, validation
REMOTE = (lambda a: a.rollout_placement == "remote", "add --rollout-placement remote")  # when remote knobs are read
ANY_REMOTE = (lambda a: a.rollout_placement == "remote" or getattr(a, "teacher_placement", "") == "remote",
              "add --rollout-placement remote (or distill.py's --teacher-placement remote)")  # fmt: skip


@dataclass
class PlacementArgs:
    rollout_placement: Literal["colocated", "remote"] = "colocated"
    """colocated: the engine runs in the trainer's processes; remote: in Ray actors with their own copy of the weights,
    streamed to them after every step"""
    num_rollout_engines: int = flag(2, ge=1, only_with=REMOTE)
    """remote: engine processes (Ray actors)"""
    engine_num_cpus: float = flag(1.0, gt=0, only_with=REMOTE)
    """remote: CPUs Ray reserves for each engine (its torch threads)"""
    engine_num_gpus: float = flag(0.0, ge=0, only_with=REMOTE)
    """remote: GPUs Ray reserves for each engine"""
    ray_address: str | None = flag(None, only_with=ANY_REMOTE)
    """remote: the Ray cluster to join (default: $RAY_ADDRESS, else Ray starts inside this job)"""
    max_staleness: int = flag(0, ge=0, note="0 is synchronous", only_with=REMOTE)
    """remote: most weight versions a sample may lag the policy it trains (rollouts generated ahead; 0: synchronous)"""
    engine_timeout: float = flag(300.0, gt=0, unit="seconds", only_with=ANY_REMOTE)
    """remote: seconds any wait on an engine may last before the run stops, naming the engine"""


BAND_RULE = "a cap >= 1, or lo_hi with 0 < lo <= 1 <= hi (else even an on-policy token's weight of 1 is cut)"
# When the run reads a flag (common.flags.flag's only_with), for flags that share it
BYPASS = (lambda a: not a.bypass_mode, "drop --bypass-mode (the old policy is then the engine's: no gap to mask)")
CORRECTING = (lambda a: a.rollout_is is not None, "add --rollout-is token|sequence")
CHECKING = (lambda a: a.check != "off", "drop --check off (the probe comes from the launch check)")
NORMALISING = (lambda a: a.reward_normalization_method != "identity",
               "add --reward-normalization-method mean_std or asym_clip")  # fmt: skip
SAMPLED = (lambda a: a.val_temperature > 0, "add --val-temperature above 0 (at 0 validation is greedy)")
ENV = "env_config"


@dataclass
class RolloutArgs:
    max_prompt_length: int = flag(64, ge=1)
    """prompt tokens after the chat template (longer ones follow --truncation)"""
    max_response_length: int = flag(16, ge=1)
    """generated tokens per response"""
    filter_overlong_prompts: bool = False
    """drop (and count) prompts longer than max_prompt_length instead of truncating / failing"""
    train_batch_size: int = flag(16, ge=1)
    """prompts per step, over all processes"""
    rollout_n: int = flag(16, ge=1)
    """responses sampled per prompt (the group)"""
    ppo_mini_batch_size: int | None = flag(None, ge=1, note="or left unset: the train batch")
    """prompts per optimizer step, so train_batch_size / ppo_mini_batch_size updates per step (default: all)"""
    micro_batch_size_per_gpu: int = flag(64, ge=1)
    """most sequences per forward/backward pass on one process (the last micro-batch may be smaller)"""
    use_dynamic_bsz: bool = False
    """pack micro-batches by a token budget (--ppo-max-token-len-per-gpu) instead of a sequence count"""
    ppo_max_token_len_per_gpu: int = flag(16384, ge=1)
    """with --use-dynamic-bsz: most padded tokens (rows x longest) per micro-batch on one process (verl: real ones)"""
    ppo_epochs: int = flag(1, ge=1)
    """passes over each step's samples"""
    shuffle_mini_batches: bool = False
    """each epoch, deal whole groups into the mini-batches (--ppo-mini-batch-size) in a new seeded order (verl's
    actor.shuffle); off: in the order sampled"""
    temperature: float = flag(1.0, ge=0, note="0 is greedy decoding")
    """sampling temperature (the trainer scales logits by it too)"""
    top_p: float = flag(1.0, gt=0, le=1)
    """nucleus sampling: keep the smallest token set with this much probability (1.0: off)"""
    top_k: int = flag(-1, rule=(lambda v: v == -1 or v >= 1, "-1 (off) or >= 1"))
    """sample among the k most likely tokens (-1: off)"""
    shared_prompt_forward: bool = True
    """trainer passes run each group's shared prompt once (same numbers; off: one pass per sequence)"""
    rollout_is: Literal["token", "sequence"] | None = None
    """rollout correction: weight each token by the truncated pi_old / pi_rollout, per token or per response"""
    rollout_is_threshold: float | str = flag(2.0, rule=(band_ok, BAND_RULE), only_with=CORRECTING)
    """rollout correction: the cap on those importance weights, or lo_hi (e.g. 0.5_5.0): weights outside are zeroed"""
    rollout_is_batch_normalize: bool = flag(False, only_with=CORRECTING)
    """rollout correction: rescale the importance weights to mean 1 over the step"""
    rollout_rs: str | None = None
    """rollout rejection: drop tokens / responses whose trainer-engine gap leaves the band, e.g. token_k1,seq_mean_k3"""
    rollout_rs_threshold: str | None = flag(None, only_with=(lambda a: a.rollout_rs is not None, "add --rollout-rs"))
    """rollout rejection's bounds, one or one per option: lo_hi for k1 (e.g. 0.5_2.0), an upper bound for k2 / k3"""
    off_policy_mask_threshold: float | None = flag(None, gt=0, only_with=BYPASS)
    """off-policy sequence mask (DeepSeek-V3.2; TRL's): a negative-advantage token of a response whose mean
    log(pi_rollout / pi_old) is above this gets no gradient (e.g. 0.5; off: None)"""
    bypass_mode: bool = False
    """take the engine's logprobs as the old policy (saves the trainer's old-logprob pass)"""
    check_freq: int = flag(10, ge=0, note="0: never during training", only_with=CHECKING)
    """after the launch check, the engine's logprobs stay the trainer's: the per-step gap (rollout/logprob_diff_*) is
    bounded or, where it proves nothing (--top-p, --top-k, --max-staleness, --bypass-mode, a rollout correction), the
    check's probe reruns every N steps (check/engine_gap_*); past the bounds the run saves and stops (0: never)"""

    @property
    def engine_holds_own_weights(self) -> bool:
        """vLLM or remote engines sample with their own copy of the policy, not the trainer's."""
        return self.rollout_name != "hf" or self.placement.rollout_placement == "remote"

    @property
    def old_logprobs_from(self) -> Literal["engine", "pass", "when-stale"]:
        """Where step 4's old logprobs come from: the engine ("engine", --bypass-mode); a no-grad trainer pass ("pass")
        when needed before the update (--use-kl-in-reward) or set against the engine's (an engine with its own weights,
        --rollout-is, --rollout-rs, the off-policy mask); else a pass only for a sample the policy moved past
        ("when-stale": the update's own logprobs are exact for the rest)."""
        if self.bypass_mode:
            return "engine"
        correcting = self.rollout_is or self.rollout_rs or self.off_policy_mask_threshold
        before_update = getattr(self, "use_kl_in_reward", False) or self.engine_holds_own_weights or correcting
        return "pass" if before_update else "when-stale"

    @property
    def gap_proves_sync(self) -> bool:
        """Whether the per-step gap proves the weight sync: an engine with its own weights sampling on policy from the
        whole distribution (no --max-staleness, --top-p, --top-k), against the trainer's old logprobs (no
        --bypass-mode), in a run that expects no gap (no --rollout-is / --rollout-rs)."""
        whole = self.top_p == 1 and self.top_k == -1 and not self.placement.max_staleness
        expected = self.bypass_mode or self.rollout_is or self.rollout_rs
        return self.engine_holds_own_weights and whole and not expected

    def gap_bound(self, dtype) -> dict | None:
        """Tracker's bound on the logged gap's mean: TOLERANCE for the trainer's dtype (none with --check off,
        --check-freq 0, or where the gap proves nothing)."""
        if self.check == "off" or not self.check_freq or not self.gap_proves_sync:
            return None
        return dict(mean=TOLERANCE[dtype][1], dtype=str(dtype).removeprefix("torch."), warn=self.check == "warn")

    @property
    def probe_freq(self) -> int:
        """--check-freq for the probe (common.check), only for own-weights engines whose logged gap proves nothing."""
        return self.check_freq if self.engine_holds_own_weights and not self.gap_proves_sync else 0

    def rollout_kwargs(self) -> dict:
        """Rollout's keyword arguments; environment seeds play in order (each batch holds every tag's share)."""
        sampling, val_sampling = self.samplings()
        return dict(
            sampling=sampling,
            val_sampling=val_sampling,
            batch_size=self.train_batch_size,
            seed=self.seed,
            shuffle=self.shuffle and not self.env.env_config,
            log_val_generations=self.validation.log_val_generations,
        )

    def batch_plan(self, world_size: int) -> BatchPlan:
        """The checked batch arithmetic (plan_batches) for this many processes."""
        return plan_batches(
            world_size=world_size, train_batch_size=self.train_batch_size, rollout_n=self.rollout_n,
            mini_batch_size=self.ppo_mini_batch_size, micro_batch_size_per_gpu=self.micro_batch_size_per_gpu,
            use_dynamic_bsz=self.use_dynamic_bsz, max_token_len_per_gpu=self.ppo_max_token_len_per_gpu,
            max_sequence_length=self.max_prompt_length + self.max_response_length, epochs=self.ppo_epochs,
            temperature=self.temperature, share_prompts=self.shared_prompt_forward, shuffle=self.shuffle_mini_batches,
        )  # fmt: skip

    def samplings(self):
        """(training sampling: rollout_n per prompt, validation sampling: val_n per prompt)."""
        sampling = Sampling(self.rollout_n, self.temperature, self.top_p, self.top_k, self.max_response_length)
        v = self.validation
        return sampling, Sampling(v.val_n, v.val_temperature, v.val_top_p, v.val_top_k, sampling.max_tokens)

    def rollout_is_kwargs(self) -> dict:
        """The keyword arguments of common.ops.rollout_correction that these flags set."""
        return dict(mode=self.rollout_is, threshold=self.rollout_is_threshold,
                    batch_normalize=self.rollout_is_batch_normalize, rs=self.rollout_rs,
                    rs_threshold=self.rollout_rs_threshold, opsm=self.off_policy_mask_threshold)  # fmt: skip


REWARD_NORM = (lambda a: a.reward_norm is not None, "add --reward-norm batch, group or running")


@dataclass
class ConditioningArgs:
    """ROLL's reward and advantage conditioning and loss terms (common.conditioning, loaded only when a knob is on;
    all off by default). RLArgs holds them as its `conditioning` group: the flags keep their names under one --help
    heading, and a recipe reads them as args.conditioning.reward_norm."""

    reward_normalization_grouping: Literal["state", "batch", "inductive"] = flag("state", only_with=NORMALISING)
    """ROLL's reward_normalization.grouping: normalise per prompt (seed) group, per step, or per data_source (tag)"""
    reward_normalization_method: Literal["identity", "mean_std", "asym_clip"] = "identity"
    """ROLL's reward_normalization.method: identity (off), mean_std, or mean_std clipped to [-1, 3]"""
    add_len_reward: bool = False
    """ROLL's add_len_reward, as Kimi k1.5 defines it: within a group, shorter correct responses gain up to +0.5 and
    longer ones lose up to -0.5 (wrong ones only lose), times --len-reward-coef"""
    len_reward_coef: float = flag(1.0, gt=0, only_with="add_len_reward")
    """weight of the length reward"""
    reward_norm: Literal["batch", "group", "running"] | None = None
    """ROLL's reward_norm: (r - mean) / std over the step (every rank), the prompt's group, or every reward so far"""
    reward_shift: bool = flag(False, only_with=REWARD_NORM)
    """with --reward-norm: only subtract the mean"""
    reward_scale: bool = flag(False, only_with=REWARD_NORM)
    """with --reward-norm: only divide by the std"""
    whiten_rewards: bool = False
    """whiten the step's rewards (every rank) before the advantage"""
    reward_clip: float | None = flag(None, gt=0, note="rewards are clamped to [-c, c]")
    """clamp the conditioned rewards to [-c, c]"""
    whiten_advantages: bool = False
    """whiten the advantages over every response token of the step"""
    advantage_clip: float | None = flag(None, gt=0, note="advantages are clamped to [-c, c]")
    """clamp the advantages to [-c, c] (after any whitening)"""
    difficulty_loss_weight: bool = False
    """weight each response's policy-gradient loss by 0.5 + 1.5 * its row's difficulty (a column in [0, 1])"""
    length_loss_weight: bool = False
    """weight each response's policy-gradient loss by 1.5 - its length scaled to [0, 1] over the step"""
    rl_loss_coef: float = flag(1.0, ge=0)
    """ROLL's rl_loss_coef: weight of the policy-gradient term (and of the KL loss with it)"""
    sft_loss_coef: float = flag(0.0, ge=0, note="a negative weight would push the good responses down")
    """ROLL's sft_loss_coef: add this times the negative log-likelihood of the responses that scored > 0"""
    use_topr_loss: bool = False
    """ROLL's use_topr_loss: TOPR's truncated-importance REINFORCE instead of the clipped surrogate"""

    def __post_init__(self):
        if self.rl_loss_coef == 0 and self.sft_loss_coef == 0:
            raise UsageError("--rl-loss-coef 0 with --sft-loss-coef 0: the loss would have no term left to learn from")
        if self.reward_shift and self.reward_scale:
            raise UsageError("--reward-shift with --reward-scale: shift only subtracts the mean and scale only divides "
                             "by the std; for both, drop the two flags (--reward-norm alone does both)")  # fmt: skip

    def _on(self, names: tuple[str, ...]) -> bool:
        return any(getattr(self, n) != getattr(ConditioningArgs, n) for n in names)

    def rewards(self, rewards, batch: dict, state: dict) -> "torch.Tensor":
        """Step 3's conditioning; --reward-norm running keeps its moments in `state`, the checkpointed trainer state."""
        names = ("reward_norm", "reward_shift", "reward_scale", "whiten_rewards", "reward_clip", "add_len_reward",
                 "len_reward_coef", "reward_normalization_grouping", "reward_normalization_method")  # fmt: skip
        if not self._on(names):
            return rewards.float()
        from common.conditioning import condition_rewards

        running = RunningMoments.from_state(state.get("reward_stats"))
        rewards = condition_rewards(rewards, batch, running, normalization_grouping=self.reward_normalization_grouping,
                                    normalization_method=self.reward_normalization_method,
                                    **{k: getattr(self, k) for k in names[:7]})  # fmt: skip
        state["reward_stats"] = running.state()
        return rewards

    def advantages(self, advantages, response_mask, batch: dict) -> "torch.Tensor":
        """Step 5's conditioning after the recipe's own advantage (common.conditioning.condition_advantages)."""
        names = ("whiten_advantages", "advantage_clip", "difficulty_loss_weight", "length_loss_weight")
        if not self._on(names):
            return advantages
        from common.conditioning import condition_advantages

        return condition_advantages(advantages, response_mask, batch, **{k: getattr(self, k) for k in names})

    def loss(self, terms: dict, metrics: dict, *tensors) -> "torch.Tensor":
        """The sum of a recipe's compute_loss terms, or with ROLL's terms (common.conditioning.roll_loss of tensors)."""
        names = ("rl_loss_coef", "sft_loss_coef", "use_topr_loss")
        if not self._on(names):
            return sum(terms.values())
        from common.conditioning import roll_loss

        return roll_loss(terms, metrics, *tensors, **{k: getattr(self, k) for k in names})


TOOLS = (lambda a: a.tool_config or a.interaction_config, "add --tool-config or --interaction-config")


@dataclass
class AgentArgs:
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

    def tool_schemas(self) -> list[dict] | None:
        """The function schemas of --tool-config, which tool_agent prompts are templated with."""
        if not self.tool_config:
            return None
        from common.tools import read_tool_config

        return read_tool_config(self.tool_config).schemas

    def tool_class_names(self) -> list[str]:
        """The tools of --tool-config that are verl tool classes (they take per-row tools_kwargs)."""
        if not self.tool_config:
            return []
        from common.tools import read_tool_config

        return list(read_tool_config(self.tool_config).classes)

    def interaction_names(self) -> list[str] | None:
        if not self.interaction_config:
            return None
        from common.tools import read_interaction_config

        return read_interaction_config(self.interaction_config).names

    def agent_kwargs(self, tool_pool, interaction_pool, max_response_length: int, lockstep: bool = True) -> dict:
        """start_engine's `agent` (none without --tool-config or --interaction-config): AgentLoop's keyword arguments,
        its tools and interactions running in those pools, a conversation's tokens at most max_response_length;
        lockstep False where each process generates alone."""
        if not self.tool_config and not self.interaction_config:
            return {}
        from common.tools import read_interaction_config, read_tool_config

        return {"agent": dict(
            tools=read_tool_config(self.tool_config) if self.tool_config else None, pool=tool_pool,
            interactions=read_interaction_config(self.interaction_config) if self.interaction_config else None,
            interaction_pool=interaction_pool, max_assistant_turns=self.max_assistant_turns,
            max_user_turns=self.max_user_turns, max_response_length=max_response_length,
            check_mode=self.tokenization_sanity_check_mode, lockstep=lockstep)}  # fmt: skip


@dataclass
class EnvPlayArgs:
    """How environments are played (common.envs, common.env_manager): generate.py's `env` group."""

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
    """environment: path/to/file.py:Class subclassing common.env_manager.EnvLoop, to play instead (ROLL's worker_cls)"""
    env_gamma: float = flag(1.0, ge=0, le=1, only_with=ENV)
    """environment: discount of the per-turn rewards in a trajectory's return"""
    env_timeout: float = flag(10.0, gt=0, unit="seconds", only_with=ENV)
    """environment: seconds a reset or step may take before its trajectory ends, counted in env/<tag>/timeouts"""
    env_workers: int = flag(2, ge=1, only_with=ENV)
    """environment: worker processes per rank that run the environments"""

    def env_tag_list(self) -> list[str]:
        if self.env_tags:
            return list(self.env_tags)
        from common.envs import read_env_config

        return read_env_config(self.env_config).tags

    def env_kwargs(self, pool, max_prompt_length: int, max_response_length: int, lockstep: bool = True) -> dict:
        """start_engine's `env` (none without --env-config): EnvLoop's keyword arguments, its environments in `pool`."""
        if not self.env_config:
            return {}
        from common.envs import read_env_config

        return {"env": dict(
            config=read_env_config(self.env_config), pool=getattr(pool, "envs", None) or pool,
            max_env_steps=self.max_env_steps, format_penalty=self.format_penalty, gamma=self.env_gamma,
            max_response_length=max_response_length, max_prompt_length=max_prompt_length,
            manager=self.env_manager, lockstep=lockstep)}  # fmt: skip

    def env_pool_kwargs(self, max_prompt_length: int) -> dict | None:
        """common.rewards.start_env_pool's keyword arguments (none without --env-config)."""
        if not self.env_config:
            return None
        return dict(config=self.env_config, workers=self.env_workers, timeout=self.env_timeout,
                    max_traj_per_env=self.max_traj_per_env, max_prompt_length=max_prompt_length)  # fmt: skip


@dataclass
class EnvArgs(EnvPlayArgs):
    """RLArgs' `env` group: how environments are played, a step's groups and an epoch's seeds."""

    env_n_groups: tuple[int, ...] = flag((), ge=1, only_with=ENV)
    """environment: groups a step of each tag, summing to --train-batch-size (default: split evenly; ROLL's n_groups)"""
    env_train_seeds: int = flag(10000, ge=1, only_with=ENV)
    """environment: training seeds 0..N-1, each played once an epoch"""

    def env_groups(self, train_batch_size: int) -> tuple[list[str], list[int]]:
        """(tags, groups a step of each): --env-tags / --env-n-groups, or every tag, the train batch split evenly."""
        tags = self.env_tag_list()
        return tags, list(self.env_n_groups) or [train_batch_size // len(tags)] * len(tags)


@dataclass
class ValidationArgs:
    val_temperature: float = flag(0.0, ge=0, note="0 is greedy")
    """validation sampling temperature; 0 is greedy"""
    val_n: int = flag(1, ge=1)
    """validation responses per prompt"""
    val_top_p: float = flag(1.0, gt=0, le=1, only_with=SAMPLED)
    """validation's nucleus sampling (1.0: off; verl's val_kwargs.top_p, apart from training's --top-p)"""
    val_top_k: int = flag(-1, rule=(lambda v: v == -1 or v >= 1, "-1 (off) or >= 1"), only_with=SAMPLED)
    """validation's top-k sampling (-1: off; verl's val_kwargs.top_k, apart from training's --top-k)"""
    val_batch_size: int = flag(256, ge=1)
    """prompts per generate call in validation"""
    log_val_generations: int = flag(0, ge=0, note="0: none")
    """each validation, log the first N prompts with a response and its score (val_generations.jsonl; wandb table)"""
