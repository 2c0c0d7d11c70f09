"""`pyoffcpu crashes`: a watcher, left on, that catches the crash of any
Python process (or of every process with -a) as it happens.

BPF (collect/crashcapture.py, bpf/crashes.bpf.c) runs at each signal
delivery and, for a fatal one (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) to
a watched process, copies in the receiving thread what its stacks need once
the process is gone: registers, the top of its stack, its kernel stack,
its Python frames and the code objects they name.  Here:

- which processes are watched: commands/crashwatch.py (a scan of /proc
  every --rescan seconds, and each process born since, read at its exec);
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
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ..kernel import bpfdefs
from ..collect.platform import ProfilerError
from ..failures import failure_text
from . import postmortem as PM
from . import snapshot as S
from .crashwatch import ProcessWatch, _ident

V = bpfdefs.value
CRF = bpfdefs.with_prefix("CRF_")
DEFAULT_DIR = "/var/lib/pyoffcpu/crashes"
HANDLED_AFTER_S = 10.0          # a process that runs on this long after its handler ran: handled
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


LOST_RATE = f"over the budget of {V('CR_PER_UID_S')} captures a user a second (a storm)"
LOST_BUFFER = "no room in the perf buffer (a burst of crashes)"
LOST_FAILED = "its report failed"


class Watcher(ProcessWatch):
    """The captures and the reports (run() below drives them), of the
    processes ProcessWatch finds."""

    def __init__(self, opts: CrashOptions, capture, say: Callable[[str], None],
                 log: Callable[..., None]):
        super().__init__(opts, capture, log)
        self.say = say
        self._ksyms = None
        self.crashes = 0
        self.held: Dict[int, tuple] = {}    # pid -> (capture, when): delivered to a handler
        self.said: Dict[Tuple[str, int], int] = {}  # (reason, uid) -> crashes said to be lost so far

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
        ignored = self.ignored.get(ev.pid)
        if self._watched(ev.pid) is None and ignored and int(ignored[1]) == ev.start_ticks:
            return None                 # read at its birth and not selected (BPF had it then)
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
        if w is None:
            w = self._fork_parent(ev, notes)
        maps = w.maps if w is not None else []
        fresh = _maps_now(ev.pid, w.ident) if w is not None else None
        if fresh:
            maps = _merge_maps(w.maps, fresh)
        if w is None:
            notes.append("not read by the watcher before it crashed (born moments before, or "
                         "its birth not read yet): no mappings, native frames not named")
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
            why = ("no Python frames: the watcher had not read it yet (its interpreter "
                   "is known from its next start on)")
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
            cap = CrashCapture(uid=opts.uid, pids=[], births=True)
            try:
                w = Watcher(opts, cap, say, log)
                w.scan()
                n_py = sum(1 for x in w.known.values() if x.pp is not None)
                note(f"watching {len(w.known)} processes ({n_py} Python) for crashes; "
                     f"reports in {opts.dir}")
                start = time.monotonic()
                next_scan = start + opts.rescan_s      # the first scan was just made
                while not stop:
                    due = w.next_look()
                    wait = 0.5 if due is None else min(0.5, max(due - time.monotonic(), 0.0))
                    events = cap.poll(wait)
                    # births first: a process born and crashed in one poll is read before its report
                    w.births(cap.take_births())
                    if cap.births_lost:
                        log(f"{cap.births_lost} births not read (the buffer was full): "
                            "found by the next scan")
                        cap.births_lost = 0
                        next_scan = time.monotonic()
                    for ev in events:
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
