"""Prometheus collectors, named after vLLM's with the prefix `conveyor:`."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from conveyor.engine.llm_engine import LLMEngine
from conveyor.outputs import RequestOutput
from conveyor.spec.stats import SpecDecodingStats
from conveyor.structured.backend import GrammarCompiler

_LATENCY_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
]
_GRAMMAR_BUCKETS = [
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
]
_REQUEST_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
]


class EngineMetrics:
    """Updated from the engine thread after every step (AsyncEngine's on_step)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(f"conveyor:{name}", doc, labels, registry=reg, buckets=buckets)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"conveyor:{name}", doc, labels, registry=reg)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"conveyor:{name}", doc, labels + list(extra), registry=reg)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between tokens.", _LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency.", _REQUEST_BUCKETS
        )
        self.queue = histogram(
            "request_queue_time_seconds", "Time waiting before first run.", _REQUEST_BUCKETS
        )
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting (incl. preempted).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens received.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.preemptions = counter("num_preemptions_total", "Preemptions (recompute).")
        self.prefix_queries = counter(
            "prefix_cache_queries_total", "Prefix-cache lookups (tokens)."
        )
        self.prefix_hits = counter("prefix_cache_hits_total", "Prefix-cache hits (tokens).")
        self.success = counter("request_success_total", "Finished requests.", ("finished_reason",))
        self.spec_drafts = counter(
            "spec_decode_num_drafts_total", "Speculative verifications (requests x steps)."
        )
        self.spec_draft_tokens = counter(
            "spec_decode_num_draft_tokens_total", "Draft tokens proposed and verified."
        )
        self.spec_accepted = counter(
            "spec_decode_num_accepted_tokens_total", "Draft tokens accepted."
        )
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos_total",
            "Draft tokens accepted, by position in the draft (0 = first).",
            ("position",),
        )
        self.grammar_compile = histogram(
            "grammar_compile_seconds",
            "Structured output: time to compile a grammar (cache misses).",
            _GRAMMAR_BUCKETS,
        )
        self.grammar_queries = counter(
            "grammar_cache_queries_total", "Structured output: grammar cache lookups."
        )
        self.grammar_hits = counter(
            "grammar_cache_hits_total", "Structured output: grammar cache hits."
        )
        self.model_name = model_name
        # Every labelled series is created now, so /metrics lists them all from the start;
        # the step path uses these children directly (no label lookup per token).
        (
            self._ttft,
            self._itl,
            self._e2e,
            self._queue,
            self._running,
            self._waiting,
            self._kv_usage,
        ) = (
            c.labels(model_name)
            for c in (
                self.ttft,
                self.itl,
                self.e2e,
                self.queue,
                self.running,
                self.waiting,
                self.kv_usage,
            )
        )
        self._counters = {
            key: counter.labels(model_name)
            for key, counter in (
                ("prompt", self.prompt_tokens),
                ("gen", self.generation_tokens),
                ("preempt", self.preemptions),
                ("queries", self.prefix_queries),
                ("hits", self.prefix_hits),
                ("drafts", self.spec_drafts),
                ("draft_tokens", self.spec_draft_tokens),
                ("accepted", self.spec_accepted),
                ("grammar_queries", self.grammar_queries),
                ("grammar_hits", self.grammar_hits),
            )
        }
        self._grammar_compile = self.grammar_compile.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)
        self._last_token_time: dict[str, float] = {}
        self._seen = dict.fromkeys(self._counters, 0)

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        stats = engine.get_stats()
        self._running.set(stats.scheduler.num_running)
        self._waiting.set(stats.scheduler.num_waiting)
        self._kv_usage.set(stats.scheduler.kv_cache_usage)
        self._add("prompt", stats.num_prompt_tokens_total)
        self._add("gen", stats.num_generation_tokens_total)
        self._add("preempt", stats.scheduler.num_preemptions_total)
        self._add("queries", stats.scheduler.prefix_cache_queries)
        self._add("hits", stats.scheduler.prefix_cache_hits)
        if stats.spec is not None:
            self._observe_spec(stats.spec)
        for out in outputs:
            self._observe(engine, out, now)

    def _observe(self, engine: LLMEngine, out: RequestOutput, now: float) -> None:
        if any(c.token_ids for c in out.outputs):
            last = self._last_token_time.get(out.request_id)
            if last is not None:
                self._itl.observe(now - last)
            else:
                arrival = engine.arrival_time(out.request_id)
                if arrival is None and out.metrics is not None:
                    arrival = out.metrics.arrival_time
                if arrival is not None:
                    self._ttft.observe(now - arrival)
            self._last_token_time[out.request_id] = now
        if out.metrics is not None:  # finished
            self._last_token_time.pop(out.request_id, None)
            metrics = out.metrics
            if metrics.first_scheduled_time is not None:
                self._queue.observe(metrics.first_scheduled_time - metrics.arrival_time)
            self._e2e.observe(metrics.finished_time - metrics.arrival_time)
            reason = out.outputs[0].finish_reason if out.outputs else None
            self.success.labels(self.model_name, reason or "stop").inc()

    def _observe_spec(self, spec: SpecDecodingStats) -> None:
        self._add("drafts", spec.num_drafts)
        self._add("draft_tokens", spec.num_draft_tokens)
        self._add("accepted", spec.num_accepted_tokens)
        for position, total in enumerate(spec.accepted_per_position):
            key = f"pos{position}"
            if key not in self._counters:
                self._counters[key] = self.spec_accepted_per_pos.labels(
                    self.model_name, str(position)
                )
                self._seen[key] = 0
            self._add(key, total)

    def observe_grammars(self, compiler: GrammarCompiler) -> None:
        """The front end's grammar compiler (every constrained request is checked there, so
        its cache sees them all); called when /metrics is scraped."""
        queries, hits, seconds = compiler.take_stats()
        self._add("grammar_queries", queries)
        self._add("grammar_hits", hits)
        for value in seconds:
            self._grammar_compile.observe(value)

    def on_abort(self, engine: LLMEngine, request_id: str) -> None:
        self._last_token_time.pop(request_id, None)
        self.success.labels(self.model_name, "abort").inc()
        self.on_step(engine, [])

    def _add(self, key: str, total: int) -> None:
        delta = total - self._seen[key]
        if delta > 0:
            self._counters[key].inc(delta)
        self._seen[key] = total
