"""What the memory and throughput models read of a model, whichever way the model was described.

Two descriptions satisfy it: :class:`memfit.model_shape.ModelShape` (sizes typed in the job or a preset,
counted by per-family formulas) and :class:`memfit.profiled_model.ProfiledModel` (the inventory a model's
own ``transformers`` code builds, from its config.json: ``memfit.profile``). The planner sees only this
protocol, so a model planned from its profile cannot reach a formula written for another family.
"""

from __future__ import annotations

from typing import Protocol

from memfit.api.vocabulary import Attention, Method, Precision

TensorCounts = tuple[tuple[tuple[int, ...], int], ...]
"""Tensor shapes, each with how many tensors have it (the layers repeat theirs: counted, not listed)."""


class PlannedModel(Protocol):
    def __hash__(self) -> int:
        """The planner's caches are keyed by the model."""
        ...

    @property
    def basis(self) -> str:
        """What the numbers come from, for the plan (``PlanResult.model_basis``)."""
        ...

    def planned_fields(self) -> dict[str, bool | int | str] | None:
        """config.json fields (``model_type`` at the top, sizes in the text config) that the profile read and
        the loaded model must state alike (``memfit.contract.model_match``); None for typed sizes, which the
        trainer config carries as ``architecture``."""
        ...

    @property
    def untraced_techniques(self) -> frozenset[str]:
        """Technique knobs whose activations this description cannot estimate: the planner leaves them off."""
        ...

    @property
    def default_attention(self) -> Attention:
        """The attention kernel planned unless the job pins one."""
        ...

    def method_problem(self, method: Method) -> str | None:
        """Why ``method`` cannot train this model, or None."""
        ...

    def unplannable(self, precision: Precision, attention: Attention | None, techniques: frozenset[str]) -> str | None:
        """Why the job's pinned precision, attention kernel or techniques cannot be planned for it, or None."""
        ...

    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def parameter_count(self) -> int:
        """Exactly ``sum(p.numel() for p in model.parameters())`` of the ``transformers`` model."""
        ...

    @property
    def quantizable_parameters(self) -> int:
        """Weights bitsandbytes replaces with 4-bit ones (``nn.Linear`` weights of the decoder layers)."""
        ...

    @property
    def embedding_parameters(self) -> int: ...
    @property
    def lm_head_parameters(self) -> int:
        """Zero when the head shares the embedding matrix."""
        ...

    @property
    def norm_parameters(self) -> int: ...
    @property
    def layer_parameters(self) -> int:
        """The largest decoder layer (FSDP2 and ZeRO-3 gather one layer at a time)."""
        ...

    @property
    def largest_layer_parameters(self) -> int:
        """The biggest single module or tensor gathered at once (often the embedding)."""
        ...

    @property
    def active_parameters_per_token(self) -> int:
        """Parameters a token flows through (MoE: only its routed experts): sets the FLOPs."""
        ...

    @property
    def tiled_mlp_parameters(self) -> int:
        """Weights of one decoder layer's MLP that the trainer's tiled MLP runs (dense MLPs, not experts): a
        tiled MLP makes their gradients whole at its first tile."""
        ...

    def forward_flops_per_token(self, sequence_length: int) -> int: ...
    def model_flops_per_token(self, sequence_length: int, trains_base: bool) -> int: ...
    def lora_parameters(self, rank: int, target_modules: tuple[str, ...]) -> int:
        """Trainable parameters of the LoRA adapters peft creates on the named modules."""
        ...

    def resolve_lora_targets(self, target_modules: tuple[str, ...]) -> frozenset[str]:
        """The target names ``target_modules`` adapts (``all-linear`` resolved); ValueError for unknown names."""
        ...

    def in_place_lora_targets(self, target_modules: tuple[str, ...]) -> tuple[str, ...]:
        """Targeted parameters that are no ``nn.Linear`` (fused experts, routers): peft adapts them in place,
        without dropout."""
        ...

    def full_tensors(self) -> TensorCounts:
        """Every parameter tensor, as full fine-tuning trains them."""
        ...

    def lora_tensors(self, rank: int, target_modules: tuple[str, ...]) -> TensorCounts:
        """``lora_A`` and ``lora_B`` of every adapted module."""
        ...

    def quantized_tensors(self) -> tuple[tuple[int, int], ...]:
        """Elements of each weight bitsandbytes quantizes, with how many weights have that size."""
        ...


def model_flops(forward_flops_per_token: int, trains_base: bool) -> int:
    """FLOPs one trained token needs, recomputation not counted (MFU's numerator): the backward is twice the
    forward when the base is trained (6N in all); with a frozen base (LoRA, QLoRA) it computes no weight
    gradients, so it costs one forward (4N)."""
    return forward_flops_per_token * (3 if trains_base else 2)


DEFAULT_LORA_DROPOUT = 0.05
"""``lora.dropout`` where the job leaves it out and peft can apply it to every target."""


def lora_dropout(model: PlannedModel, target_modules: tuple[str, ...], dropout: float | None) -> float:
    """The job's dropout, or by default 0.05 (0 where peft adapts some target in place: it refuses dropout)."""
    if dropout is not None:
        return dropout
    return 0.0 if model.in_place_lora_targets(target_modules) else DEFAULT_LORA_DROPOUT


def adapter_problem(model: PlannedModel, target_modules: tuple[str, ...], dropout: float | None) -> str | None:
    """Why peft cannot build these LoRA adapters on the model, or None: a target it lacks, or a dropout the job
    sets on parameters peft adapts in place (fused experts and routers: its ``ParamWrapper`` refuses it)."""
    try:
        in_place = model.in_place_lora_targets(target_modules)
    except ValueError as error:
        return str(error)
    if in_place and dropout:
        return (
            f"lora.dropout {dropout} cannot apply to the adapters on {', '.join(in_place)} (fused experts and "
            "router, which peft adapts in place without dropout): set lora.dropout: 0, or target other modules"
        )
    return None
