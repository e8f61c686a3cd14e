"""The optimizer step in backward without torchrun: each parameter's optimizer steps from its hook with only
its own gradient alive (what the memory model counts: one gradient at a time), and the optimizer DeepSpeed
is handed steps nothing itself while its schedule sets every per-parameter optimizer's rate."""

from __future__ import annotations

import torch
from bitsandbytes.optim.adamw import PagedAdamW8bit
from torch.optim.lr_scheduler import LambdaLR

from memfit_trainer.optimizer_in_backward import SteppedInBackward, step_in_backward


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(300, 64), torch.nn.Linear(64, 128), torch.nn.Linear(128, 300))


def test_each_parameter_steps_with_only_its_own_gradient_alive() -> None:
    model = _model()
    params = list(model.parameters())
    alive_at_steps: list[tuple[int, int]] = []

    def make(group: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = PagedAdamW8bit(group, lr=1e-3)
        stepped = group[0]

        def record(*_: object) -> None:
            alive = sum(p.grad.numel() for p in params if p.grad is not None)
            alive_at_steps.append((alive, stepped.numel()))

        optimizer.register_step_pre_hook(record)
        return optimizer

    step_in_backward(params, make)
    before = [p.detach().clone() for p in params]
    tokens = torch.randint(0, 300, (4, 16))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert len(alive_at_steps) == len(params)
    assert all(alive == own for alive, own in alive_at_steps)  # no other gradient exists when one steps
    assert all(p.grad is None for p in params)
    assert all(not torch.equal(p, b) for p, b in zip(params, before, strict=True))


def _rates_stepped_with(model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]) -> set[float]:
    rates: set[float] = set()
    for optimizer in optimizers:
        optimizer.register_step_post_hook(lambda o, *_: rates.update(g["lr"] for g in o.param_groups))
    tokens = torch.randint(0, 300, (2, 8))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    return rates


def test_deepspeeds_schedule_sets_the_rate_each_per_parameter_optimizer_steps_with() -> None:
    """One parameter group, as one optimizer has (its schedule's state then loads either way)."""
    model = _model()
    optimizers = step_in_backward(list(model.parameters()), lambda group: PagedAdamW8bit(group, lr=1e-3))
    facade = SteppedInBackward(optimizers)
    schedule = LambdaLR(facade, lambda step: 0.5 ** (step + 1))
    schedule.step()
    assert len(facade.param_groups) == 1 and _rates_stepped_with(model, optimizers) == {1e-3 * 0.25}
    saved = facade.state_dict()
    assert len(saved["param_groups"]) == 1 and len(saved["state"]) == len(optimizers)
    facade.load_state_dict(saved)
    schedule.step()
    assert _rates_stepped_with(model, optimizers) == {1e-3 * 0.125}
