"""The checkpoint shard format (relaunch.train.shard): one streaming pass, still a safetensors
file, still verified. Every byte of a shard is covered by its hash; every kind of value a state
holds comes back as it went in; a shard of an earlier release still loads."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch

from relaunch.train import CheckpointManager, CheckpointWarning
from relaunch.train import shard as shard_format


@dataclasses.dataclass
class Holder:
    """A user's own object with a tensor inside: pickled with the rest, its tensor stored raw."""

    name: str
    weights: torch.Tensor


def _wide_state() -> dict[str, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Dropout(0.2), torch.nn.Linear(5, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    parameter = torch.nn.Parameter(torch.randn(4))
    dtypes = [torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
    dtypes += [torch.int16, torch.int8, torch.uint8, torch.bool]
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "by_dtype": {str(d): (torch.arange(7) % 3).to(d) for d in dtypes},
        "transposed": torch.arange(12.0).view(3, 4).t(),
        "sliced": torch.arange(100.0)[10:20:3],
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "parameter": parameter,
        "tied": parameter,
        "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "complex": torch.ones(3, dtype=torch.complex64),
        "sparse": torch.eye(3).to_sparse(),
        "array": np.arange(5.0),
        "holder": Holder("h", torch.full((2, 2), 3.0)),
        "rng": torch.get_rng_state(),
        "step": 41,
        "text": "résumé",
    }


def _assert_same(loaded: Any, original: Any) -> None:
    if isinstance(original, torch.Tensor):
        assert type(loaded) is type(original)
        assert loaded.dtype == original.dtype and loaded.shape == original.shape
        assert loaded.requires_grad == original.requires_grad
        assert torch.equal(loaded.to_dense(), original.detach().to_dense())
    elif isinstance(original, dict):
        assert list(loaded) == list(original)
        for key in original:
            _assert_same(loaded[key], original[key])
    elif isinstance(original, list | tuple):
        assert type(loaded) is type(original) and len(loaded) == len(original)
        for a, b in zip(loaded, original, strict=True):
            _assert_same(a, b)
    elif isinstance(original, np.ndarray):
        np.testing.assert_array_equal(loaded, original)
    elif isinstance(original, Holder):
        assert loaded.name == original.name
        _assert_same(loaded.weights, original.weights)
    else:
        assert loaded == original


@pytest.mark.parametrize("async_save", [False, True])
def test_every_kind_of_value_comes_back_as_it_was_saved(tmp_path: Path, async_save: bool) -> None:
    state = _wide_state()
    manager = CheckpointManager(tmp_path, rank=0, async_save=async_save)
    manager.save(1, state)
    loaded = manager.load()
    assert loaded is not None
    _assert_same(loaded.state, state)
    assert loaded.state["tied"] is loaded.state["parameter"]  # one object saved twice, once loaded
    restored = torch.optim.Adam(torch.nn.Linear(1, 1).parameters())
    with pytest.raises(ValueError):  # a real optimizer state: it refuses the wrong parameters
        restored.load_state_dict(loaded.state["optimizer"])


def test_a_shard_is_a_safetensors_file_any_reader_opens(tmp_path: Path) -> None:
    state = {"weight": torch.randn(3, 4), "bias": torch.zeros(4, dtype=torch.bfloat16), "step": 3}
    manager = CheckpointManager(tmp_path, rank=5)
    manager.save(3, state)
    tensors = safetensors.torch.load_file(tmp_path / "step-000000003" / "rank-5.ckpt")
    stored = [t for name, t in sorted(tensors.items()) if name.startswith("t")]
    assert any(torch.equal(t, state["weight"]) for t in stored)
    assert any(torch.equal(t, state["bias"]) for t in stored)
    assert tensors["rest"].dtype == torch.uint8


def _two_steps(tmp_path: Path) -> tuple[CheckpointManager, Path, dict[str, Any]]:
    manager = CheckpointManager(tmp_path, rank=0)
    older = {"w": torch.arange(6.0), "step": 1}
    manager.save(1, older)
    manager.save(2, {"w": torch.arange(6.0) * 2, "step": 2, "extra": [torch.ones(2)]})
    return manager, tmp_path / "step-000000002" / "rank-0.ckpt", older


def test_a_flipped_byte_anywhere_in_a_shard_fails_verification(tmp_path: Path) -> None:
    manager, path, older = _two_steps(tmp_path)
    good = path.read_bytes()
    for position in range(len(good)):  # every byte: header length, header, tensors, rest
        damaged = bytearray(good)
        damaged[position] ^= 0x01
        path.write_bytes(bytes(damaged))
        with pytest.warns(CheckpointWarning, match="step 2 of rank 0"):
            loaded = manager.load()
        assert loaded is not None and loaded.step == 1, position
        _assert_same(loaded.state, older)
    path.write_bytes(good)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert manager.load().step == 2  # type: ignore[union-attr]


@pytest.mark.parametrize("change", ["truncated", "extended", "emptied", "manifest-size"])
def test_a_shard_of_the_wrong_length_fails_verification(tmp_path: Path, change: str) -> None:
    manager, path, _ = _two_steps(tmp_path)
    good = path.read_bytes()
    manifest = path.with_name("rank-0.manifest.json")
    if change == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif change == "extended":
        path.write_bytes(good + b"\0")
    elif change == "emptied":
        path.write_bytes(b"")
    else:
        entry = json.loads(manifest.read_text())
        entry["files"]["rank-0.ckpt"]["size"] += 8
        manifest.write_text(json.dumps(entry))
        path.write_bytes(good + b"\0" * 8)
    with pytest.warns(CheckpointWarning):
        loaded = manager.load()
    assert loaded is not None and loaded.step == 1


def _forged(header: dict[str, Any], data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize(
    ("why", "message"),
    [
        ("huge shape", "is not 16 bytes"),
        ("overlapping", "do not follow on"),
        ("unknown dtype", "unknown dtype"),
        ("missing rest", "entries are not"),
        ("header longer than file", "does not fit"),
    ],
)
def test_a_forged_header_is_refused_before_anything_is_allocated(why: str, message: str) -> None:
    meta = {"format": shard_format.FORMAT, "tensors": "1", "parameters": "", "requires_grad": ""}
    tensor = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    rest = {"dtype": "U8", "shape": [1], "data_offsets": [16, 17]}
    if why == "huge shape":
        tensor["shape"] = [1 << 40, 1 << 20]
    elif why == "overlapping":
        rest["data_offsets"] = [8, 9]
    elif why == "unknown dtype":
        tensor["dtype"] = "C128"
    header: dict[str, Any] = {"__metadata__": meta, "t0": tensor, "rest": rest}
    if why == "missing rest":
        del header["rest"]
    data = _forged(header, b"\0" * 17)
    if why == "header longer than file":
        data = (1 << 30).to_bytes(8, "little") + data[8:]
    with pytest.raises(shard_format.ShardError, match=message):
        shard_format.read_buffer(data, "not checked before the header")


class _Detonator:
    """Unpickling it runs code: a checkpoint loader must never get that far with it."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(os.environ["DETONATED"]),))


@pytest.mark.parametrize("fmt", ["torch", "pickle"])
def test_a_0_1_shard_that_unpickles_is_refused_and_never_unpickled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """0.1.0 wrote torch.save / pickle bytes with a SHA-256 in the manifest: loading them would
    run whatever code they carry, so they are refused by name (a warning; the next older
    checkpoint, or none) even when their checksum matches."""
    mark = tmp_path / "detonated"
    monkeypatch.setenv("DETONATED", str(mark))
    state = {"w": torch.arange(4.0), "step": 9, "payload": _Detonator()}
    if fmt == "torch":
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
    else:
        data = pickle.dumps(state)
    directory = tmp_path / "ckpt" / "step-000000009"
    directory.mkdir(parents=True)
    (directory / "rank-0.ckpt").write_bytes(data)
    files = {"rank-0.ckpt": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    manifest = {"step": 9, "rank": 0, "format": fmt, "files": files}
    (directory / "rank-0.manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(CheckpointWarning, match=f"format '{fmt}', which relaunch no longer reads"):
        assert CheckpointManager(tmp_path / "ckpt", rank=0).load() is None
    assert not mark.exists()
    # the file does detonate when unpickled: the check above could fail
    if fmt == "torch":
        torch.load(io.BytesIO(data), weights_only=False)
    else:
        pickle.loads(data)
    assert mark.exists()


class _FirstFormatPickler(pickle.Pickler):
    """How relaunch-shard-1 referred to a tensor in the pickled rest: by a persistent id."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> int | None:
        if type(obj) is not torch.Tensor:
            return None
        for index, seen in enumerate(self.tensors):
            if seen is obj:
                return index
        self.tensors.append(obj)
        return len(self.tensors) - 1


def test_a_relaunch_shard_1_file_with_persistent_ids_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = torch.arange(6.0)
    state = {"w": shared, "again": shared, "rng": tuple(range(625)), "step": 4}
    rest = io.BytesIO()
    pickler = _FirstFormatPickler(rest)
    pickler.dump(state)
    packed = shard_format.Packed(rest.getvalue(), tensors=pickler.tensors)
    monkeypatch.setattr(shard_format, "FORMAT", "relaunch-shard-1")  # the header it wrote
    buffer = io.BytesIO()
    size, digest = shard_format.write(buffer, packed)
    monkeypatch.undo()
    directory = tmp_path / "step-000000004"
    directory.mkdir()
    (directory / "rank-0.ckpt").write_bytes(buffer.getvalue())
    files = {"rank-0.ckpt": {"size": size, shard_format.HASH: digest}}
    manifest = {"step": 4, "rank": 0, "format": "relaunch-shard-1", "files": files}
    (directory / "rank-0.manifest.json").write_text(json.dumps(manifest))
    loaded = CheckpointManager(tmp_path, rank=0).load()
    assert loaded is not None and loaded.step == 4
    _assert_same(loaded.state, state)
    assert loaded.state["w"] is loaded.state["again"]  # one tensor, loaded once


def test_a_shards_pickled_rest_alone_says_where_its_tensors_are(tmp_path: Path) -> None:
    """An unpickler of the rest alone (no `read`) meets a tensor reference: a clear error, not
    a wrong value."""
    packed = shard_format.pack({"w": torch.ones(3), "n": 1})
    assert len(packed.tensors) == 1
    with pytest.raises(shard_format.ShardError, match=r"relaunch\.train\.shard\.read"):
        pickle.loads(packed.rest)


def test_consecutive_async_saves_reuse_one_buffer_and_each_keeps_its_own_values(
    tmp_path: Path,
) -> None:
    manager = CheckpointManager(tmp_path, rank=0, async_save=True, keep=5)
    weights = torch.zeros(1 << 16)
    for step in range(1, 5):
        weights.add_(1.0)
        manager.save(step, {"w": weights, "step": step})
        weights.add_(100.0)  # the next step changes the tensor while the save is written
    manager.wait()
    for step in range(1, 5):
        loaded = manager.load(step)
        assert loaded is not None and loaded.state["step"] == step
        assert torch.all(loaded.state["w"] == 101.0 * (step - 1) + 1.0)
    assert manager.load(4).state["w"] is not manager.load(3).state["w"]  # type: ignore[union-attr]


def test_a_loaded_tensor_can_be_changed_and_the_file_never_changes(tmp_path: Path) -> None:
    """A load maps the shard privately (its pages shared with the page cache until written): a
    tensor changed in place copies its pages, and neither the file nor the next load sees it."""
    manager = CheckpointManager(tmp_path, rank=0)
    weights = torch.arange(float(1 << 20))  # 4 MB: many pages, more than one read chunk
    manager.save(3, {"w": weights, "moments": {"m": weights * 2}})
    path = tmp_path / "step-000000003" / "rank-0.ckpt"
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = manager.load()
    assert loaded is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not a read-only buffer
        loaded.state["w"].add_(1.0)
        loaded.state["moments"]["m"][::1000].zero_()  # a few scattered pages
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    again = manager.load()
    assert again is not None
    assert torch.equal(again.state["w"], weights)
    assert torch.equal(again.state["moments"]["m"], weights * 2)
    assert torch.equal(loaded.state["w"], weights + 1.0)  # the changed copy keeps its change


def test_a_kernel_without_populate_read_loads_the_same_and_still_verifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel refuses MADV_POPULATE_READ (EINVAL, before Linux 5.14; here an advice no
    kernel knows), the load falls back to a populated private mapping: same state, same checks."""
    monkeypatch.setattr(shard_format, "_MADV_POPULATE_READ", 0x7FFF)
    manager, path, older = _two_steps(tmp_path)
    loaded = manager.load()
    assert loaded is not None and loaded.step == 2
    _assert_same(loaded.state, {"w": torch.arange(6.0) * 2, "step": 2, "extra": [torch.ones(2)]})
    loaded.state["w"].add_(1.0)
    good = path.read_bytes()
    damaged = bytearray(good)
    damaged[len(good) // 2] ^= 0x01
    path.write_bytes(bytes(damaged))
    with pytest.warns(CheckpointWarning, match="step 2 of rank 0"):
        fallback = manager.load()
    assert fallback is not None and fallback.step == 1
    _assert_same(fallback.state, older)


def test_a_step_saved_again_leaves_what_was_loaded_from_it_as_it_was(tmp_path: Path) -> None:
    """A loaded state shares pages with its file until changed; a save never writes into a
    committed shard (it renames a new file over it), so a dying gasp that saves the very step a
    rank resumed from cannot change what the rank loaded."""
    manager = CheckpointManager(tmp_path, rank=0)
    manager.save(27, {"w": torch.full((1 << 18,), 1.0)})
    loaded = manager.load()
    assert loaded is not None
    manager.save(27, {"w": torch.full((1 << 18,), 2.0)})
    assert torch.all(loaded.state["w"] == 1.0)
    assert torch.all(manager.load().state["w"] == 2.0)  # type: ignore[union-attr]
