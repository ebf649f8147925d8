"""The runtime under faults of its own, and the defaults that only bite real frameworks.

Every test runs real `relaunch run` processes with real agents, launchers and workers. A
controller is killed at a named failpoint (RELAUNCH_FAILPOINT, see relaunch.failpoints) or with
SIGKILL / SIGTERM from outside; each resumed job must end with exactly one correct record.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from relaunch.cluster.local import LocalCluster
from relaunch.events import EventKind
from relaunch.store import Store
from tests.cli import relaunch_here
from tests.runtime import (
    AUTO,
    FAST_CLUSTER,
    HANG,
    POD_LEVEL,
    ROOT,
    UNCONDITIONAL,
    Cluster,
    Result,
    processes_of,
    toy_job,
    wait_gone,
)

ADOPT_S = float(FAST_CLUSTER["adopt_grace_s"])


def events(result: Result) -> list[str]:
    with sqlite3.connect(result.state_dir / "relaunch.db") as db:
        return [text for (text,) in db.execute("SELECT text FROM events ORDER BY id")]


def run_until(cluster: Cluster, job: dict[str, Any], faults: list[dict[str, Any]] | None,
              env: dict[str, str] | None = None, timeout: float = 90,
              nodes: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run(
        cluster.command(job, faults, nodes),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


def query(state: Path, sql: str) -> list[tuple[Any, ...]]:
    try:
        with sqlite3.connect(state / "relaunch.db", timeout=5) as db:
            return db.execute(sql).fetchall()
    except sqlite3.OperationalError:
        return []


def start_and_wait(
    cluster: Cluster, job: dict[str, Any], step: int, shape: dict[str, Any] | None = None
) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        cluster.command(job, cluster=shape),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 60
    while not query(cluster.state, f"SELECT 1 FROM jobs WHERE last_step >= {step}"):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the job never reached the step"
        time.sleep(0.05)
    return proc


# -- part 4: the controller killed at each point of a recovery --------------------------------------

KILLED_CLUSTER = {**FAST_CLUSTER, "adopt_grace_s": 10}
"""The kill matrix resumes at once, and its pods wait for the controller that long: with 3 s, a
resume on a busy machine (its interpreter and imports starved by a neighbour) came after the
pods had ended themselves, and the job was rebuilt as an outage, a second record."""
CRASH = ([{"kind": "process-exit", "at_step": 10, "pod": 1}], UNCONDITIONAL, "job-reschedule")
CHIP = (
    [{"kind": "chip-fault", "at_step": 10, "pod": 0, "code": "80E18005", "heals": True}],
    AUTO,
    "in-place",
)
NODE = ([{"kind": "node-down", "at_step": 10, "pod": 1}], POD_LEVEL, "pod-reschedule")
KILL_POINTS = [
    ("crash", CRASH, "fault-plan-due"),  # the fault plan's entry fires once across the kill
    ("chip", CHIP, "stopping"),  # the heal asked again of a real agent
    ("node", NODE, "starting"),  # real launchers of the new generation adopted, not started twice
]
"""One real kill per mechanism; every failpoint of each fault's recovery is killed on the
simulator (tests/test_recovery_state.py:
test_a_controller_killed_at_each_point_of_a_recovery_resumes_with_exactly_one_record)."""


@pytest.mark.parametrize(
    "plan, point", [(plan, point) for _, plan, point in KILL_POINTS],
    ids=[f"{name}-{point}" for name, _, point in KILL_POINTS],
)  # fmt: skip
def test_controller_killed_at_each_point_of_a_recovery_resumes_with_exactly_one_record(
    cluster: Cluster, plan: tuple[list[dict[str, Any]], dict[str, str], str], point: str
) -> None:
    faults, annotations, action = plan
    # the pods train on while the controller is dead: 40 more steps of 0.15 s, time for the
    # resume to start and fire the plan (with 0.03 s steps a busy machine's resume once came
    # after the job had ended, with no fault)
    job = toy_job(annotations, steps=50, args="--step-seconds 0.15")
    killed = run_until(
        cluster, job, faults, env={"RELAUNCH_FAILPOINT": point}, nodes=KILLED_CLUSTER
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    result = cluster.resume()
    assert result.returncode == 0, result.stdout + result.stderr
    records = result.report["recoveries"]
    assert [(r["action"], r["outcome"]) for r in records] == [(action, "succeeded")], records
    assert [e["state"] for e in result.report["fault_plan"]] == ["fired"]


def test_resume_after_the_adopt_grace_restarts_the_agents_and_the_job_without_spending_a_restart(
    cluster: Cluster,
) -> None:
    """The controller is away longer than adopt_grace_s: pods and agents end themselves. The
    resume starts the agents again and rebuilds the job from its checkpoints, recorded as
    relaunch's own outage. Before the fix every node was declared lost and the job failed."""
    job = toy_job(AUTO, steps=60, args="--step-seconds 0.05")
    proc = start_and_wait(cluster, job, step=15)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not wait_gone(cluster.state, timeout=2 * ADOPT_S + 5)
    result = cluster.resume()
    assert result.returncode == 0, result.stdout + result.stderr
    [record] = result.report["recoveries"]
    assert record["fault"]["kind"] == "controller-outage"
    assert record["action"] == "job-reschedule" and record["outcome"] == "succeeded"
    assert result.report["restarts_used"] == 0
    assert max(int(s) for s in _resume_steps(result)) >= 10  # from its checkpoints, not step 0


def _resume_steps(result: Result) -> list[str]:
    import re

    return re.findall(r"resume_step=(\d+)", result.logs())


# -- part 4: signals, abandoned pods, re-runs, queued submissions ---------------------------------

TRAPS_SIGTERM = (
    "import os, signal, sys, time\n"
    "from relaunch.train import report_progress\n"
    "marks = sys.argv[1]\n"
    "def on_term(*_):\n"
    "    open(os.path.join(marks, 'term-' + os.environ['RANK']), 'w').close()\n"
    "    {exit}\n"
    "signal.signal(signal.SIGTERM, on_term)\n"
    "for step in range(1, 100000):\n"
    "    report_progress(step)\n"
    "    if step % 20 == 0: print('step', step, flush=True)\n"
    "    time.sleep(0.05)\n"
)


def trapping_job(marks: Path, exits: bool, **spec: Any) -> dict[str, Any]:
    job = toy_job(UNCONDITIONAL, replicas=1, **spec)
    body = TRAPS_SIGTERM.replace("{exit}", "sys.exit(0)" if exits else "pass")
    job["spec"]["command"] = [sys.executable, "-c", body, str(marks)]
    return job


def test_sigterm_to_relaunch_run_stops_the_job_as_ctrl_c_does(cluster: Cluster) -> None:
    proc = start_and_wait(cluster, toy_job(AUTO, steps=400), step=5)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 143, stderr  # before: killed by the signal, job left Running
    report = json.loads((cluster.dir / "report.json").read_text())
    assert report["status"] == "Stopped" and "SIGTERM" in report["reason"]
    assert not wait_gone(cluster.state, timeout=5)


def test_abandoned_pods_get_sigterm_and_the_jobs_grace_not_sigkill(cluster: Cluster) -> None:
    marks = cluster.dir / "marks"
    marks.mkdir()
    proc = start_and_wait(cluster, trapping_job(marks, exits=True), step=5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not wait_gone(cluster.state, timeout=2 * ADOPT_S + 5)
    assert sorted(p.name for p in marks.iterdir()) == ["term-0", "term-1"]


def test_controller_killed_during_a_stop_of_processes_ignoring_sigterm_leaves_nothing(
    cluster: Cluster,
) -> None:
    """A stop with a 60 s grace is under way when the controller dies; the processes ignore
    SIGTERM. Abandoned, the launcher still kills them within the adopt grace (before the fix
    they ran for the whole grace)."""
    marks = cluster.dir / "marks"
    marks.mkdir()
    job = trapping_job(marks, exits=False)
    job["metadata"]["labels"]["grace-over-time"] = "60"
    faults = [{"kind": "process-exit", "at_step": 10, "pod": 0, "rank": 0}]
    killed = run_until(cluster, job, faults, env={"RELAUNCH_FAILPOINT": "stopping"})
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert processes_of(cluster.state), "the stop should still be under way"
    left = wait_gone(cluster.state, timeout=2 * ADOPT_S + 5)
    assert not left, [p.cmdline() for p in left]


def test_rerun_without_resume_says_the_old_job_is_abandoned_and_points_to_resume(
    cluster: Cluster,
) -> None:
    proc = start_and_wait(cluster, toy_job(AUTO, steps=400), step=5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    again = subprocess.run(
        cluster.command(toy_job(AUTO, steps=10)), cwd=ROOT, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    assert "job e2e (id 1) was still Running" in again.stderr
    assert "from step 0" in again.stderr and "relaunch run --resume" in again.stderr


def test_local_submit_while_a_foreground_run_holds_the_state_dir_runs_after_it(
    cluster: Cluster,
) -> None:
    # the foreground run trains until it is stopped: with 60 steps it once ended before the
    # submit (an interpreter's start on a busy machine) looked, and a runner started beside it
    proc = start_and_wait(cluster, toy_job(AUTO, steps=1_000_000), step=5)
    second = cluster.write("second.yaml", toy_job(AUTO, steps=10))
    done = subprocess.run(
        [sys.executable, "-m", "relaunch", "submit", str(second), "--state-dir",
         str(cluster.state), "--cluster", str(cluster.dir / "cluster.yaml")],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "foreground `relaunch run`" in done.stdout and "starts when that run ends" in done.stdout
    proc.send_signal(signal.SIGTERM)  # as Ctrl-C: the foreground job stops, then the queue runs
    proc.communicate(timeout=60)
    deadline = time.time() + 60
    while query(cluster.state, "SELECT status FROM jobs WHERE id = 2") != [("Succeeded",)]:
        assert time.time() < deadline, query(cluster.state, "SELECT id, status FROM jobs")
        time.sleep(0.2)


# -- part 4: a damaged state directory, reused process ids ----------------------------------------


def relaunch(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relaunch", *args, "--state-dir", str(state)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_garbage_or_truncated_state_database_is_a_one_line_error(
    tmp_path: Path, damage: str
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    db = state / "relaunch.db"
    if damage == "garbage":
        db.write_bytes(b"this is not a database\n" * 400)
    else:
        store = Store(db)
        for i in range(200):
            store.create_job(f"job-{i}", {"raw": {"x": "x" * 2000}}, [], float(i))
        store.close()
        data = db.read_bytes()
        db.write_bytes(data[: len(data) // 2])
    # the reading commands in this process (tests/cli.py); the one that starts a controller as
    # the real process
    for command in (["jobs"], ["describe", "1"], ["nodes"], ["run", "--resume"]):
        if command[0] == "run":
            done = relaunch(state, *command)
        else:
            done = relaunch_here(*command, "--state-dir", str(state))
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr, (command, done.stderr)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) <= 2 and str(db) in done.stderr, (command, done.stderr)


def test_a_reused_pid_in_pids_json_is_never_killed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        started = psutil.Process(bystander.pid).create_time()
        # an agent recorded with this pid but another start time (the kernel reused the pid),
        # and a launcher recorded the old way (a bare pid) for a process that is not ours
        (state / "pids.json").write_text(
            json.dumps(
                {
                    "agents": {"node-0": [bystander.pid, started - 100.0]},
                    "launchers": {"1/0/1/node-0": bystander.pid},
                }
            )
        )
        LocalCluster(state).shutdown()
        LocalCluster(state).kill_node("node-0")
        assert bystander.poll() is None, "an unrelated process was killed"
    finally:
        bystander.kill()
        bystander.wait()


# -- part 3: hangs, graces, busy ranks ----------------------------------------------------------


def test_hang_restart_of_a_script_ignoring_sigterm_waits_the_hang_grace_not_900_s(
    cluster: Cluster,
) -> None:
    """A ModelArts-only job (no fault-scheduling label) whose script ignores SIGTERM, as
    Lightning's handler does: the hung processes get the short hang grace (5 s), not the
    termination grace, and never MindCluster's 900 s."""
    marks = cluster.dir / "marks"
    marks.mkdir()
    job = trapping_job(marks, exits=False, hang_detect_seconds=2)
    job["metadata"] = {
        "name": "modelarts",
        "annotations": {
            "fault-tolerance/job-retry-num": "3",
            "fault-tolerance/hang-retry": "true",
        },
    }
    job["spec"]["command"][2] = job["spec"]["command"][2].replace("100000", "60")
    faults = [{"kind": "hang", "at_step": 20, "pod": 0, "rank": 1}]
    result = cluster.run(job, faults, timeout=80)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.actions == ["hang-restart"]
    stops = [e.fields for e in result.said(EventKind.STOPPING)]
    assert [(s["pods"], s["containers"], s["grace_s"], s["hang"]) for s in stops] == [
        (1, "their containers stay", 5, True)
    ], stops


def test_a_busy_silent_rank_is_not_hung(cluster: Cluster) -> None:
    """One line of output, then 4 s of silent computation under a 1.5 s hang window: the rank's
    CPU time says it is alive. Before the fix: restarted three times, then Failed."""
    work = (
        "import time\n"
        "print('computing silently', flush=True)\n"
        "end = time.time() + 4\n"
        "while time.time() < end:\n"
        "    sum(i * i for i in range(20000))\n"
        "print('done', flush=True)\n"
    )
    job = toy_job({**AUTO, "fault-tolerance/hang-retry": "true"}, replicas=1, hang_detect_seconds=2)
    job["spec"]["procs_per_pod"] = 1
    job["spec"]["command"] = [sys.executable, "-c", work]
    result = cluster.run(job, startup_s=2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.report["recoveries"] == []


def test_a_stopped_rank_is_still_hung_though_its_peer_computes(cluster: Cluster) -> None:
    faults = [{"kind": "hang", "at_step": 10, "pod": 0, "rank": 1}]
    job = toy_job({**AUTO, "fault-tolerance/hang-retry": "true"}, replicas=1, steps=60)
    result = cluster.run(job, faults)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.actions == ["hang-restart"]


ALLOWANCE_S = 600


def test_a_hang_already_there_at_a_resume_is_found_within_the_hang_window(
    cluster: Cluster,
) -> None:
    """Rank 0 stops (a real hang, SIGSTOP) and the controller dies before the hang window (6 s)
    is over. The resumed controller adopts ranks that trained: they get the hang window, not
    the startup allowance (600 s here; before, a re-adopted rank counted as not yet started).
    The pods wait 10 s for the resumed controller (KILLED_CLUSTER): beside a CPU hog and a disk
    writer, a resume came after 3 s, the pods had ended themselves and the job started anew."""
    job = toy_job(HANG, steps=100000, hang_detect_seconds=6)
    run = start_and_wait(cluster, job, step=5, shape=KILLED_CLUSTER)
    rank0 = next(
        p
        for p in processes_of(cluster.state)
        if p.name().startswith("python")  # not the /bin/sh -c that runs it
        and "train_toy.py" in " ".join(p.cmdline())
        and p.environ().get("RANK") == "0"
    )
    rank0.suspend()
    time.sleep(2)  # its last steps reached the controller; the hang window has 4 s to run
    run.send_signal(signal.SIGKILL)
    run.wait()
    resume = cluster.resume_command()
    resume[resume.index("--startup-seconds") + 1] = str(ALLOWANCE_S)
    resumed = subprocess.Popen(
        resume, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.time() + ALLOWANCE_S / 2  # found long before the allowance ends
        while not query(cluster.state, "SELECT 1 FROM recoveries WHERE action = 'hang-restart'"):
            assert resumed.poll() is None, resumed.communicate()
            assert time.time() < deadline, "the hang was not found (startup allowance: 600 s)"
            time.sleep(0.1)
    finally:
        resumed.terminate()
        resumed.communicate(timeout=60)
