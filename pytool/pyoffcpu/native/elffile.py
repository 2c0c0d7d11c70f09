"""ELF files, each read once per session, found by what they are rather than
where they are.

Under ``-a`` hundreds of processes map the same files (libc, libpython,
extension modules), often under different names (containers, venvs, hard
links), and a name can come to mean another file (a package upgrade).  So
parsed files are kept by *file identity*, never by path:

* ``identify``: the ``FileIdentity`` of an open file (or of bytes such as
  the vDSO), read from a few KiB of it.
* ``ElfFile``: what pyoffcpu reads out of one ELF file: type, PT_LOAD
  segments, build-id, ``.gnu_debuglink``, the section table (its headers
  read with struct, as pyelftools would read them, ~10x faster) and the
  defined symbols of ``.symtab`` / ``.dynsym`` (decoded once, on first use,
  only where asked for): the symbol reader behind data symbol look-ups
  (``_PyRuntime``), ``_thread_db_*`` descriptors and the Python fallback of
  the function index.  The symbolizer's functions come from that index
  (``symindex``: built by the compiled helper from the file itself), not
  from decoded symbols.
* ``ElfCache``: identity -> ElfFile, plus what is derived from parsed files
  (function indexes) and the kernel's vDSO image, read once.
* ``load_bias``: runtime address minus ELF virtual address in a mapping, the
  one computation the unwinder and the symbolizer share.

One process runs one session, so ``default_cache()`` is that session's cache;
whoever needs another (a test counting parses) builds an ``ElfCache`` and
hands it to ``Symbolizer`` / ``NativeUnwinder``.

Over 600 lines and one job: reading ELF files as pyelftools reads them
(the same checks, names and failures, the compiled helper's contract),
once per file identity.
"""
from __future__ import annotations

import atexit
import errno
import hashlib
import io
import json
import os
import stat
import struct
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple, Union

from elftools.common.exceptions import ELFError
from elftools.elf import enums as _enums
from elftools.elf.elffile import ELFFile

from .. import cachedir

__all__ = [
    "ElfCache", "ElfFile", "FileIdentity", "IdentityMemo", "LoadSegment", "RawSymbol",
    "default_cache", "identify", "load_bias", "segment_for_offset",
]

# ELF symbol types / bindings / special section indices.
STT_NOTYPE, STT_OBJECT, STT_FUNC, STT_TLS, STT_GNU_IFUNC = 0, 1, 2, 6, 10
STB_LOCAL, STB_GLOBAL, STB_WEAK = 0, 1, 2
SHN_UNDEF, SHN_LORESERVE, SHN_ABS = 0, 0xFF00, 0xFFF1
PF_X = 1
PAGE = 4096

FUNC_TYPES = frozenset({STT_FUNC, STT_GNU_IFUNC})
ADDRESS_TYPES = frozenset({STT_OBJECT, STT_FUNC, STT_TLS, STT_GNU_IFUNC})

IDENTITY_SPAN = 4096            # bytes of the head and of the tail in the identity

# Raw ELF header fields, section and program header types.
_SHT_SYMTAB, _SHT_NOTE, _SHT_NOBITS, _SHT_DYNSYM = 2, 7, 8, 11
_PT_LOAD, _PT_NOTE = 1, 4
_NT_GNU_BUILD_ID = 3
STAT_SETTLED_NS = 1_000_000_000        # see ElfCache._by_stat
_PARSE_ERRORS = (OSError, ELFError, ValueError, struct.error, AssertionError,
                 OverflowError, IndexError, KeyError, MemoryError)
# What a file may make us read, at most (a file can claim any size, and a
# sparse one costs its maker nothing): the largest real sections measured
# (PyTorch 2.x: .strtab 74 MiB, .text 271 MiB, .symtab 12 MiB) are well below.
MAX_NOTE_BYTES = 64 << 10               # notes searched for the build-id
MAX_SYMBOL_TABLE_BYTES = 64 << 20       # .symtab / .dynsym: decoded into objects
MAX_SECTION_BYTES = 256 << 20           # any other section read whole
MAX_CODE_SECTION_BYTES = 1 << 30        # code read for prologue analysis
_HASH_CHUNK = 4 << 20


# ---------------------------------------------------------------------------
# File identity
# ---------------------------------------------------------------------------
class FileIdentity(NamedTuple):
    """What an ELF file is, whatever its path.

    Why a hit on this key is the same file (the cache must never hand out
    another file's symbols):

    * ``digest`` covers, in every case, the size, the section and program
      header tables wherever they are, and the first and last 4 KiB.
    * a file without a build-id, or one that root did not write (owned by
      another user, or writable by group or other): ``digest`` also covers
      every byte that ``ElfFile`` reads (the symbol and string tables they
      link to, the notes, the section names, the debuglink): two files
      that agree on all of it parse to the same ElfFile, whatever else
      differs.  The size and head/tail alone would not be exact: two builds
      of a small program at the same path, renaming one function to a name
      of the same length, differ only inside ``.strtab``; and a build-id is
      a claim the file makes (a user's library can claim libc's).
    * a file of root's with a GNU build-id: the build-id, which the linker
      computes over the linked output (the convention that debuginfod,
      perf and gdb rely on), and which only root could have put there.
      Tools that rewrite a linked file keep its id (strip, objcopy
      --only-keep-debug, dwz), and what they rewrite is the very tables
      read here, but they drop, add or move whole sections, which changes
      the header tables (and mostly the size): a stripped copy, its
      original and its debug file are three entries.  (Hashing the symbol
      tables of every file torch maps would add ~0.4 s to a cold start.)
    * an in-memory image (the vDSO): ``digest`` covers all of its bytes.

    Identities are kept by stat in this process and, through IdentityMemo,
    on disk for the next run.
    """

    build_id: Optional[str]     # hex; None: the file has none
    size: int
    digest: str                 # hex, see above

    @property
    def kind(self) -> str:
        """"build-id" or "hash": what names the file."""
        return "build-id" if self.build_id else "hash"


class _Source:
    """Random access to an open file or to bytes, keeping the head and tail
    read for the identity so that headers inside them cost no more reads."""

    def __init__(self, fd: Optional[int] = None, data: Optional[bytes] = None):
        self.fd, self.data = fd, data
        if data is not None:
            self.size = len(data)
        else:
            self.size = os.fstat(fd).st_size
        self.head = self._pread(0, min(IDENTITY_SPAN, self.size))
        tail_at = max(0, self.size - IDENTITY_SPAN)
        self.tail_at = tail_at
        self.tail = self.head[tail_at:] if tail_at < len(self.head) else \
            self._pread(tail_at, self.size - tail_at)

    def _pread(self, off: int, n: int) -> bytes:
        if self.data is not None:
            return self.data[off:off + n]
        return os.pread(self.fd, n, off)

    def read(self, off: int, n: int) -> bytes:
        if off < 0 or n <= 0 or off >= self.size:
            return b""
        n = min(n, self.size - off)
        if off + n <= len(self.head):
            return self.head[off:off + n]
        if off >= self.tail_at:
            return self.tail[off - self.tail_at:off - self.tail_at + n]
        return self._pread(off, n)


def _notes_build_id(raw: bytes, fmt: str) -> Optional[str]:
    """The NT_GNU_BUILD_ID desc (hex) of notes named "GNU" in ``raw``,
    padded to 4 bytes as pyelftools and the ABI lay them out."""
    pos = 0
    while pos + 12 <= len(raw):
        namesz, descsz, ntype = struct.unpack_from(fmt + "III", raw, pos)
        pos += 12
        name = raw[pos:pos + namesz].split(b"\0", 1)[0]
        pos += (namesz + 3) & ~3
        desc = raw[pos:pos + descsz]
        pos += (descsz + 3) & ~3
        if ntype == _NT_GNU_BUILD_ID and name == b"GNU":
            return desc.hex() if len(desc) == descsz else None
    return None


def _identify(src: _Source, roots: bool = False) -> Optional[FileIdentity]:
    """The identity of the ELF file in ``src``; None when it is not ELF.

    Headers that make no sense only leave their part out (no build-id, no
    tables): whether the file is usable is for pyelftools to say."""
    head = src.head
    if len(head) < 16 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) \
            or head[5] not in (1, 2):
        return None
    e = "<" if head[5] == 1 else ">"
    is64 = head[4] == 2
    h = hashlib.blake2b(digest_size=16)
    h.update(struct.pack("<Q", src.size))
    h.update(head)
    h.update(src.tail)
    if src.data is not None:
        h.update(src.data)          # in memory: all of it costs nothing
    build_id = None
    shdrs: List[tuple] = []
    try:
        if is64:
            (_t, _m, _v, _entry, phoff, shoff, _f, _eh, phentsize, phnum,
             shentsize, shnum, shstrndx) = struct.unpack_from(e + "HHIQQQIHHHHHH", head, 16)
            sh_fmt, ph_fmt = e + "IIQQQQIIQQ", e + "IIQQQQQQ"
        else:
            (_t, _m, _v, _entry, phoff, shoff, _f, _eh, phentsize, phnum,
             shentsize, shnum, shstrndx) = struct.unpack_from(e + "HHIIIIIHHHHHH", head, 16)
            sh_fmt, ph_fmt = e + "IIIIIIIIII", e + "IIIIIIII"
    except struct.error:
        return FileIdentity(None, src.size, h.hexdigest())
    if shoff and shentsize >= struct.calcsize(sh_fmt):
        first = src.read(shoff, shentsize)
        if len(first) == shentsize:
            # Extended numbering: the real counts are in section 0 (sh_size:
            # sections, sh_link: the names' section, sh_info: segments).
            zero = struct.unpack_from(sh_fmt, first)
            shnum = shnum or zero[5]
            shstrndx = zero[6] if shstrndx == 0xFFFF else shstrndx
            phnum = zero[7] if phnum == 0xFFFF else phnum
        table = src.read(shoff, shentsize * min(shnum, 1 << 16))
        h.update(table)
        for i in range(len(table) // shentsize):
            # name, type, flags, addr, offset, size, link, info, align, entsize
            f = struct.unpack_from(sh_fmt, table, i * shentsize)
            shdrs.append((f[0], f[1], f[4], f[5], f[6]))
    phdrs = []
    if phoff and phentsize >= struct.calcsize(ph_fmt):
        table = src.read(phoff, phentsize * phnum)
        h.update(table)
        for i in range(len(table) // phentsize):
            f = struct.unpack_from(ph_fmt, table, i * phentsize)
            if is64:        # type, flags, offset, vaddr, paddr, filesz, memsz, align
                phdrs.append((f[0], f[2], f[5]))
            else:           # type, offset, vaddr, paddr, filesz, memsz, flags, align
                phdrs.append((f[0], f[1], f[4]))
    # The build-id as pyoffcpu has always read it: from the first note
    # section that has one, else from the first PT_NOTE segment that has one.
    for _name, stype, off, size, _link in shdrs:
        if stype == _SHT_NOTE:
            build_id = _notes_build_id(src.read(off, min(size, MAX_NOTE_BYTES)), e)
            if build_id:
                break
    if not build_id:
        for ptype, off, size in phdrs:
            if ptype == _PT_NOTE:
                build_id = _notes_build_id(src.read(off, min(size, MAX_NOTE_BYTES)), e)
                if build_id:
                    break
    if build_id and roots:
        return FileIdentity(build_id, src.size, h.hexdigest())
    # The digest covers every section ElfFile reads (FileIdentity says why):
    # the symbol tables and the string tables they link to, the notes,
    # .shstrtab (the section names) and .gnu_debuglink.
    h.update(b"sections")
    wanted = {i for i, sh in enumerate(shdrs) if sh[1] in (_SHT_SYMTAB, _SHT_DYNSYM, _SHT_NOTE)}
    wanted |= {shdrs[i][4] for i in list(wanted) if shdrs[i][1] != _SHT_NOTE}
    if 0 < shstrndx < len(shdrs):
        wanted.add(shstrndx)
        names = src.read(shdrs[shstrndx][2], min(shdrs[shstrndx][3], MAX_SECTION_BYTES))
        wanted |= {i for i, sh in enumerate(shdrs)
                   if names[sh[0]:sh[0] + 15] == b".gnu_debuglink\0"}
    for i in sorted(w for w in wanted if 0 <= w < len(shdrs)):
        _name, stype, off, size, _link = shdrs[i]
        h.update(struct.pack("<IQQ", i, off, size))
        if stype != _SHT_NOBITS:
            if size > (MAX_SYMBOL_TABLE_BYTES if stype in (_SHT_SYMTAB, _SHT_DYNSYM)
                       else MAX_SECTION_BYTES):
                raise ValueError("a section larger than pyoffcpu reads")
            for at in range(off, off + min(size, max(0, src.size - off)), _HASH_CHUNK):
                h.update(src.read(at, min(_HASH_CHUNK, off + size - at)))
    return FileIdentity(build_id, src.size, h.hexdigest())


def roots(st: os.stat_result) -> bool:
    """Is this the stat of a file only root can have written?"""
    return st.st_uid == 0 and not st.st_mode & 0o022


def section_bytes(sec, limit: int = MAX_SECTION_BYTES) -> bytes:
    """pyelftools' Section.data(), refused (ValueError) past ``limit``
    bytes, inflated or not: a compressed section inflates to at most the
    size its header states, which is what is checked."""
    if sec.data_size > limit:
        raise ValueError(f"section {sec.name!r} of {sec.data_size} bytes: more than pyoffcpu reads")
    return sec.data()


def identify(f) -> Optional[FileIdentity]:
    """The FileIdentity of an open binary file (or file descriptor) or of
    bytes; None when it is not an ELF file or cannot be read."""
    try:
        if isinstance(f, (bytes, bytearray, memoryview)):
            return _identify(_Source(data=bytes(f)))
        fd = f if isinstance(f, int) else f.fileno()
        return _identify(_Source(fd=fd), roots(os.fstat(fd)))
    except (OSError, ValueError, OverflowError, MemoryError):
        return None


# ---------------------------------------------------------------------------
# Parsed files
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadSegment:
    """A PT_LOAD program header."""

    offset: int
    vaddr: int
    filesz: int
    memsz: int
    align: int
    flags: int = 0              # p_flags (PF_X 1, PF_W 2, PF_R 4)


class RawSymbol(NamedTuple):
    """A defined symbol of .symtab / .dynsym."""

    name: str
    value: int
    size: int
    type: int
    bind: int
    shndx: int


@dataclass(frozen=True)
class Section:
    name: str
    type: str                   # pyelftools' name: "SHT_PROGBITS", ...
    addr: int
    size: int
    offset: int = 0
    link: int = 0
    flags: int = 0


_SHF_COMPRESSED = 0x800


def _decode_symbols(data: bytes, strtab: bytes, little: bool, elfclass: int
                    ) -> List[RawSymbol]:
    """The defined, named symbols of a SYMTAB/DYNSYM section, straight from
    its bytes (pyelftools' per-symbol objects are too slow for libc's
    thousands).  Value 0 is left out but for TLS (an offset in the block).

    Names are decoded with "surrogateescape": each str stands for exactly
    its raw bytes (``name.encode("utf-8", "surrogateescape")``), so what is
    ranked or indexed by name (symbols._function_table, symindex) is the
    bytes, as in the compiled helper."""
    fmt = ("<" if little else ">") + ("IBBHQQ" if elfclass == 64 else "IIIBBH")
    out = []
    entsize = struct.calcsize(fmt)
    usable = len(data) - len(data) % entsize
    for fields in struct.iter_unpack(fmt, data[:usable]):
        if elfclass == 64:
            name_off, info, _other, shndx, value, size = fields
        else:
            name_off, value, size, info, _other, shndx = fields
        stype = info & 0xF
        if shndx == SHN_UNDEF or not name_off or (value == 0 and stype != STT_TLS):
            continue
        end = strtab.find(b"\0", name_off)
        name = strtab[name_off:end if end >= 0 else len(strtab)].decode("utf-8", "surrogateescape")
        out.append(RawSymbol(name, value, size, stype, info >> 4, shndx))
    return out


def _decoding(mapping) -> Dict[int, str]:
    """value -> name of a pyelftools enum, as its construct Enum decodes
    (the last name of a value wins; unknown values stay ints)."""
    return {v: k for k, v in mapping.items() if k != "_default_"}


_E_TYPES = _decoding(_enums.ENUM_E_TYPE)
_E_MACHINES = _decoding(_enums.ENUM_E_MACHINE)
# pyelftools' section type names by e_machine (elftools.elf.structs._create_shdr),
# for the machines the installed pyelftools names (Debian 12's 0.29 has no
# AArch64 or RISC-V table: it decodes theirs with the base names)
_SH_TYPES_BY_MACHINE = {
    machine: _decoding(getattr(_enums, table))
    for machine, table in (("EM_ARM", "ENUM_SH_TYPE_ARM"), ("EM_AARCH64", "ENUM_SH_TYPE_AARCH64"),
                           ("EM_X86_64", "ENUM_SH_TYPE_AMD64"), ("EM_MIPS", "ENUM_SH_TYPE_MIPS"),
                           ("EM_RISCV", "ENUM_SH_TYPE_RISCV"))
    if hasattr(_enums, table)
}
_SH_TYPES_BASE = _decoding(_enums.ENUM_SH_TYPE_BASE)
_SHT_STRTAB, _SHT_SUNW_LDYNSYM = 3, 0x6FFFFFF3
_ONE_READ = 1 << 20             # header tables up to this size are read at once


def _read_at(stream, off: int, n: int) -> bytes:
    stream.seek(off)
    return stream.read(n)


def _read_exact(stream, off: int, n: int) -> bytes:
    data = _read_at(stream, off, n)
    if len(data) != n:
        raise ValueError(f"ELF header at {off:#x} runs past the end of the file")
    return data


_MAX_CSTRING = 64 << 10        # a section name read from outside its table, at most


def _cstring(stream, off: int) -> bytes:
    """The NUL-terminated string at ``off`` anywhere in the file (b"": none
    before the end), as pyelftools' parse_cstring_from_stream reads it, but
    bounded: a file of a gigabyte without a NUL is not read whole (b"")."""
    chunks = []
    for _ in range(_MAX_CSTRING // 64):
        chunk = _read_at(stream, off, 64)
        head, sep, _ = chunk.partition(b"\0")
        chunks.append(head)
        if sep:
            return b"".join(chunks)
        if len(chunk) < 64:
            return b""
        off += 64
    return b""


class _Headers:
    """The ELF header, program and section headers of a file, read with
    struct as pyelftools reads them (the same counts, the same checks that
    make a file unreadable, the same names), without its per-field objects:
    ElfFile's fields are what pyelftools' gave, ~10x faster."""

    def __init__(self, stream):
        stream.seek(0, io.SEEK_END)
        self.size = stream.tell()
        self.stream = stream
        ident = _read_at(stream, 0, 16)
        if ident[:4] != b"\x7fELF":
            raise ValueError("Magic number does not match")
        if ident[4:5] not in (b"\x01", b"\x02"):
            raise ValueError(f"Invalid EI_CLASS {ident[4:5]!r}")
        if ident[5:6] not in (b"\x01", b"\x02"):
            raise ValueError(f"Invalid EI_DATA {ident[5:6]!r}")
        self.is64 = ident[4] == 2
        self.little = ident[5] == 1
        e = "<" if self.little else ">"
        eh = struct.Struct(e + ("16sHHIQQQIHHHHHH" if self.is64 else "16sHHIIIIIHHHHHH"))
        (_id, self.e_type, self.e_machine, _ver, _entry, self.phoff, self.shoff, _flags,
         _ehsize, self.phentsize, self.phnum, self.shentsize, self.shnum,
         self.shstrndx) = eh.unpack(_read_exact(stream, 0, eh.size))
        self.sh = struct.Struct(e + ("IIQQQQIIQQ" if self.is64 else "IIIIIIIIII"))
        self.ph = struct.Struct(e + ("IIQQQQQQ" if self.is64 else "IIIIIIII"))
        self.chdr_size = 24 if self.is64 else 12
        if self.shoff > 0 and self.shentsize < self.sh.size:
            raise ValueError(f"Too small e_shentsize: {self.shentsize}")
        self._sh0: Optional[tuple] = None

    def section_header(self, n: int) -> tuple:
        """(name, type, flags, addr, offset, size, link, info, addralign,
        entsize) of section n (pyelftools' _get_section_header)."""
        if n == 0 and self._sh0 is not None:
            return self._sh0
        pos = self.shoff + n * self.shentsize
        if pos > self.size:
            raise ValueError(f"Reading section {n} at offset {pos} past EOF {self.size}")
        h = self.sh.unpack(_read_exact(self.stream, pos, self.sh.size))
        if n == 0:
            self._sh0 = h
        return h

    def num_sections(self) -> int:
        if self.shoff == 0:
            return 0
        if self.shnum == 0:                 # extended numbering: in section 0
            return self.section_header(0)[5]
        return self.shnum

    def num_segments(self) -> int:
        return self.phnum if self.phnum < 0xFFFF else self.section_header(0)[7]

    def _table(self, off: int, entsize: int, count: int, entry: struct.Struct) -> List[tuple]:
        """count entries of entry's format every entsize bytes from off;
        raises where one runs past the end of the file."""
        if count and off + (count - 1) * entsize + entry.size > self.size:
            raise ValueError("header table runs past the end of the file")
        if count * entsize <= _ONE_READ:
            raw = b"" if not count else _read_exact(self.stream, off,
                                                    (count - 1) * entsize + entry.size)
            return [entry.unpack_from(raw, i * entsize) for i in range(count)]
        return [entry.unpack(_read_exact(self.stream, off + i * entsize, entry.size))
                for i in range(count)]

    def segments(self) -> List[tuple]:
        n = self.num_segments()
        if n and self.phoff > 0 and self.phentsize < self.ph.size:
            raise ValueError(f"Too small e_phentsize: {self.phentsize}")
        return self._table(self.phoff, self.phentsize, n, self.ph)

    def sections(self) -> List[tuple]:
        return self._table(self.shoff, self.shentsize, self.num_sections(), self.sh)

    def names(self, headers: List[tuple]) -> List[str]:
        """The section names (pyelftools' StringTableSection.get_string on
        the section e_shstrndx names: read at its offset, not bounded by its
        size)."""
        self.names_in_table = False
        if not headers:
            return []
        idx = self.shstrndx if self.shstrndx != 0xFFFF else self.section_header(0)[6]
        strtab = self.section_header(idx)
        base = strtab[4]
        table = _read_at(self.stream, base, min(strtab[5], max(0, self.size - base)))
        # every name inside a names section that lies in the file, as the
        # compiled helper's ELF reader wants them (helper/elf.c)
        self.names_in_table = (0 < idx < len(headers) and strtab[1] != _SHT_NOBITS
                               and not strtab[2] & _SHF_COMPRESSED and len(table) == strtab[5])
        out = []
        for h in headers:
            off = h[0]
            end = table.find(b"\0", off) if off < len(table) else -1
            if end < 0:
                self.names_in_table = False
            raw = table[off:end] if end >= 0 else _cstring(self.stream, base + off)
            out.append(raw.decode("utf-8", "replace") if raw else "")
        return out


class ElfFile:
    """One parsed ELF file (see the module's docstring).  Made by ElfCache,
    which keeps one per FileIdentity."""

    def __init__(self, identity: FileIdentity, stream):
        """Reads headers and the section table from ``stream`` (the file
        ``identity`` was taken from); symbols come with ``load_symbols``.
        Raises ValueError (struct.error) where the headers are not a
        readable ELF file's."""
        self.identity = identity
        self.build_id: Optional[str] = identity.build_id
        hd = _Headers(stream)
        self.e_type = _E_TYPES.get(hd.e_type, hd.e_type)
        self.little_endian: bool = hd.little
        self.elfclass: int = 64 if hd.is64 else 32
        machine = _E_MACHINES.get(hd.e_machine, hd.e_machine)
        sh_types = _SH_TYPES_BY_MACHINE.get(machine, _SH_TYPES_BASE)
        self.segments: List[LoadSegment] = []
        for f in hd.segments():
            if f[0] != _PT_LOAD:
                continue
            if hd.is64:     # type, flags, offset, vaddr, paddr, filesz, memsz, align
                self.segments.append(LoadSegment(f[2], f[3], f[5], f[6], f[7], f[1]))
            else:           # type, offset, vaddr, paddr, filesz, memsz, flags, align
                self.segments.append(LoadSegment(f[1], f[2], f[4], f[5], f[7], f[6]))
        headers = hd.sections()
        names = hd.names(headers)
        self.sections: List[Section] = []
        self.debuglink: Optional[str] = None
        self.has_symtab = False
        # What pyelftools checked as it made each section (and refused the
        # file for): a symbol table links to a string table; a compressed
        # section starts with its compression header.
        for i, (h, name) in enumerate(zip(headers, names)):
            sh_name, stype, flags, addr, offset, size, link = h[:7]
            if stype in (_SHT_SYMTAB, _SHT_DYNSYM, _SHT_SUNW_LDYNSYM) and (
                    link >= len(headers) or hd.section_header(link)[1] != _SHT_STRTAB):
                raise ValueError(f"symbol table {i} links to section {link}, not a string table")
            if flags & _SHF_COMPRESSED:
                _read_exact(stream, offset, hd.chdr_size)
            sec = Section(name, sh_types.get(stype, stype), addr, size, offset, link, flags)
            self.sections.append(sec)
            if stype == _SHT_SYMTAB:
                self.has_symtab = True
            elif name == ".gnu_debuglink" and stype != _SHT_NOBITS:
                raw = self._section_data(stream, i)
                self.debuglink = raw[: raw.find(b"\0")].decode("utf-8", "replace") or None
        # The compiled helper's ELF reader takes this section table as it is
        # (helper/elf.c): ELF64, entries of 64 bytes, counts in the header,
        # the section names where they should be.
        self.plain_section_table = (hd.is64 and hd.little and (
            hd.shoff == 0 or (hd.shnum != 0 and hd.shentsize == hd.sh.size
                              and hd.shstrndx != 0xFFFF and hd.names_in_table)))
        # (start, end) of each section by index, for unsized symbols.
        self.section_ranges: List[Tuple[int, int]] = [
            (s.addr, s.addr + s.size) for s in self.sections]
        # {section index: its symbols} of the SYMTAB / DYNSYM sections
        self._symtabs: Optional[Dict[int, List[RawSymbol]]] = None
        self._by_address_name: Optional[Dict[str, int]] = None
        self._by_defined_name: Optional[Dict[str, int]] = None
        self.symbols_failed = False     # the symbol tables could not be read

    def __repr__(self) -> str:
        return f"<ElfFile {self.identity.kind} {self.build_id or self.identity.digest}>"

    # -- symbols ----------------------------------------------------------------
    @property
    def symbols_loaded(self) -> bool:
        return self._symtabs is not None

    def load_symbols(self, stream) -> None:
        """Decode .symtab / .dynsym from ``stream``, the file this was parsed
        from, still open (ElfCache.get sees to it), where the section table
        read with the headers says they are."""
        if self._symtabs is not None:
            return
        tabs: Dict[int, List[RawSymbol]] = {}
        for idx, sec in enumerate(self.sections):
            if sec.type in ("SHT_SYMTAB", "SHT_DYNSYM"):
                strtab = self._section_data(stream, sec.link)
                tabs[idx] = _decode_symbols(self._section_data(stream, idx), strtab,
                                            self.little_endian, self.elfclass)
        self._symtabs = tabs

    def _section_data(self, stream, idx: int) -> bytes:
        """A section's bytes as pyelftools' Section.data() gives them (but
        none for SHT_NOBITS, where it makes up zeros)."""
        sec = self.sections[idx]
        if sec.type == "SHT_NOBITS":
            return b""
        limit = (MAX_SYMBOL_TABLE_BYTES if sec.type in ("SHT_SYMTAB", "SHT_DYNSYM")
                 else MAX_SECTION_BYTES)
        if sec.flags & _SHF_COMPRESSED:     # rare: let pyelftools inflate it
            return section_bytes(ELFFile(stream).get_section(idx), limit)
        if sec.size > limit:
            raise ValueError(f"section {sec.name!r} of {sec.size} bytes: more than pyoffcpu reads")
        stream.seek(sec.offset)
        return stream.read(sec.size)

    def needed(self, stream) -> List[str]:
        """DT_NEEDED names from .dynamic (and the string table it links)."""
        idx = next((i for i, sec in enumerate(self.sections) if sec.type == "SHT_DYNAMIC"), None)
        if idx is None:
            return []
        try:
            dyn = self._section_data(stream, idx)
            strtab = self._section_data(stream, self.sections[idx].link)
        except _PARSE_ERRORS:
            return []
        fmt = ("<" if self.little_endian else ">") + ("qQ" if self.elfclass == 64 else "iI")
        out = []
        for tag, val in struct.iter_unpack(fmt, dyn[:len(dyn) - len(dyn) % struct.calcsize(fmt)]):
            if tag == 0:                # DT_NULL
                break
            if tag == 1 and val < len(strtab):  # DT_NEEDED
                end = strtab.find(b"\0", val)
                out.append(strtab[val:end if end >= 0 else len(strtab)].decode("utf-8", "replace"))
        return out

    def _tables(self) -> Dict[int, List[RawSymbol]]:
        if self._symtabs is None:
            raise RuntimeError("symbols not loaded (ElfCache.get(..., symbols=True))")
        return self._symtabs

    def symbols(self, types: Optional[frozenset] = None) -> List[RawSymbol]:
        """Defined symbols of every symbol table in section order, of the
        given types (None: all)."""
        tabs = self._tables()
        return [s for idx in sorted(tabs) for s in tabs[idx]
                if types is None or s.type in types]

    def function_symbols(self) -> List[RawSymbol]:
        return self.symbols(FUNC_TYPES)

    def address_of(self, name: str) -> Optional[int]:
        """st_value of the first function / object / TLS symbol ``name`` in
        section order (for TLS: its offset in the module's TLS block)."""
        if self._by_address_name is None:
            d: Dict[str, int] = {}
            for s in self.symbols(ADDRESS_TYPES):
                d.setdefault(s.name, s.value)
            self._by_address_name = d
        return self._by_address_name.get(name)

    def defined(self, names: Iterable[str]) -> Dict[str, int]:
        """st_value of the defined symbols among ``names`` (any type, value
        not 0) in the section called .dynsym, then, for the ones not
        exported, in the one called .symtab."""
        if self._by_defined_name is None:
            tabs = self._tables()
            d: Dict[str, int] = {}
            for secname in (".dynsym", ".symtab"):
                idx = next((i for i, sec in enumerate(self.sections) if sec.name == secname), None)
                for s in tabs.get(idx, ()):
                    if s.value:
                        d.setdefault(s.name, s.value)
            self._by_defined_name = d
        return {n: self._by_defined_name[n] for n in names if n in self._by_defined_name}


# ---------------------------------------------------------------------------
# Load bias
# ---------------------------------------------------------------------------
def segment_for_offset(file_offset: int, segments: Iterable[LoadSegment],
                       executable: Optional[bool] = None) -> Optional[LoadSegment]:
    """The PT_LOAD segment a mapping starting at ``file_offset`` maps.

    The mapping starts at the page holding a segment's first byte, which may
    also hold the end of the segment before (when the linker packs segments
    without padding them to pages: lld, or GNU ld without -z separate-code).
    Then the segment whose PF_X agrees with the mapping's ``executable``
    (its 'x' permission) is the one; else the first that contains it."""
    first = None
    for seg in segments:
        page = max(seg.align, PAGE)
        lo = seg.offset - seg.offset % page
        if lo <= file_offset < seg.offset + max(seg.filesz, 1):
            if executable is None or bool(seg.flags & PF_X) == executable:
                return seg
            if first is None:
                first = seg
    return first


def load_bias(mapping, segments: Iterable[LoadSegment]) -> Optional[int]:
    """runtime address - ELF virtual address inside ``mapping`` (a
    symbols.Mapping: start, offset, perms), None when no segment holds it."""
    seg = segment_for_offset(mapping.offset, segments, "x" in mapping.perms)
    if seg is None:
        return None
    return mapping.start - (mapping.offset - seg.offset + seg.vaddr)


# ---------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------
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
