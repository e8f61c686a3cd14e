"""Build the model and tokenizer a config asks for: random or pretrained, full, LoRA or QLoRA.

Everything memory-relevant that the plan assumed is applied here and nowhere else: the weights' dtype
(from the precision; adapters and QLoRA's non-quantized parameters too, see :func:`prepare_adapter_base`),
the attention kernel, non-reentrant gradient checkpointing, the LoRA adapters and, for QLoRA, 4-bit NF4
base weights with double quantisation. The Hub token is read from the environment
variable the config names (a Kubernetes Secret), never from the config itself; ``HF_HUB_OFFLINE`` is
honoured by ``huggingface_hub``.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memfit.api.vocabulary import ALL_LINEAR, ATTN_IMPLEMENTATION, Attention, Engine, Method, Precision
from memfit.contract.engines import DeepSpeedEngineSection
from memfit.contract.model_match import fields_mismatch, shape_mismatch
from memfit.contract.reader import ConfigError
from memfit.contract.sections import LoraConfig, ModelConfig
from memfit.contract.termination import one_line
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer.hf_config import transformers_config
from memfit_trainer.tokenizer import hub_miss, model_tokenizer

DTYPES: dict[Precision, torch.dtype] = {
    Precision.BF16: torch.bfloat16,
    Precision.FP16: torch.float16,
    Precision.FP32: torch.float32,
}
ATTENTION_SUPPORT: dict[Attention, tuple[str, ...]] = {
    Attention.SDPA: ("_supports_sdpa",),
    Attention.FLASH: ("_supports_flash_attn", "_supports_flash_attn_2"),
    Attention.FLEX: ("_supports_flex_attn",),
}
"""The ``PreTrainedModel`` class attributes saying that a model class implements each kernel (eager: all do).
gpt-oss, for one, implements no SDPA attention: ``from_pretrained`` would raise deep inside loading."""


@dataclass
class BuiltModel:
    model: Any
    tokenizer: Any
    zero3_context: Any = None
    """``HfDeepSpeedConfig`` that made ``transformers`` build the model partitioned (``zero.Init``); it only
    works while referenced, so it is kept until ``deepspeed.initialize`` has run."""


def build_tokenizer(config: TrainerConfig) -> Any:
    """The tokenizer the config asks for (:func:`~memfit_trainer.tokenizer.model_tokenizer`)."""
    return model_tokenizer(config.model)


def quantization_config(engine: Engine) -> Any:
    """QLoRA's base-weight format: 4-bit NF4, double-quantised, computing in bf16.

    On the fsdp2 engine the packed 4-bit codes are stored in bf16 elements (``bnb_4bit_quant_storage``: one
    element holds four codes), as in answer.ai's FSDP-QLoRA recipe: ``fully_shard`` then shards them like any
    frozen bf16 weight (and ``MixedPrecisionPolicy`` casts nothing), where uint8 storage would be a dtype of
    its own in the layer's all-gather. Only the packed codes are sharded: the quant states (absmax, code
    tables) are attributes of each ``Linear4bit``, replicated whole on every rank, and bitsandbytes'
    ``fix_4bit_weight_quant_state_from_module`` re-attaches them to the unsharded weight FSDP2 gathers."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(  # type: ignore[no-untyped-call]  # transformers' config classes are unannotated
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16 if engine == Engine.FSDP2 else torch.uint8,
    )


def _device_map(config: TrainerConfig, local_rank: int) -> dict[str, Any]:
    """Where QLoRA's 4-bit base is built: on the GPU for DeepSpeed (which keeps it whole there); on the host
    for fsdp2, whose ``fully_shard`` moves each layer to the GPU as it shards it (bitsandbytes' ``Params4bit.to``
    moves the quant states along), so no GPU ever holds the whole 4-bit model."""
    on_gpu = torch.cuda.is_available() and config.engine.kind != Engine.FSDP2
    return {"": local_rank if on_gpu else "cpu"}


def model_class(hf_config: Any) -> Any:
    """The ``transformers`` causal-LM class ``AutoModelForCausalLM`` builds for ``hf_config`` (a
    ``PretrainedConfig``); ConfigError when its model type has none."""
    from transformers import AutoModelForCausalLM

    mapping: Any = AutoModelForCausalLM._model_mapping
    try:
        found = mapping[type(hf_config)]
    except KeyError:
        raise ConfigError(
            f"model_type {hf_config.model_type!r} has no causal language model in the installed transformers"
        ) from None
    if not isinstance(found, (list, tuple)):
        return found
    by_name = {cls.__name__: cls for cls in found}
    return next((by_name[a] for a in getattr(hf_config, "architectures", None) or () if a in by_name), found[0])


def implements_attention(cls: Any, attention: Attention) -> bool:
    """Whether the model class ``cls`` implements the attention kernel (:data:`ATTENTION_SUPPORT`)."""
    flags = ATTENTION_SUPPORT.get(attention)
    return flags is None or any(getattr(cls, flag, False) for flag in flags)


def attention_problem(hf_config: Any, attention: Attention) -> str | None:
    """One line when the model class of ``hf_config`` does not implement the ``attention`` kernel, naming
    the ones it does; None when it does."""
    cls = model_class(hf_config)
    if implements_attention(cls, attention):
        return None
    supported = ", ".join(kernel.value for kernel in Attention if implements_attention(cls, kernel))
    return (
        f"training.attention {attention.value}: transformers implements no {ATTN_IMPLEMENTATION[attention]} attention "
        f"for {cls.__name__} (model_type {hf_config.model_type}); set it to one it implements: {supported}"
    )


def pretrained_config(model_config: ModelConfig) -> Any:
    """The model's ``PretrainedConfig``: built from the architecture for randomInit, else read (from the
    directory, or fetched from the Hub) as ``transformers`` resolves it, class defaults filled in. One that
    cannot be read (no network, not in the offline cache, an unknown model_type) is a ConfigError naming it."""
    if model_config.random_init:
        assert model_config.architecture is not None  # guaranteed by ModelConfig's validator
        return transformers_config(model_config.architecture)
    from huggingface_hub import is_offline_mode
    from transformers import AutoConfig

    name = model_config.name_or_path
    try:
        return AutoConfig.from_pretrained(
            name, revision=model_config.revision, token=os.environ.get(model_config.token_env) or None
        )
    except (OSError, ValueError) as error:  # transformers' own
        if Path(name).is_dir():
            raise ConfigError(
                f"model directory {name}: transformers cannot read its config ({one_line(error)})"
            ) from error
        hint = hub_miss(name, model_config.token_env, offline=is_offline_mode())
        raise ConfigError(f"cannot read the model's config: {hint}: {one_line(error)}") from error


LINEAR_ATTENTION = "linear_attention"
"""The ``layer_types`` entry of a linear-attention layer (Qwen3.5's and Qwen3-Next's Gated DeltaNet)."""


def packing_problem(config: TrainerConfig, hf_config: Any) -> str | None:
    """One line when packed documents would leak into one another: a linear-attention layer carries its
    state (and its short convolution) along the whole row unless given the documents' boundaries, which
    ``transformers`` hands only to flash-linear-attention's kernels (the trainer passes them with flash
    attention); its pure-PyTorch fallback cannot keep them apart. None otherwise."""
    if not config.data.packing or LINEAR_ATTENTION not in (getattr(hf_config, "layer_types", None) or ()):
        return None
    if config.training.attention == Attention.FLASH and importlib.util.find_spec("fla") is not None:
        return None
    return (
        f"data.packing: the linear-attention layers of {model_class(hf_config).__name__} would carry their state "
        "from one packed document into the next (only flash-linear-attention keeps them apart, with "
        "training.attention flash): set data.packing false"
    )


def model_class_problem(config: TrainerConfig, hf_config: Any) -> str | None:
    """What the model class of ``hf_config`` cannot do that the config asks for (the attention kernel,
    packing, the heads' split over sequence-parallel ranks), in one line; None when nothing."""
    from memfit_trainer.sequence_parallel import heads_problem  # it imports this module (through the run)

    training = config.training
    problems = [
        p
        for p in (
            attention_problem(hf_config, training.attention),
            packing_problem(config, hf_config),
            heads_problem(training.sequence_parallel, hf_config),
        )
        if p
    ]
    return "; ".join(problems) or None


def check_model_class(config: TrainerConfig, hf_config: Any) -> None:
    """ConfigError (exit 2) when ``transformers`` has no causal LM for the model, or that class cannot do what
    the config asks for (:func:`model_class_problem`)."""
    problem = model_class_problem(config, hf_config)
    if problem is not None:
        raise ConfigError(problem)


def checked_config(config: TrainerConfig) -> Any:
    """The model's ``PretrainedConfig``, refused (ConfigError) when it is not the planned shape or its class
    cannot do what the config asks: before any weights load (and before torchrun: memfit_trainer.launch_check)."""
    hf_config = pretrained_config(config.model)
    check_planned_shape(config.model, hf_config)
    check_model_class(config, hf_config)
    return hf_config


def _load_base(config: TrainerConfig, local_rank: int) -> Any:
    """The base model, randomly initialised (seeded: identical on every rank and every restart) or loaded."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from memfit_trainer.sequence_parallel import attn_implementation  # it imports this module (through the run)

    model_config, training = config.model, config.training
    kwargs: dict[str, Any] = {
        "dtype": torch.bfloat16 if training.method == Method.QLORA else DTYPES[training.precision],
        "attn_implementation": attn_implementation(training.attention, training.sequence_parallel)
        or ATTN_IMPLEMENTATION[training.attention],  # flash-attn presence: see preflight
    }
    hf_config = checked_config(config)
    if model_config.random_init:
        torch.manual_seed(training.seed)
        # transformers' from_config is unannotated (the type: ignores on it below).
        if training.method != Method.QLORA:
            return AutoModelForCausalLM.from_config(hf_config, **kwargs)  # type: ignore[no-untyped-call]
        # bitsandbytes quantises only while loading weights: write the random model out and load it back.
        # (Not with save_pretrained: under torch.distributed it writes on rank 0 only, and this is per rank.)
        with tempfile.TemporaryDirectory(prefix="memfit-random-init-") as scratch:
            hf_config.to_json_file(os.path.join(scratch, "config.json"))
            save_model(
                AutoModelForCausalLM.from_config(hf_config, **kwargs),  # type: ignore[no-untyped-call]
                os.path.join(scratch, "model.safetensors"),
            )
            return AutoModelForCausalLM.from_pretrained(
                scratch,
                quantization_config=quantization_config(config.engine.kind),
                device_map=_device_map(config, local_rank),
                **kwargs,
            )
    if training.method == Method.QLORA:
        kwargs.update(
            quantization_config=quantization_config(config.engine.kind), device_map=_device_map(config, local_rank)
        )
    return AutoModelForCausalLM.from_pretrained(
        model_config.name_or_path,
        revision=model_config.revision,
        token=os.environ.get(model_config.token_env) or None,
        **kwargs,
    )


def check_planned_shape(model_config: ModelConfig, loaded: Any = None) -> None:
    """ConfigError (exit 2) when the model to load is not the shape the plan was made for: its config, as
    ``transformers`` resolves it (class defaults filled in; ``loaded`` where already read), is compared
    before any weights load. A config without a typed architecture plans no shape: nothing to compare."""
    if model_config.random_init or (model_config.architecture is None and model_config.planned_fields is None):
        return
    if loaded is None:
        loaded = pretrained_config(model_config)
    if model_config.planned_fields is not None:
        problem = fields_mismatch(model_config.planned_fields, loaded.to_dict(), model_config.name_or_path)
    else:
        assert model_config.architecture is not None
        problem = shape_mismatch(model_config.architecture, loaded.to_dict(), model_config.name_or_path)
    if problem is not None:
        raise ConfigError(problem)


def peft_lora_config(lora: LoraConfig, model: Any) -> Any:
    """peft's ``LoraConfig`` for the config's ``training.lora`` section (causal-LM adapters) on ``model``:
    ``all-linear`` leaves out the linears whose adapters could not train (:func:`not_plain_linears`) and those
    peft refuses to wrap in this model (:func:`refused_by_peft`)."""
    from peft import LoraConfig as PeftLoraConfig

    all_linear = lora.target_modules == [ALL_LINEAR]
    targets: str | list[str] = ALL_LINEAR if all_linear else list(lora.target_modules)
    # peft annotates lora_alpha as int, but it only divides it by r: a float alpha is used as given.
    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]
        lora_dropout=lora.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    if all_linear:
        config.exclude_modules = not_plain_linears(model) + refused_by_peft(config, model) or None
    return config


def refused_by_peft(config: Any, model: Any) -> list[str]:
    """The modules ``all-linear`` resolves to (peft's own resolution) that peft refuses to adapt in this model:
    it refuses LoRA on the ``out_proj`` of some Mamba models' mixers, raising where ``all-linear`` reaches it (its
    ``_check_lora_target_modules_mamba``, asked here of each module). Nothing where the peft installed has no
    such check."""
    from peft.tuners import tuners_utils

    check = getattr(tuners_utils, "_check_lora_target_modules_mamba", None)
    if check is None:
        return []
    resolved: Any = tuners_utils._maybe_include_all_linear_layers(copy.copy(config), model)
    refused = []
    for name in sorted(resolved.target_modules):
        try:
            check(config, model, name.rpartition(".")[2])
        except ValueError:
            refused.append(name)
    return refused


def adapted(model: Any, config: Any) -> Any:
    """peft's model of ``config``'s adapters on ``model``; a ConfigError in one line where peft cannot build them
    (a target it refuses in this model, or one the model does not have)."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, config)
    except ValueError as error:  # peft's own refusals
        raise ConfigError(f"lora.targetModules: peft cannot build these adapters: {one_line(error)}") from error


def not_plain_linears(model: Any) -> list[str]:
    """The model's own ``nn.Linear`` subclasses with a forward of their own that does not compute as a linear layer
    (:func:`computes_as_linear`: Llama 4's router returns a tuple, DeepSeek-V4's grouped projection maps each group
    of its input on its own): peft's ``all-linear`` would wrap them and its ``lora.Linear`` adds ``x A B`` to what
    they return, so they keep no adapter (Falcon's ``FalconLinear`` keeps its adapters). Only classes of the
    model's code count: bitsandbytes' 4-bit layers are ``nn.Linear`` subclasses peft adapts."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and type(module).forward is not torch.nn.Linear.forward
        and type(module).__module__.startswith("transformers.")
        and not computes_as_linear(module)
    ]


def computes_as_linear(linear: torch.nn.Linear) -> bool:
    """Whether the module's own forward maps a batch of rows of its ``in_features`` to one tensor of rows of its
    ``out_features``, as ``nn.Linear`` does: run on the meta device, its weight and bias standing in by meta
    tensors of their shapes (whatever device, or partitioning, the module's own are on)."""
    rows = (2, 3)
    stand_ins = {"weight": torch.empty(linear.out_features, linear.in_features, device="meta")}
    if linear.bias is not None:
        stand_ins["bias"] = torch.empty(linear.out_features, device="meta")
    try:
        out = torch.func.functional_call(linear, stand_ins, (torch.empty(*rows, linear.in_features, device="meta"),))
    except Exception:  # the model's own forward refusing a plain batch of rows, whatever it raises
        return False
    return isinstance(out, torch.Tensor) and tuple(out.shape) == (*rows, linear.out_features)


def trains_adapters(method: Method) -> bool:
    """LoRA and QLoRA: only the adapters are trained, checkpointed and exported; the base stays frozen as built."""
    return method in (Method.LORA, Method.QLORA)


def build_model(config: TrainerConfig, local_rank: int = 0) -> BuiltModel:
    """The trainable model (with adapters for LoRA/QLoRA) and its tokenizer, ready for ``deepspeed.initialize``."""
    training = config.training
    tokenizer = build_tokenizer(config)
    zero3_context = None
    deepspeed = config.engine
    if isinstance(deepspeed, DeepSpeedEngineSection) and deepspeed.zero_stage == 3 and training.method != Method.QLORA:
        from transformers.integrations.deepspeed import HfDeepSpeedConfig

        # From here on, models are built partitioned. (HfDeepSpeedConfig.__init__ is unannotated.) zero.Init has no
        # mpu: its batch-size check counts data ranks by the config's sequence-parallel size.
        sp = {"sequence_parallel_size": training.sequence_parallel} if training.sequence_parallel > 1 else {}
        zero3_context = HfDeepSpeedConfig({**deepspeed.config, **sp})  # type: ignore[no-untyped-call]
    model = _load_base(config, local_rank)
    model.train()  # from_pretrained returns it in eval mode: no dropout, and bitsandbytes' CPU inference repacking
    model.config.use_cache = False  # the KV cache is for generation; in training it only costs memory
    if training.method == Method.FULL:
        if training.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CHECKPOINTING)
        return BuiltModel(model=model, tokenizer=tokenizer, zero3_context=zero3_context)
    model = with_adapters(model, training.lora, DTYPES[training.precision], training.gradient_checkpointing)
    return BuiltModel(model=model, tokenizer=tokenizer, zero3_context=zero3_context)


CHECKPOINTING = {"use_reentrant": False}
"""Non-reentrant activation checkpointing (what the activation model counts)."""


def with_adapters(model: Any, lora: LoraConfig, dtype: torch.dtype, gradient_checkpointing: bool) -> Any:
    """The peft model of LoRA's adapters on ``model``: its base frozen (:func:`prepare_adapter_base`), the adapters
    in ``dtype`` (:func:`cast_trainable`). Also what the activation profiler traces (on a meta-device model)."""
    wrapped = adapted(prepare_adapter_base(model, gradient_checkpointing), peft_lora_config(lora, model))
    cast_trainable(wrapped, dtype)
    return wrapped


def prepare_adapter_base(model: Any, gradient_checkpointing: bool) -> Any:
    """LoRA's and QLoRA's base model, ready for the adapters: every base parameter frozen, and with gradient
    checkpointing (non-reentrant) the embedding's output made to require grad, as ``transformers``' own
    ``enable_input_require_grads`` does for a frozen embedding (the reentrant variant needs it; the activation
    model counts the embedding output's gradient it makes at the end of the backward pass).

    This replaces peft's ``prepare_model_for_kbit_training`` for QLoRA, which does the same and also upcasts
    every parameter that is not 4-bit (embeddings, LM head, norms, biases) to fp32. That upcast bought
    nothing here: DeepSpeed's bf16 engine casts them back to bf16 at ``initialize`` (its fp32 masters are of
    the adapters only), and with bf16 masters at ZeRO-0 nothing would, leaving them fp32 through training.
    What it cost was a GPU peak at start-up above the steady state: 4 bytes per such parameter instead of 2
    until DeepSpeed cast them back (4.2 GB instead of 2.1 GB for Llama 3.1 8B's untied 128k-vocabulary
    embedding and head), which the plan does not count. Like torchtune's and Unsloth's QLoRA, the
    non-quantized parameters stay in the compute dtype (bf16) from loading on; bitsandbytes' 4-bit layers
    still compute in bf16 (``bnb_4bit_compute_dtype``) and RMSNorm still normalises in fp32 internally."""
    for param in model.parameters():
        param.requires_grad_(False)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CHECKPOINTING)
        model.enable_input_require_grads()
    return model


def cast_trainable(model: Any, dtype: torch.dtype) -> None:
    """Cast the adapters to the compute dtype (peft makes them fp32 over a 16-bit base). DeepSpeed's bf16 and
    fp16 engines would do the same at ``initialize`` (keeping fp32 masters in their optimizer); with bf16
    master weights at ZeRO-0 DeepSpeed casts nothing, and the optimizer updates these bf16 adapters."""
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
