"""Write the run's result: the LoRA adapter, or the full model in 16-bit, plus the tokenizer.

The result goes to ``outputDir/final`` and appears there whole or not at all (written under
``final.tmp``, flushed, then renamed), so a consumer never picks up half a model; an earlier export there (a
rerun of a finished job) is renamed aside only once the new one is complete, and removed after the swap
(:func:`_swap_into_place`). Where the ranks hold slices
of the weights (DeepSpeed's ZeRO-3, the fsdp2 engine whatever the sharding) all ranks gather them
(:meth:`~memfit_trainer.training_engine.TrainingEngine.consolidated_state_dict`) and rank 0 writes.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from memfit_trainer.checkpoint import fsync_tree, write_final_marker
from memfit_trainer.protocol_hold import hold_at
from memfit_trainer.training_engine import TrainingEngine


class _Pretrained(Protocol):
    """A ``transformers`` model or a peft model (which saves only the adapter)."""

    def save_pretrained(self, save_directory: Path, *, state_dict: dict[str, torch.Tensor] | None) -> None: ...


def save_final(
    engine: TrainingEngine, tokenizer: Any, final_dir: Path, *, rank: int, marker: Mapping[str, Any]
) -> None:
    """Collective: every rank calls it; rank 0 writes ``final_dir``, with ``marker`` (what it is the model of)."""
    state_dict = engine.consolidated_state_dict()
    if rank == 0:
        tmp = final_dir.with_name(final_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        # A PeftModel saves only the adapter (it filters a full state dict down to the adapter's keys).
        cast(_Pretrained, engine.module).save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        write_final_marker(tmp, marker)
        fsync_tree(tmp)
        hold_at("final-written", int(marker["step"]))
        _swap_into_place(tmp, final_dir)
    dist.barrier()


def _swap_into_place(complete: Path, final_dir: Path) -> None:
    """Rename the complete export ``complete`` to ``final_dir``. A complete export is on disk at every instant:
    the earlier one is renamed to ``final.previous`` first and removed only after the new one is in place (a
    crash between the two renames leaves both, under their temporary names, for the rerun to redo)."""
    previous = final_dir.with_name(final_dir.name + ".previous")
    shutil.rmtree(previous, ignore_errors=True)
    if final_dir.exists():
        os.replace(final_dir, previous)
    os.replace(complete, final_dir)
    shutil.rmtree(previous, ignore_errors=True)
