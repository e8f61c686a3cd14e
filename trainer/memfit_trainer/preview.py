"""``memfit data preview``'s trainer side: the first packed sequences as the trainer builds them, with the
targets and document boundaries marked, and the dataset's token statistics.

The core CLI (``memfit.cli.data_preview``) cannot import torch or transformers; it writes a request (the
trainer config's ``data`` and ``model`` sections, the sequence length) and runs ``python -m
memfit_trainer.preview REQUEST``, which prints the result as JSON (the CLI renders it) and exits 2 with one
line on bad input. It runs on a CPU, reads the whole dataset once (map-style: the statistics are the epoch's).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from memfit.contract.sections import DataConfig, ModelConfig
from memfit_trainer.blocks import DOCUMENT, IDS, IGNORE_INDEX, LABELS, TokenStatistics
from memfit_trainer.data import BatchShape, DataError, DataSource, PackedBatches, load_records
from memfit_trainer.tokenizer import TokenizerLoadError, model_tokenizer

EXIT_BAD_INPUT = 2


def sequence_tokens(block: np.ndarray, tokenizer: Any) -> list[dict[str, Any]]:
    """One sequence as ``{"id", "text", "trained", "document"}`` per token (document -1: padding)."""
    return [
        {"id": int(token), "text": tokenizer.decode([int(token)]), "trained": bool(label != IGNORE_INDEX),
         "document": int(document)}
        for token, label, document in zip(block[IDS], block[LABELS], block[DOCUMENT], strict=True)
    ]  # fmt: skip


def preview(request: dict[str, Any]) -> dict[str, Any]:
    data, model = DataConfig.model_validate(request["data"]), ModelConfig.model_validate(request["model"])
    sequence_length, count = int(request["sequenceLength"]), int(request["count"])
    tokenizer = model_tokenizer(model)
    source = DataSource.from_config(data.model_copy(update={"streaming": False}))
    batches = PackedBatches(load_records(source), tokenizer, source, BatchShape(sequence_length, 1), shuffle=False)
    statistics = batches.statistics
    assert isinstance(statistics, TokenStatistics)  # map-style batches count their epoch
    sequences = [sequence_tokens(block, tokenizer) for block in itertools.islice(batches.blocks(), count)]
    return {"sequences": sequences, "statistics": statistics.to_dict(), "packing": source.packing}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memfit_trainer.preview")
    parser.add_argument("request", help="JSON file: data, model, sequenceLength, count")
    args = parser.parse_args(argv)
    try:
        with open(args.request, encoding="utf-8") as handle:
            result = preview(json.load(handle))
    except (DataError, TokenizerLoadError, FileNotFoundError, ValueError) as error:
        print(f"memfit data preview: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
