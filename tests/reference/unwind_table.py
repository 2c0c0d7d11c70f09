"""The Python reference of the compiled helper's `table` command
(pytool/pyoffcpu/native/helper/tables.c): the same unwind table from an ELF
file's .eh_frame (reference/ehframe.py) and from prologue analysis
(reference/prologue.py).  The product runs the helper alone; the tests
hold it to these bytes (test_helper_tables.py) and read rows from here
where a test builds a table from parts."""
from __future__ import annotations

import array
from typing import Iterable, List, Optional, Tuple

from pyoffcpu.native.elffile import section_bytes
from pyoffcpu.native.unwind.table import (MAX_ROWS_PER_PAGE, MIN_PAGE_SHIFT, PAGE, PAGE_SHIFT,
                                          RBP_AT_RBP, RBP_LOST, ROW, UR_DERIVED, UR_DRAP, UR_END,
                                          UR_INVALID, UR_PLT, UR_RBP, UR_RSP, UnwindTable,
                                          _max_rows_per_page, max_pages, serialize)

from . import ehframe as E
from . import prologue


def _plt_threshold(expr: bytes) -> Optional[Tuple[int, int]]:
    """(offset, K) for the PLT rule `rsp + off + ((rip & 15) >= K) << 3`."""
    # DW_OP_breg7 sleb off; DW_OP_breg16 0; lit15; and; litK; ge; lit3; shl; plus
    if len(expr) < 11 or expr[0] != 0x77:
        return None
    off, pos = E.read_sleb(expr, 1)
    tail = expr[pos:]
    if (len(tail) == 9 and tail[0:2] == b"\x80\x00" and tail[2] == 0x3F and tail[3] == 0x1A
            and 0x30 <= tail[4] <= 0x4F and tail[5:] == b"\x2a\x33\x24\x22"):
        return off, tail[4] - 0x30
    return None


def _drap_offset(expr: bytes) -> Optional[int]:
    """N of the CFA rule `DW_OP_breg6 N; DW_OP_deref` (the word at rbp + N),
    which GCC emits for a function that realigns its stack."""
    if len(expr) < 3 or expr[0] != 0x76:
        return None
    off, pos = E.read_sleb(expr, 1)
    return off if expr[pos:] == b"\x06" else None


def encode_row(r: E.Row) -> Tuple[int, int, int]:
    """(kind, cfa_off, rbp) of one parsed row."""
    if r.ra[0] == E.UNDEFINED:
        return (UR_END, 0, 0)
    if r.cfa_expr is not None:
        plt = _plt_threshold(r.cfa_expr)
        if plt is not None and -32768 <= plt[0] < 32768 and r.ra == (E.OFFSET, -8):
            return (UR_PLT, plt[0], plt[1])
        drap = _drap_offset(r.cfa_expr)
        if drap is None or not -32768 <= drap < 32768 or r.ra != (E.OFFSET, -8):
            return (UR_INVALID, 0, 0)
        kind, cfa_off = UR_DRAP, drap
    elif r.ra != (E.OFFSET, -8):
        return (UR_INVALID, 0, 0)
    elif r.cfa_reg == E.REG_RSP:
        kind, cfa_off = UR_RSP, r.cfa_off
    elif r.cfa_reg == E.REG_RBP:
        kind, cfa_off = UR_RBP, r.cfa_off
    else:
        return (UR_INVALID, 0, 0)
    if not -32768 <= cfa_off < 32768:
        return (UR_INVALID, 0, 0)
    rk, ro = r.rbp
    if rk == E.SAME:
        rbp = 0
    elif rk == E.OFFSET and ro % 8 == 0 and -127 * 8 <= ro < 0:
        rbp = ro // 8
    elif rk == E.AT_RBP and ro == 0 and kind == UR_DRAP:
        # only where the CFA comes from rbp, so rbp is this frame's own: in
        # the instruction after an epilogue's `pop %rbp` GCC's rule still
        # says "at rbp" of a register that is the caller's already
        rbp = RBP_AT_RBP
    else:
        rbp = RBP_LOST
    return (kind, cfa_off, rbp)


def build_table(fdes: Iterable[E.FdeTable], build_id: Optional[str] = None,
                derived: Iterable[Tuple[int, Tuple[int, int, int]]] = ()) -> UnwindTable:
    """derived: (address, (kind | UR_DERIVED, cfa_off, rbp)) rows of the
    functions no FDE covers (prologue.py), their ends invalid rows."""
    # (loc, priority, encoding): a rule at loc wins over the end marker of the
    # FDE before it (priority 0 < 1).
    entries: List[Tuple[int, int, Tuple[int, int, int]]] = []
    for loc, enc in derived:
        end = (enc[0] & ~UR_DERIVED) == UR_INVALID
        entries.append((loc, 1 if end else 0, enc))
    unsupported = 0
    for fde in fdes:
        for r in fde.rows:
            if fde.pc_begin <= r.loc < fde.pc_end:
                enc = encode_row(r) if not fde.signal_frame else (UR_INVALID, 0, 0)
                if enc[0] == UR_INVALID:
                    unsupported += 1
                entries.append((r.loc, 0, enc))
        entries.append((fde.pc_end, 1, (UR_INVALID, 0, 0)))
    if not entries:
        return UnwindTable(0, b"", array.array("I", [0]), build_id)
    entries.sort(key=lambda e: (e[0], e[1]))
    base = entries[0][0] & ~(PAGE - 1)
    out = bytearray()
    locs: List[int] = []
    last_loc = None
    last_enc = None
    for loc, _prio, enc in entries:
        if loc == last_loc:
            continue                    # an earlier entry at the same loc won
        last_loc = loc
        if enc == last_enc:
            continue
        last_enc = enc
        rel = loc - base
        if rel >= 1 << 32:
            break                       # objects over 4 GiB of code: rest unsupported
        out += ROW.pack(rel, enc[1], enc[0], enc[2])
        locs.append(rel)
    shift = page_shift(locs)
    pages = _page_index(locs, shift)
    return UnwindTable(base, bytes(out), pages, build_id, unsupported, shift)


def page_shift(locs: List[int]) -> int:
    """The page size (log2) of a table's index: 4 KiB pages unless a page
    would hold more rows than the BPF search takes (then smaller pages, down
    to MIN_PAGE_SHIFT), but never more pages than max_pages() allows for its
    rows: the index is sized by what the file holds, not by the address span
    it claims (a 27 KB library with code at 0x40000000 gets a few hundred
    pages, not a quarter million).  A page left with more rows than the
    search takes finds no row there (the walk ends), never a wrong one."""
    cap = max_pages(len(locs))
    last = locs[-1]
    shift = PAGE_SHIFT
    while (last >> shift) + 1 > cap:
        shift += 1                      # ends by 31: rel < 2^32, cap >= 2
    while (shift > MIN_PAGE_SHIFT and (last >> (shift - 1)) + 1 <= cap
           and _max_rows_per_page(_page_index(locs, shift)) > MAX_ROWS_PER_PAGE):
        shift -= 1
    return shift


def _page_index(locs: List[int], shift: int) -> array.array:
    n = len(locs)
    npages = (locs[-1] >> shift) + 1
    pages = array.array("I", bytes(4 * (npages + 1)))
    i = 0
    for p in range(npages):
        start = p << shift
        while i + 1 < n and locs[i + 1] <= start:
            i += 1
        pages[p] = i
    pages[npages] = n - 1
    return pages


def table_from_elf(stream, path: Optional[str] = None, elf_cache=None) -> UnwindTable:
    """The table of an ELF file's .eh_frame (stream: an open binary file),
    with rows from prologue analysis for its functions without CFI (their
    symbols through the session's ElfCache when `path` is given)."""
    from elftools.elf.elffile import ELFFile
    elf = ELFFile(stream)
    if elf["e_machine"] != "EM_X86_64":
        raise E.EhFrameError(f"not x86_64 ({elf['e_machine']})")
    sec = elf.get_section_by_name(".eh_frame")
    fdes = [] if sec is None or sec["sh_type"] == "SHT_NOBITS" else list(
        E.parse_eh_frame(section_bytes(sec), sec["sh_addr"]))
    syms = None
    if path is not None:
        try:
            syms = prologue.function_symbols(path, elf_cache)
        except Exception:               # noqa: BLE001 - read them with pyelftools instead
            syms = None
    derived = prologue.derived_rows(elf, [(f.pc_begin, f.pc_end) for f in fdes], syms) \
        if prologue.enabled() else []
    return build_table(fdes, derived=derived)


def table_bytes(stream, path: Optional[str] = None, elf_cache=None) -> bytes:
    """What the helper's `table` command writes for this ELF file."""
    return serialize(table_from_elf(stream, path, elf_cache))
