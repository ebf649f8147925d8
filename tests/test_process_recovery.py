"""Process-level recovery (R-30 to R-36) on the PyTorch DDP example, 2 pods x 2 processes: the
healthy ranks keep their processes (PID, MA_PROC_START_CNT) through the recovery, and the job ends
bit-identical to a fault-free run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from relaunch.events import EventKind
from relaunch.store import NodeState, Store
from tests.noisy import noisy_neighbour
from tests.runtime import ROOT, Cluster, Result, wait_gone
from tests.test_controller_restart import query

JOB = yaml.safe_load((ROOT / "examples" / "ddp" / "process-job.yaml").read_text())
CLUSTER = yaml.safe_load((ROOT / "examples" / "cluster-small.yaml").read_text())
SCRIPT = ROOT / "examples" / "ddp" / "train_ddp.py"
START = re.compile(
    r"start: rank (\d+)/4 pid=(\d+) MA_SCHEDULE_CNT=(\d+) MA_PROC_START_CNT=(\d+) "
    r"(resume|joined)_step=(\d+)"
)


def process_job(
    out: Path, ckpt_every: int = 10, strategies: str | None = None, extra: str = ""
) -> dict[str, Any]:
    job = yaml.safe_load(yaml.safe_dump(JOB))
    job["spec"]["command"] = (
        f"python {SCRIPT} --process-recovery --steps 120 --ckpt-every {ckpt_every} --out {out} {extra}"
    )
    if strategies is not None:
        job["metadata"]["annotations"]["recover-strategy"] = strategies
    return job


def starts(result: Result) -> dict[int, list[dict[str, Any]]]:
    """Every process start, per rank, in order: pid, counters, and how it began."""
    found: dict[int, list[dict[str, Any]]] = {}
    for m in START.finditer(result.logs()):
        found.setdefault(int(m[1]), []).append(
            {
                "pid": int(m[2]),
                "schedule_cnt": int(m[3]),
                "proc_start_cnt": int(m[4]),
                "how": m[5],
                "step": int(m[6]),
            }
        )
    for entries in found.values():
        entries.sort(key=lambda e: (e["how"] == "joined", e["step"]))
    return found


def run(
    cluster: Cluster,
    job: dict[str, Any],
    faults: list[dict[str, Any]] | None,
    shape: dict[str, Any] = CLUSTER,
) -> Result:
    result = cluster.run(job, faults, shape, timeout=300, startup_s=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("unbroken-process")
    result = Cluster(tmp).run(
        process_job(tmp / "hash.txt"), None, CLUSTER, timeout=300, startup_s=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.report["recoveries"] == []
    return (tmp / "hash.txt").read_text().strip()


def assert_kept(found: dict[int, list[dict[str, Any]]], ranks: list[int]) -> None:
    """These ranks ran in one process from start to end, never restarted."""
    for rank in ranks:
        assert len(found[rank]) == 1, (rank, found[rank])
        assert found[rank][0]["how"] == "resume" and found[rank][0]["proc_start_cnt"] == 1


KILLED_ONCE_DECIDED = [
    ("process-in-place", [{"kind": "process-exit", "at_step": 40, "pod": 0, "rank": 1}], ""),
]  # fmt: skip
"""One real kill of a process-level recovery once it is decided; the other levels' kills are the
simulator's (tests/test_recovery_state.py: test_a_process_retry_killed_before_its_membership_
keeps_the_step_it_waits_past, test_a_process_reschedule_killed_before_its_membership_publishes_
it_on_resume), and each level's real run is below."""


@pytest.mark.parametrize(
    "level, faults, extra", KILLED_ONCE_DECIDED, ids=[level for level, *_ in KILLED_ONCE_DECIDED]
)
def test_r30_r31_r32_a_controller_killed_once_the_decision_is_stored_carries_the_level_on(
    cluster: Cluster, unbroken: str, level: str, faults: list[dict[str, Any]], extra: str
) -> None:
    """The controller dies (SIGKILL, at the `decision-stored` failpoint) after it stored the
    process-level recovery and before it sent anything; `relaunch run --resume` carries the stored
    recovery on: exactly one record, of the level decided, no job restart spent, and the job ends
    bit-identical. Before: process-in-place ended as three records and a job restart,
    process-reschedule as a pod-reschedule, process-retry `succeeded` with no rank retried."""
    out = cluster.dir / "hash.txt"
    killed = subprocess.run(
        cluster.command(process_job(out, extra=extra), faults, CLUSTER, startup_s=60),
        env={**os.environ, "RELAUNCH_FAILPOINT": "decision-stored"},
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    result = cluster.resume(timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = result.report["recoveries"]
    assert [(r["action"], r["outcome"]) for r in records] == [(level, "succeeded")], records
    assert result.report["restarts_used"] == 0
    if level == "process-retry":
        retried = re.findall(r"rank (\d): retry at step (\d+)", result.logs())
        assert sorted(int(r) for r, _ in retried) == [0, 1, 2, 3]
    assert out.read_text().strip() == unbroken


def test_r30_memory_uce_is_retried_online_by_every_rank(cluster: Cluster, unbroken: str) -> None:
    out = cluster.dir / "hash.txt"
    faults = [{"kind": "memory-uce", "at_step": 40, "pod": 0, "code": "80E01801", "heals": True}]
    result = run(cluster, process_job(out), faults)
    assert result.actions == ["process-retry"]
    assert result.report["recoveries"][0]["outcome"] == "succeeded"
    found = starts(result)
    assert_kept(found, [0, 1, 2, 3])
    retried = re.findall(r"rank (\d): retry at step (\d+), generation 2", result.logs())
    assert sorted(int(r) for r, _ in retried) == [0, 1, 2, 3]
    assert len({step for _, step in retried}) == 1  # every rank re-ran the same step
    # the struck chip's rank took model and optimizer from a healthy replica (step_rollback:
    # replica, the default), on record; no other rank took anything
    restores = result.restores()
    assert [(r.pod, r.rank, r.tier, r.holder) for r in restores] == [(0, 0, "replica", "1")]
    assert out.read_text().strip() == unbroken


def test_r31_only_the_crashed_rank_restarts_in_place(cluster: Cluster, unbroken: str) -> None:
    """Twice: the replacement crashes too, later (same attempt, generation and rank)."""
    out = cluster.dir / "hash.txt"
    faults = [
        {"kind": "process-exit", "at_step": step, "pod": 0, "rank": 1, "exit_code": 1}
        for step in (40, 80)
    ]
    result = run(cluster, process_job(out), faults)
    assert result.actions == ["process-in-place", "process-in-place"]
    assert [r["outcome"] for r in result.report["recoveries"]] == ["succeeded", "succeeded"]
    assert result.report["restarts_used"] == 0 and result.report["pod_restarts_used"] == 0
    found = starts(result)
    assert_kept(found, [0, 2, 3])
    first, replacement, second = found[1]
    assert replacement["how"] == "joined" and 40 <= replacement["step"] < 80
    assert second["how"] == "joined" and second["step"] >= 80
    assert len({first["pid"], replacement["pid"], second["pid"]}) == 3
    assert [p["generation"] for p in result.report["pods"]] == [1, 1]
    assert out.read_text().strip() == unbroken


def test_r34_dump_saves_a_dying_gasp_then_the_job_level_resumes_from_it(
    cluster: Cluster, unbroken: str
) -> None:
    out = cluster.dir / "hash.txt"
    faults = [{"kind": "process-exit", "at_step": 40, "pod": 1, "rank": 3, "exit_code": 1}]
    result = run(cluster, process_job(out, ckpt_every=0, strategies="dump,exit"), faults)
    assert result.actions == ["dump", "job-reschedule"]
    assert "dying gasp saved step" in result.logs()
    found = starts(result)
    resumed = [e["step"] for e in found[0]]
    assert resumed[0] == 0 and resumed[1] >= 40  # no periodic checkpoint: the gasp it is
    assert out.read_text().strip() == unbroken


ELASTIC_CLUSTER = {**CLUSTER, "nodes": 3}
ELASTIC = "retry,recover-in-place,recover,elastic-training,dump,exit"


def elastic_cluster(cluster: Cluster) -> None:
    """Three nodes, the third held back (isolated): a lost node leaves no standby."""
    store = Store(cluster.state / "relaunch.db")
    store.ensure_nodes([(f"node-{i}", 2) for i in range(3)])
    store.set_node_state("node-2", NodeState.ISOLATED, "held back by the test", 0.0)
    store.close()


def scaled_in(cluster: Cluster) -> str:
    """The job through a lost node with no standby: it goes on at world size 2; its hash."""
    elastic_cluster(cluster)
    out = cluster.dir / "hash.txt"
    faults = [{"kind": "node-down", "at_step": 40, "pod": 1}]
    result = cluster.run(
        process_job(out, strategies=ELASTIC), faults, ELASTIC_CLUSTER, timeout=300, startup_s=60
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.actions == ["scale-in"]
    assert result.report["recoveries"][0]["isolated_nodes"] == ["node-1"]
    found = starts(result)
    assert_kept(found, [0, 1])
    assert re.findall(
        r"rank (\d): rejoin at step \d+, generation 2, now rank \d of 2", result.logs()
    )
    assert not wait_gone(cluster.state, timeout=5)
    return out.read_text().strip()


def test_r33_scale_in_continues_at_the_smaller_world_size_the_same_way_twice(
    tmp_path: Path,
) -> None:
    """Two runs side by side (their own state, nodes and cgroups), the same hash."""
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(scaled_in, [Cluster(tmp_path / n) for n in ("first", "second")])
    assert first == second


def scale_in_then_release(
    cluster: Cluster, job: dict[str, Any], faults: list[dict[str, Any]]
) -> Result:
    """`relaunch run` of `job` on the elastic cluster; once a recovery (the scale-in) has
    worked, node-2 is released (`relaunch release`), and the run goes on to its end."""
    running = subprocess.Popen(
        cluster.command(job, faults, ELASTIC_CLUSTER, startup_s=60),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 120
        while not query(cluster.state, "SELECT 1 FROM recoveries WHERE outcome = 'succeeded'"):
            assert time.time() < deadline and running.poll() is None, "no scale-in"
            time.sleep(0.2)
        released = subprocess.run(
            [sys.executable, "-m", "relaunch", "release", "node-2", "--state-dir", str(cluster.state)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert released.returncode == 0, released.stderr
        stdout, stderr = running.communicate(timeout=240)
    finally:
        if running.poll() is None:
            running.kill()
    result = cluster.result(running.returncode, stdout, stderr)
    assert result.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return result


def test_r33_scale_out_when_a_node_comes_back(cluster: Cluster) -> None:
    elastic_cluster(cluster)
    out = cluster.dir / "hash.txt"
    faults = [{"kind": "node-down", "at_step": 40, "pod": 1}]
    job = process_job(out, strategies=ELASTIC)
    job["spec"]["command"] = job["spec"]["command"].replace("--steps 120", "--steps 200")
    result = scale_in_then_release(cluster, job, faults)
    assert result.actions == ["scale-in"]
    assert [(e.fields["pod"], e.fields["node"]) for e in result.said(EventKind.SCALED_OUT)] == [
        (1, "node-2")
    ]
    found = starts(result)
    assert_kept(found, [0, 1])
    for rank in (2, 3):
        assert [e["how"] for e in found[rank]] == ["resume", "joined"]
    assert re.findall(r"rank 0: rejoin at step \d+, generation 3, now rank 0 of 4", result.logs())
    pods = result.report["pods"]
    assert [(p["node"], p["generation"]) for p in pods] == [("node-0", 1), ("node-2", 2)]
    assert out.read_text().strip()


def test_r31_r32_warm_spares_replace_a_crashed_rank_then_a_lost_nodes_pod(
    cluster: Cluster, unbroken: str
) -> None:
    """spec.warm_spares: 2 keeps two spare processes (torch imported) in each pod and on each
    standby node. A crashed rank becomes a pod spare; a pod moved off a lost node is taken by the
    standby node's launcher, whose spares become both its ranks. Three nodes: one standby (each
    spare imports torch; a fourth node's would be two more on the tests' two cores). No rank
    template: where a pod's spare is still importing at the crash (a busy machine), a ready
    template would fork the rank instead (launcher.ranks.rank_source, tested on its own)."""
    out = cluster.dir / "hash.txt"
    job = process_job(out)
    job["spec"]["warm_spares"] = 2
    job["spec"]["env"] = {**job["spec"].get("env", {}), "RELAUNCH_RANK_TEMPLATE": "0"}
    faults = [
        {"kind": "process-exit", "at_step": 40, "pod": 1, "rank": 3, "exit_code": 1},
        {"kind": "node-down", "at_step": 80, "pod": 1},
    ]
    result = run(cluster, job, faults, {**CLUSTER, "nodes": 3})
    assert result.actions == ["process-in-place", "process-reschedule"]
    took = [(e.fields["pod"], e.fields["node"]) for e in result.said(EventKind.STANDBY_TAKEN)]
    assert (1, "node-2") in took, result.events()
    found = starts(result)
    assert_kept(found, [0, 1])
    spare = re.compile(r"--- relaunch: attempt 1, MA_PROC_START_CNT=1, warm spare pid (\d+) ---")
    pods = cluster.state / "jobs" / "1" / "pods"
    in_place = spare.findall((pods / "pod-1-g1" / "logs" / "rank-3.log").read_text())
    assert [e["how"] for e in found[3]] == ["resume", "joined", "joined"]
    # a pod spare became rank 3 (its first start may have taken one too: one ready at the start)
    assert found[3][1]["pid"] in {int(pid) for pid in in_place}
    for rank in (2, 3):
        moved = spare.findall((pods / "pod-1-g2" / "logs" / f"rank-{rank}.log").read_text())
        assert found[rank][-1]["pid"] == int(moved[0])  # the standby node's spares became them
        assert found[rank][-1]["schedule_cnt"] == 2
    assert [(p["node"], p["generation"]) for p in result.report["pods"]] == [
        ("node-0", 1),
        ("node-2", 2),
    ]
    assert out.read_text().strip() == unbroken


def test_r37_a_fault_while_a_checkpoint_is_saved_goes_to_the_next_level(
    cluster: Cluster, unbroken: str
) -> None:
    """The ranks report that they are saving (the SDK's CheckpointManager), for longer than
    the hang window (4 s) the fault waits for a save to end; a memory UCE then is not retried
    online (R-30) but goes down to in-place recovery (R-37), and the job still ends
    bit-identical."""
    out = cluster.dir / "hash.txt"
    faults = [
        {"kind": "memory-uce", "at_step": 40, "while_saving": True, "pod": 0, "code": "80E01801"}
    ]  # while_saving: step 40's report may reach the controller well before the save begins
    job = process_job(out, ckpt_every=40, extra="--slow-save-at 40 --slow-save-s 7")
    result = run(cluster, job, faults)
    assert result.actions == ["in-place"], result.stdout[-3000:]
    decided = [e for e in result.said(EventKind.DECISION) if e.fields["action"] == "in-place"]
    assert decided and "a checkpoint is being saved (R-37)" in decided[0].fields["passed_over"]
    assert out.read_text().strip() == unbroken


def test_r25_r32_process_reschedule_beside_a_disk_writer_and_a_cpu_hog(
    cluster: Cluster, unbroken: str
) -> None:
    """A lost node moves one pod; the other keeps running (R-32). On a busy machine (another
    job writes and fsyncs on the same disk, both cores are taken), the replacement's checkpoint
    saves are slow: it is saving, not hung, and its peers wait for it (before: declared hung 2
    runs in 3, and the job failed)."""
    out = cluster.dir / "hash.txt"
    job = process_job(out, ckpt_every=5)
    with noisy_neighbour(cluster.dir / "neighbour"):
        result = run(cluster, job, [{"kind": "node-down", "at_step": 42, "pod": 1}])
    assert result.actions == ["process-reschedule"], result.stdout[-3000:]
    record = result.report["recoveries"][0]
    assert record["isolated_nodes"] == ["node-1"] and record["outcome"] == "succeeded"
    # the lost node's pod moved; the other pod's ranks kept their processes
    found = starts(result)
    assert_kept(found, [0, 1])
    for rank in (2, 3):
        assert [e["how"] for e in found[rank]] == ["resume", "joined"]
        assert found[rank][1]["schedule_cnt"] == 2
    pods = result.report["pods"]
    assert [(p["node"], p["generation"]) for p in pods] == [("node-0", 1), ("node-2", 2)]
    # the moved ranks' state came from a healthy rank's memory, and the record says so
    restores = sorted(result.restores())
    assert [(r.pod, r.rank, r.tier, r.holder) for r in restores] == [
        (1, 2, "replica", "0"),
        (1, 3, "replica", "0"),
    ]
    assert out.read_text().strip() == unbroken
