"""The commands that read the record: jobs, describe, logs, nodes, cordon, release."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.runtime import AUTO, ROOT, Cluster, toy_job, wait_gone


def relaunch(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relaunch", *args, "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )


def test_record_commands_on_a_finished_run(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    faults = [{"kind": "chip-fault", "at_step": 8, "pod": 0, "chip": 0, "code": "80E3A201"}]
    result = cluster.run(toy_job(AUTO, steps=24), faults)
    assert result.returncode == 0, result.stdout
    assert not wait_gone(cluster.state, 5)
    state = cluster.state

    jobs = relaunch(state, "jobs")
    assert jobs.returncode == 0 and "e2e" in jobs.stdout and "Succeeded" in jobs.stdout

    described = relaunch(state, "describe", "e2e", "-o", "json")
    report = json.loads(described.stdout)
    assert report["recoveries"][0]["action"] == "isolated-job-reschedule"
    assert report == json.loads((tmp_path / "report.json").read_text())
    table = relaunch(state, "describe", "1")
    assert "Fault recovery details" in table.stdout and "isolated-job-reschedule" in table.stdout

    logs = relaunch(state, "logs", "e2e", "--pod", "1", "--rank", "3")
    assert logs.returncode == 0 and "start: rank 3/4" in logs.stdout and "done:" in logs.stdout
    assert relaunch(state, "logs", "e2e", "--pod", "7").returncode == 2
    assert relaunch(state, "describe", "nope").returncode == 2

    nodes = relaunch(state, "nodes")
    assert "node-0" in nodes.stdout and "Isolated" in nodes.stdout
    assert relaunch(state, "release", "node-0").returncode == 0
    assert "Isolated" not in relaunch(state, "nodes").stdout
    assert relaunch(state, "cordon", "node-3").returncode == 0
    assert "cordoned" in relaunch(state, "nodes").stdout
    assert relaunch(state, "cordon", "node-9").returncode == 2


def test_a_cordoned_node_gets_no_pod(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    cluster.state.mkdir(parents=True)
    first = cluster.run(toy_job(AUTO, steps=5))
    assert first.returncode == 0
    assert relaunch(cluster.state, "cordon", "node-0").returncode == 0
    second = cluster.run(toy_job(AUTO, steps=5))
    assert second.returncode == 0, second.stdout
    assert [p["node"] for p in second.report["pods"]] == ["node-1", "node-2"]
    assert not wait_gone(cluster.state, 5)


def test_a_job_the_cluster_has_no_room_for_is_a_one_line_error(tmp_path: Path) -> None:
    """Three of four nodes cordoned: the job's two pods do not fit. A user-facing failure
    (relaunch.errors.NoRoom, exit 2, one line), not a traceback."""
    cluster = Cluster(tmp_path)
    assert cluster.run(toy_job(AUTO, steps=3)).returncode == 0
    for node in ("node-0", "node-1", "node-2"):
        assert relaunch(cluster.state, "cordon", node).returncode == 0
    result = cluster.run(toy_job(AUTO, steps=3))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "needs 2 pod(s) with 2 chip(s) each; the cluster has room for 1" in result.stderr


def test_a_run_on_a_state_directory_another_run_holds_is_a_one_line_error(tmp_path: Path) -> None:
    """Another `relaunch run` holds the state directory (its lock, here taken by this test's
    process): a second run is refused with who holds it (exit 2), and writes no job."""
    from relaunch import runner
    from relaunch.protocol.layout import StateDir
    from relaunch.store import Store

    cluster = Cluster(tmp_path)
    cluster.state.mkdir(parents=True, exist_ok=True)
    held = runner.lock(cluster.state)
    try:
        result = cluster.run(toy_job(AUTO, steps=3))
    finally:
        held.close()
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "another `relaunch run` or runner" in result.stderr
    assert "(pid" in result.stderr and "run)" in result.stderr
    db = StateDir(cluster.state).db
    assert not db.exists() or Store(db).jobs() == []
    assert cluster.run(toy_job(AUTO, steps=3)).returncode == 0  # released: the next run runs
