"""R-21 and R-24 at the joints of the ladder: "three unconditional reschedules (restarts upon
suspension) in a row, the fourth fails"
holds whatever levels each fault falls through first (process-level in place, dump, a warm
spare, elastic scale-in), and a finer recovery has worked only when the job made progress past
its fault. The script of these tests fails at import on every start, as a user's broken script
does: each rank prints its traceback's lines and exits 1. On the controller simulator with its
fake clock (tests/controller_sim.py); the same script runs end to end in test_runtime_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaunch.protocol.messages import Exited, Output
from relaunch.store import JobStatus
from tests.controller_sim import LADDERS, MINDCLUSTER, Sim, job_spec


def broken_script_sim(tmp: Path, ladder: str) -> Sim:
    annotations, labels, spec = LADDERS[ladder]
    sim = Sim(tmp, job_spec(annotations, labels=labels, replicas=2, **spec), nodes=4)
    sim.boot()
    return sim


def fail_at_import(sim: Sim, seconds: float = 120.0, broken: set[int] | None = None) -> None:
    """Every rank that starts (of `broken`, all when None) prints its traceback and exits 1, a
    tick after it started; the others print a line every tick (a script that reports no
    steps)."""
    crashed: set[tuple[int, int, float]] = set()
    end = sim.clock.now() + seconds
    while sim.clock.now() < end and not sim.controller.job.status.ended:
        sim.tick()
        c = sim.controller
        for pod in list(c.pods.values()):
            link = pod.link
            if link is None:
                continue
            for rank, observed in list(link.ranks.items()):
                key = (rank, observed.attempt, observed.started_at)
                if not observed.running or key in crashed:
                    continue
                if broken is not None and rank not in broken:
                    c.receive(link.peer, Output(rank, observed.attempt, "working"))
                    continue
                crashed.add(key)
                for line in ("Traceback (most recent call last):", "ImportError: no module"):
                    c.receive(link.peer, Output(rank, observed.attempt, line))
                c.receive(link.peer, Exited(rank, observed.attempt, 1, None, sim.clock.now()))


@pytest.mark.parametrize("ladder", sorted(LADDERS))
def test_r21_three_in_a_row_then_fail_on_every_ladder(tmp_path: Path, ladder: str) -> None:
    """The always-failing script: exactly three job-level restarts, then the job fails as a user
    code error, however many finer levels each fault tried before its job-level restart."""
    sim = broken_script_sim(tmp_path, ladder)
    fail_at_import(sim)
    job = sim.controller.job
    records = sim.records()
    actions = [(r.action.value, r.outcome.value) for r in records]
    assert job.status is JobStatus.FAILED, actions
    assert [a for a, _ in actions].count("job-reschedule") == 3, actions
    assert actions[-1] == ("fail", "failed"), actions
    assert "user code error (R-21)" in job.reason, job.reason


@pytest.mark.parametrize("ladder", ["process-level", "warm-spares", "elastic"])
def test_r21_a_process_level_recovery_without_progress_has_not_worked(
    tmp_path: Path, ladder: str
) -> None:
    """A rank restarted in place that prints and dies at import did not recover its fault: no
    process-level record of the broken script is settled succeeded."""
    sim = broken_script_sim(tmp_path, ladder)
    fail_at_import(sim)
    process = [r for r in sim.records() if r.action.process_level]
    assert process, "the process-level ladder was never tried"
    finer = [r for r in process if not r.action.hands_over]
    assert all(r.outcome.value == "failed" for r in finer), [
        (r.action.value, r.outcome.value) for r in process
    ]


@pytest.mark.parametrize("ladder", ["process-level", "warm-spares", "elastic"])
def test_r21_one_rank_broken_at_import_is_no_process_level_success(
    tmp_path: Path, ladder: str
) -> None:
    """One rank dies at import on every start while its peers run and print: its restart in
    place prints a traceback, which is no progress past the fault. Before: each restart
    counted as worked at its first line, the next exit was a new fault, and the restarts went
    on until max_restarts (32,767), never reaching job level."""
    sim = broken_script_sim(tmp_path, ladder)
    fail_at_import(sim, broken={3})
    records = sim.records()
    actions = [(r.action.value, r.outcome.value) for r in records]
    assert sim.controller.job.status is JobStatus.FAILED, actions
    assert ("process-in-place", "succeeded") not in actions, actions
    assert [a for a, _ in actions].count("job-reschedule") == 3, actions
    assert "user code error (R-21)" in sim.controller.job.reason


def test_r21_a_script_broken_at_import_under_process_level_recovery_end_to_end(
    tmp_path: Path,
) -> None:
    """One real run of the issue's case: a script that raises at import on every start, 2 pods,
    job-retry-num 8 with unconditional retry, MindCluster's process-level recovery on. Exactly
    three job-level restarts, each fault trying process-in-place and dump first, then the job
    fails naming the user's code and its error. Before: 38 to 43 records, the whole budget of
    8 spent, "restart budget spent (R-26)"."""
    from tests.runtime import Cluster

    script = tmp_path / "broken.py"
    script.write_text("print('starting', flush=True)\nimport no_such_module_anywhere\n")
    job = {
        "kind": "job",
        "metadata": {
            "name": "broken",
            "annotations": {
                **LADDERS["process-level"][0],
            },
            "labels": {**MINDCLUSTER, "fault-scheduling": "grace", "grace-over-time": "1"},
        },
        "spec": {
            "replicas": 2,
            "procs_per_pod": 1,
            "chips_per_pod": 1,
            "command": f"python {script}",
            "hang_detect_seconds": 5,
        },
    }
    result = Cluster(tmp_path).run(job, timeout=300)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    report = result.report
    assert report["restarts_used"] == 3
    assert result.actions.count("job-reschedule") == 3 and result.actions[-1] == "fail"
    assert "user code error (R-21)" in report["reason"]
    assert "ModuleNotFoundError" in report["reason"]
    process = [r for r in report["recoveries"] if r["action"] == "process-in-place"]
    assert process and all(r["outcome"] == "failed" for r in process)


HANG_RETRY = {"fault-tolerance/hang-retry": "true", "fault-tolerance/job-retry-num": "3"}


@pytest.mark.parametrize("ladder", sorted(LADDERS))
def test_r24_a_job_that_hangs_at_every_start_fails_after_three_hang_restarts_on_every_ladder(
    tmp_path: Path, ladder: str
) -> None:
    """Seed 001's restart upon suspension, three in a row: a script that hangs at every start
    (no step, no line, ever) is restarted upon suspension three times, and its fourth hang fails
    the job naming R-24, on every ladder. Before: the second hang was taken for the first
    restart's own failure (it never progressed), and the job failed after one restart with "no
    recovery is enabled for this fault"."""
    annotations, labels, spec = LADDERS[ladder]
    annotations = {**annotations, **HANG_RETRY}
    job = job_spec(annotations, labels=labels, replicas=2, hang_detect_seconds=3, **spec)
    sim = Sim(tmp_path, job, nodes=4)
    sim.boot()
    sim.run(120)
    actions = [(r.action.value, r.outcome.value) for r in sim.records()]
    assert sim.controller.job.status is JobStatus.FAILED, actions
    assert [a for a, _ in actions if a != "fail"] == ["hang-restart"] * 3, actions
    assert actions[-1] == ("fail", "failed"), actions
    assert "in a row (R-24)" in sim.controller.job.reason, sim.controller.job.reason
    assert all(not r.consumed for r in sim.records()), "a hang restart spends no budget"


def test_r24_restarts_that_trained_and_restarts_that_never_did_make_one_row(
    tmp_path: Path,
) -> None:
    """The row counts hangs, whether the restart between them trained or not (R-24's row, as
    test_ladder_sequences.py's hangs between steps): a restart that trained, then restarts that
    never progress, are three restarts in all, then the job fails."""
    sim = Sim(tmp_path, job_spec(HANG_RETRY, hang_detect_seconds=3), nodes=4)
    sim.boot()
    while not sim.records():  # hangs at its first start: one restart upon suspension
        sim.tick()
    for step in range(1, 30):  # the restart trains, then hangs again for good
        sim.run(0.2)
        sim.train(step)
    sim.run(120)
    actions = [(r.action.value, r.outcome.value) for r in sim.records()]
    assert actions == [
        ("hang-restart", "succeeded"),
        ("hang-restart", "failed"),
        ("hang-restart", "failed"),
        ("fail", "failed"),
    ], actions
    assert "in a row (R-24)" in sim.controller.job.reason
