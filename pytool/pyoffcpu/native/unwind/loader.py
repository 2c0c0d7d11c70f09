"""Puts unwind tables into the BPF maps of bpf/unwind.c and reads the
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
COLLECT_S apart found it unused (and every look in between, KEEP_UNUSED_S
long, while slots are plenty): a BPF program that read an entry before
the first look has long finished, and what it wrote is seen by the second.
A slot that is cleared makes a lookup fail (no row: that frame is walked
by frame pointer), never find another file's rows; the kernel frees the
array once no program holds it.

The stacks BPF walked are read back by stacks.py (WalkedStacks, a part of
NativeUnwinder).
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

from .. import helper, symbols
from ..elfcache import ElfCache, default_cache
from ..elffile import load_bias
from ...kernel.bpfdefs import MAX_UNWIND_MAPS, UNWIND_FILE_PENDING
from . import build as B
from . import table as T
from . import walk
from .stacks import WalkedStacks
ROW_SIZE = T.ROW.size
COLLECT_S = 0.5                         # between the two looks that free a table
COLLECT_IDLE_S = 5.0                    # a look even when nothing changed
# A table unused this long goes (sooner when few slots are left): short jobs
# one after another map the same files again at once, and each free costs
# the kernel a grace period (~12 ms here) besides the load that follows
KEEP_UNUSED_S = 10.0
FREES_PER_LOOK = 4                      # ... and a few at a look (the loop waits for each)
LOAD_BYTES = 64 << 20                   # rows put into the kernel per turn of the main loop, at most


def enabled() -> bool:
    return os.environ.get("PYOFFCPU_NATIVE_UNWIND", "1") != "0"


REGS_FIELDS = ("ip", "sp", "bp", "bx", "cs")


def _regs_offsets(btf_path: Optional[str]) -> Optional[Dict[str, int]]:
    """The offsets in struct pt_regs the walk starts from (BTF), or None."""
    from ...kernel.btf import VMLINUX_BTF, BtfError, member_offsets
    try:
        return dict(zip(REGS_FIELDS, member_offsets(btf_path or VMLINUX_BTF,
                                                    [("pt_regs", f) for f in REGS_FIELDS])))
    except (BtfError, OSError):
        return None


def load_consts(btf_path: Optional[str] = None) -> Dict[str, int]:
    """Its load-time constants (bpf/loadconst.h): NATIVE_UNWIND, 0 (frame
    pointers) when it is turned off or BTF lacks pt_regs, and pt_regs's
    offsets (0s where unwinding is off: no instruction reads them then)."""
    offs = _regs_offsets(btf_path)
    return {"NATIVE_UNWIND": int(enabled() and offs is not None),
            **{f"PT_REGS_{f.upper()}_OFF": (offs or {}).get(f, 0) for f in REGS_FIELDS}}


def program_specs(perf: bool = True, switch: bool = True, wake: bool = False) -> List[Tuple[str, int]]:
    """(function, BPF program type) of the finishing programs load_programs
    loads (the session has them loaded with the main programs, in parallel)."""
    from ...kernel.bpfsys import PERF_EVENT, RAW_TRACEPOINT
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


# A file mapping without a table (none could be made, or none fits): BPF walks
# it by frame pointer.  Registered all the same, so that a pc in no
# registered mapping is known to be in anonymous memory: JIT code, which
# ends the walk (see bpf/unwind.c: unwind_step).
_NO_TABLE = _Loaded(-1, 0, 0, 0, 0, "")


@dataclass
class _Waiting:
    """A mapping's file whose table is being made (build.Builds)."""
    id: int                     # in unwind_pending
    name: str


class NativeUnwinder(WalkedStacks):
    """The finishing programs, and with `tables` the unwind tables.  With
    bpf None: tables for user-space walks only (walk_blocked)."""

    def __init__(self, bpf, tables: bool = True, cache: Optional[T.TableCache] = None,
                 elf_cache: Optional[ElfCache] = None, background: Optional[bool] = None):
        """``cache``: unwind tables; ``elf_cache``: the session's parsed ELF
        files (default ``elffile.default_cache()``, shared with the
        symbolizer and the interpreter detection); ``background`` (default:
        with BPF): tables not ready are made while the recording runs
        (build.py) instead of before update() returns."""
        self.bpf = bpf
        self.tables = tables
        self.cache = cache if cache is not None else (T.TableCache() if tables else None)
        self.elf_cache = elf_cache if elf_cache is not None else default_cache()
        if self.cache is not None:
            self.cache.elf_cache = self.elf_cache     # the prologue analysis's symbols
        self._objects: Dict[tuple, Optional[_Loaded]] = {}
        self._tables: Dict[tuple, T.UnwindTable] = {}   # key -> its table (user-space walks)
        self._proc_keys: Dict[int, frozenset] = {}
        self._regions: Dict[int, list] = {}     # pid -> walk.Region list (user-space walks)
        self.notices: List[str] = []
        self._full_noticed = False
        self.stacks_read = 0
        self.procs_full = 0             # processes left without tables: unwind_procs full
        self.tables_freed = 0
        self._procs = self._nstacks = self._files = None
        self._free_slots: List[int] = []
        self._unreferenced: Dict[tuple, float] = {}  # keys no entry referred to -> since (a look's time)
        self._changed = False           # entries written or deleted since the last look
        self._slots_of: Dict[int, set] = {}     # pid -> the slots of the entry user space wrote
        self.copies = False             # BPF copies entries (follow_child): look at them too
        self.kernel_looks = 0
        self._looked = 0.0
        self._misses_seen: Dict[int, int] = {}
        self._misses_checked = 0.0
        self._gen = 0                   # proc_unwind.gen: unique per write
        if background is None:
            background = bpf is not None
        self.builds = B.Builds(self.cache) if background and tables and helper.available() else None
        if tables and not helper.available():       # tables only from the disk cache
            self.notices.append(f"{B.NO_HELPER}: files without a cached table are walked by frame pointer")
        self._exe_of: Dict[int, list] = {}      # pid -> its executable mappings at the last update
        # pid -> which image its regions are of (a new token at exec and after
        # forget): a captured stack is walked with its own image's only
        self._image: Dict[int, int] = {}
        self._tokens = 0
        self._users: Dict[tuple, set] = {}      # file key -> the pids whose entries name it
        self._names: Dict[tuple, str] = {}
        # made, not in the kernel yet: key -> table (None: it has none)
        self._ready: Dict[tuple, Optional[T.UnwindTable]] = {}
        self._wait_id: Dict[tuple, int] = {}    # key -> its id in unwind_pending until it is in
        self._hits: Dict[tuple, int] = {}       # key -> walks that stopped at it (unwind_pending)
        self._entries_of: Dict[int, list] = {}  # pid -> its entries at the last update (force: reused)
        self._fresh: Dict[int, Tuple[List[int], int]] = {}  # stacks take_stacks read, not asked for yet
        self._batched = False           # the last take_stacks emptied nstacks
        self.load_s = 0.0               # time spent putting tables into the kernel
        self._held = False              # entries kept from BPF until its programs are in
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

    def hold_entries(self) -> None:
        """Write no process's entry into BPF until release_entries: while the
        finishing programs are verified, a sample of a process with an entry
        would skip its frame-pointer stack for a walk no program makes."""
        self._held = True

    def release_entries(self) -> None:
        """The finishing programs are in: every entry made meanwhile is written."""
        if not self._held:
            return
        self._held = False
        for pid, exe in list(self._exe_of.items()):
            self.update(pid, exe, force=True)

    def close(self) -> None:
        """The helpers still building stop; the tables stay the kernel's
        until the program's maps go."""
        if self.builds is not None:
            self.builds.close()
            self.notices.extend(self.builds.notices)
            self.builds.notices.clear()

    # -- object files ---------------------------------------------------------
    def _load(self, key: tuple, t: Optional[T.UnwindTable], name: str) -> Optional[_Loaded]:
        if key in self._objects:
            self._unreferenced.pop(key, None)
            return self._objects[key]
        if t is None or not t.nrows:
            self._objects[key] = None       # no table: nothing to load, ever
            return None
        self._tables[key] = t
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
        fd = self._array_of(t, loaded)
        try:
            slot = self._free_slots.pop()
            try:
                self._files[slot] = fd
            except Exception:
                self._free_slots.append(slot)
                raise OSError(errno.ENOSPC, "unwind_files refused it") from None
            return slot
        finally:
            os.close(fd)            # the slot holds the map now

    def _array_of(self, t: T.UnwindTable, loaded: _Loaded) -> int:
        """A new BPF array holding the table (page index, rows); its fd."""
        from ...kernel.bpfsys import BPF_F_INNER_MAP, BPF_F_MMAPABLE, create_array
        index = array.array("I", bytes(8 * (t.npages + 1)))
        index[0::2] = t.pages
        head = index.tobytes()
        fd = create_array("unwind_table", ROW_SIZE, loaded.entries,
                          BPF_F_MMAPABLE | BPF_F_INNER_MAP)
        try:
            size = -(-(len(head) + len(t.rows)) // mmap.PAGESIZE) * mmap.PAGESIZE
            with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
                mm[:len(head)] = head
                mm[len(head):len(head) + len(t.rows)] = t.rows
        except BaseException:
            os.close(fd)
            raise
        finally:
            t.release()             # the kernel has the rows: our copy's pages go back
        return fd

    def _load_many(self, items: List[Tuple[tuple, Optional[T.UnwindTable]]]) -> None:
        """Tables into the kernel, their slots set in one batched update
        (one wait for the programs, not one per slot)."""
        from ...kernel.bpfsys import update_batch
        staged = []                     # (key, loaded, fd)
        for key, t in items:
            name = self._names.get(key, "?")
            if key in self._objects:
                continue
            if t is None or not t.nrows or self._files is None or not self._free_slots:
                self._load(key, t, name)        # the plain path says what goes wrong
                continue
            loaded = _Loaded(-1, t.npages, t.nrows, t.page_shift, t.base, name)
            try:
                fd = self._array_of(t, loaded)
            except OSError as e:
                self.notices.append(f"native unwind table of {name} not loaded ({e.strerror}): "
                                    "walked by frame pointer")
                self._objects[key] = None
                continue
            loaded.slot = self._free_slots.pop()
            self._tables[key] = t
            staged.append((key, loaded, fd))
        if not staged:
            return
        try:
            update_batch(self._files.map_fd, [lo.slot for _, lo, _ in staged], [fd for _, _, fd in staged])
            ok = [True] * len(staged)
        except OSError:                 # a kernel without batch updates of an array of maps
            ok = []
            for _, lo, fd in staged:
                try:
                    self._files[lo.slot] = fd
                    ok.append(True)
                except Exception:
                    ok.append(False)
        for (key, lo, fd), good in zip(staged, ok):
            os.close(fd)
            if good:
                self._objects[key] = lo
            else:
                self._free_slots.append(lo.slot)
                self._tables.pop(key, None)
                self._objects[key] = None
                self.notices.append(f"native unwind table of {lo.name} not loaded (unwind_files "
                                    "refused it): walked by frame pointer")

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
        keep = KEEP_UNUSED_S if len(self._free_slots) > self._files.max_entries // 10 else 0.0
        since = {k: self._unreferenced.get(k, now) for k in unreferenced}
        freed = 0
        due = [k for k, t in since.items() if k in self._unreferenced and now - t >= keep]
        for k in due[:FREES_PER_LOOK] if keep else due:
            del since[k]
            lo = self._objects.pop(k)
            self._tables.pop(k, None)
            try:
                del self._files[lo.slot]
            except KeyError:
                pass
            self._free_slots.append(lo.slot)
            freed += 1
        self.tables_freed += freed
        self._unreferenced = since
        return freed

    def loaded(self) -> List[str]:
        """The files whose tables are in the kernel now."""
        return sorted(lo.name for lo in self._objects.values() if lo is not None and lo.slot >= 0)

    def _entry(self, pid: int, m: symbols.Mapping
               ) -> Optional[Tuple[int, int, int, object, Optional[T.UnwindTable], tuple]]:
        """(start, end, runtime base, where its table is (_Loaded, or
        _Waiting while it is made), table, the file's key) of one executable
        mapping."""
        if m.path == "[vdso]":
            v = self.elf_cache.vdso()
            if v is None:
                return None
            data, info = v
            t = self.cache.get_bytes("[vdso]", data, info.build_id)
            key = ("vdso", info.identity)
            loaded = self._load(key, t, "[vdso]")
        elif m.is_file and not m.is_jit:
            key = ("file", m.path, m.inode)     # until its ELF identity is known
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
                return m.start, m.end, 0, _NO_TABLE, None, key
            try:
                st = os.stat(path)
            except OSError:
                return m.start, m.end, 0, _NO_TABLE, None, key
            info = self.elf_cache.get(path)
            if info is None:
                return m.start, m.end, 0, _NO_TABLE, None, key
            # where its rows are: one copy per file (the same inode, unchanged:
            # every process that maps it shares it), never per build-id, which
            # is what a file claims (T.TableCache.key_for)
            ident = T.file_identity(st)
            key = ("file",) + ident
            self._names.setdefault(key, m.path)
            if key in self._objects:
                loaded = self._load(key, None, m.path)
                t = self._tables.get(key)
            elif key in self._wait_id:
                # being made, or made and not in the kernel yet: asked for once
                return m.start, m.end, 0, _Waiting(self._wait_id[key], m.path), None, key
            elif self.builds is not None:
                ckey = self.cache.key_for(path, info.build_id, st)
                paths = [path] + [c for c in (f"/proc/{pid}/root{m.path}",) if c != path]
                eh_frame = next((sec.size for sec in info.sections if sec.name == ".eh_frame"), 0)
                wid = self._wait_id[key] = self.builds.want(key, ckey, info.build_id, m.path,
                                                            paths, st.st_size, eh_frame, expect=ident)
                return m.start, m.end, 0, _Waiting(wid, m.path), None, key
            else:
                t = self.cache.get(path, info.build_id)
                loaded = self._load(key, t, m.path)
        else:
            return None                 # anonymous memory: not registered (JIT code)
        if loaded is None:
            return m.start, m.end, 0, _NO_TABLE, None, key
        bias = load_bias(m, info.segments)
        if bias is None:
            return m.start, m.end, 0, _NO_TABLE, None, key
        return m.start, m.end, loaded.base + bias, loaded, t, key

    # -- processes ------------------------------------------------------------
    def update(self, pid: int, maps: Iterable[symbols.Mapping], force: bool = False) -> bool:
        """Write the executable mappings of pid; True when they changed (or
        force: a table they wait for is in the kernel now)."""
        if not self.tables:
            return False
        exe = [m for m in maps if "x" in m.perms and (m.is_file or m.path == "[vdso]")]
        key = frozenset((m.start, m.end, m.offset, m.path, m.inode) for m in exe)
        if self._proc_keys.get(pid) == key and not force:
            return False
        unchanged = self._proc_keys.get(pid) == key and pid in self._entries_of
        self._proc_keys[pid] = key
        self._exe_of[pid] = exe
        if pid not in self._image:
            self._tokens += 1
            self._image[pid] = self._tokens
        entries = []
        if unchanged:
            # the same mappings (a table they waited for is in now): only the
            # waiting entries are looked at again
            for m, e in self._entries_of[pid]:
                if e is not None and isinstance(e[3], _Waiting) and e[5] not in self._wait_id:
                    e = self._entry_or_none(pid, m)
                entries.append((m, e))
        else:
            entries = [(m, self._entry_or_none(pid, m)) for m in exe]
        self._entries_of[pid] = entries
        entries = [e for _, e in entries if e is not None]
        for fkey in list(self._users):
            self._users[fkey].discard(pid)
        for e in entries:
            self._users.setdefault(e[5], set()).add(pid)
        # user-space walks: a region whose table is being made stops the walk there
        self._regions[pid] = [(e[0], e[1], e[2], walk.NO_TABLE if e[3] is _NO_TABLE else e[4])
                              for e in entries]
        if len(entries) > MAX_UNWIND_MAPS:
            entries.sort(key=lambda e: -(1 << 40 if isinstance(e[3], _Waiting) else e[3].nrows))
            entries = entries[:MAX_UNWIND_MAPS]
            self.notices.append(f"process {pid}: more than {MAX_UNWIND_MAPS} executable "
                                "mappings; the smallest are walked by frame pointer")
        entries.sort(key=lambda e: e[0])
        if self._procs is None or self._held:
            return True
        leaf = self._procs.Leaf()
        leaf.n = len(entries)
        self._gen += 1
        leaf.gen = self._gen
        for i, (start, end, base, t, _, _) in enumerate(entries):
            me = leaf.maps[i]
            me.start, me.end, me.base = start, end, base & 0xFFFFFFFFFFFFFFFF
            if isinstance(t, _Waiting):
                me.file, me.npages, me.nrows, me.page_shift = UNWIND_FILE_PENDING, t.id, 0, 0
            elif t is _NO_TABLE:
                me.file, me.npages, me.nrows, me.page_shift = 0, 0, 0, 0
            else:
                me.file, me.npages, me.nrows, me.page_shift = t.slot, t.npages, t.nrows, t.page_shift
        self._changed = True
        new = {t.slot for _, _, _, t, _, _ in entries if isinstance(t, _Loaded) and t.slot >= 0}
        try:
            self._procs[self._procs.Key(pid)] = leaf
        except Exception:               # map full (MAX_UNWIND_PROCS): frame pointers
            self.procs_full += 1
            self._slots_of[pid] = self._slots_of.get(pid, set()) | new   # whichever entry it has
            return False
        self._slots_of[pid] = new
        return True

    def _entry_or_none(self, pid: int, m: symbols.Mapping):
        try:
            return self._entry(pid, m)
        except OSError:             # the process is exiting, a file went away
            return None

    # -- tables made in the background (build.py) -------------------------------
    def poll(self, build: bool = True) -> int:
        """A turn of the main loop: what the builds finished goes into the
        kernel (the files stacks stopped at most first; up to LOAD_BYTES,
        the rest at the next turns), with one batched update of their slots,
        and the processes that wait for them are written again; how many
        tables it put in.  build=False: only what the disk cache has (the
        start: a build is for the recording's time, never before it)."""
        b = self.builds
        if b is None or not (b.busy() or self._ready):
            return 0
        if self.bpf is not None and (b.busy() or self._ready):
            hits = self._pending_hits()
            b.hits(hits)
            by_id = {i: k for k, i in self._wait_id.items()}
            for i, n in hits.items():
                if i in by_id:
                    self._hits[by_id[i]] = n
        for key, t in b.step(start=build):
            self._ready[key] = t
        t0 = time.monotonic()
        order = sorted(self._ready, key=lambda k: -self._hits.get(k, 0))
        take, size = [], 0
        for key in order:
            t = self._ready.pop(key)
            if self._users.get(key):
                take.append((key, t))
                size += len(t.rows) if t is not None else 0
            else:
                self._wait_id.pop(key, None)    # no process maps it any more
            if size >= LOAD_BYTES:
                break                   # the rest at the next turn: the loop stays responsive
        if not take:
            return 0
        self._load_many(take)
        waiting: set = set()
        for key, _ in take:
            self._wait_id.pop(key, None)
            waiting |= self._users.get(key, set())
        for pid in waiting:
            if pid in self._exe_of:
                self.update(pid, self._exe_of[pid], force=True)
        self.load_s += time.monotonic() - t0
        self.notices.extend(b.notices)
        b.notices.clear()
        return len(take)

    def build_all(self) -> None:
        """--tables-first: every table wanted now made and in the kernel
        (the helpers run as in the background, several at once; each has its
        own time limit)."""
        while self.builds is not None and (self.builds.busy() or self._ready):
            if not self.poll():
                time.sleep(0.005)

    def _pending_hits(self) -> Dict[int, int]:
        """unwind_pending: the walks that stopped at each waiting file; the
        entries of files no longer waiting are deleted."""
        table = self.bpf["unwind_pending"]
        waiting = set(self._wait_id.values())
        out, stale = {}, []
        for k, v in table.items():
            if k.value in self.builds.by_id or k.value in waiting:
                out[k.value] = v.value
            else:
                stale.append(k)
        for k in stale:
            try:
                del table[k]
            except KeyError:
                pass
        return out

    @property
    def tables_waiting(self) -> int:
        """How many files' tables are still being made (read at every turn)."""
        return len(self._wait_id) if self.builds is not None else 0

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
        with the same tables (bpf/unwind.c cannot see it until it runs)."""
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
            return self.walk_registers(pid, regs[0], regs[1], None, read)
        finally:
            read.close()

    def walk_registers(self, pid: int, pc: int, sp: int, bp: Optional[int], read_u64,
                       bx: Optional[int] = None) -> Optional[Tuple[List[int], int]]:
        """(pcs, flags) walked in user space from these registers with the
        tables of pid's mappings (update()), reading its memory through
        read_u64; None when update() has not seen pid."""
        from . import walk
        regions = self._regions.get(pid)
        return None if regions is None else walk.walk(regions, pc, sp, bp, read_u64, bx)

    def capture_blocked(self, pid: int, tid: int) -> Optional[Tuple[int, int, bytes]]:
        """(pc, sp, the stack from sp up) of a thread blocked right now, to be
        walked later (walk_captured) with the tables ready by then."""
        from . import walk
        if not self.tables:
            return None
        regs = walk.blocked_registers(pid, tid)
        if regs is None or pid not in self._image:
            return None
        data = walk.stack_snapshot(pid, regs[1])
        return None if data is None else (self._image[pid], regs[0], regs[1], data)

    def captured_ready(self, pid: int, cap) -> bool:
        """Every table the capture's process maps is in (or its image is gone)."""
        regions = self._regions.get(pid)
        return self._image.get(pid) != cap[0] or not regions or all(r[3] is not None for r in regions)

    def walk_captured(self, pid: int, cap) -> Optional[Tuple[List[int], int]]:
        """(pcs, flags) of a capture_blocked stack, with the tables in the
        kernel now (a file still being made stops it: NST_PENDING); None
        when its process is another image now (exec, a reused PID)."""
        from . import walk
        regions = self._regions.get(pid)
        token, pc, sp, data = cap
        if not regions or self._image.get(pid, token) != token:
            return None
        return walk.walk(regions, pc, sp, None, walk.snapshot_reader(sp, data))

    def reload(self, pid: int, maps: Iterable[symbols.Mapping]) -> bool:
        """Write pid's mappings again even if they look unchanged (it called
        exec, and BPF dropped its entry)."""
        self._proc_keys.pop(pid, None)
        self._image.pop(pid, None)          # another image
        return self.update(pid, maps)

    def forget(self, pid: int) -> None:
        """pid is gone (or another image): its entry and tables' references
        go; its regions stay for walk_captured, under its image's token."""
        self._proc_keys.pop(pid, None)
        self._image.pop(pid, None)
        self._exe_of.pop(pid, None)
        self._entries_of.pop(pid, None)
        for fkey, pids in list(self._users.items()):
            pids.discard(pid)
            if not pids and fkey in self._wait_id:
                # no process waits for it any more
                del self._wait_id[fkey]
                self._ready.pop(fkey, None)
                if self.builds is not None:
                    self.builds.drop(fkey)
        self._slots_of.pop(pid, None)
        self._changed = True
        if self._procs is None:
            return
        try:
            del self._procs[self._procs.Key(pid)]
        except KeyError:
            pass
