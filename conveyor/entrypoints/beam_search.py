"""Beam search over the engine, as vLLM's `LLM.beam_search` runs it.

Every step, each live beam of every prompt is one request for one token with the top
2 x beam_width log-probabilities; a beam's candidates are its own tokens among those, and a
prompt keeps the beam_width best candidates of all its beams (the best of all of a step's
(beam, token) pairs are always among each beam's own best 2 x beam_width, so this is the
search transformers' `generate(num_beams=...)` runs). A candidate that ends in the EOS token
(unless ignore_eos) is complete and leaves the search. After max_tokens steps the complete
and the live beams are ranked together and the best beam_width returned.

A beam's request shares all but its last token with the request its beam came from, so with
prefix caching on (the default) a step computes one new token per beam. The score is vLLM's:
the cumulative log-probability over the length (prompt included, a final EOS not) to the power
length_penalty; at equal lengths it is the log-probability alone.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from conveyor.engine.streams import RequestFailedError
from conveyor.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from conveyor.sampling_params import SamplingParams

MAX_LENGTH_PENALTY = 10  # a length's power stays a float (no overflow) at any context length


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's fields. temperature is accepted as vLLM accepts it: the search ranks the model's
    own log-probabilities, which a temperature does not change."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    num_logprobs: int | None = None  # a server's answer: each beam token's top entries shown
    # False: the beams' text keeps the special tokens (a server's parsers read their markers)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        checks = [
            (
                # a step asks for 2 x beam_width logprobs: the engine bounds them by its
                # vocabulary, a server by its --max-logprobs (as vLLM's max_logprobs)
                _is_int(self.beam_width) and self.beam_width >= 1,
                f"beam_width must be an integer >= 1, got {self.beam_width!r}",
            ),
            (
                _is_int(self.max_tokens) and self.max_tokens >= 1,
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
            ),
            (
                _is_number(self.temperature) and self.temperature >= 0,
                f"temperature must be a finite number >= 0, got {self.temperature!r}",
            ),
            (
                _is_number(self.length_penalty) and abs(self.length_penalty) <= MAX_LENGTH_PENALTY,
                f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY}, "
                f"{MAX_LENGTH_PENALTY}], got {self.length_penalty!r}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass(slots=True)
class BeamSearchSequence:
    tokens: list[int]  # the prompt's, then the beam's
    logprobs: list[PositionLogprobs] = field(default_factory=list)  # one per beam token
    cum_logprob: float = 0.0
    text: str | None = None  # the beam's tokens decoded, once it is returned
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | None = None  # the EOS id that ended it


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def score(beam: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    length = len(beam.tokens) - (beam.tokens[-1] == eos_token_id)
    return beam.cum_logprob / (length**length_penalty)


@dataclass(slots=True)
class _Search:
    prompt_len: int
    beams: list[BeamSearchSequence]
    done: list[BeamSearchSequence] = field(default_factory=list)


class BeamSearch:
    """The search as a state machine, for any driver (LLM.beam_search steps it with
    LLM.generate; a server would with its async engine): `requests()` gives the step's prompts
    (none: the search is over), `advance(outputs)` takes the engine's outputs for them in the
    same order, `results()` the best sequences of each prompt."""

    def __init__(self, tokenizer, prompts: Sequence[list[int]], params: BeamSearchParams):
        self.tokenizer, self.params = tokenizer, params
        self.eos = None if params.ignore_eos else tokenizer.eos_token_id
        self.step_params = SamplingParams(
            max_tokens=1, logprobs=2 * params.beam_width, temperature=0.0, ignore_eos=True
        )
        self._searches = [_Search(len(p), [BeamSearchSequence(list(p))]) for p in prompts]
        self._steps = 0
        self._live: list[tuple[_Search, BeamSearchSequence]] = []

    def requests(self) -> list[list[int]]:
        if self._steps >= self.params.max_tokens:
            return []
        self._live = [(s, beam) for s in self._searches for beam in s.beams]
        return [beam.tokens for _, beam in self._live]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        candidates: dict[int, list[BeamSearchSequence]] = {id(s): [] for s in self._searches}
        for (search, beam), output in zip(self._live, outputs, strict=True):
            for grown in _grown(beam, output):
                if self.eos is not None and grown.tokens[-1] == self.eos:
                    grown.finish_reason, grown.stop_reason = "stop", self.eos
                    search.done.append(grown)
                else:
                    candidates[id(search)].append(grown)
        key = _key(self.eos, self.params)
        for search in self._searches:
            ranked = sorted(candidates[id(search)], key=key, reverse=True)
            search.beams = ranked[: self.params.beam_width]
        self._steps += 1

    def results(self) -> list[BeamSearchOutput]:
        return [_finished(s, self.tokenizer, self.eos, self.params) for s in self._searches]


def beam_search(
    generate: Callable[[list[list[int]], SamplingParams], list[RequestOutput]],
    tokenizer,
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
) -> list[BeamSearchOutput]:
    """generate(prompts, params): the engine's outputs in input order (LLM.generate)."""
    search = BeamSearch(tokenizer, prompts, params)
    while batch := search.requests():
        search.advance(generate(batch, search.step_params))
    return search.results()


def _grown(beam: BeamSearchSequence, output: RequestOutput) -> list[BeamSearchSequence]:
    if output.error is not None:
        raise ValueError(f"beam search step failed: {output.error}")
    position = output.outputs[0].logprobs[0]
    return [
        BeamSearchSequence(
            beam.tokens + [token],
            beam.logprobs + [position],
            beam.cum_logprob + logprob.logprob,
        )
        for token, logprob in position.items()
        if math.isfinite(logprob.logprob)  # a banned token is no candidate
    ]


def _key(eos: int | None, params: BeamSearchParams):
    return lambda beam: score(beam, eos, params.length_penalty)


def _finished(search: _Search, tokenizer, eos, params: BeamSearchParams) -> BeamSearchOutput:
    for beam in search.beams:
        beam.finish_reason = "length"
    best = sorted(search.done + search.beams, key=_key(eos, params), reverse=True)
    best = best[: params.beam_width]
    for beam in best:
        generated = beam.tokens[search.prompt_len :]
        if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
            generated = generated[:-1]
        beam.text = tokenizer.decode(generated, skip_special_tokens=params.skip_special_tokens)
    return BeamSearchOutput(best)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


class BeamStream:
    """One prompt's beam search as its request's stream of outputs, for a server: iterated, it
    runs the search on the async engine (step(prompts, params): their request streams, each
    submitted as an ordinary request) and yields one final output whose completions are the
    beams, best first, as vLLM's server answers beam search. live: the step's requests in
    flight, which a client that goes away has aborted (their KV freed now). num_logprobs: each
    beam token's top entries kept in its logprobs (None: no logprobs)."""

    def __init__(
        self,
        request_id: str,
        search: BeamSearch,
        prompt: list[int],
        step: Callable[[list[list[int]], SamplingParams], Awaitable[list]],
        num_logprobs: int | None = None,
    ) -> None:
        self.request_id, self.prompt = request_id, prompt
        self._search, self._step, self._num_logprobs = search, step, num_logprobs
        self.live: list = []
        self.finished = False
        self.num_outputs = 0

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        search = self._search
        while batch := search.requests():
            self.live = await self._step(batch, search.step_params)
            search.advance([await _token_output(stream) for stream in self.live])
        self.live, self.finished, self.num_outputs = [], True, 1
        yield self._output(search.results()[0])

    def _output(self, result: BeamSearchOutput) -> RequestOutput:
        num_prompt = len(self.prompt)
        completions = [
            CompletionOutput(
                index,
                beam.text or "",
                beam.tokens[num_prompt:],
                beam.cum_logprob,
                self._logprobs(beam),
                beam.finish_reason,
                beam.stop_reason,
            )
            for index, beam in enumerate(result.sequences)
        ]
        return RequestOutput(self.request_id, None, self.prompt, completions, finished=True)

    def _logprobs(self, beam: BeamSearchSequence) -> list[PositionLogprobs] | None:
        top = self._num_logprobs
        if top is None:
            return None
        tokens = beam.tokens[len(self.prompt) :]
        return [
            {t: lp for t, lp in position.items() if lp.rank <= top or t == token}
            for token, position in zip(tokens, beam.logprobs, strict=True)
        ]


async def _token_output(stream) -> RequestOutput:
    """A step request's output that holds its one token's logprobs."""
    found = None
    async for out in stream:
        if out.outputs and out.outputs[0].logprobs:
            found = out
    if found is None:
        raise RequestFailedError(f"beam search step {stream.request_id} ended without a token")
    return found
