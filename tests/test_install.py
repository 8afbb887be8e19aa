"""Installed without ``-e`` into a fresh virtualenv, depctl runs from any directory: the prompt sets and the C++
sources ship as package data, and nothing reads the source tree. The virtualenv borrows this environment's
dependencies through a ``.pth`` line (torch and the rest are not downloaded again); depctl itself is installed there
from the repository like any package, and every command runs from another directory."""

from __future__ import annotations

import json
import os
import site
import subprocess
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a fresh virtualenv and a non-editable install

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The fresh virtualenv's ``bin`` directory."""
    env = tmp_path_factory.mktemp("venv")
    venv.create(env, with_pip=False)  # pip and setuptools come from this environment, through the .pth below
    python = env / "bin" / "python"
    packages = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # this environment's dependencies; its own editable depctl is not visible (a .pth line is not a site dir)
    (Path(packages) / "depctl-test-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    build = tmp_path_factory.mktemp("build")
    proc = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(ROOT)],
        cwd=build,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return env / "bin"


def _run(bin_dir: Path, cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(bin_dir / args[0]), *args[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_installed_package_is_what_runs_and_ships_its_data(installed, tmp_path):
    probe = _run(
        installed,
        tmp_path,
        "python",
        "-c",
        "import depctl, depctl_runtime, depctl.workloads as w, depctl_runtime.kernels.native as n; "
        "print(depctl.__file__); print(depctl_runtime.__file__); print(w.names()); "
        "print(all(p.is_file() for p in n.SOURCES))",
    )
    assert probe.returncode == 0, probe.stderr
    depctl_file, runtime_file, names, sources = probe.stdout.splitlines()
    env = str(installed.parent)
    assert depctl_file.startswith(env) and runtime_file.startswith(env), (depctl_file, runtime_file)
    assert names == "['chat', 'code', 'grounded', 'structured']" and sources == "True"


def test_deployment_bench_runs_from_another_directory(installed, tmp_path, tiny_model_dir, depctl_home):
    create = _run(
        installed,
        tmp_path,
        "depctl",
        "deployment",
        "create",
        str(tiny_model_dir),
        "--deployment-id",
        "t",
        "--ngram-speculation-length",
        "2",
        "--draft-token-count",
        "4",
        "--device",
        "cpu",
        "--no-compile",
        "-o",
        "json",
    )
    try:
        assert create.returncode == 0, create.stderr
        bench = _run(
            installed,
            tmp_path,
            "depctl",
            "deployment",
            "bench",
            "t",
            "--limit",
            "1",
            "--max-tokens",
            "8",
            "-o",
            "json",
        )
        assert bench.returncode == 0, bench.stderr
        data = json.loads(bench.stdout)
        assert data["workload"] == "grounded" and data["prompts"] == 1 and data["identical_output"] is True
    finally:
        _run(installed, tmp_path, "depctl", "daemon", "stop")


def test_a_package_named_runtime_in_the_working_directory_changes_nothing(installed, tmp_path):
    # the bug: the runtime installed as the top-level `runtime`, so a user's own runtime/ package shadowed it
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "__init__.py").write_text("MINE = True\n")
    for args in (("python", "-m", "depctl", "--help"), ("depctl", "daemon", "--help")):
        proc = _run(installed, tmp_path, *args)
        assert proc.returncode == 0, proc.stderr
        assert "deployment" in proc.stdout or "start" in proc.stdout
    probe = _run(installed, tmp_path, "python", "-c", "import runtime, depctl_runtime.app; print(runtime.MINE)")
    assert probe.returncode == 0 and probe.stdout.strip() == "True", probe.stderr
