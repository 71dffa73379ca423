"""common/ is read bottom-up: common.LAYERS lists the core's modules from the bottom and common.FEATURES the
features' above them, and a module imports (at top level or inside a function) only modules listed before it; the
core reaches a feature only inside a function (the one its flag routes to). Parsed, not imported."""

import ast
from pathlib import Path

from common import FEATURES, LAYERS

COMMON = Path(__file__).resolve().parent.parent / "common"


def module_name(path: Path, folder: Path = COMMON) -> str:
    """common/serving/remote.py -> serving.remote; common/serving/__init__.py -> serving."""
    parts = path.relative_to(folder).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def common_imports(path: Path, folder: Path = COMMON) -> list[tuple[int, str, bool]]:
    """(line, module, inside a function) for every import of a common module anywhere in the file: `from
    common.x.y import ...`, `from common import x`, `import common.x`, relative imports, at top level or nested
    in a function."""
    found = []
    package = ".".join(path.relative_to(folder).parts[:-1])  # what a relative import is relative to

    def visit(node, nested: bool):
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                parts = child.module.split(".")
                if parts[0] == "common" and len(parts) > 1:
                    found.append((child.lineno, ".".join(parts[1:]), inner))
                elif child.module == "common":
                    found.extend((child.lineno, a.name, inner) for a in child.names if a.name != "LAYERS")
                elif parts[0] == "recipes":
                    found.append((child.lineno, "recipes", inner))
            elif isinstance(child, ast.ImportFrom) and child.level > 0:  # from . import x / from .x import y
                base = package.split(".")[: max(0, len(package.split(".")) - (child.level - 1))] if package else []
                names = [child.module] if child.module else [a.name for a in child.names]
                found.extend((child.lineno, ".".join([*base, n]).strip("."), inner) for n in names)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    parts = alias.name.split(".")
                    if parts[0] == "common" and len(parts) > 1:
                        found.append((child.lineno, ".".join(parts[1:]), inner))
                    if parts[0] == "recipes":
                        found.append((child.lineno, "recipes", inner))
            visit(child, inner)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def layer_violations(layers: tuple[str, ...], features: tuple[str, ...] = (), folder: Path = COMMON) -> list[str]:
    """Every import in folder's modules of a module not listed before the importer (the core, then the
    features), but for the core's imports of a feature inside a function, as
    'common/x.py:LINE imports common.y (listed after x: ...)'."""
    order = (*layers, *features)
    rank = {name: i for i, name in enumerate(order)}
    problems = []
    for path in sorted(folder.rglob("*.py")):
        me = module_name(path, folder)
        if not me:
            continue
        for line, name, nested in common_imports(path, folder):
            where = f"common/{path.relative_to(folder)}:{line}"
            if name == "recipes":
                problems.append(f"{where} imports a recipe (nothing in common/ may)")
            elif name not in rank:
                problems.append(f"{where} imports common.{name}, which is not in common.LAYERS or common.FEATURES")
            elif me in layers and name in features:
                if not nested:
                    problems.append(
                        f"{where} imports the feature common.{name} at its top (a core module reaches a "
                        f"feature only inside the function its flag routes to)"
                    )
            elif rank[name] >= rank.get(me, -1):
                problems.append(
                    f"{where} imports common.{name}, listed "
                    + ("as the module itself" if name == me else f"after {me} (layer {rank[name]} > {rank[me]})")
                )
    return problems


def test_every_module_of_common_has_exactly_one_place():
    modules = sorted(module_name(p) for p in COMMON.rglob("*.py") if module_name(p))
    listed = [*LAYERS, *FEATURES]
    assert len(listed) == len(set(listed)), f"listed twice: {[m for m in listed if listed.count(m) > 1]}"
    assert sorted(listed) == modules, (
        f"common/ modules in neither common.LAYERS nor common.FEATURES: {sorted(set(modules) - set(listed))}; "
        f"listed but missing: {sorted(set(listed) - set(modules))}"
    )


def test_the_features_live_in_subpackages_and_the_core_flat():
    """The folders say what the code is: every feature module is in a subpackage (common/<what it adds>/), every
    core module flat in common/ but for a feature package's __init__ (its flag groups, which every run parses)."""
    assert all("." in f or (COMMON / f / "__init__.py").is_file() for f in FEATURES), FEATURES
    packages = {f.split(".")[0] for f in FEATURES}
    assert all("." not in m and ((COMMON / f"{m}.py").is_file() or m in packages) for m in LAYERS), LAYERS


def circles(folder: Path = COMMON) -> list[list[str]]:
    """The import circles among folder's modules, counting imports inside functions (a core module's call into a
    feature included): each a sorted list of the modules on it (Tarjan's strongly connected components)."""
    edges = {module_name(p, folder): {name for _, name, _ in common_imports(p, folder)} for p in folder.rglob("*.py")}
    index, low, stack, found = {}, {}, [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(part) > 1 or node in edges.get(node, ()):
                found.append(sorted(part))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_common_has_no_import_circle(tmp_path):
    """DESIGN.md: common/ never imports in a circle, not even inside a function. A feature the core reaches imports
    only what sits below the module that reaches it (what that module's caller must hand it, it is handed)."""
    assert circles() == [], "import circles in common/ (counting imports inside functions)"
    (tmp_path / "low.py").write_text("def f():\n    from common.high import g\n    return g\n")
    (tmp_path / "high.py").write_text("from common.low import f\n")
    (tmp_path / "other.py").write_text("from common.low import f\n")
    assert circles(tmp_path) == [["high", "low"]]


def test_common_imports_only_downward():
    problems = layer_violations(LAYERS, FEATURES)
    assert not problems, "common/ imports against its layers (common/__init__.py):\n" + "\n".join(problems)


def test_the_check_names_file_line_and_module_of_an_upward_import(tmp_path):
    """The checker itself: an import inside a function that goes up (a circle in the making) is reported with its
    file, line and module; a downward one is not; the core may reach a feature inside a function, never at its top."""
    (tmp_path / "low.py").write_text("import os\n\n\ndef f():\n    from common.high import g\n    return g\n")
    (tmp_path / "high.py").write_text("from common.low import f\n")
    (tmp_path / "__init__.py").write_text("")
    assert layer_violations(("low", "high"), (), tmp_path) == [
        "common/low.py:5 imports common.high, listed after low (layer 1 > 0)"
    ]
    assert layer_violations(("high", "low"), (), tmp_path) == [
        "common/high.py:1 imports common.low, listed after high (layer 1 > 0)"
    ]
    assert layer_violations(("low",), ("high",), tmp_path) == []  # low reaches the feature inside a function
    (tmp_path / "low.py").write_text("import common.extra\nfrom recipes import grpo\nfrom common.high import g\n")
    assert layer_violations(("low",), ("high",), tmp_path) == [
        "common/low.py:1 imports common.extra, which is not in common.LAYERS or common.FEATURES",
        "common/low.py:2 imports a recipe (nothing in common/ may)",
        "common/low.py:3 imports the feature common.high at its top (a core module reaches a feature only inside "
        "the function its flag routes to)",
    ]
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text("from common.high import f\n")  # a feature reaching a later one
    assert layer_violations(("low",), ("pkg", "pkg.mod", "high"), tmp_path)[-1] == (
        "common/pkg/mod.py:1 imports common.high, listed after pkg.mod (layer 3 > 2)"
    )


def test_a_default_run_loads_no_ray_gymnasium_engines_agent_or_environments(default_run):
    """A plain grpo.py run (one step, the launch check on) never imports Ray, Gymnasium, vLLM or a
    feature module (common.FEATURES: tools, agents, environments, remote and vLLM engines, ROLL's
    conditioning, --check full's child runs, the verl translation); a verl key on the command line
    loads the translation (common.config.cli_args)."""
    loaded = set(default_run["run"])
    unwanted = {"ray", "gymnasium", "vllm", *(f"common.{m}" for m in FEATURES)}
    assert not loaded & unwanted, sorted(loaded & unwanted)
    assert "common.rollout" in loaded  # the run did run
    assert "common.formats.verl" in default_run["verl"]


# The names the recipes import, by module: the surface a fork builds on. The recipes are held to it, so that every
# name a recipe uses is named here and every name here is used (test_the_recipes_import_exactly_the_public_names).
PUBLIC = {
    "agents.envs": "env_rows env_tags",
    "agents.tools": "check_rows read_tool_config",
    "check": "launch_check prove_resume trainer_check",
    "checkpoint": "find_resume resume save_checkpoint",
    "config": "AgentArgs BUNDLED EngineArgs EnvPlayArgs ModelArgs OptimArgs RLArgs TrainerArgs WaitArgs check_flags cli "
    "engine_sync group is_due plan_batches plan_rl_batches",
    "critic": "load_critic response_values",
    "data": "DataError RLDataArgs StepPrompts get_field has_column pad read_rows split_rows step_rows take_rows",
    "engines": "RolloutArgs Sampling hf_generate_greedy",
    "errors": "UsageError usage_errors",
    "flags": "flag flag_values",
    "formats.prompt_cache": "load_prompts",
    "formats.sources": "KINDS NAME open_source",
    "model": "load_policy load_tokenizer load_trained_model response_logits response_logprobs sequence_logits",
    "kl_reward": "KLRewardArgs kl_controller_step",
    "ops": "KLEstimator agg_loss kl_from_logits kl_penalty logprobs_and_entropy logprobs_from_logits "
    "masked_mean masked_mean_all_ranks masked_var masked_whiten masked_whiten_all_ranks",
    "optim": "trainable",
    "parallel": "StopSignal all_reduce_sum barrier clip_grad_norm gather_objects grad_sync init_distributed "
    "seed_everything setup_logging shard_evenly",
    "rewards": "Scored reward_pool start_agent_pools start_env_pool start_reward_pool",
    "rollout": "Rollout engine_logprobs generate_and_score load_reward_model load_rl_data load_rl_models local_engine "
    "regroup sample start_engine with_agents",
    "runlock": "claim_output claim_run_dir",
    "scoring": "builtin_scorer exact_match extract_answer hit",
    "sft_data": "SFTDataArgs load_sft",
    "shaping": "condition_advantages condition_rewards roll_terms rollout_correction",
    "teacher": "TeacherArgs check_teacher check_teacher_engine jsd_from_logits start_teacher",
    "tracking": "Tracker describe_run step_metrics",
}


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

    missing = [
        f"{m}.{n}"
        for m, names in FORK_IMPORTS.items()
        for n in names.split()
        if not hasattr(importlib.import_module(m), n)
    ]
    assert not missing, f"names a fork of an earlier recipe imports are gone: {missing}"


def test_the_recipes_import_exactly_the_public_names():
    """common.PUBLIC names what the recipes import from common/, and nothing else: a recipe reaching
    for a name not listed, or a listed name no recipe uses (or that does not exist), fails here."""
    import importlib

    used: dict[str, set[str]] = {}
    for path in sorted((COMMON.parent / "recipes").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common."):
                used.setdefault(node.module.split(".", 1)[1], set()).update(a.name for a in node.names)
    listed = {module: set(names.split()) for module, names in PUBLIC.items()}
    assert used == listed, {
        m: (sorted(used.get(m, set()) - listed.get(m, set())), sorted(listed.get(m, set()) - used.get(m, set())))
        for m in used.keys() | listed.keys()
        if used.get(m) != listed.get(m)
    }
    missing = [
        f"{m}.{n}"
        for m, names in listed.items()
        for n in names
        if not hasattr(importlib.import_module(f"common.{m}"), n)
    ]
    assert not missing, missing


def assembly(path: Path) -> list[str]:
    """Where a file builds another function's arguments from a flag group: a method of a dataclass named *_kwargs,
    or a call that splats one (`f(**args.engine_kwargs())`), as 'file:LINE what'."""
    tree, found = ast.parse(path.read_text()), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
            found += [
                f"{path.name}:{f.lineno} {node.name}.{f.name}"
                for f in node.body
                if isinstance(f, ast.FunctionDef) and f.name.endswith("_kwargs")
            ]
        if isinstance(node, ast.Call):
            for keyword in node.keywords:
                splat = keyword.value
                if keyword.arg is None and isinstance(splat, ast.Call) and ast.unparse(splat.func).endswith("_kwargs"):
                    found.append(f"{path.name}:{node.lineno} **{ast.unparse(splat)}")
    return found


def test_flag_groups_hold_knobs_and_rules_not_assembly(tmp_path):
    """A call in a recipe shows what it receives (flag groups passed whole, or values): no flag group has a method
    building another function's keyword arguments, and nothing splats one."""
    files = [*sorted(COMMON.rglob("*.py")), *sorted((COMMON.parent / "recipes").glob("*.py"))]
    assert len(files) > 60 and not [problem for path in files for problem in assembly(path)]
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from dataclasses import dataclass\n@dataclass\nclass EngineArgs:\n    n: int = 1\n"
        "    def engine_kwargs(self):\n        return dict(n=self.n)\n"
        "def main(args):\n    start(**args.engine.engine_kwargs())\n"
    )
    assert assembly(planted) == ["planted.py:5 EngineArgs.engine_kwargs", "planted.py:8 **args.engine.engine_kwargs()"]
