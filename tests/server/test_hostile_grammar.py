"""Hostile grammars, giant prompts and a tokenizer the grammar backend cannot read: each is
refused on its own (a 4xx with an OpenAI error body, or a ValueError in the library) while the
server goes on serving everyone else, and nothing crashes or is left behind."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import server_util
import torch
from conftest import DEVICE_FLAGS, DEVICE_KWARGS
from server_util import HTTP, ServerProcess
from tiny import CHATML, CORPUS, SPECIAL_TOKENS, tiny_config
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from conveyor import LLM, SamplingParams
from conveyor.structured.backend import GrammarCompiler, GrammarError
from conveyor.structured.params import StructuredOutputs

MODEL = "tiny"
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Paris is the capital of"}]
# --grammar-compile-timeout of the server below (at 4 s a small schema passed it once under a
# full run's load, the compile worker restarting after a stopped compile)
TIMEOUT = 8


def lark_chain(n: int) -> str:
    """r0 -> r1 -> ... -> "x": llguidance recurses once per rule (SIGSEGV in a thread's 8 MiB
    stack at ~3,000 rules)."""
    return "start: r0\n" + "\n".join([f"r{i}: r{i + 1}" for i in range(n)] + [f'r{n}: "x"'])


def ref_chain(n: int) -> dict:
    """$defs d0 .. dn, each an object whose one property $refs the next."""
    defs = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def many_optional(tag: str, n: int = 10_000) -> dict:
    """An object of n optional properties: minutes of compile."""
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(n)}}


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("hostile-grammar") / "server.log"
    args = [str(tiny_checkpoint("llama")), "--dtype", "float32", "--served-model-name", MODEL]
    args += ["--grammar-compile-timeout", str(TIMEOUT), *DEVICE_FLAGS]
    proc = ServerProcess(args, log)
    yield proc
    assert proc.stop() == 0, log.read_text()[-2000:]


def post(server, path: str, body: dict, timeout: float = 120):
    return server_util.post(server.base_url, path, body, timeout=timeout)


def assert_refused(response, status: int = 400, param: str | None = None) -> str:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    return error["message"]


def assert_serving(server) -> None:
    assert HTTP.get(f"{server.base_url}/health", timeout=10).status_code == 200
    answer = post(server, CHAT, {"model": MODEL, "messages": HI, "max_tokens": 4}, timeout=60)
    assert answer.status_code == 200, answer.text[:500]
    assert answer.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    ("field", "make"),
    [
        (
            "response_format",
            lambda: {
                "type": "json_schema",
                "json_schema": {"name": "chain", "schema": ref_chain(3000)},
            },
        ),
        ("structured_outputs", lambda: {"grammar": lark_chain(6_000)}),
        ("structured_outputs", lambda: {"json": ref_chain(3000)}),
    ],
    ids=["ref-chain-response-format", "lark-chain", "ref-chain-structured-outputs"],
)
def test_a_grammar_that_crashes_the_compiler_is_a_400_and_the_server_lives(server, field, make):
    body = {"model": MODEL, "messages": HI, "max_tokens": 4, field: make()}
    message = assert_refused(post(server, CHAT, body))
    assert "crashed the grammar compiler" in message
    assert server.proc.poll() is None
    assert_serving(server)
    again = post(server, CHAT, body)  # a crash is never cached as a verdict either way
    assert "crashed the grammar compiler" in assert_refused(again)


# Every instance nests forever: llguidance takes the schema, allows the first token, then
# its parser runs past its item limit. {"$ref": "#"} alone allows no text at all.
ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


def schema_body(schema: dict, stream: bool = False) -> dict:
    body = {"model": MODEL, "messages": HI, "max_tokens": 8, "temperature": 0, "stream": stream}
    json_schema = {"name": "s", "schema": schema}
    body["response_format"] = {"type": "json_schema", "json_schema": json_schema}
    return body


def assert_readable(message: str) -> None:
    """llguidance's errors carry a dump of its parser state and of the grammar: not for the
    client, who sent the grammar."""
    assert "<state>" not in message and "<grammar>" not in message and "RuntimeError" not in message
    assert len(message) < 600, message


def test_a_constraint_that_fails_while_generating_is_a_400_and_the_server_lives(server):
    message = assert_refused(post(server, CHAT, schema_body(ENDLESS)))
    assert "constraint could not be followed at output token 1:" in message, message
    assert_readable(message)
    assert_serving(server)


def test_a_constraint_that_fails_mid_stream_ends_it_with_a_client_error_event(server):
    response = post(server, CHAT, schema_body(ENDLESS, stream=True))
    assert response.status_code == 200, response.text[:500]
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "BadRequestError" and "could not be followed" in error["message"]
    assert_readable(error["message"])
    assert_serving(server)


def test_a_constraint_no_text_satisfies_is_refused_in_words(server):
    message = assert_refused(post(server, CHAT, schema_body({"$ref": "#"})))
    assert_readable(message)
    assert "no text" in message, message


def test_a_choice_of_thousands_is_followed(server):
    """llguidance's choice grammar (one alternative each) runs past its parser's 2,000 items
    a row at the first token; one regex lexeme of all of them does not."""
    choices = [f"{i} [{i % 7}] a.b|c" for i in range(5000)]
    body = {"model": MODEL, "messages": HI, "max_tokens": 32, "temperature": 0}
    response = post(server, CHAT, body | {"structured_outputs": {"choice": choices}})
    assert response.status_code == 200, response.text[:500]
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] in choices


def test_slow_grammars_are_stopped_at_the_limit_while_plain_requests_flow(server):
    """Three schemas that would compile for minutes, at once: each is stopped at the limit
    (a 400), never cached, and a plain chat and /tokenize are answered meanwhile."""
    results: dict[str, tuple[float, object]] = {}

    def bomb(tag: str) -> None:
        schema = {"name": tag, "schema": many_optional(tag)}
        body = {"model": MODEL, "messages": HI, "max_tokens": 4}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
        response = post(server, CHAT, body)
        results[tag] = (time.monotonic(), response)

    def bombs() -> list[threading.Thread]:
        threads = [threading.Thread(target=bomb, args=(tag,)) for tag in ("a", "b", "c")]
        for thread in threads:
            thread.start()
        return threads

    threads = bombs()
    time.sleep(0.5)  # the bombs are compiling
    assert_serving(server)
    tokens = post(server, "/tokenize", {"model": MODEL, "prompt": "Paris is"})
    plain_done = time.monotonic()
    assert tokens.status_code == 200 and tokens.json()["count"] > 0
    for thread in threads:
        thread.join(120)
    assert all(done > plain_done for done, _ in results.values())
    for _, response in results.values():
        assert f"did not compile within {TIMEOUT} s" in assert_refused(response)
    # Not cached, as pending or as anything: the same schemas are compiled (and stopped) again;
    # the three at once, as above (one alone compiles in ~8 s on a quiet Zen 4: at the limit).
    start = time.monotonic()
    for thread in bombs():
        thread.join(120)
    for _, response in results.values():
        assert f"did not compile within {TIMEOUT} s" in assert_refused(response)
    assert time.monotonic() - start >= TIMEOUT - 0.5
    small = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = {"model": MODEL, "messages": HI, "max_tokens": 12, "temperature": 0}
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "n", "schema": small}}
    answer = post(server, CHAT, body)
    assert answer.status_code == 200, answer.text[:300]


def test_a_giant_prompt_is_refused_before_it_is_tokenized(server):
    """16 MB of text can never fit a context of 512 tokens: refused from its length alone,
    on every route that takes text, without the front end's memory growing by the gigabytes
    tokenizing it would take."""
    pid = server.proc.pid
    before = _peak_rss(pid)
    text = "Paris is the capital of France. " * 500_000
    chat = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    for path, body in [
        ("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 4}),
        (CHAT, chat),
        ("/tokenize", {"model": MODEL, "prompt": text}),
        ("/tokenize", {"model": MODEL, "messages": chat["messages"]}),
    ]:
        message = assert_refused(post(server, path, body))
        assert "cannot fit in the model's context length" in message, (path, message)
    grown = _peak_rss(pid) - before
    assert grown < 1 << 30, f"the front end's peak memory grew by {grown >> 20} MiB"
    many = {"model": MODEL, "tokens": [5] * 100_000}
    assert "context length" in assert_refused(post(server, "/detokenize", many), param="tokens")
    assert_serving(server)


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def _sandbox_workers(pid: int) -> dict[int, str]:
    """The server's sandbox workers: pid -> state (R, S, Z, ...)."""
    workers = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid and b"sandbox.py" in cmdline:
            workers[int(entry.name)] = fields[0]
    return workers


def test_sandbox_workers_live_with_the_server_and_die_with_it(tiny_checkpoint, tmp_path):
    args = [str(tiny_checkpoint("llama")), "--dtype", "float32", "--served-model-name", MODEL]
    server = ServerProcess([*args, *DEVICE_FLAGS], tmp_path / "server.log")
    try:
        # One worker starts with the server, ahead of the first constraint, and stays up.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not _sandbox_workers(server.proc.pid):
            time.sleep(0.2)
        time.sleep(2)
        workers = _sandbox_workers(server.proc.pid)
        assert len(workers) == 1 and "Z" not in workers.values(), workers
        body = {"model": MODEL, "messages": HI, "max_tokens": 4}
        body["structured_outputs"] = {"regex": "[a-z]+"}
        assert post(server, CHAT, body).status_code == 200
        assert _sandbox_workers(server.proc.pid) == workers  # and it served the check
    finally:
        server.stop(signal.SIGKILL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in workers):
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{p}") for p in workers), "a worker outlived its server"


# ---- a tokenizer llguidance cannot read ------------------------------------------------------


@pytest.fixture(scope="module")
def word_level_checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama whose tokenizer is word-level, without a decoder: llguidance refuses it
    ("can't determine decoder type"), transformers and conveyor do not."""
    path = tmp_path_factory.mktemp("word-level")
    words = sorted({word for line in CORPUS for word in line.split()})
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, "[UNK]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="[UNK]"
    )
    fast.chat_template = CHATML
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", len(fast)), dtype=torch.float64)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


def test_a_tokenizer_the_grammar_backend_refuses_only_turns_structured_output_off(
    word_level_checkpoint, tmp_path
):
    log = tmp_path / "server.log"
    args = [str(word_level_checkpoint), "--dtype", "float32", "--served-model-name", MODEL]
    server = ServerProcess([*args, *DEVICE_FLAGS], log)
    try:
        assert_serving(server)
        body = {"model": MODEL, "messages": HI, "max_tokens": 4}
        body["structured_outputs"] = {"choice": ["yes", "no"]}
        message = assert_refused(post(server, CHAT, body))
        assert "structured output is unavailable for this model" in message
        assert "decoder" in message
        assert_serving(server)
    finally:
        assert server.stop() == 0
    warnings = [line for line in log.read_text().splitlines() if "structured output is off" in line]
    assert len(warnings) == 1, warnings


# ---- the library ----------------------------------------------------------------------------


def test_the_library_refuses_a_crashing_grammar_with_a_value_error(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float64", **DEVICE_KWARGS)
    bomb = SamplingParams(max_tokens=4, structured_outputs={"grammar": lark_chain(20_000)})
    with pytest.raises(ValueError, match="crashed the grammar compiler"):
        llm.generate(["hi"], bomb, use_tqdm=False)
    ok = SamplingParams(max_tokens=4, structured_outputs={"choice": ["a", "b"]})
    assert llm.generate(["hi"], ok, use_tqdm=False)[0].outputs[0].text in ("a", "b")


def test_the_library_ends_a_request_whose_constraint_fails_and_serves_the_rest(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float64", **DEVICE_KWARGS)
    endless = SamplingParams(max_tokens=8, structured_outputs={"json": ENDLESS})
    ok = SamplingParams(max_tokens=4, structured_outputs={"choice": ["a", "b"]})
    failed, fine = llm.generate(["hi", "hi"], [endless, ok], use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error" and failed.bad_input
    assert failed.error.startswith("the output constraint could not be followed at output token")
    assert_readable(failed.error)
    assert fine.error is None and fine.outputs[0].text in ("a", "b")


def test_a_constraint_is_compiled_once_in_the_core_and_never_in_the_front_end(tiny_checkpoint):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = SamplingParams(n=3, max_tokens=8, structured_outputs={"json": schema})
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float64", engine_process=True, **DEVICE_KWARGS)
    front = llm.engine.inputs.grammars
    llm.generate(["a", "b"], params, use_tqdm=False)
    queries, hits, seconds = front.take_stats()
    assert front.num_compiled == 0  # the front end's process compiled nothing itself
    assert len(seconds) == 1 and hits == queries - 1  # one sandbox compile, then its verdict
    in_process = LLM(str(tiny_checkpoint("llama")), dtype="float64", **DEVICE_KWARGS)
    in_process.generate(["a", "b"], params, use_tqdm=False)
    assert in_process.engine.core.grammars.num_compiled == 1


def test_a_timed_out_compile_is_killed_and_never_cached(tiny_checkpoint):
    folder = tiny_checkpoint("llama")
    compiler = GrammarCompiler(
        lambda: None, 384, [2], timeout=1.0,
        tokenizer_file=folder / "tokenizer.json", tokenizer_dir=folder,
    )  # fmt: skip
    try:
        slow = StructuredOutputs(json=many_optional("t"))
        for _ in range(2):
            with pytest.raises(GrammarError, match="did not compile within 1 s"):
                compiler.validate(slow, timeout=30)
            assert compiler.sandbox_pids == []  # its worker was killed, not left compiling
        # A new worker's first compile took over 1 s once in a full run, next to another test
        # worker: what is checked here is that a new worker compiles at all.
        compiler.timeout = 30.0
        compiler.validate(StructuredOutputs(regex="[a-z]+"))
        (pid,) = compiler.sandbox_pids
        assert os.path.exists(f"/proc/{pid}")
    finally:
        compiler.close()
    assert not os.path.exists(f"/proc/{pid}")  # closed: killed and reaped
