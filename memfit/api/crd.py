"""Generate the CustomResourceDefinitions from the pydantic models (the one source of truth).

pydantic emits JSON Schema 2020-12; Kubernetes wants a *structural* OpenAPI v3.0 schema: no ``$ref``,
``nullable`` instead of ``anyOf: [X, null]``, boolean ``exclusiveMinimum``, no ``title``/``const``.
``crds/`` holds the output and a test fails when it drifts from the models.

kopf's peering CRDs are here too (``PEERING_CRD_FILES``): the operator's replicas need one of them, so
``memfit crd`` and ``crds/`` carry every CRD the operator needs.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from memfit.api.base import GROUP, VERSION
from memfit.api.finetunejob import FineTuneJobSpec, FineTuneJobStatus
from memfit.api.gpupool import GPUPoolSpec

DROPPED_KEYWORDS = {"title", "$defs", "examples"}


def to_structural(schema: dict[str, Any], definitions: dict[str, Any] | None = None) -> dict[str, Any]:
    """Convert one pydantic JSON Schema node (and its children) to Kubernetes' structural dialect."""
    definitions = definitions if definitions is not None else schema.get("$defs", {})
    if "$ref" in schema:
        target = definitions[schema["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return to_structural(merged, definitions)
    variants = schema.get("anyOf")
    if variants is not None:
        non_null = [v for v in variants if v.get("type") != "null"]
        if len(non_null) != 1:
            raise ValueError(f"a CRD field cannot be a union of {non_null}: restructure the model")
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        converted = to_structural({**non_null[0], **rest}, definitions)
        if len(non_null) < len(variants):
            converted["nullable"] = True
        return converted

    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in DROPPED_KEYWORDS:
            continue
        if key == "default" and value is None:
            continue
        if key == "const":
            out["enum"] = [value]
        elif key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "properties":
            out["properties"] = {name: to_structural(sub, definitions) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = to_structural(value, definitions)
        else:
            out[key] = value
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "properties" in out and out.get("additionalProperties") is False:
        # Structural schemas forbid both; the API server prunes unknown fields instead (and the operator
        # validates every spec with the same pydantic models, so a misspelt field still gets a clear error).
        del out["additionalProperties"]
    return out


def without_defaults(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with no ``default`` anywhere: status is written by the operator, never defaulted."""
    out = {key: value for key, value in schema.items() if key != "default"}
    if "properties" in out:
        out["properties"] = {name: without_defaults(sub) for name, sub in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = without_defaults(out[key])
    return out


def _object_schema(model: type[BaseModel], description: str) -> dict[str, Any]:
    schema = to_structural(model.model_json_schema(by_alias=True, mode="validation"))
    schema["description"] = description
    return schema


def _definition(group: str, scope: str, names: dict[str, Any], version: dict[str, Any]) -> dict[str, Any]:
    """A CustomResourceDefinition with one version, served and stored (``version`` holds its name, schema...)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{names['plural']}.{group}", "labels": {"app.kubernetes.io/part-of": "memfit"}},
        "spec": {
            "group": group,
            "scope": scope,
            "names": names,
            "versions": [{"name": version["name"], "served": True, "storage": True, **version}],
        },
    }


def _crd(
    plural: str, kind: str, scope: str, schema: dict[str, Any], columns: list[dict[str, Any]], short: list[str]
) -> dict[str, Any]:
    names = {"plural": plural, "singular": kind.lower(), "kind": kind, "listKind": f"{kind}List",
             "shortNames": short, "categories": ["memfit"]}  # fmt: skip
    version = {
        "name": VERSION,
        "schema": {"openAPIV3Schema": schema},
        "subresources": {"status": {}} if "status" in schema["properties"] else {},
        "additionalPrinterColumns": columns,
    }
    return _definition(GROUP, scope, names, version)


def _column(name: str, path: str, kind: str = "string", description: str = "", priority: int = 0) -> dict[str, Any]:
    column: dict[str, Any] = {"name": name, "type": kind, "jsonPath": path, "description": description}
    if priority:
        column["priority"] = priority
    return column


def _immutable_spec(spec: dict[str, Any]) -> dict[str, str]:
    """A CEL transition rule on the whole object (Kubernetes 1.25+; older API servers drop it, and the operator
    reports and ignores the change instead), the operator's rule: once the job has launched (the operator
    records status.launchedSpec at the first launch), every spec field but `suspend` keeps its value; until
    then the spec may change (fixing an Invalid or Unschedulable job plans it anew). It sits at the root of
    the schema because a rule sees only its own node and below, and the decision needs status.

    A field the API server does not default may be absent (`lora`, `strategy`, ...): CEL fails on a missing
    field, so such fields compare presence first."""
    always = set(spec.get("required", [])) | {name for name, node in spec["properties"].items() if "default" in node}
    kept = []
    for name in spec["properties"]:
        if name == "suspend":
            continue
        same = f"self.spec.{name} == oldSelf.spec.{name}"
        if name not in always:
            same = f"(has(self.spec.{name}) ? has(oldSelf.spec.{name}) && {same} : !has(oldSelf.spec.{name}))"
        kept.append(same)
    return {
        "rule": "!has(oldSelf.status) || !has(oldSelf.status.launchedSpec) || (" + " && ".join(kept) + ")",
        "message": "the spec of a FineTuneJob is immutable after its first launch (status.launchedSpec) except "
        "spec.suspend: delete the job and create a new one",
    }


def _resource_schema(description: str, **parts: dict[str, Any]) -> dict[str, Any]:
    """A custom resource's top-level schema: the standard fields, ``parts`` (spec, status), spec required."""
    standard = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"}}
    return {"type": "object", "description": description, "properties": {**standard, **parts}, "required": ["spec"]}


def finetunejob_crd() -> dict[str, Any]:
    spec = _object_schema(FineTuneJobSpec, "The desired job.")
    schema = _resource_schema(
        "A fine-tuning job that memfit plans to fit the declared GPUs, launches and follows.",
        spec=spec,
        status=without_defaults(_object_schema(FineTuneJobStatus, "Observed state, written by the operator.")),
    )
    schema["x-kubernetes-validations"] = [_immutable_spec(spec)]
    columns = [
        _column("Status", ".status.phase", description="Where the job is"),
        _column("Method", ".status.plan.strategy.method", description="Planned method"),
        _column("ZeRO", ".status.plan.strategy.zeroStage", "integer", "DeepSpeed ZeRO stage"),
        _column("GPUs", ".status.gpus", "integer", "GPUs the plan uses"),
        _column("Mem/GPU", ".status.memoryPerGPU", description="Estimated memory per GPU against capacity"),
        _column("Progress", ".status.progressDisplay", description="Training progress"),
        _column("Age", ".metadata.creationTimestamp", "date"),
        _column("Model", ".spec.model.name", description="Model", priority=1),
        _column("Pool", ".status.plan.strategy.pool", description="GPU pool", priority=1),
        _column("Restarts", ".status.restarts", "integer", "Gang restarts", priority=1),
    ]
    return _crd("finetunejobs", "FineTuneJob", "Namespaced", schema, columns, ["ftj"])


def gpupool_crd() -> dict[str, Any]:
    schema = _resource_schema(
        "The declared inventory of one pool of identical GPU nodes.", spec=_object_schema(GPUPoolSpec, "The pool.")
    )
    columns = [
        _column("Product", ".spec.gpuProduct"),
        _column("GPUs/Node", ".spec.gpusPerNode", "integer"),
        _column("Nodes", ".spec.nodes", "integer"),
        _column("GiB/GPU", ".spec.gpuMemoryGiB", "number"),
        _column("Age", ".metadata.creationTimestamp", "date"),
    ]
    return _crd("gpupools", "GPUPool", "Cluster", schema, columns, ["gpool"])


KOPF_GROUP = "kopf.dev"


def kopf_peering_crd(kind: str, plural: str, scope: str) -> dict[str, Any]:
    """kopf's peering resource as kopf documents it: only status, kept as the replicas write it."""
    status = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    schema = {"openAPIV3Schema": {"type": "object", "properties": {"status": status}}}
    names = {"kind": kind, "plural": plural, "singular": kind.lower()}
    return _definition(KOPF_GROUP, scope, names, {"name": "v1", "schema": schema})


def cluster_peering_crd() -> dict[str, Any]:
    return kopf_peering_crd("ClusterKopfPeering", "clusterkopfpeerings", "Cluster")


def namespaced_peering_crd() -> dict[str, Any]:
    return kopf_peering_crd("KopfPeering", "kopfpeerings", "Namespaced")


CRD_FILES = {
    f"{GROUP}_finetunejobs.yaml": finetunejob_crd,
    f"{GROUP}_gpupools.yaml": gpupool_crd,
}
"""memfit's own CRDs, generated from the models: file name in crds/ -> generator (kubebuilder's naming)."""
PEERING_CRD_FILES = {
    f"{KOPF_GROUP}_clusterkopfpeerings.yaml": cluster_peering_crd,
    f"{KOPF_GROUP}_kopfpeerings.yaml": namespaced_peering_crd,
}
"""kopf's peering CRDs (ClusterKopfPeering for an operator of the whole cluster, KopfPeering for one
restricted to a namespace): without the one it uses, a replicated operator waits forever."""
ALL_CRD_FILES = {**CRD_FILES, **PEERING_CRD_FILES}
"""Every CRD the operator needs: what crds/ holds and `memfit crd` prints."""


class _PlainDumper(yaml.SafeDumper):
    """Writes repeated values out in full: a CRD is read by people and by kubectl, not only by YAML
    parsers, and anchors (`&id001`) make it harder to read and to diff."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def crd_yaml(crd: dict[str, Any]) -> str:
    if crd["spec"]["group"] == KOPF_GROUP:
        header = ("# kopf's peering resource: the operator's replicas agree through it which one is active.\n"
                  "# Generated by `memfit crd` (memfit/api/crd.py). Do not edit.\n")  # fmt: skip
    else:
        header = "# Generated by `memfit crd` from the pydantic models in memfit.api. Do not edit.\n"
    return header + yaml.dump(crd, Dumper=_PlainDumper, sort_keys=False, width=120)


def crd_documents_yaml() -> str:
    """Every CRD the operator needs (memfit's and kopf's peering CRDs), as one YAML stream."""
    return "---\n".join(crd_yaml(generate()) for generate in ALL_CRD_FILES.values())
