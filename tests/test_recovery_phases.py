"""The recovery's state machine has one owner (controller.active): every legal phase change is
enumerated here and every other one refused; the outcome a record reports follows from its
phase, written in the same statement; and no other module writes a phase (read from the code)."""

from __future__ import annotations

import ast
from itertools import product
from pathlib import Path

import pytest

from relaunch.controller import active as phases
from relaunch.controller.active import (
    ActiveRecovery,
    IllegalTransition,
    RecoveryPhase,
    move,
    recorded,
    save,
)
from relaunch.faults import Cause, Fault, FaultKind
from relaunch.faults.assessment import Assessment
from relaunch.policy import Action, Decision, JobHistory
from relaunch.states import Outcome
from relaunch.store import Store

W, R, S, F, H = (
    RecoveryPhase.WAITING,
    RecoveryPhase.RUNNING,
    RecoveryPhase.SUCCEEDED,
    RecoveryPhase.FAILED,
    RecoveryPhase.HANDED_OVER,
)
LEGAL = {
    (None, W),  # a recovery that runs: recorded with its plan
    (None, S),  # ignore: done at once
    (None, F),  # fail: done at once
    (None, H),  # dump, exit: done at once, the next level runs
    (W, R),  # its level sent what it must
    (W, F),  # a heal nobody can answer; a newer fault that outranks it before it ran
    (R, S),  # progress proved it, or every rank exited 0
    (R, F),  # a heal that did not heal, no progress within R-32's wait, a newer fault
}
"""Written out by hand from the state diagram in controller/active.py, not read from the table."""

SRC = Path(__file__).resolve().parent.parent / "src" / "relaunch"


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "relaunch.db")


def fault() -> Fault:
    return Fault(FaultKind.PROCESS_EXIT, 10.0, node="node-0", rank=1, exit_code=1)


def decision(action: Action) -> Decision:
    f = fault()
    return Decision(action, "test", Assessment(f, Cause.SOFTWARE, None, False, False, False, ""))


def stored(store: Store, phase: RecoveryPhase | None) -> tuple[int, ActiveRecovery | None]:
    """A job with one fault and, for a phase, a record in it (None: no record yet)."""
    job = store.create_job("phases", {"raw": {}, "source": "test"}, [], 0.0)
    fault_id = store.add_fault(job, fault(), 10.0, "test")
    assert fault_id is not None
    if phase is None:
        return job, None
    active = ActiveRecovery(0, fault(), fault_id, Action.PROCESS_RETRY, frozenset(), 11.0)
    recorded(store, job, fault_id, decision(Action.PROCESS_RETRY), [], {}, 11.0, W, active)
    if phase is W:
        return job, active
    object.__setattr__(active, "_phase", phase)  # put there without the table, to start from
    return job, active


def row(store: Store, job: int) -> tuple[str, Outcome, float | None]:
    (record,) = store.records(job)
    return record.phase, record.outcome, record.mttr_s


@pytest.mark.parametrize(
    ("before", "after"), list(product([None, *RecoveryPhase], list(RecoveryPhase)))
)
def test_every_phase_change_is_legal_exactly_when_listed(
    store: Store, before: RecoveryPhase | None, after: RecoveryPhase
) -> None:
    job, active = stored(store, before)
    legal = (before, after) in LEGAL
    if before is None:
        fault_id = store.add_fault(job, fault(), 12.0, "again")
        assert fault_id is not None
        plan = ActiveRecovery(0, fault(), fault_id, Action.PROCESS_RETRY, frozenset(), 12.0)
        runs = after is W
        if not legal:
            with pytest.raises(IllegalTransition):
                recorded(store, job, fault_id, decision(Action.PROCESS_RETRY), [], {}, 12.0, after)
            assert store.records(job) == []  # nothing written
            return
        recorded(
            store,
            job,
            fault_id,
            decision(Action.PROCESS_RETRY if runs else Action.IGNORE),
            [],
            {},
            12.0,
            after,
            plan if runs else None,
        )
        assert row(store, job)[:2] == (after.value, phases.OUTCOMES[after])
        return
    assert active is not None
    before_row = row(store, job)
    if not legal:
        with pytest.raises(IllegalTransition):
            move(store, active, after)
        assert active.phase is before and row(store, job) == before_row  # nothing written
        return
    resumed = 13.5 if after is S else None
    move(store, active, after, resumed)
    assert active.phase is after
    assert row(store, job) == (after.value, phases.OUTCOMES[after], 3.5 if resumed else None)


def test_the_table_is_the_list_and_every_phase_has_an_outcome() -> None:
    table = {(a, b) for a, targets in phases.TRANSITIONS.items() for b in targets}
    assert table == LEGAL
    assert set(phases.OUTCOMES) == set(RecoveryPhase)
    assert {p for p in RecoveryPhase if phases.OUTCOMES[p] is Outcome.RUNNING} == {W, R}


def test_a_record_under_way_carries_its_plan_and_a_done_one_none(store: Store) -> None:
    job, _ = stored(store, None)
    fault_id = store.add_fault(job, fault(), 12.0, "again")
    assert fault_id is not None
    with pytest.raises(IllegalTransition, match="needs a plan"):
        recorded(store, job, fault_id, decision(Action.PROCESS_RETRY), [], {}, 12.0, W)
    plan = ActiveRecovery(0, fault(), fault_id, Action.IGNORE, frozenset(), 12.0)
    with pytest.raises(IllegalTransition, match="has a plan"):
        recorded(store, job, fault_id, decision(Action.IGNORE), [], {}, 12.0, S, plan)
    assert store.records(job) == []


def test_only_success_resumes_progress(store: Store) -> None:
    _job, active = stored(store, R)
    assert active is not None
    with pytest.raises(IllegalTransition, match="only a recovery that succeeded"):
        move(store, active, F, resumed_at=13.0)
    assert active.phase is R


def test_the_phase_has_no_setter_and_save_keeps_it(store: Store) -> None:
    job, active = stored(store, W)
    assert active is not None
    with pytest.raises(AttributeError):
        active.phase = R  # type: ignore[misc]
    active.ranks = (1,)
    save(store, active)
    (record,) = store.records(job)
    assert (record.phase, record.state["ranks"]) == ("waiting", [1])


def test_a_resumed_controller_carries_on_only_a_recovery_under_way(store: Store) -> None:
    job, active = stored(store, W)
    assert active is not None
    active.ranks = (1, 3)
    move(store, active, R)
    again = ActiveRecovery.resumed(store.records(job)[0])
    assert (again.phase, again.ranks, again.record_id) == (R, (1, 3), active.record_id)
    move(store, again, S, 14.0)
    with pytest.raises(IllegalTransition, match="nothing to carry on"):
        ActiveRecovery.resumed(store.records(job)[0])


PHASE_WRITERS = {"add_record", "set_recovery_phase", "save_recovery_state"}
"""The store's calls that write a recovery's phase or state."""


def test_no_module_but_the_state_machine_writes_a_phase() -> None:
    owner = SRC / "controller" / "active.py"
    store_side = SRC / "store" / "records.py"  # where the calls are defined
    found: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        if path in (owner, store_side):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(SRC)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and node.attr == "_phase":
                found.append(f"{where} touches _phase")
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                if name in PHASE_WRITERS:
                    found.append(f"{where} calls {name}")
                if any(k.arg == "_phase" for k in node.keywords):
                    found.append(f"{where} builds a recovery in a phase")
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value.upper()
                if "UPDATE RECOVERIES" in text and ("PHASE" in text or "OUTCOME" in text):
                    found.append(f"{where} writes the recoveries' phase in SQL")
    assert found == []
    # and the check sees a writer where there is one
    owner_tree = ast.parse(owner.read_text())
    assert any(
        isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "set_recovery_phase"
        for n in ast.walk(owner_tree)
    )


@pytest.mark.parametrize("action", list(Action))
@pytest.mark.parametrize("worked", [True, False])
def test_the_tests_history_reads_as_the_store_builds_it(
    store: Store, action: Action, worked: bool
) -> None:
    """JobHistory.with_decision / with_outcome, which the policy's tests build histories with,
    give every action's record the same outcome as the controller's store: recorded in its
    first phase, then (for one that runs) settled the way it went."""
    job, _ = stored(store, None)
    fault_id = store.add_fault(job, fault(), 12.0, "decided")
    assert fault_id is not None
    made = decision(action)
    runs = action.done_when_recorded is None
    plan = ActiveRecovery(0, fault(), fault_id, action, frozenset(), 12.0) if runs else None
    recorded(store, job, fault_id, made, [], {}, 12.0, phases.first_phase(action, runs), plan)
    tests_history = JobHistory(pods=1).with_decision(made, 12.0)
    assert store.history(job, pods=[]).records[-1].succeeded == (
        tests_history.records[-1].succeeded
    )
    if plan is None:
        return
    move(store, plan, R)
    move(store, plan, S if worked else F, 13.0 if worked else None)
    tests_history = tests_history.with_outcome(worked)
    assert store.history(job, pods=[]).records[-1].succeeded is worked
    assert tests_history.records[-1].succeeded is worked
