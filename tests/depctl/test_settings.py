"""Daemon settings: flags over the environment over defaults, and errors that name the flag or variable."""

from __future__ import annotations

import pytest

from depctl.settings import SETTINGS, Settings, is_loopback


def _environ(monkeypatch, env: dict) -> None:
    for name in SETTINGS.values():
        monkeypatch.delenv(name.env, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_flags_over_environment_over_defaults(monkeypatch):
    _environ(monkeypatch, {})
    assert Settings.resolve({}) == Settings() and Settings().max_body_bytes == 4 * 1024 * 1024
    _environ(monkeypatch, {"DEPCTL_MAX_BODY_BYTES": "5000", "DEPCTL_API_KEY": "k", "DEPCTL_DRAIN_TIMEOUT": "0"})
    s = Settings.resolve({"max_body_bytes": "9000", "host": None})
    assert (s.max_body_bytes, s.api_key, s.drain_timeout, s.default_max_tokens) == (9000, "k", 0.0, 2048)
    _environ(monkeypatch, {"DEPCTL_API_KEY": ""})  # empty: unset
    assert Settings.resolve({}).api_key is None


@pytest.mark.parametrize(
    "flags, env, needle",
    [
        ({}, {"DEPCTL_MAX_BODY_BYTES": "lots"}, "DEPCTL_MAX_BODY_BYTES must be a number"),
        ({"max_body_bytes": "10"}, {}, "--max-body-bytes must be at least 1024"),
        ({}, {"DEPCTL_LOAD_TIMEOUT": "0"}, "DEPCTL_LOAD_TIMEOUT must be at least 1"),
        ({"default_max_tokens": "0"}, {}, "--default-max-tokens must be at least 1"),
    ],
)
def test_bad_values_name_their_source(flags, env, needle, monkeypatch):
    _environ(monkeypatch, env)
    with pytest.raises(ValueError, match=needle):
        Settings.resolve(flags)


def test_every_setting_is_a_flag_of_daemon_start_and_serve():
    from typer.testing import CliRunner

    from depctl.cli import app

    for command in (["daemon", "start"], ["serve"]):
        shown = " ".join(CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"}).output.split())
        for s in SETTINGS.values():
            assert s.flag in shown and s.env in shown, (command, s.flag)


def test_loopback():
    assert all(is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.5", "example.com"))


def test_daemon_refuses_bad_settings_before_binding(depctl_home):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "depctl_runtime", "--port", "0", "--max-body-bytes", "12"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--max-body-bytes must be at least 1024" in r.stderr
