"""`relaunch bench`: recovery time by level, side by side with torchrun, in one run.

Every number comes from real runs on this machine: `relaunch run` on the embedded cluster with a
one-fault plan, and `torchrun` (from the installed torch) with the same DDP script crashing at the
same step. Writes DIR/bench.json, DIR/bench.md and DIR/bench.png.

MTTR is the time from the fault to the first training step completed after recovery. For the
crash level of the DDP workload both systems are measured from the script's own timeline (the
crashing rank writes the time it exits; rank 0 the time each step ends); otherwise relaunch's
record gives it (fault injection to first progress report after recovery).
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relaunch.bench_sections import (
    RELIABILITY_LEVELS,
    checkpoint_rows,
    overhead_row,
    reliability_rows,
    run_job,
    scale_rows,
)
from relaunch.cluster.local import kill_tree

__all__ = ["BenchOptions", "run_bench"]

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "examples" / "train_toy.py"
DDP = ROOT / "examples" / "ddp" / "train_ddp.py"
CLUSTER = {
    "nodes": 4,
    "chips_per_node": 2,
    "heartbeat_interval_s": 0.2,
    "heartbeat_timeout_s": 1.5,
    "adopt_grace_s": 10,
}
RETRY = {"fault-tolerance/job-retry-num": "8"}
LEVELS: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    # level -> (annotations, the fault that triggers it)
    "job-reschedule": (
        {**RETRY, "fault-tolerance/job-unconditional-retry": "true"},
        {"kind": "process-exit", "pod": 1, "rank": 3, "exit_code": 1},
    ),
    "in-place": (
        RETRY,
        {"kind": "chip-fault", "pod": 1, "chip": 0, "code": "80E18005", "heals": True},
    ),
    "hang-restart": (
        {**RETRY, "fault-tolerance/hang-retry": "true"},
        {"kind": "hang", "pod": 1, "rank": 3},
    ),
    "pod-reschedule": (
        {**RETRY, "fault-tolerance/pod-retry-num": "3"},
        {"kind": "node-down", "pod": 1},
    ),
    "isolated-job-reschedule": (RETRY, {"kind": "node-down", "pod": 1}),
    # Process level (DDP only: the healthy ranks keep running through train.group's keeper).
    "process-retry": (
        RETRY,
        {"kind": "memory-uce", "pod": 1, "chip": 0, "code": "80E01801", "heals": True},
    ),
    "process-in-place": (RETRY, {"kind": "process-exit", "pod": 1, "rank": 3, "exit_code": 1}),
    "process-reschedule": (RETRY, {"kind": "node-down", "pod": 1}),
    "process-in-place+spare": (
        RETRY,
        {"kind": "process-exit", "pod": 1, "rank": 3, "exit_code": 1},
    ),
    "process-reschedule+spare": (RETRY, {"kind": "node-down", "pod": 1}),
}
PROCESS_LEVELS = (
    "process-retry",
    "process-in-place",
    "process-reschedule",
    "process-in-place+spare",
    "process-reschedule+spare",
)
WARM_SPARE = "+spare"
"""A level measured with warm spares: spec.warm_spares 2, one per rank of a pod, kept in each
pod and on each standby node."""
PROCESS_LABELS = {"process-recover-enable": "on", "pod-rescheduling": "on"}
PROCESS_ANNOTATIONS = {
    "recover-strategy": "retry,recover-in-place,recover,dump,exit",
    "wait-reschedule-timeout": "60",
}
FAULT_STEP = 20
SECTIONS = ("mttr", "hang", "scale", "overhead", "checkpoint", "reliability")


@dataclass
class BenchOptions:
    out: Path
    quick: bool = False
    repeats: int = 5
    progress: Callable[[str], None] = print
    levels: tuple[str, ...] = ()
    sections: tuple[str, ...] = ()
    """Only these parts of the benchmark (all of SECTIONS when empty)."""
    """Only these levels in the MTTR table (all when empty); torchrun's row is always there."""


@dataclass
class Sample:
    ok: bool
    mttr_s: float | None = None
    detect_s: float | None = None
    lost_steps: int | None = None
    note: str = ""
    phases: dict[str, float] | None = None
    fault_at: float | None = None


@dataclass
class Row:
    system: str
    level: str
    workload: str
    pods: int
    repeats: int
    failures: int
    median_s: float | None
    min_s: float | None
    max_s: float | None
    detect_s: float | None
    lost_steps: float | None
    samples: list[float] = field(default_factory=list)
    phases: dict[str, float] | None = None
    """Median seconds of each part of the recovery (PHASES), from rank 0's timeline."""


def _job(
    workload: str, level: str, timeline: Path | None, pods: int = 2, procs: int = 2
) -> dict[str, Any]:
    annotations, _ = LEVELS[level]
    if workload == "light":
        command = f"python {TOY} --steps 60 --step-seconds 0.03 --ckpt-every 5"
        hang_s, grace = 2, 1
    else:
        crash = (
            f" --crash-at-step {FAULT_STEP} --crash-rank {pods * procs - 1}"
            if level == "job-reschedule"
            else ""
        )
        command = f"python {DDP} --steps 60 --ckpt-every 5 --timeline {timeline}{crash}"
        hang_s, grace = 4, 3
    labels = {"fault-scheduling": "grace", "grace-over-time": str(grace)}
    spares = {}
    if level in PROCESS_LEVELS:
        command = f"python {DDP} --process-recovery --steps 60 --ckpt-every 5"
        annotations = {**annotations, **PROCESS_ANNOTATIONS}
        labels = {**labels, **PROCESS_LABELS}
        if level.endswith(WARM_SPARE):
            spares = {"warm_spares": 2}
    return {
        "kind": "job",
        "metadata": {
            "name": f"bench-{workload}",
            "annotations": annotations,
            "labels": labels,
        },
        "spec": {
            "replicas": pods,
            "procs_per_pod": procs,
            "chips_per_pod": 2,
            "command": command,
            "hang_detect_seconds": hang_s,
            "monitor_interval": 0.1,
            **spares,
        },
    }


def _timeline(path: Path) -> list[tuple[str, int, float]]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            events.append((parts[0], int(parts[1]), float(parts[2])))
    return events


PHASES = ("detect", "stop_spawn", "import", "rendezvous", "model", "load", "first_step")
"""Where a DDP restart's time goes, in order: detection; stopping and spawning the processes (from
detection to rank 0's new interpreter starting); importing torch and the script's modules;
forming the gloo group; building the model, optimizer and DDP; loading the checkpoint; the first
step."""


def _phases(
    events: list[tuple[str, int, float]], fault_at: float, detect_s: float | None
) -> dict[str, float] | None:
    """The parts of one recovery from rank 0's timeline events after the fault (None when rank 0
    did not restart, as in process-level recoveries)."""
    marks: list[float] = []
    since = fault_at
    for name in ("launched", "imported", "group", "ddp", "loaded", "step"):
        # each mark is the first after the one before: steps the old processes completed
        # between the fault and their stop are not the first step after recovery
        found = next((t for e, _, t in events if e == name and t >= since), None)
        if found is None:
            return None
        marks.append(found)
        since = found
    launched, imported, group, ddp, loaded, step = marks
    detect = detect_s or 0.0
    return {
        "detect": round(detect, 3),
        "stop_spawn": round(launched - fault_at - detect, 3),
        "import": round(imported - launched, 3),
        "rendezvous": round(group - imported, 3),
        "model": round(ddp - group, 3),
        "load": round(loaded - ddp, 3),
        "first_step": round(step - loaded, 3),
    }


def _from_timeline(path: Path) -> Sample | None:
    """MTTR and lost steps from the script's own clock: crash -> first step after it."""
    events = _timeline(path)
    crash = next(((s, t) for e, s, t in events if e == "crash"), None)
    if crash is None:
        return None
    done_before = max((s for e, s, t in events if e == "step" and t < crash[1]), default=0)
    after = [(e, s, t) for e, s, t in events if t > crash[1]]
    resumed = next((s for e, s, _ in after if e == "start"), None)
    first = next((t for e, _, t in after if e == "step"), None)
    if first is None:
        return Sample(False, note="no step after the crash")
    lost = None if resumed is None else max(0, done_before - resumed)
    phases = _phases(events, crash[1], None)
    return Sample(True, mttr_s=first - crash[1], lost_steps=lost, phases=phases, fault_at=crash[1])


def _run_relaunch(
    tmp: Path, job: dict[str, Any], faults: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """`relaunch run` of one job with one fault plan on a fresh embedded cluster; its report."""
    report, _ = run_job(tmp, job, faults, CLUSTER, timeout=300)
    return report


def _single_recovery(report: dict[str, Any] | None, level: str) -> dict[str, Any] | None:
    """The report's one recovery record, if it is `level` and it worked."""
    records = report["recoveries"] if report else []
    action = level.removesuffix(WARM_SPARE)
    if len(records) != 1 or records[0]["action"] != action or records[0]["outcome"] != "succeeded":
        return None
    record: dict[str, Any] = records[0]
    return record


def _relaunch_once(workload: str, level: str, tmp: Path, procs: int = 2) -> Sample:
    timeline = tmp / "timeline.txt"
    _, fault = LEVELS[level]
    faults = (
        []
        if (workload == "ddp" and level == "job-reschedule")
        else [{**fault, "at_step": FAULT_STEP}]
    )
    report = _run_relaunch(tmp, _job(workload, level, timeline, procs=procs), faults)
    record = _single_recovery(report, level)
    if record is None:
        shown = (
            [(r["action"], r["outcome"]) for r in report["recoveries"]]
            if report
            else "the run failed"
        )
        return Sample(False, note=f"recoveries: {shown}")
    measured = _from_timeline(timeline)
    if measured is not None:
        # from the moment the rank decided to exit (its timeline) to relaunch's decision
        detect = round(max(0.0, record["detected_at"] - (measured.fault_at or 0.0)), 3)
        measured.detect_s = detect
        if measured.phases is not None:
            measured.phases["stop_spawn"] = round(measured.phases["stop_spawn"] - detect, 3)
            measured.phases["detect"] = detect
        return measured
    logs = "\n".join(
        p.read_text() for p in (tmp / "state" / "jobs").glob("*/pods/*/logs/rank-0.log")
    )
    resumes = [int(m) for m in re.findall(r"resume_step=(\d+)", logs)]
    lost = max(0, FAULT_STEP - resumes[-1]) if len(resumes) > 1 else None
    phases = _phases(_timeline(timeline), record["fault_at"], record["detect_s"])
    return Sample(
        True, mttr_s=record["mttr_s"], detect_s=record["detect_s"], lost_steps=lost, phases=phases
    )


def _relaunch_hang(window: float, tmp: Path, ignores_sigterm: bool = False) -> dict[str, Any]:
    """A rank stopped with SIGSTOP under relaunch, hang window `window` s (light workload).
    `ignores_sigterm`: the script ignores SIGTERM, as PyTorch Lightning's handler does, in a job
    with ModelArts annotations only (no fault-scheduling label): its hung processes wait for the
    hang grace (spec.hang_grace_seconds, 5 s) before SIGKILL."""
    job = _job("light", "hang-restart", None)
    job["spec"]["hang_detect_seconds"] = window
    # the healthy ranks must still be training when the hang is detected and they are stopped
    steps = FAULT_STEP + int((window + 2) / 0.03)
    job["spec"]["command"] = f"python {TOY} --steps {steps} --step-seconds 0.03 --ckpt-every 5"
    script = "exits on SIGTERM"
    if ignores_sigterm:
        job["spec"]["command"] += " --ignore-sigterm"
        job["metadata"]["labels"] = {}
        script = "ignores SIGTERM"
    report = _run_relaunch(tmp, job, [{**LEVELS["hang-restart"][1], "at_step": FAULT_STEP}])
    record = _single_recovery(report, "hang-restart")
    row: dict[str, Any] = {
        "system": "relaunch",
        "workload": "light",
        "script": script,
        "window_s": window,
    }
    if record is None:
        return {
            **row,
            "detected": False,
            "detect_s": None,
            "mttr_s": None,
            "note": "no hang-restart",
        }
    return {
        **row,
        "detected": True,
        "detect_s": record["detect_s"],
        "mttr_s": record["mttr_s"],
        "note": "",
    }


def _torchrun_hang(limit: float, tmp: Path, procs: int = 2) -> dict[str, Any]:
    """The same SIGSTOP under torchrun, which has no hang detector: does anything restart the job
    within `limit` s? (The script's gloo group times out after 60 s.)"""
    timeline = tmp / "timeline.txt"
    agents = _start_torchrun(
        tmp,
        timeline,
        ["--hang-at-step", str(FAULT_STEP), "--crash-rank", str(2 * procs - 1)],
        procs=procs,
    )
    deadline = time.time() + 120
    hung_at = None
    while time.time() < deadline:
        events = _timeline(timeline)
        hung_at = next((t for e, _, t in events if e == "hang"), hung_at)
        if hung_at is not None and (
            time.time() - hung_at > limit or any(e == "start" and t > hung_at for e, _, t in events)
        ):
            break
        time.sleep(0.2)
    _stop_torchrun(agents)
    row: dict[str, Any] = {
        "system": "torchrun",
        "workload": "ddp",
        "script": "exits on SIGTERM",
        "window_s": None,
    }
    if hung_at is None:
        return {
            **row,
            "detected": False,
            "detect_s": None,
            "mttr_s": None,
            "note": "the hang never happened",
        }
    events = _timeline(timeline)
    restart = next((t for e, _, t in events if e == "start" and t > hung_at), None)
    step = next((t for e, _, t in events if e == "step" and t > hung_at), None)
    if restart is None or restart - hung_at > limit:
        return {
            **row,
            "detected": False,
            "detect_s": None,
            "mttr_s": None,
            "note": f"not detected within {limit:g} s",
        }
    mttr = None if step is None else round(step - hung_at, 3)
    return {
        **row,
        "detected": True,
        "detect_s": round(restart - hung_at, 3),
        "mttr_s": mttr,
        "note": "restarted",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _start_torchrun(
    tmp: Path,
    timeline: Path,
    extra: list[str],
    max_restarts: int = 3,
    steps: int = 60,
    procs: int = 2,
) -> list[tuple[subprocess.Popen[bytes], Any]]:
    """The DDP script under torchrun --max-restarts=N: two agents (pods) of `procs` workers."""
    port = _free_port()
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
    agents = []
    for node_rank in range(2):
        args = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(procs),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
            str(DDP), "--steps", str(steps), "--ckpt-every", "5", "--ckpt-dir", str(tmp / "ckpt"),
            "--timeline", str(timeline), *extra,
        ]  # fmt: skip
        log = open(tmp / f"torchrun-{node_rank}.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        agents.append((proc, log))
    return agents


def _stop_torchrun(agents: list[tuple[subprocess.Popen[bytes], Any]], wait_s: float = 0.0) -> bool:
    """Wait up to `wait_s` for both agents to finish; kill whatever is left. True if both exited 0."""
    ok = True
    deadline = time.time() + wait_s
    for proc, log in agents:
        try:
            ok = proc.wait(timeout=max(0.01, deadline - time.time())) == 0 and ok
        except subprocess.TimeoutExpired:
            ok = False
        kill_tree(proc.pid)  # torchrun's workers run in sessions of their own
        proc.wait()
        log.close()
    return ok


def _torchrun_once(tmp: Path, procs: int = 2) -> Sample:
    timeline = tmp / "timeline.txt"
    crash = ["--crash-at-step", str(FAULT_STEP), "--crash-rank", str(2 * procs - 1)]
    agents = _start_torchrun(tmp, timeline, crash, procs=procs)
    ok = _stop_torchrun(agents, wait_s=240)
    measured = _from_timeline(timeline)
    if measured is None or not ok:
        return Sample(
            False, note="torchrun did not finish" if not ok else "no crash in the timeline"
        )
    return measured


def _row(system: str, level: str, workload: str, samples: list[Sample]) -> Row:
    good = [s for s in samples if s.ok and s.mttr_s is not None]
    times = [s.mttr_s for s in good if s.mttr_s is not None]
    detects = [s.detect_s for s in good if s.detect_s is not None]
    lost = [s.lost_steps for s in good if s.lost_steps is not None]
    return Row(
        system=system,
        level=level,
        workload=workload,
        pods=2,
        repeats=len(samples),
        failures=len(samples) - len(good),
        median_s=round(statistics.median(times), 3) if times else None,
        min_s=round(min(times), 3) if times else None,
        max_s=round(max(times), 3) if times else None,
        detect_s=round(statistics.median(detects), 3) if detects else None,
        lost_steps=statistics.median(lost) if lost else None,
        samples=[round(t, 3) for t in times],
        phases=_median_phases([s.phases for s in good if s.phases is not None]),
    )


def _median_phases(samples: list[dict[str, float]]) -> dict[str, float] | None:
    if not samples:
        return None
    return {k: round(statistics.median(p[k] for p in samples), 3) for k in PHASES}


def run_bench(options: BenchOptions) -> dict[str, Any]:
    options.out.mkdir(parents=True, exist_ok=True)
    repeats = 1 if options.quick else options.repeats
    procs = 1 if options.quick else 2  # DDP processes per pod: --quick starts half as many
    plan: list[tuple[str, str, str]] = [
        ("relaunch", "light", level) for level in LEVELS if level not in PROCESS_LEVELS
    ]
    ddp_levels = ["job-reschedule"] if options.quick else list(LEVELS)
    plan += [("relaunch", "ddp", level) for level in ddp_levels]
    if options.levels:
        plan = [(sy, w, lv) for sy, w, lv in plan if lv in options.levels]
    plan.append(("torchrun", "ddp", "job-reschedule"))
    sections = options.sections or SECTIONS
    extra: dict[str, Any] = {}
    rows = []
    started = time.time()
    if "mttr" not in sections:
        plan = []
    for system, workload, level in plan:
        samples = []
        for i in range(repeats):
            with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
                sample = (
                    _torchrun_once(Path(tmp), procs)
                    if system == "torchrun"
                    else _relaunch_once(
                        workload, level, Path(tmp), procs if workload == "ddp" else 2
                    )
                )
            samples.append(sample)
            shown = (
                f"{sample.mttr_s:.2f} s" if sample.mttr_s is not None else f"failed ({sample.note})"
            )
            options.progress(
                f"[{time.time() - started:6.0f} s] {system} {workload} {level} #{i + 1}: MTTR {shown}"
            )
        rows.append(_row(system, level, workload, samples))
    hangs = []
    windows = [2.0] if options.quick else [5.0, 10.0, 20.0]
    for window in windows if "hang" in sections else []:
        with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
            hangs.append(_relaunch_hang(window, Path(tmp)))
        options.progress(
            f"[{time.time() - started:6.0f} s] relaunch hang, window {window:g} s: {hangs[-1]}"
        )
        if window == windows[0]:
            with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
                hangs.append(_relaunch_hang(window, Path(tmp), ignores_sigterm=True))
            options.progress(
                f"[{time.time() - started:6.0f} s] relaunch hang, script ignoring SIGTERM, "
                f"window {window:g} s: {hangs[-1]}"
            )
    if "hang" in sections:
        with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
            hangs.append(_torchrun_hang(3.0 if options.quick else 90.0, Path(tmp), procs))
        options.progress(f"[{time.time() - started:6.0f} s] torchrun hang: {hangs[-1]}")
    if "scale" in sections:
        sizes = [2] if options.quick else [2, 4, 8, 16, 64]
        extra["scale"] = scale_rows(
            sizes, 1 if options.quick else min(3, repeats), options.progress, options.levels
        )
    if "overhead" in sections:
        extra["overhead"] = overhead_row(
            16 if options.quick else 256,
            2.0 if options.quick else 20.0,
            options.progress,
            report_hz=10.0 if options.quick else 2.0,
        )
    if "checkpoint" in sections:
        extra["checkpoint"] = checkpoint_rows(
            [8] if options.quick else [64, 512], 1 if options.quick else 3, options.progress
        )
    if "reliability" in sections:
        chosen = [lv for lv in RELIABILITY_LEVELS if not options.levels or lv in options.levels]
        extra["reliability"] = reliability_rows(
            1 if options.quick else 20,
            ["job-reschedule"] if options.quick else chosen,
            options.progress,
            torchrun=not options.quick and "job-reschedule" in chosen,
        )
        baseline = next((r for r in rows if r.system == "torchrun"), None)
        if options.quick and baseline is not None:
            # --quick: torchrun's crashes of the MTTR runs stand for its reliability row
            extra["reliability"].append(
                {
                    "system": "torchrun",
                    "level": baseline.level,
                    "workload": baseline.workload,
                    "jobs": baseline.repeats,
                    "injected": baseline.repeats,
                    "recovered": baseline.repeats - baseline.failures,
                    "other_actions": [],
                    "job_succeeded": baseline.failures == 0,
                    "median_mttr_s": baseline.median_s,
                }
            )
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": _torch_version(),
        },
        "quick": options.quick,
        "torchrun_env": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        "mttr": [asdict(r) for r in rows],
        "hang": hangs,
        "ratios": _ratios(rows),
        "scale": [],
        "overhead": None,
        "checkpoint": [],
        "reliability": [],
        **extra,
        "seconds": round(time.time() - started, 1),
    }
    (options.out / "bench.json").write_text(json.dumps(result, indent=2))
    (options.out / "bench.md").write_text(_markdown(result))
    _chart(rows, result["scale"], options.out / "bench.png")
    return result


def _torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def _ratios(rows: list[Row]) -> dict[str, float]:
    baseline = next((r.median_s for r in rows if r.system == "torchrun" and r.median_s), None)
    if not baseline:
        return {}
    return {
        f"{r.workload}/{r.level}": round(r.median_s / baseline, 3)
        for r in rows
        if r.system == "relaunch" and r.workload == "ddp" and r.median_s is not None
    }


MTTR_COLUMNS = {
    "system": "system", "workload": "workload", "level": "level", "repeats": "repeats",
    "failures": "failed", "median_s": "median MTTR s", "min_s": "min", "max_s": "max",
    "detect_s": "detect s", "lost_steps": "lost steps",
}  # fmt: skip
HANG_COLUMNS = {
    "system": "system", "workload": "workload", "script": "script", "window_s": "hang window s",
    "detected": "detected", "detect_s": "detect s", "mttr_s": "MTTR s", "note": "note",
}  # fmt: skip


def _table(rows: list[dict[str, Any]], columns: dict[str, str]) -> list[str]:
    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = ("-" if row[key] is None else str(row[key]) for key in columns)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


SCALE_COLUMNS = {
    "level": "level", "pods": "pods", "nodes": "nodes", "processes": "processes",
    "repeats": "repeats", "failures": "failed", "median_s": "median MTTR s", "min_s": "min",
    "max_s": "max", "detect_s": "detect s",
}  # fmt: skip
OVERHEAD_COLUMNS = {
    "processes": "processes", "pods": "pods", "nodes": "nodes", "window_s": "window s",
    "report_rate_hz": "reports / proc / s", "controller_ms_per_proc_s": "controller ms CPU / proc / s",
    "launchers_ms_per_proc_s": "launchers", "agents_ms_per_proc_s": "agents",
    "relaunch_ms_per_proc_s": "relaunch total", "relaunch_cores": "relaunch cores",
    "workers_ms_per_proc_s": "workers (for scale)", "detect_s": "crash detect s",
}  # fmt: skip
CHECKPOINT_COLUMNS = {
    "size_mb": "state MB", "raw_write_mb_s": "raw write MB/s", "save_mb_s": "SDK save MB/s",
    "save_vs_raw": "save / raw", "raw_read_mb_s": "raw read MB/s", "load_mb_s": "SDK load MB/s",
    "load_vs_raw": "load / raw", "async_stall_s": "async save stall s",
    "save_s": "sync save s", "async_total_s": "async done after s",
}  # fmt: skip
RELIABILITY_COLUMNS = {
    "system": "system", "level": "level", "workload": "workload", "jobs": "jobs",
    "injected": "faults injected",
    "recovered": "recovered", "other_actions": "other actions", "job_succeeded": "job succeeded",
    "median_mttr_s": "median MTTR s",
}  # fmt: skip


def _phase_rows(mttr: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"system": r["system"], "level": r["level"], "median_s": r["median_s"], **r["phases"]}
        for r in mttr
        if r.get("phases")
    ]


def _markdown(result: dict[str, Any]) -> str:
    lines = _table(result["mttr"], MTTR_COLUMNS)
    if result["hang"]:
        lines += ["", *_table(result["hang"], HANG_COLUMNS)]
    if result["ratios"]:
        lines.append("")
        lines.append(
            "relaunch / torchrun (DDP, median MTTR): "
            + ", ".join(f"{k} {v}" for k, v in result["ratios"].items())
        )
    phases = _phase_rows(result["mttr"])
    if phases:
        columns = {"system": "system", "level": "level", "median_s": "MTTR s"}
        columns.update({k: k.replace("_", " ") + " s" for k in PHASES})
        lines += ["", "Where the time goes (DDP, rank 0's timeline, medians):", ""]
        lines += _table(phases, columns)
    sections = (
        ("scale", "Scale (light workload, 2 processes per pod)", SCALE_COLUMNS),
        ("checkpoint", "Checkpoints against the raw disk", CHECKPOINT_COLUMNS),
        ("reliability", "Restart reliability", RELIABILITY_COLUMNS),
    )
    for key, title, table_columns in sections:
        if result.get(key):
            lines += ["", f"{title}:", "", *_table(result[key], table_columns)]
    if result.get("overhead"):
        lines += ["", "Controller overhead:", "", *_table([result["overhead"]], OVERHEAD_COLUMNS)]
    return "\n".join(lines) + "\n"


def _chart(rows: list[Row], scale: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.median_s is not None]
    labels = [f"{r.system}\n{r.workload}\n{r.level}" for r in shown]
    width = max(6, 1.1 * len(shown))
    if scale:
        figure, (axes, grows) = plt.subplots(
            1, 2, figsize=(width + 5, 4), gridspec_kw={"width_ratios": [width, 5]}
        )
        for level in dict.fromkeys(r["level"] for r in scale):
            points = [(r["pods"], r["median_s"]) for r in scale if r["level"] == level]
            points = [(x, y) for x, y in points if y is not None]
            grows.plot([x for x, _ in points], [y for _, y in points], marker="o", label=level)
        grows.set_xscale("log", base=2)
        grows.set_xlabel("pods (2 light processes each)")
        grows.set_ylabel("median MTTR, s")
        grows.set_title("MTTR as the job grows")
        grows.legend(fontsize=7)
    else:
        figure, axes = plt.subplots(figsize=(width, 4))
    colours = ["tab:orange" if r.system == "torchrun" else "tab:blue" for r in shown]
    axes.bar(range(len(shown)), [r.median_s or 0 for r in shown], color=colours)
    axes.errorbar(
        range(len(shown)),
        [r.median_s or 0 for r in shown],
        yerr=[
            [(r.median_s or 0) - (r.min_s or 0) for r in shown],
            [(r.max_s or 0) - (r.median_s or 0) for r in shown],
        ],
        fmt="none",
        ecolor="black",
        capsize=3,
    )
    axes.set_xticks(range(len(shown)), labels, fontsize=7)
    axes.set_ylabel("MTTR, s (fault -> first step after recovery)")
    axes.set_title("Recovery time by level (median, min-max)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
