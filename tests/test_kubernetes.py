"""Kubernetes as an engine, on a real control plane built by the project (`make k8s`): etcd,
kube-apiserver, kube-controller-manager and kube-scheduler of v1.37, with relaunch's agent as
each node's kubelet (relaunch.cluster.kubernetes.trial), three nodes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from relaunch.cluster.kubernetes import binaries
from relaunch.cluster.kubernetes.engine import api_client, node_seen
from relaunch.cluster.kubernetes.objects import controller_lease, pod_manifest
from relaunch.cluster.kubernetes.trial import TrialKubernetes
from relaunch.cluster.kubernetes.watching import list_watch
from relaunch.errors import EngineError
from relaunch.protocol.layout import StateDir
from relaunch.protocol.plans import LaunchPlan
from tests.runtime import DDP_FAULTS, ddp_job

ROOT = Path(__file__).resolve().parents[1]
NODES = ["n0", "n1", "n2"]


@pytest.fixture(scope="module")
def trial(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrialKubernetes]:
    try:
        binaries()
    except EngineError as error:
        if shutil.which("go") is None:
            pytest.skip(f"no Go on this machine to build the control plane with: {error}")
        pytest.fail(f"`make k8s` should have built the control plane: {error}")
    cluster = TrialKubernetes(tmp_path_factory.mktemp("k8s"), NODES, node_grace_s=6)
    cluster.start(progress=lambda _: None)
    try:
        yield cluster
    finally:
        cluster.stop()


def core_of(trial: TrialKubernetes, admin: bool = True) -> client.CoreV1Api:
    config = trial.plane.admin_kubeconfig if admin else trial.controller_kubeconfig
    return client.CoreV1Api(api_client(str(config)))


def until(what: str, check: Any, seconds: float = 120) -> Any:
    """Poll `check` until it returns something true (a deadline only to fail, not a bound)."""
    deadline = time.monotonic() + seconds
    while not (found := check()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.2)
    return found


def bring_back(trial: TrialKubernetes, lost: str) -> None:
    """The lost node back for the tests after this one: its agent again, relaunch's taint
    removed, and Ready with no taint left (the node controller's `unreachable`, NoExecute, goes
    a moment after Ready: a pod made on the node before then is evicted before it runs)."""
    trial.start_agent(lost)
    trial.plane.kubectl("taint", "nodes", lost, "relaunch.io/isolated-")
    core = core_of(trial)

    def back() -> bool:
        node = core.read_node(lost)
        return node_seen(node) is None and not node.spec.taints

    until(f"{lost} Ready again, untainted", back)


def test_every_identity_has_the_rights_it_uses_and_no_more(trial: TrialKubernetes) -> None:
    def can(verb: str, what: str, *identity: str) -> bool:
        said = trial.plane.kubectl("auth", "can-i", verb, what, *identity, check=False)
        return said.strip() == "yes"

    controller = ("--as=relaunch:controller", "--as-group=relaunch:controllers")
    for verb, what in [("create", "pods"), ("delete", "pods"), ("watch", "nodes"),
                       ("patch", "nodes"), ("create", "leases"), ("patch", "leases"),
                       ("create", "events")]:  # fmt: skip
        assert can(verb, what, *controller), (verb, what)
    for verb, what in [("get", "secrets"), ("create", "deployments"), ("delete", "nodes"),
                       ("create", "clusterrolebindings"), ("create", "services"),
                       ("patch", "pods")]:  # fmt: skip
        assert not can(verb, what, *controller), (verb, what)
    # a node's agent: its own Node, no one else's (the Node authorizer and NodeRestriction)
    node = client.CoreV1Api(api_client(str(trial.plane.kubeconfig_of_node("n0"))))
    node.patch_node("n0", {"metadata": {"labels": {"relaunch.io/checked": "yes"}}})
    with pytest.raises(ApiException) as refused:
        node.patch_node("n1", {"metadata": {"labels": {"relaunch.io/checked": "yes"}}})
    assert refused.value.status == 403


def test_a_pods_pod_and_the_controllers_lease_are_accepted_by_the_api_server(
    trial: TrialKubernetes,
) -> None:
    """Whatever the job's name and node (upper case, dots, underscores), its Pod and Lease
    pass the real API server's validation (a server-side dry run)."""
    plan = LaunchPlan(
        job=7, pod=1, generation=3, node="n2", command=("python", "train.py"), procs_per_pod=2,
        first_rank=2, working_dir=None, monitor_interval_s=0.5, adopt_grace_s=10,
        workdir="/tmp/w", job_name="My_Job.v2 (final)",
    )  # fmt: skip
    core = core_of(trial, admin=False)
    made = core.create_namespaced_pod(
        "default", pod_manifest(plan, "abc", sys.executable), dry_run="All"
    )
    assert made.metadata.labels["relaunch.io/job"] == "My_Job.v2-final"
    lease = controller_lease("relaunch-controller-abc", "abc", "127.0.0.1:4000", "me", 15)
    leases = client.CoordinationV1Api(api_client(str(trial.controller_kubeconfig)))
    leases.create_namespaced_lease("default", lease, dry_run="All")


def test_a_silent_node_is_marked_unknown_by_the_controller_manager_and_comes_back(
    trial: TrialKubernetes,
) -> None:
    """The agent of n2 stopped (SIGSTOP): its Lease is not renewed, the real controller
    manager marks the Node's Ready Unknown and taints it unreachable; relaunch reads that as
    the node gone (engine.node_seen, `relaunch nodes --engine kubernetes`). Continued, the
    agent posts its status again and the node is Ready."""
    core = core_of(trial)
    agent = trial.agents["n2"]
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        seen = until("n2 NotReady", lambda: node_seen(core.read_node("n2")))
        assert "Unknown" in seen and "Kubelet stopped posting node status" in seen, seen
        until(
            "n2 tainted unreachable",
            lambda: (
                "node.kubernetes.io/unreachable"
                in {t.key for t in core.read_node("n2").spec.taints or []}
            ),
        )
        listed = subprocess.run(
            [sys.executable, "-m", "relaunch", "nodes", "--engine", "kubernetes",
             "--kubeconfig", str(trial.controller_kubeconfig),
             "--state-dir", str(trial.home / "nodes-view")],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
        assert listed.returncode == 0, listed.stderr
        row = next(line for line in listed.stdout.splitlines() if line.strip().startswith("n2"))
        assert "Unknown" in row, listed.stdout
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    until("n2 Ready again", lambda: node_seen(core.read_node("n2")) is None)


def test_kubernetes_own_indexed_job_runs_on_the_agents_and_the_job_controller_replaces_a_failed_pod(
    trial: TrialKubernetes, tmp_path: Path
) -> None:
    """A Pod that is not relaunch's (here an Indexed Job's, what the bench measures relaunch
    beside) runs on the node's agent as on a kubelet: its command, with its env's values, the
    downward API's fields and `$(VAR)` expanded; its exit code in its status. Index 1 exits 3
    once: the real Job controller counts it (podFailurePolicy) and recreates that index, and the
    Job completes. A Pod asking for a Secret is Failed at once, saying why."""
    namespace = "indexed-job-test"
    trial.plane.kubectl("create", "namespace", namespace)
    once = tmp_path / "index-1-failed"
    shell = (f"echo index=$JOB_COMPLETION_INDEX rank=$(RANK) node=$(NODE) > {tmp_path}/out-$(RANK); "
             f'[ "$(RANK)" != 1 ] || [ -e {once} ] || {{ touch {once}; exit 3; }}')  # fmt: skip
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "indexed", "namespace": namespace},
        "spec": {
            "completionMode": "Indexed", "completions": 2, "parallelism": 2, "backoffLimit": 2,
            "podFailurePolicy": {"rules": [
                {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}},
                {"action": "Count", "onExitCodes": {"operator": "NotIn", "values": [0]}}]},
            "template": {"spec": {"restartPolicy": "Never", "containers": [{
                "name": "trainer", "image": "python", "command": ["bash", "-c", shell],
                "env": [{"name": "RANK", "valueFrom": {"fieldRef": {"fieldPath": index}}},
                        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}]}},
        },
    }  # fmt: skip
    secret = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "wants-a-secret", "namespace": namespace},
        "spec": {"restartPolicy": "Never", "nodeName": "n0", "containers": [{
            "name": "c", "image": "python", "command": ["true"],
            "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}]},
    }  # fmt: skip
    manifest = tmp_path / "objects.json"
    manifest.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": [job, secret]}))
    core = core_of(trial)
    try:
        trial.plane.kubectl("apply", "-f", str(manifest))
        batch = client.BatchV1Api(api_client(str(trial.plane.admin_kubeconfig)))

        def ended() -> Any:
            # SuccessCriteriaMet and FailureTarget come first; the Job has ended only once
            # its controller has written Complete or Failed (after its pods terminated).
            status = batch.read_namespaced_job("indexed", namespace).status
            held = [c.type for c in status.conditions or [] if c.status == "True"]
            return held if {"Complete", "Failed"} & set(held) else []

        assert "Complete" in until("the Job ended", ended), ended()
        status = batch.read_namespaced_job("indexed", namespace).status
        assert (status.succeeded, status.failed) == (2, 1)
        pods = core.list_namespaced_pod(namespace, label_selector="job-name=indexed").items
        codes = sorted(
            (p.metadata.annotations["batch.kubernetes.io/job-completion-index"],
             p.status.container_statuses[0].state.terminated.exit_code)
            for p in pods
        )  # fmt: skip
        assert codes == [("0", 0), ("1", 0), ("1", 3)], codes
        for rank in (0, 1):
            said = (tmp_path / f"out-{rank}").read_text().split()
            node = next(p.spec.node_name for p in pods if p.status.phase == "Succeeded"
                        and p.metadata.annotations["batch.kubernetes.io/job-completion-index"] == str(rank))  # fmt: skip
            assert said == [f"index={rank}", f"rank={rank}", f"node={node}"], said
        refused = until(
            "the Pod asking for a Secret Failed",
            lambda: (
                (p := core.read_namespaced_pod("wants-a-secret", namespace)).status.phase
                == "Failed"
                and p
            ),
        )
        assert refused.status.reason == "RelaunchAgentCannotRun", refused.status
        assert "env TOKEN" in refused.status.message, refused.status.message
    finally:
        trial.plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_the_toy_job_comes_through_the_demos_three_faults_on_kubernetes(
    trial: TrialKubernetes, tmp_path: Path
) -> None:
    """`relaunch run --engine kubernetes`: the demo's crash, chip fault and lost node (its
    agent and pods killed: its pod recreated as a new Pod on the standby node), with the
    embedded cluster's decisions; the lost node tainted with relaunch's reason; after the job
    no Pod or Lease of it is left."""
    report = tmp_path / "report.json"
    seen_pods: list[str] = []
    core = core_of(trial)
    stop = threading.Event()

    def watch_pods() -> None:
        while not stop.wait(0.5):
            with_label = core.list_namespaced_pod("default", label_selector="relaunch.io/job=toy")
            seen_pods.extend(p.metadata.name for p in with_label.items)

    threading.Thread(target=watch_pods, daemon=True).start()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "relaunch", "run", "examples/toy-job.yaml",
             "--engine", "kubernetes", "--kubeconfig", str(trial.controller_kubeconfig),
             "--cluster", "examples/cluster-small.yaml", "--faults", "examples/toy-faults.yaml",
             "--state-dir", str(tmp_path / "state"), "--report", str(report)],
            capture_output=True, text=True, timeout=600, cwd=ROOT,
        )  # fmt: skip
    finally:
        stop.set()
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    summary = json.loads(report.read_text())
    actions = [(r["fault"]["kind"], r["action"], r["outcome"]) for r in summary["recoveries"]]
    assert actions == [("process-exit", "job-reschedule", "succeeded"),
                       ("chip", "in-place", "succeeded"),
                       ("node-lost", "pod-reschedule", "succeeded")], said  # fmt: skip
    lost = summary["recoveries"][2]["fault"]["node"]
    assert all(pod["node"] != lost for pod in summary["pods"]), summary["pods"]
    assert any(name.startswith("toy-1-pod-1-g") for name in seen_pods), seen_pods
    assert len({n for n in seen_pods if n.startswith("toy-1-pod-1-")}) >= 3, seen_pods
    node = core.read_node(lost)
    isolated = [t for t in node.spec.taints or [] if t.key == "relaunch.io/isolated"]
    assert isolated and isolated[0].effect == "NoSchedule", node.spec.taints
    assert "node-lost" in node.metadata.annotations["relaunch.io/isolated-reason"]
    assert not core.list_namespaced_pod("default", label_selector="relaunch.io/job=toy").items
    said_by = core.list_namespaced_event("default", field_selector="source=relaunch-controller")
    events = {(e.reason, e.involved_object.name.split("-g")[0]) for e in said_by.items}
    assert {("RelaunchJobReschedule", "toy-1-pod-0"), ("RelaunchJobReschedule", "toy-1-pod-1"),
            ("RelaunchInPlace", "toy-1-pod-0"), ("RelaunchPodReschedule", "toy-1-pod-1")} <= events, events  # fmt: skip
    leases = client.CoordinationV1Api(api_client(str(trial.plane.admin_kubeconfig)))
    assert not leases.list_lease_for_all_namespaces(label_selector="relaunch.io/role").items
    bring_back(trial, lost)


def test_a_volcano_job_with_mindclusters_labels_runs_with_those_settings(
    trial: TrialKubernetes, tmp_path: Path
) -> None:
    """examples/kubernetes/volcano-job.yaml, written as MindCluster's docs write a job: its
    `fault-scheduling: force` stops the pods at once, its `pod-rescheduling: on` takes the lost
    node's pod to the standby node, its job-retry-num and maxRetry bound the restarts."""
    faults = tmp_path / "faults.yaml"
    faults.write_text(
        "faults:\n"
        "  - {kind: process-exit, at_step: 20, pod: 1, exit_code: 1}\n"
        "  - {kind: node-down, at_step: 70, pod: 1}\n"
    )
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "relaunch", "run", "examples/kubernetes/volcano-job.yaml",
         "--engine", "kubernetes", "--kubeconfig", str(trial.controller_kubeconfig),
         "--cluster", "examples/cluster-small.yaml", "--faults", str(faults),
         "--state-dir", str(tmp_path / "state"), "--report", str(report)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    summary = json.loads(report.read_text())
    assert summary["job"] == "toy-volcano"
    actions = [(r["fault"]["kind"], r["action"]) for r in summary["recoveries"]]
    assert actions == [("process-exit", "job-reschedule"), ("node-lost", "pod-reschedule")], said
    assert "SIGKILL at once" in said or "SIGKILL" in said, said  # fault-scheduling: force
    assert summary["budgets_left"]["job"] == 3, summary["budgets_left"]  # 4, one used
    lost = summary["recoveries"][1]["fault"]["node"]
    bring_back(trial, lost)


def test_the_controller_killed_and_resumed_keeps_the_job_and_its_records(
    trial: TrialKubernetes, tmp_path: Path
) -> None:
    """SIGKILL the controller after the toy job's first recovery: its Pods run on; `relaunch
    run --resume` makes its Lease again with its new address, the agents and launchers follow
    it there, the job ends with both records (the chip fault recovered after the resume), and
    nothing of it is left."""
    state = tmp_path / "state"
    faults = tmp_path / "faults.yaml"
    faults.write_text(
        "faults:\n"
        "  - {kind: process-exit, at_step: 10, pod: 1, exit_code: 1}\n"
        "  - {kind: chip-fault, at_step: 60, pod: 0, chip: 0, code: 80E18005, heals: true}\n"
    )
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("heartbeat_interval_s: 0.2\nheartbeat_timeout_s: 1.5\nadopt_grace_s: 20\n")
    run = [sys.executable, "-m", "relaunch", "run", "--state-dir", str(state)]
    first = subprocess.Popen(
        [*run, "examples/toy-job.yaml", "--engine", "kubernetes",
         "--kubeconfig", str(trial.controller_kubeconfig), "--cluster", str(cluster),
         "--faults", str(faults)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    database = StateDir(state).db

    def recovered_and_on() -> bool:
        assert first.poll() is None, "the run ended before its controller was killed"
        try:
            with contextlib.closing(sqlite3.connect(database, timeout=5)) as db:
                done = db.execute("SELECT count(*) FROM recoveries WHERE outcome = 'succeeded'")
                step = db.execute("SELECT max(last_step) FROM jobs").fetchone()[0]
                return bool(done.fetchone()[0] == 1 and (step or 0) >= 25)
        except sqlite3.OperationalError:  # not made yet
            return False

    until("the first recovery, and the job past step 25", recovered_and_on)
    first.send_signal(signal.SIGKILL)
    first.wait()
    core = core_of(trial)
    assert core.list_namespaced_pod("default", label_selector="relaunch.io/job=toy").items
    report = tmp_path / "report.json"
    done = subprocess.run(
        [*run, "--resume", "--report", str(report)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(report.read_text())
    actions = [(r["action"], r["outcome"]) for r in summary["recoveries"]]
    assert actions == [("job-reschedule", "succeeded"), ("in-place", "succeeded")], summary
    assert summary["last_step"] == 120
    assert not core.list_namespaced_pod("default", label_selector="relaunch.io/job=toy").items


def test_the_ddp_example_ends_bit_identical_through_a_crash_a_chip_fault_a_lost_node_and_a_hang(
    trial: TrialKubernetes, tmp_path: Path, unbroken: str
) -> None:
    """The example's own fault plan (examples/ddp/faults.yaml) on Kubernetes: the DDP example's
    parameters end as a fault-free run's on the embedded cluster, bit for bit."""
    out = tmp_path / "hash.txt"
    job, faults = tmp_path / "job.yaml", tmp_path / "faults.yaml"
    job.write_text(yaml.safe_dump(ddp_job(out, 10)))
    faults.write_text(yaml.safe_dump({"faults": DDP_FAULTS}))
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "relaunch", "run", str(job), "--engine", "kubernetes",
         "--kubeconfig", str(trial.controller_kubeconfig), "--cluster", "examples/cluster-small.yaml",
         "--faults", str(faults), "--state-dir", str(tmp_path / "state"), "--report", str(report),
         "--startup-seconds", "60"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    summary = json.loads(report.read_text())
    kinds = [r["fault"]["kind"] for r in summary["recoveries"]]
    assert kinds == ["process-exit", "chip", "node-lost", "hang"], said
    assert all(r["outcome"] == "succeeded" for r in summary["recoveries"]), said
    assert out.read_text().strip() == unbroken, said
    lost = summary["recoveries"][2]["fault"]["node"]
    bring_back(trial, lost)


def test_a_list_watch_lists_again_when_its_version_has_expired() -> None:
    """An ERROR event of 410 Gone on the watch (its resource version compacted away) is a new
    list, the objects handled again from it, as an informer re-lists."""
    stop = threading.Event()
    lists: list[str] = []
    handled: list[tuple[str, str]] = []
    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                        "message": "too old resource version"}}  # fmt: skip

    class Response:
        status = 200

        def __init__(self, lines: list[bytes]) -> None:
            self.lines = lines

        def stream(self, amt: Any = None, decode_content: bool = False) -> Iterator[bytes]:
            yield from self.lines

        def close(self) -> None: ...

        def release_conn(self) -> None: ...

    def lister(**selectors: Any) -> Any:
        if selectors.get("watch"):
            if len(lists) == 1:
                return Response([json.dumps(gone).encode() + b"\n"])
            stop.set()
            return Response([])
        lists.append("list")
        item = SimpleNamespace(metadata=SimpleNamespace(name=f"pod-{len(lists)}"))
        version = SimpleNamespace(resource_version=str(len(lists)))
        return SimpleNamespace(metadata=version, items=[item])

    list_watch(lister, lambda kind, obj: handled.append((kind, obj.metadata.name)), stop)
    assert lists == ["list", "list"]
    assert handled == [("ADDED", "pod-1"), ("ADDED", "pod-2")]
