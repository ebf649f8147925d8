"""MTTR of job-level, pod-level and in-place recovery as the job grows."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from relaunch_bench.jobs import Progress, cluster, light_job, median, only_record, run_job

SCALE_LEVELS: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    # the fault hits the last pod (not pod 0, whose rank 0 makes some losses job-level)
    "job-reschedule": (
        {"fault-tolerance/job-unconditional-retry": "true"},
        {"kind": "process-exit", "exit_code": 1},
    ),
    "pod-reschedule": ({"fault-tolerance/pod-retry-num": "30"}, {"kind": "node-down"}),
    "in-place": ({}, {"kind": "chip-fault", "chip": 0, "code": "80E18005"}),
}


def scale_rows(
    sizes: list[int], repeats: int, say: Progress, levels: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """MTTR of each of SCALE_LEVELS at each job size (light workers, 2 processes a pod). Up to 16
    pods: one pod per 2-chip node; beyond: two pods per 4-chip node (64 pods on 32 nodes). Two
    spare nodes take the pods of a lost node."""
    rows = []
    for pods in sizes:
        for level in SCALE_LEVELS:
            if not levels or level in levels:
                rows.append(_scale_row(pods, level, repeats, say))
    return rows


def _scale_row(pods: int, level: str, repeats: int, say: Progress) -> dict[str, Any]:
    packed = pods > 16
    nodes = (pods // 2 if packed else pods) + 2
    tolerance, fault = SCALE_LEVELS[level]
    # The fault comes once every worker runs: 128 processes take seconds to start here.
    at_step = max(20, 8 * pods)
    plan = [{**fault, "pod": pods - 1, "at_step": at_step}]
    times, detects = [], []
    for i in range(repeats):
        job = light_job(pods, tolerance, steps=at_step + 60, step_s=0.05)
        with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
            report, _ = run_job(Path(tmp), job, plan, cluster(nodes, 4 if packed else 2))
        record = only_record(report, level)
        if record is not None:
            times.append(record["mttr_s"])
            detects.append(record["detect_s"])
        shown = f"{record['mttr_s']:.2f} s" if record is not None else "failed"
        say(f"scale {pods} pods {level} #{i + 1}: MTTR {shown}")
    return {
        "level": level,
        "pods": pods,
        "nodes": nodes,
        "processes": 2 * pods,
        "repeats": repeats,
        "failures": repeats - len(times),
        "median_s": median(times),
        "min_s": round(min(times), 3) if times else None,
        "max_s": round(max(times), 3) if times else None,
        "detect_s": median(detects),
    }
