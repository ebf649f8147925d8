"""A pod's container: a cgroup (v2) that holds every process its ranks start.

A process group is not a container: a rank's helper that calls `setsid` (a log shipper, a
prefetch daemon, `nohup`), or a wrapper's child when the wrapper dies, leaves it and outlives its
pod. A cgroup is what Kubernetes gives a container: a process cannot leave it (only a writer of
`cgroup.procs`, root or the delegate, moves processes), everything it forks is born in it, and
`cgroup.kill` SIGKILLs all of it at once, recursively, with no race against forks.

Where relaunch may create cgroups (root, or a delegated subtree such as a systemd user scope)
the embedded cluster (and the Ray engine's node hosts) lays its processes out so::

    <unified mount><the creator's own cgroup>/relaunch-<state dir digest>/   one cluster
        node-<NODE>/                   a node: `cgroup.kill` here is the node going down
            agent/                     its agent (it reaps the pods below, see `reap_pods`)
            job-<J>-pod-<I>-g<G>/      a pod's container (a standby launcher: job-<J>-standby)
                launcher/              its launcher
                spares/                its warm spares, until one becomes a rank
                rank-<R>/              a rank's processes, killed whole when the rank ends

The unified hierarchy is found in /proc/self/mountinfo (here it is mounted at
/sys/fs/cgroup/unified beside cgroup v1 controllers; elsewhere at /sys/fs/cgroup). No controller
needs enabling: `cgroup.procs`, `cgroup.kill`, `cgroup.events`, `cpu.stat` and the pressure
files are in every cgroup v2 (`cgroup.kill` since Linux 5.14).

Where no cgroup can be made, `ClusterCgroups.probe` says why, and the caller keeps process groups
(and says so once at start). `RELAUNCH_CGROUPS=off` asks for that fallback on purpose.

Standard library only: this runs in launchers, agents and Ray workers.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import subprocess
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "CGROUPS_ENV",
    "Cgroup",
    "ClusterCgroups",
    "cluster_root",
    "find_unified",
    "own_cgroup",
    "pod_name",
    "reap_pods",
    "step_out",
    "unified_mount",
]

CGROUPS_ENV: Final = "RELAUNCH_CGROUPS"
"""`off`: keep pods as process groups even where cgroups could be made."""

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def unified_mount(mountinfo: str | None = None) -> Path | None:
    """Where the cgroup v2 (unified) hierarchy is mounted, from /proc/self/mountinfo."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    for line in mountinfo.splitlines():
        before, sep, after = line.partition(" - ")
        fields = before.split()
        if sep and after.split()[:1] == ["cgroup2"] and len(fields) >= 5:
            return Path(fields[4].replace("\\040", " "))
    return None


def own_cgroup(proc_cgroup: str | None = None) -> str:
    """This process's cgroup v2 path ("/" at the root), from /proc/self/cgroup's `0::` line."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return "/"
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return "/"


def pod_name(job: int, pod: int, generation: int) -> str:
    """A pod container's cgroup name (pod -1 is a job's standby launcher on a node)."""
    return f"job-{job}-standby" if pod < 0 else f"job-{job}-pod-{pod}-g{generation}"


@dataclass(frozen=True)
class Cgroup:
    """One cgroup directory. Every method tolerates a cgroup that is gone."""

    path: Path

    def child(self, name: str) -> Cgroup:
        return Cgroup(self.path / _UNSAFE.sub("_", name))

    def make(self) -> Cgroup:
        self.path.mkdir(parents=True, exist_ok=True)
        return self

    def exists(self) -> bool:
        return (self.path / "cgroup.procs").exists()

    def join(self) -> None:
        """Move the calling process here (in a child before exec: all it forks is born here).
        Made again if it is gone: the last process of a cluster removes the empty cgroups, and
        this one may have been empty a moment ago."""
        self.add(0)

    def add(self, pid: int) -> None:
        """Move process `pid` (all its threads; 0: the caller) here. Made again if it is gone
        or going: a cgroup removed between the `mkdir` and the open is not found (ENOENT), one
        removed between the open and the write answers ENODEV."""
        for _ in range(5):
            self.path.mkdir(parents=True, exist_ok=True)
            try:
                with open(self.path / "cgroup.procs", "w") as procs:
                    procs.write(str(pid))
                return
            except OSError as error:
                if error.errno not in (errno.ENOENT, errno.ENODEV):
                    raise
        raise FileNotFoundError(f"{self.path} vanished each time it was made")

    def procs(self) -> list[int]:
        """The processes in this cgroup and every cgroup below it."""
        return [pid for _, pids in self._walk() for pid in pids]

    def census(self, besides: Collection[int] = (), settle_s: float = 0.0) -> list[str]:
        """Each process here and below that lives on, as `cgroup: name (state)`, the cgroup
        relative to this one, the name and state from /proc: what a count of left-behind
        processes means. Not `besides` (processes the caller ends and waits for itself), not
        one that is gone or dead (a zombie: the kernel lists none, a process in its exit may
        be read as one), and not one that ends on its own within `settle_s`: a process in the
        middle of its exit is still listed, running (R), until the kernel has torn it down."""
        deadline = time.monotonic() + settle_s
        while True:
            found = [
                (directory, pid)
                for directory, pids in self._walk()
                for pid in pids
                if pid not in besides and _lives(pid)
            ]
            if not found or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        return [
            f"{os.path.relpath(directory, self.path)}: {_name_and_state(pid)}"
            for directory, pid in found
        ]

    def _walk(self) -> Iterator[tuple[str, list[int]]]:
        """Each cgroup here and below (a directory) with the processes in it."""
        for directory, _, _ in os.walk(self.path):
            with contextlib.suppress(OSError, ValueError):
                text = (Path(directory) / "cgroup.procs").read_text()
                yield directory, [int(pid) for pid in text.split()]

    def populated(self) -> bool:
        """Some process lives here or below (`cgroup.events`)."""
        try:
            return "populated 1" in (self.path / "cgroup.events").read_text()
        except OSError:
            return False

    def kill(self) -> int:
        """SIGKILL every process here and below at once (`cgroup.kill`); how many there were.
        Where the kernel has no `cgroup.kill` (before 5.14), each is killed by pid."""
        pids = self.procs()
        if not pids:
            return 0
        try:
            (self.path / "cgroup.kill").write_text("1")
        except OSError as error:
            if error.errno != errno.ENOENT or not self.exists():
                return len(pids)
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
        return len(pids)

    def wait_empty(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) until no process is left here; True if none is."""
        deadline = time.monotonic() + timeout
        while self.populated():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def end(self) -> int:
        """Kill every process here and below, wait (5 s at most) until they are gone, remove the
        cgroups; how many processes there were."""
        killed = self.kill()
        self.wait_empty(5)
        self.remove()
        return killed

    def remove(self) -> bool:
        """Remove this cgroup and the empty ones below it, deepest first; True if it is gone."""
        if not self.path.exists():
            return True
        for directory, _, _ in sorted(os.walk(self.path), key=lambda w: -len(w[0])):
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        return not self.path.exists()

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system) of every process that ever ran here, from `cpu.stat`."""
        try:
            for line in (self.path / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
        except (OSError, ValueError):
            return None
        return None

    def io_bytes(self) -> int | None:
        """Bytes read and written here, from `io.stat` (None: no io controller here)."""
        try:
            text = (self.path / "io.stat").read_text()
        except OSError:
            return None
        total = 0
        for line in text.splitlines():
            for item in line.split()[1:]:
                key, _, value = item.partition("=")
                if key in ("rbytes", "wbytes") and value.isdigit():
                    total += int(value)
        return total


PRIVATE_MOUNT: Final = Path("/run/relaunch/cgroup2")
"""Where relaunch mounts the unified hierarchy itself when none is visible in a private mount
namespace (`ip netns exec` gives each command one, with a fresh /sys that hides
/sys/fs/cgroup): every cgroup2 mount shows the one hierarchy, and the mount ends with the
namespace."""


def _sys_remounted(mountinfo: str) -> bool:
    """No cgroup file system (v1 or v2) is visible at all: this process sees a /sys mounted
    anew (`ip netns exec`), not the machine's, whose cgroups are mounted somewhere."""
    return not any(
        line.partition(" - ")[2].split()[:1] in (["cgroup"], ["cgroup2"])
        for line in mountinfo.splitlines()
    )


def find_unified() -> Path | None:
    """The unified hierarchy's mount; where no cgroup file system is visible at all (a private
    mount namespace with a fresh /sys), as root, mounted at PRIVATE_MOUNT. A machine whose
    cgroups are v1 only is left as it is."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    found = unified_mount(mountinfo)
    if found is not None or os.geteuid() != 0 or not _sys_remounted(mountinfo):
        return found
    try:
        PRIVATE_MOUNT.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "cgroup2", "cgroup2", str(PRIVATE_MOUNT)],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return unified_mount()


def cluster_root(state_dir: Path) -> Cgroup | None:
    """Where the cluster of `state_dir` has its cgroups, made or not (None: no cgroup v2)."""
    mount = find_unified()
    if mount is None:
        return None
    digest = hashlib.sha1(str(state_dir.resolve()).encode()).hexdigest()[:10]
    return Cgroup(mount / own_cgroup().lstrip("/") / f"relaunch-{digest}")


class ClusterCgroups:
    """The cgroups of one embedded cluster (one state directory), see the module docstring."""

    def __init__(self, root: Cgroup) -> None:
        self.root = root

    @staticmethod
    def probe(state_dir: Path) -> ClusterCgroups | str:
        """This cluster's cgroups if they can be made here (a test cgroup is made, joined by
        nothing, and removed), else why not, in words a user can act on."""
        if os.environ.get(CGROUPS_ENV, "").lower() in ("off", "0", "no", "false"):
            return f"{CGROUPS_ENV}=off"
        root = cluster_root(state_dir)
        if root is None:
            return "no cgroup v2 hierarchy is mounted (see /proc/self/mountinfo)"
        base = root.path.parent
        # a probe of this process's own: the node hosts of a Ray trial cluster probe at once on
        # one machine, and one's cleanup took another's probe away before it was looked at
        trial = root.child(f"probe-{os.getpid()}")
        made_root = not root.path.exists()
        try:
            trial.make()
            killable = (trial.path / "cgroup.kill").exists()
        except OSError as error:
            return f"cannot create a cgroup under {base} ({error.strerror}): run as root or in a delegated cgroup"
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(trial.path)  # nothing is left of the probe
        if made_root:  # unless another process has made its cgroups there meanwhile
            with contextlib.suppress(OSError):
                os.rmdir(root.path)
        if not killable:
            return "this kernel's cgroups have no cgroup.kill (Linux 5.14 or later needed)"
        return ClusterCgroups(root)

    def node(self, name: str) -> Cgroup:
        return self.root.child(f"node-{name}")

    def agent(self, node: str) -> Cgroup:
        return self.node(node).child("agent")

    def pod(self, node: str, job: int, pod: int, generation: int) -> Cgroup:
        return self.node(node).child(pod_name(job, pod, generation))

    def pods(self, node: str) -> list[Cgroup]:
        """The pod containers on `node` now."""
        try:
            names = sorted(p.name for p in self.node(node).path.iterdir() if p.is_dir())
        except OSError:
            return []
        return [self.node(node).child(n) for n in names if n.startswith("job-")]

    def agent_placement(self, node: str) -> tuple[Cgroup, list[str]]:
        """The cgroup `node`'s agent starts in (made), and the arguments that tell it the
        cluster's."""
        return self.agent(node).make(), ["--cgroups", str(self.root.path)]

    def launcher_placement(
        self, node: str, job: int, pod: int, generation: int
    ) -> tuple[Cgroup, list[str]]:
        """The cgroup a pod's launcher starts in (made), and the arguments that tell it its
        pod's."""
        container = self.pod(node, job, pod, generation).make()
        return launcher_cgroup(container).make(), ["--container", str(container.path)]

    def shutdown(self) -> int:
        """Kill every process of the cluster and remove its cgroups; how many processes were
        still there."""
        return self.root.end()


def _lives(pid: int) -> bool:
    """The process has not ended: it is there, and neither a zombie (Z) nor dead (X)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X")


def _name_and_state(pid: int) -> str:
    """`comm (state)` of a process from /proc/PID/stat, or `pid N (gone)`."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return f"pid {pid} (gone)"
    name = stat[stat.find("(") + 1 : stat.rfind(")")]
    return f"{name} ({stat[stat.rfind(')') + 2 :].split(' ', 1)[0]})"


def step_out(cgroup: Cgroup, levels: int) -> None:
    """The calling process, about to exit, leaves the cluster's cgroups (for the parent of the
    cluster's root, `levels` above `cgroup`'s parent: where their creator made them), and every
    cgroup of the cluster that is then empty is removed (a populated one cannot be): the last
    process of an abandoned cluster to exit leaves no cgroup behind. One made a moment ago for
    a process still to start is made again when that process joins it (`Cgroup.join`)."""
    top = cgroup.path.parents[levels]
    with contextlib.suppress(OSError):
        Cgroup(top.parent).join()
        Cgroup(top).remove()  # every empty cgroup of the cluster: a lost node's, this one's


def launcher_cgroup(pod: Cgroup) -> Cgroup:
    return pod.child("launcher")


def reap_pods(cluster: ClusterCgroups, node: str, seen: set[Path]) -> int:
    """One look of a node's agent at the pods on its node: a pod whose launcher has died is
    killed whole (the ranks' processes, their helpers) and its cgroups removed. A pod whose
    launcher this look has never seen alive is left alone while it has no other process (it may
    be starting). `seen` is the agent's memory of launchers it saw alive; what it reaped is
    forgotten. How many processes were killed."""
    killed = 0
    for pod in cluster.pods(node):
        if launcher_cgroup(pod).populated():
            seen.add(pod.path)
            continue
        if pod.path not in seen and not pod.populated():
            continue
        killed += pod.kill()
        if pod.wait_empty(1.0):
            pod.remove()
            seen.discard(pod.path)
    return killed
