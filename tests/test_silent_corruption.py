"""R-45: silent data corruption. The replicas' fingerprints tell which rank computed wrong
(relaunch.train.integrity), the fault isolates its node and moves its pod, the job goes back to
a checkpoint taken while the replicas agreed, and ends bit for bit as a run without the fault.
The corruption is rehearsed for real: the launcher asks the rank, whose SDK flips one bit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from relaunch.errors import FaultPlanError
from relaunch.events import EventKind
from relaunch.faults import FaultKind
from relaunch.faults.plan import PlannedFaultKind, parse_plan
from relaunch.protocol.datagrams import CorruptionReport, corruption_datagram, parse_datagram
from relaunch.protocol.integrity import Corruption, CorruptionTarget
from relaunch.protocol.messages import CorruptionFound
from relaunch.store import NodeState
from relaunch.train.integrity import ReplicaCheck, culprits, fingerprint
from tests.controller_sim import Sim, job_spec
from tests.runtime import DDP_CLUSTER, Cluster, ddp_job

RETRIES = {"fault-tolerance/job-retry-num": "4", "fault-tolerance/pod-retry-num": "2"}


@pytest.mark.parametrize(
    ("prints", "named"),
    [
        (["a", "a", "a"], None),
        (["a", "b", "a"], (1,)),
        (["b", "a", "a", "a"], (0,)),
        (["a", "b", "a", "c", "a"], (1, 3)),
        (["a", "b"], ()),  # two replicas: no majority names either
        (["a", "a", "b", "b"], ()),
    ],
)
def test_r45_the_majority_names_the_ranks_whose_fingerprints_differ(
    prints: list[str], named: tuple[int, ...] | None
) -> None:
    assert culprits(prints) == named


@pytest.mark.parametrize("target", list(CorruptionTarget))
def test_r45_one_flipped_bit_changes_the_fingerprint(target: CorruptionTarget) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    twin = torch.nn.Linear(4, 2)
    twin.load_state_dict(model.state_dict())
    assert fingerprint(twin) == fingerprint(model)
    check = ReplicaCheck(model, optimizer, every=1)
    check._flip(target)
    if target is CorruptionTarget.OPTIMIZER:  # the momentum is wrong: the next step shows it
        assert fingerprint(model) == fingerprint(twin)
        optimizer.step()
        twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
        twin_optimizer.load_state_dict(optimizer.state_dict())  # the flipped momentum as well
    assert fingerprint(model) != fingerprint(twin)


def test_r45_a_silent_corruption_in_a_fault_plan_is_checked_like_the_other_rank_faults() -> None:
    (entry,) = parse_plan(
        [
            {
                "kind": "silent-corruption",
                "at_step": 50,
                "pod": 1,
                "target": "optimizer",
                "repeat": True,
            }
        ]
    )
    assert entry.kind is PlannedFaultKind.SILENT_CORRUPTION and entry.targets_process
    assert entry.corruption == Corruption(CorruptionTarget.OPTIMIZER, repeat=True)
    assert entry.describe() == "silent corruption of a optimizer, at every step on pod 1 at step 50"
    bad = [
        ({"kind": "silent-corruption", "at_step": 5, "node": "node-1"}, "faults[0].pod"),
        (
            {"kind": "silent-corruption", "at_step": 5, "pod": 0, "target": "gpu"},
            "faults[0].target",
        ),
        ({"kind": "hang", "at_step": 5, "pod": 0, "repeat": True}, "faults[0].repeat"),
        (
            {"kind": "process-exit", "at_step": 5, "pod": 0, "target": "parameter"},
            "faults[0].target",
        ),
    ]
    for plan, where in bad:
        with pytest.raises(FaultPlanError) as raised:
            parse_plan([plan])
        assert where in [p.key for p in raised.value.problems], raised.value.problems


@pytest.mark.parametrize(
    ("clean", "named", "seen"),
    [(40, (1,), ("0123456789abcdef:2", "fedcba9876543210:1")), (None, (), ("aa:1", "bb:1"))],
)
def test_r45_a_corruption_datagram_reads_back_as_sent(
    clean: int | None, named: tuple[int, ...], seen: tuple[str, ...]
) -> None:
    parsed = parse_datagram(corruption_datagram(2, 50, clean, named, seen))
    assert parsed == (2, CorruptionReport(50, clean, named, seen), None)


def corruption_seen_by_every_rank(sim: Sim, step: int, clean: int, named: tuple[int, ...]) -> None:
    c = sim.controller
    for rank in range(c.spec.world_size):
        found = CorruptionFound(rank, c.job.attempt, step, clean, named, ("a:2", "b:1"), 0.0)
        c.receive(sim.link_peer(rank // c.spec.procs_per_pod), found)
    sim.tick()


def test_r45_a_corruption_isolates_the_culprits_node_and_moves_its_pod(tmp_path: Path) -> None:
    """Every rank says the replicas differ at step 50 and rank 1 is the odd one out: one fault,
    on rank 1's node, said once; the ladder moves pod 1 off the node and isolates it, and the
    healthy pods start again from their checkpoints (R-23)."""
    sim = Sim(tmp_path, job_spec(RETRIES, replicas=3, procs_per_pod=1), nodes=4)
    sim.boot()
    sim.train(1)
    sim.tick()
    corruption_seen_by_every_rank(sim, 50, 40, (1,))
    (record,) = sim.records()
    assert record.fault.kind is FaultKind.SILENT_CORRUPTION
    assert (record.fault.node, record.fault.pod, record.fault.rank) == ("node-1", 1, 1)
    assert record.action.value == "pod-reschedule" and record.isolated == ("node-1",)
    (said,) = sim.said(EventKind.CORRUPTION_FOUND)
    assert (said.fields["step"], said.fields["clean_step"], said.fields["culprits"]) == (
        50,
        40,
        [1],
    )
    assert sim.controller.node("node-1").state is NodeState.ISOLATED


def test_r45_replicas_apart_with_no_majority_roll_back_isolating_nothing(tmp_path: Path) -> None:
    """Two replicas that differ: no majority names a culprit, so nothing is isolated; the job
    goes back to its checkpoints at the job level."""
    annotations = {**RETRIES, "fault-tolerance/job-unconditional-retry": "true"}
    sim = Sim(tmp_path, job_spec(annotations, replicas=2, procs_per_pod=1), nodes=3)
    sim.boot()
    sim.train(1)
    sim.tick()
    corruption_seen_by_every_rank(sim, 20, 10, ())
    (record,) = sim.records()
    assert record.fault.kind is FaultKind.SILENT_CORRUPTION and record.fault.node is None
    assert record.action.value == "job-reschedule" and record.isolated == ()
    assert all(n.state is NodeState.READY for n in sim.controller.store.nodes())


REPLICAS = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from pathlib import Path
    from relaunch.train import CheckpointManager
    from relaunch.train.integrity import ReplicaCheck, SilentCorruption

    rank, inject, ckpt_dir = int(os.environ["RANK"]), Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = CheckpointManager(ckpt_dir, rank=rank, every=5)
    check = ReplicaCheck(model, optimizer, every=10, checkpoint=ckpt)
    for step in range(1, 31):
        if step == 12 and rank == 1:  # as the launcher asks, from the fault plan
            (inject / f"{os.getpid()}.corrupt").write_text('{"target": "parameter"}')
        optimizer.zero_grad()
        model(torch.ones(4, 8) * step).sum().backward()
        optimizer.step()
        try:
            check.after_step(step)
        except SilentCorruption as error:
            print(f"rank {rank}: {error}; clean {check.clean_step}", flush=True)
            sys.exit(3)
        ckpt.maybe_save(step, {"w": model.weight.detach().clone()})
    print(f"rank {rank}: not found", flush=True)
    """
)


def test_r45_three_replicas_find_the_flipped_rank_and_set_aside_the_checkpoints_after_agreement(
    tmp_path: Path,
) -> None:
    """Three real processes on gloo, a save every 5 steps and a check every 10: rank 1's SDK
    flips a bit at step 12 as the launcher asked; the check at step 20 finds it, names rank 1,
    says the replicas last agreed at step 10, and moves step 15's checkpoint out of the
    restores' way (step 20's is never taken: the check comes first); 10 and before stay."""
    script = tmp_path / "replicas.py"
    script.write_text(REPLICAS)
    inject, ckpt_dir = tmp_path / "inject", tmp_path / "ckpt"
    inject.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("RELAUNCH_")}
    base |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "3"}
    base |= {"RELAUNCH_INJECT_DIR": str(inject)}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(inject), str(ckpt_dir)],
            env={**base, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(3)
    ]
    said = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [3, 3, 3], said
    assert all("differ at step 20 (1); clean 10" in out for out in said), said
    kept = sorted(p.name for p in ckpt_dir.iterdir())
    assert [n for n in kept if n.startswith("step-")] == ["step-000000005", "step-000000010"]
    assert [n.split("-")[2] for n in kept if n.startswith("suspect-")] == ["000000015"]
    assert not list(inject.iterdir())  # the request was taken


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.real
def test_r45_the_ddp_example_through_a_flipped_bit_ends_bit_identical_its_culprit_isolated(
    tmp_path: Path,
) -> None:
    """The DDP example, 3 replicas, a bit of rank 1's parameters flipped once its step 50 is
    reported, a check every 10 steps (the default): found at the next check, rank 1's node
    isolated, its pod moved, every rank back at the newest checkpoint the replicas agreed on
    (the one of the last check that agreed), and the final parameters bit for bit those of the
    run without the fault. The same for a bad chip (`repeat`: a bit flipped at every step from
    step 50 on): isolated at its first detection, so one rollback, never a second."""
    runs = {}
    corruption = {"kind": "silent-corruption", "at_step": 50, "pod": 1}
    for name, faults in (
        ("fault-free", None),
        ("corrupted", [corruption]),
        ("bad-chip", [{**corruption, "repeat": True}]),
    ):
        (tmp_path / name).mkdir()
        out = tmp_path / name / "hash.txt"
        job = ddp_job(out, steps=80)
        job["spec"]["replicas"] = 3
        result = Cluster(tmp_path / name).run(job, faults, DDP_CLUSTER, timeout=300, startup_s=60)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[name] = (result, out.read_text().strip())
    for name in ("corrupted", "bad-chip"):
        result, digest = runs[name]
        assert digest == runs["fault-free"][1], name
        (record,) = result.report["recoveries"]
        assert record["fault"]["kind"] == "silent-corruption", record
        assert (record["fault"]["node"], record["fault"]["rank"]) == ("node-1", 1), record
        assert record["action"] == "pod-reschedule" and record["isolated_nodes"] == ["node-1"]
        (found,) = result.said(EventKind.CORRUPTION_FOUND)
        step, clean = found.fields["step"], found.fields["clean_step"]
        assert found.fields["culprits"] == [1] and step == clean + 10 and clean >= 50, found.fields
        resumed = sorted({int(s) for s in re.findall(r"resume_step=(\d+)", result.logs())})
        assert resumed == [0, clean], (name, resumed)  # every rank back where they last agreed
