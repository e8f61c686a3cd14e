"""QLoRA sharded by the fsdp2 engine, on 2 CPU ranks (gloo), in one test process that spawns them.

Each rank builds the tiny llama's 4-bit base (bf16 quant storage) with its adapters, shards it with the
trainer's own ``build_fsdp2_engine`` and trains a few steps on one repeated batch, with the parameters
resharded after the forward (FSDP2 frees each gathered packed weight and gathers it again for the backward)
or kept, fp32 or bf16 masters, and CPU offload. What it must show: the loss falls, the packed 4-bit codes
(compared bit for bit: as bf16 they read as NaNs) and the other frozen weights never change, the adapters do;
and the memory model's per-rank parameter bytes are exactly the storages each rank holds (its shards, and
every ``Linear4bit``'s replicated quant state).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from memfit.api.plan import Strategy
from memfit.api.vocabulary import Attention, Engine, MasterWeights, Method, Offload, Optimizer, Precision
from memfit.memory.estimate import model_states
from memfit.memory.setup import Adapters
from tests.trainer.runs import MICRO_BATCH, TINY_LLAMA, WORLD_SIZE, make_config

pytestmark = pytest.mark.distributed

STEPS = 4
CASES: dict[str, dict[str, Any]] = {
    "reshard fp32-masters": dict(stage=3, offload=False),
    "keep fp32-masters": dict(stage=2, offload=False),
    "reshard bf16-masters": dict(stage=3, offload=False, master_weights="bf16"),
    "reshard cpu-offload": dict(stage=3, offload=True),
}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone().view(torch.uint8)


def _quant_state_tensors(module: Any) -> list[torch.Tensor]:  # a bitsandbytes Linear4bit
    state = module.quant_state
    return [state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code]


def _rank(rank: int, directory: Path, options: dict[str, Any]) -> None:
    from bitsandbytes.nn.modules import Linear4bit

    from memfit_trainer.fsdp2_engine import build_fsdp2_engine
    from memfit_trainer.model import build_model

    dist.init_process_group("gloo", init_method=f"file://{directory / 'store'}", rank=rank, world_size=WORLD_SIZE)
    try:
        (directory / f"rank{rank}").mkdir()
        config = make_config(directory / f"rank{rank}", engine="fsdp2", method="qlora", max_steps=STEPS,
                             learning_rate=1e-2, **options)  # fmt: skip
        engine = build_fsdp2_engine(config, build_model(config).model, total_steps=STEPS)
        params: dict[str, Any] = dict(engine.module.named_parameters())  # DTensors
        shards = sum(p.to_local().untyped_storage().nbytes() for p in params.values())
        linears = [m for m in engine.module.modules() if isinstance(m, Linear4bit)]
        quant_states = sum(t.untyped_storage().nbytes() for m in linears for t in _quant_state_tensors(m))
        before = {n: _bits(p.to_local()) for n, p in params.items()}
        torch.manual_seed(0)
        ids = torch.randint(0, TINY_LLAMA.vocab_size, (MICRO_BATCH, 32))
        losses = []
        for _ in range(STEPS):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        changed = [n for n, p in params.items() if not torch.equal(_bits(p.to_local()), before[n])]
        result = {
            "losses": losses,
            "changed": changed,
            "trainable": [n for n, p in params.items() if p.requires_grad],
            "packed": sorted({str(m.weight.dtype) for m in linears}),
            "shard_bytes": shards,
            "quant_state_bytes": quant_states,
            "quant_state_devices": sorted({str(t.device) for m in linears for t in _quant_state_tensors(m)}),
        }
        (directory / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _strategy(options: dict[str, Any]) -> Strategy:
    offload = Offload.CPU if options["offload"] else Offload.NONE
    return Strategy(
        method=Method.QLORA, pool="p", nodes=1, gpus_per_node=WORLD_SIZE, zero_stage=options["stage"],
        offload_optimizer=offload, offload_parameters=offload, gradient_checkpointing=False,
        micro_batch_size=MICRO_BATCH, gradient_accumulation_steps=1, precision=Precision.BF16,
        optimizer=Optimizer.ADAMW, attention=Attention.SDPA,
        master_weights=MasterWeights(options.get("master_weights", "fp32")), engine=Engine.FSDP2,
    )  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_qlora_trains_only_adapters_and_holds_what_the_model_counts(tmp_path: Path, case: str) -> None:
    options = CASES[case]
    mp.start_processes(  # type: ignore[no-untyped-call]
        _rank, args=(tmp_path, options), nprocs=WORLD_SIZE, start_method="spawn"
    )
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    lora = make_config(tmp_path, method="qlora").training.lora
    states = model_states(TINY_LLAMA, _strategy(options), Adapters(lora.rank, tuple(lora.target_modules)))
    for result in results:
        losses = result["losses"]
        assert losses[-1] < losses[0] - 0.05, losses
        assert result["trainable"] and all("lora_" in n for n in result["trainable"])
        assert sorted(result["changed"]) == sorted(result["trainable"])  # the 4-bit base never moves
        assert result["packed"] == ["torch.bfloat16"]  # the 4-bit codes in bf16 storage
        assert result["quant_state_devices"] == ["cpu"]
        if options["offload"]:  # the shards are host memory; the replicated quant states stay with the compute
            assert states.parameters == result["quant_state_bytes"]
            assert states.cpu_per_rank >= result["shard_bytes"]
        else:
            assert states.parameters == result["shard_bytes"] + result["quant_state_bytes"]
