"""Process-level recovery for sharded state (FSDP2, any state split across the ranks): healthy
ranks keep their processes through a replaced rank's recovery, and every rank goes back to the
newest checkpoint.

ProcessGroupKeeper's healthy ranks give a replacement their state: with data parallelism each
holds all of it. A sharded job has no such replica: the replaced rank's shard lived only in its
process, and in its checkpoints (and, with `peer_memory_mb`, in another node's memory). So when
the group re-forms, :class:`ShardedGroupKeeper` builds model and optimizer anew on the new group
(FSDP2 keeps the group it was sharded on), gives the checkpoint manager a group of the new one
(`ShardedCheckpointManager.regroup`) and has every rank load the newest step that verifies; the
replacement loads its shard from a peer's memory where a copy is held, checked against the
manifest, else from storage, and the record says which. What healthy ranks keep: their process,
its imports and its CUDA context; not their steps since that checkpoint::

    keeper = ShardedGroupKeeper(build)         # build(): model sharded, optimizer over it
    keeper.start()                             # forms the group, then calls build()
    ckpt = ShardedCheckpointManager(directory, every=5)
    keeper.completed = resume()                # every rank: load the newest step, its number
    keeper.run(keeper.completed + 1, steps, train_step, after, checkpoint=ckpt, resume=resume)

where ``resume()`` loads the newest checkpoint into ``keeper.model`` and ``keeper.optimizer``
(the script's own load at its start) and returns its step, 0 if there is none. Every rank calls
the same collectives in the same order: the replacement builds, constructs its checkpoint manager
and resumes; the healthy ranks build, regroup and resume.

An online retry (a memory error) restores each rank from its own copy of the step's start: the
keeper takes one before every step (`StepRollback.SNAPSHOT`), the price of state with no replica.
A change of world size (elastic training) goes the same way: the newest checkpoint, which DCP
reshards onto the new group, is the step every member goes back to."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from relaunch.protocol.plans import Membership
from relaunch.protocol.rollback import StepRollback
from relaunch.train.checkpoint import CheckpointManager
from relaunch.train.following import GroupLost
from relaunch.train.group import ProcessGroupKeeper

__all__ = ["ShardedGroupKeeper"]

Build = Callable[[], tuple[nn.Module, torch.optim.Optimizer]]


class ShardedGroupKeeper(ProcessGroupKeeper):
    def __init__(
        self,
        build: Build,
        *,
        backend: str = "gloo",
        collective_timeout_s: float | None = None,
        wait_s: float | None = None,
    ) -> None:
        # model and optimizer exist only once the group does (build() shards on it): start()
        super().__init__(
            nn.Module(),
            cast(torch.optim.Optimizer, None),
            backend=backend,
            collective_timeout_s=collective_timeout_s,
            wait_s=wait_s,
            rollback=StepRollback.SNAPSHOT.value,
            operator_retry=False,  # R-29's retried collectives are DDP's buckets: not here
        )
        self.build = build
        self.elastic = False  # no boundary copies: a re-formed group reloads a checkpoint
        self._checkpoint: Any = None
        self._resume: Callable[[], int] | None = None

    def _begin(self, m: Membership | None) -> None:
        self._build()

    def _build(self) -> None:
        self.model, self.optimizer = self.build()
        self.module = self.model

    def _rejoin(self, m: Membership) -> None:
        """Build anew on the re-formed group, regroup the checkpoint, load the newest step: at
        a new world size too (elastic scale-in or out), DCP resharding the saved shards onto
        the new group. The checkpoint is the boundary every member goes back to."""
        if self._resume is None or self._checkpoint is None:
            raise GroupLost("a sharded keeper re-forms its group only inside run(..., resume=)")
        self._build()
        self._checkpoint.regroup()
        self.completed = int(self._resume())
        self._checkpoint.completed_step = self.completed

    def _retry_restore(self, m: Membership) -> None:
        """Each rank has restored its own snapshot (`_restore`): shards have no replica."""

    def run(
        self,
        first: int,
        last: int,
        train_step: Callable[[int], Any],
        after: Callable[[int, Any], None] | None = None,
        checkpoint: CheckpointManager | None = None,
        resume: Callable[[], int] | None = None,
    ) -> None:
        """ProcessGroupKeeper.run, with what a re-formed group needs: the checkpoint manager
        (a ShardedCheckpointManager: `regroup`) and `resume`, the script's own load."""
        if self.recovery_enabled and (resume is None or not hasattr(checkpoint, "regroup")):
            raise TypeError(
                "ShardedGroupKeeper.run needs checkpoint=a ShardedCheckpointManager and resume="
                "a function that loads its newest step into keeper.model and keeper.optimizer"
            )
        self._checkpoint, self._resume = checkpoint, resume
        super().run(first, last, train_step, after, checkpoint)
