"""The peers section of the bench: what is read off a peer's timeline, and what a missing peer
says. (The peers themselves run in `relaunch bench --only peers`, in virtual environments of
their own that `make peers` makes: minutes of installs, not a test's business.)"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from relaunch_bench import report
from relaunch_bench.jobs import FAULT_STEP
from relaunch_bench.peer_runs import (
    PEERS_ENV,
    PeerSample,
    _launcher_sample,
    _torchft_sample,
    peer_python,
)
from relaunch_bench.peers import _row, peer_ratio_spreads, peer_ratios, peer_rows, peer_unmatched
from relaunch_bench.timeline import PHASES

F = FAULT_STEP


def steps(replica: int, first: int, last: int, start: float, every: float = 0.025):
    return [("step", s, start + (s - first) * every, replica) for s in range(first, last + 1)]


def test_a_torchft_crash_reads_the_survivors_stall_and_the_replacements_rejoin() -> None:
    """Replica 1 exits at the fault step; replica 0 commits again 1.05 s later (the lighthouse
    dropped it); replica 1's new process steps 4 s after the fault."""
    events = [
        *steps(0, 1, F - 1, 100.0),
        *steps(1, 1, F - 1, 100.0),
        ("crash", F, 101.0, 1),
        *steps(0, F, F + 100, 102.05),
        ("launched", 0, 101.3, 1),
        *steps(1, F + 90, F + 100, 105.0),
    ]
    sample = _torchft_sample(events, "crash", None)
    assert sample.ok and sample.stall_s == pytest.approx(1.05)
    assert sample.rejoin_s == pytest.approx(4.0)
    assert sample.lost_steps == 0 and sample.ranks_restarted == 1 and sample.detected


def test_a_torchft_replica_killed_with_its_node_never_comes_back() -> None:
    """A lost node: the harness kills replica 1's torchrun at `killed_at`; nothing restarts it."""
    events = [*steps(0, 1, F - 1, 100.0), *steps(0, F, F + 50, 101.5)]
    sample = _torchft_sample(events, "lost-node", 100.6)
    assert sample.ok and sample.stall_s == pytest.approx(0.9)
    assert sample.rejoin_s is None and sample.ranks_restarted == 0
    assert "never came back" in sample.note


def test_a_torchft_fault_that_never_struck_or_a_survivor_that_stopped_is_no_number() -> None:
    assert not _torchft_sample(steps(0, 1, 40, 100.0), "crash", None).ok
    stuck = [*steps(0, 1, F - 1, 100.0), ("hang", F, 101.0, 1)]
    sample = _torchft_sample(stuck, "hang", None)
    assert not sample.ok and "no step after the fault" in sample.note
    row = _row("torchft", "hang", [sample])
    assert row.failures == 1 and row.stall_s is None and "no step" in row.note


def test_a_peer_not_installed_is_a_row_that_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PEERS_ENV, str(tmp_path))
    why = peer_python("torchft")
    assert isinstance(why, str) and "make peers" in why and "torchft==0.2.0" in why
    said: list[str] = []
    rows = [r for r in peer_rows(1, said.append, faults=("crash",), relaunch=False)]
    assert [(r["system"], r["fault"], r["stall_s"]) for r in rows] == [
        ("torchft (1 s heartbeat)", "crash", None),
        ("NVRx ft_launcher (4 s heartbeat)", "crash", None),
        ("DLRover dlrover-run --standalone", "crash", None),
    ]
    assert all("make peers" in r["note"] for r in rows) and len(said) == 3
    markdown = report.markdown(
        {"mttr": [], "hang": [], "ratios": {}, "peers": rows, "overhead": []}
    )
    assert "Side by side with the specialists" in markdown and "make peers" in markdown


def test_each_faults_ratio_is_relaunch_over_the_best_peer_measured() -> None:
    """A crash twice: one rank replaced against torchft's survivor, every rank restarted
    against the best launcher that restarts every rank; a fault a peer could not take (no
    number) is no ratio."""
    rows = [
        {"fault": "crash", "system": "relaunch process-in-place+spare", "stall_s": 0.2},
        {"fault": "crash", "system": "relaunch job-reschedule+spare", "stall_s": 0.8},
        {"fault": "crash", "system": "torchrun (c10d)", "stall_s": 4.0, "rejoin_s": 4.0},
        {"fault": "crash", "system": "torchft (1 s heartbeat)", "stall_s": 1.0, "rejoin_s": 3.9},
        {
            "fault": "crash",
            "system": "NVRx ft_launcher (4 s heartbeat)",
            "stall_s": 4.2,
            "rejoin_s": 4.2,
        },
        {
            "fault": "crash",
            "system": "DLRover dlrover-run --standalone",
            "stall_s": 3.2,
            "rejoin_s": 3.2,
        },
        {"fault": "hang", "system": "relaunch hang-restart", "stall_s": 5.0, "detect_s": 4.15},
        {"fault": "hang", "system": "torchft (1 s heartbeat)", "stall_s": None},
        {"fault": "link-flap", "system": "relaunch operator-retry", "stall_s": 6.0},
        {"fault": "link-flap", "system": "torchrun (c10d)", "stall_s": 30.0},
        {"fault": "link-flap", "system": "torchft (1 s heartbeat)", "stall_s": 12.0},
    ]
    assert peer_ratios(rows) == {
        "crash, one rank (process-in-place+spare / torchft)": 0.2,
        "crash, every rank (job-reschedule+spare / best of torchrun, NVRx, DLRover)": 0.25,
        "link flap 10 s (operator-retry / best peer)": 0.5,
        "hang: seconds detected past its 4 s window": 0.15,
    }
    markdown = report.markdown(
        {"mttr": [], "hang": [], "ratios": {}, "peers": rows, "peer_ratios": peer_ratios(rows)}
    )
    assert "relaunch / the best peer (stall" in markdown
    assert "crash, one rank (process-in-place+spare / torchft) 0.2" in markdown


def test_a_ratio_is_taken_against_a_peer_that_restores_the_job_or_said_to_have_none() -> None:
    """Issue 75: the hang's ratio came out 3.84, relaunch over torchft's survivor, whose struck
    replica never came back. A peer counts where the struck rank stepped again (`rejoin_s`);
    a fault that no peer recovers is named, with no number."""
    rows = [
        {"fault": "hang", "system": "relaunch hang-restart+spare", "stall_s": 4.2},
        {"fault": "hang", "system": "torchft (1 s heartbeat)", "stall_s": 1.1, "rejoin_s": None},
        {"fault": "hang", "system": "NVRx ft_launcher (4 s heartbeat)", "stall_s": 10.5,
         "rejoin_s": 10.5},
        {"fault": "lost-node", "system": "relaunch process-reschedule+spare", "stall_s": 0.16},
        {"fault": "lost-node", "system": "torchft (1 s heartbeat)", "stall_s": 1.0},
        {"fault": "lost-node", "system": "NVRx ft_launcher (4 s heartbeat)", "stall_s": None},
    ]  # fmt: skip
    assert peer_ratios(rows) == {"hang (hang-restart / best peer)": 0.4}
    assert peer_unmatched(rows) == ["lost node (process-reschedule+spare / best peer)"]
    result = {
        "mttr": [], "hang": [], "ratios": {}, "peers": rows, "peer_ratios": peer_ratios(rows),
        "peer_unmatched": peer_unmatched(rows),
    }  # fmt: skip
    assert "No peer restores the job: lost node (process-reschedule+spare" in (
        report.markdown(result)
    )


def test_each_ratio_is_said_with_its_spread_over_the_runs() -> None:
    """Issue 49: the one-rank crash ratio came out 0.41 in one run of the bench and 0.21 in
    another; a ratio is said with the spread of its runs: relaunch's fastest against the
    peer's slowest, to relaunch's slowest against the peer's fastest."""
    rows = [
        {"fault": "crash", "system": "relaunch process-in-place+spare", "stall_s": 0.3,
         "samples": [0.2, 0.3, 0.5]},
        {"fault": "crash", "system": "torchft (1 s heartbeat)", "stall_s": 1.0,
         "rejoin_s": 3.0, "samples": [0.8, 1.0, 2.0]},
        {"fault": "hang", "system": "relaunch hang-restart", "stall_s": 5.0, "samples": [5.0]},
    ]  # fmt: skip
    assert peer_ratio_spreads(rows) == {
        "crash, one rank (process-in-place+spare / torchft)": (0.1, 0.62)
    }
    result = {
        "mttr": [], "hang": [], "ratios": {}, "peers": rows, "peer_ratios": peer_ratios(rows),
        "peer_ratio_spreads": peer_ratio_spreads(rows),
    }  # fmt: skip
    assert "crash, one rank (process-in-place+spare / torchft) 0.3 (runs: 0.1-0.62)" in (
        report.markdown(json.loads(json.dumps(result)))  # as read back from bench.json
    )


def test_a_launcher_that_restarts_every_rank_is_read_off_rank_0s_timeline(tmp_path: Path) -> None:
    """Rank 1 crashes at the fault step; every rank restarts from the checkpoint of step 20 and
    steps again 4.5 s later: 1 step redone, both ranks restarted."""
    lines = [f"step {s} {100 + s * 0.025:.3f}" for s in range(1, F)]
    lines += [f"crash {F} 101.0", "launched 0 102.0", "start 20 105.0"]
    lines += [f"step {s} {105.5 + (s - 21) * 0.025:.3f}" for s in range(21, 40)]
    path = tmp_path / "timeline.txt"
    path.write_text("\n".join(lines) + "\n")
    sample = _launcher_sample(path, "crash", finished=True)
    assert sample.ok and sample.stall_s == pytest.approx(4.5)
    assert sample.lost_steps == F - 1 - 20 and sample.ranks_restarted == 2
    path.write_text("\n".join(lines[: F + 1]) + "\n")  # restarted, never stepped again
    failed = _launcher_sample(path, "crash", finished=False)
    assert not failed.ok and "did not finish" in failed.note


def test_relaunchs_restarts_beside_the_peers_are_shown_part_by_part() -> None:
    """Issue 75: a warm restart's floor is visible where the peers are: each relaunch row where
    rank 0 restarted carries the medians of its parts, and the report prints them."""
    parts = {k: 0.01 for k in PHASES} | {"rendezvous": 0.08}
    samples = [
        PeerSample(True, stall_s=s, rejoin_s=s, detected=True, phases={**parts, "detect": d})
        for s, d in ((0.5, 0.02), (0.6, 0.04), (4.0, 0.03))
    ]
    row = asdict(_row("relaunch job-reschedule+spare", "crash", samples))
    assert row["phases"]["detect"] == 0.03 and row["phases"]["rendezvous"] == 0.08
    kept = asdict(_row("torchft (1 s heartbeat)", "crash", [PeerSample(True, stall_s=1.0)]))
    assert kept["phases"] is None
    result = {"mttr": [], "hang": [], "ratios": {}, "peers": [row, kept]}
    text = report.markdown(json.loads(json.dumps(result)))
    assert "Where relaunch's restarts' time goes" in text
    (shown,) = [line for line in text.splitlines() if line.startswith("| relaunch job-")]
    assert "| 0.08 |" in shown and "torchft" not in text.split("restarts' time goes")[1]
