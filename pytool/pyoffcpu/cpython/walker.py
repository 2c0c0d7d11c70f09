"""Walks every thread's Python stack from user space, through /proc/PID/mem.

The same frame records BPF produces ((code address, offset, flags) innermost
first, see bpf/pyoffcpu.h), for the moments BPF cannot see: the threads that
were already blocked when the recording started.  Reads are racy by nature;
a blocked thread's frames do not change, which is what this is used for.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..kernel.bpfdefs import MAX_PY_DEPTH as MAX_DEPTH
from ..kernel.bpfdefs import PYF_ENTRY
from ..kernel.memory import MemoryError_, ProcessMemory
from .process import PythonProcess, iter_thread_states

MAX_THREADS = 4096
MAX_INTERPRETERS = 256           # sub-interpreters walked at most

Frames = List[Tuple[int, int, int]]


def _first_frame(mem: ProcessMemory, o: Dict[str, int], minor, tstate: int) -> int:
    if minor <= (3, 10):
        return mem.u64(tstate + o["tstate_frame"])
    if o["tstate_cframe"] >= 0:
        cframe = mem.u64(tstate + o["tstate_cframe"])
        return mem.u64(cframe + o["cframe_current_frame"]) if cframe else 0
    return mem.u64(tstate + o["tstate_current_frame"])


def walk_frames(mem: ProcessMemory, pp: PythonProcess, tstate: int,
                addresses: Optional[List[int]] = None) -> Tuple[Frames, bool]:
    """(frames innermost first, truncated) of one thread state; each
    frame's address (a PyFrameObject before 3.11, an interpreter frame from
    3.11) appended to `addresses` when it is given (its locals)."""
    o, minor = pp.offsets, pp.minor
    f = _first_frame(mem, o, minor, tstate)
    frames: Frames = []
    while f and len(frames) < MAX_DEPTH:
        if addresses is not None:
            addresses.append(f)
        if minor <= (3, 10):
            code = mem.u64(f + o["frame_code"])
            frames.append((code, mem.i32(f + o["frame_lasti"]), PYF_ENTRY))
            f = mem.u64(f + o["frame_back"])
            continue
        code = mem.u64(f + o["iframe_code"]) & ~3
        instr = mem.u64(f + o["iframe_instr"])
        owner = mem.read(f + o["iframe_owner"], 1)[0]
        flags = owner
        if minor == (3, 11) and mem.read(f + o["iframe_is_entry"], 1)[0]:
            flags |= PYF_ENTRY
        offset = (instr - code - o["code_code_adaptive"]) & 0xffffffff
        if offset >= 1 << 31:
            offset -= 1 << 32
        frames.append((code, offset, flags))
        f = mem.u64(f + o["iframe_previous"])
    return frames, bool(f)


def thread_id(mem: ProcessMemory, pp: PythonProcess, ts: int) -> int:
    """The OS thread id of the PyThreadState at ts (0: none yet)."""
    o = pp.offsets
    if o["tstate_native_thread_id"] >= 0:
        return mem.i64(ts + o["tstate_native_thread_id"])
    pthread = mem.u64(ts + o["tstate_thread_id"])
    return mem.i32(pthread + pp.thread_layout.tid) if pthread else 0


def thread_states(mem: ProcessMemory, pp: PythonProcess) -> Dict[int, int]:
    """OS thread id -> PyThreadState address, for every thread of every interpreter."""
    out: Dict[int, int] = {}
    for _, ts in iter_thread_states(pp, mem, MAX_THREADS, MAX_INTERPRETERS):
        tid = thread_id(mem, pp, ts)
        if tid > 0:
            out[tid] = ts
    return out


def all_thread_stacks(pp: PythonProcess, pid: Optional[int] = None) -> Dict[int, Tuple[Frames, bool]]:
    """tid -> (frames, truncated) for every Python thread of pp's process,
    or of process pid, a copy of pp's image (a fork's child); threads whose
    structures cannot be read are left out."""
    out = {}
    mem = ProcessMemory(pp.pid if pid is None else pid)
    try:
        for tid, ts in thread_states(mem, pp).items():
            try:
                out[tid] = walk_frames(mem, pp, ts)
            except MemoryError_:
                continue
    except MemoryError_:
        pass
    finally:
        mem.close()
    return out
