"""``memfit profile MODEL``: the parameters a model's own ``transformers`` code builds, by role and layer type.

The core cannot import torch or transformers, so the trainer package builds the model on the meta device in
a subprocess (``python -m memfit_trainer.profile``) and prints a ``memfit.profile.ModelProfile`` as JSON; this
module renders it (or passes the JSON through with ``-o json``). MODEL is a directory holding config.json,
a config.json, or the name of a config memfit stores (``memfit.catalog.model_configs``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from memfit.catalog.model_configs import stored_config_path
from memfit.cli.exit_codes import ExitCode
from memfit.cli.model_profiles import ProfileFailed, make_profile
from memfit.profile import ActivationProfile, ActivationTerm, LoraModules, ModelProfile

BILLION = 1e9


def _model_path(model: str) -> Path:
    """A stored config's file when ``model`` names one and is no path here, else the path as given."""
    path = Path(model)
    stored = stored_config_path(model)
    return stored if stored is not None and not path.exists() else path


def _billions(count: int) -> str:
    return f"{count / BILLION:.3f}B" if count >= BILLION / 1000 else f"{count:,}"


def profile_table(profile: ModelProfile) -> Table:
    """Parameters by role and layer type, with their tensors' shapes and whether bitsandbytes quantizes them."""
    table = Table(title=f"{profile.architecture} ({profile.model_type})", title_justify="left")
    for column in ("role", "layer type", "layers", "parameters", "4-bit"):
        table.add_column(column, justify="left" if column in ("role", "layer type") else "right")
    for (role, layer_type), count in profile.parameters_by().items():
        groups = [g for g in profile.tensors if g.role is role and g.layer_type == layer_type]
        layers = len({layer for group in groups for layer in group.layers})
        quantized = sum(group.numel for group in groups if group.quantizable)
        share = f"{quantized / count:.0%}" if count else "-"
        table.add_row(role.value, layer_type or "-", str(layers or "-"), _billions(count), share)
    table.add_section()
    quantized_share = profile.quantizable_parameters / profile.total_parameters
    table.add_row("total", "", str(profile.num_layers), _billions(profile.total_parameters), f"{quantized_share:.0%}")
    return table


def _print_text(profile: ModelProfile, console: Console) -> None:
    console.print(profile_table(profile))
    layer_counts = {kind: profile.layer_types.count(kind) for kind in dict.fromkeys(profile.layer_types)}
    facts = {
        "layers": ", ".join(f"{count} {kind}" for kind, count in layer_counts.items()),
        "hidden size / vocab": f"{profile.hidden_size} / {profile.vocab_size:,}",
        "sliding window": str(profile.sliding_window or "-"),
        "tied embeddings": "yes" if profile.tie_word_embeddings else "no",
        "attention kernels": ", ".join(profile.attention_kernels),
        "config sha256": profile.config_sha256,
    }
    if profile.experts is not None:
        experts = profile.experts
        facts["experts"] = (
            f"{experts.num_experts}, {experts.experts_per_token} per token, in {len(experts.layers)} layers"
        )
    for resolution in profile.lora:
        targets = resolution.target_modules
        label = targets if isinstance(targets, str) else ",".join(targets)
        suffixes = dict.fromkeys(_lora_label(group) for group in resolution.modules)
        facts[f"LoRA {label}"] = f"{len(resolution.names())} modules: {', '.join(suffixes) or 'none'}"
    if profile.activations is not None:
        facts.update(_activation_facts(profile.activations))
    for key, value in facts.items():
        console.print(f"{key}: {value}", highlight=False, markup=False)


def _activation_facts(activations: ActivationProfile) -> dict[str, str]:
    """One line per traced term of each setup (full fine-tuning, LoRA; the terms outside the layers with the model's
    loss and with the chunked loss): bytes per token, per token squared (up to the window), and constant."""
    lora = f"lora r{activations.lora_rank} dropout {activations.lora_dropout:g}"
    traced_setups = {
        "full": activations.full,
        "full, checkpointed": activations.full_checkpointed,
        lora: activations.lora,
        f"{lora}, checkpointed": activations.lora_checkpointed,
    }
    setups = {name: terms for name, terms in traced_setups.items() if terms is not None}
    facts = {}
    if activations.lora_failure is not None:
        facts[f"activations ({lora})"] = f"cannot train: {activations.lora_failure}"
    for setup, traced in setups.items():
        losses = {"": traced.outside, ", chunked loss": traced.chunked_loss}
        terms = {
            f"{name}{loss}": term
            for loss, outside in losses.items()
            if outside is not None
            for name, term in (
                ("outside layers", outside.outside_layers),
                ("loss backward", outside.loss_backward),
                ("outside, in the layers' backward", outside.outside_backward),
            )
        }
        for layer in traced.layers:
            terms[f"{layer.layer_type} ({layer.attention}) saved"] = layer.saved
            terms[f"{layer.layer_type} ({layer.attention}) backward"] = layer.backward_peak
        facts.update({f"activations ({setup}), {name}": _term(term) for name, term in terms.items()})
    return facts


def _term(term: ActivationTerm) -> str:
    window = f"T·min(T, {term.window})" if term.window else "T²"
    text = f"{term.per_token:g}·T + {term.per_token_squared:g}·{window} + {term.constant:g} bytes"
    return text if term.exact else f"{text} (not exact: use the measured points)"


def _lora_label(group: LoraModules) -> str:
    """``self_attn.q_proj``, or ``mlp.experts.gate_up_proj`` for a fused parameter peft wraps in place."""
    module = group.name.rpartition("*.")[2].removesuffix(".base_layer")
    return f"{module}.{group.parameter}" if group.parameter else module


def run_profile(model: str, output: str, lora_targets: list[str], activations: bool = False) -> int:
    try:
        text = make_profile(_model_path(model), lora_targets, activations)
    except ProfileFailed as error:
        print(f"memfit profile: error: {error}", file=sys.stderr)
        return error.exit_code
    if output == "json":
        print(text)
    else:
        _print_text(ModelProfile.model_validate_json(text), Console(soft_wrap=True))
    return ExitCode.OK
