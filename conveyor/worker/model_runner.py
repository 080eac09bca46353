"""SchedulerOutput -> input tensors -> forward -> sampler -> ModelRunnerOutput.

The runner keeps no per-request state: everything it needs arrives in the SchedulerOutput.
The one host sync of a step is reading the sampled tokens back.
"""

from __future__ import annotations

import numpy as np
import torch

from conveyor.config import ModelConfig
from conveyor.model.attention import AttentionMetadata, PrefillChunk
from conveyor.model.loader import load_model
from conveyor.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from conveyor.sample.sampler import Sampler


class ModelRunner:
    def __init__(self, cfg: ModelConfig, device: torch.device, block_size: int, seed: int) -> None:
        self.cfg = cfg
        self.device = device
        self.block_size = block_size
        self.model = load_model(cfg, device)
        self.sampler = Sampler(cfg.eos_token_ids, seed=seed)
        self.kv_caches: list[torch.Tensor] = []

    def kv_bytes_per_block(self) -> int:
        per_token = 2 * self.cfg.num_layers * self.cfg.num_kv_heads * self.cfg.head_dim
        return per_token * self.block_size * self.cfg.dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.cfg.dtype, device=self.device)
            for _ in range(self.cfg.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        input_ids, positions, meta, logits_rows = self._prepare(sched.scheduled)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        sampled = [s for s in sched.scheduled if s.sampling is not None]
        if not sampled:
            return ModelRunnerOutput([], [], [])
        logits = self.model.compute_logits(hidden[logits_rows])
        out = self.sampler(logits, [s.sampling for s in sampled])
        return ModelRunnerOutput(
            request_ids=[s.request_id for s in sampled],
            sampled_token_ids=[[t] for t in out.token_ids],
            logprobs=[None if lp is None else [lp] for lp in out.logprobs],
        )

    def _prepare(self, scheduled: list[ScheduledRequest]):
        bs = self.block_size
        ids, pos, slots, logits_rows, prefills = [], [], [], [], []
        dec_rows, dec_tables, dec_lens = [], [], []
        start = 0
        for item in scheduled:
            n = len(item.token_ids)
            p = np.arange(item.num_computed_tokens, item.num_computed_tokens + n)
            table = np.asarray(item.block_ids, dtype=np.int64)
            ids.append(item.token_ids)
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            if n == 1:
                dec_rows.append(start)
                dec_tables.append(table)
                dec_lens.append(item.num_computed_tokens + 1)
            else:
                prefills.append(PrefillChunk(start, start + n, item.num_computed_tokens, table))
            if item.sampling is not None:
                logits_rows.append(start + n - 1)
            start += n
        meta = AttentionMetadata(
            slot_mapping=self._tensor(np.concatenate(slots)),
            decode_rows=self._tensor(np.asarray(dec_rows, dtype=np.int64)),
            decode_block_tables=self._tensor(_pad_tables(dec_tables)),
            decode_seq_lens=self._tensor(np.asarray(dec_lens, dtype=np.int64)),
            prefills=[_chunk_to(c, self.device) for c in prefills],
            block_size=bs,
        )
        input_ids = self._tensor(np.fromiter((t for chunk in ids for t in chunk), np.int64))
        return (
            input_ids,
            self._tensor(np.concatenate(pos)),
            meta,
            self._tensor(np.asarray(logits_rows, dtype=np.int64)),
        )

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device)


def _pad_tables(tables: list[np.ndarray]) -> np.ndarray:
    width = max((len(t) for t in tables), default=0)
    out = np.zeros((len(tables), width), dtype=np.int64)
    for i, table in enumerate(tables):
        out[i, : len(table)] = table
    return out


def _chunk_to(chunk: PrefillChunk, device: torch.device) -> PrefillChunk:
    table = torch.from_numpy(chunk.block_table).to(device)
    return PrefillChunk(chunk.start, chunk.end, chunk.context_len, table)
