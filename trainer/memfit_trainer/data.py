"""Training data: records from jsonl/parquet/arrow files, tokenised, packed into blocks, sharded, resumable.

The memory plan assumes every micro-batch is exactly ``micro_batch_size x sequence_length`` tokens: documents
are packed into blocks of that length, or put one per block and padded (``packing``; :mod:`memfit_trainer.blocks`).
Which tokens are targets depends on the record kind (labels are -100 elsewhere; the model shifts them):

* plain text (``text_field``): every token; the tokenizer's BOS (where it adds one) and an EOS are added;
* chat (``messages_field``: a list of ``{"role", "content"}``): the assistant turns (``train_on: assistant``)
  or every token, rendered with the tokenizer's chat template (:mod:`memfit_trainer.chat`);
* prompt/completion (``prompt_field`` + ``completion_field``): the completion and EOS, or every token.

A packed batch carries ``position_ids`` restarting at 0 for every document, from which ``transformers`` builds attention
that stays inside each document (sdpa, eager: a block-diagonal causal mask; flex attention: a ``BlockMask`` of the same
pattern in 128x128 tiles; flash attention: the variable-length kernel, see :func:`model_inputs`). An unpacked batch
carries an ``attention_mask`` that hides the padding. With labels masked, the model's loss is the mean over the
micro-batch's target tokens: micro-batches (and ranks) with fewer targets weigh as much as those with more in the
accumulated gradient (each micro-batch's mean is averaged, as ``transformers``' Trainer does without
``average_tokens_across_devices``).

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

Records are checked before they are tokenised (:mod:`memfit_trainer.records`, :func:`check_data_files`): JSON Lines
files record by record before loading (a stream's as read), parquet and arrow files from their schema; a bad
record is one line naming its file, line and field, or is skipped and counted (``onBadRecord: skip``).

The data position a checkpoint stores is :class:`DataPosition` ``(epoch, micro_batch)``: the micro-batches
this rank has consumed in ``epoch`` (the same on every rank, so rank 0's copy in the checkpoint marker serves
all). :meth:`PackedBatches.iterate` yields the position *after* each batch,
rolled over to ``(epoch + 1, 0)`` after an epoch's last batch, so the loop saves what it last received. Beside it
the marker keeps the data's :attr:`PackedBatches.fingerprint`; :meth:`PackedBatches.check_resume` refuses a resume
on other data or past the end of the epoch unless the job says the data changed on purpose (``dataset.changed``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.api.vocabulary import DEFAULT_MAX_RECORD_MIB, DatasetFormat, OnBadRecord, TrainOn
from memfit.contract.reader import ConfigError
from memfit.contract.sections import DataConfig
from memfit.contract.termination import one_line
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer.blocks import (
    DOCUMENT,
    IDS,
    LABELS,
    TokenStatistics,
    attention_mask,
    one_per_row,
    pack,
    position_ids,
)
from memfit_trainer.chat import ChatTemplateError, ConversationTokenizer, Tokens
from memfit_trainer.records import (
    MIB,
    RecordRules,
    SkippedRecords,
    check_columns,
    check_json_files,
    field_label,
    good_records,
    value_problem,
)

# The data errors, re-exported (defined with the record checks, which need neither torch nor datasets).
from memfit_trainer.records import DataError as DataError
from memfit_trainer.records import EmptyDatasetError as EmptyDatasetError
from memfit_trainer.records import MissingFieldError as MissingFieldError

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
FINGERPRINT_SAMPLE_BYTES = 64 * 1024
"""Of each data file, this much of its start and of its end goes into the data's fingerprint."""
DATA_FINGERPRINT = "dataFingerprint"
"""The checkpoint marker's key for :attr:`PackedBatches.fingerprint`."""


class UnsupportedFormatError(DataError):
    pass


class DatasetTooSmallError(DataError):
    pass


@dataclass(frozen=True)
class DataSource:
    """Where the records are, which fields hold them (text, messages, or prompt with completion), which
    tokens are targets and whether documents are packed."""

    path: str
    text_field: str | None = None
    messages_field: str | None = None
    format: str | None = None
    streaming: bool = False
    prompt_field: str | None = None
    completion_field: str | None = None
    train_on: TrainOn = TrainOn.ASSISTANT
    packing: bool = True
    on_bad_record: OnBadRecord = OnBadRecord.FAIL
    max_record_mib: int = DEFAULT_MAX_RECORD_MIB
    changed: bool = False

    def __post_init__(self) -> None:
        if (self.prompt_field is None) != (self.completion_field is None):
            raise DataError("set promptField and completionField together")
        if sum(f is not None for f in (self.text_field, self.messages_field, self.prompt_field)) != 1:
            raise DataError("set exactly one of textField, messagesField and promptField/completionField")

    @classmethod
    def from_config(cls, data: DataConfig) -> DataSource:
        """The trainer config's ``data`` section (its validation records aside)."""
        return cls(**{field.name: getattr(data, field.name) for field in fields(cls)})

    @property
    def fields(self) -> dict[str, str]:
        """The record fields read, by their name in the job's spec."""
        named = {
            "textField": self.text_field,
            "messagesField": self.messages_field,
            "promptField": self.prompt_field,
            "completionField": self.completion_field,
        }
        return {kind: name for kind, name in named.items() if name is not None}

    @property
    def rules(self) -> RecordRules:
        """What each record must hold (:mod:`memfit_trainer.records`)."""
        skip = self.on_bad_record == OnBadRecord.SKIP
        return RecordRules(self.fields, self.max_record_mib * MIB, skip)


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


def check_data_files(source: DataSource, skipped: SkippedRecords | None = None) -> tuple[str, list[str], int]:
    """The ``datasets`` builder, the files, and how many bad records ``onBadRecord: skip`` leaves out, after every
    JSON Lines record was read and checked (a stream's are checked as read) and parquet and arrow columns
    checked from their schema (:mod:`memfit_trainer.records`); a bad record raises its one line."""
    builder, files = resolve_data_files(source.path, source.format)
    if builder != "json":
        check_columns(builder, files, source.rules)
        return builder, files, 0
    if source.streaming:
        return builder, files, 0
    return builder, files, check_json_files(files, source.rules, source.path, skipped).count


def _json_stream(files: list[str], rules: RecordRules) -> Any:
    """A stream of JSON Lines records checked as read (each file a shard, as the ``json`` builder's)."""
    from datasets import IterableDataset

    return IterableDataset.from_generator(
        good_records, gen_kwargs={"files": files, "rules": rules, "skipped": SkippedRecords()}
    )


def _without_bad_records(files: list[str], rules: RecordRules) -> Any:
    """The usable records, loaded whole, where ``onBadRecord: skip`` leaves bad ones out."""
    from datasets import Dataset

    return Dataset.from_list(list(good_records(files, rules, SkippedRecords(quiet=True))))


def _loaded(source: DataSource, builder: str, files: list[str], cache_dir: str | None) -> Any:
    """The files as the ``datasets`` builder loads them (every record checked already, or a columnar file)."""
    from datasets import load_dataset

    return load_dataset(builder, data_files=files, split="train", streaming=source.streaming, cache_dir=cache_dir)


def load_records(source: DataSource, cache_dir: str | None = None) -> Any:
    """The source's records as a ``datasets`` Dataset (or IterableDataset when streaming), checked
    (:func:`check_data_files`) and non-empty."""
    from datasets.exceptions import DatasetGenerationError
    from pyarrow import ArrowInvalid

    builder, files, skipped = check_data_files(source)
    try:
        if builder == "json" and source.streaming:
            records = _json_stream(files, source.rules)
        elif skipped:
            records = _without_bad_records(files, source.rules)
        else:
            records = _loaded(source, builder, files, cache_dir)
        first = next(iter(records.take(1)), None)
    except (DatasetGenerationError, ArrowInvalid) as exc:  # a columnar file it cannot read
        reason = one_line(exc.__cause__ or exc)
        raise DataError(f"dataset {source.path!r} cannot be read as {builder}: {reason}") from exc
    if first is None:
        raise EmptyDatasetError(f"dataset {source.path!r} has no records")
    return records


def config_sources(data: DataConfig) -> dict[str, DataSource]:
    """The training data and, where it has files of its own, the validation data, by their config field."""
    training = DataSource.from_config(data)
    own = None if data.validation is None else data.validation.path
    return {"data.path": training} | ({} if own is None else {"data.validation.path": replace(training, path=own)})


def check_before_start(config: TrainerConfig) -> None:
    """``memfit-train``'s data check, on rank 0 before the process group starts (:func:`check_data_files` of the
    training and validation files): a bad record is the ConfigError the trainer reports (one line, exit 2, a
    ConfigError termination message) before any weights load."""
    if os.environ.get("RANK", "0") != "0":
        return
    for where, source in config_sources(config.data).items():
        try:
            check_data_files(source, SkippedRecords(quiet=True))
        except FileNotFoundError as error:
            raise ConfigError(f"{where}: {error}") from error
        except DataError as error:
            raise ConfigError(str(error)) from error


# --- tokens ----------------------------------------------------------------------------------------


class DocumentTokenizer:
    """Turns batches of records into documents: token ids and which of them are targets (module docstring)."""

    def __init__(self, tokenizer: Any, source: DataSource) -> None:
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no EOS token to end a document with")
        self.tokenizer = tokenizer
        self.source = source
        self.eos = int(tokenizer.eos_token_id)
        self.conversations = ConversationTokenizer(tokenizer, source.train_on)
        self.bos = self._bos(tokenizer)

    @staticmethod
    def _bos(tokenizer: Any) -> list[int]:
        """The BOS the tokenizer puts before a text, if it does (prompt/completion records get it too)."""
        bos = tokenizer.bos_token_id
        adds = bos is not None and tokenizer("x", add_special_tokens=True)["input_ids"][:1] == [bos]
        return [int(bos)] if adds else []

    def _strings(self, values: list[Any], kind: str, first: int) -> list[str]:
        """``values`` (a parquet or arrow column may hold nulls its schema allows); a bad one names its record."""
        for number, value in enumerate(values, start=first):
            problem = value_problem(kind, value)
            if problem is not None:
                label = field_label(kind, self.source.fields[kind])
                raise DataError(f"{self.source.path!r} record {number}: {label}: {problem}")
        return values

    def _texts(self, values: list[Any], first: int) -> list[Tokens]:
        ids = self.tokenizer(self._strings(values, "textField", first), add_special_tokens=True)["input_ids"]
        docs = [doc if doc and doc[-1] == self.eos else [*doc, self.eos] for doc in ids]
        return [Tokens(doc, [True] * len(doc)) for doc in docs]

    def _prompts(self, prompts: list[Any], completions: list[Any], first: int) -> list[Tokens]:
        encode = self.tokenizer
        prompt_ids = encode(self._strings(prompts, "promptField", first), add_special_tokens=False)["input_ids"]
        completions = self._strings(completions, "completionField", first)
        completion_ids = encode(completions, add_special_tokens=False)["input_ids"]
        everything = self.source.train_on == TrainOn.ALL
        return [
            Tokens(
                [*self.bos, *prompt, *completion, self.eos],
                [everything] * (len(self.bos) + len(prompt)) + [True] * (len(completion) + 1),
            )
            for prompt, completion in zip(prompt_ids, completion_ids, strict=True)
        ]

    def _conversations(self, values: list[Any], first: int) -> list[Tokens]:
        try:
            return [
                self.conversations(value, f"{self.source.path!r} record {first + i}") for i, value in enumerate(values)
            ]
        except ChatTemplateError as exc:
            raise DataError(str(exc)) from exc

    def __call__(self, batch: Mapping[str, list[Any]], first: int = 0) -> list[Tokens]:
        """The documents of a batch of records; ``first`` is the first record's index (named in errors)."""
        source = self.source
        if source.text_field is not None:
            return self._texts(batch[source.text_field], first)
        if source.messages_field is not None:
            return self._conversations(batch[source.messages_field], first)
        return self._prompts(batch[str(source.prompt_field)], batch[str(source.completion_field)], first)

    def documents(self, records: Any) -> Iterator[Tokens]:
        """Every record's document, in order; empty ones (no tokens) are left out."""
        for number, batch in enumerate(records.iter(batch_size=TOKENIZE_BATCH)):
            yield from (doc for doc in self(batch, number * TOKENIZE_BATCH) if doc.ids)


def blocks_of(
    documents: Iterable[Tokens], source: DataSource, sequence_length: int, pad_id: int
) -> Iterator[np.ndarray]:
    """Documents into ``(3, sequence_length)`` blocks: packed, or one per block (:mod:`memfit_trainer.blocks`)."""
    if source.packing:
        return pack(documents, sequence_length)
    return one_per_row(documents, sequence_length, pad_id)


def model_inputs(blocks: np.ndarray, packing: bool) -> dict[str, torch.Tensor]:
    """A micro-batch of blocks as the model's keyword arguments.

    Packed: ``position_ids`` restarting per document, and no ``attention_mask``: that is what makes ``transformers``
    (5.x, ``masking_utils.find_packed_sequence_indices``) build a block-diagonal causal mask for sdpa and eager
    attention, and a ``BlockMask`` for flex attention (it skips that detection when an attention mask or a KV cache
    is given; the trainer disables the cache). Flash attention detects packing from ``position_ids`` only for a
    batch of one row, so the variable-length boundaries are passed explicitly (:func:`flash_varlen_kwargs`).
    Unpacked: ``attention_mask`` hides the padding (positions count from 0 in every row anyway).
    """
    ids = torch.from_numpy(np.ascontiguousarray(blocks[:, IDS])).long()
    labels = torch.from_numpy(np.ascontiguousarray(blocks[:, LABELS])).long()
    documents = blocks[:, DOCUMENT]
    if packing:
        return {"input_ids": ids, "labels": labels, "position_ids": torch.from_numpy(position_ids(documents)).long()}
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.from_numpy(attention_mask(documents))}


def flash_varlen_kwargs(position: torch.Tensor) -> dict[str, Any]:
    """flash-attention's variable-length arguments for packed ``position_ids`` (``FlashAttentionKwargs``):
    cumulative document boundaries over the flattened micro-batch, so no document attends to another, for
    any number of rows. (Not exercised without a CUDA flash-attn build.)"""
    flat = position.reshape(-1)
    # Positions restart at 0 in every document and every row (a continued document too): those are the starts.
    starts = torch.nonzero(flat == 0).reshape(-1)
    bounds = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    return {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest, "max_length_k": longest}


# --- batches ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchShape:
    """How blocks are cut and shared out: the same for the training and the validation data."""

    sequence_length: int
    micro_batch_size: int
    rank: int = 0
    world_size: int = 1
    seed: int = 0


class PackedBatches:
    """Deterministic, rank-sharded, resumable micro-batches of packed blocks (see the module docstring)."""

    def __init__(
        self,
        records: Any,
        tokenizer: Any,
        source: DataSource,
        shape: BatchShape,
        *,
        shuffle: bool = True,
        shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
    ) -> None:
        if shape.sequence_length < 1 or shape.micro_batch_size < 1:
            raise DataError("sequence_length and micro_batch_size must be positive")
        if not 0 <= shape.rank < shape.world_size:
            raise DataError(f"rank {shape.rank} is outside world size {shape.world_size}")
        self.documents = DocumentTokenizer(tokenizer, source)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.documents.eos
        self.statistics: TokenStatistics | None = None
        """Token counts of the epoch (map-style only: a stream is not read ahead)."""
        self.source = source
        self.shape = shape
        self.shuffle = shuffle
        self.shuffle_buffer = shuffle_buffer
        self.blocks_per_step = shape.world_size * shape.micro_batch_size
        if source.streaming:
            self._stream = records.shuffle(seed=shape.seed, buffer_size=shuffle_buffer) if shuffle else records
            self._blocks: np.ndarray | None = None
        else:
            self._stream = None
            self._blocks = self._build_blocks(records)

    def _too_small(self, blocks: int | None, tokens: int | None) -> DatasetTooSmallError:
        shape = self.shape
        need = f"one micro-batch on each of {shape.world_size} rank(s) needs {self.blocks_per_step} block(s) of "
        need += f"{shape.sequence_length} tokens ({shape.world_size} rank(s) x micro batch {shape.micro_batch_size})"
        if blocks is None:
            found = "an epoch yields fewer blocks than that"
        elif blocks == 0:
            found = f"all its records together are {tokens} tokens, not even one block"
        else:
            found = f"its {tokens} tokens make only {blocks} block(s)"
        return DatasetTooSmallError(f"dataset {self.source.path!r} is too small: {need}, but {found}")

    def _blocks_of(self, records: Any) -> Iterator[np.ndarray]:
        return blocks_of(self.documents.documents(records), self.source, self.shape.sequence_length, self.pad_id)

    def _build_blocks(self, records: Any) -> np.ndarray:
        counts = TokenStatistics(self.shape.sequence_length)
        documents = counts.documents(self.documents.documents(records))
        blocks = list(counts.rows_of(blocks_of(documents, self.source, self.shape.sequence_length, self.pad_id)))
        self.statistics = counts
        if len(blocks) < self.blocks_per_step:
            raise self._too_small(len(blocks), counts.document_tokens)
        return np.stack(blocks)

    @property
    def micro_batches_per_epoch(self) -> int | None:
        """Micro-batches each rank gets per epoch; ``None`` when streaming (known only by reading it all)."""
        return None if self._blocks is None else len(self._blocks) // self.blocks_per_step

    @cached_property
    def fingerprint(self) -> dict[str, Any]:
        """The data and its order, cheaply: each file's name (under the dataset's path), size and a hash of its
        first and last 64 KiB; the fields, masking, packing, sequence length, seed and shuffling; and, loaded
        whole, the blocks per epoch (what a changed tokenizer or validation split shows in). Stored in every
        checkpoint's marker (:data:`DATA_FINGERPRINT`) and compared on resume (:meth:`check_resume`)."""
        files = file_samples(self.source)
        blocks = None if self._blocks is None else len(self._blocks)
        source = self.source
        order = [source.format, source.fields, source.train_on, source.packing, source.streaming, self.shuffle,
                 self.shuffle_buffer, self.shape.sequence_length, self.shape.seed, blocks]  # fmt: skip
        digest = hashlib.sha256(json.dumps([files, order], default=str).encode()).hexdigest()
        return {"sha256": digest, "files": len(files), "bytes": sum(size for _, size, _ in files), "blocks": blocks}

    def check_resume(
        self, position: DataPosition, blocks_per_step_then: int, written: Mapping[str, Any] | None
    ) -> None:
        """Refuse to go on from a checkpoint's ``position`` (in micro-steps of ``blocks_per_step_then`` blocks) on
        data other than its fingerprint ``written`` says (None: a checkpoint written before fingerprints), or past
        the end of this data's epoch, unless the job says the data changed on purpose (``dataset.changed``)."""
        if self.source.changed:
            return
        if written is not None and written.get("sha256") != self.fingerprint["sha256"]:
            raise DataError(
                f"the checkpoint was written on other data than {self.source.path!r} holds now, or in another order "
                f"(then: {described(written)}; now: {described(self.fingerprint)}); set dataset.changed: true to go "
                "on with this data, or start from an empty output directory"
            )
        if self._blocks is not None and position.micro_batch * blocks_per_step_then > len(self._blocks):
            raise past_the_end(position.micro_batch, position.epoch, len(self._blocks) // blocks_per_step_then)

    def _epoch_steps(self, epoch: int, start: int) -> Iterator[list[np.ndarray]]:
        """The epoch's complete global micro-steps (lists of blocks) from micro-step ``start`` on."""
        blocks: Iterator[np.ndarray]
        if self._blocks is not None:
            n = len(self._blocks)
            order = np.random.default_rng([self.shape.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            blocks = (self._blocks[i] for i in order[start * self.blocks_per_step :])
            skip = 0
        else:
            if self.shuffle:
                self._stream.set_epoch(epoch)
            blocks = self._blocks_of(self._stream)
            skip = start  # a stream can only be replayed, not indexed
        seen = 0
        while len(step := list(itertools.islice(blocks, self.blocks_per_step))) == self.blocks_per_step:
            if seen >= skip:
                yield step
            seen += 1
        if seen < skip:
            raise past_the_end(start, epoch, seen)

    def _batch(self, step: list[np.ndarray]) -> dict[str, torch.Tensor]:
        mine = step[self.shape.rank * self.shape.micro_batch_size : (self.shape.rank + 1) * self.shape.micro_batch_size]
        return model_inputs(np.stack(mine), self.source.packing)

    def blocks(self, epoch: int = 0) -> Iterator[np.ndarray]:
        """The epoch's blocks in training order, all ranks' (``(3, sequence_length)``: ids, labels, document;
        what ``memfit data preview`` shows)."""
        for step in self._epoch_steps(epoch, 0):
            yield from step

    def iterate(self, start: DataPosition | None = None) -> Iterator[tuple[DataPosition, dict[str, torch.Tensor]]]:
        """Endless ``(position after this batch, batch)`` pairs from ``start``, epoch after epoch.

        Batches are :func:`model_inputs`: ``input_ids``, ``labels`` and ``position_ids`` (packed) or
        ``attention_mask`` (not packed), int64 tensors of shape ``(micro_batch_size, sequence_length)``.
        """
        epoch, index = (start or DataPosition()).epoch, (start or DataPosition()).micro_batch
        per_epoch = self.micro_batches_per_epoch
        if per_epoch is not None and index > per_epoch:
            raise past_the_end(index, epoch, per_epoch)
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


def past_the_end(position: int, epoch: int, micro_batches: int) -> DataError:
    return DataError(
        f"resume position {position} is past the end of epoch {epoch} ({micro_batches} micro-batches); "
        "has the dataset, sequence length, batch size or world size changed? (dataset.changed: true goes on "
        "with the next epoch)"
    )


def described(fingerprint: Mapping[str, Any]) -> str:
    blocks = fingerprint.get("blocks")
    per_epoch = "" if blocks is None else f", {blocks} blocks per epoch"
    return f"{fingerprint.get('files')} file(s), {fingerprint.get('bytes')} bytes{per_epoch}"


def _sample_hash(file: Path, size: int) -> str:
    """A hash of the file's first and last :data:`FINGERPRINT_SAMPLE_BYTES`."""
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        digest.update(handle.read(FINGERPRINT_SAMPLE_BYTES))
        handle.seek(max(0, size - FINGERPRINT_SAMPLE_BYTES))
        digest.update(handle.read(FINGERPRINT_SAMPLE_BYTES))
    return digest.hexdigest()


def file_samples(source: DataSource) -> list[tuple[str, int, str]]:
    """Each data file's name under the dataset's path (the same on every machine), size and sample hash."""
    root = Path(source.path)
    samples = []
    for name in resolve_data_files(source.path, source.format)[1]:
        file = Path(name)
        size = file.stat().st_size
        samples.append((file.name if root.is_file() else str(file.relative_to(root)), size, _sample_hash(file, size)))
    return samples


def build_batches(
    source: DataSource,
    tokenizer: Any,
    shape: BatchShape,
    *,
    cache_dir: str | None = None,
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
) -> PackedBatches:
    """Load, check and wrap a data source: the one call the training loop makes."""
    records = load_records(source, cache_dir=cache_dir)
    return PackedBatches(records, tokenizer, source, shape, shuffle_buffer=shuffle_buffer)
