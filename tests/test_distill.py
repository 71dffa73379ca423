"""recipes/distill.py's own parts: the teacher's advantage, GKD's divergence against its formula,
a teacher equal to the student teaching nothing, a teacher with another tokenizer refused before
any model loads, and distillation closing the gap to the bundled teacher. What every RL recipe
must do (resume, micro-batches, two processes, errors, learning) is in tests/test_rl_recipes.py."""

import importlib.util
import math

import pytest
import torch
from conftest import BUNDLED, TINY, load_recipe, make_args

from common.data import pack_sequences
from common.errors import UsageError
from common.model import load_policy
from common.teacher import jsd_from_logits

distill = load_recipe("distill")
SFT = str(BUNDLED / "tiny-qwen2-sft")


def test_the_teacher_advantage_by_hand():
    """A_t = -(old_t - teacher_t) on the sampled tokens, zero on padding; with a discount gamma each
    token adds the discounted advantages of the tokens after it in its own response."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -9.0]])
    teacher = torch.tensor([[-0.5, -2.5, -0.5], [-1.1, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert torch.allclose(
        distill.teacher_advantages(old, teacher, mask), torch.tensor([[0.5, -0.5, 0.0], [-1.0, 2.0, 0.0]])
    )
    discounted = distill.teacher_advantages(old, teacher, mask, kl_discount=0.5)
    want = [[0.5 - 0.25 + 0.0, -0.5 + 0.0, 0.0], [-1.0 + 1.0, 2.0, 0.0]]  # row 2's padding adds nothing
    assert torch.allclose(discounted, torch.tensor(want))


def jsd_by_formula(logits, teacher_logits, beta):
    """GKD's JSD_beta written out in float64 over explicit distributions: beta KL(p || m) +
    (1 - beta) KL(q || m), m = beta p + (1 - beta) q, p the teacher's, q the student's; the ends
    are the forward KL(p || q) (beta 0) and the reverse KL(q || p) (beta 1)."""
    q, p = torch.softmax(logits.double(), -1), torch.softmax(teacher_logits.double(), -1)

    def kl(a, b):
        return (a * (a.log() - b.log())).sum(-1)

    if beta == 0:
        return kl(p, q)
    if beta == 1:
        return kl(q, p)
    m = beta * p + (1 - beta) * q
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_gkd_divergence_equals_its_formula(beta, monkeypatch):
    """jsd_from_logits against the formula on random logits, chunked (a chunk of 3 rows: common.ops.rowwise's) and
    whole; its gradient reaches the student's logits only and equals the formula's."""
    import common.ops

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(4, 5, 11, generator=g)).requires_grad_()
    teacher = (3 * torch.randn(4, 5, 11, generator=g)).requires_grad_()
    want = jsd_by_formula(logits, teacher, beta)
    whole = jsd_from_logits(logits, teacher, beta)
    monkeypatch.setattr(common.ops, "CHUNK_ROWS", 3)
    chunked = jsd_from_logits(logits, teacher, beta)
    assert torch.allclose(whole.double(), want, atol=1e-6) and torch.allclose(chunked, whole, atol=1e-7)
    grad, teacher_grad = torch.autograd.grad(chunked.sum(), [logits, teacher], allow_unused=True)
    (want_grad,) = torch.autograd.grad(want.sum(), logits)
    assert torch.allclose(grad, want_grad, atol=1e-5) and teacher_grad is None
    if 0 < beta < 1:
        assert (want > 0).all() and (want <= math.log(2) + 1e-9).all()  # a JSD: between 0 and log 2 nats


def test_gkd_ends_are_the_two_kls():
    from common.ops import kl_from_logits

    g = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(6, 9, generator=g), torch.randn(6, 9, generator=g)
    assert torch.allclose(jsd_from_logits(student, teacher, 1.0), kl_from_logits(student, teacher))
    assert torch.allclose(jsd_from_logits(student, teacher, 0.0), kl_from_logits(teacher, student))
    with pytest.raises(ValueError, match="outside"):
        jsd_from_logits(student, teacher, 1.5)


@pytest.mark.parametrize("loss", ["reverse_kl", "gkd"])
def test_a_teacher_equal_to_the_student_teaches_nothing(tokenizer, loss):
    """With the student as its own teacher the advantage is zero on every token and so is the loss's
    gradient (reverse_kl: the surrogate of a zero advantage; gkd: the divergence at its minimum)."""
    from common.data import load_prompts

    model = load_policy(SFT)
    rows, _ = load_prompts([BUNDLED / "addition" / "test.parquet"], tokenizer, max_prompt_length=64)
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(10, 100, (n,), generator=g).tolist() for n in (3, 9, 5, 7)]
    batch = pack_sequences([r["prompt_ids"] for r in rows[:4]], responses, tokenizer.pad_token_id)
    batch["group_ids"] = torch.arange(4)
    mask = batch["response_mask"].float()
    plan = type("Plan", (), {"share_prompts": True, "temperature": 1.0})()
    rows = torch.arange(4)
    with torch.no_grad():
        old = distill.forward_logprobs(model, batch, rows, plan)[0]
    teacher = distill.forward_logprobs(model, batch, rows, plan)[0].detach()
    advantages = distill.teacher_advantages(old, teacher, mask)
    assert advantages.abs().max() == 0
    gkd = loss == "gkd"
    new, entropy, _, jsd = distill.forward_logprobs(
        model, batch, rows, plan, True, None, model if gkd else None, 0.5 if gkd else None
    )
    args = make_args(distill.Args, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    terms, _ = distill.compute_loss(new, old, advantages, mask, {"mode": "token-mean"}, args, jsd=jsd)
    total = sum(terms.values())
    grads = torch.autograd.grad(total, [p for p in model.parameters() if p.requires_grad])
    assert max(g.abs().max().item() for g in grads) < 1e-6
    if gkd:
        assert jsd.abs().max() < 1e-6


def test_a_teacher_with_another_tokenizer_is_refused_before_any_model_loads(tmp_path, tokenizer, monkeypatch):
    """The teacher scores the student's token ids: a tokenizer with one more token (or tokens at other
    ids) is a usage error naming the difference, raised before a model loads."""
    import shutil

    import common.model

    shutil.copytree(SFT, tmp_path / "teacher")
    other = type(tokenizer).from_pretrained(TINY)
    other.add_tokens(["<extra>"])
    other.save_pretrained(tmp_path / "teacher")
    monkeypatch.setattr(common.model, "load_policy", lambda *a, **k: pytest.fail("a model loaded"))
    args = make_args(distill.Args, teacher_model=str(tmp_path / "teacher"), output_dir=str(tmp_path / "run"), logger=())
    with pytest.raises(UsageError, match=r"--teacher-model .*tokenizer differs.*1 in one vocabulary only; '<extra>'"):
        distill.main(args)


def test_gkd_flags_are_checked():
    with pytest.raises(UsageError, match=r"--jsd-beta 0.2 would change nothing in this run: add --loss gkd"):
        make_args(distill.Args, jsd_beta=0.2)
    with pytest.raises(UsageError, match=r"--jsd-beta 1.5: must be in \[0, 1\]"):
        make_args(distill.Args, loss="gkd", jsd_beta=1.5)
    with pytest.raises(UsageError, match=r"--kl-discount 0.9 would change nothing in this run: drop --loss gkd"):
        make_args(distill.Args, loss="gkd", kl_discount=0.9)
    with pytest.raises(UsageError, match=r"--teacher-model .*: folder does not exist"):
        make_args(distill.Args, teacher_model="/no/such/teacher")


def test_an_engine_scores_the_batch_as_the_teachers_passes(tokenizer):
    """common.rollout.engine_logprobs (what an engine serving the teacher gives step 4) equals
    forward_logprobs of the teacher on the same batch: prompts and responses of several lengths,
    read off the batch's padded tensors, at a sampling temperature, zero past each response."""
    from common.data import load_prompts
    from common.engines import HFEngine
    from common.rollout import engine_logprobs

    teacher = load_policy(distill.Args().teacher.teacher_model)
    rows, _ = load_prompts([BUNDLED / "addition" / "test.parquet"], tokenizer, max_prompt_length=64)
    prompts = [r["prompt_ids"] for r in rows[:4]]
    prompts[1] = prompts[1][5:]  # prompts of different lengths
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(10, 100, (n,), generator=g).tolist() for n in (3, 9, 1, 7)]
    batch = pack_sequences(prompts, responses, tokenizer.pad_token_id)
    batch["group_ids"] = torch.arange(4)
    plan = type("Plan", (), {"share_prompts": True, "temperature": 0.7})()
    with torch.no_grad():
        want = distill.forward_logprobs(teacher, batch, torch.arange(4), plan)[0]
    engine = HFEngine(
        teacher, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id], device="cpu", batch_size=3
    )
    got, mask = engine_logprobs(engine, batch, 0.7), batch["response_mask"]
    assert got.shape == want.shape and torch.allclose(got, want * mask, atol=1e-5)
    assert (got[mask == 0] == 0).all() and (got[mask == 1] < 0).all()


def test_teacher_engine_flags_are_checked(tokenizer, monkeypatch):
    """An engine serves the teacher's logprobs of the sampled tokens only (no GKD), vLLM's at
    temperature 1; the remote engines' own flags need --teacher-placement remote."""
    with pytest.raises(UsageError, match=r"--loss gkd with --teacher-engine hf --teacher-placement remote: GKD"):
        make_args(distill.Args, loss="gkd", teacher_placement="remote")
    with pytest.raises(UsageError, match=r"--teacher-engine vllm with --temperature 0.7: vLLM's prompt logprobs"):
        make_args(distill.Args, teacher_engine="vllm", temperature=0.7)
    with pytest.raises(UsageError, match=r"--teacher-num-engines 2 would change nothing .*--teacher-placement remote"):
        make_args(distill.Args, teacher_num_engines=2)
    with pytest.raises(UsageError, match=r"--teacher-gpu-memory-utilization 0.2 would .*add --teacher-engine vllm"):
        make_args(distill.Args, teacher_gpu_memory_utilization=0.2)
    with pytest.raises(UsageError, match=r"--teacher-engine-num-cpus 0.0: must be > 0"):
        make_args(distill.Args, teacher_placement="remote", teacher_engine_num_cpus=0.0)
    with pytest.raises(
        UsageError, match=r"--ray-address '10.0.0.1:6379' would .*remote \(or distill.py's --teacher-placement remote\)"
    ):
        make_args(distill.Args, ray_address="10.0.0.1:6379")
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(UsageError, match=r"--teacher-engine vllm: vLLM is not installed; pip install"):
            make_args(distill.Args, teacher_engine="vllm")
    args = make_args(distill.Args, teacher_placement="remote", ray_address="10.0.0.1:6379", engine_timeout=60.0)
    import common.serving.remote
    from common.parallel import Dist
    from common.teacher import start_teacher

    started = {}  # the keywords the teacher's remote engines are started with (start_teacher's RemoteEngines)
    monkeypatch.setattr(common.serving.remote, "RemoteEngines", lambda *a, **kw: started.update(kw))
    dist = Dist(0, 1, 0, torch.device("cpu"))
    start_teacher(args.teacher, args.model, args.data, args.rollout, args.actor, args.placement, dist, tokenizer)
    assert started["ray_address"] == "10.0.0.1:6379"
