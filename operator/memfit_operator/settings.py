"""How one operator process runs: flags of ``memfit operator``, each with an environment default."""

from __future__ import annotations

import os
from dataclasses import dataclass

from memfit_operator.objects import METRICS_PORT

DEFAULT_TRAINER_IMAGE = "ghcr.io/memfit/memfit-trainer:0.1.0"


@dataclass(frozen=True)
class OperatorSettings:
    namespace: str | None = None
    """Serve this namespace only; None: the whole cluster."""
    trainer_image: str = DEFAULT_TRAINER_IMAGE
    """Image of the trainer pods."""
    standalone: bool = False
    """No peering (a single replica, or a test)."""
    peering: str = "memfit"
    """Name of the (Cluster)KopfPeering object the replicas coordinate through."""
    metrics_port: int | None = 8080
    health_port: int | None = 8081
    resync_seconds: float = 10.0
    """Each job is reconciled at least this often (pod and job events wake it sooner)."""
    progress_seconds: float = 15.0
    """Rank 0's progress is read this often while running (status.progress stays under 30 s old)."""
    trainer_metrics_port: int = METRICS_PORT
    """Where trainer pods serve /metrics (tests point it at a local server)."""

    @classmethod
    def from_environment(cls) -> OperatorSettings:
        """Defaults overridable by MEMFIT_* variables (the way a Deployment or a test configures it)."""
        env, defaults = os.environ, cls()

        def number(name: str, default: float) -> float:
            value = env.get(name)
            return float(value) if value else default

        return cls(
            namespace=env.get("MEMFIT_NAMESPACE") or defaults.namespace,
            trainer_image=env.get("MEMFIT_TRAINER_IMAGE", defaults.trainer_image),
            standalone=env.get("MEMFIT_STANDALONE", "") in ("1", "true"),
            peering=env.get("MEMFIT_PEERING", defaults.peering),
            metrics_port=int(number("MEMFIT_METRICS_PORT", defaults.metrics_port or 0)),
            health_port=int(number("MEMFIT_HEALTH_PORT", defaults.health_port or 0)),
            resync_seconds=number("MEMFIT_RESYNC_SECONDS", defaults.resync_seconds),
            progress_seconds=number("MEMFIT_PROGRESS_SECONDS", defaults.progress_seconds),
            trainer_metrics_port=int(number("MEMFIT_TRAINER_METRICS_PORT", defaults.trainer_metrics_port)),
        )
