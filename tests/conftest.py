import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "bundled"
TINY = BUNDLED / "tiny-qwen2"
TASK_TRAIN = BUNDLED / "addition" / "train.parquet"
TASK_TEST = BUNDLED / "addition" / "test.parquet"
# Every recipe whose Args build on RLArgs: the RL family, forks dropped into recipes/ included.
RL_RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.py") if "RLArgs):" in p.read_text())
SHIPPED_ACCURACY = 0.488  # bundled/tiny-qwen2-sft's greedy accuracy on TASK_TEST (test_sft.py measures it)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    """A recipe run in-process installs common.parallel.StopSignal's handlers for the life of the
    process; the next test, and pytest itself, get back the ones they had."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def load_recipe(name: str):
    """Import recipes/<name>.py as a module (recipes are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # so inspect can find its source
    spec.loader.exec_module(module)
    return module


def load_recipe_refusing_models(name: str, monkeypatch):
    """The recipe module with load_policy replaced by a failure: a test of an error that must come
    before any model loads fails if the recipe gets that far."""
    module = load_recipe(name)

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was reported")

    import common.model

    monkeypatch.setattr(common.model, "load_policy", refuse)
    if hasattr(module, "load_policy"):
        monkeypatch.setattr(module, "load_policy", refuse)
    return module


def run_recipe(
    name: str,
    *flags,
    nproc: int = 1,
    env: dict | None = None,
    check: bool = True,
    timeout: int = 1200,
):
    """Run a recipe the way users do: `python recipes/x.py`, or torchrun with nproc processes.
    The time limit is generous (a loaded 2-core machine runs these several times slower than a
    quiet one); a run that hits it fails with the last output it printed, so it says how far it got."""
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / "recipes" / f"{name}.py"), *map(str, flags)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(29500 + os.getpid() % 1000),
            str(ROOT / "recipes" / f"{name}.py"),
            *map(str, flags),
        ]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", **(env or {})}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        raise AssertionError(
            f"{' '.join(cmd)} still running after {timeout}s; it got this far:\n{out[-3000:]}\n{err[-3000:]}"
        ) from None  # noqa: E501
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


@pytest.fixture(scope="session")
def tokenizer():
    from common.model import load_tokenizer

    return load_tokenizer(str(TINY))
