"""The shape of a decoder-only transformer, and exact parameter counts derived from it.

Everything memfit predicts starts here: the memory model and the throughput model only ever see a
:class:`ModelShape`, never a framework object, so they stay pure functions that run in microseconds.
The counts follow the Hugging Face ``transformers`` implementations of each family module by module
(a test builds every preset on the meta device and compares).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property

from memfit.api.vocabulary import ALL_LINEAR, Attention, Method, Precision
from memfit.planned_model import TensorCounts, model_flops


class ModelFamily(StrEnum):
    """Architecture families memfit knows module by module (the ``model_type`` in ``transformers``)."""

    LLAMA = "llama"
    MISTRAL = "mistral"
    QWEN2 = "qwen2"
    GEMMA2 = "gemma2"
    PHI3 = "phi3"
    MIXTRAL = "mixtral"


class Role(StrEnum):
    """What a linear module of a decoder layer belongs to."""

    ATTENTION = "attention"
    MLP = "mlp"
    ROUTER = "router"
    """The MoE router: in ``transformers`` 5 a bare ``weight`` parameter of its own module, not an ``nn.Linear``."""
    EXPERTS = "experts"
    """An MoE layer's experts, fused in ``transformers`` 5 into one 3-D parameter per projection (``count`` experts
    x out x in), not ``nn.Linear`` modules."""


LINEAR_ROLES = frozenset({Role.ATTENTION, Role.MLP})
"""Roles that ``transformers`` builds as ``nn.Linear``: only these does bitsandbytes quantize
(``replace_with_bnb_linear``) and peft wrap with ``lora.Linear``; it wraps the other parameters in place
(``ParamWrapper``, which folds the adapter into the weight)."""


@dataclass(frozen=True)
class LinearModule:
    """One kind of linear projection inside a decoder layer (``count`` copies of it per layer: the experts of a
    fused parameter)."""

    name: str
    in_features: int
    out_features: int
    bias: bool = False
    count: int = 1
    role: Role = Role.MLP
    lora_names: tuple[str, ...] = ()
    """The LoRA target names that reach it when they are not its own: fused experts keep the ``transformers`` 4
    names (``w1``, ``w3`` -> ``gate_up_proj``), which peft 0.21 maps onto the fused parameter."""

    @property
    def target_names(self) -> tuple[str, ...]:
        """The ``target_modules`` names that adapt this module (all of them at once for a fused one)."""
        return self.lora_names or (self.name,)

    @property
    def is_linear(self) -> bool:
        """Built as an ``nn.Linear``: see :data:`LINEAR_ROLES`."""
        return self.role in LINEAR_ROLES

    def lora_rank(self, rank: int) -> int:
        """The rank peft gives its adapter: peft 0.21 multiplies ``r`` by the number of fused projections
        (its ``rank_pattern`` for ``gate_up_proj``) so that w1 and w3 each keep a rank-r share."""
        return rank * len(self.target_names)

    def lora_parameters(self, rank: int) -> int:
        """A: (lora rank x count) x in, B: out x (lora rank x count): peft's ``ParamWrapper`` stacks the experts'
        adapters along the rank, so a fused parameter's adapter is as big as ``count`` separate ones."""
        return self.lora_rank(rank) * self.count * (self.in_features + self.out_features)

    @property
    def weight_parameters(self) -> int:
        return self.in_features * self.out_features * self.count

    @property
    def parameters(self) -> int:
        return self.weight_parameters + (self.out_features * self.count if self.bias else 0)


@dataclass(frozen=True)
class ModelShape:
    """The numbers that decide a causal LM's memory: all sizes, no weights."""

    family: ModelFamily
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    attention_bias: bool = False
    num_experts: int = 1
    experts_per_token: int = 1

    untraced_techniques = frozenset[str]()
    default_attention = Attention.SDPA

    def planned_fields(self) -> None:
        return None

    @property
    def basis(self) -> str:
        return f"typed sizes, counted by memfit's {self.family.value} formulas"

    def unplannable(self, precision: Precision, attention: Attention | None, techniques: frozenset[str]) -> str | None:
        return None

    def method_problem(self, method: Method) -> None:
        return None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    # --- derived sizes ------------------------------------------------------------------------
    @property
    def dim_head(self) -> int:
        assert self.head_dim is not None  # set in __post_init__
        return self.head_dim

    @property
    def q_size(self) -> int:
        """Width of the query projection output (heads x head_dim)."""
        return self.num_attention_heads * self.dim_head

    @property
    def kv_size(self) -> int:
        """Width of one of the key/value projection outputs (GQA: fewer heads than queries)."""
        return self.num_key_value_heads * self.dim_head

    @property
    def norms_per_layer(self) -> int:
        """RMSNorms per decoder layer: Gemma 2 normalises before and after attention and MLP."""
        return 4 if self.family is ModelFamily.GEMMA2 else 2

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    # --- modules ------------------------------------------------------------------------------
    @cached_property
    def layer_linears(self) -> tuple[LinearModule, ...]:
        """The linear modules of one decoder layer, named as in ``transformers`` (LoRA targets)."""
        h, i = self.hidden_size, self.intermediate_size
        attention: tuple[LinearModule, ...]
        if self.family is ModelFamily.PHI3:
            attention = (
                LinearModule("qkv_proj", h, self.q_size + 2 * self.kv_size, role=Role.ATTENTION),
                LinearModule("o_proj", self.q_size, h, role=Role.ATTENTION),
            )
            return attention + (
                LinearModule("gate_up_proj", h, 2 * i),
                LinearModule("down_proj", i, h),
            )
        bias = self.attention_bias or self.family is ModelFamily.QWEN2
        attention = (
            LinearModule("q_proj", h, self.q_size, bias, role=Role.ATTENTION),
            LinearModule("k_proj", h, self.kv_size, bias, role=Role.ATTENTION),
            LinearModule("v_proj", h, self.kv_size, bias, role=Role.ATTENTION),
            LinearModule("o_proj", self.q_size, h, self.attention_bias, role=Role.ATTENTION),
        )
        if self.is_moe:
            e = self.num_experts
            return attention + (
                LinearModule("gate", h, e, role=Role.ROUTER),
                LinearModule("gate_up_proj", h, 2 * i, count=e, role=Role.EXPERTS, lora_names=("w1", "w3")),
                LinearModule("down_proj", i, h, count=e, role=Role.EXPERTS, lora_names=("w2",)),
            )
        return attention + (
            LinearModule("gate_proj", h, i),
            LinearModule("up_proj", h, i),
            LinearModule("down_proj", i, h),
        )

    # --- compute ------------------------------------------------------------------------------
    def forward_flops_per_token(self, sequence_length: int) -> int:
        """2 x the active parameters plus causal attention (QK^T and AV over half the sequence on average)."""
        return 2 * self.active_parameters_per_token + 2 * self.num_layers * sequence_length * self.q_size

    def model_flops_per_token(self, sequence_length: int, trains_base: bool) -> int:
        return model_flops(self.forward_flops_per_token(sequence_length), trains_base)

    def linears_of(self, *roles: Role) -> tuple[LinearModule, ...]:
        return tuple(m for m in self.layer_linears if m.role in roles)

    # --- parameter counts ---------------------------------------------------------------------
    @property
    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_parameters(self) -> int:
        """Output projection; zero when it shares the embedding matrix."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @cached_property
    def norm_parameters(self) -> int:
        """All RMSNorm weights: per layer plus the final norm."""
        return (self.num_layers * self.norms_per_layer + 1) * self.hidden_size

    @cached_property
    def layer_linear_parameters(self) -> int:
        """Weights and biases of the linear modules of one decoder layer."""
        return sum(m.parameters for m in self.layer_linears)

    @cached_property
    def layer_parameters(self) -> int:
        return self.layer_linear_parameters + self.norms_per_layer * self.hidden_size

    @cached_property
    def parameter_count(self) -> int:
        """Exactly ``sum(p.numel() for p in model.parameters())`` of the ``transformers`` model."""
        return (
            self.embedding_parameters
            + self.lm_head_parameters
            + self.num_layers * self.layer_linear_parameters
            + self.norm_parameters
        )

    @cached_property
    def quantizable_parameters(self) -> int:
        """Weights bitsandbytes replaces with 4-bit ones: the decoder's ``nn.Linear`` weights.

        Embeddings, the LM head, norms, biases, the MoE router and the fused experts (3-D parameters, not
        ``nn.Linear``: most of an MoE model) stay in 16 bits under QLoRA.
        """
        return self.num_layers * sum(m.weight_parameters for m in self.quantizable_linears)

    @cached_property
    def quantizable_linears(self) -> tuple[LinearModule, ...]:
        """The layer's linears bitsandbytes replaces with 4-bit ones: its ``nn.Linear`` modules."""
        return tuple(m for m in self.layer_linears if m.is_linear)

    @cached_property
    def largest_layer_parameters(self) -> int:
        """The biggest single module (what ZeRO-3 must gather at once): often the embedding."""
        linear = max(m.in_features * m.out_features for m in self.layer_linears)
        return max(self.embedding_parameters, linear)

    @cached_property
    def tiled_mlp_parameters(self) -> int:
        """A dense layer's MLP weights (the trainer tiles no mixture of experts)."""
        return 0 if self.is_moe else sum(m.weight_parameters for m in self.linears_of(Role.MLP))

    @cached_property
    def active_parameters_per_token(self) -> int:
        """Parameters a token flows through (MoE: only its routed experts): sets the FLOPs."""
        if not self.is_moe:
            return self.parameter_count - self.embedding_parameters
        idle_experts = self.num_experts - self.experts_per_token
        expert = sum(m.weight_parameters for m in self.linears_of(Role.EXPERTS)) // self.num_experts
        return self.parameter_count - self.embedding_parameters - self.num_layers * idle_experts * expert

    # --- tensors (memfit.planned_model) ---------------------------------------------------------
    def full_tensors(self) -> TensorCounts:
        """Embedding, LM head (unless tied), the final norm and per layer its norms, the linear weights
        (``out x in``) and biases; fused experts are one 3-d parameter each (``experts x out x in``)."""
        h = self.hidden_size
        layer: list[tuple[int, ...]] = [(h,)] * self.norms_per_layer
        for m in self.layer_linears:
            fused = (m.count,) if m.role is Role.EXPERTS else ()
            layer.append((*fused, m.out_features, m.in_features))
            if m.bias:
                layer.append((m.out_features,))
        model = [(self.vocab_size, h), (h,)] + ([] if self.tie_word_embeddings else [(self.vocab_size, h)])
        return _counted(model, layer, self.num_layers)

    def lora_tensors(self, rank: int, target_modules: tuple[str, ...]) -> TensorCounts:
        """``lora_A`` (rank x in) and ``lora_B`` (out x rank) per targeted module, where peft's rank of a fused
        parameter stacks its experts' adapters (:meth:`LinearModule.lora_parameters`)."""
        layer: list[tuple[int, ...]] = []
        for m in self.lora_targeted(target_modules):
            rows = m.lora_rank(rank) * m.count
            layer += [(rows, m.in_features), (m.out_features, rows)]
        return _counted([], layer, self.num_layers)

    def quantized_tensors(self) -> tuple[tuple[int, int], ...]:
        return tuple((m.in_features * m.out_features, m.count * self.num_layers) for m in self.quantizable_linears)

    def in_place_lora_targets(self, target_modules: tuple[str, ...]) -> tuple[str, ...]:
        targeted = self.lora_targeted(target_modules)
        return tuple(sorted({name for m in targeted if not m.is_linear for name in m.target_names}))

    def lora_parameters(self, rank: int, target_modules: tuple[str, ...]) -> int:
        """Trainable parameters of the LoRA adapters peft creates on the named modules."""
        return self.num_layers * sum(m.lora_parameters(rank) for m in self.lora_targeted(target_modules))

    def lora_targeted(self, target_modules: tuple[str, ...]) -> tuple[LinearModule, ...]:
        """The layer's modules that ``target_modules`` adapts."""
        targets = self.resolve_lora_targets(target_modules)
        return tuple(m for m in self.layer_linears if targets.intersection(m.target_names))

    def resolve_lora_targets(self, target_modules: tuple[str, ...]) -> frozenset[str]:
        """Turn ``all-linear`` (peft's shorthand) into target names; reject names the family lacks, and half of a
        fused parameter (peft 0.21 refuses w1 without w3).

        ``all-linear`` includes the MoE router and experts: peft 0.21 adds their ``transformers`` 4 names, which
        were ``nn.Linear`` there, when it converts the config for ``transformers`` 5.
        """
        names = {name for m in self.layer_linears for name in m.target_names}
        if ALL_LINEAR in target_modules:
            return frozenset(names)
        unknown = sorted(set(target_modules) - names)
        if unknown:
            raise ValueError(
                f"unknown LoRA target module(s) {', '.join(unknown)} for a {self.family.value} model; "
                f"its linear modules are {', '.join(sorted(names))} (or use all-linear)"
            )
        for m in self.layer_linears:
            named = set(target_modules).intersection(m.target_names)
            missing = sorted(set(m.target_names) - named)
            if named and missing:
                raise ValueError(
                    f"LoRA targets {', '.join(sorted(named))} without {', '.join(missing)}: they are one fused "
                    f"parameter ({m.name}) in transformers 5, which peft adapts whole"
                )
        return frozenset(target_modules)


def _counted(once: list[tuple[int, ...]], per_layer: list[tuple[int, ...]], layers: int) -> TensorCounts:
    counts: Counter[tuple[int, ...]] = Counter(once)
    for tensor in per_layer:
        counts[tensor] += layers
    return tuple(counts.items())
