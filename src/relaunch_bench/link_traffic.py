"""What a link fault does in the bench's network rows (relaunch_bench.network): the bytes a
node's data link carries while it is down or slow (read from its veth's counters), and the
fault fired at a replica's step as its timeline shows it.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relaunch.cluster.network import DATA_IF, ClusterNetwork
from relaunch.protocol.links import Cut, LinkFaultKind
from relaunch_bench import timeline
from relaunch_bench.jobs import FAULT_STEP

CARRIED_BYTES_PER_S = 10_000.0
"""Below this, a data link carried none of a system's collectives before a fault cut it (a
gloo all-reduce of the bench's model at its step rate moves hundreds of kB a second; a fresh
idle link, its neighbour discoveries, about 1 kB a second)."""


@dataclass
class LinkTraffic:
    """What the cut link carried: its bytes a second from the start of the run to the cut, and
    its bytes while cut (None: not read). A flap row counts only where the cut link carried the
    system's collectives, and traffic on it stopped while it was down: a row that moved 2,000-
    fold between two runs (torchft's survivor, 65.4 s then 0.03 s) is no measurement unless
    the flap cut what that system sends."""

    before_bytes_per_s: float | None = None
    during_bytes: int | None = None

    @property
    def carried(self) -> bool:
        before, during = self.before_bytes_per_s, self.during_bytes
        if before is None or during is None:
            return False
        return before >= CARRIED_BYTES_PER_S and during < before

    def describe(self) -> str:
        if self.before_bytes_per_s is None or self.during_bytes is None:
            return "the cut link's traffic could not be read"
        said = (
            f"the cut link carried {self.before_bytes_per_s / 1000:.1f} kB/s before the flap, "
            f"{self.during_bytes} B while down"
        )
        return said if self.carried else f"{said}: it carried none of this system's collectives"


def data_link_bytes(network: ClusterNetwork, node: str) -> int | None:
    """The bytes `node`'s data link has sent and received (its counters, read in its namespace
    through iproute2's JSON); None where they cannot be read."""
    done = subprocess.run(
        ["ip", "-n", network.layout.namespace(node), "-s", "-j", "link", "show", "dev", DATA_IF],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        stats = json.loads(done.stdout)[0]["stats64"]
        return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])
    except (ValueError, LookupError, TypeError):
        return None


def _fault_at_step(
    network: ClusterNetwork,
    fault: dict[str, Any],
    path: Path,
    agents: list[Any],
    replica: int | None = None,
) -> LinkTraffic:
    """Apply `fault` to node-1 once rank 0 (torchft: `replica`) passed FAULT_STEP; undo it after
    its duration. What node-1's data link carried before and during it: filled in by the time
    the fault is undone."""
    traffic = LinkTraffic()
    began, first = time.time(), data_link_bytes(network, "node-1")
    deadline = began + 120
    while time.time() < deadline and all(a.poll() is None for a in agents):
        if _stepped_past(path, FAULT_STEP, replica):
            break
        time.sleep(0.05)
    cut_at, at_cut = time.time(), data_link_bytes(network, "node-1")
    if first is not None and at_cut is not None and cut_at > began:
        traffic.before_bytes_per_s = (at_cut - first) / (cut_at - began)
    kind = {
        "network": LinkFaultKind.DOWN,
        "partition": LinkFaultKind.PARTITION,
        "degraded-link": LinkFaultKind.DEGRADED,
    }[fault["kind"]]
    cut = Cut(fault["cut"]) if "cut" in fault else None
    network.apply("node-1", kind, cut, fault.get("rate_mbit"))
    duration = fault.get("duration_s")
    if duration is not None:

        def undo() -> None:
            before_undo = data_link_bytes(network, "node-1")
            if at_cut is not None and before_undo is not None:
                traffic.during_bytes = before_undo - at_cut
            with contextlib.suppress(OSError):
                network.apply("node-1", kind, cut, fault.get("rate_mbit"), undo=True)

        threading.Timer(duration, undo).start()
    return traffic


def _stepped_past(path: Path, step: int, replica: int | None) -> bool:
    """Rank 0's timeline (`event step time`), or torchft's (`event step time replica`)."""
    if replica is None:
        return any(e == "step" and s >= step for e, s, _ in timeline.read(path))
    lines = path.read_text().splitlines() if path.exists() else []
    return any(
        len(f) == 4 and f[0] == "step" and int(f[1]) >= step and int(f[3]) == replica
        for f in (line.split() for line in lines)
    )
