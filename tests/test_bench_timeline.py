"""Where a restart's time goes, read off rank 0's timeline (relaunch_bench.timeline): each part
between two of the script's marks, CUDA's start and the communicator's apart from the model's."""

from __future__ import annotations

import pytest

from relaunch_bench.timeline import PHASES, phases_of

FAULT_AT = 100.0


def events(*marks: tuple[str, float]) -> list[tuple[str, int, float]]:
    before = [("step", 41, 99.5), ("ddp", 0, 10.0)]  # the first attempt's, before the fault
    return before + [(name, 0, at) for name, at in marks]


def test_each_part_is_the_time_between_its_marks() -> None:
    found = phases_of(
        events(
            ("launched", 103.0), ("imported", 107.5), ("cuda", 113.0), ("group", 113.5),
            ("built", 114.0), ("ddp", 116.0), ("loaded", 116.25), ("step", 116.5),
        ),
        FAULT_AT,
        0.5,
    )  # fmt: skip
    assert found == {
        "detect": 0.5, "stop_spawn": 2.5, "import": 4.5, "cuda": 5.5, "rendezvous": 0.5,
        "model": 0.5, "communicator": 2.0, "load": 0.25, "first_step": 0.25,
    }  # fmt: skip
    assert tuple(found) == PHASES


def test_a_timeline_without_the_cuda_and_built_marks_counts_them_as_nothing() -> None:
    """Timelines written before those marks (results kept from earlier runs, a peer's)."""
    found = phases_of(
        events(
            ("launched", 103.0), ("imported", 107.5), ("group", 113.5), ("ddp", 116.0),
            ("loaded", 116.25), ("step", 116.5),
        ),
        FAULT_AT,
        None,
    )  # fmt: skip
    assert found is not None
    assert found["cuda"] == 0 and found["rendezvous"] == 6.0
    assert found["model"] == 0 and found["communicator"] == 2.5
    assert sum(found.values()) == pytest.approx(116.5 - FAULT_AT)


def test_a_restart_that_never_stepped_has_no_parts() -> None:
    assert phases_of(events(("launched", 103.0), ("imported", 107.5)), FAULT_AT, 0.5) is None
