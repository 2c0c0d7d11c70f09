"""`pyoffcpu dump --core FILE`: `dump`'s view of a process that crashed, from
its core file (plain, `coredumpctl dump -o`, or systemd-coredump's
compressed ones).

The files a core names are read from this machine (or under --root, the
tree the process saw as /): a file is used only when its build-id is the
one the core kept in the file's first page, so a library rebuilt since the
crash names no frame instead of naming them wrong.
"""
from __future__ import annotations

import os
import signal
import stat
from typing import Dict, List, Optional, Tuple

from ..targets import corefile as C
from . import postmortem as PM

SIGSTOP = int(signal.SIGSTOP)


def _check_files(core: C.Core, root: Optional[str], exe: Optional[str]
                 ) -> Tuple[Dict[str, Tuple[str, int]], List[str]]:
    """path as the core names it -> (our path, inode) for the files that
    match it; and the notes on the others."""
    from ..native.elfcache import default_cache
    exe_core = PM.exe_path(core.files, core.auxv)
    ok: Dict[str, Tuple[str, int]] = {}
    changed, gone, unchecked = [], [], []
    first = {}
    for fm in core.files:
        if fm.offset == 0:
            first.setdefault(fm.path, fm)
    for path in dict.fromkeys(fm.path for fm in core.files):
        ours = exe if (exe and path == exe_core) else PM.host_path(path, root)
        try:
            st = os.stat(ours)
        except OSError:
            gone.append(path)
            continue
        if not stat.S_ISREG(st.st_mode):
            gone.append(path)
            continue
        want = C.build_id_in_core(core, first[path]) if path in first else None
        info = default_cache().get(ours)
        have = info.build_id if info is not None else None
        if want is not None and have != want:
            changed.append(f"{path} (build-id {want[:12]} in the core, "
                           f"{have[:12] if have else 'none'} on disk)")
            continue
        if want is None and info is not None:
            unchecked.append(path)
        ok[path] = (ours, st.st_ino)
    notes = []
    if changed:
        notes.append("changed since the crash, their frames are not named: " + "; ".join(changed))
    if gone:
        notes.append("not on this machine" + (f" under {root}" if root else "") +
                      ", their frames are not named: " + ", ".join(gone))
    if unchecked:
        notes.append("no build-id in the core to check them by (used as they are): " +
                     ", ".join(unchecked[:8]) + (" ..." if len(unchecked) > 8 else ""))
    return ok, notes


def _maps(core: C.Core, ok: Dict[str, Tuple[str, int]]):
    """/proc/PID/maps as it was, with our paths (a file that does not match
    keeps no path: it is then neither symbolized nor unwound by table)."""
    from ..native.symbols import Mapping
    by_start = {fm.start: fm for fm in core.files}
    vdso = core.auxv.get(33)            # AT_SYSINFO_EHDR
    out = []
    for seg in core.segments:
        fm = by_start.get(seg.vaddr)
        path, inode, offset = "", 0, 0
        if fm is not None:
            offset = fm.offset
            if fm.path in ok:
                path, inode = ok[fm.path]
        elif seg.vaddr == vdso:
            path = "[vdso]"
        out.append(Mapping(seg.vaddr, seg.vaddr + seg.memsz, offset, seg.perms, path, inode))
    # the file mappings a core has no segment for (gdb's gcore leaves out the
    # read-only ones: code, .rodata), known from NT_FILE; executable when
    # they are a text segment by their file's program headers
    starts = {seg.vaddr for seg in core.segments}
    for fm in core.files:
        if fm.start not in starts and fm.path in ok:
            path, inode = ok[fm.path]
            out.append(Mapping(fm.start, fm.end, fm.offset, _file_perms(path, fm.offset), path, inode))
    out.sort(key=lambda m: m.start)
    return out


def _file_perms(path: str, offset: int) -> str:
    """A mapping's permissions as its file's PT_LOAD at that offset gives
    them (NT_FILE has none): `r-xp` for code, `r--p` otherwise."""
    from ..native.elfcache import default_cache
    from ..native.elffile import PF_X, segment_for_offset
    elf = default_cache().get(path)
    seg = segment_for_offset(offset, elf.segments) if elf is not None else None
    return "r-xp" if seg is not None and seg.flags & PF_X else "r--p"


def _blank_stacks(core: C.Core) -> List[int]:
    """The threads whose stack, at their stack pointer, the core keeps as
    zeros (a return address is never 0: nothing was written there)."""
    out = []
    for t in core.threads:
        sp = t.regs.get("sp") if t.regs else None
        seg = C.segment_at(core, sp) if sp else None
        got = core.bytes_at(seg, sp, 256) if seg is not None else None
        if got is not None and not any(got):
            out.append(t.tid)
    return out


def dump_core(path: str, root: Optional[str] = None, exe: Optional[str] = None,
              native: bool = True, with_locals: bool = False):
    """The ProcessDump of the core at path.  Raises corefile.CoreError."""
    from ..cpython import detect
    core = C.open_core(path)
    try:
        ok, notes = _check_files(core, root, exe)
        maps = _maps(core, ok)
        mem = C.CoreMemory(core, {fm.start: ok[fm.path][0] for fm in core.files if fm.path in ok})
        exe_core = PM.exe_path(core.files, core.auxv)
        pp, why = None, ""
        try:
            pp = detect.find_python(0, maps, mem=mem, exe=ok[exe_core][0] if exe_core in ok else "")
        except Exception as e:                      # noqa: BLE001 - not Python: native only
            why = f"not a CPython process ({e}): no Python frames"
        si = core.siginfo
        first = core.threads[0]
        fatal = None
        if si is not None and si.signo == SIGSTOP or si is None and first.cursig == SIGSTOP:
            # SIGSTOP kills nothing: a core of a running process (gdb's gcore)
            notes.append("a core of a process that was running (stopped by SIGSTOP, "
                         "as gdb's gcore stops it), not of a crash")
        elif si is not None:
            fatal = PM.Fatal(first.tid, si.signo, si.code, si.addr, si.sender)
        elif first.cursig:
            fatal = PM.Fatal(first.tid, first.cursig, 0)
        threads = [PM.DeadThread(t.tid, t.regs, core.comm if t.tid == core.pid else "")
                   for t in core.threads]
        blank = _blank_stacks(core)
        if blank:
            notes.append(f"{len(blank)} of {len(threads)} threads' stacks hold only zeros in the core "
                         "(gdb 13's gcore writes zeros for a stack whose guard page lies inside it, as "
                         "glibc 2.42+ makes them): their native frames, and the Python frames that "
                         "follow a frame kept on the C stack (3.12+), are lost")
        what = f"core file {path}" + (f" ({core.compressed})" if core.compressed else "")
        d = PM.build(core.pid, core.comm, maps, mem, threads, fatal, pp, native=native,
                     notes=tuple([f"from {what}: {core.args}"] + notes), python_note=why,
                     with_locals=with_locals)
        if pp is not None:
            d.notes.extend(pp.notices)
        d.fatal = fatal.as_dict() if fatal else None
        mem.close()
        return d
    finally:
        core.close()
