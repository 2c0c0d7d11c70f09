"""The short text summary printed after a recording: per-thread on/off-CPU
time, the top functions by wall time, and what would name the native frames
of objects that have no symbols."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Dict, List, Optional, Tuple

from .model import Frame, FrameKind, PathShortener, Profile, is_task_wait, task_root


def fmt_s(ns: int) -> str:
    return f"{ns / 1e9:.2f} s"


def thread_table(prof: Profile) -> List[Tuple[int, int, str, int, int, int]]:
    """(pid, tid, name, on-CPU ns, off-CPU ns, raw samples) per thread (or
    group of ended threads), busiest first."""
    acc: Dict[int, List[int]] = {}
    for key, ns in prof.thread_weights():
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


def reasons_text(by_reason: Dict[str, int], n: int = 3) -> str:
    """`lock 92%, gil 6%`: the largest reasons' shares of that off-CPU time."""
    total = sum(by_reason.values())
    if not total:
        return ""
    top = sorted(by_reason.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{r} {100 * ns / total:.0f}%" for r, ns in top)


def gil_lines(prof: Profile, n: int = 20) -> List[str]:
    """Per thread (those with most GIL time first): the time it held the
    GIL, waited for it and ran without it; none when no state was read."""
    if not prof.gil:
        return []
    sampled = prof.meta.waits is not None and prof.meta.waits.offcpu == "sampled"
    out = ["  the GIL (state read at every sample and "
           + ("sampled wait" if sampled else "switch")
           + "): thread, held (of it off-CPU), waited for it, on-CPU without it"]
    rows = sorted(prof.gil.items(), key=lambda kv: (-(kv[1].held_ns + kv[1].waiting_ns), kv[0]))
    for tid, g in rows[:n]:
        info = prof.thread_info.get(tid)
        label = info.root_label() if info is not None else f"thread {tid} {prof.threads.get(tid, '?')}"
        unknown = f", not read {fmt_s(g.unknown_on_ns)}" if g.unknown_on_ns else ""
        unknown += f", in the cyclic GC {fmt_s(g.gc_ns)}" if g.gc_ns else ""
        out.append(f"  {label[:40]:<40} held {fmt_s(g.held_ns):>8} ({fmt_s(g.held_off_ns)}), "
                   f"waited {fmt_s(g.waiting_ns):>8}, without {fmt_s(g.released_ns):>8}{unknown}")
    if len(rows) > n:
        out.append(f"  ... and {len(rows) - n} more threads")
    # per process and GIL: a subinterpreter with a GIL of its own has its line
    held: Dict[int, Dict[int, int]] = {}
    for tid, g in prof.gil.items():
        by_gil = held.setdefault(prof.thread_pid.get(tid, 0), {})
        for gil_id, ns in g.held_by_gil.items():
            by_gil[gil_id] = by_gil.get(gil_id, 0) + ns
    dur = prof.meta.duration_ns
    for pid, by_gil in sorted(held.items(), key=lambda kv: -sum(kv[1].values()))[:n] if dur else ():
        if set(by_gil) <= {0}:
            ns = by_gil.get(0, 0)
            out.append(f"  process {pid}: its GIL held {fmt_s(ns)} of the {fmt_s(dur)} recorded "
                       f"({100 * ns / dur:.0f}%)")
            continue
        by_gil.setdefault(0, 0)         # the main interpreter's, held or not
        for gil_id, ns in sorted(by_gil.items()):
            whose = "interpreter 0" if gil_id == 0 else f"interpreter {gil_id} (own GIL)"
            out.append(f"  process {pid}: {whose}: GIL held {fmt_s(ns)} of the {fmt_s(dur)} "
                       f"recorded ({100 * ns / dur:.0f}%)")
    return out


def wake_lines(prof: Profile, n: int = 10) -> List[str]:
    """--wakers: for the threads that waited longest, their main wait and
    who ended it most: `thread 12 worker: 2.10 s in Queue.get (queue.py:171),
    woken 93% by thread 11 main in producer (app.py:41)`."""
    acc: Dict[int, Dict[str, Dict[tuple, int]]] = {}
    for w, ns in prof.wakes.items():
        who = (w.waker, w.waker_pid, w.waker_tid, w.waker_where)
        by_who = acc.setdefault(w.tid, {}).setdefault(w.where, {})
        by_who[who] = by_who.get(who, 0) + ns
    rows = []
    for tid, places in acc.items():
        where, by_who = max(places.items(), key=lambda kv: sum(kv[1].values()))
        total = sum(by_who.values())
        who, ns = max(by_who.items(), key=lambda kv: kv[1])
        rows.append((total, tid, where, who, ns))
    out = []
    for total, tid, where, (kind, wpid, wtid, wwhere), ns in sorted(rows, reverse=True)[:n]:
        if kind == "task":
            name = prof.threads.get(wtid) or prof.processes.get(wpid, "?")
            by = f"thread {wtid} {name}" + (f" in {wwhere}" if wwhere else " (no Python frames)")
        else:
            by = {"timer": "a timer", "irq": "an interrupt"}.get(kind, "an unknown waker")
        out.append(f"  {prof.thread_root(tid)}: {fmt_s(total)} in {where or 'native code'}, "
                   f"woken {100 * ns / total:.0f}% by {by}")
    return out


def wait_stack_lines(meta) -> List[str]:
    """How the waits got their stacks (profile/waits.py's counts): with
    --off-cpu sampled, which waits are exact and how many were sampled."""
    w = meta.waits
    if w is None or meta.mode == "cpu" or not (w.exact or w.short):
        return []
    if w.offcpu != "sampled":
        return [f"  off-CPU stacks: taken at every switch (--off-cpu exact), {w.exact:,} waits"]
    period = f"{w.period_ns / 1e6:.3g} ms"
    return [f"  off-CPU stacks: {w.exact:,} waits >= {period} exact, {w.sampled:,} sampled of "
            f"{w.short:,} shorter ones (each thread's times, and its time per kind of wait, "
            "are exact; the split of the short ones over stacks is sampled: docs/offcpu-sampling.md)"]


def where_time_goes(frames) -> Optional[Frame]:
    """The frame a stack's time is shown under: its innermost Python frame,
    or the innermost native frame of a stack without Python frames."""
    where = None
    for fr in reversed(frames):
        if fr.kind is FrameKind.PYTHON:
            return fr
        if where is None and fr.kind is FrameKind.NATIVE:
            where = fr
    return where


def top_functions(prof: Profile, n: int = 10) -> List[Tuple[str, int, int]]:
    """(label, wall ns, on-CPU ns) of the frames the time is spent in
    (where_time_goes), the heaviest first."""
    short = PathShortener()
    acc: Dict[str, List[int]] = {}
    for key, ns in prof.thread_weights():
        where = where_time_goes(key.frames)
        if where is None:
            continue
        a = acc.setdefault(where.label(False, short), [0, 0])
        a[0] += ns
        if key.off_cpu is None:
            a[1] += ns
    rows = sorted(((k, v[0], v[1]) for k, v in acc.items()), key=lambda r: -r[1])
    return rows[:n]


# A module earns its line when its nameless frames (`[unknown] module+0x...`,
# or `module@0x...`: code no symbol covers, named by the start of its FDE) sit
# in stacks holding at least this share of all the profile's time: the
# width of those boxes in the flame graph.  Below 5% they are narrow enough
# not to change where a reader sees the time go, and the line asks for a
# package install, so it is kept for what matters; at 5% even a short
# recording has several samples or a long wait behind it, not one stray PC.
UNNAMED_SHARE = 0.05
UNNAMED_LINES = 5           # modules named at most (busiest first)

# Debian binary packages whose debug files ship in a `-dbg` package of the
# main archive; everything else has `<package>-dbgsym` in the debug archive.
_PYTHON_PKG = re.compile(r"(?:lib)?python(3\.\d+)(?:-minimal|-stdlib)?")
_DBG_PACKAGES = {"libc6": "libc6-dbg"}
_DPKG_TIMEOUT_S = 5


def _unnamed(fr: Frame) -> bool:
    """A native frame that no symbol names: `[unknown] module+0x...`, or
    `module@0x...` (only its FDE's start: symbols.Symbolizer.frame_name)."""
    return (fr.name.startswith("[unknown] ")
            or fr.name.startswith(os.path.basename(fr.module) + "@0x"))


def unnamed_modules(prof: Profile, share: float = UNNAMED_SHARE
                    ) -> List[Tuple[object, int]]:
    """(symbols.ModuleSymbols, ns) of every mapped object without symbols
    whose unnamed frames (``_unnamed``) are in stacks holding at least ``share`` of the
    profile's time (a stack counts once per object), busiest first.  Objects
    are told apart by build-id (the same file mapped by several processes is
    one), and only those the symbolizer read are considered."""
    mods = prof.meta.native_modules
    total = prof.total_ns()
    if not mods or total <= 0:
        return []
    acc: Dict[tuple, List] = {}
    for key, ns in prof.weights.items():
        seen = set()
        for fr in key.frames:
            if fr.kind is not FrameKind.NATIVE or not fr.module or not _unnamed(fr):
                continue
            info = mods.get((key.pid, fr.module))
            if info is None or info.file is None or info.has_symbols:
                continue
            group = (("id", info.build_id, info.root is None) if info.build_id
                     else ("path", key.pid, info.path))
            if group in seen:
                continue
            seen.add(group)
            a = acc.setdefault(group, [info, 0])
            a[1] += ns
    rows = [(info, ns) for info, ns in acc.values() if ns >= share * total]
    rows.sort(key=lambda r: (-r[1], r[0].path))
    return rows


def _dpkg_owner(path: str, root: Optional[str]) -> Optional[str]:
    """The Debian binary package that owns ``path`` (as its process sees
    it): the host's package database for a process in our root, the
    target's own (ROOT/var/lib/dpkg) for one in another; None if neither
    knows it.  A merged /usr is tried both ways (dpkg lists /lib/... for
    what maps show as /usr/lib/...)."""
    exe = shutil.which("dpkg-query")
    if exe is None:
        return None
    cmd = [exe]
    if root:
        admin = os.path.join(root, "var/lib/dpkg")
        if not os.path.isfile(os.path.join(admin, "status")):
            return None
        cmd.append("--admindir=" + admin)
    names = [path]
    m = re.match(r"/usr(/(?:s?bin|lib[^/]*)/.*)", path)
    if m:
        names.append(m.group(1))
    elif re.match(r"/(?:s?bin|lib[^/]*)/", path):
        names.append("/usr" + path)
    for name in names:
        try:
            res = subprocess.run(cmd + ["-S", name], capture_output=True, text=True,
                                 timeout=_DPKG_TIMEOUT_S)
        except (OSError, ValueError, subprocess.SubprocessError):
            return None
        if res.returncode != 0:
            continue
        for line in res.stdout.splitlines():
            owners, sep, owned = line.partition(": ")
            if not sep or owners.startswith("diversion by") or owned.strip() != name:
                continue
            pkg = owners.split(",")[0].strip().split(":")[0]
            if pkg:
                return pkg
    return None


def debug_package(pkg: str) -> Tuple[str, bool]:
    """(the package holding ``pkg``'s debug files, whether it is in Debian's
    debug archive rather than the main one)."""
    m = _PYTHON_PKG.fullmatch(pkg)
    if m:
        return f"python{m.group(1)}-dbg", False
    if pkg in _DBG_PACKAGES:
        return _DBG_PACKAGES[pkg], False
    return pkg + "-dbgsym", True


def debug_hint(info, ns: int, total_ns: int, owner=_dpkg_owner) -> str:
    """One line: how much time ``info``'s object holds without names, and
    the package and the build-id debug file that would name it."""
    name = os.path.basename(info.path)
    share = 100.0 * ns / total_ns if total_ns else 0.0
    head = f"pyoffcpu: {share:.0f}% of the time is in {name} without symbols: "
    inside = " in the target's root" if info.root else ""
    pkg = owner(info.target_path, info.root)
    bid_path = info.build_id_path()
    if pkg:
        dbg, debug_archive = debug_package(pkg)
        todo = f"install {dbg}{inside}" + (" from Debian's debug archive" if debug_archive else "")
        if bid_path:
            todo += f" (debug file {bid_path})"
        return head + todo
    wheel = wheel_of(info.target_path)
    if wheel:
        # a copy a wheel bundles (torch's libgomp, numpy's OpenBLAS): no
        # package ships its debug file, so none is pointed at
        return (head + f"it is the copy the {wheel} package bundles, stripped, and no package ships its "
                f"debug file; its functions are named by where their code starts ({name}@0x...)")
    if bid_path:
        return head + f"its debug file would be {bid_path}{inside} (build-id {info.build_id})"
    return head + f"it has no build-id; profile a build of {info.target_path} that keeps its .symtab"


# A library that a Python package from PyPI carries: .../site-packages/torch/lib/libgomp.so.1,
# or auditwheel's .../site-packages/numpy.libs/libscipy_openblas64_-....so
_WHEEL_DIR = re.compile(r"/(?:site|dist)-packages/([^/]+)/")


def wheel_of(path: Optional[str]) -> Optional[str]:
    """The Python package whose files hold ``path`` (None: not in one)."""
    m = _WHEEL_DIR.search(path or "")
    if m is None:
        return None
    name = m.group(1)
    return name[:-len(".libs")] if name.endswith(".libs") else name


def symbol_hints(prof: Profile, owner=_dpkg_owner) -> List[str]:
    """The summary's lines about objects without symbols (see UNNAMED_SHARE)."""
    rows = unnamed_modules(prof)
    if rows:
        from ..native import helper
        if not helper.available():      # no index was made: a debug file would not help
            return [f"pyoffcpu: native frames have no names: {helper.BINARY} is not built (make install)"]
    total = prof.total_ns()
    out = [debug_hint(info, ns, total, owner) for info, ns in rows[:UNNAMED_LINES]]
    if len(rows) > UNNAMED_LINES:
        out.append(f"pyoffcpu: ... and {len(rows) - UNNAMED_LINES} more objects without symbols")
    return out


def task_table(prof: Profile) -> List[Tuple[int, str, Dict[str, int]]]:
    """--async: (pid, task root, ns by state) per task, the longest first;
    states: `running` (its loop thread's time in it, on and off the CPU),
    `await: KIND` and `ready` (sampled)."""
    acc: Dict[Tuple[int, str], Dict[str, int]] = {}
    for key, ns in prof.weights.items():
        root = task_root(key.frames)
        if root is None:
            continue
        state = key.off_cpu if is_task_wait(key.off_cpu) else "running"
        a = acc.setdefault((key.pid, root), {})
        a[state] = a.get(state, 0) + ns
    rows = [(pid, label, by) for (pid, label), by in acc.items()]
    rows.sort(key=lambda r: -sum(r[2].values()))
    return rows


def task_lines(prof: Profile, n: int = 20) -> List[str]:
    rows = task_table(prof)
    if not rows:
        return []
    out = ["  asyncio tasks (--async; running from the loop thread's time, awaiting and ready "
           "sampled):",
           f"  {'task':<34} {'total':>10} {'running':>10} {'awaiting':>10} {'ready':>10}  awaiting on"]
    for pid, label, by in rows[:n]:
        run, ready = by.get("running", 0), by.get("ready", 0)
        waits = {k[len("await: "):]: v for k, v in by.items() if k.startswith("await: ")}
        out.append(f"  {label[:34]:<34} {fmt_s(sum(by.values())):>10} {fmt_s(run):>10} "
                   f"{fmt_s(sum(waits.values())):>10} {fmt_s(ready):>10}  "
                   f"{reasons_text(waits)}".rstrip())
    if len(rows) > n:
        out.append(f"  ... and {len(rows) - n} more tasks")
    return out


def render_summary(prof: Profile, top: int = 10) -> str:
    total = prof.total_ns()
    lines = []
    rows = thread_table(prof)
    why = prof.off_cpu_by_reason()
    lines.append(f"  {'thread':<34} {'on-CPU':>10} {'off-CPU':>10} {'wall':>10} {'samples':>8}"
                 "  off-CPU by reason")
    for pid, tid, name, on, off, samples in rows[:20]:
        label = f"{tid} {name}" if tid >= 0 else name
        lines.append(f"  {label[:34]:<34} {fmt_s(on):>10} {fmt_s(off):>10} {fmt_s(on + off):>10} "
                     f"{samples:>8}  {reasons_text(why.get(tid, {}))}".rstrip())
    if len(rows) > 20:
        lines.append(f"  ... and {len(rows) - 20} more threads")
    meta = prof.meta
    if meta.mode == "wall" and meta.exact_on_cpu:
        lines.append("  on-CPU time is exact per thread (switch timestamps); the samples split it over stacks")
    elif meta.mode == "cpu":
        lines.append(f"  on-CPU time is estimated from samples (1/{meta.frequency_hz} s each); "
                     "--mode wall measures it exactly")
    lines.extend(wait_stack_lines(meta))
    everyone = prof.off_cpu_totals()
    if everyone:
        lines.append("  off-CPU by reason, all threads: " + ", ".join(
            f"{r} {fmt_s(ns)}" for r, ns in sorted(everyone.items(), key=lambda kv: -kv[1])))
    lines.extend(task_lines(prof))
    lines.extend(gil_lines(prof))
    in_gc = sum(g.gc_ns for g in prof.gil.values())
    if in_gc:
        lines.append(f"  the cyclic garbage collector ([gc] frames): {fmt_s(in_gc)}, "
                     f"{100 * in_gc / max(total, 1):.1f}% of the time recorded")
    woken = wake_lines(prof)
    if woken:
        lines.append("  who ended the waits (--wakers; the longest-waiting threads, their main wait):")
        lines.extend(woken)
    if total:
        lines.append(f"  where the time goes (innermost Python frame; all threads, {fmt_s(total)}):")
        for label, ns, on in top_functions(prof, top):
            lines.append(f"  {100 * ns / total:6.1f}%  {fmt_s(ns):>9}  (on-CPU {100 * on / max(ns, 1):3.0f}%)  {label}")
    lines.extend(symbol_hints(prof))
    return "\n".join(lines)


STEAL_NOTE_SHARE = 0.01     # stolen time worth a note: this share of the machine's busy time
STEAL_NOTE_MIN_S = 0.02     # and at least two of /proc/stat's 10 ms ticks


def steal_note(cpu_steal: Optional[Tuple[float, float]]) -> Optional[str]:
    """The note on a recording's hypervisor steal, from the machine's
    (busy, stolen) CPU seconds over it; None when there is little or none."""
    if not cpu_steal:
        return None
    busy, stolen = cpu_steal
    if busy <= 0 or stolen < STEAL_NOTE_MIN_S or stolen < STEAL_NOTE_SHARE * busy:
        return None
    return (f"steal: the hypervisor stole {100 * stolen / busy:.1f}% of this machine's busy CPU time while "
            f"recording ({stolen:.2f} of {busy:.2f} CPU s, /proc/stat); on-CPU times are by the clock and "
            "include what it stole while a thread was on a CPU, its own CPU clock does not")


def recording_notes(rec, stats) -> List[str]:
    """What a recording lost or could not do, one line each: its drops, the
    waits --min/--max-block-us left out, and how the native stacks were
    found (merge's MergeStats).  record prints them; snapshot keeps them."""
    out: List[str] = []
    drops = {k: v for k, v in rec.drops.items() if v}
    if drops:
        def lost(k):
            ns = rec.drops_ns.get(k, 0)
            return f" ({ns / 1e6:.1f} ms)" if ns else ""
        out.append("drops: " + ", ".join(f"{k} {v}{lost(k)}" for k, v in sorted(drops.items())))
    else:
        out.append("drops: none")
    steal = steal_note(rec.cpu_steal)
    if steal:
        out.append(steal)
    n_out, ns_out = rec.block_filtered
    if rec.options.min_block_ns or rec.options.max_block_ns:
        out.append(f"{n_out} waits ({ns_out / 1e9:.2f} s) outside --min-block-us/"
                   "--max-block-us left out")
    if stats.failed_stacks:
        out.append(f"{stats.failed_stacks} stacks ({stats.failed_ns / 1e9:.2f} s) could not be built "
                   f"({stats.failure}): shown as [frames not read]")
    if stats.python_ns:
        out.append(f"native/Python merge fell back for {100 * stats.fallback_ns / stats.python_ns:.0f}% "
                   "of the Python time (native frames above the interpreter only)")
    if stats.pending_ns and stats.native_ns:
        libs = sorted(stats.pending_libs.items(), key=lambda kv: -kv[1])
        named = ", ".join(f"{name} {ns / 1e9:.2f} s" for name, ns in libs[:3]) + (", ..." if len(libs) > 3 else "")
        out.append(f"native table not ready: {stats.pending_ns / 1e9:.2f} s "
                   f"({100 * stats.pending_ns / stats.native_ns:.1f}% of the native-stack time) stopped at a "
                   f"library whose unwind table was still being made ({named}); "
                   "those stacks start with [native table not ready]")
    if stats.jit_ns and stats.native_ns:
        out.append(f"native stacks that end in code made at run time ([jit]): {stats.jit_ns / 1e9:.2f} s "
                   f"({100 * stats.jit_ns / stats.native_ns:.1f}% of the native-stack time); nothing says "
                   "where its frames are, so the walk stops there and its Python frames stay")
    if stats.prologue_ns or stats.framepointer_ns:
        share = lambda ns: f"{100 * ns / stats.native_ns:.0f}%" if stats.native_ns else "0%"   # noqa: E731
        out.append(f"native stacks through code without CFI: {share(stats.prologue_ns)} of the "
                   f"time needed rows from prologue analysis, {share(stats.framepointer_ns)} frame pointers")
        frames = sum(stats.method_frame_ns.values())
        if frames:
            by = ", ".join(f"{label} {100 * stats.method_frame_ns.get(name, 0) / frames:.1f}%" for name, label in
                           (("cfi", "CFI"), ("prologue", "prologue analysis"), ("frame pointer", "frame pointers")))
            out.append(f"native frames by how they were found (weighted by time): {by}")
    return out
