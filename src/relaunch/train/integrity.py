"""Silent data corruption found within steps (R-45): replicas of data parallelism must stay bit
for bit the same, so every few steps each rank fingerprints its parameters and the replica group
compares them (eight bytes a rank). A chip that computes wrong without failing makes its rank's
fingerprint differ; with three or more replicas the majority names it.

    check = ReplicaCheck(model, optimizer, checkpoint=ckpt)   # every spec.integrity_check_every
    for step in ...:
        with ckpt.step(step):
            ...                                               # forward, backward, optimizer.step
        check.after_step(step)                                # before the step's checkpoint
        ckpt.maybe_save(step, state)

When the fingerprints differ, the rank says so to relaunch (which isolates the culprit's node and
rolls the job back), moves every checkpoint taken after the last agreement out of the way
(`suspect-step-…`: a restore never takes it), drops its dying gasp (the state it would save is
the corrupted one) and waits to be stopped; outside relaunch it raises :class:`SilentCorruption`.
Under relaunch a fault plan's `silent-corruption` is carried out here too, inside the rank, as a
bad chip would: one bit of the first parameter (or of its optimizer state) flipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relaunch.protocol.environment import Env
from relaunch.protocol.integrity import CORRUPTION_SUFFIX, Corruption, CorruptionTarget
from relaunch.train.checkpoint import CheckpointManager
from relaunch.train.progress import report_corruption

__all__ = ["DEFAULT_EVERY", "ReplicaCheck", "SilentCorruption", "culprits", "fingerprint"]

DEFAULT_EVERY = 10
"""Steps between checks where neither the script nor the job says."""


class SilentCorruption(RuntimeError):
    """The replicas' parameters are no longer bit-identical (outside relaunch, or not stopped)."""


def fingerprint(model: torch.nn.Module) -> str:
    """Sixteen hex digits standing for every parameter's bytes, in order."""
    digest = hashlib.blake2b(digest_size=8)
    for tensor in model.parameters():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def culprits(prints: Sequence[str]) -> tuple[int, ...] | None:
    """None where every rank's fingerprint is the same; else the ranks whose fingerprint differs
    from the one a strict majority holds, () where no majority names any (two replicas)."""
    counts = Counter(prints)
    if len(counts) == 1:
        return None
    common, held = counts.most_common(1)[0]
    if held * 2 <= len(prints):
        return ()
    return tuple(rank for rank, seen in enumerate(prints) if seen != common)


class ReplicaCheck:
    """Compares the replicas' fingerprints every `every` steps (None: the job's
    `integrity_check_every`, else DEFAULT_EVERY; 0: never) across `group` (the default group:
    every rank a replica, as in DDP)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        every: int | None = None,
        checkpoint: CheckpointManager | None = None,
        group: Any = None,
    ) -> None:
        self.model, self.optimizer, self.checkpoint, self.group = (
            model,
            optimizer,
            checkpoint,
            group,
        )
        said = os.environ.get(Env.INTEGRITY_EVERY)
        self.every = every if every is not None else int(said) if said else DEFAULT_EVERY
        self.clean_step: int | None = None
        """The last step at which every replica agreed."""
        self._corrupt: Corruption | None = None
        self._request = (
            Path(os.environ[Env.INJECT_DIR]) / f"{os.getpid()}{CORRUPTION_SUFFIX}"
            if os.environ.get(Env.INJECT_DIR)
            else None
        )

    def after_step(self, step: int) -> None:
        """Call once a step's optimizer step is done, before its checkpoint is saved."""
        self._rehearse()
        if self.every and step % self.every == 0:
            self.check(step)

    def check(self, step: int) -> None:
        """Every rank's fingerprint, compared (a collective: every replica calls it)."""
        prints = self._gathered(fingerprint(self.model))
        found = culprits(prints)
        if found is None:
            self.clean_step = step
            return
        seen = tuple(f"{p}:{n}" for p, n in Counter(prints).most_common())
        report_corruption(step, self.clean_step, found, seen)
        moved = self._set_aside_suspects()
        rank = dist.get_rank(self.group)
        named = ", ".join(map(str, found)) or "no majority names a rank"
        print(
            f"relaunch: rank {rank}: the replicas' parameters differ at step {step} (culprits: "
            f"{named}; last agreed at step {self.clean_step}); checkpoints set aside: "
            f"{moved or 'none'}",
            flush=True,
        )
        if self.checkpoint is not None:
            self.checkpoint.forget_gasp()  # it would save the corrupted state
        if Env.JOB_ID in os.environ:  # relaunch stops the job and rolls it back
            deadline = time.monotonic() + float(os.environ.get(Env.GASP_WAIT_S, "600"))
            while time.monotonic() < deadline:
                time.sleep(0.05)
        raise SilentCorruption(f"the replicas' parameters differ at step {step} ({named})")

    def _gathered(self, mine: str) -> list[str]:
        """Every rank's fingerprint, in rank order: one eight-byte tensor a rank, all-gathered
        (all_gather_object pickles, sizes and gathers twice: a check cost 10 % of a step on
        three gloo ranks, where one tensor's gather costs what any small collective does)."""
        device = _device_of(self.group)
        value = int.from_bytes(bytes.fromhex(mine), "big", signed=True)
        each = [
            torch.zeros(1, dtype=torch.int64, device=device)
            for _ in range(dist.get_world_size(self.group))
        ]
        dist.all_gather(each, torch.tensor([value], dtype=torch.int64, device=device), self.group)
        return [int(t.item()).to_bytes(8, "big", signed=True).hex() for t in each]

    def _set_aside_suspects(self) -> list[int]:
        """Every checkpoint taken after the last agreement, renamed out of the restores' way
        (whichever rank gets there first; kept for whoever wants to look)."""
        if self.checkpoint is None:
            return []
        self.checkpoint.wait()
        moved = []
        for step in self.checkpoint.steps():
            if self.clean_step is not None and step <= self.clean_step:
                continue
            path = self.checkpoint.directory / f"step-{step:09d}"
            with contextlib.suppress(OSError):  # another rank moved it first
                path.rename(path.with_name(f"suspect-{path.name}-{time.time_ns()}"))
            moved.append(step)
        return sorted(moved)

    def _rehearse(self) -> None:
        """A fault plan's silent corruption, asked for by the launcher: one bit flipped."""
        if self._request is not None and self._request.exists():
            with contextlib.suppress(OSError, ValueError):
                self._corrupt = Corruption.from_json(self._request.read_text())
            self._request.unlink(missing_ok=True)
            if self._corrupt is not None:
                self._flip(self._corrupt.target)
                if not self._corrupt.repeat:
                    self._corrupt = None
                return
        if self._corrupt is not None:
            self._flip(self._corrupt.target)

    def _flip(self, target: CorruptionTarget) -> None:
        tensor = next(self.model.parameters()).data
        if target is CorruptionTarget.OPTIMIZER and self.optimizer is not None:
            buffers = [
                v
                for v in self.optimizer.state.get(next(self.model.parameters()), {}).values()
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()
            ]
            tensor = buffers[0] if buffers else tensor
        size = tensor.element_size()
        as_int, bit = {2: (torch.int16, 4), 4: (torch.int32, 20), 8: (torch.int64, 40)}[size]
        with torch.no_grad():  # one bit of the first element's mantissa
            word = tensor.view(-1)[:1].view(as_int)
            word ^= 1 << bit


def _device_of(group: Any) -> torch.device:
    """Where a collective's tensors live for `group`'s backend: NCCL's on this rank's GPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
