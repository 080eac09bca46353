"""N-gram prompt lookup (Saxena 2023; vLLM's "ngram", llama.cpp's lookup decoding).

After each step, for every decoding request: the longest suffix of its tokens (prompt +
output), between prompt_lookup_min and prompt_lookup_max tokens long, that occurred earlier
in them, and the up to k tokens that followed that occurrence are its drafts. Among matches
of max length, the one whose context agrees furthest back wins, then the latest. No match:
no drafts, and the request decodes as without speculation.

Vectorised over the request's tokens: candidates are the positions holding the last token;
each is compared backwards with the text's end in one (candidates, length) numpy gather.
The work per request and step is bounded however repetitive the text: beyond the one scan
for the last token, at most MAX_CANDIDATES x max_n comparisons find the n-gram length, and
at most MAX_TIE_BREAK x TIE_BREAK_LIMIT choose among the matches of length max_n (a 3-token
cycle or one repeated token makes every third or every position a candidate: 6-9 ms per
request per step before these caps, on a 4,000-token context).
"""

from __future__ import annotations

import numpy as np

from conveyor.request import Request

# How far back equally long (max_n) matches are compared to choose between them.
TIE_BREAK_LIMIT = 256
# Only the latest occurrences of the last token are candidates, and only the latest matches
# of length max_n are compared further back: older ones are dropped, never the cost capped
# by cutting a comparison short, so a proposal is always one the uncapped search could make.
MAX_CANDIDATES = 1024
MAX_TIE_BREAK = 32


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n
        self.num_compared = 0  # token comparisons of the last propose(): the bound's witness

    def propose_for(self, requests: list[Request]) -> None:
        """Sets spec_token_ids of every decoding request (empty for the others)."""
        for request in requests:
            if request.num_computed_tokens == request.num_tokens - 1:
                request.spec_token_ids = self.propose(request.all_token_ids)
            elif request.spec_token_ids:
                request.spec_token_ids = []

    def propose(self, token_ids: list[int]) -> list[int]:
        self.num_compared = 0
        num = len(token_ids)
        if num <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])[-MAX_CANDIDATES:]
        if ends.size == 0:
            return []
        # Up to max_n the agreement is the n-gram's length; past it only matches of length
        # max_n are compared further, to choose the one whose context agrees furthest back
        # (copying text that repeats phrases). Ties: the latest.
        lengths = self._agreement(tokens, ends, min(self.max_n, num - 1))
        best = int(lengths.max())
        if best < self.min_n:
            return []
        ends = ends[lengths == best]
        if best == self.max_n and ends.size > 1:
            ends = ends[-MAX_TIE_BREAK:]
            lengths = self._agreement(tokens, ends, min(TIE_BREAK_LIMIT, num - 1))
            ends = ends[lengths == lengths.max()]
        end = int(ends[-1])
        return tokens[end + 1 : end + 1 + self.k].tolist()

    def _agreement(self, tokens: np.ndarray, ends: np.ndarray, limit: int) -> np.ndarray:
        """For each end: how many tokens up to it agree with the text's last ones (<= limit)."""
        self.num_compared += ends.size * limit
        back = np.arange(limit)
        index = ends[:, None] - back  # (candidates, limit); negative: before the text
        agree = (tokens[np.maximum(index, 0)] == tokens[tokens.size - 1 - back]) & (index >= 0)
        return np.where(agree.all(axis=1), limit, agree.argmin(axis=1))
