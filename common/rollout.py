"""A step's batch, whichever engine samples it: start_engine builds the engine the flags ask for; generate_and_score
samples, scores and packs one rank's prompts for the trainer; evaluate gives val/*; Rollout holds what steps 1-3 and
validation use together. Also the loading of an RL recipe's data and models, and the validation flags."""

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common import data, watchdog
from common.data import DataError, LoadStats, StepPrompts, load_prompts, pack_sequences
from common.engines import Completion, HFEngine, Sampling
from common.engines import hf_generate_greedy as hf_generate_greedy  # re-exported for older forks
from common.flags import flag
from common.model import AdapterOff, load_frozen, load_trained_model
from common.parallel import Dist, gather_objects, shard_evenly
from common.rewards import JUDGE_MESSAGES, Scored
from common.scoring import hit, load_from_file

log = logging.getLogger(__name__)

# The largest and mean |trainer - engine| logprob over the probe's response tokens that pass, by the trainer's dtype.
# float32: the bundled model measures 2e-6 to 7e-6 (vLLM) and below 1e-5 (HF), so a real gap (stale weights, a wrong
# position, another chat template) is orders above the bound. Half precision rounds each side differently: a token's
# logprob may move by tenths of a nat, the mean far less.
TOLERANCE = {torch.float32: (1e-3, 1e-4), torch.bfloat16: (0.5, 0.05), torch.float16: (0.25, 0.02)}


def load_rl_models(policy, dist, with_reference: bool = False) -> tuple:
    """(the trained model the policy group describes, a frozen reference or None, run_info). The reference, for a
    KL term, is a copy of the starting policy (with LoRA: AdapterOff, the policy with its adapter off)."""
    model, run_info = load_trained_model(policy, dist)
    ref = None
    if with_reference:
        ref = AdapterOff(model) if policy.lora_rank else load_frozen(policy.path, dist, policy)
    return model, ref, run_info


def load_reward_model(reward, policy, tokenizer, dist, micro_batch_size: int):
    """The reward group's --reward-model (common.shaping.reward_model, a sequence classifier scoring micro_batch_size
    conversations a pass with the policy group's packing), or None without one."""
    if not reward.reward_model:
        return None
    from common.shaping.reward_model import RewardModel

    return RewardModel(
        reward.reward_model,
        tokenizer,
        dist.device,
        policy.trust_remote_code,
        micro_batch_size,
        policy.use_remove_padding,
    )


def load_rl_data(data_args, tokenizer, reward, agent, env, conditioning) -> tuple[list[dict], LoadStats, list[dict]]:
    """(train, its LoadStats, val) prompts of an RL recipe, as the data group says; too few training prompts for one
    batch fail here, before any model loads. A row's ground truth is required by the built-in rewards (they score
    against it: a row without one is an error), optional for the reward group's --reward-fn (a warning counts rows
    without) and unused by its --reward-model. Rows of the agent group's tool_agent are checked against its tools
    and interactions (common.agents.tools.check_agent_rows); the env group's --env-config plays environments whose
    seeds replace the files' rows (common.agents.envs.env_rows). --difficulty-loss-weight (the conditioning group's)
    needs a number in every training row."""
    own = reward.reward_fn or reward.judge_url or getattr(agent, "agent_fn", None)  # may need no ground truth
    ground_truth = "unused" if reward.reward_model else "optional" if own else "required"
    if env.env_config:
        if conditioning.difficulty_loss_weight:
            raise DataError("--difficulty-loss-weight: environment rows have no difficulty column; drop the flag")
        if data_args.domain_interleave_probs:
            raise DataError("--domain-interleave-probs: environment rows have no data_source to draw by; drop the flag")
        from common.agents.envs import play_rows

        return play_rows(env, data_args.train_batch_size)
    tools = None  # the function schemas tool_agent prompts are templated with
    if agent.tool_config:
        from common.agents.tools import read_tool_config

        tools = read_tool_config(agent.tool_config).schemas
    spec = dict(
        prompt_key=data_args.prompt_key,
        label_key=data_args.label_key,
        data_source=data_args.data_source,
        apply_chat_template=data_args.apply_chat_template,
        max_prompt_length=data_args.max_prompt_length,
        truncation=data_args.truncation,
        filter_overlong_prompts=data_args.filter_overlong_prompts,
        tools=tools,
        ground_truth=ground_truth,
    )
    files = [*data_args.train_files, *data_args.val_files]
    load = load_prompts  # small parquet files, templated here; the rest as a cached map (common.formats.prompt_cache)
    if not data.in_process(files, data_args.data_workers):
        from common.formats.prompt_cache import load_prompts as load

        spec["data_workers"] = data_args.data_workers
    train_files, val_files = data_args.train_files, data_args.val_files
    difficulty = conditioning.difficulty_loss_weight
    train, stats = load(train_files, tokenizer, **spec, difficulty=difficulty, what="train_files")
    if len(train) < data_args.train_batch_size:
        raise DataError(
            f"train_files hold {len(train)} prompts, fewer than train_batch_size={data_args.train_batch_size}"
        )
    if data_args.domain_interleave_probs:
        from common.shaping.domains import check_domains  # a feature: loaded where its flag asks for it

        check_domains(data_args.domain_interleave_probs, train)
    val, val_stats = load(val_files, tokenizer, **spec, what="val_files") if val_files else ([], LoadStats())
    if val_stats.filtered_overlong or val_stats.truncated:  # the run's header says the training rows' own
        log.warning("%s: validation scores the rows kept", val_stats.summary("val_files"))
    for described in dict.fromkeys([*stats.columns, *val_stats.columns]):  # one line per mapping, said once
        files = [Path(f).name for f in stats.columns.get(described, []) + val_stats.columns.get(described, [])]
        log.info("columns of %s: %s", ", ".join(files), described)
    if (agent.on or stats.agent_rows or val_stats.agent_rows) and not getattr(agent, "agent_fn", None):
        from common.agents.tools import check_rows

        train, val = list(train), list(val)  # it fills in each row's interaction_kwargs
        check_rows(train + val, agent)
    if missing := stats.no_ground_truth + val_stats.no_ground_truth if ground_truth == "optional" else 0:
        log.warning("%d rows have no ground truth: the reward function gets None", missing)
    return train, stats, val


def reward_task(row: dict, completion: Completion, text: str) -> tuple:
    """The reward pool's (data_source, solution_str, ground_truth, extra_info), with a conversation's extra_info."""
    extra_info = {**(row["extra_info"] or {}), **completion.extra_info} if completion.extra_info else row["extra_info"]
    return row["data_source"], text, row["ground_truth"], extra_info


def start_engine(model, tokenizer, dist, version: int, policy, rollout, placement, prompts: StepPrompts):
    """The engine an RL run's rollout group asks for, holding weights `version` (the step the run starts from):
    local_engine's, or, with the placement group's --rollout-placement remote, common.serving.remote.RemoteEngines
    (HF or vLLM engines in Ray actors, which sample `prompts`' steps ahead). One with its own weights syncs with
    `model` at once: call this after a resume has loaded them; then every --model-update-frequency versions."""
    if placement.remote:
        from common.serving.remote import start_remote_engines

        engine = start_remote_engines(model, tokenizer, dist, version, policy, rollout, placement, prompts)
    else:
        checkpoint = policy.path, policy.dtype, policy.trust_remote_code
        lengths = prompts.max_length + rollout.max_response_length
        engine = local_engine(model, tokenizer, dist, rollout, *checkpoint, lengths, rollout.val_batch_size, version)
    if rollout.model_update_frequency > 1:
        from common.serving.weight_sync import SyncEvery  # a feature: loaded where its flag asks for it

        return SyncEvery(engine, rollout.model_update_frequency)
    return engine


def local_engine(
    model,
    tokenizer,
    dist,
    engine,
    path: str,
    dtype: str,
    trust_remote_code: bool,
    max_model_len: int,
    batch_size: int,
    version: int = 0,
):
    """An engine in this process, as the engine group's --rollout-name asks: HFEngine on the live `model`
    (batch_size prompts a generate call), or a VLLMEngine loaded from the checkpoint at path (in dtype, or the
    engine group's --rollout-dtype), max_model_len tokens a sequence, synced with `model` (None: serving the
    checkpoint as it is)."""
    if engine.rollout_name == "hf":
        hf = HFEngine.for_policy(model, tokenizer, dist, batch_size=batch_size)
        hf.update_weights(version)
        return hf
    from common.serving.vllm_engine import VLLMEngine

    return VLLMEngine(
        model,
        model_path=path,
        eos_ids=[tokenizer.eos_token_id],
        dist=dist,
        dtype=dtype if engine.rollout_dtype == "auto" else engine.rollout_dtype,
        max_model_len=max_model_len,
        seed=dist.seed,
        vllm=engine.vllm,
        trust_remote_code=trust_remote_code,
        version=version,
    )


def with_agents(engine, tokenizer, pool, agent, env, max_prompt_length: int, lockstep: bool = True):
    """The engine behind the loop that plays a row over several turns: common.agents.agent.AgentLoop with the agent
    group's tools and interactions (their pools in `pool`, the reward pool), or common.agents.env_manager.EnvLoop
    (or the env group's --env-manager) over its environments, whose first prompts hold at most max_prompt_length
    tokens; the engine itself when neither group is on. lockstep False where each process generates alone."""
    if env.env_config:
        from common.agents.env_manager import EnvLoop

        manager = load_from_file(env.env_manager, "--env-manager", "", kind="class") if env.env_manager else EnvLoop
        return manager(engine, tokenizer, env, getattr(pool, "envs", None) or pool, max_prompt_length, lockstep)
    if getattr(agent, "agent_fn", None):
        from common.agents.endpoint import AgentFnLoop

        return AgentFnLoop(engine, tokenizer, agent, pool.agents, max_prompt_length)
    if not agent.on:
        return engine
    from common.agents.agent import AgentLoop

    return AgentLoop(engine, tokenizer, agent, pool.tools, pool.interactions, lockstep)


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
    g*n+n-1, plus those rows, group_ids (B,) and rollout_logprobs (B, T): the engine's (0 past a response's end), and
    kept (B, T) where the engine truncated its sampling (common.engines.Completion.kept)."""
    prompts, responses = [p["prompt_ids"] for p, _ in rows], [c.token_ids for _, c in rows]
    batch = pack_sequences(prompts, responses, tokenizer.pad_token_id, device)
    width = batch["responses"].shape[1]
    batch["rollout_logprobs"] = torch.tensor(
        [c.logprobs + [0.0] * (width - len(c.logprobs)) for _, c in rows], dtype=torch.float32, device=device
    )
    if any(c.kept for _, c in rows):  # the sampler's truncation, which the trainer's logprobs replay
        kept = [(c.kept or [0] * len(c.token_ids)) + [0] * (width - len(c.token_ids)) for _, c in rows]
        batch["kept"] = torch.tensor(kept, dtype=torch.long, device=device)
    for i, (_, c) in enumerate(rows):  # multi-turn: only the sampled tokens are the policy's (common.agents.agent)
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
        return Scored(
            [e["return"] for e in results], [{"acc": float(e["success"])} for e in results], ok=[True] * len(rows)
        )
    if rows and "agent_fn" in (rows[0][1].extra_info or {}):  # --agent-fn: the agent's own reward
        results = [c.extra_info["agent_fn"] for _, c in rows]
        failed = [r["failed"] for r in results]
        return Scored(
            [r["reward"] for r in results], [r["extras"] for r in results], sum(failed), ok=[not f for f in failed]
        )
    tasks = [reward_task(p, c, x) for (p, c), x in zip(rows, texts)]
    if getattr(pool, "judged", False):  # --judge-url: the judge reads the prompt too (a fork may bring its own pool)
        tasks = [(*t[:3], {**(t[3] or {}), JUDGE_MESSAGES: p["messages"]}) for t, (p, _) in zip(tasks, rows)]
    return pool.score(tasks)


def generate_and_score(prompts, engine, sampling, pool, tokenizer, device, reward_model=None) -> dict:
    """Steps 2-3 for this rank's prompts: sampling.n responses each, packed (pack_groups), scored by the reward pool
    (verl's compute_score) or the reward model. Adds weight_version (the engine's), engine_stats, scored (the pool's
    Scored: errors, timeouts, nonfinite, extra keys), rewards (B,) float32, timing {perf/generate_s, perf/score_s} and
    started (when generation began: perf/step_s counts from it)."""
    t = time.time()
    groups = sample(engine, prompts, sampling)
    rows = [
        (p if c.prompt_ids is None else {**p, "prompt_ids": c.prompt_ids}, c)
        for p, g in zip(prompts, groups)
        for c in g
    ]
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
        from common.agents.envs import env_metrics

        metrics.update(env_metrics(pairs, "val/env"))
    for source in sorted({d for d, *_ in results}):
        hits_d = [h for d, _, h in results if d == source]
        metrics[f"val/accuracy/{source}"] = sum(hits_d) / len(hits_d)
    if (n := sampling.n) > 1:  # verl's best@n of the accuracy: a prompt counts once any of its n responses hits
        solved = sum(gather_objects(sum(any(h for *_, h in mine[i : i + n]) for i in range(0, len(mine), n))))
        metrics[f"val/pass@{n}"] = solved / (len(results) // n)
    if log_generations:  # rank 0 holds the first rows (shard_evenly is contiguous); every rank sends its first N
        mine = [
            {
                "data_source": row["data_source"],
                "prompt": tokenizer.decode(row["prompt_ids"]),
                "response": texts[i * n],
                "ground_truth": str(row["ground_truth"]),
                "score": scored.scores[i * n],
            }
            for i, row in enumerate(local[:n_real][:log_generations])
        ]
        metrics["val/generations"] = [g for part in gather_objects(mine) for g in part][:log_generations]
    return metrics


@dataclass
class Rollout:
    """Steps 1-3 and validation of every RL recipe, over what they use together. step(i): this rank's share of step
    i's prompts (common.data.StepPrompts), sampled and scored (generate_and_score), with the step's epoch.
    validate(): val/* over `val` (evaluate, sampled as the validation group says) and perf/validate_s."""

    prompts: StepPrompts
    val: list[dict]
    engine: object
    pool: object
    tokenizer: object
    dist: Dist
    sampling: Sampling
    validation: "ValidationArgs"
    reward_model: object = None

    @property
    def train(self) -> list[dict]:
        return self.prompts.rows

    @property
    def batch_size(self) -> int:
        return self.prompts.data.train_batch_size

    def step(self, step: int) -> dict:
        watchdog.note(step=step + 1)
        epoch, ranks = self.prompts.step(step, self.dist.world_size)
        batch = generate_and_score(
            ranks[self.dist.rank],
            self.engine,
            self.sampling,
            self.pool,
            self.tokenizer,
            self.dist.device,
            self.reward_model,
        )
        batch["epoch"] = epoch
        return batch

    def validate(self) -> dict:
        start, v = time.time(), self.validation
        sampling = Sampling(
            v.val_n, v.val_temperature, v.val_top_p, v.val_top_k, self.sampling.max_tokens, min_p=v.val_min_p
        )
        metrics = evaluate(self.engine, self.pool, self.tokenizer, self.val, sampling, self.dist, v.log_val_generations)
        return {**metrics, "perf/validate_s": time.time() - start}


SAMPLED = (lambda a: a.val_temperature > 0, "add --val-temperature above 0 (at 0 validation is greedy)")


@dataclass
class ValidationArgs:
    """How each validation samples and what it logs (common.rollout.evaluate)."""

    val_temperature: float = flag(0.0, ge=0, note="0 is greedy")
    """validation sampling temperature; 0 is greedy"""
    val_n: int = flag(1, ge=1)
    """validation responses per prompt"""
    val_top_p: float = flag(1.0, gt=0, le=1, only_with=SAMPLED)
    """validation's nucleus sampling (1.0: off; verl's val_kwargs.top_p, apart from training's --top-p)"""
    val_top_k: int = flag(-1, rule=(lambda v: v == -1 or v >= 1, "-1 (off) or >= 1"), only_with=SAMPLED)
    """validation's top-k sampling (-1: off; verl's val_kwargs.top_k, apart from training's --top-k)"""
    val_min_p: float = flag(0.0, ge=0, lt=1, only_with=SAMPLED)
    """validation's min-p sampling (0.0: off; apart from training's --min-p)"""
    log_val_generations: int = flag(0, ge=0, note="0: none")
    """each validation, log the first N prompts with a response and its score (val_generations.jsonl; wandb table)"""
