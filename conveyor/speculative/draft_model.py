"""A draft model proposes: a second, smaller model of the same vocabulary runs k greedy steps.

Its KV cache has its own tensors but the target's block ids: the draft writes a token's KV
into the same block and slot as the target, so it needs no block tables, allocation or prefix
cache of its own. Every step, before the target runs:

  1. one forward of the draft over every scheduled request's own tokens (prompt chunks, and
     each decoding request's last token), mirroring what the target computes this step, so
     the draft's cache holds every token the target's does, prefix-cache hits included;
  2. for the requests that verify d drafts: the argmax at their last row is draft 1, and
     d - 1 more one-token steps feed each draft back at the next position, into slots the
     scheduler has already allocated for the verification.

After verification the target's cache holds the request's token and its accepted drafts; the
draft's holds the same except the last draft when all d were accepted (it was proposed, never
fed). So a decoding request's mirror in step 1 also rewrites the token before its own
(`prev_token_id`), which fills that one gap. Draft KV at rejected positions is overwritten
later, like the target's. The drafts are greedy: the verifier treats each as a point mass.

One gap remains: a request that ends right after accepting all its drafts leaves the draft's
KV of its last draft unwritten, in a block that the prefix cache may hand to a later request.
That later request's drafts may then be worse at that one position; its output is not
affected (verification decides every token).
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from conveyor.outputs import ScheduledRequest
from conveyor.worker.model_runner import ModelRunner


class DraftModelProposer:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner  # the draft model's runner; its KV cache has the target's blocks

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest]) -> list[list[int]]:
        """The drafts of every scheduled request (empty where it verifies none)."""
        feeds = [
            ([] if s.prev_token_id is None else [s.prev_token_id]) + s.token_ids for s in scheduled
        ]
        starts = [s.num_computed_tokens - (s.prev_token_id is not None) for s in scheduled]
        drafting = [i for i, s in enumerate(scheduled) if s.num_drafts > 0]
        logits = self._forward(scheduled, range(len(scheduled)), feeds, starts, drafting)
        drafts: list[list[int]] = [[] for _ in scheduled]
        if not drafting:
            return drafts
        for i, token in zip(drafting, logits.argmax(dim=-1).tolist(), strict=True):
            drafts[i].append(token)
        for step in range(1, max(scheduled[i].num_drafts for i in drafting)):
            drafting = [i for i in drafting if scheduled[i].num_drafts > step]
            feeds = {i: [drafts[i][-1]] for i in drafting}
            # Draft `step` sits right after the request's own tokens and the drafts before it.
            starts = {
                i: scheduled[i].num_computed_tokens + len(scheduled[i].token_ids) + step - 1
                for i in drafting
            }
            logits = self._forward(scheduled, drafting, feeds, starts, drafting)
            for i, token in zip(drafting, logits.argmax(dim=-1).tolist(), strict=True):
                drafts[i].append(token)
        return drafts

    def _forward(self, scheduled, which, feeds, starts, logits_of) -> torch.Tensor:
        """One draft forward over the requests `which` (feeding feeds[i] from position
        starts[i]); the logits of the last row of each request in `logits_of`."""
        runner = self.runner
        which = list(which)
        query_lens = np.fromiter((len(feeds[i]) for i in which), np.int64, len(which))
        context_lens = np.fromiter((starts[i] for i in which), np.int64, len(which))
        input_ids = np.fromiter(
            chain.from_iterable(feeds[i] for i in which), np.int64, int(query_lens.sum())
        )
        block_ids = [scheduled[i].block_ids[:1] for i in which]  # one KV group with a draft
        positions, meta = runner.positions_and_metadata(query_lens, context_lens, block_ids)
        hidden = runner.model(
            runner.as_tensor(input_ids), runner.as_tensor(positions), runner.kv_caches, meta
        )
        wanted = set(logits_of)
        last = np.cumsum(query_lens) - 1
        rows = [int(last[k]) for k, i in enumerate(which) if i in wanted]
        if not rows:
            return hidden.new_empty((0, 0))
        return runner.model.compute_logits(hidden[runner.as_tensor(np.asarray(rows))])
