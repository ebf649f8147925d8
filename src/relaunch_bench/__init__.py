"""`relaunch bench`: recovery time by level side by side with torchrun, scale, controller
overhead, checkpoint throughput and restart reliability, all measured in one run on this machine.

Outside the core package: nothing in `relaunch` imports it except the `bench` command, lazily.
The training scripts it runs ship inside it (:mod:`relaunch_bench.jobs`), so it works from an
installed wheel as from the source tree.

Modules, in the order a run uses them: `suite` (which sections, the files written), `mttr`
(recovery time by level, hang detection), `scale`, `overhead`, `checkpoint`, `reliability`,
`torchrun` (the baseline), `jobs` (job specs and `relaunch run`), `timeline` (the DDP script's own
clock), `report` (bench.md and bench.png).
"""

from relaunch_bench.mttr import LEVELS
from relaunch_bench.series import SERIES_SYSTEMS
from relaunch_bench.suite import SECTIONS, BenchOptions, run_bench

__all__ = ["LEVELS", "SECTIONS", "SERIES_SYSTEMS", "BenchOptions", "run_bench"]
