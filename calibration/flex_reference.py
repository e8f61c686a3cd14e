"""torch's flex attention with its backward pass on the CPU, through the unfused reference implementation.

torch 2.13 refuses flex attention inputs that require grad on the CPU (``_validate_device``), and inductor
has no CPU backward template, so a training step under ``attn_implementation="flex_attention"`` cannot run
here as it runs on CUDA. The same higher-order op has an unfused implementation with autograd (its
``FlexAttentionAutogradOp`` saves what the fused kernel's backward reads: queries, keys, values, the output,
the fp32 log-sum-exp and maximum scores, the ``BlockMask``'s tensors) and a fake-tensor implementation that
allocates what the fused kernel allocates. Checks of the mask's semantics (packed documents kept apart) and
traces of the memory run through it; the fused kernel is what a CUDA run uses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def flex_reference_on_cpu() -> Iterator[None]:
    """Run flex attention uncompiled (``transformers`` compiles it: with dynamo disabled it runs as written),
    through the reference implementation, with torch's CPU device check let through."""
    import torch.nn.attention.flex_attention as flex

    check, debug, disabled = (
        flex._validate_device,
        flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG,
        torch._dynamo.config.disable,
    )
    flex._validate_device = lambda *tensors: None
    flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    torch._dynamo.config.disable = True
    try:
        yield
    finally:
        flex._validate_device, flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = check, debug
        torch._dynamo.config.disable = disabled
        torch._dynamo.reset()  # frames dynamo skipped while disabled would stay skipped
