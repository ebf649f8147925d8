"""Faults to decisions to recoveries, and the one recovery under way.

    fault ──store (fault + pending decision, one transaction)──> waiting
    waiting ──policy.decide──> decision ──store (record + desired change + pending dropped)──>
        final (ignore, fail): done          hands over (dump, exit): waiting again, one level down
        otherwise: the ActiveRecovery, carried out by its level's action (controller.actions)
    ActiveRecovery ──progress resumed──> settled succeeded
                   ──a new fault, or its own failure (a heal that did not heal)──> settled
                     failed, and a fault waits again (policy.fallback says which, and with what
                     already tried)

Each arrow that writes is one store transaction, so a controller killed anywhere resumes from the
store with every fault decided exactly once. The recovery's phases are controller.active's: this
driver asks it for each change (`recorded`, `move`, `save`), and never writes one itself.
Nothing here blocks: a heal is a request whose answer
(or its absence by a deadline) is an observation like any other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from relaunch import failpoints
from relaunch.cluster import Settled
from relaunch.controller import active as phases
from relaunch.controller import commands
from relaunch.controller.actions import action_for
from relaunch.controller.active import HEAL_TIMEOUT_S, ActiveRecovery, RecoveryPhase
from relaunch.diagnosis import Group, is_collateral, root_cause
from relaunch.events import EventKind, fault_fields
from relaunch.faults import Fault, FaultKind
from relaunch.policy import Action, Decision, decide
from relaunch.policy.fallback import (
    FAILED_AT_START_S,
    Consequence,
    decide_after,
    on_new_fault,
)
from relaunch.store import JobStatus, RecordRow

if TYPE_CHECKING:
    from relaunch.controller.context import ControllerContext

__all__ = ["RecoveryDriver"]


class RecoveryDriver:
    """Turns waiting faults into decisions and decisions into the active recovery."""

    def __init__(self, controller: ControllerContext) -> None:
        self.c = controller
        self.active: ActiveRecovery | None = None
        self.hold_until = 0.0
        """A decision held back (R-41's start window) until then."""
        self.waiting = False
        """Faults wait for a decision (the store says which)."""
        self.group: Group | None = None
        """The last fault stored to be decided: failures it caused are its collateral."""
        self.members: list[Fault] = []
        """The group's faults: its first and its collateral so far."""
        self.hang_stop = False
        """The processes are being stopped because the job hung: the hang grace applies."""
        self.heal_requests = 0
        """The number of the last heal request sent (an answer to an older one is dropped)."""
        self.waited_until = 0.0
        """When the last process-level recovery worked: the ranks that kept running waited for
        the restarted ones until then, silent (R-25 counts their silence from then)."""

    # -- faults ---------------------------------------------------------------------------------

    def fault(
        self,
        fault: Fault,
        source: str,
        attempt: int | None = None,
        started_at: float = 0.0,
        evidence: Mapping[str, Any] | None = None,
        detected_at: float | None = None,
    ) -> None:
        """Store a fault and what waits for a decision because of it, in one transaction; then
        decide. A controller killed in between finds the decision still waiting on resume.
        A process exit that the last fault caused (`attempt`: the exited process's, and when
        it started) is stored as that fault's collateral and not decided again. `evidence`:
        what diagnosis found (a hang's stacks), stored with the fault; `detected_at`: when the
        fault was found, if before now (a hang, found before its stacks were captured)."""
        c = self.c
        if c.job.status.ended:
            return
        attempt = c.job.attempt if attempt is None else attempt
        if self.collateral(fault, source, attempt, started_at):
            return
        now = c.clock.now()
        active = self.active
        if active is not None and action_for(active.action).absorbs(c, active, fault, now):
            # the recovery's own business (a re-issued collective failed again): recorded only
            if (
                c.store.add_fault(c.job_id, fault, now, source, collateral_of=active.fault_id)
                is not None
            ):
                c.event(EventKind.FAULT_ABSORBED, action=active.action.value, **fault_fields(fault))
            return
        fallback = None
        if active is not None:
            fallback = on_new_fault(
                active.action, active.fault, active.tried, fault, self._action_alone(fault, now)
            )
        alongside = fallback is not None and fallback.consequence is Consequence.ALONGSIDE
        with c.store.transaction():
            found_at = now if detected_at is None else detected_at
            fault_id = c.store.add_fault(c.job_id, fault, found_at, source, evidence=evidence)
            if fault_id is None:
                return  # seen before (a heartbeat repeats it, a resumed controller re-hears it)
            if not alongside:  # a fault only recorded causes nothing: no collateral is its
                self.group, self.members = Group(fault_id, fault, attempt), [fault]
            waiting, tried = fault_id, frozenset[Action]()
            if active is not None and fallback is not None and not alongside:
                self._settle(active, RecoveryPhase.FAILED)
                if fallback.consequence is Consequence.FALL_BACK:
                    waiting, tried = active.fault_id, fallback.tried
            c.store.add_pending(c.job_id, waiting, sorted(tried))
        if not alongside:
            self.active = None
        c.event(EventKind.FAULT, **fault_fields(fault))
        if active is not None and fallback and fallback.consequence is Consequence.FALL_BACK:
            said = fault_fields(active.fault)
            c.event(EventKind.RECOVERY_FELL_BACK, action=active.action.value, **said)
        failpoints.reach("fault-stored")
        self.waiting = True
        c.hurry()

    def collateral(self, fault: Fault, source: str, attempt: int, started_at: float) -> bool:
        """Store `fault` as collateral of the last fault if it is (diagnosis.rootcause). Not in
        a job with process-level recovery while its attempt runs: there a healthy rank's exit
        means the finer recovery failed (R-20), which the policy must hear."""
        c = self.c
        group = self.group
        if group is None or not is_collateral(
            group, fault, attempt, started_at, c.cluster.root_cause_window_s
        ):
            return False
        if c.recovery.process_level and attempt == c.job.attempt:
            return False
        stored = c.store.add_fault(
            c.job_id, fault, c.clock.now(), source, collateral_of=group.fault_id
        )
        if stored is None:
            return True
        before = root_cause(self.members)
        self.members.append(fault)
        c.event(EventKind.COLLATERAL, **fault_fields(group.first, "first"), **fault_fields(fault))
        if root_cause(self.members) is fault and fault is not before:
            said = f": {fault.error.summary()}" if fault.error is not None else ""
            c.event(EventKind.ROOT_CAUSE, **fault_fields(fault), error_text=said)
        return True

    def failed(self, why: str) -> None:
        """The recovery under way cannot work (a heal that did not heal): settled failed, and
        its fault waits for the next level down."""
        active = self.active
        if active is None:
            return
        c = self.c
        with c.store.transaction():
            self._settle(active, RecoveryPhase.FAILED)
            c.store.add_pending(c.job_id, active.fault_id, sorted(active.tried | {active.action}))
        c.event(EventKind.RECOVERY_FAILED, action=active.action.value, why=why)
        self.waiting = True
        c.hurry()

    # -- decisions ------------------------------------------------------------------------------

    def decide_waiting(self, now: float) -> None:
        """Decide every fault that waits (normally the one just stored; after a resume, what the
        killed controller stored and did not decide), unless the policy holds it back."""
        c = self.c
        if not self.waiting or now < max(c.adoption.until, self.hold_until):
            return
        waiting = c.store.pending(c.job_id)
        # one look at every rank, for the hold and the decision
        ranks: commands.RanksNow | None = commands.ranks_now(c)
        failed, saving = commands.failed_and_saving(c, ranks)
        hold = decide_after(
            c.recovery,
            [(fault, tried) for _, fault, tried in waiting],
            c.job.attempt_started_at or now,
            failed,
            len(c.pods),
            now,
            saving=bool(waiting) and saving,
        )
        if hold is not None:
            self.hold_until = hold
            return
        self.waiting = False
        for fault_id, fault, tried in waiting:
            if c.job.status.ended:
                return
            active = self.active
            if active is not None and action_for(active.action).absorbs(c, active, fault, now):
                # stored before the recovery decided just now began: its business all the same
                # (two ranks' failures of one collective, heard in one pass)
                with c.store.transaction():
                    c.store.make_collateral(c.job_id, fault_id, active.fault_id)
                c.event(EventKind.FAULT_ABSORBED, action=active.action.value, **fault_fields(fault))
                continue
            if active is not None and (  # a newer fault outranks a recovery under way
                on_new_fault(
                    active.action, active.fault, active.tried, fault, self._action_alone(fault, now)
                ).consequence
                is not Consequence.ALONGSIDE
            ):
                self._settle(active, RecoveryPhase.FAILED)
            self._climb(fault, fault_id, tried, now, ranks)
            ranks = None  # the next fault's decision looks again: this one changed things

    def _action_alone(self, fault: Fault, now: float) -> Action:
        """What the policy would decide for `fault` on its own, as things stand (pure; nothing
        is stored): whether it is only recorded decides what it does to a recovery under way."""
        c = self.c
        return decide(
            c.recovery,
            fault,
            c.store.history(c.job_id, pods=[p.row for p in c.pods.values()]),
            commands.cluster_view(c, fault),
            now,
            table=c.options.table,
            rules=c.options.rules,
        ).action

    def _climb(
        self,
        fault: Fault,
        fault_id: int,
        tried: frozenset[Action],
        now: float,
        ranks: commands.RanksNow | None = None,
    ) -> None:
        """Down the ladder until an action is under way or the job ends; each record is stored
        with its desired-state change and what still waits, in one transaction. `ranks`: the
        look at every rank just taken, for the first rung (a record changes nothing of them)."""
        c = self.c
        while True:
            pods = [p.row for p in c.pods.values()]
            history = c.store.history(c.job_id, before_fault=fault_id, pods=pods)
            decision = decide(
                c.recovery,
                fault,
                history,
                commands.cluster_view(c, fault, ranks),
                now,
                table=c.options.table,
                rules=c.options.rules,
                tried=tried,
            )
            c.event(
                EventKind.DECISION,
                action=decision.action.value,
                reason=decision.reason,
                passed_over=list(decision.passed_over),
                summary=decision.summary(),
                **fault_fields(fault),
            )
            action = decision.action
            self.hang_stop = fault.kind is FaultKind.HANG
            if action.final or action.hands_over:
                after = tried | {action} if action.hands_over else None
                self.record(decision, fault_id, tried, now, still_waiting=after)
                if action.hands_over:
                    tried |= {action}
                    continue
                return
            self._begin(decision, fault, fault_id, tried, now)
            return

    def _begin(
        self,
        decision: Decision,
        fault: Fault,
        fault_id: int,
        tried: frozenset[Action],
        now: float,
    ) -> None:
        """Store the record with its plan (WAITING), then send what its level sends (RUNNING)."""
        c = self.c
        level = action_for(decision.action)
        active = ActiveRecovery(
            0, fault, fault_id, decision.action, tried, now, wait_s=decision.wait_s
        )
        current = c.membership.current()
        active.base_generation = current.generation if current is not None else 0
        active.fence_until = c.leases.fence_until(fault)
        level.plan(c, decision, active)
        self.record(decision, fault_id, tried, now, active)
        failpoints.reach("decision-stored")
        self.active = active
        self.carry_on(active)

    def carry_on(self, active: ActiveRecovery) -> None:
        """WAITING -> RUNNING: the level sends what it must (what a killed controller did not
        send, on resume), and the recovery's state is stored with its new phase."""
        why = action_for(active.action).begin(self.c, active)
        if why is not None:  # a heal nobody can answer fails it at once
            self.failed(why)
        elif self.active is active:
            phases.move(self.c.store, active, RecoveryPhase.RUNNING)

    def save(self, active: ActiveRecovery) -> None:
        """What changed inside the recovery's phase, stored for a resumed controller."""
        phases.save(self.c.store, active)

    def resume(self, records: list[RecordRow]) -> None:
        """The recovery a killed controller left under way, as it stored it: one still WAITING
        sends what it had not sent once the adoption window is over (`carry_on`); one RUNNING
        waits for the same proof. Faults only recorded while it ran (`ignore`, stored after it)
        are passed over: they leave the recovery under way alone (policy.fallback, ALONGSIDE),
        so it is the newest record of any other action."""
        for record in reversed(records):
            if record.action is Action.IGNORE:
                continue
            if RecoveryPhase(record.phase).live:
                active = ActiveRecovery.resumed(record)
                if active.heal is not None:  # its requests go on from the stored one's number
                    self.heal_requests = max(self.heal_requests, active.heal.request)
                self.active = active
            return

    def next_heal_request(self) -> int:
        """The number of a new heal request (an answer to an older one is dropped)."""
        self.heal_requests += 1
        return self.heal_requests

    def record(
        self,
        decision: Decision,
        fault_id: int,
        tried: frozenset[Action],
        now: float,
        active: ActiveRecovery | None = None,
        still_waiting: frozenset[Action] | None = None,
    ) -> int:
        """Store a record, the desired-state change its action makes, whether its fault still
        waits for a decision (`still_waiting`: the actions tried by then) and, for a recovery
        that runs, its plan (WAITING), together. A final decision is done at once (ignore:
        SUCCEEDED, fail: FAILED), a hand-over (dump, exit) too (HANDED_OVER)."""
        c = self.c
        budgets = decision.budgets_left
        # what the change needs of the engine, asked before the transaction holds the store:
        # a port on the node rank 0 will be on (where the decision moves pod 0, if it does)
        rank0_node = dict(decision.targets).get(0)
        port = commands.master_port(c, rank0_node) if decision.action.level.new_attempt else 0
        action = decision.action
        phase = phases.first_phase(action, runs=active is not None)
        with c.store.transaction():
            record_id = phases.recorded(
                c.store,
                c.job_id,
                fault_id,
                decision,
                sorted(tried),
                {"job": budgets.job, "pod": budgets.pod, "fault_retry": budgets.fault_retry}
                if budgets
                else {},
                now,
                phase,
                active,
            )
            action_for(action).change(c, decision, now, port)
            if still_waiting is None:
                c.store.drop_pending(c.job_id, fault_id)
            else:
                c.store.add_pending(c.job_id, fault_id, sorted(still_waiting))
        return record_id

    # -- the recovery under way -----------------------------------------------------------------

    def progressed(
        self,
        rank: int,
        started_at: float,
        attempt: int,
        step: int | None,
        reported_at: float | None = None,
    ) -> None:
        """A sign of progress: if it proves the active recovery worked, settle it. Nothing proves
        a recovery still WAITING (resumed, it has not sent what it must yet). A step proves it
        at once; a sign of life of a script that reports no steps (`step` None: a line) only
        once the process lived on through the start window after it (`check`): a rank that
        prints its traceback and dies at import has not recovered anything (R-21)."""
        active = self.active
        c = self.c
        if active is None or attempt != c.job.attempt or active.phase is not RecoveryPhase.RUNNING:
            return
        if not action_for(active.action).worked(active, rank, started_at, step, reported_at):
            return
        if step is None:
            if active.alive_since is None:
                active.alive_since = c.clock.now()
            return
        self.succeeded(c.clock.now())

    def succeeded(self, now: float, resumed_at: float | None = None) -> None:
        """The recovery worked; progress resumed at `resumed_at` (now if not said)."""
        active = self.active
        if active is None:
            return
        c = self.c
        resumed_at = now if resumed_at is None else resumed_at
        self._settle(active, RecoveryPhase.SUCCEEDED, resumed_at)
        if active.action.process_level:
            self.waited_until = now
        c.move_job(JobStatus.RUNNING)
        self.hang_stop = False
        c.event(
            EventKind.RECOVERED,
            action=active.action.value,
            after_s=resumed_at - active.fault.at,
            **fault_fields(active.fault),
        )
        failpoints.reach("recovered")

    def _settle(
        self, active: ActiveRecovery, phase: RecoveryPhase, resumed_at: float | None = None
    ) -> None:
        """To SUCCEEDED or FAILED: its record settled (the MTTR, when progress resumed), and no
        longer the recovery under way."""
        phases.move(self.c.store, active, phase, resumed_at)
        if self.active is active:
            self.active = None
        took = resumed_at - active.fault.at if resumed_at is not None else None
        ok = phase is RecoveryPhase.SUCCEEDED
        what = Settled(active.action.value, ok, active.fault.describe(), active.pods, took)
        self.c.engine.settled(what)

    def healed(self, request: int, ok: bool) -> None:
        heal = self.active.heal if self.active is not None else None
        if heal is None or heal.request != request:
            return
        heal.ok = ok
        if not ok:
            network = self.active is not None and self.active.fault.kind is FaultKind.NETWORK
            self.failed("the link is still down" if network else "the chip did not heal")
        else:
            self.c.hurry()

    def check(self, now: float) -> None:
        """Deadlines of the recovery under way: a heal not answered in time did not heal; a
        replacement that made no progress within the decision's wait did not join (R-32)."""
        active = self.active
        if active is None:
            return
        alive = active.alive_since
        if alive is not None and now >= alive + FAILED_AT_START_S:
            self.succeeded(now, resumed_at=alive)  # a sign of life, and no exit since
            return
        why = action_for(active.action).tick(self.c, active, now)
        if why is not None:
            self.failed(why)
            return
        heal = active.heal
        if heal is not None and heal.ok is None and now > heal.deadline:
            self.failed(f"the agent of {heal.node} did not answer the heal in {HEAL_TIMEOUT_S:g} s")
        elif active.wait_s is not None and now > active.started_at + active.wait_s:
            self.failed(
                f"the replacement processes made no progress within {active.wait_s:g} s "
                "(wait-reschedule-timeout, R-32)"
            )
