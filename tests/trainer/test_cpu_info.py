"""DeepSpeed's CPU ops are built for the same CPU when the kernel answers py-cpuinfo's questions
(memfit_trainer.cpu_info): the same compiler flags, so the ops compiled before are the ones loaded."""

from __future__ import annotations

from typing import Any

import cpuinfo
import pytest

from memfit_trainer import cpu_info


def build_flags() -> tuple[str, str, str]:
    """What DeepSpeed's CPU Adam builder compiles with, and the vendor its optimizer reads."""
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    builder = CPUAdamBuilder()
    return builder.cpu_arch(), builder.simd_width(), cpuinfo.get_cpu_info().get("vendor_id_raw", "")


def test_deepspeed_builds_for_the_same_cpu_from_the_kernels_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = build_flags()  # py-cpuinfo's own answer (its CPUID probe, in a subprocess)
    original = cpuinfo.get_cpu_info
    calls: list[int] = []

    def counted() -> dict[str, Any]:
        calls.append(1)
        return original()

    monkeypatch.setattr(cpuinfo, "get_cpu_info", counted)
    cpu_info.ask_the_kernel_once()
    assert build_flags() == asked and build_flags() == asked
    assert calls == ([] if cpu_info.kernel_cpu_info(lambda: {}) else [1])  # py-cpuinfo only without /proc/cpuinfo
    cpu_info.ask_the_kernel_once()  # once: not wrapped again
    assert (
        hasattr(cpuinfo.get_cpu_info, "cache_info")
        and cpuinfo.get_cpu_info.__wrapped__.func is cpu_info.kernel_cpu_info
    )


def test_without_the_kernels_answer_py_cpuinfos_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    from cpuinfo import cpuinfo as source

    monkeypatch.setattr(source, "_get_cpu_info_from_proc_cpuinfo", lambda: {})
    assert cpu_info.kernel_cpu_info(lambda: {"arch": "PPC_64", "flags": []}) == {"arch": "PPC_64", "flags": []}
    monkeypatch.delattr(source, "_parse_arch")
    assert cpu_info.kernel_cpu_info(lambda: {"asked": True}) == {"asked": True}
