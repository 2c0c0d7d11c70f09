"""The function index of an ELF file: which function holds an address, read
from a file on disk instead of a Python object per symbol.

A torch process maps libraries with half a million function symbols
(``libtorch_cpu.so``: a 12.5 MB ``.symtab``); a profile names a few hundred
addresses in them.  So each file (with its separate debug file) gets an
index, built once by the compiled helper (``pyoffcpu-elf symbols``, see
``helper/symbols.c`` for the rules and the format) and cached on disk; the
symbolizer maps it and binary-searches it, and decodes a name only when an
address asks for it.

The index holds, in address order, every function (start, end, name: one
name per address, chosen by helper/symbols.c's rules) and
every FDE range of ``.eh_frame``: code that no symbol covers (a stripped
library's static functions) is still known to be one function, named by
the start of its FDE.

Format (little-endian; ``SymbolIndex`` checks every offset it reads)::

    header, 64 bytes: magic b"PYOFSYMI", u32 version, u32 0,
                      u64 nfuncs, u64 nfdes, u64 names_size, 24 zero bytes
    u64 starts[nfuncs]        sorted, distinct
    u64 ends[nfuncs]
    u64 name_offsets[nfuncs + 1]   name i: names[name_offsets[i]:name_offsets[i + 1]]
    u64 fde_starts[nfdes]     sorted, distinct
    u64 fde_ends[nfdes]
    names: names_size bytes, the raw symbol names one after another

The helper is the one builder; tests/reference/symbol_index.py makes the
same bytes in Python, and the tests hold the helper to them.  A file the
helper cannot read (ELF32, big-endian, extended section numbering, a
compressed symbol table) and every file where the helper is not built get
an empty index: their frames keep the file's name and offset.
"""
from __future__ import annotations

import array
import bisect
import hashlib
import mmap
import os
import select
import stat
import struct
import sys
import time
from typing import Iterable, List, Optional, Sequence, Tuple

from .. import cachedir
__all__ = ["IdentifiedFile", "SymbolIndex", "index_for", "poll_prefetches", "prefetch"]

MAGIC = b"PYOFSYMI"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIQQQ24x")
U64_MAX = (1 << 64) - 1
# What else a cached index depends on: the format and the rules that fill it
# (bump it when either changes).
CACHE_VERSION = 1
CACHE_KIND = "symbols"
MAX_FILES = 2048                        # past this, the least recently used half goes
HELPER_WALL_S = 60.0                    # libtorch_cpu.so takes 0.3 s


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------
class SymbolIndex:
    """One file's index, over bytes or an mmap of its cache file.

    A buffer that is not a whole index (truncated, another format) gives an
    empty index; inside a valid header, every offset is checked where it is
    used, so a damaged file gives no name (or a wrong one), never an
    exception or a read outside the buffer."""

    __slots__ = ("_buf", "_starts", "_ends", "_noffs", "_fstarts", "_fends", "_names",
                 "nfuncs", "nfdes", "valid", "__weakref__")

    def __init__(self, buf=b""):
        self._buf = buf
        self.nfuncs = self.nfdes = 0
        self.valid = False
        empty = memoryview(b"").cast("Q")
        self._starts = self._ends = self._noffs = self._fstarts = self._fends = empty
        self._names = memoryview(b"")
        try:
            self._open(buf)
        except (ValueError, TypeError, struct.error, OverflowError):
            self.nfuncs = self.nfdes = 0
            self.valid = False

    def _open(self, buf) -> None:
        view = memoryview(buf)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        if len(view) < HEADER.size:
            return
        magic, version, _flags, nfuncs, nfdes, names_size = HEADER.unpack_from(view, 0)
        if magic != MAGIC or version != FORMAT_VERSION:
            return
        arrays = 3 * nfuncs + 1 + 2 * nfdes
        if HEADER.size + 8 * arrays + names_size != len(view):
            return
        words = view[HEADER.size:HEADER.size + 8 * arrays]
        if sys.byteorder == "little":
            q = words.cast("Q")
        else:                                       # (the format is little-endian)
            a = array.array("Q", bytes(words))
            a.byteswap()
            q = memoryview(a)
        self._starts = q[0:nfuncs]
        self._ends = q[nfuncs:2 * nfuncs]
        self._noffs = q[2 * nfuncs:3 * nfuncs + 1]
        self._fstarts = q[3 * nfuncs + 1:3 * nfuncs + 1 + nfdes]
        self._fends = q[3 * nfuncs + 1 + nfdes:]
        self._names = view[HEADER.size + 8 * arrays:]
        self.nfuncs, self.nfdes = nfuncs, nfdes
        self.valid = True

    def __len__(self) -> int:
        return self.nfuncs

    def _name(self, i: int) -> Optional[str]:
        lo, hi = self._noffs[i], self._noffs[i + 1]
        if not lo <= hi <= len(self._names):
            return None
        return bytes(self._names[lo:hi]).decode("utf-8", "replace")

    def lookup(self, vaddr: int) -> Optional[Tuple[str, int]]:
        """(name, start) of the function holding ``vaddr``, None: none."""
        if not self.nfuncs or not 0 <= vaddr <= U64_MAX:
            return None
        i = bisect.bisect_right(self._starts, vaddr) - 1
        if i < 0:
            return None
        start = self._starts[i]
        if not start <= vaddr < self._ends[i]:
            return None
        name = self._name(i)
        return None if name is None else (name, start)

    def fde_start(self, vaddr: int) -> Optional[int]:
        """The start of the FDE covering ``vaddr``, None: none."""
        if not self.nfdes or not 0 <= vaddr <= U64_MAX:
            return None
        i = bisect.bisect_right(self._fstarts, vaddr) - 1
        if i < 0:
            return None
        start = self._fstarts[i]
        return start if start <= vaddr < self._fends[i] else None

    def function_range(self, vaddr: int) -> Optional[Tuple[int, int]]:
        """(start, end) of the function holding ``vaddr``: its symbol's,
        else the FDE's that covers it; None: neither."""
        if self.nfuncs and 0 <= vaddr <= U64_MAX:
            i = bisect.bisect_right(self._starts, vaddr) - 1
            if i >= 0 and self._starts[i] <= vaddr < self._ends[i]:
                return self._starts[i], self._ends[i]
        if self.nfdes and 0 <= vaddr <= U64_MAX:
            i = bisect.bisect_right(self._fstarts, vaddr) - 1
            if i >= 0 and self._fstarts[i] <= vaddr < self._fends[i]:
                return self._fstarts[i], self._fends[i]
        return None

    def entries(self) -> List[Tuple[int, int, str]]:
        """(start, end, name) of every function, in address order (names
        that a damaged index cannot give are left out)."""
        out = []
        for i in range(self.nfuncs):
            name = self._name(i)
            if name is not None:
                out.append((self._starts[i], self._ends[i], name))
        return out

    def fdes(self) -> List[Tuple[int, int]]:
        return list(zip(self._fstarts, self._fends))


# ---------------------------------------------------------------------------
# Made once per file: helper, disk cache, session
# ---------------------------------------------------------------------------
def helper_reads(image) -> bool:
    """Can the helper read this ElfFile as Python does?  Its ELF reader
    takes ELF64 little-endian files with a plain section table (no extended
    numbering), and it leaves compressed symbol tables to Python."""
    if image.elfclass != 64 or not image.little_endian or not image.plain_section_table:
        return False
    for s in image.sections:
        if s.type in ("SHT_SYMTAB", "SHT_DYNSYM") and (
                s.flags & 0x800 or image.sections[s.link].flags & 0x800):
            return False
    return True


def cache_key(identities: Iterable) -> str:
    """The cache file's name: the format, the rules and the FileIdentity of
    the file and of its debug file (caches are keyed by content)."""
    parts = [f"{i.build_id or '-'}:{i.size}:{i.digest}" if i is not None else "none"
             for i in identities]
    return hashlib.sha256(f"symindex v{CACHE_VERSION}.{FORMAT_VERSION}:{'|'.join(parts)}"
                          .encode()).hexdigest()[:32]


def _cache_directory() -> Optional[str]:
    d = cachedir.cache_dir(CACHE_KIND)
    if d is None or not cachedir.safe_dir(d):
        return None
    return d


def _map_file(path: str) -> Optional[SymbolIndex]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < HEADER.size:
            return None
        idx = SymbolIndex(mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not idx.valid:
        return None
    try:
        os.utime(path)                  # recently used: kept by _prune
    except OSError:
        pass
    return idx


def _prune(directory: str) -> None:
    try:
        names = [n for n in os.listdir(directory) if n.endswith(".sym")]
        if len(names) <= MAX_FILES:
            return
        aged = sorted(names, key=lambda n: os.stat(os.path.join(directory, n)).st_mtime)
        for n in aged[:len(aged) - MAX_FILES // 2]:
            os.unlink(os.path.join(directory, n))
    except OSError:
        pass


class IdentifiedFile:
    """A file opened once, with its identity as the session's ElfCache
    computes it: what is then read from it (an index build, a function's
    code) is that identity's file, whatever happens at its path."""

    def __init__(self, elf_cache, path: str):
        from . import helper
        self.fd = helper.open_regular(path)
        try:
            self.f = os.fdopen(self.fd, "rb")
        except BaseException:
            os.close(self.fd)
            raise
        self.identity = elf_cache._identify_open(self.f)

    @property
    def proc_path(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    def read(self, off: int, n: int) -> bytes:
        return os.pread(self.fd, n, off)

    def close(self) -> None:
        self.f.close()


def _wait(job) -> bool:
    """job.wait(), woken the moment the helper exits (a pidfd): Popen.wait
    with a timeout polls, sleeping up to 50 ms past the end of each job."""
    try:
        fd = os.pidfd_open(job.pid)
    except (OSError, AttributeError):
        return job.wait()
    try:
        select.select([fd], [], [], max(0.0, job.wall_limit_s - (time.monotonic() - job.started)))
    except (OSError, ValueError):
        pass
    finally:
        os.close(fd)
    return job.wait()


def _build_with_helper(files: List[IdentifiedFile], directory: Optional[str],
                       key: str) -> Optional[SymbolIndex]:
    from . import helper
    job = helper.Job(["symbols"], files[0].proc_path, [f.proc_path for f in files[1:]],
                     wall_limit_s=HELPER_WALL_S)
    try:
        if not _wait(job):
            return None
        out_fd = job._out.fileno()      # (its output file: copied by the kernel, never read here)
        if directory is not None:
            path = os.path.join(directory, key + ".sym")
            if cachedir.write_private(path, out_fd):
                _prune(directory)
                idx = _map_file(path)
                if idx is not None:
                    return idx
        idx = SymbolIndex(job.output())     # caching off: the job's own (unnamed) file
        return idx if idx.valid else None
    except (OSError, ValueError, helper.HelperError):
        return None
    finally:
        job.close()


class _Prefetch:
    """An index being built in the background (prefetch)."""

    def __init__(self, job, files: List[IdentifiedFile], directory: str, key: str):
        self.job, self.files, self.directory, self.key = job, files, directory, key

    def finish(self, wait: bool) -> bool:
        """Into the cache once the helper is done; False while it runs."""
        if wait:
            _wait(self.job)
        elif self.job.poll() is None:
            return False
        try:
            if self.job.poll():
                path = os.path.join(self.directory, self.key + ".sym")
                if cachedir.write_private(path, self.job._out.fileno()):
                    _prune(self.directory)
        finally:
            self.job.close()
            for f in self.files:
                f.close()
        return True


_INFLIGHT: dict = {}                    # cache key -> _Prefetch
_QUEUED: dict = {}                      # cache key -> (elf_cache, images, paths, memory estimate)
INDEX_PER_SYMTAB = 8                    # an index build's peak RSS: helper.HELPER_BASE + this x its symbol tables


def prefetch(elf_cache, images: Sequence, paths: Sequence[str]) -> bool:
    """Have the index of ``images`` (a file, then maybe its debug file, read
    from ``paths``) built in the background, into the disk cache: the
    session does so for the files its samples land in while it records, so
    that the profile at the end finds them built.  The builds wait their
    turn in helper.BACKGROUND (after the unwind tables, within its memory).
    Nothing when the cache has it, caching is off or there is no helper.
    True when a build is queued or under way now."""
    directory = _cache_directory()
    if directory is None:
        return False
    key = cache_key(im.identity for im in images)
    if key in _INFLIGHT or key in _QUEUED:
        return True
    if os.path.exists(os.path.join(directory, key + ".sym")):
        return False
    from . import helper
    if not helper.available() or not all(helper_reads(im) for im in images):
        return False
    tables = sum(sec.size for im in images for sec in im.sections if sec.name in (".symtab", ".dynsym"))
    _QUEUED[key] = (elf_cache, list(images), list(paths), helper.HELPER_BASE + INDEX_PER_SYMTAB * tables)
    _start_queued(directory)
    return True


def _start_queued(directory: Optional[str]) -> None:
    """Start the queued builds, in order, while the budget has room."""
    from . import helper
    budget = helper.BACKGROUND
    for key, (elf_cache, images, paths, memory) in list(_QUEUED.items()):
        if budget.tables_waiting or not budget.fits(memory):
            return
        del _QUEUED[key]
        files: List[IdentifiedFile] = []
        try:
            for p in paths:
                files.append(IdentifiedFile(elf_cache, p))
            if any(f.identity != im.identity for f, im in zip(files, images)):
                raise OSError("replaced")
            job = helper.Job(["symbols"], files[0].proc_path, [f.proc_path for f in files[1:]],
                             wall_limit_s=HELPER_WALL_S)
        except (OSError, helper.HelperError):
            for f in files:
                f.close()
            continue
        budget.started(job, memory)
        _INFLIGHT[key] = _Prefetch(job, files, directory, key)


def poll_prefetches() -> int:
    """The background builds that ended go into the cache, queued ones
    start; how many are queued or run still."""
    for key, pf in list(_INFLIGHT.items()):
        if pf.finish(wait=False):
            del _INFLIGHT[key]
    if _QUEUED:
        _start_queued(_cache_directory())
    return len(_INFLIGHT) + len(_QUEUED)


def build_for_files(elf_cache, images: Sequence, paths: Sequence[str]) -> SymbolIndex:
    """The index of the ElfFiles ``images`` (a file, then maybe its debug
    file) read from ``paths``: from the disk cache, else built by the
    helper and cached.  Empty when a file is not
    what its ElfFile was made from any more, or cannot be read."""
    directory = _cache_directory()
    key = cache_key(im.identity for im in images)
    _QUEUED.pop(key, None)              # not started yet: built here, now
    pf = _INFLIGHT.pop(key, None)
    if pf is not None:
        pf.finish(wait=True)            # a prefetch of this very index: its result
    if directory is not None:
        idx = _map_file(os.path.join(directory, key + ".sym"))
        if idx is not None:
            return idx
    files: List[IdentifiedFile] = []
    try:
        for p in paths:
            files.append(IdentifiedFile(elf_cache, p))
    except OSError:
        for f in files:
            f.close()
        return SymbolIndex()
    try:
        if any(f.identity != im.identity for f, im in zip(files, images)):
            return SymbolIndex()                    # replaced since: nothing exact to index
        from . import helper
        idx = None
        if helper.available() and all(helper_reads(im) for im in images):
            idx = _build_with_helper(files, directory, key)
        return idx if idx is not None else SymbolIndex()
    finally:
        for f in files:
            f.close()


def build_for_image(image, data: bytes) -> SymbolIndex:
    """The index of an in-memory image (the vDSO), by the helper from an
    unnamed in-memory file holding it (not cached: it is small)."""
    from . import helper
    if not helper.available() or not helper_reads(image):
        return SymbolIndex()
    try:
        with helper.memory_file("image", data) as path:
            idx = SymbolIndex(helper.run(["symbols"], path, wall_limit_s=HELPER_WALL_S))
    except (OSError, ValueError, helper.HelperError):
        return SymbolIndex()
    return idx if idx.valid else SymbolIndex()


def index_for(elf_cache, images: Sequence, paths: Optional[Sequence[str]] = None,
              data: Optional[bytes] = None) -> SymbolIndex:
    """The session's index of ``images`` (made once per their identities):
    from files at ``paths``, or from the in-memory image ``data``."""
    ids = tuple(im.identity for im in images)
    if data is not None:
        return elf_cache.derived("symindex-mem", ids, lambda: build_for_image(images[0], data))
    return elf_cache.derived("symindex", ids, lambda: build_for_files(elf_cache, images, paths))
