"""``memfit presets``: what ``architecture.preset`` and ``gpuProduct`` accept."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from memfit.catalog.gpus import GPU_PRODUCTS
from memfit.catalog.models import MODEL_PRESETS


def print_catalog(console: Console | None = None) -> None:
    console = console or Console(highlight=False)
    models = Table(title="Model presets (architecture.preset)", title_justify="left")
    for column in ("preset", "family", "parameters", "layers", "hidden", "heads/kv", "vocab"):
        models.add_column(column, justify="left" if column in ("preset", "family") else "right")
    for name, shape in MODEL_PRESETS.items():
        models.add_row(name, shape.family.value, f"{shape.parameter_count / 1e9:.2f}B", str(shape.num_layers),
                       str(shape.hidden_size), f"{shape.num_attention_heads}/{shape.num_key_value_heads}",
                       f"{shape.vocab_size:,}")  # fmt: skip
    console.print(models)
    gpus = Table(title="GPU products (GPUPool gpuProduct)", title_justify="left")
    for column in ("product", "GiB", "bf16 TFLOPS", "fp16 TFLOPS"):
        gpus.add_column(column, justify="left" if column == "product" else "right")
    for product in GPU_PRODUCTS.values():
        bf16 = f"{product.peak_tflops_bf16:g}" if product.peak_tflops_bf16 else "-"
        gpus.add_row(product.product, f"{product.memory_gib:g}", bf16, f"{product.peak_tflops_fp16:g}")
    console.print(gpus)
