"""A process's mappings: /proc/PID/maps parsed (Mapping), merged over
snapshots (AddressSpace, so that a process that has exited can still be
symbolized from what was seen of it), the process's root directory when
it is not ours (a chroot, a container), and where a file's address lies in
a process (runtime_address).  The first step of naming a native address
(symbols.py names the function)."""
from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass
from typing import Iterable, Optional

from .elfcache import ElfCache, default_cache
from .elffile import load_bias


def _under_root(root: Optional[str], path: str) -> str:
    """``path`` as seen from inside ``root`` (None: our own root)."""
    if not root:
        return path
    return os.path.join(root, path.lstrip("/"))


def target_root(pid: int) -> Optional[str]:
    """The root directory of a process that sees another file system root
    than we do, None when it shares ours or is gone.

    A chroot inside our tree is returned as the directory itself (it stays
    valid once the process has exited); another mount namespace (a
    container) as ``/proc/PID/root``."""
    link = f"/proc/{pid}/root"
    try:
        theirs = os.stat(link)
        ours = os.stat("/")
    except OSError:
        return None
    other = (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino)
    if not other:
        try:
            other = os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        except OSError:
            other = False
        if not other:
            return None
        return link     # the same directory, other mounts: only through /proc
    try:
        real = os.path.realpath(link)
        st = os.stat(real)
    except OSError:
        return link
    if real != "/" and (st.st_dev, st.st_ino) == (theirs.st_dev, theirs.st_ino):
        return real
    return link


def path_in_root(path: str, root: Optional[str]) -> str:
    """``path`` as a process with root directory ``root`` names it.  Our
    /proc/PID/maps shows a chroot's files by our names (under the chroot
    directory); a container's, whose root we cannot reach, by its own."""
    if not root:
        return path
    try:
        real = os.path.realpath(root)
    except (OSError, ValueError):
        return path
    real = real.rstrip("/")
    if real and path.startswith(real + "/"):
        return path[len(real):]
    return path


# ---------------------------------------------------------------------------
# /proc/PID/maps
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Mapping:
    """One line of /proc/PID/maps."""

    start: int
    end: int
    offset: int
    perms: str
    path: str
    inode: int
    deleted: bool = False

    @property
    def is_file(self) -> bool:
        """Backed by a file (not anonymous, not [heap]/[stack]/[vdso]...)."""
        return self.inode != 0 and self.path.startswith("/")

    @property
    def is_jit(self) -> bool:
        """Executable anonymous memory (or a memfd, which JIT runtimes map
        twice, writable and executable): code made at run time."""
        return "x" in self.perms and (
            (not self.is_file and not self.path.startswith("[v")) or self.path.startswith("/memfd:"))

    def file_offset(self, addr: int) -> int:
        return addr - self.start + self.offset


def parse_maps(text: str) -> list[Mapping]:
    """Parse the contents of a /proc/PID/maps file."""
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        lo, _, hi = parts[0].partition("-")
        path = parts[5] if len(parts) > 5 else ""
        deleted = path.endswith(" (deleted)")
        if deleted:
            path = path[: -len(" (deleted)")]
        out.append(Mapping(int(lo, 16), int(hi, 16), int(parts[2], 16),
                           parts[1], path, int(parts[4]), deleted))
    return out


# The lines of /proc/PID/maps that symbols and unwinding need: executable
# ones (code made at run time too), read-only file mappings (an ELF file's
# first mapping gives its load bias), [vdso]/[vsyscall].  The rest changes
# with every allocation of a busy target and never holds a pc: the heap,
# thread stacks, anonymous buffers, and writable file mappings (a torch
# DataLoader hands every batch over in shared memory, a new mapping each).
_CODE_OR_FILE = re.compile(
    r"^[0-9a-f]+-[0-9a-f]+ (?:[r-][w-]x[ps-] [^\n]*|r-[-x][ps] \S+ \S+ [1-9][^\n]*|[^\n]*\[v[^\n]*)\n?",
    re.M)


def code_and_file_lines(text: str) -> str:
    """The part of a /proc/PID/maps text that symbols and unwinding need
    (_CODE_OR_FILE): stable while a target only allocates, so a snapshot
    that did not change it is not parsed again, and an AddressSpace does not
    keep every buffer a long recording saw come and go."""
    return "".join(m.group(0) for m in _CODE_OR_FILE.finditer(text))


def read_maps(pid: int) -> list[Mapping]:
    """Mappings of a live process; raises OSError when it is gone."""
    with open(f"/proc/{pid}/maps") as f:
        return parse_maps(f.read())


class AddressSpace:
    """The mappings of one process, merged over successive snapshots.

    A newer snapshot wins wherever it overlaps an older mapping; older
    mappings that nothing newer covers are kept (e.g. a library that was
    unloaded, or everything once the process has exited).
    """

    def __init__(self, pid: Optional[int] = None,
                 maps: Optional[Iterable[Mapping]] = None):
        self.pid = pid
        self._maps: list[Mapping] = []
        self._starts: list[int] = []
        # The process's root when not ours (target_root), read with its
        # first snapshot, while it is alive.
        self.root: Optional[str] = None
        self.root_known = False
        if maps is not None:
            self.add_snapshot(maps)

    @classmethod
    def of_process(cls, pid: int) -> "AddressSpace":
        return cls(pid, read_maps(pid))

    def refresh(self) -> bool:
        """Merge a fresh snapshot of the process; False if it is gone."""
        if self.pid is None:
            return False
        try:
            self.add_snapshot(read_maps(self.pid))
        except OSError:
            return False
        return True

    def add_snapshot(self, maps: Iterable[Mapping]) -> None:
        new = sorted(maps, key=lambda m: m.start)
        if not self._maps:
            merged = new
        else:
            new_starts = [m.start for m in new]
            kept = [old for old in self._maps
                    if not _overlaps_any(old, new, new_starts)]
            merged = sorted(kept + new, key=lambda m: m.start)
        self._maps = merged
        self._starts = [m.start for m in merged]
        if not self.root_known and self.pid is not None:
            self.root = target_root(self.pid)
            self.root_known = True

    @property
    def mappings(self) -> list[Mapping]:
        return list(self._maps)

    def find(self, addr: int) -> Optional[Mapping]:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0:
            m = self._maps[i]
            if addr < m.end:
                return m
        return None

    def __len__(self) -> int:
        return len(self._maps)


def _overlaps_any(m: Mapping, sorted_maps: list[Mapping],
                  starts: list[int]) -> bool:
    i = bisect.bisect_left(starts, m.end)  # first with start >= m.end
    return i > 0 and sorted_maps[i - 1].end > m.start


def _same_file(mapping: Mapping, path: str, real: str, st) -> bool:
    """Is ``mapping`` of the file ``path`` (resolved: ``real``)?"""
    if mapping.path in (path, real):
        return True
    # Another name of the same file: same inode and same file name.
    return (st is not None and mapping.inode != 0
            and mapping.inode == st.st_ino
            and os.path.basename(mapping.path) == os.path.basename(real))


def runtime_address(mappings: Iterable[Mapping], path: str, vaddr: int,
                    elf_path: Optional[str] = None,
                    cache: Optional[ElfCache] = None) -> int:
    """Convert ``vaddr`` of object file ``path`` to an address in a process.

    ``mappings`` are the process's maps; ``path`` is matched against their
    paths (a symlink or another name of the same inode also matches).  The
    ELF program headers are read from ``elf_path`` (default ``path``; pass
    /proc/PID/root/... for a process in another mount namespace).  The
    first mapping of the file (lowest address) gives the load bias.  Raises
    LookupError when the file is not mapped."""
    elf_path = elf_path or path
    image = (cache if cache is not None else default_cache()).get(elf_path)
    if image is None:
        raise LookupError(f"cannot read ELF program headers of {elf_path}")
    try:
        st = os.stat(elf_path)
    except OSError:
        st = None
    real = os.path.realpath(path)
    for m in sorted(mappings, key=lambda m: m.start):
        if not _same_file(m, path, real, st):
            continue
        bias = load_bias(m, image.segments)
        if bias is not None:
            return vaddr + bias
    raise LookupError(f"{path} is not mapped in the given address space")
