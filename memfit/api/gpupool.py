"""The ``GPUPool`` resource: the declared inventory of one node pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from memfit.api.base import API_VERSION, ApiModel, NonEmptyStr, ObjectMeta, Toleration
from memfit.catalog.gpus import GPUProduct, gpu_product

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"


class Interconnect(ApiModel):
    """Bandwidths the throughput model uses for communication (defaults from the GPU product table)."""

    intra_node_gbps: PositiveFloat | None = None
    """GB/s per GPU between GPUs of one node (NVLink or PCIe)."""
    inter_node_gbps: PositiveFloat = 25.0
    """GB/s per node between nodes (e.g. 25 for one 200 Gb/s NIC, 400 for 8x400 Gb/s)."""


class PeakTFLOPS(ApiModel):
    """Dense tensor-core peak of one GPU (defaults from the GPU product table)."""

    bf16: PositiveFloat | None = None
    """bf16 TFLOPS; leave empty on GPUs without bf16."""
    fp16: PositiveFloat | None = None
    """fp16 TFLOPS."""


class GPUPoolSpec(ApiModel):
    """One pool of identical GPU nodes that FineTuneJobs may be planned onto."""

    gpu_product: NonEmptyStr
    """GPU model as in the `nvidia.com/gpu.product` node label, e.g. NVIDIA-A100-SXM4-80GB."""
    gpu_memory_gib: PositiveFloat | None = None
    """Memory of one GPU in GiB (default: from the product table)."""
    gpus_per_node: PositiveInt
    """GPUs on each node."""
    nodes: PositiveInt
    """Nodes in the pool that jobs may use."""
    cpu_memory_gib_per_node: PositiveFloat
    """CPU RAM per node in GiB available to training pods (offloaded states live here)."""
    nvme_gib_per_node: float = Field(default=0.0, ge=0)
    """Local NVMe space per node in GiB for ZeRO-Infinity offload (0: none)."""
    nvme_gbps_per_node: PositiveFloat = 3.0
    """NVMe read/write bandwidth per node in GB/s."""
    interconnect: Interconnect = Field(default_factory=Interconnect)
    """Communication bandwidths."""
    peak_tflops: PeakTFLOPS = Field(default_factory=PeakTFLOPS)
    """Peak compute per GPU (default: from the product table)."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Extra node labels the trainer pods select (the product label is always added)."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Tolerations for the pool's taints."""

    @model_validator(mode="after")
    def _known_or_complete(self) -> GPUPoolSpec:
        try:
            gpu_product(self.gpu_product)
        except KeyError as unknown:
            if self.gpu_memory_gib is None or self.peak_tflops.fp16 is None:
                raise ValueError(
                    f"{unknown.args[0]}; for a product not in the table give gpuMemoryGiB and peakTFLOPS.fp16 "
                    "(and peakTFLOPS.bf16 if it supports bf16)"
                ) from None
        return self


class GPUPool(ApiModel):
    """A GPUPool object as `kubectl apply` takes it."""

    api_version: Literal["memfit.dev/v1alpha1"] = API_VERSION
    """API version."""
    kind: Literal["GPUPool"] = "GPUPool"
    """Kind."""
    metadata: ObjectMeta
    """Standard object metadata."""
    spec: GPUPoolSpec
    """The pool."""


@dataclass(frozen=True)
class PoolCapacity:
    """A pool with every default resolved: what the planner works with."""

    name: str
    product: str
    gpu_memory_bytes: int
    gpus_per_node: int
    nodes: int
    cpu_memory_bytes_per_node: int
    nvme_bytes_per_node: int
    nvme_bytes_per_second: float
    bf16: bool
    peak_flops_bf16: float | None
    peak_flops_fp16: float
    intra_node_bytes_per_second: float
    inter_node_bytes_per_second: float
    pcie_bytes_per_second: float


GIB = 1024**3
GB = 1e9


def pool_capacity(pool: GPUPool) -> PoolCapacity:
    """Resolve a pool's defaults from the GPU product table."""
    spec = pool.spec
    try:
        known: GPUProduct | None = gpu_product(spec.gpu_product)
    except KeyError:
        known = None
    memory_gib = spec.gpu_memory_gib or (known.memory_gib if known else 0.0)
    bf16_tflops = spec.peak_tflops.bf16 or (known.peak_tflops_bf16 if known else None)
    fp16_tflops = spec.peak_tflops.fp16 or (known.peak_tflops_fp16 if known else 0.0)
    intra = spec.interconnect.intra_node_gbps or (known.intra_node_gbps if known else 25.0)
    return PoolCapacity(
        name=pool.metadata.name,
        product=known.product if known else spec.gpu_product,
        gpu_memory_bytes=int(memory_gib * GIB),
        gpus_per_node=spec.gpus_per_node,
        nodes=spec.nodes,
        cpu_memory_bytes_per_node=int(spec.cpu_memory_gib_per_node * GIB),
        nvme_bytes_per_node=int(spec.nvme_gib_per_node * GIB),
        nvme_bytes_per_second=spec.nvme_gbps_per_node * GB,
        bf16=bf16_tflops is not None,
        peak_flops_bf16=bf16_tflops * 1e12 if bf16_tflops else None,
        peak_flops_fp16=fp16_tflops * 1e12,
        intra_node_bytes_per_second=intra * GB,
        inter_node_bytes_per_second=spec.interconnect.inter_node_gbps * GB,
        pcie_bytes_per_second=(known.pcie_gbps if known else 25.0) * GB,
    )
