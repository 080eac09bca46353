"""Flags shared by the bench commands: workloads, results, the serve and throughput clients.

Its own module so that bench/cli.py and the commands (spec.py, ...) both import it instead of
each other.
"""

from __future__ import annotations

import argparse
import json
import math

from conveyor.entrypoints.args import add_engine_args

DATASETS = (
    "random",
    "prefix-repetition",
    "sharegpt",
    "spec-edit",
    "spec-control",
    "json-schema",
)


# vllm bench serve's backends whose servers speak OpenAI's API; openai-chat sends chat,
# openai-embeddings embeddings (/v1/embeddings: a request's latency, input tokens/s).
SERVE_BACKENDS = (
    "vllm", "openai", "openai-chat", "openai-embeddings", "sglang", "lmdeploy", "llama.cpp",
)  # fmt: skip
# vllm bench serve's sampling flags, sent with every request where given.
SAMPLING_FLAGS = (
    "--top-p",
    "--top-k",
    "--min-p",
    "--frequency-penalty",
    "--presence-penalty",
    "--repetition-penalty",
)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text[:80]!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text[:80]!r}")
    return value


def add_dataset_args(parser: argparse.ArgumentParser, with_seed: bool = True) -> None:
    # --dataset: the name vLLM's structured-output benchmark gives this flag.
    parser.add_argument("--dataset-name", "--dataset", default="random", choices=DATASETS)
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (sharegpt)")
    parser.add_argument("--num-prompts", type=int, default=1000)
    # --input-len / --output-len: vLLM's general names, the random workload's lengths here
    parser.add_argument("--random-input-len", "--input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", "--output-len", type=int, default=128)
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)]",
    )
    parser.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    parser.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    parser.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    parser.add_argument("--prefix-repetition-output-len", type=int, default=128)
    parser.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="output length for every sharegpt request (default: the reply's)",
    )
    add_spec_workload_args(parser)
    add_structured_workload_args(parser)
    parser.add_argument(
        "--structured-ratio",
        "--structured-output-ratio",
        type=float,
        default=1.0,
        help="json-schema: the share of requests constrained to their schema (round(R x n), "
        "spread evenly); the rest ask for the same JSON unconstrained",
    )
    if with_seed:
        parser.add_argument("--seed", type=int, default=0)


def add_spec_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec-input-len",
        type=int,
        default=300,
        help="spec-edit / spec-control: about this many prompt tokens, chat template included",
    )
    parser.add_argument("--spec-output-len", type=int, default=128)


def add_structured_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--structured-output-len",
        type=int,
        default=256,
        help="json-schema: max tokens of each answer (EOS is never ignored: a constrained "
        "answer ends when its JSON is complete)",
    )


def add_result_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--save-result", action="store_true", help="write the results as JSON")
    parser.add_argument("--result-dir", default=None, help="folder of the JSON file (default: .)")
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--disable-tqdm", action="store_true")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser)
    parser.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1", help="used when --base-url is not given")
    parser.add_argument("--port", type=int, default=8000, help="used when --base-url is not given")
    parser.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="/v1/completions (token-id prompts), /v1/chat/completions (text) or "
        "/v1/embeddings (token-id inputs)",
    )
    parser.add_argument(
        "--backend",
        default=None,
        choices=SERVE_BACKENDS,
        help="vllm bench serve's: openai-chat sends chat completions (--endpoint "
        "/v1/chat/completions), openai-embeddings each prompt's token ids to /v1/embeddings "
        "(its latency is its TTFT and E2EL), the others completions; each server speaks "
        "OpenAI's API",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model name sent to the server, when it is not --model (which then only "
        "names the tokenizer)",
    )
    for flag in SAMPLING_FLAGS:
        parser.add_argument(flag, type=float, default=None, help="sent with every request")
    parser.add_argument(
        "--extra-body",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="fields added to every request's body, e.g. '{\"min_tokens\": 8}'",
    )
    parser.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        metavar="N",
        help="requests sent (the workload's first N) and awaited before the measured run",
    )
    parser.add_argument(
        "--ready-check-timeout-sec",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to this long for the server to list its models before starting "
        "(default 0: it must be up already)",
    )
    parser.add_argument(
        "--label", default=None, help="a name for this run, in the saved result ('label')"
    )
    parser.add_argument(
        "--metadata",
        nargs="+",
        default=None,
        metavar="KEY=VALUE",
        help="pairs saved with the result, e.g. machine=zen3 peer=vllm",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted (vllm bench serve's): tokenizers load here without remote code",
    )
    parser.add_argument(
        "--header",
        nargs="+",
        default=None,
        metavar="KEY=VALUE",
        help="HTTP headers sent with every request",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="model name sent to the server (default: the first of /v1/models)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="HF folder or .gguf file (default: --model if it is a local path, "
        "else conveyor's default model)",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s (default inf: all sent at once)",
    )
    parser.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the inter-arrival times; 1 is a Poisson process",
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="LoRA adapters the server serves: requests name them as their model, in turn "
        "(as vllm bench serve's --lora-modules)",
    )
    parser.add_argument(
        "--lora-ratio",
        type=float,
        default=1.0,
        help="with --lora-modules: the fraction of requests sent to an adapter, spread evenly "
        "over the run; the others go to the base model (default 1: all)",
    )
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:3000",
    )
    parser.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help="comma-separated, from ttft,tpot,itl,e2el",
    )
    parser.add_argument(
        "--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 25,50,99"
    )
    add_result_args(parser)


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)  # it brings --seed, which the workload uses too
    add_dataset_args(parser, with_seed=False)
    add_result_args(parser)
