"""Prefix caching for a hybrid model's recurrent layers: snapshots of a sequence's state.

A hybrid (model/recurrent.py) keeps one recurrent state per running sequence, the state at the
end of what it computed, so KV blocks alone cannot continue a cached prefix: its state there is
needed too. A snapshot is a copy of every recurrent layer's state of one sequence at a block
boundary, kept in a state slot beyond the running requests' (the same tensors), keyed by the
prefix's last block (its hash names every token before it).

Where snapshots are taken: at the last block boundary before the end of each prompt (the
scheduler ends a prompt chunk there, so the state at that point exists: one extra step for the
prompt's last partial block), so a request that repeats a prompt, or extends it (the same
document with another question), starts from there; and at the block boundaries its output
passes, one at a time (each replacing the request's last), so that the next turn of a chat,
which repeats the answer, starts from the answer's last boundary. vLLM keeps them on a
grid of its attention blocks, which it widens to the state's size (528 tokens for Qwen3.5-4B),
and a prompt shorter than one of those hits nothing; here a block is 32 tokens on the CPU.

A snapshot is saved after the forward of the step whose chunk ends at the boundary and read
(restored into the request's own slot) before the forward of the step that admits a hit, so a
snapshot taken in a step is not visible to lookups until the step is done (`commit`).
Unreferenced snapshots are evicted least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class StateSnapshots:
    def __init__(self, first_slot: int, num_slots: int) -> None:
        """Slots first_slot .. first_slot + num_slots - 1 of the recurrent states."""
        self.first_slot, self.num_slots = first_slot, num_slots
        self.ready: OrderedDict[Hashable, int] = OrderedDict()  # key -> slot, LRU first
        self.pending: dict[int, Hashable] = {}  # slot -> key, saved by the step under way
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self.hits = 0  # restores handed out

    def has(self, key: Hashable) -> bool:
        """Whether a snapshot of `key` is kept or being saved."""
        return key in self.ready or key in self.pending.values()

    def peek(self, key: Hashable) -> int | None:
        return self.ready.get(key)

    def take(self, key: Hashable) -> int:
        """The slot of a kept snapshot, for a restore in this step; marked recently used."""
        self.ready.move_to_end(key)
        self.hits += 1
        return self.ready[key]

    def reserve(self, key: Hashable) -> int | None:
        """A slot to save `key` into after this step's forward (a free one, else the least
        recently used snapshot's), or None when it is kept or being saved already or every
        slot is being saved this step."""
        if self.has(key):
            return None
        if self._free:
            slot = self._free.pop()
        elif self.ready:
            _, slot = self.ready.popitem(last=False)
        else:
            return None
        self.pending[slot] = key
        return slot

    def release(self, key: Hashable) -> None:
        """Forgets a kept snapshot (a request's output snapshot that a later one replaces),
        if it has not been evicted already."""
        slot = self.ready.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def commit(self, slots: list[int]) -> None:
        """The step that saved into `slots` is done: their snapshots can be hit."""
        for slot in slots:
            key = self.pending.pop(slot)
            self.ready[key] = slot

    def clear(self) -> bool:
        """Forgets every kept snapshot (reset_prefix_cache); False while one is being saved."""
        if self.pending:
            return False
        self._free.extend(self.ready.values())
        self.ready.clear()
        return True

    def check_integrity(self) -> None:
        slots = list(self.ready.values()) + list(self.pending) + self._free
        assert sorted(slots) == list(range(self.first_slot, self.first_slot + self.num_slots)), (
            "snapshot slots: each one kept, being saved or free, once"
        )
        assert len(set(self.ready)) == len(self.ready)
