"""The job's status is a state machine with one table (states.JOB_TRANSITIONS) and one writer
(Store.move_job): every move the table has no arrow for is refused, a stop carries its cause,
only a resumable stop runs again, a writer that lost a race writes nothing, and nothing else
writes a status."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

import relaunch
from relaunch.states import JOB_TRANSITIONS, IllegalJobMove, JobStatus, StopCause, check_job_move
from relaunch.store import Store

SRC = Path(relaunch.__file__).parent


@pytest.mark.parametrize(
    ("current", "to"), list(itertools.product(JobStatus, JobStatus)), ids=lambda s: s.value
)
def test_a_job_moves_only_where_its_status_machine_has_an_arrow(
    current: JobStatus, to: JobStatus
) -> None:
    cause = StopCause.HANGUP  # resumable: the only way out of a stop
    allowed = to in JOB_TRANSITIONS[current] or (current is to and not current.ended)
    if allowed:
        check_job_move(current, to, cause)
    else:
        with pytest.raises(IllegalJobMove):
            check_job_move(current, to, cause)


def test_a_stop_needs_its_cause_and_only_a_resumable_stop_runs_again() -> None:
    with pytest.raises(IllegalJobMove, match="with its cause"):
        check_job_move(JobStatus.RUNNING, JobStatus.STOPPED)
    for cause in StopCause:
        if cause.resumable:
            check_job_move(JobStatus.STOPPED, JobStatus.RUNNING, cause)
        else:
            with pytest.raises(IllegalJobMove, match="stopped to be resumed"):
                check_job_move(JobStatus.STOPPED, JobStatus.RUNNING, cause)


def test_the_store_writes_an_end_once_with_its_time_and_a_stale_writer_writes_nothing(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "relaunch.db")
    job = store.create_job("toy", {"raw": {}}, [], 1.0)
    assert store.claim_job(job, 2.0) and not store.claim_job(job, 2.5)  # one runner claims it
    row = store.job(job)
    assert (row.status, row.attempt_started_at) == (JobStatus.RUNNING, 2.0)
    moved = store.move_job(job, JobStatus.RUNNING, JobStatus.FAILED, 3.0, reason="no budget left")
    assert moved == {"status": JobStatus.FAILED, "ended_at": 3.0, "reason": "no budget left",
                     "stop_cause": None}  # fmt: skip
    # a writer that still believes it runs: refused by the store, nothing written
    assert store.move_job(job, JobStatus.RUNNING, JobStatus.SUCCEEDED, 4.0, reason="x") is None
    row = store.job(job)
    assert (row.status, row.reason, row.ended_at) == (JobStatus.FAILED, "no budget left", 3.0)
    with pytest.raises(IllegalJobMove):
        store.move_job(job, JobStatus.FAILED, JobStatus.RUNNING, 5.0)


def test_a_resumable_stop_runs_again_with_its_end_cleared(tmp_path: Path) -> None:
    store = Store(tmp_path / "relaunch.db")
    job = store.create_job("toy", {"raw": {}}, [], 1.0)
    store.claim_job(job, 2.0)
    hangup = StopCause.HANGUP
    store.move_job(job, JobStatus.RUNNING, JobStatus.STOPPED, 3.0, reason="hup", cause=hangup)
    assert store.job(job).resumable
    assert store.reopen_to_resume(job, 4.0) is hangup
    row = store.job(job)
    assert (row.status, row.reason, row.ended_at, row.stop_cause) == (
        JobStatus.RUNNING, "", None, None
    )  # fmt: skip
    assert row.controller_seen_at == 4.0


@pytest.mark.parametrize("field", ["status", "reason", "ended_at", "stop_cause"])
def test_no_other_write_of_a_job_changes_its_status_or_its_end(tmp_path: Path, field: str) -> None:
    store = Store(tmp_path / "relaunch.db")
    job = store.create_job("toy", {"raw": {}}, [], 1.0)
    with pytest.raises(IllegalJobMove, match="written by move_job only"):
        store.update_job(job, **{field: None}, last_step=3)
    assert store.job(job).last_step is None and store.job(job).status is JobStatus.PENDING


def test_only_the_stores_two_writers_update_a_job_in_sql() -> None:
    """move_job (the status and the end) and update_job (everything else, refusing those)."""
    writers = [
        (path.relative_to(SRC).as_posix(), text.count("UPDATE jobs"))
        for path in SRC.rglob("*.py")
        if "UPDATE jobs" in (text := path.read_text())
    ]
    assert writers == [("store/tables.py", 2)], writers
