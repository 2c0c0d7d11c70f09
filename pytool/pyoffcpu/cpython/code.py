"""Code objects read from a live target: qualified name, file, line table.

BPF records (code object address, instruction offset, stamp) per frame; this
module turns them into (qualname, file, line).  Reads are done as soon as a
stack arrives, so a target that exits keeps its names, and cached by (address,
stamp): a code object's address is reused once it is freed (a module's code
after its import, a function's redefined), so the address alone does not say
which code object a frame ran.  The stamp (bpf/pywalk.c: code_stamp) mixes
the first line, the addresses of the file name, name, qualified name and line
table, and the qualified name's length and first 16 characters, nothing a
code object changes while it lives (StampLayout): the entry of a freed code
object is given for a new one at its address only where all of those are the
same (docs/interpreters.md says what that leaves).  A read whose stamp is not the
frame's found another object there: the frame's code was freed before it
could be read, and is named FREED, never by what lies there now.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..kernel import bpfdefs
from ..kernel.memory import MemoryError_, ProcessMemory
from . import linetable

MAX_STR = 1024
MAX_TABLE = 1 << 20
PEEK_DATA = 120             # a str's or bytes' data read with its header (most names and tables fit)


@dataclass
class CodeInfo:
    name: str           # co_qualname from 3.11, co_name before
    filename: str
    firstlineno: int
    table: bytes        # lnotab / linetable / location table
    firsttraceable: int  # 3.11+: code units before the first traceable instruction
    _lines: object = None   # decoded table, built on first use

    def line_for(self, version: Tuple[int, int], offset: int) -> int:
        """The line of the instruction `offset` bytes into the bytecode; -1: none."""
        if offset < 0:
            return self.firstlineno
        if self._lines is None:
            try:
                self._lines = linetable.LineTable(version, self.table, self.firstlineno)
            except Exception:
                self._lines = False
        if self._lines is False:
            return -1
        line = self._lines.line_for_offset(offset)
        return line if line is not None else -1


# A frame whose code object was freed (and its memory reused) between the
# sample and user space's read: what ran there is not known.
FREED = CodeInfo("[code freed before it was read]", "<unknown>", 0, b"", 0)

_MASK64 = (1 << 64) - 1
_POINTERS = ("code_filename", "code_name", "code_qualname", "code_linetable")


@dataclass(frozen=True)
class StampLayout:
    """What a code object's stamp mixes, for one layout (the code_stamp_*
    and name_stamp_* fields of struct proc_info, bpf/pyoffcpu.h): the word
    of its first line, its pointers to file name, name, qualified name and
    line table, and its qualified name's (the name's before 3.11) length and
    first 16 characters.  A layout that does not fit what BPF reads (an
    unknown build) stamps by the first line's word alone."""
    code_lo: int = 0            # offset of the read in the code object: its first line's word
    ptrs: int = 0               # the file name's pointer, in that read
    words: int = 0              # which of the 4 pointer words are mixed (bit 0: file name)
    name: int = 0               # the qualified name's pointer, in that read
    name_lo: int = 0            # offset of the name's read: its length
    name_state: int = 0         # its state, in that read
    name_text: int = 0          # its text (compact ASCII), in that read
    name_on: int = 0            # 0: the name is read but not mixed

    @classmethod
    def of(cls, o: Dict[str, int]) -> "StampLayout":
        span = bpfdefs.CODE_STAMP_SPAN
        first, filename = o.get("code_firstlineno", -1), o.get("code_filename", -1)
        if first < 0:
            return cls()
        lo = first & ~7
        if filename < lo or filename % 8:
            return cls(lo)
        ptrs, words = filename - lo, 0
        for key in _POINTERS:
            k, rest = divmod(o.get(key, -1) - filename, 8)
            if 0 <= k < 4 and not rest and ptrs + 8 * k + 8 <= span:
                words |= 1 << k
        name_field = o["code_qualname"] if o.get("code_qualname", -1) >= 0 else o.get("code_name", -1)
        n_lo, state, text = o.get("unicode_length", -1), o.get("unicode_state", -1), o.get("ascii_data", -1)
        name_ok = (name_field >= lo and name_field % 8 == 0 and name_field - lo + 8 <= span
                   and 0 <= n_lo < 256 and 0 <= state - n_lo <= 28 and state % 4 == 0
                   and 0 <= text - n_lo and text - n_lo + 16 <= bpfdefs.NAME_STAMP_SPAN)
        if not name_ok:
            return cls(lo, ptrs, words, ptrs)     # reads the file name, mixes none of it
        return cls(lo, ptrs, words, name_field - lo, n_lo, state - n_lo, text - n_lo, 1)

    def fill(self, info) -> None:
        """Into a struct proc_info (ctypes)."""
        info.code_stamp_lo, info.code_stamp_ptrs = self.code_lo, self.ptrs
        info.code_stamp_words, info.code_stamp_name = self.words, self.name
        info.name_stamp_lo, info.name_stamp_state = self.name_lo, self.name_state
        info.name_stamp_text, info.name_stamp_on = self.name_text, self.name_on


def _mix(h: int, w: int) -> int:
    return ((h ^ w) * bpfdefs.CODE_STAMP_PRIME) & _MASK64


def code_fields(o: Dict[str, int]) -> List[Tuple[str, int, str]]:
    """The fields of a code object CodeReader reads, (what, offset, struct
    format), its type first."""
    name = o["code_qualname"] if o["code_qualname"] >= 0 else o["code_name"]
    fields = [("type", o["object_type"], "<Q"), ("name", name, "<Q"), ("file", o["code_filename"], "<Q"),
              ("first", o["code_firstlineno"], "<i"), ("table", o["code_linetable"], "<Q")]
    if o["code_firsttraceable"] >= 0:
        fields.append(("ft", o["code_firsttraceable"], "<i"))
    return fields


def code_span(fields: List[Tuple[str, int, str]]) -> Tuple[int, int]:
    """(lowest offset, end) of code_fields: CodeReader reads that span in
    one read, and a crash capture copies a code object up to its end."""
    return (min(off for _, off, _ in fields),
            max(off + struct.calcsize(fmt) for _, off, fmt in fields))


class CodeReader:
    """Reads PyCodeObjects and str/bytes of one process: of a running one,
    a code object read without BPF's stamp is stamped as it is read; of a
    snapshot (mem.snapshot: a core, a crash capture) nothing is freed
    meanwhile, and the stamp's span may not have been copied: none is read."""

    def __init__(self, mem: ProcessMemory, version: Tuple[int, int], offsets: Dict[str, int],
                 code_type: int = 0):
        self.mem = mem
        self.version = version
        self.o = offsets
        self.code_type = code_type          # &PyCode_Type, 0: do not check
        self.live = not getattr(mem, "snapshot", False)
        self.stamps = StampLayout.of(offsets)
        self.cache: Dict[Tuple[int, int], Optional[CodeInfo]] = {}   # (address, stamp)
        # the code object's fields, read in one span from its lowest (_read_code)
        self.fields = code_fields(offsets)
        self.fields_lo, end = code_span(self.fields)
        self.fields_len = end - self.fields_lo

    def stamp(self, addr: int) -> int:
        """The stamp of the code object at addr now (0: unreadable; always 0
        for a snapshot, whose reads need none)."""
        if not self.live:
            return 0
        lay = self.stamps
        try:
            span = self.mem.read(addr + lay.code_lo, bpfdefs.CODE_STAMP_SPAN)
            word = lambda data, at: struct.unpack_from("<Q", data, at)[0]    # noqa: E731
            s = _mix(bpfdefs.CODE_STAMP_SEED, word(span, 0))
            for k in range(4):
                s = _mix(s, word(span, lay.ptrs + 8 * k) if lay.words >> k & 1 else 0)
            try:
                name = self.mem.read(word(span, lay.name) + lay.name_lo, bpfdefs.NAME_STAMP_SPAN)
            except MemoryError_:
                return s | 1                        # as BPF: the code object's part alone
            length, state = word(name, 0), struct.unpack_from("<I", name, lay.name_state)[0]
            text = lay.name_text
            end = text + length + 1 if lay.name_on and (state >> 5) & 3 == 3 and length < 4096 else 0
            s = _mix(s, length if lay.name_on else 0)
            s = _mix(s, word(name, text) if end >= text + 8 else 0)
            s = _mix(s, word(name, text + 8) if end >= text + 16 else 0)
        except (MemoryError_, struct.error, ValueError):
            return 0
        return s | 1

    def code(self, addr: int, stamp: Optional[int] = None) -> Optional[CodeInfo]:
        """The code object at addr; stamp: BPF's for the frame (None: the
        one there now).  FREED when what lies there is another object."""
        now = None
        if stamp is None:
            stamp = now = self.stamp(addr)
        key = (addr, stamp)
        if key in self.cache:
            return self.cache[key]
        if now is None:
            now = self.stamp(addr) if self.live else stamp
        if now != stamp or (self.live and not stamp):
            return self._gone(stamp, now)
        try:
            info = self._read_code(addr)
        except (MemoryError_, UnicodeDecodeError, struct.error, ValueError):
            info = None
        if info is not None and self.live:
            now = self.stamp(addr)
            if now != stamp:
                return self._gone(stamp, now)   # freed while it was read
        self.cache[key] = info
        return info

    @staticmethod
    def _gone(stamp: int, now: int) -> Optional[CodeInfo]:
        """Not read: FREED where another object lies there now; None where
        nothing is readable (the process exited) or BPF could not read it."""
        return FREED if stamp and now else None

    def _read_code(self, addr: int) -> Optional[CodeInfo]:
        # the fields in one read: they lie within the object's first few
        # hundred bytes, all of it the object's (and all a crash captured)
        lo = self.fields_lo
        span = self.mem.read(addr + lo, self.fields_len)
        f = {k: struct.unpack_from(fmt, span, off - lo)[0] for k, off, fmt in self.fields}
        if self.code_type and f["type"] != self.code_type:
            return None         # not a code object (3.13 shims, a torn read)
        return CodeInfo(self.read_str(f["name"]), self.read_str(f["file"]), f["first"],
                        self.read_bytes(f["table"]), f.get("ft", 0))

    def _peek(self, addr: int, size: int) -> bytes:
        """Up to size bytes at addr, fewer where the memory ends first (b"":
        none): an object's header and its data in one read where it fits."""
        upto = getattr(self.mem, "read_upto", None)
        if upto is not None:
            return upto(addr, size)
        try:
            return self.mem.read(addr, size)
        except MemoryError_:
            return b""

    def read_bytes(self, addr: int) -> bytes:
        o = self.o
        head = self._peek(addr, o["bytes_data"] + PEEK_DATA)
        if len(head) >= o["bytes_size"] + 8:
            size = struct.unpack_from("<q", head, o["bytes_size"])[0]
        else:
            size = self.mem.i64(addr + o["bytes_size"])
        if size < 0 or size > MAX_TABLE:
            raise ValueError("implausible bytes size")
        if len(head) >= o["bytes_data"] + size:
            return bytes(head[o["bytes_data"]:o["bytes_data"] + size])
        return self.mem.read(addr + o["bytes_data"], size) if size else b""

    def read_str(self, addr: int) -> str:
        """A str object, per reference §2.5 (compact ASCII / compact / legacy)."""
        o, m = self.o, self.mem
        head = self._peek(addr, o["ascii_data"] + PEEK_DATA)
        if len(head) >= max(o["unicode_length"] + 8, o["unicode_state"] + 4):
            length = struct.unpack_from("<q", head, o["unicode_length"])[0]
            state = struct.unpack_from("<I", head, o["unicode_state"])[0]
        else:
            length, state = m.i64(addr + o["unicode_length"]), m.u32(addr + o["unicode_state"])
        if length < 0 or length > MAX_STR:
            length = min(max(length, 0), MAX_STR)
        kind = (state >> 2) & 7
        compact = (state >> 5) & 1
        ascii_ = (state >> 6) & 1
        if compact and ascii_:
            if len(head) >= o["ascii_data"] + length:
                return head[o["ascii_data"]:o["ascii_data"] + length].decode("ascii", "replace")
            return m.read(addr + o["ascii_data"], length).decode("ascii", "replace")
        if kind not in (1, 2, 4):
            raise ValueError("bad str kind")
        if compact:
            data_addr = addr + o["compact_data"]
        else:                                   # legacy string: data pointer after the header
            data_addr = m.u64(addr + o["compact_data"])
        raw = m.read(data_addr, length * kind)
        if kind == 1:
            return raw.decode("latin-1")
        return raw.decode("utf-16-le" if kind == 2 else "utf-32-le", "replace")
