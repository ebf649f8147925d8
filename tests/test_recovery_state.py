"""The recovery as a persisted state machine (controller.active): a decided recovery is stored
WAITING with its plan, RUNNING once its level sent what it must, then SUCCEEDED or FAILED. A
controller killed in either phase and resumed carries the recovery on from what it stored:
nothing lost (the ranks it restarts, the step it waits past, its heal, its re-issues), nothing
sent twice, exactly one record. With a fake engine and clock (tests/controller_sim.py); the same
kills end to end, with real processes, are in test_runtime_robustness.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaunch import failpoints
from relaunch.protocol.messages import ChipReport, Heal, MembershipUpdate, Start
from tests.controller_sim import Sim
from tests.test_controller_unit import (
    OP_ENV,
    PROCESS,
    PROCESS_LABELS,
    UNCONDITIONAL,
    booted,
    collective_failed,
)


class Killed(Exception):
    """The controller died here."""


@pytest.fixture
def kill_at(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Put a place in the list: the controller dies there (once)."""
    armed: list[str] = []
    real = failpoints.reach

    def reach(place: str) -> None:
        if place in armed:
            armed.remove(place)
            raise Killed(place)
        real(place)

    monkeypatch.setattr(failpoints, "reach", reach)
    return armed


def die_in(sim: Sim) -> None:
    with pytest.raises(Killed):
        for _ in range(20):
            sim.tick()


def generations(sim: Sim) -> list[int]:
    """The membership generations published, in order, as pod 0's launchers (before and after the
    controller's restart) got them."""
    seen: list[int] = []
    for name, message in sim.wire:
        if (
            name.startswith("launcher-0-")
            and isinstance(message, MembershipUpdate)
            and message.membership.generation not in seen
        ):
            seen.append(message.membership.generation)
    return seen


def starts_of(sim: Sim, rank: int) -> int:
    """How many times a launcher (before or after the controller's restart) was told to start
    `rank`."""
    return sum(
        1
        for name, m in sim.wire
        if name.startswith("launcher-") and isinstance(m, Start) and m.ranks and rank in m.ranks
    )


def uce(sim: Sim, node: str = "node-1") -> None:
    sim.seq += 1
    sim.chip_faults[node] = [
        ChipReport(sim.seq, 0, "80E01801", True, "memory-uce", sim.clock.now())
    ]


def test_a_process_in_place_killed_before_it_sent_anything_is_carried_on_when_resumed(
    tmp_path: Path, kill_at: list[str]
) -> None:
    """Killed at decision-stored: the record is WAITING with the rank to replace. The resumed
    controller publishes the joiners' membership and starts rank 3 (once each), and the
    replacement's progress settles the one record. Before: resumed without its ranks, the
    recovery never saw its proof, failed, and the job was rebuilt (three records)."""
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS, hang_detect_seconds=60)
    sim.train(5)
    sim.tick()
    kill_at.append("decision-stored")
    sim.crash(3)
    die_in(sim)
    [record] = sim.records()
    assert record.phase == "waiting" and record.state["ranks"] == [3]
    assert starts_of(sim, 3) == 0 and generations(sim) == [1]
    sim.restart_controller()
    sim.run(2.5)  # the adoption window
    assert generations(sim) == [1, 2] and starts_of(sim, 3) == 1
    assert sim.records()[0].phase == "running"
    sim.train(6)
    sim.tick()
    assert sim.actions() == [("process-in-place", "succeeded")]
    assert sim.records()[0].phase == "succeeded"


def test_a_process_in_place_resumed_running_sends_nothing_again(tmp_path: Path) -> None:
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS, hang_detect_seconds=60)
    sim.train(5)
    sim.tick()
    sim.crash(3)
    sim.run(0.3)
    assert sim.records()[0].phase == "running" and starts_of(sim, 3) == 1
    sim.restart_controller()
    sim.run(2.5)
    assert generations(sim) == [1, 2] and starts_of(sim, 3) == 1  # nothing twice
    sim.train(6)
    sim.tick()
    assert sim.actions() == [("process-in-place", "succeeded")]


def test_a_process_retry_killed_before_its_membership_keeps_the_step_it_waits_past(
    tmp_path: Path, kill_at: list[str]
) -> None:
    """Before: resumed without `after_step`, any report (even of the step the fault hit) settled
    it `succeeded` although no rank had retried."""
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS, hang_detect_seconds=60)
    sim.train(5)
    sim.tick()
    kill_at.append("decision-stored")
    uce(sim)
    die_in(sim)
    [record] = sim.records()
    assert record.phase == "waiting" and record.state["after_step"] == 5
    sim.restart_controller()
    sim.run(2.5)
    assert generations(sim) == [1, 2]
    sim.train(5)
    sim.tick()
    assert sim.actions() == [("process-retry", "running")]  # the same step proves nothing
    sim.train(6)
    sim.tick()
    assert sim.actions() == [("process-retry", "succeeded")]


def test_a_process_retry_killed_once_its_membership_is_stored_sends_it_with_its_suspects(
    tmp_path: Path, kill_at: list[str]
) -> None:
    """A memory error's online retry names the ranks whose memory it may have touched (the
    suspects, who take model and optimizer from a healthy replica). The controller dies once
    that generation is committed and before any launcher got it: the resumed controller sends
    that same generation, suspects and all, not a new one without them; the retry then settles
    on a step past the one it waits for."""
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS, hang_detect_seconds=60)
    sim.train(5)
    sim.tick()
    kill_at.append("membership-stored")
    uce(sim)  # node-1's chip 0: pod 1's first rank, rank 2
    die_in(sim)
    sent = [m for _, m in sim.wire if isinstance(m, MembershipUpdate)]
    assert all(m.membership.generation == 1 for m in sent), "sent before the kill"
    sim.restart_controller()
    sim.run(2.5)
    assert generations(sim) == [1, 2]
    resent = {
        m.membership.generation: m.membership
        for _, m in sim.wire
        if isinstance(m, MembershipUpdate)
    }
    assert resent[2].retry and resent[2].suspects == (2,), resent[2]
    assert sim.actions() == [("process-retry", "running")]
    sim.train(6)
    sim.tick()
    assert sim.actions() == [("process-retry", "succeeded")]


def test_a_process_reschedule_killed_before_its_membership_publishes_it_on_resume(
    tmp_path: Path, kill_at: list[str]
) -> None:
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS, hang_detect_seconds=60)
    sim.train(5)
    sim.tick()
    kill_at.append("decision-stored")
    sim.kill_node("node-1")
    die_in(sim)
    assert sim.records()[0].state["ranks"] == [2, 3]
    sim.restart_controller()
    sim.run(3.0)
    c = sim.controller
    latest = c.membership.current()
    assert latest is not None and latest.generation == 2 and latest.joiners == (2, 3)
    assert [(p.row.node, p.row.generation) for p in c.pods.values()] == [
        ("node-0", 1),
        ("node-2", 2),
    ]
    sim.train(6)
    sim.tick()
    assert sim.actions() == [("process-reschedule", "succeeded")]


def test_an_in_place_recovery_killed_before_its_heal_asks_for_it_on_resume(
    tmp_path: Path, kill_at: list[str]
) -> None:
    sim = booted(tmp_path, UNCONDITIONAL)
    sim.train(5)
    sim.tick()
    kill_at.append("decision-stored")
    sim.chip_fault("node-1", 0, "80E18005", heals=True)
    die_in(sim)
    assert sim.records()[0].phase == "waiting"
    sim.restart_controller()
    sim.run(3.0)
    assert sim.agents["node-1"].of(Heal)
    sim.train(6)
    sim.tick()
    assert sim.actions() == [("in-place", "succeeded")]


def test_an_in_place_recovery_resumed_while_its_heal_is_unanswered_asks_again(
    tmp_path: Path, kill_at: list[str]
) -> None:
    """Killed once RUNNING (its heal asked, its processes being stopped): the agent's answer went
    to the dead controller. The resumed one asks again (a new request), and the recovery
    succeeds. Before: it waited for an answer that could not come, failed at the heal's
    deadline, and the job was rebuilt at job level."""
    sim = booted(tmp_path, UNCONDITIONAL, heal=1.0)
    sim.train(5)
    sim.tick()
    kill_at.append("stopping")
    sim.chip_fault("node-1", 0, "80E18005", heals=True)
    die_in(sim)
    [record] = sim.records()
    assert record.phase == "running" and record.state["heal"]["ok"] is None
    asked = record.state["heal"]["request"]
    sim.restart_controller()
    sim.run(4.0)
    [again] = sim.agents["node-1"].of(Heal)
    assert again.request > asked
    sim.train(6)
    sim.tick()
    assert sim.actions() == [("in-place", "succeeded")]


def test_an_operator_retry_resumed_keeps_its_schedule_and_its_attempts(tmp_path: Path) -> None:
    """Resumed after its first re-issue went out: the attempts left and the order out are the
    stored ones; the re-issue's failure leads to the second attempt, not the first again."""
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS, env=OP_ENV)
    sim.train(6)
    sim.tick()
    collective_failed(sim, 0, 7, 0, 1)
    sim.run(2.1)
    first = sim.controller.membership.current()
    assert first is not None and first.operator == (7, 0, 1)
    state = sim.records()[0].state["operator"]
    assert state["left"] == 2 and state["order"] == first.generation
    sim.restart_controller()
    sim.run(2.5)
    collective_failed(sim, 0, 7, 0, first.generation)
    sim.run(1.1)
    latest = sim.controller.membership.current()
    assert latest is not None and latest.operator == (7, 0, 2)
    sim.train(7)
    sim.tick()
    assert sim.actions() == [("operator-retry", "succeeded")]


# -- a fault only recorded while a recovery runs, then the controller killed --------------------

HANG = {**UNCONDITIONAL, "fault-tolerance/hang-retry": "true"}
POD_LEVEL = {**UNCONDITIONAL, "fault-tolerance/pod-retry-num": "2"}
ISOLATED = {"fault-tolerance/job-retry-num": "4"}


def _operator_retry(sim: Sim) -> None:
    collective_failed(sim, 0, 6, 0, 1)


LEVELS = {
    # level: (annotations, labels, extra spec, how the fault comes)
    "operator-retry": (PROCESS, PROCESS_LABELS, {"env": OP_ENV}, _operator_retry),
    "process-retry": (PROCESS, PROCESS_LABELS, {}, uce),
    "process-in-place": (PROCESS, PROCESS_LABELS, {}, lambda sim: sim.crash(3)),
    "process-reschedule": (PROCESS, PROCESS_LABELS, {}, lambda sim: sim.kill_node("node-1")),
    "in-place": (
        UNCONDITIONAL,
        {},
        {},
        lambda sim: sim.chip_fault("node-1", 0, "80E18005", heals=True),
    ),
    "hang-restart": (HANG, {}, {"hang_detect_seconds": 2}, lambda sim: sim.run(2.5)),
    "pod-reschedule": (POD_LEVEL, {}, {}, lambda sim: sim.kill_node("node-1")),
    "isolated-job-reschedule": (ISOLATED, {}, {}, lambda sim: sim.kill_node("node-1")),
    "job-reschedule": (UNCONDITIONAL, {}, {}, lambda sim: sim.crash(3)),
}


def alive(sim: Sim, seconds: float) -> None:
    """Time passes with every running rank printing a line a tick: alive, and no step (a job
    that reports steps proves a recovery by a step only)."""
    from relaunch.protocol.messages import Output

    end = sim.clock.now() + seconds
    while sim.clock.now() < end:
        sim.tick()
        for pod in sim.controller.pods.values():
            link = pod.link
            for rank, observed in link.ranks.items() if link is not None else ():
                if observed.running:
                    sim.controller.receive(link.peer, Output(rank, observed.attempt, "..."))


def starts_sent(sim: Sim) -> list[tuple[str, int, tuple[int, ...] | None]]:
    """Every Start on the wire, before and after a controller's restart: (pod and generation,
    attempt, ranks)."""
    return [
        ("-".join(name.split("-")[1:3]), m.attempt, m.ranks)
        for name, m in sim.wire
        if name.startswith("launcher-") and isinstance(m, Start)
    ]


@pytest.mark.parametrize("level", list(LEVELS))
def test_a_recovery_with_a_fault_recorded_during_it_is_resumed_after_a_kill(
    tmp_path: Path, level: str
) -> None:
    """While a recovery runs, a fault is only recorded (a node no pod uses is lost: `ignore`),
    and then the controller is killed. The resumed controller carries the same recovery on:
    one record of it, settled by the job's progress, nothing started twice. Before: the resume
    looked at the newest record only, found the ignore, and left the recovery `running` for
    ever with no one carrying it on (seen under operator-level recovery: the ranks then gave
    up on their group, and the job went down the ladder to a restart)."""
    from tests.controller_sim import job_spec

    annotations, labels, spec, fault = LEVELS[level]
    spec = {"hang_detect_seconds": 60, **spec}
    sim = Sim(tmp_path, job_spec(annotations, labels=labels, **spec), nodes=5)
    sim.boot()
    sim.train(5)
    sim.tick()
    fault(sim)
    alive(sim, 0.5)
    assert sim.actions() == [(level, "running")]
    sim.kill_node("node-4")  # a standby node: lost while the recovery runs, recorded only
    alive(sim, 1.5)
    assert sim.actions() == [(level, "running"), ("ignore", "succeeded")]
    sim.restart_controller()
    alive(sim, 3.5)  # the adoption window, and the recovery carried on
    active = sim.controller.recoveries.active
    assert active is not None and active.action.value == level, sim.events[-5:]
    if level == "operator-retry":
        alive(sim, 2.0)  # the re-issue goes out once the hold is over
    sim.train(7)
    sim.tick()
    assert sim.actions() == [(level, "succeeded"), ("ignore", "succeeded")], sim.events[-8:]
    sent = starts_sent(sim)
    assert len(sent) == len(set(sent)), sent  # nothing started twice


def flap_carried_on(sim: Sim, level: str, kill: str, down_at: float) -> None:
    """The rest of node-1's flap with `level` running: the link back within R-12's 20 s (its
    outage then recorded only: `ignore`), the controller restarted where `kill` says (while the
    link is down, or just after the link-back is recorded)."""
    from relaunch.protocol.messages import LinkReport

    sim.run(1.0)
    assert sim.actions() == [(level, "running")], sim.events[-6:]
    if kill == "link-down":
        sim.restart_controller()
    sim.run(2.5)
    sim.links_down = set()
    sim.link_reports["node-1"] = LinkReport(1, down_at, sim.clock.now() - down_at, "carrier lost")
    sim.tick()
    sim.tick()
    assert sim.actions() == [(level, "running"), ("ignore", "succeeded")]
    if kill == "link-back":
        sim.restart_controller()
    sim.run(3.5)


@pytest.mark.parametrize("kill", ["decision", "link-down", "link-back", "re-issue"])
def test_an_operator_retry_through_a_flap_is_resumed_from_a_kill_at_each_point(
    tmp_path: Path, kill_at: list[str], kill: str
) -> None:
    """R-29 through a real flap's shape: node-1's data link goes down, two ranks' collective
    fails, the link comes back within R-12's 20 s (its outage then recorded only: `ignore`), the
    collective is issued again. The controller killed at each point (once its decision is
    stored, while the link is down, just after the link-back is recorded, with the re-issue
    out) resumes with the one operator retry, settled by the next step: nothing stopped or
    started, no group formed anew for a rollback, no step run twice. Before: killed after the
    link-back's record, the resumed controller took the ignore for the newest recovery, the
    retry stayed `running` for ever, and the ranks gave up on their group."""
    from relaunch.protocol.messages import Stop

    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS, env=OP_ENV, hang_detect_seconds=60)
    sim.train(6)
    sim.tick()
    down_at = sim.clock.now()
    sim.links_down = {"node-1"}
    sim.tick()
    if kill == "decision":
        kill_at.append("decision-stored")
    collective_failed(sim, 3, 7, 1, 1)
    collective_failed(sim, 0, 7, 1, 1)
    if kill == "decision":
        die_in(sim)
        sim.restart_controller()
    flap_carried_on(sim, "operator-retry", kill, down_at)
    orders = [
        m.membership.operator
        for name, m in sim.wire
        if isinstance(m, MembershipUpdate) and m.membership.operator is not None
    ]
    assert orders and orders[-1][:2] == (7, 1), sim.events[-6:]
    if kill == "re-issue":
        sim.restart_controller()
        sim.run(3.0)
    sim.train(7)
    sim.tick()
    assert sim.actions() == [("operator-retry", "succeeded"), ("ignore", "succeeded")]
    assert starts_sent(sim) == [("0-g1", 1, None), ("1-g1", 1, None)]  # the boot's, only
    assert not any(isinstance(m, Stop) for _, m in sim.wire)
    assert not any(
        isinstance(m, MembershipUpdate) and m.membership.retry for _, m in sim.wire
    )  # no rollback (process-retry)


def link_down_at_step_6(tmp_path: Path) -> tuple[Sim, float]:
    """A process-level job (operator retry off) at step 6, node-1's data link down since the
    second returned."""
    sim = booted(tmp_path, PROCESS, labels=PROCESS_LABELS, hang_detect_seconds=60)
    sim.train(6)
    sim.tick()
    down_at = sim.clock.now()
    sim.links_down = {"node-1"}
    sim.tick()
    return sim, down_at


@pytest.mark.parametrize("kill", ["fault-stored", "decision-stored", "link-down", "link-back"])
def test_r30_a_collective_failed_while_a_link_is_down_is_resumed_from_a_kill_at_each_point(
    tmp_path: Path, kill_at: list[str], kill: str
) -> None:
    """R-30 with operator retry off: node-1's data link goes down, two ranks' collectives time
    out and their keepers say so (collective 0), which is a fault while the link is down, decided
    process-retry; the link comes back within R-12's 20 s (its outage recorded only: `ignore`)
    and the group re-forms. The controller killed once the fault is stored (nothing decided
    yet), once the decision is stored, while the link is down, and just after the link-back is
    recorded, resumes with the one process-retry, settled by the next step: nothing stopped or
    started, the group re-formed with every rank."""
    from relaunch.protocol.messages import Stop

    sim, down_at = link_down_at_step_6(tmp_path)
    if kill in ("fault-stored", "decision-stored"):
        kill_at.append(kill)
    collective_failed(sim, 3, 7, 0, 1)
    collective_failed(sim, 0, 7, 0, 1)
    if kill in ("fault-stored", "decision-stored"):
        die_in(sim)
        sim.restart_controller()
    flap_carried_on(sim, "process-retry", kill, down_at)
    latest = sim.controller.membership.current()
    assert latest is not None and sorted(latest.ranks) == [0, 1, 2, 3] and not latest.retry
    assert generations(sim)[-1] == latest.generation == 2  # re-formed once, kill or not
    sim.train(7)
    sim.tick()
    assert sim.actions() == [("process-retry", "succeeded"), ("ignore", "succeeded")]
    assert starts_sent(sim) == [("0-g1", 1, None), ("1-g1", 1, None)]  # the boot's, only
    assert not any(isinstance(m, Stop) for _, m in sim.wire)


def test_r30_collective_reports_lost_with_a_killed_controller_fall_to_the_process_ladder(
    tmp_path: Path,
) -> None:
    """R-30 with operator retry off, the collective reports lost: node-1's link goes down and the
    controller is killed while two ranks' reports are on their way (a datagram, not sent again).
    The resumed controller never hears them: the outage is recorded only (`ignore`, back within
    R-12's 20 s), no process-retry is decided, and the two ranks, told of no new group within
    RELAUNCH_RECOVERY_WAIT, raise GroupLost and exit. Their exits are decided on the process
    ladder, like any: slower than the retry, nothing lost, no job-level restart."""
    from relaunch.protocol.messages import LinkReport

    sim, down_at = link_down_at_step_6(tmp_path)
    sim.restart_controller()  # the reports of ranks 0 and 3 die with it
    sim.run(3.0)
    sim.links_down = set()
    sim.link_reports["node-1"] = LinkReport(1, down_at, sim.clock.now() - down_at, "carrier lost")
    sim.run(2.0)
    assert sim.actions() == [("ignore", "succeeded")], sim.events[-6:]
    sim.crash(3)  # GroupLost: no group within the wait
    sim.crash(0)
    sim.run(3.0)
    sim.train(7)
    sim.tick()
    actions = sim.actions()
    assert {action for action, _ in actions[1:]} <= {"process-reschedule", "process-in-place"}
    assert len(actions) > 1 and actions[-1][1] == "succeeded", actions
    assert {attempt for _, attempt, _ in starts_sent(sim)} == {1}, starts_sent(sim)  # no job-level
    latest = sim.controller.membership.current()
    assert latest is not None and sorted(latest.ranks) == [0, 1, 2, 3]


KILL_MATRIX = {
    # fault: (annotations, how it comes, the level decided, the points a kill is tried at)
    "crash": (
        UNCONDITIONAL,
        lambda sim: sim.crash(3),
        "job-reschedule",
        ("fault-stored", "decision-stored", "stopping", "starting", "recovered"),
    ),
    "chip": (
        UNCONDITIONAL,
        lambda sim: sim.chip_fault("node-1", 0, "80E18005", heals=True),
        "in-place",
        ("fault-stored", "decision-stored", "stopping", "starting", "recovered"),
    ),
    "node": (
        POD_LEVEL,
        lambda sim: sim.kill_node("node-1"),
        "pod-reschedule",
        ("fault-stored", "decision-stored", "stopping", "starting", "recovered"),
    ),
}
"""The kill matrix of test_runtime_robustness.py on the simulator: every failpoint between two
writes of a recovery, for each kind of fault (the real runs keep one kill per mechanism)."""


def _train_until(sim: Sim, step: int, done: object, seconds: float = 30.0) -> None:
    """Time passes with every running rank reporting `step`, until `done()` or `seconds`."""
    end = sim.clock.now() + seconds
    while sim.clock.now() < end and not done():  # type: ignore[operator]
        sim.tick()
        sim.train(step)


@pytest.mark.parametrize(
    ("fault", "point"),
    [(fault, point) for fault, (*_, points) in KILL_MATRIX.items() for point in points],
)
def test_a_controller_killed_at_each_point_of_a_recovery_resumes_with_exactly_one_record(
    tmp_path: Path, kill_at: list[str], fault: str, point: str
) -> None:
    from tests.controller_sim import job_spec

    annotations, strike, level, _ = KILL_MATRIX[fault]
    sim = Sim(tmp_path, job_spec(annotations, hang_detect_seconds=60), nodes=5)
    sim.boot()
    sim.train(5)
    sim.tick()
    kill_at.append(point)
    with pytest.raises(Killed):
        strike(sim)
        _train_until(sim, 6, lambda: False)
    assert kill_at == []  # it died there
    sim.restart_controller()
    _train_until(sim, 7, lambda: sim.actions() == [(level, "succeeded")], seconds=60)
    assert sim.actions() == [(level, "succeeded")], sim.events[-10:]
    sent = starts_sent(sim)
    assert len(sent) == len(set(sent)), sent  # nothing started twice
