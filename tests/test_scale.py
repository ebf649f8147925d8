"""A controller for thousands of pods: what it sends to every pod stays small, what it looks at
each pass is not every rank each time, and the bench's simulation drives the real controller
through real recoveries (the 4,096-pod figures are `relaunch bench --only simulation`'s)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from relaunch.controller.core import HEARTBEAT_WRITTEN_EVERY_S
from relaunch.controller.detectors import HangLook, HangWatch
from relaunch.protocol.messages import MembershipUpdate, Started, Stopped, decode, encode
from relaunch.protocol.plans import Membership
from relaunch_bench import report
from relaunch_bench.simulation import growth, simulated
from tests.controller_sim import Sim
from tests.runtime import AUTO, toy_job


def test_a_membership_of_thousands_of_pods_is_a_few_hundred_bytes_to_every_launcher() -> None:
    """4,096 pods of 8 ranks: the map of 32,768 ranks was 500 KB, sent to each of 4,096 pods
    (2 GB per process-level recovery); as runs of pods it is the same membership in one line."""
    pods = {pod: 1 for pod in range(4096)}
    pods[17] = 2  # a pod rebuilt once (process-level rescheduling)
    parked = {100, 101}  # scaled in
    for pod in parked:
        del pods[pod]
    membership = Membership.of_pods(pods, 8, generation=5, addr="10.0.0.1", port=29500)
    line = encode(MembershipUpdate(membership))
    assert len(line) < 400, len(line)
    got = decode(line)
    assert isinstance(got, MembershipUpdate) and got.membership == membership
    assert got.membership.pods == pods and got.membership.world_size == 4094 * 8
    members = [pod * 8 + r for pod in sorted(pods) for r in range(8)]
    assert got.membership.ranks == {rank: i for i, rank in enumerate(members)}
    assert 100 * 8 not in got.membership.ranks and got.membership.ranks[102 * 8] == 100 * 8


def test_a_start_and_a_stop_are_one_message_a_pod_whatever_its_ranks() -> None:
    started = Started(3, 12.5, {8: 501, 9: 502})
    stopped = Stopped(3, 13.0, exited={8: (3, None, 15), 9: (3, 0, None)})
    assert decode(encode(started)) == started and decode(encode(stopped)) == stopped
    assert decode(encode(Stopped(3, 13.0))) == Stopped(3, 13.0, exited={})


def test_the_hang_detector_looks_when_due_and_whenever_what_it_looked_at_changed() -> None:
    watch = HangWatch()
    assert watch.must_look(100.0, "key"), "never looked"
    watch.looked(HangLook(None, 160.0), "key")
    assert not watch.must_look(159.9, "key"), "no rank can be silent for its window before"
    assert watch.must_look(160.0, "key")
    assert watch.must_look(100.0, "another recovery"), "what it exempted changed"
    watch.stale()  # a rank started, a first step, a phase: a window may end sooner
    assert watch.must_look(100.0, "key")
    watch.looked(HangLook(None, None), "key")
    assert not watch.must_look(1e12, "key"), "no rank runs: nothing to look at"


def test_the_nodes_last_heartbeats_reach_the_store_together_every_few_seconds(
    tmp_path: Path,
) -> None:
    """Thousands of agents beat every few seconds: each beat was a SQLite write (400 a second at
    4,096 nodes); the record's "last heartbeat" now goes in one transaction every
    HEARTBEAT_WRITTEN_EVERY_S, and a beat that reports a chip fault still at once."""
    sim = Sim(tmp_path, toy_job(AUTO))
    sim.boot()
    writes: list[str] = []
    sim.store._db.set_trace_callback(writes.append)
    sim.run(HEARTBEAT_WRITTEN_EVERY_S + 0.5)  # a beat every 50 ms from each of 4 nodes
    beats = [i for i, w in enumerate(writes) if "last_heartbeat" in w]
    assert len(beats) in (4, 8), writes  # one flush of the 4 nodes' rows, maybe two
    for first in beats[::4]:  # each flush: the 4 rows in one transaction
        assert writes[first - 1].startswith("BEGIN") and writes[first + 4] == "COMMIT"
    heard = {n.name: n.last_heartbeat for n in sim.store.nodes()}
    assert all(
        at is not None and at > sim.clock.now() - HEARTBEAT_WRITTEN_EVERY_S - 1
        for at in heard.values()
    )
    sim.chip_fault("node-1", 0, "80E18005")
    sim.tick()
    assert sim.store.node("node-1").chip_faults, "a chip fault is written at once"


COMMANDS = {
    "process-in-place": {"membership": 16, "start": 1},
    "job-reschedule": {"shutdown": 16, "start": 16},
    # warm spares: each rebuilt pod takes its node's standby launcher (no new launcher)
    "job-reschedule+spare": {"shutdown": 16, "assume": 16, "start": 16},
}


@pytest.fixture(scope="module")
def simulated_rows() -> dict[str, dict[str, Any]]:
    """One simulated run per level, the three at once: each is a process of its own (its own
    controller and store) whose ranks step on a wall clock, idle nearly all their 20 s, and
    nothing below bounds a time; run one after another they took a minute of the suite."""
    # the simulated ranks step on a wall clock and end `tail_s` after the fault's step: long
    # enough for a start beside another test on two cores
    # the fault comes once every pod started and trained a while (the default lead, 10 s): with
    # a 3 s lead, beside another test file on two workers, the warm-spare run once ended with
    # no recovery recorded
    with ThreadPoolExecutor(len(COMMANDS)) as pool:
        running = {level: pool.submit(simulated, 16, 2, level, None, 8.0) for level in COMMANDS}
        return {level: future.result() for level, future in running.items()}


@pytest.mark.parametrize("level", list(COMMANDS))
def test_the_simulation_drives_the_real_controller_through_a_recovery(
    level: str, simulated_rows: dict[str, dict[str, Any]]
) -> None:
    """16 simulated pods of 2 ranks over the real wire: the level recovers, the commands it
    sends are counted, and a process-level recovery writes a handful of rows, not one a pod."""
    row, commands = simulated_rows[level], COMMANDS[level]
    assert row.get("records") == [[level.removesuffix("+spare"), "succeeded"]], row
    assert row["status"] == "Succeeded" and row["ranks"] == 32
    assert row["commands"] == commands
    assert 0 < row["detected_to_last_command_s"] <= row["fault_to_last_command_s"]
    assert row["cpu_s"] > 0 and row["steady_messages_per_s"] > 0
    if level == "process-in-place":
        assert row["store_rows"] < 16, "a process-level recovery rewrote every pod's row"
        assert 0 < row["membership_bytes"] < 400
    table = report.markdown(
        {"mttr": [], "hang": [], "ratios": {}, "simulation": [row], "simulation_growth": []}
    )
    assert f"| {level} | 16 | 32 |" in table
    json.dumps(row)


def test_growth_compares_the_smallest_and_the_largest_job_of_each_level() -> None:
    rows = [
        {"level": "job-reschedule", "pods": 64, "detected_to_last_command_s": 0.05},
        {"level": "job-reschedule", "pods": 4096, "detected_to_last_command_s": 2.0},
        {"level": "process-retry", "pods": 64, "detected_to_last_command_s": 0.02},
        {"level": "process-retry", "pods": 4096, "detected_to_last_command_s": 0.1},
        {"level": "in-place", "pods": 64, "error": "it failed"},
    ]
    found = {g["level"]: g for g in growth(rows)}
    assert set(found) == {"job-reschedule", "process-retry"}
    assert (
        found["job-reschedule"]["pods_ratio"] == 64 and found["job-reschedule"]["time_ratio"] == 40
    )
    assert found["process-retry"]["process_level"] and found["process-retry"]["largest_s"] == 0.1
