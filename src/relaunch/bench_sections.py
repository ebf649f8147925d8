"""The parts of `relaunch bench` beyond MTTR by level: scale, controller overhead, checkpoint
throughput against the raw disk, and restart reliability over many injected crashes.

Each function runs real jobs (`relaunch run` on a fresh embedded cluster, or torchrun from the
installed torch) and returns plain dicts for bench.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import yaml

from relaunch.cluster.local import LocalCluster

__all__ = [
    "RELIABILITY_LEVELS",
    "checkpoint_rows",
    "overhead_row",
    "reliability_rows",
    "run_job",
    "scale_rows",
]

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "examples" / "train_toy.py"
DDP = ROOT / "examples" / "ddp" / "train_ddp.py"
Progress = Callable[[str], None]

SCALE_LEVELS: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    # the fault hits the last pod (not pod 0, whose rank 0 makes some losses job-level)
    "job-reschedule": (
        {"fault-tolerance/job-unconditional-retry": "true"},
        {"kind": "process-exit", "exit_code": 1},
    ),
    "pod-reschedule": ({"fault-tolerance/pod-retry-num": "30"}, {"kind": "node-down"}),
    "in-place": ({}, {"kind": "chip-fault", "chip": 0, "code": "80E18005"}),
}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _cluster(nodes: int, chips: int) -> dict[str, Any]:
    return {
        "nodes": nodes,
        "chips_per_node": chips,
        "heartbeat_interval_s": 0.2,
        "heartbeat_timeout_s": 1.5,
        "adopt_grace_s": 10,
    }


def _light_job(
    pods: int,
    annotations: dict[str, str],
    *,
    procs: int = 2,
    chips: int = 2,
    steps: int = 60,
    step_s: float = 0.03,
    hang_s: float = 2,
) -> dict[str, Any]:
    return {
        "kind": "job",
        "metadata": {
            "name": "bench-light",
            "annotations": {"fault-tolerance/job-retry-num": "40", **annotations},
            "labels": {"fault-scheduling": "grace", "grace-over-time": "1"},
        },
        "spec": {
            "replicas": pods,
            "procs_per_pod": procs,
            "chips_per_pod": chips,
            "command": f"python {TOY} --steps {steps} --step-seconds {step_s} --ckpt-every 5",
            "hang_detect_seconds": hang_s,
            "monitor_interval": 0.1,
        },
    }


def run_job(
    tmp: Path,
    job: dict[str, Any],
    faults: list[dict[str, Any]],
    cluster: dict[str, Any],
    timeout: float = 600,
    during: Callable[[subprocess.Popen[bytes], Path], dict[str, Any]] | None = None,
    extra_args: tuple[str, ...] = (),
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """`relaunch run` of one job with a fault plan on a fresh embedded cluster: its report (None
    if it failed) and whatever `during` measured while it ran."""
    (tmp / "job.yaml").write_text(yaml.safe_dump(job))
    (tmp / "faults.yaml").write_text(yaml.safe_dump({"faults": faults}))
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    args = [
        sys.executable, "-m", "relaunch", "run", str(tmp / "job.yaml"), "--faults", str(tmp / "faults.yaml"),
        "--cluster", str(tmp / "cluster.yaml"), "--state-dir", str(tmp / "state"),
        "--report", str(tmp / "report.json"), "--startup-seconds", "120", "-q", *extra_args,
    ]  # fmt: skip
    with open(tmp / "run.log", "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        measured: dict[str, Any] = {}
        try:
            if during is not None:
                measured = during(proc, tmp / "state")
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                from relaunch.cluster.local import kill_tree

                kill_tree(proc.pid)
                proc.wait()
    report_path = tmp / "report.json"
    if proc.returncode != 0 or not report_path.exists():
        return None, measured
    report: dict[str, Any] = json.loads(report_path.read_text())
    return report, measured


# -- scale ---------------------------------------------------------------------------------------


def scale_rows(
    sizes: list[int], repeats: int, progress: Progress, levels: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """MTTR of job-level vs pod-level vs in-place as the job grows (light workers, 2 processes a
    pod). Up to 16 pods: one pod per 2-chip node; beyond: two pods per 4-chip node (64 pods on 32
    nodes). Two spare nodes take the pods of a lost node."""
    rows = []
    started = time.time()
    for pods in sizes:
        packed = pods > 16
        nodes = (pods // 2 if packed else pods) + 2
        cluster = _cluster(nodes, 4 if packed else 2)
        for level, (tolerance, fault) in SCALE_LEVELS.items():
            if levels and level not in levels:
                continue
            times, detects, failures = [], [], 0
            # The fault comes once every worker runs: 128 processes take seconds to start here.
            at_step = max(20, 8 * pods)
            plan = [{**fault, "pod": pods - 1, "at_step": at_step}]
            for i in range(repeats):
                job = _light_job(pods, tolerance, steps=at_step + 60, step_s=0.05)
                with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
                    report, _ = run_job(Path(tmp), job, plan, cluster)
                record = _only_record(report, level)
                if record is None:
                    failures += 1
                else:
                    times.append(record["mttr_s"])
                    detects.append(record["detect_s"])
                shown = f"{times[-1]:.2f} s" if record is not None else "failed"
                progress(
                    f"[{time.time() - started:6.0f} s] scale {pods} pods {level} #{i + 1}: MTTR {shown}"
                )
            rows.append(
                {
                    "level": level,
                    "pods": pods,
                    "nodes": nodes,
                    "processes": 2 * pods,
                    "repeats": repeats,
                    "failures": failures,
                    "median_s": _median(times),
                    "min_s": round(min(times), 3) if times else None,
                    "max_s": round(max(times), 3) if times else None,
                    "detect_s": _median(detects),
                }
            )
    return rows


def _only_record(report: dict[str, Any] | None, action: str) -> dict[str, Any] | None:
    records = report["recoveries"] if report else []
    if len(records) != 1 or records[0]["action"] != action or records[0]["outcome"] != "succeeded":
        return None
    record: dict[str, Any] = records[0]
    return record


# -- controller overhead -------------------------------------------------------------------------


def _cpu(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def _family(state: Path) -> tuple[list[psutil.Process], list[psutil.Process], list[psutil.Process]]:
    """The embedded cluster's launchers, agents and workers (every process under a launcher)."""
    cluster = LocalCluster(state)
    launchers = cluster.processes("launchers")
    agents = cluster.processes("agents")
    workers: list[psutil.Process] = []
    for launcher in launchers:
        with contextlib.suppress(psutil.Error):
            workers += launcher.children(recursive=True)
    return launchers, agents, workers


def overhead_row(
    processes: int, window_s: float, progress: Progress, report_hz: float = 10.0
) -> dict[str, Any]:
    """CPU time of relaunch's own processes (controller, launchers, agents) per supervised process
    per second, with `processes` light workers each reporting progress `report_hz` times a
    second; then the detection latency of a crash injected at that load."""
    from relaunch.store import Outcome, Store

    procs_per_pod = 4
    pods = processes // procs_per_pod
    nodes = max(2, pods // 2)
    job = _light_job(
        pods,
        {"fault-tolerance/job-unconditional-retry": "true"},
        procs=procs_per_pod,
        chips=4,
        steps=100_000,
        step_s=1.0 / report_hz,
        hang_s=60,
    )
    cluster = _cluster(nodes, 8)

    def measure(run: subprocess.Popen[bytes], state: Path) -> dict[str, Any]:
        deadline = time.time() + 600
        while time.time() < deadline and run.poll() is None:
            launchers, agents, workers = _family(state)
            pythons = [w for w in workers if _named_python(w)]
            if len(launchers) == pods and len(pythons) >= processes:
                break
            time.sleep(0.5)
        time.sleep(3.0)  # every worker past its start, reporting
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
        measured: dict[str, Any] = {"wall_s": wall, "cpu_s": used, "workers": len(workers)}
        # then a crash under that load: its detection latency, from relaunch's record
        store = Store(state / "relaunch.db")
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

    with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
        _, measured = run_job(Path(tmp), job, [], cluster, timeout=120, during=measure)
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
    for name in ("controller", "launchers", "agents", "workers"):
        spent = cpu.get(name)
        row[f"{name}_cpu_s"] = None if spent is None else round(spent, 3)
        row[f"{name}_ms_per_proc_s"] = (
            None if spent is None else round(1000 * spent / (processes * wall), 4)
        )
    relaunch_cpu = sum(cpu.get(n, 0.0) for n in ("controller", "launchers", "agents"))
    row["relaunch_ms_per_proc_s"] = round(1000 * relaunch_cpu / (processes * wall), 4)
    row["relaunch_cores"] = round(relaunch_cpu / wall, 3)
    row["detect_s"] = measured.get("detect_s")
    row["mttr_s"] = measured.get("mttr_s")
    progress(f"overhead, {processes} processes: {row}")
    return row


def _named_python(process: psutil.Process) -> bool:
    try:
        return process.name().startswith("python")
    except psutil.Error:
        return False


# -- checkpoints ---------------------------------------------------------------------------------


def _drop_cache(path: Path) -> None:
    """Evict a file's pages, so that the next read comes from the disk (not the page cache)."""
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw(directory: Path, data: bytes) -> tuple[float, float]:
    """Sequential write (with fsync) and cold read of `data` through plain file calls: s, s."""
    path = directory / "raw.bin"
    chunk = 8 << 20
    view = memoryview(data)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for offset in range(0, len(data), chunk):
            f.write(view[offset : offset + chunk])
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - start
    _drop_cache(path)
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(chunk):
            pass
    read_s = time.perf_counter() - start
    path.unlink()
    return write_s, read_s


def checkpoint_rows(sizes_mb: list[int], repeats: int, progress: Progress) -> list[dict[str, Any]]:
    """The SDK's save and load of a state of each size against the raw disk, same files, same run;
    and how long an asynchronous save stalls the training loop."""
    import torch

    from relaunch.train import CheckpointManager

    rows = []
    for mb in sizes_mb:
        tensor = torch.randn(mb * (1 << 20) // 4, generator=torch.Generator().manual_seed(mb))
        raw_bytes = tensor.numpy().tobytes()
        samples: dict[str, list[float]] = {
            k: [] for k in ("raw_write", "raw_read", "save", "load", "async_stall", "async_total")
        }
        for _ in range(repeats):
            with tempfile.TemporaryDirectory(prefix="relaunch-bench-ckpt-", dir=ROOT) as tmp:
                directory = Path(tmp)
                write_s, read_s = _raw(directory, raw_bytes)
                samples["raw_write"].append(write_s)
                samples["raw_read"].append(read_s)
                manager = CheckpointManager(directory / "sync", rank=0, keep=1)
                start = time.perf_counter()
                manager.save(1, {"weights": tensor})
                samples["save"].append(time.perf_counter() - start)
                for path in (directory / "sync").rglob("*"):
                    if path.is_file():
                        _drop_cache(path)
                start = time.perf_counter()
                loaded = manager.load()
                samples["load"].append(time.perf_counter() - start)
                assert loaded is not None and torch.equal(loaded.state["weights"], tensor)
                del loaded
                background = CheckpointManager(directory / "async", rank=0, keep=1, async_save=True)
                start = time.perf_counter()
                background.save(1, {"weights": tensor})
                samples["async_stall"].append(time.perf_counter() - start)
                background.wait()
                samples["async_total"].append(time.perf_counter() - start)
        med = {k: statistics.median(v) for k, v in samples.items()}
        row = {
            "size_mb": mb,
            "repeats": repeats,
            "raw_write_mb_s": round(mb / med["raw_write"], 1),
            "raw_read_mb_s": round(mb / med["raw_read"], 1),
            "save_mb_s": round(mb / med["save"], 1),
            "load_mb_s": round(mb / med["load"], 1),
            "save_vs_raw": round(med["raw_write"] / med["save"], 3),
            "load_vs_raw": round(med["raw_read"] / med["load"], 3),
            "save_s": round(med["save"], 3),
            "load_s": round(med["load"], 3),
            "async_stall_s": round(med["async_stall"], 3),
            "async_total_s": round(med["async_total"], 3),
        }
        progress(f"checkpoint {mb} MB: {row}")
        rows.append(row)
        del tensor, raw_bytes
    return rows


# -- restart reliability -------------------------------------------------------------------------

RELIABILITY_LIGHT: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    "job-reschedule": (
        {"fault-tolerance/job-unconditional-retry": "true"},
        {"kind": "process-exit", "pod": 1, "rank": 3, "exit_code": 1},
    ),
    "in-place": ({}, {"kind": "chip-fault", "pod": 1, "chip": 0, "code": "80E18005"}),
    "hang-restart": (
        {"fault-tolerance/hang-retry": "true"},
        {"kind": "hang", "pod": 1, "rank": 3},
    ),
    "pod-reschedule": ({"fault-tolerance/pod-retry-num": "40"}, {"kind": "node-down", "pod": 1}),
    "isolated-job-reschedule": ({}, {"kind": "node-down", "pod": 1}),
}
RELIABILITY_PROCESS: dict[str, dict[str, Any]] = {
    "process-retry": {"kind": "memory-uce", "pod": 1, "chip": 0, "code": "80E01801"},
    "process-in-place": {"kind": "process-exit", "pod": 1, "rank": 3, "exit_code": 1},
    "process-reschedule": {"kind": "node-down", "pod": 1},
}
RELIABILITY_LEVELS = (*RELIABILITY_LIGHT, *RELIABILITY_PROCESS)


IN_A_ROW = {"job-reschedule": 3, "hang-restart": 3}
"""R-21 and R-24 allow three of these in a row and fail the job on the fourth: their faults
are injected in runs of three, each run a new job."""


def _reliability(
    level: str, workload: str, reports: list[dict[str, Any] | None], crashes: int
) -> dict[str, Any]:
    records = [r for report in reports if report for r in report["recoveries"]]
    ours = [r for r in records if r["action"] == level]
    succeeded = [r for r in ours if r["outcome"] == "succeeded"]
    mttrs = [r["mttr_s"] for r in succeeded if r.get("mttr_s") is not None]
    return {
        "system": "relaunch",
        "level": level,
        "workload": workload,
        "jobs": len(reports),
        "injected": crashes,
        "recovered": len(succeeded),
        "other_actions": sorted({r["action"] for r in records} - {level}),
        "job_succeeded": all(
            report is not None and str(report.get("status")).lower() == "succeeded"
            for report in reports
        ),
        "median_mttr_s": _median(mttrs),
    }


def reliability_rows(
    crashes: int, levels: list[str], progress: Progress, torchrun: bool = True
) -> list[dict[str, Any]]:
    """`crashes` faults per level (one every 10 steps of a job), each of which must be recovered
    by that level; and the same number of crashes under torchrun --max-restarts=`crashes`."""
    rows = []
    started = time.time()
    for level in levels:
        per_job = min(crashes, IN_A_ROW.get(level, crashes))
        plans = [per_job] * (crashes // per_job) + (
            [crashes % per_job] if crashes % per_job else []
        )
        reports = []
        for count in plans:
            steps = 10 * count + 20
            if level in RELIABILITY_LIGHT:
                tolerance, fault = RELIABILITY_LIGHT[level]
                job = _light_job(2, tolerance, steps=steps)
                workload = "light"
            else:
                fault = RELIABILITY_PROCESS[level]
                job = _process_job(steps)
                workload = "ddp"
            nodes = 3 + (count if fault["kind"] == "node-down" else 0)
            faults = [{**fault, "at_step": 10 * (i + 1)} for i in range(count)]
            with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
                # R-10 would isolate a node after 3 faults of one code in a row; here every
                # fault is to be handled by the level under test, so the threshold is raised.
                table = Path(tmp) / "fault-table.yaml"
                table.write_text(yaml.safe_dump({"escalation": {"threshold": 100}}))
                report, _ = run_job(
                    Path(tmp),
                    job,
                    faults,
                    _cluster(nodes, 2),
                    timeout=1800,
                    extra_args=("--fault-table", str(table)),
                )
            reports.append(report)
        rows.append(_reliability(level, workload, reports, crashes))
        progress(f"[{time.time() - started:6.0f} s] reliability {level}: {rows[-1]}")
    if torchrun:
        with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
            rows.append(torchrun_reliability(Path(tmp), crashes))
        progress(f"[{time.time() - started:6.0f} s] reliability torchrun: {rows[-1]}")
    return rows


def _process_job(steps: int) -> dict[str, Any]:
    return {
        "kind": "job",
        "metadata": {
            "name": "bench-ddp",
            "annotations": {
                "fault-tolerance/job-retry-num": "40",
                "recover-strategy": "retry,recover-in-place,recover,dump,exit",
                "wait-reschedule-timeout": "60",
            },
            "labels": {
                "fault-scheduling": "grace",
                "grace-over-time": "3",
                "process-recover-enable": "on",
                "pod-rescheduling": "on",
            },
        },
        "spec": {
            "replicas": 2,
            "procs_per_pod": 2,
            "chips_per_pod": 2,
            "command": f"python {DDP} --process-recovery --steps {steps} --ckpt-every 5",
            "hang_detect_seconds": 4,
            "monitor_interval": 0.1,
        },
    }


def torchrun_reliability(tmp: Path, crashes: int) -> dict[str, Any]:
    """The DDP script under torchrun --max-restarts=`crashes`, rank 3 exiting 1 once in each of
    the first `crashes` attempts; a restart that makes no step within 90 s counts as failed."""
    from relaunch.bench import _start_torchrun, _stop_torchrun, _timeline

    timeline = tmp / "timeline.txt"
    crash = ["--crash-every", "10", "--crash-attempts", str(crashes)]
    agents = _start_torchrun(tmp, timeline, crash, max_restarts=crashes, steps=10 * crashes + 20)
    stalled = False
    while any(p.poll() is None for p, _ in agents):
        events = _timeline(timeline)
        last = max((t for _, _, t in events), default=time.time())
        if time.time() - last > 90:
            stalled = True
            break
        time.sleep(0.5)
    ok = _stop_torchrun(agents, wait_s=5) and not stalled
    events = _timeline(timeline)
    crash_times = [t for e, _, t in events if e == "crash"]
    recovered = sum(1 for at in crash_times if any(e == "step" and t > at for e, _, t in events))
    mttrs = [
        min(t for e, _, t in events if e == "step" and t > at) - at
        for at in crash_times
        if any(e == "step" and t > at for e, _, t in events)
    ]
    return {
        "system": "torchrun",
        "level": "job-reschedule",
        "workload": "ddp",
        "jobs": 1,
        "injected": len(crash_times),
        "recovered": recovered,
        "other_actions": [],
        "job_succeeded": ok,
        "median_mttr_s": _median(mttrs),
    }
