"""--timeline: a recording's timeline events (collect/timeline.py) named as
the profile names them: each wait's stack and reason, each on-CPU sample's
stack, each thread's and process's name, each wait's waker.  The exporter
(export/timeline.py) writes it for Perfetto."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..collect.timeline import every_other
from . import model as P
from . import reasons


@dataclass
class Span:
    """A wait (end > 0: [begin, end)) or an on-CPU sample (end 0) of one thread."""
    pid: int
    tid: int
    begin: int                      # ns, CLOCK_MONOTONIC
    end: int
    frames: Tuple[P.Frame, ...]     # root first
    reason: Optional[str]           # a wait's; None: on-CPU
    waker: Optional[Tuple[int, int, int]] = None    # (pid, tid, when it woke the wait)
    open_at_end: bool = False       # still blocked when the recording ended
    task: Optional[str] = None      # --async: an asyncio task's state (reason: "running", "await: ...")
    before_start: bool = False      # blocked already when the recording started (begin: the start)


TASK_TID_BASE = 1 << 30             # a task's track: above any thread id (pid_max <= 2^22)


@dataclass
class TimelineModel:
    start_ns: int
    end_ns: int
    start_time: float               # unix time of start_ns
    processes: Dict[int, str] = field(default_factory=dict)     # pid -> name
    threads: Dict[int, Tuple[int, str]] = field(default_factory=dict)     # tid -> (pid, name)
    spans: List[Span] = field(default_factory=list)
    # what the budget did (collect/timeline.py while recording, thin_* at
    # the write), and what was lost
    asked_min_ns: int = 0           # --timeline-min-us
    min_ns: int = 0                 # the threshold in force now
    waits_dropped: int = 0
    sample_stride: int = 1
    samples_dropped: int = 0
    lost: int = 0

    def thin_waits(self) -> None:
        """The threshold doubles: the waits shorter go."""
        self.min_ns *= 2
        kept = [s for s in self.spans if not s.end or s.task or s.end - s.begin >= self.min_ns]
        self.waits_dropped += len(self.spans) - len(kept)
        self.spans = kept

    def thin_samples(self) -> None:
        """Every other on-CPU sample of each thread goes."""
        kept = every_other(self.spans, lambda s: None if s.end else s.tid)
        self.samples_dropped += len(self.spans) - len(kept)
        self.sample_stride *= 2
        self.spans = kept

    def notes(self) -> List[str]:
        waits = sum(1 for s in self.spans if s.end and not s.task)
        samples = sum(1 for s in self.spans if not s.end)
        tasks = len({s.tid for s in self.spans if s.task})
        out = [f"timeline: {waits:,} waits of {self.min_ns / 1000:g} µs or more, {samples:,} on-CPU samples"
               + (f", {tasks:,} asyncio tasks' states (sampled at --async-hz)" if tasks else "")]
        if self.min_ns > self.asked_min_ns:
            out.append(f"timeline: the wait threshold rose from {self.asked_min_ns / 1000:g} µs to "
                       f"{self.min_ns / 1000:g} µs to keep the trace small ({self.waits_dropped:,} "
                       "shorter waits left out; docs/timeline.md)")
        if self.sample_stride > 1:
            out.append(f"timeline: every {self.sample_stride}th on-CPU sample of a thread kept "
                       f"({self.samples_dropped:,} left out to keep the trace small)")
        if self.lost:
            out.append(f"timeline: {self.lost:,} events lost (the buffer was full): those waits and "
                       "samples are in the profile, not in the timeline")
        return out


def build_timeline(rec, merger) -> TimelineModel:
    """The named timeline of a recording made with --timeline (rec.timeline)."""
    tl = rec.timeline
    out = TimelineModel(tl.start_ns, tl.end_ns, rec.start_time, asked_min_ns=tl.min_ns,
                        min_ns=tl.final_min_ns, waits_dropped=tl.waits_dropped,
                        sample_stride=tl.sample_stride, samples_dropped=tl.samples_dropped, lost=tl.lost)
    named: Dict[tuple, Tuple[Tuple[P.Frame, ...], Optional[str]]] = {}
    comms: Dict[int, str] = {}
    for ev in tl.events:
        tgid, tid, uid, kstack, pystack, kind = ev.key
        got = named.get(ev.key[:1] + ev.key[2:])
        if got is None:
            frames = tuple(merger.frames_for(tgid, uid, kstack, pystack, max(0, ev.end - ev.begin)))
            got = named[ev.key[:1] + ev.key[2:]] = (frames, reasons.reason_of(kind, frames) if ev.end else None)
        frames, reason = got
        if ev.comm:
            comms[tid] = ev.comm
        out.threads.setdefault(tid, (tgid, ""))
        waker = None
        if ev.waker is not None:
            waker = ev.waker
            out.threads.setdefault(waker[1], (waker[0], ""))
        out.spans.append(Span(tgid, tid, ev.begin, ev.end, frames,
                              (reason or "off-CPU") if ev.end else None, waker,
                              ev.end >= tl.end_ns > 0, before_start=ev.before_start))
    _add_tasks(out, rec)
    ended = {t.first_tid: t.name for t in rec.threads.values() if t.threads == 1}
    for tid, (pid, _) in list(out.threads.items()):
        name = (rec.python_names.get(tid) or comms.get(tid) or
                (rec.threads[tid].name if tid in rec.threads else None) or ended.get(tid) or f"thread {tid}")
        if tid < TASK_TID_BASE:
            out.threads[tid] = (pid, name)
        out.processes.setdefault(pid, rec.comms.get(pid, "?"))
    return out


def _add_tasks(out: TimelineModel, rec) -> None:
    """--async: each asyncio task a track of its own under its process, its
    states (running, await: KIND, ready) as the snapshots saw them."""
    times = rec.tasks
    if times is None or not times.spans:
        return
    for n, ((pid, _addr, info), spans) in enumerate(sorted(times.spans.items(), key=lambda kv: kv[1][0][0])):
        tid = TASK_TID_BASE + n
        out.threads[tid] = (pid, f"task {info.name}")
        for begin, end, state in spans:
            out.spans.append(Span(pid, tid, begin, end, (), state, task=info.coro_name))
    out.spans.sort(key=lambda s: s.begin)
