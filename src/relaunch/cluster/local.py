"""The embedded cluster: simulated nodes on this machine.

Each node is a real agent process (see :mod:`relaunch.cluster.agent`); each pod is a real
launcher process with its workers. Losing a node kills its agent and every process of every pod
on it. Processes start in sessions of their own, so that they outlive a controller that dies (and
are re-adopted by the next one) but not a launcher that dies.

Where cgroups can be made (:mod:`relaunch.containers`), a node is a cgroup and each pod a cgroup
below it: the agent and each launcher are started in theirs, a rank's processes in the rank's,
and losing a node, ending a pod or shutting the cluster down is one `cgroup.kill`, which no
process of theirs escapes. A pod whose launcher died is killed by its node's agent. Elsewhere
processes are found by their process tree, as before (`containers` says why).

A simulated node lives as long as its agent process: the engine watches each agent through a
pidfd and reports the node dead (`lost_nodes`) the moment its agent has exited, as Ray reports a
node its GCS saw die. A silent agent that still lives (stopped, cut off) is found by the
heartbeat timeout, as before.

Where network namespaces can be made (:mod:`relaunch.cluster.network`), each node is one, with a
management link to the controller and a data link to its peers: its agent, launchers and ranks
run inside it, the controller listens on the management network, MASTER_ADDR is rank 0's node's
data address, and a fault plan's link faults are real. Elsewhere every node shares the loopback
(`networks` says why).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from relaunch.cluster import NOTHING_COUNTED, EngineBase, EngineFacts, LeftBehind, Rehearsal
from relaunch.cluster.network import DATA_IF, ClusterNetwork, NamespaceGone, enter_namespace
from relaunch.cluster.nvml import SIMULATE_CHIPS_ENV, gpu_count
from relaunch.containers import Cgroup, ClusterCgroups
from relaunch.protocol.layout import PodDir, StateDir
from relaunch.protocol.links import Cut, LinkFaultKind
from relaunch.protocol.plans import LaunchPlan

if TYPE_CHECKING:  # the agents and launchers that import this module need no pydantic
    from relaunch.cluster.config import NodeSpec

__all__ = ["LocalCluster", "free_port", "kill_tree"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at `host` right now."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _pid_of(ref: Any) -> int:
    """The pid a remembered process (a pid, or [pid, start time]) had."""
    return int(ref) if isinstance(ref, int) else int(ref[0])


def kill_tree(pid: int, wait: bool = True) -> None:
    """SIGKILL a process and every descendant, whatever session or group they are in; then wait
    (5 s at most) until they are gone, unless told not to."""
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)
    if wait:
        psutil.wait_procs(family, timeout=5)


class LocalCluster(EngineBase):
    """Starts and kills the processes of the embedded cluster; remembers them on disk.

    `pids.json` holds each agent's and launcher's pid with its start time. A pid is only trusted
    while the process that has it started at that time and runs from this state directory: a
    pid the kernel gave to an unrelated process since is never signalled.
    """

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.layout = StateDir(state_dir)
        self.pid_file = self.layout.pids
        self.layout.logs.mkdir(parents=True, exist_ok=True)
        self._agent_fds: dict[str, int] | None = None  # node -> its agent's pidfd, once watched
        self._poll = select.poll()
        self._watched: dict[int, str] = {}  # pidfd -> node, for the fds still registered
        self._dead: set[str] = set()
        probed = ClusterCgroups.probe(state_dir)
        self.cgroups = probed if isinstance(probed, ClusterCgroups) else None
        """The cluster's cgroups (None: pods are process groups)."""
        self.no_cgroups_because = probed if isinstance(probed, str) else None
        self._network: ClusterNetwork | str | None = None

    @property
    def network(self) -> ClusterNetwork | None:
        """The cluster's network namespaces, made at the first use (None: shared loopback)."""
        if self._network is None:
            self._network = ClusterNetwork.open(self.state_dir)
        return self._network if isinstance(self._network, ClusterNetwork) else None

    @property
    def bind_host(self) -> str:
        """Where the controller listens: its end of the management network, or the loopback."""
        network = self.network
        return network.layout.controller_address if network is not None else "127.0.0.1"

    @property
    def facts(self) -> EngineFacts:
        return EngineFacts(
            chips=self._chips(),
            containers=self._containers(),
            networks=self._networks(),
            chips_are_gpus=self.chips_are_gpus,
            nodes_share_cores=True,  # the embedded cluster's nodes are this machine
        )

    @property
    def rehearsal(self) -> Rehearsal:
        return self

    def _networks(self) -> str:
        """What a node's network is on this cluster, in words (said once at start)."""
        network = self.network
        if network is not None:
            layout = network.layout
            return (
                f"nodes are network namespaces: a management link (10.{layout.mgmt}.0.0/16, the "
                f"controller at {layout.controller_address}) and a data link "
                f"(10.{layout.data}.0.0/16) each; link faults are real"
            )
        return (
            f"nodes share the loopback, not networks of their own: {self._network}; a network "
            "fault is simulated (the agent reports it, no connection notices), partition and "
            "degraded-link faults cannot fire"
        )

    def _containers(self) -> str:
        """What a pod is on this cluster, in words (said once at start)."""
        if self.cgroups is not None:
            return f"pods are cgroups under {self.cgroups.root.path}"
        return f"pods are process groups, not cgroups: {self.no_cgroups_because}; a process that leaves its rank's process group (setsid, a daemon) can outlive its pod"

    def _pids(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.pid_file.read_text())
            if isinstance(data, dict) and {"agents", "launchers"} <= set(data):
                data.setdefault("helpers", {})
                return data
        except (OSError, ValueError):
            pass
        return {"agents": {}, "launchers": {}, "helpers": {}}

    def _save(self, pids: dict[str, dict[str, Any]]) -> None:
        tmp = self.pid_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(pids))
        tmp.replace(self.pid_file)

    def _ours(self, ref: Any) -> psutil.Process | None:
        """The live process `ref` (a pid, or [pid, start time]) names, if it is still ours: its
        pid and start time are the remembered ones. Only a pid remembered without its start
        time is also asked for its command line. A process in the middle of its exit reads as
        having none (the kernel has released its memory), and was taken for another's: it was
        neither killed nor waited for, and was then counted as left behind in its cgroup."""
        try:
            pid, started = (ref, None) if isinstance(ref, int) else (int(ref[0]), float(ref[1]))
            process = psutil.Process(pid)
            if started is not None:
                return process if abs(process.create_time() - started) <= 0.5 else None
            if str(self.state_dir) not in " ".join(process.cmdline()):
                return None
            return process
        except (psutil.Error, ValueError, TypeError, IndexError):
            return None

    def _kill(self, ref: Any, wait: bool = True) -> None:
        process = self._ours(ref)
        if process is not None:
            kill_tree(process.pid, wait)

    def processes(self, kind: str) -> list[psutil.Process]:
        """The live agents (`kind` "agents") or launchers ("launchers") this cluster started."""
        found = (self._ours(ref) for ref in self._pids()[kind].values())
        return [p for p in found if p is not None]

    def start_agent(self, node: NodeSpec, interval: float, grace: float, blip_s: float) -> int:
        self._kill(self._pids()["agents"].get(node.name))  # a node has one agent at a time
        network = self.network
        if network is not None:
            network.ensure_node(node.name)
        pid = self._spawn(
            ["relaunch.cluster.agent", "--node", node.name, "--chips", str(node.chips),
             "--first-gpu", str(node.first_gpu),
             "--interval", str(interval), "--grace", str(grace), "--blip", str(blip_s),
             *(["--network"] if network is not None else [])],
            self.layout.agent_log(node.name),
            self.cgroups.agent_placement(node.name) if self.cgroups is not None else None,
            node.name,
        )  # fmt: skip
        self._remember("agents", node.name, pid)
        self._watch_agents()
        self._watch(node.name, pid)
        return pid

    def start_pod(self, plan: LaunchPlan) -> int:
        pod = PodDir(Path(plan.workdir))
        pod.path.mkdir(parents=True, exist_ok=True)
        pod.plan.write_text(plan.to_json())
        placement = (
            self.cgroups.launcher_placement(plan.node, plan.job, plan.pod, plan.generation)
            if self.cgroups is not None
            else None
        )
        pid = self._spawn(
            ["relaunch.launcher", "--plan", str(pod.plan)], pod.launcher_log, placement, plan.node
        )
        self._remember("launchers", f"{plan.job}/{plan.pod}/{plan.generation}/{plan.node}", pid)
        return pid

    def assumed(self, job: int, node: str, pod: int, generation: int) -> None:
        """The standby launcher on `node` became the launcher of `pod` (see Launcher.assume)."""
        pids = self._pids()
        ref = pids["launchers"].pop(f"{job}/-1/0/{node}", None)
        if ref is not None:
            pids["launchers"][f"{job}/{pod}/{generation}/{node}"] = ref
            self._save(pids)

    def _spawn(
        self,
        module_and_args: list[str],
        log_path: Path,
        placement: tuple[Cgroup, list[str]] | None = None,
        node: str | None = None,
    ) -> int:
        """A relaunch process in a session of its own, so that it outlives its controller, in
        its cgroup from its first instruction, told so (`placement`), where there is one, and
        in `node`'s network namespace, where nodes have them."""
        module, *args = module_and_args
        cgroup, extra = placement if placement is not None else (None, [])
        network = self.network if node is not None else None
        namespace = network.open_namespace(node) if network is not None and node else None

        def enter() -> None:
            if cgroup is not None:
                cgroup.join()
            if namespace is not None:
                enter_namespace(namespace)

        try:
            with open(log_path, "a") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", module, "--state-dir", str(self.state_dir), *args, *extra],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=enter if cgroup is not None or namespace is not None else None,
                )  # fmt: skip
        finally:
            if namespace is not None:
                os.close(namespace)
        return proc.pid

    def _remember(self, kind: str, key: str, pid: int) -> None:
        try:
            started = psutil.Process(pid).create_time()
        except psutil.Error:
            return  # it died already: nothing to remember
        pids = self._pids()
        pids[kind][key] = [pid, started]
        self._save(pids)

    def kill_node(self, node: str) -> None:
        """A node is lost: its agent and every pod on it die at once. Without waiting for them
        to be gone: the controller calls this from its loop, and waiting for a dozen processes
        holding torch to be reaped kept it from reading for 2 s, which node-loss detection
        then measured."""
        pids = self._pids()
        if self.cgroups is not None:
            self.cgroups.node(node).kill()  # the agent, every pod, all they started: at once
        self._kill(pids["agents"].pop(node, None), wait=False)
        for key, ref in list(pids["launchers"].items()):
            if key.rsplit("/", 1)[1] == node:
                self._kill(ref, wait=False)
                del pids["launchers"][key]
        self._save(pids)

    def shutdown(self) -> LeftBehind:
        """Kill everything this cluster started and is still running. With cgroups, count
        what the pods left behind, then kill it and remove the cgroups; then the nodes'
        networks (whatever an earlier run left of them too)."""
        pids = self._pids()
        refs = [*pids["helpers"].values(), *pids["launchers"].values(), *pids["agents"].values()]
        for ref in refs:
            self._kill(ref)
        self._save({"agents": {}, "launchers": {}, "helpers": {}})
        left = NOTHING_COUNTED
        if self.cgroups is not None:
            # the cluster's own agents and launchers are not what the pods left behind, even
            # one still in its exit; a rank's process ending on its own is given a moment
            own = {_pid_of(ref) for ref in refs}
            what = self.cgroups.root.census(besides=own, settle_s=1.0)
            left = LeftBehind(len(what), tuple(what))
            self.cgroups.shutdown()
        self._unwatch_all()
        network = self.network if self._network is not None else None
        network = network or ClusterNetwork.existing(self.state_dir)
        if network is not None:
            network.remove()
        return left

    def _unwatch_all(self) -> None:
        """Close every agent's pidfd: a runner runs job after job, each with an engine of its
        own, and kept 4 descriptors a job open until it could open no more."""
        for fd in (self._agent_fds or {}).values():
            if self._watched.pop(fd, None) is not None:
                self._poll.unregister(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        self._agent_fds = None

    def lost_nodes(self) -> dict[str, str]:
        """Nodes whose agent process has exited (killed by node-down, or dead of its own): one
        poll of every agent's pidfd, without waiting."""
        self._watch_agents()
        if self._watched:
            for fd, _ in self._poll.poll(0):
                node = self._watched.pop(fd)
                self._poll.unregister(fd)
                self._dead.add(node)
        return dict.fromkeys(self._dead, "its agent exited")

    def _watch_agents(self) -> None:
        """At the first look, watch the agents an earlier controller started (a resume)."""
        if self._agent_fds is not None:
            return
        self._agent_fds = {}
        for node, ref in self._pids()["agents"].items():
            process = self._ours(ref)
            if process is not None:
                self._watch(node, process.pid)

    def _watch(self, node: str, pid: int) -> None:
        """Watch `node`'s agent `pid` from now on (a new agent replaces the one before)."""
        assert self._agent_fds is not None
        old = self._agent_fds.pop(node, None)
        if old is not None:
            if self._watched.pop(old, None) is not None:
                self._poll.unregister(old)
            os.close(old)
        self._dead.discard(node)
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):  # gone and reaped, or no pidfds: heartbeats only
            return
        self._agent_fds[node] = fd
        self._watched[fd] = node
        self._poll.register(fd, select.POLLIN)

    def node_address(self, node: str) -> str:
        network = self.network
        if network is None or node not in network.layout.nodes:
            return "127.0.0.1"
        return network.layout.data_address(node)

    def free_port(self, node: str) -> int:
        network = self.network
        if network is None or node not in network.layout.nodes:
            return free_port()
        try:
            return network.free_port(node)
        except NamespaceGone:  # a lost node: the launch there fails, the recovery asks again
            return free_port()

    @functools.cached_property
    def chips_are_gpus(self) -> bool:
        """This machine has NVIDIA GPUs (NVML sees them), and chips are not simulated: `relaunch
        run` refused a cluster of more chips than it has (nvml.chips_problem)."""
        return bool(gpu_count())

    def _chips(self) -> str:
        if self.chips_are_gpus:
            return (
                "chips are this machine's GPUs, node by node; each pod sees its own only "
                "(CUDA_VISIBLE_DEVICES)"
            )
        if os.environ.get(SIMULATE_CHIPS_ENV) == "1":
            return "chips are simulated (--simulate-chips): no pod is given a GPU"
        return "chips are simulated: NVML sees no GPU on this machine"

    def pod_environment(self, node: str) -> dict[str, str]:
        """What the ranks of a pod on `node` need to find their peers: gloo and NCCL bind the
        data link (a namespace's host name resolves to no address of its own)."""
        if self.network is None:
            return {}
        return {"GLOO_SOCKET_IFNAME": DATA_IF, "NCCL_SOCKET_IFNAME": DATA_IF}

    def inject_link_fault(
        self,
        node: str,
        kind: LinkFaultKind,
        duration_s: float | None,
        cut: Cut | None = None,
        rate_mbit: float | None = None,
    ) -> str | None:
        """Cut, partition or slow `node`'s links for real, for `duration_s` (a helper process
        applies the fault and undoes it: the loop does not wait); why not, where it cannot."""
        network = self.network
        if network is None:
            return f"nodes share the loopback ({self._network})"
        if node not in network.layout.nodes:
            return f"node {node} has no network (its agent never started)"
        args = ["--node", node, "--kind", kind.value]
        args += ["--cut", cut.value] if cut is not None else []
        args += ["--rate-mbit", str(rate_mbit)] if rate_mbit is not None else []
        args += ["--duration", str(duration_s)] if duration_s is not None else []
        placement: tuple[Cgroup, list[str]] | None = None
        if self.cgroups is not None:  # ended with the cluster, like everything it started
            placement = (self.cgroups.root.child("link-faults").make(), [])
        pid = self._spawn(
            ["relaunch.cluster.linkfault", *args],
            self.layout.logs / "network-faults.log",
            placement,
        )
        self._remember("helpers", f"{node}/{kind.value}/{pid}", pid)
        return None
