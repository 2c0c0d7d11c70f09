"""A process that is no more, as `dump` shows a live one: every thread's
Python and native frames, from what was kept of it when it died.

Two sources feed this: a core file (corefile.py: every thread's registers
and the whole writable memory) and the crash watcher's BPF capture
(collect/crashcapture.py: the signalled thread's registers, the top of its
stack and the code objects its Python frames name).  Both give a memory
reader with ProcessMemory's interface, the mappings, and per thread its
registers; the walks are the ones live stacks use (cpython/walker.py,
native/unwind/walk.py with the same .eh_frame tables, the Merger's
interleaving and labels).
"""
from __future__ import annotations

import os
import signal as _signal
import struct
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ..kernel.memory import MemoryError_

# si_code values (include/uapi/asm-generic/siginfo.h)
_CODES = {
    _signal.SIGSEGV: {1: "SEGV_MAPERR: address not mapped", 2: "SEGV_ACCERR: no permission",
                      3: "SEGV_BNDERR", 4: "SEGV_PKUERR"},
    _signal.SIGBUS: {1: "BUS_ADRALN: misaligned address", 2: "BUS_ADRERR: no such physical address",
                     3: "BUS_OBJERR: object error (a file truncated under its mapping?)",
                     4: "BUS_MCEERR_AR", 5: "BUS_MCEERR_AO"},
    _signal.SIGFPE: {1: "FPE_INTDIV: integer divide by zero", 2: "FPE_INTOVF: integer overflow",
                     3: "FPE_FLTDIV", 4: "FPE_FLTOVF", 5: "FPE_FLTUND", 6: "FPE_FLTRES",
                     7: "FPE_FLTINV", 8: "FPE_FLTSUB"},
    _signal.SIGILL: {1: "ILL_ILLOPC: illegal opcode", 2: "ILL_ILLOPN", 3: "ILL_ILLADR",
                     4: "ILL_ILLTRP", 5: "ILL_PRVOPC", 6: "ILL_PRVREG", 7: "ILL_COPROC",
                     8: "ILL_BADSTK"},
}
_SENT = {0: "SI_USER: kill()", -1: "SI_QUEUE: sigqueue()", -6: "SI_TKILL: tkill()/raise()",
         0x80: "SI_KERNEL"}


def signal_name(signo: int) -> str:
    try:
        return _signal.Signals(signo).name
    except ValueError:
        return f"signal {signo}"


@dataclass
class Fatal:
    """The signal that ended the process."""
    tid: int
    signo: int
    code: int
    addr: Optional[int] = None      # the faulting address (a fault)
    sender: Optional[int] = None    # who sent it (kill, raise)

    def as_dict(self) -> dict:
        return {"tid": self.tid, "signal": signal_name(self.signo), "signo": self.signo,
                "code": self.code, "code_text": self.code_text(), "address": self.addr,
                "sender": self.sender}

    def code_text(self) -> str:
        if self.code > 0 and self.code != 0x80:
            return _CODES.get(self.signo, {}).get(self.code, f"code {self.code}")
        return _SENT.get(self.code, f"code {self.code}")

    def text(self) -> str:
        s = f"{signal_name(self.signo)} ({self.code_text()})"
        if self.addr is not None:
            s += f" at address {self.addr:#x}"
        if self.sender is not None:
            s += f", sent by process {self.sender}"
        return s


@dataclass
class DeadThread:
    tid: int
    regs: Dict[str, int]                # user registers ({}: not known)
    name: str = ""
    # read_u64 for its native walk (None: the process memory's own)
    stack_reader: Optional[Callable[[int], Optional[int]]] = None
    python: Optional[tuple] = None      # (frames, truncated) walked already (BPF), else from memory
    kernel: List[str] = field(default_factory=list)


def memory_u64(mem) -> Callable[[int], Optional[int]]:
    def read_u64(addr: int) -> Optional[int]:
        try:
            return mem.u64(addr)
        except (MemoryError_, OSError, struct.error):
            return None
    return read_u64


def in_syscall(regs: Dict[str, int]) -> Optional[int]:
    """The system call a thread was blocked in (orig_ax), None: in user space."""
    nr = regs.get("orig_ax", -1)
    if nr >= 1 << 63:
        nr -= 1 << 64
    return nr if nr >= 0 else None


def build(pid: int, comm: str, maps, mem, threads: List[DeadThread], fatal: Optional[Fatal],
          pp=None, native: bool = True, notes: Tuple[str, ...] = (), python_note: str = "",
          with_locals: bool = False):
    """The ProcessDump (commands/dump.py) of a dead process.  maps: its
    mappings with paths we can open (a file that is not the one it had is
    left without a path by the caller); pp: its PythonProcess (None: not
    Python, python_note says why); pid: the number it had (nothing under
    /proc is looked at: it may be another process's by now)."""
    from . import dump as D
    from ..cpython import walker
    from ..kernel.syscalls import syscall_name

    out = D.ProcessDump(pid, comm)
    out.notes.extend(notes)
    if python_note:
        out.notes.append(python_note)
    # a pid no process can have: every file is opened by the path the maps
    # give, never through /proc/PID (a number reused since the crash)
    space = 0
    tids = [t.tid for t in threads]
    m = D._moment(space, pp, mem, native, tids, None, maps=maps)
    if m.unwinder_error:
        out.notes.append(f"no native frames ({m.unwinder_error})")
    states: Dict[int, list] = {}        # tid -> walker.interp_thread_states'
    if pp is not None:
        out.python = pp.version_str
        if any(t.python is None for t in threads):
            from ..cpython.process import interpreter_layout
            try:
                pp.interps, _ = interpreter_layout(pp, mem)
                states = walker.interp_thread_states(mem, pp)
            except MemoryError_ as e:
                out.notes.append(f"its thread states cannot be read: {e}")
    gil_addr = D._gil(out, mem, pp, states) if pp is not None and states else 0
    names = D.thread_names(pp, mem) if pp is not None else {}
    mem_u64 = memory_u64(mem)
    for t in threads:
        d = D.ThreadDump(t.tid, names.get(t.tid, t.name), "R", "running", comm=t.name)
        nr = in_syscall(t.regs) if t.regs else None
        if fatal is not None and t.tid == fatal.tid:
            d.state, d.state_text = "!", "took the fatal signal: " + fatal.text()
        elif nr is not None:
            d.state, d.state_text = "S", "blocked"
            d.syscall = syscall_name(nr)
            if nr == D.SYS_FUTEX:
                d.lock = D.futex_owner(mem, pid, t.regs.get("di", 0), tids, gil_addr, out.gil_holder)
        elif not t.regs:
            d.state, d.state_text = "?", "its Python frames at the crash (no registers: no native frames)"
        d.kernel = list(t.kernel)
        frames = t.python
        if frames is None and t.tid in states:
            addresses: List[int] = []
            try:
                frames = walker.walk_thread(mem, pp, states[t.tid], addresses)
            except MemoryError_:
                frames = None
            if frames is not None and with_locals:
                from .locals import frame_locals
                m.stacks[t.tid], m.frame_addresses[t.tid] = frames, addresses
                d.locals = frame_locals(m, t.tid)
        d.python = frames is not None or t.tid in states
        d.interpreters = D.interpreter_ids(frames[0]) if frames else []
        if out.gil_holder is not None or states:
            d.holds_gil = t.tid == out.gil_holder if d.python else None
        native_pcs = None
        if m.unwinder is not None and t.regs.get("sp"):
            native_pcs = m.unwinder.walk_registers(space, t.regs["ip"], t.regs["sp"], t.regs.get("bp"),
                                                   t.stack_reader or mem_u64, t.regs.get("bx"))
        if frames and m.reader is None:
            out.notes.append(f"thread {t.tid}: its Python frames were walked, but the interpreter "
                             "they belong to is not known: left out")
        d.frames = D.frame_labels(m, t.tid, frames, native_pcs)
        out.threads.append(d)
    if m.unwinder is not None:
        m.unwinder.close()
    return out


def bare(pid: int, comm: str, threads: List[DeadThread], fatal: Optional[Fatal], failure: str,
         notes: Tuple[str, ...] = ()):
    """The report of a dead process whose full build failed: what was
    captured, unnamed (registers, the kernel's frames), and a note naming
    what failed.  Touches nothing but its arguments: it cannot fail on the
    process's memory, files or interpreter."""
    from . import dump as D
    out = D.ProcessDump(pid, comm)
    out.notes.extend(notes)
    out.notes.append(f"the report could not be built in full ({failure}): what was captured follows")
    for t in threads:
        d = D.ThreadDump(t.tid, t.name, "R", "running", comm=t.name)
        if fatal is not None and t.tid == fatal.tid:
            d.state, d.state_text = "!", "took the fatal signal: " + fatal.text()
        d.kernel = list(t.kernel)
        if t.regs.get("ip"):
            d.frames = [f"{t.regs['ip']:#x} (sp {t.regs.get('sp', 0):#x})"]
        out.threads.append(d)
    return out


def exe_path(files, auxv: Dict[int, int]) -> Optional[str]:
    """The executable's path: the file mapped where AT_PHDR points."""
    at_phdr = auxv.get(3)
    for fm in files:
        if at_phdr is not None and fm.start <= at_phdr < fm.end:
            return fm.path
    return files[0].path if files else None


def host_path(path: str, root: Optional[str]) -> str:
    """The path a core names, on this machine: under root, unless it names
    a file under root already (a core written from outside the container,
    as gdb's gcore on the host writes one, holds the host's paths)."""
    if not root or path.startswith(root.rstrip("/") + "/"):
        return path
    return os.path.join(root, path.lstrip("/"))
