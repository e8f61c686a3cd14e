"""Where an attempt resumed from, in the trainer's own words: ``status.attempts[].resumedFromStep`` replaces the
launch's expectation once rank 0 reports it, ``checkpointsSetAside`` counts the newer checkpoints it set aside
(a Warning Event, once), and a resume elsewhere than launched is said once too. A second pass over the same
observation writes and posts nothing new."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime

from memfit.api.finetunejob import Progress
from memfit.api.vocabulary import Phase
from memfit.contract.progress import Progress as TrainerProgress
from memfit.contract.termination import completed_message
from memfit_operator.reconcile import Decision
from memfit_operator.status import Resumption
from tests.operator.test_reconcile import FakeCluster, cluster, gang, job_document, quiet, reasons

__all__ = ["cluster", "gang"]  # the fixtures, used by name


def restarted(cluster: FakeCluster, checkpoint: int = 200) -> None:
    """Attempt 1 read at a checkpoint of ``checkpoint``, then failed: attempt 2 running, launched to resume
    from that checkpoint."""
    cluster.launch_running()
    cluster.step(Progress(step=checkpoint + 50, total_steps=1000, percent=25, last_checkpoint_step=checkpoint))
    cluster.failed(cluster.attempt_pods(1)[0])
    cluster.step()
    cluster.running()
    cluster.step()
    assert cluster.status.phase is Phase.RUNNING and cluster.status.attempts[1].resumed_from_step == checkpoint


def again(cluster: FakeCluster, progress: Progress, resumption: Resumption | None) -> Decision:
    """A pass over the same observation: nothing new to write or post."""
    before = copy.deepcopy(cluster.raw_status)
    decision = cluster.step(progress, resumption)
    assert quiet(decision) and decision.status.to_api() == before
    return decision


def test_checkpoints_set_aside_are_recorded_and_reported_once(gang: FakeCluster) -> None:
    restarted(gang)
    # Until rank 0 has reported, the launch's expectation stands and nothing says it was checked.
    gang.step()
    assert gang.raw_status["attempts"][1]["resumedFromStep"] == 200
    assert "checkpointsSetAside" not in gang.raw_status["attempts"][1]

    progress = Progress(step=101, total_steps=1000, percent=10, last_checkpoint_step=100)
    decision = gang.step(progress, Resumption(step=100, set_aside=1))
    assert reasons(decision.events) == [("Warning", "CheckpointSetAside")]
    assert decision.events[0].message == (
        "attempt 2: 1 newer checkpoint(s) failed verification or could not be read and were set aside (rank 0's log "
        "names them); resumed from checkpoint step 100 (launched to resume from checkpoint step 200)")  # fmt: skip
    first, second = gang.raw_status["attempts"]
    assert (second["resumedFromStep"], second["checkpointsSetAside"]) == (100, 1)
    assert "checkpointsSetAside" not in first, "an ended attempt is not rewritten"
    assert gang.raw_status["progress"]["lastCheckpointStep"] == 100
    assert decision.create == [] and decision.delete == []

    again(gang, progress, Resumption(step=100, set_aside=1))
    later = Progress(step=150, total_steps=1000, percent=15, last_checkpoint_step=100)
    assert reasons(gang.step(later, Resumption(step=100, set_aside=1)).events) == []
    assert [e.reason for e in gang.events].count("CheckpointSetAside") == 1

    # The next restart is launched from the checkpoint the trainer resumed from, not from the one set aside.
    gang.failed(gang.attempt_pods(2)[0])
    decision = gang.step()
    third = decision.status.attempts[2]
    assert third.resumed_from_step == 100 and third.checkpoints_set_aside is None
    assert "from checkpoint step 100" in next(e.message for e in decision.events if e.reason == "Launching")


def test_a_resume_elsewhere_than_launched_is_said_once(cluster: FakeCluster) -> None:
    """The common case: a checkpoint written after the operator's last read, before the failure."""
    restarted(cluster, checkpoint=200)
    progress = Progress(step=301, total_steps=1000, percent=30, last_checkpoint_step=300)
    decision = cluster.step(progress, Resumption(step=300, set_aside=0))
    assert reasons(decision.events) == [("Normal", "ResumedFrom")]
    assert decision.events[0].message == (
        "attempt 2 resumed from checkpoint step 300 (launched to resume from checkpoint step 200)")  # fmt: skip
    attempt = decision.status.attempts[1]
    assert (attempt.resumed_from_step, attempt.checkpoints_set_aside) == (300, 0)
    assert cluster.raw_status["attempts"][1]["checkpointsSetAside"] == 0
    again(cluster, progress, Resumption(step=300, set_aside=0))
    assert [e.reason for e in cluster.events].count("ResumedFrom") == 1


def test_a_resume_where_the_launch_said_posts_nothing(cluster: FakeCluster) -> None:
    cluster.launch_running()
    progress = Progress(step=3, total_steps=1000, percent=0)
    decision = cluster.step(progress, Resumption(step=None, set_aside=0))
    assert quiet(decision)
    attempt = decision.status.attempts[0]
    assert (attempt.resumed_from_step, attempt.checkpoints_set_aside) == (None, 0)
    again(cluster, progress, Resumption(step=None, set_aside=0))
    other = FakeCluster(job_document())  # restarted at 200, and resumed there
    restarted(other)
    decision = other.step(Progress(step=201, last_checkpoint_step=200), Resumption(step=200, set_aside=0))
    assert quiet(decision) and decision.status.attempts[1].checkpoints_set_aside == 0


def test_every_checkpoint_set_aside_starts_from_the_weights_and_the_old_checkpoint_is_forgotten(
    cluster: FakeCluster,
) -> None:
    restarted(cluster, checkpoint=200)
    progress = Progress(step=1, total_steps=1000, percent=0)  # no checkpoint of its own yet
    decision = cluster.step(progress, Resumption(step=None, set_aside=2))
    assert reasons(decision.events) == [("Warning", "CheckpointSetAside")]
    assert decision.events[0].message.endswith(
        "2 newer checkpoint(s) failed verification or could not be read and were set aside (rank 0's log names "
        "them); started from the model weights (launched to resume from checkpoint step 200)")  # fmt: skip
    status = decision.status
    assert (status.attempts[1].resumed_from_step, status.attempts[1].checkpoints_set_aside) == (None, 2)
    assert status.progress is not None and status.progress.last_checkpoint_step is None
    again(cluster, progress, Resumption(step=None, set_aside=2))
    cluster.failed(cluster.attempt_pods(2)[0])
    decision = cluster.step()
    assert decision.status.attempts[2].resumed_from_step is None
    assert "starting from the model weights" in next(e.message for e in decision.events if e.reason == "Launching")


def test_a_trainer_that_does_not_say_where_it_resumed_keeps_the_last_known_checkpoint(cluster: FakeCluster) -> None:
    restarted(cluster, checkpoint=200)
    status = cluster.step(Progress(step=210, total_steps=1000, percent=21)).status
    assert status.progress is not None and status.progress.last_checkpoint_step == 200
    assert status.attempts[1].resumed_from_step == 200 and status.attempts[1].checkpoints_set_aside is None


def test_a_report_for_an_ended_attempt_changes_nothing(cluster: FakeCluster) -> None:
    cluster.launch_running()
    cluster.edit_spec(suspend=True)
    cluster.step()
    decision = cluster.step(Progress(step=5, total_steps=1000, percent=0), Resumption(step=None, set_aside=3))
    assert decision.events == [] and decision.status.attempts[0].checkpoints_set_aside is None


def final_message(resumed_from_step: int | None = None, checkpoints_set_aside: int = 0) -> str:
    """Rank 0's Completed termination message after 40 of 40 steps."""
    final = TrainerProgress(step=40, total_steps=40, percent=100.0, tokens_per_second=1234.5, eta_seconds=0.0,
                            eta=None, last_checkpoint_step=40, loss=2.5,
                            updated=datetime(2026, 1, 1, tzinfo=UTC))  # fmt: skip
    resume = {"resumed_from_step": resumed_from_step, "checkpoints_set_aside": checkpoints_set_aside}
    return completed_message(final.model_copy(update=resume))


def test_a_job_too_short_for_a_read_says_where_it_resumed_in_its_termination_message(cluster: FakeCluster) -> None:
    cluster.launch_running()
    cluster.terminated(cluster.attempt_pods(1)[0], "Succeeded", 0, "Completed",
                       final_message(resumed_from_step=30, checkpoints_set_aside=1))  # fmt: skip
    decision = cluster.step()
    assert reasons(decision.events) == [("Warning", "CheckpointSetAside"), ("Normal", "Succeeded")]
    assert "resumed from checkpoint step 30 (launched to start from the model weights)" in decision.events[0].message
    attempt = decision.status.attempts[0]
    assert decision.status.phase is Phase.SUCCEEDED
    assert (attempt.resumed_from_step, attempt.checkpoints_set_aside) == (30, 1)
    assert quiet(cluster.step())


def test_a_termination_message_without_the_resume_keys_says_nothing_about_it(cluster: FakeCluster) -> None:
    cluster.launch_running()
    message = json.loads(final_message())
    for key in ("resumedFromStep", "checkpointsSetAside"):
        del message["progress"][key]  # as a trainer older than the keys wrote it
    cluster.terminated(cluster.attempt_pods(1)[0], "Succeeded", 0, "Completed", json.dumps(message))
    decision = cluster.step()
    assert reasons(decision.events) == [("Normal", "Succeeded")]
    assert "checkpointsSetAside" not in cluster.raw_status["attempts"][0]
    assert cluster.raw_status["progress"]["lastCheckpointStep"] == 40
