"""KV groups: which layers share a block table, and which share the memory of a block.

A model whose attention layers are of one kind (full attention, or one sliding window) has one
group: every layer's cache is indexed by the request's one block table. A hybrid (Gemma 2 and
3: five sliding layers to a global one; GPT-OSS and Cohere 2: alternating) has its layers split
by kind into groups of equal size, vLLM's hybrid KV cache manager:

    Gemma 3 1B, 26 layers (4 global, 22 sliding of window 512): groups of 4 layers
      group 0  global   layers  5 11 17 23      a request's table: every block of its context
      group 1  sliding  layers  0  1  2  3      tables of its last 512 tokens' blocks only
      ...
      group 6  sliding  layers 24 25  -  -
      slot        0  1  2  3  (the caches: one block id is one page in each of them)

A block id belongs to one group at a time (the pool is shared), and its page in slot j is
layer j of that group's, so the caches hold `group size` layers' pages per block id rather than
every layer's. A kind of fewer than 1.25x the smallest kind's layers keeps its layers in one
group (a few empty slots rather than a group of a layer or two).

Pages of different sizes (Gemma 4: its global layers' heads are twice as wide, and fewer): a
slot's cache is sized by the largest page, and a layer whose page is 1/k of it sees the cache
as k times as many blocks of its own shape; its group's tables name block k * id, the first of
the k that block id's page holds (`scales`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVGroups:
    windows: tuple[int, ...]  # per group: its layers' sliding window (0: full attention)
    layers: tuple[tuple[int, ...], ...]  # per group: the layers that keep a cache of their own
    # per group: the largest page's size over its layers' (1 where the pages are alike)
    scales: tuple[int, ...] = ()

    def scale(self, group: int) -> int:
        return self.scales[group] if self.scales else 1

    @property
    def size(self) -> int:
        """Caches (slots) per block id: the largest group's layers."""
        return max((len(layers) for layers in self.layers), default=0)

    def slot_of(self) -> dict[int, int]:
        """Layer -> the cache it keeps its pages in: its place in its group."""
        return {layer: j for layers in self.layers for j, layer in enumerate(layers)}

    def group_of(self) -> dict[int, int]:
        """Layer -> its group (of the layers that keep a cache of their own)."""
        return {layer: g for g, layers in enumerate(self.layers) for layer in layers}

    def describe(self) -> str:
        """For the log: "one table" or the groups, e.g. "7 KV groups of 4 layers (1 full
        attention, 6 sliding window 512)"."""
        if len(self.windows) == 1:
            kind = f"sliding window {self.windows[0]}" if self.windows[0] else "full attention"
            return f"one table ({kind})"
        kinds = {}
        for window in self.windows:
            kinds[window] = kinds.get(window, 0) + 1
        parts = [
            f"{n} {f'sliding window {w}' if w else 'full attention'}" for w, n in kinds.items()
        ]
        return f"{len(self.windows)} KV groups of {self.size} layers ({', '.join(parts)})"


def group_layers(windows: dict[int, int], pages: dict[int, int], separate: bool = True) -> KVGroups:
    """The groups of the layers in `windows` (layer -> its window, 0: full attention), pages:
    layer -> its page's size (a token's K or V: heads x head_dim). Layers of one kind have a
    group of their own where the kinds' pages are alike within each, and each divides the
    largest. One group when the layers are of one kind, when the pages do not fit so, or when
    separate is False (a draft model reads the target's one table): its window the largest
    layer's, where every layer slides (a block leaves it when it left every layer's), else 0."""
    layers = tuple(sorted(windows))
    kinds: dict[int, list[int]] = {}
    for layer in layers:
        kinds.setdefault(windows[layer], []).append(layer)
    largest = max(pages.values(), default=1)
    fits = all(
        len({pages[layer] for layer in members}) == 1 and largest % pages[members[0]] == 0
        for members in kinds.values()
    )
    if len(kinds) <= 1 or not separate or not fits:
        window = max(windows.values()) if layers and all(windows.values()) else 0
        return KVGroups((window,), (layers,))
    counts = [len(members) for members in kinds.values()]
    size = min(counts)
    if max(counts) < 1.25 * size:
        size = max(counts)
    groups = [
        (window, tuple(members[i : i + size]))
        for window, members in sorted(kinds.items())  # full attention (0) first
        for i in range(0, len(members), size)
    ]
    scales = tuple(largest // pages[members[0]] for _, members in groups)
    return KVGroups(tuple(w for w, _ in groups), tuple(m for _, m in groups), scales)


def blocks_held(windows: tuple[int, ...], num_tokens: int, block_size: int, step: int) -> int:
    """The most blocks a request of num_tokens tokens holds at once: a full group's every
    block; a sliding group's those of the positions from its window's first before a step's
    first token to the step's last (`step`: the most a step computes), however they fall on
    block boundaries."""
    whole = -(-num_tokens // block_size)
    sliding = lambda window: min(whole, (window + step - 2) // block_size + 2)  # noqa: E731
    return sum(sliding(window) if window else whole for window in windows)


def max_concurrency(
    windows: tuple[int, ...], num_blocks: int, num_tokens: int, block_size: int, step: int
) -> float:
    """How many requests of num_tokens tokens a cache of num_blocks holds at once (vLLM's
    "maximum concurrency"), each holding blocks_held."""
    return num_blocks / blocks_held(windows, num_tokens, block_size, step)
