"""scripts/gpu_check.sh and benchmarks/gpu_check.py: everything but the GPU, so the check runs the first time a GPU
machine is at hand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SCRIPT), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_without_a_gpu_it_says_so_and_succeeds():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the check would run")
    done = _run()
    assert done.returncode == 0, done.stderr
    assert "no CUDA GPU here" in done.stdout and f"torch {torch.__version__}" in done.stdout


def test_the_wheels_are_what_the_image_lacks():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gpu_wheels import IMAGE, needed
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    pins = needed()
    for name in ("pydantic", "pydantic-core", "pydantic-settings", "fastapi", "uvicorn", "llguidance", "jsonschema"):
        assert name in pins, name
    assert not {"torch", "transformers", "typer", "rich", "httpx", "pyyaml"} & set(pins)
    assert not IMAGE & set(pins)


@pytest.mark.slow
def test_prepare_downloads_python_3_12_wheels_small_enough_to_carry(tmp_path):
    done = _run("--prepare", str(tmp_path / "wheels"))
    assert done.returncode == 0, done.stdout + done.stderr
    wheels = sorted(p.name for p in (tmp_path / "wheels").glob("*.whl"))
    assert any(w.startswith("pydantic_core-") and "cp312" in w for w in wheels), wheels
    assert any(w.startswith("llguidance-") for w in wheels), wheels
    assert sum(p.stat().st_size for p in (tmp_path / "wheels").iterdir()) < 48 * 2**20


@pytest.mark.slow
def test_the_table_on_a_cpu_with_a_tiny_model(tmp_path):
    # the benchmark's own logic (loads, rows, the exactness columns, the CPU reference) on a tiny model
    out = tmp_path / "gpu_check.md"
    args = ["--device", "cpu", "--shapes", "tiny", "--rows", "1,2", "--tokens", "8", "--passes", "eager"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args, "--cpu-tokens", "8", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    table = out.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| tiny | eager |") and line.count("|") == 10]
    assert len(rows) == 6, table  # plain, n-gram and a draft model at 1 and 2 rows
    assert all("| yes" in r or "| reference |" in r for r in rows), table
    assert "| tiny | yes (8 tokens) |" in table


def test_the_cpu_comparison_tells_a_broken_tie_from_a_wrong_token():
    """Random weights give nearly flat logits: a GPU's order of additions may break a tie, which is no error."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_check import judge

    assert judge([0.0, 0.0]) == "yes (2 tokens)"
    assert judge([0.0, 4e-4, 0.0]) == "yes, up to near ties: 1 of 3 tokens within 4.0e-04 of the top logit"
    assert judge([0.0, 4e-4, 0.5]) == "NO: token 2 lies 0.5 below the top logit (2 of 3 off the argmax)"
