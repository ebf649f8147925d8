"""A real Kubernetes control plane on this machine: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler, built by `make k8s`, each started with a
configuration of its own kept in `home` (certificates and kubeconfigs made per cluster: `pki`).

The API server authorizes by Node and RBAC, with NodeRestriction: relaunch's controller and each
node's agent connect under identities of their own, bound to what they use (pki's module
docstring; manifests/controller-rbac.yaml). The controller manager marks a node whose Lease is
not renewed for `node_grace_s` NotReady and taints it, as on any cluster; both it and the
scheduler hold their leader Lease in kube-system, by which the control plane is known to be up.
etcd runs without fsync: a trial cluster's state is its tests' (and goes with `stop`).
"""

from __future__ import annotations

import contextlib
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO

from relaunch.cluster.kubernetes import MANIFESTS, binaries
from relaunch.cluster.kubernetes.pki import (
    ADMIN,
    CONTROLLER,
    CONTROLLER_MANAGER,
    SCHEDULER,
    Identity,
    Pki,
    kubeconfig,
    node_identity,
)
from relaunch.cluster.local import free_port
from relaunch.errors import EngineError

__all__ = ["ControlPlane"]

START_S = 180.0
"""How long the control plane may take to come up (2 busy cores: about 15 s)."""
SERVICE_RANGE = "10.0.0.0/24"


class ControlPlane:
    """One cluster's control plane, kept in `home` (see the module docstring)."""

    def __init__(self, home: Path, node_grace_s: float = 10.0) -> None:
        self.home = home
        self.bin = binaries()
        self.pki = Pki(home / "pki")
        self.node_grace_s = node_grace_s
        self.api_port = free_port()
        self.server = f"https://127.0.0.1:{self.api_port}"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []

    @property
    def admin_kubeconfig(self) -> Path:
        return self.home / "admin.kubeconfig"

    def kubeconfig(self, identity: Identity) -> Path:
        """A kubeconfig of `identity` on this cluster (made once, then kept in `home`)."""
        path = self.home / "kubeconfigs" / f"{identity.file_name}.kubeconfig"
        return path if path.exists() else kubeconfig(self.pki, self.server, identity, path)

    def kubeconfig_of_node(self, node: str) -> Path:
        """The kubeconfig of `node`'s agent: the node's own identity (system:node:NAME)."""
        return self.kubeconfig(node_identity(node))

    def start(self, progress: Callable[[str], None] = print) -> Path:
        """Every part started, in order, each waited for; the administrator's kubeconfig."""
        self.pki.ensure()
        kubeconfig(self.pki, self.server, ADMIN, self.admin_kubeconfig)
        try:
            self._start_etcd()
            progress("etcd is up")
            self._start_apiserver()
            progress(f"kube-apiserver is up at {self.server}")
            self._start_controllers()
            self.kubectl("apply", "-f", str(MANIFESTS / "controller-rbac.yaml"))
            self._wait(self._leaders_elected, "the controller manager and the scheduler")
            # A Pod is refused until its namespace's default ServiceAccount exists, which the
            # controller manager makes a moment after it leads: waited for, not raced.
            self._wait(self._default_account_made, "the default namespace's ServiceAccount")
            progress("kube-controller-manager and kube-scheduler are up")
        except BaseException:
            self.stop()
            raise
        return self.admin_kubeconfig

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.home / "logs" / f"{name}.log", "ab")  # noqa: SIM115
        self._logs.append(log)
        self.processes[name] = subprocess.Popen(
            [str(self.bin / name), *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _start_etcd(self) -> None:
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        client, peer = free_port(), free_port()
        self.etcd = f"http://127.0.0.1:{client}"
        self._spawn(
            "etcd",
            [
                f"--data-dir={self.home / 'etcd'}",
                f"--listen-client-urls={self.etcd}",
                f"--advertise-client-urls={self.etcd}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=default=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        self._wait(lambda: self._get(f"{self.etcd}/health", tls=False), "etcd")

    def _start_apiserver(self) -> None:
        pki = self.pki
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers={self.etcd}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                "--endpoint-reconciler-type=none",  # a loopback address: no kubernetes Endpoints
                f"--secure-port={self.api_port}",
                f"--tls-cert-file={pki.serving_cert}",
                f"--tls-private-key-file={pki.serving_key}",
                f"--client-ca-file={pki.ca_cert}",
                f"--service-account-key-file={pki.service_account_pub}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-cluster-ip-range={SERVICE_RANGE}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=false",
                "--profiling=false",
            ],
        )
        self._wait(lambda: self._get(f"{self.server}/readyz", tls=True), "kube-apiserver")

    def _start_controllers(self) -> None:
        pki = self.pki
        manager = self.kubeconfig(CONTROLLER_MANAGER)
        self._spawn(
            "kube-controller-manager",
            [
                f"--kubeconfig={manager}",
                f"--authentication-kubeconfig={manager}",
                f"--authorization-kubeconfig={manager}",
                f"--service-account-private-key-file={pki.service_account_key}",
                f"--root-ca-file={pki.ca_cert}",
                "--use-service-account-credentials=true",
                f"--service-cluster-ip-range={SERVICE_RANGE}",
                "--secure-port=0",
                "--node-monitor-period=1s",
                f"--node-monitor-grace-period={self.node_grace_s:g}s",
                "--profiling=false",
            ],
        )
        scheduler = self.kubeconfig(SCHEDULER)
        self._spawn(
            "kube-scheduler",
            [
                f"--kubeconfig={scheduler}",
                f"--authentication-kubeconfig={scheduler}",
                f"--authorization-kubeconfig={scheduler}",
                "--secure-port=0",
                "--profiling=false",
            ],
        )
        self.kubeconfig(CONTROLLER)

    def _leaders_elected(self) -> bool:
        found = self.kubectl("get", "leases", "-n", "kube-system", "-o", "name", check=False)
        return {"lease.coordination.k8s.io/kube-controller-manager",
                "lease.coordination.k8s.io/kube-scheduler"} <= set(found.split())  # fmt: skip

    def _default_account_made(self) -> bool:
        found = self.kubectl("get", "serviceaccounts", "-n", "default", "-o", "name", check=False)
        return "serviceaccount/default" in found.split()

    def kubectl(self, *args: str, check: bool = True) -> str:
        """kubectl of the control plane's version, as the administrator; its output."""
        done = subprocess.run(
            [str(self.bin / "kubectl"), f"--kubeconfig={self.admin_kubeconfig}", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check and done.returncode != 0:
            raise EngineError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def _get(self, url: str, *, tls: bool) -> bool:
        context = None
        if tls:
            context = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        try:
            with urllib.request.urlopen(url, timeout=5, context=context) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + START_S
        while not ready():
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise EngineError(f"{name} exited ({process.returncode}): {self._tail(name)}")
            if time.monotonic() > deadline:
                raise EngineError(f"{what} did not come up in {START_S:g} s")
            time.sleep(0.2)

    def _tail(self, name: str) -> str:
        with contextlib.suppress(OSError):
            lines = (self.home / "logs" / f"{name}.log").read_text(errors="replace").splitlines()
            return " | ".join(lines[-5:])
        return "(no log)"

    def stop(self) -> None:
        """Every part ended (SIGTERM, then SIGKILL after 10 s), the last started first, each
        before the next: an API server whose etcd ended first waits on it for long."""
        for process in reversed(self.processes.values()):
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()
