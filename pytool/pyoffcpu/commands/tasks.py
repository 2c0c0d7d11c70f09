"""pyoffcpu dump --async: a live process's asyncio tasks, as a tree of who
awaits whom, each with where it is suspended and on what; tasks that await
each other in a cycle are named.  Read from the target's memory
(cpython/asyncio_tasks.py) without stopping it."""
from __future__ import annotations

from typing import Dict, List

from ..cpython import asyncio_tasks as A
from ..profile.model import PathShortener
from ..kernel.procfs import comm


def task_graph(snap: A.Snapshot) -> Dict[int, List[int]]:
    """task -> the tasks it awaits: its fut_waiter when that is a task, and
    (3.14+) every task that lists it in its awaited_by."""
    known = {t.addr for t in snap.tasks}
    awaits: Dict[int, List[int]] = {t.addr: [] for t in snap.tasks}
    for t in snap.tasks:
        if t.waiter_is_task and t.waiter in known and t.waiter not in awaits[t.addr]:
            awaits[t.addr].append(t.waiter)
        for by in t.awaited_by:
            if by in known and t.addr not in awaits[by]:
                awaits[by].append(t.addr)
    return awaits


def dump_tasks(pid: int, full_paths: bool = False) -> dict:
    """The tasks of process `pid` as a dict (the --json form).  Raises
    detect.NotPython / Unsupported, A.AsyncioUnavailable, OSError."""
    from ..cpython import detect
    pp = detect.find_python(pid)
    reader = A.TaskReader(pp)
    try:
        snap = reader.snapshot()
        short = (lambda f: f) if full_paths else PathShortener()
        names = {t.addr: t.name for t in snap.tasks}
        awaits = task_graph(snap)
        tasks = []
        for t in snap.tasks:
            named = reader.named_frames(t.frames)
            tasks.append({
                "task": "%#x" % t.addr, "name": t.name, "thread": t.tid or None,
                "state": t.state, "awaits": A.await_kind(named, t, names),
                "awaits_tasks": ["%#x" % a for a in awaits[t.addr]],
                "frames": [{"function": n, "file": short(f), "line": ln}
                           for n, f, ln in named],
            })
        cycles = [["%#x" % a for a in c] for c in A.find_cycles(awaits)]
        return {"pid": pid, "name": comm(pid), "python": pp.version_str,
                "tasks": tasks, "cycles": cycles, "notices": reader.notices,
                "unreadable_tasks": snap.dropped, "truncated": snap.truncated}
    finally:
        reader.close()


def _frame_text(f: dict) -> str:
    return "%s (%s:%s)" % (f["function"], f["file"], f["line"] if f["line"] >= 0 else "?")


def render_tasks(d: dict) -> str:
    tasks = {t["task"]: t for t in d["tasks"]}
    by_thread: Dict[object, List[dict]] = {}
    for t in d["tasks"]:
        by_thread.setdefault(t["thread"], []).append(t)
    lines = ["process %d %s (CPython %s): %d asyncio task%s" % (
        d["pid"], d["name"], d["python"], len(tasks), "" if len(tasks) == 1 else "s")]
    lines += ["  note: %s" % n for n in d["notices"]]
    if d["unreadable_tasks"]:
        lines.append("  note: %d task(s) changed while read, left out" % d["unreadable_tasks"])
    if d["truncated"]:
        lines.append("  note: more than %d tasks: the rest left out" % A.MAX_TASKS)
    for cyc in d["cycles"]:
        names = [tasks[a]["name"] for a in cyc]
        lines.append("  CYCLE: " + " -> ".join(names + names[:1]) +
                     " (these tasks await each other: none can finish)")
    awaited = {a for t in d["tasks"] for a in t["awaits_tasks"]}
    in_cycle = {a for c in d["cycles"] for a in c}

    def show(t: dict, depth: int, seen: set) -> None:
        pad = "  " * depth
        lines.append("%s- task %s [%s]: %s" % (pad, t["name"], t["state"], t["awaits"]))
        for f in reversed(t["frames"]):                 # innermost first, as dump
            lines.append("%s      %s" % (pad, _frame_text(f)))
        for a in t["awaits_tasks"]:
            if a in seen:
                lines.append("%s  - task %s (above: a cycle)" % (pad, tasks[a]["name"]))
            elif a in tasks:
                show(tasks[a], depth + 1, seen | {a})
    for tid in sorted(by_thread, key=lambda x: (x is None, x or 0)):
        head = "thread %d (its loop)" % tid if tid else "loop thread not known"
        lines.append(head + ":")
        roots = [t for t in by_thread[tid] if t["task"] not in awaited]
        roots += [t for t in by_thread[tid]
                  if t["task"] in in_cycle and t["task"] == min(
                      c for c in d["cycles"] if t["task"] in c)[0]]
        for t in roots:
            show(t, 1, {t["task"]})
    return "\n".join(lines)
