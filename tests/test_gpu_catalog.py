"""Integrity of the built-in GPU product table and its lookups."""

from __future__ import annotations

import dataclasses

import pytest

from memfit.catalog.gpus import GPU_ALIASES, GPU_PRODUCTS, AmbiguousProduct, GPUProduct, gpu_product, unknown_product

REQUIRED = [
    "NVIDIA-A100-SXM4-40GB",
    "NVIDIA-A100-SXM4-80GB",
    "NVIDIA-A100-PCIE-40GB",
    "NVIDIA-A100-80GB-PCIe",
    "NVIDIA-H100-80GB-HBM3",
    "NVIDIA-H100-PCIe",
    "NVIDIA-H100-NVL",
    "NVIDIA-H200",
    "NVIDIA-B200",
    "NVIDIA-L4",
    "NVIDIA-L40",
    "NVIDIA-L40S",
    "NVIDIA-A10",
    "NVIDIA-A10G",
    "NVIDIA-A30",
    "NVIDIA-A40",
    "Tesla-T4",
    "Tesla-V100-SXM2-16GB",
    "Tesla-V100-SXM2-32GB",
    "NVIDIA-RTX-A6000",
    "NVIDIA-RTX-6000-Ada-Generation",
    "NVIDIA-GeForce-RTX-4090",
    "NVIDIA-GeForce-RTX-3090",
]


def test_required_products_present() -> None:
    assert set(REQUIRED) <= set(GPU_PRODUCTS)


@pytest.mark.parametrize("label", sorted(GPU_PRODUCTS))
def test_row_integrity(label: str) -> None:
    p = GPU_PRODUCTS[label]
    assert p.product == label
    assert " " not in label  # GFD replaces spaces with dashes
    assert p.memory_gib > 0
    assert p.bf16 == (p.peak_tflops_bf16 is not None)
    if p.peak_tflops_bf16 is not None:
        assert p.peak_tflops_bf16 > 0
    assert p.peak_tflops_fp16 > 0
    assert p.intra_node_gbps > 0
    assert p.pcie_gbps > 0
    # NVLink or PCIe, never slower than the host link
    assert p.intra_node_gbps >= p.pcie_gbps


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        GPU_PRODUCTS["Tesla-T4"].memory_gib = 1.0  # type: ignore[misc]


def test_bf16_by_generation() -> None:
    assert not gpu_product("t4").bf16
    assert not gpu_product("v100-32gb").bf16
    for name in ("a100-80gb", "a10g", "l4", "h100", "b200", "rtx-3090", "rtx-4090"):
        assert gpu_product(name).bf16, name


def test_memory_as_driver_reports_it() -> None:
    assert gpu_product("NVIDIA-A100-SXM4-80GB").memory_gib == 80.0
    assert gpu_product("NVIDIA-H100-80GB-HBM3").memory_gib == pytest.approx(81559 / 1024)
    assert gpu_product("NVIDIA-H100-80GB-HBM3").memory_gib == pytest.approx(79.65, abs=0.005)
    assert gpu_product("Tesla-T4").memory_gib == 15.0
    assert gpu_product("NVIDIA-H200").memory_gib == pytest.approx(143771 / 1024)


def test_dense_not_sparse() -> None:
    # The datasheet headline for H100 SXM is 1,979 TFLOPS *with sparsity*; the table holds half.
    assert gpu_product("h100").peak_tflops_bf16 == pytest.approx(989.4, abs=1)
    assert gpu_product("a100-40gb").peak_tflops_bf16 == 312.0
    assert gpu_product("l4").peak_tflops_bf16 == 121.0


def test_lookup_case_insensitive_and_nvml_names() -> None:
    assert gpu_product("nvidia-a100-sxm4-80gb") is GPU_PRODUCTS["NVIDIA-A100-SXM4-80GB"]
    assert gpu_product("NVIDIA-A100-SXM4-80GB") is GPU_PRODUCTS["NVIDIA-A100-SXM4-80GB"]
    # nvidia-smi spells the same device with spaces
    assert gpu_product("NVIDIA H100 80GB HBM3") is GPU_PRODUCTS["NVIDIA-H100-80GB-HBM3"]
    assert gpu_product("Tesla T4") is GPU_PRODUCTS["Tesla-T4"]
    assert gpu_product("  NVIDIA A100 80GB PCIe ") is GPU_PRODUCTS["NVIDIA-A100-80GB-PCIe"]


@pytest.mark.parametrize(
    ("alias", "label"),
    [
        ("a100-80gb", "NVIDIA-A100-SXM4-80GB"),
        ("A100-40GB", "NVIDIA-A100-SXM4-40GB"),
        ("h100", "NVIDIA-H100-80GB-HBM3"),
        ("H100-PCIe", "NVIDIA-H100-PCIe"),
        ("l4", "NVIDIA-L4"),
        ("L40S", "NVIDIA-L40S"),
        ("t4", "Tesla-T4"),
        ("rtx-6000-ada", "NVIDIA-RTX-6000-Ada-Generation"),
        ("nvidia-tesla-t4", "Tesla-T4"),
    ],
)
def test_aliases(alias: str, label: str) -> None:
    assert gpu_product(alias).product == label


def test_every_alias_resolves() -> None:
    for alias, label in GPU_ALIASES.items():
        assert alias == alias.lower()
        assert label in GPU_PRODUCTS, alias
        assert gpu_product(alias) is GPU_PRODUCTS[label]


def test_unknown_lists_known_products() -> None:
    with pytest.raises(KeyError) as err:
        gpu_product("NVIDIA-Z9000")
    msg = str(err.value)
    assert "NVIDIA-Z9000" in msg
    assert "NVIDIA-A100-SXM4-80GB" in msg and "Tesla-T4" in msg


def test_an_unknown_label_is_echoed_short_and_escaped() -> None:
    with pytest.raises(KeyError) as err:
        gpu_product("\x1b[31m" + "G" * 100_000)
    shown = unknown_product("\x1b[31m" + "G" * 100_000)
    assert shown in err.value.args[0] and shown.isprintable() and len(shown) < 120


def test_mig_and_shared_labels_are_not_whole_gpus() -> None:
    with pytest.raises(KeyError, match="MIG"):
        gpu_product("NVIDIA-A100-80GB-PCIe-MIG-1g.10gb")
    with pytest.raises(KeyError, match="SHARED"):
        gpu_product("NVIDIA-A10G-SHARED")


def test_is_dataclass_with_expected_fields() -> None:
    names = [f.name for f in dataclasses.fields(GPUProduct)]
    assert names == [
        "product",
        "memory_gib",
        "bf16",
        "peak_tflops_bf16",
        "peak_tflops_fp16",
        "intra_node_gbps",
        "pcie_gbps",
    ]


@pytest.mark.parametrize("alias", ["A100", "a100", "V100", " v100 "])
def test_a_short_name_sold_in_several_sizes_is_refused_not_read_as_the_smaller_card(alias: str) -> None:
    with pytest.raises(AmbiguousProduct, match="names several cards") as refused:
        gpu_product(alias)
    assert "80 GiB" in str(refused.value) or "32 GiB" in str(refused.value)
