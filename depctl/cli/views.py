"""What `depctl deployment` shows: the list's table, a deployment's detail view (a table of rows, each a label and a
cell that may leave its row out), and the line a wait shows while a deployment loads."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from rich.table import Table
from rich.text import Text

from depctl import output, recordings
from depctl.output import fmt_bytes, fmt_num, fmt_rate
from depctl.spec import DeploymentSpec, describe_duration, describe_engine, describe_speculation


def _describe_head(head: dict) -> str:
    layers = ", ".join(map(str, head["aux_layers"]))
    return f"drafts from the target's layers {layers}, over its {head['draft_vocab_size']} most used tokens"


def _per_position(stats: dict) -> str:
    """Accepted drafts at each position, with the acceptance there (of the drafts that reached it where the engine
    counts those, else of all drafts, as vLLM's counters give it)."""
    accepted = stats.get("accepted_per_position") or []
    reached = stats.get("drafted_per_position") or [stats.get("drafts") or 0] * len(accepted)
    return ", ".join(f"{a} ({fmt_rate(a / d if d else None)})" for a, d in zip(accepted, reached)) or "-"


def list_table(rows: list[dict]) -> Table:
    table = output.make_table(
        "ID", "MODEL", "ENGINE", "SPECULATION", "STATE", "ACCEPTANCE", "MEAN LEN", "TOK/S (10s)", whole=2
    )
    for r in rows:
        stats = r["status"].get("stats") or {}
        spec = r.get("speculation")
        table.add_row(
            r["id"],
            r.get("model", "-"),
            _engine_cell(r),
            describe_speculation(_spec_obj(spec)) if spec else "-",
            _state_cell(r["status"]),
            fmt_rate(stats.get("acceptance_rate")),
            fmt_num(stats.get("mean_acceptance_length")),
            fmt_num((r["status"].get("recent") or {}).get("tokens_per_second"), 1),
        )
    return table


def _engine_cell(r: dict) -> str:
    if "engine" not in r:
        return "-"
    spec = DeploymentSpec.model_validate({k: v for k, v in r.items() if k in DeploymentSpec.model_fields})
    return describe_engine(spec)


def _spec_obj(speculation: dict):
    return DeploymentSpec.model_validate({"id": "x", "model": "x", "speculation": speculation}).speculation


def _vllm_note(info: dict | None) -> str:
    if not info:
        return ""
    parts = [f"vLLM {info['version']}" if info.get("version") else "vLLM"]
    if info.get("pid"):
        parts.append(f"pid {info['pid']}")
    if info.get("restarts"):
        parts.append(f"{info['restarts']} restarts")
    return f" ({', '.join(parts)})"


def _state_cell(status: dict) -> Text:
    colour = {"READY": "green", "FAILED": "red", "UNKNOWN": "yellow", "IDLE": "blue"}.get(status["state"], "cyan")
    since = status.get("state_since")
    elapsed = f" for {time.time() - since:.0f}s" if since and status["state"] in ("CREATING", "UPDATING") else ""
    return Text(status["state"] + elapsed, style=colour)


@dataclass(frozen=True)
class _Detail:
    """One deployment as ``get`` shows it: its record, the daemon's status and the status's counters."""

    r: dict
    status: dict
    stats: dict

    def running(self, key: str, template: str) -> str:
        """`` (running: ...)`` when the daemon reports ``key``, else nothing."""
        return template.format(self.status[key]) if self.status.get(key) else ""


def _memory_cell(d: _Detail) -> str | None:
    total, weights = d.status.get("memory_bytes"), d.status.get("weights_bytes")
    if not total:
        return None
    parts = (
        f"weights {output.fmt_bytes(weights)}, KV cache {output.fmt_bytes(total - weights)}"
        if weights and weights <= total
        else "weights and KV cache"
    )
    return f"{output.fmt_bytes(total)} ({parts})"


def _recording_cell(d: _Detail) -> str | None:
    dep_id = d.r["id"]
    if not (d.r.get("record_prompts") or recordings.path(dep_id).exists()):
        return None
    state, kept = "on" if d.r.get("record_prompts") else "off", recordings.count(dep_id)
    return f"{state}, {kept} prompt{'' if kept == 1 else 's'} in {recordings.path(dep_id)}"


def _sampling_cell(d: _Detail) -> str | None:
    """The defaults a request that leaves them out gets (None: OpenAI's, nothing to show)."""
    given = {k: v for k, v in (d.r.get("sampling") or {}).items() if v is not None}
    return ", ".join(f"{k} {v}" for k, v in given.items()) + " (where a request sets none)" if given else None


def _now_cell(d: _Detail) -> str | None:
    recent = d.status.get("recent")
    if not recent or recent.get("tokens_per_second") is None:
        return None
    return (
        f"{fmt_num(recent['tokens_per_second'], 1)} tok/s (last {recent['window_seconds']:.0f}s), acceptance "
        f"{fmt_rate(recent['acceptance_rate'])} (last {recent['acceptance_window_seconds']:.0f}s)"
    )


def _suffix_cell(d: _Detail) -> str | None:
    index = d.status.get("suffix_index")
    if not index:
        return None
    return (
        f"{index['requests']} requests, {index['tokens']} / {index['budget_tokens']} tokens "
        f"({index['evicted_requests']} evicted); {index['hits']} of {index['lookups']} lookups drafted"
    )


def _prefix_cell(d: _Detail) -> str | None:
    cache = d.status.get("prefix_cache")
    if not cache:
        return None
    rate = cache["hits"] / cache["queries"] if cache["queries"] else None
    shared = ", shared by all users" if d.r.get("prefix_cache_scope") == "deployment" else ""
    answers = f", {cache['from_answers']} read from answers while idle" if cache.get("from_answers") else ""
    # mid-block: prompts resume wherever a stored one ended; else at whole blocks (prompt passes round by chunk here)
    unit = "blocks and tails of up to" if cache.get("mid_block") else "blocks of"
    return (
        f"{cache['blocks']} {unit} {cache['block_tokens']} tokens{shared}, {fmt_bytes(cache['bytes'])} of "
        f"{fmt_bytes(cache['budget_bytes'])}; {cache['hits']} of {cache['queries']} prompt tokens found "
        f"({fmt_rate(rate)}), {cache['evictions']} blocks evicted{answers}"
    )


def _learned_head_cell(d: _Detail) -> str | None:
    learning = d.status.get("learning")
    if not learning:
        return None
    if not learning["generation"]:
        return "none yet: drafting with the n-gram or suffix index until a head drafts better"
    live = learning.get("live") or {}
    now = f", {fmt_num(live['mean_accepted'])} accepted a step it drafted serving" if live.get("mean_accepted") else ""
    start = f" (learning from the head in {learning['started_from']})" if learning.get("started_from") else ""
    if learning["held_out_mean_accepted"] is None:  # the head it started from, not yet measured on this traffic
        return f"generation {learning['generation']}{start}: not yet compared on this deployment's answers{now}"
    return (
        f"generation {learning['generation']}{start}: {fmt_num(learning['held_out_mean_accepted'])} mean accepted "
        f"length on held-out recent answers{now}"
    )


def _head_training_cell(d: _Detail) -> str | None:
    learning = d.status.get("learning")
    if not learning:
        return None
    t, traffic = learning["training"], learning["traffic"]
    error = f" ({learning['error']})" if learning.get("error") else ""
    shipped, written = t.get("shipped_prompts"), t.get("requests_written")
    idle = [f"{shipped['answered']} of {shipped['total']} shipped prompts"] if shipped else []
    idle += [f"{written} requests the target wrote"] if written else []
    among = f", {' and '.join(idle)} among them" if idle else ""
    vocabulary = (
        f"; drafting within the tokens of {t['vocabulary_answers']} answers" if t.get("vocabulary_answers") else ""
    )
    return (
        f"{t['state']}{error}; {t['minutes']:.1f} min, {t['optimizer_steps']} steps over {t['positions']} positions; "
        f"{traffic['answers']} answers recorded ({traffic['held_out']} held out{among}), "
        f"{fmt_bytes(traffic['bytes'])} of {fmt_bytes(traffic['budget_bytes'])} on disk{vocabulary}"
    )


def _head_history_cell(d: _Detail) -> str | None:
    """The last comparisons, oldest first: when, the candidate's held-out score against the serving one's."""
    history = (d.status.get("learning") or {}).get("history") or []
    if not history:
        return None
    parts = []
    for h in history[-6:]:
        against = f" vs {fmt_num(h['serving'])}" if h.get("serving") is not None else ""
        verdict = f" -> generation {h['generation']}" if h["promoted"] else " (kept)"
        parts.append(f"{h['at'][11:16]} {fmt_num(h['candidate'])}{against}{verdict}")
    return "; ".join(parts)


def _policy(d: _Detail) -> dict:
    policy = d.status.get("policy") or {}
    return policy if policy.get("max_draft_tokens") else {}


_STEP_KINDS = {"free": "free guesses", "model": "draft model"}


def _guard_cell(d: _Detail) -> str | None:
    """Per band of batch sizes measured, each kind of drafting step's tokens a second over plain steps' there, and
    where the guard turned it off."""
    bands = _policy(d).get("drafting_over_plain") or {}
    parts = []
    for band in bands.values():
        kinds = [(k, band[k]) for k in _STEP_KINDS if k in band]
        if not kinds:  # plain steps only so far: nothing to compare
            continue
        named = len(kinds) > 1
        cells = [
            f"{_STEP_KINDS[k] + ' ' if named else ''}{g['ratio']:.2f}x{' (off)' if g['off'] else ''}" for k, g in kinds
        ]
        rows = "1 row" if band["sizes"] == "1" else f"{band['sizes']} rows"
        parts.append(f"{rows}: {', '.join(cells)}")
    return "; ".join(parts) or None


def _counted(cell: Callable[[_Detail], str | None]) -> Callable[[_Detail], str | None]:
    """A row of the counters: shown once the daemon reports them."""
    return lambda d: cell(d) if d.stats else None


# ``deployment get``'s rows in order: a label (or a function of the deployment) and its cell, None to leave the row out
_DETAIL_ROWS: tuple[tuple[str | Callable[[_Detail], str], Callable[[_Detail], str | Text | None]], ...] = (
    ("ID", lambda d: d.r["id"]),
    ("Display name", lambda d: d.r.get("display_name") or "-"),
    ("Model", lambda d: d.r.get("model", "-")),
    ("Speculation", lambda d: describe_speculation(_spec_obj(d.r["speculation"])) if d.r.get("speculation") else "-"),
    ("Engine", lambda d: _engine_cell(d.r) + _vllm_note(d.status.get("vllm"))),
    (
        "Device / dtype",
        lambda d: (
            f"{d.r.get('device')} / {d.r.get('dtype')}"
            + (f" (running on {d.status['device']} / {d.status['dtype']})" if d.status.get("device") else "")
        ),
    ),
    ("Matrix products", lambda d: d.status.get("products") or None),
    (
        "Quantization",
        lambda d: (
            d.r["quantization"] + d.running("weights", " (running: {})")
            if d.r.get("quantization", "none") != "none"
            else None
        ),
    ),
    ("Draft precision", lambda d: d.status.get("draft_precision") or None),
    ("EAGLE head", lambda d: _describe_head(d.status["eagle_head"]) if d.status.get("eagle_head") else None),
    ("Learned head", _learned_head_cell),
    ("Head training", _head_training_cell),
    ("Head comparisons", _head_history_cell),
    (
        "Compiled passes",
        lambda d: ("on" if d.r.get("compile", True) else "off") + d.running("compiled", " (running: {})"),
    ),
    ("Max batch size", lambda d: str(d.r.get("max_batch_size", "-"))),
    (
        "Context",
        lambda d: (
            f"{d.r.get('max_context_length') or 'the model’s'}" + d.running("max_context", " (running: {} tokens)")
        ),
    ),
    ("State", lambda d: _state_cell(d.status)),
    (
        "Requests running / waiting",
        lambda d: (
            f"{d.status['num_requests_running']} / {d.status['num_requests_waiting']}"
            if "num_requests_running" in d.status
            else None
        ),
    ),
    ("Reason", lambda d: d.status.get("reason") or None),
    ("Prompt recording", _recording_cell),
    (
        "Keep alive",
        lambda d: (
            f"{describe_duration(d.r['keep_alive'])}, then unloaded until the next request"
            if d.r.get("keep_alive")
            else None
        ),
    ),
    ("Sampling defaults", _sampling_cell),
    ("Now", _now_cell),
    ("Memory", _memory_cell),
    ("Requests", _counted(lambda d: str(d.stats["requests"]))),
    ("Generated tokens", _counted(lambda d: str(d.stats["generated_tokens"]))),
    (
        "Decode speed (lifetime)",
        _counted(
            lambda d: (
                f"{fmt_num(d.stats['decode_tokens_per_second'], 1)} tok/s"
                if d.stats.get("decode_tokens_per_second") is not None
                else None
            )
        ),
    ),
    (
        lambda d: "Acceptance rate" + (" (vLLM's counters)" if d.stats.get("source") == "vllm" else ""),
        _counted(lambda d: fmt_rate(d.stats["acceptance_rate"])),
    ),
    ("Mean acceptance length", _counted(lambda d: fmt_num(d.stats["mean_acceptance_length"]))),
    (
        "Drafts / draft tokens / accepted",
        _counted(lambda d: f"{d.stats['drafts']} / {d.stats['draft_tokens']} / {d.stats['accepted_tokens']}"),
    ),
    ("Accepted per position", _counted(lambda d: _per_position(d.stats))),
    (
        "Time drafting / verifying",
        _counted(
            lambda d: (
                f"{d.stats['draft_seconds']:.2f}s / {d.stats['verify_seconds']:.2f}s"
                if "draft_seconds" in d.stats
                else None
            )
        ),
    ),
    (
        "Grammar drafts / accepted / time",
        _counted(  # shown once a request used a grammar
            lambda d: (
                f"{d.stats['grammar_draft_tokens']} / {d.stats['grammar_accepted_tokens']} / "
                f"{d.stats['grammar_seconds']:.2f}s"
                if d.stats.get("grammar_seconds")
                else None
            )
        ),
    ),
    (
        "Pass cost (tokens: ms)",
        lambda d: ", ".join(f"{n}: {v}" for n, v in _policy(d)["verify_ms"].items()) if _policy(d) else None,
    ),
    (
        "Draft forward (rows: ms)",
        lambda d: (
            ", ".join(f"{n}: {v}" for n, v in _policy(d)["draft_ms"].items()) if _policy(d).get("draft_ms") else None
        ),
    ),
    (
        "Draft start (rows: ms)",  # a step's first drafted position: the draft's catch-up and its first forward
        lambda d: (
            ", ".join(f"{n}: {v}" for n, v in _policy(d)["draft_start_ms"].items())
            if _policy(d).get("draft_start_ms")
            else None
        ),
    ),
    (
        "Tree pass cost (tokens: ms)",
        lambda d: (
            ", ".join(f"{n}: {v}" for n, v in _policy(d)["tree_ms"].items()) if _policy(d).get("tree_ms") else None
        ),
    ),
    ("Drafting steps vs plain", _guard_cell),
    ("Suffix index", _suffix_cell),
    ("Prefix cache", _prefix_cell),
    (
        "Created / updated",
        lambda d: f"{d.r['created_at']} / {d.r['updated_at']}" if d.r.get("created_at") else None,
    ),
)


def detail_table(r: dict) -> Table:
    table = output.make_grid()
    d = _Detail(r, r["status"], r["status"].get("stats") or {})
    for label, cell in _DETAIL_ROWS:
        value = cell(d)
        if value is not None:
            table.add_row(Text(label(d) if callable(label) else label, style="bold"), value)
    return table


def wait_line(dep_id: str, status: dict) -> tuple[str, float | None]:
    """What a wait shows: the state, the stage of the load with how long it has run, and how far it is if known."""
    stage = status.get("stage")
    if not stage:
        return f"{dep_id}: {status['state'].lower()}", None
    took = time.time() - stage["since"]
    detail = f" {stage['detail']}" if stage.get("detail") else ""
    return f"{dep_id}: {stage['name']}{detail} ({took:.0f}s)", stage.get("fraction")
