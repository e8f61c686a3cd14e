"""Write the run's result: the LoRA adapter, or the full model in 16-bit, plus the tokenizer.

The result goes to ``outputDir/final`` and appears there whole or not at all (written under
``final.tmp``, flushed, then renamed), so a consumer never picks up half a model. Where the ranks hold slices
of the weights (DeepSpeed's ZeRO-3, the fsdp2 engine whatever the sharding) all ranks gather them
(:meth:`~memfit_trainer.training_engine.TrainingEngine.consolidated_state_dict`) and rank 0 writes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from memfit_trainer.checkpoint import fsync_tree
from memfit_trainer.training_engine import TrainingEngine


class _Pretrained(Protocol):
    """A ``transformers`` model or a peft model (which saves only the adapter)."""

    def save_pretrained(self, save_directory: Path, *, state_dict: dict[str, torch.Tensor] | None) -> None: ...


def save_final(engine: TrainingEngine, tokenizer: Any, final_dir: Path, *, rank: int) -> None:
    """Collective: every rank calls it; rank 0 writes ``final_dir``."""
    state_dict = engine.consolidated_state_dict()
    if rank == 0:
        tmp = final_dir.with_name(final_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        # A PeftModel saves only the adapter (it filters a full state dict down to the adapter's keys).
        cast(_Pretrained, engine.module).save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        fsync_tree(tmp)
        if final_dir.exists():
            shutil.rmtree(final_dir)
        os.replace(tmp, final_dir)
    dist.barrier()
