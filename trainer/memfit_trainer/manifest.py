"""A checkpoint's manifest: the size and content hash of every file the ranks wrote, checked before a load.

Without it, a checkpoint whose shard was garbled (a bad disk, a copy gone wrong, 4 KiB of random bytes) loads
without a word and trains on garbage, and one truncated or missing file makes every rerun crash while the
intact previous checkpoint sits beside it. With it, the newest checkpoint is verified before the engine reads
it; one that fails is set aside (:mod:`memfit_trainer.verified`) and the run goes on from the previous one.

Saving: after every rank has written and flushed its files, each rank hashes its share of the directory's
files (:func:`share`: every ``world``-th file of the sorted list, so the reading is spread over the ranks
whatever files each engine writes), rank 0 gathers the entries and writes :data:`MANIFEST` before the
``COMPLETE`` marker, which records the manifest's own hash. The hash reads the files back from the
filesystem after they were flushed: the manifest describes what reached it, not what the engine meant to
write. Loading: each rank verifies its share the same way (the world size may differ from the writer's) and
the verdicts are gathered, so every rank agrees.

The hash is xxHash's XXH3-128 (the ``xxhash`` package, already a dependency of ``datasets``): about 10 GiB/s
per core, so reading the files costs more than hashing them; it detects accidental damage, not tampering.
The cost of the check is one extra read of the checkpoint, split over the ranks: ``bench/verify_speed.py``
measures it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import xxhash

MANIFEST = "MANIFEST.json"
CHUNK_BYTES = 8 << 20
"""Read size while hashing: large enough that a local disk or NFS streams, small enough to bound memory."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its size and XXH3-128 digest."""

    size: int
    xxh3: str

    def to_dict(self) -> dict[str, int | str]:
        return {"size": self.size, "xxh3": self.xxh3}


def digest_file(path: Path) -> FileEntry:
    """Read ``path`` once: its size and content hash."""
    hasher = xxhash.xxh3_128()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            hasher.update(chunk)
            size += len(chunk)
    return FileEntry(size, hasher.hexdigest())


def digest_bytes(payload: bytes) -> str:
    return xxhash.xxh3_128(payload).hexdigest()


def checkpoint_files(directory: Path, exclude: Iterable[str] = ()) -> list[str]:
    """Every file under ``directory`` (relative POSIX paths, sorted), but the ``exclude`` names at its top."""
    skipped = set(exclude)
    found = []
    for parent, _, names in os.walk(directory):
        for name in names:
            relative = (Path(parent) / name).relative_to(directory).as_posix()
            if relative not in skipped:
                found.append(relative)
    return sorted(found)


def share(files: list[str], rank: int, world_size: int) -> list[str]:
    """This rank's part of the reading: every ``world_size``-th file from the ``rank``-th."""
    return files[rank::world_size]


def digest_share(directory: Path, files: list[str], rank: int, world_size: int) -> dict[str, FileEntry]:
    """The entries of this rank's share of ``files``."""
    return {name: digest_file(directory / name) for name in share(files, rank, world_size)}


def write_manifest(directory: Path, entries: Mapping[str, FileEntry]) -> str:
    """Write the manifest (flushed to disk) into ``directory``; the hash of its bytes, for the marker."""
    document = {"version": 1, "files": {name: entries[name].to_dict() for name in sorted(entries)}}
    payload = json.dumps(document, sort_keys=True, indent=1).encode()
    with open(directory / MANIFEST, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    return digest_bytes(payload)


class ManifestError(Exception):
    """The manifest itself is missing, unreadable or not the one the marker sealed."""


def read_manifest(directory: Path, sealed_digest: str) -> dict[str, FileEntry]:
    """The entries of ``directory``'s manifest, checked against the digest its marker recorded."""
    try:
        payload = (directory / MANIFEST).read_bytes()
    except OSError as error:
        raise ManifestError(f"{MANIFEST} cannot be read ({error.strerror or error})") from None
    if digest_bytes(payload) != sealed_digest:
        raise ManifestError(f"{MANIFEST} is not the one its COMPLETE marker sealed (its content hash differs)")
    try:
        files = json.loads(payload)["files"]
        return {name: FileEntry(int(entry["size"]), str(entry["xxh3"])) for name, entry in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ManifestError(f"{MANIFEST} is not a manifest") from None


def verify_share(directory: Path, entries: Mapping[str, FileEntry], rank: int, world_size: int) -> str | None:
    """Check this rank's share of the manifest's files: the first problem found (naming the file), or None."""
    for name in share(sorted(entries), rank, world_size):
        expected, path = entries[name], directory / name
        try:
            found = digest_file(path)
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as error:
            return f"{name} cannot be read ({error.strerror or error})"
        if found.size != expected.size:
            return f"{name} has {found.size} bytes, {expected.size} were written (truncated or overwritten)"
        if found.xxh3 != expected.xxh3:
            return f"{name} has other content than was written (its content hash differs: garbled)"
    return None
