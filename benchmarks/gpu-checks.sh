#!/usr/bin/env bash
# The GPU checks in one run, for a short loan of a machine with an NVIDIA GPU (issue 46): run it
# from the repository's root there, `bash benchmarks/gpu-checks.sh [OUT]`, within 8 minutes
# (each part has a time limit of its own; PARTS="machine pods tests restart sizes" by default,
# `nccl` adds tests/test_gpu_nccl.py, 4 to 5 minutes more on one GPU).
#
# machine: what the machine has (nvidia-smi, torch's CUDA, NVML's count);
# pods:    a pod sees its chips, and only them: a one-pod job on a cluster of one node of one
#          chip runs with CUDA_VISIBLE_DEVICES naming GPU 0, torch sees exactly that GPU; a
#          cluster of more chips than the machine has GPUs is refused (exit 2) before anything
#          starts;
# tests:   tests/test_pod_gpus.py, tests/test_gpus.py (NVML on the real GPU, a warm spare that
#          starts CUDA on its pod's GPU);
# restart: where a GPU restart's time goes, cold, with warm spares and under torchrun
#          (benchmarks/gpu_restart_parts.py, one sample each);
# sizes:   process-level recovery at 4, 8 and 16 processes on the machine's cores
#          (benchmarks/sizes_flatness.py, one sample a cell; SIZES, SIZE_LEVELS and
#          SIZES_LIMIT_S choose others);
# nccl:    tests/test_gpu_nccl.py (the DDP example over NCCL through every level, bit-identical).
#
# The machine's own python3 runs it (with its CUDA torch): relaunch from src/, and the packages
# its image lacks from .whl/ where they were carried (pip download --no-deps --only-binary
# :all: --python-version 3.12 pydantic pydantic-core annotated-types typing-inspection msgspec
# py-spy fastapi starlette uvicorn).
set -u
out=${1:-${OUT:-/tmp/relaunch-gpu-checks}}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -3
fi
export PYTHONPATH="$root/src:$root${PYTHONPATH:+:$PYTHONPATH}"
began=$(date +%s)
say() { echo "[gpu-checks $(( $(date +%s) - began )) s] $*"; }

PARTS=${PARTS:-machine pods tests restart sizes}
wanted() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if wanted machine; then
  say "machine"
  nvidia-smi -L 2>&1 | head -8
  timeout 60 python3 - <<'PY' 2>&1 | tee "$out/machine.txt"
import os, torch
from relaunch.cluster.nvml import gpu_count
print(f"torch {torch.__version__}, CUDA available {torch.cuda.is_available()}, "
      f"{torch.cuda.device_count()} device(s); NVML counts {gpu_count()}; {os.cpu_count()} CPUs")
PY
fi

if wanted pods; then
  say "pods: a pod sees its chips, and only them"
  work=$(mktemp -d)
  cat > "$work/sees.py" <<'PY'
import os, torch
print(f"sees CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} "
      f"NVIDIA_VISIBLE_DEVICES={os.environ.get('NVIDIA_VISIBLE_DEVICES')!r} "
      f"devices={torch.cuda.device_count()} LOCAL_RANK={os.environ['LOCAL_RANK']}", flush=True)
torch.ones(1, device=f"cuda:{os.environ['LOCAL_RANK']}")
PY
  printf 'nodes: 1\nchips_per_node: 1\nheartbeat_interval_s: 0.2\nheartbeat_timeout_s: 1.0\n' > "$work/one-chip.yaml"
  timeout 90 python3 -m relaunch run --nnodes 1 --nproc-per-node 1 --max-restarts 0 \
    --cluster "$work/one-chip.yaml" --state-dir "$work/state" --report "$out/one-chip-report.json" \
    "$work/sees.py" > "$out/one-chip.txt" 2>&1
  echo "exit $?" >> "$out/one-chip.txt"
  grep -E "sees |chips are|exit " "$out/one-chip.txt"
  ngpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  timeout 60 python3 -m relaunch run --nnodes $((ngpus + 1)) --nproc-per-node 1 \
    --state-dir "$work/refused" "$work/sees.py" > "$out/refused.txt" 2>&1
  echo "exit $?" >> "$out/refused.txt"
  tail -4 "$out/refused.txt"
  rm -rf "$work"
fi

if wanted tests; then
  say "tests: pods' GPUs, NVML, a spare that starts CUDA"
  timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" --durations=8 -s \
    tests/test_pod_gpus.py tests/test_gpus.py > "$out/pytest.txt" 2>&1
  echo "pytest exit $?" >> "$out/pytest.txt"
  grep -E "warm spare's first tensor|passed|failed|skipped|error|exit" "$out/pytest.txt" | tail -8
fi

if wanted restart; then
  say "restart: where a GPU restart's time goes, cold, warm and under torchrun"
  timeout 240 python3 benchmarks/gpu_restart_parts.py --repeats 1 --out "$out/restart-parts.json" \
    > "$out/restart-parts.txt" 2>&1
  echo "exit $?" >> "$out/restart-parts.txt"
  tail -16 "$out/restart-parts.txt"
fi

if wanted sizes; then
  say "sizes: process-level recovery at 4, 8 and 16 processes"
  timeout "${SIZES_LIMIT_S:-180}" python3 benchmarks/sizes_flatness.py --sizes "${SIZES:-4,8,16}" \
    --step-seconds 0.1 --levels "${SIZE_LEVELS:-process-retry,process-in-place+spare}" \
    --repeats 1 --out "$out/sizes.json" \
    > "$out/sizes.txt" 2>&1
  echo "exit $?" >> "$out/sizes.txt"
  grep -E "^\[" "$out/sizes.txt" | tail -12
  grep -A4 growth "$out/sizes.txt"
fi

if wanted nccl; then
  say "nccl: the DDP example over NCCL through every level"
  timeout 390 python3 -m pytest -q -p no:cacheprovider -o addopts="" --durations=8 \
    tests/test_gpu_nccl.py > "$out/nccl.txt" 2>&1
  echo "pytest exit $?" >> "$out/nccl.txt"
  tail -12 "$out/nccl.txt"
fi
say "done"
