"""Sequences of faults through the real controller on its simulator (tests/controller_sim.py, a
fake clock, no process): which level each fault of a row takes, what the row's end does to the
job and its nodes. These were real runs of test_runtime_e2e.py, three or four recoveries each;
the ladder's counting is the controller's, not the processes', and each mechanism keeps its one
real run there (a healed chip fault, a hang found by the launcher's sampling, a crash)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaunch.protocol.messages import Shutdown, Stop
from relaunch.store import JobStatus, NodeState
from tests.controller_sim import LADDERS, Sim, job_spec

AUTO = {"fault-tolerance/job-retry-num": "4"}
UNCONDITIONAL = {**AUTO, "fault-tolerance/job-unconditional-retry": "true"}
HANG = {**AUTO, "fault-tolerance/hang-retry": "true"}


def booted(tmp: Path, annotations: dict[str, str]) -> Sim:
    sim = Sim(tmp, job_spec(annotations), nodes=4)
    sim.boot()
    sim.train(1)
    sim.tick()
    return sim


def trained(sim: Sim, step: int, seconds: float = 1.0) -> None:
    """The job trains on for `seconds` (whatever attempt now runs), then reports `step`."""
    sim.run(seconds)
    sim.train(step)
    sim.tick()


def chip_fault_row(sim: Sim, code: str) -> None:
    """Three faults of `code` on chip 1 of node-0 (pod 0's), each once the last was recovered."""
    for step in (8, 16, 24):
        node = sim.controller.pods[0].row.node
        sim.chip_fault(node, 1, code)
        trained(sim, step)
        trained(sim, step + 1)


def test_r10_third_same_code_on_one_chip_isolates_the_node(tmp_path: Path) -> None:
    sim = booted(tmp_path, AUTO)
    chip_fault_row(sim, "80E18005")
    assert sim.actions() == [
        ("in-place", "succeeded"),
        ("in-place", "succeeded"),
        ("isolated-job-reschedule", "succeeded"),
    ]
    assert sim.records()[2].isolated == ("node-0",)
    assert sim.controller.node("node-0").state is NodeState.ISOLATED  # type: ignore[union-attr]
    assert "node-0" not in [p.row.node for p in sim.controller.pods.values()]


def test_r11_user_induced_codes_never_isolate(tmp_path: Path) -> None:
    sim = booted(tmp_path, AUTO)
    chip_fault_row(sim, "80C98002")
    assert sim.actions() == [
        ("in-place", "succeeded"),
        ("in-place", "succeeded"),
        ("job-reschedule", "succeeded"),
    ]
    assert all(not r.isolated for r in sim.records())
    assert sim.controller.node("node-0").state is not NodeState.ISOLATED  # type: ignore[union-attr]


def test_r02_without_unconditional_retry_a_plain_crash_fails_the_job(tmp_path: Path) -> None:
    sim = booted(tmp_path, AUTO)
    sim.crash(3, code=7)
    sim.run(0.3)
    (record,) = sim.records()
    assert (record.action.value, record.outcome.value) == ("fail", "failed")
    assert record.fault.exit_code == 7 and record.fault.rank == 3
    assert sim.controller.job.status is JobStatus.FAILED
    assert "R-02" in sim.controller.job.reason


def test_r26_spent_restart_budget_fails_with_the_reason(tmp_path: Path) -> None:
    sim = booted(tmp_path, {**UNCONDITIONAL, "fault-tolerance/job-retry-num": "1"})
    sim.crash(0)
    trained(sim, 8)
    trained(sim, 9)
    sim.crash(3)
    sim.run(0.3)
    assert sim.actions() == [("job-reschedule", "succeeded"), ("fail", "failed")]
    assert sim.controller.job.status is JobStatus.FAILED
    assert "restart budget spent: 1 of 1" in sim.controller.job.reason


def test_r24_three_hang_restarts_in_a_row_then_failed(tmp_path: Path) -> None:
    """Pod 1 falls silent four times, each after the last restart trained a step: three hang
    restarts, then the job fails naming R-24 (the first real hang, found by the launcher's
    sampling, is test_runtime_e2e.py's)."""
    sim = booted(tmp_path, HANG)
    for step in (6, 12, 18, 24):
        if sim.controller.job.status.ended:
            break
        # pod 0 trains on; pod 1 says nothing for past the 2 s hang window
        for _ in range(15):
            sim.run(0.2)
            sim.train(step, pods={0})
        trained(sim, step + 1)
    assert sim.actions() == [("hang-restart", "succeeded")] * 3 + [("fail", "failed")]
    assert sim.controller.job.status is JobStatus.FAILED
    assert "R-24" in sim.controller.job.reason
    assert all(not r.consumed for r in sim.records()[:3])  # hang restarts spend no restart


PROCESS = {
    "fault-tolerance/job-retry-num": "6",
    "fault-tolerance/job-unconditional-retry": "true",
    "fault-tolerance/pod-retry-num": "2",
    "recover-strategy": "retry,recover-in-place,recover,dump,exit",
    "wait-reschedule-timeout": "60",
}
"""examples/ddp/process-job.yaml's annotations (its real runs: test_process_recovery.py)."""
PROCESS_LABELS = {"process-recover-enable": "on", "pod-rescheduling": "on"}


def test_r36_a_replacement_that_crashes_again_moves_down_to_job_level(tmp_path: Path) -> None:
    """Rank 1 is restarted in place and its replacement crashes before it trains a step: that
    restart failed, the healthy ranks save a dying gasp, and the job is rebuilt (one restart).
    The real replacement that crashes on purpose was a real run of test_process_recovery.py; a
    replacement that never progresses is test_restart_storm.py's, on every ladder."""
    sim = Sim(tmp_path, job_spec(PROCESS, labels=PROCESS_LABELS), nodes=4)
    sim.boot()
    sim.train(40)
    sim.tick()
    sim.crash(1)
    sim.tick()
    assert sim.actions() == [("process-in-place", "running")]
    sim.run(0.5)
    sim.crash(1)
    trained(sim, 41)
    trained(sim, 42)
    assert sim.actions() == [
        ("process-in-place", "failed"),
        ("dump", "succeeded"),
        ("job-reschedule", "succeeded"),
    ]
    assert [r.consumed for r in sim.records()][-1], "the job-level restart is spent"
    assert sim.controller.job.attempt == 2


def test_r31_with_another_fault_on_the_rank0_pod_the_others_migrate(tmp_path: Path) -> None:
    """node-0 (the rank-0 pod's) reports a chip fault that is only recorded and stays; a crash
    in pod 1 then cannot restart in place (R-31) and migrates to a standby node instead (R-32),
    node-1 not isolated; the rank-0 pod's processes never restart. (A real run before, in
    test_process_recovery.py; each level's mechanism keeps its real run there.)"""
    strategies = {**PROCESS, "recover-strategy": "recover-in-place,recover,dump,exit"}
    sim = Sim(tmp_path, job_spec(strategies, labels=PROCESS_LABELS), nodes=4)
    sim.boot()
    sim.train(20)
    sim.tick()
    sim.chip_fault("node-0", 0, "80E21007", heals=False)
    trained(sim, 21, seconds=0.5)
    assert sim.actions() == [("ignore", "succeeded")]
    sim.crash(3)
    trained(sim, 41)
    trained(sim, 42)
    assert sim.actions() == [("ignore", "succeeded"), ("process-reschedule", "succeeded")]
    record = sim.records()[1]
    assert record.isolated == () and "rank-0 pod has another fault" in record.reason
    pods = sim.controller.pods
    assert [(p.row.node, p.row.generation) for p in pods.values()] == [("node-0", 1), ("node-2", 2)]
    stopped = [name for name, m in sim.wire if isinstance(m, Stop | Shutdown)]
    assert not [name for name in stopped if name.startswith("launcher-0-")], stopped


@pytest.mark.parametrize("ladder", sorted(LADDERS))
def test_r23_a_node_loss_heard_while_its_collateral_exits_recovery_starts_runs_every_pod(
    tmp_path: Path, ladder: str
) -> None:
    """Pod 1's node dies; rank 0's exit (its peer gone) is heard first and decided; the node's
    loss, heard while pod 0's launcher is slow to start what it was told, outranks that
    recovery: pod 1 moves to a standby node (R-23, or its process-level kin) and pod 0 runs
    again. A launcher told to start an attempt while the rank it started for the one before
    still ran kept that rank: the start it did not carry out is sent again once the rank is
    stopped. Before, pod 0 sat idle until rank 1's rendezvous timed out (140 s on Kubernetes)
    and a second rebuild ran. On every ladder, no other fault: every rank of every pod runs."""
    annotations, labels, spec = LADDERS[ladder]
    job = job_spec({**annotations, "fault-tolerance/pod-retry-num": "2"}, labels=labels,
                   procs_per_pod=1, **spec)  # fmt: skip
    sim = Sim(tmp_path, job, nodes=3)
    sim.boot()
    trained(sim, 5)
    c = sim.controller
    lost = c.pods[1].row.node
    sim.silent.add(lost)  # its agent and its pods' processes killed: silent, not known dead
    launcher = sim.link_peer(1)
    launcher.closed = True
    c.receive(launcher, None)
    sim.starting.add(0)  # pod 0's launcher is slow to start what it is told
    sim.crash(0)
    for _ in range(50):
        if any(r.fault.kind.value == "node-lost" for r in sim.records()):
            break
        sim.tick()
    else:
        raise AssertionError(f"the node's loss was never decided: {sim.actions()}")
    decided = len(sim.records())
    sim.run(0.2)
    sim.starting.clear()
    for _ in range(200):
        if all(len(sim.running(p.index, p.row.generation)) == 1 for p in c.pods.values()):
            break
        sim.run(0.2)
    assert len(sim.records()) == decided, sim.actions()
    assert all(len(sim.running(p.index, p.row.generation)) == 1 for p in c.pods.values()), (
        sim.procs, sim.actions())  # fmt: skip
    trained(sim, 6)
    assert sim.records()[-1].outcome.value == "succeeded", sim.actions()
    assert c.pods[1].row.node != lost
