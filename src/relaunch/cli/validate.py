"""`relaunch validate` and `relaunch faults`: a job file, a fault plan and the code table checked."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from relaunch import service
from relaunch.cli.common import (
    FaultTableOption,
    app,
    duration,
    fail_input,
    out,
)
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
from relaunch.cluster.config import parse_cluster
from relaunch.errors import InputError
from relaunch.faults import EscalationRules, Fault, FaultCodeTable, FaultKind
from relaunch.faults.plan import PlannedFault, parse_plan
from relaunch.files import load_cluster, load_job, read_document
from relaunch.policy import ClusterView, Decision, JobHistory, PodView, plan
from relaunch.spec import JobSpec, RecoverySettings, parse_job, process_recovery_env


@app.command(cls=TorchrunForm)
def validate(
    ctx: typer.Context,
    file: Annotated[
        Path,
        typer.Argument(
            help="Job spec, YAML or JSON; or, in torchrun's form, the training script and its "
            "arguments.",
            metavar="JOB_FILE | SCRIPT [ARGS]...",
        ),
    ],
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
    """Check a job spec (and a fault plan against it): its effective recovery settings, or every
    problem (exit 2); in torchrun's form (`--nnodes 2 train.py`), the job `relaunch run` builds."""
    launch = LaunchOptions.of(ctx)
    try:
        document = launch_document(ctx, file, launch)
        job = load_job(file) if document is None else parse_job(document[0], source=document[1])
        table, rules = service.table_from(fault_table)
        plan = _checked_plan(faults_file, cluster_file, job)
    except InputError as error:
        raise fail_input(error) from None
    if as_json:
        out.print_json(json.dumps(_settings_json(job, table, rules, plan), default=str))
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


def _checked_plan(
    faults_file: Path | None, cluster_file: Path | None, job: JobSpec
) -> tuple[PlannedFault, ...]:
    """The fault plan of `faults_file` (none without one), each entry checked to hit a target of
    `job` on the cluster of `cluster_file` (the default cluster without one)."""
    if faults_file is None:
        return ()
    source = str(faults_file)
    cluster = load_cluster(cluster_file) if cluster_file else parse_cluster(None)
    plan = parse_plan(read_document(faults_file), source=source)
    service.check_plan_fits(
        service.plan_entries(read_document(faults_file), source), job, cluster, source
    )
    return plan


def _settings_json(
    job: JobSpec, table: FaultCodeTable, rules: EscalationRules, plan: tuple[PlannedFault, ...]
) -> dict[str, object]:
    """`--json`: the job's effective settings, its ladder per fault and its fault plan."""
    return {
        "name": job.name,
        "replicas": job.replicas,
        "procs_per_pod": job.procs_per_pod,
        "chips_per_pod": job.chips_per_pod,
        "warm_spares": job.warm_spares,
        "command": list(job.command),
        "labels": dict(job.labels),
        "recovery": asdict(job.recovery),
        "process_recovery_env": process_recovery_env(job.recovery),
        "ladder": {
            name: [d.action.value for d in steps] for name, steps in _ladder(job, table, rules)
        },
        "fault_plan": [e.describe() for e in plan],
    }


def _print_settings(file: Path, job: JobSpec) -> None:
    r = job.recovery
    out.print(f"[bold green]valid[/]: {file} defines job [bold]{job.name}[/]", highlight=False)
    out.print(
        f"  {job.replicas} pod(s) x {job.procs_per_pod} process(es), {job.chips_per_pod} chip(s) "
        f"per pod; command: {' '.join(job.command)}",
        markup=False,
        highlight=False,
    )
    out.print(_levels(r))
    stop = (
        "SIGKILL at once"
        if r.termination_grace_s == 0
        else f"SIGTERM, SIGKILL after {duration(r.termination_grace_s)}"
    )
    out.print(
        f"  stopping processes: {stop} (a hung job: at most {duration(r.hang_grace_s)}); "
        f"max_restarts {r.max_restarts}; monitor every {r.monitor_interval_s:g} s",
        highlight=False,
    )
    env = process_recovery_env(r)
    if env:
        out.print("  injected: " + " ".join(f"{k}={v}" for k, v in env.items()), markup=False)


_MINDIO_ONLY = (
    "a MindSpore job: MindIO rebuilds its communicator (Ascend); relaunch's keeper rebuilds "
    "torch.distributed's only, so its faults go a level down (R-46); R-07's variables are set"
)


def _levels(r: RecoverySettings) -> Table:
    """Which recovery levels the job has on, with each one's budget or setting."""
    levels = Table(title="Recovery levels", title_justify="left", show_edge=False)
    levels.add_column("level")
    levels.add_column("state")
    levels.add_column("budget / setting")
    on, off = "[green]on[/]", "[dim]off[/]"
    process = ", ".join(s.value for s in r.recover_strategies) if r.process_level else "-"
    state = r.process_recovery.value
    if r.process_level_asked and not r.process_level:
        process, state = _MINDIO_ONLY, "MindIO's"
    retry = r.operator_retry
    levels.add_row(
        "operator level (R-29)",
        on if retry is not None else off,
        (
            f"{retry.max_count} re-issue(s), the first {retry.hold_s:g} s after the failure, "
            f"{retry.interval_s:g} s apart: rides out a link down up to {retry.rides_out_s:g} s "
            "(HoldTime + (MaxCnt - 1) x IntervalTime); only for collectives the SDK's keeper issues "
            "(DDP's buckets, keeper.all_reduce): a script without it never gets this level"
        )
        if retry is not None
        else "HCCL_OP_RETRY_ENABLE with L1:1 in spec.env turns it on (with process-level recovery)",
    )
    levels.add_row(
        "process level (R-30..R-36)",
        on if r.process_level else f"[yellow]{state}[/]",
        process,
    )
    levels.add_row(
        "in-place recovery (R-20)", on if r.auto_restart else off, "does not consume restarts"
    )
    levels.add_row(
        "restart upon suspension (R-24)",
        on if r.hang_retry else off,
        f"hang after {duration(r.hang_detect_s)} without progress; 3 in a row fail the job",
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
    return levels


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
        (
            "a collective fails (its link)",
            Fault(FaultKind.COLLECTIVE, 0.0, pod=last, rank=rank, step=1, collective=0),
        ),
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
        table, rules = service.table_from(fault_table)
    except InputError as error:
        raise fail_input(error) from None
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
        f"escalation: {rules.threshold} in a row within {duration(rules.window_s)} isolates the "
        f"node; released after {duration(rules.release_after_s)} without a fault",
        highlight=False,
    )


# ---------------------------------------------------------------------------------------------
# Running jobs on the embedded cluster
# ---------------------------------------------------------------------------------------------
