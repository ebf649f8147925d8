"""The launcher: one per pod, the pod's "container". Run as `python -m relaunch.launcher`.

It starts the job's command as `procs_per_pod` processes (`ranks`: each in its own process
group and, where the pod is a cgroup, its rank's cgroup, with torchrun's and ModelArts'
environment), reads their output into per-rank logs and relays it, their steps and SDK phases to
the controller (`relay`); learns of each exit at once (a pidfd per process; where the kernel has
none, every `monitor_interval`); samples the CPU time and I/O of ranks that gave no other sign
of life; stops them with SIGTERM then SIGKILL after the grace period; keeps warm spares
(`spares`) and the rank template its ranks are forked from (`template`); injects a fault
plan's faults (`injection`). Its link to the controller
(`link`) keeps the processes running while no controller is connected and ends them once the
pod is abandoned (no controller for `adopt_grace_s`, or no word for the lease, R-14): SIGTERM,
SIGKILL once the job's grace (bounded by that wait) has passed, also when a stop was under way.

It sleeps until something happens: one loop waits on the controller's commands, the SDK's
datagrams and the processes' exits at once, and otherwise only until the next thing that is due
(a progress batch, a usage sample, the end of the adopt grace). A pod whose ranks train costs a
few wake-ups a second, whatever the monitor interval.
"""

from __future__ import annotations

import contextlib
import os
import queue
import selectors
import signal
import subprocess
import threading
import time
from pathlib import Path

from relaunch.containers import Cgroup, step_out
from relaunch.launcher.injection import inject
from relaunch.launcher.link import ControllerLink
from relaunch.launcher.mindspore import Scheduler
from relaunch.launcher.processes import (
    Worker,
    forget_stat,
    group_alive,
    sample_busy,
    signal_group,
    terminate,
    usage_changes,
)
from relaunch.launcher.ranks import INJECT_DIR, Pod, pod_environment, rank_error, start_rank
from relaunch.launcher.relay import ProgressRelay
from relaunch.launcher.stacks import capture_aside
from relaunch.protocol.layout import PodDir
from relaunch.protocol.messages import (
    Assume,
    CaptureStacks,
    Exited,
    Injected,
    InjectProcessFault,
    LauncherHello,
    MembershipUpdate,
    Message,
    Output,
    ProcReport,
    Shutdown,
    Stacks,
    Start,
    Started,
    Stop,
    Stopped,
    Usage,
)
from relaunch.protocol.plans import LaunchPlan, write_atomically

__all__ = ["INJECT_DIR", "Launcher"]

SPARE_SETTLE_S = 30.0
"""How long after their start ranks that report no steps count as training (spares_wanted)."""
HOUSEKEEPING_S = 5.0
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
        self.pod = Pod.of(plan, self.dir, container, lambda: self.wake())
        self.spares, self.template = self.pod.spares, self.pod.template
        self.scheduler = Scheduler(plan, self.dir, container)  # MindSpore's, in its pod 0
        self.commands: queue.Queue[Message] = queue.Queue()
        self.workers: dict[int, Worker] = {}
        self.attempt = 0
        self.last_env: dict[str, str] = {}
        self.running = True
        self.ended_as_asked: dict[int, tuple[int, int | None, int | None]] = {}
        """Ranks a stop ended (rank -> attempt, code, signal), told in its `Stopped`."""
        self.usage_sent_at = 0.0
        self.link = ControllerLink(state_dir, plan, self.hello, self.post, self.wake)
        self.relay = ProgressRelay(
            f"relaunch-{os.getpid()}-{plan.job}-{plan.pod}-{plan.generation}",
            plan.progress_interval_s,
            self.link.send,
        )
        self.events = selectors.DefaultSelector()
        self.wake_read, self.wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.events.register(self.relay.urgent, selectors.EVENT_READ, "progress")
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

    def read_progress(self) -> None:
        """The SDK's datagrams that arrived (the relay sends what cannot wait at once), then a
        look at each rank: its output, whether it is busy."""
        urgent = self.relay.drain(self.workers, self.attempt)
        for worker in self.workers.values():
            if not worker.reported:
                self.read_output(worker)
            if worker.started and worker.attempt == self.attempt and worker.proc.poll() is None:
                sample_busy(worker)
        self.relay.flush(self.workers, force=urgent)

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
            if rank == 0:  # MindSpore's cluster forms anew around a scheduler of its own
                self.scheduler.start(attempt, self._child_env(env))
                self.scheduler.watch(self.events)
            worker = start_rank(self.pod, self._child_env(env), attempt, rank, local_rank)
            self.workers[rank] = worker
            pids[rank] = worker.proc.pid
            self._watch_exit(worker)
        if pids:
            self.link.send(Started(attempt, time.time(), pids))
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

    def rank_cgroup(self, rank: int) -> Cgroup | None:
        return self.pod.rank_cgroup(rank)

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
        self.scheduler.stop(0.0)  # in its own session: it would outlive the launcher
        if self.container is None:
            return
        for name in ["spares", *(f"rank-{rank}" for rank in self.workers)]:
            cgroup = self.container.child(name)
            cgroup.kill()
            cgroup.wait_empty(5.0)
        step_out(self.container, levels=1)  # pod, node, cluster: removed if this was the last

    def _child_env(self, env: dict[str, str]) -> dict[str, str]:
        """What every process of the pod sees, before its rank is set."""
        return pod_environment(self.plan, self.dir, env, self.relay.environment())

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
            self.link.send(Output(worker.rank, worker.attempt, line[:2000]))

    def monitor(self) -> None:
        lost = self.scheduler.failed()
        rank_0 = self.workers.get(0)
        if lost is not None and rank_0 is not None and rank_0.proc.poll() is None:
            rank_0.ended_by = lost  # its exit says why: found now, not at MindSpore's time-out
            signal_group(rank_0.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                rank_0.proc.wait(timeout=5)
        drained = False
        for worker in list(self.workers.values()):
            code = worker.proc.poll()
            if code is None or worker.reported:
                continue
            if not drained:  # what the rank reported before it exited goes first, due or not
                self.read_progress()
                self.relay.flush(self.workers, force=True, urgent=False)  # the exit rings next
                drained = True
            self._unwatch_exit(worker)
            self.end_rank(worker)
            self.read_output(worker, final=True)
            if worker.output is not None:
                worker.output.close()
            worker.reported = True
            signum = -code if code < 0 else None
            error = rank_error(worker, self.dir) if code != 0 and worker.started else None
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
            self.link.send(
                Exited(
                    rank=worker.rank,
                    attempt=worker.attempt,
                    code=None if signum else code,
                    signal=signum,
                    at=time.time(),
                    detail=worker.start_error or worker.ended_by or "",
                    error=error,
                )
            )

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
        ranks, working, stopped = usage_changes(silent, self.rank_cgroup, self.container is None)
        if ranks:
            self.link.send(Usage(self.attempt, time.time(), ranks, working, stopped))

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
        while time.time() < min(deadline, self.link.kill_by()) and any(
            group_alive(w.proc) for w in targets
        ):
            time.sleep(0.02)
        if any(w.rank == 0 for w in chosen):
            self.scheduler.stop(max(0.0, min(deadline, self.link.kill_by()) - time.time()))
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
        why = inject(
            self.workers.get(message.rank),
            message,
            list(self.workers.values()),
            self.dir.inject,
            self.plan.pod,
            lambda: self.running,
        )
        self.link.send(Injected(message.index, why is None, why or "", time.time()))

    def assume(self, plan: LaunchPlan) -> None:
        """A standby launcher becomes the launcher of a pod moved to its node; its warm spares
        will become the pod's processes."""
        if not self.plan.standby or self.workers:
            return
        self.plan = self.link.plan = self.pod.plan = plan
        self.dir = self.pod.dir = PodDir(Path(plan.workdir))
        self.dir.logs.mkdir(parents=True, exist_ok=True)
        self.dir.inject.mkdir(exist_ok=True)
        self.dir.plan.write_text(plan.to_json())

    # -- main loop ------------------------------------------------------------------------------

    def run(self) -> None:
        # the rank template's imports run while the controller gathers the pods
        self.template.start(
            Path(self.plan.working_dir or self.dir.path), self._child_env(self.last_env or {})
        )
        threading.Thread(target=self.link.serve, daemon=True).start()
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
            if now >= self.relay.due():
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
            if self.link.abandoned():
                self.stop(self.link.abandon_grace())
                self.running = False

    def next_due(self, next_check: float) -> float:
        """When the loop must wake if nothing happens before: the next process check, progress
        batch, usage sample, spare refill or the end of the adopt grace."""
        due = [next_check, self.usage_sent_at + self.plan.activity_interval_s]
        if any(w.started and w.proc.poll() is None for w in self.workers.values()):
            due.append(self.relay.due())
        abandoned_at = self.link.due()
        if abandoned_at is not None:
            due.append(abandoned_at)
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

    def handle(self, message: Message) -> None:
        match message:
            case Start(attempt=attempt, env=env, ranks=ranks):
                self.start(attempt, env, ranks)
            case Stop(grace=grace, ranks=ranks):
                self.stop(grace, ranks)
                self.link.send(Stopped(self.attempt, time.time(), exited=self.stop_ended()))
            case InjectProcessFault():
                self.inject(message)
            case CaptureStacks(request=request, timeout_s=timeout_s):
                pids = {
                    w.rank: w.proc.pid
                    for w in self.workers.values()
                    if w.started and w.proc.poll() is None and w.attempt == self.attempt
                }
                attempt = self.attempt
                capture_aside(
                    pids, timeout_s, lambda s: self.link.send(Stacks(request, attempt, s))
                )
            case MembershipUpdate(membership=membership):
                write_atomically(self.dir.membership, membership.to_json())
            case Assume(plan=plan):
                self.assume(plan)
            case Shutdown(grace=grace):
                self.stop(grace)  # its answer is the close: the controller waits for that
                self.running = False
