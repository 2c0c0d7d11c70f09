"""A Python process as pyoffcpu knows it once detect.py has found its
interpreter (PythonProcess: its version, _PyRuntime, offsets, how its
threads find their PyThreadState), and the walk of its interpreters' thread
lists that the frame walker, the live check and the thread names share."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

from ..native import libc


@dataclass(frozen=True)
class GilLayout:
    """Where BPF reads a process's GIL state (struct _gil_runtime_state):
    3.7-3.11 one GIL at `addr` (in _PyRuntime); 3.12+ the one each thread's
    interpreter points to (tstate->interp->ceval.gil).  `holder`: offset of
    last_holder in it, `locked` (an int) 8 bytes after."""
    addr: int                   # <= 3.11; 0 for 3.12+
    interp_ceval_gil: int       # 3.12+: offsetof(PyInterpreterState, ceval.gil); -1
    holder: int


@dataclass(frozen=True)
class InterpLayout:
    """Subinterpreters (3.12+): the main PyInterpreterState, its GIL (0: none
    read, a free-threaded build) and where an interpreter keeps its id.  BPF
    marks the frames of any other interpreter's thread state, and follows the
    thread into its state in the main interpreter (bpf/pywalk.c)."""
    main: int
    main_gil: int
    id_offset: int              # offsetof(PyInterpreterState, id): right after `next`


@dataclass
class PythonProcess:
    pid: int
    version: Tuple[int, int, int]           # (3, 11, 7)
    binary: str                             # file holding _PyRuntime
    runtime: int                            # &_PyRuntime in the target
    offsets: Dict[str, int]
    tss_key: int = -1                       # autoTSSkey's pthread key, -1 until known, -2 unusable
    tstate_tls: Optional[int] = None        # 3.15+: _Py_tss_gilstate's distance from the
                                            # thread pointer (tls.py), None until known
    gilstate_func: int = 0                  # &PyGILState_GetThisThreadState (3.15+: tls.py)
    code_type: int = 0                      # &PyCode_Type
    notices: List[str] = field(default_factory=list)
    debug_offsets: bool = False             # offsets include the target's _Py_DebugOffsets
    from_source: bool = False               # the table's values were not compiled (3.14)
    free_threaded: bool = False             # Py_GIL_DISABLED (3.13+: _Py_DebugOffsets says)
    debug_build: bool = False               # Py_DEBUG / Py_REF_DEBUG (3.13+)
    thread_layout: libc.ThreadLayout = libc.GLIBC_236   # its libc's struct pthread
    gil: Optional[GilLayout] = None         # where BPF reads its GIL (None: it does not)
    gil_checked: bool = False               # gil_layout() ran on the live process
    interps: Optional[InterpLayout] = None  # 3.12+: subinterpreters marked (None: not)

    @property
    def minor(self) -> Tuple[int, int]:
        return self.version[:2]

    @property
    def tstate_found(self) -> bool:
        """Does BPF know where each thread keeps its PyThreadState?"""
        return self.tss_key >= 0 or self.tstate_tls is not None

    @property
    def version_str(self) -> str:
        """3.11.7; 3.13.15 free-threaded; 3.14.8 debug."""
        words = [w for w, on in (("free-threaded", self.free_threaded),
                                 ("debug", self.debug_build)) if on]
        return " ".join(["%d.%d.%d" % self.version] + words)


def iter_thread_states(pp: PythonProcess, mem, max_states: int,
                       max_interps: int) -> Iterator[Tuple[int, int]]:
    """(interpreter, PyThreadState) of every interpreter's thread list, at
    most `max_states` states over at most `max_interps` interpreters.  The
    lists are the target's memory: a node met twice (a cycle) ends its
    list, whatever `next` says.  Reads that fail raise MemoryError_."""
    o = pp.offsets
    states = 0
    interps: set = set()
    interp = mem.u64(pp.runtime + o["runtime_interpreters_head"])
    while interp and states < max_states and interp not in interps and len(interps) < max_interps:
        interps.add(interp)
        ts = mem.u64(interp + o["interp_threads_head"])
        seen: set = set()
        while ts and states < max_states and ts not in seen:
            seen.add(ts)
            states += 1
            yield interp, ts
            ts = mem.u64(ts + o["tstate_next"])
        interp = mem.u64(interp + o["interp_next"])


# Interpreters walked at most, here and by every walk of their thread lists
# (walker.py): a longer list is not marked, as its main one would not be met.
MAX_INTERPRETERS = 256


def interpreter_layout(pp: PythonProcess, mem) -> Tuple[Optional[InterpLayout], str]:
    """The main interpreter of a 3.12+ process, checked on the live process:
    it is the last of the interpreter list and its id is 0, every other id is
    positive and distinct, and its thread states name it.  (None, why) when
    there is nothing to mark (before 3.12) or the layout does not hold.
    Reads that fail raise MemoryError_."""
    o = pp.offsets
    need = ("runtime_interpreters_head", "interp_next", "interp_threads_head",
            "tstate_next", "tstate_interp", "tstate_thread_id")
    if pp.minor < (3, 12):
        return None, ""
    if any(o.get(k, -1) < 0 for k in need):
        return None, "no interpreter-list layout for CPython %d.%d" % pp.minor
    id_offset = o["interp_next"] + 8        # int64_t id follows `next` in 3.12-3.15
    interp = mem.u64(pp.runtime + o["runtime_interpreters_head"])
    seen: set = set()
    ids: List[int] = []                     # in list order: the main one's last
    main = 0
    while interp and len(seen) < MAX_INTERPRETERS and interp not in seen:
        seen.add(interp)
        main = interp
        ids.append(struct.unpack("<q", mem.read(interp + id_offset, 8))[0])
        interp = mem.u64(interp + o["interp_next"])
    if not ids:
        return None, ""                     # not initialised yet
    if interp or ids[-1] != 0 or len(set(ids)) != len(ids) or min(ids) < 0:
        return None, "its interpreter list does not hold (ids %s)" % sorted(ids)[:8]
    ts = mem.u64(main + o["interp_threads_head"])
    if ts and mem.u64(ts + o["tstate_interp"]) != main:
        return None, "the main interpreter's thread states do not name it"
    gil_off = o.get("interp_ceval_gil", -1)
    main_gil = mem.u64(main + gil_off) if gil_off >= 0 and not pp.free_threaded else 0
    return InterpLayout(main, main_gil, id_offset), ""
