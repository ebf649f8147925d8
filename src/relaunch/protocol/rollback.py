"""What process-level recovery keeps of each step to run it again: the spec's `step_rollback`,
read alike by the spec and the SDK (train.group). Standard library only."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["StepRollback"]


class StepRollback(StrEnum):
    """What a process-level recovery keeps of each step to run it again (the spec's
    `step_rollback`, train.group). Parameters and optimizer state change only at the keeper's
    optimizer step, after every rank committed the step: a fault before it leaves them as they
    were, unless it struck the memory they live in."""

    REPLICA = "replica"
    """Each step keeps only what its forward pass changes (random streams, buffers); a rank whose
    memory a fault touched takes model and optimizer from a healthy data-parallel replica."""
    SNAPSHOT = "snapshot"
    """Each step also copies model and optimizer in the rank's own memory (state that has no
    replica: a sharded optimizer; a job of one replica)."""
