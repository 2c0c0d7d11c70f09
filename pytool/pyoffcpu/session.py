"""Loader and session: compiles the BPF, attaches it, registers targets, drains
the kernel maps while the target runs, and decides when the recording ends.

Its product is a `Recording`: raw aggregated stacks (stack ids, Python stack
hashes), the Python stacks with their code objects already read, the targets'
address spaces and thread names.  The merger turns it into a Profile.
"""
from __future__ import annotations

import ctypes
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from . import symbols
from .cpython import detect, walker
from .unwind import loader as unwind_loader
from .cpython.code import CodeInfo, CodeReader
from .memory import MemoryError_, ProcessMemory
from .platform import Platform, ProfilerError

# bpf/ sits at the top of the source tree (the package is installed editable).
BPF_DIR = os.environ.get("PYOFFCPU_BPF_DIR") or os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bpf"))
KINDS = {0: None, 1: "sleep", 2: "runqueue", 3: "uninterruptible", 4: "other"}
DROP_NAMES = ["user stack", "kernel stack", "python read", "python truncated",
              "aggregation map full", "off-cpu start map full", "python stack map full",
              "native stack map full", "native stack incomplete"]
PYS_TRUNCATED = 1
NATIVE_ID_BASE = 1 << 20            # rec.ustacks ids of .eh_frame-walked stacks (bcc's are smaller)
PYF_ENTRY = walker.PYF_ENTRY        # bpf/pyoffcpu.h


@dataclass
class Options:
    pids: List[int] = field(default_factory=list)
    command: List[str] = field(default_factory=list)
    system_wide: bool = False
    duration: Optional[float] = None
    frequency: int = 99
    mode: str = "wall"              # wall | cpu | off
    kernel: bool = False


@dataclass
class PyStack:
    tgid: int
    flags: int
    frames: List[Tuple[int, int, int]]      # (code address, offset, flags), innermost first


@dataclass
class Recording:
    options: Options
    start_time: float = 0.0                 # unix time
    duration_s: float = 0.0
    # (tgid, tid, ustack, kstack, pyhash, kind) -> [count, ns]
    stacks: Dict[Tuple[int, int, int, int, int, int], List[int]] = field(default_factory=dict)
    ustacks: Dict[int, List[int]] = field(default_factory=dict)
    # ids in ustacks >= NATIVE_ID_BASE are .eh_frame-walked stacks: their NST_* flags
    native_flags: Dict[int, int] = field(default_factory=dict)
    kstacks: Dict[int, List[int]] = field(default_factory=dict)
    pystacks: Dict[int, PyStack] = field(default_factory=dict)
    code: Dict[Tuple[int, int], Optional[CodeInfo]] = field(default_factory=dict)
    pythons: Dict[int, detect.PythonProcess] = field(default_factory=dict)
    spaces: Dict[int, symbols.AddressSpace] = field(default_factory=dict)
    thread_names: Dict[int, str] = field(default_factory=dict)
    comms: Dict[int, str] = field(default_factory=dict)
    cmdlines: Dict[int, str] = field(default_factory=dict)
    drops: Dict[str, int] = field(default_factory=dict)
    notices: List[str] = field(default_factory=list)
    exit_status: Optional[int] = None       # of a launched command

    def totals(self) -> Tuple[int, int]:
        """(on-CPU samples, off-CPU ns) so far."""
        samples = sum(v[0] for k, v in self.stacks.items() if k[5] == 0)
        blocked = sum(v[1] for k, v in self.stacks.items() if k[5] != 0)
        return samples, blocked


class Target:
    """One profiled process: its BPF registration, Python runtime and memory."""

    def __init__(self, pid: int, launched: bool = False):
        self.pid = pid
        self.launched = launched
        self.python: Optional[detect.PythonProcess] = None
        self.settled = False            # Python found, or given up looking
        self.first_seen = time.monotonic()
        self.reader: Optional[CodeReader] = None
        self.mem: Optional[ProcessMemory] = None
        self.exited = False


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def _proc_state(stat_path: str) -> str:
    """The state letter of a /proc/.../stat file ("" when it is gone); the
    command name before it may hold spaces and parentheses."""
    fields = (_read_text(stat_path) or "").rsplit(")", 1)[-1].split()
    return fields[0] if fields else ""


def process_alive(pid: int) -> bool:
    return _proc_state(f"/proc/{pid}/stat") not in ("", "Z", "X")


class Session:
    def __init__(self, options: Options, platform: Platform,
                 status: Optional[Callable[[Recording, float], None]] = None,
                 started: Optional[Callable[[], None]] = None):
        self.opts = options
        self.platform = platform
        self.status = status
        self.started = started          # called once BPF is attached and targets registered
        self.rec = Recording(options)
        self.targets: Dict[int, Target] = {}
        self.child_pid: Optional[int] = None
        self.stop_reason: Optional[str] = None
        self.bpf = None
        self.unwinder: Optional[unwind_loader.NativeUnwinder] = None
        self._unwind_cflags: List[str] = []
        self._native_ids: Dict[object, int] = {}   # native stack hash -> id in rec.ustacks
        self._start_ns = 0
        # tid -> (pid, Python stack hash, kind, native stack id) of the threads
        # there at the start
        self._initial: Dict[int, Tuple[int, int, int, int]] = {}

    # -- set up -------------------------------------------------------------
    def _compile(self):
        from bcc import BPF  # imported late: importing bcc is slow and needs root
        o = self.opts
        cflags = [
            f"-I{BPF_DIR}",
            f"-DTASK_FSBASE_OFF={self.platform.task_fsbase_offset}",
            f"-DPTHREAD_SPECIFIC_OFF={self.platform.pthread_specific_offset}",
            f"-DSAMPLE_PERIOD_NS={int(1e9 // o.frequency)}ULL",
            f"-DKERNEL_STACKS={1 if o.kernel else 0}",
            f"-DSYSTEM_WIDE={1 if o.system_wide else 0}",
        ]
        from .platform import BTF_PATH
        self._unwind_cflags = unwind_loader.cflags(BTF_PATH)
        cflags += self._unwind_cflags
        try:
            self.bpf = BPF(text=_bpf_source(os.path.join(BPF_DIR, "pyoffcpu.bpf.c")).encode(),
                           cflags=cflags)
        except Exception as e:
            raise ProfilerError(f"cannot load the BPF programs: {str(e).strip().splitlines()[-1]}",
                                "check that the kernel has BPF and `make install` set up headers")

    def _attach(self):
        from bcc import PerfSWConfig, PerfType
        o = self.opts
        try:
            if o.mode in ("wall", "cpu"):
                self.bpf.attach_perf_event(ev_type=PerfType.SOFTWARE, ev_config=PerfSWConfig.CPU_CLOCK,
                                           fn_name=b"on_cpu_sample",
                                           sample_period=int(1e9 // o.frequency), cpu=-1)
            if o.mode in ("wall", "off"):
                # TRACEPOINT_PROBE attaches itself at load; nothing to do but check it did.
                pass
            else:
                self.bpf.detach_tracepoint(b"sched:sched_switch")
        except Exception as e:
            raise ProfilerError(f"cannot attach BPF: {e}", "is this kernel built with perf events?")
        self.bpf["pystack_events"].open_perf_buffer(self._on_pystack, page_cnt=256,
                                                     lost_cb=self._on_lost)
        # The programs that finish each sample (and walk native stacks from
        # .eh_frame tables when NATIVE_UNWIND=1), called by tail call.
        try:
            self.unwinder = unwind_loader.NativeUnwinder(
                self.bpf, tables="-DNATIVE_UNWIND=1" in self._unwind_cflags)
            self.unwinder.load_programs()
        except Exception as e:
            if self.unwinder is not None:
                self.unwinder.close()
            self.unwinder = None
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            self.rec.notices.append(f"native unwinding off ({msg}): frame-pointer user stacks")

    # -- targets ------------------------------------------------------------
    def _register(self, tgt: Target):
        table = self.bpf["procs"]
        info = table.Leaf()
        for name, _ in info._fields_:
            setattr(info, name, -1)
        info.walker = 0
        py = tgt.python
        if py is not None and py.tss_key >= 0:
            o = py.offsets
            info.walker = detect.walker_kind(py.minor)
            info.tss_key = py.tss_key
            for name in ("tstate_frame", "tstate_cframe", "cframe_current_frame",
                         "tstate_current_frame", "frame_back", "frame_code", "frame_lasti",
                         "iframe_code", "iframe_previous", "iframe_instr", "iframe_is_entry",
                         "iframe_owner", "code_code_adaptive"):
                setattr(info, name, o[name])
        table[table.Key(tgt.pid)] = info

    def _add_target(self, pid: int, launched: bool = False):
        tgt = Target(pid, launched)
        self.targets[pid] = tgt
        self._snapshot(tgt)
        self._find_python(tgt)          # registers with Python frames when found
        if not tgt.settled or tgt.python is None or tgt.reader is None:
            self._register(tgt)         # native stacks meanwhile

    def _find_python(self, tgt: Target):
        """Look for the interpreter; a launched command may take a moment to map it."""
        if tgt.settled:
            return
        pid = tgt.pid
        try:
            if tgt.python is None:
                tgt.python = detect.find_python(pid)
            if detect.refresh_tss(tgt.python):
                tgt.settled = True
                tgt.mem = ProcessMemory(pid)
                tgt.reader = CodeReader(tgt.mem, tgt.python.minor, tgt.python.offsets,
                                        tgt.python.code_type)
                self.rec.pythons[pid] = tgt.python
                self.rec.notices.extend(f"process {pid}: {n}" for n in tgt.python.notices)
                self._register(tgt)
            elif tgt.python.tss_key == -2:
                tgt.settled = True
                self.rec.notices.extend(tgt.python.notices)
        except detect.Unsupported as e:
            tgt.settled = True
            self.rec.notices.append(f"process {pid}: {e}; profiling native stacks only")
        except (detect.NotPython, MemoryError_, OSError):
            # A launched command gets a few seconds to load its interpreter.
            waited = time.monotonic() - tgt.first_seen
            if not tgt.launched or waited > 3.0 or not process_alive(pid):
                tgt.settled = True
                comm = (_read_text(f"/proc/{pid}/comm") or "?").strip()
                self.rec.notices.append(
                    f"process {pid} ({comm}) is not a Python process: profiling native stacks only")

    def _snapshot(self, tgt: Target):
        pid = tgt.pid
        rec = self.rec
        try:
            maps = symbols.read_maps(pid)
        except OSError:
            return
        space = rec.spaces.get(pid)
        if space is None:
            space = rec.spaces[pid] = symbols.AddressSpace(pid)
        space.add_snapshot(maps)
        if self.unwinder is not None:
            self.unwinder.update(pid, maps)
        comm = _read_text(f"/proc/{pid}/comm")
        if comm:
            rec.comms[pid] = comm.strip()
        cmd = _read_text(f"/proc/{pid}/cmdline")
        if cmd:
            rec.cmdlines[pid] = cmd.replace("\0", " ").strip()
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                name = _read_text(f"/proc/{pid}/task/{tid}/comm")
                if name:
                    rec.thread_names[int(tid)] = name.strip()
        except OSError:
            pass

    # -- events ---------------------------------------------------------------
    def _on_pystack(self, cpu, data, size):
        raw = ctypes.cast(data, ctypes.POINTER(_pystack_type())).contents
        n = min(raw.depth, len(raw.frames))
        frames = [(raw.frames[i].code, raw.frames[i].offset, raw.frames[i].flags) for i in range(n)]
        st = PyStack(raw.tgid, raw.flags, frames)
        self.rec.pystacks[raw.hash] = st
        tgt = self.targets.get(raw.tgid)
        if tgt is not None and tgt.reader is not None:
            for code, _, _ in frames:
                key = (raw.tgid, code)
                if key not in self.rec.code:
                    self.rec.code[key] = tgt.reader.code(code)

    def _on_lost(self, count):
        self.rec.drops["python stack events lost"] = self.rec.drops.get(
            "python stack events lost", 0) + count

    def _drain(self):
        """Move the aggregated times out of the kernel so the map stays small."""
        agg = self.bpf["agg"]
        stacks = self.rec.stacks
        try:
            items = list(agg.items_lookup_and_delete_batch())
        except Exception:
            items = []
            for k, v in list(agg.items()):
                items.append((k, v))
                try:
                    del agg[k]
                except KeyError:
                    pass
        for k, v in items:
            key = (k.tgid, k.tid, self._ustack_id(k), k.kstack, k.pystack, k.kind)
            acc = stacks.get(key)
            if acc is None:
                stacks[key] = [v.count, v.ns]
            else:
                acc[0] += v.count
                acc[1] += v.ns
            self._fetch_stack_ids(key[2], k.kstack)

    def _ustack_id(self, key) -> int:
        """The id in rec.ustacks of a key's user stack: the frame-pointer stack
        id, or for an .eh_frame-walked stack an id of its own (read from
        nstacks the first time it is seen)."""
        h = key.nstack
        if not h:
            return key.ustack
        sid = self._native_ids.get(h)
        if sid is None:
            got = self.unwinder.stack(h) if self.unwinder is not None else None
            if got is None:
                return -1
            sid = NATIVE_ID_BASE + len(self._native_ids)
            self._native_ids[h] = sid
            self.rec.ustacks[sid], self.rec.native_flags[sid] = got
        return sid

    def _native_now(self, pid: int, tid: int) -> int:
        """The native stack of a thread blocked right now (walked in user
        space with the same tables), as an id in rec.ustacks; -1: none."""
        got = self.unwinder.walk_blocked(pid, tid) if self.unwinder is not None else None
        if got is None:
            return -1
        sid = NATIVE_ID_BASE + len(self._native_ids)
        self._native_ids[("now", tid)] = sid
        self.rec.ustacks[sid], self.rec.native_flags[sid] = got
        return sid

    def _fetch_stack_ids(self, ustack: int, kstack: int):
        rec = self.rec
        if ustack >= 0 and ustack not in rec.ustacks:
            rec.ustacks[ustack] = _walk(self.bpf["ustacks"], ustack)
        if kstack >= 0 and kstack not in rec.kstacks:
            rec.kstacks[kstack] = _walk(self.bpf["kstacks"], kstack)

    def _flush_blocked(self, now_ns: int):
        """Threads still off the CPU when the recording stops: count them until now."""
        table = self.bpf["offcpu_start"]
        for k, st in list(table.items()):
            tid = k.value
            key = st.key
            if not os.path.exists(f"/proc/{key.tgid}/task/{tid}"):
                continue
            ns = now_ns - st.ts
            if ns <= 0:
                continue
            skey = (key.tgid, key.tid, self._ustack_id(key), key.kstack, key.pystack, key.kind)
            acc = self.rec.stacks.setdefault(skey, [0, 0])
            acc[0] += 1
            acc[1] += ns
            self._fetch_stack_ids(skey[2], key.kstack)

    def _capture_preexisting(self):
        """The targets' threads as they are when recording starts: BPF tells
        which were blocked and until when; their stacks are read here, since
        BPF only sees a stack when a thread leaves the CPU."""
        table = self.bpf["preexisting"]
        self._start_ns = time.monotonic_ns()
        for tgt in self.targets.values():
            pid = tgt.pid
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue
            for tid in tids:
                table[table.Key(tid)] = table.Leaf(0)
            stacks = {}
            if tgt.python is not None and tgt.reader is not None:
                stacks = walker.all_thread_stacks(tgt.python)
            for tid in tids:
                frames, truncated = stacks.get(tid, ([], False))
                pyhash = 0
                if frames:
                    pyhash = (hash((pid, tid, tuple(frames))) & ((1 << 62) - 1)) | (1 << 62)
                    self.rec.pystacks[pyhash] = PyStack(pid, PYS_TRUNCATED if truncated else 0, frames)
                    for code, _, _ in frames:
                        if (pid, code) not in self.rec.code:
                            self.rec.code[(pid, code)] = tgt.reader.code(code)
                self._initial[tid] = (pid, pyhash, _state_kind(pid, tid),
                                      self._native_now(pid, tid))

    def _account_preexisting(self, end_ns: int):
        """Time the threads there at the start spent blocked before their first
        switch-in (all of the recording for a thread that never ran)."""
        for k, v in self.bpf["preexisting"].items():
            tid, first = k.value, v.value
            init = self._initial.get(tid)
            if init is None or first == 1:
                continue
            pid, pyhash, kind, ustack = init
            if first == 0:
                if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                    continue
                first = end_ns
            ns = first - self._start_ns
            if ns <= 0:
                continue
            acc = self.rec.stacks.setdefault((pid, tid, ustack, -1, pyhash, kind), [0, 0])
            acc[0] += 1
            acc[1] += ns

    def _read_drops(self):
        table = self.bpf["drops"]
        for i, name in enumerate(DROP_NAMES):
            total = sum(table[table.Key(i)])
            if total:
                self.rec.drops[name] = total

    def _read_thread_names(self):
        for k, v in self.bpf["thread_names"].items():
            name = bytes(v.c).split(b"\0", 1)[0].decode("utf-8", "replace")
            self.rec.thread_names.setdefault(k.value, name)

    # -- the run --------------------------------------------------------------
    def _launch(self) -> int:
        """fork; the child waits until it is registered, then execs the command."""
        go_r, go_w = os.pipe()
        # closed by a successful exec: EOF tells the parent the child is the command now
        exec_r, exec_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:
            try:
                os.close(go_w)
                os.close(exec_r)
                os.read(go_r, 1)
                os.close(go_r)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.execvp(self.opts.command[0], self.opts.command)
            except OSError as e:
                os.write(exec_w, (e.strerror or str(e)).encode())
            os._exit(127)
        os.close(go_r)
        os.close(exec_w)
        self._release_child = (go_w, exec_r)
        return pid

    def _start_child(self):
        """Let the registered child exec, and wait until it has."""
        go_w, exec_r = self._release_child
        os.write(go_w, b"x")
        os.close(go_w)
        err = b""
        while True:
            chunk = os.read(exec_r, 512)
            if not chunk:
                break
            err += chunk
        os.close(exec_r)
        if err:
            os.waitpid(self.child_pid, 0)
            raise ProfilerError(f"cannot run {self.opts.command[0]}: {err.decode(errors='replace')}",
                                "check the command after --")

    def _check_child(self) -> bool:
        """True while the launched command runs."""
        if self.child_pid is None:
            return True
        try:
            pid, status = os.waitpid(self.child_pid, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        self.rec.exit_status = os.waitstatus_to_exitcode(status)
        self.child_pid = None
        return False

    def request_stop(self, reason: str):
        if self.stop_reason is None:
            self.stop_reason = reason

    def run(self) -> Recording:
        o = self.opts
        self._compile()
        self._attach()
        rec = self.rec
        if o.command:
            # Registered before it execs, so its first instructions are profiled;
            # its interpreter is looked for once it is the command.
            self.child_pid = self._launch()
            tgt = Target(self.child_pid, launched=True)
            self.targets[tgt.pid] = tgt
            self._register(tgt)
            self._start_child()
            self._snapshot(tgt)
            self._find_python(tgt)
        for pid in o.pids:
            self._add_target(pid)
        # The recording starts once every target is registered with BPF.
        start_mono = time.monotonic()
        rec.start_time = time.time()
        if o.mode in ("wall", "off") and o.pids:
            self._capture_preexisting()
        if self.started:
            self.started()
        last_drain = last_slow = start_mono
        deadline = start_mono + o.duration if o.duration else None
        while self.stop_reason is None:
            self.bpf.perf_buffer_poll(timeout=50)
            now = time.monotonic()
            if deadline and now >= deadline:
                self.request_stop("duration")
            if not self._check_child():
                self.request_stop("target exited")
            pending = [t for t in self.targets.values() if not t.settled]
            for tgt in pending:
                self._find_python(tgt)
            if self.unwinder is not None:
                # native stacks reached code in no known mapping: a library
                # was just loaded (or the command just started): look again
                for pid in self.unwinder.missed(0.2):
                    tgt = self.targets.get(pid)
                    if tgt is not None and not tgt.exited:
                        self._snapshot(tgt)
            if now - last_slow >= 0.5:
                last_slow = now
                alive = False
                for tgt in self.targets.values():
                    if not tgt.exited and process_alive(tgt.pid):
                        alive = True
                        self._snapshot(tgt)
                    else:
                        tgt.exited = True
                if self.targets and not alive:
                    self.request_stop("target exited")
            if now - last_drain >= 1.0:
                last_drain = now
                self._drain()
                if self.status:
                    self._read_drops()
                    self.status(rec, now - start_mono)
        end_ns = time.monotonic_ns()
        rec.duration_s = time.monotonic() - start_mono
        # Names and code objects first: the rest can be read after the target is gone.
        self.bpf.perf_buffer_poll(timeout=0)
        self._drain()
        if o.mode in ("wall", "off"):
            self._flush_blocked(end_ns)
            self._account_preexisting(end_ns)
        self._read_drops()
        self._read_thread_names()
        for tgt in self.targets.values():
            if tgt.mem is not None:
                tgt.mem.close()
        if self.unwinder is not None:
            rec.notices.extend(self.unwinder.notices)
            self.unwinder.close()
        self.bpf.cleanup()
        return rec


def _state_kind(pid: int, tid: int) -> int:
    """The kind of off-CPU time (KINDS) of a thread's state in /proc."""
    return {"S": 1, "R": 2, "D": 3, "I": 1}.get(_proc_state(f"/proc/{pid}/task/{tid}/stat"), 4)


def _bpf_source(path: str) -> str:
    """The main BPF file, with each `#include "x.h" /* inline */` replaced by
    that file's text: bcc rewrites map calls (table.lookup()) only in the
    main file, so headers that use maps are pasted into it."""
    out = []
    with open(path) as f:
        for line in f:
            s = line.strip()
            if s.startswith("#include \"") and s.endswith("/* inline */"):
                name = s.split('"')[1]
                out.append(f'#line 1 "{name}"\n')
                with open(os.path.join(os.path.dirname(path), name)) as h:
                    out.append(h.read())
                out.append("\n")
            else:
                out.append(line)
    return "".join(out)


_PYSTACK_TYPE = None


def _pystack_type():
    """ctypes mirror of struct pystack (bpf/pyoffcpu.h)."""
    global _PYSTACK_TYPE
    if _PYSTACK_TYPE is None:
        depth = walker.MAX_DEPTH    # MAX_PY_DEPTH

        class PyFrame(ctypes.Structure):
            _fields_ = [("code", ctypes.c_uint64), ("offset", ctypes.c_int32),
                        ("flags", ctypes.c_uint32)]

        class PyStackC(ctypes.Structure):
            _fields_ = [("hash", ctypes.c_uint64), ("tgid", ctypes.c_uint32),
                        ("depth", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                        ("pad", ctypes.c_uint32), ("frames", PyFrame * depth)]
        _PYSTACK_TYPE = PyStackC
    return _PYSTACK_TYPE


def _walk(table, stack_id: int) -> List[int]:
    try:
        return list(table.walk(stack_id))
    except KeyError:
        return []
