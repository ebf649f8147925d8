"""Which tier served each restore, on record (relaunch.restores): the controller's event for a
rank's `Restored`, read back into the report's `restores` and counted in the run's summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaunch.api.metrics import StoreCollector
from relaunch.cli import summary
from relaunch.events import Event, EventKind, Recorded
from relaunch.protocol.datagrams import Restore, RestoreTier, parse_datagram, restored_datagram
from relaunch.protocol.messages import Restored
from relaunch.report import build_report
from relaunch.restores import restores, tiers_text
from tests.builders import AUTO
from tests.test_controller_unit import booted


def restored(at: float, pod: int, rank: int, step: int, tier: RestoreTier, holder: str) -> Recorded:
    """A `restored` event as the store gives it back."""
    event = Event.of(
        EventKind.RESTORED,
        pod=pod,
        rank=rank,
        step=step,
        tier=tier.value,
        holder=holder,
        source=tier.source(holder),
    )
    return Recorded(at, event.kind, event.fields, event.text)


def test_a_restore_event_reads_back_as_written_and_other_events_are_not_restores() -> None:
    decision = Event.of(EventKind.DECISION, summary="job-reschedule: non-zero exit")
    events = [
        restored(1.0, 0, 0, 20, RestoreTier.LOCAL_DISK, "node-0"),
        Recorded(2.0, decision.kind, decision.fields, decision.text),
        restored(3.0, 1, 3, 20, RestoreTier.REPLICA, "1"),
        # a sentence of an older relaunch that reads like one: not a restore (no kind)
        Recorded(4.0, None, {}, "pod 1 rank 1 restored step 20 from storage"),
    ]
    assert restores(events) == [
        {"at": 1.0, "pod": 0, "rank": 0, "step": 20, "tier": "local-disk", "holder": "node-0",
         "source": "local disk of node-0"},
        {"at": 3.0, "pod": 1, "rank": 3, "step": 20, "tier": "replica", "holder": "1",
         "source": "the memory of rank 1, a healthy replica"},
    ]  # fmt: skip


def test_the_tiers_are_counted_whichever_node_or_rank_served() -> None:
    tiers = ("peer-memory", "storage", "peer-memory", "local-disk", "replica")
    found = [{"tier": t} for t in tiers]
    assert tiers_text(found) == (
        "2 from peer memory, 1 from storage, 1 from local disk, 1 from a healthy replica"
    )
    assert tiers_text([]) == ""


@pytest.mark.parametrize(
    "data",
    [b"0 #20 peer-memory node-1", b"3 #7 storage", b"1 #5 replica 0", b"1 #5 local-disk n1"],
)
def test_a_restore_datagram_reads_back_as_sent(data: bytes) -> None:
    rank, step, tier, *holder = data.decode().replace("#", "").split()
    parsed = parse_datagram(restored_datagram(int(rank), int(step), tier, "".join(holder)))
    assert parsed == (int(rank), Restore(int(step), tier, "".join(holder)), None)


def test_a_restore_datagram_of_an_unknown_tier_is_no_restore() -> None:
    assert parse_datagram(b"0 #20 the-cloud node-1") is None


def test_a_ranks_restore_reaches_the_report_and_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real controller records what the ranks' launchers say (the simulator's wire): the
    report lists each restore, the summary and the metrics count them by tier."""
    sim = booted(tmp_path, AUTO)
    c = sim.controller
    for rank, tier, holder in ((0, "peer-memory", "node-1"), (1, "storage", "")):
        message = Restored(rank, c.job.attempt, 20, tier, holder, sim.clock.now())
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
