"""A plan names only kernels its runtime has: on every pool kind, the default plan's attention kernel comes with
the install that runs it, locally (``pip install 'memfit[trainer]'``: ``memfit run --local`` plans with what this
environment imports) and in the trainer image (the operator plans with the chart's ``trainer.kernelPackages``)."""

from __future__ import annotations

import importlib.metadata
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from rich.console import Console

from memfit.api.finetunejob import FineTuneJob, FineTuneJobSpec
from memfit.api.gpupool import GPUPool
from memfit.api.runtime import IMAGE_RUNTIME, Runtime, package_needed
from memfit.api.vocabulary import Attention
from memfit.catalog.gpus import GPU_PRODUCTS
from memfit.cli.plan_table import print_plan_table
from memfit.planner.search import PlanningError, plan_job
from tests.planning_fixtures import DECLARED_LLAMA, job, pool

ROOT = Path(__file__).resolve().parents[1]
POOL_KINDS = [*GPU_PRODUCTS, "cpu"]
PROFILED = "qwen2.5-0.5b"
"""A preset planned from its stored profile, small enough to fit every pool kind."""


def _typed_job() -> FineTuneJobSpec:
    shape = DECLARED_LLAMA
    architecture = {
        "family": shape.family.value,
        "hiddenSize": shape.hidden_size,
        "intermediateSize": shape.intermediate_size,
        "numLayers": shape.num_layers,
        "numAttentionHeads": shape.num_attention_heads,
        "numKeyValueHeads": shape.num_key_value_heads,
        "vocabSize": shape.vocab_size,
    }
    base = job(PROFILED).model_dump(by_alias=True, exclude_none=True)
    base["model"] = {"name": "declared", "architecture": architecture}
    return FineTuneJobSpec.model_validate(base)


JOBS = {"profiled": lambda: job(PROFILED, sequence=4096), "typed": _typed_job}


def _pool(kind: str) -> GPUPool:
    return pool("p", kind, 8, 1, 1000)


def _trainer_extra_distributions() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {Requirement(dep).name for dep in project["optional-dependencies"]["trainer"]}


def _image_distributions() -> set[str]:
    """What the trainer image installs: the trainer extra, and the kernel packages the chart says it carries
    (tests/chart/test_dockerfile.py holds those to the Dockerfile's KERNEL_PACKAGES)."""
    values = yaml.safe_load((ROOT / "charts" / "memfit" / "values.yaml").read_text())
    return _trainer_extra_distributions() | set(values["trainer"]["kernelPackages"])


@pytest.mark.parametrize("kind", POOL_KINDS)
@pytest.mark.parametrize("model", JOBS)
@pytest.mark.slow
def test_the_default_plan_uses_kernels_the_image_and_the_local_install_have(kind: str, model: str) -> None:
    spec = JOBS[model]()
    for runtime, installed in ((IMAGE_RUNTIME, _image_distributions()), (Runtime.local(), None)):
        chosen = plan_job(spec, [_pool(kind)], runtime=runtime).chosen
        assert chosen is not None, f"{model} job fits no {kind} pool"
        package = package_needed(chosen.strategy.attention)
        if installed is not None:
            assert package in installed, f"{kind}: the image plan needs {package}, which the image lacks"
        else:
            importlib.metadata.version(package)  # installed here, where `memfit run --local` would train


def test_flash_is_planned_where_the_trainer_has_flash_attn() -> None:
    """The runtime decides: the same profiled job on an A100 runs flash once the trainer has flash-attn (its
    unmasked terms hold less than SDPA's masks), and SDPA without it."""
    spec, pools = job(PROFILED, sequence=4096), [_pool("NVIDIA-A100-SXM4-80GB")]
    with_flash = plan_job(spec, pools, runtime=Runtime.of(["flash-attn"])).chosen
    without = plan_job(spec, pools, runtime=IMAGE_RUNTIME).chosen
    assert with_flash is not None and without is not None
    assert (with_flash.strategy.attention, without.strategy.attention) == (Attention.FLASH, Attention.SDPA)


def test_a_pinned_kernel_the_trainer_lacks_is_refused_in_one_line() -> None:
    spec = job(PROFILED, strategy={"attention": "flash"})
    with pytest.raises(
        PlanningError, match=r"strategy.attention flash: the trainer has no flash-attn .*kernelPackages"
    ):
        plan_job(spec, [_pool("NVIDIA-A100-SXM4-80GB")])


def test_an_unknown_kernel_package_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown kernel package flash-atn: memfit plans with flash-attn"):
        Runtime.of(["flash-atn"])


def test_packing_is_decided_per_model_and_said_in_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """Left out, dataset.packing packs wherever the model keeps documents apart: not Qwen3.5's Gated DeltaNet
    layers, unless the trainer has flash-linear-attention and attends with flash."""
    pools = [_pool("NVIDIA-H100-80GB-HBM3")]
    qwen35 = plan_job(job("qwen3.5-27b", "lora"), pools).chosen
    llama = plan_job(job(PROFILED, "lora"), pools).chosen
    kernels = Runtime.of(["flash-attn", "flash-linear-attention"])
    with_fla = plan_job(job("qwen3.5-27b", "lora"), pools, runtime=kernels).chosen
    assert qwen35 is not None and llama is not None and with_fla is not None
    assert (qwen35.strategy.packing, llama.strategy.packing) == (False, True)
    assert "unpacked" in qwen35.strategy.summary().split()
    assert (with_fla.strategy.packing, with_fla.strategy.attention) == (True, Attention.FLASH)
    document = FineTuneJob.model_validate(
        {"apiVersion": "memfit.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "q"},
         "spec": job("qwen3.5-27b", "lora").model_dump(by_alias=True, mode="json", exclude_none=True)}
    )  # fmt: skip
    print_plan_table(document, plan_job(document.spec, pools), Console(file=sys.stdout, width=200))
    assert "Packing: off (this model's linear-attention layers" in capsys.readouterr().out
