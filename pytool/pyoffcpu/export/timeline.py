"""--timeline FILE: a recording's timeline (profile/timeline.py) as Chrome
trace-event JSON, which Perfetto (ui.perfetto.dev, trace_processor) and
chrome://tracing read (docs/timeline.md):

- a track per thread, under its process, named as the profile names it
  (`process_name` and `thread_name` metadata);
- each wait as a complete slice ("X") at its real begin and end, named by
  its reason, with its stack (root first, `;` between frames) and its
  innermost Python frame in args; a wait still open when the recording
  ended has args.open, one that began before it args.before_start (it is
  drawn from the start);
- with --wakers, a flow arrow from a 1 ns slice on the waker's thread
  ("wakes NAME", at the moment of the wakeup) to a 1 ns slice ("woken")
  that ends the wait it ended;
- each on-CPU sample as an instant ("i") named by its innermost frame, with
  its stack.

Times are microseconds of CLOCK_MONOTONIC (bpf_ktime_get_ns) with three
decimals: the switch timestamps' nanoseconds survive.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Dict, Iterator, List

from ..collect.platform import ProfilerError
from ..profile import model as P
from ..profile.timeline import TimelineModel
from . import write_bytes_atomic, write_fallback


MAX_BYTES = 200 << 20               # what Perfetto's UI opens in a browser tab without trouble


def _us(ns: int) -> float:
    return round(ns / 1000.0, 3)


def _stack(frames, full_paths: bool, short) -> str:
    return ";".join(f.label(full_paths, short).replace(";", ":") for f in frames)


def _where(frames, full_paths: bool, short) -> str:
    """The innermost Python frame, else the innermost frame."""
    for f in reversed(frames):
        if f.kind is P.FrameKind.PYTHON:
            return f.label(full_paths, short)
    return frames[-1].label(full_paths, short) if frames else "?"


def _metadata(tl: TimelineModel) -> Iterator[dict]:
    for pid, name in sorted(tl.processes.items()):
        yield {"ph": "M", "name": "process_name", "pid": pid, "tid": pid, "args": {"name": name}}
    for tid, (pid, name) in sorted(tl.threads.items()):
        yield {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def _span_events(tl: TimelineModel, s, flow: int, full_paths: bool, short) -> List[dict]:
    """One span's events; flow: the id of its wakeup's flow, if it has one."""
    if s.task is not None:
        return [{"ph": "X", "cat": "asyncio", "name": s.reason, "pid": s.pid, "tid": s.tid,
                 "ts": _us(s.begin), "dur": _us(s.end - s.begin), "args": {"coroutine": s.task}}]
    stack = _stack(s.frames, full_paths, short)
    where = _where(s.frames, full_paths, short)
    if not s.end:
        return [{"ph": "i", "s": "t", "cat": "on-cpu", "name": where, "pid": s.pid, "tid": s.tid,
                 "ts": _us(s.begin), "args": {"stack": stack}}]
    args = {"stack": stack, "at": where, "reason": s.reason}
    if s.open_at_end:
        args["open"] = True
    if s.before_start:
        args["before_start"] = True
    out = [{"ph": "X", "cat": "off-cpu", "name": s.reason, "pid": s.pid, "tid": s.tid,
            "ts": _us(s.begin), "dur": _us(s.end - s.begin), "args": args}]
    if s.waker is not None:
        # a flow from a 1 ns slice on the waker's thread at the wakeup to a
        # 1 ns slice ending the wait (a flow goes forward in time)
        wpid, wtid, when = s.waker
        args["waker"] = wtid
        out.append({"ph": "X", "cat": "wake", "name": f"wakes {tl.threads.get(s.tid, (0, '?'))[1]}",
                    "pid": wpid, "tid": wtid, "ts": _us(when), "dur": 0.001, "bind_id": flow,
                    "flow_out": True, "args": {"wakes": s.tid}})
        out.append({"ph": "X", "cat": "wake", "name": "woken", "pid": s.pid, "tid": s.tid,
                    "ts": _us(s.end - 1), "dur": 0.001, "bind_id": flow, "flow_in": True,
                    "args": {"by": wtid}})
    return out


def _lines(tl: TimelineModel, full_paths: bool) -> Dict[int, str]:
    """Each span's JSON lines, by id(span)."""
    short = None if full_paths else P.PathShortener()
    out = {}
    for n, s in enumerate(tl.spans, 1):
        out[id(s)] = ",\n".join(json.dumps(ev, ensure_ascii=True)
                                for ev in _span_events(tl, s, n, full_paths, short))
    return out


def render_timeline(tl: TimelineModel, full_paths: bool = False, max_bytes: int = MAX_BYTES) -> bytes:
    """The trace's JSON, one event per line (a reader of a big one can
    stream it), under max_bytes: past it the wait threshold doubles, or
    every other on-CPU sample of a thread goes (whichever takes more room),
    until it fits; the notes say so."""
    meta = [json.dumps(ev, ensure_ascii=True) for ev in _metadata(tl)]
    lines = _lines(tl, full_paths)
    fixed = sum(len(m) + 2 for m in meta) + 4096
    while tl.spans and fixed + sum(len(lines[id(s)]) + 2 for s in tl.spans) > max_bytes:
        before = len(tl.spans)
        if 2 * sum(len(lines[id(s)]) for s in tl.spans if not s.end) > sum(len(v) for v in lines.values()):
            tl.thin_samples()
        else:
            tl.thin_waits()
        if len(tl.spans) == before:
            break                       # what is left cannot be thinned (one sample a thread, task states)
        lines = {id(s): lines[id(s)] for s in tl.spans}
    head = {"displayTimeUnit": "ns",
            "otherData": {"generator": "pyoffcpu --timeline",
                          "start": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(tl.start_time)),
                          "start_monotonic_us": _us(tl.start_ns), "end_monotonic_us": _us(tl.end_ns),
                          "notes": tl.notes()}}
    body = ",\n".join(meta + [lines[id(s)] for s in tl.spans])
    return (json.dumps(head)[:-1] + ', "traceEvents": [\n' + body + "\n]}\n").encode("ascii")


def write_timeline(tl: TimelineModel, path: str, full_paths: bool = False) -> None:
    """Written atomically; a write that fails leaves the trace in the temp
    directory and says where (a ProfilerError), as the profile's does."""
    data = render_timeline(tl, full_paths, MAX_BYTES)
    try:
        write_bytes_atomic(path, data)
        return
    except OSError as e:
        failed = f"cannot write the timeline {os.fspath(path)}: {e.strerror or e}"
    try:
        kept = write_fallback(path, "timeline", data, tempfile.gettempdir())
    except OSError as e:
        raise ProfilerError(f"{failed}; the fallback copy failed too: {e.strerror or e}",
                            "the timeline is lost: free some space or choose another path") from None
    raise ProfilerError(failed, f"the timeline was saved to {kept}")
