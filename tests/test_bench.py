"""`relaunch bench --quick` runs end to end once and writes every field (not checking numbers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {
    "system",
    "level",
    "workload",
    "pods",
    "repeats",
    "median_s",
    "min_s",
    "max_s",
    "detect_s",
    "lost_steps",
}
LEVELS = {"job-reschedule", "in-place", "hang-restart", "pod-reschedule", "isolated-job-reschedule"}


def test_quick_bench_writes_json_markdown_and_chart(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, "-m", "relaunch", "bench", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((out / "bench.json").read_text())
    rows = result["mttr"]
    assert all(set(row) >= FIELDS for row in rows)
    assert {
        r["level"] for r in rows if r["system"] == "relaunch" and r["workload"] == "light"
    } == LEVELS
    assert {(r["system"], r["workload"], r["level"]) for r in rows} >= {
        ("relaunch", "ddp", "job-reschedule"),
        ("torchrun", "ddp", "job-reschedule"),
    }
    assert all(r["failures"] == 0 for r in rows if r["system"] == "relaunch")
    assert "ddp/job-reschedule" in result["ratios"]
    relaunch_hangs = [h for h in result["hang"] if h["system"] == "relaunch"]
    assert sorted(h["script"] for h in relaunch_hangs) == ["exits on SIGTERM", "ignores SIGTERM"]
    assert all(h["detected"] and h["detect_s"] is not None for h in relaunch_hangs)
    [torchrun_hang] = [h for h in result["hang"] if h["system"] == "torchrun"]
    assert set(torchrun_hang) >= {"detected", "detect_s", "mttr_s", "note"}
    # where a DDP restart's time goes, for both systems
    phased = {
        r["system"]: r["phases"]
        for r in rows
        if r["level"] == "job-reschedule" and r["workload"] == "ddp"
    }
    for phases in phased.values():
        assert set(phases) == {
            "detect", "stop_spawn", "import", "rendezvous", "model", "load", "first_step"
        }  # fmt: skip
    assert phased["relaunch"]["detect"] > 0
    scale = result["scale"]
    assert {r["level"] for r in scale} == {"job-reschedule", "pod-reschedule", "in-place"}
    assert all(r["failures"] == 0 and r["median_s"] is not None for r in scale)
    overhead = result["overhead"]
    assert overhead["ok"] and overhead["workers_seen"] >= overhead["processes"]
    assert overhead["controller_cpu_s"] > 0 and overhead["relaunch_ms_per_proc_s"] > 0
    (ckpt,) = result["checkpoint"]
    assert all(ckpt[k] > 0 for k in ("raw_write_mb_s", "save_mb_s", "raw_read_mb_s", "load_mb_s"))
    assert ckpt["async_stall_s"] is not None
    reliability = {r["system"]: r for r in result["reliability"]}
    assert reliability["relaunch"]["recovered"] == reliability["relaunch"]["injected"] == 1
    assert reliability["torchrun"]["injected"] == 1
    assert set(reliability["torchrun"]) == set(reliability["relaunch"])
    markdown = (out / "bench.md").read_text()
    assert markdown.startswith("| system |")
    for title in ("Where the time goes", "Scale", "Controller overhead", "Checkpoints", "Restart"):
        assert title in markdown
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    left = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "relaunch-bench-" in " ".join(p.info["cmdline"] or [])
    ]
    assert not left, "benchmark processes outlived the benchmark"
