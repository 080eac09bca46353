"""`conveyor generate | serve | bench` — the command line."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

from conveyor import envs
from conveyor.bench.cli import add_bench_parser
from conveyor.entrypoints.args import add_engine_args, engine_args
from conveyor.entrypoints.openai.responses.store import add_store_args, store_limits
from conveyor.entrypoints.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, ParserNames
from conveyor.entrypoints.serve_line import (
    QuietPaths,
    add_negations,
    add_serve_line_args,
    add_task_flags,
    check_serve_line,
    check_task,
    compilation_eager,
    cors_settings,
    load_chat_template,
    quiet_paths,
    refused_flags,
    request_logger,
    server_defaults,
    ssl_settings,
    take_active_seqs,
    take_model_flag,
    take_spec_flags,
    use_chat_template,
    uvicorn_settings,
    with_config_file,
    with_dotted_json,
)

if TYPE_CHECKING:
    from conveyor.engine_args import EngineArgs

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about continuous batching.",
    "Give me three tips for writing readable Python.",
    "Explain what a KV cache is in one paragraph.",
]


def cmd_generate(args: argparse.Namespace) -> int:
    from conveyor.entrypoints.llm import LLM
    from conveyor.sampling_params import SamplingParams

    llm = LLM(engine_args(args))
    questions = args.prompt or DEMO_QUESTIONS
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    start = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
    elapsed = time.perf_counter() - start
    for question, out in zip(questions, outputs, strict=True):
        print(f"\n>>> {question}\n{out.outputs[0].text.strip()}")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"\n{len(outputs)} requests, {num_tokens} tokens in {elapsed:.2f} s "
        f"({num_tokens / elapsed:.1f} output tokens/s, batched)"
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from conveyor.lora.request import local_lora_modules

    if isinstance(args.hf_token, str):  # read by huggingface_hub here and in the core
        os.environ["HF_TOKEN"] = args.hf_token
    if compilation_eager(args.compilation_config):
        args.enforce_eager = True
    args.lora_modules = local_lora_modules(args.lora_modules, args.download_dir)
    settings = engine_args(args)
    ray = args.distributed_executor_backend == "ray"
    if args.engine_process and args.data_parallel_size == 1 and not ray:
        # The core first: it imports torch while this process reads the model's config for
        # it (transformers), then loads the model while this process imports the server.
        import zmq

        from conveyor.engine.core_proc import CoreProcess

        context = zmq.Context()
        started = CoreProcess(settings, context)
        try:
            return _serve(args, settings, started=(started, context))
        finally:
            started.kill()  # a no-op after a clean shutdown; else no core is left behind
    return _serve(args, settings)


def _serve(args: argparse.Namespace, settings: EngineArgs, started=None) -> int:
    from conveyor import heap

    heap.pause()  # until the server is about to listen (conveyor/heap.py)
    try:
        app = _server_app(args, settings, started)
    finally:
        heap.freeze()
    if isinstance(app, int):
        return app  # refused flags: the exit status
    from conveyor.entrypoints.openai.api_server import run_server

    quiet = quiet_paths(args)
    return run_server(
        app,
        args.host,
        args.port,
        args.log_level,
        args.graceful_timeout,
        QuietPaths(quiet) if quiet else None,
        **uvicorn_settings(args),
    )


def _kernel_plan(engine) -> dict[str, str]:
    """The engine's kernel plan, where it is known before the first request (an engine built
    on its own thread may not be built yet)."""
    try:
        return dict(engine.kernel_plan or {})
    except Exception:  # noqa: BLE001 - a line of start-up output, never a reason to fail
        return {}


def _memory_line(engine) -> str:
    """What the model holds (the core's memory report, model/memory.py), where the engine
    tells it before the first request (its own process); "" otherwise."""
    info = getattr(engine, "info", None)
    memory = getattr(info, "memory", None) or {}
    if "weights" not in memory:
        return ""
    mib = {k: v / 2**20 for k, v in memory.items()}
    experts = f" (experts {mib['experts']:.1f} MiB of them)" if mib.get("experts") else ""
    return (
        f"conveyor: memory: weights {mib['weights']:.1f} MiB + kernel copies "
        f"{mib['kernel_copies']:.1f} MiB{experts}, KV cache {mib.get('kv_cache', 0):.1f} MiB"
        + _concurrency(info)
    )


def _concurrency(info) -> str:
    """The KV cache's blocks, its KV groups, and how many requests of max_model_len tokens it
    holds at once (vLLM's "maximum concurrency")."""
    from conveyor.model.kv_groups import max_concurrency

    cache, windows = info.cache_config, info.kv_windows
    max_len = info.model_config.max_model_len
    step = info.scheduler_config.max_num_batched_tokens
    concurrency = max_concurrency(windows, info.num_blocks, max_len, cache.block_size, step)
    groups = f" in {len(windows)} KV groups" if len(windows) > 1 else ""
    return (
        f" ({info.num_blocks} blocks of {cache.block_size} tokens{groups}; maximum concurrency "
        f"{concurrency:.2f}x at {max_len} tokens)"
    )


def _has_classifier(settings: EngineArgs) -> bool:
    """Whether the model has a classifier (ModelConfig.classifier); True where its config
    does not resolve: the engine's start then says why."""
    from conveyor.engine.config import resolve_model_config

    try:
        return resolve_model_config(settings).classifier is not None
    except ValueError:
        return True


def _server_app(args: argparse.Namespace, settings: EngineArgs, started):
    """The app over a ready engine, or an exit status for flags that do not go together."""

    from conveyor.engine.core_client import AsyncMPEngine, CoreProcess
    from conveyor.entrypoints.openai.api_server import build_app
    from conveyor.limits import RequestLimits

    if problem := check_serve_line(args) or check_task(args, lambda: _has_classifier(settings)):
        print(f"conveyor serve: {problem}", file=sys.stderr)
        return 2
    template = None if args.chat_template is None else load_chat_template(args.chat_template)
    limits = RequestLimits(**{name: getattr(args, name) for name in _LIMIT_FLAGS})
    api_key = args.api_key or envs.api_key() or None
    ray = args.distributed_executor_backend == "ray"
    if args.data_parallel_size != 1 or ray:
        if not args.engine_process:
            print(
                "conveyor serve: --data-parallel-size and --distributed-executor-backend ray "
                "need --engine-process",
                file=sys.stderr,
            )
            return 2
        from conveyor.engine.data_parallel import AsyncDPEngine

        spawn, restart = CoreProcess, args.restart_engine
        if ray:  # Ray places each replica's core; a dead one is placed again and rejoins
            from conveyor.engine.ray_placement import RayCoreProcess, init_ray

            init_ray(args.ray_address)
            spawn, restart = RayCoreProcess, True
        engine = AsyncDPEngine(
            settings,
            args.data_parallel_size,
            routing=args.data_parallel_routing,
            iteration_timeout=args.engine_iteration_timeout,
            restart=restart,
            spawn=spawn,
        )
    elif args.engine_process:
        engine = AsyncMPEngine(
            settings,
            iteration_timeout=args.engine_iteration_timeout,
            restart=args.restart_engine,
            started=started,
        )
    else:  # built on the engine thread, where it runs
        from conveyor.engine.async_engine import AsyncEngine
        from conveyor.engine.llm_engine import LLMEngine

        engine = AsyncEngine(lambda: LLMEngine(settings))
    if template is not None:
        use_chat_template(engine, template)
    app = build_app(
        engine,
        args.served_model_name,
        api_key,
        limits,
        metrics_auth=not args.metrics_no_auth,
        dashboard=args.dashboard,
        trust_request_chat_template=args.trust_request_chat_template,
        ignore_unknown_fields=args.ignore_unknown_fields,
        embedding_pooling=args.embedding_pooling,
        response_store=store_limits(args),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        lora_allowed_dir=args.lora_allowed_dir,
        parsers=ParserNames(
            args.reasoning_parser, args.tool_call_parser, args.enable_auto_tool_choice
        ),
        response_role=args.response_role,
        cors=cors_settings(args),
        docs=not args.disable_fastapi_docs,
        root_path=args.root_path,
        defaults=server_defaults(args),
        request_logger=request_logger(args),
        request_id_headers=args.enable_request_id_headers,
        load_tracking=args.enable_server_load_tracking,
        middleware=args.middleware,
        max_queued=args.max_num_queued_reqs,
        model_arg=settings.model,
    )
    name = app.state.metrics.model_name
    base = f"{'https' if ssl_settings(args) else 'http'}://{args.host}:{args.port}"
    if args.uds is not None:
        base = f"http+unix://{args.uds}"
    print(f"conveyor: serving {name!r} on {base}/v1", flush=True)
    plan = _kernel_plan(engine)
    if plan:  # model/plan.py: which kernel and instruction set each op takes, chosen at load
        print("conveyor: kernel plan: " + ", ".join(f"{k}={v}" for k, v in plan.items()))
    if line := _memory_line(engine):
        print(line, flush=True)
    if defaults := engine.default_sampling:  # as vLLM warns: they change unset fields' values
        shown = ", ".join(f"{k}={v}" for k, v in defaults.items())
        print(
            f"conveyor: default sampling from the model's generation config: {shown} "
            "(for the fields a request leaves out; --generation-config vllm: none)",
            flush=True,
        )
    if args.dashboard:
        print(f"conveyor: dashboard on {base}/dashboard", flush=True)
    return app


# RequestLimits field -> what its flag means; defaults come from RequestLimits.
_LIMIT_FLAGS = {
    "max_n": "most completions (n) one request may ask for",
    "max_logprobs": "most logprobs / top_logprobs per token",
    "max_prompts": "most prompts in one /v1/completions request",
    "max_stop": "most stop strings per request",
    "max_stop_length": "most characters in one stop string",
    "max_stop_token_ids": "most stop_token_ids per request",
    "max_logit_bias": "most logit_bias entries per request",
    "max_body_bytes": "largest request body in bytes (413 beyond it)",
    "min_priority": "lowest request priority (--scheduling-policy priority: lower runs first); "
    "a lower one is clamped to it",
    "max_priority": "highest request priority; a higher one is clamped to it",
    "max_json_depth": "deepest nesting of a JSON schema, tool parameters or tool-call arguments",
}


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    from conveyor.limits import RequestLimits

    group = parser.add_argument_group("request limits (a request beyond one gets a 400)")
    defaults = RequestLimits()
    for name, meaning in _LIMIT_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        group.add_argument(flag, type=int, default=default, help=f"{meaning} (default {default})")


def add_process_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine process")
    group.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core (scheduler, KV cache, model) in its own process, apart from "
        "the HTTP front end; --no-engine-process runs it on a thread of the server",
    )
    group.add_argument(
        "--restart-engine",
        action="store_true",
        help="when the engine core dies, start a new one (open requests fail) instead of "
        "exiting with status 1",
    )
    group.add_argument(
        "--engine-iteration-timeout",
        type=float,
        default=None,
        help="seconds without a finished step, while requests are open, after which the "
        "engine core counts as hung and is killed (default 60 on CUDA, 300 on CPU)",
    )
    group = parser.add_argument_group("replicas (scale-out)")
    group.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine-core replicas behind this server, each in its own process (each gets "
        "an equal share of the CPU threads unless --num-threads is given)",
    )
    group.add_argument(
        "--data-parallel-routing",
        default="cache",
        choices=["cache", "round_robin"],
        help="cache: to the replica holding the longest prefix of the prompt, else the least "
        "loaded; round_robin: in turn",
    )
    group.add_argument(
        "--distributed-executor-backend",
        default="mp",
        choices=["mp", "ray"],
        help="mp: engine cores are local processes; ray: Ray actors, placed on the cluster "
        "of --ray-address (restarted when they die; pip install 'conveyor[ray]')",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster to join (e.g. auto, or HEAD_IP:6379); default: start a local one",
    )


def add_parser_args(group) -> None:
    """vLLM's parser flags, with its names (entrypoints/parsers): a name that is none is a usage
    error (exit 2) that lists the valid ones."""
    group.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        metavar="NAME",
        help="how the model writes its reasoning, returned as message.reasoning: "
        f"{', '.join(REASONING_PARSERS)} (default: chosen from the chat template when it is "
        "unambiguous, else none)",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        metavar="NAME",
        help="how the model writes tool calls: "
        f"{', '.join(TOOL_CALL_PARSERS)} (default: chosen from the chat template when it is "
        "unambiguous, else hermes: <tool_call> blocks or a reply that is JSON)",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='vLLM\'s flag, accepted: tool_choice "auto" is always served here, read with '
        "--tool-call-parser",
    )


def build_parser() -> argparse.ArgumentParser:
    """Imports no torch (nor do the bench commands' parsers): `serve` starts its engine core
    right after parsing, before the server's imports (see cmd_serve)."""
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer a few chat prompts offline (a demo)")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a user message (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.set_defaults(func=cmd_generate)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(serve)
    server = serve.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model's name in the API (default: the checkpoint's file or folder name); "
        "several, as vLLM's: requests may name any, responses and metrics name the first",
    )
    server.add_argument(
        "--api-key",
        default=None,
        help="required on every route but /health (also read from CONVEYOR_API_KEY)",
    )
    server.add_argument(
        "--metrics-no-auth",
        action="store_true",
        help="serve /metrics without the API key (for a Prometheus scraper)",
    )
    server.add_argument(
        "--dashboard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve the live view of the scheduler at /dashboard (behind --api-key like the "
        "API); --no-dashboard turns it off",
    )
    server.add_argument(
        "--embedding-pooling",
        choices=["last", "mean", "cls"],
        default=None,
        help="/v1/embeddings: the last token's final hidden state, the mean over the input's "
        "tokens, or the first token's (an encoder's [CLS]), normalized either way; default: "
        "the checkpoint's sentence-transformers pooling, else an encoder's first token and a "
        "decoder's last",
    )
    server.add_argument(
        "--ignore-unknown-fields",
        action="store_true",
        help="accept chat, completions and embeddings requests with top-level fields this "
        "server does not know, logging and ignoring them (vLLM's behaviour); by default such "
        "a request is refused with a 400 that names them",
    )
    server.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat request's own chat_template (sandboxed Jinja, but a template may "
        "loop for long: only for trusted clients); by default only the model's is rendered",
    )
    server.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora; "
        "also turned on by VLLM_ALLOW_RUNTIME_LORA_UPDATING=1). An unload answers once the "
        "requests running with the adapter have finished; new ones naming it get a 404",
    )
    server.add_argument(
        "--lora-allowed-dir",
        default=None,
        metavar="DIR",
        help="/v1/load_lora_adapter loads only adapter folders inside DIR (symlinks resolved)",
    )
    add_parser_args(server)
    server.add_argument(
        "--log-level",
        "--uvicorn-log-level",
        default="info",
        help="uvicorn's: critical|error|warning|info|debug",
    )
    server.add_argument(
        "--graceful-timeout",
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds open responses get to finish after SIGTERM (vLLM's --shutdown-timeout); "
        "those still open then end with finish_reason abort",
    )
    add_serve_line_args(serve.add_argument_group("vLLM's serve line"))
    add_task_flags(serve.add_argument_group("vLLM's serve line"))
    add_process_args(serve)
    add_limit_args(serve)
    add_store_args(serve)
    add_negations(serve)  # last: every on/off flag above gets its --no- form, as vLLM's
    serve.set_defaults(func=cmd_serve)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    argv = [_dashed(arg) for arg in argv]
    parser = build_parser()
    try:
        if argv[:1] == ["serve"]:  # vLLM's --config FILE, read into flags; --FLAG.KEY VALUE
            argv = ["serve", *with_config_file(argv[1:], _subparser(parser, "serve"))]
            argv = ["serve", *with_dotted_json(argv[1:])]
    except ValueError as error:
        parser.error(str(error))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # a vLLM flag conveyor refuses says why; any other is argparse's usage error
        parser.error(refused_flags(unknown) or f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if args.func is cmd_serve:
            take_model_flag(args)
            take_active_seqs(args)
            take_spec_flags(args)
        return args.func(args)
    except ValueError as error:
        print(f"conveyor: error: {error}", file=sys.stderr)
        return 2


def _dashed(arg: str) -> str:
    """A flag's name with dashes for underscores, as vLLM's parser takes them: model cards
    write `--hf_overrides '{...}'` and `--max_model_len 4096`. Values are left as given."""
    if not arg.startswith("--"):
        return arg
    name, equals, value = arg.partition("=")
    return name.replace("_", "-") + equals + value


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._subparsers._group_actions:  # argparse keeps no public handle
        if name in getattr(action, "choices", {}):
            return action.choices[name]
    raise KeyError(name)


if __name__ == "__main__":
    sys.exit(main())
