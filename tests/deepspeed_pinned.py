"""The host buffers DeepSpeed pins for offloaded states: a worker run under torchrun (2 CPU ranks, gloo).

For each case it renders the DeepSpeed config with memfit's own renderer (offloading, with two micro-batches
accumulated per step), builds the model and the engine with the trainer's own code, as
tests/deepspeed_allocations.py does, and runs one step. Every tensor DeepSpeed hands to
``get_accelerator().pin_memory`` is recorded by its size, from the model's construction (``zero.Init`` pins
ZeRO-3's offloaded parameter partitions) to the end of the step: on the CPU that call pins nothing and returns
its argument, on CUDA it is ``tensor.pin_memory()``, so the sizes are what a GPU run pins. The bytes of the
optimizer's states (pageable host memory) are recorded too. Each rank's figures are gathered; rank 0 writes
them.

Run it as ``python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.deepspeed_pinned
CASES.json OUT.json`` from the repository root with ``DS_ACCELERATOR=cpu`` (see
tests/test_pinned_vs_deepspeed.py).
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.plan import Strategy
from tests.deepspeed_allocations import MICRO_BATCH, SEQUENCE_LENGTH, SHAPES, WORLD_SIZE, Case, trainer_config

ACCUMULATION = 2
"""Micro-batches per step: ZeRO-1/2 pin their per-parameter accumulation buffers from the first one."""


@dataclass(frozen=True)
class OffloadCase(Case):
    """A case of tests/deepspeed_allocations.py with fp32 masters (DeepSpeed offloads no bf16 masters),
    offload and gradient accumulation."""

    master_weights: str = "fp32"
    offload_optimizer: str = "cpu"
    offload_parameters: str = "none"

    @property
    def name(self) -> str:
        return f"{super().name}-opt-{self.offload_optimizer}-param-{self.offload_parameters}"

    def strategy(self) -> Strategy:
        return (
            super()
            .strategy()
            .replaced(
                offload_optimizer=self.offload_optimizer,
                offload_parameters=self.offload_parameters,
                gradient_accumulation_steps=ACCUMULATION,
            )
        )

    def spec(self) -> FineTuneJobSpec:
        spec = super().spec()
        training = spec.training.model_copy(update={"global_batch_size": MICRO_BATCH * WORLD_SIZE * ACCUMULATION})
        return spec.model_copy(update={"training": training})


def measure(case: OffloadCase) -> dict[str, Any]:
    import torch
    from deepspeed.accelerator import get_accelerator

    from memfit_trainer.deepspeed_engine import build_deepspeed_engine
    from memfit_trainer.model import build_model

    accelerator = get_accelerator()
    pinned: list[int] = []
    pin_memory = accelerator.pin_memory

    def recording(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        pinned.append(tensor.nbytes)
        result: torch.Tensor = pin_memory(tensor, *args, **kwargs)
        return result

    accelerator.pin_memory = recording  # the accelerator is one object: every get_accelerator() returns it
    try:
        with tempfile.TemporaryDirectory(prefix="memfit-ds-pinned-") as scratch:
            config = trainer_config(case, Path(scratch))
            torch.manual_seed(0)
            batch = torch.randint(0, SHAPES[case.family].vocab_size, (MICRO_BATCH, SEQUENCE_LENGTH))
            engine = build_deepspeed_engine(config, build_model(config, 0).model, 10).engine
            for _ in range(ACCUMULATION):
                out = engine(input_ids=batch, labels=batch)
                engine.backward(out.loss)
                engine.step()
            states = sum(
                t.nbytes
                for s in engine.basic_optimizer.state.values()
                for t in s.values()
                if isinstance(t, torch.Tensor)
            )
            return {"case": asdict(case), "pinned": pinned, "optimizer_states": states, "loss": float(out.loss)}
    finally:
        del accelerator.pin_memory


def main() -> None:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    results = []
    for case in (OffloadCase(**c) for c in json.loads(Path(sys.argv[1]).read_text())):
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, measure(case))
        results.append({"case": ranks[0]["case"], "ranks": ranks})
        gc.collect()  # the engine's cycles go before the next case begins
    if dist.get_rank() == 0:
        Path(sys.argv[2]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
