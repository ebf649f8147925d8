"""Kubernetes for relaunch: a real control plane for the tests and for users to try
(`controlplane`, `trial`), its certificates (`pki`), and the manifests relaunch's controller
needs on any cluster (`manifests/`). The control plane's binaries are built from the Go module
proxy by `make k8s` (k8s/ holds the wrapper modules); :func:`binaries` finds them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from relaunch.errors import EngineError

__all__ = ["BINARIES", "MANIFESTS", "binaries"]

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
MANIFESTS = Path(__file__).parent / "manifests"
BIN_ENV = "RELAUNCH_KUBERNETES_BIN"
_BUILT = Path(__file__).resolve().parents[4] / "build" / "k8s" / "bin"
"""Where `make k8s` puts them, in a checkout."""


def binaries() -> Path:
    """The folder holding every control-plane binary: $RELAUNCH_KUBERNETES_BIN, the checkout's
    build/k8s/bin, or the folder of a kube-apiserver on PATH; EngineError saying how to get
    them where none has all."""
    on_path = shutil.which("kube-apiserver")
    candidates = [os.environ.get(BIN_ENV), str(_BUILT), on_path and str(Path(on_path).parent)]
    for folder in filter(None, candidates):
        if all((Path(folder) / name).is_file() for name in BINARIES):
            return Path(folder)
    raise EngineError(
        "no Kubernetes control plane here (etcd, kube-apiserver, kube-controller-manager, "
        f"kube-scheduler, kubectl): `make k8s` builds them into {_BUILT}, or set {BIN_ENV}"
    )
