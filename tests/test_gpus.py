"""NVIDIA GPUs: every Xid class and NVML condition mapped onto a handling level and a ladder, the
mapping overridable from a fault table file, NVML's readings turned into chip faults (a stand-in
NVML module: this machine has no GPU; the real one is read in the last tests, which run where
a GPU is), and a GPU fault injected on the embedded cluster climbing the ladder end to end."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from relaunch.cluster.agent import Agent
from relaunch.cluster.nvml import NvmlChips, open_gpus
from relaunch.faults import Fault, FaultKind, normalize_code
from relaunch.faults.codes import HandlingLevel, parse_fault_table
from relaunch.faults.default_codes import DEFAULT_TABLE
from relaunch.faults.escalation import EscalationRules
from relaunch.faults.gpu_codes import GPU_ROWS, GpuReading, gpu_fault_codes, most_serious
from relaunch.policy import ClusterView, JobHistory, PodView, plan
from relaunch.spec import parse_job
from tests.runtime import POD_LEVEL, Cluster, toy_job

L = HandlingLevel

# What each code should do, stated here independently of relaunch.faults.gpu_codes:
# (level, user-induced, the ladder for a 2-pod job with pod and job rescheduling on).
IN_PLACE = "in-place -> pod-reschedule -> job-reschedule -> fail"
USER = "in-place -> job-reschedule -> fail"  # user-induced: never moves a pod
MOVE = "pod-reschedule -> job-reschedule -> fail"
EXPECTED: dict[str, tuple[HandlingLevel, bool, str]] = {
    "XID-13": (L.RESTART_REQUEST, True, USER),
    "XID-31": (L.RESTART_REQUEST, True, USER),
    "XID-43": (L.RESTART_REQUEST, True, USER),
    "XID-45": (L.NOT_HANDLE_FAULT, False, "ignore"),
    "XID-92": (L.SUB_HEALTH_FAULT, False, "ignore"),
    "XID-32": (L.RESTART_BUSINESS, False, IN_PLACE),
    "XID-69": (L.RESTART_BUSINESS, False, IN_PLACE),
    "XID-94": (L.RESTART_BUSINESS, False, IN_PLACE),
    "XID-63": (L.FREE_RESTART_NPU, False, IN_PLACE),
    "GPU-ROW-REMAP-PENDING": (L.FREE_RESTART_NPU, False, IN_PLACE),
    "GPU-RETIRED-PAGES-PENDING": (L.FREE_RESTART_NPU, False, IN_PLACE),
    "XID-48": (L.RESTART_NPU, False, IN_PLACE),
    "XID-95": (L.RESTART_NPU, False, IN_PLACE),
    "XID-74": (L.RESTART_NPU, False, IN_PLACE),
    "XID-38": (L.RESTART_NPU, False, IN_PLACE),
    "XID-61": (L.RESTART_NPU, False, IN_PLACE),
    "XID-62": (L.RESTART_NPU, False, IN_PLACE),
    "XID-119": (L.RESTART_NPU, False, IN_PLACE),
    "XID-120": (L.RESTART_NPU, False, IN_PLACE),
    "GPU-ECC-DBE": (L.RESTART_NPU, False, IN_PLACE),
    "XID-64": (L.SEPARATE_NPU, False, MOVE),
    "XID-79": (L.SEPARATE_NPU, False, MOVE),
    "GPU-LOST": (L.SEPARATE_NPU, False, MOVE),
    "GPU-ROW-REMAP-FAILURE": (L.SEPARATE_NPU, False, MOVE),
}

JOB = parse_job(
    {
        "kind": "job",
        "metadata": {
            "name": "gpu",
            "annotations": {
                "fault-tolerance/job-retry-num": "3",
                "fault-tolerance/pod-retry-num": "2",
            },
        },
        "spec": {"replicas": 2, "procs_per_pod": 2, "command": "python train.py"},
    }
)


def ladder(code: str, table: Any = DEFAULT_TABLE) -> str:
    pods = tuple(PodView(i, f"node-{i}", holds_rank0=i == 0) for i in range(2))
    cluster = ClusterView(pods=pods, standby_nodes=("node-2",))
    fault = Fault(FaultKind.CHIP, 0.0, node="node-1", chip=0, code=code)
    steps = plan(JOB.recovery, fault, JobHistory(pods=2), cluster, 0.0, table=table,
                 rules=EscalationRules())  # fmt: skip
    return " -> ".join(d.action.value for d in steps)


def test_every_gpu_code_of_the_table_is_stated_here() -> None:
    assert {row.code for row in GPU_ROWS} == set(EXPECTED)


@pytest.mark.parametrize("code", sorted(EXPECTED))
def test_each_xid_class_maps_to_its_handling_level_and_ladder(code: str) -> None:
    level, user, expected_ladder = EXPECTED[code]
    row = DEFAULT_TABLE.lookup(code)
    assert (row.level, row.user_induced, row.known) == (level, user, True)
    assert ladder(code) == expected_ladder


def test_an_unknown_xid_is_handled_as_r09_says_for_an_unknown_code() -> None:
    assert DEFAULT_TABLE.lookup("XID-999").level is L.SEPARATE_NPU
    assert ladder("XID-999") == MOVE


def test_a_fault_table_file_overrides_a_gpu_row() -> None:
    """A site that trusts its GPUs after Xid 79 (a reseat fixes it) says so in a file."""
    override = parse_fault_table(
        {"codes": [{"code": "xid 79", "level": "RestartNPU"}, {"code": "XID-13", "level": "NotHandleFault"}]}
    )  # fmt: skip
    table = DEFAULT_TABLE.overridden_by(override.rows)
    assert table.lookup("XID-79").level is L.RESTART_NPU
    assert ladder("XID-79", table) == IN_PLACE
    assert ladder("XID-13", table) == "ignore"


@pytest.mark.parametrize(
    ("given", "code"),
    [("XID-79", "XID-79"), ("xid79", "XID-79"), ("Xid 79", "XID-79"), ("XID_048", "XID-48"),
     ("gpu-lost", "GPU-LOST"), (" GPU-ECC-DBE ", "GPU-ECC-DBE"), ("80e18005", "80E18005")],
)  # fmt: skip
def test_gpu_codes_are_written_several_ways_and_read_as_one(given: str, code: str) -> None:
    assert normalize_code(given) == code


@pytest.mark.parametrize("given", ["XID-0", "XID-1000", "XID-", "XID-7a", "GPU-FOO", "GPU", ""])
def test_a_code_that_is_neither_npu_nor_gpu_is_refused_saying_what_is(given: str) -> None:
    with pytest.raises(ValueError, match=r"XID-<1\.\.999>"):
        normalize_code(given)


# -- readings to codes (pure) -------------------------------------------------------------------


def test_a_lost_gpu_is_only_lost() -> None:
    assert gpu_fault_codes(None, GpuReading(0, lost=True, xids=(79,), remap_pending=True)) == (
        "GPU-LOST",
    )


def test_a_grown_uncorrected_ecc_count_is_a_fault_unless_an_xid_said_it() -> None:
    before = GpuReading(0, uncorrected_ecc=2)
    assert gpu_fault_codes(before, GpuReading(0, uncorrected_ecc=3)) == ("GPU-ECC-DBE",)
    assert gpu_fault_codes(before, GpuReading(0, xids=(48,), uncorrected_ecc=3)) == ("XID-48",)
    assert gpu_fault_codes(before, GpuReading(0, uncorrected_ecc=2)) == ()
    assert gpu_fault_codes(None, GpuReading(0, uncorrected_ecc=9)) == ()  # the first look: a base
    assert gpu_fault_codes(GpuReading(0), GpuReading(0, uncorrected_ecc=9)) == ()  # unsupported


def test_conditions_and_events_of_one_look_all_show_and_the_worst_is_reported() -> None:
    codes = gpu_fault_codes(None, GpuReading(0, xids=(13, 13, 63), remap_pending=True,
                                             retired_pending=True))  # fmt: skip
    assert codes == ("XID-13", "XID-63", "GPU-ROW-REMAP-PENDING", "GPU-RETIRED-PAGES-PENDING")
    failed = gpu_fault_codes(None, GpuReading(0, remap_pending=True, remap_failure=True))
    assert failed == ("GPU-ROW-REMAP-FAILURE",)
    assert most_serious(["XID-13", "XID-63", "XID-79", "XID-92"]) == "XID-79"
    assert most_serious(["XID-92", "XID-500"]) == "XID-500"  # unknown: SeparateNPU
    assert most_serious([]) is None


# -- NVML through a stand-in module ------------------------------------------------------------


class NVMLError(Exception):
    pass


class NVMLError_Timeout(NVMLError):
    pass


class NVMLError_GpuIsLost(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


@dataclass
class Event:
    device: int
    eventData: int
    eventType: int = 8


class FakeNvml:
    """The part of pynvml NvmlChips calls, over GPUs whose state a test sets."""

    NVMLError = NVMLError
    NVMLError_Timeout = NVMLError_Timeout
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    nvmlEventTypeXidCriticalError = 8
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_FEATURE_ENABLED = 1

    def __init__(self, gpus: int) -> None:
        self.events: list[Event] = []
        self.lost: set[int] = set()
        self.ecc = dict.fromkeys(range(gpus), 0)
        self.remapped = {i: (0, 0, 0, 0) for i in range(gpus)}
        self.retired = dict.fromkeys(range(gpus), 0)
        self.no_remap: set[int] = set()

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, events: str) -> None:
        assert types == 8 and events == "set"

    def nvmlEventSetWait_v2(self, events: str, timeout_ms: int) -> Event:
        assert timeout_ms == 0  # never blocks the heartbeat
        if not self.events:
            raise NVMLError_Timeout()
        return self.events.pop(0)

    def _alive(self, handle: int) -> None:
        if handle in self.lost:
            raise NVMLError_GpuIsLost()

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        self._alive(handle)
        return f"GPU-{handle}"

    def nvmlDeviceGetTotalEccErrors(self, handle: int, kind: int, counter: int) -> int:
        self._alive(handle)
        assert (kind, counter) == (1, 0)
        return self.ecc[handle]

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        self._alive(handle)
        if handle in self.no_remap:
            raise NVMLError_NotSupported()
        return self.remapped[handle]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> int:
        self._alive(handle)
        return self.retired[handle]


def test_nvml_chips_are_the_nodes_slice_of_the_machines_gpus() -> None:
    nvml = FakeNvml(4)
    chips = NvmlChips(nvml, first=2, count=2)  # the second node of 2 chips each
    nvml.events = [Event(device=3, eventData=79), Event(device=0, eventData=48),
                   Event(device=2, eventData=13)]  # fmt: skip
    nvml.ecc[2] = 5
    nvml.remapped[3] = (0, 1, 1, 0)
    looks = chips.look()
    assert [(r.index, r.xids, r.uncorrected_ecc, r.remap_pending) for r in looks] == [
        (0, (13,), 5, False),  # GPU 2 is chip 0; GPU 0's Xid 48 is another node's
        (1, (79,), 0, True),
    ]
    assert chips.look()[1].xids == ()  # each event once


def test_a_gpu_that_is_lost_or_does_not_support_a_query_reads_as_such() -> None:
    nvml = FakeNvml(2)
    chips = NvmlChips(nvml, first=0, count=2)
    nvml.lost.add(1)
    nvml.no_remap.add(0)
    first, second = chips.look()
    assert first == GpuReading(0, uncorrected_ecc=0)  # remap rows unsupported: no fault
    assert second.lost


def agent_with(nvml: FakeNvml, tmp: Path) -> Agent:
    return Agent(tmp, "node-0", 2, 0.5, 1.0, 20.0, NvmlChips(nvml, 0, 2))


def test_the_agent_reports_an_xid_each_time_and_a_condition_once_while_it_holds(
    tmp_path: Path,
) -> None:
    nvml = FakeNvml(2)
    agent = agent_with(nvml, tmp_path)
    assert agent.heartbeat().chips == ()
    nvml.events = [Event(0, 13)]
    [xid] = agent.heartbeat().chips
    assert (xid.chip, xid.code, xid.heals) == (0, "XID-13", True)
    nvml.events = [Event(0, 13)]
    [again] = agent.heartbeat().chips
    assert again.seq > xid.seq  # a second event is a second fault
    nvml.remapped[1] = (0, 1, 1, 0)
    reports = {r.chip: r for r in agent.heartbeat().chips}
    pending = reports[1]
    assert (pending.code, pending.heals) == ("GPU-ROW-REMAP-PENDING", False)
    assert {r.chip: r for r in agent.heartbeat().chips}[1].seq == pending.seq  # the same fault
    nvml.remapped[1] = (1, 0, 0, 0)  # the GPU was reset: the remap was applied
    assert 1 not in {r.chip for r in agent.heartbeat().chips}


def test_an_in_place_heal_does_not_clear_a_condition_only_a_gpu_reset_can(tmp_path: Path) -> None:
    nvml = FakeNvml(2)
    agent = agent_with(nvml, tmp_path)
    nvml.lost.add(0)
    nvml.events = [Event(1, 94)]
    agent.heartbeat()
    assert agent._heal() is False  # the lost GPU stays lost
    assert {r.code for r in agent.heartbeat().chips} == {"GPU-LOST"}


def test_without_nvml_the_agent_simulates_its_chips_and_says_why() -> None:
    """The real counterpart: this machine has nvidia-ml-py but no driver or GPU."""
    gpus, why = open_gpus(0, 2)
    if shutil.which("nvidia-smi") is not None:
        pytest.skip("this machine has an NVIDIA driver: test_the_real_gpus_read_clean reads it")
    assert gpus is None
    assert why.startswith(("NVML: ", "nvidia-ml-py is not installed"))


def test_the_real_gpus_read_clean() -> None:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi is not installed)")
    count = int(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True)
                .stdout.count("GPU "))  # fmt: skip
    gpus, why = open_gpus(0, count)
    assert gpus is not None, why
    looks = gpus.look()
    assert [r.index for r in looks] == list(range(count))
    assert not any(r.lost for r in looks)


# -- end to end: a GPU fault on the embedded cluster's simulated chips --------------------------


def test_an_xid_79_moves_the_pod_and_an_xid_13_restarts_in_place(cluster: Cluster) -> None:
    faults = [
        {"kind": "chip-fault", "at_step": 8, "pod": 1, "chip": 0, "code": "XID-13", "heals": True},
        {"kind": "chip-fault", "at_step": 20, "pod": 1, "chip": 1, "code": "Xid 79"},
    ]
    result = cluster.run(toy_job(POD_LEVEL), faults)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.actions == ["in-place", "pod-reschedule"]
    first, second = result.report["recoveries"]
    assert (first["fault"]["code"], first["fault"]["chip"]) == ("XID-13", 0)
    assert (second["fault"]["code"], second["fault"]["chip"]) == ("XID-79", 1)
    assert second["isolated_nodes"] == ["node-1"]


# -- the keeper on NCCL --------------------------------------------------------------------------


def test_the_keeper_aborts_an_nccl_group_through_its_communicator(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The logic, with torch.distributed's calls recorded: this machine has no NCCL, and no GPU
    machine was lent to this work (docs/gpus.md says what is not yet run on one)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from relaunch.train.group import ProcessGroupKeeper

    calls: list[str] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed_c10d, "_abort_process_group", lambda: calls.append("abort"))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append("init"))
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # torchrun's, set by the launcher
    monkeypatch.setenv("RELAUNCH_MEMBERSHIP", str(tmp_path / "membership.json"))
    model = torch.nn.Linear(2, 2)
    keeper = ProcessGroupKeeper(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="nccl")
    keeper._form(None)
    assert calls == ["init"]
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: the process lives
    keeper._abort()
    assert calls == ["init", "abort"]
    gloo = ProcessGroupKeeper(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="gloo")
    gloo._abort()
    assert calls == ["init", "abort"]  # gloo: its sockets are shut instead


def test_a_warm_spare_starts_cuda_on_its_pods_gpu(tmp_path: Path) -> None:
    """On a real GPU: a spare of a one-GPU pod (CUDA_VISIBLE_DEVICES=0) imports torch and starts
    CUDA while it waits (`ready cuda 0`); the rank it becomes finds CUDA started and its first
    tensor on the GPU costs it no context. Without CUDA: skipped (the spare's part is checked
    with a stand-in in tests/test_launcher_parts.py)."""
    import json
    import sys

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA here (torch's CPU build, or no NVIDIA GPU)")
    script = tmp_path / "rank.py"
    script.write_text(
        "import time, torch\n"
        "started = torch.cuda.is_initialized()\n"
        "t = time.perf_counter(); torch.ones(1, device='cuda'); torch.cuda.synchronize()\n"
        "print('initialized', started, 'first tensor', time.perf_counter() - t, flush=True)\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    spare = subprocess.Popen(
        [sys.executable, "-m", "relaunch._spare"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
    )  # fmt: skip
    log = tmp_path / "rank.log"
    try:
        assert spare.stdout is not None and spare.stdin is not None
        assert spare.stdout.readline().strip() == b"ready cuda 0"
        identity = {"env": env, "argv": [str(script)], "cwd": str(tmp_path), "log": str(log)}
        spare.stdin.write((json.dumps(identity) + "\n").encode())
        spare.stdin.close()
        assert spare.wait(timeout=120) == 0, log.read_text()
    finally:
        spare.kill()
    said = log.read_text().split()
    assert said[:2] == ["initialized", "True"], said
    print("warm spare's first tensor on the GPU:", said[-1], "s")
