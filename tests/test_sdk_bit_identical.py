"""The SDK's bit-identical promise for a script written from docs/training-sdk.md alone (dropout,
Adam, three random streams: tests/scripts/ddp_dropout_adam.py), under every fault kind of the
fault plan: a crash (job-reschedule), a chip fault that heals (in-place), a lost node
(pod-reschedule) and a hang (hang-restart). Each run ends with the parameters of the fault-free
run, bit for bit (its periodic saves overlapped with the next step: `overlap_copy=True`); so does
a run that saves only dying gasps (no periodic checkpoint).

Before the fix, the settle pass's dropout drew once more per start, and a gasp after a failed
step saved the random streams of the step that failed: both runs ended with another hash.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from relaunch.events import EventKind
from relaunch.restores import restores
from tests.runtime import DDP_CLUSTER, DDP_FAULTS, DDP_JOB, ROOT, Cluster, Result

SCRIPT = ROOT / "tests" / "scripts" / "ddp_dropout_adam.py"
ACTIONS = ["job-reschedule", "in-place", "pod-reschedule", "hang-restart"]


def job(out: Path, ckpt_every: int, save: str = "sync") -> dict[str, Any]:
    """The DDP example's job file (fault-scheduling: grace, every level on), running the
    independent script; one process per pod, so that each restart starts two torch processes
    on the tests' two cores. `save`: sync, async or overlap (the script's --save)."""
    spec = yaml.safe_load(yaml.safe_dump(DDP_JOB))
    spec["metadata"]["name"] = "dropout-adam"
    spec["spec"]["procs_per_pod"] = 1
    spec["spec"]["command"] = (
        f"python {SCRIPT} --steps 120 --ckpt-every {ckpt_every} --out {out} --save {save}"
    )
    return spec


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("fault-free")
    result = Cluster(tmp).run(
        job(tmp / "hash.txt", 10), None, DDP_CLUSTER, timeout=240, startup_s=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.report["recoveries"] == []
    return (tmp / "hash.txt").read_text().strip()


def story(result: Result) -> str:
    """What each rank did, for a hash that differs: every attempt, resume and dying gasp."""
    lines = [
        line
        for line in result.logs().splitlines()
        if line.startswith(("--- relaunch:", "start:", "relaunch: dying gasp", "done:"))
    ]
    return "\n".join([*lines, result.stdout])


def resume_steps(logs: str) -> list[int]:
    return [int(m) for m in re.findall(r"start: rank 0 resume_step=(\d+)", logs)]


def test_overlapped_saves_and_warm_restarts_at_every_level_end_bit_identical(
    cluster: Cluster, fault_free: str
) -> None:
    """Two promises of one run (each a real run of its own before; the suite's time): periodic
    saves overlapped with the next step (the fault-free run saves synchronously; the synchronous
    path is the DDP example's, tested under every fault elsewhere), and spec.warm_spares: the
    restarted processes are spares that imported torch before the fault (a standby launcher's
    for the rebuilt and the moved pods, the pod's own for in-place and hang restarts), and run
    the script as a fresh process would. Same result, bit for bit. With `peer_memory_mb` too:
    each save also goes to another node's memory, and the rank moved off the lost node, in a
    warm spare, restores from there (on record)."""
    out = cluster.dir / "hash.txt"
    spec = job(out, 10, "overlap")
    spec["spec"]["warm_spares"] = 1
    spec["spec"]["peer_memory_mb"] = 16
    result = cluster.run(spec, DDP_FAULTS, DDP_CLUSTER, timeout=400, startup_s=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.actions == ACTIONS, result.stdout
    assert all(r["outcome"] == "succeeded" for r in result.report["recoveries"])
    assert out.read_text().strip() == fault_free, story(result)
    assert result.said(EventKind.STANDBY_TAKEN) or result.said(EventKind.STANDBYS_TAKEN)
    warm = re.findall(r"--- relaunch: attempt ([2-9]), \S+, warm spare pid \d+ ---", result.logs())
    assert warm, "no restart ran in a warm spare"
    events = result.events()
    lost = next(i for i, e in enumerate(events) if e.fields.get("fault") == "node-lost")
    moved = [r for r in restores(events[lost:]) if (r["pod"], r["rank"]) == (1, 1)]
    assert moved and moved[0]["tier"] == "peer-memory", events


def test_sdk_script_with_dying_gasps_only_ends_bit_identical_under_every_fault(
    cluster: Cluster, fault_free: str
) -> None:
    out = cluster.dir / "hash.txt"
    result = cluster.run(job(out, 0), DDP_FAULTS, DDP_CLUSTER, timeout=400, startup_s=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.actions == ACTIONS
    assert out.read_text().strip() == fault_free, story(result)
    # Only gasps exist: each resume after the crash, the chip fault and the lost node comes from
    # a gasp saved by the healthy rank, no earlier than the step the fault was injected at.
    resumed = resume_steps(result.logs())
    assert resumed[0] == 0
    triggers = [f["at_step"] for f in DDP_FAULTS]
    for after_fault, trigger in zip(resumed[1:4], triggers[:3], strict=True):
        assert after_fault >= trigger - 1
