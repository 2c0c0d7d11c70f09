"""Walks every thread's Python stack from user space, through /proc/PID/mem.

The same frame records BPF produces ((code address, offset, flags) innermost
first, see bpf/pyoffcpu.h), for the moments BPF cannot see: the threads that
were already blocked when the recording started.  Reads are racy by nature;
a blocked thread's frames do not change, which is what this is used for.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..kernel.bpfdefs import MAX_PY_DEPTH as MAX_DEPTH
from ..kernel.bpfdefs import PYF_ENTRY, PYF_INTERP, PYF_OWN_GIL
from ..kernel.memory import MemoryError_, ProcessMemory
from .process import MAX_INTERPRETERS, PythonProcess, iter_thread_states

MAX_THREADS = 4096

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


def interp_thread_states(mem: ProcessMemory, pp: PythonProcess) -> Dict[int, List[Tuple[int, int]]]:
    """OS thread id -> its (interpreter, PyThreadState) in every interpreter
    it has one in, innermost first: a thread that runs code in a
    subinterpreter has a state there and one in the interpreter it called
    from, and the list of interpreters is newest first, the main one last."""
    out: Dict[int, List[Tuple[int, int]]] = {}
    for interp, ts in iter_thread_states(pp, mem, MAX_THREADS, MAX_INTERPRETERS):
        tid = thread_id(mem, pp, ts)
        if tid > 0:
            out.setdefault(tid, []).append((interp, ts))
    return out


def thread_states(mem: ProcessMemory, pp: PythonProcess) -> Dict[int, int]:
    """OS thread id -> its innermost PyThreadState (interp_thread_states)."""
    return {tid: states[0][1] for tid, states in interp_thread_states(mem, pp).items()}


def walk_thread(mem: ProcessMemory, pp: PythonProcess, states: List[Tuple[int, int]],
                addresses: Optional[List[int]] = None) -> Tuple[Frames, bool]:
    """(frames innermost first, truncated) of one thread across the
    interpreters it is in (states: interp_thread_states'), as BPF walks
    them: each subinterpreter's frames end in its mark, (interpreter,
    its id, PYF_INTERP | PYF_OWN_GIL when its GIL is not the main one's).
    A subinterpreter state with no frames (one left behind) is passed
    over; so are all but the innermost before 3.12 or where pp.interps
    was not found.  `addresses` gets 0 for a mark."""
    lay = pp.interps
    if lay is None:
        states = states[:1]
    out: Frames = []
    for interp, ts in states:
        got: List[int] = []
        frames, truncated = walk_frames(mem, pp, ts, got)
        inner = lay is not None and interp != lay.main
        if inner and not frames:
            continue
        out.extend(frames)
        if addresses is not None:
            addresses.extend(got)
        if truncated or len(out) >= MAX_DEPTH:
            return out, True
        if inner:
            flags = PYF_INTERP
            gil_off = pp.offsets.get("interp_ceval_gil", -1)
            if lay.main_gil and gil_off >= 0 and mem.u64(interp + gil_off) != lay.main_gil:
                flags |= PYF_OWN_GIL
            out.append((interp, mem.i32(interp + lay.id_offset), flags))
            if addresses is not None:
                addresses.append(0)
    return out, False


def all_thread_stacks(pp: PythonProcess, pid: Optional[int] = None) -> Dict[int, Tuple[Frames, bool]]:
    """tid -> (frames, truncated) for every Python thread of pp's process,
    or of process pid, a copy of pp's image (a fork's child); threads whose
    structures cannot be read are left out."""
    out = {}
    mem = ProcessMemory(pp.pid if pid is None else pid)
    try:
        for tid, states in interp_thread_states(mem, pp).items():
            try:
                out[tid] = walk_thread(mem, pp, states)
            except MemoryError_:
                continue
    except MemoryError_:
        pass
    finally:
        mem.close()
    return out
