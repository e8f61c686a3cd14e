"""Measure the memory of real ``transformers`` training steps without allocating any of it.

The analytic memory model of memfit needs calibration against what PyTorch really keeps alive: which
tensors autograd saves per op, how many logits-sized buffers the loss holds, what a checkpointed layer
costs in backward, when the optimizer's temporaries appear. This module runs the genuine Hugging Face
model, peft adapters and ``torch.optim.AdamW`` under :class:`~torch._subclasses.fake_tensor.FakeTensorMode`
(tensors carry shapes and dtypes, no storage), so a 7B step costs seconds on a laptop CPU, and counts
bytes with PyTorch's own :class:`~torch.distributed._tools.mem_tracker.MemTracker`.

Fake tensors live on the CPU device (autograd on a fake CUDA device needs a CUDA build of PyTorch). Where
the CPU path differs from a GPU run, the trace says so rather than pretending:

* SDPA runs ``_scaled_dot_product_flash_attention_for_cpu``, which saves what CUDA flash attention saves
  (output plus fp32 log-sum-exp) but has no ``dq_accum`` scratch in backward;
* dropout on CPU would keep a mask of the input's dtype; the trace routes it through ``native_dropout``,
  the kernel CUDA uses, which keeps a bool mask (see :func:`_cuda_like_dropout`);
* MemTracker rounds nothing on CPU (the CUDA caching allocator rounds blocks to 512 bytes);
* activation offloading (``memfit_trainer.activation_offload``, the trainer's own hooks) copies to the
  ``meta`` device, the trace's stand-in for host memory: those bytes leave the traced device, as they
  leave a GPU, and are reported apart (``HOST``).

The traced batch is ``plain`` (one unpadded sequence per row, the committed grid's) or the trainer's own
(``memfit_trainer.data.model_inputs``): ``packed`` documents with restarting ``position_ids``, or ``padded``
rows of one document each with an ``attention_mask``; both make ``transformers`` build a ``(b, 1, s, s)`` mask
(flex attention: a ``BlockMask``, traced through torch's reference implementation, see
``calibration.flex_reference``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any, Literal, cast

import numpy as np
import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from calibration.flex_reference import flex_reference_on_cpu
from memfit.api.vocabulary import ATTN_IMPLEMENTATION, Attention, Method, Optimizer, Precision
from memfit.model_shape import ModelShape
from memfit_trainer.activation_offload import offload_activations
from memfit_trainer.blocks import one_per_row, pack
from memfit_trainer.chat import Tokens
from memfit_trainer.chunked_loss import causal_lm_loss, unwrap_causal_lm
from memfit_trainer.data import model_inputs
from memfit_trainer.fake_trace import (
    HOST,
    CausalMask,
    PhaseMemTracker,
    categories_of,
    fake_run,
    fake_weights,
    transient,
)
from memfit_trainer.hf_config import transformers_config

Dtype = Literal[Precision.BF16, Precision.FP32]
TracedAttention = Literal[Attention.SDPA, Attention.EAGER, Attention.FLEX]
Trainable = Literal[Method.FULL, Method.LORA]
OptimizerImpl = Literal["foreach", "for-loop", "fused"]
Batch = Literal["plain", "packed", "padded"]

_TORCH_DTYPES: dict[Precision, torch.dtype] = {Precision.BF16: torch.bfloat16, Precision.FP32: torch.float32}


def lora_settings(trainable: str, rank: int, targets: tuple[str, ...], dropout: float) -> dict[str, Any]:
    """The LoRA part of a trace's settings (none unless it trains LoRA adapters)."""
    lora = trainable == Method.LORA
    return {
        "lora_rank": rank if lora else None,
        "lora_targets": list(targets) if lora else None,
        "lora_dropout": dropout if lora else None,
    }


def _real_batch(batch: Batch, micro_batch: int, seq_len: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """One micro-batch as real tensors (made before the fake run, which cannot read numpy): ``plain`` token
    ids that are their own labels, or the trainer's :func:`~memfit_trainer.data.model_inputs` of documents
    shorter than a row (three quarters of one), ``packed`` or one per row and ``padded``."""
    if batch == "plain":
        ids = torch.randint(0, vocab_size, (micro_batch, seq_len))
        return {"input_ids": ids, "labels": ids}
    length = max(1, 3 * seq_len // 4)
    documents = itertools.repeat(Tokens(torch.randint(0, vocab_size, (length,)).tolist(), [True] * length))
    rows = pack(documents, seq_len) if batch == "packed" else one_per_row(documents, seq_len, pad_id=0)
    return model_inputs(np.stack([next(rows) for _ in range(micro_batch)]), packing=batch == "packed")


def _build_model(
    shape: ModelShape,
    dtype: Dtype,
    attention: TracedAttention,
    gradient_checkpointing: bool,
    trainable: Trainable,
    lora_rank: int,
    lora_targets: tuple[str, ...],
    lora_dropout: float,
) -> torch.nn.Module:
    """The family's causal LM in training mode on the meta device, optionally with LoRA (base frozen).

    Built outside ``FakeTensorMode`` and given fake weights afterwards by :func:`fake_weights`: modules
    created under ``FakeTensorMode`` cannot be moved with ``.to()`` (the fake-tensor converter keeps a weak
    reference to every parameter, which ``swap_tensors`` refuses), and peft moves its adapters to the base
    layer's device and dtype.
    """
    from transformers import AutoModelForCausalLM

    config = transformers_config(shape, use_cache=False)
    with torch.device("meta"):
        # (transformers' from_config is unannotated.)
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, attn_implementation=ATTN_IMPLEMENTATION[attention], dtype=_TORCH_DTYPES[dtype]
        )
        if trainable == Method.LORA:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(
                r=lora_rank,
                lora_alpha=2 * lora_rank,
                lora_dropout=lora_dropout,
                target_modules=sorted(shape.resolve_lora_targets(lora_targets)),
                task_type="CAUSAL_LM",
            )
            model = get_peft_model(model, lora)
    if gradient_checkpointing:
        # ``activation_checkpointing_enable`` is the name from transformers 5.x on; older ones only have this.
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return cast(torch.nn.Module, model)


def _optimizer(params: list[torch.nn.Parameter], impl: OptimizerImpl) -> torch.optim.Optimizer:
    """AdamW as a GPU run gets it: ``foreach`` is PyTorch's default on CUDA (and allocates temporaries)."""
    return torch.optim.AdamW(params, lr=1e-4, foreach=impl == "foreach", fused=True if impl == "fused" else None)


def tracked_training_steps(
    model: torch.nn.Module, opt: torch.optim.Optimizer, forward: Callable[[], torch.Tensor], steps: int
) -> tuple[dict[str, int], dict[str, dict[str, dict[str, int]]]]:
    """Run ``steps`` training steps (forward, backward, optimizer step) and measure the last with MemTracker:
    the memory at its start by category, and per phase (``forward`` with the loss, ``backward``,
    ``optimizer``) the breakdown at its peak and at its end."""
    # (Tensor.backward is unannotated in torch.)
    for _ in range(steps - 1):
        forward().backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad(set_to_none=True)

    tracker = PhaseMemTracker()
    tracker.track_external(model, opt)
    phases: dict[str, dict[str, dict[str, int]]] = {}
    with tracker:
        start = categories_of(tracker.get_tracker_snapshot())
        tracker.phase_summary()
        loss = forward()
        phases["forward"] = tracker.phase_summary()
        loss.backward()  # type: ignore[no-untyped-call]
        del loss
        phases["backward"] = tracker.phase_summary()
        opt.step()
        opt.zero_grad(set_to_none=True)
        phases["optimizer"] = tracker.phase_summary()
    return start, phases


def trace_training_step(
    shape: ModelShape,
    *,
    micro_batch: int,
    seq_len: int,
    dtype: Dtype = Precision.BF16,
    gradient_checkpointing: bool = False,
    attention: TracedAttention = Attention.SDPA,
    optimizer: Literal[Optimizer.ADAMW] = Optimizer.ADAMW,
    optimizer_impl: OptimizerImpl = "foreach",
    trainable: Trainable = Method.FULL,
    lora_rank: int = 16,
    lora_targets: tuple[str, ...] = ("all-linear",),
    lora_dropout: float = 0.05,
    causal_mask: CausalMask | None = None,
    steps: int = 2,
    chunked_loss: bool = False,
    activation_offloading: bool = False,
    batch: Batch = "plain",
) -> dict[str, Any]:
    """Run ``steps`` training steps on fake tensors and measure the last one with MemTracker.

    The model is built directly in ``dtype`` (pure bf16 or fp32 training; AdamW states share the
    parameters' dtype), takes ``labels=input_ids`` so ``transformers`` computes the loss (with
    ``chunked_loss``, the trainer's own ``memfit_trainer.chunked_loss.causal_lm_loss`` does), and only the
    loss outlives the forward call, as in ``Trainer.training_step``. Earlier steps run untracked so the
    measured step starts in steady state: optimizer states exist, gradients were set to ``None``.

    Returns the settings and, in bytes: ``peak_total`` with ``at_peak`` (per-category breakdown at that
    moment), ``peak_phase``, ``activation_bytes`` (``peak_total`` minus parameters, buffers, gradients and
    optimizer states at the peak), and for each phase (``forward`` includes the loss, ``backward``,
    ``optimizer``) its peak breakdown, the breakdown when it ended, and ``transient_peak``: the breakdown
    at the phase's maximum of non-state memory (activations + temporaries), which need not coincide with
    the total's peak because gradients accumulate during backward. With ``activation_offloading`` (which
    needs ``gradient_checkpointing``) the trainer's offload hooks move the checkpointed layers' inputs to
    :data:`HOST`; ``host_peak_bytes`` is the most they held at once.

    ``batch``: plain, or the trainer's packed or padded one (see the module's docstring). ``causal_mask``
    defaults to what a real run of that batch gets: ``implicit`` for plain, ``explicit`` otherwise.
    """
    if optimizer != Optimizer.ADAMW:
        raise ValueError(f"unsupported optimizer {optimizer!r}: only adamw is traced")
    if steps < 1:
        raise ValueError("steps must be at least 1")
    if activation_offloading and not gradient_checkpointing:
        raise ValueError("activation offloading moves checkpointed layers' inputs: it needs gradient_checkpointing")
    if causal_mask is None:
        causal_mask = "implicit" if batch == "plain" else "explicit"
    elif causal_mask == "implicit" and batch != "plain":
        raise ValueError(f"a {batch} batch always gets an explicit mask: causal_mask='implicit' needs batch='plain'")
    import transformers

    settings: dict[str, Any] = {
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "dtype": dtype,
        "gradient_checkpointing": gradient_checkpointing,
        "attention": attention,
        "optimizer": optimizer,
        "optimizer_impl": optimizer_impl,
        "trainable": trainable,
        **lora_settings(trainable, lora_rank, lora_targets, lora_dropout),
        "causal_mask": causal_mask,
        "steps": steps,
        "chunked_loss": chunked_loss,
        "activation_offloading": activation_offloading,
        "batch": batch,
    }
    model = _build_model(
        shape, dtype, attention, gradient_checkpointing, trainable, lora_rank, lora_targets, lora_dropout
    )
    if activation_offloading:  # the trainer's hooks (memfit_trainer.activation_offload), to the stand-in host
        offload_activations(model, host=HOST)
    real_inputs = _real_batch(batch, micro_batch, seq_len, shape.vocab_size)
    reference = flex_reference_on_cpu() if attention == Attention.FLEX else contextlib.nullcontext()
    with reference, fake_run(causal_mask) as mode:
        fake_weights(model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = _optimizer(params, optimizer_impl)
        inputs: dict[str, torch.Tensor] = {name: mode.from_tensor(tensor) for name, tensor in real_inputs.items()}

        def forward() -> torch.Tensor:
            if chunked_loss:  # the trainer's code path (memfit_trainer.chunked_loss.install)
                return causal_lm_loss(model, unwrap_causal_lm(model), inputs)
            return cast(torch.Tensor, model(**inputs).loss)

        start, phases = tracked_training_steps(model, opt, forward, steps)

    peak_phase = max(phases, key=lambda name: phases[name]["peak"]["total"])
    at_peak = phases[peak_phase]["peak"]
    return {
        "shape": shape_fields(shape),
        "settings": settings,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for p in params),
        "peak_total": at_peak["total"],
        "peak_phase": peak_phase,
        "at_peak": at_peak,
        "activation_bytes": transient(at_peak),
        "transient_peak_bytes": max(transient(p["transient_peak"]) for p in phases.values()),
        "host_peak_bytes": max(p["host_peak"]["HOST"] for p in phases.values()),
        "start": start,
        "phases": phases,
    }


def distributed_record(
    shape: ModelShape, settings: dict[str, Any], start: dict[str, int], phases: dict[str, dict[str, dict[str, int]]]
) -> dict[str, Any]:
    """The record of one rank's traced step on a fake process group (``calibration.fsdp2_trace``,
    ``calibration.sp_trace``), shaped as :func:`trace_training_step`'s where ``calibration.compare`` reads it."""
    peak_phase = max(phases, key=lambda name: phases[name]["peak"]["total"])
    return {
        "shape": shape_fields(shape),
        "settings": settings,
        "versions": {"torch": torch.__version__},
        "peak_total": phases[peak_phase]["peak"]["total"],
        "peak_phase": peak_phase,
        "activation_bytes": transient(phases[peak_phase]["peak"]),
        "start": start,
        "phases": phases,
    }


def shape_fields(shape: ModelShape) -> dict[str, Any]:
    """The shape as plain JSON, plus the derived widths the formulas use."""
    fields = {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)}
    fields["family"] = shape.family.value
    fields.update(q_size=shape.q_size, kv_size=shape.kv_size, parameter_count=shape.parameter_count)
    return fields


class _Provenance(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__ is unannotated
    """Remembers which op, inside which module, produced each storage (to name what autograd saves)."""

    def __init__(self, module_names: dict[torch.nn.Module, str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # unannotated in torch
        self.producers: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.module_stack: list[str] = []
        self._module_names = module_names

    def enter_module(self, module: torch.nn.Module, *_: Any) -> None:
        self.module_stack.append(self._module_names.get(module, type(module).__name__))

    def leave_module(self, *_: Any) -> None:
        self.module_stack.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        where = self.module_stack[-1] if self.module_stack else ""
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                # (WeakIdKeyDictionary's methods are unannotated in torch.)
                self.producers.setdefault(  # type: ignore[no-untyped-call]
                    t.untyped_storage(), (str(func.overloadpacket.__name__), where)
                )
        return out


def saved_tensors(
    shape: ModelShape,
    *,
    micro_batch: int,
    seq_len: int,
    dtype: Dtype = Precision.BF16,
    attention: TracedAttention = Attention.SDPA,
    trainable: Trainable = Method.FULL,
    lora_rank: int = 16,
    lora_targets: tuple[str, ...] = ("all-linear",),
    lora_dropout: float = 0.05,
    causal_mask: CausalMask = "implicit",
) -> list[dict[str, Any]]:
    """Every storage autograd saves during one forward (with loss), once each, named by its producer.

    The rows (``module`` that saved it, producing ``op`` and the module it ran in, ``shape``, ``dtype``,
    ``bytes``) are how the per-layer activation formula is derived: sum the rows of one decoder layer.
    Parameters are left out, since they exist anyway.
    """
    model = _build_model(shape, dtype, attention, False, trainable, lora_rank, lora_targets, lora_dropout)
    with fake_run(causal_mask):
        fake_weights(model)
        input_ids = torch.randint(0, shape.vocab_size, (micro_batch, seq_len))
        names = {module: name for name, module in model.named_modules()}
        params = WeakIdKeyDictionary({p.untyped_storage(): True for p in model.parameters()})
        provenance = _Provenance(names)
        seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        rows: list[dict[str, Any]] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage in params or storage in seen:
                return t
            seen[storage] = True
            op, produced_in = provenance.producers.get(storage, ("external", ""))  # type: ignore[no-untyped-call]
            rows.append(
                {
                    "module": provenance.module_stack[-1] if provenance.module_stack else "",
                    "op": op,
                    "produced_in": produced_in,
                    "shape": list(t.shape),
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "bytes": storage.nbytes(),
                }
            )
            return t

        pre = register_module_forward_pre_hook(provenance.enter_module)
        post = register_module_forward_hook(provenance.leave_module)
        try:
            with provenance, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model(input_ids=input_ids, labels=input_ids)
        finally:
            pre.remove()
            post.remove()
    return rows
