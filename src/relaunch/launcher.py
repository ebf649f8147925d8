"""The launcher: one per pod, the pod's "container". Run as `python -m relaunch.launcher`.

It starts the job's command as `procs_per_pod` processes, each in its own process group with the
torchrun-compatible and ModelArts environment; writes their output to per-rank log files and
relays it (and their progress reports) to the controller; checks them every `monitor_interval`;
stops them with SIGTERM then SIGKILL after the grace period; and injects faults on request.

If the controller goes away, the launcher keeps its processes running and reconnects to the next
controller that writes its address into the state directory. After `adopt_grace_s` without one
the pod is abandoned: its processes get SIGTERM (a dying gasp can still save) and SIGKILL once the
job's termination grace has passed, but never more than `adopt_grace_s` later, also when a stop
was already under way; then the launcher exits. Nothing outlives an abandoned job by more than
twice the adopt grace.

A command that cannot be started (its working directory is gone, the program does not exist) is
reported as that rank's exit, with code 127 or 126 as a shell would give, so that the recovery
ladder handles it like any failed start.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from relaunch.wire import Connection, controller_address

INJECT_DIR = Path(__file__).parent / "_inject"


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


@dataclass
class Worker:
    rank: int
    local_rank: int
    attempt: int
    proc: subprocess.Popen[bytes]
    log: IO[str]
    stopping: bool = False
    reported: bool = False
    pump: threading.Thread | None = None
    start_error: str | None = None
    """Why the command could not be started, if it could not."""
    usage: tuple[float, int] = (0.0, 0)
    """CPU seconds and I/O bytes of the rank's processes, as last sent."""


@dataclass
class LaunchPlan:
    """Written by the controller into the pod's work directory as launch.json."""

    job: int
    pod: int
    generation: int
    node: str
    command: list[str]
    procs_per_pod: int
    first_rank: int
    working_dir: str | None
    monitor_interval_s: float
    adopt_grace_s: float
    workdir: str
    env: dict[str, str] = field(default_factory=dict)
    warm_spares: int = 0
    """Processes kept started (Python up, torch imported) for process-level restarts."""
    progress_interval_s: float = 0.02
    """At most one progress message per this interval (the controller scales it with the job)."""
    termination_grace_s: float = 30.0
    """SIGTERM -> SIGKILL grace the job asks for: used when the pod is abandoned."""
    activity_interval_s: float = 1.0
    """How often each rank's CPU time and I/O are sampled and sent (hang detection, R-25)."""
    standby: bool = False
    """A launcher on a standby node that runs no rank yet: it keeps `warm_spares` processes
    ready and becomes a pod's launcher when the controller moves a pod to its node ("assume")."""


@dataclass
class Spare:
    proc: subprocess.Popen[bytes]
    ready: threading.Event


class Launcher:
    def __init__(self, state_dir: Path, plan: LaunchPlan) -> None:
        self.state_dir = state_dir
        self.plan = plan
        self.workdir = Path(plan.workdir)
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.inject_dir = self.workdir / "inject"
        self.spares: list[Spare] = []
        self.spare_argv = _spare_argv(plan.command)
        self.inject_dir.mkdir(exist_ok=True)
        self.commands: queue.Queue[dict[str, Any]] = queue.Queue()
        self.workers: dict[int, Worker] = {}
        self.conn: Connection | None = None
        self.outbox: list[dict[str, Any]] = []  # kept while the controller is away
        self.lock = threading.Lock()
        self.attempt = 0
        self.last_env: dict[str, str] = {}
        self.alone_since: float | None = time.time()
        self.running = True
        self.latest_progress: dict[int, dict[str, Any]] = {}
        self.progress_sent_at = 0.0
        self.abandoned_at: float | None = None
        self.usage_sent_at = 0.0
        self.progress_name = f"relaunch-{os.getpid()}-{plan.job}-{plan.pod}-{plan.generation}"
        self.progress = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.progress.bind("\0" + self.progress_name)

    # -- talking to the controller ---------------------------------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        with self.lock:
            conn = self.conn
            undelivered = conn is None or not conn.send(message)
            if undelivered and message["t"] in ("exit", "stopped", "progress_batch"):
                self.outbox.append(message)

    def hello(self) -> dict[str, Any]:
        procs = {
            str(w.rank): {
                "attempt": w.attempt,
                "pid": w.proc.pid,
                "running": w.proc.poll() is None,
                "code": w.proc.returncode,
            }
            for w in self.workers.values()
        }
        return {
            "t": "hello",
            "role": "launcher",
            "job": self.plan.job,
            "pod": self.plan.pod,
            "gen": self.plan.generation,
            "pid": os.getpid(),
            "attempt": self.attempt,
            "procs": procs,
            "standby": self.plan.standby,
            "node": self.plan.node,
        }

    def connect_loop(self) -> None:
        while self.running:
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
                    for message in backlog:
                        conn.send(message)
                    for message in conn:
                        self.commands.put(message)
                    with self.lock:
                        self.conn = None
                        self.alone_since = time.time()
            time.sleep(0.1)

    def progress_loop(self) -> None:
        while self.running:
            try:
                data = self.progress.recv(256)
            except OSError:
                return
            try:
                rank_text, step_text = data.decode().split()[:2]
                rank, step = int(rank_text), int(step_text)
            except ValueError:
                continue
            worker = self.workers.get(rank)
            attempt = worker.attempt if worker else self.attempt
            report = {
                "t": "progress",
                "rank": rank,
                "step": step,
                "attempt": attempt,
                "at": time.time(),
            }
            with self.lock:
                self.latest_progress[rank] = report
            self.flush_progress()

    def flush_progress(self, force: bool = False) -> None:
        """Forward the newest report of each rank in one message, at most every
        `progress_interval_s`: a loop that reports thousands of steps a second costs the
        controller a few messages a second per pod, and a large job's interval is longer."""
        now = time.time()
        with self.lock:
            if not self.latest_progress or (
                not force and now - self.progress_sent_at < self.plan.progress_interval_s
            ):
                return
            reports, self.latest_progress = list(self.latest_progress.values()), {}
            self.progress_sent_at = now
        self.send({"t": "progress_batch", "reports": reports})

    # -- processes ----------------------------------------------------------------------------------

    def start(self, attempt: int, env: dict[str, str], ranks: list[int] | None = None) -> None:
        self.attempt = attempt
        self.last_env = env
        local_ranks = range(self.plan.procs_per_pod)
        for local_rank in local_ranks:
            rank = self.plan.first_rank + local_rank
            if ranks is not None and rank not in ranks:
                continue
            old = self.workers.get(rank)
            if old is not None and old.proc.poll() is None:
                continue
            child_env = self._child_env(env)
            child_env.update(RANK=str(rank), LOCAL_RANK=str(local_rank))
            log = open(self.workdir / "logs" / f"rank-{rank}.log", "a", encoding="utf-8")  # noqa: SIM115
            spare = self._take_spare()
            cwd = self.plan.working_dir or str(self.workdir)
            how = f", warm spare pid {spare.proc.pid}" if spare is not None else ""
            log.write(
                f"--- relaunch: attempt {attempt}, MA_PROC_START_CNT={env.get('MA_PROC_START_CNT')}{how} ---\n"
            )
            log.flush()
            start_error = None
            if spare is not None:
                proc = spare.proc
                assert proc.stdin is not None
                identity = {"env": child_env, "argv": self.spare_argv, "cwd": cwd}
                proc.stdin.write((json.dumps(identity) + "\n").encode())
                proc.stdin.close()
            else:
                try:
                    proc = subprocess.Popen(
                        self.plan.command,
                        cwd=cwd,
                        env=child_env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=_die_with_parent,
                    )
                except (OSError, ValueError, subprocess.SubprocessError) as error:
                    start_error = f"could not start {self.plan.command[0]!r} in {cwd}: {error}"
                    proc = _NotStarted(126 if isinstance(error, PermissionError) else 127)  # type: ignore[assignment]
                    log.write(f"relaunch: {start_error}\n")
                    log.flush()
            worker = Worker(rank, local_rank, attempt, proc, log, start_error=start_error)
            if start_error is None:
                worker.pump = threading.Thread(target=self.pump, args=(worker,), daemon=True)
                worker.pump.start()
            else:
                log.close()
            self.workers[rank] = worker
            self.send(
                {
                    "t": "started",
                    "rank": rank,
                    "attempt": attempt,
                    "pid": proc.pid,
                    "at": time.time(),
                }
            )

    def _child_env(self, env: dict[str, str]) -> dict[str, str]:
        """What every process of the pod sees, before its rank is set."""
        child_env = {**os.environ, **self.plan.env, **env}
        child_env.update(
            RELAUNCH_PROGRESS_SOCKET="@" + self.progress_name,
            RELAUNCH_INJECT_DIR=str(self.inject_dir),
            RELAUNCH_WORKDIR=str(self.workdir),
            PYTHONPATH=os.pathsep.join(
                p for p in (str(INJECT_DIR), child_env.get("PYTHONPATH", "")) if p
            ),
            PYTHONUNBUFFERED="1",
            # `python` in the command means the Python relaunch runs on, venv included.
            PATH=os.pathsep.join((str(Path(sys.executable).parent), child_env.get("PATH", ""))),
        )
        return child_env

    # -- warm spares ----------------------------------------------------------------------------

    def refill_spares(self) -> None:
        """Keep `warm_spares` spare processes started, for commands a spare can become."""
        if not self.plan.warm_spares or self.spare_argv is None:
            return
        self.spares = [sp for sp in self.spares if sp.proc.poll() is None]
        while len(self.spares) < self.plan.warm_spares:
            proc = subprocess.Popen(
                [sys.executable, "-m", "relaunch._spare"],
                cwd=self.workdir,
                env=self._child_env(self.last_env or {}),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
            spare = Spare(proc, threading.Event())
            threading.Thread(target=self._await_ready, args=(spare,), daemon=True).start()
            self.spares.append(spare)

    @staticmethod
    def _await_ready(spare: Spare) -> None:
        assert spare.proc.stdout is not None
        if spare.proc.stdout.readline().strip() == b"ready":
            spare.ready.set()

    def _take_spare(self) -> Spare | None:
        for spare in self.spares:
            if spare.ready.is_set() and spare.proc.poll() is None:
                self.spares.remove(spare)
                return spare
        return None

    def retire_spares(self) -> None:
        for spare in self.spares:
            with contextlib.suppress(OSError):
                spare.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                spare.proc.wait(timeout=5)
        self.spares = []

    def pump(self, worker: Worker) -> None:
        assert worker.proc.stdout is not None
        with worker.log:  # the pump owns the log: a child may write after its group leader died
            for raw in worker.proc.stdout:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                worker.log.write(line + "\n")
                worker.log.flush()
                message = {"t": "output", "rank": worker.rank, "attempt": worker.attempt}
                self.send({**message, "line": line[:2000]})
        # Output closed: the rank has most likely exited. Check now rather than at the next
        # monitor interval, so that a crash is reported at once (not taken for a hang).
        self.commands.put({"t": "check", "rank": worker.rank})

    def monitor(self) -> None:
        for worker in list(self.workers.values()):
            code = worker.proc.poll()
            if code is None or worker.reported:
                continue
            if worker.pump is not None:
                worker.pump.join(timeout=1.0)
            worker.reported = True
            signum = -code if code < 0 else None
            self.send(
                {
                    "t": "exit",
                    "rank": worker.rank,
                    "attempt": worker.attempt,
                    "code": None if signum else code,
                    "signal": signum,
                    "expected": worker.stopping,
                    "at": time.time(),
                    "detail": worker.start_error or "",
                }
            )

    def send_usage(self) -> None:
        """CPU time and I/O of each running rank (its whole process tree), when they changed:
        the controller counts a rank that computes or does I/O as alive though it is silent.
        One walk of the process table per sample, whatever the number of ranks."""
        running = [w for w in self.workers.values() if not w.start_error and w.proc.poll() is None]
        if not running:
            return
        children = _children_by_parent()
        ranks: dict[str, list[float]] = {}
        for worker in running:
            usage = _tree_usage(worker.proc.pid, children)
            if usage is not None and usage != worker.usage:
                worker.usage = usage
                ranks[str(worker.rank)] = [usage[0], usage[1]]
        if ranks:
            self.send({"t": "usage", "attempt": self.attempt, "at": time.time(), "ranks": ranks})

    def stop(self, grace: float, ranks: list[int] | None = None) -> None:
        """SIGTERM every process group, SIGKILL what is left after `grace` seconds."""
        chosen = [w for w in self.workers.values() if ranks is None or w.rank in ranks]
        for worker in chosen:
            worker.stopping = True
        targets = [w for w in chosen if w.start_error is None]  # pid 0 would be our own group
        for worker in targets:
            if worker.proc.poll() is None:
                _signal_group(worker.proc.pid, signal.SIGCONT)
                if grace > 0:
                    _terminate(worker.proc.pid)
                else:
                    _signal_group(worker.proc.pid, signal.SIGKILL)
        # Wait for every process of each group, not only its leader: a shell dies at once on
        # SIGTERM while the Python under it is still saving its dying gasp.
        deadline = time.time() + grace
        while time.time() < min(deadline, self.kill_by()) and any(
            _group_alive(w.proc) for w in targets
        ):
            time.sleep(0.02)
        for worker in targets:
            _signal_group(worker.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=5)
        self.monitor()

    def inject(self, message: dict[str, Any]) -> None:
        """A fault plan's process fault; the controller hears back whether it fired, and why not."""
        rank = int(message["rank"])
        worker = self.workers.get(rank)
        why = self._inject(worker, message)
        self.send(
            {
                "t": "injected",
                "index": message.get("index"),
                "ok": why is None,
                "why": why or "",
                "at": time.time(),
            }
        )

    def _inject(self, worker: Worker | None, message: dict[str, Any]) -> str | None:
        if worker is None or worker.start_error:
            return f"rank {message['rank']} has no process in pod {self.plan.pod}"
        if worker.proc.poll() is not None:
            return f"rank {worker.rank} has exited (code {worker.proc.returncode})"
        if message["kind"] == "hang":
            _signal_group(worker.proc.pid, signal.SIGSTOP)
            return None
        code = int(message.get("exit_code", 1))
        try:
            tree = [
                psutil.Process(worker.proc.pid),
                *psutil.Process(worker.proc.pid).children(recursive=True),
            ]
        except psutil.NoSuchProcess:
            return f"rank {worker.rank} has exited"
        pythons = [p for p in tree if _is_python(p)] or tree[:1]
        for process in pythons:
            (self.inject_dir / str(process.pid)).write_text(str(code))
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGUSR2)
        return None

    def assume(self, plan: LaunchPlan) -> None:
        """A standby launcher becomes the launcher of a pod moved to its node; its warm spares
        will become the pod's processes."""
        if not self.plan.standby or self.workers:
            return
        self.plan = plan
        self.workdir = Path(plan.workdir)
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.inject_dir = self.workdir / "inject"
        self.inject_dir.mkdir(exist_ok=True)
        (self.workdir / "launch.json").write_text(json.dumps(asdict(plan)))

    def write_membership(self, membership: dict[str, Any]) -> None:
        """The process group's membership, where the training SDK reads it (atomically replaced)."""
        target = self.workdir / "membership.json"
        partial = target.with_suffix(".json.part")
        partial.write_text(json.dumps(membership))
        os.replace(partial, target)

    # -- main loop ------------------------------------------------------------------------------

    def run(self) -> None:
        threading.Thread(target=self.connect_loop, daemon=True).start()
        threading.Thread(target=self.progress_loop, daemon=True).start()
        interval = self.plan.monitor_interval_s
        next_check = 0.0
        while self.running:
            try:
                message = self.commands.get(timeout=min(0.05, interval))
            except queue.Empty:
                message = None
            if message is not None:
                self.handle(message)
            now = time.time()
            self.flush_progress()
            if now >= next_check:
                self.flush_progress(force=True)
                self.monitor()
                self.refill_spares()
                next_check = now + interval
            if now - self.usage_sent_at >= self.plan.activity_interval_s:
                self.usage_sent_at = now
                self.send_usage()
            if self.abandoned():
                self.stop(self.plan.termination_grace_s)
                self.running = False

    def abandoned(self) -> bool:
        """No controller for `adopt_grace_s`: the pod is abandoned (see the module docstring)."""
        with self.lock:
            alone = self.alone_since
        if alone is None:
            return False
        if time.time() - alone > self.plan.adopt_grace_s:
            if self.abandoned_at is None:
                self.abandoned_at = time.time()
            return True
        return False

    def kill_by(self) -> float:
        """The latest moment a process of this pod may still run: once abandoned, at most
        `adopt_grace_s` (and the job's grace) after that. A stop in progress checks it too."""
        if not self.abandoned() or self.abandoned_at is None:
            return float("inf")
        grace = min(self.plan.termination_grace_s, self.plan.adopt_grace_s)
        return self.abandoned_at + grace

    def handle(self, message: dict[str, Any]) -> None:
        kind = message["t"]
        if kind == "check":
            worker = self.workers.get(int(message["rank"]))
            deadline = time.time() + 0.5  # its output closes a moment before it can be reaped
            while worker is not None and worker.proc.poll() is None and time.time() < deadline:
                time.sleep(0.01)
            self.monitor()
        elif kind == "start":
            self.start(int(message["attempt"]), message["env"], message.get("ranks"))
        elif kind == "stop":
            self.stop(float(message["grace"]), message.get("ranks"))
            self.send({"t": "stopped", "attempt": self.attempt, "at": time.time()})
        elif kind == "inject":
            self.inject(message)
        elif kind == "membership":
            self.write_membership(message["m"])
        elif kind == "assume":
            self.assume(LaunchPlan(**message["plan"]))
        elif kind == "shutdown":
            self.stop(float(message.get("grace", 0)))
            self.send({"t": "stopped", "attempt": self.attempt, "at": time.time(), "final": True})
            self.running = False


class _NotStarted:
    """Stands in for the Popen of a command that could not be started: it has "exited"."""

    pid = 0
    stdout = None

    def __init__(self, code: int) -> None:
        self.returncode = code

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def kill(self) -> None:
        return None


def _children_by_parent() -> dict[int, list[int]]:
    """Every process's children, from one walk of the process table."""
    children: dict[int, list[int]] = {}
    for process in psutil.process_iter(["ppid"]):
        parent = process.info.get("ppid")
        if parent:
            children.setdefault(int(parent), []).append(process.pid)
    return children


def _tree_usage(pid: int, children: dict[int, list[int]]) -> tuple[float, int] | None:
    """CPU seconds (user + system) and bytes read and written, summed over a process and its
    descendants; None if it is gone."""
    family, queue_ = [], [pid]
    while queue_:
        current = queue_.pop()
        family.append(current)
        queue_.extend(children.get(current, ()))
    cpu, io, seen = 0.0, 0, False
    for member in family:
        try:
            process = psutil.Process(member)
            with process.oneshot():
                times = process.cpu_times()
                cpu += times.user + times.system
                counters = process.io_counters()
                io += int(getattr(counters, "read_chars", 0)) + int(
                    getattr(counters, "write_chars", 0)
                )
            seen = True
        except (psutil.Error, AttributeError):
            continue
    return (round(cpu, 2), io) if seen else None


def _spare_argv(command: list[str]) -> list[str] | None:
    """`[script, args...]` when the command is `python script.py args` (directly or through
    /bin/sh -c without shell syntax): what a warm spare can become. None otherwise."""
    if command[:2] == ["/bin/sh", "-c"] and len(command) == 3:
        if any(ch in command[2] for ch in ";|&<>$`()*?~\n"):
            return None
        command = shlex.split(command[2])
    if len(command) < 2 or not Path(command[0]).name.startswith("python"):
        return None
    if not command[1].endswith(".py"):
        return None
    return command[1:]


def _signal_group(pid: int, signum: int) -> None:
    if pid <= 0:
        return  # killpg(0) would signal the launcher's own group
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


SHELLS = {"sh", "dash", "bash", "zsh", "ksh"}


def _terminate(leader: int) -> None:
    """SIGTERM for a rank's processes. A shell that runs the command is left to exit with its
    child: killed first, it would take the child with it (PR_SET_PDEATHSIG) before the child's
    dying gasp could save anything."""
    try:
        shell = psutil.Process(leader)
        children = shell.children(recursive=True) if shell.name() in SHELLS else []
    except psutil.Error:
        children = []
    if not children:
        _signal_group(leader, signal.SIGTERM)
        return
    for child in children:
        with contextlib.suppress(psutil.Error):
            if child.name() not in SHELLS:
                child.send_signal(signal.SIGTERM)


def _group_alive(proc: subprocess.Popen[bytes]) -> bool:
    """Some process of the group led by `proc` still runs (zombies do not count)."""
    proc.poll()
    try:
        members = [p for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == proc.pid]
    except psutil.Error:
        return False
    return any(_running(p) for p in members)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _is_python(process: psutil.Process) -> bool:
    try:
        name = process.name()
        exe = os.path.basename(process.exe())
    except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
        return False
    return name.startswith("python") or exe.startswith("python")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="relaunch.launcher")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--plan", type=Path, required=True)
    args = parser.parse_args(argv)
    plan = LaunchPlan(**json.loads(args.plan.read_text()))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    launcher = Launcher(args.state_dir, plan)
    try:
        launcher.run()
    finally:
        launcher.retire_spares()
        launcher.stop(0.0)


if __name__ == "__main__":
    main()
