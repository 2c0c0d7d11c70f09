"""Finds the CPython interpreter inside a process and what BPF needs to walk it.

The interpreter is found by the `_PyRuntime` symbol in the executable or in a
loaded shared object (static, shared, venvs, renamed or embedded builds).  The
version comes from the ELF and the target's memory, never from a file name:
`Py_Version` (3.11+), the `_Py_DebugOffsets` header at the start of
`_PyRuntime` (3.13+), or before 3.11 the newest exported C-API function plus
the PY_VERSION string.

Offsets come from the generated table (offsets_table.py); from 3.13 on the
values the target publishes in `_Py_DebugOffsets` replace them, and a
disagreement is reported as a notice.  The pthread key of `autoTSSkey` (what
BPF reads to find a thread's PyThreadState) is read from `_PyRuntime` and
checked against the live threads' thread-specific data, which also finds it
where the table's position is wrong (3.7.0-3.7.3 lay `_PyRuntime` out
differently from 3.7.4+) or unverified (3.14).
"""
from __future__ import annotations

import os
import re
import struct
from typing import Dict, List, Optional, Sequence, Tuple

from ..native import symbols
from ..native.elfcache import default_cache
from ..kernel.memory import MemoryError_, ProcessMemory
from ..native import libc
from . import debug_offsets, livecheck, tls
from .process import GilLayout, PythonProcess, iter_thread_states
from .offsets_table import OFFSETS, OFFSETS_FROM_SOURCE

SUPPORTED = sorted(set(OFFSETS) | set(OFFSETS_FROM_SOURCE))
SUPPORTED_TEXT = "%d.%d-%d.%d" % (SUPPORTED[0] + SUPPORTED[-1])
# A minor version above the newest tested one is read with its layout, from
# its own _Py_DebugOffsets, and profiled only when that layout holds on the
# live process (livecheck.py).
NEWEST = SUPPORTED[-1]
FIRST_BLOCK_KEYS = 32           # glibc keeps keys < 32 inline in struct pthread
MAX_SCAN_THREADS = 16           # thread states looked at to derive the tss key
MAX_TLS_THREADS = 1024          # ... and checked against the thread-local (3.15+)


class NotPython(Exception):
    """The process has no CPython runtime we can find."""


class Unsupported(Exception):
    """A CPython we cannot walk (version, free-threaded build)."""


def proc_path(pid: int, path: str) -> str:
    """A path as the target sees it (containers), falling back to ours."""
    p = f"/proc/{pid}/root{path}"
    return p if os.path.exists(p) else path


def table_for(minor: Tuple[int, int]) -> Tuple[Optional[Dict[str, int]], bool]:
    """(offsets, from_source) of a minor version; (None, False) if unsupported."""
    if minor in OFFSETS:
        return OFFSETS[minor], False
    if minor in OFFSETS_FROM_SOURCE:
        return OFFSETS_FROM_SOURCE[minor], True
    return None, False


def _candidates(pid: int, maps, exe: Optional[str] = None) -> List[str]:
    """The files that may define the runtime: the executable (a static
    build, renamed or copied as it may be), then libpython3.X.so, then the
    other shared objects whose name mentions python.  Not the rest: reading
    the symbol table of each library of a large native process (hundreds of
    thousands of symbols) took -a seconds per new process, and a runtime
    lives in a library named for it.  Extension modules (.cpython-3XX-...so,
    libtorch_python) hold none."""
    if exe is None:
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            exe = None
    seen, out = set(), []
    paths = [exe] if exe else []

    def rank(p: str) -> int:
        name = os.path.basename(p)
        if name.startswith("libpython"):
            return 0
        if ".cpython-" in name or name.startswith("libtorch_python") or "python" not in name:
            return 2
        return 1
    libs = sorted((m.path for m in maps if m.path.startswith("/") and ".so" in m.path
                   and rank(m.path) < 2), key=rank)
    for p in paths + libs:
        if p and p not in seen:
            seen.add(p)
            out.append(p)
    return out


def _address(maps, path: str, real: str, vaddr: int) -> Optional[int]:
    try:
        return symbols.runtime_address(maps, path, vaddr, elf_path=real)
    except (LookupError, OSError):
        return None


# Before 3.11 there is no Py_Version. The minor version is told by the newest
# C-API function the binary exports (each first appeared in that release); the
# patch level from the PY_VERSION string, which the linker may have merged as the
# tail of a longer string (a build path), hence no NUL required before it.
_API_SINCE = [((3, 10), "PyModule_AddObjectRef"), ((3, 9), "PyFrame_GetCode"),
              ((3, 8), "PyCode_NewWithPosOnlyArgs"), ((3, 7), "PyThread_tss_alloc")]
_VERSION_RE = re.compile(rb"(?<![0-9.])([23])\.(\d{1,2})\.(\d{1,2})(?:(?:a|b|rc)\d+)?\+?\x00")


def _rodata_versions(path: str) -> Dict[Tuple[int, int, int], int]:
    """How often each X.Y.Z string ends a NUL-terminated string in .rodata
    (counted once per file identity: -a meets many processes of one binary)."""
    def count(data: bytes) -> Dict[Tuple[int, int, int], int]:
        counts: Dict[Tuple[int, int, int], int] = {}
        for m in _VERSION_RE.finditer(data):
            v = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
            counts[v] = counts.get(v, 0) + 1
        return counts
    return dict(default_cache().from_section(path, ".rodata", "rodata-versions", count))


def _patch_from_rodata(path: str, minor: Tuple[int, int]) -> int:
    counts = {v: n for v, n in _rodata_versions(path).items() if v[:2] == minor}
    return max(counts, key=counts.get)[2] if counts else 0


def _version_before_311(path: str) -> Optional[Tuple[int, int, int]]:
    found = default_cache().defined_symbols(path, [name for _, name in _API_SINCE])
    for minor, name in _API_SINCE:
        if name in found:
            return minor + (_patch_from_rodata(path, minor),)
    return None


def _old_version(path: str) -> Optional[Tuple[int, int, int]]:
    """The version of a CPython older than 3.7 (no _PyRuntime), best effort."""
    counts = _rodata_versions(path)
    return max(counts, key=counts.get) if counts else None


def may_become_python(pid: int) -> bool:
    """Can this process's program be CPython once it has started: its
    executable defines the runtime, or links a libpython?  False for the
    shells, tools and servers an -a recording sees exec all the time, which
    are then not looked at again and again while they start.  (A program
    that dlopen()s libpython later, an embedding one, is found by its
    samples instead.)"""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    real = proc_path(pid, exe)
    if default_cache().defined_symbols(real, ("_PyRuntime", "Py_GetVersion")):
        return True
    return any("python" in n for n in default_cache().needed(real))


def find_python(pid: int, maps=None, mem=None, exe: Optional[str] = None) -> PythonProcess:
    """Raises NotPython or Unsupported; returns the runtime, maybe with tss_key -1
    when the interpreter has not finished starting (call `refresh_tss` again).

    `mem` and `exe`: a process that is no more (a core file, corefile.py):
    its memory, and its executable's path; its maps' paths are then ours."""
    if maps is None:
        maps = symbols.read_maps(pid)
    old = None
    for path in _candidates(pid, maps, exe):
        real = proc_path(pid, path) if mem is None else path
        syms = default_cache().defined_symbols(real, ("_PyRuntime", "Py_GetVersion"))
        vaddr = syms.get("_PyRuntime")
        if vaddr is None:
            if old is None and "Py_GetVersion" in syms:
                old = real
            continue
        runtime = _address(maps, path, real, vaddr)
        if runtime is None:
            continue
        return _describe(pid, maps, path, real, runtime, mem)
    if old is not None:
        v = _old_version(old)
        what = ("CPython %d.%d" % v[:2] if v and v[:2] < SUPPORTED[0]
                else "this CPython (no _PyRuntime: older than %d.%d)" % SUPPORTED[0])
        raise Unsupported(f"{what} is not supported (supported: {SUPPORTED_TEXT})")
    raise NotPython(f"no CPython runtime (_PyRuntime) in process {pid}")


# Before 3.13, defined only by Py_REF_DEBUG / Py_TRACE_REFS builds, whose
# object headers and structs the table does not describe: such a build gets
# native stacks only (fails safe; a release build never defines them).  From
# 3.13 the target publishes its own layout in _Py_DebugOffsets, so a debug
# build is walked like any other, and only named as one: by a symbol that
# Py_REF_DEBUG alone defines (3.14's release builds export
# _Py_ForgetReference too, so it tells nothing there).
DEBUG_BUILD_SYMBOLS = ("_Py_RefTotal", "_Py_GetGlobalRefTotal", "_Py_ForgetReference",
                       "_Py_PrintReferences")
DEBUG_BUILD_SYMBOLS_313 = ("_Py_GetGlobalRefTotal",)


def _describe(pid, maps, path, real, runtime, dead_mem=None) -> PythonProcess:
    named = ("Py_Version", "PyCode_Type", "PyGILState_GetThisThreadState")
    syms = default_cache().defined_symbols(real, named + DEBUG_BUILD_SYMBOLS)
    addrs = {name: _address(maps, path, real, syms[name]) for name in named if name in syms}
    debug = [name for name in DEBUG_BUILD_SYMBOLS if name in syms]
    mem = ProcessMemory(pid) if dead_mem is None else dead_mem
    try:
        layout, notes = libc.thread_layout(pid, maps, mem)
        return describe(mem, pid, path, runtime, {k: v for k, v in addrs.items() if v},
                        lambda: _version_before_311(real), debug_build=debug,
                        thread_layout=layout, notices=notes)
    finally:
        if dead_mem is None:
            mem.close()


def describe(mem, pid: int, path: str, runtime: int, addrs: Dict[str, int],
             old_version=lambda: None, debug_build: Sequence[str] = (),
             thread_layout: libc.ThreadLayout = libc.GLIBC_236,
             notices: List[str] = ()) -> PythonProcess:
    """The PythonProcess of the runtime at `runtime` (&_PyRuntime) in `mem`.

    `addrs`: target addresses of the symbols Py_Version, PyCode_Type and
    PyGILState_GetThisThreadState where the binary has them; `old_version()`: the version told by the ELF alone
    (before 3.11); `debug_build`: the DEBUG_BUILD_SYMBOLS the binary
    defines.  Raises Unsupported."""
    version = None
    if "Py_Version" in addrs:
        version = debug_offsets.split_version(mem.u32(addrs["Py_Version"]))
    header = None
    try:
        header = debug_offsets.parse_header(mem.read(runtime, debug_offsets.HEADER_SIZE))
    except (debug_offsets.BadDebugOffsets, MemoryError_):
        pass
    if header is not None:
        dbg_version = debug_offsets.split_version(header[0])
        if version is None:
            version = dbg_version
        elif version[:2] != dbg_version[:2]:
            raise Unsupported("CPython version unclear: Py_Version says %d.%d, "
                              "_Py_DebugOffsets %d.%d" % (version[:2] + dbg_version[:2]))
    if version is None:
        version = old_version()
    if version is None:
        raise Unsupported(f"cannot tell the CPython version of {path}")
    name = "CPython %d.%d" % version[:2]
    table, from_source = table_for(version[:2])
    as_minor = None                 # a newer minor version: read as the newest tested one
    if table is None and version[:2] > NEWEST and header is not None:
        as_minor = NEWEST
        table, from_source = table_for(NEWEST)
    if table is None:
        raise Unsupported(f"{name} is not supported (supported: {SUPPORTED_TEXT})")
    if version[:2] < (3, 13):
        if debug_build:
            raise Unsupported(f"{name} is a debug build ({debug_build[0]}): before 3.13 its "
                              "layouts are not published and the offsets table has release builds only")
        return _finish(PythonProcess(pid, version, path, runtime, dict(table),
                                     from_source=from_source, thread_layout=thread_layout,
                                     notices=list(notices)), mem, addrs)
    # 3.13+: the build says what it is, and how it is laid out, in _Py_DebugOffsets.
    if header is None:
        raise Unsupported(f"{name}: no _Py_DebugOffsets at _PyRuntime")
    free_threaded = header[1]
    if free_threaded and version[:2] >= (3, 14):
        raise Unsupported(f"{name} free-threaded build: its threads run their own copies of "
                          "the bytecode, whose lines pyoffcpu does not read yet")
    debug = any(s in debug_build for s in DEBUG_BUILD_SYMBOLS_313)
    kind = " ".join(w for w, on in (("free-threaded", free_threaded), ("debug", debug)) if on)
    try:
        dbg = debug_offsets.read(mem, runtime, as_minor)
    except (debug_offsets.BadDebugOffsets, MemoryError_) as e:
        if as_minor:
            raise Unsupported(f"{name} is newer than tested (up to %d.%d), and its "
                              f"_Py_DebugOffsets cannot be read as %d.%d's ({e})"
                              % (NEWEST + as_minor)) from None
        if kind:
            raise Unsupported(f"{name} ({kind} build): cannot read _Py_DebugOffsets ({e}), "
                              "and the offsets table has release builds only") from None
        pp = PythonProcess(pid, version, path, runtime, dict(table), from_source=from_source,
                           thread_layout=thread_layout, notices=list(notices))
        pp.notices.append(f"{name}: cannot read _Py_DebugOffsets ({e}): using the offsets table")
        return _finish(pp, mem, addrs)
    offsets, differ = debug_offsets.merge(table, dbg)
    pp = PythonProcess(pid, version, path, runtime, offsets, from_source=from_source,
                       thread_layout=thread_layout, notices=list(notices), debug_offsets=True,
                       free_threaded=free_threaded, debug_build=debug)
    if as_minor:
        # nothing vouches for this layout but the process itself
        _finish(pp, mem, addrs)
        why = livecheck.check(pp, mem)
        if why:
            raise Unsupported(f"{name} is newer than tested (up to %d.%d), and the layout its "
                              f"_Py_DebugOffsets describe does not hold on the live process: {why}"
                              % NEWEST)
        pp.notices.append(f"{name} is newer than tested; layout read from the interpreter")
        return pp
    if differ and not kind:
        # a release GIL build is what the table describes: a difference is news
        pp.notices.append("%s.%d: _Py_DebugOffsets differ from the offsets table in %s: "
                          "using the run-time values" % (name, version[2], ", ".join(differ)))
    return _finish(pp, mem, addrs)


def _finish(pp: PythonProcess, mem, addrs: Dict[str, int]) -> PythonProcess:
    pp.code_type = addrs.get("PyCode_Type", 0)
    pp.gilstate_func = addrs.get("PyGILState_GetThisThreadState", 0)
    refresh_tss(pp, mem)
    return pp


# -- the thread-state key ---------------------------------------------------------
def key_from_runtime(pp: PythonProcess, mem) -> Optional[int]:
    """autoTSSkey as `_PyRuntime` holds it, or None (unknown position, not yet
    created, unreadable)."""
    o = pp.offsets
    if o.get("runtime_autotss", -1) < 0:
        return None
    base = pp.runtime + o["runtime_autotss"]
    try:
        if mem.i32(base + o["tss_is_initialized"]) != 1:
            return None
        return mem.u32(base + o["tss_key"])
    except MemoryError_:
        return None


def thread_state_addresses(pp: PythonProcess, mem, limit: int = MAX_SCAN_THREADS) -> List[int]:
    """The first `limit` PyThreadStates of every interpreter (racy, best effort)."""
    out: List[int] = []
    try:
        for _, ts in iter_thread_states(pp, mem, limit, limit):
            out.append(ts)
    except MemoryError_:
        pass
    return out


def key_from_threads(pp: PythonProcess, mem) -> Optional[int]:
    """The pthread key under which the live threads keep their own PyThreadState.

    `tstate->thread_id` is the thread's pthread_t, which glibc on x86_64 makes
    the address of its struct pthread; its `specific_1stblock[key]` is
    {seq, data}.  The key whose data is the thread state itself is autoTSSkey.
    The first thread read also confirms where specific_1stblock is
    (libc.confirm): pp.thread_layout is corrected if its libc said otherwise."""
    for ts in thread_state_addresses(pp, mem):
        try:
            pthread = mem.u64(ts + pp.offsets["tstate_thread_id"])
            if not pthread:
                continue
            seen = libc.confirm(pp.thread_layout, mem, pthread)
            if seen is not None and seen != pp.thread_layout:
                pp.notices.append(
                    "struct pthread keeps thread-specific data at %#x, not at %#x as %s "
                    "implies: using %#x" % (seen.specific_1stblock,
                                            pp.thread_layout.specific_1stblock,
                                            pp.thread_layout.source, seen.specific_1stblock))
                pp.thread_layout = seen
            block = mem.read(pthread + pp.thread_layout.specific_1stblock, 16 * FIRST_BLOCK_KEYS)
        except MemoryError_:
            continue
        for key in range(FIRST_BLOCK_KEYS):
            seq, data = struct.unpack_from("<QQ", block, 16 * key)
            if data == ts and seq & 1:
                return key
    return None


def refresh_tss(pp: PythonProcess, mem: Optional[ProcessMemory] = None) -> bool:
    """Find where BPF reads each thread's PyThreadState once the runtime has
    bound the first one: autoTSSkey, or from 3.15 the thread-local
    _Py_tss_gilstate (tls.py); True when known."""
    if pp.tstate_found:
        return True
    if pp.tss_key == -2:
        return False
    own = mem is None
    try:
        if own:
            mem = ProcessMemory(pp.pid)
        if pp.offsets.get("runtime_autotss", -1) < 0 and pp.minor >= (3, 15):
            return _refresh_tls(pp, mem)
        stored = key_from_runtime(pp, mem)
        live = key_from_threads(pp, mem)
    except OSError:
        return False
    finally:
        if own and mem is not None:
            mem.close()
    if live is None and stored is None:
        return False
    key = live if live is not None else stored
    if live is not None and stored is not None and live != stored:
        pp.notices.append("CPython %d.%d: autoTSSkey is %d in the threads but %d at the "
                          "offsets table's position: using %d" % (pp.minor + (live, stored, live)))
    if key >= FIRST_BLOCK_KEYS:
        pp.notices.append(
            f"CPython's thread-state key is {key} (>= {FIRST_BLOCK_KEYS}): Python frames unavailable")
        pp.tss_key = -2
        return False
    pp.tss_key = key
    return True


def _refresh_tls(pp: PythonProcess, mem) -> bool:
    """3.15+: _Py_tss_gilstate's distance from the thread pointer, checked on
    the live threads (tls.py); -2 and a notice when it cannot be had."""
    why = "PyGILState_GetThisThreadState is not exported"
    if pp.gilstate_func:
        threads = []
        # every state: a thread's binding may be its state in another interpreter
        for ts in thread_state_addresses(pp, mem, MAX_TLS_THREADS):
            try:
                threads.append((ts, mem.u64(ts + pp.offsets["tstate_thread_id"])))
            except MemoryError_:
                continue
        distance, why = tls.gilstate_distance(mem, pp.gilstate_func, threads)
        if distance is not None:
            pp.tstate_tls = distance
            return True
        if not why:
            return False                # no thread has bound its state yet
    pp.notices.append("CPython %d.%d: cannot find each thread's PyThreadState (%s): "
                      "Python frames unavailable" % (pp.minor + (why,)))
    pp.tss_key = -2
    return False


# -- the GIL ------------------------------------------------------------------------
GIL_CHECKS = 3                  # reads of a live GIL before its layout is given up


def gil_layout(pp: PythonProcess, mem) -> Tuple[Optional[GilLayout], str]:
    """The process's GIL layout, checked on the live process: `locked` is 0
    or 1, and a locked GIL's last_holder is one of its thread states.
    (None, why) when there is none to read (free-threaded) or the offsets
    do not hold there."""
    o = pp.offsets
    if pp.free_threaded:
        return None, "a free-threaded build: no GIL to read"
    holder, locked = o.get("gil_last_holder", -1), o.get("gil_locked", -1)
    if holder < 0 or locked != holder + 8:
        return None, "no GIL layout for CPython %d.%d" % pp.minor
    if pp.minor <= (3, 11):
        if o.get("runtime_gil", -1) < 0:
            return None, "no GIL position in _PyRuntime"
        lay = GilLayout(pp.runtime + o["runtime_gil"], -1, holder)
    else:
        if o.get("interp_ceval_gil", -1) < 0:
            return None, "no ceval.gil position in PyInterpreterState"
        lay = GilLayout(0, o["interp_ceval_gil"], holder)
    for _ in range(GIL_CHECKS):
        try:
            got = read_gil(pp, lay, mem)
        except MemoryError_:
            return None, "its GIL cannot be read"
        if got is None:
            return lay, ""                  # not initialised yet: BPF reads it when it is
        _, last, is_locked = got
        if is_locked == 0 or (is_locked == 1 and last in thread_state_addresses(pp, mem, 4096)):
            return lay, ""
    return None, "its GIL's fields do not hold the values a GIL holds (locked %d)" % is_locked


def read_gil(pp: PythonProcess, lay: GilLayout, mem) -> Optional[Tuple[int, int, int]]:
    """(the GIL's address, last_holder, locked) of the main interpreter's
    GIL now, as BPF reads it; None before the interpreter has one.  Raises
    MemoryError_ when it cannot be read."""
    gil = lay.addr
    if not gil:
        # the main interpreter: the list's last (its head is the newest)
        interp = pp.interps.main if pp.interps is not None else \
            mem.u64(pp.runtime + pp.offsets["runtime_interpreters_head"])
        gil = mem.u64(interp + lay.interp_ceval_gil) if interp else 0
        if not gil:
            return None
    return (gil,) + read_gil_at(mem, gil, lay.holder)


def read_gil_at(mem, gil: int, holder: int) -> Tuple[int, int]:
    """(last_holder, locked) of the GIL (struct _gil_runtime_state) at gil;
    holder: last_holder's offset, locked 8 bytes after.  Raises MemoryError_."""
    return struct.unpack("<QI", mem.read(gil + holder, 12))


def walker_kind(minor: Tuple[int, int]) -> int:
    if minor <= (3, 10):
        return 1      # WALK_FRAMEOBJ
    if minor == (3, 11):
        return 2      # WALK_ISENTRY
    return 3          # WALK_OWNER
