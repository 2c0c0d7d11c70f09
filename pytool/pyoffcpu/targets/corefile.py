"""Reads an ELF core file (x86_64 Linux): its threads' registers, the signal
that killed it, the files it had mapped, and its memory.

What the kernel writes (fs/binfmt_elf.c), and what is read here:
- one PT_NOTE segment: per thread an NT_PRSTATUS (its tid and user
  registers; the thread that took the fatal signal comes first), the
  process's NT_PRPSINFO (name, arguments), NT_SIGINFO (the signal, its code
  and faulting address), NT_FILE (every file-backed mapping: start, end,
  file offset, path as the process saw it);
- one PT_LOAD per mapping, with its permissions; its bytes where the
  coredump_filter kept them (by default anonymous and written private
  memory, and the first page of each ELF file), nothing for read-only file
  pages such as code, which are read from the file itself, and only from a
  file whose build-id is the one in the core (CoreMemory).

A core from systemd-coredump (/var/lib/systemd/coredump/core.*.zst, .lz4,
.xz) is decompressed first, into a private temporary file.  The core is
input we did not write: every count, size and offset in it is bounded
before it is used.
"""
from __future__ import annotations

import bisect
import mmap
import os
import shutil
import stat
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..kernel.memory import MemoryError_, WordReads, readable_range

ET_CORE = 4
EM_X86_64 = 62
PT_LOAD, PT_NOTE = 1, 4
PN_XNUM = 0xFFFF
NT_PRSTATUS, NT_PRPSINFO, NT_AUXV = 1, 3, 6
NT_SIGINFO = 0x53494749
NT_FILE = 0x46494C45
NT_GNU_BUILD_ID = 3
PF_X, PF_W, PF_R = 1, 2, 4

# struct user_regs_struct (x86_64), the pr_reg of NT_PRSTATUS at offset 112
REG_NAMES = ("r15", "r14", "r13", "r12", "bp", "bx", "r11", "r10", "r9", "r8", "ax", "cx",
             "dx", "si", "di", "orig_ax", "ip", "cs", "flags", "sp", "ss", "fsbase", "gsbase",
             "ds", "es", "fs", "gs")
PRSTATUS_REGS = 112
PRSTATUS_SIZE = PRSTATUS_REGS + 8 * len(REG_NAMES)

MAX_NOTES_BYTES = 64 << 20      # a core of 100k threads has ~35 MB of notes
MAX_PHDRS = 1 << 20
MAX_FILES = 1 << 20
MAX_PATH = 4096
MAX_HEADERS_AT = 1 << 20        # the kernel writes a core's program headers right after its ELF header
DECOMPRESS_RESERVE = 1 << 30    # what decompressing a core leaves free, at least

COMPRESSED = {                  # magic -> (what, command that writes it to stdout)
    b"\x28\xb5\x2f\xfd": ("zstd", ["zstd", "-dcq"]),
    b"\x04\x22\x4d\x18": ("lz4", ["lz4", "-dcq"]),
    b"\xfd7zXZ\x00": ("xz", ["xz", "-dcq"]),
}


class CoreError(Exception):
    """Not a core this can read; the message says why, in one line."""


@dataclass
class CoreThread:
    tid: int
    regs: Dict[str, int]
    cursig: int                 # the signal it was taking (the dumping thread's; else 0)


@dataclass
class SigInfo:
    signo: int
    code: int
    addr: Optional[int]         # the faulting address (SIGSEGV, SIGBUS, SIGFPE, SIGILL)
    sender: Optional[int]       # the pid that sent it (kill, tgkill, abort's raise)


@dataclass
class FileMapping:
    start: int
    end: int
    offset: int                 # bytes into the file
    path: str                   # as the process named it (" (deleted)" kept off: see deleted)
    deleted: bool = False


@dataclass
class Segment:
    vaddr: int
    memsz: int
    offset: int                 # in the core file
    filesz: int                 # bytes of it the core holds (the rest reads from its file, or not)
    flags: int

    @property
    def perms(self) -> str:
        return "%s%s%sp" % ("r" if self.flags & PF_R else "-", "w" if self.flags & PF_W else "-",
                            "x" if self.flags & PF_X else "-")


@dataclass
class Core:
    path: str                   # the file read (the decompressed copy for a compressed core)
    pid: int = 0
    uid: int = 0
    comm: str = ""
    args: str = ""
    threads: List[CoreThread] = field(default_factory=list)     # the signalled thread first
    siginfo: Optional[SigInfo] = None
    files: List[FileMapping] = field(default_factory=list)
    segments: List[Segment] = field(default_factory=list)
    auxv: Dict[int, int] = field(default_factory=dict)
    compressed: str = ""        # "zstd" ...: how it was stored
    _data: Optional[mmap.mmap] = None
    _tmpdir: Optional[str] = None

    def close(self) -> None:
        if self._data is not None:
            self._data.close()
            self._data = None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def bytes_at(self, seg: Segment, addr: int, size: int) -> Optional[bytes]:
        """The core's own bytes of [addr, addr + size), all inside seg's
        dumped part; None otherwise."""
        off = addr - seg.vaddr
        if off < 0 or off + size > seg.filesz or self._data is None:
            return None
        lo = seg.offset + off
        if lo + size > len(self._data):
            return None         # a truncated core
        return self._data[lo:lo + size]


def _open_regular(path: str) -> int:
    """An fd of the regular file at path (a FIFO or a device is refused
    before anything blocks on it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CoreError(f"cannot open {path}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CoreError(f"{path} is not a regular file")
    return fd


def claimed_size(head: bytes) -> Optional[int]:
    """The size of the core whose first bytes are head, by its own headers:
    the end of its last segment.  None while head is too short to say; 0
    for a core of more than 65534 mappings (its count is in a section
    header at its end); CoreError when it is not an ELF core."""
    if len(head) < 64:
        return None
    if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1 or \
            struct.unpack_from("<H", head, 16)[0] != ET_CORE:
        raise CoreError("not an ELF core file")
    phoff, shoff = struct.unpack_from("<QQ", head, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 54)
    if phentsize != 56 or phoff > MAX_HEADERS_AT:
        raise CoreError("its program headers are not where a core has them")
    if phnum == PN_XNUM:
        return 0
    if len(head) < phoff + phnum * 56:
        return None
    end = max(64, phoff + phnum * 56, shoff + shentsize * shnum if shoff else 0)
    for i in range(phnum):
        p_offset, _, _, p_filesz = struct.unpack_from("<QQQQ", head, phoff + i * 56 + 8)
        end = max(end, p_offset + p_filesz)
    return end


def _decompress(path: str, fd: int, magic: bytes) -> Tuple[str, str, str]:
    """(the decompressed copy's path, its private directory, what it was).

    What comes out of the decompressor is bounded: never more than the size
    the core's own headers give (a bomb's extra bytes are not written), and
    that size must fit in the temporary directory with DECOMPRESS_RESERVE
    (or a twentieth of its file system) left free: a file we did not write
    cannot fill the disk."""
    for m, (what, cmd) in COMPRESSED.items():
        if magic.startswith(m):
            break
    else:
        raise CoreError(f"{path} is not an ELF core file")
    if shutil.which(cmd[0]) is None:
        raise CoreError(f"{path} is {what}-compressed and there is no `{cmd[0]}` to decompress "
                        f"it (apt install {cmd[0]})")
    tmp = tempfile.mkdtemp(prefix="pyoffcpu-core-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    out = os.path.join(tmp, "core")
    os.lseek(fd, 0, os.SEEK_SET)
    proc = subprocess.Popen(cmd, stdin=fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        room = _room(tmp)
        head, size, written = b"", None, 0
        with open(out, "wb") as f:
            while True:
                chunk = proc.stdout.read(1 << 20)
                if not chunk:
                    break
                if size is None:
                    head += chunk
                    try:
                        size = claimed_size(head)
                    except CoreError as e:
                        raise CoreError(f"{path} is {what}-compressed, but {e}") from None
                    if size is None:
                        if len(head) > MAX_HEADERS_AT + PN_XNUM * 56:
                            raise CoreError(f"{path} is {what}-compressed, but its headers do not end")
                        continue
                    if size > room:
                        raise _no_room(path, tmp, size, room)
                    chunk, head = head, b""
                end = size or room      # 0: a core whose size its headers do not give
                if written + len(chunk) > end and not size:
                    raise _no_room(path, tmp, written + len(chunk), room)
                chunk = chunk[:end - written]
                f.write(chunk)
                written += len(chunk)
                if size and written >= size:
                    break       # the core is all there; anything after it is not read
            if size is None:
                f.write(head)   # too short to be a core: open_core says so
        if size is None or written < size:
            rc = proc.wait()
            why = proc.stderr.read(4096).decode("utf-8", "replace").strip().splitlines()
            if rc != 0:
                raise CoreError(f"{path}: {cmd[0]} failed: {why[-1] if why else rc}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return out, tmp, what


def _room(tmp: str) -> int:
    """Bytes a decompressed core may take in tmp's file system."""
    st = os.statvfs(tmp)
    keep = max(DECOMPRESS_RESERVE, st.f_blocks * st.f_frsize // 20)
    return max(0, st.f_bavail * st.f_frsize - keep)


def _no_room(path: str, tmp: str, size: int, room: int) -> CoreError:
    return CoreError(f"{path} decompresses to {'over ' if size > room else ''}{size >> 20} MiB, and "
                     f"{os.path.dirname(tmp)} has {room >> 20} MiB to spare "
                     f"(set TMPDIR to a directory with room)")


def open_core(path: str) -> Core:
    """Parse the core at path (compressed or not).  Raises CoreError."""
    fd = _open_regular(path)
    tmp = what = None
    try:
        magic = os.pread(fd, 8, 0)
        if not magic.startswith(b"\x7fELF"):
            real, tmp, what = _decompress(path, fd, magic)
            os.close(fd)
            fd = _open_regular(real)
        size = os.fstat(fd).st_size
        if size < 64:
            raise CoreError(f"{path} is too short to be a core")
        data = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    except BaseException:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(fd)
    core = Core(path, _data=data, _tmpdir=tmp, compressed=what or "")
    try:
        _parse(core, data)
    except (struct.error, IndexError, ValueError) as e:
        core.close()
        raise CoreError(f"{path}: a malformed core ({e})") from None
    except CoreError:
        core.close()
        raise
    return core


def _parse(core: Core, data: mmap.mmap) -> None:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise CoreError(f"{core.path} is not a 64-bit little-endian ELF file")
    e_type, e_machine = struct.unpack_from("<HH", data, 16)
    if e_type != ET_CORE:
        raise CoreError(f"{core.path} is an ELF file but not a core (type {e_type})")
    if e_machine != EM_X86_64:
        raise CoreError(f"{core.path} is a core of another architecture (machine {e_machine})")
    phoff, shoff = struct.unpack_from("<QQ", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    if phnum == PN_XNUM:        # more than 65534 mappings: the count is in section 0's sh_info
        phnum = struct.unpack_from("<I", data, shoff + 44)[0]
    if phentsize != 56 or phnum > MAX_PHDRS or phoff + phnum * 56 > len(data):
        raise CoreError(f"{core.path}: its program headers do not fit in the file (truncated?)")
    notes = []
    for i in range(phnum):
        p_type, p_flags, p_offset, p_vaddr, _, p_filesz, p_memsz, _ = \
            struct.unpack_from("<IIQQQQQQ", data, phoff + i * 56)
        if p_type == PT_LOAD:
            # a truncated core (the disk filled up) keeps what it has
            have = max(0, min(p_filesz, len(data) - p_offset))
            core.segments.append(Segment(p_vaddr, p_memsz, p_offset, have, p_flags))
        elif p_type == PT_NOTE:
            notes.append((p_offset, min(p_filesz, MAX_NOTES_BYTES)))
    core.segments.sort(key=lambda s: s.vaddr)
    for off, size in notes:
        _parse_notes(core, data[off:off + size])
    if not core.threads:
        raise CoreError(f"{core.path}: a core without threads (no NT_PRSTATUS)")


def _parse_notes(core: Core, raw: bytes) -> None:
    pos = 0
    while pos + 12 <= len(raw):
        namesz, descsz, ntype = struct.unpack_from("<III", raw, pos)
        pos += 12
        name = raw[pos:pos + namesz].rstrip(b"\0")
        pos += (namesz + 3) & ~3
        desc = raw[pos:pos + descsz]
        pos += (descsz + 3) & ~3
        if len(desc) < descsz:
            break
        if name != b"CORE" and name != b"LINUX":
            continue
        if ntype == NT_PRSTATUS and len(desc) >= PRSTATUS_SIZE:
            cursig = struct.unpack_from("<h", desc, 12)[0]
            tid = struct.unpack_from("<i", desc, 32)[0]
            regs = dict(zip(REG_NAMES, struct.unpack_from("<%dQ" % len(REG_NAMES), desc,
                                                           PRSTATUS_REGS)))
            core.threads.append(CoreThread(tid, regs, cursig))
        elif ntype == NT_PRPSINFO and len(desc) >= 136:
            core.uid, = struct.unpack_from("<I", desc, 16)
            core.pid, = struct.unpack_from("<i", desc, 24)
            core.comm = desc[40:56].split(b"\0", 1)[0].decode("utf-8", "replace")
            core.args = desc[56:136].split(b"\0", 1)[0].decode("utf-8", "replace").strip()
        elif ntype == NT_SIGINFO and len(desc) >= 24:
            signo, _, code = struct.unpack_from("<iii", desc, 0)
            addr = sender = None
            if code > 0:        # from the kernel: SEGV_MAPERR, FPE_INTDIV, ...: si_addr
                addr, = struct.unpack_from("<Q", desc, 16)
            else:               # SI_USER, SI_TKILL (kill, tgkill, raise): si_pid
                sender, = struct.unpack_from("<i", desc, 16)
            core.siginfo = SigInfo(signo, code, addr, sender)
        elif ntype == NT_FILE and len(desc) >= 16:
            core.files = _parse_files(desc)
        elif ntype == NT_AUXV:
            for i in range(0, len(desc) - 15, 16):
                k, v = struct.unpack_from("<QQ", desc, i)
                if k == 0:
                    break
                core.auxv[k] = v


def _parse_files(desc: bytes) -> List[FileMapping]:
    count, page = struct.unpack_from("<QQ", desc, 0)
    if count > MAX_FILES or 16 + count * 24 > len(desc) or page == 0 or page > 1 << 30:
        return []
    names = desc[16 + count * 24:].split(b"\0")
    out = []
    for i in range(min(count, len(names))):
        start, end, pgoff = struct.unpack_from("<QQQ", desc, 16 + i * 24)
        path = names[i][:MAX_PATH].decode("utf-8", "surrogateescape")
        deleted = path.endswith(" (deleted)")
        if deleted:
            path = path[:-len(" (deleted)")]
        out.append(FileMapping(start, end, pgoff * page, path, deleted))
    return out


def build_id_in_core(core: Core, fm: FileMapping) -> Optional[str]:
    """The build-id in the first page of an ELF file as the core kept it
    (coredump_filter's ELF-headers bit, on by default); None when the page
    is not there or holds no build-id note."""
    if fm.offset != 0:
        return None
    seg = segment_at(core, fm.start)
    head = core.bytes_at(seg, fm.start, 64) if seg else None
    if head is None or head[:4] != b"\x7fELF" or head[4] != 2:
        return None
    phoff, = struct.unpack_from("<Q", head, 32)
    phnum, = struct.unpack_from("<H", head, 56)
    phdrs = core.bytes_at(seg, fm.start + phoff, 56 * min(phnum, 64))
    if phdrs is None:
        return None
    for i in range(len(phdrs) // 56):
        p_type, _, p_offset, _, _, p_filesz, _, _ = struct.unpack_from("<IIQQQQQQ", phdrs, i * 56)
        if p_type != PT_NOTE or p_filesz > 4096:
            continue
        raw = core.bytes_at(seg, fm.start + p_offset, p_filesz)
        if raw is None:
            continue
        pos = 0
        while pos + 12 <= len(raw):
            namesz, descsz, ntype = struct.unpack_from("<III", raw, pos)
            pos += 12
            name = raw[pos:pos + namesz]
            pos += (namesz + 3) & ~3
            desc = raw[pos:pos + descsz]
            pos += (descsz + 3) & ~3
            if ntype == NT_GNU_BUILD_ID and name.rstrip(b"\0") == b"GNU" and desc:
                return desc.hex()
    return None


def segment_at(core: Core, addr: int) -> Optional[Segment]:
    i = bisect.bisect_right([s.vaddr for s in core.segments], addr) - 1
    if i >= 0 and addr < core.segments[i].vaddr + core.segments[i].memsz:
        return core.segments[i]
    return None


class CoreMemory(WordReads):
    snapshot = True
    """A dead process's memory, with the interface of ProcessMemory: the
    core's bytes where it kept them, else the bytes of the file mapped
    there, for the files `files` vouches for (path we can open, by the
    mapping's start: only files whose build-id matches the core's)."""

    def __init__(self, core: Core, files: Dict[int, str]):
        self.core = core
        self._starts = [s.vaddr for s in core.segments]
        self._maps = sorted((fm.start, fm.end, fm.offset, files[fm.start])
                            for fm in core.files if fm.start in files)
        self._map_starts = [m[0] for m in self._maps]
        self._fds: Dict[str, int] = {}

    def _piece(self, addr: int, size: int) -> bytes:
        """The bytes from addr up to size, or to the end of the mapping
        holding addr, whichever is first; raises MemoryError_."""
        i = bisect.bisect_right(self._starts, addr) - 1
        seg = self.core.segments[i] if i >= 0 else None
        if seg is None or addr >= seg.vaddr + seg.memsz:
            # no segment at all (gdb's gcore leaves read-only file mappings
            # out, where the kernel writes empty ones): the file's, if known
            nxt = self._starts[i + 1] if i + 1 < len(self._starts) else addr + size
            return self._from_file(addr, min(size, nxt - addr),
                                   f"{addr:#x} is not in the core's memory")
        n = min(size, seg.vaddr + seg.memsz - addr)
        if addr - seg.vaddr < seg.filesz:
            n = min(n, seg.vaddr + seg.filesz - addr)
            got = self.core.bytes_at(seg, addr, n)
            if got is not None:
                return got
        return self._from_file(addr, n)

    def _from_file(self, addr: int, n: int, missing: str = "") -> bytes:
        j = bisect.bisect_right(self._map_starts, addr) - 1
        if j < 0 or addr >= self._maps[j][1]:
            raise MemoryError_(missing or f"{addr:#x} is not in the core (a mapping it did not keep)")
        start, end, offset, path = self._maps[j]
        n = min(n, end - addr)
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError as e:
                raise MemoryError_(f"{path}: {e.strerror}") from None
        data = os.pread(fd, n, offset + addr - start)
        if not data:
            raise MemoryError_(f"{addr:#x} lies past the end of {path}")
        return data

    def read(self, addr: int, size: int) -> bytes:
        if not readable_range(addr, size) or size > 1 << 30:
            raise MemoryError_(f"bad read of {size} at {addr:#x}")
        out = []
        while size > 0:
            piece = self._piece(addr, size)
            out.append(piece)
            addr += len(piece)
            size -= len(piece)
        return b"".join(out)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
