"""Checkpoints of sharded state (FSDP2, DTensor, any torch.distributed.checkpoint state dict)
with the guarantees of relaunch.train.checkpoint: atomic, verified with fallback, rotated,
asynchronous, a dying gasp. Every rank calls save and load together (they are collectives).

Layout, one directory per step, written by torch.distributed.checkpoint (DCP)::

    DIR/step-000000120/__0_0.distcp ...   each rank's shards (DCP's files)
    DIR/step-000000120/.metadata          DCP's index of them
    DIR/step-000000120/manifest.json      {step, world_size, format: "dcp", files: {name: {size, xxh3_128}}}

A save writes into `DIR/.step-000000120.tmp-<run>` (DCP fsyncs each file); each rank hashes the
files it wrote, rank 0 gathers their sizes and hashes, fsyncs, renames the directory to its
name and only then writes the manifest (temporary name, fsync, rename). A step counts only with
its manifest; `load` takes the newest step whose every file matches it (the ranks check a share
each) and falls back, with a CheckpointWarning, past a torn or corrupted one. DCP reshards on
load, so a checkpoint saved by 4 ranks loads on 2 (after an elastic scale-in) or on 8.

Checkpoint collectives run on a gloo group of their own, so that an asynchronous save's
background work never shares a communicator with training (NCCL or gloo)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from relaunch.protocol.datagrams import RestoreTier
from relaunch.train.atomic import fsync_dir, write_atomic, write_bytes
from relaunch.train.checkpoint import Checkpoint, CheckpointManager, CheckpointWarning
from relaunch.train.fence import check_fence
from relaunch.train.local import LocalCopies
from relaunch.train.peer import PeerCopies
from relaunch.train.progress import SdkPhase, report_phase

__all__ = ["ShardedCheckpointManager"]

FORMAT = "dcp"
HASH = "xxh3_128"
MANIFEST = "manifest.json"
_CHUNK = 8 << 20


def _digest(path: Path) -> dict[str, Any]:
    hasher = xxhash.xxh3_128()
    size = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
            size += len(chunk)
    return {"size": size, HASH: hasher.hexdigest()}


def _own_file(name: str, rank: int) -> bool:
    """A DCP data file this rank wrote (its writer's default: one, `__RANK_0.distcp`)."""
    return name.startswith(f"__{rank}_") and name.endswith(".distcp")


def _checked(data: Any, expected: str) -> Any:
    """`data` itself, once its hash is `expected` (a copy from a peer's memory)."""
    if xxhash.xxh3_128(data).hexdigest() != expected:
        raise ValueError("the copy does not match its checksum")
    return data


class _MemoryFile(io.RawIOBase):
    """A file's bytes held in memory, read (and sliced by DCP) without being copied first."""

    def __init__(self, data: Any) -> None:
        self._view = memoryview(data).cast("B")
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._view)}[whence]
        self._at = max(0, base + offset)
        return self._at

    def readinto(self, buffer: Any) -> int:
        chunk = self._view[self._at : self._at + len(buffer)]
        memoryview(buffer).cast("B")[: len(chunk)] = chunk
        self._at += len(chunk)
        return len(chunk)


class _TieredFileSystem(FileSystem):
    def __init__(self, held: dict[str, Any]) -> None:
        super().__init__()
        self.held = held

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        data = self.held.get(Path(path).name) if mode == "rb" else None
        if data is None:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with io.BufferedReader(_MemoryFile(data), buffer_size=_CHUNK) as stream:
            yield stream


class TieredReader(FileSystemReader):
    """DCP's reader of a checkpoint directory that takes the files held in memory (`held`:
    {name: bytes}, copies from a peer's memory already checked) from there, the rest from
    storage."""

    def __init__(self, path: str | os.PathLike[str], held: dict[str, Any]) -> None:
        super().__init__(path)
        self.fs = _TieredFileSystem(held)


class ShardedCheckpointManager(CheckpointManager):
    """Saves and loads a job's sharded state with DCP. `state` is a DCP state dict (for FSDP2:
    `{"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
    "step": step}` or `get_state_dict`'s pair); every rank passes its own and calls together.

    `every`, `keep`, `async_save`, `peers`, `local`, :meth:`step` and :meth:`dying_gasp` are
    CheckpointManager's: with peer memory (or a local checkpoint directory), each rank's own DCP
    file is copied to the next node's memory (onto its node's disk), and a load reads it from
    there (checked against the manifest), the rest from storage. An asynchronous save returns
    once DCP has staged the state in host memory; the save is committed (hashed, renamed,
    manifest written) at the next save, `wait` or `load`, which every rank reaches together."""

    WAITS_AT_EXIT = False  # its wait is a collective: a rank exiting alone would hang in it

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every: int | None = None,
        keep: int = 3,
        async_save: bool = False,
        peers: PeerCopies | None = None,
        local: LocalCopies | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ShardedCheckpointManager saves with every rank: initialise torch.distributed "
                "(init_process_group) first"
            )
        self._pending: tuple[int, Path, Any] | None = None
        self.regroup()
        super().__init__(directory, rank=dist.get_rank(), every=every, keep=keep,
                         async_save=async_save, peers=peers, local=local)  # fmt: skip

    def regroup(self) -> None:
        """The checkpoint's own group, of the current process group: at the start, and again
        after relaunch re-formed the process group around a replaced rank (a sharded
        ProcessGroupKeeper calls it, in the order in which the replacement builds its manager:
        a collective). An asynchronous save of the old group is dropped unfinished: what it
        wrote carries the old run's name and never counts (`sweep`)."""
        self._pending = None
        self.group = dist.new_group(backend="gloo")
        shared = [uuid.uuid4().hex[:8] if dist.get_rank() == 0 else ""]
        dist.broadcast_object_list(shared, src=0, group=self.group)
        self._run = str(shared[0])
        self.rank = dist.get_rank()

    # -- saving -------------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, blocking: bool | None = None) -> None:
        """Save `state` as `step`, with every rank (a collective)."""
        report_phase(SdkPhase.CHECKPOINT)
        try:
            self.wait()
            check_fence()
            tmp = self.directory / f".step-{step:09d}.tmp-{self._run}"
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            dist.barrier(group=self.group)
            if blocking if blocking is not None else not self.async_save:
                dcp_save(state, checkpoint_id=str(tmp), process_group=self.group)
                self._commit(step, tmp)
                return
            response = dcp_async_save(state, checkpoint_id=str(tmp), process_group=self.group)
            # torch returns a future, or (with some stagers) a pair of them: wait for the upload
            future = getattr(response, "upload_completion", response)
            self._pending = (step, tmp, future)
        finally:
            report_phase(SdkPhase.TRAINING)

    def wait(self) -> None:
        """Commit an asynchronous save (every rank calls it together); re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, tmp, future = pending
        future.result()
        self._commit(step, tmp)

    def _commit(self, step: int, tmp: Path) -> None:
        mine = {
            p.name: _digest(p)
            for p in sorted(tmp.iterdir())
            if p.name.startswith(f"__{self.rank}_")
            or (self.rank == 0 and not p.name.startswith("__"))
        }
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, mine, group=self.group)
        if self.rank == 0:
            files: dict[str, Any] = {}
            for part in gathered:
                files.update(part)
            check_fence()  # a stale generation must not commit what the new one would load
            fsync_dir(tmp)
            final = self.directory / f"step-{step:09d}"
            if final.exists():  # the same step saved again (a dying gasp after a save)
                old = self.directory / f".step-{step:09d}.old-{self._run}"
                final.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(final)
            fsync_dir(self.directory)
            manifest = {
                "step": step,
                "world_size": dist.get_world_size(self.group),
                "format": FORMAT,
                "files": files,
            }
            write_atomic(final / MANIFEST, write_bytes(json.dumps(manifest).encode()))
            self._rotate()
        dist.barrier(group=self.group)
        own = [name for name in mine if _own_file(name, self.rank)]
        if len(own) == 1:  # this rank's own file, into the next node's memory, onto this disk
            path = self.directory / f"step-{step:09d}" / own[0]
            if self.peers is not None:
                self.peers.copy(self.rank, step, {"files": {own[0]: mine[own[0]]}}, path)
            if self.local is not None:
                self.local.copy(step, own[0], path)

    def sweep(self) -> int:
        """Remove what an earlier run's save left half-written (rank 0; the others: none)."""
        removed = 0
        if self.rank != 0:
            return removed
        for path in self.directory.glob(".step-*"):
            if path.name.endswith(f"-{self._run}"):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
        return removed

    def _rotate(self) -> None:
        for old in self.steps()[self.keep :]:
            shutil.rmtree(self.directory / f"step-{old:09d}", ignore_errors=True)

    def _gasp_and_exit(self) -> None:
        """The collective gasp, only where every rank stands at the same completed step (a rank
        stopped between steps while a peer is inside the next one would save a mixture): else
        skipped, saying so, and the last committed checkpoint stands. A peer blocked in a
        training collective never answers: the grace ends it, and nothing half-written counts."""
        self._gasping = True
        steps: list[Any] = [None] * dist.get_world_size(self.group)
        try:
            dist.all_gather_object(steps, self.completed_step, group=self.group)
        except RuntimeError as error:  # a peer is gone
            print(f"relaunch: dying gasp failed: {error}", flush=True)
            os._exit(143)
        if len(set(steps)) != 1:
            print(f"relaunch: dying gasp skipped: the ranks stand at steps {steps}", flush=True)
            os._exit(143)
        super()._gasp_and_exit()

    # -- loading ------------------------------------------------------------------------------

    def steps(self, rank: int | None = None) -> list[int]:
        """Steps with a manifest, newest first (not yet verified)."""
        found = []
        for path in self.directory.glob("step-*"):
            if (path / MANIFEST).exists():
                with contextlib.suppress(ValueError):
                    found.append(int(path.name.removeprefix("step-")))
        return sorted(found, reverse=True)

    def verified_steps(self, rank: int | None = None) -> list[int]:
        return [s for s in self._agreed_steps() if self._verified(s, warn=False, held={})]

    def load(
        self, step: int | None = None, *, rank: int | None = None, into: Any = None
    ) -> Checkpoint | None:
        """Load the newest step that verifies (or exactly `step`) into `into`, a state dict of
        the current model's shape (DCP loads in place and reshards); None where there is none.
        Every rank calls it together."""
        if into is None:
            raise TypeError(
                "a sharded checkpoint loads into the current state dict: load(into=state)"
            )
        self.wait()
        candidates = [step] if step is not None else self._agreed_steps()
        for candidate in candidates:
            held, served = self._own_from_copies(candidate)
            if self._verified(candidate, warn=True, held=held):
                directory = self.directory / f"step-{candidate:09d}"
                reader = TieredReader(directory, held)
                dcp_load(into, storage_reader=reader, process_group=self.group)
                self._restored(candidate, self.rank, *served)
                return Checkpoint(candidate, into, directory)
        return None

    def _own_from_copies(self, step: int) -> tuple[dict[str, Any], tuple[RestoreTier, str]]:
        """This rank's own file of `step`, from a peer's memory or the node's disk, checked
        against the manifest on storage: ({name: its bytes}, which tier and node served), or
        ({}, storage)."""
        storage = (RestoreTier.STORAGE, "")
        if self.peers is None and self.local is None:
            return {}, storage
        try:
            manifest = json.loads((self.directory / f"step-{step:09d}" / MANIFEST).read_text())
            (name,) = [n for n in manifest["files"] if _own_file(n, self.rank)]
            expected = {"files": {name: manifest["files"][name]}}
        except (OSError, ValueError, KeyError, TypeError):
            return {}, storage
        data, served = self._from_copies(step, self.rank, expected, _checked)
        return ({name: data}, served) if served is not None else ({}, storage)

    def _agreed_steps(self) -> list[int]:
        """Rank 0's list, so that every rank tries the same steps in the same order."""
        listed = [self.steps() if self.rank == 0 else None]
        dist.broadcast_object_list(listed, src=0, group=self.group)
        return list(listed[0] or [])

    def _verified(self, step: int, *, warn: bool, held: dict[str, Any]) -> bool:
        """Every file of `step` matches the manifest: each rank checks a share of those that no
        rank holds checked from a peer's memory (`held`: this rank's)."""
        directory = self.directory / f"step-{step:09d}"
        problem = ""
        checked: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(checked, sorted(held), group=self.group)
        try:
            manifest = json.loads((directory / MANIFEST).read_text())
            done = {name for names in checked for name in names}
            files = sorted(i for i in manifest["files"].items() if i[0] not in done)
            world = dist.get_world_size(self.group)
            if manifest.get("format") != FORMAT or ".metadata" not in manifest["files"]:
                problem = "not a DCP checkpoint manifest"
            for name, expected in files[self.rank :: world]:
                if problem:
                    break
                if _digest(directory / name) != expected:
                    problem = f"{name} does not match its manifest"
        except (OSError, ValueError, KeyError, TypeError) as error:
            problem = str(error)
        problems: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(problems, problem, group=self.group)
        found = [p for p in problems if p]
        if found and warn and self.rank == 0:
            warnings.warn(
                f"checkpoint step {step} in {directory} is unusable ({found[0]}); trying an "
                "older one",
                CheckpointWarning,
                stacklevel=3,
            )
        return not found
