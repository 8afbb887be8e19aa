"""``depctl ps`` and ``depctl top``: what each deployment is doing now (the daemon's last seconds, not a lifetime
average), and a live view of it with sparklines."""

from __future__ import annotations

import time

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from depctl import output
from depctl.cli._common import daemon_client, handle_errors
from depctl.client import Client, tree_rss
from depctl.output import Format, fmt_bytes, fmt_num, fmt_rate, sparkline


def _rows(client: Client) -> list[dict]:
    rows = []
    for d in client.deployments():
        recent = d.get("recent") or {}
        rows.append(
            {
                "id": d["id"],
                "state": d["state"],
                "model": d.get("model"),
                "speculation": d.get("speculation"),
                "running": d.get("num_requests_running", 0),
                "waiting": d.get("num_requests_waiting", 0),
                "tokens_per_second": recent.get("tokens_per_second"),
                "acceptance_rate": recent.get("acceptance_rate"),
                "memory_bytes": d.get("memory_bytes"),
                "series": recent.get("series") or {},
            }
        )
    return rows


def _ps_table(data: dict) -> Table:
    table = output.make_table(
        "ID", "STATE", "RUNNING", "WAITING", "TOK/S (10s)", "ACCEPT (60s)", "MEMORY", "MODEL", whole=1
    )
    for r in data["deployments"]:
        table.add_row(
            r["id"],
            r["state"],
            str(r["running"]),
            str(r["waiting"]),
            fmt_num(r["tokens_per_second"], 1),
            fmt_rate(r["acceptance_rate"]),
            fmt_bytes(r["memory_bytes"]),
            r["model"] or "-",
        )
    table.caption = f"daemon pid {data['pid']}, {fmt_bytes(data['memory_bytes'])} resident"
    return table


def _snapshot(client: Client) -> dict:
    return {
        "pid": client.info.pid,
        "memory_bytes": tree_rss(client.info.pid),
        "deployments": _rows(client),
    }


@handle_errors
def ps(fmt: Format = typer.Option(Format.table, "--output", "-o", metavar="[table|json|yaml]")) -> None:
    """What each deployment is doing now: state, requests running and waiting, tok/s over the last 10 s, acceptance
    over the last minute, memory."""
    data = _snapshot(daemon_client())
    if fmt != Format.table:
        for r in data["deployments"]:
            r.pop("series")
    output.emit(data, fmt, _ps_table)


def _top_view(data: dict, width: int) -> Group:
    spark = max(10, min(60, (width - 70) // 2))
    table = Table(box=None, header_style="bold", pad_edge=False, expand=False)
    for name, justify in (
        ("ID", "left"),
        ("STATE", "left"),
        ("RUN/WAIT", "right"),
        ("TOK/S", "right"),
        (f"TOK/S, LAST {spark}s", "left"),
        ("ACCEPT", "right"),
        (f"ACCEPTANCE, LAST {spark}s", "left"),
        ("MEMORY", "right"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)
    for r in data["deployments"]:
        series = r["series"]
        table.add_row(
            Text(r["id"], style="bold"),
            Text(r["state"], style="green" if r["state"] == "READY" else "yellow"),
            f"{r['running']}/{r['waiting']}",
            fmt_num(r["tokens_per_second"], 1),
            Text(sparkline(series.get("tokens_per_second", []), spark), style="cyan"),
            fmt_rate(r["acceptance_rate"]),
            Text(sparkline(series.get("acceptance_rate", []), spark, top=1.0), style="magenta"),
            fmt_bytes(r["memory_bytes"]),
        )
    title = Text.assemble(
        ("depctl top", "bold"),
        f"  daemon pid {data['pid']}, {fmt_bytes(data['memory_bytes'])} resident  ",
        (time.strftime("%H:%M:%S"), "dim"),
        ("  Ctrl-C to quit", "dim"),
    )
    if not data["deployments"]:
        return Group(title, Text("No deployments: create one with `depctl deployment create MODEL`."))
    return Group(title, table)


@handle_errors
def top(
    interval: float = typer.Option(1.0, "--interval", metavar="SECONDS", min=0.25, help="Seconds between updates."),
) -> None:
    """A live view of every deployment: throughput and acceptance with sparklines of the last minute, requests
    running and waiting, memory."""
    client = daemon_client()
    console = output.out()
    try:
        with Live(
            _top_view(_snapshot(client), console.width), console=console, screen=False, auto_refresh=False
        ) as live:
            while True:
                time.sleep(interval)
                live.update(_top_view(_snapshot(client), console.width), refresh=True)
    except KeyboardInterrupt:
        pass
