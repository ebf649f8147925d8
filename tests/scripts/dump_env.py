"""Writes what a rank sees of its launcher: every variable of torchrun's contract, and whether
torch itself takes the rank as launched by torchelastic. Usage: dump_env.py OUT_DIR."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

PREFIXES = ("TORCHELASTIC_", "ROLE_", "GROUP_", "TORCH_NCCL_")
NAMES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "OMP_NUM_THREADS", "NCCL_HOSTID",
)  # fmt: skip

seen = {k: v for k, v in os.environ.items() if k in NAMES or k.startswith(PREFIXES)}
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
(out / f"rank-{os.environ['RANK']}.json").write_text(
    json.dumps({"env": seen, "launched": dist.is_torchelastic_launched()})
)
