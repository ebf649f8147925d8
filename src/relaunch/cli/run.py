"""`relaunch run`: a job run in the foreground, on the embedded cluster, Ray, Slurm or agents."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from relaunch import engines, runner, service
from relaunch.cli.common import (
    EXIT_INVALID,
    AddressOption,
    FaultTableOption,
    KubeconfigOption,
    NamespaceOption,
    RaySelectOption,
    StateDirOption,
    app,
    err,
    exit_code,
    fail_input,
    out,
    say_error,
    state_dir_of,
    visible,
)
from relaunch.cli.engines import SimulateChipsOption, engine_kind, say, stop_trial
from relaunch.cli.launch import (
    AnnotationOption,
    EnvironmentOnlyOption,
    EnvOption,
    HangSecondsOption,
    LabelOption,
    LaunchOptions,
    MaxRestartsOption,
    ModuleOption,
    MonitorOption,
    NameOption,
    NnodesOption,
    NoHangRetryOption,
    NprocOption,
    PodRetryOption,
    StandaloneOption,
    TorchrunForm,
    WarmSparesOption,
    launch_document,
)
from relaunch.cli.resume import unfinished
from relaunch.cli.summary import print_summary
from relaunch.cluster.nvml import SIMULATE_CHIPS_ENV
from relaunch.controller import Controller, RunOptions
from relaunch.errors import MISSING, InputError, Problem, RelaunchError, StateDirBusy
from relaunch.events import Event
from relaunch.files import read_document
from relaunch.protocol.layout import StateDir
from relaunch.report import build_report
from relaunch.spec import parse_job
from relaunch.store import JobRow, JobStatus, Store

JobFileArgument = Annotated[
    Path | None,
    typer.Argument(
        help="Job spec, YAML or JSON; or, in torchrun's form, the training script, followed by "
        "its arguments.",
        metavar="JOB_FILE | SCRIPT [ARGS]...",
    ),
]
ClusterOption = Annotated[
    Path | None, typer.Option("--cluster", help="Cluster file (nodes, chips, timings).")
]
FaultsOption = Annotated[Path | None, typer.Option("--faults", help="Fault plan to inject.")]
ReportOption = Annotated[
    Path | None, typer.Option("--report", help="Write a JSON report here at the end.")
]
ResumeOption = Annotated[
    bool, typer.Option("--resume", help="Re-adopt the unfinished job of the state directory.")
]
StartupOption = Annotated[
    float | None,
    typer.Option(
        "--startup-seconds", help="Allowance before a (re)started job must show progress."
    ),
]
NodesOption = Annotated[
    int | None,
    typer.Option(
        "--nodes", help="Number of nodes (node-0, node-1, ...), instead of a cluster file."
    ),
]
ChipsOption = Annotated[
    int | None, typer.Option("--chips-per-node", help="Chips per node, with --nodes.")
]
QuietOption = Annotated[
    bool, typer.Option("--quiet", "-q", help="Do not echo the processes' output.")
]
EngineOption = Annotated[
    str,
    typer.Option(
        "--engine",
        help="embedded: the embedded cluster; ray: a Ray cluster (--address, or a local "
        "trial cluster shaped by --cluster); slurm: the Slurm allocation this runs in "
        "(sbatch, salloc: docs/slurm.md); agents: node agents started by hand (`relaunch "
        "agent`) that dial --address; kubernetes: a Kubernetes cluster (--kubeconfig, "
        "docs/kubernetes.md).",
    ),
]


@app.command(cls=TorchrunForm)
def run(
    ctx: typer.Context,
    job_file: JobFileArgument = None,
    cluster_file: ClusterOption = None,
    faults_file: FaultsOption = None,
    report: ReportOption = None,
    state_dir: StateDirOption = None,
    fault_table: FaultTableOption = None,
    resume: ResumeOption = False,
    startup_s: StartupOption = None,
    nodes_count: NodesOption = None,
    chips_per_node: ChipsOption = None,
    quiet: QuietOption = False,
    simulate_chips: SimulateChipsOption = False,
    engine: EngineOption = "embedded",
    address: AddressOption = None,
    ray_select: RaySelectOption = None,
    kubeconfig: KubeconfigOption = None,
    namespace: NamespaceOption = None,
    nnodes: NnodesOption = None,
    nproc_per_node: NprocOption = None,
    module: ModuleOption = False,
    standalone: StandaloneOption = False,
    max_restarts: MaxRestartsOption = None,
    monitor_interval: MonitorOption = None,
    name: NameOption = None,
    pod_retry_num: PodRetryOption = None,
    environment_faults_only: EnvironmentOnlyOption = False,
    no_hang_retry: NoHangRetryOption = False,
    hang_detect_seconds: HangSecondsOption = None,
    warm_spares: WarmSparesOption = None,
    annotation: AnnotationOption = None,
    label: LabelOption = None,
    env: EnvOption = None,
) -> None:
    """Run a job to its end (exit 0 / 1; 2 for bad input) on the embedded cluster, Ray, Slurm,
    Kubernetes or agents (--engine), from a job file or as torchrun (or msrun) runs a script:
    `relaunch run --nnodes 2 train.py --epochs 3`, or `-m pkg.train` (the rest is theirs)."""
    kind = _engine_checked(engine, address, ray_select, simulate_chips)
    where = engines.Where(address, ray_select, cluster_file, kubeconfig, namespace)
    held = _lock(directory := state_dir_of(state_dir))
    try:
        table, rules = service.table_from(fault_table)
        store = Store(StateDir(directory).db)
        document = launch_document(ctx, job_file, LaunchOptions.of(ctx))
        if resume:
            job_id, trial = unfinished(store, job_file, document).id, None
        else:
            request = _NewRun(job_file, cluster_file, faults_file, fault_table, startup_s, document)
            raw = _cluster_settings(cluster_file, nodes_count, chips_per_node)
            job_id, trial = _submit(store, directory, request, raw, kind, where)
    except RelaunchError as error:
        raise _refused(error, held) from None
    options = _options(store, job_id, resume, startup_s, table, rules)
    try:
        status = _execute(store, directory, job_id, resume, options, quiet, trial)
    finally:
        held.close()
        stop_trial(trial)
    raise typer.Exit(_finished(store, directory, job_id, status, report))


def _engine_checked(
    engine: str, address: str | None, ray_select: str | None, simulate_chips: bool
) -> engines.EngineKind:
    """The engine; --address only where it takes one (Ray, agents), --ray-select only with Ray
    (exit 2 otherwise)."""
    kind = engine_kind(engine)
    if (address and not kind.takes_address) or (ray_select and not kind.takes_select):
        every = [engines.kind(name) for name in engines.names()]
        takes = " or ".join(k.name for k in every if k.takes_address)
        selects = " or ".join(k.name for k in every if k.takes_select)
        err.print(f"[bold red]error:[/] --address needs --engine {takes}, --ray-select {selects}")
        raise typer.Exit(EXIT_INVALID)
    if simulate_chips:  # the engine and the agents it starts read it
        os.environ[SIMULATE_CHIPS_ENV] = "1"
    return kind


def _lock(directory: Path) -> Any:
    """The state directory held for this foreground run (exit 2 if another holds it)."""
    try:
        return runner.lock(directory)
    except StateDirBusy as error:
        say_error(error)
        raise typer.Exit(EXIT_INVALID) from None


def _options(
    store: Store, job_id: int, resume: bool, startup_s: float | None, table: Any, rules: Any
) -> RunOptions:
    """The run's options; a stopped job resumed is reopened first (resumable again)."""
    ended = store.reopen_to_resume(job_id, time.time()) if resume else None
    return RunOptions(startup_s=startup_s, table=table, rules=rules, resumed_from=ended)


def _refused(error: RelaunchError, held: Any) -> typer.Exit:
    """A job that cannot run: every problem of bad input, or the one error (exit 2); the state
    directory's lock let go."""
    held.close()
    if isinstance(error, InputError):
        return fail_input(error)
    say_error(error)
    return typer.Exit(EXIT_INVALID)


def _finished(
    store: Store, directory: Path, job_id: int, status: JobStatus, report: Path | None
) -> int:
    """The job's summary printed (and written to `report`), queued jobs started; its exit code."""
    summary = build_report(store, job_id)
    print_summary(summary)
    if report is not None:
        report.write_text(json.dumps(summary, indent=2))
    _start_queued(directory)
    return exit_code(status, store.job(job_id).stop_cause)


@dataclass(frozen=True)
class _NewRun:
    job_file: Path | None
    cluster_file: Path | None
    faults_file: Path | None
    fault_table: Path | None
    startup_s: float | None
    document: tuple[dict[str, Any], str] | None
    """The job torchrun's form made, and the source its errors name; None: the job file."""


def _cluster_settings(
    cluster_file: Path | None, nodes_count: int | None, chips_per_node: int | None
) -> Any:
    cluster_raw = read_document(cluster_file) if cluster_file else None
    if nodes_count is not None or chips_per_node is not None:
        cluster_raw = dict(cluster_raw or {})
        if nodes_count is not None:
            cluster_raw["nodes"] = nodes_count
        if chips_per_node is not None:
            cluster_raw["chips_per_node"] = chips_per_node
    return cluster_raw


def _submit(
    store: Store,
    directory: Path,
    request: _NewRun,
    cluster_raw: Any,
    kind: engines.EngineKind,
    where: engines.Where,
) -> tuple[int, Any]:
    """The job checked fully and stored, before anything starts; an unfinished earlier job is
    abandoned, saying so. Returns the job's id and the Ray trial cluster, if one was started."""
    if request.document is not None:
        raw, source = request.document  # parsed already, errors naming the options
    elif request.job_file is None:
        raise InputError(
            "relaunch run",
            [
                Problem(
                    "JOB",
                    MISSING,
                    "a job file to run, or torchrun's form: --nnodes N "
                    "--nproc-per-node M script.py ARGS",
                )
            ],
        )
    else:
        raw, source = read_document(request.job_file), str(request.job_file)
        parse_job(raw, source=source)  # before a trial cluster starts for it
    faults_file = request.faults_file
    plan_raw = read_document(faults_file) if faults_file else None
    plan = service.plan_entries(plan_raw, source=str(faults_file))
    placed = kind.place(cluster_raw, parse_job(raw, source=source), where, say)
    trial = placed.trial
    try:
        job_id = _stored(
            store, directory, request, raw, source, placed.cluster, plan, placed.stored
        )
    except BaseException:
        stop_trial(trial)  # the trial cluster started for a job that was refused
        raise
    return job_id, trial


def _stored(
    store: Store,
    directory: Path,
    request: _NewRun,
    raw: Any,
    source: str,
    cluster_raw: Any,
    plan: Any,
    engine_spec: Any,
) -> int:
    """The job checked fully, stored and claimed by this run (starting nothing)."""
    faults_file = request.faults_file
    submission = service.Submission(
        raw=raw,
        source=source,
        cwd=os.getcwd(),
        cluster=cluster_raw,
        plan=plan,
        plan_source=str(faults_file),
        fault_table=str(request.fault_table.resolve()) if request.fault_table else None,
        startup_s=request.startup_s,
        engine=engine_spec,
    )
    job_id = service.submit(store, submission, time.time())  # checks all, starts nothing
    for old in runner.abandon_unfinished(store, directory):
        _warn_abandoned(old, store.job(job_id).name, directory)
    store.claim_job(job_id, time.time())
    return job_id


def _execute(
    store: Store,
    directory: Path,
    job_id: int,
    resume: bool,
    options: RunOptions,
    quiet: bool,
    trial: Any,
) -> JobStatus:
    """The job run to its end, its events and output echoed; SIGTERM or SIGHUP (its terminal
    closed) stops it in order."""
    echo = _Echo(job_id, directory, quiet)
    live = _LiveView(store, job_id) if out.is_terminal else None
    previous = {sig: signal.signal(sig, _stop_on_signal) for sig in _STOPPING_SIGNALS}
    try:
        if live is not None:
            live.start()
        return runner.run_job(
            store,
            directory,
            job_id,
            resume=resume,
            options=options,
            on_event=echo.event,
            on_output=echo.output,
            on_tick=live.refresh if live else None,
            on_start=echo.started,
            remove_node=trial.remove_node if trial is not None else None,
        )
    except RelaunchError as error:
        runner.could_not_start(store, job_id, error)
        say_error(error)
        raise typer.Exit(EXIT_INVALID) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if live is not None:
            live.stop()


@dataclass(frozen=True)
class _Echo:
    """What a foreground run shows of its job: relaunch's events, the ranks' output (unless
    quiet), and what the job runs on."""

    job_id: int
    directory: Path
    quiet: bool

    def event(self, event: Event) -> None:
        # escaped: an event quotes what ranks said ("[/pytorch/.../pair.cc:553] Connection...")
        out.print(
            f"[bold cyan]\\[relaunch][/] {escape(visible(event.text))}",
            highlight=False,
            soft_wrap=True,
        )

    def output(self, pod: int, rank: int, line: str) -> None:
        if not self.quiet:
            out.print(
                f"[dim]\\[pod {pod} rank {rank}][/] {escape(visible(line))}",
                highlight=False,
                soft_wrap=True,
            )

    def started(self, controller: Controller) -> None:
        out.print(
            f"[bold cyan]\\[relaunch][/] job {controller.spec.name} (id {self.job_id}): "
            f"{controller.spec.replicas} pod(s) x {controller.spec.procs_per_pod} process(es) on "
            f"{len(controller.cluster.nodes)} node(s); state in {self.directory}",
            highlight=False,
        )
        out.print(
            f"[bold cyan]\\[relaunch][/] {escape(controller.engine.facts.containers)}",
            highlight=False,
        )
        out.print(
            f"[bold cyan]\\[relaunch][/] {escape(controller.engine.facts.networks)}",
            highlight=False,
        )
        out.print(
            f"[bold cyan]\\[relaunch][/] {escape(controller.engine.facts.chips)}", highlight=False
        )


_STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _stop_on_signal(signum: int, frame: Any) -> None:
    """SIGTERM (systemd, docker, `timeout`) and SIGHUP (the terminal of a foreground run was
    closed) stop the job in order, as Ctrl-C does; a second one does not cut that stop short.
    After a hangup nothing is written to the terminal that is gone (a write there fails): what
    the run says goes to /dev/null, the job's record keeps it all."""
    for sig in _STOPPING_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if signum == signal.SIGHUP:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
    raise runner.Interrupted(signal.Signals(signum).name)


def _warn_abandoned(old: JobRow, name: str, directory: Path) -> None:
    err.print(
        f"[bold yellow]warning:[/] job {old.name} (id {old.id}) was still {old.status.value} in "
        f"{directory}, but its controller is gone: it is abandoned now and its processes are "
        f"stopped, and this run starts job {name} from step 0 in a new shared directory. To "
        f"continue job {old.name} instead, stop this run and use `relaunch run --resume "
        f"--state-dir {directory}`.",
        highlight=False,
        soft_wrap=True,
    )


def _start_queued(directory: Path) -> None:
    """Jobs submitted while this foreground run held the state directory start now."""
    try:
        state = runner.ensure_runner(directory)
    except (OSError, RelaunchError):
        return
    if state.started is not None:
        out.print(
            f"queued jobs in {directory}: runner started (pid {state.started}); see "
            "`relaunch jobs`",
            highlight=False,
        )


class _LiveView:
    """A footer on a terminal: pods, their nodes and counters, the step, the recoveries so far."""

    def __init__(self, store: Store, job_id: int) -> None:
        self.store = store
        self.job_id = job_id
        self.live = Live(console=out, auto_refresh=False, transient=True)
        self.shown_at = 0.0

    def start(self) -> None:
        self.live.start()

    def stop(self) -> None:
        self.live.stop()

    def refresh(self) -> None:
        now = time.time()
        if now - self.shown_at < 0.25:
            return
        self.shown_at = now
        job = self.store.job(self.job_id)
        records = self.store.records(self.job_id)
        view = Table(
            title=f"{job.name}: {job.status.value}, attempt {job.attempt}, step {job.last_step or 0}, "
            f"{len(records)} recovery record(s)",
            title_justify="left",
            show_edge=False,
        )
        for column in ("pod", "node", "generation", "MA_SCHEDULE_CNT", "MA_PROC_START_CNT"):
            view.add_column(column)
        for p in self.store.pods(self.job_id):
            view.add_row(
                str(p.idx), p.node, str(p.generation), str(p.schedule_cnt), str(p.proc_start_cnt)
            )
        self.live.update(view, refresh=True)
