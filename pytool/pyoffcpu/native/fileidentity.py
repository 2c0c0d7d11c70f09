"""What an ELF file is, whatever its name: its FileIdentity (size, the
build-id, a digest of its head, tail and every section pyoffcpu reads),
from a few KiB of an open file or of bytes such as the vDSO.  Parsed files
are kept by it (elfcache.py), never by path: a name can come to mean
another file, and one file has many names."""
from __future__ import annotations

import hashlib
import os
import struct
from typing import List, NamedTuple, Optional

IDENTITY_SPAN = 4096            # bytes of the head and of the tail in the identity

# Raw ELF header fields, section and program header types.
_SHT_SYMTAB, _SHT_NOTE, _SHT_NOBITS, _SHT_DYNSYM = 2, 7, 8, 11
_PT_LOAD, _PT_NOTE = 1, 4
_NT_GNU_BUILD_ID = 3
# What a file may make us read, at most (a file can claim any size, and a
# sparse one costs its maker nothing): the largest real sections measured
# (PyTorch 2.x: .strtab 74 MiB, .text 271 MiB, .symtab 12 MiB) are well below.
MAX_NOTE_BYTES = 64 << 10               # notes searched for the build-id
MAX_SYMBOL_TABLE_BYTES = 64 << 20       # .symtab / .dynsym: decoded into objects
MAX_SECTION_BYTES = 256 << 20           # any other section read whole
_HASH_CHUNK = 4 << 20


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
