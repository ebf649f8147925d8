"""What the process-level recovery's rollback costs a step (issue 48's third part): on a model of
about 100M parameters with Adam, the time of one training step (forward, backward, optimizer)
beside the time of what the keeper keeps before each step to run it again (`StepRollback`):
`replica` (random streams and buffers), `snapshot` (also model and optimizer state, the copy every
step paid before), and the elastic boundary's full copy every `elastic_every` steps.

One process, the keeper's own functions (train.distributed.step_snapshot), medians of repeated
timings; on a GPU where `device` says cuda and one is present (the copies then stay in GPU
memory: `snapshot` doubles what the model and optimizer take there)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

WIDTH = 2048
LAYERS = 24
"""24 square layers of 2048: 100.7M parameters."""
BATCH = 16
ELASTIC_EVERY = 20


def rollback_rows(
    quick: bool,
    say: Callable[[str], None],
    device: str = "cpu",
    layers: int = LAYERS,
    width: int = WIDTH,
) -> list[dict[str, Any]]:
    import torch
    from torch import nn

    from relaunch.train.distributed import step_snapshot

    where = torch.device("cuda" if device == "cuda" and torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).to(where)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in model.parameters())
    batch = torch.randn(BATCH, width, device=where)

    def sync() -> None:
        if where.type == "cuda":
            torch.cuda.synchronize()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(batch).square().mean().backward()
        optimizer.step()

    def timed(what: Callable[[], object], repeats: int) -> float:
        times = []
        for _ in range(repeats):
            sync()
            began = time.perf_counter()
            what()
            sync()
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    repeats = 3 if quick else 9
    say(f"rollback: {params / 1e6:.1f}M parameters with Adam on {where.type}, {repeats} repeats")
    step()  # the optimizer's state exists from here on
    step_s = timed(step, repeats)
    rows = []
    kept = {
        full: timed(partial(step_snapshot, model, optimizer, full), repeats)
        for full in (False, True)
    }
    rows = [
        _row("replica", params, where.type, step_s, kept[False], 1),
        _row("snapshot", params, where.type, step_s, kept[True], 1),
        _row("elastic boundary", params, where.type, step_s, kept[True], ELASTIC_EVERY),
    ]
    for row in rows:
        say(f"  {row['rollback']}: {row['cost_pct']} % of a {row['step_ms']} ms step")
    return rows


def _row(
    rollback: str, params: int, device: str, step_s: float, keep_s: float, every: int
) -> dict[str, Any]:
    per_step = keep_s / every
    return {
        "rollback": rollback,
        "params_m": round(params / 1e6, 1),
        "device": device,
        "every_steps": every,
        "step_ms": round(step_s * 1e3, 1),
        "keep_ms": round(keep_s * 1e3, 2),
        "cost_pct": round(100 * per_step / step_s, 2),
    }
