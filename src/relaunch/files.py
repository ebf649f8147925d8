"""Reading relaunch's input files from disk: job specs and fault tables, YAML or JSON.

The parsers are pure (:func:`relaunch.spec.parse_job`, :func:`relaunch.faults.parse_fault_table`);
this module is the I/O in front of them and turns every way a file can be unreadable into an
:class:`~relaunch.errors.InputError` instead of a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from relaunch.cluster.config import ClusterConfig, parse_cluster
from relaunch.errors import MISSING, InputError, Problem
from relaunch.faults import FaultTableFile, parse_fault_table
from relaunch.spec import JobSpec, parse_job

__all__ = ["load_cluster", "load_fault_table", "load_job", "read_document"]


def read_document(path: Path) -> Any:
    """The parsed content of a YAML or JSON file (JSON is read as YAML's subset)."""
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _unreadable(source, "no such file", "the path of an existing file") from None
    except IsADirectoryError:
        raise _unreadable(source, "a directory", "a file") from None
    except PermissionError:
        raise _unreadable(source, "permission denied", "a file you may read") from None
    except UnicodeDecodeError as error:
        raise _unreadable(source, f"not UTF-8 at byte {error.start}", "UTF-8 text") from None
    try:
        if path.suffix.lower() == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except json.JSONDecodeError as error:
        where = f"line {error.lineno}, column {error.colno}"
        raise InputError(source, [Problem(where, None, "valid JSON", found=error.msg)]) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
        what = getattr(error, "problem", None) or str(error)
        raise InputError(source, [Problem(where, None, "valid YAML", found=what)]) from None


def _unreadable(source: str, found: str, allowed: str) -> InputError:
    return InputError(source, [Problem("(file)", MISSING, allowed, found=found)])


def load_job(path: Path) -> JobSpec:
    return parse_job(read_document(path), source=str(path))


def load_fault_table(path: Path) -> FaultTableFile:
    return parse_fault_table(read_document(path), source=str(path))


def load_cluster(path: Path) -> ClusterConfig:
    return parse_cluster(read_document(path), source=str(path))
