"""``depctl deployment bench ID``: the same prompts through one deployment with speculation off and on.

Both runs use the same loaded engine (a request can ask to decode plainly), alternating per prompt, greedy, so
the speedup is measured under identical conditions and every output can be checked against plain decoding.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from depctl import output, workloads
from depctl.cli._common import DEPLOYMENT_ID, OUTPUT, daemon_client, handle_errors
from depctl.output import Format


def _chart(d: dict) -> Table:
    """Plain against speculative tok/s as bars, and each prompt's speedup as a sparkline."""
    top = max(d["plain_tok_s"], d["speculative_tok_s"])
    grid = output.make_grid()
    grid.add_row("plain", Text(output.bar(d["plain_tok_s"], top, 40), style="blue"), f"{d['plain_tok_s']:.1f} tok/s")
    grid.add_row(
        "speculative",
        Text(output.bar(d["speculative_tok_s"], top, 40), style="green"),
        f"{d['speculative_tok_s']:.1f} tok/s ({d['speedup']:.2f}x)",
    )
    per = d["speedup_per_prompt"]
    if len(per) > 1:
        grid.add_row(
            "per prompt",
            Text(output.sparkline(per, min(len(per), 40)), style="magenta"),
            f"speedup {min(per):.2f}x to {max(per):.2f}x",
        )
    return grid


@handle_errors
def bench(
    deployment_id: str = DEPLOYMENT_ID,
    workload: str = typer.Option(
        "grounded", "--workload", metavar="NAME", help="A prompt set depctl ships: grounded, chat or code."
    ),
    prompts_file: Optional[Path] = typer.Option(
        None, "--prompts", metavar="FILE", help='A JSONL file of {"prompt": ...} lines.'
    ),
    max_tokens: int = typer.Option(128, "--max-tokens", metavar="N", min=1, help="Most tokens each answer generates."),
    limit: Optional[int] = typer.Option(None, "--limit", metavar="N", min=1, help="Only the first N prompts."),
    fmt: Format = OUTPUT,
) -> None:
    """Measure a deployment's speedup: its prompts with speculation off and on, alternating, greedy."""
    prompts = workloads.load(workload, prompts_file)[:limit]
    client = daemon_client()
    totals = {False: [0.0, 0], True: [0.0, 0]}
    drafted = accepted = 0
    exact = True
    speedups = []
    with output.progress() as progress:
        task = progress.add_task(f"{deployment_id}: plain and speculative, prompt by prompt", total=len(prompts))
        for i, prompt in enumerate(prompts):
            texts, rates = {}, {}
            for speculate in (False, True) if i % 2 == 0 else (True, False):
                body = {
                    "model": deployment_id,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "speculate": speculate,
                }
                t0 = time.perf_counter()
                r = client.chat_completion(body)
                seconds = time.perf_counter() - t0
                totals[speculate][0] += seconds
                totals[speculate][1] += r["usage"]["completion_tokens"]
                rates[speculate] = r["usage"]["completion_tokens"] / seconds
                texts[speculate] = r["choices"][0]["message"]["content"]
                if speculate:
                    drafted += r["usage"]["speculation"]["drafted_tokens"]
                    accepted += r["usage"]["speculation"]["accepted_tokens"]
            exact &= texts[True] == texts[False]
            speedups.append(round(rates[True] / rates[False], 3))
            progress.advance(task)
    off = totals[False][1] / totals[False][0]
    on = totals[True][1] / totals[True][0]
    data = {
        "deployment": deployment_id,
        "workload": prompts_file.name if prompts_file else workload,
        "prompts": len(prompts),
        "tokens": totals[True][1],
        "plain_tok_s": round(off, 2),
        "speculative_tok_s": round(on, 2),
        "speedup": round(on / off, 3),
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "identical_output": exact,
        "speedup_per_prompt": speedups,
    }

    def table(d):
        t = output.make_table(
            "WORKLOAD", "PROMPTS", "PLAIN TOK/S", "SPECULATIVE TOK/S", "SPEEDUP", "ACCEPTANCE", "IDENTICAL"
        )
        t.add_row(
            d["workload"],
            str(d["prompts"]),
            f"{d['plain_tok_s']:.1f}",
            f"{d['speculative_tok_s']:.1f}",
            f"{d['speedup']:.2f}x",
            output.fmt_rate(d["acceptance_rate"]),
            "yes" if d["identical_output"] else "NO",
        )
        return Group(t, Text(""), _chart(d))

    output.emit(data, fmt, table)
