"""Decode steps replayed as CUDA graphs.

Eager on CUDA, a decode step is host-bound: Python issues ~20 small kernels per layer, and on
an H200 a step took ~40 ms at 1, 32 and 256 rows alike (docs/benchmarks.md). A step in which
every request brings one token and is sampled (no drafts, no prompt logprobs, no pooling)
runs here instead: its inputs are copied into fixed buffers, padded to a captured shape, and
the whole forward with the lm_head is one graph replay.

Shapes. One graph per (rows, block-table width): rows 1, 2, 4, 8, then multiples of 8 (as
vLLM's), up to max_num_seqs; widths powers of two blocks from 8 up to max_model_len's. Each is
captured the first time a step needs it (warm-up run + capture, tens of milliseconds), all in
one memory pool; `--enforce-eager` turns them off. Attention is the reference path
(model/attention.py) over the padded width: keys past a row's length are masked.

Padding. Rows past the step's requests write their K and V into a scratch block beyond the
pool's blocks (ModelRunner allocates it with the cache, the scheduler never hands it out) and
attend to that block alone; a padded table entry points at it too. So no padded row touches a
request's blocks, and a request's row computes what it would alone, up to the matmul library's
choice of kernel for the padded row count (tests/conftest.py: LOGPROB_TOL on CUDA). A model
with KV groups (model/kv_groups.py) has a table and slots per group in the buffers, each layer
reading its group's.

CONVEYOR_CUDA_GRAPHS=eager runs the same padded buffers without capture, on any device: the
tests compare it with the plain step on the CPU, and on CUDA it tells a capture bug from a
padding bug. CONVEYOR_CUDA_GRAPHS=0 is --enforce-eager.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from conveyor import envs
from conveyor.model.attention import AttentionMetadata, ReferencePlan

if TYPE_CHECKING:
    from conveyor.outputs import StepInputs

MIN_WIDTH = 8  # blocks: the narrowest table a graph reads


def graph_mode(device: torch.device) -> str | None:
    """ "capture" (CUDA's default), "eager" (the padded step without capture) or None (off)."""
    setting = envs.cuda_graphs()
    if setting in ("0", "off", "false"):
        return None
    if setting == "eager":
        return "eager"
    if setting not in ("", "1", "on", "true", "capture"):
        raise ValueError(f"CONVEYOR_CUDA_GRAPHS must be 0, 1 or eager, got {setting!r}")
    return "capture" if device.type == "cuda" else None


def row_buckets(max_rows: int) -> list[int]:
    """The captured row counts: 1, 2, 4, then multiples of 8, the last one >= max_rows."""
    buckets = [b for b in (1, 2, 4) if b < max_rows]
    return buckets + list(range(8, max_rows + 8, 8)) if max_rows > 4 else [*buckets, max_rows]


def width_buckets(max_blocks: int) -> list[int]:
    """The captured table widths in blocks: powers of two from MIN_WIDTH, the last max_blocks."""
    widths, width = [], MIN_WIDTH
    while width < max_blocks:
        widths.append(width)
        width *= 2
    return [*widths, max_blocks]


def bucket(value: int, buckets: list[int]) -> int:
    return buckets[int(np.searchsorted(buckets, value))]


@dataclass(slots=True)
class Entry:
    graph: torch.cuda.CUDAGraph | None  # None: the padded step runs eagerly
    logits: torch.Tensor | None  # (rows, vocab): the graph's output, rewritten by each replay


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_rows: int,
        max_model_len: int,
        capture: bool,
        layer_groups: list[int] | None = None,
        num_groups: int = 1,
    ) -> None:
        """kv_caches: the layers' caches, each with the scratch block last (see the module);
        layer_groups: each layer's KV group, of num_groups (None: one)."""
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.layer_groups, self.num_groups = layer_groups or [], num_groups
        self.scratch_block = kv_caches[0].shape[1] - 1
        self.rows = row_buckets(max_rows)
        self.widths = width_buckets(-(-max_model_len // block_size))
        device = kv_caches[0].device
        rows, width = self.rows[-1], self.widths[-1]
        # One int64 buffer for the step's inputs, filled by one host-to-device copy:
        # ids, positions, lengths (rows each), then per KV group its slots (rows) and its
        # table (rows x width, row-major).
        size = 3 * rows + num_groups * (rows + rows * width)
        self.inputs = torch.zeros(size, dtype=torch.int64, device=device)
        self.host = torch.zeros_like(self.inputs, device="cpu")
        if device.type == "cuda":
            self.host = self.host.pin_memory()
        self.row_ids = torch.arange(rows + 1, device=device)
        self.entries: dict[tuple[int, int], Entry] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.capture_seconds = 0.0  # spent capturing (and warming up) the graphs so far
        self.replays = 0  # steps run here

    def eligible(self, step: StepInputs) -> bool:
        """Whether the step runs here: one token and one sampled row per request (no drafts,
        prompt logprobs or pooling rows), no prompt route, and a shape some graph holds."""
        num_rows = len(step.query_lens)
        if not 0 < num_rows <= self.rows[-1] or step.prompt_tokens is not None:
            return False
        if len(step.input_ids) != num_rows or len(step.logits_rows) != num_rows:
            return False
        return self._blocks(step.context_lens) <= self.widths[-1]

    def run(self, step: StepInputs) -> torch.Tensor:
        """The logits (num_rows, vocab) of an eligible step, a view of the graph's output:
        read it before the next step."""
        num_rows = len(step.input_ids)
        rows = bucket(num_rows, self.rows)
        width = bucket(self._blocks(step.context_lens), self.widths)
        entry = self.entries.get((rows, width))
        if entry is None:
            entry = self.entries[(rows, width)] = self._new_entry(rows, width)
        self._fill(rows, width, step.input_ids, step.context_lens, step.block_tables)
        self.replays += 1
        if entry.graph is None:
            return self._forward(rows, width)[:num_rows]
        entry.graph.replay()
        return entry.logits[:num_rows]

    def _blocks(self, context_lens: np.ndarray) -> int:
        """Table columns the step reads: its longest sequence's blocks, this token included."""
        return -(-(int(context_lens.max()) + 1) // self.block_size)

    def _groups(self, buffer, rows: int, width: int):
        """Per KV group: its slots (rows) and table (rows, width) in `buffer`."""
        start, groups = 3 * rows, []
        for _ in range(self.num_groups):
            slots = buffer[start : start + rows]
            table = buffer[start + rows : start + rows + rows * width]
            groups.append((slots, table.reshape(rows, width)))
            start += rows + rows * width
        return groups

    def _fill(self, rows, width, input_ids, context_lens, tables) -> None:
        """The step's inputs into the buffers, rows past its requests padded (scratch slot).
        tables: (G, S, W)."""
        num_rows, bs = len(input_ids), self.block_size
        host = self.host.numpy()
        ids, positions, lengths = (host[i * rows : (i + 1) * rows] for i in range(3))
        ids[:num_rows], ids[num_rows:] = input_ids, 0
        positions[:num_rows], positions[num_rows:] = context_lens, 0
        lengths[:num_rows], lengths[num_rows:] = context_lens + 1, 1
        for (slots, table), group_tables in zip(
            self._groups(host, rows, width), tables, strict=True
        ):
            table[:] = self.scratch_block
            used = min(width, group_tables.shape[1])
            table[:num_rows, :used] = group_tables[:, :used]
            blocks = table[np.arange(num_rows), context_lens // bs]
            slots[:num_rows] = blocks * bs + context_lens % bs
            slots[num_rows:] = self.scratch_block * bs
        size = 3 * rows + self.num_groups * (rows + rows * width)
        self.inputs[:size].copy_(self.host[:size], non_blocking=True)

    def _forward(self, rows: int, width: int) -> torch.Tensor:
        """The padded step on the buffers' first `rows` rows and `width` table columns."""
        ids, positions, lengths = (self.inputs[i * rows : (i + 1) * rows] for i in range(3))
        row_ids = self.row_ids[:rows]
        metas = [
            AttentionMetadata(
                slot_mapping=slots,
                query_start=self.row_ids[: rows + 1],
                seq_lens=lengths,
                block_tables=table,
                block_size=self.block_size,
                ops=None,
                reference=ReferencePlan(row_ids, table, lengths, []),
                split_keys=False,
            )
            for slots, table in self._groups(self.inputs, rows, width)
        ]
        meta = metas[0]
        if len(metas) > 1:
            meta.groups, meta.layer_groups = metas, self.layer_groups
        hidden = self.model(ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    def _new_entry(self, rows: int, width: int) -> Entry:
        if self.pool is None:  # the padded step without capture
            return Entry(None, None)
        start = time.perf_counter()
        self._pad(rows, width)  # warm-up and capture write the scratch block only
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # the libraries' first calls (workspaces) not captured
            self._forward(rows, width)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (a sampler, a dashboard) is not an error
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self._forward(rows, width)
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - start
        return Entry(graph, logits)

    def _pad(self, rows: int, width: int) -> None:
        empty = np.zeros(0, dtype=np.int64)
        self._fill(rows, width, empty, empty, np.zeros((self.num_groups, 0, width), np.int64))
