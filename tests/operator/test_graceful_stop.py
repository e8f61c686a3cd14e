"""A graceful stop as the operator sees it: the pod's grace period and torchrun's shutdown timeout cover the
plan's estimated checkpoint (memfit.contract.lifetime), and a pod the trainer left with a Stopped message is
an unfinished attempt, never a success."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from memfit.api.finetunejob import FineTuneJob
from memfit.api.loading import load_documents
from memfit.api.plan import PlanCandidate
from memfit.api.vocabulary import Outcome
from memfit.contract.lifetime import (
    CHECKPOINT_TIME_MARGIN,
    CHECKPOINT_WRITE_BYTES_PER_SECOND,
    MIN_STOP_SECONDS,
    TEARDOWN_SECONDS,
    checkpoint_bytes_per_node,
    stop_seconds,
)
from memfit.contract.termination import stopped_message
from memfit.planner.search import plan_job
from memfit_operator import objects
from memfit_operator.status import gang_state, report_pod
from tests.operator.test_status import pod

ROOT = Path(__file__).parent.parent.parent
IMAGE = "registry.example/memfit-trainer:0.1.0"


def planned(preset: str, method: str) -> tuple[FineTuneJob, PlanCandidate, object]:
    document = yaml.safe_load((ROOT / "examples" / "llama-3.1-8b-lora.yaml").read_text())
    document["metadata"]["uid"] = "1234-abcd"
    document["spec"]["model"]["architecture"] = {"preset": preset}
    document["spec"]["method"] = method
    document["spec"]["resources"] = {"pool": "a100-80gb"}
    job = FineTuneJob.model_validate(document)
    pool = next(p for p in load_documents(ROOT / "examples" / "inventory.yaml").pools if p.metadata.name == "a100-80gb")
    plan = plan_job(job.spec, [pool]).chosen
    assert plan is not None
    return job, plan, pool


@pytest.mark.parametrize(("preset", "method"), [("llama-2-70b", "full"), ("llama-2-70b", "lora")])
def test_the_grace_period_covers_the_step_and_the_checkpoint_write(preset: str, method: str) -> None:
    job, plan, pool = planned(preset, method)
    spec = objects.trainer_pod(job, plan, pool, attempt=1, node_rank=0, image=IMAGE)["spec"]  # type: ignore[arg-type]
    write = checkpoint_bytes_per_node(plan) / CHECKPOINT_WRITE_BYTES_PER_SECOND * CHECKPOINT_TIME_MARGIN
    assert stop_seconds(plan) >= max(MIN_STOP_SECONDS, math.ceil(plan.throughput.step_seconds + write))
    assert spec["terminationGracePeriodSeconds"] == stop_seconds(plan) + TEARDOWN_SECONDS
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(stop_seconds(plan))


def test_a_full_checkpoint_takes_longer_than_an_adapters() -> None:
    _, full, _ = planned("llama-2-70b", "full")
    _, lora, _ = planned("llama-2-70b", "lora")
    # 70B weights in 16 bits are written either way; full fine-tuning adds 12 bytes of states per parameter.
    assert checkpoint_bytes_per_node(full) > checkpoint_bytes_per_node(lora) >= 2 * 69e9
    assert stop_seconds(full) > stop_seconds(lora)


@pytest.mark.parametrize(("phase", "exit_code"), [("Succeeded", 0), ("Failed", 1)])
def test_a_stopped_trainer_is_an_unfinished_attempt_never_a_success(phase: str, exit_code: int) -> None:
    report = report_pod(pod("job-a1-n0", phase, exit_code, "Completed", stopped_message(7, "SIGTERM")))
    assert report.outcome is Outcome.FAILED
    assert report.reason == "job-a1-n0: stopped by SIGTERM at step 7, its checkpoint written"
    assert gang_state([report], 1).outcome is Outcome.FAILED
