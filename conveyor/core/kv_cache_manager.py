"""Block tables per request on top of the block pool: prefix lookup, allocation, freeing.

Layout of one request's table (block_size 4, 10 tokens, 6 of them computed):

    blocks:  [ b7 | b2 | b9 ]          allocated = ceil(tokens to hold / block_size)
    tokens:  [xxxx|xx..|....]          x: KV computed  .: allocated, written this step
    hashed:  [ h0 ]                    only full, computed blocks are hashed and cached

allocate_slots() only adds the blocks that this step's tokens need, so allocated-but-unused KV
is under one block per request, plus the slots of rejected drafts (speculative decoding),
which the request's next tokens write again.

Sliding window (a model whose every layer attends to its last `sliding_window` tokens only,
as Mistral v0.1 or Phi-3): a block whose tokens are all before the window of the request's next
token is never read again, so it goes back to the pool while the request runs (still cached
by its hash) and its table entry becomes the null block, a zeroed block past the pool
(the runner allocates it) that the attention kernel may read but always masks:

    blocks:  [ null | null | b9 | b4 | b6 ]     window 6, 17 tokens computed: the next token
    tokens:  [ ---- | ---- | xxxx | xxxx | x... ]  sees positions 12..17, blocks 3 and 4 only
"""

from __future__ import annotations

from conveyor.core.block_pool import BlockPool, KVBlock
from conveyor.request import BlockHash, Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        salt_generated: bool = False,
        sliding_window: int = 0,
    ) -> None:
        """sliding_window: every layer's (0: a model with any full-attention layer)."""
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.null_block = KVBlock(num_blocks)  # outside the pool: never allocated or freed
        self.enable_caching = enable_caching
        # The model computes prompt and generated tokens by different routes
        # (model/prompt_route.py): a block holding generated tokens gets its own key, so that a
        # later request whose prompt repeats them misses it and computes them as prompt.
        self.salt_generated = salt_generated
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already hashed
        self.num_null_blocks: dict[str, int] = {}  # leading blocks that left the window
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks, leaving at least one token to compute (the
        step that computes it produces the logits to sample from)."""
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_cache_queries += num_query_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Blocks for `num_new_tokens` more tokens after the computed ones (plus the prefix
        hits in `computed_blocks`, on first scheduling). None when the pool is too small."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_needed - len(blocks) - len(computed_blocks)
        # Hits with no other user sit in the free queue: touching them uses up free blocks.
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if computed_blocks:
            self.pool.touch(list(computed_blocks))
            blocks.extend(computed_blocks)
            self.num_cached_blocks[request.request_id] = len(blocks)
        new_blocks = self.pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request) -> None:
        """Hashes and caches the request's full blocks whose KV is now computed; with a sliding
        window, then frees those that left it."""
        self._cache_full_blocks(request)
        if self.sliding_window:
            self._free_outside_window(request)

    def _free_outside_window(self, request: Request) -> None:
        """The next token to compute, at position num_computed_tokens, sees positions from
        num_computed_tokens - sliding_window + 1 on (and later ones see no earlier)."""
        first_seen = max(0, request.num_computed_tokens - self.sliding_window + 1)
        blocks = self.req_to_blocks.get(request.request_id)
        start = self.num_null_blocks.get(request.request_id, 0)
        stop = min(first_seen // self.block_size, len(blocks or ()))
        if stop <= start:
            return
        left = blocks[start:stop]
        blocks[start:stop] = [self.null_block] * (stop - start)
        self.num_null_blocks[request.request_id] = stop
        self.pool.free_blocks(left[::-1])  # later blocks evicted first: prefixes are shared

    def _cache_full_blocks(self, request: Request) -> None:
        if not self.enable_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        if self.num_null_blocks.pop(request.request_id, 0):
            blocks = [b for b in blocks if b is not self.null_block]
        # Tail first: a request's last blocks are the least likely to be shared, evict them first.
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
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Every block is free, or referenced exactly by the tables that hold it; ref counts,
        the free queue and the hash map agree. Raises AssertionError otherwise."""
        refs = [0] * self.pool.num_blocks
        for request_id, all_blocks in self.req_to_blocks.items():
            blocks = [b for b in all_blocks if b is not self.null_block]
            nulls = len(all_blocks) - len(blocks)
            assert nulls == self.num_null_blocks.get(request_id, 0), f"{request_id}: null blocks"
            assert all(b is self.null_block for b in all_blocks[:nulls]), "null blocks lead"
            ids = [b.block_id for b in blocks]
            assert len(set(ids)) == len(ids), f"{request_id} holds a block twice"
            for block in blocks:
                refs[block.block_id] += 1
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
        for block_hash, block in self.pool.cached.items():
            assert block.block_hash == block_hash, "cached block lost its hash"
