"""Every strategy knob in one record, and the rules over their combinations in one table.

A spec pins some knobs, the planner decides the rest, and the trainer's config holds them all: each says
once how it maps to :class:`Knobs` (``FineTuneJobSpec.knobs``, ``Strategy.knobs``, ``TrainerConfig.knobs``),
and every check is ``conflicts(x.knobs())``. ``None`` is a knob not decided yet: a rule applies only where
the knobs it reads are decided, so the same table checks a spec's pinned knobs and each strategy the
planner generates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any

from memfit.api.vocabulary import (
    EIGHT_BIT_OPTIMIZERS,
    Attention,
    Engine,
    MasterWeights,
    Method,
    Offload,
    Optimizer,
    Precision,
)


@dataclass(frozen=True, slots=True)
class Knobs:
    """The choices of one way to run a job (where it runs, the pool and layout, is not a knob)."""

    method: Method | None = None
    precision: Precision | None = None
    engine: Engine | None = None
    zero_stage: int | None = None
    offload_optimizer: Offload | None = None
    offload_parameters: Offload | None = None
    optimizer: Optimizer | None = None
    attention: Attention | None = None
    gradient_checkpointing: bool | None = None
    micro_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    master_weights: MasterWeights | None = None
    chunked_loss: bool | None = None
    activation_offloading: bool | None = None
    optimizer_in_backward: bool | None = None
    sequence_parallel: int | None = None
    """Ranks one sequence is split over (Ulysses attention); 1: none."""
    tiled_mlp: bool | None = None
    """Each dense MLP runs tile by tile along the sequence, recomputed in backward."""
    clips_gradients: bool | None = None
    """Not a strategy knob but the training setting two rules read (training.maxGradNorm > 0)."""
    packing: bool | None = None
    """Documents packed into full sequences (dataset.packing): a data knob the model can rule out."""
    # Model facts: not knobs either, but what the sequence-parallel and tiled-MLP rules read (the search fills
    # them from the planned model; None where unknown, and the rules that read them skip).
    attention_heads: int | None = None
    """Query heads of the full-attention layers: Ulysses gives each rank heads / sequenceParallel of them."""
    kv_heads: int | None = None
    """Key/value heads: split like the query heads, or replicated when fewer than the ranks."""
    linear_attention: bool | None = None
    """Some layers keep a recurrent state (Gated DeltaNet...) instead of attending over the whole sequence."""
    windowed_attention: bool | None = None
    """Some layers attend within a window (sliding or chunked), or the scores are soft-capped (Gemma 2)."""
    dense_mlp: bool | None = None
    """Some layer has a dense MLP (the tiled MLP tiles those; a mixture of experts' routed MLPs stay whole)."""
    # A fact of the trainer's runtime (memfit.api.runtime), read by the packing rule.
    linear_attention_kernels: bool | None = None
    """The trainer has flash-linear-attention, whose kernels keep packed documents apart in linear-attention
    layers (handed the documents' boundaries by flash attention)."""

    @property
    def qlora_on_deepspeed(self) -> bool:
        """DeepSpeed cannot partition or offload 4-bit weights; FSDP2 shards their bf16-stored codes (and its
        CPUOffloadPolicy moves them to the host). False while the engine is undecided: fsdp2 may still run it."""
        return self.method == Method.QLORA and self.engine == Engine.DEEPSPEED

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_optimizer in OFFLOADED

    @property
    def offloads_parameters(self) -> bool:
        return self.offload_parameters in OFFLOADED

    @property
    def bf16_masters(self) -> bool:
        return self.master_weights == MasterWeights.BF16


KNOB_NAMES = tuple(field.name for field in fields(Knobs))


def knobs_of(record: object, **decided: Any) -> Knobs:
    """The knobs ``record`` holds as attributes of the same names (``StrategySpec``, ``Strategy``), with
    ``decided`` for the ones it does not hold or overrides."""
    held = {name: getattr(record, name) for name in KNOB_NAMES if hasattr(record, name)}
    return Knobs(**{**held, **decided})


OFFLOADED = (Offload.CPU, Offload.NVME)
FSDP2_OPTIMIZERS = frozenset({Optimizer.ADAMW}) | EIGHT_BIT_OPTIMIZERS
"""What the fsdp2 engine steps on its DTensor shards (bitsandbytes' on each local shard:
memfit_trainer.sharded_8bit)."""
_NOT_BF16 = (Precision.FP16, Precision.FP32)


@dataclass(frozen=True, slots=True)
class Rule:
    """One reason a combination of knobs cannot run as planned: the trainer's preflight refuses it,
    DeepSpeed or FSDP2 refuses it, or silently ignores part of it."""

    applies: Callable[[Knobs], bool]
    message: str
    """Formatted with the knobs' fields (e.g. ``{precision}``)."""

    def check(self, knobs: Knobs) -> str | None:
        return self.message.format_map(_Fields(knobs)) if self.applies(knobs) else None


class _Fields(dict[str, object]):
    """The knobs' fields by name, read only when a message names them (``asdict`` would copy every one)."""

    def __init__(self, knobs: Knobs) -> None:
        super().__init__()
        self.knobs = knobs

    def __missing__(self, name: str) -> object:
        return getattr(self.knobs, name)


def _fsdp2(knobs: Knobs) -> bool:
    return knobs.engine == Engine.FSDP2


def _splits_sequences(knobs: Knobs) -> bool:
    return knobs.sequence_parallel is not None and knobs.sequence_parallel > 1


def _heads_split_unevenly(knobs: Knobs) -> bool:
    """Whether Ulysses cannot give each rank whole heads: the query heads must divide among the ranks, and the
    key/value heads either divide among them or each serve a whole number of ranks (replicated)."""
    sp, heads, kv = knobs.sequence_parallel, knobs.attention_heads, knobs.kv_heads
    if sp is None or heads is None or kv is None:
        return False
    return heads % sp != 0 or (kv % sp != 0 and sp % kv != 0)


def _packs_across_linear_state(knobs: Knobs) -> bool:
    """Whether packed documents would leak into one another through a linear-attention layer's state: unless
    the trainer has flash-linear-attention and attends with flash (where either is decided)."""
    if not (knobs.packing and knobs.linear_attention):
        return False
    return knobs.linear_attention_kernels is False or (
        knobs.attention is not None and knobs.attention != Attention.FLASH
    )


def _deepspeed_keeps_masters(knobs: Knobs) -> bool:
    """Whether DeepSpeed's precision section steps masters of its own (fp16, or bf16 with fp32 masters), not
    the model's weights."""
    return knobs.precision == Precision.FP16 or (
        knobs.master_weights == MasterWeights.FP32 and knobs.precision != Precision.FP32
    )


RULES: tuple[Rule, ...] = (
    Rule(
        lambda k: k.method == Method.QLORA and k.precision in _NOT_BF16,
        "method qlora computes in bf16 (the trainer refuses it in {precision}): set training.precision to bf16 or "
        "auto, on a GPU with bf16",
    ),
    Rule(
        lambda k: k.qlora_on_deepspeed and k.zero_stage == 3,
        "method qlora cannot run under DeepSpeed ZeRO-3 (DeepSpeed does not partition 4-bit weights); use zeroStage "
        "0-2, or strategy.engine fsdp2 (it shards them)",
    ),
    Rule(
        lambda k: k.qlora_on_deepspeed and k.offloads_parameters,
        "method qlora keeps its 4-bit base on the GPU under DeepSpeed (parameter offload needs ZeRO-3, which "
        "DeepSpeed cannot run with qlora); strategy.engine fsdp2 offloads it",
    ),
    Rule(
        lambda k: k.offloads_parameters and k.zero_stage is not None and k.zero_stage != 3,
        "strategy.offloadParameters needs zeroStage 3 (only ZeRO-3 partitions parameters; DeepSpeed ignores "
        "parameter offload under ZeRO 0-2)",
    ),
    Rule(
        lambda k: k.offloads_optimizer and k.zero_stage == 0,
        "strategy.offloadOptimizer needs zeroStage 1-3 (DeepSpeed ignores it without ZeRO)",
    ),
    Rule(
        lambda k: (
            k.offload_optimizer == Offload.NVME
            and (k.zero_stage in (1, 2) or (k.method == Method.QLORA and k.zero_stage is None))
        ),
        "strategy.offloadOptimizer nvme needs zeroStage 3 (ZeRO-1 and ZeRO-2 keep offloaded optimizer states in "
        "CPU memory, whatever the device says)",
    ),
    Rule(
        lambda k: k.offloads_optimizer and k.optimizer in EIGHT_BIT_OPTIMIZERS,
        "8-bit optimizers run on the GPU; they cannot be combined with strategy.offloadOptimizer",
    ),
    Rule(
        lambda k: bool(k.activation_offloading) and k.gradient_checkpointing is False,
        "strategy.activationOffloading moves the saved inputs of checkpointed layers: it needs "
        "strategy.gradientCheckpointing true",
    ),
    Rule(
        lambda k: k.bf16_masters and k.precision in _NOT_BF16,
        "strategy.masterWeights bf16 needs training.precision bf16 (not {precision})",
    ),
    # What the FSDP2 engine cannot run: it always shards parameters, gradients and optimizer states (ZeRO 2 or
    # 3, by whether parameters are resharded after the forward pass), and its CPUOffloadPolicy moves all three
    # to the host together.
    Rule(
        lambda k: _fsdp2(k) and k.precision == Precision.FP16,
        "strategy.engine fsdp2 trains in bf16 or fp32 (fp16 needs loss scaling, which it does not do)",
    ),
    Rule(
        lambda k: _fsdp2(k) and k.zero_stage in (0, 1),
        "strategy.engine fsdp2 shards parameters, gradients and optimizer states: zeroStage 3 (resharded after the "
        "forward pass) or 2 (kept gathered until the backward pass)",
    ),
    Rule(
        lambda k: _fsdp2(k) and Offload.NVME in (k.offload_optimizer, k.offload_parameters),
        "strategy.engine fsdp2 offloads to CPU memory only (no NVMe)",
    ),
    Rule(
        lambda k: (
            _fsdp2(k)
            and Offload.NVME not in (k.offload_optimizer, k.offload_parameters)
            and None not in (k.offload_optimizer, k.offload_parameters)
            and k.offload_optimizer != k.offload_parameters
        ),
        "strategy.engine fsdp2 offloads parameters, gradients and optimizer states together: set offloadOptimizer "
        "and offloadParameters alike",
    ),
    Rule(
        lambda k: _fsdp2(k) and k.optimizer is not None and k.optimizer not in FSDP2_OPTIMIZERS,
        "training.optimizer {optimizer} runs on the deepspeed engine; strategy.engine fsdp2 runs adamw, adamw8bit "
        "and paged_adamw8bit (on its sharded tensors)",
    ),
    Rule(
        lambda k: k.bf16_masters and k.offloads_optimizer and not _fsdp2(k),
        "strategy.masterWeights bf16 keeps the optimizer on the GPU; with strategy.offloadOptimizer use fp32 masters "
        "(host memory holds them)",
    ),
    # The optimizer step in backward: each parameter steps as soon as its gradient is reduced: only fsdp2's hooks
    # do that, the gradient must be final (one micro-batch per step), and no step can wait for the norm of all
    # gradients.
    Rule(
        lambda k: bool(k.optimizer_in_backward) and k.engine == Engine.DEEPSPEED and k.zero_stage not in (None, 0),
        "strategy.optimizerInBackward on the deepspeed engine needs zeroStage 0 (ZeRO 1-3 step their partitions "
        "after the backward; fsdp2 steps its shards in it)",
    ),
    Rule(
        lambda k: bool(k.optimizer_in_backward) and k.engine == Engine.DEEPSPEED and _deepspeed_keeps_masters(k),
        "strategy.optimizerInBackward on the deepspeed engine steps the model's own weights: it needs "
        "strategy.masterWeights bf16 (DeepSpeed's mixed precision steps fp32 masters after the backward)",
    ),
    Rule(
        lambda k: (
            bool(k.optimizer_in_backward)
            and k.gradient_accumulation_steps is not None
            and k.gradient_accumulation_steps > 1
        ),
        "strategy.optimizerInBackward needs gradient accumulation 1 (got {gradient_accumulation_steps}): each "
        "micro-batch's gradients are stepped on as its backward makes them; use a micro-batch of globalBatchSize "
        "/ GPUs",
    ),
    Rule(
        lambda k: bool(k.optimizer_in_backward) and bool(k.clips_gradients),
        "strategy.optimizerInBackward cannot clip gradients (a parameter's step cannot wait for the global norm of "
        "all of them): set training.maxGradNorm: 0",
    ),
    # Ulysses sequence parallelism: two all-to-alls per attention give each rank the whole sequence for a share
    # of the heads (DeepSpeed's UlyssesSPAttentionHF, on either engine).
    Rule(
        lambda k: _splits_sequences(k) and k.attention == Attention.EAGER,
        "strategy.sequenceParallel {sequence_parallel} needs sdpa or flash attention (DeepSpeed's Ulysses "
        "attention refuses eager)",
    ),
    Rule(
        lambda k: _splits_sequences(k) and k.attention == Attention.FLEX,
        "strategy.sequenceParallel {sequence_parallel} cannot run flex attention (its mask is rebuilt causal-only "
        "over the gathered sequence, so packed documents would attend across their boundaries); use sdpa or flash",
    ),
    Rule(
        lambda k: _splits_sequences(k) and bool(k.optimizer_in_backward),
        "strategy.optimizerInBackward cannot run with strategy.sequenceParallel {sequence_parallel} (its "
        "per-parameter reduction averages over every rank, not over the data-parallel groups)",
    ),
    Rule(
        lambda k: _splits_sequences(k) and k.method == Method.QLORA,
        "strategy.sequenceParallel {sequence_parallel} is not supported with method qlora yet; use lora or full",
    ),
    Rule(
        _heads_split_unevenly,
        "strategy.sequenceParallel {sequence_parallel} must divide the model's {attention_heads} attention heads, "
        "and divide or be a multiple of its {kv_heads} key/value heads (each rank attends with whole heads)",
    ),
    Rule(
        lambda k: _splits_sequences(k) and bool(k.linear_attention),
        "strategy.sequenceParallel {sequence_parallel} cannot split this model: its linear-attention layers "
        "(Gated DeltaNet...) would each see only their rank's share of the sequence",
    ),
    Rule(
        lambda k: (
            _splits_sequences(k)
            and bool(k.windowed_attention)
            and k.attention is not None
            and k.attention != Attention.FLASH
        ),
        "strategy.sequenceParallel {sequence_parallel} runs this model's windowed or soft-capped attention only "
        "with flash attention (not {attention})",
    ),
    Rule(
        _packs_across_linear_state,
        "dataset.packing: this model's linear-attention layers (Gated DeltaNet...) would carry their state from "
        "one packed document into the next (only flash-linear-attention's kernels with flash attention keep them "
        "apart): leave dataset.packing out (off for this model) or set it false",
    ),
    Rule(
        lambda k: bool(k.tiled_mlp) and k.dense_mlp is False,
        "strategy.tiledMlp tiles dense MLPs, and every layer of this model routes its tokens to experts (which "
        "it leaves whole): leave strategy.tiledMlp out",
    ),
)


def conflicts(knobs: Knobs) -> list[str]:
    """Why ``knobs`` cannot run as planned, one message per broken rule (none: they can)."""
    return list(_conflicts(knobs))


@lru_cache(maxsize=1 << 14)
def _conflicts(knobs: Knobs) -> tuple[str, ...]:
    """The search asks this of the same few thousand knob records again and again (every pool, method and
    variant): the rules are pure, so each record is checked once."""
    return tuple(message for rule in RULES if (message := rule.check(knobs)) is not None)
