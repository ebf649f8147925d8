"""relaunch on Ray with real links: a trial Ray cluster whose nodes are network namespaces
(`python -m relaunch.cluster.ray --network`: each node's `ray start` in a namespace of the
embedded cluster's kind, with a management and a data link; the head and relaunch on the
controller's address). The ranks' collectives go over the nodes' data links, as a user points
gloo or NCCL at their fabric, and a flap of one is real: the SDK's report of the failed
collective travels its launcher's path to the controller on Ray as on the embedded cluster
(test_operator_retry) and on Slurm (test_slurm)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml

from relaunch.cluster.network import NETNS_DIR, ClusterNetwork
from tests.runtime import (
    DDP_CLUSTER,
    ROOT,
    Cluster,
    assert_issued_again_nothing_restarted,
    flap_pod_1_at_step_40,
)
from tests.test_operator_retry import ddp as ddp_command
from tests.test_operator_retry import job as operator_retry_job

NODES = ["node-0", "node-1"]


@dataclass
class RayOnLinks:
    """The module's cluster: its address, and its network (whose switch ports are the links)."""

    address: str
    network: ClusterNetwork

    def set_data_link(self, node: str, up: bool) -> None:
        """`node`'s data link (its switch port) down or up again."""
        layout = self.network.layout
        state = "up" if up else "down"
        port = f"d{layout.nodes[node]}"
        subprocess.run(["ip", "-n", layout.switch, "link", "set", port, state], check=True)


def _in_namespaces(inodes: set[int]) -> list[psutil.Process]:
    """Live processes in any of the network namespaces `inodes`."""
    found = []
    for process in psutil.process_iter(["status"]):
        if process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if os.stat(f"/proc/{process.pid}/ns/net").st_ino in inodes:
                found.append(process)
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def ray_on_links(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayOnLinks]:
    why = ClusterNetwork.unavailable()
    if why is not None:
        pytest.fail(f"the Ray nodes' links are network namespaces: {why} (CI runs as root)")
    tmp = tmp_path_factory.mktemp("ray-links")
    shape, status = tmp / "cluster.yaml", tmp / "status.json"
    shape.write_text(yaml.safe_dump({"nodes": len(NODES), "chips_per_node": 2}))
    keeper = subprocess.Popen(
        [sys.executable, "-m", "relaunch.cluster.ray", "--cluster", str(shape),
         "--status", str(status), "--network", str(tmp / "network")],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    inodes: set[int] = set()
    try:
        deadline = time.monotonic() + 150
        while True:
            up = json.loads(status.read_text()) if status.exists() else {}
            if up.get("alive") == NODES:
                break
            assert keeper.poll() is None, (tmp / "status.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"the Ray nodes did not come up: {up}"
            time.sleep(0.2)
        network = ClusterNetwork.existing(tmp / "network")
        assert network is not None
        inodes = {os.stat(NETNS_DIR / network.layout.namespace(n)).st_ino for n in NODES}
        yield RayOnLinks(str(up["address"]), network)
    finally:
        keeper.send_signal(signal.SIGTERM)
        keeper.wait(timeout=90)
    left = _in_namespaces(inodes)
    assert not left, f"processes outlived the cluster: {[p.cmdline() for p in left]}"
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"rl{network.layout.digest}" not in names, names  # the switch's and every node's


def test_r29_a_flap_of_a_ray_nodes_data_link_issues_the_collective_again_nothing_restarts(
    ray_on_links: RayOnLinks, tmp_path: Path, unbroken_process_pair: str
) -> None:
    """Pod 1's node's data link down for 6 s in the middle of training, under relaunch's Ray
    engine: the collective that failed is issued again once the link is back, no process
    restarts, no step runs twice, and the job ends bit-identical to the fault-free run."""
    cluster = Cluster(tmp_path)
    out, steps = tmp_path / "hash.txt", tmp_path / "steps.txt"
    spec = operator_retry_job(f"{ddp_command(out, steps)} --step-seconds 0.1")
    shape = {**DDP_CLUSTER, "nodes": len(NODES)}
    engine = ("--engine", "ray", "--address", ray_on_links.address)
    args = cluster.command(spec, [], shape, extra=engine, startup_s=60)
    with open(tmp_path / "out.txt", "w") as output:
        run = subprocess.Popen(args, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
    try:
        flap_pod_1_at_step_40(tmp_path, ray_on_links.set_data_link)
        code = run.wait(timeout=240)
    finally:
        run.kill()
    log = (tmp_path / "out.txt").read_text()
    result = cluster.result(code, log)
    assert code == 0, log
    assert_issued_again_nothing_restarted(result, steps, out, unbroken_process_pair)
