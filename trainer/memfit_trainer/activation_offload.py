"""Activation offloading (``training.activation_offloading``): checkpointed layers' inputs wait in host memory.

Under gradient checkpointing each decoder layer keeps only its input for the backward pass (t x h values,
recomputing the rest), so at long sequences those inputs are what is left of the activations, layers x t x h.
:class:`ActivationOffload` moves them to host memory: it wraps each checkpointed layer's checkpoint call
(``GradientCheckpointingLayer._gradient_checkpointing_func``, which is ``torch.utils.checkpoint`` without
reentrance) in :func:`torch.autograd.graph.saved_tensors_hooks`. Non-reentrant checkpointing saves the
region's inputs *before* it enters its own saved-tensor hooks, so these hooks see exactly the layer's
input (its keyword arguments, the shared rotary tables and mask, are not saved), and nothing inside the
layer: that is what makes the memory model exact (``memfit.memory.activations``).

The schedule, the same on every device, is what the memory model counts:

* forward: the input is copied to the host when the layer starts; the device copy is let go when the layer's
  call returns (the layer reads it until then anyway);
* backward: the layer's recomputation asks for its input, which comes back to the device (already there when
  it was prefetched), and the input of the layer before it, the next one backward needs, starts coming back.
  So one layer's input waits on the device beside the layer being back-propagated; the returned input itself
  is freed once the recomputation has run. The first offloaded input is not prefetched: the first layers'
  backward holds nearly every gradient (when they do not persist), and a prefetch there would add an input
  to that peak; its copy back is the one that does not overlap.

A leaf that requires grad stays where it is (with LoRA, the frozen embedding's output is made one so that
gradients reach the checkpointed layers): autograd keeps a saved leaf alive through its gradient accumulator,
so a copy would only cost.

On CUDA the host copies are pinned and both directions run on a side stream: the copy out overlaps the
layer's forward (the compute stream waits for it before the input's memory can be reused), the prefetch
overlaps the layer's backward (the compute stream waits for it where the input is used). Elsewhere the
copies are plain synchronous copies to a separate host tensor, so CPU runs and tests take the same path.
The trace of ``calibration.memtrace`` copies to the ``meta`` device instead, so that the traced device
loses the bytes as a GPU does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memfit.contract.reader import ConfigError
from memfit_trainer.run import Run
from memfit_trainer.technique import Installed

CHECKPOINT_FUNCTION = "_gradient_checkpointing_func"
"""The attribute through which a ``GradientCheckpointingLayer`` calls ``torch.utils.checkpoint``."""
MIN_OFFLOAD_BYTES = 1024
"""Smaller inputs (and non-floating ones) stay where they are: a copy would cost more than it saves."""


@dataclass
class OffloadStats:
    """Counters since the offloader was installed (tests and the log read them)."""

    packed: int = 0
    """Tensors the checkpointed layers saved (one per layer and forward pass)."""
    offloaded: int = 0
    """Of those, the ones copied to the host."""
    offloaded_bytes: int = 0
    fetched: int = 0
    """Host copies brought back for the backward pass."""
    prefetched: int = 0
    """Of those, the ones whose copy back started one layer ahead."""


class _Saved:
    """One checkpointed layer's saved input: a host copy (or the tensor itself, when it stays)."""

    __slots__ = ("__weakref__", "device", "event", "first", "host", "kept", "prefetched", "previous")

    def __init__(self) -> None:
        self.kept: torch.Tensor | None = None
        self.host: torch.Tensor | None = None
        self.device = torch.device("cpu")
        self.previous: weakref.ref[_Saved] | None = None
        """The input saved just before this one: the next that backward needs after this one."""
        self.first = False
        """The first input this forward pass offloaded (the last one backward needs)."""
        self.prefetched: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None
        """Marks the end of the prefetch's copy on the side stream (CUDA)."""


class ActivationOffload:
    """Installs the offloading on every checkpointed decoder layer of ``model``; :meth:`remove` undoes it.

    ``host`` is where the copies go: the CPU (pinned where the layers run on CUDA), or ``meta`` for a trace
    that must see the bytes leave its device.
    """

    def __init__(self, model: torch.nn.Module, host: torch.device | str = "cpu") -> None:
        from transformers.modeling_layers import GradientCheckpointingLayer

        self.host = torch.device(host)
        self.stats = OffloadStats()
        self._last: weakref.ref[_Saved] | None = None
        """The input saved last (weakly: a finished step's inputs must be freed with its graph)."""
        self._in_flight: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.layers = [
            m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
        ]
        if not self.layers:
            raise ConfigError(
                "training.activationOffloading moves the inputs of checkpointed decoder layers, and this model has "
                "none (gradient checkpointing off, or an architecture without transformers' GradientCheckpointingLayer)"
            )
        self._originals: list[tuple[torch.nn.Module, Callable[..., Any]]] = []
        for layer in self.layers:
            original: Callable[..., Any] = getattr(layer, CHECKPOINT_FUNCTION)
            self._originals.append((layer, original))
            setattr(layer, CHECKPOINT_FUNCTION, self._wrap(original))

    def describe(self) -> str:
        """One line for the log: what is moved, where to, and how."""
        device = next(self.layers[0].parameters()).device
        how = (
            "pinned host memory, copied on a side CUDA stream, prefetched one layer ahead in backward"
            if self._asynchronous(device)
            else f"{self.host.type} memory (synchronous copies, prefetched one layer ahead in backward)"
        )
        return f"activation offloading: the saved inputs of {len(self.layers)} checkpointed layers wait in {how}"

    def summary(self) -> str:
        """One line for the log at the end: what moved (this process's counts)."""
        s = self.stats
        return (
            f"activation offloading: {s.offloaded} layer inputs ({s.offloaded_bytes / 2**20:.1f} MiB) went to "
            f"{self.host.type} memory and came back {s.fetched} times ({s.prefetched} prefetched)"
        )

    def remove(self) -> None:
        """Give the layers their own checkpoint function back."""
        for layer, original in self._originals:
            setattr(layer, CHECKPOINT_FUNCTION, original)
        self._originals.clear()

    def __enter__(self) -> ActivationOffload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _wrap(self, checkpoint: Callable[..., Any]) -> Callable[..., Any]:
        def offloaded_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            try:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    return checkpoint(function, *args, **kwargs)
            finally:
                self._release_in_flight()

        return offloaded_checkpoint

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        return self._side_streams[device]

    def _asynchronous(self, device: torch.device) -> bool:
        return device.type == "cuda" and self.host.type == "cpu"

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        self.stats.packed += 1
        saved = _Saved()
        nbytes = tensor.numel() * tensor.element_size()
        if not tensor.is_floating_point() or nbytes < MIN_OFFLOAD_BYTES or (tensor.is_leaf and tensor.requires_grad):
            # A leaf that requires grad (the first layer's input when the embedding is frozen: LoRA makes its
            # output require grad) stays anyway: saving it keeps its gradient accumulator, which holds it.
            saved.kept = tensor
            return saved
        source = tensor.detach()
        saved.device = tensor.device
        if self._asynchronous(tensor.device):
            saved.host = torch.empty_like(source, device=self.host, pin_memory=True)
            compute, side = torch.cuda.current_stream(tensor.device), self._side_stream(tensor.device)
            side.wait_stream(compute)  # the input is complete
            with torch.cuda.stream(side):
                saved.host.copy_(source, non_blocking=True)
            # The input's memory must outlive the copy: kept until the layer's call returns.
            self._in_flight.append((source, side.record_event()))
        else:
            saved.host = torch.empty_like(source, device=self.host)
            saved.host.copy_(source)
        saved.previous = self._last
        saved.first = self._last is None or self._last() is None  # the last step's inputs died with its graph
        self._last = weakref.ref(saved)
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += nbytes
        return saved

    def _release_in_flight(self) -> None:
        """The compute stream waits for the copies out (a no-op once they are done), then the inputs' memory
        may be reused."""
        for tensor, event in self._in_flight:
            torch.cuda.current_stream(tensor.device).wait_event(event)
        self._in_flight.clear()

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        if saved.kept is not None:
            return saved.kept
        if saved.prefetched is not None:
            tensor, event = saved.prefetched, saved.event
            saved.prefetched = saved.event = None
            if event is not None:
                torch.cuda.current_stream(tensor.device).wait_event(event)
            self.stats.prefetched += 1
        else:
            tensor = self._copy_back(saved)
        self.stats.fetched += 1
        previous = saved.previous() if saved.previous is not None else None
        if previous is not None and previous.host is not None and previous.prefetched is None and not previous.first:
            self._prefetch(previous)
        return tensor

    def _copy_back(self, saved: _Saved) -> torch.Tensor:
        """The input back on its device, on the compute stream (its consumer is about to run)."""
        assert saved.host is not None
        return saved.host.to(saved.device, non_blocking=self._asynchronous(saved.device), copy=True)

    def _prefetch(self, saved: _Saved) -> None:
        """Start bringing ``saved`` back: allocated now (on the compute stream, which frees it later), copied
        on the side stream after everything queued so far, waited for where it is used."""
        assert saved.host is not None
        tensor = torch.empty_like(saved.host, device=saved.device)
        if self._asynchronous(saved.device):
            compute, side = torch.cuda.current_stream(saved.device), self._side_stream(saved.device)
            side.wait_stream(compute)  # the memory may have been in use until now
            with torch.cuda.stream(side):
                tensor.copy_(saved.host, non_blocking=True)
            saved.event = side.record_event()
        else:
            tensor.copy_(saved.host)
        saved.prefetched = tensor


def offload_activations(model: torch.nn.Module, host: torch.device | str = "cpu") -> ActivationOffload:
    """Install activation offloading on ``model``'s checkpointed layers (see :class:`ActivationOffload`)."""
    return ActivationOffload(model, host)


def install(run: Run) -> Installed | None:
    """With ``training.activation_offloading``, the technique on the run's model (the config refuses it without
    gradient checkpointing); what moved is said at the end."""
    if not run.config.training.activation_offloading:
        return None
    offload = offload_activations(run.engine.module)
    return Installed(said=offload.describe(), summary=offload.summary)
