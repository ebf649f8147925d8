"""The launcher's parts on their own: its link to the controller (what waits while none is
connected, when the pod is abandoned), the relay of the SDK's reports, and the faults it injects
into real processes. (Every end-to-end test runs them together.)"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from relaunch.launcher.injection import inject, slow_down
from relaunch.launcher.link import ControllerLink
from relaunch.launcher.processes import NotStarted, Worker
from relaunch.launcher.ranks import INJECT_DIR
from relaunch.launcher.relay import ProgressRelay
from relaunch.protocol.datagrams import (
    SdkPhase,
    collective_failure_datagram,
    phase_datagram,
    progress_datagram,
)
from relaunch.protocol.messages import (
    CollectiveFailed,
    Exited,
    InjectProcessFault,
    LauncherHello,
    Lease,
    Message,
    Output,
    ProgressBatch,
    Restored,
    Shutdown,
    Start,
    Started,
    Stopped,
    decode,
    encode,
)
from relaunch.protocol.plans import LaunchPlan
from relaunch.protocol.wire import write_controller_address
from tests.runtime import ready_spare


def _plan(tmp: Path, adopt_grace_s: float = 30.0, lease_s: float | None = None) -> LaunchPlan:
    return LaunchPlan(
        job=1, pod=0, generation=1, node="node-0", command=("true",), procs_per_pod=1,
        first_rank=0, working_dir=None, monitor_interval_s=0.1, adopt_grace_s=adopt_grace_s,
        workdir=str(tmp / "pod"), termination_grace_s=20.0, lease_s=lease_s,
    )  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Controller:
    """A listening socket standing for the controller: what each connection said, in order."""

    def __init__(self, state: Path) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        write_controller_address(state, "127.0.0.1", self.server.getsockname()[1], os.getpid())
        self.conn: socket.socket | None = None
        self.lines: list[Message] = []

    def accept(self) -> None:
        self.server.settimeout(10)
        self.conn, _ = self.server.accept()
        self.conn.settimeout(0.2)

    def heard(self, count: int) -> list[Message]:
        assert self.conn is not None
        buffer, deadline = b"", time.time() + 10
        while len(self.lines) < count and time.time() < deadline:
            try:
                buffer += self.conn.recv(65536)
            except TimeoutError:
                continue
            *done, buffer = buffer.split(b"\n")
            self.lines += [m for m in (decode(line.decode()) for line in done) if m is not None]
        return self.lines

    def say(self, message: Message) -> None:
        assert self.conn is not None
        self.conn.sendall((encode(message) + "\n").encode())


def test_what_the_pod_said_while_no_controller_was_there_goes_first_to_the_next(
    tmp_path: Path,
) -> None:
    clock = Clock()
    commands: list[Message] = []
    hello = LauncherHello(1, 0, 1, os.getpid(), 1, "node-0")
    link = ControllerLink(
        tmp_path, _plan(tmp_path), lambda: hello, commands.append, lambda: None, clock
    )
    link.send(Exited(0, 1, 1, None, 5.0))
    link.send(Output(0, 1, "a line nobody heard"))  # output is not kept: the log has it
    # a replaced rank restored while the controller was away: which tier served, for the record
    link.send(Restored(0, 1, 40, "peer-memory", "node-1", 5.5))
    link.send(Stopped(1, 6.0))
    controller = Controller(tmp_path)
    threading.Thread(target=link.serve, daemon=True).start()
    controller.accept()
    assert controller.heard(4)[:4] == [
        hello, Exited(0, 1, 1, None, 5.0), Restored(0, 1, 40, "peer-memory", "node-1", 5.5), Stopped(1, 6.0)
    ]  # fmt: skip
    controller.say(Lease())
    controller.say(Start(2, {}))
    deadline = time.time() + 10
    while not commands and time.time() < deadline:
        time.sleep(0.01)
    assert commands == [Start(2, {})], "a lease is the link's own, a command the launcher's"
    assert link.alone_since is None and not link.abandoned()


def test_a_pod_alone_past_the_adopt_grace_is_abandoned_for_good(tmp_path: Path) -> None:
    clock = Clock()
    link = ControllerLink(
        tmp_path, _plan(tmp_path, adopt_grace_s=30), lambda: None, print, lambda: None, clock
    )  # type: ignore[arg-type]
    assert link.due() == 1030.0
    clock.t = 1029.0
    assert not link.abandoned() and link.kill_by() == float("inf")
    clock.t = 1031.0
    assert link.abandoned() and not link.fenced
    assert link.kill_by() == 1031.0 + 20.0  # the job's grace, within the adopt grace
    link.alone_since = None  # a controller that would come now changes nothing
    assert link.abandoned()


def test_a_connected_pod_that_hears_nothing_for_its_lease_stops_within_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """R-14: a node cut off from the controller, its connection still open."""
    clock = Clock()
    link = ControllerLink(
        tmp_path, _plan(tmp_path, lease_s=4.0), lambda: None, print, lambda: None, clock
    )  # type: ignore[arg-type]
    link.alone_since, link.heard_at = None, 1000.0
    assert link.due() == 1004.0
    clock.t = 1003.9
    assert not link.abandoned()
    clock.t = 1004.5
    assert link.abandoned() and link.fenced
    assert link.abandon_grace() == 4.0, "its processes' grace bounded by the lease"
    assert "no word from the controller for 4.5 s (lease 4 s, R-14)" in capsys.readouterr().out


def _worker(rank: int, proc: subprocess.Popen[bytes] | NotStarted, attempt: int = 1) -> Worker:
    return Worker(rank, rank, attempt, proc, None)


def test_the_relay_sends_a_first_step_and_a_phase_at_once_and_steps_once_an_interval() -> None:
    sent: list[tuple[Message, bool | None]] = []
    relay = ProgressRelay(
        f"relaunch-test-{os.getpid()}", 10.0, lambda m, urgent=None: sent.append((m, urgent))
    )
    workers = {3: _worker(3, NotStarted(0))}
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    progress, urgent = (
        relay.environment()["RELAUNCH_PROGRESS_SOCKET"],
        relay.environment()["RELAUNCH_URGENT_SOCKET"],
    )
    address = lambda name: "\0" + name[1:]  # noqa: E731
    sender.sendto(progress_datagram(3, 1, 50.0), address(urgent))
    assert relay.drain(workers, 1), "a rank's first step goes at once"
    relay.flush(workers, force=True)
    ((batch, ring),) = sent
    assert isinstance(batch, ProgressBatch) and ring is True
    assert [(p.rank, p.step, p.at) for p in batch.reports] == [(3, 1, 50.0)]
    for step in (2, 3, 4):
        sender.sendto(progress_datagram(3, step), address(progress))
    assert not relay.drain(workers, 1)
    relay.flush(workers)  # within the interval of the last batch: kept
    assert len(sent) == 1
    relay.sent_at -= 10.0
    relay.flush(workers)
    assert [p.step for p in sent[-1][0].reports] == [4], "the newest step of each rank"
    sender.sendto(phase_datagram(3, SdkPhase.CHECKPOINT), address(urgent))
    assert relay.drain(workers, 1)
    sender.sendto(collective_failure_datagram(3, 7, 2, 1, "Connection reset"), address(urgent))
    relay.drain(workers, 1)
    failed = [m for m, u in sent if isinstance(m, CollectiveFailed)]
    assert failed and failed[0].step == 7 and failed[0].why == "Connection reset"
    sender.sendto(b"not a datagram", address(urgent))
    assert not relay.drain(workers, 1)


def test_an_older_step_read_after_a_newer_one_does_not_replace_it() -> None:
    """A phase sends its step on the urgent socket, which the relay reads first; a routine step
    reported before it, still in the other queue, must not make the save's step look older."""
    sent: list[tuple[Message, bool | None]] = []
    relay = ProgressRelay(
        f"relaunch-test-order-{os.getpid()}", 10.0, lambda m, urgent=None: sent.append((m, urgent))
    )
    workers = {0: _worker(0, NotStarted(0))}
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    address = lambda name: "\0" + name[1:]  # noqa: E731
    routine = address(relay.environment()["RELAUNCH_PROGRESS_SOCKET"])
    urgent = address(relay.environment()["RELAUNCH_URGENT_SOCKET"])
    sender.sendto(progress_datagram(0, 38, 100.0), routine)
    sender.sendto(progress_datagram(0, 40, 101.0), urgent)
    sender.sendto(phase_datagram(0, SdkPhase.CHECKPOINT), urgent)
    assert relay.drain(workers, 1)
    relay.flush(workers, force=True)
    ((batch, _),) = sent
    assert isinstance(batch, ProgressBatch)
    assert [(p.step, p.at) for p in batch.reports] == [(40, 101.0)]
    assert [p.phase for p in batch.phases] == [SdkPhase.CHECKPOINT]
    sender.sendto(progress_datagram(0, 31, 102.0), routine)  # later: a rollback's step counts
    relay.drain(workers, 1)
    relay.flush(workers, force=True)
    assert [p.step for p in sent[-1][0].reports] == [31]
    sender.close()


def _sleeper(tmp: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(INJECT_DIR), "RELAUNCH_INJECT_DIR": str(tmp)}
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nprint('ready', flush=True)\nwhile True: time.sleep(0.01)",
        ],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
    )


def _ready(proc: subprocess.Popen[bytes]) -> None:
    """The process ran its first line: its sitecustomize (run before it) installed its handler."""
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"


def test_injected_faults_are_real_a_hang_stops_the_rank_an_exit_ends_it_with_its_code(
    tmp_path: Path,
) -> None:
    hung, crashing = _sleeper(tmp_path), _sleeper(tmp_path)
    try:
        _ready(hung)
        _ready(crashing)
        workers = [_worker(0, hung), _worker(1, crashing)]
        assert (
            inject(workers[0], InjectProcessFault(0, "hang", 0), workers, tmp_path, 0, lambda: True)
            is None
        )
        deadline = time.time() + 5
        while psutil.Process(hung.pid).status() != psutil.STATUS_STOPPED and time.time() < deadline:
            time.sleep(0.02)
        assert psutil.Process(hung.pid).status() == psutil.STATUS_STOPPED
        exit_fault = InjectProcessFault(1, "exit", 1, exit_code=42)
        assert inject(workers[1], exit_fault, workers, tmp_path, 0, lambda: True) is None
        assert crashing.wait(timeout=10) == 42
        assert inject(workers[1], exit_fault, workers, tmp_path, 0, lambda: True) == (
            "rank 1 has exited (code 42)"
        )
        assert inject(None, exit_fault, workers, tmp_path, 3, lambda: True) == (
            "rank 1 has no process in pod 3"
        )
    finally:
        for proc in (hung, crashing):
            proc.kill()
            proc.wait()


def test_a_slow_pod_runs_a_share_of_the_time_and_is_left_running_after(tmp_path: Path) -> None:
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        time.sleep(0.3)
        before = psutil.Process(spin.pid).cpu_times()
        started = time.time()
        slow_down([_worker(0, spin)], factor=4.0, duration_s=2.0)
        after = psutil.Process(spin.pid).cpu_times()
        used = (after.user + after.system) - (before.user + before.system)
        assert used < 0.6 * (time.time() - started), "it ran most of the time"
        assert psutil.Process(spin.pid).status() != psutil.STATUS_STOPPED
    finally:
        spin.kill()
        spin.wait()


def _may_raise_priority() -> bool:
    from relaunch import _spare

    return _spare._may_raise_to(os.getpriority(os.PRIO_PROCESS, 0))


@pytest.mark.skipif(
    not _may_raise_priority(),
    reason="needs CAP_SYS_NICE (root) or an RLIMIT_NICE that lets a process raise its priority "
    "back: without it a spare keeps the launcher's priority",
)
def test_a_spare_waits_at_a_lower_priority_and_every_thread_trains_at_the_launchers(
    tmp_path: Path,
) -> None:
    """A warm spare imports and waits SPARE_NICENESS lower than its launcher (a refill must not
    slow the ranks training beside it); once it becomes a rank, every thread it has (the
    imports' too: Linux keeps a niceness per thread) is back at the launcher's priority."""
    from relaunch._spare import SPARE_NICENESS

    (tmp_path / "starts_a_thread.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
    )
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, pathlib\n"
        "nices = [int(pathlib.Path(f'/proc/self/task/{t}/stat').read_text().rsplit(')', 1)[1]"
        ".split()[16]) for t in os.listdir('/proc/self/task')]\n"
        "print('threads', len(nices), 'nice', sorted(set(nices)), flush=True)\n"
    )
    env = {**os.environ, "RELAUNCH_SPARE_PRELOAD": "starts_a_thread", "PYTHONPATH": str(tmp_path)}
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    spare = ready_spare(env)
    try:
        assert spare.stdin is not None
        waiting = [t.id for t in psutil.Process(spare.pid).threads()]
        assert len(waiting) >= 2, "the preloaded module's thread runs"
        for task in waiting:
            assert os.getpriority(os.PRIO_PROCESS, task) == min(19, ours + SPARE_NICENESS)
        log = tmp_path / "rank.log"
        identity = {"env": env, "argv": [str(script)], "cwd": str(tmp_path), "log": str(log)}
        spare.stdin.write((json.dumps(identity) + "\n").encode())
        spare.stdin.close()
        assert spare.wait(timeout=30) == 0
    finally:
        spare.kill()
    threads, nices = log.read_text().split("nice")
    assert int(threads.split()[1]) >= 2
    assert nices.strip() == f"[{ours}]"


def test_a_launcher_whose_last_stop_raises_still_closes_its_container(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the final stop raised, the pod's processes are killed and its cgroups removed:
    a launcher that skipped it exited inside its cgroup, with what its ranks started there."""
    import relaunch.launcher.__main__ as launcher_main

    calls: list[str] = []

    class Raising:
        def __init__(self, *args: object) -> None:
            self.spares = self.template = self

        def run(self) -> None:
            calls.append("run")

        def kill(self) -> None:
            calls.append("kill")

        def retire(self) -> None:
            calls.append("retire")

        def stop(self, grace: float) -> None:
            calls.append("stop")
            raise OSError("the stop failed")

        def close_container(self) -> None:
            calls.append("close_container")

    monkeypatch.setattr(launcher_main, "Launcher", Raising)
    monkeypatch.setattr(launcher_main.signal, "signal", lambda *args: None)  # not pytest's own
    monkeypatch.setattr(launcher_main.LaunchPlan, "from_json", staticmethod(lambda text: None))
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    with pytest.raises(OSError, match="the stop failed"):
        launcher_main.main(["--state-dir", str(tmp_path), "--plan", str(plan)])
    assert calls == ["run", "kill", "kill", "retire", "stop", "close_container"]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_shutdown_is_answered_by_the_close_with_every_rank_ended(tmp_path: Path) -> None:
    """A real launcher told to shut down stops its ranks and closes its connection, with no
    `Stopped` before it: the controller waits for the close (a job-level restart of 4,096 pods
    decoded 4,095 of them for nothing)."""
    plan = replace(
        _plan(tmp_path),
        command=(sys.executable, "-c", "import time; time.sleep(120)"),
        procs_per_pod=2,
    )
    (tmp_path / "plan.json").write_text(plan.to_json())
    controller = Controller(tmp_path)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "relaunch.launcher", "--state-dir", str(tmp_path),
         "--plan", str(tmp_path / "plan.json")],
    )  # fmt: skip
    try:
        controller.accept()
        assert isinstance(controller.heard(1)[0], LauncherHello)
        controller.say(Start(1, {}))
        deadline = time.time() + 20
        while not (started := [m for m in controller.lines if isinstance(m, Started)]):
            assert time.time() < deadline, controller.lines
            controller.heard(len(controller.lines) + 1)
        assert sorted(started[0].pids) == [0, 1], started
        ranks = [psutil.Process(pid) for pid in started[0].pids.values()]
        before = len(controller.lines)
        controller.say(Shutdown(5.0))
        assert controller.conn is not None
        controller.conn.settimeout(20)
        rest = b""
        while chunk := controller.conn.recv(65536):  # until the launcher closes its end
            rest += chunk
        said = controller.lines[before:] + [decode(line) for line in rest.splitlines()]
        assert not [m for m in said if isinstance(m, Stopped)], said
        assert launcher.wait(timeout=20) == 0
        assert not [r for r in ranks if _alive(r)]
    finally:
        launcher.kill()
        launcher.wait()


@pytest.mark.parametrize(
    ("host_processes", "procs_per_pod", "job_env", "user_env", "expected"),
    [
        (2, 1, {}, None, "1"),  # two one-process pods on the embedded cluster's one machine
        (1, 1, {}, None, None),  # the job's only process keeps every core
        (0, 2, {}, None, "1"),  # a plan written before host_processes: the pod's count
        (4, 2, {"OMP_NUM_THREADS": "3"}, None, "3"),  # the job says otherwise
        (4, 2, {}, "6", "6"),  # so does the user's environment, as under torchrun
    ],
)
def test_several_processes_on_one_machine_take_one_openmp_thread_each(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    host_processes: int,
    procs_per_pod: int,
    job_env: dict[str, str],
    user_env: str | None,
    expected: str | None,
) -> None:
    """Issue 49: the torchrun form's one-process pods all ran on this machine's cores with
    OpenMP's default of a thread per core each; an unmodified Hugging Face Trainer script ran 5
    times slower than with one thread each. torchrun's rule (several processes on one host:
    OMP_NUM_THREADS=1 unless set) now counts the job's processes that share the node's cores."""
    from relaunch.launcher.ranks import pod_environment
    from relaunch.protocol.layout import PodDir

    if user_env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", user_env)
    plan = replace(
        _plan(tmp_path), host_processes=host_processes, procs_per_pod=procs_per_pod, env=job_env
    )
    env = pod_environment(plan, PodDir(tmp_path / "pod"), {}, {})
    assert env.get("OMP_NUM_THREADS") == expected


@pytest.mark.parametrize(("shared", "expected"), [(True, 4), (False, 2)])
def test_a_pods_plan_counts_the_processes_that_share_its_nodes_cores(
    tmp_path: Path, shared: bool, expected: int
) -> None:
    """The embedded cluster's nodes are one machine: every process of the job shares its cores;
    elsewhere (Ray's hosts), the pod's own."""
    from relaunch.controller import commands
    from tests.controller_sim import Sim, job_spec

    sim = Sim(tmp_path, job_spec(replicas=2, procs_per_pod=2))
    sim.engine.facts = dataclasses.replace(sim.engine.facts, nodes_share_cores=shared)  # type: ignore[misc]
    c = sim.controller
    plan = commands.launch_plan(c, c.pods[0].row)
    assert plan.host_processes == expected


FAKE_TORCH = """\
import os
calls = []
class cuda:
    @staticmethod
    def is_available():
        return True
    @staticmethod
    def init():
        calls.append("init")
    @staticmethod
    def device_count():
        return len(os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(","))  # a 2-GPU machine
    @staticmethod
    def set_device(index):
        calls.append(f"set_device {index}")
def empty(*shape, device=None):
    calls.append(f"empty on {device}")
"""
"""A stand-in for torch's CUDA calls a spare makes, recording them (this machine has no GPU;
the real one is tests/test_gpus.py's test_a_warm_spare_starts_cuda_on_its_pods_gpu)."""


def _spare_with_fake_cuda(
    tmp_path: Path, visible: str | None, wanted: str | None = None
) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    (tmp_path / "torch.py").write_text(FAKE_TORCH)
    env = {**os.environ, "RELAUNCH_SPARE_PRELOAD": "torch", "PYTHONPATH": str(tmp_path)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("RELAUNCH_SPARE_CUDA", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    if wanted is not None:
        env["RELAUNCH_SPARE_CUDA"] = wanted
    spare = subprocess.Popen(
        [sys.executable, "-m", "relaunch._spare"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
    )  # fmt: skip
    return spare, env


FAKE_CUDA_CASES = {
    # the pod's own GPUs: one, its context too; several, the driver only (which is the
    # rank's is not known yet)
    "one GPU": ("3", None, "ready cuda 3", ["init", "set_device 0", "empty on cuda"]),
    "two GPUs": ("2,3", None, "ready cuda 2,3", ["init"]),
    # pods that share the machine's GPUs (simulated chips): only when the job asks
    "shared, asked": (None, "1", "ready cuda all", ["init"]),
    "shared": (None, None, "ready", []),
    "turned off": ("3", "0", "ready", []),
}


@pytest.mark.parametrize("case", sorted(FAKE_CUDA_CASES))
def test_a_spare_starts_cuda_where_its_pod_has_gpus_and_becomes_a_rank_that_sees_them(
    tmp_path: Path, case: str
) -> None:
    visible, wanted, said, calls = FAKE_CUDA_CASES[case]
    spare, env = _spare_with_fake_cuda(tmp_path, visible, wanted)
    script = tmp_path / "rank.py"
    script.write_text("import torch\nprint('calls', torch.calls, flush=True)\n")
    log = tmp_path / "rank.log"
    try:
        assert spare.stdout is not None and spare.stdin is not None
        assert spare.stdout.readline().decode().strip() == said
        identity = {"env": env, "argv": [str(script)], "cwd": str(tmp_path), "log": str(log)}
        spare.stdin.write((json.dumps(identity) + "\n").encode())
        spare.stdin.close()
        assert spare.wait(timeout=30) == 0, log.read_text()
    finally:
        spare.kill()
    assert log.read_text().strip() == f"calls {calls}"


def test_a_spare_that_started_cuda_refuses_a_rank_that_sees_other_gpus(tmp_path: Path) -> None:
    from relaunch._spare import SPARE_REFUSED

    spare, env = _spare_with_fake_cuda(tmp_path, "3")
    log = tmp_path / "rank.log"
    try:
        assert spare.stdout is not None and spare.stdin is not None
        assert spare.stdout.readline().strip() == b"ready cuda 3"
        other = {**env, "CUDA_VISIBLE_DEVICES": "5"}
        identity = {"env": other, "argv": ["rank.py"], "cwd": str(tmp_path), "log": str(log)}
        spare.stdin.write((json.dumps(identity) + "\n").encode())
        spare.stdin.close()
        assert spare.wait(timeout=30) == SPARE_REFUSED
    finally:
        spare.kill()
    assert "started CUDA on GPUs 3 cannot be a rank that sees 5" in log.read_text()


def test_the_pool_hands_a_cuda_spare_only_to_a_rank_that_sees_its_gpus(tmp_path: Path) -> None:
    """A pod's GPUs changed since its spares started CUDA (a standby launcher's spares, started
    on its node's first chips, and a pod given others): they are retired, not handed on; a
    spare without CUDA may become any rank."""
    from relaunch.launcher.spares import SparePool

    (tmp_path / "torch.py").write_text(FAKE_TORCH)
    ready = threading.Semaphore(0)
    pool = SparePool(2, ("python", "train.py"), on_ready=ready.release)
    env = {**os.environ, "RELAUNCH_SPARE_PRELOAD": "torch", "PYTHONPATH": str(tmp_path)}
    env.pop("RELAUNCH_SPARE_CUDA", None)
    try:
        pool.refill(tmp_path, {**env, "CUDA_VISIBLE_DEVICES": "3"})
        assert ready.acquire(timeout=30) and ready.acquire(timeout=30)
        assert [s.cuda for s in pool.spares] == ["3", "3"]
        first = pool.spares[0].proc
        assert pool.take("5") is None and pool.spares == []  # both retired
        assert first.wait(timeout=10) is not None
        pool.refill(tmp_path, {**env, "CUDA_VISIBLE_DEVICES": "5"})
        assert ready.acquire(timeout=30) and ready.acquire(timeout=30)
        taken = pool.take("5")
        assert taken is not None and taken.cuda == "5"
        taken.proc.kill()
        pool.refill(tmp_path, {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"})
        assert ready.acquire(timeout=30)
        plain = [s for s in pool.spares if s.ready.is_set() and s.cuda is None]
        assert plain and plain[0].can_be("7") and plain[0].can_be(None)
    finally:
        pool.retire()


def test_a_rank_takes_a_spare_still_importing_at_the_launchers_priority_not_a_cold_start(
    tmp_path: Path,
) -> None:
    """A fault soon after a refill: no spare is ready, one is importing. The rank waits for
    that one (further along than a new process), and the spare imports on at the launcher's
    priority from then on (it started SPARE_NICENESS lower, not to slow the ranks beside it)."""
    import threading

    from relaunch.launcher.spares import SparePool

    gate, seen = tmp_path / "gate", tmp_path / "niceness"
    (tmp_path / "slow_import.py").write_text(
        "import os, pathlib, time\n"
        f"while not pathlib.Path({str(gate)!r}).exists():\n"
        "    time.sleep(0.01)\n"
        f"pathlib.Path({str(seen)!r}).write_text(str(os.getpriority(os.PRIO_PROCESS, 0)))\n"
    )
    env = {**os.environ, "RELAUNCH_SPARE_PRELOAD": "slow_import", "PYTHONPATH": str(tmp_path)}
    pool = SparePool(1, ("python", "train.py"))
    pool.refill(tmp_path, env)
    (spare_started,) = pool.spares
    assert not spare_started.ready.is_set()
    opener = threading.Timer(0.3, gate.write_text, args=("open",))
    opener.start()
    try:
        taken = pool.take()
    finally:
        opener.join()
        pool.retire()
    assert taken is spare_started and taken.ready.is_set()
    if _may_raise_priority():
        assert int(seen.read_text()) == os.getpriority(os.PRIO_PROCESS, 0)
    if taken.proc.poll() is None:
        taken.proc.kill()
    taken.proc.wait()


def test_a_spare_that_dies_while_importing_is_not_waited_for(tmp_path: Path) -> None:
    """The rank starts as it would without a spare (None: the template or a new process)."""
    from relaunch.launcher.spares import SparePool

    (tmp_path / "dies.py").write_text("import os\nos._exit(3)\n")
    env = {**os.environ, "RELAUNCH_SPARE_PRELOAD": "dies", "PYTHONPATH": str(tmp_path)}
    pool = SparePool(1, ("python", "train.py"))
    pool.refill(tmp_path, env)
    assert pool.take() is None
    assert pool.spares[0].proc.wait(timeout=30) == 3
