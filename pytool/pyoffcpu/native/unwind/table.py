"""Compact unwind tables: what the BPF unwinder (bpf/unwind.c) searches.

One table per object file: rows sorted by code address, each 8 bytes
(`struct unwind_row` in bpf/unwind.c), the rule from that address on:

    u32 pc        address - table base (base: the lowest FDE address, page aligned)
    s16 cfa_off   CFA = rsp/rbp + cfa_off
    u8  kind      UR_INVALID / UR_RSP / UR_RBP / UR_PLT / UR_END, UR_DRAP (CFA = the
                  word at rbp + cfa_off), UR_RBX (CFA = rbx + cfa_off, leaf only)
    s8  rbp       rbp saved at CFA + 8*rbp (< 0), 0: unchanged, RBP_LOST: unknown,
                  RBP_AT_RBP: the word at this frame's rbp;
                  for UR_PLT: the threshold K of the PLT rule
                  CFA = rsp + cfa_off + ((pc & 15) >= K ? 8 : 0)

Gaps between FDEs are UR_INVALID rows.  A page index speeds the search up:
pages[i] is the index of the row in force at base + i * PAGE (the BPF side
searches rows pages[i] .. pages[i+1]).
"""
from __future__ import annotations

import array
import hashlib
import mmap
import os
import struct
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ...kernel import bpfdefs
from ... import cachedir
from ..elfcache import STAT_SETTLED_NS

# the row kinds and limits BPF reads them with (bpf/unwind_defs.h)
UR_INVALID, UR_RSP, UR_RBP, UR_PLT, UR_END, UR_DRAP, UR_RBX, UR_DERIVED = (
    bpfdefs.value(n) for n in ("UR_INVALID", "UR_RSP", "UR_RBP", "UR_PLT", "UR_END", "UR_DRAP",
                               "UR_RBX", "UR_DERIVED"))
RBP_LOST, RBP_AT_RBP = bpfdefs.value("RBP_LOST"), bpfdefs.value("RBP_AT_RBP")
PAGE_SHIFT = 12
PAGE = 1 << PAGE_SHIFT
# struct unwind_row; rbp is written signed into its unsigned char (BPF reads it as signed char)
ROW = struct.Struct("<IhBb")
SEARCH_STEPS = bpfdefs.value("UNWIND_SEARCH_STEPS")    # halvings the BPF search does
MAX_ROWS_PER_PAGE = 1 << SEARCH_STEPS
MIN_PAGE_SHIFT = 6
MAX_PAGE_SHIFT = 31                 # BPF: rel >> (page_shift & 31)
PAGES_PER_ROW, MIN_PAGES = 4, 256   # max_pages()

KIND_NAMES = {UR_INVALID: "invalid", UR_RSP: "rsp", UR_RBP: "rbp", UR_PLT: "plt", UR_END: "end",
              UR_DRAP: "drap", UR_RBX: "rbx"}
# (UR_DERIVED may be or-ed into a row's kind: from a prologue, not an FDE)


@dataclass
class UnwindTable:
    base: int                   # ELF virtual address of pc 0
    rows: bytes                 # nrows * ROW.size
    pages: array.array          # 'I', npages + 1 entries
    build_id: Optional[str] = None
    unsupported: int = 0        # FDE rows the unwinder cannot follow (expressions...)
    page_shift: int = PAGE_SHIFT
    mapped: object = None       # the mmap rows is a view of (deserialize(copy=False))

    def release(self) -> None:
        """Give the pages of a mapped table back to the kernel (they are read
        again from its file if a lookup needs them): once BPF has its copy,
        pyoffcpu's memory does not hold a library's rows."""
        if self.mapped is not None:
            try:
                self.mapped.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError, AttributeError):
                pass

    @property
    def nrows(self) -> int:
        return len(self.rows) // ROW.size

    @property
    def npages(self) -> int:
        return len(self.pages) - 1

    def row(self, i: int) -> Tuple[int, int, int, int]:
        return ROW.unpack_from(self.rows, i * ROW.size)

    def lookup(self, vaddr: int) -> Tuple[int, int, int, int]:
        """The row for an ELF virtual address, as the BPF side finds it:
        (pc, cfa_off, kind, rbp); kind UR_INVALID when none."""
        rel = vaddr - self.base
        if rel < 0 or self.nrows == 0:
            return (0, 0, UR_INVALID, 0)
        p = rel >> self.page_shift
        if p >= self.npages:
            lo = hi = self.nrows - 1
        else:
            lo, hi = self.pages[p], self.pages[p + 1]
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if self.row(mid)[0] <= rel:
                lo = mid
            else:
                hi = mid - 1
        r = self.row(lo)
        if r[0] > rel:
            return (0, 0, UR_INVALID, 0)
        return r

    def max_rows_per_page(self) -> int:
        return _max_rows_per_page(self.pages)


def max_pages(nrows: int) -> int:
    """The most index entries a table of nrows rows gets (helper/tables.c
    the same): 4 per row and 256 more, so the index costs the kernel at most
    four times the rows' own memory and 2 KiB."""
    return PAGES_PER_ROW * nrows + MIN_PAGES


def _max_rows_per_page(pages: array.array) -> int:
    return max((pages[i + 1] - pages[i] + 1 for i in range(len(pages) - 1)), default=0)


# ---------------------------------------------------------------------------
# ELF files and the on-disk cache
# ---------------------------------------------------------------------------
MAGIC = b"PYOFFUW2"
_HDR = struct.Struct("<8sQIIII")       # magic, base, nrows, npages, unsupported, page shift


def prologue_enabled() -> bool:
    """Prologue analysis (the helper's, for code without CFI) is on unless
    PYOFFCPU_PROLOGUE=0 (for measuring what it costs and buys: make bench
    case 14) or the helper has no capstone to decode with."""
    from .. import helper
    return os.environ.get("PYOFFCPU_PROLOGUE", "1") != "0" and helper.capstone_lib() is not None


def _variant() -> str:
    """What else a cached table depends on: tables built without prologue
    analysis are cached apart, and so are those that another capstone
    decoded (its text is what the analysis reads)."""
    if not prologue_enabled():
        return "noprologue:"
    from .. import helper
    return f"capstone-{helper.capstone_version() or 'unknown'}:"


def serialize(t: UnwindTable) -> bytes:
    pages = t.pages if sys.byteorder == "little" else array.array("I", t.pages)
    if sys.byteorder != "little":
        pages.byteswap()
    return (_HDR.pack(MAGIC, t.base, t.nrows, t.npages, t.unsupported, t.page_shift)
            + bytes(t.rows) + pages.tobytes())


def deserialize(data, copy: bool = True) -> UnwindTable:
    """The table serialize() wrote, checked.  copy=False: its rows stay a
    view of `data` (an mmap of the cache file: pages the kernel loads when
    read, and drops again with UnwindTable.release)."""
    if len(data) < _HDR.size:
        raise ValueError("short unwind table")
    magic, base, nrows, npages, unsupported, shift = _HDR.unpack_from(data, 0)
    if magic != MAGIC:
        raise ValueError("not an unwind table")
    rows_end = _HDR.size + nrows * ROW.size
    if len(data) != rows_end + 4 * (npages + 1):
        raise ValueError("unwind table of the wrong size")
    pages = array.array("I")
    pages.frombytes(data[rows_end:])
    if sys.byteorder != "little":
        pages.byteswap()
    if nrows and (max(pages) >= nrows or pages[npages] != nrows - 1):
        raise ValueError("corrupt unwind table page index")
    if not MIN_PAGE_SHIFT <= shift <= MAX_PAGE_SHIFT or npages > max_pages(nrows):
        raise ValueError("bad page shift")
    rows = bytes(data[_HDR.size:rows_end]) if copy else memoryview(data)[_HDR.size:rows_end]
    t = UnwindTable(base, rows, pages, None, unsupported, shift)
    if not copy:
        t.mapped = data
    return t


def default_cache_dir() -> Optional[str]:
    return cachedir.cache_dir("unwind")


_safe_dir = cachedir.safe_dir


def build_args() -> List[str]:
    """The helper's command line for a file's serialized table (its
    `table` command writes it to standard output)."""
    return ["table"] + ([] if prologue_enabled() else ["--no-prologue"])


UNSETTLED_KEY = "unsettled-"        # a TableCache key that is never on disk


def file_identity(st: os.stat_result) -> tuple:
    """Which file a stat is of, and unchanged: (device, inode, size, mtime,
    ctime).  Two files never share it; a file that is written to gets
    another (the kernel sets ctime, no user can), once settled()."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def settled(st: os.stat_result) -> bool:
    """File times have a clock tick's grain: a file changed less than
    STAT_SETTLED_NS ago could be written again keeping its ctime, so its
    identity holds only for now (shared within the recording, where a
    library rewritten in place breaks its own users anyway), not on disk."""
    return time.time_ns() - st.st_ctime_ns > STAT_SETTLED_NS


def build_now(path: str, expect: Optional[tuple] = None) -> UnwindTable:
    """A file's table, built now, in a helper process; expect: the file_identity the file must have when the
    helper opens it (a path swapped meanwhile: no table).  Raises
    (helper.HelperError, OSError, ValueError)."""
    from .. import helper
    job = helper.Job(build_args(), path)
    try:
        if expect is not None and file_identity(job.opened) != expect:
            raise helper.HelperError("the file changed while its table was made")
        if not job.wait():
            raise helper.HelperError(job.error or "failed")
        return deserialize(job.output())
    finally:
        job.close()


class TableCache:
    """Tables by file identity, in memory and on disk.

    Key: the file's identity (file_identity; never its build-id, a claim
    the file makes).  Only settled() files reach the disk.  Disk files are
    written atomically and checked on read;
    a table read from disk is an mmap of its file, whose pages the kernel
    holds (UnwindTable.release gives them back once BPF has its copy).
    `get` builds what it lacks at once; the session builds in the
    background instead (build.py) and hands the results to `store`."""

    VERSION = 6                         # 2: rows from prologue analysis (helper/prologue.c); 3: its RBP_LOST;
                                        # 4: UR_DRAP, UR_RBX, RBP_AT_RBP; 5: code no symbol covers
    MAX_FILES = 2048                    # past this, the least recently used half goes

    def __init__(self, directory: Optional[str] = "default"):
        self.dir = default_cache_dir() if directory == "default" else directory
        if self.dir is not None and not _safe_dir(self.dir):
            self.dir = None
        self._mem: dict = {}
        self.elf_cache = None           # the session's ElfCache (None: the default one)
        self.built = 0                  # tables built from ELF this session
        self.loaded = 0                 # tables read from the disk cache

    @staticmethod
    def key_for(path: str, build_id: Optional[str], st: os.stat_result) -> str:
        """The cache key of the file st is the stat of: which file it is
        (device, inode) and that it is unchanged since (size, mtime, and the
        ctime no user can set), never what the file says of itself.  A
        build-id is a claim: a user's library that claims libc's would have
        given libc its table, in this cache, for every process after.
        (Copies of one library at other inodes each get their own entry.)"""
        ident = "file:" + ":".join(map(str, file_identity(st)))
        key = hashlib.sha256(f"v{TableCache.VERSION}:{_variant()}{ident}".encode()).hexdigest()[:32]
        return key if settled(st) else UNSETTLED_KEY + key

    def key_of(self, path: str, build_id: Optional[str]) -> Optional[str]:
        try:
            return self.key_for(path, build_id, os.stat(path))
        except OSError:
            return None

    def path_of(self, key: str) -> Optional[str]:
        """Where the table of key is kept on disk (None: no disk cache, or
        a file changed too recently to be told apart by its stat)."""
        if self.dir is None or key.startswith(UNSETTLED_KEY):
            return None
        return os.path.join(self.dir, key + ".tbl")

    def known(self, key: str) -> bool:
        """Is the table for key (or the fact that there is none) in memory?"""
        return key in self._mem

    def cached(self, key: str, build_id: Optional[str] = None) -> Optional[UnwindTable]:
        """From memory, else from disk (None: not there; see known())."""
        if key in self._mem:
            return self._mem[key]
        t = self._read(key)
        if t is not None:
            self.loaded += 1
            t.build_id = build_id
            self._mem[key] = t
        return t

    def get(self, path: str, build_id: Optional[str]) -> Optional[UnwindTable]:
        """The table of the ELF file at path (None: not an x86_64 ELF or
        unreadable), built now if no cache has it."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = self.key_for(path, build_id, st)
        if key in self._mem:
            return self._mem[key]
        t = self.cached(key, build_id)
        if t is not None:
            return t
        try:
            t = build_now(path, file_identity(st))
        except Exception:               # noqa: BLE001 - any malformed ELF: no table, native stacks by FP
            self._mem[key] = None
            return None
        return self.store(key, t, build_id)

    def store(self, key: str, t: Optional[UnwindTable], build_id: Optional[str]) -> Optional[UnwindTable]:
        """A table built for key (None: the file has none), kept in memory
        and on disk; the table to use (from its cache file when written)."""
        if t is not None:
            self.built += 1
            if self._write(key, t):
                again = self._read(key)
                if again is not None:
                    t = again
            t.build_id = build_id
        self._mem[key] = t
        return t

    def get_bytes(self, name: str, data: bytes, build_id: Optional[str]) -> Optional[UnwindTable]:
        """For in-memory images (the vDSO): kept on disk too, keyed by the
        image's bytes (never by its build-id alone), so that a start does not
        start a helper for it again.  The helper reads the bytes from an
        unnamed in-memory file (helper.memory_file)."""
        from .. import helper
        key = hashlib.sha256(f"v{self.VERSION}:{_variant()}mem:{name}:{build_id}".encode()
                             + hashlib.sha256(data).digest()).hexdigest()[:32]
        if key in self._mem:
            return self._mem[key]
        t = self.cached(key, build_id)
        if t is not None:
            return t
        try:
            with helper.memory_file(name, data) as path:
                t = build_now(path)
        except (OSError, ValueError, helper.HelperError):
            self._mem[key] = None
            return None
        return self.store(key, t, build_id)

    def _read(self, key: str) -> Optional[UnwindTable]:
        path = self.path_of(key)
        if path is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < _HDR.size:
                return None
            t = deserialize(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ), copy=False)
        except (OSError, ValueError, struct.error):
            return None
        finally:
            os.close(fd)
        try:
            os.utime(path)              # recently used: kept by _prune
        except OSError:
            pass
        return t

    def _write(self, key: str, t: UnwindTable) -> bool:
        path = self.path_of(key)
        if path is None:
            return False
        ok = cachedir.write_private(path, serialize(t))
        self._prune()
        return ok

    def _prune(self) -> None:
        try:
            names = [n for n in os.listdir(self.dir) if n.endswith(".tbl")]
            if len(names) <= self.MAX_FILES:
                return
            aged = sorted(names, key=lambda n: os.stat(os.path.join(self.dir, n)).st_mtime)
            for n in aged[:len(aged) - self.MAX_FILES // 2]:
                os.unlink(os.path.join(self.dir, n))
        except OSError:
            pass
