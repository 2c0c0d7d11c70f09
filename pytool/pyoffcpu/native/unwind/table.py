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
from typing import Iterable, List, Optional, Tuple

from ...kernel import bpfdefs
from ... import cachedir
from ..elfcache import STAT_SETTLED_NS
from ..elffile import section_bytes
from . import ehframe as E

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


def _plt_threshold(expr: bytes) -> Optional[Tuple[int, int]]:
    """(offset, K) for the PLT rule `rsp + off + ((rip & 15) >= K) << 3`."""
    # DW_OP_breg7 sleb off; DW_OP_breg16 0; lit15; and; litK; ge; lit3; shl; plus
    if len(expr) < 11 or expr[0] != 0x77:
        return None
    off, pos = E.read_sleb(expr, 1)
    tail = expr[pos:]
    if (len(tail) == 9 and tail[0:2] == b"\x80\x00" and tail[2] == 0x3F and tail[3] == 0x1A
            and 0x30 <= tail[4] <= 0x4F and tail[5:] == b"\x2a\x33\x24\x22"):
        return off, tail[4] - 0x30
    return None


def _drap_offset(expr: bytes) -> Optional[int]:
    """N of the CFA rule `DW_OP_breg6 N; DW_OP_deref` (the word at rbp + N),
    which GCC emits for a function that realigns its stack."""
    if len(expr) < 3 or expr[0] != 0x76:
        return None
    off, pos = E.read_sleb(expr, 1)
    return off if expr[pos:] == b"\x06" else None


def encode_row(r: E.Row) -> Tuple[int, int, int]:
    """(kind, cfa_off, rbp) of one parsed row."""
    if r.ra[0] == E.UNDEFINED:
        return (UR_END, 0, 0)
    if r.cfa_expr is not None:
        plt = _plt_threshold(r.cfa_expr)
        if plt is not None and -32768 <= plt[0] < 32768 and r.ra == (E.OFFSET, -8):
            return (UR_PLT, plt[0], plt[1])
        drap = _drap_offset(r.cfa_expr)
        if drap is None or not -32768 <= drap < 32768 or r.ra != (E.OFFSET, -8):
            return (UR_INVALID, 0, 0)
        kind, cfa_off = UR_DRAP, drap
    elif r.ra != (E.OFFSET, -8):
        return (UR_INVALID, 0, 0)
    elif r.cfa_reg == E.REG_RSP:
        kind, cfa_off = UR_RSP, r.cfa_off
    elif r.cfa_reg == E.REG_RBP:
        kind, cfa_off = UR_RBP, r.cfa_off
    else:
        return (UR_INVALID, 0, 0)
    if not -32768 <= cfa_off < 32768:
        return (UR_INVALID, 0, 0)
    rk, ro = r.rbp
    if rk == E.SAME:
        rbp = 0
    elif rk == E.OFFSET and ro % 8 == 0 and -127 * 8 <= ro < 0:
        rbp = ro // 8
    elif rk == E.AT_RBP and ro == 0 and kind == UR_DRAP:
        # only where the CFA comes from rbp, so rbp is this frame's own: in
        # the instruction after an epilogue's `pop %rbp` GCC's rule still
        # says "at rbp" of a register that is the caller's already
        rbp = RBP_AT_RBP
    else:
        rbp = RBP_LOST
    return (kind, cfa_off, rbp)


def build_table(fdes: Iterable[E.FdeTable], build_id: Optional[str] = None,
                derived: Iterable[Tuple[int, Tuple[int, int, int]]] = ()) -> UnwindTable:
    """derived: (address, (kind | UR_DERIVED, cfa_off, rbp)) rows of the
    functions no FDE covers (prologue.py), their ends invalid rows."""
    # (loc, priority, encoding): a rule at loc wins over the end marker of the
    # FDE before it (priority 0 < 1).
    entries: List[Tuple[int, int, Tuple[int, int, int]]] = []
    for loc, enc in derived:
        end = (enc[0] & ~UR_DERIVED) == UR_INVALID
        entries.append((loc, 1 if end else 0, enc))
    unsupported = 0
    for fde in fdes:
        for r in fde.rows:
            if fde.pc_begin <= r.loc < fde.pc_end:
                enc = encode_row(r) if not fde.signal_frame else (UR_INVALID, 0, 0)
                if enc[0] == UR_INVALID:
                    unsupported += 1
                entries.append((r.loc, 0, enc))
        entries.append((fde.pc_end, 1, (UR_INVALID, 0, 0)))
    if not entries:
        return UnwindTable(0, b"", array.array("I", [0]), build_id)
    entries.sort(key=lambda e: (e[0], e[1]))
    base = entries[0][0] & ~(PAGE - 1)
    out = bytearray()
    locs: List[int] = []
    last_loc = None
    last_enc = None
    for loc, _prio, enc in entries:
        if loc == last_loc:
            continue                    # an earlier entry at the same loc won
        last_loc = loc
        if enc == last_enc:
            continue
        last_enc = enc
        rel = loc - base
        if rel >= 1 << 32:
            break                       # objects over 4 GiB of code: rest unsupported
        out += ROW.pack(rel, enc[1], enc[0], enc[2])
        locs.append(rel)
    shift = page_shift(locs)
    pages = _page_index(locs, shift)
    return UnwindTable(base, bytes(out), pages, build_id, unsupported, shift)


def page_shift(locs: List[int]) -> int:
    """The page size (log2) of a table's index: 4 KiB pages unless a page
    would hold more rows than the BPF search takes (then smaller pages, down
    to MIN_PAGE_SHIFT), but never more pages than max_pages() allows for its
    rows: the index is sized by what the file holds, not by the address span
    it claims (a 27 KB library with code at 0x40000000 gets a few hundred
    pages, not a quarter million).  A page left with more rows than the
    search takes finds no row there (the walk ends), never a wrong one."""
    cap = max_pages(len(locs))
    last = locs[-1]
    shift = PAGE_SHIFT
    while (last >> shift) + 1 > cap:
        shift += 1                      # ends by 31: rel < 2^32, cap >= 2
    while (shift > MIN_PAGE_SHIFT and (last >> (shift - 1)) + 1 <= cap
           and _max_rows_per_page(_page_index(locs, shift)) > MAX_ROWS_PER_PAGE):
        shift -= 1
    return shift


def max_pages(nrows: int) -> int:
    """The most index entries a table of nrows rows gets (helper/tables.c
    the same): 4 per row and 256 more, so the index costs the kernel at most
    four times the rows' own memory and 2 KiB."""
    return PAGES_PER_ROW * nrows + MIN_PAGES


def _max_rows_per_page(pages: array.array) -> int:
    return max((pages[i + 1] - pages[i] + 1 for i in range(len(pages) - 1)), default=0)


def _page_index(locs: List[int], shift: int) -> array.array:
    n = len(locs)
    npages = (locs[-1] >> shift) + 1
    pages = array.array("I", bytes(4 * (npages + 1)))
    i = 0
    for p in range(npages):
        start = p << shift
        while i + 1 < n and locs[i + 1] <= start:
            i += 1
        pages[p] = i
    pages[npages] = n - 1
    return pages


# ---------------------------------------------------------------------------
# ELF files and the on-disk cache
# ---------------------------------------------------------------------------
MAGIC = b"PYOFFUW2"
_HDR = struct.Struct("<8sQIIII")       # magic, base, nrows, npages, unsupported, page shift


def table_from_elf(stream, path: Optional[str] = None, elf_cache=None) -> UnwindTable:
    """The table of an ELF file's .eh_frame (stream: an open binary file),
    with rows from prologue analysis for its functions without CFI (their
    symbols through the session's ElfCache when `path` is given)."""
    from elftools.elf.elffile import ELFFile
    elf = ELFFile(stream)
    if elf["e_machine"] != "EM_X86_64":
        raise E.EhFrameError(f"not x86_64 ({elf['e_machine']})")
    sec = elf.get_section_by_name(".eh_frame")
    fdes = [] if sec is None or sec["sh_type"] == "SHT_NOBITS" else list(
        E.parse_eh_frame(section_bytes(sec), sec["sh_addr"]))
    from . import prologue
    syms = None
    if path is not None:
        try:
            syms = prologue.function_symbols(path, elf_cache)
        except Exception:               # noqa: BLE001 - read them with pyelftools instead
            syms = None
    derived = prologue.derived_rows(elf, [(f.pc_begin, f.pc_end) for f in fdes], syms) \
        if prologue.enabled() else []
    return build_table(fdes, derived=derived)


def _variant() -> str:
    """What else a cached table depends on: tables built without prologue
    analysis (PYOFFCPU_PROLOGUE=0) are cached apart, and so are those that
    another capstone decoded (its text is what the analysis reads)."""
    from . import prologue
    if not prologue.enabled():
        return "noprologue:"
    global _CAPSTONE
    if _CAPSTONE is None:
        v = capstone_version()
        _CAPSTONE = f"capstone-{v}:" if v else "nocapstone:"
    return _CAPSTONE


_CAPSTONE: Optional[str] = None


def capstone_version() -> Optional[str]:
    """The installed capstone's version, from its distribution's metadata
    directory beside the package (capstone-5.0.9.dist-info, Debian's
    capstone-4.0.2.egg-info): a directory listing, where importing capstone
    or importlib.metadata costs 0.1-0.2 s of a start.  None: not installed."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("capstone")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    parent = os.path.dirname(list(spec.submodule_search_locations)[0])
    try:
        names = os.listdir(parent)
    except OSError:
        names = []
    for n in sorted(names):
        for ext in (".dist-info", ".egg-info"):
            if n.lower().startswith("capstone-") and n.endswith(ext):
                return n[len("capstone-"):-len(ext)].split("-py")[0]
    try:
        from importlib.metadata import version
        return version("capstone")
    except Exception:               # noqa: BLE001 - no metadata
        return None


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


def build_command() -> Tuple[List[str], Optional[List[str]]]:
    """(args, program) of a helper job that writes a file's serialized
    table to its standard output: the compiled helper's `table` command,
    or, without it, the same from this package in another Python."""
    from .. import helper
    from . import prologue
    args = ["table"] + ([] if prologue.enabled() else ["--no-prologue"])
    if helper.available():
        return args, None
    return args, [sys.executable, "-m", "pyoffcpu.native.unwind.table"]


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
    """A file's table, built now, in a helper process (the compiled one if
    there is one); expect: the file_identity the file must have when the
    helper opens it (a path swapped meanwhile: no table).  Raises
    (helper.HelperError, OSError, ValueError)."""
    from .. import helper
    args, program = build_command()
    job = helper.Job(args, path, program=program)
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

    VERSION = 6                         # 2: rows from prologue analysis (prologue.py); 3: its RBP_LOST;
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
        analyse the vDSO's code again (its functions without CFI: 0.25 s,
        most of it importing capstone)."""
        import io
        key = hashlib.sha256(f"v{self.VERSION}:{_variant()}mem:{name}:{build_id}".encode()
                             + hashlib.sha256(data).digest()).hexdigest()[:32]
        if key in self._mem:
            return self._mem[key]
        t = self.cached(key, build_id)
        if t is not None:
            return t
        try:
            t = table_from_elf(io.BytesIO(data))
        except Exception:
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


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m pyoffcpu.native.unwind.table table [--no-prologue] [--into PATH] <ELF`:
    the compiled helper's `table` command in Python, where it was not
    built: the serialized table to standard output, or written to PATH
    (beside it first, then renamed: a reader never sees half a table)."""
    argv = sys.argv[1:] if argv is None else argv
    from .. import helper
    helper.apply_limits()
    into = None
    if len(argv) >= 3 and argv[-2] == "--into":
        into, argv = argv[-1], argv[:-2]
    if not argv or argv[0] != "table" or any(a != "--no-prologue" for a in argv[1:]):
        print("usage: python -m pyoffcpu.native.unwind.table table [--no-prologue] [--into PATH] <ELF",
              file=sys.stderr)
        return 2
    if "--no-prologue" in argv:
        os.environ["PYOFFCPU_PROLOGUE"] = "0"
    path = f"/proc/self/fd/{sys.stdin.fileno()}"
    try:
        with open(sys.stdin.fileno(), "rb", closefd=False) as f:
            data = serialize(table_from_elf(f, path))
    except Exception as e:          # noqa: BLE001 - one line, exit 1, as the helper does
        print(f"pyoffcpu.native.unwind.table: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if into is None:
        sys.stdout.buffer.write(data)
    elif not cachedir.write_private(into, data):
        print(f"pyoffcpu.native.unwind.table: cannot write {into}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
