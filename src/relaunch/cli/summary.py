"""A job's fault-recovery details, as `relaunch run` ends and `relaunch describe` prints them."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from relaunch.cli.common import out

__all__ = ["print_summary"]


def print_summary(summary: dict[str, Any]) -> None:
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
