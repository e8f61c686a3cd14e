"""The core (API, memory model, planner, `memfit plan`) runs without torch, kopf or a cluster client:
installing `memfit` without extras gives a working `memfit plan`, and the operator image stays slim."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each starts memfit in a fresh interpreter

ROOT = Path(__file__).parent.parent

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "kopf", "kubernetes", "deepspeed", "transformers", "peft", "bitsandbytes"}:
            raise ImportError(f"the core must not import {name}")
sys.meta_path.insert(0, Block())
from memfit.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def run_core(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCKER, *args], capture_output=True, text=True, check=False)


def test_memfit_plan_runs_without_heavy_packages() -> None:
    completed = run_core("plan", str(ROOT / "examples" / "llama-3.1-8b-lora.yaml"),
                         "-i", str(ROOT / "examples" / "inventory.yaml"), "-o", "json")  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert '"chosen"' in completed.stdout


def test_crd_and_presets_run_without_heavy_packages() -> None:
    assert run_core("crd").returncode == 0
    presets = run_core("presets")
    assert presets.returncode == 0 and "llama-3.1-8b" in presets.stdout
