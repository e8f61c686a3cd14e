"""Trace a model's activation terms per decoder-layer type: the activation half of a profile (``memfit.profile``).

No per-family formula exists for layers like Gated-DeltaNet, sliding windows with sinks, or fused experts, so
the model's own code is run instead: a truncated copy of its text config (one decoder layer of each distinct
type, at the real widths) trains one micro-batch of one row (bf16, forward and backward, no gradient
checkpointing) on fake tensors while torch's MemTracker counts bytes (``memfit_trainer.fake_trace``). The row
is packed as the trainer packs it (``memfit_trainer.data.model_inputs``): two documents, ``position_ids``
restarting at the second and no ``attention_mask``, from which ``transformers`` builds its block-diagonal
attention mask for sdpa and eager (``masking_utils.find_packed_sequence_indices``; on fake tensors it cannot
read the positions and always builds it, as a real packed row makes it), so the mask and whatever the layers
derive from it are traced with the rest (SDPA keeps a bf16 copy of it in every layer, and without native GQA
keys and values repeated to every head; the bool mask itself is gone when the forward ends). Four setups are
traced (:class:`Setup`), each without and with gradient checkpointing: full fine-tuning, and LoRA as the
trainer builds it
(``memfit_trainer.model.with_adapters``: the base frozen, adapters in bf16) with memfit's default adapters
(``all-linear``, rank 16, dropout 0.05; no dropout where peft adapts fused experts or a router in place, which
refuse it), the embedding's output made to require grad so that each traced layer keeps what a layer deeper in
the stack keeps (a frozen model's first layer keeps less: it is counted high); each is traced again with the
trainer's chunked loss for the terms outside the layers. All four are traced again on a row of one unpadded
document (no mask: SDPA's ``is_causal`` path, which saves what flash attention saves, the terms flash is planned
with), and on such rows with the trainer's tiled MLP (``memfit_trainer.tiled_mlp``) at whole tiles. Hooks on
each decoder layer read what the layer leaves alive at the end of its forward and the most its backward adds
above what was alive when that backward started. The traces at several token counts are solved exactly for
``a·T + b·T² + c`` (``T·min(T, window)`` where a sliding window bounds the quadratic term; past the window
for a term that appears only there) and every further count is checked to the byte; no factor is fitted. A
term that no such form reproduces keeps its measured points.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, TypeVar

from memfit.contract.sections import LoraConfig
from memfit.profile import (
    ActivationProfile,
    ActivationTerm,
    ActivationTerms,
    LayerActivations,
    OutsideTerms,
    TracedSetups,
)
from memfit_trainer.trace_workers import default_workers, trace_workers

DEFAULT_TOKENS = (256, 512, 1024, 2048)
"""Token counts traced for every model: three to solve for and one to check."""
DTYPE = "bfloat16"
FULL_ATTENTION = "full_attention"
DEFAULT_LORA = LoraConfig()
"""memfit's default adapters (a job's ``lora`` section left out): ``all-linear``, rank 16, dropout 0.05."""
Coefficients = tuple[Fraction, Fraction, Fraction]


@dataclass(frozen=True)
class Setup:
    """What a trace trains, and on what row."""

    lora: LoraConfig | None = None
    """The adapters trained over a frozen base, or None: full fine-tuning."""
    packed: bool = True
    """Two documents packed in the row (the trainer's packing); False: one document and no attention mask at all
    (an unpadded, unpacked row: SDPA's ``is_causal`` path)."""
    checkpointing: bool = False
    """The decoder layers checkpointed as the trainer checkpoints them."""
    chunked_loss: bool = False
    """The loss as the trainer's chunked loss computes it (``memfit_trainer.chunked_loss``: the LM head inside
    the loss, one chunk of logits at a time), else the model's own (the full logits)."""
    offloading: bool = False
    """The checkpointed layers' inputs moved off the traced device by the trainer's own activation offloading
    (``memfit_trainer.activation_offload``, copying to ``fake_trace.HOST``)."""
    tiled_mlp: bool = False
    """The decoder's dense MLPs run tile by tile by the trainer's own tiled MLP (``memfit_trainer.tiled_mlp``)."""


FULL = Setup()
UNMASKED = Setup(packed=False)
"""Rows of one unpadded document, no mask: flash attention's memory (traced plain and with the tiled MLP)."""


@dataclass(frozen=True)
class LayerTrace:
    """One decoder layer's bytes in one trace."""

    layer_type: str
    saved: int
    """Bytes its forward left alive for the backward (allocated between entering and leaving it)."""
    backward_peak: int
    """Bytes its backward allocated at most beyond what was alive when that backward began."""


@dataclass(frozen=True)
class Trace:
    """One traced training micro-batch: the activations alive when its forward ended, and per layer."""

    tokens: int
    forward_end: int
    layers: tuple[LayerTrace, ...]
    loss_backward: int = 0
    """Above ``forward_end``, the most the backward held before the last decoder layer's backward began (the
    loss's, the LM head's and the final norm's gradients)."""
    outside_backward: int = 0
    """Alive outside the decoder layers' saved bytes when the last layer's backward began (masks, rotary
    tables, the embedding's output, the gradient arriving at the last layer)."""
    peak: int = 0
    """The most the step held at once beyond the model's state (parameters, buffers, gradients)."""

    @property
    def outside_layers(self) -> int:
        return self.forward_end - sum(layer.saved for layer in self.layers)


def text_config(config: dict[str, Any]) -> Any:
    """The ``transformers`` config of the text decoder a config.json describes (a multimodal one's text part)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**transformers_fields(config)).get_text_config()


def transformers_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The config.json's fields as transformers reads the file: the floats JSON cannot hold, which its
    ``save_pretrained`` writes as ``{"__float__": "Infinity"}`` (Falcon-H1's ``time_step_limit``), made floats
    again, in new dicts and lists: transformers edits a config's nested dicts as it reads them (a
    ``rope_scaling``), and the config.json's own fields stay as the file has them (its ``config_sha256``)."""
    from transformers import PretrainedConfig

    decoded: dict[str, Any] = PretrainedConfig._decode_special_floats(config)
    return decoded


MESSAGE_LENGTH = 200
"""Characters of transformers' own reason shown in the one-line error."""


class ProfileError(ValueError):
    """Bad input: the message is the one line the user sees."""


def decoder_layers_prefix(model: Any, num_layers: int) -> str:
    """``model.layers``, ``transformer.h``, ``model.language_model.layers``...: where the text decoder keeps its
    layers, an ``nn.ModuleList`` of the config's length outside any vision or audio tower.

    The decoder's ``layers`` where :func:`~memfit_trainer.chunked_loss.text_decoder` finds it, else the one such
    list named ``layers``, else the one inside that decoder (GPT-2's and Bloom's ``h``), else the only one.
    """
    from torch import nn

    from memfit_trainer.chunked_loss import text_decoder

    decoder = text_decoder(model)
    decoder_layers = getattr(decoder, "layers", None)
    inside = {id(module) for module in decoder.modules()}
    lists = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        and len(module) == num_layers
        and not any(tower in name for tower in ("vision", "audio"))
    ]
    tiers = (
        [name for name, module in lists if module is decoder_layers],
        [name for name, _ in lists if name.rpartition(".")[2] == "layers"],
        [name for name, module in lists if id(module) in inside],
        [name for name, _ in lists],
    )
    found = next((tier for tier in tiers if tier), [])
    if len(found) != 1:
        raise ProfileError(f"cannot tell the decoder's {num_layers} layers in {type(model).__name__}")
    return str(found[0])


def traced_layer_types(text: Any) -> tuple[str, ...]:
    """The decoder layers a trace builds: one of each type, in order of first appearance (``full_attention`` where
    the config names none). A config that computes its layer types from other fields (a property: Jamba's periods,
    Zamba 2's hybrid layer ids, RecurrentGemma's block pattern) cannot be given other ones: there the model's own
    first layers, as many as hold every type, each type then planned at the most any of its layers holds
    (:func:`layers_by_type`)."""
    kinds = list(getattr(text, "layer_types", None) or [FULL_ATTENTION] * int(text.num_hidden_layers))
    if _derived_layer_types(text):
        return tuple(kinds[: max(kinds.index(kind) for kind in set(kinds)) + 1])
    return tuple(dict.fromkeys(kinds))


def layers_by_type(kinds: Sequence[str]) -> dict[str, list[int]]:
    """The indices of the traced layers of each type, types in order of first appearance."""
    indices: dict[str, list[int]] = {}
    for index, kind in enumerate(kinds):
        indices.setdefault(kind, []).append(index)
    return indices


def _derived_layer_types(text: Any) -> bool:
    """Whether the config's class computes ``layer_types`` (a property without a setter, under that name or the
    one its ``attribute_map`` reads: Falcon-H1's ``layers_block_type``)."""
    name = getattr(text, "attribute_map", {}).get("layer_types", "layer_types")
    attribute = getattr(type(text), name, None)
    return isinstance(attribute, property) and attribute.fset is None


def truncated(text: Any, layer_types: Sequence[str]) -> Any:
    """A copy of the text config with exactly these decoder layers, widths unchanged.

    ``layer_types`` is set explicitly, which is what configs that derive it from a pattern
    (``sliding_window_pattern``, ``full_attention_interval``) read first. A config that computes it from other
    fields (:func:`traced_layer_types`) is cut to as many layers, which must then be these.
    """
    short = copy.deepcopy(text)
    short.num_hidden_layers = len(layer_types)
    if _derived_layer_types(text):
        if list(short.layer_types) != list(layer_types):
            raise ProfileError(
                f"{text.model_type} computes its layer types from other fields, and a copy cut to "
                f"{len(layer_types)} layers has {list(short.layer_types)}, not the whole model's first "
                f"{list(layer_types)}: no copy of its layers can be traced"
            )
    elif getattr(text, "layer_types", None) is not None:
        short.layer_types = list(layer_types)
    elif set(layer_types) != {FULL_ATTENTION}:
        raise ValueError(f"{text.model_type} names no layer types, cannot build {sorted(set(layer_types))}")
    short.use_cache = False
    return short


def attention_kernel(text: Any) -> str:
    """``sdpa`` where the model class supports it, else ``eager`` (gpt-oss's sinks, for one)."""
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping[type(text)]
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def meta_model(text: Any, layer_types: Sequence[str], attention: str, setup: Setup) -> Any:
    """The model a trace trains, on the meta device in bf16 and in training mode: the truncated copy, wrapped
    with the setup's adapters as the trainer wraps it (peft creates them on the base layers' meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    from memfit_trainer.model import CHECKPOINTING, with_adapters

    auto_model: Any = AutoModelForCausalLM  # untyped classmethods
    with torch.device("meta"):
        model = auto_model.from_config(
            truncated(text, layer_types), attn_implementation=attention, dtype=torch.bfloat16
        )
    if setup.lora is not None:
        # Over a frozen embedding the first layer's input needs no gradient, and that layer keeps less for
        # backward than the others: making it need one (as with gradient checkpointing) traces every layer
        # as one deeper in the stack (a whole model's first layer is then counted high, never low).
        model.enable_input_require_grads()
        model = with_adapters(model, setup.lora, torch.bfloat16, gradient_checkpointing=setup.checkpointing)
    elif setup.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CHECKPOINTING)
    if setup.tiled_mlp:
        from memfit_trainer.tiled_mlp import tile_mlps

        tile_mlps(model)
    model.train()
    return model


def lora_of(text: Any, layer_types: Sequence[str], attention: str, lora: LoraConfig = DEFAULT_LORA) -> LoraConfig:
    """``lora``, without dropout where peft adapts some target in place (``ParamWrapper``: fused experts, a
    router parameter), which refuses dropout: what a job may train (``FineTuneJob`` refuses the dropout there)."""
    from peft.tuners.lora.layer import ParamWrapper

    if not lora.dropout:
        return lora
    undropped = lora.model_copy(update={"dropout": 0.0})
    model = meta_model(text, layer_types, attention, Setup(lora=undropped))
    return undropped if any(isinstance(module, ParamWrapper) for module in model.modules()) else lora


def training_row(tokens: int, vocab_size: int, packed: bool) -> dict[str, Any]:
    """The model's inputs for one row of ``tokens`` random tokens; packed as the trainer packs two documents
    (``memfit_trainer.data.model_inputs``: ids, labels and restarting ``position_ids``), else ids and labels."""
    import torch

    from memfit_trainer.blocks import pack
    from memfit_trainer.chat import Tokens
    from memfit_trainer.data import model_inputs

    ids = torch.randint(0, vocab_size, (tokens,)).tolist()
    if not packed:
        row = torch.tensor([ids])
        return {"input_ids": row, "labels": row}
    half = tokens // 2
    documents = [Tokens(ids[:half], [True] * half), Tokens(ids[half:], [True] * (tokens - half))]
    (block,) = pack(documents, tokens)
    return model_inputs(block[None], packing=True)


def trace(text: Any, layer_types: Sequence[str], tokens: int, attention: str, setup: Setup = FULL) -> Trace:
    """Train one row of ``tokens`` tokens through a copy of the model with these decoder layers, on fake tensors."""
    from memfit_trainer.activation_offload import offload_activations
    from memfit_trainer.chunked_loss import causal_lm_loss, unwrap_causal_lm
    from memfit_trainer.fake_trace import HOST, PhaseMemTracker, categories_of, fake_run, fake_weights, transient

    model = meta_model(text, layer_types, attention, setup)
    if setup.offloading:
        offload_activations(model, host=HOST)
    layers = list(model.get_submodule(decoder_layers_prefix(model, len(layer_types))))
    row = training_row(tokens, int(text.vocab_size), setup.packed)
    # Packed: the explicit mask transformers builds for the restarting positions; else none (is_causal).
    with fake_run("explicit" if setup.packed else "implicit") as mode:
        fake_weights(model)
        inputs = {name: mode.from_tensor(tensor) for name, tensor in row.items()}
        tracker = PhaseMemTracker()
        tracker.track_external(model)
        marks = _LayerMarks(tracker, len(layers), lambda: transient(categories_of(tracker.get_tracker_snapshot())))
        handles = [marks.hook(index, layer) for index, layer in enumerate(layers)]
        try:
            with tracker:
                loss = (
                    causal_lm_loss(model, unwrap_causal_lm(model), inputs)
                    if setup.chunked_loss
                    else model(**inputs).loss
                )
                forward_end, forward_moments = marks.now(), tracker.moment_count()
                marks.forwarding = False
                loss.backward()
                del loss
                moments = [transient(moment) for moment in tracker.moments()]
        finally:
            for handle in handles:
                for one in handle:
                    one.remove()
    return Trace(
        tokens=tokens,
        forward_end=forward_end,
        layers=tuple(
            LayerTrace(kind, marks.saved[index], marks.backward_peak(index, moments))
            for index, kind in enumerate(layer_types)
        ),
        loss_backward=max([forward_end, *moments[forward_moments : marks.backward_begins(len(layers) - 1)]])
        - forward_end,
        outside_backward=marks.held_at_backward(len(layers) - 1) - sum(marks.saved),
        peak=max(moments),
    )


class _LayerMarks:
    """Forward and backward hooks on decoder layers that note the tracker's non-state bytes and moments."""

    def __init__(self, tracker: Any, count: int, now: Any) -> None:
        self.tracker, self.now = tracker, now
        self.saved = [0] * count
        self._before = [0] * count
        self._backward: list[list[int]] = [[0, 0, 0] for _ in range(count)]
        """Per layer: non-state bytes when its backward starts, first and last moment of its backward."""
        self.forwarding = True
        """False once the forward ended: a checkpointed layer's recomputation runs these hooks again."""

    def hook(self, index: int, layer: Any) -> tuple[Any, Any]:
        def before(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self.forwarding:
                return
            self._before[index] = self.now()
            hidden = args[0] if args else kwargs["hidden_states"]
            hidden.register_hook(lambda grad: self._backward_ends(index))

        def after(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not self.forwarding:
                return
            self.saved[index] = self.now() - self._before[index]
            hidden = output[0] if isinstance(output, tuple) else output
            hidden.register_hook(lambda grad: self._backward_starts(index))

        return (
            layer.register_forward_pre_hook(before, with_kwargs=True),
            layer.register_forward_hook(after, with_kwargs=True),
        )

    def _backward_starts(self, index: int) -> None:
        self._backward[index][:2] = [self.now(), self.tracker.moment_count()]

    def _backward_ends(self, index: int) -> None:
        self._backward[index][2] = self.tracker.moment_count()

    def held_at_backward(self, index: int) -> int:
        """Non-state bytes alive when layer ``index``'s backward began."""
        return self._backward[index][0]

    def backward_begins(self, index: int) -> int:
        """The moment at which layer ``index``'s backward began."""
        return self._backward[index][1]

    def backward_peak(self, index: int, moments: list[int]) -> int:
        start, first, last = self._backward[index]
        return max([start, *moments[first:last]]) - start


def solve(points: Sequence[tuple[int, int]], window: int | None = None) -> ActivationTerm:
    """The exact ``a·T + b·T·min(T, window) + c`` through the three smallest token counts, checked on the rest.

        With a window, the quadratic form is tried first without it: the window is recorded only where the traces
        above it need it (a kernel that materializes the whole ``T×T`` scores is not bounded by the mask's window).
        Where neither form holds over all counts, both are tried over the counts from the second, third... up, as
    long as one is left to check (a term that changes form at some count: SDPA's sliding-window mask appears
    only past the window, a chunked linear attention's first chunk differs); the first that holds is kept with
    ``valid_from``. Failing all, the term is stored with ``exact`` false and its measured points.
    """
    points = sorted(points)
    forms = (None, window) if window else (None,)
    terms = [_exact_term(points, form, start) for start in range(len(points) - 3) for form in forms]
    return next((term for term in terms if term is not None and term.exact), _exact_term(points, None) or _lone(points))


def _lone(points: list[tuple[int, int]]) -> ActivationTerm:
    """Measured points that no form fits (too few, or collinear rows): nothing solved."""
    return ActivationTerm(per_token=0, per_token_squared=0, constant=0, measured=tuple(points), exact=False)


def _exact_term(points: list[tuple[int, int]], window: int | None, start: int = 0) -> ActivationTerm | None:
    def row(tokens: int) -> list[Fraction]:
        return [Fraction(tokens), Fraction(tokens * min(tokens, window or tokens)), Fraction(1)]

    fit, rest = points[start : start + 3], points[start + 3 :]
    solved = _solve3([row(t) for t, _ in fit], [Fraction(v) for _, v in fit])
    if solved is None:  # the window makes the quadratic column a multiple of the linear one
        return None
    a, b, c = solved
    exact = len(rest) > 0 and all(a * r[0] + b * r[1] + c == value for t, value in rest for r in [row(t)])
    return ActivationTerm(
        per_token=float(a),
        per_token_squared=float(b),
        constant=float(c),
        window=window,
        valid_from=fit[0][0] if start else 0,
        measured=() if exact and not start else tuple(points),  # where the form reproduces them all, it is them
        exact=exact,
    )


def _solve3(rows: list[list[Fraction]], values: list[Fraction]) -> Coefficients | None:
    """Gauss-Jordan elimination over fractions (three equations, three unknowns); None if singular."""
    m = [[*row, value] for row, value in zip(rows, values, strict=True)]
    for col in range(3):
        pivot = next((r for r in range(col, 3) if m[r][col] != 0), None)
        if pivot is None:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        m[col] = [x / m[col][col] for x in m[col]]
        for r in range(3):
            if r != col:
                m[r] = [x - m[r][col] * y for x, y in zip(m[r], m[col], strict=True)]
    return m[0][3], m[1][3], m[2][3]


def token_counts(window: int | None) -> tuple[int, ...]:
    """:data:`DEFAULT_TOKENS`, plus for a sliding window three counts up to it and four above it."""
    extra = {window // 4, window // 2, window, 2 * window, 3 * window, 4 * window, 6 * window} if window else set()
    return tuple(sorted(set(DEFAULT_TOKENS) | extra))


TILES = (2, 3, 4, 6)
"""Multiples of the hidden size (whole tiles) traced for the tiled MLP: three to solve for and one to check."""


@dataclass(frozen=True)
class TracedModel:
    """What every traced setup of one model shares: its text config, layer types, window, kernel and counts."""

    text: Any
    kinds: tuple[str, ...]
    window: int | None
    attention: str
    counts: tuple[int, ...]
    outside_counts: tuple[int, ...]
    """Where the chunked loss's terms are traced: no window bounds a term outside the layers."""
    tiled_counts: tuple[int, ...]
    """Where the tiled MLP's setups are traced: multiples of the hidden size, whole tiles of the trainer's
    ``mlp_tile_tokens``, so that one tile's bytes are the constant and the rest grows with the tokens (a count
    between them cuts smaller tiles, which hold less)."""

    @classmethod
    def of(cls, config: dict[str, Any], tokens: Sequence[int] | None = None) -> TracedModel:
        text = text_config(config)
        kinds = traced_layer_types(text)
        window = getattr(text, "sliding_window", None) if any("sliding" in kind for kind in kinds) else None
        counts = tuple(tokens or token_counts(window))
        tiled = tuple(factor * int(text.hidden_size) for factor in TILES)
        return cls(text, kinds, window, attention_kernel(text), counts, tuple(tokens or DEFAULT_TOKENS), tiled)

    def terms(self, setup: Setup) -> ActivationTerms:
        """The setup's terms, each solved exactly from its traces (:func:`activation_terms`)."""
        return activation_terms(
            self.text, self.kinds, self.attention, self.counts, setup, self.window, self.outside_counts
        )

    def tiled_terms(self, setup: Setup) -> ActivationTerms | None:
        """The setup's terms with the trainer's tiled MLP, without the chunked loss (what tiling changes is inside
        the layers); None where a step with it fails (the planner then leaves tiled MLPs off)."""
        tiled = replace(setup, tiled_mlp=True)
        try:
            return activation_terms(self.text, self.kinds, self.attention, self.tiled_counts, tiled, self.window, ())
        except Exception:  # the model's own code under the trainer's tiled MLP: whatever it raises, untraced
            return None


def activation_profile(
    config: dict[str, Any], tokens: Sequence[int] | None = None, workers: int | None = None
) -> ActivationProfile:
    """Trace one layer of each type at each token count, full and LoRA, and solve every term exactly. The setups
    are traced in ``workers`` processes (default: two where this process may run on two CPUs;
    ``memfit_trainer.trace_workers``): each trace is single-threaded Python dispatch, so two cores halve the wall
    time of a full-size profile."""
    model = TracedModel.of(config, tokens)
    with trace_workers(workers if workers is not None else default_workers()) as pool:
        full = pool.submit(model.terms, FULL)
        full_checkpointed = pool.submit(model.terms, Setup(checkpointing=True))
        unmasked = [pool.submit(model.terms, setup) for setup in _each_checkpointed([UNMASKED], None)]
        tiled = [pool.submit(model.tiled_terms, setup) for setup in _each_checkpointed([UNMASKED], None)]
        lora_terms: tuple[ActivationTerms, ...] | None = None
        lora_tiled: Sequence[ActivationTerms | None] = (None, None)
        failure: str | None = None
        try:
            lora = lora_of(model.text, model.kinds, model.attention)
            adapted = [pool.submit(model.terms, setup) for setup in _each_checkpointed([FULL, UNMASKED], lora)]
            adapted_tiled = [pool.submit(model.tiled_terms, setup) for setup in _each_checkpointed([UNMASKED], lora)]
            lora_terms = tuple(future.result() for future in adapted)
            lora_tiled = [future.result() for future in adapted_tiled]
        except Exception as error:  # the model's own code with peft's adapters: whatever it raises, LoRA cannot train
            lora, failure = DEFAULT_LORA, " ".join(f"{type(error).__name__}: {error}".split())[:MESSAGE_LENGTH]
        lora_all: Sequence[ActivationTerms | None] = lora_terms or (None,) * 4
        return ActivationProfile(
            dtype=DTYPE,
            micro_batch=1,
            attention=model.attention,
            full=full.result(),
            full_checkpointed=full_checkpointed.result(),
            lora=lora_all[0],
            lora_checkpointed=lora_all[1],
            unmasked=_traced_setups([future.result() for future in unmasked], lora_all[2:]),
            tiled_mlp=_traced_setups([future.result() for future in tiled], lora_tiled),
            lora_rank=lora.rank,
            lora_dropout=lora.dropout,
            lora_failure=failure,
        )


def _each_checkpointed(rows: Sequence[Setup], lora: LoraConfig | None) -> list[Setup]:
    """Each of these setups with these adapters (None: full fine-tuning), without and with checkpointing."""
    return [replace(row, lora=lora, checkpointing=on) for row in rows for on in (False, True)]


def _traced_setups(
    full: Sequence[ActivationTerms | None], lora: Sequence[ActivationTerms | None]
) -> TracedSetups | None:
    """Full fine-tuning's and LoRA's terms, each without and with checkpointing; None where full fine-tuning's
    failed."""
    if full[0] is None or full[1] is None:
        return None
    return TracedSetups(full=full[0], full_checkpointed=full[1], lora=lora[0], lora_checkpointed=lora[1])


def activation_terms(
    text: Any,
    kinds: Sequence[str],
    attention: str,
    counts: Sequence[int],
    setup: Setup,
    window: int | None = None,
    outside_counts: Sequence[int] | None = None,
) -> ActivationTerms:
    """The terms of one setup: a trace per token count, each term solved exactly over them, with the model's own
    loss and, for the terms outside the layers (the layers keep the same), the chunked loss, traced at
    ``outside_counts`` (default ``counts``): None where a step with it fails, or where no counts are given."""

    def solved(traces: list[Trace]) -> tuple[OutsideTerms, tuple[LayerActivations, ...]]:
        return _outside(traces), _layers(traces, kinds, attention, window)

    def every_term(terms: tuple[OutsideTerms, tuple[LayerActivations, ...]]) -> list[ActivationTerm]:
        outside, layers = terms
        return _outside_list(outside) + [term for layer in layers for term in (layer.saved, layer.backward_peak)]

    outside, layers = _exactly_solved(text, kinds, attention, counts, setup, solved, every_term)
    chunked = outside_counts if outside_counts is not None else counts
    return ActivationTerms(
        outside=outside,
        chunked_loss=_chunked_loss_terms(text, kinds, attention, chunked, setup) if chunked else None,
        layers=layers,
    )


def _chunked_loss_terms(
    text: Any, kinds: Sequence[str], attention: str, counts: Sequence[int], setup: Setup
) -> OutsideTerms | None:
    """The terms outside the layers with the trainer's chunked loss; None where a step with it fails."""
    chunked = replace(setup, chunked_loss=True)
    try:
        return _exactly_solved(text, kinds, attention, counts, chunked, _outside, _outside_list)
    except Exception:  # the model's own code under the chunked loss: whatever it raises, the planner leaves it off
        return None


LONGER = (2, 3, 4)
"""Multiples of the longest count traced again where a term has no exact form over the first counts."""
Solved = TypeVar("Solved")


def _exactly_solved(
    text: Any,
    kinds: Sequence[str],
    attention: str,
    counts: Sequence[int],
    setup: Setup,
    solve_all: Callable[[list[Trace]], Solved],
    terms: Callable[[Solved], list[ActivationTerm]],
) -> Solved:
    """The terms solved from a trace per token count; where one of them changes form at the longest counts
    (gpt-oss's experts at 2048 tokens), solved again with three longer counts, so that the form of the long
    sequences plans are made for is solved and checked (``valid_from``)."""
    traces = [trace(text, kinds, count, attention, setup) for count in counts]
    solved = solve_all(traces)
    if all(term.exact for term in terms(solved)):
        return solved
    longest = max(counts)
    traces += [trace(text, kinds, factor * longest, attention, setup) for factor in LONGER]
    return solve_all(traces)


def _outside(traces: list[Trace]) -> OutsideTerms:
    return OutsideTerms(
        outside_layers=solve([(t.tokens, t.outside_layers) for t in traces]),
        loss_backward=solve([(t.tokens, t.loss_backward) for t in traces]),
        outside_backward=solve([(t.tokens, t.outside_backward) for t in traces]),
    )


def _outside_list(outside: OutsideTerms) -> list[ActivationTerm]:
    return [outside.outside_layers, outside.loss_backward, outside.outside_backward]


def _layers(
    traces: list[Trace], kinds: Sequence[str], attention: str, window: int | None
) -> tuple[LayerActivations, ...]:
    """One entry per layer type, each term solved over the most any traced layer of that type holds at each count."""
    layers = []
    for kind, indices in layers_by_type(kinds).items():
        windowed = window if "sliding" in kind else None
        saved = solve([(t.tokens, max(t.layers[i].saved for i in indices)) for t in traces], windowed)
        peak = solve([(t.tokens, max(t.layers[i].backward_peak for i in indices)) for t in traces], windowed)
        layers.append(LayerActivations(layer_type=kind, attention=attention, saved=saved, backward_peak=peak))
    return tuple(layers)
