"""The shape the controller's parts keep (issue 31): no import circle among the controller's
modules, counting the imports made only for type checking; no module over 500 lines and no
function over 60 in the package. Read from the source, as a reviewer would count."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import relaunch

SRC = Path(relaunch.__file__).parent
BENCH = SRC.parent / "relaunch_bench"
CONTROLLER = SRC / "controller"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def controller_imports(path: Path) -> set[str]:
    """The controller modules `path` imports, at run time or under TYPE_CHECKING alike."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        if node.level == 1:
            names = [module.split(".")[0]] if module else [a.name for a in node.names]
        elif module == "relaunch.controller":
            names = [a.name for a in node.names]
        elif module.startswith("relaunch.controller."):
            names = [module.split(".")[2]]
        else:
            names = []
        found |= {n for n in names if (CONTROLLER / f"{n}.py").exists() and n != path.stem}
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary circle of `graph`, each once (started from its smallest module)."""
    found: list[list[str]] = []

    def walk(start: str, at: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(at, ())):
            if nxt == start:
                found.append([*path, start])
            elif nxt > start and nxt not in path:
                walk(start, nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return found


def test_circles_finds_a_circle_through_a_type_only_import(tmp_path: Path) -> None:
    """The checker itself: a circle closed only by an import under TYPE_CHECKING counts."""
    graph = {"core": {"parts"}, "parts": {"core"}, "leaf": set()}
    assert circles(graph) == [["core", "parts", "core"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    part = tmp_path / "parts.py"
    part.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from relaunch.controller.core import Controller\n"
    )
    assert controller_imports(part) == {"core"}


def test_no_import_circle_inside_the_controller() -> None:
    graph = {p.stem: controller_imports(p) for p in CONTROLLER.glob("*.py") if p.stem != "__init__"}
    assert graph["core"], "the checker reads core's imports"
    assert circles(graph) == []
    # the parts are written against the context, not against the module that assembles them
    assert not [m for m, imported in graph.items() if "core" in imported]


def test_no_module_over_500_lines_and_no_function_over_60() -> None:
    """relaunch and its bench (but for the example scripts the bench ships, which are the
    examples')."""
    long_modules, long_functions = [], []
    bench = [p for p in BENCH.rglob("*.py") if "workloads" not in p.parts]
    for path in sorted([*SRC.rglob("*.py"), *bench]):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(str(path.relative_to(SRC.parent)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(SRC.parent)}:{node.name} ({lines})")
    assert long_modules == []
    assert long_functions == []


def test_every_attribute_docstring_follows_the_assignment_it_describes() -> None:
    """A string statement after another statement documents the assignment just before it: two
    in a row (or one after a call) is a docstring left under the wrong name (issue 69 found six)."""
    misplaced = []
    for path in sorted([*SRC.rglob("*.py"), *BENCH.rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            body = getattr(node, "body", None)
            if not isinstance(body, list):
                continue
            for before, stmt in itertools.pairwise(body):
                text = stmt.value if isinstance(stmt, ast.Expr) else None
                is_text = isinstance(text, ast.Constant) and isinstance(text.value, str)
                if is_text and not isinstance(before, ast.Assign | ast.AnnAssign):
                    misplaced.append(f"{path.relative_to(SRC.parent)}:{stmt.lineno}")
    assert misplaced == []
