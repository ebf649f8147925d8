"""Overlapped asynchronous saves (`overlap_copy=True`, relaunch.train.overlap): what an optimizer
owns is copied while the loop runs on, and its next step waits for the copy. The promise: every
checkpoint holds the state as it was when `save` returned, bit for bit, or the save fails loudly;
never a mix. Tested on a model with dropout, batch norm (buffers changed by every forward) and
Adam, not on a state built for the mechanism."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from relaunch.train import CheckpointManager, StateChangedDuringSave, overlap


def model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.BatchNorm1d(256),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.3),
        torch.nn.Linear(256, 64),
    )
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-3)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "rng": torch.get_rng_state(),
    }


def snapshot(state: Any) -> Any:
    """A deep copy of `state`, taken at once: what the checkpoint must hold."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [snapshot(v) for v in state]
    return state


def assert_same(loaded: Any, expected: Any, where: str = "state") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(loaded, torch.Tensor), where
        assert loaded.dtype == expected.dtype and torch.equal(loaded, expected), where
    elif isinstance(expected, dict):
        assert loaded.keys() == expected.keys(), where
        for key in expected:
            assert_same(loaded[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, list):
        assert len(loaded) == len(expected), where
        for i, (a, b) in enumerate(zip(loaded, expected, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert loaded == expected, where


def test_an_overlapped_save_holds_the_state_as_of_the_save_bit_for_bit(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer()
    manager = CheckpointManager(tmp_path, rank=0, async_save=True, overlap_copy=True, keep=10)
    expected = {}
    for step in range(1, 13):
        train_step(model, optimizer, step)
        if step % 3 == 0:
            state = state_of(model, optimizer, step)
            expected[step] = snapshot(state)
            manager.save(step, state)
            # the optimizer's tensors are still to be copied when save returns: the next
            # forward (which changes batch norm's buffers) and backward run meanwhile
            assert manager._uncopied is not None
    manager.wait()
    assert manager.verified_steps() == [12, 9, 6, 3]
    for step, state in expected.items():
        loaded = manager.load(step)
        assert loaded is not None
        assert_same(loaded.state, state)


def test_the_next_optimizer_step_waits_for_a_copy_still_being_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy slower than the next forward and backward (a big state, a busy machine): the
    optimizer's step waits for it, so it never copies what that step changed."""
    take = overlap.PendingCopy.take
    taking = threading.Event()

    def slow_take(self: overlap.PendingCopy) -> None:
        taking.set()
        time.sleep(0.5)
        take(self)

    monkeypatch.setattr(overlap.PendingCopy, "take", slow_take)
    model, optimizer = model_and_optimizer()
    manager = CheckpointManager(tmp_path, rank=0, async_save=True, overlap_copy=True)
    train_step(model, optimizer, 1)
    state = state_of(model, optimizer, 1)
    expected = snapshot(state)
    manager.save(1, state)
    assert taking.wait(10)
    train_step(model, optimizer, 2)  # its optimizer step lands in the middle of the copy
    manager.wait()
    loaded = manager.load()
    assert loaded is not None
    assert_same(loaded.state, expected)


def test_a_run_resumed_from_an_overlapped_save_ends_bit_identical(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer()
    for step in range(1, 11):
        train_step(model, optimizer, step)
    uninterrupted = snapshot(model.state_dict())

    model, optimizer = model_and_optimizer()
    manager = CheckpointManager(tmp_path, rank=0, async_save=True, overlap_copy=True)
    for step in range(1, 8):  # the process dies after step 7 (its save of step 6 is written)
        train_step(model, optimizer, step)
        if step % 2 == 0:
            manager.save(step, state_of(model, optimizer, step))
    manager.wait()

    model, optimizer = model_and_optimizer(seed=1)  # a new process: other initial weights
    loaded = CheckpointManager(tmp_path, rank=0).load()
    assert loaded is not None and loaded.step == 6
    model.load_state_dict(loaded.state["model"])
    optimizer.load_state_dict(loaded.state["optimizer"])
    torch.set_rng_state(loaded.state["rng"])
    for step in range(7, 11):
        train_step(model, optimizer, step)
    assert_same(model.state_dict(), uninterrupted)


@pytest.mark.parametrize(
    "change",
    [
        "an in-place update of a parameter",
        "an in-place update through a view of a parameter",
        "load_state_dict into the model",
        "an in-place update of the optimizer's state",
    ],
)
def test_a_tensor_changed_before_the_next_optimizer_step_fails_the_save_loudly(
    tmp_path: Path, change: str
) -> None:
    model, optimizer = model_and_optimizer()
    manager = CheckpointManager(tmp_path, rank=0, async_save=True, overlap_copy=True)
    train_step(model, optimizer, 1)
    manager.save(1, state_of(model, optimizer, 1))
    manager.wait()
    train_step(model, optimizer, 2)
    other = model_and_optimizer(seed=5)[0].state_dict()
    manager.save(2, state_of(model, optimizer, 2))
    weight = model[0].weight
    with torch.no_grad():
        if change == "an in-place update of a parameter":
            weight.mul_(0.5)
        elif change == "an in-place update through a view of a parameter":
            weight[3].zero_()
        elif change == "load_state_dict into the model":
            model.load_state_dict(other)
        else:
            optimizer.state[weight]["exp_avg"].add_(1.0)
    train_step(model, optimizer, 3)  # the optimizer's step checks the copy
    with pytest.raises(StateChangedDuringSave, match="changed in place"):
        manager.wait()
    assert manager.verified_steps() == [1]  # nothing of step 2 was written
    assert not any(p.name.startswith(".") for p in tmp_path.rglob("*"))
    manager.save(3, state_of(model, optimizer, 3))  # the next save works
    manager.wait()
    assert manager.verified_steps() == [3, 1]


def test_a_save_before_the_first_optimizer_step_copies_everything_at_once(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer(seed=7)
    manager = CheckpointManager(tmp_path, rank=0, async_save=True, overlap_copy=True)
    expected = snapshot(state_of(model, optimizer, 0))
    manager.save(0, state_of(model, optimizer, 0))
    assert manager._uncopied is None  # no optimizer has stepped: it owns nothing yet
    with torch.no_grad():
        model[0].weight.add_(1.0)  # allowed: the copy was taken
    manager.wait()
    loaded = manager.load()
    assert loaded is not None
    assert_same(loaded.state, expected)


def test_a_copy_of_only_plain_tensors_is_taken_at_the_save(tmp_path: Path) -> None:
    """Tensors no optimizer owns (buffers, the user's own) may change right after the save."""
    model, optimizer = model_and_optimizer()
    manager = CheckpointManager(tmp_path, rank=0, async_save=True, overlap_copy=True)
    train_step(model, optimizer, 1)
    mine = torch.arange(1000.0)
    manager.save(1, {"mine": mine, "model": model.state_dict()})
    mine.add_(1.0)
    model(torch.randn(32, 64))  # changes batch norm's running statistics
    manager.wait()
    loaded = manager.load()
    assert loaded is not None and torch.equal(loaded.state["mine"], torch.arange(1000.0))


def test_overlap_copy_without_async_save_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="overlap_copy needs async_save"):
        CheckpointManager(tmp_path, overlap_copy=True)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_script_that_ends_right_after_an_async_save_still_writes_it(
    tmp_path: Path, overlap: bool
) -> None:
    script = textwrap.dedent(
        f"""
        import torch
        from relaunch.train import CheckpointManager

        model = torch.nn.Linear(512, 512)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        manager = CheckpointManager(
            {str(tmp_path)!r}, rank=0, async_save=True, overlap_copy={overlap}
        )
        for step in range(1, 4):
            model(torch.ones(4, 512)).sum().backward()
            optimizer.step()
        manager.save(3, {{"model": model.state_dict()}})
        torch.save(model.state_dict(), {str(tmp_path / "expected.pt")!r})
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    loaded = CheckpointManager(tmp_path, rank=0).load()
    assert loaded is not None and loaded.step == 3
    assert_same(loaded.state["model"], torch.load(tmp_path / "expected.pt"))


def test_an_online_retry_that_restores_the_step_start_keeps_the_save_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """relaunch's own in-place restores (an online retry puts back the state the step started
    from; a healthy rank's broadcast, an elastic boundary do the same) settle a pending copy
    first: the save before the retried step is written, not failed."""
    from relaunch.protocol.environment import Env
    from relaunch.train.group import ProcessGroupKeeper

    monkeypatch.setenv(Env.MEMBERSHIP, str(tmp_path / "membership.json"))  # recovery on
    model, optimizer = model_and_optimizer()
    keeper = ProcessGroupKeeper(model, optimizer)
    manager = CheckpointManager(tmp_path / "ckpt", rank=0, async_save=True, overlap_copy=True)
    train_step(model, optimizer, 1)
    state = state_of(model, optimizer, 1)
    expected = snapshot(state)
    manager.save(1, state)
    assert manager._uncopied is not None
    start = keeper._take_snapshot()  # step 2 starts
    model(torch.randn(32, 64)).sum().backward()  # ... and is told to run again
    keeper._restore(start)
    train_step(model, optimizer, 2)
    manager.wait()
    loaded = manager.load()
    assert loaded is not None and loaded.step == 1
    assert_same(loaded.state, expected)
