"""A model planned from its profile: every count is a sum over the tensors its own code builds.

:class:`ProfiledModel` answers :class:`memfit.planned_model.PlannedModel` from a :class:`memfit.profile.ModelProfile`
alone: parameters, the tensors each method trains, what bitsandbytes quantizes and what peft adapts are the
profile's inventory (exact by construction), and the attention FLOPs follow each layer's type. Its activations
come from the profile's traced terms (:mod:`memfit.memory.profiled_activations`), which cover a 16-bit step
with the traced attention kernel (and flash attention, from the terms traced without a mask on SDPA), with the
model's own loss or the chunked one, with or without activation offloading or tiled MLPs: what is not traced is
what :attr:`ProfiledModel.untraced_techniques` and :meth:`ProfiledModel.unplannable` report.
"""

from __future__ import annotations

import math
from collections import Counter
from functools import cached_property

from memfit.api.vocabulary import ALL_LINEAR, ATTN_IMPLEMENTATION, Attention, Method, Precision
from memfit.planned_model import TensorCounts, model_flops
from memfit.profile import ActivationProfile, LoraResolution, ModelProfile, Role

WINDOWED = ("sliding", "chunked")
"""Layer types whose attention a window bounds (sliding windows, Llama 4's chunked attention)."""
LINEAR_ATTENTION = "linear_attention"
"""Layer types without a quadratic term: a recurrent state instead of a score matrix."""


class ProfiledModel:
    """The planner's view of a profiled model (see the module docstring)."""

    def __init__(self, profile: ModelProfile) -> None:
        if profile.activations is None:
            raise ValueError("the profile holds no activation terms: profile the model with --activations")
        self.profile = profile
        self.activations: ActivationProfile = profile.activations
        self._key = profile.model_dump_json()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProfiledModel) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    @cached_property
    def untraced_techniques(self) -> frozenset[str]:
        """Technique knobs the traced activation terms do not cover: the planner leaves them off."""
        activations = self.activations
        setups = [activations.full, activations.full_checkpointed, activations.lora, activations.lora_checkpointed]
        chunked = all(terms.chunked_loss is not None for terms in setups if terms is not None)
        untraced = {"chunked_loss": not chunked, "tiled_mlp": not self._traces_tiled_mlp}
        return frozenset(knob for knob, missing in untraced.items() if missing)

    @property
    def _traces_tiled_mlp(self) -> bool:
        """Whether every setup that trains was traced with the trainer's tiled MLP (not in a version-4 profile)."""
        tiled = self.activations.tiled_mlp
        if tiled is None:
            return False
        return self.activations.lora is None or (tiled.lora is not None and tiled.lora_checkpointed is not None)

    def planned_fields(self) -> dict[str, bool | int | str]:
        """The fields every config states alike at the top of its text config (the profile's head widths are
        its full-attention layers', which some configs give under other keys)."""
        profile = self.profile
        return {
            "model_type": profile.model_type,
            "hidden_size": profile.hidden_size,
            "num_hidden_layers": profile.num_layers,
            "num_attention_heads": profile.num_attention_heads,
            "vocab_size": profile.vocab_size,
            "tie_word_embeddings": profile.tie_word_embeddings,
        }

    @property
    def basis(self) -> str:
        sha = self.profile.config_sha256[:12]
        basis = f"profile of {self.profile.architecture} built from its config.json (sha256 {sha}...)"
        if self.activations.unmasked is None:
            basis += f", version {self.profile.version}: traced on packed rows only, no flash attention or tiled MLP"
        return basis

    def __repr__(self) -> str:
        return f"ProfiledModel({self.profile.architecture}, config sha256 {self.profile.config_sha256[:12]})"

    # --- sizes -------------------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.profile.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.profile.vocab_size

    @property
    def num_layers(self) -> int:
        return self.profile.num_layers

    @property
    def tie_word_embeddings(self) -> bool:
        return self.profile.tie_word_embeddings

    @property
    def default_attention(self) -> Attention:
        """The kernel the activations were traced with (SDPA where the model supports it, else eager)."""
        return Attention(self.activations.attention)

    # --- parameters --------------------------------------------------------------------------
    def _parameters(self, *roles: Role) -> int:
        return sum(group.numel for group in self.profile.tensors if group.role in roles)

    @cached_property
    def parameter_count(self) -> int:
        return self.profile.total_parameters

    @cached_property
    def quantizable_parameters(self) -> int:
        return self.profile.quantizable_parameters

    @cached_property
    def embedding_parameters(self) -> int:
        return self._parameters(Role.EMBEDDING)

    @cached_property
    def lm_head_parameters(self) -> int:
        return self._parameters(Role.LM_HEAD)

    @cached_property
    def norm_parameters(self) -> int:
        return self._parameters(Role.NORM, Role.FINAL_NORM)

    @cached_property
    def layer_parameters(self) -> int:
        per_layer: Counter[int] = Counter()
        for group in self.profile.tensors:
            for layer in group.layers:
                per_layer[layer] += math.prod(group.shape)
        return max(per_layer.values(), default=0)

    @cached_property
    def tiled_mlp_parameters(self) -> int:
        """A layer's MLP weights, averaged over the layers: exact where every layer has the same MLP; on a mixture
        of experts it counts shared dense MLPs the trainer leaves untiled (their gradients then count early)."""
        return self._parameters(Role.MLP) // self.num_layers

    @cached_property
    def largest_layer_parameters(self) -> int:
        return max(math.prod(group.shape) for group in self.profile.tensors)

    @cached_property
    def active_parameters_per_token(self) -> int:
        experts = self.profile.experts
        idle = 0
        if experts is not None:
            share = 1 - experts.experts_per_token / experts.num_experts
            idle = int(self._parameters(Role.EXPERTS) * share)
        return self.parameter_count - self.embedding_parameters - idle

    # --- compute -----------------------------------------------------------------------------
    @cached_property
    def _attention_layers(self) -> tuple[int, int]:
        """(full-attention layers, windowed ones): linear-attention layers have no quadratic term."""
        kinds = [kind for kind in self.profile.layer_types if kind != LINEAR_ATTENTION]
        windowed = sum(any(word in kind for word in WINDOWED) for kind in kinds) if self.profile.sliding_window else 0
        return len(kinds) - windowed, windowed

    def forward_flops_per_token(self, sequence_length: int) -> int:
        """2 x the active parameters plus attention: each softmax-attention layer attends over the causal
        half of its span (the whole sequence, or its window); linear-attention layers add no quadratic term."""
        profile = self.profile
        full, windowed = self._attention_layers
        span = full * sequence_length + windowed * min(sequence_length, profile.sliding_window or sequence_length)
        return 2 * self.active_parameters_per_token + 2 * span * profile.num_attention_heads * profile.head_dim

    def model_flops_per_token(self, sequence_length: int, trains_base: bool) -> int:
        return model_flops(self.forward_flops_per_token(sequence_length), trains_base)

    # --- LoRA --------------------------------------------------------------------------------
    def resolution(self, target_modules: tuple[str, ...]) -> LoraResolution:
        """What peft made of these targets when the model was profiled; ValueError if it was not asked."""
        wanted: str | tuple[str, ...] = ALL_LINEAR if ALL_LINEAR in target_modules else tuple(sorted(target_modules))
        for resolution in self.profile.lora:
            held = resolution.target_modules
            if held == wanted or (not isinstance(held, str) and tuple(sorted(held)) == wanted):
                return resolution
        shown = ",".join(target_modules)
        raise ValueError(
            f"the model's profile resolves no LoRA targets {shown}: profile it with --lora-targets {shown}"
        )

    def resolve_lora_targets(self, target_modules: tuple[str, ...]) -> frozenset[str]:
        resolution = self.resolution(target_modules)
        if not resolution.modules:
            raise ValueError(f"LoRA targets {','.join(target_modules)} match no module of {self.profile.architecture}")
        return frozenset(name for group in resolution.modules for name in group.names())

    def lora_parameters(self, rank: int, target_modules: tuple[str, ...]) -> int:
        return self.resolution(target_modules).adapter_parameters(rank)

    def in_place_lora_targets(self, target_modules: tuple[str, ...]) -> tuple[str, ...]:
        modules = self.resolution(target_modules).modules
        return tuple(sorted({f"{group.name}.{group.parameter}" for group in modules if group.parameter}))

    # --- tensors -----------------------------------------------------------------------------
    def full_tensors(self) -> TensorCounts:
        counts: Counter[tuple[int, ...]] = Counter()
        for group in self.profile.tensors:
            counts[group.shape] += group.count
        return tuple(counts.items())

    def lora_tensors(self, rank: int, target_modules: tuple[str, ...]) -> TensorCounts:
        counts: Counter[tuple[int, ...]] = Counter()
        for group in self.resolution(target_modules).modules:
            rows, modules = rank * group.rank_multiple, max(1, len(group.layers))
            counts[(rows, group.in_features)] += modules
            counts[(group.out_features, rows)] += modules
        return tuple(counts.items())

    def quantized_tensors(self) -> tuple[tuple[int, int], ...]:
        return tuple((math.prod(group.shape), group.count) for group in self.profile.tensors if group.quantizable)

    # --- what the traces cover ---------------------------------------------------------------
    @cached_property
    def plans_flash(self) -> bool:
        """Whether flash attention can be planned: the class implements it, and its setups were traced without a
        mask on SDPA, whose ``is_causal`` path saves what flash saves (its output and log-sum-exp; flash takes
        packed documents as boundaries, not as a mask). Traced on eager, an unmasked row still holds the scores."""
        flash = ATTN_IMPLEMENTATION[Attention.FLASH] in self.profile.attention_kernels
        return flash and self.activations.attention == Attention.SDPA.value and self.activations.unmasked is not None

    def method_problem(self, method: Method) -> str | None:
        failure = self.activations.lora_failure
        if method == Method.FULL or failure is None:
            return None
        return (
            f"{method.value} cannot train {self.profile.architecture}: a step with peft's adapters failed ({failure})"
        )

    def unplannable(self, precision: Precision, attention: Attention | None, techniques: frozenset[str]) -> str | None:
        """Why a pinned setting cannot be planned from this profile, or None."""
        if precision == Precision.FP32:
            return f"training.precision fp32: the profile of {self.profile.architecture} traced 16-bit activations"
        kernels = self.profile.attention_kernels
        if attention is not None and ATTN_IMPLEMENTATION[attention] not in kernels:
            return f"strategy.attention {attention.value}: {self.profile.architecture} supports {', '.join(kernels)}"
        traced = self.activations.attention
        if attention == Attention.FLASH and not self.plans_flash:
            return (
                f"strategy.attention flash: the profile of {self.profile.architecture} holds no terms traced "
                f"without a mask on {Attention.SDPA.value} attention (trace it again: make profiles)"
            )
        if attention not in (None, Attention.FLASH) and attention.value != traced:
            return (
                f"strategy.attention {attention.value}: the profile of {self.profile.architecture} traced its "
                f"activations with {traced} attention (leave strategy.attention out)"
            )
        untraced = sorted(techniques & self.untraced_techniques)
        if untraced:
            return f"strategy {', '.join(untraced)}: not yet traced for a model planned from its profile"
        return None
