"""The SDK's checkpoint save and load against the raw disk, same files, same run; and how long
each kind of save stalls a training loop (a model and Adam, the state of the same size)."""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from relaunch_bench.jobs import Progress

KINDS = ("raw_write", "raw_read", "save", "load", "async_first_stall", "async_stall", "async_total")
LOOP_KINDS = (
    "loop_sync_stall",
    "loop_async_stall",
    "loop_overlap_stall",
    "loop_async_next_step_extra",
    "loop_overlap_next_step_extra",
)
LAYERS = 8  # the loop's model: LAYERS square linear layers, Adam
BATCH = 32


def _drop_cache(path: Path) -> None:
    """Evict a file's pages, so that the next read comes from the disk (not the page cache)."""
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw(directory: Path, data: bytes) -> tuple[float, float]:
    """Sequential write (with fsync) and cold read of `data` through plain file calls: s, s."""
    path = directory / "raw.bin"
    chunk = 8 << 20
    view = memoryview(data)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for offset in range(0, len(data), chunk):
            f.write(view[offset : offset + chunk])
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - start
    _drop_cache(path)
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(chunk):
            pass
    read_s = time.perf_counter() - start
    path.unlink()
    return write_s, read_s


def checkpoint_rows(
    sizes_mb: list[int], repeats: int, where: Path, say: Progress
) -> list[dict[str, Any]]:
    """For a state of each size, on the disk that holds `where`: the SDK's save and load against
    the raw disk, and how long an asynchronous save stalls the training loop."""
    import torch

    rows = []
    for mb in sizes_mb:
        tensor = torch.randn(mb * (1 << 20) // 4, generator=torch.Generator().manual_seed(mb))
        samples: dict[str, list[float]] = {k: [] for k in KINDS + LOOP_KINDS}
        for _ in range(repeats):
            with tempfile.TemporaryDirectory(prefix="relaunch-bench-ckpt-", dir=where) as tmp:
                for kind, seconds in _one_round(Path(tmp), tensor).items():
                    samples[kind].append(seconds)
                for kind, seconds in _loop_round(Path(tmp), mb).items():
                    samples[kind].append(seconds)
        rows.append(_row(mb, repeats, {k: statistics.median(v) for k, v in samples.items()}))
        say(f"checkpoint {mb} MB: {rows[-1]}")
        del tensor
    return rows


def _one_round(directory: Path, tensor: Any) -> dict[str, float]:
    """Seconds of each of KINDS for one tensor, in a fresh directory."""
    import torch

    from relaunch.train import CheckpointManager

    seconds: dict[str, float] = {}
    seconds["raw_write"], seconds["raw_read"] = _raw(directory, tensor.numpy().tobytes())
    manager = CheckpointManager(directory / "sync", rank=0, keep=1)
    start = time.perf_counter()
    manager.save(1, {"weights": tensor})
    seconds["save"] = time.perf_counter() - start
    for path in (directory / "sync").rglob("*"):
        if path.is_file():
            _drop_cache(path)
    start = time.perf_counter()
    loaded = manager.load()
    seconds["load"] = time.perf_counter() - start
    if loaded is None or not torch.equal(loaded.state["weights"], tensor):
        raise RuntimeError("the checkpoint read back differs from the one saved")
    background = CheckpointManager(directory / "async", rank=0, keep=1, async_save=True)
    start = time.perf_counter()
    background.save(1, {"weights": tensor})  # the first save of a manager allocates its buffer
    seconds["async_first_stall"] = time.perf_counter() - start
    background.wait()
    start = time.perf_counter()
    background.save(2, {"weights": tensor})  # every later save copies into the same one
    seconds["async_stall"] = time.perf_counter() - start
    background.wait()
    seconds["async_total"] = time.perf_counter() - start
    return seconds


def _loop_round(directory: Path, mb: int) -> dict[str, float]:
    """A loop whose model and Adam state weigh `mb`: a save's stall, synchronous, asynchronous
    and overlapped (the optimizer's step waits for the copy's rest, timed there), and how much
    longer the step after an asynchronous save is."""
    import torch

    from relaunch.train import CheckpointManager, overlap

    torch.manual_seed(mb)
    width = max(8, int((mb * (1 << 20) / 12 / LAYERS) ** 0.5))  # weights and 2 moments: 12 B
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(LAYERS)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    batch = torch.randn(BATCH, width)

    def train_step() -> float:
        start = time.perf_counter()
        loss = model(batch).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    def timed_save(manager: CheckpointManager, step: int) -> float:
        saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        start = time.perf_counter()
        manager.save(step, saved)
        return time.perf_counter() - start

    waited: list[float] = []
    settle = overlap.PendingCopy.settle

    def timed_settle(self: overlap.PendingCopy) -> None:
        start = time.perf_counter()
        settle(self)
        waited.append(time.perf_counter() - start)

    seconds: dict[str, float] = {}
    sync = CheckpointManager(directory / "loop-sync", rank=0, keep=1)
    copying = CheckpointManager(directory / "loop-async", rank=0, keep=1, async_save=True)
    overlapped = CheckpointManager(
        directory / "loop-overlap", rank=0, keep=1, async_save=True, overlap_copy=True
    )
    usual = statistics.median(train_step() for _ in range(4))  # Adam's state exists after one
    seconds["loop_sync_stall"] = timed_save(sync, 1)
    for manager, kind in ((copying, "async"), (overlapped, "overlap")):
        timed_save(manager, 1)  # the first save of a manager allocates its buffer
        train_step()
        manager.wait()
        overlap.PendingCopy.settle = timed_settle  # type: ignore[method-assign]
        try:
            stall = timed_save(manager, 2)
            seconds[f"loop_{kind}_next_step_extra"] = max(0.0, train_step() - usual)
            stall += sum(waited)  # the optimizer's step waiting for the copy
            waited.clear()
        finally:
            overlap.PendingCopy.settle = settle  # type: ignore[method-assign]
        seconds[f"loop_{kind}_stall"] = stall
        manager.wait()
    return seconds


def _row(mb: int, repeats: int, med: dict[str, float]) -> dict[str, Any]:
    return {
        "size_mb": mb,
        "repeats": repeats,
        "raw_write_mb_s": round(mb / med["raw_write"], 1),
        "raw_read_mb_s": round(mb / med["raw_read"], 1),
        "save_mb_s": round(mb / med["save"], 1),
        "load_mb_s": round(mb / med["load"], 1),
        "save_vs_raw": round(med["raw_write"] / med["save"], 3),
        "load_vs_raw": round(med["raw_read"] / med["load"], 3),
        "save_s": round(med["save"], 3),
        "load_s": round(med["load"], 3),
        "async_first_stall_s": round(med["async_first_stall"], 3),
        "async_stall_s": round(med["async_stall"], 3),
        "async_vs_sync": round(med["async_stall"] / med["save"], 3),
        "async_total_s": round(med["async_total"], 3),
        "loop_sync_stall_s": round(med["loop_sync_stall"], 4),
        "loop_async_stall_s": round(med["loop_async_stall"], 4),
        "loop_async_vs_sync": round(med["loop_async_stall"] / med["loop_sync_stall"], 3),
        "loop_overlap_stall_s": round(med["loop_overlap_stall"], 4),
        "loop_overlap_vs_sync": round(med["loop_overlap_stall"] / med["loop_sync_stall"], 3),
        "loop_async_next_step_extra_s": round(med["loop_async_next_step_extra"], 4),
        "loop_overlap_next_step_extra_s": round(med["loop_overlap_next_step_extra"], 4),
    }
