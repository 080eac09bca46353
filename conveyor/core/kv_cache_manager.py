"""Block tables per request on top of the block pool: prefix lookup, allocation, freeing.

Layout of one request's table (block_size 4, 10 tokens, 6 of them computed):

    blocks:  [ b7 | b2 | b9 ]          allocated = ceil(tokens to hold / block_size)
    tokens:  [xxxx|xx..|....]          x: KV computed  .: allocated, written this step
    hashed:  [ h0 ]                    only full, computed blocks are hashed and cached

allocate_slots() only adds the blocks that this step's tokens need, so allocated-but-unused KV
is under one block per request, plus the slots of rejected drafts (speculative decoding),
which the request's next tokens write again.

KV groups (vLLM's hybrid KV cache manager). A model whose layers attend differently (Gemma 2
and 3's sliding and global layers, GPT-OSS's, Cohere 2's) has its layers in groups of one kind
each (model/kv_groups.py), and a request holds one table per group, all of blocks from the one
pool; a block id names one page in each of the group's layers' caches, the page of one layer
of every group sharing memory (worker/model_runner.py). A model of one kind has one group.

Sliding window (a group whose layers attend to their last `window` tokens only): a block
whose tokens are all before the window of the request's next token is never read again, so it
goes back to the pool while the request runs (still cached by its hash) and its table entry
becomes the null block, a zeroed block past the pool (the runner allocates it) that the
attention kernel may read but always masks:

    blocks:  [ null | null | b9 | b4 | b6 ]     window 6, 17 tokens computed: the next token
    tokens:  [ ---- | ---- | xxxx | xxxx | x... ]  sees positions 12..17, blocks 3 and 4 only

So a Gemma 3 request of 32k tokens holds its global layers' 32k and its local layers' last
1024 (and a step's tokens), not 32k of every layer.

Prefix caching keys a group's blocks by the group and the block's tokens (and everything
before them). A hit is the longest prefix of whole blocks that every group can serve: a full
group the blocks of the prefix, a sliding group those inside the window of the first token to
compute (the ones before it are null in its table), found from the right; and a hybrid's
recurrent layers a snapshot of their state at its end (core/state_snapshots.py).
"""

from __future__ import annotations

from conveyor.core.block_pool import BlockPool, KVBlock
from conveyor.core.state_snapshots import StateSnapshots
from conveyor.request import BlockHash, Request

# Per group: a request's hits (null blocks before a sliding group's window), in table order.
Hits = list[list[KVBlock]]


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        salt_generated: bool = False,
        windows: tuple[int, ...] = (0,),
        snapshots: StateSnapshots | None = None,
    ) -> None:
        """windows: each KV group's sliding window (0: full attention; model/kv_groups.py);
        snapshots: a hybrid's recurrent state snapshots, with prefix caching on."""
        self.snapshots = snapshots if enable_caching else None
        self.block_size = block_size
        self.windows = tuple(windows)
        self.null_block = KVBlock(num_blocks)  # outside the pool: never allocated or freed
        self.enable_caching = enable_caching
        # The model computes prompt and generated tokens by different routes
        # (model/prompt_route.py): a block holding generated tokens gets its own key, so that a
        # later request whose prompt repeats them misses it and computes them as prompt.
        self.salt_generated = salt_generated
        self.pool = BlockPool(num_blocks, enable_caching)
        # request id -> per group: its table
        self.req_to_blocks: dict[str, list[list[KVBlock]]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already hashed
        self.num_null_blocks: dict[str, list[int]] = {}  # per group: leading blocks left behind
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[list[int]]:
        """Per group: the request's block table."""
        tables = self.req_to_blocks.get(request_id)
        if tables is None:
            return [[] for _ in self.windows]
        return [[b.block_id for b in table] for table in tables]

    def _key(self, group: int, block_hash: BlockHash):
        """A group's key of a block of tokens: its layers' KV of them is its own."""
        return block_hash if group == 0 else (group, block_hash)

    def get_computed_blocks(self, request: Request) -> tuple[Hits, int]:
        """The longest prefix of full blocks every group has cached, leaving at least one token
        to compute (the step that computes it produces the logits to sample from): per group
        its hits, and the prefix's tokens."""
        none = [[] for _ in self.windows]
        if not self.enable_caching:
            return none, 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_blocks]
        found = [
            [self.pool.get_cached_block(self._key(g, h)) for h in hashes]
            for g in range(len(self.windows))
        ]
        length = max_blocks
        while True:  # each group's longest prefix no longer than the others': until all agree
            agreed = length
            for g, window in enumerate(self.windows):
                length = self._longest_hit(found[g], window, length)
            if self.snapshots is not None:  # and a recurrent state kept at its end
                while length and self.snapshots.peek(hashes[length - 1]) is None:
                    length -= 1
            if length == agreed:
                break
        if not length:
            return none, 0
        hits = []
        for g, window in enumerate(self.windows):
            first = self._first_read(length * self.block_size, window)
            hits.append([self.null_block] * first + found[g][first:length])
        return hits, length * self.block_size

    def snapshot_key(self, request: Request, num_tokens: int) -> BlockHash:
        """The key of a recurrent state snapshot after the request's first num_tokens tokens
        (a multiple of the block size): the hash of its last block."""
        self._update_block_hashes(request)
        return request.block_hashes[num_tokens // self.block_size - 1]

    def _first_read(self, position: int, window: int) -> int:
        """The first block the token at `position` reads (0 for full attention)."""
        return max(0, position - window + 1) // self.block_size if window else 0

    def _longest_hit(self, found: list[KVBlock | None], window: int, limit: int) -> int:
        """The most blocks, at most `limit`, of which a group has the ones the next token reads:
        for full attention all of them; for a sliding window those inside it, found from the
        right (a run of found blocks long enough for the window)."""
        if not window:
            for i in range(limit):
                if found[i] is None:
                    return i
            return limit
        runs = [0] * (limit + 1)  # runs[n]: how many found blocks end at block n (exclusive)
        for i in range(limit):
            runs[i + 1] = runs[i] + 1 if found[i] is not None else 0
        for length in range(limit, 0, -1):
            if runs[length] >= length - self._first_read(length * self.block_size, window):
                return length
        return 0

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_cache_queries += num_query_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Hits | None = None
    ) -> list[list[KVBlock]] | None:
        """Blocks for `num_new_tokens` more tokens after the computed ones (plus the prefix
        hits in `computed_blocks`, on first scheduling), in every group: per group the new
        blocks, or None when the pool is too small."""
        tables = self.req_to_blocks.get(request.request_id)
        fresh = tables is None
        if fresh:
            tables = [[] for _ in self.windows]
        hits = computed_blocks if computed_blocks and computed_blocks[0] else None
        num_hit = len(hits[0]) if hits else 0
        num_computed = request.num_computed_tokens + num_hit * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new = [max(num_needed - len(t) - num_hit, 0) for t in tables]
        # Hits with no other user sit in the free queue: touching them uses up free blocks.
        touched = [b for group in hits or () for b in group if b is not self.null_block]
        num_evictable_hits = sum(1 for b in touched if b.ref_cnt == 0)
        if sum(num_new) > self.pool.num_free_blocks - num_evictable_hits:
            return None
        if fresh:
            self.req_to_blocks[request.request_id] = tables
            self.num_null_blocks[request.request_id] = [0] * len(self.windows)
        if hits:
            self.pool.touch(touched)
            for g, group in enumerate(hits):
                tables[g].extend(group)
                nulls = 0
                while nulls < len(group) and group[nulls] is self.null_block:
                    nulls += 1
                self.num_null_blocks[request.request_id][g] = nulls
            self.num_cached_blocks[request.request_id] = num_hit
        added = []
        for table, count in zip(tables, num_new, strict=True):
            new_blocks = self.pool.get_new_blocks(count)
            table.extend(new_blocks)
            added.append(new_blocks)
        return added

    def cache_blocks(self, request: Request) -> None:
        """Hashes and caches the request's full blocks whose KV is now computed; in a sliding
        group, then frees those that left its window."""
        self._cache_full_blocks(request)
        for g, window in enumerate(self.windows):
            if window:
                self._free_outside_window(request, g, window)

    def _free_outside_window(self, request: Request, group: int, window: int) -> None:
        """The next token to compute, at position num_computed_tokens, sees positions from
        num_computed_tokens - window + 1 on (and later ones see no earlier)."""
        tables = self.req_to_blocks.get(request.request_id)
        if tables is None:
            return
        blocks = tables[group]
        nulls = self.num_null_blocks[request.request_id]
        start = nulls[group]
        stop = min(self._first_read(request.num_computed_tokens, window), len(blocks))
        if stop <= start:
            return
        left = blocks[start:stop]
        blocks[start:stop] = [self.null_block] * (stop - start)
        nulls[group] = stop
        self.pool.free_blocks(left[::-1])  # later blocks evicted first: prefixes are shared

    def _cache_full_blocks(self, request: Request) -> None:
        if not self.enable_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        for g, blocks in enumerate(self.req_to_blocks[request.request_id]):
            for i in range(start, num_full):
                if blocks[i] is not self.null_block:  # a sliding group's, before its window
                    self.pool.cache_block(blocks[i], self._key(g, request.block_hashes[i]))
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        tables = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_null_blocks.pop(request.request_id, None)
        for blocks in tables:
            blocks = [b for b in blocks if b is not self.null_block]
            # Tail first: a request's last blocks are the least likely to be shared, evicted first.
            self.pool.free_blocks(blocks[::-1])

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        parent = hashes[-1].digest if hashes else request.root_digest
        for i in range(len(hashes), len(tokens) // bs):
            block = tuple(tokens[i * bs : (i + 1) * bs])
            prompt = request.num_prompt_tokens - i * bs  # of this block's tokens
            if self.salt_generated and prompt < bs:  # token ids are >= 0: a marker can't clash
                block += (-1 - max(prompt, 0),)
            block_hash = BlockHash(parent, block)
            hashes.append(block_hash)
            parent = block_hash.digest

    def reset_prefix_cache(self) -> bool:
        if self.snapshots is not None and not self.snapshots.clear():
            return False
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Every block is free, or referenced exactly by the tables that hold it, in one group;
        ref counts, the free queue and the hash map agree. Raises AssertionError otherwise."""
        refs = [0] * self.pool.num_blocks
        group_of: dict[int, int] = {}
        for request_id, tables in self.req_to_blocks.items():
            assert len(tables) == len(self.windows), f"{request_id}: a table per group"
            for g, all_blocks in enumerate(tables):
                blocks = [b for b in all_blocks if b is not self.null_block]
                nulls = len(all_blocks) - len(blocks)
                assert nulls == self.num_null_blocks[request_id][g], f"{request_id}: null blocks"
                assert all(b is self.null_block for b in all_blocks[:nulls]), "null blocks lead"
                assert not nulls or self.windows[g], f"{request_id}: nulls in a full group"
                ids = [b.block_id for b in blocks]
                assert len(set(ids)) == len(ids), f"{request_id} holds a block twice"
                for block in blocks:
                    refs[block.block_id] += 1
                    assert group_of.setdefault(block.block_id, g) == g, "a block in two groups"
        in_queue = set()
        for block in self.pool.free_queue:
            assert block.block_id not in in_queue, f"block {block.block_id} queued twice"
            in_queue.add(block.block_id)
        assert len(in_queue) == self.pool.num_free_blocks, "free count disagrees with the queue"
        for block in self.pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {refs[block.block_id]}"
            )
            queued = block.block_id in in_queue
            assert (block.ref_cnt == 0) == queued, (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but queued={queued}"
            )
            if block.block_hash is not None:
                assert self.pool.cached.get(block.block_hash) is block, "hash map disagrees"
                key = block.block_hash
                group = key[0] if isinstance(key, tuple) and isinstance(key[0], int) else 0
                if block.ref_cnt:
                    assert group_of[block.block_id] == group, "a block cached for another group"
        for block_hash, block in self.pool.cached.items():
            assert block.block_hash == block_hash, "cached block lost its hash"
        if self.snapshots is not None:
            self.snapshots.check_integrity()
