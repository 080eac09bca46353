"""N-gram prompt lookup (Saxena 2023; vLLM's "ngram", llama.cpp's lookup decoding).

After each step, for every decoding request: the longest suffix of its tokens (prompt +
output), between prompt_lookup_min and prompt_lookup_max tokens long, that occurred earlier
in them, and the up to k tokens that followed that occurrence are its drafts. Among matches
of max length, the one whose context agrees furthest back wins, then the latest. No match:
no drafts, and the request decodes as without speculation.

Vectorised over the request's tokens: candidates are the positions holding the last token;
each grows backwards while it keeps matching, max_n - 1 numpy passes over the candidates.
"""

from __future__ import annotations

import numpy as np

from conveyor.request import Request

# How far back equally long (max_n) matches are compared to choose between them.
TIE_BREAK_LIMIT = 256


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose_for(self, requests: list[Request]) -> None:
        """Sets spec_token_ids of every decoding request (empty for the others)."""
        for request in requests:
            if request.num_computed_tokens == request.num_tokens - 1:
                request.spec_token_ids = self.propose(request.all_token_ids)
            elif request.spec_token_ids:
                request.spec_token_ids = []

    def propose(self, token_ids: list[int]) -> list[int]:
        num = len(token_ids)
        if num <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # occurrences of the last token
        if ends.size == 0:
            return []
        lengths = np.ones(ends.size, dtype=np.int64)
        growing = np.ones(ends.size, dtype=bool)
        # Grow each candidate backwards while it matches. Up to max_n that is the n-gram's
        # length; past it only matches of length max_n keep growing, to choose among them
        # the one whose context agrees furthest back (copying text that repeats phrases).
        for m in range(1, min(TIE_BREAK_LIMIT, num - 1)):
            if m == self.max_n:
                growing &= lengths == self.max_n
                if np.count_nonzero(growing) < 2:
                    break
            index = ends - m
            growing &= index >= 0
            growing[growing] &= tokens[index[growing]] == tokens[num - 1 - m]
            if not growing.any():
                break
            lengths += growing
        if int(lengths.max()) < self.min_n:
            return []
        end = int(ends[np.flatnonzero(lengths == lengths.max())[-1]])
        return tokens[end + 1 : end + 1 + self.k].tolist()
