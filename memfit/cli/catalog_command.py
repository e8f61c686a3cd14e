"""``memfit presets``: what ``architecture.preset`` (formula presets and profiled ones) and ``gpuProduct`` accept."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from memfit.api.vocabulary import Method
from memfit.catalog.gpus import GPU_PRODUCTS
from memfit.catalog.model_configs import stored_profile, stored_profile_names
from memfit.catalog.models import MODEL_PRESETS
from memfit.profiled_model import ProfiledModel


def profiled_presets() -> Table:
    """The stored configs' profiles: presets planned from the model's own code."""
    table = Table(title="Profiled presets (architecture.preset, planned from a stored profile)", title_justify="left")
    for column in ("preset", "model_type", "parameters", "active", "layers", "LoRA"):
        table.add_column(column, justify="right" if column in ("parameters", "active") else "left")
    for name in stored_profile_names():
        profile = stored_profile(name)
        assert profile is not None  # listed because it is stored
        model = ProfiledModel(profile)
        kinds = {kind: profile.layer_types.count(kind) for kind in dict.fromkeys(profile.layer_types)}
        layers = " + ".join(f"{count} {kind.removesuffix('_attention')}" for kind, count in kinds.items())
        lora = "no (a step with peft's adapters fails)" if model.method_problem(Method.LORA) else "yes"
        active = f"{model.active_parameters_per_token / 1e9:.2f}B" if profile.experts else "-"
        table.add_row(name, profile.model_type, f"{model.parameter_count / 1e9:.2f}B", active, layers, lora)
    return table


def print_catalog(console: Console | None = None, profiles_only: bool = False) -> None:
    console = console or Console(highlight=False)
    if profiles_only:
        console.print(profiled_presets())
        return
    models = Table(title="Model presets (architecture.preset)", title_justify="left")
    for column in ("preset", "family", "parameters", "layers", "hidden", "heads/kv", "vocab"):
        models.add_column(column, justify="left" if column in ("preset", "family") else "right")
    for name, shape in MODEL_PRESETS.items():
        models.add_row(name, shape.family.value, f"{shape.parameter_count / 1e9:.2f}B", str(shape.num_layers),
                       str(shape.hidden_size), f"{shape.num_attention_heads}/{shape.num_key_value_heads}",
                       f"{shape.vocab_size:,}")  # fmt: skip
    console.print(models)
    console.print(profiled_presets())
    gpus = Table(title="GPU products (GPUPool gpuProduct)", title_justify="left")
    for column in ("product", "GiB", "bf16 TFLOPS", "fp16 TFLOPS"):
        gpus.add_column(column, justify="left" if column == "product" else "right")
    for product in GPU_PRODUCTS.values():
        bf16 = f"{product.peak_tflops_bf16:g}" if product.peak_tflops_bf16 else "-"
        gpus.add_row(product.product, f"{product.memory_gib:g}", bf16, f"{product.peak_tflops_fp16:g}")
    console.print(gpus)
