"""Goodput under a fault series (`relaunch bench --only series`): one long run of the DDP
example's job (about ten minutes of training, two ranks) with a fault every EVERY steps (about a
minute), the same series for relaunch and for each peer that can take it, each measured by the
same ruler: rank 0's timeline.

Per system: how long the run took from its first step to its last, how much of it was
productive (the steps it kept, at its own fault-free step time), ETTR, and the time lost by
cause: detecting each fault and restarting (fault to the first step after it), steps computed
again (back to the last checkpoint), and the rest (slower steps around the faults).

torchft cannot take the series: a hung replica is dropped for good (the job goes on at half
its data, and the series' later faults never strike the replica that is gone).
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relaunch_bench import timeline, torchrun
from relaunch_bench.jobs import DDP, Progress, cluster, keep_failed, run_job
from relaunch_bench.mttr import HANG_GRACE_WARM_S, PROCESS_ANNOTATIONS, PROCESS_LABELS
from relaunch_bench.peer_runs import NVRX_HEARTBEAT_S, PLAIN_DDP, dlrover_run, nvrx_run, peer_python

EVERY = 2400
"""Steps between two faults: about a minute at the job's 25 ms a step."""
COUNT = 9
KINDS = ("crash", "crash", "hang")
"""The series cycles through these: two crashes, then a hang (every peer takes both)."""
WITH_LOST_NODES = ("crash", "lost-node", "hang")
"""relaunch's second series: a lost node instead of every other crash (no peer here can take
one: torchft and standalone DLRover have no scheduler to replace a node, NVRx's ft_launcher
waits for one)."""
HANG_S = 4
"""relaunch's hang window (NVRx's rank heartbeat timeout is the same 4 s)."""


def plan(
    count: int = COUNT, every: int = EVERY, kinds: tuple[str, ...] = KINDS
) -> list[tuple[int, str]]:
    """(step, kind) of each fault of the series."""
    return [((i + 1) * every, kinds[i % len(kinds)]) for i in range(count)]


@dataclass
class SeriesResult:
    system: str
    series: str
    faults: int = 0
    """Faults that struck."""
    finished: bool = False
    steps: int | None = None
    run_s: float | None = None
    productive_s: float | None = None
    lost_s: float | None = None
    ettr: float | None = None
    step_ms: float | None = None
    plain_step_ms: float | None = None
    """relaunch: the same script's fault-free step without process-level recovery (no SDK
    keeper), on the same cluster in the same run; a peer runs the plain script throughout."""
    process_level_cost: float | None = None
    """step_ms over plain_step_ms, less one: what process-level recovery costs each step."""
    lost_by_cause: dict[str, float] = field(default_factory=dict)
    note: str = ""


def measure(events: list[timeline.Event], faults_at: list[float]) -> dict[str, Any]:
    """Goodput from rank 0's timeline and when each fault struck. The step time is the median
    of rank 0's step-to-step intervals (nearly all fault-free); productive time is the steps
    kept at that pace; each fault costs its stall (from the fault to the step that ends the
    longest pause after it: detection and restart) and the steps computed again after it (down
    to the checkpoint it resumed from)."""
    steps = [(s, t) for e, s, t in events if e == "step"]
    if len(steps) < 2:
        return {}
    intervals = [b[1] - a[1] for a, b in itertools.pairwise(steps) if b[0] == a[0] + 1]
    step_s = statistics.median(intervals)
    first_step, first_at = steps[0]
    last_step = max(s for s, _ in steps)
    run_s = steps[-1][1] - first_at
    productive = (last_step - first_step) * step_s
    stall = recomputed = 0.0
    struck = sorted(faults_at)
    for at, until in zip(struck, [*struck[1:], float("inf")][: len(struck)], strict=True):
        resumed = _resumed(steps, at, until)
        if resumed is None:
            continue
        (before, _), (after, after_at) = resumed
        stall += after_at - at
        recomputed += max(0, before - (after - 1)) * step_s
    lost = run_s - productive
    return {
        "steps": last_step,
        "run_s": round(run_s, 1),
        "productive_s": round(productive, 1),
        "lost_s": round(lost, 1),
        "ettr": round(productive / run_s, 3) if run_s > 0 else None,
        "step_ms": round(step_s * 1000, 2),
        "lost_by_cause": {
            "detection and restart": round(stall, 1),
            "recomputed": round(recomputed, 1),
            "slower steps": round(max(0.0, lost - stall - recomputed), 1),
        },
    }


def _resumed(
    steps: list[tuple[int, float]], at: float, until: float
) -> tuple[tuple[int, float], tuple[int, float]] | None:
    """The longest pause in rank 0's steps after a fault at `at` (and before the next one, at
    `until`): the step before it and the first after it, where training resumed. Not simply the
    next step: a rank whose peer has just died may finish the step under way, and the fault
    time may be a hang's detection, after its last step."""
    last = [(s, t) for s, t in steps if t <= at][-1:]
    seq = last + [(s, t) for s, t in steps if at < t < until]
    if len(seq) < 2:
        return None
    return max(itertools.pairwise(seq), key=lambda pair: pair[1][1] - pair[0][1])


def _struck(path: Path) -> list[float]:
    return [t for e, _, t in timeline.read(path) if e in ("crash", "hang")]


REFERENCE_STEPS = 1200
"""The fault-free reference run's steps (about 30 s): the plain script's step time."""


def relaunch_series(
    series: list[tuple[int, str]],
    tmp: Path,
    every: int = EVERY,
    async_save: bool = True,
    reference_steps: int = REFERENCE_STEPS,
) -> SeriesResult:
    """relaunch with its best levels: the SDK keeps the group (process level), warm spares in
    each pod, hang retry, checkpoints written in the background (`async_save`: a synchronous
    save, fsynced on both ranks every 5 steps, made each fifth step 8 ms slower: 36 s of a
    ten-minute run); the series as its fault plan on rank 1 (pod 1). Then `reference_steps` of
    the same job without process-level recovery and without faults: the step's price of it."""
    name = "with lost nodes" if any(k == "lost-node" for _, k in series) else "crash, hang"
    path = tmp / "timeline.txt"
    steps = every * (len(series) + 1)
    kinds = {
        "crash": {"kind": "process-exit", "pod": 1, "rank": 1, "exit_code": 1},
        "hang": {"kind": "hang", "pod": 1, "rank": 1},
        "lost-node": {"kind": "node-down", "pod": 1},
    }
    faults = [{**kinds[kind], "at_step": step} for step, kind in series]
    nodes = cluster(2 + sum(k == "lost-node" for _, k in series), 2)
    job = series_job(steps, path, async_save, process_level=True)
    report, _ = run_job(tmp, job, faults, nodes, timeout=3600)
    result = SeriesResult("relaunch", name, finished=report is not None)
    if report is None:
        result.note = f"the run failed; {keep_failed(tmp, f'series-{name}')}"
        return result
    records = report["recoveries"]
    faults_at = sorted({r["fault_at"] for r in records})
    result.faults = len(faults_at)
    result.note = ", ".join(sorted({r["action"] for r in records}))
    _fill(result, measure(timeline.read(path), faults_at))
    if reference_steps and result.step_ms:
        plain = tmp / "plain"
        plain.mkdir()
        job = series_job(reference_steps, plain / "timeline.txt", async_save, process_level=False)
        if run_job(plain, job, [], nodes, timeout=600)[0] is not None:
            reference = measure(timeline.read(plain / "timeline.txt"), [])
            result.plain_step_ms = reference.get("step_ms")
        if result.plain_step_ms:
            result.process_level_cost = round(result.step_ms / result.plain_step_ms - 1, 3)
    return result


def series_job(steps: int, path: Path, async_save: bool, process_level: bool) -> dict[str, Any]:
    """The series' job for relaunch: the DDP example, two pods of one rank, warm spares, hang
    retry; `process_level`: the SDK keeps the group and the process levels come first."""
    annotations = {"fault-tolerance/job-retry-num": "40", "fault-tolerance/hang-retry": "true"}
    labels = {"fault-scheduling": "grace", "grace-over-time": "3"}
    if process_level:
        annotations |= PROCESS_ANNOTATIONS
        labels |= PROCESS_LABELS
    keeper = " --process-recovery" if process_level else ""
    return {
        "kind": "job",
        "metadata": {"name": "bench-series", "annotations": annotations, "labels": labels},
        "spec": {
            "replicas": 2,
            "procs_per_pod": 1,
            "chips_per_pod": 2,
            "command": f"python {DDP}{keeper} --steps {steps} --ckpt-every 5 "
            f"--timeline {path}" + (" --async-save" if async_save else ""),
            "hang_detect_seconds": HANG_S,
            "monitor_interval": 0.1,
            "warm_spares": 1,
            "hang_grace_seconds": HANG_GRACE_WARM_S,
        },
    }


def peer_series(
    system: str, series: list[tuple[int, str]], tmp: Path, every: int = EVERY
) -> SeriesResult:
    """torchrun (from this venv), NVRx's ft_launcher or DLRover's dlrover-run on the plain
    script, the series in its command line (each fault once, on rank 1)."""
    steps = every * (len(series) + 1)
    script = ["--steps", str(steps), "--faults", ",".join(f"{s}:{k}" for s, k in series)]
    restarts = len(series) + 2
    result = SeriesResult(system, "crash, hang")
    path = tmp / "timeline.txt"
    if system == "torchrun":
        agents = torchrun.start(
            tmp, path, script[2:], max_restarts=restarts, steps=steps, procs=1, script=PLAIN_DDP
        )
        result.finished = torchrun.stop(agents, wait_s=3600)
    else:
        python = peer_python("nvrx" if system.startswith("NVRx") else "dlrover")
        if isinstance(python, str):
            result.note = python
            return result
        run = nvrx_run if system.startswith("NVRx") else dlrover_run
        result.finished = run(python, tmp, script, restarts, 3600)
    struck = _struck(path)
    result.faults = len(struck)
    _fill(result, measure(timeline.read(path), struck))
    if not result.finished:
        result.note = "did not finish"
    return result


def _fill(result: SeriesResult, measured: dict[str, Any]) -> None:
    for key, value in measured.items():
        setattr(result, key, value)


PEERS = ("torchrun", f"NVRx ft_launcher ({NVRX_HEARTBEAT_S:g} s heartbeat)", "DLRover standalone")


RUNS: dict[str, tuple[str, tuple[str, ...]]] = {
    "relaunch": ("relaunch", KINDS),
    "nvrx": (PEERS[1], KINDS),
    "dlrover": (PEERS[2], KINDS),
    "torchrun": (PEERS[0], KINDS),
    "relaunch-lost-nodes": ("relaunch", WITH_LOST_NODES),
}
"""The section's runs by name (`relaunch bench --series-systems`), in the order they run:
relaunch, then the peers best first as the peers table ranks them (NVRx, DLRover, torchrun: its
hour-long section's most telling rows first), then relaunch's second series (lost nodes, which
no peer here can take)."""
SERIES_SYSTEMS = tuple(RUNS)


def series_rows(
    say: Progress,
    count: int = COUNT,
    partial: Path | None = None,
    only: tuple[str, ...] = (),
    async_save: bool = True,
) -> list[dict[str, Any]]:
    """relaunch on both series, each peer on the one it can take (`only`: those of RUNS);
    then the lost time of each beside relaunch's. `partial`: the rows so far, written after
    each run (the section takes about an hour). `async_save`: relaunch's script writes its
    checkpoints in the background (the SDK's own way; each peer's script saves as its docs do)."""
    rows: list[dict[str, Any]] = []
    for name, (system, kinds) in RUNS.items():
        if only and name not in only:
            continue
        series = plan(count, kinds=kinds)
        with tempfile.TemporaryDirectory(prefix="relaunch-bench-") as tmp:
            result = (
                relaunch_series(series, Path(tmp), async_save=async_save)
                if system == "relaunch"
                else peer_series(system, series, Path(tmp))
            )
        rows.append(asdict(result))
        say(
            f"series {system} ({result.series}): {result.faults} faults, lost {result.lost_s} s, "
            f"ETTR {result.ettr} {result.note}; lost by cause {result.lost_by_cause}, "
            f"{result.steps} steps in {result.run_s} s at {result.step_ms} ms"
            + (
                f" ({result.plain_step_ms} ms without process-level recovery)"
                if result.plain_step_ms
                else ""
            )
        )
        if partial is not None:
            partial.write_text(json.dumps(rows, indent=2))
    rows.append(
        {
            "system": "torchft",
            "series": "crash, hang",
            "note": "cannot take it: a hung replica is dropped for good, and the series' later "
            "faults never strike the replica that is gone",
        }
    )
    return rows


def series_ratio(rows: list[dict[str, Any]]) -> float | None:
    """relaunch's lost time over the best peer's, on the series every peer takes."""
    ours = next(
        (
            r["lost_s"]
            for r in rows
            if r["system"] == "relaunch" and r["series"] == "crash, hang" and r.get("lost_s")
        ),
        None,
    )
    peers = [
        r["lost_s"]
        for r in rows
        if r["system"] != "relaunch" and r.get("lost_s") and r.get("finished")
    ]
    if ours is None or not peers:
        return None
    return round(float(ours) / float(min(peers)), 2)
