"""The optimizer step in the backward pass (``fsdp2.optimizerInBackward``), as torchtune runs Llama-3.1-70B.

One optimizer per trainable sharded parameter, stepped from the parameter's post-accumulate-grad hook, which
FSDP2 calls on the sharded parameter right after its group's reduce-scatter (``foreach_reduce``; under
``CPUOffloadPolicy`` after a synchronous copy to the host); the hook then sets the gradient to None, so each
group's sharded gradient is released once all its parameters have stepped and no full set of gradients
ever exists. There is nothing to clip (the global norm is unknown until every gradient exists) and nothing
to accumulate: the config validation refuses both.

The schedule: one ``LambdaLR`` per optimizer (:class:`PerParameterSchedules`), stepped together once per
optimizer step; they are identical, so a checkpoint holds one state and a resume loads it into all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR


def step_in_backward(
    params: Iterable[torch.nn.Parameter], make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
) -> tuple[torch.optim.Optimizer, ...]:
    """One optimizer per parameter, each stepped (and the gradient freed) by that parameter's hook."""
    optimizers = []
    for param in params:
        optimizer = make_optimizer([param])

        def step(_: torch.Tensor, optimizer: torch.optim.Optimizer = optimizer) -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        param.register_post_accumulate_grad_hook(step)  # type: ignore[no-untyped-call]  # unannotated in torch
        optimizers.append(optimizer)
    return tuple(optimizers)


class PerParameterSchedules:
    """The surface of one ``LambdaLR`` the loop and the engine use, over one per per-parameter optimizer."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer], schedule: Callable[[int], float]) -> None:
        self.schedulers = [LambdaLR(optimizer, schedule) for optimizer in optimizers]

    @property
    def last_epoch(self) -> int:
        return self.schedulers[0].last_epoch

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> list[float | torch.Tensor]:
        return self.schedulers[0].get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        """The first schedule's state: all of them are the same."""
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for scheduler in self.schedulers:
            scheduler.load_state_dict(state)
