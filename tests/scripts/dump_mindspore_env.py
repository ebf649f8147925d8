"""Writes what a MindSpore process sees of its launcher (msrun or relaunch): every variable of
msrun's contract, to OUT_DIR/<MS_ROLE>-<RANK_ID>.json. A worker first waits for the scheduler's
file (the job may end, and its scheduler with it, once the workers have exited).
Usage: dump_mindspore_env.py OUT_DIR [TAG] (TAG names the files of one of several msruns)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

NAMES = ("RANK_ID", "RANK_SIZE", "DEVICE_ID", "RANK_TABLE_FILE")

seen = {k: v for k, v in os.environ.items() if k in NAMES or k.startswith("MS_")}
out = Path(sys.argv[1])
tag = sys.argv[2] if len(sys.argv) > 2 else ""
out.mkdir(parents=True, exist_ok=True)
role = os.environ.get("MS_ROLE", "none")
written = out / f"{tag}{role}-{os.environ.get('RANK_ID', 'none')}.json"
partial = written.with_suffix(".partial")
partial.write_text(json.dumps(seen, sort_keys=True))
partial.rename(written)
if role != "MS_SCHED":
    deadline = time.monotonic() + 60
    while not list(out.glob("*MS_SCHED-*.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
