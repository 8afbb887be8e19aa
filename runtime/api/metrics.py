"""Prometheus metrics at ``/metrics``.

Names follow vLLM's (``vllm:spec_decode_num_drafts`` ...) with the ``depctl:`` prefix, so a vLLM dashboard
translates by swapping the prefix. Request metrics are recorded as requests finish; the speculation counters are
read from each engine's ``SpecDecodeStats`` at scrape time (they restart from zero when a deployment reloads,
which Prometheus treats as a counter reset).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from depctl_runtime.manager import DeploymentManager

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class SpecDecodeCollector:
    def __init__(self, manager: DeploymentManager):
        self.manager = manager

    def collect(self) -> Iterable:
        state = GaugeMetricFamily(
            "depctl:deployment_state", "1 for the deployment's current state", labels=["deployment", "state"]
        )
        drafts = CounterMetricFamily(
            "depctl:spec_decode_num_drafts", "Steps that verified draft tokens", labels=["deployment"]
        )
        draft_tokens = CounterMetricFamily(
            "depctl:spec_decode_num_draft_tokens", "Draft tokens verified", labels=["deployment"]
        )
        accepted = CounterMetricFamily(
            "depctl:spec_decode_num_accepted_tokens", "Draft tokens accepted", labels=["deployment"]
        )
        per_pos = CounterMetricFamily(
            "depctl:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position",
            labels=["deployment", "position"],
        )
        grammar_tokens = CounterMetricFamily(
            "depctl:spec_decode_num_grammar_draft_tokens",
            "Of the draft tokens verified, those a request's grammar forced",
            labels=["deployment"],
        )
        grammar_accepted = CounterMetricFamily(
            "depctl:spec_decode_num_grammar_accepted_tokens",
            "Of the draft tokens accepted, those a request's grammar forced",
            labels=["deployment"],
        )
        grammar_seconds = CounterMetricFamily(
            "depctl:grammar_seconds", "Time spent in grammar matchers (masks, draft checks)", labels=["deployment"]
        )
        running = GaugeMetricFamily(
            "depctl:num_requests_running", "Requests in the running batch (prefilling included)", labels=["deployment"]
        )
        waiting = GaugeMetricFamily(
            "depctl:num_requests_waiting", "Requests waiting for a batch row", labels=["deployment"]
        )
        suffix_tokens = GaugeMetricFamily(
            "depctl:suffix_cache_tokens", "Tokens held by suffix speculation's index", labels=["deployment"]
        )
        suffix_requests = GaugeMetricFamily(
            "depctl:suffix_cache_requests", "Requests held by suffix speculation's index", labels=["deployment"]
        )
        # vLLM's names: prompt tokens looked up in the prefix cache, and found there
        prefix_queries = CounterMetricFamily(
            "depctl:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels=["deployment"]
        )
        prefix_hits = CounterMetricFamily(
            "depctl:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels=["deployment"]
        )
        prefix_bytes = GaugeMetricFamily(
            "depctl:prefix_cache_bytes", "Bytes held by the prefix cache's blocks", labels=["deployment"]
        )
        for dep in self.manager.all():
            state.add_metric([dep.id, dep.state.value], 1)
            if dep.backend is None:
                continue
            c = dep.backend.counters()
            drafts.add_metric([dep.id], c.drafts)
            draft_tokens.add_metric([dep.id], c.draft_tokens)
            accepted.add_metric([dep.id], c.accepted_tokens)
            for pos, count in enumerate(c.accepted_per_position):
                per_pos.add_metric([dep.id, str(pos)], count)
            for family, value in (
                (grammar_tokens, c.grammar_draft_tokens),
                (grammar_accepted, c.grammar_accepted_tokens),
                (grammar_seconds, c.grammar_seconds),
                (running, c.running),
                (waiting, c.waiting),
                (suffix_tokens, c.suffix_tokens),
                (suffix_requests, c.suffix_requests),
                (prefix_queries, c.prefix_cache_queries),
                (prefix_hits, c.prefix_cache_hits),
                (prefix_bytes, c.prefix_cache_bytes),
            ):
                if value is not None:
                    family.add_metric([dep.id], value)
        yield from (state, running, waiting, drafts, draft_tokens, accepted, per_pos, suffix_tokens, suffix_requests)
        yield from (grammar_tokens, grammar_accepted, grammar_seconds, prefix_queries, prefix_hits, prefix_bytes)


class Metrics:
    def __init__(self, manager: DeploymentManager):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "depctl:requests", "Finished requests", ["deployment", "endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("depctl:prompt_tokens", "Prompt tokens processed", ["deployment"], registry=r)
        self.generation_tokens = Counter("depctl:generation_tokens", "Tokens generated", ["deployment"], registry=r)
        self.ttft = Histogram(
            "depctl:time_to_first_token_seconds",
            "Time to first token",
            ["deployment"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "depctl:inter_token_latency_seconds",
            "Time per output token after the first",
            ["deployment"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "depctl:e2e_request_latency_seconds",
            "Request latency",
            ["deployment"],
            buckets=LATENCY_BUCKETS + (20.0, 60.0, 120.0),
            registry=r,
        )
        r.register(SpecDecodeCollector(manager))

    def observe_request(
        self,
        deployment: str,
        endpoint: str,
        status: str,
        prompt_tokens: int = 0,
        generated: int = 0,
        ttft: float | None = None,
        latency: float | None = None,
    ) -> None:
        self.requests.labels(deployment, endpoint, status).inc()
        if prompt_tokens:
            self.prompt_tokens.labels(deployment).inc(prompt_tokens)
        if generated:
            self.generation_tokens.labels(deployment).inc(generated)
        if ttft is not None:
            self.ttft.labels(deployment).observe(ttft)
        if latency is not None:
            self.e2e.labels(deployment).observe(latency)

    def observe_run(self, deployment: str, seconds: float, tokens: int) -> None:
        """A run of ``tokens`` accepted in one step arrived ``seconds`` after the previous run: each of its tokens
        is recorded with the mean gap, which is what a client streaming them sees on average."""
        if tokens > 0:
            hist = self.itl.labels(deployment)
            for _ in range(tokens):
                hist.observe(seconds / tokens)
