"""The DeepSpeed config of a plan: the JSON the trainer hands to ``deepspeed.initialize``.

The memory model reads its communication buffer sizes from here (:func:`bucket_elements`), so what is
predicted and what runs cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.knobs import conflicts as knob_conflicts
from memfit.api.plan import Strategy
from memfit.api.vocabulary import Method, Offload, Optimizer
from memfit.contract.engines import precision_section
from memfit.planned_model import PlannedModel

NVME_PATH = "/local_nvme"
"""Where trainer pods mount the node's NVMe for ZeRO-Infinity offload."""

STAGE12_BUCKET_ELEMENTS = 50_000_000
"""ZeRO-1/2 reduce and all-gather buckets (DeepSpeed's default is 5e8; with overlap_comm it keeps ~4.5
buckets of each alive, 9 GB at 5e8: 5e7 costs 0.9 GB and still saturates NCCL)."""

DEEPSPEED_OPTIMIZERS = {Optimizer.ADAMW: "AdamW", Optimizer.LION: "Lion"}
"""Optimizers DeepSpeed builds itself (fused on GPU, its CPU kernels under offload). The others are
built by the trainer (bitsandbytes 8-bit, transformers Adafactor) and passed in as client optimizers."""

BETAS = {Optimizer.ADAMW: (0.9, 0.999), Optimizer.LION: (0.9, 0.99)}


def bucket_elements(shape: PlannedModel, zero_stage: int) -> dict[str, int]:
    """Communication bucket sizes in elements, as Hugging Face's "auto" values size them for ZeRO-3."""
    if zero_stage in (1, 2):
        return {"reduce": STAGE12_BUCKET_ELEMENTS, "allgather": STAGE12_BUCKET_ELEMENTS}
    if zero_stage == 3:
        h = shape.hidden_size
        return {"reduce": h * h, "prefetch": int(0.9 * h * h), "persistence": 10 * h}
    return {}


def default_learning_rate(method: Method) -> float:
    """LoRA tolerates (and needs) a learning rate about ten times that of full fine-tuning."""
    return 2e-5 if method == Method.FULL else 2e-4


def deepspeed_config(spec: FineTuneJobSpec, strategy: Strategy, model: PlannedModel | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON for running ``spec`` with ``strategy``. A strategy that would not run as planned
    (``memfit.api.knobs.conflicts``: e.g. parameter offload, which DeepSpeed ignores below ZeRO-3) is an error,
    never a config: the planner does not produce one."""
    conflicts = knob_conflicts(strategy.knobs())
    if conflicts:
        raise ValueError(f"strategy {strategy.summary()!r} cannot run as planned: " + "; ".join(conflicts))
    shape = spec.planned_model(model)
    training = spec.training
    config: dict[str, Any] = {
        "train_batch_size": training.global_batch_size,
        "train_micro_batch_size_per_gpu": strategy.micro_batch_size,
        "gradient_accumulation_steps": strategy.gradient_accumulation_steps,
        "gradient_clipping": training.max_grad_norm,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_optimization": _zero_section(shape, strategy),
    }
    section = precision_section(strategy.precision, strategy.master_weights, strategy.zero_stage)
    if section is not None:
        config[str(strategy.precision)] = section
    if strategy.optimizer in DEEPSPEED_OPTIMIZERS and not strategy.optimizer_in_backward:
        config["optimizer"] = {
            "type": DEEPSPEED_OPTIMIZERS[strategy.optimizer],
            "params": {
                "lr": training.learning_rate or default_learning_rate(strategy.method),
                "betas": list(BETAS[strategy.optimizer]),
                "weight_decay": training.weight_decay,
            },
        }
    else:
        config["zero_allow_untested_optimizer"] = True
    return config


def _offload(device: Offload) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == Offload.NVME:
        section["nvme_path"] = NVME_PATH
    return section


def _zero_section(shape: PlannedModel, strategy: Strategy) -> dict[str, Any]:
    stage = strategy.zero_stage
    zero: dict[str, Any] = {"stage": stage}
    if stage == 0:
        return zero
    buckets = bucket_elements(shape, stage)
    zero.update({"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": buckets["reduce"]})
    if stage in (1, 2):
        zero["allgather_bucket_size"] = buckets["allgather"]
    else:
        zero.update(
            {
                "stage3_prefetch_bucket_size": buckets["prefetch"],
                "stage3_param_persistence_threshold": buckets["persistence"],
                "stage3_max_live_parameters": 1_000_000_000,
                "stage3_max_reuse_distance": 1_000_000_000,
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
    if strategy.offload_optimizer != Offload.NONE:
        zero["offload_optimizer"] = _offload(strategy.offload_optimizer)
    if strategy.offload_parameters != Offload.NONE:
        zero["offload_param"] = _offload(strategy.offload_parameters)
    return zero
