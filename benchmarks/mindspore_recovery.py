"""A MindSpore job's crash and lost node under relaunch, beside msrun, in one run.

The SDK example (examples/frameworks/mindspore_sdk.py, the hand-written loop: it reports its
steps, so both sides time the same thing) trains on two workers. Each fault is timed from the
moment it strikes to the first step trained again:

- msrun (--join=True): a worker killed (the crash) or stopped (SIGSTOP: its node gone silent
  while it keeps its sockets); msrun notices when MindSpore's workers do, kills the rest and
  exits; the user's rerun, started the moment msrun exits (no human in the loop: msrun's best
  case), then trains again from the script's checkpoints.
- relaunch: the same faults from a fault plan (`process-exit` of rank 1, `node-down` of pod
  1's node), each recovered on its own; the report's MTTR is the same span (fault to the first
  step reported again).

Run: .mindspore/bin/python benchmarks/mindspore_recovery.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCRIPT = ROOT / "examples" / "frameworks" / "mindspore_sdk.py"
API = ("--api", "loop", "--min-step-seconds", "0.05")
NOTICE_AT_MOST_S = 300.0
"""How long msrun is given to notice a fault before it is said not to (and killed)."""
STRIKE_AT_STEP = 100
"""msrun's fault strikes once rank 0 printed this step (its checkpoints at 20, 40, ...)."""


def environment() -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


def wait_for_line(log: Path, prefix: str, since: int = 0, timeout: float = 300) -> float:
    """When a line starting with `prefix` appeared in `log` past byte `since` (polled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists():
            with open(log, "rb") as f:
                f.seek(since)
                if any(line.startswith(prefix.encode()) for line in f):
                    return time.time()
        time.sleep(0.02)
    raise TimeoutError(f"no {prefix!r} in {log} within {timeout} s")


def worker(cwd: Path, rank: int) -> psutil.Process:
    for p in psutil.process_iter(["environ", "cwd"]):
        env = p.info["environ"] or {}
        ours = env.get("MS_ROLE") == "MS_WORKER" and p.info["cwd"] == str(cwd)
        if ours and env.get("RANK_ID") == str(rank):
            return p
    raise LookupError(f"no worker {rank} in {cwd}")


def msrun(cwd: Path, port: int, logs: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(BIN / "msrun"), "--worker_num=2", "--local_worker_num=2", f"--master_port={port}",
         "--join=True", f"--log_dir={logs}", str(SCRIPT), *API, "--steps", "3000"],
        cwd=cwd, env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def under_msrun(fault: str, port: int) -> dict[str, float | int | None]:
    """msrun's side of one fault: its time to notice and exit, the rerun's to train again."""
    cwd = Path(tempfile.mkdtemp(prefix=f"msrun-{fault}-"))
    first = msrun(cwd, port, "first")
    wait_for_line(cwd / "first" / "worker_0.log", f"step {STRIKE_AT_STEP} ")
    struck = time.time()
    victim = worker(cwd, 1)
    victim.send_signal(signal.SIGKILL if fault == "crash" else signal.SIGSTOP)
    try:
        code: int | None = first.wait(timeout=NOTICE_AT_MOST_S)
    except subprocess.TimeoutExpired:  # never noticed: the user would have to
        code = None
        first.kill()
    exited = time.time()
    for p in psutil.process_iter(["cwd"]):  # a stopped worker msrun left behind
        if p.info["cwd"] == str(cwd) and p.pid != os.getpid():
            p.kill()
    rerun = msrun(cwd, port + 1, "rerun")
    trained = wait_for_line(cwd / "rerun" / "worker_0.log", "step ")
    rerun.kill()
    for p in psutil.process_iter(["cwd"]):
        if p.info["cwd"] == str(cwd):
            p.kill()
    return {
        "exit_code": code,
        "noticed": code is not None,
        "noticed_s": round(exited - struck, 2),
        "rerun_to_a_step_s": round(trained - exited, 2),
        "to_a_step_s": round(trained - struck, 2),
    }


def under_relaunch() -> dict[str, dict[str, float]]:
    """relaunch's side: both faults in one run, each recovered before the next strikes."""
    cwd = Path(tempfile.mkdtemp(prefix="relaunch-"))
    plan = cwd / "faults.yaml"
    strike = [
        {"kind": "process-exit", "after_s": 15, "pod": 1, "rank": 1},
        {"kind": "node-down", "after_s": 15, "pod": 1},
    ]
    plan.write_text(yaml.safe_dump({"faults": strike}))
    report = cwd / "report.json"
    subprocess.run(
        [str(BIN / "relaunch"), "run", "--state-dir", str(cwd / "state"), "--faults", str(plan),
         "--report", str(report), "--monitor-interval", "0.2", "--worker_num=2",
         "--local_worker_num=1", str(SCRIPT), *API, "--steps", "1200"],
        cwd=cwd, env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        check=True, timeout=900,
    )  # fmt: skip
    records = json.loads(report.read_text())["recoveries"]
    return {
        name: {"action": r["action"], "detect_s": r["detect_s"], "to_a_step_s": r["mttr_s"]}
        for name, r in zip(("crash", "lost node"), records, strict=True)
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = {
        "msrun": {
            "crash": under_msrun("crash", 18200),
            "lost node": under_msrun("silent", 18210),
        },
        "relaunch": under_relaunch(),
    }
    for fault in ("crash", "lost node"):
        ours, theirs = results["relaunch"][fault], results["msrun"][fault]
        ratio = theirs["to_a_step_s"] / ours["to_a_step_s"]
        print(
            f"{fault:10s} msrun: noticed after {theirs['noticed_s']:6.2f} s, its rerun trained "
            f"after {theirs['rerun_to_a_step_s']:5.2f} s more ({theirs['to_a_step_s']:6.2f} s); "
            f"relaunch ({ours['action']}): {ours['to_a_step_s']:5.2f} s: {ratio:4.1f}x faster"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
