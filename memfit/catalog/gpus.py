"""Built-in table of NVIDIA GPU products, keyed by the ``nvidia.com/gpu.product`` node label.

GPU Feature Discovery (GFD) sets that label to the NVML device name with spaces replaced by ``-``
(``NVIDIA A100-SXM4-80GB`` -> ``NVIDIA-A100-SXM4-80GB``, ``Tesla T4`` -> ``Tesla-T4``). With MIG it appends
``-MIG-<profile>`` and with time-slicing (``renameByDefault``) ``-SHARED``; neither is a whole device, so
neither is in this table.

Conventions, per field:

* ``memory_gib`` is the total memory NVML / ``nvidia-smi`` reports, in MiB, divided by 1024 (also the value
  of GFD's ``nvidia.com/gpu.memory`` label). The MiB figure is in each row. Two things move it:

  - ECC on GDDR parts: an A10 reports 23028 MiB with ECC on and 24564 MiB with it off; an A40 or L40 46068
    vs 49140. Data-centre parts ship with ECC on and the ECC-on figure is used; workstation and GeForce
    parts ship with it off (or have none) and the ECC-off figure is used.
  - Driver version: older drivers (R470/R510 era) reported less, e.g. 40536 MiB for an A100 40GB and
    16160 / 32510 MiB for V100 16GB / 32GB, where current drivers report 40960, 16384 and 32768. The table
    follows current drivers (R535+), i.e. what a freshly installed GPU Operator node shows.

* ``peak_tflops_bf16`` / ``peak_tflops_fp16`` are dense (no 2:4 sparsity) tensor-core figures with FP32
  accumulate. NVIDIA datasheets often print the sparse number (marked ``*``); those are halved here. On
  GeForce parts FP32 accumulate runs at half the FP16-accumulate rate and the FP32-accumulate figure is used.

* ``intra_node_gbps`` is the nominal per-GPU, per-direction GPU<->GPU bandwidth in GB/s: half the
  bidirectional NVLink total for SXM parts, else the PCIe link (gen3 x16 = 16, gen4 = 32, gen5 = 64; the
  usable rate is lower, roughly 80%). Two-GPU NVLink bridges on PCIe cards are ignored, since they only
  join pairs.

* ``pcie_gbps`` is the nominal per-direction host<->GPU PCIe bandwidth in GB/s, same scale.

Sources are named per row. "datasheet" / "whitepaper" name the NVIDIA document a figure comes from, as
transcribed in public material (the PDFs themselves were not read); "nvidia-smi" means public ``nvidia-smi``
output for that product under a recent driver; "GFD" a published ``nvidia.com/gpu.memory`` label. Rows
marked UNCONFIRMED hold numbers that could not be checked against an NVIDIA figure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Nominal per-direction PCIe x16 bandwidth, GB/s.
_PCIE3, _PCIE4, _PCIE5 = 16.0, 32.0, 64.0


@dataclass(frozen=True)
class GPUProduct:
    """One GPU product as the planner sees it."""

    product: str
    """The exact ``nvidia.com/gpu.product`` label value GFD sets, e.g. ``NVIDIA-A100-SXM4-80GB``."""
    memory_gib: float
    """Total device memory as the driver reports it (MiB / 1024)."""
    bf16: bool
    """Tensor cores support bf16 (Ampere and later)."""
    peak_tflops_bf16: float | None
    """Dense bf16 tensor-core TFLOPS (FP32 accumulate); ``None`` when bf16 is unsupported."""
    peak_tflops_fp16: float
    """Dense fp16 tensor-core TFLOPS with FP32 accumulate."""
    intra_node_gbps: float
    """Default per-GPU intra-node GPU<->GPU bandwidth, GB/s per direction."""
    pcie_gbps: float
    """Host<->GPU bandwidth, GB/s per direction (offload traffic)."""


def _gpu(product: str, mib: int, bf16: float | None, fp16: float, intra: float, pcie: float) -> GPUProduct:
    return GPUProduct(product, mib / 1024, bf16 is not None, bf16, fp16, intra, pcie)


_PRODUCTS: list[GPUProduct] = [
    # --- Ampere GA100 -------------------------------------------------------------------------------------
    # A100 datasheet: BF16/FP16 Tensor 312 | 624* TFLOPS; NVLink3 600 GB/s; PCIe gen4. nvidia-smi 40960 MiB.
    _gpu("NVIDIA-A100-SXM4-40GB", 40960, 312.0, 312.0, 300.0, _PCIE4),
    # A100 datasheet (as above). nvidia-smi 81920 MiB.
    _gpu("NVIDIA-A100-SXM4-80GB", 81920, 312.0, 312.0, 300.0, _PCIE4),
    # A100 datasheet (as above), PCIe gen4 card. nvidia-smi 40960 MiB (driver name "NVIDIA A100-PCIE-40GB").
    _gpu("NVIDIA-A100-PCIE-40GB", 40960, 312.0, 312.0, _PCIE4, _PCIE4),
    # A100 datasheet (as above), PCIe gen4 card. nvidia-smi 81920 MiB (driver name "NVIDIA A100 80GB PCIe").
    _gpu("NVIDIA-A100-80GB-PCIe", 81920, 312.0, 312.0, _PCIE4, _PCIE4),
    # A30 datasheet: BF16/FP16 Tensor 165 | 330* TFLOPS; PCIe gen4. nvidia-smi 24576 MiB.
    _gpu("NVIDIA-A30", 24576, 165.0, 165.0, _PCIE4, _PCIE4),
    # --- Ampere GA102 -------------------------------------------------------------------------------------
    # A10 datasheet: BF16/FP16 Tensor 125 | 250* TF; PCIe gen4. nvidia-smi 23028 MiB (ECC on; 24564 off).
    _gpu("NVIDIA-A10", 23028, 125.0, 125.0, _PCIE4, _PCIE4),
    # AWS-only A10 variant; NVIDIA publishes no datasheet. Memory: nvidia-smi / GFD 23028 MiB. TFLOPS
    # UNCONFIRMED: third-party figures range 62.5-125; 70 is a guess below the A10's 125. PCIe gen4.
    _gpu("NVIDIA-A10G", 23028, 70.0, 70.0, _PCIE4, _PCIE4),
    # A40 datasheet: BF16/FP16 Tensor 149.7 | 299.4* TFLOPS; PCIe gen4. nvidia-smi 46068 MiB (ECC on).
    _gpu("NVIDIA-A40", 46068, 149.7, 149.7, _PCIE4, _PCIE4),
    # GA102 whitepaper: RTX A6000 BF16 (FP32 acc) 154.8/309.6 TFLOPS; PCIe gen4. nvidia-smi 49140 MiB (ECC off).
    _gpu("NVIDIA-RTX-A6000", 49140, 154.8, 154.8, _PCIE4, _PCIE4),
    # GA102 whitepaper: RTX 3090 BF16 / FP16 (FP32 acc) 71/142 (71.2 unrounded); PCIe gen4. nvidia-smi 24576.
    _gpu("NVIDIA-GeForce-RTX-3090", 24576, 71.2, 71.2, _PCIE4, _PCIE4),
    # --- Hopper -------------------------------------------------------------------------------------------
    # H100 datasheet: BF16/FP16 1,979* (dense 989.4 = 528 TC x 1830 MHz x 1024); NVLink4 900 GB/s; PCIe gen5.
    # nvidia-smi 81559 MiB.
    _gpu("NVIDIA-H100-80GB-HBM3", 81559, 989.4, 989.4, 450.0, _PCIE5),
    # H100 datasheet: H100 PCIe BF16/FP16 1,513* (dense 756.5); PCIe gen5. nvidia-smi 81559 MiB.
    _gpu("NVIDIA-H100-PCIe", 81559, 756.5, 756.5, _PCIE5, _PCIE5),
    # H100 datasheet: H100 NVL BF16/FP16 1,671* (dense 835.5; one third-party note quotes NVIDIA's dense 835);
    # PCIe gen5 (NVLink bridge joins pairs only).
    # GFD nvidia.com/gpu.memory=95830 MiB.
    _gpu("NVIDIA-H100-NVL", 95830, 835.5, 835.5, _PCIE5, _PCIE5),
    # H200 datasheet: H200 SXM BF16/FP16 1,979* (dense 989.4, same GH100 as H100 SXM); NVLink 900 GB/s;
    # PCIe gen5. nvidia-smi 143771 MiB.
    _gpu("NVIDIA-H200", 143771, 989.4, 989.4, 450.0, _PCIE5),
    # --- Blackwell ----------------------------------------------------------------------------------------
    # NVIDIA exemplar-performance README: B200 BF16 dense 2250 TFLOPS; NVLink5 1.8 TB/s per GPU; host PCIe
    # gen5. nvidia-smi 183359 MiB. FP16 assumed equal to BF16 (as on every other data-centre part).
    _gpu("NVIDIA-B200", 183359, 2250.0, 2250.0, 900.0, _PCIE5),
    # --- Ada ----------------------------------------------------------------------------------------------
    # L4 datasheet: BF16/FP16 Tensor 242* (dense 121); PCIe gen4. nvidia-smi 23034 MiB.
    _gpu("NVIDIA-L4", 23034, 121.0, 121.0, _PCIE4, _PCIE4),
    # L40 datasheet: BF16 / FP16 (FP32 acc) 181.05 | 362.1* (only seen quoted in third-party code); PCIe gen4.
    # nvidia-smi 46068 MiB (ECC on; 49140 off).
    _gpu("NVIDIA-L40", 46068, 181.05, 181.05, _PCIE4, _PCIE4),
    # L40S datasheet: BF16/FP16 Tensor 362.05 | 733*; PCIe gen4. nvidia-smi 46068 MiB (ECC on).
    _gpu("NVIDIA-L40S", 46068, 362.05, 362.05, _PCIE4, _PCIE4),
    # Ada / RTX PRO Blackwell whitepapers: RTX 6000 Ada BF16 (FP32 acc) 364.2/728.5*; PCIe gen4.
    # nvidia-smi 49140 MiB (ECC off).
    _gpu("NVIDIA-RTX-6000-Ada-Generation", 49140, 364.2, 364.2, _PCIE4, _PCIE4),
    # Ada whitepaper App. A: RTX 4090 BF16 / FP16 (FP32 acc) 165.2/330.4*; PCIe gen4 (no GPU P2P).
    # nvidia-smi 24564 MiB.
    _gpu("NVIDIA-GeForce-RTX-4090", 24564, 165.2, 165.2, _PCIE4, _PCIE4),
    # --- Turing / Volta (no bf16) -------------------------------------------------------------------------
    # T4 datasheet: Mixed precision (FP16/FP32) 65 TFLOPS (no sparsity on Turing); PCIe gen3. nvidia-smi 15360.
    _gpu("Tesla-T4", 15360, None, 65.0, _PCIE3, _PCIE3),
    # V100 datasheet: SXM2 Tensor 125 TFLOPS; NVLink2 300 GB/s; PCIe gen3. nvidia-smi 16384 MiB.
    _gpu("Tesla-V100-SXM2-16GB", 16384, None, 125.0, 150.0, _PCIE3),
    # V100 datasheet (as above). nvidia-smi 32768 MiB.
    _gpu("Tesla-V100-SXM2-32GB", 32768, None, 125.0, 150.0, _PCIE3),
]

GPU_PRODUCTS: dict[str, GPUProduct] = {p.product: p for p in _PRODUCTS}
"""GFD product label -> product."""

GPU_ALIASES: dict[str, str] = {
    # Short names. Where a short name is ambiguous the smaller-memory or more common part wins, as in
    # SkyPilot's naming ("A100" is the 40GB part, "A100-80GB" the 80GB one); say the full label to be exact.
    "a100-40gb": "NVIDIA-A100-SXM4-40GB",
    "a100-80gb": "NVIDIA-A100-SXM4-80GB",
    "a100-sxm4-40gb": "NVIDIA-A100-SXM4-40GB",
    "a100-sxm4-80gb": "NVIDIA-A100-SXM4-80GB",
    "a100-pcie-40gb": "NVIDIA-A100-PCIE-40GB",
    "a100-pcie-80gb": "NVIDIA-A100-80GB-PCIe",
    "a100-80gb-pcie": "NVIDIA-A100-80GB-PCIe",
    "a30": "NVIDIA-A30",
    "a10": "NVIDIA-A10",
    "a10g": "NVIDIA-A10G",
    "a40": "NVIDIA-A40",
    "a6000": "NVIDIA-RTX-A6000",
    "rtx-a6000": "NVIDIA-RTX-A6000",
    "rtx-3090": "NVIDIA-GeForce-RTX-3090",
    "rtx3090": "NVIDIA-GeForce-RTX-3090",
    "3090": "NVIDIA-GeForce-RTX-3090",
    "h100": "NVIDIA-H100-80GB-HBM3",
    "h100-80gb": "NVIDIA-H100-80GB-HBM3",
    "h100-sxm": "NVIDIA-H100-80GB-HBM3",
    "h100-sxm5": "NVIDIA-H100-80GB-HBM3",
    "h100-pcie": "NVIDIA-H100-PCIe",
    "h100-nvl": "NVIDIA-H100-NVL",
    "h200": "NVIDIA-H200",
    "h200-sxm": "NVIDIA-H200",
    "b200": "NVIDIA-B200",
    "l4": "NVIDIA-L4",
    "l40": "NVIDIA-L40",
    "l40s": "NVIDIA-L40S",
    "rtx-6000-ada": "NVIDIA-RTX-6000-Ada-Generation",
    "rtx6000-ada": "NVIDIA-RTX-6000-Ada-Generation",
    "rtx-4090": "NVIDIA-GeForce-RTX-4090",
    "rtx4090": "NVIDIA-GeForce-RTX-4090",
    "4090": "NVIDIA-GeForce-RTX-4090",
    "t4": "Tesla-T4",
    "v100-16gb": "Tesla-V100-SXM2-16GB",
    "v100-32gb": "Tesla-V100-SXM2-32GB",
    # GKE ``cloud.google.com/gke-accelerator`` values.
    "nvidia-tesla-t4": "Tesla-T4",
    "nvidia-tesla-v100": "Tesla-V100-SXM2-16GB",
    "nvidia-tesla-a100": "NVIDIA-A100-SXM4-40GB",
    "nvidia-a100-80gb": "NVIDIA-A100-SXM4-80GB",
    "nvidia-l4": "NVIDIA-L4",
    "nvidia-h100-80gb": "NVIDIA-H100-80GB-HBM3",
    "nvidia-h100-mega-80gb": "NVIDIA-H100-80GB-HBM3",
}
"""Lower-case alias -> GFD product label."""

AMBIGUOUS_ALIASES: dict[str, tuple[str, ...]] = {
    "a100": ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-PCIE-40GB", "NVIDIA-A100-80GB-PCIe"),
    "v100": ("Tesla-V100-SXM2-16GB", "Tesla-V100-SXM2-32GB"),
}
"""Short names sold with more than one memory size: never read as the smaller card."""


class AmbiguousProduct(ValueError):
    """A short name that names several products (``AMBIGUOUS_ALIASES``)."""


_BY_LOWER: dict[str, str] = {label.lower(): label for label in GPU_PRODUCTS}
SHOWN_LABEL = 80
"""How much of an unknown label a message echoes (its repr escapes control characters)."""


def _normalize(label: str) -> str:
    # nvidia-smi / NVML names use spaces where GFD uses dashes ("NVIDIA A100-SXM4-80GB").
    return re.sub(r"[\s_]+", "-", label.strip()).lower()


def gpu_product(label: str) -> GPUProduct:
    """Look a GPU up by GFD label, NVML name or short alias, ignoring case.

    Raises ``KeyError`` naming every known product when nothing matches, with a hint for MIG and
    time-slicing labels, which describe a slice of a device rather than a whole one, and ``AmbiguousProduct``
    for a short name sold in several memory sizes.
    """
    key = _normalize(label)
    canonical = _BY_LOWER.get(key) or GPU_ALIASES.get(key)
    if canonical is not None:
        return GPU_PRODUCTS[canonical]
    if key in AMBIGUOUS_ALIASES:
        products = ", ".join(f"{name} ({GPU_PRODUCTS[name].memory_gib:g} GiB)" for name in AMBIGUOUS_ALIASES[key])
        raise AmbiguousProduct(f"gpuProduct {label[:SHOWN_LABEL]!r} names several cards: {products}; give one of them")
    raise KeyError(f"{unknown_product(label)}; known products: {', '.join(GPU_PRODUCTS)}")


def unknown_product(label: str) -> str:
    """`unknown GPU product 'X'`, with a hint for MIG and time-slicing labels; a long label is cut short."""
    key = _normalize(label[:SHOWN_LABEL])
    hint = ""
    if "-mig-" in key:
        hint = " (a MIG slice is not a whole GPU; give its memory explicitly)"
    elif key.endswith("-shared"):
        hint = " (a time-sliced '-SHARED' label shares one GPU's memory between replicas)"
    shown = repr(label[:SHOWN_LABEL]) + ("..." if len(label) > SHOWN_LABEL else "")
    return f"unknown GPU product {shown}{hint}"
