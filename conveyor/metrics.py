"""Prometheus collectors, named after vLLM's with the prefix `conveyor:`.

Every series is exported under both prefixes, always: `conveyor:*` as observed here, and
`vllm:*` with vLLM's names, help texts, label names and buckets (conveyor/metrics_vllm.py), so
a dashboard built for vLLM works unchanged and conveyor's own dashboards keep theirs. The
`vllm:` copy is made when /metrics is scraped, from the same samples: nothing is observed
twice. A flag to choose one prefix would only make users find out which one their dashboard
needs."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter as Tally
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from conveyor.engine.client import EngineClient
from conveyor.metrics_vllm import (
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    PARAMS_N_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    VllmView,
    buckets_1_2_5,
)
from conveyor.outputs import RequestMetrics, RequestOutput
from conveyor.speculative.stats import SpecDecodingStats
from conveyor.structured.backend import GrammarCompiler

if TYPE_CHECKING:
    from conveyor.engine.core_io import CoreInfo
    from conveyor.lora.request import LoRAStats

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
    2560.0,
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
    7680.0,
]
# conveyor's bounds hold all of vLLM's, so that metrics_vllm exports exact vLLM histograms.
_ITL_BUCKETS = sorted(set(_LATENCY_BUCKETS) | set(ITL_BUCKETS))
assert set(TTFT_BUCKETS) <= set(_LATENCY_BUCKETS)
assert set(REQUEST_LATENCY_BUCKETS) <= set(_REQUEST_BUCKETS)


class RecentLatencies:
    """The observations of the last `window` seconds, for percentiles at a constant cost
    whatever the rate: one array of log-spaced buckets (2% wide, 10 us to 1000 s) per second
    of the window. A percentile is the middle of its bucket: within 1% of the exact value."""

    LOW, RATIO, NUM_BUCKETS = 1e-5, 1.02, 931  # LOW * RATIO**NUM_BUCKETS > 1000 s

    def __init__(self, window: float = 60.0) -> None:
        self.window = window
        self._log_ratio = math.log(self.RATIO)
        self._seconds: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()  # observed on the engine thread, read on the event loop

    def observe(self, value: float, now: float) -> None:
        index = int(math.log(max(value, self.LOW) / self.LOW) / self._log_ratio)
        second = int(now)
        counts = self._seconds.get(second)
        if counts is None:
            with self._lock:
                counts = self._seconds[second] = np.zeros(self.NUM_BUCKETS, np.int64)
                for old in [s for s in self._seconds if s <= second - self.window]:
                    del self._seconds[old]
        counts[min(index, self.NUM_BUCKETS - 1)] += 1

    def summary(self, now: float, quantiles=(0.5, 0.9, 0.99)) -> dict:
        """{"n", "p50", "p90", "p99"} over the window (seconds; None without observations)."""
        with self._lock:
            recent = [c for s, c in self._seconds.items() if s > now - self.window]
        total = np.sum(recent, axis=0) if recent else np.zeros(self.NUM_BUCKETS, np.int64)
        count = int(total.sum())
        out: dict = {"n": count}
        cumulative = np.cumsum(total)
        for q in quantiles:
            key = f"p{q * 100:g}"
            if count == 0:
                out[key] = None
                continue
            index = int(np.searchsorted(cumulative, q * count))
            out[key] = self.LOW * self.RATIO ** (index + 0.5)
        return out


class _Totals:
    """Counters fed from running totals: stats carry totals, counters take increments."""

    __slots__ = ("counters", "seen")

    def __init__(self, counters: dict) -> None:
        self.counters = counters
        self.seen = dict.fromkeys(counters, 0)

    def add(self, key: str, total: int) -> None:
        delta = total - self.seen[key]
        if delta > 0:
            self.counters[key].inc(delta)
        self.seen[key] = total


class _RequestHistograms(NamedTuple):
    """The series each finished request adds to once (labelled children), as vLLM's: the
    phases of its life and its sizes."""

    prefill: Histogram
    decode: Histogram
    inference: Histogram
    prompt_tokens: Histogram
    generation_tokens: Histogram
    max_generation_tokens: Histogram
    n: Histogram
    max_tokens: Histogram

    @classmethod
    def build(
        cls, reg: CollectorRegistry, model_name: str, max_model_len: int
    ) -> _RequestHistograms:
        tokens = buckets_1_2_5(max_model_len)
        specs = [
            ("request_prefill_time_seconds", "From first scheduled to first token.", None),
            ("request_decode_time_seconds", "From first token to the last.", None),
            ("request_inference_time_seconds", "From first scheduled to the last token.", None),
            ("request_prompt_tokens", "Prompt tokens of a finished request.", tokens),
            ("request_generation_tokens", "Tokens a request generated (all its n).", tokens),
            ("request_max_num_generation_tokens", "Tokens of a request's longest of n.", tokens),
            ("request_params_n", "The n of finished requests.", PARAMS_N_BUCKETS),
            ("request_params_max_tokens", "max_tokens of finished requests (resolved).", tokens),
        ]
        return cls(
            *(
                Histogram(
                    f"conveyor:{name}",
                    doc,
                    ["model_name"],
                    registry=reg,
                    buckets=buckets or _REQUEST_BUCKETS,
                ).labels(model_name)
                for name, doc, buckets in specs
            )
        )

    def observe(self, out: RequestOutput, metrics: RequestMetrics) -> None:
        """vLLM's phases: prefill from first scheduled to first token, decode from there to
        the last token (a request that generated none: all prefill)."""
        scheduled, finished = metrics.first_scheduled_time, metrics.finished_time
        if scheduled is not None and finished is not None:
            first_token = metrics.first_token_time or finished
            # max(0): the core's process stamps `scheduled`; a clock apart may run behind.
            self.prefill.observe(max(first_token - scheduled, 0.0))
            self.decode.observe(max(finished - first_token, 0.0))
            self.inference.observe(max(finished - scheduled, 0.0))
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        self.generation_tokens.observe(metrics.num_generation_tokens)
        self.max_generation_tokens.observe(metrics.max_num_generation_tokens)
        self.n.observe(metrics.n)
        if metrics.max_tokens is not None:
            self.max_tokens.observe(metrics.max_tokens)


class _ReplicaSeries(_Totals):
    """The series one engine core feeds from its stats (label replica="i")."""

    __slots__ = (
        "labels",
        "running",
        "waiting",
        "kv_usage",
        "per_position",
        "iteration_tokens",
        "iteration_new_tokens",
        "last_seq",
    )

    def __init__(self, metrics: EngineMetrics, labels: tuple[str, str]) -> None:
        self.labels = labels
        self.running = metrics.running.labels(*labels)
        self.waiting = metrics.waiting.labels(*labels)
        self.kv_usage = metrics.kv_usage.labels(*labels)
        self.iteration_tokens = metrics.iteration_tokens.labels(*labels)
        self.iteration_new_tokens = metrics.iteration_new_tokens.labels(*labels)
        self.last_seq: int | None = None  # the last step record observed
        super().__init__(
            {
                key: counter.labels(*labels)
                for key, counter in (
                    ("prompt", metrics.prompt_tokens),
                    ("gen", metrics.generation_tokens),
                    ("preempt", metrics.preemptions),
                    ("queries", metrics.prefix_queries),
                    ("hits", metrics.prefix_hits),
                    ("drafts", metrics.spec_drafts),
                    ("draft_tokens", metrics.spec_draft_tokens),
                    ("accepted", metrics.spec_accepted),
                )
            }
        )
        self.per_position = metrics.spec_accepted_per_pos


class EngineMetrics:
    """Updated after every step (AsyncEngine's on_step, on the engine thread; AsyncMPEngine's,
    on the event loop). The series an engine core feeds from its stats carry a `replica`
    label ("0" for a single engine), one per data-parallel replica."""

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        num_replicas: int = 1,
        recent: bool = False,
        max_model_len: int = 2**20,
    ) -> None:
        """recent: also keep the last minute's TTFT and inter-token latencies (the dashboard).
        max_model_len: the top bound of the token-count histograms (as vLLM's)."""
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        per_replica = ["model_name", "replica"]
        # conveyor's series live in their own registry, which `registry` exports twice: as
        # they are, and under vLLM's names (metrics_vllm).
        reg = self.conveyor_registry = CollectorRegistry()
        self.registry.register(reg)
        self.registry.register(VllmView(reg))

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(f"conveyor:{name}", doc, labels, registry=reg, buckets=buckets)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"conveyor:{name}", doc, per_replica, registry=reg)

        def counter(name: str, doc: str, extra: tuple[str, ...] = (), base=labels) -> Counter:
            return Counter(f"conveyor:{name}", doc, base + list(extra), registry=reg)

        def replica_counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return counter(name, doc, extra, per_replica)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", _ITL_BUCKETS)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency.", _REQUEST_BUCKETS
        )
        self.queue = histogram(
            "request_queue_time_seconds", "Time waiting before first run.", _REQUEST_BUCKETS
        )
        self._requests = _RequestHistograms.build(reg, model_name, max_model_len)
        self.iteration_tokens = Histogram(
            "conveyor:iteration_tokens_total",
            "Tokens computed per engine step (prompt chunks, decoded and draft tokens).",
            per_replica,
            registry=reg,
            buckets=ITERATION_TOKENS_BUCKETS,
        )
        # vLLM's iteration_tokens_total: a step's new prompts, whole (cached tokens too), and
        # the tokens it generated; what the step computed is iteration_tokens above.
        self.iteration_new_tokens = Histogram(
            "conveyor:iteration_new_tokens",
            "Prompt tokens of the requests a step started and tokens it generated.",
            per_replica,
            registry=reg,
            buckets=ITERATION_TOKENS_BUCKETS,
        )
        self.cache_config = Gauge(
            "conveyor:cache_config_info",
            "The KV cache's configuration, in the labels (always 1).",
            [*per_replica, "block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"],
            registry=reg,
        )
        self.lora_info = Gauge(
            "conveyor:lora_requests_info",
            "LoRA adapters of the running and the waiting requests, in the labels (comma-"
            "separated names), and max_lora; the value is when it was observed (as vLLM's).",
            [*per_replica, "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=reg,
        )
        self._lora_labels: dict[str, tuple[str, ...]] = {}  # replica -> its current series
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting (incl. preempted).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.prompt_tokens = replica_counter("prompt_tokens_total", "Prompt tokens received.")
        self.generation_tokens = replica_counter("generation_tokens_total", "Tokens generated.")
        self.preemptions = replica_counter("num_preemptions_total", "Preemptions (recompute).")
        self.prefix_queries = replica_counter(
            "prefix_cache_queries_total", "Prefix-cache lookups (tokens)."
        )
        self.prefix_hits = replica_counter("prefix_cache_hits_total", "Prefix-cache hits (tokens).")
        self.success = counter("request_success_total", "Finished requests.", ("finished_reason",))
        self.spec_drafts = replica_counter(
            "spec_decode_num_drafts_total", "Speculative verifications (requests x steps)."
        )
        self.spec_draft_tokens = replica_counter(
            "spec_decode_num_draft_tokens_total", "Draft tokens proposed and verified."
        )
        self.spec_accepted = replica_counter(
            "spec_decode_num_accepted_tokens_total", "Draft tokens accepted."
        )
        self.spec_accepted_per_pos = replica_counter(
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
        self._ttft, self._itl, self._e2e, self._queue = (
            c.labels(model_name) for c in (self.ttft, self.itl, self.e2e, self.queue)
        )
        self._replicas = {
            str(i): _ReplicaSeries(self, (model_name, str(i))) for i in range(num_replicas)
        }
        self._grammar_totals = _Totals(
            {
                "grammar_queries": self.grammar_queries.labels(model_name),
                "grammar_hits": self.grammar_hits.labels(model_name),
            }
        )
        self._grammar_compile = self.grammar_compile.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)
        self._last_token_time: dict[str, float] = {}
        self.finished: Tally[str] = Tally()  # finished requests by reason, as request_success
        self.recent_ttft = RecentLatencies() if recent else None
        self.recent_itl = RecentLatencies() if recent else None

    def _replica(self, engine) -> _ReplicaSeries:
        key = str(engine.replica_index)
        series = self._replicas.get(key)
        if series is None:
            series = self._replicas[key] = _ReplicaSeries(self, (self.model_name, key))
        return series

    def on_step(self, engine: EngineClient, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        stats = engine.get_stats()
        series = self._replica(engine)
        series.running.set(stats.scheduler.num_running)
        series.waiting.set(stats.scheduler.num_waiting)
        series.kv_usage.set(stats.scheduler.kv_cache_usage)
        new_tokens = stats.num_prompt_tokens_total + stats.num_generation_tokens_total
        new_tokens -= series.seen["prompt"] + series.seen["gen"]
        if new_tokens > 0:
            series.iteration_new_tokens.observe(new_tokens)
        series.add("prompt", stats.num_prompt_tokens_total)
        series.add("gen", stats.num_generation_tokens_total)
        series.add("preempt", stats.scheduler.num_preemptions_total)
        series.add("queries", stats.scheduler.prefix_cache_queries)
        series.add("hits", stats.scheduler.prefix_cache_hits)
        record = stats.last_record  # the step's (an abort re-reports the last one: seq)
        if record is not None and record.seq != series.last_seq:
            series.last_seq = record.seq
            if num_tokens := record.prefill_tokens + record.decode_tokens:
                series.iteration_tokens.observe(num_tokens)
        if stats.spec is not None:
            self._observe_spec(series, stats.spec)
        if stats.lora is not None:
            self._observe_lora(series.labels, stats.lora)
        for out in outputs:
            self._observe(engine, out, now)

    def _observe(self, engine: EngineClient, out: RequestOutput, now: float) -> None:
        if any(c.token_ids for c in out.outputs):
            last = self._last_token_time.get(out.request_id)
            if last is not None:
                self._itl.observe(now - last)
                if self.recent_itl is not None:
                    self.recent_itl.observe(now - last, now)
            else:
                arrival = engine.arrival_time(out.request_id)
                if arrival is None and out.metrics is not None:
                    arrival = out.metrics.arrival_time
                if arrival is not None:
                    self._ttft.observe(now - arrival)
                    if self.recent_ttft is not None:
                        self.recent_ttft.observe(now - arrival, now)
            self._last_token_time[out.request_id] = now
        if out.metrics is not None:  # finished
            self._last_token_time.pop(out.request_id, None)
            metrics = out.metrics
            if metrics.first_scheduled_time is not None:
                self._queue.observe(metrics.first_scheduled_time - metrics.arrival_time)
            self._e2e.observe(metrics.finished_time - metrics.arrival_time)
            self._requests.observe(out, metrics)
            reason = (out.outputs[0].finish_reason if out.outputs else None) or "stop"
            self.success.labels(self.model_name, reason).inc()
            self.finished[reason] += 1

    def _observe_spec(self, series: _ReplicaSeries, spec: SpecDecodingStats) -> None:
        series.add("drafts", spec.num_drafts)
        series.add("draft_tokens", spec.num_draft_tokens)
        series.add("accepted", spec.num_accepted_tokens)
        for position, total in enumerate(spec.accepted_per_position):
            key = f"pos{position}"
            if key not in series.counters:
                series.counters[key] = series.per_position.labels(*series.labels, str(position))
                series.seen[key] = 0
            series.add(key, total)

    def _observe_lora(self, replica_labels: tuple[str, str], lora: LoRAStats) -> None:
        """One series per replica: the one of the previous adapter sets is removed (vLLM keeps
        every set it saw, which grows without bound)."""
        labels = (
            *replica_labels,
            str(lora.max_loras),
            ",".join(lora.waiting),
            ",".join(lora.running),
        )
        previous = self._lora_labels.get(replica_labels[1])
        if previous is not None and previous != labels:
            self.lora_info.remove(*previous)
        self._lora_labels[replica_labels[1]] = labels
        self.lora_info.labels(*labels).set(time.time())

    def observe_grammars(self, compiler: GrammarCompiler) -> None:
        """The front end's grammar compiler (every constrained request is checked there, so
        its cache sees them all); called when /metrics is scraped."""
        queries, hits, seconds = compiler.take_stats()
        self._grammar_totals.add("grammar_queries", queries)
        self._grammar_totals.add("grammar_hits", hits)
        for value in seconds:
            self._grammar_compile.observe(value)

    def set_cache_config(self, info: CoreInfo, num_replicas: int = 1) -> None:
        """cache_config_info: one series per replica, valued 1, whose labels say how its KV
        cache is laid out (vLLM's label names; num_gpu_blocks whatever the device)."""
        cache = info.cache_config
        for replica in range(num_replicas):
            self.cache_config.labels(
                model_name=self.model_name,
                replica=str(replica),
                block_size=str(cache.block_size),
                num_gpu_blocks=str(info.num_blocks),
                cache_dtype=cache.kv_cache_dtype,
                enable_prefix_caching=str(cache.enable_prefix_caching),
            ).set(1)
            if info.lora_config is not None:  # listed from the start, as vLLM's
                from conveyor.lora.request import LoRAStats

                idle = LoRAStats((), (), info.lora_config.max_loras)
                self._observe_lora((self.model_name, str(replica)), idle)

    def on_abort(self, engine: EngineClient, request_id: str) -> None:
        self._last_token_time.pop(request_id, None)
        self.success.labels(self.model_name, "abort").inc()
        self.finished["abort"] += 1
        self.on_step(engine, [])
