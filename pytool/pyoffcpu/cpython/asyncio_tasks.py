"""asyncio's tasks, read from a live target without stopping it.

Where the tasks are:
- 3.14+: each thread's list and the interpreter's list of tasks
  (`struct llist_node asyncio_tasks_head`), at the offsets the target
  publishes in its `.AsyncioDebug` section (`_Py_AsyncioModuleDebugOffsets`,
  in the python binary, libpython, or the _asyncio extension module), which
  also names the thread's running task and loop;
- 3.11-3.13: the WeakSet `asyncio.tasks._scheduled_tasks` (3.11:
  `_all_tasks`), reached from the interpreter's module dict.
How each object is laid out is generated data (asyncio_table.py).

For each task: its name, its coroutine, the future it waits on
(`fut_waiter`), that future's state, and its await chain: from the task's
coroutine, each suspended coroutine's awaited object is the top of its
frame's value stack; a coroutine (or generator) there is followed into its own
frame, a FutureIter ends the chain at its future.  The frames are (code
address, byte offset) pairs like BPF's, named by CodeReader.

Every read is of memory the target may be changing: a torn read drops that
task (counted), never the snapshot; every list and chain is bounded.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

from ..native import symbols
from ..native.elfcache import open_regular_file
from ..native.elffile import _Headers
from ..kernel.memory import MemoryError_, ProcessMemory
from . import walker
from .asyncio_table import LAYOUTS
from .code import CodeReader
from .detect import PythonProcess, iter_thread_states, proc_path

MAX_TASKS = 100_000              # tasks read per snapshot at most
MAX_CHAIN = 64                   # coroutines followed per task
MAX_SET = 1 << 22                # entries of the WeakSet's table
MAX_DICT = 1 << 16               # entries of a module dict scanned
MAX_TYPE_NAME = 128
DEBUG_SECTION = ".AsyncioDebug"
DEBUG_FIELDS = ("task_size", "task_name", "task_awaited_by", "task_is_task",
                "task_awaited_by_is_set", "task_coro", "task_node",
                "interp_size", "interp_tasks_head",
                "tstate_size", "tstate_running_loop", "tstate_running_task",
                "tstate_tasks_head")

# Task states
RUNNING = "running"              # its coroutine is executing (it holds the loop)
AWAITING = "awaiting"            # suspended on a pending future
READY = "ready"                  # runnable: its step is queued behind other callbacks
CREATED = "created"              # not started yet (its first step is queued)


class TaskDone(Exception):
    """A task that has finished: not one of the loop's tasks any more."""


class AsyncioUnavailable(Exception):
    """The target's tasks cannot be read (one line: why)."""


@dataclass
class Task:
    addr: int
    name: str
    coro: int
    loop: int
    state: str
    waiter: int = 0                  # the future it waits on, 0: none
    waiter_type: str = ""            # that future's type name
    waiter_is_task: bool = False
    frames: List[Tuple[int, int]] = field(default_factory=list)   # outermost first
    awaited_type: str = ""           # the innermost awaited object's type, "" none
    tid: int = 0                     # its loop's thread, 0: unknown
    awaited_by: List[int] = field(default_factory=list)   # 3.14+: tasks awaiting it


@dataclass
class Snapshot:
    tasks: List[Task]
    running: Dict[int, int]          # tid -> running task address (3.14+)
    loops: Dict[int, int]            # loop address -> tid
    dropped: int = 0                 # tasks whose reads failed (torn)
    truncated: bool = False          # more than MAX_TASKS


def _debug_section(path: str) -> Optional[Tuple[int, bytes]]:
    """(vaddr, bytes) of the file's .AsyncioDebug section, or None."""
    try:
        with open_regular_file(path) as f:
            h = _Headers(f)
            headers = h.sections()
            for name, hdr in zip(h.names(headers), headers):
                if name == DEBUG_SECTION and 8 * len(DEBUG_FIELDS) <= hdr[5] <= 4096:
                    f.seek(hdr[4])
                    return hdr[3], f.read(hdr[5])
    except (OSError, ValueError, struct.error):
        return None
    return None


def find_debug_offsets(pid: int, maps) -> Optional[Dict[str, int]]:
    """_Py_AsyncioModuleDebugOffsets from the first mapped file that has it
    (the executable, libpython, or _asyncio's extension module), read from the
    file: it is constant data."""
    seen = set()
    for m in maps:
        path = m.path
        if not path.startswith("/") or path in seen:
            continue
        seen.add(path)
        base = os.path.basename(path)
        if not (base.startswith("python") or base.startswith("libpython")
                or base.startswith("_asyncio")):
            continue
        found = _debug_section(proc_path(pid, path))
        if found is None:
            continue
        _vaddr, blob = found
        values = struct.unpack_from("<%dQ" % len(DEBUG_FIELDS), blob)
        if any(v > 1 << 20 for v in values):
            continue
        return dict(zip(DEBUG_FIELDS, values))
    return None


class TaskReader:
    """Reads one process's tasks; keep one per process (it caches where the
    task set is and the names of types)."""

    def __init__(self, pp: PythonProcess, mem: Optional[ProcessMemory] = None, maps=None):
        self.pp = pp
        self.mem = mem or ProcessMemory(pp.pid)
        self.o = pp.offsets
        minor = pp.minor
        self.notices: List[str] = []
        if minor < (3, 11):
            raise AsyncioUnavailable("asyncio tasks are read from CPython 3.11 on (this is %s)"
                                     % pp.version_str)
        if pp.free_threaded:
            raise AsyncioUnavailable("asyncio tasks of a free-threaded CPython are not read")
        newest = max(LAYOUTS)
        if minor not in LAYOUTS:
            self.notices.append("asyncio of CPython %d.%d is read as %d.%d's, checked against "
                                "its _AsyncioDebug" % (minor + newest))
        self.L = dict(LAYOUTS.get(minor, LAYOUTS[newest]))
        self.dbg: Optional[Dict[str, int]] = None
        if minor >= (3, 14):
            if maps is None:
                maps = symbols.read_maps(pp.pid)
            self.dbg = find_debug_offsets(pp.pid, maps)
            if self.dbg is None:
                raise AsyncioUnavailable("no _AsyncioDebug section in the target's files "
                                         "(asyncio not imported yet?)")
            for k in ("task_name", "task_coro"):
                if self.dbg[k] != self.L[k]:
                    self.notices.append("_AsyncioDebug gives %s at %d, the table %d: "
                                        "using the target's" % (k, self.dbg[k], self.L[k]))
                    self.L[k] = self.dbg[k]
        self._type_names: Dict[int, str] = {}
        # the bytes of a frame the chain reads: up to its last field
        o = self.o
        self._frame_head = 8 + max(o["iframe_code"], o["iframe_instr"],
                                   self.L["iframe_stackpointer"], self.L["iframe_stacktop"])
        # the code objects (and str) of this process, read once
        self.codes = CodeReader(self.mem, minor, self.o, pp.code_type)
        self._weakset: int = 0          # 3.11-3.13: the set object of the WeakSet
        self._weakref_type: int = 0
        self._names: Dict[Tuple[int, int, int], str] = {}

    # -- small reads ---------------------------------------------------------------
    def type_name(self, obj: int) -> str:
        return self.name_of_type(self.mem.u64(obj + self.o["object_type"]))

    def name_of_type(self, tp: int) -> str:
        name = self._type_names.get(tp)
        if name is None:
            ptr = self.mem.u64(tp + self.o["type_name"])
            raw = self._read_upto(ptr, MAX_TYPE_NAME)
            name = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
            self._type_names[tp] = name
        return name

    def _read_upto(self, addr: int, n: int) -> bytes:
        # a C string near the end of a mapping: read less rather than fail
        while n >= 8:
            try:
                return self.mem.read(addr, n)
            except MemoryError_:
                n //= 2
        raise MemoryError_("unreadable string at %#x" % addr)

    def read_str(self, addr: int) -> str:
        return self.codes.read_str(addr)

    def named_frames(self, frames: List[Tuple[int, int]]) -> List[Tuple[str, str, int]]:
        """(qualified name, file, line) of an await chain's (code, offset)
        frames; ("?", "?", -1) for a code object that cannot be read."""
        out = []
        for code, offset in frames:
            info = self.codes.code(code)
            out.append((info.name, info.filename, info.line_for(self.pp.minor, offset))
                       if info is not None else ("?", "?", -1))
        return out

    def task_name(self, addr: int) -> str:
        """A task's name: a str, or (3.13+, not yet asked for) the int N of
        "Task-N"."""
        head = self.mem.read(addr, 40)              # str: ob_refcnt, ob_type, length, hash
        tname = self.name_of_type(struct.unpack_from("<Q", head, self.o["object_type"])[0])
        if tname == "str":
            # keyed by the content's hash too (-1: not computed yet, not kept)
            length, h = struct.unpack_from("<qq", head, self.o["unicode_length"])
            key = (addr, h, length)
            if h != -1 and key in self._names:
                return self._names[key]
            s = self.read_str(addr)
            if h != -1:
                self._names[key] = s
            return s
        if tname == "int":
            return "Task-%d" % self._small_int(head)
        return "<%s>" % tname

    def _small_int(self, head: bytes) -> int:
        """An int's value from its first 40 bytes (up to 3 30-bit digits)."""
        if self.pp.minor >= (3, 12):
            tag = struct.unpack_from("<Q", head, 16)[0]
            ndigits, sign = tag >> 3, 1 - (tag & 3)
        else:
            size = struct.unpack_from("<q", head, 16)[0]
            ndigits, sign = abs(size), (1 if size >= 0 else -1)
        value = 0
        for i in range(min(ndigits, 4)):
            value |= struct.unpack_from("<I", head, 24 + 4 * i)[0] << (30 * i)
        return sign * value

    # -- where the tasks are ---------------------------------------------------------
    def _llist(self, head: int, budget: int) -> Iterator[int]:
        """The tasks on the list at head (3.14+: linked by their task_node)."""
        node = self.mem.u64(head)
        seen = set()
        while node and node != head and node not in seen and len(seen) < budget:
            seen.add(node)
            yield node - self.dbg["task_node"]
            node = self.mem.u64(node)

    def _tasks_314(self, snap: Snapshot) -> List[Tuple[int, int]]:
        d, m = self.dbg, self.mem
        out: List[Tuple[int, int]] = []
        interps = set()
        for interp, ts in iter_thread_states(self.pp, m, walker.MAX_THREADS,
                                             walker.MAX_INTERPRETERS):
            tid = walker.thread_id(m, self.pp, ts)
            loop = m.u64(ts + d["tstate_running_loop"])
            if loop and tid:
                snap.loops[loop] = tid
            running = m.u64(ts + d["tstate_running_task"])
            if running and tid:
                snap.running[tid] = running
            for t in self._llist(ts + d["tstate_tasks_head"], MAX_TASKS - len(out)):
                out.append((t, tid))
            if interp not in interps:
                interps.add(interp)
                for t in self._llist(interp + d["interp_tasks_head"], MAX_TASKS - len(out)):
                    out.append((t, 0))
        return out

    def _dict_get(self, d: int, key: str) -> int:
        """The value under str `key` in the dict at d (a combined table), 0: none."""
        m, L = self.mem, self.L
        keys = m.u64(d + L["dict_keys"])
        if m.u64(d + L["dict_values"]):
            return 0                                # split table: not a module dict
        hdr = m.read(keys, 32)
        log2_index_bytes, kind = hdr[9], hdr[10]
        nentries = struct.unpack_from("<q", hdr, 24)[0]
        if not 0 <= nentries <= MAX_DICT or log2_index_bytes > 32:
            return 0
        esize = 24 if kind == 0 else 16
        entries = keys + 32 + (1 << log2_index_bytes)
        raw = m.read(entries, nentries * esize) if nentries else b""
        want = len(key)
        for i in range(nentries):
            if esize == 24:
                _h, k, v = struct.unpack_from("<qQQ", raw, i * esize)
            else:
                k, v = struct.unpack_from("<QQ", raw, i * esize)
            if not k or not v:
                continue
            try:
                if m.i64(k + self.o["unicode_length"]) != want:
                    continue
                if self.read_str(k) == key:
                    return v
            except (MemoryError_, ValueError, UnicodeDecodeError):
                continue
        return 0

    def _find_weakset(self) -> int:
        """The set object behind asyncio.tasks.<tasks_global> (3.11-3.13)."""
        L, m = self.L, self.mem
        interp = m.u64(self.pp.runtime + self.o["runtime_interpreters_head"])
        modules = m.u64(interp + L["interp_modules"])
        mod = self._dict_get(modules, "asyncio.tasks") if modules else 0
        if not mod:
            raise AsyncioUnavailable("asyncio is not imported in the target")
        ws = self._dict_get(m.u64(mod + L["module_dict"]), L["tasks_global"])
        if not ws:
            raise AsyncioUnavailable("asyncio.tasks.%s not found" % L["tasks_global"])
        path = L["weakset_data"]
        if path["kind"] == "direct":
            data = m.u64(ws + path["offset"])
        else:
            p = m.u64(ws + path["offset"])
            if path["tag"]:
                if not p & 1:
                    p = 0               # 3.12: a materialised dict, not values
                else:
                    p += 1
            data = m.u64(p + path["at"]) if p else 0
        if not data or self.type_name(data) != "set":
            raise AsyncioUnavailable("the task WeakSet's set could not be found "
                                     "(its __dict__ was materialised?)")
        return data

    def _tasks_weakset(self) -> List[Tuple[int, int]]:
        m, L = self.mem, self.L
        if not self._weakset:
            self._weakset = self._find_weakset()
        s = self._weakset
        refs = self._set_keys(s, MAX_SET)
        if refs is None:
            raise AsyncioUnavailable("implausible task set")
        out = []
        for ref in refs:
            try:
                head = m.read(ref, max(self.o["object_type"], L["weakref_object"]) + 8)
                tp = struct.unpack_from("<Q", head, self.o["object_type"])[0]
                if self._weakref_type and tp != self._weakref_type:
                    continue                    # the dummy of a deleted entry
                if not self._weakref_type:
                    if self.name_of_type(tp) != "weakref.ReferenceType":
                        continue
                    self._weakref_type = tp
                obj = struct.unpack_from("<Q", head, L["weakref_object"])[0]
            except MemoryError_:
                continue
            if obj:
                out.append((obj, 0))
            if len(out) >= MAX_TASKS:
                break
        return out

    # -- one task --------------------------------------------------------------------
    def _read_task(self, addr: int, tid: int) -> Task:
        m, L, o = self.mem, self.L, self.o
        raw = m.read(addr, L["task_size"])

        def word(off: int) -> int:
            return struct.unpack_from("<Q", raw, off)[0]
        if struct.unpack_from("<i", raw, L["fut_state"])[0] != L["fut_pending"]:
            raise TaskDone()                    # done, not yet freed (still in the set)
        coro, waiter, loop = word(L["task_coro"]), word(L["task_fut_waiter"]), word(L["fut_loop"])
        name_obj = word(L["task_name"])
        name = self.task_name(name_obj) if name_obj else "?"
        t = Task(addr=addr, name=name, coro=coro, loop=loop, state=READY, waiter=waiter, tid=tid)
        if waiter:
            head = m.read(waiter, L["fut_state"] + 4)
            t.waiter_type = self.name_of_type(struct.unpack_from("<Q", head, o["object_type"])[0])
            t.waiter_is_task = t.waiter_type.endswith("Task")
            state = struct.unpack_from("<i", head, L["fut_state"])[0]
            t.state = AWAITING if state == L["fut_pending"] else READY
        if coro:
            first = self._chain(t, coro)
            fs = L["frame_state"]
            if first == fs["executing"]:
                t.state = RUNNING
            elif first == fs["created"]:
                t.state = CREATED
        if self.dbg is not None and self.dbg["task_awaited_by"]:
            t.awaited_by = self._awaited_by(raw)
        return t

    def _awaited_by(self, raw: bytes) -> List[int]:
        d = self.dbg
        ab = struct.unpack_from("<Q", raw, d["task_awaited_by"])[0]
        if not ab:
            return []
        if not raw[d["task_awaited_by_is_set"]]:
            return [ab]
        return [k for k in self._set_keys(ab, 1 << 16) or () if self.type_name(k).endswith("Task")]

    def _set_keys(self, s: int, max_slots: int) -> Optional[List[int]]:
        """The non-NULL keys of the set object at s (deleted entries' dummy
        included: callers check each key's type); None: a table of more
        than max_slots slots, not believed."""
        m = self.mem
        mask = m.i64(s + self.L["set_mask"])
        if not 0 <= mask < max_slots:
            return None
        raw = m.read(m.u64(s + self.L["set_table"]), (mask + 1) * 16)
        return [k for k in struct.unpack_from("<%dQ" % (2 * (mask + 1)), raw)[::2] if k]

    def _chain(self, t: Task, coro: int) -> int:
        """Fills t.frames from the task's coroutine inward; returns the state
        of the task's own coroutine (gi_frame_state)."""
        m, L, o = self.mem, self.L, self.o
        fs = L["frame_state"]
        first_state = None
        gen = coro
        fi = L["gen_iframe"]
        for _ in range(MAX_CHAIN):
            # the coroutine's state and its frame's fields, in one read
            raw = m.read(gen, fi + self._frame_head)
            state = struct.unpack_from("<b", raw, L["gen_frame_state"])[0]
            if first_state is None:
                first_state = state
            if state not in (fs["created"], fs["executing"], fs["suspended_await"],
                             fs["suspended_yield"]):
                break                               # completed or cleared
            frame = gen + fi
            code = struct.unpack_from("<Q", raw, fi + o["iframe_code"])[0] & ~3
            instr = struct.unpack_from("<Q", raw, fi + o["iframe_instr"])[0]
            offset = (instr - code - o["code_code_adaptive"]) & 0xffffffff
            if offset >= 1 << 31:
                offset -= 1 << 32
            t.frames.append((code, offset))
            if state != fs["suspended_await"]:
                break
            top = self._stack_top(frame, raw[fi:])
            if not top:
                break
            head = m.read(top, max(o["object_type"], L["futureiter_future"]) + 8)
            kind = self.name_of_type(struct.unpack_from("<Q", head, o["object_type"])[0])
            if kind in ("coroutine", "generator"):
                gen = top
                continue
            if kind.endswith("FutureIter"):
                fut = struct.unpack_from("<Q", head, L["futureiter_future"])[0]
                if fut and fut == t.waiter:
                    t.awaited_type = t.waiter_type
                else:
                    t.awaited_type = self.type_name(fut) if fut else kind
            else:
                t.awaited_type = kind
            break
        return first_state if first_state is not None else 0

    def _stack_top(self, frame: int, head: bytes) -> int:
        """The awaited object of a suspended frame; `head`: its first bytes."""
        m, L = self.mem, self.L
        if L["iframe_stackpointer"] >= 0:
            sp = struct.unpack_from("<Q", head, L["iframe_stackpointer"])[0]
            slot = sp - 8 * L["stack_above_awaited"]
        else:
            top = struct.unpack_from("<i", head, L["iframe_stacktop"])[0]
            if not 0 < top < 4096:
                return 0
            slot = frame + L["iframe_localsplus"] + 8 * (top - 1)
        if not frame < slot < frame + (1 << 20):
            return 0
        return m.u64(slot) & ~3                     # 3.14+ tag stack references

    # -- a snapshot ------------------------------------------------------------------
    def loop_threads(self, snap: Snapshot) -> None:
        """3.11-3.13: which thread runs which loop, from the `self` of a
        run_forever / _run_once frame on each thread's stack."""
        if self.L["iframe_localsplus"] < 0:
            return
        codes, m, o = self.codes, self.mem, self.o
        for tid, ts in walker.thread_states(m, self.pp).items():
            f = walker._first_frame(m, o, self.pp.minor, ts)
            for _ in range(walker.MAX_DEPTH):
                if not f:
                    break
                info = codes.code(m.u64(f + o["iframe_code"]) & ~3)
                if info and info.name in ("BaseEventLoop.run_forever",
                                          "BaseEventLoop._run_once") \
                        and info.filename.endswith("base_events.py"):
                    snap.loops.setdefault(m.u64(f + self.L["iframe_localsplus"]), tid)
                    break
                f = m.u64(f + o["iframe_previous"])

    def snapshot(self) -> Snapshot:
        snap = Snapshot(tasks=[], running={}, loops={})
        if self.dbg is not None:
            found = self._tasks_314(snap)
        else:
            found = self._tasks_weakset()
            try:
                self.loop_threads(snap)
            except MemoryError_:
                pass
        snap.truncated = len(found) >= MAX_TASKS
        seen = set()
        for addr, tid in found:
            if addr in seen:
                continue
            seen.add(addr)
            try:
                t = self._read_task(addr, tid)
            except TaskDone:
                continue
            except (MemoryError_, struct.error, ValueError, UnicodeDecodeError):
                snap.dropped += 1
                continue
            if not t.tid:
                t.tid = snap.loops.get(t.loop, 0)
            if snap.running.get(t.tid) == t.addr:
                t.state = RUNNING
            snap.tasks.append(t)
        return snap

    def close(self) -> None:
        self.mem.close()


# -- what a task waits for ---------------------------------------------------------
# (innermost asyncio-library frame's qualified name, its file's basename) -> kind.
# The awaited future itself is a plain Future for most of these: the frame
# that created it says what it stands for.
KINDS = {
    ("sleep", "tasks.py"): "sleep",
    ("gather", "tasks.py"): "tasks",
    ("wait", "tasks.py"): "tasks",
    ("_wait", "tasks.py"): "tasks",
    ("as_completed", "tasks.py"): "tasks",
    ("Queue.get", "queues.py"): "queue",
    ("Queue.put", "queues.py"): "queue",
    ("Queue.join", "queues.py"): "queue",
    ("StreamReader._wait_for_data", "streams.py"): "socket read",
    ("FlowControlMixin._drain_helper", "streams.py"): "socket write",
    ("Lock.acquire", "locks.py"): "lock",
    ("Event.wait", "locks.py"): "event",
    ("Condition.wait", "locks.py"): "condition",
    ("Semaphore.acquire", "locks.py"): "semaphore",
    ("Barrier.wait", "locks.py"): "barrier",
    ("Barrier._block", "locks.py"): "barrier",
    ("Barrier._wait", "locks.py"): "barrier",
    ("BaseEventLoop.run_in_executor", "base_events.py"): "executor",
    ("BaseEventLoop.getaddrinfo", "base_events.py"): "executor",
    ("BaseEventLoop.sock_connect", "selector_events.py"): "socket connect",
    ("BaseSelectorEventLoop.sock_connect", "selector_events.py"): "socket connect",
    ("BaseSelectorEventLoop.sock_recv", "selector_events.py"): "socket read",
    ("BaseSelectorEventLoop.sock_recv_into", "selector_events.py"): "socket read",
    ("BaseSelectorEventLoop.sock_sendall", "selector_events.py"): "socket write",
    ("BaseSelectorEventLoop.sock_accept", "selector_events.py"): "socket accept",
    ("BaseSelectorEventLoop._sock_connect_cb", "selector_events.py"): "socket connect",
    ("BaseEventLoop.create_connection", "base_events.py"): "socket connect",
    ("BaseEventLoop.sock_connect", "base_events.py"): "socket connect",
    ("Process.wait", "subprocess.py"): "subprocess",
    ("Process.communicate", "subprocess.py"): "subprocess",
}


def await_kind(names: List[Tuple[str, str, int]], task: Task, task_names: Dict[int, str]) -> str:
    """What a task is suspended on: `names` are its await chain's frames as
    (qualified name, file, line), outermost first (TaskReader.named_frames).  A task awaited directly is named;
    otherwise the innermost frame of asyncio's own library that KINDS knows."""
    if task.state == READY:
        return "ready"
    if task.state == CREATED:
        return "ready (not started)"
    if task.state == RUNNING:
        return "running"
    if task.waiter_is_task:
        return "task %s" % task_names.get(task.waiter, "?")
    for name, filename, _line in reversed(names):
        base = os.path.basename(filename)
        if "asyncio" not in filename:
            continue
        kind = KINDS.get((name, base))
        if kind:
            return kind
    if task.waiter_type and task.waiter_type not in ("_asyncio.Future", "Future"):
        return "future %s" % task.waiter_type
    return "future"


def find_cycles(awaits: Dict[int, List[int]]) -> List[List[int]]:
    """Groups of tasks that await each other (directly or around a loop of
    awaits: none of them can finish), from the graph task -> the tasks it
    awaits; each group in await order from its lowest address.  Strongly
    connected components, found without recursion (Tarjan's, iterative)."""
    index: Dict[int, int] = {}
    low: Dict[int, int] = {}
    on_stack: set = set()
    stack: List[int] = []
    groups: List[List[int]] = []
    counter = 0
    for root in sorted(awaits):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            succ = awaits.get(node) or []
            if i < len(succ):
                work.append((node, i + 1))
                nxt = succ[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1 or node in (awaits.get(node) or []):
                    groups.append(comp)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    out = []
    for comp in groups:
        members = set(comp)
        node, order = min(comp), []
        while node not in order:
            order.append(node)
            node = next((n for n in awaits.get(node, []) if n in members), order[0])
        out.append(order)
    return sorted(out)
