"""`relaunch bench --quick` runs end to end once, from a wheel installed outside the source tree,
and writes every field (not checking numbers)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import psutil
import pytest

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
LEVELS = ("job-reschedule", "pod-reschedule")


def _installed_from_wheel(tmp_path: Path) -> Path:
    """A virtual environment holding relaunch installed from a wheel of this checkout (not an
    editable install): its `bin`. Its third-party libraries (torch, ...) come from the test's own
    environment through a path file, so that nothing is downloaded."""
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(wheels), str(ROOT)],
        check=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = wheels.glob("relaunch-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # a plain path line: the test environment's own .pth files (the editable install) stay out
    (Path(purelib) / "test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--no-deps", "--no-index", str(wheel)],
        check=True, timeout=300,
    )  # fmt: skip
    where = subprocess.run(
        [str(python), "-c", "import relaunch, relaunch_bench; print(relaunch.__file__, relaunch_bench.__file__)"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    ).stdout.split()  # fmt: skip
    assert all(Path(p).is_relative_to(purelib) for p in where), where
    return venv / "bin"


def test_quick_bench_writes_json_markdown_and_chart(tmp_path: Path) -> None:
    bin_dir = _installed_from_wheel(tmp_path)
    out, scratch = tmp_path / "bench", tmp_path / "scratch"
    scratch.mkdir()
    ssh_before = _ssh_processes()
    done = subprocess.run(
        # the sections that make the chart, the ratios and the report's every kind of table;
        # `make bench` runs the others (hang, scale, sizes, slow, network): they repeat jobs the
        # suite already runs end to end (tests/test_hang_detection.py, test_diagnosis.py,
        # test_networks.py) and took 100 s of the suite's 25 minutes
        [
            str(bin_dir / "relaunch"),
            "bench",
            "--quick",
            "--out",
            str(out),
            "--only",
            "mttr,overhead,checkpoint,reliability,peer-memory",
            # two levels of the light workload (a job-level and a pod-level one): `--levels`
            # and the rows both kinds make; each level's recovery is the end-to-end tests'
            "--levels",
            ",".join(LEVELS),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        check=False,
        # its runs' directories under a scratch of its own: what is left of them is this
        # bench's, not another's on the same machine
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((out / "bench.json").read_text())
    rows = result["mttr"]
    assert all(set(row) >= FIELDS for row in rows)
    assert {
        r["level"] for r in rows if r["system"] == "relaunch" and r["workload"] == "light"
    } == set(LEVELS)
    assert {(r["system"], r["workload"], r["level"]) for r in rows} >= {
        ("relaunch", "ddp", "job-reschedule"),
        ("torchrun", "ddp", "job-reschedule"),
    }
    assert all(r["failures"] == 0 for r in rows if r["system"] == "relaunch")
    assert "ddp/job-reschedule" in result["ratios"]
    # where a DDP restart's time goes, for both systems
    phased = {
        r["system"]: r["phases"]
        for r in rows
        if r["level"] == "job-reschedule" and r["workload"] == "ddp"
    }
    for phases in phased.values():
        assert set(phases) == {
            "detect", "stop_spawn", "import", "cuda", "rendezvous", "model", "communicator",
            "load", "first_step",
        }  # fmt: skip
    assert phased["relaunch"]["detect"] > 0
    (overhead,) = result["overhead"]
    assert overhead["ok"] and overhead["workers_seen"] >= overhead["processes"]
    assert overhead["controller_cpu_s"] > 0 and overhead["relaunch_ms_per_proc_s"] > 0
    (ckpt,) = result["checkpoint"]
    assert all(ckpt[k] > 0 for k in ("raw_write_mb_s", "save_mb_s", "raw_read_mb_s", "load_mb_s"))
    assert ckpt["async_stall_s"] is not None and ckpt["async_vs_sync"] is not None
    assert ckpt["loop_sync_stall_s"] > 0 and ckpt["loop_overlap_stall_s"] > 0
    assert ckpt["loop_async_vs_sync"] is not None and ckpt["loop_overlap_vs_sync"] is not None
    (peer_memory,) = result["peer_memory"]
    if os.geteuid() == 0:  # a data link between two node namespaces needs root
        assert all(
            peer_memory[f"{k}_mb_s"] > 0
            for k in (
                "link", "link_fresh", "fault_in", "peer_restore", "peer_restore_late",
                "local_restore", "storage_restore",
            )
        )  # fmt: skip
        assert peer_memory["local_copy_s"] > 0
        assert peer_memory["copy_fresh_mb_s"] > 0 and peer_memory["copy_again_mb_s"] > 0
        assert peer_memory["again_over_fresh"] > 0
        # the link and the restore from peer memory taken in turn, one pair a round in --quick
        assert peer_memory["link_pairs"] == peer_memory["repeats"] == 1
        assert peer_memory["link_ratio"] > 0 and peer_memory["late_over_link"] > 0
        assert 0 <= peer_memory["ready_share"] <= 1  # of the copy, faulted in when load() began
        # two ranks restoring at once from the one keeper, each from its memory
        assert peer_memory["together_ranks"] == 2 and peer_memory["together_mb_s"] > 0
        assert peer_memory["together_over_alone"] > 0 and peer_memory["together_over_link"] > 0
        # shared storage over the data link (`make test` installs its sshd and sshfs as root)
        assert all(
            peer_memory.get(f"{k}_mb_s", 0) > 0 for k in ("shared_read", "shared_restore")
        ), peer_memory.get("shared_storage")
        assert peer_memory["shared_over_peer"] > 0
        assert peer_memory["stall_plain_s"] > 0 and peer_memory["stall_copy_s"] > 0
        low, high = peer_memory["stall_ratio_95"]  # 7 pairs in --quick: an interval exists
        assert (
            peer_memory["stall_pairs"] == 7 and low <= peer_memory["stall_copy_over_plain"] <= high
        )
    else:
        assert "needs root" in peer_memory["error"]
    reliability = {r["system"]: r for r in result["reliability"]}
    assert reliability["relaunch"]["recovered"] == reliability["relaunch"]["injected"] == 1
    assert reliability["torchrun"]["injected"] == 1
    assert set(reliability["torchrun"]) == set(reliability["relaunch"])
    assert 0 < reliability["relaunch"]["ettr"] < 1
    markdown = (out / "bench.md").read_text()
    assert markdown.startswith("| system |")
    for title in (
        "Where the time goes", "Controller overhead", "Checkpoints",
        "Save stalls in a training loop", "Restart", "Restores from a peer's memory",
        "Costs beside their goals", "cold job-level restart: stop and spawn",
    ):  # fmt: skip
        assert title in markdown
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    left = [
        p
        for p in psutil.process_iter(["cmdline"])
        if f"{scratch}/relaunch-bench-" in " ".join(p.info["cmdline"] or [])
    ]
    assert not left, "benchmark processes outlived the benchmark"
    # the shared storage's sshd, its connections' sshd (renamed: no path to know them by) and the
    # mounts' sshfs and ssh: no other test starts any
    assert _ssh_processes() <= ssh_before, "the shared storage's processes outlived the benchmark"


def test_a_bench_stopped_by_sigterm_cleans_up_as_ctrl_c_does(tmp_path: Path) -> None:
    """`timeout` or systemd stop a bench with SIGTERM: it ends as Ctrl-C ends it (exit 130), and
    each section's cleanup runs. Stopped in the middle of the peer-memory section, no worker, no
    file server, no node namespace and no mount of it is left (before, SIGTERM ended the bench
    at once and left them all)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the peer-memory section's node namespaces")
    out, log = tmp_path / "out", tmp_path / "bench.log"

    def ours() -> list[psutil.Process]:
        return [
            p
            for p in psutil.process_iter(["cmdline"])
            if str(out) in " ".join(p.info["cmdline"] or [])
        ]

    with open(log, "w") as said:
        bench = subprocess.Popen(
            [sys.executable, "-m", "relaunch", "bench", "--quick", "--only", "peer-memory",
             "--out", str(out)],
            stdout=said, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 180
    while not any("peer_memory_worker" in " ".join(p.info["cmdline"] or []) for p in ours()):
        assert bench.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    (layout,) = out.glob("relaunch-peer-memory-*/state/network.json")
    digest = json.loads(layout.read_text())["digest"]
    bench.send_signal(signal.SIGTERM)
    namespaces: list[str] = []
    try:
        assert bench.wait(timeout=180) == 130, log.read_text()
        assert not ours(), [p.info["cmdline"] for p in ours()]
        namespaces = [n for n in os.listdir("/run/netns") if n.startswith(f"rl{digest}")]
        assert not namespaces, namespaces
        assert str(out) not in Path("/proc/mounts").read_text()
    finally:  # what a failure left, so that it is this test's failure alone
        for process in ours():
            process.kill()
        for namespace in namespaces:
            subprocess.run(["ip", "netns", "delete", namespace], check=False)


def test_a_peer_memory_size_the_disk_has_no_room_for_is_not_measured_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round writes its state about five times over; on a disk without that room the size is
    not measured, and the row and the progress say how much it needs (before, a disk that
    filled under DLRover's save left the bench waiting 30 minutes). Nothing of it is left."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the peer-memory section's node namespaces")
    from relaunch_bench import peer_memory

    monkeypatch.setattr(
        peer_memory.shutil,
        "disk_usage",
        lambda path: shutil._ntuple_diskusage(10**12, 10**12, 10**8),
    )
    said: list[str] = []
    (row,) = peer_memory.peer_memory_rows((64,), 1, tmp_path, said.append)
    assert row["size_mb"] == 64 and "0.3 GB free under" in row["error"], row
    assert said and "not measured" in said[-1], said
    assert not list(tmp_path.iterdir()), "the section left files"


def _ssh_processes() -> set[int]:
    return {
        p.pid
        for p in psutil.process_iter(["name", "status"])
        if p.info["name"] in ("sshd", "sshfs", "ssh") and p.info["status"] != psutil.STATUS_ZOMBIE
    }


def test_bench_without_torch_says_what_to_install(tmp_path: Path) -> None:
    """An install without the `bench` extra: exit 2 naming the missing library and the extra,
    before any job starts."""
    hide_torch = (
        "import sys; sys.modules['torch'] = None; sys.argv = ['relaunch', 'bench', '--quick',"
        f" '--out', {str(tmp_path / 'out')!r}]; from relaunch.cli import main; main()"
    )
    done = subprocess.run(
        [sys.executable, "-c", hide_torch], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "needs torch" in done.stderr and "relaunch[bench]" in done.stderr
    assert not (tmp_path / "out").exists()


def test_bench_refuses_unknown_levels_sections_and_devices(tmp_path: Path) -> None:
    cases = (
        ("--levels", "in-place,warp-drive"),
        ("--only", "mttr,speed"),
        ("--device", "cpu,tpu"),
        ("--series-systems", "relaunch,kubeflow"),
    )
    for option, value in cases:
        done = subprocess.run(
            [sys.executable, "-m", "relaunch", "bench", option, value, "--out", str(tmp_path)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 2, done.stdout + done.stderr
        assert value.split(",")[1] in done.stderr and "choose from" in done.stderr
    for pods in ("4096,many", "1", "64,-2"):
        done = subprocess.run(
            [sys.executable, "-m", "relaunch", "bench", "--simulation-pods", pods, "--out",
             str(tmp_path)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 2, done.stdout + done.stderr
        assert "--simulation-pods" in done.stderr and "a number of pods" in done.stderr


def test_the_bench_faults_land_between_checkpoints_and_the_save_rows_on_one() -> None:
    """A fault at a checkpoint step waits for the save (R-37's hold): a process-level row whose
    fault fell there measured the save's time too (before the hold: the level below). The
    `@save` row puts it there on purpose, its save shorter than the DDP rows' hang window so the
    row's own level handles it."""
    import re

    from relaunch_bench import mttr
    from relaunch_bench.jobs import FAULT_STEP, SAVE_FAULT_STEP

    for level in mttr.LEVELS:
        for workload in ("light", "ddp"):
            command = mttr._job(workload, level, None)["spec"]["command"]
            every = int(re.search(r"--ckpt-every (\d+)", command)[1])  # type: ignore[index]
            assert FAULT_STEP % every != 0, (level, workload, command)
            assert SAVE_FAULT_STEP % every == 0
    assert mttr.handled_by("process-reschedule@save") == "process-reschedule"
    assert mttr.handled_by("process-in-place+spare") == "process-in-place"
    held_job = mttr._job("ddp", "process-reschedule@save", None)
    assert held_job["spec"]["hang_detect_seconds"] > mttr.SAVE_HELD_S
    held = mttr._job("ddp", "process-reschedule@save", None)["spec"]["command"]
    assert f"--slow-save-at {SAVE_FAULT_STEP}" in held
    for level in mttr.PROCESS_LEVELS:  # every process level runs with process recovery on
        job = mttr._job("ddp", level, None)
        assert job["metadata"]["labels"]["process-recover-enable"] == "on", level
        assert "--slow-save-at" in job["spec"]["command"] or not level.endswith("@save")
    for level in mttr.LEVELS:  # a crash row's rank exits by itself, timed on the script's clock
        command = mttr._job("ddp", level, Path("timeline.txt"))["spec"]["command"]
        scripted = mttr.handled_by(level) in ("job-reschedule", "process-in-place")
        assert mttr.scripts_its_crash("ddp", level) is scripted, level
        assert (f"--crash-at-step {FAULT_STEP}" in command) is scripted, (level, command)
        assert ("--timeline timeline.txt" in command) is (
            scripted or level not in mttr.PROCESS_LEVELS
        )
        assert not mttr.scripts_its_crash("light", level)


def test_the_stall_ratios_interval_is_the_medians_order_statistics() -> None:
    """The copy's stall is judged by a 95 % interval for the median of the pairs' ratios: the
    order statistics the binomial distribution gives (n = 100: the 40th and 61st), whatever
    order the pairs came in; too few pairs to reach 95 % give none."""
    import random

    from relaunch_bench.peer_memory import median_interval

    values = [1 + i / 1000 for i in range(100)]
    random.Random(7).shuffle(values)
    assert median_interval(values) == (1.039, 1.06)
    assert median_interval([1.0, 0.5, 2.0, 1.5, 0.9, 1.1]) == (0.5, 2.0)  # n = 6: 96.9 %
    assert median_interval([1.0, 0.5, 2.0, 1.5, 0.9]) is None  # n = 5: at most 93.8 %
    assert median_interval(values[:21], level=0.99) != median_interval(values[:21])


def test_a_failed_bench_run_keeps_its_state_and_says_its_last_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 49: a bench row that failed ("the run failed") kept no reason, no state directory
    and no records. A run whose job fails keeps its directory (records, logs, job, its run's
    output) and says where, with the run's last lines. The job here: a command that is not
    there, on a fresh embedded cluster, no restart."""
    from relaunch_bench.jobs import FAILED_RUNS_ENV, cluster, keep_failed, run_job

    monkeypatch.setenv(FAILED_RUNS_ENV, str(tmp_path / "kept"))
    run = tmp_path / "run"
    run.mkdir()
    job = {
        "kind": "job",
        "metadata": {"name": "bench-fails"},
        "spec": {"replicas": 1, "procs_per_pod": 1, "command": "no-such-program-here"},
    }
    report, _ = run_job(run, job, [], cluster(2, 1), timeout=120)
    assert report is None  # the job failed
    said = keep_failed(run, "process-in-place+spare")
    [kept] = (tmp_path / "kept").iterdir()
    assert f"kept in {kept}" in said and "process-in-place+spare" in kept.name
    assert "last lines:" in said and "no-such-program-here" in said, said
    assert (kept / "state" / "relaunch.db").is_file() and (kept / "run.log").is_file()
    assert list((kept / "state" / "jobs").glob("*/pods/*/logs/rank-0.log"))


def test_a_restart_inside_slurm_is_told_part_by_part_from_rank_0s_timeline(tmp_path: Path) -> None:
    """Where a Slurm restart's time goes: the stall cut at the script's own marks, the detection
    apart where the system says when it detected the fault (relaunch's record), and a markdown
    table of the parts under the section."""
    from relaunch_bench.peer_runs import _launcher_sample
    from relaunch_bench.report import phase_lines

    line = tmp_path / "timeline.txt"
    marks = [("step", 21, 99.0), ("crash", 22, 100.0), ("launched", 0, 102.0),
             ("imported", 0, 103.5), ("group", 0, 104.0), ("ddp", 0, 104.2),
             ("loaded", 20, 104.3), ("start", 20, 104.3), ("step", 21, 104.5)]  # fmt: skip
    line.write_text("".join(f"{e} {s} {t:.6f}\n" for e, s, t in marks))
    plain = _launcher_sample(line, "crash", True)
    assert plain.ok and plain.stall_s == 4.5 and plain.phases is None
    ours = _launcher_sample(line, "crash", True, parts=True, detect_s=0.5)
    assert ours.detect_s == 0.5 and ours.phases is not None
    assert ours.phases["detect"] == 0.5 and ours.phases["stop_spawn"] == 1.5
    assert (ours.phases["import"], ours.phases["rendezvous"], ours.phases["load"]) == (
        1.5,
        0.5,
        0.1,
    )
    assert round(sum(ours.phases.values()), 3) == ours.stall_s
    theirs = _launcher_sample(line, "crash", True, parts=True)
    assert theirs.phases is not None and theirs.phases["stop_spawn"] == 2.0  # detection in it
    rows = [{"system": "relaunch", "fault": "crash", **ours.__dict__}]
    table = phase_lines(rows, "Where a restart's time goes inside Slurm:")
    assert table[1] == "Where a restart's time goes inside Slurm:"
    assert "| relaunch | crash | 4.5 | 0.5 | 1.5 | 1.5 |" in "\n".join(table)


def test_the_slurm_sections_ratio_is_relaunchs_stall_over_nvrxs_where_both_recovered() -> None:
    from relaunch_bench.report import stall_ratios

    rows = [
        {"system": "relaunch", "fault": "crash", "ok": True, "stall_s": 6.0},
        {"system": "NVRx", "fault": "crash", "ok": True, "stall_s": 12.0},
        {"system": "relaunch", "fault": "lost-node", "ok": True, "stall_s": 27.0},
        {"system": "NVRx", "fault": "lost-node", "ok": False, "stall_s": None},
        {"system": "relaunch", "fault": "hang", "ok": False, "stall_s": None},
        {"system": "NVRx", "fault": "hang", "ok": True, "stall_s": 3.0},
    ]
    assert stall_ratios(rows) == "crash 0.5, lost-node only relaunch recovers, hang -"


def test_a_kubernetes_row_is_the_median_of_what_recovered_its_spread_and_why_the_rest_did_not() -> (
    None
):
    """The Kubernetes section's rows (relaunch and the Indexed Job, a few samples each): a
    sample that did not recover counts in `recovered`, not in the median, and says why."""
    from relaunch_bench.kubernetes import JOB, row_of
    from relaunch_bench.peer_runs import PeerSample
    from relaunch_bench.report import stall_ratios

    ours = row_of(
        "relaunch", "crash", [PeerSample(True, stall_s=s, lost_steps=1) for s in (3.1, 2.7, 3.5)]
    )
    assert (ours["recovered"], ours["stall_s"], ours["stall_range"]) == ("3/3", 3.1, "2.7-3.5")
    stuck = "not restored within 150 s: rank 1's pods x on n2: Terminating (Running)"
    theirs = row_of(
        JOB, "crash", [PeerSample(True, stall_s=24.0, lost_steps=1), PeerSample(False, note=stuck)]
    )
    assert (theirs["recovered"], theirs["stall_s"], theirs["stall_range"]) == ("1/2", 24.0, None)
    assert theirs["note"] == stuck
    never = row_of(JOB, "lost-node", [PeerSample(False, note=stuck)] * 2)
    assert not never["ok"] and never["stall_s"] is None and never["note"] == stuck  # said once
    lost = row_of("relaunch", "lost-node", [PeerSample(True, stall_s=22.0, lost_steps=0)])
    assert (
        stall_ratios([ours, theirs, lost, never], JOB)
        == "crash 0.13, lost-node only relaunch recovers"
    )
