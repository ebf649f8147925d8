"""Which sections a `relaunch bench` run measures, in which size, and the files it writes:
DIR/bench.json (every number), DIR/bench.md (the tables), DIR/bench.png (the chart)."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from relaunch_bench import report, torchrun
from relaunch_bench.checkpoint import checkpoint_rows
from relaunch_bench.jobs import Progress
from relaunch_bench.kubernetes import kubernetes_rows
from relaunch_bench.mttr import SIZES, Row, hang_rows, mttr_rows, ratios, size_rows
from relaunch_bench.network import network_rows
from relaunch_bench.overhead import overhead_rows
from relaunch_bench.peer_memory import LINK_PAIRS, peer_memory_rows
from relaunch_bench.peer_memory import SIZES_MB as PEER_MEMORY_SIZES
from relaunch_bench.peers import peer_ratio_spreads, peer_ratios, peer_rows, peer_unmatched
from relaunch_bench.reliability import RELIABILITY_LEVELS, reliability_rows
from relaunch_bench.rollback import rollback_rows
from relaunch_bench.scale import scale_rows
from relaunch_bench.series import series_ratio, series_rows
from relaunch_bench.simulation import SIM_LEVELS, growth, simulation_rows
from relaunch_bench.simulation import SIZES as SIM_SIZES
from relaunch_bench.slow import FACTORS, slow_rows
from relaunch_bench.slurm import slurm_rows

SECTIONS = (
    "mttr", "hang", "peers", "series", "scale", "simulation", "sizes", "overhead", "checkpoint",
    "reliability", "slow", "network", "slurm", "kubernetes", "peer-memory", "rollback",
)  # fmt: skip


@dataclass
class BenchOptions:
    out: Path
    quick: bool = False
    repeats: int = 5
    progress: Callable[[str], None] = print
    levels: tuple[str, ...] = ()
    """Only these levels in the MTTR, scale and reliability tables (all when empty); torchrun's
    row is always there."""
    sections: tuple[str, ...] = ()
    """Only these parts of the benchmark (all of SECTIONS when empty)."""
    device: str = "cpu"
    """cuda: the MTTR table's DDP rows (relaunch's and torchrun's) on the GPUs, over NCCL."""
    series_systems: tuple[str, ...] = ()
    """Only these runs of the goodput series (series.RUNS; all when empty)."""
    simulation_sizes: tuple[int, ...] = ()
    """The simulation's jobs, in pods (simulation.SIZES when empty)."""


def run_bench(options: BenchOptions) -> dict[str, Any]:
    """Run the chosen sections one after the other, then write bench.json, bench.md, bench.png."""
    options.out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    def say(text: str) -> None:
        options.progress(f"[{time.time() - started:6.0f} s] {text}")

    sections = options.sections or SECTIONS
    repeats = 1 if options.quick else options.repeats
    rows = (
        mttr_rows(options.quick, repeats, options.levels, say, options.device)
        if "mttr" in sections
        else []
    )
    hangs = hang_rows(options.quick, say) if "hang" in sections else []
    measured = _sections(options, sections, repeats, say)
    if options.quick and "reliability" in sections:
        measured["reliability"] += _quick_torchrun_reliability(rows)
    result = {
        "machine": _machine(),
        "quick": options.quick,
        "device": options.device,
        "torchrun_env": torchrun.ENV,
        "mttr": [asdict(r) for r in rows],
        "peers": [],
        "series": [],
        "hang": hangs,
        "ratios": ratios(rows),
        "scale": [],
        "simulation": [],
        "simulation_growth": [],
        "sizes": [],
        "overhead": [],
        "checkpoint": [],
        "reliability": [],
        "slow": [],
        "network": [],
        "slurm": [],
        "kubernetes": [],
        "peer_memory": [],
        "rollback": [],
        **measured,
        "peer_ratios": peer_ratios(measured.get("peers", [])),
        "peer_ratio_spreads": peer_ratio_spreads(measured.get("peers", [])),
        "peer_unmatched": peer_unmatched(measured.get("peers", [])),
        "series_ratio": series_ratio(measured.get("series", [])),
        "seconds": round(time.time() - started, 1),
    }
    (options.out / "bench.json").write_text(json.dumps(result, indent=2))
    (options.out / "bench.md").write_text(report.markdown(result))
    report.chart(rows, result["scale"], options.out / "bench.png")
    report.goodput_chart(result["series"], options.out / "goodput.png")
    return result


def _engine_sections(sections: tuple[str, ...], repeats: int, say: Progress) -> dict[str, Any]:
    """The engines beside their own answers, those chosen: Slurm (one sample), Kubernetes."""
    measured: dict[str, Any] = {}
    if "slurm" in sections:
        measured["slurm"] = slurm_rows(say)
    if "kubernetes" in sections:
        measured["kubernetes"] = kubernetes_rows(say, repeats)
    return measured


def _sections(
    options: BenchOptions, sections: tuple[str, ...], repeats: int, say: Progress
) -> dict[str, Any]:
    """Scale, overhead, checkpoint and reliability, those of them chosen (--quick: small)."""
    quick = options.quick
    measured: dict[str, Any] = {}
    if "peers" in sections:
        measured["peers"] = peer_rows(1 if quick else min(3, repeats), say)
    if "series" in sections:
        partial = options.out / "series.partial.json"
        measured["series"] = series_rows(
            say, count=2 if quick else 9, partial=partial, only=options.series_systems
        )
    if "scale" in sections:
        sizes = [2] if quick else [2, 4, 8, 16, 64]
        measured["scale"] = scale_rows(sizes, 1 if quick else min(3, repeats), say, options.levels)
    if "simulation" in sections:
        levels = tuple(lv for lv in options.levels if lv in SIM_LEVELS)
        pods = (64,) if quick else options.simulation_sizes or SIM_SIZES
        rows = simulation_rows(pods, levels, say)
        measured["simulation"], measured["simulation_growth"] = rows, growth(rows)
    if "sizes" in sections:
        levels = ("process-in-place",) if quick else options.levels
        measured["sizes"] = size_rows(
            (2,) if quick else SIZES, 1 if quick else min(3, repeats), levels, say
        )
    if "overhead" in sections:
        rate = 10.0 if quick else 2.0
        measured["overhead"] = overhead_rows(
            16 if quick else 256, 2.0 if quick else 20.0, say, rate, quick
        )
    if "checkpoint" in sections:
        sizes = [8] if quick else [64, 512]
        measured["checkpoint"] = checkpoint_rows(sizes, 1 if quick else 3, options.out, say)
    if "reliability" in sections:
        chosen = [lv for lv in RELIABILITY_LEVELS if not options.levels or lv in options.levels]
        measured["reliability"] = reliability_rows(
            1 if quick else 20,
            ["job-reschedule"] if quick else chosen,
            say,
            with_torchrun=not quick and "job-reschedule" in chosen,
        )
    if "slow" in sections:
        measured["slow"] = (
            slow_rows((3.0,), 1, say, steps=200) if quick else slow_rows(FACTORS, 2, say)
        )
    if "network" in sections:
        measured["network"] = network_rows(quick, say)
    measured.update(_engine_sections(sections, 1 if quick else min(3, repeats), say))
    if "peer-memory" in sections:
        measured["peer_memory"] = peer_memory_rows(
            (64,) if quick else PEER_MEMORY_SIZES,
            1 if quick else 3,
            options.out,
            say,
            pairs=1 if quick else LINK_PAIRS,
        )
    if "rollback" in sections:
        measured["rollback"] = rollback_rows(quick, say, options.device)
    return measured


def _quick_torchrun_reliability(rows: list[Row]) -> list[dict[str, Any]]:
    """--quick: torchrun's crashes of the MTTR runs stand for its reliability row."""
    baseline = next((r for r in rows if r.system == "torchrun"), None)
    if baseline is None:
        return []
    return [
        {
            "system": "torchrun",
            "level": baseline.level,
            "workload": baseline.workload,
            "jobs": baseline.repeats,
            "injected": baseline.repeats,
            "recovered": baseline.repeats - baseline.failures,
            "other_actions": [],
            "job_succeeded": baseline.failures == 0,
            "median_mttr_s": baseline.median_s,
            "ettr": None,  # torchrun records no goodput
            "lost_s": None,
            "median_capture_s": None,
        }
    ]


def _machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _torch_version(),
        "gpus": _gpus(),
    }


def _gpus() -> list[str]:
    """The names of this machine's NVIDIA GPUs (none without a driver)."""
    try:
        import pynvml  # type: ignore[import-untyped]

        pynvml.nvmlInit()
        count = int(pynvml.nvmlDeviceGetCount())
        return [
            str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)))
            for i in range(count)
        ]
    except Exception:  # no nvidia-ml-py, no driver: no GPUs to name
        return []


def _torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)
