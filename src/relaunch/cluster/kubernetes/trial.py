"""A real Kubernetes cluster on this machine, for the tests, the bench and users to try: the
control plane (controlplane.ControlPlane) and one relaunch agent per node as its kubelet
(kubelet.NodeKubelet), each under its node's own identity; kept in `home`.

Run `python -m relaunch.cluster.kubernetes.trial HOME NODE...` to keep one up by hand: it prints
`KUBECONFIG=<path>` once every node is Ready (kubectl of the control plane's version is in
build/k8s/bin); Ctrl-C ends it, and everything it started.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from relaunch.cluster.kubernetes.controlplane import START_S, ControlPlane
from relaunch.cluster.kubernetes.pki import CONTROLLER
from relaunch.cluster.local import kill_tree
from relaunch.errors import EngineError

__all__ = ["TrialKubernetes"]


class TrialKubernetes:
    """A local Kubernetes cluster of `nodes` (see the module docstring)."""

    def __init__(self, home: Path, nodes: list[str], chips: int = 2, node_grace_s: float = 10.0):
        self.home = home
        self.nodes = nodes
        self.chips = chips
        self.plane = ControlPlane(home, node_grace_s=node_grace_s)
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []

    @property
    def controller_kubeconfig(self) -> Path:
        """relaunch's controller's own identity on this cluster (RBAC: manifests/)."""
        return self.plane.kubeconfig(CONTROLLER)

    def start(self, progress: Callable[[str], None] = print) -> Path:
        """The control plane, then every node's agent; the administrator's kubeconfig once
        every node is Ready."""
        admin = self.plane.start(progress)
        try:
            for node in self.nodes:
                self.start_agent(node)
            self._wait_ready(self.nodes)
        except BaseException:
            self.stop()
            raise
        progress(f"{len(self.nodes)} node(s) Ready: {', '.join(self.nodes)}")
        return admin

    def start_agent(self, node: str) -> None:
        """`node`'s agent (again, after a lost node: the same Node comes back)."""
        state = self.home / "nodes" / node
        state.mkdir(parents=True, exist_ok=True)
        log = open(self.home / "logs" / f"agent-{node}.log", "ab")  # noqa: SIM115
        self._logs.append(log)
        self.agents[node] = subprocess.Popen(
            [sys.executable, "-m", "relaunch.cluster.agent", "--state-dir", str(state),
             "--node", node, "--chips", str(self.chips), "--simulate-chips",
             "--address", "127.0.0.1", "--kubeconfig", str(self.plane.kubeconfig_of_node(node))],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def ready_nodes(self) -> set[str]:
        listed = json.loads(self.plane.kubectl("get", "nodes", "-o", "json"))
        return {
            n["metadata"]["name"]
            for n in listed["items"]
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in n.get("status", {}).get("conditions", [])
            )
        }

    def _wait_ready(self, nodes: list[str]) -> None:
        deadline = time.monotonic() + START_S
        while not set(nodes) <= self.ready_nodes():
            for node, agent in self.agents.items():
                if agent.poll() is not None:
                    raise EngineError(f"the agent of node {node} exited ({agent.returncode})")
            if time.monotonic() > deadline:
                raise EngineError(f"nodes not Ready in {START_S:g} s: {nodes}")
            time.sleep(0.2)

    def kill_agent(self, node: str) -> None:
        """`node` lost: its agent and every pod it started, killed at once."""
        agent = self.agents.pop(node, None)
        if agent is not None:
            kill_tree(agent.pid)
            agent.wait()

    def stop(self) -> None:
        for node in list(self.agents):
            self.kill_agent(node)
        self.plane.stop()
        for log in self._logs:
            log.close()
        self._logs.clear()


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m relaunch.cluster.kubernetes.trial HOME NODE...", file=sys.stderr)
        return 2
    home = Path(argv[0]).resolve()
    trial = TrialKubernetes(home, argv[1:])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        admin = trial.start(lambda text: print(f"[trial] {text}", flush=True))
    except EngineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"KUBECONFIG={admin}", flush=True)
    print(f"[trial] relaunch's controller: --kubeconfig {trial.controller_kubeconfig}; kubectl: "
          f"{trial.plane.bin / 'kubectl'}; Ctrl-C ends the cluster", flush=True)  # fmt: skip
    try:
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        trial.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
