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
from depctl.cli._common import OUTPUT, daemon_client, handle_errors
from depctl.client import Client, tree_rss
from depctl.output import Format, fmt_bytes, fmt_num, fmt_rate, sparkline


def _rows(client: Client) -> list[dict]:
    rows = []
    for d in client.deployments():
        recent = d.get("recent") or {}
        cache = d.get("prefix_cache") or {}
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
                # the share of prompt tokens the prefix cache held (vLLM's prefix_cache_hits / queries)
                "cached_rate": cache["hits"] / cache["queries"] if cache.get("queries") else None,
                "series": recent.get("series") or {},
                "learning": _learning(d.get("learning")),
            }
        )
    return rows


def _learning(status: dict | None) -> dict | None:
    """A learning head's generation, its held-out score and the training's state, as ps and top show them."""
    if not status:
        return None
    return {
        "generation": status["generation"],
        "held_out_mean_accepted": status.get("held_out_mean_accepted"),
        "training": status["training"]["state"],
        "trained_minutes": status["training"]["minutes"],
        "answers": status["traffic"]["answers"],
    }


def _learning_lines(rows: list[dict]) -> list[Text]:
    lines = []
    for r in rows:
        h = r.get("learning")
        if h:
            score = f" ({fmt_num(h['held_out_mean_accepted'])} accepted on held-out answers)" if h["generation"] else ""
            lines.append(
                Text.assemble(
                    (r["id"], "bold"),
                    f": learned head generation {h['generation']}{score}; {h['training']}, "
                    f"{h['trained_minutes']:.1f} min trained on {h['answers']} answers",
                )
            )
    return lines


def _ps_table(data: dict) -> Table:
    # no wrapping: a row stays one line in 80 columns, every column but MODEL at its full width, and a model name
    # too long for what is left ends in an ellipsis
    rows = [
        [
            r["id"],
            r["state"],
            str(r["running"]),
            str(r["waiting"]),
            fmt_num(r["tokens_per_second"], 1),
            fmt_rate(r["acceptance_rate"]),
            fmt_rate(r.get("cached_rate")),
            fmt_bytes(r["memory_bytes"]),
            r["model"] or "-",
        ]
        for r in data["deployments"]
    ]
    table = Table(box=None, header_style="bold", pad_edge=False)
    widest = [max([len(name), *(len(row[i]) for row in rows)]) for i, (name, _) in enumerate(PS_COLUMNS)]
    room = max(len("MODEL"), output.out().width - sum(widest[:-1]) - 2 * (len(widest) - 1))
    for (name, justify), width in zip(PS_COLUMNS, widest[:-1] + [min(widest[-1], room)]):
        table.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis", width=width)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    table.caption = (
        "tok/s: last 10 s, accept: last 60 s, cached: share of prompt from the prefix cache; "
        f"daemon pid {data['pid']}, {fmt_bytes(data['memory_bytes'])}"
    )
    return table


PS_COLUMNS = (
    ("ID", "left"),
    ("STATE", "left"),
    ("RUN", "right"),
    ("WAIT", "right"),
    ("TOK/S", "right"),
    ("ACCEPT", "right"),
    ("CACHED", "right"),
    ("MEMORY", "right"),
    ("MODEL", "left"),
)


def _snapshot(client: Client) -> dict:
    return {
        "pid": client.info.pid,
        "memory_bytes": tree_rss(client.info.pid),
        "deployments": _rows(client),
    }


@handle_errors
def ps(fmt: Format = OUTPUT) -> None:
    """What each deployment is doing now: state, requests running and waiting, tok/s over the last 10 s, acceptance
    over the last minute, the share of prompts found in the prefix cache, memory."""
    data = _snapshot(daemon_client())
    if fmt != Format.table:
        for r in data["deployments"]:
            r.pop("series")
    output.emit(data, fmt, _ps_table)


def _top_view(data: dict, width: int) -> Group:
    """The deployments' table at ``width`` columns: the numbers always, sparklines of the last seconds beside them
    where they fit (at least 10 columns each; 80 columns have no room for them)."""
    rows = data["deployments"]
    id_width = min(24, max([2, *(len(r["id"]) for r in rows)]))
    state_width = max([5, *(len(r["state"]) for r in rows)])
    numbers = (
        id_width + state_width + len("RUN/WAIT") + len("TOK/S") + 2 + len("ACCEPT") + len("CACHED") + len("MEMORY") + 4
    )
    spark = min(60, (width - numbers - 2 * 6 - 2 * 2) // 2)
    columns = [("ID", "left"), ("STATE", "left"), ("RUN/WAIT", "right"), ("TOK/S", "right")]
    if spark >= 10:
        columns += [(f"TOK/S, {spark}s", "left"), ("ACCEPT", "right"), (f"ACCEPT, {spark}s", "left")]
    else:
        columns += [("ACCEPT", "right")]
    columns += [("CACHED", "right"), ("MEMORY", "right")]
    table = Table(box=None, header_style="bold", pad_edge=False, expand=False)
    for name, justify in columns:
        table.add_column(
            name, justify=justify, no_wrap=True, overflow="ellipsis", max_width=24 if name == "ID" else None
        )
    for r in rows:
        series = r["series"]
        cells = [
            Text(r["id"], style="bold"),
            Text(r["state"], style="green" if r["state"] == "READY" else "yellow"),
            f"{r['running']}/{r['waiting']}",
            fmt_num(r["tokens_per_second"], 1),
        ]
        if spark >= 10:
            cells += [
                Text(sparkline(series.get("tokens_per_second", []), spark), style="cyan"),
                fmt_rate(r["acceptance_rate"]),
                Text(sparkline(series.get("acceptance_rate", []), spark, top=1.0), style="magenta"),
            ]
        else:
            cells += [fmt_rate(r["acceptance_rate"])]
        table.add_row(*cells, fmt_rate(r.get("cached_rate")), fmt_bytes(r["memory_bytes"]))
    title = Text.assemble(
        ("depctl top", "bold"),
        f"  pid {data['pid']}, {fmt_bytes(data['memory_bytes'])}  ",
        (time.strftime("%H:%M:%S"), "dim"),
        ("  Ctrl-C quits", "dim"),
    )
    if not rows:
        return Group(title, Text("No deployments: create one with `depctl deployment create MODEL`."))
    return Group(title, table, *_learning_lines(rows))


@handle_errors
def top(
    interval: float = typer.Option(1.0, "--interval", metavar="SECONDS", min=0.25, help="Seconds between updates."),
) -> None:
    """A live view of every deployment: throughput and acceptance with sparklines of the last minute, requests
    running and waiting, the share of prompts found in the prefix cache, memory."""
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
