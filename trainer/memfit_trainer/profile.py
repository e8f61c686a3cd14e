"""Build a model from its config.json on the meta device and record its profile (``memfit.profile``).

A model is what its own code says: rather than a per-family formula, ``AutoModelForCausalLM.from_config``
builds the model under ``torch.device("meta")`` (no memory, no weights, no download) and every parameter
tensor is classified by role and decoder-layer type. What bitsandbytes 4-bit would quantize and what LoRA
would wrap come from transformers' and peft's own rules, applied to the same meta model.

``python -m memfit_trainer.profile PATH [-o json] [--lora-targets q_proj,v_proj] [--activations]`` prints the
profile as JSON (``memfit profile`` renders it; ``--activations`` adds the traced activation terms of
``memfit_trainer.activation_profile``); bad input exits 2 with one line. ``--hub`` reads PATH as a Hugging Face
Hub repository id (its config.json only, with ``HF_TOKEN`` where set). ``--termination-log FILE`` (the
operator's profiling pod) also writes the profile to FILE as ``memfit.contract.profile_message`` encodes it,
or on bad input the one line as a ConfigError termination message (``memfit.contract.termination``).
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memfit.api.vocabulary import ATTN_IMPLEMENTATION, Attention, TerminationReason
from memfit.contract.lifetime import end_with_launcher
from memfit.contract.profile_message import ProfileMessageError, encode_profile_message
from memfit.contract.reader import ConfigError
from memfit.contract.sections import LoraConfig
from memfit.contract.termination import fitted_message, one_line, write_termination_message
from memfit.profile import (
    ActivationProfile,
    Experts,
    LoraModules,
    LoraResolution,
    ModelProfile,
    Role,
    TensorGroup,
    canonical_config_sha256,
)
from memfit_trainer.activation_profile import (
    MESSAGE_LENGTH,
    ProfileError,
    activation_profile,
    decoder_layers_prefix,
    transformers_fields,
)
from memfit_trainer.model import adapted, peft_lora_config
from memfit_trainer.trace_workers import default_workers, start_early

EXIT_BAD_INPUT = 2
ALL_LINEAR = "all-linear"
FULL_ATTENTION = "full_attention"
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "top_k_experts", "experts_per_token")
KERNEL_FLAGS = (
    ("_supports_sdpa", ATTN_IMPLEMENTATION[Attention.SDPA]),
    ("_supports_flash_attn", ATTN_IMPLEMENTATION[Attention.FLASH]),
    ("_supports_flex_attn", ATTN_IMPLEMENTATION[Attention.FLEX]),
)


def read_config(path: Path) -> dict[str, Any]:
    """The config.json at ``path`` (a directory holding one, or the file itself)."""
    if not path.exists():
        raise ProfileError(f"{path}: no such file or directory")
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ProfileError(f"{path}: no config.json in this directory")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ProfileError(f"{file}: not JSON: {error}") from error
    if not isinstance(config, dict):
        raise ProfileError(f"{file}: not a JSON object")
    return config


def read_hub_config(repo_id: str) -> dict[str, Any]:
    """The config.json of a Hub repository (nothing else is downloaded); ``HF_TOKEN`` is used where set."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    # Subclasses first: no local copy offline is an EntryNotFoundError too, a gated repository a missing one.
    try:
        file = hf_hub_download(repo_id, "config.json")
    except GatedRepoError as error:
        raise ProfileError(f"{repo_id}: the Hub refuses access to this gated repository without a token that has "
                           "it (set model.source.tokenSecretRef)") from error  # fmt: skip
    except RepositoryNotFoundError as error:
        raise ProfileError(f"{repo_id}: no such Hub repository, or a private one this token cannot read "
                           "(model.source.tokenSecretRef)") from error  # fmt: skip
    except (OfflineModeIsEnabled, LocalEntryNotFoundError) as error:
        raise ProfileError(f"{repo_id}: cannot reach the Hub to read config.json (offline, or no network from "
                           "this pod)") from error  # fmt: skip
    except EntryNotFoundError as error:
        raise ProfileError(f"{repo_id}: the Hub repository has no config.json") from error
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise ProfileError(f"{repo_id}: reading config.json from the Hub failed: {_reason(error)}") from error
    return read_config(Path(file))


def build_meta_model(config: dict[str, Any]) -> Any:
    """The model ``AutoModelForCausalLM`` builds from this config, its parameters on the meta device; a
    ProfileError in one line where transformers cannot build it, or builds no decoder-only causal LM."""
    import torch
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ProfileError("config.json: no model_type")
    if model_type not in CONFIG_MAPPING:
        raise ProfileError(f"config.json: unknown model_type {model_type!r} (this transformers has no such model)")
    auto_model: Any = AutoModelForCausalLM  # untyped classmethods
    try:
        hf_config = AutoConfig.for_model(**config)
    except Exception as error:  # transformers refusing the config, whatever it raises
        raise _refusal(model_type, error) from error
    if getattr(hf_config, "is_encoder_decoder", False):
        raise ProfileError(
            f"config.json: {model_type} is an encoder-decoder model: its causal LM in transformers is the decoder "
            "alone, without the encoder it was made for; memfit plans decoder-only language models"
        )
    try:
        with torch.device("meta"):
            model = auto_model.from_config(hf_config)
    except Exception as error:  # the model's own code failing on its config, whatever it raises
        raise _refusal(model_type, error) from error
    return model


def _refusal(model_type: str, error: Exception) -> ProfileError:
    """The one line for transformers failing to read or build a config: a package it needs, its refusal of the
    config, or what its model code raised."""
    from huggingface_hub.errors import StrictDataclassError

    if isinstance(error, ImportError):
        return ProfileError(
            f"config.json: building this {model_type} model needs a package not installed: {_reason(error)}"
        )
    if isinstance(error, (ValueError, TypeError, StrictDataclassError)):
        return ProfileError(f"config.json: transformers refuses this {model_type} config: {_reason(error)}")
    reason = f"{type(error).__name__}: {_reason(error)}"
    return ProfileError(f"config.json: transformers cannot build this {model_type} model: {reason}")


def _reason(error: BaseException) -> str:
    """A library's exception message, on one line and cut to :data:`MESSAGE_LENGTH` characters."""
    return one_line(error)[:MESSAGE_LENGTH]


def layer_role(path: str, classes: list[str]) -> Role:
    """A decoder layer's tensor, by the path inside the layer and the classes of the modules along it."""
    parts = path.split(".")[:-1]
    if len(parts) == 1 and "Norm" in classes[-1]:
        return Role.NORM
    if parts and parts[0].endswith(("attn", "attention")):
        return Role.ATTENTION
    if any(part in ("router", "gate") for part in parts) or any("Router" in cls for cls in classes):
        return Role.ROUTER
    if any("expert" in part and "shared_expert" not in part for part in parts):
        return Role.EXPERTS
    if parts and parts[0] in ("mlp", "feed_forward", "block_sparse_moe", "moe"):
        return Role.MLP
    return Role.OTHER


def outer_role(module: Any, model: Any, decoder: Any) -> Role:
    """A tensor outside the decoder layers: embeddings, LM head, the decoder's final norm, or something else."""
    if module is model.get_input_embeddings():
        return Role.EMBEDDING
    if module is model.get_output_embeddings():
        return Role.LM_HEAD
    if module is getattr(decoder, "norm", None):
        return Role.FINAL_NORM
    return Role.OTHER


def quantized_module_names(model: Any) -> set[str]:
    """The modules bitsandbytes 4-bit replaces, by transformers' own rule (``replace_with_bnb_linear``)."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = get_keys_to_not_convert(model) + list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return {
        name
        for name, module in model.named_modules()
        if (isinstance(module, Conv1D) or type(module) is nn.Linear) and should_convert_module(name, skip)
    }


def lora_resolution(model: Any, target_modules: str | tuple[str, ...], prefix: str) -> LoraResolution:
    """The modules peft's LoRA wraps for ``target_modules``: peft itself injects them into a copy of the meta model.

    Injecting rather than matching names keeps every rule peft applies: ``all-linear`` leaving out the output
    embeddings, and peft 0.21 targeting transformers 5's fused expert parameters through ``ParamWrapper``
    (its v4-to-v5 MoE conversion), which no name match over ``nn.Linear`` modules would find.
    """
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    config = peft_lora_config(LoraConfig(target_modules=targets, dropout=0.0), model)  # in place: no dropout
    # The adapters made on the meta device too: peft would otherwise allocate and initialise each on the CPU
    # (seconds for a 70B model) before moving it to its base layer's meta device; only their shapes are read.
    try:
        with torch.device("meta"):
            wrapped: Any = adapted(copy.deepcopy(model), config)
    except ConfigError as error:  # what the trainer's with_adapters refuses alike
        raise ProfileError(str(error)) from error
    groups: dict[tuple[str, str | None, int, int, int], list[int]] = {}
    for name, module in wrapped.base_model.model.named_modules():
        if isinstance(module, BaseTunerLayer):
            pattern, layer = _layer_pattern(name, prefix)
            lora_a: Any = module.lora_A  # type: ignore[attr-defined]  # a LoraLayer's adapters
            rows = next(iter(lora_a.values())).out_features
            key = (pattern, getattr(module, "parameter_name", None), *_features(module), rows // config.r)
            groups.setdefault(key, []).extend([] if layer is None else [layer])
    modules = tuple(
        LoraModules(
            name=name,
            parameter=parameter,
            layers=tuple(layers),
            in_features=fan_in,
            out_features=fan_out,
            rank_multiple=multiple,
        )
        for (name, parameter, fan_in, fan_out, multiple), layers in groups.items()
    )
    return LoraResolution(target_modules=target_modules, modules=modules)


def _features(layer: Any) -> tuple[int, int]:
    """A LoRA layer's base in and out features (per expert for a fused parameter)."""
    return int(layer.in_features), int(layer.out_features)


def _layer_pattern(name: str, prefix: str) -> tuple[str, int | None]:
    match = re.match(rf"{re.escape(prefix)}\.(\d+)(\.|$)", name)
    if match is None:
        return name, None
    return f"{prefix}.*{name[match.end(1) :]}", int(match.group(1))


def _classes_along(model: Any, path: str) -> list[str]:
    classes, module = [], model
    for part in path.split(".")[:-1]:
        module = getattr(module, part)
        classes.append(type(module).__name__)
    return classes


def tensor_groups(model: Any, prefix: str, layer_types: Sequence[str]) -> tuple[TensorGroup, ...]:
    """Every parameter tensor, grouped by name (layer index as ``*``), shape and layer type."""
    quantized = quantized_module_names(model)
    decoder = model.get_submodule(prefix.rpartition(".")[0])
    groups: dict[tuple[str, tuple[int, ...], str | None], dict[str, Any]] = {}
    for name, parameter in model.named_parameters():
        module_name, _, attribute = name.rpartition(".")
        pattern, layer = _layer_pattern(name, prefix)
        module = model.get_submodule(module_name) if module_name else model
        if layer is None:
            role, layer_type = outer_role(module, model, decoder), None
        else:
            inner = name[len(f"{prefix}.{layer}.") :]
            role = layer_role(inner, _classes_along(model.get_submodule(f"{prefix}.{layer}"), inner))
            layer_type = layer_types[layer]
        shape = tuple(parameter.shape)
        group = groups.setdefault((pattern, shape, layer_type), {"role": role, "layers": []})
        group["quantizable"] = attribute == "weight" and module_name in quantized
        if layer is not None:
            group["layers"].append(layer)
    return tuple(
        TensorGroup(
            name=pattern,
            role=group["role"],
            shape=shape,
            layer_type=layer_type,
            layers=tuple(group["layers"]),
            count=max(1, len(group["layers"])),
            quantizable=group["quantizable"],
        )
        for (pattern, shape, layer_type), group in groups.items()
    )


def experts_of(text_config: Any, model: Any, prefix: str) -> Experts | None:
    """Expert count and experts per token from the config; the routing layers from the built model."""
    values = text_config.to_dict()
    count = next((values[key] for key in EXPERT_COUNT_KEYS if values.get(key)), None)
    per_token = next((values[key] for key in EXPERTS_PER_TOKEN_KEYS if values.get(key)), None)
    if count is None or per_token is None:
        return None
    routed = {
        layer
        for name, _ in model.named_modules()
        if name.endswith(".experts") and (layer := _layer_pattern(name, prefix)[1]) is not None
    }
    return Experts(num_experts=count, experts_per_token=per_token, layers=tuple(sorted(routed))) if routed else None


def attention_widths(text_config: Any, layer_types: Sequence[str] = ()) -> dict[str, int]:
    """Heads, key-value heads and head width of the text config's full-attention layers (``head_dim`` where it
    names one, else ``hidden_size // num_attention_heads``; key-value heads default to the heads, as without
    GQA). A config whose layers differ (Gemma 4's wider full-attention heads) is read at its first
    full-attention layer (``per_layer_config``), or its first layer where none is. A model without attention
    (no ``num_attention_heads``) is one head as wide as its hidden state: nothing for sequence parallelism,
    which splits heads, to divide."""
    per_layer = getattr(text_config, "per_layer_config", None)
    source = text_config
    if per_layer:
        source = per_layer[list(layer_types).index(FULL_ATTENTION) if FULL_ATTENTION in layer_types else 0]
    if getattr(source, "num_attention_heads", None) is None:  # no attention: Mamba, RWKV
        return {"num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": int(text_config.hidden_size)}
    heads = int(source.num_attention_heads)
    kv_heads = getattr(source, "num_key_value_heads", None)
    head_dim = getattr(source, "head_dim", None)
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": heads if kv_heads is None else int(kv_heads),
        "head_dim": int(text_config.hidden_size) // heads if head_dim is None else int(head_dim),
    }


def profile(
    config: dict[str, Any], lora_targets: Sequence[tuple[str, ...]] = (), activations: bool = False
) -> ModelProfile:
    """The profile of the model this config.json describes (built on the meta device), with its traced
    activation terms if asked (off by default: tens of seconds for a full-size config)."""
    fields = transformers_fields(config)
    model = build_meta_model(fields)
    text = decoder_config(model)
    num_layers = int(text.num_hidden_layers)
    layer_types = tuple(getattr(text, "layer_types", None) or [FULL_ATTENTION] * num_layers)
    prefix = decoder_layers_prefix(model, num_layers)
    check_causal(model, prefix)
    tensors = tensor_groups(model, prefix, layer_types)
    built = sum(parameter.numel() for parameter in model.parameters())
    if sum(group.numel for group in tensors) != built:
        raise AssertionError(f"the inventory sums to {sum(g.numel for g in tensors)}, the model has {built}")
    uses_window = any(kind == "sliding_attention" for kind in layer_types)
    resolved: list[str | tuple[str, ...]] = [ALL_LINEAR, *lora_targets]
    kernels = ("eager", *(kernel for flag, kernel in KERNEL_FLAGS if getattr(type(model), flag, False)))
    return ModelProfile(
        config_sha256=canonical_config_sha256(config),
        model_type=str(config["model_type"]),
        architecture=type(model).__name__,
        hidden_size=int(text.hidden_size),
        vocab_size=int(text.vocab_size),
        num_layers=num_layers,
        **attention_widths(text, layer_types),
        layer_types=layer_types,
        sliding_window=getattr(text, "sliding_window", None) if uses_window else None,
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        experts=experts_of(text, model, prefix),
        attention_kernels=kernels,
        tensors=tensors,
        lora=tuple(lora_resolution(model, targets, prefix) for targets in resolved),
        activations=traced_activations(fields, model) if activations else None,
    )


def check_causal(model: Any, prefix: str) -> None:
    """ProfileError where the decoder layers' modules say they attend both ways (their ``is_causal`` and
    ``is_decoder`` flags all false: BERT's and BigBird's layers unless their config makes them a decoder): an
    encoder, into which a causal LM's labels would leak."""
    flags = {
        f"{type(module).__name__}.{flag}": value
        for module in model.get_submodule(prefix).modules()
        for flag in ("is_causal", "is_decoder")
        if isinstance(value := getattr(module, flag, None), bool)
    }
    if flags and not any(flags.values()):
        raise ProfileError(
            f"config.json: {type(model).__name__} is an encoder, not a causal language model: its layers attend "
            f"both ways ({', '.join(sorted(flags))} false)"
        )


def decoder_config(model: Any) -> Any:
    """The config of the model's text decoder; a ProfileError where none states its width, depth and vocabulary
    (Byte Latent Transformer's byte-level encoder, decoder and latent transformer each state their own)."""
    try:
        text = model.config.get_text_config()
    except ValueError as error:  # transformers finds several
        raise ProfileError(f"config.json: cannot tell the text decoder's config: {_reason(error)}") from error
    missing = [field for field in ("hidden_size", "num_hidden_layers", "vocab_size") if not hasattr(text, field)]
    if missing:
        raise ProfileError(
            f"config.json: the text config of {type(model).__name__} ({type(text).__name__}) states no "
            f"{', '.join(missing)}: memfit cannot tell its decoder's shape"
        )
    return text


def traced_activations(config: dict[str, Any], model: Any) -> ActivationProfile:
    """The activation terms :func:`~memfit_trainer.activation_profile.activation_profile` traces; a ProfileError
    in one line where a training step of full fine-tuning, which every plan needs, fails in the model's own code
    (a failing LoRA step only leaves LoRA unplanned: ``lora_failure``). A trace worker that died (killed, out of
    memory) is no fault of the model's: that error goes on as raised."""
    from concurrent.futures.process import BrokenProcessPool

    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        return activation_profile(config)
    except (ProfileError, BrokenProcessPool):
        raise
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise ProfileError(
            f"{type(model).__name__}: its code reads the values of tensors ({type(error).__name__}: {error}), "
            "which a trace on fake tensors cannot know"
        ) from error
    except Exception as error:  # the model's own code on fake tensors, whatever it raises
        reason = f"{type(error).__name__}: {_reason(error)}"
        raise ProfileError(f"{type(model).__name__}: a traced training step fails in its own code: {reason}") from error


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memfit_trainer.profile")
    parser.add_argument("path", help="a directory holding config.json, the config.json, or with --hub a Hub id")
    parser.add_argument("-o", "--output", choices=("json",), default="json", help="output format (JSON only)")
    parser.add_argument(
        "--lora-targets", action="append", default=[], metavar="NAMES", help="comma-separated target_modules"
    )
    parser.add_argument("--activations", action="store_true", help="also trace activation bytes per layer type")
    parser.add_argument("--hub", action="store_true", help="PATH is a Hugging Face Hub repository id")
    parser.add_argument(
        "--termination-log",
        metavar="FILE",
        help="also write the profile (base64 of the xz-compressed JSON) or the one-line error to FILE (a pod's "
        "termination message)",
    )
    args = parser.parse_args(argv)
    try:
        targets = [tuple(names.split(",")) for names in args.lora_targets]
        config = read_hub_config(args.path) if args.hub else read_config(Path(args.path))
        if args.activations:
            start_early(default_workers())  # the trace workers' imports beside building the model
        result = profile(config, targets, args.activations)
        message = encode_profile_message(result) if args.termination_log else None
    except (ProfileError, ProfileMessageError) as error:
        if args.termination_log:
            refusal = fitted_message({"reason": TerminationReason.CONFIG_ERROR}, str(error))
            write_termination_message(refusal, args.termination_log)
        print(f"memfit profile: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if message is not None:
        write_termination_message(message, args.termination_log)
    print(result.model_dump_json())
    return 0


if __name__ == "__main__":
    end_with_launcher()  # started by memfit (memfit.cli.model_profiles): ends with it, kill -9 included
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends it at once, as SIGTERM does; its workers end with it
    sys.exit(main())
