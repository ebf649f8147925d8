"""A root cause as large as a rank can make it: what is kept is capped and says what was cut."""

from __future__ import annotations

import fcntl
import json
import socket
import subprocess
import sys
import termios
import time

import pytest

from relaunch.diagnosis.errors import (
    MESSAGE_AT_MOST,
    TRACEBACK_AT_MOST,
    capped,
    error_from_file,
    error_from_large_file,
    error_from_output,
)
from relaunch.faults import ErrorReport
from relaunch.protocol.messages import Output, encode
from relaunch.protocol.wire import Connection
from tests.runtime import ROOT, Cluster, toy_job

HUGE = 20 << 20

RAISES_HUGE = (
    "import json, os, sys\n"
    "from relaunch.train import report_progress\n"
    "report_progress(1)\n"
    "body = 'x' * {size}\n"
    "frames = ''.join(f'  File \"f{{i}}.py\", line {{i}}, in f{{i}}\\n' for i in range(20000))\n"
    "error = {{'message': {{'message': 'ValueError: ' + body + ' END',\n"
    "                      'extraInfo': {{'py_callstack': 'Traceback (most recent call last):\\n'\n"
    "                                     + frames + 'ValueError: ' + body}}}}}}\n"
    "open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w').write(json.dumps(error))\n"
    "print('ValueError: ' + body[: 2 << 20], flush=True)\n"
    "sys.exit(1)\n"
)


def test_a_huge_message_and_traceback_are_cut_keeping_both_ends() -> None:
    report = ErrorReport(
        "ValueError", "a" * 100 + "b" * HUGE + "z" * 100, "T\n" + "f\n" * HUGE, 1.0, "x"
    )
    kept = capped(report)
    assert (
        len(kept.message) < MESSAGE_AT_MOST + 100 and len(kept.traceback) < TRACEBACK_AT_MOST + 100
    )
    assert kept.message.startswith("a" * 100) and kept.message.endswith("z" * 100)
    assert f"{HUGE + 200 - MESSAGE_AT_MOST:,} characters cut" in kept.message
    assert kept.traceback.startswith("T\n") and "characters cut" in kept.traceback
    small = ErrorReport("E", "m", "t", 1.0, "x")
    assert capped(small) is small


def test_every_reader_of_a_ranks_error_caps_it() -> None:
    body = "y" * HUGE
    from_file = error_from_file({"message": f"RuntimeError: {body}"}, 1.0)
    assert from_file is not None and len(from_file.message) < MESSAGE_AT_MOST + 100
    from_output = error_from_output([(1.0, f"RuntimeError: {body}")])
    assert from_output is not None and len(from_output.message) < MESSAGE_AT_MOST + 100
    head = json.dumps({"message": {"message": "KeyError: caf\u00e9 " + body}})[: 64 << 10]
    large = error_from_large_file(head, 123456789, 1.0)
    assert large.type == "KeyError" and large.message.startswith("caf\u00e9 yyy")
    assert "the error file was 123,456,789 bytes" in large.message
    cut_escape = error_from_large_file('{"message": "OSError: bad \\u00', 10**9, 1.0)
    assert cut_escape.type == "OSError" and cut_escape.message.startswith("bad ")


def _waiting(sock: socket.socket) -> int:
    """Bytes in the socket's receive buffer (FIONREAD)."""
    return int.from_bytes(fcntl.ioctl(sock, termios.FIONREAD, b"\0\0\0\0"), "little")


def test_a_message_larger_than_one_receive_is_read_in_one_read() -> None:
    """Before, each read took 64 KB: a large message waited for one of the controller's passes
    per 64 KB while the other peers' messages waited behind it."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        theirs = socket.create_connection(server.getsockname())
        ours, _ = server.accept()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    reader, writer = Connection(ours), Connection(theirs)
    big = Output(0, 1, "z" * (600 << 10))
    assert writer.send(big) and writer.send(Output(0, 1, "next"))  # all of it is in flight
    sent = len(encode(big)) + len(encode(Output(0, 1, "next"))) + 2  # and their newlines
    deadline = time.monotonic() + 30
    while _waiting(ours) < sent:  # all of it in our receive buffer, however slow the machine
        assert time.monotonic() < deadline, (_waiting(ours), sent)
        time.sleep(0.01)
    assert reader.read_ready() == [big, Output(0, 1, "next")]
    reader.close()
    writer.close()


@pytest.mark.parametrize("size", [2 << 20, HUGE], ids=["2MB-parsed", "20MB-start-only"])
def test_a_huge_root_cause_is_kept_capped_everywhere_it_is_shown(
    cluster: Cluster, size: int
) -> None:
    job = toy_job(replicas=1)
    job["spec"]["procs_per_pod"] = 1
    job["spec"]["command"] = [sys.executable, "-c", RAISES_HUGE.format(size=size)]
    result = cluster.run(job, timeout=120)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    [record] = result.report["recoveries"] or [None]
    error = record["fault"]["error"]
    assert error["type"] == "ValueError" and error["message"].startswith("xxx")
    if size == HUGE:  # its error file (40 MB) is not parsed whole: its start says enough
        assert "only its start was read" in error["message"]
    else:
        assert error["message"].endswith(" END") and "characters cut" in error["message"]
        assert "characters cut" in error["traceback"]
    assert len(json.dumps(result.report)) < 64 << 10  # before: the whole message, each view
    describe = subprocess.run(
        [sys.executable, "-m", "relaunch", "describe", "e2e", "--state-dir", str(cluster.state)],
        cwd=ROOT, capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    assert describe.returncode == 0 and len(describe.stdout) < 64 << 10
