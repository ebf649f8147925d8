"""The training SDK's promises tested with inputs they were not designed around: random streams
left as found (dropout in the settle pass), a dying gasp that saves the state as of the last
completed step (the failed step had already drawn), and a full disk that leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from relaunch.train import CheckpointManager, rng
from relaunch.train.distributed import rng_state, set_rng_state, settle_ddp_buckets


def draws() -> tuple[float, float, float]:
    """One number from each stream: equal draws, equal states."""
    return random.random(), float(np.random.random_sample()), float(torch.rand(1).item())


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    """A real one-process gloo group."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_settle_ddp_buckets_leaves_every_random_stream_as_it_found_it(group: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    random.seed(1)
    np.random.seed(2)
    before = rng.capture()
    expected = draws()
    rng.restore(before)
    settle_ddp_buckets(ddp, torch.randn(3, 4, generator=torch.Generator().manual_seed(3)))
    assert draws() == expected  # the dropout in the settle pass drew from torch's stream


def test_rng_state_holds_every_stream_the_script_draws_from() -> None:
    saved = rng_state()
    expected = draws()
    draws()
    set_rng_state(pickle.loads(pickle.dumps(saved)))  # as a checkpoint round trip does
    assert draws() == expected
    set_rng_state({"torch": saved["torch"]})  # a checkpoint of an older relaunch still loads


GASP_RNG_SCRIPT = """
import os, pickle, random, sys, time
import numpy as np
import torch
from relaunch.train import CheckpointManager, rng
out = sys.argv[1]
m = CheckpointManager(out + "/ckpt", rank=0)
m.completed_step = 0
m.dying_gasp(lambda: {"rng": rng.capture()})
for step in range(1, 10_000):
    with m.step(step):
        random.random(); np.random.random_sample(); torch.rand(3)   # a step draws (dropout)
        if os.environ.get("FAIL_AT") == str(step):
            raise RuntimeError("a peer died in the middle of a collective")
    with open(f"{out}/rng-{step}.pkl", "wb") as f:
        pickle.dump(rng.capture(), f)
    print("step", step, flush=True)
    time.sleep(0.01)
"""


def test_dying_gasp_after_a_failed_step_saves_the_random_streams_of_the_step_before(
    tmp_path: Path,
) -> None:
    script = tmp_path / "gasp.py"
    script.write_text(GASP_RNG_SCRIPT)
    env = {**os.environ, "FAIL_AT": "5", "RELAUNCH_JOB_ID": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step 4"):
            break
    time.sleep(0.5)  # step 5 has drawn and failed; the process waits for relaunch's SIGTERM
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 143
    loaded = CheckpointManager(tmp_path / "ckpt", rank=0).load()
    assert loaded is not None and loaded.step == 4
    with open(tmp_path / "rng-4.pkl", "rb") as f:
        after_step_4 = pickle.load(f)
    rng.restore(after_step_4)
    expected = draws()
    rng.restore(loaded.state["rng"])
    assert draws() == expected  # before the fix: the streams as step 5 left them


GASP_POINT_SCRIPT = """
import random, signal, sys, time
import numpy as np
import torch
from relaunch.train import CheckpointManager, checkpoint, rng
out, point, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
random.seed(0); np.random.seed(0); torch.manual_seed(0)
m = CheckpointManager(out + "/ckpt", rank=0, every=at)
model = {"w": 0}
armed = False

def term(where):  # relaunch's SIGTERM, arriving exactly here at step `at`
    global armed
    if armed and where == point:
        armed = False
        signal.raise_signal(signal.SIGTERM)  # its Python handler runs before this returns

capture = rng.capture
def capture_hooked():
    if sys._getframe(1).f_code.co_name == "completed_step":
        term("while the step's random streams are noted")
    return capture()
rng.capture = capture_hooked
write_atomic = checkpoint.write_atomic
def write_hooked(*args, **kwargs):
    term("while a periodic save writes")
    return write_atomic(*args, **kwargs)
checkpoint.write_atomic = write_hooked

def state():
    term("while a periodic save gathers the state")
    return {"w": model["w"], "rng": rng.capture()}

m.completed_step = 0
m.dying_gasp(state)
for step in range(1, 100):
    with m.step(step):
        armed = armed or step == at
        random.random(); np.random.random_sample(); torch.rand(3)  # a step draws (dropout)
        term("inside the step")
        model["w"] = step  # the optimizer's update
    m.maybe_save(step, state)
    term("between two steps")
    time.sleep(0.01)
"""

GASP_POINTS = [
    "inside the step",
    "while the step's random streams are noted",
    "while a periodic save gathers the state",
    "while a periodic save writes",
    "between two steps",
]


@pytest.mark.parametrize("point", GASP_POINTS)
def test_a_sigterm_at_each_point_between_two_writes_gasps_the_state_of_one_step(
    tmp_path: Path, point: str
) -> None:
    """The gasp saves a step's parameters with that step's random streams, wherever relaunch's
    SIGTERM lands (a hung rank's SIGSTOP and a stop's SIGCONT + SIGTERM land anywhere). Before
    the fix: the step noted before its streams (a gasp between saved step 3 with step 2's
    streams: a warm-restart run ended with another hash once in CI), and a gasp in the middle of
    a save waited for the lock that save held until the grace killed the rank."""
    script = tmp_path / "gasp.py"
    script.write_text(GASP_POINT_SCRIPT)
    at = 3
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), point, str(at)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 143, done.stdout + done.stderr
    assert f"dying gasp saved step {at}" in done.stdout, done.stdout + done.stderr
    loaded = CheckpointManager(tmp_path / "ckpt", rank=0).load()
    assert loaded is not None and loaded.step == at
    assert loaded.state["w"] == at  # the parameters of step 3, not of step 2 or 4
    with rng.preserved():
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        for _ in range(at):
            random.random(), np.random.random_sample(), torch.rand(3)
        expected = draws()
        rng.restore(loaded.state["rng"])
        assert draws() == expected  # the streams as step 3 left them


KEEPER_GASP_SCRIPT = """
import random, signal, sys
import numpy as np
import torch
from torch import nn
from relaunch.train import CheckpointManager, rng
from relaunch.train.group import ProcessGroupKeeper
out, at, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
random.seed(0); np.random.seed(0); torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))

class Adam(torch.optim.Adam):
    def step(self, closure=None):
        result = super().step(closure)
        if mode == "signal" and keeper.completed + 1 == at:
            signal.raise_signal(signal.SIGTERM)  # relaunch's SIGTERM, inside the update
        return result

optimizer = Adam(model.parameters(), lr=0.01)
keeper = ProcessGroupKeeper(model, optimizer)
keeper.start()
ckpt = CheckpointManager(out + "/ckpt", rank=0)
ckpt.completed_step = 0
state = lambda: {"model": model.state_dict(), "rng": rng.capture()}
ckpt.dying_gasp(state)

def train_step(step):
    optimizer.zero_grad()
    model(torch.randn(2, 4) + random.random() + float(np.random.random_sample())).sum().backward()

def after(step, _):
    if mode == "reference" and step == at:
        ckpt.save(step, state())
        keeper.exit(0)

keeper.run(1, 100, train_step, after, checkpoint=ckpt)
"""


def test_a_sigterm_inside_the_keepers_optimizer_step_gasps_the_state_of_one_step(
    tmp_path: Path,
) -> None:
    """Process-level recovery's loop (`ProcessGroupKeeper.run`, handed the checkpoint manager):
    a SIGTERM in the middle of the optimizer's update waits for it, and the gasp saves step 3's
    parameters with step 3's number and streams, as a run that saved step 3 itself has them.
    Before: the example noted the step in `after`, and a gasp in between saved step 3's
    parameters as step 2 (the resumed run trained step 3 twice)."""
    script = tmp_path / "keeper_gasp.py"
    script.write_text(KEEPER_GASP_SCRIPT)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1"}
    saved = {}
    for mode in ("reference", "signal"):
        out = tmp_path / mode
        out.mkdir()
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(free.getsockname()[1])
        done = subprocess.run(
            [sys.executable, str(script), str(out), "3", mode],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert done.returncode == (0 if mode == "reference" else 143), done.stdout + done.stderr
        loaded = CheckpointManager(out / "ckpt", rank=0).load()
        assert loaded is not None and loaded.step == 3, done.stdout + done.stderr
        saved[mode] = loaded.state
    assert_same_tensors(saved["signal"]["model"], saved["reference"]["model"])
    with rng.preserved():
        rng.restore(saved["reference"]["rng"])
        expected = draws()
        rng.restore(saved["signal"]["rng"])
        assert draws() == expected


def assert_same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name in got:
        assert torch.equal(got[name], expected[name]), name


@contextlib.contextmanager
def tiny_disk(path: Path, size: str) -> Iterator[Path]:
    """A real, small file system (tmpfs) that fills up; needs root, as the Ray tests do."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_failed_checkpoint_save_leaves_no_temporary_file_and_the_next_save_fits(
    tmp_path: Path,
) -> None:
    with tiny_disk(tmp_path / "disk", "256k") as disk:
        manager = CheckpointManager(disk / "ckpt", rank=0)
        with pytest.raises(OSError):
            manager.save(1, {"blob": os.urandom(400_000)})  # does not fit
        leftovers = [p for p in disk.rglob("*") if ".tmp-" in p.name]
        assert leftovers == []
        manager.save(2, {"blob": os.urandom(150_000)})  # fits on the empty disk
        loaded = manager.load()
        assert loaded is not None and loaded.step == 2


def test_a_stale_temporary_file_from_a_killed_save_is_swept(tmp_path: Path) -> None:
    step = tmp_path / "ckpt" / "step-000000003"
    step.mkdir(parents=True)
    stale = step / ".rank-0.ckpt.tmp-999999"
    stale.write_bytes(b"x" * 1000)
    other_rank = step / ".rank-1.ckpt.tmp-999999"
    other_rank.write_bytes(b"y")
    CheckpointManager(tmp_path / "ckpt", rank=0)
    assert not stale.exists()
    assert other_rank.exists()  # another rank's file is that rank's to sweep
