"""Loader and session: compiles the BPF, attaches it, registers targets, drains
the kernel maps while the target runs, and decides when the recording ends.

Its product is a `Recording`: raw aggregated stacks (stack ids, Python stack
hashes), the Python stacks with their code objects already read, the targets'
address spaces, and per thread its exact times.  The merger turns it into a
Profile.

The recording window is exact: BPF records nothing before `control.start_ns`
or from `control.end_ns` on, and every interval is clamped to it.  In wall
mode every switch of a target thread is seen, so each thread's on-CPU time is
known exactly from its switch timestamps; the samples only say how that time
splits over stacks (`_scale_on_cpu`).
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import struct
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from . import bpfdefs
from ..native import symbols
from .bpfdefs import BPF_DIR, KIND_ONCPU, PYF_ENTRY, PYS_TRUNCATED  # noqa: F401 (re-exported)
from ..cpython import detect, walker
from ..native.unwind import loader as unwind_loader
from ..cpython.code import CodeInfo
from .platform import Platform, ProfilerError
from ..targets.procfs import blocked_syscall, ns_id, proc_state, read_text, rss_kib
from ..profile import reasons
from ..targets.processes import Select, Targets

DROP_NAMES = bpfdefs.drop_names()
TH = bpfdefs.TH
NATIVE_ID_BASE = 1 << 20            # rec.ustacks ids of .eh_frame-walked stacks (bcc's are smaller)
UNSAMPLED = -1000                   # ustack id: on-CPU time no sample landed in
NO_STACK = -1001                    # ustack id: a thread there at the start, stack unreadable
GRACE_S = 0.003                     # a BPF program runs for microseconds: after a flip of
                                    # control.gen (or the end mark) none still uses the old value
LOST_PYTHON = "python stack lost"   # drop: the Python frames of a stack never reached user space


@dataclass
class Options:
    pids: List[int] = field(default_factory=list)
    command: List[str] = field(default_factory=list)
    system_wide: bool = False
    duration: Optional[float] = None
    frequency: int = 99
    mode: str = "wall"              # wall | cpu | off
    kernel: bool = False
    fold_threads: bool = True       # ended threads fold by entry function
    # -a: which processes (none given: every one, SYSTEM_WIDE in BPF)
    match: Optional[str] = None     # a regex searched in the command line
    uid: Optional[int] = None
    python_only: bool = False
    follow: bool = False            # --subprocesses: the targets' children too
    wakers: bool = False            # --wakers: who ended each wait
    # --min-block-us / --max-block-us: waits shorter / longer are left out (ns; 0: no bound)
    min_block_ns: int = 0
    max_block_ns: int = 0
    # --tables-first: every native table made before the recording starts
    # (default: made while it runs; stacks reaching one not ready stop there)
    tables_first: bool = field(default_factory=lambda: tables_first_env())

    @property
    def filtered(self) -> bool:
        """-a with a filter (targets.Select says what a filter is)."""
        return Select(self.match, self.uid, self.python_only).filtered

    @property
    def every_process(self) -> bool:
        """-a without filters: BPF takes every process (SYSTEM_WIDE)."""
        return self.system_wide and not self.filtered


def tables_first_env() -> bool:
    """PYOFFCPU_TABLES_FIRST=1: --tables-first for every command (the tests
    that check whole native stacks set it)."""
    return os.environ.get("PYOFFCPU_TABLES_FIRST") == "1"


@dataclass
class Batch:
    """What Session.batches() hands out after each drain: the Recording
    (session.rec) holds everything drained up to here."""
    elapsed_s: float                # since the start of the recording
    final: bool                     # the recording is over and complete


@dataclass
class PyStack:
    tgid: int
    flags: int
    frames: List[Tuple[int, int, int]]      # (code address, offset, flags), innermost first
    # the code objects, read when the stack arrived (the reader of the image it
    # was walked in); None: look them up in Recording.code
    infos: Optional[List[Optional[CodeInfo]]] = None
    # the interpreter of that image: a process that execs another Python
    # keeps its earlier stacks, in the earlier layouts and line tables
    python: Optional[detect.PythonProcess] = None


@dataclass
class ThreadTimes:
    """One thread's exact times inside the recording (ns; first/last from the
    start), or, with threads > 1, of a group of ended threads folded together."""
    pid: int
    tid: int
    name: str
    on_ns: int = 0                  # wall mode: exact; cpu mode: samples x period
    samples: int = 0                # raw on-CPU samples
    first_ns: int = 0
    last_ns: int = 0
    exited: bool = False
    threads: int = 1
    entry: str = ""                 # a group: the function its threads started in
    first_tid: int = 0              # a group: its first thread


@dataclass
class Recording:
    options: Options
    start_time: float = 0.0                 # unix time
    duration_s: float = 0.0
    duration_ns: int = 0
    # (tgid, tid, ustack, kstack, pyhash, kind) -> [count, ns]; tid < 0: a group
    stacks: Dict[Tuple[int, int, int, int, int, int], List[int]] = field(default_factory=dict)
    ustacks: Dict[int, List[int]] = field(default_factory=dict)
    # ids in ustacks >= NATIVE_ID_BASE are .eh_frame-walked stacks: their NST_* flags
    native_flags: Dict[int, int] = field(default_factory=dict)
    kstacks: Dict[int, List[int]] = field(default_factory=dict)
    pystacks: Dict[int, PyStack] = field(default_factory=dict)
    code: Dict[Tuple[int, int], Optional[CodeInfo]] = field(default_factory=dict)
    pythons: Dict[int, detect.PythonProcess] = field(default_factory=dict)     # the latest image
    python_images: List[detect.PythonProcess] = field(default_factory=list)   # every one, execs too
    spaces: Dict[int, symbols.AddressSpace] = field(default_factory=dict)
    threads: Dict[int, ThreadTimes] = field(default_factory=dict)   # tid (or group id) ->
    comms: Dict[int, str] = field(default_factory=dict)
    cmdlines: Dict[int, str] = field(default_factory=dict)
    # host pid/tid -> its id inside its PID namespace (containers), where they differ
    ns_ids: Dict[int, int] = field(default_factory=dict)
    drops: Dict[str, int] = field(default_factory=dict)
    drops_ns: Dict[str, int] = field(default_factory=dict)           # time the drops lost
    notices: List[str] = field(default_factory=list)
    exit_status: Optional[int] = None       # of a launched command
    exact_on_cpu: bool = False              # on-CPU per thread from switch timestamps
    # --wakers: (the wait's key in stacks, its waker) -> [waits, ns], the waker
    # (kind, tgid, tid, ustack, kstack, pystack, comm); its stacks are in
    # ustacks / kstacks / pystacks like the waits' own
    wakes: Dict[Tuple[tuple, tuple], List[int]] = field(default_factory=dict)
    # waits left out by --min-block-us / --max-block-us: [how many, ns]
    block_filtered: List[int] = field(default_factory=lambda: [0, 0])

    @property
    def thread_names(self) -> Dict[int, str]:
        return {tid: t.name for tid, t in self.threads.items()}

    def totals(self) -> Tuple[int, int]:
        """(on-CPU samples, off-CPU ns) so far."""
        samples = sum(v[0] for k, v in self.stacks.items() if bpfdefs.on_cpu(k[5]))
        blocked = sum(v[1] for k, v in self.stacks.items() if not bpfdefs.on_cpu(k[5]))
        return samples, blocked


class Session:
    def __init__(self, options: Options, platform: Platform,
                 status: Optional[Callable[[Recording, float], None]] = None,
                 started: Optional[Callable[[], None]] = None):
        self.opts = options
        self.platform = platform
        self.status = status
        self.started = started          # called once BPF is attached and targets registered
        self.rec = Recording(options)
        self.start_notices: List[str] = []  # said when the recording starts (the cli prints them)
        self.targets: Optional[Targets] = None     # made once BPF is loaded (run)
        self.child_pid: Optional[int] = None
        self.stop_reason: Optional[str] = None
        self.bpf = None
        self.unwinder: Optional[unwind_loader.NativeUnwinder] = None
        self._unwind_cflags: List[str] = []
        self._native_ids: Dict[object, int] = {}   # native stack hash -> id in rec.ustacks
        self._start_ns = 0
        self._end_ns = 0
        self._gen = 0
        self._control = None
        # tid -> (pid, Python stack hash, kind, native stack id) of the threads
        # there at the start, blocked
        self._initial: Dict[int, Tuple[int, int, int, int]] = {}
        self._tid_keys: Dict[int, List[tuple]] = {}    # live tid -> its keys in rec.stacks
        self._tid_wakes: Dict[int, List[tuple]] = {}   # ... and in rec.wakes
        self._groups: Dict[Tuple[int, str], int] = {}  # (pid, entry) -> group id (< 0)
        self._unresolved: Dict[tuple, List[int]] = {}  # keys whose Python stack is not here yet
        self._stats_path = os.environ.get("PYOFFCPU_STATS_FILE")
        self._t0 = 0.0
        self._entries: Dict[int, Optional[str]] = {}   # Python stack hash -> its entry (_stack_entry)
        self._fixes: Dict[int, Tuple[int, int]] = {}   # tid -> (ts, Python stack hash) (_fix_blocked)
        self._sampled: Optional[set] = None            # -a: the processes the last drain had
        self._bpf_filtered = [0, 0]                    # waits user space left out (--min/max-block-us)
        self._captured: Dict[int, tuple] = {}          # ustack id -> (pid, capture) to walk (_native_now)
        # the files native stacks run through, their function indexes built
        # while the recording runs (_prefetch_symbols)
        self._symbolizer = None
        self._prefetched: set = set()
        self._prefetch_seen: set = set()             # (pid, pc) already looked at
        self._ustack_pid: Dict[int, int] = {}        # user stack id -> the process it was seen in
        self._new_ustacks: List[int] = []

    # -- set up -------------------------------------------------------------
    def _compile(self):
        from . import bpfload  # from the cache without clang; bcc (slow, maps LLVM) on a miss
        o = self.opts
        p = self.platform
        cflags = [
            f"-I{BPF_DIR}",
            f"-DTASK_FSBASE_OFF={p.task_fsbase_offset}",
            f"-DTASK_PID_OFF={p.task_pid_offset}",
            f"-DTASK_TGID_OFF={p.task_tgid_offset}",
            f"-DTASK_EXEC_OFF={p.task_exec_offset}",
            f"-DEXIT_GROUP_DEAD={int(p.exit_group_dead)}",
            f"-DSAMPLE_PERIOD_NS={int(1e9 // o.frequency)}ULL",
            f"-DKERNEL_STACKS={1 if o.kernel else 0}",
            f"-DSYSTEM_WIDE={1 if o.every_process else 0}",
            f"-DWAKERS={int(o.wakers and o.mode in ('wall', 'off'))}",
        ] + [f"-DSYS_REGS_{n}_OFF={off}" for n, off in zip(("IP", "CS", "ORIG_AX"), p.pt_regs_offsets)]
        from .platform import BTF_PATH
        self._unwind_cflags = unwind_loader.cflags(BTF_PATH)
        cflags += self._unwind_cflags
        # only what the mode runs (no sched_switch in cpu mode, no perf event in
        # off mode), all verified at once; the unwinder's may fail (_attach)
        sampled, switches = o.mode in ("wall", "cpu"), o.mode in ("wall", "off")
        try:
            self.bpf = bpfload.load(_bpf_source(os.path.join(BPF_DIR, "pyoffcpu.bpf.c")), cflags,
                                    sizes=map_sizes(o, tables=unwind_loader.tables_on(self._unwind_cflags)),
                                    skip=() if switches else ("sched_switch",),
                                    preload=([("on_cpu_sample", bpfload.PERF_EVENT)] if sampled else [])
                                    + [(fn, bpfload.RAW_TRACEPOINT) for fn in self._wake_programs()],
                                    optional=unwind_loader.program_specs(sampled, switches,
                                                                         bool(self._wake_programs())),
                                    notices=self.rec.notices,
                                    meanwhile=self._head_start if not o.command else None)
        except Exception as e:
            raise ProfilerError(f"cannot load the BPF programs: {str(e).strip().splitlines()[-1]}",
                                "check that the kernel has BPF and `make install` set up headers")
        self._control = self.bpf["control"]

    def _head_start(self, prog):
        """While the kernel verifies the programs (their maps exist, none
        runs yet): the targets registered (_register), so that the recording
        starts sooner — a torch process maps ~90 files, and the verifier
        takes half a second on a busy machine.  What fails here is done
        again, the usual way, once the programs are loaded."""
        try:
            self._register(prog)
        except Exception:               # noqa: BLE001 - again after the load, errors and all
            if self.unwinder is not None:
                self.unwinder.close()
            self.targets = self.unwinder = None

    # --wakers: the interrupt-context tracepoints, exits first (see bpf: wake_irq_enter)
    WAKE_ATTACH = (("irq_handler_exit", "wake_irq_leave"), ("softirq_exit", "wake_irq_leave"),
                   ("hrtimer_expire_exit", "wake_timer_leave"),
                   ("irq_handler_entry", "wake_irq_enter"), ("softirq_entry", "wake_irq_enter"),
                   ("hrtimer_expire_entry", "wake_timer_enter"))

    def _wake_programs(self) -> List[str]:
        if not (self.opts.wakers and self.opts.mode in ("wall", "off")):
            return []
        return sorted({fn for _, fn in self.WAKE_ATTACH})

    def _attach(self):
        from .bpfload import PERF_COUNT_SW_CPU_CLOCK, PERF_TYPE_SOFTWARE
        o = self.opts
        try:
            if o.mode in ("wall", "cpu"):
                self.bpf.attach_perf_event(ev_type=PERF_TYPE_SOFTWARE, ev_config=PERF_COUNT_SW_CPU_CLOCK,
                                           fn_name=b"on_cpu_sample",
                                           sample_period=int(1e9 // o.frequency), cpu=-1)
            # the raw tracepoints are attached at load (raw_tracepoint__*; in cpu
            # mode not sched_switch); --wakers' interrupt ones here, in order
            if self._wake_programs():
                for tp, fn in self.WAKE_ATTACH:
                    self.bpf.attach_raw_tracepoint(tp=tp, fn_name=fn)
        except Exception as e:
            raise ProfilerError(f"cannot attach BPF: {e}", "is this kernel built with perf events?")
        self.bpf["pystack_events"].open_perf_buffer(self._on_pystack, page_cnt=256,
                                                     lost_cb=self._on_lost)
        # The programs that finish each sample (and walk native stacks from
        # .eh_frame tables when NATIVE_UNWIND=1), called by tail call.
        try:
            if self.unwinder is not None and self.unwinder.bpf is not self.bpf:
                self.unwinder.close()   # made for a program that did not load (compiled again)
                self.unwinder = None
            if self.unwinder is None:
                self._make_unwinder()
            self.unwinder.load_programs(perf=o.mode in ("wall", "cpu"), switch=o.mode in ("wall", "off"),
                                        wake=bool(self._wake_programs()))
        except Exception as e:
            if self.unwinder is not None:
                self.unwinder.close()
            self.unwinder = None
            if self.targets is not None:
                self.targets.unwinder = None
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            self.rec.notices.append(f"native unwinding off ({msg}): frame-pointer user stacks")

    def _make_unwinder(self):
        self.unwinder = unwind_loader.NativeUnwinder(
            self.bpf, tables=unwind_loader.tables_on(self._unwind_cflags))
        self.unwinder.copies = self.opts.follow     # BPF copies a parent's entry to its child

    def _register(self, prog=None):
        """The targets (-p, their children with --subprocesses, -a's scan)
        found and registered in BPF's maps, and the control block's settings."""
        o = self.opts
        if prog is not None:
            self.bpf = prog
            self._control = prog["control"]
        if self.unwinder is None:
            try:
                self._make_unwinder()
            except Exception:           # noqa: BLE001 - _attach says why
                self.unwinder = None
        select = Select(o.match, o.uid, o.python_only) if o.system_wide else None
        targets = self.targets = Targets(self.bpf, self.rec, self.unwinder,
                                         lambda pids: self._write_control(targets=pids),
                                         select=select, self_pid=os.getpid(), follow=o.follow,
                                         on_python=self._fix_blocked if o.mode != "cpu" else None,
                                         exit_events=self.platform.exit_group_dead)
        self._write_control(self_tgid=os.getpid(), discover=int(o.system_wide and o.filtered),
                            follow=int(o.follow), min_block_ns=o.min_block_ns,
                            max_block_ns=o.max_block_ns)
        for pid in o.pids:
            targets.add(pid)
        if o.follow and o.pids:
            targets.add_descendants()
        elif o.pids:
            for pid, n in targets.python_descendants().items():
                self.start_notices.append(
                    f"process {pid} has started {n} Python process{'' if n == 1 else 'es'} "
                    "(workers?) that are not recorded: --subprocesses takes them too")
        if o.system_wide:
            targets.scan()
        if self.unwinder is not None:
            # the tables the cache has go in now (a batched load: ~0.1 s for
            # torch's 90 files); the ones to build are made while it records
            while self.unwinder.poll(build=False):
                pass

    def _write_control(self, **fields):
        table = self._control
        k = table.Key(0)
        c = table[k]
        for name, v in fields.items():
            if name == "targets":
                pids = list(v)
                # --subprocesses: BPF adds the children to procs itself
                if len(pids) > bpfdefs.MAX_INLINE_TARGETS or self.opts.follow:
                    c.ntargets = bpfdefs.TARGETS_IN_MAP
                else:
                    c.ntargets = len(pids)
                    for i, pid in enumerate(pids):
                        c.targets[i] = pid
            else:
                setattr(c, name, v)
        table[k] = c

    # -- events ---------------------------------------------------------------
    def _on_pystack(self, cpu, data, size):
        raw = ctypes.cast(data, ctypes.POINTER(_pystack_type())).contents
        n = min(raw.depth, len(raw.frames))
        frames = [(raw.frames[i].code, raw.frames[i].offset, raw.frames[i].flags) for i in range(n)]
        tgt = self.targets.get(raw.tgid)
        if tgt is None and self.opts.follow:
            # a child BPF registered at its fork, before the loop took it in
            # (the fork is in the life log before any stack of the child)
            self.targets.check_life()
            tgt = self.targets.get(raw.tgid)
        infos = python = None
        if tgt is not None and tgt.reader is not None and raw.epoch == tgt.epoch:
            infos = [tgt.reader.code(code) for code, _, _ in frames]
            python = tgt.python
        self.rec.pystacks[raw.hash] = PyStack(raw.tgid, raw.flags, frames, infos, python)

    def _on_lost(self, count):
        self.rec.drops["python stack events lost"] = self.rec.drops.get(
            "python stack events lost", 0) + count

    def _take_agg(self, final: bool) -> List[tuple]:
        """The aggregated times BPF no longer adds to: the old generation (the
        end mark stops BPF entirely, so at the end everything), as tuples
        (tgid, tid, ustack, kstack, pystack, kind, nstack, count, ns); with
        --wakers the same generation of wake_agg goes into rec.wakes."""
        old = None
        if not final:
            old = self._gen
            self._gen ^= 1
            self._write_control(gen=self._gen)
            time.sleep(GRACE_S)
        if self.unwinder is not None:
            # every native stack the old generation's times name was stored
            # before them: all in this batch, or read by an earlier one
            self.unwinder.take_stacks(self._native_ids)
        if "wake_agg" in self.bpf:
            for k, (count, ns) in _take_generation(self.bpf["wake_agg"], WAKE_KEY_FIELDS,
                                                   AGG_VALUE_FIELDS, final, old):
                self._add_wake(dict(zip(WAKE_KEY_FIELDS, k)), count, ns)
        return [(tgid, tid, ustack, kstack, pystack, kind, nstack, count, ns)
                for (tgid, tid, ustack, kstack, pystack, kind, _gen, nstack), (count, ns)
                in _take_generation(self.bpf["agg"], AGG_KEY_FIELDS, AGG_VALUE_FIELDS, final, old)]

    def _add_wake(self, w: Dict[str, int], count: int, ns: int):
        """One wake_agg entry into rec.wakes: the wait's key as in rec.stacks,
        the waker's stacks fetched as a wait's are."""
        uid = self._ustack_id(w["ustack"], w["nstack"])
        wait = (w["tgid"], w["tid"], uid, w["kstack"], w["pystack"], w["kind"])
        wuid = self._ustack_id(w["waker_ustack"], w["waker_nstack"])
        self._fetch_stack_ids(uid, w["kstack"])
        self._fetch_stack_ids(wuid, w["waker_kstack"])
        comm = struct.pack("<QQ", w["waker_comm0"], w["waker_comm1"]).split(b"\0", 1)[0]
        waker = (w["waker_kind"], w["waker_tgid"], w["waker_tid"], wuid, w["waker_kstack"],
                 w["waker_pystack"], comm.decode("utf-8", "replace"))
        key = (wait, waker)
        if key not in self.rec.wakes:
            self._tid_wakes.setdefault(w["tid"], []).append(key)
        _accumulate(self.rec.wakes, key, count, ns)

    def _drain(self, final: bool = False):
        """Move the aggregated times out of the kernel so the maps stay small."""
        flip_ns = time.monotonic_ns()
        items = self._take_agg(final)
        # Python stacks BPF sent before those times were added are in the
        # perf buffer now.
        self.bpf.perf_buffer_poll(timeout=0)
        pystacks, stacks = self.rec.pystacks, self.rec.stacks
        if self.opts.system_wide:
            self._sampled = {it[0] for it in items}
        for tgid, tid, ustack, kstack, pystack, kind, nstack, count, ns in items:
            uid = self._ustack_id(ustack, nstack)
            key = (tgid, tid, uid, kstack, pystack, kind)
            acc = stacks.get(key)
            if acc is not None:
                # a key in rec.stacks has its stacks and Python frames already
                acc[0] += count
                acc[1] += ns
                continue
            self._fetch_stack_ids(uid, kstack)
            if uid not in self._ustack_pid:
                self._ustack_pid[uid] = tgid
                self._new_ustacks.append(uid)
            if pystack and pystack not in pystacks:
                self._hold(key, count, ns)
            else:
                self._add(key, count, ns)
        self._retry_unresolved(final)
        self._walk_captured(final)
        self._prefetch_symbols()
        if self.unwinder is not None:
            self.unwinder.sweep(self._native_ids)
        self._read_threads(fold_before=None if final else flip_ns)

    def _add(self, key, count: int, ns: int):
        if key not in self.rec.stacks and key[1] >= 0:
            self._tid_keys.setdefault(key[1], []).append(key)
        _accumulate(self.rec.stacks, key, count, ns)

    def _hold(self, key, count: int, ns: int):
        """A Python stack whose frames did not reach user space (a lost perf
        event): keep its time aside, and let BPF send the stack again."""
        _accumulate(self._unresolved, key, count, ns)
        try:
            del self.bpf["pystack_seen"][self.bpf["pystack_seen"].Key(key[4])]
        except KeyError:
            pass

    def _retry_unresolved(self, final: bool):
        for key in list(self._unresolved):
            count, ns = self._unresolved[key]
            if key[4] in self.rec.pystacks:
                del self._unresolved[key]
                self._add(key, count, ns)
            elif final:
                # never sent again: keep the time, without its Python frames
                del self._unresolved[key]
                self.rec.drops[LOST_PYTHON] = self.rec.drops.get(LOST_PYTHON, 0) + count
                self.rec.drops_ns[LOST_PYTHON] = self.rec.drops_ns.get(LOST_PYTHON, 0) + ns
                self._add(key, count, ns)

    def _ustack_id(self, ustack: int, nstack: int) -> int:
        """The id in rec.ustacks of a key's user stack: the frame-pointer stack
        id, or for an .eh_frame-walked stack an id of its own (read from
        nstacks the first time it is seen)."""
        h = nstack
        if not h:
            return ustack
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
        """The native stack of a thread blocked right now, as an id in
        rec.ustacks; -1: none.  Its registers and stack are read now and
        walked once its process's tables are ready (_walk_captured): the
        tables are made while the recording runs, and the thread has not
        run meanwhile, so the walk is the one it would have been now."""
        cap = self.unwinder.capture_blocked(pid, tid) if self.unwinder is not None else None
        if cap is None:
            return -1
        sid = NATIVE_ID_BASE + len(self._native_ids)
        self._native_ids[("now", tid)] = sid
        self.rec.ustacks[sid], self.rec.native_flags[sid] = [], 0
        self._captured[sid] = (pid, cap)
        return sid

    def _prefetch_symbols(self):
        """The function indexes of the files the new native stacks run
        through, built in the background (symbols.Symbolizer.prefetch), so
        that naming the profile's frames at the end does not wait for them."""
        from ..native import symindex
        symindex.poll_prefetches()
        if not self._new_ustacks:
            return
        if self._symbolizer is None:
            self._symbolizer = symbols.Symbolizer()
        new, self._new_ustacks = self._new_ustacks, []
        for sid in new:
            pid = self._ustack_pid[sid]
            space = self.rec.spaces.get(pid)
            pcs = self.rec.ustacks.get(sid) or []
            if space is None:
                continue
            for pc in pcs:
                if (pid, pc) in self._prefetch_seen:
                    continue            # a pc of an earlier stack: its file was looked at
                self._prefetch_seen.add((pid, pc))
                m = space.find(pc)
                if m is None or (m.inode, m.path) in self._prefetched or not m.is_file:
                    continue
                self._prefetched.add((m.inode, m.path))
                try:
                    self._symbolizer.prefetch(pid, m, space)
                except (OSError, ValueError):
                    pass

    def _walk_captured(self, final: bool):
        """The stacks _native_now captured, walked once their tables are in
        (at the end, with what is in by then)."""
        if not self._captured or self.unwinder is None:
            return
        for sid, (pid, cap) in list(self._captured.items()):
            if not final and not self.unwinder.captured_ready(pid, cap):
                continue
            del self._captured[sid]
            got = self.unwinder.walk_captured(pid, cap)
            if got is not None:
                self.rec.ustacks[sid], self.rec.native_flags[sid] = got

    def _fetch_stack_ids(self, ustack: int, kstack: int):
        rec = self.rec
        if ustack >= 0 and ustack not in rec.ustacks:
            rec.ustacks[ustack] = _walk(self.bpf["ustacks"], ustack)
        if kstack >= 0 and kstack not in rec.kstacks:
            rec.kstacks[kstack] = _walk(self.bpf["kstacks"], kstack)

    # -- threads --------------------------------------------------------------
    def _read_threads(self, fold_before: Optional[int]):
        """Bring the threads' BPF entries into rec.threads.  Ended threads are
        closed; with fold_before (a drain), those that ended before it —
        all their times are drained by now — fold into their group and leave
        the map, which keeps memory bounded by live threads."""
        table = self.bpf["threads"]
        done = []
        for k, th in _items(table):
            tid = k.value
            self._thread_times(tid, th)
            if fold_before is not None and th.flags & TH["EXITED"] and th.last_ts < fold_before:
                self._close_thread(tid, th)
                self._settle(tid)
                done.append(k)
        _delete_all(table, done)

    def _thread_times(self, tid: int, th) -> ThreadTimes:
        t = self.rec.threads.get(tid)
        name = bytes(th.comm).split(b"\0", 1)[0].decode("utf-8", "replace")
        if t is None:
            t = self.rec.threads[tid] = ThreadTimes(th.tgid, tid, name)
            if th.tgid in self.rec.ns_ids:      # a container's thread: its own id too
                inner = ns_id(f"/proc/{th.tgid}/task/{tid}/status", tid)
                if inner:
                    self.rec.ns_ids[tid] = inner
        elif name:
            t.name = name
        t.on_ns = th.on_ns
        t.exited = bool(th.flags & TH["EXITED"])
        return t

    def _close_thread(self, tid: int, th):
        """A thread's last facts: its lifetime in the window, the on-CPU span
        still open at the end, and the time before its first switch when it
        was there at the start."""
        t = self.rec.threads[tid]
        start, end = self._start_ns, self._end_ns
        flags = th.flags
        born = flags & TH["BORN"]
        t.last_ns = (th.last_ts if flags & TH["EXITED"] else end) - start
        t.first_ns = (th.first_ts - start if th.first_ts else t.last_ns) if born else 0
        if flags & TH["ON"] and not flags & TH["EXITED"]:
            t.on_ns = th.on_ns + (end - th.ts)
        if th.unseen_ns:
            # off-CPU after a switch-out BPF missed: the time is known, its stack not
            self._add((t.pid, tid, NO_STACK, -1, 0, bpfdefs.KIND_OTHER), 1, th.unseen_ns)
        if born or self.opts.mode == "cpu":
            return
        if not th.first_ts:
            # No switch in the whole window: running all along, or blocked
            # all along.  Only a running thread gets samples; without them
            # (--mode off) its state at the start tells.
            initial = self._initial.get(tid)
            if self._samples_of(tid) or (self.opts.mode == "off" and initial is not None
                                         and initial[2] == bpfdefs.KIND_RUNQUEUE):
                t.on_ns = end - start
                return
            self._add_initial(tid, t.pid, end - start)
        elif flags & TH["FIRST_IN"]:
            self._add_initial(tid, t.pid, th.first_ts - start)

    def _add_initial(self, tid: int, pid: int, ns: int):
        """Time a thread there at the start spent blocked before its first
        switch-in, with the stacks read at the start."""
        if ns <= 0:
            return
        if self.left_out_by_length(ns):         # judged by the part inside the recording
            self._bpf_filtered[0] += 1
            self._bpf_filtered[1] += ns
            return
        pid0, pyhash, kind, ustack = self._initial.get(tid, (pid, 0, bpfdefs.KIND_OTHER, NO_STACK))
        self._add((pid0, tid, ustack, -1, pyhash, kind), 1, ns)

    def _samples_of(self, tid: int) -> int:
        return sum(self.rec.stacks[k][0] for k in self._tid_keys.get(tid, ())
                   if bpfdefs.on_cpu(k[5]))

    def _stack_entry(self, pyhash: int) -> Optional[str]:
        """A Python stack's outermost frame that is not threading's own, as
        `name (file)`; None when there is none or a frame is not known yet.
        Remembered for a stack whose frames were all read with it (they never
        change); a server that starts a thread per request asks for the same
        few stacks thousands of times a second."""
        got = self._entries.get(pyhash, False)
        if got is not False:
            return got
        st = self.rec.pystacks.get(pyhash)
        if st is None:
            return None
        infos = st.infos or [self.rec.code.get((st.tgid, c)) for c, _, _ in st.frames]
        entry = None
        for info in reversed(infos):
            if info is None:
                break
            # threading's own frames, and 3.12+'s entry shim (`<interpreter
            # trampoline>` in `<shim>`), are not where a thread started
            if not info.filename.endswith("threading.py") and info.filename != "<shim>":
                entry = f"{info.name} ({os.path.basename(info.filename)})"
                break
        if st.infos:
            self._entries[pyhash] = entry
        return entry

    def _fold(self, tid: int):
        """Fold an ended thread into the group of its process and entry function."""
        t = self.rec.threads.pop(tid)
        keys = self._tid_keys.pop(tid, ())
        stacks = self.rec.stacks
        moved = [(key, stacks.pop(key)) for key in keys]
        # its entry: that of its heaviest Python stack that has one
        entry, best_ns = "", -1
        for key, (_, ns) in moved:
            if key[4] and ns > best_ns:
                e = self._stack_entry(key[4])
                if e is not None:
                    entry, best_ns = e, ns
        gkey = (t.pid, entry or t.name)
        gid = self._groups.get(gkey)
        if gid is None:
            gid = self._groups[gkey] = -(len(self._groups) + 1)
            self.rec.threads[gid] = ThreadTimes(t.pid, gid, t.name, first_ns=t.first_ns,
                                                last_ns=t.last_ns, exited=True, threads=0,
                                                entry=entry)
        g = self.rec.threads[gid]
        g.threads += 1
        g.on_ns += t.on_ns
        if t.first_ns < g.first_ns:
            g.first_ns = t.first_ns
        if t.last_ns > g.last_ns:
            g.last_ns = t.last_ns
        g.samples += t.samples
        if g.threads == 1:
            g.first_tid = tid
        for key, (count, ns) in moved:
            _accumulate(stacks, (key[0], gid) + key[2:], count, ns)
        # its waits' wakers go with them, under the same group
        wakes = self.rec.wakes
        for wait, waker in self._tid_wakes.pop(tid, ()):
            count, ns = wakes.pop((wait, waker))
            _accumulate(wakes, ((wait[0], gid) + wait[2:], waker), count, ns)

    def _settle(self, tid: int):
        """A closed thread's final numbers: its raw sample count and its
        on-CPU time — exact in wall mode, where its sampled stacks are scaled
        to add up to it (the raw counts stay); samples x period in cpu mode.
        Then an ended thread folds into its group."""
        t = self.rec.threads[tid]
        stacks = self.rec.stacks
        on_keys = [k for k in self._tid_keys.get(tid, ()) if bpfdefs.on_cpu(k[5])]
        t.samples = sum([stacks[k][0] for k in on_keys])
        if self.opts.mode == "wall":
            self._scale_on_cpu(t, on_keys)
        elif self.opts.mode == "cpu":
            t.on_ns = t.samples * int(1e9 // self.opts.frequency)
        else:
            t.on_ns = 0
        if t.exited and self.opts.fold_threads:
            self._fold(tid)

    def _scale_on_cpu(self, t: ThreadTimes, keys: List[tuple]):
        """The thread's on-CPU stacks scaled to add up to its exact on-CPU
        time, remainder on the last; time no sample landed in goes to a stack
        of its own ([on-cpu: not sampled])."""
        exact = t.on_ns
        total = sum(self.rec.stacks[k][1] for k in keys)
        if total <= 0:
            if exact > 0:
                self._add((t.pid, t.tid, UNSAMPLED, -1, 0, KIND_ONCPU), 0, exact)
            return
        left = exact
        for i, key in enumerate(keys):
            acc = self.rec.stacks[key]
            share = left if i == len(keys) - 1 else acc[1] * exact // total
            acc[1] = share
            left -= share

    def _finish_threads(self):
        """At the end: close and settle every thread still in the map."""
        self.rec.exact_on_cpu = self.opts.mode == "wall"
        for k, th in _items(self.bpf["threads"]):
            tid = k.value
            if not self.opts.every_process and th.tgid not in self.targets:
                continue
            self._thread_times(tid, th)
            self._close_thread(tid, th)
            t = self.rec.threads[tid]
            if t.last_ns <= t.first_ns and not self._tid_keys.get(tid):
                del self.rec.threads[tid]     # born at the very end: never ran
                continue
            self._settle(tid)

    # -- the start ------------------------------------------------------------
    def _capture_preexisting(self):
        """The stacks of the targets' threads that are blocked at the start,
        read here, since BPF only sees a stack when a thread leaves the CPU."""
        for tgt in self.targets:
            pid = tgt.pid
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue
            stacks = {}
            if tgt.python is not None and tgt.reader is not None:
                stacks = self._thread_stacks(tgt, tids)
            for tid in tids:
                frames, truncated = stacks.get(tid, ([], False))
                pyhash = self._keep_pystack(tgt, tid, frames, truncated) if frames else 0
                self._initial[tid] = (pid, pyhash, _state_kind(pid, tid),
                                      self._native_now(pid, tid))

    def _thread_stacks(self, tgt, tids) -> Dict[int, tuple]:
        """host tid -> (frames, truncated): the Python stacks of tgt's threads
        read from its memory now (walker.all_thread_stacks)."""
        stacks = walker.all_thread_stacks(tgt.python)
        if tgt.pid in self.rec.ns_ids:
            # CPython keeps the ids its own PID namespace gave the threads
            host = {ns_id(f"/proc/{tgt.pid}/task/{t}/status", -1): t for t in tids}
            stacks = {host[t]: st for t, st in stacks.items() if t in host}
        return stacks

    def _keep_pystack(self, tgt, tid: int, frames, truncated: bool) -> int:
        """A Python stack read in user space, kept beside BPF's with its code
        objects; its hash (bit 62 set, as every one read in user space; the
        image's epoch in it, as BPF mixes it into its own)."""
        pyhash = (hash((tgt.pid, tid, tgt.epoch, tuple(frames))) & ((1 << 62) - 1)) | (1 << 62)
        infos = [tgt.reader.code(code) for code, _, _ in frames]
        self.rec.pystacks[pyhash] = PyStack(tgt.pid, PYS_TRUNCATED if truncated else 0, frames,
                                            infos, tgt.python)
        return pyhash

    def _fix_blocked(self, tgt):
        """tgt has just been registered with its interpreter: its threads that
        blocked before (a launched command, a child, a process found by -a)
        were captured without Python frames.  Each still in that interval
        (offcpu_start.ts the same before and after the read) has not run
        since, so the frames read now are those it blocked with: BPF takes
        them at its switch-in (pystack_fix), _flush_blocked at the end."""
        if tgt.python is None or tgt.reader is None:
            return
        from .bpfload import update_elem
        table, fix = self.bpf["offcpu_start"], self.bpf["pystack_fix"]
        pid = tgt.pid

        def open_now():
            return {k.value: st.ts for k, st in _items(table)
                    if st.key.tgid == pid and not st.key.pystack}
        before = open_now()
        if not before:
            return
        stacks = self._thread_stacks(tgt, before)
        after = open_now()
        for tid, ts in before.items():
            frames, truncated = stacks.get(tid, ([], False))
            if not frames or after.get(tid) != ts:
                continue                # it ran meanwhile: its next capture has them
            pyhash = self._keep_pystack(tgt, tid, frames, truncated)
            leaf = fix.Leaf()
            leaf.ts, leaf.pystack = ts, pyhash
            update_elem(fix.map_fd, fix.Key(tid), leaf)
            self._fixes[tid] = (ts, pyhash)

    def _read_drops(self):
        for table_name, out in (("drops", self.rec.drops), ("drops_ns", self.rec.drops_ns)):
            table = self.bpf[table_name]
            for i, name in DROP_NAMES.items():
                if i >= bpfdefs.N_DROPS:
                    continue
                total = sum(table[table.Key(i)])
                if total:
                    out[name] = total
        if self.unwinder is not None and self.unwinder.procs_full:
            self.rec.drops["unwind process map full"] = self.unwinder.procs_full
        # The kernel skips a program that would run inside another BPF program
        # on the same CPU: each skipped sched_switch is a switch not seen.
        missed = 0
        for fn in list(self.bpf.funcs.values()):
            missed += _fdinfo(fn.fd).get("recursion_misses", 0)
        if missed:
            self.rec.drops["BPF runs skipped by the kernel"] = missed
        table = self.bpf["block_filtered"]
        self.rec.block_filtered = [sum(table[table.Key(i)]) + self._bpf_filtered[i] for i in (0, 1)]

    def _write_stats(self, elapsed: float):
        """PYOFFCPU_STATS_FILE: one JSON line per drain (make bench reads it)."""
        if not self._stats_path:
            return
        maps = {}
        for name in ("agg", "offcpu_start", "threads", "pystack_seen", "nstacks", "switch_memo",
                     "procs", "unwind_procs", "execs"):
            try:
                maps[name] = sum(1 for _ in self.bpf[name].keys())
            except Exception:
                pass
        line = {"t": round(elapsed, 3), "rss_kib": rss_kib(), "maps": maps,
                "drops": dict(self.rec.drops), "stacks": len(self.rec.stacks),
                "threads": len(self.rec.threads), "unresolved": len(self._unresolved)}
        u = self.unwinder
        if u is not None and u.builds is not None:
            # the tables made in the background: how many still wait, and each
            # build's seconds (the bench's per-library figures)
            line["tables"] = {"waiting": len(u.waiting()), "built": dict(u.builds.times),
                              "load_s": round(u.load_s, 3)}
        try:
            with open(self._stats_path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError:
            self._stats_path = None

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
        """Record until the duration, the targets' end or request_stop()."""
        for _ in self.batches():
            pass
        return self.rec

    def batches(self) -> Iterator[Batch]:
        """Compile, attach, register the targets and record: one Batch after
        each drain (about a second), the last after the final one, when the
        Recording is complete.  record, and whatever shows a live view, use
        this one loop; a consumer that stops early ends the recording."""
        o = self.opts
        self._compile()                 # the targets registered meanwhile (_head_start)
        self._attach()
        rec = self.rec
        if self.targets is None or self.targets.bpf is not self.bpf:
            self.start_notices.clear()
            self._register()
        elif o.follow and o.pids:
            # children forked while the programs were verified, before BPF's
            # fork tracepoint was attached
            self.targets.add_descendants()
        targets = self.targets
        launched = None
        if o.command:
            # Registered before it execs, so its first instructions are profiled;
            # its interpreter is looked for once it is the command.
            self.child_pid = self._launch()
            launched = targets.add_launched(self.child_pid)
        targets.list_threads()
        if self.unwinder is not None:
            while self.unwinder.poll(build=False):     # what the cache had for what came meanwhile
                pass
        if self.unwinder is not None and o.tables_first:
            self.unwinder.build_all()
        if not o.system_wide and launched is None:
            # a target that ended before BPF was attached left no exit event
            targets.check_liveness()
        # The recording starts once every target and thread is registered.
        self._start_ns = time.monotonic_ns()
        self._write_control(start_ns=self._start_ns)
        start_mono = self._t0 = time.monotonic()
        rec.start_time = time.time()
        try:
            if o.mode in ("wall", "off") and (o.pids or o.system_wide):
                self._capture_preexisting()
            if launched is not None:
                self._start_child()
                targets.started(launched)
            if self.started:
                self.started()
            last_drain = start_mono
            deadline = start_mono + o.duration if o.duration else None
            while self.stop_reason is None:
                self.bpf.perf_buffer_poll(timeout=50)
                now = time.monotonic()
                if deadline and now >= deadline:
                    self.request_stop("duration")
                if not self._check_child():
                    self.request_stop("target exited")
                targets.poll(now, self._sampled if o.system_wide else None)
                if not o.system_wide and targets.all_exited():
                    self.request_stop("target exited")
                if now - last_drain >= 1.0:
                    last_drain = now
                    self._drain()
                    self._read_drops()
                    self._write_stats(now - start_mono)
                    if self.status:
                        self.status(rec, now - start_mono)
                    yield Batch(now - start_mono, final=False)
        except GeneratorExit:           # the consumer stopped early: end it cleanly
            self.request_stop("stopped")
            self._finish(start_mono)
            raise
        self._finish(start_mono)
        yield Batch(rec.duration_s, final=True)

    def _finish(self, start_mono: float):
        """The end mark first: from it on BPF adds nothing, so what is read
        below is the whole recording, and every open interval ends there."""
        o, rec = self.opts, self.rec
        self._end_ns = time.monotonic_ns()
        self._write_control(end_ns=self._end_ns)
        time.sleep(GRACE_S)
        rec.duration_ns = self._end_ns - self._start_ns
        rec.duration_s = rec.duration_ns / 1e9
        # Names and code objects first: the rest can be read after the target is gone.
        self.bpf.perf_buffer_poll(timeout=0)
        self._drain(final=True)
        if o.mode in ("wall", "off"):
            self._flush_blocked()
        self._finish_threads()
        self._read_drops()
        self._write_stats(time.monotonic() - start_mono)
        if o.system_wide:
            self._system_wide_notices()
        self.targets.close()
        if self.unwinder is not None:
            rec.notices.extend(self.unwinder.notices)
            self.unwinder.close()
        self.bpf.cleanup()

    def _system_wide_notices(self):
        targets, rec = self.targets, self.rec
        late = {p: n for p, n in targets.unregistered_samples().items() if p in rec.pythons}
        n, npy = len(targets) + len(targets.retired), len(rec.python_images)
        others = (f"; {_count(targets.left_out, 'process')} without one left out (--python-only)"
                  if self.opts.python_only else f" ({_count(targets.not_python, 'process')} without one)")
        rec.notices.append(f"-a: {_count(n, 'process')}, {_count(npy, 'Python interpreter')} found"
                           + others)
        if late:
            rec.notices.append(f"{sum(late.values())} samples of {len(late)} Python processes came before "
                               "they were registered: native frames only")

    def left_out_by_length(self, length_ns: int) -> bool:
        """--min-block-us / --max-block-us: is a wait this long left out?"""
        o = self.opts
        return length_ns < o.min_block_ns or bool(o.max_block_ns and length_ns > o.max_block_ns)

    def _flush_blocked(self):
        """Threads still off the CPU at the end: blocked until the end mark
        (judged by --min/--max-block-us on their length so far)."""
        for k, st in _items(self.bpf["offcpu_start"]):
            tid = k.value
            key = st.key
            ns = self._end_ns - max(st.ts, self._start_ns)
            if ns <= 0:
                continue
            if self.left_out_by_length(self._end_ns - st.ts):
                self._bpf_filtered[0] += 1
                self._bpf_filtered[1] += ns
                continue
            pystack = key.pystack
            if not pystack and self._fixes.get(tid, (None,))[0] == st.ts:
                pystack = self._fixes[tid][1]
            skey = (key.tgid, key.tid, self._ustack_id(key.ustack, key.nstack), key.kstack, pystack,
                    key.kind)
            self._fetch_stack_ids(skey[2], key.kstack)
            self._add(skey, 1, ns)


def _accumulate(table: Dict, key, count: int, ns: int) -> None:
    """table[key] += [count, ns], the entry made if there is none."""
    acc = table.get(key)
    if acc is None:
        table[key] = [count, ns]
    else:
        acc[0] += count
        acc[1] += ns


AGG_KEY_FIELDS = ("tgid", "tid", "ustack", "kstack", "pystack", "kind", "gen", "nstack")
AGG_VALUE_FIELDS = ("count", "ns")
WAKE_KEY_FIELDS = ("tgid", "tid", "ustack", "kstack", "pystack", "kind", "gen", "nstack",
                   "waker_kind", "waker_tgid", "waker_tid", "waker_ustack", "waker_kstack", "waker_pad",
                   "waker_pystack", "waker_nstack", "waker_comm0", "waker_comm1")
_CHARS = {ctypes.c_uint32: "I", ctypes.c_int32: "i", ctypes.c_uint64: "Q", ctypes.c_int64: "q",
          ctypes.c_uint16: "H", ctypes.c_int16: "h", ctypes.c_uint8: "B", ctypes.c_int8: "b"}
_FORMATS: Dict[type, Optional[str]] = {}


def _take_generation(table, key_fields: Tuple[str, ...], value_fields: Tuple[str, ...],
                     final: bool, old: Optional[int]) -> List[Tuple[tuple, tuple]]:
    """(key, value) field tuples of a map's entries of generation `old`
    (key field `gen`; every entry when final), deleted from the map: a few
    batched syscalls, unpacked without a ctypes object per entry; one entry
    at a time where the kernel has no batch ops."""
    kfmt = _unpack_format(table.Key, key_fields)
    vfmt = _unpack_format(table.Leaf, value_fields)
    g = key_fields.index("gen")
    out, stale = [], []
    try:
        if kfmt is None or vfmt is None:
            raise ValueError("not the layout of " + ", ".join(key_fields))
        ks = struct.calcsize(kfmt)
        for kb, vb, n in table.raw_lookup_batch(delete=final):
            for i, (k, v) in enumerate(zip(struct.iter_unpack(kfmt, kb), struct.iter_unpack(vfmt, vb))):
                if final or k[g] == old:
                    out.append((k, v))
                    if not final:
                        stale.append(kb[i * ks:(i + 1) * ks])
        if stale:
            _delete_all(table, (table.Key * len(stale)).from_buffer_copy(b"".join(stale)))
        return out
    except Exception:                       # noqa: BLE001 (kernels without batch ops)
        if not final:
            out = []                        # nothing deleted yet: all read again below
    # one entry at a time; at the end, what a failed batch took is in out
    items = list(table.items())
    if not final:
        items = [(k, v) for k, v in items if k.gen == old]
    _delete_all(table, [k for k, _ in items])
    return out + [(tuple(getattr(k, f) for f in key_fields), tuple(getattr(v, f) for f in value_fields))
                  for k, v in items]


def _unpack_format(ctype, names: Tuple[str, ...]) -> Optional[str]:
    """The struct format that unpacks one ctype, its fields in the order of
    names (padding skipped); None when its fields are not exactly those, of
    plain integer types."""
    if ctype not in _FORMATS:
        fmt, at = "<", 0
        fields = getattr(ctype, "_fields_", ())
        ok = tuple(f[0] for f in fields) == names
        for name, t in fields if ok else ():
            off = getattr(ctype, name).offset
            ch = _CHARS.get(t)
            if ch is None or off < at:
                ok = False
                break
            fmt += "x" * (off - at) + ch
            at = off + ctypes.sizeof(t)
        fmt += "x" * (ctypes.sizeof(ctype) - at)
        _FORMATS[ctype] = fmt if ok and struct.calcsize(fmt) == ctypes.sizeof(ctype) else None
    return _FORMATS[ctype]


def _items(table) -> list:
    """A BPF map's entries: a few batched syscalls (one or two per entry
    otherwise, which a server that starts thousands of threads a second
    pays at every drain)."""
    try:
        return list(table.items_lookup_batch())
    except Exception:                   # noqa: BLE001 (kernels without batch ops)
        return list(table.items())


def _delete_all(table, keys) -> None:
    """Delete keys (a list of keys, or a ctypes array of them) from a BPF
    map, batched; one already gone is no error."""
    if not len(keys):
        return
    try:
        table.items_delete_batch(keys if isinstance(keys, ctypes.Array) else (table.Key * len(keys))(*keys))
    except Exception:                   # noqa: BLE001 (an entry gone meanwhile fails the batch)
        _delete_each(table, keys)


def map_sizes(o: Options, tables: bool) -> Dict[str, int]:
    """Entries of the big BPF maps this session needs, below what the source
    gives (its sizes are for -a): the kernel reserves a preallocated map
    whole, ~100 MiB for all of them.  A map that fills counts a drop, named
    in the drops line."""
    sizes = {}
    if not o.kernel:
        sizes["kstacks"] = 1            # never written: KERNEL_STACKS=0
    if tables:
        sizes["ustacks"] = 4096         # frame-pointer stacks: only where a process has no tables
    if not o.system_wide:
        # the targets' threads, live or ended since the last drain (a second),
        # and those of them blocked now
        sizes["threads"] = sizes["offcpu_start"] = 16384
        sizes["pystack_seen"] = 32768   # full: a stack is sent again, not lost
    return sizes


def _count(n: int, what: str) -> str:
    """`1 process`, `2 processes`."""
    return f"{n} {what}" + ("" if n == 1 else "es" if what.endswith("s") else "s")


def _delete_each(table, keys) -> None:
    """Delete keys from a BPF map one by one; one already gone is no error."""
    for k in keys:
        try:
            del table[k]
        except KeyError:
            pass


def _fdinfo(fd: int) -> Dict[str, int]:
    out = {}
    for line in (read_text(f"/proc/self/fdinfo/{fd}") or "").splitlines():
        k, _, v = line.partition(":")
        v = v.strip()
        if v.isdigit():
            out[k.strip()] = int(v)
    return out


def _state_kind(pid: int, tid: int) -> int:
    """The kind of off-CPU time (bpfdefs.KIND_*) of a thread's state in /proc, with
    the system call it is in (/proc/PID/task/TID/syscall: its number, -1
    for none, `running`), as BPF keeps it (reasons.split_kind)."""
    sc = blocked_syscall(pid, tid)
    sysno = reasons.UNKNOWN if sc is None else (None if sc.nr < 0 else sc.nr)
    return reasons.with_sys(_proc_state_kind(pid, tid), sysno)


def _proc_state_kind(pid: int, tid: int) -> int:
    return {"S": bpfdefs.KIND_SLEEP, "R": bpfdefs.KIND_RUNQUEUE, "D": bpfdefs.KIND_UNINTERRUPTIBLE,
            "I": bpfdefs.KIND_SLEEP}.get(proc_state(f"/proc/{pid}/task/{tid}/stat"),
                                         bpfdefs.KIND_OTHER)


_INCLUDE = re.compile(r'^#include "([^"]+)" /\* inline \*/$')


def _bpf_source(path: str) -> str:
    """The main BPF file, with each `#include "x.h" /* inline */` replaced by
    that file's text: bcc rewrites map calls (table.lookup()) only in the
    main file, so headers that use maps are pasted into it."""
    out = []
    with open(path) as f:
        for line in f:
            m = _INCLUDE.match(line.strip())
            if m:
                name = m.group(1)
                out.append(f'#line 1 "{name}"\n')
                with open(os.path.join(os.path.dirname(path), name)) as h:
                    out.append(h.read())
                out.append("\n")
            else:
                out.append(line)
    return "".join(out)


def _pystack_type():
    """ctypes of struct pystack (bpf/pyoffcpu.h), for the perf events."""
    return bpfdefs.struct_type("pystack")


def _walk(table, stack_id: int) -> List[int]:
    try:
        return list(table.walk(stack_id))
    except KeyError:
        return []
