"""The compiled paged-attention kernel against the PyTorch reference, on random steps."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from conftest import torch_threads

from conveyor.model.attention import AttentionKind, build_metadata, paged_attention, to_cache_dtype
from conveyor.worker.model_runner import pad_block_tables, positions_and_slots

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


def run_both(
    ops, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, cache_dtype=None,
    kind=None, sinks=None,
):  # fmt: skip
    """seqs: (context_len, query_len) per sequence. Runs one attention layer of the step through
    the kernel and through the reference, on identical random caches and inputs (the cache in
    `cache_dtype`, default `dtype`)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    query_lens = np.array([q for _, q in seqs], dtype=np.int64)
    context_lens = np.array([c for c, _ in seqs], dtype=np.int64)
    needed = [-(-(c + q) // block_size) for c, q in seqs]
    num_blocks = sum(needed) + len(seqs) + 3  # room for the spare blocks below
    pool = list(range(num_blocks))
    rng.shuffle(pool)  # non-contiguous, unordered block ids
    block_ids, used = [], 0
    for n in needed:
        spare = rng.randrange(0, 2)  # some tables hold a block beyond the sequence
        block_ids.append(pool[used : used + n + spare])
        used += n + spare
    assert all(len(ids) >= n for ids, n in zip(block_ids, needed, strict=True))
    tables = pad_block_tables(block_ids)
    _, slots = positions_and_slots(query_lens, context_lens, tables, block_size)
    num_tokens = int(query_lens.sum())
    cache = torch.randn(2, num_blocks, num_kv_heads, block_size * head_dim, generator=gen)
    cache = cache.to(cache_dtype or dtype)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen, dtype=dtype)
    # k and v as strided views, like the projections' transposed outputs.
    k = torch.randn(num_kv_heads, head_dim, num_tokens, generator=gen, dtype=dtype).permute(2, 0, 1)
    v = torch.randn(num_tokens, num_kv_heads * head_dim * 2, generator=gen, dtype=dtype)
    v = v[:, ::2].view(num_tokens, num_kv_heads, head_dim)
    results = []
    for path_ops in (ops, None):
        meta = build_metadata(
            query_lens, context_lens, tables, slots, block_size, torch.device("cpu"), path_ops
        )
        layer_cache = cache.clone()
        kind = kind or AttentionKind(head_dim**-0.5)
        out = paged_attention(q, k, v, layer_cache, meta, kind, sinks)
        results.append((out, layer_cache))
    return results


def assert_close(results, dtype):
    (out, cache), (ref_out, ref_cache) = results
    assert torch.equal(cache, ref_cache), "the kernel wrote K/V to other places than the reference"
    assert out.shape == ref_out.shape
    worst = (out - ref_out).abs().max().item()
    assert worst < TOLERANCE[dtype], f"max abs difference {worst}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(8, 2, 64), (4, 1, 128), (9, 3, 64), (4, 4, 64)],
    ids=["gqa8-2", "mqa4-1", "gqa9-3", "mha"],
)
def test_decode_rows_match_reference(ops, dtype, num_heads, num_kv_heads, head_dim):
    # Lengths at block edges (1, exact multiples, one past) and random ones.
    lengths = [1, 2, 15, 16, 17, 32, 33, 64, 100, 257]
    seqs = [(n - 1, 1) for n in lengths]
    results = run_both(ops, seqs, num_heads, num_kv_heads, head_dim, 16, dtype)
    assert_close(results, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "block_size,head_dim",
    [(16, 64), (16, 128), (32, 128), (8, 32), (16, 256), (32, 512), (32, 576)],
)  # 256 / 512: Gemma's; 576: latent attention's (kv_lora_rank 512 + 64 rope dims: model/mla.py)
def test_mixed_decode_and_prefill_chunks_match_reference(ops, dtype, block_size, head_dim):
    seqs = [
        (0, 37),  # a whole prompt in one chunk
        (40, 1),  # decode
        (32, 16),  # a chunk after cached context, both at block edges
        (5, 70),  # a chunk longer than one kernel tile, after a partial block
        (0, 1),  # a one-token prompt
        (100, 3),  # a short chunk (speculation-like)
        (0, 16),  # exactly one block
    ]
    results = run_both(ops, seqs, 8, 2, head_dim, block_size, dtype)
    assert_close(results, dtype)


@pytest.mark.parametrize("seed", range(4))
def test_random_steps_match_reference(ops, seed):
    rng = random.Random(seed)
    seqs = []
    for _ in range(rng.randrange(1, 40)):
        if rng.random() < 0.6:
            seqs.append((rng.randrange(0, 300), 1))
        else:
            seqs.append((rng.choice([0, 0, rng.randrange(0, 200)]), rng.randrange(1, 90)))
    num_kv_heads = rng.choice([1, 2, 3])
    group = rng.choice([1, 2, 3, 4, 8])
    results = run_both(
        ops, seqs, num_kv_heads * group, num_kv_heads, 64, 16, torch.float64, seed=seed
    )
    assert_close(results, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "seqs",
    [[(511, 1)], [(63, 1)], [(64, 1)], [(300, 1), (40, 1)], [(200, 1), (0, 20)], [(1000, 1)]],
    ids=["one-row", "8-blocks", "one-past", "two-rows", "row-and-chunk", "long"],
)
def test_few_decode_rows_split_by_keys_match_reference(ops, dtype, seqs):
    """Steps of few items split their decode rows' keys into parts merged afterwards
    (flash-decoding style); parts end at block edges, short rows stay whole."""
    for heads in ((9, 3), (4, 1), (8, 8)):
        results = run_both(ops, seqs, *heads, 64, 16, dtype, seed=len(seqs))
        assert_close(results, dtype)


def test_split_rows_do_not_depend_on_the_thread_count(ops):
    seqs = [(700, 1)]
    many = run_both(ops, seqs, 9, 3, 64, 16, torch.float32)
    with torch_threads(1):
        one = run_both(ops, seqs, 9, 3, 64, 16, torch.float32)
    assert torch.equal(many[0][0], one[0][0])


def test_single_thread_gives_the_same_result(ops):
    seqs = [(0, 50), (30, 1), (200, 1), (17, 9)]
    many = run_both(ops, seqs, 9, 3, 64, 16, torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = run_both(ops, seqs, 9, 3, 64, 16, torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(many[0][0], one[0][0]), "a row's result depends on the thread count"


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_a_rows_result_does_not_depend_on_its_tile(ops, cache_dtype):
    """A one-request step of 1 + k rows (a verification) has too few items for two threads,
    so its tiles are cut to fewer tokens; each row must keep the bits it gets in a step where
    it shares one full tile (33 rows here: a float16 cache is widened there, read in place in
    the small tiles; from 32 rows with AVX-512, from 8 with AVX2)."""
    bs, num_heads, num_kv_heads, dim = 16, 9, 3, 64
    gen = torch.Generator().manual_seed(5)
    seqs = [(300, 11), (40, 30), (10, 60), (0, 64)]  # the first alone: 3 items; all: 30
    query_lens = torch.tensor([q for _, q in seqs])
    seq_lens = torch.tensor([c + q for c, q in seqs])
    needed = [-(-int(n) // bs) for n in seq_lens]
    starts = np.cumsum([0, *needed])
    tables = torch.from_numpy(
        pad_block_tables([list(range(a, a + n)) for a, n in zip(starts, needed, strict=False)])
    )
    cache = torch.randn(2, int(starts[-1]), num_kv_heads, bs * dim, generator=gen)
    cache = cache.to(cache_dtype)
    q = torch.randn(int(query_lens.sum()), num_heads, dim, generator=gen)
    query_start = torch.cat([torch.zeros(1, dtype=torch.int64), query_lens.cumsum(0)])
    scale = dim**-0.5
    together = ops.paged_attention(q, cache, bs, query_start, seq_lens, tables, scale, False)
    n = seqs[0][1]
    alone = ops.paged_attention(
        q[:n], cache, bs, query_start[:2], seq_lens[:1], tables[:1], scale, False
    )
    assert torch.equal(alone, together[:n]), "a row's result depends on the tile it sits in"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "window,softcap", [(1, 0.0), (5, 0.0), (16, 0.0), (37, 0.0), (0, 2.5), (20, 3.0)]
)
def test_sliding_window_and_soft_capped_attention_match_reference(ops, dtype, window, softcap):
    """Windows shorter than a block, one block, and spanning groups of blocks, on decode rows
    and chunks that start inside, at and past the window."""
    seqs = [(0, 37), (40, 1), (200, 1), (32, 16), (5, 70), (0, 1), (100, 3), (300, 20)]
    kind = AttentionKind(64**-0.5, window, softcap)
    results = run_both(ops, seqs, 8, 2, 64, 16, dtype, kind=kind)
    assert_close(results, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("window", [0, 20])
def test_attention_sinks_match_reference(ops, dtype, window):
    """GPT-OSS's sinks (a logit per query head in every row's softmax), on decode rows whose
    keys are split into parts (merge_parts) and on prompt chunks, with and without a window."""
    seqs = [(0, 37), (40, 1), (200, 1), (32, 16), (300, 20), (0, 1)]
    sinks = torch.linspace(-2.0, 3.0, 8, dtype=dtype)
    kind = AttentionKind(64**-0.5, window)
    results = run_both(ops, seqs, 8, 2, 64, 16, dtype, kind=kind, sinks=sinks)
    assert_close(results, dtype)
    plain = run_both(ops, seqs, 8, 2, 64, 16, dtype, kind=kind)
    assert not torch.allclose(plain[0][0], results[0][0])  # the sinks count


@pytest.mark.parametrize("window", [3, 40, 100])
def test_a_windowed_rows_result_does_not_depend_on_its_step(ops, window):
    """A row's keys are summed in the same groups of blocks whether it decodes alone or sits
    in a long prompt chunk whose first rows see earlier blocks (the batch-invariance contract
    with a sliding window)."""
    bs, num_heads, num_kv_heads, dim = 16, 4, 2, 64
    gen = torch.Generator().manual_seed(9)
    length = 300
    cache = torch.randn(2, -(-length // bs), num_kv_heads, bs * dim, generator=gen)
    table = torch.arange(-(-length // bs)).unsqueeze(0)
    q = torch.randn(length, num_heads, dim, generator=gen)
    scale = dim**-0.5

    def attend(first: int, last: int) -> torch.Tensor:  # rows [first, last) as one chunk
        query_start = torch.tensor([0, last - first])
        return ops.paged_attention(
            q[first:last], cache, bs, query_start, torch.tensor([last]), table, scale, False,
            window=window,
        )  # fmt: skip

    whole = attend(0, length)
    for row in (0, 7, 64, 150, 299):
        assert torch.equal(attend(row, row + 1), whole[row : row + 1]), f"row {row}"
    assert torch.equal(attend(131, 260), whole[131:260])


def test_negative_slots_are_skipped(ops):
    k = torch.ones(2, 1, 4)
    cache = torch.zeros(2, 3, 1, 4 * 4)
    ops.write_kv(k, k, cache, torch.tensor([-1, 5]), 4)
    assert cache.count_nonzero() == 2 * 4  # only slot 5 (block 1, offset 1) was written
    assert torch.equal(cache[1, 1, 0, 4:8], torch.ones(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_rotary_gives_the_same_bits_whatever_the_strides(ops, dtype, head_dim):
    """Contiguous heads take vector loops, strided ones scalar loops: the same expressions, so
    a row's rotated values do not depend on its tensor's layout."""
    gen = torch.Generator().manual_seed(head_dim)
    cos = torch.randn(40, head_dim, generator=gen, dtype=dtype)
    sin = torch.randn(40, head_dim, generator=gen, dtype=dtype)
    x = torch.randn(40, 12, head_dim, generator=gen, dtype=dtype) * 10
    rows = x.clone()
    ops.rotary_embedding(rows[:, :9], rows[:, 9:], cos, sin)
    spread = x.transpose(1, 2).contiguous().transpose(1, 2)  # stride(2) = 12: the scalar loops
    assert spread.stride(2) != 1
    q, k = spread[:, :9], spread[:, 9:]
    ops.rotary_embedding(q, k, cos, sin)
    assert torch.equal(spread, rows)
    assert not torch.equal(rows, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotary_in_place_matches_reference(ops, dtype):
    from transformers import LlamaConfig

    from conveyor.model.config import rope_frequencies
    from conveyor.model.layers import RotaryEmbedding

    rotary = RotaryEmbedding(*rope_frequencies(LlamaConfig(rope_theta=10000.0), 64), 300, dtype)
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 300, (70,), generator=gen)
    cos, sin = rotary.rows(positions)
    qkv = torch.randn(12 * 64, 70, generator=gen, dtype=dtype).T  # transposed, as projections give
    q, k = qkv[:, : 9 * 64].view(70, 9, 64), qkv[:, 9 * 64 :].view(70, 3, 64)
    ref_q, ref_k = rotary(q.clone(), k.clone(), cos, sin)
    out_q, out_k = rotary(q, k, cos, sin, ops)
    assert out_q.data_ptr() == qkv.data_ptr(), "the compiled path rotates in place"
    assert (out_q - ref_q).abs().max() < TOLERANCE[dtype]
    assert (out_k - ref_k).abs().max() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("out_dim,k_dim", [(960, 576), (67, 64), (13, 1536), (9, 21), (1, 3)])
def test_small_gemm_matches_torch(ops, dtype, out_dim, k_dim):
    """Every token count through every register tile and its tails: rows (8/6/4/3 at a time
    and the rest), tokens (4/3/2/1 at a time and the rest) and input columns (vectors and the
    rest), against torch's matmul; on 1 and 2 threads, which split the rows differently."""
    gen = torch.Generator().manual_seed(out_dim * 31 + k_dim)
    weight = torch.randn(out_dim, k_dim, generator=gen, dtype=dtype)
    for threads in (1, 2):
        with torch_threads(threads):
            for n in range(1, 21):
                x = torch.randn(n, k_dim, generator=gen, dtype=dtype)
                got = ops.small_gemm(x, weight)
                assert got.shape == (n, out_dim) and got.dtype == dtype
                scale = k_dim**0.5
                torch.testing.assert_close(got, x @ weight.T, rtol=0, atol=TOLERANCE[dtype] * scale)
    # A strided x (a transposed view) is read as its values.
    x = torch.randn(k_dim, 5, generator=gen, dtype=dtype).T
    torch.testing.assert_close(ops.small_gemm(x, weight), x @ weight.T, rtol=0, atol=1e-4)


@pytest.mark.parametrize("threads", [3, 5])
def test_small_gemm_rows_taken_over_between_threads_are_each_computed_once(ops, threads):
    """isa/balance.h: a thread done with its share takes the back half of another's. With more
    threads than this machine's cores, threads are descheduled mid-share all the time, so
    shares change hands in most calls; every output row must still be computed, exactly once,
    from the same weight row (a row taken twice or never shows in the result: it is written
    into uninitialized memory), and to the same bits as on one thread (a row's sum does not
    depend on who computes it)."""
    gen = torch.Generator().manual_seed(threads)
    weight = torch.randn(4099, 64, generator=gen)  # 512 pieces of 8 rows and a short one
    xs = [torch.randn(n, 64, generator=gen) for n in (1, 2, 3, 5, 8)]
    with torch_threads(1):
        expected = [ops.small_gemm(x, weight) for x in xs]
    with torch_threads(threads):
        for _ in range(40):
            for x, want in zip(xs, expected, strict=True):
                assert torch.equal(ops.small_gemm(x, weight), want)


def test_small_gemm_refuses_bad_shapes(ops):
    with pytest.raises(RuntimeError, match="small_gemm"):
        ops.small_gemm(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="small_gemm"):
        ops.small_gemm(torch.randn(2, 8), torch.randn(8, 4).T)  # weight not contiguous
    with pytest.raises(RuntimeError, match="small_gemm"):
        ops.small_gemm(torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8))


def test_matmul_forms_are_measured_and_can_be_forced(ops, monkeypatch):
    from conveyor.model.layers import MATMUL_BUCKETS, linear, matmul_forms

    measured = matmul_forms(torch.float32)
    assert set(measured) == set(MATMUL_BUCKETS)
    assert set(measured.values()) <= {"linear", "transposed", "kernel"}
    weight, bias = torch.randn(40, 24), torch.randn(40)
    x = torch.randn(5, 24)
    for form in ("linear", "transposed", "kernel"):
        monkeypatch.setenv("CONVEYOR_MATMUL", form)
        assert set(matmul_forms(torch.float32).values()) == {form}
        torch.testing.assert_close(linear(x, weight, bias), x @ weight.T + bias)
    monkeypatch.setenv("CONVEYOR_MATMUL", "fast")
    with pytest.raises(ValueError, match="CONVEYOR_MATMUL"):
        matmul_forms(torch.float32)


def test_matmul_forms_kept_at_set_up_are_read_by_later_processes(ops, monkeypatch, tmp_path):
    from conveyor.model import layers

    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CONVEYOR_MATMUL", raising=False)
    # Each measurement is real, once per dtype (~1.5 s each, more under load); later ones
    # return the first's result and are counted.
    real, results, measured_dtypes = layers._measure_forms, {}, []

    def measure(dtype, ops):
        measured_dtypes.append(dtype)
        if dtype not in results:
            results[dtype] = real(dtype, ops)
        return dict(results[dtype])

    monkeypatch.setattr(layers, "_measure_forms", measure)
    layers._measured_forms.cache_clear()
    try:
        # Without a kept file a process measures for itself and writes nothing.
        assert set(layers.matmul_forms(torch.float64)) == set(layers.MATMUL_BUCKETS)
        assert measured_dtypes == [torch.float64]
        assert not (tmp_path / "matmul_forms").exists()
        measured = layers.keep_measured_forms(torch.float64)  # what the warm-up does
        (kept,) = (tmp_path / "matmul_forms").glob("*.json")
        assert {int(k): v for k, v in json.loads(kept.read_text()).items()} == measured
        # A later process reads the file instead of measuring: what it holds is what it gets.
        chosen = {str(n): "transposed" if n % 2 else "linear" for n in layers.MATMUL_BUCKETS}
        kept.write_text(json.dumps(chosen))
        layers._measured_forms.cache_clear()
        assert layers.matmul_forms(torch.float64) == {int(k): v for k, v in chosen.items()}
        assert len(measured_dtypes) == 2  # the first process and the warm-up; not this one
        # Another dtype is another file.
        layers.keep_measured_forms(torch.float32)
        assert len(list((tmp_path / "matmul_forms").glob("*.json"))) == 2
        # A file cut short or naming an unknown form is not trusted: the process measures.
        for bad in ('{"1": "linear"', json.dumps(dict.fromkeys(chosen, "fast"))):
            kept.write_text(bad)
            layers._measured_forms.cache_clear()
            before = len(measured_dtypes)
            again = layers.matmul_forms(torch.float64)
            assert measured_dtypes[before:] == [torch.float64]
            assert again == results[torch.float64]
        # Keeping only what is missing (the test session's start): a kept file is read back,
        # not measured again; a missing one is measured and kept.
        kept.write_text(json.dumps(chosen))
        before = len(measured_dtypes)
        assert layers.keep_measured_forms(torch.float64, again=False) == {
            int(k): v for k, v in chosen.items()
        }
        assert len(measured_dtypes) == before
        kept.unlink()
        assert layers.keep_measured_forms(torch.float64, again=False) == results[torch.float64]
        assert measured_dtypes[before:] == [torch.float64]
        assert len(list((tmp_path / "matmul_forms").glob("*.json"))) == 2
    finally:
        layers._measured_forms.cache_clear()


def test_engine_num_threads_sets_torch_threads_and_rejects_zero(tiny_checkpoint):
    from conveyor.engine.llm_engine import LLMEngine

    path = str(tiny_checkpoint("llama"))
    threads = torch.get_num_threads()
    try:
        LLMEngine(path, dtype="float64", num_threads=1, num_blocks=8)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="num_threads"):
        LLMEngine(path, dtype="float64", num_threads=0, num_blocks=8)


def test_tables_pointing_outside_the_cache_raise(ops):
    q = torch.randn(1, 2, 8)
    cache = torch.zeros(2, 4, 1, 4 * 8)
    one = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.paged_attention(q, cache, 4, one, torch.tensor([3]), torch.tensor([[9]]), 1.0)
    with pytest.raises(RuntimeError, match="table of 1 blocks"):
        ops.paged_attention(q, cache, 4, one, torch.tensor([5]), torch.tensor([[0]]), 1.0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.write_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), cache, torch.tensor([16]), 4)


# ---- a float16 / bfloat16 / fp8 KV cache under a float32 model ----------------------------

HALF_TYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn]  # the narrow cache types
MIXED_STEP = [(0, 37), (40, 1), (32, 16), (5, 70), (0, 1), (100, 3), (0, 16), (300, 1)]


@pytest.mark.parametrize("cache_dtype", HALF_TYPES)
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 128), (8, 32)])
def test_half_cache_matches_reference(ops, cache_dtype, block_size, head_dim):
    # Both paths read the same rounded values and compute in float32: float32 tolerance, and
    # the writes (round to nearest even on both sides) must agree bit for bit. (8, 32): the
    # runtime-shape scalar loops.
    results = run_both(ops, MIXED_STEP, 9, 3, head_dim, block_size, torch.float32, 0, cache_dtype)
    assert results[0][1].dtype == cache_dtype
    assert_close(results, torch.float32)


@pytest.mark.parametrize("cache_dtype", HALF_TYPES)
@pytest.mark.parametrize("seed", range(3))
def test_half_cache_random_steps_match_reference(ops, cache_dtype, seed):
    rng = random.Random(seed)
    seqs = [(rng.randrange(0, 300), 1) for _ in range(rng.randrange(1, 30))]
    seqs += [(rng.choice([0, rng.randrange(0, 200)]), rng.randrange(2, 90)) for _ in range(3)]
    group = rng.choice([1, 3, 4])
    results = run_both(ops, seqs, 2 * group, 2, 64, 16, torch.float32, seed, cache_dtype)
    assert_close(results, torch.float32)


@pytest.mark.parametrize(
    "cache_dtype,tolerance",
    [(torch.float16, 2e-3), (torch.bfloat16, 2e-2), (torch.float8_e4m3fn, 8e-2)],
)
def test_half_cache_output_is_close_to_a_float32_cache(ops, cache_dtype, tolerance):
    # The loss itself: the same step with a float32 cache holding the same (unrounded) values.
    # Outputs are averages of unit-variance values; half an ulp of float16 is 2^-11 = 4.9e-4
    # relative (bfloat16: 2^-8 = 3.9e-3; fp8 e4m3: 2^-4 = 6.3e-2), the output error stays
    # below a few of those.
    wide = run_both(ops, MIXED_STEP, 9, 3, 64, 16, torch.float32)[0][0]
    half = run_both(ops, MIXED_STEP, 9, 3, 64, 16, torch.float32, 0, cache_dtype)[0][0]
    relative = ((half - wide).norm() / wide.norm()).item()
    assert 0 < relative < tolerance, f"relative error {relative}"


@pytest.mark.parametrize("cache_dtype", HALF_TYPES)
def test_write_rounds_like_torch(ops, cache_dtype):
    # Random float32 bit patterns over the whole exponent range (subnormals, overflow to inf)
    # plus exact ties, which only round-to-nearest-even gets right.
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**31 - 1, (4096,), generator=gen, dtype=torch.int64)
    values = bits.to(torch.int32).view(torch.float32)
    values = values[torch.isfinite(values)]
    mantissa_bits = {torch.float16: 10, torch.bfloat16: 7, torch.float8_e4m3fn: 3}[cache_dtype]
    step = 2.0**-mantissa_bits
    ties = torch.arange(1, 65, dtype=torch.float32) * step + step / 2  # halfway between two
    small = torch.randn(2048, generator=gen) * torch.logspace(-8, 5, 2048)
    values = torch.cat([values, -values, ties, -ties, small, torch.tensor([0.0, -0.0])])
    num = values.numel() // 32 * 32
    k = values[:num].view(-1, 1, 32)
    v = k.flip(0)
    cache = torch.zeros(2, k.shape[0], 1, 32, dtype=cache_dtype)  # block_size 1: tile = a row
    ops.write_kv(k, v, cache, torch.arange(k.shape[0]), 1)
    for stored, source in ((cache[0, :, 0], k[:, 0]), (cache[1, :, 0], v[:, 0])):
        expected = to_cache_dtype(source, cache_dtype)  # fp8: clamped to +-448, no NaN
        assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
        assert not stored.float().isnan().any()


def test_half_cache_is_refused_for_other_model_dtypes(ops):
    with pytest.raises(RuntimeError, match="cache dtype"):
        ops.write_kv(
            torch.ones(1, 1, 8, dtype=torch.float64),
            torch.ones(1, 1, 8, dtype=torch.float64),
            torch.zeros(2, 2, 1, 32, dtype=torch.float16),
            torch.tensor([0]),
            4,
        )


def greedy_tokens(path, prompts, **kwargs) -> list[list[int]]:
    from conveyor import LLMEngine, SamplingParams

    engine = LLMEngine(path, dtype="float32", **kwargs)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = list(out.outputs[0].token_ids)
    return [done[i] for i in range(len(prompts))]


def test_float16_cache_engine_generates_nearly_the_same_greedy_tokens(tiny_checkpoint):
    from conftest import random_prompts

    path = str(tiny_checkpoint("llama"))
    prompts = random_prompts(16, 200, seed=1)
    auto = greedy_tokens(path, prompts)
    half = greedy_tokens(path, prompts, kv_cache_dtype="float16")
    # A random tiny model has near-tied logits, so one rounding of K/V may flip a greedy choice
    # and the continuation diverges from there: compare the prefix before the first mismatch.
    # Requiring most of all tokens to match catches a cache that is read wrong (that would
    # diverge at once), without pinning near-ties.
    agree = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
        for x, y in zip(auto, half, strict=True)
    ]
    assert sum(agree) >= 0.75 * sum(map(len, auto)), f"tokens agreeing per prompt: {agree}"


def test_fp8_cache_engine_generates_mostly_the_same_greedy_tokens(tiny_checkpoint):
    from conftest import random_prompts

    path = str(tiny_checkpoint("llama"))
    prompts = random_prompts(16, 200, seed=1)
    auto = greedy_tokens(path, prompts)
    fp8 = greedy_tokens(path, prompts, kv_cache_dtype="fp8")
    first = [a[0] == b[0] for a, b in zip(auto, fp8, strict=True)]
    # 3 mantissa bits flip more near-ties than float16 does; a cache read wrong (scale, sign,
    # byte order) agrees on almost nothing.
    assert sum(first) >= 12, f"first tokens agreeing: {first}"


@pytest.mark.parametrize(
    "kv_cache_dtype,dtype,factor",
    [("bfloat16", torch.bfloat16, 2), ("fp8_e4m3", torch.float8_e4m3fn, 4)],
)
def test_narrow_cache_divides_kv_bytes_and_multiplies_blocks(
    tiny_checkpoint, kv_cache_dtype, dtype, factor
):
    from conveyor import LLMEngine

    path = str(tiny_checkpoint("llama"))
    auto = LLMEngine(path, dtype="float32", kv_cache_memory="1MiB")
    narrow = LLMEngine(path, dtype="float32", kv_cache_memory="1MiB", kv_cache_dtype=kv_cache_dtype)
    assert narrow.runner.kv_bytes_per_block() * factor == auto.runner.kv_bytes_per_block()
    assert narrow.runner.kv_caches[0].dtype == dtype
    assert factor * auto.num_blocks <= narrow.num_blocks < factor * (auto.num_blocks + 1)


def test_bad_kv_cache_dtype_is_refused():
    from conveyor.config import CacheConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float16, bfloat16"):
        CacheConfig(kv_cache_dtype="fp8_e5m2")


def _decoder_layer(dtype, num_heads, num_kv_heads, head_dim, qkv_bias, qk_norm, seed, parts=None):
    """A random decoder layer of the Llama family (or of the layer description `parts`), and
    its rotary table."""
    from transformers import LlamaConfig

    from conveyor.distributed.parallel import TPGroup
    from conveyor.model.config import ModelConfig, rope_frequencies
    from conveyor.model.families import Parts
    from conveyor.model.layers import RotaryEmbedding
    from conveyor.model.llama import LlamaDecoderLayer

    hidden, inner = 96, 160
    cfg = ModelConfig(
        path=None, architecture="test", dtype_name=str(dtype).removeprefix("torch."),
        vocab_size=32, hidden_size=hidden,
        intermediate_size=inner, num_layers=1, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, rms_norm_eps=1e-5, tie_word_embeddings=False, qkv_bias=qkv_bias,
        qk_norm=qk_norm, max_model_len=512, eos_token_ids=frozenset(),
        rope_inv_freq=rope_frequencies(LlamaConfig(rope_theta=10000.0), head_dim)[0],
        parts=parts or Parts(),
    )  # fmt: skip
    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(cfg, TPGroup(), 0).to(dtype)
    with torch.no_grad():
        for param in layer.parameters():  # norms near 1, projections small: a layer-like scale
            param.copy_(1 + 0.1 * torch.randn_like(param) if param.dim() == 1 else param.normal_())
            if param.dim() == 2:
                param.mul_(param.shape[1] ** -0.5)
    rotary = RotaryEmbedding(cfg.rope_inv_freq, cfg.rope_scaling, 512, dtype)
    return layer, rotary


@pytest.mark.parametrize("form", ["kernel", "linear", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,qkv_bias,qk_norm",
    [
        (8, 2, 64, False, False),
        (4, 1, 128, True, False),
        (9, 3, 64, False, True),
        (4, 4, 64, True, True),
    ],
    ids=["gqa-llama", "mqa-bias", "gqa-qknorm", "mha-bias-qknorm"],
)  # fmt: skip
def test_compiled_decoder_layers_match_the_modules(
    ops, monkeypatch, form, dtype, num_heads, num_kv_heads, head_dim, qkv_bias, qk_norm
):
    """decoder_layers (kernels/layer/decoder_layer.cpp) against the model's own modules run op by
    op, on decode rows and a short chunk: residual stream and KV cache. Both compute the matmuls in
    the same form (the small-row kernel, MKL's x W^T or (W x^T)^T), so float64 must agree bit
    for bit (the norms are transformers' ATen ops in both); float32 norms are a loop of their
    own in the compiled layer."""
    from conveyor.model.llama import _FORMS, RopeRows

    monkeypatch.setenv("CONVEYOR_MATMUL", form)
    seqs, block_size = [(0, 3), (16, 1), (40, 1), (5, 2)], 16
    layers = [
        _decoder_layer(dtype, num_heads, num_kv_heads, head_dim, qkv_bias, qk_norm, seed)
        for seed in range(2)
    ]
    rotary = layers[0][1]
    query_lens = np.array([q for _, q in seqs], dtype=np.int64)
    context_lens = np.array([c for c, _ in seqs], dtype=np.int64)
    tables = pad_block_tables([[4 * i + j for j in range(4)] for i in range(len(seqs))])
    positions, slots = positions_and_slots(query_lens, context_lens, tables, block_size)
    cpu = torch.device("cpu")
    meta = build_metadata(query_lens, context_lens, tables, slots, block_size, cpu, ops)
    rope = RopeRows(*rotary.rows(torch.from_numpy(positions)))
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(int(query_lens.sum()), 96, generator=gen, dtype=dtype)
    caches = [
        torch.randn(2, 4 * len(seqs), num_kv_heads, block_size * head_dim, generator=gen).to(dtype)
        for _ in layers
    ]
    with torch.inference_mode():
        ref_x, ref_caches, before = x.clone(), [c.clone() for c in caches], x.clone()
        for (layer, _), cache in zip(layers, ref_caches, strict=True):
            ref_x = layer(ref_x, [rope], [rotary], cache, meta)
        compiled = [layer.compiled(ops) for layer, _ in layers]
        ops.decoder_layers(
            compiled, x, caches, [rope.cos], [rope.sin], [meta.slot_mapping], block_size,
            meta.query_start, meta.seq_lens, [meta.block_tables], None, _FORMS[form],
        )  # fmt: skip
    if dtype == torch.float64:
        assert torch.equal(x, ref_x)
        assert all(torch.equal(c, r) for c, r in zip(caches, ref_caches, strict=True))
    else:
        torch.testing.assert_close(x, ref_x, rtol=1e-4, atol=1e-4)
        for cache, ref in zip(caches, ref_caches, strict=True):
            torch.testing.assert_close(cache, ref, rtol=1e-4, atol=1e-4)
    assert not torch.equal(x, before), "the residual stream is updated in place"


def test_compiled_rms_norm_is_the_models(ops):
    """float64: transformers' arithmetic bit for bit (normalized in float32); float32: a loop
    of its own, to float32 rounding of torch.rms_norm."""
    from conveyor.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float64, torch.float32):
        norm = RMSNorm(200, 1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.normal_(generator=gen)
        x = torch.randn(5, 3, 200, generator=gen, dtype=dtype) * 4
        with torch.inference_mode():
            got, expected = ops.rms_norm(x, norm.weight.detach(), 1e-5), norm(x)
        if dtype == torch.float64:
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_compiled_layers_time_their_parts_and_refuse_bad_input(ops):
    layer, rotary = _decoder_layer(torch.float32, 4, 2, 64, False, False, seed=0)
    compiled = layer.compiled(ops)
    x = torch.randn(1, 96)
    cache = torch.zeros(2, 2, 2, 16 * 64)
    cos, sin = rotary.rows(torch.tensor([0]))
    meta = ([torch.tensor([0])], 16, torch.tensor([0, 1]), torch.tensor([1]), [torch.tensor([[0]])])
    seconds = torch.zeros(3, dtype=torch.float64)
    ops.decoder_layers([compiled], x, [cache], [cos], [sin], *meta, seconds)
    assert (seconds > 0).all(), "projections, attention and the rest each take some time"
    with pytest.raises(RuntimeError, match="one KV cache per layer"):
        ops.decoder_layers([compiled], x, [], [cos], [sin], *meta, None)
    with pytest.raises(RuntimeError, match="seconds"):
        ops.decoder_layers([compiled], x, [cache], [cos], [sin], *meta, torch.zeros(2))
    with pytest.raises(RuntimeError, match="form 0"):
        ops.decoder_layers([compiled], x, [cache], [cos], [sin], *meta, None, 3)
    with pytest.raises(RuntimeError, match="group out of range"):  # one KV group given
        ops.decoder_layers([compiled], x, [cache], [cos], [sin], *meta, None, layer_groups=[1])
    dense = [ops.Projection(weight=torch.zeros(*shape)) for shape in ((10, 96), (96, 256))]
    with pytest.raises(RuntimeError, match="weight shapes"):
        ops.DecoderLayer(
            attn_in=torch.ones(96), attn_out=None, mlp_in=torch.ones(96), mlp_out=None,
            q_norm=None, k_norm=None, eps=1e-5, qkv=dense[0], o=dense[1],
            gate_up=ops.Projection(weight=torch.zeros(320, 96)),
            down=ops.Projection(weight=torch.zeros(96, 160)), num_heads=4, num_kv_heads=2,
            head_dim=64, scale=0.125,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="dense weight, or block weights"):
        ops.Projection(weight=torch.zeros(4, 4), qs=torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="bias size"):
        ops.Projection(weight=torch.zeros(4, 4), bias=torch.zeros(3))


def test_layers_without_a_compiled_form_keep_the_module_path(ops):
    """A projection the compiled layer cannot run (here any other module) keeps the model on
    its modules."""
    from torch import nn

    layer, _ = _decoder_layer(torch.float32, 4, 2, 64, False, False, seed=0)
    layer.mlp.down_proj = nn.Identity()
    assert layer.compiled(ops) is None
