"""Benchmark workloads: request lengths and arrival times, shared by every bench command.

Prompts are token ids drawn at random from the vocabulary's ordinary tokens (no special
tokens), so their lengths are exact; `prompt_text` gives a text form for chat endpoints.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(slots=True)
class SampleRequest:
    prompt_token_ids: list[int]
    output_len: int
    prompt_text: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _ordinary_ids(tokenizer) -> np.ndarray:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = np.arange(len(tokenizer))
    return ids[~np.isin(ids, list(special))] if special else ids


def _lengths(rng: np.random.Generator, num: int, mean: int, range_ratio: float) -> np.ndarray:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=num)


def random_requests(
    tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[SampleRequest]:
    """vLLM's `random` dataset: lengths uniform in [len*(1-r), len*(1+r)]."""
    rng = np.random.default_rng(seed)
    vocab = _ordinary_ids(tokenizer)
    inputs = _lengths(rng, num, input_len, range_ratio)
    outputs = _lengths(rng, num, output_len, range_ratio)
    return [
        SampleRequest(rng.choice(vocab, size=int(n)).tolist(), int(m))
        for n, m in zip(inputs, outputs, strict=True)
    ]


def uniform_requests(
    tokenizer, num: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int = 0
) -> list[SampleRequest]:
    """The Orca paper's trace shape: prompt and output lengths uniform in closed ranges."""
    rng = np.random.default_rng(seed)
    vocab = _ordinary_ids(tokenizer)
    inputs = rng.integers(prompt_range[0], prompt_range[1] + 1, size=num)
    outputs = rng.integers(output_range[0], output_range[1] + 1, size=num)
    return [
        SampleRequest(rng.choice(vocab, size=int(n)).tolist(), int(m))
        for n, m in zip(inputs, outputs, strict=True)
    ]


def prefix_repetition_requests(
    tokenizer,
    num: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """vLLM's `prefix-repetition` dataset: a few shared prefixes, each with random suffixes."""
    rng = np.random.default_rng(seed)
    vocab = _ordinary_ids(tokenizer)
    prefixes = [rng.choice(vocab, size=prefix_len).tolist() for _ in range(num_prefixes)]
    requests = [
        SampleRequest(
            prefixes[i % num_prefixes] + rng.choice(vocab, size=suffix_len).tolist(), output_len
        )
        for i in range(num)
    ]
    order = rng.permutation(num)
    return [requests[i] for i in order]


def sharegpt_requests(
    path: str | Path,
    tokenizer,
    num: int,
    output_len: int | None = None,
    seed: int = 0,
    max_len: int = 2048,
) -> list[SampleRequest]:
    """Conversations from a ShareGPT JSON file the user supplies: the first human turn is the
    prompt, the first reply's length (or output_len) the output length."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"ShareGPT dataset {str(path)!r} does not exist")
    data = json.loads(path.read_text())
    rng = np.random.default_rng(seed)
    requests = []
    for index in rng.permutation(len(data)):
        turns = data[index].get("conversations") or []
        if len(turns) < 2:
            continue
        prompt_ids = tokenizer(turns[0]["value"]).input_ids
        reply_len = output_len or len(tokenizer(turns[1]["value"]).input_ids)
        if len(prompt_ids) < 4 or reply_len < 4 or len(prompt_ids) + reply_len > max_len:
            continue
        requests.append(SampleRequest(list(prompt_ids), reply_len, turns[0]["value"]))
        if len(requests) == num:
            break
    if len(requests) < num:
        raise ValueError(f"{str(path)!r} has only {len(requests)} usable conversations")
    return requests


def arrival_times(
    num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Seconds from the start at which each request is sent. Gamma inter-arrival times with
    shape `burstiness` and mean 1/rate (burstiness 1 is a Poisson process); rate inf: all at 0."""
    if request_rate == math.inf:
        return [0.0] * num
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def check_workload_args(args) -> None:
    positive = [
        "num_prompts",
        "random_input_len",
        "random_output_len",
        "prefix_repetition_prefix_len",
        "prefix_repetition_num_prefixes",
        "prefix_repetition_output_len",
    ]
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prefix_repetition_suffix_len < 0:
        raise ValueError("--prefix-repetition-suffix-len must be >= 0")
    if args.sharegpt_output_len is not None and args.sharegpt_output_len < 1:
        raise ValueError("--sharegpt-output-len must be >= 1")


def sample_requests(args, tokenizer) -> list[SampleRequest]:
    check_workload_args(args)
    if args.dataset_name == "random":
        return random_requests(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    if args.dataset_name == "prefix-repetition":
        return prefix_repetition_requests(
            tokenizer,
            args.num_prompts,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
            args.seed,
        )
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
    return sharegpt_requests(
        args.dataset_path, tokenizer, args.num_prompts, args.sharegpt_output_len, args.seed
    )
