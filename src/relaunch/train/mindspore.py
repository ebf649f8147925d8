"""The training SDK for MindSpore: steps reported to relaunch, and checkpoints saved and loaded
through the SDK's guarantees (atomic, verified with a fallback to the one before, optionally
asynchronous; a dying gasp on relaunch's SIGTERM where asked), for a `Model.train` script and
for a hand-written loop. Imports MindSpore (its own venv: `make mindspore`); not torch.

`Model.train`, with MindSpore's own callbacks beside relaunch's::

    manager = CheckpointManager("ckpt", every=20)
    saves = Checkpoints(manager, optimizer)      # the optimizer holds the network's parameters
    start = saves.restore()                      # the newest verified step, 0 for none
    model.train(epochs, dataset, callbacks=[Progress(), saves],
                initial_epoch=start // steps_per_epoch)

A hand-written loop::

    start = restore(manager, optimizer)
    for step in range(start + 1, steps + 1):
        with manager.step(step):
            loss, grads = grad_fn(x, y); optimizer(reducer(grads))
        report_progress(step)
        manager.maybe_save(step, lambda: state_of(optimizer))
"""

from __future__ import annotations

import os
from typing import Any

import mindspore as ms
import numpy as np
from mindspore.train import Callback

from relaunch.protocol.environment import Env
from relaunch.train.checkpoint import CheckpointManager
from relaunch.train.progress import report_progress

__all__ = ["Checkpoints", "Progress", "load_into", "restore", "state_of", "train_step"]


def state_of(cell: Any) -> dict[str, np.ndarray]:
    """Every parameter of `cell` (a network, or an optimizer: its moments with the network's
    parameters it updates), by name, as host arrays: what a checkpoint holds."""
    return {p.name: p.asnumpy() for p in cell.get_parameters()}


def load_into(cell: Any, state: dict[str, np.ndarray]) -> None:
    """`state` (from :func:`state_of`) back into `cell`'s parameters, bit for bit. A name
    missing on either side is an error: a checkpoint of another network is not half loaded."""
    parameters = {p.name: p for p in cell.get_parameters()}
    if set(parameters) != set(state):
        missing, extra = sorted(set(parameters) - set(state)), sorted(set(state) - set(parameters))
        raise ValueError(f"the checkpoint does not fit: missing {missing}, unknown {extra}")
    for name, parameter in parameters.items():
        parameter.set_data(ms.Tensor(np.ascontiguousarray(state[name])))


def restore(
    manager: CheckpointManager,
    cell: Any,
    *,
    world_size: int | None = None,
    replicated: bool = True,
    gasp: bool = False,
) -> int:
    """The newest step every rank can resume from loaded into `cell`, so that the workers
    resume together; its step (0: none). `gasp`: the dying gasp armed to save `cell` on
    relaunch's SIGTERM (call `manager.step(step)` around each step); off by default: a worker
    blocked in a collective whose peer died cannot run Python's SIGTERM handler (MindSpore's
    CPU collective returns at its 30 s heartbeat time-out), so an armed gasp held relaunch's
    stop of the survivors of a crash 30 s (without a handler, SIGTERM ends them at once).
    `replicated` (data parallelism: every worker holds the same parameters): the
    newest step any worker saved, a replica's shard where this worker has none (a worker that
    died saved no gasp, its peers did); else the newest all saved. Read from the checkpoints'
    shared storage (the job's `shared_dir`), not through a collective: every worker restores
    before its first step, which none ends alone. `world_size`: RANK_SIZE's, by default."""
    if gasp:
        manager.dying_gasp(lambda: state_of(cell))
    size = world_size if world_size is not None else int(os.environ.get(Env.MS_RANK_SIZE, "1"))
    per_rank = [set(manager.verified_steps(rank)) for rank in range(size)]
    usable = set.union(*per_rank) if replicated else set.intersection(*per_rank)
    if not usable:
        return 0
    newest = max(usable)
    holders = [r for r, steps in enumerate(per_rank) if newest in steps]
    holders.sort(key=lambda r: r != manager.rank)  # its own shard first
    for holder in holders:
        found = manager.load(newest, rank=holder)
        if found is not None:
            load_into(cell, found.state)
            manager.completed_step = found.step
            return found.step
    raise RuntimeError(f"step {newest} verified, then did not load: its storage changed")


def train_step(run_context: Any) -> int:
    """The step of the whole run that `Model.train` is at: its step counter restarts at 1 in a
    run resumed with `initial_epoch` (MindSpore 2.10), its epoch counter does not."""
    args = run_context.original_args()
    per_epoch = int(args.batch_num)
    return (int(args.cur_epoch_num) - 1) * per_epoch + (int(args.cur_step_num) - 1) % per_epoch + 1


class Progress(Callback):  # type: ignore[misc]
    """Reports each training step of `Model.train` to relaunch: hang detection by steps, a
    fault plan's `at_step`, goodput, "progress resumed" after a recovery. Outside relaunch it
    does nothing."""

    def on_train_step_end(self, run_context: Any) -> None:
        report_progress(train_step(run_context))


class Checkpoints(Callback):  # type: ignore[misc]
    """Saves `cell`'s parameters through `manager` every `manager.every` steps of `Model.train`;
    :meth:`restore` loads the newest verified checkpoint before training. `Model.train` resumes
    at an epoch's start (its `initial_epoch`): `every` must be a multiple of the epoch's steps,
    and there is no dying gasp (a step in the middle of an epoch is no place to resume from);
    a hand-written loop has one (:func:`restore`)."""

    def __init__(self, manager: CheckpointManager, cell: Any) -> None:
        super().__init__()
        self.manager, self.cell = manager, cell

    def restore(self, *, world_size: int | None = None) -> int:
        return restore(self.manager, self.cell, world_size=world_size)

    def on_train_begin(self, run_context: Any) -> None:
        steps = int(run_context.original_args().batch_num)
        if self.manager.every is None or self.manager.every % steps:
            raise ValueError(
                f"Model.train resumes at an epoch's start: save every multiple of its {steps} "
                f"steps (CheckpointManager(every=...) is {self.manager.every})"
            )

    def on_train_step_end(self, run_context: Any) -> None:
        step = train_step(run_context)
        self.manager.completed_step = step
        self.manager.maybe_save(step, lambda: state_of(self.cell))

    def on_train_end(self, run_context: Any) -> None:
        self.manager.wait()
