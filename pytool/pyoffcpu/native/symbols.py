"""Native symbolization: from a process's address to a function's name.

The modules, in the order a user address flows through them:

* ``procmaps``: which object file an address of a process belongs to
  (``read_maps`` / ``Mapping`` / ``AddressSpace``: snapshots are merged, so
  a process that has exited can still be symbolized from what was seen of
  it), its root directory, and ``runtime_address``.
* here, ``ElfSymbols``: one ELF file's function symbols (from ``.symtab`` /
  ``.dynsym``, or a separate debug file that ``debugfiles`` finds), its
  PT_LOAD segments and build-id.  The files themselves are read by
  ``elffile`` (``ElfCache``): once per session, by file identity, for the
  symbolizer, the unwinder, and the look-ups of data symbols alike.  The
  functions are looked up in the file's index (``symindex``: built once by
  the compiled helper, cached on disk, mapped), never decoded into a Python
  object per symbol; where no symbol covers an address but an ``.eh_frame``
  FDE does (a stripped library's static functions), the FDE names it:
  ``libgomp.so.1@0x1de40``.
* here, ``Symbolizer``: ties them together, caches per file, demangles C++
  names in the process (``demangle``: libstdc++'s ``__cxa_demangle``), and
  resolves kernel addresses through ``kernelsyms.KernelSymbols``.
* here, ``find_symbol_address``: a data symbol such as ``_PyRuntime``.

The names of procmaps, debugfiles and kernelsyms are importable from here
too, as before they had modules of their own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from . import demangle as _demangle
from . import symindex
from .debugfiles import (DEBUG_DIRS_ENV, DEFAULT_DEBUG_DIRS, _debug_candidates,  # noqa: F401 (re-exported)
                         _load_debug_image, build_id_debug_path, debug_dirs_from_env, safe_debuglink)
from .kernelsyms import KernelSymbols
from .procmaps import (AddressSpace, Mapping, code_and_file_lines, parse_maps,  # noqa: F401 (re-exported)
                       path_in_root, read_maps, runtime_address, target_root)

# ELF symbol types, bindings and special section indices are elffile's.
from .elffile import (ADDRESS_TYPES as _ADDRESS_TYPES, FUNC_TYPES as _FUNC_TYPES, SHN_ABS,  # noqa: F401 (STT_* and SHN_* re-exported)
                      SHN_LORESERVE, SHN_UNDEF, STB_GLOBAL, STB_LOCAL, STB_WEAK, STT_FUNC,
                      STT_GNU_IFUNC, STT_NOTYPE, STT_OBJECT, STT_TLS, ElfFile,
                      LoadSegment, load_bias, segment_for_offset)
from .elfcache import ElfCache, default_cache

__all__ = [
    "AddressSpace", "DEBUG_DIRS_ENV", "ElfSymbols", "KernelSymbols",
    "LoadSegment", "Mapping", "ModuleSymbols", "NativeSymbol", "Symbolizer",
    "build_id_debug_path", "debug_dirs_from_env", "demangle",
    "find_symbol_address", "path_in_root", "read_maps", "runtime_address",
    "target_root",
]

MAX_CODE_BYTES = 1 << 20        # a function's code read for analysis, at most


# ---------------------------------------------------------------------------
# ELF files (parsed once per session by elfcache.ElfCache, by file identity)
# ---------------------------------------------------------------------------
def _open_image(path: str, want_types: frozenset = _FUNC_TYPES,
                cache: Optional[ElfCache] = None) -> Optional[ElfFile]:
    """The session's ElfFile of ``path`` (None: unreadable, not ELF), with
    its symbols when ``want_types`` asks for any."""
    return (cache if cache is not None else default_cache()).get(path, symbols=bool(want_types))


class ElfSymbols:
    """Function symbols and load layout of one ELF file.

    Symbols come from ``.symtab`` and ``.dynsym``; when the file has no
    ``.symtab``, a separate debug file is looked up by build-id and then by
    ``.gnu_debuglink``, and its ``.symtab`` is used as well.  The files are
    parsed once per session (ElfCache); their function index (symindex) is
    made once per file and debug file, on first lookup, and cached on disk.
    An ElfSymbols is the view of them from one path.
    """

    def __init__(self, path: str, debug_dirs: Optional[Sequence[str]] = DEFAULT_DEBUG_DIRS,
                 orig_path: Optional[str] = None, *, root: Optional[str] = None,
                 _image: Optional[ElfFile] = None, cache: Optional[ElfCache] = None,
                 _data: Optional[bytes] = None):
        """``path`` is the file to read; ``orig_path`` the name it has in
        the process (for debuglink lookups under /usr/lib/debug); ``root``
        the process's root when it is not ours (debug files are looked up
        there first); ``debug_dirs=None``: no debug file lookup; ``cache``:
        the session's ElfCache (default ``elffile.default_cache()``);
        ``_data``: the bytes of an in-memory image (the vDSO)."""
        cache = cache if cache is not None else default_cache()
        self.path = path
        self.orig_path = orig_path or path
        image = _image if _image is not None else cache.get(path)
        if image is None or image.symbols_failed:
            raise ValueError(f"not a readable ELF file: {path}")
        self.image = image
        self.build_id: Optional[str] = image.build_id
        self.e_type: str = image.e_type
        self.segments: list[LoadSegment] = image.segments
        self.has_symtab: bool = image.has_symtab
        self.debug_file: Optional[str] = None
        self._cache = cache
        self._data = _data
        self._sources = [image]
        self._paths = [path]
        if not image.has_symtab and debug_dirs is not None and _data is None:
            self.debug_file, dbg = _load_debug_image(
                path, image, debug_dirs, orig_path, root=root, cache=cache, symbols=False)
            if dbg is not None:
                self._sources.append(dbg)
                self._paths.append(self.debug_file)
        self._index: Optional[symindex.SymbolIndex] = None

    @property
    def index(self) -> symindex.SymbolIndex:
        """The function index of the file and its debug file (made on first
        use, once per session for the same files)."""
        if self._index is None:
            self._index = symindex.index_for(self._cache, self._sources, self._paths, self._data)
        return self._index

    @classmethod
    def from_bytes(cls, data: bytes, name: str,
                   cache: Optional[ElfCache] = None) -> "ElfSymbols":
        """For in-memory images such as the vDSO (no debug file lookup)."""
        cache = cache if cache is not None else default_cache()
        image = cache.from_bytes(data)
        if image is None:
            raise ValueError(f"not an ELF image: {name}")
        return cls(name, debug_dirs=None, _image=image, cache=cache, _data=data)

    def __len__(self) -> int:
        return len(self.index)

    # -- address conversions ---------------------------------------------
    def file_offset_to_vaddr(self, off: int) -> Optional[int]:
        for seg in self.segments:
            if seg.offset <= off < seg.offset + seg.filesz:
                return off - seg.offset + seg.vaddr
        # The page holding a segment's first bytes may start before p_offset.
        seg = segment_for_offset(off, self.segments)
        return off - seg.offset + seg.vaddr if seg is not None else None

    def vaddr_to_file_offset(self, vaddr: int) -> Optional[int]:
        for seg in self.segments:
            if seg.vaddr <= vaddr < seg.vaddr + max(seg.memsz, seg.filesz):
                return vaddr - seg.vaddr + seg.offset
        return None

    def address_to_vaddr(self, addr: int, mapping: Mapping) -> Optional[int]:
        """Runtime address inside ``mapping`` -> ELF virtual address."""
        return self.file_offset_to_vaddr(mapping.file_offset(addr))

    def load_bias(self, mapping: Mapping) -> Optional[int]:
        """runtime address - ELF virtual address in ``mapping`` (as the
        unwinder computes it: elffile.load_bias)."""
        return load_bias(mapping, self.segments)

    # -- symbol lookup ------------------------------------------------------
    def lookup(self, vaddr: int) -> Optional[tuple[str, int]]:
        """(name, symbol start) of the function containing ``vaddr``."""
        return self.index.lookup(vaddr)

    def fde_start(self, vaddr: int) -> Optional[int]:
        """The start of the .eh_frame FDE covering ``vaddr`` (for code no
        symbol covers), None: none."""
        return self.index.fde_start(vaddr)

    def symbols(self) -> list[tuple[int, int, str]]:
        """(start, end, name) of every function, sorted by start."""
        return self.index.entries()

    def function_range(self, vaddr: int) -> Optional[tuple[int, int]]:
        """(start, end) of the function holding ``vaddr``: by its symbol,
        else by its FDE; None: neither covers it."""
        return self.index.function_range(vaddr)

    def read_code(self, start: int, end: int) -> Optional[bytes]:
        """The file's bytes at ELF virtual addresses [start, end) (code: in
        one PT_LOAD segment's file bytes), read from the very file this was
        made from; None when they are not there or the file changed."""
        if not 0 < end - start <= MAX_CODE_BYTES:
            return None
        seg = next((g for g in self.segments
                    if g.vaddr <= start and end <= g.vaddr + g.filesz), None)
        if seg is None:
            return None
        off = start - seg.vaddr + seg.offset
        if self._data is not None:
            code = self._data[off:off + end - start]
            return code if len(code) == end - start else None
        try:
            opened = symindex.IdentifiedFile(self._cache, self.path)
        except OSError:
            return None
        try:
            if opened.identity != self.image.identity:
                return None
            code = opened.read(off, end - start)
        except OSError:
            return None
        finally:
            opened.close()
        return code if len(code) == end - start else None


# ---------------------------------------------------------------------------
# Data symbols (e.g. _PyRuntime) and their runtime addresses.
# ---------------------------------------------------------------------------
def find_symbol_address(path: str, name: str,
                        debug_dirs: Optional[Sequence[str]] = None,
                        orig_path: Optional[str] = None,
                        root: Optional[str] = None,
                        cache: Optional[ElfCache] = None) -> Optional[int]:
    """ELF virtual address (st_value) of a defined function / object / TLS
    symbol called ``name`` in ``.dynsym`` or ``.symtab`` of ``path`` (or of
    its separate debug file, under ``debug_dirs``, default
    ``debug_dirs_from_env()``; inside ``root`` first, see
    ``_debug_candidates``).  For STT_TLS the value is the offset in the
    module's TLS block."""
    if debug_dirs is None:
        debug_dirs = debug_dirs_from_env()
    cache = cache if cache is not None else default_cache()
    image = cache.get(path, symbols=True)
    if image is None:
        return None
    value = image.address_of(name)
    if value is None and not image.has_symtab and debug_dirs:
        _cand, dbg = _load_debug_image(path, image, debug_dirs, orig_path,
                                       want_types=_ADDRESS_TYPES, root=root,
                                       cache=cache)
        if dbg is not None:
            value = dbg.address_of(name)
    return value


# ---------------------------------------------------------------------------
# C++ demangling
# ---------------------------------------------------------------------------
def demangle(names: Iterable[str]) -> dict[str, str]:
    """Demangle ``_Z`` names; {mangled: readable}.

    In the process (``demangle.demangle_all``: libstdc++'s __cxa_demangle,
    c++filt's text); names that cannot be demangled (or all of them, when
    neither libstdc++ nor c++filt is there) map to themselves."""
    return _demangle.demangle_all(names)


# ---------------------------------------------------------------------------
# Symbolizer
# ---------------------------------------------------------------------------
# A native frame in code made at run time (oneDNN's kernels, a JIT compiler's
# output): no file names it, and the walk ends there (bpf/unwind.c).
JIT_FRAME = "[jit]"


@dataclass(frozen=True)
class NativeSymbol:
    """A resolved user-space address.

    ``name`` is the (mangled) function name or None; ``module`` the path of
    the mapped object (None when no mapping holds the address); ``offset``
    the ELF virtual address inside the module when its ELF file could be
    read, else the file offset (or the raw address when there is no mapping).
    """

    name: Optional[str]
    module: Optional[str]
    offset: int
    symbol_offset: int = 0  # address - start of the function
    # no symbol, but an .eh_frame FDE starting here covers the address (its
    # frame is named module@0xSTART: one name per function)
    fde_start: Optional[int] = None
    jit: bool = False       # in code made at run time (Mapping.is_jit): named [jit]

    @property
    def module_basename(self) -> Optional[str]:
        return os.path.basename(self.module) if self.module else None


@dataclass(frozen=True)
class ModuleSymbols:
    """What the symbolizer found for one object file mapped by a process:
    enough to tell a user what would name its functions."""

    path: str                       # the name its mapping has in /proc/PID/maps
    pid: int
    root: Optional[str] = None      # the process's root when not ours (target_root)
    target_path: str = ""           # the name inside that root (default: path)
    file: Optional[str] = None      # the file read for it; None: unreadable
    build_id: Optional[str] = None
    has_symtab: bool = False        # the file itself has .symtab
    debug_file: Optional[str] = None    # the separate debug file used
    debug_dirs: tuple = DEFAULT_DEBUG_DIRS  # where debug files were looked for

    def __post_init__(self):
        if not self.target_path:
            object.__setattr__(self, "target_path", path_in_root(self.path, self.root))

    @property
    def has_symbols(self) -> bool:
        """Local (static) functions are named: .symtab here or in a debug
        file.  .dynsym alone names only what the object exports."""
        return self.has_symtab or self.debug_file is not None

    def build_id_path(self) -> Optional[str]:
        """The debug file by build-id, in the first debug directory, as the
        process sees its file system."""
        base = self.debug_dirs[0] if self.debug_dirs else DEFAULT_DEBUG_DIRS[0]
        return build_id_debug_path(self.build_id, base) if self.build_id else None


class Symbolizer:
    """Resolves user and kernel addresses to names, caching per file."""

    def __init__(self, debug_dirs: Optional[Sequence[str]] = None,
                 demangle_names: bool = True, elf_cache: Optional[ElfCache] = None):
        """``debug_dirs``: where separate debug files are looked up (default
        ``debug_dirs_from_env()``: $PYOFFCPU_DEBUG_DIRS or /usr/lib/debug);
        for a process with its own root, under that root first.
        ``elf_cache``: the session's parsed ELF files (default
        ``elffile.default_cache()``, shared with the unwinder)."""
        self.debug_dirs = tuple(debug_dirs_from_env() if debug_dirs is None
                                else debug_dirs)
        self.demangle_names = demangle_names
        self.elf_cache = elf_cache if elf_cache is not None else default_cache()
        # (file identity, path, orig_path, root) -> the file seen from there
        # (its debug file is looked up from those names)
        self._elf_by_lookup: dict[tuple, ElfSymbols] = {}
        self._elf_by_mapping: dict[tuple, Optional[ElfSymbols]] = {}
        # pid -> its root when not ours; may be filled in by whoever saw the
        # process alive (its /proc entry is gone once it has exited)
        self.roots: dict[int, Optional[str]] = {}
        self._modules: dict[tuple[int, str], ModuleSymbols] = {}
        self._spaces: dict[int, AddressSpace] = {}
        self._demangled: dict[str, str] = {}
        self._kernel: Optional[KernelSymbols] = None
        self._vdso: Optional[ElfSymbols] = None

    # -- processes ----------------------------------------------------------
    def address_space(self, pid: int) -> AddressSpace:
        """The cached AddressSpace of ``pid`` (read once, on first use)."""
        space = self._spaces.get(pid)
        if space is None:
            space = AddressSpace(pid)
            space.refresh()
            self._spaces[pid] = space
        return space

    def forget_process(self, pid: int) -> None:
        self._spaces.pop(pid, None)
        for key in [k for k in self._elf_by_mapping if k[0] == pid]:
            del self._elf_by_mapping[key]

    def root_of(self, pid: int, space: Optional[AddressSpace] = None
                ) -> Optional[str]:
        """The process's own root when it is not ours: as set in ``roots``,
        else as its address space saw it while it was alive, else
        ``target_root`` now; decided once per process."""
        if pid not in self.roots:
            if space is not None and space.root_known:
                self.roots[pid] = space.root
            else:
                self.roots[pid] = target_root(pid)
        return self.roots[pid]

    def module_symbols(self) -> dict[tuple[int, str], ModuleSymbols]:
        """(pid, path as the process maps it) -> what was found for every
        file-backed object resolved so far."""
        return dict(self._modules)

    # -- files ----------------------------------------------------------------
    def elf_for_path(self, path: str, orig_path: Optional[str] = None,
                     root: Optional[str] = None) -> Optional[ElfSymbols]:
        """ElfSymbols of the file at ``path`` now, None when it is not a
        readable ELF file.  The file is parsed once per session whatever its
        path (the session's ElfCache, by file identity); its debug file is
        looked up once per name it is reached by and ``root`` (under which
        debug files are looked up first)."""
        image = self.elf_cache.get(path)
        if image is None or image.symbols_failed:
            return None
        key = (image.identity, path, orig_path, root)
        elf = self._elf_by_lookup.get(key)
        if elf is None:
            elf = ElfSymbols(path, self.debug_dirs, orig_path, root=root,
                             _image=image, cache=self.elf_cache)
            self._elf_by_lookup[key] = elf
        return elf

    def prefetch(self, pid: int, m: Mapping, space: Optional[AddressSpace] = None) -> None:
        """Have the function index of the file mapped by ``m`` built in the
        background (symindex.prefetch), for a profile to come."""
        elf = self._elf_for_mapping(pid, m, space)
        if elf is not None and elf._index is None and elf._data is None:
            symindex.prefetch(self.elf_cache, elf._sources, elf._paths)

    def _elf_for_mapping(self, pid: int, m: Mapping,
                         space: Optional[AddressSpace] = None) -> Optional[ElfSymbols]:
        key = (pid, m.path, m.inode, m.deleted)
        try:
            return self._elf_by_mapping[key]
        except KeyError:
            pass
        if m.path == "[vdso]":
            elf = self._vdso_symbols()
        elif not m.path.startswith("/"):
            elf = None
        else:
            elf = None
            root = self.root_of(pid, space)
            for cand in self._file_candidates(pid, m):
                elf = self.elf_for_path(cand, m.path, root)
                if elf is not None:
                    break
            if elf is None:     # (an ElfSymbols with no functions is falsy)
                info = ModuleSymbols(m.path, pid, root, debug_dirs=self.debug_dirs)
            else:
                info = ModuleSymbols(m.path, pid, root, file=elf.path,
                                     build_id=elf.build_id, has_symtab=elf.has_symtab,
                                     debug_file=elf.debug_file, debug_dirs=self.debug_dirs)
            self._modules.setdefault((pid, m.path), info)
        self._elf_by_mapping[key] = elf
        return elf

    @staticmethod
    def _file_candidates(pid: int, m: Mapping) -> list[str]:
        """Paths to open for a mapping: same inode first, then any."""
        alive = os.path.exists(f"/proc/{pid}")
        paths = []
        if alive:
            if m.deleted:
                paths.append(f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}")
            paths.append(f"/proc/{pid}/root{m.path}")
        paths.append(m.path)
        matching, other = [], []
        for p in paths:
            try:
                st = os.stat(p)
            except OSError:
                continue
            (matching if st.st_ino == m.inode else other).append(p)
        return matching + other

    def _vdso_symbols(self) -> Optional[ElfSymbols]:
        """The vDSO image (the kernel's, the same in every process), as the
        session's ElfCache read it once."""
        if self._vdso is None:
            v = self.elf_cache.vdso()
            if v is None:
                return None
            self._vdso = ElfSymbols("[vdso]", debug_dirs=None, _image=v[1],
                                    cache=self.elf_cache, _data=v[0])
        return self._vdso

    # -- resolution -------------------------------------------------------
    def resolve_user(self, pid: int, addr: int,
                     address_space: Optional[AddressSpace] = None
                     ) -> NativeSymbol:
        space = address_space if address_space is not None \
            else self.address_space(pid)
        m = space.find(addr)
        if m is None:
            return NativeSymbol(None, None, addr)
        if m.is_jit:
            return NativeSymbol(None, None, addr, jit=True)
        file_off = m.file_offset(addr)
        module = m.path or None
        elf = self._elf_for_mapping(pid, m, space)
        if elf is None:
            return NativeSymbol(None, module, file_off)
        vaddr = elf.file_offset_to_vaddr(file_off)
        if vaddr is None:
            return NativeSymbol(None, module, file_off)
        hit = elf.lookup(vaddr)
        if hit is None:
            fde = elf.fde_start(vaddr)
            if fde is not None:
                return NativeSymbol(None, module, vaddr, vaddr - fde, fde_start=fde)
            return NativeSymbol(None, module, vaddr)
        name, start = hit
        return NativeSymbol(name, module, vaddr, vaddr - start)

    def resolve_kernel(self, addr: int) -> Optional[str]:
        return self.kernel_symbols().resolve(addr)

    def kernel_symbols(self) -> KernelSymbols:
        if self._kernel is None:
            self._kernel = KernelSymbols.load()
        return self._kernel

    # -- naming -------------------------------------------------------------
    def demangled(self, name: str) -> str:
        """Readable form of a symbol name (demangled once per name)."""
        if not self.demangle_names or not name.startswith("_Z"):
            return name
        out = self._demangled.get(name)
        if out is None:
            out = self._demangled[name] = _demangle.demangle(name)
        return out

    def frame_name(self, sym: NativeSymbol) -> str:
        """The frame's name in a profile: the demangled symbol; without one,
        ``module@0xSTART`` of the FDE covering it, else
        ``[unknown] module+0xOFFSET``."""
        if sym.name is not None:
            return self.demangled(sym.name)
        if sym.jit:
            return JIT_FRAME
        if sym.module is None:
            return "[unknown]"
        if sym.fde_start is not None:
            return f"{os.path.basename(sym.module)}@0x{sym.fde_start:x}"
        return f"[unknown] {os.path.basename(sym.module)}+0x{sym.offset:x}"

    def frame_names(self, syms: Iterable[NativeSymbol]) -> list[str]:
        syms = list(syms)
        if self.demangle_names:
            todo = {s.name for s in syms if s.name and s.name.startswith("_Z")
                    and s.name not in self._demangled}
            self._demangled.update(_demangle.demangle_all(todo))
        return [self.frame_name(s) for s in syms]

    def function_code(self, pid: int, addr: int,
                      address_space: Optional[AddressSpace] = None
                      ) -> Optional[tuple]:
        """(file identity, start, end, code) of the function holding the
        user address ``addr``: its symbol's range, else its FDE's (ELF
        virtual addresses), and its bytes; None when neither covers it or
        its bytes cannot be read (over MAX_CODE_BYTES are not).  For what is
        decided from a function's code (merge: an OpenMP runtime's waits)."""
        space = address_space if address_space is not None else self.address_space(pid)
        m = space.find(addr)
        if m is None:
            return None
        elf = self._elf_for_mapping(pid, m, space)
        if elf is None:
            return None
        vaddr = elf.file_offset_to_vaddr(m.file_offset(addr))
        rng = elf.function_range(vaddr) if vaddr is not None else None
        if rng is None:
            return None
        code = elf.read_code(*rng)
        return None if code is None else (elf.image.identity, rng[0], rng[1], code)

    def kernel_frame_name(self, addr: int) -> str:
        return self.resolve_kernel(addr) or "[unknown]"
