"""Diagnosis: the root cause of a fault and its collateral (issue 18, part 1). Pure rules first,
then a real DDP job (gloo) whose rank 3 raises while its peers' exits reach relaunch first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relaunch.cli import summary
from relaunch.cli.common import out
from relaunch.controller.commands import progress_interval, slow_window_unusable
from relaunch.controller.peers import Rank
from relaunch.diagnosis import (
    MIN_LOOKS,
    Frame,
    Goodput,
    Group,
    RankStack,
    Recovery,
    StackGroup,
    caused_by_peer,
    culprits,
    error_from_file,
    error_from_output,
    failure_time,
    goodput,
    group_stacks,
    is_collateral,
    ranks_text,
    root_cause,
    slow_pods,
    waits_in_collective,
)
from relaunch.events import EventKind
from relaunch.faults import ErrorReport, Fault, FaultKind
from relaunch.store import Store
from relaunch.store.rows import hang_view
from tests.runtime import DDP_CLUSTER, FAST_CLUSTER, ROOT, Cluster, Result, toy_job

GLOO_PEER = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:21709"
)


def exit_of(rank: int, at: float, error: ErrorReport | None = None, code: int = 1) -> Fault:
    return Fault(FaultKind.PROCESS_EXIT, at, node="node-0", pod=rank // 2, rank=rank,
                 exit_code=code, error=error)  # fmt: skip


def said(kind: str, message: str, at: float) -> ErrorReport:
    return ErrorReport(kind, message, "Traceback ...", at, "error-file")


# -- what a rank left behind --------------------------------------------------------------------


def test_error_file_written_by_torch_record_gives_type_message_and_traceback() -> None:
    data = {
        "message": {
            "message": "ValueError: bad batch",
            "extraInfo": {
                "py_callstack": "Traceback (most recent call last):\n  ...\n",
                "timestamp": "1",
            },
        }
    }
    found = error_from_file(data, 12.5)
    assert found == ErrorReport(
        "ValueError", "bad batch", "Traceback (most recent call last):\n  ...", 12.5, "error-file"
    )


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"message": ""},
        {"message": {"extraInfo": {}}},
        {"message": 3},
        {"message": {"message": None}},
    ],
    ids=["empty", "blank", "no-message", "number", "null"],
)
def test_error_file_without_a_message_gives_nothing(data: dict[str, object]) -> None:
    assert error_from_file(data, 1.0) is None


def test_error_file_with_a_plain_string_message() -> None:
    found = error_from_file({"message": "NCCL watchdog timed out\nmore"}, 2.0)
    assert found is not None
    assert (found.type, found.message) == ("", "NCCL watchdog timed out\nmore")


def test_traceback_in_the_output_with_torch_rank_prefixes_and_chained_exceptions() -> None:
    lines = [
        (1.0, "step 9 total 36"),
        (2.0, "[rank3]: Traceback (most recent call last):"),
        (2.0, '[rank3]:   File "t.py", line 3, in f'),
        (2.0, "[rank3]: KeyError: 'x'"),
        (2.0, "[rank3]: "),
        (2.0, "[rank3]: During handling of the above exception, another exception occurred:"),
        (2.1, "[rank3]: Traceback (most recent call last):"),
        (2.1, '[rank3]:   File "t.py", line 5, in g'),
        (2.1, "[rank3]:     raise ValueError('bad batch')"),
        (2.2, "[rank3]: ValueError: bad batch"),
    ]
    found = error_from_output(lines)
    assert found is not None
    assert (found.type, found.message, found.at, found.source) == (
        "ValueError",
        "bad batch",
        2.1,
        "output",
    )
    assert found.traceback.splitlines()[0] == "Traceback (most recent call last):"
    assert found.traceback.splitlines()[-1] == "ValueError: bad batch"


def test_output_without_a_traceback_gives_its_last_line() -> None:
    found = error_from_output([(1.0, "loading"), (2.0, "CUDA out of memory, giving up"), (3.0, "")])
    assert found is not None
    assert (found.type, found.message, found.at) == ("", "CUDA out of memory, giving up", 2.0)


def test_no_output_gives_nothing() -> None:
    assert error_from_output([]) is None
    assert error_from_output([(1.0, "   ")]) is None


def test_a_traceback_cut_before_its_exception_line_falls_back_to_the_last_line() -> None:
    found = error_from_output([(1.0, "Traceback (most recent call last):"), (1.0, '  File "a.py"')])
    assert found is not None and found.type == ""


# -- which failure caused the others ------------------------------------------------------------


def test_root_cause_is_the_first_failure_by_time_not_by_arrival() -> None:
    late_arrival_but_first = exit_of(3, at=10.0, error=said("ValueError", "bad", 5.0))
    first_arrival = exit_of(2, at=6.0)
    assert root_cause([first_arrival, late_arrival_but_first]) is late_arrival_but_first
    assert failure_time(late_arrival_but_first) == 5.0


def test_a_rank_that_blames_its_peer_is_not_the_root_cause_even_when_first() -> None:
    peer = exit_of(2, at=6.0, error=said("RuntimeError", GLOO_PEER, 4.9))
    own = exit_of(3, at=9.0, error=said("ValueError", "bad batch", 5.0))
    assert caused_by_peer(peer) and not caused_by_peer(own)
    assert root_cause([peer, own]) is own


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("RuntimeError", "Connection reset by peer"),
        (
            "torch.distributed.DistBackendError",
            "NCCL error: remote process exited or there was a network error",
        ),
        ("DistNetworkError", "anything"),
        ("RuntimeError", "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(...)"),
        ("RuntimeError", "failed to recv, got 0 bytes"),
    ],
)
def test_what_collectives_say_when_a_peer_failed(kind: str, message: str) -> None:
    assert caused_by_peer(exit_of(0, 1.0, said(kind, message, 1.0)))


def test_a_rank_that_left_only_its_last_output_failed_when_it_exited() -> None:
    """Its last line ("step 180 loss ...") may be minutes old: not the time of the failure."""
    last_line = ErrorReport("", "step 180 loss 0.52", "step 180 loss 0.52", 3.0, "output")
    assert failure_time(exit_of(1, at=50.0, error=last_line)) == 50.0
    traceback = ErrorReport("ValueError", "bad", "Traceback ...", 48.0, "output")
    assert failure_time(exit_of(1, at=50.0, error=traceback)) == 48.0


def test_if_every_rank_blames_a_peer_the_first_is_named() -> None:
    a = exit_of(0, at=3.0, error=said("RuntimeError", GLOO_PEER, 2.0))
    b = exit_of(1, at=2.5, error=said("RuntimeError", GLOO_PEER, 2.4))
    assert root_cause([b, a]) is a


def test_collateral_is_same_attempt_same_processes_within_the_window() -> None:
    group = Group(1, exit_of(2, at=10.0), attempt=1)
    rank3 = exit_of(3, at=14.0, error=said("ValueError", "bad", 9.5))
    assert is_collateral(group, rank3, attempt=1, started_at=0.0, window_s=5)
    assert not is_collateral(group, rank3, attempt=2, started_at=0.0, window_s=5), "another attempt"
    assert not is_collateral(group, rank3, attempt=1, started_at=10.5, window_s=5), "a replacement"
    assert not is_collateral(group, exit_of(3, at=15.1), 1, 0.0, 5), "outside the window"
    assert not is_collateral(group, exit_of(3, at=4.9), 1, 0.0, 5), "long before"
    lost = Fault(FaultKind.NODE_LOST, 11.0, node="node-1")
    assert not is_collateral(group, lost, 1, 0.0, 5), "only process exits are collateral"


# -- end to end ---------------------------------------------------------------------------------

FOUR_RANKS = {
    "kind": "job",
    "metadata": {
        "name": "root-cause",
        "annotations": {
            "fault-tolerance/job-retry-num": "3",
            "fault-tolerance/job-unconditional-retry": "true",
        },
        "labels": {"fault-scheduling": "grace", "grace-over-time": "5"},
    },
    "spec": {
        "replicas": 2,
        "procs_per_pod": 2,
        "chips_per_pod": 2,
        "hang_detect_seconds": 20,
        "monitor_interval": 0.2,
    },
}


@pytest.mark.parametrize("recorded", [True, False], ids=["error-file", "output"])
def test_ddp_rank_that_raises_is_the_root_cause_and_its_peers_are_collateral(
    tmp_path: Path, recorded: bool
) -> None:
    """Rank 3 raises; its `finally` destroys the process group so ranks 0-2 fail at once in their
    all-reduce ("Connection closed by peer") while rank 3 takes 3 s to exit: their exits reach
    relaunch first, and their errors were even written first (torch's `record` writes rank 3's
    after the `finally`). The record names rank 3 with its exception; the others are collateral; one
    restart, not four."""
    script = ROOT / "tests" / "scripts" / "raise_in_step.py"
    job = json.loads(json.dumps(FOUR_RANKS))
    job["spec"]["command"] = f"python {script}" + ("" if recorded else " --no-record")
    cluster = Cluster(tmp_path)
    result = cluster.run(job, timeout=120)
    seen = f"{result.stdout}\n{result.stderr}\n{result.logs()[-4000:]}"
    assert result.returncode == 0, seen
    assert len(result.report["recoveries"]) == 1, seen
    (record,) = result.report["recoveries"]
    root = record["fault"]
    assert (root["kind"], root["rank"], root["pod"]) == ("process-exit", 3, 1)
    error = root["error"]
    assert error["type"] == "ValueError"
    assert error["message"] == "bad batch at step 10: labels out of range"
    assert error["source"] == ("error-file" if recorded else "output")
    assert "raise ValueError" in error["traceback"]
    collateral = {c["rank"]: c for c in record["collateral"]}
    assert set(collateral) <= {0, 1, 2} and 2 in collateral, record["collateral"]
    peer = collateral[2]["error"]
    assert peer is not None and "Connection closed by peer" in peer["message"]
    assert result.report["restarts_used"] == 1
    figures = result.report["goodput"]
    lost = figures["lost_s"]
    assert figures["productive_s"] + sum(lost.values()) == pytest.approx(
        figures["wall_s"], abs=0.01
    )
    assert lost["recovery"] > 0 and lost["detection"] >= 0

    described = subprocess.run(
        [sys.executable, "-m", "relaunch", "describe", "root-cause", "--state-dir", str(cluster.state)],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout  # fmt: skip
    assert "#1 root cause (rank 3, pod 1" in described
    assert "ValueError: bad batch at step 10: labels out of range" in described
    assert "collateral" in described and "rank 2" in described


# -- the hung rank, named -------------------------------------------------------------------------

TORCH = "/venv/lib/python3.11/site-packages/torch"
IN_ALL_REDUCE = (
    Frame("wait", f"{TORCH}/distributed/distributed_c10d.py", 3252),
    Frame("all_reduce", f"{TORCH}/distributed/distributed_c10d.py", 3250),
    Frame("main", "train.py", 40),
)
IN_DDP_BACKWARD = (
    Frame("_engine_run_backward", f"{TORCH}/autograd/graph.py", 979),
    Frame("backward", f"{TORCH}/autograd/__init__.py", 395),
    Frame("main", "train.py", 41),
)
IN_USER_CODE = (Frame("load_batch", "data.py", 12), Frame("main", "train.py", 38))


def stack(
    rank: int, state: str = "sleeping", frames: tuple[Frame, ...] = IN_ALL_REDUCE
) -> RankStack:
    return RankStack(rank, 100 + rank, state, frames, "\n".join(map(str, frames)))


def test_a_stopped_rank_is_the_culprit_wherever_its_stack_is() -> None:
    found = culprits([stack(0), stack(1, "stopped", IN_DDP_BACKWARD), stack(2), stack(3)])
    assert found.culprits == (1,)
    assert "stopped" in found.reason


def test_a_rank_outside_any_collective_while_the_others_wait_is_the_culprit() -> None:
    found = culprits(
        [stack(0, frames=IN_DDP_BACKWARD), stack(1), stack(2, "running", IN_USER_CODE), stack(3)]
    )
    assert found.culprits == (2,)
    assert "load_batch (data.py:12)" in found.reason


def test_every_rank_in_a_collective_names_no_culprit() -> None:
    found = culprits([stack(0), stack(1, frames=IN_DDP_BACKWARD)])
    assert found.culprits == ()
    assert "every rank waits in a collective" in found.reason


def test_no_readable_stack_names_no_culprit_and_says_why() -> None:
    unread = [RankStack(0, 5, "sleeping", error="py-spy: Permission denied")]
    assert culprits(unread).culprits == ()
    assert "Permission denied" in culprits(unread).reason
    assert culprits([]).culprits == ()


def test_alike_stacks_are_one_group_with_each_ranks_pid_and_unlike_ones_stay_apart() -> None:
    groups = group_stacks(
        [stack(3), stack(0), stack(1, "stopped", IN_DDP_BACKWARD), stack(2, frames=IN_DDP_BACKWARD)]
    )
    assert [(g.ranks, g.pids, g.state) for g in groups] == [
        ((0, 3), (100, 103), "sleeping"),
        ((1,), (101,), "stopped"),  # same frames as rank 2, another state
        ((2,), (102,), "sleeping"),
    ]
    # groups from two launchers merge into one a stack, with single ranks' stacks beside them
    merged = group_stacks(
        [
            *groups,
            stack(4),
            StackGroup((6, 5), (106, 105), "sleeping", IN_ALL_REDUCE, groups[0].text),
        ]
    )
    assert (merged[0].ranks, merged[0].pids) == ((0, 3, 4, 5, 6), (100, 103, 104, 105, 106))
    assert len(merged) == 3
    assert group_stacks([]) == ()


def test_a_hang_of_thousands_of_ranks_is_named_in_a_line_from_their_groups() -> None:
    """32,768 ranks: one stopped, the rest waiting in one collective, sent as one group a pod
    (8 ranks): the culprit is named, and the finding stays a line however many ranks wait."""
    pods = [
        StackGroup(
            tuple(range(p * 8, p * 8 + 8)),
            tuple(range(p * 8, p * 8 + 8)),
            "sleeping",
            IN_ALL_REDUCE,
        )
        for p in range(4095)
    ]
    last = group_stacks([stack(r) for r in range(32760, 32767)] + [stack(32767, "stopped")])
    found = culprits([*pods, *last])
    assert found.culprits == (32767,)
    away = group_stacks([*pods, StackGroup((32760,), (1,), "running", IN_USER_CODE)])
    found = culprits(away)
    assert found.culprits == (32760,)
    assert found.reason == (
        "rank 32760 not in a collective (rank 32760 is in load_batch (data.py:12)) while "
        "ranks 0-32759 (32,760) wait in one"
    )


def test_ranks_are_written_as_runs_with_a_count_once_there_are_many() -> None:
    assert ranks_text([7]) == "rank 7"
    assert ranks_text([2, 0]) == "ranks 0, 2"
    assert ranks_text([0, 1, 3]) == "ranks 0, 1, 3"
    assert ranks_text([0, 1, 2, 3, 5, 7, 8, 9, 10]) == "ranks 0-3, 5, 7-10 (9)"
    assert ranks_text(list(range(4096))) == "ranks 0-4095 (4,096)"


def test_describe_prints_alike_stacks_once_with_their_ranks_and_reads_a_record_of_one_a_rank() -> (
    None
):
    """A hang's evidence as stored now (groups) and as stored before the groups (one stack a
    rank): `describe` prints each stack once, with its ranks as runs, the culprit marked."""
    waiting = {"state": "sleeping", "stack": "all_reduce (c10d.py:1)", "error": ""}
    grouped = {
        "finding": "rank 4095 stopped",
        "capture_s": 0.4,
        "culprits": [4095],
        "stacks": [
            {"ranks": list(range(4095)), "pids": list(range(4095)), **waiting},
            {
                "ranks": [4095],
                "pids": [77],
                "state": "stopped",
                "stack": "main (t.py:9)",
                "error": "",
            },
        ],
    }
    old = {
        **grouped,
        "stacks": [
            {"rank": 0, "pid": 10, **waiting},
            {"rank": 1, "pid": 11, "state": "stopped", "stack": "", "error": "py-spy: gone"},
        ],
        "culprits": [1],
    }
    assert hang_view(old)["stacks"] == [  # type: ignore[index]
        {"ranks": [0], "pids": [10], **waiting},
        {"ranks": [1], "pids": [11], "state": "stopped", "stack": "", "error": "py-spy: gone"},
    ]
    assert hang_view(grouped) == grouped and hang_view(None) is None
    with out.capture() as printed:
        summary._hang(grouped)
        summary._hang(hang_view(old))  # type: ignore[arg-type]
    text = printed.get()
    assert "ranks 0-4094 (4,095) (sleeping):" in text
    assert "rank 4095 (pid 77, stopped) <- culprit:" in text and "main (t.py:9)" in text
    assert text.count("all_reduce (c10d.py:1)") == 2  # once a record, not once a rank
    assert "rank 1 (pid 11, stopped) <- culprit:" in text and "py-spy: gone" in text


def test_waiting_in_a_collective_needs_a_torch_distributed_frame() -> None:
    assert waits_in_collective(IN_ALL_REDUCE) and waits_in_collective(IN_DDP_BACKWARD)
    assert not waits_in_collective((Frame("all_reduce", "my_own_comm.py", 3),))
    assert not waits_in_collective(IN_USER_CODE)


def test_ddp_rank_stopped_inside_a_step_is_named_with_every_rank_stack(tmp_path: Path) -> None:
    """The DDP example: rank 2 SIGSTOPs itself in step 15 while ranks 0, 1 and 3 wait in DDP's
    all-reduce (autograd's backward). Before the hang restart, relaunch captures every rank's
    stack: the record names rank 2, and holds the four stacks."""
    job = yaml.safe_load((ROOT / "examples" / "ddp" / "job.yaml").read_text())
    job["spec"]["command"] = (
        f"python {ROOT / 'examples' / 'ddp' / 'train_ddp.py'} --steps 30 --ckpt-every 10 "
        "--hang-at-step 15 --crash-rank 2"
    )
    cluster = Cluster(tmp_path)
    result = cluster.run(job, cluster=DDP_CLUSTER, timeout=240, startup_s=60)
    assert result.returncode == 0, result.stdout + result.stderr
    first = result.report["recoveries"][0]
    assert first["fault"]["kind"] == "hang"
    assert first["fault"]["rank"] == 2 and first["fault"]["pod"] == 1
    hang = first["hang"]
    assert hang["culprits"] == [2]
    by_rank = {rank: s for s in hang["stacks"] for rank in s["ranks"]}
    assert sorted(by_rank) == [0, 1, 2, 3]
    assert by_rank[2]["ranks"] == [2], "the stopped rank's stack is alike no other"
    assert all(len(s["pids"]) == len(s["ranks"]) for s in hang["stacks"])
    assert by_rank[2]["state"] == "stopped"
    assert "train_ddp.py" in by_rank[2]["stack"]
    for rank in (0, 1, 3):
        assert by_rank[rank]["state"] != "stopped"
        assert "backward" in by_rank[rank]["stack"], by_rank[rank]
    assert hang["capture_s"] >= 0
    described = subprocess.run(
        [sys.executable, "-m", "relaunch", "describe", "ddp", "--state-dir", str(cluster.state)],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout  # fmt: skip
    assert "rank 2 stopped" in described and "<- culprit" in described
    figures = result.report["goodput"]
    lost = figures["lost_s"]
    assert figures["productive_s"] + sum(lost.values()) == pytest.approx(
        figures["wall_s"], abs=0.01
    )
    assert lost["startup"] > 0 and lost["recovery"] > 0 and lost["detection"] > 0
    assert 0 < figures["ettr"] < 1
    assert "goodput:" in described and "ETTR" in described


# -- goodput ------------------------------------------------------------------------------------


def adds_up(g: Goodput) -> bool:
    return abs(g.productive_s + sum(g.lost_s.values()) - g.wall_s) < 1e-9


def test_goodput_of_a_job_without_faults_is_its_time_after_startup() -> None:
    g = goodput(0.0, 100.0, [], [(10.0, 1), (50.0, 40), (100.0, 90)])
    assert g.lost_s["startup"] == 10.0 and g.productive_s == 90.0
    assert g.ettr == pytest.approx(0.9) and adds_up(g)


def test_goodput_splits_a_recovery_into_detection_recovery_and_recomputed_steps() -> None:
    progress = [(1.0, 1), (20.0, 20), (29.0, 29), (45.0, 21), (52.0, 29), (53.0, 30), (80.0, 57)]
    g = goodput(0.0, 80.0, [Recovery(fault_at=30.0, detected_at=32.0, resumed_at=40.0)], progress)
    assert g.lost_s["detection"] == 2.0
    assert g.lost_s["recovery"] == 8.0
    assert g.lost_s["recomputed"] == 13.0  # from 40 until step 30 > 29 at 53
    assert g.lost_s["startup"] == 1.0
    assert g.productive_s == 80.0 - 24.0 and adds_up(g)


def test_goodput_counts_overlapping_losses_once() -> None:
    """A second fault (at 12) during the first one's recovery (detected at 11): every instant is
    lost once, to the first cause in CAUSES order that covers it."""
    recoveries = [Recovery(10.0, 11.0, 13.0), Recovery(12.0, 13.0, 20.0)]
    g = goodput(0.0, 30.0, recoveries, [(0.5, 1), (9.0, 9), (25.0, 10)])
    assert g.lost_s["detection"] == pytest.approx(2.0)  # 10-11 and 12-13
    assert g.lost_s["recovery"] == pytest.approx(1.0 + 7.0)  # 11-12 and 13-20
    assert g.lost_s["recomputed"] == pytest.approx(5.0)  # 20 until step 10 > 9 at 25
    assert g.productive_s == pytest.approx(30.0 - 0.5 - 2.0 - 8.0 - 5.0) and adds_up(g)


def test_goodput_of_a_fault_never_recovered_is_lost_until_the_end() -> None:
    g = goodput(0.0, 30.0, [Recovery(10.0, 11.0, None)], [(1.0, 1)])
    assert g.lost_s["unrecovered"] == 19.0 and g.lost_s["detection"] == 1.0
    assert g.productive_s == 9.0 and adds_up(g)


def test_goodput_of_a_job_that_reports_no_steps_counts_only_its_faults() -> None:
    g = goodput(0.0, 50.0, [Recovery(20.0, 20.5, 25.0)], [])
    assert g.lost_s["startup"] == 0.0 and g.lost_s["recomputed"] == 0.0
    assert g.productive_s == pytest.approx(50.0 - 5.0) and adds_up(g)


def test_goodput_of_a_job_with_no_wall_time() -> None:
    g = goodput(5.0, 4.0, [], [])
    assert g.wall_s == 0.0 and g.ettr == 1.0 and adds_up(g)


# -- slow pods ----------------------------------------------------------------------------------


def test_the_pod_that_rarely_waits_is_slow() -> None:
    (found,) = slow_pods({0: 0.35, 1: 0.97, 2: 0.30}, margin=0.3)
    assert (found.pod, found.busy) == (1, 0.97) and found.peers == pytest.approx(0.325)
    assert "busy 97% of the window" in found.describe()


@pytest.mark.parametrize(
    "shares",
    [
        {0: 0.95, 1: 0.97, 2: 0.99},  # uniformly slow: nobody waits
        {0: 0.30, 1: 0.35, 2: 0.28},  # uniformly fast: everyone waits alike
        {0: 0.50, 1: 0.75},  # a difference below the margin
        {0: 0.99},  # no peers
        {},
    ],
    ids=["uniformly-slow", "uniformly-fast", "below-margin", "one-pod", "none"],
)
def test_no_slow_pod_without_an_outlier_among_waiting_peers(shares: dict[int, float]) -> None:
    assert slow_pods(shares, margin=0.3) == []


@pytest.mark.parametrize(
    "hang_s, replicas, window_s",
    [(10, 2, 2.0), (10, 2, 5.0), (1800, 2, 60.0), (4, 2, 3.0), (1800, 200, 30.0), (60, 8, 0.5)],
)
def test_a_slow_window_holds_twice_the_looks_a_share_needs_whatever_the_hang_window(
    hang_s: float, replicas: int, window_s: float
) -> None:
    for pod in (0, 1, replicas - 1):
        interval = progress_interval(hang_s, replicas, window_s, pod)
        assert window_s / interval >= 2 * MIN_LOOKS - 1e-9, (pod, interval)
        cap = 1.0 if pod == 0 else 5.0
        assert interval <= min(cap, hang_s / 20) or interval == 0.002 * replicas, (pod, interval)
    assert slow_window_unusable(hang_s, replicas, window_s) is None


def test_a_slow_window_off_leaves_the_progress_interval_to_the_hang_window() -> None:
    assert progress_interval(10, 2, 0) == 0.5
    assert progress_interval(10, 2, 0, pod=1) == 0.5
    assert progress_interval(1800, 2, 0) == 1.0
    assert progress_interval(1800, 2, 0, pod=1) == 5.0
    assert progress_interval(1800, 2, 60) == 1.0, "the default window costs pod 0 no wake-up"
    assert progress_interval(1800, 2, 60, pod=1) == 3.0, "the default window's looks"
    assert slow_window_unusable(10, 2, 0) is None


def test_a_slow_window_a_very_large_job_cannot_fill_is_said_with_the_window_that_works() -> None:
    """5000 pods: the launchers report every 10 s (0.002 s a pod, for the controller's sake), so
    a 60 s window holds 6 looks: the job is told, with the window that would hold 10."""
    assert progress_interval(1800, 5000, 60) == 10.0
    said = slow_window_unusable(1800, 5000, 60)
    assert said is not None
    assert "holds 6 looks, fewer than the 10" in said and "set slow_window_s to 100 s" in said
    assert slow_window_unusable(1800, 5000, 100) is None
    assert slow_window_unusable(10, 2, 0.15) is not None, "0.02 s is the shortest interval"


def test_a_slow_window_the_launchers_cannot_fill_is_said_when_the_job_starts(
    tmp_path: Path,
) -> None:
    cluster = Cluster(tmp_path)
    result = cluster.run(toy_job(steps=10), None, {**FAST_CLUSTER, "slow_window_s": 0.15})
    assert result.returncode == 0, result.stdout + result.stderr
    said = [e for e in result.events() if e.kind is EventKind.SETTING_UNUSABLE]
    assert [e.fields["setting"] for e in said] == ["slow_window_s"], said
    assert "set slow_window_s to 0.2 s or more" in said[0].fields["why"], said


SLOW_CLUSTER = {**DDP_CLUSTER, "slow_window_s": 3, "slow_margin": 0.3}


def slow_run(
    tmp_path: Path, nodes: int, steps: int, **cluster_and_hang: float
) -> tuple[Result, list[tuple[float, int]]]:
    """The DDP example, one rank per pod on 2 pods; pod 1 made 6 times slower at step 20.
    `hang_detect_seconds` goes to the job, the rest to SLOW_CLUSTER."""
    job = yaml.safe_load((ROOT / "examples" / "ddp" / "job.yaml").read_text())
    hang_s = cluster_and_hang.pop("hang_detect_seconds", None)
    if hang_s is not None:
        job["spec"]["hang_detect_seconds"] = hang_s
    job["spec"]["procs_per_pod"] = 1
    job["spec"]["command"] = (
        f"python {ROOT / 'examples' / 'ddp' / 'train_ddp.py'} --steps {steps} --ckpt-every 10"
    )
    plan = [{"kind": "slow", "at_step": 20, "pod": 1, "factor": 6}]
    cluster = Cluster(tmp_path)
    shape = {**SLOW_CLUSTER, "nodes": nodes, **cluster_and_hang}
    result = cluster.run(job, plan, shape, timeout=240, startup_s=60)
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(cluster.state / "relaunch.db")
    return result, store.progress(result.report["id"])


def rate(progress: list[tuple[float, int]], start: float, end: float) -> float:
    inside = [(at, step) for at, step in progress if start <= at <= end]
    assert len(inside) >= 2, (start, end, progress)
    (t0, s0), (t1, s1) = inside[0], inside[-1]
    return (s1 - s0) / (t1 - t0)


def test_a_slow_pod_moves_to_the_standby_node_and_the_step_rate_recovers(tmp_path: Path) -> None:
    result, progress = slow_run(tmp_path, nodes=3, steps=200)
    first = result.report["recoveries"][0]
    assert first["fault"]["kind"] == "slow" and first["fault"]["pod"] == 1, first
    assert first["action"] == "pod-reschedule" and first["outcome"] == "succeeded", first
    assert "busy" in first["fault"]["detail"]
    assert result.report["isolated_nodes"] == ["node-1"]
    pod1 = next(p for p in result.report["pods"] if p["index"] == 1)
    assert pod1["node"] == "node-2"
    slow_rate = rate(progress, first["fault_at"] + 1.0, first["detected_at"])
    after = rate(progress, first["resumed_at"] + 1.0, result.report["ended_at"])
    assert after > 2 * slow_rate, (slow_rate, after)
    assert result.report["goodput"]["lost_s"]["slow"] > 0


def test_a_slow_pod_without_a_standby_node_is_recorded_only(tmp_path: Path) -> None:
    """With a slow window (2 s) shorter than twenty progress intervals of the hang window
    (10 s: 0.5 s), the launchers look often enough for the window: before, it held 4 looks of
    the 10 a share needs and the slow pod was never found."""
    result, _ = slow_run(tmp_path, nodes=2, steps=150, slow_window_s=2, hang_detect_seconds=10)
    records = result.report["recoveries"]
    # Pod 1 is the one the plan slows. Another pod may be recorded slow too, never acted on:
    # seen once in CI, pod 0's link probes took 6 ms against 0.4 ms while both ranks imported
    # torch on the two cores, before the first step (the link check does not yet wait for a
    # start's load to pass, as the busy shares do).
    assert all(r["fault"]["kind"] == "slow" and r["action"] == "ignore" for r in records), records
    (record,) = [r for r in records if r["fault"]["pod"] == 1]
    assert "no standby node" in record["reason"]
    assert result.report["restarts_used"] == 0 and result.report["isolated_nodes"] == []
    assert [p["generation"] for p in result.report["pods"]] == [1, 1]


def test_a_rank_keeps_its_looks_back_to_the_window_start_only() -> None:
    rank = Rank(attempt=1)
    for i in range(100):  # a report every 0.1 s: 10 looks each, 7 busy from t = 5
        rank.looked(i * 0.1, 7 * max(0, i - 50), 10 * i, window_s=3.0)
    assert len(rank.busy) <= 32, "not every report since the start"
    share = rank.busy_share(9.9 - 3.0)
    assert share is not None and share[0] == pytest.approx(0.7) and share[1] == 300
    assert rank.busy_share(-1.0) is None, "the reports do not reach back that far"
