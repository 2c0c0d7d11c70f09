"""The waits open at the start and at the end of a recording, whose stacks
BPF cannot take (it takes a wait's stack when it begins, or with --off-cpu
sampled when it ends).  The threads already blocked at the start: read
here (capture: the Python stack from the target's memory, the native one
as registers and stack bytes, walked once its tables are in).  The waits
still open at the end: read before the end mark (read_open_waits) and
added with those BPF took (flush_captured, flush_sampled).  And the
threads of a target registered late (a launched command, a child, a
process -a found) that blocked before its interpreter was known: the
Python frames they blocked with are read and handed to BPF (fix_blocked)."""
from __future__ import annotations

import os
import time
from typing import Dict

from ..kernel import bpfdefs
from ..kernel.bpfsys import update_elem
from ..kernel.bpfdefs import PYS_TRUNCATED
from .accounting import ended_by_stamp
from .maps import items
from .recording import NATIVE_ID_BASE, NO_STACK, PyStack, code_infos
from ..cpython import walker
from ..kernel import syscalls

TABLES_EVERY_S = 0.1             # reading threads at the start: tables loaded this often
from ..kernel.procfs import blocked_syscall, ns_id, proc_state


class BlockedThreads:
    """The blocked-at-the-start captures of one session (s: the Session,
    whose targets, rec, bpf, unwinder and native stack ids they use)."""

    def __init__(self, session):
        self.s = session
        self.fixes: Dict[int, tuple] = {}       # tid -> (ts, Python stack hash) (fix_blocked)
        self.captured: Dict[int, tuple] = {}    # ustack id -> (pid, capture) to walk (native_now)
        self._tables_at = time.monotonic()

    def capture(self):
        """The stacks of the targets' threads that are blocked at the start,
        read here, since BPF only sees a stack when a thread leaves the CPU."""
        for tgt in self.s.targets:
            pid = tgt.pid
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue
            stacks = {}
            if tgt.python is not None and tgt.reader is not None:
                stacks = self.thread_stacks(tgt, tids)
            for tid in tids:
                frames, truncated = stacks.get(tid, ([], False))
                pyhash = self.keep_pystack(tgt, tid, frames, truncated) if frames else 0
                self.s.accounts.initial[tid] = (pid, pyhash, state_kind(pid, tid),
                                      self.native_now(pid, tid))
                self._tables_meanwhile()

    def _tables_meanwhile(self):
        """The unwind tables built meanwhile go into the kernel every
        TABLES_EVERY_S: reading thousands of threads takes seconds, and
        every stack BPF walks meanwhile stops where a table is missing."""
        now = time.monotonic()
        if self.s.unwinder is not None and now - self._tables_at >= TABLES_EVERY_S:
            self._tables_at = now
            self.s.unwinder.poll()

    def read_open_waits(self) -> Dict[int, tuple]:
        """tid -> (the wait's start, Python stack hash, native stack id) of
        every target thread in a wait whose stack BPF has not taken
        (--off-cpu sampled: TH_OFF without TH_CAPTURED), read now, before the
        end mark.  A thread whose entry shows the same start after the mark
        has not run since: these are the stacks it waited with
        (flush_sampled).  The map is listed again after the
        reads (three times at most), for the waits that began meanwhile."""
        out: Dict[int, tuple] = {}
        for _ in range(3):
            fresh = self._open_waits(out)
            if not fresh:
                break
            self._read_waits(fresh, out)
        return out

    def _open_waits(self, known: Dict[int, tuple]) -> Dict[int, Dict[int, int]]:
        """pid -> {tid: wait start} of the open waits (TH_OFF, not
        TH_CAPTURED) not in known with that start."""
        off, captured = bpfdefs.TH["OFF"], bpfdefs.TH["CAPTURED"]
        by_pid: Dict[int, Dict[int, int]] = {}
        for k, th in items(self.s.bpf["threads"]):
            if th.flags & off and not th.flags & captured and known.get(k.value, (None,))[0] != th.ts:
                by_pid.setdefault(th.tgid, {})[k.value] = th.ts
        return by_pid

    def _read_waits(self, by_pid: Dict[int, Dict[int, int]], out: Dict[int, tuple]):
        for pid, tids in by_pid.items():
            tgt = self.s.targets.get(pid)
            if tgt is None or tgt.exited:
                continue
            try:
                stacks = {}
                if tgt.python is not None and tgt.reader is not None:
                    stacks = self.thread_stacks(tgt, list(tids))
                for tid, ts in tids.items():
                    frames, truncated = stacks.get(tid, ([], False))
                    pyhash = self.keep_pystack(tgt, tid, frames, truncated) if frames else 0
                    out[tid] = (ts, pyhash, self.native_now(pid, tid, "end"))
            except (OSError, ValueError):   # it is gone: its waits end with it
                continue

    def thread_stacks(self, tgt, tids) -> Dict[int, tuple]:
        """host tid -> (frames, truncated): the Python stacks of tgt's threads
        read from its memory now (walker.all_thread_stacks)."""
        by_tid = walker.all_thread_stacks(tgt.python, tgt.pid)    # a child shares its parent's
        if len(by_tid) == 1 and len(tids) == 1 and tgt.pid not in self.s.rec.ns_ids \
                and not set(by_tid) & set(tids) and _one_thread(tgt.pid):
            # a fork's child has one thread, whose thread state may still
            # carry the id of the parent's thread that forked (3.11 does not
            # update native_thread_id in the child): it is that thread's
            (frames,) = by_tid.values()
            return {next(iter(tids)): frames}
        return self._host_ids(tgt, by_tid, tids)

    def _host_ids(self, tgt, by_tid: Dict[int, object], tids) -> Dict[int, object]:
        """by_tid keyed by the host's ids of the threads: CPython keeps the
        ids its own PID namespace gave them (a container's)."""
        if tgt.pid not in self.s.rec.ns_ids:
            return by_tid
        host = {ns_id(f"/proc/{tgt.pid}/task/{t}/status", -1): t for t in tids}
        return {host[t]: v for t, v in by_tid.items() if t in host}

    def read_python_names(self):
        """Python's names of the targets' threads (threading's), into
        rec.python_names; read at the start and before the end mark, so a
        thread renamed meanwhile keeps its last name."""
        from ..cpython.threadnames import python_thread_names
        for tgt in self.s.targets:
            if tgt.python is None or tgt.mem is None or tgt.exited:
                continue
            try:
                names = python_thread_names(tgt.python, tgt.mem)
                tids = os.listdir(f"/proc/{tgt.pid}/task") if tgt.pid in self.s.rec.ns_ids else ()
            except Exception:                           # noqa: BLE001 - names are extra
                continue
            self.s.rec.python_names.update(self._host_ids(tgt, names, tids))

    def keep_pystack(self, tgt, tid: int, frames, truncated: bool) -> int:
        """A Python stack read in user space, kept beside BPF's with its code
        objects; its hash (bit 62 set, as every one read in user space; the
        image's epoch in it, as BPF mixes it into its own)."""
        stamps = [tgt.reader.stamp(code) for code, _, _ in frames]
        pyhash = (hash((tgt.pid, tid, tgt.epoch, tuple(frames), tuple(stamps))) & ((1 << 62) - 1)) | (1 << 62)
        infos = code_infos(tgt.reader, frames, stamps)
        self.s.rec.pystacks[pyhash] = PyStack(tgt.pid, PYS_TRUNCATED if truncated else 0, frames,
                                            infos, tgt.python)
        return pyhash

    def fix_blocked(self, tgt):
        """tgt has just been registered with its interpreter: its threads that
        blocked before (a launched command, a child, a process found by -a)
        were captured without Python frames.  Each still in that interval
        (offcpu_start.ts the same before and after the read) has not run
        since, so the frames read now are those it blocked with: BPF takes
        them at its switch-in (pystack_fix), flush_captured at the end."""
        if tgt.python is None or tgt.reader is None:
            return
        table, fix = self.s.bpf["offcpu_start"], self.s.bpf["pystack_fix"]
        pid = tgt.pid

        def open_now():
            return {k.value: st.ts for k, st in items(table)
                    if st.key.tgid == pid and not st.key.pystack}
        before = open_now()
        if not before:
            if self.s.rec.offcpu != "exact":
                self._name_blocked(tgt)
            return
        stacks = self.thread_stacks(tgt, before)
        after = open_now()
        for tid, ts in before.items():
            frames, truncated = stacks.get(tid, ([], False))
            if not frames or after.get(tid) != ts:
                continue                # it ran meanwhile: its next capture has them
            pyhash = self.keep_pystack(tgt, tid, frames, truncated)
            leaf = fix.Leaf()
            leaf.ts, leaf.pystack = ts, pyhash
            update_elem(fix.map_fd, fix.Key(tid), leaf)
            self.fixes[tid] = (ts, pyhash)

    def _name_blocked(self, tgt):
        """Sampled off-CPU stacks: a wait's stack is taken at its end, and a
        thread blocked since before its process was registered (a child
        asleep from its fork) may end it just before its process exits,
        leaving no memory to name the code objects by.  They are read now,
        while it lives (its reader keeps what it read, by address: a code
        object on a live stack is not freed)."""
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{tgt.pid}/task")]
            for frames, _ in self.thread_stacks(tgt, tids).values():
                for code, _, _ in frames:
                    tgt.reader.code(code)
        except (OSError, ValueError):
            pass

    def _open_at_end(self, start_ns: int, end_ns: int, since: int) -> int:
        """The part inside the recording of a wait open at the end mark,
        begun at `since`; 0 when there is none or --min/--max-block-us leave
        it out (judged by its length so far; then counted)."""
        ns = end_ns - max(since, start_ns)
        if ns <= 0:
            return 0
        if self.s.left_out_by_length(end_ns - since):
            self.s.accounts.filtered[0] += 1
            self.s.accounts.filtered[1] += ns
            return 0
        return ns

    def flush_captured(self, start_ns: int, end_ns: int):
        """Threads still off the CPU at the end whose stack BPF took at the
        switch-out: blocked until the end mark."""
        s = self.s
        for k, st in items(s.bpf["offcpu_start"]):
            tid = k.value
            key = st.key
            ns = self._open_at_end(start_ns, end_ns, st.ts)
            if not ns:
                continue
            pystack = key.pystack
            if not pystack and self.fixes.get(tid, (None,))[0] == st.ts:
                pystack = self.fixes[tid][1]
            skey = (key.tgid, key.tid, s._ustack_id(key.ustack, key.nstack), key.kstack, pystack,
                    key.kind)
            s._fetch_stack_ids(skey[2], key.kstack)
            s.accounts.add_own(skey, 1, ns)
            if s.timeline is not None:      # --timeline: open until the end mark
                s.timeline.add_open_wait(key, pystack, st.ts, end_ns)

    def flush_sampled(self, start_ns: int, end_ns: int, reads: Dict[int, tuple]):
        """--off-cpu sampled: the waits still open at the end, whose stacks
        BPF never took (it takes one when a wait ends), at their exact
        length with the stacks read_open_waits read before the end mark; a
        thread whose wait began after that read has none."""
        s = self.s
        off, captured = bpfdefs.TH["OFF"], bpfdefs.TH["CAPTURED"]
        lost = [0, 0]
        for k, th in items(s.bpf["threads"]):
            if not th.flags & off or th.flags & captured:
                continue
            if not s.opts.every_process and th.tgid not in s.targets:
                continue
            tid = k.value
            until = end_ns
            if ended_by_stamp(th) and th.exit_ts < end_ns:
                until = th.exit_ts      # its wait ended by then
            ns = self._open_at_end(start_ns, until, th.ts)
            if not ns:
                continue
            got = reads.get(tid)
            if got is not None and got[0] == th.ts:
                _ts, pyhash, uid = got
            else:
                pyhash, uid = 0, NO_STACK
                lost[0] += 1
                lost[1] += ns
            s._fetch_stack_ids(-1, th.wait_kstack)
            s.accounts.add((th.tgid, tid, uid, th.wait_kstack, pyhash, th.wait_kind), 1, ns)
        if lost[0]:
            s.rec.add_drop("open wait's stack not read at the end", lost[0], lost[1])

    def native_now(self, pid: int, tid: int, when: str = "start") -> int:
        """The native stack of a thread blocked right now, as an id in
        rec.ustacks; -1: none.  Its registers and stack are read now and
        walked once its process's tables are ready (walk_captured): the
        tables are made while the recording runs, and the thread has not
        run meanwhile, so the walk is the one it would have been now."""
        cap = self.s.unwinder.capture_blocked(pid, tid) if self.s.unwinder is not None else None
        if cap is None:
            return -1
        sid = NATIVE_ID_BASE + len(self.s.native_ids)
        self.s.native_ids[(when, tid, sid)] = sid       # a key of its own: ids are counted by it
        self.s.rec.ustacks[sid], self.s.rec.native_flags[sid] = [], 0
        self.captured[sid] = (pid, cap)
        return sid

    def walk_captured(self, final: bool):
        """The stacks native_now captured, walked once their tables are in
        (at the end, with what is in by then)."""
        if not self.captured or self.s.unwinder is None:
            return
        for sid, (pid, cap) in list(self.captured.items()):
            if not final and not self.s.unwinder.captured_ready(pid, cap):
                continue
            del self.captured[sid]
            got = self.s.unwinder.walk_captured(pid, cap)
            if got is not None:
                self.s.rec.ustacks[sid], self.s.rec.native_flags[sid] = got


def _one_thread(pid: int) -> bool:
    """Has the process exactly one thread (its main one)?"""
    try:
        return os.listdir(f"/proc/{pid}/task") == [str(pid)]
    except OSError:
        return False


def state_kind(pid: int, tid: int) -> int:
    """The kind of off-CPU time (bpfdefs.KIND_*) of a thread's state in /proc, with
    the system call it is in (/proc/PID/task/TID/syscall: its number, -1
    for none, `running`), as BPF keeps it (syscalls.split_kind)."""
    sc = blocked_syscall(pid, tid)
    sysno = syscalls.UNKNOWN if sc is None else (None if sc.nr < 0 else sc.nr)
    return syscalls.with_sys(proc_state_kind(pid, tid), sysno)


def proc_state_kind(pid: int, tid: int) -> int:
    return {"S": bpfdefs.KIND_SLEEP, "R": bpfdefs.KIND_RUNQUEUE, "D": bpfdefs.KIND_UNINTERRUPTIBLE,
            "I": bpfdefs.KIND_SLEEP}.get(proc_state(f"/proc/{pid}/task/{tid}/stat"),
                                         bpfdefs.KIND_OTHER)
