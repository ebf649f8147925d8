"""A job's fault-recovery details, as `relaunch run` ends and `relaunch describe` prints them."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table

from relaunch.cli.common import out, visible_all
from relaunch.diagnosis import ranks_text
from relaunch.restores import tiers_text

__all__ = ["print_summary"]


def print_summary(summary: dict[str, Any]) -> None:
    summary = visible_all(summary)  # it quotes what ranks said: never their escape sequences
    colour = "green" if summary["status"] == "Succeeded" else "red"
    out.print(
        f"\n[bold {colour}]{summary['status']}[/]: job {summary['job']} - "
        f"{escape(summary['reason'])}",
        highlight=False,
        soft_wrap=True,
    )
    _records_table(summary)
    _root_causes(summary)
    _goodput(summary.get("goodput"))
    if summary.get("restores"):
        out.print(f"checkpoints restored: {tiers_text(summary['restores'])}", highlight=False)
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
        if f.get("rank") is not None:
            what += f" rank {f['rank']}"
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


TRACEBACK_LINES = 8
"""How many of a root cause's last traceback lines `describe` prints."""


def _root_causes(summary: dict[str, Any]) -> None:
    """Each fault's own account (its exception) and the ranks that failed because of it."""
    for i, r in enumerate(summary["recoveries"], 1):
        f = r["fault"]
        error = f.get("error")
        collateral = r.get("collateral") or []
        hang = r.get("hang")
        if error is None and not collateral and not hang:
            continue
        where = ", ".join(
            part
            for part in (
                f"rank {f['rank']}" if f.get("rank") is not None else "",
                f"pod {f['pod']}" if f.get("pod") is not None else "",
                f["node"] or "",
            )
            if part
        )
        out.print(f"[bold]#{i} root cause[/] ({where}):", highlight=False)
        if error is not None:
            said = (
                f"{error['type']}: {error['message']}"
                if error["type"]
                else f"last output: {error['message']}"
            )
            source = "its error file" if error["source"] == "error-file" else "its last output"
            out.print(f"  {said}", markup=False, highlight=False)
            lines = error["traceback"].splitlines()[-TRACEBACK_LINES:]
            if lines:
                out.print(f"  from {source}:", highlight=False)
                for line in lines:
                    out.print(f"    {line}", markup=False, highlight=False)
        if collateral:
            ranks = ", ".join(
                f"rank {c['rank']}" if c.get("rank") is not None else c["kind"] for c in collateral
            )
            out.print(f"  collateral ({len(collateral)}): {ranks}", highlight=False)
        if hang:
            _hang(hang)


STACK_LINES = 8
"""How many innermost frames of each rank's stack `describe` prints."""


def _hang(hang: dict[str, Any]) -> None:
    """A hang's finding and its stacks, alike ones once with their ranks, the culprits marked."""
    out.print(
        f"  {hang['finding']} (stacks captured in {hang['capture_s']:.2f} s)",
        markup=False,
        highlight=False,
    )
    culprits = set(hang["culprits"])
    for group in hang["stacks"]:
        ranks = group["ranks"]
        who = (
            f"rank {ranks[0]} (pid {group['pids'][0]}, "
            if len(ranks) == 1
            else f"{ranks_text(ranks)} ("
        )
        mark = " <- culprit" if culprits.intersection(ranks) else ""
        out.print(f"  {who}{group['state']}){mark}:", markup=False, highlight=False)
        lines = group["stack"].splitlines()[: STACK_LINES + 1] or [group["error"] or "no stack"]
        for line in lines:
            out.print(f"    {line}", markup=False, highlight=False)


def _goodput(figures: dict[str, Any] | None) -> None:
    """Productive time and the time lost by cause; they add up to the wall time."""
    if not figures:
        return
    lost = ", ".join(f"{cause} {s:.1f} s" for cause, s in figures["lost_s"].items() if s > 0)
    out.print(
        f"goodput: {figures['productive_s']:.1f} s productive of {figures['wall_s']:.1f} s "
        f"(ETTR {figures['ettr']:.1%}); lost: {lost or 'nothing'}",
        highlight=False,
    )
