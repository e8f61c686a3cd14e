"""Spec changes: the CRD's transition rule (evaluated offline with a CEL implementation: the test API server
1.20 predates CEL) and the operator decide alike. Before the first launch any change is allowed (fixing an
Invalid or Unschedulable job plans it anew, as the README says); after it, only spec.suspend may change."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml

from memfit.api.crd import finetunejob_crd
from memfit.api.vocabulary import Phase
from tests.operator.test_reconcile import FakeCluster, job_document

ROOT = Path(__file__).parent.parent.parent


def rule() -> celpy.Runner:
    schema = finetunejob_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert "x-kubernetes-validations" not in schema["properties"]["spec"], "a rule on spec cannot see status"
    [validation] = schema["x-kubernetes-validations"]
    environment = celpy.Environment()
    return environment.program(environment.compile(validation["rule"]))


def checked_in_rule() -> str:
    crd = yaml.safe_load((ROOT / "crds" / "memfit.dev_finetunejobs.yaml").read_text())
    [validation] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    return str(validation["rule"])


def allowed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """What an API server with CEL says to an update from ``old`` to ``new`` (a rule that fails to evaluate,
    e.g. on a missing field, refuses the update just the same)."""
    stored = {k: v for k, v in old.items() if k in ("spec", "status")}
    updated = {k: v for k, v in new.items() if k in ("spec", "status")}
    result = rule().evaluate({"self": celpy.json_to_cel(updated), "oldSelf": celpy.json_to_cel(stored)})
    return result is True or (isinstance(result, celpy.celtypes.BoolType) and bool(result))


def as_stored(document: dict[str, Any]) -> dict[str, Any]:
    """The job as the API server stores it: the manifest with the CRD's defaults (method, suspend, maxRestarts,
    maxReplans), and none for the fields it does not default (the example has no `strategy`: absent)."""
    stored = copy.deepcopy(document)
    stored["spec"].setdefault("method", "auto")
    stored["spec"].setdefault("suspend", False)
    stored["spec"].setdefault("maxRestarts", 3)
    stored["spec"].setdefault("maxReplans", 3)
    return json.loads(json.dumps(stored))


def operator_accepts(cluster: FakeCluster, **changes: Any) -> bool:
    """Edit the spec and run a pass: False when the operator refuses the change (Ready=False SpecImmutable)."""
    cluster.edit_spec(**changes)
    cluster.step()
    ready = cluster.condition("Ready")
    return not (ready["status"] == "False" and ready["reason"] == "SpecImmutable")


def test_the_checked_in_crd_carries_the_rule() -> None:
    schema = finetunejob_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert checked_in_rule() == schema["x-kubernetes-validations"][0]["rule"]


@pytest.mark.parametrize(
    ("spec", "fix"),
    [
        ({"strategy": {"microBatchSize": 5}}, {"strategy": {"microBatchSize": 4}}),  # Invalid: 64 % 5
        ({"resources": {"pool": "h100-nowhere"}}, {"resources": {"pool": "a100-80gb"}}),  # Unschedulable
    ],
)
@pytest.mark.slow
def test_a_job_that_never_launched_may_be_fixed(spec: dict[str, Any], fix: dict[str, Any]) -> None:
    cluster = FakeCluster(as_stored(job_document(**spec)))
    cluster.step()
    assert cluster.raw_status["phase"] in (Phase.INVALID, Phase.UNSCHEDULABLE)
    assert "launchedSpec" not in cluster.raw_status
    before = copy.deepcopy(cluster.job)
    assert operator_accepts(cluster, **fix)
    assert allowed(before, cluster.job), "the CRD rule refuses the fix the README promises"
    assert cluster.raw_status["phase"] == Phase.LAUNCHING  # the fixed spec is planned and launched


def test_before_launch_optional_fields_may_come_and_go() -> None:
    cluster = FakeCluster(as_stored(job_document(suspend=True)))  # created suspended: planned, not launched
    cluster.step()
    assert cluster.raw_status["phase"] == Phase.SUSPENDED and "launchedSpec" not in cluster.raw_status
    before = copy.deepcopy(cluster.job)
    assert operator_accepts(cluster, strategy={"zeroStage": 3}, training={"sequenceLength": 1024})
    assert allowed(before, cluster.job)


@pytest.mark.parametrize(
    "change",
    [
        {"training": {"sequenceLength": 1024}},
        {"method": "qlora"},
        {"maxRestarts": 5},
        {"strategy": {"zeroStage": 3}},  # a field the stored spec did not have
        {"output": {"pvc": "elsewhere"}},
    ],
)
@pytest.mark.slow
def test_after_launch_only_suspend_may_change(change: dict[str, Any]) -> None:
    cluster = FakeCluster(as_stored(job_document()))
    cluster.step()
    assert cluster.raw_status["phase"] == Phase.LAUNCHING and "launchedSpec" in cluster.raw_status
    before = copy.deepcopy(cluster.job)
    assert not operator_accepts(cluster, **change)
    assert not allowed(before, cluster.job)


def test_after_launch_suspend_changes_even_without_the_undefaulted_fields() -> None:
    """The stored spec has no `strategy` (the CRD defaults none): the rule must not fail on the missing field,
    which would refuse every update, suspending included."""
    cluster = FakeCluster(as_stored(job_document()))
    cluster.step()
    assert "strategy" not in cluster.job["spec"]
    before = copy.deepcopy(cluster.job)
    assert operator_accepts(cluster, suspend=True)
    assert allowed(before, cluster.job)
    assert cluster.raw_status["phase"] == Phase.SUSPENDED


def test_status_updates_pass_the_rule() -> None:
    """The operator's own status writes (the first launch records launchedSpec) are updates too."""
    cluster = FakeCluster(as_stored(job_document()))
    before = copy.deepcopy(cluster.job)
    cluster.step()
    assert allowed(before, cluster.job) and allowed(cluster.job, cluster.job)
