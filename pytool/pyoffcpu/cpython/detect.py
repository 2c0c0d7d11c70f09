"""Finds the CPython interpreter inside a process and what BPF needs to walk it.

The interpreter is found by the `_PyRuntime` symbol in the executable or in a
loaded shared object (static, shared, venvs, renamed or embedded builds); the
version comes from the ELF (`Py_Version`, or the PY_VERSION string), never from
a file name.
"""
from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from elftools.elf.elffile import ELFFile

from .. import symbols
from ..memory import MemoryError_, ProcessMemory
from .offsets_table import OFFSETS

SUPPORTED = sorted(OFFSETS)


@dataclass
class PythonProcess:
    pid: int
    version: Tuple[int, int, int]           # (3, 11, 7)
    binary: str                             # file holding _PyRuntime
    runtime: int                            # &_PyRuntime in the target
    offsets: Dict[str, int]
    tss_key: int = -1                       # autoTSSkey's pthread key, -1 until initialised
    code_type: int = 0                      # &PyCode_Type
    notices: List[str] = field(default_factory=list)

    @property
    def minor(self) -> Tuple[int, int]:
        return self.version[:2]

    @property
    def version_str(self) -> str:
        return "%d.%d.%d" % self.version


class NotPython(Exception):
    """The process has no CPython runtime we can find."""


class Unsupported(Exception):
    """A CPython we cannot walk (version, free-threaded build, glibc)."""


def proc_path(pid: int, path: str) -> str:
    """A path as the target sees it (containers), falling back to ours."""
    p = f"/proc/{pid}/root{path}"
    return p if os.path.exists(p) else path


def _candidates(pid: int, maps) -> List[str]:
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = None
    seen, out = set(), []
    paths = [exe] if exe else []
    # Shared objects whose name mentions python first (libpython3.X.so), then the rest.
    libs = [m.path for m in maps if m.path.startswith("/") and ".so" in m.path]
    libs.sort(key=lambda p: "python" not in os.path.basename(p))
    for p in paths + libs:
        if p and p not in seen:
            seen.add(p)
            out.append(p)
    return out


# Before 3.11 there is no Py_Version. The minor version is told by the newest
# C-API function the binary exports (each first appeared in that release); the
# patch level from the PY_VERSION string, which the linker may have merged as the
# tail of a longer string (a build path), hence no NUL required before it.
_API_SINCE = [((3, 10), "PyModule_AddObjectRef"), ((3, 9), "PyFrame_GetCode"),
              ((3, 8), "PyCode_NewWithPosOnlyArgs"), ((3, 7), "PyThread_tss_alloc")]
_VERSION_RE = re.compile(rb"(?<![0-9.])3\.(\d{1,2})\.(\d{1,2})(?:(?:a|b|rc)\d+)?\+?\x00")


def _minor_from_api(path: str) -> Optional[Tuple[int, int]]:
    for minor, symbol in _API_SINCE:
        if symbols.find_symbol_address(path, symbol) is not None:
            return minor
    return None


def _patch_from_rodata(path: str, minor: Tuple[int, int]) -> int:
    with open(path, "rb") as f:
        sec = ELFFile(f).get_section_by_name(".rodata")
        data = sec.data() if sec is not None else b""
    counts: Dict[int, int] = {}
    for m in _VERSION_RE.finditer(data):
        if (3, int(m.group(1))) == minor:
            patch = int(m.group(2))
            counts[patch] = counts.get(patch, 0) + 1
    return max(counts, key=counts.get) if counts else 0


def _version_before_311(path: str) -> Optional[Tuple[int, int, int]]:
    minor = _minor_from_api(path)
    if minor is None:
        return None
    return minor + (_patch_from_rodata(path, minor),)


def find_python(pid: int, maps=None) -> PythonProcess:
    """Raises NotPython or Unsupported; returns the runtime, maybe with tss_key -1
    when the interpreter has not finished starting (call `refresh_tss` again)."""
    if maps is None:
        maps = symbols.read_maps(pid)
    for path in _candidates(pid, maps):
        real = proc_path(pid, path)
        try:
            vaddr = symbols.find_symbol_address(real, "_PyRuntime")
        except (OSError, Exception):
            continue
        if vaddr is None:
            continue
        runtime = symbols.runtime_address(maps, path, vaddr)
        if runtime is None:
            continue
        return _describe(pid, maps, path, real, runtime)
    raise NotPython(f"no CPython runtime (_PyRuntime) in process {pid}")


def _describe(pid, maps, path, real, runtime) -> PythonProcess:
    mem = ProcessMemory(pid)
    try:
        version = None
        pv = symbols.find_symbol_address(real, "Py_Version")
        if pv is not None:
            addr = symbols.runtime_address(maps, path, pv)
            hexv = mem.u32(addr)
            version = (hexv >> 24, (hexv >> 16) & 0xff, (hexv >> 8) & 0xff)
        if version is None:
            version = _version_before_311(real)
        if version is None:
            raise Unsupported(f"cannot tell the CPython version of {path}")
        if version[:2] >= (3, 13):
            cookie = mem.read(runtime, 8)
            if cookie != b"xdebugpy":
                raise Unsupported(f"CPython {version[0]}.{version[1]}: no debug offsets at _PyRuntime")
            free_threaded = mem.u64(runtime + 16)
            if free_threaded:
                raise Unsupported(f"free-threaded CPython {version[0]}.{version[1]}t is not supported yet")
        offsets = OFFSETS.get(version[:2])
        if offsets is None:
            raise Unsupported("CPython %d.%d is not supported (supported: %s)" % (
                version[0], version[1], ", ".join("%d.%d" % v for v in SUPPORTED)))
        code_type = 0
        ct = symbols.find_symbol_address(real, "PyCode_Type")
        if ct is not None:
            code_type = symbols.runtime_address(maps, path, ct) or 0
        pp = PythonProcess(pid, version, path, runtime, offsets, code_type=code_type)
        refresh_tss(pp, mem)
        return pp
    finally:
        mem.close()


def refresh_tss(pp: PythonProcess, mem: Optional[ProcessMemory] = None) -> bool:
    """Read autoTSSkey once the runtime has created it; True when known."""
    if pp.tss_key >= 0:
        return True
    own = mem is None
    if own:
        mem = ProcessMemory(pp.pid)
    try:
        o = pp.offsets
        base = pp.runtime + o["runtime_autotss"]
        initialised = mem.i32(base + o["tss_is_initialized"])
        key = mem.u32(base + o["tss_key"])
        if initialised == 1:
            if key >= 32:
                pp.notices.append(
                    f"CPython's thread-state key is {key} (>= 32): Python frames unavailable")
                pp.tss_key = -2
                return False
            pp.tss_key = key
            return True
        return False
    except MemoryError_:
        return False
    finally:
        if own:
            mem.close()


def walker_kind(minor: Tuple[int, int]) -> int:
    if minor <= (3, 10):
        return 1      # WALK_FRAMEOBJ
    if minor == (3, 11):
        return 2      # WALK_ISENTRY
    return 3          # WALK_OWNER
