"""bitsandbytes' 8-bit AdamW (plain and paged) on FSDP2's sharded parameters, as one optimizer or one per
parameter stepped in the backward pass.

bitsandbytes' kernels take plain tensors, and FSDP2's sharded parameters and gradients are DTensors. So each
step runs the kernel on the parameter's local shard (``to_local``: the same storage), and bitsandbytes keeps
its states for that shard: ``state1`` and ``state2`` shaped like it (8-bit codes, or fp32 under
``min_8bit_size``) and one fp32 ``absmax`` per 256-element block of it. Whether a parameter gets 8-bit
states is decided by its padded shard (``ceil(rows / ranks)`` rows, the same on every rank), so that every
rank keeps the same kinds of state for it.

``torch.distributed.checkpoint`` saves a DTensor's shards at their global offsets and a plain tensor once,
so the state dict hands it DTensors: the states with the parameter's own placement, each absmax padded to
the padded shard's block count and laid end to end, one piece per rank. The quantization blocks are this
world size's shards: the states reload exactly into the same world size, and a checkpoint written at
another is refused with the reason (:func:`check_quantized_for`).

The optimizer classes themselves are in ``memfit_trainer.sharded_adamw8bit``: importing bitsandbytes sets up
torch.compile (1.4-1.7 s of CPU per process, measured), which a run without an 8-bit optimizer need not pay.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from memfit.contract.reader import ConfigError

BLOCK = 256
"""bitsandbytes' blockwise quantization: one absmax per 256 elements (``Optimizer2State.init_state``)."""
SHARD_SHAPED = ("state1", "state2")
PER_BLOCK = ("absmax1", "absmax2")
QUANTIZED_FOR = "quantized_for_world_size"
"""The checkpoint entry saying at which world size the 8-bit states were quantized."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _ranks(param: torch.Tensor) -> int:
    return param.device_mesh.size() if isinstance(param, DTensor) else 1


def padded_shard_numel(param: torch.Tensor) -> int:
    """Elements of the largest local shard (FSDP2 splits dim 0 into chunks of ``ceil(rows / ranks)``)."""
    if param.dim() == 0:
        return 1
    return math.ceil(param.shape[0] / _ranks(param)) * math.prod(param.shape[1:])


def _blocks(numel: int) -> int:
    return math.ceil(numel / BLOCK)


class OnLocalShards:
    """The overrides that run a bitsandbytes 8-bit optimizer on each DTensor parameter's local shard."""

    # What the bitsandbytes base class provides (Optimizer8bit), for mypy.
    state: Any
    param_groups: list[dict[str, Any]]
    _FSDP_WRAPPED_QUANT_STATE_KEY: str

    def get_config(self, gindex: int, pindex: int, group: dict[str, Any]) -> dict[str, Any]:
        """8-bit states for a parameter whose padded shard reaches ``min_8bit_size``, on every rank alike."""
        config: dict[str, Any] = super().get_config(gindex, pindex, group)  # type: ignore[misc]
        eight_bit = padded_shard_numel(self.param_groups[gindex]["params"][pindex]) >= config["min_8bit_size"]
        config["min_8bit_size"] = 0 if eight_bit else sys.maxsize
        return config

    def init_state(self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int) -> None:
        local = _local(p)
        super().init_state(group, local, gindex, pindex)  # type: ignore[misc]
        self.state[p] = self.state.pop(local)

    def update_step(self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int) -> None:
        assert p.grad is not None  # bitsandbytes' step skips parameters without a gradient
        local = _local(p)
        local.grad = _local(p.grad)
        self.state[local] = self.state[p]
        try:
            super().update_step(group, local, gindex, pindex)  # type: ignore[misc]
        finally:
            del self.state[local]
            local.grad = None

    def state_dict(self) -> dict[str, Any]:
        """bitsandbytes' state dict (its quantization tensors nested under one key) with DTensors for DCP."""
        saved: dict[str, Any] = super().state_dict()  # type: ignore[misc]
        for param, quantized in self._quantized_states(saved):
            for key, tensor in quantized.items():
                quantized[key] = _distributed(param, key, tensor)
        return saved

    def load_state_dict(self, state_dict: dict[str, Any], move_to_device: bool = True) -> None:
        for param, quantized in self._quantized_states(state_dict):
            for key, tensor in quantized.items():
                quantized[key] = _shard_local(param, key, tensor)
        super().load_state_dict(state_dict, move_to_device)  # type: ignore[misc]

    def _quantized_states(self, state_dict: dict[str, Any]) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
        """Each parameter with its quantization tensors in ``state_dict``, whose keys name the parameters as
        its ``param_groups`` list them (indices from ``state_dict()``, names from DCP's ``set_state_dict``)."""
        keys = (key for group in state_dict["param_groups"] for key in group["params"])
        params = (param for group in self.param_groups for param in group["params"])
        for key, param in zip(keys, params, strict=True):
            state = state_dict["state"].get(key, {})
            yield param, state.get(self._FSDP_WRAPPED_QUANT_STATE_KEY, {})


def _distributed(param: torch.Tensor, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """A state tensor as DCP must see it: shard-shaped and per-block ones as DTensors, the rest (the
    quantization maps, the same on every rank) as they are."""
    if not isinstance(param, DTensor):
        return tensor
    mesh = param.device_mesh
    if key in SHARD_SHAPED:
        return DTensor.from_local(tensor, mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())  # fmt: skip
    if key in PER_BLOCK:
        blocks = _blocks(padded_shard_numel(param))
        padded = torch.zeros(blocks, dtype=tensor.dtype, device=tensor.device)
        padded[: tensor.numel()] = tensor
        return DTensor.from_local(padded, mesh, [Shard(0)], run_check=False, shape=torch.Size((blocks * mesh.size(),)),
                                  stride=(1,))  # fmt: skip
    return tensor


def _shard_local(param: torch.Tensor, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_distributed`: this rank's piece, an absmax cut to its shard's blocks."""
    local = _local(tensor)
    if key in PER_BLOCK:
        return local[: _blocks(_local(param).numel())].clone()
    return local


def quantized_for(optimizers: tuple[torch.optim.Optimizer, ...]) -> dict[str, int]:
    """The checkpoint entry of 8-bit states on shards: the world size they were quantized at (none else)."""
    sharded = [o for o in optimizers if isinstance(o, OnLocalShards)]
    if not sharded:
        return {}
    params = [p for group in sharded[0].param_groups for p in group["params"]]
    return {QUANTIZED_FOR: _ranks(params[0])} if params else {}


def check_quantized_for(saved: int, here: int) -> None:
    if saved != here:
        raise ConfigError(
            f"the checkpoint's 8-bit optimizer states were quantized in blocks of {saved} rank(s)' shards and do not "
            f"reshard to {here}: resume on {saved} rank(s), or start the run again (a new output path)"
        )
