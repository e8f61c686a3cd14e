"""The engine section of the trainer config: DeepSpeed or FSDP2, told apart by ``kind``.

Each engine says in typed terms what the rest of memfit asks of it (its ZeRO stage, or the one its sharding is
like, what it offloads, whether it builds the optimizer); only this module knows DeepSpeed's own keys. The
DeepSpeed section carries DeepSpeed's config as DeepSpeed reads it (the operator writes it beside the trainer
config) and checks it against the keys memfit renders, since DeepSpeed ignores a misspelt key silently.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)

from memfit.api.base import ApiModel
from memfit.api.vocabulary import Engine, MasterWeights, Offload, Optimizer, Precision
from memfit.contract.paths import AbsolutePath
from memfit.contract.sections import (
    MAX_BATCH,
    MAX_GLOBAL_BATCH,
    MAX_GRAD_NORM,
    MAX_LEARNING_RATE,
    MAX_WEIGHT_DECAY,
)

MAX_BUCKET_ELEMENTS: Final = 2**40

# --- DeepSpeed's config, typed -------------------------------------------------------------------------


class _DeepSpeedPart(BaseModel):
    """DeepSpeed's own snake_case keys; only those memfit renders (DeepSpeed ignores a misspelt key
    silently, so an unknown one is an error here)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


DsInt = Annotated[int, Strict(), Field(ge=1, le=MAX_BUCKET_ELEMENTS)]
DsBool = Annotated[bool, Strict()]


class DeepSpeedOffload(_DeepSpeedPart):
    device: Offload
    pin_memory: DsBool = False
    nvme_path: AbsolutePath | None = None

    @model_validator(mode="after")
    def _nvme_path(self) -> DeepSpeedOffload:
        if self.device == Offload.NVME and self.nvme_path is None:
            raise ValueError("device nvme needs nvme_path")
        return self


class DeepSpeedZero(_DeepSpeedPart):
    stage: Annotated[int, Strict(), Field(ge=0, le=3)] = 0
    overlap_comm: DsBool | None = None
    contiguous_gradients: DsBool | None = None
    reduce_bucket_size: DsInt | None = None
    allgather_bucket_size: DsInt | None = None
    stage3_prefetch_bucket_size: DsInt | None = None
    stage3_param_persistence_threshold: DsInt | None = None
    stage3_max_live_parameters: DsInt | None = None
    stage3_max_reuse_distance: DsInt | None = None
    stage3_gather_16bit_weights_on_model_save: DsBool | None = None
    offload_optimizer: DeepSpeedOffload | None = None
    offload_param: DeepSpeedOffload | None = None

    @model_validator(mode="after")
    def _offload_needs_zero(self) -> DeepSpeedZero:
        if self.offload_optimizer is not None and self.offload_optimizer.device != Offload.NONE and self.stage == 0:
            raise ValueError("offload_optimizer needs ZeRO (stage 1, 2 or 3), the stage is 0")
        if self.offload_param is not None and self.offload_param.device != Offload.NONE and self.stage != 3:
            raise ValueError(f"offload_param needs ZeRO stage 3, the stage is {self.stage}")
        return self


class DeepSpeedPrecision(_DeepSpeedPart):
    enabled: DsBool
    loss_scale: Annotated[float, Strict(), Field(ge=0, le=2.0**64, allow_inf_nan=False)] | None = None
    initial_scale_power: Annotated[int, Strict(), Field(ge=0, le=64)] | None = None
    hysteresis: Annotated[int, Strict(), Field(ge=1, le=2**20)] | None = None
    loss_scale_window: Annotated[int, Strict(), Field(ge=1, le=2**31)] | None = None
    min_loss_scale: Annotated[float, Strict(), Field(gt=0, le=2.0**64, allow_inf_nan=False)] | None = None
    bf16_master_weights_and_grads: DsBool | None = None
    """bf16 section only (training.masterWeights bf16, ZeRO 1-3): bf16 master partitions and gradients."""
    bf16_optimizer_states: DsBool | None = None
    """bf16 section only, with bf16_master_weights_and_grads: the optimizer's states stay in bf16 on the GPU."""

    @property
    def bf16_masters(self) -> bool:
        return bool(self.enabled and self.bf16_master_weights_and_grads)


class DeepSpeedOptimizerParams(_DeepSpeedPart):
    lr: Annotated[float, Strict(), Field(gt=0, le=MAX_LEARNING_RATE, allow_inf_nan=False)]
    betas: (
        Annotated[
            list[Annotated[float, Strict(), Field(ge=0, lt=1, allow_inf_nan=False)]], Field(min_length=2, max_length=2)
        ]
        | None
    ) = None
    eps: Annotated[float, Strict(), Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    weight_decay: Annotated[float, Strict(), Field(ge=0, le=MAX_WEIGHT_DECAY, allow_inf_nan=False)] = 0.0


DEEPSPEED_OPTIMIZER_TYPES: Final = {"adamw": Optimizer.ADAMW, "lion": Optimizer.LION}
"""The optimizers DeepSpeed builds from its config (memfit.render.deepspeed), by lower-cased type."""


class DeepSpeedOptimizer(_DeepSpeedPart):
    type: Annotated[str, Strict()]
    params: DeepSpeedOptimizerParams

    @field_validator("type")
    @classmethod
    def _known(cls, name: str) -> str:
        if name.lower() not in DEEPSPEED_OPTIMIZER_TYPES:
            raise ValueError(f"{name!r} is not an optimizer memfit has DeepSpeed build (AdamW, Lion)")
        return name


class DeepSpeedSection(_DeepSpeedPart):
    """The keys of the DeepSpeed engine section's ``config``, typed (the section keeps the dict DeepSpeed is given)."""

    train_batch_size: Annotated[int, Strict(), Field(ge=1, le=MAX_GLOBAL_BATCH)] | None = None
    train_micro_batch_size_per_gpu: Annotated[int, Strict(), Field(ge=1, le=MAX_BATCH)] | None = None
    gradient_accumulation_steps: Annotated[int, Strict(), Field(ge=1, le=MAX_BATCH)] | None = None
    gradient_clipping: Annotated[float, Strict(), Field(ge=0, le=MAX_GRAD_NORM, allow_inf_nan=False)] | None = None
    steps_per_print: Annotated[int, Strict(), Field(ge=1, le=2**63 - 1)] | None = None
    wall_clock_breakdown: DsBool | None = None
    zero_optimization: DeepSpeedZero = Field(default_factory=DeepSpeedZero)
    bf16: DeepSpeedPrecision | None = None
    fp16: DeepSpeedPrecision | None = None
    optimizer: DeepSpeedOptimizer | None = None
    zero_allow_untested_optimizer: DsBool | None = None
    zero_force_ds_cpu_optimizer: DsBool | None = None

    @model_validator(mode="after")
    def _one_precision(self) -> DeepSpeedSection:
        if self.bf16 is not None and self.fp16 is not None and self.bf16.enabled and self.fp16.enabled:
            raise ValueError("bf16 and fp16 are both enabled")
        return self

    @property
    def precision(self) -> Precision | None:
        """The precision the section enables (None: it enables none, DeepSpeed trains in fp32)."""
        if self.bf16 is not None and self.bf16.enabled:
            return Precision.BF16
        if self.fp16 is not None and self.fp16.enabled:
            return Precision.FP16
        return None


def precision_section(precision: Precision, master_weights: MasterWeights, zero_stage: int) -> dict[str, Any] | None:
    """DeepSpeed's ``bf16`` or ``fp16`` section (its key is the precision), or None where there is none.

    fp32 masters: DeepSpeed's mixed precision, the 16-bit weights and gradients with fp32 master weights, fp32
    gradient partitions and fp32 optimizer states (fp16 with dynamic loss scaling).

    bf16 masters (pure bf16; the numerics change: every update is rounded to bf16's 8-bit mantissa, so
    updates smaller than about 2^-8 of a weight are lost, and the moments are bf16 too):

    * ZeRO-1/2/3: ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``. Each rank keeps a bf16
      copy of its partition as the master, reduces gradients into a bf16 partition and gives the optimizer
      bf16 moments (``_configure_master_weights`` in DeepSpeed's ``base_optimizer.py`` picks the dtype).
    * ZeRO-0: no section at all. DeepSpeed refuses bf16 masters without ZeRO, and its bf16 mode would wrap
      the optimizer in fp32 masters; without a section its engine casts nothing and hands the optimizer the
      model's own bf16 parameters (the trainer builds the model in bf16), so the weights are the masters.
      The engine still all-reduces the gradients and clips them (``clip_fp32_gradients``, whatever their
      dtype); there is no loss scaling, which bf16 does not need."""
    if precision == Precision.FP16:
        return {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2}
    if precision != Precision.BF16:
        return None
    if master_weights != MasterWeights.BF16:
        return {"enabled": True}
    if zero_stage == 0:
        return None
    return {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _describe_part(error: ValidationError) -> str:
    lines = []
    for problem in error.errors(include_url=False):
        where = ".".join(str(part) for part in problem["loc"]) or "(section)"
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            message = "not a key memfit renders (DeepSpeed would ignore a misspelt key silently)"
        lines.append(f"{where}: {message}")
    return "; ".join(lines)


def _master_weights_problems(ds: DeepSpeedSection, master_weights: MasterWeights) -> list[str]:
    """Whether the precision section keeps the master weights that training.masterWeights names (see
    :func:`precision_section`: an absent section is filled in by the trainer from that function)."""
    problems = []
    if ds.fp16 is not None and (
        ds.fp16.bf16_master_weights_and_grads is not None or ds.fp16.bf16_optimizer_states is not None
    ):
        problems.append("deepspeed.fp16 cannot hold bf16_master_weights_and_grads or bf16_optimizer_states")
    bf16 = ds.bf16
    if bf16 is not None and bf16.bf16_optimizer_states and not bf16.bf16_master_weights_and_grads:
        problems.append("deepspeed.bf16.bf16_optimizer_states needs bf16_master_weights_and_grads")
    stage = ds.zero_optimization.stage
    bf16_masters = bf16 is not None and bf16.bf16_masters
    if master_weights == MasterWeights.FP32:
        if bf16_masters:
            problems.append("deepspeed.bf16 keeps bf16 master weights but training.masterWeights is fp32")
        return problems
    if stage == 0 and bf16 is not None and bf16.enabled:
        problems.append(
            "training.masterWeights bf16 at ZeRO-0 trains the bf16 weights themselves: deepspeed.bf16 must be "
            "absent or disabled (its mixed precision would keep fp32 masters; DeepSpeed's own bf16 masters need "
            "ZeRO 1-3)"
        )
    if stage > 0 and bf16 is not None and not (bf16_masters and bf16.bf16_optimizer_states):
        problems.append(
            "training.masterWeights bf16 needs deepspeed.bf16.bf16_master_weights_and_grads and "
            "bf16_optimizer_states true (DeepSpeed would keep fp32 masters, or refuse bf16 ones on the GPU)"
        )
    return problems


# --- the sections --------------------------------------------------------------------------------------


def _offloaded(offload: DeepSpeedOffload | None) -> Offload:
    return Offload.NONE if offload is None else offload.device


class DeepSpeedEngineSection(ApiModel):
    """The DeepSpeed engine (ZeRO stages 0-3, offload to CPU or NVMe)."""

    kind: Literal[Engine.DEEPSPEED] = Engine.DEEPSPEED
    config: dict[str, Any]
    """The DeepSpeed config, exactly as `memfit plan --emit-ds-config` renders it (see DeepSpeedSection)."""
    optimizer_in_backward: Annotated[bool, Strict()] = False
    """ZeRO-0 with the model's own bf16 weights: one client optimizer per parameter, stepped from its
    post-accumulate-grad hook (after an all-reduce of its gradient over the ranks), the gradient then freed;
    DeepSpeed's own all-reduce and step are skipped. Accumulation 1, no clipping."""
    _settings: DeepSpeedSection = PrivateAttr()

    @field_validator("config")
    @classmethod
    def _known_keys(cls, config: dict[str, Any]) -> dict[str, Any]:
        try:
            DeepSpeedSection.model_validate(config)
        except ValidationError as error:
            raise ValueError(_describe_part(error)) from None
        return config

    def model_post_init(self, context: Any, /) -> None:
        self._settings = DeepSpeedSection.model_validate(self.config)

    @property
    def settings(self) -> DeepSpeedSection:
        """The typed view of ``config`` (DeepSpeed is given the dict itself)."""
        return self._settings

    @property
    def zero_stage(self) -> int:
        return self._settings.zero_optimization.stage

    @property
    def offload_optimizer(self) -> Offload:
        return _offloaded(self._settings.zero_optimization.offload_optimizer)

    @property
    def offload_parameters(self) -> Offload:
        return _offloaded(self._settings.zero_optimization.offload_param)

    @property
    def builds_optimizer(self) -> bool:
        """Whether DeepSpeed builds the optimizer from ``config`` (else the trainer hands it a client one)."""
        return self._settings.optimizer is not None

    @property
    def names_precision(self) -> bool:
        """Whether ``config`` has a bf16 or fp16 section of its own (else the trainer adds
        :func:`precision_section`'s)."""
        return self._settings.bf16 is not None or self._settings.fp16 is not None

    @property
    def nvme_paths(self) -> dict[str, str]:
        """The directories of the NVMe offloads, by DeepSpeed's key (offload_optimizer, offload_param)."""
        zero = self._settings.zero_optimization
        offloads = {"offload_optimizer": zero.offload_optimizer, "offload_param": zero.offload_param}
        return {
            key: offload.nvme_path
            for key, offload in offloads.items()
            if offload is not None and offload.device == Offload.NVME and offload.nvme_path is not None
        }

    def master_weights_problems(self, master_weights: MasterWeights) -> list[str]:
        return _master_weights_problems(self._settings, master_weights)

    def loading_universal(self) -> DeepSpeedEngineSection:
        """This section with DeepSpeed told to load universal checkpoints (after a conversion)."""
        checkpoint = {**self.config.get("checkpoint", {}), "load_universal": True}
        return self.model_copy(update={"config": {**self.config, "checkpoint": checkpoint}})


class Fsdp2EngineSection(ApiModel):
    """The FSDP2 engine: ``torch.distributed.fsdp.fully_shard`` on every decoder layer and the root."""

    kind: Literal[Engine.FSDP2] = Engine.FSDP2
    reshard_after_forward: Annotated[bool, Strict()] = True
    """True: each layer's parameters are resharded after its forward and gathered again for the backward (ZeRO-3
    like); False: kept gathered until the backward (ZeRO-2 like)."""
    cpu_offload: Annotated[bool, Strict()] = False
    """CPUOffloadPolicy: sharded parameters, gradients and optimizer states in (pinned) host memory, the
    optimizer step on the CPU."""
    reduce_dtype: Literal[Precision.FP32, Precision.BF16] = Precision.FP32
    """Gradient reduce-scatter dtype (MixedPrecisionPolicy.reduce_dtype): fp32 with fp32 masters."""
    optimizer_in_backward: Annotated[bool, Strict()] = False
    """One optimizer per sharded parameter, stepped from its post-accumulate-grad hook as soon as its
    gradient is reduced (the gradient then freed): accumulation 1, no clipping."""

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage its sharding is like: 3 resharded after forward, else 2."""
        return 3 if self.reshard_after_forward else 2

    @property
    def offload_optimizer(self) -> Offload:
        return Offload.CPU if self.cpu_offload else Offload.NONE

    @property
    def offload_parameters(self) -> Offload:
        return self.offload_optimizer  # CPUOffloadPolicy moves both

    @property
    def builds_optimizer(self) -> bool:
        return False


EngineSection = Annotated[DeepSpeedEngineSection | Fsdp2EngineSection, Field(discriminator="kind")]
"""What shards and steps the model, with its settings."""
