"""The prompt route's attention in bfloat16 (kernels/attention/amx_attention.cpp, reached through
paged_attention's prompt_rows), on AMX tiles or AVX512-BF16 dot products, whichever this CPU
has: close to its twin, a float64 softmax of the same bfloat16-rounded operands, on random
steps (GQA/MQA/MHA, head dims 48/64/128, block sizes at and off 16, every cache dtype, garbage
past each sequence); a prompt row the same bits whatever chunk, step, neighbours or thread
count computes it; the other rows untouched; bad input raises. Runs where the CPU has AMX-BF16
or AVX512-BF16 (`lscpu`: amx_bf16, avx512_bf16); skips elsewhere."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import torch_threads

CACHE_TYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


@pytest.fixture
def amx(ops):
    if not ops.prompt_attention_isa():
        pytest.skip("no AMX-BF16 or AVX512-BF16 here (or the kernel plan narrows it)")
    return ops


class Step:
    """A step over a random paged cache: seqs are (context, new rows, prompt rows among them);
    block ids shuffled, the slots past each sequence's length NaN (never written)."""

    def __init__(self, seqs, heads, kv_heads, head_dim, block_size, cache_dtype, seed):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.seqs, self.heads, self.kv_heads, self.dim = seqs, heads, kv_heads, head_dim
        self.block_size = block_size
        needed = [-(-(c + q) // block_size) for c, q, _ in seqs]
        pool = list(range(sum(needed) + 2))
        rng.shuffle(pool)
        self.tables, used = [], 0
        for n in needed:
            self.tables.append(pool[used : used + n])
            used += n
        width = max(needed)
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables])
        cache = torch.randn(2, len(pool), kv_heads, block_size * head_dim, generator=gen)
        cache = cache.view(2, len(pool), kv_heads, block_size, head_dim)  # logical (slot, d)
        for (c, q, _), table in zip(seqs, self.tables, strict=True):
            for slot in range(c + q, len(table) * block_size):  # never written: garbage
                cache[:, table[slot // block_size], :, slot % block_size] = float("nan")
        keys = cache[0].transpose(2, 3).contiguous()  # the kernel's (head_dim, block_size) tiles
        self.cache = torch.stack(
            [keys.view(len(pool), kv_heads, -1), cache[1].reshape(len(pool), kv_heads, -1)]
        )
        self.cache = self.cache.to(cache_dtype)
        rows = sum(q for _, q, _ in seqs)
        self.q = torch.randn(rows, heads, head_dim, generator=gen)
        self.scale = head_dim**-0.5
        starts = [0]
        for _, q, _ in seqs:
            starts.append(starts[-1] + q)
        self.query_start = torch.tensor(starts)
        self.seq_lens = torch.tensor([c + q for c, q, _ in seqs])
        self.prompt_rows = [
            v for (_, _, p), s in zip(seqs, starts, strict=False) if p for v in (s, s + p)
        ]

    def run(self, ops, prompt_rows=None):
        rows = self.prompt_rows if prompt_rows is None else prompt_rows
        return ops.paged_attention(
            self.q,
            self.cache,
            self.block_size,
            self.query_start,
            self.seq_lens,
            self.block_tables,
            self.scale,
            False,
            rows,
        )

    def kv(self, s):
        """Sequence s's keys and values (positions, kv heads, head_dim), float64."""
        c, q, _ = self.seqs[s]
        n, bs = c + q, self.block_size
        tiles = self.cache.float().view(2, -1, self.kv_heads, bs * self.dim)
        keys = tiles[0].view(-1, self.kv_heads, self.dim, bs).transpose(2, 3)
        values = tiles[1].view(-1, self.kv_heads, bs, self.dim)
        ids = torch.tensor(self.tables[s])
        k = keys[ids].transpose(1, 2).reshape(-1, self.kv_heads, self.dim)[:n]
        v = values[ids].transpose(1, 2).reshape(-1, self.kv_heads, self.dim)[:n]
        return k.double(), v.double()

    def twin(self):
        """The prompt rows' attention as the kernel rounds its operands: q * scale, K and V in
        bfloat16, the weights e^(s - max) rounded to bfloat16 and normalised by their own sum;
        float64 everywhere else. (The kernel's max runs over groups of 64 keys, so its weights
        round at other scales: within a bfloat16 half-ulp of a weight, not bitwise.)
        {(row, head): output}; each sequence's prompt rows at once, a causal mask."""
        out = {}
        group = self.heads // self.kv_heads
        for s, (c, _, p) in enumerate(self.seqs):
            if not p:
                continue
            k, v = self.kv(s)
            k, v = k.bfloat16().double(), v.bfloat16().double()
            row0 = int(self.query_start[s])
            positions = torch.arange(c, c + p)
            visible = torch.arange(k.shape[0])[None, :] <= positions[:, None]  # (p, keys)
            q = (self.q[row0 : row0 + p] * self.scale).bfloat16().double()  # (p, heads, d)
            for head in range(self.heads):
                h = head // group
                scores = (q[:, head] @ k[:, h].T).masked_fill(~visible, float("-inf"))
                w = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
                w = w.bfloat16().double()
                rows = (w @ v[:, h]) / w.sum(dim=1, keepdim=True)
                for t in range(p):
                    out[(row0 + t, head)] = rows[t]
        return out


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [
        (9, 3, 64, 16),
        (8, 2, 128, 32),
        (4, 4, 64, 16),
        (4, 1, 128, 16),
        (2, 2, 48, 8),
        (3, 1, 64, 5),
    ],
    ids=["gqa9-3", "gqa8-2-d128-bs32", "mha", "mqa-d128", "d48-bs8", "bs5"],
)
@pytest.mark.parametrize("cache_dtype", CACHE_TYPES, ids=str)
def test_prompt_rows_match_their_twin_and_leave_the_rest_alone(
    amx, heads, kv_heads, head_dim, block_size, cache_dtype
):
    # A prompt chunk after a cached context, a whole prompt, a prompt chunk followed by a
    # generated row (a verification after the last prompt token), decode rows.
    seqs = [(0, 70, 70), (40, 1, 0), (37, 90, 90), (5, 4, 3), (130, 1, 0), (0, 1, 1)]
    step = Step(seqs, heads, kv_heads, head_dim, block_size, cache_dtype, seed=heads + head_dim)
    with torch_threads(2):
        out = step.run(amx)
        plain = step.run(amx, prompt_rows=[])
    assert not out.isnan().any()
    bound = 2**-8 * step.kv(0)[1].abs().max().item()  # a weight's bfloat16 ulp, at most
    for (row, head), want in step.twin().items():
        error = (out[row, head].double() - want).abs().max().item()
        assert error <= bound, (row, head, error)
    prompt = torch.zeros(out.shape[0], dtype=torch.bool)
    for begin, end in zip(step.prompt_rows[::2], step.prompt_rows[1::2], strict=True):
        prompt[begin:end] = True
    assert torch.equal(out[~prompt], plain[~prompt]), "rows off the route changed"
    # the loss itself, against float32 vectors: a few bfloat16 ulps of the outputs
    relative = ((out[prompt] - plain[prompt]).norm() / plain[prompt].norm()).item()
    assert 0 < relative < 1e-2, relative


def test_a_prompt_row_is_the_same_bits_in_any_chunk_step_and_thread_count(amx):
    # One 150-token prompt (9 heads on 3 kv heads, a float16 cache, as the default model):
    # whole; in chunks after a cached context; row by row; beside other sequences' rows.
    prompt_len, cache_dtype = 150, torch.float16
    whole = Step([(0, prompt_len, prompt_len)], 9, 3, 64, 16, cache_dtype, seed=3)
    with torch_threads(2):
        reference = whole.run(amx)

    def same_prompt(seqs, s):
        # seqs' sequence s is the prompt's rows from its context on: the same cache, q rows
        step = Step(seqs, 9, 3, 64, 16, cache_dtype, seed=11)
        c, q, _ = seqs[s]
        row0 = int(step.query_start[s])
        ids = step.tables[s]
        for i, block in enumerate(whole.tables[0][: len(ids)]):
            step.cache[:, ids[i]] = whole.cache[:, block]
        step.q[row0 : row0 + q] = whole.q[c : c + q]
        return step, row0

    cases = []
    for c, q in [(0, 37), (37, 64), (101, 49), (64, 1), (149, 1), (20, 100)]:
        cases.append(([(c, q, q)], 0))
        cases.append(([(300, 1, 0), (5, 17, 17), (c, q, q), (9, 2, 0)], 2))
    for threads in (1, 2):
        with torch_threads(threads):
            for seqs, s in cases:
                step, row0 = same_prompt(seqs, s)
                c, q, _ = seqs[s]
                got = step.run(amx)[row0 : row0 + q]
                assert torch.equal(got, reference[c : c + q]), (threads, seqs)


def test_bad_prompt_rows_and_shapes_are_refused(amx):
    step = Step([(0, 5, 5), (3, 4, 4)], 4, 2, 64, 16, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="leading rows"):
        step.run(amx, prompt_rows=[1, 3])
    with pytest.raises(RuntimeError, match="ascending"):
        step.run(amx, prompt_rows=[5, 9, 0, 5])
    with pytest.raises(RuntimeError, match="pairs"):
        step.run(amx, prompt_rows=[0])
    with pytest.raises(RuntimeError, match="float32 models only"):
        amx.paged_attention(
            step.q.double(),
            step.cache.double(),
            16,
            step.query_start,
            step.seq_lens,
            step.block_tables,
            1.0,
            False,
            [0, 5],
        )
    narrow = Step([(0, 5, 5)], 2, 1, 8, 16, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        narrow.run(amx)
