"""What the tests know of the stored model configs (memfit/catalog/configs)."""

from __future__ import annotations

STORED_TOTALS = {
    "gemma-3-12b": 11_766_034_176,
    "gemma-3-27b": 27_009_346_304,
    "gemma-3-4b": 3_880_263_168,
    "gemma-4-31b": 30_697_345_280,
    "gpt-oss-120b": 116_829_156_672,
    "gpt-oss-20b": 20_914_757_184,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.3-70b": 70_553_706_496,
    "llama-4-scout": 107_769_861_120,
    "ministral-3-8b": 8_489_553_920,
    "mistral-small-3.1-24b": 23_572_403_200,
    "phi-4": 14_659_507_200,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-32b": 32_762_123_264,
    "qwen3-8b": 8_190_735_360,
    "qwen3.5-27b": 26_895_998_464,
    "qwen3.5-35b-a3b": 34_660_610_688,
}
"""What transformers builds from each stored config.json (see memfit/catalog/configs/README.md)."""
