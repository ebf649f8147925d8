"""Which tier served each restore, on record (relaunch.restores): the controller's event for a
rank's `Restored`, read back into the report's `restores` and counted in the run's summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaunch.api.metrics import StoreCollector
from relaunch.cli import summary
from relaunch.protocol.messages import Restored
from relaunch.report import build_report
from relaunch.restores import restore_event, restores, tiers_text
from tests.builders import AUTO
from tests.test_controller_unit import booted


def test_a_restore_event_reads_back_as_written_and_other_events_are_not_restores() -> None:
    events = [
        (1.0, restore_event(0, 0, 20, "local disk of node-0")),
        (2.0, "decision: job-reschedule: non-zero exit"),
        (3.0, restore_event(1, 3, 20, "the memory of rank 1, a healthy replica")),
        (4.0, "pod 1 rank 1 restored step x from storage"),  # not a step: not a restore
    ]
    assert restores(events) == [
        {"at": 1.0, "pod": 0, "rank": 0, "step": 20, "source": "local disk of node-0"},
        {"at": 3.0, "pod": 1, "rank": 3, "step": 20,
         "source": "the memory of rank 1, a healthy replica"},
    ]  # fmt: skip


def test_the_tiers_are_counted_whichever_node_or_rank_served() -> None:
    sources = (
        "peer memory of node-2", "storage", "peer memory of node-3", "local disk of n1",
        "the memory of rank 1, a healthy replica",
    )  # fmt: skip
    found = [{"source": s} for s in sources]
    assert tiers_text(found) == (
        "2 from peer memory, 1 from storage, 1 from local disk, 1 from a healthy replica"
    )
    assert tiers_text([]) == ""


def test_a_ranks_restore_reaches_the_report_and_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real controller records what the ranks' launchers say (the simulator's wire): the
    report lists each restore, the summary and the metrics count them by tier."""
    sim = booted(tmp_path, AUTO)
    c = sim.controller
    for rank, source in ((0, "peer memory of node-1"), (1, "storage")):
        message = Restored(rank, c.job.attempt, 20, source, sim.clock.now())
        c.receive(sim.link_peer(rank // c.spec.procs_per_pod), message)
    sim.tick()
    report = build_report(sim.store, sim.job_id, now=sim.clock.now())
    assert [(r["pod"], r["rank"], r["step"], r["source"]) for r in report["restores"]] == [
        (0, 0, 20, "peer memory of node-1"),
        (1 // c.spec.procs_per_pod, 1, 20, "storage"),
    ]
    summary.print_summary(report)
    assert "checkpoints restored: 1 from peer memory, 1 from storage" in capsys.readouterr().out
    (family,) = [
        f for f in StoreCollector(sim.store).collect() if f.name == "relaunch_checkpoint_restores"
    ]  # /metrics: every job's restores in the state directory, by tier
    assert {s.labels["tier"]: s.value for s in family.samples} == {"peer memory": 1, "storage": 1}
