"""The states of the domain's things: a node, a job, a recovery's outcome. Pure values (no I/O):
the store keeps them, and the pure parts (detectors, policy, diagnosis) read them without
importing the store."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Final

__all__ = [
    "JOB_TRANSITIONS",
    "IllegalJobMove",
    "JobStatus",
    "NodeState",
    "Outcome",
    "StopCause",
    "check_job_move",
]


class StopCause(StrEnum):
    """Why a job was stopped (its status Stopped), kept beside the reason a person reads: what
    `relaunch run` exits with, and whether `relaunch run --resume` carries the job on."""

    REQUEST = "request"
    """Asked for through the API or `relaunch stop`."""
    CTRL_C = "ctrl-c"
    SIGTERM = "sigterm"
    """`relaunch run` was sent SIGTERM (Slurm's scancel, a supervisor's stop)."""
    HANGUP = "sighup"
    """Its run's terminal closed: an accident, not an end; `--resume` restarts it from its
    checkpoints."""
    WANTS_NODES = "wants-nodes"
    """Its last level needed a node and none was left, on an engine whose nodes come back (a
    Slurm job requeued gets a new allocation); `--resume` restarts it on the nodes it has then."""
    ABANDONED = "abandoned"
    """Its controller died and a new foreground run found it."""

    @property
    def resumable(self) -> bool:
        return self in (StopCause.HANGUP, StopCause.WANTS_NODES)

    @property
    def exit_code(self) -> int:
        """`relaunch run`'s exit status for a job stopped so (128 + the signal, as a shell's)."""
        codes = {StopCause.CTRL_C: 130, StopCause.SIGTERM: 143, StopCause.HANGUP: 129}
        return codes.get(self, 3 if self is StopCause.WANTS_NODES else 1)

    @classmethod
    def of_signal(cls, name: str) -> StopCause:
        """The cause for a signal `relaunch run` was sent, by its name ("SIGTERM")."""
        return {"SIGTERM": cls.SIGTERM, "SIGHUP": cls.HANGUP}.get(name, cls.CTRL_C)


class NodeState(StrEnum):
    READY = "Ready"
    FAULTY = "Faulty"
    ISOLATED = "Isolated"
    LOST = "Lost"


class JobStatus(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    RECOVERING = "Recovering"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    STOPPED = "Stopped"

    @property
    def active(self) -> bool:
        """A controller owns the job (or owned it and died: the job waits to be resumed)."""
        return self in (JobStatus.RUNNING, JobStatus.RECOVERING)

    @property
    def ended(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED)


JOB_TRANSITIONS: Final[Mapping[JobStatus, frozenset[JobStatus]]] = {
    # submitted: a runner claims it, a stop asked for ends it, a spec that no longer works fails it
    JobStatus.PENDING: frozenset({JobStatus.RUNNING, JobStatus.STOPPED, JobStatus.FAILED}),
    JobStatus.RUNNING: frozenset(
        {JobStatus.RECOVERING, JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    ),
    JobStatus.RECOVERING: frozenset(
        {JobStatus.RUNNING, JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    ),
    # only a stop whose cause is resumable (StopCause.resumable): `relaunch run --resume`
    JobStatus.STOPPED: frozenset({JobStatus.RUNNING}),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset(),
}
"""The job's status machine: where each status may go. A move to the status it has already
(a second level while recovering) changes nothing but the fields written with it, except for a
job that has ended: its end is written once."""


class IllegalJobMove(ValueError):
    """A change of a job's status its status machine has no arrow for (a bug, not an input)."""


def check_job_move(current: JobStatus, to: JobStatus, cause: StopCause | None = None) -> None:
    """Raises IllegalJobMove unless `current` may go to `to` (`cause`: why it stops, needed for
    a stop, and for leaving one: only a resumable stop is carried on)."""
    if current is to and not current.ended:
        return
    if to not in JOB_TRANSITIONS[current]:
        raise IllegalJobMove(f"a {current.value} job cannot become {to.value}")
    if to is JobStatus.STOPPED and cause is None:
        raise IllegalJobMove("a job is stopped with its cause (StopCause)")
    if current is JobStatus.STOPPED and (cause is None or not cause.resumable):
        raise IllegalJobMove("only a job stopped to be resumed runs again")


class Outcome(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
