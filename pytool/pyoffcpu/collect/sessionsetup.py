"""A session's setup, before its loop: the BPF programs compiled (or taken
from the cache) with the flags the options and the platform give, the
kernel's thread-fold program verified in the background, the programs
attached (perf events, raw tracepoints, the unwinder's tail-call slots),
the targets registered and the control record written.  Session
(session.py) runs the loop on what this sets up."""
from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Dict, List, Tuple

from ..kernel import bpfdefs
from ..kernel.bpfdefs import BPF_DIR
from .maps import bpf_source, map_sizes
from .platform import DOCTOR, ProfilerError
from .progcache import KFUNC_PREFIX, one_line
from ..native.unwind import loader as unwind_loader
from ..targets.processes import Targets
from ..targets.selection import Select


def compile_flags() -> List[str]:
    """The flags the programs are compiled with: the same for every
    recording, whose options and kernel are load-time constants
    (load_consts); the package ships that compile (bpfload).  The tests'
    PYOFFCPU_MEMO_VERIFY=1 makes another, compiled on the spot."""
    flags = [f"-I{BPF_DIR}"]
    if os.environ.get("PYOFFCPU_MEMO_VERIFY") == "1":
        # every switch memo hit walked all the same and compared (bpf/memo.c)
        flags.append("-DMEMO_VERIFY=1")
    return flags


def features(o) -> Dict[str, int]:
    """What a recording with options o turns on in the programs (their
    load-time constants KERNEL_STACKS ... TIMELINE, bpf/loadconst.h)."""
    return {"KERNEL_STACKS": int(bool(o.kernel)), "SYSTEM_WIDE": int(bool(o.every_process)),
            "WAKERS": int(bool(o.wakers) and o.mode in ("wall", "off")),
            "ASYNC_TASKS": int(bool(o.async_tasks)),
            "TIMELINE": int(bool(o.timeline) and o.mode != "cpu")}


def load_consts(o, p) -> Dict[str, int]:
    """The values of the load-time constants (bpf/loadconst.h) of a
    recording with options o on platform p: the kernel's offsets (BTF) and
    the sampling period."""
    from .platform import BTF_PATH
    # the system call a thread is in (oncpu.c: current_syscall) reads ax,
    # orig_ax and cs in one go; where they are not so, or not known, it
    # reads nothing (an orig_ax past its 16 words): no system call is named
    _ip, cs, orig_ax, ax = p.pt_regs_offsets or (0, 0, 0, 0)
    if not (p.pt_regs_offsets and ax < orig_ax < cs <= ax + 120 and not (cs - ax) % 8
            and not (orig_ax - ax) % 8):
        ax, orig_ax, cs = 0, 128, 136
    return {"TASK_FSBASE_OFF": p.task_fsbase_offset, "TASK_PID_OFF": p.task_pid_offset,
            "TASK_TGID_OFF": p.task_tgid_offset, "TASK_EXEC_OFF": p.task_exec_offset,
            "EXIT_GROUP_DEAD": int(p.exit_group_dead), "TASK_RSEQ_OFF": p.task_rseq_offset,
            "SAMPLE_PERIOD_NS": int(1e9 // o.frequency),
            "SYS_REGS_AX_OFF": ax, "SYS_REGS_ORIG_AX_OFF": orig_ax, "SYS_REGS_CS_OFF": cs,
            **kernel_cast_consts(p), **features(o), **unwind_loader.load_consts(BTF_PATH)}


def kernel_cast_consts(p) -> Dict[str, int]:
    """KERNEL_CAST and what it needs (bpf/loadconst.h task_u32): task_struct
    read by plain loads where BTF has the bpf_rdonly_cast kfunc and
    PYOFFCPU_KERNEL_CAST is not 0 (the bench's comparison), else by the
    helper; the loader goes back to the helper for a program the verifier
    refuses with the cast (bpfload)."""
    on = bool(p.kfunc_rdonly_cast_id and p.btf_task_struct_id
              and os.environ.get("PYOFFCPU_KERNEL_CAST", "1") != "0")
    return {"KERNEL_CAST": int(on), "BTF_TASK_STRUCT": p.btf_task_struct_id if on else 0,
            KFUNC_PREFIX + "bpf_rdonly_cast": p.kfunc_rdonly_cast_id if on else 0}


MAIN_PROGRAM = "pyoffcpu.bpf.c"


def program_source() -> Tuple[str, List[str]]:
    """(the BPF text, its flags) of the recording's programs."""
    return bpf_source(os.path.join(BPF_DIR, MAIN_PROGRAM)), compile_flags()


# --wakers: the interrupt-context tracepoints, exits first (see bpf: wake_irq_enter)
WAKE_ATTACH = (("irq_handler_exit", "wake_irq_leave"), ("softirq_exit", "wake_irq_leave"),
               ("hrtimer_expire_exit", "wake_timer_leave"),
               ("irq_handler_entry", "wake_irq_enter"), ("softirq_entry", "wake_irq_enter"),
               ("hrtimer_expire_entry", "wake_timer_enter"))


def wake_programs(o) -> List[str]:
    """--wakers' interrupt-context programs a recording with options o runs."""
    if not (o.wakers and o.mode in ("wall", "off")):
        return []
    return sorted({fn for _, fn in WAKE_ATTACH})


def waits_sampled(o) -> bool:
    """Are waits' stacks owed by threshold sampling (--off-cpu sampled,
    the default, or PYOFFCPU_OFFCPU=shadow), taken by rseq_capture?"""
    return o.mode in ("wall", "off") and o.offcpu in ("sampled", "shadow")


def load_programs(o, consts: Dict[str, int], unwinder_now: bool, **kw):
    """The Program of a recording with options o and load-time constants
    consts (load_consts): only what the mode runs (no sched_switch in cpu
    mode, no perf event in off mode), all verified at once; the unwinder's
    with them when unwinder_now (else _attach verifies them after the
    start), and they may fail, as rseq_capture may.  kw: bpfload.load's."""
    from . import bpfload
    from ..kernel import bpfsys
    text, cflags = program_source()
    sampled, switches = o.mode in ("wall", "cpu"), o.mode in ("wall", "off")
    wake = wake_programs(o)
    return bpfload.load(text, cflags,
                        sizes=map_sizes(o, bool(consts["NATIVE_UNWIND"]), consts),
                        skip=(() if switches else ("sched_switch",)) + (() if wake else ("sched_waking",)),
                        preload=([("on_cpu_sample", bpfsys.PERF_EVENT)] if sampled else [])
                        + [(fn, bpfsys.RAW_TRACEPOINT) for fn in wake],
                        optional=(unwind_loader.program_specs(sampled, switches, bool(wake))
                                  if unwinder_now else [])
                        + ([("rseq_capture", bpfsys.RAW_TRACEPOINT)] if waits_sampled(o) else []),
                        consts=consts, **kw)


class SessionSetup:
    """The setup half of Session: its methods, on Session's state."""

    def _compile(self):
        """The programs loaded (from the package, the cache, or bcc on a
        miss), the targets registered meanwhile (_head_start)."""
        o = self.opts
        consts = load_consts(o, self.platform)
        self._unwind_tables = bool(consts["NATIVE_UNWIND"])     # (_head_start's unwinder)
        try:
            self.bpf = load_programs(o, consts, unwinder_now=o.tables_first, notices=self.rec.notices,
                                     meanwhile=self._head_start if not o.command else None)
        except Exception as e:
            raise ProfilerError(f"cannot load the BPF programs: {one_line(e)}",
                                DOCTOR)
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

    def _waits_sampled(self) -> bool:
        return waits_sampled(self.opts)

    def _offcpu_mode(self) -> int:
        """control.offcpu (bpf/pyoffcpu.h: OFFCPU_*), once _attach knows
        whether rseq_capture is attached."""
        if not self._rseq_attached:
            return bpfdefs.value("OFFCPU_EXACT")
        return bpfdefs.value("OFFCPU_SHADOW" if self.opts.offcpu == "shadow" else "OFFCPU_SAMPLED")

    def _fold_mode(self) -> int:
        """control.fold: the kernel folds the threads born and ended in the
        recording (bpf: fold_exit) unless --keep-tids, in cpu mode (no
        switches: no thread's end) and with --wakers (a wait's wakers are
        kept per thread).  PYOFFCPU_FOLD=0: user space folds them all;
        PYOFFCPU_FOLD=shadow (tests): both, the kernel's kept apart."""
        o = self.opts
        env = os.environ.get("PYOFFCPU_FOLD", "1")
        if env == "0" or not o.fold_threads or o.mode == "cpu" or self._wake_programs():
            return 0
        mode = bpfdefs.FOLD_WALL if o.mode == "wall" else bpfdefs.FOLD_OFFCPU
        return mode | (bpfdefs.FOLD_SHADOW if env == "shadow" else 0)

    def _start_fold(self):
        """The fold program verified in the background, once a target has
        started a thread during the recording (its three loops take the
        verifier ~0.8 s of CPU here, longer than every other program: the
        start does not wait for it, and a target that starts no thread never
        shares a CPU with it); _fold_ready turns it on.  Until then, ended
        threads fold here, the same way."""
        if self._fold_started:
            return
        self._fold_started = True       # asked once: a server starts a thread per request
        if not self._fold_mode():
            return
        from ..kernel.bpfsys import RAW_TRACEPOINT

        def load():
            try:
                self._fold_fd = self.bpf.load_func(b"fold_exit", RAW_TRACEPOINT).fd
            except Exception as e:      # noqa: BLE001 - user space folds them, as before
                msg = one_line(e)
                self.rec.notices.append(f"ended threads folded by pyoffcpu, not the kernel ({msg})")
        self._fold_loader = threading.Thread(target=load, name="pyoffcpu-fold", daemon=True)
        self._fold_loader.start()

    def _fold_ready(self):
        """In the recording loop, once the fold program is verified: into its
        tail-call slot, the Python stacks read so far classified for it, then
        control.fold on; from then on the threads born hold their keys for
        it (those born before fold here, as with it off)."""
        if self._fold_loader is None or self._fold_loader.is_alive():
            return
        self._fold_loader = None
        if self._fold_fd is None:
            return
        self.bpf["fold_progs"][ctypes.c_int(0)] = ctypes.c_int(self._fold_fd)
        table = self.bpf["stack_class"]
        self._stack_class_key = table.Key
        self._stack_class_values = (table.Leaf(bpfdefs.value("STACK_ENTRY")),
                                    table.Leaf(bpfdefs.value("STACK_NO_ENTRY")))
        mode = self._fold_mode()
        self.accounts.kernel_fold = mode
        for pyhash, st in list(self.rec.pystacks.items()):
            if st.infos:
                self._classify_stack(pyhash)
        self._write_control(fold=mode)

    def _classify_stack(self, pyhash: int):
        """Whether a Python stack names an entry function, for the kernel's
        fold to pick a thread's group as ThreadAccounts.fold does."""
        cls = self._stack_class_values[self.accounts.stack_entry(pyhash) is None]
        try:
            self.bpf["stack_class"][self._stack_class_key(pyhash)] = cls
        except Exception:               # noqa: BLE001 - full: those threads fold here
            pass

    def _wake_programs(self) -> List[str]:
        return wake_programs(self.opts)

    def _attach(self):
        from ..kernel.bpfsys import PERF_COUNT_SW_CPU_CLOCK, PERF_TYPE_SOFTWARE
        o = self.opts
        try:
            if o.mode in ("wall", "cpu"):
                self.bpf.attach_perf_event(ev_type=PERF_TYPE_SOFTWARE, ev_config=PERF_COUNT_SW_CPU_CLOCK,
                                           fn_name=b"on_cpu_sample",
                                           sample_period=int(1e9 // o.frequency), cpu=-1)
            # the raw tracepoints are attached at load (raw_tracepoint__*; in cpu
            # mode not sched_switch); --wakers' interrupt ones here, in order
            if self._wake_programs():
                for tp, fn in WAKE_ATTACH:
                    self.bpf.attach_raw_tracepoint(tp=tp, fn_name=fn)
        except Exception as e:
            raise ProfilerError(f"cannot attach BPF: {e}", DOCTOR)
        if self._waits_sampled():
            # the waits' stacks, owed at their switch-in, taken on the thread's
            # way back to user space; without it, at every switch-out
            try:
                if self.platform.task_rseq_offset < 0:
                    raise ValueError("this kernel's BTF has no task_struct.rseq")
                self.bpf.attach_raw_tracepoint(tp="rseq_update", fn_name="rseq_capture")
                self._rseq_attached = True
            except Exception as e:      # noqa: BLE001 - exact, and said so
                msg = one_line(e)
                self.rec.notices.append(f"off-CPU stacks taken at every switch, as --off-cpu exact ({msg})")
        self.rec.offcpu = ("exact" if not self._rseq_attached else self.opts.offcpu)
        self.accounts.shadow_waits = self.rec.offcpu == "shadow"
        self._write_control(offcpu=self._offcpu_mode())
        self.bpf["pystack_events"].open_perf_buffer(self._on_pystack, page_cnt=256,
                                                     lost_cb=self._on_lost)
        # -a: a process's first sample with no registration; else a target's
        # exec: read at once
        self.bpf["loop_wakes"].open_perf_buffer(self._on_loop_wake, page_cnt=8)
        if "timeline" in self.bpf:
            from .timeline import TimelineBuffer
            self.timeline = TimelineBuffer(o.timeline_min_ns,
                                           lambda ns: self._write_control(timeline_min_ns=ns))
            # read at each turn of the loop (50 ms at most), not woken by each record
            self.bpf["timeline"].open_perf_buffer(self.timeline.on_event, page_cnt=256,
                                                  lost_cb=self.timeline.on_lost, wakes=False)
            self.accounts.on_initial = self.timeline.add_initial_wait
        # tests: the threads folded here before the kernel's fold is on are in its view too
        self.accounts.fold_shadow = bool(self._fold_mode() & bpfdefs.FOLD_SHADOW)
        # The programs that finish each sample (and walk native stacks from
        # .eh_frame tables when NATIVE_UNWIND=1), called by tail call: loaded
        # now with --tables-first, else verified in the background while the
        # recording starts (_unwinder_ready puts them in; until then BPF
        # finishes samples itself, with frame-pointer stacks, as it does for
        # a library whose table is not made yet).
        try:
            if self.unwinder is not None and self.unwinder.bpf is not self.bpf:
                self.unwinder.close()   # made for a program that did not load (compiled again)
                self.unwinder = None
            if self.unwinder is None:
                self._make_unwinder()
        except Exception as e:          # noqa: BLE001 - as a verifier's refusal
            self._unwinder_failed(e)
            return
        kinds = dict(perf=o.mode in ("wall", "cpu"), switch=o.mode in ("wall", "off"),
                     wake=bool(self._wake_programs()))
        if o.tables_first:
            try:
                self.unwinder.load_programs(**kinds)
            except Exception as e:      # noqa: BLE001 - frame pointers, said so
                self._unwinder_failed(e)
            return
        unwinder = self.unwinder

        def load():
            try:
                unwinder.load_programs(**kinds)
            except Exception as e:      # noqa: BLE001 - _unwinder_ready says so
                self._unwinder_error = e
        self._unwinder_loader = threading.Thread(target=load, name="pyoffcpu-unwinder", daemon=True)
        self._unwinder_loader.start()

    def _unwinder_ready(self, wait: bool = False):
        """In the recording loop: once the finishing programs are verified
        and in their slots, the processes' entries go to BPF; a refusal turns
        native unwinding off, as at the start.  wait: until it is done."""
        t = self._unwinder_loader
        if t is None or (t.is_alive() and not wait):
            return
        t.join()
        self._unwinder_loader = None
        if self._unwinder_error is not None:
            self._unwinder_failed(self._unwinder_error)
        elif self.unwinder is not None:
            self.unwinder.release_entries()
            late = (time.monotonic_ns() - self._start_ns) / 1e9 if self._start_ns else 0.0
            if late > 0 and self.unwinder.tables:
                self.rec.notices.append(
                    f"native stacks from .eh_frame tables after the first {late:.2f} s of the recording "
                    "(frame pointers before, while the unwinder's programs were verified; "
                    "--tables-first waits for them)")

    def _unwinder_failed(self, e: BaseException):
        if self.unwinder is not None:
            self.unwinder.close()
        self.unwinder = None
        if self.targets is not None:
            self.targets.unwinder = None
        msg = one_line(e)
        self.rec.notices.append(f"native unwinding off ({msg}): frame-pointer user stacks")

    def _make_unwinder(self):
        self.unwinder = unwind_loader.NativeUnwinder(
            self.bpf, tables=self._unwind_tables)
        self.unwinder.copies = self.opts.follow     # BPF copies a parent's entry to its child
        if not self.opts.tables_first:
            self.unwinder.hold_entries()        # until its programs are in (_unwinder_ready)

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
                                         on_python=self.blocked.fix_blocked if o.mode != "cpu" else None,
                                         exit_events=self.platform.exit_group_dead)
        self._write_control(self_tgid=os.getpid(), discover=int(o.system_wide and o.filtered),
                            follow=int(o.follow), min_block_ns=o.min_block_ns,
                            max_block_ns=o.max_block_ns, timeline_min_ns=o.timeline_min_ns)
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
