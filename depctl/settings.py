"""The daemon's settings: where it listens, its API key, and the limits that keep one request from hurting the rest.

Each setting comes from a ``python -m depctl_runtime`` flag, else its environment variable, else the default below;
``depctl daemon start`` takes the same flags and passes them on through the environment (so the key never shows in
``ps``). Every limit's error names the setting that raises it.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, fields

from depctl import config

ALREADY_RUNNING = 3  # the daemon's exit status when another daemon holds the home's lock


@dataclass(frozen=True)
class Setting:
    env: str
    flag: str
    type: type
    default: object
    help: str
    minimum: float | None = None
    metavar: str = "N"


SETTINGS = {
    "host": Setting(
        "DEPCTL_HOST",
        "--host",
        str,
        config.DEFAULT_HOST,
        "address to bind; anything but a loopback address (this machine only) should come with an API key",
        metavar="ADDRESS",
    ),
    "api_key": Setting(
        "DEPCTL_API_KEY",
        "--api-key",
        str,
        None,
        "require `Authorization: Bearer KEY` on every route but /health",
        metavar="KEY",
    ),
    "max_body_bytes": Setting(
        "DEPCTL_MAX_BODY_BYTES",
        "--max-body-bytes",
        int,
        4 * 1024 * 1024,
        "largest request body, in bytes (413 above it)",
        1024,
    ),
    "max_prompt_tokens": Setting(
        "DEPCTL_MAX_PROMPT_TOKENS",
        "--max-prompt-tokens",
        int,
        None,
        "most prompt tokens per request (default: the model's context)",
        1,
    ),
    "default_max_tokens": Setting(
        "DEPCTL_DEFAULT_MAX_TOKENS",
        "--default-max-tokens",
        int,
        2048,
        "tokens a chat completion may generate when the request sets no max_tokens",
        1,
    ),
    "load_timeout": Setting(
        "DEPCTL_LOAD_TIMEOUT",
        "--load-timeout",
        float,
        900.0,
        "seconds a deployment may take to load before it is FAILED",
        1,
        "SECONDS",
    ),
    "drain_timeout": Setting(
        "DEPCTL_DRAIN_TIMEOUT",
        "--drain-timeout",
        float,
        10.0,
        "seconds running requests get to finish when the daemon stops",
        0,
        "SECONDS",
    ),
}


@dataclass(frozen=True)
class Settings:
    host: str = SETTINGS["host"].default
    api_key: str | None = SETTINGS["api_key"].default
    max_body_bytes: int = SETTINGS["max_body_bytes"].default
    max_prompt_tokens: int | None = SETTINGS["max_prompt_tokens"].default
    default_max_tokens: int = SETTINGS["default_max_tokens"].default
    load_timeout: float = SETTINGS["load_timeout"].default
    drain_timeout: float = SETTINGS["drain_timeout"].default

    @classmethod
    def resolve(cls, flags: dict | None = None, environ: dict | None = None) -> "Settings":
        """Flags (non-None values) over the environment over the defaults; raise ``ValueError`` naming the setting."""
        flags, environ = flags or {}, os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            s = SETTINGS[f.name]
            raw = flags.get(f.name)
            source = s.flag
            if raw is None and environ.get(s.env, "") != "":
                raw, source = environ[s.env], s.env
            if raw is None:
                values[f.name] = s.default
                continue
            try:
                value = s.type(raw)
            except ValueError:
                raise ValueError(
                    f"{source} must be {'a number' if s.type is not str else 'text'}, got {raw!r}"
                ) from None
            if s.minimum is not None and value < s.minimum:
                raise ValueError(f"{source} must be at least {s.minimum:g}, got {raw!r}")
            values[f.name] = value
        return cls(**values)

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
