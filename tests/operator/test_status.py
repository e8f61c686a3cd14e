"""Status logic: conditions, pod outcomes (including the trainer's OOM message), gang state, columns."""

from __future__ import annotations

import json

from memfit.api.vocabulary import Outcome
from memfit_operator.status import (
    gang_state,
    progress_display,
    report_pod,
    set_condition,
)


def test_transition_time_moves_only_when_the_status_changes() -> None:
    first = set_condition([], "Ready", False, "Planning", "planning", 1, at="2026-01-01T00:00:00Z")
    same = set_condition(first, "Ready", False, "StillPlanning", "still", 2, at="2026-01-01T00:05:00Z")
    flipped = set_condition(same, "Ready", True, "Running", "running", 2, at="2026-01-01T00:10:00Z")
    assert same[0].last_transition_time == "2026-01-01T00:00:00Z" and same[0].reason == "StillPlanning"
    assert same[0].observed_generation == 2
    assert flipped[0].last_transition_time == "2026-01-01T00:10:00Z" and flipped[0].status == "True"
    other = set_condition(flipped, "Suspended", None, "Unknown", "", 2)
    assert [c.type for c in other] == ["Ready", "Suspended"] and other[1].status == "Unknown"


def pod(name: str, phase: str, exit_code: int | None = None, reason: str = "", message: str | None = None) -> dict:
    status: dict = {"phase": phase}
    if exit_code is not None:
        terminated = {"exitCode": exit_code, "reason": reason}
        if message is not None:
            terminated["message"] = message
        status["containerStatuses"] = [{"name": "trainer", "state": {"terminated": terminated}}]
    return {"metadata": {"name": name}, "status": status}


def test_the_trainers_oom_message_is_an_out_of_memory_outcome() -> None:
    message = json.dumps({"reason": "OutOfMemory", "step": 12, "plannedPeakBytes": 60 * 2**30,
                          "measuredPeakBytes": 79 * 2**30, "message": "CUDA out of memory"})  # fmt: skip
    report = report_pod(pod("job-a1-n0", "Failed", 1, "Error", message))
    assert report.outcome is Outcome.OUT_OF_MEMORY
    assert "step 12" in report.reason and "measured peak 79.0 GiB, planned 60.0 GiB" in report.reason


def test_oomkilled_is_out_of_memory_and_other_failures_are_failures() -> None:
    assert report_pod(pod("p", "Failed", 137, "OOMKilled")).outcome is Outcome.OUT_OF_MEMORY
    failed = report_pod(pod("p", "Failed", 1, "Error", "Traceback ..."))
    assert failed.outcome is Outcome.FAILED and "exit code 1" in failed.reason
    assert report_pod(pod("p", "Running")).outcome is Outcome.RUNNING
    assert report_pod(pod("p", "Succeeded", 0, "Completed")).outcome is Outcome.SUCCEEDED


def test_one_failed_rank_fails_the_gang_and_oom_wins() -> None:
    reports = [report_pod(pod("n0", "Running")), report_pod(pod("n1", "Failed", 1, "Error"))]
    assert gang_state(reports, 2).outcome is Outcome.FAILED
    reports.append(report_pod(pod("n2", "Failed", 137, "OOMKilled")))
    assert gang_state(reports, 3).outcome is Outcome.OUT_OF_MEMORY


def test_gang_is_running_only_when_every_rank_runs() -> None:
    running = [report_pod(pod("n0", "Running")), report_pod(pod("n1", "Pending"))]
    assert gang_state(running, 2).outcome is Outcome.PENDING
    assert gang_state([report_pod(pod("n0", "Running"))] * 2, 2).outcome is Outcome.RUNNING
    assert gang_state([report_pod(pod("n0", "Succeeded", 0, "Completed"))] * 2, 2).outcome is Outcome.SUCCEEDED
    assert gang_state([report_pod(pod("n0", "Running"))], 2).outcome is Outcome.PENDING  # a rank is missing


def test_progress_column() -> None:
    assert progress_display(420, 1000) == "42% 420/1000"
    assert progress_display(7, None) == "step 7"


def test_a_pending_gang_says_what_the_scheduler_said() -> None:
    waiting = pod("n1", "Pending")
    why = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    waiting["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why}
    ]
    gang = gang_state([report_pod(pod("n0", "Running")), report_pod(waiting)], 2)
    assert gang.outcome is Outcome.PENDING
    assert (
        gang.reason
        == "1 of 2 node ranks started; n1 not scheduled: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    )
    assert gang_state([report_pod(pod("n0", "Pending"))], 1).reason == "0 of 1 node ranks started"


def test_the_trainers_config_error_is_its_own_outcome_and_wins_over_others() -> None:
    message = json.dumps({"reason": "ConfigError", "message": "dataset field `text` missing"})
    refused = report_pod(pod("n1", "Failed", 1, "Error", message))
    assert refused.outcome is Outcome.CONFIG_ERROR
    assert refused.reason == "n1: the trainer refused its config: dataset field `text` missing"
    oom = report_pod(pod("n0", "Failed", 137, "OOMKilled"))
    assert gang_state([oom, refused], 2).outcome is Outcome.CONFIG_ERROR


def test_a_non_finite_step_fails_the_job_with_its_message() -> None:
    """A restart would resume from the same checkpoint and train on the same data to the same NaN."""
    said = "step 6: loss nan: stopped before writing anything of it (the run started from checkpoint step 4)"
    stopped = report_pod(pod("n0", "Failed", 2, "Error", json.dumps({"reason": "NonFinite", "message": said})))
    assert stopped.outcome is Outcome.CONFIG_ERROR and stopped.reason == f"n0: {said}"
