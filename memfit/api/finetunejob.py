"""The ``FineTuneJob`` resource: what a researcher asks for, and what memfit reports back."""

from __future__ import annotations

from typing import Annotated, ClassVar, Final, Literal

from pydantic import Field, Strict, model_validator

from memfit.api.base import (
    API_VERSION,
    MAX_ATTEMPTS,
    MAX_COUNTER,
    MAX_STEPS,
    ApiModel,
    ClaimPath,
    Condition,
    NonEmptyStr,
    ObjectMeta,
    Source,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    VolumePath,
    shown,
)
from memfit.api.knobs import Knobs, knobs_of
from memfit.api.knobs import conflicts as knob_conflicts
from memfit.api.plan import PlanCandidate
from memfit.api.techniques import TECHNIQUES
from memfit.api.vocabulary import (
    ALL_LINEAR,
    BYTE_TOKENIZER_VOCAB,
    DEFAULT_MAX_RECORD_MIB,
    MAX_RECORD_MIB,
    Attention,
    DatasetFormat,
    EndedOutcome,
    Engine,
    MasterWeights,
    Method,
    Offload,
    OnBadRecord,
    Optimizer,
    Phase,
    Precision,
    TrainOn,
    ZeroStage,
)
from memfit.catalog.model_configs import stored_profile_names, stored_profiled_model
from memfit.catalog.models import MODEL_PRESETS, model_preset
from memfit.model_shape import ModelFamily, ModelShape
from memfit.planned_model import PlannedModel, adapter_problem

# Bounds of a FineTuneJob (see memfit.api.base): each far beyond any published model or real job.
MAX_HIDDEN_SIZE: Final = 131_072
"""Model width (the largest published dense models use 16-25k)."""
MAX_INTERMEDIATE_SIZE: Final = 1_048_576
"""MLP width."""
MAX_LAYERS: Final = 1024
"""Decoder layers (the largest published models have about 130)."""
MAX_HEADS: Final = 1024
"""Attention heads (and key/value heads)."""
MAX_HEAD_DIM: Final = 4096
"""Width of one attention head."""
MAX_VOCAB_SIZE: Final = 4_194_304
"""Vocabulary entries (the largest published vocabularies hold about 260k)."""
MAX_EXPERTS: Final = 4096
"""Mixture-of-experts: experts per layer, and experts per token."""
MAX_LORA_RANK: Final = 4096
"""LoRA adapter rank."""
MAX_GLOBAL_BATCH_SIZE: Final = 65_536
"""Sequences per optimizer step (the planner's work grows with the number of its divisors)."""
MIN_SEQUENCE_LENGTH: Final = 8
MAX_SEQUENCE_LENGTH: Final = 4_194_304
"""Tokens per sequence (the published long-context records split about 4M tokens over 8 GPUs)."""
MAX_SEQUENCE_PARALLEL: Final = 64
"""GPUs one sequence may be split over."""
MAX_GPUS: Final = 640_000
"""GPUs of one job: the largest pool (10000 nodes of 64 GPUs)."""
LORA_TARGET = r"^[A-Za-z0-9_.\-]+$"
"""A module name (q_proj, model.layers.0.mlp, all-linear)."""

_SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


class Architecture(ApiModel):
    """The model's shape: a built-in `preset`, or the explicit sizes from its config.json."""

    CONFIG_JSON_NAMES: ClassVar[dict[str, str]] = {
        "num_hidden_layers": "numLayers",
        "num_local_experts": "numExperts",
        "num_experts": "numExperts",
        "num_experts_per_tok": "expertsPerToken",
        "model_type": "family",
    }
    """config.json keys whose field here is not their camelCase (an unknown field names its field)."""

    preset: Annotated[str, Strict(), Field(min_length=1, max_length=128)] | None = None
    """A built-in model, e.g. llama-3.1-8b, qwen2.5-7b, gemma-2-9b, qwen3-8b, gemma-4-31b, gpt-oss-20b, each
    planned from the stored profile of its config.json (the six older families' presets also have typed sizes,
    which randomInit builds and memfit's formulas count where the job pins fp32 or another attention kernel
    than the profile traced); `memfit presets` lists them. Leave empty to give the sizes instead."""
    family: ModelFamily = ModelFamily.LLAMA
    """Architecture family (the `model_type` in config.json): decides module names and layout."""
    hidden_size: Annotated[int, Strict(), Field(ge=1, le=MAX_HIDDEN_SIZE)] | None = None
    """config.json `hidden_size`."""
    intermediate_size: Annotated[int, Strict(), Field(ge=1, le=MAX_INTERMEDIATE_SIZE)] | None = None
    """config.json `intermediate_size` (MLP width)."""
    num_layers: Annotated[int, Strict(), Field(ge=1, le=MAX_LAYERS)] | None = None
    """config.json `num_hidden_layers`."""
    num_attention_heads: Annotated[int, Strict(), Field(ge=1, le=MAX_HEADS)] | None = None
    """config.json `num_attention_heads`."""
    num_key_value_heads: Annotated[int, Strict(), Field(ge=1, le=MAX_HEADS)] | None = None
    """config.json `num_key_value_heads` (grouped-query attention); defaults to `numAttentionHeads`."""
    head_dim: Annotated[int, Strict(), Field(ge=1, le=MAX_HEAD_DIM)] | None = None
    """config.json `head_dim`; defaults to hiddenSize / numAttentionHeads."""
    vocab_size: Annotated[int, Strict(), Field(ge=1, le=MAX_VOCAB_SIZE)] | None = None
    """config.json `vocab_size`."""
    tie_word_embeddings: StrictBool = False
    """config.json `tie_word_embeddings`: the LM head shares the embedding matrix."""
    num_experts: StrictInt = Field(default=1, ge=1, le=MAX_EXPERTS)
    """Mixture-of-experts: experts per layer (config.json `num_local_experts`); 1 for dense models."""
    experts_per_token: StrictInt = Field(default=1, ge=1, le=MAX_EXPERTS)
    """Mixture-of-experts: experts each token is routed to (config.json `num_experts_per_tok`)."""

    @model_validator(mode="after")
    def _preset_or_sizes(self) -> Architecture:
        given = [name for name in _SHAPE_FIELDS if getattr(self, name) is not None]
        if self.preset is not None:
            known = [*MODEL_PRESETS, *(name for name in stored_profile_names() if name not in MODEL_PRESETS)]
            if self.preset.lower() not in known:
                raise ValueError(f"unknown preset {shown(self.preset)}; known presets: {', '.join(known)}")
            if given or self.head_dim is not None:
                raise ValueError("give either `preset` or the explicit sizes, not both")
            return self
        missing = [name for name in _SHAPE_FIELDS if getattr(self, name) is None and name != "num_key_value_heads"]
        if missing:
            raise ValueError(
                "without a `preset`, these sizes are required: "
                + ", ".join(Architecture.model_fields[m].alias or m for m in missing)
            )
        heads = self.num_attention_heads or 1
        kv = self.num_key_value_heads or heads
        if heads % kv:
            raise ValueError(f"numAttentionHeads ({heads}) must be a multiple of numKeyValueHeads ({kv})")
        if self.head_dim is None and (self.hidden_size or 0) % heads:
            raise ValueError(
                f"hiddenSize ({self.hidden_size}) is not divisible by numAttentionHeads ({heads}); set headDim"
            )
        if self.experts_per_token > self.num_experts:
            raise ValueError("expertsPerToken cannot exceed numExperts")
        return self

    @property
    def typed(self) -> bool:
        """Whether memfit has the model's sizes typed (the sizes given, or a preset of the formula families):
        what ``randomInit`` builds, and what the formulas count where a profile cannot."""
        return self.preset is None or self.preset.lower() in MODEL_PRESETS

    def planned(self) -> PlannedModel:
        """The model the planner works on: a preset's stored profile, or the typed sizes."""
        model = stored_profiled_model(self.preset.lower()) if self.preset is not None else None
        return model if model is not None else self.shape()

    def shape(self) -> ModelShape:
        """The typed shape the family formulas work on (a preset that is only a stored profile has none)."""
        if not self.typed:
            raise ValueError(f"preset {self.preset} is planned from its profile: it has no typed sizes")
        if self.preset is not None:
            return model_preset(self.preset)
        assert self.hidden_size and self.intermediate_size and self.num_layers and self.num_attention_heads
        assert self.vocab_size
        return ModelShape(
            family=self.family,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads or self.num_attention_heads,
            vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
            head_dim=self.head_dim,
            num_experts=self.num_experts,
            experts_per_token=self.experts_per_token,
        )


class ModelSpec(ApiModel):
    """The model to fine-tune."""

    name: NonEmptyStr
    """What the trainer loads with `from_pretrained`: a Hub id, or a path inside the model volume."""
    source: Source | None = None
    """Where the weights come from. Empty: the Hub, anonymously."""
    architecture: Architecture | None = None
    """The model: a preset (planned from its stored profile), or sizes copied from its config.json (counted by
    memfit's formulas for six families). Leave it out to plan the model from its own config.json and code (a
    profile: `memfit plan --mount`; in the cluster the operator profiles it in a short CPU-only pod and keeps
    the profile in a ConfigMap for every job of the model); required with `randomInit`."""
    random_init: StrictBool = False
    """Build the architecture with random weights instead of loading any (smoke tests of a cluster or
    a pipeline; nothing is downloaded)."""
    tokenizer: NonEmptyStr | None = None
    """A tokenizer other than the model's own: a directory inside the model volume when `source` is a
    claim, else a Hub id. Default: the model's own (`name`); randomInit models use a built-in byte-level
    tokenizer unless this is set."""

    def planned(self, profiled: PlannedModel | None = None) -> PlannedModel:
        """What plans and renders count this model by: ``profiled`` (its profile, read from its config.json)
        when given, else the typed architecture; ValueError when there is neither."""
        if profiled is not None:
            return profiled
        if self.architecture is None:
            raise ValueError(
                "spec.model.architecture is not given: memfit plans such a model from its config.json "
                "(memfit plan --mount CLAIM=DIR, with the model's claim mounted)"
            )
        return self.architecture.planned()

    @model_validator(mode="after")
    def _random_init_needs_sizes(self) -> ModelSpec:
        if not self.random_init:
            return self
        if self.architecture is None or not self.architecture.typed:
            raise ValueError("randomInit builds the model from typed sizes: give a formula preset or the sizes")
        vocab = self.architecture.shape().vocab_size
        if self.tokenizer is None and vocab < BYTE_TOKENIZER_VOCAB:
            raise ValueError(
                f"model.architecture.vocabSize {vocab} is below the {BYTE_TOKENIZER_VOCAB} ids of the byte-level "
                "tokenizer randomInit models use: raise vocabSize, or set model.tokenizer"
            )
        return self


class ValidationSpec(ApiModel):
    """Held-out data for a validation loss: a fraction of the training records, or files of its own."""

    fraction: Annotated[float, Strict(), Field(gt=0, le=0.5, allow_inf_nan=False)] | None = None
    """Share of the training records held out (chosen by the seed, the same on every restart), e.g. 0.05."""
    path: ClaimPath | None = None
    """A file or directory of validation records on the dataset's own volume (same format and fields)."""
    every_steps: StrictInt = Field(default=100, ge=1, le=MAX_STEPS)
    """Compute the validation loss every this many optimizer steps, and at the end."""

    @model_validator(mode="after")
    def _one_kind(self) -> ValidationSpec:
        if (self.fraction is None) == (self.path is None):
            raise ValueError("dataset.validation needs exactly one of `fraction` or `path`")
        return self


class DatasetSpec(ApiModel):
    """The training data: plain text, chat conversations, or prompt/completion pairs."""

    source: Source
    """Where the data files are."""
    format: DatasetFormat = DatasetFormat.JSONL
    """File format."""
    text_field: Annotated[str, Strict(), Field(min_length=1, max_length=256)] | None = None
    """Field holding plain text, every token a target (default `text` when no other field is given)."""
    messages_field: Annotated[str, Strict(), Field(min_length=1, max_length=256)] | None = None
    """Field holding chat messages ([{role, content}, ...]), rendered with the model's chat template."""
    prompt_field: Annotated[str, Strict(), Field(min_length=1, max_length=256)] | None = None
    """Field holding a prompt (with `completionField`): the loss is on the completion only."""
    completion_field: Annotated[str, Strict(), Field(min_length=1, max_length=256)] | None = None
    """Field holding the completion that follows `promptField`."""
    train_on: TrainOn = TrainOn.ASSISTANT
    """assistant: the loss is on assistant turns (chat) or the completion (prompt/completion) only; system,
    user and tool turns are context. all: every token is a target. Plain text always trains on every token."""
    packing: StrictBool | None = None
    """Pack documents into full sequences (each attends only to itself, positions restart per document);
    false: one document per sequence, padded (tokens past the sequence length are cut and reported). Default:
    packed wherever the model keeps packed documents apart (not Gated DeltaNet layers without
    flash-linear-attention); the plan says which."""
    validation: ValidationSpec | None = None
    """Held-out data for a validation loss (none by default)."""
    streaming: StrictBool = False
    """Stream the files instead of loading them (for datasets larger than the node's memory)."""
    on_bad_record: OnBadRecord = OnBadRecord.FAIL
    """fail: a record that is not UTF-8, not one JSON object, too large, or without its fields stops the job
    before training (or, streamed, when read) naming its file, line and field; skip: it is left out and counted."""
    max_record_mib: StrictInt = Field(default=DEFAULT_MAX_RECORD_MIB, ge=1, le=MAX_RECORD_MIB)
    """The largest record read, in MiB (a JSON line): a larger one is a bad record."""
    changed: StrictBool = False
    """The data changed on purpose since the last checkpoint: resume on it anyway (a position past the end of
    the new data starts the next epoch). Otherwise a resume on other data or past the end of an epoch is refused."""

    @model_validator(mode="after")
    def _one_kind(self) -> DatasetSpec:
        if (self.prompt_field is None) != (self.completion_field is None):
            raise ValueError("set `promptField` and `completionField` together")
        kinds = [k for k, v in (("textField", self.text_field), ("messagesField", self.messages_field),
                                ("promptField", self.prompt_field)) if v is not None]  # fmt: skip
        if len(kinds) > 1:
            both = "both" if len(kinds) == 2 else "all of"
            raise ValueError(
                "set one kind of record field (textField, messagesField, or promptField with completionField), "
                f"not {both} {' and '.join(kinds)}"
            )
        if not kinds:
            self.text_field = "text"
        if self.validation is not None and self.validation.fraction is not None and self.streaming:
            raise ValueError(
                "dataset.validation.fraction holds records out of a dataset loaded whole; a streamed dataset "
                "needs its own validation files (`validation.path`)"
            )
        return self


class LoraSpec(ApiModel):
    """LoRA adapter settings (used by methods lora and qlora, and by auto when it picks them)."""

    rank: StrictInt = Field(default=16, ge=1, le=MAX_LORA_RANK)
    """Adapter rank r (1-4096)."""
    alpha: StrictFloat = Field(default=32.0, gt=0, le=1_000_000)
    """Scaling numerator (the update is scaled by alpha / rank)."""
    dropout: StrictFloat | None = Field(default=None, ge=0, lt=1)
    """Dropout on the adapter input. Default: 0.05, or 0 where the targets include parameters peft adapts in place
    (an MoE model's fused experts and router under `all-linear`), which take no dropout."""
    target_modules: list[Annotated[str, Strict(), Field(min_length=1, max_length=128, pattern=LORA_TARGET)]] = Field(
        default_factory=lambda: [ALL_LINEAR], min_length=1, max_length=64
    )
    """Linear modules that get adapters, by name (q_proj, v_proj, ...) or `all-linear`."""


class TrainingSpec(ApiModel):
    """Training settings. The planner keeps `globalBatchSize` exact: micro-batch x accumulation x GPUs."""

    global_batch_size: StrictInt = Field(default=32, ge=1, le=MAX_GLOBAL_BATCH_SIZE)
    """Sequences per optimizer step, across all GPUs (1-65536)."""
    sequence_length: StrictInt = Field(default=2048, ge=MIN_SEQUENCE_LENGTH, le=MAX_SEQUENCE_LENGTH)
    """Tokens per sequence (samples are packed to this length)."""
    epochs: Annotated[int, Strict(), Field(ge=1, le=MAX_STEPS)] | None = None
    """Passes over the dataset. Give this or `maxSteps` (default: 1 epoch)."""
    max_steps: Annotated[int, Strict(), Field(ge=1, le=MAX_STEPS)] | None = None
    """Optimizer steps to run; overrides `epochs`."""
    learning_rate: Annotated[float, Strict(), Field(gt=0, lt=1, allow_inf_nan=False)] | None = None
    """Peak learning rate (default: 2e-5 for full fine-tuning, 2e-4 for LoRA/QLoRA)."""
    warmup_ratio: StrictFloat = Field(default=0.03, ge=0, lt=1)
    """Fraction of steps spent warming the learning rate up."""
    weight_decay: StrictFloat = Field(default=0.0, ge=0, le=10)
    """Decoupled weight decay (0-10)."""
    max_grad_norm: StrictFloat = Field(default=1.0, ge=0, le=1_000_000)
    """Clip the gradients' global norm to this; 0: no clipping (needed by strategy.optimizerInBackward)."""
    optimizer: Optimizer = Optimizer.ADAMW
    """Optimizer; the 8-bit ones come from bitsandbytes."""
    precision: Precision = Precision.AUTO
    """Compute precision; auto picks bf16 where the GPU has it, else fp16."""
    checkpoint_every_steps: StrictInt = Field(default=500, ge=1, le=MAX_STEPS)
    """Save a resumable checkpoint every this many optimizer steps (and at the end)."""
    seed: StrictInt = Field(default=42, ge=0, le=2**32 - 1)
    """Seed for initialisation and data order (a resumed run continues the same order); 0 to 2^32-1."""

    @model_validator(mode="after")
    def _length(self) -> TrainingSpec:
        if self.epochs is None and self.max_steps is None:
            self.epochs = 1
        return self


class ResourcesSpec(ApiModel):
    """Which GPUs the job may use."""

    pool: Annotated[str, Strict(), Field(min_length=1, max_length=253)] | None = None
    """Restrict the job to this GPUPool (default: any pool)."""
    max_gpus: Annotated[int, Strict(), Field(ge=1, le=MAX_GPUS)] | None = None
    """Use at most this many GPUs in all (default: as many as help)."""
    memory_headroom_percent: StrictFloat = Field(default=10.0, ge=0, lt=90)
    """Plan to leave this share of every GPU's memory free."""


class StrategySpec(ApiModel):
    """Pin any knob of the plan; the planner keeps what is pinned and evaluates exactly that."""

    zero_stage: Annotated[ZeroStage, Strict()] | None = None
    """DeepSpeed ZeRO stage 0-3."""
    offload_optimizer: Offload | None = None
    """Where optimizer states live: GPU (none), CPU memory, or NVMe."""
    offload_parameters: Offload | None = None
    """Where ZeRO-3 keeps parameters between uses: GPU (none), CPU memory, or NVMe."""
    gradient_checkpointing: StrictBool | None = None
    """Recompute activations in the backward pass instead of keeping them."""
    micro_batch_size: Annotated[int, Strict(), Field(ge=1, le=MAX_GLOBAL_BATCH_SIZE)] | None = None
    """Sequences per GPU per forward pass (gradient accumulation makes up the rest)."""
    attention: Attention | None = None
    """Attention kernel: sdpa (PyTorch fused), flash (flash-attn 2), flex (PyTorch flex_attention: packed
    documents as a block mask, no dense mask; CUDA only), or eager (materialises scores)."""
    chunked_loss: StrictBool | None = None
    """Compute the LM head and the cross-entropy chunk by chunk, recomputed in backward, so the
    full-vocabulary logits never exist (ZeRO 0-2 only)."""
    activation_offloading: StrictBool | None = None
    """Keep checkpointed layers' saved inputs in pinned host memory between forward and backward (needs
    gradientCheckpointing; costs host memory and PCIe traffic)."""
    master_weights: MasterWeights | None = None
    """fp32: mixed precision with fp32 master weights (the default the planner prefers). bf16: pure bf16
    weights, gradients and optimizer states: less memory and different numerics; the planner picks it only
    where nothing fits with fp32 masters."""
    engine: Engine | None = None
    """deepspeed (ZeRO) or fsdp2 (PyTorch's fully_shard; zeroStage 2 or 3, CPU offload of parameters,
    gradients and optimizer states together)."""
    optimizer_in_backward: StrictBool | None = None
    """Step each parameter's optimizer in the backward pass as soon as its gradient is reduced, then free
    the gradient, so the full set of gradients never exists (as torchtune does): on fsdp2 each shard, on
    deepspeed at zeroStage 0 with masterWeights bf16 each whole parameter (adamw, adamw8bit or
    paged_adamw8bit, one optimizer per parameter). It needs gradient accumulation 1 (a gradient must be
    final when it is made) and no clipping: a parameter's step cannot wait for the global norm of all
    gradients, so set training.maxGradNorm: 0 (torchtune makes the same choice). Unset: the planner uses it
    only where the job allows it and it fits a larger micro-batch, or makes the job fit at all."""
    sequence_parallel: Annotated[int, Strict(), Field(ge=1, le=MAX_SEQUENCE_PARALLEL)] | None = None
    """Split each sequence over this many GPUs (Ulysses sequence parallelism: each holds 1/n of the tokens;
    two all-to-alls per attention layer). Unset: the planner raises it only where a longer sequence or a
    larger micro-batch then fits."""
    tiled_mlp: StrictBool | None = None
    """Run each MLP tile by tile along the sequence, recomputed in backward, so its intermediate-sized
    activations exist for one tile at a time (one more MLP forward per token)."""


class FineTuneJobSpec(ApiModel):
    """A fine-tuning job: what to train, on what, how, and where it may run."""

    model: ModelSpec
    """The model to fine-tune."""
    dataset: DatasetSpec
    """The training data."""
    method: Method = Method.AUTO
    """full, lora, qlora, or auto: the highest-fidelity method that fits (full, then lora, then qlora)."""
    lora: LoraSpec = Field(default_factory=LoraSpec)
    """LoRA settings for lora and qlora."""
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    """Training settings."""
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    """Which GPUs the job may use."""
    strategy: StrategySpec = Field(default_factory=StrategySpec)
    """Pinned plan knobs; everything left out is planned."""
    output: VolumePath
    """Where checkpoints and the final model or adapter are written."""
    suspend: StrictBool = False
    """Stop the pods and keep everything else; set back to false to resume from the last checkpoint."""
    max_restarts: StrictInt = Field(default=3, ge=0, le=MAX_ATTEMPTS)
    """Gang restarts after failures, 0-100 (out-of-memory re-plans are counted separately)."""
    max_replans: StrictInt = Field(default=3, ge=0, le=MAX_ATTEMPTS)
    """Re-plans to a leaner strategy after out-of-memory failures, 0-100."""

    @model_validator(mode="after")
    def _consistent(self) -> FineTuneJobSpec:
        strategy = self.strategy
        conflicts = knob_conflicts(self.knobs())
        if conflicts:
            raise ValueError("; ".join(conflicts))
        if self.dataset.streaming and self.training.max_steps is None:
            raise ValueError("dataset.streaming has no known epoch length: set training.maxSteps")
        batch = self.training.global_batch_size
        if strategy.micro_batch_size is not None and batch % strategy.micro_batch_size:
            raise ValueError(
                f"training.globalBatchSize ({batch}) is not divisible by strategy.microBatchSize "
                f"({strategy.micro_batch_size})"
            )
        self._adapters_peft_can_build()
        return self

    def _adapters_peft_can_build(self) -> None:
        """The typed model has the LoRA targets, and peft can put the adapters on them (a model without
        typed sizes is checked when its profile is planned)."""
        architecture = self.model.architecture
        if architecture is None:
            return
        dropout = None if self.method is Method.FULL else self.lora.dropout
        problem = adapter_problem(self.planned_model(), tuple(self.lora.target_modules), dropout)
        if problem is not None:
            raise ValueError(problem)

    def planned_model(self, profiled: PlannedModel | None = None) -> PlannedModel:
        """The model this job is planned and rendered for (``ModelSpec.planned``). A preset that also has typed
        sizes is counted by its family's formulas where the job asks what its stored profile cannot estimate
        (fp32, another attention kernel than the traced one, LoRA targets it did not resolve); the plan's
        ``modelBasis`` then says typed sizes."""
        model = self.model.planned(profiled)
        architecture = self.model.architecture
        typed_preset = architecture is not None and architecture.preset is not None and architecture.typed
        if profiled is None and typed_preset and self.profile_problem(model) is not None:
            assert architecture is not None  # typed_preset
            return architecture.shape()
        return model

    def profile_problem(self, model: PlannedModel) -> str | None:
        """Why ``model`` cannot plan this job's pinned precision, attention kernel, techniques or LoRA targets."""
        precision = Precision.BF16 if self.training.precision is Precision.AUTO else self.training.precision
        pinned = frozenset(t.knob for t in TECHNIQUES if getattr(self.strategy, t.knob))
        problem = model.unplannable(precision, self.strategy.attention, pinned)
        if problem is None:
            dropout = None if self.method is Method.FULL else self.lora.dropout
            problem = adapter_problem(model, tuple(self.lora.target_modules), dropout)
        return problem

    def knobs(self) -> Knobs:
        """What the spec decides: the strategy section's pins, the method, precision and optimizer (auto decides
        nothing), the least accumulation a pinned micro-batch allows, and whether gradients are clipped."""
        return knobs_of(
            self.strategy,
            method=None if self.method is Method.AUTO else self.method,
            precision=None if self.training.precision is Precision.AUTO else self.training.precision,
            optimizer=self.training.optimizer,
            gradient_accumulation_steps=self._fewest_accumulation_steps(),
            clips_gradients=self.training.max_grad_norm > 0,
            packing=self.dataset.packing,
        )

    def _fewest_accumulation_steps(self) -> int | None:
        """The least accumulation a pinned micro-batch allows on at most resources.maxGpus GPUs (None:
        unknown until planned)."""
        micro, gpus = self.strategy.micro_batch_size, self.resources.max_gpus
        if micro is None or gpus is None:
            return None
        return max(1, -(-self.training.global_batch_size // (micro * gpus)))


class Progress(ApiModel):
    """How far training has come, as the trainer last reported it."""

    step: StrictInt = Field(default=0, ge=0, le=MAX_COUNTER)
    """Optimizer steps done."""
    total_steps: Annotated[int, Strict(), Field(ge=0, le=MAX_COUNTER)] | None = None
    """Optimizer steps planned in all."""
    percent: StrictInt = Field(default=0, ge=0, le=100)
    """step / totalSteps in percent."""
    tokens_per_second: Annotated[float, Strict(), Field(ge=0, le=1e15, allow_inf_nan=False)] | None = None
    """Measured training throughput, all ranks together."""
    eta: StrictStr | None = None
    """Estimated time to finish (RFC 3339)."""
    last_checkpoint_step: Annotated[int, Strict(), Field(ge=0, le=MAX_COUNTER)] | None = None
    """Step of the newest complete checkpoint."""
    validation_loss: Annotated[float, Strict(), Field(allow_inf_nan=False)] | None = None
    """Mean loss over the validation target tokens (dataset.validation), computed at `validationStep`."""
    validation_step: Annotated[int, Strict(), Field(ge=0, le=MAX_COUNTER)] | None = None
    """The step the validation loss was computed at."""
    updated: StrictStr | None = None
    """When this progress was read (RFC 3339)."""


class Attempt(ApiModel):
    """One launch of the job's pods."""

    number: StrictInt = Field(ge=1, le=MAX_COUNTER)
    """1 for the first launch, then counting up."""
    strategy_summary: StrictStr
    """The plan this attempt ran, in one line."""
    started: StrictStr
    """When the attempt was launched (RFC 3339)."""
    finished: StrictStr | None = None
    """When it ended (RFC 3339)."""
    outcome: EndedOutcome | None = None
    """Succeeded, Failed, OutOfMemory, ConfigError or Suspended; null while the attempt runs."""
    reason: StrictStr | None = None
    """Why it ended, in a sentence."""
    resumed_from_step: Annotated[int, Strict(), Field(ge=0, le=MAX_COUNTER)] | None = None
    """The checkpoint step it started from, if any: the trainer's own word once its rank 0 has reported
    (`checkpointsSetAside` is then set), until then the step the operator launched it to resume from."""
    checkpoints_set_aside: Annotated[int, Strict(), Field(ge=0, le=MAX_COUNTER)] | None = None
    """Newer checkpoints the trainer set aside (renamed, not deleted) before resuming, as they failed
    verification or could not be read; rank 0's log names them. Null until its rank 0 has reported."""


class FineTuneJobStatus(ApiModel):
    """What memfit planned and what is happening. Written by the operator only."""

    phase: Phase | None = None
    """Where the job is: Pending, Invalid, Unschedulable, Launching, Running, Restarting, Suspended,
    Succeeded or Failed."""
    observed_generation: Annotated[int, Strict(), Field(ge=0, le=MAX_COUNTER)] | None = None
    """The `.metadata.generation` this status describes."""
    conditions: list[Condition] = Field(default_factory=list)
    """Conditions (Ready, Planned, Running, Succeeded, Suspended) per the Kubernetes API conventions."""
    plan: PlanCandidate | None = None
    """The chosen plan, with its per-GPU memory estimate (the same fields as `memfit plan -o json`)."""
    gpus: Annotated[int, Strict(), Field(ge=0, le=MAX_GPUS)] | None = None
    """GPUs the current plan uses."""
    memory_per_gpu: StrictStr | None = None
    """Estimated memory per GPU against capacity, e.g. `61.2/80.0 GiB`."""
    progress: Progress | None = None
    """Training progress."""
    progress_display: StrictStr | None = None
    """Progress for `kubectl get`, e.g. `42% 420/1000`."""
    attempts: list[Attempt] = Field(default_factory=list)
    """Every launch, with why it ended."""
    restarts: StrictInt = Field(default=0, ge=0, le=MAX_COUNTER)
    """Gang restarts used (of spec.maxRestarts)."""
    replans: StrictInt = Field(default=0, ge=0, le=MAX_COUNTER)
    """Out-of-memory re-plans used (of spec.maxReplans)."""
    excluded_strategies: list[StrictStr] = Field(default_factory=list)
    """Strategies ruled out after they ran out of memory (the planner skips them): each one's identity, every
    knob and its placement as `name=value` pairs."""
    launched_spec: FineTuneJobSpec | None = None
    """The spec as it was at the first launch. The spec is immutable from then on except `suspend`:
    restarts and re-plans use this copy, and a changed spec is reported (condition Ready) and ignored."""


class FineTuneJob(ApiModel):
    """A FineTuneJob object as `kubectl apply` takes it."""

    api_version: Literal["memfit.dev/v1alpha1"] = API_VERSION
    """API version."""
    kind: Literal["FineTuneJob"] = "FineTuneJob"
    """Kind."""
    metadata: ObjectMeta
    """Standard object metadata."""
    spec: FineTuneJobSpec
    """The desired job."""
    status: FineTuneJobStatus | None = None
    """Observed state."""
