"""Link faults on real networks: what each costs the DDP job under relaunch, and the same script
under torchrun with its two agents in the same kind of namespaces and the same fault, side by
side in one run (root and iproute2 needed: otherwise the section says so and measures nothing).

torchrun has no notion of a link: its ranks wait in gloo until the collective's timeout (the
script's 60 s), then fail, and it restarts them all. relaunch's agents see the link (R-12, R-14,
a degraded link as a slow pod). Each fault hits pod 1's node at step FAULT_STEP of a 2 x 1 rank
job; each run is compared with a fault-free run of the same system:

- *time lost*: the run's wall time less the fault-free run's;
- *steps redone*: steps rank 0 completed twice (its timeline);
- *restarts*: how many times rank 0 started again;
- *what happened*: relaunch's records, or torchrun's restarts.
"""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relaunch.cluster.local import free_port, kill_tree
from relaunch.cluster.network import DATA_IF, ClusterNetwork, enter_namespace
from relaunch_bench import timeline
from relaunch_bench.jobs import DDP, FAULT_STEP, Progress, cluster, keep_failed, run_job
from relaunch_bench.link_traffic import LinkTraffic, _fault_at_step
from relaunch_bench.mttr import PROCESS_ANNOTATIONS, PROCESS_LABELS

STEPS = 300
FAULTS: dict[str, dict[str, Any]] = {
    "flap 10 s": {"kind": "network", "duration_s": 10},
    "loss 60 s": {"kind": "network", "duration_s": 60},
    "cut from peers 15 s": {"kind": "partition", "cut": "peers", "duration_s": 15},
    "cut from controller 60 s": {"kind": "partition", "cut": "controller", "duration_s": 60},
    "cut from both 60 s": {"kind": "partition", "cut": "both", "duration_s": 60},
    "degraded to 1 Mbit/s": {"kind": "degraded-link", "rate_mbit": 1},
}
QUICK = ("flap 10 s",)
NODES = cluster(4, 2) | {"adopt_grace_s": 10, "slow_window_s": 10}


OPERATOR_ENV = {
    "HCCL_OP_RETRY_ENABLE": "L0:0, L1:1, L2:0",
    "HCCL_OP_RETRY_PARAMS": "MaxCnt:10, HoldTime:2000, IntervalTime:1000",
    "RELAUNCH_COLLECTIVE_TIMEOUT": "3",
}
"""Operator-level online recovery (R-29): re-issues from 2 s after a failure, every second, ten at
most; a collective waits 3 s for its peers."""
SPENT_OPERATOR_ENV = OPERATOR_ENV | {
    "HCCL_OP_RETRY_PARAMS": "MaxCnt:2, HoldTime:1000, IntervalTime:1000"
}
"""Operator retry that a 10 s flap outlasts (two re-issues, 1 and 2 s after the failure): the
fault goes on to process-retry (R-29, R-30), the flap's cost at that level."""


def _job(
    process: bool,
    timeline_path: Path,
    operator: bool = False,
    step_s: float = 0.02,
    collective_timeout_s: float | None = None,
    spent: bool = False,
) -> dict[str, Any]:
    annotations = {
        "fault-tolerance/job-retry-num": "8",
        "fault-tolerance/job-unconditional-retry": "true",
        "fault-tolerance/hang-retry": "true",
        "fault-tolerance/pod-retry-num": "3",
    }
    labels = {"fault-scheduling": "grace", "grace-over-time": "3", "pod-rescheduling": "on"}
    command = (
        f"python {DDP} --steps {STEPS} --ckpt-every 5 --timeline {timeline_path} "
        f"--step-seconds {step_s}"
    )
    env: dict[str, str] = {}
    if operator:
        env = dict(SPENT_OPERATOR_ENV if spent else OPERATOR_ENV)
    if process:
        annotations |= PROCESS_ANNOTATIONS
        labels |= PROCESS_LABELS
        command = command.replace(f"python {DDP}", f"python {DDP} --process-recovery")
    elif collective_timeout_s is not None:  # the plain script's gloo group gives up then
        command += f" --collective-timeout {collective_timeout_s:g}"
    return {
        "kind": "job",
        "metadata": {"name": "bench-network", "annotations": annotations, "labels": labels},
        "spec": {
            "replicas": 2,
            "procs_per_pod": 1,
            "chips_per_pod": 2,
            "command": command,
            "hang_detect_seconds": 4,
            "monitor_interval": 0.1,
            "env": env,
        },
    }


def _steps(path: Path) -> tuple[int | None, int | None]:
    """(steps redone, restarts) from rank 0's timeline (None: no timeline)."""
    events = timeline.read(path)
    if not events:
        return None, None
    steps = [s for e, s, _ in events if e == "step"]
    starts = sum(1 for e, _, _ in events if e == "start")
    return len(steps) - len(set(steps)), max(0, starts - 1)


def relaunch_once(
    name: str | None,
    tmp: Path,
    process: bool,
    operator: bool = False,
    collective_timeout_s: float | None = None,
    spent: bool = False,
) -> dict[str, Any]:
    """One `relaunch run` of the job, with the fault `name` (None: fault-free)."""
    path = tmp / "timeline.txt"
    faults = [] if name is None else [{**FAULTS[name], "at_step": FAULT_STEP, "pod": 1}]
    began = time.time()
    job = _job(process, path, operator, collective_timeout_s=collective_timeout_s, spent=spent)
    report, seen = run_job(tmp, job, faults, NODES, timeout=600, during=_incarnations)
    wall = time.time() - began
    if report is None:
        kept = keep_failed(tmp, f"network-{name or 'fault-free'}")
        return {"ok": False, "wall_s": round(wall, 2), "note": f"the run failed; {kept}"}
    redone, restarts = _steps(path)
    if process:  # rank 0 does not restart: count every rank's starts
        logs = "\n".join(p.read_text() for p in (tmp / "state" / "jobs").glob("*/pods/*/logs/*"))
        restarts = max(0, logs.count("--- relaunch: attempt") - 2)
    generations = sorted(seen)
    overlap = None
    if len(generations) > 1:  # the old pod 1 still ran when its replacement had started
        old, new = seen[generations[0]], seen[generations[1]]
        overlap = round(old[1] - new[0], 3)
    records = report["recoveries"]
    return {
        "ok": True,
        "wall_s": round(wall, 2),
        "redone": redone,
        "restarts": restarts,
        "overlap_s": overlap,
        "mttr_s": next((r["mttr_s"] for r in records if r.get("mttr_s") is not None), None),
        "what": ", ".join(f"{r['action']} ({r['outcome']})" for r in report["recoveries"])
        or "nothing recorded",
    }


def _incarnations(proc: subprocess.Popen[bytes], state: Path) -> dict[str, Any]:
    """When each generation of pod 1's rank was seen running (every 20 ms), while the run
    lasts: R-14 wants the old one gone before the new one starts."""
    import psutil

    seen: dict[str, list[float]] = {}
    while proc.poll() is None:
        now = time.time()
        for process in psutil.process_iter(["cmdline"]):
            try:
                if str(DDP) not in " ".join(process.info["cmdline"] or []):
                    continue
                env = process.environ()
            except psutil.Error:
                continue
            if env.get("RELAUNCH_POD") == "1" and str(state) in env.get("RELAUNCH_WORKDIR", ""):
                span = seen.setdefault(env.get("RELAUNCH_GENERATION", "?"), [now, now])
                span[1] = now
        time.sleep(0.02)
    return seen


def torchrun_once(name: str | None, tmp: Path) -> dict[str, Any]:
    """The same script under torchrun, each agent in a node namespace of a network made here,
    the same fault on node-1 (None: fault-free)."""

    def agent(index: int, node: str, master: str, port: int, network: ClusterNetwork) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", *_rendezvous(index, node, master, port, network),
            str(DDP), "--steps", str(STEPS), "--ckpt-every", "5",
            "--ckpt-dir", str(tmp / "ckpt"), "--timeline", str(tmp / "timeline.txt"),
        ]  # fmt: skip

    return launchers_once(name, tmp, agent, dict(os.environ))


def nvrx_once(name: str | None, tmp: Path, python: Path) -> dict[str, Any]:
    """The plain script under NVIDIA's ft_launcher (rank heartbeats, NVRX_HEARTBEAT_S), its
    agents in node namespaces as torchrun's are, the same fault on node-1."""
    from relaunch_bench.peer_runs import NVRX_HEARTBEAT_S, PLAIN_DDP, peer_environment

    def agent(index: int, node: str, master: str, port: int, network: ClusterNetwork) -> list[str]:
        return [
            str(python.parent / "ft_launcher"), *_rendezvous(index, node, master, port, network),
            "--ft-enable-nic-monitor", "false", "--ft-initial-rank-heartbeat-timeout", "60",
            "--ft-rank-heartbeat-timeout", str(NVRX_HEARTBEAT_S),
            str(PLAIN_DDP), "--nvrx", "--steps", str(STEPS), "--ckpt-dir", str(tmp / "ckpt"),
            "--timeline", str(tmp / "timeline.txt"),
        ]  # fmt: skip

    return launchers_once(name, tmp, agent, peer_environment(python.parent))


def torchft_once(name: str | None, tmp: Path, python: Path) -> dict[str, Any]:
    """torchft's job (a lighthouse, a replica group of one rank on each of node-0 and node-1,
    each under its own torchrun) in node namespaces: the lighthouse on the management side (the
    controller's address), the replicas' gloo group on the data link; the fault on node-1."""
    from relaunch_bench.peer_runs import TORCHFT_DDP, TORCHFT_HEARTBEAT_MS, peer_environment

    opened = ClusterNetwork.open(tmp / "state")
    if isinstance(opened, str):
        return {"ok": False, "note": opened}
    network, procs = opened, []
    try:
        for node in ("node-0", "node-1", "node-2"):
            network.ensure_node(node)
        bin_dir, lighthouse = python.parent, free_port()
        env = {**peer_environment(bin_dir), "GLOO_SOCKET_IFNAME": DATA_IF}
        log = open(tmp / "lighthouse.log", "wb")  # noqa: SIM115 (closed with the run)
        procs.append(subprocess.Popen(
            [str(bin_dir / "torchft_lighthouse"), "--min_replicas", "1", "--quorum_tick_ms", "100",
             "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", str(TORCHFT_HEARTBEAT_MS),
             "--bind", f"[::]:{lighthouse}"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True,
        ))  # fmt: skip
        began = time.time()
        for replica, node in enumerate(("node-0", "node-1")):
            address = network.layout.data_address(node)
            fd = network.open_namespace(node)
            log = open(tmp / f"replica-{replica}.log", "wb")  # noqa: SIM115
            args = [
                str(bin_dir / "torchrun"), "--nnodes", "1", "--nproc-per-node", "1",
                "--max-restarts", "3", "--monitor-interval", "0.1", "--master-addr", address,
                "--master-port", str(network.free_port(node)), str(TORCHFT_DDP),
                "--steps", str(STEPS), "--timeline", str(tmp / "timeline.txt"),
            ]  # fmt: skip
            replica_env = {
                **env,
                "TORCHFT_LIGHTHOUSE": f"http://{network.layout.controller_address}:{lighthouse}",
                "REPLICA_GROUP_ID": str(replica),
                "BENCH_HOSTNAME": address,
            }
            procs.append(_in_namespace(args, fd, log, replica_env, tmp))
            os.close(fd)
        replicas = procs[1:]
        traffic = None
        if name is not None:
            traffic = _fault_at_step(
                network, FAULTS[name], tmp / "timeline.txt", replicas, replica=0
            )
        codes = [replica.wait(timeout=600) for replica in replicas]
        return _replicas_row(tmp / "timeline.txt", codes, traffic, began)
    except subprocess.TimeoutExpired:
        return {"ok": False, "note": "the replicas did not finish in 600 s"}
    finally:
        _tear_down(procs, network)


def _replicas_row(path: Path, codes: list[int], traffic: Any, began: float) -> dict[str, Any]:
    """torchft's row: each replica's longest time between two steps (`_longest_gaps`)."""
    stall, out = _longest_gaps(path)
    return {
        "link": traffic,
        "ok": not any(codes),
        "wall_s": round(time.time() - began, 2),
        "what": (
            f"replica 0's longest time between two steps {stall:.2f} s, replica 1's {out:.2f} s"
            if not any(codes)
            else f"failed: the replicas exited {codes}"
        ),
        "stall_s": stall,
        "redone": None,
        "restarts": None,
    }


def _longest_gaps(path: Path) -> tuple[float, float]:
    """The longest time between two steps of torchft's replica 0 and of replica 1 (timeline
    lines `step N time replica`): a survivor's stall, and the cut replica's time out."""
    times: dict[int, list[float]] = {0: [], 1: []}
    for line in path.read_text().splitlines() if path.exists() else []:
        fields = line.split()
        if len(fields) == 4 and fields[0] == "step":
            times.setdefault(int(fields[3]), []).append(float(fields[2]))
    gaps = [
        max((b - a for a, b in itertools.pairwise(ts)), default=0.0)
        for ts in (sorted(times[0]), sorted(times[1]))
    ]
    return round(gaps[0], 2), round(gaps[1], 2)


def _rendezvous(
    index: int, node: str, master: str, port: int, network: ClusterNetwork
) -> list[str]:
    """torchrun's arguments (and its forks') for agent `index` of two, one rank each, on `node`:
    its endpoint is node-0's data address, which torchrun does not take for its own host name:
    say which agent serves the rendezvous store, and what address each agent has (its workers'
    MASTER_ADDR; every namespace is "localhost")."""
    return [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{master}:{port}", "--rdzv-id", "bench", "--max-restarts", "3",
        "--rdzv-conf", f"is_host={1 if index == 0 else 0}",
        "--local-addr", network.layout.data_address(node), "--monitor-interval", "0.1",
    ]  # fmt: skip


Agent = Callable[[int, str, str, int, ClusterNetwork], list[str]]


def launchers_once(
    name: str | None, tmp: Path, agent: Agent, base_env: dict[str, str]
) -> dict[str, Any]:
    """Two agents of a launcher that restarts every rank (`agent`: the command of agent i on
    its node, given the rendezvous address), each in a node namespace of a network made here;
    the fault `name` on node-1 (None: fault-free)."""
    opened = ClusterNetwork.open(tmp / "state")
    if isinstance(opened, str):
        return {"ok": False, "note": opened}
    network = opened
    agents: list[subprocess.Popen[bytes]] = []
    try:
        for node in ("node-0", "node-1", "node-2"):
            network.ensure_node(node)
        master = network.layout.data_address("node-0")
        port = network.free_port("node-0")
        path = tmp / "timeline.txt"
        env = {**base_env, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": DATA_IF,
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip
        began = time.time()
        for index, node in enumerate(("node-0", "node-1")):
            fd = network.open_namespace(node)
            log = open(tmp / f"agent-{index}.log", "wb")  # noqa: SIM115 (closed with the run)
            args = agent(index, node, master, port, network)
            agents.append(_in_namespace(args, fd, log, env, tmp))
            os.close(fd)
        traffic = None
        if name is not None:
            traffic = _fault_at_step(network, FAULTS[name], path, agents)
        codes = [agent.wait(timeout=600) for agent in agents]
        wall = time.time() - began
        redone, restarts = _steps(path)
        what = f"{restarts} restart(s) of every rank" if restarts else "rode it out"
        if any(codes):
            what = f"failed: the agents exited {codes} ({what} before)"
        return {
            "ok": not any(codes),
            "wall_s": round(wall, 2),
            "redone": redone,
            "restarts": restarts,
            "what": what,
            "link": traffic,
        }
    except subprocess.TimeoutExpired:
        return {"ok": False, "note": "the agents did not finish in 600 s"}
    finally:
        _tear_down(agents, network)


def _tear_down(procs: list[subprocess.Popen[bytes]], network: ClusterNetwork) -> None:
    """Every process of a run made here killed (with what it started), then its network."""
    for running in procs:
        if running.poll() is None:
            kill_tree(running.pid)
    network.remove()


def _in_namespace(
    args: list[str], fd: int, log: Any, env: dict[str, str], cwd: Path
) -> subprocess.Popen[bytes]:
    def enter() -> None:
        enter_namespace(fd)

    return subprocess.Popen(
        args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True,
        preexec_fn=enter,
    )  # fmt: skip


def network_rows(quick: bool, say: Progress) -> list[dict[str, Any]]:
    """Every fault under relaunch (with and without the SDK's keeper) and under torchrun."""
    why = ClusterNetwork.unavailable()
    if why is not None:
        say(f"network: skipped: {why}")
        return [{"fault": "-", "system": "-", "note": f"not measured: {why}"}]
    rows: list[dict[str, Any]] = []
    for system, variant in SYSTEMS:
        names = QUICK if quick or variant in FLAP_ONLY else tuple(FAULTS)
        rows += fault_rows(system, variant, names, say)
    rows.append(keeping_cost(1 if quick else 3, say))
    return rows


SYSTEMS = (
    ("relaunch", "plain"),
    ("relaunch, SDK keeper", "keeper"),
    ("relaunch, operator retry", "operator"),
    ("relaunch, process retry (operator retry spent)", "retry"),
    ("relaunch, plain script, 3 s gloo timeout", "restart"),
    ("torchrun", "torchrun"),
)
"""Who meets each fault. `retry` and `restart` meet the flap only, the flap's cost at each level
of the ladder beside operator retry's: `retry` is operator retry that the flap outlasts
(SPENT_OPERATOR_ENV: the fault goes on to process-retry); `restart` the plain script whose gloo
group gives up after COLLECTIVE_GIVE_UP_S as operator retry's collectives do (the rank fails,
the job is rebuilt, R-21)."""
FLAP_ONLY = ("retry", "restart")
COLLECTIVE_GIVE_UP_S = 3.0


def fault_rows(
    system: str, variant: str, names: tuple[str, ...], say: Progress
) -> list[dict[str, Any]]:
    """One system's fault-free run, then each fault in `names`: a row each."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
        clean = _once(system, variant, None, Path(tmp))
    say(f"network: {system} fault-free: {clean}")
    for name in names:
        with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
            measured = _once(system, variant, name, Path(tmp))
        lost = (
            round(measured["wall_s"] - clean["wall_s"], 2)
            if measured.get("ok") and clean.get("ok")
            else None
        )
        row = {
            "fault": name,
            "system": system,
            "lost_s": lost,
            "redone_steps": measured.get("redone"),
            "restarts": measured.get("restarts"),
            "mttr_s": measured.get("mttr_s"),
            "stall_s": measured.get("stall_s"),
            "overlap_s": measured.get("overlap_s"),
            "what": measured.get("what") or measured.get("note", "failed"),
            "wall_s": measured.get("wall_s"),
            "fault_free_wall_s": clean.get("wall_s"),
            "link": _link_said(measured.get("link")),
            "link_carried": measured["link"].carried if measured.get("link") else None,
        }
        say(f"network: {system}, {name}: {row}")
        rows.append(row)
    return rows


def _link_said(traffic: LinkTraffic | None) -> str | None:
    return traffic.describe() if traffic is not None else None


def _once(system: str, variant: str, name: str | None, tmp: Path) -> dict[str, Any]:
    if variant == "torchrun":
        return torchrun_once(name, tmp)
    if variant in ("nvrx", "torchft"):
        from relaunch_bench.peer_runs import peer_python

        python = peer_python(variant)
        if isinstance(python, str):
            return {"ok": False, "note": python}
        run = nvrx_once if variant == "nvrx" else torchft_once
        return run(name, tmp, python)
    give_up = COLLECTIVE_GIVE_UP_S if variant == "restart" else None
    process = variant not in ("plain", "restart")
    operator = variant in ("operator", "retry")
    return relaunch_once(name, tmp, process, operator, give_up, spent=variant == "retry")


def keeping_cost(pairs: int, say: Progress) -> dict[str, Any]:
    """R-29's fault-free cost: the keeper's training loop with operator retry on (every
    collective's input copied, waited for in the hook) and off, steps back to back (no sleep),
    alternated in `pairs` pairs; milliseconds a step, from rank 0's timeline."""
    samples: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(pairs):
        for operator in (False, True):
            with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
                path = Path(tmp) / "timeline.txt"
                job = _job(True, path, operator, step_s=0.0)
                report, _ = run_job(Path(tmp), job, [], NODES, timeout=600)
                times = [t for e, _, t in timeline.read(path) if e == "step"]
            if report is not None and len(times) > 50:
                # the steady part: the first steps warm up
                per_step = (times[-1] - times[50]) / (len(times) - 51) * 1000
                samples[operator].append(round(per_step, 3))
            say(f"network: keeping inputs {'on' if operator else 'off'}: {samples[operator]}")
    off = statistics.median(samples[False]) if samples[False] else None
    on = statistics.median(samples[True]) if samples[True] else None
    return {
        "fault": "none (fault-free)",
        "system": "relaunch, operator retry",
        "ms_per_step_off": off,
        "ms_per_step_on": on,
        "cost_ratio": round(on / off, 3) if on and off else None,
        "samples_off": samples[False],
        "samples_on": samples[True],
    }
