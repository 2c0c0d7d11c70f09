"""The FDE ranges of an .eh_frame (where each function the unwind data
describes begins and ends), read by the rules of helper/symbols.c: every
read bounded by its entry, parsing stopped at the first malformed one.
The function index (symindex.py) names code no symbol covers by them.
ehframe.py (here too) reads the same section for the unwinder's rows, with
the unwinder's rules; tests/test_symbol_index.py checks that both give the
same ranges."""
from __future__ import annotations

from typing import List, Tuple

from pyoffcpu.leb128 import read_sleb, read_uleb

U64_MAX = (1 << 64) - 1


class _Reader:
    """Bounded reads inside one .eh_frame entry (helper/symbols.c's)."""

    __slots__ = ("d", "pos", "end")

    def __init__(self, d: bytes, pos: int, end: int):
        self.d, self.pos, self.end = d, pos, end

    def u8(self) -> int:
        if self.pos >= self.end:
            raise ValueError("past the entry")
        self.pos += 1
        return self.d[self.pos - 1]

    def fixed(self, n: int) -> int:
        if self.end - self.pos < n:
            raise ValueError("past the entry")
        self.pos += n
        return int.from_bytes(self.d[self.pos - n:self.pos], "little")

    def uleb(self) -> int:
        v, self.pos = read_uleb(memoryview(self.d)[:self.end], self.pos)
        return v & U64_MAX

    def sleb(self) -> int:
        v, self.pos = read_sleb(memoryview(self.d)[:self.end], self.pos)
        return v & U64_MAX

    def format(self, enc: int) -> int:
        fmt = enc & 0x0F
        if fmt == 0x01:
            return self.uleb()
        if fmt == 0x09:
            return self.sleb()
        size = {0x00: 8, 0x02: 2, 0x03: 4, 0x04: 8, 0x0A: 2, 0x0B: 4, 0x0C: 8}.get(fmt)
        if size is None:
            raise ValueError("pointer format")
        v = self.fixed(size)
        if fmt in (0x0A, 0x0B) and v >> (8 * size - 1):
            v -= 1 << (8 * size)
        return v & U64_MAX

    def pointer(self, enc: int, section_addr: int) -> int:
        field = section_addr + self.pos
        v = self.format(enc)
        app = enc & 0x70
        if app == 0x10:
            v += field
        elif app not in (0x00, 0x30, 0x50):
            raise ValueError("pointer application")
        return v & U64_MAX


def _entry_at(d: bytes, pos: int) -> Tuple[int, int]:
    """(body, end) of the .eh_frame entry at pos.  Raises ValueError."""
    r = _Reader(d, pos, len(d))
    length = r.fixed(4)
    if length == 0:
        raise ValueError("terminator")
    if length == 0xFFFFFFFF:
        length = r.fixed(8)
    if length > len(d) - r.pos or length < 4:
        raise ValueError("entry past the section")
    return r.pos, r.pos + length


def _cie_encoding(d: bytes, pos: int) -> int:
    """The FDE pointer encoding of the CIE at pos.  Raises ValueError."""
    body, end = _entry_at(d, pos)
    r = _Reader(d, body, end)
    if r.fixed(4) != 0:
        raise ValueError("not a CIE")
    version = r.u8()
    nul = d.find(b"\0", r.pos, end)
    if nul < 0:
        raise ValueError("augmentation string")
    aug = d[r.pos:nul]
    r.pos = nul + 1
    if b"eh" in aug:
        r.pos += 8
    if version >= 4:
        r.pos += 2
    if r.pos > end:
        raise ValueError("past the entry")
    r.uleb()                                        # code alignment
    r.sleb()                                        # data alignment
    if version == 1:
        r.u8()
    else:
        r.uleb()                                    # return address register
    enc = 0                                         # DW_EH_PE_absptr
    if aug[:1] == b"z":
        r.uleb()                                    # augmentation data length
        for ch in aug[1:]:
            if ch == 0x52:                          # R
                enc = r.u8()
            elif ch == 0x4C:                        # L
                r.u8()
            elif ch == 0x50:                        # P
                r.format(r.u8())
            elif ch not in (0x53, 0x42, 0x47):      # S B G
                break
    elif aug not in (b"", b"eh"):
        raise ValueError("augmentation without z")
    return enc


def fde_ranges(data: bytes, section_addr: int) -> List[Tuple[int, int]]:
    """(pc_begin, pc_begin + pc_range) of the FDEs of an .eh_frame at
    ``section_addr``, sorted, one per start (the longest): the rules of
    helper/symbols.c (the CIE's augmentation gives the pointer encoding, as
    unwind/ehframe.py reads it; parsing stops at the first malformed entry)."""
    out = []
    pos = 0
    n = len(data)
    cie_at, cie_enc = -1, -1
    while n - pos >= 4:
        try:
            body, end = _entry_at(data, pos)
            r = _Reader(data, body, end)
            ident = r.fixed(4)
            if ident == 0:
                _cie_encoding(data, pos)
                pos = end
                continue
            if ident > body:
                break
            at = body - ident
            enc = cie_enc if at == cie_at else _cie_encoding(data, at)
            cie_at, cie_enc = at, enc
            begin = r.pointer(enc, section_addr)
            size = r.format(enc)
        except (ValueError, IndexError):
            break
        pos = end
        if size and begin + size <= U64_MAX:
            out.append((begin, begin + size))
    out.sort()
    uniq: List[Tuple[int, int]] = []
    for fr in out:
        if uniq and uniq[-1][0] == fr[0]:
            uniq[-1] = fr
        else:
            uniq.append(fr)
    return uniq
