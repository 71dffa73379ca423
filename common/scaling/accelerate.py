"""The config file of `accelerate launch --config_file`, checked against the machine: common.parallel.init_distributed
loads this only under accelerate's launcher, whose processes carry ACCELERATE_MIXED_PRECISION."""

import logging
import os
from pathlib import Path

import torch

from common.errors import UsageError


def accelerate_config() -> tuple[str, dict] | None:
    """(path, settings) of the config file named on the command line of the `accelerate launch
    --config_file PATH` whose child this process is (the recipe); None without such a launcher or file."""
    import yaml

    parent = Path(f"/proc/{os.getppid()}")
    try:
        words = [w.decode(errors="replace") for w in (parent / "cmdline").read_bytes().split(b"\0")]
        cwd = (parent / "cwd").resolve()
    except OSError:
        return None
    if not any("accelerate" in w for w in words[:3]):
        return None
    for word, value in zip(words, words[1:]):
        if word in ("--config_file", "--config-file"):
            try:  # an absolute path replaces cwd
                return value, yaml.safe_load((cwd / Path(value).expanduser()).read_text()) or {}
            except (OSError, yaml.YAMLError):
                return None
    return None


def check_accelerate_config(world_size: int) -> None:
    """A GPU accelerate config (single GPU, DDP, FSDP) without CUDA is an error before anything starts
    (accelerate would run it on the CPU without a word); a world size other than the config's is said once."""
    found = accelerate_config()
    if found is None:
        return
    path, config = found
    kind = str(config.get("distributed_type", "NO"))
    if not config.get("use_cpu", False) and kind in ("NO", "MULTI_GPU", "FSDP") and not torch.cuda.is_available():
        raise UsageError(
            f"accelerate config {path} runs on GPUs (distributed_type {kind}) but this machine has no CUDA device; "
            f"on CPU run the recipe with python, or torchrun --nproc_per_node N for several processes"
        )
    wanted = int(config.get("num_processes", world_size))
    if wanted != world_size and os.environ.get("RANK", "0") == "0":
        logging.getLogger(__name__).warning(
            "accelerate config %s asks for %d processes; this launch has %d (--num_processes overrides it)",
            path,
            wanted,
            world_size,
        )
