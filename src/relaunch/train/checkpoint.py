"""Checkpoints a restart can trust: atomic, verified, kept in rotation, optionally asynchronous,
and saved once more on the way out (dying gasp).

Layout, one directory per step, one shard per rank::

    DIR/step-000000120/rank-3.ckpt            the state: a safetensors file (relaunch.train.shard)
    DIR/step-000000120/rank-3.manifest.json   {step, rank, format, files: {name: {size, xxh3_128}}}

A shard counts only once its manifest exists and its checksum matches: the state file is streamed
to a temporary name (tensors as raw bytes, hashed as they are written), fsynced, renamed, the
directory fsynced, and only then the manifest is written the same way. `load` takes the newest
step that verifies and falls back, with a warning, past a truncated or corrupted one. Shards
written as `relaunch-shard-1` still load; 0.1.0's (`torch.save`, SHA-256) are refused, never
unpickled. Each shard may also be copied into another node's memory (relaunch.train.peer) and
onto the node's own disk (relaunch.train.local); a load reads it from there first, in that
order, checked against the manifest on storage. Importable without torch.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pickle
import re
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, ClassVar, TypeVar

from relaunch.protocol.datagrams import RestoreTier
from relaunch.protocol.environment import Env
from relaunch.protocol.layout import FENCE_FILE
from relaunch.train import overlap, rng, shard
from relaunch.train.atomic import TMP_MARK, write_atomic, write_bytes
from relaunch.train.fence import StaleProcess, check_fence
from relaunch.train.local import LocalCopies
from relaunch.train.peer import GASP_COPY_WAIT_S, PeerCopies
from relaunch.train.progress import SdkPhase, flush_progress, report_phase, report_restore

__all__ = [
    "FENCE_FILE",
    "Checkpoint",
    "CheckpointManager",
    "CheckpointWarning",
    "StaleProcess",
    "StateChangedDuringSave",
]

_T = TypeVar("_T")
StateChangedDuringSave = overlap.StateChangedDuringSave
_STEP_DIR = re.compile(r"step-(\d{9})")
_UNUSABLE = (OSError, ValueError, KeyError, EOFError, pickle.UnpicklingError, RuntimeError)
"""What reading a shard that cannot be used raises (torn, altered, another format)."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped because it did not verify."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    state: Any
    path: Path


def _wait_at_exit(manager: weakref.ref[CheckpointManager]) -> None:
    live = manager()
    if live is None:
        return
    try:
        live.wait()
    except Exception as error:  # the interpreter is exiting: say it, as a dying gasp does
        print(f"relaunch: the last asynchronous save failed: {error}", file=sys.stderr, flush=True)


class CheckpointManager:
    """Saves and loads one rank's shard of a job's checkpoints.

    `every`: save every that many steps through :meth:`maybe_save` (None: only on demand or as a
    dying gasp). `keep`: how many verified steps to keep. `async_save`: write in a background thread;
    the training loop only waits for the copy of the state to host memory. `overlap_copy` (with
    `async_save`): the copy of what an optimizer owns is taken while the loop runs the next
    forward and backward, and the optimizer's next step waits for it (relaunch.train.overlap).
    `peers`: where each saved shard is also copied, in another node's memory, and read back from
    at a restore (relaunch.train.peer); by default the peers relaunch gives the rank where the
    job's spec asks for it (`peer_memory_mb`), else none; a manager made early in a rank's start
    has the memory for a restore's copy faulted in by the time it loads. `local`: where each
    shard is also copied on the node's own disk (relaunch.train.local; by default the job's
    `local_checkpoint_dir`), read back by a rank that restarts on the same node."""

    WAITS_AT_EXIT: ClassVar[bool] = True
    """Whether the interpreter's exit waits for an asynchronous save (not for a collective one)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        rank: int | None = None,
        every: int | None = None,
        keep: int = 3,
        async_save: bool = False,
        overlap_copy: bool = False,
        peers: PeerCopies | None = None,
        local: LocalCopies | None = None,
    ) -> None:
        if overlap_copy and not async_save:
            raise ValueError(
                "overlap_copy needs async_save=True (a synchronous save copies nothing)"
            )
        if keep < 1:
            raise ValueError("keep must be at least 1")
        if every is not None and every < 1:
            raise ValueError("every must be at least 1 (or None)")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        said = os.environ.get(Env.RANK, os.environ.get(Env.MS_RANK_ID, "0"))  # torch's, msrun's
        self.rank = int(said) if rank is None else rank
        self.every = every
        self.keep = keep
        self.async_save = async_save
        self.overlap_copy = overlap_copy
        if overlap_copy:
            overlap.install()
        self._uncopied: overlap.PendingCopy | None = None
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._completed: tuple[int | None, dict[str, Any] | None] = (None, None)
        """(the last completed step, the random streams as they were at its end): one
        attribute, assigned at once, so that a SIGTERM's gasp never sees one without the other."""
        self._in_step = False
        self._gasp_held = False
        self._gasping = False
        self._term_pending = False
        self._gasp: Callable[[], Any] | None = None
        self._host = shard.HostBuffer()  # reused by every asynchronous save
        self.peers = peers if peers is not None else PeerCopies.from_env()
        if self.peers is not None:  # a restore's memory made ready while the rank starts
            self.peers.prepare(self.rank)
        self.local = local if local is not None else LocalCopies.from_env(keep)
        self.restored_from: dict[tuple[int, int], str] = {}
        """(rank, step) -> its tier: "peer memory of NODE", "local disk of NODE" or "storage"."""
        self.sweep()
        if async_save and self.WAITS_AT_EXIT:  # a script that ends right after a save writes it
            atexit.register(_wait_at_exit, weakref.ref(self))

    @property
    def completed_step(self) -> int | None:
        """The last step that ended without an error: what a dying gasp saves."""
        return self._completed[0]

    @completed_step.setter
    def completed_step(self, step: int | None) -> None:
        # The random streams as they are at the end of this step: a gasp that comes in the
        # middle of the next step (which may have drawn already) saves them, not the current.
        # Captured first and stored with the step in one assignment: a gasp between the two
        # saved step N with the streams of step N - 1 (a resumed run drew other numbers).
        self._completed = (step, rng.capture() if step is not None else None)

    def save(self, step: int, state: Any, *, blocking: bool | None = None) -> None:
        """Save `state` as this rank's shard of `step`. relaunch hears that the rank is saving
        (no process-level recovery runs meanwhile, R-37) until the save returns: after the
        write, or for an asynchronous save once the state is copied to host memory."""
        with self.hold_gasp():
            self._save(step, state, blocking)

    def _save(self, step: int, state: Any, blocking: bool | None) -> None:
        report_phase(SdkPhase.CHECKPOINT)
        try:
            self.wait()
            if blocking if blocking is not None else not self.async_save:
                self._write(step, shard.pack(state))  # written from where the tensors are
                return
            later = overlap.owned_by_optimizers() if self.overlap_copy else None
            packed = shard.pack(state, self._host, later)  # copied: later steps cannot change it
            if packed.uncopied:  # ... but what the optimizer's next step waits for
                self._uncopied = overlap.PendingCopy(packed.uncopied)
            self._writer = threading.Thread(
                target=self._write_in_background,
                args=(step, packed, self._uncopied),
                daemon=True,
            )
            self._writer.start()
        finally:
            report_phase(SdkPhase.TRAINING)

    def maybe_save(self, step: int, state: Any | Callable[[], Any]) -> bool:
        """Save if `step` is a multiple of `every`; `state` may be a function, called only then
        (its call is part of the save)."""
        if self.peers is not None:  # a rank that trains is past its restore: its memory goes
            self.peers.release_ready()
        if self.every is None or step % self.every:
            return False
        with self.hold_gasp():
            if callable(state):
                report_phase(SdkPhase.CHECKPOINT)
                state = state()
            self.save(step, state)
        return True

    def wait(self) -> None:
        """Wait for an asynchronous save; re-raise its error, if it had one."""
        pending, self._uncopied = self._uncopied, None
        if pending is not None:
            pending.settle()  # on the training thread: the copy is checked here at the latest
        writer = self._writer
        if writer is not None:
            writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write_in_background(
        self, step: int, packed: shard.Packed, pending: overlap.PendingCopy | None
    ) -> None:
        try:
            if pending is not None:
                pending.take()
                error = pending.verdict()
                if error is not None:
                    raise error
            self._write(step, packed)
        except BaseException as error:  # handed to the training loop by wait()
            self._error = error

    def _write(self, step: int, packed: shard.Packed) -> None:
        with self._lock:
            check_fence()  # a stale process must not overwrite the new generation's shard
            directory = self.directory / f"step-{step:09d}"
            directory.mkdir(parents=True, exist_ok=True)
            name = f"rank-{self.rank}.ckpt"
            size, digest = write_atomic(directory / name, lambda f: shard.write(f, packed))
            manifest = {
                "step": step,
                "rank": self.rank,
                "format": shard.FORMAT,
                "files": {name: {"size": size, shard.HASH: digest}},
            }
            check_fence()  # ... nor commit one the new generation would load
            write_atomic(
                directory / f"rank-{self.rank}.manifest.json",
                write_bytes(json.dumps(manifest).encode()),
            )
            self._rotate()
            if self.peers is not None:  # in the background: the save stands without them
                self.peers.copy(self.rank, step, manifest, directory / name)
            if self.local is not None:
                self.local.copy(step, name, directory / name)

    def sweep(self) -> int:
        """Remove this rank's temporary files that no save of this process is writing: what a
        process killed (or a disk filled) mid-save left behind. Returns how many."""
        removed = 0
        own = f"{TMP_MARK}{os.getpid()}"
        for path in self.directory.glob(f"step-*/.rank-{self.rank}.*{TMP_MARK}*"):
            if path.name.endswith(own) and self._writer is not None and self._writer.is_alive():
                continue
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
        return removed

    def _rotate(self) -> None:
        """Keep the newest `keep` steps this rank has verified shards for; drop its older shards."""
        steps = self.steps()
        for old in steps[self.keep :]:
            directory = self.directory / f"step-{old:09d}"
            for path in directory.glob(f"rank-{self.rank}.*"):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            with contextlib.suppress(OSError):
                directory.rmdir()  # only once every rank's shard is gone

    # -- loading ------------------------------------------------------------------------------------

    def steps(self, rank: int | None = None) -> list[int]:
        """Steps with a manifest for this rank (or `rank`), newest first (not yet verified)."""
        rank = self.rank if rank is None else rank
        found = []
        for path in self.directory.glob("step-*"):
            match = _STEP_DIR.fullmatch(path.name)
            if match and (path / f"rank-{rank}.manifest.json").exists():
                found.append(int(match.group(1)))
        return sorted(found, reverse=True)

    def verified_steps(self, rank: int | None = None) -> list[int]:
        """Steps this rank (or `rank`) can restore: those whose copy a peer holds with the
        storage manifest's hash, or this node's disk with its size (each checked in full when it
        is loaded), and those whose shard on storage verifies."""
        rank = self.rank if rank is None else rank
        held = self.peers.index() if self.peers is not None else {}
        return [
            s
            for s in self.steps(rank)
            if self.held_by_peer(held, rank, s)
            or self.held_locally(rank, s)
            or self._read(s, warn=False, rank=rank)
        ]

    def held_locally(self, rank: int, step: int) -> bool:
        """This node's disk holds `rank`'s copy of `step` at the size storage's manifest says."""
        local, entry = self.local, self._entry(step, rank)
        return local is not None and entry is not None and local.holds(step, *entry)

    def held_by_peer(self, held: dict[Any, list[tuple[str, str]]], rank: int, step: int) -> bool:
        """A peer holds `rank`'s copy of `step` with storage's hash (`held`: PeerCopies.index)."""
        entry = self._entry(step, rank) if (rank, step) in held else None
        return entry is not None and any(
            digest == entry[1].get(shard.HASH) for _, digest in held[(rank, step)]
        )

    def _entry(self, step: int, rank: int) -> tuple[str, dict[str, Any]] | None:
        """(file name, {size, hash}) of `rank`'s shard of `step` in storage's manifest."""
        try:
            ((name, expected),) = json.loads(self._manifest_path(step, rank).read_text())[
                "files"
            ].items()
        except (OSError, ValueError, KeyError):
            return None
        return name, expected

    def _manifest_path(self, step: int, rank: int) -> Path:
        return self.directory / f"step-{step:09d}" / f"rank-{rank}.manifest.json"

    def load(self, step: int | None = None, *, rank: int | None = None) -> Checkpoint | None:
        """The newest checkpoint that verifies (or exactly `step`); None if there is none.

        A newer one that fails verification is skipped with a :class:`CheckpointWarning`. `rank`
        reads another rank's shard: for replicated state (data parallelism), any replica's will do.
        """
        self.wait()
        candidates = [step] if step is not None else self.steps(rank)
        for candidate in candidates:
            loaded = self._read(candidate, warn=True, rank=rank)
            if loaded is not None:
                return loaded
        return None

    def _read(self, step: int, *, warn: bool, rank: int | None = None) -> Checkpoint | None:
        rank = self.rank if rank is None else rank
        directory = self.directory / f"step-{step:09d}"
        try:
            manifest = json.loads(self._manifest_path(step, rank).read_text())
            (name, expected), *_ = manifest["files"].items()
            ours = warn and manifest.get("format") in shard.FORMATS  # else never sent to memory
            state, served = self._from_copies(step, rank, manifest) if ours else (None, None)
            if served is None:
                state = shard.read_entry(directory / name, manifest["format"], expected)
                served = (RestoreTier.STORAGE, "")
            if warn:
                self._restored(step, rank, *served)
        except _UNUSABLE as error:
            if warn:
                warnings.warn(
                    f"checkpoint step {step} of rank {rank} in {directory} is unusable ({error}); "
                    "trying an older one",
                    CheckpointWarning,
                    stacklevel=3,
                )
            return None
        return Checkpoint(step, state, directory)

    def _from_copies(
        self, step: int, rank: int, manifest: dict[str, Any], read: Any = shard.read_buffer
    ) -> tuple[Any, tuple[RestoreTier, str] | None]:
        """What `read(bytes, hash)` makes of `rank`'s copy of `step` in a peer's memory, else on
        this node's disk, checked against `manifest`, and the tier and node that served it;
        (None, None) where none did (each refused copy warned about)."""
        state, served, refusals = None, None, list[str]()
        if self.peers is not None:
            state, node, refusals = self.peers.restore(rank, step, manifest, read)
            served = (RestoreTier.PEER_MEMORY, node) if node is not None else None
        if served is None and self.local is not None:
            ((name, expected),) = manifest["files"].items()
            state, found, refusal = self.local.restore(step, name, expected, read)
            served = (RestoreTier.LOCAL_DISK, self.local.node) if found else None
            refusals += [refusal] if refusal else []
        for refusal in refusals:
            warnings.warn(
                f"checkpoint step {step} of rank {rank}: {refusal}; trying the next tier",
                CheckpointWarning,
                stacklevel=4,
            )
        return state, served

    def _restored(self, step: int, rank: int, tier: RestoreTier, holder: str) -> None:
        """Which tier served, where copies are kept: said to relaunch (the job's record) and on
        the rank's output."""
        if self.peers is None and self.local is None:
            return
        source = tier.source(holder)
        self.restored_from[(rank, step)] = source
        whose = "" if rank == self.rank else f" (rank {rank}'s shard)"
        print(f"relaunch: rank {self.rank} restored step {step}{whose} from {source}", flush=True)
        report_restore(step, tier, holder, self.rank)

    # -- dying gasp ---------------------------------------------------------------------------------

    def dying_gasp(self, state: Callable[[], Any]) -> None:
        """On SIGTERM (relaunch's `fault-scheduling: grace`), save `state()` as the last completed
        step before exiting, so that a restart loses no step. Inside :meth:`step` the save waits
        for the step to end; a step that fails leaves the last completed step's state, saved."""
        self._gasp = state
        signal.signal(signal.SIGTERM, self._on_term)

    def forget_gasp(self) -> None:
        """No dying gasp from now on: the state it would save cannot be trusted (R-45)."""
        self._gasp = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Marks one training step; `completed_step` advances when it ends without an error. With
        a gasp armed, under relaunch, a step that raises waits for relaunch's SIGTERM (the job is
        being recovered) instead of crashing, so that the gasp can save."""
        self._in_step = True
        try:
            yield
        except Exception:
            self._in_step = False
            self.wait_for_stop()
            raise
        # Still inside the step while the step and its random streams are noted: a SIGTERM in
        # between would save the new parameters as the old step (or the new step with the old
        # streams), and the resumed run would train one step twice or draw other numbers.
        self.completed_step = step
        self._in_step = False
        if self._term_pending:
            self._gasp_and_exit()

    @contextlib.contextmanager
    def hold_gasp(self) -> Iterator[None]:
        """A SIGTERM inside waits for the block to end, then the gasp saves: for what changes
        the state outside :meth:`step` (a save; `ProcessGroupKeeper.run`'s optimizer step and
        its `completed_step`). A gasp in the middle of a save waited for the save's lock, which
        the interrupted save held (the grace then killed the rank and its gasp was lost); one in
        the middle of an optimizer step saved half-updated parameters."""
        outer = self._gasp_held
        self._gasp_held = True
        try:
            yield
        finally:
            self._gasp_held = outer
            if not outer and self._term_pending and not self._in_step and not self._gasping:
                self._gasp_and_exit()

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        if self._gasping:
            return  # saving it already
        if self._in_step or self._gasp_held:
            self._term_pending = True
            return
        self._gasp_and_exit()

    def wait_for_stop(self) -> None:
        """With a gasp armed, under relaunch: wait for its SIGTERM, save and exit (else return)."""
        if self._gasp is not None and Env.JOB_ID in os.environ:
            self._await_termination()

    def _await_termination(self) -> None:
        if self._term_pending:
            self._gasp_and_exit()
        deadline = time.monotonic() + float(os.environ.get(Env.GASP_WAIT_S, "600"))
        while time.monotonic() < deadline:  # the SIGTERM handler saves and exits from here
            time.sleep(0.05)

    def _gasp_and_exit(self) -> None:
        self._gasping = True
        began = time.monotonic()
        step, streams = self._completed
        if self._gasp is not None and step is not None:
            try:
                if streams is not None:
                    rng.restore(streams)  # as of the end of the completed step
                self.save(step, self._gasp(), blocking=True)
                for copies in (self.peers, self.local):  # its copies too, or storage serves
                    if copies is not None:
                        copies.wait(GASP_COPY_WAIT_S)
                took = f"{time.monotonic() - began:.3f} s"
                said = f"relaunch: dying gasp saved step {step} (rank {self.rank}) in {took}"
                print(said, flush=True)
            except Exception as error:  # the process exits either way
                print(f"relaunch: dying gasp failed: {error}", file=sys.stderr, flush=True)
        flush_progress()  # os._exit skips atexit, which would send the last step
        os._exit(143)
