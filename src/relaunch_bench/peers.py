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

import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relaunch_bench import torchrun
from relaunch_bench.jobs import Progress
from relaunch_bench.mttr import median_phases, relaunch_once
from relaunch_bench.peer_runs import (
    NVRX_HEARTBEAT_S,
    PeerSample,
    dlrover_once,
    nvrx_once,
    peer_python,
    torchft_once,
)

FAULTS = ("crash", "hang", "lost-node", "link-flap")
FLAP = "flap 10 s"
"""The link fault of the flap rows (relaunch_bench.network): node 1's data link down 10 s."""
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
    phases: dict[str, float] | None = None
    """relaunch's rows where rank 0 restarts: the medians of where the time went."""


# -- torchft -------------------------------------------------------------------------------------


# -- the launchers that restart every rank -----------------------------------------------------


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
        phases=sample.phases,
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
        phases=median_phases([s.phases for s in good if s.phases is not None]),
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
        rows.append(_flap_row(system, variant, measured))
    rows.append(
        PeerRow(
            "DLRover dlrover-run --standalone",
            "link-flap",
            note="standalone mode runs every rank on one node: there is no link between them to cut",
        )
    )
    return rows


def _flap_row(system: str, variant: str, measured: dict[str, Any]) -> PeerRow:
    """One system's flap row from what the network section measured of it."""
    # torchft's survivor trains on alone while the cut replica is out (faster than two):
    # its cost is the survivor's stall, not the time against a fault-free run
    lost = measured["stall_s"] if variant == "torchft" else measured["lost_s"]
    link = measured.get("link") or (
        "its collective failed on the cut link (the operator retry's record)"
        if variant == "operator"
        else None
    )
    if measured.get("link_carried") is False:  # the flap cut nothing this system sends
        return PeerRow(system, "link-flap", repeats=1, failures=1, note=f"not counted: {link}")
    return PeerRow(
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
    """Each ratio's two rows: relaunch's and the best peer's that restores the job (the
    smallest stall measured), per fault: a crash twice, one rank replaced against torchft's
    survivor and every rank restarted against the launchers that restart every rank.

    A peer restores the job where the struck rank, or its replacement, stepped again (its
    `rejoin_s`): torchft's survivor that trains on alone after a hang or a lost node has not
    recovered the job, and its stall is no recovery to compare with. A link flap strikes no
    rank: every system that rode it out counts."""

    def best(fault: str, prefixes: tuple[str, ...]) -> dict[str, Any] | None:
        found = [
            r
            for r in rows
            if r["fault"] == fault
            and r["system"].startswith(prefixes)
            and r["stall_s"]
            and (fault == "link-flap" or r["system"].startswith("relaunch") or r.get("rejoin_s"))
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


def peer_unmatched(rows: list[dict[str, Any]]) -> list[str]:
    """The ratios relaunch was measured for that no peer has: none restored the job."""
    return [
        name
        for name, (ours, theirs) in _ratio_pairs(rows).items()
        if ours is not None and theirs is None
    ]


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
