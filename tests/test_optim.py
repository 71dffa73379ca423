import pytest
import torch

from common.optim import build_optimizer, build_scheduler, lr_factor


def test_warmup_then_constant():
    f = [lr_factor(s, kind="constant", total_steps=10, warmup_steps=4) for s in range(10)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0] and f[4:] == [1.0] * 6


def test_cosine_reaches_min_lr():
    f = [lr_factor(s, kind="cosine", total_steps=11, warmup_steps=1, min_lr_ratio=0.1) for s in range(11)]
    # As in transformers/verl, the decay reaches min_lr one step after the last step.
    assert f[0] == 1.0 and f[-1] > 0.1
    assert lr_factor(11, kind="cosine", total_steps=11, warmup_steps=1, min_lr_ratio=0.1) == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f, f[1:]))
    assert f[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * 0.5)).item()))


def test_wsd_is_stable_then_decays():
    f = [lr_factor(s, kind="wsd", total_steps=100, warmup_steps=0) for s in range(100)]
    assert f[:90] == [1.0] * 90
    assert f[95] < 1.0 and f[99] < f[95]


def test_scheduler_and_no_decay_groups():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, lr=1.0, weight_decay=0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert sum(len(g["params"]) for g in opt.param_groups) == 4
    sched = build_scheduler(opt, kind="constant", total_steps=10, warmup_ratio=0.5)
    assert sched.get_last_lr()[0] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="lr_warmup_steps_ratio"):
        build_scheduler(opt, kind="constant", total_steps=10, warmup_ratio=2)


def test_an_absolute_warmup_count_overrides_the_ratio_as_verls_lr_warmup_steps_does():
    """--lr-warmup-steps 3 (verl's actor.optim.lr_warmup_steps, ROLL's warmup_steps) warms up over 3 steps whatever
    the ratio says; -1 leaves it to the ratio; a count past the run is the run. The verl key and our flag agree."""
    import sys

    from conftest import load_recipe, make_args

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_verl import args_class

    from common.formats.verl import translate
    from common.optim import trainable

    def lrs(**optim):
        args = make_args(load_recipe("grpo").Args, lr=1.0, lr_scheduler="constant", **optim)
        _, optimizer, scheduler = trainable(torch.nn.Linear(2, 2), args.optim, total_steps=10)
        out = []
        for _ in range(6):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out

    assert lrs(lr_warmup_steps=3, lr_warmup_steps_ratio=0.5) == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1])
    assert lrs(lr_warmup_steps_ratio=0.5) == pytest.approx([0.2, 0.4, 0.6, 0.8, 1, 1])
    assert lrs(lr_warmup_steps=50)[-1] == pytest.approx(0.6)
    flags, _ = translate(["actor_rollout_ref.actor.optim.lr_warmup_steps=3"], args_class("grpo"), "grpo", "grpo.py")
    assert flags[flags.index("--lr-warmup-steps") + 1] == "3"


def test_l2_is_an_l2_term_in_the_loss_as_torchs_adam_weight_decay():
    """--l2 c (ROLL's l2): three steps equal torch's Adam with weight_decay c (its gradient + c w) on the weight
    matrices, biases untouched by it; the decoupled --weight-decay stays a different update."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    twin, plain = (torch.nn.Linear(4, 3) for _ in range(2))
    twin.load_state_dict(model.state_dict())
    plain.load_state_dict(model.state_dict())
    ours = build_optimizer(model, 0.1, weight_decay=0.0, l2=0.5)
    adam = torch.optim.Adam([{"params": [twin.weight], "weight_decay": 0.5}, {"params": [twin.bias]}], lr=0.1)
    decoupled = build_optimizer(plain, 0.1, weight_decay=0.5)
    x = torch.randn(8, 4)
    for _ in range(3):
        for net, opt in ((model, ours), (twin, adam), (plain, decoupled)):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
    assert torch.allclose(model.weight, twin.weight, atol=1e-6) and torch.allclose(model.bias, twin.bias, atol=1e-6)
    assert not torch.allclose(model.weight, plain.weight, atol=1e-3)
