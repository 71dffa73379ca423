"""The configuration guides our users know (verl's and ROLL's), read themselves: every key they give is in
tests/data/verl_keys.yaml (the list the rest of the suite reads, where tests/test_verl.py checks that
common.formats.verl classifies each) or, for ROLL's, named in docs/configuration.md's "Coming from ROLL". So a key a
guide gives cannot be missed again. The guides live beside the checkout (../shared/reference) or where
$RECIPES_GUIDES points; a clone without them skips these tests, saying where it looked."""

import os
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from common.errors import UsageError
from common.formats.sources import nested
from common.formats.verl import compose_hydra_config, lookup

ROOT = Path(__file__).resolve().parent.parent
GUIDES = Path(os.environ.get("RECIPES_GUIDES") or ROOT.parent / "shared" / "reference")
pytestmark = pytest.mark.skipif(
    not GUIDES.is_dir(), reason=f"the configuration guides are not at {GUIDES} (set RECIPES_GUIDES to their folder)"
)
LISTED = {
    key: value
    for keys in yaml.safe_load((ROOT / "tests" / "data" / "verl_keys.yaml").read_text()).values()
    for key, value in keys.items()
}
# verl's config sections, where a guide's block or sentence may start below the root (`custom_cls:` is data's)
SECTIONS = ("", "data.", "actor_rollout_ref.", "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "trainer.")
VERL_ROOTS = ("data", "actor_rollout_ref", "critic", "reward_model", "custom_reward_function", "algorithm", "trainer",
              "ray_init", "model", "optim", "rollout")  # fmt: skip


def guide_text(path: Path) -> str:
    """A guide's text. One was saved again through a wrong encoding and lost some Chinese characters (U+FFFD
    stands for them); its keys and listings are ASCII and read whole."""
    return path.read_text(encoding="utf-8", errors="replace")


def yaml_blocks(text: str) -> list:
    """The parsed YAML listings of a guide (Markdown fences and reStructuredText `.. code:: yaml`); a line that
    only says `...`, or `key: {...}`, is the guide leaving keys out, and is dropped."""
    found = re.findall(r"```yaml\n(.*?)```", text, re.S)
    found += [textwrap.dedent(b) for b in re.findall(r"\.\. code:: yaml\n\n((?:(?: {3}.*)?\n)+)", text)]
    blocks = []
    for block in found:
        lines = [
            line.replace("\t", "  ")
            for line in block.splitlines()
            if line.strip() not in ("...", "…") and not re.match(r"\s*[\w-]+: \{\.\.\.\}", line)
        ]
        blocks.append(yaml.safe_load("\n".join(lines)))
    return blocks


def leaves(tree, prefix: str = "") -> dict:
    """{dotted key: value} of a mapping's leaves (an empty mapping is a leaf: a section the guide leaves empty)."""
    out = {}
    for key, value in tree.items():
        out.update(leaves(value, f"{prefix}{key}.") if isinstance(value, dict) and value else {f"{prefix}{key}": value})
    return out


def guides(kind: str) -> list[Path]:
    """verl's guides (they name actor_rollout_ref) or ROLL's (they name num_return_sequences_in_group)."""
    paths = sorted(GUIDES.glob("*.txt"))
    verl = [p for p in paths if "actor_rollout_ref" in guide_text(p)]
    return (
        verl
        if kind == "verl"
        else [p for p in paths if p not in verl and "num_return_sequences_in_group" in guide_text(p)]
    )


def listed_as(key: str) -> str | None:
    """The key as the list spells it: itself, or under the section the guide's block started below; or a
    section the list has keys under (a guide's sentence naming `reward_model.model`)."""
    key = key.rstrip(".")
    for section in SECTIONS:
        if section + key in LISTED:
            return section + key
    for section in SECTIONS:
        if any(k.startswith(f"{section}{key}.") for k in LISTED):
            return section + key
    return None


def test_the_guides_are_there_and_read():
    """Five guides, four of verl and one of ROLL; the damaged one's listings parse (its keys are checked below)."""
    assert len(guides("verl")) == 4 and len(guides("roll")) == 1
    damaged = [path for path in guides("verl") if "\ufffd" in guide_text(path)]
    assert damaged and all(yaml_blocks(guide_text(path)) for path in damaged)


def test_every_key_the_verl_guides_give_is_listed_and_classified():
    """Every key of every YAML listing of verl's guides, and every dotted key their text names, is in
    tests/data/verl_keys.yaml and has an entry in common.formats.verl's table: a flag (built), or a no-op, a fixed
    value or a refusal, each with its reason."""
    checked, missing = 0, []
    for path in guides("verl"):
        text = guide_text(path)  # the listings' keys, less a tool file's and Hydra's list (the tests below)
        keys = [
            key
            for tree in yaml_blocks(text)
            if isinstance(tree, dict)
            for key in leaves(tree)
            if key.split(".")[0] not in ("tools", "defaults")
        ]
        keys += re.findall(r"`{1,2}((?:" + "|".join(VERL_ROOTS) + r")(?:\.[\w-]+)+)", text)  # sentences' keys
        for key in keys:
            name = listed_as(key)
            if name is None:
                missing.append(f"{path.name}: {key}")
            elif name in LISTED:
                entry = lookup(name)
                assert entry is not None, f"{path.name}: {name} has no entry in common.formats.verl.VERL_KEYS"
                assert hasattr(entry, "flag") or len(entry.why.split()) >= 3, f"{name}: refused or fixed without why"
            checked += 1
    assert not missing, "not in tests/data/verl_keys.yaml:\n" + "\n".join(missing)
    assert checked > 400


def roll_tables(section: str) -> tuple[dict[str, str], dict[str, str]]:
    """({left cell: right cell} of the flags table, the same of the "Not built" table) of the ROLL section."""

    def rows(text: str) -> dict[str, str]:
        cells = re.findall(r"^\| (.+?) \| (.+?) \|$", text, re.M)
        return {left: right for left, right in cells if left != "ROLL key" and not left.startswith("---")}

    flags, refused = section.split("Not built, each with its reason")
    return rows(flags), rows(refused)


def test_every_key_rolls_guide_gives_is_built_or_refused_with_its_reason():
    """Every key of ROLL's guide (its listings' keys and the keys its lists explain) is named in docs/configuration.md's
    "Coming from ROLL": in the flags table, whose row names the flag or recipe that does it (built), or in the "Not
    built" table, whose row gives the reason (refused); none is only mentioned. A key may be in both where its values
    split (adv_estimator's gae is ppo.py, its gigpo is not built)."""
    docs = (ROOT / "docs" / "configuration.md").read_text()
    section = docs[docs.index("## Coming from ROLL") :].split("\n## ")[0]
    built, refused = roll_tables(section)
    done = r"`--[a-z]|\.py`|configs/|^always|^the launcher's"  # a flag, a recipe or file, or what every run does
    assert all(re.search(done, how) for how in built.values()), [
        k for k, how in built.items() if not re.search(done, how)
    ]
    assert refused and all(len(why.split()) >= 5 for why in refused.values()), "a refused row gives its reason"

    def names(cells) -> set:
        return {
            word
            for cell in cells
            for quoted in re.findall(r"`([^`]+)`", cell)
            for word in re.split(r"[\s.:/,()=|]+", quoted)
        }

    containers = names([section[: section.index("| ROLL key |")]])  # the intro's workers and argument groups
    built_names, refused_names = names(built), names(refused)
    (path,) = guides("roll")
    text = guide_text(path)
    keys = [key for tree in yaml_blocks(text) if isinstance(tree, dict) for key in leaves(tree)]
    keys += re.findall(r"^\s*[-*]\s+\*{0,2}`([\w.]+)`", text, re.M)
    assert len(keys) > 100
    neither = sorted(
        {
            f"{part} (of {key})"
            for key in keys
            for part in key.split(".")
            if part not in built_names | refused_names | containers
            and not (part.startswith("moe_") and "moe_*" in refused_names)
        }
    )
    assert not neither, f"ROLL keys neither built nor refused with a reason: {neither}"


def test_the_guides_tool_file_example_is_refused_naming_what_to_write(tmp_path):
    """A verl guide's tool file example names its tool at tool_schema.name; verl's tools (and this library's
    --tool-config) read tool_schema.function.name, and the refusal says so."""
    from common.agents.tools import read_tool_config

    examples = [t for p in guides("verl") for t in yaml_blocks(guide_text(p)) if isinstance(t, dict) and "tools" in t]
    assert examples
    for i, example in enumerate(examples):
        path = tmp_path / f"tools{i}.yaml"
        path.write_text(yaml.safe_dump(example))
        with pytest.raises(UsageError, match=r"tools\[0\]: needs tool_schema: \{type: function, function: \{name"):
            read_tool_config(str(path))


def test_the_guides_hydra_defaults_list_is_composed_or_refused_by_name(tmp_path):
    """verl's ppo_trainer.yaml's defaults list, as a guide gives it: its config groups (actor@...) are
    refused naming the entry, as a user's config with them would be."""
    examples = [
        t for p in guides("verl") for t in yaml_blocks(guide_text(p)) if isinstance(t, dict) and "defaults" in t
    ]
    assert examples
    for example in examples:
        (tmp_path / "mine.yaml").write_text(yaml.safe_dump(example))
        group = next(e for e in example["defaults"] if isinstance(e, dict))
        with pytest.raises(UsageError, match="config groups are not composed here") as refusal:
            compose_hydra_config(str(tmp_path), "mine", "ppo")
        assert str(group)[:20] in str(refusal.value)


def test_every_verl_listing_runs_under_verl_config_or_is_refused_naming_its_key(tmp_path):
    """Each YAML listing of verl's guides, as a --verl-config file (a listing that starts below verl's root
    nested where its keys live), translates for the script whose config it is (generation.yaml's for
    generate.py, evaluation.yaml's for evaluate.py, sft_trainer.yaml's for sft.py, else ppo.py) or is refused
    naming one of its keys."""
    from test_verl import args_class

    from common.formats.verl import verl_args

    scripts = {name: args_class(name) for name in ("ppo", "sft", "generate", "evaluate")}
    ran = refused = 0
    for path in guides("verl"):
        for i, tree in enumerate(yaml_blocks(guide_text(path))):
            if not isinstance(tree, dict) or {"tools", "defaults"} & set(tree):
                continue  # a tool file and Hydra's list: the tests above
            keys = leaves(tree)
            where = listed_as(next(iter(keys)))
            section = where[: len(where) - len(next(iter(keys)).rstrip("."))] if where else ""
            flat = {section + key: value for key, value in keys.items()}
            for key, value in flat.items():  # `${a.b}` naming a key of another listing: the guide's value there
                ref = re.fullmatch(r"\$\{([^}]*)\}", str(value))
                if ref and ref.group(1) not in flat:
                    flat[key] = LISTED[ref.group(1)]
            tree = nested(flat)
            script = (
                "generate"
                if "data.n_samples" in keys or "rollout.n" in keys
                else "evaluate"
                if "data.response_key" in keys and not section
                else "sft"
                if next(iter(keys)).startswith(("optim.", "model.")) and not section
                else "ppo"
            )
            file = tmp_path / f"{path.stem}_{i}.yaml"
            file.write_text(yaml.safe_dump(tree))
            estimator, trainer = ("gae", "ppo") if script == "ppo" else (None, "sft" if script == "sft" else None)
            try:
                verl_args(scripts[script], estimator, argv=["--verl-config", str(file)], trainer=trainer)
                ran += 1
            except UsageError as e:
                assert any(key.split(".")[-1] in str(e) for key in keys), f"{path.name} listing {i}: {e}"
                refused += 1
    assert ran > 20 and refused > 3


GENERATION_YAML = """\
trainer: {nnodes: 1, n_gpus_per_node: 8, device: cuda}
data: {path: DATA, prompt_key: prompt, n_samples: 5, output_path: OUT, batch_size: 128}
model: {path: MODEL, external_lib: null}
rollout:
  name: vllm
  mode: sync
  temperature: 1.0
  top_k: 50
  top_p: 0.7
  prompt_length: 1536
  response_length: 512
  dtype: bfloat16
  gpu_memory_utilization: 0.5
  ignore_eos: False
  enforce_eager: True
  free_cache_engine: True
  load_format: dummy_dtensor
  tensor_model_parallel_size: 1
  max_num_batched_tokens: 8192
  max_num_seqs: 1024
  log_prob_micro_batch_size_per_gpu: 8
  do_sample: True
  disable_log_stats: True
  enable_chunked_prefill: True
  n: 1
  calculate_log_probs: False
actor:
  strategy: fsdp
  ulysses_sequence_parallel_size: 1
  entropy_from_logits_with_chunking: False
  entropy_checkpointing: False
  fsdp_config: {fsdp_size: -1, forward_prefetch: False}
ray_init: {num_cpus: null, timeline_json_file: null}
"""


def test_verls_generation_yaml_as_written_is_read_by_generate_py(tmp_path, capsys):
    """verl's generation.yaml, whole as the guide lists it (its six actor.* keys too, which generate.py refused as
    "not a verl key"), is a --verl-config generate.py reads: the sampling and engine keys become its flags, the
    actor's and the launcher's keys are said to change nothing."""
    from test_verl import args_class

    from common.formats.verl import verl_args

    text = GENERATION_YAML.replace("DATA", str(ROOT / "bundled" / "addition" / "test.parquet"))
    (tmp_path / "generation.yaml").write_text(text.replace("OUT", str(tmp_path / "out.parquet")).replace("MODEL", "m"))
    argv = verl_args(args_class("generate"), None, argv=["--verl-config", str(tmp_path / "generation.yaml")])
    said = capsys.readouterr().err
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["--top-k"] == "50" and flags["--top-p"] == "0.7" and flags["--n-samples"] == "5"
    assert flags["--rollout-name"] == "vllm" and flags["--max-response-length"] == "512"
    assert "actor.strategy" in said and "actor.fsdp_config.forward_prefetch" in said
