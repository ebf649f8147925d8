"""The controller and the launchers wake when something happens, not on a clock: what that must
not cost. A controller that fell behind never blames a node for its own lateness; an exit is
heard at once though the process's output stays open and the monitor interval is an hour; the
controller's one selector reads whole messages from many peers and hears each one leave; a rank
that showed progress since its last usage sample is not judged on that sample."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

from relaunch.controller import checks
from relaunch.controller.detectors import rank_active
from relaunch.controller.listener import Listener
from relaunch.controller.peers import Rank
from relaunch.protocol.messages import AgentHello, Heartbeat, encode
from relaunch.protocol.wire import Connection
from relaunch.store import JobStatus, NodeState
from tests.controller_sim import Sim, job_spec
from tests.runtime import Cluster, toy_job


def node_states(sim: Sim) -> dict[str, NodeState]:
    return {n.name: n.state for n in sim.store.nodes()}


def test_a_controller_that_fell_behind_declares_no_node_lost_and_still_finds_the_silent_one(
    tmp_path: Path,
) -> None:
    sim = Sim(tmp_path, job_spec({"fault-tolerance/job-retry-num": "2"}), nodes=4)
    sim.boot()
    c = sim.controller
    sim.silent = {"node-3"}  # a standby node's agent falls silent
    sim.run(0.5)
    # The controller stalls for twice the heartbeat timeout without reading a message: every
    # agent looks silent, but it has read nothing since, so none is lost.
    c.caught_up_at = sim.clock.now()
    sim.clock.t += 2 * sim.cluster.heartbeat_timeout_s
    checks.heartbeats(c, sim.clock.now())
    assert set(node_states(sim).values()) == {NodeState.READY}
    # Once it has read again, the agents that beat are alive and the silent one is lost.
    sim.run(0.5)
    states = node_states(sim)
    assert states.pop("node-3") is NodeState.LOST
    assert set(states.values()) == {NodeState.READY}
    assert c.job.status is JobStatus.RUNNING


def test_a_usage_sample_after_other_signs_of_life_is_only_a_baseline() -> None:
    """The launcher does not sample ranks that reported a step or printed since its last sample:
    the next sample spans that time, and its CPU proves nothing about now."""
    stepped = Rank(attempt=1, last_activity=15.0, usage=(10.0, 1.0, 0))
    assert not rank_active(stepped, cpu=9.0, io=0, now=20.0, uses_sdk=True)
    silent = Rank(attempt=1, last_activity=5.0, usage=(10.0, 1.0, 0))
    assert rank_active(silent, cpu=9.0, io=0, now=20.0, uses_sdk=True)
    assert not rank_active(silent, cpu=1.0, io=0, now=20.0, uses_sdk=True)


def test_the_listener_reads_whole_messages_from_many_peers_and_hears_each_leave() -> None:
    listener = Listener("127.0.0.1")
    peers = [socket.create_connection(listener.address) for _ in range(3)]
    try:
        beat = (encode(Heartbeat("node-1", 1.0, (), None)) + "\n").encode()
        peers[0].sendall(beat[:10])  # half a message: nothing yet
        peers[1].sendall((encode(AgentHello("node-2", 2)) + "\n").encode() + b"not json\n")
        got = _poll_until(listener, 1)
        assert [m for _, m in got] == [AgentHello("node-2", 2)]  # the garbage line is skipped
        peers[0].sendall(beat[10:] + beat)
        got = _poll_until(listener, 2)
        assert [m for _, m in got] == [Heartbeat("node-1", 1.0, (), None)] * 2
        peers[2].close()
        got = _poll_until(listener, 1)
        assert [m for _, m in got] == [None]
        ((conn, _),) = got
        assert isinstance(conn, Connection) and conn.closed
    finally:
        for peer in peers:
            peer.close()
        listener.close()


def _poll_until(listener: Listener, count: int) -> list[tuple[Connection, object]]:
    got: list[tuple[Connection, object]] = []
    deadline = time.monotonic() + 10
    while len(got) < count and time.monotonic() < deadline:
        got += listener.poll(0.1)
    return got


def test_an_exit_is_heard_at_once_though_its_output_stays_open_and_monitoring_is_hourly(
    cluster: Cluster,
) -> None:
    """The rank exits 3 while a child it started keeps its stdout open: the launcher hears the
    exit from the process itself (a pidfd), not from its output closing, and not from a check
    every monitor interval (an hour here): the job fails well within the test's 60 s."""
    script = "import subprocess, sys; subprocess.Popen(['sleep', '120']); sys.exit(3)"
    job = toy_job(replicas=1, monitor_interval=3600)
    job["spec"]["procs_per_pod"] = 1
    job["spec"]["command"] = [sys.executable, "-c", script]
    result = cluster.run(job, timeout=60)
    assert result.returncode != 0
    assert result.report["status"] == "Failed", result.stdout + result.stderr
    assert "exit code 3" in result.report["reason"], result.report["reason"]
