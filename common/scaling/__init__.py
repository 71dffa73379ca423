"""Beyond one process running eager passes, a feature: FSDP2 sharding and CPU offload (fsdp), the accelerate
launcher's config checked against the machine (accelerate), torch.compile of the decoder layers (compile). Each
loads only where a launch or a flag asks for it (common.parallel, common.model)."""


def blocks_of(model) -> list:  # its decoder layers (the classes in _no_split_modules): FSDP2's units, what compiles
    names = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or []}
    return [module for module in model.modules() if type(module).__name__ in names]
