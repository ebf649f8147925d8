"""Scale by simulation: relaunch's own controller and store, driven by simulated agents and
launchers that speak the real protocol, from tens to thousands of pods on this one machine.

    `relaunch bench --only simulation`   64, 256, 1024 and 4096 pods of 8 ranks, every level

Modules: `levels` (the job, the cluster, each level's fault), `peers` (a process playing many
agents and launchers), `engine` (the controller's engine, whose nodes those processes play),
`run` (one simulated run in a process of its own, measured from inside the controller's). This
module runs them and says how each level's cost grows with the job (`growth`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from relaunch_bench.jobs import Progress
from relaunch_bench.simulation.levels import PROCESS_LEVELS, SIM_LEVELS

__all__ = ["SIM_LEVELS", "SIZES", "growth", "simulation_rows"]

SIZES = (64, 256, 1024, 4096)
PROCS = 8


def simulation_rows(
    sizes: tuple[int, ...],
    levels: tuple[str, ...],
    say: Progress,
    procs: int = PROCS,
    lead_s: float | None = None,
    tail_s: float = 30.0,
) -> list[dict[str, Any]]:
    """One simulated run per size and level, each in a fresh process (its own controller)."""
    rows = []
    for pods in sizes:
        for level in levels or tuple(SIM_LEVELS):
            row = simulated(pods, procs, level, lead_s, tail_s)
            rows.append(row)
            took = row.get("detected_to_last_command_s")
            shown = f"{took:.3f} s to the last command" if took is not None else "failed"
            say(f"simulation {pods} pods x {procs} {level}: {shown}")
    return rows


def simulated(
    pods: int, procs: int, level: str, lead_s: float | None, tail_s: float
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="relaunch-sim-bench-") as tmp:
        out = Path(tmp) / "row.json"
        command = [
            sys.executable, "-m", "relaunch_bench.simulation.run", str(out), "--pods", str(pods),
            "--procs", str(procs), "--level", level, "--tail-s", str(tail_s),
        ]  # fmt: skip
        if lead_s is not None:
            command += ["--lead-s", str(lead_s)]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=600 + 2 * tail_s, check=False
        )
        if done.returncode != 0 or not out.exists():
            return {
                "level": level,
                "pods": pods,
                "ranks": pods * procs,
                "error": done.stderr[-2000:],
            }
        row: dict[str, Any] = json.loads(out.read_text())
        return row


def growth(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per level, how the controller's time from detection to the last command grew from the
    smallest job to the largest, beside how the pods it must touch grew: a process-level
    recovery restarts one pod's ranks (its membership, a few hundred bytes, still goes to every
    pod), a job-level one every pod."""
    found = []
    for level in SIM_LEVELS:
        measured = sorted(
            (r for r in rows if r.get("level") == level and r.get("detected_to_last_command_s")),
            key=lambda r: r["pods"],
        )
        if len(measured) < 2:
            continue
        small, large = measured[0], measured[-1]
        took = large["detected_to_last_command_s"] / max(small["detected_to_last_command_s"], 1e-4)
        found.append(
            {
                "level": level,
                "from_pods": small["pods"],
                "to_pods": large["pods"],
                "pods_ratio": round(large["pods"] / small["pods"], 1),
                "time_ratio": round(took, 1),
                "largest_s": large["detected_to_last_command_s"],
                "process_level": level in PROCESS_LEVELS,
            }
        )
    return found
