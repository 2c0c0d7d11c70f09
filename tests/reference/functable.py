"""The functions of an ELF file and its debug file as pyoffcpu names them:
one name per address, chosen by one rule.  The reference the function
index is built to (symindex.py; the compiled helper reproduces it in
helper/symbols.c, and the tests compare the two)."""
from __future__ import annotations

from typing import Sequence

from pyoffcpu.native.elffile import SHN_LORESERVE, STB_GLOBAL, STB_LOCAL, STB_WEAK, ElfFile

_BIND_RANK = {STB_GLOBAL: 0, STB_WEAK: 1, STB_LOCAL: 2}


def function_table(sources: Sequence[ElfFile]
                    ) -> tuple[list[int], list[int], list[str]]:
    """(starts, ends, names) of the functions of a file and its debug file:
    one name per address (global before weak before local, sized before
    unsized, then the shortest, plainest name), unsized ones ending at their
    section's end or at the next function.

    The reference the function index is built to (symindex; the compiled
    helper reproduces it in helper/symbols.c): names are ranked by their raw
    bytes (length, then byte order), which ElfFile's "surrogateescape"
    names give back exactly; for valid UTF-8 that is the order of the
    decoded names."""
    best: dict[int, tuple] = {}
    for image in sources:
        ranges = [(sec.addr, sec.addr + sec.size) for sec in image.sections]   # by index: unsized symbols' ends
        for s in image.function_symbols():
            if s.size:
                end = s.value + s.size
            elif 0 < s.shndx < len(ranges) and s.shndx < SHN_LORESERVE:
                end = ranges[s.shndx][1]
            else:
                end = 0  # unknown: bounded by the next symbol below
            raw = s.name.encode("utf-8", "surrogateescape")
            rank = (_BIND_RANK.get(s.bind, 3), s.size == 0,
                    raw[:1] == b"_", len(raw), raw)
            cur = best.get(s.value)
            if cur is None:
                best[s.value] = (rank, s.name, end)
            else:
                new_end = max(cur[2], end)
                if rank < cur[0]:
                    best[s.value] = (rank, s.name, new_end)
                elif new_end != cur[2]:
                    best[s.value] = (cur[0], cur[1], new_end)
    starts = sorted(best)
    names = []
    ends = []
    for i, start in enumerate(starts):
        _rank, name, end = best[start]
        nxt = starts[i + 1] if i + 1 < len(starts) else None
        if end <= start:  # unsized with no section info
            end = nxt if nxt is not None else start + 1
        elif best[start][0][1] and nxt is not None:
            end = min(end, nxt)  # unsized: stop at the next symbol
        names.append(name)
        ends.append(end)
    return starts, ends, names
