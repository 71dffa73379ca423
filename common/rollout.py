"""A step's batch, whichever engine samples it: start_engine builds the engine the flags ask for
(common.engines, common.remote, behind common.agent's loop for tool rows); generate_and_score
samples and scores one rank's prompts and packs them for the trainer; evaluate gives val/*; Rollout
holds what steps 1-3 and validation use together.
"""

import time
from dataclasses import dataclass

import torch

from common import watchdog
from common.data import pack_sequences, step_rows
from common.engines import Completion, HFEngine, Sampling, VLLMEngine
from common.engines import hf_generate_greedy as hf_generate_greedy  # re-exported for older forks
from common.model import load_frozen
from common.parallel import Dist, gather_objects, shard_evenly
from common.rewards import Scored
from common.scoring import hit, load_from_file
from common.tracking import env_metrics


def reward_task(row: dict, completion: Completion, text: str) -> tuple:
    """The reward pool's (data_source, solution_str, ground_truth, extra_info) for one response;
    a conversation's own extra_info (common.agent) is added to a copy of the row's."""
    extra_info = row["extra_info"]
    if completion.extra_info:
        extra_info = {**(extra_info or {}), **completion.extra_info}
    return row["data_source"], text, row["ground_truth"], extra_info


def start_engine(model, tokenizer, dist, version: int = 0, *, rollout_name: str = "hf", batch_size: int = 256,
                 remote: dict | None = None, agent: dict | None = None, env: dict | None = None,
                 **vllm_kwargs):  # fmt: skip
    """The rollout engine --rollout-name and --rollout-placement ask for, holding weights `version`
    (the step the run starts from): the HF engine on the live policy (the vLLM flags unused), a
    VLLMEngine loaded from model_path and synced with `model` at once, or (remote: the
    PlacementArgs) common.remote.RemoteEngines, HF or vLLM engines in Ray actors, synced at once. Call it
    after a resume has loaded the trainer's weights, or an engine with its own copy would start
    from the checkpoint's base model. With `agent` (common.config.AgentArgs.agent_kwargs) the
    engine runs behind common.agent.AgentLoop; with `env` (common.config.EnvArgs.env_kwargs) behind
    common.env_manager.EnvLoop, or the --env-manager class that subclasses it."""
    if env is not None:
        from common.env_manager import EnvLoop

        inner = start_engine(model, tokenizer, dist, version, rollout_name=rollout_name, batch_size=batch_size,
                             remote=remote, **vllm_kwargs)  # fmt: skip
        manager = load_from_file(env["manager"], "--env-manager", "", kind="class") if env["manager"] else EnvLoop
        return manager(inner, tokenizer, **{k: v for k, v in env.items() if k != "manager"})
    if agent is not None:
        from common.agent import AgentLoop

        inner = start_engine(model, tokenizer, dist, version, rollout_name=rollout_name, batch_size=batch_size,
                             remote=remote, **vllm_kwargs)  # fmt: skip
        return AgentLoop(inner, tokenizer, **agent)
    if remote is not None:
        from common.remote import RemoteEngines

        return RemoteEngines(
            model, dist, version, model_path=vllm_kwargs["model_path"], num_engines=remote["num_rollout_engines"],
            engine_num_cpus=remote["engine_num_cpus"], engine_num_gpus=remote["engine_num_gpus"],
            ray_address=remote["ray_address"], max_staleness=remote["max_staleness"], timeout=remote["engine_timeout"],
            seed=vllm_kwargs["seed"], dtype=vllm_kwargs["dtype"], trust_remote_code=vllm_kwargs["trust_remote_code"],
            pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], batch_size=batch_size,
            schedule=remote["schedule"], total_steps=remote["total_steps"],
            vllm=None if rollout_name == "hf" else {k: v for k, v in vllm_kwargs.items()
                                                     if k not in ("model_path", "dtype", "trust_remote_code")},
        )  # fmt: skip
    if rollout_name == "hf":
        engine = HFEngine.for_policy(model, tokenizer, dist, batch_size=batch_size)
        engine.update_weights(version)
        return engine
    return VLLMEngine(model, eos_ids=[tokenizer.eos_token_id], dist=dist, version=version, **vllm_kwargs)


def start_teacher(path: str, dist, tokenizer, *, engine: str = "hf", placement: str = "colocated",
                  frozen: dict | None = None, vllm: dict | None = None, remote: dict | None = None):  # fmt: skip
    """distill.py's teacher as --teacher-engine and --teacher-placement ask (common.config.TeacherArgs
    gives the keyword arguments): hf colocated is the model itself (common.model.load_frozen: forward
    passes in the trainer, sharded under FSDP2); the others are engines that serve its logprobs of
    the sampled tokens (engine_logprobs), holding path's weights as they are: a VLLMEngine in this
    process (vLLM's prompt logprobs), or common.remote.RemoteEngines, HF or vLLM engines in Ray actors."""
    if placement == "colocated" and engine == "hf":
        return load_frozen(path, dist, **frozen)
    if placement == "colocated":
        return VLLMEngine(None, model_path=path, eos_ids=[tokenizer.eos_token_id], dist=dist, **vllm)
    from common.remote import RemoteEngines

    return RemoteEngines(None, dist, 0, model_path=path, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id],
                         vllm=vllm if engine == "vllm" else None, role="teacher engine", **remote)  # fmt: skip


def engine_logprobs(engine, batch: dict, temperature: float) -> torch.Tensor:
    """The logprob an engine's model gives each response token of a trainer batch (common.engines'
    score of each row's prompt and response, read off the batch's tensors), (B, T) on the batch's
    device, 0 past each response. Collective for remote engines, as generate is."""
    T = batch["responses"].shape[1]
    P = batch["input_ids"].shape[1] - T
    ids, real = batch["input_ids"].cpu(), batch["attention_mask"].cpu().bool()
    prompts = [row[:P][keep[:P]].tolist() for row, keep in zip(ids, real)]
    responses = [row[P:][keep[P:]].tolist() for row, keep in zip(ids, real)]
    scored = engine.score(prompts, responses, temperature)
    padded = [logprobs + [0.0] * (T - len(logprobs)) for logprobs in scored]
    return torch.tensor(padded, dtype=torch.float32, device=batch["responses"].device)


def pack_groups(rows: list[tuple], n: int, tokenizer, device) -> dict:
    """The trainer tensors (common.data.pack_sequences) for rows [(prompt row, Completion)] whose
    group g sits at rows g*n .. g*n+n-1, plus those rows, group_ids (B,) and rollout_logprobs
    (B, T): the engine's logprob of each sampled token (0 past a response's end)."""
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
    """One batch of groups picked from several generate_and_score batches (parts, of any rank), as
    DAPO's dynamic sampling keeps them: each group [(row, reward, score, extra)] per response, in
    the order of its part's rows / rewards / scored. The counts of every part's scoring (errors,
    timeouts) stay counted, and timing sums over the parts."""
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
    """sampling.n completions of each prompt row: through the agent loop when the engine runs one
    (common.agent.AgentLoop: each row's agent_name), else from its prompt ids alone."""
    if hasattr(engine, "generate_rows"):
        return engine.generate_rows(prompts, sampling)
    return engine.generate([p["prompt_ids"] for p in prompts], sampling)


def is_env_row(row: dict) -> bool:
    return row.get("agent_name") == "env"


def score(pool, rows: list[tuple], texts: list[str]) -> Scored:
    """The reward pool's scores for [(prompt row, Completion)]; an environment's trajectory
    (common.env_manager) scores its return, and counts as correct when it succeeded."""
    if rows and is_env_row(rows[0][0]):
        results = [c.extra_info["env"] for _, c in rows]
        return Scored([e["return"] for e in results], [{"acc": float(e["success"])} for e in results],
                      ok=[True] * len(rows))  # fmt: skip
    return pool.score([reward_task(p, c, x) for (p, c), x in zip(rows, texts)])


def generate_and_score(prompts, engine, sampling, pool, tokenizer, device, reward_model=None) -> dict:
    """Steps 2-3 of every RL recipe for this rank's prompts (rows from common.data.load_prompts):
    sampling.n responses each, packed for the trainer (common.data.pack_sequences), then scored
    by the reward pool (verl's compute_score) or, when given, the reward model.

    Adds rows [(prompt row, Completion)] with group g at rows g*n .. g*n+n-1, group_ids (B,),
    rollout_logprobs (B, T), weight_version (the engine's), scored (the pool's Scored: errors,
    timeouts, nonfinite, extra keys), rewards (B,) float32, and timing
    {perf/generate_s, perf/score_s}, and started (when the generation began: perf/step_s counts from it).
    """
    t = time.time()
    groups = sample(engine, prompts, sampling)
    rows = [(p, c) for p, group in zip(prompts, groups) for c in group]
    responses = [c.token_ids for _, c in rows]
    batch = pack_groups(rows, sampling.n, tokenizer, device)
    batch["started"], batch["timing"] = t, {"perf/generate_s": time.time() - t}
    batch["weight_version"] = (
        engine.weight_version
    )  # the weights it holds now (a Completion's version: those that sampled it)
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
    """Sample responses to every row (sharded over ranks), score them, and return val/* metrics:
    the mean reward, the accuracy overall and per data_source (a result's own "acc" key when
    it has one, else score > 0), and the samples whose scoring raised, timed out or gave NaN (counted
    in val/reward/errors, timeouts and nonfinite: they score 0, so they must not pass for wrong
    answers). With log_generations N (verl's trainer.log_val_generations), val/generations holds
    the first N rows' prompt, first response, ground truth and score, for common.tracking to log.
    Through the agent loop (common.agent), also val/agent/*: this rank's conversations."""
    local, n_real = shard_evenly(rows, dist)
    completions = sample(engine, local, sampling)[:n_real]
    agent = engine.agent_metrics() if hasattr(engine, "agent_metrics") else {}  # this rank's conversations
    pairs = [(row, c) for row, group in zip(local[:n_real], completions) for c in group]
    texts = tokenizer.batch_decode([c.token_ids for _, c in pairs], skip_special_tokens=True)
    scored = score(pool, pairs, texts)
    hits = [hit(s, e) for s, e in zip(scored.scores, scored.extras)]
    mine = list(zip([r["data_source"] for r, _ in pairs], scored.scores, hits))
    results = [x for part in gather_objects(mine) for x in part]
    failures = [sum(c) for c in zip(*gather_objects((scored.errors, scored.timeouts, scored.nonfinite)))]
    metrics = {
        "val/reward/mean": sum(s for _, s, _ in results) / len(results),
        "val/accuracy": sum(h for *_, h in results) / len(results),
        "val/reward/errors": failures[0],
        "val/reward/timeouts": failures[1],
        "val/reward/nonfinite": failures[2],
        **{f"val/{k}": v for k, v in agent.items()},
        **(env_metrics(pairs, "val/env") if local and is_env_row(local[0]) else {}),
    }
    for source in sorted({d for d, *_ in results}):
        hits_d = [h for d, _, h in results if d == source]
        metrics[f"val/accuracy/{source}"] = sum(hits_d) / len(hits_d)
    if log_generations:  # rank 0 holds the first rows (shard_evenly is contiguous); every rank sends its first N
        n = sampling.n
        mine = [{"data_source": row["data_source"], "prompt": tokenizer.decode(row["prompt_ids"]),
                 "response": texts[i * n], "ground_truth": str(row["ground_truth"]), "score": scored.scores[i * n]}
                for i, row in enumerate(local[:n_real][:log_generations])]  # fmt: skip
        metrics["val/generations"] = [g for part in gather_objects(mine) for g in part][:log_generations]
    return metrics


@dataclass
class Rollout:
    """Steps 1-3 and validation of every RL recipe, over what they use together: the prompts, the
    engine, the reward pool (and reward model, when one scores), the tokenizer and the process
    layout. step(i): this rank's share of step i's prompts (common.data.step_rows: batch_size
    prompts a step in a seeded order per epoch), sampling.n responses each, scored
    (generate_and_score), with the step's epoch. validate(): val/* over `val` (evaluate) and its
    seconds, perf/validate_s."""

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

    def validate(self) -> dict:
        start = time.time()
        metrics = evaluate(self.engine, self.pool, self.tokenizer, self.val, self.val_sampling, self.dist,
                           self.log_val_generations)  # fmt: skip
        return {**metrics, "perf/validate_s": time.time() - start}
