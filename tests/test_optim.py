"""Learning-rate schedules and the clipped step that refuses a non-finite gradient."""

import math

import pytest
import torch

from fsdptrain.config.base import defaults, to_typed
from fsdptrain.config.sft import SFTOptimConfig
from fsdptrain.optim import build_optimizer, clipped_step, lr_factor


def optim_config(**overrides) -> SFTOptimConfig:
    base = defaults("sft_trainer").optim
    base.update(overrides)
    return to_typed(base, SFTOptimConfig)


def factors(config, total=100):
    return [lr_factor(step, config, total) for step in range(total)]


def test_warmup_then_cosine_to_the_floor():
    f = factors(optim_config(lr_warmup_steps=10, min_lr_ratio=0.1))
    assert f[:10] == pytest.approx([(i + 1) / 11 for i in range(10)])
    assert f[10] == pytest.approx(1.0)
    assert f[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in zip(f[10:], f[11:])) and f[-1] > 0.1


def test_wsd_is_flat_then_decays_over_its_last_fraction():
    f = factors(optim_config(lr_scheduler="wsd", lr_warmup_steps_ratio=0.05, wsd_decay_ratio=0.2, min_lr_ratio=0.0))
    assert f[4] < 1 and f[5:80] == [1.0] * 75
    assert f[80] == pytest.approx(1.0) and f[90] == pytest.approx(0.5) and f[99] == pytest.approx(0.05)


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
