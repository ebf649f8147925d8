"""A noisy neighbour, as the machines our users train on have one: a disk writer that writes and
fsyncs as fast as it can on a given file system, and a CPU hog per core. Everything it starts
ends with it (and within `seconds` at most, should a test be killed)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

WRITER = """
import os, sys, time
path, end = sys.argv[1], time.time() + float(sys.argv[2])
buf = os.urandom(1 << 20)
while time.time() < end:
    with open(path, "wb") as f:
        for _ in range(16):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
os.unlink(path)
"""
HOG = "import sys, time\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end: pass\n"


@contextlib.contextmanager
def noisy_neighbour(directory: Path, seconds: float = 600) -> Iterator[list[int]]:
    """A disk writer in `directory` and one CPU hog per core while the block runs; their pids."""
    directory.mkdir(parents=True, exist_ok=True)
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(directory / "noisy.bin"), str(seconds)])
    ]
    procs += [
        subprocess.Popen([sys.executable, "-c", HOG, str(seconds)])
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
        (directory / "noisy.bin").unlink(missing_ok=True)
