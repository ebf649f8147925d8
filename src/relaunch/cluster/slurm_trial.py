"""A real Slurm cluster on this machine, for the tests and the bench (root, Debian's Slurm).

`TrialSlurm` starts its own munged (a fresh key, a socket of its own), a generated slurm.conf, a
slurmctld in the root network namespace and one slurmd per node, each node a network namespace
of the embedded cluster's kind (`cluster.network`: its own management and data addresses on a
bridge, so that a node cut off or lost is real). A slurmd is started in its namespace with
`nsenter --net` (`ip netns exec` remounts /sys, and slurmd then fails on cgroups) and a mount
namespace whose /etc/hosts names every node (`NAME` its management address, `NAME-data` its data
one), so that names resolve on every node as on a real cluster, several on one
host by name (`slurmd -N NAME`, `%n` in the spool, pid and log paths), with process groups for
tracking and no task plugin (`proctrack/pgid`, `task/none`): nothing here touches the machine's
own Slurm or munge, if it has any. `stop` ends every daemon and job and removes the namespaces.

Run `python -m relaunch.cluster.slurm_trial HOME NODE...` to keep one up by hand (Ctrl-C ends it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Final

from relaunch.cluster.local import free_port
from relaunch.cluster.network import NETNS_DIR, ClusterNetwork
from relaunch.errors import EngineError

__all__ = ["TrialSlurm", "unavailable"]

DAEMONS: Final = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol")
CRED_EXPIRE_S: Final = 10
"""A job step credential's lifetime, and so how long a requeued job waits to start again
(Slurm's default is 120 s)."""


def unavailable() -> str | None:
    """Why this machine cannot run a trial Slurm cluster (None: it can)."""
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return f"Slurm and munge are not installed ({', '.join(missing)}; `make slurm` as root)"
    if os.geteuid() != 0:
        return "a trial Slurm cluster needs root (slurmd, network namespaces)"
    return ClusterNetwork.unavailable()


class TrialSlurm:
    """A local Slurm cluster of `nodes` (see the module docstring), kept in `home`."""

    def __init__(self, home: Path, nodes: list[str], cpus: int = 2) -> None:
        self.home = home
        self.nodes = nodes
        self.cpus = cpus
        self.conf = home / "slurm.conf"
        self.socket = home / "munge" / "socket"
        self.network: ClusterNetwork | None = None
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def env(self) -> dict[str, str]:
        """The environment Slurm's commands find this cluster by."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60.0) -> TrialSlurm:
        why = unavailable()
        if why is not None:
            raise EngineError(why)
        try:
            self._start_munge()
            network = ClusterNetwork.open(self.home / "network")
            if isinstance(network, str):
                raise EngineError(network)
            self.network = network
            for node in self.nodes:
                network.ensure_node(node)
            self._write_conf()
            self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            for node in self.nodes:
                self.start_node(node)
            self.wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self) -> None:
        munge = self.socket.parent
        munge.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._daemon(
            "munged",
            ["munged", "-F", "--force", f"--socket={self.socket}", f"--key-file={key}",
             f"--pid-file={munge / 'pid'}", f"--log-file={munge / 'log'}",
             f"--seed-file={munge / 'seed'}"],
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            if time.monotonic() > deadline or self.daemons["munged"].poll() is not None:
                raise EngineError(f"munged did not start (see {munge / 'log'})")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        assert self.network is not None
        layout = self.network.layout
        home = self.home
        (home / "state").mkdir(exist_ok=True)
        (home / "log").mkdir(exist_ok=True)
        lines = [
            "ClusterName=relaunch",
            f"SlurmctldHost={socket.gethostname()}({layout.controller_address})",
            "MailProg=/bin/true",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            # a requeued job waits out its last credential's lifetime (120 s by default)
            f"AuthInfo=socket={self.socket},cred_expire={CRED_EXPIRE_S}",
            "CredType=cred/munge",
            f"StateSaveLocation={home / 'state'}",
            f"SlurmdSpoolDir={home / 'spool' / '%n'}",
            f"SlurmctldPidFile={home / 'slurmctld.pid'}",
            f"SlurmdPidFile={home / 'spool' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={home / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={home / 'log' / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/pgid",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SelectType=select/linear",
            # the backfill pass, not an event, starts a requeued job once its credential is out
            # (every 30 s by default): each second, so a requeue costs cred_expire, not 30 s more
            "SchedulerParameters=bf_interval=1",
            "ReturnToService=2",
            "SlurmdTimeout=5",
            "InactiveLimit=0",
            "KillWait=2",
            "MinJobAge=600",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
        ]
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeAddr={layout.mgmt_address(node)} CPUs={self.cpus} "
                "State=UNKNOWN"
            )
        lines.append(f"PartitionName=main Nodes={','.join(self.nodes)} Default=YES State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _daemon(self, name: str, args: list[str]) -> None:
        log = self.home / "log" / f"{name}.out"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.daemons[name] = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True,
            )  # fmt: skip

    def start_node(self, node: str) -> None:
        """`node`'s slurmd, in its namespace (again, after `kill_node`); not waited for."""
        assert self.network is not None
        daemon = self.daemons.get(f"slurmd-{node}")
        if daemon is not None and daemon.poll() is None:
            return
        (self.home / "spool" / node).mkdir(parents=True, exist_ok=True)
        namespace = NETNS_DIR / self.network.layout.namespace(node)
        hosts = self._hosts()
        # a mount namespace of its own (mounts still shared from the machine's), whose /etc/hosts
        # names every node, as a real cluster's names resolve: what slurmd starts sees it too
        self._daemon(
            f"slurmd-{node}",
            ["nsenter", f"--net={namespace}", "unshare", "--mount", "--propagation", "slave",
             "sh", "-c", f'mount --bind "{hosts}" /etc/hosts && exec "$@"', "slurmd",
             "slurmd", "-D", "-f", str(self.conf), "-N", node],
        )  # fmt: skip

    def _hosts(self) -> Path:
        """The nodes' /etc/hosts: the machine's own lines, then each node's management address
        by its name and its data address by `NAME-data`."""
        assert self.network is not None
        layout = self.network.layout
        hosts = self.home / "hosts"
        own = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else ""
        lines = [own.rstrip(), "# the trial Slurm cluster's nodes"]
        for name in self.nodes:  # and as IPv4-mapped addresses: c10d's store listens on IPv6
            named = {layout.mgmt_address(name): name, layout.data_address(name): f"{name}-data"}
            for address, alias in named.items():
                lines += [f"{address} {alias}", f"::ffff:{address} {alias}"]
        hosts.write_text("\n".join(lines) + "\n")
        return hosts

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until every node is idle in `sinfo`."""
        deadline = time.monotonic() + timeout
        while True:
            done = self.slurm(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
            if all(states.get(node) == "idle" for node in self.nodes):
                return
            if time.monotonic() > deadline:
                raise EngineError(
                    f"the trial Slurm cluster did not come up: {states or done.stderr}"
                )
            time.sleep(0.2)

    def slurm(self, args: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Slurm command against this cluster."""
        return subprocess.run(
            args, env=self.env, capture_output=True, text=True, timeout=30, check=check
        )

    def kill_node(self, node: str) -> None:
        """The node dies: its slurmd and everything running in its namespace, at once."""
        self._kill_in_namespace(node)
        daemon = self.daemons.pop(f"slurmd-{node}", None)
        if daemon is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()

    def cut_node(self, node: str, cut: bool = True) -> None:
        """The node cut off from every other (its management link's switch port down), but
        running: silent to the controller and to slurmctld alike; `cut=False` joins it again."""
        assert self.network is not None
        layout = self.network.layout
        state = "down" if cut else "up"
        subprocess.run(
            ["ip", "-n", layout.switch, "link", "set", f"m{layout.nodes[node]}", state], check=True
        )

    def set_data_link(self, node: str, up: bool) -> None:
        """The node's data link (its switch port) down or up again: its ranks' collectives fail
        where they talk over it (`GLOO_SOCKET_IFNAME=data0`); the agent and Slurm, on the
        management link, hear nothing of it."""
        assert self.network is not None
        layout = self.network.layout
        state = "up" if up else "down"
        subprocess.run(
            ["ip", "-n", layout.switch, "link", "set", f"d{layout.nodes[node]}", state], check=True
        )

    def _kill_in_namespace(self, node: str) -> None:
        if self.network is None:
            return
        namespace = self.network.layout.namespace(node)
        pids = subprocess.run(
            ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False
        ).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    def stop(self) -> None:
        """Every job cancelled, every daemon ended, the namespaces removed."""
        if "slurmctld" in self.daemons:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                self.slurm(["scancel", "--full", "--user=root"], check=False)
        for node in self.nodes:
            self._kill_in_namespace(node)
        for daemon in self.daemons.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.wait(timeout=10)
        self.daemons.clear()
        if self.network is not None:
            self.network.remove()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m relaunch.cluster.slurm_trial HOME NODE...", file=sys.stderr)
        sys.exit(2)
    trial = TrialSlurm(Path(args[0]).resolve(), args[1:]).start()
    print(f"up: export SLURM_CONF={trial.conf}", flush=True)
    ended = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda *_: ended.set())  # also where a shell ignored SIGINT
    try:
        while not ended.wait(1.0):
            pass
    finally:
        trial.stop()


if __name__ == "__main__":
    main()
