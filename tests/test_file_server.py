"""The peer-memory benchmark's shared storage (relaunch_bench.file_server): what it says where it
cannot be had, and a mount that cannot reach its server. Its working path, a restore across the
data link from a storage node, is measured by the quick benchmark (tests/test_bench.py)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import psutil
import pytest

from relaunch_bench import file_server


def test_without_its_tools_the_shared_storage_names_each_package_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(file_server, "SSHD", tmp_path / "no-sshd")
    monkeypatch.setenv("PATH", str(tmp_path))
    why = file_server.unavailable()
    assert why is not None
    for package in ("openssh-server", "sshfs", "fuse3"):
        assert package in why, why


def test_a_mount_whose_server_does_not_answer_says_why_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    why = file_server.unavailable()
    if why is not None or os.geteuid() != 0:
        pytest.skip(f"needs root and sshfs (`make test` installs it as root): {why or 'not root'}")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the mount point is made
    # no server of ours there: refused, or a machine's own sshd that does not know the key
    nobody = file_server.FileServer("127.0.0.1", tmp_path / "no-key")
    with (
        pytest.raises(RuntimeError, match=r"sshfs could not mount the shared storage: \S"),
        file_server.mounted(nobody, tmp_path),
    ):
        pytest.fail("mounted a server that is not there")
    assert not list(tmp_path.glob("relaunch-storage-*")), "the mount point was left"
    left = [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path) in " ".join(p.info["cmdline"] or [])
    ]
    assert not left, left
