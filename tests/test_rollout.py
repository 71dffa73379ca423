import copy
import json
import warnings

import pytest
import torch
from conftest import ROOT, TASK_TEST, load_recipe, make_args, torchrun_plan

from common.data import load_prompts, pack_sequences
from common.engines import HFEngine, Sampling
from common.model import load_policy
from common.ops import logprobs_from_logits

SFT = str(ROOT / "bundled" / "tiny-qwen2-sft")


@pytest.fixture(scope="module")
def setup(tokenizer):
    model = load_policy(SFT)
    rows, _ = load_prompts([TASK_TEST], tokenizer, max_prompt_length=64)
    prompts = [r["prompt_ids"] for r in rows[:4]]
    prompts[1] = prompts[1][7:]  # a shorter prompt, so the batch is really left-padded
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cpu")
    return model, prompts, engine


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampler_logprobs_match_the_trainer_forward(setup, tokenizer, temperature):
    """The engine's per-token logprobs equal a trainer forward over the packed batch (left-padded
    prompts, position ids from the mask, logits / temperature): the basis of on-policy ratios."""
    model, prompts, engine = setup
    torch.manual_seed(0)
    groups = engine.generate(prompts, Sampling(n=3, temperature=temperature, max_tokens=8))
    assert [len(g) for g in groups] == [3, 3, 3, 3]
    flat = [c for g in groups for c in g]
    batch = pack_sequences([p for p in prompts for _ in range(3)], [c.token_ids for c in flat], tokenizer.pad_token_id)
    T = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    trainer = logprobs_from_logits(logits[:, -T - 1 : -1] / temperature, batch["responses"])
    for i, c in enumerate(flat):
        assert len(c.logprobs) == len(c.token_ids)
        assert torch.allclose(trainer[i, : len(c.logprobs)], torch.tensor(c.logprobs), atol=1e-4)
        assert c.finish_reason == ("stop" if c.token_ids[-1] == tokenizer.eos_token_id else "length")


def test_each_prompt_is_prefilled_once_for_its_n_samples(setup):
    """The prompt forward runs on the prompts, not on n copies of each; its samples start from
    copies of that KV cache and get what n separate greedy runs get (left padding included). The
    cache goes by the keyword the model's forward declares (common.model.cache_kwarg), so
    transformers never warns that the old one is going."""
    model, prompts, engine = setup
    widths = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            shared = engine.generate(prompts, Sampling(n=3, temperature=0, max_tokens=8))
    finally:
        hook.remove()
    assert not [w for w in caught if "past_key_values" in str(w.message)], [str(w.message) for w in caught]
    longest = max(len(p) for p in prompts)
    assert widths[0] == (len(prompts), longest - 1), "the prompt forward, once per prompt"
    assert all(w[0] == 3 * len(prompts) and w[1] <= 1 for w in widths[1:]), "then one token at a time for 3n rows"
    alone = engine.generate(prompts, Sampling(n=1, temperature=0, max_tokens=8))
    tiny = [prompts[0][-1:]] * 2  # one-token prompts: the prompt forward still runs (a padding column)
    for got, want in [
        (shared, alone),
        (
            engine.generate(tiny, Sampling(n=2, temperature=0, max_tokens=4)),
            engine.generate(tiny, Sampling(n=1, temperature=0, max_tokens=4)),
        ),
    ]:
        for group, (one,) in zip(got, want):
            for c in group:
                assert c.token_ids == one.token_ids and c.logprobs == pytest.approx(one.logprobs, abs=1e-5)


def test_a_model_of_its_own_code_gets_the_cache_by_its_old_name(setup):
    """A forward that knows only past_key_values (a trust_remote_code model, transformers before
    5.24) gets the cache by that name; the bundled model gets the name its forward declares, through
    a PEFT wrapper too."""
    import inspect

    from peft import LoraConfig, get_peft_model

    from common.model import cache_kwarg

    class OwnCode(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=None):
            return input_ids

    model = setup[0]
    declared = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    assert cache_kwarg(OwnCode()) == "past_key_values"
    assert cache_kwarg(model) == declared
    wrapped = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj"]))
    assert cache_kwarg(wrapped) == declared


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_the_exact_kl_to_a_lora_reference_in_a_recipes_forward(setup, tokenizer, recipe):
    """forward_logprobs with kl_ref (kl_penalty / kl_loss_type full), the reference being the LoRA
    policy with its adapter off (common.model.AdapterOff): per response token, the KL between the
    adapted policy's and the base model's whole next-token distributions at the sampling
    temperature, as full separate passes give it, and its gradient reaches the
    adapter while the policy keeps its adapter on afterwards."""
    from types import SimpleNamespace

    from common.model import AdapterOff

    module, (base, prompts, engine) = load_recipe(recipe), setup
    torch.manual_seed(0)
    groups = engine.generate(prompts, Sampling(n=2, temperature=1.0, max_tokens=8))
    flat = [c for g in groups for c in g]
    batch = pack_sequences([p for p in prompts for _ in range(2)], [c.token_ids for c in flat], tokenizer.pad_token_id)
    batch["group_ids"] = torch.arange(len(prompts)).repeat_interleave(2)
    policy = load_policy(SFT, lora_rank=4, lora_alpha=8)
    with torch.no_grad():  # a trained adapter: B away from its zero start
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    plan, T = SimpleNamespace(share_prompts=True, temperature=0.7), batch["responses"].shape[1]
    logprobs, _, kl = module.forward_logprobs(policy, batch, torch.arange(8), plan, kl_ref=AdapterOff(policy))
    keys = ("input_ids", "attention_mask", "position_ids")
    with torch.no_grad():
        p = torch.log_softmax(policy(**{k: batch[k] for k in keys}).logits[:, -T - 1 : -1] / 0.7, -1)
        q = torch.log_softmax(base(**{k: batch[k] for k in keys}).logits[:, -T - 1 : -1] / 0.7, -1)
    mask = batch["response_mask"][:8].bool()
    want = (p.exp() * (p - q)).sum(-1)[:8]
    assert kl.shape == logprobs.shape == (8, T)  # the loss masks padding, as it does the entropy's
    assert torch.allclose(kl[mask], want[mask], atol=1e-5) and want[mask].max() > 1e-3
    assert torch.allclose(logprobs[mask], p[:8].gather(-1, batch["responses"][:8, :, None])[..., 0][mask], atol=1e-5)
    kl[mask].sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in policy.named_parameters() if "lora_B" in n)


@pytest.mark.parametrize("rows", [slice(0, 12), slice(2, 11), slice(5, 6)])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_packed_forward_equals_the_padded_one(setup, tokenizer, rows, family):
    """--use-remove-padding: the micro-batch's sequences in one row, attention within each
    (common.model.VARLEN). The response logprobs and entropies, the critic's values and the
    gradients equal the padded pass's within float32 summation order, on responses of uneven length,
    for both model families the bundle holds (Llama's: grouped key-value heads, no attention bias)."""
    from common.critic import load_critic, response_values
    from common.data import take_rows
    from common.model import ModelArgs, packs, response_logits, sequence_logits
    from common.ops import logprobs_and_entropy

    qwen, prompts, engine = setup
    path = SFT if family == "qwen2" else str(ROOT / "bundled" / "tiny-llama")
    base = qwen if family == "qwen2" else load_policy(path)
    torch.manual_seed(1)
    groups = engine.generate(prompts, Sampling(n=3, temperature=1.5, max_tokens=24))
    flat = [c for g in groups for c in g]
    assert len({len(c.token_ids) for c in flat}) > 2, "uneven lengths"
    batch = pack_sequences([p for p in prompts for _ in range(3)], [c.token_ids for c in flat], tokenizer.pad_token_id)
    batch["group_ids"] = torch.arange(len(prompts)).repeat_interleave(3)
    mb = take_rows(batch, rows)
    mask = mb["response_mask"].bool()
    packed = load_policy(path, remove_padding=True)
    assert packs(packed) and not packs(base)
    results = []
    for model in (base, packed):
        model.train()
        logits = response_logits(model, mb, share_prompts=False)
        logprobs, entropy = logprobs_and_entropy(logits, mb["responses"])
        grads = torch.autograd.grad(logprobs[mask].sum() + entropy[mask].sum(), list(model.parameters()))
        results.append((logprobs[mask], entropy[mask], grads))
    (lp, ent, grads), (packed_lp, packed_ent, packed_grads) = results
    assert torch.allclose(packed_lp, lp, atol=1e-5) and torch.allclose(packed_ent, ent, atol=1e-5)
    for a, b in zip(packed_grads, grads):
        assert (a - b).norm() <= 1e-4 * b.norm() + 1e-8
    full = [
        torch.cat([mb["input_ids"], torch.zeros_like(mb["input_ids"][:, :3])], 1),
        torch.cat([mb["attention_mask"], torch.zeros_like(mb["attention_mask"][:, :3])], 1),
    ]
    # sequence_logits (sft.py's forward) on rows padded on both sides: the same logits at every real token
    real = full[1].bool()
    with torch.no_grad():
        a, b = sequence_logits(base, *full), sequence_logits(packed, *full)
    assert torch.allclose(b[real], a[real], atol=1e-4) and (b[~real] == 0).all()
    dist = type("Single", (), {"world_size": 1, "rank": 0, "device": torch.device("cpu")})()
    critics = [
        load_critic(ModelArgs(path=path, strategy="ddp", use_remove_padding=flag), dist) for flag in (False, True)
    ]
    torch.manual_seed(0)
    critics[1].score.load_state_dict(critics[0].score.state_dict())  # the same fresh value head
    values = [response_values(c, mb, share_prompts=False) for c in critics]
    assert torch.allclose(values[1][mask], values[0][mask], atol=1e-5)


def windowed_pair(base, prompts, tokenizer, window):
    """The padded (sdpa) and the packed (VARLEN) model with base's weights, every layer with a sliding
    window of `window` tokens (None: none), and a batch of 4 responses of 3-20 tokens with its mask."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.model import register_varlen

    config = AutoConfig.from_pretrained(SFT, use_sliding_window=window is not None, sliding_window=window)
    config.layer_types = ["sliding_attention" if window else "full_attention"] * config.num_hidden_layers
    models = []
    for attn in ("sdpa", register_varlen()):  # each its own config: from_config sets the attention on it
        models.append(AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn))
        models[-1].load_state_dict(base.state_dict())
    models[1].padding_free = True
    g = torch.Generator().manual_seed(0)
    batch = pack_sequences(
        prompts, [torch.randint(10, 100, (n,), generator=g).tolist() for n in (3, 20, 9, 14)], tokenizer.pad_token_id
    )
    batch["group_ids"] = torch.arange(4)
    return models, batch, batch["response_mask"].bool()


def test_a_sliding_window_is_kept_packed(setup, tokenizer):
    """A layer with a sliding window (Qwen2's use_sliding_window, Mistral's) attends, packed, to the
    same keys as transformers' padded mask: the logits equal the padded model's, and differ from the
    same weights without the window (so the window is really in play)."""
    from common.model import response_logits

    base, prompts, _ = setup
    models, batch, mask = windowed_pair(base, prompts, tokenizer, 6)
    with torch.no_grad():
        padded, packed, full = (response_logits(m, batch)[mask] for m in (*models, base))
    assert torch.allclose(packed, padded, atol=1e-4)
    assert not torch.allclose(padded, full, atol=1e-2)


def stand_in_varlen_attn(calls):
    """torch.nn.attention.varlen.varlen_attn's documented contract, computed on CPU one sequence at a
    time: (total tokens, heads, head dim) tensors, int32 sequence starts, window_size (left, right)
    keys back and ahead of each query (-1: no bound), a (total tokens, heads, head dim) output."""

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        assert q.dim() == 3 and cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k
        calls.append(window_size)
        left, right = window_size
        out = []
        for a, b in zip(cu_q.tolist(), cu_q.tolist()[1:]):
            i = torch.arange(b - a)
            back = i[:, None] - i[None]  # how far each key lies behind each query
            allowed = ((back <= left) | (left < 0)) & ((-back <= right) | (right < 0))
            out.append(
                torch.nn.functional.scaled_dot_product_attention(
                    *(x[a:b].transpose(0, 1) for x in (q, k, v)),
                    attn_mask=allowed,
                    scale=scale,
                    enable_gqa=enable_gqa,
                ).transpose(0, 1)
            )
        return torch.cat(out)

    return kernel


@pytest.mark.parametrize("window", [None, 6])
def test_the_gpu_varlen_kernel_is_called_as_documented(setup, tokenizer, monkeypatch, window):
    """On a GPU in bfloat16 VARLEN hands the packed row to PyTorch's varlen kernel. Its call (layout,
    sequence starts, causal or sliding window, grouped heads, scale) is checked on CPU against a
    stand-in computing the kernel's documented contract: the logits equal the padded model's."""
    import common.model

    base, prompts, _ = setup
    models, batch, mask = windowed_pair(base, prompts, tokenizer, window)
    calls = []
    monkeypatch.setattr(common.model, "_varlen_kernel", lambda query: stand_in_varlen_attn(calls))
    with torch.no_grad():
        padded, packed = (common.model.response_logits(m, batch)[mask] for m in models)
    assert calls == [(window - 1, 0) if window else (-1, 0)] * base.config.num_hidden_layers
    assert torch.allclose(packed, padded, atol=1e-4)


@pytest.mark.parametrize("release", ["2.11", "2.13"])
def test_grouped_heads_reach_the_varlen_kernel_of_either_torch(setup, tokenizer, monkeypatch, release):
    """torch 2.11's varlen kernel has no enable_gqa (2.13's has): Llama's grouped key-value heads (2
    for 4 query heads) reach 2.11's repeated to the query's heads, 2.13's as they are, and the packed
    logprobs equal the padded ones either way (on a GPU, 2.11 raised at the keyword before)."""
    import common.model
    from common.model import response_logits

    _, prompts, engine = setup
    calls, grouped = [], []
    newer = stand_in_varlen_attn(calls)

    def older(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        grouped.append(k.shape[1] != q.shape[1])
        return newer(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)

    monkeypatch.setattr(common.model, "_varlen_kernel", lambda query: older if release == "2.11" else newer)
    torch.manual_seed(1)
    flat = [c for g in engine.generate(prompts, Sampling(n=2, temperature=1.5, max_tokens=24)) for c in g]
    batch = pack_sequences([p for p in prompts for _ in range(2)], [c.token_ids for c in flat], tokenizer.pad_token_id)
    batch["group_ids"] = torch.arange(len(prompts)).repeat_interleave(2)
    mask = batch["response_mask"].bool()
    out = []
    for remove_padding in (False, True):
        model = load_policy(str(ROOT / "bundled" / "tiny-llama"), remove_padding=remove_padding)
        with torch.no_grad():
            out.append(
                logprobs_from_logits(response_logits(model, batch, share_prompts=False), batch["responses"])[mask]
            )
    assert calls and calls == [(-1, 0)] * len(calls)  # causal, every layer
    assert grouped == ([False] * len(calls) if release == "2.11" else [])
    assert torch.allclose(out[1], out[0], atol=1e-5)


def test_a_model_with_its_own_attention_code_is_not_packed(monkeypatch):
    """A model class that keeps its own attention (transformers' is_backend_compatible False) would
    let packed sequences attend to each other: --use-remove-padding refuses it, naming it."""
    from transformers import Qwen2ForCausalLM

    from common.errors import UsageError

    monkeypatch.setattr(Qwen2ForCausalLM, "_supports_attention_backend", False)
    with pytest.raises(UsageError, match="--use-remove-padding: Qwen2ForCausalLM .* runs attention code of its own"):
        load_policy(SFT, remove_padding=True)
    assert load_policy(SFT) is not None  # padded, it loads as ever


def test_auto_leaves_a_model_with_its_own_attention_code_padded(monkeypatch, caplog):
    """Under the default (auto) such a model is not refused: it runs padded, and the log says so."""
    from transformers import Qwen2ForCausalLM

    from common.model import pack_mode

    monkeypatch.setattr(Qwen2ForCausalLM, "_supports_attention_backend", False)
    with caplog.at_level("INFO", logger="common.model"):
        model = load_policy(SFT, remove_padding="auto")
    assert pack_mode(model) is False and model.config._attn_implementation == "sdpa"
    assert (
        "runs attention code of its own, which would let packed sequences attend to each other: its forward "
        "passes stay padded" in caplog.text
    )


def test_a_model_with_capped_attention_logits_is_not_packed(tmp_path, caplog):
    """Logit soft-capping (Gemma 2's attn_logit_softcapping) is a term the padding-free attention does
    not apply: True refuses such a model before it runs, auto runs it padded."""
    import shutil

    from common.errors import UsageError
    from common.model import pack_mode

    shutil.copytree(SFT, tmp_path / "capped")
    config = json.loads((tmp_path / "capped" / "config.json").read_text())
    (tmp_path / "capped" / "config.json").write_text(json.dumps({**config, "attn_logit_softcapping": 50.0}))
    with pytest.raises(UsageError, match=r"--use-remove-padding: .* caps its attention logits .*; set --use-remove"):
        load_policy(str(tmp_path / "capped"), remove_padding=True)
    with caplog.at_level("INFO", logger="common.model"):
        assert pack_mode(load_policy(str(tmp_path / "capped"), remove_padding="auto")) is False
    assert "caps its attention logits" in caplog.text


def counting_packed(monkeypatch) -> list:
    """Every call of common.model._packed_outputs (a packed forward) appends 1 to the list returned."""
    import common.model

    calls, packed = [], common.model._packed_outputs
    monkeypatch.setattr(common.model, "_packed_outputs", lambda *a, **k: calls.append(1) or packed(*a, **k))
    return calls


def test_auto_packs_where_the_padded_pass_runs_a_quarter_more_tokens(setup, tokenizer, monkeypatch):
    """--use-remove-padding auto (the default) packs a micro-batch whose padded pass would run at least
    PACK_GAIN times its real tokens, counting the shared-prompt pass's saving, and runs the others
    padded; packed or not, the logprobs are the padded model's."""
    from common.model import PACK_GAIN, pack_mode, packs_batch, response_logits

    base, prompts, _ = setup
    auto = load_policy(SFT, remove_padding="auto")
    assert pack_mode(auto) == "auto" and pack_mode(load_policy(SFT, remove_padding=True)) is True
    assert pack_mode(base) is False
    real = torch.tensor(100)
    assert packs_batch(auto, real, int(100 * PACK_GAIN)) and not packs_batch(auto, real, int(100 * PACK_GAIN) - 1)
    calls = counting_packed(monkeypatch)
    g = torch.Generator().manual_seed(0)
    spread = [torch.randint(10, 100, (n,), generator=g).tolist() for n in (2, 60, 5, 48)]
    uniform = [torch.randint(10, 100, (12,), generator=g).tolist() for _ in range(8)]
    wide = [torch.randint(10, 100, (n,), generator=g).tolist() for n in (2, 120, 3, 100)]
    cases = {  # name: (prompts, responses, group ids, packed?)
        "spread, one response a prompt": (prompts, spread, torch.arange(4), True),
        "uniform, one response a prompt": (prompts[:2] * 4, uniform, torch.arange(8), False),
        # the padded pass runs the prompt once, but its responses are mostly padding
        "spread, groups sharing a prompt": ([prompts[0]] * 4, wide, torch.zeros(4, dtype=torch.long), True),
        # 4 responses of 12 tokens to one prompt: the padded pass runs the prompt once, packing 4 times
        "uniform, groups sharing a prompt": ([prompts[0]] * 4, uniform[:4], torch.zeros(4, dtype=torch.long), False),
    }
    for name, (ps, responses, groups, want) in cases.items():
        batch = pack_sequences(ps, responses, tokenizer.pad_token_id)
        batch["group_ids"] = groups
        mask = batch["response_mask"].bool()
        calls.clear()
        with torch.no_grad():
            got = logprobs_from_logits(response_logits(auto, batch), batch["responses"])
            padded = logprobs_from_logits(response_logits(base, batch), batch["responses"])
        assert bool(calls) == want, name
        assert torch.allclose(got[mask], padded[mask], atol=1e-5), name


def rank_batch(rank: int, tokenizer) -> dict:
    """Rank 0's micro-batch: responses of 2-200 tokens, one to each prompt (alone, packed). Rank 1's:
    4 responses of 12 tokens sharing one prompt (alone, padded, the prompt run once)."""
    rows, _ = load_prompts([TASK_TEST], tokenizer, max_prompt_length=64)
    g = torch.Generator().manual_seed(rank)
    lengths = (2, 200, 3, 180) if rank == 0 else (12,) * 4
    responses = [torch.randint(10, 100, (n,), generator=g).tolist() for n in lengths]
    prompts = [r["prompt_ids"] for r in rows[:4]] if rank == 0 else [rows[0]["prompt_ids"]] * 4
    batch = pack_sequences(prompts, responses, tokenizer.pad_token_id)
    batch["group_ids"] = torch.arange(4) if rank == 0 else torch.zeros(4, dtype=torch.long)
    return batch


AUTO_UNDER_FSDP2 = """
import json, sys, torch
sys.path.insert(0, sys.argv[2])
import common.model
from test_rollout import rank_batch
from common.model import load_policy, load_tokenizer, response_logits
from common.ops import logprobs_from_logits
from common.parallel import init_distributed, wrap_model
dist = init_distributed()
model = wrap_model(load_policy(sys.argv[1], remove_padding="auto"), "fsdp2", dist)
calls, packed = [], common.model._packed_outputs
common.model._packed_outputs = lambda *a, **k: calls.append(1) or packed(*a, **k)
batch = rank_batch(dist.rank, load_tokenizer(sys.argv[1]))
with torch.no_grad():
    logprobs = logprobs_from_logits(response_logits(model, batch), batch["responses"])
common.model._packed_outputs = packed
with open(f"{sys.argv[3]}/rank{dist.rank}.json", "w") as f:
    json.dump({"packed": bool(calls), "logprobs": logprobs[batch["response_mask"].bool()].tolist()}, f)
"""


@torchrun_plan
def auto_plan(folder, fixture):
    (folder / "auto.py").write_text(AUTO_UNDER_FSDP2)
    return {"auto": (folder / "auto.py", [SFT, ROOT / "tests", folder])}


def test_fsdp2_ranks_decide_to_pack_together(torchrun_runs, tokenizer, monkeypatch):
    """Under FSDP2 every rank's forward is collective (and a padded pass with a shared prompt is two
    calls), so auto decides on every rank's tokens: two ranks whose micro-batches alone would go
    different ways both pack, and each gets the padded model's logprobs."""
    from common.model import response_logits

    folder, codes = torchrun_runs[__name__]
    assert codes == {"auto": 0}
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]
    auto, padded = load_policy(SFT, remove_padding="auto"), load_policy(SFT)
    calls = counting_packed(monkeypatch)
    for rank, got in enumerate(ranks):
        batch = rank_batch(rank, tokenizer)
        calls.clear()
        with torch.no_grad():
            response_logits(auto, batch)  # alone: rank 0 packs, rank 1 does not
            want = logprobs_from_logits(response_logits(padded, batch), batch["responses"])
        assert bool(calls) == (rank == 0) and got["packed"]
        assert got["logprobs"] == pytest.approx(want[batch["response_mask"].bool()].tolist(), rel=1e-5, abs=1e-5)


def test_length_finish_and_greedy(setup, tokenizer):
    model, prompts, engine = setup
    short = engine.generate(prompts[:2], Sampling(n=2, temperature=1.0, max_tokens=2))
    assert all(c.finish_reason == "length" and len(c.token_ids) == 2 for g in short for c in g)
    a = engine.generate(prompts, Sampling(n=1, temperature=0, max_tokens=8))
    b = engine.generate(prompts, Sampling(n=1, temperature=0, max_tokens=8))
    assert [g[0].token_ids for g in a] == [g[0].token_ids for g in b]


def test_model_generation_config_does_not_leak(setup):
    """A repetition_penalty or top_k in the model's generation_config.json must not change our
    sampling, and the model's config is left as it was."""
    model, prompts, engine = setup
    want = engine.generate(prompts, Sampling(n=1, temperature=0, max_tokens=8))
    model.generation_config.repetition_penalty, model.generation_config.top_k = 5.0, 2
    try:
        got = engine.generate(prompts, Sampling(n=1, temperature=0, max_tokens=8))
        assert [g[0].token_ids for g in got] == [g[0].token_ids for g in want]
        for g, w in zip(got, want):
            assert g[0].logprobs == pytest.approx(w[0].logprobs)
        assert model.generation_config.repetition_penalty == 5.0
    finally:
        model.generation_config.repetition_penalty, model.generation_config.top_k = 1.0, 50


def test_top_k_restricts_the_sampler(setup):
    _, prompts, engine = setup
    torch.manual_seed(0)
    groups = engine.generate(prompts, Sampling(n=4, temperature=5.0, top_k=1, max_tokens=4))
    greedy = engine.generate(prompts, Sampling(n=1, temperature=0, max_tokens=4))
    for g, ref in zip(groups, greedy):
        assert all(c.token_ids == ref[0].token_ids for c in g), "top_k=1 is greedy"
        assert all(lp == pytest.approx(0.0, abs=1e-6) for c in g for lp in c.logprobs), "sampler's own distribution"


@pytest.mark.parametrize("rows", [slice(0, 12), slice(2, 11), slice(5, 6)])
def test_shared_prompt_forward_equals_one_pass(setup, tokenizer, rows):
    """Each distinct prompt once, its KV cache repeated for the group: the same logits and the same
    gradients as one pass over every full sequence, also for slices that cut through groups."""
    from common.data import take_rows
    from common.model import response_logits

    model, prompts, engine = setup
    torch.manual_seed(0)
    groups = engine.generate(prompts, Sampling(n=3, temperature=1.0, max_tokens=8))
    flat = [c for g in groups for c in g]
    batch = pack_sequences([p for p in prompts for _ in range(3)], [c.token_ids for c in flat], tokenizer.pad_token_id)
    batch["group_ids"] = torch.arange(len(prompts)).repeat_interleave(3)
    mb = take_rows(batch, rows)
    mask = mb["response_mask"].bool()
    model.train()
    results = []
    for share in (False, True):
        logits = response_logits(model, mb, share_prompts=share)
        lp = logprobs_from_logits(logits, mb["responses"])
        grads = torch.autograd.grad(lp[mask].sum(), [p for p in model.parameters()])
        results.append((logits[mask], grads))
    (ref_logits, ref_grads), (logits, grads) = results
    assert torch.allclose(logits, ref_logits, atol=1e-5)
    for a, b in zip(grads, ref_grads):  # equal up to float summation order
        assert (a - b).norm() <= 1e-4 * b.norm() + 1e-8


MEMORY_PROBE = """
import resource, sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from common.engines import HFEngine, Sampling
torch.manual_seed(0)
config = Qwen2Config(vocab_size=32000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
engine = HFEngine(Qwen2ForCausalLM(config), pad_id=0, eos_ids=[1], device="cpu")
prompts = [[5, 6, 7, 8]] * 16
peaks = []
for max_tokens in (4, 96):
    out = engine.generate(prompts, Sampling(n=1, temperature=1.0, top_k=1000, max_tokens=max_tokens))
    assert max(len(c.logprobs) for g in out for c in g) > max_tokens // 2
    peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
print(peaks[1] - peaks[0])
"""


def test_engine_logprob_memory_does_not_grow_with_vocabulary_x_length():
    """16 responses of 96 tokens over a 32k vocabulary: keeping every step's full-vocabulary
    scores (and their log-softmax) added 540 MB over the 4-token run; keeping the
    sampled tokens' logprobs adds 0-100 MB (allocator noise)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grown_kb = int(proc.stdout.split()[-1])
    assert grown_kb < 150_000, f"peak memory grew {grown_kb / 1024:.0f} MB from 4 to 96 generated tokens"


def test_regroup_keeps_the_chosen_groups_in_order_and_every_parts_counts(tokenizer):
    """DAPO's batch from groups picked across two generation batches: tokens, rewards, scores and
    group ids follow the chosen groups; errors, timeouts and seconds of both scoring calls stay
    counted; timing sums."""
    from common.engines import Completion
    from common.rewards import Scored
    from common.rollout import regroup

    rows, _ = load_prompts([TASK_TEST], tokenizer, max_prompt_length=64)

    def member(i, reward):
        prompt = rows[i]
        return ((prompt, Completion([5 + i, 6 + i], [-0.1, -0.2], "length")), reward, reward, {"acc": reward})

    parts = [  # two generation batches of one step: the same weights sampled both
        {
            "scored": Scored([0.0] * 4, [{}] * 4, errors=1, seconds=1.0),
            "timing": {"perf/generate_s": 2.0},
            "started": 5.0,
            "weight_version": 7,
        },
        {
            "scored": Scored([1.0] * 4, [{}] * 4, timeouts=2, seconds=0.5),
            "timing": {"perf/generate_s": 3.0},
            "started": 9.0,
            "weight_version": 7,
        },
    ]
    groups = [[member(3, 1.0), member(3, 0.0)], [member(0, 0.0), member(0, 1.0)]]
    batch = regroup(groups, parts, tokenizer, "cpu")
    assert batch["rewards"].tolist() == [1.0, 0.0, 0.0, 1.0] and batch["group_ids"].tolist() == [0, 0, 1, 1]
    assert [p is rows[i] for (p, _), i in zip(batch["rows"], (3, 3, 0, 0))] == [True] * 4
    assert batch["responses"][0].tolist()[:2] == [8, 9] and batch["responses"][2].tolist()[:2] == [5, 6]
    scored = batch["scored"]
    assert (scored.scores, scored.errors, scored.timeouts, scored.seconds) == ([1.0, 0.0, 0.0, 1.0], 1, 2, 1.5)
    assert [e["acc"] for e in scored.extras] == [1.0, 0.0, 0.0, 1.0] and batch["timing"] == {"perf/generate_s": 5.0}
    assert batch["started"] == 5.0  # the step began with its first generation batch
    assert batch["weight_version"] == 7
    assert batch["rollout_logprobs"][0].tolist() == pytest.approx([-0.1, -0.2]), "the engine's logprobs, packed"


def test_only_the_vllm_warnings_this_engine_causes_on_purpose_are_dropped():
    import logging

    from common.serving.vllm_engine import _ExpectedVLLMWarnings

    def shown(filt, msg, *args):
        return filt.filter(logging.LogRecord("vllm.x", logging.WARNING, "f.py", 1, msg, args, None))

    filt = _ExpectedVLLMWarnings()
    assert not shown(filt, "%s: Failed to load weights", "RotaryEmbedding")  # no weights to load
    assert not shown(filt, "Chat template warmup failed")  # the engine has no tokenizer on purpose
    assert shown(filt, "%s: Failed to load weights", "ParallelLMHead")  # untied: a real failure
    assert shown(filt, "%s: Failed to load weights", "QKVParallelLinear")
    filt.tied = True
    assert not shown(filt, "%s: Failed to load weights", "ParallelLMHead")  # tied: the embedding is sent
    assert shown(filt, "VocabParallelEmbedding: Failed to load weights")


def test_otbs_step_4_measures_each_tokens_sum_of_squared_probabilities(setup, tokenizer):
    """otb.py's step 4 runs the policy whatever the plan (step 5 needs it before the update) and leaves each
    response token's sum_v pi_v^2, pi the next-token distribution at the sampling temperature, in
    batch["sum_pi_squared"] beside the old logprobs, in row order across length-sorted micro-batches;
    --bypass-mode keeps the engine's logprobs as the old ones."""
    from types import SimpleNamespace

    otb, (model, prompts, engine) = load_recipe("otb"), setup
    torch.manual_seed(0)
    groups = engine.generate(prompts, Sampling(n=2, temperature=1.0, max_tokens=8))
    flat = [c for g in groups for c in g]
    batch = pack_sequences([p for p in prompts for _ in range(2)], [c.token_ids for c in flat], tokenizer.pad_token_id)
    batch["group_ids"], batch["timing"], T = (
        torch.arange(len(prompts)).repeat_interleave(2),
        {},
        batch["responses"].shape[1],
    )
    plan = SimpleNamespace(
        share_prompts=True, temperature=0.7, micro=dict(max_seqs=3, max_tokens=40), mini_batches_per_step=1, epochs=1
    )
    args = make_args(otb.Args)  # no KL term: no reference pass
    old, ref = otb.old_ref_logprobs(model, None, batch, plan, "trainer", args)
    keys = ("input_ids", "attention_mask", "position_ids")
    with torch.no_grad():
        p = torch.softmax(model(**{k: batch[k] for k in keys}).logits[:, -T - 1 : -1].float() / 0.7, -1)
    mask = batch["response_mask"].bool()
    assert ref is None and old is not None, (
        "one mini-batch, one epoch: grpo.py would leave the old logprobs to the update"
    )
    torch.testing.assert_close(batch["sum_pi_squared"][mask], p.square().sum(-1)[mask], atol=1e-5, rtol=1e-5)
    drawn = p.gather(-1, batch["responses"][..., None])[..., 0].log()
    torch.testing.assert_close(old[mask], drawn[mask], atol=1e-5, rtol=1e-5)
    assert 0 < batch["sum_pi_squared"][mask].min() and batch["sum_pi_squared"][mask].max() <= 1 + 1e-6
    batch["rollout_logprobs"] = torch.full_like(old, -1.5)
    engine_old, _ = otb.old_ref_logprobs(model, None, batch, plan, "engine", args)
    assert engine_old is batch["rollout_logprobs"] and "sum_pi_squared" in batch


def test_validation_with_several_responses_counts_pass_at_n_by_prompt():
    """val/pass@n (verl's best@n of the accuracy): the share of prompts with at least one hit among their n
    responses, beside val/accuracy, the share of responses that hit; with one response a prompt, no pass@1."""
    from types import SimpleNamespace

    from common.engines import Completion
    from common.rewards import Scored
    from common.rollout import evaluate

    hits = {0: [0, 0, 1], 1: [0, 0, 0], 2: [1, 1, 1], 3: [0, 1, 0]}  # prompt: its responses' scores

    class Engine:
        def generate(self, prompts, sampling):
            return [[Completion([p[0], j], [0.0, 0.0], "stop") for j in range(sampling.n)] for p in prompts]

    class Pool:
        def score(self, tasks):
            scores = [float(hits[int(p)][int(j)]) for _, text, _, _ in tasks for p, j in [text.split()]]
            return Scored(scores, [{} for _ in scores], ok=[True] * len(scores))

    tokenizer = SimpleNamespace(batch_decode=lambda ids, skip_special_tokens: [" ".join(map(str, t)) for t in ids])
    rows = [dict(prompt_ids=[i], data_source="sums", ground_truth="", extra_info={}) for i in hits]
    dist = SimpleNamespace(world_size=1, rank=0)
    metrics = evaluate(Engine(), Pool(), tokenizer, rows, Sampling(n=3, temperature=1.0, max_tokens=2), dist)
    assert metrics["val/pass@3"] == 3 / 4 and metrics["val/accuracy"] == 5 / 12
    one = evaluate(Engine(), Pool(), tokenizer, rows, Sampling(n=1, temperature=1.0, max_tokens=2), dist)
    assert one["val/accuracy"] == 1 / 4 and not any(k.startswith("val/pass@") for k in one)


def test_compiled_layers_train_as_the_eager_ones_and_run_cached_calls_eagerly(setup, tokenizer):
    """--use-torch-compile (common.model.compile_layers): every decoder layer compiled in place (its weights keep
    their names, so checkpoints and the weight sync are unchanged), one graph for all of them, the logprobs and
    gradients of a trainer pass equal to the eager model's within float32 rounding; and a call with a KV cache (the
    shared-prompt pass, the engine's decoding) runs eagerly, so the cache's per-layer guards never spend the
    compiler's recompile limit."""
    from torch._dynamo.utils import counters

    from common.model import response_logits

    eager, prompts, _ = setup
    compiled = load_policy(SFT, torch_compile=True)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    responses = [[10 + i] * (3 + 5 * i) for i in range(len(prompts))]
    batch = pack_sequences(prompts, responses, tokenizer.pad_token_id)
    batch["group_ids"] = torch.arange(len(prompts))
    shared = pack_sequences([prompts[0]] * 2, responses[:2], tokenizer.pad_token_id)  # a group of 2: one prompt
    shared["group_ids"] = torch.zeros(2, dtype=torch.long)
    passes = []
    for model in (eager, compiled):
        model.train()
        for b in (batch, shared):
            logprobs = logprobs_from_logits(response_logits(model, b), b["responses"])[b["response_mask"].bool()]
            grads = torch.autograd.grad(logprobs.sum(), list(model.parameters()))
            passes.append((logprobs.detach(), torch.cat([g.flatten() for g in grads])))
        if model is eager:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs + 1  # the uncached pass compiled, once for every layer
    for (lp, grad), (compiled_lp, compiled_grad) in zip(passes[:2], passes[2:]):
        assert (compiled_lp - lp).abs().max() < 1e-4 and (compiled_grad - grad).norm() < 1e-4 * grad.norm()
    engine = HFEngine(compiled, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cpu")
    engine.generate(prompts, Sampling(n=2, temperature=1.0, max_tokens=4))
    assert counters["stats"]["unique_graphs"] == graphs + 1
