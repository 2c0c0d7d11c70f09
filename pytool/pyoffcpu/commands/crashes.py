"""`pyoffcpu crashes`: a watcher, left on, that catches the crash of any
Python process (or of every process with -a) as it happens.

BPF (collect/crashcapture.py, bpf/crashes.bpf.c) runs at each signal
delivery and, for a fatal one (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) to
a watched process, copies in the receiving thread what its stacks need once
the process is gone: registers, the top of its stack, its kernel stack,
its Python frames and the code objects they name.  Here:

- which processes are watched: a scan of /proc every --rescan seconds
  finds new ones (and images replaced by exec); a Python one is described
  (cpython/detect.py) and registered so BPF walks its frames; each keeps a
  copy of its mappings, read again when a scan sees its code change (VmExe,
  VmLib: a library loaded), because a process that dies without a core is
  gone before user space hears of it (the copy taken at the crash, when
  /proc still has it, wins);
- each capture becomes `dump`'s report (commands/postmortem.py: the same
  walkers, tables and labels as live stacks), written as text and JSON to
  `DIR/<host>/<YYYY-mm-dd>/<HHMMSS>-<pid>-<name>.crash.{txt,json}` under
  the snapshot directory's rules (commands/snapshot.py: a directory of
  root's, one writer holding DIR/.lock, an index of what was written, and
  the retention deleting only what the index lists), and one line on
  stdout: the journal's, under systemd.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ..kernel import bpfdefs
from ..collect.platform import ProfilerError
from ..failures import failure_text
from . import postmortem as PM
from ..kernel.procfs import cmdline, comm, read_text, uid_of
from . import snapshot as S

V = bpfdefs.value
CRF = bpfdefs.with_prefix("CRF_")
DEFAULT_DIR = "/var/lib/pyoffcpu/crashes"
HANDLED_AFTER_S = 10.0          # a process that runs on this long after its handler ran: handled
GONE_KEPT_S = 30.0              # what a scan knew of a process gone: kept for its late capture
GONE_GRACE_S = 2.0              # a held capture of a process gone: its default delivery may still come
EXTENSIONS = {"txt": ".crash.txt", "json": ".crash.json"}
LINE_FRAMES = 4                 # native frames named on the journal line


@dataclass
class CrashOptions:
    dir: str = DEFAULT_DIR
    all: bool = False           # every process (native stacks for the ones not Python)
    match: Optional[str] = None
    uid: Optional[int] = None
    keep_days: Optional[float] = 30.0
    max_total_mb: Optional[float] = 512.0
    rescan_s: float = 2.0
    count: Optional[int] = None         # stop after this many crashes (tests, one-shot use)
    duration: Optional[float] = None    # stop after this many seconds
    verbose: int = 0            # 1: which processes are watched; 2: every scan too
    host: str = field(default_factory=socket.gethostname)


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


LOST_RATE = f"over the budget of {V('CR_PER_UID_S')} captures a user a second (a storm)"
LOST_BUFFER = "no room in the perf buffer (a burst of crashes)"
LOST_FAILED = "its report failed"


class Watcher:
    """The scan, the captures and the reports (run() below drives them)."""

    def __init__(self, opts: CrashOptions, capture, say: Callable[[str], None],
                 log: Callable[..., None]):
        self.opts, self.cap, self.say, self.log = opts, capture, say, log
        self.known: Dict[int, Watched] = {}
        self.ignored: Dict[int, tuple] = {}
        self.self_pid = os.getpid()
        self.match = re.compile(opts.match) if opts.match else None
        self._ksyms = None
        self.crashes = 0
        self.held: Dict[int, tuple] = {}    # pid -> (capture, when): delivered to a handler
        self.said: Dict[Tuple[str, int], int] = {}  # (reason, uid) -> crashes said to be lost so far
        self.gone: Dict[int, tuple] = {}    # pid -> (Watched, when a scan found it gone)

    # -- which processes ------------------------------------------------------------------------
    def scan(self) -> None:
        from ..cpython import detect
        try:
            pids = {int(d) for d in os.listdir("/proc") if d.isdigit()}
        except OSError:
            return
        for pid in [p for p in self.known if p not in pids]:
            self._forget(pid)
        for pid in [p for p in self.ignored if p not in pids]:
            del self.ignored[pid]
        changed = False
        new: List[Watched] = []
        for pid in sorted(pids):
            if pid == self.self_pid:
                continue
            ident = _ident(pid)
            if ident is None:
                continue
            w = self.known.get(pid)
            if w is not None and w.ident == ident and self.cap.execs(pid) == w.execs:
                if w.pp is not None and not w.registered:
                    changed |= self._register(w)
                libs = _code_sizes(pid)
                w.checked = time.monotonic()
                if libs != w.libs:
                    self.log(f"process {pid}: its code mappings changed (VmExe, VmLib {w.libs} -> "
                             f"{libs} kB): mappings read again")
                    self._snapshot_maps(w)
                continue
            if self.ignored.get(pid) == ident:
                continue
            if w is not None:
                self._forget(pid)           # exec'd: another image
            if not self._selected(pid):
                self.ignored[pid] = ident
                continue
            pp = None
            if detect.may_become_python(pid):
                try:
                    pp = detect.find_python(pid)
                except (detect.NotPython, detect.Unsupported, OSError) as e:
                    if isinstance(e, detect.Unsupported):
                        self.log(f"process {pid}: {e}: native stacks only")
                except Exception as e:                  # noqa: BLE001 - a torn read of a starting process
                    self.log(f"process {pid}: {type(e).__name__}: {e}")
            if pp is None and not self.opts.all:
                self.ignored[pid] = ident
                continue
            w = Watched(pid, ident, comm(pid), cmdline(pid)[:200], pp, execs=self.cap.execs(pid))
            self._snapshot_maps(w)
            self.known[pid] = w
            changed = True
            if pp is not None:
                self._register(w)
            new.append(w)
        if changed:
            self._filter()
        for w in new:           # said once BPF captures its crashes
            self.log(f"watching process {w.pid} ({w.name}" +
                     (f", CPython {w.pp.version_str}" if w.pp is not None else ", native") + ")")
        self.log(f"scanned /proc: {len(self.known)} processes watched", level=2)

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

    # -- a crash --------------------------------------------------------------------------------------
    def handle(self, ev) -> Optional[dict]:
        """A capture: its report written (its index entry), or held while a
        handler of the process's own runs.

        A signal delivered to a handler (faulthandler, a crash reporter)
        may end the process or not.  Its capture is the fault's own moment,
        kept until the process shows what it does: a default delivery that
        follows (faulthandler re-raises the signal once it has printed)
        ends it, and the report is the first capture's; a process that
        exits meanwhile, too (expire()); one still running HANDLED_AFTER_S
        later handled it, and nothing is written."""
        if ev.handler != 0:
            if ev.pid not in self.held:
                self.held[ev.pid] = (ev, time.monotonic())
            return None
        first = self.held.pop(ev.pid, None)
        notes = []
        if first is not None:
            notes.append(f"a handler of its own ran first ({PM.signal_name(first[0].sig)} "
                         f"handler at {first[0].handler:#x}, faulthandler's?), then "
                         f"{PM.signal_name(ev.sig)} ended it: this is the first delivery's moment")
            ev = first[0]
        return self._report(ev, notes)

    def expire(self) -> None:
        """Held captures: a process gone reports its own, one still running
        after HANDLED_AFTER_S handled its signal."""
        now = time.monotonic()
        for pid, (ev, t) in list(self.held.items()):
            w = self.known.get(pid)
            gone = _ident(pid) is None or (w is not None and _ident(pid) != w.ident)
            # a process the handler's raise ended is gone before that capture
            # is read: it is given GONE_GRACE_S to come (handle() takes it)
            if gone and now - t > GONE_GRACE_S:
                del self.held[pid]
                self._report(ev, [f"its {PM.signal_name(ev.sig)} went to a handler of its own "
                                  f"(at {ev.handler:#x}), and the process ended"])
            elif now - t > HANDLED_AFTER_S:
                del self.held[pid]
                self.log(f"process {pid}: {PM.signal_name(ev.sig)} handled by its own handler; "
                         "it runs on: no report")

    # -- what was not reported -------------------------------------------------------------------------
    def account(self) -> None:
        """Crashes BPF saw and could not capture since the last look: said
        (stdout) and kept in the index, by reason and user."""
        try:
            by_uid = self.cap.losses_by_uid()
        except Exception as e:                          # noqa: BLE001 - counts are extra
            self.log(f"the crash counts cannot be read: {e}")
            return
        for uid, (rate, lost) in sorted(by_uid.items()):
            for reason, total in ((LOST_RATE, rate), (LOST_BUFFER, lost)):
                new = total - self.said.get((reason, uid), 0)
                if new > 0:
                    self.said[(reason, uid)] = total
                    self.count_lost(reason, new, uid)

    def count_lost(self, reason: str, n: int, uid: Optional[int] = None) -> None:
        who = f" of user {uid}" if uid is not None else ""
        self.say(f"crash: {_crashes(n)}{who} not reported: {reason}")
        try:
            index = S.load_index(self.opts.dir)
            lost = [r for r in index.get("not_reported", []) if isinstance(r, dict)]
            if self.opts.keep_days is not None:
                lost = [r for r in lost if r.get("time", 0) >= time.time() - self.opts.keep_days * 86400]
            lost.append({"time": time.time(), "reason": reason, "uid": uid, "count": n})
            index["not_reported"] = lost[-1000:]
            S.save_index(self.opts.dir, index)
        except (OSError, ProfilerError) as e:
            self.log(f"the index cannot keep the count: {getattr(e, 'what', None) or e}")

    def _report(self, ev, notes: List[str]) -> Optional[dict]:
        try:
            d = self.report(ev, notes)
        except Exception as e:                          # noqa: BLE001 - one bad report never ends the watch
            d = self._bare_report(ev, notes, e)
        entry = self._write(ev, d)
        self.crashes += 1
        return entry

    def report(self, ev, notes: Optional[List[str]] = None):
        from ..collect.crashcapture import CapturedMemory
        from ..native.unwind.walk import snapshot_reader
        w = self._watched(ev.pid)
        notes = list(notes or [])
        if w is not None and (ev.start_ticks != int(w.ident[1]) or ev.execs != w.execs):
            # what the last scan saw under this PID is another image: its maps,
            # its interpreter are not this one's (BPF walked no Python frames)
            notes.append("it exec'd, or its PID was reused, after the last scan")
            w = None
        maps = w.maps if w is not None else []
        fresh = _maps_now(ev.pid, w.ident) if w is not None else None
        if fresh:
            maps = _merge_maps(w.maps, fresh)
        if w is None:
            notes.append("not seen by a scan before it crashed: no mappings, native frames not named")
        elif not fresh and time.monotonic() - w.maps_time > 0.5:
            notes.append("mappings as checked %.1f s before the crash (a library loaded after "
                         "that is not named)" % (time.monotonic() - w.checked))
        notes.extend(ev.flag_notes())
        if not ev.complete and not ev.flags & CRF["PART_LOST"]:
            notes.append("part of the capture was lost (the perf buffer was full)")
        sp = ev.thread.regs.get("sp", 0)
        t = PM.DeadThread(ev.tid, ev.thread.regs, ev.comm,
                          stack_reader=snapshot_reader(sp, ev.thread.stack) if ev.thread.stack else None,
                          python=ev.thread.python, kernel=self._kernel_names(ev.thread.kernel))
        others = [PM.DeadThread(o.tid, o.regs, "", python=o.python) for o in ev.others]
        fatal = _fatal(ev)
        pp = w.pp if w is not None and w.registered else None
        why = ""
        if w is not None and w.pp is not None and not w.registered:
            why = "its Python frames: CPython had not bound a thread state when it crashed"
        elif w is None:
            why = "no Python frames: the watcher had not registered it"
        elif pp is None:
            why = "not a CPython process: native frames only"
        name = w.name if w is not None else ev.comm
        d = PM.build(ev.pid, name, _our_paths(maps, w.root if w else None), CapturedMemory(ev.memory),
                     [t] + others, fatal, pp, native=True, notes=tuple(notes), python_note=why)
        if pp is not None:
            d.notes.extend(pp.notices)
        d.fatal = fatal.as_dict()
        return d

    def _bare_report(self, ev, notes: List[str], e: Exception):
        """What was captured of a crash whose report failed, and why."""
        failure = failure_text(e)
        self.log(f"process {ev.pid}: its report could not be built in full: {failure}")
        try:
            kernel = self._kernel_names(ev.thread.kernel)
        except Exception:                               # noqa: BLE001
            kernel = [f"{a:#x}" for a in ev.thread.kernel]
        fatal = _fatal(ev)
        threads = [PM.DeadThread(ev.tid, ev.thread.regs, ev.comm, kernel=kernel)]
        d = PM.bare(ev.pid, ev.comm, threads, fatal, failure, tuple(notes))
        d.fatal = fatal.as_dict()
        return d

    def _kernel_names(self, addrs: List[int]) -> List[str]:
        from ..native.symbols import KernelSymbols
        if not addrs:
            return []
        if self._ksyms is None:
            try:
                self._ksyms = KernelSymbols.load()
            except OSError:
                self._ksyms = KernelSymbols([])
        names = [self._ksyms.resolve(a) or f"{a:#x}" for a in addrs]
        # the capture's own frames (the BPF program, the tracepoint's runner) first
        for i, n in enumerate(names):
            if n.startswith("bpf_trace_run") or n.startswith("__bpf_trace_"):
                return names[i + 1:]
        return names

    def _write(self, ev, d) -> Optional[dict]:
        from ..commands.dump import render_text
        from ..export import write_bytes_atomic
        o = self.opts
        stamp = time.localtime()
        day = os.path.join(o.host, time.strftime("%Y-%m-%d", stamp))
        base = f"{time.strftime('%H%M%S', stamp)}-{ev.pid}-{S._safe(d.name)}"
        files, errors = {}, []
        try:
            S.make_day_dirs(o.dir, day)
            # two crashes of one PID within a second (a reused PID): both kept
            n = 1
            while any(os.path.lexists(os.path.join(o.dir, day, base + ext)) for ext in EXTENSIONS.values()):
                n += 1
                base = f"{time.strftime('%H%M%S', stamp)}-{ev.pid}-{S._safe(d.name)}-{n}"
            for fmt, data in (("txt", render_text(d) + "\n"),
                              ("json", json.dumps(d.as_dict(), indent=1) + "\n")):
                rel = os.path.join(day, base + EXTENSIONS[fmt])
                raw = data.encode("utf-8", "replace")
                write_bytes_atomic(os.path.join(o.dir, rel), raw)
                inode = os.stat(os.path.join(o.dir, rel), follow_symlinks=False).st_ino
                files[fmt] = {"path": rel, "bytes": len(raw), "inode": inode}
        except (OSError, ProfilerError) as e:
            errors.append(f"cannot write the report: {getattr(e, 'what', None) or e}")
        w = self._watched(ev.pid)
        entry = {"time": time.time(), "host": o.host, "pid": ev.pid, "name": d.name,
                 "cmdline": w.cmdline if w else "", "python": d.python, "mode": "crash",
                 "signal": d.fatal, "files": files, "notices": (d.notes + errors)[:10],
                 "threads": len(d.threads)}
        self.say(_journal_line(d, files.get("txt", {}).get("path"), o.dir) +
                 ("; " + errors[0] if errors else ""))
        if files:
            index = S.load_index(o.dir)
            index["entries"].append(entry)
            S.apply_retention(o.dir, index, o.keep_days, o.max_total_mb, time.time())
            S.save_index(o.dir, index)
        return entry


def _fatal(ev) -> PM.Fatal:
    """The signal of a capture: a fault's address, or who sent it."""
    fault = ev.si_code > 0 and ev.si_code != 0x80
    sender = None if fault else ev.addr & 0xFFFFFFFF     # si_pid, where si_addr lies
    return PM.Fatal(ev.tid, ev.sig, ev.si_code, ev.addr if fault else None, sender)


def _maps_now(pid: int, ident: tuple) -> Optional[list]:
    """The mappings of a process that is still there (a core being written
    keeps it), None when it is gone or another image."""
    from ..native import symbols
    try:
        maps = symbols.read_maps(pid)
    except OSError:
        return None
    return maps if _ident(pid) == ident else None


def _merge_maps(old: list, fresh: list) -> list:
    """The fresh mappings, and the old ones none of them overlaps: a process
    in its exit may show some of its mappings, or none, once its memory is
    being torn down; what it no longer shows is not thereby gone from the
    moment of the crash."""
    import bisect
    fresh = sorted(fresh, key=lambda m: m.start)
    starts = [m.start for m in fresh]
    out = list(fresh)
    for m in old:
        i = bisect.bisect_left(starts, m.end)
        if i == 0 or fresh[i - 1].end <= m.start:
            out.append(m)
    return sorted(out, key=lambda m: m.start)


def _our_paths(maps, root: Optional[str]):
    """The mappings with the paths we open their files by.  /proc/PID/maps
    names a chroot's files by our paths already (under its directory); a
    path of its own root is looked for under it.  A file that is no longer
    the one it mapped (its inode changed) keeps no path, and names no frame."""
    import dataclasses
    out = []
    for m in maps:
        if m.is_file:
            p = m.path
            if root and not root.startswith("/proc/") and not p.startswith(root.rstrip("/") + "/"):
                p = PM.host_path(p, root)
            try:
                same = os.stat(p).st_ino == m.inode
            except OSError:
                same = False
            m = dataclasses.replace(m, path=p) if same else dataclasses.replace(m, path="", inode=0)
        out.append(m)
    return out


def _journal_line(d, rel: Optional[str], directory: str) -> str:
    t = d.threads[0] if d.threads else None
    where = ""
    if t is not None and t.frames:
        py = next((f for f in t.frames if f.endswith(")") and " (" in f), None)
        where = " in " + " <- ".join(t.frames[:LINE_FRAMES])
        if py and py not in t.frames[:LINE_FRAMES]:
            where += f" ... {py}"
    f = d.fatal or {}
    what = f.get("signal", "?") + (f" at {f['address']:#x}" if f.get("address") is not None else "")
    out = f"crash: process {d.pid} ({d.name}) thread {f.get('tid')}: {what}{where}"
    return out + (f" -> {os.path.join(directory, rel)}" if rel else "")


def run(opts: CrashOptions, say: Callable[[str], None], log: Callable[..., None],
        note: Callable[[str], None]) -> int:
    """Watch until SIGINT/SIGTERM (or --count/--duration); 0, or raises
    ProfilerError / S.Locked.  say: a crash's line (stdout); log(line,
    level=1): what -v (-vv: level 2) tells; note: what is always told on
    stderr."""
    from ..collect.crashcapture import CrashCapture
    S.check_dir(opts.dir)
    stop = []

    def on_signal(signum, frame):
        stop.append(signum)
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with S.DirLock(opts.dir):
            cap = CrashCapture(uid=opts.uid, pids=[])
            try:
                w = Watcher(opts, cap, say, log)
                w.scan()
                n_py = sum(1 for x in w.known.values() if x.pp is not None)
                note(f"watching {len(w.known)} processes ({n_py} Python) for crashes; "
                     f"reports in {opts.dir}")
                start = time.monotonic()
                next_scan = start + opts.rescan_s      # the first scan was just made
                while not stop:
                    for ev in cap.poll(0.5):
                        try:
                            w.handle(ev)
                        except Exception as e:          # noqa: BLE001 - a crash's report, never the watch
                            note(f"process {ev.pid}: its crash could not be reported: {failure_text(e)}")
                            w.count_lost(LOST_FAILED, 1, ev.uid)
                    w.expire()
                    w.account()
                    if opts.count is not None and w.crashes >= opts.count:
                        break
                    now = time.monotonic()
                    if opts.duration is not None and now - start >= opts.duration:
                        break
                    if now >= next_scan:
                        w.scan()
                        next_scan = now + opts.rescan_s
            finally:
                cap.close()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 0


def systemd_unit(argv: List[str]) -> str:
    """pyoffcpu-crashes.service running this command (argv: the pyoffcpu
    executable and its crashes arguments): --print-service's and the
    Debian package's."""
    import shlex
    cmd = " ".join(shlex.quote(a) for a in argv)
    return f"""\
[Unit]
Description=pyoffcpu crash watcher: Python and native stacks of crashing processes
Documentation=man:pyoffcpu-crashes(1)

[Service]
ExecStart={cmd}
Restart=on-failure
Nice=5

[Install]
WantedBy=multi-user.target
"""


def service_text(argv: List[str]) -> str:
    return ("# systemd: /etc/systemd/system/pyoffcpu-crashes.service\n" + systemd_unit(argv) +
            "\n# then: sudo systemctl daemon-reload && sudo systemctl enable --now pyoffcpu-crashes\n"
            "# one line per crash: journalctl -u pyoffcpu-crashes\n")


def _crashes(n: int) -> str:
    return f"{n} crash" + ("es" if n != 1 else "")


def not_reported(directory: str) -> List[str]:
    """The crashes the watcher could not report, totalled by reason and user."""
    totals: Dict[Tuple[str, object], int] = {}
    for r in S.load_index(directory).get("not_reported", []):
        if isinstance(r, dict) and isinstance(r.get("count"), int) and isinstance(r.get("reason"), str):
            key = (r["reason"], r.get("uid"))
            totals[key] = totals.get(key, 0) + r["count"]
    return [f"not reported: {_crashes(n)}{f' of user {uid}' if isinstance(uid, int) else ''}: {reason}"
            for (reason, uid), n in sorted(totals.items(), key=lambda kv: -kv[1])]


def entries(directory: str) -> List[Tuple[str, dict]]:
    """(text path, entry) of the crashes the index lists, newest last."""
    index = S.load_index(directory)
    out = []
    for e in sorted(index["entries"], key=lambda e: e.get("time", 0)):
        if e.get("mode") == "crash" and "txt" in e.get("files", {}):
            out.append((os.path.join(directory, e["files"]["txt"]["path"]), e))
    return out
