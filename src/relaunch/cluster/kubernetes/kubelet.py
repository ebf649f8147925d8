"""A node's kubelet, in its relaunch agent: where no kubelet runs (a trial cluster on one
machine), the agent is the node to Kubernetes, as a kubelet is.

It registers its Node (its chips an extended resource: `nvidia.com/gpu` where they are GPUs,
`relaunch.io/chip` where simulated), renews the node's Lease in `kube-node-lease` (a silent
agent is then a node the real controller manager marks NotReady and taints), and list-watches
the Pods bound to it: a new one's launcher is started from the plan it carries (cluster.podhost,
in the pod's cgroup where there are cgroups), its status written as a kubelet writes it (Running,
then Succeeded or Failed with the exit code), and a Pod being deleted has its launcher killed
and its deletion finished. It also list-watches the controllers' Leases: the address of the one
running is where the agent and its pods' launchers find it (written to the agent's state
directory, as `--controller` is).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from relaunch.cluster.kubernetes.objects import (
    CONTROLLER_ADDRESS,
    GPU,
    NODE_LABEL,
    ROLE_LABEL,
    SIMULATED_CHIP,
    container_of,
    plan_of,
)
from relaunch.cluster.kubernetes.watching import list_watch
from relaunch.cluster.podhost import PodHost
from relaunch.protocol.layout import StateDir
from relaunch.protocol.wire import write_controller_address

__all__ = ["NodeKubelet"]

LEASE_S = 4
"""The node's Lease lasts this long; renewed every quarter of it, as a kubelet's."""
STATUS_EVERY = 20
"""The node's status (Ready, with a heartbeat) is posted again every this many renewals (5 s):
after the controller manager marked it Unknown (a silent agent that came back), it is Ready again."""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class NodeKubelet:
    """The node `node` to Kubernetes (see the module docstring)."""

    def __init__(
        self,
        kubeconfig: Path,
        node: str,
        chips: int,
        gpus: bool,
        address: str,
        state_dir: Path,
        host: PodHost,
    ) -> None:
        self.api = config.new_client_from_config(config_file=str(kubeconfig))
        self.core = client.CoreV1Api(self.api)
        self.leases = client.CoordinationV1Api(self.api)
        self.node = node
        self.chips = chips
        self.gpus = gpus
        self.address = address or socket.gethostbyname(socket.gethostname())
        self.state_dir = state_dir
        self.host = host
        self.stop = threading.Event()
        self.started: set[str] = set()
        """The uids of the Pods whose launcher or container runs here."""
        self.lock = threading.Lock()

    def start(self) -> None:
        self.register()
        for target in (self.renew_loop, self.watch_pods, self.watch_controllers):
            threading.Thread(target=target, daemon=True).start()

    # -- the Node and its Lease -------------------------------------------------------------------

    def register(self) -> None:
        body = {"metadata": {"name": self.node, "labels": {
            NODE_LABEL: "true", "kubernetes.io/hostname": self.node}}}  # fmt: skip
        with contextlib.suppress(ApiException):  # 409: registered before (a restarted agent)
            self.core.create_node(body)
        resource = GPU if self.gpus else SIMULATED_CHIP
        capacity = {"cpu": str(os.cpu_count() or 1), "memory": "8Gi", "pods": "32",
                    resource: str(self.chips)}  # fmt: skip
        beat = _now().isoformat()
        ready = {"type": "Ready", "status": "True", "reason": "RelaunchAgentReady",
                 "message": "relaunch's agent is this node's kubelet",
                 "lastHeartbeatTime": beat, "lastTransitionTime": beat}  # fmt: skip
        status = {"capacity": capacity, "allocatable": capacity, "conditions": [ready],
                  "addresses": [{"type": "InternalIP", "address": self.address},
                                {"type": "Hostname", "address": self.node}],
                  "nodeInfo": {"kubeletVersion": "relaunch", "operatingSystem": "linux",
                               "architecture": "amd64", "containerRuntimeVersion": "relaunch",
                               "kernelVersion": os.uname().release, "osImage": "linux",
                               "kubeProxyVersion": "", "machineID": "", "systemUUID": "",
                               "bootID": ""}}  # fmt: skip
        self.core.patch_node_status(self.node, {"status": status})

    def renew_loop(self) -> None:
        beats = 0
        while not self.stop.wait(LEASE_S / 4):
            beats += 1
            with contextlib.suppress(ApiException, OSError):
                self.renew()
                if beats % STATUS_EVERY == 0:
                    self.register()

    def renew(self) -> None:
        spec = {"holderIdentity": self.node, "leaseDurationSeconds": LEASE_S,
                "renewTime": _now().isoformat(timespec="microseconds")}  # fmt: skip
        try:
            self.leases.patch_namespaced_lease(self.node, "kube-node-lease", {"spec": spec})
        except ApiException as error:
            if error.status != 404:
                raise
            body = {"metadata": {"name": self.node}, "spec": spec}
            self.leases.create_namespaced_lease("kube-node-lease", body)
            self.register()  # a Node whose Lease was gone may have been removed too

    # -- the Pods bound here ----------------------------------------------------------------------

    def watch_pods(self) -> None:
        list_watch(
            self.core.list_pod_for_all_namespaces,
            self.pod_changed,
            self.stop,
            field_selector=f"spec.nodeName={self.node}",
        )

    def pod_changed(self, kind: str, pod: Any) -> None:
        uid = pod.metadata.uid
        plan = plan_of(pod)
        if kind == "DELETED" or pod.metadata.deletion_timestamp is not None:
            if plan is not None:
                self.host.stop(plan.job, plan.pod, plan.generation)
            else:
                self.host.stop_container(uid)
            with self.lock:
                self.started.discard(uid)
            if kind != "DELETED":  # the kubelet's part of a deletion: the Pod is gone now
                with contextlib.suppress(ApiException):
                    self.core.delete_namespaced_pod(
                        pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0,
                        body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
                    )  # fmt: skip
            return
        with self.lock:
            if uid in self.started or pod.status.phase in ("Succeeded", "Failed", "Running"):
                return
            self.started.add(uid)
        name, namespace = pod.metadata.name, pod.metadata.namespace
        started = _now().isoformat()

        def ended(code: int) -> None:
            self.ended(name, namespace, uid, code, started, container)

        container = "launcher"
        if plan is not None:
            self.host.start(plan, on_exit=ended)
        else:  # not relaunch's: a Kubernetes Job's, a user's
            what = container_of(pod, self.node, self.address)
            if isinstance(what, str):
                self.refused(name, namespace, uid, what)
                return
            container = what.name
            log = self.state_dir / "containers" / f"{namespace}_{name}.log"
            self.host.run(uid, what, log, on_exit=ended)
        running = {"phase": "Running", "hostIP": self.address, "podIP": self.address,
                   "startTime": started,
                   "conditions": [{"type": t, "status": "True"} for t in
                                  ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
                   "containerStatuses": [_container(container, ready=True, restarts=0,
                                                    state={"running": {"startedAt": started}})]}  # fmt: skip
        with contextlib.suppress(ApiException):
            self.core.patch_namespaced_pod_status(name, namespace, {"status": running})

    def ended(
        self, name: str, namespace: str, uid: str, code: int, started: str, container: str
    ) -> None:
        with self.lock:
            if uid not in self.started:
                return  # deleted: nothing to say of a Pod that is gone
            self.started.discard(uid)
        exit_code = code if code >= 0 else 128 - code  # killed by a signal, as a container
        terminated = {"exitCode": exit_code, "reason": "Completed" if code == 0 else "Error",
                      "startedAt": started, "finishedAt": _now().isoformat()}  # fmt: skip
        status = {"phase": "Succeeded" if code == 0 else "Failed",
                  "conditions": [{"type": "Ready", "status": "False"},
                                 {"type": "ContainersReady", "status": "False"}],
                  "containerStatuses": [_container(container, ready=False, restarts=0,
                                                   state={"terminated": terminated})]}  # fmt: skip
        with contextlib.suppress(ApiException):
            self.core.patch_namespaced_pod_status(name, namespace, {"status": status})

    def refused(self, name: str, namespace: str, uid: str, why: str) -> None:
        """A Pod this kubelet cannot run: Failed at once, saying why (`kubectl describe pod`)."""
        with self.lock:
            self.started.discard(uid)
        status = {"phase": "Failed", "reason": "RelaunchAgentCannotRun", "message": why}
        with contextlib.suppress(ApiException):
            self.core.patch_namespaced_pod_status(name, namespace, {"status": status})

    # -- where the controller is ------------------------------------------------------------------

    def watch_controllers(self) -> None:
        list_watch(
            self.leases.list_lease_for_all_namespaces,
            self.controller_changed,
            self.stop,
            label_selector=f"{ROLE_LABEL}=controller",
        )

    def controller_changed(self, kind: str, lease: Any) -> None:
        address = (lease.metadata.annotations or {}).get(CONTROLLER_ADDRESS, "")
        host, _, port = address.rpartition(":")
        if kind == "DELETED" or not port.isdigit():
            with contextlib.suppress(OSError):
                StateDir(self.state_dir).controller_address.unlink()
            return
        write_controller_address(self.state_dir, host, int(port), pid=0)


def _container(name: str, *, ready: bool, restarts: int, state: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "image": "relaunch", "imageID": "", "ready": ready,
            "restartCount": restarts, "state": state}  # fmt: skip
