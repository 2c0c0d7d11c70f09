"""Targets: the life of each profiled process, from its registration to its end.

A `Target` is one process: its interpreter (once found), the memory reader
its code objects are read with, its BPF registration (`procs`: which frame
walker and which offsets) and its image epoch.  `Targets` holds them all and
keeps them true while the recording runs:

- detection: the interpreter of a process, looked for again while a
  launched command has not mapped it yet;
- BPF's life log (an mmap-ed ring, `life_log`: exec, followed fork, exit, in
  the order they happened), read at every turn of the main loop;
- exec: the process is a new image, walked natively until it is detected
  again, under a new epoch, so no stack of the old image is read with the
  new image's rules or back;
- its address space: /proc/PID/maps snapshots, for the symbolizer and the
  native unwinder's tables, taken again when BPF meets code in no known
  mapping and every half second;
- its end: a target whose process exits is retired at once (its exit is in
  the log; a look at /proc every LIVENESS_S backs that up), and the
  recording ends when every target has.

The session owns BPF (compile, attach, drain) and the accounting; it asks
this stage for the targets and tells it when to look again (poll).

Its registration record is procinfo.py's, the -a selection selection.py's.
"""
from __future__ import annotations

import ctypes
import os
import struct
import time
from typing import Callable, Dict, Iterator, List, Optional

from ..kernel import bpfdefs
from ..native import symbols
from ..cpython import detect
from ..cpython.code import CodeReader
from ..cpython.process import interpreter_layout
from ..kernel.memory import MemoryError_, ProcessMemory
from ..kernel.procfs import children_by_parent, cmdline, ns_id, process_alive, read_text, start_ticks
from .lifelog import LifeLog
from .procinfo import fill_proc_info
from .selection import Select

SNAPSHOT_S = 0.5                # maps and comm of every target read again, at first ...
SNAPSHOT_MAX_S = 4.0            # ... then twice as long after each look that found no change
LIVENESS_S = 5.0                # ... and whether it lives, where exits are in the life log
LAUNCH_WAIT_S = 3.0             # a launched command's time to map its interpreter
RETRY_FIRST_S = 0.005           # ... looked for again after 5 ms, then half the time it has waited
RETRY_MAX_S = 0.1               # (at most 100 ms): found within 1.5 times its start-up
MISSED_S = 0.2                  # BPF met an unknown pc: maps read again at most this often
SAMPLED_S = 0.25                # -a: processes with samples and no entry (most come by the life log)


class Target:
    """One profiled process: its BPF registration, Python runtime and memory."""

    def __init__(self, pid: int, launched: bool = False):
        self.pid = pid
        self.launched = launched
        self.python: Optional[detect.PythonProcess] = None
        self.settled = False            # Python found, or given up looking
        self.first_seen = time.monotonic()
        self.next_try = self.first_seen     # find_python: not before (backing off)
        self.reader: Optional[CodeReader] = None
        self.mem: Optional[ProcessMemory] = None
        self.exited = False
        # proc_info.epoch: which image; unique in the session (Targets.new_epoch),
        # so that no two images' stacks, of one PID or of a reused one, ever share a hash
        self.epoch = 0
        self.start_ticks = start_ticks(pid)     # with the PID, names the process (reuse)
        self.retired = False            # its BPF registration is gone (Targets.retire)
        self.maps_text: Optional[str] = None    # /proc/PID/maps at the last snapshot (code and files)
        self.maps: Optional[list] = None        # ... parsed
        self.snapshot_every = SNAPSHOT_S        # Targets.poll's looks at its maps
        self.next_snapshot = 0.0
        self.waits_for: Optional["Target"] = None     # --subprocesses: the parent it copies
        self.children_waiting: List["Target"] = []    # ... children forked before it was found

    def gone(self) -> bool:
        """Its process has ended (a zombie too), or its PID is another's.
        A process already gone when it was taken has no start time: gone."""
        return not self.start_ticks or start_ticks(self.pid) != self.start_ticks

    def forget_image(self):
        """The process is another program now (exec): nothing of the old one holds."""
        if self.mem is not None:
            self.mem.close()
        self.python = self.reader = self.mem = None
        self.settled = False
        self.waits_for = None
        for child in self.children_waiting:   # copies of the old image: on their own now
            child.waits_for, child.settled = None, False
        self.children_waiting = []
        self.launched = True            # give the new image time to map its interpreter
        self.first_seen = self.next_try = time.monotonic()


class Targets:
    def __init__(self, bpf, rec, unwinder, write_targets: Callable[[List[int]], None],
                 select: Optional[Select] = None, self_pid: int = 0, follow: bool = False,
                 on_python: Optional[Callable[[Target], None]] = None,
                 exit_events: bool = False):
        """bpf: the loaded programs; rec: the Recording (interpreters, address
        spaces, names and notices go there); unwinder: the native unwinder or
        None; write_targets(pids): puts the target list into BPF's control;
        select: -a, which processes to take (found at the start, on exec and,
        without filters, from their first samples); self_pid: never taken;
        follow: --subprocesses, the processes the targets start are targets
        (BPF registers them at their fork, `forks` says so); on_python(tgt):
        called once a target is registered with its interpreter;
        exit_events: the life log has every exit (the kernel says which
        thread is a process's last), /proc is looked at only as a backup."""
        self.bpf = bpf
        self.rec = rec
        self.unwinder = unwinder
        self._write_targets = write_targets
        self.select = select
        self.self_pid = self_pid
        self.follow = follow
        self.on_python = on_python
        self._forks_seen = set()
        self._epoch = 0
        self.by_pid: Dict[int, Target] = {}
        self.retired: List[Target] = []     # -a: gone, or their PID now another process's
        self._retired_pids = set()
        self.not_python = 0                 # -a: processes found without an interpreter
        self.left_out = 0                   # ... of them not taken (--python-only)
        self._execs: Dict[int, int] = {}
        self._life = LifeLog(bpf)
        self._batching = False
        self._unsettled: List[tuple] = []   # (child, with its interpreter) to finish (_settle_later)
        self.life_resyncs = 0               # times the log went round between two looks
        self.exits_seen = 0                 # targets retired at their exit in the log
        self._tried: Dict[int, int] = {}    # -a: unregistered pid -> its sample count when tried
        self.woken: List[int] = []          # BPF's loop_wakes since the last poll
        self._liveness_s = LIVENESS_S if exit_events else SNAPSHOT_S
        self._last_snapshot = self._last_liveness = time.monotonic()
        self._last_sampled = 0.0

    # -- the collection --------------------------------------------------------
    def new_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    def get(self, pid: int) -> Optional[Target]:
        return self.by_pid.get(pid)

    def __contains__(self, pid: int) -> bool:
        """A target now or earlier in the recording (its times are counted)."""
        return pid in self.by_pid or pid in self._retired_pids

    def __iter__(self) -> Iterator[Target]:
        return iter(list(self.by_pid.values()))

    def __len__(self) -> int:
        return len(self.by_pid)

    # -- coming in ---------------------------------------------------------------
    def add(self, pid: int) -> Target:
        """A running process (-p): its maps and interpreter now."""
        tgt = self.by_pid[pid] = Target(pid)
        tgt.epoch = self.new_epoch()
        self.snapshot(tgt)
        self.find_python(tgt)           # registers with Python frames when found
        if not tgt.settled or tgt.python is None or tgt.reader is None:
            self.register(tgt)          # native stacks meanwhile
        return tgt

    def add_descendants(self):
        """--subprocesses with -p: the processes the targets started before
        the recording (a pool already running), children of children too."""
        parents = children_by_parent()
        todo = list(self.by_pid)
        while todo:
            for child in parents.get(todo.pop(), ()):
                if child not in self.by_pid and child != self.self_pid:
                    self.add(child)
                    todo.append(child)

    def python_descendants(self) -> Dict[int, int]:
        """Without --subprocesses: per -p target, how many Python processes
        it started (children of children too) that are not recorded — a
        DataLoader's workers, a multiprocessing pool."""
        parents = children_by_parent()
        out: Dict[int, int] = {}
        for pid in list(self.by_pid):
            todo, n = list(parents.get(pid, ())), 0
            while todo:
                child = todo.pop()
                if child in self.by_pid or child == self.self_pid:
                    continue
                n += detect.may_become_python(child)
                todo.extend(parents.get(child, ()))
            if n:
                out[pid] = n
        return out

    def add_launched(self, pid: int) -> Target:
        """A command forked but not yet exec'd (--): registered before its first
        instruction; its interpreter is looked for once it runs (started)."""
        tgt = self.by_pid[pid] = Target(pid, launched=True)
        tgt.epoch = self.new_epoch()
        self.register(tgt)
        return tgt

    def started(self, tgt: Target):
        """The launched command is running its own image now: the exec BPF
        counted is the one this detection sees, so it is not a new image
        later (which would throw away the stacks walked until then)."""
        self._execs[tgt.pid] = self._exec_count(tgt.pid)
        tgt.epoch = self.new_epoch()
        self.snapshot(tgt)
        self.find_python(tgt)
        if not tgt.settled or tgt.reader is None:
            self.register(tgt)          # the new epoch, native stacks meanwhile

    def _exec_count(self, pid: int) -> int:
        try:
            return self.bpf["execs"][self.bpf["execs"].Key(pid)].value
        except KeyError:
            return 0

    def register(self, tgt: Target):
        """Its entry in `procs`: the walker and offsets of its interpreter, or
        none (native stacks only); and the target list in control."""
        table = self.bpf["procs"]
        info = table.Leaf()
        py = tgt.python
        fill_proc_info(info, py, tgt.epoch,
                       self._gil_layout(tgt) if py is not None and py.tstate_found else None)
        table[table.Key(tgt.pid)] = info
        self._publish()

    def _gil_layout(self, tgt: Target) -> Optional[detect.GilLayout]:
        """Where BPF reads the target's GIL state (None: it does not; said
        once); first its main interpreter (py.interps), whose GIL is checked."""
        py = tgt.python
        if py.gil_checked or tgt.mem is None:
            return py.gil
        try:
            py.interps, why = interpreter_layout(py, tgt.mem)
        except MemoryError_:
            py.interps, why = None, "its interpreter list cannot be read"
        if why:
            self.rec.notices.append(f"process {tgt.pid}: subinterpreters not marked: {why}")
        py.gil, why = detect.gil_layout(py, tgt.mem)
        py.gil_checked = True
        if why:
            self.rec.notices.append(f"process {tgt.pid}: GIL state not read: {why}")
        return py.gil

    def _publish(self):
        """The live targets into BPF's control block."""
        self._write_targets(sorted(p for p, t in self.by_pid.items() if not t.exited))

    def list_threads(self):
        """Every thread of the targets gets its entry in `threads` before the
        start (BPF keeps their exact times); sched_process_fork adds the ones
        started from now on.  Entries BPF made already are kept."""
        from ..kernel.bpfsys import BPF_NOEXIST, update_elem
        table = self.bpf["threads"]
        for tgt in self:
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{tgt.pid}/task")]
            except OSError:
                continue
            for tid in tids:
                leaf = table.Leaf()
                leaf.tgid = tgt.pid
                name = (read_text(f"/proc/{tgt.pid}/task/{tid}/comm") or "").strip().encode()
                leaf.comm = name[:15]
                update_elem(table.map_fd, table.Key(tid), leaf, BPF_NOEXIST)

    # -- while recording ---------------------------------------------------------
    def find_python(self, tgt: Target):
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
                self.rec.python_images.append(tgt.python)
                self.rec.notices.extend(f"process {pid}: {n}" for n in tgt.python.notices)
                self.register(tgt)
                if self.on_python is not None:
                    self.on_python(tgt)
                nested, self._batching = self._batching, True     # all registered, then settled
                try:
                    for child in tgt.children_waiting:
                        if child.waits_for is tgt and not child.exited:
                            self._inherit(child, tgt)
                finally:
                    self._batching = nested
                tgt.children_waiting = []
                if not nested:
                    self._settle_children()
            elif tgt.python.tss_key == -2:
                tgt.settled = True
                self.rec.notices.extend(tgt.python.notices)
        except detect.Unsupported as e:
            tgt.settled = True
            self.rec.notices.append(f"process {pid}: {e}; profiling native stacks only")
        except (detect.NotPython, MemoryError_, OSError):
            waited = time.monotonic() - tgt.first_seen
            if not tgt.launched or waited > LAUNCH_WAIT_S or not process_alive(pid) or (
                    self.select is not None and not detect.may_become_python(pid)):
                tgt.settled = True
                if self.select is not None:
                    self.not_python += 1
                    if self.select.python_only:
                        self._leave_out(tgt)
                    return
                if tgt.gone() or not (read_text(f"/proc/{pid}/maps") or "").strip():
                    # gone (or going: its memory is gone already) before what
                    # it runs could be read: no verdict on it
                    self.rec.notices.append(f"process {pid} exited before pyoffcpu could read what it "
                                            "runs: what was recorded of it has native stacks only")
                    return
                comm = (read_text(f"/proc/{pid}/comm") or "?").strip()
                self.rec.notices.append(
                    f"process {pid} ({comm}) is not a Python process: profiling native stacks only")

    def check_life(self):
        """What BPF's life log (lifelog.py) says happened since the last
        look, in order: execs, forks of followed targets, exits.  If it
        lost entries, every process is looked at again (_resync): exact
        either way."""
        events, lost = self._life.read()
        if not events and lost is None:
            return
        self._batching = True
        try:
            for kind, tgid, arg in events:
                if kind == bpfdefs.LIFE_EXEC:
                    self._on_exec(tgid, arg)
                elif kind == bpfdefs.LIFE_FORK:
                    self._on_fork(tgid, arg & 0xffffffff, arg >> 32)
                elif kind == bpfdefs.LIFE_EXIT:
                    tgt = self.by_pid.get(tgid)
                    if tgt is not None and not tgt.retired:
                        self.exits_seen += 1
                        self.retire(tgt)
        finally:
            self._batching = False
        if lost is not None:
            self._resync()
        self._settle_children()

    def _resync(self):
        """The log lost entries: every exec count and fork BPF keeps in its
        maps, and every target's liveness, read again."""
        self.life_resyncs += 1
        if self.follow:
            for child, v in self._pairs("forks").items():
                self._on_fork(child, v & 0xffffffff, v >> 32)
        for pid, n in self._pairs("execs").items():
            self._on_exec(pid, n)
        self.check_liveness()

    def _on_exec(self, pid: int, n: int):
        if self._execs.get(pid, 0) == n:
            return
        self._execs[pid] = n
        tgt = self.by_pid.get(pid)
        if tgt is not None and not tgt.exited and tgt.start_ticks and \
                start_ticks(pid) == tgt.start_ticks:
            # the same process, a new program
            tgt.epoch = self.new_epoch()
            tgt.forget_image()
            self.register(tgt)
            self.snapshot(tgt, reload=True)
            self.find_python(tgt)
            return
        if tgt is not None:
            # its process is gone and the PID is another's (BPF stopped
            # walking it with the old registration at the fork)
            self.retire(tgt)
        if self.select is not None:
            self.discover(pid)

    def _on_fork(self, child: int, parent: int, parent_execs: int):
        """--subprocesses: a child BPF registered at its fork."""
        if child in self._forks_seen:
            return
        self._forks_seen.add(child)
        self.add_child(child, parent, parent_execs)

    def add_child(self, pid: int, ppid: int, parent_execs: int) -> Optional[Target]:
        """A process a target forked: a copy of the parent's image (if the
        parent has not exec'd since), so the parent's interpreter and
        offsets hold; its own memory and mappings."""
        parent = self.by_pid.get(ppid)
        old = self.by_pid.get(pid)
        if old is not None:
            self.retire(old)            # its PID was a target's that is gone
            self.by_pid.pop(pid, None)
        tgt = self.by_pid[pid] = Target(pid)
        self._execs[pid] = self._exec_count(pid)
        if parent is not None and parent_execs != self._execs.get(ppid, 0):
            parent = None               # forked from an earlier image of the parent
        try:
            # stacks BPF walked with the entry it copied carry its epoch
            tgt.epoch = self.bpf["procs"][self.bpf["procs"].Key(pid)].epoch if parent else 0
        except KeyError:
            pass
        if not tgt.epoch:
            tgt.epoch = self.new_epoch()
        # Registered first, its mappings read after (_settle_later); BPF
        # walks it with the entry it copied from the parent meanwhile.
        if parent is not None and not parent.settled:
            # the parent's interpreter is still being looked for: the child
            # takes it when it is found (Targets.find_python), not a search of its own
            tgt.settled = True
            tgt.waits_for = parent
            parent.children_waiting.append(tgt)
            self.register(tgt)          # native stacks meanwhile
        elif parent is not None:
            self._inherit(tgt, parent)
        else:
            self.find_python(tgt)
            if not tgt.settled:
                self.register(tgt)      # native stacks until its interpreter is found
        self._settle_later(tgt)
        return tgt

    def _inherit(self, tgt: Target, parent: Target):
        """A child that is a copy of parent's image: its interpreter, offsets
        and code objects' layout; its own memory."""
        tgt.waits_for = None
        tgt.python, tgt.settled = parent.python, True
        if parent.reader is not None and parent.python is not None:
            try:
                tgt.mem = ProcessMemory(tgt.pid)
                tgt.reader = CodeReader(tgt.mem, parent.python.minor, parent.python.offsets,
                                        parent.python.code_type)
                self.rec.pythons[tgt.pid] = parent.python
            except (MemoryError_, OSError):
                tgt.python = tgt.reader = None
        self.register(tgt)
        self._settle_later(tgt, python=True)

    def _settle_later(self, tgt: Target, python: bool = False):
        """A child's mappings (and, with its interpreter, on_python: its
        blocked threads are walked with its tables) once every child the
        log names is registered: a child maps what its parent loaded since
        the parent's last snapshot, and parsing those files takes a while,
        during which the children behind it would have no Python frames."""
        if not any(t is tgt for t, _ in self._unsettled):
            self._unsettled.append((tgt, python))
        elif python:
            self._unsettled = [(t, p or t is tgt) for t, p in self._unsettled]
        if not self._batching:
            self._settle_children()

    def _settle_children(self):
        while self._unsettled:
            tgt, python = self._unsettled.pop(0)
            if tgt.exited:
                continue
            self.snapshot(tgt)
            if python and tgt.reader is not None and self.on_python is not None:
                self.on_python(tgt)

    def poll(self, now: float, sampled: Optional[set] = None):
        """The main loop's turn: execs, interpreters still to find, mappings
        BPF could not place; every SNAPSHOT_S the maps and liveness of all
        (under -a the maps of those in `sampled` only, the processes the last
        drain had samples of: the others have no addresses to name)."""
        self.check_life()
        if self.woken:
            # -a: sampled for the first time and not registered: just
            # exec'd, most of them (their interpreter may still be starting);
            # else targets that exec'd, which the life log just told
            woken, self.woken = self.woken, []
            for pid in woken if self.select is not None else ():
                self.discover(pid)
        for tgt in self:
            if not tgt.settled and now >= tgt.next_try:
                self.find_python(tgt)
                wait = min(RETRY_MAX_S, max(RETRY_FIRST_S, 0.5 * (now - tgt.first_seen)))
                tgt.next_try = now + wait
        if self.unwinder is not None:
            # tables made in the background go into the kernel as they come
            self.unwinder.poll()
            # native stacks reached code in no known mapping: a library was
            # just loaded (or the command just started): look again
            for pid in self.unwinder.missed(MISSED_S):
                tgt = self.by_pid.get(pid)
                if tgt is not None and not tgt.exited:
                    self.snapshot(tgt)
        if now - self._last_liveness >= self._liveness_s:
            self._last_liveness = now
            self.check_liveness()
        if now - self._last_snapshot >= SNAPSHOT_S:
            self._last_snapshot = now
            for tgt in self:
                if tgt.exited or now < tgt.next_snapshot or not (
                        self.select is None or sampled is None or tgt.pid in sampled):
                    continue
                # a library loaded since shows first in BPF's misses (above):
                # this look is for the rest, and backs off while nothing changes
                changed = self.snapshot(tgt)
                tgt.snapshot_every = SNAPSHOT_S if changed else min(SNAPSHOT_MAX_S, 2 * tgt.snapshot_every)
                tgt.next_snapshot = now + tgt.snapshot_every
        if self.unwinder is not None:
            self.unwinder.collect()     # the tables of files no process maps now
        if self.select is not None and not self.select.filtered and now - self._last_sampled >= SAMPLED_S:
            self._last_sampled = now
            self._discover_sampled()

    def poll_timeout_ms(self, longest: int) -> int:
        """How long the loop may wait for BPF before poll() is due: at most
        `longest`, less when a process still starting is to be looked at
        again (RETRY_FIRST_S after it was found, ...)."""
        due = min((t.next_try for t in self if not t.settled), default=None)
        if due is None:
            return longest
        return max(0, min(longest, int((due - time.monotonic()) * 1000) + 1))

    def check_liveness(self):
        """Retire the targets whose process is gone or is another's now
        (at the start too: an exit before BPF was attached left no event)."""
        for tgt in self:
            if not tgt.exited and tgt.gone():
                self.retire(tgt)

    def all_exited(self) -> bool:
        return bool(self.by_pid) and all(t.exited for t in self)

    def retire(self, tgt: Target):
        """A target whose process is gone (or whose PID another process has
        now): its BPF registrations go, so nothing is walked with them."""
        if tgt.retired:
            return
        self.rec.gone_pids.add(tgt.pid)
        self._release(tgt)
        try:
            del self.bpf["procs"][self.bpf["procs"].Key(tgt.pid)]
        except KeyError:
            pass
        if self.select is not None and self.by_pid.get(tgt.pid) is tgt:
            # -a: the PID is free for the next process; the old one's facts stay in rec
            del self.by_pid[tgt.pid]
            self.retired.append(tgt)
            self._retired_pids.add(tgt.pid)
        self._publish()

    def _leave_out(self, tgt: Target):
        """--python-only: a process found without an interpreter was never
        taken (nor registered, see discover): no trace of it stays."""
        self._release(tgt)
        if self.by_pid.get(tgt.pid) is tgt:
            del self.by_pid[tgt.pid]
        for facts in (self.rec.comms, self.rec.cmdlines, self.rec.spaces, self.rec.ns_ids):
            facts.pop(tgt.pid, None)
        self.left_out += 1

    def _release(self, tgt: Target):
        """What user space holds for a target: its memory and its tables."""
        tgt.retired = tgt.exited = True
        if tgt.mem is not None:
            tgt.mem.close()
            tgt.mem = None
        if self.unwinder is not None:
            self.unwinder.forget(tgt.pid)

    # -- -a: finding the processes -------------------------------------------------
    def scan(self):
        """At the start: every process the selection takes."""
        for name in os.listdir("/proc"):
            if name.isdigit():
                self.discover(int(name))

    def discover(self, pid: int) -> Optional[Target]:
        """A process met by -a (at the start, at its exec, in the samples):
        taken if the selection wants it; kernel threads too, natively.  It
        may be starting (met at its exec, at its first sample, or by the
        scan at the start): its interpreter is looked for again while it
        may become Python (a launched command's rule)."""
        if pid in (0, self.self_pid) or pid in self.by_pid or self.select is None:
            return None
        if not self.select.wants(pid):
            return None
        tgt = Target(pid, launched=True)
        if not tgt.start_ticks:
            return None                 # gone already
        tgt.epoch = self.new_epoch()
        self.by_pid[pid] = tgt
        self.snapshot(tgt)
        self.find_python(tgt)
        if pid not in self.by_pid:
            return None                 # --python-only, and it is not
        if tgt.python is None or tgt.reader is None:
            if not self.select.python_only:
                self.register(tgt)      # native stacks (--python-only: once it is Python)
        elif self.unwinder is not None:
            self.snapshot(tgt, force=True)      # now with its unwind tables
        return tgt

    def _discover_sampled(self):
        """-a without filters: BPF counts the samples of processes it has no
        entry for; each is taken (and registered, which ends its count)."""
        for pid, n in self._unregistered().items():
            # a process not taken (gone, or left out) is tried again only
            # when it has new samples: it lives, or its PID is another's
            if pid not in self.by_pid and self._tried.get(pid) != n:
                self._tried[pid] = n
                self.discover(pid)

    def _pairs(self, name: str) -> Dict[int, int]:
        """A map of u32 -> u32/u64, read in a few batched syscalls (not two an
        entry) and unpacked without a ctypes object per entry."""
        table = self.bpf[name]
        vfmt = {4: "<I", 8: "<Q"}[ctypes.sizeof(table.Leaf)]
        out: Dict[int, int] = {}
        try:
            for kb, vb, _ in table.raw_lookup_batch():
                for (k,), (v,) in zip(struct.iter_unpack("<I", kb), struct.iter_unpack(vfmt, vb)):
                    out[k] = v
        except Exception:                               # noqa: BLE001 (no batch ops)
            out = {k.value: v.value for k, v in table.items()}
        return out

    def _unregistered(self) -> Dict[int, int]:
        return self._pairs("unregistered")

    def unregistered_samples(self) -> Dict[int, int]:
        """-a: per process, the samples taken before it was registered (native
        frames only: BPF did not know its interpreter yet)."""
        try:
            return self._unregistered()
        except KeyError:
            return {}

    def snapshot(self, tgt: Target, reload: bool = False, force: bool = False) -> bool:
        """Its mappings now (for symbols and unwind tables), name and command;
        whether they changed.  The same code and file lines of /proc/PID/maps
        as last time (symbols.code_and_file_lines): nothing is parsed (-a
        polls every process of the machine)."""
        pid = tgt.pid
        rec = self.rec
        raw = read_text(f"/proc/{pid}/maps")
        if raw is None:
            return False
        text = symbols.code_and_file_lines(raw)
        same = text == tgt.maps_text and tgt.maps is not None
        if same and not (reload or force):
            return False
        if not same:
            tgt.maps_text = text
            tgt.maps = symbols.parse_maps(text)
            space = rec.spaces.get(pid)
            if space is None:
                space = rec.spaces[pid] = symbols.AddressSpace(pid)
            space.add_snapshot(tgt.maps)
        maps = tgt.maps
        if self.unwinder is not None and self._tables_for(tgt):
            if reload:
                self.unwinder.reload(pid, maps)
            else:
                self.unwinder.update(pid, maps)
        if same and not reload:
            return True             # forced (now with its tables): its names are read already
        comm = read_text(f"/proc/{pid}/comm")
        if comm:
            rec.comms[pid] = comm.strip()
        inner = ns_id(f"/proc/{pid}/status", pid)
        if inner:
            rec.ns_ids[pid] = inner
        cmd = cmdline(pid)
        if cmd:
            rec.cmdlines[pid] = cmd
        return True

    def _tables_for(self, tgt: Target) -> bool:
        """Unwind tables for every -p / command target; under -a for the
        Python processes (their native frames interleave with the Python
        ones), the others walk by frame pointer: tables for every process
        of a machine cost seconds and hundreds of MiB."""
        return self.select is None or tgt.python is not None

    def close(self):
        for tgt in self:
            if tgt.mem is not None:
                tgt.mem.close()
