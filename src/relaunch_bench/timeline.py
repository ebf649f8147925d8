"""The DDP script's own clock: `--timeline FILE` makes it write one line per event (`launched`,
`imported`, `group`, `ddp`, `loaded`, `step`, `start`, `crash`, `hang`: name, step, wall time), so
that relaunch and torchrun are measured by the same ruler."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

Event = tuple[str, int, float]


@dataclass
class Sample:
    """One measured recovery (or why it is missing)."""

    ok: bool
    mttr_s: float | None = None
    detect_s: float | None = None
    lost_steps: int | None = None
    note: str = ""
    phases: dict[str, float] | None = None
    fault_at: float | None = None


PHASES = (
    "detect", "stop_spawn", "import", "cuda", "rendezvous", "model", "communicator", "load",
    "first_step",
)  # fmt: skip
"""Where a DDP restart's time goes, in order: detection; stopping and spawning the processes (from
detection to rank 0's new interpreter starting); importing torch and the script's modules;
starting CUDA on the rank's GPU (its context: 0 on the CPU, and for a warm spare that started it
while it waited); forming the process group (its store); building the model and its optimizer;
wrapping it in DDP, whose first broadcast makes the collectives' communicator (NCCL's, gloo's);
loading the checkpoint; the first step."""
MARKS = ("launched", "imported", "cuda", "group", "built", "ddp", "loaded", "step")
"""The script's timeline events that bound PHASES (after `detect` and `stop_spawn`). `cuda` and
`built` came later than the others: a timeline without them counts their parts as nothing, each
in the part after it."""


def read(path: Path) -> list[Event]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            events.append((parts[0], int(parts[1]), float(parts[2])))
    return events


def phases_of(
    events: list[Event], fault_at: float, detect_s: float | None
) -> dict[str, float] | None:
    """The parts of one recovery from rank 0's timeline events after the fault (None when rank 0
    did not restart, as in process-level recoveries)."""
    marks: dict[str, float] = {}
    since = fault_at
    for name in MARKS:
        # each mark is the first after the one before: steps the old processes completed
        # between the fault and their stop are not the first step after recovery
        found = next((t for e, _, t in events if e == name and t >= since), None)
        if found is None and name in ("cuda", "built"):
            continue  # an older timeline: its part is counted in the next one
        if found is None:
            return None
        marks[name] = since = found
    marks.setdefault("cuda", marks["imported"])
    marks.setdefault("built", marks["group"])
    detect = detect_s or 0.0
    return {
        "detect": round(detect, 3),
        "stop_spawn": round(marks["launched"] - fault_at - detect, 3),
        "import": round(marks["imported"] - marks["launched"], 3),
        "cuda": round(marks["cuda"] - marks["imported"], 3),
        "rendezvous": round(marks["group"] - marks["cuda"], 3),
        "model": round(marks["built"] - marks["group"], 3),
        "communicator": round(marks["ddp"] - marks["built"], 3),
        "load": round(marks["loaded"] - marks["ddp"], 3),
        "first_step": round(marks["step"] - marks["loaded"], 3),
    }


def crash_sample(path: Path) -> Sample | None:
    """MTTR and lost steps from the script's own clock: crash -> first step after it (None when
    the timeline has no crash)."""
    events = read(path)
    crash = next(((s, t) for e, s, t in events if e == "crash"), None)
    if crash is None:
        return None
    done_before = max((s for e, s, t in events if e == "step" and t < crash[1]), default=0)
    after = [(e, s, t) for e, s, t in events if t > crash[1]]
    resumed = next((s for e, s, _ in after if e == "start"), None)
    first = next((t for e, _, t in after if e == "step"), None)
    if first is None:
        return Sample(False, note="no step after the crash")
    lost = None if resumed is None else max(0, done_before - resumed)
    phases = phases_of(events, crash[1], None)
    return Sample(True, mttr_s=first - crash[1], lost_steps=lost, phases=phases, fault_at=crash[1])
