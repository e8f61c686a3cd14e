"""The planner never produces a plan that the trainer refuses (QLoRA outside bf16) or that DeepSpeed silently
runs otherwise (parameter offload below ZeRO-3, NVMe optimizer offload below ZeRO-3, offload without ZeRO)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from memfit.api.finetunejob import FineTuneJob, FineTuneJobSpec
from memfit.api.gpupool import GPUPool
from memfit.api.knobs import conflicts
from memfit.api.plan import PlanCandidate
from memfit.planner.search import plan_job
from memfit.render import deepspeed as render_deepspeed
from memfit.render.deepspeed import deepspeed_config
from memfit.render.trainer_config import Mounts, render_trainer_config
from memfit_trainer import preflight
from tests.planning_fixtures import A100_NODE, RTX_4090_BIG_HOST, V100_NODE, job, pool, unvalidated_job

T4 = pool("t4", "Tesla-T4", 4, 2, 180)
A100_NVME = pool("a100-nvme", "NVIDIA-A100-SXM4-80GB", 8, 1, 400, 3000)
L4_NVME = pool("l4-nvme", "NVIDIA-L4", 1, 2, 96, 2000)

SCENARIOS: dict[str, tuple[FineTuneJobSpec, list[GPUPool]]] = {
    "auto on GPUs without bf16": (job("llama-2-7b", batch=16), [V100_NODE, T4]),
    "auto 13b on GPUs without bf16": (job("llama-2-13b", batch=16), [T4]),
    "qlora on a mixed inventory": (job("llama-2-13b", "qlora", batch=16), [V100_NODE, T4, A100_NODE]),
    "parameter offload pinned, stage free": (
        job("llama-2-13b", "full", batch=16, strategy={"offloadParameters": "cpu"}),
        [A100_NODE, RTX_4090_BIG_HOST],
    ),
    "lora with parameter offload pinned": (
        job("llama-2-70b", "lora", batch=8, strategy={"offloadParameters": "cpu"}),
        [A100_NODE],
    ),
    "70b full where NVMe is the only room": (job("llama-2-70b", "full", batch=16), [A100_NVME, L4_NVME]),
    "optimizer on NVMe pinned, stage free": (
        job("llama-3.1-8b", "full", batch=16, strategy={"offloadOptimizer": "nvme"}),
        [A100_NVME, L4_NVME],
    ),
    "adapters with optimizer offload pinned": (
        job("llama-2-7b", "lora", batch=16, strategy={"offloadOptimizer": "cpu"}),
        [V100_NODE, A100_NODE],
    ),
}


def plans(spec: FineTuneJobSpec, pools: list[GPUPool]) -> list[PlanCandidate]:
    result = plan_job(spec, pools)
    return [*result.candidates, *result.rejected]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.slow
def test_no_plan_breaks_a_rule_of_deepspeed_or_the_trainer(scenario: str) -> None:
    spec, pools = SCENARIOS[scenario]
    found = plans(spec, pools)
    assert found
    for plan in found:
        s = plan.strategy
        assert s.method != "qlora" or s.precision == "bf16", s.summary()
        assert s.offload_parameters == "none" or s.zero_stage == 3, s.summary()
        assert s.offload_optimizer != "nvme" or s.zero_stage == 3, s.summary()
        assert s.offload_optimizer == "none" or s.zero_stage >= 1, s.summary()
        assert not conflicts(s.knobs()), s.summary()
        if s.engine == "fsdp2":  # no DeepSpeed JSON (e.g. qlora fsdp2-zero3, which DeepSpeed cannot run)
            continue
        zero = deepspeed_config(spec, s)["zero_optimization"]
        assert "offload_param" not in zero or zero["stage"] == 3
        assert zero.get("offload_optimizer", {}).get("device") != "nvme" or zero["stage"] == 3


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.slow
def test_the_trainer_accepts_every_plan(scenario: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each plan rendered as the operator renders it passes the trainer's config validation and preflight
    (on a machine whose accelerator has what the pool's GPUs have: that is the catalog's business)."""
    monkeypatch.setattr(preflight, "_precision_problem", lambda precision: None)
    monkeypatch.setattr(preflight, "_has_flash_attention", lambda: True)  # the CUDA image builds flash-attn
    (tmp_path / "nvme").mkdir()
    monkeypatch.setattr(render_deepspeed, "NVME_PATH", str(tmp_path / "nvme"))  # the node's NVMe mount
    spec, pools = SCENARIOS[scenario]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "corpus.jsonl").write_text('{"text": "hello"}\n')
    document: dict[str, Any] = spec.model_dump(by_alias=True, mode="json", exclude_none=True)
    document["dataset"]["source"] = {"pvc": "data", "path": "corpus.jsonl"}
    job_object = FineTuneJob.model_validate({"metadata": {"name": "rules"}, "spec": document})
    mounts = Mounts(model=None, data=str(tmp_path / "data"), output=str(tmp_path / "out"))
    for plan in plans(job_object.spec, pools):
        config = render_trainer_config(job_object, plan, mounts=mounts, termination_log=str(tmp_path / "term"))
        world = str(plan.strategy.gpus)
        preflight.check(config, {"WORLD_SIZE": world, "LOCAL_WORLD_SIZE": str(plan.strategy.gpus_per_node)})


def test_qlora_on_gpus_without_bf16_is_not_planned_and_the_advice_says_why() -> None:
    result = plan_job(job("llama-2-13b", "qlora", batch=16), [V100_NODE, T4])
    assert result.chosen is None and result.rejected == []
    assert result.advice == [
        "method qlora on pools t4, v100 was not tried: qlora computes in bf16 (the trainer refuses it in fp16 and "
        "fp32), which these GPUs lack"
    ]


def test_auto_on_gpus_without_bf16_trains_in_fp16_with_full_or_lora_only() -> None:
    result = plan_job(job("llama-2-7b", batch=16), [V100_NODE, T4])
    assert result.chosen is not None
    assert {c.strategy.method for c in result.candidates} <= {"full", "lora"}
    assert {c.strategy.precision for c in result.candidates} == {"fp16"}


CONFLICTING_PINS = [
    ({"method": "qlora", "training": {"precision": "fp16"}}, "method qlora computes in bf16"),
    ({"method": "qlora", "strategy": {"offloadParameters": "cpu", "engine": "deepspeed"}}, "keeps its 4-bit base"),
    ({"method": "qlora", "strategy": {"offloadOptimizer": "nvme"}}, "nvme needs zeroStage 3"),
    ({"method": "full", "strategy": {"offloadOptimizer": "cpu", "zeroStage": 0}}, "needs zeroStage 1-3"),
    ({"method": "full", "strategy": {"offloadOptimizer": "nvme", "zeroStage": 2}}, "nvme needs zeroStage 3"),
]


@pytest.mark.parametrize("pins, expected", CONFLICTING_PINS)
def test_pinned_knobs_that_cannot_run_together_are_refused_by_the_api(pins: dict[str, Any], expected: str) -> None:
    method, pins = pins["method"], {k: v for k, v in pins.items() if k != "method"}
    with pytest.raises(ValidationError, match=re.escape(expected)):
        job("llama-2-7b", method, batch=16, **pins)


@pytest.mark.parametrize("pins, expected", CONFLICTING_PINS)
def test_pinned_knobs_that_cannot_run_together_plan_nothing_and_say_so(pins: dict[str, Any], expected: str) -> None:
    """The planner holds the same rules for a spec that never went through validation (built in code)."""
    method, pins = pins["method"], {k: v for k, v in pins.items() if k != "method"}
    spec = unvalidated_job("llama-2-7b", method, batch=16, **pins)
    result = plan_job(spec, [A100_NVME])
    assert result.chosen is None and result.candidates == [] and result.rejected == []
    assert result.advice
    for line in result.advice:
        subject = line.split(" not tried: ")[0]
        assert re.fullmatch(r"methods? [a-z, ]+(?: and [a-z]+)? (?:was|were)", subject) and method in subject, line
    assert any(expected in line for line in result.advice)


def test_rendering_a_strategy_deepspeed_would_not_run_as_planned_is_an_error() -> None:
    spec = job("llama-2-7b", "full", batch=16)
    chosen = plan_job(spec, [A100_NODE]).chosen
    assert chosen is not None
    ignored = replace(chosen.strategy, zero_stage=2, offload_parameters="cpu")
    with pytest.raises(ValueError, match="offloadParameters needs zeroStage 3"):
        deepspeed_config(spec, ignored)
