"""The bench's costs beside their goals (relaunch_bench.goals): each goal read from the sections
of one run, met or not by the figure, left out when its section did not run."""

from __future__ import annotations

from typing import Any

from relaunch_bench.goals import goal_rows


def _restart(system: str, stop_spawn: float) -> dict[str, Any]:
    return {
        "system": system,
        "level": "job-reschedule",
        "workload": "ddp",
        "phases": {"detect": 0.05, "stop_spawn": stop_spawn, "import": 1.2},
    }


def _by_cost(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["cost"]: row for row in goal_rows(result)}


def test_a_goal_is_left_out_when_its_section_did_not_run() -> None:
    assert goal_rows({}) == []
    assert goal_rows({"mttr": [], "slurm": [], "simulation": []}) == []


def test_the_cold_restarts_stop_and_spawn_is_met_only_at_or_below_torchruns() -> None:
    slower = _by_cost({"mttr": [_restart("relaunch", 3.55), _restart("torchrun", 1.77)]})
    (row,) = slower.values()
    assert row["met"] is False and "3.55 s" in row["figure"] and "torchrun 1.77 s" in row["figure"]
    faster = goal_rows({"mttr": [_restart("relaunch", 0.4), _restart("torchrun", 1.77)]})
    assert faster[0]["met"] is True
    # a warm level's or the light workload's phases are not the cold DDP restart's
    warm = {**_restart("relaunch", 0.1), "level": "job-reschedule+spare"}
    (alone,) = goal_rows({"mttr": [warm, _restart("torchrun", 1.77)]})
    assert alone["met"] == "-" and "not measured" in alone["figure"]


def test_the_overhead_is_one_row_per_heartbeat_against_a_tenth_of_a_millisecond() -> None:
    rows = goal_rows(
        {
            "overhead": [
                {"heartbeat_s": 1.0, "relaunch_ms_per_proc_s": 0.31},
                {"heartbeat_s": 0.2, "relaunch_ms_per_proc_s": 0.09},
            ]
        }
    )
    assert [r["met"] for r in rows] == [False, True]
    assert "heartbeat 1 s" in rows[0]["cost"] and "heartbeat 0.2 s" in rows[1]["cost"]


def test_the_async_saves_stall_is_measured_by_size_against_a_twentieth() -> None:
    rows = goal_rows(
        {
            "checkpoint": [
                {"size_mb": 64, "async_vs_sync": 0.112, "loop_async_vs_sync": 0.09},
                {"size_mb": 512, "async_vs_sync": 0.04},
            ]
        }
    )
    assert [(r["cost"].endswith("64 MB"), r["met"]) for r in rows] == [(True, False), (False, True)]


def test_the_simulation_is_judged_by_its_slowest_level_and_a_failed_level_fails_it() -> None:
    def level(name: str, pods: int, took: float | None) -> dict[str, Any]:
        return {"level": name, "pods": pods, "detected_to_last_command_s": took}

    rows = goal_rows(
        {
            "simulation": [
                level("process-in-place", 4096, 0.08),
                level("job-reschedule", 4096, 0.89),
                level("job-reschedule", 16384, 3.2),
                level("in-place", 16384, None),
            ]
        }
    )
    small, large = rows
    assert "4,096 pods" in small["cost"] and small["met"] is True
    assert "0.890 s (job-reschedule" in small["figure"]
    assert (
        "16,384 pods" in large["cost"] and large["met"] is False and "1 failed" in large["figure"]
    )


def test_a_lost_node_inside_slurm_meets_its_goal_only_below_nvrx_or_where_nvrx_does_not_recover() -> (
    None
):
    def lost(ours: float, theirs: float | None) -> list[dict[str, Any]]:
        rows = [{"system": "relaunch", "fault": "lost-node", "ok": True, "stall_s": ours}]
        rows.append(
            {"system": "NVRx", "fault": "lost-node", "ok": theirs is not None, "stall_s": theirs}
        )
        return rows

    (behind,) = goal_rows({"slurm": lost(27.0, 12.0)})
    assert behind["met"] is False
    (alone,) = goal_rows({"slurm": lost(6.0, None)})
    assert alone["met"] is True and "NVRx not back" in alone["figure"]
