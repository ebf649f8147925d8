"""The controller and the launchers wake when something happens, not on a clock: what that must
not cost. A controller that fell behind never blames a node for its own lateness; an exit is
heard at once though the process's output stays open and the monitor interval is an hour; the
controller's one selector reads whole messages from many peers and hears each one leave; a rank
that showed progress since its last usage sample is not judged on that sample."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
import typing
from pathlib import Path
from typing import Any

import psutil
import pytest

from relaunch.controller import checks
from relaunch.controller import listener as listener_module
from relaunch.controller.clock import TICK_S
from relaunch.controller.core import IDLE_PASS_S
from relaunch.controller.detectors import rank_active
from relaunch.controller.listener import Listener
from relaunch.controller.peers import Rank
from relaunch.events import EventKind
from relaunch.launcher.processes import (
    LINE_AT_MOST,
    READ_AT_MOST,
    RankLog,
    Worker,
    forget_stat,
    sample_busy,
)
from relaunch.protocol import messages
from relaunch.protocol.codec import to_data
from relaunch.protocol.messages import AgentHello, Heartbeat, encode
from relaunch.protocol.plans import LaunchPlan
from relaunch.protocol.wire import Connection
from relaunch.store import JobStatus, NodeState, Store
from tests.controller_sim import Sim, job_spec
from tests.runtime import ROOT, Cluster, asleep, processes_of, toy_job


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


def _steady_sim(tmp_path: Path) -> tuple[Sim, list[float]]:
    """A job of 2 pods training undisturbed, and the times of the controller's passes."""
    annotations = {
        "fault-tolerance/job-retry-num": "2",
        "fault-tolerance/job-unconditional-retry": "true",
        "fault-tolerance/hang-retry": "true",
    }
    sim = Sim(tmp_path, job_spec(annotations, hang_detect_seconds=3))
    sim.boot()
    sim.train(1)
    sim.run(0.5)
    passes: list[float] = []
    sim.controller.on_tick = lambda: passes.append(sim.clock.now())
    return sim, passes


def test_a_job_training_undisturbed_is_looked_at_on_its_deadlines_not_every_tick(
    tmp_path: Path,
) -> None:
    """While nothing is under way a pass runs at most every IDLE_PASS_S (and at deadlines):
    over 2 s of heartbeats and progress every TICK_S, about 8 passes, not 40."""
    sim, passes = _steady_sim(tmp_path)
    c = sim.controller
    for step in range(2, 42):
        sim.train(step)
        sim.tick()
    assert c.pacer.steady_since is not None
    assert 4 <= len(passes) <= 2 / IDLE_PASS_S + 3, passes
    # Something under way (a fault added through the store, as the API adds it: from another
    # connection) brings back a pass every TICK_S.
    api = Store(tmp_path / "relaunch.db")
    api.append_plan(c.job_id, [{"kind": "process-exit", "pod": 1, "after_s": 30}])
    api.close()
    sim.run(IDLE_PASS_S + TICK_S)  # the next idle pass reads the plan
    passes.clear()
    sim.run(1.0)
    assert c.pacer.steady_since is None
    assert len(passes) >= 1.0 / TICK_S - 1


def test_a_crash_in_a_steady_job_is_decided_in_the_step_that_reads_it(tmp_path: Path) -> None:
    sim, _ = _steady_sim(tmp_path)
    c = sim.controller
    sim.run(1.0)
    assert c.pacer.steady_since is not None
    sim.crash(3)
    sim.tick()
    assert EventKind.FAULT in sim.kinds()
    assert [r.action.value for r in sim.records()] == ["job-reschedule"]
    assert c.pacer.steady_since is None


def test_a_silent_node_and_a_silent_rank_are_found_at_their_deadline_in_a_steady_job(
    tmp_path: Path,
) -> None:
    """Between passes the controller sleeps until the first moment a node could have been
    silent for the heartbeat timeout, or a rank for its hang window: no idle pass adds to
    either detection."""
    sim, _ = _steady_sim(tmp_path)
    c = sim.controller
    timeout = sim.cluster.heartbeat_timeout_s
    sim.run(1.0)
    assert c.pacer.steady_since is not None
    node = c.pods[1].row.node
    sim.silent = {node}
    silent_at = c.agents[node].last_heartbeat
    while c.node(node).state is not NodeState.LOST:  # type: ignore[union-attr]
        sim.train(100)
        sim.tick(0.01)
        assert sim.clock.now() < silent_at + timeout + 1.0
    assert sim.clock.now() - silent_at <= timeout + 0.02

    sim2, _ = _steady_sim(tmp_path / "hang")
    c2 = sim2.controller
    sim2.run(0.5)
    assert c2.pacer.steady_since is not None
    quiet_at = sim2.clock.now()
    while not sim2.records():
        sim2.train(100, pods={0})  # pod 1's ranks fall silent
        sim2.tick(0.01)
        assert sim2.clock.now() < quiet_at + 10
    assert sim2.records()[0].fault.kind.value == "hang"
    assert sim2.clock.now() - quiet_at <= c2.hang_s + 0.02


def test_a_usage_sample_after_other_signs_of_life_is_only_a_baseline() -> None:
    """The launcher does not sample ranks that reported a step or printed since its last sample:
    the next sample spans that time, and its CPU proves nothing about now."""
    stepped = Rank(attempt=1, last_activity=15.0, usage=(10.0, 1.0, 0))
    assert not rank_active(stepped, cpu=9.0, io=0, now=20.0)
    silent = Rank(attempt=1, last_activity=5.0, usage=(10.0, 1.0, 0))
    assert rank_active(silent, cpu=9.0, io=0, now=20.0)
    assert not rank_active(silent, cpu=1.0, io=0, now=20.0)


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


def test_a_quiet_listener_sleeps_through_routine_messages_and_wakes_for_its_doorbell() -> None:
    """While the job trains undisturbed the controller waits on its doorbell, new connections
    and closing ones only: a heartbeat, progress or output waits for the next read; an exit (or
    any message that is not ROUTINE) rings the bell and wakes it; so does a peer that leaves."""
    listener = Listener("127.0.0.1")
    assert listener.rings
    peer = Connection.connect(*listener.address)
    other = Connection.connect(*listener.address)
    try:
        assert listener.wait_quietly(5.0)  # the new connections
        assert peer.send(AgentHello("node-1", 2))  # rings: read at once
        assert listener.wait_quietly(5.0)
        assert [m for _, m in _poll_until(listener, 1)] == [AgentHello("node-1", 2)]
        assert not listener.wait_quietly(0.0)  # every bell was read with the wake
        routine = [
            Heartbeat("node-1", 1.0, (), None),
            messages.ProgressBatch((messages.Progress(0, 5, 1, 1.0),)),
            messages.Output(0, 1, "step 5"),
            messages.Usage(1, 1.0, {0: (1.5, 10)}),
        ]
        for message in routine:
            assert message.ROUTINE and peer.send(message)
        assert not listener.wait_quietly(0.3)  # slept through them: they wait on the socket
        assert [m for _, m in _poll_until(listener, 4)] == routine
        first_step = messages.ProgressBatch((messages.Progress(0, 1, 2, 2.0),))
        assert peer.send(first_step, urgent=True)  # a launcher's first step of an attempt
        assert listener.wait_quietly(5.0)
        assert [m for _, m in _poll_until(listener, 1)] == [first_step]
        exited = messages.Exited(0, 1, 1, None, 3.0)
        assert not exited.ROUTINE and peer.send(exited)
        assert listener.wait_quietly(5.0)
        assert [m for _, m in _poll_until(listener, 1)] == [exited]
        other.close()  # a peer that died: its connection closes
        assert listener.wait_quietly(5.0)
        assert [m for _, m in _poll_until(listener, 1)] == [None]
        assert not listener.wait_quietly(0.0)  # the closed one no longer wakes it
    finally:
        peer.close()
        other.close()
        listener.close()


def test_without_a_doorbell_the_controller_reads_every_tick_and_peers_ring_into_nothing() -> None:
    """Where the UDP port beside the listener is taken there is no doorbell: `rings` is False
    (the controller then reads every TICK_S, as before the doorbell) and a peer's bells go
    nowhere without an error; its messages still arrive on the connection."""
    taker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    taker.bind(("127.0.0.1", 0))
    taken = taker.getsockname()
    listener = Listener("127.0.0.1")
    try:
        assert listener_module._doorbell(taken) is None  # the port is someone else's
        assert listener.doorbell is not None
        listener.doorbell.close()
        listener.doorbell = None
        assert not listener.rings
        peer = Connection.connect(*listener.address)
        peer._doorbell = taken  # rings a port that is not the controller's: no one answers
        try:
            exited = messages.Exited(0, 1, 1, None, 3.0)
            assert peer.send(exited) and peer.send(exited)
            assert [m for _, m in _poll_until(listener, 2)] == [exited, exited]
        finally:
            peer.close()
    finally:
        taker.close()
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


def _example(kind: Any) -> Any:
    """A value of every field's declared type (non-empty collections, nested dataclasses)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    plain = {int: 3, float: 1.5, str: "x", bool: True, Any: {"k": (1, [2.5, None])}}
    if kind in plain:
        return plain[kind]
    if origin is typing.Literal:
        return args[0]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return next(iter(kind))
    if origin in (typing.Union, types.UnionType):
        return _example(next(a for a in args if a is not type(None)))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return (_example(args[0]), _example(args[0]))
        return tuple(_example(a) for a in args)
    if origin is list:
        return [_example(args[0])]
    if origin is dict:
        return {_example(args[0]): _example(args[1])}
    assert dataclasses.is_dataclass(kind), kind
    hints = typing.get_type_hints(kind)
    fields = dataclasses.fields(kind)
    return kind(**{f.name: _example(hints[f.name]) for f in fields if f.init})


def _walked(value: Any) -> Any:
    """to_data as it was before its encoders were built per type: every value walked."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _walked(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _walked(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_walked(v) for v in value]
    return value


def test_every_message_encodes_as_the_value_walk_did_and_decodes_back() -> None:
    """The encoders built once per message type (launchers and agents encode every second)
    write exactly what walking each value wrote, byte for byte, for every message kind and the
    launch plan; and every message decodes back to itself."""
    for kind in [*messages._KINDS.values(), LaunchPlan]:
        value = _example(kind)
        assert json.dumps(to_data(value)) == json.dumps(_walked(value)), kind
        if kind is not LaunchPlan:
            line = messages.encode(value)
            assert line.startswith('{"t":"' + kind.KIND + '"'), line  # its kind first
            assert json.loads(line) == {"t": kind.KIND, **json.loads(json.dumps(_walked(value)))}
            assert messages.decode(line) == value, kind
            assert messages.decode(line.encode()) == value, kind
            # the careful way (a line whose kind is not first) reads it alike
            fields = json.loads(line)
            del fields["t"]
            moved = json.dumps({**fields, "t": kind.KIND}, separators=(",", ":"))
            assert fields == {} or not moved.startswith('{"t"'), moved
            assert messages.decode(moved) == value, kind
    empty = messages.ProgressBatch((), (), {})
    assert messages.decode(messages.encode(empty)) == empty
    assert messages.encode(messages.Lease()) == '{"t":"lease"}'
    assert messages.decode('{"t":"lease"}') == messages.Lease()


def test_every_line_the_fast_decoder_refuses_the_careful_way_decides() -> None:
    """msgspec decodes a line whose kind comes first; a line it refuses goes the careful way
    (codec), which converts what it can: each way a line can be wrong or unusual, decoded with
    its kind first and last, gives the same outcome both ways."""
    stopped = '"exited":{"3":[1,null,15]}'
    for fields, expected in (
        ('"attempt":2,"at":1.5', messages.Stopped(2, 1.5)),
        ('"attempt":2,"at":1', messages.Stopped(2, 1.0)),  # an int for a float
        ('"attempt":"2","at":1.5', messages.Stopped(2, 1.5)),  # a number in a string
        (f'"attempt":2,"at":1.5,{stopped}', messages.Stopped(2, 1.5, exited={3: (1, None, 15)})),
        (
            '"attempt":2,"at":1.5,"exited":{"03":[1,null,15]}',
            messages.Stopped(2, 1.5, exited={3: (1, None, 15)}),
        ),
        ('"attempt":2,"at":1.5,"other":[1]', messages.Stopped(2, 1.5)),  # unknown: ignored
        ('"attempt":true,"at":1.5', None),
        ('"attempt":2.5,"at":1.5', None),
        ('"attempt":2', None),  # missing
        ('"attempt":2,"at":"x"', None),
        ('"attempt":2,"at":1.5,"exited":{"x":[1,null,15]}', None),
        ('"attempt":2,"at":1.5,"exited":{"3":[1,null]}', None),
        ('"attempt":2,"at":1.5,"exited":[]', None),
        (f'"attempt":{1 << 70},"at":1.5', messages.Stopped(1 << 70, 1.5)),  # past int64
    ):
        first = '{"t":"stopped",' + fields + "}"
        last = "{" + fields + ',"t":"stopped"}'
        assert messages.decode(first) == expected, first
        assert messages.decode(last) == expected, last
        assert messages.decode(first.encode()) == expected, first
    for line in (
        "",
        "not json",
        '{"t":"stopped","attempt":2,"at":1.5',  # cut short
        '{"t":"nonesuch","attempt":2}',
        '{"t":"stopped"',
        '{"t":"stopp',
        '{"attempt":2,"at":1.5}',  # no kind
        '["t","stopped"]',
        '{"t":"stopped","attempt":2,"at":1.5}trailing',
    ):
        assert messages.decode(line) is None, line
    # bytes that are not UTF-8: refused in a field the message has, ignored in one it has not
    # (as any field it has not)
    for line in (
        b'{"t":"output","rank":0,"attempt":1,"line":"\xff"}',
        b'{"rank":0,"attempt":1,"line":"\xff","t":"output"}',
    ):
        assert messages.decode(line) is None, line
    assert messages.decode(
        b'{"t":"output","rank":0,"attempt":1,"line":"a","x":"\xff"}'
    ) == messages.Output(0, 1, "a")


def test_the_decoders_shortcuts_take_what_the_careful_way_takes_and_refuse_the_rest() -> None:
    """The decoder takes a plain structure (a stack's frame, a step report, a stopped rank's
    (attempt, code, signal), int-keyed maps) without a call a field when every value already is
    what its hint names; anything else goes the careful way: converted where it can be (a
    number in a string), refused with TypeError or ValueError where it cannot. Every way such
    an input can differ from the shortcut's, each against its expected outcome."""
    from relaunch.diagnosis import Frame
    from relaunch.protocol.codec import from_data

    frame = {"function": "f", "file": "x.py", "line": 3}
    assert from_data(Frame, frame) == Frame("f", "x.py", 3)
    assert from_data(Frame, {**frame, "line": "3"}) == Frame("f", "x.py", 3)  # converted
    assert from_data(Frame, {**frame, "extra": 1}) == Frame("f", "x.py", 3)  # ignored
    for bad in (
        {**frame, "line": 3.5},
        {**frame, "line": True},
        {**frame, "function": 1},
        {"function": "f", "file": "x.py"},  # missing
        [frame],
    ):
        with pytest.raises(TypeError):
            from_data(Frame, bad)
    stopped = dict[int, tuple[int, int | None, int | None]]
    assert from_data(stopped, {"3": [1, None, 15]}) == {3: (1, None, 15)}
    assert from_data(stopped, {3: [1, None, 15]}) == {3: (1, None, 15)}  # not from JSON
    assert from_data(stopped, {"3": (1, "2", None)}) == {3: (1, 2, None)}  # converted
    for bad, error in (
        ({"3": [1, None]}, ValueError),  # too short
        ({"3": [1, None, 15, 0]}, ValueError),  # too long
        ({"3": [1, "x", 15]}, TypeError),
        ({"3": [True, None, 15]}, TypeError),
        ({"3": [1, 2.5, 15]}, TypeError),
        ({"x": [1, None, 15]}, TypeError),  # a key that is no number
        ({"3": "abc"}, TypeError),
        ([["3", [1, None, 15]]], TypeError),
    ):
        with pytest.raises(error):
            from_data(stopped, bad)
    batch = messages.ProgressBatch((messages.Progress(0, 5, 1, 2.0),))
    assert messages.decode(messages.encode(batch)) == batch
    assert (
        messages.decode('{"t":"progress","reports":[{"rank":0,"step":"x","attempt":1,"at":2.0}]}')
        is None
    )
    start = messages.Start(2, {"A": "b"}, (3,))
    assert messages.encode(start) == '{"t":"start","attempt":2,"env":{"A":"b"},"ranks":[3]}'


def test_a_rank_is_looked_at_through_one_kept_descriptor_until_it_exits() -> None:
    """The launcher's look at a rank's main thread: sleeping is not busy, stopped is; once the
    process is gone the descriptor is closed and looks stop counting (a reused pid is never
    read: the descriptor belonged to the process that ended)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    worker = Worker(0, 0, 1, proc, None)
    try:
        asleep(proc.pid)
        sample_busy(worker)
        assert (worker.samples, worker.busy) == (1, 0)
        fd = worker.stat_fd
        assert fd is not None
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while worker.busy == 0 and time.monotonic() < deadline:
            sample_busy(worker)
        assert worker.busy >= 1 and worker.stat_fd == fd
    finally:
        proc.kill()
        proc.wait()
    looks = worker.samples
    sample_busy(worker)
    assert worker.samples == looks and worker.stat_fd is None
    forget_stat(worker)  # closing twice is harmless


def test_the_last_step_a_rank_reports_before_it_exits_is_heard_though_its_batch_is_not_due(
    cluster: Cluster,
) -> None:
    """A launcher forwards routine steps once a progress interval (a second here: the hang
    window is 60 s); the job's 20 steps take about 0.6 s. Its last step is reported when the
    rank exits, not held back for a batch that falls due after the exit was heard."""
    job = toy_job(steps=20, replicas=2, hang_detect_seconds=60)
    result = cluster.run(job, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    (job_row,) = Store(result.state_dir / "relaunch.db").jobs()
    assert job_row.last_step == 20


def test_a_rank_log_is_read_in_whole_lines_timed_when_written_and_bounded_per_read(
    tmp_path: Path,
) -> None:
    """RankLog over a real file another writer appends to: whole lines only (the unfinished
    one waits, or comes with the final read), from where the rank's output began, timed by
    the file's last write, and at most READ_AT_MOST bytes a read (the newest whole lines)."""
    path = tmp_path / "rank.log"
    path.write_bytes(b"--- an earlier attempt ---\n")
    log = RankLog(path)
    with open(path, "ab", buffering=0) as writer:
        writer.write(b"first\nsecond\nunfini")
        os.utime(path, (1000.0, 1000.0))  # as if written long before it is read
        assert log.read() == (1000.0, ["first", "second"])
        assert log.read()[1] == []
        writer.write(b"shed\n\xff\n")
        assert log.read()[1] == ["unfinished", "\ufffd"]
        writer.write(b"no newline at exit")
        assert log.read()[1] == []
        assert log.read(final=True)[1] == ["no newline at exit"]
        lines = [f"{i:09d}".encode() * 10 for i in range(30_000)]  # 2.7 MB of 90-byte lines
        writer.write(b"\n".join(lines) + b"\n")
        got = log.read()[1]
        assert len("\n".join(got)) < READ_AT_MOST and len(got) > 10_000
        assert got == [line.decode() for line in lines[-len(got) :]]  # whole, newest, in order
        writer.write(b"after\n")
        assert log.read()[1] == ["after"]
    log.close()
    log.close()  # closing twice is harmless


def test_a_progress_bar_is_its_last_drawing_and_a_line_without_end_costs_a_bounded_memory(
    tmp_path: Path,
) -> None:
    """A rank drawing a progress bar (carriage returns, no newline for a long time) or writing
    without any newline: what is kept between reads never passes LINE_AT_MOST, a redrawn bar
    comes as its last drawing, and "\\r\\n" endings are plain line ends."""
    path = tmp_path / "rank.log"
    path.touch()
    log = RankLog(path)
    with open(path, "ab", buffering=0) as writer:
        for step in range(20_000):  # 20 000 drawings of a bar, about 0.9 MB, no newline
            writer.write(f"\rtraining: {step:6d}/20000 |{'#' * (step // 1000)}".encode())
            if step % 500 == 0:
                assert log.read()[1] == []
                assert len(log.partial) <= LINE_AT_MOST
        writer.write(b"\nTraceback (most recent call last):\r\n  boom\r\n")
        assert log.read()[1] == [
            "training:  19999/20000 |" + "#" * 19, "Traceback (most recent call last):", "  boom"
        ]  # fmt: skip
        writer.write(b"." * (3 * LINE_AT_MOST))  # dots, never a newline
        _, cut = log.read()
        assert cut == ["." * LINE_AT_MOST] and len(log.partial) <= LINE_AT_MOST
        writer.write(b"\rdone\r")
        assert log.read()[1] == [] and log.read(final=True)[1] == ["done"]
    log.close()


def test_a_rank_never_waits_for_a_stopped_launcher_to_read_its_output(cluster: Cluster) -> None:
    """The rank's launcher is stopped (SIGSTOP) before the rank writes 8 MB of output (a pipe
    would hold 64 KB and block the rank): the rank finishes writing meanwhile; once the
    launcher goes on, the job ends with every line in the rank's log."""
    flags = cluster.dir / "flag"
    script = (
        "import pathlib, sys, time\n"
        f"flag = pathlib.Path({str(flags)!r})\n"
        "def wait(name):\n"
        "    while not flag.with_suffix(name).exists(): time.sleep(0.02)\n"
        "wait('.go')\n"
        "for i in range(80_000): print(f'{i:08d}' + 'x' * 91)\n"
        "sys.stdout.flush(); flag.with_suffix('.written').touch()\n"
        "wait('.end'); print('last line')\n"
    )
    job = toy_job(replicas=1, hang_detect_seconds=60)
    job["spec"]["procs_per_pod"] = 1
    job["spec"]["command"] = [sys.executable, "-c", script]
    run = subprocess.Popen(
        cluster.command(job), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not (launcher := _launcher_pid(cluster.state)) or not _a_rank_runs(cluster.state):
            assert run.poll() is None and time.monotonic() < deadline, "the rank never started"
            time.sleep(0.05)
        os.kill(launcher, signal.SIGSTOP)
        try:
            flags.with_suffix(".go").touch()
            deadline = time.monotonic() + 30
            while not flags.with_suffix(".written").exists():
                assert time.monotonic() < deadline, "the rank waited for its launcher"
                time.sleep(0.05)
        finally:
            os.kill(launcher, signal.SIGCONT)
        flags.with_suffix(".end").touch()
        said, _ = run.communicate(timeout=60)
    finally:
        run.kill()
    result = cluster.result(run.returncode, said)
    assert result.returncode == 0, said
    logged = [line for line in result.logs().splitlines() if not line.startswith("---")]
    assert logged == [f"{i:08d}" + "x" * 91 for i in range(80_000)] + ["last line"]


def _launcher_pid(state: Path) -> int | None:
    try:
        launchers = json.loads((state / "pids.json").read_text())["launchers"]
    except (OSError, ValueError, KeyError):
        return None
    pids = [ref[0] for key, ref in launchers.items() if "/-1/" not in key]
    return pids[0] if len(pids) == 1 else None


def _a_rank_runs(state: Path) -> bool:
    for process in processes_of(state):
        with contextlib.suppress(psutil.Error):
            if process.environ().get("RANK") is not None:
                return True
    return False
