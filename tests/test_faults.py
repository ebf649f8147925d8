"""Fault model: R-08..R-13 of docs/recovery-rules.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaunch.errors import FaultTableError
from relaunch.faults import (
    DEFAULT_TABLE,
    LAUNCHER_DIED,
    Cause,
    EscalationRules,
    Fault,
    FaultCode,
    FaultCodeTable,
    FaultKind,
    HandlingLevel,
    RescheduleReason,
    Severity,
    assess,
    parse_fault_table,
    release_due,
    reschedule_reason,
)
from relaunch.files import load_fault_table
from tests.builders import (
    CRITICAL,
    MAJOR,
    MINOR,
    USER,
    WARNING,
    chip,
    crash,
    hang,
    network,
    node_lost,
    uce,
)

RULES = EscalationRules()
ROOT = Path(__file__).resolve().parents[1]


def test_r08_fault_kinds() -> None:
    assert {k.value for k in FaultKind} == {
        "process-exit",
        "chip",
        "node-lost",
        "hang",
        "network",
        "memory-uce",
        "controller-outage",  # relaunch's own: its controller away longer than the adopt grace
        "slow",  # a pod slower than its peers (SubHealthFault, diagnosis.subhealth)
        "collective",  # a collective the SDK issued failed on its transport
        "silent-corruption",  # the replicas' parameters apart (R-45)
    }


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kind": FaultKind.CHIP, "node": "n"}, "needs chip, code"),
        ({"kind": FaultKind.NODE_LOST}, "needs node"),
        ({"kind": FaultKind.PROCESS_EXIT}, "needs exit_code or signal"),
        ({"kind": FaultKind.PROCESS_EXIT, "exit_code": 0}, "not a fault"),
        ({"kind": FaultKind.CHIP, "node": "n", "chip": 0, "code": "xyz"}, "8 hexadecimal"),
    ],
)
def test_r08_a_fault_checks_that_it_says_where_it_happened(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Fault(at=0.0, **kwargs)  # type: ignore[arg-type]


def test_r08_process_exit_by_signal_and_code_normalisation() -> None:
    fault = Fault(FaultKind.PROCESS_EXIT, 1.0, pod=0, signal=9)
    assert "signal 9" in fault.describe()
    assert chip("80e18005").code == "80E18005"


def test_r08_every_kind_is_classified() -> None:
    causes = {
        crash().kind: assess(crash(), (), DEFAULT_TABLE, RULES).cause,
        hang().kind: assess(hang(), (), DEFAULT_TABLE, RULES).cause,
        node_lost().kind: assess(node_lost(), (), DEFAULT_TABLE, RULES).cause,
        FaultKind.NETWORK: assess(network(), (), DEFAULT_TABLE, RULES).cause,
        FaultKind.MEMORY_UCE: assess(uce(), (), DEFAULT_TABLE, RULES).cause,
        FaultKind.CHIP: assess(chip(MAJOR), (), DEFAULT_TABLE, RULES).cause,
    }
    assert causes == {
        FaultKind.PROCESS_EXIT: Cause.SOFTWARE,
        FaultKind.HANG: Cause.SOFTWARE,
        FaultKind.NODE_LOST: Cause.ENVIRONMENT,
        FaultKind.NETWORK: Cause.ENVIRONMENT,
        FaultKind.MEMORY_UCE: Cause.ENVIRONMENT,
        FaultKind.CHIP: Cause.ENVIRONMENT,
    }


# -- R-09 ---------------------------------------------------------------------------------------


def test_r09_levels_are_ordered_by_seriousness() -> None:
    names = [level.mindcluster_name for level in sorted(HandlingLevel, reverse=True)]
    assert names == [
        "ManuallySeparateNPU",
        "SeparateNPU",
        "PreSeparateNPU",
        "RestartNPU",
        "FreeRestartNPU",
        "RestartBusiness",
        "RestartRequest",
        "SubHealthFault",
        "NotHandleFault",
    ]


def test_r09_severities_warning_records_minor_major_heal_critical_does_not() -> None:
    assert [s.self_healable for s in Severity] == [False, True, True, False]


@pytest.mark.parametrize(
    "code, level, severity, user",
    [
        ("80E01801", HandlingLevel.RESTART_BUSINESS, Severity.MINOR, False),
        ("80E18005", HandlingLevel.RESTART_NPU, Severity.MAJOR, False),
        ("81078603", HandlingLevel.NOT_HANDLE_FAULT, Severity.WARNING, False),
        ("80C98002", HandlingLevel.RESTART_REQUEST, Severity.MINOR, True),
        ("80CB8002", HandlingLevel.RESTART_REQUEST, Severity.MINOR, True),
    ],
)
def test_r09_shipped_defaults_for_the_named_codes(
    code: str, level: HandlingLevel, severity: Severity, user: bool
) -> None:
    row = DEFAULT_TABLE.lookup(code)
    assert (row.level, row.severity, row.user_induced, row.known) == (level, severity, user, True)


def test_r09_default_table_has_more_codes_than_the_named_ones() -> None:
    assert len(DEFAULT_TABLE) >= 40
    assert {row.level for row in DEFAULT_TABLE} >= set(HandlingLevel) - {
        HandlingLevel.PRE_SEPARATE_NPU,
        HandlingLevel.MANUALLY_SEPARATE_NPU,
    }


def test_r09_unknown_code_reported_as_minor_is_not_handled() -> None:
    row = DEFAULT_TABLE.lookup("DEADBEEF", Severity.MINOR)
    assert row.level is HandlingLevel.NOT_HANDLE_FAULT and not row.known
    fault = chip("DEADBEEF", reported_severity=Severity.MINOR)
    assert assess(fault, (), DEFAULT_TABLE, RULES).cause is Cause.NONE


@pytest.mark.parametrize("reported", [None, Severity.MAJOR, Severity.CRITICAL])
def test_r09_any_other_unknown_code_is_separate_npu(reported: Severity | None) -> None:
    row = DEFAULT_TABLE.lookup("DEADBEEF", reported)
    assert row.level is HandlingLevel.SEPARATE_NPU and row.severity is Severity.CRITICAL


def test_r09_a_code_listed_twice_takes_the_more_serious_level() -> None:
    # A2301001 is both RestartBusiness and SeparateNPU in MindCluster's table, and in ours.
    assert DEFAULT_TABLE.lookup("A2301001").level is HandlingLevel.SEPARATE_NPU
    table = FaultCodeTable(
        [
            FaultCode("11111111", HandlingLevel.RESTART_NPU, Severity.MAJOR),
            FaultCode("11111111", HandlingLevel.RESTART_REQUEST, Severity.MINOR, user_induced=True),
        ]
    )
    row = table.lookup("11111111")
    assert (row.level, row.severity, row.user_induced) == (
        HandlingLevel.RESTART_NPU,
        Severity.MAJOR,
        True,
    )


def test_r09_warning_level_codes_are_recorded_not_handled() -> None:
    found = assess(chip(WARNING), (), DEFAULT_TABLE, RULES)
    assert found.cause is Cause.NONE and "recorded only" in found.reason


def test_r09_overrides_load_from_a_file_and_replace_defaults() -> None:
    loaded = load_fault_table(ROOT / "examples" / "fault-table.yaml")
    table = DEFAULT_TABLE.overridden_by(loaded.rows)
    assert table.lookup("80E3A201").level is HandlingLevel.SEPARATE_NPU
    assert table.lookup("80C98002").user_induced
    assert loaded.escalation == EscalationRules()


def test_r09_overrides_can_lower_a_level() -> None:
    loaded = parse_fault_table({"codes": [{"code": CRITICAL, "level": "RestartNPU"}]})
    table = DEFAULT_TABLE.overridden_by(loaded.rows)
    assert table.lookup(CRITICAL).level is HandlingLevel.RESTART_NPU
    assert table.lookup(CRITICAL).severity is Severity.MAJOR


def test_r09_mindcluster_fault_code_json_shape_is_read() -> None:
    loaded = parse_fault_table(
        {
            "RestartNPUCodes": ["AAAA0001", 80818200],
            "SubHealthFaultCodes": ["AAAA0002"],
            "PreSeparateNPUCodes": [],
        }
    )
    levels = {row.code: row.level for row in loaded.rows}
    assert levels == {
        "AAAA0001": HandlingLevel.RESTART_NPU,
        "80818200": HandlingLevel.RESTART_NPU,
        "AAAA0002": HandlingLevel.SUB_HEALTH_FAULT,
    }


def test_r09_bad_fault_table_reports_every_problem() -> None:
    with pytest.raises(FaultTableError) as caught:
        parse_fault_table(
            {
                "codes": [{"code": "nothex!!", "level": "Reboot", "severity": "Huge", "colour": 1}],
                "RebootCodes": ["AAAA0001"],
                "escalation": {"threshold": 0, "window_seconds": 10},
                "extra": 1,
            }
        )
    keys = {p.key for p in caught.value.problems}
    assert keys == {
        "codes[0].code",
        "codes[0].level",
        "codes[0].severity",
        "codes[0].colour",
        "RebootCodes",
        "escalation.threshold",
        "escalation.window_seconds",
        "extra",
    }


# -- R-10 ---------------------------------------------------------------------------------------


def test_r10_same_code_three_times_in_a_row_within_24h_on_one_chip_escalates() -> None:
    earlier = [chip(MAJOR, at=0.0), chip(MAJOR, at=3600.0)]
    assert assess(chip(MAJOR, at=80000.0), earlier, DEFAULT_TABLE, RULES).escalated


def test_r10_two_times_do_not_escalate() -> None:
    assert not assess(chip(MAJOR, at=10.0), [chip(MAJOR)], DEFAULT_TABLE, RULES).escalated


def test_r10_outside_the_window_does_not_escalate() -> None:
    earlier = [chip(MAJOR, at=0.0), chip(MAJOR, at=3600.0)]
    assert not assess(chip(MAJOR, at=86401.0), earlier, DEFAULT_TABLE, RULES).escalated


def test_r10_a_different_code_in_between_breaks_the_row() -> None:
    earlier = [chip(MAJOR, at=0.0), chip(MINOR, at=10.0), chip(MAJOR, at=20.0)]
    assert not assess(chip(MAJOR, at=30.0), earlier, DEFAULT_TABLE, RULES).escalated


def test_r10_other_chips_and_nodes_do_not_count() -> None:
    earlier = [chip(MAJOR, chip_index=1, at=0.0), chip(MAJOR, node="node-0", at=100.0)]
    assert not assess(chip(MAJOR, at=200.0), earlier, DEFAULT_TABLE, RULES).escalated


def test_r10_window_and_threshold_are_configurable_within_their_ranges() -> None:
    rules = EscalationRules(window_s=60, threshold=2)
    assert assess(chip(MAJOR, at=50.0), [chip(MAJOR)], DEFAULT_TABLE, rules).escalated
    assert not assess(chip(MAJOR, at=61.0), [chip(MAJOR)], DEFAULT_TABLE, rules).escalated
    assert EscalationRules(threshold=1, window_s=864000).threshold == 1
    for bad in ({"window_s": 59}, {"window_s": 864001}, {"threshold": 0}, {"threshold": 101}):
        with pytest.raises(ValueError):
            EscalationRules(**bad)  # type: ignore[arg-type]


def test_r10_isolated_node_is_released_after_a_fault_free_period() -> None:
    hour = 3600.0
    assert not release_due(0.0, None, 47 * hour, RULES)
    assert release_due(0.0, None, 48 * hour, RULES)
    assert not release_due(0.0, 10 * hour, 50 * hour, RULES)  # a later fault restarts the clock
    assert release_due(0.0, 10 * hour, 58 * hour, RULES)


# -- R-11 ---------------------------------------------------------------------------------------


def test_r11_user_induced_codes_are_flagged() -> None:
    found = assess(chip(USER), (), DEFAULT_TABLE, RULES)
    assert found.user_induced and found.cause is Cause.ENVIRONMENT


def test_r11_table_can_mark_more_codes_user_induced() -> None:
    loaded = parse_fault_table({"user_induced": [MAJOR, "AAAA0003"]})
    table = DEFAULT_TABLE.overridden_by(loaded.rows)
    assert assess(chip(MAJOR), (), table, RULES).user_induced
    assert table.lookup("AAAA0003").user_induced


# -- R-12 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "duration, handled", [(5.0, False), (20.0, False), (20.5, True), (None, True)]
)
def test_r12_network_link_fault_of_20s_or_less_is_only_recorded(
    duration: float | None, handled: bool
) -> None:
    assert assess(network(duration=duration), (), DEFAULT_TABLE, RULES).handled is handled


# -- R-13 ---------------------------------------------------------------------------------------


def test_r13_same_code_on_several_chips_within_30s_is_a_software_fault() -> None:
    earlier = [chip(MAJOR, node="node-0", at=0.0)]
    found = assess(chip(MAJOR, at=25.0), earlier, DEFAULT_TABLE, RULES)
    assert found.cause is Cause.SOFTWARE and "R-13" in found.reason


def test_r13_more_than_30s_apart_is_hardware() -> None:
    earlier = [chip(MAJOR, node="node-0", at=0.0)]
    assert assess(chip(MAJOR, at=31.0), earlier, DEFAULT_TABLE, RULES).cause is Cause.ENVIRONMENT


def test_r13_multi_chip_faults_do_not_count_towards_escalation() -> None:
    # Two earlier faults on node-1 chip 0, but the second came with the same code on node-0.
    earlier = [chip(MAJOR, at=0.0), chip(MAJOR, at=1000.0), chip(MAJOR, node="node-0", at=1010.0)]
    found = assess(chip(MAJOR, at=5000.0), earlier, DEFAULT_TABLE, RULES)
    assert found.cause is Cause.ENVIRONMENT and not found.escalated


# -- the reason of a reschedule record -------------------------------------------------------


REASONS = [
    (Fault(FaultKind.PROCESS_EXIT, 1.0, pod=1, rank=3, exit_code=1), "process-exception"),
    (Fault(FaultKind.HANG, 1.0, pod=1, rank=3), "process-exception"),
    (Fault(FaultKind.COLLECTIVE, 1.0, pod=1, rank=3, step=7, collective=0), "process-exception"),
    (Fault(FaultKind.PROCESS_EXIT, 1.0, node="node-1", pod=1, signal=9, detail=LAUNCHER_DIED),
     "pod-failed"),
    (Fault(FaultKind.CONTROLLER_OUTAGE, 1.0), "pod-failed"),
    (Fault(FaultKind.CHIP, 1.0, node="node-1", chip=0, code="80E18005"), "CardUnhealthy"),
    (Fault(FaultKind.MEMORY_UCE, 1.0, node="node-1", chip=0), "CardUnhealthy"),
    (Fault(FaultKind.NODE_LOST, 1.0, node="node-1"), "NodeUnhealthy"),
    (Fault(FaultKind.NETWORK, 1.0, node="node-1", duration_s=30.0), "NodeUnhealthy"),
    (Fault(FaultKind.SLOW, 1.0, node="node-1", pod=1), "NodeUnhealthy"),
    (Fault(FaultKind.SILENT_CORRUPTION, 1.0, node="node-1", pod=1, rank=1, step=50),
     "CardUnhealthy"),
]  # fmt: skip


@pytest.mark.parametrize("fault, reason", REASONS)  # fmt: skip
def test_r43_each_fault_kind_has_mindclusters_reschedule_reason(fault: Fault, reason: str) -> None:
    assert reschedule_reason(fault).value == reason


def test_r43_every_fault_kind_has_a_reason() -> None:
    """A new kind of fault must say how MindCluster's records name it."""
    assert {fault.kind for fault, _ in REASONS} == set(FaultKind)
    assert {reason for _, reason in REASONS} == {r.value for r in RescheduleReason}
