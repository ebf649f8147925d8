"""Every random-number stream a training script draws from, captured and restored as one.

A resumed run ends bit for bit where an unbroken one ends only if it draws the same random
numbers at the same steps: the checkpoint must hold every stream (Python's `random`, NumPy's
global generator, torch's CPU generator and, once CUDA is initialised, every GPU's), and nothing
relaunch's SDK does may draw from them. Importable without torch or NumPy: a library the script
has not imported is not captured (and so is not imported here either).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["capture", "preserved", "restore"]


def capture() -> dict[str, Any]:
    """The state of every stream in use now: `random`, `numpy`, `torch`, `cuda` keys."""
    state: dict[str, Any] = {"random": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_initialized():  # (is_available() asks the driver: 10x the time)
            state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put back the streams `state` holds (a checkpoint from an older relaunch holds only
    `torch`; the others are then left as they are)."""
    if "random" in state:
        random.setstate(_as_random_state(state["random"]))
    numpy = sys.modules.get("numpy")
    if "numpy" in state and numpy is not None:
        numpy.random.set_state(state["numpy"])
    torch = sys.modules.get("torch")
    if torch is not None:
        if "torch" in state:
            torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


@contextmanager
def preserved() -> Iterator[None]:
    """Whatever runs inside draws from the streams, and leaves them as it found them."""
    state = capture()
    try:
        yield
    finally:
        restore(state)


def _as_random_state(value: Any) -> Any:
    """`random.setstate` wants tuples; a state that went through a serializer may be lists."""
    if isinstance(value, list):
        return tuple(_as_random_state(v) for v in value)
    return value
