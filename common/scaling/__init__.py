"""Beyond one process running eager passes, a feature: FSDP2 sharding and CPU offload (fsdp), the accelerate
launcher's config checked against the machine (accelerate), torch.compile of the decoder layers (compile). Each
loads only where a launch or a flag asks for it (common.parallel, common.model)."""
