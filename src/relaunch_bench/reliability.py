"""Restart reliability: many injected faults per level, each of which that level must recover;
and as many crashes under torchrun --max-restarts."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml

from relaunch_bench import torchrun
from relaunch_bench.jobs import DDP, Progress, cluster, light_job, median, run_job

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


def reliability_rows(
    crashes: int, levels: list[str], say: Progress, with_torchrun: bool = True
) -> list[dict[str, Any]]:
    """`crashes` faults per level (one every 10 steps of a job), each of which must be recovered
    by that level; and the same number of crashes under torchrun --max-restarts=`crashes`."""
    rows = []
    for level in levels:
        per_job = min(crashes, IN_A_ROW.get(level, crashes))
        counts = [per_job] * (crashes // per_job) + (
            [crashes % per_job] if crashes % per_job else []
        )
        reports = [_one_job(level, count) for count in counts]
        workload = "light" if level in RELIABILITY_LIGHT else "ddp"
        rows.append(_row(level, workload, reports, crashes))
        say(f"reliability {level}: {rows[-1]}")
    if with_torchrun:
        with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
            rows.append(torchrun.reliability_row(Path(tmp), crashes))
        say(f"reliability torchrun: {rows[-1]}")
    return rows


def _one_job(level: str, count: int) -> dict[str, Any] | None:
    """One job hit by `count` faults of `level`, one every 10 steps: its report."""
    steps = 10 * count + 20
    if level in RELIABILITY_LIGHT:
        tolerance, fault = RELIABILITY_LIGHT[level]
        job = light_job(2, tolerance, steps=steps)
    else:
        fault = RELIABILITY_PROCESS[level]
        job = _process_job(steps)
    nodes = 3 + (count if fault["kind"] == "node-down" else 0)
    faults = [{**fault, "at_step": 10 * (i + 1)} for i in range(count)]
    with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
        # R-10 would isolate a node after 3 faults of one code in a row; here every fault is to
        # be handled by the level under test, so the threshold is raised.
        table = Path(tmp) / "fault-table.yaml"
        table.write_text(yaml.safe_dump({"escalation": {"threshold": 100}}))
        report, _ = run_job(
            Path(tmp),
            job,
            faults,
            cluster(nodes, 2),
            timeout=1800,
            extra_args=("--fault-table", str(table)),
        )
    return report


def _row(
    level: str, workload: str, reports: list[dict[str, Any] | None], crashes: int
) -> dict[str, Any]:
    records = [r for report in reports if report for r in report["recoveries"]]
    succeeded = [r for r in records if r["action"] == level and r["outcome"] == "succeeded"]
    mttrs = [r["mttr_s"] for r in succeeded if r.get("mttr_s") is not None]
    figures = [report["goodput"] for report in reports if report and report.get("goodput")]
    wall = sum(g["wall_s"] for g in figures)
    lost = {
        cause: round(sum(g["lost_s"].get(cause, 0.0) for g in figures), 1)
        for cause in ("detection", "recovery", "recomputed", "startup")
    }
    captures = [r["hang"]["capture_s"] for r in records if r.get("hang")]
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
        "median_mttr_s": median(mttrs),
        "ettr": round(sum(g["productive_s"] for g in figures) / wall, 3) if wall else None,
        "lost_s": " / ".join(f"{lost[c]:g}" for c in lost) if figures else None,
        "median_capture_s": median(captures) if captures else None,
    }


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
