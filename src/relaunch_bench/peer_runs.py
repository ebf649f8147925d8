"""Each specialist run once on one fault (relaunch_bench.peers sets them side by side): torchft
with its lighthouse, NVRx's ft_launcher, DLRover's dlrover-run, each from its own virtual
environment (`make peers`, under `.peers/` or $RELAUNCH_PEERS_DIR), on the same model, data and
step time; what each run did, read from its timeline as a `PeerSample`.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relaunch.cluster.local import free_port, kill_tree
from relaunch_bench import timeline
from relaunch_bench.jobs import FAULT_STEP, _script

PEER_VERSIONS = {
    "torchft": "torchft==0.2.0",
    "nvrx": "nvidia-resiliency-ext==0.4.1",
    "dlrover": "dlrover[k8s,torch]==0.6.1",
}
"""Each peer's pinned release, as `make peers` installs it (beside torch==2.13.0)."""

Events = list[tuple[str, int, float, int]]

PEERS_ENV = "RELAUNCH_PEERS_DIR"


TORCHFT_HEARTBEAT_MS = 1000
"""The lighthouse's heartbeat timeout: torchft's tuned setting (its default is 5000 ms)."""


STEPS = 400
"""Steps of a peer's run: the fault at FAULT_STEP and time enough after it for a replacement
to rejoin (at about 0.025 s a step)."""


TORCHFT_DDP = _script("torchft_ddp.py")
"""examples/peers/torchft_ddp.py: train_ddp.py's job in torchft's idiom."""


PLAIN_DDP = _script("plain_ddp.py")
"""examples/peers/plain_ddp.py: train_ddp.py's job as a plain script, for the launchers that
restart every rank (NVRx's ft_launcher, DLRover's dlrover-run)."""


NVRX_HEARTBEAT_S = 4.0
"""ft_launcher's rank heartbeat timeout: a hang is a rank silent this long (relaunch's DDP rows
use a 4 s hang window)."""


@dataclass
class PeerSample:
    ok: bool
    stall_s: float | None = None
    rejoin_s: float | None = None
    lost_steps: int | None = None
    ranks_restarted: int | None = None
    detected: bool | None = None
    note: str = ""
    detect_s: float | None = None
    """Fault to its detection, where the system says when it detected it (relaunch's record)."""
    phases: dict[str, float] | None = None
    """Where the restart's time went (timeline.PHASES), where rank 0 restarted under relaunch."""


def peers_dir() -> Path:
    return Path(os.environ.get(PEERS_ENV) or Path.cwd() / ".peers")


def peer_python(peer: str) -> Path | str:
    """The peer's interpreter, or why there is none."""
    python = peers_dir() / peer / "bin" / "python"
    if not python.exists():
        return f"{peer} is not installed: `make peers` installs {PEER_VERSIONS[peer]} in {python.parent.parent}"
    return python


def peer_environment(bin_dir: Path) -> dict[str, str]:
    """This environment for a peer's processes: its venv first on PATH, nothing of relaunch's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RELAUNCH_", "VIRTUAL_ENV"))}
    env.update({"PATH": f"{bin_dir}:{env.get('PATH', '')}", "PYTHONUNBUFFERED": "1"})
    return env


def _end(procs: list[subprocess.Popen[bytes]], logs: list[Any]) -> None:
    """Kill every process a run started (their whole trees) and close their logs."""
    for proc in procs:
        kill_tree(proc.pid)
        proc.wait()
    for log in logs:
        log.close()


def _events(path: Path) -> Events:
    found = []
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                found.append((parts[0], int(parts[1]), float(parts[2]), int(parts[3])))
    return found


def torchft_once(python: Path, fault: str, tmp: Path) -> PeerSample:
    """Two replica groups of one rank, each under `torchrun --max-restarts 3` (how torchft's
    docs run one), and a lighthouse with min_replicas 1; replica 1 is struck at FAULT_STEP:
    `crash` exits 1 (its torchrun starts it again and it takes the model from replica 0 as it
    joins), `hang` SIGSTOPs it (its heartbeats stop: the lighthouse drops it), `lost-node`
    SIGKILLs its torchrun and rank (nothing starts it again: torchft has no scheduler)."""
    bin_dir = python.parent
    path = tmp / "timeline.txt"
    lighthouse_port, procs = free_port(), []
    logs = []

    def spawn(args: list[str], env: dict[str, str], name: str) -> subprocess.Popen[bytes]:
        log = open(tmp / f"{name}.log", "w")  # noqa: SIM115
        logs.append(log)
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True
        )
        procs.append(proc)
        return proc

    base = peer_environment(bin_dir)
    try:
        spawn(
            [str(bin_dir / "torchft_lighthouse"), "--min_replicas", "1", "--quorum_tick_ms", "100",
             "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", str(TORCHFT_HEARTBEAT_MS),
             "--bind", f"[::]:{lighthouse_port}"],
            base, "lighthouse",
        )  # fmt: skip
        strike = {"crash": "--crash-at-step", "hang": "--hang-at-step"}.get(fault)
        replicas = []
        for replica in (0, 1):
            env = {
                **base,
                "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lighthouse_port}",
                "REPLICA_GROUP_ID": str(replica),
            }
            args = [
                str(bin_dir / "torchrun"), "--nnodes", "1", "--nproc-per-node", "1",
                "--max-restarts", "3", "--monitor-interval", "0.1",
                "--master-port", str(free_port()),
                str(TORCHFT_DDP), "--steps", str(STEPS), "--timeline", str(path),
            ]  # fmt: skip
            if strike is not None:
                args += [strike, str(FAULT_STEP)]
            replicas.append(spawn(args, env, f"replica-{replica}"))
        fault_at = None
        deadline = time.time() + 180
        while time.time() < deadline and replicas[0].poll() is None:
            events = _events(path)
            reached = any(e == "step" and s >= FAULT_STEP - 1 for e, s, _, r in events if r == 1)
            if fault == "lost-node" and fault_at is None and reached:
                fault_at = time.time()
                kill_tree(replicas[1].pid)
            time.sleep(0.05)
        events = _events(path)
    finally:
        _end(procs, logs)
    return _torchft_sample(events, fault, fault_at)


def _torchft_sample(events: Events, fault: str, killed_at: float | None) -> PeerSample:
    struck = next(((s, t) for e, s, t, r in events if e in ("crash", "hang") and r == 1), None)
    fault_at = struck[1] if struck is not None else killed_at
    if fault_at is None:
        return PeerSample(False, note="the fault never struck")
    before = max((s for e, s, t, _ in events if e == "step" and t < fault_at), default=0)
    survivor = next((t for e, _, t, r in events if e == "step" and r == 0 and t > fault_at), None)
    if survivor is None:
        return PeerSample(False, note="replica 0 made no step after the fault")
    relaunched = next(
        (t for e, _, t, r in events if e == "launched" and r == 1 and t > fault_at), None
    )
    rejoin = (
        next((t for e, _, t, r in events if e == "step" and r == 1 and t > relaunched), None)
        if relaunched is not None
        else None
    )
    first_after = next(s for e, s, t, r in events if e == "step" and r == 0 and t > fault_at)
    return PeerSample(
        True,
        stall_s=round(survivor - fault_at, 3),
        rejoin_s=round(rejoin - fault_at, 3) if rejoin is not None else None,
        lost_steps=max(0, before + 1 - first_after),
        ranks_restarted=1 if relaunched is not None else 0,
        detected=True,
        note="" if rejoin is not None else "the struck replica never came back",
    )


def nvrx_once(python: Path, fault: str, tmp: Path) -> PeerSample:
    """Two `ft_launcher` agents (NVRx's torchrun, c10d rendezvous) of one rank each, the NIC
    monitor off (no NIC on a CPU machine), heartbeats from every step; rank 1 crashes or is
    SIGSTOPped at FAULT_STEP. A crash restarts every rank; a hang is a rank whose heartbeats
    stop for NVRX_HEARTBEAT_S, and restarts every rank too."""
    if fault == "lost-node":
        return PeerSample(
            False,
            note="a lost agent is replaced only by a scheduler starting a new one (SLURM, "
            "Kubernetes): ft_launcher alone waits for it",
        )
    strike = "--crash-at-step" if fault == "crash" else "--hang-at-step"
    path = tmp / "timeline.txt"
    finished = nvrx_run(python, tmp, ["--steps", "60", strike, str(FAULT_STEP)], 3, 240)
    return _launcher_sample(path, fault, finished)


def nvrx_run(
    python: Path, tmp: Path, script: list[str], max_restarts: int, timeout_s: float
) -> bool:
    """PLAIN_DDP under two `ft_launcher` agents (see `nvrx_once`) with `script`'s arguments,
    its timeline in tmp/timeline.txt; True if both agents finished."""
    bin_dir, port = python.parent, free_port()
    agents, logs = [], []
    env = peer_environment(bin_dir)
    try:
        for node in range(2):
            args = [
                str(bin_dir / "ft_launcher"), "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", "bench", "--max-restarts", str(max_restarts),
                "--monitor-interval", "0.1", "--ft-enable-nic-monitor", "false",
                "--ft-initial-rank-heartbeat-timeout", "60",
                "--ft-rank-heartbeat-timeout", str(NVRX_HEARTBEAT_S),
                str(PLAIN_DDP), "--nvrx", "--ckpt-dir", str(tmp / "ckpt"),
                "--timeline", str(tmp / "timeline.txt"), *script,
            ]  # fmt: skip
            log = open(tmp / f"agent-{node}.log", "w")  # noqa: SIM115
            logs.append(log)
            agents.append(
                subprocess.Popen(
                    args,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=tmp,
                    start_new_session=True,
                )
            )
        deadline = time.time() + timeout_s
        while time.time() < deadline and any(a.poll() is None for a in agents):
            time.sleep(0.1)
        return all(a.poll() == 0 for a in agents)
    finally:
        _end(agents, logs)


def dlrover_once(python: Path, fault: str, tmp: Path) -> PeerSample:
    """`dlrover-run --standalone` (its one-machine mode: one agent, here of both ranks; its
    multi-node mode needs its master on Kubernetes), the plain script; rank 1 crashes or is
    SIGSTOPped at FAULT_STEP. Standalone DLRover has no hang detection of its own: a hang
    ends with gloo's collective timeout (60 s, the script's default), then every rank restarts."""
    if fault == "lost-node":
        return PeerSample(
            False,
            note="standalone mode is one node: a lost node is the whole job (its master on "
            "Kubernetes replaces nodes)",
        )
    strike = "--crash-at-step" if fault == "crash" else "--hang-at-step"
    finished = dlrover_run(python, tmp, ["--steps", "60", strike, str(FAULT_STEP)], 3, 240)
    return _launcher_sample(tmp / "timeline.txt", fault, finished)


def dlrover_run(
    python: Path, tmp: Path, script: list[str], max_restarts: int, timeout_s: float
) -> bool:
    """PLAIN_DDP under `dlrover-run --standalone` (see `dlrover_once`) with `script`'s
    arguments, its timeline in tmp/timeline.txt; True if it finished."""
    bin_dir = python.parent
    args = [
        str(bin_dir / "dlrover-run"), "--standalone", "--nproc_per_node", "2",
        "--max_restarts", str(max_restarts), "--monitor_interval", "0.1",
        str(PLAIN_DDP), "--ckpt-dir", str(tmp / "ckpt"), "--timeline", str(tmp / "timeline.txt"),
        *script,
    ]  # fmt: skip
    with open(tmp / "dlrover.log", "w") as log:
        agent = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=peer_environment(bin_dir),
            cwd=tmp,
            start_new_session=True,
        )
        try:
            return agent.wait(timeout=timeout_s) == 0
        except subprocess.TimeoutExpired:
            return False
        finally:
            kill_tree(agent.pid)
            agent.wait()


def _launcher_sample(
    path: Path, fault: str, finished: bool, parts: bool = False, detect_s: float | None = None
) -> PeerSample:
    """A launcher that restarts every rank, read off rank 0's timeline: the stall is the fault
    to the first step after it (of the restarted ranks); with `parts`, where it went
    (timeline.PHASES; `detect_s` where the system says when it detected the fault, else the
    detection is counted in the stop)."""
    events = timeline.read(path)
    struck = next(((s, t) for e, s, t in events if e in ("crash", "hang")), None)
    if struck is None:
        return PeerSample(False, note="the fault never struck")
    after = [(e, s, t) for e, s, t in events if t > struck[1]]
    first = next(((s, t) for e, s, t in after if e == "step"), None)
    resumed = next((s for e, s, _ in after if e == "start"), None)
    if first is None or resumed is None:
        why = "no step after the fault" + ("" if finished else " (the job did not finish)")
        return PeerSample(False, detected=resumed is not None, note=why)
    before = max((s for e, s, t in events if e == "step" and t < struck[1]), default=0)
    return PeerSample(
        True,
        stall_s=round(first[1] - struck[1], 3),
        rejoin_s=round(first[1] - struck[1], 3),
        lost_steps=max(0, before - resumed),
        ranks_restarted=2,
        detected=True,
        detect_s=detect_s,
        phases=timeline.phases_of(events, struck[1], detect_s) if parts else None,
    )
