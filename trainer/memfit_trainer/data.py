"""Training data: records from jsonl/parquet/arrow files, tokenised, packed into blocks, sharded, resumable.

The memory plan assumes every micro-batch is exactly ``micro_batch_size x sequence_length`` tokens, so the
documents are concatenated (each followed by EOS) and chunked into fixed blocks; the short tail that does not
fill a block is dropped. Every token is a training target (labels == input_ids; the model shifts them).

Order and sharding are a pure function of ``(seed, epoch)``, never of wall-clock or worker timing, which is
what lets a restarted pod continue with exactly the batches the uninterrupted run would have seen:

* The epoch's blocks form one global sequence. Global micro-step ``g`` takes the next
  ``world_size x micro_batch_size`` blocks of it, and rank ``r`` gets the ``r``-th slice of
  ``micro_batch_size`` blocks: ranks see disjoint data and always the same number of micro-batches, so no
  rank waits forever in a collective for a peer that ran out of data. Incomplete global steps are dropped.
* Map-style (``streaming=False``): all blocks are built in memory at start-up, shuffled per epoch with
  ``numpy.random.default_rng([seed, epoch])``; resuming indexes straight into that order.
* Streaming (``streaming=True``): records are shuffled with ``datasets``' seeded buffer shuffle
  (``shuffle(seed, buffer_size)`` + ``set_epoch``) and every rank reads and tokenises the whole stream,
  keeping its slice (tokenising is cheap next to a training step; it buys equal epoch lengths without any
  communication). Resuming replays the current epoch up to the saved position without collating batches,
  so it costs re-reading and re-tokenising that part of the epoch. The number of micro-batches per epoch is
  unknown in advance (``micro_batches_per_epoch is None``): bound the run by steps.

The data position a checkpoint stores is :class:`DataPosition` ``(epoch, micro_batch)``: the micro-batches
this rank has consumed in ``epoch`` (the same on every rank, so rank 0's copy in the checkpoint marker serves
all). :meth:`PackedBatches.iterate` yields the position *after* each batch,
rolled over to ``(epoch + 1, 0)`` after an epoch's last batch, so the loop saves what it last received.

Chat records (``messages_field``: a list of ``{"role", "content"}``) use the tokenizer's chat template when
it has one; otherwise each message is rendered as ``<|{role}|>\\n{content}\\n`` and the conversation is
tokenised like plain text.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from memfit.api.vocabulary import DatasetFormat

FORMAT_SUFFIXES: dict[str, tuple[str, ...]] = {
    "json": (".jsonl", ".json", ".jsonl.gz", ".json.gz"),
    "parquet": (".parquet",),
    "arrow": (".arrow",),
}
FORMAT_ALIASES = {
    "json": "json",
    DatasetFormat.JSONL.value: "json",
    DatasetFormat.PARQUET.value: "parquet",
    DatasetFormat.ARROW.value: "arrow",
}
"""The data formats accepted (memfit's, and ``json``) and the ``datasets`` builder that reads each."""
# Metadata that ``Dataset.save_to_disk`` writes next to its .arrow files: not records.
SAVE_TO_DISK_METADATA = frozenset({"state.json", "dataset_info.json", "dataset_dict.json"})
TOKENIZE_BATCH = 256
DEFAULT_SHUFFLE_BUFFER = 10_000


class DataError(ValueError):
    """The data cannot be used as configured; the message names the file, field or size at fault."""


class UnsupportedFormatError(DataError):
    pass


class MissingFieldError(DataError):
    pass


class EmptyDatasetError(DataError):
    pass


class DatasetTooSmallError(DataError):
    pass


@dataclass(frozen=True)
class DataSource:
    """Where the records are and which field holds the training text (exactly one of the two fields)."""

    path: str
    text_field: str | None = None
    messages_field: str | None = None
    format: str | None = None
    streaming: bool = False

    def __post_init__(self) -> None:
        if (self.text_field is None) == (self.messages_field is None):
            raise DataError("set exactly one of textField and messagesField")

    @property
    def field(self) -> str:
        return self.text_field if self.text_field is not None else str(self.messages_field)


@dataclass(frozen=True, order=True)
class DataPosition:
    """How far one rank got: micro-batches consumed in ``epoch`` (stored in every checkpoint)."""

    epoch: int = 0
    micro_batch: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "microBatch": self.micro_batch}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DataPosition:
        return cls(epoch=int(data["epoch"]), micro_batch=int(data["microBatch"]))


def carry_position(
    position: DataPosition, blocks_per_step_then: int, blocks_per_step_now: int
) -> tuple[DataPosition, int]:
    """``position`` of a run whose global micro-step took ``blocks_per_step_then`` blocks (world size x
    micro-batch size), in micro-steps of ``blocks_per_step_now``, and how many blocks that skips.

    The epoch's block order depends on the seed and epoch only, so ``micro_batch x blocks_per_step`` blocks
    of it were consumed whatever the world size: the position carries over exactly when that count divides
    by the new step's blocks (e.g. 2 ranks to 1 with the same micro-batch size); otherwise it is rounded up
    to the next whole step (the skipped blocks are not trained on in this epoch, none twice)."""
    if blocks_per_step_then == blocks_per_step_now:
        return position, 0
    consumed = position.micro_batch * blocks_per_step_then
    steps = -(-consumed // blocks_per_step_now)
    return DataPosition(position.epoch, steps), steps * blocks_per_step_now - consumed


# --- files -----------------------------------------------------------------------------------------


def _format_of(path: Path) -> str | None:
    name = path.name.lower()
    for fmt, suffixes in FORMAT_SUFFIXES.items():
        if name.endswith(suffixes):
            return fmt
    return None


def resolve_data_files(path: str | Path, fmt: str | None = None) -> tuple[str, list[str]]:
    """The ``datasets`` builder name and the sorted data files of a file or a directory of them."""
    root = Path(path)
    if fmt is not None:
        if fmt.lower() not in FORMAT_ALIASES:
            raise UnsupportedFormatError(f"unknown data format {fmt!r}; supported: {sorted(FORMAT_ALIASES)}")
        fmt = FORMAT_ALIASES[fmt.lower()]
    if not root.exists():
        raise FileNotFoundError(f"dataset path {str(root)!r} does not exist")
    if root.is_file():
        found = fmt or _format_of(root)
        if found is None:
            raise UnsupportedFormatError(
                f"cannot tell the format of {str(root)!r} from its name; supported suffixes: "
                f"{[s for suffixes in FORMAT_SUFFIXES.values() for s in suffixes]} (or set the format explicitly)"
            )
        return found, [str(root)]
    by_format: dict[str, list[str]] = {}
    candidates = (p for p in root.rglob("*") if p.is_file() and not p.name.startswith((".", "_")))
    for file in sorted(p for p in candidates if p.name not in SAVE_TO_DISK_METADATA):
        file_format = _format_of(file)
        if file_format is not None and (fmt is None or file_format == fmt):
            by_format.setdefault(file_format, []).append(str(file))
    if not by_format:
        wanted = FORMAT_SUFFIXES[fmt] if fmt else [s for suffixes in FORMAT_SUFFIXES.values() for s in suffixes]
        raise FileNotFoundError(f"no data files ({', '.join(wanted)}) under {str(root)!r}")
    if len(by_format) > 1:
        raise UnsupportedFormatError(
            f"{str(root)!r} mixes formats {sorted(by_format)}; set the format or point at one kind of file"
        )
    ((found, files),) = by_format.items()
    return found, files


def load_records(source: DataSource, cache_dir: str | None = None) -> Any:
    """The source's records as a ``datasets`` Dataset (or IterableDataset when streaming), checked non-empty
    and carrying the configured field."""
    from datasets import load_dataset

    builder, files = resolve_data_files(source.path, source.format)
    try:
        records = load_dataset(
            builder, data_files=files, split="train", streaming=source.streaming, cache_dir=cache_dir
        )
    except StopIteration as exc:  # the json builder's way of saying "no rows at all"
        raise EmptyDatasetError(f"dataset {source.path!r} has no records") from exc
    first = next(iter(records.take(1)), None)
    if first is None:
        raise EmptyDatasetError(f"dataset {source.path!r} has no records")
    fields = list(records.column_names or first.keys())
    if source.field not in fields:
        kind = "textField" if source.text_field is not None else "messagesField"
        raise MissingFieldError(f"{kind} {source.field!r} is not a field of {source.path!r}; fields: {fields}")
    return records


# --- tokens ----------------------------------------------------------------------------------------


def render_messages(messages: Any, tokenizer: Any) -> str:
    """A conversation as text: the tokenizer's chat template if it has one, else the documented fallback."""
    if not isinstance(messages, list) or not all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise DataError(f"a chat record must be a list of {{'role': str, 'content': str}}, got {str(messages)[:200]}")
    if getattr(tokenizer, "chat_template", None):
        return cast(str, tokenizer.apply_chat_template(messages, tokenize=False))
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)


class DocumentTokenizer:
    """Turns batches of records into token lists, one per document, each ending in EOS."""

    def __init__(self, tokenizer: Any, source: DataSource) -> None:
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no EOS token; packing needs one to separate documents")
        self.tokenizer = tokenizer
        self.source = source
        self.eos = int(tokenizer.eos_token_id)

    def __call__(self, batch: Mapping[str, list[Any]]) -> list[list[int]]:
        values = batch[self.source.field]
        if self.source.text_field is not None:
            for value in values:
                if not isinstance(value, str):
                    raise DataError(f"textField {self.source.field!r} must hold strings, got {type(value).__name__}")
            texts, special = list(values), True
        else:
            # A chat template writes its own BOS and role tokens: do not add BOS a second time.
            texts = [render_messages(v, self.tokenizer) for v in values]
            special = not getattr(self.tokenizer, "chat_template", None)
        docs = self.tokenizer(texts, add_special_tokens=special)["input_ids"]
        return [doc if doc and doc[-1] == self.eos else [*doc, self.eos] for doc in docs]

    def documents(self, records: Any) -> Iterator[list[int]]:
        for batch in records.iter(batch_size=TOKENIZE_BATCH):
            yield from self(batch)


def pack(documents: Iterable[Sequence[int]], sequence_length: int) -> Iterator[np.ndarray]:
    """Concatenate documents and cut them into ``sequence_length`` blocks; the incomplete tail is dropped."""
    buffer: list[int] = []
    for doc in documents:
        buffer.extend(doc)
        full = len(buffer) // sequence_length
        for i in range(full):
            yield np.asarray(buffer[i * sequence_length : (i + 1) * sequence_length], dtype=np.int32)
        del buffer[: full * sequence_length]


# --- batches ---------------------------------------------------------------------------------------


class PackedBatches:
    """Deterministic, rank-sharded, resumable micro-batches of packed blocks (see the module docstring)."""

    def __init__(
        self,
        records: Any,
        tokenizer: Any,
        source: DataSource,
        *,
        sequence_length: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
    ) -> None:
        if sequence_length < 1 or micro_batch_size < 1:
            raise DataError("sequence_length and micro_batch_size must be positive")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world size {world_size}")
        self.documents = DocumentTokenizer(tokenizer, source)
        self.source = source
        self.sequence_length = sequence_length
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.blocks_per_step = world_size * micro_batch_size
        if source.streaming:
            self._stream = records.shuffle(seed=seed, buffer_size=shuffle_buffer) if shuffle else records
            self._blocks: np.ndarray | None = None
        else:
            self._stream = None
            self._blocks = self._build_blocks(records)

    def _too_small(self, blocks: int | None, tokens: int | None) -> DatasetTooSmallError:
        need = f"one micro-batch on each of {self.world_size} rank(s) needs {self.blocks_per_step} block(s) of "
        need += f"{self.sequence_length} tokens ({self.world_size} rank(s) x micro batch {self.micro_batch_size})"
        if blocks is None:
            found = "an epoch yields fewer blocks than that"
        elif blocks == 0:
            found = f"all its records together are {tokens} tokens, not even one block"
        else:
            found = f"its {tokens} tokens make only {blocks} block(s)"
        return DatasetTooSmallError(f"dataset {self.source.path!r} is too small: {need}, but {found}")

    def _build_blocks(self, records: Any) -> np.ndarray:
        total = 0

        def counted(docs: Iterator[list[int]]) -> Iterator[list[int]]:
            nonlocal total
            for doc in docs:
                total += len(doc)
                yield doc

        blocks = list(pack(counted(self.documents.documents(records)), self.sequence_length))
        if len(blocks) < self.blocks_per_step:
            raise self._too_small(len(blocks), total)
        return np.stack(blocks)

    @property
    def micro_batches_per_epoch(self) -> int | None:
        """Micro-batches each rank gets per epoch; ``None`` when streaming (known only by reading it all)."""
        return None if self._blocks is None else len(self._blocks) // self.blocks_per_step

    def _epoch_steps(self, epoch: int, start: int) -> Iterator[list[np.ndarray]]:
        """The epoch's complete global micro-steps (lists of blocks) from micro-step ``start`` on."""
        blocks: Iterator[np.ndarray]
        if self._blocks is not None:
            n = len(self._blocks)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            blocks = (self._blocks[i] for i in order[start * self.blocks_per_step :])
            skip = 0
        else:
            if self.shuffle:
                self._stream.set_epoch(epoch)
            blocks = pack(self.documents.documents(self._stream), self.sequence_length)
            skip = start  # a stream can only be replayed, not indexed
        seen = 0
        while len(step := list(itertools.islice(blocks, self.blocks_per_step))) == self.blocks_per_step:
            if seen >= skip:
                yield step
            seen += 1
        if seen < skip:
            raise DataError(
                f"resume position {start} is past the end of epoch {epoch} ({seen} micro-batches); "
                "has the dataset, sequence length, batch size or world size changed?"
            )

    def _batch(self, step: list[np.ndarray]) -> dict[str, torch.Tensor]:
        mine = step[self.rank * self.micro_batch_size : (self.rank + 1) * self.micro_batch_size]
        input_ids = torch.from_numpy(np.stack(mine)).long()
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    def iterate(self, start: DataPosition | None = None) -> Iterator[tuple[DataPosition, dict[str, torch.Tensor]]]:
        """Endless ``(position after this batch, batch)`` pairs from ``start``, epoch after epoch.

        Batches are ``{"input_ids", "labels"}`` int64 tensors of shape ``(micro_batch_size, sequence_length)``.
        """
        epoch, index = (start or DataPosition()).epoch, (start or DataPosition()).micro_batch
        per_epoch = self.micro_batches_per_epoch
        if per_epoch is not None and index > per_epoch:
            raise DataError(
                f"resume position {index} is past the end of epoch {epoch} ({per_epoch} micro-batches); "
                "has the dataset, sequence length, batch size or world size changed?"
            )
        while True:
            steps = self._epoch_steps(epoch, index)
            current = next(steps, None)
            if current is None and index == 0:
                raise self._too_small(None, None)
            while current is not None:
                following = next(steps, None)
                index += 1
                after = DataPosition(epoch, index) if following is not None else DataPosition(epoch + 1, 0)
                yield after, self._batch(current)
                current = following
            epoch, index = epoch + 1, 0


def build_batches(
    source: DataSource,
    tokenizer: Any,
    *,
    sequence_length: int,
    micro_batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    cache_dir: str | None = None,
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
) -> PackedBatches:
    """Load, check and wrap a data source: the one call the training loop makes."""
    return PackedBatches(
        load_records(source, cache_dir=cache_dir),
        tokenizer,
        source,
        sequence_length=sequence_length,
        micro_batch_size=micro_batch_size,
        rank=rank,
        world_size=world_size,
        seed=seed,
        shuffle_buffer=shuffle_buffer,
    )
