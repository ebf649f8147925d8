"""The manual's site: Sphinx over the Markdown pages of docs/ (MyST), with the Furo theme; built
by `make docs` with every warning an error. The CLI reference (cli.md) is written from the
commands themselves at each build (relaunch.cli.reference), so it cannot drift from `--help`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

project = "relaunch"
author = "the relaunch developers"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "relaunch"
myst_heading_anchors = 4  # `page.md#a-section` links, as GitHub renders them
myst_enable_extensions = ["colon_fence"]

_HERE = Path(__file__).resolve().parent


def _write_cli_reference(_app: Any) -> None:
    from relaunch.cli.reference import markdown

    page = _HERE / "cli.md"
    text = markdown()
    if not page.exists() or page.read_text() != text:
        page.write_text(text)


def _from_the_root(_app: Any, _path: Path, _docname: str, content: list[str]) -> None:
    """BENCHMARKS.md, included by benchmarks.md, links to files from the repository's root:
    from docs/ those are one folder up."""
    content[0] = content[0].replace("](benchmarks/", "](../benchmarks/")


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", _write_cli_reference)
    app.connect("include-read", _from_the_root)
    return {"parallel_read_safe": True}
