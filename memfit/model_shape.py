"""The shape of a decoder-only transformer, and exact parameter counts derived from it.

Everything memfit predicts starts here: the memory model and the throughput model only ever see a
:class:`ModelShape`, never a framework object, so they stay pure functions that run in microseconds.
The counts follow the Hugging Face ``transformers`` implementations of each family module by module
(a test builds every preset on the meta device and compares).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property


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


@dataclass(frozen=True)
class LinearModule:
    """One kind of ``nn.Linear`` inside a decoder layer (``count`` copies of it per layer)."""

    name: str
    in_features: int
    out_features: int
    bias: bool = False
    count: int = 1
    role: Role = Role.MLP

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
                LinearModule("gate", h, e, role=Role.ROUTER),  # never quantized, rarely a LoRA target
                LinearModule("w1", h, i, count=e),
                LinearModule("w3", h, i, count=e),
                LinearModule("w2", i, h, count=e),
            )
        return attention + (
            LinearModule("gate_proj", h, i),
            LinearModule("up_proj", h, i),
            LinearModule("down_proj", i, h),
        )

    def linears_of(self, role: Role) -> tuple[LinearModule, ...]:
        return tuple(m for m in self.layer_linears if m.role is role)

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
        """Weights bitsandbytes replaces with 4-bit ones: decoder linears except the MoE router.

        Embeddings, the LM head, norms and biases stay in higher precision under QLoRA.
        """
        return self.num_layers * sum(m.weight_parameters for m in self.quantizable_linears)

    @cached_property
    def quantizable_linears(self) -> tuple[LinearModule, ...]:
        """The layer's linears bitsandbytes replaces with 4-bit ones (``count`` of each per layer)."""
        return tuple(m for m in self.layer_linears if m.role is not Role.ROUTER)

    @cached_property
    def largest_layer_parameters(self) -> int:
        """The biggest single module (what ZeRO-3 must gather at once): often the embedding."""
        linear = max(m.in_features * m.out_features for m in self.layer_linears)
        return max(self.embedding_parameters, linear)

    @cached_property
    def active_parameters_per_token(self) -> int:
        """Parameters a token flows through (MoE: only its routed experts): sets the FLOPs."""
        if not self.is_moe:
            return self.parameter_count - self.embedding_parameters
        idle_experts = self.num_experts - self.experts_per_token
        expert = sum(m.weight_parameters for m in self.layer_linears if m.count > 1) // self.num_experts
        return self.parameter_count - self.embedding_parameters - self.num_layers * idle_experts * expert

    def lora_parameters(self, rank: int, target_modules: tuple[str, ...]) -> int:
        """Trainable parameters of LoRA adapters (A: r x in, B: out x r) on the named modules."""
        targets = self.resolve_lora_targets(target_modules)
        per_layer = sum(
            rank * (m.in_features + m.out_features) * m.count for m in self.layer_linears if m.name in targets
        )
        return self.num_layers * per_layer

    def resolve_lora_targets(self, target_modules: tuple[str, ...]) -> frozenset[str]:
        """Turn ``all-linear`` (peft's shorthand) into module names; reject names the family lacks."""
        names = {m.name for m in self.layer_linears}
        if "all-linear" in target_modules:
            return frozenset(names - {"gate"})
        unknown = sorted(set(target_modules) - names)
        if unknown:
            raise ValueError(
                f"unknown LoRA target module(s) {', '.join(unknown)} for a {self.family.value} model; "
                f"its linear modules are {', '.join(sorted(names))} (or use all-linear)"
            )
        return frozenset(target_modules)
