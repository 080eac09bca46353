"""The garbage collector in the server's two processes: off while they start, then the heap they
start with frozen, as vLLM does.

Importing torch, transformers and fastapi and building the engine leaves ~360k long-lived
container objects in each process. With the collector on, their allocation set off ~6 full
collections per process during start (90-225 ms each on the 2-core Xeon), and every later
full collection walks all of them again: 200-270 ms measured for one `gc.collect()`, during
which the step loop (engine core) or the event loop (front end: every stream, and /health)
stands still. So `serve` and the engine-core process call `pause()` before their imports and
`freeze()` once ready: one collection, then `gc.freeze()` moves every survivor into a permanent
generation that later collections skip (reference counting still frees them). The collector
then only walks what was allocated since. A library user's process (`LLM`) is left alone.

Once frozen, the collector's own brake on full collections is off: it runs one only when the
objects promoted since the last one are over a quarter of those that survived it, and the
frozen heap counts as none. A storm of a thousand connections then set off a full collection
every ten middle ones, 20-50 ms each of a stopped event loop. So the oldest generation's
threshold goes from 10 middle collections to FULL_EVERY.
"""

from __future__ import annotations

import gc

FULL_EVERY = 100  # collections of the middle generation per full collection (CPython: 10)


def pause() -> None:
    """No automatic collections from here until `freeze()`."""
    gc.disable()


def freeze() -> None:
    """Collects once, freezes what survives, and turns automatic collection back on."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_EVERY)
    gc.enable()
