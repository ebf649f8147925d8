"""Running real jobs on the embedded cluster from tests: `relaunch run` as a user runs it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import yaml

from relaunch.cluster.config import parse_cluster
from relaunch.cluster.nvml import simulate_args
from relaunch.errors import InputError
from relaunch.events import EventKind, Recorded
from relaunch.restores import restores
from relaunch.store import Store

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "examples" / "train_toy.py"

FAST_CLUSTER = {
    "nodes": 4,
    "chips_per_node": 2,
    "heartbeat_interval_s": 0.2,
    "heartbeat_timeout_s": 1.0,
    "adopt_grace_s": 3,
}
AUTO = {"fault-tolerance/job-retry-num": "4"}
UNCONDITIONAL = {**AUTO, "fault-tolerance/job-unconditional-retry": "true"}
POD_LEVEL = {**AUTO, "fault-tolerance/pod-retry-num": "2"}
HANG = {**AUTO, "fault-tolerance/hang-retry": "true"}
HANG_S = 1.5
MONITOR_S = 0.1


def toy_job(
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    steps: int = 40,
    replicas: int = 2,
    args: str = "",
    **spec: Any,
) -> dict[str, Any]:
    return {
        "kind": "job",
        "metadata": {
            "name": "e2e",
            "annotations": annotations or {},
            "labels": {"fault-scheduling": "grace", "grace-over-time": "1", **(labels or {})},
        },
        "spec": {
            "replicas": replicas,
            "procs_per_pod": 2,
            "chips_per_pod": 2,
            "command": f"python {TOY} --steps {steps} --step-seconds 0.03 {args}",
            "hang_detect_seconds": HANG_S,
            "monitor_interval": MONITOR_S,
            **spec,
        },
    }


DDP_JOB = yaml.safe_load((ROOT / "examples" / "ddp" / "job.yaml").read_text())
DDP_CLUSTER = yaml.safe_load((ROOT / "examples" / "cluster-small.yaml").read_text())
DDP_FAULTS = [
    {**f, "rank": f["pod"]} if "rank" in f else f  # one rank per pod in the tests: see ddp_job
    for f in yaml.safe_load((ROOT / "examples" / "ddp" / "faults.yaml").read_text())["faults"]
]
"""The example's fault plan (a crash, a chip fault, a lost node, a hang), on the tests' ranks."""


def ddp_job(
    out: Path, ckpt_every: int = 10, process: bool = False, extra: str = "", steps: int = 120
) -> dict[str, Any]:
    """The PyTorch DDP example, `steps` steps, writing its final parameters' SHA-256 to `out`; one
    process per pod (world size 2) so that each restart costs two torch start-ups, not four, on
    the tests' two cores. `process`: its process-level job file (examples/ddp/process-job.yaml)
    and the script's `--process-recovery`; `extra`: more of the script's arguments."""
    job = yaml.safe_load((ROOT / "examples" / "ddp" / "process-job.yaml").read_text())
    if not process:
        job = yaml.safe_load(yaml.safe_dump(DDP_JOB))
    job["spec"]["procs_per_pod"] = 1
    recovery = " --process-recovery" if process else ""
    job["spec"]["command"] = (
        f"python {ROOT / 'examples' / 'ddp' / 'train_ddp.py'}{recovery} --steps {steps} "
        f"--ckpt-every {ckpt_every} --out {out}{' ' + extra if extra else ''}"
    )
    return job


class Restore(NamedTuple):
    """A restore on a job's record: which rank restored which step from which tier, and who
    held the bytes (a node, a rank, "" for storage)."""

    pod: int
    rank: int
    step: int
    tier: str
    holder: str


@dataclass
class Result:
    returncode: int
    report: dict[str, Any]
    stdout: str
    stderr: str
    state_dir: Path

    @property
    def actions(self) -> list[str]:
        return [r["action"] for r in self.report["recoveries"]]

    def assert_pod_moved_off_lost_node(self, node: str, why: str) -> None:
        """The run succeeded by one pod-level rescheduling, and `node` was lost for `why`."""
        assert self.returncode == 0, self.stdout + self.stderr
        assert self.actions == ["pod-reschedule"]
        lost = [(e.fields["node"], e.fields["why"]) for e in self.said(EventKind.NODE_LOST)]
        assert any(n == node and said.startswith(why) for n, said in lost), lost

    def events(self) -> list[Recorded]:
        """The job's record, in order."""
        return list(Store(self.state_dir / "relaunch.db").events(self.report["id"]))

    def said(self, kind: EventKind) -> list[Recorded]:
        """The job's events of `kind`, in order."""
        return [event for event in self.events() if event.kind is kind]

    def restores(self) -> list[Restore]:
        """Each restore on the job's record, in order."""
        return [
            Restore(r["pod"], r["rank"], r["step"], r["tier"], r["holder"])
            for r in restores(self.events())
        ]

    def logs(self) -> str:
        return "\n".join(
            p.read_text() for p in sorted((self.state_dir / "jobs").glob("*/pods/*/logs/*.log"))
        )

    def launch_nodes(self) -> list[str]:
        """Every node any pod of the job was ever started on, in generation order."""
        plans = [
            json.loads(p.read_text())
            for p in (self.state_dir / "jobs").glob("*/pods/*/launch.json")
        ]
        return [p["node"] for p in sorted(plans, key=lambda p: (p["generation"], p["pod"]))]


def _simulated_where_too_few_gpus(cluster: dict[str, Any]) -> tuple[str, ...]:
    """`--simulate-chips` where this machine has GPUs but fewer than the cluster's chips (none
    for a cluster file a test makes wrong on purpose: relaunch itself is to refuse it)."""
    try:
        nodes = parse_cluster(cluster).nodes
    except InputError:
        return ()
    return simulate_args(sum(n.chips for n in nodes))


class Cluster:
    """A state directory and the files of one test."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.state = tmp / "state"

    def write(self, name: str, data: Any) -> Path:
        path = self.dir / name
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    def command(
        self,
        job: dict[str, Any],
        faults: list[dict[str, Any]] | None = None,
        cluster: dict[str, Any] | None = None,
        extra: tuple[str, ...] = (),
        startup_s: float | None = 8,
    ) -> list[str]:
        """`relaunch run` for `job`; `startup_s` None leaves the allowance to the job's spec."""
        args = [
            sys.executable, "-m", "relaunch", "run", str(self.write("job.yaml", job)),
            "--cluster", str(self.write("cluster.yaml", cluster or FAST_CLUSTER)),
            "--state-dir", str(self.state), "--report", str(self.dir / "report.json"),
            "-q", *_simulated_where_too_few_gpus(cluster or FAST_CLUSTER), *extra,
        ]  # fmt: skip
        if startup_s is not None:
            args += ["--startup-seconds", str(startup_s)]
        if faults is not None:
            args += ["--faults", str(self.write("faults.yaml", {"faults": faults}))]
        return args

    def run(
        self,
        job: dict[str, Any],
        faults: list[dict[str, Any]] | None = None,
        cluster: dict[str, Any] | None = None,
        timeout: float = 90,
        startup_s: float | None = 8,
    ) -> Result:
        done = subprocess.run(
            self.command(job, faults, cluster, startup_s=startup_s),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            check=False,
        )
        return self.result(done.returncode, done.stdout, done.stderr)

    def result(self, returncode: int, stdout: str = "", stderr: str = "") -> Result:
        report_path = self.dir / "report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
        return Result(returncode, report, stdout, stderr, self.state)

    def resume_command(self) -> list[str]:
        """`relaunch run --resume` of the run whose controller was killed."""
        return [
            sys.executable, "-m", "relaunch", "run", "--resume",
            "--cluster", str(self.dir / "cluster.yaml"), "--state-dir", str(self.state),
            "--report", str(self.dir / "report.json"), "--startup-seconds", "8", "-q",
        ]  # fmt: skip

    def resume(self, timeout: float = 90) -> Result:
        done = subprocess.run(
            self.resume_command(),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            check=False,
        )
        return self.result(done.returncode, done.stdout, done.stderr)

    def signal_agent(self, node: str, signum: int) -> None:
        """Send `signum` to `node`'s agent (its pid as the embedded cluster recorded it)."""
        agent = json.loads((self.state / "pids.json").read_text())["agents"][node][0]
        os.kill(agent, signum)

    def signal_agent_at_step(
        self, run: subprocess.Popen[str], step: int, node: str, signum: int
    ) -> Result:
        """Once the job run by `run` (its controller, started or resumed) has recorded `step`,
        send `signum` to `node`'s agent; the run's result when it ends (90 s at most)."""
        try:
            deadline = time.monotonic() + 60
            while not _reached(self.state, step):
                alive = run.poll() is None
                assert alive and time.monotonic() < deadline, f"the job did not reach step {step}"
                time.sleep(0.05)
            self.signal_agent(node, signum)
            said, _ = run.communicate(timeout=90)
        finally:
            run.kill()
        return self.result(run.returncode, said)


def _reached(state: Path, step: int) -> bool:
    db = state / "relaunch.db"
    jobs = Store(db).jobs() if db.exists() else []
    return bool(jobs) and (jobs[0].last_step or 0) >= step


def processes_of(state_dir: Path) -> list[psutil.Process]:
    """Every live process that belongs to this state directory: agents, launchers, workers."""
    mark = str(state_dir)
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.pid == os.getpid() or process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            cmdline = " ".join(process.info["cmdline"] or [])
            environ = process.environ() if mark not in cmdline else {}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if mark in cmdline or any(mark in v for v in environ.values()):
            found.append(process)
    return found


def rank_logs(directory: Path) -> str:
    """The rank logs (`*.log`) of one pod's `logs` directory, as they are now ("" before any)."""
    return "".join(p.read_text() for p in directory.glob("*.log")) if directory.exists() else ""


FLAP_S = 6.0
"""How long a flap of a data link lasts in the R-29 tests on Slurm and Ray: longer than the
collective timeout the operator-retry job sets (3 s), shorter than its re-issues last (the first
5 s after the failure, 8 in all, 1 s apart)."""


def flap_pod_1_at_step_40(tmp: Path, set_data_link: Callable[[str, bool], None]) -> None:
    """Once the job's rank 0 printed step 40: pod 1's node's data link down for `FLAP_S`, then
    up again (`set_data_link(node, up)`: the engine's trial cluster cuts its switch port)."""
    node = pod_1_node_at_step_40(tmp)
    set_data_link(node, False)
    try:
        time.sleep(FLAP_S)
    finally:
        set_data_link(node, True)


def assert_issued_again_nothing_restarted(
    result: Result, steps: Path, out: Path, unbroken: str
) -> None:
    """R-29's promise after a flap: one operator retry that worked, for the failed collective; no
    process restarted (each of the two ranks started once); every step of the 120 once, in
    order; the parameters bit for bit the fault-free run's."""
    from relaunch_bench import timeline

    records = result.report["recoveries"]
    actions = [(r["action"], r["outcome"]) for r in records]
    assert actions == [("operator-retry", "succeeded")], result.stdout
    assert records[0]["fault"]["kind"] == "collective", records
    assert result.logs().count("--- relaunch: attempt") == 2, "a process restarted"
    done = [s for e, s, _ in timeline.read(steps) if e == "step"]
    assert done == list(range(1, 121)), "a step ran twice, or one is missing"
    assert out.read_text().strip() == unbroken, result.stdout


def pod_1_node_at_step_40(tmp: Path) -> str:
    """Once the job's rank 0 printed step 40: the node pod 1 runs on (the run's state in
    `tmp`/state, its output, said if it never gets there, in `tmp`/out.txt)."""
    logs = tmp / "state" / "jobs" / "1" / "pods"
    deadline = time.monotonic() + 120
    while "step 40" not in rank_logs(logs / "pod-0-g1" / "logs"):
        assert time.monotonic() < deadline, (tmp / "out.txt").read_text()
        time.sleep(0.2)
    return str(json.loads((logs / "pod-1-g1" / "launch.json").read_text())["node"])


def wait_gone(state_dir: Path, timeout: float) -> list[psutil.Process]:
    deadline = time.time() + timeout
    left = processes_of(state_dir)
    while left and time.time() < deadline:
        time.sleep(0.1)
        left = processes_of(state_dir)
    return left


def kill_all(state_dir: Path) -> None:
    for process in processes_of(state_dir):
        try:
            process.send_signal(signal.SIGCONT)
            process.kill()
        except psutil.NoSuchProcess:
            pass


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server:
    """`relaunch server` as an operator starts it: a real process on a loopback port."""

    def __init__(self, tmp: Path, *extra: str, cluster: dict[str, Any] | None = None) -> None:
        self.dir = tmp
        self.state = tmp / "state"
        self.extra = extra
        self.cluster_file = tmp / "cluster.yaml"
        self.cluster_file.write_text(yaml.safe_dump(cluster or FAST_CLUSTER))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[str] | None = None
        self.output = ""

    def start(self, timeout: float = 120) -> Server:
        """Until /healthz answers (at once when it does). The allowance is for a loaded
        machine: at a suite's start, beside the other worker's first runs, a server once
        had not answered, nor printed a line, after 20 s."""
        import httpx

        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "relaunch",
                "server",
                "--port",
                str(self.port),
                "--state-dir",
                str(self.state),
                "--cluster",
                str(self.cluster_file),
                *self.extra,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"server did not start: {self.stop()}")

    @property
    def token(self) -> str:
        return (self.state / "server-token").read_text().strip()

    def stop(self, kill: bool = False) -> str:
        """Stops the server process (not its jobs' runner); returns what this run printed."""
        out = ""
        if self.process is not None:
            if kill:
                self.process.kill()
            else:
                self.process.terminate()
            try:
                out, _ = self.process.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                out, _ = self.process.communicate()
            out = out or ""
            self.output += out
            self.process = None
        return out


def wait_status(pid: int, status: str, timeout: float = 30.0) -> None:
    """Until the process is in `status` (a psutil STATUS_*): sleeping once its interpreter
    reached its sleep, stopped once a SIGSTOP took. Polled: a busy machine takes its time."""
    deadline = time.monotonic() + timeout
    while psutil.Process(pid).status() != status:
        assert time.monotonic() < deadline, f"process {pid} never became {status}"
        time.sleep(0.01)


def asleep(pid: int) -> None:
    """Until a freshly started `python -c "...time.sleep(60)"` sleeps in it."""
    wait_status(pid, psutil.STATUS_SLEEPING)


FSDP_SCRIPT = ROOT / "examples" / "fsdp" / "train_fsdp2.py"


def torchrun(ranks: int, *args: str, cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(ranks), str(FSDP_SCRIPT), "--step-seconds", "0", *args],
        capture_output=True, text=True, timeout=180, cwd=cwd, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def final_hash(output: str) -> str:
    found = re.findall(r"done: params sha256 ([0-9a-f]{64})", output)
    assert len(found) == 1, output[-2000:]
    return found[0]


def ready_spare(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A warm spare (`python -m relaunch._spare`) started with `env`, once it said ready: its
    stdin takes the identity line."""
    spare = subprocess.Popen(
        [sys.executable, "-m", "relaunch._spare"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
    )  # fmt: skip
    assert spare.stdout is not None and spare.stdin is not None
    assert spare.stdout.readline().strip() == b"ready"
    return spare
