"""Documents into fixed-shape rows: packed several to a row, or one per row padded; and what that costs.

The memory plan assumes every micro-batch is exactly ``micro_batch_size x sequence_length`` tokens, so every
row is ``sequence_length`` long. A row is a ``(3, sequence_length)`` int32 array: token ids, labels
(``IGNORE_INDEX`` where not trained) and the document each token belongs to (a running count, -1 for
padding). The document row is what attention and positions are built from (:func:`position_ids`,
:func:`attention_mask`) and what ``memfit data preview`` shows as boundaries.

* Packing: documents are concatenated and cut into rows; the incomplete tail is dropped. A document cut at
  a row's end goes on in the next row as a piece of its own (positions from 0; it cannot attend back to
  the previous row).
* One per row: a document is cut to ``sequence_length`` and padded; padding is no target and, through the
  attention mask, no context.

In both, a document's first token is never a target: its label would be predicted from the previous
document's last token (or from nothing).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from memfit_trainer.chat import Tokens

IGNORE_INDEX = -100
"""The label of a token that is not a target (what ``torch.nn.functional.cross_entropy`` ignores)."""
IDS, LABELS, DOCUMENT = 0, 1, 2
PADDING_DOCUMENT = -1


def _labelled(tokens: Tokens) -> tuple[list[int], list[int]]:
    labels = [t if trained else IGNORE_INDEX for t, trained in zip(tokens.ids, tokens.trained, strict=True)]
    if labels:
        labels[0] = IGNORE_INDEX
    return tokens.ids, labels


def pack(documents: Iterable[Tokens], sequence_length: int) -> Iterator[np.ndarray]:
    """Concatenate documents and cut them into ``sequence_length`` rows; the incomplete tail is dropped."""
    buffer: list[list[int]] = [[], [], []]
    for number, tokens in enumerate(documents):
        ids, labels = _labelled(tokens)
        buffer[IDS] += ids
        buffer[LABELS] += labels
        buffer[DOCUMENT] += [number] * len(ids)
        full = len(buffer[IDS]) // sequence_length
        for i in range(full):
            block = np.asarray([row[i * sequence_length : (i + 1) * sequence_length] for row in buffer], dtype=np.int32)
            block[LABELS, 0] = IGNORE_INDEX  # a document's continuation starts here, with nothing before it
            yield block
        for row in buffer:
            del row[: full * sequence_length]


def one_per_row(documents: Iterable[Tokens], sequence_length: int, pad_id: int) -> Iterator[np.ndarray]:
    """Each document in a row of its own, cut to ``sequence_length`` and padded with ``pad_id``."""
    for number, tokens in enumerate(documents):
        ids, labels = _labelled(tokens)
        kept = min(len(ids), sequence_length)
        pad = sequence_length - kept
        yield np.asarray(
            [
                ids[:kept] + [pad_id] * pad,
                labels[:kept] + [IGNORE_INDEX] * pad,
                [number] * kept + [PADDING_DOCUMENT] * pad,
            ],
            dtype=np.int32,
        )


def position_ids(documents: np.ndarray) -> np.ndarray:
    """Positions that restart at 0 where the document changes, for a ``(..., sequence_length)`` document row."""
    index = np.broadcast_to(np.arange(documents.shape[-1]), documents.shape)
    starts = np.ones(documents.shape, dtype=bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    positions: np.ndarray = index - np.maximum.accumulate(np.where(starts, index, 0), axis=-1)
    return positions


def attention_mask(documents: np.ndarray) -> np.ndarray:
    """1 for real tokens, 0 for padding."""
    mask: np.ndarray = (documents != PADDING_DOCUMENT).astype(np.int64)
    return mask


@dataclass
class TokenStatistics:
    """What tokenising and fitting the documents into rows cost: counted over one epoch's rows."""

    sequence_length: int
    document_lengths: list[int] = field(default_factory=list)
    trained_tokens: int = 0
    rows: int = 0
    tokens_in_rows: int = 0

    def documents(self, documents: Iterable[Tokens]) -> Iterator[Tokens]:
        """Pass ``documents`` through, counting them."""
        for tokens in documents:
            self.document_lengths.append(len(tokens.ids))
            yield tokens

    def rows_of(self, rows: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        """Pass ``rows`` through, counting the tokens (not padding) and targets they hold."""
        for row in rows:
            self.rows += 1
            self.tokens_in_rows += int((row[DOCUMENT] != PADDING_DOCUMENT).sum())
            self.trained_tokens += int((row[LABELS] != IGNORE_INDEX).sum())
            yield row

    @property
    def document_tokens(self) -> int:
        return sum(self.document_lengths)

    @property
    def truncated_share(self) -> float:
        """Share of the documents' tokens in no row: cut off at the sequence length, or the packed tail."""
        total = self.document_tokens
        return (total - self.tokens_in_rows) / total if total else 0.0

    @property
    def padded_share(self) -> float:
        """Share of the rows' positions that are padding."""
        positions = self.rows * self.sequence_length
        return (positions - self.tokens_in_rows) / positions if positions else 0.0

    def percentile(self, q: float) -> int:
        return int(np.percentile(self.document_lengths, q, method="higher")) if self.document_lengths else 0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "records": len(self.document_lengths),
            "tokensP50": self.percentile(50),
            "tokensP99": self.percentile(99),
            "tokensMax": max(self.document_lengths, default=0),
            "documentTokens": self.document_tokens,
            "sequences": self.rows,
            "tokensPerEpoch": self.tokens_in_rows,
            "trainedTokensPerEpoch": self.trained_tokens,
            "truncatedShare": self.truncated_share,
            "paddedShare": self.padded_share,
        }

    def describe(self) -> str:
        """One line for the trainer console."""
        return (
            f"data: {len(self.document_lengths)} records, tokens per record p50 {self.percentile(50)} "
            f"p99 {self.percentile(99)} max {max(self.document_lengths, default=0)}; {self.rows} sequences of "
            f"{self.sequence_length} per epoch, {self.trained_tokens} target tokens; "
            f"{self.truncated_share:.1%} of tokens truncated, {self.padded_share:.1%} of positions padding"
        )
