"""The engine port (relaunch.cluster.Engine) and the registry of engines by name
(relaunch.engines): adding an engine is one module and its entry, proved by an engine of the
tests' own (tests/processes_engine.py) running the demo's three faults; no command picks an
engine by comparing its name."""

from __future__ import annotations

import ast
import json
import typing
from pathlib import Path

import pytest
from typer.testing import CliRunner

from relaunch import engines
from relaunch.cli import app
from relaunch.cluster import Engine, EngineBase
from tests.processes_engine import ProcessesKind

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "relaunch"


def test_every_engine_is_found_by_name_and_an_unknown_name_is_refused_naming_them() -> None:
    assert engines.names()[:5] == ["embedded", "ray", "slurm", "agents", "kubernetes"]
    for name in ("embedded", "slurm", "agents"):  # Ray's kind imports Ray only when used
        assert engines.kind(name).name == name
    refused = CliRunner().invoke(app, ["run", "examples/toy-job.yaml", "--engine", "k8s"])
    assert refused.exit_code == 2
    said = " ".join(refused.stderr.split())
    assert "--engine k8s: choose embedded, ray, slurm, agents or kubernetes" in said, said


def test_the_port_is_narrow_and_every_engine_states_only_what_it_does_differently() -> None:
    """The controller's port: 16 members (its facts, where it listens, its rehearsal, agents and
    pods, lost nodes and isolation, addresses, shutdown); every engine is an EngineBase."""
    members = [m for m in vars(Engine) if not m.startswith("_")]
    assert len(members) == 16, members
    from relaunch.cluster.hosted import AgentsCluster
    from relaunch.cluster.local import LocalCluster
    from relaunch.cluster.slurm import SlurmCluster

    for engine in (LocalCluster, AgentsCluster, SlurmCluster):
        assert issubclass(engine, EngineBase), engine
    assert typing.get_type_hints(EngineBase.shutdown)["return"].__name__ == "LeftBehind"


def test_no_command_picks_an_engine_by_comparing_its_name() -> None:
    """`engine == "slurm"` and its kind are the registry's: the CLI, the runner and the server
    ask the engine's kind (relaunch.engines) instead."""
    found = []
    for path in [*(SRC / "cli").glob("*.py"), SRC / "runner.py", SRC / "service.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                words = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)]
                if set(words) & set(engines.BUILT_IN):
                    found.append(f"{path.name}:{node.lineno}")
    assert found == []


@pytest.mark.real
def test_an_engine_of_the_tests_own_runs_the_demo_through_its_three_faults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registered by name, it is `--engine test-processes` for `relaunch run` and `relaunch
    nodes`; the toy job comes through the demo's crash, chip fault and lost node on it."""
    engines.register(ProcessesKind())
    assert "test-processes" in engines.names()
    monkeypatch.chdir(ROOT)
    state, report = tmp_path / "state", tmp_path / "report.json"
    args = ["run", "examples/toy-job.yaml", "--engine", "test-processes",
            "--cluster", "examples/cluster-small.yaml", "--faults", "examples/toy-faults.yaml",
            "--state-dir", str(state), "--report", str(report)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "pods are process groups started by their node's agent" in result.stdout
    summary = json.loads(report.read_text())
    recovered = [(r["fault"]["kind"], r["outcome"]) for r in summary["recoveries"]]
    assert [kind for kind, _ in recovered] == ["process-exit", "chip", "node-lost"], recovered
    assert all(outcome == "succeeded" for _, outcome in recovered), recovered
    actions = [r["action"] for r in summary["recoveries"]]
    assert actions == ["job-reschedule", "in-place", "pod-reschedule"], actions  # as embedded
    lost = summary["recoveries"][2]["fault"]["node"]
    assert all(pod["node"] != lost for pod in summary["pods"]), summary["pods"]
    nodes = CliRunner().invoke(
        app, ["nodes", "--engine", "test-processes", "--state-dir", str(state)]
    )
    assert nodes.exit_code == 0 and lost in nodes.stdout, nodes.stdout
