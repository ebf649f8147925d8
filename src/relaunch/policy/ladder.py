"""The recovery ladder: given a fault and a job's past, which recovery runs next, and at what cost.

The ladder is a list of rungs, finest first. Each rung looks at the fault in context and answers in
one of three ways: it does not apply to this fault (None), it would apply but something blocks it
(a :class:`Blocked` with the reason, e.g. a spent budget), or it proposes itself (a
:class:`Proposal`). :func:`decide` takes the first proposal; the reasons of blocked rungs explain a
``fail``. Actions that already failed for this fault are passed in ``tried`` and skipped, which is
how every degradation of docs/recovery-rules.md falls out of one ordering:

    ignore
    operator-retry                                                            (R-29)
    process-retry > process-in-place > process-reschedule > scale-in > dump > exit   (R-36)
    hang-restart | in-place                                                   (R-24, R-20)
    pod-reschedule                                                            (R-23)
    isolated-job-reschedule | job-reschedule                                  (R-22, R-21)
    fail                                                                      (R-26)

Pure: no I/O, no clock (``now`` is an argument), no engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from relaunch.faults import DEFAULT_TABLE, EscalationRules, Fault, FaultCodeTable, assess
from relaunch.policy.cluster_view import ClusterView
from relaunch.policy.decision import Action, Budget, BudgetsLeft, Counters, Decision, PodChange
from relaunch.policy.history import JobHistory
from relaunch.policy.placement import move
from relaunch.policy.rungs import RUNGS, Blocked, Context, Proposal
from relaunch.spec import RecoverySettings

__all__ = ["RUNGS", "Blocked", "Proposal", "decide", "plan"]


def decide(
    settings: RecoverySettings,
    fault: Fault,
    history: JobHistory,
    cluster: ClusterView,
    now: float,
    *,
    table: FaultCodeTable = DEFAULT_TABLE,
    rules: EscalationRules | None = None,
    tried: frozenset[Action] = frozenset(),
) -> Decision:
    """The next recovery for `fault`.

    `history` holds the job's earlier faults and recoveries (not this fault); `tried` the actions
    already attempted for this fault that failed, or that handed over (dump, exit). Always returns
    a decision; ``fail`` carries the reason the job cannot go on.
    """
    rules = rules or EscalationRules()
    assessment = assess(fault, history.faults, table, rules)
    context = Context(
        settings=settings,
        a=assessment,
        history=history,
        cluster=cluster,
        now=now,
        rules=rules,
        tried=tried,
        pods=cluster.affected_pods(fault.node, fault.pod),
    )
    action, proposal, blocked = _climb(context)
    fallback = None
    if not action.final:
        later = replace(context, tried=tried | {action})
        fallback = _climb(later)[0]
    return _decision(context, action, proposal, blocked, fallback)


def _climb(c: Context) -> tuple[Action, Proposal | None, Sequence[Blocked]]:
    blocked: list[Blocked] = []
    for action, rung in RUNGS:
        if action in c.tried:
            continue
        answer = rung(c)
        if isinstance(answer, Proposal):
            return action, answer, blocked
        if isinstance(answer, Blocked):
            blocked.append(answer)
    return Action.FAIL, None, blocked


def _decision(
    c: Context,
    action: Action,
    proposal: Proposal | None,
    blocked: Sequence[Blocked],
    fallback: Action | None,
) -> Decision:
    if proposal is None:
        reasons = [b.reason for b in blocked] or ["no recovery is enabled for this fault"]
        if c.tried:
            tried = ", ".join(sorted(a.value for a in c.tried))
            reasons.insert(0, f"{tried} did not recover it")
        return Decision(
            action=Action.FAIL,
            reason=f"{c.fault.describe()}: " + "; ".join(reasons),
            assessment=c.a,
            counters=c.history.counters,
            budgets_left=_budgets_left(c, frozenset()),
            streaks=c.history.streaks,
            wants_nodes=any(b.wants_nodes for b in blocked),
        )
    counters = _counters_after(action, c.history.counters, proposal.pods)
    decision = Decision(
        action=action,
        reason=proposal.reason,
        assessment=c.a,
        isolate_nodes=proposal.isolate,
        pods=proposal.pods,
        targets=_targets(action, c.cluster, proposal.pods, proposal.isolate),
        consumes=proposal.consumes,
        counters=counters,
        budgets_left=_budgets_left(c, proposal.consumes),
        wait_s=proposal.wait_s,
        fallback=fallback,
        passed_over=tuple(b.reason for b in blocked),
    )
    return replace(decision, streaks=c.history.streaks_with(decision))


def _budgets_left(c: Context, consumes: frozenset[Budget]) -> BudgetsLeft:
    def left(budget: Budget) -> int:
        return max(0, c.left(budget) - (1 if budget in consumes else 0))

    return BudgetsLeft(
        job=left(Budget.JOB), pod=left(Budget.POD), fault_retry=left(Budget.FAULT_RETRY)
    )


def _targets(
    action: Action, cluster: ClusterView, pods: tuple[int, ...], isolating: tuple[str, ...]
) -> tuple[tuple[int, str], ...]:
    """Where the pods the level rebuilds go: to standby nodes when some pods stay, anywhere
    schedulable but the isolated nodes when every pod is rebuilt (policy.placement.move)."""
    level = action.level
    decided = frozenset(pods)  # a set: a job-level decision names every pod
    rebuilt = [
        p.index
        for p in cluster.pods
        if level.change_of(p.index in decided) is PodChange.RESCHEDULED
    ]
    if not rebuilt or not cluster.nodes:
        return ()
    now = {p.index: p.node for p in cluster.pods}
    places = move(cluster.nodes, now, rebuilt, isolating, cluster.chips_per_pod)
    return tuple(sorted(places.items()))


def _counters_after(
    action: Action, counters: tuple[Counters, ...], pods: tuple[int, ...]
) -> tuple[Counters, ...]:
    """R-04 / R-05: each pod's counters after what the level does to its container (LEVELS)."""
    level = action.level
    decided = frozenset(pods)
    return tuple(level.change_of(i in decided).counted(c) for i, c in enumerate(counters))


def plan(
    settings: RecoverySettings,
    fault: Fault,
    history: JobHistory,
    cluster: ClusterView,
    now: float,
    *,
    table: FaultCodeTable = DEFAULT_TABLE,
    rules: EscalationRules | None = None,
) -> tuple[Decision, ...]:
    """The whole way down the ladder for `fault`: the first decision, then what follows if each
    step fails (or hands over), ending in a final action. Used to show a job's ladder."""
    steps: list[Decision] = []
    tried: frozenset[Action] = frozenset()
    while True:
        step = decide(settings, fault, history, cluster, now, table=table, rules=rules, tried=tried)
        steps.append(step)
        if step.action.final:
            return tuple(steps)
        tried |= {step.action}
