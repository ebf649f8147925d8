"""torch.distributed helpers for resumable jobs. Importing this module imports torch."""

from __future__ import annotations

import copy
import hashlib
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from relaunch.protocol.datagrams import RestoreTier
from relaunch.protocol.environment import Env
from relaunch.protocol.plans import Membership
from relaunch.protocol.rollback import StepRollback
from relaunch.train import overlap, rng
from relaunch.train.checkpoint import Checkpoint, CheckpointManager
from relaunch.train.progress import report_restore

__all__ = [
    "elastic_boundaries",
    "load_common_checkpoint",
    "parameter_hash",
    "replica_restore",
    "restore_snapshot",
    "rng_state",
    "rollback_mode",
    "set_rng_state",
    "settle_ddp_buckets",
    "step_snapshot",
]


def load_common_checkpoint(
    manager: CheckpointManager, *, replicated: bool = False
) -> Checkpoint | None:
    """The newest step that every rank can resume from, so that all ranks resume together even
    when some rank's newest shard is damaged or missing. A collective: every rank must call it.

    `replicated=True` (data parallelism: every rank holds the same state) lets a rank without a
    shard of that step load a healthy replica's, as when a rank died before its dying gasp; with
    peer memory, a rank whose own copy is not in a peer's memory loads a replica's copy that is
    (a node lost right after a save takes its ranks' newest copies with it) before storage.
    """
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, manager.verified_steps())
    per_rank = [set(steps) for steps in gathered]
    usable = set.union(*per_rank) if replicated else set.intersection(*per_rank)
    if not usable:
        return None
    newest = max(usable)
    if manager.steps() and manager.steps()[0] > newest:
        manager.load()  # warns about the newer, unusable shards
    holders = [rank for rank, steps in enumerate(per_rank) if newest in steps]
    if manager.rank in holders:
        holders.remove(manager.rank)
        holders.insert(0, manager.rank)  # its own shard first
    if replicated and manager.peers is not None:  # any replica a peer's memory holds, first
        held = manager.peers.index()
        holders.sort(key=lambda rank: not manager.held_by_peer(held, rank, newest))
    return manager.load(newest, rank=holders[0])


def parameter_hash(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in order: equal hashes, bit-identical models."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def rng_state() -> dict[str, Any]:
    """Every random stream the script uses (torch CPU and CUDA, `random`, NumPy), for its
    checkpoint: see :mod:`relaunch.train.rng`."""
    return rng.capture()


def set_rng_state(state: dict[str, Any]) -> None:
    rng.restore(state)


def settle_ddp_buckets(
    ddp: torch.nn.parallel.DistributedDataParallel, *inputs: torch.Tensor
) -> None:
    """One zero-loss pass before training, so that every real step sums gradients the same way.

    DDP lays its gradient buckets out anew after its first backward; the layout decides the order
    of floating-point sums in the allreduce. Without this pass, the first step after a restart
    would be summed with the initial layout and an unbroken run's with the rebuilt one: the same
    maths, other rounding, and a resumed job no longer ends bit for bit where an unbroken one does.
    Changes no parameter, no optimizer state and no random stream (the forward pass may draw,
    for dropout: every stream is put back as it was). A collective: every rank must call it.
    """
    with rng.preserved():
        output = ddp(*inputs)
        (output.sum() * 0.0).backward()
    ddp.module.zero_grad(set_to_none=True)


def rollback_mode(asked: str | None, optimizer: torch.optim.Optimizer) -> StepRollback:
    """What the keeper keeps of each step (`StepRollback`): `asked`, else the job's
    (RELAUNCH_STEP_ROLLBACK), else a replica's. An optimizer whose state is sharded across the
    ranks (ZeroRedundancyOptimizer) has no replica of a rank's: it takes a snapshot."""
    value = asked if asked is not None else os.environ.get(Env.STEP_ROLLBACK, StepRollback.REPLICA)
    try:
        mode = StepRollback(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in StepRollback)
        raise ValueError(f"step rollback {value!r}: expected one of {allowed}") from None
    # torch.distributed.optim is not imported here: its import warns of torch.jit 66 times
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if (
        mode is StepRollback.REPLICA
        and zero
        and isinstance(optimizer, zero.ZeroRedundancyOptimizer)
    ):
        return StepRollback.SNAPSHOT
    return mode


def elastic_boundaries(asked: int | None) -> tuple[int, bool]:
    """Every how many steps the keeper keeps an elastic boundary (`asked`, else
    RELAUNCH_ELASTIC_EVERY, else 20), and whether it keeps any: its full copy of model and
    optimizer is only for a world that may change size (elastic-training among the job's
    strategies, R-33, or boundaries asked for)."""
    env_every = os.environ.get(Env.ELASTIC_EVERY)
    every = max(1, asked or int(env_every or 20))
    wanted = asked is not None or env_every is not None
    return every, wanted or "elastic-training" in os.environ.get(Env.HIGH_AVAILABILITY, "")


def step_snapshot(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, full: bool
) -> dict[str, Any]:
    """What a step changes before its commit, taken at its start so that it can run again (an
    online retry): the random streams and the module's buffers (a forward pass updates
    BatchNorm's running statistics). Parameters and optimizer state change only at the keeper's
    optimizer step, after the commit; `full` copies them too (`StepRollback.SNAPSHOT`)."""
    snap: dict[str, Any] = {"rng": rng_state()}
    if full:
        snap["model"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        snap["optimizer"] = copy.deepcopy(optimizer.state_dict())
    else:
        snap["buffers"] = {k: v.detach().clone() for k, v in model.named_buffers()}
    return snap


def restore_snapshot(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, snapshot: dict[str, Any]
) -> None:
    """Back to the step's start (`step_snapshot`), its gradients cleared."""
    if "model" in snapshot:
        overlap.settle_pending()  # the save before this step holds the state it saved
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
    else:
        buffers = dict(model.named_buffers())
        with torch.no_grad():
            for name, saved in snapshot["buffers"].items():
                buffers[name].copy_(saved)
    set_rng_state(snapshot["rng"])
    optimizer.zero_grad(set_to_none=True)


def replica_restore(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    m: Membership,
    original_rank: int,
    step: int,
) -> int | None:
    """An online retry after a memory error (`StepRollback.REPLICA`): the ranks whose memory it
    may have touched (`m.suspects`) take model and optimizer from the lowest healthy rank, whose
    are the same (data parallelism; the step changed neither before its commit), and the record
    says so. A collective: every rank of `m` calls it. The rank that served, None if none could
    (every rank a suspect: each keeps its own)."""
    healthy = [m.ranks[r] for r in m.ranks if r not in m.suspects]
    if not m.suspects or not healthy:
        return None
    source = min(healthy)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    box: list[Any] = [state if dist.get_rank() == source else None]
    dist.broadcast_object_list(box, src=source)
    if original_rank in m.suspects:
        overlap.settle_pending()  # an overlapped save's copy comes before the state it gets
        model.load_state_dict(box[0]["model"])
        optimizer.load_state_dict(box[0]["optimizer"])
        report_restore(step, RestoreTier.REPLICA, str(source))
    return source
