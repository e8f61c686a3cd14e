"""``memfit presets``: what ``architecture.preset`` (each planned from its stored profile) and ``gpuProduct`` accept."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from memfit.api.vocabulary import Method
from memfit.catalog.gpus import GPU_PRODUCTS
from memfit.catalog.model_configs import stored_profile, stored_profile_names
from memfit.catalog.models import MODEL_PRESETS
from memfit.profiled_model import ProfiledModel


def profiled_presets() -> Table:
    """The stored configs' profiles: presets planned from the model's own code. "typed": the preset also
    has its sizes typed (randomInit builds them; the family's formulas plan what the profile cannot, fp32 or
    another attention kernel)."""
    table = Table(title="Model presets (architecture.preset, planned from a stored profile)", title_justify="left")
    for column in ("preset", "model_type", "parameters", "active", "layers", "LoRA", "typed"):
        # The names stay whole on a narrow terminal: the layer pattern wraps instead.
        table.add_column(column, justify="right" if column in ("parameters", "active") else "left",
                         no_wrap=column == "preset")  # fmt: skip
    for name in stored_profile_names():
        profile = stored_profile(name)
        assert profile is not None  # listed because it is stored
        model = ProfiledModel(profile)
        kinds = {kind: profile.layer_types.count(kind) for kind in dict.fromkeys(profile.layer_types)}
        layers = " + ".join(f"{count} {kind.removesuffix('_attention')}" for kind, count in kinds.items())
        lora = "no (a step with peft's adapters fails)" if model.method_problem(Method.LORA) else "yes"
        active = f"{model.active_parameters_per_token / 1e9:.2f}B" if profile.experts else "-"
        typed = "yes" if name in MODEL_PRESETS else "-"
        table.add_row(name, profile.model_type, f"{model.parameter_count / 1e9:.2f}B", active, layers, lora, typed)
    return table


def print_catalog(console: Console | None = None, profiles_only: bool = False) -> None:
    console = console or Console(highlight=False)
    if profiles_only:
        console.print(profiled_presets())
        return
    console.print(profiled_presets())
    gpus = Table(title="GPU products (GPUPool gpuProduct)", title_justify="left")
    for column in ("product", "GiB", "bf16 TFLOPS", "fp16 TFLOPS"):
        gpus.add_column(column, justify="left" if column == "product" else "right")
    for product in GPU_PRODUCTS.values():
        bf16 = f"{product.peak_tflops_bf16:g}" if product.peak_tflops_bf16 else "-"
        gpus.add_row(product.product, f"{product.memory_gib:g}", bf16, f"{product.peak_tflops_fp16:g}")
    console.print(gpus)
