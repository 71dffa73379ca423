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
            dict(world_size=2, train_batch_size=8, micro_batch_size_per_gpu=3),
            "each process gets 4 sequences per optimizer step (8x1 over 2 processes), which is not divisible by micro_batch_size_per_gpu=3; try micro_batch_size_per_gpu=",
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
