import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each xdist worker (and every process it starts) computes on one thread: two workers whose
    # torch each spin up a thread per core on a 2-core machine ran several times slower.
    os.environ["OMP_NUM_THREADS"] = "1"
import torch  # noqa: E402  (after OMP_NUM_THREADS)

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "bundled"
TINY = BUNDLED / "tiny-qwen2"
TASK_TRAIN = BUNDLED / "addition" / "train.parquet"
TASK_TEST = BUNDLED / "addition" / "test.parquet"
# Every recipe whose Args build on RLArgs: the RL family, forks dropped into recipes/ included.
RL_RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.py") if "RLArgs):" in p.read_text())


def _plumbing(recipe: str) -> list[str]:
    """The source of a recipe's steps that move the batch (update, forward_logprobs, old_ref_logprobs and
    main, but main's step 5: the advantage's own lines)."""
    import ast

    source = (ROOT / "recipes" / f"{recipe}.py").read_text()
    funcs = {
        n.name: ast.get_source_segment(source, n) for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)
    }
    main = [
        line for line in funcs.get("main", "").splitlines() if "# 5." not in line and "compute_advantages(" not in line
    ]
    return [funcs.get(name) for name in ("update", "forward_logprobs", "old_ref_logprobs")] + main


# The RL recipes whose plumbing is their own: a fork whose steps that move the batch are grpo.py's word for word
# (gspo.py, cispo.py, ...: a new loss or advantage) runs the environments' and the agent loop's end-to-end tests
# through grpo.py, where that same code is tested; its own smoke, resume, FSDP2, bad-input and learning tests stay.
OWN_PLUMBING = [r for r in RL_RECIPES if r == "grpo" or _plumbing(r) != _plumbing("grpo")]
SHIPPED_ACCURACY = 0.488  # bundled/tiny-qwen2-sft's greedy accuracy on TASK_TEST (test_sft.py measures it)


# Module- and session-wide fixtures that start processes of their own: a worker that runs one of their tests makes
# them again, so their tests share a worker (the preemption runs' fixture alone takes ~45 s).
SHARED_FIXTURES = ("stopped", "default_run", "help_pages", "gpu_config_launches", "single_process_run")


@pytest.hookimpl(tryfirst=True)  # before -m reads the marks
def pytest_collection_modifyitems(config, items):
    """Every test that launches torchrun (torchrun_runs), starts Ray (ray_cluster) or trains the real model
    (real_model, which marks it real as well) is end-to-end (the e2e mark: pytest -m "not e2e" is the inner
    loop). Under xdist (-n 2, --dist loadgroup) those of torchrun_runs share one worker, whose session makes
    the launch once, and the Ray tests another, as they count Ray's processes on the machine, and those of
    each of SHARED_FIXTURES another; a GPU test skips without CUDA."""
    for item in items:
        if {"torchrun_runs", "ray_cluster", "real_model"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
        if "real_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real)
        if "torchrun_runs" in getattr(item, "fixturenames", ()):  # one worker makes the one torchrun launch
            item.add_marker(pytest.mark.xdist_group("torchrun"))
        elif item.module.__name__ in ("test_remote", "test_remote_recipes") or "ray_cluster" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("ray"))  # one Ray at a time: its tests count Ray's processes
        elif shared := [f for f in SHARED_FIXTURES if f in getattr(item, "fixturenames", ())]:
            item.add_marker(pytest.mark.xdist_group(shared[0]))  # the fixture's work once, not once per worker
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    """A recipe run in-process installs common.parallel.StopSignal's handlers for the life of the
    process; the next test, and pytest itself, get back the ones they had."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.fixture(autouse=True)
def _disarm_the_watchdog():
    """A recipe's main called directly (not through its `__main__` block, whose usage_errors stops
    it) leaves common.watchdog armed: this process would end if a later test made no progress for
    --wait-timeout."""
    yield
    from common import watchdog

    watchdog.disarm()


@pytest.fixture(autouse=True)
def _forget_verl_origins():
    """A verl command run in-process leaves common.errors.ORIGINS (which flags its keys set) for the life of the
    process, as one run's; TrainerArgs.total_steps reads it, so the next test starts as a run of its own."""
    yield
    from common.errors import ORIGINS

    ORIGINS.clear()


def load_recipe(name: str):
    """Import recipes/<name>.py as a module (recipes are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # so inspect can find its source
    spec.loader.exec_module(module)
    return module


def make_args(args_class, **flags):
    """args_class(**flags) with each flag given to the group that holds it (at any depth: RLArgs.rollout.vllm), by
    its name on the command line (ModelArgs.path as model): make_args(Args, lr=1e-3, reward_norm="batch")."""
    from dataclasses import MISSING, fields, is_dataclass, replace

    from common.flags import name_of

    def take(cls, current):
        given = {}
        for f in fields(cls):
            if current is not None:
                value = getattr(current, f.name)
            else:
                value = f.default_factory() if f.default_factory is not MISSING else f.default
            if is_dataclass(value) and not isinstance(value, type):  # a group, as the recipe sets it
                inner = take(type(value), value)
                if inner:
                    given[f.name] = replace(value, **inner)
            elif name_of(cls, f) in flags:
                given[f.name] = flags.pop(name_of(cls, f))
        return given

    given = take(args_class, None)
    if flags:
        raise TypeError(f"{args_class.__module__}.Args has no flags {sorted(flags)}")
    return args_class(**given)


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
    fresh: bool = False,
    cwd=ROOT,
):
    """Run a recipe the way users do, `python recipes/x.py FLAGS` (or torchrun with nproc
    processes), and return its exit status, stdout and stderr as a CompletedProcess.

    One process runs inside this pytest process unless fresh=True: the file is executed as
    `__main__` (runpy) with the argv, environment, working folder and output streams a real run
    has, and an exit or an uncaught exception becomes its status as the interpreter would make it.
    That is the recipe's own code path without a new interpreter importing torch and transformers
    again (about 7 s a run on 2 cores). fresh=True and nproc > 1 start real processes: for a
    recipe's own start-up, signals, and several ranks.

    The time limit is generous (a loaded 2-core machine runs these several times slower than a
    quiet one); a run that hits it fails with the last output it printed, so it says how far it got.
    cwd: the folder it runs in, whose recipes/ holds the recipe (a fork copied elsewhere)."""
    script = Path(cwd) / "recipes" / f"{name}.py"
    flags = last_wins(flags)
    if nproc == 1 and not fresh:
        return _run_in_process(script, [str(f) for f in flags], cwd, env or {}, check, timeout)
    if nproc == 1:
        cmd = [sys.executable, str(script), *map(str, flags)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(free_port()),
            str(script),
            *map(str, flags),
        ]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", **(env or {})}
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        raise AssertionError(
            f"{' '.join(cmd)} still running after {timeout}s; it got this far:\n{out[-3000:]}\n{err[-3000:]}"
        ) from None  # noqa: E501
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def last_wins(flags) -> list[str]:
    """The tests compose a command line as base flags and then overrides; a recipe refuses a flag given twice
    (common.config.refuse_repeats), so each --flag (or --no-flag) keeps its last setting, in its last place."""
    parts, current = [], None
    for token in map(str, flags):
        if token.startswith("--"):
            current = [token]
            parts.append(current)
        elif current is None or ("=" in token and not token.startswith("-")):
            parts.append([token])  # a verl key=value stands alone
            current = None
        else:
            current.append(token)
    name = lambda part: "--" + part[0].split("=", 1)[0].removeprefix("--").removeprefix("no-")  # noqa: E731
    last = {name(p): i for i, p in enumerate(parts) if p[0].startswith("--")}
    kept = [p for i, p in enumerate(parts) if not p[0].startswith("--") or last[name(p)] == i]
    return [token for part in kept for token in part]


def free_port() -> int:
    """A TCP port nothing listens on now: each torchrun launch its own rendezvous, so that two launches
    of one test can run side by side."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_recipes_together(runs: list[tuple], folder, nproc: int = 2, timeout: int = 1200) -> list[int]:
    """Each (recipe, flags) or (recipe, flags, environment) of `runs` in turn inside one torchrun
    launch of nproc processes (tests/run_together.py: its processes and imports start once for all
    the runs); a recipe is a name in recipes/ or a Path to a script of a test's own. Returns each
    run's exit status, the same on every rank, and keeps the launch's output in FOLDER/runs.out; a
    launch that fails raises with its output."""
    plan = Path(folder) / "runs.json"
    plan.write_text(
        json.dumps(
            [
                [
                    str(name if isinstance(name, Path) else ROOT / "recipes" / f"{name}.py"),
                    last_wins(flags),
                    {k: str(v) for k, v in (env or {}).items()},
                ]
                for name, flags, env in ((*run, None)[:3] for run in runs)
            ]
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(29500 + os.getpid() % 1000),
        str(ROOT / "tests" / "run_together.py"),
        str(plan),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    (Path(folder) / "runs.out").write_text(proc.stdout + proc.stderr)
    ranks = [Path(f"{plan}.rank{r}") for r in range(nproc)]
    codes = [json.loads(r.read_text()) if r.is_file() else None for r in ranks]
    if proc.returncode != 0 or any(c != codes[0] for c in codes):
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode} (statuses {codes})\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return codes[0]


# Each test module that reads runs under torchrun declares them at import with @torchrun_plan; the
# torchrun_runs fixture makes every selected module's runs in one launch for the session, since a
# launch's start-up (torchrun, then each process importing torch and transformers) costs about 7 s
# on 2 cores, once instead of once per module.
TORCHRUN_PLANS: dict = {}  # test module name -> its plan


def torchrun_plan(plan):
    """Declares a test module's runs under torchrun with 2 processes: plan(folder, fixture) returns
    {key: (recipe, flags) or (recipe, flags, environment)} (a recipe as run_recipes_together takes
    it), the runs writing under folder (made for the plan) and fixture(name) giving a session
    fixture's value (small_files, ...). A script of the test's own must leave the process group
    as it found it: the runs after it share the processes (accelerate's PartialState keeps one).
    The module's tests read them through the torchrun_runs fixture."""
    TORCHRUN_PLANS[plan.__module__] = plan
    return plan


@pytest.fixture(scope="session")
def torchrun_runs(request, tmp_path_factory) -> dict:
    """Every plan of a module with a selected test, made one after another in a single torchrun
    launch of 2 processes (run_recipes_together) the first time a test asks: {module name: (the
    plan's folder, {key: exit status})}. A launch that fails fails every test that reads it."""
    out = tmp_path_factory.mktemp("torchrun")
    selected = {item.module.__name__ for item in request.session.items if "torchrun_runs" in item.fixturenames}
    keys, runs = [], []
    for module, plan in TORCHRUN_PLANS.items():
        if module in selected:
            (out / module).mkdir()
            for key, run in plan(out / module, request.getfixturevalue).items():
                keys.append((module, key))
                runs.append(run)
    found: dict = {}
    for (module, key), code in zip(keys, run_recipes_together(runs, out)):
        found.setdefault(module, (out / module, {}))[1][key] = code
    return found


def stop_side_by_side(runs: dict, *, before=None, timeout: int = 600) -> dict:
    """Start every run of `runs`, {name: (command, environment, run folder, signal, target)}, at
    once (their start-ups overlap), each writing its output to <run folder>.out (a file: nothing
    reads a pipe while they go on), and send each its signal once 2 steps are in its metrics.jsonl:
    to the process started, or to target(process) -> pid. before(name, process), if given, runs
    just before a run's signal. Returns {name: (exit status, output, before's value)}: the status
    is None for a run that ended before its signal or did not exit within 120 s of it (then
    SIGABRT, so that a faulthandler prints every thread's stack)."""
    started = {}
    for name, (cmd, env, folder, _, _) in runs.items():
        log = open(f"{folder}.out", "w")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        started[name] = proc, log
    seen, codes = {}, {}
    try:
        deadline = time.time() + timeout
        while len(seen) < len(runs) and time.time() < deadline:
            for name, (_, _, folder, sig, target) in runs.items():
                proc, metrics = started[name][0], Path(folder) / "metrics.jsonl"
                if name in seen or proc.poll() is not None:
                    continue
                if metrics.is_file() and metrics.read_text().count('"train/loss"') >= 2:
                    seen[name] = before(name, proc) if before else None
                    os.kill(target(proc) if target else proc.pid, sig)
            time.sleep(0.05)
        for name, (proc, _) in started.items():
            try:
                codes[name] = proc.wait(timeout=120) if name in seen else None
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)
                proc.wait()
                codes[name] = None
    finally:
        for proc, log in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return {
        name: (codes.get(name), Path(f"{folder}.out").read_text(), seen.get(name))
        for name, (_, _, folder, _, _) in runs.items()
    }


def child_pids() -> set[int]:
    """The processes this one started that are still running."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # a process that ended while we looked
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def _run_in_process(script: Path, flags: list[str], cwd, env: dict, check: bool, timeout: int):
    import atexit
    import contextlib
    import faulthandler
    import io
    import logging
    import runpy
    import traceback

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_argv, saved_cwd = dict(os.environ), sys.argv, os.getcwd()
    root = logging.getLogger()
    saved_logging = (root.handlers[:], root.level)
    before = child_pids()
    # The project's own exit handlers (a Ray the run started is stopped by one) run when the run
    # ends, as they would when its process exits; a library's go to pytest's exit as before.
    at_exit, register = [], atexit.register

    def register_for_the_run(func, *args, **kwargs):
        if not getattr(func, "__module__", "").startswith(("common.", "recipes.", "__main__")):
            return register(func, *args, **kwargs)
        at_exit.append((func, args, kwargs))
        return func

    atexit.register = register_for_the_run
    os.environ.update({"PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", **{k: str(v) for k, v in env.items()}})
    sys.argv = [str(script), *flags]
    os.chdir(cwd)
    # A hang inside the run cannot be interrupted from here: dump every thread's stack and end.
    faulthandler.dump_traceback_later(timeout, exit=True, file=sys.__stderr__)
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(script), run_name="__main__")
            except SystemExit as e:  # tyro's exit, usage_errors' status
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if e.code is not None and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)
            except BaseException:  # as the interpreter reports an uncaught exception
                traceback.print_exc()
                code = 1
            atexit.register = register
            for func, args, kwargs in reversed(at_exit):
                try:
                    func(*args, **kwargs)
                except Exception:  # as the interpreter reports a failing exit handler
                    traceback.print_exc()
    finally:
        atexit.register = register
        faulthandler.cancel_dump_traceback_later()
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        root.handlers[:] = saved_logging[0]  # the run's basicConfig(force=True) pointed them at `err`
        root.setLevel(saved_logging[1])
        for pid in child_pids() - before:  # workers a failed run left behind (a process exit ends them)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    proc = subprocess.CompletedProcess([str(script), *flags], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"{script} {' '.join(flags)} exited {code}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


@pytest.fixture(scope="session")
def small_val(tmp_path_factory):
    """64 rows of the bundled test split: enough for a validation accuracy, fast to generate."""
    path = tmp_path_factory.mktemp("data") / "val64.parquet"
    pq.write_table(pq.read_table(TASK_TEST).slice(0, 64), path)
    return path


@pytest.fixture(scope="session")
def small_train(tmp_path_factory):
    """512 rows of the bundled train split, for runs of a few steps: every run templates and
    tokenizes all its train rows before step 1, and the full 7,600 take about a second a run
    (77 s of the suite when every run read them)."""
    path = tmp_path_factory.mktemp("data") / "train512.parquet"
    pq.write_table(pq.read_table(TASK_TRAIN).slice(0, 512), path)
    return path


@pytest.fixture(scope="session")
def odd_val(tmp_path_factory):
    """63 rows of the bundled test split: two ranks get 32 and 31, so the shorter share is padded
    for FSDP2's collectives."""
    path = tmp_path_factory.mktemp("data") / "val63.parquet"
    pq.write_table(pq.read_table(TASK_TEST).slice(0, 63), path)
    return path


@pytest.fixture(scope="session")
def val200(tmp_path_factory):
    """200 rows of the bundled test split: several chunks of generation."""
    path = tmp_path_factory.mktemp("data") / "val200.parquet"
    pq.write_table(pq.read_table(TASK_TEST).slice(0, 200), path)
    return path


PLAIN_DENSE_REWARD = """
from common.scoring import extract_answer


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    try:
        distance = min(abs(float(extract_answer(data_source, solution_str)) - float(ground_truth)), 100.0)
    except (TypeError, ValueError):  # no number in the reply
        distance = 100.0
    return {"score": -distance / 100, "acc": float(distance == 0)}
"""


@pytest.fixture(scope="session")
def plain_task(tmp_path_factory):
    """64 training and 8 held-out rows of bundled/plain-addition (the real model's task), and dense.py: a reward
    that says how far the reply's last number is from the sum, so that a few samples of the real model carry a
    gradient."""
    folder = tmp_path_factory.mktemp("plain")
    pq.write_table(pq.read_table(BUNDLED / "plain-addition" / "train.parquet").slice(0, 64), folder / "train.parquet")
    pq.write_table(pq.read_table(BUNDLED / "plain-addition" / "test.parquet").slice(0, 8), folder / "test.parquet")
    (folder / "dense.py").write_text(PLAIN_DENSE_REWARD)
    return folder


@pytest.fixture(scope="session")
def real_model() -> Path:
    """bundled/real_model.py's folder (SmolLM2-135M-Instruct), built once and cached; without the real extra
    (and no folder built) the test skips with the one line that says how to install it."""
    spec = importlib.util.spec_from_file_location("real_model", BUNDLED / "real_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if (reason := module.missing()) and os.environ.get("REQUIRE_REAL"):  # .ci/run: the tier never silently skips
        pytest.fail(reason)
    if reason:
        pytest.skip(reason)
    return module.build()


@pytest.fixture(scope="session")
def small_files(small_train, small_val) -> list[str]:
    """The flags that point a run at small_train and small_val."""
    return ["--train-files", str(small_train), "--val-files", str(small_val)]


@pytest.fixture(scope="session")
def tokenizer():
    from common.model import load_tokenizer

    return load_tokenizer(str(TINY))


DEFAULT_RUN = """\
import json, runpy, sys
sys.argv = ['recipes/grpo.py', '--output-dir', sys.argv[1], '--total-training-steps', '1', '--test-freq', '0',
            '--save-freq', '0', '--no-val-before-train']
runpy.run_path('recipes/grpo.py', run_name='__main__')
run = {name: getattr(module, '__file__', None) for name, module in sys.modules.items()}
recipe = runpy.run_path('recipes/grpo.py', run_name='imported')
sys.argv = ['recipes/grpo.py', 'trainer.total_epochs=1']
from common.config import cli_args
cli_args(recipe['Args'], 'grpo')  # the command line read as the recipe's __main__ reads it (common.config.cli)
print('MODULES', json.dumps({'run': run, 'verl': sorted(sys.modules)}))
"""


@pytest.fixture(scope="session")
def default_run(tmp_path_factory) -> dict:
    """A plain grpo.py run (one step, the launch check on) in a new interpreter, as a user starts it:
    {"run": {module: its file} loaded by the end of the run, "verl": the modules loaded once a verl
    key=value on the command line has been read after it}. One interpreter for the tests that judge
    what a default run loads (tests/test_layers.py, tests/test_shape.py)."""
    out = tmp_path_factory.mktemp("default_run") / "run"
    proc = subprocess.run(
        [sys.executable, "-c", DEFAULT_RUN, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("MODULES ", 1)[1])


SHARED_RAY: set[int] = set()  # the shared Ray's own processes (gcs_server, raylet), while it runs


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for every remote-engine test (each start costs ~10 s on 2 cores). Its head runs
    in this process, and every Ray process it makes descends from one in SHARED_RAY (which is how
    tests/test_remote.py's ray_processes tells it from a Ray a recipe run starts); the in-process tests
    use it as it is and recipe runs join it with --ray-address (one run inside this process while it
    is up joins it whatever its flags: ray.init was called here). At the end of the session it
    stops, with every process it made."""
    import ray

    from common.serving.remote import _descendants

    before = child_pids()
    context = ray.init(
        include_dashboard=False,
        num_cpus=4,
        object_store_memory=256 * 1024**2,
        log_to_driver=False,
        configure_logging=False,
    )
    SHARED_RAY.update(child_pids() - before)
    yield context.address_info["gcs_address"]
    started = _descendants(os.getpid(), "ray")
    ray.shutdown()
    for pid in started:  # as RemoteEngines.close does for a Ray it started: the agents linger otherwise
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.time() + 30
    while (left := [pid for pid in started if running(pid)]) and time.time() < deadline:
        time.sleep(0.5)
    SHARED_RAY.clear()
    assert not left, f"the shared Ray's processes outlived it: {left}"


def running(pid: int) -> bool:
    """Whether a process still runs (a zombie does not; one of ours is reaped here)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child: its parent reaps it
        pass
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def engine_lagging_by(monkeypatch, shift, every: int = 1):
    """The engine reports the sampled tokens' logprobs `shift` below the trainer's on every
    `every`-th response (0, every, 2 every, ...), as an engine whose copy of the weights differs
    would: pi_old / pi_rollout = exp(shift) on each of their tokens."""
    import common.rollout

    pack = common.rollout.pack_groups

    def lagging(*args, **kw):
        batch = pack(*args, **kw)
        rows = torch.zeros(len(batch["response_mask"]), 1)
        rows[::every] = 1.0
        batch["rollout_logprobs"] = batch["rollout_logprobs"] - shift * batch["response_mask"] * rows
        return batch

    monkeypatch.setattr(common.rollout, "pack_groups", lagging)
