"""`relaunch --help` reads at 80 columns: each command's description is wrapped only where the
column is full (a docstring's own line breaks are not kept), and nothing runs past the edge."""

from __future__ import annotations

import itertools
import re

import pytest
from typer.testing import CliRunner

from relaunch import engines
from relaunch.cli import app

WIDTH = 80


def help_text(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": str(WIDTH)}, color=False)
    assert result.exit_code == 0, result.output
    return result.output


def command_rows(text: str) -> dict[str, list[str]]:
    """The Commands panel: each command's description, as the lines it was wrapped into."""
    panel = text.split("Commands ", 1)[1].split("╰", 1)[0]
    rows: dict[str, list[str]] = {}
    name = ""
    for line in panel.splitlines()[1:]:
        inner = line.strip("│").rstrip()
        entry = re.match(r"^ (\S+)(\s+)(\S.*)$", inner)
        if entry:
            name = entry.group(1)
            rows[name] = [entry.group(3)]
        elif name and inner.strip():
            rows[name].append(inner.strip())
    return rows


def test_the_command_list_wraps_only_where_the_column_is_full() -> None:
    text = help_text()
    assert all(len(line) <= WIDTH for line in text.splitlines())
    rows = command_rows(text)
    assert {"run", "validate", "logs", "nodes", "agent", "describe"} <= set(rows)
    column = max(len(line) for lines in rows.values() for line in lines)
    for name, lines in rows.items():
        for line, following in itertools.pairwise(lines):
            next_word = following.split()[0]
            assert len(line) + 1 + len(next_word) > column, (
                f"{name}: the line {line!r} breaks before {next_word!r} with room left"
            )


COMMANDS = [
    "validate", "faults", "run", "submit", "stop", "jobs", "describe", "logs", "nodes", "agent",
    "cordon", "release", "server", "bench",
]  # fmt: skip


def test_every_command_is_checked() -> None:
    assert set(command_rows(help_text())) == set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_commands_help_fits_80_columns(command: str) -> None:
    """Nothing past the edge, nothing cut short (rich ends a word that does not fit its column
    with an ellipsis: an option's name or a word of its description lost)."""
    text = help_text(command)
    assert all(len(line) <= WIDTH for line in text.splitlines())
    assert "Usage: relaunch " + command in text
    cut = [line for line in text.splitlines() if "…" in line]
    assert not cut, "\n".join(cut)


def test_the_help_names_every_engine_a_command_runs_on() -> None:
    """`relaunch run` runs on each engine, and its help says so (once it said "the embedded
    cluster or Ray" while Slurm and hand-started agents ran too)."""
    said = " ".join(help_text("run").replace("│", " ").split())
    for engine in engines.BUILT_IN:
        assert f"{engine}:" in said, engine
    listed = " ".join(help_text().replace("│", " ").split())
    assert "on the embedded cluster, Ray, Slurm, Kubernetes or agents" in listed, listed


@pytest.mark.parametrize("engine", ["slurm", "agents"])
def test_a_server_refuses_an_engine_it_does_not_run_jobs_on(engine: str) -> None:
    result = CliRunner().invoke(app, ["server", "--engine", engine])
    assert result.exit_code == 2
    assert "a server runs its jobs on --engine embedded or ray;" in " ".join(result.stderr.split())
