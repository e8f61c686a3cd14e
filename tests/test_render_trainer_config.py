"""The rendered trainer config: every plan of the examples renders a config the trainer loads as it is, and
no path of a job (validated or not) renders outside its volume."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from memfit.api.base import Source, VolumePath
from memfit.api.finetunejob import FineTuneJob
from memfit.api.gpupool import pool_capacity
from memfit.api.loading import load_documents
from memfit.api.vocabulary import Method, Precision
from memfit.contract.reader import ConfigError, load_config
from memfit.contract.trainer_config import TrainerConfig
from memfit.planner.search import plan_job
from memfit.planner.throughput import peak_flops
from memfit.render.trainer_config import POD_MOUNTS, Mounts, PathOutsideVolumeError, inside, render_trainer_config

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"
JOBS = ["llama-3.1-8b-lora.yaml", "custom-architecture.yaml", "tiny/job.yaml"]
METHODS = list(Method)
PRECISIONS = [Precision.AUTO, Precision.FP16, Precision.FP32]


def example_job(name: str) -> FineTuneJob:
    return load_documents(EXAMPLES / name).jobs[0]


@pytest.mark.parametrize(("name", "method", "precision"), list(itertools.product(JOBS, METHODS, PRECISIONS)))
@pytest.mark.slow
def test_every_candidate_of_the_examples_renders_a_config_the_trainer_loads(
    name: str, method: Method, precision: Precision, tmp_path: Path
) -> None:
    """Strict JSON, bounds, the DeepSpeed section and its agreement with training: all that the trainer
    checks holds for what the renderer makes, across strategies (ZeRO stages, offload, precisions...)."""
    job = example_job(name)
    training = job.spec.training.model_copy(update={"precision": precision})
    job = job.model_copy(update={"spec": job.spec.model_copy(update={"method": method, "training": training})})
    pools = load_documents(EXAMPLES / "inventory.yaml").pools
    rendered = 0
    for pool in pools:
        result = plan_job(job.spec.model_copy(update={"resources": job.spec.resources.model_copy(
            update={"pool": pool.metadata.name})}), [pool])  # fmt: skip
        for candidate in result.candidates:
            flops = peak_flops(pool_capacity(pool), candidate.strategy.precision)
            config = render_trainer_config(job, candidate, peak_flops=flops)
            path = tmp_path / "config.json"
            path.write_text(config.to_json())
            assert load_config(path) == config, candidate.strategy.summary()
            rendered += 1
    if method == Method.AUTO and precision == Precision.AUTO:
        assert rendered, f"{name}: no candidate on any example pool"


def test_pod_paths_are_inside_the_pod_mounts() -> None:
    config = render_trainer_config(example_job("llama-3.1-8b-lora.yaml"), _first_plan("llama-3.1-8b-lora.yaml"))
    assert config.volumes is not None
    assert (config.volumes.data, config.volumes.output) == (POD_MOUNTS.data, POD_MOUNTS.output)
    assert config.data.path.startswith(POD_MOUNTS.data + "/") and config.output_dir.startswith(POD_MOUNTS.output)


def _first_plan(name: str):  # type: ignore[no-untyped-def]
    job = example_job(name)
    pools = load_documents(EXAMPLES / "inventory.yaml").pools
    result = plan_job(job.spec, pools)
    assert result.chosen is not None
    return result.chosen


@pytest.mark.parametrize(
    ("path", "expected"),
    [(None, "/mnt/o"), ("", "/mnt/o"), ("/", "/mnt/o"), ("a/b/", "/mnt/o/a/b"), ("/a", "/mnt/o/a"),
     ("//a", "/mnt/o/a"), ("a//./b", "/mnt/o/a/b")],
)  # fmt: skip
def test_inside_joins_below_the_root(path: str | None, expected: str) -> None:
    assert inside("/mnt/o", path) == expected


@pytest.mark.parametrize("path", ["..", "../x", "/../x", "a/../../b", "a/..", "//..", "a\x00b", "a\nb"])
def test_inside_refuses_a_path_out_of_its_volume(path: str) -> None:
    with pytest.raises(PathOutsideVolumeError):
        inside("/mnt/o", path)


@pytest.mark.parametrize("root", ["relative", "/mnt/../etc"])
def test_inside_refuses_a_root_that_is_not_one(root: str) -> None:
    with pytest.raises(PathOutsideVolumeError):
        inside(root, "x")


def _unvalidated(job: FineTuneJob, **spec: object) -> FineTuneJob:
    return job.model_copy(update={"spec": job.spec.model_copy(update=spec)})


def test_an_unvalidated_job_cannot_render_a_path_out_of_its_volume() -> None:
    job, plan = example_job("llama-3.1-8b-lora.yaml"), _first_plan("llama-3.1-8b-lora.yaml")
    escapes = [
        _unvalidated(job, output=VolumePath.model_construct(pvc="checkpoints", path="../../tmp/x")),
        _unvalidated(job, dataset=job.spec.dataset.model_copy(
            update={"source": Source.model_construct(pvc="data", path="/../../etc/shadow")})),
        _unvalidated(job, model=job.spec.model.model_copy(
            update={"source": Source.model_construct(pvc="models", path="../other-team/model")})),
    ]  # fmt: skip
    for hostile in escapes:
        with pytest.raises(PathOutsideVolumeError, match="climbs out"):
            render_trainer_config(hostile, plan)
        with pytest.raises(PathOutsideVolumeError):
            render_trainer_config(hostile, plan, mounts=Mounts(model="/l/m", data="/l/d", output="/l/o"))


def test_a_model_on_a_volume_is_inside_the_model_mount() -> None:
    job, plan = example_job("llama-3.1-8b-lora.yaml"), _first_plan("llama-3.1-8b-lora.yaml")
    job = _unvalidated(job, model=job.spec.model.model_copy(update={"source": Source(pvc="models", path="llama/")}))
    config = render_trainer_config(job, plan)
    assert config.model.name_or_path == "/mnt/model/llama"
    assert config.volumes is not None and config.volumes.model == "/mnt/model"


def test_the_contract_refuses_a_path_outside_a_named_volume() -> None:
    config = render_trainer_config(example_job("llama-3.1-8b-lora.yaml"), _first_plan("llama-3.1-8b-lora.yaml"))
    document = config.to_api()
    document["outputDir"] = "/mnt/outputs-of-another-job"  # a sibling, not a child, of /mnt/output
    with pytest.raises(ValueError, match="outside the output volume"):
        TrainerConfig.model_validate(document)


def test_an_unreadable_config_keeps_its_termination_log(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"version": 1, "job": "a/b", "terminationLog": "/pod/termination-log"}')
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert refused.value.termination_log == "/pod/termination-log"
    path.write_text('{"terminationLog": "relative/log"}')
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert refused.value.termination_log is None
