"""Installed without ``-e``, depctl runs from any directory: the prompt sets and the C++ sources ship as package data,
and nothing reads the source tree. The project is installed (no dependencies: the test environment has them) into a
folder of its own, and every command runs from another directory with only that folder added to the path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")  # pip builds in a copy: the source tree is left as it is
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(ROOT),
        ],
        check=True,
        cwd=build,
        capture_output=True,
    )
    return site


def _run(site: Path, cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_installed_package_is_what_runs_and_ships_its_data(installed, tmp_path):
    probe = _run(
        installed,
        tmp_path,
        "-c",
        "import depctl, runtime, depctl.workloads as w, runtime.kernels.native as n; "
        "print(depctl.__file__); print(runtime.__file__); print(w.names()); "
        "print(all(p.is_file() for p in n.SOURCES))",
    )
    assert probe.returncode == 0, probe.stderr
    depctl_file, runtime_file, names, sources = probe.stdout.splitlines()
    assert depctl_file.startswith(str(installed)) and runtime_file.startswith(str(installed))
    assert names == "['chat', 'code', 'grounded']" and sources == "True"


def test_deployment_bench_runs_from_another_directory(installed, tmp_path, tiny_model_dir, depctl_home):
    create = _run(
        installed,
        tmp_path,
        "-m",
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
            "-m",
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
        _run(installed, tmp_path, "-m", "depctl", "daemon", "stop")
