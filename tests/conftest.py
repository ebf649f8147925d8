"""Fixtures shared by the runtime tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.runtime import Cluster, kill_all, wait_gone


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A state directory for one run; afterwards, no process of it may be left (no orphans)."""
    c = Cluster(tmp_path)
    yield c
    left = wait_gone(c.state, timeout=5)
    kill_all(c.state)
    assert not left, f"processes outlived the run: {[p.pid for p in left]}"
