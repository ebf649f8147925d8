"""The `relaunch` command line."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from relaunch import __version__, runner
from relaunch.api import TOKEN_FILE
from relaunch.chaos import ChaosEntry, parse_plan
from relaunch.cluster.config import parse_cluster
from relaunch.controller import Controller, RunOptions
from relaunch.errors import MISSING, InputError, Problem, RelaunchError, StoreError
from relaunch.faults import EscalationRules, Fault, FaultCodeTable, FaultKind
from relaunch.files import load_cluster, load_job, read_document
from relaunch.policy import ClusterView, Decision, JobHistory, PodView, plan
from relaunch.report import build_report, node_view
from relaunch.spec import JobSpec, parse_job, process_recovery_env
from relaunch.store import JobRow, JobStatus, NodeState, Store

if TYPE_CHECKING:
    from relaunch.api.client import Client

app = typer.Typer(
    name="relaunch",
    help="Keep distributed training jobs alive through faults.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True)

EXIT_INVALID = 2


def main() -> None:
    try:
        app()
    except StoreError as error:
        err.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_INVALID)
    except sqlite3.OperationalError as error:
        err.print(
            f"[bold red]error:[/] the state database: {error} (another relaunch may hold it "
            "busy; try again)",
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(EXIT_INVALID)


def _print_version(value: bool) -> None:
    if value:
        out.print(f"relaunch {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print the version and exit.",
            callback=_print_version,
            is_eager=True,
        ),
    ] = False,
) -> None:
    """Keep distributed training jobs alive through faults."""


def _fail_input(error: InputError) -> typer.Exit:
    err.print(
        f"[bold red]error:[/] {error.source}: invalid {error.what}", highlight=False, soft_wrap=True
    )
    for problem in error.problems:
        err.print(f"  - {problem}", markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(EXIT_INVALID)


FaultTableOption = Annotated[
    Path | None,
    typer.Option("--fault-table", help="YAML/JSON file that overrides fault codes and escalation."),
]


@app.command()
def validate(
    file: Annotated[Path, typer.Argument(help="Job spec, YAML or JSON.")],
    fault_table: FaultTableOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the effective settings as JSON.")
    ] = False,
    faults_file: Annotated[
        Path | None,
        typer.Option("--faults", help="Also check this fault plan against the job and cluster."),
    ] = None,
    cluster_file: Annotated[
        Path | None,
        typer.Option("--cluster", help="The cluster the fault plan is checked against."),
    ] = None,
) -> None:
    """Check a job spec (and a fault plan against it); print its effective recovery settings,
    or every problem (exit 2)."""
    try:
        job = load_job(file)
        table, rules = runner.table_from(fault_table)
        plan: tuple[ChaosEntry, ...] = ()
        if faults_file is not None:
            source = str(faults_file)
            cluster = load_cluster(cluster_file) if cluster_file else parse_cluster(None)
            plan = parse_plan(read_document(faults_file), source=source)
            runner.check_plan_fits(
                runner.plan_entries(read_document(faults_file), source), job, cluster, source
            )
    except InputError as error:
        raise _fail_input(error) from None
    if as_json:
        payload = {
            "name": job.name,
            "replicas": job.replicas,
            "procs_per_pod": job.procs_per_pod,
            "chips_per_pod": job.chips_per_pod,
            "command": list(job.command),
            "labels": dict(job.labels),
            "recovery": asdict(job.recovery),
            "process_recovery_env": process_recovery_env(job.recovery),
            "ladder": {
                name: [d.action.value for d in steps] for name, steps in _ladder(job, table, rules)
            },
            "fault_plan": [e.describe() for e in plan],
        }
        out.print_json(json.dumps(payload, default=str))
        return
    _print_settings(file, job)
    _print_ladder(job, table, rules)
    if faults_file is not None:
        out.print(
            f"fault plan {faults_file}: {len(plan)} entr(ies), each can hit its target",
            highlight=False,
        )
        for entry in plan:
            out.print(f"  - {entry.describe()}", highlight=False, markup=False)


def _print_settings(file: Path, job: JobSpec) -> None:
    r = job.recovery
    out.print(f"[bold green]valid[/]: {file} defines job [bold]{job.name}[/]", highlight=False)
    out.print(
        f"  {job.replicas} pod(s) x {job.procs_per_pod} process(es), {job.chips_per_pod} chip(s) "
        f"per pod; command: {' '.join(job.command)}",
        markup=False,
        highlight=False,
    )
    levels = Table(title="Recovery levels", title_justify="left", show_edge=False)
    levels.add_column("level")
    levels.add_column("state")
    levels.add_column("budget / setting")
    on, off = "[green]on[/]", "[dim]off[/]"
    process = ", ".join(s.value for s in r.recover_strategies) if r.process_level else ""
    levels.add_row(
        "process level (R-30..R-36)",
        on if r.process_level else (f"[yellow]{r.process_recovery.value}[/]"),
        process or "-",
    )
    levels.add_row(
        "in-place recovery (R-20)", on if r.auto_restart else off, "does not consume restarts"
    )
    levels.add_row(
        "restart upon suspension (R-24)",
        on if r.hang_retry else off,
        f"hang after {_duration(r.hang_detect_s)} without progress; 3 in a row fail the job",
    )
    levels.add_row(
        "pod rescheduling (R-23)",
        on if r.pod_reschedule else off,
        f"{r.pod_retry_budget} reschedule(s)"
        + ("" if r.pod_may_fall_back_to_job else "; never falls back to job level"),
    )
    levels.add_row(
        "isolated job rescheduling (R-22)",
        on if r.auto_restart else off,
        f"{r.job_retry_budget} job-level reschedule(s) in all",
    )
    unconditional = []
    if r.unconditional_retry:
        unconditional.append("job-unconditional-retry: 3 in a row, the 4th fails")
    if r.fault_retry_times:
        unconditional.append(f"fault-retry-times {r.fault_retry_times}")
    levels.add_row(
        "unconditional job rescheduling (R-21)",
        on if r.unconditional else off,
        "; ".join(unconditional) or "software faults end the job (R-02)",
    )
    out.print(levels)
    stop = (
        "SIGKILL at once"
        if r.termination_grace_s == 0
        else f"SIGTERM, SIGKILL after {_duration(r.termination_grace_s)}"
    )
    out.print(
        f"  stopping processes: {stop}; max_restarts {r.max_restarts}; "
        f"monitor every {r.monitor_interval_s:g} s",
        highlight=False,
    )
    env = process_recovery_env(r)
    if env:
        out.print("  injected: " + " ".join(f"{k}={v}" for k, v in env.items()), markup=False)


def _duration(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


def _example_faults(job: JobSpec) -> list[tuple[str, Fault]]:
    last = job.replicas - 1
    node = f"node-{last}"
    rank = last * job.procs_per_pod
    return [
        (
            "rank crashes (exit 1)",
            Fault(FaultKind.PROCESS_EXIT, 0.0, node=node, pod=last, rank=rank, exit_code=1),
        ),
        (
            "memory UCE 80E01801",
            Fault(FaultKind.MEMORY_UCE, 0.0, node=node, chip=0, code="80E01801"),
        ),
        (
            "chip fault 80E18005 (Major)",
            Fault(FaultKind.CHIP, 0.0, node=node, chip=0, code="80E18005"),
        ),
        (
            "chip fault 80E3A201 (Critical)",
            Fault(FaultKind.CHIP, 0.0, node=node, chip=0, code="80E3A201"),
        ),
        ("node lost", Fault(FaultKind.NODE_LOST, 0.0, node=node)),
        ("network link down 60 s", Fault(FaultKind.NETWORK, 0.0, node=node, duration_s=60.0)),
        ("job hangs", Fault(FaultKind.HANG, 0.0)),
    ]


def _ladder(
    job: JobSpec, table: FaultCodeTable, rules: EscalationRules
) -> list[tuple[str, tuple[Decision, ...]]]:
    pods = tuple(PodView(i, f"node-{i}", holds_rank0=i == 0) for i in range(job.replicas))
    cluster = ClusterView(pods=pods, standby_nodes=(f"node-{job.replicas}",))
    history = JobHistory(pods=job.replicas)
    return [
        (name, plan(job.recovery, fault, history, cluster, 0.0, table=table, rules=rules))
        for name, fault in _example_faults(job)
    ]


def _print_ladder(job: JobSpec, table: FaultCodeTable, rules: EscalationRules) -> None:
    ladder = Table(
        title="What happens on a fault (one standby node; each step runs if the one before fails)",
        title_justify="left",
        show_edge=False,
    )
    ladder.add_column("fault")
    ladder.add_column("recovery ladder")
    for name, steps in _ladder(job, table, rules):
        chain = " -> ".join(step.action.value for step in steps)
        ladder.add_row(name, chain)
    out.print(ladder)


@app.command()
def faults(fault_table: FaultTableOption = None) -> None:
    """List the fault code table: levels, severities, user-induced codes."""
    try:
        table, rules = runner.table_from(fault_table)
    except InputError as error:
        raise _fail_input(error) from None
    view = Table(title=f"{len(table)} fault codes", title_justify="left", show_edge=False)
    for column in ("code", "level", "severity", "user-induced", "description"):
        view.add_column(column)
    for row in table:
        view.add_row(
            row.code,
            row.level.mindcluster_name,
            row.severity.name.capitalize(),
            "yes" if row.user_induced else "",
            row.description,
        )
    out.print(view)
    out.print(
        f"escalation: {rules.threshold} in a row within {_duration(rules.window_s)} isolates the "
        f"node; released after {_duration(rules.release_after_s)} without a fault",
        highlight=False,
    )


# ---------------------------------------------------------------------------------------------
# Running jobs on the embedded cluster
# ---------------------------------------------------------------------------------------------

AddressOption = Annotated[
    str | None,
    typer.Option("--address", help="With --engine ray: the running Ray cluster to use."),
]
RaySelectOption = Annotated[
    str | None,
    typer.Option(
        "--ray-select",
        help="With --engine ray: use only nodes carrying this resource or label (KEY or "
        "KEY=VALUE).",
    ),
]
StateDirOption = Annotated[
    Path | None,
    typer.Option(
        "--state-dir",
        envvar="RELAUNCH_STATE_DIR",
        help="Where jobs, nodes and records are kept (default ~/.local/state/relaunch).",
    ),
]


def _state_dir(path: Path | None) -> Path:
    """The state directory, created readable by its owner only (it holds every job's spec,
    environment and logs, and the server's token)."""
    if path is None:
        base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
        path = base / "relaunch"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path.resolve()


def _store(state_dir: Path | None) -> Store:
    return Store(_state_dir(state_dir) / "relaunch.db")


@app.command()
def run(
    job_file: Annotated[Path | None, typer.Argument(help="Job spec, YAML or JSON.")] = None,
    cluster_file: Annotated[
        Path | None, typer.Option("--cluster", help="Cluster file (nodes, chips, timings).")
    ] = None,
    faults_file: Annotated[
        Path | None, typer.Option("--faults", help="Fault plan to inject.")
    ] = None,
    report: Annotated[
        Path | None, typer.Option("--report", help="Write a JSON report here at the end.")
    ] = None,
    state_dir: StateDirOption = None,
    fault_table: FaultTableOption = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Re-adopt the unfinished job of the state directory.")
    ] = False,
    startup_s: Annotated[
        float | None,
        typer.Option(
            "--startup-seconds", help="Allowance before a (re)started job must show progress."
        ),
    ] = None,
    nodes_count: Annotated[
        int | None,
        typer.Option(
            "--nodes", help="Number of nodes (node-0, node-1, ...), instead of a cluster file."
        ),
    ] = None,
    chips_per_node: Annotated[
        int | None, typer.Option("--chips-per-node", help="Chips per node, with --nodes.")
    ] = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Do not echo the processes' output.")
    ] = False,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            help="embedded: the embedded cluster; ray: a Ray cluster (--address, or a local "
            "trial cluster shaped by --cluster).",
        ),
    ] = "embedded",
    address: AddressOption = None,
    ray_select: RaySelectOption = None,
) -> None:
    """Run a job until it succeeds or fails (exit 0 / 1; 2 for bad input), on the embedded
    cluster or on Ray."""
    engine = _engine(engine)
    if engine == "embedded" and (address or ray_select):
        err.print("[bold red]error:[/] --address and --ray-select need --engine ray")
        raise typer.Exit(EXIT_INVALID)
    directory = _state_dir(state_dir)
    try:
        held = runner.lock(directory)
    except RuntimeError as error:
        err.print(f"[bold red]error:[/] {error}", highlight=False)
        raise typer.Exit(EXIT_INVALID) from None
    trial: Any = None
    try:
        table, rules = runner.table_from(fault_table)
        store = Store(directory / "relaunch.db")
        if resume:
            job_id = _unfinished(store, job_file).id
        else:
            if job_file is None:
                raise InputError("relaunch run", [Problem("JOB", MISSING, "a job file to run")])
            cluster_raw = read_document(cluster_file) if cluster_file else None
            if nodes_count is not None or chips_per_node is not None:
                cluster_raw = dict(cluster_raw or {})
                if nodes_count is not None:
                    cluster_raw["nodes"] = nodes_count
                if chips_per_node is not None:
                    cluster_raw["chips_per_node"] = chips_per_node
            plan_raw = read_document(faults_file) if faults_file else None
            raw = read_document(job_file)
            parse_job(raw, source=str(job_file))  # before a trial cluster starts for it
            plan = runner.plan_entries(plan_raw, source=str(faults_file))
            engine_spec = None
            if engine == "ray":
                cluster_raw, engine_spec, trial = _ray_cluster(cluster_raw, address, ray_select)
            submission = runner.Submission(
                raw=raw,
                source=str(job_file),
                cwd=os.getcwd(),
                cluster=cluster_raw,
                plan=plan,
                plan_source=str(faults_file),
                fault_table=str(fault_table.resolve()) if fault_table else None,
                startup_s=startup_s,
                engine=engine_spec,
            )
            job_id = runner.submit(store, submission, time.time())  # checks all, starts nothing
            for old in runner.abandon_unfinished(store, directory):
                _warn_abandoned(old, store.job(job_id).name, directory)
            store.claim_job(job_id, time.time())
    except InputError as error:
        held.close()
        _stop_trial(trial)
        raise _fail_input(error) from None
    except RuntimeError as error:
        held.close()
        _stop_trial(trial)
        err.print(f"[bold red]error:[/] {error}", highlight=False)
        raise typer.Exit(EXIT_INVALID) from None

    def on_event(text: str) -> None:
        out.print(f"[bold cyan]\\[relaunch][/] {text}", highlight=False, soft_wrap=True)

    def on_output(pod: int, rank: int, line: str) -> None:
        if not quiet:
            out.print(
                f"[dim]\\[pod {pod} rank {rank}][/] {escape(line)}", highlight=False, soft_wrap=True
            )

    def on_start(controller: Controller) -> None:
        out.print(
            f"[bold cyan]\\[relaunch][/] job {controller.spec.name} (id {job_id}): "
            f"{controller.spec.replicas} pod(s) x {controller.spec.procs_per_pod} process(es) on "
            f"{len(controller.cluster.nodes)} node(s); state in {directory}",
            highlight=False,
        )

    live = _LiveView(store, job_id) if out.is_terminal else None
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        if live is not None:
            live.start()
        status = runner.run_job(
            store,
            directory,
            job_id,
            resume=resume,
            options=RunOptions(startup_s=startup_s, table=table, rules=rules),
            on_event=on_event,
            on_output=on_output,
            on_tick=live.refresh if live else None,
            on_start=on_start,
            remove_node=trial.remove_node if trial is not None else None,
        )
    except (InputError, RuntimeError) as error:
        runner.could_not_start(store, job_id, error)
        err.print(f"[bold red]error:[/] {error}", highlight=False)
        raise typer.Exit(EXIT_INVALID) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        if live is not None:
            live.stop()
        held.close()
        _stop_trial(trial)
    summary = build_report(store, job_id)
    _print_summary(summary)
    if report is not None:
        report.write_text(json.dumps(summary, indent=2))
    _start_queued(directory)
    raise typer.Exit(_exit_code(status, store.job(job_id).reason))


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (systemd, docker, `timeout`) stops the job in order, as Ctrl-C does; a second
    one does not cut that stop short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise runner.Interrupted("SIGTERM")


def _exit_code(status: JobStatus, reason: str) -> int:
    """0 succeeded, 1 failed or stopped, 130 / 143 stopped by Ctrl-C / SIGTERM."""
    if status is JobStatus.SUCCEEDED:
        return 0
    if status is JobStatus.STOPPED and reason.endswith("(SIGTERM)"):
        return 143
    if status is JobStatus.STOPPED and reason.endswith("(Ctrl-C)"):
        return 130
    return 1


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


def _engine(given: str) -> str:
    if given not in ("embedded", "ray"):
        err.print(f"[bold red]error:[/] --engine {given}: choose embedded or ray", highlight=False)
        raise typer.Exit(EXIT_INVALID)
    return given


def _ray_module() -> Any:
    try:
        from relaunch.cluster import ray as ray_engine
    except ImportError:
        err.print(
            "[bold red]error:[/] --engine ray needs Ray: pip install 'relaunch[ray]'",
            highlight=False,
        )
        raise typer.Exit(EXIT_INVALID) from None
    return ray_engine


def _ray_cluster(
    cluster_raw: Any, address: str | None, select: str | None
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """The job's nodes on Ray: the cluster at `address`, or a local trial cluster shaped by the
    cluster file (started here, removed when the run ends). Returns the cluster settings with the
    Ray nodes as nodes, the engine's stored settings, and the trial cluster (or None)."""
    ray_engine = _ray_module()
    shape = parse_cluster(cluster_raw, source="cluster settings")
    trial = None
    if address is None:
        trial = ray_engine.TrialCluster(shape.nodes)
        out.print(
            f"[bold cyan]\\[relaunch][/] starting a local Ray cluster: a head and "
            f"{len(shape.nodes)} node(s) ({trial.log})",
            highlight=False,
        )
        address = trial.start(
            progress=lambda up, total: out.print(
                f"[bold cyan]\\[relaunch][/] Ray node {up} of {total} joined", highlight=False
            )
        )
    ray_engine.connect(address)
    found = ray_engine.discover(select)
    if not found:
        _stop_trial(trial)
        raise RuntimeError(
            f"the Ray cluster at {address} has no live node"
            + (f" carrying {select!r}" if select else "")
            + "; see `relaunch nodes --engine ray --address ...`"
        )
    settings = dict(cluster_raw) if isinstance(cluster_raw, dict) else {}
    settings["nodes"] = [{"name": n.name, "chips": n.chips} for n in found]
    settings.pop("chips_per_node", None)
    return settings, {"kind": "ray", "address": address, "select": select}, trial


def _stop_trial(trial: Any) -> None:
    if trial is not None:
        trial.stop()


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


def _unfinished(store: Store, ref: Path | None) -> Any:
    jobs = [j for j in store.jobs() if j.status.active]
    if ref is not None:
        jobs = [j for j in jobs if j.name == str(ref) or str(j.id) == str(ref)]
    if not jobs:
        raise InputError(
            "relaunch run --resume",
            [Problem("JOB", str(ref or ""), "an unfinished job in this state directory")],
        )
    return jobs[-1]


def _print_summary(summary: dict[str, Any]) -> None:
    colour = "green" if summary["status"] == "Succeeded" else "red"
    out.print(
        f"\n[bold {colour}]{summary['status']}[/]: job {summary['job']} - {summary['reason']}",
        highlight=False,
        soft_wrap=True,
    )
    _records_table(summary)
    out.print(
        f"job-level restarts used: {summary['restarts_used']}; pod-level: {summary['pod_restarts_used']}; "
        f"isolated nodes: {', '.join(summary['isolated_nodes']) or 'none'}",
        highlight=False,
    )
    plan = summary.get("fault_plan") or []
    missed = [e for e in plan if e["state"] != "fired"]
    if missed:
        out.print(
            f"[bold yellow]fault plan: {len(missed)} of {len(plan)} entr(ies) not fired[/]",
            highlight=False,
        )
        for e in missed:
            out.print(f"  - {e['entry']}: {e['note'] or e['state']}", markup=False, highlight=False)


def _records_table(summary: dict[str, Any]) -> None:
    records = summary["recoveries"]
    if not records:
        out.print("no faults")
        return
    view = Table(title="Fault recovery details", title_justify="left", show_edge=False)
    for column in ("#", "fault", "node", "action", "isolated", "outcome", "detect s", "MTTR s"):
        view.add_column(column)
    for i, r in enumerate(records, 1):
        f = r["fault"]
        what = f["kind"] + (f" {f['code']}" if f["code"] else "")
        if f["exit_code"] is not None:
            what += f" (exit {f['exit_code']})"
        elif f["signal"] is not None:
            what += f" (signal {f['signal']})"
        view.add_row(
            str(i),
            what,
            f["node"] or (f"pod {f['pod']}" if f["pod"] is not None else "-"),
            r["action"],
            ", ".join(r["isolated_nodes"]) or "-",
            r["outcome"],
            f"{r['detect_s']:.2f}",
            "-" if r["mttr_s"] is None else f"{r['mttr_s']:.2f}",
        )
    out.print(view)


def _job_or_exit(store: Store, ref: str) -> JobRow:
    row = store.find_job(ref)
    if row is None:
        err.print(f"[bold red]error:[/] no job {ref!r}; see `relaunch jobs`", highlight=False)
        raise typer.Exit(EXIT_INVALID)
    return row


def _node_or_exit(store: Store, name: str) -> None:
    if store.node(name) is None:
        err.print(f"[bold red]error:[/] no node {name!r}; see `relaunch nodes`", highlight=False)
        raise typer.Exit(EXIT_INVALID)


ServerOption = Annotated[
    str | None,
    typer.Option(
        "--server",
        envvar="RELAUNCH_SERVER",
        help="Talk to this relaunch server (http://host:port) instead of the local state.",
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar="RELAUNCH_TOKEN",
        help="The server's bearer token (default: the state directory's server-token file).",
    ),
]
ProjectOption = Annotated[
    str, typer.Option("--project", help="The server's project (a namespace for jobs).")
]


def _client(server: str, token: str | None, state_dir: Path | None, project: str) -> Client:
    from relaunch.api.client import Client

    if token is None:
        candidate = _state_dir(state_dir) / TOKEN_FILE
        if candidate.exists() and os.access(candidate, os.R_OK):
            token = candidate.read_text().strip()
    return Client(server, token, project)


def _remote(call: Callable[[], Any]) -> Any:
    from relaunch.api.client import ClientError

    try:
        return call()
    except ClientError as error:
        err.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
        for problem in error.problems:
            err.print(f"  - {problem}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_INVALID) from None


def _nodes_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        out.print("no nodes yet: `relaunch run` or `relaunch server` creates the embedded cluster")
        return
    view = Table(show_edge=False)
    for column in ("node", "state", "chips", "faulty chips", "reason"):
        view.add_column(column)
    for n in rows:
        faulty = ", ".join(f"{c['chip']} ({c['code']})" for c in n["faulty_chips"]) or "-"
        view.add_row(n["name"], n["state"], str(n["chips"]), faulty, n["reason"])
    out.print(view)


@app.command()
def nodes(
    state_dir: StateDirOption = None,
    server: ServerOption = None,
    token: TokenOption = None,
    engine: Annotated[
        str, typer.Option("--engine", help="embedded, or ray: the Ray cluster's nodes.")
    ] = "embedded",
    address: AddressOption = None,
    ray_select: RaySelectOption = None,
) -> None:
    """List the nodes: state, chips, chip health, isolation (with --engine ray, the Ray nodes and
    their relaunch state)."""
    if _engine(engine) == "ray":
        if address is None:
            err.print("[bold red]error:[/] --engine ray needs --address (the Ray cluster)")
            raise typer.Exit(EXIT_INVALID)
        _ray_nodes_table(address, ray_select, state_dir)
        return
    if server:
        client = _client(server, token, state_dir, "default")
        _nodes_table(_remote(client.nodes))
        return
    _nodes_table([node_view(n) for n in _store(state_dir).nodes()])


def _ray_nodes_table(address: str, select: str | None, state_dir: Path | None) -> None:
    ray_engine = _ray_module()
    try:
        ray_engine.connect(address)
    except RuntimeError as error:
        err.print(f"[bold red]error:[/] {error}", highlight=False)
        raise typer.Exit(EXIT_INVALID) from None
    known = {n.name: n for n in _store(state_dir).nodes()}
    view = Table(show_edge=False)
    for column in ("node", "ray", "ray node id", "address", "chips", "relaunch", "reason"):
        view.add_column(column)
    for n in ray_engine.discover(select, include_dead=True):
        row = known.get(n.name)
        view.add_row(
            n.name,
            "alive" if n.alive else "dead",
            n.node_id[:12],
            n.address,
            str(n.chips),
            row.state.value if row else "-",
            row.reason if row else "not used by relaunch yet",
        )
    out.print(view)


def _node_verb(
    node: str, state_dir: Path | None, server: str | None, token: str | None, verb: str
) -> None:
    if server:
        client = _client(server, token, state_dir, "default")
        row = _remote(lambda: client.node_action(node, verb))
        out.print(f"{node}: {row['state']}")
        return
    store = _store(state_dir)
    _node_or_exit(store, node)
    if verb == "cordon":
        store.set_node_state(node, NodeState.ISOLATED, "cordoned by an operator", time.time())
        out.print(f"{node}: {NodeState.ISOLATED.value}")
    else:
        store.set_node_state(node, NodeState.READY, "released by an operator")
        out.print(f"{node}: {NodeState.READY.value}")


@app.command()
def cordon(
    node: str,
    state_dir: StateDirOption = None,
    server: ServerOption = None,
    token: TokenOption = None,
) -> None:
    """Isolate a node: no new pods are placed on it."""
    _node_verb(node, state_dir, server, token, "cordon")


@app.command()
def release(
    node: str,
    state_dir: StateDirOption = None,
    server: ServerOption = None,
    token: TokenOption = None,
) -> None:
    """Release an isolated node back to Ready."""
    _node_verb(node, state_dir, server, token, "release")


@app.command()
def jobs(
    state_dir: StateDirOption = None,
    server: ServerOption = None,
    token: TokenOption = None,
    project: ProjectOption = "default",
) -> None:
    """List jobs with their status."""
    if server:
        client = _client(server, token, state_dir, project)
        rows = [
            (
                v["metadata"]["id"],
                v["metadata"]["name"],
                v["status"]["phase"],
                str(v["status"]["attempt"]),
                str(v["status"]["recoveries"]),
                v["status"]["reason"],
            )
            for v in reversed(_remote(client.jobs))
        ]
    else:
        store = _store(state_dir)
        rows = [
            (
                str(j.id),
                j.name,
                j.status.value,
                str(j.attempt),
                str(len(store.records(j.id))),
                j.reason,
            )
            for j in store.jobs()
        ]
    view = Table(show_edge=False)
    for column in ("id", "job", "status", "attempt", "recoveries", "reason"):
        view.add_column(column)
    for row in rows:
        view.add_row(*row)
    out.print(view)


@app.command()
def describe(
    job: Annotated[str, typer.Argument(help="Job name or id.")],
    output: Annotated[str, typer.Option("-o", "--output", help="table or json")] = "table",
    state_dir: StateDirOption = None,
    server: ServerOption = None,
    token: TokenOption = None,
    project: ProjectOption = "default",
) -> None:
    """A job's fault-recovery details: every fault, what relaunch did, and how long it took."""
    if server:
        client = _client(server, token, state_dir, project)
        from relaunch.api.client import summary_from_view

        summary = summary_from_view(_remote(lambda: client.job(job)))
    else:
        store = _store(state_dir)
        summary = build_report(store, _job_or_exit(store, job).id)
    if output == "json":
        out.print_json(json.dumps(summary))
        return
    _print_summary(summary)


@app.command()
def submit(
    job_file: Annotated[Path, typer.Argument(help="Job spec, YAML or JSON.")],
    faults_file: Annotated[
        Path | None, typer.Option("--faults", help="Fault plan to inject.")
    ] = None,
    cluster_file: Annotated[
        Path | None, typer.Option("--cluster", help="Cluster file (local mode only).")
    ] = None,
    state_dir: StateDirOption = None,
    server: ServerOption = None,
    token: TokenOption = None,
    project: ProjectOption = "default",
) -> None:
    """Queue a job and return at once; a server (or a background runner) runs it."""
    try:
        raw = read_document(job_file)
        plan = runner.plan_entries(
            read_document(faults_file) if faults_file else None, source=str(faults_file)
        )
        if server:
            client = _client(server, token, state_dir, project)
            view = _remote(lambda: client.submit(raw, plan))
            out.print(f"job {view['metadata']['name']} submitted (id {view['metadata']['id']})")
            return
        directory = _state_dir(state_dir)
        store = Store(directory / "relaunch.db")
        submission = runner.Submission(
            raw=raw,
            source=str(job_file),
            cwd=os.getcwd(),
            cluster=read_document(cluster_file) if cluster_file else None,
            plan=plan,
            plan_source=str(faults_file),
            project=project,
        )
        job_id = runner.submit(store, submission, time.time())
    except InputError as error:
        raise _fail_input(error) from None
    state = runner.ensure_runner(directory)
    if state.started is not None:
        how = f"; runner started (pid {state.started})"
    elif state.foreground is not None:
        how = (
            f"; queued: a foreground `relaunch run` (pid {state.foreground}) holds {directory}, "
            "and the job starts when that run ends"
        )
    else:
        how = "; the running runner will take it"
    out.print(f"job {store.job(job_id).name} submitted (id {job_id}){how}", highlight=False)


@app.command()
def stop(
    job: Annotated[str, typer.Argument(help="Job name or id.")],
    state_dir: StateDirOption = None,
    server: ServerOption = None,
    token: TokenOption = None,
    project: ProjectOption = "default",
) -> None:
    """Stop a job: a queued one at once, a running one after its pods' termination grace."""
    if server:
        client = _client(server, token, state_dir, project)
        view = _remote(lambda: client.stop(job))
        out.print(f"job {view['metadata']['name']}: stop requested ({view['status']['phase']})")
        return
    store = _store(state_dir)
    row = _job_or_exit(store, job)
    if row.status.ended:
        err.print(f"[bold red]error:[/] job {row.name} has ended ({row.status.value})")
        raise typer.Exit(EXIT_INVALID)
    status = store.request_stop(row.id, "stopped with `relaunch stop`", time.time())
    out.print(f"job {row.name}: stop requested ({status.value})")


@app.command()
def server(
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")] = 8080,
    engine: Annotated[
        str, typer.Option("--engine", help="embedded, or ray (with --address).")
    ] = "embedded",
    address: AddressOption = None,
    ray_select: RaySelectOption = None,
    state_dir: StateDirOption = None,
    cluster_file: Annotated[
        Path | None, typer.Option("--cluster", help="Cluster file the submitted jobs run on.")
    ] = None,
    nodes_count: Annotated[
        int | None, typer.Option("--nodes", help="Number of nodes, instead of a cluster file.")
    ] = None,
    lock_reads: Annotated[
        bool, typer.Option("--lock-reads", help="Reads need the token too, even on loopback.")
    ] = False,
    paused: Annotated[
        bool,
        typer.Option("--paused", help="Accept jobs but start none (maintenance; API tests)."),
    ] = False,
) -> None:
    """Serve the REST API, the dashboard and /metrics, and run submitted jobs."""
    from relaunch.api.app import ServerSettings, load_or_create_token
    from relaunch.api.server import serve

    engine_spec = None
    if _engine(engine) == "ray" and address is None:
        err.print("[bold red]error:[/] a server on Ray needs --address (a running Ray cluster)")
        raise typer.Exit(EXIT_INVALID)
    directory = _state_dir(state_dir)
    try:
        cluster_raw = read_document(cluster_file) if cluster_file else None
        if nodes_count is not None:
            cluster_raw = {**(cluster_raw or {}), "nodes": nodes_count}
        if engine == "ray":
            cluster_raw, engine_spec, _ = _ray_cluster(cluster_raw, address, ray_select)
        cluster = parse_cluster(cluster_raw, source=str(cluster_file or "cluster settings"))
    except InputError as error:
        raise _fail_input(error) from None
    except RuntimeError as error:
        err.print(f"[bold red]error:[/] {error}", highlight=False)
        raise typer.Exit(EXIT_INVALID) from None
    store = Store(directory / "relaunch.db")
    store.ensure_nodes([(n.name, n.chips) for n in cluster.nodes])
    store.close()
    token, created = load_or_create_token(directory)
    if created:
        out.print(
            f"API token (shown this once; kept in {directory / TOKEN_FILE}, mode 0600):\n{token}",
            highlight=False,
            soft_wrap=True,
        )
    else:
        out.print(f"API token: in {directory / TOKEN_FILE}", highlight=False)
    out.print(
        f"relaunch server on http://{host}:{port}/ (API /v2, OpenAPI /openapi.json, metrics "
        f"/metrics); {len(cluster.nodes)} node(s); state in {directory}"
        + ("; paused: jobs are queued, none starts" if paused else ""),
        highlight=False,
        soft_wrap=True,
    )

    def log(text: str) -> None:
        out.print(f"[bold cyan]\\[relaunch][/] {text}", highlight=False, soft_wrap=True)

    settings = ServerSettings(
        directory, token, cluster_raw, lock_reads=lock_reads, engine=engine_spec
    )
    serve(settings, host, port, paused=paused, log=log)


@app.command("runner", hidden=True)
def runner_command(state_dir: StateDirOption = None) -> None:
    """Run queued jobs of a state directory until none is left (started by submit / server)."""
    directory = _state_dir(state_dir)
    try:
        held = runner.lock(directory, role="runner")
    except RuntimeError:
        return  # another run or runner has it; it takes the queue
    try:
        runner.run_queue(
            directory, lambda text: print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)
        )
    finally:
        held.close()


@app.command()
def logs(
    job: Annotated[str, typer.Argument(help="Job name or id.")],
    pod: Annotated[int, typer.Option("--pod", help="Pod index.")] = 0,
    rank: Annotated[
        int | None, typer.Option("--rank", help="Global rank (default: the pod's first).")
    ] = None,
    state_dir: StateDirOption = None,
) -> None:
    """Print one rank's log (the pod's current container)."""
    store = _store(state_dir)
    row = _job_or_exit(store, job)
    pods = {p.idx: p for p in store.pods(row.id)}
    if pod not in pods:
        err.print(
            f"[bold red]error:[/] job {row.name} has pods 0..{len(pods) - 1}", highlight=False
        )
        raise typer.Exit(EXIT_INVALID)
    spec = parse_job(row.spec["raw"])
    rank = pod * spec.procs_per_pod if rank is None else rank
    path = Path(pods[pod].workdir) / "logs" / f"rank-{rank}.log"
    if not path.exists():
        err.print(
            f"[bold red]error:[/] no log for rank {rank} of pod {pod} ({path})", highlight=False
        )
        raise typer.Exit(EXIT_INVALID)
    sys.stdout.write(path.read_text())


@app.command()
def bench(
    out: Annotated[
        Path, typer.Option("--out", help="Where bench.json, bench.md and bench.png go.")
    ] = Path("bench-results"),
    quick: Annotated[
        bool, typer.Option("--quick", help="One repeat, light workload + DDP crash only.")
    ] = False,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Repetitions per level.")] = 5,
    levels: Annotated[
        str | None,
        typer.Option(
            "--levels", help="Comma-separated levels for the MTTR table (default: every level)."
        ),
    ] = None,
    only: Annotated[
        str | None,
        typer.Option("--only", help="Comma-separated sections to run (default: all of them)."),
    ] = None,
) -> None:
    """Measure recovery time by level on this machine, side by side with torchrun."""
    from relaunch.bench import LEVELS, SECTIONS, BenchOptions, run_bench

    chosen = _choices("--levels", levels, LEVELS)
    sections = _choices("--only", only, SECTIONS)

    def progress(text: str) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        err.print(text, highlight=False, markup=False)

    result = run_bench(
        BenchOptions(
            out=out,
            quick=quick,
            repeats=repeats,
            progress=progress,
            levels=chosen,
            sections=sections,
        )
    )
    sys.stdout.write((out / "bench.md").read_text())
    failed = sum(r["failures"] for r in result["mttr"] if r["system"] == "relaunch")
    if failed:
        err.print(f"[bold red]{failed} relaunch recovery(ies) failed[/]", highlight=False)
        raise typer.Exit(1)


def _choices(option: str, given: str | None, allowed: Iterable[str]) -> tuple[str, ...]:
    """A comma-separated option's values, each checked against `allowed` (exit 2 otherwise)."""
    allowed = tuple(allowed)
    chosen = tuple(x.strip() for x in (given or "").split(",") if x.strip())
    unknown = [x for x in chosen if x not in allowed]
    if unknown:
        err.print(
            f"[bold red]error:[/] {option}: unknown {', '.join(unknown)}; "
            f"choose from {', '.join(allowed)}",
            highlight=False,
        )
        raise typer.Exit(2)
    return chosen
