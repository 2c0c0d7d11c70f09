"""A process's registration with BPF: its struct proc_info (bpf/pyoffcpu.h),
which frame walker and which offsets BPF reads its Python frames with,
where its GIL state and the cyclic collector's flag lie.  Filled for the
profiler's targets (processes.py) and the crash watcher's
(collect/crashcapture.py) alike."""
from __future__ import annotations

import ctypes
from typing import Optional, Tuple

from ..kernel import bpfdefs
from ..cpython import detect
from ..cpython.code import StampLayout


def gc_flag(py: detect.PythonProcess) -> Tuple[int, int]:
    """(gc_flag, gc_collecting) of struct proc_info: where BPF reads whether
    the cyclic collector runs; (0, -1): not read (a layout not measured)."""
    from ..cpython.object_table import LAYOUTS
    lay = LAYOUTS.get(py.minor)
    if lay is None or py.free_threaded or lay.get("gc_collecting", -1) < 0:
        return 0, -1
    if lay["gc_base"] == "runtime":
        return py.runtime + lay["gc_collecting"], -1
    return 0, lay["gc_collecting"]


def fill_proc_info(info, py: Optional[detect.PythonProcess], epoch: int,
                   gil: Optional[detect.GilLayout] = None) -> None:
    """info (a struct proc_info, bpf/pyoffcpu.h, as ctypes) for a process
    whose interpreter is py (None, or its thread state not found: native
    stacks only); gil: where BPF reads its GIL state (None: it does not).
    The profiler's registrations and the crash watcher's (collect/crashcapture.py)."""
    for name, t in info._fields_:
        if t is ctypes.c_int:
            setattr(info, name, -1)     # the ints: offsets, -1 none
    info.walker = bpfdefs.WALK_NONE
    info.epoch = epoch
    info.gil_addr = 0
    info.tstate_tls = 0
    info.gc_flag = 0
    info.main_interp = info.main_gil = 0
    if py is None or not py.tstate_found:
        return
    o = py.offsets
    info.walker = detect.walker_kind(py.minor)
    info.tss_key = py.tss_key
    info.tstate_tls = py.tstate_tls if py.tstate_tls is not None else 0
    info.pthread_specific = py.thread_layout.specific_1stblock
    for name in ("tstate_frame", "tstate_cframe", "cframe_current_frame",
                 "tstate_current_frame", "frame_back", "frame_code", "frame_lasti",
                 "iframe_code", "iframe_previous", "iframe_instr", "iframe_is_entry",
                 "iframe_owner", "code_code_adaptive"):
        setattr(info, name, o[name])
    StampLayout.of(o).fill(info)
    if gil is not None:
        info.tstate_interp = o["tstate_interp"]
        info.interp_ceval_gil = gil.interp_ceval_gil
        info.gil_holder = gil.holder
        info.gil_addr = gil.addr
        info.gc_flag, info.gc_collecting = gc_flag(py)
    if py.interps is not None:
        info.main_interp = py.interps.main
        info.main_gil = py.interps.main_gil
        info.interp_id = py.interps.id_offset
        info.tstate_interp = o["tstate_interp"]
        for name in ("interp_threads_head", "tstate_next", "tstate_thread_id"):
            setattr(info, name, o[name])
