"""torchrun's form on the command line: `relaunch run --nnodes N --nproc-per-node M script.py
ARGS` (and `relaunch validate` in the same form). Everything after the script is the script's,
as under torchrun; before it, relaunch's and torchrun's options mix freely."""

from __future__ import annotations

import importlib.machinery
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from relaunch.cli.msrun import from_msrun, msrun_form
from relaunch.cluster.nvml import gpu_count
from relaunch.errors import Problem, SpecError
from relaunch.spec import parse_job
from relaunch.spec.launch import Launch, Machine, launch_job, nproc_of, option_problems

__all__ = [
    "LaunchOptions",
    "TorchrunForm",
    "launch_document",
]

_MODULE_OPTIONS = frozenset({"-m", "--module"})
_TORCHRUN_OPTIONS = frozenset(
    {"--nnodes", "--nproc-per-node", "--nproc_per_node", "--standalone", *_MODULE_OPTIONS}
)
"""Options that say the command line is in torchrun's form. Every option of more than one word
is taken in torchrun's two spellings, `--max-restarts` and `--max_restarts`: the second is
written as the first before the command line is parsed (`dashed`), so that `--help` lists
one name an option."""
_JOB_FILE_SUFFIXES = (".yaml", ".yml", ".json")


def torchrun_form(args: list[str]) -> bool:
    """A command line in torchrun's form: a torchrun option, or a `.py` script where the job file
    goes, before anything else positional."""
    for arg in args:
        if arg == "--":
            return False
        if arg.startswith("-"):
            if arg.split("=", 1)[0] in _TORCHRUN_OPTIONS:
                return True
        elif arg.endswith(".py"):
            return True
    return False


class TorchrunForm(TyperCommand):
    """A command whose first positional is a job file, or, in torchrun's form, a script whose
    arguments follow it unparsed (an `--epochs 3` or a `--report` after the script is the
    script's)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        """`ctx` is click's Context: typer's own copy of click since typer 0.2x, click itself
        before; not named, so that both work."""
        flags = frozenset(
            name
            for param in self.params
            if getattr(param, "is_flag", False)
            for name in (*param.opts, *param.secondary_opts)
        )
        args = dashed(args, flags)
        if msrun_form(args):
            args = _msrun_as_torchrun(args, flags)
        if torchrun_form(args):
            args = _defaults_dropped(args, flags)
            ctx.allow_interspersed_args = False
            ctx.allow_extra_args = True
        return super().parse_args(ctx, args)


def _msrun_as_torchrun(args: list[str], flags: frozenset[str]) -> list[str]:
    """msrun's form written as torchrun's, its notes said; BadParameter for what it refuses."""
    written = from_msrun(args, _script_at(args, flags | frozenset(DEFAULT_SWITCHES)))
    if written.problem is not None:
        raise typer.BadParameter(f"msrun's form: {written.problem}")
    for note in written.notes:
        typer.echo(f"note: {note}", err=True)
    return written.args


DEFAULT_SWITCHES = {
    "--unconditional-retry": "--environment-faults-only",
    "--hang-retry": "--no-hang-retry",
}
"""torchrun's form's switches whose default is on -> the option that turns it off. `--help`
lists only the latter; the default's own name is taken (a torchrun user may say it) and dropped
before parsing, and the two together are refused."""


def _defaults_dropped(args: list[str], flags: frozenset[str]) -> list[str]:
    """The command line without the switches that say a default (DEFAULT_SWITCHES), up to the
    script; BadParameter where one is given with its opposite."""
    script = _script_at(args, flags | frozenset(DEFAULT_SWITCHES))
    ours, theirs = args[:script], args[script:]
    for on, off in DEFAULT_SWITCHES.items():
        if on in ours and off in ours:
            raise typer.BadParameter(f"{on} and {off} say opposite things: give one")
    return [a for a in ours if a not in DEFAULT_SWITCHES] + theirs


def dashed(args: list[str], flags: frozenset[str] = frozenset()) -> list[str]:
    """torchrun's underscore spellings (`--nproc_per_node=4`) written with dashes, up to the
    script: what follows it is the script's, untouched. `flags`: the options that take no
    value, to find a module's name after `-m`."""
    script = _script_at([_dashed(arg) for arg in args], flags | frozenset(DEFAULT_SWITCHES))
    return [_dashed(arg) for arg in args[:script]] + args[script:]


def _dashed(arg: str) -> str:
    if not arg.startswith("--") or "_" not in arg.split("=", 1)[0]:
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


def _script_at(args: list[str], flags: frozenset[str]) -> int:
    """Where the script (a `.py` file, or what follows `--`) begins: relaunch's options are
    before it, the script's after. With torchrun's `-m` before it, the module is the first
    word that no option takes as its value (`flags`: the options that take none), as
    torchrun's parser reads it."""
    module, i = False, 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return i
        if arg.startswith("-") and arg != "-":
            name = arg.split("=", 1)[0]
            takes_value = "=" not in arg and name not in flags and name not in _MODULE_OPTIONS
            module = module or name in _MODULE_OPTIONS
            i += 2 if module and takes_value else 1
            continue
        if module or arg.endswith(".py"):
            return i
        i += 1
    return len(args)


TORCHRUN_PANEL = "torchrun's form (a script instead of a job file)"
"""Where `relaunch run --help` lists the options of torchrun's form: a table of their own, so
that their long names do not narrow every other option's description."""

NnodesOption = Annotated[
    str | None,
    typer.Option(
        "--nnodes",
        rich_help_panel=TORCHRUN_PANEL,
        help="Pods (nodes) of the job.",
        show_default=False,
    ),
]
NprocOption = Annotated[
    str | None,
    typer.Option(
        "--nproc-per-node",
        rich_help_panel=TORCHRUN_PANEL,
        help="Processes (ranks) per pod: a number, or torchrun's gpu (one per GPU), cpu (one "
        "per CPU) or auto (gpu where there are GPUs, else cpu).",
    ),
]
ModuleOption = Annotated[
    bool,
    typer.Option(
        "--module",
        "-m",
        rich_help_panel=TORCHRUN_PANEL,
        help="The script is a module, run as `python -m MODULE` (torchrun's -m).",
    ),
]
StandaloneOption = Annotated[
    bool,
    typer.Option(
        "--standalone", rich_help_panel=TORCHRUN_PANEL, help="One node (torchrun's meaning)."
    ),
]
MaxRestartsOption = Annotated[
    int | None,
    typer.Option(
        "--max-restarts",
        rich_help_panel=TORCHRUN_PANEL,
        help="Job-level restarts, 0 for none (the job-retry-num annotation). Default 3.",
    ),
]
MonitorOption = Annotated[
    float | None,
    typer.Option(
        "--monitor-interval",
        rich_help_panel=TORCHRUN_PANEL,
        help="Seconds between process checks.",
    ),
]
NameOption = Annotated[
    str | None,
    typer.Option(
        "--name", rich_help_panel=TORCHRUN_PANEL, help="The job's name (default: the script's)."
    ),
]
PodRetryOption = Annotated[
    int | None,
    typer.Option(
        "--pod-retry-num",
        rich_help_panel=TORCHRUN_PANEL,
        help="Pod-level reschedules (the pod-retry-num annotation).",
    ),
]
EnvironmentOnlyOption = Annotated[
    bool,
    typer.Option(
        "--environment-faults-only",
        rich_help_panel=TORCHRUN_PANEL,
        help="Restart only on environment faults (R-02), not on any failure as torchrun does "
        "(the job-unconditional-retry annotation off).",
    ),
]
NoHangRetryOption = Annotated[
    bool,
    typer.Option(
        "--no-hang-retry",
        rich_help_panel=TORCHRUN_PANEL,
        help="Fail a hung job rather than restart it (the hang-retry annotation off).",
    ),
]
HangSecondsOption = Annotated[
    float | None,
    typer.Option(
        "--hang-detect-seconds",
        rich_help_panel=TORCHRUN_PANEL,
        help="Silence that makes a hang.",
    ),
]
WarmSparesOption = Annotated[
    int | None,
    typer.Option(
        "--warm-spares",
        rich_help_panel=TORCHRUN_PANEL,
        help="Warm spare processes per pod.",
    ),
]
AnnotationOption = Annotated[
    list[str] | None,
    typer.Option(
        "--annotation",
        rich_help_panel=TORCHRUN_PANEL,
        help="A job annotation, KEY=VALUE (repeatable).",
    ),
]
LabelOption = Annotated[
    list[str] | None,
    typer.Option(
        "--label", rich_help_panel=TORCHRUN_PANEL, help="A job label, KEY=VALUE (repeatable)."
    ),
]
EnvOption = Annotated[
    list[str] | None,
    typer.Option(
        "--env",
        rich_help_panel=TORCHRUN_PANEL,
        help="A variable for every rank, KEY=VALUE (repeatable).",
    ),
]


@dataclass(frozen=True)
class LaunchOptions:
    """The torchrun form's options as the command received them: None where not given."""

    nnodes: str | None = None
    nproc_per_node: str | None = None
    module: bool = False
    standalone: bool = False
    max_restarts: int | None = None
    monitor_interval: float | None = None
    name: str | None = None
    pod_retry_num: int | None = None
    environment_faults_only: bool = False
    no_hang_retry: bool = False
    hang_detect_seconds: float | None = None
    warm_spares: int | None = None
    annotation: list[str] | None = None
    label: list[str] | None = None
    env: list[str] | None = None

    @classmethod
    def of(cls, ctx: typer.Context) -> LaunchOptions:
        """The options as the command received them (its parameters of these names; a
        repeatable option given no times is None, as typer passes it)."""
        values = {f.name: ctx.params.get(f.name, f.default) for f in fields(cls)}
        for name, value in values.items():
            if isinstance(value, tuple | list):
                values[name] = list(value) or None
        return cls(**values)

    def given(self) -> list[str]:
        """The options given, as typed (`--max-restarts`), for the job file form's error."""
        return [
            "--" + f.name.replace("_", "-")
            for f in fields(self)
            if getattr(self, f.name) not in (None, False, [])
        ]


def launch_document(
    ctx: typer.Context, first: Path | None, options: LaunchOptions
) -> tuple[dict[str, Any], str] | None:
    """In torchrun's form, the job mapping its options and script make and the source its
    errors name; None for the job file form. Raises SpecError naming the options: the job file
    form given torchrun options, a script that is not there, any option's bad value."""
    if ctx.allow_interspersed_args:  # TorchrunForm.parse_args found the job file form
        if options.given():
            raise SpecError(
                "relaunch run",
                [
                    Problem(
                        ", ".join(options.given()),
                        str(first),
                        "these options in torchrun's form (`relaunch run --nnodes N "
                        "--nproc-per-node M script.py ARGS`); a job file says them in its "
                        "annotations, labels and spec",
                    )
                ],
            )
        return None
    source = f"relaunch {ctx.info_name} (torchrun form)"
    problems = _script_problems(first, options)  # reported with the options' own, at once
    procs = nproc_of(options.nproc_per_node or "1", this_machine())
    if procs.problem is not None:
        problems.append(procs.problem)
    launch = Launch(
        script=str(first) if first is not None else "",
        args=tuple(ctx.args),
        nnodes=options.nnodes or "1",
        nproc_per_node=procs.procs,
        chips_per_pod=procs.chips,
        module=options.module,
        name=options.name,
        **({} if options.max_restarts is None else {"max_restarts": options.max_restarts}),
        pod_retry_num=options.pod_retry_num,
        hang_retry=not options.no_hang_retry,
        unconditional_retry=not options.environment_faults_only,
        hang_detect_seconds=options.hang_detect_seconds,
        monitor_interval=options.monitor_interval,
        warm_spares=options.warm_spares,
        annotations=tuple(options.annotation or ()),
        labels=tuple(options.label or ()),
        env=tuple(options.env or ()),
    )
    raw, shaping = launch_job(launch)
    problems.extend(shaping)
    try:
        parse_job(raw, source=source)
    except SpecError as error:
        problems.extend(option_problems(error.problems))
    if problems:
        raise SpecError(source, problems)
    return raw, source


def this_machine() -> Machine:
    """The GPUs and CPUs `--nproc-per-node auto|gpu|cpu` counts here, as torchrun counts them:
    the GPUs a process sees (NVML's, or as many as CUDA_VISIBLE_DEVICES names where it is set)
    and the CPUs this process may run on."""
    gpus = gpu_count() or 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # CUDA stops at the first entry it cannot use ("", "-1")
        named = 0
        for device in visible.split(","):
            if not device.strip() or device.strip() == "-1":
                break
            named += 1
        gpus = min(gpus, named)
    return Machine(gpus=gpus, cpus=len(os.sched_getaffinity(0)))


def _script_problems(first: Path | None, options: LaunchOptions) -> list[Problem]:
    problems: list[Problem] = []
    if options.standalone and options.nnodes not in (None, "1"):
        problems.append(Problem("--standalone", options.nnodes, "one node: drop --nnodes"))
    if first is None:
        problems.append(Problem("SCRIPT", "", "the training script after the options"))
    elif options.module:
        if not _importable(str(first)):
            problems.append(
                Problem(
                    "MODULE",
                    str(first),
                    "a module `python -m` finds from this directory (its top-level package on "
                    "sys.path or here)",
                )
            )
    elif first.suffix in _JOB_FILE_SUFFIXES:
        problems.append(
            Problem(
                "SCRIPT",
                str(first),
                "a training script; a job file takes no --nnodes / --nproc-per-node (its spec "
                "says replicas and procs_per_pod)",
            )
        )
    elif not first.is_file():
        problems.append(Problem("SCRIPT", str(first), "a training script that exists"))
    return problems


def _importable(module: str) -> bool:
    """Whether `python -m MODULE` run here finds MODULE's top-level package (its ranks run in
    this directory, which `-m` puts first on their path); found, not imported: nothing of it
    runs here."""
    top = module.split(".", 1)[0]
    if not top.isidentifier() or not all(part.isidentifier() for part in module.split(".")):
        return False
    return importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is not None
