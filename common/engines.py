"""Rollout engines: generate completions for token-id prompts (docs/engines.md).

    engine.generate(prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]
gives `sampling.n` completions per prompt, each token's logprob as the sampler saw it (after
temperature / top-k / top-p / min-p) and, where those truncated it, how many tokens the sampler kept (the
trainer replays that set: common.ops.logprobs_and_entropy's kept).
    engine.score(prompts, responses, temperature) -> list[list[float]]
gives the model's logprob of each response token (distill.py's teacher served by an engine).
The lifecycle hooks (`reset_cache`, `update_weights(version)`) serve engines with their own copy of the
policy (vLLM, which also sleeps and wakes inside its own calls; remote); the HF engine, the live policy, only
records versions.
"""

from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
import tyro

from common import watchdog
from common.data import pack_sequences, pad
from common.errors import UsageError
from common.flags import flag
from common.model import cache_kwarg, response_logprobs
from common.parallel import is_fsdp, unwrap
from common.serving import VLLMArgs


@dataclass(frozen=True)
class Sampling:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    max_tokens: int = 16
    budgets: tuple[int, ...] | None = None
    """per prompt, the most tokens to generate (each <= max_tokens): a multi-turn loop's room left in
    each conversation. vLLM stops each there; the HF engine generates a batch to max_tokens, and the
    loop cuts each response to its budget (the same tokens: a step never depends on later ones)"""
    min_p: float = 0.0  # keep the tokens at least min_p times as likely as the most likely one (0: off)

    @property
    def truncated(self) -> bool:
        """Whether top-k, top-p or min-p cut the distribution the engine samples from."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (at an eos token) | "length" (at max_tokens)
    version: int | None = None  # the weights that sampled it, when an engine holds its own (remote)
    mask: list[int] | None = None  # 1 where the policy sampled the token (common.agents.agent); None: every token
    extra_info: dict | None = None  # added to the row's extra_info for the reward (common.agents.agent: num_turns, ...)
    kept: list[int] | None = None  # per token, the most likely tokens top-k / top-p / min-p kept; None: all of them
    prompt_ids: list[int] | None = None  # the prompt it continues where not its row's (an --agent-fn agent's own)


class _SampledLogprobs:
    """A logits processor last in the list, so it sees the sampler's final distribution. It keeps one
    step's log-softmax until the next call shows the token sampled from it, then only that token's
    logprob: O(sequences x tokens) memory, where output_scores keeps the vocabulary every step. It counts
    each step's kept tokens too (the warpers set the others to -inf)."""

    def __init__(self):
        self.picked: list[torch.Tensor] = []  # (B,) per step
        self.kept: list[torch.Tensor] = []  # (B,) per step
        self.last: torch.Tensor | None = None  # (B, V) of the latest step only

    def __call__(self, input_ids, scores):
        if self.last is not None:
            self.picked.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.last = torch.log_softmax(scores.float(), -1)
        kept = torch.isfinite(scores).sum(-1)
        self.kept.append(kept.masked_fill(kept == scores.shape[-1], 0))  # 0: the whole vocabulary
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
        """The engine for a recipe's policy: its tokenizer's pad and eos, its Dist's device and world size."""
        return cls(
            model,
            pad_id=tokenizer.pad_token_id,
            eos_ids=[tokenizer.eos_token_id],
            device=dist.device,
            world_size=dist.world_size,
            batch_size=batch_size,
        )

    def reset_cache(self) -> None:  # common.serving.remote's engine actors reset theirs after each weight sync
        pass

    def update_weights(self, version: int) -> None:
        self.weight_version = version
        watchdog.note(version=version)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        """Under FSDP2 every rank must call this with the same number of prompts: the forward
        passes are collective (`synced_gpus` keeps them in step when one rank finishes early)."""
        from transformers import (
            GenerationConfig,
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        inner = unwrap(self.model)
        was_training = inner.training
        inner.eval()
        greedy = sampling.temperature == 0
        # The sampling warpers run in our own processor list, before the logprob recorder, so it
        # sees what the sampler samples from; greedy needs none (and transformers warns).
        warpers = []
        if not greedy:
            if sampling.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k > 0:
                warpers.append(TopKLogitsWarper(sampling.top_k))
            if sampling.top_p < 1.0:
                warpers.append(TopPLogitsWarper(sampling.top_p))
            if sampling.min_p > 0:
                warpers.append(MinPLogitsWarper(sampling.min_p))
        config = GenerationConfig(
            do_sample=not greedy,
            **({} if greedy else dict(temperature=1.0, top_p=1.0, top_k=0)),  # our warpers sample, not transformers'
            max_new_tokens=sampling.max_tokens,
            num_return_sequences=1,  # _generate_batch repeats each prompt n times itself
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            use_cache=True,
        )
        # generate fills unset fields from the model's generation_config.json (its top_k would change sampling)
        saved = inner.generation_config
        inner.generation_config = config
        out: list[list[Completion]] = []
        try:
            for start in range(0, len(prompts), self.batch_size):
                batch = prompts[start : start + self.batch_size]
                out.extend(self._generate_batch(inner, batch, config, warpers, sampling))
                watchdog.progress()
        finally:
            inner.generation_config = saved
        inner.train(was_training)
        return out

    @torch.no_grad()
    def score(
        self, prompts: list[list[int]], responses: list[list[int]], temperature: float = 1.0
    ) -> list[list[float]]:
        """The model's logprob of each response token (one list per response), the logits divided by
        temperature as the trainer's passes divide them. Not collective: no FSDP2 model here."""
        inner = unwrap(self.model)
        was_training = inner.training
        inner.eval()
        out = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = responses[start : start + self.batch_size]
            batch = pack_sequences(prompts[start : start + self.batch_size], chunk, self.pad_id, self.device)
            batch["group_ids"] = torch.arange(len(chunk), device=self.device)  # each row its own prompt
            logprobs = response_logprobs(inner, batch, share_prompts=False, temperature=temperature)[0].tolist()
            out.extend(row[: len(response)] for row, response in zip(logprobs, chunk))
        inner.train(was_training)
        return out

    def _generate_batch(self, inner, prompts, config, warpers, sampling) -> list[list[Completion]]:
        from transformers import DynamicCache, LogitsProcessorList

        n = sampling.n
        ids = pad(prompts, self.pad_id, side="left").to(self.device)
        attention = pad([[1] * len(p) for p in prompts], 0, side="left").to(self.device)
        cache = None
        if n > 1:
            # Prefill each prompt once, not n times (most of generate's time at 16 samples per prompt):
            # its samples start from copies of one KV cache, positions following the left padding as
            # generate's own prefill does. Every rank takes this path (FSDP2's forwards are
            # collective): one-token prompts get a padding column.
            if ids.shape[1] == 1:
                ids, attention = F.pad(ids, (1, 0), value=self.pad_id), F.pad(attention, (1, 0))
            cache = DynamicCache(config=inner.config)
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            inner(
                input_ids=ids[:, :-1],
                attention_mask=attention[:, :-1],
                position_ids=positions[:, :-1],
                **{cache_kwarg(inner): cache},
                use_cache=True,
                logits_to_keep=1,
            )
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
        kept = torch.stack(recorder.kept[: tokens.shape[1]], 1).tolist() if sampling.truncated else None
        completions = []
        for i, (row, lps) in enumerate(zip(tokens.tolist(), picked.tolist())):
            stop = next((t for t, tok in enumerate(row) if tok in self.eos_ids), None)
            end = len(row) if stop is None else stop + 1
            finish = "length" if stop is None else "stop"
            completions.append(Completion(row[:end], lps[:end], finish, kept=None if kept is None else kept[i][:end]))
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]


def hf_generate_greedy(
    model, prompts, *, pad_id, eos_id, max_new_tokens, batch_size, device, world_size=1
) -> list[list[int]]:
    """Greedy completion token ids (up to and including eos), one per prompt."""
    engine = HFEngine(
        model, pad_id=pad_id, eos_ids=[eos_id], device=device, world_size=world_size, batch_size=batch_size
    )
    return [c[0].token_ids for c in engine.generate(prompts, Sampling(n=1, temperature=0, max_tokens=max_new_tokens))]


OWN_WEIGHTS = (
    lambda a: a.rollout_name == "vllm" or getattr(a, "rollout_placement", "") == "remote",
    "add --rollout-name vllm or --rollout-placement remote (the HF engine runs in --dtype)",
)
CHECKING = (lambda a: a.check != "off", "drop --check off (the probe comes from the launch check)")
COLOCATED_VLLM = (
    lambda a: a.rollout_name == "vllm" and getattr(a, "rollout_placement", "") != "remote",
    "add --rollout-name vllm, colocated (the HF engine samples the live policy; remote engines lag by --max-staleness)",
)


@dataclass
class EngineArgs:
    """Which engine samples (common.rollout.start_engine), and vLLM's knobs when it is vLLM."""

    rollout_name: Literal["hf", "vllm"] = "hf"
    """rollout engine: hf (transformers generate on the live policy) or vllm (its own copy, synced each step)"""
    rollout_dtype: Literal["auto", "float32", "bfloat16", "float16"] = flag("auto", only_with=OWN_WEIGHTS)
    """the dtype an engine with weights of its own (vLLM, remote) samples in, each sync cast to it (verl's
    rollout.dtype: say bfloat16 beside float32 master weights); auto: --dtype, as the HF engine's always is"""
    vllm: Annotated[VLLMArgs, tyro.conf.OmitArgPrefixes] = field(default_factory=VLLMArgs)
    """vLLM's engine knobs (common.serving.vllm_engine)"""


@dataclass
class RolloutArgs(EngineArgs):
    """An RL run's engine and how it samples each step (verl's actor_rollout_ref.rollout)."""

    rollout_n: int = flag(16, ge=1)
    """responses sampled per prompt (the group)"""
    temperature: float = flag(1.0, ge=0, note="0 is greedy decoding")
    """sampling temperature (the trainer scales logits by it too)"""
    top_p: float = flag(1.0, gt=0, le=1)
    """nucleus sampling: keep the smallest token set with this much probability (1.0: off)"""
    top_k: int = flag(-1, rule=(lambda v: v == -1 or v >= 1, "-1 (off) or >= 1"))
    """sample among the k most likely tokens (-1: off)"""
    min_p: float = flag(0.0, ge=0, lt=1)
    """keep only the tokens at least this fraction as likely as the most likely one (vLLM's min_p; 0.0: off). Like
    --top-p and --top-k, the trainer's logprobs are taken over the tokens the engine kept, so the ratio stays exact"""
    max_response_length: int = flag(16, ge=1)
    """generated tokens per response"""
    val_batch_size: int = flag(256, ge=1)
    """prompts per generate call of the HF engine, in training and validation (verl's data.val_batch_size)"""
    check_freq: int = flag(1, ge=0, note="0: never during training", only_with=CHECKING)
    """after the launch check, the engine's logprobs stay the trainer's: an engine with its own weights (vLLM, remote)
    scores the launch probe after every N-th sync (check/engine_gap_*; a few short sequences), before it samples
    again, and the per-step gap (rollout/logprob_diff_*) is bounded where it proves the sync; past the bounds the run
    saves and stops, naming the step (0: never)"""
    model_update_frequency: int = flag(1, ge=1, only_with=COLOCATED_VLLM)
    """vllm: the engine gets the trainer's weights every N optimizer steps (ROLL's model_update_frequency): rollouts
    then lag the policy by up to N - 1 versions (--rollout-is corrects for it)"""

    def __post_init__(self):
        if self.temperature == 0:
            raise UsageError(
                "--temperature 0: greedy rollouts give every response of a group the same text, so there is nothing "
                "to compare; training samples (e.g. 1.0). Greedy validation is --val-temperature 0 (the default)"
            )

    @property
    def sampling(self) -> Sampling:
        """The training sampling: rollout_n responses a prompt."""
        return Sampling(
            self.rollout_n, self.temperature, self.top_p, self.top_k, self.max_response_length, min_p=self.min_p
        )
