"""Fixtures shared by the runtime tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.runtime import DDP_CLUSTER, Cluster, ddp_job, kill_all, wait_gone


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A state directory for one run; afterwards, no process of it may be left (no orphans)."""
    c = Cluster(tmp_path)
    yield c
    left = wait_gone(c.state, timeout=5)
    kill_all(c.state)
    assert not left, f"processes outlived the run: {[p.pid for p in left]}"


@pytest.fixture(scope="session")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The SHA-256 of the DDP example's parameters after a fault-free run (embedded cluster)."""
    tmp = tmp_path_factory.mktemp("unbroken")
    result = Cluster(tmp).run(
        ddp_job(tmp / "hash.txt", 10), None, DDP_CLUSTER, timeout=240, startup_s=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.report["recoveries"] == []
    return (tmp / "hash.txt").read_text().strip()
