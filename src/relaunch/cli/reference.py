"""The CLI reference of the manual (docs/cli.md), made from the commands themselves: every
command's help, usage and options as `relaunch COMMAND --help` has them, written as Markdown.
The manual's build writes it (docs/conf.py), so the two cannot drift."""

from __future__ import annotations

from typing import Any

import typer

from relaunch.cli import app

__all__ = ["markdown"]


def markdown() -> str:
    """The reference page: an introduction, then a section a command, in `--help`'s order."""
    root = typer.main.get_command(app)
    context = root.make_context("relaunch", [], resilient_parsing=True)
    lines = [
        "# The command line",
        "",
        "Made from the commands themselves each time the manual is built (`make docs`), so it says what",
        "`relaunch COMMAND --help` says. The [job file page](job-file.md) explains torchrun's",
        "form; the [operations page](operations.md) the server and the commands that talk to it.",
        "",
        "```text",
        root.get_usage(context).strip(),
        "```",
        "",
        _text(root.help),
        "",
    ]
    for name, command in root.commands.items():  # type: ignore[attr-defined]
        if command.hidden:
            continue
        sub = command.make_context(name, [], parent=context, resilient_parsing=True)
        lines += [f"## relaunch {name}", "", "```text", command.get_usage(sub).strip(), "```", ""]
        lines += [_text(command.help), ""]
        lines += _parameters(command)
    return "\n".join(lines).rstrip() + "\n"


def _parameters(command: Any) -> list[str]:
    """The command's arguments and options, a table for those of no help panel and one for
    each panel (torchrun's form's options), in `--help`'s order."""
    panels: dict[str | None, list[str]] = {}
    for param in command.params:
        if getattr(param, "hidden", False):
            continue
        panel = getattr(param, "rich_help_panel", None)
        panels.setdefault(panel, []).append(_row(param))
    lines: list[str] = []
    for panel, rows in panels.items():
        if panel:
            lines += [f"{panel[0].upper()}{panel[1:]}:", ""]
        lines += ["| argument or option | meaning | default |", "|---|---|---|", *rows, ""]
    return lines


def _row(param: Any) -> str:
    if param.param_type_name == "argument":
        names = f"`{param.metavar or param.name.upper()}`"
    else:
        value = "" if param.is_flag else " VALUE"
        names = ", ".join(f"`{n}{value}`" for n in (*param.opts, *param.secondary_opts))
    default = "" if param.default in (None, False, (), []) else f"`{param.default}`"
    return f"| {_cell(names)} | {_cell(getattr(param, 'help', None) or '')} | {_cell(default)} |"


def _text(help_text: str | None) -> str:
    """A docstring's help as the page's paragraph: its lines joined, as `--help` wraps it."""
    return " ".join((help_text or "").split())


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")
