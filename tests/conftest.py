"""Fixtures shared by the runtime tests."""

from __future__ import annotations

import os
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


def _once_per_session(factory: pytest.TempPathFactory, name: str, compute: Any) -> str:
    """A fault-free run's hash, computed once for the whole session by whichever worker asks
    first (the others wait for it on a lock, then read it): `compute(tmp)` runs it."""
    shared = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # this session's directory, the same for every xdist worker
    done = shared / f"{name}.hash"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            done.write_text(compute(factory.mktemp(name)))
        return done.read_text().strip()


def _fault_free(job: dict[str, Any], tmp: Path) -> str:
    result = Cluster(tmp).run(job, None, DDP_CLUSTER, timeout=240, startup_s=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.report["recoveries"] == []
    return (tmp / "hash.txt").read_text().strip()


@pytest.fixture(scope="session")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The SHA-256 of the DDP example's parameters after a fault-free run (embedded cluster, 2
    pods of 1 rank, 120 steps, a save every 10)."""
    return _once_per_session(
        tmp_path_factory, "unbroken-ddp", lambda tmp: _fault_free(ddp_job(tmp / "hash.txt"), tmp)
    )


@pytest.fixture(scope="session")
def unbroken_process_pair(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same with process-level recovery (the example's `--process-recovery`: the SDK's
    process group keeper, whose bucketed all-reduce ends on other bits than DDP's): the baseline
    of the network and operator-retry tests, which add only faults and settings to it."""
    return _once_per_session(
        tmp_path_factory,
        "unbroken-ddp-process",
        lambda tmp: _fault_free(ddp_job(tmp / "hash.txt", process=True), tmp),
    )


@pytest.fixture(scope="session")
def fsdp_unbroken(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The FSDP2 example's final parameters' hash after a fault-free run of 2 ranks, 45 steps,
    under torchrun."""

    def compute(tmp: Path) -> str:
        return final_hash(torchrun(2, "--steps", "45", "--ckpt-dir", str(tmp / "ckpt"), cwd=tmp))

    return _once_per_session(tmp_path_factory, "unbroken-fsdp", compute)


REAL_FIXTURES = frozenset(
    {
        "cluster",
        "unbroken",
        "fsdp_unbroken",
        "unbroken_process",
        "unbroken_process_pair",
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
        "test_disk_full", "test_frameworks", "test_gpu_nccl", "test_kubernetes", "test_mindspore",
        "test_networks",
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
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """torch.distributed in this process, alone: rank 0 of 1 (gloo), met through a file store:
    a port found free, then bound by a TCP store, was now and then taken in between by a test
    on the other worker."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("world-of-one") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
