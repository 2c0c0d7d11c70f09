"""The short text summary printed after a recording: per-thread on/off-CPU
time and the top functions by wall time."""
from __future__ import annotations

from typing import Dict, List, Tuple

from .profile import FrameKind, PathShortener, Profile


def fmt_s(ns: int) -> str:
    return f"{ns / 1e9:.2f} s"


def thread_table(prof: Profile) -> List[Tuple[int, int, str, int, int, int]]:
    """(pid, tid, name, on-CPU ns, off-CPU ns, raw samples) per thread (or
    group of ended threads), busiest first."""
    acc: Dict[int, List[int]] = {}
    for key, ns in prof.weights.items():
        a = acc.setdefault(key.tid, [key.pid, 0, 0, 0])
        a[1 if key.off_cpu is None else 2] += ns
        if key.off_cpu is None:
            a[3] += prof.sample_counts.get(key, 0)
    rows = []
    for tid, (pid, on, off, samples) in acc.items():
        info = prof.thread_info.get(tid)
        name = prof.thread_root(tid).split(" ", 2)[-1] if tid >= 0 else prof.thread_root(tid)
        rows.append((pid, tid, name, on, off, info.samples if info else samples))
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
    lines.append(f"  {'thread':<34} {'on-CPU':>10} {'off-CPU':>10} {'wall':>10} {'samples':>8}")
    for pid, tid, name, on, off, samples in rows[:20]:
        label = f"{tid} {name}" if tid >= 0 else name
        lines.append(f"  {label[:34]:<34} {fmt_s(on):>10} {fmt_s(off):>10} {fmt_s(on + off):>10} "
                     f"{samples:>8}")
    if len(rows) > 20:
        lines.append(f"  ... and {len(rows) - 20} more threads")
    meta = prof.meta
    if meta.mode == "wall" and meta.exact_on_cpu:
        lines.append("  on-CPU time is exact per thread (switch timestamps); the samples split it over stacks")
    elif meta.mode == "cpu":
        lines.append(f"  on-CPU time is estimated from samples (1/{meta.frequency_hz} s each); "
                     "--mode wall measures it exactly")
    if total:
        lines.append(f"  where the time goes (innermost Python frame; all threads, {fmt_s(total)}):")
        for label, ns, on in top_functions(prof, top):
            lines.append(f"  {100 * ns / total:6.1f}%  {fmt_s(ns):>9}  (on-CPU {100 * on / max(ns, 1):3.0f}%)  {label}")
    return "\n".join(lines)
