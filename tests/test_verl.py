"""verl's command-line overrides (common.formats.verl): every key of verl's trainer configs is classified,
a verl GRPO command line runs after the entry point is swapped, and each kind of key (mapped,
no-op, fixed, refused, unknown) does what the table says."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import BUNDLED, ROOT, make_args, read_metrics, run_recipe

from common.errors import ORIGINS, UsageError, usage_errors
from common.flags import flag_types
from common.formats.verl import (
    ACTOR,
    ROLLOUT,
    VERL_DEFAULTS,
    VERL_KEYS,
    Fixed,
    Flag,
    NoOp,
    Refused,
    lookup,
    parse_value,
    translate,
    verl_args,
)

LOSS_FORKS = {
    "cispo": "cispo",
    "sapo": "sapo",
    "gmpo": "geo_mean",
    "clip_cov": "clip_cov",
    "kl_cov": "kl_cov",
    "dppo": "dppo_tv",
    "dro": "dro",
    "gpg": "gpg",
    "gspo": "gspo",
}  # recipe: the verl loss_mode it computes
RECIPES = (
    "sft",
    "grpo",
    "rloo",
    "reinforce_pp",
    "ppo",
    "dapo",
    "distill",
    "opo",
    "otb",
    "grpo_passk",
    "remax",
    "gdpo",
    *LOSS_FORKS,
    "generate",
    "evaluate",
)
ESTIMATOR = {
    "grpo": "grpo",
    "dapo": "grpo",
    "distill": "grpo",
    "rloo": "rloo",
    "reinforce_pp": "reinforce_plus_plus",
    "ppo": "gae",
    "opo": "opo",
    "otb": "optimal_token_baseline",
    "grpo_passk": "grpo_passk",
    "remax": "remax",
    "gdpo": "gdpo",
    **{r: "grpo" for r in LOSS_FORKS},
    "gpg": "gpg",
    "sft": None,
    "generate": None,
    "evaluate": None,
}


def args_class(recipe: str):
    spec = importlib.util.spec_from_file_location(f"verl_{recipe}", ROOT / "recipes" / f"{recipe}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Args


ARGS = {r: args_class(r) for r in ("grpo", "ppo", "sft", "reinforce_pp")}


def grpo(*argv):
    return translate(list(argv), ARGS["grpo"], "grpo", "grpo.py")


def test_every_key_of_verls_trainer_configs_is_classified():
    """tests/data/verl_keys.yaml lists every key the reference guides give for verl's PPO, SFT, generation
    and evaluation configs (tests/test_guides.py reads the guides to check that); each is mapped to a flag some recipe has, or declared a no-op, fixed or refused
    with a reason. None reaches the generic 'not a verl key' refusal."""
    keys = yaml.safe_load((Path(__file__).parent / "data" / "verl_keys.yaml").read_text())
    assert len(keys["ppo"]) > 140 and len(keys["sft"]) > 10 and len(keys["generation"]) > 30 and keys["megatron"]
    every_field = {name for r in RECIPES for name in flag_types(args_class(r))}  # a group's flags too
    for key in [key for section in keys.values() for key in section]:
        entry = lookup(key)
        assert entry is not None, f"{key}: not in common.formats.verl.VERL_KEYS"
        if isinstance(entry, Flag):
            assert entry.flag in every_field, f"{key} -> --{entry.flag}: no recipe has it"
        else:
            assert len(entry.why) > 15, key
    for key, entry in VERL_KEYS.items():  # the table's own flags exist too
        assert not isinstance(entry, Flag) or entry.flag in every_field, key


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_script_reads_verls_keys_as_its_own_estimator(recipe):
    """Every script hands its command line to common.config.cli (which reads it through cli_args:
    common.formats.verl's translation, where it holds verl's syntax), and names the verl estimator it runs (a fork
    must keep its parent's: dapo and gspo are verl's grpo), and the verl policy loss when it is not the vanilla one."""
    source = (ROOT / "recipes" / f"{recipe}.py").read_text()
    loss = f', loss_mode="{LOSS_FORKS[recipe]}"' if recipe in LOSS_FORKS else ""
    expected = f'cli(Args, RECIPE, "{ESTIMATOR[recipe]}"{loss})' if ESTIMATOR[recipe] else "cli(Args, RECIPE)"
    if recipe == "sft":
        expected = 'cli(Args, RECIPE, trainer="sft")'  # verl's SFT trainer's defaults, not its PPO trainer's
    assert f"main({expected})" in source


def verl_example(recipe: str, tmp_path) -> tuple[list[str], list[str]]:
    """(verl's documented GSM8K example for `recipe`, as a script passes it: its keys, with sizes
    cut down to the bundled task, paths local, 2 steps; the flags it must become)."""
    import pyarrow.parquet as pq

    train, test, model, out = (
        BUNDLED / "addition" / "train.parquet",
        tmp_path / "test.parquet",
        BUNDLED / "tiny-qwen2-sft",
        tmp_path / "run",
    )
    pq.write_table(pq.read_table(BUNDLED / "addition" / "test.parquet").slice(0, 32), test)  # a quick validation
    if recipe == "grpo":
        argv = [
            "algorithm.adv_estimator=grpo",
            f"data.train_files={train}",
            f"data.val_files={test}",
            "data.train_batch_size=8",
            "data.max_prompt_length=64",
            "data.max_response_length=16",
            "data.filter_overlong_prompts=True",
            "data.truncation='error'",
            f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.model.use_remove_padding=True",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.kl_loss_coef=0.001",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
            "actor_rollout_ref.actor.entropy_coeff=0",
            "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            "actor_rollout_ref.actor.fsdp_config.param_offload=False",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
            "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.ref.fsdp_config.param_offload=True",
            "algorithm.use_kl_in_reward=False",
            "trainer.critic_warmup=0",
            'trainer.logger=["console"]',
            "trainer.project_name=verl_grpo_example_gsm8k",
            "trainer.n_gpus_per_node=8",
            "trainer.nnodes=1",
            "trainer.save_freq=20",
            "trainer.test_freq=5",
            "trainer.total_epochs=15",
            "trainer.total_training_steps=2",
            f"trainer.default_local_dir={out}",
        ]
        flags = [
            "--train-files",
            str(train),
            "--val-files",
            str(test),
            "--train-batch-size",
            "8",
            "--max-prompt-length",
            "64",
            "--max-response-length",
            "16",
            "--filter-overlong-prompts",
            "--truncation",
            "error",
            "--model",
            str(model),
            "--lr",
            "1e-6",
            "--use-remove-padding",
            "True",
            "--ppo-mini-batch-size",
            "4",
            "--micro-batch-size-per-gpu",
            "8",
            "--use-kl-loss",
            "--kl-loss-coef",
            "0.001",
            "--kl-loss-type",
            "low_var_kl",
            "--entropy-coeff",
            "0",
            "--gradient-checkpointing",
            "--rollout-name",
            "hf",
            "--rollout-n",
            "4",
            "--logger",
            "console",
            "--project-name",
            "verl_grpo_example_gsm8k",
            "--save-freq",
            "20",
            "--test-freq",
            "5",
            "--total-epochs",
            "15",
            "--total-training-steps",
            "2",
            "--output-dir",
            str(out),
        ]
    else:  # ppo: a critic; kl_ctrl.kl_coef is unread by verl without use_kl_in_reward, and so here
        argv = [
            f"data.train_files={train}",
            f"data.val_files={test}",
            "data.train_batch_size=8",
            "data.max_prompt_length=64",
            "data.max_response_length=16",
            f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.rollout.n=1",  # verl's default n; ours is 16
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            "critic.optim.lr=1e-5",
            f"critic.model.path={model}",
            "critic.ppo_micro_batch_size_per_gpu=4",
            "algorithm.kl_ctrl.kl_coef=0.001",
            "trainer.logger=['console']",
            "trainer.val_before_train=False",
            "trainer.n_gpus_per_node=1",
            "trainer.nnodes=1",
            "trainer.save_freq=10",
            "trainer.test_freq=10",
            "trainer.total_epochs=15",
            "trainer.total_training_steps=2",
            f"trainer.default_local_dir={out}",
        ]
        flags = [
            "--train-files",
            str(train),
            "--val-files",
            str(test),
            "--train-batch-size",
            "8",
            "--max-prompt-length",
            "64",
            "--max-response-length",
            "16",
            "--model",
            str(model),
            "--lr",
            "1e-6",
            "--ppo-mini-batch-size",
            "4",
            "--micro-batch-size-per-gpu",
            "4",
            "--tensor-parallel-size",
            "1",
            "--rollout-name",
            "hf",
            "--rollout-n",
            "1",
            "--critic-lr",
            "1e-5",
            "--critic-model",
            str(model),
            "--logger",
            "console",
            "--no-val-before-train",
            "--save-freq",
            "10",
            "--test-freq",
            "10",
            "--total-epochs",
            "15",
            "--total-training-steps",
            "2",
            "--output-dir",
            str(out),
        ]
    return argv, flags


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_verls_examples_translate_and_run(recipe, tmp_path):
    """verl's GSM8K GRPO and PPO examples after `python recipes/<recipe>.py`: the flags they become
    are asserted, what has nothing to change here is named in one line, and each trains 2 steps."""
    argv, expected = verl_example(recipe, tmp_path)
    flags, said = translate(argv, ARGS[recipe], ESTIMATOR[recipe], f"{recipe}.py")
    assert flags == expected
    noops = {
        "grpo": (
            "algorithm.adv_estimator",
            "param_offload",
            "log_prob_micro_batch_size_per_gpu",
            "use_kl_in_reward",
            "trainer.critic_warmup",
            "trainer.n_gpus_per_node",
            "trainer.nnodes",
        ),
        "ppo": (
            "algorithm.kl_ctrl.kl_coef (verl reads it only with algorithm.use_kl_in_reward=True)",
            "critic.ppo_micro_batch_size_per_gpu",
            "trainer.nnodes",
        ),
    }[recipe]
    line, *differs = said  # the no-ops, named once in one line; then, in one more, the keys that differ in a detail
    assert all(key in line for key in noops), line
    assert differs == (
        []
        if recipe == "grpo"
        else [
            "verl keys whose meaning here differs in a detail "
            "(docs/configuration.md): critic.optim.lr (the critic takes the policy's schedule and warm-up "
            "here; verl's critic has its own); trainer.val_before_train (not again on a resumed run here; "
            "verl validates at each start)"
        ]
    )
    result = run_recipe(recipe, *argv)
    assert all(said_line in result.stderr for said_line in said)
    assert [m["step"] for m in read_metrics(tmp_path / "run") if "train/loss" in m] == [1, 2]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["trainer.nope=1"], "trainer.nope=1: not a verl key this library reads"),
        (
            ["trainer.val_only=True"],
            "trainer.val_only=True: only trainer.val_only=False is supported here: validation alone is evaluate.py",
        ),
        (
            ["actor_rollout_ref.model.override_config.attention_dropout=0.1"],
            "not supported here: a model config override is not built",
        ),
        (
            ["algorithm.filter_groups.enable=True"],
            "only algorithm.filter_groups.enable=False is supported here: dapo.py always filters",
        ),
        (["actor_rollout_ref.model.external_lib=pkg"], "would run its code"),
        (["actor_rollout_ref.rollout.ignore_eos=True"], "only actor_rollout_ref.rollout.ignore_eos=False is supported"),
        (
            ["algorithm.adv_estimator=grpo", "data.max_length=64"],
            "data.max_length=64: it sets --max-length, which grpo.py does not have",
        ),
        (["algorithm.adv_estimator=gae"], "grpo.py does not run that estimator; run recipes/ppo.py"),
        (["algorithm.adv_estimator=tir_optimal_token_baseline"], "run recipes/otb.py with the same arguments"),
        (["algorithm.adv_estimator=vectorised_grpo"], "not an estimator built here"),
        (["algorithm.adv_estimator=remax"], "grpo.py does not run that estimator; run recipes/remax.py"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"], "not a policy loss built here"),
        (
            ["custom_reward_function.reward_kwargs.bonus=0.1"],
            "keyword arguments for the reward function are not passed",
        ),
        (["actor_rollout_ref.actor.use_kl_loss=maybe"], "true or false, not 'maybe'"),
        (["custom_reward_function.name=score"], "give custom_reward_function.path as well"),
    ],
)
def test_keys_that_cannot_be_honoured_are_refused_with_the_key_and_why(argv, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        grpo(*argv)


def test_two_settings_of_one_flag_must_agree():
    """A verl key beside our own flag, or two verl keys, that set one flag: equal values (as numbers:
    1e-6 is 0.000001) are one setting; unequal ones stop the run naming both settings and both
    values, so no value a user gave goes unread, not even one another setting would have replaced."""
    flags, said = grpo("actor_rollout_ref.actor.optim.lr=1e-6", "data.train_batch_size=8", "--lr", "0.000001")
    assert flags == ["--train-batch-size", "8", "--lr", "0.000001"] and said == []
    refused = [
        (["actor_rollout_ref.actor.optim.lr=1e-6", "--lr", "3e-4"],
         "actor_rollout_ref.actor.optim.lr=1e-6 and --lr 3e-4 both set --lr, to different values (1e-6 and 3e-4)"),
        (["actor_rollout_ref.actor.use_kl_loss=True", "--no-use-kl-loss"],
         "actor_rollout_ref.actor.use_kl_loss=True and --no-use-kl-loss both set --use-kl-loss, to different values "
         "(--use-kl-loss and --no-use-kl-loss)"),
        (["--rollout-n", "4", "actor_rollout_ref.rollout.n=many"],
         "actor_rollout_ref.rollout.n=many and --rollout-n 4 both set --rollout-n, to different values (many and 4)"),
    ]  # fmt: skip
    for argv, words in refused:
        with pytest.raises(UsageError, match=re.escape(words + "; keep one")):
            grpo(*argv)
    # Two verl keys: verl keeps a switch for the policy and one for the critic; here one flag is both.
    both = ["actor_rollout_ref.model.use_remove_padding=True", "critic.model.use_remove_padding=False"]
    with pytest.raises(
        UsageError,
        match=re.escape(
            "critic.model.use_remove_padding=False and actor_rollout_ref.model.use_remove_padding=True both set "
            "--use-remove-padding, to different values (False and True)"
        ),
    ):
        translate(both, ARGS["ppo"], "gae", "ppo.py")
    # verl fills the rollout's lengths in from the data's: another value is a second setting, refused.
    lengths = ["data.max_response_length=512", "actor_rollout_ref.rollout.response_length=1024"]
    with pytest.raises(
        UsageError,
        match=re.escape(
            "actor_rollout_ref.rollout.response_length=1024 and "
            "data.max_response_length=512 both set --max-response-length"
        ),
    ):
        grpo(*lengths)
    assert grpo(lengths[0], "actor_rollout_ref.rollout.response_length=512")[0] == ["--max-response-length", "512"]
    same = ["actor_rollout_ref.model.use_remove_padding=True", "critic.model.use_remove_padding=True"]
    assert translate(same, ARGS["ppo"], "gae", "ppo.py")[0] == ["--use-remove-padding", "True"]
    # In a config file too; the command line's settings replace the file's, and say so.
    filed = {"actor_rollout_ref.model.use_remove_padding": True, "critic.model.use_remove_padding": False}
    with pytest.raises(
        UsageError,
        match=re.escape(
            "f.yaml: critic.model.use_remove_padding=False and f.yaml: "
            "actor_rollout_ref.model.use_remove_padding=True both set"
        ),
    ):
        translate([], ARGS["ppo"], "gae", "ppo.py", config=filed, source="f.yaml")
    flags, said = translate(
        ["--use-remove-padding", "False"], ARGS["ppo"], "gae", "ppo.py", config=filed, source="f.yaml"
    )
    assert flags == ["--use-remove-padding", "False"]
    assert said[-1] == (
        "verl config keys the command line overrides: f.yaml: actor_rollout_ref.model.use_remove_padding"
        "=True (by --use-remove-padding False)"
    )


def test_keys_that_combine_or_rename_values():
    # the reward function's path and name become one flag; verl's resume_path takes its path key
    flags, _ = grpo("custom_reward_function.path=r.py", "custom_reward_function.name=score")
    assert flags == ["--reward-fn", "r.py:score"]
    assert grpo("custom_reward_function.path=r.py")[0] == ["--reward-fn", "r.py:compute_score"]
    flags, _ = grpo("trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpt/step_10")
    assert flags == ["--resume", "/ckpt/step_10"]
    assert grpo("trainer.resume_mode=disable")[0] == ["--resume", "disable"]
    # do_sample=False is greedy validation whatever the temperature says, as in verl
    flags, _ = grpo(
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.7", "actor_rollout_ref.rollout.val_kwargs.do_sample=False"
    )
    assert flags == ["--val-temperature", "0"]
    assert grpo("actor_rollout_ref.rollout.val_kwargs.do_sample=True")[0] == []
    # Hydra's + and ++ prefixes, lists, null, and verl's dtype names
    assert grpo("++data.val_files=[a.parquet, 'b.parquet']")[0] == ["--val-files", "a.parquet", "b.parquet"]
    assert grpo("+data.tokenizer=null")[0] == ["--tokenizer", "None"]
    assert grpo("actor_rollout_ref.actor.fsdp_config.model_dtype=bf16")[0] == ["--dtype", "bfloat16"]
    assert grpo("actor_rollout_ref.actor.use_torch_compile=True")[0] == ["--use-torch-compile"]
    assert grpo("actor_rollout_ref.actor.use_torch_compile=False")[0] == ["--no-use-torch-compile"]
    # the ++baseline estimator is reinforce_pp.py with its group baseline
    flags, _ = translate(
        ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
        ARGS["reinforce_pp"],
        "reinforce_plus_plus",
        "reinforce_pp.py",
    )
    assert flags == ["--group-baseline"]
    # verl's reward managers: batch and prime are flags; dapo is dapo.py's own overlong buffer
    assert grpo("reward_model.reward_manager=batch")[0] == ["--reward-manager", "batch"]
    assert grpo("reward_model.reward_manager=prime")[0] == ["--reward-manager", "prime"]  # the pool, as naive
    with pytest.raises(UsageError, match="run recipes/dapo.py"):
        grpo("reward_model.reward_manager=dapo")
    dapo = translate(["reward_model.reward_manager=dapo"], args_class("dapo"), "grpo", "dapo.py")[0]
    assert dapo == ["--reward-manager", "naive"]
    # SFT's own key names
    flags, _ = translate(
        [
            "model.partial_pretrain=m",
            "optim.lr=1e-4",
            "data.micro_batch_size_per_gpu=4",
            "data.multiturn.messages_key=messages",
        ],
        ARGS["sft"],
        None,
        "sft.py",
    )
    assert flags == ["--model", "m", "--lr", "1e-4", "--micro-batch-size-per-gpu", "4", "--messages-key", "messages"]
    assert parse_value(" [ ] ") == [] and parse_value("True") is True and parse_value("~") is None


# verl's defaults the guides do not list: from verl's sft_trainer.yaml and its DAPO recipe's config
NOT_IN_THE_GUIDES = {"reward_model.overlong_buffer.enable", "optim.betas", "data.train_batch_size",
                     "data.micro_batch_size_per_gpu", "data.max_length", "data.truncation", "trainer.total_epochs",
                     "trainer.total_training_steps", "trainer.save_freq", "trainer.test_freq"}  # fmt: skip


def test_keys_a_verl_command_leaves_out_take_verls_defaults():
    """A command with verl keys means verl's defaults for the rest (VERL_DEFAULTS, as the guides
    list them), said in one line; our own flags, and a verl key naming the same flag, win; keys verl
    would not read stay out; a command without verl keys is untouched."""
    guide = yaml.safe_load((ROOT / "tests" / "data" / "verl_keys.yaml").read_text())
    for trainer, defaults in VERL_DEFAULTS.items():
        for key, value in defaults.items():
            if key not in guide[trainer]:  # verl's own config files', the guides leave these out
                assert key in NOT_IN_THE_GUIDES, key
            elif value is None:  # verl's null, which the guides leave out or list as null
                assert guide[trainer].get(key) is None, key
            else:
                assert (
                    float(value) == float(guide[trainer][key])
                    if not isinstance(value, str)
                    else value == guide[trainer][key]
                )

    def flags(argv, recipe="grpo", estimator="grpo", trainer="ppo"):
        tokens, said = translate(argv, ARGS[recipe], estimator, f"{recipe}.py", trainer=trainer)
        found = {}  # flag -> its value, or True for a switch
        for i, token in enumerate(tokens):
            if token.startswith("--"):
                follows = tokens[i + 1] if i + 1 < len(tokens) else "--"
                found[token] = True if follows.startswith("--") else follows
        return found, said

    found, said = flags(["trainer.total_epochs=2"])
    assert found == {
        "--total-epochs": "2",
        "--max-prompt-length": "512",
        "--max-response-length": "512",
        "--train-batch-size": "1024",
        "--ppo-mini-batch-size": "256",
        "--lr": "1e-06",
        "--lr-scheduler": "constant",
        "--rollout-n": "1",
        "--save-freq": "-1",
        "--total-training-steps": "None",
    }
    assert said == [
        "verl's defaults for the keys this command leaves out: data.max_prompt_length=512, "
        "data.max_response_length=512, data.train_batch_size=1024, "
        "actor_rollout_ref.actor.ppo_mini_batch_size=256, actor_rollout_ref.actor.optim.lr=1e-06, "
        "actor_rollout_ref.actor.optim.warmup_style=constant, actor_rollout_ref.rollout.n=1, "
        "trainer.save_freq=-1, trainer.total_training_steps=None"
    ]
    found, _ = flags(
        ["trainer.total_epochs=2", "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "--lr", "1e-5"]
    )
    assert found["--lr-scheduler"] == "cosine" and found["--lr"] == "1e-5"
    # ppo.py: verl's in-reward KL is off unless asked for, and its coefficient is read only then
    found, _ = flags(["trainer.total_epochs=2"], "ppo", "gae")
    assert found["--no-use-kl-in-reward"] is True and "--kl-coef" not in found
    assert found["--critic-lr"] == "1e-05"
    found, _ = flags(["algorithm.use_kl_in_reward=True"], "ppo", "gae")
    assert found["--kl-coef"] == "0.001"
    # sft.py takes verl's SFT trainer's defaults; generate.py and evaluate.py none
    found, _ = flags(["optim.lr=1e-4"], "sft", None, "sft")
    assert found == {
        "--lr": "1e-4",
        "--weight-decay": "0.01",
        "--lr-warmup-steps-ratio": "0.1",
        "--betas": "0.9",
        "--train-batch-size": "256",
        "--micro-batch-size-per-gpu": "4",
        "--max-length": "1024",
        "--truncation": "error",
        "--total-epochs": "4",
        "--total-training-steps": "None",
        "--save-freq": "-1",
        "--test-freq": "-1",
    }
    tokens = translate(["optim.lr=1e-4"], ARGS["sft"], None, "sft.py", trainer="sft")[0]
    assert tokens[tokens.index("--betas") : tokens.index("--betas") + 3] == ["--betas", "0.9", "0.95"]
    assert flags(["trainer.total_epochs=2"], trainer=None)[0] == {"--total-epochs": "2"}
    assert translate(["--lr", "1"], ARGS["grpo"], "grpo", "grpo.py", trainer="ppo") == (["--lr", "1"], [])


def test_a_hydra_launch_composes_the_config_and_its_defaults(tmp_path, capsys):
    """--config-path DIR --config-name NAME as verl's example scripts launch main_ppo: the file's
    defaults list in Hydra's order (the file's own keys at _self_, else last; later wins), verl's
    ppo_trainer standing for verl's defaults, ${...} resolved, then the command line's keys, then
    our own flags. What cannot be composed is a usage error naming the file or the entry."""
    (tmp_path / "shared.yaml").write_text(
        yaml.safe_dump(
            {
                "data": {"train_batch_size": 8, "max_prompt_length": 64},
                "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-5}}},
            }
        )
    )
    main = {"hydra": {"searchpath": ["file://verl/trainer/config"]}, "defaults": ["ppo_trainer", "shared", "_self_"],
            "data": {"train_batch_size": 4}, "actor_rollout_ref": {"rollout": {"n": 2}},
            "trainer": {"experiment_name": "x", "default_local_dir": "runs/${trainer.experiment_name}"}}  # fmt: skip
    (tmp_path / "main.yaml").write_text(yaml.safe_dump(main))

    def launch(*argv, recipe="grpo", estimator="grpo"):
        tokens = verl_args(ARGS[recipe], estimator, ["--config-path", str(tmp_path), *argv])
        return dict(zip(tokens[::2], tokens[1::2]))

    found = launch("--config-name", "main", "data.max_prompt_length=32", "--lr", "3e-5")
    assert found["--train-batch-size"] == "4" and found["--max-prompt-length"] == "32" and found["--lr"] == "3e-5"
    assert found["--rollout-n"] == "2" and found["--output-dir"] == "runs/x"
    assert found["--ppo-mini-batch-size"] == "256"  # verl's default, for the key no file sets
    said = capsys.readouterr().err
    assert "hydra.searchpath" in said and "actor_rollout_ref.actor.optim.lr=1e-05 (by --lr 3e-5)" in said
    main["defaults"] = ["_self_", "shared"]  # the defaults list's file now comes after the config's own keys
    (tmp_path / "main.yaml").write_text(yaml.safe_dump(main))
    assert launch("--config-name=main")["--train-batch-size"] == "8"
    main["defaults"] = ["shared"]  # no _self_: the config's own keys come last, as in Hydra
    (tmp_path / "main.yaml").write_text(yaml.safe_dump(main))
    assert launch("-cn", "main")["--train-batch-size"] == "4"
    for defaults, message in (
        (["ppo_trainer", "missing"], "no file .*missing.yaml"),
        ([{"actor@actor_rollout_ref.actor": "dp_actor"}], "config groups are not composed here"),
        (["sft_trainer"], "sft_trainer is verl's config for another entry point"),
        (["main"], "in a circle"),
    ):
        main["defaults"] = defaults
        (tmp_path / "main.yaml").write_text(yaml.safe_dump(main))
        with pytest.raises(UsageError, match=message):
            launch("--config-name", "main")
    with pytest.raises(UsageError, match="give --config-name as well"):
        launch()
    with pytest.raises(UsageError, match="not both"):
        launch("--config-name", "main", "--verl-config", str(tmp_path / "main.yaml"))


def test_a_usage_error_names_the_verl_key_behind_a_flag(capsys):
    """A usage error about a flag a verl key set (or verl's default for a key left out) says which
    key, so the user finds what they typed; flags the message does not name are not listed."""
    verl_args(ARGS["grpo"], "grpo", ["data.train_batch_size=4", "actor_rollout_ref.actor.optim.lr=1e-6"])
    try:
        with pytest.raises(SystemExit), usage_errors():
            raise UsageError("train_batch_size=4 prompts is not divisible by ppo_mini_batch_size=256")
    finally:
        ORIGINS.clear()
    error = capsys.readouterr().err.split("error: ")[1]
    assert error.splitlines()[1:] == [
        "  (--train-batch-size came from data.train_batch_size=4)",
        "  (--ppo-mini-batch-size came from verl's default actor_rollout_ref.actor.ppo_mini_batch_size=256, "
        "a key this command leaves out)",
    ]


def test_print_verl_translation_prints_the_command_and_starts_nothing(tmp_path):
    result = run_recipe(
        "ppo",
        "--print-verl-translation",
        "algorithm.adv_estimator=gae",
        "critic.optim.lr=1e-5",
        "algorithm.lam=0.9",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    )
    command = result.stdout.strip()
    assert f"ppo.py --critic-lr 1e-5 --lam 0.9 --output-dir {tmp_path / 'run'} --max-prompt-length 512 " in command
    assert command.endswith(
        " --rollout-n 1 --total-epochs 30 --save-freq -1 --total-training-steps None --no-use-kl-in-reward"
    )  # verl's defaults follow
    assert not (tmp_path / "run").exists()


SHORT = {
    "actor.": ACTOR,
    "rollout.": ROLLOUT,
    "val_kwargs.": ROLLOUT + "val_kwargs.",
    "fsdp_config.": ACTOR + "fsdp_config.",
}


def test_the_coming_from_verl_table_agrees_with_the_translation_table():
    """Every full verl key in docs/configuration.md's "Coming from verl" table is one the translation
    reads, and where the table names flags for a mapped key, the key's flag is among them."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text.split("## Coming from verl", 1)[1].split("\n## ", 1)[0]
    checked = 0
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first, mapped = re.split(r"(?<!\\)\|", line)[1:3]
        for key in re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)`", first):
            if key.startswith("extra_info.") or key in ("reward_model.ground_truth", "reward_model.style"):
                continue  # a column of the data, not a config key
            for short, full in SHORT.items():  # the table's short forms: actor.clip_ratio
                key = full + key.removeprefix(short) if key.startswith(short) else key
            entry = lookup(key)
            assert entry is not None, f"{key}: in the docs table, not in common.formats.verl.VERL_KEYS"
            if isinstance(entry, Flag) and "--" in mapped:
                assert "--" + entry.flag.replace("_", "-") in mapped, f"{key}: the table says {mapped.strip()}"
            checked += 1
    assert checked > 20
    assert {type(e) for e in VERL_KEYS.values()} == {Flag, NoOp, Fixed, Refused}


def verl_config(overrides: dict) -> dict:
    """verl's PPO trainer config as the guides give it (tests/data/verl_keys.yaml, nested again),
    with `overrides` (dotted keys) set: what a user's or a saved verl config file holds."""
    keys = yaml.safe_load((Path(__file__).parent / "data" / "verl_keys.yaml").read_text())["ppo"]
    keys = {k: v for k, v in keys.items() if ".reward_kwargs." not in k}  # the guide's example arguments
    tree = {}
    for key, value in {**keys, **overrides}.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def test_a_verl_config_file_runs_ppo(tmp_path):
    """--verl-config: every key of verl's PPO trainer config, the local ones set as a user would
    (paths, sizes, the HF engine), `${...}` references resolved; a key on the command line wins
    over the file and our own flag over both."""
    model = str(BUNDLED / "tiny-qwen2-sft")
    config = verl_config(
        {
            "data.train_files": [str(BUNDLED / "addition" / "train.parquet")],
            "data.val_files": str(BUNDLED / "addition" / "test.parquet"),
            "data.train_batch_size": 4,
            "data.max_prompt_length": 64,
            "data.max_response_length": 8,
            "actor_rollout_ref.model.path": model,
            "critic.model.path": model,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8,
            "actor_rollout_ref.rollout.n": 2,
            "actor_rollout_ref.rollout.name": "hf",
            "actor_rollout_ref.actor.use_torch_compile": False,  # compiling costs 35 s on CPU (tests/test_rollout.py)
            "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
            "actor_rollout_ref.rollout.free_cache_engine": False,
            "actor_rollout_ref.rollout.tool_kwargs.tools_config_file": None,
            "actor_rollout_ref.rollout.interaction_config_file": None,
            "trainer.default_hdfs_dir": None,
            "trainer.total_training_steps": 2,
            "trainer.test_freq": 0,
            "trainer.save_freq": 0,
            "trainer.logger": ["console"],
            "trainer.val_before_train": False,
            "trainer.n_gpus_per_node": 1,
            "trainer.project_name": "verl_yaml",
            "trainer.default_local_dir": str(tmp_path / "${trainer.project_name}" / "${trainer.experiment_name}"),
        }
    )
    path = tmp_path / "ppo_trainer.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_recipe("ppo", "--verl-config", path, "critic.optim.lr=3e-5", "--critic-lr", "0.00003")
    run = tmp_path / "verl_yaml" / config["trainer"]["experiment_name"]
    assert [m["step"] for m in read_metrics(run) if "train/loss" in m] == [1, 2]
    assert "both set" not in result.stderr  # the command line's key and flag agree, and replace the file's key
    saved = json.loads((run / "config.json").read_text())
    assert (saved["critic_lr"], saved["lr"], saved["rollout_n"], saved["model"]) == (3e-5, 1e-6, 2, model)


VERL_BATCH_REWARD = """
import os, re

def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
    with open(os.environ["BATCH_CALLS"], "a") as f:
        f.write(f"{len(solution_strs)}\\n")
    answers = [re.search(r"<answer>(.*?)</answer>", s) for s in solution_strs]
    return [{"score": float(bool(a) and a.group(1).strip() == str(g)), "formatted": float(bool(a))}
            for a, g in zip(answers, ground_truths)]
"""


def test_a_verl_batch_reward_function_trains_grpo(tmp_path):
    """verl's batch reward manager from verl's keys: the function is called once per step with the
    step's 4 prompts x 2 samples (after the dry run's call and the launch check's reward-signal probe, 4 prompts
    x 2 samples too), and its extra key is a metric."""
    (tmp_path / "batch_reward.py").write_text(VERL_BATCH_REWARD)
    calls = tmp_path / "calls"
    out = tmp_path / "run"
    run_recipe(
        "grpo",
        "reward_model.reward_manager=batch",
        f"custom_reward_function.path={tmp_path / 'batch_reward.py'}",
        f"data.train_files={BUNDLED / 'addition' / 'train.parquet'}",
        "data.val_files=[]",
        "data.train_batch_size=4",
        "data.max_prompt_length=64",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"actor_rollout_ref.model.path={BUNDLED / 'tiny-qwen2-sft'}",
        "trainer.total_training_steps=2",
        "trainer.save_freq=0",
        f"trainer.default_local_dir={out}",
        env={"BATCH_CALLS": str(calls)},
    )
    assert calls.read_text().split()[1:] == ["8", "8", "8"]
    steps = [m for m in read_metrics(out) if "train/loss" in m]
    assert len(steps) == 2 and all(0 <= m["reward/mean"] <= 1 for m in steps)
    assert any(key.endswith("formatted") for key in steps[0]), sorted(steps[0])


VERL_CALCULATOR_TOOL = """
import json, os, sys
sys.path.insert(0, os.environ["CALCULATOR_DIR"])
from calculator import calculator

class CalculatorTool:
    # A verl tool class over the bundled calculator: it remembers, per conversation, whether a
    # result it gave equals the row's answer (create_kwargs), as verl's GSM8K tool does.

    def __init__(self, config, tool_schema):
        self.name, self.hits = tool_schema.function.name, {}

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        self.hits[instance_id] = [str(ground_truth), 0.0]
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        result = calculator(**parameters)
        if result == self.hits[instance_id][0]:
            self.hits[instance_id][1] = 1.0
        return result, 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        return self.hits[instance_id][1]

    async def release(self, instance_id, **kwargs):
        del self.hits[instance_id]
"""

VERL_TOOL_REWARD = """
import json, os, re

def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
    with open(os.environ["TOOL_SCORES"], "a") as f:
        f.write(json.dumps([(e or {}).get("rollout_reward_scores") for e in extra_infos]) + "\\n")
    out = []
    for s, g in zip(solution_strs, ground_truths):
        m = re.search(r"<answer>(.*?)</answer>", s)
        out.append(float(bool(m) and m.group(1).strip() == str(g)))
    return out
"""


def test_a_verl_multi_turn_tool_run(tmp_path):
    """verl's multi-turn GRPO launch (its GSM8K tool example's Hydra config and keys, sizes cut
    down, paths local) on the bundled tool task: a verl tool class given each row's tools_kwargs, scored by a
    batch reward function that reads the tool's calc_reward from rollout_reward_scores."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(BUNDLED / "calculator" / "train.parquet").slice(0, 64).to_pylist()
    for r in rows:
        r["extra_info"]["tools_kwargs"] = {
            "calculator": {"create_kwargs": {"ground_truth": r["reward_model"]["ground_truth"]}}
        }
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    (tmp_path / "calculator_tool.py").write_text(VERL_CALCULATOR_TOOL)
    (tmp_path / "reward.py").write_text(VERL_TOOL_REWARD)
    schema = yaml.safe_load((BUNDLED / "calculator" / "tools.yaml").read_text())["tools"][0]["tool_schema"]
    config = {
        "tools": [
            {"class_name": "calculator_tool.py:CalculatorTool", "config": {"type": "native"}, "tool_schema": schema}
        ]
    }
    (tmp_path / "tool_config.yaml").write_text(yaml.safe_dump(config))
    # verl's example launches main_ppo with --config-path/--config-name and a config of its own:
    # verl's ppo_trainer, then the multi-turn sections (sizes cut down, the engine ours)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "gsm8k_multiturn_grpo.yaml").write_text(
        yaml.safe_dump(
            {
                "hydra": {"searchpath": ["file://verl/trainer/config"]},
                "defaults": ["ppo_trainer", "_self_"],
                "data": {
                    "max_prompt_length": 128,
                    "max_response_length": 128,
                    "train_batch_size": 8,
                    "return_raw_chat": True,
                },
                "actor_rollout_ref": {
                    "hybrid_engine": True,
                    "rollout": {"name": "hf", "multi_turn": {"enable": True, "max_assistant_turns": 3}},
                },
            }
        )
    )
    scores, out = tmp_path / "scores", tmp_path / "run"
    run_recipe(
        "grpo",
        f"--config-path={tmp_path / 'config'}",
        "--config-name=gsm8k_multiturn_grpo",
        "algorithm.adv_estimator=grpo",
        "data.filter_overlong_prompts=True",
        "data.truncation=error",
        f"actor_rollout_ref.model.path={BUNDLED / 'tiny-qwen2-tools'}",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.rollout.n=4",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tool_config.yaml'}",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        "trainer.logger=['console']",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        f"data.train_files={tmp_path / 'train.parquet'}",
        "data.val_files=[]",
        "trainer.total_training_steps=2",
        f"trainer.default_local_dir={out}",
        "reward_model.reward_manager=batch",
        f"custom_reward_function.path={tmp_path / 'reward.py'}",
        env={"CALCULATOR_DIR": str(BUNDLED / "calculator"), "TOOL_SCORES": str(scores)},
    )
    steps = [m for m in read_metrics(out) if "train/loss" in m]
    assert len(steps) == 2 and sum(m["agent/tool_calls_mean"] for m in steps) > 0
    assert all(m["agent/tool_errors"] == 0 for m in steps)
    seen = [s for line in scores.read_text().splitlines()[1:] for s in json.loads(line)]
    assert len(seen) == 4 * 4 + 2 * 8 * 4  # the launch check's reward-signal probe (4 prompts x 4), then 2 steps
    called = [s for s in seen if s]  # conversations that called the calculator carry its calc_reward
    assert called and all(set(s) == {"calculator"} and s["calculator"] in (0.0, 1.0) for s in called)


def test_verls_generation_and_eval_commands_run(tmp_path):
    """verl's main_generation and main_eval argument lists (its documented example's keys, sizes
    cut down, paths local) after generate.py and evaluate.py."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(BUNDLED / "addition" / "test.parquet").slice(0, 16).to_pylist()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    out = tmp_path / "gen.parquet"
    result = run_recipe(
        "generate",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        f"data.path={tmp_path / 'test.parquet'}",
        "data.prompt_key=prompt",
        "data.n_samples=2",
        f"data.output_path={out}",
        f"model.path={BUNDLED / 'tiny-qwen2-sft'}",
        "+model.trust_remote_code=False",
        "rollout.temperature=1.0",
        "rollout.top_k=50",
        "rollout.top_p=0.7",
        "rollout.prompt_length=64",
        "rollout.response_length=8",
        "rollout.tensor_model_parallel_size=1",
        "data.batch_size=8",
    )
    assert "trainer.nnodes, trainer.n_gpus_per_node" in result.stderr
    generated = pq.read_table(out).to_pylist()
    assert len(generated) == 16 and all(len(r["responses"]) == 2 for r in generated)
    run_recipe(
        "evaluate",
        f"data.path={out}",
        "data.response_key=responses",
        "data.data_source_key=data_source",
        "data.reward_model_key=reward_model",
        "--output-json",
        tmp_path / "eval.json",
    )
    metrics = json.loads((tmp_path / "eval.json").read_text())
    assert any("pass@2" in key for key in json.dumps(metrics).split('"')), metrics


def test_a_frequency_of_minus_1_means_never_as_in_verl(tmp_path, small_train, small_val):
    """trainer.test_freq=-1 means no validation and a save_freq left out (verl's -1) no checkpoint, as
    verl's trainer reads them (> 0 or never): 2 steps with a validation set validate only before
    training (verl's val_before_train) and leave no checkpoint."""
    out = tmp_path / "run"
    run_recipe(
        "grpo",
        f"data.train_files={small_train}",
        f"data.val_files={small_val}",
        "data.train_batch_size=4",
        "data.max_prompt_length=64",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"actor_rollout_ref.model.path={BUNDLED / 'tiny-qwen2-sft'}",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        f"trainer.default_local_dir={out}",
    )
    validated = [m["step"] for m in read_metrics(out) if "val/accuracy" in m]
    assert validated == [0] and len([m for m in read_metrics(out) if "train/loss" in m]) == 2
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())


def test_total_training_steps_past_verls_epochs_is_refused(tmp_path, small_train, monkeypatch):
    """verl ends a run at trainer.total_training_steps or at the end of trainer.total_epochs, whichever
    comes first; --total-training-steps overrides the epochs. A verl key asking for more steps than its
    epochs hold (verl's default 30 epochs included) is refused before the model loads, with both ways out;
    our own flag keeps its meaning, and a verl command whose epochs cover the steps runs them."""
    from conftest import make_args

    args = make_args(args_class("grpo"), total_training_steps=1000, total_epochs=2)

    def total_steps(train_rows: int) -> int:  # as the recipe's main reads it: steps an epoch from the rows
        return args.trainer.total_steps(train_rows // args.data.train_batch_size)

    for name in ("total_training_steps", "total_epochs"):  # what an earlier translation in this process left
        monkeypatch.delitem(ORIGINS, name, raising=False)
    assert total_steps(16 * 100) == 1000  # our flag: 1000 steps, 10 passes over the data
    monkeypatch.setitem(ORIGINS, "total_training_steps", "trainer.total_training_steps=1000")
    assert total_steps(16 * 500) == 1000  # 2 epochs of 500 steps cover it
    with pytest.raises(
        UsageError,
        match=r"trainer.total_training_steps=1000: verl would stop after 2 epochs "
        r"\(--total-epochs\), 200 steps of 100.* give trainer.total_training_steps=200,"
        r" or trainer.total_epochs=10 for all 1000",
    ):
        total_steps(16 * 100)
    monkeypatch.delitem(ORIGINS, "total_training_steps")
    rows = len(__import__("pyarrow.parquet").parquet.read_table(small_train))
    proc = run_recipe(
        "grpo",
        f"data.train_files={small_train}",
        "data.train_batch_size=4",
        "trainer.total_training_steps=9999",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        check=False,
    )
    assert (
        proc.returncode == 2
        and "trainer.total_training_steps=9999: verl would stop after 30 epochs (verl's "
        f"default trainer.total_epochs=30, a key this command leaves out), {30 * (rows // 4)} steps"
        in proc.stderr
    )


def test_offload_is_the_launchs_megatron_is_refused_and_a_mini_batch_shuffle_is_read(monkeypatch):
    """The trained model's param_offload / optimizer_offload=True needs the launch's FSDP2 offload
    (configs/fsdp2_offload.yaml sets FSDP_OFFLOAD_PARAMS): without it the key is refused naming the
    config, with it the key is read as on; the reference's offload follows the launch either way.
    strategy=megatron is refused, naming FSDP2; actor.shuffle=True is --shuffle-mini-batches; rollout.dtype is
    --rollout-dtype for an engine with weights of its own."""
    on = "actor_rollout_ref.actor.fsdp_config.param_offload=True"
    monkeypatch.delenv("FSDP_OFFLOAD_PARAMS", raising=False)
    with pytest.raises(
        UsageError,
        match=re.escape(
            f"{on}: CPU offload here is the launch's: accelerate launch --config_file configs/fsdp2_offload.yaml"
        ),
    ):
        grpo(on)
    flags, said = grpo("actor_rollout_ref.ref.fsdp_config.param_offload=True", f"{on[:-4]}False")
    assert flags == [] and "actor_rollout_ref.ref.fsdp_config.param_offload" in said[0]
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    assert grpo(on, "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True")[0] == []
    assert grpo("actor_rollout_ref.actor.shuffle=True")[0] == ["--shuffle-mini-batches"]
    # rollout.dtype: the dtype of an engine with weights of its own; the HF engine's is the policy's
    flags, _ = grpo("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=bf16")
    assert flags == ["--rollout-name", "vllm", "--rollout-dtype", "bfloat16"]
    flags, said = grpo("actor_rollout_ref.rollout.dtype=bfloat16")
    assert flags == [] and "actor_rollout_ref.rollout.dtype (the HF engine runs in the policy's dtype" in said[0]
    with pytest.raises(UsageError, match="actor_rollout_ref.actor.strategy=megatron: Megatron is not built here"):
        grpo("actor_rollout_ref.actor.strategy=megatron")
    assert grpo("actor_rollout_ref.actor.strategy=fsdp2")[0] == []


def test_verls_critic_warmup_counts_as_verl_counts():
    """verl updates the actor from its step trainer.critic_warmup on, counting steps from 1: N leaves
    N - 1 critic-only steps, which --critic-warmup (ROLL's count) says as N - 1."""
    for n, alone in ((0, 0), (1, 0), (3, 2)):
        flags = translate([f"trainer.critic_warmup={n}"], ARGS["ppo"], "gae", "ppo.py")[0]
        assert flags == ["--critic-warmup", str(alone)], (n, flags)


def test_a_null_checkpoint_count_keeps_every_checkpoint_as_in_verl():
    """trainer.max_actor_ckpt_to_keep=null (verl's default, in every saved verl config) keeps them all:
    --max-ckpt-to-keep 0, where it was passed on as None and refused by the flag's parser."""
    assert grpo("trainer.max_actor_ckpt_to_keep=null")[0] == ["--max-ckpt-to-keep", "0"]
    assert grpo("trainer.max_actor_ckpt_to_keep=3")[0] == ["--max-ckpt-to-keep", "3"]


def test_generation_yamls_rollout_keys_are_read():
    """verl's generation.yaml's rollout.mode, rollout.n and rollout.calculate_log_probs (the guide's
    defaults) are read by generate.py's translation; another rollout.n is refused, since generate.py
    samples data.n_samples responses per prompt."""
    generate = args_class("generate")
    keys = ["rollout.mode=sync", "rollout.n=1", "rollout.calculate_log_probs=False", "data.n_samples=4"]
    flags, said = translate(keys, generate, None, "generate.py")
    assert flags == ["--n-samples", "4"] and "rollout.mode" in said[0] and "rollout.calculate_log_probs" in said[0]
    with pytest.raises(UsageError, match=r"rollout.n=4: only rollout.n=1 is supported here"):
        translate(["rollout.n=4"], generate, None, "generate.py")


def test_an_empty_section_sets_nothing_and_megatrons_optimizer_is_refused_by_name():
    """verl's saved configs hold empty sections (rollout.engine_kwargs: {vllm: {}, sglang: {}}): read as setting
    nothing, where a key inside them is refused; Megatron's optimizer keys are refused naming the schedule here,
    and its clip_grad is --grad-clip."""
    flags, said = grpo(
        "actor_rollout_ref.rollout.engine_kwargs.vllm={}", "actor_rollout_ref.rollout.engine_kwargs.sglang={}"
    )
    assert flags == [] and "engine_kwargs.vllm (empty: it sets nothing)" in said[0]
    with pytest.raises(UsageError, match=r"engine_kwargs.vllm.max_model_len=8: not supported here: engine keyword"):
        grpo("actor_rollout_ref.rollout.engine_kwargs.vllm.max_model_len=8")
    with pytest.raises(
        UsageError,
        match=r"optim.lr_decay_style=cosine: not supported here: Megatron's optimizer .*"
        r"the schedule here is optim.warmup_style",
    ):
        grpo(ACTOR_KEY + "optim.lr_decay_style=cosine")
    assert grpo(ACTOR_KEY + "optim.clip_grad=0.5")[0] == ["--grad-clip", "0.5"]


def test_evaluation_yamls_keys_are_read_by_evaluate():
    """verl's main_eval commands pass data.prompt_key (main_eval reads no prompts): evaluate.py reads it as a
    no-op, saying so, and takes the rest of evaluation.yaml's data keys as its flags."""
    keys = ["data.path=out.parquet", "data.prompt_key=prompt", "data.response_key=responses",
            "data.data_source_key=data_source", "data.reward_model_key=reward_model"]  # fmt: skip
    flags, said = translate(keys, args_class("evaluate"), None, "evaluate.py")
    assert flags[:2] == ["--data-path", "out.parquet"] and "--prompt-key" not in flags
    assert "data.prompt_key (verl's main_eval scores the responses column; it reads no prompts)" in said[0]


def test_dapos_overlong_buffer_is_off_when_verl_says_so():
    """reward_model.overlong_buffer.enable=False turns dapo.py's overlong penalty off (a buffer of 0),
    and verl then reads neither the buffer's length nor its factor; enable=True keeps the buffer the
    command gives (or dapo.py's own); grpo.py, which has no such penalty, reads enable=False as a no-op. A verl
    command that leaves enable out gets verl's default, False, as its DAPO config has it (dapo.py's own flag wins)."""
    dapo = args_class("dapo")
    off = ["reward_model.overlong_buffer.enable=False", "reward_model.overlong_buffer.len=4096"]
    flags, said = translate(off, dapo, "grpo", "dapo.py")
    assert flags == ["--overlong-buffer-len", "0"] and "overlong_buffer.len (verl reads it only with" in said[0]
    on = ["reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=8"]
    assert translate(on, dapo, "grpo", "dapo.py")[0] == ["--overlong-buffer-len", "8"]
    assert translate(on[:1], dapo, "grpo", "dapo.py")[0] == []
    assert grpo("reward_model.overlong_buffer.enable=False")[0] == []
    # verl's default is off: a verl command that leaves enable out has no penalty, and its len is unread
    flags, said = translate(["reward_model.overlong_buffer.len=4096"], dapo, "grpo", "dapo.py", trainer="ppo")
    assert flags[flags.index("--overlong-buffer-len") + 1] == "0"
    assert (
        "reward_model.overlong_buffer.enable=False" in said[0] and "overlong_buffer.len (verl reads it only" in said[1]
    )
    flags, _ = translate(on, dapo, "grpo", "dapo.py", trainer="ppo")
    assert flags[flags.index("--overlong-buffer-len") + 1] == "8"
    flags, _ = translate(
        ["data.train_batch_size=8", "--overlong-buffer-len", "2"], dapo, "grpo", "dapo.py", trainer="ppo"
    )
    assert flags[-2:] == ["--overlong-buffer-len", "2"] and flags.count("--overlong-buffer-len") == 1


@pytest.mark.parametrize("recipe", [r for r in RECIPES if ESTIMATOR[r]])
def test_verls_loss_modes_and_estimators_route_to_their_recipes(recipe):
    """Every loss_mode and adv_estimator built here, given to a recipe that does not compute it, is refused
    naming the recipe to run with the same arguments; given to its own recipe it is read (the other
    divergence of dppo.py becomes --loss-mode). Another loss's knobs in a verl config are unread, as in verl."""
    from common.formats.verl import ESTIMATORS, LOSS_MODES

    args = args_class(recipe)
    loss = LOSS_FORKS.get(recipe, "vanilla")
    for key, table, own in [
        (ACTOR_KEY + "policy_loss.loss_mode", LOSS_MODES, loss),
        ("algorithm.adv_estimator", ESTIMATORS, ESTIMATOR[recipe]),
    ]:
        for value, where in table.items():
            argv = [f"{key}={value}"]
            if where == table.get(own):
                flags, _ = translate(argv, args, ESTIMATOR[recipe], f"{recipe}.py", loss_mode=loss)
                other = {"dppo_kl": ["--loss-mode", "dppo_kl"], "reinforce_plus_plus_baseline": ["--group-baseline"]}
                assert flags == (other.get(value, []) if value not in (loss, ESTIMATOR[recipe]) else []), value
            else:
                with pytest.raises(UsageError, match=re.escape(f"run recipes/{where.split()[0]} with the same")):
                    translate(argv, args, ESTIMATOR[recipe], f"{recipe}.py", loss_mode=loss)
    config = [
        f"{ACTOR_KEY}clip_ratio=0.2",
        f"{ACTOR_KEY}tau_pos=1.0",
        f"{ACTOR_KEY}policy_loss.dro_beta=0.05",
        f"{ACTOR_KEY}policy_loss.kl_cov_ratio=0.0002",
    ]
    translate(config, args, ESTIMATOR[recipe], f"{recipe}.py", loss_mode=loss)  # the others' knobs: unread


ACTOR_KEY = "actor_rollout_ref.actor."


def test_a_loss_mode_key_and_the_flat_flag_that_differ_are_refused_naming_both():
    """dppo.py's --loss-mode dppo_kl beside loss_mode=dppo_tv ran dppo_kl with no word, where any other key and its
    flag that differ are refused; equal ones are one setting, and the key alone still sets the flag."""
    args, key = args_class("dppo"), ACTOR_KEY + "policy_loss.loss_mode"
    for argv in ([f"{key}=dppo_tv", "--loss-mode", "dppo_kl"], [f"{key}=dppo_kl", "--loss-mode=dppo_tv"]):
        with pytest.raises(UsageError, match=r"both set --loss-mode, to different values .*keep one"):
            translate(argv, args, "grpo", "dppo.py", loss_mode="dppo_tv")
    assert translate([f"{key}=dppo_kl", "--loss-mode", "dppo_kl"], args, "grpo", "dppo.py", loss_mode="dppo_tv")[0] == [
        "--loss-mode",
        "dppo_kl",
    ]
    assert translate([f"{key}=dppo_kl"], args, "grpo", "dppo.py", loss_mode="dppo_tv")[0] == ["--loss-mode", "dppo_kl"]


def test_verls_tensor_parallel_size_is_said_unused_with_the_hf_engine_and_read_with_vllm():
    """The guides' tensor_model_parallel_size=2 with the HF engine (the default here) shards nothing: the run says
    so among the keys read with nothing to change, where it was accepted in silence; with vLLM it is the flag. Our
    own --tensor-parallel-size with the HF engine is refused (tests/test_config.py's only-with table)."""
    args, key = args_class("grpo"), "actor_rollout_ref.rollout.tensor_model_parallel_size=2"
    flags, said = translate([key], args, "grpo", "grpo.py")
    assert "--tensor-parallel-size" not in flags
    assert any("tensor_model_parallel_size (the HF engine generates unsharded" in line for line in said), said
    flags, _ = translate([key, "actor_rollout_ref.rollout.name=vllm"], args, "grpo", "grpo.py")
    assert flags[flags.index("--tensor-parallel-size") + 1] == "2"
    with pytest.raises(UsageError, match="--tensor-parallel-size.*--rollout-name vllm"):
        make_args(args, tensor_parallel_size=2)


def test_every_verl_key_on_the_command_line_is_read_as_one():
    """sft.py's use_remove_padding=True was refused on the command line ("unrecognized") and read in --verl-config:
    verl's two top-level keys have no dot. Every key of the table is now one on the command line as in a file."""
    from common.config import VERL_KEY
    from common.formats.verl import VERL_KEYS, is_override

    for key in (k for k in VERL_KEYS if re.fullmatch(r"[\w.-]+", k)):
        assert VERL_KEY.match(f"{key}=1") and is_override(f"{key}=1"), key
    assert not is_override("use_remove_padding_x=1") and not VERL_KEY.match("lr=1")
    flags, _ = translate(["use_remove_padding=True"], args_class("sft"), None, "sft.py", trainer="sft")
    assert flags[:2] == ["--use-remove-padding", "True"]  # and verl's SFT defaults after it


def test_a_config_saved_by_a_verl_run_may_carry_the_critics_grad_clip_and_the_reward_models_strategy():
    """critic.grad_clip and reward_model.strategy, which a verl run's saved config carries, were refused as "not a
    verl key": the critic's clip is read as the actor's (refused where the two differ, naming why), and the reward
    model's strategy is said to change nothing (the reward model loads whole: no sharding, no offload)."""
    args = args_class("ppo")
    flags, said = translate(
        ["critic.grad_clip=1.0", "reward_model.strategy=fsdp"], args, "gae", "ppo.py", trainer="ppo"
    )
    assert "reward_model.strategy" in " ".join(said) and "critic.grad_clip" in " ".join(said)
    with pytest.raises(UsageError, match="critic.grad_clip=5.0: only critic.grad_clip=1.0 .*actor's --grad-clip"):
        translate(["critic.grad_clip=5.0"], args, "gae", "ppo.py", trainer="ppo")
    both = ["critic.grad_clip=5.0", "actor_rollout_ref.actor.grad_clip=5.0"]
    flags, _ = translate(both, args, "gae", "ppo.py", trainer="ppo")
    assert flags[flags.index("--grad-clip") + 1] == "5.0"
