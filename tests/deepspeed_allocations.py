"""What DeepSpeed really allocates for model states: a worker run under torchrun (2 CPU ranks, gloo).

For each case it renders the DeepSpeed config with memfit's own renderer (``memfit.render.deepspeed``), builds
the model and the engine with the trainer's own code (``memfit_trainer.model.build_model``,
``memfit_trainer.deepspeed_engine.build_deepspeed_engine``), runs one optimizer step on a fixed batch and counts
the bytes of every live tensor storage (``gc`` plus each leaf's ``.grad``; a storage shared by views counts
once) at four moments: after ``deepspeed.initialize``, after the backward pass, inside the optimizer step (a
``register_step_post_hook`` on the optimizer DeepSpeed steps, the moment the step's gradient partition and
the new states are alive together) and after the step. Storages that were alive before the model was built,
the input batch, and ZeRO-3's reduce bucket (``ipg_buckets``: a communication buffer, which memfit counts in
its overhead) are left out.

The bytes are sorted by what holds them, through the public optimizer API only: ``weights`` are the storages
of the module's parameters (and ZeRO-3's partitions, ``ds_tensor``); ``masters`` the storages of the
optimizer's own parameters that are not weights (fp32 or bf16 master partitions); ``states`` the tensors of
``optimizer.state``; ``step_gradients`` the ``.grad`` of the optimizer's own parameters inside the step when
it is not a gradient of the module; ``gradients`` everything the backward pass left alive beyond the init.

Run it as ``python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.deepspeed_allocations
CASES.json OUT.json`` from the repository root with ``DS_ACCELERATOR=cpu`` (see
tests/test_states_vs_deepspeed.py); rank 0 writes the results.
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
from memfit.model_shape import ModelFamily, ModelShape

WORLD_SIZE = 2
MICRO_BATCH = 2
SEQUENCE_LENGTH = 32

SHAPES = {
    "llama": ModelShape(ModelFamily.LLAMA, 64, 128, 2, 4, 2, 258),
    "qwen2": ModelShape(ModelFamily.QWEN2, 64, 160, 2, 4, 2, 258, tie_word_embeddings=True),
    "mistral": ModelShape(ModelFamily.MISTRAL, 64, 192, 2, 4, 1, 258),
}
"""Tiny shapes of three families: grouped-query attention everywhere, Qwen2's biases and tied embeddings.
Their tensors straddle bitsandbytes' ``min_8bit_size`` (4096 elements): 64 x 64 and larger get 8-bit states,
k/v projections (64 x 32 or 64 x 16), norms and biases 32-bit ones."""


@dataclass(frozen=True)
class Case:
    family: str
    zero_stage: int
    master_weights: str = "bf16"
    optimizer: str = "adamw"
    method: str = "full"

    @property
    def name(self) -> str:
        return f"{self.family}-{self.method}-zero{self.zero_stage}-{self.master_weights}-{self.optimizer}"

    def strategy(self) -> Strategy:
        return Strategy(
            method=self.method, pool="cpu", nodes=1, gpus_per_node=WORLD_SIZE, zero_stage=self.zero_stage,
            offload_optimizer="none", offload_parameters="none", gradient_checkpointing=False,
            micro_batch_size=MICRO_BATCH, gradient_accumulation_steps=1, precision="bf16",
            optimizer=self.optimizer, attention="sdpa", master_weights=self.master_weights,
        )  # type: ignore[arg-type]  # fmt: skip

    def spec(self) -> FineTuneJobSpec:
        shape = SHAPES[self.family]
        architecture = {
            "family": shape.family.value, "hiddenSize": shape.hidden_size,
            "intermediateSize": shape.intermediate_size, "numLayers": shape.num_layers,
            "numAttentionHeads": shape.num_attention_heads, "numKeyValueHeads": shape.num_key_value_heads,
            "vocabSize": shape.vocab_size, "tieWordEmbeddings": shape.tie_word_embeddings,
        }  # fmt: skip
        return FineTuneJobSpec.model_validate({
            "model": {"name": f"tiny-{self.family}", "randomInit": True, "architecture": architecture},
            "dataset": {"source": {"pvc": "data"}},
            "method": self.method,
            "training": {"globalBatchSize": MICRO_BATCH * WORLD_SIZE, "sequenceLength": SEQUENCE_LENGTH,
                         "maxSteps": 10, "precision": "bf16", "optimizer": self.optimizer, "learningRate": 1e-3},
            "output": {"pvc": "out"},
        })  # fmt: skip


def trainer_config(case: Case, scratch: Path) -> Any:
    from memfit.contract.engines import DeepSpeedEngineSection
    from memfit.contract.sections import DataConfig, LoraConfig, ModelConfig, TrainingConfig
    from memfit.contract.trainer_config import TrainerConfig
    from memfit.render.deepspeed import deepspeed_config

    spec, strategy = case.spec(), case.strategy()
    data = scratch / "data.jsonl"
    data.write_text('{"text": "x"}\n')
    return TrainerConfig(
        job=f"test/{case.name}",
        model=ModelConfig(name_or_path=f"tiny-{case.family}", random_init=True, architecture=SHAPES[case.family]),
        data=DataConfig(path=str(data), text_field="text"),
        training=TrainingConfig(
            method=case.method, sequence_length=SEQUENCE_LENGTH, micro_batch_size=MICRO_BATCH,
            gradient_accumulation_steps=strategy.gradient_accumulation_steps,
            global_batch_size=spec.training.global_batch_size, max_steps=10,
            learning_rate=1e-3, optimizer=case.optimizer, precision="bf16", master_weights=case.master_weights,
            lora=LoraConfig(rank=8, alpha=16, dropout=0.0),
        ),
        output_dir=str(scratch / "output"),
        engine=DeepSpeedEngineSection(config=deepspeed_config(spec, strategy)),
    )  # type: ignore[arg-type]  # fmt: skip


def _storages(tensors: Any) -> dict[int, int]:
    """Storage address -> bytes of every real (not meta, not empty) tensor in ``tensors``."""
    import torch

    found: dict[int, int] = {}
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


def live_tensors() -> list[Any]:
    """Every live tensor reachable from Python, and the gradients of leaf tensors."""
    import torch

    gc.collect()
    tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    return tensors + [t.grad for t in tensors if t.is_leaf and t.requires_grad and t.grad is not None]


def live_storages() -> dict[int, int]:
    """The storages of :func:`live_tensors`. (Storages are told apart by address: hold the tensors of one
    moment while comparing it with another, or a freed address reused in between would alias.)"""
    return _storages(live_tensors())


def _norm_function(engine: Any, zero_stage: int) -> tuple[Any, str]:
    """Where DeepSpeed computes the gradient norm of a step (the names of its code, for this measurement)."""
    if zero_stage == 0:
        return (engine, "clip_fp32_gradients") if not engine.bfloat16_enabled() else (None, "")
    return engine.optimizer, "_get_norm_groups" if zero_stage == 3 else "scaled_global_norm"


def _recording_peak(record: dict[str, Any], key: str, function: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``function``, recording in ``record[key]`` the peak bytes it had allocated beyond what it freed."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        result = function(*args, **kwargs)
    live = peak = 0
    for event in sorted(
        (e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    ):
        live += event.nbytes()
        peak = max(peak, live)
    record[key] = peak
    return result


def measure(case: Case) -> dict[str, Any]:
    import torch

    from memfit_trainer.deepspeed_engine import build_deepspeed_engine
    from memfit_trainer.model import build_model

    with tempfile.TemporaryDirectory(prefix="memfit-ds-alloc-") as scratch:
        config = trainer_config(case, Path(scratch))
        torch.manual_seed(0)
        batch = torch.randint(0, SHAPES[case.family].vocab_size, (MICRO_BATCH, SEQUENCE_LENGTH))
        alive_before = live_tensors()  # held to the end: their addresses cannot be reused meanwhile
        before = _storages(alive_before)
        built = build_model(config, 0)
        engine = build_deepspeed_engine(config, built.model, 10).engine
        inner = engine.basic_optimizer  # what DeepSpeed steps: on its masters under ZeRO, else the parameters
        params = list(engine.module.parameters())
        buckets = [b.buffer for b in getattr(engine.optimizer, "ipg_buckets", {}).values() if b.buffer is not None]
        ignored = set(before) | set(_storages([batch, *buckets]))

        def new(storages: dict[int, int]) -> dict[int, int]:
            return {ptr: size for ptr, size in storages.items() if ptr not in ignored}

        def quant_states() -> list[Any]:
            found = [q for q in (getattr(p, "quant_state", None) for p in params) if q is not None]
            return found + [q.state2 for q in found if q.nested]

        def weight_storages() -> dict[int, int]:
            # ZeRO-3's partitions, and QLoRA's 4-bit quantization scales (not parameters themselves).
            absmax = [q.absmax for q in quant_states()]
            return _storages([*params, *(getattr(p, "ds_tensor", None) for p in params), *absmax])

        def quantization_maps() -> dict[int, int]:
            """The rest of QLoRA's quantization state: the 16-value NF4 code, the 256-value map of the
            double-quantized scales and their offset, per weight (1 KiB each: not modelled)."""
            return _storages(t for q in quant_states() for t in vars(q).values())

        def optimizer_params() -> list[Any]:
            return [p for group in inner.param_groups for p in group["params"]]

        at_init = new(live_storages())
        weights = weight_storages()
        masters: dict[int, int] = {}  # ZeRO-3 hands the optimizer its partitions only while it steps
        step: dict[str, Any] = {}

        def note_masters() -> None:
            masters.update((k, v) for k, v in _storages(optimizer_params()).items() if k not in weights)

        def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            note_masters()
            module_grads = _storages(p.grad for p in params)
            grads = _storages(p.grad for p in optimizer_params())
            step["step_gradients"] = sum(v for k, v in grads.items() if k not in module_grads)
            step["live"] = sum(new(live_storages()).values())

        note_masters()
        handle = inner.register_step_post_hook(hook)
        # The gradient norm (ZeRO) or DeepSpeed's own clipping (ZeRO-0, without mixed precision): its peak
        # above what was alive when it started, from the profiler's record of every allocation and free.
        norm_owner, norm_name = _norm_function(engine, case.zero_stage)
        norm = getattr(norm_owner, norm_name) if norm_owner is not None else None
        if norm is not None:
            setattr(norm_owner, norm_name, lambda *a, **k: _recording_peak(step, "norm_peak", norm, *a, **k))
        inner_step = inner.step  # and the optimizer's own step (its temporaries)
        inner.step = lambda *a, **k: _recording_peak(step, "optimizer_step_peak", inner_step, *a, **k)
        out = engine(input_ids=batch, labels=batch)
        loss = float(out.loss)
        engine.backward(out.loss)
        del out
        alive_at_backward = live_tensors()  # held to the end (see live_storages)
        at_backward = new(_storages(alive_at_backward))
        gathered = weight_storages()  # ZeRO-3 may still hold some parameters gathered
        states_at_backward = _storages(t for state in inner.state.values() for t in state.values())
        maps = quantization_maps()
        integers = set(_storages(t for t in alive_at_backward if not t.is_floating_point()))
        engine.step()
        handle.remove()
        at_after = new(live_storages())
        states = {
            k: v
            for state in inner.state.values()
            for k, v in _storages(state.values()).items()
            if k not in weights and k not in masters
        }
        not_gradients = set(weights) | set(gathered) | set(masters) | set(states_at_backward) | set(maps) | integers
        # Integer storages are no gradients: bitsandbytes' CPU path keeps 4-bit weights it repacked (uint8) in
        # the forward pass (CUDA kernels read the 4-bit weights as they are).
        result = {
            "case": asdict(case),
            "loss": loss,
            "weights": sum(weights.values()),
            "masters": sum(masters.values()),
            "states": sum(states.values()),
            "step_gradients": step.get("step_gradients", 0),
            "norm_peak": step.get("norm_peak", 0),
            "optimizer_step_peak": step.get("optimizer_step_peak", 0),
            "gradients": sum(v for k, v in at_backward.items() if k not in not_gradients),
            "gathered_at_backward": sum(v for k, v in gathered.items() if k not in weights),
            "quantization_maps": sum(v for k, v in maps.items() if k not in weights),
            "live_init": sum(at_init.values()),
            "live_step": step.get("live", 0),
            "live_after": sum(at_after.values()),
            "parameter_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params}),
            "optimizer_parameter_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in optimizer_params()}),
            "state_dtypes": sorted(
                {
                    str(t.dtype).removeprefix("torch.")
                    for s in inner.state.values()
                    for t in s.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0
                }
            ),  # fmt: skip
            "optimizer": type(engine.optimizer).__name__,
            "basic_optimizer": type(inner).__name__,
        }
        return result


def main() -> None:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    results = []
    for case in (Case(**c) for c in json.loads(Path(sys.argv[1]).read_text())):
        results.append(measure(case))
        gc.collect()  # the engine's cycles (hooks, the wrapped step) go before the next case begins
    if dist.get_rank() == 0:
        Path(sys.argv[2]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
