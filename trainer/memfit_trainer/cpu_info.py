"""The CPU facts DeepSpeed builds its CPU ops for, asked of the kernel once per process.

DeepSpeed's op builders (``cpu_arch``, ``simd_width``) and its CPU Adam ask py-cpuinfo's ``get_cpu_info`` for the
architecture, the SIMD flags and the vendor, three times as CPU Adam builds. py-cpuinfo answers each time from a
subprocess that probes CPUID with timing loops (about a CPU-second a time, in every rank of every run). On Linux
the kernel's ``/proc/cpuinfo``, which py-cpuinfo reads too, holds the same fields, with the flags the kernel
enables; elsewhere py-cpuinfo's own answer is kept, asked once.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable
from typing import Any


def kernel_cpu_info(asked: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """py-cpuinfo's fields from ``/proc/cpuinfo`` and the machine's architecture; ``asked()`` (py-cpuinfo's own
    answer) where the kernel has no such file or py-cpuinfo no longer parses it."""
    from cpuinfo import cpuinfo as source  # DeepSpeed's own dependency

    try:
        found: dict[str, Any] = source._get_cpu_info_from_proc_cpuinfo()
        arch, bits = source._parse_arch(platform.machine())
    except (AttributeError, OSError, ValueError):  # another py-cpuinfo's private functions
        return asked()
    if not found.get("flags") or arch is None:
        return asked()
    return {**found, "arch": arch, "bits": bits}


def ask_the_kernel_once() -> None:
    """Make py-cpuinfo's ``get_cpu_info`` answer from :func:`kernel_cpu_info`, once per process."""
    import cpuinfo

    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(functools.partial(kernel_cpu_info, cpuinfo.get_cpu_info))
