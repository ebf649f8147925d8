"""Prometheus metrics, read from the store at each scrape.

The store is the record, so the metrics are derived from it rather than counted in memory: a
server restart loses nothing, and jobs run by `relaunch run` in the same state directory show up
too. Each scrape reads a few small tables.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from relaunch.events import EventKind
from relaunch.report import budgets_left, job_goodput
from relaunch.restores import RestoreTier, restores
from relaunch.store import JobRow, JobStatus, NodeState, RecordRow, Store

__all__ = ["StoreCollector"]

MTTR_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
DETECT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


def _histograms(
    name: str,
    text: str,
    label: str,
    groups: dict[str, list[float]],
    bounds: Sequence[float],
) -> HistogramMetricFamily:
    """One histogram per label value, from the recorded values (cumulative buckets)."""
    family = HistogramMetricFamily(name, text, labels=[label])
    for value, samples in sorted(groups.items()):
        buckets = [(repr(b), float(sum(1 for x in samples if x <= b))) for b in bounds]
        buckets.append(("+Inf", float(len(samples))))
        family.add_metric([value], buckets, float(sum(samples)))
    return family


class StoreCollector(Collector):
    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        jobs = self.store.jobs()
        records = [(job, r) for job in jobs for r in self.store.records(job.id)]
        yield _recoveries(records)
        yield _mttr(records)
        yield _detection(records)
        yield _by_state(
            "relaunch_jobs",
            "Jobs by status.",
            "status",
            [s.value for s in JobStatus],
            (j.status.value for j in jobs),
        )
        yield _by_state(
            "relaunch_nodes",
            "Nodes of the embedded cluster by state.",
            "state",
            [s.value for s in NodeState],
            (n.state.value for n in self.store.nodes()),
        )
        yield self._budgets(jobs)
        yield from self._goodput(jobs)
        yield self._restores()

    def _restores(self) -> CounterMetricFamily:
        """Checkpoint restores, by the tier that served them (relaunch.restores)."""
        family = CounterMetricFamily(
            "relaunch_checkpoint_restores",
            "Checkpoints ranks restored, by the tier that served them.",
            labels=["tier"],
        )
        found = restores(self.store.events_of(EventKind.RESTORED))
        for tier, n in sorted(Counter(RestoreTier(r["tier"]).words for r in found).items()):
            family.add_metric([tier], n)
        return family

    def _goodput(self, jobs: list[JobRow]) -> Iterator[GaugeMetricFamily]:
        """Each job's effective training time ratio and the seconds it lost, by cause."""
        ratio = GaugeMetricFamily(
            "relaunch_job_goodput_ratio",
            "Effective training time ratio: productive time / wall time, per job.",
            labels=["job_id", "job"],
        )
        productive = GaugeMetricFamily(
            "relaunch_job_productive_seconds",
            "Productive training time per job.",
            labels=["job_id", "job"],
        )
        lost = GaugeMetricFamily(
            "relaunch_job_lost_seconds",
            "Time a job lost, by cause (detection, recovery, recomputed, unrecovered, startup).",
            labels=["job_id", "job", "cause"],
        )
        now = time.time()
        for job in jobs:
            if job.status is JobStatus.PENDING:
                continue
            figures = job_goodput(self.store, job, now)
            ratio.add_metric([str(job.id), job.name], figures.ettr)
            productive.add_metric([str(job.id), job.name], figures.productive_s)
            for cause, seconds in figures.lost_s.items():
                lost.add_metric([str(job.id), job.name, cause], seconds)
        yield ratio
        yield productive
        yield lost

    def _budgets(self, jobs: list[JobRow]) -> GaugeMetricFamily:
        budget = GaugeMetricFamily(
            "relaunch_job_budget_remaining",
            "Recovery budget left per unfinished job: job-level restarts, pod reschedules and "
            "unconditional fault retries.",
            labels=["job_id", "job", "budget"],
        )
        for job in jobs:
            if not job.status.ended:
                for name, left in budgets_left(self.store, job).items():
                    budget.add_metric([str(job.id), job.name, name], left)
        return budget


Records = list[tuple[JobRow, RecordRow]]


def _recoveries(records: Records) -> CounterMetricFamily:
    family = CounterMetricFamily(
        "relaunch_recoveries",
        "Recoveries carried out, by action and outcome.",
        labels=["action", "outcome"],
    )
    counts = Counter((r.action.value, r.outcome.value) for _, r in records)
    for (action, outcome), n in sorted(counts.items()):
        family.add_metric([action, outcome], n)
    return family


def _mttr(records: Records) -> HistogramMetricFamily:
    by_action: dict[str, list[float]] = defaultdict(list)
    for _, r in records:
        if r.mttr_s is not None:
            by_action[r.action.value].append(r.mttr_s)
    return _histograms(
        "relaunch_recovery_mttr_seconds",
        "Time from a fault to resumed progress, for recoveries that succeeded.",
        "action",
        by_action,
        MTTR_BUCKETS,
    )


def _detection(records: Records) -> HistogramMetricFamily:
    by_kind: dict[str, list[float]] = defaultdict(list)
    seen: set[tuple[int, int]] = set()
    for job, r in records:
        if (job.id, r.fault_id) in seen:
            continue  # a fallback re-decides the same fault: count its detection once
        seen.add((job.id, r.fault_id))
        by_kind[r.fault.kind.value].append(max(0.0, r.detected_at - r.fault_at))
    return _histograms(
        "relaunch_fault_detection_seconds",
        "Time from a fault to its detection, by fault kind.",
        "kind",
        by_kind,
        DETECT_BUCKETS,
    )


def _by_state(
    name: str, text: str, label: str, states: Sequence[str], values: Iterable[str]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, text, labels=[label])
    counts = Counter(values)
    for state in states:
        family.add_metric([state], counts.get(state, 0))
    return family
