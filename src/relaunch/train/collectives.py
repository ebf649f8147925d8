"""Collectives that can be issued again: operator-level online recovery (R-29).

When a link goes down in the middle of an all-reduce, the collective fails (its transport breaks,
or it outlives its timeout). Here the failure does not end the step: the rank tells relaunch
(`report_collective_failure`: a datagram to its launcher, then the controller, over the
management network, not the failed data link), waits for relaunch's order, forms the group anew
on the order's store, puts back the inputs it kept, and issues again, in order, every collective
of the step from the one that failed: no process restarts, no step is computed again, the
parameters end as if nothing had happened. Used by the process-group keeper
(`ProcessGroupKeeper`) when the job turns operator retry on (HCCL_OP_RETRY_ENABLE with L1:1):
for DDP's gradient buckets (a communication hook) and its own commit, and for the script's own
`keeper.all_reduce`.

Why a copy: an all-reduce works in place, so its input is gone once it ran (part of it even when
it failed); the input of every collective of the current step and the last one is kept (a rank
can be one collective ahead of a peer whose link broke at the very end of a ring), and that copy
is the fault-free cost (BENCHMARKS.md).

Which collective: all ranks issue the same collectives in the same order, so (step, place in the
step) names one everywhere. An order names the earliest one any rank failed: a rank ahead of it
issues again from there what it had already finished (the same inputs, the same result), a rank
behind it reaches it in the new group.

Waiting for relaunch's order is bounded by the job's retry settings (HCCL_OP_RETRY_PARAMS); a
newer membership that is not an order (relaunch gave up and moved to process-level recovery) or
no order in time raises `OperatorRetryFailed`, which the keeper handles as any failed collective.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relaunch.protocol.operator import OperatorRetry
from relaunch.protocol.plans import Membership, read_membership
from relaunch.train.progress import report_collective_failure

__all__ = ["OperatorRetryFailed", "RetryableCollectives"]

POLL_S = 0.05
"""How often a collective that has not finished looks for relaunch's order meanwhile."""
KEPT_STEPS = 2


class OperatorRetryFailed(RuntimeError):
    """The collective could not be issued again (relaunch gave up, or no order came in time):
    the keeper's process-level recovery takes over, as for any failed collective."""


class _Ordered(Exception):
    """An order came while a collective was under way: it is left, and the order followed."""


class _Failed(Exception):
    pass


@dataclass
class _Issued:
    """One collective of a step, and what it takes to issue it again."""

    step: int
    index: int
    tensor: torch.Tensor
    kept: torch.Tensor
    op: Any
    average: bool

    @property
    def position(self) -> tuple[int, int]:
        return self.step, self.index


class RetryableCollectives:
    """The keeper's collectives, issued on a group of their own that relaunch's orders form
    anew (see the module docstring)."""

    def __init__(
        self,
        membership_path: Path,
        original_rank: int,
        settings: OperatorRetry,
        timeout_s: float,
    ) -> None:
        self.membership_path = membership_path
        self.original_rank = original_rank
        self.settings = settings
        self.timeout_s = timeout_s
        self.group: Any = None
        self.generation = 0
        """The membership generation the group was formed for."""
        self.membership: Membership | None = None
        self.stores: list[Any] = []
        self.issued: list[_Issued] = []
        self.step = 0
        self.index = 0
        self.retried = 0
        """Collectives issued again so far (each order counts one)."""

    # -- the keeper's side ---------------------------------------------------------------------

    def formed(self, membership: Membership, store: Any) -> None:
        """The keeper formed its group for `membership` on `store`: the collectives' group is
        formed alongside (a prefix of the same store), replacing any older one."""
        prefix = dist.PrefixStore(f"relaunch-ops-{membership.generation}", store)  # type: ignore[attr-defined]
        self._group(membership, prefix)

    def begin_step(self, step: int) -> None:
        self.step, self.index = step, 0
        self.issued = [i for i in self.issued if i.step > step - KEPT_STEPS]

    # -- collectives ---------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, *, average: bool = False) -> None:
        """`dist.all_reduce(tensor, op)` that is issued again after a transport fault;
        `average`: divided by the world size first (DDP's gradient buckets)."""
        entry = _Issued(
            self.step,
            self.index,
            tensor,
            tensor.detach().clone(),
            op if op is not None else dist.ReduceOp.SUM,
            average,
        )
        self.index += 1
        self.issued.append(entry)
        self._issue(entry)

    def ddp_hook(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """A DDP communication hook: the bucket's gradients averaged across the ranks, issued
        again after a transport fault (register with `ddp.register_comm_hook(None, hook)`)."""
        tensor = bucket.buffer()
        self.all_reduce(tensor, average=True)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(tensor)
        return future

    def _issue(self, entry: _Issued) -> None:
        order = self._order()
        if order is not None:
            self._follow(order, entry)
            return
        try:
            self._run(entry, entry.tensor)
        except _Ordered:
            order = self._order()
            assert order is not None
            self._follow(order, entry)
        except _Failed as failure:
            self._follow(self._report_and_wait(entry, str(failure)), entry)

    def _follow(self, order: Membership, upto: _Issued) -> None:
        """Form the group of `order` and issue again, in order, each collective from the one it
        names to `upto` (the one under way: on its own tensor, its input put back; the others
        on a copy of their input: this rank has their result already)."""
        while True:
            self._group(order, self._store(order))
            self.retried += 1
            assert order.operator is not None
            start = (order.operator[0], order.operator[1])
            again = [i for i in self.issued if start <= i.position < upto.position]
            entry = upto
            try:
                for entry in [*again, upto]:
                    target = entry.tensor if entry is upto else torch.empty_like(entry.kept)
                    target.copy_(entry.kept)
                    self._run(entry, target)
                return
            except _Ordered:
                newer = self._order()
                assert newer is not None
                order = newer
            except _Failed as failure:
                order = self._report_and_wait(entry, str(failure))

    def _run(self, entry: _Issued, target: torch.Tensor) -> None:
        """Issue one collective on the current group and wait for it, looking for orders
        meanwhile: `_Ordered` if one comes, `_Failed` if the collective fails or outlives the
        timeout."""
        if self.group is None:
            raise _Failed("no group formed (the keeper has not started)")
        if entry.average:
            target.div_(self.group.size())
        options = dist.AllreduceOptions()
        options.reduceOp = entry.op
        work = self.group.allreduce([target], options)
        began = time.monotonic()
        while True:
            try:
                work.wait(timedelta(seconds=POLL_S))
                return
            except RuntimeError as error:
                if work.is_completed():  # it failed: its transport broke, or its timeout
                    raise _Failed(str(error).splitlines()[0][:200]) from None
            if self._order() is not None:
                raise _Ordered
            if time.monotonic() - began > self.timeout_s + 1.0:
                raise _Failed(f"no answer in {self.timeout_s:g} s")

    # -- relaunch's orders ---------------------------------------------------------------------

    def _order(self) -> Membership | None:
        """An order newer than the current group (None: none)."""
        found = read_membership(self.membership_path)
        if found is None or found.generation <= self.generation:
            return None
        if found.operator is None:
            raise OperatorRetryFailed(
                f"relaunch moved on to generation {found.generation} without issuing the "
                "collective again"
            )
        return found

    def _report_and_wait(self, entry: _Issued, why: str) -> Membership:
        report_collective_failure(entry.step, entry.index, self.generation, why)
        s = self.settings
        deadline = time.monotonic() + s.hold_s + s.max_count * s.interval_s + self.timeout_s + 30
        while time.monotonic() < deadline:
            order = self._order()
            if order is not None:
                return order
            time.sleep(0.02)
        raise OperatorRetryFailed(
            f"collective {entry.index} of step {entry.step} failed ({why}) and no order to "
            "issue it again came within the job's retry settings"
        )

    # -- groups --------------------------------------------------------------------------------

    def _store(self, order: Membership) -> Any:
        rank = order.ranks[self.original_rank]
        return dist.TCPStore(  # type: ignore[attr-defined]
            order.addr,
            order.port,
            order.world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=self.settings.interval_s + self.timeout_s + 30),
        )

    def _group(self, membership: Membership, store: Any) -> None:
        self.stores.append(store)  # a store's server must outlive its peers' use of it
        rank = membership.ranks[self.original_rank]
        self.group = dist.ProcessGroupGloo(
            store, rank, membership.world_size, timedelta(seconds=self.timeout_s)
        )
        self.generation = membership.generation
        self.membership = membership


def settings_from_env() -> OperatorRetry | None:
    """The job's R-29 settings as its environment gives them (None: off)."""
    from relaunch.protocol.operator import from_environment

    return from_environment(os.environ)
