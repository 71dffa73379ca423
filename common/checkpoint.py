"""Checkpoints: sharded training state, exact-resume trainer state, and a plain HF export.

Layout of <output_dir>/checkpoints/step_<N>/:
    state/              torch.distributed.checkpoint of model + optimizer (sharded under FSDP2)
    trainer_state.json  step, epoch, data position, lr schedulers, world size, anything the recipe adds
    rng_<rank>.pt       python / numpy / torch RNG of each rank (loaded with weights_only=True)
    hf/                 safetensors + config + tokenizer (LoRA: the adapter; merged model on request)
    hf_<name>/          the same for each extra model (PPO's critic: hf_critic/), under <name> in state/
A checkpoint is written to step_<N>.tmp and renamed when complete. trainer_state.json records the size
and sha256 of every other file, which a resume checks; loading never unpickles an arbitrary object.
"""

import hashlib
import io
import json
import logging
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from common import watchdog
from common.errors import UsageError
from common.flags import BUNDLED
from common.model import is_lora
from common.parallel import Dist, barrier, unwrap
from common.perf import timed

log = logging.getLogger(__name__)
# Single-process runs use torch.distributed.checkpoint on purpose (one format for every world size): mute its notice.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
STEP_DIR = re.compile(r"^step_(\d+)$")
_REFUSED = "refusing to load it (nothing in it was run). Resume from a checkpoint you trust, or --resume disable"


class UnsafeCheckpoint(UsageError):
    """A checkpoint file holds something other than what a save writes: loading it could run code."""


class DamagedCheckpoint(UsageError):
    """A checkpoint folder that does not validate: a file missing, cut short or changed since it was saved."""


# The only globals a distributed-checkpoint .metadata names; one naming anything else (os.system) is refused unread.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


def _safe_dcp_io(state_dir: Path):
    """The storage_reader and planner for torch.distributed.checkpoint.load (resharding to any world size)
    that never unpickle an arbitrary object: .metadata goes through the allow-list above, each non-tensor
    item (optimizer hyperparameters) through torch.load(weights_only=True) first, as tensors already do."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    source = state_dir / ".metadata"  # parsed here, so a refusal is raised as itself, not inside torch's load

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module, name):
            is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
            if (module, name) in _METADATA_CLASSES or is_dtype:
                return super().find_class(module, name)
            raise UnsafeCheckpoint(f"{source}: refers to {module}.{name}, which no checkpoint save writes; {_REFUSED}")

    metadata = MetadataUnpickler(io.BytesIO(source.read_bytes())).load()

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:  # saves write one global .metadata, never per-rank ones
                raise FileNotFoundError(f"{state_dir}: no per-rank metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            data = value.read()
            try:
                torch.load(io.BytesIO(data), weights_only=True)  # refuses any global outside torch's allow-list
            except pickle.UnpicklingError:
                raise UnsafeCheckpoint(
                    f"{state_dir}: the item {read_item.dest_index.fqn} holds objects no checkpoint save writes; "
                    f"{_REFUSED}"
                ) from None
            super().load_bytes(read_item, io.BytesIO(data))  # the same bytes, now known to be plain data

    return {"storage_reader": SafeReader(str(state_dir)), "planner": SafePlanner()}


def list_checkpoints(output_dir) -> list[Path]:
    found = [p for p in (Path(output_dir) / "checkpoints").glob("step_*") if STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: (_step_of(p), p))


def _step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _manifest(folder: Path) -> dict:
    """{relative path: [bytes, sha256]} of every file in a checkpoint folder but trainer_state.json."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "trainer_state.json")
    return {str(p.relative_to(folder)): [p.stat().st_size, _sha256(p)] for p in files}


def check_checkpoint(path: Path, recipe: str | None = None) -> dict:
    """The trainer state of a checkpoint folder that validates: every file trainer_state.json lists has its
    saved size and sha256 (in older ones, without the list: .metadata exists), else DamagedCheckpoint naming
    the first that has not. With `recipe`, another recipe's checkpoint is refused first (UsageError)."""
    state_file = path / "trainer_state.json"
    if not state_file.is_file():
        raise DamagedCheckpoint(f"{state_file} is missing")
    try:
        state = json.loads(state_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DamagedCheckpoint(f"{state_file} is not valid JSON ({e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise DamagedCheckpoint(f"{state_file} has no step number")
    owner = state.get("recipe", recipe)
    if recipe is not None and owner != recipe:
        raise UsageError(
            f"{path} was written by recipes/{owner}.py, not {recipe}.py, so it is not this run's to continue. "
            f"Pass a fresh --output-dir to start this recipe's own run, or --model {path / 'hf'} --resume "
            f"disable to start it from those weights"
        )
    files = state["files"].items() if isinstance(state.get("files"), dict) else [("state/.metadata", None)]
    for rel, recorded in files:
        f = path / rel
        if not f.is_file():
            raise DamagedCheckpoint(f"{f} is missing")
        if recorded is not None and f.stat().st_size != recorded[0]:
            raise DamagedCheckpoint(f"{f} has {f.stat().st_size} bytes where {recorded[0]} were saved")
        if recorded is not None and _sha256(f) != recorded[1]:
            raise DamagedCheckpoint(f"{f} has changed since it was saved (its sha256 differs)")
    return state


# Flags a resume may change (length, frequencies, logging and saving, memory layout, validation): others make a new run.
RESUMABLE_CHANGES = {
    "total_training_steps", "total_epochs", "save_freq", "test_freq", "val_before_train", "resume",
    "max_ckpt_to_keep", "export_merged_lora", "logger", "log_interval", "project_name", "experiment_name",
    "output_dir", "strategy", "micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
    "gradient_checkpointing", "shared_prompt_forward", "val_files", "val_batch_size", "val_n", "val_temperature",
    "reward_workers", "reward_timeout", "stop_on_nonfinite_reward", "use_torch_compile",
}  # fmt: skip


def _flat(flags: dict) -> dict:
    """A group's flags (a dict: RLArgs.conditioning) beside the others, each by its own name."""
    out = {}
    for name, value in flags.items():
        out.update(value if isinstance(value, dict) else {name: value})
    return out


def _bundled(value):
    """A path into this library's bundled/ folder as bundled/<rest> (when <rest> is there): a checkout moved or
    cloned elsewhere names the same bundled model and data, so its runs resume."""
    if isinstance(value, list):
        return [_bundled(v) for v in value]
    rest = value.rsplit("/bundled/", 1)[-1] if isinstance(value, str) and "/bundled/" in value else None
    return f"bundled/{rest}" if rest and (BUNDLED / rest).exists() else value


def _changed_flags(saved: dict, flags: dict) -> list[str]:
    saved, plain = _flat(saved), _flat(json.loads(json.dumps(flags, default=str)))  # tuples as lists, as saved
    # A flag only one side knows was added or removed between versions of the library: not a change.
    names = sorted(
        k for k in set(saved) & set(plain) if k not in RESUMABLE_CHANGES and _bundled(saved[k]) != _bundled(plain[k])
    )
    return [f"--{k.replace('_', '-')} {saved.get(k)!r} (now {plain.get(k)!r})" for k in names]


def find_resume(
    resume: str, output_dir, recipe: str, total_steps: int | None = None, flags: dict | None = None
) -> Path | None:
    """The checkpoint `--resume` names, validated (check_checkpoint): for `auto` the newest valid one in
    output_dir (each one skipped is logged; None if there are none, DamagedCheckpoint if none validates),
    for `disable` None. Call it before any model loads: another recipe's checkpoint (a fork run in its
    parent's folder) is refused, a run that completed total_steps exits 0 here, and with `flags` (this
    run's) one trained with flags that differ outside RESUMABLE_CHANGES is refused, naming them. Folders a
    killed save left (step_<N>.tmp) are removed."""
    root = Path(output_dir) / "checkpoints"
    for stale in sorted(root.glob("step_*.tmp")):
        shutil.rmtree(stale, ignore_errors=True)
        log.info("removed %s, left by a save that did not finish", stale)
    if resume == "disable":
        return None
    if resume == "auto":
        skipped = []
        for path in reversed(list_checkpoints(output_dir)):
            try:
                state = check_checkpoint(path, recipe)
                break
            except DamagedCheckpoint as e:
                skipped.append(f"{path.name}: {e}")
                log.warning("--resume auto: skipping %s: %s", path, e)
        else:
            if skipped:
                raise DamagedCheckpoint(
                    f"--resume auto: no checkpoint in {root} validates ({'; '.join(skipped)}). Pass --resume "
                    f"disable to start over, or --resume PATH to name one"
                )
            return None
    else:
        path = Path(resume).expanduser()
        if not (path / "trainer_state.json").is_file():
            raise UsageError(
                f"--resume {resume}: not a checkpoint folder (no trainer_state.json); pass a "
                f"<output_dir>/checkpoints/step_<N> folder, auto or disable"
            )
        try:
            state = check_checkpoint(path, recipe)
        except DamagedCheckpoint as e:
            raise DamagedCheckpoint(f"--resume {resume}: {e}. Name another checkpoint, or --resume disable") from None
    changed = _changed_flags(state["flags"], flags) if flags is not None and "flags" in state else []
    if changed:
        raise UsageError(
            f"--resume {resume}: {path} was trained with other settings: {', '.join(changed)}. Pass a new "
            f"--output-dir to start a run with these settings, or --resume disable to start over in this folder"
        )
    if total_steps is not None and state["step"] >= total_steps:
        log.info(
            "%s already completed all %d steps: nothing to train. Use --resume disable (or another "
            "--output-dir) to start over, or raise --total-training-steps to train further.",
            path,
            total_steps,
        )
        raise SystemExit(0)
    newer = [p.name for p in list_checkpoints(output_dir) if _step_of(p) > state["step"]]
    if newer and path.parent == root:
        log.warning(
            "resuming %s while %s in the same folder went further: this run's first save removes them, so "
            "--resume auto continues this run; copy them elsewhere now to keep them",
            path.name,
            ", ".join(newer),
        )
    return path


def _rng_state() -> dict:
    kind, keys, *rest = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, keys.tolist(), *rest], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _check_extras(extra_models: dict | None) -> dict:
    extra_models = dict(extra_models or {})
    for name, triple in extra_models.items():
        if name in ("model", "optim") or not name.isidentifier() or len(triple) != 3:
            raise ValueError(
                f"extra_models[{name!r}]: use a name other than model / optim for a (model, optimizer, scheduler)"
            )
    return extra_models


def export_hf(model, tokenizer, out_dir: Path, dist: Dist, merged_lora: bool = False) -> None:
    """Write a folder that `AutoModelForCausalLM.from_pretrained` (or peft, for an adapter) loads.
    Collective: every rank must call it (FSDP2 gathers the full weights onto rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_main:
        inner = unwrap(model)
        out_dir.mkdir(parents=True, exist_ok=True)
        inner.save_pretrained(out_dir, state_dict=full)
        tokenizer.save_pretrained(out_dir)
        _check_export(out_dir)
        if merged_lora and is_lora(inner):
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            base_path = inner.peft_config["default"].base_model_name_or_path
            base = AutoModelForCausalLM.from_pretrained(base_path, dtype=inner.dtype)
            PeftModel.from_pretrained(base, out_dir).merge_and_unload().save_pretrained(out_dir / "merged")
            tokenizer.save_pretrained(out_dir / "merged")
            _check_export(out_dir / "merged")
    barrier()


def _check_export(out_dir: Path) -> None:
    """Read back what save_pretrained wrote: the config parses and every safetensors file opens
    whole (a full disk or a cut-off write shows here, not when someone loads the model)."""
    from safetensors import safe_open

    weights = sorted(out_dir.glob("*.safetensors"))
    configs = [out_dir / n for n in ("config.json", "adapter_config.json") if (out_dir / n).is_file()]
    if not weights or not configs:
        raise DamagedCheckpoint(f"{out_dir}: the export has no {'weights' if not weights else 'config'} file")
    try:
        for f in configs:
            json.loads(f.read_text())
        for f in weights:
            with safe_open(str(f), framework="pt") as opened:
                for name in opened.keys():
                    opened.get_slice(name).get_shape()
    except Exception as e:
        raise DamagedCheckpoint(f"{out_dir}: the export did not read back ({type(e).__name__}: {e})") from None


@timed("save")  # the closing "where the time went" block counts it
def save_checkpoint(
    output_dir,
    step: int,
    trained,
    dist: Dist,
    tokenizer,
    recipe: str,
    trainer,
    flags: dict | None,
    trainer_state: dict,
    extra_models: dict | None = None,
) -> Path:
    """Collective. trained: the policy's (model, optimizer, scheduler) (common.optim.Trainable); `recipe`
    (its file's stem) is recorded as the owner, and `flags` (every flag by name) for a resume to compare; the
    trainer group says how many checkpoints to keep and whether LoRA also exports a merged model; extra_models
    {name: (model, optimizer, scheduler)}: more trained models saved in the same state (PPO's critic), each
    exported to hf_<name>/."""
    keep, merged_lora = trainer.max_ckpt_to_keep, trainer.export_merged_lora
    model, optimizer, scheduler = trained
    extra_models = _check_extras(extra_models)
    root = Path(output_dir) / "checkpoints"
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    to_save = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
    for name, (extra, extra_optimizer, _) in extra_models.items():
        to_save[name] = dict(zip(("model", "optim"), get_state_dict(extra, extra_optimizer)))
    with watchdog.waiting(f"saving the checkpoint of step {step} (collective)", collective=True):
        dcp.save(to_save, checkpoint_id=str(tmp / "state"))
        torch.save(_rng_state(), tmp / f"rng_{dist.rank}.pt")
        export_hf(model, tokenizer, tmp / "hf", dist, merged_lora=merged_lora)
        for name, (extra, _, _) in extra_models.items():
            export_hf(extra, tokenizer, tmp / f"hf_{name}", dist)
    if dist.is_main:
        state = dict(trainer_state, recipe=recipe, step=step, world_size=dist.world_size)
        state["scheduler"] = scheduler.state_dict()
        if flags is not None:  # what a resume compares its own flags with (find_resume)
            state["flags"] = json.loads(json.dumps(flags, default=str))
        if extra_models:
            state["extra_schedulers"] = {name: s.state_dict() for name, (_, _, s) in extra_models.items()}
        state["files"] = _manifest(tmp)
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        saved = list_checkpoints(output_dir)
        for later in [p for p in saved if _step_of(p) > step]:  # a run resumed from an earlier checkpoint
            shutil.rmtree(later, ignore_errors=True)
            log.warning("removed %s: from before this run resumed at an earlier step", later)
        if keep > 0:
            for old in [p for p in saved if _step_of(p) <= step][:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(path: Path, trained, *, dist: Dist, extra_models: dict | None = None) -> dict:
    """Restore the (model, optimizer, scheduler) of trained (and of extra_models, as save_checkpoint
    took them) and this rank's RNG; return the trainer state."""
    model, optimizer, scheduler = trained
    extra_models = _check_extras(extra_models)
    path = Path(path)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state = json.loads((path / "trainer_state.json").read_text())
    to_load = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
    missing = sorted(set(extra_models) - set(state.get("extra_schedulers", {})))
    if missing:
        raise ValueError(f"checkpoint {path} was saved without {', '.join(missing)}, so this run cannot resume it")
    for name, (extra, extra_optimizer, _) in extra_models.items():
        to_load[name] = dict(zip(("model", "optim"), get_state_dict(extra, extra_optimizer)))
    try:
        dcp.load(to_load, **_safe_dcp_io(path / "state"))
    except dcp.CheckpointException as e:  # torch wraps what a rank raised: a refusal is raised as itself
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, UnsafeCheckpoint)]
        if refused:
            raise refused[0] from None
        raise
    set_state_dict(model, optimizer, model_state_dict=to_load["model"], optim_state_dict=to_load["optim"])
    scheduler.load_state_dict(state["scheduler"])
    for name, (extra, extra_optimizer, extra_scheduler) in extra_models.items():
        loaded = to_load[name]
        set_state_dict(extra, extra_optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        extra_scheduler.load_state_dict(state["extra_schedulers"][name])
    rng_file = path / f"rng_{dist.rank}.pt"
    if state.get("world_size") == dist.world_size and rng_file.is_file():
        try:
            _set_rng_state(torch.load(rng_file, weights_only=True))
        except pickle.UnpicklingError:
            raise UnsafeCheckpoint(f"{rng_file}: holds objects no checkpoint save writes; {_REFUSED}") from None
    else:
        log.warning(
            "checkpoint was written by %s process(es), this run has %d: RNG streams are not "
            "restored, so sampling after resume differs from an uninterrupted run",
            state.get("world_size"),
            dist.world_size,
        )
    return state


def resume(path: Path | None, trained, *, dist: Dist, extra_models: dict | None = None) -> dict:
    """Load the checkpoint find_resume chose, if any; returns its trainer state ({"step": 0} when starting
    fresh): "step" is where to start; a recipe reads back what it saved (a KL coefficient, a data position)."""
    return {"step": 0} if path is None else load_checkpoint(path, trained, dist=dist, extra_models=extra_models)
