"""Python's names of a process's threads: threading's `Thread.name`, read
from the target's memory (no code of its runs).

`threading._active` maps each thread's ident (pthread_self) to its Thread;
the interpreter's thread states give each ident's OS thread id.  A thread
Python does not know (a C thread, one started by `_thread` directly) gets
no name here: its comm stays.  Cost: one dict of live threads and one
attribute per thread, read at the start and at the end of a recording, or
once per dump.
"""
from __future__ import annotations

import struct
from typing import Dict

from ..kernel.memory import MemoryError_
from . import walker
from .detect import iter_thread_states
from .objects import ObjectError, ObjectReader, layout_for

MAX_NAME = 256                  # characters of a name kept
MAX_ACTIVE = walker.MAX_THREADS


def clean_name(name: str) -> str:
    """A name as every format can hold it: control characters and `;` (the
    folded format's separator) escaped, cut at MAX_NAME."""
    out = []
    for c in name[:MAX_NAME]:
        out.append(c if c.isprintable() and c != ";" else f"\\x{ord(c):02x}" if ord(c) < 256
                   else f"\\u{ord(c) & 0xffff:04x}")
    return "".join(out)


def python_thread_names(pp, mem) -> Dict[int, str]:
    """OS thread id -> its Python name, for the threads threading knows in
    every interpreter; {} where they cannot be read."""
    if pp.free_threaded or layout_for(pp.minor) is None:
        return {}
    reader = ObjectReader(mem, pp.minor, pp.offsets)
    o = pp.offsets
    idents: Dict[int, int] = {}
    interps = []
    try:
        for interp, ts in iter_thread_states(pp, mem, walker.MAX_THREADS, walker.MAX_INTERPRETERS):
            tid = walker.thread_id(mem, pp, ts)
            if tid > 0:
                idents[mem.u64(ts + o["tstate_thread_id"])] = tid
            if interp not in interps:
                interps.append(interp)
    except MemoryError_:
        return {}
    names: Dict[int, str] = {}
    # the main interpreter (the list's last) first: a thread that calls into a
    # subinterpreter whose threading module it was never started by is a
    # _DummyThread there ("Dummy-1"), and its name is the one it was given
    for interp in reversed(interps):
        try:
            active = reader.module_global(interp, "threading", "_active")
            entries = reader.dict_items(active, MAX_ACTIVE)[0] if active else []
        except (MemoryError_, ObjectError, struct.error, UnicodeDecodeError, ValueError):
            continue
        for key, thread in entries:
            try:
                tid = idents.get(reader.int_value(key))
                if tid is None or tid in names:
                    continue
                name = reader.attr(thread, "_name")
                if name:
                    names[tid] = clean_name(reader.str_value(name, MAX_NAME))
            except (MemoryError_, ObjectError, struct.error, UnicodeDecodeError, ValueError):
                continue
    return names
