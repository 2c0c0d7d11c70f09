"""Where each thread keeps its PyThreadState when CPython holds it in a
thread-local variable instead of under a pthread key.

Up to 3.14 a thread's PyThreadState is `pthread_getspecific(autoTSSkey)`,
which BPF reads in glibc's struct pthread (detect.refresh_tss).  3.15 has no
autoTSSkey: the binding PyGILState_Ensure makes, which survives while the
thread blocks with the GIL released, is the C thread-local `_Py_tss_gilstate`
(Python/pystate.c), a hidden symbol.

On x86_64 the thread pointer (the %fs base) is the thread's TCB, glibc's
struct pthread, whose address is also its pthread_t: `tstate->thread_id`.  A
variable in static TLS (that of the executable, or of a library loaded at
start) lies at the same distance from the thread pointer in every thread,
so BPF reads `*(fsbase + distance)`.

The distance comes from the code of the exported function that returns the
variable, PyGILState_GetThisThreadState, as the target has it mapped:

* the executable (local-exec):      mov %fs:DISP32, %rax
* a library, initial-exec:          mov GOT(%rip), %rax ; mov %fs:(%rax), %rax
                                    (the GOT entry holds the distance)
* a library, general-dynamic:       lea TI(%rip), %rdi ; call __tls_get_addr ;
                                    mov D(%rax), %rax
  TI is the tls_index {module, offset} the dynamic linker filled in; the
  module's block is glibc's dtv[module] of the thread (the dtv pointer at
  tp + 8, 16-byte entries), and the distance block + offset + D - tp.

Nothing of this is trusted until the live threads agree: for every thread
state the interpreter lists, the word at that distance from its thread
pointer must be that state, or another state of the same thread (a thread
running a sub-interpreter), or 0 (a thread that has not bound one yet), and
at least one must be that state.  A library loaded with dlopen() (dynamic TLS, a block
per thread anywhere), musl's other dtv, or code of another shape give no
distance, and the process is profiled without Python frames, saying why.
"""
from __future__ import annotations

import re
import struct
from typing import Callable, List, Optional, Tuple

from ..kernel.memory import MemoryError_

CODE_BYTES = 64                 # of the function read: all three shapes fit
TLS_DTV_UNALLOCATED = (1 << 64) - 1
MAX_DISTANCE = 1 << 24          # static TLS lies within a few MiB of the TCB

_ENDBR = rb"(?:\xf3\x0f\x1e\xfa)?"
_FRAME = rb"(?:\x55\x48\x89\xe5)?"          # push %rbp; mov %rsp,%rbp
_LOCAL_EXEC = re.compile(_ENDBR + _FRAME + rb"\x64\x48\x8b\x04\x25(.{4})", re.S)
_INITIAL_EXEC = re.compile(_ENDBR + _FRAME + rb"\x48\x8b\x05(.{4})\x64\x48\x8b\x00", re.S)
# lea TI(%rip),%rdi (maybe data16); call __tls_get_addr via the PLT or the GOT
# (maybe data16 data16 rex.W); maybe pop %rbp; mov D(%rax),%rax (disp32, disp8, none)
_GENERAL_DYNAMIC = re.compile(
    _ENDBR + _FRAME + rb"\x66?\x48\x8d\x3d(.{4})(?:\x66\x66\x48)?(?:\xe8.{4}|\xff\x15.{4})\x5d?"
    rb"\x48\x8b(?:\x80(.{4})|\x40(.)|\x00)", re.S)


class TlsShape:
    """How the function reaches the variable: a fixed distance, or a
    module's block through the dtv plus an offset in it."""

    def __init__(self, kind: str, distance: int = 0, module: int = 0, offset: int = 0):
        self.kind, self.distance, self.module, self.offset = kind, distance, module, offset

    def distance_for(self, mem, tp: int) -> Optional[int]:
        """The variable's distance from thread pointer `tp`."""
        if self.kind != "general-dynamic":
            return self.distance
        dtv = mem.u64(tp + 8)
        block = mem.u64(dtv + 16 * self.module) if dtv else 0
        if not block or block == TLS_DTV_UNALLOCATED:
            return None
        return (block + self.offset - tp + (1 << 63)) % (1 << 64) - (1 << 63)


def decode(code: bytes, addr: int, read_u64: Callable[[int], int]) -> Tuple[Optional[TlsShape], str]:
    """The shape of PyGILState_GetThisThreadState's code (`code`, read at
    target address `addr`); (None, why) when it is none of the three."""
    m = _LOCAL_EXEC.match(code)
    if m:
        return TlsShape("local-exec", struct.unpack("<i", m.group(1))[0]), ""
    m = _INITIAL_EXEC.match(code)
    if m:
        got = addr + m.end(1) + struct.unpack("<i", m.group(1))[0]
        dist = read_u64(got)
        return TlsShape("initial-exec", (dist + (1 << 63)) % (1 << 64) - (1 << 63)), ""
    m = _GENERAL_DYNAMIC.match(code)
    if m:
        ti = addr + m.end(1) + struct.unpack("<i", m.group(1))[0]
        module, offset = read_u64(ti), read_u64(ti + 8)
        disp = (struct.unpack("<i", m.group(2))[0] if m.group(2) is not None
                else struct.unpack("<b", m.group(3))[0] if m.group(3) is not None else 0)
        if not 0 < module < 1 << 16:
            return None, "its TLS module id %d is not one the dynamic linker gives" % module
        return TlsShape("general-dynamic", module=module, offset=offset + disp), ""
    return None, "PyGILState_GetThisThreadState is code of a shape not known here"


def gilstate_distance(mem, func: int, threads: List[Tuple[int, int]]) -> Tuple[Optional[int], str]:
    """(distance from the thread pointer of `_Py_tss_gilstate`, "") checked on
    `threads` [(PyThreadState, its thread pointer)]; (None, why) when it is
    not found or does not hold; (None, "") when no thread has bound its state
    yet (ask again later)."""
    try:
        shape, why = decode(mem.read(func, CODE_BYTES), func, mem.u64)
    except MemoryError_:
        return None, "cannot read PyGILState_GetThisThreadState"
    if shape is None:
        return None, why
    distance, matched = None, 0
    # a thread running a sub-interpreter has a state in each interpreter: its
    # binding holds the one it runs now, which may be another than `ts`
    states_of = {}
    for ts, tp in threads:
        states_of.setdefault(tp, set()).add(ts)
    for ts, tp in threads:
        if not tp:
            continue
        try:
            d = shape.distance_for(mem, tp)
            if d is None or abs(d) > MAX_DISTANCE:
                return None, ("the thread-local state is not in static TLS (%s code, "
                              "a library loaded with dlopen?)" % shape.kind)
            if distance is not None and d != distance:
                return None, "the thread-local state is not at one distance in every thread"
            distance = d
            val = mem.u64(tp + d)
        except MemoryError_:
            return None, "cannot read the thread-local state of a thread"
        if val == ts:
            matched += 1
        elif val and val not in states_of[tp]:
            return None, ("the thread-local word at %+#x (%s code) holds %#x, not its thread "
                          "state %#x" % (d, shape.kind, val, ts))
    return (distance, "") if matched else (None, "")
