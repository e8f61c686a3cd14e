"""The knobs of one way to run a job, as the memory and throughput models compute with them.

A plain frozen dataclass because the planner builds thousands per search; ``memfit.api.plan.PlanStrategy``
is the same set of fields as the documented API object (a test keeps the two identical).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Strategy:
    method: str
    pool: str
    nodes: int
    gpus_per_node: int
    zero_stage: int
    offload_optimizer: str
    offload_parameters: str
    gradient_checkpointing: bool
    micro_batch_size: int
    gradient_accumulation_steps: int
    precision: str
    optimizer: str
    attention: str

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def summary(self) -> str:
        """One line a person can read, e.g. `full zero2 ckpt mb2x4 bf16 adamw on 2x8 a100`."""
        parts = [self.method, f"zero{self.zero_stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"opt->{self.offload_optimizer}")
        if self.offload_parameters != "none":
            parts.append(f"params->{self.offload_parameters}")
        if self.gradient_checkpointing:
            parts.append("ckpt")
        parts += [f"mb{self.micro_batch_size}x{self.gradient_accumulation_steps}", self.precision, self.optimizer]
        return " ".join(parts) + f" on {self.nodes}x{self.gpus_per_node} {self.pool}"
