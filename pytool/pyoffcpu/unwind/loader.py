"""Puts unwind tables into the BPF maps of bpf/unwind.h and reads the
native stacks back.

* `cflags()`: the -D the BPF side needs (pt_regs offsets from BTF).
* `NativeUnwinder`: loads the unwinder programs into their tail-call
  arrays; writes each object file's table once, into a BPF array of its
  own size (mmap-ed, written, put in a slot of `unwind_files`), shared by
  every process that maps the file; per process writes the list of its
  executable mappings into `unwind_procs`, again whenever they change
  (dlopen).  `collect()` frees the tables no process refers to any more.
  `stack(hash)` returns a walked stack.

Freeing is exact by construction.  User space keeps, per process, the
tables of the entry it wrote; BPF only deletes entries (exec, exit, a
reused PID), so no table in use is missing from them, except where BPF copies
a parent's entry to a child it follows (--subprocesses, `copies`): there a
table no written entry uses is freed only if `unwind_procs` itself has no
entry that refers to it.  And a table goes only when two looks at least
COLLECT_S apart found it unused: a BPF program that read an entry before
the first look has long finished, and what it wrote is seen by the second.
A slot that is cleared makes a lookup fail (no row: that frame is walked
by frame pointer), never find another file's rows; the kernel frees the
array once no program holds it.
"""
from __future__ import annotations

import array
import ctypes
import errno
import mmap
import os
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from .. import bpfdefs, symbols
from ..elffile import ElfCache, default_cache, load_bias
from ..bpfdefs import (MAX_NATIVE_DEPTH, MAX_UNWIND_MAPS, NST_FRAMEPOINTER,  # noqa: F401
                       NST_INCOMPLETE, NST_TRUNCATED, NST_UNMAPPED)
from . import table as T
ROW_SIZE = T.ROW.size
COLLECT_S = 0.5                         # between the two looks that free a table
COLLECT_IDLE_S = 5.0                    # a look even when nothing changed


def enabled() -> bool:
    return os.environ.get("PYOFFCPU_NATIVE_UNWIND", "1") != "0"


def cflags(btf_path: Optional[str] = None) -> List[str]:
    """-D flags for bpf/unwind.h; [] (unwinding off) when BTF lacks pt_regs."""
    off = ["-DNATIVE_UNWIND=0"]
    if not enabled():
        return off
    from ..btf import VMLINUX_BTF, BtfError, member_offsets
    fields = ("ip", "sp", "bp", "bx", "cs")
    try:
        offs = dict(zip(fields, member_offsets(btf_path or VMLINUX_BTF,
                                               [("pt_regs", f) for f in fields])))
    except (BtfError, OSError):
        return off
    return ["-DNATIVE_UNWIND=1"] + [
        f"-DPT_REGS_{f.upper()}_OFF={o}" for f, o in offs.items()]


def tables_on(flags: List[str]) -> bool:
    """Do these flags (from cflags()) walk native stacks with .eh_frame tables?"""
    return "-DNATIVE_UNWIND=1" in flags


def program_specs(perf: bool = True, switch: bool = True, wake: bool = False) -> List[Tuple[str, int]]:
    """(function, BPF program type) of the finishing programs load_programs
    loads (the session has them loaded with the main programs, in parallel)."""
    from ..bpfload import PERF_EVENT, RAW_TRACEPOINT
    # tail calls stay within one program type: sched_switch and sched_waking
    # are raw tracepoints
    return ([("unwind_perf", PERF_EVENT)] if perf else []) + (
        [("unwind_tp", RAW_TRACEPOINT), ("memo_tp", RAW_TRACEPOINT)] if switch else []) + (
        [("unwind_wake", RAW_TRACEPOINT), ("memo_wake", RAW_TRACEPOINT)] if wake else [])


@dataclass
class _Loaded:
    slot: int                   # in unwind_files (-1: user space only)
    npages: int
    nrows: int
    page_shift: int
    base: int                   # ELF vaddr of the table's pc 0
    name: str                   # the file, for notices and tests

    @property
    def entries(self) -> int:   # the page index, then the rows
        return self.npages + 1 + self.nrows


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
        if self.cache is not None:
            self.cache.elf_cache = self.elf_cache     # the prologue analysis's symbols
        self._objects: Dict[tuple, Optional[_Loaded]] = {}
        self._proc_keys: Dict[int, frozenset] = {}
        self._regions: Dict[int, list] = {}     # pid -> walk.Region list (user-space walks)
        self.notices: List[str] = []
        self._full_noticed = False
        self.stacks_read = 0
        self.procs_full = 0             # processes left without tables: unwind_procs full
        self.tables_freed = 0
        self._procs = self._nstacks = self._files = None
        self._free_slots: List[int] = []
        self._unreferenced: set = set()     # keys no entry referred to at the last look
        self._changed = False           # entries written or deleted since the last look
        self._slots_of: Dict[int, set] = {}     # pid -> the slots of the entry user space wrote
        self.copies = False             # BPF copies entries (follow_child): look at them too
        self.kernel_looks = 0
        self._looked = 0.0
        self._misses_seen: Dict[int, int] = {}
        self._misses_checked = 0.0
        self._gen = 0                   # proc_unwind.gen: unique per write
        if bpf is None:
            return
        if tables:
            self._files = bpf["unwind_files"]
            self._free_slots = list(range(self._files.max_entries - 1, -1, -1))
        self._procs = bpf["unwind_procs"]
        self._nstacks = bpf["nstacks"]

    def load_programs(self, perf: bool = True, switch: bool = True, wake: bool = False) -> None:
        """Load the finishing programs into their tail-call slots: those of
        the on-CPU sample (perf), of sched_switch (switch) and of --wakers'
        sched_waking (wake).  Raises on a verifier error: the main programs
        then finish samples themselves, with frame-pointer user stacks."""
        specs = program_specs(perf, switch, wake)
        fds = {name: self.bpf.load_func(name.encode(), kind).fd for name, kind in specs}
        if perf:
            self.bpf["unwind_perf_progs"][ctypes.c_int(0)] = ctypes.c_int(fds["unwind_perf"])
        if switch:
            self.bpf["unwind_tp_progs"][ctypes.c_int(0)] = ctypes.c_int(fds["unwind_tp"])
            self.bpf["unwind_tp_progs"][ctypes.c_int(1)] = ctypes.c_int(fds["memo_tp"])
        if wake:
            self.bpf["unwind_wake_progs"][ctypes.c_int(0)] = ctypes.c_int(fds["unwind_wake"])
            self.bpf["unwind_wake_progs"][ctypes.c_int(1)] = ctypes.c_int(fds["memo_wake"])

    def close(self) -> None:
        """The tables stay the kernel's until the program's maps go."""

    # -- object files ---------------------------------------------------------
    def _load(self, key: tuple, t: Optional[T.UnwindTable], name: str) -> Optional[_Loaded]:
        if key in self._objects:
            self._unreferenced.discard(key)
            return self._objects[key]
        if t is None or not t.nrows:
            self._objects[key] = None       # no table: nothing to load, ever
            return None
        loaded = _Loaded(-1, t.npages, t.nrows, t.page_shift, t.base, name)
        if self._files is not None:     # else user space only: nothing to write
            if not self._free_slots:
                if not self._full_noticed:
                    self._full_noticed = True
                    self.notices.append(
                        f"native unwind tables: more than {self._files.max_entries} files at "
                        "once; the others are walked by frame pointer")
                return None             # tried again when a process maps it later
            try:
                loaded.slot = self._write(t, loaded)
            except OSError as e:
                self.notices.append(f"native unwind table of {name} not loaded ({e.strerror}): "
                                    "walked by frame pointer")
                self._objects[key] = None
                return None
        self._objects[key] = loaded
        return loaded

    def _write(self, t: T.UnwindTable, loaded: _Loaded) -> int:
        """A BPF array of exactly the table's entries, written through mmap,
        in a free slot of unwind_files; the slot."""
        from ..bpfload import BPF_F_INNER_MAP, BPF_F_MMAPABLE, create_array
        index = array.array("I", bytes(8 * (t.npages + 1)))
        index[0::2] = t.pages
        blob = index.tobytes() + t.rows
        fd = create_array("unwind_table", ROW_SIZE, loaded.entries,
                          BPF_F_MMAPABLE | BPF_F_INNER_MAP)
        try:
            size = -(-len(blob) // mmap.PAGESIZE) * mmap.PAGESIZE
            with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
                mm[:len(blob)] = blob
            slot = self._free_slots.pop()
            try:
                self._files[slot] = fd
            except Exception:
                self._free_slots.append(slot)
                raise OSError(errno.ENOSPC, "unwind_files refused it") from None
            return slot
        finally:
            os.close(fd)            # the slot holds the map now

    def collect(self, force: bool = False) -> int:
        """Free the tables that no process's entry refers to, at two looks
        COLLECT_S apart (see the module's doc); returns how many it freed."""
        if self._files is None:
            return 0
        now = time.monotonic()
        busy = self._changed or self._unreferenced or force
        if now - self._looked < COLLECT_S or not (busy or self.copies and
                                                  now - self._looked >= COLLECT_IDLE_S):
            return 0
        self._looked, self._changed = now, False
        used = set().union(*self._slots_of.values())
        unreferenced = {k for k, lo in self._objects.items()
                        if lo is not None and lo.slot >= 0 and lo.slot not in used}
        if unreferenced and self.copies:
            self.kernel_looks += 1
            referenced = set()
            for _, v in self._procs.items():
                referenced.update(v.maps[i].file for i in range(min(v.n, MAX_UNWIND_MAPS)))
            unreferenced = {k for k in unreferenced if self._objects[k].slot not in referenced}
        freed = 0
        for k in unreferenced & self._unreferenced:
            lo = self._objects.pop(k)
            try:
                del self._files[lo.slot]
            except KeyError:
                pass
            self._free_slots.append(lo.slot)
            freed += 1
        self.tables_freed += freed
        self._unreferenced = unreferenced - self._unreferenced
        return freed

    def loaded(self) -> List[str]:
        """The files whose tables are in the kernel now."""
        return sorted(lo.name for lo in self._objects.values() if lo is not None and lo.slot >= 0)

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
            loaded = self._load(("vdso", info.identity), t, "[vdso]")
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
            loaded = self._load(key, t, m.path)
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
            me.file, me.npages, me.nrows, me.page_shift = t.slot, t.npages, t.nrows, t.page_shift
        self._changed = True
        new = {t.slot for _, _, _, t, _ in entries if t.slot >= 0}
        try:
            self._procs[self._procs.Key(pid)] = leaf
        except Exception:               # map full (MAX_UNWIND_PROCS): frame pointers
            self.procs_full += 1
            self._slots_of[pid] = self._slots_of.get(pid, set()) | new   # whichever entry it has
            return False
        self._slots_of[pid] = new
        return True

    @property
    def rows_loaded(self) -> int:
        """Entries of the tables in the kernel now."""
        return sum(lo.entries for lo in self._objects.values() if lo is not None and lo.slot >= 0)

    def missed(self, min_interval: float = 0.1) -> List[int]:
        """Processes whose stacks reached code in no known mapping since the
        last call (at most one look every min_interval seconds): their maps
        should be read again."""
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
        self._slots_of.pop(pid, None)
        self._changed = True
        if self._procs is None:
            return
        try:
            del self._procs[self._procs.Key(pid)]
        except KeyError:
            pass

    # -- stacks ---------------------------------------------------------------
    def stack(self, h: int, delete: bool = True) -> Optional[Tuple[List[int], int]]:
        """(pcs innermost first, flags) of a walked stack; None if unknown
        (flags: NST_* and, from bit 32, the frames of each method)."""
        k = self._nstacks.Key(h)
        try:
            v = self._nstacks[k]
        except KeyError:
            return None
        n = min(v.depth, MAX_NATIVE_DEPTH)
        pcs = list(v.pcs[:n])
        flags = bpfdefs.with_methods(v.flags, list(v.methods))
        self.stacks_read += 1
        if delete:
            # user space keeps it from now on; BPF re-adds it if it sees it again
            try:
                del self._nstacks[k]
            except KeyError:
                pass
        return pcs, flags
