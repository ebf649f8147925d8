"""The launcher: one per pod, the pod's "container" (see launcher.supervisor)."""

from relaunch.launcher.supervisor import INJECT_DIR, Launcher

__all__ = ["INJECT_DIR", "Launcher"]
