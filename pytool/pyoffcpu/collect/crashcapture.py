"""The crash watcher's BPF side (bpf/crashes.bpf.c): at the delivery of a
fatal signal (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL), in the thread that
receives it, BPF copies what is needed to show that thread's stacks once the
process is gone: registers, the user stack's bytes, the kernel stack, and for
a registered Python process its frames and the code objects they name (with
the strings and line tables CodeReader reads).  Here: the load (the
profiler's loader and cache, bpfload.py), the registrations, and the records
put back together into CrashEvents.

    cap = CrashCapture(uid=None, pids=None)       # None: every user / process
    cap.register_python(pid, detect.find_python(pid))
    for ev in cap.poll(1.0): ...
    reader = CodeReader(CapturedMemory(ev.memory), pp.minor, pp.offsets, pp.code_type)

Records of one capture come from one CPU, in order (crashes.h); a capture is
complete at its CR_END record.  One whose records were lost (the perf buffer
full) is given as far as it came, flagged, once its END is seen or after
INCOMPLETE_AFTER_S.
"""
from __future__ import annotations

import bisect
import ctypes
import os
import struct
import time
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..kernel import bpfdefs
from ..kernel.bpfdefs import BPF_DIR
from ..kernel.memory import WordReads
from .maps import bpf_source, fdinfo
from ..cpython.code import code_fields, code_span

V = bpfdefs.value
CR_MAIN, CR_STACK, CR_PYSTACK, CR_MEM, CR_END = (V(n) for n in ("CR_MAIN", "CR_STACK", "CR_PYSTACK",
                                                                "CR_MEM", "CR_END"))
CR_ANY_UID = V("CR_ANY_UID")
CR_CODE_MAX = V("CR_CODE_MAX")
CR_WATCHED, CR_WATCHED_NEW = V("CR_WATCHED"), V("CR_WATCHED_NEW")
CR_BIRTH_EXEC, CR_BIRTH_FORK = V("CR_BIRTH_EXEC"), V("CR_BIRTH_FORK")
CR_EXE_NATIVE, CR_EXE_PYTHON = V("CR_EXE_NATIVE"), V("CR_EXE_PYTHON")
# the exec'd program's file, bprm->file->f_inode->{i_ino, i_sb->s_dev}: where each lies
EXE_FIELDS = {("linux_binprm", "file"): "BPRM_FILE_OFF", ("file", "f_inode"): "FILE_INODE_OFF",
              ("inode", "i_ino"): "INODE_INO_OFF", ("inode", "i_sb"): "INODE_SB_OFF",
              ("inode", "i_generation"): "INODE_GEN_OFF",
              ("super_block", "s_dev"): "SB_DEV_OFF"}
BIRTH_PAGES = 8                 # per CPU, for the births (48 bytes each with the header: 85 a page)
CRF = bpfdefs.with_prefix("CRF_")
# the registers CapturedThread.regs names, from struct pt_regs (offsets from BTF)
REGS = ("ip", "sp", "bp", "bx", "ax", "orig_ax", "di", "si", "dx", "cx", "r8", "r9", "r10", "r11",
        "r12", "r13", "r14", "r15", "cs", "flags", "ss")
BUFFER_TOTAL = 2 << 20              # the perf buffer, all CPUs together: a storm's burst (a hundred
                                    # captures of ~8 KiB without their stacks, a few of ~40 KiB with)


def page_cnt_for(ncpus: int) -> int:
    """Pages per CPU: BUFFER_TOTAL spread over the CPUs (a burst spreads over
    them too), a power of two, 64 (256 KiB: a full capture of a deep stack)
    to 256."""
    want = BUFFER_TOTAL // max(ncpus, 1) // 4096
    n = 64
    while n < want and n < 256:
        n *= 2
    return n


INCOMPLETE_AFTER_S = 2.0            # a capture without its END by then is given as it is
_BPF_ENABLE_STATS, _BPF_STATS_RUN_TIME = 32, 0
_T = bpfdefs.struct_type


def program_source() -> Tuple[str, List[str]]:
    """(the BPF text, its flags) of the crash watcher's programs."""
    return bpf_source(os.path.join(BPF_DIR, "crashes.bpf.c")), [f"-I{BPF_DIR}"]


class Birth(NamedTuple):
    """A process born (bpf/crashes.h crash_birth)."""
    kind: int                   # CR_BIRTH_EXEC, CR_BIRTH_FORK
    pid: int
    parent: int                 # a fork's parent
    ns: int                     # when (CLOCK_MONOTONIC ns)
    exe: Tuple[int, int, int]   # an exec's program file: (the kernel's dev_t, inode, generation)


@dataclass
class CapturedThread:
    tid: int
    regs: Dict[str, int]          # 'ip','sp','bp','bx','ax','orig_ax','di','si','dx','r10','r8','r9','cs','fsbase'
    stack: bytes                  # user stack bytes from regs['sp'] upward ('' when not copied)
    kernel: List[int]             # kernel stack addresses, innermost first
    python: Optional[Tuple[List[Tuple[int, int, int]], bool]]   # (frames (code, offset, flags) innermost first, as walker.walk_frames returns them; truncated), None: not walked


@dataclass
class CrashEvent:
    pid: int
    tid: int
    uid: int
    comm: str
    sig: int
    si_code: int
    addr: int
    handler: int
    time_ns: int
    thread: CapturedThread
    others: List[CapturedThread]  # other threads' Python stacks (regs {}, stack b"", kernel []), in the interpreter's list order
    memory: List[Tuple[int, bytes]]   # (address, bytes) ranges copied: the code objects and what they point to
    flags: int = 0                # CRF_* (bpf/crashes.h): what the capture could not take
    complete: bool = True         # False: records of it were lost (or its END never came)
    start_ticks: int = 0          # the process's start, in /proc/PID/stat's starttime ticks
    execs: int = 0                # its execs since the watcher started (CrashCapture.execs)

    def flag_notes(self) -> List[str]:
        """What the capture could not take, as a report says it."""
        f, out = self.flags, []
        if f & CRF["LIGHT"]:
            out.append(f"one of more than {V('CR_FULL_PER_UID_S')} crashes of user {self.uid} in a second: "
                       "its user stack was not copied (native frames: the innermost only)")
        if f & CRF["PART_LOST"]:
            out.append("part of the capture did not fit in the perf buffer (a burst of crashes)")
        if f & (CRF["CODE_CALL"] | CRF["OBJS_LEFT"]):
            out.append("some code objects or other threads were left out (the capture's tail calls ran out)")
        if f & CRF["OTHERS_READ"]:
            out.append("the other threads' list could not be read: their Python frames are left out")
        return out


class CapturedMemory(WordReads):
    """ProcessMemory's interface over the ranges a capture copied: a read
    is answered only when it lies wholly inside one of them."""
    snapshot = True

    def __init__(self, ranges: Sequence[Tuple[int, bytes]]):
        self._ranges = sorted(((a, bytes(b)) for a, b in ranges if b), key=lambda r: r[0])
        self._starts = [a for a, _ in self._ranges]
        self._longest = max((len(b) for _, b in self._ranges), default=0)

    def read(self, addr: int, size: int) -> bytes:
        from ..kernel.memory import MemoryError_
        if addr < 0 or size < 0:
            raise MemoryError_(f"bad read of {size} at {addr:#x}")
        i = bisect.bisect_right(self._starts, addr) - 1
        # ranges may overlap (a name inside its code object's span): look back
        # at every one that starts close enough to hold addr
        while i >= 0 and addr - self._starts[i] < self._longest:
            start, data = self._ranges[i]
            if addr + size <= start + len(data):
                return data[addr - start:addr - start + size]
            i -= 1
        raise MemoryError_(f"read {size} at {addr:#x}: not captured")

    def close(self) -> None:
        pass


def code_layout(pp) -> Dict[str, int]:
    """crash_layout (bpf/crashes.h) of an interpreter: where CodeReader
    reads a code object and its str and bytes objects (cpython/code.py),
    code_span covering every field of the code object it reads."""
    o = pp.offsets
    read = code_fields(o)
    name = next(off for what, off, _ in read if what == "name")
    _, span = code_span(read)
    for _, off, _ in read[1:]:
        if off < 0 or off + 8 > CR_CODE_MAX:
            raise ValueError(f"code object field at {off}: out of the copy's reach")
    return {"code_span": span, "code_name": name, "code_filename": o["code_filename"],
            "code_linetable": o["code_linetable"], "unicode_length": o["unicode_length"],
            "unicode_state": o["unicode_state"], "ascii_data": o["ascii_data"],
            "compact_data": o["compact_data"], "bytes_size": o["bytes_size"],
            "bytes_data": o["bytes_data"],
            # the other threads (crash_other)
            "tstate_interp": o["tstate_interp"], "interp_threads_head": o["interp_threads_head"],
            "tstate_next": o["tstate_next"], "tstate_native_thread_id": o["tstate_native_thread_id"],
            "tstate_thread_id": o["tstate_thread_id"], "pthread_tid": pp.thread_layout.tid}


def _btf_offsets() -> Tuple[Dict[str, int], Dict[str, int], int, bool]:
    """({task_struct field: offset} (thread.fsbase, group_leader,
    start_boottime, pid, tgid), {register: offset in pt_regs}, sizeof(pt_regs),
    whether sched_process_exit passes group_dead (as platform.probe reads it))."""
    from ..kernel.btf import TRACEPOINT_ARGS, member_offsets
    from .platform import BTF_PATH
    task = ("thread.fsbase", "group_leader", "start_boottime", "pid", "tgid")
    offs = member_offsets(BTF_PATH, [("task_struct", f) for f in task] + [("pt_regs", r) for r in REGS]
                          + list(EXE_FIELDS) + [(TRACEPOINT_ARGS, "sched_process_exit")])
    regs = dict(zip(REGS, offs[len(task):len(task) + len(REGS)]))
    out = dict(zip(task, offs))
    out.update(zip(EXE_FIELDS, offs[len(task) + len(REGS):-1]))
    return out, regs, max(regs.values()) + 8, offs[-1] >= 2


def _frames(py) -> Tuple[List[Tuple[int, int, int]], bool]:
    """(frames, truncated) of a crash_py record, as walker.walk_frames gives them."""
    st = py.st
    return ([(f.code, f.offset, f.flags) for f in st.frames[:st.depth]],
            bool(st.flags & bpfdefs.PYS_TRUNCATED))


class _Pending:
    """The records of one capture so far."""

    def __init__(self, now: float):
        self.main = None
        self.stack = b""
        self.py = None
        self.others: list = []      # the other threads' crash_py records, in list order
        self.memory: List[Tuple[int, bytes]] = []
        self.end = None
        self.first_seen = now
        self.lossy = False


class CrashCapture:
    """The watcher's BPF programs, loaded and attached (see the module's doc)."""

    def __init__(self, uid: Optional[int] = None, pids: Optional[Sequence[int]] = None,
                 page_cnt: Optional[int] = None, cache_dir: Optional[str] = "default",
                 births: bool = False):
        """births: tell of every exec and fork (take_births), and watch
        each new image until unwatch_new (the watcher reads it meanwhile)."""
        from . import bpfload
        from ..kernel import bpfsys
        task, self._reg_offs, regs_size, group_dead = _btf_offsets()
        if regs_size > V("CR_REGS_MAX"):
            raise bpfsys.BpfError(f"struct pt_regs of {regs_size} bytes: more than the copy holds")
        ncpus = max(bpfsys.possible_cpus()) + 1
        # the kernel's values are set at load time (bpf/loadconst.h): the
        # compiled programs serve every kernel
        consts = {"TASK_FSBASE_OFF": task["thread.fsbase"], "TASK_LEADER_OFF": task["group_leader"],
                  "TASK_START_OFF": task["start_boottime"], "TASK_PID_OFF": task["pid"],
                  "TASK_TGID_OFF": task["tgid"], "EXIT_GROUP_DEAD": int(group_dead),
                  "PT_REGS_SIZE": regs_size, "PT_REGS_SP_OFF": self._reg_offs["sp"],
                  "PT_REGS_CS_OFF": self._reg_offs["cs"],
                  **{macro: task[field] for field, macro in EXE_FIELDS.items()}}
        self.notices: List[str] = []
        self.bpf = bpfload.load(*program_source(),
                                preload=[(n, bpfsys.RAW_TRACEPOINT) for n in
                                         ("crash_signal", "crash_py", "crash_code", "crash_other")],
                                notices=self.notices, cache_dir=cache_dir, consts=consts,
                                sizes={"bigbuf": ncpus})
        self._stats_fd = -1
        self.lost = 0                   # perf buffer records lost
        self._pending: Dict[Tuple[int, int], _Pending] = {}
        self._done: List[CrashEvent] = []
        self.births: List[Birth] = []   # not taken yet
        self.births_lost = 0            # births the buffer had no room for (a scan finds them)
        try:
            progs = self.bpf["progs"]
            progs[ctypes.c_int(0)] = ctypes.c_int(self.bpf.funcs[b"crash_py"].fd)
            progs[ctypes.c_int(1)] = ctypes.c_int(self.bpf.funcs[b"crash_code"].fd)
            progs[ctypes.c_int(2)] = ctypes.c_int(self.bpf.funcs[b"crash_other"].fd)
            self._births = births
            self.set_filter(uid, pids)
            if page_cnt is None:
                page_cnt = page_cnt_for(len(bpfsys.online_cpus()))
            self.bpf["events"].open_perf_buffer(self._on_record, page_cnt=page_cnt,
                                                lost_cb=self._on_lost)
            self._page_cnt = page_cnt
            if births:
                self.bpf["births"].open_perf_buffer(self._on_birth, page_cnt=BIRTH_PAGES,
                                                    lost_cb=self._on_births_lost)
            self.bpf.attach_raw_tracepoint(tp="signal_deliver", fn_name="crash_signal")
        except BaseException:
            self.bpf.cleanup()
            raise

    # -- what is watched ----------------------------------------------------------------------------
    def set_filter(self, uid: Optional[int] = None, pids: Optional[Sequence[int]] = None) -> None:
        """Only this user's processes (None: every user's), only these
        processes (None: every one)."""
        # changed in place, never emptied first: a watched process that
        # crashed while the map was being rewritten would be missed; the
        # ones BPF added at their exec stay until unwatch_new
        watched = self.bpf["watched"]
        want = set(pids or ())
        for pid in want:
            watched[watched.Key(pid)] = watched.Leaf(CR_WATCHED)
        for k, v in list(watched.items()):
            if k.value not in want and v.value != CR_WATCHED_NEW:
                try:
                    del watched[k]
                except KeyError:
                    pass
        ctl = self.bpf["control"]
        c = ctl.Leaf()
        c.uid = CR_ANY_UID if uid is None else uid
        c.only_watched = int(pids is not None)
        c.births = int(self._births)
        ctl[ctl.Key(0)] = c

    def register_python(self, pid: int, pp) -> None:
        """Walk this process's Python frames at its crash (pp: its
        detect.PythonProcess), as the profiler registers a target."""
        from ..targets.procinfo import fill_proc_info
        from ..cpython.process import interpreter_layout
        from ..kernel.memory import ProcessMemory
        if pp.interps is None and pp.minor >= (3, 12):
            try:                        # its subinterpreters' frames marked, as the profiler's
                mem = ProcessMemory(pid)
                try:
                    pp.interps, _ = interpreter_layout(pp, mem)
                finally:
                    mem.close()
            except Exception:                           # noqa: BLE001 - not marked, frames still walked
                pp.interps = None
        lay = code_layout(pp)
        procs, layouts = self.bpf["procs"], self.bpf["layouts"]
        info = procs.Leaf()
        fill_proc_info(info, pp, 0)
        cl = layouts.Leaf()
        for k, v in lay.items():
            setattr(cl, k, v)
        layouts[layouts.Key(pid)] = cl
        procs[procs.Key(pid)] = info

    def unwatch_new(self, pid: int) -> None:
        """A process BPF began to watch at its exec (CR_WATCHED_NEW), read
        and not selected: no longer watched."""
        watched = self.bpf["watched"]
        try:
            if watched[watched.Key(pid)].value == CR_WATCHED_NEW:
                del watched[watched.Key(pid)]
        except KeyError:
            pass

    def take_births(self) -> List["Birth"]:
        """The processes born since the last call."""
        out, self.births = self.births, []
        return out

    def set_exe_kind(self, exe: Tuple[int, int, int], python: bool) -> None:
        """What the program file exe (Birth.exe) is: its execs are told
        from now on only when it may be Python."""
        t = self.bpf["exe_kinds"]
        key = t.Key()
        key.dev, key.ino, key.generation = exe
        t[key] = t.Leaf(CR_EXE_PYTHON if python else CR_EXE_NATIVE)

    def execs(self, pid: int) -> int:
        """The process's execs since the watcher started (a crash's `execs`
        is compared with the count its registration was made at)."""
        t = self.bpf["execs"]
        try:
            return int(t[t.Key(pid)].value)
        except KeyError:
            return 0

    def unregister(self, pid: int) -> None:
        for name in ("procs", "layouts"):
            t = self.bpf[name]
            try:
                del t[t.Key(pid)]
            except KeyError:
                pass

    # -- the captures ------------------------------------------------------------------------------
    def _on_lost(self, count: int) -> None:
        self.lost += count
        for p in self._pending.values():    # which capture lost them is not known: every open one
            p.lossy = True

    def _on_birth(self, cpu: int, data: bytes) -> None:
        b = _T("crash_birth").from_buffer_copy(data.ljust(ctypes.sizeof(_T("crash_birth")), b"\0"))
        self.births.append(Birth(b.kind, b.pid, b.parent, b.ts, (b.exe.dev, b.exe.ino, b.exe.generation)))

    def _on_births_lost(self, count: int) -> None:
        self.births_lost += count

    def _on_record(self, cpu: int, raw: bytes) -> None:
        hdr = _T("crash_hdr").from_buffer_copy(raw.ljust(ctypes.sizeof(_T("crash_hdr")), b"\0"))
        key = (hdr.id, hdr.tid)
        p = self._pending.get(key)
        if p is None:
            p = self._pending[key] = _Pending(time.monotonic())
        if hdr.kind == CR_MAIN:
            p.main = _T("crash_main").from_buffer_copy(raw.ljust(ctypes.sizeof(_T("crash_main")), b"\0"))
        elif hdr.kind == CR_STACK:
            off = _T("crash_stack").data.offset
            p.stack = raw[off:off + hdr.len]
        elif hdr.kind == CR_PYSTACK:
            py = _T("crash_py").from_buffer_copy(raw.ljust(ctypes.sizeof(_T("crash_py")), b"\0"))
            if p.py is None and py.thread == hdr.tid:
                p.py = py
            else:
                p.others.append(py)
        elif hdr.kind == CR_MEM:
            off = _T("crash_mem").data.offset
            addr = struct.unpack_from("<Q", raw.ljust(_T("crash_mem").addr.offset + 8, b"\0"),
                                      _T("crash_mem").addr.offset)[0]
            p.memory.append((addr, raw[off:off + hdr.len]))
        elif hdr.kind == CR_END:
            p.end = _T("crash_end").from_buffer_copy(raw.ljust(ctypes.sizeof(_T("crash_end")), b"\0"))
            del self._pending[key]
            self._finish(p)

    def _finish(self, p: _Pending) -> None:
        m = p.main
        if m is None:               # its CR_MAIN was lost: nothing to say who crashed
            return
        regs: Dict[str, int] = {}
        if m.regs_len:
            rb = bytes(m.regs)
            regs = {r: struct.unpack_from("<Q", rb, off)[0] for r, off in self._reg_offs.items()}
        regs["fsbase"] = m.fsbase
        kernel = list(m.kstack[:max(m.kstack_len, 0) // 8])
        python = _frames(p.py) if p.py is not None else None
        others = [CapturedThread(tid=o.thread, regs={}, stack=b"", kernel=[], python=_frames(o))
                  for o in p.others if o.thread != m.h.tid]   # (its state in the main interpreter)
        flags = (p.end.flags if p.end is not None else 0) | m.flags
        thread = CapturedThread(tid=m.h.tid, regs=regs, stack=p.stack, kernel=kernel, python=python)
        self._done.append(CrashEvent(
            pid=m.h.tgid, tid=m.h.tid, uid=m.uid, comm=bytes(m.comm).split(b"\0")[0].decode(errors="replace"),
            sig=m.sig, si_code=m.si_code, addr=m.addr, handler=m.handler, time_ns=m.h.id,
            thread=thread, others=others, memory=p.memory, flags=flags,
            complete=p.end is not None and not p.lossy and not flags & CRF["PART_LOST"],
            start_ticks=m.start_ns // (1_000_000_000 // os.sysconf("SC_CLK_TCK")), execs=m.execs))

    def poll(self, timeout_s: float) -> List[CrashEvent]:
        """The captures completed within timeout_s (returns once there is
        one, or a birth (take_births), and none is half-read, or at the
        timeout)."""
        deadline = time.monotonic() + max(timeout_s, 0)
        while True:
            left = deadline - time.monotonic()
            self.bpf.perf_buffer_poll(timeout=max(int(left * 1000), 0))
            now = time.monotonic()
            for key, p in list(self._pending.items()):
                if now - p.first_seen > INCOMPLETE_AFTER_S:
                    del self._pending[key]
                    self._finish(p)
            if ((self._done or self.births) and not self._pending) or now >= deadline:
                break
        out, self._done = self._done, []
        return sorted(out, key=lambda e: e.time_ns)

    # -- what became of the crash signals --------------------------------------------------------------
    def tally(self) -> Dict[str, int]:
        """Counts since the start (bpf/crashes.h CRT_*): seen, lost (no room
        for its first record), rate (over its user's budget: not captured),
        light (captured without its stack's copy)."""
        t = self.bpf["tally"]
        out = {}
        for name in ("SEEN", "LOST", "RATE", "LIGHT"):
            try:
                out[name.lower()] = sum(int(v) for v in t.getvalue(t.Key(V("CRT_" + name))))
            except (KeyError, OSError):
                out[name.lower()] = 0
        return out

    def losses_by_uid(self) -> Dict[int, Tuple[int, int]]:
        """uid -> (crashes over its budget, crashes with no room), all time
        (the users that crashed lately: an LRU map of 1024)."""
        out = {}
        t = self.bpf["budgets"]
        try:
            for k, v in t.items():
                if v.rate or v.lost:
                    out[int(k.value)] = (int(v.rate), int(v.lost))
        except OSError:
            pass
        return out

    # -- costs --------------------------------------------------------------------------------------
    def enable_stats(self) -> None:
        """Have the kernel count the programs' run time (BPF_ENABLE_STATS:
        on while this holds its fd, as kernel.bpf_stats_enabled=1)."""
        if self._stats_fd >= 0:
            return
        from ..kernel.bpfsys import bpf_call, new_attr
        a = new_attr()
        struct.pack_into("<I", a, 0, _BPF_STATS_RUN_TIME)
        self._stats_fd = bpf_call(_BPF_ENABLE_STATS, a)

    def stats(self) -> Dict[str, Tuple[int, int]]:
        """program -> (runs, ns) since it was loaded, counted while stats
        are on (enable_stats, or kernel.bpf_stats_enabled).  crash_signal's
        include its tail calls': it runs at every signal delivery, so
        ns / runs is the cost of one signal, fatal or not."""
        out = {}
        for name, fn in self.bpf.funcs.items():
            info = fdinfo(fn.fd)
            out[name.decode()] = (info.get("run_cnt", 0), info.get("run_time_ns", 0))
        return out

    def map_memory(self) -> Dict[str, int]:
        """map -> bytes the kernel charges for it (memlock), and the perf
        buffer's pages as 'perf buffer (mmap)'."""
        out = {name: fdinfo(fd).get("memlock", 0) for name, fd in self.bpf._map_fds.items()}
        from ..kernel.bpfsys import online_cpus
        out["perf buffer (mmap)"] = len(online_cpus()) * (self._page_cnt + 1) * os.sysconf("SC_PAGE_SIZE")
        return out

    def close(self) -> None:
        if self._stats_fd >= 0:
            os.close(self._stats_fd)
            self._stats_fd = -1
        if self.bpf is not None:
            self.bpf.cleanup()
            self.bpf = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
