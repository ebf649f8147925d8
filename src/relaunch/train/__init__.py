"""The training SDK, importable without torch: the job's environment, progress reports,
checkpoints that a restart can trust, a dying-gasp save, and reentrancy helpers.
torch.distributed helpers live in :mod:`relaunch.train.distributed`."""

from relaunch.train.checkpoint import (
    Checkpoint,
    CheckpointManager,
    CheckpointWarning,
    StateChangedDuringSave,
)
from relaunch.train.progress import JobEnv, env, report_progress
from relaunch.train.reentrancy import once_per_container, recreate_shared_memory

__all__ = [
    "Checkpoint",
    "CheckpointManager",
    "CheckpointWarning",
    "JobEnv",
    "StateChangedDuringSave",
    "env",
    "once_per_container",
    "recreate_shared_memory",
    "report_progress",
]
