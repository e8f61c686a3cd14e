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

Under Ulysses sequence parallelism (``sequence_parallel`` = n ranks, ``calibration/sp_trace.py`` traces rank 0
of the trainer's step) a rank holds t = b x ceil(s / n) tokens: every per-token term is of those, while the
attention kernel and its mask see the whole sequence for 1/n of the heads (:func:`kv_replication`,
:func:`ulysses_output_copy`, :func:`gathered_positions`). A tiled MLP (``tiled_mlp``) keeps only its input and
back-propagates one tile at a time (:func:`mlp_tile`); the norms' fp32 backward can then be a layer's worst
point (:func:`_norm_backward`, :func:`final_norm_backward`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memfit.api.vocabulary import Attention, Method, Precision
from memfit.memory.sizes import FP32
from memfit.model_shape import ModelFamily, ModelShape, Role
from memfit.planned_model import PlannedModel

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
    sequence_parallel: int = 1
    """Ranks each sequence is split over (Ulysses): each holds ``tokens`` = b x ceil(s / n) of it, while
    attention and its mask see all ``sequence_length`` positions."""
    tiled_mlp: bool = False
    """Each MLP runs tile by tile along the sequence, recomputed in backward (the trainer's tiled_mlp)."""

    @property
    def row_tokens(self) -> int:
        """Tokens of one row a rank holds: the whole sequence, or its ``ceil(s / n)`` positions under sequence
        parallelism."""
        return -(-self.sequence_length // self.sequence_parallel)

    @property
    def tokens(self) -> int:
        """Tokens one rank holds: its :attr:`row_tokens` of each row of the micro-batch."""
        return self.micro_batch_size * self.row_tokens

    @property
    def attended_length(self) -> int:
        """Positions attention sees: the whole sequence, padded to a multiple of the ranks it is split over."""
        return self.sequence_parallel * self.row_tokens

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
    """Worst point of the final norm's or the last layer's backward (the loss buffers are gone; the LM head's
    weight gradient, counted with the gradients, is already there)."""
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
    mask = setup.micro_batch_size * setup.attended_length**2
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
    tiles = -(-setup.attended_length // FLEX_BLOCK)
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
    reads it, every flex attention call saves its ``BlockMask`` for its backward, and under sequence
    parallelism the trainer's SDPA kernel keeps the mask it built for the next forward."""
    sequence_parallel_sdpa = setup.sequence_parallel > 1 and setup.attention == Attention.SDPA
    return setup.gradient_checkpointing or setup.attention == Attention.FLEX or sequence_parallel_sdpa


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


def kv_replication(shape: ModelShape, setup: ActivationSetup) -> int:
    """How many copies of each key and value head reach the kernel under sequence parallelism: Ulysses
    repeats them when there are more ranks than key/value heads, so that every rank gets one
    (``UlyssesSPAttentionHF``'s ``kv_replication_factor``)."""
    return max(1, setup.sequence_parallel // shape.num_key_value_heads)


def copies_repeated_heads(shape: ModelShape, setup: ActivationSetup) -> bool:
    """Whether repeating keys and values to every query head (``repeat_kv``) makes a copy. Under sequence
    parallelism a rank whose kernel gets a single key/value head repeats it as a view (an expanded size-1
    dimension), which autograd saves at the size of the one head."""
    heads_per_rank = kv_replication(shape, setup) * shape.num_key_value_heads // setup.sequence_parallel
    return setup.sequence_parallel == 1 or heads_per_rank > 1


def ulysses_output_copy(shape: ModelShape, setup: ActivationSetup) -> int:
    """What sequence parallelism adds to a layer's saved tensors: the kernel keeps its output in the gathered
    layout (b, H / n, s, d), and a trained ``o_proj`` keeps its own input, the reverse all-to-all's contiguous
    output in the local layout, where without sequence parallelism the two are one tensor. A frozen ``o_proj``
    keeps nothing (its adapter's input, when it keeps one, is counted with the adapters)."""
    if setup.sequence_parallel == 1 or setup.method != Method.FULL:
        return 0
    return setup.tokens * shape.q_size * setup.element_bytes


def _attention(shape: ModelShape, setup: ActivationSetup) -> int:
    """q, k, v after RoPE and what the attention kernel keeps. Under sequence parallelism the kernel gets the
    whole sequence for 1/n of the heads, which is as many bytes as the local tokens' q for all heads (keys and
    values, repeated where there are fewer heads than ranks); the local q, k and v before the all-to-all are
    not kept."""
    b, s, t, w = setup.micro_batch_size, setup.attended_length, setup.tokens, setup.element_bytes
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
    repeated = (masked and kv != q and copies_repeated_heads(shape, setup)) or (
        flex and flex_repeats_keys_and_values(shape)
    )
    if shape.family is ModelFamily.PHI3:
        # v is a view of the fused qkv output, which stays alive whole; RoPE's cat lays q out so
        # that the kernel's output (allocated like q) must be copied for o_proj. Repeating k replaces
        # it; repeating v adds a copy.
        k_and_v = 2 * q if repeated else kv
        return t * w * ((q + 2 * kv) + q + k_and_v + 2 * q) + lse + mask + ulysses_output_copy(shape, setup)
    # Fused kernels (SDPA's flash/efficient backends, flash-attn) keep q, k, v, the output (laid out
    # so that o_proj reads it without a copy) and one fp32 log-sum-exp per row and head.
    k_and_v = 2 * (q if repeated else kv * kv_replication(shape, setup))
    return t * (2 * q + k_and_v) * w + lse + mask + ulysses_output_copy(shape, setup)


def tiles_mlp(shape: ModelShape, setup: ActivationSetup) -> bool:
    """Whether the MLP runs tile by tile (the trainer tiles dense gated MLPs, not mixtures of experts)."""
    return setup.tiled_mlp and not shape.is_moe


def mlp_tile_tokens(tokens: int, width: int) -> int:
    """Tokens per tile of the tiled MLP (the trainer's ``tiled_mlp`` cuts the same): ``ceil(tokens / width)``
    tiles (about one hidden size of tokens each, ALST's choice) as equal as they can be."""
    return -(-tokens // -(-tokens // width))


def mlp_tile(shape: ModelShape, setup: ActivationSetup) -> ActivationSetup:
    """One tile of the tiled MLP, as an untiled setup of its tokens (a rank's flattened tokens are cut)."""
    tokens = mlp_tile_tokens(setup.tokens, shape.hidden_size)
    return replace(setup, micro_batch_size=1, sequence_length=tokens, sequence_parallel=1, tiled_mlp=False)


def tiled_mlp_gradients(shape: PlannedModel, method: Method, tiled_mlp: bool, element_bytes: int) -> int:
    """The MLP weights' gradients (full fine-tuning) that a tiled MLP makes whole at its first tile: at the
    worst point of its later tiles the layer's MLP gradients all exist, where an untiled MLP's backward has
    not made them yet."""
    if not tiled_mlp or method != Method.FULL:
        return 0
    return shape.tiled_mlp_parameters * element_bytes


def _mlp(shape: ModelShape, setup: ActivationSetup) -> int:
    """Gated MLP: gate (for the activation), act(gate) and up (for their product), and the product
    (for down_proj's weight gradient, so only when it is trained). MoE: the routed experts' tokens.
    Tiled, it runs without grad and keeps only its input, which in full fine-tuning is the norm's output
    already kept for its linears (:func:`_rms_norm`)."""
    if tiles_mlp(shape, setup):
        return 0 if setup.method == Method.FULL else setup.tokens * shape.hidden_size * setup.element_bytes
    width = shape.intermediate_size * (shape.experts_per_token if shape.is_moe else 1)
    kept = 4 if setup.method == Method.FULL else 3
    return kept * setup.tokens * width * setup.element_bytes


_SHARED_INPUTS = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "qkv_proj": "attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "gate_up_proj": "mlp"}  # fmt: skip
"""Adapters whose base modules read the same tensor (they share it when no copy is made)."""


def _lora(shape: ModelShape, setup: ActivationSetup, roles: frozenset[Role] = frozenset(Role)) -> int:
    """Adapters of the modules of ``roles`` keep their input (their own copy when dropout or a dtype cast makes
    one, with the dropout's bool mask) and the rank-r output of lora_A, both in the adapters' dtype. An adapter on a
    parameter that is no ``nn.Linear`` (fused experts, the MoE router) sees no tokens: peft's ``ParamWrapper``
    folds it into a new copy of the whole weight (``W + B @ A``) each forward, which the layer's matmuls keep
    for backward."""
    if setup.method == Method.FULL:
        return 0
    t, w, adapter = setup.tokens, setup.element_bytes, setup.adapter_bytes
    copies = setup.lora_dropout or adapter != w
    saved, shared_seen = 0, set()
    for module in shape.layer_linears:
        if module.role not in roles or not setup.lora_targets.intersection(module.target_names):
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
    attention = _attention(shape, setup) + _lora(shape, setup, frozenset({Role.ATTENTION}))
    return _norms(shape, setup) + attention + _feed_forward(shape, setup)


def _feed_forward(shape: ModelShape, setup: ActivationSetup) -> int:
    """What the MLP and its adapters keep for backward (a tiled MLP's adapters run inside its tiles, without
    grad: they keep nothing)."""
    adapters = frozenset() if tiles_mlp(shape, setup) else _FEED_FORWARD_ROLES
    return _mlp(shape, setup) + _lora(shape, setup, adapters)


_FEED_FORWARD_ROLES = frozenset(Role) - {Role.ATTENTION}


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


def _mlp_activation_gradients(shape: ModelShape, setup: ActivationSetup) -> int:
    """The gradients of the MLP's two intermediate-sized activations (a LoRA on down_proj adds its input
    gradient, cast back from the adapters' dtype)."""
    t, w, i = setup.tokens, setup.element_bytes, shape.intermediate_size
    gradients = 2 * t * i * w
    if setup.method != Method.FULL and "down_proj" in setup.lora_targets:
        gradients += t * i * (setup.adapter_bytes + w)
    return gradients


def _mlp_backward(shape: ModelShape, setup: ActivationSetup) -> int:
    """What the MLP's backward adds to the layer's saved tensors at its worst point: the activations'
    gradients and two hidden-sized gradients (the layer output's and the MLP input's). Tiled, one tile at a
    time: its recomputation's saved tensors and their gradients, beside the input's whole gradient that the
    tiles write into (the trainer's ``TiledMlp``)."""
    hidden_gradients = 2 * setup.tokens * shape.hidden_size * setup.element_bytes
    if not tiles_mlp(shape, setup):
        return _mlp_activation_gradients(shape, setup) + hidden_gradients
    tile = mlp_tile(shape, setup)
    recomputed = _mlp(shape, tile) + _lora(shape, tile, frozenset({Role.MLP}))
    return recomputed + _mlp_activation_gradients(shape, tile) + hidden_gradients


def _norm_backward(shape: ModelShape, setup: ActivationSetup) -> int:
    """What the backward of the norm before the MLP adds to the layer's saved tensors at its worst point,
    after the MLP's backward and before the attention's. RMSNorm forms its input's gradient in fp32: five
    hidden-sized fp32 temporaries (the product's gradient, the mean's expanded gradient, and the three of
    ``pow``'s backward: ``x.pow(1)``, times 2, times the gradient), beside the layer output's gradient. By then
    the MLP's saved tensors are freed, and so are the norm's own but its fp32 input and rsqrt (its output and
    normalised value are read first). Untiled, the MLP's backward is larger; tiled, this can bind."""
    t, h = setup.tokens, shape.hidden_size
    read_first = _rms_norm(shape, setup, setup.method == Method.FULL) - t * (h * FP32 + FP32)
    return t * h * (5 * FP32 + setup.element_bytes) - read_first - _feed_forward(shape, setup)


def final_norm_backward(shape: ModelShape, setup: ActivationSetup) -> int:
    """The final norm's backward, after the loss's, beside every layer's saved tensors: its fp32 input and
    rsqrt and the five fp32 temporaries of an RMSNorm backward (:func:`_norm_backward`). It binds where the
    layers' own backward is smaller: a tiled MLP's or, without checkpointing, a long sequence's with the
    chunked loss (traced unsplit at 4096 tokens: -1.3% before it was counted, -0.3% after)."""
    t, h = setup.tokens, shape.hidden_size
    return t * (h * FP32 + FP32) + 5 * t * h * FP32


def gathered_positions(setup: ActivationSetup) -> int:
    """Under sequence parallelism Ulysses all-gathers ``position_ids`` for every attention call (int64, the
    gathered pieces and their concatenation); the last call's are still alive when the forward returns."""
    return 2 * setup.micro_batch_size * setup.attended_length * INT64 if setup.sequence_parallel > 1 else 0


def layer_backward_moment(shape: ModelShape, setup: ActivationSetup, per_layer: int, recomputed_input: int = 0) -> int:
    """Bytes one layer holds at the worst point of its backward: its saved tensors plus the MLP's backward
    (:func:`_mlp_backward`) or the norm's before it (:func:`_norm_backward`), or, with eager attention, the
    scores' gradients.
    ``recomputed_input``: the layer's input where nothing but its recomputation holds it (activation
    offloading), alive at the first of these moments and gone by the attention's backward."""
    before_attention = max(_mlp_backward(shape, setup), _norm_backward(shape, setup))
    moment = per_layer + before_attention + recomputed_input
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
    mask += gathered_positions(setup)
    loss_moment = kept + mask + head_and_loss(shape, setup)
    one_layer = layer_backward_moment(shape, setup, per_layer, own_input) + mask
    layer_moment = max(others + one_layer, kept + mask + final_norm_backward(shape, setup))
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
