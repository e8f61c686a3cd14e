"""Model states and the step's transient buffers per GPU under PyTorch FSDP2 (``fully_shard``).

The trainer's FSDP2 engine shards every decoder layer as one parameter group and the root (embedding,
final norm, LM head) as another; each rank keeps 1/N of every parameter, gradient and optimizer state
(``FSDPParam`` pads dim 0 of each tensor to a multiple of N; the padding, under N rows per tensor, is left
out here). Notation, per rank of N: R the root group's parameters (embedding + final norm + untied
head), Λ one decoder layer's (with LoRA: its frozen base and its adapters), T the trained ones, and

========================  ==========================  ===========================  =====================
bytes per element         fp32 masters                bf16 masters                 fp32 training
========================  ==========================  ===========================  =====================
sharded parameter s       4 (trained), 2 (frozen)     2                            4
sharded gradient          4 (``reduce_output``)       2                            4
Adam states               2 x 4                       2 x 2                        2 x 4
gathered parameter c      2 (``param_dtype`` bf16)    2                            4
unsharded gradient        2 (autograd, bf16)          2                            4
reduce-scatter buffer r   4 (``reduce_dtype`` fp32)   2                            4
========================  ==========================  ===========================  =====================

So full fine-tuning holds 16/N bytes per parameter with fp32 masters (4 weight + 4 gradient + 8 Adam), 8/N
with bf16 masters, plus the working set below. What torch allocates, by file of
``torch/distributed/fsdp/_fully_shard``:

* ``_fsdp_collectives.foreach_all_gather``: one flat ``all_gather_output`` of c x group bytes per group
  gathered; ``foreach_all_gather_copy_out`` then copies it into each parameter's own unsharded tensor
  (``FSDPParam.alloc_all_gather_outputs``, c x group again). In forward the flat output is kept in
  ``comm_ctx.all_gather_state`` until the next group's copy-out (overlap of the next all-gather); in
  backward a group's pre-backward prefetches the group before it (``_backward_prefetch``), whose flat
  output waits in ``_all_gather_result`` until that group runs. So a layer being computed costs 2 x c x Λ.
* the root group is gathered through the whole forward (the model's forward is the root module's) and
  again from the loss to the end of the backward (its pre-backward hook is on the loss): c x R always;
* ``reshard_after_forward=False`` (zero stage 2): a layer's unsharded parameters stay from its forward
  to its backward: at the loss every layer's c x Λ is alive;
* ``FSDPParamGroup.post_backward`` reshards the group, then ``foreach_reduce`` allocates the
  reduce-scatter input (r x group, ``reduce_scatter_comm.allocate``), copies the unsharded gradients into
  it (``chunk_cat``) and frees them, then the output (r x group / N) becomes the sharded gradient
  (``as_strided`` views of it; cast to the parameter dtype when that differs, never here). The input is
  kept in ``comm_ctx.reduce_scatter_states`` until the next group's post-backward (one in flight,
  ``reduce_scatter_max_input_buffers``), and the last one until the root's final callback;
* the LM head's unsharded gradient (c x V x h) exists from the loss's backward until the root's
  post-backward at the very end, when the embedding's joins it (tied: is added to it).

The backward's worst moments (:meth:`Fsdp2Step.moments`): its start (loss buffers), the last layer's backward
(head gradient, the layer's own gradients, the prefetched layer), the first layer's (every other layer's
sharded gradient and the second layer's reduce-scatter input) and the root's reduce-scatter at the end
(every layer's sharded gradient, the root's unsharded gradients and its r x R input buffer: for Llama 3.1
8B with fp32 reduction 2 + 4 bytes x 1.05B = 6.3 GB).

With the optimizer step in backward (``optimizer_in_backward``) FSDP2 calls each sharded parameter's
post-accumulate-grad hook inside ``foreach_reduce``, right after its group's reduce-scatter; the hook steps
that parameter's AdamW and sets its ``.grad`` to None, so the group's reduce output (the ``as_strided``
views' storage) is released when ``foreach_reduce`` returns: no sharded gradient outlives its group's
post-backward, and the resident gradients are those of at most one group (the root's output replaces its
unsharded gradients at the end of the backward, where the head's step adds its foreach AdamW temporary,
one shard of V x h).

QLoRA (the FSDP-QLoRA recipe): the trainer stores the 4-bit codes of the frozen base in bf16 elements
(``bnb_4bit_quant_storage``, four codes per element), so ``fully_shard`` shards and gathers them like any
bf16 weight: each rank holds 1/N of the packed codes (half a byte per parameter) and a layer's all-gather
moves its packed codes plus its other parameters at c bytes. The quant states (absmax per 64-block, the
fp32 scale per 256 blocks, the code tables) are attributes of each ``Linear4bit``, not parameters: every
rank keeps all of them (:func:`replicated_quant_states`), on the GPU even under offload. The bf16 weight
``bnb.matmul_4bit`` dequantizes, one linear at a time, is not counted (nor is it on the DeepSpeed path).

``CPUOffloadPolicy`` (offload = cpu) keeps the sharded parameters, gradients and optimizer states in
pinned host memory and steps the optimizer there: the GPU keeps only what is gathered, the unsharded
gradients and the reduce-scatter buffers (each group's sharded gradient is copied to the host as soon as
it is reduced); the host holds every sharded state.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.api.vocabulary import MasterWeights, Method, Offload, Optimizer, Precision
from memfit.memory.activations import LOSS_BYTES_PER_LOGIT, ActivationEstimate
from memfit.memory.engine import Moment
from memfit.memory.setup import Adapters, StaticSetup
from memfit.memory.sizes import (
    BF16,
    FP32,
    NF4_BYTES_PER_PARAMETER,
    NF4_PACKED_BYTES_PER_PARAMETER,
    compute_bytes,
    nf4_quant_state_bytes,
)
from memfit.memory.states import ELEMENTWISE_STATES, ModelStates, optimizer_state_bytes, trainable_split
from memfit.planned_model import PlannedModel


@dataclass(frozen=True, slots=True)
class Fsdp2Widths:
    """Bytes per element of each FSDP2 tensor kind for one strategy (the module docstring's table)."""

    sharded_trained: int
    """A trained parameter's shard (the parameter's own dtype: what ``fully_shard`` was given)."""
    sharded_frozen: int
    """A frozen parameter's shard (LoRA's base stays in the compute dtype; QLoRA's 4-bit weights are
    :func:`packed_bytes` instead)."""
    gathered: int
    """An all-gathered parameter (``MixedPrecisionPolicy.param_dtype``) and its autograd gradient."""
    reduce: int
    """The reduce-scatter buffers (``reduce_dtype``) and so the sharded gradient."""


def fsdp2_widths(precision: Precision, master_weights: MasterWeights) -> Fsdp2Widths:
    c = compute_bytes(precision)
    fp32 = precision == Precision.FP32
    bf16_masters = master_weights == MasterWeights.BF16 and not fp32
    trained = BF16 if bf16_masters else FP32
    return Fsdp2Widths(sharded_trained=trained, sharded_frozen=c, gathered=c, reduce=trained)


@dataclass(frozen=True, slots=True)
class Fsdp2Groups:
    """Elements of the two kinds of parameter group ``fully_shard`` makes."""

    root: int
    """Embedding, final norm and (untied) LM head: gathered whole."""
    root_trained: int
    layer: int
    """One decoder layer, frozen base included."""
    layer_quantized: int
    """QLoRA: the layer's 4-bit weights (part of ``layer``), sharded and gathered as packed codes."""
    layer_trained: int
    head: int
    """The LM head's weight (the embedding's when tied), whose gradient is made first in backward."""
    layers: int


def fsdp2_groups(shape: PlannedModel, method: Method, adapters: Adapters) -> Fsdp2Groups:
    root = (
        shape.embedding_parameters + shape.hidden_size + (0 if shape.tie_word_embeddings else shape.lm_head_parameters)
    )
    layer = shape.layer_parameters
    if method == Method.FULL:
        return Fsdp2Groups(root, root, layer, 0, layer, shape.vocab_size * shape.hidden_size, shape.num_layers)
    added = shape.lora_parameters(adapters.rank, adapters.targets) // shape.num_layers
    quantized = shape.quantizable_parameters // shape.num_layers if method == Method.QLORA else 0
    return Fsdp2Groups(root, 0, layer + added, quantized, added, 0, shape.num_layers)


def packed_bytes(quantized: int) -> int:
    """The packed 4-bit codes of ``quantized`` parameters (two per byte)."""
    return int(quantized * NF4_PACKED_BYTES_PER_PARAMETER)


def replicated_quant_states(shape: PlannedModel, method: Method) -> int:
    """QLoRA: the quant states of every 4-bit weight, which each rank keeps whole (module docstring)."""
    if method != Method.QLORA:
        return 0
    return sum(count * nf4_quant_state_bytes(elements) for elements, count in shape.quantized_tensors())


@dataclass(frozen=True, slots=True)
class Fsdp2Step:
    """FSDP2's buffers of one strategy, in bytes, that do not depend on the micro-batch; :meth:`moments`
    adds one micro-batch's activations (module docstring)."""

    root: int
    """The root group gathered (``c x R``)."""
    layer: int
    """One decoder layer gathered (``c x Λ``): its unsharded parameters, or its flat all-gather output."""
    layers: int
    reshard_after_forward: bool
    head_gradient: int
    """The LM head's unsharded gradient (full fine-tuning)."""
    layer_gradient: int
    """One layer's unsharded gradients."""
    layer_reduce_input: int
    """One layer's reduce-scatter input (``r x Λ`` trained)."""
    layer_sharded_gradient: int
    """One layer's sharded gradient on the GPU (0 under offload)."""
    root_sharded_gradient: int
    root_gradient: int
    """The root's unsharded gradients, complete when the embedding's backward is done."""
    tied_sum: int
    """Tied embeddings: the embedding's gradient and its sum with the head's, before autograd drops the
    head's (the shared unsharded parameter's ``.grad`` is accumulated out of place)."""
    root_reduce_input: int
    """The root's reduce-scatter input (``r x R`` trained)."""
    logit_tokens_per_between: float
    """Vocabulary entries per byte of ``ActivationEstimate.kept_between_layers`` (a layer input, t x h x w):
    turns it back into the t x V logits of the micro-batch."""
    forward_loss_bytes_per_logit: int
    """The forward's cross-entropy: the 16-bit logits, their fp32 upcast and log-softmax output."""
    chunked_loss: bool
    optimizer_in_backward: bool = False
    """Each group's sharded gradient is stepped on and freed in its own post-backward (module docstring)."""
    head_step_temporary: int = 0
    """With the step in backward, on the GPU: the foreach AdamW step's ``sqrt(exp_avg_sq)`` of the LM head's
    (or the embedding's) shard, while the root's reduce buffers are still held."""

    def moments(self, activations: ActivationEstimate, grads_persist: bool) -> tuple[Moment, ...]:
        """The forward's loss, the root's re-gather at the backward's first hook (resharding), the backward's
        start, the last layer's backward, the first layer's and the root's reduce-scatter at its end."""
        a = activations
        logits = round(a.kept_between_layers * self.logit_tokens_per_between)
        layers_sharded = self.layers * self.layer_sharded_gradient
        all_sharded = layers_sharded + self.root_sharded_gradient

        def done(layers: int) -> int:
            if self.optimizer_in_backward:
                return 0  # stepped on and freed in each group's post-backward
            return all_sharded if grads_persist else layers * self.layer_sharded_gradient

        # The root's post-backward: its unsharded gradients, then (stepped in backward) its reduce output.
        root_gradients = self.root_gradient
        if self.optimizer_in_backward:
            root_gradients = max(root_gradients, self.root_sharded_gradient) + self.head_step_temporary

        kept = self.layers * self.layer if not self.reshard_after_forward else 0
        # transformers' loss: logits.float() and log_softmax in forward; at the backward's first hook only the
        # saved fp32 log-softmax is left of it (its two fp32 gradients come with the loss's backward).
        loss_gradients = 2 * FP32 * logits
        if self.chunked_loss:  # not traced under FSDP2: the backward-start moment, an upper bound
            forward_loss = hook = a.loss_moment
        else:
            forward_loss = a.loss_moment - LOSS_BYTES_PER_LOGIT * logits + self.forward_loss_bytes_per_logit * logits
            hook = a.loss_moment - loss_gradients
        moments = [
            # The loss is computed inside the root's forward: the last layer's flat all-gather output is
            # still in all_gather_state (freed by the root's post-forward).
            Moment(self.root + self.layer + kept, done(0), forward_loss),
            # The backward's start: resharding, the root's pre-backward re-gathers it (flat output + copy).
            Moment(2 * self.root if self.reshard_after_forward else self.root + kept, done(0), hook),
            # Then it prefetches the last layer (its flat output) and the loss's gradients appear.
            Moment(self.root + (kept if kept else self.layer), done(0), a.loss_moment),
            # Last layer's backward: the root, the layer, the one before prefetched (or every layer still
            # gathered), the head's gradient and the layer's own.
            Moment(
                self.root + (kept if kept else 2 * self.layer),
                done(0) + self.head_gradient + self.layer_gradient,
                a.layer_moment,
            ),
            # First layer's backward: the second layer's reduce-scatter input is still held.
            Moment(
                self.root + self.layer,
                done(self.layers - 1) + self.head_gradient + self.layer_gradient + self.layer_reduce_input,
                a.first_layer_moment,
            ),
            # The embedding's backward done: the root still gathered, all its gradients (tied: added up), the
            # first layer's reduce-scatter input still held.
            Moment(
                self.root,
                done(self.layers) + self.layer_reduce_input + self.root_gradient + self.tied_sum,
                a.backward_end,
            ),
            # The root's post-backward: resharded, its gradients copied into its reduce-scatter input (the
            # first layer's is released just before).
            Moment(0, done(self.layers) + root_gradients + self.root_reduce_input, a.backward_end),
        ]
        return tuple(moments)

    def binding(self, activations: ActivationEstimate, grads_persist: bool) -> Moment:
        return max(self.moments(activations, grads_persist), key=lambda m: m.total)

    def binding_total(self, activations: ActivationEstimate, grads_persist: bool) -> int:
        return self.binding(activations, grads_persist).total


def fsdp2_step(shape: PlannedModel, setup: StaticSetup, adapters: Adapters) -> Fsdp2Step:
    """The buffers of :class:`Fsdp2Step` for ``setup`` (module docstring for the torch code)."""
    g = fsdp2_groups(shape, setup.method, adapters)
    w = fsdp2_widths(setup.precision, setup.master_weights)
    n = setup.gpus
    c, r = w.gathered, w.reduce
    sharded = 0 if setup.offload_parameters != Offload.NONE else r  # under offload it goes to the host
    return Fsdp2Step(
        root=c * g.root,
        layer=c * (g.layer - g.layer_quantized) + packed_bytes(g.layer_quantized),
        layers=g.layers,
        reshard_after_forward=setup.zero_stage == 3,
        head_gradient=c * g.head,
        layer_gradient=c * g.layer_trained,
        layer_reduce_input=r * g.layer_trained,
        layer_sharded_gradient=sharded * g.layer_trained // n,
        root_sharded_gradient=sharded * g.root_trained // n,
        root_gradient=c * g.root_trained,
        tied_sum=2 * c * g.head if shape.tie_word_embeddings else 0,
        root_reduce_input=r * g.root_trained,
        logit_tokens_per_between=shape.vocab_size / (shape.hidden_size * c),
        forward_loss_bytes_per_logit=c + FP32 + (FP32 if c != FP32 else 0),
        chunked_loss=setup.chunked_loss,
        optimizer_in_backward=setup.optimizer_in_backward,
        head_step_temporary=head_step_temporary(setup, w.sharded_trained * g.head // n) if sharded else 0,
    )


def head_step_temporary(setup: StaticSetup, head_shard: int) -> int:
    """With the step in backward, the head's AdamW step's foreach temporary (``sqrt(exp_avg_sq)`` of its
    shard); bitsandbytes' 8-bit kernel updates in place, with none."""
    return head_shard if setup.optimizer_in_backward and setup.optimizer == Optimizer.ADAMW else 0


def fsdp2_model_states(shape: PlannedModel, setup: StaticSetup, adapters: Adapters) -> ModelStates:
    """One rank's sharded parameters, gradients (all of them, as in the optimizer step; with the step in
    backward one group's) and optimizer states; with ``CPUOffloadPolicy`` all three on the host. The gathered
    working set is in :meth:`Fsdp2Step.moments`."""
    split = trainable_split(shape, setup.method, adapters)
    w = fsdp2_widths(setup.precision, setup.master_weights)
    n = setup.gpus
    frozen = split.frozen_unquantized * w.sharded_frozen + packed_bytes(split.frozen_quantized)
    weights = (frozen + split.trainable * w.sharded_trained) / n
    quant_states = replicated_quant_states(shape, setup.method)
    grads = split.trainable * w.reduce / n
    if setup.optimizer_in_backward:  # what stays: one group's sharded gradient while its parameters step
        g = fsdp2_groups(shape, setup.method, adapters)
        grads = max(g.root_trained, g.layer_trained) * w.reduce / n
    paged = 0.0
    if setup.optimizer in ELEMENTWISE_STATES:  # zeros_like(sharded param): the shard's dtype
        optimizer = split.trainable * ELEMENTWISE_STATES[setup.optimizer] * w.sharded_trained / n
    else:  # bitsandbytes' 8-bit AdamW on each local shard (paged: its 8-bit states in CUDA managed memory)
        states = optimizer_state_bytes(shape, setup.method, adapters, setup.optimizer, w.sharded_trained, None, n)
        optimizer, paged = states.device, states.paged
    if setup.offload_parameters != Offload.NONE:
        return ModelStates(quant_states, 0, 0, 0, cpu_per_rank=int(weights + grads + optimizer), nvme_per_rank=0)
    return ModelStates(
        parameters=int(weights) + quant_states,
        gradients=int(grads),
        step_gradients=0,
        optimizer_states=int(optimizer),
        cpu_per_rank=int(paged),
        nvme_per_rank=0,
    )


class Fsdp2Memory:
    """:class:`memfit.memory.engine.EngineMemory` of PyTorch FSDP2."""

    def model_states(self, shape: PlannedModel, setup: StaticSetup, adapters: Adapters) -> ModelStates:
        return fsdp2_model_states(shape, setup, adapters)

    def communication_buffers(self, shape: PlannedModel, setup: StaticSetup, trainable: int) -> int:
        """No buckets: the all-gather and reduce-scatter buffers are counted where they are alive
        (:class:`Fsdp2Step`)."""
        return 0

    def loaded_on_host(self, shape: PlannedModel, setup: StaticSetup) -> int:
        """Every rank loads the 16-bit model into host memory first; QLoRA's rank builds its 4-bit model there
        (packed weights, quant states, the rest in bf16) and ``fully_shard`` moves it to the GPU layer by
        layer."""
        if setup.method == Method.QLORA:
            quantized = shape.quantizable_parameters
            return int(quantized * NF4_BYTES_PER_PARAMETER) + BF16 * (shape.parameter_count - quantized)
        return BF16 * shape.parameter_count

    def gradients_persist(self, setup: StaticSetup) -> bool:
        """FSDP2 sets its sharded gradients to None after each step."""
        return False

    def forward_backward(
        self, shape: PlannedModel, setup: StaticSetup, adapters: Adapters, states: ModelStates
    ) -> Fsdp2Step:
        return fsdp2_step(shape, setup, adapters)
