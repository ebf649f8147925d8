"""A failed rank's account of its failure, read from what it left behind: the torchelastic error
file (`torch.distributed.elastic.multiprocessing.errors.record` writes it where
TORCHELASTIC_ERROR_FILE says), else the last lines of its output."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from relaunch.faults import ErrorReport

__all__ = ["TAIL_LINES", "error_from_file", "error_from_output"]

TAIL_LINES: Final = 40
"""How many of a rank's last output lines are kept to find its traceback in."""

_HEADER: Final = "Traceback (most recent call last):"
_RANK_PREFIX: Final = re.compile(r"^\[(?:default)?rank\d+\]:\s?")
"""torch prefixes a rank's uncaught exception lines with `[rankN]:`."""
_EXCEPTION: Final = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")


def error_from_file(data: Mapping[str, Any], at: float) -> ErrorReport | None:
    """The error file's content (parsed JSON), written at `at`. Two shapes exist: torch's Python
    `record` writes {"message": {"message": "Type: text", "extraInfo": {"py_callstack": ...}}};
    C++ and newer writers put a string in "message"."""
    message = data.get("message")
    traceback = ""
    if isinstance(message, Mapping):
        extra = message.get("extraInfo")
        if isinstance(extra, Mapping):
            traceback = str(extra.get("py_callstack") or "")
        message = message.get("message")
    if not isinstance(message, str) or not message.strip():
        return None
    kind, text = _split(message.strip().splitlines()[0])
    rest = message.strip().splitlines()[1:]
    if rest:
        text = "\n".join([text, *rest])
    return ErrorReport(kind, text, traceback.rstrip(), at, "error-file")


def error_from_output(lines: Sequence[tuple[float, str]]) -> ErrorReport | None:
    """The last traceback in a rank's last output lines (time read, line), timed when its first
    line was printed; without one, the last line it printed and the lines before it."""
    clean = [(at, _RANK_PREFIX.sub("", line.rstrip())) for at, line in lines]
    headers = [i for i, (_, line) in enumerate(clean) if line.strip() == _HEADER]
    if headers:
        start = headers[-1]
        block = [line for _, line in clean[start:]]
        end = next(
            (i for i, line in enumerate(block[1:], 1) if line and not line[0].isspace()), None
        )
        if end is not None:
            kind, text = _split(block[end])
            more = [line for line in block[end + 1 :] if line.strip()]
            message = "\n".join([text, *more[:5]]) if more and not kind else text
            return ErrorReport(
                kind, message, "\n".join(block[: end + 1]), clean[start][0], "output"
            )
    printed = [(at, line) for at, line in clean if line.strip()]
    if not printed:
        return None
    at, last = printed[-1]
    tail = "\n".join(line for _, line in printed[-10:])
    return ErrorReport("", last.strip(), tail, at, "output")


def _split(line: str) -> tuple[str, str]:
    """'ValueError: bad' -> ('ValueError', 'bad'); a line that names no exception (its name's
    last part starts with a capital, as Python's exception classes do) -> ('', line)."""
    match = _EXCEPTION.match(line.strip())
    if match is None or not match.group(1).rsplit(".", 1)[-1][:1].isupper():
        return "", line.strip()
    return match.group(1), (match.group(2) or "").strip()
