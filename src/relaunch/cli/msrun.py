"""msrun's form on the command line: `relaunch run --worker_num=4 --local_worker_num=2
script.py ARGS`, so that an msrun user changes one word. msrun's options before the script are
written as relaunch's torchrun form (pods of `--local_worker_num` workers, the job a MindSpore
job); those that mean nothing under relaunch are dropped with a note saying why, and those that
would change what runs (core binding, a dry run, a rank table) are refused, saying why.

Pure: a command line in, a command line and notes out."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MSRUN_OPTIONS", "MsrunForm", "from_msrun", "msrun_form"]

_WORKERS, _LOCAL = "--worker-num", "--local-worker-num"
_DEFAULT_WORKERS = 8
"""msrun's default for both --worker_num and --local_worker_num."""

_DROPPED = {
    "--master-addr": "relaunch runs MindSpore's scheduler beside rank 0, on pod 0's node, and "
    "gives every worker its address",
    "--master-port": "relaunch gives the scheduler a free port each attempt (a restarted "
    "cluster does not wait for the last one's port to be released)",
    "--node-rank": "relaunch gives every worker its rank (RANK_ID, MS_NODE_ID), as msrun does "
    "with --node_rank",
    "--log-dir": "each worker's output is kept by relaunch (`relaunch logs JOB`), the "
    "scheduler's in pod 0's scheduler.log",
    "--join": "relaunch always waits for the job and ends every process with it (--join=True)",
    "--worker-log-name": "each worker's output is kept by relaunch (`relaunch logs JOB`)",
    "--tail-worker-log": "relaunch shows every worker's output (`relaunch logs JOB`)",
}
"""msrun's options that mean nothing under relaunch -> why (a note; the run goes on)."""

_REFUSED = {
    "--bind-core": "relaunch does not pin cores: each pod is a cgroup of its own, its "
    "processes share the node's cores (run under msrun to bind them)",
    "--bind-numa": "relaunch does not pin NUMA nodes (run under msrun to bind them)",
    "--sim-level": "a dry run (simulation) forms no cluster and trains nothing: run it under "
    "msrun, there is nothing to recover",
    "--sim-rank-id": "a dry run (simulation) forms no cluster and trains nothing: run it "
    "under msrun, there is nothing to recover",
    "--rank-table-file": "relaunch forms MindSpore's cluster through its scheduler (dynamic "
    "networking), as msrun does without a rank table",
}
"""msrun's options that would change what runs, and relaunch cannot honour -> why (refused)."""

MSRUN_OPTIONS = frozenset({_WORKERS, _LOCAL, "--cluster-time-out", *_DROPPED, *_REFUSED})
"""msrun's options (as `dashed` writes them): any of them says the command line is msrun's."""


@dataclass(frozen=True)
class MsrunForm:
    """An msrun command line as relaunch's torchrun form, or why it cannot be."""

    args: list[str]
    notes: list[str]
    problem: str | None = None


def _msrun_name(name: str) -> str:
    """An option as msrun spells it (`--worker_num`)."""
    return "--" + name[2:].replace("-", "_")


def msrun_form(args: list[str]) -> bool:
    """Whether the command line (dashed) uses msrun's options, before its script."""
    for arg in args:
        if arg == "--" or (not arg.startswith("-") and arg.endswith(".py")):
            return False
        if arg.split("=", 1)[0] in MSRUN_OPTIONS:
            return True
    return False


def _split(args: list[str], script: int) -> tuple[dict[str, str], list[str]]:
    """msrun's options before `script` (each with its value, `--opt=V` or `--opt V`) and the
    rest of the command line before the script, in order."""
    found: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < script:
        name, sep, value = args[i].partition("=")
        if name in MSRUN_OPTIONS:
            if not sep and i + 1 < script:
                value, i = args[i + 1], i + 1
            found[name] = value
        else:
            rest.append(args[i])
        i += 1
    return found, rest


def from_msrun(args: list[str], script: int) -> MsrunForm:
    """msrun's command line (`args`, dashed; the script at index `script`) as relaunch's
    torchrun form: --nnodes W/L --nproc-per-node L, the job's framework MindSpore, the cluster's
    time-out as MS_TOPO_TIMEOUT."""
    found, rest = _split(args, script)
    refused = [f"{_msrun_name(name)}: {why}" for name, why in _REFUSED.items() if name in found]
    if refused:
        return MsrunForm(args, [], "; ".join(refused))
    try:
        workers = int(found.get(_WORKERS, _DEFAULT_WORKERS))
        local = int(found.get(_LOCAL, _DEFAULT_WORKERS))
        timeout = int(found["--cluster-time-out"]) if "--cluster-time-out" in found else None
    except ValueError as error:
        why = f"--worker_num, --local_worker_num and --cluster_time_out are numbers: {error}"
        return MsrunForm(args, [], why)
    if workers < 1 or local < 1 or workers % local:
        return MsrunForm(
            args,
            [],
            f"--worker_num {workers} is not a whole number of nodes of --local_worker_num "
            f"{local}: relaunch's pods each run the same number of workers",
        )
    mapped = [
        f"--nnodes={workers // local}",
        f"--nproc-per-node={local}",
        "--label=framework=mindspore",
    ]
    if timeout is not None:
        mapped.append(f"--env=MS_TOPO_TIMEOUT={timeout}")
    notes = [
        f"msrun's {_msrun_name(name)} is not used: {why}"
        for name, why in _DROPPED.items()
        if name in found
    ]
    return MsrunForm([*rest, *mapped, *args[script:]], notes)
