"""One thread that runs, in the background, the newest of the tasks handed to it: a task still
waiting when the next one comes is dropped for it. A checkpoint's copies (into a peer's memory,
onto the node's own disk) go this way: the training loop never waits for one, and a copy of a
step that a newer save overtook is not worth making. Standard library only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["NewestOnly"]


class NewestOnly:
    """A background runner of the newest task given (`submit`); `wait` until it is idle."""

    def __init__(self) -> None:
        self._pending: Callable[[], None] | None = None
        self._lock = threading.Condition()
        self._running = False
        """A thread is running (it clears this under the lock as it ends)."""
        self._busy = False
        """The thread is running a task now."""

    def submit(self, task: Callable[[], None]) -> None:
        """Run `task` in the background, instead of the one still waiting, if any. `task`
        handles its own errors: one that escapes ends only that task."""
        with self._lock:
            self._pending = task
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, daemon=True).start()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the tasks given so far ran (or were dropped), at most `timeout` seconds; False
        if one is still running or waiting."""
        with self._lock:
            return self._lock.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._lock:
                task, self._pending = self._pending, None
                if task is None:
                    self._running = False  # a task given after this starts a new thread
                    return
                self._busy = True
            try:
                task()
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()
