"""The specialists side by side (`relaunch bench --only peers`): the same faults on the same
model, data and step time, each peer in its own virtual environment (`make peers`, under
`.peers/` or $RELAUNCH_PEERS_DIR) and written in its own idiom, beside relaunch's best level for
each fault, all in one run.

Per peer and fault: the stall (fault to the first step any rank commits after it), the rejoin
(fault to the first step of the rank that was struck, or of its replacement), steps lost, how
many ranks restarted, and whether the fault was detected at all. A peer that cannot take a
fault says why instead of a number.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relaunch.cluster.local import free_port, kill_tree
from relaunch_bench import timeline, torchrun
from relaunch_bench.jobs import FAULT_STEP, Progress, _script
from relaunch_bench.mttr import relaunch_once

PEERS_ENV = "RELAUNCH_PEERS_DIR"
PEER_VERSIONS = {
    "torchft": "torchft==0.2.0",
    "nvrx": "nvidia-resiliency-ext==0.4.1",
    "dlrover": "dlrover[k8s,torch]==0.6.1",
}
"""Each peer's pinned release, as `make peers` installs it (beside torch==2.13.0)."""
FAULTS = ("crash", "hang", "lost-node", "link-flap")
FLAP = "flap 10 s"
"""The link fault of the flap rows (relaunch_bench.network): node 1's data link down 10 s."""
TORCHFT_HEARTBEAT_MS = 1000
"""The lighthouse's heartbeat timeout: torchft's tuned setting (its default is 5000 ms)."""
STEPS = 400
"""Steps of a peer's run: the fault at FAULT_STEP and time enough after it for a replacement
to rejoin (at about 0.025 s a step)."""
RELAUNCH_LEVELS = {
    "crash": ("process-in-place+spare", "job-reschedule+spare"),
    "hang": ("hang-restart+spare",),
    "lost-node": ("process-reschedule+spare",),
}
"""relaunch's best levels for each fault, measured beside the peers in the same run: for a
crash, replacing one rank (process level, against torchft's survivor) and restarting every rank
(job level, against the launchers that restart every rank)."""
RESTART_ALL = ("torchrun", "NVRx", "DLRover")
"""The peers that restart every rank on a crash: relaunch's job level is measured against them."""
TORCHFT_DDP = _script("torchft_ddp.py")
"""examples/peers/torchft_ddp.py: train_ddp.py's job in torchft's idiom."""
PLAIN_DDP = _script("plain_ddp.py")
"""examples/peers/plain_ddp.py: train_ddp.py's job as a plain script, for the launchers that
restart every rank (NVRx's ft_launcher, DLRover's dlrover-run)."""
NVRX_HEARTBEAT_S = 4.0
"""ft_launcher's rank heartbeat timeout: a hang is a rank silent this long (relaunch's DDP rows
use a 4 s hang window)."""


@dataclass
class PeerRow:
    """One system and fault: medians of its samples, or why there are none."""

    system: str
    fault: str
    repeats: int = 0
    failures: int = 0
    stall_s: float | None = None
    rejoin_s: float | None = None
    detect_s: float | None = None
    lost_steps: float | None = None
    ranks_restarted: int | None = None
    detected: bool | None = None
    note: str = ""
    samples: list[float] = field(default_factory=list)


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


# -- torchft -------------------------------------------------------------------------------------

Events = list[tuple[str, int, float, int]]


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


# -- the launchers that restart every rank -----------------------------------------------------


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


def _launcher_sample(path: Path, fault: str, finished: bool) -> PeerSample:
    """A launcher that restarts every rank, read off rank 0's timeline: the stall is the fault
    to the first step after it (of the restarted ranks)."""
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
    )


# -- relaunch ------------------------------------------------------------------------------------


def relaunch_sample(level: str, tmp: Path) -> PeerSample:
    """relaunch at `level` on train_ddp.py, 2 pods of 1 rank."""
    sample = relaunch_once("ddp", level, tmp, procs=1)
    if not sample.ok or sample.mttr_s is None:
        return PeerSample(False, note=sample.note)
    return PeerSample(
        True,
        stall_s=sample.mttr_s,
        rejoin_s=sample.mttr_s,  # the job steps again only with every rank back
        lost_steps=sample.lost_steps,
        ranks_restarted=2 if level.startswith(("job", "hang")) else 1,  # hang-restart: every rank
        detected=True,
        detect_s=sample.detect_s,
    )


def torchrun_sample(tmp: Path) -> PeerSample:
    """torchrun (c10d rendezvous, --max-restarts 3) on train_ddp.py, 2 agents of 1 rank."""
    sample = torchrun.crash_once(tmp, procs=1)
    if not sample.ok or sample.mttr_s is None:
        return PeerSample(False, note=sample.note)
    return PeerSample(
        True,
        stall_s=sample.mttr_s,
        rejoin_s=sample.mttr_s,
        lost_steps=sample.lost_steps,
        ranks_restarted=2,
        detected=True,
    )


# -- the table ---------------------------------------------------------------------------------


def _row(system: str, fault: str, samples: list[PeerSample]) -> PeerRow:
    good = [s for s in samples if s.ok and s.stall_s is not None]
    notes = sorted({s.note for s in samples if s.note})

    def med(values: list[float]) -> float | None:
        return round(statistics.median(values), 3) if values else None

    return PeerRow(
        system=system,
        fault=fault,
        repeats=len(samples),
        failures=len(samples) - len(good),
        stall_s=med([s.stall_s for s in good if s.stall_s is not None]),
        rejoin_s=med([s.rejoin_s for s in good if s.rejoin_s is not None]),
        detect_s=med([s.detect_s for s in good if s.detect_s is not None]),
        lost_steps=med([float(s.lost_steps) for s in good if s.lost_steps is not None]),
        ranks_restarted=max((s.ranks_restarted or 0 for s in good), default=None),
        detected=all(s.detected for s in good) if good else None,
        note="; ".join(notes),
        samples=[round(s.stall_s, 3) for s in good if s.stall_s is not None],
    )


def flap_rows(say: Progress, relaunch: bool = True) -> list[PeerRow]:
    """A 10 s flap of node 1's data link (real, in network namespaces: root needed), against a
    fault-free run of the same system: the time it cost, as the network section measures it."""
    from relaunch.cluster.network import ClusterNetwork
    from relaunch_bench.network import fault_rows

    systems = [
        ("torchrun (c10d)", "torchrun"),
        ("torchft (1 s heartbeat)", "torchft"),
        (f"NVRx ft_launcher ({NVRX_HEARTBEAT_S:g} s heartbeat)", "nvrx"),
    ]
    if relaunch:
        systems.insert(0, ("relaunch operator-retry", "operator"))
    why = ClusterNetwork.unavailable()
    rows = []
    for system, variant in systems:
        if why is not None:
            rows.append(PeerRow(system, "link-flap", note=f"not measured: {why}"))
            continue
        (measured,) = fault_rows(system, variant, (FLAP,), say)
        # torchft's survivor trains on alone while the cut replica is out (faster than two):
        # its cost is the survivor's stall, not the time against a fault-free run
        lost = measured["stall_s"] if variant == "torchft" else measured["lost_s"]
        link = measured.get("link") or (
            "its collective failed on the cut link (the operator retry's record)"
            if variant == "operator"
            else None
        )
        if measured.get("link_carried") is False:  # the flap cut nothing this system sends
            rows.append(
                PeerRow(system, "link-flap", repeats=1, failures=1, note=f"not counted: {link}")
            )
            continue
        rows.append(
            PeerRow(
                system,
                "link-flap",
                repeats=1,
                failures=0 if lost is not None else 1,
                stall_s=lost,
                lost_steps=measured["redone_steps"],
                ranks_restarted=measured["restarts"],
                detected=variant == "operator" or bool(measured["restarts"]),
                note=(
                    "the survivor's longest stall"
                    if variant == "torchft"
                    else "time lost against a fault-free run"
                )
                + f"; {measured['what']}"
                + (f"; {link}" if link else ""),
                samples=[lost] if lost is not None else [],
            )
        )
    rows.append(
        PeerRow(
            "DLRover dlrover-run --standalone",
            "link-flap",
            note="standalone mode runs every rank on one node: there is no link between them to cut",
        )
    )
    return rows


def peer_rows(
    repeats: int, say: Progress, faults: tuple[str, ...] = FAULTS, relaunch: bool = True
) -> list[dict[str, Any]]:
    """Every peer and relaunch (unless `relaunch` is False) on each fault, `repeats` times
    each, in one run."""
    rows: list[PeerRow] = []
    for fault in faults:
        if fault == "link-flap":
            rows += flap_rows(say, relaunch)
            continue
        systems: list[tuple[str, Any]] = []
        if relaunch:
            systems += [(f"relaunch {level}", level) for level in RELAUNCH_LEVELS[fault]]
            if fault == "crash":
                systems.append(("torchrun (c10d)", "torchrun"))
        systems.append(("torchft (1 s heartbeat)", peer_python("torchft")))
        systems.append(
            (f"NVRx ft_launcher ({NVRX_HEARTBEAT_S:g} s heartbeat)", peer_python("nvrx"))
        )
        systems.append(("DLRover dlrover-run --standalone", peer_python("dlrover")))
        for system, python in systems:
            if isinstance(python, str) and system.startswith(("relaunch", "torchrun")):
                pass  # measured here, from this venv
            elif isinstance(python, str):
                rows.append(PeerRow(system, fault, note=python))
                say(f"{system} {fault}: {python}")
                continue
            samples = []
            for i in range(repeats):
                with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
                    if system.startswith("relaunch"):
                        sample = relaunch_sample(python, Path(tmp))
                    elif system.startswith("torchrun"):
                        sample = torchrun_sample(Path(tmp))
                    elif system.startswith("torchft"):
                        sample = torchft_once(python, fault, Path(tmp))
                    elif system.startswith("NVRx"):
                        sample = nvrx_once(python, fault, Path(tmp))
                    else:
                        sample = dlrover_once(python, fault, Path(tmp))
                samples.append(sample)
                shown = f"stall {sample.stall_s} s" if sample.ok else f"failed ({sample.note})"
                say(f"{system} {fault} #{i + 1}: {shown}")
            rows.append(_row(system, fault, samples))
    return [asdict(r) for r in rows]


def _ratio_pairs(
    rows: list[dict[str, Any]],
) -> dict[str, tuple[dict[str, Any] | None, dict[str, Any] | None]]:
    """Each ratio's two rows: relaunch's and the best peer's (the smallest stall measured), per
    fault: a crash twice, one rank replaced against torchft's survivor and every rank restarted
    against the launchers that restart every rank."""

    def best(fault: str, prefixes: tuple[str, ...]) -> dict[str, Any] | None:
        found = [
            r
            for r in rows
            if r["fault"] == fault and r["system"].startswith(prefixes) and r["stall_s"]
        ]
        return min(found, key=lambda r: r["stall_s"]) if found else None

    return {
        "crash, one rank (process-in-place+spare / torchft)": (
            best("crash", ("relaunch process-in-place",)),
            best("crash", ("torchft",)),
        ),
        "crash, every rank (job-reschedule+spare / best of torchrun, NVRx, DLRover)": (
            best("crash", ("relaunch job-reschedule",)),
            best("crash", RESTART_ALL),
        ),
        "hang (hang-restart / best peer)": (
            best("hang", ("relaunch",)),
            best("hang", ("torchft", *RESTART_ALL)),
        ),
        "lost node (process-reschedule+spare / best peer)": (
            best("lost-node", ("relaunch",)),
            best("lost-node", ("torchft", *RESTART_ALL)),
        ),
        "link flap 10 s (operator-retry / best peer)": (
            best("link-flap", ("relaunch",)),
            best("link-flap", ("torchft", *RESTART_ALL)),
        ),
    }


def peer_ratio_spreads(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Each ratio's spread over the runs: from relaunch's fastest run against the peer's
    slowest to relaunch's slowest against the peer's fastest (a ratio of medians alone moved
    from 0.21 to 0.41 between two runs of the bench)."""
    spreads = {}
    for name, (ours, theirs) in _ratio_pairs(rows).items():
        if ours is None or theirs is None:
            continue
        a = [v for v in ours.get("samples") or [ours["stall_s"]] if v]
        b = [v for v in theirs.get("samples") or [theirs["stall_s"]] if v]
        if a and b:
            spreads[name] = (round(min(a) / max(b), 2), round(max(a) / min(b), 2))
    return spreads


def peer_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """relaunch's stall over the best peer's, per fault (where both were measured), as
    `_ratio_pairs` pairs them: the ratio of the two rows' medians."""
    pairs = {
        name: (ours["stall_s"] if ours else None, theirs["stall_s"] if theirs else None)
        for name, (ours, theirs) in _ratio_pairs(rows).items()
    }
    ratios = {k: round(a / b, 2) for k, (a, b) in pairs.items() if a is not None and b}
    detected = [
        r.get("detect_s")
        for r in rows
        if r["fault"] == "hang" and r["system"].startswith("relaunch")
    ]
    if detected and detected[0] is not None:  # not a ratio: the target is the window + 0.2 s
        ratios[f"hang: seconds detected past its {NVRX_HEARTBEAT_S:g} s window"] = round(
            detected[0] - NVRX_HEARTBEAT_S, 2
        )
    return ratios
