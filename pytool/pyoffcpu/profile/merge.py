"""Merger: turns a Recording (stack ids, Python stack hashes) into a Profile of
frames, interleaving Python frames with the native frames beneath them.

Each native `_PyEval_EvalFrameDefault` frame is replaced by its group of Python
frames (groups are cut at entry frames, see cpython-frames.md §2.3).  When the
native stack does not hold one eval frame per group (frame-pointer stacks of a
libpython built without them), fall back to the Python frames followed by the
trustworthy native leaf frames, and count the fallback.
"""
from __future__ import annotations

import os

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from . import model as P
from ..kernel import bpfdefs
from ..kernel.bpfdefs import NST_TRUNCATED, PYF_ENTRY, PYF_INTERP, PYF_OWN_GIL, PYS_TRUNCATED, WAKER_KINDS
from . import reasons, waits
from ..collect.recording import NO_STACK, SHORT_WAITS, UNSAMPLED, Recording
from ..failures import failure_text
from ..native.symbols import JIT_FRAME

EVAL_FRAME = "_PyEval_EvalFrameDefault"
OWNER_GENERATOR = 1
OWNER_SHIM = 3          # owner >= 3 marks an entry shim from 3.12 on (cpython-frames.md §2.3)


@dataclass
class MergeStats:
    python_ns: int = 0          # weight of stacks with Python frames
    matched_ns: int = 0         # ... whose native stack matched group for group
    fallback_ns: int = 0        # ... merged by the fallback
    fallback_stacks: int = 0
    unknown_code: int = 0       # code objects that could not be read
    native_ns: int = 0          # weight of stacks walked from unwind tables
    prologue_ns: int = 0        # ... that needed rows from prologue analysis (no CFI)
    framepointer_ns: int = 0    # ... that needed frame pointers (no table)
    pending_ns: int = 0         # ... that stopped at a library whose table was not ready yet
    pending_libs: Dict[str, int] = field(default_factory=dict)  # that library -> the time it stopped
    jit_ns: int = 0             # ... that ended in code made at run time ([jit]: no frame is guessed there)
    # frames found by each method (bpfdefs.METHOD_NAMES), each weighted by its stack's time
    method_frame_ns: Dict[str, int] = field(default_factory=dict)
    torn_stacks: int = 0        # Python stacks cut at a frame that is not a code object
    failed_stacks: int = 0      # stacks whose frames could not be built ([frames not read])
    failed_ns: int = 0
    failure: str = ""           # the first one's exception, and where

    def as_dict(self) -> Dict[str, float]:
        share = (self.fallback_ns / self.python_ns) if self.python_ns else 0.0
        return {"fallback_stacks": self.fallback_stacks, "fallback_share": round(share, 4)}


@dataclass
class NativeFrame:
    frame: P.Frame
    module: Optional[str]
    resolved: bool

    @property
    def is_eval(self) -> bool:
        # gcc splits it: _PyEval_EvalFrameDefault.cold holds its unlikely paths
        name = self.frame.name
        return name == EVAL_FRAME or name.startswith(EVAL_FRAME + ".")


# the kernel frames of BPF's own running at a raw tracepoint (bpf_trace_run4
# for sched_switch, bpf_trace_run1 for sched_waking)
_BPF_OWN = ("bpf_trace_run", "__bpf_trace_", "bpf_prog_")

UNMAPPED_PC = NativeFrame(P.native_frame("[unknown]"), None, False)


class Merger:
    def __init__(self, rec: Recording, symbolizer, kernel_symbols=None):
        self.rec = rec
        self.sym = symbolizer
        self.ksym = kernel_symbols
        self.stats = MergeStats()
        self._native_cache: Dict[Tuple[int, int], NativeFrame] = {}
        self._py_cache: Dict[int, Tuple[List[List[P.Frame]], bool]] = {}
        self._short = P.PathShortener()
        self._waker_cache: Dict[tuple, Tuple[P.Frame, ...]] = {}
        self._task_cache: Dict[int, Optional[Tuple[str, P.Frame]]] = {}
        # native frames of an OpenMP runtime's waits (reasons.spin_code): on
        # the CPU there, a thread spins waiting for work or at a barrier
        self.spin_frames: set = set()
        self._spins: Dict[tuple, bool] = {}

    # -- native ---------------------------------------------------------------
    def native_frame(self, pid: int, addr: int) -> Optional[NativeFrame]:
        """The frame at addr; None when no mapping holds addr (an unwinding
        artefact: no code ever returns there)."""
        key = (pid, addr)
        if key in self._native_cache:
            return self._native_cache[key]
        space = self.rec.spaces.get(pid)
        if space is None or space.find(addr) is None:
            nf = None
        else:
            sym = self.sym.resolve_user(pid, addr, space)
            nf = NativeFrame(P.native_frame(self.sym.frame_name(sym), sym.module),
                             sym.module, sym.name is not None)
            if reasons.omp_library(sym.module) and self._omp_spins(pid, addr, space):
                self.spin_frames.add(nf.frame)
        self._native_cache[key] = nf
        return nf

    def _omp_spins(self, pid: int, addr: int, space) -> bool:
        """Is the function at addr (in an OpenMP runtime) one of its waits?
        Decided once per function, from its code."""
        got = self.sym.function_code(pid, addr, space)
        if got is None:
            return False
        key = (got[0], got[1])          # (the file's identity, the function's start)
        if key not in self._spins:
            self._spins[key] = reasons.spin_code(got[3], got[1])
        return self._spins[key]

    def omp_spin(self, frames: Tuple[P.Frame, ...]) -> bool:
        """An on-CPU stack inside an OpenMP runtime's wait: from the leaf
        up, through the runtime's own frames and the C library's (a wait
        calls sched_yield, or a helper of its own without a spin loop), a
        wait function is reached before any other code.  Code the runtime
        runs for the program (a parallel region's body, a task a waiting
        thread picks up) stops the look: that is work."""
        for f in reversed(frames):
            if f.kind is P.FrameKind.KERNEL:
                continue
            if f.kind is not P.FrameKind.NATIVE:
                return False
            if f in self.spin_frames:
                return True
            if not (reasons.omp_library(f.module) or reasons.c_library(f.module)):
                return False
        return False

    def kernel_frames(self, kstack: int) -> List[P.Frame]:
        """Leaf first, without the profiler's own frames at the leaf (the
        tracepoint's BPF trampoline and the JITed program, which has no
        symbol)."""
        if self.ksym is None:
            return []
        names = [self.ksym.resolve(a) or "[unknown]" for a in self.rec.kstacks.get(kstack, [])]
        i = 0
        while i < len(names) and (names[i] == "[unknown]" or names[i].startswith(_BPF_OWN)):
            i += 1
        if i == len(names):
            i = 0
        return [P.kernel_frame(n) for n in names[i:]]

    # -- Python -----------------------------------------------------------------
    def python_groups(self, pyhash: int) -> Tuple[List[List[P.Frame]], bool]:
        """Groups of Python frames, innermost group first, frames innermost first."""
        cached = self._py_cache.get(pyhash)
        if cached is not None:
            return cached
        st = self.rec.pystacks.get(pyhash)
        if st is None:
            result: Tuple[List[List[P.Frame]], bool] = ([], False)
            self._py_cache[pyhash] = result
            return result
        py = self._python_of(st)
        minor = py.minor if py else (3, 11)
        groups: List[List[P.Frame]] = []
        group: List[P.Frame] = []
        torn = False
        # 3.15+: every thread's chain ends in tstate->base_frame, a shim that
        # stands for no eval call: the outermost frame of a whole stack
        base = len(st.frames) - 1 if minor >= (3, 15) and not st.flags & PYS_TRUNCATED else -1
        mark = None                     # a subinterpreter's, for the next group
        for i, (code, offset, flags) in enumerate(st.frames):
            if flags & PYF_INTERP:
                # The end of a subinterpreter's frames (bpf/pywalk.c): its mark
                # goes outside its outermost frame, the frames after it are the
                # same thread's in the main interpreter.
                mark = P.interpreter_marker(offset)
                if group:
                    group.append(mark)
                    mark = None
                elif groups:
                    groups[-1].append(mark)
                    mark = None
                continue
            if (i == base or (minor >= (3, 15) and i + 1 < len(st.frames)
                              and st.frames[i + 1][2] & PYF_INTERP)) and (flags & 0xff) >= OWNER_SHIM:
                continue                # 3.15's base frame: a subinterpreter's too
            if minor >= (3, 12) and (flags & 0xff) >= OWNER_SHIM:
                # The C-stack shim (3.12/3.13 FRAME_OWNED_BY_CSTACK, 3.14
                # FRAME_OWNED_BY_INTERPRETER and above) is the `previous` of the
                # outermost frame of one eval call: it closes that group.  A
                # group can be empty (its frames not started yet): it still
                # stands for one _PyEval_EvalFrameDefault in the native stack.
                groups.append(group)
                group = []
                continue
            info = st.infos[i] if st.infos is not None else self.rec.code.get((st.tgid, code))
            if info is None:
                # Not a code object: BPF read the chain while the thread was
                # changing it (a sample can land anywhere), or it is gone.  The
                # frames from here outwards cannot be trusted: keep the inner
                # ones and mark the stack cut, never print garbage.
                self.stats.unknown_code += 1
                self.stats.torn_stacks += 1
                torn = True
                break
            frame = self.python_frame(info, minor, offset, flags)
            if mark is not None:
                group.append(mark)      # a subinterpreter with no frames of its own
                mark = None
            if frame is not None:
                group.append(frame)
            if flags & PYF_ENTRY:
                groups.append(group)
                group = []
        if group:
            groups.append(group)
        if not any(groups):
            groups = []
        result = (groups, bool(groups) and (torn or bool(st.flags & PYS_TRUNCATED)))
        self._py_cache[pyhash] = result
        return result

    def gil_of(self, pyhash: int) -> int:
        """The interpreter whose GIL a Python stack's thread held or waited
        for: its innermost subinterpreter with a GIL of its own, else 0 (the
        main interpreter's GIL, which the others share)."""
        st = self.rec.pystacks.get(pyhash) if pyhash else None
        for _code, offset, flags in st.frames if st is not None else ():
            if flags & PYF_INTERP:
                return offset if flags & PYF_OWN_GIL else 0
        return 0

    def innermost_python(self, pyhash: int) -> str:
        """The label of a Python stack's innermost frame ("": none)."""
        if not pyhash:
            return ""
        groups, _ = self.python_groups(pyhash)
        for g in groups:
            if g:
                return g[0].label(False, self._short)
        return ""

    def waker_frames(self, waker: tuple, wakee_pid: int, shown: Dict[int, int]) -> Tuple[P.Frame, ...]:
        """--wakers: a waker as folded prints it after `--`, leaf first: its
        stack (kernel, native, Python), its thread, and its process when it
        is another's; [woken by timer] / [woken by irq]; () when not known."""
        wkind, wtgid, wtid, wus, wks, wph, comm = waker
        kind = WAKER_KINDS.get(wkind, "unknown")
        if kind == "timer":
            return (P.WOKEN_BY_TIMER,)
        if kind == "irq":
            return (P.WOKEN_BY_IRQ,)
        if kind != "task":
            return ()
        got = self._waker_cache.get(waker)
        if got is not None:
            return got
        saved, self.stats = self.stats, MergeStats()    # the waits' stats only
        try:
            stack = self.frames_for(wtgid, wus, wks, wph, 0) if (wus >= 0 or wks >= 0 or wph) else ()
        finally:
            self.stats = saved
        tid = shown.get(wtid, wtid)
        thread = self.rec.threads.get(wtid)
        name = thread.name if thread is not None and thread.tid > 0 else comm
        name = self.rec.python_names.get(wtid, name)
        out = tuple(reversed(stack)) + (P.Frame(P.FrameKind.MARKER, f"thread {tid} {name or '?'}"),)
        if wtgid != wakee_pid:
            pname = self.rec.comms.get(wtgid, "")
            out += (P.Frame(P.FrameKind.MARKER, f"process {wtgid} {pname}".rstrip()),)
        self._waker_cache[waker] = out
        return out

    def _python_of(self, st):
        """The interpreter a Python stack was walked in: its own image's (a
        process that execs another Python has two), else the process's."""
        return getattr(st, "python", None) or self.rec.pythons.get(st.tgid)

    def python_frame(self, info, minor, offset, flags) -> Optional[P.Frame]:
        """The frame of code object `info` at `offset` (as BPF recorded it);
        None for a frame CPython itself would not show yet."""
        if minor >= (3, 11):
            owner = flags & 0xff
            # CPython hides frames that have not started yet; so do we (this also
            # hides 3.13's _Py_InitCleanup shim). cpython-frames.md §2.3.
            if owner != OWNER_GENERATOR and offset < 2 * info.firsttraceable:
                return None
            byte_offset = offset
        elif minor == (3, 10):
            byte_offset = 2 * offset if offset >= 0 else -1
        else:
            byte_offset = offset
        return P.python_frame(info.name, info.filename, info.line_for(minor, byte_offset))

    # -- --async ------------------------------------------------------------------
    def task_of(self, pyhash: int) -> Optional[Tuple[str, P.Frame]]:
        """--async: (the folded root of the task a stack ran in, the frame of
        that task's coroutine), or None.  The coroutine is the stack's
        outermost generator-owned frame (BPF's task_frame); the snapshots say
        whose it is.  One no snapshot saw (a task that lived between two)
        folds by its coroutine, if that frame was started by C code (an
        eval entry), as Task.__step starts a coroutine; a generator that
        Python code iterates is not a task."""
        if pyhash in self._task_cache:
            return self._task_cache[pyhash]
        out = None
        st = self.rec.pystacks.get(pyhash)
        times = self.rec.tasks
        if st is not None and times is not None and st.task_frame:
            k = max((i for i, (_c, _o, fl) in enumerate(st.frames)
                     if fl & 0xff == OWNER_GENERATOR), default=-1)
            py = self._python_of(st)
            minor = py.minor if py else (3, 11)
            info = (st.infos[k] if st.infos is not None else
                    self.rec.code.get((st.tgid, st.frames[k][0]))) if k >= 0 else None
            if info is not None:
                code, offset, flags = st.frames[k]
                frame = self.python_frame(info, minor, offset, flags)
                addr = times.by_frame.get((st.tgid, st.task_frame))
                label = times.task_label(st.tgid, addr) if addr else ""
                if not label.startswith("task ") or times.tasks[(st.tgid, addr)].coro_code != code:
                    label = ""                  # not a task of the whole recording: by its code
                if not label:
                    outer = st.frames[k + 1][2] & 0xff if k + 1 < len(st.frames) else -1
                    if flags & PYF_ENTRY or outer >= OWNER_SHIM:
                        label = "tasks in " + info.name
                if label and frame is not None:
                    out = (label, frame)
        self._task_cache[pyhash] = out
        return out

    # -- one stack ----------------------------------------------------------------
    def frames_for(self, tgid, ustack, kstack, pyhash, ns) -> Tuple[P.Frame, ...]:
        """The frames of one stack key, innermost last.  One whose frames
        cannot be built (what one process left in the recording met a case
        this code does not expect) is [frames not read], counted in stats
        with its first exception: never the end of a recording, a top or a
        snapshot of every other stack."""
        try:
            return self._frames_for(tgid, ustack, kstack, pyhash, ns)
        except Exception as e:                          # noqa: BLE001 - counted and named
            self.stats.failed_stacks += 1
            self.stats.failed_ns += ns
            if not self.stats.failure:
                self.stats.failure = failure_text(e)
            return (P.FRAMES_NOT_READ,)

    def _frames_for(self, tgid, ustack, kstack, pyhash, ns) -> Tuple[P.Frame, ...]:
        if ustack == UNSAMPLED:
            return (P.NOT_SAMPLED,)
        if ustack == NO_STACK and not pyhash:
            return (P.NO_STACK,)
        if ustack == SHORT_WAITS:
            return (P.SHORT_WAITS,)
        native: List[NativeFrame] = []
        for i, addr in enumerate(self.rec.ustacks.get(ustack, [])):
            # a caller's pc is a return address: the call lies before it, and
            # a call to a function that never returns (abort) can be the last
            # instruction of its function, its return address the next one's
            nf = self.native_frame(tgid, addr if i == 0 else addr - 1)
            if nf is None and i == 0:
                nf = UNMAPPED_PC        # the sampled PC itself: keep it visible
            if nf is not None:
                native.append(nf)
        # Stacks walked from .eh_frame tables (recording.NATIVE_ID_BASE) are right
        # as far as they go; frame-pointer stacks through code built without
        # frame pointers are not.
        nflags = getattr(self.rec, "native_flags", {}).get(ustack)
        walked = nflags is not None
        if walked:
            self.stats.native_ns += ns
            if nflags & bpfdefs.NST_PROLOGUE:
                self.stats.prologue_ns += ns
            if nflags & bpfdefs.NST_FRAMEPOINTER:
                self.stats.framepointer_ns += ns
            if nflags & bpfdefs.NST_PENDING:
                self.stats.pending_ns += ns
                stop = self._stopped_in(tgid, ustack)
                self.stats.pending_libs[stop] = self.stats.pending_libs.get(stop, 0) + ns
            if nflags & bpfdefs.NST_UNMAPPED and native and native[-1].frame.name == JIT_FRAME:
                self.stats.jit_ns += ns
            for name, n in bpfdefs.frame_methods(nflags).items():
                self.stats.method_frame_ns[name] = self.stats.method_frame_ns.get(name, 0) + n * ns
        groups, truncated = self.python_groups(pyhash) if pyhash else ([], False)
        if groups:
            self.stats.python_ns += ns
            py = self._python_of(self.rec.pystacks[pyhash])
            interp = py.binary if py is not None else None
            leaf_first = self._interleave(native, groups, interp, ns, walked)
        else:
            leaf_first = [nf.frame for nf in native]
        root_first = leaf_first[::-1]
        if truncated or (walked and nflags & NST_TRUNCATED):
            root_first.insert(0, P.TRUNCATED)
        if walked and nflags & bpfdefs.NST_PENDING:
            root_first.insert(0, P.TABLE_NOT_READY)
        if pyhash and pyhash not in self.rec.pystacks:
            root_first.insert(0, P.PYTHON_LOST)
        if kstack >= 0:
            root_first.extend(reversed(self.kernel_frames(kstack)))
        if not root_first:
            # no frame at all (a user stack BPF could not take, in a process
            # not known to be Python yet): the time stays, marked as such,
            # the same in every format (pprof has no sample without a frame)
            return (P.NO_STACK,)
        return tuple(root_first)

    def _stopped_in(self, tgid: int, ustack: int) -> str:
        """The file whose table a pending walk stopped at: its last pc's."""
        pcs = self.rec.ustacks.get(ustack) or []
        space = self.rec.spaces.get(tgid)
        m = space.find(pcs[-1]) if pcs and space is not None else None
        return os.path.basename(m.path) if m is not None and m.path else "?"

    def _interleave(self, native: List[NativeFrame], groups, interp, ns,
                    walked: bool = False) -> List[P.Frame]:
        """Leaf-first frames: each eval frame replaced by its Python group.
        walked: the native stack comes from the .eh_frame unwinder, so when
        the counts differ (the walk stopped early, or the Python stack was cut)
        the groups are still paired from the leaf and the rest go root-side."""
        evals = [i for i, nf in enumerate(native) if nf.is_eval]
        if len(evals) == len(groups) or (walked and evals):
            if len(evals) == len(groups):
                self.stats.matched_ns += ns
            else:
                self.stats.fallback_ns += ns
                self.stats.fallback_stacks += 1
            out: List[P.Frame] = []
            k = 0
            for i, nf in enumerate(native):
                if nf.is_eval and k < len(groups):
                    out.extend(groups[k])
                    k += 1
                elif i < evals[0] or not _same_file(nf.module, interp):
                    # Leaf-side frames are what the code is doing (take_gil, a
                    # syscall); between and below eval frames only non-interpreter
                    # frames (C extensions, libc) are kept: the rest is plumbing.
                    out.append(nf.frame)
            for g in groups[k:]:        # outer groups the native walk did not reach
                out.extend(g)
            return out
        self.stats.fallback_ns += ns
        self.stats.fallback_stacks += 1
        if walked:
            # no eval frame reached: the walk stopped in native code (or it is a
            # thread whose Python frames are all outside the walk)
            return [nf.frame for nf in native] + [f for g in groups for f in g]
        if evals:
            leaf = [nf.frame for nf in native[:evals[0]]]
        else:
            # Without a matching stack only the sampled PC itself is trustworthy:
            # frame-pointer unwinding through code built without them is garbage.
            leaf = [native[0].frame] if native else []
        return leaf + [f for g in groups for f in g]


# CPython's collector entry points (3.7-3.15), where native frames are named:
# the Python frames under them are the collector's callbacks and finalizers
GC_NATIVE = ("gc_collect", "_PyGC_Collect", "PyGC_Collect", "collect_with_callback",
             "collect_generations")


def _with_gc(frames) -> tuple:
    """The [gc] frame right under (leafward of) the Python frame that was
    running when the collection began: the innermost one above the
    collector's native frames where those are named, else the innermost."""
    frames = tuple(frames)
    stop = next((i for i, f in enumerate(frames)
                 if f.kind is P.FrameKind.NATIVE and f.name.startswith(GC_NATIVE)), len(frames))
    last = max((i for i, f in enumerate(frames[:stop]) if f.kind is P.FrameKind.PYTHON), default=-1)
    at = last + 1 if last >= 0 else stop
    return frames[:at] + (P.GC,) + frames[at:]


def _python_leaf(frames) -> bool:
    """Is the innermost user-space frame a Python one (no native code under it)?"""
    for f in reversed(frames):
        if f.kind is not P.FrameKind.KERNEL:
            return f.kind is P.FrameKind.PYTHON
    return False


def _add_gil(prof: P.Profile, tid: int, gil: int, reason: Optional[str], ns: int,
             gil_id: int = 0) -> None:
    """One stack's time into its thread's GIL times (build_profile drops
    those of threads whose GIL state was never read); gil_id: the
    interpreter whose GIL it is (Merger.gil_of)."""
    g = prof.gil.get(tid)
    if g is None:
        g = prof.gil[tid] = P.GilTimes()
    g.read = g.read or gil != bpfdefs.GIL_UNKNOWN
    if reason is None:
        if gil == bpfdefs.GIL_HELD:
            g.held_on_ns += ns
            g.held_by_gil[gil_id] = g.held_by_gil.get(gil_id, 0) + ns
        elif gil == bpfdefs.GIL_FREE:
            g.released_ns += ns
        else:
            g.unknown_on_ns += ns
    else:
        if gil == bpfdefs.GIL_HELD:
            g.held_off_ns += ns
            g.held_by_gil[gil_id] = g.held_by_gil.get(gil_id, 0) + ns
        if reason == "gil":
            g.waiting_ns += ns


def _same_file(a: Optional[str], b: Optional[str]) -> bool:
    return a is not None and b is not None and (a == b or a.endswith(b) or b.endswith(a))


def _in_task(merger: Merger, ph: int, frames: Tuple[P.Frame, ...]) -> Tuple[P.Frame, ...]:
    """--async: a stack that ran in a task, as that task's: its root, then
    its coroutine's frame and what is under it (the event loop's frames
    above the task are the same for every task, and left out)."""
    got = merger.task_of(ph)
    if got is None:
        return frames
    label, coro = got
    try:
        i = frames.index(coro)
    except ValueError:
        return frames
    return (P.task_marker(label),) + tuple(frames[i:])


def _add_task_waits(prof: P.Profile, rec: Recording) -> None:
    """--async: each suspended task's sampled time, under its root, at its
    await chain, with [await: KIND] or [ready] as its leaf."""
    times = rec.tasks
    # The sampled time of a root is scaled to what its tasks' lifetimes left
    # beside their measured running time: each root then adds up to its
    # tasks' lifetimes, and the samples only split that time between the
    # awaits (a snapshot's whole interval goes to the state it saw).
    # Only roots of tasks that live at the end have a known lifetime: an
    # ended task may have run (and been measured) between two snapshots
    # that never saw it, so `tasks in CORO` keeps its samples as they are.
    lifetime: Dict[Tuple[int, str], int] = {}
    for (pid, addr), info in times.tasks.items():
        label = times.task_label(pid, addr)
        if not label.startswith("task "):
            continue
        lifetime[(pid, label)] = lifetime.get((pid, label), 0) + info.last_ns - info.first_ns
    running: Dict[Tuple[int, str], int] = {}         # the loop threads' time in each root
    root_tid: Dict[Tuple[int, str], int] = {}        # ... and a thread it ran on
    for key, ns in prof.weights.items():
        root = P.task_root(key.frames)
        if root is not None:
            k = (key.pid, root)
            running[k] = running.get(k, 0) + ns
            root_tid.setdefault(k, key.tid)
    sampled: Dict[Tuple[int, str], int] = {}
    rows = []
    for (pid, tid, addr, info, chain, kind), (count, ns) in times.waits.items():
        label = times.label_of(pid, addr, info)
        sampled[(pid, label)] = sampled.get((pid, label), 0) + ns
        rows.append((pid, tid, label, chain, kind, count, ns))
    scale = {}
    for k, ns in sampled.items():
        # (a root no snapshot gave a lifetime to keeps its samples as they are)
        rest = max(0, lifetime.get(k, 0) - running.get(k, 0))
        scale[k] = rest / ns if k in lifetime else 1.0
    for pid, tid, label, chain, kind, count, ns in rows:
        frames = (P.task_marker(label),) + tuple(P.python_frame(n, f, ln) for n, f, ln in chain)
        reason = "ready" if kind.startswith("ready") else "await: " + kind
        prof.add(P.StackKey(pid, tid or pid, frames, reason), round(ns * scale[(pid, label)]), count)
    # A task no snapshot saw suspended (a CPU-bound one that yields for
    # moments) still was not running for the rest of its lifetime: that
    # time is [suspended], its state not seen, under the thread it ran on.
    for (pid, label), life in lifetime.items():
        if (pid, label) in sampled or (pid, label) not in running:
            continue
        rest = life - running[(pid, label)]
        if rest > 0:
            prof.add(P.StackKey(pid, root_tid[(pid, label)], (P.task_marker(label),), "suspended"),
                     rest, 0)


def build_profile(rec: Recording, symbolizer, kernel_symbols=None, view: str = "exact"
                  ) -> Tuple[P.Profile, MergeStats]:
    """The Profile of a recording.  view: of a recording made both ways at
    once (PYOFFCPU_OFFCPU=shadow, tests), which one (profile/waits.py)."""
    o = rec.options
    stacks, wakes, wait_counts = waits.resolve(rec.stacks, rec.wakes, rec.offcpu,
                                               int(1e9 // o.frequency), view)
    meta = P.Metadata(
        mode=o.mode, frequency_hz=o.frequency, start_time=rec.start_time,
        duration_s=rec.duration_s, drops=dict(rec.drops), notices=list(rec.notices))
    if o.command:
        meta.target = "command: " + " ".join(o.command)
    elif o.system_wide:
        meta.target = "system-wide"
    else:
        meta.target = "pid " + ", ".join(str(p) for p in o.pids)
    versions = sorted({py.version_str for py in getattr(rec, "python_images", None) or rec.pythons.values()})
    meta.python_version = ", ".join(versions)
    meta.command_line = "; ".join(rec.cmdlines.get(p, "") for p in sorted(rec.cmdlines))
    prof = P.Profile(meta)
    # A group that folded one thread only is shown as that thread.
    shown = {tid: (t.first_tid if t.tid < 0 and t.threads == 1 else tid)
             for tid, t in rec.threads.items()}
    merger = Merger(rec, symbolizer, kernel_symbols)
    # --wakers: each wait's time by who ended it (the rest of it: not known)
    wakers_of: Dict[tuple, List[Tuple[tuple, int, int]]] = {}
    for (wait, waker), (count, ns) in wakes.items():
        wakers_of.setdefault(wait, []).append((waker, count, ns))
    off_ns: Dict[int, int] = {}
    for skey, (count, ns) in stacks.items():
        tgid, tid, us, ks, ph, kind = skey
        frames = merger.frames_for(tgid, us, ks, ph, ns)
        if rec.tasks is not None and ph:
            frames = _in_task(merger, ph, frames)
        tid = shown.get(tid, tid)
        gil = bpfdefs.kind_gil(kind)
        in_gc = gil == bpfdefs.GIL_HELD_GC
        if in_gc:
            gil = bpfdefs.GIL_HELD
            frames = _with_gc(frames)
        reason = reasons.reason_of(kind, frames)
        if reason is None:
            if reasons.gpu_spin(frames):
                frames = tuple(frames) + (P.GPU_SPIN,)
            elif merger.spin_frames and merger.omp_spin(frames):
                frames = tuple(frames) + (P.OMP_SPIN,)
            elif gil == bpfdefs.GIL_FREE and _python_leaf(frames):
                frames = tuple(frames) + (P.GIL_NOT_HELD,)
        else:
            off_ns[tid] = off_ns.get(tid, 0) + ns
        _add_gil(prof, tid, gil, reason, ns, merger.gil_of(ph))
        if in_gc:
            prof.gil[tid].gc_ns += ns
        for waker, wcount, wns in wakers_of.get(skey, ()):     # waits only
            wns = min(wns, ns)
            wcount = min(wcount, count)
            chain = merger.waker_frames(waker, tgid, shown)
            if not chain:
                continue                # not known: stays with the rest
            prof.add(P.StackKey(tgid, tid, frames, reason, chain), wns, wcount)
            ns -= wns
            count -= wcount
        prof.add(P.StackKey(tgid, tid, frames, reason), ns, count)
        prof.processes.setdefault(tgid, rec.comms.get(tgid, "?"))
    prof.gil = {tid: g for tid, g in prof.gil.items() if g.read}
    for (wait, waker), (_count, ns) in wakes.items():
        tgid, tid, _us, _ks, ph, _kind = wait
        wkind, wtgid, wtid, _wus, _wks, wph, _comm = waker
        kind = WAKER_KINDS.get(wkind, "unknown")
        task = kind == "task"
        w = P.Wake(tgid, shown.get(tid, tid), merger.innermost_python(ph), kind,
                   wtgid if task else 0, shown.get(wtid, wtid) if task else 0,
                   merger.innermost_python(wph) if task else "")
        prof.wakes[w] = prof.wakes.get(w, 0) + ns
    if rec.tasks is not None:
        _add_task_waits(prof, rec)
    for tid, t in rec.threads.items():
        sid = shown[tid]
        name = rec.python_names.get(tid, t.name) if t.threads == 1 else t.name
        prof.threads[sid] = name
        prof.thread_info[sid] = P.ThreadInfo(
            t.pid, sid, name, on_cpu_ns=t.on_ns if o.mode != "off" else 0,
            off_cpu_ns=off_ns.get(sid, 0), samples=t.samples, first_ns=t.first_ns,
            last_ns=t.last_ns, threads=t.threads, entry=t.entry,
            ns_tid=rec.ns_ids.get(sid, 0) if sid > 0 else 0)
    prof.ns_ids = {i: n for i, n in rec.ns_ids.items()}
    for key in prof.weights:
        prof.threads.setdefault(key.tid, "?")
    meta.exact_on_cpu = rec.exact_on_cpu
    meta.waits = wait_counts
    meta.duration_ns = rec.duration_ns
    meta.drops_ns = dict(rec.drops_ns)
    meta.native_modules = getattr(symbolizer, "module_symbols", dict)()
    return prof, merger.stats
