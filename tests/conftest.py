"""Fixtures shared by the runtime tests."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from tests.runtime import DDP_CLUSTER, Cluster, ddp_job, final_hash, kill_all, torchrun, wait_gone


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A state directory for one run; afterwards, no process of it may be left (no orphans)."""
    c = Cluster(tmp_path)
    yield c
    left = wait_gone(c.state, timeout=5)
    kill_all(c.state)
    assert not left, f"processes outlived the run: {[p.pid for p in left]}"


@pytest.fixture(scope="session")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The SHA-256 of the DDP example's parameters after a fault-free run (embedded cluster):
    run once for the whole session, by whichever worker asks first (the others wait for it)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # this session's directory, the same for every xdist worker
    done = shared / "unbroken-ddp.hash"
    with FileLock(str(shared / "unbroken-ddp.lock")):
        if done.exists():
            return done.read_text().strip()
        tmp = tmp_path_factory.mktemp("unbroken")
        result = Cluster(tmp).run(
            ddp_job(tmp / "hash.txt", 10), None, DDP_CLUSTER, timeout=240, startup_s=60
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.report["recoveries"] == []
        digest = (tmp / "hash.txt").read_text().strip()
        done.write_text(digest)
        return digest


@pytest.fixture(scope="session")
def fsdp_unbroken(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The FSDP2 example's final parameters' hash after a fault-free run of 2 ranks, 45 steps,
    under torchrun: run once for the session, by whichever worker asks first."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    done = shared / "unbroken-fsdp.hash"
    with FileLock(str(shared / "unbroken-fsdp.lock")):
        if not done.exists():
            tmp = tmp_path_factory.mktemp("unbroken-fsdp")
            output = torchrun(2, "--steps", "45", "--ckpt-dir", str(tmp / "ckpt"), cwd=tmp)
            done.write_text(final_hash(output))
        return done.read_text().strip()


REAL_FIXTURES = frozenset(
    {
        "cluster",
        "unbroken",
        "fsdp_unbroken",
        "unbroken_process",
        "fault_free",
        "server",
        "trial_slurm",
        "slurm",
    }
)
"""Fixtures that start a real relaunch run, cluster or server: a test that uses one is in the
`real` tier (`pytest -m "not real"` runs the rest: the simulator, the pure parts, the parts of
one process, in about a minute on two workers)."""


REAL_MODULES = frozenset(
    {
        "test_agents_engine", "test_api_fuzz", "test_bench", "test_bench_series",
        "test_controller_restart", "test_dashboard", "test_ddp_exactly_once", "test_diagnosis",
        "test_disk_full", "test_frameworks", "test_gpu_nccl", "test_networks",
        "test_operator_retry", "test_overlapped_save", "test_process_recovery",
        "test_ray_engine", "test_runner_soak", "test_runtime_cli", "test_runtime_e2e",
        "test_runtime_robustness", "test_scale", "test_sdk_bit_identical", "test_sdk_promises",
        "test_server", "test_server_hostile", "test_sharded_checkpoints", "test_slurm",
        "test_terminal", "test_torchrun_form",
    }
)  # fmt: skip
"""Modules whose tests start real runs, servers, frameworks or engines (a few of their tests do
not: they go with their module)."""


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        name = module.__name__.rpartition(".")[2] if module is not None else ""
        if name in REAL_MODULES or REAL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Every test's duration (setup, call and teardown together), slowest first, kept beside
    the run for CI (build/test-report/durations.txt), with the sum per file."""
    if hasattr(config, "workerinput"):
        return  # an xdist worker: the controller writes it
    totals: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                totals[report.nodeid] = totals.get(report.nodeid, 0.0) + report.duration
    if not totals:
        return
    per_file: dict[str, float] = {}
    for nodeid, seconds in totals.items():
        path = nodeid.split("::", 1)[0]
        per_file[path] = per_file.get(path, 0.0) + seconds
    out = Path(config.rootpath) / "build" / "test-report" / "durations.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{sum(totals.values()):9.1f}s  all {len(totals)} tests (summed over workers)", ""]
    lines += [f"{s:9.1f}s  {p}" for p, s in sorted(per_file.items(), key=lambda x: -x[1])]
    lines += [""] + [f"{s:9.2f}s  {n}" for n, s in sorted(totals.items(), key=lambda x: -x[1])]
    out.write_text("\n".join(lines) + "\n")
    terminalreporter.write_line(f"every test's duration: {out}")


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """torch.distributed in this process, alone: rank 0 of 1 (gloo, on the loopback)."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
