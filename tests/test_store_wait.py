"""A rank that relaunch starts (a warm spare, a rank forked from the pod's template) and that
meets its group at rank 0's store waits for that store to listen before its script runs: torch's
TCPStore client that comes first backs off for a third of a second or more (relaunch._rendezvous,
issue 75). Real sockets and a real spare process."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from relaunch._rendezvous import before_script, wait_for_store
from relaunch.protocol.environment import Env
from tests.runtime import ready_spare


@pytest.fixture
def store() -> Iterator[socket.socket]:
    """A listening socket standing for rank 0's store; accept() without waiting."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    yield listener
    listener.close()


def _connected(listener: socket.socket) -> bool:
    """Whether a connection is waiting to be accepted (the kernel completed its handshake)."""
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def _env(listener: socket.socket, **more: str) -> dict[str, str]:
    host, port = listener.getsockname()
    return {Env.MASTER_ADDR: host, Env.MASTER_PORT: str(port), Env.STORE_WAIT: "30", **more}


def test_only_a_rank_that_meets_rank_0s_store_as_a_client_waits_for_it(
    store: socket.socket,
) -> None:
    """Rank 0 hosts the store, a process-level job meets at its membership's store, a job with
    an agent store has every rank a client of a store that was there first: none of them looks.
    Any other rank does, once, and is back as soon as it connected."""
    for env in (
        _env(store, **{Env.RANK: "0"}),
        _env(store, **{Env.RANK: "1", Env.MEMBERSHIP: "/tmp/membership.json"}),
        _env(store, **{Env.RANK: "1", Env.USE_AGENT_STORE: "True"}),
        _env(store, **{Env.RANK: "1", Env.STORE_WAIT: "0"}),
    ):
        before_script(env)
        assert not _connected(store), env
    before_script(_env(store, **{Env.RANK: "1", Env.USE_AGENT_STORE: "False"}))
    assert _connected(store)
    assert not _connected(store), "one connection, closed at once"


def test_the_wait_is_bounded_where_nothing_ever_listens() -> None:
    """A script that meets its group elsewhere: the rank goes on past the bound."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, never listening: a connection is refused
        assert wait_for_store("127.0.0.1", taken.getsockname()[1], 0.05) is False


def test_a_warm_spare_handed_rank_1_runs_its_script_once_rank_0s_store_listens(
    tmp_path: Path,
) -> None:
    """The spare is handed rank 1 while nothing listens at MASTER_PORT: its script does not
    run; once the store listens, the spare connected to it, then ran the script."""
    with socket.socket() as hold:
        hold.bind(("127.0.0.1", 0))  # a port of our own, not listening yet
        port = hold.getsockname()[1]
        script = tmp_path / "rank.py"
        began = tmp_path / "began"
        script.write_text(f"import pathlib\npathlib.Path({str(began)!r}).write_text('yes')\n")
        env = {
            **os.environ, Env.SPARE_PRELOAD: "", Env.RANK: "1", Env.MASTER_ADDR: "127.0.0.1",
            Env.MASTER_PORT: str(port), Env.STORE_WAIT: "120",
        }  # fmt: skip
        spare = ready_spare(env)
        try:
            assert spare.stdin is not None
            identity = {"env": env, "argv": [str(script)], "cwd": str(tmp_path), "log": ""}
            spare.stdin.write((json.dumps(identity) + "\n").encode())
            spare.stdin.flush()
            for _ in range(20):  # a second in which the script would have run long since
                assert spare.poll() is None and not began.exists(), "ran before the store"
                time.sleep(0.05)
            hold.listen()
            assert spare.wait(timeout=60) == 0
            assert began.read_text() == "yes"
            hold.setblocking(False)
            assert _connected(hold), "the spare connected to the store before its script ran"
        finally:
            spare.kill()
            spare.wait()
