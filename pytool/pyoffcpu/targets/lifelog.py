"""BPF's life log (bpf/life.c): the execs, the forks of followed targets and
the exits, in order, in a ring user space maps and reads without a system
call when nothing is new.  An entry carries its sequence number twice (its
first word and `seq`): one being written, or rewritten while read, is told
apart from a whole one."""
from __future__ import annotations

import ctypes
import mmap
import struct
from typing import List, Optional, Tuple

from ..kernel import bpfdefs


class LifeLog:
    def __init__(self, bpf):
        self.bpf = bpf
        self.seen = 0                   # entries read so far
        self._maps = None               # (total's page, the ring, entries, entry size), at first use

    def read(self) -> Tuple[List[Tuple[int, int, int]], Optional[int]]:
        """(the entries since the last read: (LIFE_*, tgid, arg) in order;
        None, or the total written when entries were lost: the ring went
        round (more than half of it is new), or one was rewritten while
        read; then every process is to be looked at again)."""
        if self._maps is None:
            total, log = self.bpf["life_total"], self.bpf["life_log"]
            size = -(-log.max_entries * ctypes.sizeof(log.Leaf) // mmap.PAGESIZE) * mmap.PAGESIZE
            self._maps = (mmap.mmap(total.map_fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ),
                          mmap.mmap(log.map_fd, size, mmap.MAP_SHARED, mmap.PROT_READ),
                          log.max_entries, ctypes.sizeof(log.Leaf))
        count, log, n, esize = self._maps
        total = struct.unpack_from("<Q", count, 0)[0]
        i = self.seen
        if total == i:
            return [], None             # nothing new: the loop's usual turn
        if total - i > n // 2:
            self.seen = total
            return [], total
        entry = bpfdefs.struct_type("life_event")
        out: List[Tuple[int, int, int]] = []
        while i < total:
            off = (i % n) * esize
            e = entry.from_buffer_copy(log, off)
            if e.seq != i + 1:
                if e.seq == 0 or e.seq <= i:
                    break               # being written: read it at the next look
                self.seen = total       # rewritten: the ring went round
                return out, total
            if struct.unpack_from("<Q", log, off)[0] != e.seq:
                self.seen = total       # rewritten while read
                return out, total
            i += 1
            out.append((e.kind, e.tgid, e.arg))
        self.seen = i
        return out, None
