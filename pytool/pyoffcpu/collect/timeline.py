"""--timeline's events while the recording runs, within a budget.

BPF sends each wait of at least the threshold as it ends (its stack taken at
its switch-out: --timeline records as --off-cpu exact) and each on-CPU
sample, with its stack key (bpf/pyoffcpu.h, struct timeline_event).  They
are kept here as their raw records, and named at the recording's end
(`resolved`), once the drains have read every native stack they use.

The budget (docs/timeline.md), so that an hour's trace still opens:
- at most `max_waits` waits.  One more doubles the threshold: the waits kept
  that are shorter go, and BPF sends no shorter one from then on.  The trace
  then holds every wait of at least the final threshold, over the whole
  recording, and the summary says to what the threshold rose.
- at most `max_samples` on-CPU samples.  One more halves them: every other
  sample of each thread goes, and from then on a thread keeps every 2k-th.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

# struct timeline_event: the stack_key (tgid, tid, ustack, kstack, pystack,
# kind, gen, nstack), begin, end, wake_ts, waker_tgid, waker_tid, comm
EVENT = struct.Struct("<IIiiQIIQQQQII16s")
_SIZE = EVENT.size
MIN_US_DEFAULT = 100
MAX_WAITS = 250_000                 # ~100 MB of JSON at ~400 bytes a wait; 22 MB here (raw records)
MAX_SAMPLES = 250_000
PENDING_BYTES = 1 << 20             # records kept as they came before settle() sorts them out
SEEN_MAX = 65_536                   # threads whose sample count is kept (past it: counted from 0 again)


def every_other(items: Iterable, thread_of: Callable[[object], Optional[int]]) -> List:
    """The budget's halving of samples: of each thread's items, the 1st,
    3rd, 5th ... stay (those kept were its samples 0, k, 2k, ...: 0, 2k,
    4k, ... stay); an item whose thread_of is None is not a sample and stays."""
    nth: Dict[int, int] = {}
    kept = []
    for item in items:
        tid = thread_of(item)
        if tid is not None:
            i = nth[tid] = nth.get(tid, -1) + 1
            if i % 2:
                continue
        kept.append(item)
    return kept


@dataclass
class TimelineEvent:
    """One wait (end > 0) or on-CPU sample (end 0), its stack as a key of
    Recording.stacks names it: (tgid, tid, ustack id, kstack, pystack, kind)."""
    key: Tuple[int, int, int, int, int, int]
    begin: int                      # ns, CLOCK_MONOTONIC (bpf_ktime_get_ns)
    end: int
    comm: str
    waker: Optional[Tuple[int, int, int]] = None    # (tgid, tid, when it woke the wait)
    before_start: bool = False      # blocked already when the recording started (begin: the start)


@dataclass
class Timeline:
    """What a recording's timeline holds (Recording.timeline)."""
    events: List[TimelineEvent] = field(default_factory=list)
    min_ns: int = MIN_US_DEFAULT * 1000     # the threshold asked for
    final_min_ns: int = MIN_US_DEFAULT * 1000   # what the budget raised it to
    waits_dropped: int = 0          # waits kept a while, then under a raised threshold
    sample_stride: int = 1          # a thread's every k-th on-CPU sample is kept
    samples_dropped: int = 0
    lost: int = 0                   # events the perf buffer had no room for
    start_ns: int = 0               # the recording's window, CLOCK_MONOTONIC
    end_ns: int = 0


class TimelineBuffer:
    """The raw records of one recording (see the module's doc)."""

    def __init__(self, min_ns: int, set_threshold: Callable[[int], None],
                 max_waits: int = MAX_WAITS, max_samples: int = MAX_SAMPLES):
        self.min_ns = self.threshold = min_ns
        self.set_threshold = set_threshold
        self.max_waits = max(1, max_waits)
        self.max_samples = max(1, max_samples)
        self.waits = bytearray()
        self.samples = bytearray()
        self.n_waits = self.n_samples = 0
        self.waits_dropped = self.samples_dropped = 0
        self.stride = 1
        self.seen: Dict[int, int] = {}          # tid -> its samples so far
        self.lost = 0
        self.initial: List[TimelineEvent] = []  # the waits there at the start (one a thread at most)
        self.pending = bytearray()              # records not sorted out yet (settle)

    # -- perf buffer callbacks ------------------------------------------------
    def on_event(self, cpu: int, data: bytes):
        """Kept as it came, sorted out in bulk (settle): a server sends tens
        of thousands a second, and this runs once for each.  (data: the
        event and the perf record's padding after it; a shorter one is
        dropped.)"""
        if len(data) >= _SIZE:
            self.pending += data[:_SIZE]
            if len(self.pending) >= PENDING_BYTES:
                self.settle()

    def settle(self) -> None:
        """The events that came since the last call, into the budget."""
        data, self.pending = self.pending, bytearray()
        view = memoryview(data)
        size = EVENT.size
        for i, e in enumerate(EVENT.iter_unpack(data)):
            if e[9]:
                self._wait(view[i * size:(i + 1) * size], e[9] - e[8])
            else:
                self._sample(view[i * size:(i + 1) * size], e[1])

    def on_lost(self, count):
        self.lost += count

    # -- the budget -----------------------------------------------------------
    def add_wait(self, raw: bytes) -> None:
        e = EVENT.unpack_from(raw)
        self._wait(raw, e[9] - e[8])

    def _wait(self, raw, length: int) -> None:
        if length < self.threshold:
            return                      # sent before BPF saw the raised threshold
        self.waits += raw
        self.n_waits += 1
        while self.n_waits > self.max_waits:
            self._raise_threshold()

    def add_open_wait(self, key, pystack: int, begin: int, end: int) -> None:
        """A wait still open at the end mark (`end`), its stack taken at its
        switch-out (key: BPF's stack_key, pystack as user space fixed it)."""
        self.add_wait(EVENT.pack(key.tgid, key.tid, key.ustack, key.kstack, pystack, key.kind, 0,
                                 key.nstack, begin, end, 0, 0, 0, b""))

    def add_initial_wait(self, key: tuple, start: int, end: int) -> None:
        """A thread's wait that was there at the start, until its first
        switch-in (or the end); key as Recording.stacks' (ThreadAccounts)."""
        if end - start >= self.threshold:
            self.initial.append(TimelineEvent(key, start, end, "", None, before_start=True))

    def _raise_threshold(self) -> None:
        self.threshold *= 2
        self.set_threshold(self.threshold)
        kept = bytearray()
        n = 0
        for e in EVENT.iter_unpack(self.waits):
            if e[9] - e[8] >= self.threshold:
                kept += EVENT.pack(*e)
                n += 1
        self.waits_dropped += self.n_waits - n
        self.waits, self.n_waits = kept, n

    def add_sample(self, raw: bytes) -> None:
        self._sample(raw, EVENT.unpack_from(raw)[1])

    def _sample(self, raw, tid: int) -> None:
        if len(self.seen) >= SEEN_MAX and tid not in self.seen:
            # a thread-per-request server meets millions of threads in an
            # hour: their counts go, and each thread's starts again at 0
            # (a thread keeps at most one sample more than every k-th)
            self.seen.clear()
        i = self.seen.get(tid, 0)
        self.seen[tid] = i + 1
        if i % self.stride:
            self.samples_dropped += 1
            return
        self.samples += raw
        self.n_samples += 1
        if self.n_samples > self.max_samples:
            self._halve_samples()

    def _halve_samples(self) -> None:
        """Every other kept sample of each thread goes: those kept were its
        samples 0, k, 2k, ... (stride k); 0, 2k, 4k, ... stay."""
        self.stride *= 2
        kept = every_other(EVENT.iter_unpack(self.samples), lambda e: e[1])
        self.samples_dropped += self.n_samples - len(kept)
        self.samples, self.n_samples = bytearray(b"".join(EVENT.pack(*e) for e in kept)), len(kept)

    # -- the end --------------------------------------------------------------
    def resolved(self, ustack_id: Callable[[int, int], int]) -> Timeline:
        """The events, their stacks named as Recording.stacks' keys are:
        ustack_id(ustack, nstack) is the drains' id of a user stack."""
        self.settle()
        out = Timeline(min_ns=self.min_ns, final_min_ns=self.threshold, waits_dropped=self.waits_dropped,
                       sample_stride=self.stride, samples_dropped=self.samples_dropped, lost=self.lost)
        for buf in (self.waits, self.samples):
            for (tgid, tid, ustack, kstack, pystack, kind, _gen, nstack, begin, end, wake_ts,
                 wtgid, wtid, comm) in EVENT.iter_unpack(buf):
                key = (tgid, tid, ustack_id(ustack, nstack), kstack, pystack, kind)
                name = comm.split(b"\0", 1)[0].decode("utf-8", "replace")
                waker = (wtgid, wtid, wake_ts) if wake_ts and wtid else None
                out.events.append(TimelineEvent(key, begin, end, name, waker))
        out.events += [ev for ev in self.initial if ev.end - ev.begin >= self.threshold]
        out.events.sort(key=lambda ev: ev.begin)
        return out
