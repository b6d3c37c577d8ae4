"""Learning-rate schedules and the clipped step that refuses a non-finite gradient."""

import math

import pytest
import torch

from fsdptrain.config.base import defaults, to_typed
from fsdptrain.config.sft import SFTOptimConfig
from fsdptrain.optim import build_optimizer, clipped_step, lr_factor

from checks.verl_reference import load_verl


def optim_config(**overrides) -> SFTOptimConfig:
    base = defaults("sft_trainer").optim
    base.update(overrides)
    return to_typed(base, SFTOptimConfig)


def factors(config, total=100):
    return [lr_factor(step, config, total) for step in range(total)]


def test_warmup_then_cosine_to_the_floor():
    f = factors(optim_config(lr_warmup_steps=10, min_lr_ratio=0.1))
    assert f[:10] == pytest.approx([i / 10 for i in range(10)])
    assert f[10] == pytest.approx(1.0)
    assert f[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in zip(f[10:], f[11:])) and f[-1] > 0.1


def test_wsd_is_flat_then_decays_over_its_last_fraction():
    f = factors(optim_config(lr_scheduler="wsd", lr_warmup_steps_ratio=0.05, wsd_decay_ratio=0.2, min_lr_ratio=0.0))
    assert f[4] < 1 and f[5:80] == [1.0] * 75
    assert f[80] == pytest.approx(1.0) and f[90] == pytest.approx(0.5) and f[99] == pytest.approx(0.05)


@pytest.mark.parametrize("warmup_steps, ratio", [(10, 0.0), (None, 0.1), (0, 0.1), (-1, 0.05), (0, 0.0)])
@pytest.mark.parametrize("scheduler, min_lr_ratio", [("constant", 0.0), ("cosine", 0.0), ("cosine", 0.1)])
def test_schedules_equal_verls(warmup_steps, ratio, scheduler, min_lr_ratio):
    """verl 0.9's own schedules (its FSDP engine's: lr_warmup_steps where positive, else the ratio; a warm-up from
    lr 0) step for step, from the verl wheel's torch_functional."""
    verl = load_verl("verl.utils.torch_functional")
    if verl is None:
        pytest.skip("verl 0.9.1's wheel is not unpacked (scripts/setup.sh test)")
    config = optim_config(lr_scheduler=scheduler, lr_warmup_steps=warmup_steps, lr_warmup_steps_ratio=ratio, min_lr_ratio=min_lr_ratio)
    total = 100
    warmup = warmup_steps if warmup_steps and warmup_steps > 0 else int(ratio * total)  # verl's engine's rule, as written there
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    if scheduler == "constant":
        schedule = verl.get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
    else:
        schedule = verl.get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=warmup, num_training_steps=total, min_lr_ratio=min_lr_ratio)
    theirs = []
    for _ in range(total):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert factors(config, total) == pytest.approx(theirs, abs=1e-12)


def test_constant_after_warmup():
    assert factors(optim_config(lr_scheduler="constant", lr_warmup_steps=2))[2:] == [1.0] * 98


def test_non_finite_gradient_skips_the_update():
    model = torch.nn.Linear(3, 1)
    optimizer = build_optimizer(model, optim_config(lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.tensor([[1.0, float("inf"), 0.0]])).sum().backward()
    norm, applied = clipped_step(model, optimizer, max_norm=1.0)
    assert not applied and not math.isfinite(norm)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model(torch.ones(1, 3)).sum().backward()
    norm, applied = clipped_step(model, optimizer, max_norm=1.0)
    assert applied and math.isfinite(norm)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
