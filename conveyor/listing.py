"""A field error names every bad entry, not only the first: listed([7, 8, 9]) is "7, 8 and 9".
At most `cap` are written out, then "and N more", so a message stays short however many
entries a request got wrong."""

from __future__ import annotations

from collections.abc import Sequence

MAX_LISTED = 20


def listed(values: Sequence, cap: int = MAX_LISTED) -> str:
    words = [str(value) for value in values[:cap]]
    if len(values) > cap:
        return f"{', '.join(words)} and {len(values) - cap} more"
    if len(words) < 2:
        return "".join(words)
    return f"{', '.join(words[:-1])} and {words[-1]}"
