"""The chart's crds/ hold the generated memfit CRDs unchanged (the drift check of tests/test_crd.py, for the
copies Helm installs) plus kopf's peering CRDs as the operator's peering needs them."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from memfit.api.crd import CRD_FILES, crd_yaml
from tests.chart.render import CHART, KUBE_VERSION, ROOT

CHART_CRDS = CHART / "crds"
KOPF_CRDS = {
    "kopf.dev_clusterkopfpeerings.yaml": ("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
    "kopf.dev_kopfpeerings.yaml": ("KopfPeering", "kopfpeerings", "Namespaced"),
}


@pytest.mark.parametrize("name", sorted(CRD_FILES))
def test_chart_crd_is_the_generated_one(name: str) -> None:
    text = (CHART_CRDS / name).read_text()
    assert text == crd_yaml(CRD_FILES[name]()), (
        f"charts/memfit/crds/{name} drifted from the models: `make crds` regenerates crds/ and the chart's copies"
    )
    assert text == (ROOT / "crds" / name).read_text()


def test_chart_ships_exactly_these_crds() -> None:
    assert sorted(p.name for p in CHART_CRDS.iterdir()) == sorted([*CRD_FILES, *KOPF_CRDS])


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
