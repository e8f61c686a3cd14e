"""The DeepSpeed engine behind :class:`~memfit_trainer.training_engine.TrainingEngine`: ``deepspeed.initialize``
with the run's optimizer and schedule, and the only module that reads the config's DeepSpeed section.

AdamW and Lion are built by DeepSpeed from its section's ``config`` (fused kernels on GPU, DeepSpeedCPUAdam under
optimizer offload). The others are built by memfit (:func:`~memfit_trainer.optimization.client_optimizer`) and
handed over as client optimizers, which DeepSpeed only accepts with ``zero_allow_untested_optimizer`` and, under
optimizer offload, ``zero_force_ds_cpu_optimizer: false`` (otherwise it refuses anything but its own CPU Adam).
DeepSpeed steps the warmup-cosine schedule at each optimizer step and saves it in its checkpoints.

With ``training.masterWeights: bf16`` (pure bf16) the precision section decides what the optimizer updates
(``memfit.contract.engines.precision_section``): DeepSpeed's bf16 master partitions under ZeRO 1-3; at
ZeRO-0 no section, so that DeepSpeed hands every optimizer, its own or a client one, the model's bf16
parameters themselves (and clips their gradients itself).
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from memfit.api.vocabulary import Offload
from memfit.contract.engines import DeepSpeedEngineSection, precision_section
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer import sequence_parallel
from memfit_trainer.checkpoint import DEEPSPEED_TAG
from memfit_trainer.cpu_info import ask_the_kernel_once
from memfit_trainer.model import trains_adapters
from memfit_trainer.optimization import client_optimizer, warmup_cosine
from memfit_trainer.optimizer_in_backward import SteppedInBackward, all_reduce_mean, step_in_backward

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def init_deepspeed_process_group() -> None:
    import deepspeed

    ask_the_kernel_once()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def engine_config(config: TrainerConfig, client: bool) -> dict[str, Any]:
    """The DeepSpeed section's config plus what this run needs: the flags a client optimizer requires, and what
    the training section decides where the DeepSpeed section leaves it out (batch sizes, clipping, precision and
    master weights, as ``memfit.render.deepspeed`` renders them; where it gives them, the config's validation
    made sure they agree)."""
    training = config.training
    deepspeed = _section(config)
    ds = copy.deepcopy(deepspeed.config)
    ds.setdefault("train_micro_batch_size_per_gpu", training.micro_batch_size)
    ds.setdefault("gradient_accumulation_steps", training.gradient_accumulation_steps)
    ds.setdefault("train_batch_size", training.global_batch_size)
    ds.setdefault("gradient_clipping", training.max_grad_norm)
    if not deepspeed.names_precision:
        # With bf16 masters at ZeRO-0 there is none on purpose: the optimizer updates the bf16 weights themselves.
        section = precision_section(training.precision, training.master_weights, deepspeed.zero_stage)
        if section is not None:
            ds[str(training.precision)] = section
    if client:
        ds["zero_allow_untested_optimizer"] = True
        if deepspeed.offload_optimizer != Offload.NONE:
            ds["zero_force_ds_cpu_optimizer"] = False
    return ds


def _section(config: TrainerConfig) -> DeepSpeedEngineSection:
    assert isinstance(config.engine, DeepSpeedEngineSection), "the registry builds this engine for its section only"
    return config.engine


def universal_loading(config: TrainerConfig) -> TrainerConfig:
    """``config`` with DeepSpeed told to load universal checkpoints (read when the engine is built)."""
    return config.model_copy(update={"engine": _section(config).loading_universal()})


class DeepSpeed:
    """DeepSpeed's engine (:attr:`engine`) in memfit's terms: a checkpoint is the :data:`DEEPSPEED_TAG` of a
    directory, without DeepSpeed's ``latest`` file (the marker of :mod:`memfit_trainer.checkpoint` says which
    checkpoint is complete), the frozen base of LoRA never in it."""

    def __init__(self, engine: DeepSpeedEngine, lr_scheduler: LambdaLR, *, lora: bool, backward_scale: int = 1) -> None:
        self.engine = engine
        self.lr_scheduler = lr_scheduler
        self.module: torch.nn.Module = engine.module
        self.device: torch.device = engine.device
        self.lora = lora
        self.backward_scale = backward_scale
        """What the loss is multiplied by for its backward only (:func:`zero3_sequence_scale`)."""

    def __call__(self, **inputs: torch.Tensor) -> Any:
        return self.engine(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss * self.backward_scale if self.backward_scale != 1 else loss)

    def step(self) -> None:
        self.engine.step()

    @property
    def learning_rate(self) -> float:
        return float(self.lr_scheduler.get_last_lr()[0])

    @property
    def last_grad_norm(self) -> float | None:
        """DeepSpeed's norm of the last step where it clipped (None where it computed none)."""
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def save_checkpoint(self, directory: Path) -> None:
        self.engine.save_checkpoint(
            str(directory), tag=DEEPSPEED_TAG, save_latest=False, exclude_frozen_parameters=self.lora
        )

    def load_checkpoint(self, directory: Path) -> bool:
        path, _ = self.engine.load_checkpoint(str(directory), tag=DEEPSPEED_TAG, load_module_strict=not self.lora)
        replay_bias_correction(self.engine.basic_optimizer, self.device)
        return path is not None

    def load_converted(self, universal: Path) -> bool:
        """The engine was built with :func:`universal_loading`: the ordinary load reads the universal checkpoint."""
        return self.load_checkpoint(universal)

    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Under ZeRO-3 every rank holds a slice of each weight: all ranks gather them layer by layer."""
        if not self.engine.zero_optimization_partition_weights():
            return None
        state: dict[str, torch.Tensor] = self.engine._zero3_consolidated_16bit_state_dict(
            exclude_frozen_parameters=self.lora
        )
        return state


EmptyStep = Callable[[int, dict[str, Any]], None]
"""One call of a C++ Adam step for ``(step, parameter group)`` on no elements."""


def _empty_adam_step(optimizer: torch.optim.Optimizer, device: torch.device) -> EmptyStep | None:
    """The C++ Adam step of ``optimizer`` on empty tensors, where its bias correction lives in DeepSpeed's C++
    ``Adam_Optimizer``: DeepSpeedCPUAdam's ``adam_update`` (ops/adam/cpu_adam.py:170, one C++ optimizer per
    ``opt_id``), and on the CPU accelerator FusedAdam's ``multi_tensor_adam``, which steps the same class
    (csrc/cpu/adam/fused_adam.cpp:10-51, one C++ optimizer per AdamW mode); ``None`` for any other (CUDA's
    FusedAdam computes the correction from the step at each call)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    empty = torch.empty(0)
    if isinstance(optimizer, DeepSpeedCPUAdam):
        update = optimizer.ds_opt_adam.adam_update
        return lambda step, group: update(
            optimizer.opt_id, step, group["lr"], *group["betas"], group["eps"], group["weight_decay"],
            group["bias_correction"], empty, empty, empty, empty,
        )  # fmt: skip
    if isinstance(optimizer, FusedAdam) and device.type == "cpu":
        no_overflow = torch.zeros(1, dtype=torch.int)  # read by CUDA's kernel only
        return lambda step, group: optimizer.multi_tensor_adam(
            _FUSED_ADAM_CHUNK, no_overflow, [[empty]] * 4, group["lr"], *group["betas"], group["eps"], step,
            optimizer.adam_w_mode, int(group["bias_correction"]), group["weight_decay"],
        )  # fmt: skip
    return None


_FUSED_ADAM_CHUNK = 2048 * 32
"""FusedAdam's ``multi_tensor_applier`` chunk size (ops/adam/fused_adam.py:13); the CPU op ignores it."""


def _optimizer_step(optimizer: torch.optim.Optimizer) -> int:
    """The steps the loaded optimizer has taken (every parameter steps together; 0 before the first)."""
    return max((int(state["step"]) for state in optimizer.state.values() if "step" in state), default=0)


def replay_bias_correction(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Rebuild the C++ Adam's bias-correction state after a load, so that a resumed run is bit-exact.

    DeepSpeed's C++ Adam keeps beta1^t and beta2^t as running float products (csrc/includes/cpu_adam.h:71-93,
    ``IncrementStep``: multiplied by beta once when called with the next step, recomputed with ``std::pow`` when
    called with any other), and no checkpoint holds them: a resumed process, called first with step t+1, takes
    ``pow``, which differs from the product in the last bits at many steps (resuming the tiny llama from step 2, 5
    or 13 moved its weights) and through the bias correction (cpu_adam.h:94-106) every later update. Calling the
    C++ step with the steps 1..t on empty tensors, each parameter group in turn as the optimizer does (its
    ``IncrementStep`` runs before the update of zero elements, csrc/adam/cpu_adam_impl.cpp:262-266) multiplies
    the same products the uninterrupted run did."""
    empty_step = _empty_adam_step(optimizer, device)
    if empty_step is None:
        return
    for step in range(1, _optimizer_step(optimizer) + 1):
        for group in optimizer.param_groups:  # ZeRO-3 empties a group's params between steps (stage3.py:1252-1254)
            empty_step(step, group)


def deepspeed_arch_list(value: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's JIT op builder can read it. It parses each entry's minor version as
    a number, so the architecture-specific suffixes torch accepts (``9.0a``, ``10.0f``) are dropped (``+PTX``
    kept): an H200 machine whose list held ``9.0a`` failed to build FusedAdam, before the first step."""
    entries = [re.sub(r"^(\d+\.\d+)[a-z]+", r"\1", entry.strip()) for entry in value.replace(" ", ";").split(";")]
    return ";".join(dict.fromkeys(entry for entry in entries if entry))


def zero3_sequence_scale(config: TrainerConfig) -> int:
    """The factor that makes ZeRO-3 reduce a sequence's gradients as its other stages do. Each rank's loss is its
    chunk's share of the sequence's (:mod:`memfit_trainer.sequence_parallel`), so a sequence's gradient is the sum
    over its group. ZeRO-1/2 divide the summed gradients by world/sp (stage_1_and_2 ``sequence_parallel_size``), but
    DeepSpeed's ZeRO-3 reduce-scatter (stage3 ``__avg_scatter_grads``, ``reduce_scatter_coalesced``) divides by
    the whole world, sequence ranks included: 1/sp of the gradient. ``reduce_scatter`` is DeepSpeed's default (the
    section cannot set it), so that is the path every ZeRO-3 reduction takes."""
    return config.training.sequence_parallel if _section(config).zero_stage == 3 else 1


def build_deepspeed_engine(
    config: TrainerConfig, model: torch.nn.Module, total_steps: int, *, converted: bool = False
) -> DeepSpeed:
    """The engine for ``model``; ``converted``: it loads a universal checkpoint (:func:`universal_loading`)."""
    import deepspeed

    if os.environ.get("TORCH_CUDA_ARCH_LIST"):  # read by the op builds deepspeed.initialize may start
        os.environ["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    if converted:
        config = universal_loading(config)
    params = [p for p in model.parameters() if p.requires_grad]
    in_backward = _section(config).optimizer_in_backward
    optimizer: torch.optim.Optimizer | None
    if in_backward:
        reduce = all_reduce_mean if torch.distributed.get_world_size() > 1 else None
        optimizer = SteppedInBackward(step_in_backward(params, lambda p: client_optimizer(config.training, p), reduce))
    else:
        optimizer = None if _section(config).builds_optimizer else client_optimizer(config.training, params)
    schedule = warmup_cosine(total_steps, config.training.warmup_ratio)
    engine, _, _, scheduler = deepspeed.initialize(
        model=model,
        model_parameters=params,
        optimizer=optimizer,
        lr_scheduler=lambda opt: LambdaLR(opt, schedule),
        config=engine_config(config, client=optimizer is not None),
        mpu=sequence_parallel.prepare(config, model),  # its batch sizes count data ranks; ZeRO shards over all
    )
    if in_backward:  # each gradient was all-reduced in its hook, and is gone
        engine.enable_backward_allreduce = False
    return DeepSpeed(
        engine, scheduler, lora=trains_adapters(config.training.method), backward_scale=zero3_sequence_scale(config)
    )
