"""Property tests: whatever faults arrive, in whatever order, and however recoveries turn out, the
policy never exceeds a budget, never isolates a node for a user-induced fault, and always decides."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relaunch.faults import Fault, FaultKind, Severity
from relaunch.policy import Action, Budget, ClusterView, Decision, JobHistory, PodView, decide, plan
from relaunch.spec import RecoverySettings
from tests import builders

CODES = ["80E18005", "80E01801", "80E3A201", "80C98002", "80CB8002", "81078603", "DEADBEEF"]
USER_CODES = {"80C98002", "80CB8002"}
MOSTLY_TRUE = st.sampled_from([True, True, True, False])
# Faults that spend budgets come more often, so that long runs reach the limits.
KIND_WEIGHTS = (
    [FaultKind.PROCESS_EXIT] * 3
    + [FaultKind.CHIP] * 3
    + [FaultKind.NODE_LOST] * 2
    + [
        FaultKind.HANG,
        FaultKind.NETWORK,
        FaultKind.MEMORY_UCE,
    ]
)

CONFIGS: list[RecoverySettings] = [
    builders.settings(),
    builders.settings(builders.AUTO),
    builders.settings(builders.MODELARTS_ALL),
    builders.settings(
        {
            "fault-tolerance/job-retry-num": "2",
            "fault-tolerance/job-unconditional-retry": "true",
            "fault-tolerance/pod-retry-num": "1",
        }
    ),
    builders.settings({}, {"fault-scheduling": "force", "fault-retry-times": "2"}, backoff_limit=4),
    builders.settings({}, {"fault-scheduling": "grace", "pod-rescheduling": "on"}),
    builders.process_settings(
        "retry,recover-in-place,recover,elastic-training,dump,exit", max_restarts=2
    ),
    builders.process_settings("recover-in-place,exit", max_restarts=1),
    builders.settings(
        {
            "fault-tolerance/job-retry-num": "3",
            "fault-tolerance/pod-retry-num": "2",
            "huawei.com/recover_policy_path": "pod",
            "recover-strategy": "elastic-training,dump",
        },
        {"fault-scheduling": "grace"},
    ),
]


@st.composite
def faults(draw: st.DrawFn, nodes: int) -> Fault:
    kind = draw(st.sampled_from(KIND_WEIGHTS))
    node = f"node-{draw(st.integers(0, nodes - 1))}"
    pod = draw(st.one_of(st.none(), st.integers(0, 1)))
    if kind is FaultKind.PROCESS_EXIT:
        return Fault(kind, 0.0, node=node, pod=pod, exit_code=draw(st.integers(1, 255)))
    if kind is FaultKind.CHIP:
        severity = draw(st.one_of(st.none(), st.sampled_from(list(Severity))))
        return Fault(
            kind,
            0.0,
            node=node,
            chip=draw(st.integers(0, 1)),
            code=draw(st.sampled_from(CODES)),
            reported_severity=severity,
        )
    if kind is FaultKind.NETWORK:
        return Fault(kind, 0.0, node=node, duration_s=draw(st.one_of(st.none(), st.floats(0, 100))))
    if kind is FaultKind.HANG:
        return Fault(kind, 0.0)
    return Fault(kind, 0.0, node=node, chip=0 if kind is FaultKind.MEMORY_UCE else None)


@st.composite
def scenarios(
    draw: st.DrawFn,
) -> tuple[RecoverySettings, ClusterView, list[tuple[Fault, float, list[bool]]], dict[str, bool]]:
    recovery = draw(st.sampled_from(CONFIGS))
    pods = draw(st.integers(1, 3))
    standby = draw(st.integers(0, 6))
    cluster = ClusterView(
        pods=tuple(PodView(i, f"node-{i}", holds_rank0=i == 0) for i in range(pods)),
        standby_nodes=tuple(f"node-{pods + i}" for i in range(standby)),
    )
    events = []
    now = 0.0
    for fault in draw(st.lists(faults(pods + standby), min_size=6, max_size=30)):
        now += draw(st.sampled_from([0.5, 5.0, 40.0, 3600.0, 90000.0]))
        outcomes = draw(st.lists(MOSTLY_TRUE, min_size=13, max_size=13))
        events.append(
            (replace(fault, at=now), now + draw(st.sampled_from([0.0, 10.0, 70.0])), outcomes)
        )
    facts = {
        "checkpoint_saving": not draw(MOSTLY_TRUE),
        "group_building": not draw(MOSTLY_TRUE),
        "all_pods_failed_at_start": not draw(MOSTLY_TRUE),
    }
    return recovery, cluster, events, facts


def _evolve(cluster: ClusterView, decision: Decision) -> ClusterView:
    """Isolation removes nodes from the standby pool; moved pods take standby nodes."""
    standby = [n for n in cluster.standby_nodes if n not in decision.isolate_nodes]
    pods = list(cluster.pods)
    if decision.action in (
        Action.POD_RESCHEDULE,
        Action.PROCESS_RESCHEDULE,
        Action.ISOLATED_JOB_RESCHEDULE,
    ):
        for i, pod in enumerate(pods):
            if pod.node in decision.isolate_nodes and standby:
                pods[i] = replace(pod, node=standby.pop(0))
    return replace(cluster, pods=tuple(pods), standby_nodes=tuple(standby))


def _check_budgets(recovery: RecoverySettings, history: JobHistory) -> None:
    assert history.used(Budget.JOB) <= recovery.job_retry_budget
    assert history.used(Budget.POD) <= recovery.pod_retry_budget
    assert history.used(Budget.FAULT_RETRY) <= recovery.fault_retry_times
    for pod in range(history.pods):
        assert history.process_restarts(pod) <= recovery.max_restarts


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(scenarios())
def test_no_fault_sequence_exceeds_a_budget_isolates_for_user_faults_or_goes_undecided(
    scenario: tuple[
        RecoverySettings, ClusterView, list[tuple[Fault, float, list[bool]]], dict[str, bool]
    ],
) -> None:
    recovery, cluster, events, facts = scenario
    cluster = replace(cluster, **facts)
    history = JobHistory(pods=len(cluster.pods))
    for fault, now, outcomes in events:
        tried: frozenset[Action] = frozenset()
        history = history.with_fault(fault)
        earlier = replace(history, faults=history.faults[:-1])
        for ok in outcomes:
            decision = decide(recovery, fault, earlier, cluster, now, tried=tried)
            assert isinstance(decision, Decision) and decision.action in Action
            assert decision.reason
            assessment = decision.assessment
            if assessment.user_induced or (
                fault.code in USER_CODES and fault.kind is FaultKind.CHIP
            ):
                assert decision.isolate_nodes == ()
            if decision.action.final:
                assert decision.consumes == frozenset() and decision.fallback is None
            else:
                assert decision.fallback is not None
            history = history.with_decision(decision, now)
            earlier = replace(earlier, records=history.records, counters=history.counters)
            _check_budgets(recovery, history)
            if decision.action.final:
                break
            history = history.with_outcome(ok or decision.action.hands_over)
            earlier = replace(earlier, records=history.records)
            cluster = _evolve(cluster, decision)
            if ok and not decision.action.hands_over:
                break
            tried |= {decision.action}
        # A real job ends at `fail`; the policy is fed the rest anyway, since its limits must
        # hold whatever it is asked.
        _check_budgets(recovery, history)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.sampled_from(CONFIGS), faults(4), st.integers(1, 3), st.integers(0, 2))
def test_every_ladder_ends_in_a_final_action_without_repeating_a_step(
    recovery: RecoverySettings, fault: Fault, pods: int, standby: int
) -> None:
    cluster = builders.cluster(pods=pods, standby=standby)
    steps = plan(recovery, fault, JobHistory(pods=pods), cluster, 0.0)
    actions = [s.action for s in steps]
    assert actions[-1].final and not any(a.final for a in actions[:-1])
    assert len(set(actions)) == len(actions)
    for step, following in pairwise(steps):
        assert step.fallback is following.action
