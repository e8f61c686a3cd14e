"""The repository brings its own test clusters: no file names a path beside the checkout (a folder that
exists on the developers' machines only), and the scripts under hack/ answer without building anything when
the user already has envtest binaries."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
OUTSIDE = re.compile(rb"\.\./shared\b|\bshared/k8s\b")
"""The folder of test clusters that lived beside the checkout before hack/ had them."""
HISTORY = ("docs/",)
"""Design notes record what was, including where the scripts used to be."""


def _repository_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: which files are the repository's is git's answer")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout  # fmt: skip
    return [name for name in listed.decode().split("\0") if name]


def test_no_file_names_a_folder_outside_the_repository() -> None:
    this = str(Path(__file__).relative_to(ROOT))
    named = [
        f"{name}:{line}"
        for name in _repository_files()
        if name != this and not name.startswith(HISTORY) and (ROOT / name).is_file()
        for line, text in enumerate((ROOT / name).read_bytes().splitlines(), 1)
        if OUTSIDE.search(text)
    ]
    assert not named, f"these lines name a path outside the repository (use hack/): {named}"


def test_envtest_assets_honours_the_users_binaries(tmp_path: Path) -> None:
    for name in ("kube-apiserver", "etcd"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    env = {**os.environ, "KUBEBUILDER_ASSETS": str(tmp_path)}
    done = subprocess.run([ROOT / "hack" / "envtest-assets"], env=env, capture_output=True, text=True, check=False)
    assert (done.returncode, done.stdout) == (0, f"{tmp_path}\n")

    (tmp_path / "etcd").unlink()
    done = subprocess.run([ROOT / "hack" / "envtest-assets"], env=env, capture_output=True, text=True, check=False)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == f"envtest-assets: KUBEBUILDER_ASSETS={tmp_path} has no etcd\n"
