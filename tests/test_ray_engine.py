"""relaunch on Ray: the same recoveries as on the embedded cluster, on a real Ray cluster.

The cluster is a head and four nodes (node-0 .. node-3, each with its own `relaunch_node:<name>`
resource and `relaunch_chips: 2`) started by `python -m relaunch.cluster.ray --heal` inside a
network namespace that has only a loopback interface (Ray would otherwise rewrite 127.0.0.1 to the
host's address); relaunch runs inside the same namespace with `--engine ray --address`. The
cluster is shared by the tests of this module; a test that removes a node gets it back (`--heal`)
before the next one starts. Each job and fault plan also runs on the embedded cluster, and the two
reports must agree: same actions, outcomes, faults, isolated nodes, counters and budgets.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from relaunch.cluster.ray import LoopbackNamespace
from tests.runtime import (
    AUTO,
    DDP_CLUSTER,
    FAST_CLUSTER,
    HANG,
    POD_LEVEL,
    ROOT,
    UNCONDITIONAL,
    Cluster,
    Result,
    ddp_job,
    free_port,
    toy_job,
)

NAMESPACE = f"relaunch-test-{os.getpid()}"
NODES = [f"node-{i}" for i in range(4)]
RAY_MARK = "/tmp/relaunch-ray-"
"""Every local Ray cluster relaunch starts keeps its files under /tmp/relaunch-ray-*."""


def ray_processes(mark: str = RAY_MARK) -> list[psutil.Process]:
    """Processes of the local Ray clusters relaunch started (`ray start`, GCS, raylets, agents,
    and, by default, every Ray worker: their titles are `ray::...`)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.info["status"] == psutil.STATUS_ZOMBIE:
            continue  # dead; its parent died before reaping it
        try:
            cmdline = " ".join(process.info["cmdline"] or [])
        except psutil.Error:
            continue
        ours = mark == RAY_MARK and (
            cmdline.startswith("ray::") or "relaunch.cluster.ray" in cmdline
        )
        if mark in cmdline or ours:
            found.append(process)
    return found


@dataclass
class RayTrial:
    """The shared cluster: its status file says its address, live nodes and `ray start` pids."""

    status_file: Path
    process: subprocess.Popen[bytes]

    def status(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self.status_file.read_text())
            return data
        except (OSError, ValueError):
            return {}

    @property
    def address(self) -> str:
        return str(self.status()["address"])

    def wait_whole(self, timeout: float = 120) -> None:
        """Until every node is alive in Ray again (a status written after this call)."""
        since = time.time()
        deadline = since + timeout
        while time.time() < deadline:
            status = self.status()
            if status.get("at", 0) > since and status.get("alive") == NODES:
                return
            assert self.process.poll() is None, "the Ray cluster's keeper exited"
            time.sleep(0.2)
        raise AssertionError(f"the Ray cluster did not come back whole: {self.status()}")

    def command(self, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", NAMESPACE, *args]

    def run(
        self,
        cluster: Cluster,
        job: dict[str, Any],
        faults: list[dict[str, Any]] | None = None,
        shape: dict[str, Any] | None = None,
        *,
        trial: bool = False,
        timeout: float = 150,
        startup_s: float = 8,
    ) -> Result:
        """`relaunch run --engine ray` in the namespace: on this cluster, or (trial) on a local
        cluster of its own shaped by the cluster file."""
        engine = ["--engine", "ray"] + ([] if trial else ["--address", self.address])
        args = cluster.command(job, faults, shape, extra=tuple(engine), startup_s=startup_s)
        done = subprocess.run(
            self.command(args),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            check=False,
        )
        return cluster.result(done.returncode, done.stdout, done.stderr)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayTrial]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.fail(
            "the Ray tests start Ray inside a network namespace: run them as root with iproute2 "
            "installed (CI does)"
        )
    tmp = tmp_path_factory.mktemp("ray")
    namespace = LoopbackNamespace(NAMESPACE).create()
    shape = tmp / "cluster.yaml"
    shape.write_text(yaml.safe_dump(FAST_CLUSTER))
    status = tmp / "status.json"
    keeper = subprocess.Popen(
        namespace.command([sys.executable, "-m", "relaunch.cluster.ray",
         "--cluster", str(shape), "--status", str(status), "--heal"]),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    trial = RayTrial(status, keeper)
    try:
        trial.wait_whole(timeout=150)
        yield trial
    finally:
        keeper.send_signal(signal.SIGTERM)
        try:
            keeper.wait(timeout=90)
        finally:
            deadline = time.time() + 10  # SIGKILLed ones take a moment to die
            while (left := ray_processes()) and time.time() < deadline:
                time.sleep(0.2)
            for process in left:
                process.kill()
            namespace.remove()
    assert not left, f"Ray processes outlived the tests: {[p.pid for p in left]}"


@pytest.fixture
def whole(ray_cluster: RayTrial) -> RayTrial:
    """The shared cluster with all four nodes alive (an earlier test may have removed one)."""
    ray_cluster.wait_whole()
    return ray_cluster


def embedded(cluster: Cluster, name: str = "embedded") -> Cluster:
    """A second state directory in the test's directory, for the same job on the embedded engine."""
    other = cluster.dir / name
    other.mkdir()
    return Cluster(other)


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """What must not depend on the engine: actions, outcomes, faults, nodes, counters, budgets."""
    return {
        "status": report["status"],
        "attempt": report["attempt"],
        "restarts_used": report["restarts_used"],
        "pod_restarts_used": report["pod_restarts_used"],
        "isolated_nodes": report["isolated_nodes"],
        "budgets_left": report["budgets_left"],
        "pods": [
            (p["node"], p["generation"], p["schedule_count"], p["proc_start_count"])
            for p in report["pods"]
        ],
        "recoveries": [
            {
                "action": r["action"],
                "outcome": r["outcome"],
                "fault": {k: r["fault"][k] for k in ("kind", "node", "pod", "rank", "exit_code")},
                "isolated_nodes": r["isolated_nodes"],
                "consumed_budget": r["consumed_budget"],
                "counters_after": r["counters_after"],
            }
            for r in report["recoveries"]
        ],
    }


def both(
    cluster: Cluster,
    ray: RayTrial,
    job: dict[str, Any],
    faults: list[dict[str, Any]],
    shape: dict[str, Any] | None = None,
    ray_shape: dict[str, Any] | None = None,
    **kw: Any,
) -> tuple[Result, Result]:
    """The job on Ray (cluster file `ray_shape`, else `shape`) and on the embedded cluster, side
    by side (two runs of their own: the embedded one runs while Ray detects and moves); the two
    reports must agree."""
    with ThreadPoolExecutor(1) as beside:
        running = beside.submit(embedded(cluster).run, job, faults, shape)
        on_ray = ray.run(cluster, job, faults, ray_shape or shape, **kw)
        local = running.result()
    assert on_ray.returncode == 0, on_ray.stdout + on_ray.stderr
    assert local.returncode == 0, local.stdout + local.stderr
    assert summary(on_ray.report) == summary(local.report)
    return on_ray, local


def test_nodes_lists_the_ray_nodes_with_their_relaunch_state(
    whole: RayTrial, tmp_path: Path
) -> None:
    done = subprocess.run(
        whole.command(
            [sys.executable, "-m", "relaunch", "nodes", "--engine", "ray", "--address",
             whole.address, "--state-dir", str(tmp_path / "state")]
        ),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [
        [cell.strip() for cell in line.split("│")]
        for line in done.stdout.splitlines()
        if line.strip().startswith("node-")
    ]
    assert [row[0] for row in rows] == NODES
    assert all(row[1] == "alive" and row[4] == "2" for row in rows), done.stdout
    wrong = subprocess.run(
        [sys.executable, "-m", "relaunch", "nodes", "--engine", "ray"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert wrong.returncode == 2 and "--address" in wrong.stderr


def test_node_removed_from_ray_isolates_it_and_rebuilds_the_job_on_a_standby_node(
    cluster: Cluster, whole: RayTrial
) -> None:
    # A long agent timeout: the node's loss can only be seen this fast through Ray.
    shape = {**FAST_CLUSTER, "heartbeat_timeout_s": 20}
    faults = [{"kind": "node-down", "at_step": 10, "pod": 1}]
    on_ray, _ = both(cluster, whole, toy_job(AUTO), faults, ray_shape=shape)
    assert on_ray.actions == ["isolated-job-reschedule"]
    assert on_ray.report["isolated_nodes"] == ["node-1"]
    assert on_ray.launch_nodes()[:2] == ["node-0", "node-1"]
    assert "node-1" not in on_ray.launch_nodes()[2:]
    assert "node node-1 lost: the engine reports the node dead" in on_ray.stdout


# It needs no node of the shared cluster: it runs while the keeper starts again the node the
# test before removed (the next test waits for the whole cluster; 20-50 s on two busy cores).
def test_crash_with_unconditional_retry_on_a_trial_cluster_matches_embedded(
    cluster: Cluster, ray_cluster: RayTrial
) -> None:
    """Without --address, `relaunch run --engine ray` starts its own local Ray cluster, shaped
    by the cluster file, and removes it at the end."""
    faults = [{"kind": "process-exit", "at_step": 10, "pod": 1, "exit_code": 1}]
    shape = {**FAST_CLUSTER, "nodes": 3}
    on_ray, _ = both(cluster, ray_cluster, toy_job(UNCONDITIONAL), faults, shape, trial=True)
    assert on_ray.actions == ["job-reschedule"]
    found = re.search(r"a head and 3 node\(s\) \((/tmp/relaunch-ray-[0-9-]+)\.log\)", on_ray.stdout)
    assert found, on_ray.stdout
    left = ray_processes(found[1])
    assert not left, f"the trial cluster outlived its run: {[p.cmdline() for p in left]}"
    assert not Path(found[1]).exists()


def test_hang_restarts_in_place_on_ray_as_on_embedded(cluster: Cluster, whole: RayTrial) -> None:
    faults = [{"kind": "hang", "at_step": 10, "pod": 0, "rank": 1}]
    on_ray, _ = both(cluster, whole, toy_job(HANG), faults)
    assert on_ray.actions == ["hang-restart"]
    assert [p["proc_start_count"] for p in on_ray.report["pods"]] == [2, 2]


@pytest.mark.parametrize("tier", ["peer-memory", "bad-peer-memory-then-local-disk"])
def test_ddp_loses_a_ray_node_and_ends_bit_identical_to_the_fault_free_run(
    cluster: Cluster, whole: RayTrial, unbroken: str, tier: str
) -> None:
    """Each rank's checkpoint also goes to the next node's agent's memory (`peer_memory_mb`:
    node-0's to node-1, node-1's to node-2, the next one that answers) and to its node's disk
    (`local_checkpoint_dir`). The moved pod restores from node-2's memory, which holds its
    rank's copies. Pod 0, kept where it saved, restores from node-0's disk where its copy of the
    step was lost with node-1, or from node-2's memory where node-1 no longer answered when the
    copy was sent (the ranks may save once more before the node is gone). With every node's
    peer memory gone bad from the first step (the fault plan's `peer-copy-corrupt`, delivered
    to the agents Ray started as to the embedded cluster's), each rank refuses its copies in
    peers' memory by their checksums: pod 0 restores from node-0's disk, the moved pod from
    storage. The job's end leaves only the lost node's disk copies (its agent was lost with
    it)."""
    out = cluster.dir / "hash.txt"
    faults = [{"kind": "node-down", "at_step": 40, "pod": 1}]
    if tier != "peer-memory":
        bad = [{"kind": "peer-copy-corrupt", "at_step": 1, "node": node} for node in NODES]
        faults = bad + faults
    job = ddp_job(out, 10)
    disks = cluster.dir / "node-disks"
    job["spec"].update(local_checkpoint_dir=str(disks), peer_memory_mb=16)
    result = whole.run(cluster, job, faults, DDP_CLUSTER, timeout=300, startup_s=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.actions == ["pod-reschedule"]
    pods = result.report["pods"]
    assert (pods[0]["node"], pods[0]["generation"]) == ("node-0", 1)  # kept its container
    assert (pods[1]["node"], pods[1]["generation"]) == ("node-2", 2)
    assert result.launch_nodes() == ["node-0", "node-1", "node-2"]  # only the lost pod moved
    assert out.read_text().strip() == unbroken
    tiers = sorted((r.pod, r.rank, r.tier, r.holder) for r in result.restores())
    if tier == "peer-memory":
        assert tiers[1] == (1, 1, "peer-memory", "node-2"), tiers
        assert tiers[0] in ((0, 0, "local-disk", "node-0"), (0, 0, "peer-memory", "node-2")), tiers
    else:
        assert tiers == [(0, 0, "local-disk", "node-0"), (1, 1, "storage", "")], tiers
        refusals = re.findall(r"the copy in node-\d's memory was refused: [^\n]*", result.logs())
        assert refusals and all("checksum" in r for r in refusals), refusals
    assert len(tiers) == 2, tiers
    reported = result.report["restores"]  # the report's reading of the same record
    assert sorted((r["pod"], r["rank"], r["tier"], r["holder"]) for r in reported) == tiers
    left = {p.relative_to(disks).parts[:2] for p in disks.rglob("*.ckpt")}
    assert left == {("node-1", "job-1")}, left


def _family(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _generation_one_of_pod_one(state: Path) -> list[psutil.Process]:
    """Processes of pod 1's first container of the cluster in `state`: its launcher and its
    ranks (not another cluster's, which a test beside this one may run)."""
    mark, found = str(state), []
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            cmdline = " ".join(process.info["cmdline"] or [])
            env = process.environ()
        except psutil.Error:
            continue
        rank = env.get("RELAUNCH_POD") == "1" and env.get("RELAUNCH_GENERATION") == "1"
        ours = mark in cmdline or mark in env.get("RELAUNCH_WORKDIR", "")
        if ours and ("pod-1-g1" in cmdline or rank):
            found.append(process)
    return found


def test_a_hung_node_declared_dead_is_fenced_when_it_comes_back(
    cluster: Cluster, whole: RayTrial
) -> None:
    """Every process of node-1 stops (SIGSTOP: its `ray start`, raylet, workers and the pod there)
    as in a hang or a partition. Ray declares the node dead, relaunch moves the pod; when the node
    runs again, the old pod's processes get the controller's shutdown and die, and the job ends
    as if the node had simply been lost."""
    job = toy_job(POD_LEVEL, steps=200)
    args = cluster.command(job, None, None, extra=("--engine", "ray", "--address", whole.address))
    run = subprocess.Popen(
        whole.command(args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    from relaunch.store import NodeState, Store

    store = None
    stopped: list[psutil.Process] = []
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            if store is None and (cluster.state / "relaunch.db").exists():
                store = Store(cluster.state / "relaunch.db")
            if store is not None and store.jobs() and (store.jobs()[0].last_step or 0) >= 10:
                break
            time.sleep(0.1)
        assert store is not None and _generation_one_of_pod_one(cluster.state)
        stopped = _family(whole.status()["pids"]["node-1"])
        for process in stopped:
            process.suspend()
        while time.time() < deadline:
            node = store.node("node-1")
            pods = store.pods(store.jobs()[0].id)
            if node is not None and node.state is NodeState.LOST and pods[1].generation == 2:
                break
            time.sleep(0.1)
        assert pods[1].node == "node-2", "the pod did not move off the hung node"
        assert _generation_one_of_pod_one(cluster.state), (
            "the old pod should still exist while stopped"
        )
    finally:
        for process in stopped:
            with contextlib.suppress(psutil.Error):
                process.resume()
    gone_by = time.time() + 15
    while _generation_one_of_pod_one(cluster.state) and time.time() < gone_by:
        time.sleep(0.1)
    assert not _generation_one_of_pod_one(cluster.state), (
        "the old generation outlived its node's return"
    )
    output, _ = run.communicate(timeout=120)
    result = cluster.result(run.returncode, output)
    assert result.returncode == 0, output
    assert result.actions == ["pod-reschedule"]
    assert [(p["node"], p["generation"]) for p in result.report["pods"]] == [
        ("node-0", 1),
        ("node-2", 2),
    ]
    # the fence the SDK checks before writing a checkpoint: pod 1 below generation 2 may not
    fence = json.loads((cluster.state / "jobs" / "1" / "shared" / "fence.json").read_text())
    assert fence == {"generations": {"1": 2}}


def test_a_server_on_ray_runs_what_is_submitted_to_it_there(
    cluster: Cluster, whole: RayTrial
) -> None:
    """`relaunch server --engine ray --address`: its nodes are the Ray nodes, and a job submitted
    to it (here with a node-down) runs on Ray through its detached runner."""
    port = str(free_port())
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        whole.command(
            [sys.executable, "-m", "relaunch", "server", "--engine", "ray", "--address",
             whole.address, "--cluster", str(cluster.write("cluster.yaml", FAST_CLUSTER)),
             "--state-dir", str(cluster.state), "--port", port]
        ),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip

    def cli(*args: str) -> str:
        done = subprocess.run(
            whole.command([sys.executable, "-m", "relaunch", *args, "--server", url,
                           "--state-dir", str(cluster.state)]),
            capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
        )  # fmt: skip
        return done.stdout + done.stderr

    try:
        deadline = time.time() + 60
        while "node-3" not in (listed := cli("nodes")) and time.time() < deadline:
            time.sleep(0.5)
        assert all(name in listed for name in NODES), listed
        job = cluster.write("job.yaml", toy_job(POD_LEVEL))
        faults = cluster.write(
            "faults.yaml", {"faults": [{"kind": "node-down", "at_step": 10, "pod": 1}]}
        )
        assert "submitted (id 1)" in cli("submit", str(job), "--faults", str(faults))
        while time.time() < deadline + 60:
            report = json.loads(cli("describe", "1", "-o", "json") or "{}")
            if report.get("status") in ("Succeeded", "Failed"):
                break
            time.sleep(0.5)
    finally:
        server.terminate()
        server.communicate(timeout=30)
    assert report["status"] == "Succeeded", report
    assert [r["action"] for r in report["recoveries"]] == ["pod-reschedule"]
    assert [p["node"] for p in report["pods"]] == ["node-0", "node-2"]
    runner_log = (cluster.state / "runner.log").read_text()
    assert "ended: Succeeded" in runner_log, runner_log


def test_helpers_that_leave_the_process_group_end_with_their_pod_on_ray(
    cluster: Cluster, whole: RayTrial
) -> None:
    """The pods on a Ray node are cgroups too: a rank's setsid helpers end with a job-level
    restart and with the job, and the report counts nothing left behind."""
    from relaunch.containers import cluster_root
    from tests.test_containers import _cgroups_or_skip, helpers_job, kill_helpers, live_helpers

    _cgroups_or_skip(cluster.state)
    marks = cluster.dir / "marks"
    marks.mkdir()
    try:
        faults = [{"kind": "process-exit", "at_step": 10, "pod": 1, "exit_code": 1}]
        result = whole.run(cluster, helpers_job(marks, steps=60), faults, FAST_CLUSTER)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.actions == ["job-reschedule"]
        said = [line for line in result.stdout.splitlines() if "pods" in line]
        assert any("pods are cgroups on every node" in line for line in said), said
        assert not list(marks.glob("survivors-seen-by-*"))
        assert len(list(marks.glob("helper-*[0-9]"))) == 16
        assert live_helpers(marks) == []
        assert result.report["left_behind"] == 0
        root = cluster_root(cluster.state)
        assert root is not None and not root.path.exists(), "the cluster's cgroup was left"
    finally:
        kill_helpers(marks)
