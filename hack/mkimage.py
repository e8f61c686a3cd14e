#!/usr/bin/env python3
"""Write a root filesystem folder as a one-layer image in the docker-archive format that ``ctr images import``
reads, with the standard library only: the node's pause and probe images are made before any container tool
exists on the machine, and no registry can be pulled from.

    mkimage.py NAME:TAG ROOTFS OUT.tar [--entrypoint JSON] [--cmd JSON] [--user UID:GID]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import tarfile

EPOCH = "1970-01-01T00:00:00Z"
"""Every timestamp: the same folder always makes the same image."""


def _as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mtime = 0
    return info


def layer(rootfs: str) -> bytes:
    """The folder as a tar, entries in sorted order, owned by root, symlinks kept as links."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for root, dirs, files in os.walk(rootfs):
            dirs.sort()
            for name in sorted(dirs + files):
                path = os.path.join(root, name)
                tar.add(path, arcname=os.path.relpath(path, rootfs), recursive=False, filter=_as_root)
    return out.getvalue()


def archive(ref: str, rootfs: str, out: str, entrypoint: list[str] | None, cmd: list[str] | None, user: str) -> None:
    data = layer(rootfs)
    diff_id = "sha256:" + hashlib.sha256(data).hexdigest()
    settings = {"Entrypoint": entrypoint, "Cmd": cmd, "User": user, "Env": ["PATH=/bin:/usr/bin:/sbin:/usr/sbin"]}
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "created": EPOCH,
            "config": {key: value for key, value in settings.items() if value},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created": EPOCH, "created_by": "hack/mkimage.py"}],
        },
        sort_keys=True,
    ).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [ref], "Layers": ["layer.tar"]}]).encode()
    with tarfile.open(out, "w") as tar:
        for name, content in ((config_name, config), ("layer.tar", data), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(content), 0o644
            tar.addfile(info, io.BytesIO(content))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ref", help="NAME:TAG the image is imported as")
    parser.add_argument("rootfs", help="the folder that becomes the image's only layer")
    parser.add_argument("out", help="the docker-archive tar to write")
    parser.add_argument("--entrypoint", type=json.loads, default=None, help="a JSON list")
    parser.add_argument("--cmd", type=json.loads, default=None, help="a JSON list")
    parser.add_argument("--user", default="")
    args = parser.parse_args()
    if not os.path.isdir(args.rootfs):
        parser.error(f"{args.rootfs} is not a folder")
    archive(args.ref, args.rootfs, args.out, args.entrypoint, args.cmd, args.user)


if __name__ == "__main__":
    main()
