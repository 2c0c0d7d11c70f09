"""`pyoffcpu top`: a live view of where a process's (or the machine's)
threads spend their time, refreshed every second.

It runs the same session loop as `record` (Session.batches: one batch per
drain, about a second) and shows what the last refresh interval added:
functions (the innermost Python frame of each stack, else its innermost
native frame) by on-CPU, off-CPU (with the reason) or wall time, and each
thread's state and times.  Keys: o on-CPU, f off-CPU, w wall, s sort
(time / name), q quit.  Ctrl-C quits; the target exiting ends it with the
last refresh on the screen.  `--once` prints one refresh as text.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..terminal import safe

VIEWS = {"o": "on-CPU", "f": "off-CPU", "w": "wall"}
SORTS = ("time", "name")
NAMES_EVERY = 5                 # refreshes between two reads of the threads' Python names


@dataclass
class Window:
    """What one refresh interval added, by function and by thread (ns)."""
    seconds: float = 0.0
    functions: Dict[Tuple[str, Optional[str]], int] = field(default_factory=dict)   # (label, reason)
    threads: Dict[int, List[int]] = field(default_factory=dict)                     # tid -> [on, off]
    reasons: Dict[int, Dict[str, int]] = field(default_factory=dict)                # tid -> reason ns


class Live:
    """The Recording's cumulative totals turned into per-interval windows.
    Each stack key is labelled once (a key stands for one stack)."""

    def __init__(self, rec, period_ns: int, multi: bool = False):
        from ..native import symbols
        from ..profile.merge import Merger
        self.rec = rec
        self.period_ns = period_ns
        self.merger = Merger(rec, symbols.Symbolizer())
        self.labels: Dict[tuple, Tuple[str, Optional[str]]] = {}
        self.prev: Dict[tuple, int] = {}
        self.prev_t = time.monotonic()
        self.multi = multi                  # several processes: labels name theirs

    def label(self, key: tuple) -> Tuple[str, Optional[str]]:
        got = self.labels.get(key)
        if got is None:
            from ..profile.reasons import reason_of
            from ..profile.summary import where_time_goes
            tgid, tid, us, ks, ph, kind = key
            frames = self.merger.frames_for(tgid, us, ks, ph, 0)
            where = where_time_goes(frames)
            name = where.label(False, self.merger._short) if where is not None else "[no frames]"
            reason = reason_of(kind, frames)
            if self.multi:
                name = f"{tgid} {self.rec.comms.get(tgid, '?')}: {name}"
            got = self.labels[key] = (name, reason)
        return got

    def window(self) -> Window:
        """What the stacks gained since the last call (a thread that ended
        folds into its group: its keys move, their time does not).  Sampled
        waits (--off-cpu sampled) split what each thread's short waits added
        in the interval over the stacks sampled in it (profile/waits.py)."""
        from ..kernel import bpfdefs
        from ..profile import waits
        now = time.monotonic()
        w = Window(seconds=now - self.prev_t)
        self.prev_t = now
        cur: Dict[tuple, int] = {}
        added: Dict[tuple, List[int]] = {}
        for key, (count, ns) in self.rec.stacks.items():
            on = bpfdefs.on_cpu(key[5])
            # on-CPU: samples x period until the thread's exact time is known
            cur[key] = count * self.period_ns if on else ns
            d = cur[key] - self.prev.get(key, 0)
            if d > 0:
                added[key] = [1, d]
        self.prev = cur
        added, _wakes, _counts = waits.resolve(added, {}, self.rec.offcpu, self.period_ns)
        for key, (_count, d) in added.items():
            if d <= 0:
                continue
            name, reason = self.label(key)
            w.functions[(name, reason)] = w.functions.get((name, reason), 0) + d
            t = w.threads.setdefault(key[1], [0, 0])
            if reason is None:
                t[0] += d
            else:
                t[1] += d
                r = w.reasons.setdefault(key[1], {})
                r[reason] = r.get(reason, 0) + d
        return w


def _state(pid: int, tid: int) -> str:
    from ..kernel.procfs import proc_state
    return proc_state(f"/proc/{pid}/task/{tid}/stat") or "-"


def render(w: Window, rec, title: str, view: str, sort: str, width: int = 120,
           height: int = 40) -> List[str]:
    """The screen as lines (the same for curses and --once)."""
    def s(ns):
        return f"{ns / 1e9:7.2f} s"
    on = sum(t[0] for t in w.threads.values())
    off = sum(t[1] for t in w.threads.values())
    lines = [f"{title} \u2014 {VIEWS[view]} time, last {w.seconds:.1f} s, by {sort}"[:width],
             "keys: o on-CPU  f off-CPU  w wall  s sort  q quit"[:width],
             f"threads: {len(w.threads)}; on-CPU {on / 1e9:.2f} s, off-CPU {off / 1e9:.2f} s"[:width], ""]
    rows = []
    for (name, reason), ns in w.functions.items():
        if view == "o" and reason is not None or view == "f" and reason is None:
            continue
        rows.append((ns, name, reason))
    total = sum(r[0] for r in rows) or 1
    rows.sort(key=(lambda r: (-r[0], r[1])) if sort == "time" else (lambda r: (r[1], -r[0])))
    lines.append(f"{'SHARE':>6} {'TIME':>9}  {'REASON':<10} FUNCTION")
    nthreads = min(len(w.threads), max(3, height // 3))
    room = max(3, height - len(lines) - nthreads - 4)
    for ns, name, reason in rows[:room]:
        lines.append(f"{100 * ns / total:5.1f}% {s(ns)}  {(reason or 'on-CPU'):<10} {name}"[:width])
    if not rows:
        lines.append("  (nothing in this interval)")
    lines.append("")
    lines.append(f"{'TID':>8} {'NAME':<16} {'STATE':<5} {'ON-CPU':>9} {'OFF-CPU':>9}  MAIN WAIT")
    names = {tid: rec.python_names.get(tid, t.name) for tid, t in rec.threads.items()}
    pids = {tid: t.pid for tid, t in rec.threads.items()}
    order = sorted(w.threads.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
    for tid, (ton, toff) in order[:nthreads]:
        why = w.reasons.get(tid, {})
        main = max(why.items(), key=lambda kv: kv[1])[0] if why else ""
        st = _state(pids.get(tid, tid), tid) if tid > 0 else "-"
        lines.append(f"{tid:>8} {names.get(tid, '?')[:16]:<16} {st:<5} {s(ton)} {s(toff)}  {main}"[:width])
    return lines[:height]


def run(session, title: str, once: bool = False, stdscr=None, multi: bool = False
        ) -> Tuple[str, List[str]]:
    """Drive the session, drawing a refresh after each batch; returns (why
    it ended, the last screen).  With `once`, the first interval (about a
    second) is the result and the recording ends; no terminal is used."""
    import curses
    rec = session.rec
    live = None
    view, sort = "w" if session.opts.mode == "wall" else ("o" if session.opts.mode == "cpu" else "f"), "time"
    last: List[str] = []
    refreshes = 0
    for batch in session.batches():
        refreshes += 1
        if live is None:
            live = Live(rec, int(1e9 // session.opts.frequency), multi)
        w = live.window()
        if refreshes % NAMES_EVERY == 1 and not batch.final:
            session.blocked.read_python_names()     # threads started since, renamed
        if once:
            return "once", render(w, rec, title, view, sort, 200, 10 ** 6)
        if batch.final and not w.functions and last:
            # the target ended right after a refresh: the last one with time
            # in it is what the user wants to see, not an empty interval
            return (session.stop_reason or "ended"), last
        h, wd = stdscr.getmaxyx()
        last = render(w, rec, f"{title} [{refreshes}]", view, sort, max(20, wd - 1), max(10, h))
        stdscr.erase()
        for i, line in enumerate(last[:h]):
            try:
                stdscr.addstr(i, 0, safe(line))
            except curses.error:            # the bottom-right cell, a resize under way
                pass
        stdscr.refresh()
        if batch.final:
            return (session.stop_reason or "ended"), last
        while True:
            ch = stdscr.getch()
            if ch == -1:
                break
            if ch == curses.KEY_RESIZE:
                continue
            c = chr(ch) if 0 <= ch < 256 else ""
            if c in ("q", "Q"):
                return "quit", last
            if c in VIEWS:
                view = c
            elif c == "s":
                sort = SORTS[(SORTS.index(sort) + 1) % len(SORTS)]
    return (session.stop_reason or "ended"), last
