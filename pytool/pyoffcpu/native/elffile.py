"""ELF files, each read once per session, found by what they are rather than
where they are.

Under ``-a`` hundreds of processes map the same files (libc, libpython,
extension modules), often under different names (containers, venvs, hard
links), and a name can come to mean another file (a package upgrade).  So
parsed files are kept by *file identity*, never by path:

* ``identify`` (fileidentity.py): the ``FileIdentity`` of an open file (or
  of bytes such as the vDSO), read from a few KiB of it.
* ``ElfFile``: what pyoffcpu reads out of one ELF file: type, PT_LOAD
  segments, build-id, ``.gnu_debuglink``, the section table (its headers
  read with struct, as pyelftools would read them, ~10x faster) and the
  defined symbols of ``.symtab`` / ``.dynsym`` (decoded once, on first use,
  only where asked for): the symbol reader behind data symbol look-ups
  (``_PyRuntime``), ``_thread_db_*`` descriptors and the Python fallback of
  the function index.  The symbolizer's functions come from that index
  (``symindex``: built by the compiled helper from the file itself), not
  from decoded symbols.
* ``ElfCache`` (elfcache.py): identity -> ElfFile, plus what is derived from parsed files
  (function indexes) and the kernel's vDSO image, read once.
* ``load_bias``: runtime address minus ELF virtual address in a mapping, the
  one computation the unwinder and the symbolizer share.

Here: reading ELF files as pyelftools reads them (the same checks, names
and failures, the compiled helper's contract).
"""
from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import Dict, Iterable, List, NamedTuple, Optional

from elftools.common.exceptions import ELFError
from elftools.elf import enums as _enums
from elftools.elf.elffile import ELFFile

from .fileidentity import (_PT_LOAD, _SHT_DYNSYM, _SHT_NOBITS, _SHT_SYMTAB, MAX_SECTION_BYTES,
                           MAX_SYMBOL_TABLE_BYTES, FileIdentity, identify)

__all__ = [
    "ElfFile", "FileIdentity", "LoadSegment", "RawSymbol", "identify", "load_bias", "segment_for_offset",
]

# ELF symbol types / bindings / special section indices.
STT_NOTYPE, STT_OBJECT, STT_FUNC, STT_TLS, STT_GNU_IFUNC = 0, 1, 2, 6, 10
STB_LOCAL, STB_GLOBAL, STB_WEAK = 0, 1, 2
SHN_UNDEF, SHN_LORESERVE, SHN_ABS = 0, 0xFF00, 0xFFF1
PF_X = 1
PAGE = 4096

FUNC_TYPES = frozenset({STT_FUNC, STT_GNU_IFUNC})
ADDRESS_TYPES = frozenset({STT_OBJECT, STT_FUNC, STT_TLS, STT_GNU_IFUNC})



_PARSE_ERRORS = (OSError, ELFError, ValueError, struct.error, AssertionError,
                 OverflowError, IndexError, KeyError, MemoryError)


def section_bytes(sec, limit: int = MAX_SECTION_BYTES) -> bytes:
    """pyelftools' Section.data(), refused (ValueError) past ``limit``
    bytes, inflated or not: a compressed section inflates to at most the
    size its header states, which is what is checked."""
    if sec.data_size > limit:
        raise ValueError(f"section {sec.name!r} of {sec.data_size} bytes: more than pyoffcpu reads")
    return sec.data()


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
    ranked or indexed by name (functable.function_table, symindex) is the
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
