"""A hybrid's prefix-cache snapshots of its recurrent states (core/state_snapshots.py): slots
after the running ones, a snapshot visible to hits only once the step that saved it is done,
the least recently used evicted first, and the KV cache manager's hits ending only where one
is kept."""

from __future__ import annotations

from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.state_snapshots import StateSnapshots
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams


def test_a_saved_snapshot_is_hit_only_after_its_step_and_the_least_recent_goes_first():
    snapshots = StateSnapshots(first_slot=4, num_slots=2)
    a = snapshots.reserve("a")
    assert a in (4, 5) and snapshots.has("a") and snapshots.peek("a") is None  # being saved
    assert snapshots.reserve("a") is None  # once
    b = snapshots.reserve("b")
    assert snapshots.reserve("c") is None  # both slots being saved this step
    snapshots.commit([a, b])
    assert snapshots.peek("a") == a and snapshots.peek("b") == b
    assert snapshots.take("a") == a and snapshots.hits == 1  # "a" now the most recent
    c = snapshots.reserve("c")  # evicts "b", the least recently used
    assert c == b and snapshots.peek("b") is None and not snapshots.has("b")
    assert not snapshots.clear()  # "c" is being saved
    snapshots.commit([c])
    snapshots.check_integrity()
    snapshots.release("c")  # a request's output snapshot, replaced by its next one
    assert snapshots.peek("c") is None and snapshots.reserve("d") == c
    snapshots.release("c")  # gone already: nothing
    snapshots.commit([c])
    snapshots.check_integrity()
    assert snapshots.clear() and snapshots.peek("a") is None
    snapshots.check_integrity()


def _request(request_id: str, token_ids: list[int]) -> Request:
    params = SamplingParams(temperature=0, max_tokens=1)
    return Request(request_id, token_ids, params, max_tokens=1, eos_token_ids=frozenset())


def test_a_prefix_hit_of_a_hybrid_ends_where_a_state_is_kept():
    """Blocks of 2: a 9-token request's KV blocks are all cached, but its state was kept at
    token 6 only: a request repeating it hits 6 tokens, not 8; with no snapshot, none."""
    snapshots = StateSnapshots(first_slot=2, num_slots=2)
    manager = KVCacheManager(16, 2, enable_caching=True, snapshots=snapshots)
    first = _request("first", list(range(10, 19)))
    assert manager.allocate_slots(first, 9) is not None
    first.num_computed_tokens = 9
    manager.cache_blocks(first)
    again = _request("again", list(range(10, 19)) + [1])
    assert manager.get_computed_blocks(again) == ([[]], 0)  # no state kept: no hit
    slot = snapshots.reserve(manager.snapshot_key(first, 6))
    snapshots.commit([slot])
    hits, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 6 and len(hits[0]) == 3
    assert manager.snapshot_key(again, 6) == manager.snapshot_key(first, 6)
    manager.free(first)
    manager.check_integrity()
