"""The daemon's settings: where it listens, its API key, and the limits that keep one request from hurting the rest.

Each setting comes from a ``python -m depctl_runtime`` flag, else its ``DEPCTL_*`` environment variable (read by
pydantic-settings), else the default below;
``depctl daemon start`` takes the same flags and passes them on through the environment (so the key never shows in
``ps``). Every limit's error names the setting that raises it.
"""

from __future__ import annotations

import ipaddress
import typing
from dataclasses import dataclass

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from depctl import config

ALREADY_RUNNING = 3  # the daemon's exit status when another daemon holds the home's lock
ENV_PREFIX = "DEPCTL_"


def _setting(default, help: str, metavar: str = "N", **bounds):
    return Field(default, description=help, json_schema_extra={"metavar": metavar}, **bounds)


class Settings(BaseSettings):
    """The one definition: ``python -m depctl_runtime`` and ``depctl daemon start`` / ``serve`` build their flags from
    these fields, and pydantic-settings reads the ``DEPCTL_*`` environment."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_ignore_empty=True, frozen=True, extra="ignore")

    host: str = _setting(
        config.DEFAULT_HOST,
        "address to bind; anything but a loopback address (this machine only) should come with an API key",
        "ADDRESS",
    )
    api_key: str | None = _setting(None, "require `Authorization: Bearer KEY` on every route but /health", "KEY")
    max_body_bytes: int = _setting(4 * 1024 * 1024, "largest request body, in bytes (413 above it)", ge=1024)
    max_prompt_tokens: int | None = _setting(
        None, "most prompt tokens per request (default: the model's context)", ge=1
    )
    default_max_tokens: int = _setting(
        2048, "tokens a chat completion may generate when the request sets no max_tokens", ge=1
    )
    max_grammar_bytes: int = _setting(
        256 * 1024,
        "largest structured-output constraint (a schema, regex, Lark grammar or choice list), in bytes",
        ge=16,
    )
    grammar_timeout: float = _setting(
        10.0, "seconds a request's grammar may take to compile (400 grammar_too_complex after)", "SECONDS", ge=0.1
    )
    load_timeout: float = _setting(900.0, "seconds a deployment may take to load before it is FAILED", "SECONDS", ge=1)
    drain_timeout: float = _setting(
        10.0, "seconds running requests get to finish when the daemon stops", "SECONDS", ge=0
    )

    @classmethod
    def resolve(cls, flags: dict | None = None) -> "Settings":
        """Flags (non-None values) over the environment over the defaults; a ``ValueError`` names the flag or the
        variable the bad value came from."""
        given = {k: v for k, v in (flags or {}).items() if v is not None}
        try:
            return cls(**given)
        except ValidationError as exc:
            err = exc.errors()[0]
            s = SETTINGS[str(err["loc"][0])]
            source = s.flag if s.name in given else s.env
            raw = err.get("input")
            if err["type"].endswith("_parsing"):
                raise ValueError(f"{source} must be a number, got {raw!r}") from None
            if "ge" in err.get("ctx", {}):
                raise ValueError(f"{source} must be at least {err['ctx']['ge']:g}, got {raw!r}") from None
            raise ValueError(f"{source}: {err['msg']}, got {raw!r}") from None

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


@dataclass(frozen=True)
class Setting:
    """One field of ``Settings`` as a command line shows it."""

    name: str
    env: str
    flag: str
    type: type
    default: object
    help: str
    minimum: float | None
    metavar: str


def _describe(name: str, field) -> Setting:
    kind = next(t for t in (typing.get_args(field.annotation) or (field.annotation,)) if t is not type(None))
    minimum = next((m.ge for m in field.metadata if hasattr(m, "ge")), None)
    return Setting(
        name,
        f"{ENV_PREFIX}{name.upper()}",
        "--" + name.replace("_", "-"),
        kind,
        field.default,
        field.description,
        minimum,
        field.json_schema_extra["metavar"],
    )


SETTINGS = {name: _describe(name, field) for name, field in Settings.model_fields.items()}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
