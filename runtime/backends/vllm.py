"""A deployment served by vLLM (``--engine vllm``): the daemon starts vLLM's OpenAI server, watches it, restarts it
with backoff, and stops it with every process it started.

- **Start**: on the supervisor thread, inside the manager's load turn (one start or load at a time): resolve the
  model to a directory (as for depctl's engine), resolve ``auto`` dtype and the context as depctl's engine would,
  pick a free loopback port and a random API key (the server is reachable only through the daemon's proxy, with the
  daemon's auth), start ``python -m vllm.entrypoints.openai.api_server`` in a session of its own, and poll
  ``/health`` until it answers, the process exits, or the load timeout passes. Every line it prints goes to the
  daemon's log (``depctl daemon logs``) as ``vllm[<id>]: ...``; the last one is the start-up progress ``get`` shows.
- **Crash**: a server that exits on its own puts the deployment in FAILED with its exit status and last error line,
  then is restarted after 1, 2, 4 ... 60 s (the delay resets after 10 minutes up). A server that never came up is
  tried ``START_ATTEMPTS`` times, then left FAILED: a bad model or flag fails the same way every time.
- **Stop** (delete, update, ``daemon stop``): SIGTERM to the server's process group, SIGKILL to whatever is left
  after ``STOP_GRACE`` seconds, children found before the kill included.
- **No orphans, no duplicates**: each server is recorded in ``$DEPCTL_HOME/run/vllm-<id>.json`` (pid, start time);
  a starting daemon kills what an earlier one left behind (``reap_orphans``) before it starts anything. On Linux the
  server also gets SIGTERM when the supervisor thread dies (``PR_SET_PDEATHSIG``), so a killed daemon takes it along.

``vllm_process`` holds the process side (ports, the launcher, killing and reaping), ``vllm_wire`` what crosses HTTP
(the request body, the streamed answer's pieces, errors, metrics); this module supervises and serves.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import os
import re
import secrets
import subprocess
import threading
import time
from pathlib import Path
from typing import AsyncIterator, Callable

import httpx
import psutil

from depctl import models
from depctl.client import tree_rss
from depctl.engines import SERVER_MODULE, EngineEnv, require_vllm_env
from depctl.errors import DepctlError, first_line
from depctl.spec import DeploymentSpec, DraftModelSpeculation
from depctl.vllm import engine_args
from depctl_runtime.backends.base import (
    BackendError,
    Counters,
    Delta,
    GenerateRequest,
    Interrupted,
    Owner,
    Stage,
)
from depctl_runtime.backends.structured import vllm_structured_outputs
from depctl_runtime.backends.vllm_process import (
    ANSI,
    LAUNCHER,
    STOP_GRACE,
    LaunchError,
    exit_text,
    free_port,
    kill_group,
    kill_tree,
    run_dir,
    shorten,
)
from depctl_runtime.backends.vllm_wire import (
    METRICS_TTL,
    completion_payload,
    parse_logprobs,
    parse_metrics,
    stats_from_metrics,
    upstream_error,
)

log = logging.getLogger("depctl.vllm")

START_ATTEMPTS = 3
BACKOFF_MAX = 60.0
BACKOFF_RESET = 600.0  # up this long: the next crash restarts after 1 s again


class VLLMBackend:
    """One deployment's vLLM server and the thread that supervises it (see the module docstring)."""

    per_request_speculation = False  # vLLM counts drafts per server, not per request

    def __init__(self, spec: DeploymentSpec, owner: Owner, load_timeout: float):
        self.spec = spec
        self.load_timeout = load_timeout
        self._owner = owner
        self.api_key = secrets.token_urlsafe(24)
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.env: EngineEnv | None = None
        self.max_context: int | None = None
        self.dtype: str | None = None
        self.device: str | None = None
        self.tokenizer = None  # the model's, for the daemon's own request checks (the same 400s as depctl's engine)
        self._ready = False
        self.restarts = 0
        self.log_tail: collections.deque[str] = collections.deque(maxlen=60)
        self._stop = threading.Event()
        self._thens: list[Callable[[], None]] = []  # run once the server has exited for good
        self._exited = threading.Event()
        self._metrics: tuple[float, dict] = (0.0, {})
        self._exit_lock = threading.Lock()  # stop callbacks added vs. the supervisor's exit
        self._client: httpx.AsyncClient | None = None
        self.thread = threading.Thread(target=self._supervise, name=f"depctl-vllm-{spec.id}", daemon=True)

    # ---- any thread ----
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"}

    @property
    def ready(self) -> bool:
        return self._ready

    def start(self) -> None:
        self.thread.start()

    def set_num_draft_tokens(self, k: int) -> bool:
        return False  # vLLM takes K only at start-up

    def stop(self, drain: bool = True, then: Callable[[], None] | None = None) -> None:
        """Stop the server (and keep it stopped); ``then`` runs once it has exited. vLLM finishes nothing on SIGTERM
        that a client still waits for, so ``drain`` only matters for depctl's engine."""
        if then is not None:
            with self._exit_lock:
                if not self._exited.is_set():
                    self._thens.append(then)
                    then = None
            if then is not None:
                then()
        self._stop.set()

    def _stopping(self) -> bool:
        if not self._stop.is_set() and not self._owner.wanted(self):
            self._stop.set()
        return self._stop.is_set()

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return self._exited.wait(timeout)

    def status(self) -> dict:
        proc, metrics = self.proc, self.metrics()
        env = self.env
        out = {
            "vllm": {
                "pid": proc.pid if proc is not None and proc.poll() is None else None,
                "port": self.port,
                "version": env.version if env else None,
                "build": env.build if env else None,
                "python": env.python if env else None,
                "restarts": self.restarts,
                "dtype": self.dtype,
                "max_model_len": self.max_context,
            },
            "num_requests_running": int(metrics.get("vllm:num_requests_running", 0)),
            "num_requests_waiting": int(metrics.get("vllm:num_requests_waiting", 0)),
            "device": self.device,
            "dtype": self.dtype,
            "max_context": self.max_context,
            "max_batch_size": self.spec.max_batch_size,
        }
        if self._ready:
            out["stats"] = stats_from_metrics(metrics)
        return out

    def counters(self, fresh: bool = False) -> Counters:
        """vLLM's counters as last read (no HTTP call: this runs on the event loop), or read now when ``fresh``."""
        m = self.metrics(fetch=fresh)
        stats = stats_from_metrics(m)
        return Counters(
            stats["drafts"],
            stats["draft_tokens"],
            stats["accepted_tokens"],
            stats["accepted_per_position"],
            int(m.get("vllm:num_requests_running", 0)),
            int(m.get("vllm:num_requests_waiting", 0)),
            generated_tokens=int(m.get("vllm:generation_tokens_total", 0)),
            memory_bytes=self._memory(),
        )

    def _memory(self) -> int | None:
        """The resident memory of the vLLM server and its workers (GPU memory is vLLM's own to report)."""
        proc = self.proc
        return None if proc is None or proc.poll() is not None else tree_rss(proc.pid)

    def metrics(self, max_age: float = METRICS_TTL, fetch: bool = True) -> dict:
        """vLLM's Prometheus samples as {name: value} (labels summed; per-position counters as a list); cached
        ``max_age`` seconds. ``fetch=False`` returns the cache only (never blocks)."""
        at, cached = self._metrics
        if not fetch or time.monotonic() - at < max_age or not self._ready:
            return cached
        try:
            text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=2.0).text
        except httpx.HTTPError:
            return cached
        values = parse_metrics(text)
        self._metrics = (time.monotonic(), values)
        return values

    # ---- requests (on the event loop) ----
    def _http(self) -> httpx.AsyncClient:
        if self._client is None:  # made on the event loop that uses it
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=10.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            )
        return self._client

    def prepare(self, request: GenerateRequest) -> GenerateRequest:
        if request.constraint is not None and request.constraint.optional:
            return dataclasses.replace(request, constraint=None)  # vLLM runs tool_choice auto unconstrained
        if request.constraint is not None:
            vllm_structured_outputs(request.constraint)  # a malformed schema is refused here, as by our own engine
        return request

    async def generate(self, request: GenerateRequest, cut: asyncio.Future) -> AsyncIterator[Delta]:
        """The request as token ids to vLLM's completions endpoint (the chat template is already applied), streamed
        back as text; vLLM detokenizes and applies the stop strings."""
        if not self._ready:
            raise BackendError(
                503, f"deployment {self.spec.id!r}: its vLLM server is not up", code="deployment_not_ready"
            )
        payload = completion_payload(self.spec.id, request)
        client = self._http()
        try:
            upstream = await client.send(
                client.build_request("POST", f"{self.url}/v1/completions", json=payload, headers=self.headers),
                stream=True,
            )
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None

        def on_cut(_) -> None:
            asyncio.ensure_future(upstream.aclose())

        cut.add_done_callback(on_cut)
        counted, final, completion, cached = 0, None, None, 0
        try:
            if upstream.status_code != 200:
                raise upstream_error(upstream.status_code, await upstream.aread())
            async for line in upstream.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk or chunk.get("object") == "error":
                    raise upstream_error(500, data.encode())
                choices = chunk.get("choices") or ()
                if choices:
                    text, finish = choices[0].get("text") or "", choices[0].get("finish_reason")
                    counted += bool(text)  # a chunk a token, until the usage says exactly
                    matched = choices[0].get("stop_reason")  # vLLM: the stop string, or a stop token's id
                    delta = Delta(
                        text,
                        int(bool(text)),
                        finish,
                        logprobs=parse_logprobs(choices[0].get("logprobs")),
                        stop=matched if isinstance(matched, str) else None,
                    )
                    if finish is None:
                        yield delta
                    else:  # held until the usage chunk, which comes after it, gives the true token count
                        final = delta
                elif chunk.get("usage"):
                    completion = chunk["usage"].get("completion_tokens")
                    cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            if final is not None:
                extra = completion - counted if completion is not None else 0
                yield dataclasses.replace(final, tokens=final.tokens + extra, cached_tokens=cached)
        except (httpx.HTTPError, httpx.StreamError) as exc:
            if cut.done():
                raise Interrupted() from None
            raise self._unreachable(exc) from None
        finally:
            cut.remove_done_callback(on_cut)  # one future for every request: leave nothing on it
            await upstream.aclose()

    def _unreachable(self, exc: Exception) -> BackendError:
        return BackendError(
            503,
            f"deployment {self.spec.id!r}: its vLLM server did not answer ({type(exc).__name__}); "
            "`depctl deployment get` shows its state",
            code="deployment_not_ready",
        )

    # ---- the supervisor thread ----
    def _supervise(self) -> None:
        attempts, backoff = 0, 1.0
        try:
            while not self._stopping():
                attempts += 1
                failure = self._start_once(attempts)
                if self._stopping():
                    break
                if failure is None:
                    attempts = 0
                    up_since = time.monotonic()
                    if not self._owner.ready(self):
                        break  # superseded while starting
                    code = self._wait_exit()
                    self._terminate()  # what the crashed server left in its process group (resource trackers...)
                    if self._stop.is_set():
                        break
                    if time.monotonic() - up_since > BACKOFF_RESET:
                        backoff = 1.0
                    self.restarts += 1
                    reason = f"the vLLM server {exit_text(code)}{self._last_error(': ')}"
                    self._owner.failed(self, f"{reason}; restarting in {backoff:g}s (restart {self.restarts})", True)
                elif attempts >= START_ATTEMPTS:
                    self._owner.failed(
                        self,
                        f"{failure}; gave up after {attempts} attempts (`depctl daemon logs` has "
                        "vLLM's output; fix the spec with `depctl deployment update`)",
                        False,
                    )
                    break
                else:
                    self._owner.failed(
                        self, f"{failure}; retrying in {backoff:g}s (attempt {attempts + 1} of {START_ATTEMPTS})", True
                    )
                if self._stop.wait(backoff):
                    break
                backoff = min(backoff * 2, BACKOFF_MAX)
        except BaseException as exc:  # noqa: BLE001 - a bug here must end in FAILED, not a silent thread
            log.exception("deployment %s: the vLLM supervisor failed", self.spec.id)
            self._owner.failed(self, f"the vLLM supervisor failed: {first_line(exc)}", False)
        finally:
            self._terminate()
            with self._exit_lock:
                self._exited.set()
                thens, self._thens = self._thens, []
            self._owner.exited(self)
            for then in thens:
                then()

    def _start_once(self, attempt: int) -> str | None:
        """Start a server and wait until it is healthy; None once it is, else why not."""
        with self._owner.load_turn():
            if self._stopping():
                return "stopped"
            what = "starting vLLM" if attempt == 1 and not self.restarts else "restarting vLLM"
            self._owner.progress(self, Stage(what, "preparing"))
            try:
                cmd, env = self._command()
            except (DepctlError, OSError) as exc:
                return getattr(exc, "message", None) or str(exc)
            self.log_tail.clear()
            log.info("deployment %s: %s", self.spec.id, " ".join(cmd[:1] + cmd[3:]))
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                text=True,
                bufsize=1,
                errors="replace",
            )
            self._record()
            threading.Thread(
                target=self._pump, args=(self.proc,), name=f"depctl-vllm-log-{self.spec.id}", daemon=True
            ).start()
            return self._wait_healthy(what)

    def _command(self) -> tuple[list[str], dict]:
        from depctl_runtime.backends.precision import pick_dtype
        from depctl_runtime.backends.weights import MAX_CONTEXT_CAP, LoadError

        spec = self.spec
        self.env = require_vllm_env()
        if spec.device == "cuda" and self.env.build == "cpu":
            raise LaunchError(
                "--device cuda, but the installed vLLM is the CPU build: `depctl engine install vllm "
                "--build cuda --force`, or --device cpu"
            )
        if spec.device == "cpu" and self.env.build == "cuda":
            raise LaunchError(
                "--device cpu, but the installed vLLM is the CUDA build: `depctl engine install vllm "
                "--build cpu --force`, or --device cuda"
            )
        source = models.materialize(models.resolve(spec.model, "MODEL"))
        draft_source = None
        if isinstance(spec.speculation, DraftModelSpeculation):
            draft_source = models.materialize(models.resolve(spec.speculation.draft_model, "--draft-model"))
        import torch

        device = torch.device("cuda" if self.env.build == "cuda" else "cpu")
        self.device = device.type
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self.tokenizer = AutoTokenizer.from_pretrained(source)
            except Exception as exc:  # noqa: BLE001 - a model vLLM could not serve either
                raise LaunchError(f"could not load the tokenizer of {spec.model}: {first_line(exc)}") from None
        try:
            dtype = pick_dtype(spec.dtype, device) if device.type == "cpu" else None
        except LoadError as exc:
            raise LaunchError(str(exc)) from None
        self.dtype = str(dtype).removeprefix("torch.") if dtype is not None else spec.dtype
        model_len = _model_positions(source)
        if spec.max_context_length and model_len and spec.max_context_length > model_len:
            raise LaunchError(
                f"--max-context-length {spec.max_context_length} is more than the model's "
                f"{model_len} positions: lower it, or leave it unset"
            )
        self.max_context = spec.max_context_length or min(model_len or MAX_CONTEXT_CAP, MAX_CONTEXT_CAP)
        self.port = free_port()
        args = engine_args(spec, draft_source=draft_source, dtype=self.dtype, max_model_len=self.max_context)
        cmd = [
            self.env.python,
            "-c",
            LAUNCHER,
            SERVER_MODULE,
            "--model",
            source,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--disable-uvicorn-access-log",
            "--enable-prompt-tokens-details",  # its prefix cache's hits, passed on as usage.prompt_tokens_details
            *args,
        ]
        env = {
            **os.environ,
            "VLLM_API_KEY": self.api_key,
            "DEPCTL_PARENT_PID": str(os.getpid()),
            "PYTHONUNBUFFERED": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        for name in ("DEPCTL_API_KEY", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
            env.pop(name, None)  # the daemon's own: not vLLM's business, and a foreign PYTHONPATH breaks its imports
        if spec.ray_address:
            env["RAY_ADDRESS"] = spec.ray_address
        if self.env.build == "cpu":
            env.setdefault(
                "OMP_NUM_THREADS",
                str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1),
            )
            env.setdefault(
                "VLLM_CPU_KVCACHE_SPACE", str(_kv_cache_gib(source, self.dtype, self.max_context, spec.max_batch_size))
            )
        return cmd, env

    def _wait_healthy(self, what: str) -> str | None:
        deadline = time.monotonic() + self.load_timeout
        while not self._stopping():
            code = self.proc.poll()
            if code is not None:
                return f"the vLLM server {exit_text(code)} while starting{self._last_error(': ')}"
            if time.monotonic() > deadline:
                self._terminate()
                return f"the vLLM server did not answer /health within {self.load_timeout:g}s (DEPCTL_LOAD_TIMEOUT)"
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    self._ready = True
                    return None
            except httpx.HTTPError:
                pass
            if self.log_tail:
                self._owner.progress(self, Stage(what, shorten(self.log_tail[-1], 160)))
            self._stop.wait(0.5)
        return "stopped"

    def _wait_exit(self) -> int | None:
        while not self._stop.is_set():
            try:
                return self.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
        return None

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            line = ANSI.sub("", line.rstrip())
            if line:
                self.log_tail.append(line)
                log.info("vllm[%s]: %s", self.spec.id, line)

    def _last_error(self, prefix: str) -> str:
        """``prefix`` + the last line that reads like an error, or nothing."""
        for line in reversed(self.log_tail):
            if re.search(r"Error|error:|Exception|Traceback|Killed", line):
                return prefix + shorten(line)
        return ""

    def _record(self) -> None:
        info = {
            "pid": self.proc.pid,
            "create_time": psutil.Process(self.proc.pid).create_time(),
            "deployment": self.spec.id,
            "port": self.port,
        }
        path = run_dir() / f"vllm-{self.spec.id}.json"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, path)

    def _terminate(self) -> None:
        self._ready = False
        proc = self.proc
        if proc is not None:
            if proc.poll() is None:
                log.info("deployment %s: stopping the vLLM server (pid %d)", self.spec.id, proc.pid)
                kill_tree(proc.pid, STOP_GRACE)
            else:
                kill_group(proc.pid)  # the server is gone; its session may not be
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            path = run_dir() / f"vllm-{self.spec.id}.json"
            try:
                if json.loads(path.read_text()).get("pid") == proc.pid:
                    path.unlink()
            except (OSError, ValueError):
                pass


def _model_positions(source: str) -> int | None:
    try:
        data = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = data.get("text_config", data)
    value = text.get("max_position_embeddings")
    return int(value) if value else None


def _kv_cache_gib(source: str, dtype: str, max_model_len: int, rows: int) -> int:
    """GiB of KV cache for ``rows`` full-length requests (vLLM on a CPU reserves it up front; its default is 4)."""
    from transformers import AutoConfig

    from depctl_runtime.backends.weights import kv_cache_bytes

    try:
        kv = kv_cache_bytes(AutoConfig.from_pretrained(source), 4 if dtype == "float32" else 2, max_model_len * rows)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError):
        return 4
    return max(1, -(-kv // (1 << 30)))
