"""``memfit run --local`` of a model directory that types no sizes: profiled from its config.json, planned
from the profile, trained to the end on 2 CPU ranks (the Done-means of planning models from their own code).

Each family keeps its layer pattern in a tiny random model (tests.trainer.new_families): Gated DeltaNet and
full attention (qwen3_5_text), sliding and full layers with per-layer inputs (gemma4_text), fused experts
(qwen3_moe) and gpt-oss's eager-only attention with sinks. The plan chooses everything the job does not pin,
packing included: Qwen3.5's default LoRA job trains unpacked.

Profiling and the trainer's launch check run for every family; torchrun (two ranks importing the trainer) only
for the families in TRAINED: Qwen3.5's default LoRA job (unpacked, Gated DeltaNet under adapters) and Gemma 4
fully fine-tuned (the one full job, per-layer inputs trained). The plans of the other two are checked with
``--dry-run`` (the config the trainer would get, and its launch check on the model, tokenizer and data): every
plan here is the same DeepSpeed ZeRO-1 recipe, whose LoRA training from a planned config the Qwen3.5 run
covers, and tests/trainer/test_new_families.py trains both from their directories under torchrun (qwen3_moe's
fused experts under LoRA adapters, gpt_oss's eager attention).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from memfit.contract.reader import ConfigError
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer.preflight import check
from tests.trainer.new_families import write_model_directory
from tests.trainer.runs import logged_losses, trainer_env

STEPS = 3
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_5_text": {"method": "lora"},  # the defaults: Gated DeltaNet cannot keep packed documents apart
    "gemma4_text": {"method": "full"},
    "qwen3_moe": {"method": "lora", "lora": {"dropout": 0.0}},  # peft adapts the fused experts in place
    "gpt_oss": {"method": "lora"},
}
TRAINED = {"qwen3_5_text", "gemma4_text"}
"""The families run to the end; the others are profiled, planned and launch-checked (``--dry-run``)."""


def write_job(tmp_path: Path, model_type: str) -> Path:
    """A job training the model saved in ``models/<model_type>``, with no ``architecture``."""
    options = FAMILIES[model_type]
    write_model_directory(model_type, tmp_path / "models" / model_type)
    data = tmp_path / "data"
    data.mkdir()
    lines = [json.dumps({"text": f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 5 + 1)})
             for i in range(64)]  # fmt: skip
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    job = {
        "apiVersion": "memfit.dev/v1alpha1",
        "kind": "FineTuneJob",
        "metadata": {"name": model_type.replace("_", "-")},
        "spec": {
            "model": {"name": model_type, "source": {"pvc": "models", "path": model_type}},
            "dataset": {
                "source": {"pvc": "data", "path": "train.jsonl"},
                "format": "jsonl",
                "textField": "text",
            },
            "method": options["method"],
            "training": {
                "globalBatchSize": 4,
                "sequenceLength": 64,
                "maxSteps": STEPS,
                "learningRate": 1e-3,
                "checkpointEverySteps": STEPS,
            },  # fmt: skip
            "output": {"pvc": "output", "path": "run/"},
            **({"lora": options["lora"]} if "lora" in options else {}),
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def memfit(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memfit.cli.main", *args], env=env, capture_output=True, text=True, timeout=600
    )


class LocalRuns:
    """``memfit run --local --nproc 2`` of each family's job (``--dry-run`` outside TRAINED), each run once in a
    directory of its own, which the tests read and never change."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]] = {}

    def __call__(self, model_type: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
        """The directory the job ran in (its models, data, profile cache and output) and what memfit said."""
        if model_type not in self._runs:
            directory = self._factory.mktemp(model_type)
            job = write_job(directory, model_type)
            env = trainer_env(MEMFIT_PROFILE_CACHE=str(directory / "profiles"))
            dry_run = [] if model_type in TRAINED else ["--dry-run"]
            self._runs[model_type] = directory, memfit("run", str(job), "--local", "--nproc", "2", *dry_run, env=env)
        return self._runs[model_type]


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory: pytest.TempPathFactory) -> LocalRuns:
    return LocalRuns(tmp_path_factory)


@pytest.mark.distributed
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_a_model_directory_without_typed_sizes_is_profiled_planned_and_trained(
    local_runs: LocalRuns, model_type: str
) -> None:
    """Trained to the end for the families in TRAINED; the others' plans and launch checks (module docstring)."""
    tmp_path, result = local_runs(model_type)
    assert result.returncode == 0, result.stderr[-6000:]
    assert "profiling the model in" in result.stderr
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1  # cached for the next plan
    config = json.loads((tmp_path / "output" / "run" / ".memfit" / "trainer-config.json").read_text())
    assert config["model"].get("architecture") is None
    assert config["model"]["plannedFields"]["model_type"] == model_type
    if model_type == "gpt_oss":
        assert config["training"]["attention"] == "eager"  # transformers has no SDPA for it
    # Packing left to the plan: off only where linear-attention layers would mix packed documents.
    assert config["data"]["packing"] is (model_type != "qwen3_5_text")
    final = tmp_path / "output" / "run" / "final"
    if model_type not in TRAINED:
        assert logged_losses(result.stdout) == {} and not final.exists(), result.stdout  # planned, not trained
        return
    losses = logged_losses(result.stdout)
    assert set(losses) >= {1, STEPS} and all(math.isfinite(loss) for loss in losses.values()), result.stdout
    assert (
        final / ("model.safetensors" if FAMILIES[model_type]["method"] == "full" else "adapter_model.safetensors")
    ).is_file()


@pytest.mark.slow  # the qwen3_moe job profiled and planned (memfit run --dry-run) when no test ran it yet
def test_a_directory_holding_another_model_than_the_profiled_one_is_refused_before_training(
    tmp_path: Path, local_runs: LocalRuns
) -> None:
    """Planned from the profile of one model, run on a directory now holding another: the trainer's preflight
    compares the profiled config fields with the directory's config.json (one line, exit 2 in a pod). The plan
    is the qwen3_moe job's (run once for the test above): its directory copied here with the config it rendered
    (every path in it moved with it), the shared one left as it was."""
    directory, planned = local_runs("qwen3_moe")
    assert planned.returncode == 0, planned.stderr
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    config_path = tmp_path / "output" / "run" / ".memfit" / "trainer-config.json"
    rendered = config_path.read_text()
    assert f"{directory.resolve()}/models/qwen3_moe" in rendered
    moved = rendered.replace(f"{directory.resolve()}/", f"{tmp_path.resolve()}/")
    write_model_directory("qwen3_5_text", tmp_path / "models" / "qwen3_moe")  # another model, same place
    config = TrainerConfig.model_validate_json(moved)
    assert Path(config.model.name_or_path) == tmp_path.resolve() / "models" / "qwen3_moe"
    with pytest.raises(ConfigError) as refused:
        check(config, {"WORLD_SIZE": str(config.world_size)})
    assert "holds a qwen3_5_text model" in str(refused.value) and "the plan was made for" in str(refused.value)
