"""The API models parse as strictly as the API server's structural schema, within documented bounds, and stay
readable for what a real API server returns."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from memfit.api.base import ObjectMeta, Source, VolumePath, shown
from memfit.api.finetunejob import FineTuneJob, TrainingSpec
from memfit.api.gpupool import GPUPool, pool_capacity
from memfit.api.loading import describe_validation_error
from memfit.planner.search import plan_job

ROOT = Path(__file__).parent.parent.parent
JOB: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "llama-3.1-8b-lora.yaml").read_text())
POOLS: list[dict[str, Any]] = list(yaml.safe_load_all((ROOT / "examples" / "inventory.yaml").read_text()))


def problem(model: type[Any], document: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as refused:
        model.model_validate(document)
    return describe_validation_error(refused.value)


@pytest.mark.parametrize(
    "field, value",
    [("globalBatchSize", "64"), ("globalBatchSize", 64.0), ("globalBatchSize", True), ("epochs", 2**64),
     ("globalBatchSize", 4_611_686_018_427_387_904), ("weightDecay", math.inf), ("learningRate", math.nan),
     ("warmupRatio", "0.1"), ("weightDecay", False), ("seed", -1)],
)  # fmt: skip
def test_training_numbers_are_strict_and_bounded(field: str, value: Any) -> None:
    assert f"{field}:" in problem(TrainingSpec, {field: value})


def test_an_integer_is_a_number_and_python_may_use_snake_case() -> None:
    """JSON has one number type: 0 is a valid weightDecay. Code builds models with Python names."""
    assert TrainingSpec.model_validate({"weightDecay": 0}).weight_decay == 0.0
    assert TrainingSpec.model_validate_json('{"weightDecay": 1, "learningRate": 2e-5}').learning_rate == 2e-5
    assert TrainingSpec(global_batch_size=8).global_batch_size == 8


def test_suspend_is_a_boolean_not_a_word() -> None:
    job = copy.deepcopy(JOB)
    job["spec"]["suspend"] = "yes"
    assert "spec.suspend: Input should be a valid boolean, got 'yes'" in problem(FineTuneJob, job)


@pytest.mark.parametrize(
    "field, value",
    [("gpuMemoryGiB", 1e-9), ("gpuMemoryGiB", 1e308), ("cpuMemoryGiBPerNode", 0.0), ("nodes", 10**9),
     ("gpusPerNode", 65), ("nvmeGBpsPerNode", 1e-9), ("nvmeGiBPerNode", math.inf)],
)  # fmt: skip
def test_a_pool_the_planner_cannot_divide_by_is_refused(field: str, value: Any) -> None:
    pool = copy.deepcopy(POOLS[1])
    pool["spec"][field] = value
    assert f"spec.{field}:" in problem(GPUPool, pool)


def test_the_smallest_and_largest_pools_plan_with_finite_numbers() -> None:
    pools = []
    for name, scale in (("smallest", 0), ("largest", 1)):
        low = scale == 0
        pools.append(GPUPool.model_validate({"metadata": {"name": name}, "spec": {
            "gpuProduct": "X", "gpuMemoryGiB": 1 / 16 if low else 4096, "gpusPerNode": 1 if low else 64,
            "nodes": 1 if low else 10_000, "cpuMemoryGiBPerNode": 1 / 16 if low else 65_536,
            "nvmeGiBPerNode": 0 if low else 65_536, "nvmeGBpsPerNode": 0.01 if low else 1e5,
            "interconnect": {"intraNodeGBps": 0.01 if low else 1e5, "interNodeGBps": 0.01 if low else 1e5},
            "peakTFLOPS": {"fp16": 0.01 if low else 1e6, "bf16": 0.01 if low else 1e6}}}))  # fmt: skip
    for pool in pools:
        capacity = pool_capacity(pool)
        assert capacity.gpu_memory_bytes > 0 and capacity.cpu_memory_bytes_per_node > 0
    result = plan_job(FineTuneJob.model_validate(JOB).spec, pools)
    for candidate in [*result.candidates, *result.rejected]:
        assert math.isfinite(candidate.throughput.tokens_per_second)
        assert math.isfinite(candidate.throughput.step_seconds)


@pytest.mark.parametrize("path", ["../x", "a/../../b", "/..", "..", "a/..", "x\ty", "x\x00", ""])
def test_a_path_cannot_leave_its_claim(path: str) -> None:
    assert "path:" in problem(VolumePath, {"pvc": "data", "path": path})
    assert "path:" in problem(Source, {"pvc": "data", "path": path})


@pytest.mark.parametrize("path", ["/", "a", "/a/b/", "./a", "...", "a..b/c", "x/.hidden"])
def test_paths_inside_the_claim(path: str) -> None:
    assert VolumePath.model_validate({"pvc": "data", "path": path}).path == path


@pytest.mark.parametrize("name", ["Data", "da_ta", "-data", "data-", "a..b", "a" * 254, "", "da ta", "[/]"])
def test_claim_and_secret_names_are_dns_subdomains(name: str) -> None:
    assert "pvc:" in problem(VolumePath, {"pvc": name})
    assert "tokenSecretRef.name:" in problem(Source, {"hub": "a/b", "tokenSecretRef": {"name": name}})


@pytest.mark.parametrize("name", ["data", "d", "my-data.v2", "a" * 253, "0data"])
def test_valid_claim_names(name: str) -> None:
    assert VolumePath.model_validate({"pvc": name}).pvc == name


def test_metadata_from_an_api_server_is_read_and_kept() -> None:
    """What kopf hands the operator: every standard field, the ones memfit does not read kept as extras."""
    metadata = {"name": "llama-chat", "namespace": "research", "uid": "0f1e-uid", "resourceVersion": "7",
                "generation": 2, "creationTimestamp": "2024-05-01T10:00:00Z", "labels": {"a": "b"},
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"},
                "finalizers": ["memfit.dev/cleanup"], "managedFields": [{"manager": "kubectl", "fieldsV1": {}}],
                "ownerReferences": [], "deletionTimestamp": "2024-05-02T10:00:00Z",
                "deletionGracePeriodSeconds": 0, "generateName": "llama-", "selfLink": "/x"}  # fmt: skip
    parsed = ObjectMeta.model_validate(metadata)
    assert parsed.model_extra is not None and parsed.model_extra["uid"] == "0f1e-uid"
    assert parsed.model_dump(by_alias=True, exclude_none=True) == metadata


@pytest.mark.parametrize(
    "metadata, field",
    [({"name": "x", "labesl": {}}, "metadata.labesl: unknown field"),
     ({"name": "x", "resource_version": "1"}, "metadata.resource_version: unknown field"),
     ({"name": "x", "generation": "1"}, "metadata.generation:"), ({"name": "x", "labels": {"a": 1}}, "labels.a:"),
     ({"name": 5}, "metadata.name:"), ({"name": ""}, "metadata.name:")],
)  # fmt: skip
def test_metadata_takes_only_the_standard_fields(metadata: dict[str, Any], field: str) -> None:
    job = {**JOB, "metadata": metadata}
    assert field in problem(FineTuneJob, job)


def test_an_echoed_value_is_short_and_printable() -> None:
    for value in ["x" * 10**6, "\x1b[31m\n\u202e", list(range(10**5)), {"a": {"b": {"c": {"d": 1}}}}, 10**4000]:
        text = shown(value)
        assert len(text) <= 90 and text.isprintable()


def test_many_problems_make_one_short_line() -> None:
    job = copy.deepcopy(JOB)
    job["spec"].update({f"typo{index}\n": index for index in range(1000)})
    message = problem(FineTuneJob, job)
    assert message.isprintable() and len(message) < 1000 and "and 997 more problem(s)" in message
