"""How one operator process runs: flags of ``memfit operator``, each with an environment default."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memfit.api.runtime import IMAGE_RUNTIME, Runtime
from memfit.units import GIB
from memfit_operator.objects import METRICS_PORT, TrainerOptions

DEFAULT_TRAINER_IMAGE = "ghcr.io/memfit/memfit-trainer:0.1.0"


@dataclass(frozen=True)
class OperatorSettings:
    namespace: str | None = None
    """Serve this namespace only; None: the whole cluster."""
    trainer_image: str = DEFAULT_TRAINER_IMAGE
    """Image of the trainer pods."""
    trainer_cpu_image: str = ""
    """Image of the trainer pods on CPU pools (``gpuProduct: cpu``); empty: ``trainer_image``."""
    standalone: bool = False
    """No peering (a single replica, or a test)."""
    peering: str = "memfit"
    """Name of the (Cluster)KopfPeering object the replicas coordinate through."""
    peering_notice_seconds: float = 60.0
    """While the peering object is missing (kopf then keeps every handler paused), say so this often."""
    metrics_port: int | None = 8080
    health_port: int | None = 8081
    resync_seconds: float = 10.0
    """Each job is reconciled at least this often (pod and job events wake it sooner)."""
    progress_seconds: float = 15.0
    """Rank 0's progress is read this often while running (status.progress stays under 30 s old)."""
    trainer_metrics_port: int = METRICS_PORT
    """Where trainer pods serve /metrics (tests point it at a local server)."""
    trainer_cache_gib: float = 50.0
    """Room in a trainer pod's cache volume (datasets cache and the like) besides the downloaded weights."""
    network_policy: bool = False
    """Create a NetworkPolicy with each attempt (the chart turns it on: networkPolicy.enabled)."""
    network_policy_metrics_from: tuple[Mapping[str, Any], ...] = ()
    """NetworkPolicy peers (the operator, Prometheus) let into the trainer pods' metrics ports."""
    trainer_runtime: Runtime = IMAGE_RUNTIME
    """The kernel packages the trainer image carries beyond torch (flash-attn...): the chart's
    ``trainer.kernelPackages``, comma-separated in MEMFIT_TRAINER_KERNEL_PACKAGES."""

    def trainer_options(self) -> TrainerOptions:
        return TrainerOptions(
            cache_bytes=int(self.trainer_cache_gib * GIB),
            network_policy=self.network_policy,
            metrics_peers=self.network_policy_metrics_from,
            cpu_image=self.trainer_cpu_image or None,
            runtime=self.trainer_runtime,
        )

    @classmethod
    def from_environment(cls) -> OperatorSettings:
        """Defaults overridable by MEMFIT_* variables (the way a Deployment or a test configures it)."""
        env, defaults = os.environ, cls()

        def number(name: str, default: float) -> float:
            value = env.get(name)
            try:
                return float(value) if value else default
            except ValueError:
                raise ValueError(f"{name}={value!r} is not a number") from None

        def flag(name: str, default: bool) -> bool:
            value = env.get(name)
            return value.lower() in ("1", "true", "yes") if value else default

        def peers(name: str) -> tuple[Mapping[str, Any], ...]:
            value = json.loads(env.get(name) or "[]")
            if not isinstance(value, list) or not all(isinstance(peer, dict) for peer in value):
                raise ValueError(f"{name} must be a JSON list of NetworkPolicy peers (objects)")
            return tuple(value)

        return cls(
            namespace=env.get("MEMFIT_NAMESPACE") or defaults.namespace,
            trainer_image=env.get("MEMFIT_TRAINER_IMAGE", defaults.trainer_image),
            trainer_cpu_image=env.get("MEMFIT_TRAINER_CPU_IMAGE", defaults.trainer_cpu_image),
            standalone=flag("MEMFIT_STANDALONE", defaults.standalone),
            peering=env.get("MEMFIT_PEERING", defaults.peering),
            peering_notice_seconds=number("MEMFIT_PEERING_NOTICE_SECONDS", defaults.peering_notice_seconds),
            metrics_port=int(number("MEMFIT_METRICS_PORT", defaults.metrics_port or 0)),
            health_port=int(number("MEMFIT_HEALTH_PORT", defaults.health_port or 0)),
            resync_seconds=number("MEMFIT_RESYNC_SECONDS", defaults.resync_seconds),
            progress_seconds=number("MEMFIT_PROGRESS_SECONDS", defaults.progress_seconds),
            trainer_metrics_port=int(number("MEMFIT_TRAINER_METRICS_PORT", defaults.trainer_metrics_port)),
            trainer_cache_gib=number("MEMFIT_TRAINER_CACHE_GIB", defaults.trainer_cache_gib),
            network_policy=flag("MEMFIT_NETWORK_POLICY", defaults.network_policy),
            network_policy_metrics_from=peers("MEMFIT_NETWORK_POLICY_METRICS_FROM"),
            trainer_runtime=_kernel_packages(env.get("MEMFIT_TRAINER_KERNEL_PACKAGES", "")),
        )


def _kernel_packages(value: str) -> Runtime:
    try:
        return Runtime.of(value.split(","))
    except ValueError as error:
        raise ValueError(f"MEMFIT_TRAINER_KERNEL_PACKAGES: {error}") from None
