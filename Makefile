# The two commands of the README: `make run` and `make test`. Both build .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint typecheck docs unit clean peers gpu-checks k8s

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "error: relaunch needs Python 3.11+; '$(PYTHON)' is missing or older. Run 'make PYTHON=/path/to/python3.11 ...'"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

# Sets up and runs the demo: the toy job on the embedded cluster, hit by a crash, a chip fault
# and a lost node, recovering from each. Each demo starts on a fresh cluster (the last one
# isolated a node); its state stays in .relaunch/ (`.venv/bin/relaunch describe toy --state-dir .relaunch`).
run: $(STAMP)
	rm -rf .relaunch
	$(BIN)/relaunch run examples/toy-job.yaml --cluster examples/cluster-small.yaml \
	  --faults examples/toy-faults.yaml --state-dir .relaunch --report .relaunch/toy-report.json

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

typecheck: $(STAMP)
	$(BIN)/mypy

# The dashboard's browser test drives Debian's Chromium (headless); installed here when missing.
CHROMIUM := /usr/bin/chromium
SUDO     := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
$(CHROMIUM):
	@command -v apt-get >/dev/null || { echo "error: the dashboard test needs Chromium at $(CHROMIUM) (Debian's package 'chromium')"; exit 1; }
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium >/dev/null

# The Slurm engine's tests start a real Slurm cluster of Debian's daemons (tests/test_slurm.py,
# relaunch.cluster.slurm_trial): installed here when missing, where this is root with apt (the
# tests need root anyway, and say so when they skip).
SLURMD := /usr/sbin/slurmd
.PHONY: slurm
slurm: $(SLURMD)
$(SLURMD):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends slurmd slurmctld slurm-client munge >/dev/null; \
	else echo "note: not root with apt: the Slurm tests will skip (they need Debian's slurmd, slurmctld, slurm-client, munge)"; fi

# The Kubernetes engine's control plane (relaunch.cluster.kubernetes): kube-apiserver,
# kube-controller-manager, kube-scheduler and kubectl of the version k8s/control-plane/go.mod
# pins, and etcd, built from the Go module proxy by the wrapper modules in k8s/ (no server
# binary is packaged on PyPI, npm or Debian). Built once into build/k8s/bin; again only when a
# pinned version changes. Without Go, a note: the Kubernetes tests then skip, saying so.
K8S_VERSION := $(shell awk '$$1 == "k8s.io/kubernetes" && $$2 ~ /^v/ {print $$2; exit}' k8s/control-plane/go.mod)
K8S_BIN     := build/k8s/bin
K8S_STAMP   := $(K8S_BIN)/.built
K8S_LDFLAGS := -s -w -X k8s.io/component-base/version.gitVersion=$(K8S_VERSION) \
  -X k8s.io/component-base/version.gitMajor=$(word 2,$(subst ., ,$(K8S_VERSION:v%=x.%))) \
  -X k8s.io/component-base/version.gitMinor=$(word 3,$(subst ., ,$(K8S_VERSION:v%=x.%)))
k8s: $(K8S_STAMP)
$(K8S_STAMP): k8s/control-plane/go.mod k8s/control-plane/go.sum k8s/etcd/go.mod k8s/etcd/go.sum k8s/etcd/main.go
	@if ! command -v go >/dev/null; then \
	  echo "note: no Go here: the Kubernetes tests will skip (they need the control plane built from Go modules)"; \
	else \
	  echo "building Kubernetes $(K8S_VERSION)'s control plane and etcd from the Go module proxy into $(K8S_BIN) (once: about 9 minutes on 2 cores)"; \
	  mkdir -p $(K8S_BIN) && \
	  (cd k8s/control-plane && CGO_ENABLED=0 go build -trimpath -ldflags "$(K8S_LDFLAGS)" -o ../../$(K8S_BIN)/ \
	    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
	    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl) && \
	  (cd k8s/etcd && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o ../../$(K8S_BIN)/etcd .) && \
	  $(K8S_BIN)/kube-apiserver --version && touch $@; \
	fi

# The peer-memory benchmark's shared storage is a file server on a node of its own (OpenSSH's
# sshd, read through sshfs: relaunch_bench.file_server); tests/test_bench.py measures it as root.
# Installed here when missing, where this is root with apt.
SSHFS := /usr/bin/sshfs
.PHONY: shared-storage
shared-storage: $(SSHFS)
$(SSHFS):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends openssh-server sshfs >/dev/null; \
	else echo "note: not root with apt: the peer-memory benchmark measures no shared storage (it needs Debian's openssh-server, sshfs)"; fi

# MindSpore's own venv (tests/test_mindspore.py): its wheel is built against numpy 1.x and pins
# what torch's stack does not, so it lives apart, as a MindSpore user's would, with relaunch
# installed into it (relaunch's core needs no torch). About 800 MB, once.
MINDSPORE := .mindspore
MINDSPORE_STAMP := $(MINDSPORE)/.installed
.PHONY: mindspore
mindspore: $(MINDSPORE_STAMP)
$(MINDSPORE_STAMP): pyproject.toml
	$(PYTHON) -m venv $(MINDSPORE)
	$(MINDSPORE)/bin/python -m pip install --quiet mindspore==2.10.0 'numpy<2' -e .
	@touch $@

# Two workers, a test file to each at a time (a file's module fixtures, such as its fault-free
# baseline, run once); every test's duration is kept in build/test-report/durations.txt.
# `pytest -m "not real"` runs the tier that starts no real run, cluster or server.
unit: $(STAMP) $(CHROMIUM) $(SLURMD) $(SSHFS) $(K8S_STAMP) $(MINDSPORE_STAMP)
	@# relaunch's own bytecode, ahead: where PYTHONDONTWRITEBYTECODE is set, each of the
	@# suite's thousands of processes (agents, launchers, controllers) compiled it again
	$(BIN)/python -m compileall -q -j 0 src
	$(BIN)/pytest -q -n 2 --dist loadfile

# The manual (docs/): a Sphinx site, every warning an error (a broken link, a page no table of
# contents holds); its CLI reference is written from the commands at each build.
docs: $(STAMP)
	$(BIN)/sphinx-build -W --keep-going -q -b html docs build/docs
	@echo "the manual: build/docs/index.html"

# Sets up and runs everything CI runs: lint, types, the manual, tests.
test: lint typecheck docs unit

# The specialists `relaunch bench --only peers` measures beside relaunch, each in a virtual
# environment of its own under .peers/ (their pins conflict), with the torch CPU wheel.
PEERS := .peers
TORCH := torch==2.13.0
peers: $(PEERS)/torchft/.installed $(PEERS)/nvrx/.installed $(PEERS)/dlrover/.installed

$(PEERS)/torchft/.installed:
	$(PYTHON) -m venv $(PEERS)/torchft
	$(PEERS)/torchft/bin/python -m pip install --quiet $(TORCH) numpy torchft==0.2.0
	@touch $@

# 0.4.1: the newest release whose wheel runs on glibc 2.36 (0.5 and later need 2.39)
$(PEERS)/nvrx/.installed:
	$(PYTHON) -m venv $(PEERS)/nvrx
	$(PEERS)/nvrx/bin/python -m pip install --quiet $(TORCH) numpy nvidia-resiliency-ext==0.4.1
	@touch $@

# DLRover 0.6.1 calls torch's SubprocessHandler without the numa_options argument torch 2.13
# added: `dlrover-run --standalone` fails at start until its one call passes None for it.
$(PEERS)/dlrover/.installed:
	$(PYTHON) -m venv $(PEERS)/dlrover
	$(PEERS)/dlrover/bin/python -m pip install --quiet $(TORCH) numpy 'dlrover[k8s,torch]==0.6.1' 'protobuf<5'
	sed -i 's/SubprocessHandler(cmd, args, {}, "", "", 0)$$/SubprocessHandler(cmd, args, {}, "", "", 0, None)/' \
	  $(PEERS)/dlrover/lib/python3.*/site-packages/dlrover/trainer/torch/elastic_run.py
	grep -q '"", 0, None)' $(PEERS)/dlrover/lib/python3.*/site-packages/dlrover/trainer/torch/elastic_run.py
	@touch $@

# The GPU checks in one run (at most 8 minutes), on a machine with an NVIDIA GPU and its own
# CUDA torch: the pods' own GPUs, the NVML readings, the DDP example over NCCL (issue 46).
gpu-checks:
	bash benchmarks/gpu-checks.sh

clean:
	rm -rf $(VENV) $(PEERS) .relaunch .pytest_cache .mypy_cache .ruff_cache build/docs
