"""Tiled MLP (``training.tiled_mlp``): each decoder MLP runs a tile of tokens at a time, recomputed in backward.

At long sequences a decoder layer's largest activations are its MLP's intermediate-size tensors (the gate and
up projections, the activation and their product: about 4 x t x i values for t tokens). :class:`TiledMlp` runs
the MLP's own forward on one tile of about ``hidden_size`` tokens at a time under ``no_grad`` and saves only
its input; its backward recomputes each tile with grad and back-propagates it at once, so the
intermediate-size tensors and their gradients exist for one tile at a time. Cost: one more MLP forward per
token than untiled, with or without gradient checkpointing (whose recomputation runs the tiled forward again,
as it runs the untiled one).

The tiles are cut from the flattened tokens (batch x sequence), the same in forward and backward, and the
count is ``ceil(tokens / hidden_size)`` (ALST's rule, :func:`mlp_tile_tokens`). memfit's blocks have a fixed
shape, so every rank cuts the same tiles and runs the same module calls (ZeRO-3 gathers a module's weights per
call): no all-reduce of the count is needed.

This is DeepSpeed's ``TiledMLP`` (``deepspeed.runtime.sequence_parallel.ulysses_sp``) with three changes that
make it exact for memfit: its forward chunks the sequence of each row while its backward chunks the flattened
tokens, so with a micro-batch above one the recomputed tiles are not the forward's; it does not replay the
random state, so LoRA dropout would draw other masks in the recomputation than in the forward (a gradient of
another function); and it concatenates the tiles' outputs (two outputs alive at once). Here each tile's random
state (CPU and accelerator) is recorded before its forward and replayed for its recomputation, the global
random state left as it was.

Gradients: the parameters' gradients accumulate over the tiles in their ``.grad``. DeepSpeed's ZeRO reduces a
parameter when its gradient is accumulated, once per backward; its ``ds_grad_is_ready`` attribute (read by
ZeRO-1/2, ZeRO-3 and the bf16 optimizer's hooks) is False for every tile but the last, so it reduces the sum
once. FSDP2 reduce-scatters a layer's gradients in its post-backward, after the layer's whole backward (this
nested backward included); the attribute means nothing to it.

Which modules: the dense MLPs of the text decoder, found by their projections (``gate_proj``/``up_proj``/
``down_proj`` of Llama, Mistral, Qwen2, Gemma 2; Phi-3's fused ``gate_up_proj``; ``fc1``/``fc2`` of plain
MLPs), whatever their activation, since the module's own forward runs on each tile. Mixture-of-experts blocks
(a module with ``experts``) and everything in them are left as they are: their router is not token by token
(its auxiliary load-balancing loss sees the whole sequence), each expert sees a data-dependent number of
tokens, so ranks would cut different tiles, and ``transformers`` 5 fuses the experts into 3-D parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

from memfit.contract.reader import ConfigError
from memfit.memory.activations import mlp_tile_tokens  # the memory model counts the same tiles
from memfit_trainer.chunked_loss import text_decoder, unwrap_causal_lm
from memfit_trainer.run import Run
from memfit_trainer.technique import Installed

MLP_PROJECTIONS = (("gate_proj", "up_proj", "down_proj"), ("gate_up_proj", "down_proj"), ("fc1", "fc2"))
"""The child modules that make a module a dense MLP (any one of these sets)."""
MOE_MARK = "experts"
"""A mixture-of-experts block holds its experts under this name; it and its submodules are not tiled."""
DS_GRAD_IS_READY = "ds_grad_is_ready"
"""DeepSpeed's flag: False while a parameter's gradient is still being accumulated over tiles."""

MlpForward = Callable[[torch.Tensor], torch.Tensor]
RandomState = tuple[torch.Tensor, list[int], list[torch.Tensor]]
"""The CPU generator's state, and the accelerator devices' ids and states (``torch.utils.checkpoint``'s)."""


def _random_state(x: torch.Tensor) -> RandomState:
    devices, states = get_device_states(x)
    return torch.get_rng_state(), devices, states


@contextmanager
def _replaying(state: RandomState, device_type: str) -> Iterator[None]:
    """Run under ``state``, then give the global random state back (the backward draws nothing of its own)."""
    cpu, devices, states = state
    with torch.random.fork_rng(devices=devices, device_type=device_type):
        torch.set_rng_state(cpu)
        set_device_states(devices, states, device_type=device_type)
        yield


def _mark_ready(params: list[torch.Tensor], ready: bool) -> None:
    for param in params:
        setattr(param, DS_GRAD_IS_READY, ready)


class TiledMlp(torch.autograd.Function):
    """``forward(x)`` of a token-wise module, computed ``tile`` flattened tokens at a time without a graph and
    recomputed tile by tile in backward; ``module`` is the one whose trainable parameters receive gradients."""

    @staticmethod
    def forward(ctx: Any, forward: MlpForward, module: torch.nn.Module, x: torch.Tensor, tile: int) -> torch.Tensor:
        # Detached: inside a Function's forward, views of ``x`` keep requires_grad without a grad_fn, which
        # module hooks that watch autograd (MemTracker's) refuse.
        flat = x.detach().reshape(-1, x.shape[-1])
        states, out = [], None
        with torch.no_grad():
            for start in range(0, flat.shape[0], tile):
                states.append(_random_state(x))
                part = forward(flat[start : start + tile])
                if out is None:
                    out = part.new_empty((flat.shape[0], part.shape[-1]))
                out[start : start + part.shape[0]] = part
                del part
        assert out is not None, "an MLP input without tokens"
        ctx.save_for_backward(x)
        ctx.forward, ctx.module, ctx.tile, ctx.states = forward, module, tile, states
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        flat = x.detach().reshape(-1, x.shape[-1])
        grad_out = grad_outputs[0].reshape(-1, grad_outputs[0].shape[-1])
        needs_input = ctx.needs_input_grad[2]
        grad_x = torch.empty_like(flat) if needs_input else None
        params = [p for p in ctx.module.parameters() if p.requires_grad]
        starts = range(0, flat.shape[0], ctx.tile)
        for index, start in enumerate(starts):
            _mark_ready(params, index == len(starts) - 1)
            part = flat[start : start + ctx.tile].detach().requires_grad_(needs_input)
            with torch.enable_grad(), _replaying(ctx.states[index], x.device.type):
                output = ctx.forward(part)
            torch.autograd.backward(output, grad_out[start : start + part.shape[0]])
            del output
            if grad_x is not None:
                assert part.grad is not None
                grad_x[start : start + part.shape[0]] = part.grad
        return None, None, None if grad_x is None else grad_x.view_as(x), None


def dense_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The dense MLPs of ``model``'s text decoder (see the module docstring), in model order."""
    decoder = text_decoder(unwrap_causal_lm(model))
    moe = [name for name, module in decoder.named_modules() if hasattr(module, MOE_MARK)]
    return [
        module
        for name, module in decoder.named_modules()
        if any(all(hasattr(module, child) for child in names) for names in MLP_PROJECTIONS)
        and not any(name == block or name.startswith(f"{block}.") for block in moe)
    ]


def tile_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Make every dense MLP of ``model`` run tiled: its own forward, tile by tile (:class:`TiledMlp`); the MLPs.
    Per instance, so hooks on the module calls (ZeRO-3's gathers, checkpointing) are untouched."""
    mlps = dense_mlps(model)
    for mlp in mlps:
        mlp.forward = _tiled(mlp, mlp.forward)
    return mlps


def _tiled(module: torch.nn.Module, forward: MlpForward) -> MlpForward:
    def tiled_forward(x: torch.Tensor) -> torch.Tensor:
        tile = mlp_tile_tokens(x.numel() // x.shape[-1], x.shape[-1])
        result: torch.Tensor = TiledMlp.apply(forward, module, x, tile)  # type: ignore[no-untyped-call]
        return result

    return tiled_forward


def install(run: Run) -> Installed | None:
    """With ``training.tiled_mlp``, every dense decoder MLP of the run's model tiled; said with their count."""
    if not run.config.training.tiled_mlp:
        return None
    model = run.engine.module
    mlps = tile_mlps(model)
    if not mlps:
        raise ConfigError("training.tiledMlp tiles dense decoder MLPs, and this model has none")
    width = unwrap_causal_lm(model).config.get_text_config().hidden_size
    return Installed(
        said=f"tiled MLP: {len(mlps)} decoder MLPs run tiles of at most {width} tokens, recomputed in backward"
    )
