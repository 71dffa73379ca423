"""common.perf: the update's model FLOPs against a hand count and against torch's own FLOP counter,
the work a group's shared prompt saves, the device peaks, and perf/mfu in a run's metrics."""

import pytest
import torch
from conftest import BUNDLED, make_args, read_metrics, run_recipe

from common import perf
from common.config import RLArgs, plan_rl_batches
from common.flags import flag_values
from common.model import load_policy
from common.perf import device_peak, flop_terms, matmul_parameters, needed_tokens, update_flops, verdict
from common.tracking import Tracker


def rl_tracker(run_dir, run_info: dict, **flags) -> Tracker:
    """The Tracker of a grpo run with these flags (by name) and run_info (common.model.load_trained_model's), its
    update measured over the run's batch plan; no console."""
    args = make_args(RLArgs, logger=(), **flags)
    plan = plan_rl_batches(args.data, args.actor, args.rollout, run_info["world_size"])
    return Tracker(run_dir, 0, 0, True, args.trainer, "grpo", flag_values(args), run_info, plan)


def test_the_flop_terms_of_the_bundled_model_equal_a_hand_count():
    # tiny-qwen2: hidden 128, MLP 512, 4 layers of 4 heads of 32, vocabulary 261, lm_head tied to the embedding.
    attention = 4 * 128 * 128 + 3 * 128  # q, k, v, o and the q, k, v biases
    mlp = 3 * 128 * 512  # gate, up, down
    norms = 2 * 128
    layers = 4 * (attention + mlp + norms)
    head = 261 * 128  # the tied lm_head's matmul counts; the embedding lookup does not
    n = layers + 128 + head  # + the final norm
    model = load_policy(str(BUNDLED / "tiny-qwen2"))
    assert matmul_parameters(model) == n == 1_084_672
    assert flop_terms(model) == {"per_token": 6 * n, "per_token_sq": 12 * 4 * 4 * 32}
    # two sequences of 10 and 30 tokens
    assert update_flops(flop_terms(model), 40, 10**2 + 30**2) == 6 * n * 40 + 12 * 4 * 4 * 32 * 1000


def test_an_untied_lm_head_counts_once_and_the_embedding_not_at_all():
    model = load_policy(str(BUNDLED / "tiny-llama"))  # tie_word_embeddings false
    total = sum(p.numel() for p in model.parameters())
    assert matmul_parameters(model) == total - 261 * 128


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
def test_the_count_equals_torch_flop_counter_on_a_forward_and_backward(name):
    """torch.utils.flop_counter counts every matmul of a real forward and backward (attention too, as
    the batched matmuls of SDPA's math kernel): the attention term equals its count exactly, and the
    whole within 1% (our N also holds the norms and biases, 0.3% of it here)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = load_policy(str(BUNDLED / name)).train()
    n = 40
    ids = torch.randint(0, 250, (2, n), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(input_ids=ids).logits.float().sum().backward()
    terms = flop_terms(model)
    counts = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    assert counts["aten.bmm"] == terms["per_token_sq"] * 2 * n**2
    assert counter.get_total_flops() == pytest.approx(update_flops(terms, 2 * n, 2 * n**2), rel=0.01)


def test_a_shared_prompt_is_needed_work_once_a_group():
    # two groups: prompt 10 with responses 5 and 7; prompt 4 with responses 2, 2, 3 (rows interleaved)
    group_ids = torch.tensor([0, 1, 0, 1, 1])
    prompts = torch.tensor([10, 4, 10, 4, 4])
    lengths = prompts + torch.tensor([5, 2, 7, 2, 3])
    tokens, tokens_sq = needed_tokens(lengths.double(), prompts, group_ids)
    assert tokens.item() == (10 + 5 + 7) + (4 + 2 + 2 + 3)
    assert tokens_sq.item() == (15**2 + 17**2 - 10**2) + (6**2 + 6**2 + 7**2 - 2 * 4**2)


def test_device_peaks_come_from_the_datasheets_or_a_probe(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    assert device_peak("cuda", torch.bfloat16) == (989.4e12, "NVIDIA H100 80GB HBM3 datasheet, dense bfloat16")
    assert device_peak("cuda", torch.float32)[0] == 67e12  # torch's default float32 matmul: no TF32
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 PCIe")
    assert device_peak("cuda", torch.bfloat16)[0] == 756e12  # the variant before its family
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert device_peak("cuda", torch.float32)[0] == 378e12  # TF32 where torch was told to use it
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA L40")  # not an L4
    monkeypatch.setattr(perf, "matmul_probe", lambda device, dtype: 1.5e14)
    assert device_peak("cuda", torch.bfloat16) == (1.5e14, "measured by a bfloat16 matmul on cuda")
    flops, source = device_peak("cpu", torch.float32)
    assert flops > 1e8 and source == "measured by a float32 matmul on cpu"


def test_the_tracker_turns_a_steps_lengths_into_mfu(tmp_path):
    terms = {"per_token": 600, "per_token_sq": 12}
    run_info = {"flops": terms, "device": "cpu", "compute_dtype": "float32", "world_size": 2}
    tracker = rl_tracker(tmp_path, run_info, ppo_epochs=3)
    peak = device_peak("cpu", torch.float32)[0]
    tracker.log({"perf/update_s": 0.5, "_sequence_tokens": (120.0, 100.0, 2000.0)}, step=1)
    (record,) = read_metrics(tmp_path)
    flops = 3 * (600 * 100 + 12 * 2000)  # three passes over the needed work
    assert "_sequence_tokens" not in record
    assert record["perf/update_tflop"] == pytest.approx(flops / 1e12)
    assert record["perf/mfu"] == pytest.approx(flops / 0.5 / (2 * peak))
    assert record["perf/train_tokens_per_s"] == pytest.approx(3 * 120 / 0.5)


def test_every_step_of_a_run_logs_its_mfu_and_token_rates(tmp_path, small_files):
    run_recipe("grpo", "--output-dir", tmp_path, *small_files, "--total-training-steps", "2", "--check", "off")
    steps = [r for r in read_metrics(tmp_path) if "train/loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert 0 < r["perf/mfu"] < 1, r
        assert r["perf/generate_tokens_per_s"] > 0 and r["perf/train_tokens_per_s"] > 0
        assert r["perf/total_num_tokens"] * 1 / r["perf/update_s"] == pytest.approx(r["perf/train_tokens_per_s"])


RUN = {"rollout_name": "hf", "rollout_placement": "colocated", "max_staleness": 0, "reward_workers": 2,
       "use_remove_padding": "auto", "micro_batch_size_per_gpu": 64, "gradient_checkpointing": False,
       "mixed_precision": "no", "dtype": "float32", "lora_rank": 0, "device": "cpu", "micro_batches": 1,
       "padding": 0.0}  # fmt: skip


def test_the_verdict_names_the_largest_kind_of_phase_and_only_advice_the_run_can_take():
    gen = {"generate": 6.0, "update": 3.0, "score": 1.0}
    bound, advice = verdict(gen, 10.0, RUN)
    assert bound == "generation-bound (60% of the time)"
    assert "--rollout-name vllm" in advice and "at most the update's 30%" in advice
    # already on vLLM remote engines sampling ahead: neither is offered again
    bound, advice = verdict(
        gen, 10.0, {**RUN, "rollout_name": "vllm", "rollout_placement": "remote", "max_staleness": 1}
    )
    assert "--rollout-name vllm" not in advice and "--max-staleness" not in advice and "--num-rollout-engines" in advice
    # a remote engine's wait is generation; logprob passes and the update are the trainer's
    assert verdict({"waiting on remote engines": 5.0, "update": 4.0}, 10.0, RUN)[0].startswith("generation-bound")
    assert verdict({"old / ref logprobs": 3.0, "update": 3.0, "generate": 5.0}, 11.0, RUN)[0].startswith("trainer")
    assert verdict({"score": 5.0, "update": 1.0}, 6.0, RUN)[1].startswith(
        "more reward workers (--reward-workers, now 2,"
    )
    assert "--lora-rank" in verdict({"weight sync": 5.0, "update": 1.0}, 6.0, RUN)[1]
    assert "--lora-rank" not in verdict({"weight sync": 5.0}, 6.0, {**RUN, "lora_rank": 8})[1]


def test_trainer_bound_advice_follows_the_runs_flags():
    update = {"update": 8.0, "generate": 2.0}
    padded = {
        **RUN,
        "use_remove_padding": False,
        "padding": 0.4,
        "device": "cuda",
        "micro_batches": 4,
        "gradient_checkpointing": True,
    }
    advice = verdict(update, 10.0, padded)[1]
    for flag in (
        "--use-remove-padding auto",
        "40%",
        "--mixed-precision bf16",
        "--gradient-checkpointing",
        "--micro-batch-size-per-gpu (now 64)",
        "4 micro-batches",
        "--use-torch-compile",
    ):
        assert flag in advice, flag
    advice = verdict(update, 10.0, {**RUN, "device": "cuda", "mixed_precision": "bf16", "use_torch_compile": True})[1]
    for flag in (
        "--use-remove-padding",
        "--mixed-precision",
        "--gradient-checkpointing",
        "--micro-batch-size",
        "--use-torch-compile",
    ):
        assert flag not in advice, flag
    assert "--use-torch-compile" not in verdict(update, 10.0, padded | {"device": "cpu"})[1]  # little gain on a CPU


SLOW_REWARD = """
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.2)
    return float(solution_str.strip() == str(ground_truth))
"""
SHORT = ["--total-training-steps", "3", "--train-batch-size", "4", "--rollout-n", "4", "--check", "off",
         "--save-freq", "0", "--test-freq", "0", "--no-val-before-train"]  # fmt: skip


def closing_block(out: str) -> str:
    return out[out.index("where the time went") :]


@pytest.mark.e2e
def test_a_slow_reward_function_makes_the_run_reward_bound(tmp_path, small_files):
    (tmp_path / "reward.py").write_text(SLOW_REWARD)
    proc = run_recipe(
        "grpo", "--output-dir", tmp_path / "run", *small_files, *SHORT, "--reward-fn", tmp_path / "reward.py"
    )
    block = closing_block(proc.stdout + proc.stderr)
    assert "reward-bound" in block and "more reward workers (--reward-workers, now 2," in block, block
    records = [r for r in read_metrics(tmp_path / "run") if "perf/score_s" in r]
    assert all(r["perf/score_s"] >= 0.2 * 16 / 2 for r in records)  # 16 responses in 2 workers


@pytest.mark.e2e
def test_a_slow_update_makes_the_run_trainer_bound(tmp_path, small_files, monkeypatch):
    import time

    import common.parallel

    real = common.parallel.clip_grad_norm

    def slow(*args, **kwargs):  # once an optimizer step, inside the update
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(common.parallel, "clip_grad_norm", slow)
    proc = run_recipe("grpo", "--output-dir", tmp_path, *small_files, *SHORT)
    block = closing_block(proc.stdout + proc.stderr)
    assert "trainer-bound" in block and "update MFU" in block, block
    shares = dict(part.rsplit(" ", 1) for part in block.splitlines()[0].split(": ", 1)[1].split("  "))
    assert int(shares["update"].rstrip("%")) >= 50
    assert sum(int(v.rstrip("%")) for v in shares.values()) in range(97, 104)  # every second, once (rounded)


def test_the_micro_batch_advice_counts_the_passes_of_one_optimizer_step(tmp_path):
    """A larger --micro-batch-size-per-gpu merges the passes of one mini-batch, not the mini-batches of a step:
    four mini-batches of 8 sequences at a cap of 64 make no such advice; a cap of 4 splits each into 2 passes."""
    info = {"world_size": 1, "device": "cpu"}
    for cap, passes in ((64, 1), (4, 2)):
        flags = dict(train_batch_size=8, ppo_mini_batch_size=2, rollout_n=4, micro_batch_size_per_gpu=cap)
        run = rl_tracker(tmp_path / str(cap), info, **flags).run_facts
        assert run["micro_batches"] == passes
        advice = verdict({"update": 8.0, "generate": 2.0}, 10.0, {**RUN, **run})[1]
        assert ("--micro-batch-size-per-gpu" in advice) is (passes > 1), advice
