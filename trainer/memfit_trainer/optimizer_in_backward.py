"""The optimizer step in the backward pass (``optimizerInBackward``), as torchtune runs Llama-3.1-70B on FSDP
and its single-GPU full fine-tunes.

One optimizer per trainable parameter, stepped from the parameter's post-accumulate-grad hook. FSDP2 calls
it on the sharded parameter right after its group's reduce-scatter (``foreach_reduce``; under
``CPUOffloadPolicy`` after a synchronous copy to the host), so each group's sharded gradient is released once
all its parameters have stepped. On DeepSpeed (ZeRO-0, the model's own bf16 weights) autograd calls it when
the whole parameter's gradient is made: the hook first all-reduces it over the ranks (``reduce``: what
DeepSpeed's own all-reduce after the backward would do, which is turned off) and DeepSpeed is handed
:class:`SteppedInBackward`, whose step does nothing. Either way the hook then sets the gradient to None, and
no full set of gradients ever exists. There is nothing to clip (the global norm is unknown until every
gradient exists) and nothing to accumulate: the config validation refuses both.

The schedule: one ``LambdaLR`` per optimizer (:class:`PerParameterSchedules`), stepped together once per
optimizer step; they are identical, so a checkpoint holds one state and a resume loads it into all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR


def step_in_backward(
    params: Iterable[torch.nn.Parameter],
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    reduce: Callable[[torch.Tensor], None] | None = None,
) -> tuple[torch.optim.Optimizer, ...]:
    """One optimizer per parameter, each stepped (and the gradient freed) by that parameter's hook, after
    ``reduce`` of its gradient where given."""
    optimizers = []
    for param in params:
        optimizer = make_optimizer([param])

        def step(param: torch.Tensor, optimizer: torch.optim.Optimizer = optimizer) -> None:
            if reduce is not None:
                assert param.grad is not None  # the hook runs once the gradient is accumulated
                reduce(param.grad)
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


class SteppedInBackward(torch.optim.Optimizer):
    """The per-parameter optimizers as the one optimizer DeepSpeed drives: one parameter group over all the
    parameters, whose rate DeepSpeed's schedule sets and each of them steps with; its state dict is one
    optimizer's; its step and zero_grad do nothing, the hooks having done both."""

    def __init__(self, optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
        params = [param for optimizer in optimizers for group in optimizer.param_groups for param in group["params"]]
        settings = {key: value for key, value in optimizers[0].param_groups[0].items() if key != "params"}
        super().__init__(params, defaults=settings)
        self.optimizers = optimizers
        for optimizer in optimizers:
            optimizer.register_step_pre_hook(self._at_our_rate)

    def _at_our_rate(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            group["lr"] = self.param_groups[0]["lr"]

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Nothing: each parameter stepped in the backward pass."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: each gradient was freed once its parameter stepped."""

    def state_dict(self) -> dict[str, Any]:
        """One optimizer's state dict over all the parameters (their states by index, one group): what the
        same optimizer stepped after the backward saves, so that a re-plan that turns the step in backward on
        or off resumes from the other's checkpoint, the schedule's included."""
        each = [optimizer.state_dict() for optimizer in self.optimizers]
        group = {**self.param_groups[0], "params": list(range(len(each)))}
        return {"state": {i: saved["state"][0] for i, saved in enumerate(each) if 0 in saved["state"]},
                "param_groups": [group]}  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        (group,) = state_dict["param_groups"]
        states = state_dict["state"]
        for index, optimizer in enumerate(self.optimizers):
            state = {0: states[index]} if index in states else {}
            optimizer.load_state_dict({"state": state, "param_groups": [{**group, "params": [0]}]})
        self.param_groups[0].update({key: value for key, value in group.items() if key != "params"})


def all_reduce_mean(gradient: torch.Tensor) -> None:
    """The gradient averaged over the ranks, in place (what data parallelism's all-reduce makes of it)."""
    import torch.distributed as dist

    dist.all_reduce(gradient)
    gradient.div_(dist.get_world_size())
