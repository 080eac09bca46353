"""Finding markers in streamed text, whatever the boundaries between its pieces.

A marker such as `</think>` may arrive split over several deltas (`</th`, `ink>`). A scan holds
back the shortest tail of what it has seen that could still be the start of a marker, and
passes on everything before it, so its answer for a text never depends on how the text was
cut. It holds at most the longest marker's length less one character, and looks at each
character a bounded number of times: linear in the text.
"""

from __future__ import annotations

from typing import NamedTuple


class Found(NamedTuple):
    before: str  # text before the marker (all that is settled, when marker is None)
    marker: str | None  # the marker found, or None: no marker in what is settled
    after: str  # text after the marker, not yet scanned (empty when marker is None)


class MarkerScan:
    """Scans for the earliest of `markers` in text fed piece by piece."""

    __slots__ = ("markers", "_held", "_longest")

    def __init__(self, markers: tuple[str, ...]) -> None:
        self.markers = markers
        self._held = ""
        self._longest = max((len(m) for m in markers), default=0)

    def feed(self, text: str) -> Found:
        """The settled text before the first marker, the marker, and the rest (unscanned: the
        caller feeds it to whatever reads after the marker). Without a marker, the tail that may
        begin one stays held."""
        text = self._held + text
        self._held = ""
        found = earliest(text, self.markers)
        if found is not None:
            start, marker = found
            return Found(text[:start], marker, text[start + len(marker) :])
        keep = self._partial(text)
        self._held = text[len(text) - keep :] if keep else ""
        return Found(text[: len(text) - keep], None, "")

    def flush(self) -> str:
        """The held tail, at the end of the text: it began no marker after all."""
        held, self._held = self._held, ""
        return held

    def _partial(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of a marker."""
        for length in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[len(text) - length :]
            if any(m.startswith(tail) for m in self.markers):
                return length
        return 0


def earliest(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """(position, marker) of the first marker in text from start; the longer one on a tie."""
    best: tuple[int, str] | None = None
    for marker in markers:
        at = text.find(marker, start)
        if at != -1 and (best is None or (at, -len(marker)) < (best[0], -len(best[1]))):
            best = (at, marker)
    return best
