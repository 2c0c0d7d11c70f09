"""Targets: the life of each profiled process, from its registration to its end.

A `Target` is one process: its interpreter (once found), the memory reader
its code objects are read with, its BPF registration (`procs`: which frame
walker and which offsets) and its image epoch.  `Targets` holds them all and
keeps them true while the recording runs:

- detection: the interpreter of a process, looked for again while a
  launched command has not mapped it yet;
- exec (`sched_process_exec` bumps `exec_total` and `execs`): the process is
  a new image, walked natively until it is detected again, under a new epoch,
  so no stack of the old image is read with the new image's rules or back;
- its address space: /proc/PID/maps snapshots, for the symbolizer and the
  native unwinder's tables, taken again when BPF meets code in no known
  mapping and every half second;
- its end: a target whose process is gone is retired, and the recording
  ends when every target has.

The session owns BPF (compile, attach, drain) and the accounting; it asks
this stage for the targets and tells it when to look again (poll).
"""
from __future__ import annotations

import os
import time
from typing import Callable, Dict, Iterator, List, Optional

from . import bpfdefs, symbols
from .cpython import detect
from .cpython.code import CodeReader
from .memory import MemoryError_, ProcessMemory
from .procfs import ns_id, process_alive, read_text

SNAPSHOT_S = 0.5                # maps, comm and liveness of every target read again
LAUNCH_WAIT_S = 3.0             # a launched command's time to map its interpreter
MISSED_S = 0.2                  # BPF met an unknown pc: maps read again at most this often


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
        self.epoch = 0                  # execs seen (proc_info.epoch)

    def forget_image(self):
        """The process is another program now (exec): nothing of the old one holds."""
        if self.mem is not None:
            self.mem.close()
        self.python = self.reader = self.mem = None
        self.settled = False
        self.launched = True            # give the new image time to map its interpreter
        self.first_seen = time.monotonic()


class Targets:
    def __init__(self, bpf, rec, unwinder, write_targets: Callable[[List[int]], None]):
        """bpf: the loaded programs; rec: the Recording (interpreters, address
        spaces, names and notices go there); unwinder: the native unwinder or
        None; write_targets(pids): puts the target list into BPF's control."""
        self.bpf = bpf
        self.rec = rec
        self.unwinder = unwinder
        self._write_targets = write_targets
        self.by_pid: Dict[int, Target] = {}
        self._execs: Dict[int, int] = {}
        self._exec_total = None             # (fd, key, leaf) of exec_total, made at first use
        self._exec_total_seen = 0
        self._last_snapshot = time.monotonic()

    # -- the collection --------------------------------------------------------
    def get(self, pid: int) -> Optional[Target]:
        return self.by_pid.get(pid)

    def __contains__(self, pid: int) -> bool:
        return pid in self.by_pid

    def __iter__(self) -> Iterator[Target]:
        return iter(list(self.by_pid.values()))

    def __len__(self) -> int:
        return len(self.by_pid)

    # -- coming in ---------------------------------------------------------------
    def add(self, pid: int) -> Target:
        """A running process (-p): its maps and interpreter now."""
        tgt = self.by_pid[pid] = Target(pid)
        self.snapshot(tgt)
        self.find_python(tgt)           # registers with Python frames when found
        if not tgt.settled or tgt.python is None or tgt.reader is None:
            self.register(tgt)          # native stacks meanwhile
        return tgt

    def add_launched(self, pid: int) -> Target:
        """A command forked but not yet exec'd (--): registered before its first
        instruction; its interpreter is looked for once it runs (started)."""
        tgt = self.by_pid[pid] = Target(pid, launched=True)
        self.register(tgt)
        return tgt

    def started(self, tgt: Target):
        """The launched command is running its own image now."""
        self.snapshot(tgt)
        self.find_python(tgt)

    def register(self, tgt: Target):
        """Its entry in `procs`: the walker and offsets of its interpreter, or
        none (native stacks only); and the target list in control."""
        table = self.bpf["procs"]
        info = table.Leaf()
        for name, _ in info._fields_:
            setattr(info, name, -1)
        info.walker = bpfdefs.WALK_NONE
        info.epoch = tgt.epoch
        py = tgt.python
        if py is not None and py.tss_key >= 0:
            o = py.offsets
            info.walker = detect.walker_kind(py.minor)
            info.tss_key = py.tss_key
            info.pthread_specific = py.thread_layout.specific_1stblock
            for name in ("tstate_frame", "tstate_cframe", "cframe_current_frame",
                         "tstate_current_frame", "frame_back", "frame_code", "frame_lasti",
                         "iframe_code", "iframe_previous", "iframe_instr", "iframe_is_entry",
                         "iframe_owner", "code_code_adaptive"):
                setattr(info, name, o[name])
        table[table.Key(tgt.pid)] = info
        self._write_targets(sorted(self.by_pid))

    def list_threads(self):
        """Every thread of the targets gets its entry in `threads` before the
        start (BPF keeps their exact times); sched_process_fork adds the ones
        started from now on.  Entries BPF made already are kept."""
        from .bpfload import BPF_NOEXIST, update_elem
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
            elif tgt.python.tss_key == -2:
                tgt.settled = True
                self.rec.notices.extend(tgt.python.notices)
        except detect.Unsupported as e:
            tgt.settled = True
            self.rec.notices.append(f"process {pid}: {e}; profiling native stacks only")
        except (detect.NotPython, MemoryError_, OSError):
            waited = time.monotonic() - tgt.first_seen
            if not tgt.launched or waited > LAUNCH_WAIT_S or not process_alive(pid):
                tgt.settled = True
                comm = (read_text(f"/proc/{pid}/comm") or "?").strip()
                self.rec.notices.append(
                    f"process {pid} ({comm}) is not a Python process: profiling native stacks only")

    def check_execs(self):
        """A target that called exec is a new image: BPF walks it natively
        until it is detected and registered again, under a new epoch.  This
        polls one array element; the execs map (a hash map, whose iteration
        walks every bucket) is read only when it changed."""
        from .bpfload import lookup_elem
        total = self._exec_total
        if total is None:
            table = self.bpf["exec_total"]
            total = self._exec_total = (table.map_fd, table.Key(0), table.Leaf())
        fd, key, leaf = total
        lookup_elem(fd, key, leaf)
        if leaf.value == self._exec_total_seen:
            return
        self._exec_total_seen = leaf.value
        for k, v in self.bpf["execs"].items():
            pid, n = k.value, v.value
            if self._execs.get(pid, 0) == n:
                continue
            self._execs[pid] = n
            tgt = self.by_pid.get(pid)
            if tgt is None:
                continue
            tgt.epoch = n
            tgt.forget_image()
            self.register(tgt)
            self.snapshot(tgt, reload=True)
            self.find_python(tgt)

    def poll(self, now: float):
        """The main loop's turn: execs, interpreters still to find, mappings
        BPF could not place; every SNAPSHOT_S the maps and liveness of all."""
        self.check_execs()
        for tgt in self:
            if not tgt.settled:
                self.find_python(tgt)
        if self.unwinder is not None:
            # native stacks reached code in no known mapping: a library was
            # just loaded (or the command just started): look again
            for pid in self.unwinder.missed(MISSED_S):
                tgt = self.by_pid.get(pid)
                if tgt is not None and not tgt.exited:
                    self.snapshot(tgt)
        if now - self._last_snapshot >= SNAPSHOT_S:
            self._last_snapshot = now
            for tgt in self:
                if tgt.exited:
                    continue
                if process_alive(tgt.pid):
                    self.snapshot(tgt)
                else:
                    tgt.exited = True

    def all_exited(self) -> bool:
        return bool(self.by_pid) and all(t.exited for t in self)

    def snapshot(self, tgt: Target, reload: bool = False):
        """Its mappings now (for symbols and unwind tables), name and command."""
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
            if reload:
                self.unwinder.reload(pid, maps)
            else:
                self.unwinder.update(pid, maps)
        comm = read_text(f"/proc/{pid}/comm")
        if comm:
            rec.comms[pid] = comm.strip()
        inner = ns_id(f"/proc/{pid}/status", pid)
        if inner:
            rec.ns_ids[pid] = inner
        cmd = read_text(f"/proc/{pid}/cmdline")
        if cmd:
            rec.cmdlines[pid] = cmd.replace("\0", " ").strip()

    def close(self):
        for tgt in self:
            if tgt.mem is not None:
                tgt.mem.close()
