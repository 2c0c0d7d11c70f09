"""The short text summary printed after a recording: per-thread on/off-CPU
time and the top functions by wall time."""
from __future__ import annotations

from typing import Dict, List, Tuple

from .profile import FrameKind, PathShortener, Profile


def fmt_s(ns: int) -> str:
    return f"{ns / 1e9:.2f} s"


def thread_table(prof: Profile) -> List[Tuple[int, int, str, int, int]]:
    """(pid, tid, name, on-CPU ns, off-CPU ns) per thread, busiest first."""
    acc: Dict[int, List[int]] = {}
    for key, ns in prof.weights.items():
        a = acc.setdefault(key.tid, [key.pid, 0, 0])
        a[1 if key.off_cpu is None else 2] += ns
    rows = [(pid, tid, prof.threads.get(tid, "?"), on, off) for tid, (pid, on, off) in acc.items()]
    rows.sort(key=lambda r: -(r[3] + r[4]))
    return rows


def top_functions(prof: Profile, n: int = 10) -> List[Tuple[str, int, int]]:
    """(label, wall ns, on-CPU ns) of the frames the time is spent in: the
    innermost Python frame of each stack (with its line), or the innermost
    native frame of a stack without Python frames."""
    short = PathShortener()
    acc: Dict[str, List[int]] = {}
    for key, ns in prof.weights.items():
        where = None
        for fr in reversed(key.frames):
            if fr.kind is FrameKind.PYTHON:
                where = fr
                break
            if where is None and fr.kind is FrameKind.NATIVE:
                where = fr
        if where is None:
            continue
        a = acc.setdefault(where.label(False, short), [0, 0])
        a[0] += ns
        if key.off_cpu is None:
            a[1] += ns
    rows = sorted(((k, v[0], v[1]) for k, v in acc.items()), key=lambda r: -r[1])
    return rows[:n]


def render_summary(prof: Profile, top: int = 10) -> str:
    total = prof.total_ns()
    lines = []
    rows = thread_table(prof)
    lines.append(f"  {'thread':<34} {'on-CPU':>10} {'off-CPU':>10} {'wall':>10}")
    for pid, tid, name, on, off in rows[:20]:
        lines.append(f"  {f'{tid} {name}':<34} {fmt_s(on):>10} {fmt_s(off):>10} {fmt_s(on + off):>10}")
    if len(rows) > 20:
        lines.append(f"  ... and {len(rows) - 20} more threads")
    if total:
        lines.append(f"  where the time goes (innermost Python frame; all threads, {fmt_s(total)}):")
        for label, ns, on in top_functions(prof, top):
            lines.append(f"  {100 * ns / total:6.1f}%  {fmt_s(ns):>9}  (on-CPU {100 * on / max(ns, 1):3.0f}%)  {label}")
    return "\n".join(lines)
