"""KV blocks: a pool with an O(1) LRU free queue, reference counts and a prefix-cache map.

A block is in exactly one of three states:
  in use   ref_cnt > 0, not in the free queue (it may also be cached: shared by prefix hits)
  cached   ref_cnt == 0, in the free queue, still findable by its hash until evicted
  free     ref_cnt == 0, in the free queue, no hash
get_new_blocks() takes from the head of the free queue and evicts a cached block's hash as it
takes it. A freed block with a hash joins the tail (least recently freed, evicted first); one
without (prefix caching off, or a request's partial last block) joins the head: it holds
nothing anyone can hit, so it is taken again before a cached block is evicted and before a
block no step has written yet. The last matters on the CPU: the cache's pages are faulted in
(and zeroed by the OS) on their first write (allocator.zeroed), and taking the least recently
freed block walked a fresh server through all of its pages (2 GiB by default), faulting in and
zeroing 2 MiB for every ~90 tokens of SmolLM2's it wrote: 13% of a prompt burst's time on a
2-vCPU Xeon (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.request import BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of blocks with ref_cnt == 0: O(1) popleft, append and remove."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next_free
        assert first is not None and block.prev_free is None and block.next_free is None
        self._head.next_free, block.prev_free = block, self._head
        block.next_free, first.prev_free = first, block
        self.num_free_blocks += 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None and block.prev_free is None and block.next_free is None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, "block is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        # One more than the largest block id ever taken: never-used blocks are taken in id
        # order, so every block below it has been written (the engine core faults in pages
        # ahead of it: EngineCore.idle_work).
        self.high_water = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot take {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self.high_water = max(self.high_water, block.block_id + 1)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[KVBlock]) -> None:
        """Takes a reference on prefix-cache hits, pulling unreferenced ones off the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: list[KVBlock]) -> None:
        """Drops a reference; cached blocks reaching zero join the queue tail in the given
        order, so the first of them is evicted first; blocks without a hash join the head, to
        be taken again first (the module's docstring says why)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # same content computed twice at once; the first copy stays the cached one
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        if any(b.ref_cnt > 0 for b in self.blocks):
            return False
        for block in self.blocks:
            self._evict(block)
        return True
