"""pyoffcpu record: one recording of the pipeline, start to end.

collect (the session's loop) -> profile (merge: native and Python frames,
reasons) -> export (the file) -> the summary on stderr.  cli.py parses the
options into a recording.Options and calls record(); Ctrl-C and SIGTERM end
the recording normally, and the profile is written either way."""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Optional

from ..collect import platform as plat
from ..collect.platform import ProfilerError
from ..terminal import echo
from ..collect.session import Session
from ..native import symbols


def status_line(rec, elapsed: float):
    samples, blocked = rec.totals()
    dur = rec.options.duration
    drops = sum(rec.drops.values())
    when = f"{elapsed:5.1f}s" + (f"/{dur:g}s" if dur else "")
    sys.stderr.write(f"\rpyoffcpu: {when}  samples {samples}  blocked {blocked / 1e9:.2f}s  drops {drops}   ")
    sys.stderr.flush()


def record(opts, output: Optional[str], fmt: str, threads: bool, full_paths: bool,
            only_reasons: Optional[set] = None):

    platform = plat.probe()
    target = (f"pid {opts.pids[0]}" if opts.pids else "every process" if opts.system_wide
              else " ".join(opts.command))

    def started():
        echo(f"pyoffcpu: recording {target} ({opts.mode} mode, {opts.frequency} Hz"
                   + (f", {opts.duration:g} s" if opts.duration else ", Ctrl-C to stop") + ")", err=True)
        for notice in session.start_notices:
            echo(f"pyoffcpu: notice: {notice}", err=True)
    session = Session(opts, platform, status=status_line if sys.stderr.isatty() else None,
                      started=started)

    def on_signal(signum, frame):
        session.request_stop(signal.Signals(signum).name)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    rec = session.run()
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    for notice in rec.notices:
        echo(f"pyoffcpu: notice: {notice}", err=True)

    # imported once the recording is done: they are not needed before, and a
    # start that waits for them starts later (docs/overhead.md)
    from ..export import write_profile_or_fallback
    from ..profile.merge import build_profile
    from ..profile.summary import recording_notes, render_summary
    ksyms = symbols.KernelSymbols.load() if opts.kernel else None
    symbolizer = symbols.Symbolizer()
    prof, stats = build_profile(rec, symbolizer, ksyms)
    if only_reasons is not None:
        prof = prof.with_reasons(only_reasons)
    main_pid = opts.pids[0] if opts.pids else (min(rec.comms) if rec.comms and opts.command else 0)
    if output is None:
        who = "all" if opts.system_wide else main_pid
        output = f"pyoffcpu-{who}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(rec.start_time))}.svg"
    n = len(rec.comms)
    comm = rec.comms.get(main_pid, "") if main_pid else f"{n} process" + ("" if n == 1 else "es")
    title = (f"pyoffcpu: {prof.meta.target} {comm} — {opts.mode} mode, "
             f"{rec.duration_s:.1f} s, {opts.frequency} Hz")
    # a failed write still prints the summary; its error (naming the fallback
    # copy in the temp directory) is the last line
    write_error = None
    try:
        write_profile_or_fallback(prof, output, fmt, threads=threads, full_paths=full_paths,
                                  title=title)
    except ProfilerError as e:
        write_error = e
    sampled_view = os.environ.get("PYOFFCPU_SAMPLED_VIEW")
    if rec.offcpu == "shadow" and sampled_view:
        # tests and make bench: the same recording's sampled view (docs/offcpu-sampling.md)
        other, _ = build_profile(rec, symbols.Symbolizer(), ksyms, view="sampled")
        write_profile_or_fallback(other, sampled_view, "folded", threads=threads, full_paths=full_paths,
                                  title=title)

    timeline_error = timeline_notes = None
    if opts.timeline and rec.timeline is not None:
        timeline_notes, timeline_error = _write_timeline(rec, symbolizer, ksyms, opts.timeline, full_paths)

    samples, blocked = rec.totals()
    py = f", CPython {prof.meta.python_version}" if prof.meta.python_version else ""
    echo(f"pyoffcpu: recorded {rec.duration_s:.1f} s of {prof.meta.target} ({comm}{py}): "
               f"{samples} samples, {blocked / 1e9:.2f} s off-CPU"
               + ("; the process exited" if session.stop_reason == "target exited" and not opts.command else ""),
               err=True)
    for line in recording_notes(rec, stats):
        echo(f"pyoffcpu: {line}", err=True)
    echo(render_summary(prof), err=True)
    for line in timeline_notes or ():
        echo(f"pyoffcpu: {line}", err=True)
    if write_error is None:
        echo(f"pyoffcpu: wrote {output} ({fmt})", err=True)
    if opts.timeline and timeline_error is None and timeline_notes is not None:
        echo(f"pyoffcpu: wrote {opts.timeline} (timeline: open it in ui.perfetto.dev)", err=True)
    if rec.exit_status not in (None, 0):
        echo(f"pyoffcpu: the command exited with status {rec.exit_status}", err=True)
    if write_error is not None or timeline_error is not None:
        raise write_error or timeline_error


def _write_timeline(rec, symbolizer, ksyms, path: str, full_paths: bool):
    """--timeline: the recording's timeline written to path; (its notes, the
    ProfilerError of a failed write or None)."""
    from ..export.timeline import write_timeline
    from ..profile.merge import Merger
    from ..profile.timeline import build_timeline
    tl = build_timeline(rec, Merger(rec, symbolizer, ksyms))
    try:
        write_timeline(tl, path, full_paths)
    except ProfilerError as e:
        return tl.notes(), e
    return tl.notes(), None
