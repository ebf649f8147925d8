"""The engine of a simulated cluster: what the controller asks of it goes to the simulated peers.

`SimEngine` is an `Engine` (relaunch.cluster) whose nodes and pods are played by a few shard
processes (simulation.peers): starting an agent or a pod's launcher, or losing a node, is a line
written to the shard that plays that node. Nothing blocks: a shard reads its requests in its own
loop, and a writer thread per shard feeds its pipe (a shard busy connecting hundreds of peers
reads late; the controller never waits for it).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

from relaunch.cluster import NOTHING_COUNTED, EngineBase, EngineFacts, LeftBehind, Rehearsal
from relaunch.cluster.config import NodeSpec
from relaunch.protocol.links import Cut, LinkFaultKind
from relaunch.protocol.plans import LaunchPlan
from relaunch_bench.simulation.peers import SimPlan

__all__ = ["PEERS_NICE", "SimEngine"]

PEERS_NICE = 10


class SimEngine(EngineBase):
    facts = EngineFacts(
        chips="chips are simulated",
        containers="pods are simulated (no process runs a rank: bench simulation)",
        networks="nodes are simulated: every peer on the loopback",
    )

    def __init__(self, state_dir: Path, shards: int, step_s: float, steps: int) -> None:
        self.origin = time.time()
        self.shards: list[subprocess.Popen[bytes]] = []
        self.requests: list[queue.Queue[bytes | None]] = []
        self.writers: list[threading.Thread] = []
        for _ in range(shards):
            shard = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "relaunch_bench.simulation.peers",
                    str(state_dir),
                    str(step_s),
                    str(steps),
                    str(self.origin),
                ],
                stdin=subprocess.PIPE,
                # below the controller's priority: on a cluster its peers run on other
                # machines and leave its core to it; here they share two cores with it
                preexec_fn=lambda: os.nice(PEERS_NICE),
            )
            requests: queue.Queue[bytes | None] = queue.Queue()
            writer = threading.Thread(target=_feed, args=(shard, requests), daemon=True)
            writer.start()
            self.shards.append(shard)
            self.requests.append(requests)
            self.writers.append(writer)
        self.killed: dict[str, float] = {}
        """Nodes lost by the fault plan, and when."""

    def _tell(self, node: str, request: dict[str, object]) -> None:
        shard = zlib.crc32(node.encode()) % len(self.shards)
        self.requests[shard].put(json.dumps(request).encode() + b"\n")

    def start_agent(self, node: NodeSpec, interval: float, grace: float, blip_s: float) -> int:
        self._tell(
            node.name, {"op": "agent", "node": node.name, "chips": node.chips, "interval": interval}
        )
        return 0

    def start_pod(self, plan: LaunchPlan) -> int:
        self._tell(plan.node, {"op": "pod", "plan": SimPlan.of(plan)})
        return 0

    def kill_node(self, node: str) -> None:
        self.killed[node] = time.time()
        self._tell(node, {"op": "kill", "node": node})

    @property
    def rehearsal(self) -> Rehearsal:
        return self

    def shutdown(self) -> LeftBehind:
        for requests in self.requests:
            requests.put(b'{"op": "shutdown"}\n')
            requests.put(None)
        for writer in self.writers:
            writer.join(timeout=10)
        for shard in self.shards:
            try:
                shard.wait(timeout=10)
            except subprocess.TimeoutExpired:
                shard.kill()
                shard.wait()
        return NOTHING_COUNTED  # nothing runs a rank

    def lost_nodes(self) -> dict[str, str]:
        return dict.fromkeys(self.killed, "its agent exited")  # as the embedded cluster sees it

    def free_port(self, node: str) -> int:
        return 29500  # nothing listens: the simulated ranks form no group

    def inject_link_fault(
        self,
        node: str,
        kind: LinkFaultKind,
        duration_s: float | None,
        cut: Cut | None = None,
        rate_mbit: float | None = None,
    ) -> str | None:
        return "the simulation has no links"


def _feed(shard: subprocess.Popen[bytes], requests: queue.Queue[bytes | None]) -> None:
    """The shard's requests, written in order as it reads them; None closes its input."""
    pipe = shard.stdin
    assert pipe is not None
    while (request := requests.get()) is not None:
        try:
            pipe.write(request)
            if requests.empty():
                pipe.flush()
        except OSError:
            return
    with contextlib.suppress(OSError):
        pipe.close()
