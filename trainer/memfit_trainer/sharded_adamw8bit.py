"""bitsandbytes' 8-bit AdamW, plain and paged, on FSDP2's sharded parameters (``memfit_trainer.sharded_8bit``):
imported only by a run that trains with it (``memfit_trainer.optimization``)."""

from __future__ import annotations

from bitsandbytes.optim.adamw import AdamW8bit, PagedAdamW8bit

from memfit_trainer.sharded_8bit import OnLocalShards


class ShardedAdamW8bit(OnLocalShards, AdamW8bit):
    """bitsandbytes' ``AdamW8bit`` on FSDP2's DTensor parameters."""


class ShardedPagedAdamW8bit(OnLocalShards, PagedAdamW8bit):
    """bitsandbytes' ``PagedAdamW8bit`` (states in CUDA managed memory) on FSDP2's DTensor parameters."""
