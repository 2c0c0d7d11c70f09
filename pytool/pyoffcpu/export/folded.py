"""Collapsed ("folded") stacks: one line per stack, `FRAME;FRAME;... WEIGHT`.

Root first, WEIGHT an integer number of microseconds of wall time (see the
"Output contract" in DESIGN.md).  Identical lines are merged before rounding,
so `threads=False` sums the threads of a process into one line per stack.
"""
from __future__ import annotations

from typing import Dict

from ..profile.model import Profile

# A label must not break the line structure of the format, for a reader that
# splits on any line boundary (str.splitlines: \v, \f, \x1c-\x1e, \x85,
# U+2028, U+2029 too) as for one that splits on \n.
_LINE_BREAKS = str.maketrans({c: " " for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"})


def ns_to_us(ns: int) -> int:
    """Nanoseconds to whole microseconds, rounded half up; any positive time
    is at least 1 so that no stack that happened disappears."""
    if ns <= 0:
        return 0
    return max(1, (ns + 500) // 1000)


def folded_weights(profile: Profile, threads: bool = True,
                   full_paths: bool = False) -> Dict[str, int]:
    """Map each folded stack line (without weight) to its summed weight in ns."""
    merged: Dict[str, int] = {}
    for frames, ns, _on_cpu in profile.labelled_stacks(threads=threads, full_paths=full_paths):
        line = ";".join(label.translate(_LINE_BREAKS) for label, _kind in frames)
        merged[line] = merged.get(line, 0) + ns
    return merged


def render_folded(profile: Profile, threads: bool = True, full_paths: bool = False) -> str:
    merged = folded_weights(profile, threads=threads, full_paths=full_paths)
    out = []
    for line in sorted(merged):
        us = ns_to_us(merged[line])
        if us:
            out.append(f"{line} {us}\n")
    return "".join(out)
