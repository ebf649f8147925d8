"""R-25 in a harsh world: a rank that is slow, saving or starved is not hung (pure detectors, and
the launcher's look at a real process)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from relaunch.controller.detectors import active_at, hang_fault, rank_active
from relaunch.controller.peers import LauncherLink, Rank
from relaunch.diagnosis import Frame, RankStack, culprits, in_rendezvous
from relaunch.events import EventKind
from relaunch.launcher.processes import NotStarted, Worker, sample_busy
from relaunch.protocol.datagrams import SdkPhase
from relaunch.protocol.messages import Output
from tests.controller_sim import Sim, job_spec, waiting_stack
from tests.runtime import AUTO, Cluster, asleep, toy_job, wait_status

HANG_S, STARTUP_S = 4.0, 30.0


class _Peer:
    closed = False

    def send(self, message: object) -> bool:
        return True


def _links(*ranks: Rank) -> list[LauncherLink]:
    link = LauncherLink(_Peer(), 0, 1, 100)  # type: ignore[arg-type]
    link.ranks = dict(enumerate(ranks))
    return [link]


def _hung(links: list[LauncherLink], now: float) -> int | None:
    found = hang_fault(links, 1, now, HANG_S, STARTUP_S, lambda _: False, lambda _, at: at)
    return None if found is None else found.fault.rank


def test_r25_a_rank_saving_a_checkpoint_is_not_hung_nor_are_the_peers_that_wait_for_it() -> None:
    """The replacement sat in the checkpoint's fsync on a busy disk for longer than the hang
    window while its peers waited in the all-reduce: before, the job was declared hung."""
    saving = Rank(1, last_activity=100.0, progressed=True, phase=SdkPhase.CHECKPOINT)
    saving.phase_since = 100.0
    waiting = Rank(1, last_activity=100.0, progressed=True)
    links = _links(waiting, saving)
    assert _hung(links, 100.0 + 3 * HANG_S) is None
    # a save counts for the startup allowance at most: one that never ends is a hang
    assert _hung(links, 100.0 + STARTUP_S + 1) == 0
    saving.phase, saving.save_ended_at = SdkPhase.TRAINING, 110.0  # the save ended at 110
    assert _hung(links, 110.0 + HANG_S - 0.5) is None, "rank 0 waited for it until then"
    assert _hung(links, 110.0 + HANG_S + 0.5) == 0, "then both fell silent"


def test_r25_a_rank_waiting_in_its_rendezvous_for_peers_still_starting_is_not_hung() -> None:
    """Warm spares on three nodes: ten processes imported torch on two cores. Ranks 1 and 3
    printed their first line and sat in their group's rendezvous while ranks 0 and 2 were still
    importing; the first line had ended rank 3's startup allowance, and it was declared hung
    after the 4 s hang window (CI, d8ce823). Building its group is part of a rank's start."""
    importing = Rank(1, last_activity=100.0)
    forming = Rank(1, last_activity=100.0, progressed=True, phase=SdkPhase.GROUP)
    forming.phase_since = 100.0
    links = _links(importing, forming)
    assert _hung(links, 100.0 + 3 * HANG_S) is None
    assert _hung(links, 100.0 + STARTUP_S + 1) is not None, "a rendezvous never met is a hang"
    formed = Rank(1, last_activity=100.0, progressed=True, phase=SdkPhase.TRAINING)
    formed.phase_since = 100.0
    assert _hung(_links(importing, formed), 100.0 + HANG_S + 0.5) == 1, "then the window"
    stopped = Rank(1, last_activity=100.0, progressed=True, phase=SdkPhase.GROUP)
    stopped.phase_since, stopped.stopped_at = 100.0, 100.8  # SIGSTOPped in its rendezvous
    assert _hung(_links(importing, stopped), 100.0 + HANG_S + 0.5) == 1


def test_r25_a_rank_stopped_in_its_save_is_hung_after_the_hang_window() -> None:
    """A rank SIGSTOPped while it said it saved a checkpoint (its launcher found it stopped) was
    taken for saving for the whole startup allowance (120 s in the bench): its peers' SDK gave up
    first (their collective's timeout, then the wait for a new group) and the job failed, its
    saver's phase holding every process level back (R-37)."""
    stopped = Rank(1, last_activity=100.0, progressed=True, phase=SdkPhase.CHECKPOINT)
    stopped.phase_since, stopped.stopped_at = 100.0, 100.8
    waiting = Rank(1, last_activity=100.0, progressed=True)
    links = _links(waiting, stopped)
    assert not stopped.saving
    assert _hung(links, 100.0 + HANG_S - 0.5) is None
    assert _hung(links, 100.0 + HANG_S + 0.5) is not None, "not before the startup allowance"
    resumed = Rank(1, last_activity=100.0, progressed=True, phase=SdkPhase.CHECKPOINT)
    resumed.phase_since, resumed.stopped_at = 100.0, 99.0  # stopped before this save began
    assert resumed.saving and _hung(_links(waiting, resumed), 100.0 + 3 * HANG_S) is None


def test_r25_a_rank_found_stopped_worked_no_later_than_the_sample_before() -> None:
    """SIGSTOPped just after its step at 100.0: the next usage sample (at 100.9) still counts
    looks that found it working before the stop, and also stopped ones. Before, that work was
    taken for life at 100.9, and the hang was found 0.9 s late (the bench: 5.05 s for a 4 s
    window); now it is placed at the previous sample, and the step's time stands."""
    rank = Rank(1, last_activity=100.0, progressed=True, usage=(99.9, 5.0, 0))
    assert active_at(rank, cpu=5.09, io=0, working=8, stopped=2, now=100.9) == 99.9
    assert active_at(rank, cpu=5.09, io=0, working=8, stopped=0, now=100.9) == 100.9
    assert active_at(rank, cpu=5.0, io=0, working=0, stopped=10, now=100.9) is None
    unsampled = Rank(1, last_activity=100.0, progressed=True)  # no sample before: no time
    assert active_at(unsampled, cpu=5.09, io=0, working=8, stopped=2, now=100.9) is None
    link = _links(rank)
    rank.last_activity = max(rank.last_activity, 99.9)
    assert _hung(link, 100.0 + HANG_S + 0.05) == 0, "found at the window, not a sample later"


def test_r25_io_counts_as_progress_for_a_job_that_reports_steps() -> None:
    """A rank writing a checkpoint does I/O and little CPU; before, I/O counted only for
    scripts that report no steps."""
    writing = Rank(1, last_activity=5.0, usage=(10.0, 1.0, 1000))
    assert rank_active(writing, cpu=1.0, io=5000, now=20.0)
    assert not rank_active(writing, cpu=1.0, io=1000, now=20.0)


def test_r25_the_launcher_sees_a_rank_working_not_a_stopped_one(tmp_path: Path) -> None:
    """A look at a rank's main thread: running (or runnable, starved of CPU) and disk waits
    count as work; a stopped rank (SIGSTOP, a real hang) and a sleeping one do not."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        workers = {
            name: Worker(0, 0, 1, proc, None) for name, proc in (("spin", spin), ("sleep", sleeper))
        }
        asleep(sleeper.pid)
        for _ in range(20):
            for worker in workers.values():
                sample_busy(worker)
            time.sleep(0.01)
        assert workers["spin"].working >= 15 and workers["sleep"].working == 0
        os.kill(spin.pid, 19)  # SIGSTOP: busy for the slow-pod detector, not working
        wait_status(spin.pid, psutil.STATUS_STOPPED)
        before = workers["spin"].working
        for _ in range(10):
            sample_busy(workers["spin"])
        assert workers["spin"].working == before
        assert workers["spin"].busy >= before + 10
    finally:
        for proc in (spin, sleeper):
            proc.kill()
            proc.wait()
    assert Worker(0, 0, 1, NotStarted(127), None).working == 0


SLOW_SAVE = """
import os, sys, time
import torch, torch.distributed as dist
from relaunch.train import CheckpointManager, report_progress

dist.init_process_group("gloo")
rank = dist.get_rank()
ckpt = CheckpointManager(os.environ["RELAUNCH_SHARED_DIR"] + "/ckpt", every=10, keep=2)

def state():  # rank 1 saves on a busy disk: its save outlasts the hang window three times
    if rank == 1:
        time.sleep(3 * float(sys.argv[1]))
    return {"step": step, "w": torch.zeros(4)}

for step in range(1, 21):
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here, silent, while rank 1 saves
    report_progress(step)
    ckpt.maybe_save(step, state)
    time.sleep(0.02)
dist.destroy_process_group()
"""


def test_r25_a_save_longer_than_the_hang_window_is_no_hang_end_to_end(cluster: Cluster) -> None:
    """Written from the docs: a DDP-style gloo job whose rank 1 takes three hang windows to
    save at step 10 while rank 0 waits for it in an all-reduce. Before: declared hung (the
    silent rank 0 the culprit) and, without hang-retry, failed."""
    hang_s = 2.0
    job = toy_job(AUTO, replicas=2, hang_detect_seconds=hang_s)
    job["spec"]["procs_per_pod"] = 1
    job["spec"]["command"] = [sys.executable, "-c", SLOW_SAVE, str(hang_s)]
    result = cluster.run(job, timeout=180, startup_s=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.report["recoveries"] == []


def rendezvous_stack(rank: int, state: str = "sleeping") -> RankStack:
    """As py-spy reads a rank that waits in `init_process_group` for its store's peers."""
    frames = (
        Frame("_create_c10d_store", "site-packages/torch/distributed/rendezvous.py", 199),
        Frame("_env_rendezvous_handler", "site-packages/torch/distributed/rendezvous.py", 280),
        Frame("init_process_group", "site-packages/torch/distributed/distributed_c10d.py", 1892),
        Frame("<module>", "<string>", 6),
    )
    return RankStack(rank, 5000 + rank, state, frames, "\n".join(map(str, frames)))


def test_r25_a_stack_in_init_process_group_is_a_rendezvous_and_only_torchs_counts() -> None:
    assert in_rendezvous(rendezvous_stack(0).frames)
    assert not in_rendezvous(waiting_stack(0).frames)
    assert not in_rendezvous((Frame("init_process_group", "my_launcher.py", 3),))
    forming = culprits([rendezvous_stack(0), rendezvous_stack(1, "running")])
    assert forming.forming and forming.culprits == ()
    mixed = culprits([rendezvous_stack(0), waiting_stack(1)])
    assert not mixed.forming
    stopped = culprits([rendezvous_stack(0), rendezvous_stack(1, "stopped")])
    assert stopped.culprits == (1,) and not stopped.forming
    unread = culprits([rendezvous_stack(0), RankStack(1, 5001, "sleeping", error="py-spy: gone")])
    assert not unread.forming, "a rank whose stack is unknown may be anywhere"


def _printed_then_silent(tmp_path: Path, stack: Callable[[int], RankStack]) -> Sim:
    """A job whose ranks each print a line (a c10d warning as the store's client retries) and
    then wait, silent, where `stack` says, before any step."""
    sim = Sim(tmp_path, job_spec({**AUTO, "fault-tolerance/hang-retry": "true"}), nodes=4)
    sim.boot()
    sim.tick()
    c = sim.controller
    for rank in range(4):
        sim.stacks[rank] = stack(rank)
        c.receive(sim.link_peer(rank // 2), Output(rank, c.job.attempt, "[W socket.cpp] retry"))
    return sim


def test_r25_ranks_read_in_their_rendezvous_after_a_line_are_in_their_startup_not_hung(
    tmp_path: Path,
) -> None:
    """Before: a rank that printed a line (ending its startup allowance) and then waited in
    init_process_group for a peer still importing torch was hung after the hang window (CI,
    under load). Its stack says it builds its group: no hang until the startup allowance runs
    out, and then one (a rendezvous that never completes is a hang)."""
    sim = _printed_then_silent(tmp_path, rendezvous_stack)
    hang_s, startup_s = 2.0, 10.0  # the sim's job
    sim.run(hang_s + sim.cluster.stack_capture_s + 1.0)
    assert sim.records() == [] and sim.said(EventKind.HANG_FORMING)
    sim.run(startup_s - sim.cluster.stack_capture_s - 2.0)
    assert sim.records() == [], "within the startup allowance"
    sim.run(sim.cluster.stack_capture_s + 3.0)
    (record,) = sim.records()
    assert record.fault.kind.value == "hang" and len(sim.said(EventKind.HANG_FORMING)) == 1


def test_r25_ranks_read_in_a_collective_after_a_line_are_hung_after_the_hang_window(
    tmp_path: Path,
) -> None:
    sim = _printed_then_silent(tmp_path, waiting_stack)
    sim.run(2.0 + sim.cluster.stack_capture_s + 1.0)
    (record,) = sim.records()
    assert record.fault.kind.value == "hang" and not sim.said(EventKind.HANG_FORMING)
