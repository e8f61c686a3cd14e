"""What verifying a checkpoint costs beside loading it: one rank's share of a checkpoint, as files of tensors
written with ``torch.save``, read back with ``torch.load`` (what an engine's load does at least) and verified
against its manifest (:mod:`memfit_trainer.manifest`), side by side in one run.

Run: python bench/verify_speed.py [--gib 2] [--files 8] [--dir PATH]
Both reads come from the page cache after the write (the common case right after a save, and on a node that
wrote the checkpoint); from a cold network filesystem both are bounded by the same reads, so the ratio is the
one to look at. Sealing costs the same read and hash as verifying.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from memfit_trainer.manifest import FileEntry, checkpoint_files, digest_share, verify_share


def _write(directory: Path, gib: float, files: int) -> None:
    elements = int(gib * 2**30 / files / 4)
    for index in range(files):
        torch.save({"state": torch.randn(elements)}, directory / f"shard-{index:03d}.pt")


def _seconds(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="checkpoint size (default 2 GiB)")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--dir", type=Path, default=None, help="where to write it (default: a temporary dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        directory = Path(scratch)
        _write(directory, args.gib, args.files)
        names = checkpoint_files(directory)
        entries: dict[str, FileEntry] = {}
        seal = _seconds(lambda: entries.update(digest_share(directory, names, 0, 1)))
        load = _seconds(lambda: [torch.load(directory / name, weights_only=True) for name in names])
        verify = _seconds(lambda: verify_share(directory, entries, 0, 1))
    print(f"{args.gib:g} GiB in {args.files} files, one rank, warm page cache")
    print(f"  torch.load of every file   {load:6.2f} s  ({args.gib / load:5.1f} GiB/s)")
    print(f"  verify (read + XXH3-128)   {verify:6.2f} s  ({args.gib / verify:5.1f} GiB/s)")
    print(f"  seal   (read + XXH3-128)   {seal:6.2f} s")
    print(f"  verify / load              {verify / load:6.2f}")


if __name__ == "__main__":
    main()
