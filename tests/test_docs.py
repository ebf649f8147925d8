"""The manual's CLI reference (relaunch.cli.reference, written into docs/cli.md at each build)
holds every command and every option that `relaunch COMMAND --help` lists, with its help; and
every page of docs/ is in the manual's tables of contents. The build itself, with warnings as
errors, is `make docs`, which `make test` runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from relaunch.cli import app
from relaunch.cli.reference import markdown

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = markdown()


def _help(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200"}, color=False)
    assert result.exit_code == 0, result.output
    return result.output


def _commands() -> list[str]:
    panel = _help().split("Commands ", 1)[1]
    return re.findall(r"^│ (\w[\w-]*) ", panel, flags=re.M)


def test_the_reference_has_a_section_for_every_command_in_help_s_order() -> None:
    sections = re.findall(r"^## relaunch (\S+)$", REFERENCE, flags=re.M)
    assert sections == _commands() and len(sections) >= 14


@pytest.mark.parametrize("command", _commands())
def test_every_option_a_command_lists_is_in_its_section(command: str) -> None:
    section = REFERENCE.split(f"## relaunch {command}\n", 1)[1].split("\n## relaunch ", 1)[0]
    listed = set(re.findall(r"^│\s+(?:\*\s+)?(--[a-z][\w-]*)", _help(command), flags=re.M))
    listed -= {"--help"}
    assert listed, "no option rows read from --help"
    documented = set(re.findall(r"`(--[a-z][\w-]*)", section))
    assert listed <= documented, listed - documented


def test_a_command_s_help_text_is_its_section_s_paragraph() -> None:
    said = " ".join(_help("run").replace("│", " ").split())
    assert "or -m pkg.train" in said
    assert "or `-m pkg.train`" in REFERENCE


def test_the_committed_reference_is_the_one_the_commands_make() -> None:
    """docs/cli.md is committed, so that it reads on the repository's pages too; the build writes
    it anew, and this fails where a command changed and the page was not made again (`make
    docs`)."""
    assert (ROOT / "docs" / "cli.md").read_text() == REFERENCE


def test_every_page_of_the_manual_is_in_a_table_of_contents() -> None:
    docs = ROOT / "docs"
    listed: set[str] = set()
    for page in docs.rglob("*.md"):
        for block in re.findall(r"```\{toctree\}\n(.*?)```", page.read_text(), flags=re.S):
            listed |= set(re.findall(r"^([a-z][\w/-]*)$", block, flags=re.M))
    pages = {str(p.relative_to(docs).with_suffix("")) for p in docs.rglob("*.md")} - {"index"}
    assert pages == listed, pages ^ listed
