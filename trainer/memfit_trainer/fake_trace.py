"""Count the bytes of a training step that runs on fake tensors: PyTorch's MemTracker under FakeTensorMode.

Shared by the trainer's activation profiler (``memfit_trainer.activation_profile``) and the development-only
calibration traces (``calibration.memtrace``), which import these mechanics from here: the shipped trainer
package never imports ``calibration``. Tensors carry shapes and dtypes but no storage, so a step of a model
at real widths costs seconds on a CPU; the choices below make the fake CPU run keep what a GPU run keeps
(see ``calibration.memtrace`` for what still differs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

CausalMask = Literal["implicit", "explicit"]

CATEGORIES: tuple[str, ...] = ("PARAM", "BUFFER", "GRAD", "ACT", "TEMP", "OPT", "OTH")
"""MemTracker's categories by enum member name (``OTH`` holds externally tracked inputs)."""
HOST = torch.device("meta")
"""Where offloaded activations go in a trace: bytes there are host memory, not in the traced device's total."""

STATE_CATEGORIES = ("PARAM", "BUFFER", "GRAD", "OPT")


class PhaseMemTracker(MemTracker):  # type: ignore[no-untyped-call]  # torch's __init_subclass__ is unannotated
    """MemTracker with one peak per phase of a step, and gradients labelled GRAD from their allocation.

    ``MemTracker`` keeps one peak per context, copied when the total peaks (a breakdown *at* the peak,
    not per-category maxima), reset only on ``__enter__``; re-entering to restart it would drop the
    gradient hooks. It also labels a parameter's fresh gradient TEMP until the gradient hook runs, so a
    peak that coincides with, say, the LM head's weight gradient shows it as a temporary. This subclass
    records the breakdown after every op instead, with the live TEMP storages, and relabels at the end
    of a phase those that became gradients. It overrides two private methods of this private torch tool:
    ``_update_snap`` (to know live TEMP storages) and ``_update_peak_stats`` (module-level peaks, unused
    here, cost a loop over all modules per op).
    """

    supports_higher_order_operators = True
    """Higher-order operators (flex attention's) pass through ``__torch_dispatch__``, which runs them below this
    mode and tracks what they return, as for any op."""

    def __init__(self) -> None:
        super().__init__()
        self._live_temp: dict[int, Any] = {}
        self._records: list[tuple[dict[str, int], tuple[Any, ...]]] = []

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True) -> Any:
        # MemTracker registers a gradient hook on every parameter, which raises for frozen ones (LoRA's
        # base weights); a placeholder handle makes it skip them.
        for param in module.parameters():
            if not param.requires_grad:
                handles = (_NoHook(), _NoHook())
                # (WeakIdKeyDictionary's methods are unannotated in torch.)
                self._param_to_grad_hook_handles.setdefault(param, handles)  # type: ignore[no-untyped-call]
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _update_snap(self, u_type: Any, winfo: Any, *args: Any, **kwargs: Any) -> None:
        super()._update_snap(u_type, winfo, *args, **kwargs)
        if winfo.reftype is _MemRefType.TEMP and u_type.name in ("ADD", "REF"):
            self._live_temp[id(winfo)] = winfo
        elif u_type.name in ("DEL", "REF"):
            self._live_temp.pop(id(winfo), None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # A fake tensor's device, which autograd asks of every gradient and matmul input (most of a trace's
        # dispatches): it allocates nothing, and MemTracker would record a moment, a copy of the state, for it.
        if func is torch.ops.prim.device.default:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[no-untyped-call]  # torch's

    def _update_peak_stats(self, peak_state: Any) -> None:
        self._records.append((categories_of(self._curr_mem_snap), tuple(self._live_temp.values())))

    def moment_count(self) -> int:
        """How many moments (one after each op) are recorded since the last phase summary: a mark to slice
        :meth:`moments` with."""
        return len(self._records)

    def moments(self) -> list[dict[str, int]]:
        """Every recorded moment's breakdown, fresh gradients relabelled GRAD, without restarting."""
        return [relabel_gradients(categories, temps) for categories, temps in self._records]

    def phase_summary(self) -> dict[str, dict[str, int]]:
        """Breakdowns at the phase's peak, at its end, at its peak of non-state memory and at its peak of
        host memory (offloaded activations); then restart."""
        self._update_peak_stats(None)
        moments = [relabel_gradients(categories, temps) for categories, temps in self._records]
        self._records.clear()
        self._update_peak_stats(None)
        return {
            "peak": max(moments, key=lambda c: c["total"]),
            "end": moments[-1],
            "transient_peak": max(moments, key=transient),
            "host_peak": max(moments, key=lambda c: c["HOST"]),
        }


class _NoHook:
    """Stands for the gradient-hook handle a frozen parameter cannot have."""

    def remove(self) -> None:
        """Nothing was registered."""


def relabel_gradients(categories: dict[str, int], live_temp: tuple[Any, ...]) -> dict[str, int]:
    """Move the bytes of TEMP storages that later became parameter gradients from TEMP to GRAD."""
    fresh = sum(w.mem_consumed for w in live_temp if w.reftype is _MemRefType.GRAD)
    return {**categories, "TEMP": categories["TEMP"] - fresh, "GRAD": categories["GRAD"] + fresh}


def categories_of(snapshot: dict[torch.device, dict[Any, int]]) -> dict[str, int]:
    """Flatten a MemTracker snapshot into ``{category name: bytes, "total": bytes}`` of the traced device,
    with ``HOST``: the bytes offloaded to :data:`HOST` (in no category and not in the total)."""
    out = dict.fromkeys((*CATEGORIES, "total", "HOST"), 0)
    for device, dev_snap in snapshot.items():
        for key, value in dev_snap.items():
            if device == HOST:
                out["HOST"] += 0 if isinstance(key, _MemRefType) else value
                continue
            out[key.name if isinstance(key, _MemRefType) else "total"] += value
    return out


def transient(categories: dict[str, int]) -> int:
    """Bytes that are not model state: activations, backward temporaries and untracked extras."""
    return categories.get("total", 0) - sum(categories.get(c, 0) for c in STATE_CATEGORIES)


@contextlib.contextmanager
def real_run_mask_decisions(causal_mask: CausalMask) -> Iterator[None]:
    """Make ``transformers`` choose the attention mask a real run of unpacked sequences would choose.

    To detect packed sequences ``transformers`` reads the values of ``position_ids``; it cannot read fake
    tensors, so it assumes packing and builds an explicit ``(b, 1, s, s)`` mask. That also disables SDPA's
    ``is_causal`` path and native GQA (keys and values get repeated to all heads). Real unpadded batches
    with ``arange`` positions are not packed, so ``implicit`` answers "not packed" as a real run would;
    ``explicit`` keeps the mask, as for padded batches.
    """
    if causal_mask == "explicit":
        yield
        return
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def cuda_like_dropout() -> Iterator[None]:
    """Make training-mode dropout save what it saves on a GPU: a bool mask, not a mask of the input dtype.

    ``aten::dropout`` takes the fused ``native_dropout`` kernel only for CUDA inputs; on CPU it multiplies
    by a noise tensor of the input's dtype, which autograd saves (2-4 bytes per element instead of 1).
    peft's ``lora_dropout`` (0.05 in memfit's API) runs once per adapted module, so this matters.
    """
    original = torch.nn.functional.dropout

    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if training and 0 < p < 1 and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    torch.nn.functional.dropout = dropout
    try:
        yield
    finally:
        torch.nn.functional.dropout = original


@contextlib.contextmanager
def fake_run(causal_mask: CausalMask) -> Iterator[FakeTensorMode]:
    """Fake tensors on the CPU device, with the mask and dropout choices of a real GPU run."""
    with FakeTensorMode() as mode, real_run_mask_decisions(causal_mask), cuda_like_dropout():
        yield mode


def fake_weights(model: torch.nn.Module) -> None:
    """Replace meta parameters and buffers by fake CPU ones in place (call under ``FakeTensorMode``).

    Tied weights stay tied: each distinct tensor is replaced once.
    """
    replaced: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in replaced:
            empty = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            replaced[id(t)] = torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty
        return replaced[id(t)]

    for module in model.modules():
        registries: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for registry in registries:
            for name, tensor in registry.items():
                if tensor is not None:
                    registry[name] = fake(tensor)
