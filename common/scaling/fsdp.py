"""FSDP2 sharding (torch's fully_shard on a device mesh), a feature: common.parallel.wrap_model shards with it only
under --strategy fsdp2 (or an accelerate FSDP config, or CPU offload)."""

import torch

from common.scaling import blocks_of


def shard(model, dist, mixed_precision: str, options: dict):
    """One shard unit per decoder layer (blocks_of), then the rest, on a mesh of every rank; options: fsdp_options'
    (offload, reshard_after_forward). mixed_precision bf16: gathered parameters cast to bfloat16, gradients reduced
    in float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(dist.device.type, (dist.world_size,))
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision == "bf16" else {}
    # Pinned memory makes the copies to the GPU asynchronous; there is none to pin for on CPU.
    offload = CPUOffloadPolicy(pin_memory=dist.device.type == "cuda") if options["offload"] else OffloadPolicy()
    reshard = options["reshard_after_forward"]
    policy = dict(
        mesh=mesh, mp_policy=MixedPrecisionPolicy(**bf16), offload_policy=offload, reshard_after_forward=reshard
    )
    for module in blocks_of(model):
        fully_shard(module, **policy)
    fully_shard(model, **policy)
    if options["offload"]:  # FSDP moves only parameters; buffers (rotary frequencies) go to the device here
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(dist.device)
    return model
