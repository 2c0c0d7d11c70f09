"""The session: compiles the BPF (or takes it from the cache), attaches it,
registers the targets, drains the kernel maps once a second while they run,
and decides when the recording ends.  record, top and snapshot all run this
one loop (batches()).

Its product is a Recording (recording.py): raw aggregated stacks, the
Python stacks with their code objects already read, the targets' address
spaces, and per thread its exact times (accounting.py).  The merger turns
it into a Profile.

The recording window is exact: BPF records nothing before `control.start_ns`
or from `control.end_ns` on, and every interval is clamped to it.  In wall
mode every switch of a target thread is seen, so each thread's on-CPU time is
known exactly from its switch timestamps; the samples only say how that time
splits over stacks (ThreadAccounts.scale_on_cpu).  What the maps hold is read
with maps.py; the waits open at the start and at the end are preexisting.py's;
a command after -- is launch.py's.

Its setup (compile, attach, register) is sessionsetup.py's; what it hands off
has a module each (named below).
"""
from __future__ import annotations

import ctypes
import json
import os
import struct
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional

from ..kernel import bpfdefs
from .accounting import ThreadAccounts
from ..kernel.bpfdefs import GROUP_TID
from .launch import Launcher
from .maps import (AGG_KEY_FIELDS, AGG_VALUE_FIELDS, GROUP_KEY_FIELDS, GROUP_VALUE_FIELDS, WAKE_KEY_FIELDS,
                   delete_all, fdinfo, held_times, items, pystack_type, take_generation, walk_stack)
from .platform import Platform
from .preexisting import BlockedThreads
from .sessionsetup import SessionSetup
from .recording import (LOST_PYTHON, NATIVE_ID_BASE, Batch, Options, PyStack, Recording, accumulate,
                        code_infos)
from ..native import symbols
from ..native.unwind import loader as unwind_loader
from ..targets.processes import Targets
from ..kernel.procfs import cpu_times, rss_kib, wall_time_of

# memo_stats' slots (bpf/memo.c): how each switch-out's native stack was found
MEMO_STATS = {n.lower(): bpfdefs.value("MEMO_" + n) for n in
              ("HIT_THREAD", "HIT_SHARED", "WALKED", "CHECKED", "WRONG", "HIT_WAKE")}

DROP_NAMES = bpfdefs.drop_names()
POLL_MS = 50                        # the loop's longest wait for BPF's records (sooner when a
                                    # process found lately is to be looked at again) ...
IDLE_POLL_MS = 250                  # ... while nothing waits for it (_poll_ms): each turn costs
                                    # ~0.25 ms of CPU here, 0.5% of a core at 20 turns a second
TH = bpfdefs.TH
EDGE_LEAD_NS = 20_000_000           # the window's edges are written this far ahead (_mark_edge)
GRACE_S = 0.003                     # a BPF program runs for microseconds: after a flip of
                                    # control.gen (or the end mark) none still uses the old value


class Session(SessionSetup):
    """One recording: compile and attach the BPF programs, register the
    targets, drain the maps once a second into a Recording, and end it (see
    the module's doc).  Its helpers, each a module of its own: ThreadAccounts
    (the exact per-thread times), BlockedThreads (the threads blocked at the
    start), Launcher (a command after --)."""

    def __init__(self, options: Options, platform: Platform,
                 status: Optional[Callable[[Recording, float], None]] = None,
                 started: Optional[Callable[[], None]] = None):
        self.opts = options
        self.platform = platform
        self.status = status
        self.started = started          # called once BPF is attached and targets registered
        self.rec = Recording(options)
        self.accounts = ThreadAccounts(self.rec, self.left_out_by_length)
        self.blocked = BlockedThreads(self)
        self.launcher: Optional[Launcher] = None
        self.start_notices: List[str] = []  # said when the recording starts (the cli prints them)
        self.targets: Optional[Targets] = None     # made once BPF is loaded (run)
        self.stop_reason: Optional[str] = None
        self.bpf = None
        self.unwinder: Optional[unwind_loader.NativeUnwinder] = None
        self._unwind_tables = False     # native stacks from .eh_frame tables (load_consts)
        self.native_ids: Dict[object, int] = {}   # native stack hash -> id in rec.ustacks
        self._start_ns = 0
        self._cpu_at_start = None           # procfs.CpuTimes at the start
        self._end_ns = 0
        self._gen = 0
        self._control = None
        self._unresolved: Dict[tuple, List[int]] = {}  # keys whose Python stack is not here yet
        self._stats_path = os.environ.get("PYOFFCPU_STATS_FILE")
        self._t0 = 0.0
        self._sampled: Optional[set] = None            # -a: the processes the last drain had
        # the files native stacks run through, their function indexes built
        # while the recording runs (_prefetch_symbols)
        self._symbolizer = None
        self._prefetched: set = set()
        self._prefetch_seen: set = set()             # (pid, pc) already looked at
        self._ustack_pid: Dict[int, int] = {}        # user stack id -> the process it was seen in
        self._new_ustacks: List[int] = []
        self._tasks = None                           # --async: collect/tasks.py's sampler
        self._fold_loader: Optional[threading.Thread] = None    # the fold program's verification
        self._unwinder_loader: Optional[threading.Thread] = None    # the finishing programs' (_attach)
        self._unwinder_error: Optional[BaseException] = None
        self._fold_fd: Optional[int] = None
        self._fold_started = False
        self._rseq_attached = False                  # rseq_capture takes the waits' owed stacks
        self.timeline = None                         # --timeline: collect/timeline.py's TimelineBuffer

    # -- set up -------------------------------------------------------------
    # -- events ---------------------------------------------------------------
    def _on_loop_wake(self, cpu: int, data: bytes):
        """-a: a process sampled before it was registered; else a target
        that exec'd or exited (its tgid): Targets.poll looks at it now."""
        if self.targets is not None and len(data) >= 4:
            self.targets.woken.append(struct.unpack_from("<I", data)[0])

    def _on_pystack(self, cpu: int, data: bytes):
        t = pystack_type()
        raw = t.from_buffer_copy(data.ljust(ctypes.sizeof(t), b"\0"))     # (short: zeros after it)
        n = min(raw.depth, len(raw.frames))
        frames = [(raw.frames[i].code, raw.frames[i].offset, raw.frames[i].flags) for i in range(n)]
        stamps = [raw.frames[i].stamp for i in range(n)]
        tgt = self.targets.get(raw.tgid)
        if tgt is None and self.opts.follow:
            # a child BPF registered at its fork, before the loop took it in
            # (the fork is in the life log before any stack of the child)
            self.targets.check_life()
            tgt = self.targets.get(raw.tgid)
        infos = python = None
        if tgt is not None and tgt.reader is not None and raw.epoch == tgt.epoch:
            infos = code_infos(tgt.reader, frames, stamps)
            python = tgt.python
        self.rec.pystacks[raw.hash] = PyStack(raw.tgid, raw.flags, frames, infos, python,
                                              raw.task_frame)
        if infos and self.accounts.kernel_fold:
            self._classify_stack(raw.hash)

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
            self.unwinder.take_stacks(self.native_ids)
        if "wake_agg" in self.bpf:
            for k, (count, ns) in take_generation(self.bpf["wake_agg"], WAKE_KEY_FIELDS,
                                                   AGG_VALUE_FIELDS, final, old):
                self._add_wake(dict(zip(WAKE_KEY_FIELDS, k)), count, ns)
        taken = [(tgid, tid, ustack, kstack, pystack, kind, nstack, count, ns)
                 for (tgid, tid, ustack, kstack, pystack, kind, _gen, nstack), (count, ns)
                 in take_generation(self.bpf["agg"], AGG_KEY_FIELDS, AGG_VALUE_FIELDS, final, old)]
        if final and "held_keys" in self.bpf:
            taken.extend(held_times(self.bpf["held_keys"]))
        if self.accounts.kernel_fold:
            # the kernel's folds of the same generation, and the ids of their groups
            records = take_generation(self.bpf["groups"], GROUP_KEY_FIELDS, GROUP_VALUE_FIELDS, final, old)
            if records or any(it[1] & GROUP_TID for it in taken):
                self.accounts.kernel_groups(items(self.bpf["group_ids"]))
            for (gid, _gen, _cpu, _pad), value in records:
                self.accounts.add_kernel_record(gid, dict(zip(GROUP_VALUE_FIELDS, value)))
        return taken

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
            self.accounts.tid_wakes.setdefault(w["tid"], []).append(key)
        accumulate(self.rec.wakes, key, count, ns)

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
        native_ids, ustacks, kstacks = self.native_ids, self.rec.ustacks, self.rec.kstacks
        add = self.accounts.add
        group_of = self.accounts.kernel_gid
        shadow = self.accounts.kernel_fold & bpfdefs.FOLD_SHADOW
        for tgid, tid, ustack, kstack, pystack, kind, nstack, count, ns in items:
            if tid & GROUP_TID:         # a group the kernel folded: its id here (< 0)
                tid = group_of(tid & ~GROUP_TID)
                if shadow:
                    uid = self._ustack_id(ustack, nstack)
                    self._fetch_stack_ids(uid, kstack)
                    accumulate(self.rec.kernel_stacks, (tgid, tid, uid, kstack, pystack, kind), count, ns)
                    continue
            # the stack's id, as _ustack_id gives it, without a call for the
            # common case: a native stack seen before
            uid = native_ids.get(nstack) if nstack else ustack
            if uid is None:
                uid = self._ustack_id(ustack, nstack)
            key = (tgid, tid, uid, kstack, pystack, kind)
            acc = stacks.get(key)
            if acc is not None:
                # a key in rec.stacks has its stacks and Python frames already
                acc[0] += count
                acc[1] += ns
                continue
            if (uid >= 0 and uid not in ustacks) or (kstack >= 0 and kstack not in kstacks):
                self._fetch_stack_ids(uid, kstack)
            if uid not in self._ustack_pid:
                self._ustack_pid[uid] = tgid
                self._new_ustacks.append(uid)
            if pystack and pystack not in pystacks:
                self._hold(key, count, ns)
            else:
                add(key, count, ns)
        self._retry_unresolved(final)
        self.blocked.walk_captured(final)
        self._prefetch_symbols()
        if self.unwinder is not None:
            self.unwinder.sweep(self.native_ids)
        self._read_threads(fold_before=None if final else flip_ns)

    def _hold(self, key, count: int, ns: int):
        """A Python stack whose frames did not reach user space (a lost perf
        event): keep its time aside, and let BPF send the stack again."""
        accumulate(self._unresolved, key, count, ns)
        try:
            del self.bpf["pystack_seen"][self.bpf["pystack_seen"].Key(key[4])]
        except KeyError:
            pass

    def _retry_unresolved(self, final: bool):
        for key in list(self._unresolved):
            count, ns = self._unresolved[key]
            if key[4] in self.rec.pystacks:
                del self._unresolved[key]
                self.accounts.add(key, count, ns)
            elif final:
                # never sent again: keep the time, without its Python frames
                del self._unresolved[key]
                self.rec.add_drop(LOST_PYTHON, count, ns)
                self.accounts.add(key, count, ns)

    def _ustack_id(self, ustack: int, nstack: int) -> int:
        """The id in rec.ustacks of a key's user stack: the frame-pointer stack
        id, or for an .eh_frame-walked stack an id of its own (read from
        nstacks the first time it is seen)."""
        h = nstack
        if not h:
            return ustack
        sid = self.native_ids.get(h)
        if sid is None:
            got = self.unwinder.stack(h) if self.unwinder is not None else None
            if got is None:
                return -1
            sid = NATIVE_ID_BASE + len(self.native_ids)
            self.native_ids[h] = sid
            self.rec.ustacks[sid], self.rec.native_flags[sid] = got
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

    def _fetch_stack_ids(self, ustack: int, kstack: int):
        rec = self.rec
        if ustack >= 0 and ustack not in rec.ustacks:
            rec.ustacks[ustack] = walk_stack(self.bpf["ustacks"], ustack)
        if kstack >= 0 and kstack not in rec.kstacks:
            rec.kstacks[kstack] = walk_stack(self.bpf["kstacks"], kstack)

    # -- threads --------------------------------------------------------------
    def _read_threads(self, fold_before: Optional[int]):
        """Bring the threads' BPF entries into rec.threads.  Ended threads are
        closed; with fold_before (a drain), those that ended before it —
        all their times are drained by now — fold into their group and leave
        the map, which keeps memory bounded by live threads."""
        table = self.bpf["threads"]
        done = []
        held, born = TH["HELD"], TH["BORN"]
        ended_before = self.accounts.ended_before
        for k, th in items(table):
            tid = k.value
            if th.flags & born and not self._fold_started:
                self._start_fold()      # a target starts threads: the kernel's fold is worth it
            if th.flags & held:
                # its keys are the kernel's until it ends: it folds there, or
                # comes back without TH_HELD (or, not folded at all, at the end)
                continue
            if fold_before is not None and ended_before(th, fold_before) and \
                    self.accounts.fold_unsampled(tid, th):
                done.append(k)
                continue
            self.accounts.thread_times(tid, th)
            if th.flags & TH["KFOLDED"]:
                self.accounts.kernel_folded.add(tid)
            if fold_before is not None and ended_before(th, fold_before):
                self.accounts.close_thread(tid, th)
                self.accounts.settle(tid)
                done.append(k)
        delete_all(table, done)

    def _finish_threads(self):
        """At the end: close and settle every thread still in the map."""
        self.rec.exact_on_cpu = self.opts.mode == "wall"
        for k, th in items(self.bpf["threads"]):
            tid = k.value
            if not self.opts.every_process and th.tgid not in self.targets:
                continue
            self.accounts.thread_times(tid, th)
            if th.flags & TH["KFOLDED"]:
                self.accounts.kernel_folded.add(tid)
            self.accounts.close_thread(tid, th)
            t = self.rec.threads[tid]
            if t.last_ns <= t.first_ns and not t.exited and not self.accounts.tid_keys.get(tid):
                del self.rec.threads[tid]     # born at the very end: never ran
                continue
            self.accounts.settle(tid)

    # -- the start ------------------------------------------------------------
    def _read_drops(self):
        for table_name, out in (("drops", self.rec.drops), ("drops_ns", self.rec.drops_ns)):
            table = self.bpf[table_name]
            for i, name in DROP_NAMES.items():
                if i >= bpfdefs.N_DROPS:
                    continue
                total = sum(table[table.Key(i)])
                if total:
                    out[name] = total
        if "memo_stats" in self.bpf:
            table = self.bpf["memo_stats"]
            for name, i in MEMO_STATS.items():
                self.rec.memo_stats[name] = sum(table[table.Key(i)])
        if self.unwinder is not None and self.unwinder.procs_full:
            self.rec.drops["unwind process map full"] = self.unwinder.procs_full
        # The kernel skips a program that would run inside another BPF program
        # on the same CPU: each skipped sched_switch is a switch not seen.
        missed = 0
        for fn in list(self.bpf.funcs.values()):
            missed += fdinfo(fn.fd).get("recursion_misses", 0)
        if missed:
            self.rec.drops["BPF runs skipped by the kernel"] = missed
        table = self.bpf["block_filtered"]
        self.rec.block_filtered = [sum(table[table.Key(i)]) + self.accounts.filtered[i] for i in (0, 1)]

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
                "threads": len(self.rec.threads), "unresolved": len(self._unresolved),
                "memo": dict(self.rec.memo_stats), "kernel_folded": self.rec.kernel_folded}
        u = self.unwinder
        if u is not None and u.builds is not None:
            # the tables made in the background: how many still wait, and each
            # build's seconds (the bench's per-library figures)
            line["tables"] = {"waiting": u.tables_waiting, "built": dict(u.builds.times),
                              "load_s": round(u.load_s, 3)}
        try:
            with open(self._stats_path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError:
            self._stats_path = None

    # -- the run --------------------------------------------------------------
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
            self.launcher = Launcher(o.command)
            launched = targets.add_launched(self.launcher.fork())
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
        self._start_ns = self.accounts.start_ns = self._mark_edge("start_ns")
        rec.start_time = wall_time_of(self._start_ns)
        self._cpu_at_start = cpu_times()    # the machine's busy and stolen time (the summary's steal)
        start_mono = self._t0 = self._start_ns / 1e9
        if o.async_tasks:
            from .tasks import TaskSampler
            self._tasks = TaskSampler(lambda: [(t.pid, t.python) for t in targets if not t.exited],
                                      self._start_ns, o.async_hz, spans=bool(o.timeline))
            self._tasks.start()
        try:
            if self.unwinder is not None:
                # the tables' builds start now, beside the reads below: those
                # take seconds for thousands of threads, and stacks wait for them
                self.unwinder.poll()
            if o.mode in ("wall", "off") and (o.pids or o.system_wide):
                self.blocked.capture()
                self.blocked.read_python_names()
            if launched is not None:
                self.launcher.start()
                targets.started(launched)
            if self.started:
                self.started()
            last_drain = start_mono
            # (the end is marked EDGE_LEAD_NS after the stop: see _mark_edge)
            deadline = start_mono + o.duration - EDGE_LEAD_NS / 1e9 if o.duration else None
            while self.stop_reason is None:
                self.bpf.perf_buffer_poll(timeout=targets.poll_timeout_ms(
                    self._poll_ms(time.monotonic(), last_drain, deadline)))
                self._fold_ready()
                self._unwinder_ready()
                now = time.monotonic()
                if deadline and now >= deadline:
                    self.request_stop("duration")
                if self.launcher is not None and not self.launcher.running():
                    rec.exit_status = self.launcher.exit_status
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

    def _mark_edge(self, field: str) -> int:
        """Mark the window's start or end (control's start_ns or end_ns) for
        BPF at an instant EDGE_LEAD_NS ahead, and wait for it to come.  BPF
        has the value before the instant, so it puts each event on the side
        of the edge its own clock says, and the window is exact.  Marked at
        the instant it is written instead, an edge reached BPF as late as the
        write (a syscall, which waits milliseconds where the hypervisor takes
        the CPU): a thread's exit in between was kept past the end, and one at
        the start was lost.  A write later than the lead is said."""
        at = time.monotonic_ns() + EDGE_LEAD_NS
        self._write_control(**{field: at})
        late = time.monotonic_ns() - at
        if late > 0:
            edge = "start" if field == "start_ns" else "end"
            self.rec.notices.append(f"the recording's {edge} reached BPF {late / 1e6:.1f} ms after it: "
                                    f"events that close to the {edge} may be on its wrong side")
        while (left := at - time.monotonic_ns()) > 0:
            time.sleep(left / 1e9)
        return at

    def _poll_ms(self, now: float, last_drain: float, deadline: Optional[float]) -> int:
        """The loop's longest wait now: POLL_MS while something waits for
        its turns (tables made or loaded a turn at a time, programs still
        verified, --timeline's buffer read at each turn, a launched command,
        whose end is seen by polling it); else IDLE_POLL_MS.  BPF's records
        (a new Python stack, a process -a meets, a target's exec or exit)
        wake it at once either way.  Never past the next drain or the
        deadline."""
        u = self.unwinder
        busy = (self.launcher is not None or self.opts.timeline or self._fold_loader is not None
                or self._unwinder_loader is not None or (u is not None and u.tables_waiting > 0))
        wait_s = (POLL_MS if busy else IDLE_POLL_MS) / 1000
        wait_s = min(wait_s, last_drain + 1.0 - now, (deadline - now) if deadline else wait_s)
        return max(0, int(wait_s * 1000) + 1)

    def _finish(self, start_mono: float):
        """The end mark first: from it on BPF adds nothing, so what is read
        below is the whole recording, and every open interval ends there."""
        o, rec = self.opts, self.rec
        # the stacks of the waits still open, read while they are: BPF takes
        # a wait's stack only when it ends (--off-cpu sampled)
        open_waits = self.blocked.read_open_waits() if rec.offcpu == "sampled" else {}
        self.blocked.read_python_names()
        self._end_ns = self.accounts.end_ns = self._mark_edge("end_ns")
        cpu_at_end = cpu_times()
        if self._cpu_at_start is not None and cpu_at_end is not None:
            rec.cpu_steal = (cpu_at_end.busy_s - self._cpu_at_start.busy_s,
                             cpu_at_end.steal_s - self._cpu_at_start.steal_s)
        if self._fold_loader is not None:
            self._fold_loader.join()    # a short recording: the program goes with the rest
        self._unwinder_ready(wait=True)
        if self._tasks is not None:
            rec.tasks = self._tasks.stop(self._end_ns)
            rec.notices.extend(rec.tasks.notices)
        time.sleep(GRACE_S)
        rec.duration_ns = self._end_ns - self._start_ns
        rec.duration_s = rec.duration_ns / 1e9
        # Names and code objects first: the rest can be read after the target is gone.
        self.bpf.perf_buffer_poll(timeout=0)
        self._drain(final=True)
        if o.mode in ("wall", "off"):
            self.blocked.flush_captured(self._start_ns, self._end_ns)
            self.blocked.flush_sampled(self._start_ns, self._end_ns, open_waits)
        self._finish_threads()
        if self.timeline is not None:       # (after the threads: their waits at the start)
            rec.timeline = self.timeline.resolved(self._ustack_id)
            rec.timeline.start_ns, rec.timeline.end_ns = self._start_ns, self._end_ns
            for ev in rec.timeline.events:
                self._fetch_stack_ids(ev.key[2], ev.key[3])
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


def _count(n: int, what: str) -> str:
    """`1 process`, `2 processes`."""
    return f"{n} {what}" + ("" if n == 1 else "es" if what.endswith("s") else "s")
