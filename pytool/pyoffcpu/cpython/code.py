"""Code objects read from a live target: qualified name, file, line table.

BPF records (code object address, instruction offset) per frame; this module
turns them into (qualname, file, line).  Reads are cached by address, and done
as soon as a stack arrives so a target that exits keeps its names.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..kernel.memory import MemoryError_, ProcessMemory
from . import linetable

MAX_STR = 1024
MAX_TABLE = 1 << 20


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


class CodeReader:
    """Reads PyCodeObjects and str/bytes of one process."""

    def __init__(self, mem: ProcessMemory, version: Tuple[int, int], offsets: Dict[str, int],
                 code_type: int = 0):
        self.mem = mem
        self.version = version
        self.o = offsets
        self.code_type = code_type          # &PyCode_Type, 0: do not check
        self.cache: Dict[int, Optional[CodeInfo]] = {}

    def code(self, addr: int) -> Optional[CodeInfo]:
        if addr in self.cache:
            return self.cache[addr]
        try:
            info = self._read_code(addr)
        except (MemoryError_, UnicodeDecodeError, struct.error, ValueError):
            info = None
        self.cache[addr] = info
        return info

    def _read_code(self, addr: int) -> Optional[CodeInfo]:
        o, m = self.o, self.mem
        if self.code_type and m.u64(addr + o["object_type"]) != self.code_type:
            return None         # not a code object (3.13 shims, a torn read)
        name_field = o["code_qualname"] if o["code_qualname"] >= 0 else o["code_name"]
        name = self.read_str(m.u64(addr + name_field))
        filename = self.read_str(m.u64(addr + o["code_filename"]))
        first = m.i32(addr + o["code_firstlineno"])
        table = self.read_bytes(m.u64(addr + o["code_linetable"]))
        ft = m.i32(addr + o["code_firsttraceable"]) if o["code_firsttraceable"] >= 0 else 0
        return CodeInfo(name, filename, first, table, ft)

    def read_bytes(self, addr: int) -> bytes:
        size = self.mem.i64(addr + self.o["bytes_size"])
        if size < 0 or size > MAX_TABLE:
            raise ValueError("implausible bytes size")
        return self.mem.read(addr + self.o["bytes_data"], size) if size else b""

    def read_str(self, addr: int) -> str:
        """A str object, per reference §2.5 (compact ASCII / compact / legacy)."""
        o, m = self.o, self.mem
        length = m.i64(addr + o["unicode_length"])
        if length < 0 or length > MAX_STR:
            length = min(max(length, 0), MAX_STR)
        state = m.u32(addr + o["unicode_state"])
        kind = (state >> 2) & 7
        compact = (state >> 5) & 1
        ascii_ = (state >> 6) & 1
        if compact and ascii_:
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
