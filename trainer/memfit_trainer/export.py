"""Write the run's result: the LoRA adapter, or the full model in 16-bit, plus the tokenizer.

The result goes to ``outputDir/final`` and appears there whole or not at all (written under
``final.tmp``, flushed, then renamed), so a consumer never picks up half a model. Under ZeRO-3 every rank
holds a slice of each weight; all ranks gather them layer by layer and rank 0 writes. On the fsdp2 engine
every rank holds a slice whatever the sharding: the full state dict is gathered to rank 0's host
(:meth:`~memfit_trainer.fsdp2_engine.Fsdp2Engine.consolidated_state_dict`, in the compute dtype).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from memfit_trainer.checkpoint import fsync_tree


def save_final(engine: Any, tokenizer: Any, final_dir: Path, *, rank: int, lora: bool) -> None:
    """Collective: every rank calls it; rank 0 writes ``final_dir``."""
    state_dict = None
    if hasattr(engine, "consolidated_state_dict"):  # fsdp2
        state_dict = engine.consolidated_state_dict()
    elif engine.zero_optimization_partition_weights():
        state_dict = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=lora)
    if rank == 0:
        tmp = final_dir.with_name(final_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        # A PeftModel saves only the adapter (it filters a full state dict down to the adapter's keys).
        engine.module.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        fsync_tree(tmp)
        if final_dir.exists():
            shutil.rmtree(final_dir)
        os.replace(tmp, final_dir)
    dist.barrier()
