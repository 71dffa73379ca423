"""Checkpoints: sharded training state, exact-resume trainer state, and a plain HF export.

Layout of <output_dir>/checkpoints/step_<N>/:
    state/              torch.distributed.checkpoint of model + optimizer (sharded under FSDP2)
    trainer_state.json  step, epoch, data position, lr scheduler, world size, anything the recipe adds
    rng_<rank>.pt       python / numpy / torch RNG of each rank (loaded with weights_only=True)
    hf/                 safetensors + config + tokenizer (LoRA: the adapter; merged model on request)
    hf_<name>/          the same for each extra model (PPO's critic: hf_critic/); its weights and
                        optimizer sit in state/ under <name>, its lr scheduler in trainer_state.json
A checkpoint is written to step_<N>.tmp and renamed when complete, so a folder named step_<N> is
always whole. Only the newest `keep` are kept.
"""

import json
import logging
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from common.model import is_lora
from common.parallel import Dist, barrier, unwrap

log = logging.getLogger(__name__)
# Single-process runs save and load with torch.distributed.checkpoint on purpose (one format for
# every world size); its notice about that would print on every save.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
STEP_DIR = re.compile(r"^step_(\d+)$")


def list_checkpoints(output_dir) -> list[Path]:
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def find_resume(resume: str, output_dir, recipe: str, total_steps: int | None = None) -> Path | None:
    """The checkpoint `--resume` names: `auto` the newest complete one in output_dir (or None),
    `disable` None, else that path. Call it before any model loads: a checkpoint written by
    another recipe (a fork run in its parent's folder, say) is refused, never silently continued,
    and a run that already completed total_steps exits 0 here, saying so, without loading a model."""
    if resume == "disable":
        return None
    if resume == "auto":
        found = list_checkpoints(output_dir)
        path = found[-1] if found else None
    else:
        path = Path(resume).expanduser()
        if not (path / "trainer_state.json").is_file():
            raise FileNotFoundError(
                f"--resume {resume}: not a checkpoint folder (no trainer_state.json); pass a "
                f"<output_dir>/checkpoints/step_<N> folder, auto or disable"
            )
    if path is not None:
        state = json.loads((path / "trainer_state.json").read_text())
        owner = state.get("recipe", recipe)
        if owner != recipe:
            raise ValueError(
                f"--resume {resume}: {path} was written by recipes/{owner}.py, not {recipe}.py, so it "
                f"is not this run's to continue. Pass a fresh --output-dir to start this recipe's own "
                f"run, or --model {path / 'hf'} --resume disable to start it from those weights"
            )
        if total_steps is not None and state["step"] >= total_steps:
            log.info(
                "%s already completed all %d steps: nothing to train. Use --resume disable (or another "
                "--output-dir) to start over, or raise --total-training-steps to train further.",
                path, total_steps,
            )  # fmt: skip
            raise SystemExit(0)
    return path


def _rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
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

    Collective: every rank must call it (FSDP2 gathers the full weights onto rank 0).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_main:
        inner = unwrap(model)
        out_dir.mkdir(parents=True, exist_ok=True)
        inner.save_pretrained(out_dir, state_dict=full)
        tokenizer.save_pretrained(out_dir)
        if merged_lora and is_lora(inner):
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            base_path = inner.peft_config["default"].base_model_name_or_path
            base = AutoModelForCausalLM.from_pretrained(base_path, dtype=inner.dtype)
            merged = PeftModel.from_pretrained(base, out_dir).merge_and_unload()
            merged.save_pretrained(out_dir / "merged")
            tokenizer.save_pretrained(out_dir / "merged")
    barrier()


def save_checkpoint(
    output_dir,
    step: int,
    *,
    model,
    optimizer,
    scheduler,
    tokenizer,
    dist: Dist,
    recipe: str,
    trainer_state: dict,
    keep: int = 2,
    merged_lora: bool = False,
    extra_models: dict | None = None,
) -> Path:
    """Collective. `recipe` (the recipe file's stem) is recorded as the checkpoint's owner.
    extra_models {name: (model, optimizer, scheduler)}: more trained models saved in the same state
    (PPO's critic), each also exported to hf_<name>/."""
    extra_models = _check_extras(extra_models)
    root = Path(output_dir) / "checkpoints"
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    to_save = {"model": model_sd, "optim": optim_sd}
    for name, (extra, extra_optimizer, _) in extra_models.items():
        to_save[name] = dict(zip(("model", "optim"), get_state_dict(extra, extra_optimizer)))
    dcp.save(to_save, checkpoint_id=str(tmp / "state"))
    torch.save(_rng_state(), tmp / f"rng_{dist.rank}.pt")
    export_hf(model, tokenizer, tmp / "hf", dist, merged_lora=merged_lora)
    for name, (extra, _, _) in extra_models.items():
        export_hf(extra, tokenizer, tmp / f"hf_{name}", dist)
    if dist.is_main:
        state = {
            **trainer_state,
            "recipe": recipe,
            "step": step,
            "world_size": dist.world_size,
            "scheduler": scheduler.state_dict(),
        }
        if extra_models:
            state["extra_schedulers"] = {name: s.state_dict() for name, (_, _, s) in extra_models.items()}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        if keep > 0:
            for old in list_checkpoints(output_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(path: Path, *, model, optimizer, scheduler, dist: Dist, extra_models: dict | None = None) -> dict:
    """Restore model, optimizer, scheduler (and those of extra_models, as save_checkpoint took them)
    and this rank's RNG; return the trainer state."""
    extra_models = _check_extras(extra_models)
    path = Path(path)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state = json.loads((path / "trainer_state.json").read_text())
    model_sd, optim_sd = get_state_dict(model, optimizer)
    to_load = {"model": model_sd, "optim": optim_sd}
    missing = sorted(set(extra_models) - set(state.get("extra_schedulers", {})))
    if missing:
        raise ValueError(f"checkpoint {path} was saved without {', '.join(missing)}, so this run cannot resume it")
    for name, (extra, extra_optimizer, _) in extra_models.items():
        to_load[name] = dict(zip(("model", "optim"), get_state_dict(extra, extra_optimizer)))
    dcp.load(to_load, checkpoint_id=str(path / "state"))
    set_state_dict(model, optimizer, model_state_dict=to_load["model"], optim_state_dict=to_load["optim"])
    scheduler.load_state_dict(state["scheduler"])
    for name, (extra, extra_optimizer, extra_scheduler) in extra_models.items():
        set_state_dict(
            extra, extra_optimizer, model_state_dict=to_load[name]["model"], optim_state_dict=to_load[name]["optim"]
        )
        extra_scheduler.load_state_dict(state["extra_schedulers"][name])
    rng_file = path / f"rng_{dist.rank}.pt"
    if state.get("world_size") == dist.world_size and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        log.warning(
            "checkpoint was written by %s process(es), this run has %d: RNG streams are not "
            "restored, so sampling after resume differs from an uninterrupted run",
            state.get("world_size"),
            dist.world_size,
        )
    return state


def resume(path: Path | None, *, model, optimizer, scheduler, dist: Dist, extra_models: dict | None = None) -> dict:
    """Load the checkpoint find_resume chose, if any; returns its trainer state ({"step": 0} when
    starting fresh): "step" is where to start, and a recipe reads back what it saved (an adaptive
    KL coefficient, a data position)."""
    if path is None:
        return {"step": 0}
    return load_checkpoint(
        path, model=model, optimizer=optimizer, scheduler=scheduler, dist=dist, extra_models=extra_models
    )
