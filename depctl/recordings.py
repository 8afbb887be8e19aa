"""Prompts a deployment has served, kept only where its owner turned recording on (``--record-prompts``), to train a
draft head on the deployment's own traffic (``depctl draft train TARGET --from-deployment ID``).

One JSONL file a deployment beside the specs (``HOME/recordings/ID.jsonl``), in the format ``depctl draft train
--data`` reads: a chat request's messages up to its last user turn (text only), a completion's prompt. Answers are
never kept: training regenerates them with the target. The file stops growing at ``MAX_BYTES`` and is deleted with
the deployment (``SpecStore.delete``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from depctl import config

MAX_BYTES = 64 << 20  # about 50,000 chat prompts: far more than a head trains on in an hour


def path(deployment_id: str) -> Path:
    return config.home() / "recordings" / f"{deployment_id}.jsonl"


def record(deployment_id: str, example: dict) -> bool:
    """Append one example (``{"messages": [...]}`` or ``{"prompt": "..."}``); False once the file is full. One
    ``write`` of one line to a file opened for appending: concurrent requests never interleave their lines."""
    target = path(deployment_id)
    line = (json.dumps(example, ensure_ascii=False) + "\n").encode()
    try:
        if target.stat().st_size + len(line) > MAX_BYTES:
            return False
    except FileNotFoundError:
        target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # prompts are the users' text: owner only
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return True


def count(deployment_id: str) -> int:
    try:
        with path(deployment_id).open("rb") as fh:
            return sum(1 for _ in fh)
    except FileNotFoundError:
        return 0


def delete(deployment_id: str) -> None:
    path(deployment_id).unlink(missing_ok=True)


def chat_example(messages) -> dict | None:
    """A chat request's messages as training data: text contents, up to the last user turn (None without one)."""
    kept = []
    for m in messages:
        role = getattr(m, "role", None)
        content = getattr(m, "content", None)
        if isinstance(content, list):  # content parts: their text
            content = "".join(getattr(p, "text", None) or "" for p in content)
        if role in ("system", "developer", "user", "assistant") and isinstance(content, str) and content:
            kept.append({"role": role, "content": content})
    last_user = max((i for i, m in enumerate(kept) if m["role"] == "user"), default=None)
    return None if last_user is None else {"messages": kept[: last_user + 1]}
