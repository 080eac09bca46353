"""The flags of vLLM's `vllm serve` line that are not engine settings, so that a user's serve
line runs here as it is: each one either does what vLLM's does, or (marked "accepted") asks
for what conveyor already does, and its help says why. The engine's own vLLM flags
(--max-model-len, --generation-config, --gpu-memory-utilization, ...) are EngineArgs'.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conveyor.entrypoints.openai.chat_content import CONTENT_FORMATS


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(
            f"must be a JSON list of strings, e.g. '[\"*\"]', got {text!r}"
        )
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_serve_line_args(group) -> None:
    group.add_argument(
        "--model",
        dest="model_flag",
        default=None,
        metavar="MODEL",
        help="the model, given as a flag instead of the positional argument (vLLM's)",
    )
    group.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a YAML file of these flags, as vLLM's (`port: 8000`, `enable-prefix-caching: "
        "true`, `served-model-name: [a, b]`, `model: PATH`, JSON settings as mappings): the "
        "command line's own flags win over the file's",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="the Jinja chat template to render chats with instead of the tokenizer's: a "
        "file, or the template itself on one line (\\n for a newline), as vLLM's",
    )
    group.add_argument(
        "--response-role",
        default="assistant",
        help="the role a chat completion's message names when the request adds a generation "
        "prompt (else the last message's role), as vLLM's",
    )
    group.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="serve no /docs, /redoc or /openapi.json",
    )
    group.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=None,
        metavar="JSON",
        help="CORS: the origins a browser page may call the API from, e.g. "
        "'[\"https://ui.example\"]' or '[\"*\"]'. vLLM allows every origin by default; "
        "conveyor allows none until this is given",
    )
    group.add_argument(
        "--allowed-methods", type=_json_list, default=["*"], metavar="JSON", help="CORS"
    )
    group.add_argument(
        "--allowed-headers", type=_json_list, default=["*"], metavar="JSON", help="CORS"
    )
    group.add_argument("--allow-credentials", action="store_true", help="CORS")
    group.add_argument(
        "--root-path",
        default="",
        metavar="PATH",
        help="the path prefix a proxy in front of the server strips (FastAPI's root_path: the "
        "schema's server URL and the docs pages carry it)",
    )
    group.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprobs name every token "token_id:N" (as a request\'s return_tokens_as_token_ids '
        "asks): a token that is not valid UTF-8 on its own stays identifiable",
    )
    group.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every stream of /v1/completions and /v1/chat/completions ends with a usage chunk, "
        "as stream_options.include_usage asks",
    )
    group.add_argument(
        "--ssl-keyfile", default=None, metavar="FILE", help="HTTPS: the server's private key"
    )
    group.add_argument(
        "--ssl-certfile", default=None, metavar="FILE", help="HTTPS: the server's certificate"
    )
    group.add_argument(
        "--ssl-ca-certs",
        default=None,
        metavar="FILE",
        help="HTTPS: the CA certificates client certificates are checked against",
    )
    group.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="HTTPS: whether a client certificate is required (Python's ssl.CERT_NONE 0, "
        "CERT_OPTIONAL 1, CERT_REQUIRED 2), as vLLM's",
    )
    group.add_argument(
        "--tokenizer-mode",
        default="auto",
        help="auto or hf: the checkpoint's tokenizer as transformers' AutoTokenizer loads it "
        "(its fast one); vLLM's slow and mistral modes are refused",
    )
    group.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no uvicorn line per HTTP request",
    )
    group.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="every response carries X-Request-Id: the request's own, else a new one",
    )
    group.add_argument(
        "--structured-outputs-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="accepted: structured output runs llguidance whatever backend this names "
        '(vLLM\'s \'{"backend": "xgrammar"}\' or "guidance"); the grammar a request gives is '
        "the same language under each",
    )
    group.add_argument(
        "--guided-decoding-backend",
        default=None,
        metavar="NAME",
        help="accepted: vLLM's earlier spelling of --structured-outputs-config's backend",
    )
    group.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted: conveyor runs no code from a checkpoint (each family it serves is its "
        "own code, model/families.py), so there is none to trust",
    )
    group.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log every request as it reaches the engine: its id, prompt (text and token "
        "ids), sampling parameters and LoRA adapter, at INFO (vLLM's)",
    )
    group.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        metavar="N",
        help="with --enable-log-requests: the characters of a prompt's text and the token ids "
        "logged (default: all)",
    )
    group.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="accepted: requests are logged only with --enable-log-requests (vLLM's default "
        "since 0.10 too)",
    )
    group.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="accepted: conveyor logs no periodic statistics (they are at /metrics and on "
        "/dashboard)",
    )
    group.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="accepted: usage always carries prompt_tokens_details.cached_tokens",
    )
    group.add_argument(
        "--swap-space",
        type=float,
        default=None,
        metavar="GIB",
        help="accepted: a preempted request's KV is recomputed, never swapped (vLLM's V1 "
        "engine ignores it too)",
    )
    group.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="1 only: a model splits over ranks by --tensor-parallel-size",
    )
    _add_chat_args(group)
    _add_http_args(group)
    for flags, keywords, why in _ACCEPTED:
        group.add_argument(*flags, **keywords, help=f"accepted: {why}")


def _add_chat_args(group) -> None:
    group.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="the chat template's variables for the requests that do not set them, e.g. "
        "'{\"enable_thinking\": false}' (a request's chat_template_kwargs win)",
    )
    group.add_argument(
        "--chat-template-content-format",
        choices=CONTENT_FORMATS,
        default="auto",
        help="how a message's content reaches the chat template: string (its text parts "
        'one to a line), openai (a list of {"type": "text", "text": ...} parts), auto: openai '
        "for a template that loops over a message's content, else string",
    )
    group.add_argument(
        "--expand-tools-even-if-tool-choice-none",
        action="store_true",
        help='a request\'s tools reach the chat template even with tool_choice "none" (the '
        "model is told of them, and calls none); by default they are left out",
    )
    group.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='accepted: with tool_choice "none" the tools are left out of the prompt unless '
        "--expand-tools-even-if-tool-choice-none",
    )
    group.add_argument(
        "--enable-log-outputs",
        action="store_true",
        help="with --enable-log-requests: log every request's output as it finishes (its "
        "text and token ids, cut to --max-log-len, and finish reason)",
    )


def _add_http_args(group) -> None:
    group.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help='serve GET /load: {"server_load": N}, the generating and embedding requests in '
        "progress, for a load balancer",
    )
    group.add_argument(
        "--spec-method",
        default=None,
        metavar="METHOD",
        help="--speculative-config's method, in short (ngram, draft_model or mtp)",
    )
    group.add_argument(
        "--spec-model",
        default=None,
        metavar="MODEL",
        help="--speculative-config's model, in short (the draft model: method draft_model)",
    )
    group.add_argument(
        "--spec-tokens",
        type=_positive_int,
        default=None,
        metavar="K",
        help="--speculative-config's num_speculative_tokens, in short",
    )
    group.add_argument(
        "--max-num-active-seqs",
        type=_positive_int,
        default=None,
        metavar="N",
        help="the most requests running at once (at most --max-num-seqs, which it lowers: "
        "the step's buffers are sized by it as well); the rest wait",
    )
    group.add_argument(
        "--max-num-queued-reqs",
        type=_positive_int,
        default=None,
        metavar="N",
        help="the most generating and embedding requests in progress (running or waiting); "
        "one beyond is answered 503 with Retry-After at once, so that its client may retry "
        "elsewhere (default: no limit)",
    )
    group.add_argument(
        "--middleware",
        action="append",
        default=[],
        metavar="IMPORT.PATH",
        help="an ASGI middleware class or an async HTTP middleware function (request, "
        "call_next) to add to the app, by import path; repeatable",
    )
    group.add_argument(
        "--uds", default=None, metavar="PATH", help="listen on this Unix socket, not host:port"
    )
    group.add_argument(
        "--log-config-file",
        default=None,
        metavar="FILE",
        help="a logging configuration (JSON or YAML dictConfig, or INI) for the server's "
        "loggers, uvicorn's included",
    )
    group.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=None,
        metavar="BYTES",
        help="the largest request line and header block a connection may send (uvicorn's; "
        "default 16 KiB)",
    )
    group.add_argument(
        "--stream-interval",
        type=_positive_int,
        default=1,
        metavar="N",
        help="tokens a streamed chunk gathers (default 1: each step's own); the first and the "
        "last go out at once. Fewer, larger chunks cost the front end less; a request's "
        "stream_interval may ask for more",
    )
    group.add_argument(
        "--enable-per-request-metrics",
        action="store_true",
        help="a reply of one choice carries its own timings (vLLM's `metrics`: "
        "time_to_first_token_ms, generation_time_ms, queue_time_ms, mean_itl_ms, "
        "tokens_per_second); a stream's on its usage chunk",
    )
    group.add_argument(
        "--sse-keep-alive-interval",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="a stream that sends nothing for this long (a request waiting, a long prompt) "
        "gets an SSE comment line, so that a proxy's read timeout keeps it open (default 0: "
        "none)",
    )
    group.add_argument(
        "--ssl-ciphers",
        default=None,
        metavar="CIPHERS",
        help="the ciphers HTTPS offers, in OpenSSL's cipher-list format (uvicorn's default: TLSv1)",
    )
    group.add_argument(
        "--disable-access-log-for-endpoints",
        default=None,
        metavar="PATHS",
        help="comma-separated paths whose requests are not written to the access log, e.g. "
        '"/health,/metrics,/load"',
    )
    group.add_argument(
        "--hf-token",
        nargs="?",
        const=True,
        default=None,
        metavar="TOKEN",
        help="the Hugging Face token models named by their Hub id are downloaded with "
        "(without a value: the one `hf auth login` saved, as by default)",
    )
    group.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        metavar="N",
        help="1 only: one front-end process serves the API (it imports no torch and runs "
        "no model: the engine core does, in its own process)",
    )
    group.add_argument(
        "-O",
        "--compilation-config",
        "--optimization-level",
        default=None,
        metavar="LEVEL|JSON",
        help="vLLM's optimization level or compilation settings: 0, or '{\"cudagraph_mode\": "
        '"NONE"}\', or \'{"level": 0}\', runs every CUDA step eagerly (--enforce-eager); '
        "the rest is accepted: conveyor's CPU kernels are compiled ahead, and on CUDA a "
        "decode step replays a CUDA graph by default",
    )


# vLLM flags that ask for what conveyor does anyway, or that tune what it has no such part
# for: accepted, each with why (shown as its help).
_ACCEPTED: tuple[tuple[tuple[str, ...], dict, str], ...] = (
    (
        ("--mamba-ssm-cache-dtype", "--mamba-cache-dtype"),
        {"choices": ("auto", "float32"), "metavar": "{auto,float32}"},
        "a hybrid model's recurrent states (Qwen3.5's delta nets, LFM2's convolutions, Mamba2 "
        "layers) are kept in float32 (float64 for a float64 model); 16-bit states are not offered",
    ),
    (
        ("--mamba-block-size",),
        {"type": int, "metavar": "N"},
        "a hybrid model's states are kept for prefix caching at the KV cache's block boundaries "
        "(--block-size; core/state_snapshots.py), not on a grid of their own",
    ),
    (
        ("--async-scheduling",),
        {"action": "store_true"},
        "the engine core schedules the next step while the front end detokenizes and "
        "streams the last one, in its own process",
    ),
    (
        ("--limit-mm-per-prompt",),
        {"type": _json_object, "metavar": "JSON"},
        "the models conveyor serves read text only, so a prompt carries no images, audio or "
        "video (a content part of another type is a 400)",
    ),
    (
        ("--disable-frontend-multiprocessing",),
        {"action": "store_true"},
        "the front end is one process; --no-engine-process runs the engine core on its thread",
    ),
    (
        ("--enable-tokenizer-info-endpoint",),
        {"action": "store_true"},
        "GET /tokenizer_info is always served (behind --api-key)",
    ),
    (
        ("--cuda-graph-sizes",),
        {"nargs": "+", "type": int, "metavar": "N"},
        "on CUDA a decode step's graph is captured at the first step of each batch size",
    ),
    (
        ("--cudagraph-capture-sizes", "--max-cudagraph-capture-size"),
        {"nargs": "+", "type": int, "metavar": "N"},
        "on CUDA a decode step's graph is captured at the first step of each batch size",
    ),
    (
        ("--use-tqdm-on-load",),
        {"action": "store_true"},
        "the weights' progress bar shows when stderr is a terminal",
    ),
    (
        ("--max-seq-len-to-capture",),
        {"type": int, "metavar": "N"},
        "a CUDA graph replays decode steps of any context length",
    ),
    (
        ("--max-parallel-loading-workers",),
        {"type": int, "metavar": "N"},
        "weights load in one pass, memory-mapped",
    ),
    (
        ("--disable-custom-all-reduce",),
        {"action": "store_true"},
        "tensor parallelism reduces with torch.distributed (gloo on CPU, NCCL on CUDA)",
    ),
    (
        ("--disable-cascade-attn",),
        {"action": "store_true"},
        "conveyor has no cascade attention: each request reads its own KV blocks",
    ),
    (
        ("--kv-sharing-fast-prefill",),
        {"action": "store_true"},
        "no layer shares another's KV cache in the families conveyor serves",
    ),
    (
        ("--prefix-caching-hash-algo",),
        {"metavar": "NAME"},
        "a block's key is a sha256 of its prefix and its tokens, compared themselves on a hit: "
        "no collision can serve another prefix's KV",
    ),
    (
        ("--show-hidden-metrics-for-version",),
        {"metavar": "VERSION"},
        "/metrics shows vLLM's metric names, none hidden",
    ),
    (
        ("--model-impl",),
        {"choices": ["auto", "vllm", "transformers"]},
        "each family is conveyor's own code, tested to give transformers' tokens in float64",
    ),
    (
        ("--lora-dtype",),
        {"metavar": "DTYPE"},
        "adapters run in the model's compute dtype",
    ),
    (
        ("--fully-sharded-loras",),
        {"action": "store_true"},
        "LoRA runs without tensor parallelism (--enable-lora needs --tensor-parallel-size 1)",
    ),
    (
        ("--max-num-partial-prefills", "--max-long-partial-prefills"),
        {"type": int, "metavar": "N"},
        "prompts share each step's token budget in admission order, as in vLLM's V1 engine",
    ),
    (
        ("--logprobs-mode",),
        {"choices": ["raw_logprobs"]},
        "logprobs are the model's own distribution, before temperature, penalties or "
        "top-k/p (vLLM's default); the other modes are not served",
    ),
    (
        ("--attention-backend",),
        {"metavar": "NAME"},
        "conveyor has one attention per device, its own paged kernels",
    ),
    (
        ("--performance-mode",),
        {"metavar": "MODE"},
        "the kernels and the step's token budget are chosen for the CPU at start",
    ),
    (
        ("--distributed-timeout-seconds", "--cpu-distributed-timeout-seconds"),
        {"type": int, "metavar": "SECONDS"},
        "tensor-parallel ranks wait on torch.distributed's default timeout",
    ),
    (
        ("--language-model-only",),
        {"action": "store_true"},
        "the models conveyor serves are language models only: no vision or audio tower",
    ),
    (
        ("--ignore-patterns",),
        {"nargs": "+", "metavar": "GLOB"},
        "a model named by its Hub id fetches only its top-level config, tokenizer and weight "
        "files (original/ and every other folder never)",
    ),
    (
        ("--safetensors-load-strategy",),
        {"metavar": "NAME"},
        "safetensors weights are memory-mapped and read once, as they are packed",
    ),
    (
        ("--h11-max-header-count",),
        {"type": int, "metavar": "N"},
        "a request's whole header block is bounded by --h11-max-incomplete-event-size "
        "(16 KiB by default)",
    ),
    (
        ("--enable-log-deltas",),
        {"action": "store_true"},
        "--enable-log-outputs logs each output whole, once it finishes",
    ),
    (
        ("--log-error-stack",),
        {"action": "store_true"},
        "a request that fails in the server logs its traceback",
    ),
    (
        ("--config-format",),
        {"choices": ["auto", "hf"]},
        "a checkpoint's config.json (or a GGUF file's header) is read as transformers reads it",
    ),
)


# The flags whose value is a JSON object, which vLLM also takes a key at a time: the model
# card's `--speculative-config.method mtp --speculative-config.num_speculative_tokens 1`.
JSON_FLAGS = (
    "--speculative-config", "--hf-overrides", "--override-generation-config",
    "--structured-outputs-config", "--default-chat-template-kwargs", "--limit-mm-per-prompt",
    "--compilation-config",
)  # fmt: skip


def with_dotted_json(argv: list[str]) -> list[str]:
    """vLLM's dotted form of a JSON flag: `--FLAG.KEY VALUE` (or `--FLAG.KEY=VALUE`, the key
    nested by further dots, dashes in it as underscores) sets KEY in FLAG's object, VALUE read
    as JSON where it is (a number, true, an object) and as a string otherwise; the keys join
    the object a plain `--FLAG JSON` gives, if any. Each such flag comes back as one `--FLAG
    JSON`, where it first stood. ValueError for a key without a value, or dotted keys beside a
    plain value that is not a JSON object."""
    dotted: dict[str, dict] = {}
    plain: dict[str, str] = {}
    kept: list[str] = []
    places: list[tuple[int, str]] = []  # (index in kept, flag) where each flag first stood
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, equals, text = arg.partition("=")
        flag, dot, key = name.partition(".")
        if flag not in JSON_FLAGS or (dot and not key):
            kept.append(arg)
            i += 1
            continue
        if not equals:
            if i + 1 == len(argv):
                if not dot:  # argparse says what a flag without its value lacks
                    kept.append(arg)
                    break
                raise ValueError(f"{arg} needs a value")
            text, i = argv[i + 1], i + 1
        i += 1
        if flag not in plain and flag not in dotted:
            places.append((len(kept), flag))
        if not dot:
            plain[flag] = text
            continue
        *parents, leaf = key.replace("-", "_").split(".")
        node = dotted.setdefault(flag, {})
        for parent in parents:
            node = node.setdefault(parent, {})
            if not isinstance(node, dict):
                raise ValueError(f"{arg}: {parent} is given both a value and keys")
        node[leaf] = _json_or_text(text)
    if not dotted:
        return argv
    result, at = [], 0
    for index, flag in places:
        result += kept[at:index]
        at = index
        if flag not in dotted:
            result += [flag, plain[flag]]
            continue
        base = _json_or_text(plain[flag]) if flag in plain else {}
        if not isinstance(base, dict):
            raise ValueError(f"{flag} must be a JSON object beside its dotted keys")
        result += [flag, json.dumps(base | dotted[flag])]
    return result + kept[at:]


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def with_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`conveyor serve` arguments with --config FILE's settings added as flags, as vLLM's: a
    YAML mapping of flag names (dashes or underscores) to values; true/false turn a switch on
    or off, a list gives a flag's several values, a mapping its JSON. A flag the command line
    gives itself keeps the command line's value; `model` is the model where the command line
    names none. ValueError for a file that cannot be read or a name no flag has."""
    path, rest = _config_path(argv)
    if path is None:
        return argv
    import yaml

    try:
        settings = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"--config {path}: {error}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"--config {path}: not a YAML mapping of flag names to values")
    options = parser._option_string_actions  # argparse's table of every flag it takes
    given = {arg.split("=", 1)[0] for arg in rest if arg.startswith("-")}
    added: list[str] = []
    for key, value in settings.items():
        name = "--" + str(key).replace("_", "-")
        if name == "--model":
            known, _ = parser.parse_known_args(rest)
            if known.model is None and known.model_flag is None:
                added += ["--model", str(value)]
            continue
        action = options.get(name)
        if action is None or name == "--config":
            raise ValueError(f"--config {path}: {key!r} is not a flag of conveyor serve")
        flags = set(action.option_strings)
        if flags & given or {f"--no-{s[2:]}" for s in flags} & given or value is None:
            continue  # the command line's own value wins; an empty one keeps the default
        added += _as_flags(name, value, action)
    return rest + added


def _config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 == len(argv):
                raise ValueError("--config needs a file")
            return argv[i + 1], argv[:i] + argv[i + 2 :]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1 :]
    return None, argv


def _as_flags(name: str, value: Any, action: argparse.Action) -> list[str]:
    if isinstance(value, bool):
        if action.nargs == 0:  # a switch: on, or (with its --no- form) off
            if value:
                return [name]
            off = "--no-" + name[2:]
            return [off] if off in action.option_strings else []
        return [name, "true" if value else "false"]
    if isinstance(value, list):
        items = [json.dumps(v) if isinstance(v, dict) else str(v) for v in value]
        if isinstance(action, argparse._AppendAction):  # the flag once per item (--middleware)
            return [part for item in items for part in (name, item)]
        return [name, *items]
    if isinstance(value, dict):
        return [name, json.dumps(value)]
    return [name, str(value)]


def take_model_flag(args: argparse.Namespace) -> None:
    """--model as the model (vLLM's spelling); given with a different positional one, a
    ValueError."""
    flag = getattr(args, "model_flag", None)
    if flag is None:
        return
    if args.model is not None and args.model != flag:
        raise ValueError(f"the model is given twice: {args.model!r} and --model {flag!r}")
    args.model = flag


def take_spec_flags(args: argparse.Namespace) -> None:
    """vLLM's --spec-method, --spec-model and --spec-tokens as --speculative-config's method,
    model and num_speculative_tokens; with --speculative-config as well, a ValueError."""
    given = {
        key: value
        for key, value in (
            ("method", args.spec_method),
            ("model", args.spec_model),
            ("num_speculative_tokens", args.spec_tokens),
        )
        if value is not None
    }
    if not given:
        return
    if args.speculative_config is not None:
        raise ValueError(
            "--spec-method / --spec-model / --spec-tokens and --speculative-config say the "
            "same: give one of them"
        )
    from conveyor.config import SpeculativeConfig

    args.speculative_config = SpeculativeConfig.parse(given)


def take_active_seqs(args: argparse.Namespace) -> None:
    """vLLM's --max-num-active-seqs, the most requests running at once, as --max-num-seqs (by
    which conveyor sizes its step buffers too); above --max-num-seqs, a ValueError."""
    active = getattr(args, "max_num_active_seqs", None)
    if active is None:
        return
    if active > args.max_num_seqs:
        raise ValueError(
            f"--max-num-active-seqs {active} must be <= --max-num-seqs {args.max_num_seqs}"
        )
    args.max_num_seqs = active


# vLLM's model runner choices (--task before vLLM 0.10, --runner and --convert after): conveyor
# serves a model's every task at once (generation, /v1/embeddings, and with a classifier
# /classify, /score, /rerank), so these only check that the model can do what they name.
TASKS = ("auto", "generate", "embed", "embedding", "classify", "score")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")


def add_task_flags(parser: argparse.ArgumentParser) -> None:
    doc = (
        "vLLM's (a serve line written for it): every task is served at once (generation, "
        "/v1/embeddings; /classify, /score, /rerank by the model's classifier); classify or "
        "score checks that the model has one"
    )
    parser.add_argument("--task", choices=TASKS, default="auto", help=doc)
    parser.add_argument("--runner", choices=RUNNERS, default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--convert", choices=CONVERTS, default="auto", help=argparse.SUPPRESS)


def check_task(args: argparse.Namespace, has_classifier: Callable[[], bool]) -> str | None:
    """A task a model without a classifier cannot do, as a message (None: it can)."""
    if args.task not in ("classify", "score") and args.convert != "classify":
        return None
    if has_classifier():
        return None
    named = f"--task {args.task}" if args.task != "auto" else "--convert classify"
    return (
        f"{named}: the model has no classifier; serve a *ForSequenceClassification "
        "checkpoint, or name the tokens whose logits are the labels, as for Qwen3-Reranker: "
        '--hf-overrides \'{"architectures": ["Qwen3ForSequenceClassification"], '
        '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}\''
    )


def check_serve_line(args: argparse.Namespace) -> str | None:
    """What in these flags cannot be served, as a message (None: all can)."""
    if args.tokenizer_mode not in ("auto", "hf"):
        return (
            f"--tokenizer-mode {args.tokenizer_mode}: only auto and hf (transformers' "
            "AutoTokenizer, from the checkpoint's tokenizer files) are supported"
        )
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        return "--ssl-keyfile and --ssl-certfile go together: HTTPS needs both"
    if args.max_log_len is not None and args.max_log_len < 0:
        return f"--max-log-len must be >= 0, got {args.max_log_len}"
    if args.api_server_count != 1:
        return (
            f"--api-server-count {args.api_server_count}: one front-end process serves the "
            "API; --data-parallel-size adds engine cores behind it"
        )
    if args.enable_log_outputs and not args.enable_log_requests:
        return "--enable-log-outputs goes with --enable-log-requests"
    if args.log_config_file is not None and not Path(args.log_config_file).is_file():
        return f"--log-config-file {args.log_config_file}: no such file"
    if args.uds is not None and args.ssl_certfile is not None:
        return "--uds serves plain HTTP on a Unix socket: leave out --ssl-certfile"
    if not 0 <= args.sse_keep_alive_interval < float("inf"):
        return f"--sse-keep-alive-interval must be >= 0 seconds, got {args.sse_keep_alive_interval}"
    if args.pipeline_parallel_size != 1:
        return (
            f"--pipeline-parallel-size {args.pipeline_parallel_size}: pipeline parallelism is "
            "not supported; --tensor-parallel-size splits a model over ranks"
        )
    return None


def compilation_eager(value: str | None) -> bool:
    """Whether -O / --compilation-config asks for no CUDA graphs: level 0, or cudagraph_mode
    NONE; as a level, '{"level": 0, ...}' or vLLM's dotted '.cudagraph_mode=NONE'. ValueError
    for a value that is none of these forms."""
    if value is None:
        return False
    text = value.strip()
    if text.isdigit():
        return int(text) == 0
    if text.startswith("."):
        key, sep, setting = text[1:].partition("=")
        if not sep:
            raise ValueError(f"-O {value}: a dotted setting is .name=value")
        settings: dict[str, Any] = {key: setting}
    else:
        try:
            settings = json.loads(text)
        except ValueError:
            settings = None
        if not isinstance(settings, dict):
            raise ValueError(f"--compilation-config {value!r}: give a level (0-3) or a JSON object")
    level = settings.get("level", settings.get("mode"))
    graphs = str(settings.get("cudagraph_mode", "")).upper()
    return str(level) == "0" or graphs == "NONE"


def uvicorn_settings(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's keywords for these flags."""
    settings: dict[str, Any] = {"access_log": not args.disable_uvicorn_access_log}
    settings.update(ssl_settings(args))
    if args.uds is not None:
        settings["uds"] = args.uds
    if args.log_config_file is not None:
        settings["log_config"] = args.log_config_file
    if args.h11_max_incomplete_event_size is not None:
        settings["h11_max_incomplete_event_size"] = args.h11_max_incomplete_event_size
    return settings


def quiet_paths(args: argparse.Namespace) -> frozenset[str]:
    """The paths --disable-access-log-for-endpoints keeps out of the access log."""
    value = args.disable_access_log_for_endpoints or ""
    return frozenset(path.strip() for path in value.split(",") if path.strip())


class QuietPaths(logging.Filter):
    """Drops uvicorn's access-log records of these paths (their query strings aside)."""

    def __init__(self, paths: frozenset[str]) -> None:
        super().__init__()
        self.paths = paths

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 3 or not isinstance(args[2], str):
            return True
        return args[2].split("?", 1)[0] not in self.paths


def server_defaults(args: argparse.Namespace):
    """What these flags set on every request (serving.ServerDefaults)."""
    from conveyor.entrypoints.openai.serving import ServerDefaults

    return ServerDefaults(
        tokens_as_ids=args.return_tokens_as_token_ids,
        force_include_usage=args.enable_force_include_usage,
        chat_template_kwargs=args.default_chat_template_kwargs,
        content_format=args.chat_template_content_format,
        tools_when_none=args.expand_tools_even_if_tool_choice_none,
        stream_interval=args.stream_interval,
        keep_alive=args.sse_keep_alive_interval,
        per_request_metrics=args.enable_per_request_metrics,
    )


def request_logger(args: argparse.Namespace):
    """--enable-log-requests' RequestLogger, its lines on stderr (as uvicorn's: "INFO:     ..."),
    or None."""
    if not args.enable_log_requests:
        return None
    import logging

    from conveyor.entrypoints.openai.serving import RequestLogger

    log = logging.getLogger("conveyor.requests")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    return RequestLogger(args.max_log_len, args.enable_log_outputs)


def load_chat_template(value: str) -> str:
    """--chat-template's text: the file it names, else the value itself when it reads as a
    template (it holds "{", "}" or a newline; "\\n" and "\\t" stand for them), as vLLM's;
    ValueError for a path that cannot be read or a template Jinja cannot parse."""
    import jinja2

    try:
        text = Path(value).read_text()
    except (OSError, ValueError) as error:
        if not any(mark in value for mark in "{}\n"):
            raise ValueError(
                f"--chat-template {value!r} looks like a file, but it could not be read: {error}"
            ) from None
        text = value.replace("\\n", "\n").replace("\\t", "\t")
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"--chat-template is not a Jinja template: {error}") from None
    return text


def use_chat_template(engine: Any, template: str) -> None:
    """Every tokenizer the server renders chats with (a data-parallel engine's replicas' too)
    takes `template` as its chat template."""
    owners = [engine, *getattr(engine, "replicas", [])]
    tokenizers = {id(t): t for t in (getattr(o, "tokenizer", None) for o in owners) if t}
    if not tokenizers:
        raise ValueError("--chat-template needs a tokenizer (this engine has none)")
    for tokenizer in tokenizers.values():
        tokenizer.chat_template = template


def cors_settings(args: argparse.Namespace) -> dict[str, Any] | None:
    """Starlette's CORSMiddleware keywords, or None without --allowed-origins."""
    if args.allowed_origins is None:
        return None
    return {
        "allow_origins": args.allowed_origins,
        "allow_methods": args.allowed_methods,
        "allow_headers": args.allowed_headers,
        "allow_credentials": args.allow_credentials,
    }


def ssl_settings(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's SSL keywords ({}: plain HTTP)."""
    if args.ssl_certfile is None:
        return {}
    return {
        "ssl_keyfile": args.ssl_keyfile,
        "ssl_certfile": args.ssl_certfile,
        "ssl_ca_certs": args.ssl_ca_certs,
        "ssl_cert_reqs": args.ssl_cert_reqs,
    } | ({"ssl_ciphers": args.ssl_ciphers} if args.ssl_ciphers is not None else {})


# vLLM flags that ask for what conveyor cannot do: refused, each with why, where argparse
# would only call them unrecognized.
VLLM_REFUSED = {
    "--enable-sleep-mode": "there is no sleep mode (the weights stay loaded; the KV cache is "
    "--kv-cache-memory's)",
    "--cpu-offload-gb": "weights are not offloaded: a CUDA model lives on the GPU, a CPU model "
    "in memory",
    "--kv-transfer-config": "no disaggregated prefill: one engine prefills and decodes",
    "--kv-events-config": "the KV cache publishes no events (its state is on /dashboard)",
    "--otlp-traces-endpoint": "no OpenTelemetry tracing (per-request timings are in /metrics)",
    "--collect-detailed-traces": "no OpenTelemetry tracing",
    "--enable-expert-parallel": "experts are split like every projection, by "
    "--tensor-parallel-size",
    "--enable-eplb": "no expert parallelism to balance",
    "--headless": "each replica's engine core runs behind this server's front end",
    "--data-parallel-address": "replicas on other nodes are placed by Ray "
    "(--distributed-executor-backend ray --ray-address)",
    "--data-parallel-rpc-port": "replicas on other nodes are placed by Ray",
    "--data-parallel-size-local": "replicas on other nodes are placed by Ray",
    "--data-parallel-start-rank": "replicas on other nodes are placed by Ray",
    "--data-parallel-backend": "--distributed-executor-backend mp or ray places the replicas",
    "--calculate-kv-scales": "the fp8 KV cache (--kv-cache-dtype fp8) needs no scales: its "
    "values are clamped to +-448",
    "--enable-prompt-embeds": "prompts are text or token ids",
    "--tool-server": "no built-in tools (browsing, Python) for the Responses API",
    "--tool-parser-plugin": "parsers are conveyor's own, by vLLM's names (--tool-call-parser)",
    "--reasoning-parser-plugin": "parsers are conveyor's own, by vLLM's names (--reasoning-parser)",
    "--mm-processor-kwargs": "the models conveyor serves read text only",
    "--mm-encoder-tp-mode": "the models conveyor serves read text only",
    "--allowed-local-media-path": "the models conveyor serves read text only",
    "--hf-config-path": "the config is the checkpoint's own (change fields with --hf-overrides)",
    "--code-revision": "conveyor runs no code from a checkpoint",
    "--rope-scaling": "vLLM has dropped it: give --hf-overrides '{\"rope_scaling\": {...}}'",
    "--rope-theta": "vLLM has dropped it: give --hf-overrides '{\"rope_theta\": ...}'",
    "--speculative-model": "vLLM has dropped it: give --speculative-config "
    '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\'',
    "--num-speculative-tokens": "vLLM has dropped it: give --speculative-config",
    "--num-scheduler-steps": "vLLM has dropped it: every step is scheduled",
    "--tokenizer-pool-size": "vLLM has dropped it: prompts are tokenized on two threads",
    "--preemption-mode": "a preempted request is recomputed (vLLM's V1 engine too)",
    "--multi-step-stream-outputs": "vLLM has dropped it",
    "--enable-lora-bias": "LoRA adapters with bias terms are not served",
    "--logits-processors": "no custom logits processor classes are loaded (logit_bias, "
    "allowed_token_ids, bad_words and structured outputs are per request)",
    "--worker-cls": "the worker is conveyor's own",
    "--worker-extension-cls": "the worker is conveyor's own",
    "--scheduler-cls": "the scheduler is conveyor's own (--scheduling-policy fcfs, priority "
    "or static)",
    "--grpc": "the API is HTTP (OpenAI's and Anthropic's)",
    "--grpc-port": "the API is HTTP (OpenAI's and Anthropic's)",
    "--watermark": "sampled tokens are not watermarked",
    "--watermark-config": "sampled tokens are not watermarked",
    "--kv-offloading-backend": "the KV cache is not offloaded (--kv-cache-memory sizes it)",
    "--kv-offloading-size": "the KV cache is not offloaded (--kv-cache-memory sizes it)",
    "--cpu-offload-params": "weights are not offloaded",
    "--offload-backend": "weights are not offloaded",
    "--offload-params": "weights are not offloaded",
    "--offload-group-size": "weights are not offloaded",
    "--offload-num-in-group": "weights are not offloaded",
    "--offload-prefetch-step": "weights are not offloaded",
    "--nnodes": "engines on other nodes are placed by Ray (--distributed-executor-backend ray, "
    "--ray-address)",
    "--node-rank": "engines on other nodes are placed by Ray",
    "--master-addr": "engines on other nodes are placed by Ray",
    "--master-port": "engines on other nodes are placed by Ray",
    "--data-parallel-rank": "the replicas run behind this server's front end "
    "(--data-parallel-size)",
    "--data-parallel-external-lb": "the replicas run behind this server's front end, which "
    "balances them (--data-parallel-routing)",
    "--data-parallel-hybrid-lb": "the replicas run behind this server's front end",
    "--data-parallel-multi-port-external-lb": "the replicas run behind this server's front end",
    "--decode-context-parallel-size": "no context parallelism: a request's KV cache lives on "
    "one rank group (--tensor-parallel-size)",
    "--prefill-context-parallel-size": "no context parallelism: a request's KV cache lives on "
    "one rank group (--tensor-parallel-size)",
    "--ec-transfer-config": "no disaggregated encoder: the models read text only",
    "--enable-return-routed-experts": "a mixture of experts' routing is not returned",
    "--enable-elastic-ep": "no expert parallelism",
    "--io-processor-plugin": "no plugins",
    "--skip-tokenizer-init": "the server needs the tokenizer (chat templates, stop strings, "
    "text); offline, LLM(..., skip_tokenizer_init=True) takes and gives token ids",
    "--pooler-config": "embeddings pool as --embedding-pooling says (last, mean or cls; by "
    "default the checkpoint's sentence-transformers pooling)",
    "--lora-target-modules": "an adapter applies to the modules its adapter_config.json names",
}


def add_negations(parser: argparse.ArgumentParser) -> None:
    """vLLM's boolean flags each have a --no- form (argparse's BooleanOptionalAction): a serve
    line or --config written for vLLM may say --no-enable-log-requests or --no-disable-fastapi-docs.
    Each on/off flag of the parser gets its --no- form, which sets it off."""
    taken = {option for action in parser._actions for option in action.option_strings}
    for action in list(parser._actions):
        if not isinstance(action, argparse._StoreTrueAction):
            continue
        for option in action.option_strings:
            negated = "--no-" + option[2:]
            if option.startswith("--") and not option.startswith("--no-") and negated not in taken:
                parser.add_argument(
                    negated, dest=action.dest, action="store_false", help=argparse.SUPPRESS
                )
                taken.add(negated)


def refused_flags(unknown: list[str]) -> str | None:
    """The message for the first of these unrecognized arguments that is a vLLM flag conveyor
    refuses, or None."""
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--no-"):
            flag = "--" + flag[5:]
        if flag in VLLM_REFUSED:
            return f"vLLM's {flag} is not supported by conveyor: {VLLM_REFUSED[flag]}"
    return None
