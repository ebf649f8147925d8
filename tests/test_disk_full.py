"""The state directory's disk fills up while a job runs: said as such, the record kept, resumed.

Needs root, to mount a small tmpfs that the test can fill (skipped, saying so, without)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.runtime import ROOT, UNCONDITIONAL, Cluster, kill_all, toy_job, wait_gone
from tests.test_runtime_robustness import query


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a 64 MB tmpfs to fill")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        kill_all(disk / "state")
        subprocess.run(["umount", "-l", str(disk)], check=False)


def ended(run: subprocess.Popen[str]) -> tuple[str, str]:
    """What a run said, once it is ended (killed if it still runs): a failing check never waits
    on a run that does not end."""
    run.kill()
    return run.communicate(timeout=30)


def fill(disk: Path) -> Path:
    """Fill the disk to its last byte; the file that did it."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as out:
        for size in (1 << 20, 4096, 64):
            with contextlib.suppress(OSError):
                while True:
                    out.write(b"\0" * size)
    return filler


def test_a_full_disk_is_said_the_record_kept_and_resume_carries_on(small_disk: Path) -> None:
    cluster = Cluster(small_disk)
    job = toy_job(UNCONDITIONAL, steps=100000, **{"hang_detect_seconds": 30})
    run = subprocess.Popen(
        cluster.command(job), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while not query(cluster.state, "SELECT 1 FROM jobs WHERE last_step >= 5"):
        assert run.poll() is None and time.monotonic() < deadline, ended(run)
        time.sleep(0.05)
    filler = fill(small_disk)
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == 75, stderr  # before: 2, "not a usable relaunch state database"
    assert "is full" in stderr and "--resume" in stderr, stderr
    assert "move it away" not in stderr
    filler.unlink()
    before = query(cluster.state, "SELECT last_step FROM jobs WHERE id = 1")[0][0]
    resumed = subprocess.Popen(
        cluster.resume_command(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 90
    while not query(
        cluster.state, f"SELECT 1 FROM jobs WHERE id = 1 AND last_step >= {before + 10}"
    ):
        assert resumed.poll() is None and time.monotonic() < deadline, ended(resumed)
        time.sleep(0.05)
    resumed.terminate()  # it trains on: the job carried on from its record
    resumed.communicate(timeout=60)
    assert resumed.returncode == 143
    assert not wait_gone(cluster.state, timeout=10)
