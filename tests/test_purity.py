"""The pure core stays pure: spec, faults and policy do no I/O, read no clock and import no engine,
store or CLI (docs/architecture.md). Checked on the source and at run time."""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

import pytest

import relaunch
from relaunch.policy import plan
from tests.builders import MODELARTS_ALL, chip, cluster, history, settings

SRC = Path(relaunch.__file__).parent
PURE = [
    *sorted((SRC / "spec").glob("*.py")),
    *sorted((SRC / "faults").glob("*.py")),
    *sorted((SRC / "policy").glob("*.py")),
    *sorted((SRC / "diagnosis").glob("*.py")),
    SRC / "restores.py",
    SRC / "events.py",
]
IMPURE_MODULES = {
    "time",
    "datetime",
    "os",
    "io",
    "pathlib",
    "socket",
    "subprocess",
    "random",
    "threading",
    "asyncio",
    "sqlite3",
    "shutil",
    "tempfile",
    "yaml",
    "json",
    "psutil",
    "ray",
    "typer",
    "rich",
}
RELAUNCH_ALLOWED = {
    "relaunch.protocol.operator",  # R-29's settings, parsed alike by the spec and the SDK
    "relaunch.protocol.rollback",  # the step rollback the spec chooses and the SDK keeps
    "relaunch.protocol.links",  # the link faults a fault plan names
    "relaunch.protocol.integrity",  # what a fault plan's silent corruption strikes
    "relaunch.protocol.datagrams",  # the restore tiers a rank names and the record reads
    "relaunch.events",  # the record's kinds of event, read by the restores
    "relaunch.errors",
    "relaunch.validation",
    "relaunch.spec",
    "relaunch.faults",
    "relaunch.policy",
    "relaunch.diagnosis",
}
FORBIDDEN_CALLS = {"open", "print", "input", "exec", "eval", "__import__"}


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", PURE, ids=lambda p: str(p.relative_to(SRC)))
def test_pure_modules_import_no_io_clock_engine_store_or_cli(path: Path) -> None:
    for name in imports_of(path):
        top = name.split(".")[0]
        assert top not in IMPURE_MODULES, f"{path.name} imports {name}"
        if top == "relaunch":
            assert any(name == a or name.startswith(a + ".") for a in RELAUNCH_ALLOWED), (
                f"{path.name} imports {name}"
            )


@pytest.mark.parametrize("path", PURE, ids=lambda p: str(p.relative_to(SRC)))
def test_pure_modules_call_no_builtin_io(path: Path) -> None:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in FORBIDDEN_CALLS, f"{path.name} calls {node.func.id}()"


def test_importing_the_policy_loads_no_outer_layer() -> None:
    code = (
        "import sys, relaunch.policy, relaunch.faults, relaunch.spec;"
        "print(sorted(m for m in sys.modules if m.startswith('relaunch')));"
        "print(sorted(m for m in ('yaml', 'typer', 'rich', 'sqlite3', 'ray', 'psutil') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    loaded, outer = result.stdout.splitlines()
    assert "relaunch.cli" not in loaded and "relaunch.files" not in loaded
    assert outer == "[]"


def test_decide_reads_no_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    def clock() -> float:
        raise AssertionError("the policy read the clock")

    for name in ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns"):
        monkeypatch.setattr(time, name, clock)
    steps = plan(settings(MODELARTS_ALL), chip("80E18005"), history(), cluster(), 123.0)
    assert steps[-1].action.final


def test_the_inject_hook_names_the_variable_the_launcher_sets() -> None:
    """sitecustomize spells the names out (it must not import relaunch, but in a pod's rank
    template): they must stay Env's, and the template's value the launcher's."""
    import importlib.util

    from relaunch.protocol.environment import Env

    spec = importlib.util.spec_from_file_location("hook", SRC / "_inject" / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    assert hook.INJECT_DIR == Env.INJECT_DIR
    assert hook.RANK_TEMPLATE == Env.RANK_TEMPLATE

    from relaunch.launcher.template import RankTemplate

    assert '== "serve"' in (SRC / "_inject" / "sitecustomize.py").read_text()
    assert RankTemplate.SERVE == "serve"


def test_the_training_sdk_loads_no_wire_messages_and_no_controller() -> None:
    """Every training process imports relaunch.train, and a restart waits for it: it loads the
    datagrams and the environment's names, not the wire messages, plans or anything else."""
    code = "import sys, relaunch.train; print(sorted(m for m in sys.modules if m.startswith('relaunch')))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    loaded = set(ast.literal_eval(result.stdout))
    assert loaded <= {
        "relaunch", "relaunch.errors", "relaunch.protocol", "relaunch.protocol.datagrams",
        "relaunch.protocol.environment", "relaunch.protocol.layout", "relaunch.train",
        "relaunch.train.checkpoint", "relaunch.train.overlap", "relaunch.train.progress",
        "relaunch.train.reentrancy", "relaunch.train.rng", "relaunch.train.shard",
        "relaunch.train.atomic", "relaunch.train.peer", "relaunch.protocol.peer_memory",
        "relaunch.train.fence", "relaunch.train.local", "relaunch.train.background",
    }, loaded  # fmt: skip
