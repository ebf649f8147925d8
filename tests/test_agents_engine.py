"""A fixed set of machines without a scheduler: `relaunch agent` started by hand on each, and
`relaunch run --engine agents --address HOST:PORT` (docs/slurm.md, "The agent is one program").

The machines are two network namespaces with addresses of their own (cluster.network); the
controller listens in the root namespace on the address the agents were given.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from relaunch.cluster.local import free_port
from relaunch.cluster.network import NETNS_DIR, ClusterNetwork
from tests.runtime import DDP_CLUSTER, ROOT, Cluster, ddp_job

MACHINES = ["a", "b"]


@pytest.fixture
def machines(tmp_path: Path) -> Iterator[ClusterNetwork]:
    why = ClusterNetwork.unavailable()
    if why is not None:
        pytest.skip(f"needs network namespaces for the machines: {why}")
    network = ClusterNetwork.open(tmp_path / "machines")
    assert isinstance(network, ClusterNetwork), network
    for name in MACHINES:
        network.ensure_node(name)
    yield network
    network.remove()


def test_agents_started_by_hand_on_two_machines_run_the_ddp_example_through_a_crash(
    machines: ClusterNetwork, tmp_path: Path, unbroken: str
) -> None:
    """Each machine's agent is started by hand (`relaunch agent --controller HOST:PORT`) before
    the controller; the job's pods start on them, find rank 0 on machine a's own address, come
    through a crash by a job-level restart, and end bit-identical to a fault-free run; the
    agents exit with the job."""
    address = f"{machines.layout.controller_address}:{free_port()}"
    state = tmp_path / "state"
    agents = []
    for name in MACHINES:
        namespace = NETNS_DIR / machines.layout.namespace(name)
        log = open(tmp_path / f"agent-{name}.log", "w")  # noqa: SIM115
        command = ["nsenter", f"--net={namespace}", sys.executable, "-m", "relaunch", "agent",
                   "--controller", address, "--node", name, "--state-dir", str(state)]  # fmt: skip
        environment = {**os.environ, "GLOO_SOCKET_IFNAME": "mgmt0"}
        agents.append(
            subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)
        )
    try:
        # both agents up and waiting before the controller exists, as an operator starts them
        deadline = time.monotonic() + 60
        while not all("ready;" in _said(tmp_path, name) for name in MACHINES):
            assert all(a.poll() is None for a in agents), [_said(tmp_path, n) for n in MACHINES]
            assert time.monotonic() < deadline, [_said(tmp_path, n) for n in MACHINES]
            time.sleep(0.1)
        cluster = {**DDP_CLUSTER, "nodes": [{"name": n, "chips": 2} for n in MACHINES]}
        faults = [{"kind": "process-exit", "at_step": 30, "pod": 1, "rank": 1, "exit_code": 1}]
        out = tmp_path / "hash.txt"
        runs = Cluster(tmp_path)
        runs.state = state
        engine = ("--engine", "agents", "--address", address)
        command = runs.command(ddp_job(out, 10), faults, cluster, engine, startup_s=60)
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
        log = done.stdout + done.stderr
        assert done.returncode == 0, log
        assert "job-reschedule worked" in log, log
        assert out.read_text().strip() == unbroken, log
        for agent in agents:
            assert agent.wait(timeout=30) == 0  # told to end with the job
        said = (tmp_path / "agent-a.log").read_text()
        assert "the pods left 0 process(es)" in said, said
        plans = [yaml.safe_load(p.read_text()) for p in state.glob("jobs/*/pods/*/launch.json")]
        assert {p["node"] for p in plans} == set(MACHINES)
    finally:
        for agent in agents:
            agent.kill()
            agent.wait()


def _said(tmp_path: Path, machine: str) -> str:
    return (tmp_path / f"agent-{machine}.log").read_text()
