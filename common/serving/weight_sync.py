"""The trainer's weights as a Hugging Face checkpoint names them, one full tensor at a time: what
a rollout engine holding its own copy of the policy (vLLM) loads after every optimizer step.

- Names: wrapper prefixes (DDP's `module.`, torch.compile's `_orig_mod.`, activation
  checkpointing's) and PEFT's (`base_model.model.`, `.base_layer`) are stripped, so a name is the
  one in the model's own safetensors.
- LoRA: each adapted weight is sent merged (W + B A * scaling) without touching the trainer's W;
  the adapter's own tensors are not sent.
- Tied embeddings: named_parameters() lists a tied weight once (under the input embedding), so it
  is sent once, as the checkpoint holds it.
- FSDP2: each DTensor is gathered on its own (full_tensor is a collective, so every rank iterates
  in the same order and must consume the whole stream); peak memory is one full parameter.
- Every tensor is checked against the checkpoint's own names, shapes (check_against) before an
  engine sees it: a weight the engine would not know is an error here, never a silent skip.
- An adapter sync (vLLM's LoRA support) sends the adapter alone: save_adapter writes it as a PEFT
  folder, gathered whole on every rank, which the engine loads in place of the previous one.
"""

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from common.errors import UsageError
from common.model import is_lora
from common.parallel import unwrap

WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def hf_name(name: str) -> str:
    """The checkpoint name of a trainer parameter name (see the module docstring)."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name.removeprefix("module.").removeprefix("base_model.model.").replace(".base_layer.", ".")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _lora_layers(model) -> dict:
    """{module name: peft LoRA Linear} of a PEFT model; other adapter kinds are refused (their
    merge is not a plain B A product)."""
    from peft.tuners.lora import Linear, LoraLayer

    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            if not isinstance(module, Linear) or any(module.use_dora.get(a) for a in module.active_adapters):
                raise UsageError(
                    f"LoRA on {name} ({type(module).__name__}): weight sync merges LoRA on Linear layers only; "
                    f"use --target-modules with linear layers"
                )
            layers[name] = module
    return layers


def _delta(layer) -> torch.Tensor:
    """B A * scaling of every active adapter of a LoRA Linear, full size (gathered under FSDP2)."""
    total = None
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        a, b = _full(layer.lora_A[adapter].weight.detach()), _full(layer.lora_B[adapter].weight.detach())
        delta = (b.float() @ a.float()) * layer.scaling[adapter]
        delta = delta.T if layer.fan_in_fan_out else delta
        total = delta if total is None else total + delta
    return total


def _sent(inner, lora: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters a sync sends, by trainer name: LoRA's own tensors are merged, not sent."""
    for name, param in inner.named_parameters():
        if lora and (".lora_" in name or "modules_to_save" in name or "original_module" in name):
            if "modules_to_save" in name:
                raise UsageError(f"{name}: PEFT modules_to_save is not supported by the weight sync")
            continue
        yield name, param


def weight_manifest(model) -> list[tuple[str, tuple[int, ...]]]:
    """[(checkpoint name, full shape)] of what hf_weights sends, in its order, without gathering
    anything (a DTensor's shape is the full one)."""
    inner = unwrap(model)
    lora = _lora_layers(inner) if is_lora(inner) else {}
    return [(hf_name(name), tuple(param.shape)) for name, param in _sent(inner, lora)]


@torch.no_grad()
def hf_weights(model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, full tensor) for every weight of the policy, in the model's order (layer
    by layer), cast to `dtype` when given. A collective under FSDP2: every rank iterates it all."""
    inner = unwrap(model)
    lora = _lora_layers(inner) if is_lora(inner) else {}
    for name, param in _sent(inner, lora):
        tensor = _full(param.detach())
        owner = name.removesuffix(".base_layer.weight")
        if owner != name and owner in lora:
            tensor = (tensor.float() + _delta(lora[owner])).to(tensor.dtype)  # a new tensor: W stays as it is
        yield hf_name(name), tensor.to(dtype) if dtype is not None else tensor


def checkpoint_shapes(model_dir) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every tensor in a Hugging Face folder's safetensors, read from the file
    headers (no tensor is loaded)."""
    from safetensors import safe_open

    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []
    files = [folder / f for f in files] or sorted(folder.glob("*.safetensors"))
    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def check_against(weights: Iterator[tuple[str, torch.Tensor]], shapes: dict, where: str):
    """Pass `weights` through, raising at the first name the checkpoint `shapes` does not hold or
    whose shape differs; at the end, names the checkpoint holds that never came (a tied lm_head
    excepted) are an error too. `where` names the engine in the message."""
    seen = set()
    for name, tensor in weights:
        if name not in shapes:
            raise RuntimeError(f"weight sync to {where}: {name} is not a weight of the engine's model")
        if tuple(tensor.shape) != shapes[name]:
            raise RuntimeError(
                f"weight sync to {where}: {name} has shape {tuple(tensor.shape)}, the engine's model {shapes[name]}"
            )
        seen.add(name)
        yield name, tensor
    missing = sorted(set(shapes) - seen - {"lm_head.weight"})
    if missing:
        raise RuntimeError(f"weight sync to {where}: {len(missing)} weight(s) never sent, e.g. {missing[0]}")


@torch.no_grad()
def save_adapter(model, folder: Path) -> Path:
    """Write the policy's LoRA adapter (its active one, full tensors) to `folder` as PEFT saves it,
    adapter_config.json and adapter_model.safetensors: what vLLM's LoRARequest loads. A collective
    under FSDP2 (every rank gathers every adapter tensor in the same order)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    inner = unwrap(model)
    _lora_layers(inner)  # the adapter kinds vLLM takes are the ones the merge takes
    state = {}
    for name, param in inner.named_parameters():
        if ".lora_" in name:
            for wrapper in WRAPPERS:
                name = name.replace(wrapper, "")
            state[name] = _full(param.detach()).contiguous()
    (adapter,) = inner.active_adapters
    folder.mkdir(parents=True)
    inner.peft_config[adapter].save_pretrained(str(folder))
    save_file(
        get_peft_model_state_dict(inner, state_dict=state, adapter_name=adapter),
        str(folder / "adapter_model.safetensors"),
    )
    return folder


class SyncEvery:
    """An engine with its own weights, synced every `n` versions (--model-update-frequency): update_weights(version)
    loads the trainer's weights once `n` versions have passed since the engine's, or when asked again for the
    version it holds (the launch check moves the weights without a new version); anything else is the engine's."""

    def __init__(self, engine, n: int):
        self.engine, self.n = engine, n

    def update_weights(self, version: int) -> None:
        if version == self.engine.weight_version or version - self.engine.weight_version >= self.n:
            self.engine.update_weights(version)

    def __getattr__(self, name):  # generate, score, sleep, wake_up, weight_version, ...
        return getattr(self.engine, name)
