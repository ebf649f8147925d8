"""Recovery time by level (MTTR) and hang detection, side by side with torchrun.

MTTR is the time from the fault to the first training step completed after recovery. For the
crash levels of the DDP workload (job-reschedule, process-in-place: `scripts_its_crash`) every
system is measured from the script's own timeline (the crashing rank writes the time it exits;
rank 0 the time each step ends); otherwise relaunch's record gives it (fault injection to first
progress report after recovery).
"""

from __future__ import annotations

import re
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relaunch_bench import timeline, torchrun
from relaunch_bench.jobs import (
    DDP,
    FAULT_STEP,
    GPU_STEP_S,
    SAVE_FAULT_STEP,
    TOY,
    Progress,
    cluster,
    keep_failed,
    only_record,
    run_job,
)
from relaunch_bench.timeline import PHASES, Sample

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
    # The same node lost while the ranks save a checkpoint: the fault waits for the save
    # (R-37's hold, at most the hang window), then process level moves the lost ranks.
    "process-reschedule@save": (RETRY, {"kind": "node-down", "pod": 1}),
}
DURING_SAVE = "@save"
"""A level whose fault lands on a checkpoint step (SAVE_FAULT_STEP), during the save: that
save is held SAVE_HELD_S longer (a large model's), so that the surviving ranks are surely still
saving when the fault is found: it waits for the save, shorter than the DDP rows' 4 s hang
window, and is then handled by the row's own level."""
SAVE_HELD_S = 3
HANG_GRACE_WARM_S = 1
"""spec.hang_grace_seconds of the warm hang-restart row (and the series): the default 5 s is
for ranks that can still save when stopped; the DDP example's healthy ranks, blocked in a
collective with the hung one, cannot."""
WARM_SPARE = "+spare"
"""A level measured with warm spares: spec.warm_spares set to the processes of a pod, kept in
each pod and, in a standby launcher, on each schedulable node."""


def scripts_its_crash(workload: str, level: str) -> bool:
    """The DDP rows whose fault is a crash exit by themselves at FAULT_STEP (the script's
    --crash-at-step), as the peers' scripts do, and are timed from that exit on the script's
    own clock: a fault plan's exit fires at the step's report, a few steps later (4 steps, 0.07
    s, of a process-in-place run's 0.30 s were that delay)."""
    return workload == "ddp" and handled_by(level) in ("job-reschedule", "process-in-place")


def handled_by(level: str) -> str:
    """The action whose record a row measures: its own level, whether warm spares are kept or
    the fault lands in a save (which it now waits for, R-37's hold; before the hold, the `@save`
    row's fault went to pod-reschedule)."""
    return level.removesuffix(WARM_SPARE).removesuffix(DURING_SAVE)


JOB_LEVELS = (
    "job-reschedule",
    "in-place",
    "hang-restart",
    "pod-reschedule",
    "isolated-job-reschedule",
)
LEVELS.update({level + WARM_SPARE: LEVELS[level] for level in JOB_LEVELS})
PROCESS_LEVELS = (
    "process-retry",
    "process-in-place",
    "process-reschedule",
    "process-in-place+spare",
    "process-reschedule+spare",
    "process-reschedule@save",
)
PROCESS_LABELS = {"process-recover-enable": "on", "pod-rescheduling": "on"}
PROCESS_ANNOTATIONS = {
    "recover-strategy": "retry,recover-in-place,recover,dump,exit",
    "wait-reschedule-timeout": "60",
}
CLUSTER = cluster(4, 2)


@dataclass
class Row:
    """One system and level of the MTTR table: the median of its samples."""

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
    workload: str,
    level: str,
    timeline_path: Path | None,
    pods: int = 2,
    procs: int = 2,
    device: str = "cpu",
    step_s: float | None = None,
) -> dict[str, Any]:
    annotations, _ = LEVELS[level]
    crash = (
        f" --crash-at-step {FAULT_STEP} --crash-rank {pods * procs - 1}"
        if scripts_its_crash(workload, level)
        else ""
    )
    if workload == "light":
        command = f"python {TOY} --steps 60 --step-seconds 0.03 --ckpt-every 5"
        hang_s, grace = 2, 1
    else:
        command = f"python {DDP} --steps 60 --ckpt-every 5 --timeline {timeline_path}{crash}"
        hang_s, grace = 4, 3
    labels = {"fault-scheduling": "grace", "grace-over-time": str(grace)}
    spares: dict[str, Any] = {}
    if level in PROCESS_LEVELS:
        command = f"python {DDP} --process-recovery --steps 60 --ckpt-every 5"
        if crash:
            command += f" --timeline {timeline_path}{crash}"
        annotations = {**annotations, **PROCESS_ANNOTATIONS}
        labels = {**labels, **PROCESS_LABELS}
    if workload == "ddp" and device != "cpu":
        command += f" --device {device}"
    step_s = GPU_STEP_S if step_s is None and device != "cpu" else step_s
    if workload == "ddp" and step_s is not None:
        command += f" --step-seconds {step_s}"
    if level.endswith(DURING_SAVE):  # the save of the fault's step lasts: the fault lands in it
        command += f" --slow-save-at {SAVE_FAULT_STEP} --slow-save-s {SAVE_HELD_S}"
    if level.endswith(WARM_SPARE):
        spares = {"warm_spares": procs}
        if workload == "ddp" and device != "cpu":
            # the bench's pods share the machine's GPUs (simulated chips where it has fewer than
            # the cluster's): no pod is given its GPUs, so its spares are told to start CUDA
            spares["env"] = {"RELAUNCH_SPARE_CUDA": "1"}
    if handled_by(level) == "hang-restart" and level.endswith(WARM_SPARE):
        # the healthy ranks wait in a collective for the hung one: no Python runs there, so
        # a SIGTERM cannot save anything and the hang grace is only a wait before SIGKILL
        spares["hang_grace_seconds"] = HANG_GRACE_WARM_S
    return {
        "kind": "job",
        "metadata": {"name": f"bench-{workload}", "annotations": annotations, "labels": labels},
        "spec": {
            "replicas": pods,
            "procs_per_pod": procs,
            "chips_per_pod": max(2, procs),
            "command": command,
            "hang_detect_seconds": hang_s,
            "monitor_interval": 0.1,
            **spares,
        },
    }


def relaunch_once(
    workload: str,
    level: str,
    tmp: Path,
    procs: int = 2,
    device: str = "cpu",
    step_s: float | None = None,
) -> Sample:
    """One `relaunch run` whose single fault must be recovered by `level`. A process fault
    hits the last rank (in pod 1, whatever the pod's size). `device` cuda: the DDP workload on
    the GPUs, over NCCL. `step_s`: the DDP script's step time (default: its own on the CPU,
    GPU_STEP_S on a GPU)."""
    path = tmp / "timeline.txt"
    _, fault = LEVELS[level]
    if "rank" in fault:
        fault = {**fault, "rank": 2 * procs - 1}
    step = SAVE_FAULT_STEP if level.endswith(DURING_SAVE) else FAULT_STEP
    faults = [] if scripts_its_crash(workload, level) else [{**fault, "at_step": step}]
    nodes = CLUSTER if procs <= 2 else cluster(4, procs)
    job = _job(workload, level, path, procs=procs, device=device, step_s=step_s)
    report, _ = run_job(tmp, job, faults, nodes, timeout=300)
    record = only_record(report, handled_by(level))
    if record is None:
        shown = (
            [(r["action"], r["outcome"]) for r in report["recoveries"]]
            if report
            else "the run failed"
        )
        return Sample(False, note=f"recoveries: {shown}; {keep_failed(tmp, level)}")
    measured = timeline.crash_sample(path)
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
    lost = max(0, step - resumes[-1]) if len(resumes) > 1 else None
    phases = timeline.phases_of(timeline.read(path), record["fault_at"], record["detect_s"])
    return Sample(
        True, mttr_s=record["mttr_s"], detect_s=record["detect_s"], lost_steps=lost, phases=phases
    )


def relaunch_hang(window: float, tmp: Path, ignores_sigterm: bool = False) -> dict[str, Any]:
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
    plan = [{**LEVELS["hang-restart"][1], "at_step": FAULT_STEP}]
    report, _ = run_job(tmp, job, plan, CLUSTER, timeout=300)
    record = only_record(report, "hang-restart")
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


def row_of(system: str, level: str, workload: str, samples: list[Sample]) -> Row:
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
        phases=median_phases([s.phases for s in good if s.phases is not None]),
    )


def median_phases(samples: list[dict[str, float]]) -> dict[str, float] | None:
    if not samples:
        return None
    return {k: round(statistics.median(p[k] for p in samples), 3) for k in PHASES}


def plan(quick: bool, levels: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(system, workload, level) of each MTTR row: every level on the light workload except the
    process levels (DDP only), every level on DDP (--quick: the crash only), and torchrun."""
    rows = [
        ("relaunch", "light", level)
        for level in LEVELS
        if level not in PROCESS_LEVELS and not level.endswith(WARM_SPARE)
    ]
    rows += [("relaunch", "ddp", level) for level in (["job-reschedule"] if quick else LEVELS)]
    if levels:
        rows = [(s, w, lv) for s, w, lv in rows if lv in levels]
    return [*rows, ("torchrun", "ddp", "job-reschedule")]


def mttr_rows(
    quick: bool, repeats: int, levels: tuple[str, ...], say: Progress, device: str = "cpu"
) -> list[Row]:
    """The MTTR table: `repeats` runs of each row of `plan` (DDP with 1 process a pod in quick,
    and on GPUs: NCCL lets two ranks share a GPU only from different hosts, as pods are)."""
    procs = 1 if quick or device != "cpu" else 2  # --quick starts half as many DDP processes
    rows = []
    for system, workload, level in plan(quick, levels):
        samples = []
        for i in range(repeats):
            with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
                if system == "torchrun":
                    sample = torchrun.crash_once(Path(tmp), procs, device)
                else:
                    pod_procs = procs if workload == "ddp" else 2
                    sample = relaunch_once(workload, level, Path(tmp), pod_procs, device)
            samples.append(sample)
            shown = (
                f"{sample.mttr_s:.2f} s" if sample.mttr_s is not None else f"failed ({sample.note})"
            )
            say(f"{system} {workload} {level} #{i + 1}: MTTR {shown}")
        rows.append(row_of(system, level, workload, samples))
    return rows


SIZES = (4, 8, 16)
"""Processes of the DDP job (2 pods) in the sizes section."""
SIZE_LEVELS = (
    "process-in-place",
    "process-in-place+spare",
    "process-retry",
    "job-reschedule+spare",
)


def size_rows(
    sizes: tuple[int, ...], repeats: int, levels: tuple[str, ...], say: Progress
) -> list[dict[str, Any]]:
    """MTTR of the DDP job at each size (2 pods of size/2 processes): torchrun's crash restart
    and relaunch's process-level and warm job-level recoveries, side by side (R-42: process-level
    recovery replaces one process, so its MTTR should stay nearly flat as the job grows)."""
    chosen = [lv for lv in SIZE_LEVELS if not levels or lv in levels]
    rows: list[dict[str, Any]] = []
    for size in sizes:
        procs = size // 2
        measured: dict[str, Row] = {}
        for system, level in [("torchrun", "job-reschedule"), *(("relaunch", lv) for lv in chosen)]:
            samples = []
            for i in range(repeats):
                with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
                    sample = (
                        torchrun.crash_once(Path(tmp), procs)
                        if system == "torchrun"
                        else relaunch_once("ddp", level, Path(tmp), procs)
                    )
                samples.append(sample)
                shown = f"{sample.mttr_s:.2f} s" if sample.mttr_s is not None else sample.note
                say(f"{size} processes, {system} {level} #{i + 1}: MTTR {shown}")
            measured[f"{system} {level}"] = row_of(system, level, "ddp", samples)
        baseline = measured["torchrun job-reschedule"].median_s
        for name, row in measured.items():
            rows.append(
                {
                    "processes": size,
                    "system": row.system,
                    "level": row.level,
                    "repeats": row.repeats,
                    "failures": row.failures,
                    "median_s": row.median_s,
                    "detect_s": row.detect_s,
                    "vs_torchrun": (
                        round(row.median_s / baseline, 3)
                        if row.median_s and baseline and name != "torchrun job-reschedule"
                        else None
                    ),
                }
            )
    return rows


def hang_rows(quick: bool, say: Progress) -> list[dict[str, Any]]:
    """relaunch's hang detection at each window (the first also with a script that ignores
    SIGTERM), then whether torchrun restarts a hung job at all."""
    rows: list[dict[str, Any]] = []
    windows = [2.0] if quick else [5.0, 10.0, 20.0]
    for window in windows:
        for ignores_sigterm in (False, True) if window == windows[0] else (False,):
            with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
                rows.append(relaunch_hang(window, Path(tmp), ignores_sigterm))
            say(f"relaunch hang, {rows[-1]['script']}, window {window:g} s: {rows[-1]}")
    with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
        rows.append(torchrun.hang_row(3.0 if quick else 90.0, Path(tmp), 1 if quick else 2))
    say(f"torchrun hang: {rows[-1]}")
    return rows


def ratios(rows: list[Row]) -> dict[str, float]:
    """Each relaunch DDP level's median MTTR over torchrun's."""
    baseline = next((r.median_s for r in rows if r.system == "torchrun" and r.median_s), None)
    if not baseline:
        return {}
    return {
        f"{r.workload}/{r.level}": round(r.median_s / baseline, 3)
        for r in rows
        if r.system == "relaunch" and r.workload == "ddp" and r.median_s is not None
    }
