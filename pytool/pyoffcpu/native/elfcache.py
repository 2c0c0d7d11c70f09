"""The session's ELF files: ElfCache maps a file's identity to its parsed
ElfFile, plus what is derived from parsed files (function indexes) and the
kernel's vDSO image, read once; open_regular_file opens a file a target
names without following a link or blocking on a FIFO.  One process runs one
session, so default_cache() is that session's cache; whoever needs another
(a test counting parses) builds an ElfCache and hands it to Symbolizer /
NativeUnwinder."""
from __future__ import annotations

import atexit
import errno
import io
import json
import os
import stat
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

from .. import cachedir
from .elffile import _PARSE_ERRORS, ElfFile
from .fileidentity import FileIdentity, identify

STAT_SETTLED_NS = 1_000_000_000        # see ElfCache._by_stat

SymbolsWanted = Union[bool, Callable[[ElfFile], bool]]


def open_regular_file(path: str):
    """The file at ``path``, open for reading, if it is a regular file.  A
    target names the paths we read (its mappings, its debug links) and can
    put a FIFO there: opened without blocking, then refused (OSError), it
    never hangs root's profiler; a device is refused the same way, before
    it is opened for reading (which may do something, for a device): the
    path is first opened with O_PATH, which opens nothing, checked, then
    reopened through that descriptor, the same file."""
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path}: not a regular file")
        readable = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    finally:
        os.close(fd)
    try:
        return os.fdopen(readable, "rb")
    except BaseException:
        os.close(readable)
        raise


class IdentityMemo:
    """File identities that earlier runs computed, by stat: (device, inode,
    size, mtime, ctime) of a file changed more than STAT_SETTLED_NS ago is
    the same bytes (writing to a file gives it a new ctime, which no program
    can set back), so its identity need not be hashed again; hashing torch's
    symbol tables would cost each start ~0.35 s.  One JSON file in root's
    cache directory, read once (at most MAX_BYTES), written back at exit
    with what this run used and added: the MAX_ENTRIES most recent."""

    FILE = "identities-v1.json"
    MAX_ENTRIES = 16384
    MAX_BYTES = 8 << 20

    def __init__(self, directory: Optional[str]):
        self.path = (os.path.join(directory, self.FILE)
                     if directory is not None and cachedir.safe_dir(directory) else None)
        self._known: Optional[Dict[tuple, FileIdentity]] = None
        self._used: Dict[tuple, FileIdentity] = {}
        self._pid = os.getpid()

    def _read(self) -> Dict[tuple, FileIdentity]:
        known: Dict[tuple, FileIdentity] = {}
        if self.path is None:
            return known
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    return known
                data = f.read(self.MAX_BYTES + 1)
            rows = json.loads(data) if len(data) <= self.MAX_BYTES else []
        except (OSError, ValueError, RecursionError):
            return known
        for row in rows[-self.MAX_ENTRIES:] if isinstance(rows, list) else ():
            if (isinstance(row, list) and len(row) == 8
                    and all(type(v) is int and v >= 0 for v in row[:5] + row[6:7])
                    and (row[5] is None or (isinstance(row[5], str) and len(row[5]) <= 128))
                    and isinstance(row[7], str) and len(row[7]) == 32):
                known[tuple(row[:5])] = FileIdentity(row[5], row[6], row[7])
        return known

    def get(self, key: tuple) -> Optional[FileIdentity]:
        if self._known is None:
            self._known = self._read()
        ident = self._known.get(key)
        if ident is not None:
            self.put(key, ident)
        return ident

    def put(self, key: tuple, ident: FileIdentity) -> None:
        if self.path is None:
            return
        if not self._used:
            atexit.register(self.save)
        self._used[key] = ident

    def save(self) -> None:
        """What this run used and found, after what the file holds now
        (another run may have written it meanwhile)."""
        if not self._used or self.path is None or os.getpid() != self._pid:
            return
        rows = {k: v for k, v in self._read().items() if k not in self._used}
        rows.update(self._used)
        out = [list(k) + [v.build_id, v.size, v.digest] for k, v in rows.items()][-self.MAX_ENTRIES:]
        cachedir.write_private(self.path, json.dumps(out, separators=(",", ":")).encode())
        self._used = {}


class ElfCache:
    """Parsed ELF files by FileIdentity: each parsed once however many
    paths and processes lead to it.  Not thread-safe (one per session, used
    from its thread)."""

    def __init__(self, memo: Optional[IdentityMemo] = None):
        self._files: Dict[FileIdentity, Optional[ElfFile]] = {}
        self.memo = memo                # identities of earlier runs (None: hash every file)
        self._derived: Dict[tuple, object] = {}
        self._vdso: Optional[Tuple[bytes, ElfFile]] = None
        self._vdso_read = False
        # (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns) of an open file
        # -> its identity: a file whose bytes change gets a new ctime (which
        # no program can set back), so the same stat is the same file.  Only
        # files changed more than STAT_SETTLED_NS ago are kept: file times
        # have a clock tick's grain, and a write in the tick of the last
        # change would leave the ctime as it was.
        self._by_stat: Dict[tuple, Optional[FileIdentity]] = {}
        self.identifies = 0             # identities computed (files read)
        self.parses = 0                 # ElfFile made (headers read)
        self.symbol_loads = 0           # symbol tables decoded
        self.vdso_reads = 0

    def __len__(self) -> int:
        return len(self._files)

    def _identify_open(self, f) -> Optional[FileIdentity]:
        """identify(f), read once per file as fstat tells files apart."""
        try:
            st = os.fstat(f.fileno())
        except (OSError, ValueError):
            return identify(f)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if key in self._by_stat:
            return self._by_stat[key]
        settled = time.time_ns() - st.st_ctime_ns > STAT_SETTLED_NS
        ident = self.memo.get(key) if settled and self.memo is not None else None
        if ident is None:
            self.identifies += 1
            ident = identify(f)
            if settled and ident is not None and self.memo is not None:
                self.memo.put(key, ident)
        if settled:
            self._by_stat[key] = ident
        return ident

    def identity(self, path: str) -> Optional[FileIdentity]:
        """The identity of the file at ``path`` now; None: not ELF, unreadable."""
        try:
            with open_regular_file(path) as f:
                return self._identify_open(f)
        except OSError:
            return None

    def get(self, path: str, symbols: SymbolsWanted = False) -> Optional[ElfFile]:
        """The ElfFile of the file at ``path`` (None: unreadable, not ELF).

        ``symbols``: have its symbol tables decoded too (a callable: when it
        says so of the ElfFile).  The identity and everything read come from
        one open file, so a path that is being replaced gives the old file
        or the new one, never a mix."""
        try:
            f = open_regular_file(path)
        except OSError:
            return None
        with f:
            ident = self._identify_open(f)
            if ident is None:
                return None
            return self._get(ident, f, symbols)

    def from_bytes(self, data: bytes, symbols: bool = True) -> Optional[ElfFile]:
        """The ElfFile of an in-memory image (the vDSO)."""
        ident = identify(data)
        if ident is None:
            return None
        return self._get(ident, io.BytesIO(data), symbols)

    def _get(self, ident: FileIdentity, stream, symbols: SymbolsWanted) -> Optional[ElfFile]:
        if ident in self._files:
            elf = self._files[ident]
        else:
            try:
                elf = ElfFile(ident, stream)
            except _PARSE_ERRORS:
                elf = None
            self.parses += 1
            self._files[ident] = elf
        if elf is None:
            return None
        if not elf.symbols_loaded and (symbols(elf) if callable(symbols) else symbols):
            try:
                elf.load_symbols(stream)
            except _PARSE_ERRORS:
                elf._symtabs = {}
                elf.symbols_failed = True
            self.symbol_loads += 1
        if elf.symbols_failed and (symbols(elf) if callable(symbols) else symbols):
            return None                 # unreadable symbol tables: unusable for names
        return elf

    def derived(self, kind: str, sources: Tuple[FileIdentity, ...],
                build: Callable[[], object]) -> object:
        """What ``build`` makes of the files ``sources`` name, made once per
        (kind, sources): e.g. one function table per file and debug file."""
        key = (kind,) + tuple(sources)
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    def vdso(self) -> Optional[Tuple[bytes, ElfFile]]:
        """(image, ElfFile) of the vDSO, read once from our own memory: the
        kernel maps the same image into every process."""
        if not self._vdso_read:
            self._vdso_read = True
            self.vdso_reads += 1
            self._vdso = None
            try:
                with open("/proc/self/maps") as f:
                    lines = [ln for ln in f if ln.rstrip().endswith("[vdso]")]
                if lines:
                    lo, _, hi = lines[0].split()[0].partition("-")
                    start, end = int(lo, 16), int(hi, 16)
                    with open("/proc/self/mem", "rb") as f:
                        f.seek(start)
                        data = f.read(end - start)
                    elf = self.from_bytes(data, symbols=True)
                    if elf is not None:
                        self._vdso = (data, elf)
            except (OSError, OverflowError, ValueError):
                self._vdso = None
        return self._vdso

    # -- conveniences --------------------------------------------------------
    def defined_symbols(self, path: str, names: Iterable[str]) -> Dict[str, int]:
        """``ElfFile.defined`` of the file at ``path``; {} when unreadable."""
        elf = self.get(path, symbols=True)
        return elf.defined(names) if elf is not None else {}

    def needed(self, path: str) -> List[str]:
        """The DT_NEEDED libraries of the file at ``path`` ([]: none, not
        ELF, unreadable), read once per file identity."""
        try:
            f = open_regular_file(path)
        except OSError:
            return []
        with f:
            ident = self._identify_open(f)
            if ident is None:
                return []
            key = ("needed", ".dynamic", ident)
            if key not in self._derived:
                elf = self._get(ident, f, False)
                self._derived[key] = elf.needed(f) if elf is not None else []
            return self._derived[key]

    def section_data(self, path: str, name: str) -> bytes:
        """The bytes of the first section called ``name`` (b"": none, no
        bytes in the file, unreadable), read from the file whose ElfFile
        says where it is."""
        return self.from_section(path, name, None, lambda data: data)

    def from_section(self, path: str, name: str, kind: Optional[str],
                     make: Callable[[bytes], object]) -> object:
        """make(the bytes of section ``name`` of the file at ``path``); with a
        kind, made once per file identity (the identity and the bytes come
        from one open file, so the result is the file's it is kept for)."""
        try:
            f = open_regular_file(path)
        except OSError:
            return make(b"")
        with f:
            ident = self._identify_open(f)
            key = (kind, name, ident)
            if kind is not None and ident is not None and key in self._derived:
                return self._derived[key]
            elf = self._get(ident, f, False) if ident is not None else None
            data = b""
            idx = None if elf is None else next(
                (i for i, s in enumerate(elf.sections) if s.name == name), None)
            if idx is not None:
                try:
                    data = elf._section_data(f, idx)
                except _PARSE_ERRORS:
                    data = b""
            got = make(data)
            if kind is not None and ident is not None:
                self._derived[key] = got
            return got


_DEFAULT: Optional[ElfCache] = None


def default_cache() -> ElfCache:
    """This process's (its session's) ElfCache."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = ElfCache(IdentityMemo(cachedir.cache_dir("elf")))
    return _DEFAULT
