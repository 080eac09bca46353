"""Hostile-input hardening of the HTTP front and the step thread (issue 28, items 8-10): HEAD
/health, priorities clamped to the operator's range, admission that slow clients cannot hold,
and the n-gram proposer's work bounded however repetitive the text."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import server_util
from server_util import HTTP, ServerProcess

from conveyor.limits import RequestLimits
from conveyor.speculative import ngram
from conveyor.speculative.ngram import NgramProposer

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    """One request at a time, by priority, clamped to [0, 10]."""
    log = tmp_path_factory.mktemp("hostile-http") / "server.log"
    args = [str(tiny_checkpoint("llama")), "--dtype", "float32", "--served-model-name", MODEL]
    args += ["--scheduling-policy", "priority", "--max-num-seqs", "1"]
    args += ["--min-priority", "0", "--max-priority", "10"]
    proc = ServerProcess(args, log)
    yield proc
    assert proc.stop() == 0, log.read_text()[-2000:]


def test_head_health_answers_like_get(server):
    head = HTTP.head(f"{server.base_url}/health", timeout=10)
    get = HTTP.get(f"{server.base_url}/health", timeout=10)
    assert (head.status_code, head.content) == (200, b"")
    assert get.status_code == 200


@pytest.mark.serial  # once, in a full parallel run, "zero" and "ten" ended before the blocker
def test_priorities_are_clamped_to_the_operators_range(server):
    """With one seat, requests queued behind a long one run in (clamped priority, arrival)
    order: -1000 counts as 0, so it neither jumps ahead of an earlier 0 nor preempts the
    running request; 10**40 counts as 10, so a later 10 does not overtake it. Each is sent
    once the one before was admitted (a stream's headers come at admission)."""
    finished: list[str] = []
    threads = []

    def stream(name: str, body: dict, admitted: threading.Event) -> None:
        body = body | {"model": MODEL, "stream": True}
        url = f"{server.base_url}/v1/completions"
        with HTTP.stream("POST", url, json=body, timeout=120) as response:
            assert response.status_code == 200, response.read()
            admitted.set()
            lines = list(response.iter_lines())
        assert "data: [DONE]" in lines, lines[-3:]
        finished.append(name)

    blocker = {"prompt": [[5, 6, 7]] * 4, "max_tokens": 150, "ignore_eos": True}
    queued = [("blocker", blocker)]
    for name, priority in (("zero", 0), ("low", -1000), ("huge", 10**40), ("ten", 10)):
        # 40 tokens each: requests that end a step apart would reach `finished` in whichever
        # order their client threads happen to run.
        body = {"prompt": [8, 9], "max_tokens": 40, "ignore_eos": True, "priority": priority}
        queued.append((name, body))
    for name, body in queued:
        admitted = threading.Event()
        thread = threading.Thread(target=stream, args=(name, body, admitted), daemon=True)
        thread.start()
        threads.append(thread)
        assert admitted.wait(60), f"{name} was not admitted"
    for thread in threads:
        thread.join(180)
    assert finished == ["blocker", "zero", "low", "huge", "ten"]


def test_an_inverted_priority_range_is_refused():
    with pytest.raises(ValueError, match=r"min_priority \(5\) must be <= max_priority \(1\)"):
        RequestLimits(min_priority=5, max_priority=1)
    assert RequestLimits(min_priority=0, max_priority=10).clamp_priority(-(10**40)) == 0


def test_slow_bodies_hold_no_admission_slot(server):
    """Guard of the admission slots (guard.Guard): clients that send headers and then
    their body slowly, more of them than there are slots, do not keep others out."""
    sockets = []
    try:
        for _ in range(24):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"model": '
            )
            sockets.append(sock)
        body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2}
        response = server_util.post(server.base_url, "/v1/completions", body, timeout=60)
        assert response.status_code == 200, response.text
    finally:
        for sock in sockets:
            sock.close()


# ---- the n-gram proposer's work per request and step ---------------------------------------


def test_ngram_work_per_request_is_bounded_however_repetitive_the_text():
    """Token comparisons per propose() stay under a fixed budget on texts where every third or
    every position is a candidate (before the bound: ~2,700 candidates x 256 passes on a cycle
    of 8,000 tokens); on ordinary text the proposals are unchanged."""
    proposer = NgramProposer(4, 2, 5)
    budget = ngram.MAX_CANDIDATES * proposer.max_n + ngram.MAX_TIE_BREAK * ngram.TIE_BREAK_LIMIT
    rng = np.random.default_rng(0)
    texts = {
        "3-token cycle": [1, 2, 3] * 2700,
        "one token": [7] * 8000,
        "small vocabulary": rng.integers(0, 3, 8000).tolist(),
    }
    for name, tokens in texts.items():
        proposal = proposer.propose(tokens)
        assert 0 < proposer.num_compared <= budget, (name, proposer.num_compared)
        assert proposal, name
    assert proposer.propose([1, 2, 3] * 2700) == [1, 2, 3]  # what followed the latest match
    # ordinary text: few candidates, so nothing is dropped: the longest, then latest, match
    assert proposer.propose([1, 2, 3, 7, 2, 3, 8, 1, 2, 3]) == [7, 2, 3, 8]
    assert proposer.propose([9, 7, 1, 2, 3, 4, 8, 1, 2, 3, 5, 9, 7, 1, 2, 3]) == [4, 8, 1, 2]
