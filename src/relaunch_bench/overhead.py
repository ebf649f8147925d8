"""CPU time of relaunch's own processes per supervised process, and crash detection under load."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from relaunch.cluster.config import ClusterConfig
from relaunch.cluster.local import LocalCluster
from relaunch.protocol.layout import StateDir
from relaunch.store import Outcome, Store
from relaunch_bench.jobs import Progress, cluster, light_job, run_job

GROUPS = ("controller", "launchers", "agents", "workers")
RELAUNCH = ("controller", "launchers", "agents")


_DEFAULT = ClusterConfig()
HEARTBEATS = ((_DEFAULT.heartbeat_interval_s, _DEFAULT.heartbeat_timeout_s), (0.2, 1.5))
"""(interval, timeout) of the agents' heartbeats measured: the embedded cluster's default, and
the bench's fast one (node loss in 1.5 s) that the MTTR rows use."""


def overhead_rows(
    processes: int, window_s: float, say: Progress, report_hz: float, quick: bool
) -> list[dict[str, Any]]:
    """overhead_row at each of HEARTBEATS (--quick: the default only)."""
    chosen = HEARTBEATS[:1] if quick else HEARTBEATS
    return [overhead_row(processes, window_s, say, report_hz, *beat) for beat in chosen]


def overhead_row(
    processes: int,
    window_s: float,
    say: Progress,
    report_hz: float = 10.0,
    heartbeat_s: float = _DEFAULT.heartbeat_interval_s,
    heartbeat_timeout_s: float = _DEFAULT.heartbeat_timeout_s,
) -> dict[str, Any]:
    """CPU time of relaunch's own processes (controller, launchers, agents) per supervised process
    per second, with `processes` light workers each reporting progress `report_hz` times a
    second and agents beating every `heartbeat_s`; then the detection latency of a crash
    injected at that load."""
    procs_per_pod = 4
    pods = processes // procs_per_pod
    nodes = max(2, pods // 2)
    job = light_job(
        pods,
        {"fault-tolerance/job-unconditional-retry": "true"},
        procs=procs_per_pod,
        chips=4,
        steps=100_000,
        step_s=1.0 / report_hz,
        hang_s=60,
    )

    def during(run: subprocess.Popen[bytes], state: Path) -> dict[str, Any]:
        _wait_for_workers(run, state, pods, processes)
        measured = _cpu_over(run, state, window_s)
        measured.update(_crash_under_load(run, state))
        return measured

    with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
        _, measured = run_job(
            Path(tmp),
            job,
            [],
            cluster(nodes, 8, heartbeat_s, heartbeat_timeout_s),
            timeout=120,
            during=during,
        )
    row = _row(processes, pods, nodes, report_hz, measured)
    row["heartbeat_s"] = heartbeat_s
    say(f"overhead, {processes} processes: {row}")
    return row


def _row(
    processes: int, pods: int, nodes: int, report_hz: float, measured: dict[str, Any]
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "processes": processes,
        "pods": pods,
        "nodes": nodes,
        "window_s": round(measured.get("wall_s", 0.0), 2),
        "workers_seen": measured.get("workers"),
        "report_rate_hz": report_hz,
        "ok": measured.get("detect_s") is not None,
    }
    cpu = measured.get("cpu_s", {})
    wall = measured.get("wall_s") or 1.0
    for name in GROUPS:
        spent = cpu.get(name)
        row[f"{name}_cpu_s"] = None if spent is None else round(spent, 3)
        row[f"{name}_ms_per_proc_s"] = (
            None if spent is None else round(1000 * spent / (processes * wall), 4)
        )
    relaunch_cpu = sum(cpu.get(n, 0.0) for n in RELAUNCH)
    row["relaunch_ms_per_proc_s"] = round(1000 * relaunch_cpu / (processes * wall), 4)
    row["relaunch_cores"] = round(relaunch_cpu / wall, 3)
    row["detect_s"] = measured.get("detect_s")
    row["mttr_s"] = measured.get("mttr_s")
    return row


def _cpu(processes: list[psutil.Process]) -> float:
    """CPU seconds the processes' threads have run: from the scheduler's own count in
    nanoseconds (/proc/PID/task/TID/schedstat), where the user and system times are counted in
    10 ms ticks (a launcher runs well under a tick a second); those where it is missing."""
    total = 0.0
    for process in processes:
        ran = _scheduled_s(process.pid)
        if ran is not None:
            total += ran
            continue
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def _scheduled_s(pid: int) -> float | None:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat", "rb") as stat:
                total += int(stat.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def _family(state: Path) -> tuple[list[psutil.Process], list[psutil.Process], list[psutil.Process]]:
    """The embedded cluster's launchers, agents and workers (every process under a launcher)."""
    local = LocalCluster(state)
    launchers = local.processes("launchers")
    agents = local.processes("agents")
    workers: list[psutil.Process] = []
    for launcher in launchers:
        with contextlib.suppress(psutil.Error):
            workers += launcher.children(recursive=True)
    return launchers, agents, workers


def _named_python(process: psutil.Process) -> bool:
    try:
        return process.name().startswith("python")
    except psutil.Error:
        return False


def _wait_for_workers(run: subprocess.Popen[bytes], state: Path, pods: int, processes: int) -> None:
    """Until every launcher and worker interpreter is up (10 min at most), then 3 s more: every
    worker past its start, reporting."""
    deadline = time.time() + 600
    while time.time() < deadline and run.poll() is None:
        launchers, _, workers = _family(state)
        pythons = [w for w in workers if _named_python(w)]
        if len(launchers) == pods and len(pythons) >= processes:
            break
        time.sleep(0.5)
    time.sleep(3.0)


def _cpu_over(run: subprocess.Popen[bytes], state: Path, window_s: float) -> dict[str, Any]:
    """CPU seconds each group of processes spent over `window_s` s of wall time."""
    launchers, agents, workers = _family(state)
    groups = {
        "controller": [psutil.Process(run.pid)],
        "launchers": launchers,
        "agents": agents,
        "workers": workers,
    }
    before = {name: _cpu(group) for name, group in groups.items()}
    wall = time.time()
    time.sleep(window_s)
    wall = time.time() - wall
    used = {name: _cpu(group) - before[name] for name, group in groups.items()}
    return {"wall_s": wall, "cpu_s": used, "workers": len(workers)}


def _crash_under_load(run: subprocess.Popen[bytes], state: Path) -> dict[str, Any]:
    """A crash appended to the running job's plan: its detection latency and MTTR from relaunch's
    record; then the job is asked to stop."""
    store = Store(StateDir(state).db)
    measured: dict[str, Any] = {}
    try:
        (job_row,) = store.jobs()
        store.append_plan(
            job_row.id, [{"kind": "process-exit", "pod": 1, "after_s": 0, "exit_code": 1}]
        )
        deadline = time.time() + 300
        while time.time() < deadline and run.poll() is None:
            done = [r for r in store.records(job_row.id) if r.outcome is Outcome.SUCCEEDED]
            if done:
                measured["detect_s"] = round(done[0].detected_at - done[0].fault_at, 3)
                measured["mttr_s"] = done[0].mttr_s
                break
            time.sleep(0.5)
        store.request_stop(job_row.id, "benchmark done", time.time())
    finally:
        store.close()
    return measured
