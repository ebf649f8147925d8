"""The training SDK (importable without torch). This first part: the job's environment and the
progress report that feeds hang detection, MTTR and `at_step` fault triggers."""

from relaunch.train.progress import JobEnv, env, report_progress

__all__ = ["JobEnv", "env", "report_progress"]
