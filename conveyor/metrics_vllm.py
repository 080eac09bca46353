"""vLLM's names for conveyor's metrics, so that a dashboard or alert built for vLLM works
unchanged against `conveyor serve`.

Every series is observed once, under conveyor's own name (conveyor/metrics.py). `VllmView` is
a collector that, when /metrics is scraped, exports the same samples a second time under
vLLM's names: prefix `vllm:`, vLLM's help texts, the label `replica` renamed to vLLM's
`engine`, and histogram buckets cut down to vLLM's bounds. conveyor's histograms have every
bound vLLM's have (the bucket lists below are vLLM's, and conveyor/metrics.py builds its own
from them), so the cut-down buckets are exact counts, not estimates. The step path pays
nothing for the second name.

Names, help texts and buckets are those of vLLM's v1 PrometheusStatLogger
(vllm/v1/metrics/loggers.py), plus two of its older names that its example Grafana dashboard
still reads: `vllm:time_per_output_token_seconds` (now `inter_token_latency_seconds`) and
`vllm:gpu_cache_usage_perc` (now `kv_cache_usage_perc`).

What differs: vLLM counts a request with n > 1 as n requests in its per-request series;
conveyor counts the user's request once (its generation tokens summed over the n
completions), as in conveyor's own series. vLLM labels every series with `engine`; conveyor's
per-request histograms are observed in the front end for all replicas together and carry
`model_name` alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple, Protocol

from prometheus_client.metrics_core import Metric

PREFIX = "conveyor:"
VLLM_PREFIX = "vllm:"

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's bounds of its token-count histograms
    (prompt and generation tokens, max_tokens), with max_value the context length."""
    bounds, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return bounds
            bounds.append(mantissa * scale)
        scale *= 10


class _Export(NamedTuple):
    name: str  # vLLM's, without the prefix
    help: str  # vLLM's
    buckets: tuple[float, ...] | None = None  # vLLM's, where conveyor's histogram has more


# conveyor's family name (prometheus_client drops a counter's `_total`) -> its vLLM names.
_EXPORTS: dict[str, tuple[_Export, ...]] = {
    "num_requests_running": (
        _Export("num_requests_running", "Number of requests in model execution batches."),
    ),
    "num_requests_waiting": (
        _Export("num_requests_waiting", "Number of requests waiting to be processed."),
    ),
    "kv_cache_usage_perc": (
        _Export("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
        _Export("gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage."),
    ),
    "prefix_cache_queries": (
        _Export(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        ),
    ),
    "prefix_cache_hits": (
        _Export("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ),
    "num_preemptions": (
        _Export("num_preemptions", "Cumulative number of preemption from the engine."),
    ),
    "prompt_tokens": (_Export("prompt_tokens", "Number of prefill tokens processed."),),
    "generation_tokens": (_Export("generation_tokens", "Number of generation tokens processed."),),
    "request_success": (_Export("request_success", "Count of successfully processed requests."),),
    "request_prompt_tokens": (
        _Export("request_prompt_tokens", "Number of prefill tokens processed."),
    ),
    "request_generation_tokens": (
        _Export("request_generation_tokens", "Number of generation tokens processed."),
    ),
    "request_max_num_generation_tokens": (
        _Export(
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
        ),
    ),
    "iteration_new_tokens": (
        _Export("iteration_tokens_total", "Histogram of number of tokens per engine_step."),
    ),
    "request_params_n": (_Export("request_params_n", "Histogram of the n request parameter."),),
    "request_params_max_tokens": (
        _Export("request_params_max_tokens", "Histogram of the max_tokens request parameter."),
    ),
    "time_to_first_token_seconds": (
        _Export(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        ),
    ),
    "inter_token_latency_seconds": (
        _Export(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        ),
        _Export(
            "time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            ITL_BUCKETS,
        ),
    ),
    "e2e_request_latency_seconds": (
        _Export(
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        ),
    ),
    "request_queue_time_seconds": (
        _Export(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ),
    ),
    "request_inference_time_seconds": (
        _Export(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ),
    ),
    "request_prefill_time_seconds": (
        _Export(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ),
    ),
    "request_decode_time_seconds": (
        _Export(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ),
    ),
    "spec_decode_num_drafts": (
        _Export("spec_decode_num_drafts", "Number of spec decoding drafts."),
    ),
    "spec_decode_num_draft_tokens": (
        _Export("spec_decode_num_draft_tokens", "Number of draft tokens."),
    ),
    "spec_decode_num_accepted_tokens": (
        _Export("spec_decode_num_accepted_tokens", "Number of accepted tokens."),
    ),
    "spec_decode_num_accepted_tokens_per_pos": (
        _Export("spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position."),
    ),
    "cache_config_info": (
        _Export("cache_config_info", "Information of the LLMEngine CacheConfig"),
    ),
    "lora_requests_info": (_Export("lora_requests_info", "Running stats on lora requests."),),
}
# Every vLLM name the view exports (tests and the README list them).
VLLM_NAMES = sorted(VLLM_PREFIX + e.name for exports in _EXPORTS.values() for e in exports)


class _Source(Protocol):
    def collect(self) -> Iterable[Metric]: ...


class VllmView:
    """A collector: conveyor's series from `source` (the registry conveyor/metrics.py
    registers them in), again under vLLM's names."""

    def __init__(self, source: _Source) -> None:
        self.source = source

    def describe(self) -> list[Metric]:
        return []  # no names to reserve: the registry then never collects at registration

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if not family.name.startswith(PREFIX):
                continue
            for export in _EXPORTS.get(family.name[len(PREFIX) :], ()):
                yield _renamed(family, export)


def _renamed(family: Metric, export: _Export) -> Metric:
    name = VLLM_PREFIX + export.name
    metric = Metric(name, export.help, family.type)
    bounds = None if export.buckets is None else {float(b) for b in export.buckets}
    for sample in family.samples:
        suffix = sample.name[len(family.name) :]  # _total, _bucket, _count, _sum, _created
        labels = sample.labels
        if bounds is not None and suffix == "_bucket":
            bound = labels.get("le")
            if bound != "+Inf" and float(bound) not in bounds:
                continue
        if "replica" in labels:
            labels = {("engine" if k == "replica" else k): v for k, v in labels.items()}
        metric.samples.append(sample._replace(name=name + suffix, labels=labels))
    return metric
