"""What the trainer's install carries beyond torch: the optional kernel packages a plan may use.

A plan names only kernels its trainer has. torch brings SDPA, eager and flex attention; flash-attention 2 and
flash-linear-attention are packages of their own that neither ``pip install 'memfit[trainer]'`` nor memfit's
trainer image installs (both compile CUDA code against the local toolkit: hours on a small builder). So they
are planned only where the runtime says it has them: ``memfit run --local`` finds out by looking for their
modules, the operator reads ``trainer.kernelPackages`` from the chart (what the cluster's trainer image
carries), ``memfit plan --trainer-packages`` says it for an offline question.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from memfit.api.vocabulary import Attention


@dataclass(frozen=True, slots=True)
class KernelPackage:
    """A package the trainer imports a kernel from."""

    distribution: str
    """pip's name for it."""
    module: str
    """The module the trainer imports."""


TORCH: Final = KernelPackage("torch", "torch")
FLASH_ATTN: Final = KernelPackage("flash-attn", "flash_attn")
FLASH_LINEAR_ATTENTION: Final = KernelPackage("flash-linear-attention", "fla")
"""Gated DeltaNet's kernels, which keep packed documents apart in linear-attention layers (with flash
attention, which hands transformers the documents' boundaries)."""

OPTIONAL_PACKAGES: Final = {package.distribution: package for package in (FLASH_ATTN, FLASH_LINEAR_ATTENTION)}
"""The kernel packages a trainer may or may not have, by pip's name."""

ATTENTION_PACKAGE: Final[dict[Attention, KernelPackage]] = {
    Attention.SDPA: TORCH,
    Attention.EAGER: TORCH,
    Attention.FLEX: TORCH,
    Attention.FLASH: FLASH_ATTN,
}
"""The package each attention kernel comes from."""


@dataclass(frozen=True, slots=True)
class Runtime:
    """The optional kernel packages the trainer that runs a plan has (pip names)."""

    packages: frozenset[str] = frozenset()

    @classmethod
    def of(cls, names: Iterable[str]) -> Runtime:
        """The runtime with these packages; ValueError naming an unknown one."""
        chosen = frozenset(name.strip() for name in names if name.strip())
        unknown = sorted(chosen - OPTIONAL_PACKAGES.keys())
        if unknown:
            known = ", ".join(OPTIONAL_PACKAGES)
            raise ValueError(f"unknown kernel package {', '.join(unknown)}: memfit plans with {known}")
        return cls(chosen)

    @classmethod
    def local(cls) -> Runtime:
        """The packages this Python environment can import (what ``memfit run --local`` trains with)."""
        return cls(frozenset(name for name, p in OPTIONAL_PACKAGES.items() if importlib.util.find_spec(p.module)))

    def has(self, package: KernelPackage) -> bool:
        return package is TORCH or package.distribution in self.packages

    def runs(self, attention: Attention) -> bool:
        """Whether the trainer has the kernel's package."""
        return self.has(ATTENTION_PACKAGE[attention])


IMAGE_RUNTIME: Final = Runtime()
"""What memfit's trainer image carries (the Dockerfile's default build): torch's kernels only. The chart's
``trainer.kernelPackages`` default says the same (tests/chart/test_dockerfile.py holds them together)."""


def package_needed(attention: Attention) -> str:
    """The pip name of the package ``attention`` comes from (``torch`` for PyTorch's own kernels)."""
    return ATTENTION_PACKAGE[attention].distribution
