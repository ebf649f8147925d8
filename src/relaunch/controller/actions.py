"""What each recovery level does, one small class per level, registered by the `Action` it
declares. Adding a level is one declaration, its entry of the policy's LEVELS (policy.rungs:
what it is, what it changes to each container, the job's status while it runs, the run it
extends, its rung and its place in the ladder), and one class here (what it sends); the
registry refuses to load unless the classes cover LEVELS exactly.

Each level says four things:

- `change`: the desired state it sets, inside its record's transaction (nodes isolated, pods'
  counters, nodes and generations, the job's attempt and status). The controller's reconcile then
  converges the running pods to it;
- `plan`: what it will need (the ranks it restarts, the step it waits past), stored with its
  record (controller.active), so that a resumed controller carries it on;
- `begin`: what it sends once its record is stored (memberships, restarts, a heal request),
  skipping what the observed state shows done already: a controller killed before it sent all
  runs it again on resume;
- `worked`: which sign of progress proves it worked.

`ready_to_start` lets a level hold the start of the new processes (in-place waits for its heal).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, Final

from relaunch.controller import commands
from relaunch.controller.active import OperatorState
from relaunch.events import EventKind
from relaunch.faults import Fault, FaultKind
from relaunch.policy import LEVELS, Action, Decision, PodChange
from relaunch.states import StopCause
from relaunch.store import JobStatus, NodeState, PodRow

if TYPE_CHECKING:
    from relaunch.controller.active import ActiveRecovery
    from relaunch.controller.context import ControllerContext

__all__ = ["ACTIONS", "LevelAction", "action_for"]


class LevelAction:
    """The defaults: nothing moves, the same processes run on, any progress proves it."""

    action: ClassVar[Action]

    @property
    def new_attempt(self) -> bool:
        """Every process of the job starts again (a new attempt): the policy's LEVELS says."""
        return self.action.level.new_attempt

    def change(self, c: ControllerContext, d: Decision, now: float, port: int = 0) -> None:
        """The desired state the level's LEVELS entry declares: the decision's nodes isolated,
        the pods it rebuilds on their new nodes, every pod's counters, a new attempt (its rank 0
        on `port`). Runs inside the record's transaction: it asks the engine nothing."""
        isolate(c, d, now)
        level = self.action.level
        decided = frozenset(d.pods)  # a set: a job-level decision names every pod
        moved = {
            pod.index
            for pod in c.pods.values()
            if level.change_of(pod.index in decided) is PodChange.RESCHEDULED
        }
        if d.counters or moved:
            move_pods(c, d, moved=moved)
        if level.new_attempt:
            new_attempt(c, now, port)
        if level.recovering:
            c.move_job(JobStatus.RECOVERING)

    def plan(self, c: ControllerContext, d: Decision, active: ActiveRecovery) -> None:
        """Fill in what the recovery needs from its decision (no side effect)."""
        active.pods = d.pods

    def begin(self, c: ControllerContext, active: ActiveRecovery) -> str | None:
        """Send what the level sends; why it cannot work, if it already knows (the recovery
        driver then fails it), else None."""
        if self.new_attempt and c.recovery.process_level and not published(c, active):
            c.membership.publish()  # every process starts again: a fresh group
        return None

    def ready_to_start(self, active: ActiveRecovery) -> bool:
        return True

    def tick(self, c: ControllerContext, active: ActiveRecovery, now: float) -> str | None:
        """What the level does as time passes (each pass), beyond its deadlines; why it failed,
        once it knows (the recovery driver then fails it), else None."""
        return None

    def absorbs(
        self, c: ControllerContext, active: ActiveRecovery, fault: Fault, now: float
    ) -> bool:
        """Whether a new fault is this recovery's own business (not a new decision): it is
        then recorded as collateral of the recovery's fault. A collective that failed while a
        recovery runs failed because of it (its group is being torn down and formed anew)."""
        return fault.kind is FaultKind.COLLECTIVE

    def worked(
        self,
        active: ActiveRecovery,
        rank: int,
        started_at: float,
        step: int | None,
        reported_at: float | None = None,
    ) -> bool:
        """Progress from a process started after the recovery began (`reported_at`: when the
        rank reported the step, where it did)."""
        return started_at >= active.started_at


class Ignore(LevelAction):
    action = Action.IGNORE

    def change(self, c: ControllerContext, d: Decision, now: float, port: int = 0) -> None:
        isolate(c, d, now)  # a fault on a node the job does not use may still take the node out


class Fail(LevelAction):
    action = Action.FAIL

    def change(self, c: ControllerContext, d: Decision, now: float, port: int = 0) -> None:
        isolate(c, d, now)
        if d.wants_nodes and c.engine.facts.nodes_come_back:  # requeued, it resumes
            reason = f"{d.reason}; stopped to be resumed when nodes come back (waiting for nodes)"
            c.move_job(JobStatus.STOPPED, reason=reason, cause=StopCause.WANTS_NODES)
            return
        c.move_job(JobStatus.FAILED, reason=d.reason)


class HandOver(LevelAction):
    """dump and exit: the healthy processes save (their dying gasp) or exit when the next level
    stops them; the next level runs at once."""

    action = Action.DUMP

    def change(self, c: ControllerContext, d: Decision, now: float, port: int = 0) -> None:
        isolate(c, d, now)


class Exit(HandOver):
    action = Action.EXIT


class ProcessRetry(LevelAction):
    """R-30: every rank rolls the step back and runs it again: in the same group for a chip's
    memory error; for a network fault or a failed collective, whose link broke the group's
    connections, in a group formed anew by the same ranks (each waits in the new store until the
    link is back)."""

    action = Action.PROCESS_RETRY

    def plan(self, c: ControllerContext, d: Decision, active: ActiveRecovery) -> None:
        active.after_step = c.progress.step or 0

    def begin(self, c: ControllerContext, active: ActiveRecovery) -> str | None:
        if not published(c, active):
            # the step to get past is the newest heard when the ranks are told (later than the
            # fault's for a controller resumed meanwhile: the ranks may have gone on)
            active.after_step = max(active.after_step or 0, c.progress.step or 0)
            if active.fault.kind in (FaultKind.NETWORK, FaultKind.COLLECTIVE):
                c.membership.publish(reform=True)
            else:  # a memory error: its ranks take model and optimizer from a replica
                c.membership.publish(retry=True, suspects=commands.suspects(c, active.fault))
        if active.fault.chip is not None and active.heal is None:
            # the chip's error is repaired while the step runs again: left faulty, its node
            # would count as faulty for every later decision (R-31's rank-0 rule); a chip that
            # cannot heal fails the retry, and the ladder goes on down
            return commands.request_heal(c, active)
        return None

    def worked(
        self,
        active: ActiveRecovery,
        rank: int,
        started_at: float,
        step: int | None,
        reported_at: float | None = None,
    ) -> bool:
        """A step past the newest one heard before, reported after the recovery began: a report
        of a step done before the fault may reach the controller late (batched, or held by a
        link that was down), and proves nothing."""
        late = reported_at is not None and reported_at < active.started_at
        return step is not None and step > (active.after_step or 0) and not late


class OperatorRetry(LevelAction):
    """R-29: the failed collective is issued again, nothing restarts. The first re-issue may go
    `hold_s` after the failure, the next ones `interval_s` apart, `max_count` in all; each goes
    only while every node of the job has its data link up (a re-issue while a link is down
    would fail: it is skipped, and counts). A re-issue is an order in a new generation of the
    membership: the ranks form a group anew on its store and issue again, from the failed
    collective on, all they had issued since. Another failure of the collective is this
    recovery's (the next re-issue); progress past the step proves it; spent, it fails and the
    fault goes down the ladder (process-retry, R-30)."""

    action = Action.OPERATOR_RETRY

    def plan(self, c: ControllerContext, d: Decision, active: ActiveRecovery) -> None:
        retry = c.recovery.operator_retry
        fault = active.fault
        assert retry is not None and fault.step is not None and fault.collective is not None
        active.after_step = c.progress.step or 0
        active.operator = OperatorState(
            fault.step, fault.collective, fault.at + retry.hold_s, retry.max_count
        )

    def begin(self, c: ControllerContext, active: ActiveRecovery) -> str | None:
        """Nothing at once: its re-issues go as time passes (`tick`)."""
        return None

    def tick(self, c: ControllerContext, active: ActiveRecovery, now: float) -> str | None:
        op, retry = active.operator, c.recovery.operator_retry
        if op is None or retry is None:
            return None
        if op.order is not None:
            if now - op.ordered_at > max(c.hang_s, 10.0):
                return (
                    f"no step completed within {now - op.ordered_at:.0f} s of issuing collective "
                    f"{op.collective} of step {op.step} again"
                )
            return None
        if now < op.next_at:
            return None
        if op.left <= 0:
            return (
                f"collective {op.collective} of step {op.step} could not be issued again within "
                f"{retry.max_count} attempt(s) (HCCL_OP_RETRY_PARAMS)"
            )
        attempt = retry.max_count - op.left + 1
        op.left -= 1
        down = commands.links_down(c)
        if down:
            c.event(
                EventKind.RETRY_HELD,
                attempt=attempt,
                max_count=retry.max_count,
                nodes=", ".join(down),
                down=list(down),
            )
            op.next_at = now + retry.interval_s
            return None
        op.order = c.membership.publish(operator=(op.step, op.collective, attempt))
        op.ordered_at = now
        c.recoveries.save(active)  # a resumed controller counts it
        return None

    def absorbs(
        self, c: ControllerContext, active: ActiveRecovery, fault: Fault, now: float
    ) -> bool:
        op, retry = active.operator, c.recovery.operator_retry
        if fault.kind is not FaultKind.COLLECTIVE or op is None or retry is None:
            return False
        assert fault.step is not None and fault.collective is not None
        if (fault.step, fault.collective) < (op.step, op.collective):
            op.step, op.collective = fault.step, fault.collective  # an earlier one failed too
        if op.order is not None:  # the re-issue failed: the next one, an interval later
            op.order = None
            op.next_at = max(now, op.ordered_at + retry.interval_s)
        return True

    worked = ProcessRetry.worked


class ProcessInPlace(LevelAction):
    """R-31: only the faulty processes restart, on the same node; the others wait for them."""

    action = Action.PROCESS_IN_PLACE

    def plan(self, c: ControllerContext, d: Decision, active: ActiveRecovery) -> None:
        active.ranks = commands.faulty_ranks(c, active.fault)

    def begin(self, c: ControllerContext, active: ActiveRecovery) -> str | None:
        if not published(c, active):
            c.membership.publish(joiners=active.ranks)
        commands.restart_ranks(c, active.ranks)
        return None

    def worked(
        self,
        active: ActiveRecovery,
        rank: int,
        started_at: float,
        step: int | None,
        reported_at: float | None = None,
    ) -> bool:
        return rank in active.ranks and started_at >= active.started_at


class ProcessReschedule(LevelAction):
    """R-32: the faulty node's pods move to a standby node and join the running group."""

    action = Action.PROCESS_RESCHEDULE

    def plan(self, c: ControllerContext, d: Decision, active: ActiveRecovery) -> None:
        active.pods = d.pods
        active.ranks = tuple(r for pod in d.pods for r in c.ranks_of(pod))

    def begin(self, c: ControllerContext, active: ActiveRecovery) -> str | None:
        if not published(c, active):
            c.membership.publish(joiners=active.ranks)
        return None

    worked = ProcessInPlace.worked


class ScaleIn(LevelAction):
    """R-33: the lost pods are parked; the others go on with fewer replicas."""

    action = Action.SCALE_IN

    def plan(self, c: ControllerContext, d: Decision, active: ActiveRecovery) -> None:
        active.pods = d.pods
        active.after_step = c.progress.step or 0

    def begin(self, c: ControllerContext, active: ActiveRecovery) -> str | None:
        commands.park(c, active.pods)
        if not published(c, active):
            c.membership.publish(parked=c.membership.parked() | set(active.pods))
        return None

    worked = ProcessRetry.worked


class InPlace(LevelAction):
    """R-20: heal the chip, then every container re-runs the start command. The heal is a
    request: the new processes start once the agent says the chip healed; a heal that fails (or
    gets no answer) fails this recovery, and the policy moves one level down."""

    action = Action.IN_PLACE

    def begin(self, c: ControllerContext, active: ActiveRecovery) -> str | None:
        super().begin(c, active)
        if active.heal is None or active.heal.ok is None:  # again after a resume: a new request
            return commands.request_heal(c, active)
        return None

    def ready_to_start(self, active: ActiveRecovery) -> bool:
        return active.heal is None or active.heal.ok is True


class HangRestart(LevelAction):
    """R-24: kill the processes (with the short hang grace), keep the containers, start again."""

    action = Action.HANG_RESTART


class PodReschedule(LevelAction):
    """R-23: the faulty node's pods are recreated elsewhere; the others re-run the command."""

    action = Action.POD_RESCHEDULE


class JobReschedule(LevelAction):
    """R-21: every pod is rebuilt (new containers, new generation)."""

    action = Action.JOB_RESCHEDULE


class IsolatedJobReschedule(JobReschedule):
    """R-22: the faulty node is isolated, then the whole job is rebuilt on healthy nodes."""

    action = Action.ISOLATED_JOB_RESCHEDULE


def published(c: ControllerContext, active: ActiveRecovery) -> bool:
    """The recovery published its membership already (a controller killed after it did, before
    it stored that it had: nothing else publishes while a recovery runs)."""
    current = c.membership.current()
    return current is not None and current.generation > active.base_generation


# -- the desired-state changes the levels share -------------------------------------------------


def isolate(c: ControllerContext, d: Decision, now: float) -> None:
    if not d.isolate_nodes:
        return
    for node in d.isolate_nodes:
        row = c.node(node)
        if row is None:
            continue
        if row.state is not NodeState.LOST:
            c.store.set_node_state(
                node, NodeState.ISOLATED, f"isolated: {d.assessment.fault.describe()}", now
            )
        else:
            c.store.set_node_state(
                node, NodeState.LOST, f"lost and isolated: {d.assessment.fault.describe()}"
            )
        c.refresh_node(node)


def move_pods(c: ControllerContext, d: Decision, moved: set[int]) -> None:
    """Every pod gets the decision's counters; `moved` pods a new generation on the node the
    decision chose for each (its targets)."""
    places = dict(d.targets)
    job_dir = c.layout.job(c.job_id)
    changed = []
    for pod in c.pods.values():
        row = pod.row
        counters = d.counters[row.idx]
        generation = row.generation + (1 if row.idx in moved else 0)
        workdir = job_dir.pod_path(row.idx, generation) if row.idx in moved else row.workdir
        wanted = PodRow(
            row.job_id,
            row.idx,
            places.get(row.idx, row.node),
            generation,
            counters.schedule_cnt,
            counters.proc_start_cnt,
            workdir,
        )
        if wanted != row:  # a process-level recovery touches one pod of thousands
            changed.append(wanted)
    c.put_pods(changed)


def new_attempt(c: ControllerContext, now: float, port: int) -> None:
    """The job's next attempt, its rank 0 listening on `port` (asked of the engine before the
    record's transaction began: a Ray node answers in its own time)."""
    c.update_job(attempt=c.job.attempt + 1, attempt_started_at=now, master_port=port)


def _registered() -> dict[Action, LevelAction]:
    """One instance of each class that declares its own `action`; every level of the policy's
    LEVELS has exactly one (a level without a class, or two classes for one, is a defect found
    at import)."""
    found: dict[Action, LevelAction] = {}
    todo = list(LevelAction.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        action = cls.__dict__.get("action")
        if action is None:
            continue
        if action in found:
            raise TypeError(f"two classes carry out {action.value}")
        found[action] = cls()
    missing = set(LEVELS) - set(found)
    if missing:
        raise TypeError(f"no class carries out {', '.join(sorted(a.value for a in missing))}")
    return found


ACTIONS: Final[Mapping[Action, LevelAction]] = MappingProxyType(_registered())
"""Each level's class, by the action it carries out."""


def action_for(action: Action) -> LevelAction:
    return ACTIONS[action]
