"""The engine on a Kubernetes cluster: each relaunch pod a Pod, placed by the scheduler on the
node relaunch chose and run there by the node's kubelet (on the trial cluster, relaunch's own
agent: kubelet.NodeKubelet); the nodes' agents reach the controller through its Lease.

What Kubernetes says of a node is an observation beside relaunch's heartbeats (whichever comes
first is the detection): a Node whose Ready condition is not True (its kubelet silent: the
controller manager's NotReady or Unknown), and a Node cordoned by someone else. A node relaunch
takes out carries the taint `relaunch.io/isolated=<reason>:NoSchedule` (the whole reason in the
annotation `relaunch.io/isolated-reason`), so that nothing else is scheduled there either. The
job's end deletes every Pod and the Lease it made; a Pod on a node that is gone is deleted at
once (as `kubectl delete --force`), there being no kubelet to finish it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from relaunch.cluster import NOTHING_COUNTED, EngineFacts, LeftBehind, Settled
from relaunch.cluster.hosted import AgentsCluster
from relaunch.cluster.kubernetes.objects import (
    ISOLATED_REASON,
    ISOLATED_TAINT,
    STATE_LABEL,
    controller_lease,
    pod_manifest,
    state_label,
    taint_value,
)
from relaunch.cluster.kubernetes.watching import list_watch
from relaunch.protocol.plans import LaunchPlan

__all__ = ["KubernetesCluster", "api_client", "node_seen"]

LEASE_S = 15
"""The controller's Lease lasts this long, renewed every second."""
END_WAIT_S = 60.0
"""How long the job's end waits for its Pods to be gone."""


def api_client(kubeconfig: str | None) -> client.ApiClient:
    """A client of the cluster `kubeconfig` names ($KUBECONFIG or ~/.kube/config where None;
    in a Pod, the Pod's own service account)."""
    if kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ:
        config.load_incluster_config()
        return client.ApiClient()
    return config.new_client_from_config(config_file=kubeconfig)


def _event(pod: str, recovery: Settled) -> dict[str, Any]:
    """A core/v1 Event on `pod` saying what relaunch did (reason `Relaunch<Level>`)."""
    now = datetime.datetime.now(datetime.UTC).isoformat()
    took = f" in {recovery.took_s:.2f} s" if recovery.took_s is not None else ""
    outcome = f"succeeded{took}" if recovery.succeeded else "failed"
    return {
        "metadata": {"generateName": f"{pod}."},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": pod},
        "reason": "Relaunch" + "".join(w.capitalize() for w in recovery.action.split("-")),
        "message": f"{recovery.action} for {recovery.fault}: {outcome}",
        "type": "Normal" if recovery.succeeded else "Warning",
        "source": {"component": "relaunch-controller"},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


def node_seen(node: Any) -> str | None:
    """What Kubernetes says of a Node that makes it no place for a pod (None: it is Ready)."""
    ready = next((c for c in node.status.conditions or [] if c.type == "Ready"), None)
    if ready is None or ready.status != "True":
        said = f"{ready.reason}: {ready.message}" if ready is not None else "no Ready condition"
        return f"Kubernetes reports it {'NotReady' if ready and ready.status == 'False' else 'Unknown'} ({said})"
    if node.spec.unschedulable:
        return "cordoned in Kubernetes (by an administrator: kubectl cordon or drain)"
    return None


class KubernetesCluster(AgentsCluster):
    """The engine of a job on a Kubernetes cluster (see the module docstring)."""

    def __init__(self, state_dir: Path, kubeconfig: str | None, namespace: str, bind: str) -> None:
        super().__init__(bind, 0)
        self.state_dir = state_dir
        self.api = api_client(kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.coordination = client.CoordinationV1Api(self.api)
        self.namespace = namespace
        self.state = state_label(state_dir)
        self.lease = f"relaunch-controller-{self.state}"
        self._lost: dict[str, str] = {}
        self._pod_names: dict[int, str] = {}  # pod index -> its Pod's name, the newest
        self._events: queue.Queue[Settled] = queue.Queue()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._watch_nodes, daemon=True).start()
        threading.Thread(target=self._send_events, daemon=True).start()

    @property
    def facts(self) -> EngineFacts:
        return EngineFacts(
            chips="chips are each Node's extended resource (nvidia.com/gpu, or relaunch.io/chip "
            "where its agent simulates them)",
            containers="a pod is a Pod, its launcher the container's entrypoint, run by the "
            "node's kubelet (relaunch's agent on the trial cluster: a cgroup per pod)",
            networks="nodes use the cluster's network; a network fault is simulated (the agent "
            "reports it)",
        )

    # -- what Kubernetes says of the nodes ---------------------------------------------------------

    def _watch_nodes(self) -> None:
        list_watch(self.core.list_node, self._node_changed, self._stop)

    def _node_changed(self, kind: str, node: Any) -> None:
        name = node.metadata.name
        seen = "the Node was deleted from Kubernetes" if kind == "DELETED" else node_seen(node)
        if seen is not None:
            with self._lock:
                self._lost.setdefault(name, seen)

    def lost_nodes(self) -> Mapping[str, str]:
        with self._lock:
            return dict(self._lost)

    # -- the controller's Lease: where the agents find it ------------------------------------------

    def start_agent(self, node: Any, interval: float, grace: float, blip_s: float) -> int:
        """The node's agent runs already (its kubelet's side): it finds this controller by its
        Lease."""
        return -1

    def listening(self, host: str, port: int) -> None:
        """The controller's Lease, made (a resumed controller's replaces the one before, with
        its new address: the agents and launchers follow it there)."""
        holder = f"{socket.gethostname()}-{os.getpid()}"
        body = controller_lease(self.lease, self.state, f"{host}:{port}", holder, LEASE_S)
        with contextlib.suppress(ApiException):  # a resumed controller's: replaced
            self.coordination.delete_namespaced_lease(self.lease, self.namespace)
        self.coordination.create_namespaced_lease(self.namespace, body)
        threading.Thread(target=self._renew_lease, daemon=True).start()

    def _renew_lease(self) -> None:
        """Each second; a renewal refused is said once (on the controller's stderr, its log)
        until one goes through again: a Lease not renewed is the agents' sign that the
        controller is gone, and who reads that log must learn why."""
        failing = False
        while not self._stop.wait(1.0):
            now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
            try:
                self.coordination.patch_namespaced_lease(
                    self.lease, self.namespace, {"spec": {"renewTime": now}}
                )
                failing = False
            except (ApiException, OSError) as error:
                if not failing:
                    why = getattr(error, "reason", None) or error
                    print(
                        f"relaunch: the controller's Lease {self.namespace}/{self.lease} could "
                        f"not be renewed ({why}); trying again each second",
                        file=sys.stderr,
                        flush=True,
                    )
                failing = True

    # -- pods ---------------------------------------------------------------------------------------

    def start_pod(self, plan: LaunchPlan) -> int:
        """The pod's Pod, created; the node's kubelet starts its launcher (-1: no pid here)."""
        body = pod_manifest(plan, self.state, sys.executable)
        name = body["metadata"]["name"]
        try:
            self.core.create_namespaced_pod(self.namespace, body)
        except ApiException as error:
            if error.status != 409:  # 409: made by this job before a controller restart
                raise
        with self._lock:
            if not plan.standby:
                self._pod_names[plan.pod] = name
        return -1

    # -- a recovery, as an Event on the Pods it touched (`kubectl describe pod`) -------------------

    def settled(self, recovery: Settled) -> None:
        self._events.put(recovery)  # sent by its own thread: the loop never waits on the API

    def _send_events(self) -> None:
        while True:
            recovery = self._events.get()
            with self._lock:
                names = [self._pod_names[i] for i in recovery.pods if i in self._pod_names]
                names = names or list(self._pod_names.values())
            for name in names:
                with contextlib.suppress(ApiException, OSError):
                    self.core.create_namespaced_event(self.namespace, _event(name, recovery))

    def isolate_node(self, node: str, reason: str) -> str | None:
        """The node tainted relaunch.io/isolated=<reason>:NoSchedule (taints of others kept)."""
        try:
            current = self.core.read_node(node)
            taints = [t for t in current.spec.taints or [] if t.key != ISOLATED_TAINT]
            taints.append(
                client.V1Taint(key=ISOLATED_TAINT, value=taint_value(reason), effect="NoSchedule")
            )
            patch = {"metadata": {"annotations": {ISOLATED_REASON: reason}},
                     "spec": {"taints": [self.api.sanitize_for_serialization(t) for t in taints]}}  # fmt: skip
            self.core.patch_node(node, patch)
        except ApiException as error:
            return f"Kubernetes refused the taint: {error.status} {error.reason}"
        return None

    def shutdown(self) -> LeftBehind:
        """Every Pod of the job deleted and waited for (at once on a lost node), then the
        controller's Lease."""
        selector = f"{STATE_LABEL}={self.state}"
        with contextlib.suppress(ApiException, OSError):
            lost = set(self.lost_nodes())
            for pod in self.core.list_namespaced_pod(self.namespace, label_selector=selector).items:
                grace = 0 if pod.spec.node_name in lost or not pod.spec.node_name else None
                with contextlib.suppress(ApiException):
                    self.core.delete_namespaced_pod(
                        pod.metadata.name, self.namespace, grace_period_seconds=grace
                    )
            deadline = time.monotonic() + END_WAIT_S
            while time.monotonic() < deadline:
                left = self.core.list_namespaced_pod(self.namespace, label_selector=selector)
                if not left.items:
                    break
                time.sleep(0.2)
        self._stop.set()
        with contextlib.suppress(ApiException, OSError):
            self.coordination.delete_namespaced_lease(self.lease, self.namespace)
        return NOTHING_COUNTED
