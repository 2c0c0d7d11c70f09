"""`pyoffcpu dump -p PID`: every thread's stack now, without stopping it.

No BPF and no ptrace: everything is read from /proc and the process's
memory (/proc/PID/mem), so it works on a deadlocked process, where no
context switch ever comes, and costs no BPF compile.  Per thread:

- its name: Python's (threading's Thread.name), else the OS's (comm);
- with `with_locals`: each Python frame's source line, arguments and
  locals (commands/locals.py);

- its Python frames, innermost first, walked from its PyThreadState (the
  interpreter's thread list) with the same layouts the BPF walker uses;
- with `native`: its native frames, unwound in user space from the same
  .eh_frame tables, from the registers /proc/PID/task/TID/syscall gives
  for a thread blocked in a system call (a thread on a CPU has none), and
  the Python frames interleaved as `record` does;
- its kernel stack (/proc/PID/task/TID/stack) and wait channel;
- its state (R, S, D, ...) and how long since it last ran (the
  scheduler's se.exec_start against the clock of the CPU it ran on);
- whether it holds the GIL (the GIL's `locked` and `last_holder`);
- for a thread waiting on a futex: the owner when the word is a pthread
  mutex's (its __owner), else that nobody is recorded (a semaphore, a
  condition variable, a threading.Lock keeps no owner).
"""
from __future__ import annotations

import os
import struct
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from ..kernel.procfs import blocked_syscall, children_by_parent, comm, proc_state, read_text, stat_fields

SYS_FUTEX = 202
STATES = {"R": "running", "S": "sleeping", "D": "uninterruptible (disk)", "T": "stopped",
          "t": "traced", "Z": "zombie", "X": "dead", "I": "idle"}
MUTEX_OWNER_OFF = 8             # glibc x86_64 pthread_mutex_t: {int __lock; unsigned __count; int __owner; ...}
GIL_SPAN = 256                  # struct _gil_runtime_state's bytes: its mutexes and condition variables


@dataclass
class ThreadDump:
    tid: int
    name: str                           # Python's name for it (threading), else comm
    state: str                          # the letter of /proc/.../stat
    state_text: str
    idle_s: Optional[float] = None      # since it last ran (None: running now, or not known)
    wchan: str = ""
    syscall: Optional[str] = None       # the system call it is blocked in
    kernel: List[str] = field(default_factory=list)     # innermost first
    frames: List[str] = field(default_factory=list)     # innermost first: Python (and native)
    python: bool = False                # a Python thread state was found for it
    holds_gil: Optional[bool] = None
    lock: Optional[dict] = None         # waiting on a futex: {"address", "owner", "why"}
    comm: str = ""                      # the OS's name (/proc/.../comm)
    # the ids of the interpreters it has frames in, innermost first, when one
    # is a subinterpreter ([]: the main interpreter's only)
    interpreters: List[int] = field(default_factory=list)
    # --locals: per Python frame, innermost first: {"frame", "source", "locals":
    # [{"name", "argument", "repr", "value"}]}
    locals: Optional[List[dict]] = None


@dataclass
class ProcessDump:
    pid: int
    name: str
    python: str = ""                    # "3.12.1" ("" not Python)
    gil_holder: Optional[int] = None    # tid
    gil: str = ""                       # what is known of the GIL
    # the subinterpreters with a GIL of their own: id -> what is known of it
    interpreter_gils: Dict[int, str] = field(default_factory=dict)
    threads: List[ThreadDump] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    fatal: Optional[dict] = None        # a dead process: the signal that ended it (postmortem.Fatal)

    def as_dict(self) -> dict:
        return asdict(self)


def _stat_state(pid: int, tid: int) -> str:
    return proc_state(f"/proc/{pid}/task/{tid}/stat") or "?"


def _last_cpu(pid: int, tid: int) -> Optional[int]:
    fields = stat_fields(f"/proc/{pid}/task/{tid}/stat")
    try:
        return int(fields[36])              # field 39, `processor`: the CPU it last ran on
    except (IndexError, ValueError):
        return None


class CpuClocks:
    """Each CPU's scheduler clock now, in the clock of se.exec_start: it is
    per CPU (rq clock_task: less the CPU's interrupt and steal time), so a
    thread's last run is compared with the clock of the CPU it ran on, read
    by running this thread there for a moment.  None where that cannot be
    done (an affinity we may not change)."""

    def __init__(self):
        self.now: Dict[int, Optional[float]] = {}
        try:
            self.home = os.sched_getaffinity(0)
        except OSError:
            self.home = None

    def at(self, cpu: int) -> Optional[float]:
        if cpu not in self.now:
            try:
                os.sched_setaffinity(0, {cpu})
                self.now[cpu] = _exec_start_ms("/proc/thread-self/sched")
            except OSError:
                self.now[cpu] = None
        return self.now[cpu]

    def close(self):
        if self.home is not None:
            try:
                os.sched_setaffinity(0, self.home)
            except OSError:
                pass


def _exec_start_ms(path: str) -> Optional[float]:
    for line in (read_text(path) or "").splitlines():
        if line.startswith("se.exec_start"):
            try:
                return float(line.split(":")[1])
            except (IndexError, ValueError):
                return None
    return None


def kernel_stack(pid: int, tid: int) -> List[str]:
    """`futex_wait_queue` ... innermost first (root only)."""
    out = []
    for line in (read_text(f"/proc/{pid}/task/{tid}/stack") or "").splitlines():
        name = line.split("] ", 1)[-1].split("+", 1)[0].strip()
        if name:
            out.append(name)
    return out


def futex_owner(mem, pid: int, addr: int, tids: List[int], gil: int = 0,
                gil_holder: Optional[int] = None) -> dict:
    """What a futex at `addr` says of its owner: the GIL's holder when it
    lies in the GIL (its mutex or condition variable: the thread waits in
    take_gil), a pthread mutex's __owner when the word and the owner look
    like one (locked, owned by a thread of this process), else none."""
    out = {"address": addr, "owner": None}
    if gil and gil <= addr < gil + GIL_SPAN:
        out["gil"] = True
        out["owner"] = gil_holder
        out["why"] = "the GIL"
        return out
    try:
        word = struct.unpack("<i", mem.read(addr, 4))[0]
        owner = struct.unpack("<i", mem.read(addr + MUTEX_OWNER_OFF, 4))[0]
    except Exception:                   # noqa: BLE001 - unreadable: nothing known
        out["why"] = "the lock word cannot be read"
        return out
    if word != 0 and owner in tids:
        out["owner"] = owner
        out["why"] = "a pthread mutex: its __owner"
    else:
        out["why"] = ("its owner cannot be known (a semaphore or a condition variable: "
                      "threading.Lock is one, and keeps no owner)")
    return out


def dump_process(pid: int, native: bool = False, with_locals: bool = False) -> ProcessDump:
    """Everything above for one process (raises OSError when it is gone);
    with_locals: each Python frame's arguments and locals (frame_locals)."""
    from ..cpython import detect, walker
    from ..kernel.memory import MemoryError_, ProcessMemory
    if not os.path.isdir(f"/proc/{pid}"):
        raise FileNotFoundError(f"no such process: {pid}")
    out = ProcessDump(pid, comm(pid))
    tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    clocks = CpuClocks()
    pp = None
    try:
        pp = detect.find_python(pid)
        out.python = pp.version_str
    except Exception as e:                              # noqa: BLE001 - not Python: native only
        out.notes.append(f"not a CPython process ({e}): no Python frames")
    mem = ProcessMemory(pid)
    try:
        m = _moment(pid, pp, mem, native, tids, clocks)
        if pp is not None:
            from ..cpython.process import interpreter_layout
            try:
                pp.interps, _ = interpreter_layout(pp, mem)
                m.interp_states = walker.interp_thread_states(mem, pp)
            except MemoryError_ as e:
                out.notes.append(f"its thread states cannot be read: {e}")
            m.states = {tid: states[0][1] for tid, states in m.interp_states.items()}
            for tid, states in m.interp_states.items():
                addresses: List[int] = []
                try:
                    m.stacks[tid] = walker.walk_thread(mem, pp, states, addresses)
                    m.frame_addresses[tid] = addresses
                except MemoryError_:
                    pass
            m.names = thread_names(pp, mem)
            m.with_locals = with_locals
            m.gil_addr = _gil(out, mem, pp, m.interp_states)
            m.holder = out.gil_holder
            m.holders = _interpreter_gils(out, mem, pp, m.interp_states)
        out.threads = [_thread(m, tid) for tid in tids]
    finally:
        mem.close()
        clocks.close()
    return out


def _gil(out: ProcessDump, mem, pp, states: Dict[int, List[Tuple[int, int]]]) -> int:
    """Who holds the (main interpreter's) GIL into out; the GIL's address (0:
    none).  states: walker.interp_thread_states'."""
    from ..cpython import detect
    lay, why = detect.gil_layout(pp, mem)
    if lay is None:
        out.gil = why or "no GIL state"
        return 0
    try:
        got = detect.read_gil(pp, lay, mem)
    except Exception:                                   # noqa: BLE001
        got = None
    if got is None:
        out.gil = "its GIL cannot be read"
        return 0
    gil, last, locked = got
    by_ts = {ts: tid for tid, sts in states.items() for _, ts in sts}
    if not locked:
        out.gil = "nobody holds the GIL"
    elif last in by_ts:
        out.gil_holder = by_ts[last]
        out.gil = f"held by thread {out.gil_holder}"
    else:
        out.gil = "held by a thread state that is not in the thread list"
    return gil


def _interpreter_gils(out: ProcessDump, mem, pp, states: Dict[int, List[Tuple[int, int]]]) -> List[int]:
    """Who holds the GIL of each subinterpreter that has its own, into
    out.interpreter_gils; the tids that hold one."""
    from ..cpython.detect import read_gil_at
    lay, gil_off = pp.interps, pp.offsets.get("interp_ceval_gil", -1)
    holder_off = pp.offsets.get("gil_last_holder", -1)
    if lay is None or not lay.main_gil or gil_off < 0 or holder_off < 0:
        return []
    by_ts = {ts: tid for tid, sts in states.items() for _, ts in sts}
    holders = []
    for interp in sorted({i for sts in states.values() for i, _ in sts} - {lay.main}):
        try:
            gil = mem.u64(interp + gil_off)
            if not gil or gil == lay.main_gil:
                continue
            interp_id = mem.i32(interp + lay.id_offset)
            last, locked = read_gil_at(mem, gil, holder_off)
        except Exception:                               # noqa: BLE001 - unreadable: not said
            continue
        if not locked:
            out.interpreter_gils[interp_id] = "nobody holds it"
        elif last in by_ts:
            holders.append(by_ts[last])
            out.interpreter_gils[interp_id] = f"held by thread {by_ts[last]}"
        else:
            out.interpreter_gils[interp_id] = "held by a thread state that is not in the thread list"
    return holders


def interpreter_ids(frames) -> List[int]:
    """The interpreters a thread's frames (walker.walk_thread's) ran in,
    innermost first, when one is a subinterpreter; [] otherwise."""
    from ..kernel.bpfdefs import PYF_INTERP
    marks = [i for i, (_code, _offset, flags) in enumerate(frames) if flags & PYF_INTERP]
    ids = [frames[i][1] for i in marks]
    # frames after the last mark: its state in the main interpreter (a
    # thread started in a subinterpreter has none)
    return ids + [0] if marks and marks[-1] < len(frames) - 1 else ids


@dataclass
class _Moment:
    """What the threads of one dump share: the process's memory, the GIL,
    and a Merger over a Recording of this one moment (record's labels)."""
    pid: int
    mem: object
    clocks: CpuClocks
    tids: List[int]
    merger: object
    rec: object
    reader: object = None               # CodeReader (None: not Python)
    unwinder: object = None             # NativeUnwinder with user-space tables (--native)
    stacks: Dict[int, tuple] = field(default_factory=dict)     # tid -> (Python frames, truncated)
    states: Dict[int, int] = field(default_factory=dict)       # tid -> its innermost PyThreadState
    # tid -> its (interpreter, PyThreadState) in each interpreter, innermost first
    interp_states: Dict[int, List[Tuple[int, int]]] = field(default_factory=dict)
    holder: Optional[int] = None
    holders: List[int] = field(default_factory=list)           # of subinterpreters' own GILs
    gil_addr: int = 0
    unwinder_error: str = ""            # why there are no native frames (native asked for)
    names: Dict[int, str] = field(default_factory=dict)        # tid -> Python's name for it
    frame_addresses: Dict[int, List[int]] = field(default_factory=dict)     # tid -> its frames'
    with_locals: bool = False


def thread_names(pp, mem) -> Dict[int, str]:
    """tid -> Python's name of each thread threading knows ({}: none read)."""
    from ..cpython.threadnames import python_thread_names
    try:
        return python_thread_names(pp, mem)
    except Exception:                                   # noqa: BLE001 - names are extra
        return {}


def _moment(pid: int, pp, mem, native: bool, tids: List[int], clocks: Optional[CpuClocks],
            maps=None) -> _Moment:
    """maps: the mappings (None: the live process's, from /proc); a dead
    process (postmortem.py) gives its own, under a pid no process has."""
    from ..native import symbols
    from ..cpython.code import CodeReader
    from ..profile.merge import Merger
    from ..collect.recording import Options, Recording
    rec = Recording(Options())
    if pp is not None:
        rec.pythons[pid] = pp
    m = _Moment(pid, mem, clocks, tids, Merger(rec, symbols.Symbolizer()), rec)
    if pp is not None:
        m.reader = CodeReader(mem, pp.minor, pp.offsets, pp.code_type)
    if native:
        if maps is None:
            maps = symbols.parse_maps(read_text(f"/proc/{pid}/maps") or "")
        rec.spaces[pid] = symbols.AddressSpace(pid)
        rec.spaces[pid].add_snapshot(maps)
        from ..native.unwind.loader import NativeUnwinder
        try:
            m.unwinder = NativeUnwinder(None, tables=True)
            m.unwinder.update(pid, maps)
        except Exception as e:                          # noqa: BLE001 - no tables: no native frames
            m.unwinder = None
            m.unwinder_error = str(e) or type(e).__name__
    return m


def frame_labels(m: _Moment, tid: int, python: Optional[tuple], native: Optional[tuple]) -> List[str]:
    """A thread's frames as record labels them, innermost first: its Python
    frames ((frames, truncated) or None) interleaved with its native ones
    ((pcs, NST_* flags) or None)."""
    from ..kernel.bpfdefs import PYS_TRUNCATED
    from ..collect.recording import NATIVE_ID_BASE, PyStack, code_infos
    h = 0
    if python and m.reader is not None:     # frames BPF walked, with no interpreter to name them: left out
        frames, truncated = python
        infos = code_infos(m.reader, frames)
        h = len(m.rec.pystacks) + 1
        m.rec.pystacks[h] = PyStack(m.pid, PYS_TRUNCATED if truncated else 0, frames, infos)
    us = -1
    if native is not None:
        us = NATIVE_ID_BASE + tid
        m.rec.ustacks[us], m.rec.native_flags[us] = native
    if not h and us < 0:
        return []
    return [f.label(False, m.merger._short) for f in m.merger.frames_for(m.pid, us, -1, h, 0)][::-1]


def _thread(m: _Moment, tid: int) -> ThreadDump:
    from ..kernel.syscalls import syscall_name
    pid = m.pid
    letter = _stat_state(pid, tid)
    os_name = comm(pid, tid)
    t = ThreadDump(tid, m.names.get(tid, os_name), letter, STATES.get(letter, letter), comm=os_name)
    then = _exec_start_ms(f"/proc/{pid}/task/{tid}/sched")
    cpu = _last_cpu(pid, tid)
    now_ms = m.clocks.at(cpu) if cpu is not None and letter != "R" else None
    if now_ms is not None and then is not None and now_ms >= then - 100.0:
        t.idle_s = max(0.0, now_ms - then) / 1000.0   # it ran after the clock was read: just now
    wchan = (read_text(f"/proc/{pid}/task/{tid}/wchan") or "").strip()
    t.wchan = "" if wchan == "0" else wchan
    t.kernel = kernel_stack(pid, tid)
    sc = blocked_syscall(pid, tid)
    if sc is not None and sc.nr >= 0 and len(sc.args) == 6:
        t.syscall = syscall_name(sc.nr)
        if sc.nr == SYS_FUTEX:
            t.lock = futex_owner(m.mem, pid, sc.args[0], m.tids, m.gil_addr, m.holder)
    t.python = tid in m.states
    if m.holder is not None or m.states:
        t.holds_gil = (tid == m.holder or tid in m.holders) if t.python else None
    if tid in m.stacks:
        t.interpreters = interpreter_ids(m.stacks[tid][0])
    native = m.unwinder.walk_blocked(pid, tid) if m.unwinder is not None else None
    t.frames = frame_labels(m, tid, m.stacks.get(tid), native)
    if m.with_locals and tid in m.stacks:
        from .locals import frame_locals
        t.locals = frame_locals(m, tid)
    return t


def children(pid: int) -> List[int]:
    """The processes under pid, depth first (--subprocesses)."""
    kids = children_by_parent()
    out, todo = [], sorted(kids.get(pid, []))
    while todo:
        c = todo.pop(0)
        out.append(c)
        todo = sorted(kids.get(c, [])) + todo
    return out


def render_frame_locals(fl: dict) -> List[str]:
    """--locals: a Python frame's source line, arguments and locals."""
    out = [f"        > {fl['source']}"] if fl.get("source") else []
    for v in fl["locals"]:
        out.append(f"        {'arg ' if v['argument'] else ''}{v['name']} = {v['repr']}")
    return out


def render_text(d: ProcessDump) -> str:
    head = f"process {d.pid} {d.name}"
    if d.python:
        head += f" (CPython {d.python})"
    head += f", {len(d.threads)} thread" + ("s" if len(d.threads) != 1 else "")
    if d.gil:
        head += f"; the GIL: {d.gil}"
    for interp_id, what in sorted(d.interpreter_gils.items()):
        head += f"; interpreter {interp_id}'s own GIL: {what}"
    lines = [head]
    if d.fatal:
        f = d.fatal
        lines.append(f"  killed by {f['signal']} ({f['code_text']})"
                     + (f" at address {f['address']:#x}" if f.get("address") is not None else "")
                     + (f", sent by process {f['sender']}" if f.get("sender") is not None else "")
                     + f" in thread {f['tid']}")
    lines += [f"  note: {n}" for n in d.notes]
    names = {t.tid: t.name for t in d.threads}
    for t in d.threads:
        bits = [t.state_text]
        if t.idle_s is not None:
            bits.append(f"for {t.idle_s:.1f} s" if t.idle_s >= 0.05 else "just now")
        if t.syscall:
            bits.append(f"in {t.syscall}")
        if t.interpreters:
            bits.append("in interpreters " + " < ".join(str(i) for i in t.interpreters))
        if t.holds_gil:
            bits.append("HOLDS THE GIL")
        if t.lock is not None:
            owner = t.lock.get("owner")
            what = "for the GIL" if t.lock.get("gil") else "on a lock"
            bits.append(f"waiting {what} held by thread {owner} ({names.get(owner, '?')})" if owner
                        else f"waiting {what}: " + t.lock.get("why", "its owner is not known"))
        lines.append(f"thread {t.tid}" + (f" {t.name}" if t.name else "") + ": " + ", ".join(bits))
        pending = list(t.locals or [])
        for f in t.frames:
            lines.append(f"    {f}")
            if pending and pending[0]["frame"] == f:
                lines.extend(render_frame_locals(pending.pop(0)))
        if not t.frames and not t.python:
            lines.append("    (no Python thread state" + (", no native frames" if d.python else "") + ")")
        if t.kernel:
            lines.append("  kernel: " + " <- ".join(t.kernel[:8]) + (" <- ..." if len(t.kernel) > 8 else ""))
    return "\n".join(lines)
