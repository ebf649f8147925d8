"""The controller's order of side effects, with a fake engine, a fake clock and fake peers (see
tests/controller_sim.py): each recovery level's desired change, the commands it sends and how it
is verified, in milliseconds, without starting a process. The same paths run end to end, with real
processes, in test_runtime_e2e.py, test_process_recovery.py and test_runtime_robustness.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from relaunch.controller.clock import TICK_S
from relaunch.controller.fencing import FENCE_MARGIN_S
from relaunch.diagnosis import StackGroup
from relaunch.events import Event, EventKind
from relaunch.faults import FaultKind
from relaunch.policy import Action
from relaunch.protocol.environment import Env
from relaunch.protocol.messages import (
    CaptureStacks,
    Exited,
    ForgetCopies,
    Heal,
    Lease,
    MembershipUpdate,
    Output,
    ProgressBatch,
    Shutdown,
    Stacks,
    Start,
    Stop,
)
from relaunch.states import StopCause
from relaunch.store import JobStatus, NodeState, Outcome
from tests.controller_sim import Sim, job_spec, waiting_stack

AUTO = {"fault-tolerance/job-retry-num": "4"}
UNCONDITIONAL = {**AUTO, "fault-tolerance/job-unconditional-retry": "true"}
POD_LEVEL = {**AUTO, "fault-tolerance/pod-retry-num": "2"}
HANG = {**AUTO, "fault-tolerance/hang-retry": "true"}
PROCESS = {
    **POD_LEVEL,
    "recover-strategy": "retry,recover-in-place,recover,elastic-training,dump,exit",
}
PROCESS_LABELS = {"process-recover-enable": "on", "pod-rescheduling": "on"}


def booted(
    tmp: Path, annotations: dict[str, str], nodes: int = 4, heal: float = 0.0, **kw: Any
) -> Sim:
    sim = Sim(tmp, job_spec(annotations, **kw), nodes=nodes, heal_delay_s=heal)
    sim.boot()
    sim.train(1)
    sim.tick()
    return sim


def order(events: list[Event], *kinds: EventKind) -> list[int]:
    """Where each kind first appears in the events (to check the order of effects)."""
    return [next(i for i, e in enumerate(events) if e.kind is kind) for kind in kinds]


def starts(sim: Sim, attempt: int) -> list[tuple[int, tuple[int, ...] | None]]:
    return [
        (pod, m.ranks)
        for (pod, _), peer in sim.launchers.items()
        for m in peer.of(Start)
        if m.attempt == attempt
    ]


def test_boot_places_pods_in_order_and_starts_attempt_1(tmp_path: Path) -> None:
    sim = booted(tmp_path, AUTO)
    assert sim.engine.pods_started() == [(0, 1, "node-0"), (1, 1, "node-1")]
    assert sorted(starts(sim, 1)) == [(0, None), (1, None)]
    assert sim.records() == []


def test_a_crash_is_decided_then_every_pod_rebuilt_then_verified_by_progress(
    tmp_path: Path,
) -> None:
    sim = booted(tmp_path, UNCONDITIONAL)
    c = sim.controller
    sim.crash(3)
    sim.tick()
    [record] = sim.records()
    assert (record.action, record.outcome) == (Action.JOB_RESCHEDULE, Outcome.RUNNING)
    assert c.job.attempt == 2 and [p.row.generation for p in c.pods.values()] == [2, 2]
    assert all(peer.of(Shutdown) for (pod, gen), peer in sim.launchers.items() if gen == 1)
    sim.run(0.5)
    assert sim.engine.pods_started()[2:] == [(0, 2, "node-0"), (1, 2, "node-1")]
    assert sorted(starts(sim, 2)) == [(0, None), (1, None)]
    assert sim.actions() == [("job-reschedule", "running")]  # not before progress
    sim.train(2)
    sim.tick()
    assert sim.actions() == [("job-reschedule", "succeeded")]
    effects = EventKind.FAULT, EventKind.DECISION, EventKind.STOPPING, EventKind.RECOVERED
    assert order(sim.events, *effects) == sorted(order(sim.events, *effects))
    (worked,) = sim.said(EventKind.RECOVERED)
    assert worked.fields["action"] == "job-reschedule" and worked.fields["fault"] == "process-exit"


def test_the_job_row_the_controller_keeps_is_the_stored_one_through_its_recoveries(
    tmp_path: Path,
) -> None:
    """The controller writes the job's fields without reading the row back: after every write
    of a job-level restart (status, attempt, port, seen-at, last step) and of a process-level
    recovery (the membership), what it keeps is what the store holds."""

    def same() -> None:
        c = sim.controller
        assert c.job == c.store.job(c.job_id)

    sim = booted(tmp_path, UNCONDITIONAL)
    same()
    sim.crash(3)
    sim.tick()
    assert sim.controller.job.attempt == 2
    same()
    sim.run(0.5)
    sim.train(2)
    sim.tick()
    assert sim.actions() == [("job-reschedule", "succeeded")]
    same()
    sim = booted(tmp_path / "process", PROCESS, labels=PROCESS_LABELS)
    sim.train(5)
    sim.tick()
    sim.controller.membership.publish()
    assert sim.controller.job.membership is not None
    same()
    sim.run(11.0)  # past the seen-at interval
    same()


def test_each_start_has_its_attempts_variables_and_its_pods_own(tmp_path: Path) -> None:
    """The variables every pod of an attempt shares are built once an attempt: a restart's
    starts carry the new attempt's (its count, its rank 0's port), each pod its own (R-04 to
    R-07); with process-level recovery, the membership file and the replacement wait too."""
    sim = booted(tmp_path, UNCONDITIONAL)
    sim.crash(3)
    sim.tick()
    sim.run(0.5)
    c = sim.controller
    for attempt in (1, 2):
        envs = {
            pod: m.env
            for (pod, _), peer in sim.launchers.items()
            for m in peer.of(Start)
            if m.attempt == attempt
        }
        assert sorted(envs) == [0, 1]
        for pod, env in envs.items():
            assert (env[Env.ATTEMPT], env[Env.RESTART_COUNT]) == (str(attempt), str(attempt - 1))
            assert (env[Env.GROUP_RANK], env[Env.POD]) == (str(pod), str(pod))
            assert env[Env.NODE] == f"node-{pod}" and env[Env.GENERATION] == str(attempt)
            assert Env.MEMBERSHIP not in env and Env.RECOVERY_WAIT not in env
        assert envs[0][Env.MASTER_PORT] == envs[1][Env.MASTER_PORT]
    assert envs[0][Env.MASTER_PORT] == str(c.job.master_port)  # attempt 2's
    sim = booted(tmp_path / "process", PROCESS, labels=PROCESS_LABELS)
    env = sim.link_peer(1).of(Start)[0].env
    assert env[Env.MEMBERSHIP].endswith("membership.json") and env[Env.POD_GENERATION] == "1"
    assert float(env[Env.RECOVERY_WAIT]) == sim.controller.recovery.wait_reschedule_timeout_s


def test_a_chip_fault_that_heals_starts_again_only_once_the_agent_healed_it(
    tmp_path: Path,
) -> None:
    sim = booted(tmp_path, AUTO, heal=1.0)
    c = sim.controller
    sim.chip_fault("node-1", 0, "80E18005")
    sim.tick()
    assert sim.actions() == [("in-place", "running")]
    assert c.job.attempt == 2 and [p.row.generation for p in c.pods.values()] == [1, 1]
    assert sim.agents["node-1"].of(Heal)
    sim.run(0.5)  # the old processes are stopped, but the heal has not come back
    assert all(peer.of(Stop) for peer in sim.launchers.values())
    assert starts(sim, 2) == []
    sim.run(0.7)
    assert sorted(starts(sim, 2)) == [(0, None), (1, None)]
    sim.train(2)
    sim.tick()
    assert sim.actions() == [("in-place", "succeeded")]
    assert [(p.row.schedule_cnt, p.row.proc_start_cnt) for p in c.pods.values()] == [(1, 2), (1, 2)]


def test_a_chip_fault_that_does_not_heal_isolates_the_node_and_rebuilds_the_job(
    tmp_path: Path,
) -> None:
    sim = booted(tmp_path, AUTO)
    c = sim.controller
    sim.chip_fault("node-1", 0, "80E18005", heals=False)
    sim.run(0.2)
    assert sim.actions() == [("in-place", "failed"), ("isolated-job-reschedule", "running")]
    assert c.node("node-1").state is NodeState.ISOLATED  # type: ignore[union-attr]
    assert [(p.row.node, p.row.generation) for p in c.pods.values()] == [
        ("node-0", 2),
        ("node-2", 2),
    ]
    sim.run(0.5)
    sim.train(2)
    sim.tick()
    assert sim.actions()[-1] == ("isolated-job-reschedule", "succeeded")


def test_the_loop_never_blocks_on_a_heal(tmp_path: Path) -> None:
    """A heal that takes 3 s: meanwhile every heartbeat is answered (no node is taken for lost),
    and another fault (a pod's container dies) is detected and decided."""
    sim = booted(tmp_path, UNCONDITIONAL, heal=3.0)
    c = sim.controller
    sim.chip_fault("node-1", 0, "80E18005")
    sim.tick()
    assert sim.actions() == [("in-place", "running")]
    sim.run(1.5)  # longer than the 1 s heartbeat timeout, without a heal answer
    assert all(n.state is not NodeState.LOST for n in c.nodes.values())
    assert set(c.agents) == {"node-0", "node-1", "node-2", "node-3"}
    assert starts(sim, 2) == []
    peer = sim.link_peer(0)
    peer.closed = True
    c.receive(peer, None)  # pod 0's container dies while the heal is pending
    sim.run(1.45)  # the launcher grace (1.4 s) ends before the heal's 3 s
    assert sim.pending_heals, "the heal should still be pending"
    assert [f.kind.value for f in sim.store.faults(sim.job_id)] == ["chip", "process-exit"]
    assert sim.actions() == [("in-place", "failed"), ("isolated-job-reschedule", "running")]


def test_a_lost_node_moves_only_its_pod_and_the_other_re_runs(tmp_path: Path) -> None:
    sim = booted(tmp_path, POD_LEVEL)
    c = sim.controller
    sim.kill_node("node-1")
    sim.tick()
    assert sim.actions() == [("pod-reschedule", "running")]
    (lost,) = sim.said(EventKind.NODE_LOST)
    assert lost.fields["node"] == "node-1"
    assert lost.fields["why"] == "the engine reports the node dead: its agent exited"
    assert [(p.row.node, p.row.generation) for p in c.pods.values()] == [
        ("node-0", 1),
        ("node-2", 2),
    ]
    assert c.node("node-1").state is NodeState.LOST  # type: ignore[union-attr]
    sim.run(0.5)
    assert (1, 2, "node-2") in sim.engine.pods_started()
    assert sorted(starts(sim, 2)) == [(0, None), (1, None)]
    sim.train(2)
    sim.tick()
    assert sim.actions() == [("pod-reschedule", "succeeded")]
    assert [(p.row.schedule_cnt, p.row.proc_start_cnt) for p in c.pods.values()] == [(1, 2), (2, 1)]


def test_a_hang_restarts_in_place_with_the_hang_grace(tmp_path: Path) -> None:
    sim = booted(tmp_path, HANG, labels={"grace-over-time": "30"})
    silent_since = sim.clock.now()  # the last step was reported before
    sim.run(2.5)  # silent for the 2 s window
    assert sim.actions() == [("hang-restart", "running")]
    # found at the first pass after the window: the controller's pass, not a monitor's lag
    assert 2.0 < sim.records()[0].detected_at - silent_since <= 2.0 + 2 * TICK_S
    stops = [m for peer in sim.launchers.values() for m in peer.of(Stop)]
    assert stops and all(m.grace == 5.0 for m in stops)  # hang grace, not the 30 s grace
    sim.run(0.3)
    sim.train(2)
    sim.tick()
    assert sim.actions() == [("hang-restart", "succeeded")]


def test_process_retry_keeps_every_process_and_is_verified_by_a_later_step(
    tmp_path: Path,
) -> None:
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS)
    c = sim.controller
    sim.train(5)
    sim.tick()
    sim.seq += 1
    from relaunch.protocol.messages import ChipReport

    sim.chip_faults["node-1"] = [
        ChipReport(sim.seq, 0, "80E01801", True, "memory-uce", sim.clock.now())
    ]
    sim.tick()
    assert sim.actions() == [("process-retry", "running")]
    update = [m for m in sim.link_peer(0).of(MembershipUpdate) if m.membership.retry]
    assert update and c.job.attempt == 1
    # the rank driving the struck chip (node-1's pod, chip 0) takes model and optimizer from a
    # healthy replica (train.distributed.replica_restore)
    assert update[-1].membership.suspects == (c.spec.procs_per_pod * 1 + 0,)
    assert not any(peer.of(Stop) for peer in sim.launchers.values())
    sim.train(5)
    sim.tick()
    assert sim.actions() == [("process-retry", "running")]  # the same step does not prove it
    sim.train(6)
    sim.tick()
    assert sim.actions() == [("process-retry", "succeeded")]


def test_r30_the_retried_chip_is_healed_so_a_later_crash_restarts_in_place(
    tmp_path: Path,
) -> None:
    """A memory UCE on pod 0's node is retried online; the chip is then healed (the retry asks
    its agent), so a later crash in pod 1 restarts in place. Before: the chip stayed faulty for
    good, and R-31's rank-0 rule sent every later crash to a standby node (seen on a GPU)."""
    from relaunch.protocol.messages import ChipReport

    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS)
    sim.train(5)
    sim.tick()
    sim.seq += 1
    sim.chip_faults["node-0"] = [
        ChipReport(sim.seq, 0, "80E01801", True, "memory-uce", sim.clock.now())
    ]
    sim.tick()
    assert sim.actions() == [("process-retry", "running")]
    assert sim.agents["node-0"].of(Heal)
    sim.run(0.5)
    sim.train(6)
    sim.tick()
    assert sim.actions() == [("process-retry", "succeeded")]
    assert not sim.controller.node("node-0").chip_faults  # type: ignore[union-attr]
    sim.crash(3)
    sim.tick()
    assert sim.actions()[-1] == ("process-in-place", "running")


def test_r30_a_late_report_of_a_step_done_before_the_fault_proves_no_retry(
    tmp_path: Path,
) -> None:
    """A report of step 6, made before the fault but heard after the decision (batched, or held
    by a link that was down), is not progress past the fault: the retry still runs. Before, it
    settled the retry as succeeded while the ranks still waited (seen with a 60 s link loss)."""
    from relaunch.protocol.messages import ChipReport, Progress

    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS)
    c = sim.controller
    sim.train(5)
    sim.tick()
    before = sim.clock.now()
    sim.run(0.2)
    sim.seq += 1
    sim.chip_faults["node-1"] = [
        ChipReport(sim.seq, 0, "80E01801", True, "memory-uce", sim.clock.now())
    ]
    sim.tick()
    assert sim.actions() == [("process-retry", "running")]
    link = c.pods[0].link
    assert link is not None
    c.receive(link.peer, ProgressBatch((Progress(0, 6, c.job.attempt, before),)))
    sim.tick()
    assert sim.actions() == [("process-retry", "running")]
    sim.train(7)
    sim.tick()
    assert sim.actions() == [("process-retry", "succeeded")]


def test_process_in_place_restarts_only_the_crashed_rank(tmp_path: Path) -> None:
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS)
    sim.crash(3)
    sim.tick()
    assert sim.actions() == [("process-in-place", "running")]
    peer = sim.link_peer(1)
    assert [m.ranks for m in peer.of(Start)][-1] == (3,)
    joiners = [m.membership.joiners for m in peer.of(MembershipUpdate)]
    assert joiners[-1] == (3,)
    assert not sim.link_peer(0).of(Stop)
    sim.run(0.2)
    sim.train(2)
    sim.tick()
    assert sim.actions() == [("process-in-place", "succeeded")]


def test_process_reschedule_moves_the_lost_pod_and_its_ranks_join(tmp_path: Path) -> None:
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS)
    c = sim.controller
    sim.kill_node("node-1")
    sim.tick()
    assert sim.actions() == [("process-reschedule", "running")]
    assert [(p.row.node, p.row.generation) for p in c.pods.values()] == [
        ("node-0", 1),
        ("node-2", 2),
    ]
    assert c.job.attempt == 1
    membership = sim.link_peer(0).of(MembershipUpdate)[-1].membership
    assert membership.joiners == (2, 3) and membership.pods == {0: 1, 1: 2}
    sim.run(0.5)
    assert not sim.link_peer(0).of(Stop)  # the healthy pod keeps running
    sim.train(2)
    sim.tick()
    assert sim.actions() == [("process-reschedule", "succeeded")]


def test_r25_ranks_that_waited_for_replacements_are_silent_from_the_recovery_end_on(
    tmp_path: Path,
) -> None:
    """The healthy pod's ranks wait for the moved pod's ranks, silent, for longer than the hang
    window; a replacement's first step (urgent) settles the recovery before the healthy ranks'
    step of the same moment (routine, forwarded a progress interval later) arrives. Their silence
    counts from the recovery's end, not from their last step before the fault (before, the CI's
    busy machine found a hang in that moment, and the job went down to pod level)."""
    sim = booted(tmp_path, {**PROCESS, **HANG}, labels=PROCESS_LABELS)
    sim.kill_node("node-1")
    sim.tick()
    assert sim.actions() == [("process-reschedule", "running")]
    sim.run(5.0)  # past the 2 s hang window: the replacements start, the healthy ranks wait
    sim.train(2, pods={1})
    sim.tick()
    assert sim.actions() == [("process-reschedule", "succeeded")]
    sim.run(0.5)  # the healthy ranks' own step report is on its way
    sim.train(2)
    sim.run(0.5)
    assert sim.actions() == [("process-reschedule", "succeeded")]
    assert [f.kind.value for f in sim.store.faults(sim.job_id)] == ["node-lost"]


def test_scale_in_parks_the_lost_pod_without_a_standby_node(tmp_path: Path) -> None:
    sim = booted(tmp_path, PROCESS, nodes=2, labels=PROCESS_LABELS)
    c = sim.controller
    sim.train(5)
    sim.kill_node("node-1")
    sim.tick()
    assert sim.actions() == [("scale-in", "running")]
    assert c.membership.parked() == {1}
    membership = sim.link_peer(0).of(MembershipUpdate)[-1].membership
    assert membership.world_size == 2 and membership.parked == (1,)
    sim.train(6)
    sim.tick()
    assert sim.actions() == [("scale-in", "succeeded")]


def test_dump_hands_over_to_the_next_level_at_once(tmp_path: Path) -> None:
    annotations = {**UNCONDITIONAL, "recover-strategy": "dump"}
    sim = booted(tmp_path, annotations, labels={"process-recover-enable": "on"})
    sim.crash(1)
    sim.tick()
    assert sim.actions() == [("dump", "succeeded"), ("job-reschedule", "running")]
    sim.run(0.5)
    stops = [m for peer in sim.launchers.values() for m in peer.of(Shutdown)]
    assert stops and all(m.grace == 3.0 for m in stops)  # SIGTERM and the grace: the gasp saves


def test_exit_hands_over_to_the_next_level_at_once(tmp_path: Path) -> None:
    annotations = {**UNCONDITIONAL, "recover-strategy": "exit"}
    sim = booted(tmp_path, annotations, labels={"process-recover-enable": "on"})
    sim.crash(1)
    sim.tick()
    assert sim.actions() == [("exit", "succeeded"), ("job-reschedule", "running")]
    sim.run(0.5)
    sim.train(2)
    sim.tick()
    assert sim.actions()[-1] == ("job-reschedule", "succeeded")


def test_a_fault_on_a_node_the_job_does_not_use_is_ignored_and_nothing_stops(
    tmp_path: Path,
) -> None:
    sim = booted(tmp_path, AUTO)
    c = sim.controller
    sim.chip_fault("node-3", 0, "80E18005", heals=False)
    sim.run(0.3)
    assert sim.actions() == [("ignore", "succeeded")]
    assert c.node("node-3").state is NodeState.FAULTY  # type: ignore[union-attr]
    assert c.job.attempt == 1 and [p.row.generation for p in c.pods.values()] == [1, 1]
    assert not any(peer.of(Stop) or peer.of(Shutdown) for peer in sim.launchers.values())


def test_a_fault_no_level_takes_fails_the_job_then_pods_then_agents_shut_down(
    tmp_path: Path,
) -> None:
    """Without unconditional retry a crash is not an environment fault (R-02): the job fails,
    nothing starts again; at the end every launcher is shut down before any agent, then the
    engine."""
    sim = booted(tmp_path, AUTO)
    c = sim.controller
    sim.crash(3)
    sim.run(0.3)
    assert sim.actions() == [("fail", "failed")]
    assert c.job.status is JobStatus.FAILED and "R-02" in c.job.reason
    assert starts(sim, 2) == [] and len(sim.engine.pods_started()) == 2
    sim.finish()
    shutdowns = [name for name, m in sim.wire if isinstance(m, Shutdown)]
    assert sorted(shutdowns[:2]) == ["launcher-0-g1", "launcher-1-g1"]
    assert sorted(shutdowns[2:]) == [f"agent-node-{i}" for i in range(4)]
    assert sim.engine.calls[-1] == ("shutdown",)


@pytest.mark.parametrize(
    ("ending", "local_dir", "told"),
    [
        ("failed", "/local/ckpt", "/local/ckpt"),
        ("stopped by its terminal's hangup", "/local/ckpt", ""),
        ("stopped by the user", "/local/ckpt", "/local/ckpt"),
        ("failed", None, ""),
    ],
)
def test_a_job_ended_for_good_has_every_agent_remove_its_nodes_local_copies_of_the_job(
    tmp_path: Path, ending: str, local_dir: str | None, told: str
) -> None:
    """The agents' last message says where the job's local checkpoint copies are, for each to
    remove its node's (relaunch.train.local.forget_job), only where the job ended for good: a
    job stopped by a hangup is carried on by `relaunch run --resume`, maybe on the same nodes."""
    from relaunch.controller import lifecycle

    extra = {"local_checkpoint_dir": local_dir} if local_dir else {}
    sim = booted(tmp_path, AUTO, **extra)
    c = sim.controller
    if ending == "failed":
        sim.crash(3)
        sim.run(0.3)
        assert c.job.status is JobStatus.FAILED
        sim.finish()
    else:
        for peer in sim.launchers.values():
            peer.closes_on_shutdown = True
        cause = StopCause.HANGUP if "hangup" in ending else StopCause.CTRL_C
        lifecycle.stop(c, f"stopped by the user ({cause.value})", cause)
    assert len([m for peer in sim.agents.values() for m in peer.of(Shutdown)]) == 4
    said = [
        (n, m)
        for n, m in sim.wire
        if n.startswith("agent") and isinstance(m, ForgetCopies | Shutdown)
    ]
    forget = [ForgetCopies(((told, sim.job_id),))] if told else []
    assert said == [  # each agent told before its Shutdown, which it exits at once removed
        (f"agent-node-{i}", m) for i in range(4) for m in (*forget, Shutdown())
    ]


@pytest.mark.parametrize(
    ("first", "status", "reason", "local_dir", "named"),
    [
        ("succeeded, its controller killed before its last message", JobStatus.SUCCEEDED,
         "every rank exited 0", "/disks/a", True),
        ("failed, its controller killed before its last message", JobStatus.FAILED,
         "no budget left", "/disks/a", True),
        ("stopped by its terminal's hangup", JobStatus.STOPPED, StopCause.HANGUP, "/disks/a",
         False),
        ("running, its controller killed", JobStatus.RUNNING, "", "/disks/a", False),
        ("succeeded, keeping no local copies", JobStatus.SUCCEEDED, "every rank exited 0", None,
         False),
    ],
)  # fmt: skip
def test_the_next_jobs_agents_remove_the_local_copies_of_a_job_whose_agents_never_heard_its_end(
    tmp_path: Path,
    first: str,
    status: JobStatus,
    reason: str | StopCause,
    local_dir: str | None,
    named: bool,
) -> None:
    """Job 1's agents never got its last message (its controller was killed after the job's end
    was written, or a node was lost during it): as each agent of the next job in the same state
    directory joins, it is told to remove its node's copies of job 1 where job 1 ended for good,
    never of a job that may be carried on (`relaunch run --resume`) nor of the job itself."""
    earlier = booted(tmp_path, AUTO, **({"local_checkpoint_dir": local_dir} if local_dir else {}))
    if status is not JobStatus.RUNNING:  # written, and then the controller was killed
        cause = reason if isinstance(reason, StopCause) else None
        earlier.controller.move_job(status, reason=str(reason), cause=cause)
    assert earlier.controller.job.resumable == ("hangup" in first)
    sim = Sim(tmp_path, job_spec(AUTO, local_checkpoint_dir="/disks/b"))
    sim.boot()
    told = [m for peer in sim.agents.values() for m in peer.of(ForgetCopies)]
    assert told == ([ForgetCopies((("/disks/a", earlier.job_id),))] * 4 if named else [])


def test_r32_a_replacement_that_never_progresses_fails_at_wait_reschedule_timeout(
    tmp_path: Path,
) -> None:
    """R-32: the healthy pod trains on, the replacement ranks start but never report a step;
    once wait-reschedule-timeout has passed the recovery failed and the fault goes down the
    ladder, not before. (The hang window and the startup allowance are longer than the wait.)"""
    annotations = {**PROCESS, **UNCONDITIONAL, "wait-reschedule-timeout": "30"}
    sim = booted(
        tmp_path, annotations, labels=PROCESS_LABELS, hang_detect_seconds=120, startup_seconds=120
    )
    sim.kill_node("node-1")
    sim.tick()
    assert sim.actions() == [("process-reschedule", "running")]
    for step in range(2, 30):  # 29 s: pod 0 reports a step every second
        sim.train(step, pods={0})
        sim.run(1.0)
    assert sim.actions() == [("process-reschedule", "running")]
    for step in range(30, 33):
        sim.train(step, pods={0})
        sim.run(1.0)
    actions = sim.actions()
    assert actions[:2] == [("process-reschedule", "failed"), ("dump", "succeeded")], actions
    failed = sim.said(EventKind.RECOVERY_FAILED)
    assert [e.fields["action"] for e in failed] == ["process-reschedule"], failed
    assert "(wait-reschedule-timeout, R-32)" in failed[0].fields["why"]


def test_a_replacement_crashing_again_is_not_taken_for_a_hang_of_the_ranks_that_waited(
    tmp_path: Path,
) -> None:
    """The healthy ranks wait, silent, for the replacement (longer than the hang window); it
    crashes again: that fault is decided (down to the job level), and their silence is not a
    hang fault of its own in the same pass (R-36)."""
    annotations = {**PROCESS, **UNCONDITIONAL, "recover-strategy": "recover-in-place,dump"}
    sim = booted(tmp_path, annotations, labels=PROCESS_LABELS)
    sim.crash(3)
    sim.tick()
    assert sim.actions() == [("process-in-place", "running")]
    sim.run(3.0)  # the 2 s hang window passes; the healthy ranks wait for rank 3
    sim.crash(3)
    sim.tick()
    assert sim.actions() == [
        ("process-in-place", "failed"),
        ("dump", "succeeded"),
        ("job-reschedule", "running"),
    ]
    assert [f.kind.value for f in sim.store.faults(sim.job_id)] == ["process-exit", "process-exit"]
    sim.run(0.5)
    sim.train(2)
    sim.tick()
    assert sim.actions()[-1] == ("job-reschedule", "succeeded")


# -- diagnosis: a hang's stacks, collateral exits (issue 18) ----------------------------------------


def _say(sim: Sim, line: str) -> None:
    """Every running rank of the current attempt prints a line."""
    c = sim.controller
    for pod in c.pods.values():
        if pod.link is None:
            continue
        for rank, observed in pod.link.ranks.items():
            if observed.running and observed.attempt == c.job.attempt:
                c.receive(pod.link.peer, Output(rank, c.job.attempt, line))  # type: ignore[arg-type]


def test_r25_a_restarted_rank_that_prints_before_its_first_step_keeps_its_startup_allowance(
    tmp_path: Path,
) -> None:
    """R-25 in a job whose ranks report steps: a restarted rank is past its startup at its
    first step, not at its first line (ranks print before their rendezvous, which on a busy
    machine outlasts a short hang window: a warm restart was taken for a hang). Silent past
    the startup allowance, it is hung."""
    sim = booted(tmp_path, {**UNCONDITIONAL, **HANG})
    sim.crash(1)
    sim.tick()
    assert sim.actions() == [("job-reschedule", "running")]
    sim.run(0.3)
    _say(sim, "start: resume_step=1")
    sim.run(3.0)  # past the 2 s hang window, inside the 10 s startup allowance
    assert sim.actions() == [("job-reschedule", "running")]
    sim.run(8.0)  # past the startup allowance since the start
    assert [a for a, _ in sim.actions()] == ["job-reschedule", "hang-restart"]


def test_r25_a_rank_of_a_script_without_steps_is_past_its_startup_at_its_first_line(
    tmp_path: Path,
) -> None:
    """A script that reports no steps (no SDK) shows progress only by its output: its first
    line starts the hang window."""
    sim = Sim(tmp_path, job_spec(HANG), nodes=4)
    sim.boot()
    sim.run(0.3)
    _say(sim, "epoch 1")
    sim.run(2.5)  # silent for the 2 s hang window after its line
    assert [a for a, _ in sim.actions()] == ["hang-restart"]


def test_a_hang_waits_for_every_rank_stack_and_names_the_stopped_rank(tmp_path: Path) -> None:
    sim = booted(tmp_path, HANG, labels={"grace-over-time": "30"})
    sim.stacks[2] = waiting_stack(2, state="stopped")
    sim.run(2.5)
    (record,) = sim.records()
    assert (record.fault.kind.value, record.fault.rank, record.fault.pod) == ("hang", 2, 1)
    assert record.evidence is not None and record.evidence["culprits"] == [2]
    # alike stacks once, with their ranks and pids; the stopped rank's alone
    assert [(s["ranks"], s["pids"], s["state"]) for s in record.evidence["stacks"]] == [
        ([0, 1, 3], [5000, 5001, 5003], "sleeping"),
        ([2], [5002], "stopped"),
    ]
    capture = [m for peer in sim.launchers.values() for m in peer.of(CaptureStacks)]
    stops = [m for peer in sim.launchers.values() for m in peer.of(Stop)]
    assert len(capture) == 2 and stops  # both pods asked, then stopped
    first_stop = min(sim.wire.index((p, m)) for p, m in sim.wire if isinstance(m, Stop))
    last_capture = max(sim.wire.index((p, m)) for p, m in sim.wire if isinstance(m, CaptureStacks))
    assert last_capture < first_stop, "stacks are read before anything is stopped"


def test_a_launcher_that_does_not_answer_delays_the_hang_by_at_most_the_capture_time(
    tmp_path: Path,
) -> None:
    sim = booted(tmp_path, HANG, labels={"grace-over-time": "30"})
    sim.mute_stacks.add(1)
    sim.run(2.5)
    assert sim.records() == [], "waiting for pod 1's stacks"
    sim.run(sim.cluster.stack_capture_s + 1.5)
    (record,) = sim.records()
    assert record.fault.kind.value == "hang"
    assert record.evidence is not None and record.evidence["missing_pods"] == [1]
    assert [s["ranks"] for s in record.evidence["stacks"]] == [[0, 1]]


def test_a_launchers_malformed_stack_groups_are_dropped_and_the_hang_decided_on_the_rest(
    tmp_path: Path,
) -> None:
    """Pod 1's launcher answers with a group of no rank and a group whose ranks and pids differ
    in number: those are dropped (the controller does not fail on them), the pod counts as
    answered, and the hang is decided on pod 0's stacks at once."""
    sim = booted(tmp_path, HANG, labels={"grace-over-time": "30"})
    sim.mute_stacks.add(1)
    sim.run(2.5)
    c = sim.controller
    assert c.capture.current is not None and sim.records() == []
    malformed = (StackGroup((), (), "sleeping"), StackGroup((2, 3), (5002,), "stopped"))
    c.receive(sim.link_peer(1), Stacks(c.capture.current.request, c.job.attempt, malformed))
    sim.tick()
    (record,) = sim.records()
    assert record.evidence is not None and record.evidence["missing_pods"] == []
    assert [s["ranks"] for s in record.evidence["stacks"]] == [[0, 1]]
    assert record.evidence["culprits"] == []  # pod 1's "stopped" was not believed


def test_a_crash_during_the_stack_capture_wins_and_the_hang_is_dropped(tmp_path: Path) -> None:
    sim = booted(tmp_path, {**HANG, **UNCONDITIONAL}, labels={"grace-over-time": "30"})
    sim.mute_stacks.update({0, 1})
    sim.run(2.5)
    sim.crash(3)
    sim.run(sim.cluster.stack_capture_s + 1.5)
    kinds = [r.fault.kind.value for r in sim.records()]
    assert kinds == ["process-exit"], kinds
    assert EventKind.HANG_DROPPED in sim.kinds()


def test_exits_after_a_job_level_decision_are_its_collateral_not_new_faults(
    tmp_path: Path,
) -> None:
    """Rank 1 exits; the job is rebuilt (a new attempt); ranks 0 and 3 of the old attempt then
    exit on their own: stored as collateral, one record, one restart."""
    sim = booted(tmp_path, UNCONDITIONAL)
    sim.crash(1)
    sim.tick()
    assert sim.actions() == [("job-reschedule", "running")]
    c = sim.controller
    old = c.job.attempt - 1
    for rank in (0, 3):
        pod = rank // c.spec.procs_per_pod
        c.receive(sim.link_peer(pod) if c.pods[pod].link else sim.launchers[(pod, 1)],
                  Exited(rank, old, 1, None, sim.clock.now()))  # fmt: skip
    sim.tick()
    (record,) = sim.records()
    assert record.action is Action.JOB_RESCHEDULE
    assert sorted(f.rank for f, _ in record.others) == [0, 3]
    assert len(sim.store.faults(sim.job_id)) == 1, "collateral is not decided"


def test_r46_a_crash_in_a_mindspore_job_that_asks_for_process_level_goes_a_level_down(
    tmp_path: Path,
) -> None:
    """The same spec as PyTorch's process-level tests, the framework MindSpore: a crashed rank is
    a job-level restart (unconditional retry), not a process-level replacement."""
    labels = {**PROCESS_LABELS, "framework": "mindspore"}
    sim = booted(tmp_path, {**PROCESS, **UNCONDITIONAL}, labels=labels)
    sim.crash(1)
    sim.tick()
    (record,) = sim.records()
    assert record.action is Action.JOB_RESCHEDULE, record


def feed_looks(sim: Sim, seconds: float, busy: dict[int, float], train: bool = True) -> None:
    """Every tick, each running rank's launcher reports 10 more looks, `busy[pod]` of them busy;
    the job makes progress (`train`) or its ranks are still starting."""
    c = sim.controller
    counts: dict[int, list[int]] = sim.__dict__.setdefault("looks", {})  # cumulative, as sent
    step = c.progress.step or 1
    end = sim.clock.now() + seconds
    while sim.clock.now() < end:
        for pod in c.pods.values():
            link = pod.link
            if link is None:
                continue
            report = {}
            for rank, observed in link.ranks.items():
                if observed.running and observed.attempt == c.job.attempt:
                    seen = counts.setdefault(rank, [0, 0])
                    seen[0] += round(10 * busy[pod.index])
                    seen[1] += 10
                    report[rank] = (seen[0], seen[1])
            c.receive(sim.link_peer(pod.index), ProgressBatch((), (), report))
        step += 1
        if train:
            sim.train(step)  # the job makes progress: it is slow, not hung
        sim.tick()


def slow_sim(tmp_path: Path, annotations: dict[str, str]) -> Sim:
    sim = booted(tmp_path, annotations)
    sim.controller.cluster = replace(sim.cluster, slow_window_s=2.0)
    return sim


def test_a_pod_busy_while_its_peers_wait_is_a_slow_fault_after_one_and_a_half_windows(
    tmp_path: Path,
) -> None:
    sim = slow_sim(tmp_path, AUTO)
    feed_looks(sim, 2.5, {0: 0.2, 1: 0.9})
    assert sim.records() == [], "a full window, then half a window more"
    feed_looks(sim, 1.5, {0: 0.2, 1: 0.9})
    (record,) = sim.records()
    assert (record.fault.kind.value, record.fault.pod, record.fault.node) == ("slow", 1, "node-1")
    assert record.action is Action.IGNORE and "pod-level rescheduling is off" in record.reason
    feed_looks(sim, 5.0, {0: 0.2, 1: 0.9})
    assert len(sim.records()) == 1, "recorded once per attempt"


def test_no_slow_fault_when_every_pod_is_busy_or_during_a_recovery(tmp_path: Path) -> None:
    sim = slow_sim(tmp_path, UNCONDITIONAL)
    feed_looks(sim, 6.0, {0: 0.95, 1: 0.9})
    assert sim.records() == [], "uniformly slow: nobody waits"
    sim.crash(0)
    sim.tick()
    assert sim.actions() == [("job-reschedule", "running")]
    feed_looks(sim, 1.5, {0: 0.2, 1: 0.9})
    assert [r.fault.kind.value for r in sim.records()] == ["process-exit"]


def test_a_slow_link_is_judged_only_a_window_after_every_rank_made_progress(
    tmp_path: Path,
) -> None:
    """A node's probes answered slowly while the ranks start (imports on shared cores delay
    the answers; no training traffic crosses a link yet) are no slow link: the links are
    compared from a slow window after every rank of the attempt made progress, and then found
    after half a window more, as the busy shares are."""
    sim = Sim(tmp_path, job_spec(AUTO), nodes=4)
    sim.boot()
    c = sim.controller
    c.cluster = replace(sim.cluster, slow_window_s=2.0)
    for node in c.agents:
        sim.link_rtt_ms[node] = 6.0 if node == c.pods[1].row.node else 0.4
    sim.run(1.5)  # the ranks start: no step yet (half a window is what a finding needs)
    assert sim.records() == []
    step = 1
    for _ in range(5):  # every rank trains: a window and a half (the window, then half one)
        sim.train(step)
        sim.run(0.5)
        step += 1
    assert sim.records() == []
    for _ in range(3):
        sim.train(step)
        sim.run(0.5)
        step += 1
    (record,) = sim.records()
    assert (record.fault.kind.value, record.fault.pod) == ("slow", 1)
    assert "data link is slow" in record.fault.detail


def test_a_pod_moved_off_a_slow_link_is_judged_on_its_new_node_only_after_it_trained_a_window(
    tmp_path: Path,
) -> None:
    """CI: a pod moved off a degraded link was found slow again on its new node. Its new ranks
    import and restore, busy, while its peer's ranks wait for them; that start is no slowness:
    the pods are compared from a window after every rank, on the nodes its pods hold now, made
    progress, as after the attempt's start."""
    sim = Sim(tmp_path, job_spec(POD_LEVEL, labels={"pod-rescheduling": "on"}), nodes=4)
    sim.boot()
    c = sim.controller
    c.cluster = replace(sim.cluster, slow_window_s=2.0)
    degraded = c.pods[1].row.node
    sim.link_rtt_ms.update({node: 6.0 if node == degraded else 0.4 for node in c.agents})
    step = 1
    while not sim.records() and step < 20:
        sim.train(step)
        sim.run(0.5)
        step += 1
    (record,) = sim.records()
    assert (record.fault.kind.value, record.action) == ("slow", Action.POD_RESCHEDULE)
    sim.link_rtt_ms[degraded] = 0.4  # out of the job (its probes no longer count)
    sim.run(2.0)  # the move: the new pod's launcher says hello, its ranks start
    moved = c.pods[1].row.node
    assert moved != degraded and c.pods[1].link is not None
    feed_looks(sim, 2.5, {0: 0.2, 1: 0.9}, train=False)  # pod 1 imports; pod 0 waits for it
    feed_looks(sim, 6.0, {0: 0.5, 1: 0.5})  # both train alike
    assert len(sim.records()) == 1, [(r.fault.node, r.fault.detail) for r in sim.records()]


def test_a_standby_launchers_node_is_judged_alone_as_the_whole_set_judges_it(
    tmp_path: Path,
) -> None:
    """A standby launcher's hello asks whether its node keeps one by a look at that node alone
    (asking for the whole set made thousands of hellos quadratic): the same answer as the
    whole set's for every kind of node (a pod on it or not, isolated, lost, too few chips, no
    agent), with warm spares on and off."""
    sim = booted(tmp_path, AUTO, nodes=7)
    c = sim.controller
    nodes = sorted(c.nodes)
    c.nodes[nodes[2]] = replace(c.nodes[nodes[2]], state=NodeState.ISOLATED)
    c.nodes[nodes[3]] = replace(c.nodes[nodes[3]], state=NodeState.LOST)
    c.nodes[nodes[4]] = replace(c.nodes[nodes[4]], chips=1)
    del c.agents[nodes[5]]
    reconciler = c.reconciler
    from relaunch.controller import commands

    free = set(commands.free_nodes(c, set()))  # the placement policy's free nodes
    assert free and free != set(nodes)
    for warm in (1, 0):
        c.spec = replace(c.spec, warm_spares=warm)
        assert reconciler.standby_nodes() == (free if warm else set())
        for node in nodes:
            assert reconciler._keeps_standby(node) == (bool(warm) and node in free), (warm, node)


def test_many_pods_taking_standby_launchers_in_one_pass_are_said_in_one_line() -> None:
    """A few pods taking their nodes' standby launchers are said a line each; more than
    ASSUMED_SAID_EACH in one pass, one line (a job-level restart of thousands of pods wrote a
    line each, a sixth of its controller's time)."""
    from types import SimpleNamespace

    from relaunch.controller.reconcile import ASSUMED_SAID_EACH, Reconciler

    said: list[Event] = []

    def event(kind: EventKind, **fields: object) -> None:
        said.append(Event.of(kind, **fields))

    reconciler = Reconciler(SimpleNamespace(event=event))  # type: ignore[arg-type]
    reconciler._said_assumed([(1, "node-2"), (0, "node-0")])
    assert said == [
        Event(EventKind.STANDBY_TAKEN, {"pod": 1, "node": "node-2"}),
        Event(EventKind.STANDBY_TAKEN, {"pod": 0, "node": "node-0"}),
    ]
    said.clear()
    many = [(i, f"node-{i}") for i in range(ASSUMED_SAID_EACH + 1)]
    reconciler._said_assumed(many)
    fields = {"count": ASSUMED_SAID_EACH + 1, "first": 0, "node": "node-0", "last": len(many) - 1}
    assert said == [Event(EventKind.STANDBYS_TAKEN, fields)]
    said.clear()
    reconciler._said_assumed([])
    assert said == []


def test_a_fault_the_policy_ignores_leaves_the_recovery_under_way_alone(tmp_path: Path) -> None:
    """A node no pod uses is lost while the job is rebuilt: the rebuild goes on and is recorded
    as it ends (before: failed, with no MTTR, and goodput counted no recovery at all)."""
    sim = booted(tmp_path, UNCONDITIONAL)
    sim.crash(1)
    sim.tick()
    assert sim.actions() == [("job-reschedule", "running")]
    sim.kill_node("node-3")  # a standby: no pod is on it
    sim.tick()
    assert sim.actions() == [("job-reschedule", "running"), ("ignore", "succeeded")]
    sim.run(0.5)
    sim.train(2)
    sim.tick()
    assert sim.actions() == [("job-reschedule", "succeeded"), ("ignore", "succeeded")]
    rebuild = sim.records()[0]
    assert rebuild.mttr_s is not None and rebuild.mttr_s > 0


def _phase(sim: Sim, pod: int, phase: str) -> None:
    """Every running rank of `pod` says it entered `phase` (as the SDK's datagrams do)."""
    from relaunch.protocol.messages import ProgressBatch, RankPhase

    c = sim.controller
    link = c.pods[pod].link
    assert link is not None
    phases = tuple(
        RankPhase(rank, r.attempt, phase, sim.clock.now())
        for rank, r in link.ranks.items()
        if r.running
    )
    c.receive(link.peer, ProgressBatch((), phases))


def test_r37_only_ranks_that_live_on_hold_process_level_recovery_back(tmp_path: Path) -> None:
    """The lost node's ranks were last heard saving (their launcher, starved of CPU, had not
    yet forwarded the save's end): they are gone, and process-level rescheduling still runs
    (before: passed over, the job rebuilt at pod level, 1 run in 10 beside a noisy neighbour)."""
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS)
    _phase(sim, 1, "checkpoint")
    sim.tick()
    sim.engine.dead.add("node-1")  # the engine saw the node die; its launcher's close comes later
    sim.tick()
    assert sim.actions() == [("process-reschedule", "running")]


def test_r37_a_surviving_rank_that_saves_still_holds_process_level_recovery_back(
    tmp_path: Path,
) -> None:
    """The ranks that live on save for longer than the hang window (2 s here): the lost node's
    fault waits that long for the save (R-37's hold), then goes to the next level down."""
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS)
    _phase(sim, 0, "checkpoint")
    sim.tick()
    sim.engine.dead.add("node-1")
    sim.tick()
    assert sim.actions() == []  # held: the save may end in time
    sim.tick(1.0)
    assert sim.actions() == []
    sim.tick(1.5)
    assert sim.actions() == [("pod-reschedule", "running")]


def test_r37_a_fault_found_during_a_save_waits_for_the_save_and_stays_at_process_level(
    tmp_path: Path,
) -> None:
    """Before: a node lost at the step a checkpoint was taken was rebuilt at pod level (or the
    job failed where no pod could move: CI, elastic scale-in). The survivors' save ends within
    the hang window, and process-level rescheduling runs."""
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS)
    _phase(sim, 0, "checkpoint")
    sim.tick()
    sim.engine.dead.add("node-1")
    sim.tick()
    sim.tick(0.5)
    assert sim.actions() == []
    _phase(sim, 0, "training")
    sim.tick(0.25)  # a held decision looks again within 0.2 s
    assert sim.actions() == [("process-reschedule", "running")]


def test_a_rank_that_failed_while_no_controller_heard_it_is_a_fault_at_adoption(
    tmp_path: Path,
) -> None:
    """Rank 2 exited with code 1 while its launcher's connection was gone (its exit was sent to
    a controller that was dying): the launcher's hello is all that says so. Before: the rank
    counted as exited without a fault, and the job waited forever with nothing running."""
    from relaunch.protocol.messages import LauncherHello, ProcReport
    from tests.controller_sim import FakePeer

    sim = booted(tmp_path, UNCONDITIONAL)
    c = sim.controller
    old = sim.link_peer(1)
    old.closed = True
    c.receive(old, None)
    sim.tick()
    again = FakePeer("launcher-1-again", sim.wire)
    procs = {2: ProcReport(1, 5002, False, 1), 3: ProcReport(1, 5003, True, None)}
    c.receive(again, LauncherHello(sim.job_id, 1, 1, 1011, 1, "node-1", procs=procs))
    sim.tick()
    assert sim.actions() == [("job-reschedule", "running")]
    assert sim.records()[0].fault.rank == 2


def _first_launch_of_pod_1_fails(sim: Sim) -> list[int]:
    """The engine's first start of pod 1's launcher raises (a cgroup removed under it); the
    pods it failed for, as it fails."""
    import subprocess

    real = sim.engine.start_pod
    failed: list[int] = []

    def start_pod(plan: Any) -> int:
        if plan.pod == 1 and not failed:
            failed.append(plan.pod)
            raise subprocess.SubprocessError("Exception occurred in preexec_fn.")
        return real(plan)

    sim.engine.start_pod = start_pod  # type: ignore[method-assign]
    return failed


def test_a_launcher_the_engine_could_not_start_is_started_again_not_fatal(
    tmp_path: Path,
) -> None:
    """The engine's start of a pod's launcher raised (a cgroup removed under it): the controller
    says so and carries on, and starts that launcher again once its launch is overdue. Before:
    the exception ended `relaunch run` with a traceback, the job's pods left without a controller."""
    from relaunch.controller.pods import LAUNCH_RETRY_S

    sim = Sim(tmp_path, job_spec(UNCONDITIONAL), nodes=4)
    failed = _first_launch_of_pod_1_fails(sim)
    sim.boot()
    assert failed == [1]
    assert [(e.fields["pod"], e.fields["node"]) for e in sim.said(EventKind.LAUNCHER_FAILED)] == [
        (1, "node-1")
    ]
    sim.run(LAUNCH_RETRY_S + 0.5)
    assert (1, 1, "node-1") in sim.engine.pods_started()
    sim.train(1)
    sim.tick()
    assert sim.controller.job.status is JobStatus.RUNNING


def test_a_pod_starts_while_another_pods_launcher_is_on_its_way_and_waits_unhung(
    tmp_path: Path,
) -> None:
    """Pod 1's launcher is late (the engine's start failed; asked again after LAUNCH_RETRY_S,
    much longer than the 2 s hang window and the 10 s startup allowance): pod 0, connected, is
    started at once rather than after every pod connected (a job of thousands of pods starts as
    its launchers arrive), and its ranks, waiting in their rendezvous for pod 1's, are not hung
    (R-25). Once pod 1 starts, the window counts from then: a rank silent for it is hung."""
    from relaunch.controller.pods import LAUNCH_RETRY_S

    sim = Sim(tmp_path, job_spec(HANG), nodes=4)
    _first_launch_of_pod_1_fails(sim)
    sim.boot()
    assert [m.attempt for m in sim.launchers[(0, 1)].of(Start)] == [1]
    assert (1, 1) not in sim.launchers
    assert sim.controller.reconciler.started_everywhere(1) is None
    sim.run(LAUNCH_RETRY_S + 0.5)
    assert [m.attempt for m in sim.launchers[(1, 1)].of(Start)] == [1]
    started = sim.controller.reconciler.started_everywhere(1)
    assert started is not None and started > sim.clock.now() - 1
    assert not sim.controller.store.records(sim.controller.job_id)
    assert not {EventKind.HANG_CAPTURING, EventKind.HANG_FOUND} & set(sim.kinds())
    sim.train(1)
    sim.run(1.0)
    assert sim.controller.job.status is JobStatus.RUNNING
    sim.train(2, pods={0})  # pod 1's ranks say nothing more: hung after the window
    sim.run(3.0)
    assert EventKind.HANG_CAPTURING in sim.kinds()


# -- operator-level online recovery --------------------------------------------------------

OP_ENV = {
    "HCCL_OP_RETRY_ENABLE": "L1:1",
    "HCCL_OP_RETRY_PARAMS": "MaxCnt:3, HoldTime:2000, IntervalTime:1000",
}


def collective_failed(sim: Sim, rank: int, step: int, index: int, generation: int) -> None:
    from relaunch.protocol.messages import CollectiveFailed

    c = sim.controller
    pod = rank // c.spec.procs_per_pod
    message = CollectiveFailed(
        rank, c.job.attempt, step, index, generation, "Connection reset by peer", sim.clock.now()
    )
    c.receive(sim.link_peer(pod), message)


def orders(sim: Sim) -> list[tuple[int, tuple[int, int, int]]]:
    return [
        (m.membership.generation, m.membership.operator)
        for m in sim.link_peer(0).of(MembershipUpdate)
        if m.membership.operator is not None
    ]


def test_r29_the_collective_is_issued_again_after_the_hold_once_the_link_is_back(
    tmp_path: Path,
) -> None:
    """Two ranks say collective 1 of step 7 failed (one fault); the first re-issue is due 2 s
    after it, but node-1's data link is still down: skipped. Once it is back the next goes out,
    an order in a new generation naming the collective; a step past it settles the recovery.
    Nothing is stopped or started meanwhile."""
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS, env=OP_ENV)
    c = sim.controller
    sim.train(6)
    sim.tick()
    sim.links_down = {"node-1"}
    sim.tick()
    collective_failed(sim, 3, 7, 1, 1)
    collective_failed(sim, 0, 7, 1, 1)
    sim.tick()
    assert sim.actions() == [("operator-retry", "running")]
    assert len(c.store.faults(c.job_id)) == 1
    sim.run(1.9)
    assert orders(sim) == []  # the hold
    sim.run(0.2)
    assert orders(sim) == [] and sim.said(EventKind.RETRY_HELD)
    sim.links_down = set()
    sim.run(1.0)
    assert orders(sim) == [(2, (7, 1, 2))]
    assert not any(peer.of(Stop) for peer in sim.launchers.values())
    sim.train(7)
    sim.tick()
    assert sim.actions() == [("operator-retry", "succeeded")]


def test_r29_two_ranks_failures_of_different_collectives_heard_in_one_pass_are_one_recovery(
    tmp_path: Path,
) -> None:
    """Rank 0 got past collective 0 of step 7 and failed in collective 1; rank 3 failed in
    collective 0. Both say so before the controller decides (a busy machine delays its loop):
    one operator retry, the other fault its collateral (before: two decisions, the first
    settled failed), and the re-issue starts from the earlier collective."""
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS, env=OP_ENV)
    c = sim.controller
    sim.train(6)
    sim.tick()
    collective_failed(sim, 0, 7, 1, 1)
    collective_failed(sim, 3, 7, 0, 1)
    sim.tick()
    assert sim.actions() == [("operator-retry", "running")]
    assert len(c.store.faults(c.job_id)) == 1
    assert [len(v) for v in c.store.collateral(c.job_id).values()] == [1]
    assert c.store.pending(c.job_id) == []
    sim.run(2.1)
    assert orders(sim) == [(2, (7, 0, 1))]
    sim.train(7)
    sim.tick()
    assert sim.actions() == [("operator-retry", "succeeded")]


def test_r29_a_reissue_that_fails_is_followed_by_the_next_and_spent_goes_to_process_retry(
    tmp_path: Path,
) -> None:
    """Every re-issue fails again (each failure recorded, not decided anew): after 3 (MaxCnt)
    the operator retry failed, and the fault goes on to process-retry (R-30), which forms the
    group anew."""
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS, env=OP_ENV)
    c = sim.controller
    sim.train(6)
    sim.tick()
    collective_failed(sim, 0, 7, 0, 1)
    sim.tick()
    for attempt in (1, 2, 3):
        sim.run(2.0 if attempt == 1 else 1.0)
        generation, order = orders(sim)[-1]
        assert order == (7, 0, attempt)
        collective_failed(sim, 0, 7, 0, generation)
        sim.tick()
    sim.run(1.1)
    assert sim.actions() == [("operator-retry", "failed"), ("process-retry", "running")]
    latest = c.membership.current()
    assert latest is not None and latest.operator is None and not latest.retry
    assert len(c.store.faults(c.job_id)) == 1  # the re-issues' failures: collateral


def test_r29_a_collective_failing_under_another_recovery_is_its_collateral(tmp_path: Path) -> None:
    """Rank 3 crashes; its peers' collectives fail too and say so: recorded as collateral of
    the crash's process-in-place recovery, which goes on undisturbed."""
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS, env=OP_ENV)
    c = sim.controller
    sim.train(6)
    sim.tick()
    sim.crash(3)
    sim.tick()
    assert sim.actions() == [("process-in-place", "running")]
    collective_failed(sim, 0, 7, 0, 1)
    sim.tick()
    assert sim.actions() == [("process-in-place", "running")]
    assert len(c.store.faults(c.job_id)) == 1


def test_r29_a_crash_found_after_the_collective_it_broke_ends_the_operator_retry(
    tmp_path: Path,
) -> None:
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS, env=OP_ENV)
    sim.train(6)
    sim.tick()
    collective_failed(sim, 0, 7, 0, 1)
    sim.tick()
    assert sim.actions() == [("operator-retry", "running")]
    sim.crash(3)
    sim.tick()
    assert sim.actions() == [("operator-retry", "failed"), ("process-in-place", "running")]


def test_r30_a_collective_failed_while_a_link_is_down_reforms_the_group_without_operator_retry(
    tmp_path: Path,
) -> None:
    """Operator retry off: the keeper still says its collective failed (its timeout shorter than
    the outage). Node-1's data link is down, so that is a fault, decided process-retry (R-30):
    the same ranks form the group anew (a blip's ranks would otherwise wait for a group nobody
    re-forms, R-12 recording the blip only once it is over). Nothing is stopped."""
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS)
    c = sim.controller
    sim.train(6)
    sim.tick()
    sim.links_down = {"node-1"}
    sim.tick()
    collective_failed(sim, 3, 7, 0, 1)
    collective_failed(sim, 0, 7, 0, 1)
    sim.tick()
    assert sim.actions() == [("process-retry", "running")]
    (fault,) = c.store.faults(c.job_id)
    assert fault.kind is FaultKind.COLLECTIVE and fault.node == "node-1"
    latest = c.membership.current()
    assert latest is not None and latest.generation == 2 and not latest.retry
    assert latest.operator is None and sorted(latest.ranks) == [0, 1, 2, 3]
    sim.links_down = set()
    sim.run(1.0)
    sim.train(7)
    sim.tick()
    assert sim.actions() == [("process-retry", "succeeded")]
    assert not any(peer.of(Stop) for peer in sim.launchers.values())


def test_r30_a_collective_failed_with_no_link_down_is_a_symptom_on_record_not_a_fault(
    tmp_path: Path,
) -> None:
    """Operator retry off and no link down: a rank's failed collective is what its peer's crash
    did to it, and may be heard before the crash is. It is said once for its pod and decided
    nothing (before, in the R-29 path, it would have re-formed the group around a dead rank); the
    crash is decided as always."""
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS)
    c = sim.controller
    sim.train(6)
    sim.tick()
    collective_failed(sim, 0, 7, 0, 1)
    collective_failed(sim, 1, 7, 0, 1)
    sim.tick()
    assert sim.actions() == [] and c.store.faults(c.job_id) == []
    (said,) = sim.said(EventKind.COLLECTIVE_UNLINKED)
    assert (said.fields["pod"], said.fields["rank"], said.fields["step"]) == (0, 0, 7)
    assert "Connection reset" in said.fields["why"]
    sim.crash(3)
    sim.tick()
    assert sim.actions() == [("process-in-place", "running")]


# -- fencing a silent node ------------------------------------------------------------------


def test_r14_a_silent_nodes_replacements_wait_for_the_last_lease_its_launchers_can_have_heard(
    tmp_path: Path,
) -> None:
    """Node 1 falls silent (cut off, maybe running). The controller renews leases until it finds
    the node lost, then sends that node none: its launcher cannot have heard anything after the
    last one, so its rank is surely stopped a lease, its grace and a margin after it. The
    replacement starts then, not earlier; the bound does not depend on when the cut really
    happened (before: the last heartbeat, or the moment a partition was asked for, which on a
    busy machine came seconds before the helper applied it: the two incarnations overlapped)."""
    sim = booted(tmp_path, AUTO)
    sim.train(5)
    sim.tick()
    sim.silent.add("node-1")
    last_lease = 0.0
    seen = 0

    def leases_to_node_1() -> int:
        return sum(1 for n, m in sim.wire if n == "launcher-1-g1" and isinstance(m, Lease))

    while not sim.records():
        sim.tick()
        if leases_to_node_1() > seen:
            seen, last_lease = leases_to_node_1(), sim.clock.now()
    [record] = sim.records()
    assert record.fault.kind.value == "node-lost" and record.fault.detail.startswith("silent")
    active = sim.controller.recoveries.active
    assert active is not None and active.fence_until is not None
    cluster, grace = sim.cluster, sim.controller.recovery.termination_grace_s
    assert last_lease > record.fault.at + cluster.heartbeat_interval_s  # leases went on after
    expected = last_lease + cluster.lease_s + min(grace, cluster.lease_s) + FENCE_MARGIN_S
    assert active.fence_until == pytest.approx(expected, abs=0.06)
    assert record.state["fence_until"] == active.fence_until  # stored with the plan
    replaced_at = None
    while sim.clock.now() < expected + 2:
        sim.tick()
        if replaced_at is None and any(p == 1 and g == 2 for p, g, _ in sim.engine.pods_started()):
            replaced_at = sim.clock.now()
    assert replaced_at is not None and replaced_at >= active.fence_until
    assert leases_to_node_1() == seen  # none after the loss: the node is fenced


def test_no_engine_call_inside_a_transaction(tmp_path: Path) -> None:
    """Issue 31: a job-level recovery's new attempt asks the engine for rank 0's port (a Ray
    node answers in its own time) before the record's transaction, never while it holds the
    store: every engine call of a pod-level and a job-level recovery is made outside one."""
    sim = booted(tmp_path, POD_LEVEL)
    inside: list[str] = []
    engine = sim.engine
    for name in ("free_port", "start_pod", "kill_node", "node_address", "pod_environment"):
        call = getattr(engine, name)

        def watched(*args: Any, _call: Any = call, _name: str = name) -> Any:
            if sim.store.in_transaction:
                inside.append(_name)
            return _call(*args)

        setattr(engine, name, watched)
    sim.kill_node("node-1")
    sim.tick()
    sim.run(2.0)
    assert sim.actions()[0] == ("pod-reschedule", "running")
    assert ("start_pod", 1, 2, "node-2") in engine.calls
    assert inside == []


def test_a_heal_nobody_can_answer_fails_in_place_at_once_and_the_ladder_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-place's begin finds no agent on the chip's node to heal it: it says why, and the
    recovery driver fails it (one failed record) and decides the fault one level down, without
    the level calling back into the driver from inside its own begin."""
    from relaunch.controller import commands

    sim = booted(tmp_path, UNCONDITIONAL)
    asked = commands.request_heal

    def agent_gone(c: Any, active: Any) -> Any:  # it reported the chip, then went away
        c.agents.pop(active.fault.node, None)
        return asked(c, active)

    monkeypatch.setattr(commands, "request_heal", agent_gone)
    sim.chip_fault("node-1", 0, "80E18005")
    sim.tick()
    assert sim.actions() == [("in-place", "failed")]  # at once: no heal deadline waited for
    sim.tick()
    assert sim.actions() == [("in-place", "failed"), ("isolated-job-reschedule", "running")]
    failed = [(e.fields["action"], e.fields["why"]) for e in sim.said(EventKind.RECOVERY_FAILED)]
    assert failed == [("in-place", "node-1 has no agent to heal the chip")]


def test_a_new_attempts_port_is_free_on_the_node_rank_0_moves_to(tmp_path: Path) -> None:
    """A job-level rebuild that moves pod 0 asks the engine for rank 0's port on pod 0's new
    node (the decision's target), before the record's transaction, not on the node it leaves."""
    sim = booted(tmp_path, UNCONDITIONAL)
    asked: list[str] = []
    port_of = sim.engine.free_port

    def free_port(node: str) -> int:
        asked.append(node)
        return port_of(node)

    sim.engine.free_port = free_port  # type: ignore[method-assign]
    sim.kill_node("node-0")
    sim.tick()
    assert sim.actions() == [("isolated-job-reschedule", "running")]
    rank0_node = sim.controller.pods[0].row.node
    assert rank0_node != "node-0"
    assert asked == [rank0_node]
