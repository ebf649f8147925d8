"""relaunch keeps distributed training jobs alive through faults."""

from relaunch.errors import (
    FaultPlanError,
    FaultTableError,
    InputError,
    Problem,
    RelaunchError,
    SpecError,
    StoreError,
    StoreFull,
)

__version__ = "0.1.0"

__all__ = [
    "FaultPlanError",
    "FaultTableError",
    "InputError",
    "Problem",
    "RelaunchError",
    "SpecError",
    "StoreError",
    "StoreFull",
    "__version__",
]
