"""Bytes per element of the dtypes the memory model counts, and of bitsandbytes' 4-bit weights.

A leaf module: the model states, the engines and the activations all size tensors with these, so keeping
them apart keeps those modules from importing each other.
"""

from __future__ import annotations

import math

from memfit.api.vocabulary import Precision

FP64 = 8
FP32 = 4
BF16 = 2

NF4_BLOCK = 64
"""bitsandbytes 4-bit quantizes weights in blocks of 64, one absmax per block."""
NF4_DOUBLE_QUANT_BLOCK = 256
"""With double quantization the absmaxes are themselves 8-bit, one fp32 scale per 256 of them."""
NF4_PACKED_BYTES_PER_PARAMETER = 4 / 8
"""The 4-bit codes, two per byte, whatever element type packs them (uint8, or bf16 on the fsdp2 engine)."""
NF4_QUANT_STATE_BYTES_PER_PARAMETER = (8 / NF4_BLOCK + 32 / (NF4_BLOCK * NF4_DOUBLE_QUANT_BLOCK)) / 8
"""The 8-bit absmax per block and the fp32 second-level scale per 256 blocks, on average."""
NF4_BYTES_PER_PARAMETER = NF4_PACKED_BYTES_PER_PARAMETER + NF4_QUANT_STATE_BYTES_PER_PARAMETER
"""4.127 bits: the 4-bit code, the 8-bit absmax per block, the fp32 second-level scale."""
NF4_CODE_TABLE_BYTES = (16 + 256 + 1) * FP32
"""Per 4-bit weight, beside its absmaxes: bitsandbytes' ``QuantState`` keeps its own 16-value NF4 code, the
256-value dynamic map of the double quantization and the absmaxes' offset, all fp32."""


def nf4_quant_state_bytes(elements: int) -> int:
    """Exactly the ``QuantState`` tensors of one double-quantized 4-bit weight of ``elements`` parameters: the
    uint8 absmax of each block (the last one partial), the fp32 scale of each 256 of them, the code tables."""
    blocks = math.ceil(elements / NF4_BLOCK)
    return blocks + FP32 * math.ceil(blocks / NF4_DOUBLE_QUANT_BLOCK) + NF4_CODE_TABLE_BYTES


def compute_bytes(precision: Precision) -> int:
    """Bytes of one weight, gradient or activation element in the compute precision."""
    return FP32 if precision == Precision.FP32 else 2
