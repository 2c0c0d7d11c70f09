"""The one in-memory profile every exporter reads.

A Profile holds, per process and thread, stacks of frames (root first) with a
weight in nanoseconds of wall time and the kind of time: on-CPU, or off-CPU
with a reason.  Exporters read a Profile and nothing else; `from_folded`
rebuilds one from folded text so exporters and tests can start from text.
"""
from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple


class FrameKind(enum.Enum):
    PYTHON = "python"
    NATIVE = "native"
    KERNEL = "kernel"
    MARKER = "marker"       # [off-cpu], [truncated]
    WAKER = "waker"         # --wakers: `--` and the waker's frames after it (labels only)


@dataclass(frozen=True)
class Frame:
    kind: FrameKind
    name: str                       # qualname / symbol / marker text
    file: Optional[str] = None      # Python source file (full path)
    line: Optional[int] = None      # Python line number
    module: Optional[str] = None    # native: object file path
    # the hash, computed once: a profile hashes each frame of each stack key
    # at every look-up (a tuple does not keep its hash)
    _hash: int = field(default=0, init=False, compare=False, repr=False)

    def __hash__(self) -> int:
        h = self._hash
        if not h:
            h = hash((self.kind, self.name, self.file, self.line, self.module)) or 1
            object.__setattr__(self, "_hash", h)
        return h

    def label(self, full_paths: bool = False, short_file=None) -> str:
        """The frame as the folded format writes it (see DESIGN.md)."""
        if self.kind is FrameKind.PYTHON:
            f = self.file or "?"
            if not full_paths and short_file is not None:
                f = short_file(f)
            line = self.line if self.line is not None and self.line >= 0 else "?"
            return f"{self.name} ({f}:{line})"
        if self.kind is FrameKind.KERNEL:
            return f"{self.name}_[k]"
        return self.name


def python_frame(name, file, line) -> Frame:
    return Frame(FrameKind.PYTHON, name, file, line)


def native_frame(name, module=None) -> Frame:
    return Frame(FrameKind.NATIVE, name, module=module)


def kernel_frame(name) -> Frame:
    return Frame(FrameKind.KERNEL, name)


TRUNCATED = Frame(FrameKind.MARKER, "[truncated]")
# A native stack whose walk stopped at a library whose unwind table was still
# being made (the recording never waits for one): its root-most frame.
TABLE_NOT_READY = Frame(FrameKind.MARKER, "[native table not ready]")
# On-CPU time of a thread that no sample landed in (wall mode: the thread's
# on-CPU time is exact, the samples only split it over stacks).
NOT_SAMPLED = Frame(FrameKind.MARKER, "[on-cpu: not sampled]")
# Time whose stack could not be read (a thread blocked since before the start
# whose memory could not be read).
NO_STACK = Frame(FrameKind.MARKER, "[stack unknown]")
# --off-cpu sampled: a thread's waits shorter than the sampling period, of
# one kind, none of which was sampled: their exact time, without a stack
# (profile/waits.py).
SHORT_WAITS = Frame(FrameKind.MARKER, "[short waits, none sampled]")
# Time whose frames could not be built from what was recorded (merge met
# something it did not expect in one process's data): counted and named in
# the summary; the rest of the profile stands.
FRAMES_NOT_READ = Frame(FrameKind.MARKER, "[frames not read]")
# A Python stack whose frames never reached user space (lost events).
PYTHON_LOST = Frame(FrameKind.MARKER, "[python frames lost]")
# on-CPU inside a CUDA synchronize call: the driver spins until the GPU is done
GPU_SPIN = Frame(FrameKind.MARKER, "[gpu-spin]")
# on-CPU in an OpenMP runtime's wait (a function of libgomp/libomp/libiomp5
# with a spin loop): a thread spinning for work or at a barrier
OMP_SPIN = Frame(FrameKind.MARKER, "[omp-spin]")
# on-CPU in a Python frame (no native frame under it) while the thread did
# not hold the GIL: no CPython thread runs Python code so, the stack is not
# to be trusted (a thread state read as another thread changed it)
GIL_NOT_HELD = Frame(FrameKind.MARKER, "[gil not held]")
# inside CPython's cyclic garbage collector: above the Python frame whose
# allocation (or gc.collect()) started it
GC = Frame(FrameKind.MARKER, "[gc]")
# --wakers: a wait ended by an interrupt (its `current` is not the waker)
WOKEN_BY_TIMER = Frame(FrameKind.MARKER, "[woken by timer]")
WOKEN_BY_IRQ = Frame(FrameKind.MARKER, "[woken by irq]")
# folded: the target's stack, WAKER_SEPARATOR, the waker's frames (leaf first)
# each suffixed WAKER_SUFFIX, as bcc's offwaketime writes them
WAKER_SEPARATOR = "--"
WAKER_SUFFIX = "_[w]"

# Why a thread was off the CPU (reasons.py has them all and the rules).
OFF_SLEEP = "sleep"              # in time.sleep, nanosleep
OFF_RUNQUEUE = "runqueue"        # preempted, runnable, waiting for a CPU
OFF_DISK = "disk"                # uninterruptible (D) in a system call
OFF_OTHER = "other"


def off_cpu_marker(reason: str) -> Frame:
    """`[off-cpu: REASON]`, the innermost frame of an off-CPU stack; --async's
    suspended tasks: `[await: KIND]` or `[ready]` (time of a task, not of
    its thread: it overlaps the loop thread's)."""
    if is_task_wait(reason):
        return Frame(FrameKind.MARKER, f"[{reason}]")
    return Frame(FrameKind.MARKER, f"[off-cpu: {reason}]")


def is_task_wait(reason: Optional[str]) -> bool:
    return reason is not None and (reason.startswith("await: ") or reason in ("ready", "suspended"))


TASK_PREFIXES = ("task ", "tasks in ")


def interpreter_marker(interp_id: int) -> Frame:
    """`[interpreter 2]`: the frames above it ran in that subinterpreter, the
    ones below it (the same thread's) in the main interpreter."""
    return Frame(FrameKind.MARKER, f"[interpreter {interp_id}]")


def task_marker(label: str) -> Frame:
    """--async: `task NAME` / `tasks in CORO`, the first frame under the
    thread root of a task's stacks."""
    return Frame(FrameKind.MARKER, label)


def task_root(frames: Tuple[Frame, ...]) -> Optional[str]:
    """The task root a stack is under (task_marker's label), None: none."""
    if frames and frames[0].kind is FrameKind.MARKER and frames[0].name.startswith(TASK_PREFIXES):
        return frames[0].name
    return None


@dataclass(frozen=True)
class StackKey:
    pid: int
    tid: int
    frames: Tuple[Frame, ...]          # root first, without process/thread roots or markers
    off_cpu: Optional[str] = None      # None: on-CPU; else the off-CPU reason
    # --wakers, off-CPU: who ended the wait, leaf first as folded prints it after
    # `--` (its stack, then its thread and, if another, its process, as
    # markers; [woken by timer] / [woken by irq]); (): not known
    waker: Tuple[Frame, ...] = ()
    _hash: int = field(default=0, init=False, compare=False, repr=False)

    def __hash__(self) -> int:
        h = self._hash
        if not h:
            h = hash((self.pid, self.tid, self.frames, self.off_cpu, self.waker)) or 1
            object.__setattr__(self, "_hash", h)
        return h


@dataclass
class Metadata:
    target: str = ""                  # "pid 4242" / "command: python3 app.py" / "system-wide"
    command_line: str = ""
    python_version: str = ""          # e.g. "3.11.7"
    mode: str = "wall"
    start_time: float = 0.0           # unix seconds
    duration_s: float = 0.0
    frequency_hz: int = 99
    drops: Dict[str, int] = field(default_factory=dict)
    drops_ns: Dict[str, int] = field(default_factory=dict)    # time the drops lost
    notices: List[str] = field(default_factory=list)
    duration_ns: int = 0
    exact_on_cpu: bool = False        # on-CPU per thread from switch times (wall mode)
    waits: Any = None                 # profile/waits.py's WaitCounts: how the waits got their stacks
    # (pid, object path as the process maps it) -> symbols.ModuleSymbols: what
    # the symbolizer found for it (symbols, build-id); the summary reads it
    native_modules: Dict[Tuple[int, str], Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Wake:
    """--wakers: time a thread waited at `where`, ended by `waker`."""
    pid: int
    tid: int
    where: str                      # its innermost Python frame when it blocked ("" : none)
    waker: str                      # "task", "timer", "irq" or "unknown"
    waker_pid: int = 0
    waker_tid: int = 0
    waker_where: str = ""           # the waker's innermost Python frame ("": none)


@dataclass
class GilTimes:
    """A thread's time by its relation to its interpreter's GIL (ns), from
    the GIL's state read at each on-CPU sample and switch-out: on-CPU time
    holding it, running without it (C code that released it), off-CPU time
    holding it (preempted, or blocked in a call that kept it), waiting for it
    (off-CPU reason gil), and on-CPU time whose state was not read."""
    held_on_ns: int = 0
    released_ns: int = 0
    held_off_ns: int = 0
    waiting_ns: int = 0
    unknown_on_ns: int = 0
    gc_ns: int = 0                  # holding it, in the cyclic collector (on- and off-CPU)
    read: bool = False              # the state was read at least once
    # held_ns by GIL: the interpreter that owns it (0: the main interpreter's,
    # which subinterpreters without a GIL of their own share)
    held_by_gil: Dict[int, int] = field(default_factory=dict)

    @property
    def held_ns(self) -> int:
        return self.held_on_ns + self.held_off_ns

    def as_dict(self) -> Dict[str, int]:
        return {"held_ns": self.held_ns, "held_on_cpu_ns": self.held_on_ns,
                "held_off_cpu_ns": self.held_off_ns, "waiting_ns": self.waiting_ns,
                "on_cpu_without_ns": self.released_ns, "on_cpu_unknown_ns": self.unknown_on_ns,
                "in_gc_ns": self.gc_ns,
                "held_by_interpreter_gil_ns": {str(i): ns for i, ns in sorted(self.held_by_gil.items())}}


@dataclass
class ThreadInfo:
    """A thread's exact times inside the recording (ns; first/last from the
    start); with threads > 1 a group of ended threads that started in the
    same entry function, folded into one root (tid < 0)."""
    pid: int
    tid: int
    name: str
    on_cpu_ns: int = 0
    off_cpu_ns: int = 0
    samples: int = 0                  # raw on-CPU samples behind on_cpu_ns
    first_ns: int = 0
    last_ns: int = 0
    threads: int = 1
    entry: str = ""
    ns_tid: int = 0                   # the id inside the thread's PID namespace, 0: the same


    @property
    def is_group(self) -> bool:
        return self.tid < 0

    def root_label(self) -> str:
        """The thread root of the folded contract."""
        if self.is_group:
            where = f" in {self.entry}" if self.entry else ""
            return f"threads {self.threads} ended {self.name}{where}"
        return f"thread {self.tid}{ns_suffix(self.ns_tid)} {self.name}"


def ns_suffix(ns_id: int) -> str:
    """` (ns N)` after a host PID/TID whose process lives in another PID
    namespace (a container), where it is N; nothing otherwise."""
    return f" (ns {ns_id})" if ns_id else ""


@dataclass
class Profile:
    meta: Metadata = field(default_factory=Metadata)
    processes: Dict[int, str] = field(default_factory=dict)     # pid -> comm
    threads: Dict[int, str] = field(default_factory=dict)       # tid -> thread name
    thread_pid: Dict[int, int] = field(default_factory=dict)    # tid -> pid
    weights: Dict[StackKey, int] = field(default_factory=dict)  # ns
    sample_counts: Dict[StackKey, int] = field(default_factory=dict)  # events behind each weight
    # tid -> exact times (from a recording; absent for a profile read from text)
    thread_info: Dict[int, ThreadInfo] = field(default_factory=dict)
    # host pid/tid -> its id in its own PID namespace, where they differ
    ns_ids: Dict[int, int] = field(default_factory=dict)
    # --wakers: ns of waits by who ended them (waits that ended inside the recording)
    wakes: Dict[Wake, int] = field(default_factory=dict)
    # tid -> its GIL times (threads of a process whose GIL state BPF read)
    gil: Dict[int, GilTimes] = field(default_factory=dict)

    def add(self, key: StackKey, ns: int, count: int = 1) -> None:
        if ns <= 0:
            return
        self.weights[key] = self.weights.get(key, 0) + ns
        self.sample_counts[key] = self.sample_counts.get(key, 0) + count
        self.thread_pid.setdefault(key.tid, key.pid)

    def thread_weights(self) -> Iterator[Tuple["StackKey", int]]:
        """The weights of the threads' own time: without --async's suspended
        tasks, whose time overlaps their loop thread's."""
        for key, ns in self.weights.items():
            if not is_task_wait(key.off_cpu):
                yield key, ns

    def total_ns(self, tid: Optional[int] = None, on_cpu: Optional[bool] = None) -> int:
        total = 0
        for key, ns in self.thread_weights():
            if tid is not None and key.tid != tid:
                continue
            if on_cpu is not None and (key.off_cpu is None) != on_cpu:
                continue
            total += ns
        return total

    def thread_root(self, tid: int) -> str:
        info = self.thread_info.get(tid)
        if info is not None:
            return info.root_label()
        return f"thread {tid}{ns_suffix(self.ns_ids.get(tid, 0))} {self.threads.get(tid, '?')}"

    def off_cpu_by_reason(self) -> Dict[int, Dict[str, int]]:
        """Per thread (tid, or group id), its off-CPU ns by reason."""
        acc: Dict[int, Dict[str, int]] = {}
        for key, ns in self.thread_weights():
            if key.off_cpu is not None:
                r = acc.setdefault(key.tid, {})
                r[key.off_cpu] = r.get(key.off_cpu, 0) + ns
        return acc

    def off_cpu_totals(self) -> Dict[str, int]:
        """All threads' off-CPU ns by reason."""
        acc: Dict[str, int] = {}
        for key, ns in self.thread_weights():
            if key.off_cpu is not None:
                acc[key.off_cpu] = acc.get(key.off_cpu, 0) + ns
        return acc

    def _keeping(self, keep) -> "Profile":
        out = Profile(self.meta, dict(self.processes), dict(self.threads), dict(self.thread_pid),
                      thread_info=dict(self.thread_info), ns_ids=dict(self.ns_ids))
        for key, ns in self.weights.items():
            if keep(key):
                out.add(key, ns, self.sample_counts.get(key, 1))
        return out

    def of_process(self, pid: int) -> "Profile":
        """The stacks, threads and times of one process, its target named."""
        import copy
        meta = copy.copy(self.meta)
        meta.target = f"pid {pid}"
        meta.native_modules = {k: v for k, v in self.meta.native_modules.items() if k[0] == pid}
        tids = {t for t, p in self.thread_pid.items() if p == pid}
        tids |= {t for t, info in self.thread_info.items() if info.pid == pid}
        out = Profile(meta, {pid: self.processes.get(pid, "?")},
                      {t: n for t, n in self.threads.items() if t in tids},
                      {t: p for t, p in self.thread_pid.items() if p == pid},
                      thread_info={t: i for t, i in self.thread_info.items() if i.pid == pid},
                      ns_ids={i: n for i, n in self.ns_ids.items() if i == pid or i in tids},
                      wakes={w: ns for w, ns in self.wakes.items() if w.pid == pid},
                      gil={t: g for t, g in self.gil.items() if t in tids})
        for key, ns in self.weights.items():
            if key.pid == pid:
                out.add(key, ns, self.sample_counts.get(key, 1))
        return out

    def filtered(self, keep_on_cpu: bool, keep_off_cpu: bool) -> "Profile":
        return self._keeping(lambda k: keep_on_cpu if k.off_cpu is None else keep_off_cpu)

    def with_reasons(self, reasons) -> "Profile":
        """The on-CPU time and the off-CPU time of these reasons only."""
        return self._keeping(lambda k: k.off_cpu is None or k.off_cpu in reasons)

    # -- the stacks as exporters print them ---------------------------------
    def labelled_stacks(self, threads: bool = True, full_paths: bool = False,
                        ) -> Iterator[Tuple[List[Tuple[str, FrameKind]], int, bool]]:
        """Yield (frames root first as (label, kind), weight ns, on_cpu) with the
        process/thread roots and the off-CPU marker added: the folded contract."""
        short = PathShortener() if not full_paths else None
        for key, ns in sorted(self.weights.items(), key=_sort_key):
            comm = self.processes.get(key.pid, "?")
            in_ns = ns_suffix(self.ns_ids.get(key.pid, 0))
            out = [(f"process {key.pid}{in_ns} {comm}", FrameKind.MARKER)]
            if threads:
                out.append((self.thread_root(key.tid), FrameKind.MARKER))
            for fr in key.frames:
                out.append((fr.label(full_paths, short), fr.kind))
            if key.off_cpu is not None:
                m = off_cpu_marker(key.off_cpu)
                out.append((m.name, m.kind))
            if key.waker:
                out.append((WAKER_SEPARATOR, FrameKind.WAKER))
                for fr in key.waker:
                    out.append((fr.label(full_paths, short) + WAKER_SUFFIX, FrameKind.WAKER))
            yield out, ns, key.off_cpu is None


def _sort_key(item):
    key, _ = item
    return (key.pid, key.tid, key.off_cpu or "", [f.label(True) for f in key.frames],
            [f.label(True) for f in key.waker])


class PathShortener:
    """Shortens a Python source path relative to the sys.path-like root it lives
    under (site-packages, lib/pythonX.Y, the current directory)."""
    _ROOT = re.compile(r".*/(?:site-packages|dist-packages|lib/python\d\.\d+)/")

    def __init__(self, cwd: Optional[str] = None):
        self.cwd = (cwd or os.getcwd()).rstrip("/") + "/"
        self.cache: Dict[str, str] = {}

    def __call__(self, path: str) -> str:
        s = self.cache.get(path)
        if s is None:
            s = self._ROOT.sub("", path, count=1)
            if s == path and path.startswith(self.cwd):
                s = path[len(self.cwd):]
            self.cache[path] = s
        return s


# -- folded text back into a Profile ----------------------------------------
_PY = re.compile(r"^(?P<name>.*) \((?P<file>[^()]*):(?P<line>\d+|\?)\)$")
_PROC = re.compile(r"^process (\d+)(?: \(ns (\d+)\))? ?(.*)$")
_THREAD = re.compile(r"^thread (\d+)(?: \(ns (\d+)\))? ?(.*)$")
_GROUP = re.compile(r"^threads (\d+) ended (.*?)(?: in (.*))?$")
_OFF = re.compile(r"^\[off-cpu(?:: (?P<reason>[^\]]+))?\]$")


def parse_frame(label: str) -> Frame:
    if label.endswith("_[k]"):
        return kernel_frame(label[:-4])
    if label == TRUNCATED.name:
        return TRUNCATED
    if label == TABLE_NOT_READY.name:
        return TABLE_NOT_READY
    m = _PY.match(label)
    if m:
        line = m.group("line")
        return python_frame(m.group("name"), m.group("file"), int(line) if line != "?" else None)
    return native_frame(label)


def from_folded(text: str) -> Profile:
    """Rebuild a Profile from folded lines (weights in microseconds)."""
    prof = Profile()
    groups: Dict[Tuple[int, str], int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        raw = raw.strip()
        if not raw:
            continue
        stack, _, weight = raw.rpartition(" ")
        if not stack or not weight.isdigit():
            raise ValueError(f"line {n}: not a folded stack: {raw[:80]!r}")
        labels = stack.split(";")
        pid = tid = 0
        m = _PROC.match(labels[0])
        if m:
            pid = int(m.group(1))
            prof.processes[pid] = m.group(3)
            if m.group(2):
                prof.ns_ids[pid] = int(m.group(2))
            labels = labels[1:]
        if labels:
            m = _THREAD.match(labels[0])
            g = _GROUP.match(labels[0]) if not m else None
            if m:
                tid = int(m.group(1))
                prof.threads[tid] = m.group(3)
                if m.group(2):
                    prof.ns_ids[tid] = int(m.group(2))
                labels = labels[1:]
            elif g:
                gkey = (pid, labels[0])
                tid = groups.setdefault(gkey, -(len(groups) + 1))
                prof.threads[tid] = g.group(2)
                prof.thread_info[tid] = ThreadInfo(pid, tid, g.group(2), threads=int(g.group(1)),
                                                   entry=g.group(3) or "")
                labels = labels[1:]
        waker: Tuple[Frame, ...] = ()
        if WAKER_SEPARATOR in labels:
            at = labels.index(WAKER_SEPARATOR)
            waker = tuple(_waker_frame(lb) for lb in labels[at + 1:])
            labels = labels[:at]
        off = None
        if labels:
            m = _OFF.match(labels[-1])
            if m:
                off = m.group("reason") or OFF_OTHER     # `[off-cpu]`: files of earlier versions
                labels = labels[:-1]
            elif labels[-1].startswith("[") and is_task_wait(labels[-1][1:-1]):
                off = labels[-1][1:-1]
                labels = labels[:-1]
        frames = tuple(task_marker(lb) if i == 0 and lb.startswith(TASK_PREFIXES) else parse_frame(lb)
                       for i, lb in enumerate(labels))
        key = StackKey(pid, tid or pid, frames, off, waker)
        prof.add(key, int(weight) * 1000)
    return prof


def _waker_frame(label: str) -> Frame:
    """A frame after `--`, its `_[w]` taken off (thread and process roots,
    [woken by ...]: markers)."""
    if label.endswith(WAKER_SUFFIX):
        label = label[:-len(WAKER_SUFFIX)]
    if label.startswith("[") and label.endswith("]") or _THREAD.match(label) or _PROC.match(label):
        return Frame(FrameKind.MARKER, label)
    return parse_frame(label)
