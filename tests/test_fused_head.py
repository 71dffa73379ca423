"""The LM head fused with the logprob (issue 61): common.model.response_logprobs stops the forward at the hidden
states of the response positions and common.ops.logprobs_and_entropy makes the logits chunk by chunk, so the
(b, T, vocabulary) logits and their gradient never exist. Its results equal the whole head's within rounding,
and where it cannot fuse (a head LoRA wraps, logits changed after the head, FSDP2, the exact KL) it says why,
counts it and runs the head whole."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT

from common import model as common_model
from common import ops
from common.data import pack_sequences
from common.model import HEADS, load_policy, response_logits, response_logprobs, why_head_whole
from common.ops import logprobs_and_entropy

QWEN = str(ROOT / "bundled" / "tiny-qwen2-sft")  # tied embeddings
LLAMA = str(ROOT / "bundled" / "tiny-llama")  # its own LM head


def test_the_fused_head_equals_the_head_then_the_logprob(monkeypatch):
    """In float64 over several chunks: logprobs, entropy and the gradients of the hidden states, the weight and
    the bias, at a temperature, padding skipped; a frozen weight gets no gradient and the rest stay exact."""
    monkeypatch.setattr(ops, "HEAD_CHUNK", 40 * 3)  # 3 rows a chunk
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 8, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(40, 8, generator=g, dtype=torch.float64).requires_grad_()
    bias = torch.randn(40, generator=g, dtype=torch.float64).requires_grad_()
    labels, mask = torch.randint(0, 40, (3, 5), generator=g), torch.rand(3, 5, generator=g) > 0.3
    w_lp, w_h = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64)
    leaves = (hidden, weight, bias)
    whole = logprobs_and_entropy(F.linear(hidden, weight, bias), labels, mask, True, 0.7)
    fused = logprobs_and_entropy(hidden, labels, mask, True, 0.7, head=(weight, bias, None))
    for want, got in zip(whole, fused):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12) and (got[~mask] == 0).all()
    grads = [torch.autograd.grad((w_lp * lp + w_h * h).sum(), leaves) for lp, h in (whole, fused)]
    for want, got in zip(*grads):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12) and want.abs().sum() > 0
    assert torch.autograd.gradcheck(
        lambda *t: logprobs_and_entropy(t[0], labels, mask, True, 0.7, (*t[1:], None)), leaves
    )
    frozen = weight.detach()
    lp, _ = logprobs_and_entropy(hidden, labels, mask, False, 0.7, head=(frozen, None, None))
    (grad,) = torch.autograd.grad(lp.sum(), hidden)
    want = logprobs_and_entropy(F.linear(hidden, frozen), labels, mask, False, 0.7)[0]
    assert torch.allclose(grad, torch.autograd.grad(want.sum(), hidden)[0], rtol=1e-10)


def batch_of(vocab: int) -> dict:
    """Two groups of four responses of 2-8 tokens to a 7-token prompt each."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (7,), generator=g).tolist() for _ in range(2)]
    lengths = torch.randint(2, 9, (8,), generator=g).tolist()
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    batch = pack_sequences([p for p in prompts for _ in range(4)], responses, 0, torch.device("cpu"))
    batch["group_ids"] = torch.arange(8) // 4
    return batch


def both_heads(model, batch, share: bool, temperature: float = 0.7):
    """[(logprobs, entropy, every parameter's gradient)] for the whole head, then the fused one, and the largest
    tensor either kept for its backward with the vocabulary as its last dimension (None: none)."""
    out, vocab = [], model.config.vocab_size
    for fused in (False, True):
        kept = []

        def keep(t, kept=kept):
            if t.dim() > 1 and t.shape[-1] == vocab:
                kept.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            if fused:
                lp, h, _ = response_logprobs(model, batch, share, temperature, with_entropy=True)
            else:
                logits = response_logits(model, batch, share)
                lp, h = logprobs_and_entropy(logits, batch["responses"], batch["response_mask"], True, temperature)
        grads = torch.autograd.grad(lp.sum() + 0.5 * h.sum(), list(model.parameters()))
        out.append((lp.detach(), h.detach(), grads, max(kept, default=None)))
    return out


@pytest.mark.parametrize("layout", ["shared prompts", "one pass", "packed"])
@pytest.mark.parametrize("path", [QWEN, LLAMA], ids=["tied", "untied"])
def test_the_fused_head_equals_the_whole_one_in_every_layout(path, layout):
    """Through each of response_logits' layouts, in float64: the same logprobs, entropies and gradients of every
    parameter (a tied embedding's two uses summed), and the fused pass keeps no (..., vocabulary) tensor."""
    model = load_policy(path, remove_padding=layout == "packed").double().train()
    batch = batch_of(model.config.vocab_size)
    HEADS.clear()
    (lp, h, grads, kept), (f_lp, f_h, f_grads, f_kept) = both_heads(model, batch, share=layout == "shared prompts")
    assert HEADS == {"fused": 1}
    mask = batch["response_mask"].bool()
    assert torch.allclose(f_lp, lp, rtol=1e-10, atol=1e-12) and torch.allclose(f_h, h, rtol=1e-10, atol=1e-12)
    assert (f_lp[~mask] == 0).all() and lp[mask].abs().min() > 0
    for (name, _), a, b in zip(model.named_parameters(), f_grads, grads):
        assert (a - b).norm() <= 1e-10 * b.norm() + 1e-14, name
    assert kept >= int(mask.sum()) * model.config.vocab_size and f_kept is None


def test_under_autocast_the_fused_head_computes_in_bfloat16_as_the_whole_one():
    """--mixed-precision bf16 without FSDP2 autocasts the forward (common.parallel.wrap_model): the fused head
    makes its logits in bfloat16 too, so both sides agree to bfloat16's rounding of the logits."""
    from common.parallel import wrap_model

    dist = type("Single", (), {"world_size": 1, "rank": 0, "device": torch.device("cpu")})()
    model = wrap_model(load_policy(LLAMA), "ddp", dist, "bf16")
    assert model.autocast_dtype == torch.bfloat16
    batch = batch_of(model.config.vocab_size)
    (lp, h, grads, _), (f_lp, f_h, f_grads, _) = both_heads(model, batch, share=True, temperature=1.0)
    mask = batch["response_mask"].bool()
    assert (f_lp - lp)[mask].abs().max() < 0.05 and (f_h - h)[mask].abs().max() < 0.05
    float32 = both_heads(load_policy(LLAMA), batch, share=True, temperature=1.0)[1]
    assert (float32[0] - lp)[mask].abs().max() > 1e-4, "the whole head ran in bfloat16"
    for a, b in zip(f_grads, grads):
        assert (a - b).norm() <= 0.05 * b.norm() + 1e-6


class Halved(torch.nn.Module):
    """A causal LM whose forward halves the logits after the head, under no config key the check knows."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config, self.training = inner, inner.config, inner.training

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, **inputs):
        out = self.inner(**inputs)
        out.logits = out.logits / 2
        return out


def test_where_the_head_cannot_be_fused_it_runs_whole_says_why_and_counts_it(caplog):
    """LoRA on lm_head, logits changed after the head (named in the config, or found by the check's two forwards
    on 4 tokens), FSDP2 and the exact KL: each gives its reason, is counted in HEADS (perf/fused_head_share), is
    logged once, and gets the whole head's results."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.model import AdapterOff

    base = load_policy(LLAMA)
    batch = batch_of(base.config.vocab_size)
    lora = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    assert "not a plain Linear" in why_head_whole(lora) and "LoRA" in why_head_whole(lora)
    assert why_head_whole(get_peft_model(copy.deepcopy(base), LoraConfig(r=2, target_modules=["q_proj"]))) is None
    halved = Halved(base)
    assert "changes the head's output" in why_head_whole(halved) and why_head_whole(base) is None
    gemma2 = AutoConfig.for_model("gemma2", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    gemma2.num_attention_heads = gemma2.num_key_value_heads = 2
    gemma2.head_dim = 8
    capped = AutoModelForCausalLM.from_config(gemma2)  # soft-caps its logits at 30 after the head
    assert capped.config.final_logit_softcapping and "changes the head's output" in why_head_whole(capped)
    sharded = copy.deepcopy(base)
    sharded.set_requires_gradient_sync = lambda *a: None  # what common.parallel.is_fsdp looks for
    assert "FSDP2" in why_head_whole(sharded)
    HEADS.clear()
    with caplog.at_level("INFO", logger="common.model"):
        for _ in range(2):
            got = response_logprobs(halved, batch, True, 0.7)[0]
        _, _, kl = response_logprobs(base, batch, True, 0.7, kl_ref=AdapterOff(lora))
    reasons = dict(HEADS)
    assert reasons.pop(why_head_whole(halved)) == 2 and len(reasons) == 1
    assert "exact KL" in next(iter(reasons)) and list(reasons.values()) == [1]
    assert sum("runs whole" in r.message and "changes" in r.message for r in caplog.records) == 1, "said once"
    with torch.no_grad():
        want = logprobs_and_entropy(
            response_logits(halved, batch), batch["responses"], batch["response_mask"], False, 0.7
        )
    assert torch.equal(got.detach(), want[0]) and kl.shape == got.shape


def test_the_head_check_runs_once_per_model_and_leaves_its_mode(monkeypatch):
    calls = []
    monkeypatch.setattr(common_model, "_check_head", lambda base, head: calls.append(base) or None)
    model = load_policy(LLAMA).train()
    assert why_head_whole(model) is None and why_head_whole(model) is None and len(calls) == 1
    monkeypatch.undo()
    fresh = load_policy(LLAMA).train()
    assert why_head_whole(fresh) is None and fresh.training
