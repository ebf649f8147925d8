"""What reaches the operator's terminal: a rank's bytes shown safely, a hangup stops in order."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from relaunch.cli.common import visible
from tests.runtime import AUTO, ROOT, Cluster, toy_job, wait_gone
from tests.test_runtime_robustness import start_and_wait

HOSTILE = (
    b"\xff\xfe not UTF-8 \xc3\x28"  # invalid bytes
    b" \x1b]0;owned title\x07"  # OSC: the terminal's title
    b" \x1b[2J\x1b[H"  # a clear screen, the cursor home
    b" \x1b]52;c;aGk=\x07"  # OSC 52: write the clipboard
    b" \x9b31m C1 CSI"
)
"""What a rank may print: bytes that are not UTF-8 and escape sequences."""

PRINTS_AND_FAILS = (
    "import sys\n"
    "from relaunch.train import report_progress\n"
    "report_progress(1)\n"
    f"sys.stdout.buffer.write({HOSTILE!r} + b'\\n'); sys.stdout.flush()\n"
    f"raise RuntimeError({HOSTILE.decode('utf-8', 'replace')!r})\n"
)


def relaunch(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "relaunch", *args], cwd=ROOT, capture_output=True, timeout=60
    )


def test_visible_writes_out_every_control_character_and_keeps_lines() -> None:
    assert visible("a\tb\nc") == "a\tb\nc"
    assert visible("\x1b[2J\x07\r\x08\x9b\x7f") == "\\x1b[2J\\x07\\x0d\\x08\\x9b\\x7f"


def test_logs_and_describe_show_a_ranks_bytes_safely(cluster: Cluster) -> None:
    job = toy_job(replicas=1)
    job["spec"]["procs_per_pod"] = 1
    job["spec"]["command"] = [sys.executable, "-c", PRINTS_AND_FAILS]
    result = cluster.run(job)
    assert result.returncode == 1, result.stdout + result.stderr
    state = str(cluster.state)
    logs = relaunch("logs", "e2e", "--state-dir", state)
    assert logs.returncode == 0, logs.stderr  # before: a UnicodeDecodeError traceback
    shown = logs.stdout.decode()
    assert "not UTF-8 \ufffd(" in shown and "\\x1b]0;owned title\\x07" in shown
    assert b"\x1b" not in logs.stdout and b"\x07" not in logs.stdout
    raw = relaunch("logs", "e2e", "--state-dir", state, "--raw")
    assert HOSTILE in raw.stdout  # the bytes as written, for who asks
    describe = relaunch("describe", "e2e", "--state-dir", state)
    assert describe.returncode == 0, describe.stderr
    assert b"owned title" in describe.stdout, "the root cause is shown"
    assert b"\x1b]" not in describe.stdout and b"\x07" not in describe.stdout
    assert b"\x1b[2J" not in describe.stdout
    assert b"\x1b" not in result.stdout.encode(), "the run's own echo is safe too"


def test_a_hangup_stops_the_job_in_order_and_exits_129(cluster: Cluster) -> None:
    proc = start_and_wait(cluster, toy_job(AUTO, steps=400), step=5)
    proc.send_signal(signal.SIGHUP)
    proc.communicate(timeout=30)
    assert proc.returncode == 129  # before: killed by the signal, the job left Running
    report = json.loads((cluster.dir / "report.json").read_text())
    assert report["status"] == "Stopped" and "SIGHUP" in report["reason"]
    assert not wait_gone(Path(cluster.state), timeout=5)


def test_a_job_its_terminals_hangup_stopped_is_carried_on_by_resume(cluster: Cluster) -> None:
    """Issue 49: a closed terminal is an accident, not a decision. The run it stopped (129)
    is carried on by `relaunch run --resume` from its checkpoints, as after an outage of
    relaunch's own: no restart spent, the steps done kept. Before: --resume answered exit 2
    ("an unfinished job")."""
    proc = start_and_wait(cluster, toy_job(AUTO, steps=120), step=20)
    proc.send_signal(signal.SIGHUP)
    proc.communicate(timeout=30)
    assert proc.returncode == 129
    stopped = json.loads((cluster.dir / "report.json").read_text())
    assert stopped["status"] == "Stopped" and stopped["last_step"] >= 20
    result = cluster.resume()
    assert result.returncode == 0, result.stdout + result.stderr
    report = result.report
    assert report["status"] == "Succeeded" and report["last_step"] == 120
    [record] = report["recoveries"]
    assert record["fault"]["kind"] == "controller-outage" and "SIGHUP" in record["fault"]["detail"]
    assert record["action"] == "job-reschedule" and record["consumed_budget"] == []
    assert report["restarts_used"] == 0
    first = relaunch("logs", "e2e", "--pod", "0", "--rank", "0", "--state-dir", str(cluster.state))
    starts = [line for line in first.stdout.decode().splitlines() if "resume_step=" in line]
    assert starts and not starts[-1].endswith("resume_step=0"), starts  # from its checkpoint
    assert not wait_gone(Path(cluster.state), timeout=5)
