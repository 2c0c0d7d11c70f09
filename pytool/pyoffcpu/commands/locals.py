"""`dump --locals`: each Python frame's arguments and locals, and its
source line, read from the target's memory and disk without running any of
its code (cpython/objects.py reads the values, bounded).

The source line is taken from the file the code object names, seen from the
process's root, only where that file is the one the code came from as far
as can be told without a hash: a regular file, not changed since the
process started.  Otherwise no line is shown (a file edited since would
show the wrong one).
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional

from ..native.elfcache import open_regular_file
from ..kernel.procfs import read_text
from ..kernel.procfs import start_ticks

MAX_SOURCE_BYTES = 8 << 20      # a source file read for its line at most
MAX_LINE_SHOWN = 200


def frame_locals(m, tid: int) -> List[dict]:
    """Per Python frame of the thread, innermost first: {"frame" (its label,
    as dump prints it), "source", "locals"}; frames CPython would not show
    are left out, as they are from the stack."""
    from ..cpython.objects import ObjectError, ObjectReader
    pp = m.rec.pythons.get(m.pid)
    frames, _ = m.stacks[tid]
    addresses = m.frame_addresses.get(tid, [])
    try:
        reader = ObjectReader(m.mem, pp.minor, pp.offsets, m.reader)
    except ObjectError as e:
        return [{"frame": "", "source": "", "locals": [], "error": str(e)}]
    sources = _Sources(m.pid)
    out = []
    for (code, offset, flags), addr in zip(frames, addresses):
        if not addr:
            continue                    # a subinterpreter's mark (walker.walk_thread)
        info = m.reader.code(code)
        if info is None:
            continue
        frame = m.merger.python_frame(info, pp.minor, offset, flags)
        if frame is None:
            continue
        values = []
        try:
            for name, is_arg, value in reader.frame_locals(addr, code):
                values.append({"name": name, "argument": is_arg, "repr": reader.repr(value),
                               "value": reader.data(value)})
        except Exception as e:                          # noqa: BLE001 - one frame's are lost
            values.append({"name": "?", "argument": False, "repr": f"<unreadable: {e}>",
                           "value": None})
        out.append({"frame": frame.label(False, m.merger._short),
                    "source": sources.line(frame.file, frame.line), "locals": values})
    return out


class _Sources:
    """Lines of a process's source files, where a file is what the process
    loaded (see the module's doc)."""

    def __init__(self, pid: int):
        self.root = f"/proc/{pid}/root"
        self.started = _start_time(pid)
        self.files: Dict[str, Optional[List[bytes]]] = {}

    def line(self, path: Optional[str], line: Optional[int]) -> str:
        if not path or not line or line < 1 or not path.startswith("/"):
            return ""
        lines = self.files.get(path, False)
        if lines is False:
            lines = self.files[path] = self._read(path)
        if not lines or line > len(lines):
            return ""
        text = lines[line - 1].decode("utf-8", "replace").strip()
        text = "".join(c if c.isprintable() else "?" for c in text)
        return text[:MAX_LINE_SHOWN] + ("..." if len(text) > MAX_LINE_SHOWN else "")

    def _read(self, path: str) -> Optional[List[bytes]]:
        try:
            with open_regular_file(self.root + path) as f:
                st = os.fstat(f.fileno())
                if st.st_size > MAX_SOURCE_BYTES or self.started is None or st.st_mtime > self.started:
                    return None
                return f.read(MAX_SOURCE_BYTES).splitlines()
        except OSError:
            return None


def _start_time(pid: int) -> Optional[float]:
    """When the process started, in unix seconds (None: not known)."""
    ticks = start_ticks(pid)
    boot = next((ln.split()[1] for ln in (read_text("/proc/stat") or "").splitlines()
                 if ln.startswith("btime ")), None)
    if not ticks or boot is None or not boot.isdigit():
        return None
    return int(boot) + ticks / os.sysconf("SC_CLK_TCK")
