"""The serving layer between the routes and the backends: request -> job -> deltas -> OpenAI shapes.

``Service.run`` is an async generator on the event loop: it hands the job's ``GenerateRequest`` to the backend that
checked it (``depctl_runtime.backends``) and passes on its ``Delta``s, recording metrics and usage; it never asks which
engine answers. Leaving the generator early (the client went away) cancels the request.

Building a job (chat template, tokenizing) runs on a worker thread, never on the event loop: a multi-megabyte prompt
must not stall every other client. The tokenizer is called through ``encode_batch``, which releases the GIL (a plain
``encode`` of a multi-megabyte prompt holds it for seconds). Waiting for an idle deployment to load, and for a
grammar to compile (in a pool of its own, ``grammars.GrammarPool``), is awaited on the loop: no request holds a
thread while it waits.

Stopping the daemon: ``begin_drain`` refuses new requests (503) and, after the drain timeout, cuts the requests
still running: each ends with a 503 error (in-stream: an error event, then ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

from depctl import recordings
from depctl.settings import Settings
from depctl.spec import SamplingDefaults, describe_speculation
from depctl_runtime.api.errors import APIError
from depctl_runtime.api.grammars import GrammarPool
from depctl_runtime.api.metrics import Metrics
from depctl_runtime.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from depctl_runtime.api.tools import (
    HERMES,
    ToolCallParser,
    ToolFormat,
    history,
    prompted,
    renders_tools,
    shown_tokens,
    split_calls,
    template_format,
    tool_constraint,
    tool_format,
)
from depctl_runtime.backends import Backend, BackendError, Delta, GenerateRequest, Interrupted, Logprob
from depctl_runtime.backends.structured import GrammarLimits
from depctl_runtime.manager import DeploymentManager, State
from depctl_runtime.speculation.params import GenerationParams, Tenant

log = logging.getLogger("depctl.serving")

SERVING_STATES = (State.READY, State.UPDATING)  # UPDATING keeps serving with the previous engine


def chat_prompt_ids(tokenizer, dep_id: str, messages, tools=None, add_generation_prompt: bool = True) -> list[int]:
    """Messages (and tools: through the template where it renders them, else described in a system message)
    rendered by the model's own chat template, as token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400,
            f"deployment {dep_id!r} has no chat template (a base model?): use /v1/completions",
            param="messages",
            code="no_chat_template",
        )
    turns, extra = history(messages, template_format(tokenizer)), {}
    if tools and renders_tools(tokenizer):
        extra = {"tools": [t.model_dump(exclude_none=True) for t in tools]}
    elif tools:
        turns = prompted(turns, [t.function.model_dump(exclude_none=True) for t in tools])
    try:
        text = tokenizer.apply_chat_template(
            turns, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    except Exception as exc:  # jinja templates raise on roles they do not support
        raise APIError(
            400, f"the chat template rejected the messages: {exc}", param="messages", code="invalid_value"
        ) from None
    return encode(tokenizer, text, add_special_tokens=False)


def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids for ``text``, as ``tokenizer(text)["input_ids"]`` gives them, without holding the GIL (fast
    tokenizers' ``encode_batch`` releases it; a single ``encode`` does not)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def named_deployment(manager: DeploymentManager, model: str):
    """The deployment a request's ``model`` names: a deployment id, or firectl's ``MODEL#DEPLOYMENT_ID``, whose MODEL
    must name what the deployment serves (its model as the spec gives it, or that name's last path segment, as in
    ``accounts/me/models/smollm2-135m-instruct``). 404 otherwise."""
    named, _, dep_id = model.rpartition("#")
    dep = manager.get(dep_id)
    if dep is None:
        raise APIError(
            404,
            f"deployment {dep_id!r} does not exist; list them with GET /v1/models or `depctl deployment list`",
            param="model",
            code="model_not_found",
        )
    if not named:
        return dep
    spec = dep.loaded_spec or dep.spec
    served = spec.model if spec is not None else named  # a broken spec: its state says so
    if named != served and named.rstrip("/").rsplit("/", 1)[-1] != served.rstrip("/").rsplit("/", 1)[-1]:
        raise APIError(
            404,
            f"deployment {dep_id!r} serves {served!r}, not {named!r}: send model {dep_id!r} or '{served}#{dep_id}'",
            param="model",
            code="model_not_found",
        )
    return dep


@dataclass
class Job:
    kind: str  # "text_completion" | "chat.completion"
    deployment_id: str
    model: str  # echoed back as the response's "model"
    request: GenerateRequest
    backend: Backend  # the one that checked the request (its tokenizer and context)
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    usage: dict | None = None  # filled in when the run ends
    tools: frozenset[str] = frozenset()  # the functions offered: the output is read for calls to them
    tool_format: ToolFormat = HERMES  # how the model writes its calls
    example: dict | None = None  # the prompt as a recording keeps it, once the job is runnable
    stop: str | None = None  # the stop string that ended the output, once it has (Anthropic's stop_sequence)

    def call_parser(self) -> ToolCallParser | None:
        """A reader of the tool calls in the output as it streams, where tools were offered."""
        return ToolCallParser(self.tools, self.tool_format) if self.tools else None

    def split_calls(self, text: str) -> tuple[str, list[dict]]:
        """A whole output's content and its tool calls (``tools.split_calls``)."""
        return split_calls(text, self.tools, self.tool_format)


class Service:
    def __init__(self, manager: DeploymentManager, metrics: Metrics, settings: Settings | None = None):
        self.manager = manager
        self.metrics = metrics
        self.settings = settings or Settings()
        self.stopping = False
        self._cut: asyncio.Future | None = None  # resolves when the drain time is up: running requests end
        self._full: set[str] = set()  # deployments whose prompt recording is full (said once in the log)
        self.grammars = GrammarPool(
            GrammarLimits(max_bytes=self.settings.max_grammar_bytes), timeout=self.settings.grammar_timeout
        )

    # ---- stopping ----
    def begin_drain(self, timeout: float) -> None:
        """New requests get 503 from now on; requests still running after ``timeout`` seconds are cut."""
        self.stopping = True
        asyncio.get_running_loop().call_later(timeout, self._cut_now)

    def _cut_now(self) -> None:
        if not self.cut.done():
            self.cut.set_result(None)

    @property
    def cut(self) -> asyncio.Future:
        if self._cut is None:  # made on the event loop that waits on it
            self._cut = asyncio.get_running_loop().create_future()
        return self._cut

    # ---- looking up the deployment ----
    def deployment(self, model: str) -> tuple[str, Backend]:
        """The deployment ``model`` names, and the backend serving it now (read once: a job keeps the backend that
        checked it, whatever an update swaps in meanwhile)."""
        dep = named_deployment(self.manager, model)  # before the stopping check: a retry would not find it either
        dep_id = dep.id
        if self.stopping:
            raise APIError(
                503, "the daemon is stopping; retry once it is back (`depctl daemon start`)", code="daemon_stopping"
            )
        self.manager.touch(dep)
        backend = dep.backend
        if dep.state not in SERVING_STATES or backend is None or not backend.ready:
            why = f": {dep.reason}" if dep.reason else ""
            raise APIError(
                503,
                f"deployment {dep_id!r} is {dep.state.value}{why}; it serves requests once READY",
                param="model",
                code=f"deployment_{dep.state.value.lower()}",
            )
        return dep.id, backend

    async def awake(self, model: str) -> None:
        """If ``model`` names an idle deployment, load it again and wait until it serves (or fails): on the event
        loop, so that a crowd of requests waiting for one load holds no thread that other requests need."""
        dep = named_deployment(self.manager, model)
        if self.stopping or not (dep.state == State.IDLE or dep.waking):
            return
        self.manager.touch(dep)
        self.manager.wake(dep)  # (a brief lock; the load itself runs on a thread of its own)
        deadline = time.monotonic() + self.manager.load_timeout
        while dep.waking and time.monotonic() < deadline and not self.stopping:
            await asyncio.sleep(0.05)

    # ---- building jobs ----
    def completion_job(self, req: CompletionRequest, key: str = "") -> Job:
        req.check_supported()
        dep_id, backend = self.deployment(req.model)
        tokenizer = backend.tokenizer
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = encode(tokenizer, prompt, add_special_tokens=True)
        else:
            prompt_ids = list(prompt)
            vocab = len(tokenizer)
            bad = [t for t in prompt_ids if not 0 <= t < vocab]
            if bad:
                raise APIError(
                    400,
                    f"prompt token ids must be in [0, {vocab}); got {bad[:5]}",
                    param="prompt",
                    code="invalid_value",
                )
        job = self._job(
            "text_completion", dep_id, backend, req, prompt_ids, req.max_tokens or 16, (), req.constraint(), key
        )
        if isinstance(prompt, str):
            job.example = {"prompt": prompt}
        return job

    def chat_job(self, req: ChatCompletionRequest, key: str = "", clamp: bool = False) -> Job:
        """clamp: max_tokens beyond what the context leaves is cut to it, not refused (the Messages API's clients
        send a fixed, large max_tokens and expect stop_reason max_tokens)."""
        req.check_supported()
        dep_id, backend = self.deployment(req.model)
        tokenizer = backend.tokenizer
        constraint = req.constraint()
        tools = req.tools if req.calling_tools else None
        fmt = None
        if tools:
            fmt = tool_format(tokenizer, dep_id)
            parallel = req.parallel_tool_calls and fmt.parallel
            required = req.required_functions()
            if required:
                constraint = tool_constraint(tokenizer, required, parallel, "tool_choice", fmt=fmt)
            elif constraint is None:  # auto: free text, and a call where the model begins one
                functions = [t.function.model_dump(exclude_none=True) for t in tools]
                constraint = tool_constraint(tokenizer, functions, parallel, "tools", lazy=True, fmt=fmt)
        prompt_ids = chat_prompt_ids(tokenizer, dep_id, req.messages, tools)
        prediction = ()
        if req.prediction is not None:
            prediction = tuple(encode(tokenizer, req.prediction.text(), add_special_tokens=False))
        job = self._job(
            "chat.completion", dep_id, backend, req, prompt_ids, req.token_budget, prediction, constraint, key, clamp
        )
        if fmt is not None:
            job.tools, job.tool_format = frozenset(t.function.name for t in req.tools), fmt
            job.request = dataclasses.replace(job.request, shown_tokens=shown_tokens(tokenizer, fmt))
        job.example = recordings.chat_example(req.messages)
        return job

    def _record(self, dep_id: str, example: dict | None) -> None:
        """Keep a request's prompt where the deployment's owner turned recording on (a request that was refused is
        never kept: this runs once its job is runnable)."""
        dep = self.manager.get(dep_id)
        if example is None or dep is None or dep.spec is None or not dep.spec.record_prompts:
            return
        try:
            if not recordings.record(dep_id, example) and dep_id not in self._full:
                self._full.add(dep_id)
                log.warning(
                    "%s: its prompt recording is full (%s); no more prompts are kept", dep_id, recordings.path(dep_id)
                )
        except OSError as exc:  # a full disk must not fail the request
            log.warning("%s: recording a prompt failed: %s", dep_id, exc)

    def tokenize(self, req: TokenizeRequest) -> dict:
        dep_id, backend = self.deployment(req.model)
        tokenizer = backend.tokenizer
        if req.messages is not None:
            if req.tools:
                tool_format(tokenizer, dep_id)
            ids = chat_prompt_ids(tokenizer, dep_id, req.messages, req.tools, req.add_generation_prompt)
        else:
            ids = encode(tokenizer, req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": backend.max_context, "tokens": ids}

    def count_chat_tokens(self, req: ChatCompletionRequest) -> int:
        """The prompt tokens a chat request renders to (tools included), as its job would read them."""
        dep_id, backend = self.deployment(req.model)
        tools = req.tools if req.calling_tools else None
        if tools:
            tool_format(backend.tokenizer, dep_id)
        return len(chat_prompt_ids(backend.tokenizer, dep_id, req.messages, tools))

    def detokenize(self, req: DetokenizeRequest) -> dict:
        dep_id, backend = self.deployment(req.model)
        vocab = len(backend.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400, f"token ids must be in [0, {vocab}); got {bad[:5]}", param="tokens", code="invalid_value"
            )
        return {"prompt": backend.tokenizer.decode(req.tokens)}

    def _job(
        self,
        kind,
        dep_id: str,
        backend: Backend,
        req,
        prompt_ids,
        max_tokens,
        prediction,
        constraint,
        key: str,
        clamp: bool = False,
    ) -> Job:
        prompt_param = "prompt" if kind == "text_completion" else "messages"
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param=prompt_param, code="invalid_value")
        limit = self.settings.max_prompt_tokens
        if limit is not None and len(prompt_ids) > limit:
            raise APIError(
                400,
                f"the prompt has {len(prompt_ids)} tokens; this daemon accepts at most {limit} "
                "(DEPCTL_MAX_PROMPT_TOKENS, or `depctl daemon start --max-prompt-tokens`)",
                param=prompt_param,
                code="prompt_too_long",
            )
        max_context = backend.max_context
        room = max_context - len(prompt_ids)
        if max_tokens is None:  # a chat request without max_tokens: the daemon's default, within the context
            max_tokens = min(self.settings.default_max_tokens, room)
        elif clamp and room >= 1:
            max_tokens = min(max_tokens, room)
        if room < 1 or max_tokens > room:
            raise APIError(
                400,
                f"this model's context holds {max_context} tokens; the prompt has {len(prompt_ids)} and max_tokens "
                f"asks for {max_tokens}: shorten the prompt or lower max_tokens",
                param="max_tokens" if room >= 1 else prompt_param,
                code="context_length_exceeded",
            )
        dep = self.manager.get(dep_id)
        try:  # the deployment's defaults as they are now: a change to them applies without a reload
            sampling = req.sampling_params(
                dep.spec.sampling if dep is not None and dep.spec is not None else SamplingDefaults()
            )
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
        penalties = req.penalties()
        vocab = len(backend.tokenizer)
        bad = [t for t, _ in penalties.logit_bias if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400,
                f"logit_bias token ids must be in [0, {vocab}); got {bad[:5]}",
                param="logit_bias",
                code="invalid_value",
            )
        params = GenerationParams(
            max_tokens=max_tokens,
            sampling=sampling,
            ignore_eos=req.ignore_eos,
            prediction=prediction,
            speculate=req.speculation_enabled,
            max_draft_tokens=req.max_draft_tokens,
            penalties=penalties,
            logprobs=req.logprobs_count,
            tenant=Tenant(key, req.user or ""),  # the key presented (a digest) and the user field
            cache_salt=req.cache_salt or "",
            cache_shared=backend.spec.prefix_cache_scope == "deployment",
        )
        request = GenerateRequest(list(prompt_ids), params, tuple(req.stop_strings), constraint)
        return Job(kind, dep_id, req.model, request, backend)  # not runnable before ``prepare``

    async def prepare(self, job: Job) -> None:
        """Make the job runnable: its constraint compiled by its backend, in the grammar pool."""
        job.request = await self.grammars.prepare(job.backend, job.request)
        dep = self.manager.get(job.deployment_id)
        if job.example is not None and dep is not None and dep.spec is not None and dep.spec.record_prompts:
            await asyncio.to_thread(self._record, job.deployment_id, job.example)  # a file append

    def choices(self, job: Job, n: int) -> list[Job]:
        """The ``n`` choices of one request: the same prompt, each its own row (and with a seed, the seeds
        seed, seed + 1, ..., so that choices differ and a rerun repeats them all)."""
        params, seed = job.request.params, job.request.params.sampling.seed
        out = [job]
        for i in range(1, n):
            sampling = (
                params.sampling if seed is None else dataclasses.replace(params.sampling, seed=(seed + i) % 2**64)
            )
            request = dataclasses.replace(job.request, params=dataclasses.replace(params, sampling=sampling))
            out.append(dataclasses.replace(job, request=request, usage=None))
        return out

    # ---- running ----
    async def run(self, job: Job) -> AsyncIterator[Delta]:
        endpoint = "chat" if job.kind == "chat.completion" else "completions"
        t0 = time.perf_counter()
        status, completion, first_at, last_at = "error", 0, None, None
        drafted = accepted = pred_accepted = grammar_drafted = grammar_accepted = cached = 0
        try:
            async with aclosing(job.backend.generate(job.request, self.cut)) as deltas:
                async for delta in deltas:
                    now = time.perf_counter()
                    if delta.tokens:
                        if first_at is None:
                            first_at = now
                        else:
                            self.metrics.observe_run(job.deployment_id, now - last_at, delta.tokens)
                        last_at = now
                    completion += delta.tokens
                    drafted += delta.drafted
                    accepted += delta.accepted
                    pred_accepted += delta.prediction_accepted
                    grammar_drafted += delta.grammar_drafted
                    grammar_accepted += delta.grammar_accepted
                    cached += delta.cached_tokens
                    yield delta
                    if delta.finish_reason:
                        status, job.stop = "ok", delta.stop
                        job.usage = self._usage(
                            job, completion, drafted, accepted, pred_accepted, grammar_drafted, grammar_accepted
                        )
                        job.usage["prompt_tokens_details"] = {"cached_tokens": cached}
                        return
            status = "cancelled"
        except Interrupted:
            raise APIError(
                503,
                f"the daemon is stopping and this request was still running when its drain time ran "
                f"out, after {completion} tokens (DEPCTL_DRAIN_TIMEOUT); retry once it is back",
                code="daemon_stopping",
            ) from None
        except BackendError as exc:
            raise APIError(exc.status, exc.message, param=exc.param, code=exc.code) from None
        finally:
            self.metrics.observe_request(
                job.deployment_id,
                endpoint,
                status,
                len(job.request.prompt_ids),
                completion,
                None if first_at is None else first_at - t0,
                time.perf_counter() - t0,
            )

    @staticmethod
    def total_usage(jobs: list[Job]) -> dict | None:
        """One request's usage over its choices: the prompt once, the completions and speculation summed."""
        usages = [job.usage for job in jobs]
        if any(u is None for u in usages):
            return None
        total = dict(usages[0])
        if len(usages) == 1:
            return total
        total["completion_tokens"] = sum(u["completion_tokens"] for u in usages)
        total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
        for key in ("completion_tokens_details", "speculation"):
            if key in total:
                part = dict(total[key])
                for name, value in part.items():
                    if isinstance(value, int) and not isinstance(value, bool):
                        part[name] = sum(u[key][name] for u in usages)
                if key == "speculation":
                    drafted = part["drafted_tokens"]
                    part["acceptance_rate"] = round(part["accepted_tokens"] / drafted, 4) if drafted else None
                total[key] = part
        return total

    def _usage(
        self, job: Job, completion: int, drafted: int, accepted: int, pred_accepted: int, gd: int, ga: int
    ) -> dict:
        prompt = len(job.request.prompt_ids)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if not job.backend.per_request_speculation:
            return usage
        params = job.request.params
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": pred_accepted,
            # as OpenAI counts them: prediction tokens that did not make it into the completion
            "rejected_prediction_tokens": max(len(params.prediction) - pred_accepted, 0),
        }
        usage["speculation"] = {
            "method": describe_speculation(job.backend.spec.speculation),
            "enabled": params.speculate,
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            # of those, the tokens the request's grammar forced (drafted for free, ahead of the proposer)
            "grammar_drafted_tokens": gd,
            "grammar_accepted_tokens": ga,
        }
        return usage

    async def collect(self, job: Job) -> tuple[str, str, list[Logprob]]:
        """Run to the end; (text, finish_reason, logprobs)."""
        parts, finish, logprobs = [], "length", []
        async for delta in self.run(job):
            parts.append(delta.text)
            logprobs.extend(delta.logprobs)
            if delta.finish_reason:
                finish = delta.finish_reason
        return "".join(parts), finish, logprobs
