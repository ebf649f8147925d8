"""A failed rank's account of its failure, read from what it left behind: the torchelastic error
file (`torch.distributed.elastic.multiprocessing.errors.record` writes it where
TORCHELASTIC_ERROR_FILE says), else the last lines of its output."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from relaunch.faults import ErrorReport

__all__ = [
    "ERROR_FILE_AT_MOST",
    "MESSAGE_AT_MOST",
    "TAIL_LINES",
    "TRACEBACK_AT_MOST",
    "capped",
    "error_from_file",
    "error_from_large_file",
    "error_from_output",
]

TAIL_LINES: Final = 40
"""How many of a rank's last output lines are kept to find its traceback in."""
MESSAGE_AT_MOST: Final = 4000
"""Characters of an exception's message kept (its start and its end): a rank can raise with a
message of any size (a tensor printed whole, a 20 MB dump), and every view of the record, the
wire to the controller and the store would carry it all."""
TRACEBACK_AT_MOST: Final = 8000
"""Characters of a traceback kept: its first line and its innermost frames (where it failed)."""
ERROR_FILE_AT_MOST: Final = 16 << 20
"""An error file larger than this is not parsed (its start is read for the exception's name
and message): a rank may write one of any size."""

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
    return capped(ErrorReport(kind, text, traceback.rstrip(), at, "error-file"))


def error_from_large_file(head: str, size: int, at: float) -> ErrorReport:
    """What the start of an error file too large to parse (`size` bytes) says: the exception's
    name and the start of its message, where they are found there."""
    found = re.search(r'"message"\s*:\s*(?:\{\s*"message"\s*:\s*)?"((?:[^"\\]|\\.)*)', head)
    raw = re.sub(r"\\(u[0-9a-fA-F]{0,3})?$", "", found.group(1) if found else "")
    text = _JSON_ESCAPE.sub(_unescaped, raw)  # the JSON string, as far as it was read
    kind, message = _split(text.splitlines()[0]) if text.strip() else ("", "")
    note = f"[relaunch: the error file was {size:,} bytes; only its start was read]"
    return capped(ErrorReport(kind, f"{message} {note}".strip(), "", at, "error-file"))


_JSON_ESCAPE: Final = re.compile(r"\\(u[0-9a-fA-F]{4}|.)")
_JSON_ESCAPES: Final = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _unescaped(match: re.Match[str]) -> str:
    """One escape of a JSON string: \\uXXXX, \\n and the like, or the character escaped."""
    escape = match.group(1)
    if len(escape) == 5:
        return chr(int(escape[1:], 16))
    return _JSON_ESCAPES.get(escape, escape)


def capped(report: ErrorReport) -> ErrorReport:
    """The report with its message and traceback cut to what is kept, saying how much was cut:
    the message keeps its start and end, the traceback its first line and innermost frames."""
    message = _cut(report.message, MESSAGE_AT_MOST, head=MESSAGE_AT_MOST // 2)
    traceback = _cut(report.traceback, TRACEBACK_AT_MOST, head=200)
    if message is report.message and traceback is report.traceback:
        return report
    return dataclasses.replace(report, message=message, traceback=traceback)


def _cut(text: str, at_most: int, head: int) -> str:
    if len(text) <= at_most:
        return text
    tail = at_most - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n[relaunch: {cut:,} characters cut]\n{text[-tail:]}"


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
            return capped(
                ErrorReport(kind, message, "\n".join(block[: end + 1]), clean[start][0], "output")
            )
    printed = [(at, line) for at, line in clean if line.strip()]
    if not printed:
        return None
    at, last = printed[-1]
    tail = "\n".join(line for _, line in printed[-10:])
    return capped(ErrorReport("", last.strip(), tail, at, "output"))


def _split(line: str) -> tuple[str, str]:
    """'ValueError: bad' -> ('ValueError', 'bad'); a line that names no exception (its name's
    last part starts with a capital, as Python's exception classes do) -> ('', line)."""
    match = _EXCEPTION.match(line.strip())
    if match is None or not match.group(1).rsplit(".", 1)[-1][:1].isupper():
        return "", line.strip()
    return match.group(1), (match.group(2) or "").strip()
