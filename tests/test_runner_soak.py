"""The runner of queued jobs over many jobs: what a job opened is closed when it ends."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import psutil

from relaunch import service
from relaunch.store import JobStatus, Store
from tests.runtime import FAST_CLUSTER, ROOT, kill_all, toy_job, wait_gone

JOBS = 12
FD_LIMIT = 64
"""Well under what a runner needs if each job leaked its agents' pidfds (4 a job)."""


def _limit_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def test_a_soak_of_queued_jobs_keeps_the_runners_descriptors_and_memory_flat(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    store = Store(state / "relaunch.db")
    job = toy_job(steps=3, replicas=1)
    job["spec"]["procs_per_pod"] = 1
    cluster = {**FAST_CLUSTER, "nodes": 2}
    for _ in range(JOBS):
        submission = service.Submission(raw=job, source="soak", cwd=str(ROOT), cluster=cluster)
        service.submit(store, submission, time.time())
    runner = subprocess.Popen(
        [sys.executable, "-m", "relaunch", "runner", "--state-dir", str(state)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_limit_descriptors,
    )
    process = psutil.Process(runner.pid)
    looks: dict[int, tuple[int, int]] = {}  # jobs ended -> (descriptors, resident bytes)
    try:
        deadline = time.monotonic() + 240
        while runner.poll() is None:
            assert time.monotonic() < deadline, f"the runner ran {len(looks)} jobs in 240 s"
            ended = sum(1 for j in store.jobs() if j.status.ended)
            if ended not in looks and ended:
                looks[ended] = (
                    len(os.listdir(f"/proc/{runner.pid}/fd")),
                    process.memory_info().rss,
                )
            time.sleep(0.05)
    finally:
        runner.kill()
        runner.wait()
        kill_all(state)
    statuses = [j.status for j in store.jobs()]
    assert statuses == [JobStatus.SUCCEEDED] * JOBS, statuses  # before: "Too many open files"
    # A look is taken as a job ends, when the next may already be opening its own: one look
    # can catch a moment's descriptors. A leak grows with every job, so the fewest the last
    # jobs left must not exceed the most the first ones did.
    early = [looks[n] for n in sorted(looks) if 2 <= n <= 4]
    late = [looks[n] for n in sorted(looks) if n > JOBS - 4]
    assert early and late, looks
    fds = min(f for f, _ in late), max(f for f, _ in early)
    assert fds[0] <= fds[1], f"descriptors grew from {fds[1]} to {fds[0]}: {looks}"
    grown = min(m for _, m in late) - max(m for _, m in early)
    assert grown < 24 << 20, f"memory grew {grown >> 20} MiB: {looks}"
    assert not wait_gone(state, timeout=5)
