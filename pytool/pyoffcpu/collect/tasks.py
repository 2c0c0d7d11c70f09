"""--async: snapshots of every target's asyncio tasks while the recording runs.

BPF gives the running task's time exactly: with ASYNC_TASKS each Python stack
carries its outermost generator-owned frame, which lies inside the coroutine
of the task that runs (bpf/pyoffcpu.h, pystack.task_frame).  A suspended task
runs no code, so nothing happens in the kernel to measure: a thread here
reads the task graph from the target's memory (cpython/asyncio_tasks.py)
HZ times a second, and gives each task that is not running the time since the
previous snapshot, at what it was suspended on then (an await chain and its
kind, or ready).  That split is sampled; the snapshots also tell which task
owns which coroutine frame, which names BPF's running time.

The thread keeps its own CPU to a share of a core (MAX_SHARE): a loop of
10,000 tasks is read less often, never at the target's expense.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set, Tuple

from ..cpython import asyncio_tasks as A
from ..kernel.memory import MemoryError_, ProcessMemory

DEFAULT_HZ = 100
MAX_SHARE = 0.05                 # of one core, for all snapshots together
RETRY_S = 1.0                    # a target whose tasks cannot be read yet: look again
MAX_SPANS = 200_000              # --timeline: task states kept, all tasks together

PyFrameText = Tuple[str, str, int]          # (qualified name, file, line)


@dataclass(eq=False)
class TaskInfo:
    name: str
    coro_name: str                           # its coroutine's qualified name
    coro_code: int                           # its coroutine's code object
    coro: int = 0                            # its coroutine object
    first_ns: int = 0                        # from the snapshot before the first that saw
    last_ns: int = 0                         # it to the last that did: its sampled lifetime


@dataclass
class TaskTimes:
    """What the snapshots found, for the merger (profile/merge.py)."""
    hz: float = DEFAULT_HZ
    start_ns: int = 0                        # the recording's start
    # (pid, task address) -> its name and coroutine (the latest seen)
    tasks: Dict[Tuple[int, int], TaskInfo] = field(default_factory=dict)
    # (pid, frame address) -> task address: whose coroutine frame that is
    by_frame: Dict[Tuple[int, int], int] = field(default_factory=dict)
    # (pid, tid, task address, TaskInfo, await chain outermost first, kind) -> [snapshots, ns]
    waits: Dict[tuple, List[int]] = field(default_factory=dict)
    # pid -> the tasks of its last snapshot
    alive: Dict[int, Set[int]] = field(default_factory=dict)
    notices: List[str] = field(default_factory=list)
    # --timeline: (pid, task address, TaskInfo) -> its states in time, each
    # [begin ns, end ns, "running" or "await: KIND" / "ready"]: a state runs
    # from the snapshot before the first that saw it to the last that did
    spans: Optional[Dict[tuple, List[list]]] = None
    spans_kept: int = 0             # all tasks' spans (at most MAX_SPANS)

    def label_of(self, pid: int, addr: int, info: TaskInfo) -> str:
        """task_label of the task `info` describes, which may have been
        followed at its address by another."""
        if self.tasks.get((pid, addr)) is not info:
            return "tasks in " + info.coro_name
        return self.task_label(pid, addr)

    def task_label(self, pid: int, addr: int) -> str:
        """The folded root of a task: `task NAME` for one that lived through
        the whole recording (from the first snapshot to the last), `tasks in
        CORO` for the others, folded by coroutine, as ended threads fold by
        entry function.  Only the first are named because only their time
        is theirs by construction: BPF knows a running task by its
        coroutine's address, which a task that lives throughout holds
        throughout, while a short task's address may be an earlier or a
        later one's too (with the same coroutine, checked by its code)."""
        info = self.tasks.get((pid, addr))
        if info is None:
            return ""
        if addr in self.alive.get(pid, ()) and info.first_ns <= self.start_ns:
            return "task " + info.name
        return "tasks in " + info.coro_name


class TaskSampler:
    """One thread for the whole session."""

    def __init__(self, targets: Callable[[], List[Tuple[int, object]]], start_ns: int,
                 hz: int = 0, spans: bool = False):
        self.targets = targets                 # () -> [(pid, PythonProcess or None)]
        self.times = TaskTimes(hz=hz or DEFAULT_HZ, start_ns=start_ns, spans={} if spans else None)
        self.start_ns = start_ns
        self.end_ns: Optional[int] = None
        self._readers: Dict[int, A.TaskReader] = {}
        self._retry: Dict[int, float] = {}
        self._said: Set[Tuple[int, str]] = set()
        self._prev_ns = start_ns
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pyoffcpu-tasks", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, end_ns: int) -> TaskTimes:
        self.end_ns = end_ns
        self._stop.set()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            try:
                self.snapshot_all()                 # the last one, at the end mark
            except Exception:                       # noqa: BLE001 - keep what we have
                pass
        for r in self._readers.values():
            r.close()
        return self.times

    def _run(self) -> None:
        interval = 1.0 / self.times.hz
        while not self._stop.is_set():
            c0 = time.thread_time_ns()
            try:
                self.snapshot_all()
            except Exception as e:                  # noqa: BLE001 - never kill the recording
                self._say(0, "asyncio task snapshots stopped: %s" % e)
                return
            cost = time.thread_time_ns() - c0
            self._stop.wait(max(interval - cost / 1e9, cost / 1e9 * (1 / MAX_SHARE - 1)))

    def _say(self, pid: int, text: str) -> None:
        if (pid, text) not in self._said:
            self._said.add((pid, text))
            self.times.notices.append(text if not pid else "process %d: %s" % (pid, text))

    def _reader(self, pid: int, pp) -> Optional[A.TaskReader]:
        r = self._readers.get(pid)
        if r is not None and r.pp is pp:
            return r
        if r is not None:                           # the process exec'd another Python
            r.close()
            del self._readers[pid]
        if pp is None or time.monotonic() < self._retry.get(pid, 0.0):
            return None
        try:
            # a fork's child shares its parent's description: its own memory
            r = A.TaskReader(pp, ProcessMemory(pid) if pid != pp.pid else None)
        except A.AsyncioUnavailable as e:
            self._retry[pid] = time.monotonic() + RETRY_S
            if pp.minor < (3, 11) or pp.free_threaded:
                self._retry[pid] = float("inf")
                self._say(pid, "--async: %s" % e)
            return None
        except OSError:
            self._retry[pid] = time.monotonic() + RETRY_S
            return None
        for n in r.notices:
            self._say(pid, n)
        self._readers[pid] = r
        return r

    def snapshot_all(self) -> None:
        now = time.monotonic_ns()
        if self.end_ns is not None:
            now = min(now, self.end_ns)
        weight = now - self._prev_ns
        self._prev_ns = now
        for pid, pp in self.targets():
            r = self._reader(pid, pp)
            if r is None:
                continue
            try:
                snap = r.snapshot()
            except A.AsyncioUnavailable as e:
                self._retry[pid] = time.monotonic() + RETRY_S
                del self._readers[pid]
                r.close()
                if "not imported" not in str(e):
                    self._say(pid, "--async: %s" % e)
                continue
            except (MemoryError_, OSError):
                continue                            # it is exiting: keep what it had
            self._record(pid, snap, now, weight)

    def _span(self, pid: int, addr: int, info: TaskInfo, state: str, begin: int, end: int) -> None:
        """--timeline: the task was in `state` from begin to end."""
        t = self.times
        spans = t.spans.get((pid, addr, info))
        if spans and spans[-1][2] == state and spans[-1][1] == begin:
            spans[-1][1] = end
        elif t.spans_kept < MAX_SPANS:
            t.spans.setdefault((pid, addr, info), []).append([begin, end, state])
            t.spans_kept += 1

    def _record(self, pid: int, snap: A.Snapshot, now: int, weight: int) -> None:
        t = self.times
        reader = self._readers[pid]
        gen_iframe = reader.L["gen_iframe"]
        names = {k.addr: k.name for k in snap.tasks}
        alive = set()
        for task in snap.tasks:
            alive.add(task.addr)
            chain: List[PyFrameText] = reader.named_frames(task.frames)
            key = (pid, task.addr)
            info = t.tasks.get(key)
            if info is None or info.name != task.name or info.coro != task.coro:
                # a new task (or a new one at a freed one's address)
                # its time starts where this snapshot's weight does
                info = t.tasks[key] = TaskInfo(task.name, "?", 0, task.coro, first_ns=now - weight)
            if task.frames:
                info.coro_code = task.frames[0][0]
                info.coro_name = chain[0][0]
            info.last_ns = now
            if task.coro:
                t.by_frame[(pid, task.coro + gen_iframe)] = task.addr
            running = task.state == A.RUNNING
            kind = "running" if running else A.await_kind(chain, task, names)
            if t.spans is not None and weight > 0:
                self._span(pid, task.addr, info, kind if kind in ("running", "ready") else "await: " + kind,
                           now - weight, now)
            if running or weight <= 0:
                continue                            # BPF measures it
            wkey = (pid, task.tid, task.addr, info, tuple(chain), kind)
            slot = t.waits.get(wkey)
            if slot is None:
                slot = t.waits[wkey] = [0, 0]
            slot[0] += 1
            slot[1] += weight
        t.alive[pid] = alive
        if any(not task.tid for task in snap.tasks):
            self._say(pid, "--async: the thread of a loop is not known (its run_forever is not "
                           "Python code: uvloop?); its suspended tasks are shown under the main "
                           "thread, their running time under the thread that ran them")
