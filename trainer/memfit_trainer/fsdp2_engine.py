"""The FSDP2 engine (``engine: fsdp2``): PyTorch's ``fully_shard`` behind the loop's ``TrainingEngine`` protocol.

Wrapping (:func:`shard_model`), in this order, over one 1-D device mesh of all ranks:

* every decoder layer (the model's ``_no_split_modules`` classes, e.g. ``LlamaDecoderLayer``) gets
  ``fully_shard(layer, mesh=mesh, reshard_after_forward=fsdp2.reshardAfterForward, mp_policy=...,
  offload_policy=...)``, then the root (the peft model for LoRA, else the causal LM) the same call: it owns
  what is left (embedding, final norm, LM head). With fp32 master weights each layer is cast to fp32 just
  before its ``fully_shard`` (the trainable parameters only for LoRA and QLoRA: the frozen base stays in the
  compute dtype, QLoRA's 4-bit codes in their bf16 storage), so the build's peak is the 16-bit model plus one
  fp32 layer. QLoRA's packed codes are sharded like any bf16 weight; each ``Linear4bit``'s quant state
  (absmax, code tables) stays whole on every rank (see ``memfit_trainer.model.quantization_config``);
* mixed precision (training.precision bf16, fp32 masters): ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fsdp2.reduceDtype)``: the sharded parameters, their gradients and AdamW's two states are fp32;
  each layer's parameters are all-gathered in bf16 for its forward (and again for its backward when
  resharded after the forward), its gradients reduce-scattered in ``reduceDtype`` into fp32 sharded
  gradients. Pure bf16 (``masterWeights: bf16``) or fp32 precision: the parameters themselves are in the
  compute dtype, no cast (``param_dtype=None``), gradients and optimizer states in that dtype too;
* ``CPUOffloadPolicy`` with ``fsdp2.cpuOffload``: sharded parameters, gradients and optimizer states in
  (pinned) host memory, the optimizer step and the clipping on the CPU; each layer's parameters are copied
  to the device for the all-gather.

Gradient accumulation: each micro-batch's loss is divided by ``gradientAccumulationSteps`` (as DeepSpeed's
``backward`` does) and its gradients are reduce-scattered into the sharded gradients at once (no unsharded
accumulation); at the boundary the gradient norm is clipped to ``training.maxGradNorm``
(``torch.nn.utils.clip_grad_norm_`` on the sharded DTensor gradients), the optimizer (``client_optimizer``:
AdamW unless configured otherwise) steps, the gradients are freed and the warmup-cosine schedule steps.
With ``training.maxGradNorm: 0`` nothing is clipped (and no gradient norm is reported). With
``fsdp2.optimizerInBackward`` each parameter has its own optimizer, stepped in the backward pass
(:mod:`memfit_trainer.optimizer_in_backward`): the boundary only steps the schedule.

Checkpoints (:meth:`Fsdp2Engine.save_checkpoint`) are ``torch.distributed.checkpoint`` directories (``dcp``
inside the step directory): the model's sharded state (trainable parameters only for LoRA and QLoRA), the optimizer's
(keyed by parameter name: one state dict whether one optimizer or one per parameter holds it) and the LR
scheduler's, which load into any world size and sharding.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.optim.lr_scheduler import LambdaLR

from memfit.api.vocabulary import MasterWeights, Method, Precision
from memfit.contract.engines import Fsdp2EngineSection
from memfit.contract.reader import ConfigError
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer import sequence_parallel
from memfit_trainer.checkpoint import DEEPSPEED_TAG
from memfit_trainer.convert import load_universal_into_fsdp2
from memfit_trainer.model import DTYPES, trains_adapters
from memfit_trainer.optimization import client_optimizer, warmup_cosine
from memfit_trainer.optimizer_in_backward import PerParameterSchedules, step_in_backward
from memfit_trainer.sharded_8bit import QUANTIZED_FOR, check_quantized_for, quantized_for

DCP_DIRECTORY = "dcp"
"""The ``torch.distributed.checkpoint`` directory inside a checkpoint's step directory."""


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the modules of the classes ``transformers`` never splits across devices
    (``_no_split_modules``), in model order."""
    get_base = getattr(model, "get_base_model", None)  # peft
    base = get_base() if callable(get_base) else model
    classes = set(getattr(base, "_no_split_modules", None) or ())
    # By class name along the MRO: fully_shard swaps a module's class for an FSDP subclass of it.
    layers = [m for m in model.modules() if any(c.__name__ in classes for c in type(m).__mro__)]
    if not layers:
        raise ConfigError(f"engine fsdp2 finds no decoder layers ({sorted(classes)}) in {type(base).__name__}")
    return layers


def fp32_masters(config: TrainerConfig) -> bool:
    """Whether the sharded parameters are fp32 masters of bf16 compute (mixed precision)."""
    training = config.training
    return training.precision == Precision.BF16 and training.master_weights == MasterWeights.FP32


def init_fsdp2_process_group() -> None:
    """CPU offload clips and checkpoints host tensors: gloo beside NCCL for those."""
    dist.init_process_group(backend="cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo")


def mixed_precision(config: TrainerConfig, fsdp2: Fsdp2EngineSection) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if fp32_masters(config) else None, reduce_dtype=DTYPES[fsdp2.reduce_dtype]
    )


def _cast_for_sharding(module: torch.nn.Module, dtype: torch.dtype, trainable_only: bool) -> None:
    for param in module.parameters():
        if param.is_floating_point() and param.dtype != dtype and (param.requires_grad or not trainable_only):
            param.data = param.data.to(dtype)


def _keep_4bit_layout(model: torch.nn.Module) -> None:
    """QLoRA: turn off bitsandbytes' CPU inference repacking (eval mode, e.g. validation, on a CPU with
    AVX512-bf16): it rewrites the gathered weight and the shared quant state in place, and FSDP2's next
    all-gather brings back the codes in their original layout, which that quant state would then misread."""
    from bitsandbytes.nn.modules import Linear4bit

    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False


def shard_model(config: TrainerConfig, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``fully_shard`` every decoder layer, then the root (see the module docstring); returns the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    fsdp2 = config.engine
    assert isinstance(fsdp2, Fsdp2EngineSection)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if fsdp2.cpu_offload else OffloadPolicy()
    options: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": fsdp2.reshard_after_forward,
        "mp_policy": mixed_precision(config, fsdp2),
        "offload_policy": offload,
    }
    masters = fp32_masters(config)
    lora = trains_adapters(config.training.method)  # QLoRA too: casting its packed 4-bit codes would ruin them
    if config.training.method == Method.QLORA:
        _keep_4bit_layout(model)
    for layer in decoder_layers(model):
        if masters:
            _cast_for_sharding(layer, torch.float32, trainable_only=lora)
        fully_shard(layer, **options)
    if masters:
        _cast_for_sharding(model, torch.float32, trainable_only=lora)
    fully_shard(model, **options)
    return model


def average_over_data_ranks(model: torch.nn.Module, data_ranks: int) -> None:
    """Gradients averaged over the data-parallel ranks only: FSDP2 divides the world's sum by the world size, but
    a sequence-parallel group's ranks hold parts of one gradient, which sum (memfit_trainer.sequence_parallel).
    Reduced as a plain sum, divided after: FSDP2 would otherwise scale inside the reduction (PREMUL_SUM), which
    only NCCL has."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(data_ranks))
            module.set_force_sum_reduction_for_comms(True)


class Fsdp2Engine:
    """The :class:`~memfit_trainer.training_engine.TrainingEngine` of a sharded model: :meth:`step` makes an
    optimizer step at each accumulation boundary, or with the optimizers stepped in backward (``in_backward``)
    the schedule's step only."""

    def __init__(
        self,
        module: torch.nn.Module,
        optimizers: tuple[torch.optim.Optimizer, ...],
        lr_scheduler: LambdaLR | PerParameterSchedules,
        *,
        device: torch.device,
        accumulation: int,
        max_grad_norm: float,
        lora: bool,
        export_dtype: torch.dtype,
        in_backward: bool = False,
    ) -> None:
        self.module = module
        self.optimizers = optimizers
        self.lr_scheduler = lr_scheduler
        self.in_backward = in_backward
        self.device = device
        self.accumulation = accumulation
        self.max_grad_norm = max_grad_norm
        self.lora = lora
        self.export_dtype = export_dtype
        self.micro_steps = 0
        self.last_grad_norm: float | None = None

    def __call__(self, **inputs: torch.Tensor) -> Any:
        return self.module(**inputs)

    def trainable(self) -> Iterator[torch.nn.Parameter]:
        return (p for p in self.module.parameters() if p.requires_grad)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.accumulation).backward()  # type: ignore[no-untyped-call]  # Tensor.backward is untyped

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.accumulation == 0

    def step(self) -> None:
        """After each micro-batch's backward: at the accumulation boundary clip (unless maxGradNorm is 0),
        step, zero (all done in the backward with ``in_backward``), schedule."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        if not self.in_backward:
            if self.max_grad_norm > 0:
                norm = torch.nn.utils.clip_grad_norm_(list(self.trainable()), self.max_grad_norm)
                full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                self.last_grad_norm = float(full)
            for optimizer in self.optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()

    # --- checkpoints ---------------------------------------------------------------------------------

    def _options(self) -> StateDictOptions:
        return StateDictOptions(ignore_frozen_params=self.lora, strict=not self.lora)

    def _state(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.module, self.optimizers, options=self._options())
        scheduler = self.lr_scheduler.state_dict()
        return {"model": model, "optimizer": optimizer, "scheduler": scheduler, **quantized_for(self.optimizers)}

    @property
    def learning_rate(self) -> float:
        return float(self.lr_scheduler.get_last_lr()[0])

    def save_checkpoint(self, directory: Path) -> None:
        """Collective: every rank writes its shards into ``directory/dcp`` (the frozen base of LoRA never)."""
        from torch.distributed.checkpoint.state_dict_saver import save

        save(self._state(), checkpoint_id=str(directory / DCP_DIRECTORY))

    def load_checkpoint(self, directory: Path) -> bool:
        """Collective: load ``directory/dcp`` into this run's sharding (any world size)."""
        from torch.distributed.checkpoint.state_dict_loader import load

        path = directory / DCP_DIRECTORY
        if not (path / ".metadata").is_file():
            return False
        state = self._state()
        if QUANTIZED_FOR in state:  # before the states: quantized blocks of another world size do not load
            saved = {QUANTIZED_FOR: 0}
            load(saved, checkpoint_id=str(path))
            check_quantized_for(saved[QUANTIZED_FOR], state[QUANTIZED_FOR])
        load(state, checkpoint_id=str(path))
        set_state_dict(
            self.module,
            self.optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=self._options(),
        )
        self.lr_scheduler.load_state_dict(state["scheduler"])
        return True

    def load_converted(self, universal: Path) -> bool:
        load_universal_into_fsdp2(self.module, self.optimizers, self.lr_scheduler, universal, DEEPSPEED_TAG, self.lora)
        return True

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the full (unsharded) state dict on rank 0's host, in the compute dtype (the trainable
        parameters only for LoRA); an empty dict on the other ranks. Gathered one parameter at a time."""
        full: dict[str, Any] = get_model_state_dict(
            self.module,
            options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.lora),
        )
        return {
            name: value.to(self.export_dtype) if value.is_floating_point() else value for name, value in full.items()
        }


def build_fsdp2_engine(
    config: TrainerConfig, model: torch.nn.Module, total_steps: int, *, converted: bool = False
) -> Fsdp2Engine:
    """The model sharded, the optimizer over its sharded trainable parameters (``converted`` changes nothing:
    :meth:`Fsdp2Engine.load_converted` reads a universal checkpoint whatever the build)."""
    training = config.training
    local_rank = torch.cuda.current_device() if torch.cuda.is_available() else None
    device = torch.device("cuda", local_rank) if local_rank is not None else torch.device("cpu")
    sharded = shard_model(config, model, device)
    if sequence_parallel.prepare(config, sharded) is not None:
        average_over_data_ranks(sharded, dist.get_world_size() // training.sequence_parallel)
    params = [p for p in sharded.parameters() if p.requires_grad]
    schedule = warmup_cosine(total_steps, training.warmup_ratio)
    in_backward = isinstance(config.engine, Fsdp2EngineSection) and config.engine.optimizer_in_backward
    scheduler: LambdaLR | PerParameterSchedules
    if in_backward:
        optimizers = step_in_backward(params, lambda group: client_optimizer(training, group, sharded=True))
        scheduler = PerParameterSchedules(optimizers, schedule)
    else:
        optimizers = (client_optimizer(training, params, sharded=True),)
        scheduler = LambdaLR(optimizers[0], schedule)
    return Fsdp2Engine(
        sharded,
        optimizers,
        scheduler,
        device=device,
        accumulation=training.gradient_accumulation_steps,
        max_grad_norm=training.max_grad_norm,
        lora=trains_adapters(training.method),
        export_dtype=DTYPES[training.precision],
        in_backward=in_backward,
    )
