"""Chunked cross-entropy (``training.chunked_loss``): the LM head and the loss, a chunk of tokens at a time.

The plain loss materialises the full-vocabulary logits, their fp32 copy and the fp32 gradient (12 bytes per
token and vocabulary entry). :class:`ChunkedCrossEntropy` takes the final hidden states and the LM-head
weight instead: its forward computes each chunk's logits, keeps only one fp32 log-sum-exp per token, and
drops them; its backward recomputes each chunk's logits, forms softmax minus one-hot and accumulates the
hidden states' and the weight's gradients chunk by chunk. Alive at once: one chunk's fp32 logits (and their
16-bit cast), never the full logits. The memory model counts exactly these tensors
(``memfit.memory.activations.head_and_loss``, checked by MemTracker traces of :func:`causal_lm_loss`).

Same loss as ``transformers``' causal-LM loss: labels shifted by one, ``-100`` ignored, mean over the
tokens that count; Gemma 2's final logit soft-capping and an LM-head bias are applied as the model does.

On CUDA a fused kernel is used where installed (Liger Kernel's fused linear cross-entropy, else Apple's
cut-cross-entropy), chosen once at start (:func:`select_kernel`) and said in the log; elsewhere, and when
neither is installed, this pure-PyTorch function.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from memfit.memory.activations import loss_chunk_tokens
from memfit_trainer.blocks import IGNORE_INDEX
from memfit_trainer.run import Run
from memfit_trainer.technique import Installed

PYTORCH, LIGER, CUT_CROSS_ENTROPY = "pytorch", "liger-kernel", "cut-cross-entropy"
SHIFT_LABELS = "shift_labels"
"""A batch's labels already shifted (a chunk of a sequence split over ranks: memfit_trainer.sequence_parallel)."""
GROUP_TARGETS = "num_items_in_batch"
"""The target count a batch's summed loss is divided by, where it is not the batch's own (a chunk's: the whole
sequence's). The names are ``transformers``' causal-LM loss arguments, so the model's own loss reads them too."""
LOSS_ONLY = ("labels", SHIFT_LABELS, GROUP_TARGETS)
"""Batch entries for the loss, not the decoder."""


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's fp32 logits (soft-capped where the model caps them) and, when capped, the tanh the
    gradient needs."""
    raw = hidden @ weight.t()
    if bias is not None:
        raw += bias
    logits = raw.float()
    del raw
    if softcap is None:
        return logits, None
    tanh = torch.tanh(logits.div_(softcap))
    del logits
    return tanh * softcap, tanh


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels`` (already shifted), computed
    ``chunk_tokens`` rows at a time; the logits are recomputed in backward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        chunk_tokens: int,
        softcap: float | None,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        lse = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, tokens, chunk_tokens):
            end = min(start + chunk_tokens, tokens)
            logits, tanh = _chunk_logits(hidden[start:end], weight, bias, softcap)
            del tanh
            target = labels[start:end]
            picked = logits.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
            # log-sum-exp in place: no second logits-sized buffer
            top = logits.amax(dim=-1, keepdim=True)
            total = logits.sub_(top).exp_().sum(dim=-1)
            del logits
            lse[start:end] = total.log_().add_(top.squeeze(1))
            loss += ((lse[start:end] - picked) * (target != IGNORE_INDEX)).sum()
        count = (labels != IGNORE_INDEX).sum().clamp(min=1).float()
        ctx.save_for_backward(hidden, weight, bias, labels, lse, count)
        ctx.chunk_tokens, ctx.softcap = chunk_tokens, softcap
        return loss / count

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Any:
        hidden, weight, bias, labels, lse, count = ctx.saved_tensors
        scale = grad_outputs[0].float() / count
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros_like(weight) if needs_weight else None
        grad_bias = torch.zeros_like(bias) if bias is not None and needs_bias else None
        tokens, chunk = hidden.shape[0], ctx.chunk_tokens
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            part = hidden[start:end]
            probabilities, tanh = _chunk_logits(part, weight, bias, ctx.softcap)
            probabilities.sub_(lse[start:end].unsqueeze(1)).exp_()  # softmax
            target = labels[start:end]
            rows = torch.arange(end - start, device=hidden.device)
            probabilities[rows, target.clamp(min=0)] -= 1  # minus one-hot
            probabilities.mul_(((target != IGNORE_INDEX) * scale).unsqueeze(1))
            if tanh is not None:  # d(cap * tanh(x / cap))/dx = 1 - tanh^2
                probabilities.mul_(tanh.mul_(tanh).neg_().add_(1))
                del tanh
            gradient = probabilities.to(weight.dtype)
            del probabilities
            if grad_hidden is not None:
                torch.mm(gradient, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                grad_weight.addmm_(gradient.t(), part)
            if grad_bias is not None:
                grad_bias += gradient.sum(0)
            del gradient
        return grad_hidden, grad_weight, grad_bias, None, None, None


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """``transformers``' causal-LM shift: position i predicts token i + 1; the last position is ignored."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of the logits ``hidden @ weight.T`` against the shifted ``labels`` (pure PyTorch).

    ``hidden`` is ``(..., hidden_size)`` and ``labels`` the matching ``(...)`` shape, already shifted;
    ``chunk_tokens`` defaults to what the memory model assumes (``loss_chunk_tokens``)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = labels.reshape(-1)
    if weight.dtype != flat.dtype:
        weight = weight.to(flat.dtype)  # e.g. a head upcast by peft's k-bit preparation
    chunk = chunk_tokens or loss_chunk_tokens(flat.shape[0], weight.shape[0])
    loss: torch.Tensor = ChunkedCrossEntropy.apply(  # type: ignore[no-untyped-call]  # unannotated in torch
        flat, weight, bias, targets, chunk, softcap
    )
    return loss


LossFunction = Callable[..., torch.Tensor]


def _liger() -> LossFunction:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, bias: Any = None,
             softcap: float | None = None, chunk_tokens: int | None = None) -> torch.Tensor:  # fmt: skip
        flat = hidden.reshape(-1, hidden.shape[-1])
        return liger_fused_linear_cross_entropy(  # type: ignore[no-any-return]
            flat, weight.to(flat.dtype), labels.reshape(-1), bias=bias, ignore_index=IGNORE_INDEX, softcap=softcap
        )

    return loss


def _cut_cross_entropy() -> LossFunction:
    from cut_cross_entropy import linear_cross_entropy

    def loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, bias: Any = None,
             softcap: float | None = None, chunk_tokens: int | None = None) -> torch.Tensor:  # fmt: skip
        flat = hidden.reshape(-1, hidden.shape[-1])
        return linear_cross_entropy(  # type: ignore[no-any-return]
            flat, weight.to(flat.dtype), labels.reshape(-1), bias=bias, ignore_index=IGNORE_INDEX, softcap=softcap
        )

    return loss


def select_kernel(device: torch.device) -> tuple[str, LossFunction]:
    """The loss implementation for ``device``: a fused CUDA kernel where one is installed, else the
    pure-PyTorch :func:`chunked_cross_entropy` (always on CPU). Chosen once, at start."""
    if device.type == "cuda":
        for name, make in ((LIGER, _liger), (CUT_CROSS_ENTROPY, _cut_cross_entropy)):
            try:
                return name, make()
            except ImportError:
                continue
    return PYTORCH, chunked_cross_entropy


def unwrap_causal_lm(model: Any) -> Any:
    """The ``transformers`` causal LM inside a DeepSpeed engine and/or a peft model."""
    model = getattr(model, "module", model)  # DeepSpeed engine
    get_base = getattr(model, "get_base_model", None)  # peft
    return get_base() if get_base is not None else model


def text_decoder(causal_lm: Any) -> Any:
    """The decoder stack of a causal LM, whose last hidden state is the LM head's input. ``transformers``'
    ``get_decoder()`` returns the causal LM itself where ``base_model_prefix`` names no attribute of it (Llama 4's
    text model: ``language_model``, its decoder being ``model``): its output holds the logits, not the hidden
    states."""
    decoder = causal_lm.get_decoder()
    return getattr(causal_lm, "model", decoder) if decoder is causal_lm else decoder


def as_forward_of(module: torch.nn.Module, compute: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Any:
    """``compute(x)`` run as ``module``'s forward, through the module's hooks: DeepSpeed's ZeRO-3 then gathers the
    module's partitioned parameters for it and again before its backward, and releases them after each, exactly
    as for the module's own forward (its hooks are registered on the module, not on what the forward does)."""
    own = module.__dict__.get("forward")
    module.forward = compute
    try:
        return module(x)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def causal_lm_loss(
    forward: Callable[..., Any],
    causal_lm: Any,
    batch: Mapping[str, torch.Tensor],
    loss_function: LossFunction = chunked_cross_entropy,
    gather_head: Callable[[], Any] | None = None,
    in_head: bool = False,
) -> torch.Tensor:
    """The loss of ``batch`` with the LM head inside the loss: ``forward`` (the engine, the peft model or
    the model itself) runs the decoder and computes no logits (``logits_to_keep`` selects no position);
    the final norm's output is taken from the decoder and goes with the head's weight to the loss, gathered
    first by ``gather_head`` where the forward left it sharded (FSDP2), or computed as the head module's forward
    with ``in_head`` (DeepSpeed's ZeRO-3: :func:`as_forward_of`). A batch with :data:`GROUP_TARGETS` gets its
    summed loss over that count (its mean scaled by its own targets over it)."""
    captured: list[torch.Tensor] = []

    def keep_output(module: Any, args: Any, output: Any) -> None:
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = text_decoder(causal_lm).register_forward_hook(keep_output)
    inputs = {name: value for name, value in batch.items() if name not in LOSS_ONLY}
    no_position = torch.empty(0, dtype=torch.long, device=batch["input_ids"].device)
    try:
        forward(**inputs, logits_to_keep=no_position)
    finally:
        handle.remove()
    if gather_head is not None:
        gather_head()
    head = causal_lm.get_output_embeddings()
    softcap = getattr(causal_lm.config, "final_logit_softcapping", None)
    targets = batch[SHIFT_LABELS] if SHIFT_LABELS in batch else shift_labels(batch["labels"])

    def head_loss(hidden: torch.Tensor) -> torch.Tensor:
        return loss_function(hidden, head.weight, targets, bias=head.bias, softcap=softcap)

    loss = as_forward_of(head, head_loss, captured[-1]) if in_head else head_loss(captured[-1])
    if GROUP_TARGETS not in batch:
        return loss
    return loss * (targets != IGNORE_INDEX).sum() / batch[GROUP_TARGETS]


def install(run: Run) -> Installed | None:
    """With ``training.chunked_loss``, the micro-batch's loss with the LM head inside it, its implementation
    chosen once and said in the log. FSDP2's root (the head's group) resharded after the forward is gathered again
    for the loss (its pre-backward hook would gather it next anyway, and its post-backward reduces the head's
    gradient); under DeepSpeed's ZeRO-3, which partitions the head's weight, the loss runs as the head's forward,
    so that ZeRO-3 gathers the weight for it and its backward and reduces the head's gradient as the module's."""
    if not run.config.training.chunked_loss:
        return None
    engine = run.engine
    name, kernel = select_kernel(engine.device)
    causal_lm = unwrap_causal_lm(engine)
    root = getattr(engine, "module", None)
    gather_head = root.unshard if isinstance(root, FSDPModule) else None
    in_head = hasattr(causal_lm.get_output_embeddings().weight, "ds_id")  # partitioned by DeepSpeed's ZeRO-3
    return Installed(
        said=f"loss: chunked cross-entropy ({name}{', in the LM head under ZeRO-3' if in_head else ''})",
        loss=lambda batch: causal_lm_loss(engine, causal_lm, batch, kernel, gather_head, in_head),
    )
