"""A rank's copies of its checkpoint on its node's own disk: the tier between a peer's memory and
storage. A rank that restarts on the node it saved on (process-level retry in place, in-place
recovery, a pod restarted where it was) reads its shard from there when no peer's memory served
it; a rank moved to another node finds nothing there and reads storage. Nothing read is trusted:
each copy is checked against the manifest on storage (size, then every byte against its hash)
before a byte of it is loaded, so that a torn copy, one altered on the disk, or one of an older
save of the same step is refused and the next tier serves.

Layout, under the job's `local_checkpoint_dir` (a path on each node's own disk)::

    DIR/NODE/job-ID/step-000000120/rank-3.ckpt        a copy of storage's file, byte for byte

NODE keeps nodes that share one machine (the embedded cluster) apart. A node keeps each rank's
newest `keep` steps, as storage does; its agent removes the job's directory once the job ended
for good (`forget_job`: not a job `relaunch run --resume` may carry on). Standard library only.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import re
import shutil
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from relaunch.protocol.environment import Env
from relaunch.train.atomic import TMP_MARK
from relaunch.train.background import NewestOnly

__all__ = ["LocalCopies", "forget_job", "job_root"]

KEPT_RECORDS = 64
"""How many failures to copy a rank remembers."""
_STEP_DIR = re.compile(r"step-(\d{9})")


def job_root(base: str | os.PathLike[str], node: str, job: int | str) -> Path:
    """Where `node` keeps job `job`'s copies under the job's `local_checkpoint_dir`."""
    return Path(base) / (node or "node") / f"job-{job}"


def forget_job(base: str | os.PathLike[str], node: str, job: int | str) -> bool:
    """Remove `node`'s copies of job `job` (it ended for good); True if there were any."""
    root = job_root(base, node, job)
    if not root.exists():
        return False
    shutil.rmtree(root, ignore_errors=True)
    with contextlib.suppress(OSError):
        root.parent.rmdir()  # the node's directory, once no job's copies are left in it
    return True


class LocalCopies:
    """One rank's copies on its node's disk (`from_env`: None where the job keeps none)."""

    def __init__(self, root: Path, node: str, keep: int) -> None:
        self.root = root
        self.node = node
        self.keep = keep
        self._writer = NewestOnly()
        self.failures: deque[str] = deque(maxlen=KEPT_RECORDS)
        """Why a copy was not made, for the newest that were not."""

    @classmethod
    def from_env(cls, keep: int, environ: Mapping[str, str] | None = None) -> LocalCopies | None:
        environ = os.environ if environ is None else environ
        base = environ.get(Env.LOCAL_CHECKPOINTS, "")
        job = environ.get(Env.JOB_ID, "")
        if not base or not job:
            return None
        node = environ.get(Env.NODE, "")
        return cls(job_root(base, node, job), node or "node", keep)

    def path(self, step: int, name: str) -> Path:
        return self.root / f"step-{step:09d}" / name

    # -- copying -----------------------------------------------------------------------------------

    def copy(self, step: int, name: str, source: Path) -> None:
        """Copy storage's file `source` (`name` of `step`) to the node's disk in the background;
        a copy still waiting when the next comes is replaced by it."""
        self._writer.submit(functools.partial(self._copy, step, name, source))

    def wait(self, timeout: float | None = None) -> bool:
        """Until the copies asked for so far are made (or failed), at most `timeout` seconds."""
        return self._writer.wait(timeout)

    def _copy(self, step: int, name: str, source: Path) -> None:
        target = self.path(step, name)
        tmp = target.with_name(f".{name}{TMP_MARK}{os.getpid()}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, tmp)  # in the kernel (sendfile), not through Python
            os.replace(tmp, target)  # unsynced: a copy torn by a crash fails its check
        except OSError as error:  # the copy is an extra: the save stands on storage
            self.failures.append(f"step {step}: {error}")
            with contextlib.suppress(OSError):
                tmp.unlink()
        self._rotate(name)

    def _rotate(self, name: str) -> None:
        """Keep this file's newest `keep` steps; drop the older ones, with what a copy killed
        half-way left of them (and emptied directories)."""
        held: list[tuple[int, Path, list[Path]]] = []  # (step, its directory, this file's there)
        with contextlib.suppress(OSError):
            for directory in self.root.iterdir():
                match = _STEP_DIR.fullmatch(directory.name)
                if match is None:
                    continue
                torn = directory.glob(f".{name}{TMP_MARK}*")
                files = [p for p in (directory / name, *torn) if p.exists()]
                if files:
                    held.append((int(match.group(1)), directory, files))
        for _, directory, files in sorted(held, reverse=True)[self.keep :]:
            for path in files:
                with contextlib.suppress(OSError):
                    path.unlink()
            with contextlib.suppress(OSError):
                directory.rmdir()  # only once every rank's copy is gone

    # -- reading back ------------------------------------------------------------------------------

    def holds(self, step: int, name: str, expected: Mapping[str, Any]) -> bool:
        """A copy of `name` of `step` is here, of `expected`'s size (its bytes unchecked)."""
        try:
            return self.path(step, name).stat().st_size == expected.get("size")
        except OSError:
            return False

    def restore(
        self,
        step: int,
        name: str,
        expected: Mapping[str, Any],
        read: Callable[[mmap.mmap, str], Any],
    ) -> tuple[Any, bool, str | None]:
        """`name` of `step` from the node's disk, read with `read(bytes, hash)` (which checks
        every byte against `expected`'s hash before it loads any) once its size is `expected`'s:
        (state, served, refusal). Not served and no refusal: the node holds no copy."""
        path = self.path(step, name)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != expected["size"]:
                    raise ValueError(f"{size} bytes where the manifest says {expected['size']}")
                data = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else b""
            return read(data, expected["xxh3_128"]), True, None  # type: ignore[arg-type]
        except FileNotFoundError:
            return None, False, None
        except (OSError, ValueError) as error:
            return None, False, f"the copy on {self.node}'s local disk was refused: {error}"
