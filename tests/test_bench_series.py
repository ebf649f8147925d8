"""The bench's goodput under a fault series: the series each script strikes, the goodput read off
a timeline, and a short series run end to end under relaunch and under torchrun. (The peers'
ten-minute runs are `relaunch bench --only series`'s, in their own virtual environments.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from relaunch_bench.series import measure, peer_series, plan, relaunch_series, series_ratio

WORKLOADS = Path(__file__).parent.parent / "src" / "relaunch_bench" / "workloads"


def _peer_job():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("peer_job", WORKLOADS / "peer_job.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_series_is_a_fault_every_so_many_steps_cycling_through_its_kinds() -> None:
    assert plan(5, every=100) == [
        (100, "crash"),
        (200, "crash"),
        (300, "hang"),
        (400, "crash"),
        (500, "crash"),
    ]
    assert [k for _, k in plan(3, kinds=("crash", "lost-node", "hang"))] == [
        "crash",
        "lost-node",
        "hang",
    ]


def test_each_fault_of_a_scripts_series_strikes_once_across_restarts(tmp_path: Path) -> None:
    series_of = _peer_job().FaultSeries
    marks = str(tmp_path / "timeline.txt")
    first = series_of("10:crash,20:hang", marks)
    assert [first.due(s) for s in (9, 10, 11)] == [None, "crash", None]
    again = series_of("10:crash,20:hang", marks)  # the restarted process resumes at step 6
    assert again.due(6) is None and again.due(10) is None
    assert again.due(22) == "hang", "a step healed past strikes at the first step tried"
    assert series_of("10:crash,20:hang", marks).due(30) is None
    with pytest.raises(ValueError, match="crash or hang"):
        series_of("10:meteor", marks)


def test_goodput_is_the_steps_kept_at_the_fault_free_pace() -> None:
    """Steps every 25 ms; a fault at 10.0 s after step 400 (about 10.0 s), the next step 2 s
    later resuming from checkpoint 395 (steps 396-400 again): 2 s of stall, 5 steps again."""
    events = [("step", s, s * 0.025) for s in range(1, 401)]
    events += [("step", 395 + i, 12.0 + i * 0.025) for i in range(1, 206)]
    measured = measure(events, [10.01])
    assert measured["steps"] == 600 and measured["step_ms"] == pytest.approx(25.0)
    assert measured["lost_by_cause"]["detection and restart"] == pytest.approx(2.0, abs=0.05)
    assert measured["lost_by_cause"]["recomputed"] == pytest.approx(0.1, abs=0.05)
    assert measured["lost_s"] == pytest.approx(2.1, abs=0.1)
    assert measured["ettr"] == pytest.approx(14.975 / 17.1, abs=0.01)
    assert measure([("step", 1, 0.0)], []) == {}
    fault_free = measure(events[:400], [])  # a reference run: no fault, nothing lost to one
    assert fault_free["step_ms"] == pytest.approx(25.0) and fault_free["ettr"] == 1.0
    assert fault_free["lost_by_cause"]["detection and restart"] == 0


def test_the_stall_ends_with_the_longest_pause_after_the_fault_not_the_next_step() -> None:
    """Rank 0 finishes the step under way after its peer died (step 401 at 10.02 s) and waits;
    training resumes 2 s later from checkpoint 395: the stall is the fault to that resumption,
    and 401 - 395 steps are computed again."""
    events = [("step", s, s * 0.025) for s in range(1, 402)]
    events += [("step", 395 + i, 12.0 + i * 0.025) for i in range(1, 206)]
    measured = measure(events, [10.01])
    assert measured["lost_by_cause"]["detection and restart"] == pytest.approx(2.0, abs=0.05)
    assert measured["lost_by_cause"]["recomputed"] == pytest.approx(0.15, abs=0.06)  # 0.1 s units


def test_the_lost_time_ratio_is_against_the_best_peer_that_finished() -> None:
    rows = [
        {"system": "relaunch", "series": "crash, hang", "lost_s": 30.0, "finished": True},
        {"system": "relaunch", "series": "with lost nodes", "lost_s": 40.0, "finished": True},
        {"system": "torchrun", "series": "crash, hang", "lost_s": 300.0, "finished": True},
        {"system": "NVRx", "series": "crash, hang", "lost_s": 100.0, "finished": True},
        {"system": "DLRover", "series": "crash, hang", "lost_s": 10.0, "finished": False},
    ]
    assert series_ratio(rows) == 0.3
    assert series_ratio(rows[:2]) is None


def test_a_short_series_under_relaunch_is_recovered_fault_by_fault(tmp_path: Path) -> None:
    """A crash and a hang 100 steps apart: relaunch's own levels recover each (the SDK keeps
    the group, so a warm spare replaces the crashed rank, and the hung one too), and the ruler
    reads the run; then a fault-free run of the same job without process-level recovery gives
    the plain script's step, and the step's price of the process level beside it."""
    series = plan(2, every=100, kinds=("crash", "hang"))
    result = relaunch_series(series, tmp_path, every=100, reference_steps=60)
    assert result.finished and result.faults == 2, result
    assert set(result.note.split(", ")) <= {"process-in-place", "hang-restart"}, result.note
    assert result.steps == 300 and result.ettr is not None and 0 < result.ettr < 1
    assert result.lost_by_cause["detection and restart"] > 0
    assert result.step_ms and result.plain_step_ms, result
    assert result.process_level_cost == round(result.step_ms / result.plain_step_ms - 1, 3)
    ran = {d: yaml.safe_load((d / "job.yaml").read_text()) for d in (tmp_path, tmp_path / "plain")}
    assert "--process-recovery" in ran[tmp_path]["spec"]["command"]
    assert "--process-recovery" not in ran[tmp_path / "plain"]["spec"]["command"]
    assert "recover-strategy" not in ran[tmp_path / "plain"]["metadata"]["annotations"]


def test_a_short_series_under_torchrun_runs_the_plain_script_and_strikes_each_fault(
    tmp_path: Path,
) -> None:
    """One crash: torchrun restarts every rank from the script's checkpoint (that each fault of
    a series strikes once across restarts is test_each_fault_of_a_scripts_series_strikes_once_
    across_restarts; every restart here is two torch start-ups)."""
    result = peer_series("torchrun", plan(1, every=100, kinds=("crash",)), tmp_path, every=100)
    assert result.finished and result.faults == 1, result
    assert result.steps == 200 and result.lost_s is not None and result.lost_s > 0


def test_the_goodput_figure_shows_each_run_that_was_measured(tmp_path: Path) -> None:
    """A bar a system that ran (productive, then lost by cause); a peer that could not take
    the series (no run) has none; no measured run at all writes no figure."""
    from relaunch_bench.report import goodput_chart

    lost = {"detection and restart": 20.0, "recomputed": 1.0, "slower steps": 3.0}
    rows = [
        {"system": "relaunch", "series": "crash, hang", "faults": 9, "run_s": 624.0,
         "productive_s": 600.0, "lost_s": 24.0, "ettr": 0.96, "lost_by_cause": lost},
        {"system": "torchft", "series": "crash, hang", "note": "cannot take it"},
    ]  # fmt: skip
    path = tmp_path / "goodput.png"
    assert goodput_chart(rows, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not goodput_chart(rows[1:], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()
