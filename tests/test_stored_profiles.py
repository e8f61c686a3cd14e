"""The stored profiles are what the profiler makes now from the stored configs (``make profiles`` rewrites them).

A change to the profiler, to transformers or peft, or to a stored config.json shows up here as a drift of the
numbers every plan of those models reads. The profiler's code path is the model type's, so the suite checks
the smallest stored config of each ``model_type``: its inventory (parameters, 4-bit tensors, LoRA targets,
kernels) whole, and its traced activations for full fine-tuning with both losses, on packed rows and on unmasked
ones (flash attention's terms); one model is profiled whole, every traced setup (the setups' code is shared by
every model type, and tests/test_activation_profile.py traces each of them on every family). Profiling every
stored config whole (twelve setups each since version 5) took about an hour on 2 shared cores: 20 to 60
seconds for most models when the cores were free, 4 to 10 minutes each when they were loaded.
"""

from __future__ import annotations

import functools
import json

import pytest

pytest.importorskip("transformers")

from memfit.catalog.model_configs import stored_config_names, stored_config_path, stored_profile  # noqa: E402
from memfit.profile import ActivationTerms, ModelProfile  # noqa: E402
from memfit_trainer.activation_profile import FULL, UNMASKED, TracedModel  # noqa: E402
from memfit_trainer.profile import profile, read_config  # noqa: E402
from tests.stored_models import STORED_TOTALS  # noqa: E402

PROFILED_WHOLE = "llama-3.2-1b"
"""The smallest stored model: every setup of it is traced again."""


def smallest_of_each_model_type() -> list[str]:
    by_type: dict[str, str] = {}
    for name in sorted(stored_config_names(), key=lambda name: STORED_TOTALS[name]):
        path = stored_config_path(name)
        assert path is not None
        by_type.setdefault(json.loads(path.read_text())["model_type"], name)
    return sorted(by_type.values())


def _config(name: str) -> dict[str, object]:
    path = stored_config_path(name)
    assert path is not None
    return read_config(path)


@functools.cache
def _profiled_whole() -> ModelProfile:
    """:data:`PROFILED_WHOLE` as the profiler makes it, every setup traced: made once, read by both tests."""
    return profile(_config(PROFILED_WHOLE), activations=True)


def _made_now(name: str) -> tuple[ModelProfile, ActivationTerms, ActivationTerms]:
    """The inventory the profiler makes now, and its terms of full fine-tuning on packed and unmasked rows (of
    :data:`PROFILED_WHOLE`, the ones its whole profile traced: the same ``TracedModel.terms``, in its workers)."""
    if name == PROFILED_WHOLE:
        made = _profiled_whole()
        assert made.activations is not None and made.activations.unmasked is not None
        inventory = made.model_copy(update={"activations": None})
        return inventory, made.activations.full, made.activations.unmasked.full
    config = _config(name)
    traced = TracedModel.of(config)
    return profile(config), traced.terms(FULL), traced.terms(UNMASKED)


@pytest.mark.slow
@pytest.mark.parametrize("name", smallest_of_each_model_type())
def test_the_stored_inventory_and_full_fine_tuning_terms_are_what_the_profiler_makes_now(name: str) -> None:
    stored = stored_profile(name)
    assert stored is not None and stored.activations is not None
    inventory, full, unmasked = _made_now(name)
    assert inventory == stored.model_copy(update={"activations": None}), f"{name}: drifted; make profiles"
    assert full == stored.activations.full, f"{name}: drifted; run make profiles"
    assert stored.activations.unmasked is not None, f"{name}: a version-4 profile; run make profiles"
    assert unmasked == stored.activations.unmasked.full, f"{name}: drifted; run make profiles"


@pytest.mark.slow
def test_one_stored_profile_is_what_the_profiler_makes_now_in_every_setup() -> None:
    assert PROFILED_WHOLE in smallest_of_each_model_type()
    made = _profiled_whole()
    assert made == stored_profile(PROFILED_WHOLE), f"{PROFILED_WHOLE}: the stored profile drifted; run make profiles"
