import math
import re
import sys
import typing
from types import SimpleNamespace

import pytest
from conftest import ROOT, load_recipe, make_args

from common.config import flag_types, plan_batches
from common.errors import UsageError
from common.flags import flag_defaults, flag_fields, in_range, must_be


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
            ),
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


def test_the_plan_carries_how_the_trainer_passes_run():
    """epochs x mini-batches x micro-batches: the micro-batch limits are split_rows' (a sequence cap,
    or with dynamic batching a token budget too), with the temperature and prompt sharing."""
    plan = plan_batches(
        world_size=1,
        train_batch_size=8,
        micro_batch_size_per_gpu=12,
        rollout_n=4,
        epochs=2,
        temperature=0.7,
        share_prompts=False,
    )
    assert (plan.epochs, plan.micro, plan.temperature, plan.share_prompts) == (
        2,
        {"max_seqs": 12, "max_tokens": None},
        0.7,
        False,
    )
    packed = plan_batches(
        world_size=1,
        train_batch_size=8,
        micro_batch_size_per_gpu=12,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=300,
        max_sequence_length=80,
    )
    assert packed.micro == {"max_seqs": 12, "max_tokens": 300} and packed.grad_accum == 0


def test_shuffled_mini_batches_hold_whole_groups_in_a_new_seeded_order_each_epoch():
    """--shuffle-mini-batches (verl's actor.shuffle): each call deals whole groups, each group's rows
    together and in order, into the mini-batches, every row once; two epochs differ; the order comes
    from torch's generator (so a resumed run, which restores it, deals the same). Without the flag, or
    with one mini-batch, the rows come as sampled and no number is drawn."""
    import torch

    group_ids = torch.arange(8).repeat_interleave(4)  # 8 prompts x 4 responses, one rank
    plan = plan_batches(
        world_size=1, train_batch_size=8, micro_batch_size_per_gpu=16, mini_batch_size=2, rollout_n=4, shuffle=True
    )
    torch.manual_seed(0)
    epochs = [plan.mini_batches(group_ids) for _ in range(2)]
    for minis in epochs:
        assert [len(m) for m in minis] == [8] * 4 and sorted(torch.cat(minis).tolist()) == list(range(32))
        for m in minis:
            for g in group_ids[m].unique():
                rows = m[group_ids[m] == g]
                assert rows.tolist() == list(range(int(g) * 4, int(g) * 4 + 4))  # whole, in order, adjacent
    assert any(not torch.equal(a, b) for a, b in zip(*epochs)), "each epoch a new order"
    torch.manual_seed(0)
    assert all(torch.equal(a, b) for a, b in zip(plan.mini_batches(group_ids), epochs[0]))
    state = torch.get_rng_state()
    for shuffle, mini in ((False, 2), (True, 8)):
        same = plan_batches(
            world_size=1,
            train_batch_size=8,
            micro_batch_size_per_gpu=16,
            mini_batch_size=mini,
            rollout_n=4,
            shuffle=shuffle,
        )
        assert torch.equal(torch.cat(same.mini_batches(group_ids)), torch.arange(32))
    assert torch.equal(torch.get_rng_state(), state)


def sync_of(args, needed_before_update=False):
    """The run's common.config.Sync (how engine and trainer keep to one policy), from args' groups."""
    from common.config import engine_sync

    return engine_sync(args.model, args.rollout, args.placement, args.correction, needed_before_update)


def engine_dtype(args, monkeypatch) -> str:
    """The dtype common.rollout.start_engine starts args' remote engines in (RemoteEngines recorded, not started)."""
    import common.serving.remote
    from common.rollout import start_engine

    seen = {}
    monkeypatch.setattr(common.serving.remote, "RemoteEngines", lambda *a, **kw: seen.update(kw))
    prompts, tokenizer = (
        SimpleNamespace(rows=[], max_length=8, total_steps=1),
        SimpleNamespace(pad_token_id=0, eos_token_id=1),
    )
    start_engine(None, tokenizer, SimpleNamespace(seed=0), 0, args.model, args.rollout, args.placement, prompts)
    return seen["dtype"]


def test_the_rollout_dtype_is_the_engines_and_the_gap_takes_the_coarser_bound(monkeypatch):
    """--rollout-dtype (verl's rollout.dtype) sets the dtype of an engine with weights of its own, and the
    engine-trainer gap (the launch check, the logged per-step gap) is held to the coarser of it and the
    trainer's; the HF engine runs in --dtype, so there the flag is refused naming what to add."""
    import torch

    from common.check import Check
    from common.config import RLArgs

    remote = make_args(RLArgs, rollout_placement="remote", rollout_dtype="bfloat16")
    assert engine_dtype(remote, monkeypatch) == "bfloat16" and sync_of(remote).gap_dtype == torch.bfloat16
    assert Check("fast", sync_of(remote), None, None, None).sync.gap_dtype == torch.bfloat16  # what the check holds
    assert engine_dtype(make_args(RLArgs, rollout_placement="remote"), monkeypatch) == "float32"
    assert sync_of(RLArgs()).gap_dtype == torch.float32
    assert sync_of(make_args(RLArgs, mixed_precision="bf16")).gap_dtype == torch.bfloat16
    assert (
        sync_of(
            make_args(RLArgs, rollout_placement="remote", rollout_dtype="float32", mixed_precision="bf16")
        ).gap_dtype
        == torch.bfloat16
    )
    with pytest.raises(
        UsageError,
        match=r"--rollout-dtype 'float16' would change nothing in this run: add "
        r"--rollout-name vllm or --rollout-placement remote",
    ):
        make_args(RLArgs, rollout_dtype="float16")


def test_where_old_logprobs_come_from():
    """The engine's own with --bypass-mode; a trainer pass whenever they are set against the
    engine's (remote engines hold their own weights; --rollout-is weighs them); else only when the
    policy moves before a sample is used."""
    from common.config import RLArgs

    assert sync_of(RLArgs()).old_logprobs == "when-stale"
    assert sync_of(make_args(RLArgs, rollout_is="token")).old_logprobs == "pass"
    assert sync_of(make_args(RLArgs, rollout_placement="remote")).old_logprobs == "pass"
    assert sync_of(make_args(RLArgs, bypass_mode=True)).old_logprobs == "engine"
    assert sync_of(make_args(RLArgs, bypass_mode=True, rollout_placement="remote")).old_logprobs == "engine"


class Loaded(Exception):
    """Raised in place of loading the models: the run got that far, asking for a reference or not."""


def loads_reference(module, monkeypatch, tmp_path, **flags) -> bool:
    """Whether the recipe's main asks common.rollout.load_rl_models for a frozen reference under these flags (its
    reward pool and models are not started: the run stops there)."""

    def load_rl_models(policy, dist, with_reference=False):
        raise Loaded(with_reference)

    monkeypatch.setattr(module, "load_rl_models", load_rl_models)
    monkeypatch.setattr(module, "start_reward_pool", lambda *a, **kw: None)
    train = ROOT / "bundled" / "addition" / "test.parquet"
    args = make_args(
        module.Args, output_dir=str(tmp_path / "run"), train_files=str(train), val_files=str(train), **flags
    )
    with pytest.raises(Loaded) as loaded:
        module.main(args)
    return bool(loaded.value.args[0])


def step_4_passes(module, monkeypatch, **flags) -> list[str]:
    """Which passes the recipe's step 4 (old_ref_logprobs) makes under these flags: "ref" (the reference's logprobs
    of the sampled tokens) and "full" (the exact KL of policy and reference, from a pass of both), no old pass."""
    import torch

    passes = []

    def forward_logprobs(model, batch, rows, plan, with_entropy=False, kl_ref=None):
        passes.append("full" if kl_ref is not None else model)
        return torch.zeros(len(rows), 2), None, torch.zeros(len(rows), 2)

    monkeypatch.setattr(module, "forward_logprobs", forward_logprobs)
    batch = {"responses": torch.zeros(4, 2, dtype=torch.long), "response_mask": torch.ones(4, 2), "timing": {}}
    batch["attention_mask"] = torch.ones(4, 4)  # two prompt tokens, two response tokens a row
    plan = plan_batches(world_size=1, train_batch_size=1, micro_batch_size_per_gpu=4, mini_batch_size=1, rollout_n=4)
    module.old_ref_logprobs("policy", "ref", batch, plan, "when-stale", make_args(module.Args, **flags))
    return passes


def test_a_kl_in_the_reward_needs_the_reference_and_old_logprobs_before_the_update(monkeypatch, tmp_path):
    grpo, rloo = load_recipe("grpo"), load_recipe("rloo")
    kl_loss, kl_reward = dict(use_kl_loss=True), dict(use_kl_in_reward=True)
    assert not loads_reference(grpo, monkeypatch, tmp_path) and loads_reference(grpo, monkeypatch, tmp_path, **kl_loss)
    # rloo passes use_kl_in_reward to engine_sync: old logprobs are needed before the update
    assert (loads_reference(rloo, monkeypatch, tmp_path), sync_of(rloo.Args()).old_logprobs) == (False, "when-stale")
    with_kl = make_args(rloo.Args, **kl_reward)
    assert (loads_reference(rloo, monkeypatch, tmp_path, **kl_reward), sync_of(with_kl, True).old_logprobs) == (
        True,
        "pass",
    )
    assert sync_of(make_args(rloo.Args, bypass_mode=True, **kl_reward), True).old_logprobs == "engine"
    # full: the reference runs beside the policy for the exact KL; step 4 has no sampled-token logprobs to make
    full_loss, full_reward = dict(kl_loss, kl_loss_type="full"), dict(kl_reward, kl_penalty="full")
    assert loads_reference(grpo, monkeypatch, tmp_path, **full_loss) and "ref" not in step_4_passes(
        grpo, monkeypatch, **full_loss
    )
    assert step_4_passes(grpo, monkeypatch, **kl_loss) == ["ref"]
    assert loads_reference(rloo, monkeypatch, tmp_path, **full_reward)
    assert step_4_passes(rloo, monkeypatch, **full_reward) == ["full"]  # the exact KL in the reward, no ref pass


def edges(f, hint, defaults: dict) -> tuple[list, list]:
    """(values on the allowed side of each of a field's bounds, values just past them), from the
    field's own metadata (common.flags); hint is its type (a tuple of numbers gets pairs); a bound
    naming another flag is that flag's default."""
    kinds = set(typing.get_args(hint) or (hint,))
    step, pair = (1e-3 if float in kinds else 1), typing.get_origin(hint) is tuple
    inside, outside = [], []
    for op, bound in f.metadata["bounds"].items():
        bound = defaults[bound] if isinstance(bound, str) else bound  # a bound naming another flag: its default
        inside.append(bound if op in ("ge", "le") else bound + step if op == "gt" else bound - step)
        outside.append(bound if op in ("gt", "lt") else bound - step if op == "ge" else bound + step)
    return [(v, v) if pair else v for v in inside], [(v, v) if pair else v for v in outside]


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (ROOT / "recipes").glob("*.py")))
def test_every_range_rule_holds_at_its_edges(recipe):
    """The range rules are one table, the fields' metadata: for every flag with bounds, the value
    just past an edge is a usage error naming the flag and saying what it must be (the words its
    field declares), and the edge's allowed side passes that rule (another check may still refuse
    it: a LoRA alpha without LoRA)."""
    module = load_recipe(recipe)
    hints = flag_types(module.Args)  # a group's flags (RLArgs.optim, RLArgs.conditioning) too
    defaults = flag_defaults(module.Args)
    ruled = [f for f in flag_fields(module.Args) if f.metadata.get("bounds")]
    for f in ruled:
        inside, outside = edges(f, hints[f.name], defaults)
        for value in outside:
            with pytest.raises(UsageError) as error:
                make_args(module.Args, **{f.name: value})
            assert f"--{f.name.replace('_', '-')} {value!r}: must be {must_be(f, defaults)}" in str(error.value)
        for value in inside:
            try:
                make_args(module.Args, **{f.name: value})
            except UsageError as refused:
                assert f"--{f.name.replace('_', '-')} {value!r}: must be" not in str(refused), refused
    assert len(ruled) >= {"sft": 15, "generate": 5, "evaluate": 2}.get(recipe, 20), [f.name for f in ruled]


def another_value(f, hint, default, defaults: dict):
    """A value of the flag's type, other than its default, inside its range (None if none is found)."""
    kinds = [k for k in (typing.get_args(hint) or (hint,)) if k is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return next(v for v in typing.get_args(hint) if v != default)
    if bool in kinds:
        return not default
    if typing.get_origin(hint) is tuple:
        return (1,) if int in typing.get_args(hint) else ("x",)
    if int in kinds or float in kinds:
        start = default if isinstance(default, int | float) else 1
        kind = float if float in kinds else int
        fits = (v for v in (start * 2, start + 1, start / 2, start - 1, 0.5, 1, 2) if kind(v) == v and v != default)
        return next((kind(v) for v in fits if in_range(f, kind(v), defaults)), None)
    return "x" if str in kinds else None


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (ROOT / "recipes").glob("*.py")))
def test_every_flag_read_only_with_another_is_refused_without_it(recipe):
    """The "only with" rules are one table, the fields' metadata (common.flags.flag's only_with): for every flag
    whose rule does not hold at the recipe's defaults, a value of its own is a usage error naming the flag and
    what to add, so a knob the run would not read is never silently dropped."""
    module = load_recipe(recipe)
    hints, defaults = flag_types(module.Args), flag_defaults(module.Args)
    view = SimpleNamespace(**defaults)
    ruled = [f for f in flag_fields(module.Args) if f.metadata.get("only_with")]
    checked = []
    for f in ruled:
        test, add = f.metadata["only_with"]
        value = another_value(f, hints[f.name], defaults[f.name], defaults)
        if test(view) or value is None:
            continue  # read at the defaults (--temperature with sampling on), or no simple value to try
        with pytest.raises(UsageError) as error:
            make_args(module.Args, **{f.name: value})
        assert f"--{f.name.replace('_', '-')} {value!r} would change nothing in this run: {add}" in str(error.value)
        checked.append(f.name)
    assert len(checked) >= {"sft": 3, "evaluate": 0, "generate": 10}.get(recipe, 25), checked


def test_a_fork_without_the_switch_reads_the_flag_its_own_way():
    """A fork that takes KLRewardArgs without --use-kl-in-reward (it puts the KL somewhere of its own) may set
    --kl-coef: the rule's switch is not its flag, so the rule does not apply, as a recipe's own rule would not."""
    from dataclasses import dataclass

    from common.config import KLRewardArgs, RLArgs

    @dataclass
    class Fork(KLRewardArgs, RLArgs):
        pass

    assert make_args(Fork, kl_coef=0.5).kl_coef == 0.5
    with pytest.raises(UsageError, match="--kl-coef 0.5 would change nothing in this run: add --use-kl-in-reward"):
        make_args(load_recipe("rloo").Args, kl_coef=0.5)


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (ROOT / "recipes").glob("*.py")))
def test_every_numeric_flag_has_a_range(recipe):
    """Each int and float flag of every script, set to a negative number (and each float to NaN),
    is a usage error as the flags are parsed: no numeric flag is left without its check (the
    sentinel -1 of --top-k still passes; -5 does not). --save-freq and --test-freq take any number:
    0 or below is never, as in verl (test_a_frequency_of_0_or_below_is_never)."""
    module = load_recipe(recipe)
    checked = []
    for name, hint in flag_types(module.Args).items():  # a group's flags (RLArgs.conditioning) too
        kinds = set(typing.get_args(hint) or (hint,))
        if bool in kinds or not kinds & {int, float} or name in ("save_freq", "test_freq"):
            continue
        values = [-5] if float not in kinds else [-0.5, math.nan]
        for value in [(v, 0.9) for v in values] if typing.get_origin(hint) is tuple else values:
            with pytest.raises(UsageError, match=f"--{name.replace('_', '-')}"):
                make_args(module.Args, **{name: value})
        checked.append(name)
    assert len(checked) >= {"sft": 18, "generate": 5, "evaluate": 2}.get(recipe, 20), checked
    assert recipe in ("sft", "generate", "evaluate") or {"reward_clip", "sft_loss_coef"} <= set(checked)


def test_a_frequency_of_0_or_below_is_never():
    """--save-freq / --test-freq N: every N steps and after the last; unset: only after the last; 0
    or below: never, as verl's trainer.save_freq / test_freq (whose default, -1, is never)."""
    from common.config import is_due

    def due(freq):
        return [step for step in range(1, 11) if is_due(step, freq, 10)]

    assert due(None) == [10] and due(3) == [3, 6, 9, 10] and due(10) == due(20) == [10]
    assert due(0) == due(-1) == due(-7) == []


def samplings(args, monkeypatch) -> tuple:
    """(training's Sampling, validation's): the rollout group's, and what common.rollout.Rollout.validate samples
    with from the validation group (its evaluate recorded, not run)."""
    import common.rollout

    seen = []
    monkeypatch.setattr(
        common.rollout, "evaluate", lambda engine, pool, tok, val, sampling, *a: seen.append(sampling) or {}
    )
    rollout = common.rollout.Rollout(None, [], None, None, None, None, args.rollout.sampling, args.validation)
    rollout.validate()
    return rollout.sampling, seen[0]


def test_validation_samples_with_its_own_top_p_top_k_and_min_p(monkeypatch):
    """As verl's val_kwargs: validation's top-p / top-k (and --val-min-p) are their own flags (off by default), not
    training's; at --val-temperature 0 (greedy) they would change nothing, so setting them is refused."""
    from common.config import RLArgs
    from common.formats.verl import translate

    train, val = samplings(make_args(RLArgs, top_p=0.5, top_k=3, min_p=0.1, val_temperature=0.7), monkeypatch)
    assert (train.top_p, train.top_k, train.min_p) == (0.5, 3, 0.1)
    assert (val.top_p, val.top_k, val.min_p, val.temperature) == (1.0, -1, 0.0, 0.7)
    val = samplings(make_args(RLArgs, val_temperature=0.7, val_top_p=0.9, val_top_k=20, val_min_p=0.05), monkeypatch)[1]
    assert (val.top_p, val.top_k, val.min_p) == (0.9, 20, 0.05)
    with pytest.raises(UsageError, match="--val-top-k 20 would change nothing in this run: add --val-temperature"):
        make_args(RLArgs, val_top_k=20)
    keys = ["actor_rollout_ref.rollout.val_kwargs.top_p=0.95", "actor_rollout_ref.rollout.val_kwargs.top_k=50"]
    assert translate(keys, RLArgs, "grpo", "grpo.py")[0] == ["--val-top-p", "0.95", "--val-top-k", "50"]


@pytest.mark.parametrize(
    "recipe, argv, said",
    [
        ("grpo", ["--lr", "1e-4", "--lr=3e-4"], "--lr is given twice"),
        ("generate", ["--input-key", "q", "--prompt-key", "p"], "--input-key and --prompt-key both set --prompt-key"),
        ("grpo", ["--val-before-train", "--no-val-before-train"], "--val-before-train and --no-val-before-train"),
        ("sft", ["--output-key", "a", "--response-key", "b"], "--output-key and --response-key both set"),
    ],
)
def test_a_flag_given_twice_or_under_two_spellings_is_refused(recipe, argv, said, monkeypatch):
    """argparse keeps the last of two settings of one flag in silence (--lr 1e-4 --lr 3e-4 trained at 3e-4); the
    command line names both. --check full's child runs, which append their flags over the user's, may repeat."""
    from common.config import LAST_WINS, cli, refuse_repeats

    args_class = load_recipe(recipe).Args
    with pytest.raises(UsageError, match=re.escape(said) + ".*give it once"):
        refuse_repeats(argv, args_class)
    refuse_repeats(["--lr", "1e-4", "--total-training-steps", "2"], args_class)  # distinct flags pass
    monkeypatch.setattr(sys, "argv", ["x.py", *argv])
    monkeypatch.setenv(LAST_WINS, "1")
    if recipe == "grpo" and argv[0] == "--lr":
        assert cli(args_class, "grpo", "grpo").optim.lr == 3e-4


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--rollout-name", "sglang"], "--rollout-name sglang: SGLang is not an engine here"),
        (["--strategy=deepspeed"], "--strategy deepspeed: DeepSpeed cannot run here"),
        (["--strategy", "megatron"], "--strategy megatron: Megatron cannot run here"),
        (["actor_rollout_ref.rollout.name=sglang"], "--rollout-name sglang: SGLang is not an engine here"),
    ],
)
def test_an_engine_or_strategy_of_another_tool_is_refused_with_its_reason(argv, said, monkeypatch):
    """SGLang, DeepSpeed and Megatron, as our users' tools name them (a flag or a verl key): one line with the
    reason and what to use, not the parser's list of choices."""
    from common.config import cli

    monkeypatch.setattr(sys, "argv", ["grpo.py", *argv])
    with pytest.raises(UsageError, match=re.escape(said)):
        cli(load_recipe("grpo").Args, "grpo", "grpo")
