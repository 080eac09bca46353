"""KV groups (model/kv_groups.py) and their tables in the KV cache manager: which layers share
a table and a cache; every group's blocks accounted for (check_integrity), a sliding group's
blocks outside its window handed back, and a prefix hit serving in every group the blocks
that hold exactly that group's KV of those tokens."""

from __future__ import annotations

import random

import pytest

from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.model.kv_groups import KVGroups, blocks_held, group_layers
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams

PAGE = 32  # a token's K (or V) in a layer: every layer's alike unless a test says otherwise


def _grouping(windows: list[int], pages=None, separate: bool = True) -> KVGroups:
    pages = pages or [PAGE] * len(windows)
    return group_layers(dict(enumerate(windows)), dict(enumerate(pages)), separate)


def test_gemma3_layers_split_into_groups_of_its_global_layers_count():
    """Gemma 3 1B: 26 layers, every sixth global (window 512 on the others): 4 global layers,
    so groups of 4, the sliding layers in six of them (the last two layers alone in theirs)."""
    windows = [0 if (i + 1) % 6 == 0 else 512 for i in range(26)]
    groups = _grouping(windows)
    assert groups.windows == (0, 512, 512, 512, 512, 512, 512)
    assert groups.layers[0] == (5, 11, 17, 23)
    assert groups.layers[1] == (0, 1, 2, 3) and groups.layers[-1] == (24, 25)
    assert groups.size == 4
    slot_of, group_of = groups.slot_of(), groups.group_of()
    assert sorted(slot_of) == list(range(26)) and set(slot_of.values()) == {0, 1, 2, 3}
    assert group_of[23] == 0 and group_of[24] == 6 and slot_of[25] == 1
    # one slot's layers, one per group: a block id is a page of exactly one of them at a time
    for slot in range(4):
        members = [layer for layer, j in slot_of.items() if j == slot]
        assert len({group_of[layer] for layer in members}) == len(members)


def test_kinds_of_near_equal_size_keep_one_group_each_and_the_rest_one_group():
    gpt_oss = _grouping([128 if i % 2 == 0 else 0 for i in range(24)])  # alternating
    assert gpt_oss.windows == (0, 128) and gpt_oss.size == 12
    near = _grouping([0] * 8 + [64] * 9)  # 9 < 1.25 x 8: one group each, a slot left empty
    assert near.layers == (tuple(range(8)), tuple(range(8, 17))) and near.size == 9
    apart = _grouping([0] * 4 + [64] * 5)  # 5 = 1.25 x 4: the sliding kind in two groups
    assert apart.layers == ((0, 1, 2, 3), (4, 5, 6, 7), (8,)) and apart.size == 4
    # one kind, pages that do not divide the largest, or a draft model's one table: one
    # group, its window the largest where every layer slides
    assert _grouping([0, 0, 0]) == KVGroups((0,), ((0, 1, 2),))
    assert _grouping([4, 4]).windows == (4,)
    assert _grouping([4, 8], pages=[32, 48]).windows == (8,)
    assert _grouping([4, 0], pages=[32, 48]).windows == (0,)
    assert _grouping([4, 0, 4, 0], pages=[32, 64, 48, 64]).windows == (0,)  # a kind unalike
    assert _grouping([4, 0], separate=False) == KVGroups((0,), ((0, 1),))


def test_a_group_of_smaller_pages_sees_its_slots_as_more_blocks():
    """Gemma 4 E2B: global layers of one 512-wide KV head, sliding ones of one 256-wide (and
    the 31B's the other way round, 4 x 512 against 16 x 256): a slot's cache holds the largest
    page, and the smaller pages' group names block `scale` x id."""
    e2b = _grouping([512, 512, 512, 512, 0] * 3, pages=[256, 256, 256, 256, 512] * 3)
    assert e2b.windows[0] == 0 and e2b.scales[0] == 1 and set(e2b.scales[1:]) == {2}
    big = _grouping([1024, 0] * 2, pages=[16 * 256, 4 * 512] * 2)
    assert big.windows == (0, 1024) and big.scales == (2, 1)
    assert _grouping([4, 0]).scales == (1, 1)


def test_blocks_held_is_a_full_groups_context_and_a_sliding_groups_window_and_step():
    assert blocks_held((0,), 100, 4, 16) == 25
    # window 6, step 8: positions p - 5 .. p + 7, 13 of them, over at most 5 blocks of 4
    assert blocks_held((0, 6), 100, 4, 8) == 25 + 5
    assert blocks_held((0, 6), 10, 4, 8) == 3 + 3  # a short request: all its blocks
    for start in range(16):  # every alignment of a step against the blocks
        first, last = max(0, start - 5) // 4, (start + 7) // 4
        assert last - first + 1 <= blocks_held((6,), 100, 4, 8)


def _request(request_id: str, token_ids: list[int]) -> Request:
    params = SamplingParams(temperature=0, max_tokens=1)
    return Request(request_id, token_ids, params, max_tokens=1, eos_token_ids=frozenset())


class Model:
    """What the KV cache would hold: each block's content, written when a step computes its
    tokens (group, the tokens of the prefix through the block), checked where it is read."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager, self.content = manager, {}

    def compute(self, request: Request, num_new: int) -> None:
        bs, start = self.manager.block_size, request.num_computed_tokens
        tokens = request.all_token_ids
        tables = self.manager.req_to_blocks[request.request_id]
        for g, table in enumerate(tables):
            for i in range(start // bs, -(-(start + num_new) // bs)):
                block = table[i]
                assert block is not self.manager.null_block, "a step writes into a null block"
                self.content[block.block_id] = (g, tuple(tokens[: (i + 1) * bs]))
        request.num_computed_tokens += num_new
        self.manager.cache_blocks(request)

    def check_reads(self, request: Request) -> None:
        """The full blocks the next token reads hold its prefix's KV, in every group."""
        bs, manager = self.manager.block_size, self.manager
        position = request.num_computed_tokens
        for g, (window, table) in enumerate(
            zip(manager.windows, manager.req_to_blocks[request.request_id], strict=True)
        ):
            first = max(0, position - window + 1) // bs if window else 0
            for i in range(first, position // bs):
                expected = (g, tuple(request.all_token_ids[: (i + 1) * bs]))
                assert table[i] is not manager.null_block, f"group {g} lost block {i}"
                assert self.content[table[i].block_id] == expected, f"group {g} block {i}"
            # and every block before the window has gone back to the pool
            assert all(b is manager.null_block for b in table[:first])


@pytest.mark.parametrize("seed", range(6))
def test_random_requests_keep_every_groups_accounting_and_read_their_own_kv(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    windows = rng.choice([(0, 5), (0, 3, 3), (6,), (0, 8, 8, 8)])
    manager = KVCacheManager(40, block_size, enable_caching=True, windows=windows)
    model = Model(manager)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    running: list[Request] = []
    hits_seen = 0
    for n in range(120):
        if len(running) < 4 and rng.random() < 0.5:  # a new request, often on a shared stem
            tokens = rng.choice(stems)[: rng.randrange(1, 20)] + [
                rng.randrange(50)
            ] * rng.randrange(1, 8)
            request = _request(str(n), tokens)
            hits, num_hit = manager.get_computed_blocks(request)
            assert num_hit % block_size == 0 and num_hit < request.num_tokens
            num_new = min(request.num_tokens - num_hit, rng.choice([1, 3, 8]))
            if manager.allocate_slots(request, num_new, hits) is not None:
                request.num_computed_tokens = num_hit
                hits_seen += num_hit
                model.check_reads(request)
                model.compute(request, num_new)
                running.append(request)
        for request in list(running):
            if rng.random() < 0.1:  # preempted or finished: its blocks go back
                manager.free(request)
                running.remove(request)
                continue
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, rng.choice([1, 2, 5])) if remaining else 1
            if not remaining:  # decoding: a sampled token joins
                request.append_output_token(rng.randrange(50))
            if manager.allocate_slots(request, num_new) is None:
                manager.free(request)
                running.remove(request)
                continue
            model.check_reads(request)
            model.compute(request, num_new)
            model.check_reads(request)
            held = [
                sum(b is not manager.null_block for b in t)
                for t in manager.req_to_blocks[request.request_id]
            ]
            for window, count in zip(windows, held, strict=True):
                if window:
                    assert count <= blocks_held((window,), request.num_tokens, block_size, 8)
        manager.check_integrity()
    for request in running:
        manager.free(request)
    manager.check_integrity()
    assert manager.pool.num_free_blocks == 40
    assert hits_seen > 0


def _first_request(manager: KVCacheManager, model: Model) -> list[int]:
    """A 12-token request computed whole and freed: global blocks 0-5 cached; the sliding
    group's 0-3 left its window of position 12 (freed, cached, while it ran), 4-5 at the end."""
    tokens = list(range(100, 112))
    first = _request("first", tokens)
    assert manager.allocate_slots(first, 12) is not None
    model.compute(first, 12)
    assert manager.num_null_blocks["first"] == [0, 4]
    manager.free(first)
    manager.check_integrity()
    return tokens


def test_a_sliding_group_hits_from_the_right_without_the_blocks_before_its_window():
    """Global and sliding (window 4) groups, blocks of 2. The sliding group's first blocks
    evicted (they left its window first, so were freed first and are taken first): a request
    on the same prompt still hits all 12 tokens, the global group every block, the sliding one
    nulls and then the 2 blocks inside the window of position 12."""
    manager = KVCacheManager(20, 2, enable_caching=True, windows=(0, 4))
    model = Model(manager)
    tokens = _first_request(manager, model)
    taken = manager.pool.get_new_blocks(8 + 4)  # the never-used blocks, then those four
    manager.pool.free_blocks(taken)
    again = _request("again", tokens + [1])
    hits, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 12 and len(hits[0]) == len(hits[1]) == 6
    assert all(b is manager.null_block for b in hits[1][:4])  # before position 12's window
    assert all(b is not manager.null_block for b in hits[0] + hits[1][4:])
    assert manager.allocate_slots(again, 1, hits) is not None
    again.num_computed_tokens = 12
    model.check_reads(again)
    manager.check_integrity()
    manager.free(again)
    manager.check_integrity()


def test_a_sliding_group_missing_a_block_of_its_window_shortens_the_hit():
    """The sliding group's block 5 evicted: position 12's window (blocks 4 and 5) is not
    whole, position 10's (blocks 3 and 4) is: the hit is 10 tokens in both groups."""
    manager = KVCacheManager(20, 2, enable_caching=True, windows=(0, 4))
    model = Model(manager)
    tokens = _first_request(manager, model)
    long = _request("long", tokens + [3])
    manager._update_block_hashes(long)
    manager.pool._evict(manager.pool.cached[manager._key(1, long.block_hashes[5])])
    manager.check_integrity()
    hits, num_hit = manager.get_computed_blocks(long)
    assert num_hit == 10
    assert [b is manager.null_block for b in hits[1]] == [True, True, True, False, False]
    assert manager.allocate_slots(long, 3, hits) is not None
    long.num_computed_tokens = 10
    model.check_reads(long)
    manager.check_integrity()
