"""Load a policy and its tokenizer (LoRA through peft); the forward passes that give response logits."""

import contextlib
import functools
import inspect
import logging
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
import tyro

from common import watchdog
from common.errors import UsageError
from common.flags import BUNDLED, flag
from common.ops import kl_from_logits, logprobs_and_entropy
from common.parallel import all_reduce_sum, is_fsdp, resolve_strategy, sharding_report, unwrap, wrap_model
from common.perf import compute_dtype, flop_terms

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def looks_local(path: str) -> bool:
    """A path (or an existing name) rather than a hub name such as Qwen/Qwen2.5-0.5B-Instruct."""
    return path.startswith((".", "/", "~")) or Path(path).expanduser().exists()


def check_source(path: str, what: str) -> str:
    """What from_pretrained takes for path (~ expanded); raises UsageError where a local path is no folder, for a
    remote filesystem's URL (hdfs://), and for a hub name missing from the cache when the hub is off (HF_HUB_OFFLINE)."""
    from huggingface_hub import constants, snapshot_download

    if "://" in path:
        raise UsageError(
            f"{what} {path!r}: {path.split('://')[0]}:// paths are not read here (no remote filesystem library is "
            f"chosen yet); copy the folder to a local disk first (hdfs dfs -get, aws s3 cp) and pass that folder"
        )
    if not looks_local(path) and constants.HF_HUB_OFFLINE:
        try:
            snapshot_download(path, local_files_only=True)
        except Exception:  # not cached (or not a hub name at all)
            raise UsageError(
                f"{what} {path!r} is not in the Hugging Face cache and HF_HUB_OFFLINE=1 forbids downloading it; "
                f"download it where the hub is reachable (hf download {path}) or pass a local folder"
            ) from None
    if looks_local(path) and not Path(path).expanduser().is_dir():
        raise UsageError(
            f"{what} folder {path!r} does not exist; pass a Hugging Face folder (config.json, "
            f"weights, tokenizer files) or a hub name such as Qwen/Qwen2.5-0.5B-Instruct"
        )
    return str(Path(path).expanduser()) if Path(path).expanduser().exists() else path


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(check_source(path, "tokenizer"), trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise UsageError(f"tokenizer {path!r} has neither a pad nor an eos token; set one")
        log.warning("tokenizer %s has no pad token; padding with eos %r", path, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        raise UsageError(
            f"tokenizer {path!r} has no chat template; use an instruct/chat model or add one "
            f"(tokenizer.chat_template) to its folder"
        )
    return tokenizer


def load_policy(
    path: str,
    *,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    lora_rank: int = 0,
    lora_alpha: int = 16,
    target_modules: tuple[str, ...] | list[str] = ("all-linear",),
    remove_padding: bool | str = False,
    torch_compile: bool = False,
):
    """AutoModelForCausalLM in `dtype`, with LoRA adapters (the base then frozen) where lora_rank > 0.
    remove_padding True or "auto": VARLEN attention, and response_logits packs batches (pack_mode)."""
    from transformers import AutoModelForCausalLM

    source = check_source(path, "model")
    attention = {"attn_implementation": register_varlen()} if remove_padding else {}
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, **attention
    )
    check_packs(model, path, remove_padding)
    model.config.use_cache = False
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        targets = list(target_modules)
        targets = "all-linear" if targets == ["all-linear"] else targets  # peft's keyword, not a module name
        config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules=targets, task_type="CAUSAL_LM")
        model = get_peft_model(model, config)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora_rank > 0:
            model.enable_input_require_grads()
    if torch_compile:  # a feature: loaded where --use-torch-compile asks for it
        from common.scaling.compile import compile_layers

        compile_layers(model)
    return model


def load_trained_model(policy: "ModelArgs", dist, path: str | None = None):
    """The model the policy group describes (load_policy, at `path` if given) wrapped for DDP / FSDP2 (--strategy
    auto|ddp|fsdp2). Returns (model, run_info: common.parallel.sharding_report of the layout, plus the FLOP terms
    and matmul dtype MFU needs)."""
    strategy = resolve_strategy(policy.strategy)
    model = load_policy(
        path or policy.path,
        dtype=policy.dtype,
        trust_remote_code=policy.trust_remote_code,
        gradient_checkpointing=policy.gradient_checkpointing,
        lora_rank=policy.lora_rank,
        lora_alpha=policy.lora_alpha,
        target_modules=policy.target_modules,
        remove_padding=policy.use_remove_padding,
        torch_compile=policy.use_torch_compile,
    )
    model = wrap_model(model, strategy, dist, policy.mixed_precision)
    compute = str(compute_dtype(policy.dtype, policy.mixed_precision)).removeprefix("torch.")
    return model, {**sharding_report(model, strategy, dist), "flops": flop_terms(model), "compute_dtype": compute}


def load_frozen(path: str, dist, policy: "ModelArgs"):
    """A forward-only causal LM at path (a reference, a teacher) in the policy group's dtype, precision, packing and
    compilation: no gradient, eval mode, sharded like the policy under FSDP2 (its forwards then collective), else on
    this rank's device."""
    model = load_policy(
        path,
        dtype=policy.dtype,
        trust_remote_code=policy.trust_remote_code,
        remove_padding=policy.use_remove_padding,
        torch_compile=policy.use_torch_compile,
    )
    model = model.eval().requires_grad_(False)
    strategy = "fsdp2" if resolve_strategy(policy.strategy) == "fsdp2" else "none"
    return wrap_model(model, strategy, dist, policy.mixed_precision)


class AdapterOff:
    """The reference under LoRA: the policy run inside peft's disable_adapter, so no copy is loaded. Its
    attributes (the wrapping, checkpointing) are the policy's, so response_logits treats both alike."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, **inputs):
        with unwrap(self.policy).disable_adapter():
            return self.policy(**inputs)

    def __getattr__(self, name):
        return getattr(self.policy, name)


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def _checkpointing(model) -> bool:
    inner = model.module if hasattr(model, "module") else model
    return bool(getattr(inner, "is_activation_checkpointing", False) or getattr(inner, "gradient_checkpointing", False))


# --- padding-free forward passes (verl's use_remove_padding) ------------------------------------------
VARLEN = "varlen_sdpa"


def register_varlen() -> str:
    """Register VARLEN with transformers and return its name, for attn_implementation.

    A call with cu_seq_lens_q (the packed row's sequence starts) attends causally within each sequence, through
    _varlen_kernel or else one sequence at a time: sum_i n_i^2, not a block mask's (sum_i n_i)^2; sliding windows
    kept. Other calls (padded batches, cached generation) are transformers' own sdpa attention."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        starts = kwargs.get("cu_seq_lens_q")
        if starts is None:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        unknown = [k for k in ("softcap", "s_aux") if kwargs.get(k) is not None]
        if unknown:  # logit soft-capping, attention sinks: terms these kernels do not apply
            raise UsageError(
                f"--use-remove-padding: {type(module).__name__} applies {' and '.join(unknown)} in "
                f"its attention, which the padding-free path does not; set --use-remove-padding False"
            )
        window, gqa = kwargs.get("sliding_window"), query.shape[1] != key.shape[1]
        dropout = dropout if module.training else 0.0
        if query.is_cuda and torch.is_autocast_enabled("cuda"):  # float32 rotary tables promote q and k:
            half = torch.get_autocast_dtype("cuda")  # back to autocast's dtype, which the varlen kernel takes
            query, key, value = query.to(half), key.to(half), value.to(half)
        kernel = _varlen_kernel(query) if not dropout else None
        takes = _keywords(kernel) if kernel is not None else set()
        if kernel is not None and "window_size" in takes:
            if gqa and "enable_gqa" not in takes:  # torch 2.11's kernel: each key / value head repeated for its queries
                key, value = (x.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for x in (key, value))
            extra = {"window_size": (window - 1, 0) if window else (-1, 0)}  # (-1, 0): causal
            extra |= {"enable_gqa": gqa} if "enable_gqa" in takes else {}
            longest = kwargs["max_length_q"]
            out = kernel(
                *(x[0].transpose(0, 1) for x in (query, key, value)),
                starts,
                starts,
                longest,
                longest,
                scale=scaling,
                **extra,
            )
            return out[None], None
        bounds, parts = starts.tolist(), []
        for a, b in zip(bounds, bounds[1:]):
            band = None
            if window and b - a > window:
                i = torch.arange(b - a, device=query.device)
                band = (i[:, None] >= i[None]) & (i[:, None] - i[None] < window)
            q, k, v = query[:, :, a:b], key[:, :, a:b], value[:, :, a:b]
            parts.append(
                F.scaled_dot_product_attention(
                    q, k, v, attn_mask=band, is_causal=band is None, dropout_p=dropout, scale=scaling, enable_gqa=gqa
                )
            )
        return torch.cat(parts, 2).transpose(1, 2).contiguous(), None

    def mask(**kwargs):  # a packed row has no padding mask and needs none: each sequence is causal in itself
        packed = kwargs.get("attention_mask") is None and kwargs["q_length"] == kwargs["kv_length"]
        return None if packed else sdpa_mask(**kwargs)

    AttentionInterface.register(VARLEN, attention)
    AttentionMaskInterface.register(VARLEN, mask)
    return VARLEN


def _varlen_kernel(query):
    """torch's flash-attention varlen kernel where it runs (CUDA, float16 / bfloat16, a torch with it), else None."""
    if not (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)):
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _keywords(fn) -> frozenset:
    """fn's parameter names, read once: torch's varlen kernel varies by release; cache_kwarg asks every forward."""
    return frozenset(inspect.signature(fn).parameters)


def _why_not_packed(model) -> str | None:
    """What keeps this model's attention from running packed, or None."""
    if not type(model).is_backend_compatible():  # no transformers attention interface: one sequence per row
        return "runs attention code of its own, which would let packed sequences attend to each other"
    if getattr(model.config, "attn_logit_softcapping", None):
        return "caps its attention logits (attn_logit_softcapping), which the padding-free attention does not"
    if any(name.endswith(".sinks") for name, _ in model.named_parameters()):
        return "has attention sinks, which the padding-free attention does not apply"
    return None


def check_packs(model, path: str, remove_padding: bool | str) -> None:
    """Records the mode on the model for pack_mode. A model the padding-free path cannot run
    (_why_not_packed) raises UsageError under True and runs padded, with a log line, under auto."""
    why = _why_not_packed(model) if remove_padding else None
    if why and remove_padding is True:
        raise UsageError(f"--use-remove-padding: {type(model).__name__} ({path}) {why}; set --use-remove-padding False")
    if why:
        log.info("%s (%s) %s: its forward passes stay padded", type(model).__name__, path, why)
        model.set_attn_implementation("sdpa")
    model.padding_free = False if why else remove_padding


def pack_mode(model) -> bool | str:
    """How this model's forwards lay batches out: False (padded), True (every micro-batch padding-free)
    or "auto" (where packs_batch decides). Only a VARLEN model packs."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    if getattr(getattr(inner, "config", None), "_attn_implementation", None) != VARLEN:
        return False
    return getattr(inner, "padding_free", True)


def packs(model) -> bool:
    """Whether the model can run padding-free (pack_mode True or auto)."""
    return bool(pack_mode(model))


# Measured on CPU (bench/packing.py): packing loses 10-20% where it removes little padding (its
# attention runs per sequence) and wins from about a fifth of the padded tokens removed.
PACK_GAIN = 1.25


def packs_batch(model, real_tokens: torch.Tensor, padded_tokens: int) -> bool:
    """Whether this micro-batch runs packed: always under pack_mode True; under auto where its padded pass
    runs PACK_GAIN x its real tokens or more, summed over the ranks under FSDP (whose forwards are collective)."""
    mode = pack_mode(model)
    if mode != "auto":
        return bool(mode)
    tokens = torch.stack([real_tokens.sum().double(), real_tokens.new_tensor(padded_tokens, dtype=torch.float64)])
    real, padded = (all_reduce_sum(tokens) if is_fsdp(model) else tokens).tolist()
    return padded >= PACK_GAIN * real


def pack_inputs(input_ids, attention_mask, position_ids) -> tuple[dict, torch.Tensor]:
    """(inputs for one row of every row's real tokens at their own positions with VARLEN's starts, the starts)."""
    real = attention_mask.bool()
    lengths = real.sum(-1)
    starts = F.pad(lengths.cumsum(0), (1, 0))
    cu, longest = starts.to(torch.int32), int(lengths.max())
    inputs = dict(
        input_ids=input_ids[real][None],
        position_ids=position_ids[real][None],
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=longest,
        max_length_k=longest,
    )
    return inputs, starts


def sequence_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """model(input_ids, attention_mask).logits for right-padded rows, (B, L, V); padding-free when
    the model packs this batch (packs_batch): the same logits at every real token, zeros at padding."""
    if not packs(model) or not packs_batch(model, attention_mask.sum(), attention_mask.numel()):
        return model(input_ids=input_ids, attention_mask=attention_mask).logits
    inputs, _ = pack_inputs(input_ids, attention_mask, (attention_mask.cumsum(-1) - 1).clamp(min=0))
    out = model(**inputs).logits[0]
    full = out.new_zeros(*input_ids.shape, out.shape[-1])
    full[attention_mask.bool()] = out
    return full


def _packed_outputs(model, batch: dict, keep_logits: bool) -> torch.Tensor:
    """response_outputs packed into one row (pack_inputs): only the outputs predicting a response token
    are made, then set back in the (b, T, ...) layout (zeros past each response's end)."""
    T, P = batch["responses"].shape[1], batch["input_ids"].shape[1] - batch["responses"].shape[1]
    inputs, starts = pack_inputs(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    real = batch["attention_mask"].bool()
    lengths, prompt_lengths = real.sum(-1), real[:, :P].sum(-1)
    t = torch.arange(T, device=real.device)
    exists = t[None] < (lengths - prompt_lengths)[:, None]  # (b, T): response positions holding a token
    index = (starts[:-1, None] + prompt_lengths[:, None] - 1 + t[None])[exists]  # the output before each token
    out = model(**inputs, logits_to_keep=index).logits[0] if keep_logits else model(**inputs).logits[0, index]
    full = out.new_zeros(len(lengths), T, out.shape[-1])
    full[exists] = out
    return full


# forward_layout's choices for models that can pack, since common.tracking.step_metrics last read
# them for perf/packed_share: {"packed": n, "one pass": n, "shared prompts": n}.
LAYOUTS: Counter = Counter()


def forward_layout(model, batch: dict, share_prompts: bool = True) -> str:
    """How response_outputs runs this micro-batch: "packed", "one pass" (the padded rows) or "shared
    prompts" (each group's prompt once, then its responses). Collective under FSDP with auto packing."""
    T, P = batch["responses"].shape[1], batch["input_ids"].shape[1] - batch["responses"].shape[1]
    starts = _group_starts(batch["group_ids"])
    one_pass = not share_prompts or _checkpointing(model) or (bool(starts.all()) and not is_fsdp(model))
    padded_tokens = len(starts) * (P + T) if one_pass else int(starts.sum()) * P + len(starts) * T
    padded = "one pass" if one_pass else "shared prompts"
    if not packs(model):
        return padded
    layout = "packed" if packs_batch(model, batch["attention_mask"].sum(), padded_tokens) else padded
    LAYOUTS[layout] += 1
    return layout


def _group_starts(group_ids: torch.Tensor) -> torch.Tensor:
    """Whether each row starts a group (a prompt the rows before it did not answer)."""
    starts = torch.ones_like(group_ids, dtype=torch.bool)
    starts[1:] = group_ids[1:] != group_ids[:-1]
    return starts


def response_outputs(model, batch: dict, share_prompts: bool, keep_logits: bool) -> torch.Tensor:
    """The model's `.logits` at the positions that predict each response token, (b, T, ...).

    With share_prompts each distinct prompt (its responses sit together) runs once, its KV cache repeated
    for the responses: one pass's outputs and gradients at a rollout_n-fold saving on prompt tokens. One
    pass instead under activation checkpointing (transformers drops the cache) or without groups, but not
    under FSDP, whose collective forwards need the same two calls on every rank. Packed where forward_layout
    says. keep_logits: the model takes logits_to_keep (causal LMs): only the needed positions are made."""
    from transformers import DynamicCache

    layout = forward_layout(model, batch, share_prompts)
    if layout == "packed":
        return _packed_outputs(model, batch, keep_logits)  # no pad token reaches the model
    T, P = batch["responses"].shape[1], batch["input_ids"].shape[1] - batch["responses"].shape[1]
    keys = ("input_ids", "attention_mask", "position_ids")
    keep = (lambda n: {"logits_to_keep": n}) if keep_logits else (lambda n: {})  # noqa: E731
    if layout == "one pass":
        return model(**{k: batch[k] for k in keys}, **keep(T + 1)).logits[:, -T - 1 : -1]
    starts = _group_starts(batch["group_ids"])
    first = starts.nonzero().squeeze(-1)  # each prompt's first row
    owner = starts.cumsum(0) - 1  # which distinct prompt each row answers
    cache = DynamicCache()  # passed in: a token-classification output carries no cache of its own
    cached = {cache_kwarg(model): cache, "use_cache": True}
    prompt = model(**{k: batch[k][first, :P] for k in keys}, **cached, **keep(1))
    for layer in cache.layers:  # index_select: the backward of batch_select_indices' x[owner] took 15x as long
        layer.keys, layer.values = layer.keys.index_select(0, owner), layer.values.index_select(0, owner)
    positions = batch["position_ids"][:, P:]
    out = model(input_ids=batch["responses"], attention_mask=batch["attention_mask"], position_ids=positions, **cached)
    return torch.cat([prompt.logits[:, -1:].index_select(0, owner), out.logits[:, :-1]], 1)


def cache_kwarg(model) -> str:
    """The KV-cache keyword of a model's forward and generate, through DDP and peft: `cache` from transformers
    5.24 (past_key_values warns there, goes in 5.40); earlier 5.x and remote-code models may know only the latter."""
    base = unwrap(model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    return "cache" if "cache" in _keywords(type(base).forward) else "past_key_values"


def response_logits(model, batch: dict, share_prompts: bool = True) -> torch.Tensor:
    """(b, T, V) logits for a (micro-)batch of common.data.pack_sequences / take_rows plus `group_ids`:
    position t predicts response token t. With share_prompts each group's prompt runs once."""
    watchdog.progress()
    return response_outputs(model, batch, share_prompts, keep_logits=True)


# Where response_logprobs made the logits: {"fused": n, reason the head ran whole: n}, since tracking.step_metrics
# last read it for perf/fused_head_share.
HEADS: Counter = Counter()
_SAID: set = set()


def response_logprobs(model, batch: dict, share_prompts: bool, temperature: float, with_entropy=False, kl_ref=None):
    """(logprobs, entropy or None, KL or None) of the response tokens of a micro-batch (response_logits' batch),
    each (b, T): the logits divided by temperature; with kl_ref (a reference model) the exact KL(model || kl_ref)
    of each token's whole next-token distribution. Where the engine truncated its sampling (the batch's kept:
    top-k, top-p, min-p), each logprob is over the tokens it kept, as the engine's was.

    The LM head is fused with the logprob where it can be (why_head_whole): the forward stops at the hidden states
    of the response positions and common.ops.logprobs_and_entropy makes the logits chunk by chunk, so neither the
    (b, T, vocabulary) logits nor their gradient exist: at a real vocabulary most of the update's memory."""
    responses, mask, kept = batch["responses"], batch["response_mask"], batch.get("kept")
    why = why_head_whole(model) if kl_ref is None else "the exact KL over the vocabulary needs the whole logits"
    if why and why not in _SAID:
        _SAID.add(why)
        log.info("the LM head of %s runs whole (no fused logprob): %s", type(_base(model)).__name__, why)
    HEADS[why or "fused"] += 1
    if why is None:
        head = output_head(model)
        with skipped(head):  # the model's `.logits` are then the head's input
            hidden = response_logits(model, batch, share_prompts)
        fused = (head.weight, head.bias, getattr(_base(model), "autocast_dtype", None))
        return *logprobs_and_entropy(hidden, responses, mask, with_entropy, temperature, fused, kept), None
    with torch.no_grad():  # the reference's first: one forward of it, outside the policy's graph
        ref_logits = None if kl_ref is None else response_logits(kl_ref, batch, share_prompts) / temperature
    logits = response_logits(model, batch, share_prompts)
    logprobs, entropy = logprobs_and_entropy(logits, responses, mask, with_entropy, temperature, kept=kept)
    return logprobs, entropy, (None if kl_ref is None else kl_from_logits(logits / temperature, ref_logits))


def _base(model):
    """The model under DDP and AdapterOff (peft's PeftModel stays: its forward applies the adapter)."""
    return unwrap(model.policy if isinstance(model, AdapterOff) else model)


def output_head(model) -> torch.nn.Module:
    base = _base(model)
    return (base.get_base_model() if hasattr(base, "get_base_model") else base).get_output_embeddings()


@contextlib.contextmanager
def skipped(module: torch.nn.Module):
    """module(x) returns x inside the block."""
    own = module.__dict__.get("forward")  # a hook's wrapper (accelerate's) stays
    module.forward = lambda x: x
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


_HEAD_CHECKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def why_head_whole(model) -> str | None:
    """Why response_logprobs cannot fuse the model's LM head (None: it can). It can where the head is a plain
    Linear whose output the forward returns as it is, checked once per model on a few tokens: that excludes a
    head LoRA wraps, FSDP2's sharded weights (only its forward gathers them) and models that soft-cap or scale
    their logits after the head (Gemma 2, Cohere, Granite)."""
    if is_fsdp(model):
        return "FSDP2 shards its weight, which only the model's forward gathers"
    base, head = _base(model), output_head(model)
    if type(head) is not torch.nn.Linear:
        return f"it is a {type(head).__name__}, not a plain Linear (LoRA or modules_to_save on lm_head?)"
    if base not in _HEAD_CHECKS:
        _HEAD_CHECKS[base] = _check_head(base, head)
    return _HEAD_CHECKS[base]


@torch.no_grad()
def _check_head(base, head) -> str | None:
    """Whether, on 4 tokens, the forward's logits are the head's output at the head's input, to the bit, and the
    forward with the head skipped returns that input."""
    was_training, dtype = base.training, getattr(base, "autocast_dtype", None) or head.weight.dtype
    ids = torch.arange(4, device=head.weight.device)[None] % base.config.vocab_size
    taken = []
    hook = head.register_forward_pre_hook(lambda module, args: taken.append(args[0]))
    try:
        base.eval()  # no dropout: the two forwards must meet
        logits = base(input_ids=ids).logits
        hook.remove()
        with skipped(head):
            hidden = base(input_ids=ids).logits
    finally:
        hook.remove()
        base.train(was_training)
    if len(taken) != 1:
        return f"the model's forward calls it {len(taken)} times, not once"
    bias = None if head.bias is None else head.bias.to(dtype)
    if not torch.equal(F.linear(taken[0].to(dtype), head.weight.to(dtype), bias).to(logits.dtype), logits):
        return "the model's forward changes the head's output (soft-capped or scaled logits?)"
    if not torch.equal(hidden, taken[0]):
        return "the model's forward with the head skipped does not return the head's input"
    return None


def trainer_logprobs(model, batch: dict, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        return response_logprobs(model, batch, share_prompts=False, temperature=temperature)[0]


LORA = (lambda a: getattr(a, "lora_rank", 0) > 0, "set --lora-rank (LoRA is off at 0)")  # when LoRA's knobs are read


@dataclass
class ModelArgs:
    """The policy's model: where it comes from, its dtype, LoRA, how it is sharded and how its passes run."""

    path: Annotated[str, tyro.conf.arg(name="model")] = str(BUNDLED / "tiny-qwen2")
    """policy: a local Hugging Face folder or a hub name"""
    tokenizer: str | None = None
    """tokenizer folder or hub name (default: the model's)"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype the weights are loaded and trained in"""
    trust_remote_code: bool = False
    """allow model code from the model folder / hub (off: only transformers' own architectures)"""
    strategy: Literal["auto", "ddp", "fsdp2"] = "auto"
    """data parallelism: auto is fsdp2 under an accelerate FSDP config, else ddp"""
    mixed_precision: Literal["no", "bf16"] = "no"
    """bf16: compute in bfloat16 over the --dtype master weights (FSDP2: bf16 params, float32
    gradient reduction; DDP / one process: autocast)"""
    gradient_checkpointing: bool = False
    """recompute activations in backward to save memory"""
    lora_rank: int = flag(0, ge=0, note="0 trains the full model")
    """LoRA rank; 0 trains the full model"""
    lora_alpha: int = flag(16, ge=1, only_with=LORA)
    """LoRA scaling numerator (scale = lora_alpha / lora_rank)"""
    target_modules: tuple[str, ...] = flag(("all-linear",), only_with=LORA)
    """modules that get LoRA adapters: 'all-linear' or names such as q_proj v_proj"""
    use_remove_padding: Literal["auto"] | bool = "auto"
    """padding-free forward passes (verl's name): a micro-batch's sequences packed into one row, attention kept
    within each sequence; about 2x faster where lengths spread, slower where they do not. auto: the micro-batches
    whose padded pass would run 1.25x their real tokens or more; True: every one; False: none"""
    use_torch_compile: bool = False
    """torch.compile each decoder layer of the policy and reference (verl's key compiles its logprob and entropy
    functions; here those are one fused op already): fewer, fused kernels in each pass, after a first step that
    compiles (tens of seconds on a GPU, minutes on a CPU)"""

    @property
    def trainer_dtype(self) -> torch.dtype:
        """The dtype the trainer computes in: bfloat16 under --mixed-precision bf16, else --dtype."""
        return torch.bfloat16 if self.mixed_precision == "bf16" else getattr(torch, self.dtype)
