"""Files written so that a reader sees the whole file or none of it: streamed to a temporary
name beside the target, fsynced, renamed over it, and the directory fsynced. Standard library
only (every training process imports it)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["TMP_MARK", "fsync_dir", "write_atomic", "write_bytes"]

_T = TypeVar("_T")

TMP_MARK = ".tmp-"
"""Temporary files are `.NAME.tmp-PID` beside their target until they are renamed into place."""


def write_atomic(path: Path, emit: Callable[[Any], _T]) -> _T:
    """Write a temporary file with `emit(file)` (an unbuffered binary file), fsync, rename over
    `path`, fsync the directory; returns what `emit` returned. On any error the temporary file is
    removed: a failed save (a full disk) leaves nothing behind that would make the next save fail
    too."""
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb", buffering=0) as f:
            result = emit(f)
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)
    return result


def write_bytes(data: bytes) -> Callable[[Any], None]:
    def emit(f: Any) -> None:
        view = memoryview(data)
        while view:
            view = view[f.write(view) or 0 :]

    return emit


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
