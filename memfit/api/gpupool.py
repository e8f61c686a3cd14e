"""The ``GPUPool`` resource: the declared inventory of one node pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Final, Literal

from pydantic import Field, Strict, model_validator

from memfit.api.base import API_VERSION, ApiModel, ObjectMeta, StrictFloat, StrictInt, StrictStr, Toleration
from memfit.api.vocabulary import Devices
from memfit.catalog.gpus import GPUProduct, gpu_product, unknown_product
from memfit.units import GIB

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
CPU_PRODUCT: Final = "cpu"
"""``gpuProduct: cpu``: a pool of CPU-only nodes, for trying a pipeline on cheap nodes before GPU hours. Each
"GPU" is one trainer process (a gloo rank) whose device memory is the node's RAM, so the ranks' memory and the
node's host memory are planned against one budget (``cpuMemoryGiBPerNode``); its pods request CPU and memory
and no GPU."""
CPU_RANK_TFLOPS: Final = 0.1
"""Compute of one CPU rank when the pool gives no peakTFLOPS: an order-of-magnitude estimate of a few cores'
bf16 matrix rate, not a measurement of any node. It ranks a CPU pool's plans against each other; give the
pool's own figure for a throughput estimate worth reading."""
CPU_RANK_GBPS: Final = 5.0
"""GB/s between two CPU ranks of a node (gloo over loopback) when the pool gives none: an estimate."""

# Bounds of a GPUPool (see memfit.api.base). The minima keep the planner's arithmetic finite and free of
# division by zero (a pool with 1e-9 GiB or 1e308 TFLOPS is refused, not planned); the maxima are far beyond
# any real node. The smallest memory figures admit `memfit run --local`, whose CPU "devices" share the RAM.
MIN_MEMORY_GIB: Final = 1 / 16
"""64 MiB."""
MAX_GPU_MEMORY_GIB: Final = 4096.0
"""Memory of one GPU (the largest today hold under 300 GiB)."""
MAX_NODE_MEMORY_GIB: Final = 65_536.0
"""CPU memory or NVMe space of one node: 64 TiB."""
MAX_GPUS_PER_NODE: Final = 64
MAX_NODES: Final = 10_000
MAX_CPUS_PER_RANK: Final = 1024.0
MIN_GBPS: Final = 0.01
"""Bandwidths in GB/s: 10 MB/s at least."""
MAX_GBPS: Final = 100_000.0
"""100 TB/s at most (NVLink 5 moves 0.9 TB/s per direction)."""
MIN_TFLOPS: Final = 0.01
MAX_TFLOPS: Final = 1_000_000.0
"""An exaflop per GPU (the fastest today reach a few thousand dense TFLOPS)."""


class Interconnect(ApiModel):
    """Bandwidths the throughput model uses for communication (defaults from the GPU product table)."""

    intra_node_gbps: Annotated[float, Strict(), Field(ge=MIN_GBPS, le=MAX_GBPS)] | None = None
    """GB/s per GPU between GPUs of one node (NVLink or PCIe)."""
    inter_node_gbps: StrictFloat = Field(default=25.0, ge=MIN_GBPS, le=MAX_GBPS)
    """GB/s per node between nodes (e.g. 25 for one 200 Gb/s NIC, 400 for 8x400 Gb/s)."""


class PeakTFLOPS(ApiModel):
    """Dense tensor-core peak of one GPU (defaults from the GPU product table)."""

    bf16: Annotated[float, Strict(), Field(ge=MIN_TFLOPS, le=MAX_TFLOPS)] | None = None
    """bf16 TFLOPS; leave empty on GPUs without bf16."""
    fp16: Annotated[float, Strict(), Field(ge=MIN_TFLOPS, le=MAX_TFLOPS)] | None = None
    """fp16 TFLOPS."""


class GPUPoolSpec(ApiModel):
    """One pool of identical GPU nodes that FineTuneJobs may be planned onto."""

    gpu_product: Annotated[str, Strict(), Field(min_length=1, max_length=63)]
    """GPU model as in the `nvidia.com/gpu.product` node label, e.g. NVIDIA-A100-SXM4-80GB; `cpu`: CPU-only nodes
    (each "GPU" a trainer process with a share of the node's RAM)."""
    gpu_memory_gib: Annotated[float, Strict(), Field(ge=MIN_MEMORY_GIB, le=MAX_GPU_MEMORY_GIB)] | None = None
    """Memory of one GPU in GiB (default: from the product table; `cpu`: cpuMemoryGiBPerNode / gpusPerNode)."""
    gpus_per_node: StrictInt = Field(ge=1, le=MAX_GPUS_PER_NODE)
    """GPUs on each node (1-64); `cpu`: trainer processes per node."""
    nodes: StrictInt = Field(ge=1, le=MAX_NODES)
    """Nodes in the pool that jobs may use (1-10000)."""
    cpu_memory_gib_per_node: StrictFloat = Field(ge=MIN_MEMORY_GIB, le=MAX_NODE_MEMORY_GIB)
    """CPU RAM per node in GiB available to training pods (offloaded states live here)."""
    nvme_gib_per_node: StrictFloat = Field(default=0.0, ge=0, le=MAX_NODE_MEMORY_GIB)
    """Local NVMe space per node in GiB for ZeRO-Infinity offload (0: none)."""
    nvme_gbps_per_node: StrictFloat = Field(default=3.0, ge=MIN_GBPS, le=MAX_GBPS)
    """NVMe read/write bandwidth per node in GB/s."""
    interconnect: Interconnect = Field(default_factory=Interconnect)
    """Communication bandwidths."""
    peak_tflops: PeakTFLOPS = Field(default_factory=PeakTFLOPS)
    """Peak compute per GPU (default: from the product table)."""
    cpus_per_rank: Annotated[float, Strict(), Field(ge=0.1, le=MAX_CPUS_PER_RANK)] | None = None
    """CPU cores each trainer process (one per GPU) requests (default: 2, or 4 where states are offloaded to the
    host); on a CPU pool the cores that compute. The limit is twice the request."""
    node_selector: dict[StrictStr, StrictStr] = Field(default_factory=dict)
    """Extra node labels the trainer pods select (the product label is always added)."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Tolerations for the pool's taints."""

    @property
    def cpu_only(self) -> bool:
        return self.gpu_product.lower() == CPU_PRODUCT

    @property
    def devices(self) -> Devices:
        """What the pool's ranks compute on."""
        return Devices.CPU if self.cpu_only else Devices.CUDA

    @model_validator(mode="after")
    def _known_or_complete(self) -> GPUPoolSpec:
        if self.cpu_only:
            ranks_gib = (self.gpu_memory_gib or 0.0) * self.gpus_per_node
            if ranks_gib > self.cpu_memory_gib_per_node:
                raise ValueError(
                    f"gpuProduct cpu: gpusPerNode x gpuMemoryGiB ({self.gpus_per_node} x {self.gpu_memory_gib:g}) is "
                    f"more than cpuMemoryGiBPerNode ({self.cpu_memory_gib_per_node:g}): the ranks' memory is the "
                    "node's RAM"
                )
            return self
        try:
            gpu_product(self.gpu_product)
        except KeyError:
            if self.gpu_memory_gib is None or self.peak_tflops.fp16 is None:
                raise ValueError(
                    f"{unknown_product(self.gpu_product)}; for a product not in the table give gpuMemoryGiB and "
                    "peakTFLOPS.fp16 (and peakTFLOPS.bf16 if it supports bf16); `memfit presets` lists the table"
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
    cpu_only: bool = False
    """The ranks' "GPU" memory is the node's RAM (``CPU_PRODUCT``): both count against cpu_memory_bytes_per_node."""


GB = 1e9


CPU_RANK: Final = GPUProduct(CPU_PRODUCT, 0.0, True, CPU_RANK_TFLOPS, CPU_RANK_TFLOPS, CPU_RANK_GBPS, CPU_RANK_GBPS)
"""What a CPU pool's ranks are planned with where the pool says nothing (estimates, see each constant); the
memory of a rank is its share of the node's RAM instead of a product's."""


def pool_capacity(pool: GPUPool) -> PoolCapacity:
    """Resolve a pool's defaults from the GPU product table (a CPU pool's from ``CPU_RANK``)."""
    spec = pool.spec
    known: GPUProduct | None
    if spec.cpu_only:
        known = CPU_RANK
    else:
        try:
            known = gpu_product(spec.gpu_product)
        except KeyError:
            known = None
    share = spec.cpu_memory_gib_per_node / spec.gpus_per_node if spec.cpu_only else None
    memory_gib = spec.gpu_memory_gib or share or (known.memory_gib if known else 0.0)
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
        cpu_only=spec.cpu_only,
    )


def product_read_as(pool: GPUPool) -> str | None:
    """`pool 'x': gpuProduct 'a100-80gb' is NVIDIA-A100-SXM4-80GB (80 GiB)` where the pool names its GPUs by
    another spelling than the product table's label (an alias or an NVML name), else None: the plan says which
    card it planned for."""
    spec = pool.spec
    if spec.cpu_only:
        return None
    try:
        known = gpu_product(spec.gpu_product)
    except KeyError:
        return None
    if known.product == spec.gpu_product:
        return None
    return f"pool {pool.metadata.name!r}: gpuProduct {spec.gpu_product!r} is {known.product} ({known.memory_gib:g} GiB)"
