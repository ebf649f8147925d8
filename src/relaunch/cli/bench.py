"""`relaunch bench`: recovery time by level, side by side with torchrun."""

from __future__ import annotations

import importlib.util
import signal
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import typer

from relaunch.cli.common import app, err

SeriesSystemsOption = Annotated[
    str | None,
    typer.Option(
        "--series-systems",
        help="Comma-separated runs of the goodput series (default: relaunch, nvrx, dlrover, "
        "torchrun, relaunch-lost-nodes: about an hour).",
    ),
]


LevelsOption = Annotated[
    str | None,
    typer.Option(
        "--levels", help="Comma-separated levels for the MTTR table (default: every level)."
    ),
]
OnlyOption = Annotated[
    str | None,
    typer.Option("--only", help="Comma-separated sections to run (default: all of them)."),
]
DeviceOption = Annotated[
    str,
    typer.Option(
        "--device",
        help="cpu, or cuda: the MTTR table's DDP rows on the GPUs over NCCL (relaunch and torchrun).",
    ),
]
SimulationPodsOption = Annotated[
    str | None,
    typer.Option(
        "--simulation-pods",
        help="Comma-separated job sizes of the simulation, in pods (default: 64,256,1024,4096).",
    ),
]


@app.command()
def bench(
    out: Annotated[
        Path,
        typer.Option("--out", help="Where bench.json, bench.md, bench.png and goodput.png go."),
    ] = Path("bench-results"),
    quick: Annotated[
        bool, typer.Option("--quick", help="One repeat, light workload + DDP crash only.")
    ] = False,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Repetitions per level.")] = 5,
    levels: LevelsOption = None,
    only: OnlyOption = None,
    device: DeviceOption = "cpu",
    series_systems: SeriesSystemsOption = None,
    simulation_pods: SimulationPodsOption = None,
) -> None:
    """Measure recovery time by level on this machine beside torchrun, torchft, NVRx, DLRover."""
    _needs("torch", "matplotlib")
    # the benchmarks live outside the core package; imported only when asked for
    from relaunch_bench import LEVELS, SECTIONS, SERIES_SYSTEMS, BenchOptions, run_bench

    options = BenchOptions(
        out=out,
        quick=quick,
        repeats=repeats,
        progress=lambda text: err.print(text, highlight=False, markup=False),
        levels=_choices("--levels", levels, LEVELS),
        sections=_choices("--only", only, SECTIONS),
        device=_one("--device", device, ("cpu", "cuda")),
        series_systems=_choices("--series-systems", series_systems, SERIES_SYSTEMS),
        simulation_sizes=_pods("--simulation-pods", simulation_pods),
    )
    _stopped_as_by_ctrl_c()
    result = run_bench(options)
    sys.stdout.write((out / "bench.md").read_text())
    failed = sum(r["failures"] for r in result["mttr"] if r["system"] == "relaunch")
    if failed:
        err.print(f"[bold red]{failed} relaunch recovery(ies) failed[/]", highlight=False)
        raise typer.Exit(1)


def _pods(option: str, given: str | None) -> tuple[int, ...]:
    """A comma-separated option of job sizes, each a whole number of pods from 2 (exit 2
    otherwise)."""
    words = [x.strip() for x in (given or "").split(",") if x.strip()]
    wrong = [w for w in words if not w.isdigit() or int(w) < 2]
    if wrong:
        err.print(
            f"[bold red]error:[/] {option}: {', '.join(wrong)}: a number of pods, 2 or more",
            highlight=False,
        )
        raise typer.Exit(2)
    return tuple(int(w) for w in words)


def _stopped_as_by_ctrl_c() -> None:
    """SIGTERM (`timeout`, systemd) and SIGHUP (its terminal gone) stop the bench as Ctrl-C does:
    each section's cleanup runs (its runs' processes, the nodes' namespaces, the file server)."""
    for stopping in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stopping, _interrupted)


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _needs(*modules: str) -> None:
    """Exit 2 with the install command when a library the benchmarks run is missing."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        err.print(
            f"[bold red]error:[/] relaunch bench needs {', '.join(missing)}: "
            "pip install 'relaunch\\[bench]'",  # \\[: not rich markup
            highlight=False,
        )
        raise typer.Exit(2)


def _one(option: str, given: str, allowed: tuple[str, ...]) -> str:
    """An option that takes one of `allowed` (exit 2 otherwise)."""
    chosen = _choices(option, given, allowed)
    if len(chosen) != 1:
        err.print(
            f"[bold red]error:[/] {option}: one of {', '.join(allowed)}, not {given!r}",
            highlight=False,
        )
        raise typer.Exit(2)
    return chosen[0]


def _choices(option: str, given: str | None, allowed: Iterable[str]) -> tuple[str, ...]:
    """A comma-separated option's values, each checked against `allowed` (exit 2 otherwise)."""
    allowed = tuple(allowed)
    chosen = tuple(x.strip() for x in (given or "").split(",") if x.strip())
    unknown = [x for x in chosen if x not in allowed]
    if unknown:
        err.print(
            f"[bold red]error:[/] {option}: unknown {', '.join(unknown)}; "
            f"choose from {', '.join(allowed)}",
            highlight=False,
        )
        raise typer.Exit(2)
    return chosen
