"""Asynchronous saves whose copy of the optimizer's tensors overlaps the next step.

An asynchronous save copies the state into a host buffer before it returns: a stall that runs at
memory speed, a noticeable share of a synchronous save when the disk is fast. Most of a training
state is what an optimizer owns (the parameters it updates and its own state, such as Adam's
moments), and nothing changes those between two of its steps. So with `overlap_copy`, the save
copies only the rest before it returns; a background thread copies what an optimizer owns while
the loop runs the next forward and backward, and that optimizer's next `step()` waits for the copy
(a global step pre-hook, installed once).

That wait is also where the copy is checked, on the training thread, where every change the loop
made in between has finished: a tensor taken late whose version counter moved since the save (it
or a view of it was changed in place, a `load_state_dict` into the model included) makes the save
fail instead of writing a state the loop never had. The save is then never written, and the next
`save` or `wait` raises :class:`StateChangedDuringSave`. A change through `.data` keeps no
version, so it is not seen: between a save and the next optimizer step, change the saved tensors
only in ways that leave their version (or copy everything at the save: `overlap_copy=False`).

Which tensors an optimizer owns is known from the optimizers that have stepped at least once (the
same hook records them): a save before the first step copies everything before it returns.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = [
    "PendingCopy",
    "StateChangedDuringSave",
    "install",
    "owned_by_optimizers",
    "settle_pending",
]


class StateChangedDuringSave(RuntimeError):
    """A tensor of an overlapped save changed before its copy was checked: the save was dropped."""


_optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
_pending: list[PendingCopy] = []
_lock = threading.Lock()
_installed = False


def install() -> None:
    """Install the global optimizer step pre-hook (once per process)."""
    global _installed
    with _lock:
        if _installed:
            return
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_before_step)
        _installed = True


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    _optimizers.add(optimizer)
    settle_pending()  # an optimizer step changes what the copies still read: wait, check


def settle_pending() -> None:
    """Wait for every copy still being taken and check it: what changes an optimizer's tensors in
    place on purpose (the SDK's own restores: an online retry, a state broadcast by a healthy
    rank) calls this first, so that it cannot fail a save it did not race."""
    with _lock:
        pending = list(_pending)
    for copy in pending:
        copy.settle()


def _key(tensor: Any) -> tuple[str, int]:
    return str(tensor.device), tensor.untyped_storage().data_ptr()


def owned_by_optimizers() -> Callable[[Any], bool]:
    """Whether a tensor lies in the memory of a parameter or a state tensor of an optimizer that
    has stepped: only an optimizer step changes those (a view of a parameter included)."""
    torch = sys.modules["torch"]
    owned: set[tuple[str, int]] = set()
    for optimizer in list(_optimizers):
        for group in optimizer.param_groups:
            owned.update(_key(p) for p in group["params"])
        for state in optimizer.state.values():
            owned.update(_key(v) for v in state.values() if isinstance(v, torch.Tensor))
    owned = {key for key in owned if key[1]}  # empty storages all sit at 0

    def owned_tensor(tensor: Any) -> bool:
        return bool(owned) and _key(tensor) in owned

    return owned_tensor


class PendingCopy:
    """Copies still to take for one save: `(target, source)` pairs, their sources' versions as of
    the save. The save's background thread calls :meth:`take` then :meth:`verdict`; the training
    thread calls :meth:`settle` (at the next optimizer step, save or wait)."""

    def __init__(self, pairs: list[tuple[Any, Any]]) -> None:
        self._pairs = pairs
        self._versions = [source._version for _, source in pairs]
        self._taken = threading.Event()
        self._settled = threading.Event()
        self._error: BaseException | None = None
        with _lock:
            _pending.append(self)

    def take(self) -> None:
        """Copy every source into its target (background thread)."""
        try:
            for target, source in self._pairs:
                target.copy_(source.detach())
        except BaseException as error:  # reported by verdict(), raised by the next save or wait
            self._error = error
        finally:
            self._taken.set()

    def settle(self) -> None:
        """On the training thread: wait for the copy, then check that no source changed since the
        save. Idempotent."""
        if self._settled.is_set():
            return
        self._taken.wait()
        if self._error is None:
            for (_, source), version in zip(self._pairs, self._versions, strict=True):
                if source._version != version:
                    self._error = StateChangedDuringSave(
                        f"a tensor of the state (shape {tuple(source.shape)}, {source.dtype}) "
                        "was changed in place after the overlapped save returned and before the "
                        "optimizer's next step, so its copy may not be the state that was saved: "
                        "that save was dropped. Change the saved tensors only through the "
                        "optimizer until its next step, or save with overlap_copy=False"
                    )
                    break
        with _lock:
            if self in _pending:
                _pending.remove(self)
        self._settled.set()

    def verdict(self) -> BaseException | None:
        """Wait for :meth:`settle`; the error that drops the save, if any (background thread)."""
        self._settled.wait()
        return self._error
