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
