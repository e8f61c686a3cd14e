"""The stored profiles are what the profiler makes now from the stored configs (``make profiles`` rewrites them).

A change to the profiler, to transformers or peft, or to a stored config.json shows up here as a drift of the
numbers every plan of those models reads. The profiler's code path is the model type's, so the suite profiles
the smallest stored config of each ``model_type`` (profiling all of them takes about ten minutes on 2 cores).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from memfit.catalog.model_configs import PROFILES_DIR, stored_config_names, stored_config_path  # noqa: E402
from memfit.profile import ModelProfile  # noqa: E402
from memfit_trainer.profile import profile, read_config  # noqa: E402
from tests.stored_models import STORED_TOTALS  # noqa: E402


def smallest_of_each_model_type() -> list[str]:
    by_type: dict[str, str] = {}
    for name in sorted(stored_config_names(), key=lambda name: STORED_TOTALS[name]):
        path = stored_config_path(name)
        assert path is not None
        by_type.setdefault(json.loads(path.read_text())["model_type"], name)
    return sorted(by_type.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", smallest_of_each_model_type())
def test_the_stored_profile_is_what_the_profiler_makes_now(name: str) -> None:
    path = stored_config_path(name)
    assert path is not None
    made = profile(read_config(path), activations=True)
    stored = ModelProfile.model_validate_json((PROFILES_DIR / f"{name}.json").read_text())
    assert made == stored, f"{name}: the stored profile drifted; run make profiles"
