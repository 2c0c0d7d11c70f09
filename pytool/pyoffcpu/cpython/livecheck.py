"""Does a layout hold on the live process?  The check that lets a CPython
newer than any tested one be profiled on the day it ships.

Such a process is read with the newest tested version's reading of
`_Py_DebugOffsets` (detect.describe).  Nothing vouches for the values that
gives but the process itself, so each is checked against what it must
point at, on every thread state the interpreters list:

* the interpreter list: `_PyRuntime.interpreters.head` is an interpreter,
  each thread state's `interp` is the interpreter whose list holds it;
* the thread ids: each `native_thread_id` is one of the process's threads
  (as its own PID namespace numbers them);
* the thread binding: where BPF will read each thread's PyThreadState
  (autoTSSkey or the thread-local, found before this runs) is known;
* the frames: every code object a thread's frames name is a `code` object
  (PyCode_Type, or a type whose tp_name is "code"); its qualname, name and
  filename are `str` objects, its line table a `bytes` object, its first
  line plausible; the frame's instruction lies inside its bytecode.  At
  least one code object must have been checked.

A layout with fields moved or swapped fails one of these; the caller then
profiles native stacks only and says which check failed.
"""
from __future__ import annotations

import os
from typing import Dict, List, Set

from ..kernel.memory import MemoryError_
from ..kernel.procfs import ns_id
from .process import iter_thread_states
from .walker import walk_frames

MAX_INTERPRETERS = 64
MAX_THREADS = 256
MAX_FRAMES = 64                 # per thread
MAX_LINE = 10_000_000
MAX_BYTECODE = 1 << 24          # bytes into the bytecode


def namespace_tids(pid: int) -> Set[int]:
    """The ids of the process's threads as its PID namespace gives them."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        return set()
    return {ns_id(f"/proc/{pid}/task/{t}/status", t) or t for t in tids}


class _Types:
    """Type names by type address, read once each."""

    def __init__(self, mem, o: Dict[str, int]):
        self.mem, self.o = mem, o
        self.names: Dict[int, str] = {}

    def of(self, obj: int) -> str:
        tp = self.mem.u64(obj + self.o["object_type"])
        if tp not in self.names:
            raw = self.mem.read(self.mem.u64(tp + self.o["type_name"]), 16)
            self.names[tp] = raw.split(b"\0", 1)[0].decode("latin-1")
        return self.names[tp]


def check(pp, mem) -> str:
    """'' when the layout of `pp` holds on its live process, else the first
    check that failed, in words."""
    o = pp.offsets
    try:
        return _check(pp, mem, o)
    except MemoryError_ as e:
        return f"a read failed ({e})"
    except (KeyError, ValueError) as e:
        return f"a value is missing or implausible ({e})"


def _check(pp, mem, o) -> str:
    if not pp.tstate_found:
        return "no thread's PyThreadState is where the layout says"
    tids = namespace_tids(pp.pid)
    types = _Types(mem, o)
    if not mem.u64(pp.runtime + o["runtime_interpreters_head"]):
        return "the interpreter list is empty"
    states: List[int] = []
    for interp, ts in iter_thread_states(pp, mem, MAX_THREADS, MAX_INTERPRETERS):
        if mem.u64(ts + o["tstate_interp"]) != interp:
            return "a thread state's interp is not the interpreter that lists it"
        tid = mem.i64(ts + o["tstate_native_thread_id"])
        if tid and tid not in tids:
            return f"a thread state's native_thread_id ({tid}) is no thread of the process"
        states.append(ts)
    if not states:
        return "the main interpreter lists no thread state"
    codes = 0
    for ts in states:
        frames, _ = walk_frames(mem, pp, ts)
        for code, offset, flags in frames[:MAX_FRAMES]:
            if (flags & 0xff) >= 3:         # the interpreter's own entry frames
                continue
            why = _check_code(pp, mem, o, types, code, offset)
            if why:
                return why
            codes += 1
    if not codes:
        return "no thread has a Python frame to check the layout on"
    return ""


def _check_code(pp, mem, o, types, code: int, offset: int) -> str:
    if pp.code_type:
        if mem.u64(code + o["object_type"]) != pp.code_type:
            return "a frame's code is not a code object (PyCode_Type)"
    elif types.of(code) != "code":
        return "a frame's code is not a code object"
    for key in ("code_qualname", "code_name", "code_filename"):
        if types.of(mem.u64(code + o[key])) != "str":
            return f"a code object's {key[5:]} is not a str"
    if types.of(mem.u64(code + o["code_linetable"])) != "bytes":
        return "a code object's line table is not bytes"
    if not 0 <= mem.i32(code + o["code_firstlineno"]) < MAX_LINE:
        return "a code object's first line is implausible"
    if not -2 <= offset < MAX_BYTECODE:     # -2: a frame about to run its first instruction
        return "a frame's instruction is not inside its code object's bytecode"
    return ""
