"""DeepSpeed ZeRO's memory: model states per GPU, communication buckets, host loading and the backward's gradients.

The accounting is the ZeRO paper's (Rajbhandari et al. 2020, §3: 2Ψ for 16-bit weights, 2Ψ for 16-bit
gradients, KΨ for the optimizer with K = 12 for mixed-precision Adam: fp32 master weights, momentum and
variance; each ZeRO stage partitions one more of them over the N data-parallel ranks) plus the one
buffer DeepSpeed adds that the paper leaves out: the fp32 copy of a rank's gradient partition that the
optimizer step works on (DeepSpeed's own estimators count it: ``2Ψ + 18Ψ/N`` for ZeRO-2).

What the optimizer steps on decides the size of its states, so it is followed tensor by tensor:

* ZeRO 1-3 hand the optimizer one flat 1-d partition per rank (``single_partition_of_fp32_groups`` in
  ``stage_1_and_2.py``, ``fp32_partitioned_groups_flat`` in ``stage3.py``), in the master dtype;
* ZeRO-0 hands it the model's own tensors: DeepSpeed's mixed precision wraps a client optimizer in
  ``FP16_UnfusedOptimizer``, which keeps one fp32 master per parameter (its fused ``FP16_Optimizer``, for
  DeepSpeed's own Adam, flattens them, which changes nothing for Adam's element-wise states), and without
  mixed precision (fp32, or bf16 masters) the optimizer gets the parameters themselves.

Adafactor's and bitsandbytes' states, per tensor or per partition, are counted in :mod:`memfit.memory.states`.

Offloaded to the CPU, the host holds what DeepSpeed pins, as PyTorch's pinned allocator rounds it
(:func:`zero_pinned_buffers`, :func:`host_pinned_bytes`), and the optimizer's pageable states.

bf16 master weights (``Strategy.master_weights``, pure bf16 training) change three terms:

========================  ===================  ==========================  ================
per trainable parameter   ZeRO-0               ZeRO-1/2/3                  fp32 masters
========================  ===================  ==========================  ================
master copy               0 (the weights)      2/N (a bf16 clone)          4 (/N under ZeRO)
Adam moments              2 x 2                2 x 2/N                     2 x 4 (/N)
Lion momentum             2                    2/N                         4 (/N)
step gradient             0 (reads .grad)      2/N (the flattened bf16     4 (/N)
                                               partition)
========================  ===================  ==========================  ================

Weights and gradients stay 16-bit as with mixed precision; 8-bit and Adafactor states have their own
dtypes whatever the masters' (bitsandbytes quantizes, Adafactor upcasts to fp32). With bf16 masters the
step's transients are counted whole (:func:`bf16_step_transient`): the gradient norm's fp64 copy of one
gradient piece can outgrow the bf16 partition, and ZeRO-0's clipping copies one gradient to fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memfit.api.vocabulary import MasterWeights, Method, Offload, Optimizer, Precision
from memfit.memory.activations import ActivationEstimate, pinned_host_bytes, tiled_mlp_gradients
from memfit.memory.engine import Moment
from memfit.memory.setup import Adapters, StaticSetup
from memfit.memory.sizes import BF16, FP32, FP64, NF4_BYTES_PER_PARAMETER, compute_bytes
from memfit.memory.states import (
    ELEMENTWISE_STATES,
    ModelStates,
    largest_trainable_tensor,
    optimizer_state_bytes,
    trainable_split,
    trainable_tensors,
)
from memfit.planned_model import PlannedModel, TensorCounts
from memfit.render.deepspeed import bucket_elements


def zero3_working_set(shape: PlannedModel) -> int:
    """Parameters a ZeRO-3 rank holds gathered at once: the module being computed (the embedding or
    LM head can be the largest) plus the next layer prefetched, plus the small persistent ones."""
    return shape.largest_layer_parameters + shape.layer_parameters + shape.norm_parameters


def master_bytes(setup: StaticSetup) -> int:
    """Bytes of one master weight (0: the optimizer updates the weights themselves)."""
    if setup.precision == Precision.FP32:
        return 0
    if setup.master_weights == MasterWeights.BF16 and setup.precision == Precision.BF16:
        return BF16 if setup.zero_stage > 0 else 0
    return FP32


def bf16_step_transient(shape: PlannedModel, setup: StaticSetup, adapters: Adapters) -> float:
    """What exists only during the optimizer step with bf16 masters, beyond gradients, masters and states.

    ZeRO 1-3 flatten the rank's gradient partition for the optimizer (bf16: ``.to(master dtype)`` then copies
    nothing), after computing the gradient norm piece by piece, each piece cast to fp64 first
    (``get_norm_dtype``): the larger of the partition and the largest piece's fp64 copy. A piece is the part of
    a gradient inside the partition under ZeRO-1/2 and a parameter's partition under ZeRO-3. With bf16 masters
    the norm's copy is often the larger one (Llama 3.1 8B on 8 GPUs: the 525M-element embedding, 4.2 GB
    in fp64, against a 2 GB partition).

    ZeRO-0 has no partition (the optimizer reads the gradients) but DeepSpeed clips them itself
    (``clip_fp32_gradients``: the norm of ``grad.float()``, one gradient at a time): the largest gradient's
    fp32 copy.

    Adafactor computes in fp32: over bf16 it adds ``grad.float()`` and ``p.float()`` of the tensor it steps
    (the flat partition under ZeRO, one tensor at a time at ZeRO-0), 8 bytes per element. (Its update's own
    two fp32 temporaries, 8 bytes per element, exist with fp32 masters too, and like every optimizer's
    temporaries are not counted here.)"""
    trainable = trainable_split(shape, setup.method, adapters).trainable
    largest = largest_trainable_tensor(shape, setup.method, adapters)
    upcasts = 2 * FP32 if setup.optimizer == Optimizer.ADAFACTOR else 0
    if setup.zero_stage == 0:
        return max(FP32, upcasts) * largest
    partition = trainable / setup.gpus
    piece = largest / setup.gpus if setup.zero_stage == 3 else min(largest, partition)
    return max((BF16 + upcasts) * partition, FP64 * piece)


PinnedBuffers = tuple[tuple[float, float], ...]
"""(bytes, how many) of each kind of host buffer one rank pins; a count may be a share of the ranks' buffers."""

SUB_GROUP_ELEMENTS = 1_000_000_000
"""ZeRO-3 steps a rank's partition in sub-groups of about this many elements (DeepSpeed's ``sub_group_size``
default, ``runtime/zero/config.py``, which memfit's renderer keeps), each with its own fp32 gradient buffer."""


def host_pinned_bytes(buffers: PinnedBuffers) -> int:
    """Host bytes that ``buffers`` take once pinned. DeepSpeed pins through ``get_accelerator().pin_memory``,
    on CUDA ``tensor.pin_memory()``, whose ``CachingHostAllocator`` rounds every block up to a power of two
    (:func:`~memfit.memory.activations.pinned_host_bytes`) and keeps a freed block cached; pinned memory is
    page-locked, never swapped, and charged to the pod's cgroup like any other, so its rounding is part of the
    pod's memory request. (On a CPU pool DeepSpeed's CPU accelerator pins nothing and the buffers are
    pageable, without rounding: the static memory does not know the pool, so the rounding is counted there
    too.)"""
    return math.ceil(sum(count * pinned_host_bytes(math.ceil(nbytes)) for nbytes, count in buffers))


def _partition(elements: int, gpus: int) -> int:
    """A rank's share of a tensor or a flat group: DeepSpeed pads it to a multiple of the ranks."""
    return -(-elements // gpus)


def stage12_pinned_buffers(shape: PlannedModel, setup: StaticSetup, adapters: Adapters) -> PinnedBuffers:
    """What ZeRO-1/2 pin per rank under optimizer offload (``runtime/zero/stage_1_and_2.py``): the fp32 master
    partition (561-565) and a 16-bit copy of it through which the updated weights go back to the GPU
    (566-575), the fp32 gradient partition the CPU optimizer reads (936-941), a 16-bit buffer of the largest
    parameter (653-658) and, under ZeRO-2 from the first micro-batch that accumulates, a 16-bit buffer of each
    whole parameter of the rank's partition (1822-1825, 1852-1853): its share of every tensor, and the tensor
    straddling its boundary, which both neighbouring ranks hold whole. (ZeRO-1 reduces only at the accumulation
    boundary, 2293-2295, where its count of reduced micro-batches is still 0, 2166 and 3256-3258: it pins none.)
    They exist only with gradient accumulation, which static memory does not know: they are counted for every
    ZeRO-2 plan (with none, 2 bytes per parameter over the ranks too many)."""
    n, w = setup.gpus, compute_bytes(setup.precision)
    partition = _partition(trainable_split(shape, setup.method, adapters).trainable, n)
    largest = w * largest_trainable_tensor(shape, setup.method, adapters)
    flat = ((FP32 * partition, 2), (w * partition, 1), (largest, 1))
    if setup.zero_stage == 1:
        return flat
    accumulated = tuple((w * math.prod(t), count / n) for t, count in trainable_tensors(shape, setup.method, adapters))
    return (*flat, (largest, 1), *accumulated)


def _model_tensors(shape: PlannedModel, setup: StaticSetup, adapters: Adapters) -> TensorCounts:
    """Every parameter tensor of the trained model: the adapters too with LoRA."""
    base = shape.full_tensors()
    return base if setup.method == Method.FULL else base + trainable_tensors(shape, setup.method, adapters)


def _trained_partition(shape: PlannedModel, setup: StaticSetup, adapters: Adapters) -> int:
    """Elements of a ZeRO-3 rank's partitions of the trained parameters (each one padded to the ranks)."""
    return sum(
        count * _partition(math.prod(t), setup.gpus) for t, count in trainable_tensors(shape, setup.method, adapters)
    )


def stage3_pinned_buffers(shape: PlannedModel, setup: StaticSetup, adapters: Adapters) -> PinnedBuffers:
    """What ZeRO-3 pins per rank. Optimizer offload (``runtime/zero/stage3.py``): the 16-bit gradient
    partitions of the trained parameters, one flat buffer (790-795), and on the CPU an fp32 gradient buffer
    per sub-group for the CPU optimizer (1336-1342); the fp32 masters (1158-1160) and the states are pageable.
    Parameter offload to the CPU: ``zero.Init`` pins every parameter's partition
    (``partition_parameters.py`` 1842-1843; it applies no persistence threshold, 1292, as nothing calls
    ``_update_persist_config``), then the trained ones move into one flat 16-bit buffer, pinned whatever
    ``pin_memory`` says (``stage3.py`` 906): their own blocks are freed into the pinned allocator's cache,
    which keeps them."""
    n, w = setup.gpus, compute_bytes(setup.precision)
    trained = _trained_partition(shape, setup, adapters)
    buffers: list[tuple[float, float]] = []
    if setup.offload_optimizer != Offload.NONE:
        buffers.append((w * trained, 1))
    if setup.offload_optimizer == Offload.CPU:
        whole, rest = divmod(trained, SUB_GROUP_ELEMENTS)
        buffers += [(FP32 * size, count) for size, count in ((SUB_GROUP_ELEMENTS, whole), (rest, 1)) if size * count]
    if setup.offload_parameters == Offload.CPU:
        buffers += [(w * _partition(math.prod(t), n), count) for t, count in _model_tensors(shape, setup, adapters)]
        buffers.append((w * trained, 1))
    return tuple(buffers)


def zero_pinned_buffers(shape: PlannedModel, setup: StaticSetup, adapters: Adapters) -> PinnedBuffers:
    """The host buffers one rank pins for what it offloads (the renderer asks for ``pin_memory``, also
    DeepSpeed's default: ``runtime/zero/offload_config.py`` 45 and 75)."""
    if setup.zero_stage == 3:
        return stage3_pinned_buffers(shape, setup, adapters)
    if setup.zero_stage in (1, 2) and setup.offload_optimizer != Offload.NONE:
        return stage12_pinned_buffers(shape, setup, adapters)
    return ()


def zero_model_states(shape: PlannedModel, setup: StaticSetup, adapters: Adapters) -> ModelStates:
    """Weights, gradients and optimizer states of one rank under ZeRO."""
    split = trainable_split(shape, setup.method, adapters)
    n = setup.gpus
    stage = setup.zero_stage
    w = compute_bytes(setup.precision)
    bf16_masters = setup.master_weights == MasterWeights.BF16 and setup.precision == Precision.BF16

    # QLoRA: only the decoder linears are 4-bit; the trainer keeps everything else (embeddings, LM head,
    # norms, adapters) in the compute dtype (memfit_trainer.model.prepare_kbit_model).
    trainable_bytes = w
    frozen_bytes = split.frozen_quantized * NF4_BYTES_PER_PARAMETER + split.frozen_unquantized * w
    weights = frozen_bytes + split.trainable * trainable_bytes

    # What the optimizer updates: fp32 masters (mixed precision), bf16 ones, or the weights themselves.
    masters = master_bytes(setup)
    element_bytes = BF16 if bf16_masters else FP32
    shards = n if stage >= 1 else 1
    optimizer: float
    paged: float = 0
    if setup.optimizer in ELEMENTWISE_STATES:  # the same bytes per element in any tensor
        optimizer = split.trainable * (masters + ELEMENTWISE_STATES[setup.optimizer] * element_bytes) / shards
    else:
        partition = split.trainable / n if stage >= 1 else None
        states = optimizer_state_bytes(shape, setup.method, adapters, setup.optimizer, element_bytes, partition)
        optimizer = split.trainable * masters / shards + states.device
        paged = states.paged
    grads: float = split.trainable * trainable_bytes
    step_grads: float = split.trainable * masters / shards
    if bf16_masters:
        step_grads = bf16_step_transient(shape, setup, adapters)
    if stage >= 2:
        grads /= n
    if setup.optimizer_in_backward:  # ZeRO-0: each gradient is all-reduced, stepped on and freed once made
        # Adafactor steps a 16-bit tensor through fp32 copies of it and its gradient (bf16_step_transient).
        upcasts = 2 * FP32 if setup.optimizer == Optimizer.ADAFACTOR and trainable_bytes != FP32 else 0
        grads = largest_trainable_tensor(shape, setup.method, adapters) * (trainable_bytes + upcasts)
        step_grads = 0
    # Under ZeRO-3 the module being reduced holds its full gradient before the reduce-scatter.
    gathered_grads = shape.largest_layer_parameters * w if stage == 3 and setup.method == Method.FULL else 0
    if stage == 3:
        working_set = zero3_working_set(shape) * w
        weights = weights / n + working_set
        grads += gathered_grads
        if setup.offload_parameters != Offload.NONE:
            weights = working_set

    cpu = nvme = 0.0
    if setup.offload_optimizer != Offload.NONE:
        # Master weights and states move to the host, and reduced gradient partitions are copied
        # straight into the fp32 buffers the CPU optimizer reads: the GPU keeps only the buckets
        # (and, under ZeRO-3, the full gradient of the module being reduced). What DeepSpeed pins (the
        # masters at ZeRO-1/2, the gradient buffers) is in zero_pinned_buffers; the states are pageable.
        grads = gathered_grads
        if setup.offload_optimizer == Offload.CPU:
            host_states = optimizer - split.trainable * masters / shards + paged
            cpu += host_states + (FP32 * _trained_partition(shape, setup, adapters) if stage == 3 else 0)
        else:
            cpu += step_grads
            nvme += optimizer + paged
        optimizer = step_grads = paged = 0
    cpu += paged + host_pinned_bytes(zero_pinned_buffers(shape, setup, adapters))
    if stage == 3 and setup.offload_parameters == Offload.NVME:
        nvme += (frozen_bytes + split.trainable * trainable_bytes) / n
    return ModelStates(
        parameters=int(weights),
        gradients=int(grads),
        step_gradients=int(step_grads),
        optimizer_states=int(optimizer),
        cpu_per_rank=int(cpu),
        nvme_per_rank=int(nvme),
    )


OVERLAP_BUCKETS = 4.5
"""DeepSpeed's documentation: with overlap_comm, ZeRO-1/2 keep about 4.5x each bucket size alive."""

DDP_ALLREDUCE_ELEMENTS = 500_000_000
"""ZeRO-0: DeepSpeed all-reduces gradients in flattened buckets of up to 5e8 elements."""


def communication_buffer_bytes(shape: PlannedModel, setup: StaticSetup, trainable: int) -> int:
    """Gradient and parameter buckets DeepSpeed allocates for collective communication."""
    if setup.gpus == 1 or setup.optimizer_in_backward:  # in backward: each gradient all-reduced in place
        return 0
    w = compute_bytes(setup.precision)
    buckets = bucket_elements(shape, setup.zero_stage)
    if setup.zero_stage == 0:
        return w * min(trainable, DDP_ALLREDUCE_ELEMENTS)
    if setup.zero_stage in (1, 2):
        return int(OVERLAP_BUCKETS * w * (buckets["reduce"] + buckets["allgather"]))
    return 2 * w * buckets["reduce"]  # double-buffered reduce-scatter; prefetched weights are in the working set


@dataclass(frozen=True, slots=True)
class GradientTimeline:
    """When gradients appear in the backward pass (full fine-tuning; adapters' are negligible)."""

    head: int
    """Made before the last layer's worst point: the LM head's weight gradient (made first), and a tiled MLP's
    weights' gradients (made whole at its first tile)."""
    missing_at_first_layer: int
    """Not yet made while the first layer back-propagates: its own and the (untied) embedding's."""
    tied_extra: int
    """Tied embeddings: at the very end the head's and the embedding's gradients and their sum are
    alive together."""


def gradient_timeline(
    shape: PlannedModel, method: Method, precision: Precision, made_early: int = 0
) -> GradientTimeline:
    """``made_early``: bytes of a layer's gradients that already exist at its worst point (a tiled MLP's,
    :func:`memfit.memory.activations.tiled_mlp_gradients`)."""
    if method != Method.FULL:
        return GradientTimeline(0, 0, 0)
    w = compute_bytes(precision)
    head = shape.vocab_size * shape.hidden_size * w
    embedding = 0 if shape.tie_word_embeddings else head
    return GradientTimeline(
        head=head + made_early,
        missing_at_first_layer=shape.layer_parameters * w - made_early + embedding,
        tied_extra=2 * head if shape.tie_word_embeddings else 0,
    )


def _moment_gradients(gradients: int, grads_persist: bool, timeline: GradientTimeline) -> tuple[int, int, int, int]:
    """Gradient bytes alive at each candidate moment of the backward pass (see forward_backward_moments)."""
    resident = gradients if grads_persist else 0
    at_first_layer = gradients if grads_persist else max(0, gradients - timeline.missing_at_first_layer)
    return resident, resident + timeline.head, at_first_layer, gradients + timeline.tied_extra


def forward_backward_moments(
    activations: ActivationEstimate, gradients: int, grads_persist: bool, timeline: GradientTimeline
) -> tuple[int, int]:
    """(gradient bytes, activation bytes) at the worst moment of the forward and backward passes.

    Gradients grow as the backward pass frees activations, so the candidates are: its start (loss
    buffers), the last layer's backward (the head's gradient exists), the first layer's backward
    (nearly every gradient exists), and its end (tied embeddings' extra gradient copies)."""
    at_loss, at_last_layer, at_first_layer, at_end = _moment_gradients(gradients, grads_persist, timeline)
    moments = [
        (at_loss, activations.loss_moment),
        (at_last_layer, activations.layer_moment),
        (at_first_layer, activations.first_layer_moment),
        (at_end, activations.backward_end),
    ]
    return max(moments, key=sum)


@dataclass(frozen=True, slots=True)
class ZeroForwardBackward:
    """DeepSpeed's forward and backward passes: the model states' gradients, growing along the backward
    (:func:`forward_backward_moments`); ZeRO-3's gathered working set is part of the resident weights."""

    gradients: int
    timeline: GradientTimeline

    def binding(self, activations: ActivationEstimate, grads_persist: bool) -> Moment:
        gradients, acts = forward_backward_moments(activations, self.gradients, grads_persist, self.timeline)
        return Moment(0, gradients, acts)

    def binding_total(self, activations: ActivationEstimate, grads_persist: bool) -> int:
        a = activations
        at_loss, at_last_layer, at_first_layer, at_end = _moment_gradients(self.gradients, grads_persist, self.timeline)
        return max(at_loss + a.loss_moment, at_last_layer + a.layer_moment,
                   at_first_layer + a.first_layer_moment, at_end + a.backward_end)  # fmt: skip


class DeepSpeedMemory:
    """:class:`memfit.memory.engine.EngineMemory` of DeepSpeed ZeRO."""

    def model_states(self, shape: PlannedModel, setup: StaticSetup, adapters: Adapters) -> ModelStates:
        return zero_model_states(shape, setup, adapters)

    def communication_buffers(self, shape: PlannedModel, setup: StaticSetup, trainable: int) -> int:
        return communication_buffer_bytes(shape, setup, trainable)

    def loaded_on_host(self, shape: PlannedModel, setup: StaticSetup) -> int:
        """ZeRO-3 builds the model already partitioned and QLoRA quantizes shard by shard straight onto the
        GPU: neither holds the whole model on the host. Otherwise every rank loads the 16-bit model into host
        memory first."""
        if setup.zero_stage == 3 or setup.method == Method.QLORA:
            return 0
        return BF16 * shape.parameter_count

    def gradients_persist(self, setup: StaticSetup) -> bool:
        """ZeRO-2/3 keep their gradient partition."""
        return setup.zero_stage >= 2

    def forward_backward(
        self, shape: PlannedModel, setup: StaticSetup, adapters: Adapters, states: ModelStates
    ) -> ZeroForwardBackward:
        made_early = tiled_mlp_gradients(shape, setup.method, setup.tiled_mlp, compute_bytes(setup.precision))
        return ZeroForwardBackward(
            states.gradients, gradient_timeline(shape, setup.method, setup.precision, made_early)
        )
