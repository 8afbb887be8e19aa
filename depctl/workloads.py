"""The prompt sets depctl ships (``depctl/data/prompts``): what ``deployment bench`` and the benchmarks run.

grounded: answers that quote or edit their prompt; chat: open-ended questions; code: code to write or change;
structured: JSON extraction, function calls and free JSON, each line with the ``schema`` its answer must match
(``benchmarks/structured.py`` sends it as ``response_format``).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from depctl.errors import UsageError


def prompts_dir() -> Path:
    return Path(str(resources.files("depctl") / "data" / "prompts"))


def names() -> list[str]:
    return sorted(p.stem for p in prompts_dir().glob("*.jsonl"))


def load(workload: str | None = None, path: Path | None = None) -> list[str]:
    """The prompts of a shipped workload, or of a JSONL file of ``{"prompt": ...}`` lines."""
    path = path or prompts_dir() / f"{workload}.jsonl"
    if not path.is_file():
        raise UsageError(
            f"no prompt set at {path} (workloads: {', '.join(names()) or 'none found'})",
            "pass --workload NAME or --prompts FILE.jsonl",
        )
    try:
        return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f'{path}: every line must be a JSON object with a "prompt" ({exc})') from None
