"""The process group's membership (process-level recovery): which ranks form each generation of
the group, where its store listens, who joins, who is parked. Published to the store and to every
launcher, which writes it where the SDK's ProcessGroupKeeper reads it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relaunch import failpoints
from relaunch.controller import commands
from relaunch.events import EventKind
from relaunch.policy import Counters
from relaunch.policy.elastic import scale_out
from relaunch.protocol.messages import MembershipUpdate
from relaunch.protocol.plans import Membership
from relaunch.store import JobStatus

if TYPE_CHECKING:
    from relaunch.controller.context import ControllerContext

__all__ = ["MembershipPublisher"]


class MembershipPublisher:
    def __init__(self, controller: ControllerContext) -> None:
        self.c = controller
        self.joining: tuple[int, ...] = ()
        """Ranks of a scale-out that have not reported progress yet (the others wait for them)."""
        self.joining_until = 0.0

    def current(self) -> Membership | None:
        data = self.c.job.membership
        return Membership.from_json(data) if data else None

    def parked(self) -> set[int]:
        """Pods left out of the group by an elastic scale-in, until a node takes them back."""
        current = self.current()
        return set(current.parked) if current is not None else set()

    def publish(
        self,
        joiners: tuple[int, ...] = (),
        retry: bool = False,
        parked: set[int] | None = None,
        reform: bool = False,
        operator: tuple[int, int, int] | None = None,
        suspects: tuple[int, ...] = (),
    ) -> int:
        """The next generation of the group: a new store port unless it is an online retry,
        which keeps the group. Parked pods' ranks are left out and the others are numbered
        densely (elastic training). `reform`: the same ranks form the group anew, on a new
        store, and run the interrupted step again (a network fault broke its connections).
        `operator`: an order to issue a failed collective again (R-29: step, collective,
        attempt), on a new store; the keeper's own group is not this generation's. `suspects`:
        the ranks whose memory an online retry's fault may have touched. Returns the
        generation published (0: none, process-level recovery is off)."""
        c = self.c
        if not c.recovery.process_level:
            return 0
        previous = self.current()
        if parked is None:
            parked = self.parked() if (joiners or retry or reform or operator) else set()
        if retry and previous is not None:
            port = previous.port
        elif previous is None or not (joiners or parked or reform or operator):
            port = c.job.master_port
        else:
            port = commands.master_port(c)
        active = [p.row for p in c.pods.values() if p.index not in parked]
        membership = Membership.of_pods(
            {p.idx: p.generation for p in active},
            c.spec.procs_per_pod,
            generation=(previous.generation if previous else 0) + 1,
            addr=c.engine.node_address(active[0].node) if active else "127.0.0.1",
            port=port,
            joiners=tuple(sorted(joiners)),
            retry=retry,
            suspects=tuple(sorted(suspects)),
            parked=tuple(sorted(parked)),
            operator=operator,
        )
        c.update_job(membership=_stored(membership))
        failpoints.reach("membership-stored")
        update = MembershipUpdate(membership)  # one message, encoded once (protocol.wire)
        for pod in c.pods.values():
            if pod.link is not None:
                pod.link.peer.send(update)
        c.event(
            EventKind.GROUP_FORMED,
            generation=membership.generation,
            world_size=membership.world_size,
            what=_what(membership, reform),
        )
        return membership.generation

    def scale_out(self, now: float) -> None:
        """Elastic training (R-33): the policy's scale-out carried out: the parked pods it
        sends back get new containers on their nodes, and their ranks join the running job."""
        c = self.c
        parked = self.parked()
        if not parked or c.job.status is not JobStatus.RUNNING:
            return
        free = commands.free_nodes(
            c, {p.row.node for p in c.pods.values() if p.index not in parked}
        )
        counters = [Counters(p.row.schedule_cnt, p.row.proc_start_cnt) for p in c.pods.values()]
        decided = scale_out(parked, free, counters, recovering=c.recoveries.active is not None)
        if decided is None:
            return
        commands.unpark(c, decided, now)
        self.joining = tuple(r for idx in decided.pods for r in c.ranks_of(idx))
        self.joining_until = now + c.startup_s
        self.publish(joiners=self.joining, parked=parked - set(decided.pods))

    def joined(self, rank: int) -> None:
        if rank in self.joining:
            self.joining = ()
            self.c.event(EventKind.SCALE_OUT_TRAINING)


def _what(membership: Membership, reform: bool) -> str:
    """What a generation of the group is for, in words."""
    operator = membership.operator
    what = (
        f"issue collective {operator[1]} of step {operator[0]} again (attempt {operator[2]})"
        if operator is not None
        else "online retry"
        if membership.retry
        else f"replacements {sorted(membership.joiners)}"
        if membership.joiners
        else "the same ranks anew (the step runs again)"
        if reform
        else "fresh group"
    )
    if membership.parked:
        what += f"; pods {sorted(membership.parked)} left out"
    return what


def _stored(membership: Membership) -> dict[str, object]:
    import json

    return dict(json.loads(membership.to_json()))
