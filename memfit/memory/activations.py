"""Peak activation memory of one micro-batch's forward and backward, from the model's shape.

Derived op by op from what autograd saves in the ``transformers`` decoder layer of each family (the
tensors a backward pass needs), and checked against PyTorch MemTracker traces of real training steps
(``bench/memtrace_grid.py`` writes them, ``bench/estimate_vs_trace.py`` prints the error table,
``tests/test_activations_vs_traces.py`` keeps it small). Every term is a tensor size; nothing is a fitted
factor, which is what lets the model carry over to shapes that were never traced.

Notation: t = micro_batch x sequence tokens, h hidden, i intermediate, q = heads x head_dim,
kv = kv_heads x head_dim, V vocabulary, w bytes per element of the compute dtype.

The peak is the larger of two moments. At the start of the backward pass every layer's saved tensors,
the final norm's and the loss's buffers are alive together (the fp32 log-softmax output plus two fp32
logits-sized gradients: 12 bytes per token and vocabulary entry, whatever the compute dtype). Inside the
last layer's backward the loss buffers are gone but the layer's gradient temporaries are there (with
eager attention at long sequences, the scores' gradients win). With gradient checkpointing each layer
keeps only its input, and the second moment also holds the recomputed layer. With the chunked loss
(``chunked_loss``) the loss buffers are what the trainer's chunked cross-entropy holds: per-token
log-sum-exp and labels, the hidden states' and head's gradients and one chunk's logits
(:func:`chunked_loss_buffers`).

With activation offloading (``activation_offloading``, on top of checkpointing) the layers' inputs wait in
pinned host memory (the trainer's ``memfit_trainer.activation_offload``); the GPU holds only the inputs its
code path has there at each moment (:func:`offloaded_inputs`: LoRA's first input, which autograd keeps; the
recomputed layer's own; the one prefetched for the next layer), and ``host_bytes`` is what the host holds
when the forward pass ends, in the pinned allocator's blocks (:func:`pinned_host_bytes`).

Packed documents (or padded rows) make ``transformers`` build a ``(b, 1, s, s)`` attention mask for SDPA and
eager attention, never for flash attention (:func:`attention_mask_bytes`, :func:`sdpa_mask`); flex attention
gets a ``BlockMask`` of 128x128 tiles instead (:func:`flex_block_mask_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.api.vocabulary import Attention, Method, Precision
from memfit.memory.sizes import FP32
from memfit.model_shape import ModelFamily, ModelShape, Role

BOOL = 1
INT32 = 4
INT64 = 8
FLEX_BLOCK = 128
"""torch's ``flex_attention`` tile (``_DEFAULT_SPARSE_BLOCK_SIZE``): the ``BlockMask`` has one entry per
128x128 tile of the score matrix."""
LOSS_BYTES_PER_LOGIT = 3 * FP32
"""Log-softmax output (fp32) saved by cross-entropy, and the two fp32 gradients its backward makes."""
LOSS_CHUNK_BYTES = 2**27
"""Chunked loss (``chunked_loss``): the fp32 logits of one chunk of tokens stay under this (128 MiB)."""


def loss_chunk_tokens(tokens: int, vocab_size: int) -> int:
    """Tokens per chunk of the chunked loss (the trainer's ``chunked_cross_entropy`` uses the same)."""
    return max(1, min(tokens, LOSS_CHUNK_BYTES // (vocab_size * FP32)))


@dataclass(frozen=True)
class ActivationSetup:
    """What decides activation memory (a plan's knobs minus the ones that only move model states)."""

    method: Method
    precision: Precision
    gradient_checkpointing: bool
    micro_batch_size: int
    sequence_length: int
    attention: Attention
    lora_rank: int = 0
    lora_targets: frozenset[str] = frozenset()
    lora_dropout: bool = True
    adapter_bytes: int = 2
    """LoRA adapters' dtype: the trainer casts them to the compute dtype (memfit_trainer.model); plain
    peft keeps them in fp32 (autocast_adapter_dtype)."""
    chunked_loss: bool = False
    """The LM head and the loss run chunk by chunk (the trainer's ``chunked_cross_entropy``)."""
    activation_offloading: bool = False
    """Checkpointed layers' saved inputs wait in pinned host memory (the trainer's activation_offload)."""
    masked_batches: bool = True
    """Batches reach SDPA with a ``(b, 1, s, s)`` attention mask: packed documents (restarting positions)
    or padded rows (``packing: false``; a plan assumes a batch with padding, the worst case). False only
    for rows of one unpadded sequence each, which SDPA runs with ``is_causal`` and no mask."""

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.sequence_length

    @property
    def element_bytes(self) -> int:
        return FP32 if self.precision == Precision.FP32 else 2


@dataclass(frozen=True)
class ActivationEstimate:
    saved_per_layer: int
    """Bytes one decoder layer keeps for its backward pass."""
    kept_between_layers: int
    """Bytes kept per layer under gradient checkpointing (its input)."""
    loss_moment: int
    """Start of the backward pass: every layer's saved tensors, the final norm and the loss buffers."""
    layer_moment: int
    """Worst point of the last layer's backward (the loss buffers are gone; the LM head's weight
    gradient, counted with the gradients, is already there)."""
    first_layer_moment: int
    """Worst point of the first layer's backward, the last one to run (nearly all gradients exist)."""
    backward_end: int
    """End of the backward pass: the embedding output's gradient."""
    peak: int
    """Peak bytes of the forward + backward beyond weights, gradients and optimizer states."""
    host_bytes: int = 0
    """Pinned host bytes one rank holds for offloaded activations (``activation_offloading``), at the end
    of the forward pass: every offloaded layer input, in the pinned allocator's power-of-two blocks."""


def uses_eager_attention(shape: ModelShape, setup: ActivationSetup) -> bool:
    """Gemma 2 soft-caps attention scores, which SDPA cannot do: transformers runs it eagerly (flash and flex
    attention soft-cap inside the kernel)."""
    return setup.attention == Attention.EAGER or (
        shape.family is ModelFamily.GEMMA2 and setup.attention == Attention.SDPA
    )


def sdpa_mask(shape: ModelShape, setup: ActivationSetup) -> bool:
    """SDPA gets an explicit mask (``transformers``' ``create_causal_mask``): it then converts it to the
    compute dtype in every layer and, without native GQA, repeats keys and values to every query head."""
    return setup.attention == Attention.SDPA and setup.masked_batches and not uses_eager_attention(shape, setup)


def attention_mask_bytes(shape: ModelShape, setup: ActivationSetup) -> int:
    """The ``(b, 1, s, s)`` mask ``transformers`` builds once per forward: bool for SDPA, the compute dtype
    for eager attention (which builds it for every batch); none for flash attention (variable-length
    boundaries instead); flex attention's block mask (:func:`flex_block_mask_bytes`). The decoder's forward
    holds it, and under checkpointing so does every layer's recomputation, until the backward pass ends;
    without checkpointing it is gone before the loss, but for flex's (:func:`mask_outlives_forward`)."""
    mask = setup.micro_batch_size * setup.sequence_length**2
    if uses_eager_attention(shape, setup):
        return mask * setup.element_bytes
    if setup.attention == Attention.FLEX:
        return flex_block_mask_bytes(setup)
    return mask * BOOL if sdpa_mask(shape, setup) else 0


def flex_block_mask_bytes(setup: ActivationSetup) -> int:
    """What flex attention's mask holds (``transformers``' ``flex_attention_mask``, one per forward, shared by
    every layer): torch's ``BlockMask`` of ``n = ceil(s / 128)`` tiles a side, one head (``H=None``) per row,
    four int32 block counts of ``n`` (``kv_num_blocks``, ``full_kv_num_blocks``, ``q_num_blocks``,
    ``full_q_num_blocks``) and four int32 index tables of ``n x n`` (``kv_indices``, ``full_kv_indices``,
    ``q_indices``, ``full_q_indices``); with packed documents also the int64 document index per token that
    its ``mask_mod`` reads (``find_packed_sequence_indices``)."""
    tiles = -(-setup.sequence_length // FLEX_BLOCK)
    block_mask = setup.micro_batch_size * 4 * (tiles + tiles**2) * INT32
    documents = setup.tokens * INT64 if setup.masked_batches else 0
    return block_mask + documents


def flex_repeats_keys_and_values(shape: ModelShape) -> bool:
    """``transformers``' flex path uses the kernel's native GQA only for a power-of-two number of query heads;
    otherwise it repeats keys and values to every head (``repeat_kv``) before the call."""
    heads = shape.num_attention_heads
    return shape.kv_size != shape.q_size and heads & (heads - 1) != 0


def mask_outlives_forward(setup: ActivationSetup) -> bool:
    """Whether the attention mask is alive through the backward pass: the checkpointed layers' recomputation
    reads it, and every flex attention call saves its ``BlockMask`` for its backward."""
    return setup.gradient_checkpointing or setup.attention == Attention.FLEX


def _rms_norm(shape: ModelShape, setup: ActivationSetup, output_kept: bool) -> int:
    """RMSNorm keeps its input upcast to fp32 (and an fp32 rsqrt per token); when its weight is trained
    also the normalised value (fp32 in Gemma's norm, which computes in fp32 throughout). Its output is
    kept by the linear layers it feeds only when their weights are trained."""
    t, h, w = setup.tokens, shape.hidden_size, setup.element_bytes
    kept = t * (h * FP32 + FP32)
    if setup.method == Method.FULL:
        kept += t * h * (FP32 if shape.family is ModelFamily.GEMMA2 else w)
    if output_kept:
        kept += t * h * w
    return kept


def _norms(shape: ModelShape, setup: ActivationSetup) -> int:
    full = setup.method == Method.FULL
    if shape.family is ModelFamily.GEMMA2:  # pre-norms feed linears, post-norms feed the residual add
        return 2 * _rms_norm(shape, setup, full) + 2 * _rms_norm(shape, setup, False)
    return shape.norms_per_layer * _rms_norm(shape, setup, full)


def _attention(shape: ModelShape, setup: ActivationSetup) -> int:
    """q, k, v after RoPE and what the attention kernel keeps."""
    b, s, t, w = setup.micro_batch_size, setup.sequence_length, setup.tokens, setup.element_bytes
    q, kv, heads = shape.q_size, shape.kv_size, shape.num_attention_heads
    if uses_eager_attention(shape, setup):
        # Keys and values are repeated to every query head (repeat_kv); the softmax keeps its fp32
        # output and the value matmul its 16-bit cast; the output is copied for o_proj.
        scores = b * heads * s * s * (FP32 + w)
        if shape.family is ModelFamily.GEMMA2:
            scores += b * heads * s * s * w  # tanh of the soft-capped scores
        fused = t * (q + 2 * kv) * w if shape.family is ModelFamily.PHI3 else 0  # v is a view of it
        return fused + t * 3 * q * w + scores + t * q * w
    flex = setup.attention == Attention.FLEX
    # Flex's autograd op saves each row's and head's fp32 maximum score beside its log-sum-exp (traced). Its
    # backward never reads it, so a compiled graph may drop it: at most 4 bytes per token and head over.
    lse = t * heads * FP32 * (2 if flex else 1)
    masked = sdpa_mask(shape, setup)
    # With a mask, SDPA keeps its compute-dtype copy and keys and values repeated to every query head.
    mask = b * s * s * w if masked else 0
    repeated = (masked and kv != q) or (flex and flex_repeats_keys_and_values(shape))
    if shape.family is ModelFamily.PHI3:
        # v is a view of the fused qkv output, which stays alive whole; RoPE's cat lays q out so
        # that the kernel's output (allocated like q) must be copied for o_proj. Repeating k replaces
        # it; repeating v adds a copy.
        k_and_v = 2 * q if repeated else kv
        return t * w * ((q + 2 * kv) + q + k_and_v + 2 * q) + lse + mask
    # Fused kernels (SDPA's flash/efficient backends, flash-attn) keep q, k, v, the output (laid out
    # so that o_proj reads it without a copy) and one fp32 log-sum-exp per row and head.
    k_and_v = 2 * (q if repeated else kv)
    return t * (2 * q + k_and_v) * w + lse + mask


def _mlp(shape: ModelShape, setup: ActivationSetup) -> int:
    """Gated MLP: gate (for the activation), act(gate) and up (for their product), and the product
    (for down_proj's weight gradient, so only when it is trained). MoE: the routed experts' tokens."""
    width = shape.intermediate_size * (shape.experts_per_token if shape.is_moe else 1)
    kept = 4 if setup.method == Method.FULL else 3
    return kept * setup.tokens * width * setup.element_bytes


_SHARED_INPUTS = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "qkv_proj": "attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "gate_up_proj": "mlp"}  # fmt: skip
"""Adapters whose base modules read the same tensor (they share it when no copy is made)."""


def _lora(shape: ModelShape, setup: ActivationSetup) -> int:
    """Adapters keep their input (their own copy when dropout or a dtype cast makes one, with the
    dropout's bool mask) and the rank-r output of lora_A, both in the adapters' dtype. An adapter on a
    parameter that is no ``nn.Linear`` (fused experts, the MoE router) sees no tokens: peft's ``ParamWrapper``
    folds it into a new copy of the whole weight (``W + B @ A``) each forward, which the layer's matmuls keep
    for backward."""
    if setup.method == Method.FULL:
        return 0
    t, w, adapter = setup.tokens, setup.element_bytes, setup.adapter_bytes
    copies = setup.lora_dropout or adapter != w
    saved, shared_seen = 0, set()
    for module in shape.layer_linears:
        if not setup.lora_targets.intersection(module.target_names):
            continue
        if not module.is_linear:
            saved += module.weight_parameters * w
            continue
        saved += module.count * t * setup.lora_rank * adapter
        if copies:
            saved += module.count * t * module.in_features * (adapter + (BOOL if setup.lora_dropout else 0))
        elif _SHARED_INPUTS.get(module.name) not in shared_seen:
            saved += module.count * t * module.in_features * w
            shared_seen.add(_SHARED_INPUTS.get(module.name, module.name))
    return saved


def saved_per_layer(shape: ModelShape, setup: ActivationSetup) -> int:
    """Bytes one decoder layer saves for backward (no checkpointing)."""
    return _norms(shape, setup) + _attention(shape, setup) + _mlp(shape, setup) + _lora(shape, setup)


def head_and_loss(shape: ModelShape, setup: ActivationSetup) -> int:
    """The final norm, the LM head's input (when the head is trained) and the loss at the start of the
    backward pass. Gemma 2 also soft-caps the logits (a tanh whose 16-bit output is kept)."""
    if setup.chunked_loss:
        return _rms_norm(shape, setup, True) + chunked_loss_buffers(shape, setup)
    loss = setup.tokens * shape.vocab_size * LOSS_BYTES_PER_LOGIT
    if shape.family is ModelFamily.GEMMA2:
        loss += setup.tokens * shape.vocab_size * setup.element_bytes
    return _rms_norm(shape, setup, setup.method == Method.FULL) + loss


def chunked_loss_buffers(shape: ModelShape, setup: ActivationSetup) -> int:
    """What the chunked loss holds at the worst point of its backward (the final norm's output, which it
    keeps whatever the method, is counted with the norm): one fp32 log-sum-exp and the shifted label per
    token, the hidden states' gradient, the LM head's weight gradient it accumulates (when the head is
    trained), and one chunk's fp32 logits with their 16-bit cast (Gemma 2: the fp32 tanh of the soft-cap
    instead of the cast). The full logits never exist."""
    t, h, v, w = setup.tokens, shape.hidden_size, shape.vocab_size, setup.element_bytes
    chunk = loss_chunk_tokens(t, v)
    per_logit = 2 * FP32 if shape.family is ModelFamily.GEMMA2 else FP32 + (0 if w == FP32 else w)
    head_gradient = v * h * w if setup.method == Method.FULL else 0
    return t * (FP32 + INT64) + t * h * w + head_gradient + chunk * v * per_logit


def _eager_attention_backward(shape: ModelShape, setup: ActivationSetup, per_layer: int) -> int:
    """Inside the attention backward: the MLP's saved tensors are freed, the scores' gradients (fp32 and
    16-bit, like the scores) are alive, and in full fine-tuning so are the MLP weights' gradients."""
    t, w = setup.tokens, setup.element_bytes
    scores_gradient = setup.micro_batch_size * shape.num_attention_heads * setup.sequence_length**2 * (FP32 + w)
    mlp = shape.linears_of(Role.MLP, Role.EXPERTS)
    mlp_weights = sum(m.weight_parameters for m in mlp) * w if setup.method == Method.FULL else 0
    return per_layer - _mlp(shape, setup) + scores_gradient + 2 * t * shape.hidden_size * w + mlp_weights


def layer_backward_moment(shape: ModelShape, setup: ActivationSetup, per_layer: int, recomputed_input: int = 0) -> int:
    """Bytes one layer holds at the worst point of its backward: its saved tensors plus the gradients
    of the MLP's activations and of the layer output (a LoRA on down_proj adds its input gradient,
    cast back from the adapters' dtype), or, with eager attention, the scores' gradients.
    ``recomputed_input``: the layer's input where nothing but its recomputation holds it (activation
    offloading), alive at the first of these moments and gone by the attention's backward."""
    t, w, i = setup.tokens, setup.element_bytes, shape.intermediate_size
    mlp = t * (2 * i * w + 2 * shape.hidden_size * w)
    if setup.method != Method.FULL and "down_proj" in setup.lora_targets:
        mlp += t * i * (setup.adapter_bytes + w)
    moment = per_layer + mlp + recomputed_input
    if uses_eager_attention(shape, setup):
        moment = max(moment, _eager_attention_backward(shape, setup, per_layer))
    return moment


def pinned_host_bytes(nbytes: int) -> int:
    """Host bytes PyTorch's pinned-memory allocator (``CachingHostAllocator``) takes for a tensor of
    ``nbytes``: it rounds every block up to a power of two, and keeps freed blocks for reuse."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def offloaded_layers(setup: ActivationSetup, layers: int) -> int:
    """Layer inputs that go to the host under activation offloading: all but LoRA's first (see below)."""
    return layers - (0 if setup.method == Method.FULL else 1)


def offloaded_inputs(setup: ActivationSetup, layers: int, between: int) -> tuple[int, int, int]:
    """Layer inputs on the GPU under activation offloading: (at the loss, beside the last layer's backward,
    the recomputed layer's own). They wait on the host, with three exceptions.

    * LoRA's frozen embedding: its output is made a leaf that requires grad, which autograd keeps on the
      GPU; the first layer's input stays.
    * The input of the layer being back-propagated is back for its recomputation. With LoRA the end of
      the recomputation, with the input still there, is the worst moment of the layer's MLP (traced with
      adapters on every linear layer and on the attention's alone); in full fine-tuning that moment comes
      later, in the MLP's backward (its activation gradients outweigh the input, the residual and the
      output gradient the recomputation holds), and the input is freed by then.
    * The input of the layer before is already coming back (prefetched), unless it is the first one
      offloaded, which comes back only when asked for (``memfit_trainer.activation_offload``).
    """
    if setup.method == Method.FULL:
        return 0, between if layers >= 3 else 0, 0
    own = between if layers >= 2 else 0
    prefetched = between if layers >= 4 else 0
    return between, between + prefetched, own


def estimate_activations(shape: ModelShape, setup: ActivationSetup) -> ActivationEstimate:
    per_layer = saved_per_layer(shape, setup)
    between = setup.tokens * shape.hidden_size * setup.element_bytes
    layers = shape.num_layers
    offloaded = setup.gradient_checkpointing and setup.activation_offloading
    own_input = 0
    if offloaded:
        kept, others, own_input = offloaded_inputs(setup, layers, between)
        # Full fine-tuning: the first layer's backward, with nearly every gradient, holds no other input.
        # LoRA, whose gradients are counted whole: the middle layers' backward, as full as the last's.
        first_layer_input = 0 if setup.method == Method.FULL else others
    elif setup.gradient_checkpointing:
        # Every layer keeps its input, and the one being back-propagated is recomputed.
        kept, others, first_layer_input = layers * between, layers * between, between
    else:
        kept, others, first_layer_input = layers * per_layer, (layers - 1) * per_layer, 0
    mask = attention_mask_bytes(shape, setup) if mask_outlives_forward(setup) else 0
    loss_moment = kept + mask + head_and_loss(shape, setup)
    one_layer = layer_backward_moment(shape, setup, per_layer, own_input) + mask
    layer_moment = others + one_layer
    return ActivationEstimate(
        saved_per_layer=per_layer,
        kept_between_layers=between,
        loss_moment=loss_moment,
        layer_moment=layer_moment,
        first_layer_moment=one_layer + first_layer_input,
        backward_end=between,
        peak=max(loss_moment, layer_moment),
        host_bytes=offloaded_layers(setup, layers) * pinned_host_bytes(between) if offloaded else 0,
    )
