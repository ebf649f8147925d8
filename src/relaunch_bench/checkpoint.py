"""The SDK's checkpoint save and load against the raw disk, same files, same run."""

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
        samples: dict[str, list[float]] = {k: [] for k in KINDS}
        for _ in range(repeats):
            with tempfile.TemporaryDirectory(prefix="relaunch-bench-ckpt-", dir=where) as tmp:
                for kind, seconds in _one_round(Path(tmp), tensor).items():
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
    }
