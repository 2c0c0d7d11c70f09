"""Which processes `pyoffcpu crashes` watches (commands/crashes.py reports
their crashes): a scan of /proc every --rescan seconds, the backstop for
what ran before the start; and each process born since (an exec, or a fork
of a registered process: bpf/crashes.bpf.c's births), read at once, and
again while its interpreter is still starting, so a crash 0.2 s after a
start, or at an import, has its Python frames.

A Python process is described (cpython/detect.py) and registered so BPF
walks its frames; each keeps a copy of its mappings, read again when its
code changes (VmExe, VmLib: a library loaded), because a process that dies
without a core is gone before user space hears of it.  A program file
found not to be Python is told BPF (exe_kinds), which then tells nothing of
its execs: a shell's loop of tools costs a map lookup each.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ..kernel import bpfdefs
from ..kernel.procfs import cmdline, comm, read_text, uid_of

CR_BIRTH_FORK = bpfdefs.value("CR_BIRTH_FORK")
GONE_KEPT_S = 30.0              # what a scan knew of a process gone: kept for its late capture
# A process born (exec, fork) is read at once and, while its interpreter is
# still starting (libpython not mapped, no thread state bound), again this
# long after its birth: an interpreter starts in 10-30 ms
BIRTH_RETRY_S = (0.0, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
MAX_FORKS_KEPT = 16384          # forks remembered (GONE_KEPT_S each) for a crash before a scan
MAX_EXES_KEPT = 4096            # program files classified (bpf: exe_kinds)


@dataclass
class Watched:
    pid: int
    ident: tuple                # what changes when the process execs
    name: str
    cmdline: str
    pp: object = None           # its PythonProcess (None: native only)
    maps: list = field(default_factory=list)
    maps_time: float = 0.0
    root: Optional[str] = None  # its root directory when not ours (a chroot)
    registered: bool = False    # in BPF's procs (its Python frames are walked)
    libs: Optional[Tuple[int, int]] = None  # _code_sizes when maps were read
    checked: float = 0.0        # when a scan last found them the same
    execs: int = 0              # its execs (BPF's count) when it was first seen


def _ident(pid: int) -> Optional[tuple]:
    """(executable, start time, stack start) of a process: a new value after
    an exec (the stack is placed anew) or a reused PID."""
    from ..kernel.procfs import stat_fields
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None                 # a kernel thread, or gone
    f = stat_fields(f"/proc/{pid}/stat")
    try:
        return exe, f[19], f[25]    # starttime (22), startstack (28)
    except IndexError:
        return None


def _code_sizes(pid: int) -> Optional[Tuple[int, int]]:
    """(VmExe, VmLib) in kB: the process's executable file mappings (its
    program's, the libraries'); a library loaded or unloaded changes them.
    Read at each scan instead of the maps (a few hundred bytes, not the
    thousands of lines of a large process's maps)."""
    sizes = {}
    for line in (read_text(f"/proc/{pid}/status") or "").splitlines():
        if line.startswith(("VmExe:", "VmLib:")):
            try:
                sizes[line[:5]] = int(line.split()[1])
            except (IndexError, ValueError):
                return None
    return (sizes["VmExe"], sizes["VmLib"]) if len(sizes) == 2 else None


class ProcessWatch:
    """The watched processes (known), the ones found not selected
    (ignored), and the ones born lately (see the module's doc).  opts: the
    CrashOptions; cap: the CrashCapture; log(line, level=1)."""

    def __init__(self, opts, capture, log: Callable[..., None]):
        self.opts, self.cap, self.log = opts, capture, log
        self.known: Dict[int, Watched] = {}
        self.ignored: Dict[int, tuple] = {}
        self.self_pid = os.getpid()
        self.match = re.compile(opts.match) if opts.match else None
        self.gone: Dict[int, tuple] = {}    # pid -> (Watched, when a scan found it gone)
        self.newborn: Dict[int, tuple] = {}  # pid -> (its exec's time, looks so far)
        self.forks: Dict[int, tuple] = {}    # child -> (parent, when its birth was read)
        self.exe_kinds: Dict[tuple, bool] = {}  # Birth.exe -> may it be Python (told BPF)
        self._changed = False               # the watched set changed: BPF's filter to update
        self._new: List[Watched] = []       # watched since the last _settle, to be said

    # -- which processes ------------------------------------------------------------------------
    def scan(self) -> None:
        """Every process in /proc looked at: the backstop for what ran
        before the start and what a lost birth left unseen."""
        try:
            pids = {int(d) for d in os.listdir("/proc") if d.isdigit()}
        except OSError:
            return
        for pid in [p for p in self.known if p not in pids]:
            self._forget(pid)
        for pid in [p for p in self.ignored if p not in pids]:
            del self.ignored[pid]
        for pid in sorted(pids):
            self._consider(pid)
        self._settle()
        self.log(f"scanned /proc: {len(self.known)} processes watched", level=2)

    def births(self, births) -> None:
        """Processes born since the last look (BPF's births, Birth).  An
        exec'd image is read at once, then again BIRTH_RETRY_S after its
        exec while its interpreter is still starting, instead of at the
        next scan; its program file is told BPF (_classify).  A fork of a
        registered process is a copy of its parent (BPF gave it the
        parent's registration): nothing is read, its parent is remembered
        for its crash (_fork_parent), and a scan reads it if it lives on;
        a fork of one still starting is read as an exec is."""
        now = time.monotonic()
        self.forks = {c: f for c, f in self.forks.items() if now - f[1] < GONE_KEPT_S}
        for b in births:
            if b.pid == self.self_pid:
                continue
            if b.kind == CR_BIRTH_FORK:
                if len(self.forks) < MAX_FORKS_KEPT:
                    self.forks[b.pid] = (b.parent, now)
                parent = self.known.get(b.parent)
                if parent is not None and (parent.registered or parent.pp is None):
                    continue            # a copy of what is known: nothing to read
                # its parent's interpreter was still starting: read the child too
            self.newborn[b.pid] = (min(b.ns / 1e9, now), 0)
            self.ignored.pop(b.pid, None)   # an image not selected may exec one that is
            if b.kind != CR_BIRTH_FORK and b.exe not in self.exe_kinds:
                self._classify(b)
        self.read_newborn(now)

    def _classify(self, b) -> None:
        """The program file of an exec, told BPF once: one that cannot be
        Python is not told of again (its execs cost BPF a lookup).  Read
        through the process while it still runs that file."""
        from ..cpython import detect
        try:
            st = os.stat(f"/proc/{b.pid}/exe")
        except OSError:
            return                      # gone, or exec'd again: its next exec tells
        if ((os.major(st.st_dev) << 20) | os.minor(st.st_dev), st.st_ino) != b.exe[:2]:
            return
        python = detect.may_become_python(b.pid)
        if len(self.exe_kinds) >= MAX_EXES_KEPT:
            self.exe_kinds.clear()      # BPF's map is an LRU: this only forgets what was told
        self.exe_kinds[b.exe] = python
        self.cap.set_exe_kind(b.exe, python)

    def read_newborn(self, now: float) -> None:
        """The newborn processes whose next look is due: each read, and
        kept for another look while it may still become a registered
        Python process."""
        for pid, (born, tries) in list(self.newborn.items()):
            if now < born + BIRTH_RETRY_S[tries]:
                continue
            done = self._consider(pid, newborn=True)
            tries += 1
            while tries < len(BIRTH_RETRY_S) and born + BIRTH_RETRY_S[tries] <= now:
                tries += 1              # looks that are past already: the next one to come
            if done or tries == len(BIRTH_RETRY_S):
                self.log(f"process {pid}: {'read' if done else 'given up'} "
                         f"{1e3 * (time.monotonic() - born):.1f} ms after its exec", level=2)
                del self.newborn[pid]
                if not done:
                    self.ignored[pid] = _ident(pid)
                    self.cap.unwatch_new(pid)
            else:
                self.newborn[pid] = (born, tries)
        self._settle()

    def next_look(self) -> Optional[float]:
        """When the next newborn is due a look (None: none waits)."""
        return min((born + BIRTH_RETRY_S[tries] for born, tries in self.newborn.values()), default=None)

    def _settle(self) -> None:
        """BPF's filter updated to what was found, and each new process said."""
        if self._changed:
            self._filter()
            self._changed = False
        for w in self._new:             # said once BPF captures its crashes
            self.log(f"watching process {w.pid} ({w.name}" +
                     (f", CPython {w.pp.version_str}" if w.pp is not None else ", native") + ")")
        self._new = []

    def _consider(self, pid: int, newborn: bool = False) -> bool:
        """One process looked at: watched (registered when it is Python),
        ignored, or left for a later look.  True when nothing is left to
        do for it; False when a later look may find more: a Python process
        whose thread state is not bound yet, and (newborn) one that may
        still become Python, its libpython not mapped yet."""
        from ..cpython import detect
        if pid == self.self_pid:
            return True
        ident = _ident(pid)
        if ident is None:
            return True                 # gone, or a kernel thread
        w = self.known.get(pid)
        if w is not None and w.ident == ident and self.cap.execs(pid) == w.execs:
            if w.pp is not None and not w.registered:
                self._changed |= self._register(w)
            libs = _code_sizes(pid)
            w.checked = time.monotonic()
            if libs != w.libs:
                self.log(f"process {pid}: its code mappings changed (VmExe, VmLib {w.libs} -> "
                         f"{libs} kB): mappings read again")
                self._snapshot_maps(w)
            return w.pp is None or w.registered
        if self.ignored.get(pid) == ident and not newborn:
            return True
        if w is not None:
            self._forget(pid)           # exec'd: another image
            self._changed = True
        if not self._selected(pid):
            self._ignore(pid, ident)
            return True
        pp = None
        may_be_python = detect.may_become_python(pid)
        if may_be_python:
            try:
                pp = detect.find_python(pid)
            except (detect.NotPython, detect.Unsupported, OSError) as e:
                if isinstance(e, detect.Unsupported):
                    self.log(f"process {pid}: {e}: native stacks only")
                    may_be_python = False
            except Exception as e:                  # noqa: BLE001 - a torn read of a starting process
                self.log(f"process {pid}: {type(e).__name__}: {e}")
        if pp is None and newborn and may_be_python:
            return False                # its libpython is not mapped yet: a later look
        if pp is None and not self.opts.all:
            self._ignore(pid, ident)
            return True
        w = Watched(pid, ident, comm(pid), cmdline(pid)[:200], pp, execs=self.cap.execs(pid))
        self._snapshot_maps(w)
        self.known[pid] = w
        self._changed = True
        if pp is not None:
            self._register(w)
        self._new.append(w)
        return pp is None or w.registered

    def _ignore(self, pid: int, ident: tuple) -> None:
        self.ignored[pid] = ident
        self.cap.unwatch_new(pid)

    def _selected(self, pid: int) -> bool:
        if self.opts.uid is not None and uid_of(pid) != self.opts.uid:
            return False
        if self.match is not None:
            return bool(self.match.search(comm(pid)) or self.match.search(cmdline(pid)))
        return True

    def _register(self, w: Watched) -> bool:
        """Its frames walked by BPF once its thread-state binding is known."""
        from ..cpython import detect
        if not w.pp.tstate_found and not detect.refresh_tss(w.pp):
            return False
        self.cap.register_python(w.pid, w.pp)
        # BPF drops a registration at exec and exit: one that raced with
        # either describes another image, and goes (the next scan starts over)
        if _ident(w.pid) != w.ident or self.cap.execs(w.pid) != w.execs:
            self.cap.unregister(w.pid)
            self.known.pop(w.pid, None)
            return False
        w.registered = True
        return True

    def _forget(self, pid: int) -> None:
        w = self.known.pop(pid, None)
        if w is not None and w.registered:
            self.cap.unregister(pid)
        if w is not None:
            # a crash read after the scan that found its process gone (a
            # storm's captures wait in the buffer) still has its maps and
            # interpreter; the capture's start and exec count tell a reused PID
            now = time.monotonic()
            self.gone = {p: g for p, g in self.gone.items() if now - g[1] < GONE_KEPT_S}
            self.gone[pid] = (w, now)

    def _watched(self, pid: int):
        """What a scan knew of pid: watched now, or gone lately."""
        w = self.known.get(pid)
        if w is None and pid in self.gone:
            w = self.gone[pid][0]
        return w

    def _filter(self) -> None:
        """BPF captures only the watched processes (every one with -a and no
        --match/--uid: then no lookup at all)."""
        everything = self.opts.all and self.match is None and self.opts.uid is None
        self.cap.set_filter(uid=self.opts.uid, pids=None if everything else sorted(self.known))

    def _snapshot_maps(self, w: Watched) -> None:
        """Its mappings now, and the sizes of its code that tell when to read
        them again (a library loaded: VmLib grows)."""
        from ..native import symbols
        libs = _code_sizes(w.pid)
        try:
            w.maps = symbols.read_maps(w.pid)
            w.root = symbols.target_root(w.pid)
        except OSError:
            return
        w.libs = libs
        w.maps_time = w.checked = time.monotonic()

    def _fork_parent(self, ev, notes: List[str]):
        """A process that crashed before the watcher read it, forked by one
        it knows and not exec'd since: a copy of its parent's image (BPF
        gave it the parent's registration at the fork), read with the
        parent's mappings and interpreter."""
        parent = self.forks.get(ev.pid, (0,))[0]
        w = self._watched(parent) if parent and ev.execs == 0 else None
        if w is not None:
            notes.append(f"a fork of process {parent}, crashed before the watcher read it: "
                         "read with its parent's mappings and interpreter")
        return w
