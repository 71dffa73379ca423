"""torch.compile of the decoder layers (--use-torch-compile), a feature: common.model.load_policy compiles only where
the flag asks."""

import functools

import torch

from common.scaling import blocks_of


def compile_layers(model):
    """Each decoder layer (the blocks FSDP2 shards) compiled in place, before any wrapping, so weights keep their
    names: one graph for all layers and lengths, norms, rotary and activations fused. A call with a KV cache
    (decoding, the shared-prompt pass) runs eagerly: the cache's per-layer guards would spend the recompile limit."""
    for module in blocks_of(model):
        compiled = torch.compile(module.forward, dynamic=True)
        module.forward = functools.partial(_eager_if_cached, module.forward, compiled)
    return model


def _eager_if_cached(eager, compiled, *args, **kwargs):
    cached = any(kwargs.get(k) is not None for k in ("cache", "past_key_values", "past_key_value"))
    return (eager if cached else compiled)(*args, **kwargs)
