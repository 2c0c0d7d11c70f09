"""Puts unwind tables into the BPF maps of bpf/unwind.h and reads the
native stacks back.

* `cflags()`: the -D the BPF side needs (pt_regs offsets from BTF).
* `NativeUnwinder`: loads the unwinder programs into their tail-call
  arrays, writes each object file's table once into the mmap-ed
  `unwind_rows` array (shared by every process that maps the file), and per
  process the list of its executable mappings into `unwind_procs`, again
  whenever they change (dlopen).  `stack(hash)` returns a walked stack.
"""
from __future__ import annotations

import array
import ctypes
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from .. import symbols
from ..elffile import ElfCache, default_cache, load_bias
from ..bpfdefs import (MAX_NATIVE_DEPTH, MAX_UNWIND_MAPS, NST_FRAMEPOINTER,  # noqa: F401
                       NST_INCOMPLETE, NST_TRUNCATED, NST_UNMAPPED)
from . import table as T
DEFAULT_ROWS = 1 << 21                  # 16 MiB of rows
ROW_SIZE = T.ROW.size


def enabled() -> bool:
    return os.environ.get("PYOFFCPU_NATIVE_UNWIND", "1") != "0"


def rows_capacity() -> int:
    try:
        n = int(os.environ.get("PYOFFCPU_UNWIND_ROWS", DEFAULT_ROWS))
    except ValueError:
        n = DEFAULT_ROWS
    return max(1 << 12, n)


def cflags(btf_path: Optional[str] = None) -> List[str]:
    """-D flags for bpf/unwind.h; [] (unwinding off) when BTF lacks pt_regs."""
    off = ["-DNATIVE_UNWIND=0", "-DUNWIND_ROWS=4096"]
    if not enabled():
        return off
    from ..btf import VMLINUX_BTF, BtfError, member_offsets
    fields = ("ip", "sp", "bp", "cs")
    try:
        offs = dict(zip(fields, member_offsets(btf_path or VMLINUX_BTF,
                                               [("pt_regs", f) for f in fields])))
    except (BtfError, OSError):
        return off
    return ["-DNATIVE_UNWIND=1", f"-DUNWIND_ROWS={rows_capacity()}"] + [
        f"-DPT_REGS_{f.upper()}_OFF={o}" for f, o in offs.items()]


def tables_on(flags: List[str]) -> bool:
    """Do these flags (from cflags()) walk native stacks with .eh_frame tables?"""
    return "-DNATIVE_UNWIND=1" in flags


def program_specs(perf: bool = True, switch: bool = True) -> List[Tuple[str, int]]:
    """(function, BPF program type) of the finishing programs load_programs
    loads (the session has them loaded with the main programs, in parallel)."""
    from ..bpfload import PERF_EVENT, RAW_TRACEPOINT
    # tail calls stay within one program type: sched_switch is a raw tracepoint
    return ([("unwind_perf", PERF_EVENT)] if perf else []) + (
        [("unwind_tp", RAW_TRACEPOINT), ("memo_tp", RAW_TRACEPOINT)] if switch else [])


@dataclass
class _Loaded:
    rows: int                   # first entry in unwind_rows (page index first)
    npages: int
    nrows: int
    page_shift: int
    base: int                   # ELF vaddr of the table's pc 0


class NativeUnwinder:
    """The finishing programs, and with `tables` the unwind tables.  With
    bpf None: tables for user-space walks only (walk_blocked)."""

    def __init__(self, bpf, tables: bool = True, cache: Optional[T.TableCache] = None,
                 elf_cache: Optional[ElfCache] = None):
        """``cache``: unwind tables; ``elf_cache``: the session's parsed ELF
        files (default ``elffile.default_cache()``, shared with the
        symbolizer and the interpreter detection)."""
        self.bpf = bpf
        self.tables = tables
        self.cache = cache if cache is not None else (T.TableCache() if tables else None)
        self.elf_cache = elf_cache if elf_cache is not None else default_cache()
        self.capacity = rows_capacity()
        self._next = 0
        self._objects: Dict[tuple, Optional[_Loaded]] = {}
        self._proc_keys: Dict[int, frozenset] = {}
        self._regions: Dict[int, list] = {}     # pid -> walk.Region list (user-space walks)
        self.notices: List[str] = []
        self._full_noticed = False
        self.stacks_read = 0
        self.procs_full = 0             # processes left without tables: unwind_procs full
        self._mm = None
        self._procs = self._nstacks = None
        self._misses_seen: Dict[int, int] = {}
        self._misses_checked = 0.0
        self._gen = 0                   # proc_unwind.gen: unique per write
        if bpf is None:
            return
        if tables:
            fd = bpf["unwind_rows"].map_fd
            self._mm = mmap.mmap(fd, self.capacity * ROW_SIZE, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        self._procs = bpf["unwind_procs"]
        self._nstacks = bpf["nstacks"]

    def load_programs(self, perf: bool = True, switch: bool = True) -> None:
        """Load the finishing programs into their tail-call slots: those of
        the on-CPU sample (perf) and of sched_switch (switch).  Raises on a
        verifier error: the main programs then finish samples themselves,
        with frame-pointer user stacks."""
        specs = program_specs(perf, switch)
        fds = {name: self.bpf.load_func(name.encode(), kind).fd for name, kind in specs}
        if perf:
            self.bpf["unwind_perf_progs"][ctypes.c_int(0)] = ctypes.c_int(fds["unwind_perf"])
        if switch:
            self.bpf["unwind_tp_progs"][ctypes.c_int(0)] = ctypes.c_int(fds["unwind_tp"])
            self.bpf["unwind_tp_progs"][ctypes.c_int(1)] = ctypes.c_int(fds["memo_tp"])

    def close(self) -> None:
        if self._mm is None:
            return
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass
        self._mm = None

    # -- object files ---------------------------------------------------------
    def _load(self, key: tuple, t: Optional[T.UnwindTable]) -> Optional[_Loaded]:
        if key in self._objects:
            return self._objects[key]
        loaded = None
        if t is not None and t.nrows:
            need = t.npages + 1 + t.nrows
            if self._mm is None:        # user space only: nothing to write
                loaded = _Loaded(0, t.npages, t.nrows, t.page_shift, t.base)
            elif self._next + need > self.capacity:
                if not self._full_noticed:
                    self._full_noticed = True
                    self.notices.append(
                        f"native unwind tables full ({self.capacity} rows): some libraries are "
                        "walked by frame pointer (raise PYOFFCPU_UNWIND_ROWS)")
            else:
                index = array.array("I", bytes(8 * (t.npages + 1)))
                index[0::2] = t.pages
                off = self._next * ROW_SIZE
                blob = index.tobytes() + t.rows
                self._mm[off:off + len(blob)] = blob
                loaded = _Loaded(self._next, t.npages, t.nrows, t.page_shift, t.base)
                self._next += need
        # a table that did not fit is not retried (its rows would not fit later either)
        self._objects[key] = loaded
        return loaded

    def _entry(self, pid: int, m: symbols.Mapping
               ) -> Optional[Tuple[int, int, int, _Loaded, T.UnwindTable]]:
        """(start, end, runtime base, where its table is, table) of one
        executable mapping."""
        if m.path == "[vdso]":
            v = self.elf_cache.vdso()
            if v is None:
                return None
            data, info = v
            t = self.cache.get_bytes("[vdso]", data, info.build_id)
            loaded = self._load(("vdso", info.identity), t)
        elif m.is_file:
            path = None
            for cand in (f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}",
                         f"/proc/{pid}/root{m.path}", m.path):
                try:
                    if os.stat(cand).st_ino == m.inode:
                        path = cand
                        break
                except OSError:
                    continue
            if path is None:
                return None
            info = self.elf_cache.get(path)
            if info is None:
                return None
            # where its rows are: one copy per table (the table cache keys
            # tables by build-id), else per file identity
            key = ("bid", info.build_id) if info.build_id else ("elf", info.identity)
            t = self.cache.get(path, info.build_id)
            loaded = self._load(key, t)
        else:
            return None
        if loaded is None:
            return None
        bias = load_bias(m, info.segments)
        if bias is None:
            return None
        return m.start, m.end, loaded.base + bias, loaded, t

    # -- processes ------------------------------------------------------------
    def update(self, pid: int, maps: Iterable[symbols.Mapping]) -> bool:
        """Write the executable mappings of pid; True when they changed."""
        if not self.tables:
            return False
        exe = [m for m in maps if "x" in m.perms and (m.is_file or m.path == "[vdso]")]
        key = frozenset((m.start, m.end, m.offset, m.path, m.inode) for m in exe)
        if self._proc_keys.get(pid) == key:
            return False
        self._proc_keys[pid] = key
        entries = []
        for m in exe:
            try:
                e = self._entry(pid, m)
            except OSError:             # the process is exiting, a file went away
                e = None
            if e is not None:
                entries.append(e)
        self._regions[pid] = [(e[0], e[1], e[2], e[4]) for e in entries]
        if len(entries) > MAX_UNWIND_MAPS:
            entries.sort(key=lambda e: -e[3].nrows)
            entries = entries[:MAX_UNWIND_MAPS]
            self.notices.append(f"process {pid}: more than {MAX_UNWIND_MAPS} executable "
                                "mappings; the smallest are walked by frame pointer")
        entries.sort(key=lambda e: e[0])
        if self._procs is None:
            return True
        leaf = self._procs.Leaf()
        leaf.n = len(entries)
        self._gen += 1
        leaf.gen = self._gen
        for i, (start, end, base, t, _) in enumerate(entries):
            me = leaf.maps[i]
            me.start, me.end, me.base = start, end, base & 0xFFFFFFFFFFFFFFFF
            me.rows, me.npages, me.nrows, me.page_shift = t.rows, t.npages, t.nrows, t.page_shift
        try:
            self._procs[self._procs.Key(pid)] = leaf
        except Exception:               # map full (1024 processes): frame pointers
            self.procs_full += 1
            return False
        return True

    def missed(self, min_interval: float = 0.1) -> List[int]:
        """Processes whose stacks reached code in no known mapping since the
        last call (at most one look every min_interval seconds): their maps
        should be read again."""
        import time
        now = time.monotonic()
        if self.bpf is None or not self.tables or now - self._misses_checked < min_interval:
            return []
        self._misses_checked = now
        out = []
        for k, v in self.bpf["unwind_misses"].items():
            pid, n = k.value, v.value
            if n != self._misses_seen.get(pid, 0):
                self._misses_seen[pid] = n
                out.append(pid)
        return out

    def walk_blocked(self, pid: int, tid: int) -> Optional[Tuple[List[int], int]]:
        """(pcs, flags) of a thread blocked right now, walked in user space
        with the same tables (bpf/unwind.h cannot see it until it runs)."""
        from . import walk
        regions = self._regions.get(pid)
        regs = walk.blocked_registers(pid, tid) if regions else None
        if regs is None:
            return None
        try:
            read = walk.memory_reader(pid)
        except OSError:
            return None
        try:
            return walk.walk(regions, regs[0], regs[1], None, read)
        finally:
            read.close()

    def reload(self, pid: int, maps: Iterable[symbols.Mapping]) -> bool:
        """Write pid's mappings again even if they look unchanged (it called
        exec, and BPF dropped its entry)."""
        self._proc_keys.pop(pid, None)
        return self.update(pid, maps)

    def sweep(self, known) -> int:
        """Delete the stacks of nstacks that user space already holds (BPF
        adds a stack again each time it walks it after user space took it):
        the map keeps only stacks not read yet.  Returns how many it deleted."""
        if self._nstacks is None:
            return 0
        stale = [k for k in self._nstacks.keys() if k.value in known]
        for k in stale:
            try:
                del self._nstacks[k]
            except KeyError:
                pass
        return len(stale)

    def forget(self, pid: int) -> None:
        self._proc_keys.pop(pid, None)
        self._regions.pop(pid, None)
        if self._procs is None:
            return
        try:
            del self._procs[self._procs.Key(pid)]
        except KeyError:
            pass

    # -- stacks ---------------------------------------------------------------
    def stack(self, h: int, delete: bool = True) -> Optional[Tuple[List[int], int]]:
        """(pcs innermost first, flags) of a walked stack; None if unknown."""
        k = self._nstacks.Key(h)
        try:
            v = self._nstacks[k]
        except KeyError:
            return None
        n = min(v.depth, MAX_NATIVE_DEPTH)
        pcs = list(v.pcs[:n])
        flags = v.flags
        self.stacks_read += 1
        if delete:
            # user space keeps it from now on; BPF re-adds it if it sees it again
            try:
                del self._nstacks[k]
            except KeyError:
                pass
        return pcs, flags
