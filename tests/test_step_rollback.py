"""What process-level recovery keeps of each step to run it again (spec.step_rollback, issue 48's
third part): a replica's rollback keeps only what a forward pass changes, and a rank whose memory a
fault touched takes model and optimizer from a healthy replica."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from relaunch.controller.commands import _attempt_variables
from relaunch.errors import SpecError
from relaunch.protocol.environment import Env
from relaunch.protocol.rollback import StepRollback
from relaunch.train.distributed import restore_snapshot, rollback_mode, step_snapshot
from tests.builders import job

# Two ranks of a DDP replica over gloo on the loopback; rank 0's memory is struck after a step
# (its parameters and momentum overwritten), then both call replica_restore as the keeper does in
# an online retry whose membership names rank 0 a suspect.
TWO_RANKS = r"""
import json, os, sys
import torch
import torch.distributed as dist
from torch import nn
from relaunch.protocol.plans import Membership
from relaunch.train.distributed import parameter_hash, replica_restore

rank, store, suspects = int(sys.argv[1]), sys.argv[2], tuple(json.loads(sys.argv[3]))
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.randn(4, 8)).sum().backward()
optimizer.step()
healthy = parameter_hash(model), optimizer.state_dict()["state"][0]["momentum_buffer"].sum().item()
if rank in suspects:  # the memory error: garbage in the parameters and the optimizer's state
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1000.0)
        optimizer.state[model[0].weight]["momentum_buffer"].fill_(7.0)
m = Membership.of_pods({0: 1, 1: 1}, 1, generation=2, addr="127.0.0.1", port=29500,
                       retry=True, suspects=suspects)
source = replica_restore(model, optimizer, m, rank, 1)
after = parameter_hash(model), optimizer.state_dict()["state"][0]["momentum_buffer"].sum().item()
print("result:", json.dumps({"source": source, "healthy": healthy, "after": after}), flush=True)
dist.barrier()  # neither leaves while the other still uses gloo
# this harness's result is said: no teardown (torch 2.13's gloo aborted in it now and then, even
# after the barrier, "terminate called without an active exception", once the result was out)
os._exit(0)
"""


def _two_ranks(suspects: tuple[int, ...], tmp: Path) -> list[dict[str, object]]:
    """The two ranks meet through a file store: a port found free and then bound by the store
    was taken in between by a test on the other worker, now and then."""
    store = tmp / "store"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAUNCH_")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_RANKS, str(rank), str(store), json.dumps(suspects)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    found = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        said = f"exit {proc.returncode}\n--- stdout:\n{out}\n--- stderr:\n{err}"
        results = [line for line in out.splitlines() if line.startswith("result: ")]
        assert proc.returncode == 0 and len(results) == 1, said
        found.append(json.loads(results[0].removeprefix("result: ")))
    return found


def test_r30_a_rank_whose_memory_a_fault_touched_takes_model_and_optimizer_from_a_replica(
    tmp_path: Path,
) -> None:
    """Rank 0's parameters and momentum are garbage after the memory error; the retry's
    membership names it a suspect, and it ends with rank 1's state, bit for bit, as it was
    before the error (the step changed neither before its commit)."""
    struck, healthy = _two_ranks((0,), tmp_path)
    assert struck["source"] == healthy["source"] == 1
    assert struck["healthy"] == healthy["healthy"], "two replicas of one model"
    assert struck["after"] == healthy["after"] == healthy["healthy"]


def test_r30_with_every_rank_a_suspect_no_replica_serves_and_each_keeps_its_own(
    tmp_path: Path,
) -> None:
    """A job of one replica (every rank on the struck pod) has no healthy replica: nothing is
    sent, each rank keeps what it holds (`snapshot` is the choice for such a job)."""
    struck, other = _two_ranks((0, 1), tmp_path)
    assert struck["source"] is None and other["source"] is None
    assert struck["after"] != struck["healthy"], "no replica could repair it"


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()  # the optimizer has state
    return model, optimizer


def test_a_replicas_step_rollback_keeps_only_what_a_forward_pass_changes() -> None:
    """A step's forward pass moves BatchNorm's running statistics and draws from the random
    streams; the replica rollback puts both back, copies no parameter and no optimizer state
    (they change only at the keeper's optimizer step, after the commit), and clears the
    gradients."""
    model, optimizer = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    snapshot = step_snapshot(model, optimizer, full=False)
    assert set(snapshot) == {"rng", "buffers"}
    assert set(snapshot["buffers"]) == {name for name, _ in model.named_buffers()}
    drawn = torch.randn(3)
    model(torch.randn(16, 8)).sum().backward()  # the step, interrupted before its commit
    assert not torch.equal(model.state_dict()["1.running_mean"], before["1.running_mean"])
    restore_snapshot(model, optimizer, snapshot)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.randn(3), drawn), "the random streams are back at the step's start"
    assert all(p.grad is None for p in model.parameters())


def test_a_snapshot_rollback_copies_model_and_optimizer_and_puts_them_back() -> None:
    model, optimizer = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    snapshot = step_snapshot(model, optimizer, full=True)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()  # a script whose step changed its state before the commit
    restore_snapshot(model, optimizer, snapshot)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], moments)


def test_the_rollback_is_the_callers_else_the_jobs_else_a_replicas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, optimizer = _model()
    monkeypatch.delenv(Env.STEP_ROLLBACK, raising=False)
    assert rollback_mode(None, optimizer) is StepRollback.REPLICA
    monkeypatch.setenv(Env.STEP_ROLLBACK, "snapshot")
    assert rollback_mode(None, optimizer) is StepRollback.SNAPSHOT
    assert rollback_mode("replica", optimizer) is StepRollback.REPLICA
    with pytest.raises(
        ValueError, match="step rollback 'copy': expected one of 'replica', 'snapshot'"
    ):
        rollback_mode("copy", optimizer)


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")  # its import
def test_a_sharded_optimizer_has_no_replica_and_takes_a_snapshot(world_of_one: None) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = nn.Linear(4, 4)
    sharded = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    assert rollback_mode("replica", sharded) is StepRollback.SNAPSHOT


def test_the_spec_chooses_the_rollback_and_refuses_an_unknown_one() -> None:
    assert job().recovery.step_rollback is StepRollback.REPLICA
    assert job(step_rollback="snapshot").recovery.step_rollback is StepRollback.SNAPSHOT
    for bad in ("everything", "", 1, True):
        with pytest.raises(SpecError) as error:
            job(step_rollback=bad)
        assert [p.key for p in error.value.problems] == ["spec.step_rollback"]
        assert "one of 'replica', 'snapshot'" in str(error.value)


def test_a_process_level_jobs_ranks_hear_the_rollback_others_do_not() -> None:
    process = {"recover-strategy": "retry"}
    labels = {"fault-scheduling": "grace", "process-recover-enable": "on"}
    chosen = job(process, labels, step_rollback="snapshot")
    env = _attempt_variables("j", 1, 1, 1, 1, "127.0.0.1", 1, "/s", chosen.recovery)
    assert env[Env.STEP_ROLLBACK] == "snapshot"
    plain = _attempt_variables("j", 1, 1, 1, 1, "127.0.0.1", 1, "/s", job().recovery)
    assert Env.STEP_ROLLBACK not in plain


def test_elastic_boundaries_are_copied_only_where_the_world_may_change_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The elastic boundary's full copy (every `elastic_every` steps: 3.5 % of a 100M-parameter
    model's steps) is only for jobs whose strategies scale in, or that ask for it."""
    from relaunch.train.group import ProcessGroupKeeper

    model, optimizer = _model()
    for name in (Env.HIGH_AVAILABILITY, Env.ELASTIC_EVERY):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(Env.HIGH_AVAILABILITY, "retry,recover")
    assert not ProcessGroupKeeper(model, optimizer).elastic
    assert ProcessGroupKeeper(model, optimizer, elastic_every=10).elastic
    monkeypatch.setenv(Env.HIGH_AVAILABILITY, "retry,elastic-training")
    assert ProcessGroupKeeper(model, optimizer).elastic
    monkeypatch.delenv(Env.HIGH_AVAILABILITY)
    monkeypatch.setenv(Env.ELASTIC_EVERY, "5")
    assert ProcessGroupKeeper(model, optimizer).elastic


def test_the_bench_section_times_each_rollback_beside_a_step_and_reports_it() -> None:
    """`relaunch bench --only rollback` (a tiny model here; about 100M parameters in the bench):
    each rollback's cost is its copy over a step, the elastic boundary's spread over its steps."""
    from relaunch_bench import report
    from relaunch_bench.rollback import ELASTIC_EVERY, rollback_rows

    said: list[str] = []
    rows = rollback_rows(True, said.append, layers=2, width=64)
    assert [r["rollback"] for r in rows] == ["replica", "snapshot", "elastic boundary"]
    replica, snapshot, boundary = rows
    assert replica["params_m"] == snapshot["params_m"] == round(2 * (64 * 64 + 64) / 1e6, 1)
    assert all(r["step_ms"] > 0 and r["keep_ms"] > 0 for r in rows)
    assert boundary["every_steps"] == ELASTIC_EVERY and boundary["keep_ms"] == snapshot["keep_ms"]
    assert said[0].startswith("rollback: ")
    table = "\n".join(report.table(rows, report.ROLLBACK_COLUMNS))
    assert "| replica |" in table and "| kept before a step |" in table
