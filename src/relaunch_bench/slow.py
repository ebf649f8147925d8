"""Slow pods: how long relaunch takes to detect a pod slowed down by a given factor (a fault
plan's `slow`, a duty cycle on its processes), on the DDP workload, record-only (no standby node,
so the job keeps running and the detection is all that is measured)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from relaunch_bench.jobs import DDP, Progress, cluster, median, run_job

FACTORS = (1.5, 2.0, 3.0, 5.0)
WINDOW_S = 5.0
"""The bench's `slow_window_s` (the default is 60 s): detection takes about 1.5 windows."""


def slow_rows(
    factors: tuple[float, ...], repeats: int, say: Progress, steps: int = 400
) -> list[dict[str, Any]]:
    rows = []
    for factor in factors:
        delays: list[float] = []
        missed = 0
        for _ in range(repeats):
            delay = _detection_s(factor, steps)
            if delay is None:
                missed += 1
            else:
                delays.append(delay)
        rows.append(
            {
                "factor": factor,
                "window_s": WINDOW_S,
                "runs": repeats,
                "detected": repeats - missed,
                "median_detect_s": median(delays),
            }
        )
        say(f"slow x{factor:g}: {rows[-1]}")
    return rows


def _detection_s(factor: float, steps: int) -> float | None:
    """One run: from the `slow` entry's injection to the slow fault's detection (None: not
    detected before the job ended). The job runs `steps` steps, slowed from step 20 on: enough
    for about 1.5 windows at the slowed pace."""
    job = {
        "kind": "job",
        "metadata": {
            "name": "bench-slow",
            "annotations": {"fault-tolerance/job-retry-num": "3"},
            "labels": {"fault-scheduling": "grace", "grace-over-time": "3"},
        },
        "spec": {
            "replicas": 2,
            "procs_per_pod": 1,
            "chips_per_pod": 2,
            "command": f"python {DDP} --steps {steps} --ckpt-every 50",
            "hang_detect_seconds": 10,
            "monitor_interval": 0.2,
        },
    }
    plan = [{"kind": "slow", "at_step": 20, "pod": 1, "factor": factor, "duration_s": 40}]
    shape = {**cluster(2, 2), "slow_window_s": WINDOW_S, "slow_margin": 0.3}
    with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
        report, _ = run_job(Path(tmp), job, plan, shape, timeout=600)
    if report is None:
        return None
    fired = next((e["at"] for e in report["fault_plan"] if e["state"] == "fired"), None)
    slow = next((r for r in report["recoveries"] if r["fault"]["kind"] == "slow"), None)
    if fired is None or slow is None:
        return None
    return round(float(slow["detected_at"]) - float(fired), 2)
