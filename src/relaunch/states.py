"""The states of the domain's things: a node, a job, a recovery's outcome. Pure values (no I/O):
the store keeps them, and the pure parts (detectors, policy, diagnosis) read them without
importing the store."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["HANGUP", "RESUMABLE_ENDS", "WANTS_NODES", "JobStatus", "NodeState", "Outcome"]

HANGUP = "(SIGHUP)"
"""How the reason of a job stopped by a hangup (its run's terminal closed) ends: such a job is
not ended for good, `relaunch run --resume` restarts it from its checkpoints."""
WANTS_NODES = "(waiting for nodes)"
"""How the reason of a job stopped for want of nodes ends: its last level needed a node and none
was left, on an engine whose nodes come back (a Slurm job requeued gets a new allocation);
`relaunch run --resume` restarts it from its checkpoints on the nodes it has then."""
RESUMABLE_ENDS = (HANGUP, WANTS_NODES)
"""The ends of a stopped job's reason that `relaunch run --resume` carries on."""


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


class Outcome(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
