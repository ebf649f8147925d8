"""The launcher: one per pod, the pod's "container". Run as `python -m relaunch.launcher`.

It starts the job's command as `procs_per_pod` processes, each in its own process group (and,
where the pod is a cgroup, in its rank's cgroup: see relaunch.containers) with the
torchrun-compatible and ModelArts environment; writes their output to per-rank log files and
relays it (and their progress reports and SDK phases) to the controller; learns of each exit at
once (a pidfd per process; where the kernel has none, every `monitor_interval`); samples the CPU
time and I/O of ranks that gave no other sign of life; stops them with SIGTERM then SIGKILL after
the grace period; and injects faults on request.

It sleeps until something happens: one loop waits on the controller's commands, the SDK's
progress datagrams and the processes' exits at once, and otherwise only until the next thing
that is due (a progress batch, a usage sample, the end of the adopt grace). A pod whose ranks
train costs a few wake-ups a second, whatever the monitor interval.

If the controller goes away, the launcher keeps its processes running and reconnects to the next
controller that writes its address into the state directory. After `adopt_grace_s` without one
the pod is abandoned: its processes get SIGTERM (a dying gasp can still save) and SIGKILL once the
job's termination grace has passed, but never more than `adopt_grace_s` later, also when a stop
was already under way; then the launcher exits. Nothing outlives an abandoned job by more than
twice the adopt grace. A connection that stays open while nothing comes over it (the node cut
off from the controller, but running) counts the same once the plan's `lease_s` has passed
without a word (the controller renews the lease every quarter of it, R-14): the pod stops its
processes, with the job's grace bounded by the lease, and the launcher exits.

A command that cannot be started (its working directory is gone, the program does not exist) is
reported as that rank's exit, with code 127 or 126 as a shell would give, so that the recovery
ladder handles it like any failed start.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from relaunch.containers import Cgroup, step_out
from relaunch.diagnosis.errors import (
    ERROR_FILE_AT_MOST,
    error_from_file,
    error_from_large_file,
    error_from_output,
)
from relaunch.faults.kinds import ErrorReport
from relaunch.launcher.processes import (
    NotStarted,
    RankLog,
    Worker,
    cgroup_usage,
    children_by_parent,
    forget_stat,
    group_alive,
    in_container,
    is_python,
    sample_busy,
    signal_group,
    terminate,
    tree_usage,
)
from relaunch.launcher.spares import SparePool
from relaunch.launcher.stacks import capture
from relaunch.protocol.datagrams import CollectiveFailure, parse_datagram
from relaunch.protocol.environment import Env
from relaunch.protocol.layout import PodDir
from relaunch.protocol.messages import (
    Assume,
    CaptureStacks,
    CollectiveFailed,
    Exited,
    Injected,
    InjectProcessFault,
    LauncherHello,
    Lease,
    MembershipUpdate,
    Message,
    Output,
    ProcReport,
    Progress,
    ProgressBatch,
    RankPhase,
    Shutdown,
    Stacks,
    Start,
    Started,
    Stop,
    Stopped,
    Usage,
)
from relaunch.protocol.plans import LaunchPlan, write_atomically
from relaunch.protocol.wire import Connection, controller_address

__all__ = ["INJECT_DIR", "Launcher"]

INJECT_DIR = Path(__file__).parent.parent / "_inject"
_KEPT_WHILE_AWAY = (Exited, Stopped, ProgressBatch)
"""Messages kept for the next controller while none is connected."""
SPARE_SETTLE_S = 30.0
"""How long after their start ranks that report no steps count as training (spares_wanted)."""
HOUSEKEEPING_S = 5.0
SLOW_PERIOD_S = 0.1
"""A fault plan's `slow`: the period of its duty cycle."""
"""How often, at least, the processes are checked and the spares refilled when nothing else
wakes the launcher (with pidfds an exit wakes it at once)."""


class Launcher:
    def __init__(self, state_dir: Path, plan: LaunchPlan, container: Cgroup | None = None) -> None:
        self.state_dir = state_dir
        self.plan = plan
        self.container = container
        """The pod's cgroup (None: no cgroups here, each rank is a process group): each rank's
        processes live in its `rank-R` cgroup below it, killed whole when the rank ends."""
        self.dir = PodDir(Path(plan.workdir))
        self.dir.logs.mkdir(parents=True, exist_ok=True)
        self.dir.inject.mkdir(exist_ok=True)
        self.spares = SparePool(
            plan.warm_spares,
            plan.command,
            on_ready=lambda: self.wake(),
            container=container.child("spares") if container is not None else None,
        )
        self.commands: queue.Queue[Message] = queue.Queue()
        self.workers: dict[int, Worker] = {}
        self.conn: Connection | None = None
        self.outbox: list[Message] = []  # kept while the controller is away
        self.lock = threading.Lock()
        self.attempt = 0
        self.last_env: dict[str, str] = {}
        self.alone_since: float | None = time.time()
        self.heard_at = time.time()
        """When the controller last said anything (a `Lease` at least every quarter lease)."""
        self.abandoned_at: float | None = None
        self.fenced = False
        """Abandoned because the lease ran out with the connection still open (R-14)."""
        self.running = True
        self.ended_as_asked: dict[int, tuple[int, int | None, int | None]] = {}
        """Ranks a stop ended (rank -> attempt, code, signal), told in its `Stopped`."""
        self.latest_progress: dict[int, Progress] = {}
        self.phases: list[RankPhase] = []
        self.progress_sent_at = 0.0
        self.usage_sent_at = 0.0
        self.progress_name = f"relaunch-{os.getpid()}-{plan.job}-{plan.pod}-{plan.generation}"
        self.progress = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.progress.bind("\0" + self.progress_name)
        self.progress.setblocking(False)
        self.urgent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.urgent.bind("\0" + self.progress_name + "-urgent")
        self.urgent.setblocking(False)
        self.progress_read_at = 0.0
        self.events = selectors.DefaultSelector()
        self.wake_read, self.wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.events.register(self.urgent, selectors.EVENT_READ, "progress")
        self.events.register(self.wake_read, selectors.EVENT_READ, "wake")
        self.exits_by_pidfd = hasattr(os, "pidfd_open")
        """False where the kernel has no pidfds: exits are then polled every monitor interval."""

    def post(self, message: Message) -> None:
        """A command for the main loop, from another thread; wakes it."""
        self.commands.put(message)
        self.wake()

    def wake(self) -> None:
        """The main loop recomputes what is due now (a thread changed something it waits on)."""
        with contextlib.suppress(BlockingIOError):
            os.write(self.wake_write, b"!")

    # -- talking to the controller ---------------------------------------------------------------

    def send(self, message: Message, *, urgent: bool | None = None) -> None:
        with self.lock:
            conn = self.conn
            undelivered = conn is None or not conn.send(message, urgent=urgent)
            if undelivered and isinstance(message, _KEPT_WHILE_AWAY):
                self.outbox.append(message)

    def hello(self) -> LauncherHello:
        procs = {
            w.rank: ProcReport(
                w.attempt,
                w.proc.pid,
                w.proc.poll() is None,
                w.proc.returncode,
                progressed=w.stepped or bool(w.tail),
            )
            for w in self.workers.values()
        }
        return LauncherHello(
            job=self.plan.job,
            pod=self.plan.pod,
            generation=self.plan.generation,
            pid=os.getpid(),
            attempt=self.attempt,
            node=self.plan.node,
            standby=self.plan.standby,
            procs=procs,
        )

    def connect_loop(self) -> None:
        """Connected to the controller whose address the state directory holds; reconnects to
        the next one. An abandoned pod never reconnects: it is ending, and a controller that
        adopted it would hear its processes stop without a fault."""
        while self.running and self.abandoned_at is None:
            address = controller_address(self.state_dir)
            if address is not None:
                try:
                    conn = Connection.connect(*address)
                except OSError:
                    conn = None
                if conn is not None and conn.send(self.hello()):
                    with self.lock:
                        self.conn = conn
                        backlog, self.outbox = self.outbox, []
                        self.alone_since = None
                        self.heard_at = time.time()
                    for message in backlog:
                        conn.send(message)
                    for message in conn:
                        self.heard_at = time.time()
                        if not isinstance(message, Lease):
                            self.post(message)
                    with self.lock:
                        self.conn = None
                        self.alone_since = time.time()
                    self.wake()  # the adopt grace runs from now
            time.sleep(0.1)

    def read_progress(self) -> None:
        """The SDK's datagrams that arrived. Urgent ones wake the launcher and are sent at once:
        a rank's first step (it proves a restart worked) and its phases (whether a rank is
        saving a checkpoint decides which recovery can run, R-37). Routine steps are read
        every progress interval, the newest per rank kept."""
        urgent = False
        for sock in (self.urgent, self.progress):
            while True:
                try:
                    data = sock.recv(256)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    return
                urgent = self._received(data) or urgent
        self.progress_read_at = time.time()
        for worker in self.workers.values():
            if not worker.reported:
                self.read_output(worker)
            if worker.started and worker.attempt == self.attempt and worker.proc.poll() is None:
                sample_busy(worker)
        self.flush_progress(force=urgent)

    def _received(self, data: bytes) -> bool:
        """One datagram, kept for the next progress message; True if it is to go at once."""
        parsed = parse_datagram(data)
        if parsed is None:
            return False
        rank, value, reported_at = parsed
        worker = self.workers.get(rank)
        attempt = worker.attempt if worker else self.attempt
        now = time.time()
        if isinstance(value, CollectiveFailure):  # to the controller at once
            failed = CollectiveFailed(
                rank, attempt, value.step, value.collective, value.generation, value.why, now
            )
            self.send(failed, urgent=True)
            return False
        with self.lock:
            if isinstance(value, str):
                self.phases.append(RankPhase(rank, attempt, value, now))
                return True
            self.latest_progress[rank] = Progress(rank, value, attempt, reported_at or now)
            if worker is None:
                return False
            first = not worker.stepped
            worker.stepped = worker.alive_since_sample = True
            return first

    def flush_progress(self, force: bool = False, urgent: bool | None = None) -> None:
        """Forward the newest report of each rank in one message, at most every
        `progress_interval_s`: a loop that reports thousands of steps a second costs the
        controller one message per pod per interval (up to a second, see commands.launch_plan).
        `force`: now, due or not; the message rings the controller's doorbell if `urgent`
        (by default: if forced)."""
        now = time.time()
        with self.lock:
            if not (self.latest_progress or self.phases) or (
                not force and now - self.progress_sent_at < self.plan.progress_interval_s
            ):
                return
            reports, self.latest_progress = tuple(self.latest_progress.values()), {}
            phases, self.phases = tuple(self.phases), []
            self.progress_sent_at = now
        busy = {w.rank: (w.busy, w.samples) for w in self.workers.values() if w.samples}
        urgent = force if urgent is None else urgent  # a first step, a phase
        self.send(ProgressBatch(reports, phases, busy), urgent=urgent)

    # -- processes ----------------------------------------------------------------------------------

    def start(self, attempt: int, env: dict[str, str], ranks: tuple[int, ...] | None) -> None:
        self.attempt = attempt
        self.last_env = env
        pids = {}
        for local_rank in range(self.plan.procs_per_pod):
            rank = self.plan.first_rank + local_rank
            if ranks is not None and rank not in ranks:
                continue
            old = self.workers.get(rank)
            if old is not None and old.proc.poll() is None:
                continue
            worker = self._start_rank(attempt, env, rank, local_rank)
            self.workers[rank] = worker
            pids[rank] = worker.proc.pid
            self._watch_exit(worker)
        if pids:
            self.send(Started(attempt, time.time(), pids))
        self.monitor()  # a command that could not be started has exited already

    def _watch_exit(self, worker: Worker) -> None:
        """The loop wakes when the worker's process exits (its pidfd becomes readable)."""
        if not self.exits_by_pidfd or not worker.started:
            return
        try:
            worker.pidfd = os.pidfd_open(worker.proc.pid)
        except OSError:  # no pidfds here (ENOSYS) or not allowed: poll instead
            self.exits_by_pidfd = False
            return
        self.events.register(worker.pidfd, selectors.EVENT_READ, worker)

    def _unwatch_exit(self, worker: Worker) -> None:
        forget_stat(worker)
        if worker.pidfd is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.events.unregister(worker.pidfd)
        with contextlib.suppress(OSError):
            os.close(worker.pidfd)
        worker.pidfd = None

    def _start_rank(self, attempt: int, env: dict[str, str], rank: int, local_rank: int) -> Worker:
        child_env = self._child_env(env)
        error_file = self.dir.error_file(rank)
        error_file.parent.mkdir(exist_ok=True)
        error_file.unlink(missing_ok=True)  # what an earlier process of this rank wrote
        child_env.update(
            {
                Env.RANK: str(rank),
                Env.ROLE_RANK: str(rank),  # one role: its rank is the global rank, as torchrun's
                Env.LOCAL_RANK: str(local_rank),
                Env.ERROR_FILE: str(error_file),
            }
        )
        child_env.setdefault(Env.NCCL_ASYNC_ERROR_HANDLING, "1")  # torchrun's defaults
        # NCCL takes ranks with one host identity and one GPU for a mistake ("Duplicate GPU
        # detected"); ranks of different nodes sharing the machine's GPU are different hosts
        child_env.setdefault(Env.NCCL_HOSTID, f"relaunch-{self.plan.node}")
        child_env.setdefault(Env.SIGNALS_TO_HANDLE, "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
        path = self.dir.rank_log(rank)
        cgroup = self.rank_cgroup(rank)
        if cgroup is not None:
            try:
                cgroup.make()
            except OSError:
                cgroup = None  # the rank runs as a process group only
        if cgroup is not None:  # what an earlier process of this rank left there
            cgroup.kill()
            cgroup.wait_empty(5.0)
        spare = self.spares.take() if self.spares.argv is not None else None
        cwd = self.plan.working_dir or str(self.dir.path)
        how = f", warm spare pid {spare.proc.pid}" if spare is not None else ""
        start_error = None
        proc: subprocess.Popen[bytes] | NotStarted
        # The process writes its output to its log itself (appending: the log holds every
        # attempt of the rank); the launcher reads it from where this attempt's begins.
        with open(path, "ab") as log:
            log.write(
                f"--- relaunch: attempt {attempt}, "
                f"{Env.PROC_START_CNT}={env.get(Env.PROC_START_CNT)}{how} ---\n".encode()
            )
            log.flush()
            output = RankLog(path)
            if spare is not None and self.spares.argv is not None:
                # moved before it runs the rank's code: all it forks is born there
                if cgroup is not None:
                    with contextlib.suppress(OSError):
                        cgroup.add(spare.proc.pid)
                proc = spare.become(child_env, self.spares.argv, cwd, str(path))
            else:
                try:
                    proc = subprocess.Popen(
                        list(self.plan.command),
                        cwd=cwd,
                        env=child_env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=in_container(cgroup),
                    )
                except (OSError, ValueError, subprocess.SubprocessError) as error:
                    start_error = f"could not start {self.plan.command[0]!r} in {cwd}: {error}"
                    proc = NotStarted(126 if isinstance(error, PermissionError) else 127)
                    log.write(f"relaunch: {start_error}\n".encode())
        if start_error is not None:
            output.close()  # nothing will write to it
        kept = output if start_error is None else None
        return Worker(rank, local_rank, attempt, proc, kept, start_error=start_error)

    def rank_cgroup(self, rank: int) -> Cgroup | None:
        """Rank `rank`'s cgroup in the pod's container (None: no cgroups)."""
        return self.container.child(f"rank-{rank}") if self.container is not None else None

    def end_rank(self, worker: Worker) -> None:
        """The rank's process has ended: whatever it started that still runs (a helper that
        left its process group, a daemon) ends with it, as a container's processes end with it."""
        cgroup = self.rank_cgroup(worker.rank)
        if cgroup is None or not cgroup.populated() or group_alive(worker.proc):
            return  # a wrapper's child still saving its dying gasp: the stop ends it
        cgroup.kill()

    def close_container(self) -> None:
        """The launcher exits: every process of its ranks and spares is killed and their
        cgroups removed, the pod's own too (with the node's and the cluster's, if they are then empty)."""
        if self.container is None:
            return
        for name in ["spares", *(f"rank-{rank}" for rank in self.workers)]:
            cgroup = self.container.child(name)
            cgroup.kill()
            cgroup.wait_empty(5.0)
        step_out(self.container, levels=1)  # pod, node, cluster: removed if this was the last

    def _child_env(self, env: dict[str, str]) -> dict[str, str]:
        """What every process of the pod sees, before its rank is set."""
        child_env = {**os.environ, **self.plan.env, **env}
        if self.plan.procs_per_pod > 1:
            # torchrun's rule: several processes on a node share its cores, one OpenMP thread
            # each unless the job says otherwise (spares too: torch reads it when imported)
            child_env.setdefault("OMP_NUM_THREADS", "1")
        child_env.update(
            {
                Env.PROGRESS_SOCKET: "@" + self.progress_name,
                Env.URGENT_SOCKET: "@" + self.progress_name + "-urgent",
                Env.PROGRESS_EVERY: str(self.plan.progress_interval_s),
                Env.INJECT_DIR: str(self.dir.inject),
                Env.WORKDIR: str(self.dir.path),
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(INJECT_DIR), child_env.get("PYTHONPATH", "")) if p
                ),
                "PYTHONUNBUFFERED": "1",
                # `python` in the command means the Python relaunch runs on, venv included.
                "PATH": os.pathsep.join(
                    (str(Path(sys.executable).parent), child_env.get("PATH", ""))
                ),
            }
        )
        return child_env

    def read_output(self, worker: Worker, final: bool = False) -> None:
        """The lines the rank wrote to its log since the last read (`final`: it exited, its
        unfinished last line too): kept for its error, forwarded to the controller, and a sign
        of life (detectors.rank_active; for a script without the SDK, its progress)."""
        if worker.output is None:
            return
        written, lines = worker.output.read(final)
        if not lines:
            return
        at = min(written, time.time())
        worker.alive_since_sample = True
        for line in lines:
            worker.tail.append((at, line[:2000]))
            self.send(Output(worker.rank, worker.attempt, line[:2000]))

    def monitor(self) -> None:
        drained = False
        for worker in list(self.workers.values()):
            code = worker.proc.poll()
            if code is None or worker.reported:
                continue
            if not drained:  # what the rank reported before it exited goes first, due or not
                self.read_progress()
                self.flush_progress(force=True, urgent=False)  # the exit rings right after
                drained = True
            self._unwatch_exit(worker)
            self.end_rank(worker)
            self.read_output(worker, final=True)
            if worker.output is not None:
                worker.output.close()
            worker.reported = True
            signum = -code if code < 0 else None
            error = self.error_of(worker) if code != 0 and worker.started else None
            # A rank that raised before it was asked to stop failed on its own account.
            failed_first = (
                error is not None
                and bool(error.type)
                and worker.stop_asked_at is not None
                and error.at < worker.stop_asked_at
            )
            if worker.stopping and not failed_first:  # told in the stop's Stopped
                self.ended_as_asked[worker.rank] = (
                    worker.attempt,
                    None if signum else code,
                    signum,
                )
                continue
            self.send(
                Exited(
                    rank=worker.rank,
                    attempt=worker.attempt,
                    code=None if signum else code,
                    signal=signum,
                    at=time.time(),
                    detail=worker.start_error or "",
                    error=error,
                )
            )

    def error_of(self, worker: Worker) -> ErrorReport | None:
        """What the failed rank said: its torchelastic error file (timed by when it was
        written), else the traceback or last lines of its output."""
        path = self.dir.error_file(worker.rank)
        try:
            status = path.stat()
            with open(path, "rb") as file:
                if status.st_size > ERROR_FILE_AT_MOST:  # not parsed whole: its start says enough
                    head = file.read(64 << 10).decode("utf-8", "replace")
                    return error_from_large_file(head, status.st_size, status.st_mtime)
                data = json.loads(file.read().decode("utf-8", "replace"))
            written = status.st_mtime
        except (OSError, ValueError):
            data = None
        if isinstance(data, dict):
            found = error_from_file(data, written)
            if found is not None:
                return found
        return error_from_output(list(worker.tail))

    def send_usage(self) -> None:
        """CPU time and I/O of each running rank (its cgroup, or its whole process tree without
        cgroups), and whether it was seen running or waiting for the disk, when they changed:
        the controller counts a rank that computes, does I/O or waits for the disk as alive
        though it is silent.
        Ranks that reported a step or wrote output since the last sample are alive already and
        are not sampled (the controller takes their next sample as a new baseline, see
        detectors.rank_active): a job whose ranks report steps costs no walk of the process
        table, other jobs one per sample, whatever the number of ranks."""
        running = [w for w in self.workers.values() if w.started and w.proc.poll() is None]
        silent = [w for w in running if not w.alive_since_sample]
        for worker in running:
            worker.alive_since_sample = False
        if not silent:
            return
        children = children_by_parent() if self.container is None else {}
        ranks: dict[int, tuple[float, int]] = {}
        working: dict[int, int] = {}
        stopped: dict[int, int] = {}
        for worker in silent:
            cgroup = self.rank_cgroup(worker.rank)
            usage = (
                cgroup_usage(cgroup)
                if cgroup is not None
                else tree_usage(worker.proc.pid, children)
            )
            looks = worker.working - worker.working_sent
            worker.working_sent = worker.working
            halted = worker.stopped - worker.stopped_sent
            worker.stopped_sent = worker.stopped
            if usage is not None and (usage != worker.usage or looks or halted):
                worker.usage = usage
                ranks[worker.rank] = usage
                if looks:
                    working[worker.rank] = looks
                if halted:
                    stopped[worker.rank] = halted
        if ranks:
            self.send(Usage(self.attempt, time.time(), ranks, working, stopped))

    def stop(self, grace: float, ranks: tuple[int, ...] | None = None) -> None:
        """SIGTERM every process group, SIGKILL what is left after `grace` seconds."""
        chosen = [w for w in self.workers.values() if ranks is None or w.rank in ranks]
        for worker in chosen:  # what a rank printed before it was asked to stop is timed so
            if not worker.reported:
                self.read_output(worker)
        asked = time.time()
        for worker in chosen:
            worker.stopping = True
            worker.stop_asked_at = worker.stop_asked_at or asked
        targets = [w for w in chosen if w.started]
        for worker in targets:
            if worker.proc.poll() is None:
                signal_group(worker.proc.pid, signal.SIGCONT)
                if grace > 0:
                    terminate(worker.proc.pid)
                else:
                    signal_group(worker.proc.pid, signal.SIGKILL)
        # Wait for every process of each group, not only its leader: a shell dies at once on
        # SIGTERM while the Python under it is still saving its dying gasp.
        deadline = time.time() + grace
        while time.time() < min(deadline, self.kill_by()) and any(
            group_alive(w.proc) for w in targets
        ):
            time.sleep(0.02)
        for worker in targets:
            signal_group(worker.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=5)
            cgroup = self.rank_cgroup(worker.rank)
            if cgroup is not None:  # and all the rank started, wherever it went
                cgroup.kill()
        self.monitor()

    def stop_ended(self) -> dict[int, tuple[int, int | None, int | None]]:
        """The ranks the stop just carried out ended, for its `Stopped` (and forgotten)."""
        ended, self.ended_as_asked = self.ended_as_asked, {}
        return ended

    def inject(self, message: InjectProcessFault) -> None:
        """A fault plan's process fault; the controller hears back whether it fired, and why not."""
        why = self._inject(self.workers.get(message.rank), message)
        self.send(Injected(message.index, why is None, why or "", time.time()))

    def _slow_down(self, workers: list[Worker], factor: float, duration_s: float | None) -> None:
        """A CPU throttle's duty cycle on the pod's processes (a fault plan's `slow`): each
        period (SLOW_PERIOD_S on average, drawn anew each time as a busy node's scheduler would
        give it: not in step with anything that samples them) they run 1/factor of it and are
        stopped the rest, until `duration_s` has passed or they are stopped or gone."""
        end = time.time() + duration_s if duration_s is not None else float("inf")
        draw = random.Random()
        try:
            while self.running and time.time() < end:
                live = [w for w in workers if not w.stopping and w.proc.poll() is None]
                if not live:
                    return
                period = draw.uniform(0.5, 1.5) * SLOW_PERIOD_S
                run = period / factor
                for worker in live:
                    signal_group(worker.proc.pid, signal.SIGSTOP)
                time.sleep(period - run)
                for worker in live:
                    signal_group(worker.proc.pid, signal.SIGCONT)
                time.sleep(run)
        finally:
            for worker in workers:
                if worker.proc.poll() is None:
                    signal_group(worker.proc.pid, signal.SIGCONT)

    def _inject(self, worker: Worker | None, message: InjectProcessFault) -> str | None:
        if worker is None or not worker.started:
            return f"rank {message.rank} has no process in pod {self.plan.pod}"
        if worker.proc.poll() is not None:
            return f"rank {worker.rank} has exited (code {worker.proc.returncode})"
        if message.kind == "hang":
            signal_group(worker.proc.pid, signal.SIGSTOP)
            return None
        if message.kind == "slow":
            pod = [w for w in self.workers.values() if w.started and w.proc.poll() is None]
            threading.Thread(
                target=self._slow_down,
                args=(pod, message.factor, message.duration_s),
                daemon=True,
            ).start()
            return None
        try:
            root = psutil.Process(worker.proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return f"rank {worker.rank} has exited"
        for process in [p for p in tree if is_python(p)] or tree[:1]:
            (self.dir.inject / str(process.pid)).write_text(str(message.exit_code))
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGUSR2)
        return None

    def assume(self, plan: LaunchPlan) -> None:
        """A standby launcher becomes the launcher of a pod moved to its node; its warm spares
        will become the pod's processes."""
        if not self.plan.standby or self.workers:
            return
        self.plan = plan
        self.dir = PodDir(Path(plan.workdir))
        self.dir.logs.mkdir(parents=True, exist_ok=True)
        self.dir.inject.mkdir(exist_ok=True)
        self.dir.plan.write_text(plan.to_json())

    # -- main loop ------------------------------------------------------------------------------

    def run(self) -> None:
        threading.Thread(target=self.connect_loop, daemon=True).start()
        now = time.time()
        next_check = now
        self.usage_sent_at = now
        while self.running:
            for key, _ in self.events.select(max(0.0, self.next_due(next_check) - time.time())):
                if key.data == "wake":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_read, 4096)
                elif key.data == "progress":
                    self.read_progress()
                else:
                    self.monitor()  # a worker's process exited
            while self.running:
                try:
                    message = self.commands.get_nowait()
                except queue.Empty:
                    break
                self.handle(message)
            now = time.time()
            # what falls due within one progress interval of a progress read is done with it,
            # early, rather than in a wake-up of its own (a wake costs far more than the work)
            early = 0.0
            if now >= self.progress_read_at + self.plan.progress_interval_s:
                self.read_progress()
                early = self.plan.progress_interval_s
            if now >= next_check - early:
                self.monitor()
                interval = self.plan.monitor_interval_s
                next_check = now + (HOUSEKEEPING_S if self.exits_by_pidfd else interval)
            if self.spares.wants_more() and self.spares_wanted(now):
                training = any(
                    (w.stepped or now - w.started_at >= SPARE_SETTLE_S) and w.proc.poll() is None
                    for w in self.workers.values()
                )
                self.spares.refill(
                    self.dir.path,
                    self._child_env(self.last_env or {}),
                    at_once=self.plan.spares_at_once and not training,
                )
            if now - self.usage_sent_at >= self.plan.activity_interval_s - early:
                self.usage_sent_at = now
                self.send_usage()
            if self.abandoned():
                self.stop(self.abandon_grace())
                self.running = False

    def next_due(self, next_check: float) -> float:
        """When the loop must wake if nothing happens before: the next process check, progress
        batch, usage sample, spare refill or the end of the adopt grace."""
        due = [next_check, self.usage_sent_at + self.plan.activity_interval_s]
        if any(w.started and w.proc.poll() is None for w in self.workers.values()):
            due.append(self.progress_read_at + self.plan.progress_interval_s)
        with self.lock:
            if self.alone_since is not None:
                due.append(self.alone_since + self.plan.adopt_grace_s)
            elif self.plan.lease_s is not None:
                due.append(self.heard_at + self.plan.lease_s)
        if self.spares.wants_more():
            now = time.time()
            settled = (
                w.started_at + SPARE_SETTLE_S for w in self.workers.values() if w.attempt > 1
            )
            due += [at for at in settled if at > now]
        return min(due)

    def spares_wanted(self, now: float) -> bool:
        """Spares used by a restart are started again once the restarted processes train: a
        spare importing torch beside ranks that restart would slow the very recovery it is
        kept for. At the job's first start and in a standby launcher (no ranks; the controller
        starts it between recoveries) they start at once; ranks that report no steps (no SDK)
        count as training SPARE_SETTLE_S after their start."""
        restarted = [w for w in self.workers.values() if w.attempt > 1 and w.proc.poll() is None]
        return all(w.stepped or now - w.started_at >= SPARE_SETTLE_S for w in restarted)

    def abandoned(self) -> bool:
        """No controller for `adopt_grace_s`, or no word from a connected one for the lease: the
        pod is abandoned (see the module docstring)."""
        now = time.time()
        with self.lock:
            alone, heard = self.alone_since, self.heard_at
        lease = self.plan.lease_s
        closed = alone is not None and now - alone > self.plan.adopt_grace_s
        silent = alone is None and lease is not None and now - heard > lease
        if not (closed or silent):
            return False
        if self.abandoned_at is None:
            self.abandoned_at = now
            self.fenced = silent
            if silent:
                print(
                    f"[relaunch] no word from the controller for {now - heard:.1f} s (lease "
                    f"{lease:g} s, R-14): this pod stops its processes",
                    flush=True,
                )
        return True

    def kill_by(self) -> float:
        """The latest moment a process of this pod may still run: once abandoned, at most
        `adopt_grace_s` (the lease, when it ran out) and the job's grace after that. A stop in
        progress checks it too."""
        if not self.abandoned() or self.abandoned_at is None:
            return float("inf")
        return self.abandoned_at + self.abandon_grace()

    def abandon_grace(self) -> float:
        """How long an abandoned pod's processes have between SIGTERM and SIGKILL."""
        bound = self.plan.lease_s if self.fenced and self.plan.lease_s else self.plan.adopt_grace_s
        return min(self.plan.termination_grace_s, bound)

    def handle(self, message: Message) -> None:
        match message:
            case Start(attempt=attempt, env=env, ranks=ranks):
                self.start(attempt, env, ranks)
            case Stop(grace=grace, ranks=ranks):
                self.stop(grace, ranks)
                self.send(Stopped(self.attempt, time.time(), exited=self.stop_ended()))
            case InjectProcessFault():
                self.inject(message)
            case CaptureStacks(request=request, timeout_s=timeout_s):
                pids = {
                    w.rank: w.proc.pid
                    for w in self.workers.values()
                    if w.started and w.proc.poll() is None and w.attempt == self.attempt
                }
                attempt = self.attempt
                threading.Thread(  # py-spy takes tens of ms a rank: the loop keeps serving
                    target=lambda: self.send(
                        Stacks(request, attempt, tuple(capture(pids, timeout_s)))
                    ),
                    daemon=True,
                ).start()
            case MembershipUpdate(membership=membership):
                write_atomically(self.dir.membership, membership.to_json())
            case Assume(plan=plan):
                self.assume(plan)
            case Shutdown(grace=grace):
                self.stop(grace)
                self.send(Stopped(self.attempt, time.time(), final=True, exited=self.stop_ended()))
                self.running = False
