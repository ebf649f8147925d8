"""The record is data (relaunch.events): each kind's template and fields agree, an event is
stored and read back as its kind and fields, and a stopped job's exit and resumability come
from its typed cause, never from the words of its reason."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from relaunch.cli.common import exit_code
from relaunch.events import Event, EventKind
from relaunch.states import JobStatus, StopCause
from relaunch.store import Store


@pytest.mark.parametrize("kind", list(EventKind), ids=lambda k: k.value)
def test_every_kind_renders_from_the_fields_it_declares(kind: EventKind) -> None:
    fields = {name: 1.5 for name in kind.fields}
    event = Event.of(kind, **fields)
    assert event.text == kind.template.format_map(fields)
    assert "{" not in event.text


def test_an_event_without_a_field_its_kind_needs_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="a node-lost event needs silent_s, why"):
        Event.of(EventKind.NODE_LOST, node="node-1")


def test_an_event_is_stored_as_its_kind_and_fields_and_an_older_sentence_has_no_kind(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "relaunch.db")
    lost = Event.of(EventKind.NODE_LOST, node="node-1", why="its agent exited", silent_s=2.25)
    store.event(1, lost, at=10.0)
    store.event(1, Event.of(EventKind.SUCCEEDED, job="toy"), at=11.0)
    with sqlite3.connect(tmp_path / "relaunch.db") as db:  # as a relaunch before kinds wrote it
        db.execute("INSERT INTO events (job_id, at, text) VALUES (1, 12.0, 'node n1 lost: x')")
    first, second, older = store.events(1)
    assert (first.at, first.kind, dict(first.fields)) == (10.0, EventKind.NODE_LOST, lost.fields)
    assert first.text == "node node-1 lost: its agent exited (last heartbeat 2.2 s ago)"
    assert second.kind is EventKind.SUCCEEDED
    assert (older.kind, dict(older.fields), older.text) == (None, {}, "node n1 lost: x")
    assert [e.at for e in store.events_of(EventKind.NODE_LOST)] == [10.0]
    assert lost.subject == "node node-1"


@pytest.mark.parametrize(
    ("cause", "code", "resumable"),
    [
        (StopCause.CTRL_C, 130, False),
        (StopCause.SIGTERM, 143, False),
        (StopCause.HANGUP, 129, True),
        (StopCause.WANTS_NODES, 3, True),
        (StopCause.REQUEST, 1, False),
        (StopCause.ABANDONED, 1, False),
    ],
)
def test_a_stopped_jobs_exit_and_resume_come_from_its_cause_whatever_its_reason_says(
    tmp_path: Path, cause: StopCause, code: int, resumable: bool
) -> None:
    store = Store(tmp_path / "relaunch.db")
    job = store.create_job("toy", {"raw": {}}, [], 1.0)
    # a reason that reads like another cause: only the cause counts
    store.move_job(
        job, JobStatus.PENDING, JobStatus.STOPPED, 1.5, reason="stopped (SIGHUP)", cause=cause
    )
    row = store.job(job)
    assert (row.stop_cause, row.resumable) == (cause, resumable)
    assert exit_code(row.status, row.stop_cause) == code
    assert store.reopen_to_resume(job, 2.0) == (cause if resumable else None)
    reopened = store.job(job)
    assert reopened.status is (JobStatus.RUNNING if resumable else JobStatus.STOPPED)
    assert reopened.stop_cause is (None if resumable else cause)


def test_a_job_stopped_without_a_cause_exits_1_and_is_not_resumed(tmp_path: Path) -> None:
    """A job an older relaunch stopped (no cause written): its reason is not read for one."""
    store = Store(tmp_path / "relaunch.db")
    job = store.create_job("toy", {"raw": {}}, [], 1.0)
    with sqlite3.connect(tmp_path / "relaunch.db") as db:  # as a relaunch before causes wrote it
        db.execute("UPDATE jobs SET status = 'Stopped', reason = 'stopped by the user (SIGHUP)'")
    assert exit_code(JobStatus.STOPPED, store.job(job).stop_cause) == 1
    assert store.reopen_to_resume(job, 2.0) is None
    assert exit_code(JobStatus.SUCCEEDED, None) == 0 and exit_code(JobStatus.FAILED, None) == 1
