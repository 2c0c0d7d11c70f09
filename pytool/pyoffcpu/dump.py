"""`pyoffcpu dump -p PID`: every thread's stack now, without stopping it.

No BPF and no ptrace: everything is read from /proc and the process's
memory (/proc/PID/mem), so it works on a deadlocked process, where no
context switch ever comes, and costs no BPF compile.  Per thread:

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
from typing import Dict, List, Optional

from .procfs import proc_state, read_text, stat_fields

SYS_FUTEX = 202
STATES = {"R": "running", "S": "sleeping", "D": "uninterruptible (disk)", "T": "stopped",
          "t": "traced", "Z": "zombie", "X": "dead", "I": "idle"}
MUTEX_OWNER_OFF = 8             # glibc x86_64 pthread_mutex_t: {int __lock; unsigned __count; int __owner; ...}
GIL_SPAN = 256                  # struct _gil_runtime_state's bytes: its mutexes and condition variables


@dataclass
class ThreadDump:
    tid: int
    name: str
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


@dataclass
class ProcessDump:
    pid: int
    name: str
    python: str = ""                    # "3.12.1" ("" not Python)
    gil_holder: Optional[int] = None    # tid
    gil: str = ""                       # what is known of the GIL
    threads: List[ThreadDump] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

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


def blocked_syscall(pid: int, tid: int) -> Optional[List[int]]:
    """[nr, arg0..arg5] of the system call the thread is blocked in; None
    when it is running or in none."""
    parts = (read_text(f"/proc/{pid}/task/{tid}/syscall") or "").split()
    if len(parts) < 7 or parts[0] in ("running", "-1"):
        return None
    try:
        return [int(parts[0])] + [int(p, 16) for p in parts[1:7]]
    except ValueError:
        return None


def _syscall_name(nr: int) -> str:
    from . import reasons
    for table in (reasons.SYS_SLEEP, reasons.SYS_LOCK, reasons.SYS_POLL, reasons.SYS_IO):
        if nr in table:
            return table[nr]
    return f"syscall {nr}"


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
        word, _count, owner = struct.unpack("<iIi", mem.read(addr, 12))
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


def dump_process(pid: int, native: bool = False) -> ProcessDump:
    """Everything above for one process (raises OSError when it is gone)."""
    from . import symbols
    from .cpython import detect, walker
    from .memory import MemoryError_, ProcessMemory
    if not os.path.isdir(f"/proc/{pid}"):
        raise FileNotFoundError(f"no such process: {pid}")
    name = (read_text(f"/proc/{pid}/comm") or "?").strip()
    out = ProcessDump(pid, name)
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
        states: Dict[int, int] = {}
        stacks: Dict[int, tuple] = {}
        gil_addr = 0
        if pp is not None:
            try:
                states = walker.thread_states(mem, pp)
            except MemoryError_ as e:
                out.notes.append(f"its thread states cannot be read: {e}")
            for tid, ts in states.items():
                try:
                    stacks[tid] = walker.walk_frames(mem, pp, ts)
                except MemoryError_:
                    pass
            gil_addr = _gil(out, mem, pp, states)
        merger, rec = _merger(pid, pp, mem, native)
        for tid in tids:
            out.threads.append(_thread(pid, tid, mem, clocks, stacks, states, tids, merger, rec,
                                       native, out.gil_holder, gil_addr))
    finally:
        mem.close()
        clocks.close()
    return out


def _gil(out: ProcessDump, mem, pp, states: Dict[int, int]) -> int:
    """Who holds the GIL into out; the GIL's address (0: none)."""
    from .cpython import detect
    lay, why = detect.gil_layout(pp, mem)
    if lay is None:
        out.gil = why or "no GIL state"
        return 0
    try:
        gil = lay.addr
        if not gil:
            interp = mem.u64(pp.runtime + pp.offsets["runtime_interpreters_head"])
            gil = mem.u64(interp + lay.interp_ceval_gil)
        last, locked = struct.unpack("<QI", mem.read(gil + lay.holder, 12))
    except Exception:                                   # noqa: BLE001
        out.gil = "its GIL cannot be read"
        return 0
    by_ts = {ts: tid for tid, ts in states.items()}
    if not locked:
        out.gil = "nobody holds the GIL"
    elif last in by_ts:
        out.gil_holder = by_ts[last]
        out.gil = f"held by thread {out.gil_holder}"
    else:
        out.gil = "held by a thread state that is not in the thread list"
    return gil


def _merger(pid: int, pp, mem, native: bool):
    """A Merger over a Recording of this one moment (record's labels)."""
    from . import symbols
    from .cpython.code import CodeReader
    from .merge import Merger
    from .session import Options, Recording
    rec = Recording(Options())
    if pp is not None:
        rec.pythons[pid] = pp
    if native:
        maps = symbols.parse_maps(read_text(f"/proc/{pid}/maps") or "")
        space = rec.spaces[pid] = symbols.AddressSpace(pid)
        space.add_snapshot(maps)
    merger = Merger(rec, symbols.Symbolizer())
    merger.reader = CodeReader(mem, pp.minor, pp.offsets, pp.code_type) if pp is not None else None
    merger.unwinder = None
    if native:
        from .unwind.loader import NativeUnwinder
        try:
            merger.unwinder = NativeUnwinder(None, tables=True)
            merger.unwinder.update(pid, symbols.parse_maps(read_text(f"/proc/{pid}/maps") or ""))
        except Exception:                               # noqa: BLE001 - no tables: no native frames
            merger.unwinder = None
    return merger, rec


def _thread(pid, tid, mem, clocks, stacks, states, tids, merger, rec, native, holder,
            gil_addr) -> ThreadDump:
    from .bpfdefs import PYS_TRUNCATED
    from .session import NATIVE_ID_BASE, PyStack
    letter = _stat_state(pid, tid)
    t = ThreadDump(tid, (read_text(f"/proc/{pid}/task/{tid}/comm") or "?").strip(), letter,
                   STATES.get(letter, letter))
    then = _exec_start_ms(f"/proc/{pid}/task/{tid}/sched")
    cpu = _last_cpu(pid, tid)
    now_ms = clocks.at(cpu) if cpu is not None and letter != "R" else None
    if now_ms is not None and then is not None and now_ms >= then - 100.0:
        t.idle_s = max(0.0, now_ms - then) / 1000.0   # it ran after the clock was read: just now
    wchan = (read_text(f"/proc/{pid}/task/{tid}/wchan") or "").strip()
    t.wchan = "" if wchan == "0" else wchan
    t.kernel = kernel_stack(pid, tid)
    sc = blocked_syscall(pid, tid)
    if sc is not None:
        t.syscall = _syscall_name(sc[0])
        if sc[0] == SYS_FUTEX:
            t.lock = futex_owner(mem, pid, sc[1], tids, gil_addr, holder)
    t.python = tid in states
    if holder is not None or states:
        t.holds_gil = tid == holder if t.python else None
    h = 0
    if tid in stacks:
        frames, truncated = stacks[tid]
        infos = [merger.reader.code(c) for c, _, _ in frames]
        h = len(rec.pystacks) + 1
        rec.pystacks[h] = PyStack(pid, PYS_TRUNCATED if truncated else 0, frames, infos)
    us = -1
    if native and merger.unwinder is not None:
        got = merger.unwinder.walk_blocked(pid, tid)
        if got is not None:
            us = NATIVE_ID_BASE + tid
            rec.ustacks[us], rec.native_flags[us] = got
    if h or us >= 0:
        labels = [f.label(False, merger._short) for f in merger.frames_for(pid, us, -1, h, 0)]
        t.frames = labels[::-1]
    return t


def children(pid: int) -> List[int]:
    """The processes under pid, depth first (--subprocesses)."""
    kids: Dict[int, List[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        after = stat_fields(f"/proc/{d}/stat")
        if len(after) >= 2 and after[1].isdigit():
            kids.setdefault(int(after[1]), []).append(int(d))
    out, todo = [], sorted(kids.get(pid, []))
    while todo:
        c = todo.pop(0)
        out.append(c)
        todo = sorted(kids.get(c, [])) + todo
    return out


def render_text(d: ProcessDump) -> str:
    head = f"process {d.pid} {d.name}"
    if d.python:
        head += f" (CPython {d.python})"
    head += f", {len(d.threads)} thread" + ("s" if len(d.threads) != 1 else "")
    if d.gil:
        head += f"; the GIL: {d.gil}"
    lines = [head]
    lines += [f"  note: {n}" for n in d.notes]
    names = {t.tid: t.name for t in d.threads}
    for t in d.threads:
        bits = [t.state_text]
        if t.idle_s is not None:
            bits.append(f"for {t.idle_s:.1f} s" if t.idle_s >= 0.05 else "just now")
        if t.syscall:
            bits.append(f"in {t.syscall}")
        if t.holds_gil:
            bits.append("HOLDS THE GIL")
        if t.lock is not None:
            owner = t.lock.get("owner")
            what = "for the GIL" if t.lock.get("gil") else "on a lock"
            bits.append(f"waiting {what} held by thread {owner} ({names.get(owner, '?')})" if owner
                        else f"waiting {what}: " + t.lock.get("why", "its owner is not known"))
        lines.append(f"thread {t.tid} {t.name}: " + ", ".join(bits))
        for f in t.frames:
            lines.append(f"    {f}")
        if not t.frames and not t.python:
            lines.append("    (no Python thread state" + (", no native frames" if d.python else "") + ")")
        if t.kernel:
            lines.append("  kernel: " + " <- ".join(t.kernel[:8]) + (" <- ..." if len(t.kernel) > 8 else ""))
    return "\n".join(lines)
