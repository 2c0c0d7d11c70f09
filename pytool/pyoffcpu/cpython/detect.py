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


_VERSION_RE = re.compile(rb"\x00(3\.(\d{1,2})\.(\d{1,2})(?:[abc]|rc)?\d*\+?)\x00")


def _version_from_rodata(path: str) -> Optional[Tuple[int, int, int]]:
    """PY_VERSION ("3.9.18") as a NUL-terminated string in .rodata (before 3.11)."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        sec = elf.get_section_by_name(".rodata")
        if sec is None:
            return None
        data = sec.data()
    found = {}
    for m in _VERSION_RE.finditer(data):
        v = (3, int(m.group(2)), int(m.group(3)))
        found[v] = found.get(v, 0) + 1
    if not found:
        return None
    return max(found, key=found.get)


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
            version = _version_from_rodata(real)
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
