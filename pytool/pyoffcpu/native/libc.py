"""The target's own C library: where its `struct pthread` keeps the thread id
and the thread-specific data that CPython's autoTSSkey lives in.

BPF finds a thread's PyThreadState as pthread_getspecific(autoTSSkey) would:
at fs_base (x86_64 glibc: the thread's struct pthread) + the offset of
`specific_1stblock` + key*16 + 8.  That offset is a property of the glibc
build, and a process in a container runs its own glibc, not the host's.  So
it is taken from the process's libc: glibc describes its struct pthread for
libthread_db in `_thread_db_*` descriptor symbols ({size in bits, count,
offset} as three u32), and those are read from the mapped libc.  glibc
describes the `specific` array of pointers to the key blocks, not the first
block itself; `specific[0]` points at `specific_1stblock` inside the same
struct, so a live thread gives that offset exactly (`confirm`).

A libc without the descriptors (not glibc, or a static executable) gets
glibc 2.36's layout, and a notice, as before.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..native import symbols
from ..native.elfcache import default_cache
from ..kernel.memory import MemoryError_

KEY_BLOCK = 32                  # PTHREAD_KEY_2NDLEVEL_SIZE: keys in specific_1stblock
KEY_DATA_SIZE = 16              # struct pthread_key_data { uintptr_t seq; void *data; }
DESCRIPTORS = ("_thread_db_pthread_specific", "_thread_db_pthread_tid",
               "_thread_db_sizeof_pthread")


@dataclass(frozen=True)
class ThreadLayout:
    specific_1stblock: int      # offsetof(struct pthread, specific_1stblock)
    tid: int                    # offsetof(struct pthread, tid)
    specific: int = -1          # offsetof(struct pthread, specific) (the pointers), -1: unknown
    size: int = 0               # sizeof(struct pthread), 0: unknown
    source: str = ""            # where the numbers came from


# glibc 2.36 x86_64, measured on this machine (tools/check_glibc_offsets.py).
GLIBC_236 = ThreadLayout(specific_1stblock=0x310, tid=0x2d0, specific=0x510, size=2368,
                         source="glibc 2.36 defaults")


def _is_libc(path: str) -> bool:
    base = os.path.basename(path)
    return base == "libc.so.6" or (base.startswith("libc-") and base.endswith(".so"))


def libc_path(pid: int, maps) -> Optional[Tuple[str, str]]:
    """(path as the process sees it, a path we can open) of its mapped libc."""
    for m in maps:
        if m.path.startswith("/") and _is_libc(m.path):
            for cand in (f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}",
                         f"/proc/{pid}/root{m.path}", m.path):
                if os.path.exists(cand):
                    return m.path, cand
    return None


def thread_layout(pid: int, maps, mem) -> Tuple[ThreadLayout, List[str]]:
    """The struct pthread layout of process `pid`'s libc, read from its
    `_thread_db_*` descriptors in the process's memory; (layout, notices)."""
    found = libc_path(pid, maps)
    if found is None:
        return GLIBC_236, [f"no libc mapped: assuming {GLIBC_236.source}"]
    path, real = found
    syms = default_cache().defined_symbols(real, DESCRIPTORS)
    if len(syms) < len(DESCRIPTORS):
        return GLIBC_236, [f"{path} has no glibc thread descriptors: assuming {GLIBC_236.source}"]
    vals = {}
    try:
        for name, vaddr in syms.items():
            addr = symbols.runtime_address(maps, path, vaddr, elf_path=real)
            vals[name] = struct.unpack("<III", mem.read(addr, 12))
    except (LookupError, OSError, MemoryError_) as e:
        return GLIBC_236, [f"cannot read {path}'s thread descriptors ({e}): "
                           f"assuming {GLIBC_236.source}"]
    specific = vals["_thread_db_pthread_specific"][2]
    tid = vals["_thread_db_pthread_tid"][2]
    size = vals["_thread_db_sizeof_pthread"][0]
    first = specific - KEY_BLOCK * KEY_DATA_SIZE     # declared right before `specific`
    if not (0 < first and specific < size and tid < size):
        return GLIBC_236, [f"{path}'s thread descriptors look wrong (specific {specific}, "
                           f"tid {tid}, size {size}): assuming {GLIBC_236.source}"]
    return ThreadLayout(first, tid, specific, size, source=path), []


def confirm(layout: ThreadLayout, mem, pthread: int) -> Optional[ThreadLayout]:
    """The layout with specific_1stblock as one live thread's `specific[0]`
    says (it points into the thread's own struct pthread); None when the
    thread cannot be read or the pointer is not inside the struct."""
    if layout.specific < 0 or not pthread:
        return None
    try:
        block = mem.u64(pthread + layout.specific)
    except MemoryError_:
        return None
    off = block - pthread
    if not (0 < off and off + KEY_BLOCK * KEY_DATA_SIZE <= (layout.size or 1 << 16)):
        return None
    if off == layout.specific_1stblock:
        return layout
    return ThreadLayout(off, layout.tid, layout.specific, layout.size, layout.source)
