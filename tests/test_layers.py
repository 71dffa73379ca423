"""common/ is read bottom-up: common.LAYERS lists its modules from the bottom, and a module may
import (at top level or inside a function) only modules listed before it. Parsed, not imported."""

import ast
from pathlib import Path

from common import FEATURES, LAYERS, PUBLIC

COMMON = Path(__file__).resolve().parent.parent / "common"


def common_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of a common module anywhere in the file: `from common.x import
    ...`, `from common import x`, `import common.x`, at top level or nested in a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == "common" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
            elif node.module == "common":
                found += [(node.lineno, alias.name) for alias in node.names if alias.name != "LAYERS"]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:  # from . import x / from .x import y
            target = node.module.split(".")[0] if node.module else None
            names = [target] if target else [alias.name for alias in node.names]
            found += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "common" and len(parts) > 1:
                    found.append((node.lineno, parts[1]))
                if parts[0] == "recipes":
                    found.append((node.lineno, "recipes"))
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "recipes":
            found.append((node.lineno, "recipes"))
    return found


def layer_violations(layers: tuple[str, ...], folder: Path = COMMON) -> list[str]:
    """Every import in folder's modules of a module not listed before the importer, as
    'common/x.py:LINE imports common.y (listed after x: ...)'."""
    rank = {name: i for i, name in enumerate(layers)}
    problems = []
    for path in sorted(folder.glob("*.py")):
        me = path.stem
        if me == "__init__":
            continue
        for line, name in common_imports(path):
            where = f"common/{path.name}:{line}"
            if name == "recipes":
                problems.append(f"{where} imports a recipe (nothing in common/ may)")
            elif name not in rank:
                problems.append(f"{where} imports common.{name}, which is not in common.LAYERS")
            elif rank[name] >= rank[me]:
                problems.append(
                    f"{where} imports common.{name}, listed "
                    + ("as the module itself" if name == me else f"after {me} (layer {rank[name]} > {rank[me]})")
                )
    return problems


def test_every_module_of_common_has_exactly_one_layer():
    modules = sorted(p.stem for p in COMMON.glob("*.py") if p.stem != "__init__")
    assert len(LAYERS) == len(set(LAYERS)), f"listed twice: {[m for m in LAYERS if LAYERS.count(m) > 1]}"
    assert sorted(LAYERS) == modules, (
        f"common/ modules not in common.LAYERS: {sorted(set(modules) - set(LAYERS))}; "
        f"listed but missing: {sorted(set(LAYERS) - set(modules))}"
    )


def test_common_imports_only_downward():
    problems = layer_violations(LAYERS)
    assert not problems, "common/ imports against its layers (common/__init__.py):\n" + "\n".join(problems)


def test_the_check_names_file_line_and_module_of_an_upward_import(tmp_path):
    """The checker itself: an import inside a function that goes up (a circle in the making) is
    reported with its file, line and module; a downward one is not."""
    (tmp_path / "low.py").write_text("import os\n\n\ndef f():\n    from common.high import g\n    return g\n")
    (tmp_path / "high.py").write_text("from common.low import f\n")
    (tmp_path / "__init__.py").write_text("")
    assert layer_violations(("low", "high"), tmp_path) == [
        "common/low.py:5 imports common.high, listed after low (layer 1 > 0)"
    ]
    assert layer_violations(("high", "low"), tmp_path) == [
        "common/high.py:1 imports common.low, listed after high (layer 1 > 0)"
    ]
    (tmp_path / "low.py").write_text("import common.extra\nfrom recipes import grpo\n")
    assert layer_violations(("low", "high"), tmp_path) == [
        "common/low.py:1 imports common.extra, which is not in common.LAYERS",
        "common/low.py:2 imports a recipe (nothing in common/ may)",
    ]


def top_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of a common module that runs when the file is imported: at
    module level, or in an if / try there, not inside a function."""
    found, todo = [], list(ast.parse(path.read_text(), filename=str(path)).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If | ast.Try):
            todo += (
                node.body
                + node.orelse
                + getattr(node, "finalbody", [])
                + [n for h in getattr(node, "handlers", []) for n in h.body]
            )
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common."):
            found.append((node.lineno, node.module.split(".")[1]))
        elif isinstance(node, ast.ImportFrom) and node.module == "common":
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[1]) for a in node.names if a.name.startswith("common.")]
    return found


def test_no_core_module_imports_a_feature_when_it_is_imported():
    """common.FEATURES load only where a flag asks: a module outside them imports one inside the
    function that serves the flag, never at its top, so a default run does not load it."""
    assert set(FEATURES) <= set(LAYERS)
    problems = [f"common/{path.name}:{line} imports common.{name} at its top"
                for path in sorted(COMMON.glob("*.py")) if path.stem not in (*FEATURES, "__init__")
                for line, name in top_level_imports(path) if name in FEATURES]  # fmt: skip
    assert not problems, "a core module loads a feature in every run:\n" + "\n".join(problems)


def test_a_default_run_loads_no_ray_gymnasium_engines_agent_or_environments(default_run):
    """A plain grpo.py run (one step, the launch check on) never imports Ray, Gymnasium, vLLM or a
    feature module (common.FEATURES: tools, agents, environments, remote and vLLM engines, ROLL's
    conditioning, --check full's child runs, the verl translation); a verl key on the command line
    loads the translation (common.config.cli_args)."""
    loaded = set(default_run["run"])
    unwanted = {"ray", "gymnasium", "vllm", *(f"common.{m}" for m in FEATURES)}
    assert not loaded & unwanted, sorted(loaded & unwanted)
    assert "common.rollout" in loaded  # the run did run
    assert "common.verl" in default_run["verl"]


# What the recipes imported from common/ before it was layered: a fork made then still imports.
FORK_IMPORTS = {
    "common.config": "BUNDLED AgentArgs DataArgs EngineArgs KLRewardArgs ModelArgs OptimArgs RLArgs TrainerArgs "
    "UsageError check_flags is_due plan_batches usage_errors",
    "common.data": "DataError load_prompts read_parquet",
    "common.rewards": "Scored builtin_scorer exact_match extract_answer hit start_agent_pools start_reward_pool",
    "common.rollout": "Sampling evaluate generate_and_score hf_generate_greedy regroup sample start_engine",
    "common.tracking": "Tracker describe_run rollout_is_metrics setup_logging step_metrics",
}


def test_an_older_forks_imports_still_resolve():
    import importlib

    missing = [f"{m}.{n}" for m, names in FORK_IMPORTS.items() for n in names.split()
               if not hasattr(importlib.import_module(m), n)]  # fmt: skip
    assert not missing, f"names a fork of an earlier recipe imports are gone: {missing}"


def test_the_recipes_import_exactly_the_public_names():
    """common.PUBLIC names what the recipes import from common/, and nothing else: a recipe reaching
    for a name not listed, or a listed name no recipe uses (or that does not exist), fails here."""
    import importlib

    used: dict[str, set[str]] = {}
    for path in sorted((COMMON.parent / "recipes").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common."):
                used.setdefault(node.module.split(".")[1], set()).update(a.name for a in node.names)
    listed = {module: set(names.split()) for module, names in PUBLIC.items()}
    assert used == listed, {m: (sorted(used.get(m, set()) - listed.get(m, set())),
                                sorted(listed.get(m, set()) - used.get(m, set()))) for m in used.keys() | listed.keys()
                            if used.get(m) != listed.get(m)}  # fmt: skip
    missing = [
        f"{m}.{n}"
        for m, names in listed.items()
        for n in names
        if not hasattr(importlib.import_module(f"common.{m}"), n)
    ]
    assert not missing, missing
