"""Each thread's exact times, from the records BPF keeps per thread (the
threads map) and the aggregated stacks of a recording.

In wall mode every switch of a target thread is seen: its on-CPU time is
exact, from its switch timestamps, and its sampled on-CPU stacks are scaled
to add up to it (scale_on_cpu).  A thread there at the start gets the time
before its first switch-in with the stacks read then (add_initial, from
preexisting.py).  A thread that ended folds into one group per process and
entry function (fold), which keeps memory bounded by live threads however
many threads a server starts.

ThreadAccounts works on plain values: a thread record is anything with the
fields of bpf/pyoffcpu.h's struct thread_t (tgid, comm, on_ns, flags, ts,
first_ts, last_ts, exit_ts, unseen_ns; with --off-cpu sampled the arrays
short_kind, short_n, short_ns (one slot per kind) and pend_kind, pend_kstack,
pend_ns), so it runs on recorded batches without BPF
(tests/test_thread_accounts.py).

A thread's end: its last switch-out (TASK_DEAD, TH_EXITED) where BPF sees
switches; else the stamp its exit left (sched_process_exit, TH_EXITING):
in cpu mode, where no switch is seen, and for a thread whose last
switch-out BPF missed."""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional, Tuple

from ..kernel import bpfdefs
from ..kernel.bpfdefs import KIND_ONCPU
from .recording import NO_STACK, SHORT_WAITS, UNSAMPLED, Recording, ThreadTimes, accumulate
from ..kernel.procfs import ns_id

KIND_SHADOW = bpfdefs.value("KIND_SHADOW")
KIND_SHORT = bpfdefs.value("KIND_SHORT")

TH = bpfdefs.TH
_NO_GIL = ~(3 << bpfdefs.GIL_SHIFT)     # a key's kind & this == KIND_ONCPU: on-CPU (bpfdefs.on_cpu)
# cpu mode: a thread that began to exit this long before a drain's flip has
# had its last sample (its last microseconds in the kernel) by then
EXIT_SETTLE_NS = 100_000_000


def ended_by_stamp(th) -> bool:
    """Does the thread's exit stamp (sched_process_exit) end it: stamped,
    and not switched out since (a thread switched out after its stamp is
    blocked on its way out, so still there; one whose wait began before
    its stamp ran again by then, at a switch-in BPF missed)."""
    return bool(th.flags & TH["EXITING"]) and not (th.flags & TH["OFF"] and th.ts >= th.exit_ts)


class ThreadAccounts:
    """The per-thread bookkeeping of one recording (see the module's doc)."""

    def __init__(self, rec: Recording, left_out: Callable[[int], bool]):
        """left_out(ns): is a wait this long left out (--min/--max-block-us)?"""
        self.rec = rec
        self.opts = rec.options
        self.left_out = left_out
        self.start_ns = 0               # the recording's window (monotonic ns)
        self.end_ns = 0
        self.tid_keys: Dict[int, List[tuple]] = {}     # live tid -> its keys in rec.stacks
        self.tid_wakes: Dict[int, List[tuple]] = {}    # ... and in rec.wakes
        self.groups: Dict[Tuple[int, str], int] = {}   # (pid, entry) -> group id (< 0)
        self._entry_of: Dict[int, Optional[str]] = {}  # Python stack hash -> its entry (stack_entry)
        # tid -> (pid, Python stack hash, kind, native stack id) of the
        # threads there at the start, blocked (preexisting.py fills it)
        self.initial: Dict[int, Tuple[int, int, int, int]] = {}
        # --timeline: told of each wait there at the start, (its key, the
        # start, its end), as add_initial adds it
        self.on_initial: Optional[Callable[[tuple, int, int], None]] = None
        self.filtered = [0, 0]          # waits left out here by length: [how many, ns]
        # the kernel's fold (bpf: fold_exit): control.fold, and its group ids
        # -> (process, entry stack, name), then -> the group's id here
        self.kernel_fold = 0
        self._kernel_ids: Dict[int, Tuple[int, int, str]] = {}
        self._kernel_gids: Dict[int, int] = {}
        self.kernel_folded: set = set()     # FOLD_SHADOW: threads the kernel folded too
        self.fold_shadow = False            # PYOFFCPU_FOLD=shadow, from the start on
        self.shadow_waits = False           # PYOFFCPU_OFFCPU=shadow: both views of the waits

    def add(self, key, count: int, ns: int):
        acc = self.rec.stacks.get(key)
        if acc is not None:
            acc[0] += count
            acc[1] += ns
            return
        self.rec.stacks[key] = [count, ns]
        if key[1] >= 0:
            keys = self.tid_keys.get(key[1])
            if keys is None:
                self.tid_keys[key[1]] = [key]
            else:
                keys.append(key)

    def add_own(self, key, count: int, ns: int):
        """A key made here, not drained from BPF (a wait before the start,
        one open at the end, time after a switch-out BPF missed).  In a
        recording made both ways at once (PYOFFCPU_OFFCPU=shadow) it is the
        same in both, so an off-CPU one goes to the sampled view too."""
        self.add(key, count, ns)
        if self.shadow_waits and not bpfdefs.on_cpu(key[5]):
            self.add(key[:5] + (key[5] | KIND_SHADOW,), count, ns)

    def thread_times(self, tid: int, th) -> ThreadTimes:
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

    def _end_of(self, th) -> Tuple[int, bool]:
        """(the thread's end or the recording's, has it ended): its last
        switch-out; else its exit's stamp, where no switch-out was seen (cpu
        mode, or missed), stamped inside the window (end_ns is 0 until the end)."""
        if th.flags & TH["EXITED"]:
            return th.last_ts, True
        if ended_by_stamp(th):
            return max(th.exit_ts, th.ts), True
        return self.end_ns, False

    def _span(self, th, last: int) -> Tuple[int, int]:
        """(first_ns, last_ns) from the start: one there at the start from 0."""
        last_ns = last - self.start_ns
        if not th.flags & TH["BORN"]:
            return 0, last_ns
        return (th.first_ts - self.start_ns if th.first_ts else last_ns), last_ns

    def fold_unsampled(self, tid: int, th) -> bool:
        """cpu mode: an ended thread no sample landed in and no drain saw
        alive joins its group with its span alone, which is all that
        close_thread, settle and fold come to for it, without a record of its
        own first (a thread-per-request server starts a few thousand a
        second, and most get no sample).  False: not such a thread."""
        if (self.opts.mode != "cpu" or not self.opts.fold_threads or tid in self.rec.threads
                or self.tid_keys.get(tid) or self.tid_wakes.get(tid)):
            return False
        last, ended = self._end_of(th)
        if not ended:
            return False
        name = bytes(th.comm).split(b"\0", 1)[0].decode("utf-8", "replace")
        first_ns, last_ns = self._span(th, last)
        gid = self.group_id(th.tgid, "", name)
        g = self.group_times(self.rec.threads, gid, th.tgid, name, "", first_ns, last_ns)
        self.join_group(g, tid, 1, 0, 0, first_ns, last_ns)
        return True

    def ended_before(self, th, flip_ns: int) -> bool:
        """Has the thread ended, all its times drained by a drain whose
        generation flipped at flip_ns?  In wall and off mode only its last
        switch-out says so (its exit stamp comes before its last
        microseconds on a CPU, and an entry deleted before that switch-out
        would be made again by it); in cpu mode its exit stamp."""
        if th.flags & TH["EXITED"]:
            return th.last_ts < flip_ns
        return (self.opts.mode == "cpu" and bool(th.flags & TH["EXITING"])
                and th.exit_ts + EXIT_SETTLE_NS < flip_ns)

    def close_thread(self, tid: int, th):
        """A thread's last facts: its lifetime in the window, the on-CPU span
        still open at the end, and the time before its first switch when it
        was there at the start."""
        t = self.rec.threads[tid]
        start, end = self.start_ns, self.end_ns
        flags = th.flags
        born = flags & TH["BORN"]
        last, ended = self._end_of(th)
        t.exited = t.exited or ended
        t.first_ns, t.last_ns = self._span(th, last)
        if flags & TH["ON"] and not flags & TH["EXITED"]:
            t.on_ns = th.on_ns + (last - th.ts)
        if th.unseen_ns:
            # off-CPU after a switch-out BPF missed: the time is known, its stack not
            self.add_own((t.pid, tid, NO_STACK, -1, 0, bpfdefs.KIND_OTHER), 1, th.unseen_ns)
        for kind, n, ns in zip(th.short_kind, th.short_n, th.short_ns):
            if n:
                # its last short waits of a kind, kept in its entry (bpf: short_add)
                self.add((t.pid, tid, SHORT_WAITS, -1, 0, kind | KIND_SHORT), n, ns)
        if flags & TH["PENDING"]:
            # a wait's stack owed, not taken before the end: its time all the same
            self.add((t.pid, tid, NO_STACK, th.pend_kstack, 0, th.pend_kind), 1, th.pend_ns)
            self.rec.add_drop("wait's stack not taken (the recording ended)", 1, th.pend_ns)
        if born or self.opts.mode == "cpu":
            return
        if not th.first_ts:
            # No switch in the whole window: running all along, or blocked
            # all along.  Only a running thread gets samples; without them
            # (--mode off) its state at the start tells.
            initial = self.initial.get(tid)
            if self.samples_of(tid) or (self.opts.mode == "off" and initial is not None
                                         and initial[2] == bpfdefs.KIND_RUNQUEUE):
                t.on_ns = end - start
                return
            self.add_initial(tid, t.pid, end - start)
        elif flags & TH["FIRST_IN"]:
            self.add_initial(tid, t.pid, th.first_ts - start)

    def add_initial(self, tid: int, pid: int, ns: int):
        """Time a thread there at the start spent blocked before its first
        switch-in, with the stacks read at the start."""
        if ns <= 0:
            return
        if self.left_out(ns):         # judged by the part inside the recording
            self.filtered[0] += 1
            self.filtered[1] += ns
            return
        pid0, pyhash, kind, ustack = self.initial.get(tid, (pid, 0, bpfdefs.KIND_OTHER, NO_STACK))
        self.add_own((pid0, tid, ustack, -1, pyhash, kind), 1, ns)
        if self.on_initial is not None:         # --timeline
            self.on_initial((pid0, tid, ustack, -1, pyhash, kind), self.start_ns, self.start_ns + ns)

    def samples_of(self, tid: int) -> int:
        return sum(self.rec.stacks[k][0] for k in self.tid_keys.get(tid, ())
                   if bpfdefs.on_cpu(k[5]))

    def stack_entry(self, pyhash: int) -> Optional[str]:
        """A Python stack's outermost frame that is not threading's own, as
        `name (file)`; None when there is none or a frame is not known yet.
        Remembered for a stack whose frames were all read with it (they never
        change); a server that starts a thread per request asks for the same
        few stacks thousands of times a second."""
        got = self._entry_of.get(pyhash, False)
        if got is not False:
            return got
        st = self.rec.pystacks.get(pyhash)
        if st is None:
            return None
        infos = st.infos or [self.rec.code.get((st.tgid, c)) for c, _, _ in st.frames]
        entry = None
        for (_, _, flags), info in zip(reversed(st.frames), reversed(infos)):
            if flags & bpfdefs.PYF_INTERP:
                continue                # a subinterpreter's mark: not a frame
            if info is None:
                break
            # threading's own frames, and 3.12+'s entry shim (`<interpreter
            # trampoline>` in `<shim>`), are not where a thread started
            if not info.filename.endswith("threading.py") and info.filename != "<shim>":
                entry = f"{info.name} ({os.path.basename(info.filename)})"
                break
        if st.infos:
            self._entry_of[pyhash] = entry
        return entry

    def fold(self, tid: int):
        """Fold an ended thread into the group of its process and entry function."""
        t = self.rec.threads.pop(tid)
        keys = self.tid_keys.pop(tid, ())
        stacks = self.rec.stacks
        pop = stacks.pop
        moved = [(key, pop(key)) for key in keys]
        # its entry: that of its heaviest Python stack that has one
        entry, best_ns = "", -1
        stack_entry = self.stack_entry
        for key, acc in moved:
            if key[4] and acc[1] > best_ns:
                e = stack_entry(key[4])
                if e is not None:
                    entry, best_ns = e, acc[1]
        gid = self.group_id(t.pid, entry, t.name)
        g = self.group_times(self.rec.threads, gid, t.pid, t.name, entry, t.first_ns, t.last_ns)
        self.join_group(g, tid, 1, t.on_ns, t.samples, t.first_ns, t.last_ns)
        get = stacks.get
        for key, acc in moved:
            gkey = (key[0], gid) + key[2:]
            g_acc = get(gkey)
            if g_acc is None:
                stacks[gkey] = acc          # popped above: nothing else holds it
            else:
                g_acc[0] += acc[0]
                g_acc[1] += acc[1]
        if self.fold_shadow and tid not in self.kernel_folded:
            # the kernel left it to user space: in its view too
            k = self.group_times(self.rec.kernel_threads, gid, t.pid, t.name, entry, t.first_ns, t.last_ns)
            self.join_group(k, tid, 1, t.on_ns, t.samples, t.first_ns, t.last_ns)
            for key, acc in moved:
                accumulate(self.rec.kernel_stacks, (key[0], gid) + key[2:], acc[0], acc[1])
        self.kernel_folded.discard(tid)
        # its waits' wakers go with them, under the same group
        wakes = self.rec.wakes
        for wait, waker in self.tid_wakes.pop(tid, ()):
            count, ns = wakes.pop((wait, waker))
            accumulate(wakes, ((wait[0], gid) + wait[2:], waker), count, ns)

    def group_id(self, pid: int, entry: Optional[str], name: str) -> int:
        """The id (< 0) of the group of a process's ended threads that
        started in entry (None: by their name)."""
        gkey = (pid, entry or name)
        gid = self.groups.get(gkey)
        if gid is None:
            gid = self.groups[gkey] = -(len(self.groups) + 1)
        return gid

    @staticmethod
    def group_times(table: Dict[int, ThreadTimes], gid: int, pid: int, name: str, entry: Optional[str],
                    first_ns: int, last_ns: int) -> ThreadTimes:
        g = table.get(gid)
        if g is None:
            g = table[gid] = ThreadTimes(pid, gid, name, first_ns=first_ns, last_ns=last_ns, exited=True,
                                         threads=0, entry=entry or "")
        return g

    @staticmethod
    def join_group(g: ThreadTimes, first_tid: int, threads: int, on_ns: int, samples: int,
                   first_ns: int, last_ns: int):
        """Threads (one ended thread, or a record of the kernel's) added to
        group g; first_tid: the one that came first (what a group of one
        is shown as)."""
        if not g.threads or first_ns < g.first_ns:
            g.first_tid = first_tid
        g.threads += threads
        g.on_ns += on_ns
        g.samples += samples
        g.first_ns = min(g.first_ns, first_ns)
        g.last_ns = max(g.last_ns, last_ns)

    # -- the kernel's fold (bpf: fold_exit) ------------------------------------
    def kernel_groups(self, entries):
        """The kernel's group ids (group_ids map entries: key with tgid,
        pystack and the name as two words, value the id) not seen yet."""
        for k, v in entries:
            gid = v.value
            if gid not in self._kernel_ids:
                name = (k.comm0.to_bytes(8, "little") + k.comm1.to_bytes(8, "little")).split(b"\0", 1)[0]
                self._kernel_ids[gid] = (k.tgid, k.pystack, name.decode("utf-8", "replace"))

    def kernel_gid(self, kid: int) -> int:
        """The group here of the kernel's group kid: the same (process,
        entry) as user space gives a thread whose heaviest Python stack is
        the group's."""
        gid = self._kernel_gids.get(kid)
        if gid is None:
            pid, pystack, name = self._kernel_ids[kid]
            entry = self.stack_entry(pystack) if pystack else None
            gid = self._kernel_gids[kid] = self.group_id(pid, entry, name)
        return gid

    def add_kernel_record(self, kid: int, r: Dict[str, int]):
        """One group_t of the kernel's: its threads added to the group."""
        gid = self.kernel_gid(kid)
        pid, pystack, name = self._kernel_ids[kid]
        table = self.rec.kernel_threads if self.kernel_fold & bpfdefs.FOLD_SHADOW else self.rec.threads
        first, last = r["first_ts"] - self.start_ns, r["last_ts"] - self.start_ns
        g = self.group_times(table, gid, pid, name, self.stack_entry(pystack) if pystack else None, first, last)
        self.join_group(g, r["first_tid"], r["threads"], r["on_ns"], r["samples"], first, last)
        self.rec.kernel_folded += r["threads"]

    def settle(self, tid: int):
        """A closed thread's final numbers: its raw sample count and its
        on-CPU time — exact in wall mode, where its sampled stacks are scaled
        to add up to it (the raw counts stay); samples x period in cpu mode.
        Then an ended thread folds into its group."""
        t = self.rec.threads[tid]
        stacks = self.rec.stacks
        on_keys = [k for k in self.tid_keys.get(tid, ()) if k[5] & _NO_GIL == KIND_ONCPU]
        t.samples = sum([stacks[k][0] for k in on_keys])
        if self.opts.mode == "wall":
            self.scale_on_cpu(t, on_keys)
        elif self.opts.mode == "cpu":
            t.on_ns = t.samples * int(1e9 // self.opts.frequency)
        else:
            t.on_ns = 0
        if t.exited and self.opts.fold_threads:
            self.fold(tid)

    def scale_on_cpu(self, t: ThreadTimes, keys: List[tuple]):
        """The thread's on-CPU stacks scaled to add up to its exact on-CPU
        time, remainder on the last; time no sample landed in goes to a stack
        of its own ([on-cpu: not sampled])."""
        exact = t.on_ns
        total = sum(self.rec.stacks[k][1] for k in keys)
        if total <= 0:
            if exact > 0:
                self.add((t.pid, t.tid, UNSAMPLED, -1, 0, KIND_ONCPU), 0, exact)
            return
        left = exact
        for i, key in enumerate(keys):
            acc = self.rec.stacks[key]
            share = left if i == len(keys) - 1 else acc[1] * exact // total
            acc[1] = share
            left -= share
