"""`memfit run --local`: planning for this machine and rendering the trainer's config (the training
itself is exercised in tests/trainer)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from memfit.api.gpupool import pool_capacity
from memfit.cli.local_machine import CPU_PRODUCT, LocalMachine, local_pool
from memfit.cli.main import main
from memfit.contract.trainer_config import load_config

ROOT = Path(__file__).parent.parent
TINY = ROOT / "examples" / "tiny"


@pytest.fixture
def tiny_job(tmp_path: Path) -> Path:
    shutil.copytree(TINY / "data", tmp_path / "data")
    shutil.copy(TINY / "job.yaml", tmp_path / "job.yaml")
    return tmp_path / "job.yaml"


def test_dry_run_renders_the_trainer_config_for_local_directories(tiny_job: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["run", str(tiny_job), "--local", "--nproc", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    config = load_config(tiny_job.parent / "output" / "tiny" / ".memfit" / "trainer-config.json")
    assert "memfit run: full zero" in out
    assert config.world_size == 2
    assert config.data.path == str(tiny_job.parent / "data" / "train.jsonl")
    assert config.output_dir == str(tiny_job.parent / "output" / "tiny")
    assert config.model.random_init and config.model.architecture and config.model.architecture.num_layers == 4
    assert config.deepspeed["train_batch_size"] == 8
    assert config.metrics.progress_file and config.metrics.progress_file.endswith("progress.json")


def test_mount_maps_a_claim_to_a_directory(tiny_job: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    shutil.move(tiny_job.parent / "data", elsewhere)
    assert main(["run", str(tiny_job), "--local", "--mount", f"data={elsewhere}", "--dry-run"]) == 0
    config = load_config(tiny_job.parent / "output" / "tiny" / ".memfit" / "trainer-config.json")
    assert config.data.path == str(elsewhere / "train.jsonl")


def test_run_without_local_is_refused(tiny_job: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["run", str(tiny_job)]) == 2
    assert "kubectl apply" in capsys.readouterr().err


def test_bad_mount_is_one_clear_line(tiny_job: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["run", str(tiny_job), "--local", "--mount", "data", "--dry-run"]) == 2
    assert "expected CLAIM=DIRECTORY" in capsys.readouterr().err


def test_cpu_machine_becomes_a_pool_of_cpu_processes() -> None:
    machine = LocalMachine((), (), memory_bytes=20 * 1024**3, cpus=4)
    capacity = pool_capacity(local_pool(machine, ranks=2))
    assert capacity.product == CPU_PRODUCT and capacity.gpus_per_node == 2
    assert capacity.gpu_memory_bytes == pytest.approx(0.8 * 20 * 1024**3 / 2, rel=1e-6)


def test_gpu_machine_uses_the_product_table() -> None:
    machine = LocalMachine(("NVIDIA A100-SXM4-80GB",) * 2, (81920,) * 2, memory_bytes=200 * 1024**3, cpus=32)
    capacity = pool_capacity(local_pool(machine, ranks=2))
    assert capacity.product == "NVIDIA-A100-SXM4-80GB" and capacity.bf16
    assert capacity.peak_flops_bf16 == pytest.approx(312e12)
    with pytest.raises(ValueError, match="has 2 GPU"):
        local_pool(machine, ranks=4)
