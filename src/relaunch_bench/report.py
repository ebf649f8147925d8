"""bench.md (tables), bench.png (MTTR by level, and as the job grows) and goodput.png (the
fault series: each system's run split into productive time and time lost by cause) from
bench.json's data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relaunch_bench.goals import GOAL_COLUMNS, goal_rows
from relaunch_bench.mttr import Row
from relaunch_bench.timeline import PHASES

MTTR_COLUMNS = {
    "system": "system", "workload": "workload", "level": "level", "repeats": "repeats",
    "failures": "failed", "median_s": "median MTTR s", "min_s": "min", "max_s": "max",
    "detect_s": "detect s", "lost_steps": "lost steps",
}  # fmt: skip
HANG_COLUMNS = {
    "system": "system", "workload": "workload", "script": "script", "window_s": "hang window s",
    "detected": "detected", "detect_s": "detect s", "mttr_s": "MTTR s", "note": "note",
}  # fmt: skip
SCALE_COLUMNS = {
    "level": "level", "pods": "pods", "nodes": "nodes", "processes": "processes",
    "repeats": "repeats", "failures": "failed", "median_s": "median MTTR s", "min_s": "min",
    "max_s": "max", "detect_s": "detect s",
}  # fmt: skip
SERIES_COLUMNS = {
    "system": "system", "series": "fault series", "faults": "faults struck",
    "finished": "finished", "run_s": "run s", "productive_s": "productive s", "lost_s": "lost s",
    "ettr": "ETTR", "step_ms": "step ms", "plain_step_ms": "step ms without process level",
    "process_level_cost": "process level's cost a step", "lost_by_cause": "lost s by cause",
    "note": "note",
}  # fmt: skip
SIMULATION_COLUMNS = {
    "level": "level", "pods": "pods", "ranks": "ranks", "action": "handled by",
    "detected_to_last_command_s": "detection to last command s",
    "fault_to_last_command_s": "fault to last command s", "commands": "commands sent",
    "cpu_s": "controller CPU s", "store_writes": "SQLite write statements",
    "store_rows": "rows written",
    "store_write_s": "SQLite write s", "store_write_max_ms": "slowest write ms",
    "membership_publish_s": "membership publication s", "membership_bytes": "membership bytes",
    "steady_messages_per_s": "steady messages / s",
    "steady_cpu_per_message_us": "steady CPU / message us", "steady_cpu_share": "steady CPU share",
}  # fmt: skip
GROWTH_COLUMNS = {
    "level": "level", "from_pods": "from pods", "to_pods": "to pods", "pods_ratio": "pods x",
    "time_ratio": "time x", "largest_s": "at the largest s", "process_level": "process level",
}  # fmt: skip
SIZE_COLUMNS = {
    "processes": "processes", "system": "system", "level": "level", "repeats": "repeats",
    "failures": "failed", "median_s": "median MTTR s", "detect_s": "detect s",
    "vs_torchrun": "vs torchrun",
}  # fmt: skip
OVERHEAD_COLUMNS = {
    "processes": "processes", "pods": "pods", "nodes": "nodes", "heartbeat_s": "heartbeat s",
    "window_s": "window s",
    "report_rate_hz": "reports / proc / s", "controller_ms_per_proc_s": "controller ms CPU / proc / s",
    "launchers_ms_per_proc_s": "launchers", "agents_ms_per_proc_s": "agents",
    "relaunch_ms_per_proc_s": "relaunch total", "relaunch_cores": "relaunch cores",
    "workers_ms_per_proc_s": "workers (for scale)", "detect_s": "crash detect s",
}  # fmt: skip
CHECKPOINT_COLUMNS = {
    "size_mb": "state MB", "raw_write_mb_s": "raw write MB/s", "save_mb_s": "SDK save MB/s",
    "save_vs_raw": "save / raw", "raw_read_mb_s": "raw read MB/s", "load_mb_s": "SDK load MB/s",
    "load_vs_raw": "load / raw", "save_s": "sync save s",
    "async_first_stall_s": "first async save stalls s", "async_stall_s": "async save stalls s",
    "async_vs_sync": "async / sync stall", "async_total_s": "async done after s",
}  # fmt: skip
LOOP_COLUMNS = {
    "size_mb": "state MB", "loop_sync_stall_s": "sync save stalls s",
    "loop_async_stall_s": "async save stalls s", "loop_async_vs_sync": "async / sync",
    "loop_overlap_stall_s": "overlapped save stalls s", "loop_overlap_vs_sync": "overlapped / sync",
    "loop_async_next_step_extra_s": "next step slower by s (async)",
    "loop_overlap_next_step_extra_s": "next step slower by s (overlapped)",
}  # fmt: skip
PEER_MEMORY_COLUMNS = {
    "size_mb": "state MB", "link_mb_s": "data link MB/s (raw)",
    "link_fresh_mb_s": "data link into fresh memory MB/s",
    "fault_in_mb_s": "fresh memory faulted in MB/s",
    "peer_restore_mb_s": "restore from peer memory MB/s", "peer_over_link": "peer / link",
    "link_ratio": "peer / link (median of pairs)", "link_ratio_95": "95 % interval",
    "link_pairs": "pairs", "ready_share": "share of its memory ready at load()",
    "peer_restore_late_mb_s": "... into fresh memory (manager made just before load) MB/s",
    "late_over_link": "fresh / link",
    "together_mb_s": "2 ranks restoring at once from one peer MB/s (together)",
    "together_over_alone": "at once / one alone", "together_over_link": "at once / link",
    "disk_read_mb_s": "disk read MB/s (raw, cold)",
    "local_restore_mb_s": "restore from the node's disk MB/s (cold)",
    "storage_restore_mb_s": "restore from storage MB/s (cold)",
    "storage_over_peer": "storage s / peer s",
    "shared_read_mb_s": "shared storage read MB/s (raw, cold, over the data link)",
    "shared_restore_mb_s": "restore from shared storage MB/s (cold)",
    "shared_over_peer": "shared storage s / peer s",
    "copy_s": "copy to the peer s (after the save)",
    "local_copy_s": "copy to the node's disk s",
    "copy_fresh_mb_s": "copy into fresh memory MB/s",
    "copy_again_mb_s": "... into the dropped step's MB/s", "again_over_fresh": "dropped's / fresh",
    "stall_plain_s": "async save stalls s", "stall_copy_s": "... with the copy s",
    "stall_copy_over_plain": "with / without (median of pairs)",
    "stall_ratio_95": "95 % interval", "stall_pairs": "pairs",
    "dlrover_save_stall_s": "DLRover flash save stalls s",
    "dlrover_restore_s": "DLRover restore, same node s",
}  # fmt: skip
ROLLBACK_COLUMNS = {
    "rollback": "kept before a step", "params_m": "parameters (M)", "device": "device",
    "every_steps": "every (steps)", "step_ms": "step ms", "keep_ms": "kept in ms",
    "cost_pct": "cost per step %",
}  # fmt: skip
RELIABILITY_COLUMNS = {
    "system": "system", "level": "level", "workload": "workload", "jobs": "jobs",
    "injected": "faults injected",
    "recovered": "recovered", "other_actions": "other actions", "job_succeeded": "job succeeded",
    "median_mttr_s": "median MTTR s",
    "ettr": "ETTR", "lost_s": "lost s: detection / recovery / recomputed / startup",
    "median_capture_s": "median stack capture s",
}  # fmt: skip
SLOW_COLUMNS = {
    "factor": "slowdown factor", "window_s": "slow_window_s", "runs": "runs",
    "detected": "detected", "median_detect_s": "median detection s",
}  # fmt: skip
NETWORK_COLUMNS = {
    "fault": "link fault (pod 1's node)", "system": "system", "lost_s": "time lost s",
    "redone_steps": "steps redone", "restarts": "restarts", "mttr_s": "relaunch's MTTR s",
    "overlap_s": "incarnations overlap s", "what": "what happened",
    "ms_per_step_off": "ms / step, inputs not kept", "ms_per_step_on": "ms / step, kept",
    "cost_ratio": "kept / not", "note": "note",
}  # fmt: skip
PEER_COLUMNS = {
    "fault": "fault (rank 1)", "system": "system", "repeats": "repeats", "failures": "failed",
    "stall_s": "stall s (to the next step)", "rejoin_s": "rejoin s (the struck rank steps)",
    "detect_s": "detect s",
    "lost_steps": "lost steps", "ranks_restarted": "ranks restarted", "detected": "detected",
    "note": "note",
}  # fmt: skip
SLURM_COLUMNS = {
    "system": "system",
    "fault": "fault",
    "ok": "recovered",
    "stall_s": "stall s (fault to the next step)",
    "detect_s": "detect s",
    "lost_steps": "steps lost",
    "note": "note",
}

KUBERNETES_COLUMNS = {
    "system": "system",
    "fault": "fault",
    "recovered": "recovered",
    "stall_s": "stall s (median)",
    "stall_range": "spread s",
    "lost_steps": "steps lost",
    "note": "note",
}

SECTIONS = (
    ("peers", "Side by side with the specialists (2 ranks, the DDP example's job)", PEER_COLUMNS),
    ("series", "Goodput under a fault series (a fault a minute, DDP, 2 ranks)", SERIES_COLUMNS),
    ("scale", "Scale (light workload, 2 processes per pod)", SCALE_COLUMNS),
    ("simulation", "Scale by simulation (the controller, simulated peers)", SIMULATION_COLUMNS),
    ("simulation_growth", "How each level's controller time grows with the job", GROWTH_COLUMNS),
    ("sizes", "MTTR by job size (DDP, 2 pods)", SIZE_COLUMNS),
    ("checkpoint", "Checkpoints against the raw disk", CHECKPOINT_COLUMNS),
    (
        "checkpoint",
        "Save stalls in a training loop (a model and Adam, same state size)",
        LOOP_COLUMNS,
    ),
    (
        "peer_memory",
        "Restores from a peer's memory against storage (data link between node namespaces)",
        PEER_MEMORY_COLUMNS,
    ),
    (
        "rollback",
        "What process-level recovery keeps of each step (Adam, about 100M parameters)",
        ROLLBACK_COLUMNS,
    ),
    ("reliability", "Restart reliability", RELIABILITY_COLUMNS),
    ("slow", "Slow pod detection (DDP, 2 pods, record only)", SLOW_COLUMNS),
    ("network", "Link faults on real networks (DDP, 2 pods x 1 rank)", NETWORK_COLUMNS),
    ("slurm", "Inside a Slurm allocation (3 nodes, 2 ranks, a trial Slurm cluster)", SLURM_COLUMNS),
    (
        "kubernetes",
        "On Kubernetes (3 nodes, 2 ranks, a trial control plane): relaunch and an Indexed Job",
        KUBERNETES_COLUMNS,
    ),
)


def table(rows: list[dict[str, Any]], columns: dict[str, str]) -> list[str]:
    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = (_cell(row.get(key)) for key in columns)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):  # a breakdown: "name value" each
        return ", ".join(f"{k} {v}" for k, v in value.items()) or "-"
    return str(value)


def phase_rows(mttr: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"system": r["system"], "level": r["level"], "median_s": r["median_s"], **r["phases"]}
        for r in mttr
        if r.get("phases")
    ]


def phase_lines(
    measured: list[dict[str, Any]],
    title: str = "Where relaunch's restarts' time goes (rank 0's timeline, medians):",
) -> list[str]:
    """Restarts part by part (rank 0's timeline): where the floor of each restart is, relaunch's
    beside the peers' (a section's rows that have their parts)."""
    rows = [
        {"system": r["system"], "fault": r["fault"], "stall_s": r["stall_s"], **r["phases"]}
        for r in measured
        if r.get("phases")
    ]
    if not rows:
        return []
    columns = {"system": "system", "fault": "fault", "stall_s": "stall s"}
    columns.update({k: k.replace("_", " ") + " s" for k in PHASES})
    return ["", title, "", *table(rows, columns)]


def markdown(result: dict[str, Any]) -> str:
    lines = table(result["mttr"], MTTR_COLUMNS)
    if result["hang"]:
        lines += ["", *table(result["hang"], HANG_COLUMNS)]
    if result["ratios"]:
        lines.append("")
        lines.append(
            "relaunch / torchrun (DDP, median MTTR): "
            + ", ".join(f"{k} {v}" for k, v in result["ratios"].items())
        )
    phases = phase_rows(result["mttr"])
    if phases:
        columns = {"system": "system", "level": "level", "median_s": "MTTR s"}
        columns.update({k: k.replace("_", " ") + " s" for k in PHASES})
        lines += ["", "Where the time goes (DDP, rank 0's timeline, medians):", ""]
        lines += table(phases, columns)
    for key, title, columns in SECTIONS:
        if result.get(key):
            lines += ["", f"{title}:", "", *table(result[key], columns)]
        if key == "slurm" and result.get("slurm"):
            lines += ["", "relaunch / NVRx inside Slurm (stall): " + stall_ratios(result["slurm"])]
            title = "Where a restart's time goes inside Slurm (rank 0's timeline):"
            lines += phase_lines(result["slurm"], title)
        if key == "kubernetes" and result.get("kubernetes"):
            said = stall_ratios(result["kubernetes"], "Indexed Job")
            lines += ["", "relaunch / the Indexed Job on Kubernetes (stall): " + said]
        if key == "series" and result.get("series_ratio") is not None:
            lines += ["", f"relaunch's lost time / the best peer's: {result['series_ratio']}"]
        if key == "peers" and result.get("peer_ratios"):
            lines.append("")
            spreads = result.get("peer_ratio_spreads") or {}
            lines.append(
                "relaunch / the best peer (stall, the median's ratio and its spread over the "
                "runs): "
                + ", ".join(
                    f"{k} {v}{_spread(spreads.get(k))}" for k, v in result["peer_ratios"].items()
                )
            )
        if key == "peers" and result.get("peer_unmatched"):
            lines += ["", "No peer restores the job: " + ", ".join(result["peer_unmatched"])]
        if key == "peers":
            lines += phase_lines(result.get("peers") or [])
    if result.get("overhead"):
        lines += ["", "Controller overhead:", "", *table(result["overhead"], OVERHEAD_COLUMNS)]
    goals = goal_rows(result)
    if goals:
        lines += ["", "Costs beside their goals:", "", *table(goals, GOAL_COLUMNS)]
    return "\n".join(lines) + "\n"


def stall_ratios(rows: list[dict[str, Any]], theirs_is: str = "NVRx") -> str:
    """relaunch's stall over the other system's, per fault, where both recovered (`only
    relaunch recovers` where the other did not)."""
    said = []
    for fault in dict.fromkeys(r["fault"] for r in rows):
        stall = {r["system"]: r.get("stall_s") for r in rows if r["fault"] == fault and r["ok"]}
        ours, theirs = stall.get("relaunch"), stall.get(theirs_is)
        if ours and theirs:
            said.append(f"{fault} {round(ours / theirs, 2)}")
        else:
            said.append(f"{fault} only relaunch recovers" if ours else f"{fault} -")
    return ", ".join(said)


def _spread(found: Any) -> str:
    """` (runs: LOW-HIGH)` of a ratio's spread, as stored (a pair; a list once in JSON)."""
    if not found:
        return ""
    low, high = found
    return f" (runs: {low}-{high})"


def chart(rows: list[Row], scale: list[dict[str, Any]], path: Path) -> None:
    """Median MTTR by level (min-max whiskers), and beside it MTTR against pods when scale ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.median_s is not None]
    width = max(6, 1.1 * len(shown))
    if scale:
        figure, (axes, grows) = plt.subplots(
            1, 2, figsize=(width + 5, 4), gridspec_kw={"width_ratios": [width, 5]}
        )
        _scale_chart(grows, scale)
    else:
        figure, axes = plt.subplots(figsize=(width, 4))
    medians = [r.median_s or 0 for r in shown]
    colours = ["tab:orange" if r.system == "torchrun" else "tab:blue" for r in shown]
    axes.bar(range(len(shown)), medians, color=colours)
    whiskers = [
        [m - (r.min_s or 0) for m, r in zip(medians, shown, strict=True)],
        [(r.max_s or 0) - m for m, r in zip(medians, shown, strict=True)],
    ]
    axes.errorbar(range(len(shown)), medians, yerr=whiskers, fmt="none", ecolor="black", capsize=3)
    labels = [f"{r.system}\n{r.workload}\n{r.level}" for r in shown]
    axes.set_xticks(range(len(shown)), labels, fontsize=7)
    axes.set_ylabel("MTTR, s (fault -> first step after recovery)")
    axes.set_title("Recovery time by level (median, min-max)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


GOODPUT_PARTS = (
    ("productive", "productive_s", "tab:green"),
    ("detection and restart", "detection and restart", "tab:red"),
    ("recomputed", "recomputed", "tab:orange"),
    ("slower steps", "slower steps", "tab:gray"),
)


def goodput_chart(series: list[dict[str, Any]], path: Path) -> bool:
    """One horizontal bar a system that ran the series: its productive time, then what it lost by
    cause, ETTR at the end. False (nothing written) when no system has a measured run."""
    shown = [r for r in series if r.get("run_s")]
    if not shown:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 0.6 * len(shown) + 1.6))
    for y, row in enumerate(shown):
        left = 0.0
        for label, key, colour in GOODPUT_PARTS:
            value = row.get(key) if key == "productive_s" else row["lost_by_cause"].get(key, 0.0)
            axes.barh(y, value or 0.0, left=left, color=colour, label=label if y == 0 else None)
            left += value or 0.0
        axes.text(left, y, f"  ETTR {row['ettr']}, lost {row['lost_s']} s", va="center", fontsize=8)
    axes.set_yticks(
        range(len(shown)), [f"{r['system']}\n({r['series']})" for r in shown], fontsize=8
    )
    axes.invert_yaxis()
    axes.set_xlabel("s, from the first step to the last")
    axes.set_title(f"Goodput under a fault series ({shown[0]['faults']} faults, one a minute)")
    axes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4)
    axes.margins(x=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def _scale_chart(axes: Any, scale: list[dict[str, Any]]) -> None:
    for level in dict.fromkeys(r["level"] for r in scale):
        points = [(r["pods"], r["median_s"]) for r in scale if r["level"] == level]
        points = [(x, y) for x, y in points if y is not None]
        axes.plot([x for x, _ in points], [y for _, y in points], marker="o", label=level)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("pods (2 light processes each)")
    axes.set_ylabel("median MTTR, s")
    axes.set_title("MTTR as the job grows")
    axes.legend(fontsize=7)
