"""The front end's half of a step: token ids from the core in, RequestOutputs out.

Per sequence it keeps the generated tokens, the detokenizer (text, stop strings) and the
logprobs; per user request it groups the n sequences of one prompt into one RequestOutput
(DELTA, CUMULATIVE or FINAL_ONLY). It never touches the scheduler: sequences that a stop string
ended, or whose handling failed, are returned so that the caller tells the core to free them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from conveyor.engine.core_io import CoreOutput
from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.outputs import (
    CompletionOutput,
    OutputKind,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from conveyor.request import RequestStatus
from conveyor.sampling_params import SamplingParams


class _InputError(Exception):
    """The core ended a sequence for its request's own input (CoreOutput.bad_input)."""


@dataclass(slots=True, eq=False)
class _Sequence:
    request_id: str
    index: int
    parent: _Parent
    detokenizer: IncrementalDetokenizer
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    # What the steps since its last output added (one step's, unless its parent holds them
    # for a stream interval), and how many tokens its outputs have handed out.
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[PositionLogprobs] | None = None
    num_sent: int = 0


@dataclass(slots=True, eq=False)
class _Parent:
    """A user request: n > 1 completions run as n sequences that share the prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    output_kind: OutputKind
    sequences: list[_Sequence] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    new_prompt_logprobs: bool = False  # arrived with the step being processed
    embedding: list[float] | None = None
    max_tokens: int | None = None  # per sequence, resolved (for the request histograms)
    # Delta outputs: tokens a sequence gathers before its next output (vLLM's stream
    # interval); the first tokens and the end go out at once.
    interval: int = 1

    def due(self, changed: list[_Sequence]) -> bool:
        """Whether this step's delta output goes out (else its tokens wait for the next)."""
        if self.interval <= 1 or self.new_prompt_logprobs or self.embedding is not None:
            return True
        return any(
            s.status.finished
            or (s.num_sent == 0 and s.new_token_ids)
            or len(s.new_token_ids) >= self.interval
            for s in changed
        )


@dataclass(slots=True)
class Processed:
    outputs: list[RequestOutput]
    stopped: list[str]  # sequences a stop string ended: the core must free them
    failed: list[str]  # sequences of requests whose handling raised: the core must free them


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._sequences: dict[str, _Sequence] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def num_unfinished(self) -> int:
        return len(self._parents)

    def arrival_time(self, request_id: str) -> float | None:
        parent = self._parents.get(request_id)
        return None if parent is None else parent.arrival_time

    def sequence_ids(self, request_id: str) -> list[str]:
        """The ids the core knows one user request's sequences by."""
        parent = self._parents.get(request_id)
        return [] if parent is None else [s.request_id for s in parent.sequences]

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: list[tuple[str, SamplingParams]],
        arrival_time: float,
        output_kind: OutputKind,
        max_tokens: int | None = None,
    ) -> None:
        """Registers a request and its sequences (id, params each). Builds every detokenizer
        before registering anything, so a failure leaves no state behind."""
        parent = _Parent(request_id, prompt, prompt_token_ids, arrival_time, output_kind)
        parent.max_tokens = max_tokens
        if output_kind == OutputKind.DELTA and params:
            parent.interval = params[0][1].stream_interval
        for index, (sequence_id, sequence_params) in enumerate(params):
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, sequence_params)
            sequence = _Sequence(sequence_id, index, parent, detokenizer)
            if sequence_params.logprobs is not None:
                sequence.logprobs = []
            parent.sequences.append(sequence)
        self._parents[request_id] = parent
        for sequence in parent.sequences:
            self._sequences[sequence.request_id] = sequence

    def abort(self, request_id: str) -> list[str]:
        """Forgets a request; returns its sequence ids for the core to free."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        self._forget(parent)
        return [s.request_id for s in parent.sequences]

    def abort_all(self) -> list[tuple[str, list[str]]]:
        """Forgets every request; returns (request id, its sequence ids) for each."""
        return [(request_id, self.abort(request_id)) for request_id in list(self._parents)]

    # ---- one step ------------------------------------------------------------------------

    def process(self, core_outputs: list[CoreOutput]) -> Processed:
        now = time.monotonic()
        changed: dict[str, list[_Sequence]] = {}
        errors: dict[str, tuple[str, bool]] = {}  # parent id -> (message, bad_input)
        stopped: list[str] = []
        for out in core_outputs:
            sequence = self._sequences.get(out.request_id)
            if sequence is None or sequence.status.finished:
                continue  # aborted, or ended by a stop string before the core heard of it
            parent_id = sequence.parent.request_id
            if parent_id in errors:
                continue
            try:
                if self._update(sequence, out, now):
                    stopped.append(sequence.request_id)
            except _InputError as error:
                errors[parent_id] = (str(error), True)
            except Exception as error:  # noqa: BLE001 - one request's fault must not stop the rest
                errors[parent_id] = (f"{type(error).__name__}: {error}", False)
            changed.setdefault(parent_id, []).append(sequence)
        outputs, failed = [], []
        for parent_id, sequences in changed.items():
            parent = self._parents[parent_id]
            error = errors.get(parent_id)
            out = None
            if error is None:
                try:
                    out = self._parent_output(parent, sequences, now)
                except Exception as failure:  # noqa: BLE001 - fail this request only
                    error = (f"{type(failure).__name__}: {failure}", False)
            if error is not None:
                out = _error_output(parent, *error)
                failed.extend(s.request_id for s in parent.sequences if not s.status.finished)
            if out is not None or parent.output_kind != OutputKind.DELTA:
                for sequence in parent.sequences:  # handed out (or never to be, as deltas)
                    sequence.new_token_ids, sequence.new_logprobs = [], None
            if out is not None:
                outputs.append(out)
                if out.finished:
                    del self._parents[parent_id]
                    self._forget(parent)
        return Processed(outputs, stopped, failed)

    def _update(self, sequence: _Sequence, out: CoreOutput, now: float) -> bool:
        """Takes one step's tokens; True when a stop string ended the sequence."""
        if sequence.first_token_time is None and out.new_token_ids:
            sequence.first_token_time = now
        sequence.status, sequence.stop_reason = out.status, out.stop_reason
        sequence.num_cached_tokens = out.num_cached_tokens
        sequence.first_scheduled_time = out.first_scheduled_time
        sequence.num_preemptions = out.num_preemptions
        if out.error is not None:  # the core refused or failed this sequence
            raise (_InputError if out.bad_input else RuntimeError)(out.error)
        detokenizer = sequence.detokenizer
        parent = sequence.parent
        if out.prompt_logprobs is not None:
            parent.new_prompt_logprobs = True
            parent.prompt_logprobs = [
                None if p is None else _decoded(p, detokenizer) for p in out.prompt_logprobs
            ]
        if out.embedding is not None:
            parent.embedding = out.embedding
        num_before = detokenizer.num_tokens
        stop = detokenizer.update(out.new_token_ids)
        # A step may bring several tokens (speculative decoding): a stop string drops those
        # after the token that completed it, as if they had never been generated.
        new_token_ids = out.new_token_ids[: detokenizer.num_tokens - num_before]
        sequence.new_token_ids.extend(new_token_ids)
        sequence.output_token_ids.extend(new_token_ids)
        if out.new_logprobs is not None and sequence.logprobs is not None:
            kept = out.new_logprobs[: len(new_token_ids)]
            decoded = [_decoded(position, detokenizer) for position in kept]
            sequence.new_logprobs = (sequence.new_logprobs or []) + decoded
            sequence.logprobs.extend(decoded)
            for token_id, position in zip(new_token_ids, decoded, strict=True):
                sequence.cumulative_logprob += position[token_id].logprob
        if stop is not None and not out.status.finished:
            sequence.status, sequence.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            return True
        if stop is None and out.status.finished:
            # Ended by EOS or length: flush a held-back UTF-8 tail. A stop string completed by
            # that tail still ends the text there, and is reported as the reason.
            stop = detokenizer.finish()
            if stop is not None:
                sequence.status, sequence.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        return False

    def _parent_output(
        self, parent: _Parent, changed: list[_Sequence], now: float
    ) -> RequestOutput | None:
        sequences = parent.sequences
        finished = all(s.status.finished for s in sequences)
        if parent.output_kind == OutputKind.DELTA:
            if not (finished or parent.due(changed)):
                return None
            completions = [_delta(s) for s in sequences if s in changed or s.new_token_ids]
        elif finished or parent.output_kind == OutputKind.CUMULATIVE:
            completions = [_completion(s) for s in sequences]
        else:
            return None
        metrics = None
        if finished:
            first_token = [s.first_token_time for s in sequences if s.first_token_time]
            metrics = RequestMetrics(
                arrival_time=parent.arrival_time,
                first_scheduled_time=sequences[0].first_scheduled_time,
                first_token_time=min(first_token) if first_token else None,
                finished_time=now,
                num_preemptions=sum(s.num_preemptions for s in sequences),
                n=len(sequences),
                max_tokens=parent.max_tokens,
                num_generation_tokens=sum(len(s.output_token_ids) for s in sequences),
                max_num_generation_tokens=max(len(s.output_token_ids) for s in sequences),
            )
        prompt_logprobs = parent.prompt_logprobs
        if parent.output_kind == OutputKind.DELTA and not parent.new_prompt_logprobs:
            prompt_logprobs = None  # a stream carries them once
        parent.new_prompt_logprobs = False
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=sequences[0].num_cached_tokens,
            metrics=metrics,
            prompt_logprobs=prompt_logprobs,
            embedding=parent.embedding,
        )

    def _forget(self, parent: _Parent) -> None:
        for sequence in parent.sequences:
            self._sequences.pop(sequence.request_id, None)


def _delta(sequence: _Sequence) -> CompletionOutput:
    """What the last step added: its tokens, their text and logprobs."""
    text = sequence.detokenizer.get_delta(finished=sequence.status.finished)
    sequence.num_sent += len(sequence.new_token_ids)
    return _output(sequence, text, list(sequence.new_token_ids), sequence.new_logprobs)


def _completion(sequence: _Sequence) -> CompletionOutput:
    logprobs = sequence.logprobs
    return _output(
        sequence,
        sequence.detokenizer.output_text,
        list(sequence.output_token_ids),
        list(logprobs) if logprobs is not None else None,
    )


def _output(sequence: _Sequence, text: str, token_ids: list[int], logprobs) -> CompletionOutput:
    wants_logprobs = sequence.logprobs is not None
    return CompletionOutput(
        index=sequence.index,
        text=text,
        token_ids=token_ids,
        cumulative_logprob=sequence.cumulative_logprob if wants_logprobs else None,
        logprobs=logprobs if wants_logprobs else None,
        finish_reason=sequence.status.finish_reason,
        stop_reason=sequence.stop_reason,
    )


def _error_output(parent: _Parent, message: str, bad_input: bool = False) -> RequestOutput:
    """The last output of a request whose handling failed: every completion ends with "error"."""
    completions = [
        CompletionOutput(i, "", [], None, None, finish_reason="error")
        for i in range(len(parent.sequences))
    ]
    return RequestOutput(
        request_id=parent.request_id,
        prompt=parent.prompt,
        prompt_token_ids=parent.prompt_token_ids,
        outputs=completions,
        finished=True,
        error=message,
        bad_input=bad_input,
    )


def _decoded(position: PositionLogprobs, detok: IncrementalDetokenizer) -> PositionLogprobs:
    return {t: lp._replace(decoded_token=detok.decode_token(t)) for t, lp in position.items()}
