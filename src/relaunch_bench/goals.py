"""The costs the project has goals for, each figure of one bench run beside its goal (issue 71's
section 3): a cold job-level restart's stop and spawn beside torchrun's, the supervision's CPU per
supervised process-second, an asynchronous save's stall beside a synchronous one's, the
simulation's slowest level at its largest job, and a lost node's stall inside Slurm beside NVRx.

    relaunch bench --only mttr,overhead,checkpoint,simulation,slurm --levels job-reschedule \\
        --simulation-pods 4096,16384 --repeats 3

A goal whose sections did not run is left out; one that ran but measured nothing says so.
Pure: from bench.json's data.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GOAL_COLUMNS", "goal_rows"]

GOAL_COLUMNS = {"cost": "cost", "figure": "measured", "goal": "goal", "met": "met"}
OVERHEAD_GOAL_MS = 0.1
ASYNC_GOAL = 0.05
SIMULATION_GOAL_S = 1.0


def goal_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per goal whose section ran: what it costs, the figure, the goal, met or not."""
    rows: list[dict[str, Any]] = []
    rows += _restart(result.get("mttr") or [])
    rows += _overhead(result.get("overhead") or [])
    rows += _async_save(result.get("checkpoint") or [])
    rows += _simulation(result.get("simulation") or [])
    rows += _lost_node(result.get("slurm") or [])
    return rows


def _row(cost: str, figure: str, goal: str, met: bool | None) -> dict[str, Any]:
    return {"cost": cost, "figure": figure, "goal": goal, "met": "-" if met is None else met}


def _at_most(
    cost: str, figure: str, value: float | None, goal: float, unit: str = ""
) -> dict[str, Any]:
    """A goal that is a bound: met where the value is at most it (not known where unmeasured)."""
    return _row(cost, figure, f"{goal}{unit}", None if value is None else value <= goal)


def _restart(mttr: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A cold job-level restart of the DDP example: the stop and the spawn (detection to rank 0's
    new interpreter) beside torchrun's, which stops and spawns the same processes. relaunch's
    new pod forks its ranks from a template that imports torch (relaunch._template) where
    torchrun's ranks import it after their spawn: the figure says both, and the sum through the
    model's build, which holds the import on either side."""

    def parts(system: str) -> dict[str, float] | None:
        found = next(
            (
                r
                for r in mttr
                if r["system"] == system
                and r["level"] == "job-reschedule"
                and r.get("workload") == "ddp"
                and r.get("phases")
            ),
            None,
        )
        return None if found is None else found["phases"]

    ours, theirs = parts("relaunch"), parts("torchrun")
    if ours is None and theirs is None:
        return []

    def said(phases: dict[str, float] | None) -> str:
        if phases is None:
            return "not measured"
        through = sum(phases.get(k, 0.0) for k in ("stop_spawn", "import", "model"))
        return f"{_s(phases.get('stop_spawn'))} ({_s(through)} through import and model)"

    figure = f"{said(ours)}; torchrun {said(theirs)}"
    met = None
    if ours is not None and theirs is not None:
        met = ours.get("stop_spawn", 0.0) <= theirs.get("stop_spawn", 0.0)
    return [_row("cold job-level restart: stop and spawn", figure, "at most torchrun's", met)]


def _overhead(overhead: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in overhead:
        ms = r.get("relaunch_ms_per_proc_s")
        parts = (
            f"controller {r.get('controller_ms_per_proc_s')}, launchers "
            f"{r.get('launchers_ms_per_proc_s')}, agents {r.get('agents_ms_per_proc_s')}"
        )
        figure = "not measured" if ms is None else f"{ms} ms ({parts})"
        cost = f"supervision's CPU per supervised process-second, heartbeat {r['heartbeat_s']:g} s"
        rows.append(_at_most(cost, figure, ms, OVERHEAD_GOAL_MS, " ms"))
    return rows


def _async_save(checkpoint: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The loop's stall in an asynchronous save over a synchronous save's, by size: the save
    call alone, and the training loop's stall with and without the save overlapped."""
    rows = []
    for r in checkpoint:
        ratio = r.get("async_vs_sync")
        figure = (
            f"{ratio} (the loop: {r.get('loop_async_vs_sync')}; overlapped: "
            f"{r.get('loop_overlap_vs_sync')})"
        )
        cost = f"an asynchronous save's stall / a synchronous one's, {r['size_mb']} MB"
        rows.append(_at_most(cost, figure, ratio, ASYNC_GOAL))
    return rows


def _simulation(simulation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The slowest level at each size the simulation ran (detection to the last command)."""
    rows = []
    for pods in sorted({r["pods"] for r in simulation}):
        at = [r for r in simulation if r["pods"] == pods]
        timed = [r for r in at if r.get("detected_to_last_command_s") is not None]
        failed = len(at) - len(timed)
        slowest = max(timed, key=lambda r: r["detected_to_last_command_s"], default=None)
        figure = (
            "no level finished"
            if slowest is None
            else f"{slowest['detected_to_last_command_s']:.3f} s ({slowest['level']}, the slowest "
            f"of {len(timed)} level(s){f'; {failed} failed' if failed else ''})"
        )
        met = None
        if slowest is not None:
            met = slowest["detected_to_last_command_s"] < SIMULATION_GOAL_S and not failed
        rows.append(
            _row(
                f"the simulation at {pods:,} pods: detection to the last command",
                figure,
                f"every level under {SIMULATION_GOAL_S:g} s",
                met,
            )
        )
    return rows


def _lost_node(slurm: list[dict[str, Any]]) -> list[dict[str, Any]]:
    stall = {r["system"]: r.get("stall_s") for r in slurm if r["fault"] == "lost-node" and r["ok"]}
    if not any(r["fault"] == "lost-node" for r in slurm):
        return []
    ours, theirs = stall.get("relaunch"), stall.get("NVRx")
    nvrx = _s(theirs) if theirs is not None else "not back"
    figure = f"{_s(ours)} (NVRx {nvrx})"
    met = None if ours is None else theirs is None or ours <= theirs
    return [
        _row(
            "a lost node inside Slurm: fault to the next step",
            figure,
            "a node's lease of a few heartbeats; below NVRx",
            met,
        )
    ]


def _s(seconds: float | None) -> str:
    return "not measured" if seconds is None else f"{seconds:.2f} s"
