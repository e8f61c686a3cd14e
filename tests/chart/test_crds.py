"""The chart's crds/ hold the generated CRDs unchanged (the drift check of tests/test_crd.py, for the copies
Helm installs): memfit's and kopf's peering CRDs as the operator's peering needs them. The repository's crds/
(what `kubectl apply -f crds/` installs, and `memfit crd` prints) holds the same: every CRD the operator needs."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from memfit.api.crd import ALL_CRD_FILES, crd_documents_yaml, crd_yaml
from tests.chart.render import CHART, KUBE_VERSION, ROOT

CHART_CRDS = CHART / "crds"
KOPF_CRDS = {
    "kopf.dev_clusterkopfpeerings.yaml": ("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
    "kopf.dev_kopfpeerings.yaml": ("KopfPeering", "kopfpeerings", "Namespaced"),
}


@pytest.mark.parametrize("name", sorted(ALL_CRD_FILES))
def test_chart_crd_is_the_generated_one(name: str) -> None:
    text = (CHART_CRDS / name).read_text()
    assert text == crd_yaml(ALL_CRD_FILES[name]()), (
        f"charts/memfit/crds/{name} drifted from the models: `make crds` regenerates crds/ and the chart's copies"
    )
    assert text == (ROOT / "crds" / name).read_text()


def test_chart_ships_exactly_these_crds() -> None:
    assert sorted(p.name for p in CHART_CRDS.iterdir()) == sorted(ALL_CRD_FILES)
    assert set(KOPF_CRDS) <= set(ALL_CRD_FILES)


def test_crds_and_memfit_crd_carry_every_crd_the_operator_needs() -> None:
    """`kubectl apply -f crds/` (or `memfit crd | kubectl apply -f -`) is enough for `memfit operator` with
    its default peering: the peering CRDs are there too (the object itself, see the operator's log)."""
    assert sorted(p.name for p in (ROOT / "crds").glob("*.yaml")) == sorted(ALL_CRD_FILES)
    printed = {d["metadata"]["name"] for d in yaml.safe_load_all(crd_documents_yaml())}
    assert {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"} <= printed
    for name in KOPF_CRDS:
        assert (ROOT / "crds" / name).read_text() == crd_yaml(ALL_CRD_FILES[name]())


@pytest.mark.parametrize("name", sorted(KOPF_CRDS))
def test_kopf_peering_crd(name: str) -> None:
    crd = yaml.safe_load((CHART_CRDS / name).read_text())
    kind, plural, scope = KOPF_CRDS[name]
    spec = crd["spec"]
    assert crd["metadata"]["name"] == f"{plural}.kopf.dev"
    assert (spec["group"], spec["scope"], spec["names"]["kind"], spec["names"]["plural"]) == (
        "kopf.dev", scope, kind, plural,
    )  # fmt: skip
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1", True, True)
    assert version["schema"]["openAPIV3Schema"] == {
        "type": "object",
        "properties": {"status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    }


@pytest.mark.parametrize("path", sorted(CHART_CRDS.glob("*.yaml")), ids=lambda p: p.name)
def test_crd_is_a_valid_customresourcedefinition(path: Path) -> None:
    kubernetes_validate.validate(yaml.safe_load(path.read_text()), KUBE_VERSION, strict=True)
