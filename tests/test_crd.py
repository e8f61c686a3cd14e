"""The CRDs in crds/ are generated from the pydantic models; any drift fails here."""

from __future__ import annotations

import json
from pathlib import Path

import celpy
import pytest
import yaml

from memfit.api.base import to_camel
from memfit.api.crd import CRD_FILES, crd_documents_yaml, crd_yaml
from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.plan import Strategy

ROOT = Path(__file__).parent.parent
CRDS = ROOT / "crds"


@pytest.mark.parametrize("name", sorted(CRD_FILES))
def test_checked_in_crd_matches_models(name: str) -> None:
    assert (CRDS / name).read_text() == crd_yaml(CRD_FILES[name]()), (
        f"crds/{name} drifted from the models: regenerate with `memfit crd` (see README)"
    )


def _walk(schema: dict, path: str = ""):
    yield path, schema
    for name, child in schema.get("properties", {}).items():
        yield from _walk(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from _walk(schema[key], f"{path}[]")


@pytest.mark.parametrize("name", sorted(CRD_FILES))
def test_schema_is_structural_and_documented(name: str) -> None:
    crd = yaml.safe_load((CRDS / name).read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    text = json.dumps(schema)
    for forbidden in ('"$ref"', '"anyOf"', '"oneOf"', '"const"', '"title"'):
        assert forbidden not in text
    for path, node in _walk(schema, ""):
        assert not ("properties" in node and "additionalProperties" in node), f"{path}: both are forbidden"
    for path, node in _walk(schema["properties"]["spec"], "spec"):
        assert "type" in node, f"{path} has no type (a structural schema needs one everywhere)"
        if not path.endswith("[]"):
            assert node.get("description"), f"{path} has no description (kubectl explain shows it)"


def test_kubernetes_spellings_of_acronyms() -> None:
    spec = yaml.safe_load((CRDS / "memfit.dev_finetunejobs.yaml").read_text())
    properties = spec["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert "maxGPUs" in properties["resources"]["properties"]
    pools = yaml.safe_load((CRDS / "memfit.dev_gpupools.yaml").read_text())
    pool = pools["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert {"gpuMemoryGiB", "cpuMemoryGiBPerNode", "peakTFLOPS", "nvmeGiBPerNode"} <= set(pool)


def test_printer_columns_read_fields_that_exist() -> None:
    crd = yaml.safe_load((CRDS / "memfit.dev_finetunejobs.yaml").read_text())
    version = crd["spec"]["versions"][0]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    for column in version["additionalPrinterColumns"]:
        path = column["jsonPath"].strip(".").split(".")
        if path[0] != "status":
            continue
        node = status
        for part in path[1:]:
            node = node["properties"][part]
        assert node["type"] == column["type"] or (node["type"], column["type"]) == ("integer", "integer")


def test_memfit_crd_prints_every_document() -> None:
    """Every CRD the operator needs: memfit's, and kopf's peering CRDs (a replicated operator waits for one)."""
    documents = list(yaml.safe_load_all(crd_documents_yaml()))
    assert {d["spec"]["names"]["kind"] for d in documents} == {"FineTuneJob", "GPUPool", "ClusterKopfPeering",
                                                               "KopfPeering"}  # fmt: skip


def test_spec_defaults_in_crd_equal_model_defaults() -> None:
    crd = yaml.safe_load((CRDS / "memfit.dev_finetunejobs.yaml").read_text())
    training = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["training"]
    defaults = FineTuneJobSpec.model_fields["training"].default_factory()  # type: ignore[misc]
    assert training["properties"]["globalBatchSize"]["default"] == defaults.global_batch_size
    assert training["properties"]["sequenceLength"]["default"] == defaults.sequence_length


def test_status_plan_strategy_carries_every_field_of_the_planners_strategy() -> None:
    """One record (memfit.api.plan.Strategy) is both what the planner computes with and status.plan.strategy."""
    crd = yaml.safe_load((CRDS / "memfit.dev_finetunejobs.yaml").read_text())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    strategy = status["properties"]["plan"]["properties"]["strategy"]
    assert list(strategy["properties"]) == [to_camel(name) for name in Strategy.__dataclass_fields__]


def _immutability_rule() -> tuple[str, dict]:
    """The rule sits at the root of the schema: whether the spec may change depends on status.launchedSpec."""
    crd = yaml.safe_load((CRDS / "memfit.dev_finetunejobs.yaml").read_text())
    [validation] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    return validation["rule"], FineTuneJobSpec.model_validate(yaml.safe_load(
        (ROOT / "examples" / "llama-3.1-8b-lora.yaml").read_text())["spec"]).to_api()  # fmt: skip


@pytest.mark.parametrize("field", [f.alias or n for n, f in FineTuneJobSpec.model_fields.items()])
@pytest.mark.slow
def test_the_cel_rule_lets_only_suspend_change(field: str) -> None:
    """The CRD's transition rule (Kubernetes 1.25+, which the test API server predates), evaluated by a CEL
    implementation on a defaulted spec, as the API server sees it: after the first launch (status.launchedSpec),
    suspend may change, nothing else (before it, see tests/operator/test_spec_changes.py)."""
    rule, spec = _immutability_rule()
    old = {"spec": spec, "status": {"phase": "Running", "launchedSpec": spec}}
    environment = celpy.Environment()
    program = environment.program(environment.compile(rule))
    changed = json.loads(json.dumps(old))
    value = changed["spec"][field]
    changed["spec"][field] = (not value if isinstance(value, bool) else value + 1 if isinstance(value, int)
                              else f"{value}-x" if isinstance(value, str) else {**value, "changed": True})  # fmt: skip
    allowed = program.evaluate({"self": celpy.json_to_cel(changed), "oldSelf": celpy.json_to_cel(old)})
    assert bool(allowed) is (field == "suspend")
    assert bool(program.evaluate({"self": celpy.json_to_cel(old), "oldSelf": celpy.json_to_cel(old)}))


@pytest.mark.parametrize("name", sorted(CRD_FILES))
def test_every_number_in_a_spec_is_bounded(name: str) -> None:
    """The API server refuses what the models refuse: no integer or number without a minimum and a maximum
    (an unbounded globalBatchSize once made the planner run for ever)."""
    crd = yaml.safe_load((CRDS / name).read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    numbers = [(path, node) for path, node in _walk(spec, "spec") if node.get("type") in ("integer", "number")]
    assert numbers
    for path, node in numbers:
        assert "minimum" in node and "maximum" in node, f"{path} is unbounded"
