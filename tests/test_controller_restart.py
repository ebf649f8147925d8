"""A controller killed with SIGKILL loses nothing: `relaunch run --resume` re-adopts the pods and the
job ends as it would have, with the same records; without a resume nothing outlives the grace."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from tests.runtime import (
    FAST_CLUSTER,
    POD_LEVEL,
    ROOT,
    UNCONDITIONAL,
    Cluster,
    processes_of,
    toy_job,
    wait_gone,
)


def query(state: Path, sql: str) -> list[tuple[object, ...]]:
    try:
        with sqlite3.connect(state / "relaunch.db", timeout=5) as db:
            return db.execute(sql).fetchall()
    except sqlite3.OperationalError:
        return []


def start_and_kill(
    cluster: Cluster,
    job: dict,
    faults: list[dict] | None,
    when: Callable[[], bool],
    shape: dict | None = None,
) -> None:
    """Start `relaunch run` (on a cluster of `shape`), wait for `when`, then SIGKILL the
    controller."""
    proc = subprocess.Popen(
        cluster.command(job, faults, shape),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 60
    while not when():
        assert proc.poll() is None, "the run ended before the controller could be killed"
        assert time.time() < deadline, "condition never met"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def step_at_least(state: Path, step: int) -> Callable[[], bool]:
    return lambda: bool(query(state, f"SELECT 1 FROM jobs WHERE last_step >= {step}"))


def test_controller_killed_mid_run_resumes_with_the_same_records(cluster: Cluster) -> None:
    faults = [
        {"kind": "process-exit", "at_step": 10, "pod": 1, "exit_code": 1},
        {
            "kind": "chip-fault",
            "at_step": 50,
            "pod": 0,
            "chip": 0,
            "code": "80E18005",
            "heals": True,
        },
    ]
    job = toy_job(UNCONDITIONAL, steps=80, args="--step-seconds 0.05")

    def first_recovered() -> bool:
        done = query(cluster.state, "SELECT 1 FROM recoveries WHERE outcome = 'succeeded'")
        return bool(done) and step_at_least(cluster.state, 25)()

    # pods wait 20 s for their controller: a resume on a busy machine took 3.2 s, past the
    # 3 s of FAST_CLUSTER, and the pods had ended themselves
    shape = {**FAST_CLUSTER, "adopt_grace_s": 20}
    start_and_kill(cluster, job, faults, first_recovered, shape)
    assert processes_of(cluster.state), "the pods should outlive their controller"
    result = cluster.resume()
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.actions == ["job-reschedule", "in-place"]
    assert [r["outcome"] for r in result.report["recoveries"]] == ["succeeded", "succeeded"]
    assert result.report["restarts_used"] == 1
    assert [(p["schedule_count"], p["proc_start_count"]) for p in result.report["pods"]] == [
        (2, 2),
        (2, 2),
    ]


def test_controller_killed_in_the_middle_of_a_recovery(cluster: Cluster) -> None:
    faults = [{"kind": "node-down", "at_step": 10, "pod": 1}]
    job = toy_job(POD_LEVEL, steps=60, args="--step-seconds 0.05")

    def running():
        return bool(query(cluster.state, "SELECT 1 FROM recoveries WHERE outcome = 'running'"))

    start_and_kill(cluster, job, faults, running)
    result = cluster.resume()
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.actions == ["pod-reschedule"]
    assert result.report["pod_restarts_used"] == 1 and result.report["restarts_used"] == 0
    pods = result.report["pods"]
    assert [(p["node"], p["generation"]) for p in pods] == [("node-0", 1), ("node-2", 2)]
    assert [(p["schedule_count"], p["proc_start_count"]) for p in pods] == [(1, 2), (2, 1)]


def test_a_fault_while_the_controller_is_down_is_still_handled(cluster: Cluster) -> None:
    """Rank 1 is killed while the controller is down; the resumed controller adopts the pods
    and handles the exit as the fault it is. The pods wait for it longer than the fast
    cluster's 3 s: the killed ranks stay zombies until their launcher reaps them (1.5-2 s
    measured on a busy machine) and a resume starts in a second or more, so 3 s was a window
    only a quiet machine held (the pods ended themselves, and the fault was the outage)."""
    job = toy_job(UNCONDITIONAL, steps=60, args="--step-seconds 0.05")
    shape = {**FAST_CLUSTER, "adopt_grace_s": 20}
    start_and_kill(cluster, job, None, step_at_least(cluster.state, 10), shape)
    victims = [p for p in processes_of(cluster.state) if p.environ().get("RANK") == "1"]
    assert victims
    for victim in victims:
        victim.send_signal(signal.SIGKILL)
    psutil.wait_procs(victims, timeout=5)
    result = cluster.resume()
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.actions == ["job-reschedule"]
    fault = result.report["recoveries"][0]["fault"]
    assert fault["kind"] == "process-exit" and fault["rank"] == 1


def test_a_killed_run_that_is_not_resumed_leaves_nothing_after_the_grace_period(
    cluster: Cluster,
) -> None:
    start_and_kill(
        cluster, toy_job(UNCONDITIONAL, steps=400), None, step_at_least(cluster.state, 5)
    )
    assert processes_of(cluster.state)
    left = wait_gone(cluster.state, timeout=float(FAST_CLUSTER["adopt_grace_s"]) + 3)
    assert not left, [p.cmdline() for p in left]


def test_a_resumed_controller_loses_a_node_the_moment_an_agent_it_did_not_start_exits(
    cluster: Cluster,
) -> None:
    """The agents were started by the controller that was killed: the resumed one watches them
    too (their pids from pids.json, each checked to be the process that was started) and loses
    node-1 the moment its agent is killed, though the heartbeat timeout (120 s) is longer than
    the run is given (90 s)."""
    # pods wait 10 s for the resumed controller: with 3 s, a resume starved by a neighbour came
    # after they had ended themselves, and the job restarted from its checkpoint instead
    shape = {**FAST_CLUSTER, "heartbeat_timeout_s": 120, "adopt_grace_s": 10}
    job = toy_job(POD_LEVEL, steps=250, args="--step-seconds 0.05")
    start_and_kill(cluster, job, None, step_at_least(cluster.state, 10), shape)
    (killed_at,) = query(cluster.state, "SELECT last_step FROM jobs")[0]
    resumed = subprocess.Popen(
        cluster.resume_command(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # the resumed controller hears the pods' steps before the agent is killed
    result = cluster.signal_agent_at_step(resumed, int(killed_at) + 20, "node-1", signal.SIGKILL)
    result.assert_pod_moved_off_lost_node("node-1", "the engine reports the node dead")
