"""The rungs of the recovery ladder, one function per level, and LEVELS, every level declared
once in ladder order with its rung (RUNGS, the ladder, follows from it).

Each rung looks at one fault in context and answers: it does not apply (None), it would apply but
something blocks it (`Blocked`, with the reason), or it proposes itself (`Proposal`). Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Final

from relaunch.faults import (
    Cause,
    Fault,
    FaultKind,
    HandlingLevel,
)
from relaunch.policy.context import Answer, Blocked, Context, Proposal
from relaunch.policy.decision import Action, Budget, Level, PodChange, Streak
from relaunch.spec import RecoverStrategy

__all__ = ["IN_A_ROW_LIMIT", "LEVELS", "RUNGS", "Answer", "Blocked", "Context", "Proposal"]

IN_A_ROW_LIMIT = 3
"""Unconditional reschedules (R-21) and hang restarts (R-24) allowed in a row; the 4th fails."""

_IN_PLACE_LEVELS = (
    HandlingLevel.NOT_HANDLE_FAULT,
    HandlingLevel.RESTART_REQUEST,
    HandlingLevel.RESTART_BUSINESS,
)


# ---------------------------------------------------------------------------------------------
# Rungs. Each is a function of the context; RUNGS lists them in ladder order.
# ---------------------------------------------------------------------------------------------


def _ignore(c: Context) -> Answer:
    if not c.a.handled:
        return Proposal(c.a.reason)
    if c.fault.kind is FaultKind.SLOW:
        why = _slow_stays(c)
        return Proposal(f"{c.a.reason}: recorded only ({why})") if why else None
    if c.tried:
        return None  # already being recovered: a failed move may have emptied the node
    if c.node is not None and c.fault.pod is None and not c.cluster.pods_on(c.node):
        isolate = (c.node,) if c.node_must_go else ()
        return Proposal(f"{c.a.reason}, on a node this job does not use", isolate=isolate)
    return None


def _slow_stays(c: Context) -> str | None:
    """Why a slow pod is not moved (None: it is). It moves only where that costs no more than a
    pod-level move: a standby node, and pod-level rescheduling allowed (or process-level
    rescheduling, under process-level recovery); never by a job-level rebuild."""
    if c.tried:
        return "moving it did not work"
    process_move = c.settings.process_level and c.allows(RecoverStrategy.RECOVER)
    if not c.settings.pod_reschedule and not process_move:
        return "pod-level rescheduling is off for this job"
    if not c.cluster.standby_nodes:
        return "no standby node to move it to"
    if not process_move and c.touches_rank0:
        return "it holds rank 0, which pod-level rescheduling does not move (R-23)"
    if not process_move and c.left(Budget.POD) <= 0:
        return f"pod-retry-num spent ({c.settings.pod_retry_budget} used)"
    return None


def _process_gate(c: Context) -> Blocked | None:
    """Process-level recovery cannot run right now (R-37)."""
    if c.cluster.checkpoint_saving:
        return Blocked("a checkpoint is being saved (R-37)")
    if c.cluster.group_building:
        return Blocked("the communication group is being built (R-37)")
    return None


def _process_rung(
    strategy: RecoverStrategy,
) -> Callable[[Callable[[Context], Answer]], Callable[[Context], Answer]]:
    """Wraps a process-level rung: it applies only when the strategy is allowed and the gate open."""

    def wrap(body: Callable[[Context], Answer]) -> Callable[[Context], Answer]:
        def rung(c: Context) -> Answer:
            if not c.settings.process_level or not c.allows(strategy):
                return None
            if c.tried & {Action.DUMP, Action.EXIT}:
                return None  # process level already handed the fault over
            answer = body(c)
            if isinstance(answer, Proposal):
                return _process_gate(c) or answer
            return answer

        rung.__name__ = body.__name__
        return rung

    return wrap


def _operator_retry(c: Context) -> Answer:
    """R-29: a collective the SDK issued failed on its transport; with operator-level online
    recovery on (HCCL_OP_RETRY_ENABLE), the same collective is issued again once the links are
    back, in a group formed anew, nothing restarts and no step is recomputed. Only the SDK's
    collectives report such a fault: a script without them never reaches this rung."""
    if c.fault.kind is not FaultKind.COLLECTIVE:
        return None
    retry = c.settings.operator_retry
    if retry is None:
        return Blocked("operator-level online recovery is off (HCCL_OP_RETRY_ENABLE, R-29)")
    if not c.settings.process_level:
        return Blocked("operator-level online recovery needs process-level recovery (R-29)")
    # not gated by R-37: nothing is rolled back, and a rank still saving joins the re-issue
    # when it reaches the collective
    return Proposal(
        f"issue the failed collective again once the links are back, up to {retry.max_count} "
        f"time(s), {retry.hold_s:g} s after the failure then every {retry.interval_s:g} s; "
        "nothing restarts (R-29)",
        pods=tuple(p.index for p in c.cluster.pods),
    )


@_process_rung(RecoverStrategy.RETRY)
def _process_retry(c: Context) -> Answer:
    if c.fault.kind not in (FaultKind.MEMORY_UCE, FaultKind.NETWORK, FaultKind.COLLECTIVE):
        return None
    return Proposal(
        f"{c.fault.kind.value} fault: roll the step back and run it again on every rank (R-30)",
        pods=tuple(p.index for p in c.cluster.pods),
    )


@_process_rung(RecoverStrategy.RECOVER_IN_PLACE)
def _process_in_place(c: Context) -> Answer:
    eligible = c.fault.kind is FaultKind.PROCESS_EXIT or (
        c.a.row is not None and c.a.row.level in _IN_PLACE_LEVELS and not c.node_must_go
    )
    if not eligible or not c.pods:
        return None
    age = c.now - c.fault.at
    if age > c.rules.process_fault_max_age_s:
        return Blocked(
            f"the fault is {age:g} s old (> {c.rules.process_fault_max_age_s:g} s, R-31)"
        )
    if _rank0_pod_has_another_fault(c):
        return Blocked("the rank-0 pod has another fault (R-31)")
    for pod in c.pods:
        used = c.history.process_restarts(pod)
        if used >= c.settings.max_restarts:
            return Blocked(
                f"pod {pod} used its {c.settings.max_restarts} process restarts (max_restarts)"
            )
    return Proposal(
        "restart only the faulty processes, on the same node (R-31)",
        pods=c.pods,
        consumes=frozenset({Budget.PROCESS_RESTARTS}),
    )


def _rank0_pod_has_another_fault(c: Context) -> bool:
    rank0 = c.cluster.rank0_pod
    return rank0 is not None and rank0 in c.cluster.faulty_pods and rank0 not in c.pods


@_process_rung(RecoverStrategy.RECOVER)
def _process_reschedule(c: Context) -> Answer:
    """R-32, for a node that must go; and R-31's "the others migrate": a fault kept from
    restarting in place by the rank-0 rule moves its processes to a standby node instead (its
    node is not isolated: nothing says it is faulty)."""
    migrate = (
        Action.PROCESS_IN_PLACE not in c.tried
        and c.allows(RecoverStrategy.RECOVER_IN_PLACE)
        and _rank0_pod_has_another_fault(c)
    )
    if not (c.node_must_go or migrate) or not c.pods:
        return None
    if not c.cluster.standby_nodes:
        return Blocked("no standby node for the replacement processes (R-32)")
    if not c.node_must_go:
        return Proposal(
            "the rank-0 pod has another fault, so not in place: replacement processes on a "
            "standby node, healthy ranks keep running (R-31, R-32)",
            pods=c.pods,
            wait_s=c.settings.wait_reschedule_timeout_s,
        )
    assert c.node is not None
    return Proposal(
        f"isolate {c.node}; replacement processes on a standby node, healthy ranks keep running (R-32)",
        pods=c.pods,
        isolate=(c.node,),
        wait_s=c.settings.wait_reschedule_timeout_s,
    )


@_process_rung(RecoverStrategy.ELASTIC_TRAINING)
def _scale_in(c: Context) -> Answer:
    if not c.node_must_go or not c.pods or c.cluster.standby_nodes:
        return None
    if len(c.cluster.pods) - len(c.pods) < 1:
        return Blocked("scale-in needs more than one data-parallel replica (R-33)")
    if c.touches_rank0:
        return Blocked("scale-in cannot drop the pod holding rank 0 (R-33)")
    assert c.node is not None
    return Proposal(
        f"no standby node: isolate {c.node} and continue with "
        f"{len(c.cluster.pods) - len(c.pods)} of {len(c.cluster.pods)} replicas (R-33)",
        pods=c.pods,
        isolate=(c.node,),
    )


_NO_LIVE_PROCESSES = (FaultKind.HANG, FaultKind.CONTROLLER_OUTAGE)
"""Faults after which no healthy process can save or exit on request (dump / exit)."""


@_process_rung(RecoverStrategy.DUMP)
def _dump(c: Context) -> Answer:
    if c.fault.kind in _NO_LIVE_PROCESSES:
        return None
    return Proposal("healthy ranks save a dying-gasp checkpoint, then the next level runs (R-34)")


@_process_rung(RecoverStrategy.EXIT)
def _exit(c: Context) -> Answer:
    if c.fault.kind in _NO_LIVE_PROCESSES:
        return None
    return Proposal("training processes exit, then the next level runs (R-35)")


def _hang_restart(c: Context) -> Answer:
    if c.fault.kind is not FaultKind.HANG:
        return None
    if not c.settings.hang_retry:
        return Blocked("the job hung and fault-tolerance/hang-retry is off")
    streak = c.history.streaks.hang
    if streak >= IN_A_ROW_LIMIT:
        return Blocked(f"hung again after {streak} restarts upon suspension in a row (R-24)")
    return Proposal(
        "kill the processes, keep the containers, run the start command again (R-24)",
        pods=tuple(p.index for p in c.cluster.pods),
    )


def _in_place(c: Context) -> Answer:
    if c.a.cause is not Cause.ENVIRONMENT or not c.a.self_healable:
        return None
    if not c.settings.auto_restart:
        return Blocked("auto restart is off (set fault-tolerance/job-retry-num)")
    if c.a.escalated:
        return None  # the node or the job moves instead
    return Proposal(
        "stop every process, heal the chip, re-run the start command in every container (R-20)",
        pods=tuple(p.index for p in c.cluster.pods),
    )


def _pod_reschedule(c: Context) -> Answer:
    if not c.node_must_go or not c.settings.pod_reschedule:
        return None
    assert c.node is not None
    if c.left(Budget.POD) <= 0:
        return Blocked(f"pod-retry-num spent ({c.settings.pod_retry_budget} used)")
    if c.touches_rank0:
        return Blocked("the faulty pod holds rank 0: straight to job level (R-23)")
    moved = c.cluster.pods_on(c.node) or c.pods
    if len(c.cluster.standby_nodes) < len(moved):
        return Blocked(f"no standby node for {len(moved)} pod(s) (R-23)")
    return Proposal(
        f"isolate {c.node}; recreate pod(s) {', '.join(map(str, moved))} on standby nodes; "
        "healthy pods re-run the start command (R-23)",
        pods=moved,
        isolate=(c.node,),
        consumes=frozenset({Budget.POD}),
    )


def _isolated_job_reschedule(c: Context) -> Answer:
    if not c.node_must_go or Action.POD_RESCHEDULE in c.tried:
        return None
    if not c.settings.auto_restart:
        return Blocked("auto restart is off (set fault-tolerance/job-retry-num)")
    assert c.node is not None
    blocker = c.job_budget_blocker()
    if blocker:
        return blocker
    slots = c.cluster.rebuild_slots(without=c.node)
    if slots is not None and slots < len(c.cluster.pods):
        return Blocked(
            f"no room to rebuild the job without {c.node}: {slots} pod slot(s) left (R-22)",
            wants_nodes=True,
        )
    if slots is None and len(c.cluster.standby_nodes) < len(c.cluster.pods_on(c.node)):
        return Blocked(
            f"no healthy node to replace {c.node} (R-22 needs a standby node)", wants_nodes=True
        )
    return Proposal(
        f"isolate {c.node}; rebuild the whole job on healthy nodes (R-22)",
        pods=tuple(p.index for p in c.cluster.pods),
        isolate=(c.node,),
        consumes=frozenset({Budget.JOB}),
    )


def _job_reschedule(c: Context) -> Answer:
    everything = tuple(p.index for p in c.cluster.pods)
    if c.fault.kind is FaultKind.CONTROLLER_OUTAGE:
        return Proposal(
            "relaunch's controller was away longer than the adopt grace and the pods ended "
            "themselves: rebuild the job; relaunch's own outage spends no restart",
            pods=everything,
        )
    if Action.POD_RESCHEDULE in c.tried:
        if not c.settings.pod_may_fall_back_to_job:
            return Blocked(
                "pod-level rescheduling failed and recover_policy_path=pod forbids job level"
            )
        return c.job_budget_blocker() or Proposal(
            "pod-level rescheduling failed; the node is already isolated: rebuild the job (R-23)",
            pods=everything,
            consumes=frozenset({Budget.JOB}),
        )
    if c.user_degraded:
        if not c.settings.auto_restart:
            return Blocked("auto restart is off (set fault-tolerance/job-retry-num)")
        return c.job_budget_blocker() or Proposal(
            "user-induced fault code: rebuild the job without isolating the node (R-20, R-11)",
            pods=everything,
            consumes=frozenset({Budget.JOB}),
        )
    if c.a.cause is not Cause.SOFTWARE or c.fault.kind is FaultKind.HANG:
        return None
    s = c.settings
    if not s.unconditional:
        if s.auto_restart:
            return Blocked(
                "not an environment fault, and unconditional retry is off: auto restart only "
                "restarts for hardware, node and network faults (R-02)"
            )
        return Blocked("fault tolerance is off for this job")
    consumes = {Budget.JOB}
    if s.unconditional_retry:
        streak = c.history.streaks.unconditional
        if streak >= IN_A_ROW_LIMIT:
            return Blocked(_in_a_row_reason(c.fault, streak))
    if s.fault_retry_times > 0:
        if not s.unconditional_retry and c.cluster.all_pods_failed_at_start:
            return Blocked("every pod failed right after start: not retried (R-41)")
        if c.left(Budget.FAULT_RETRY) <= 0:
            return Blocked(f"fault-retry-times spent ({s.fault_retry_times} used, R-41)")
        consumes.add(Budget.FAULT_RETRY)
    return c.job_budget_blocker() or Proposal(
        "non-zero exit with no hardware fault: rebuild the whole job (R-21, R-41)",
        pods=everything,
        consumes=frozenset(consumes),
    )


def _in_a_row_reason(fault: Fault, streak: int) -> str:
    """R-21's end, naming what the failed rank's own error names: the user's code, or the part
    of the machine no restart frees (a full disk: not the user's code, though no node or chip
    fault was found)."""
    error = fault.error
    said = f": {error.summary()}" if error is not None else ""
    cause = error.environment_cause() if error is not None else None
    if cause is not None:
        return (
            f"failed again after {streak} unconditional reschedules in a row: {cause}{said}; "
            "free it, then run the job again (R-21)"
        )
    return (
        f"failed again after {streak} unconditional reschedules in a row with no node or chip "
        f"fault found: user code error (R-21){said}"
    )


_KEEP_PROCESSES: Final = Level(process_level=True)
_RESTART_ALL: Final = Level(
    new_attempt=True,
    recovering=True,
    decided_pods=PodChange.RESTARTED,
    other_pods=PodChange.RESTARTED,
)
_REBUILD_ALL: Final = Level(
    new_attempt=True,
    recovering=True,
    decided_pods=PodChange.RESCHEDULED,
    other_pods=PodChange.RESCHEDULED,
)

LEVELS: Final[Mapping[Action, Level]] = MappingProxyType(
    {
        Action.IGNORE: Level(final=True, rung=_ignore),
        Action.OPERATOR_RETRY: replace(_KEEP_PROCESSES, rung=_operator_retry),
        Action.PROCESS_RETRY: replace(_KEEP_PROCESSES, rung=_process_retry),
        Action.PROCESS_IN_PLACE: Level(
            process_level=True, restarts_a_process=True, rung=_process_in_place
        ),
        Action.PROCESS_RESCHEDULE: Level(
            process_level=True,
            recovering=True,
            decided_pods=PodChange.RESCHEDULED,
            rung=_process_reschedule,
        ),
        Action.SCALE_IN: Level(process_level=True, recovering=True, rung=_scale_in),
        Action.DUMP: Level(process_level=True, hands_over=True, rung=_dump),
        Action.EXIT: Level(process_level=True, hands_over=True, rung=_exit),
        Action.HANG_RESTART: replace(_RESTART_ALL, streak=Streak.HANG, rung=_hang_restart),
        Action.IN_PLACE: replace(_RESTART_ALL, rung=_in_place),
        Action.POD_RESCHEDULE: Level(
            new_attempt=True,
            recovering=True,
            decided_pods=PodChange.RESCHEDULED,
            other_pods=PodChange.RESTARTED,
            rung=_pod_reschedule,
        ),
        Action.ISOLATED_JOB_RESCHEDULE: replace(_REBUILD_ALL, rung=_isolated_job_reschedule),
        Action.JOB_RESCHEDULE: replace(
            _REBUILD_ALL, streak=Streak.UNCONDITIONAL, rung=_job_reschedule
        ),
        Action.FAIL: Level(final=True),
    }
)
"""Every level, declared once, in ladder order (finest first): what it is, what it changes to
the job's pods, the job's status while it runs, the run in a row it extends, and its rung (when
it applies). What follows from it: the ladder (`RUNGS`), each pod's counters (ladder), the
streaks (history), R-43's reschedule records (report), the controller's classes
(controller/actions.py, one per level, checked against it)."""

RUNGS: Final[tuple[tuple[Action, Callable[[Context], Answer]], ...]] = tuple(
    (action, level.rung) for action, level in LEVELS.items() if level.rung is not None
)
"""The ladder, in order. ``fail`` is what remains when no rung proposes itself."""
