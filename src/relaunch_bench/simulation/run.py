"""One simulated run: the real controller and store, a job of many pods on simulated peers, one
fault of one level, and what the controller did about it, measured from inside its process.

    python -m relaunch_bench.simulation.run OUT.json --pods 4096 --procs 8 --level job-reschedule

The controller is relaunch's own (runner.run_job, SQLite in a temporary state directory); its
engine is simulation.engine.SimEngine, whose peers are simulation.peers shards. Measured, by
wrapping what the controller calls (nothing in relaunch knows it is measured):

- every message it sends (when, what kind) and how many it receives;
- its process's CPU time, sampled every 50 ms;
- every write to SQLite (each statement outside a transaction is a commit, and each COMMIT);
- each membership publication (how long, how large the message).

What it writes (OUT.json): the recovery record, and from the fault to the last command sent
for it: the time, the commands, the CPU, the store's writes; the steady state's CPU per message.
"""

from __future__ import annotations

import argparse
import bisect
import json
import resource
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from relaunch import runner, service
from relaunch.controller import listener as listener_module
from relaunch.controller.membership import MembershipPublisher
from relaunch.protocol.environment import Env
from relaunch.protocol.layout import StateDir
from relaunch.protocol.messages import Lease, MembershipUpdate, Message, Start, encode
from relaunch.protocol.wire import Connection
from relaunch.store import Store
from relaunch_bench.simulation.engine import SimEngine
from relaunch_bench.simulation.levels import SIM_LEVELS, sim_job

__all__ = ["main"]

COMMANDS = frozenset(
    {
        "start",
        "stop",
        "membership",
        "capture-stacks",
        "heal",
        "assume",
        "shutdown",
        "inject-process-fault",
        "inject-chip-fault",
    }
)
"""What the controller sends to act (not its leases, nor the fault plan's injections)."""
ACTING = COMMANDS - {"inject-process-fault", "inject-chip-fault"}
FIRST_START = "first-start"
"""A pod's first start (attempt 1, generation 1): the job's, never a recovery's command, though
a launcher slow to connect on a busy machine may take it after the fault."""


def _kind(message: Message) -> str:
    if (
        isinstance(message, Start)
        and message.attempt == 1
        and message.ranks is None
        and message.env.get(Env.GENERATION) == "1"
    ):
        return FIRST_START
    return message.KIND


SAMPLE_S = 0.05


class Probe:
    """What the controller's process did, as the wrappers saw it."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, str]] = []
        self.received = 0
        self.writes: list[tuple[float, float, int]] = []
        """(when it began, how long, rows) of each write statement (one of many rows: an
        executemany) or COMMIT."""
        self.cpu: list[tuple[float, float, int]] = []
        """(when, CPU seconds, messages received) every SAMPLE_S."""
        self.publications: list[tuple[float, float, int]] = []
        """(when, seconds, bytes of the message) of each membership publication."""
        self.running = True

    def sample(self) -> None:
        while self.running:
            self.cpu.append((time.time(), time.process_time(), self.received))
            time.sleep(SAMPLE_S)

    def cpu_between(self, start: float, end: float) -> tuple[float, int]:
        """CPU seconds and messages received between two moments (the samples around them)."""
        times = [t for t, _, _ in self.cpu]
        i = max(0, bisect.bisect_right(times, start) - 1)
        j = min(len(self.cpu) - 1, bisect.bisect_left(times, end))
        return self.cpu[j][1] - self.cpu[i][1], self.cpu[j][2] - self.cpu[i][2]


PROBE = Probe()


class TimedConnection(Connection):
    def send(self, message: Message, *, urgent: bool | None = None) -> bool:
        sent = super().send(message, urgent=urgent)
        if not isinstance(message, Lease):
            PROBE.sent.append((time.time(), _kind(message)))
        return sent

    def read_ready(self) -> list[Message] | None:
        messages = super().read_ready()
        if messages:
            PROBE.received += len(messages)
        return messages


class TimedSqlite(sqlite3.Connection):
    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        verb = sql.lstrip()[:6].upper()
        if verb not in ("INSERT", "UPDATE", "DELETE", "COMMIT", "REPLAC"):
            return super().execute(sql, parameters)
        began = time.time()
        started = time.perf_counter()
        try:
            return super().execute(sql, parameters)
        finally:
            PROBE.writes.append((began, time.perf_counter() - started, 1))

    def executemany(self, sql: str, parameters: Any, /) -> sqlite3.Cursor:
        rows = list(parameters)
        began = time.time()
        started = time.perf_counter()
        try:
            return super().executemany(sql, rows)
        finally:
            PROBE.writes.append((began, time.perf_counter() - started, len(rows)))


def _instrument() -> None:
    """The wrappers put in place, in this process only (it runs nothing but the simulation):
    the listener's connections, every SQLite connection, the membership's publication."""
    setattr(listener_module, "Connection", TimedConnection)  # noqa: B010
    connect = sqlite3.connect

    def timed_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        return connect(*args, factory=TimedSqlite, **kwargs)

    setattr(sqlite3, "connect", timed_connect)  # noqa: B010
    publish = MembershipPublisher.publish

    def timed_publish(self: MembershipPublisher, *args: Any, **kwargs: Any) -> int:
        began, started = time.time(), time.perf_counter()
        generation = publish(self, *args, **kwargs)
        current = self.current()
        size = len(encode(MembershipUpdate(current))) if current is not None else 0
        PROBE.publications.append((began, time.perf_counter() - started, size))
        return generation

    setattr(MembershipPublisher, "publish", timed_publish)  # noqa: B010


@contextmanager
def _more_descriptors() -> Iterator[None]:
    """Thousands of connections (two a node: its agent's and its launcher's, in the controller
    and in the peers, which inherit it): the limit of open files raised to the kernel's
    (`fs.nr_open`) where this process may raise it (root), else the soft limit to the hard."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        most = int(Path("/proc/sys/fs/nr_open").read_text())
        resource.setrlimit(resource.RLIMIT_NOFILE, (most, most))
    except (OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def simulate(
    pods: int,
    procs: int,
    level: str,
    shards: int = 2,
    step_s: float = 0.5,
    lead_s: float | None = None,
    tail_s: float = 30.0,
) -> dict[str, Any]:
    """One job of `pods` pods x `procs` ranks through one fault of `level`; what it cost."""
    _instrument()
    job, cluster, plan, steps = sim_job(pods, procs, level, step_s, lead_s, tail_s)
    sampler = threading.Thread(target=PROBE.sample, daemon=True)
    sampler.start()
    with tempfile.TemporaryDirectory(prefix="relaunch-sim-") as tmp, _more_descriptors():
        directory = Path(tmp)
        store = Store(StateDir(directory).db)
        submission = service.Submission(
            raw=job, source="simulation", cwd=tmp, cluster=cluster, plan=plan
        )
        job_id = service.submit(store, submission, time.time())
        store.claim_job(job_id, time.time())
        engine = SimEngine(directory, shards, step_s, steps)
        began = time.time()
        try:
            status = runner.run_job(
                store, directory, job_id, resume=False, on_event=lambda _text: None, engine=engine
            )
        finally:
            engine.shutdown()
        took = time.time() - began
        records = store.records(job_id)
        store.close()
    PROBE.running = False
    return _measured(level, pods, procs, status.value, began, took, records)


def _measured(
    level: str, pods: int, procs: int, status: str, began: float, took: float, records: list[Any]
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "level": level, "pods": pods, "ranks": pods * procs, "status": status,
        "run_s": round(took, 1), "records": [(r.action.value, r.outcome.value) for r in records],
    }  # fmt: skip
    if len(records) != 1:
        return row
    record = records[0]
    end = record.resumed_at or record.fault_at + 60
    # the recovery's commands, and its starts after its first step: a pod is started as its
    # launcher connects, and the first pods started may step before the last is (the job's
    # own end, later, sends only stops and shutdowns)
    acting = [
        (t, kind)
        for t, kind in PROBE.sent
        if kind in ACTING and (record.fault_at <= t <= end or (t > end and kind == "start"))
    ]
    last = acting[-1][0] if acting else record.detected_at
    cpu, _ = PROBE.cpu_between(record.detected_at, last)
    # the steady state: the job trains, every pod started (the second half before the fault)
    quiet_from, quiet_to = max(record.fault_at - 10, (began + record.fault_at) / 2), record.fault_at
    steady_cpu, steady_messages = PROBE.cpu_between(quiet_from, quiet_to)
    quiet_s = max(quiet_to - quiet_from, 1e-3)
    writes = [d for t, d, _ in PROBE.writes if record.detected_at <= t <= last]
    rows = sum(n for t, _, n in PROBE.writes if record.detected_at <= t <= last)
    publications = [p for p in PROBE.publications if record.detected_at <= p[0] <= last]
    kinds: dict[str, int] = {}
    for _, kind in acting:
        kinds[kind] = kinds.get(kind, 0) + 1
    row.update(
        action=record.action.value,
        outcome=record.outcome.value,
        detect_s=round(record.detected_at - record.fault_at, 4),
        fault_to_last_command_s=round(last - record.fault_at, 4),
        detected_to_last_command_s=round(last - record.detected_at, 4),
        commands=kinds,
        cpu_s=round(cpu, 4),
        store_writes=len(writes),
        store_rows=rows,
        store_write_s=round(sum(writes), 4),
        store_write_max_ms=round(max(writes, default=0) * 1000, 3),
        membership_publish_s=round(sum(p[1] for p in publications), 4),
        membership_bytes=max((p[2] for p in publications), default=0),
        steady_messages_per_s=round(steady_messages / quiet_s, 1),
        steady_cpu_per_message_us=(
            round(steady_cpu / steady_messages * 1e6, 1) if steady_messages else None
        ),
        steady_cpu_share=round(steady_cpu / quiet_s, 3),
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--pods", type=int, required=True)
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--level", choices=sorted(SIM_LEVELS), required=True)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--step-s", type=float, default=0.5)
    parser.add_argument("--lead-s", type=float, help="seconds of training before the fault")
    parser.add_argument("--tail-s", type=float, default=30.0, help="... and after it")
    args = parser.parse_args()
    row = simulate(
        args.pods, args.procs, args.level, args.shards, args.step_s, args.lead_s, args.tail_s
    )
    args.out.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
