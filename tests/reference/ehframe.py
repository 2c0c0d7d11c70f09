"""A small `.eh_frame` reader for x86_64: CIEs, FDEs and the CFA programs,
executed just far enough to know, at every code address, how to find the
caller's frame.

Only three registers matter to the unwinder: the CFA rule (rsp+N, rbp+N,
or an expression), where rbp was saved, and whether the return address is
defined at all (it is undefined in the outermost frames, `_start` and the
thread entry of `clone`).  Everything else is parsed and skipped.

The result is one `FdeTable` per FDE: the rows exactly as
`readelf --debug-dump=frames-interp` prints them (tests compare both), and
unwind_table.py turns them into the sorted table the BPF unwinder searches.
The reference of the compiled helper's helper/ehframe.c.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import List, Optional, Tuple

from pyoffcpu.leb128 import read_sleb, read_uleb     # noqa: F401 - this module's readers too

# x86_64 DWARF register numbers
REG_RBP = 6
REG_RSP = 7
REG_RA = 16

# Rule kinds for a register
SAME = 0            # unchanged (or never mentioned)
OFFSET = 1          # saved at CFA + n
UNDEFINED = 2       # no value (the return address of the outermost frame)
OTHER = 3           # in another register, an expression, val_offset...
AT_RBP = 4          # saved at rbp + n: DW_CFA_expression DW_OP_breg6 n (GCC's stack realignment)

# CFA kinds
CFA_REG = 0         # reg + offset
CFA_EXPR = 1        # DWARF expression (expr holds its bytes)

# DW_EH_PE pointer encodings
PE_OMIT = 0xFF
PE_ABSPTR, PE_ULEB128, PE_UDATA2, PE_UDATA4, PE_UDATA8 = 0x00, 0x01, 0x02, 0x03, 0x04
PE_SLEB128, PE_SDATA2, PE_SDATA4, PE_SDATA8 = 0x09, 0x0A, 0x0B, 0x0C
PE_PCREL, PE_TEXTREL, PE_DATAREL, PE_FUNCREL, PE_ALIGNED = 0x10, 0x20, 0x30, 0x40, 0x50
PE_INDIRECT = 0x80


class EhFrameError(Exception):
    """Malformed .eh_frame data."""


@dataclass(frozen=True)
class Row:
    """The unwind rule in force from `loc` on (until the next row)."""
    loc: int
    cfa_reg: int                # DWARF register of the CFA rule (-1: expression)
    cfa_off: int
    cfa_expr: Optional[bytes]
    rbp: Tuple[int, int]        # (kind, offset)
    ra: Tuple[int, int]


@dataclass
class FdeTable:
    pc_begin: int
    pc_end: int
    rows: List[Row]
    signal_frame: bool = False


@dataclass
class _Cie:
    code_align: int
    data_align: int
    ra_reg: int
    fde_enc: int = PE_ABSPTR
    lsda_enc: int = PE_OMIT
    has_aug_data: bool = False
    signal_frame: bool = False
    initial: bytes = b""
    addr_size: int = 8


_FIXED = {PE_UDATA2: "<H", PE_UDATA4: "<I", PE_UDATA8: "<Q",
          PE_SDATA2: "<h", PE_SDATA4: "<i", PE_SDATA8: "<q", PE_ABSPTR: "<Q"}


def read_encoded(data: bytes, pos: int, enc: int, field_addr: int,
                 data_base: int = 0, value_only: bool = False) -> Tuple[int, int]:
    """Decode a DW_EH_PE pointer at data[pos]; field_addr is its address
    (for pcrel).  value_only: the format without the application (pc_range)."""
    fmt = enc & 0x0F
    if fmt == PE_ULEB128:
        val, npos = read_uleb(data, pos)
    elif fmt == PE_SLEB128:
        val, npos = read_sleb(data, pos)
    else:
        f = _FIXED.get(fmt)
        if f is None:
            raise EhFrameError(f"unsupported pointer encoding {enc:#x}")
        val = struct.unpack_from(f, data, pos)[0]
        npos = pos + struct.calcsize(f)
    if value_only:
        return val, npos
    app = enc & 0x70
    if app == PE_PCREL:
        val += field_addr
    elif app == PE_DATAREL:
        val += data_base
    elif app not in (0, PE_ALIGNED):
        raise EhFrameError(f"unsupported pointer application {enc:#x}")
    return val & 0xFFFFFFFFFFFFFFFF, npos


class _State:
    __slots__ = ("cfa_reg", "cfa_off", "cfa_expr", "rbp", "ra")

    def __init__(self, cfa_reg=REG_RSP, cfa_off=8, cfa_expr=None,
                 rbp=(SAME, 0), ra=(SAME, 0)):
        self.cfa_reg = cfa_reg
        self.cfa_off = cfa_off
        self.cfa_expr = cfa_expr
        self.rbp = rbp
        self.ra = ra

    def copy(self) -> "_State":
        return _State(self.cfa_reg, self.cfa_off, self.cfa_expr, self.rbp, self.ra)

    def row(self, loc: int) -> Row:
        return Row(loc, self.cfa_reg if self.cfa_expr is None else -1, self.cfa_off,
                   self.cfa_expr, self.rbp, self.ra)

    def set_reg(self, reg: int, rule: Tuple[int, int]) -> None:
        if reg == REG_RBP:
            self.rbp = rule
        elif reg == REG_RA:
            self.ra = rule


def _run_program(prog: bytes, cie: _Cie, state: _State, initial: Optional[_State],
                 loc: int, rows: Optional[List[Row]], field_base: int) -> Tuple[_State, int]:
    """Execute CFA instructions.  With rows, record a row before each advance
    (and not for CIE initial instructions)."""
    pos = 0
    n = len(prog)
    stack: List[_State] = []
    caf, daf = cie.code_align, cie.data_align
    while pos < n:
        op = prog[pos]
        pos += 1
        hi = op & 0xC0
        low = op & 0x3F
        if hi == 0x40:                              # advance_loc
            if rows is not None:
                rows.append(state.row(loc))
            loc += low * caf
            continue
        if hi == 0x80:                              # offset
            off, pos = read_uleb(prog, pos)
            state.set_reg(low, (OFFSET, off * daf))
            continue
        if hi == 0xC0:                              # restore
            state.set_reg(low, _initial_rule(initial, low))
            continue
        if op == 0x00:                              # nop
            continue
        if op in (0x02, 0x03, 0x04):                # advance_loc1/2/4
            size = {0x02: 1, 0x03: 2, 0x04: 4}[op]
            delta = int.from_bytes(prog[pos:pos + size], "little")
            pos += size
            if rows is not None:
                rows.append(state.row(loc))
            loc += delta * caf
        elif op == 0x01:                            # set_loc
            new, pos = read_encoded(prog, pos, cie.fde_enc, field_base + pos)
            if rows is not None:
                rows.append(state.row(loc))
            loc = new
        elif op == 0x05:                            # offset_extended
            reg, pos = read_uleb(prog, pos)
            off, pos = read_uleb(prog, pos)
            state.set_reg(reg, (OFFSET, off * daf))
        elif op == 0x06:                            # restore_extended
            reg, pos = read_uleb(prog, pos)
            state.set_reg(reg, _initial_rule(initial, reg))
        elif op == 0x07:                            # undefined
            reg, pos = read_uleb(prog, pos)
            state.set_reg(reg, (UNDEFINED, 0))
        elif op == 0x08:                            # same_value
            reg, pos = read_uleb(prog, pos)
            state.set_reg(reg, (SAME, 0))
        elif op == 0x09:                            # register
            reg, pos = read_uleb(prog, pos)
            _, pos = read_uleb(prog, pos)
            state.set_reg(reg, (OTHER, 0))
        elif op == 0x0A:                            # remember_state
            stack.append(state.copy())
        elif op == 0x0B:                            # restore_state
            if stack:
                # the location is not part of the state
                state = stack.pop()
        elif op == 0x0C:                            # def_cfa
            state.cfa_reg, pos = read_uleb(prog, pos)
            state.cfa_off, pos = read_uleb(prog, pos)
            state.cfa_expr = None
        elif op == 0x0D:                            # def_cfa_register
            state.cfa_reg, pos = read_uleb(prog, pos)
            state.cfa_expr = None
        elif op == 0x0E:                            # def_cfa_offset
            state.cfa_off, pos = read_uleb(prog, pos)
        elif op == 0x0F:                            # def_cfa_expression
            ln, pos = read_uleb(prog, pos)
            state.cfa_expr = bytes(prog[pos:pos + ln])
            pos += ln
        elif op in (0x10, 0x16):                    # expression, val_expression
            reg, pos = read_uleb(prog, pos)
            ln, pos = read_uleb(prog, pos)
            expr = bytes(prog[pos:pos + ln])
            pos += ln
            state.set_reg(reg, _expression_rule(expr) if op == 0x10 else (OTHER, 0))
        elif op == 0x11:                            # offset_extended_sf
            reg, pos = read_uleb(prog, pos)
            off, pos = read_sleb(prog, pos)
            state.set_reg(reg, (OFFSET, off * daf))
        elif op == 0x12:                            # def_cfa_sf
            state.cfa_reg, pos = read_uleb(prog, pos)
            off, pos = read_sleb(prog, pos)
            state.cfa_off = off * daf
            state.cfa_expr = None
        elif op == 0x13:                            # def_cfa_offset_sf
            off, pos = read_sleb(prog, pos)
            state.cfa_off = off * daf
        elif op in (0x14, 0x15):                    # val_offset(_sf)
            reg, pos = read_uleb(prog, pos)
            if op == 0x14:
                _, pos = read_uleb(prog, pos)
            else:
                _, pos = read_sleb(prog, pos)
            state.set_reg(reg, (OTHER, 0))
        elif op == 0x2E:                            # GNU_args_size
            _, pos = read_uleb(prog, pos)
        elif op == 0x2F:                            # GNU_negative_offset_extended
            reg, pos = read_uleb(prog, pos)
            off, pos = read_uleb(prog, pos)
            state.set_reg(reg, (OFFSET, -off * daf))
        else:
            raise EhFrameError(f"unknown CFA instruction {op:#x}")
    return state, loc


def _expression_rule(expr: bytes) -> Tuple[int, int]:
    """The rule of `DW_CFA_expression: REG (EXPR)`: saved at the address EXPR
    computes.  Only `DW_OP_breg6 n` (rbp + n) is followed."""
    if expr and expr[0] == 0x76:
        off, end = read_sleb(expr, 1)
        if end == len(expr):
            return (AT_RBP, off)
    return (OTHER, 0)


def _initial_rule(initial: Optional[_State], reg: int) -> Tuple[int, int]:
    if initial is None:
        return (SAME, 0)
    if reg == REG_RBP:
        return initial.rbp
    if reg == REG_RA:
        return initial.ra
    return (SAME, 0)


def _parse_cie(data: bytes, pos: int, end: int) -> _Cie:
    version = data[pos]
    pos += 1
    aug_end = data.index(b"\0", pos)
    aug = data[pos:aug_end].decode("ascii", "replace")
    pos = aug_end + 1
    addr_size = 8
    if "eh" in aug:
        pos += 8
    if version >= 4:
        addr_size = data[pos]
        pos += 2                                    # address_size, segment_size
    code_align, pos = read_uleb(data, pos)
    data_align, pos = read_sleb(data, pos)
    if version == 1:
        ra_reg = data[pos]
        pos += 1
    else:
        ra_reg, pos = read_uleb(data, pos)
    cie = _Cie(code_align, data_align, ra_reg, addr_size=addr_size)
    if aug.startswith("z"):
        cie.has_aug_data = True
        ln, pos = read_uleb(data, pos)
        aug_data_end = pos + ln
        p = pos
        for ch in aug[1:]:
            if ch == "R":
                cie.fde_enc = data[p]
                p += 1
            elif ch == "L":
                cie.lsda_enc = data[p]
                p += 1
            elif ch == "P":
                penc = data[p]
                p += 1
                _, p = read_encoded(data, p, penc & 0x7F, 0, value_only=True)
            elif ch == "S":
                cie.signal_frame = True
            elif ch in "BG":
                pass
            else:
                break                               # unknown: rest of the data is opaque
        pos = aug_data_end
    elif aug not in ("", "eh"):
        raise EhFrameError(f"CIE augmentation {aug!r} without 'z'")
    cie.initial = bytes(data[pos:end])
    return cie


def parse_eh_frame(data: bytes, section_addr: int) -> List[FdeTable]:
    """Every FDE of an .eh_frame section (at virtual address section_addr)."""
    cies: dict = {}
    cie_states: dict = {}
    out: List[FdeTable] = []
    pos = 0
    n = len(data)
    while pos + 4 <= n:
        start = pos
        length = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        if length == 0:
            # A zero terminator (crtend's); eh_frame of a linked object may
            # still hold more after it only in odd cases: stop.
            break
        if length == 0xFFFFFFFF:
            length = struct.unpack_from("<Q", data, pos)[0]
            pos += 8
        body = pos
        end = body + length
        if end > n:
            raise EhFrameError(f"entry at {start:#x} runs past the section")
        cie_id = struct.unpack_from("<I", data, body)[0]
        p = body + 4
        if cie_id == 0:
            cies[start] = _parse_cie(data, p, end)
            pos = end
            continue
        cie_pos = body - cie_id
        cie = cies.get(cie_pos)
        if cie is None:
            # CIEs normally come first; parse it where it is.
            ln = struct.unpack_from("<I", data, cie_pos)[0]
            cie = cies[cie_pos] = _parse_cie(data, cie_pos + 8, cie_pos + 4 + ln)
        pc_begin, p = read_encoded(data, p, cie.fde_enc, section_addr + p)
        pc_range, p = read_encoded(data, p, cie.fde_enc, 0, value_only=True)
        if cie.has_aug_data:
            ln, p = read_uleb(data, p)
            p += ln
        prog = data[p:end]
        pos = end
        if pc_range == 0:
            continue
        initial = cie_states.get(cie_pos)
        if initial is None:
            initial = cie_states[cie_pos] = _run_program(
                cie.initial, cie, _State(), None, pc_begin, None, 0)[0]
        rows: List[Row] = []
        state, loc = _run_program(prog, cie, initial.copy(), initial, pc_begin, rows,
                                  section_addr + p)
        # The row in force at the end of the program covers the rest of the FDE.
        rows.append(state.row(loc))
        out.append(FdeTable(pc_begin, pc_begin + pc_range, _dedupe(rows), cie.signal_frame))
    return out


def _dedupe(rows: List[Row]) -> List[Row]:
    """Drop rows that an advance of zero made redundant (same loc: the later
    wins)."""
    out: List[Row] = []
    for r in rows:
        if out and out[-1].loc == r.loc:
            out[-1] = r
        else:
            out.append(r)
    return out
