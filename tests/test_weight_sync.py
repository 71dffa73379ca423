"""common/serving/weight_sync.py: the weights an engine receives are the checkpoint's names and tensors,
LoRA merged without touching the trainer, tied weights once, FSDP2 gathered to the same values; an adapter
sync's folder is the adapter PEFT saves, gathered whole under FSDP2 too."""

import copy

import pytest
import torch
from conftest import ROOT, torchrun_plan
from safetensors.torch import load_file

from common.errors import UsageError
from common.model import load_policy
from common.serving.weight_sync import check_against, checkpoint_shapes, hf_name, hf_weights, save_adapter

SFT = ROOT / "bundled" / "tiny-qwen2-sft"


def test_names_and_tensors_are_the_checkpoints():
    model = load_policy(str(SFT))
    sent = dict(hf_weights(model))
    saved = load_file(SFT / "model.safetensors")
    assert set(sent) == set(saved) - {"lm_head.weight"}, "tied lm_head: sent once, as embed_tokens"
    assert model.config.tie_word_embeddings
    for name, tensor in saved.items():
        if name in sent:
            assert torch.equal(sent[name], tensor), name
    assert {t.dtype for _, t in hf_weights(model, torch.bfloat16)} == {torch.bfloat16}
    assert checkpoint_shapes(SFT) == {k: tuple(v.shape) for k, v in saved.items()}


def test_wrapper_and_peft_prefixes_are_stripped():
    assert hf_name("module.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert hf_name("_orig_mod.model.norm.weight") == "model.norm.weight"
    assert hf_name("base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight") == (
        "model.layers.1.self_attn.q_proj.weight"
    )
    assert hf_name("model.layers.0._checkpoint_wrapped_module.mlp.down_proj.weight") == (
        "model.layers.0.mlp.down_proj.weight"
    )


def trained_adapter(model):
    """Give every adapter weight seeded values (lora_B starts at zero, which would hide a missing
    merge; lora_A at random), the same full tensors whether a parameter is whole or an FSDP2 shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for i, p in enumerate(p for name, p in model.named_parameters() if ".lora_" in name):
        full = torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.05
        with torch.no_grad():
            p.copy_(distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full)
    return model


def test_lora_is_sent_merged_and_the_trainer_keeps_its_weights():
    model = trained_adapter(load_policy(str(SFT), lora_rank=4, lora_alpha=8))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sent = dict(hf_weights(model))
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(sent) == set(merged) - {"lm_head.weight"}
    for name, tensor in sent.items():
        assert torch.allclose(tensor, merged[name], atol=1e-6), name
    base = load_file(SFT / "model.safetensors")
    assert any(not torch.equal(t, base[n]) for n, t in sent.items() if "q_proj" in n), "the adapters reach the engine"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "trainer's weights untouched"


def test_an_adapter_sync_writes_the_adapter_peft_loads_to_the_same_policy(tmp_path):
    """save_adapter's folder, loaded by peft onto the base checkpoint, is the trainer's policy (its logits), and holds
    the adapter's tensors alone under PEFT's names; a DoRA adapter is refused as the merge refuses it."""
    from peft import PeftModel
    from safetensors.torch import load_file as load_tensors

    model = trained_adapter(load_policy(str(SFT), lora_rank=4, lora_alpha=8))
    folder = save_adapter(model, tmp_path / "1")
    tensors = load_tensors(folder / "adapter_model.safetensors")
    assert tensors and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in tensors), list(tensors)[:3]
    loaded = PeftModel.from_pretrained(load_policy(str(SFT)), str(folder))
    ids = torch.tensor([[5, 9, 20, 33, 40, 7]])
    with torch.no_grad():
        want, got, base = model(ids).logits, loaded(ids).logits, load_policy(str(SFT))(ids).logits
    assert (want - base).abs().max() > 1e-2, "the adapter moves the policy"
    assert torch.allclose(got, want, atol=1e-5)
    dora = load_policy(str(SFT), lora_rank=4, lora_alpha=8)
    for module in dora.modules():
        if hasattr(module, "use_dora"):
            module.use_dora["default"] = True
    with pytest.raises(UsageError, match="merges LoRA on Linear layers only"):
        save_adapter(dora, tmp_path / "2")


def test_the_adapter_sync_asks_vllm_for_the_smallest_rank_that_holds_the_adapter():
    """vLLM's max_lora_rank takes a fixed set: rank 4 asks for 8, 16 for 16; a rank past its largest is merged,
    saying why; --lora-sync merged, or a policy without LoRA, asks nothing."""
    from common.serving.vllm_engine import adapter_plan

    assert adapter_plan(load_policy(str(SFT), lora_rank=4), "auto") == (
        dict(enable_lora=True, max_lora_rank=8, max_loras=1, max_cpu_loras=1),
        "",
    )
    assert adapter_plan(load_policy(str(SFT), lora_rank=16), "adapter")[0]["max_lora_rank"] == 16
    assert adapter_plan(load_policy(str(SFT), lora_rank=600), "auto") == (
        {},
        "vLLM's LoRA takes ranks up to 512, not 600",
    )
    assert adapter_plan(load_policy(str(SFT), lora_rank=4), "merged") == ({}, "--lora-sync merged")
    assert adapter_plan(load_policy(str(SFT)), "auto") == ({}, "")


def test_a_weight_the_engine_does_not_know_is_an_error():
    shapes = checkpoint_shapes(SFT)
    good = list(hf_weights(load_policy(str(SFT))))
    assert [n for n, _ in check_against(iter(good), shapes, "engine 0")] == [n for n, _ in good]
    renamed = [("model.layers.0.mlp.gate.weight", good[0][1])] + good[1:]
    with pytest.raises(RuntimeError, match="model.layers.0.mlp.gate.weight is not a weight of the engine's model"):
        list(check_against(iter(renamed), shapes, "engine 0"))
    reshaped = [(good[0][0], good[0][1][:-1])] + good[1:]
    with pytest.raises(RuntimeError, match=r"has shape \(260, 128\), the engine's model \(261, 128\)"):
        list(check_against(iter(reshaped), shapes, "engine 0"))
    with pytest.raises(RuntimeError, match=r"1 weight\(s\) never sent, e.g. model.norm.weight"):
        list(check_against(iter([w for w in good if w[0] != "model.norm.weight"]), shapes, "engine 0"))


FSDP2_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[3])
from test_weight_sync import trained_adapter
from common.errors import UsageError
from common.model import load_policy
from common.parallel import init_distributed, wrap_model
from common.serving.weight_sync import hf_weights, save_adapter
from pathlib import Path
dist = init_distributed()
for lora_rank in (0, 4):
    model = wrap_model(load_policy(sys.argv[1], lora_rank=lora_rank, lora_alpha=8), "fsdp2", dist)
    sent = dict(hf_weights(trained_adapter(model) if lora_rank else model))
    if dist.rank == 0:
        torch.save(sent, f"{sys.argv[2]}/sent{lora_rank}.pt")
    if lora_rank:  # every rank writes the whole adapter, for its own engine
        save_adapter(model, Path(sys.argv[2]) / f"adapter{dist.rank}")
torch.distributed.barrier()  # neither rank goes on while the other still gathers
"""


@torchrun_plan
def fsdp2_plan(folder, fixture):
    """FSDP2_SCRIPT under 2 processes, saving what rank 0 sends in folder."""
    (folder / "sync.py").write_text(FSDP2_SCRIPT)
    return {"sync": (folder / "sync.py", [SFT, folder, ROOT / "tests"])}


def test_fsdp2_ranks_gather_what_one_process_sends(torchrun_runs):
    """Two gloo processes (fsdp2_plan), the model sharded, plain and with a trained LoRA adapter:
    rank 0's stream equals one process's, name for name and bit for bit (every rank runs the gathers)."""
    tmp_path, codes = torchrun_runs[__name__]
    assert codes == {"sync": 0}
    for lora_rank in (0, 4):
        sent = torch.load(tmp_path / f"sent{lora_rank}.pt", weights_only=True)
        model = load_policy(str(SFT), lora_rank=lora_rank, lora_alpha=8)
        want = dict(hf_weights(trained_adapter(model) if lora_rank else model))
        assert list(sent) == list(want), "the same names in the same (layer) order"
        for name, tensor in want.items():
            assert torch.allclose(sent[name], tensor, atol=1e-6 if lora_rank else 0), name
    one = save_adapter(trained_adapter(load_policy(str(SFT), lora_rank=4, lora_alpha=8)), tmp_path / "one")
    want = load_file(one / "adapter_model.safetensors")
    for rank in (0, 1):  # each rank's folder holds the full adapter, equal to one process's
        got = load_file(tmp_path / f"adapter{rank}" / "adapter_model.safetensors")
        assert list(got) == list(want) and all(torch.equal(got[n], want[n]) for n in want), rank


def test_an_engine_synced_every_n_versions_skips_the_others_and_resyncs_its_own():
    """SyncEvery (--model-update-frequency 3) over an engine: versions 1 and 2 leave it at 0, 3 reaches it, 4 and 5
    do not, 6 does; asked again for the version it holds (the launch check's move and restore), it syncs."""
    from common.engines import HFEngine
    from common.serving.weight_sync import SyncEvery

    engine = HFEngine(load_policy(str(SFT)), pad_id=0, eos_ids=[1], device="cpu")
    engine.update_weights(0)
    every = SyncEvery(engine, 3)
    held = []
    for version in range(1, 7):
        every.update_weights(version)
        held.append(every.weight_version)
    assert held == [0, 0, 3, 3, 3, 6]
    synced = []
    engine.update_weights = lambda version: synced.append(version)  # count the calls through to the engine
    every.update_weights(6)
    assert synced == [6]
