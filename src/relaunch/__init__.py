"""relaunch keeps distributed training jobs alive through faults."""

from relaunch.errors import FaultTableError, InputError, Problem, RelaunchError, SpecError

__version__ = "0.1.0"

__all__ = ["FaultTableError", "InputError", "Problem", "RelaunchError", "SpecError", "__version__"]
