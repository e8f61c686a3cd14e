"""Data records checked as read: one bad record is one line naming its file, line and field, never a traceback.

A JSON Lines file (``.jsonl``, ``.json``, gzipped or not) is read line by line, each line at most
``maxRecordMib`` (read in pieces of that size, so an oversize record never costs more memory than the limit):
it must be UTF-8, one JSON object, and hold the configured fields with the right types (text, prompt and
completion: strings; messages: a non-empty list of ``{"role": str, "content": str}``, what
:mod:`memfit_trainer.chat` renders). Blank lines are no records. A bad record raises a :class:`DataError`
``FILE:LINE: FIELD: what is wrong``, or, with ``onBadRecord: skip``, is counted and left out
(:class:`SkippedRecords`). A dataset without one usable record is refused.

Parquet and arrow files carry a schema: their columns' types are checked once from it (:func:`check_columns`),
not record by record.

The checks are plain Python (no torch, no ``datasets``): ``memfit-train`` runs them on rank 0 before the process
group starts (:func:`memfit_trainer.data.check_before_start`), ``datasets`` then loads what passed.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any, cast

MIB = 1 << 20
MESSAGES_KIND = "messagesField"
MESSAGE_KEYS = ("role", "content")
SAID_SKIPS = 10
"""Skipped records said one by one; the rest are counted only."""
DRAIN_CHUNK = 64 * 1024


class DataError(ValueError):
    """The data cannot be used as configured; the message names the file, field or size at fault."""


class MissingFieldError(DataError):
    pass


class EmptyDatasetError(DataError):
    pass


@dataclass(frozen=True)
class RecordRules:
    """What every record must hold: the configured fields by kind (``{"textField": "text"}``), its size limit,
    and whether a bad record is skipped (``onBadRecord: skip``) or stops the run."""

    fields: Mapping[str, str]
    max_record_bytes: int
    skip_bad: bool = False


@dataclass(frozen=True)
class BadRecord:
    """One record that cannot be used, and why (``problem`` names the field)."""

    file: str
    line: int
    problem: str
    missing_field: bool = False

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.problem}"

    def error(self) -> DataError:
        return (MissingFieldError if self.missing_field else DataError)(str(self))


@dataclass
class SkippedRecords:
    """The bad records left out under ``onBadRecord: skip``: the first :data:`SAID_SKIPS` said on rank 0's
    stderr, all counted."""

    quiet: bool = False
    """Count only (a second read of records already said)."""
    count: int = 0

    def add(self, bad: BadRecord) -> None:
        self.count += 1
        if not self.quiet and self.count <= SAID_SKIPS and os.environ.get("RANK", "0") == "0":
            print(f"memfit-train: skipped bad record {bad} ({self.count} skipped so far)", file=sys.stderr, flush=True)


JSON_KINDS = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}


def _shown(value: Any) -> str:
    """A value's kind as JSON names it (what the record's author wrote)."""
    return "null" if value is None else JSON_KINDS.get(type(value), f"a {type(value).__name__}")


def messages_problem(messages: Any) -> str | None:
    """Why ``messages`` is not a non-empty list of ``{"role": str, "content": str}`` (None: it is)."""
    if not isinstance(messages, list) or not messages:
        return f"{_shown(messages) if messages != [] else 'an empty list'}, not a non-empty list of messages"
    for number, message in enumerate(messages):
        if not isinstance(message, Mapping):
            return f"message {number} is {_shown(message)}, not an object with role and content"
        for key in MESSAGE_KEYS:
            if key not in message:
                return f"message {number}: no {key}"
            if not isinstance(message[key], str):
                return f"message {number}: {key} is {_shown(message[key])}, not a string"
    return None


def value_problem(kind: str, value: Any) -> str | None:
    """Why a field's value cannot be read as its kind (None: it can)."""
    if kind == MESSAGES_KIND:
        return messages_problem(value)
    return None if isinstance(value, str) else f"{_shown(value)}, not a string"


def field_label(kind: str, name: str) -> str:
    """How an error names a field: its kind in the job's spec and its name in the records."""
    return f"{kind} {name!r}"


def _record_problem(record: Any, rules: RecordRules, file: str, line: int) -> BadRecord | None:
    if not isinstance(record, dict):
        return BadRecord(file, line, f"record: {_shown(record)} instead of a JSON object")
    for kind, name in rules.fields.items():
        if name not in record:
            fields = list(record)
            return BadRecord(file, line, f"{field_label(kind, name)}: missing; the record's fields: {fields}", True)
        problem = value_problem(kind, record[name])
        if problem is not None:
            return BadRecord(file, line, f"{field_label(kind, name)}: {problem}")
    return None


def _parsed(raw: bytes, rules: RecordRules, file: str, line: int) -> dict[str, Any] | BadRecord | None:
    """A line's record (its configured fields only), why it is bad, or None for a blank line."""
    try:
        text = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as error:
        return BadRecord(file, line, f"record: not UTF-8 (byte 0x{raw[error.start]:02x} at byte {error.start + 1})")
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        return BadRecord(file, line, f"record: invalid JSON: {error.msg} (column {error.colno})")
    bad = _record_problem(record, rules, file, line)
    return bad if bad is not None else {name: record[name] for name in rules.fields.values()}


def _open(file: str) -> IO[bytes]:
    return cast(IO[bytes], gzip.open(file, "rb")) if file.endswith(".gz") else open(file, "rb")


def _lines(handle: IO[bytes], limit: int) -> Iterator[bytes | None]:
    """The file's lines, each ``None`` where it is longer than ``limit`` bytes (read past, never held whole)."""
    while line := handle.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while (rest := handle.readline(DRAIN_CHUNK)) and not rest.endswith(b"\n"):
            pass
        yield None


def json_records(file: str, rules: RecordRules) -> Iterator[dict[str, Any] | BadRecord]:
    """Every record of a JSON Lines file, or why it is bad, in order."""
    limit = rules.max_record_bytes
    with _open(file) as handle:
        for line, raw in enumerate(_lines(handle, limit), start=1):
            if raw is None:
                yield BadRecord(
                    file, line, f"record: larger than the limit of {limit // MIB} MiB (dataset.maxRecordMib)"
                )
                continue
            parsed = _parsed(raw, rules, file, line)
            if parsed is not None:
                yield parsed


def good_records(
    files: Iterable[str], rules: RecordRules, skipped: SkippedRecords | None = None
) -> Iterator[dict[str, Any]]:
    """The usable records of JSON Lines files in order; a bad one raises its one line, or, with
    ``rules.skip_bad``, is counted in ``skipped`` and left out."""
    skipped = skipped if skipped is not None else SkippedRecords()
    for file in files:
        for record in json_records(file, rules):
            if not isinstance(record, BadRecord):
                yield record
            elif rules.skip_bad:
                skipped.add(record)
            else:
                raise record.error()


def check_json_files(
    files: list[str], rules: RecordRules, dataset: str, skipped: SkippedRecords | None = None
) -> SkippedRecords:
    """Read every record of ``files`` once, as :func:`good_records` does; refuse a dataset without one usable
    record. What was skipped (``onBadRecord: skip``)."""
    skipped = skipped if skipped is not None else SkippedRecords()
    usable = sum(1 for _ in good_records(files, rules, skipped))
    if not usable:
        more = f" ({skipped.count} bad record(s) skipped)" if skipped.count else ""
        raise EmptyDatasetError(f"dataset {dataset!r} has no records{more}")
    return skipped


# --- columnar files --------------------------------------------------------------------------------


def _schema(builder: str, file: str) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if builder == "parquet":
        return pq.read_schema(file)
    with pa.memory_map(file) as source:
        try:
            return pa.ipc.open_stream(source).schema  # what Dataset.save_to_disk writes
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_file(source).schema


def _is_string(column: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_string(column) or pa.types.is_large_string(column) or pa.types.is_string_view(column))


def _column_fits(kind: str, column: Any) -> bool:
    import pyarrow as pa

    if kind != MESSAGES_KIND:
        return _is_string(column)
    listed = pa.types.is_list(column) or pa.types.is_large_list(column)
    item = column.value_type if listed else None
    if item is None or not pa.types.is_struct(item):
        return False
    names = [item.field(i).name for i in range(item.num_fields)]
    return all(key in names and _is_string(item.field(key).type) for key in MESSAGE_KEYS)


def check_columns(builder: str, files: list[str], rules: RecordRules) -> None:
    """Each configured field a column of every parquet or arrow file, of a type its kind can be read from."""
    for file in files:
        schema = _schema(builder, file)
        for kind, name in rules.fields.items():
            if name not in schema.names:
                raise MissingFieldError(f"{file}: {field_label(kind, name)}: no such column; columns: {schema.names}")
            column = schema.field(name).type
            if not _column_fits(kind, column):
                wanted = "a list of {role: string, content: string}" if kind == MESSAGES_KIND else "strings"
                raise DataError(f"{file}: {field_label(kind, name)}: the column holds {column}, not {wanted}")
