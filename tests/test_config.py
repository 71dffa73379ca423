import pytest

from common.config import plan_batches


def test_plan_derives_local_sizes():
    plan = plan_batches(world_size=2, train_batch_size=8, micro_batch_size_per_gpu=4, mini_batch_size=4, rollout_n=4)
    assert plan.sequences_per_step == 32
    assert plan.local_sequences_per_step == 16
    assert plan.mini_batches_per_step == 2
    assert plan.local_mini_batch == 8
    assert plan.grad_accum == 2


def test_sft_plan_is_one_mini_batch():
    plan = plan_batches(world_size=1, train_batch_size=64, micro_batch_size_per_gpu=16)
    assert (plan.mini_batches_per_step, plan.grad_accum) == (1, 4)


def test_micro_batch_size_is_a_cap_not_a_divisor():
    """The user's first change of shape (12 prompts x 6 samples = 72 sequences, micro-batches of
    up to 64) plans a full micro-batch and a smaller last one."""
    plan = plan_batches(world_size=1, train_batch_size=12, micro_batch_size_per_gpu=64, mini_batch_size=12, rollout_n=6)
    assert (plan.local_mini_batch, plan.grad_accum) == (72, 2)
    plan = plan_batches(world_size=2, train_batch_size=8, micro_batch_size_per_gpu=3)
    assert (plan.local_mini_batch, plan.grad_accum) == (4, 2)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (
            dict(world_size=1, train_batch_size=48, micro_batch_size_per_gpu=8, mini_batch_size=32),
            "train_batch_size=48 prompts is not divisible by ppo_mini_batch_size=32; try ppo_mini_batch_size=",
        ),
        (
            dict(world_size=4, train_batch_size=6, micro_batch_size_per_gpu=1),
            "cannot be split evenly over 4 processes",
        ),
        (
            dict(
                world_size=1,
                train_batch_size=8,
                micro_batch_size_per_gpu=4,
                use_dynamic_bsz=True,
                max_token_len_per_gpu=50,
                max_sequence_length=80,
            ),  # fmt: skip
            "ppo_max_token_len_per_gpu=50 cannot hold one sequence of up to 80 tokens",
        ),
        (
            dict(world_size=1, train_batch_size=0, micro_batch_size_per_gpu=1),
            "train_batch_size=0 must be at least 1",
        ),
    ],
)
def test_indivisible_batches_name_the_numbers(kwargs, expected):
    with pytest.raises(ValueError) as err:
        plan_batches(**kwargs)
    assert expected in str(err.value)


def test_suggestions_are_valid():
    with pytest.raises(ValueError) as err:
        plan_batches(world_size=1, train_batch_size=48, micro_batch_size_per_gpu=1, mini_batch_size=32)
    suggested = [int(s) for s in str(err.value).split("ppo_mini_batch_size=")[-1].split(" or ")]
    assert suggested and all(48 % s == 0 for s in suggested)
