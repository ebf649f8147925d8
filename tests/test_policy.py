"""The recovery ladder, rule by rule: the rules of docs/recovery-rules.md, each test named after its rule.

Each test drives `decide` (or `plan`, the whole way down) through one transition of the ladder.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from relaunch.faults import ErrorReport, EscalationRules, Fault, FaultKind
from relaunch.policy import (
    Action,
    Budget,
    ClusterView,
    Counters,
    Decision,
    JobHistory,
    PodView,
    decide,
    plan,
)
from relaunch.spec import RecoverySettings
from tests.builders import (
    AUTO,
    CRITICAL,
    MAJOR,
    MINOR,
    MODELARTS_ALL,
    USER,
    WARNING,
    chip,
    cluster,
    crash,
    hang,
    history,
    network,
    node_lost,
    process_settings,
    settings,
    uce,
)

UNCONDITIONAL = {**AUTO, "fault-tolerance/job-unconditional-retry": "true"}
HANG = {**AUTO, "fault-tolerance/hang-retry": "true"}


def actions(
    s: RecoverySettings, fault: Fault, c: ClusterView | None = None, h: JobHistory | None = None
) -> list[str]:
    """The ladder for one fault: each action, then what runs if it fails."""
    c = c or cluster()
    return [d.action.value for d in plan(s, fault, h or history(len(c.pods)), c, fault.at)]


def first(
    s: RecoverySettings,
    fault: Fault,
    c: ClusterView | None = None,
    h: JobHistory | None = None,
    **kw: object,
) -> Decision:
    c = c or cluster()
    return decide(s, fault, h or history(len(c.pods)), c, fault.at, **kw)  # type: ignore[arg-type]


def carry_out(h: JobHistory, d: Decision, ok: bool = True) -> JobHistory:
    """What the controller does: record the fault and the decision, then settle the outcome."""
    h = h.with_fault(d.assessment.fault).with_decision(d, d.assessment.fault.at)
    return h if d.action.final else h.with_outcome(ok)


# -- R-02 ---------------------------------------------------------------------------------------


def test_r02_auto_restart_without_unconditional_retry_fails_software_faults() -> None:
    d = first(settings(AUTO), crash())
    assert d.action is Action.FAIL and "R-02" in d.reason


def test_r02_auto_restart_without_unconditional_retry_still_handles_environment_faults() -> None:
    assert first(settings(AUTO), node_lost()).action is Action.ISOLATED_JOB_RESCHEDULE


def test_r02_no_fault_tolerance_fails_every_handled_fault() -> None:
    for fault in (crash(), node_lost(), chip(MAJOR), hang()):
        assert first(settings(), fault).action is Action.FAIL


# -- counters ------------------------------------------------------------------------


def test_r04_r05_new_job_counters_start_at_1() -> None:
    assert history(3).counters == (Counters(1, 1),) * 3


def test_r04_r05_job_rescheduling_counts_a_schedule_for_every_pod_and_resets_starts() -> None:
    h = replace(history(), counters=(Counters(1, 3), Counters(2, 2)))
    d = first(settings(UNCONDITIONAL), crash(), h=h)
    assert d.action is Action.JOB_RESCHEDULE
    assert d.counters == (Counters(2, 1), Counters(3, 1))


def test_r04_r05_pod_rescheduling_counts_a_schedule_only_for_recreated_pods() -> None:
    d = first(settings(MODELARTS_ALL), node_lost("node-1"))
    assert d.action is Action.POD_RESCHEDULE
    assert d.counters == (Counters(1, 2), Counters(2, 1))  # healthy pod 0 re-runs its command


def test_r05_in_place_recovery_and_hang_restart_count_a_start_in_every_container() -> None:
    assert first(settings(AUTO), chip(MAJOR)).counters == (Counters(1, 2), Counters(1, 2))
    assert first(settings(HANG), hang()).counters == (Counters(1, 2), Counters(1, 2))


def test_r05_process_level_recovery_does_not_rerun_the_start_command() -> None:
    d = first(process_settings("recover-in-place"), crash())
    assert d.action is Action.PROCESS_IN_PLACE and d.counters == (Counters(), Counters())


def test_r04_counters_accumulate_across_recoveries() -> None:
    s, c, h = settings(MODELARTS_ALL), cluster(standby=2), history()
    for fault in (chip(MAJOR, at=0.0), node_lost("node-1", at=100.0), crash(at=200.0)):
        h = carry_out(h, decide(s, fault, h, c, fault.at))
    # in-place (+1 start), pod reschedule (pod 1 moved, pod 0 +1 start), job reschedule (all)
    assert h.counters == (Counters(2, 1), Counters(3, 1))


# -- R-20 in-place recovery ---------------------------------------------------------------------------


@pytest.mark.parametrize("code", [MINOR, MAJOR])
def test_r20_self_healable_chip_fault_recovers_in_place_without_consuming_restarts(
    code: str,
) -> None:
    d = first(settings(AUTO), chip(code))
    assert d.action is Action.IN_PLACE
    assert d.consumes == frozenset() and not d.isolate_nodes
    assert d.pods == (0, 1)
    assert d.budgets_left is not None and d.budgets_left.job == 8


def test_r20_self_healing_fails_isolate_and_degrade_to_isolated_job_rescheduling() -> None:
    steps = plan(settings(AUTO), chip(MAJOR), history(), cluster(), 0.0)
    assert [s.action for s in steps] == [
        Action.IN_PLACE,
        Action.ISOLATED_JOB_RESCHEDULE,
        Action.FAIL,
    ]
    assert steps[1].isolate_nodes == ("node-1",)


def test_r20_self_healing_fails_with_pod_rescheduling_on_moves_only_the_pod() -> None:
    assert actions(settings(MODELARTS_ALL), chip(MAJOR)) == [
        "in-place",
        "pod-reschedule",
        "job-reschedule",
        "fail",
    ]


def test_r20_escalation_isolates_and_degrades_to_isolated_job_rescheduling() -> None:
    s, c, h = settings(AUTO), cluster(), history()
    for at in (0.0, 100.0):
        h = carry_out(h, decide(s, chip(MAJOR, at=at), h, c, at))
    d = decide(s, chip(MAJOR, at=200.0), h, c, 200.0)
    assert d.action is Action.ISOLATED_JOB_RESCHEDULE and d.isolate_nodes == ("node-1",)
    assert d.assessment.escalated


def test_r20_escalation_of_a_user_induced_code_reschedules_without_isolation() -> None:
    s, c, h = settings(AUTO), cluster(), history()
    for at in (0.0, 100.0):
        d = decide(s, chip(USER, at=at), h, c, at)
        assert d.action is Action.IN_PLACE
        h = carry_out(h, d)
    d = decide(s, chip(USER, at=200.0), h, c, 200.0)
    assert d.action is Action.JOB_RESCHEDULE
    assert d.isolate_nodes == () and Budget.JOB in d.consumes


def test_r20_user_induced_code_that_fails_to_heal_is_not_isolated_either() -> None:
    steps = plan(settings(AUTO), chip(USER), history(), cluster(), 0.0)
    assert [s.action for s in steps] == [Action.IN_PLACE, Action.JOB_RESCHEDULE, Action.FAIL]
    assert all(not s.isolate_nodes for s in steps)


def test_r20_needs_auto_restart() -> None:
    d = first(settings(), chip(MAJOR))
    assert d.action is Action.FAIL and "auto restart is off" in d.reason


# -- R-21 unconditional job-level rescheduling ------------------------------------------------------------


def test_r21_non_zero_exit_reschedules_the_whole_job_and_consumes_a_restart() -> None:
    d = first(settings(UNCONDITIONAL), crash())
    assert d.action is Action.JOB_RESCHEDULE
    assert d.consumes == frozenset({Budget.JOB}) and d.pods == (0, 1) and not d.isolate_nodes
    assert d.budgets_left is not None and d.budgets_left.job == 7


def test_r21_signal_exit_is_a_non_zero_exit() -> None:
    fault = Fault(FaultKind.PROCESS_EXIT, 0.0, pod=1, signal=9)
    assert first(settings(UNCONDITIONAL), fault).action is Action.JOB_RESCHEDULE


def test_r21_three_in_a_row_allowed_the_fourth_fails_as_user_code_error() -> None:
    s, c, h = settings(UNCONDITIONAL), cluster(), history()
    for i in range(3):
        d = decide(s, crash(at=float(i)), h, c, float(i))
        assert d.action is Action.JOB_RESCHEDULE
        assert d.streaks.unconditional == i + 1
        h = carry_out(h, d)
    d = decide(s, crash(at=10.0), h, c, 10.0)
    assert d.action is Action.FAIL and "user code error" in d.reason and "R-21" in d.reason


def test_r21_a_hardware_recovery_in_between_breaks_the_streak() -> None:
    s, c, h = settings(UNCONDITIONAL), cluster(standby=2), history()
    for i, fault in enumerate([crash(), crash(), node_lost("node-1"), crash(), crash()]):
        fault = replace(fault, at=float(i))
        d = decide(s, fault, h, c, fault.at)
        assert d.action is not Action.FAIL
        h = carry_out(h, d)
    assert h.streaks.unconditional == 2


def _fell_through(
    s: RecoverySettings, fault: Fault, h: JobHistory, c: ClusterView
) -> tuple[JobHistory, Decision]:
    """The controller's way with one fault: each level that does not work fails (hand-overs run
    at once), down to a job-level restart (left running) or the job's end."""
    h, tried = h.with_fault(fault), frozenset[Action]()
    while True:
        d = decide(s, fault, h, c, fault.at, tried=tried)
        h = h.with_decision(d, fault.at)
        if d.action.final or d.action.rebuilds_all_pods:
            return h, d
        if not d.action.hands_over:
            h = h.with_outcome(False)
        tried |= {d.action}


@pytest.mark.parametrize(
    "strategies",
    [
        "retry,recover-in-place,recover,dump,exit",
        "retry,recover-in-place,recover,elastic-training,dump,exit",
        "recover-in-place,exit",
    ],
)
def test_r21_a_faults_failed_process_level_levels_and_its_dump_do_not_break_the_streak(
    strategies: str,
) -> None:
    """Each crash first tries process-in-place (which fails), then dump or exit, then a job
    reschedule: a fault is one fault however many levels it fell through, so the fourth crash
    fails as a user code error. Before: the fault's own failed restart in place and its dump
    ended the run, which never passed 1, and the job spent its whole budget (R-26)."""
    s, c, h = process_settings(strategies), cluster(), history()
    for i in range(3):
        h, d = _fell_through(s, crash(at=float(i)), h, c)
        assert d.action is Action.JOB_RESCHEDULE
        assert h.streaks.unconditional == i + 1
    h, d = _fell_through(s, crash(at=10.0), h, c)
    assert d.action is Action.FAIL and "user code error (R-21)" in d.reason


def test_r21_a_process_level_recovery_that_worked_breaks_the_streak() -> None:
    """A crash recovered in place (progress past it) is progress: the run starts again."""
    s, c, h = process_settings("retry,recover-in-place,dump,exit"), cluster(), history()
    for i in range(2):
        h, _ = _fell_through(s, crash(at=float(i)), h, c)
    worked = decide(s, crash(at=5.0), h.with_fault(crash(at=5.0)), c, 5.0)
    assert worked.action is Action.PROCESS_IN_PLACE
    h = carry_out(h, worked, ok=True)
    assert h.streaks.unconditional == 0


def _four_in_a_row(fault: Fault) -> Decision:
    s, c, h = settings(UNCONDITIONAL), cluster(), history()
    for i in range(3):
        h = carry_out(h, decide(s, replace(fault, at=float(i)), h, c, float(i)))
    return decide(s, replace(fault, at=10.0), h, c, 10.0)


def test_r21_the_final_reason_names_the_root_causes_error() -> None:
    """The fourth failure's reason says what the failed rank's own error says."""
    error = ErrorReport("KeyError", "'lr'", "Traceback ...", 0.0, "error-file")
    d = _four_in_a_row(replace(crash(), error=error))
    assert d.action is Action.FAIL
    assert d.reason.endswith("user code error (R-21): KeyError: 'lr'"), d.reason


@pytest.mark.parametrize(
    ("message", "cause"),
    [
        ("[Errno 28] No space left on device: '/ckpt/step-40'", "the disk is full"),
        ("[Errno 122] Disk quota exceeded", "the disk quota is spent"),
    ],
)
def test_r21_a_full_disk_is_named_as_the_cause_not_the_users_code(message: str, cause: str) -> None:
    """A checkpoint disk that stayed full failed every start: the job still ends at the fourth
    (no restart frees a disk), but its reason names the disk. Before: "user code error (R-21)",
    the ENOSPC shown only below it as the root cause."""
    error = ErrorReport("OSError", message, "Traceback ...", 0.0, "output")
    d = _four_in_a_row(replace(crash(), error=error))
    assert d.action is Action.FAIL
    assert cause in d.reason and message in d.reason and "R-21" in d.reason
    assert "user code error" not in d.reason


def test_r21_failed_pod_rescheduling_degrades_to_job_rescheduling() -> None:
    steps = plan(settings(MODELARTS_ALL), node_lost(), history(), cluster(), 0.0)
    assert [s.action for s in steps] == [Action.POD_RESCHEDULE, Action.JOB_RESCHEDULE, Action.FAIL]
    assert steps[0].isolate_nodes == ("node-1",)
    assert steps[1].isolate_nodes == ()  # already isolated by the pod-level attempt
    assert steps[0].fallback is Action.JOB_RESCHEDULE


# -- R-22 isolated job-level rescheduling ------------------------------------------------------------


@pytest.mark.parametrize("fault", [node_lost(), chip(CRITICAL)], ids=["node-lost", "critical-chip"])
def test_r22_node_fault_or_critical_chip_isolates_and_rebuilds_the_job(fault: Fault) -> None:
    d = first(settings(AUTO), fault)
    assert d.action is Action.ISOLATED_JOB_RESCHEDULE
    assert d.isolate_nodes == ("node-1",) and d.consumes == frozenset({Budget.JOB})
    assert d.counters == (Counters(2, 1), Counters(2, 1))


def test_r22_needs_a_standby_node() -> None:
    d = first(settings(AUTO), node_lost(), cluster(standby=0))
    assert d.action is Action.FAIL and "no healthy node" in d.reason


def test_r44_a_fail_for_want_of_nodes_says_so_and_one_for_a_spent_budget_does_not() -> None:
    wanting = first(settings(AUTO), node_lost(), cluster(standby=0))
    assert wanting.action is Action.FAIL and wanting.wants_nodes
    spent = settings({**AUTO, "fault-tolerance/job-retry-num": "1"})
    earlier = first(spent, node_lost("node-0"), cluster(standby=1))
    used = carry_out(history(2), earlier)
    d = first(spent, node_lost(at=10.0), cluster(standby=0), used)
    assert d.action is Action.FAIL and not d.wants_nodes, d.reason
    assert "budget spent" in d.reason
    software = first(settings(AUTO), crash())
    assert software.action is Action.FAIL and not software.wants_nodes


def test_r22_fault_on_a_node_the_job_does_not_use_isolates_it_without_recovery() -> None:
    d = first(settings(AUTO), node_lost("node-2"))
    assert d.action is Action.IGNORE and d.isolate_nodes == ("node-2",)


# -- R-23 pod-level rescheduling -------------------------------------------------------------------


def test_r23_node_fault_recreates_only_its_pods_and_consumes_pod_retry_num() -> None:
    d = first(settings(MODELARTS_ALL), node_lost())
    assert d.action is Action.POD_RESCHEDULE
    assert d.pods == (1,) and d.isolate_nodes == ("node-1",)
    assert d.consumes == frozenset({Budget.POD})
    assert d.budgets_left is not None and (d.budgets_left.pod, d.budgets_left.job) == (2, 8)


def test_r23_no_standby_node_degrades_to_job_level() -> None:
    d = first(settings(MODELARTS_ALL), node_lost(), cluster(standby=0))
    assert d.action is Action.FAIL  # job level needs a healthy node too
    assert "no standby node" in d.reason


def test_r23_rank0_pod_goes_straight_to_job_level() -> None:
    d = first(settings(MODELARTS_ALL), node_lost("node-0"))
    assert d.action is Action.ISOLATED_JOB_RESCHEDULE
    assert d.isolate_nodes == ("node-0",)


def test_r23_spent_pod_budget_degrades_to_isolated_job_level() -> None:
    s, c, h = settings(MODELARTS_ALL), cluster(pods=4, standby=8), history(4)
    for i in range(3):
        fault = node_lost(f"node-{i + 1}", at=float(i))
        d = decide(s, fault, h, c, fault.at)
        assert d.action is Action.POD_RESCHEDULE
        h = carry_out(h, d)
    d = decide(s, node_lost("node-3", at=9.0), h, c, 9.0)
    assert d.action is Action.ISOLATED_JOB_RESCHEDULE


def test_r23_recover_policy_path_pod_forbids_the_step_down() -> None:
    s = settings({**MODELARTS_ALL, "huawei.com/recover_policy_path": "pod"})
    steps = plan(s, node_lost(), history(), cluster(), 0.0)
    assert [x.action for x in steps] == [Action.POD_RESCHEDULE, Action.FAIL]
    assert "recover_policy_path=pod" in steps[-1].reason


def test_r23_mindcluster_pod_rescheduling_label() -> None:
    s = settings({}, {"fault-scheduling": "grace", "pod-rescheduling": "on"})
    assert first(s, node_lost()).action is Action.POD_RESCHEDULE


# -- R-24 restart upon suspension ------------------------------------------------------------------


def test_r24_hang_restarts_in_place_without_consuming_restarts() -> None:
    d = first(settings(HANG), hang())
    assert d.action is Action.HANG_RESTART and d.consumes == frozenset() and d.pods == (0, 1)


def test_r24_three_hang_restarts_in_a_row_then_failed() -> None:
    s, c, h = settings(HANG), cluster(), history()
    for i in range(3):
        d = decide(s, hang(at=float(i)), h, c, float(i))
        assert d.action is Action.HANG_RESTART and d.streaks.hang == i + 1
        h = carry_out(h, d)
    d = decide(s, hang(at=9.0), h, c, 9.0)
    assert d.action is Action.FAIL and "R-24" in d.reason


def test_r24_another_recovery_in_between_resets_the_hang_streak() -> None:
    s, c, h = settings(HANG), cluster(), history()
    for i, fault in enumerate([hang(), hang(), chip(MAJOR), hang(), hang()]):
        d = decide(s, replace(fault, at=float(i * 100)), h, c, float(i * 100))
        assert d.action is not Action.FAIL
        h = carry_out(h, d)


def test_r24_hang_without_hang_retry_fails_with_the_reason() -> None:
    d = first(settings(UNCONDITIONAL), hang())
    assert d.action is Action.FAIL and "hang-retry is off" in d.reason


def test_r25_hang_window_reaches_the_policy_from_the_spec() -> None:
    # Detection itself is the hang detector's; the policy side is the window it is given.
    assert settings(HANG, hang_detect_seconds=3).hang_detect_s == 3


# -- R-26 budgets ----------------------------------------------------------------------------------------


def test_r26_job_fails_with_the_reason_when_the_restart_budget_is_spent() -> None:
    s = settings(
        {"fault-tolerance/job-retry-num": "2", "fault-tolerance/job-unconditional-retry": "true"}
    )
    c, h = cluster(standby=4), history()
    for i, fault in enumerate([node_lost("node-1"), crash()]):
        d = decide(s, replace(fault, at=float(i)), h, c, float(i))
        assert Budget.JOB in d.consumes
        h = carry_out(h, d)
    d = decide(s, crash(at=5.0), h, c, 5.0)
    assert d.action is Action.FAIL
    assert "restart budget spent: 2 of 2" in d.reason and "R-26" in d.reason


def test_r26_failed_attempts_consume_the_budget_too() -> None:
    s, c, h = settings({"fault-tolerance/job-retry-num": "1"}), cluster(standby=3), history()
    d = decide(s, node_lost(), h, c, 0.0)
    h = carry_out(h, d, ok=False)
    assert h.used(Budget.JOB) == 1
    assert decide(s, node_lost("node-0", at=1.0), h, c, 1.0).action is Action.FAIL


# -- records -------------------------------------------------------------------------------


def test_r27_every_decision_is_recorded_with_fault_action_isolation_and_outcome() -> None:
    d = first(settings(AUTO), chip(CRITICAL, at=5.0))
    h = history().with_fault(d.assessment.fault).with_decision(d, at=6.0)
    record = h.records[-1]
    assert (record.at, record.fault.code, record.action, record.isolated) == (
        6.0,
        CRITICAL,
        Action.ISOLATED_JOB_RESCHEDULE,
        ("node-1",),
    )
    assert record.succeeded is None
    assert h.with_outcome(True).records[-1].succeeded is True


# -- R-30 .. R-37 process level ---------------------------------------------------------------------


@pytest.mark.parametrize("fault", [uce(), network()], ids=["uce", "network"])
def test_r30_retry_handles_memory_uce_and_network_faults_without_restarts(fault: Fault) -> None:
    d = first(process_settings("retry"), fault)
    assert d.action is Action.PROCESS_RETRY and d.counters == (Counters(), Counters())


def test_r30_retry_does_not_handle_a_crash() -> None:
    assert first(process_settings("retry"), crash()).action is Action.JOB_RESCHEDULE


def test_r31_recover_in_place_restarts_only_the_faulty_process() -> None:
    d = first(process_settings("recover-in-place"), crash(pod=1))
    assert d.action is Action.PROCESS_IN_PLACE and d.pods == (1,) and not d.isolate_nodes


@pytest.mark.parametrize("code", [USER, MINOR])  # RestartRequest, RestartBusiness
def test_r31_recover_in_place_takes_restart_request_and_business_levels(code: str) -> None:
    assert first(process_settings("recover-in-place"), chip(code)).action is Action.PROCESS_IN_PLACE


def test_r31_recover_in_place_does_not_take_chip_reset_or_isolation_levels() -> None:
    assert first(process_settings("recover-in-place"), chip(MAJOR)).action is Action.IN_PLACE
    d = first(process_settings("recover-in-place"), chip(CRITICAL))
    assert d.action is Action.POD_RESCHEDULE


def test_r31_faults_older_than_60s_are_not_recovered_in_place() -> None:
    s, fault = process_settings("recover-in-place"), crash(at=0.0)
    assert decide(s, fault, history(), cluster(), 60.0).action is Action.PROCESS_IN_PLACE
    d = decide(s, fault, history(), cluster(), 61.0)
    assert d.action is Action.JOB_RESCHEDULE


def test_r31_not_when_the_rank0_pod_has_another_fault() -> None:
    c = cluster(faulty_pods=frozenset({0, 1}))
    assert (
        first(process_settings("recover-in-place"), crash(pod=1), c).action is Action.JOB_RESCHEDULE
    )
    # The rank-0 pod's own fault may still be restarted in place.
    assert (
        first(process_settings("recover-in-place"), crash(pod=0), c).action
        is Action.PROCESS_IN_PLACE
    )


def test_r31_bounded_by_max_restarts_per_container() -> None:
    s, c, h = process_settings("recover-in-place", max_restarts=2), cluster(), history()
    for i in range(2):
        d = decide(s, crash(at=float(i)), h, c, float(i))
        assert d.action is Action.PROCESS_IN_PLACE
        h = carry_out(h, d)
    d = decide(s, crash(at=5.0), h, c, 5.0)
    assert d.action is Action.JOB_RESCHEDULE
    h = carry_out(h, d)  # the rebuilt container starts a new count
    assert decide(s, crash(at=9.0), h, c, 9.0).action is Action.PROCESS_IN_PLACE


def test_r32_recover_isolates_the_node_and_moves_the_processes_to_a_standby_node() -> None:
    d = first(process_settings("recover"), node_lost())
    assert d.action is Action.PROCESS_RESCHEDULE
    assert d.isolate_nodes == ("node-1",) and d.pods == (1,) and d.wait_s == 270
    assert d.counters == (Counters(1, 1), Counters(2, 1))


def test_r32_wait_reschedule_timeout_bounds_the_wait() -> None:
    s = process_settings("recover")
    s2 = replace(s, wait_reschedule_timeout_s=30.0)
    assert first(s2, node_lost()).wait_s == 30


def test_r32_without_a_standby_node_recover_is_blocked() -> None:
    d = first(process_settings("recover"), node_lost(), cluster(standby=0))
    assert d.action is Action.FAIL and "R-32" in d.reason


def test_r33_elastic_training_scales_in_when_no_standby_node() -> None:
    d = first(
        process_settings("recover,elastic-training"),
        node_lost("node-2"),
        cluster(pods=4, standby=0),
    )
    assert d.action is Action.SCALE_IN
    assert d.pods == (2,) and d.isolate_nodes == ("node-2",) and "3 of 4" in d.reason


def test_r33_not_with_a_standby_node_nor_for_rank0_nor_with_one_replica() -> None:
    s = process_settings("elastic-training")
    assert first(s, node_lost(), cluster(standby=1)).action is not Action.SCALE_IN
    assert first(s, node_lost("node-0"), cluster(standby=0)).action is Action.FAIL
    d = first(s, node_lost("node-0"), cluster(pods=1, standby=0))
    assert d.action is Action.FAIL and "more than one data-parallel replica" in d.reason


def test_r34_dump_saves_then_hands_over_to_the_next_level() -> None:
    d = first(process_settings("dump"), node_lost())
    assert d.action is Action.DUMP and d.action.hands_over
    assert d.fallback is Action.POD_RESCHEDULE


def test_r35_exit_stops_training_processes_and_hands_over() -> None:
    assert actions(process_settings("exit"), crash()) == ["exit", "job-reschedule", "fail"]
    no_job_level = settings({"recover-strategy": "exit"}, {"fault-scheduling": "grace"})
    assert actions(no_job_level, crash()) == ["exit", "fail"]


def test_r36_strategies_are_tried_in_priority_order_then_pod_then_job_level() -> None:
    s = process_settings("retry,recover-in-place,recover,elastic-training,dump,exit")
    assert actions(s, uce()) == [
        "process-retry",
        "process-in-place",
        "dump",
        "in-place",
        "pod-reschedule",
        "job-reschedule",
        "fail",
    ]
    assert actions(s, node_lost()) == [
        "process-reschedule",
        "dump",
        "pod-reschedule",
        "job-reschedule",
        "fail",
    ]
    assert actions(s, node_lost(), cluster(pods=3, standby=0)) == ["scale-in", "dump", "fail"]


def test_r36_only_listed_strategies_are_used() -> None:
    assert actions(process_settings("recover,exit"), uce()) == [
        "exit",
        "in-place",
        "pod-reschedule",
        "job-reschedule",
        "fail",
    ]


def test_r36_pause_and_off_hand_recovery_to_pod_and_job_level() -> None:
    paused = settings(
        {**MODELARTS_ALL, "recover-strategy": "recover"},
        {"fault-scheduling": "grace", "process-recover-enable": "pause"},
    )
    assert first(paused, node_lost()).action is Action.POD_RESCHEDULE


@pytest.mark.parametrize("fact", ["checkpoint_saving", "group_building"])
def test_r37_no_process_level_recovery_while_saving_or_building_the_group(fact: str) -> None:
    c = cluster(**{fact: True})
    d = first(process_settings("recover-in-place,recover"), crash(), c)
    assert d.action is Action.JOB_RESCHEDULE
    d = first(process_settings("recover-in-place,recover"), node_lost(), c)
    assert d.action is Action.POD_RESCHEDULE


# -- MindCluster rescheduling policies -----------------------------------------------------


def test_r40_direct_rescheduling_on_a_hardware_fault() -> None:
    s = settings({}, {"fault-scheduling": "force"})
    d = first(s, chip(CRITICAL))
    assert d.action is Action.ISOLATED_JOB_RESCHEDULE and d.isolate_nodes == ("node-1",)


def test_r40_without_fault_retry_times_software_faults_are_not_retried() -> None:
    d = first(settings({}, {"fault-scheduling": "force"}), crash())
    assert d.action is Action.FAIL and "R-02" in d.reason


def test_r41_fault_retry_times_counts_down_on_successful_software_reschedules() -> None:
    s = settings({}, {"fault-scheduling": "force", "fault-retry-times": "2"}, backoff_limit=10)
    c, h = cluster(), history()
    d = decide(s, crash(), h, c, 0.0)
    assert d.consumes == frozenset({Budget.JOB, Budget.FAULT_RETRY})
    h = carry_out(h, d, ok=False)  # an unsuccessful reschedule does not count down
    assert h.used(Budget.FAULT_RETRY) == 0
    for i in range(2):
        h = carry_out(h, decide(s, crash(at=float(i + 1)), h, c, float(i + 1)))
    assert h.used(Budget.FAULT_RETRY) == 2
    d = decide(s, crash(at=9.0), h, c, 9.0)
    assert d.action is Action.FAIL and "fault-retry-times spent" in d.reason


def test_r41_hardware_reschedules_do_not_count_down() -> None:
    s = settings({}, {"fault-scheduling": "force", "fault-retry-times": "1"})
    d = first(s, node_lost())
    assert Budget.FAULT_RETRY not in d.consumes


def test_r41_total_cap_backoff_limit_stops_rescheduling() -> None:
    s = settings({}, {"fault-scheduling": "force", "fault-retry-times": "5"}, backoff_limit=1)
    c, h = cluster(), history()
    h = carry_out(h, decide(s, crash(), h, c, 0.0))
    assert decide(s, crash(at=1.0), h, c, 1.0).action is Action.FAIL


def test_r41_every_pod_failing_at_start_is_not_retried() -> None:
    s = settings({}, {"fault-scheduling": "force", "fault-retry-times": "3"})
    d = first(s, crash(), cluster(all_pods_failed_at_start=True))
    assert d.action is Action.FAIL and "R-41" in d.reason


# -- Faults that need nothing --------------------------------------------------------------------------


@pytest.mark.parametrize("fault", [chip(WARNING), network(duration=10.0)], ids=["warning", "blip"])
def test_recorded_only_faults_are_ignored_even_without_fault_tolerance(fault: Fault) -> None:
    d = first(settings(), fault)
    assert d.action is Action.IGNORE and d.fallback is None and not d.isolate_nodes


def test_r13_multi_chip_fault_is_handled_as_software_and_isolates_nothing() -> None:
    h = history().with_fault(chip(MAJOR, node="node-0", at=0.0))
    d = decide(settings(UNCONDITIONAL), chip(MAJOR, at=10.0), h, cluster(), 10.0)
    assert d.action is Action.JOB_RESCHEDULE and not d.isolate_nodes


def test_custom_escalation_rules_reach_the_decision() -> None:
    h = history().with_fault(chip(MAJOR, at=0.0))
    rules = EscalationRules(threshold=2)
    d = decide(settings(AUTO), chip(MAJOR, at=10.0), h, cluster(), 10.0, rules=rules)
    assert d.action is Action.ISOLATED_JOB_RESCHEDULE


def test_a_failed_move_does_not_turn_its_fault_into_an_ignore() -> None:
    # The pod-level move already took every pod off node-1; the fallback must still be job level.
    moved = ClusterView(
        pods=(PodView(0, "node-0", True), PodView(1, "node-2")), standby_nodes=("node-3",)
    )
    d = decide(
        settings(MODELARTS_ALL),
        node_lost(),
        history(),
        moved,
        0.0,
        tried=frozenset({Action.POD_RESCHEDULE}),
    )
    assert d.action is Action.JOB_RESCHEDULE


# -- relaunch's own outage -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "s",
    [settings(UNCONDITIONAL), settings(AUTO), settings(), process_settings("retry,dump,exit")],
    ids=["unconditional", "auto-restart", "no-fault-tolerance", "process-level"],
)
def test_controller_outage_rebuilds_the_job_without_spending_a_budget(s: RecoverySettings) -> None:
    outage = Fault(FaultKind.CONTROLLER_OUTAGE, 0.0, detail="away 40 s")
    d = first(s, outage)
    assert d.action is Action.JOB_RESCHEDULE and d.pods == (0, 1)
    assert d.consumes == frozenset() and not d.isolate_nodes


def test_controller_outage_neither_breaks_nor_extends_an_unconditional_streak() -> None:
    s, c, h = settings(UNCONDITIONAL), cluster(), history()
    for i, fault in enumerate([crash(), crash(), Fault(FaultKind.CONTROLLER_OUTAGE, 0.0)]):
        d = decide(s, replace(fault, at=float(i)), h, c, float(i))
        h = carry_out(h, d)
    assert h.streaks.unconditional == 2


def test_r31_the_others_migrate_when_the_rank0_pod_has_another_fault() -> None:
    """R-31: "the eligible ones restart in place and the others migrate (R-32)": a fault kept
    from restarting in place by the rank-0 rule moves its processes to a standby node, without
    isolating its node (nothing says that node is faulty)."""
    c = cluster(faulty_pods=frozenset({0}))
    d = first(process_settings("recover-in-place,recover"), crash(pod=1), c)
    assert d.action is Action.PROCESS_RESCHEDULE and d.pods == (1,) and not d.isolate_nodes
    assert "the rank-0 pod has another fault (R-31)" in d.passed_over
    assert "passed over: the rank-0 pod has another fault (R-31)" in d.summary()
    # without recover-in-place in the list, nothing was kept from in place: nothing migrates
    d = first(process_settings("recover"), crash(pod=1), c)
    assert d.action is not Action.PROCESS_RESCHEDULE


def test_r37_a_fault_during_a_checkpoint_save_goes_to_the_next_level() -> None:
    s = process_settings("retry,recover-in-place,recover,dump,exit")
    saving = cluster(checkpoint_saving=True)
    d = first(s, uce(), saving)
    assert d.action is Action.IN_PLACE
    assert "a checkpoint is being saved (R-37)" in d.passed_over
    assert first(s, uce(), cluster()).action is Action.PROCESS_RETRY


def test_r37_a_fault_found_during_a_save_waits_for_it_at_most_the_hang_window() -> None:
    from relaunch.policy.fallback import SAVE_HOLD_MAX_S, decide_after

    s = process_settings("retry,recover-in-place,recover,dump,exit", hang_detect_seconds=4)
    fresh = [(uce(at=10.0), frozenset[Action]())]

    def hold(
        now: float,
        saving: bool = True,
        with_settings: RecoverySettings = s,
        waiting: list[tuple[Fault, frozenset[Action]]] = fresh,
    ) -> float | None:
        return decide_after(with_settings, waiting, 0.0, 0, 2, now, saving=saving)

    assert hold(10.0) == pytest.approx(10.2)  # looks again soon: the save may end any moment
    assert hold(13.9) == pytest.approx(14.0)  # never past the hang window after the fault
    assert hold(14.0) is None  # then R-37 sends it down
    assert hold(10.0, saving=False) is None  # the save ended: decided now
    falling_back = [(uce(at=10.0), frozenset({Action.PROCESS_RETRY}))]
    assert hold(10.0, waiting=falling_back) is None  # a fault falling back is not held again
    no_process = settings(MODELARTS_ALL, hang_detect_seconds=4)
    assert hold(10.0, with_settings=no_process) is None  # nothing finer to wait for
    long_window = process_settings("retry", hang_detect_seconds=1800)
    assert hold(10.0 + SAVE_HOLD_MAX_S, with_settings=long_window) is None  # capped


# -- a slow pod (SubHealthFault, issue 18) ---------------------------------------------------------


def slow(node: str = "node-1", pod: int = 1) -> Fault:
    return Fault(FaultKind.SLOW, 0.0, node=node, pod=pod, detail="busy 95% vs 30%")


def test_a_slow_pod_moves_to_a_standby_node_by_pod_level_rescheduling() -> None:
    d = first(settings(MODELARTS_ALL), slow())
    assert d.action is Action.POD_RESCHEDULE
    assert d.pods == (1,) and d.isolate_nodes == ("node-1",)


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("no-standby", "no standby node"),
        ("rank0", "rank 0"),
        ("pod-level-off", "pod-level rescheduling is off"),
    ],
)
def test_a_slow_pod_that_cannot_move_is_recorded_only(case: str, why: str) -> None:
    s = settings(MODELARTS_ALL)
    fault, view = slow(), cluster()
    if case == "no-standby":
        view = cluster(standby=0)
    elif case == "rank0":
        fault = slow("node-0", 0)
    else:
        s = settings({"fault-tolerance/job-retry-num": "8"})
    d = first(s, fault, view)
    assert d.action is Action.IGNORE, d
    assert "recorded only" in d.reason and why in d.reason


def test_a_slow_pod_whose_move_failed_is_recorded_only_never_a_job_restart() -> None:
    s = settings(MODELARTS_ALL)
    d = decide(s, slow(), history(), cluster(), 0.0, tried=frozenset({Action.POD_RESCHEDULE}))
    assert d.action is Action.IGNORE and "did not work" in d.reason


def test_a_slow_pod_under_process_level_recovery_moves_by_process_rescheduling() -> None:
    d = first(process_settings("retry,recover-in-place,recover,dump,exit"), slow())
    assert d.action is Action.PROCESS_RESCHEDULE and d.isolate_nodes == ("node-1",)


def test_a_fault_only_recorded_leaves_the_recovery_under_way_going() -> None:
    from relaunch.policy.fallback import Consequence, on_new_fault

    crash = Fault(FaultKind.PROCESS_EXIT, 0.0, pod=1, exit_code=1)
    lost = Fault(FaultKind.NODE_LOST, 1.0, node="node-3")
    rebuild = Action.JOB_RESCHEDULE
    assert on_new_fault(rebuild, crash, frozenset(), lost, Action.IGNORE).consequence is (
        Consequence.ALONGSIDE
    )
    acted_on = on_new_fault(rebuild, crash, frozenset(), lost, Action.ISOLATED_JOB_RESCHEDULE)
    assert acted_on.consequence is Consequence.DECIDE_NEW
    finer = on_new_fault(Action.POD_RESCHEDULE, crash, frozenset(), crash, Action.JOB_RESCHEDULE)
    assert finer.consequence is Consequence.FALL_BACK


# -- operator-level online recovery -------------------------------------------------------

OP_ENV = {"HCCL_OP_RETRY_ENABLE": "L0:0, L1:1, L2:0", "HCCL_OP_RETRY_PARAMS": "MaxCnt:3"}


def collective(node: str | None = "node-1") -> Fault:
    return Fault(FaultKind.COLLECTIVE, 0.0, node=node, pod=1, rank=1, step=7, collective=2)


def test_r29_a_failed_collective_is_issued_again_before_any_process_level_recovery() -> None:
    s = process_settings("retry,recover-in-place,recover,dump,exit", env=OP_ENV)
    assert s.operator_retry is not None and s.operator_retry.max_count == 3
    ladder = actions(s, collective())
    assert ladder[:2] == ["operator-retry", "process-retry"]
    d = first(s, collective())
    assert d.action is Action.OPERATOR_RETRY and not d.isolate_nodes
    assert d.counters == (Counters(), Counters())  # nothing restarts


def test_r29_without_operator_retry_a_failed_collective_starts_at_process_retry() -> None:
    s = process_settings("retry,recover-in-place,recover,dump,exit")
    assert actions(s, collective())[0] == "process-retry"


def test_r29_is_not_held_back_by_a_save_in_progress_r37_holds_the_rest() -> None:
    """Nothing is rolled back: a rank still saving joins the re-issue when it gets there."""
    s = process_settings("retry,recover-in-place,recover,dump,exit", env=OP_ENV)
    saving = cluster(checkpoint_saving=True)
    assert first(s, collective(), saving).action is Action.OPERATOR_RETRY
    assert "process-retry" not in actions(s, collective(), saving)[:2]


def test_r29_a_collective_with_no_link_seen_down_is_the_jobs_fault_after_operator_retry() -> None:
    """No node had its data link down: nothing to isolate; past the process levels, the job is
    rebuilt as for a crash (unconditional retry), not a node moved."""
    s = process_settings("retry,dump,exit", env=OP_ENV)
    assert actions(s, collective(node=None)) == [
        "operator-retry", "process-retry", "dump", "job-reschedule", "fail",
    ]  # fmt: skip


def test_r29_a_rank_that_died_under_an_operator_retry_is_decided_on_its_own() -> None:
    """The collective failed because a rank crashed: issuing it again cannot help."""
    from relaunch.policy.fallback import Consequence, on_new_fault

    retry = on_new_fault(Action.OPERATOR_RETRY, collective(), frozenset(), crash(pod=1))
    assert (
        retry.consequence is Consequence.DECIDE_NEW
        and retry.fault_to_decide.kind is FaultKind.PROCESS_EXIT
    )


def test_every_level_is_declared_once_decided_by_a_rung_and_carried_out_by_an_action() -> None:
    """Issue 31's one table per level: the policy's LEVELS declares what each level is and
    changes, a rung of the ladder decides when it applies (fail is the ladder's end, not a
    rung), and one class of controller/actions.py carries it out: the three cover the same
    levels, and what the controller derives from the table agrees with it."""
    from relaunch.controller.actions import ACTIONS
    from relaunch.policy import LEVELS, RUNGS, PodChange

    assert list(LEVELS) == list(Action)  # one order: the ladder's
    assert set(ACTIONS) == set(Action)
    assert [action for action, _ in RUNGS] == [a for a in Action if a is not Action.FAIL]
    for action, level in LEVELS.items():
        assert ACTIONS[action].action is action
        assert ACTIONS[action].new_attempt is level.new_attempt
        assert action.rebuilds_all_pods is (level.other_pods is PodChange.RESCHEDULED)
        # a level that restarts every process changes every container, and only those do
        assert level.new_attempt is (level.other_pods is not PodChange.KEPT)
        assert not (level.process_level and level.new_attempt)
        assert not (level.final and (level.new_attempt or level.process_level))
        assert level.recovering >= level.new_attempt  # a new attempt is a recovery under way


def test_what_follows_from_the_level_declarations() -> None:
    """Issue 47's one declaration per level: R-43's reschedules, the runs in a row (R-21,
    R-24), the job's status while a level runs and the controller's classes all read LEVELS;
    a level declared without a class is refused when the controller loads."""
    from relaunch.controller import actions
    from relaunch.policy import LEVELS, Streak
    from relaunch.report import RESCHEDULES

    assert {
        Action.PROCESS_RESCHEDULE,
        Action.POD_RESCHEDULE,
        Action.ISOLATED_JOB_RESCHEDULE,
        Action.JOB_RESCHEDULE,
    } == RESCHEDULES
    assert {a: LEVELS[a].streak for a in Action if LEVELS[a].streak} == {
        Action.HANG_RESTART: Streak.HANG,
        Action.JOB_RESCHEDULE: Streak.UNCONDITIONAL,
    }
    assert {a for a in Action if LEVELS[a].recovering} == {
        Action.PROCESS_RESCHEDULE,
        Action.SCALE_IN,
        Action.HANG_RESTART,
        Action.IN_PLACE,
        Action.POD_RESCHEDULE,
        Action.ISOLATED_JOB_RESCHEDULE,
        Action.JOB_RESCHEDULE,
    }

    class Twice(actions.LevelAction):
        action = Action.JOB_RESCHEDULE

    try:
        with pytest.raises(TypeError, match="two classes carry out job-reschedule"):
            actions._registered()
    finally:
        del Twice
        import gc

        gc.collect()
    assert actions._registered().keys() == set(Action)


def test_r04_r05_counters_follow_what_each_level_does_to_a_container() -> None:
    """MA_SCHEDULE_CNT and MA_PROC_START_CNT of the decided pod and of another pod, for every
    level: the counters a decision carries are what LEVELS says happens to each container."""
    from relaunch.policy.ladder import _counters_after

    start = (Counters(2, 3), Counters(2, 3))
    expected = {
        Action.IN_PLACE: (Counters(2, 4), Counters(2, 4)),
        Action.HANG_RESTART: (Counters(2, 4), Counters(2, 4)),
        Action.POD_RESCHEDULE: (Counters(3, 1), Counters(2, 4)),
        Action.PROCESS_RESCHEDULE: (Counters(3, 1), Counters(2, 3)),
        Action.JOB_RESCHEDULE: (Counters(3, 1), Counters(3, 1)),
        Action.ISOLATED_JOB_RESCHEDULE: (Counters(3, 1), Counters(3, 1)),
    }
    for action in Action:
        assert _counters_after(action, start, (0,)) == expected.get(action, start), action


def test_r33_scale_out_sends_parked_pods_back_in_order_one_per_free_node() -> None:
    """The policy decides the scale-out (issue 31): parked pods go back in pod order, one per
    free node, each a rescheduled container (MA_SCHEDULE_CNT + 1, MA_PROC_START_CNT 1); nothing
    while a recovery runs, with nothing parked, or with no node for one."""
    from relaunch.policy.elastic import scale_out

    counters = [Counters(1, 1), Counters(2, 3), Counters(1, 2), Counters(3, 1)]
    decided = scale_out({3, 1}, ["node-7"], counters, recovering=False)
    assert decided is not None
    assert decided.back == ((1, "node-7", Counters(3, 1)),)
    both = scale_out([3, 1], ["node-7", "node-8", "node-9"], counters, recovering=False)
    assert both is not None and both.back == (
        (1, "node-7", Counters(3, 1)),
        (3, "node-8", Counters(4, 1)),
    )
    assert scale_out([1], ["node-7"], counters, recovering=True) is None
    assert scale_out([], ["node-7"], counters, recovering=False) is None
    assert scale_out([1], [], counters, recovering=False) is None
