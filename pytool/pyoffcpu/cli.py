"""Command line: `pyoffcpu [record] -p PID | -- CMD...`."""
from __future__ import annotations

import os
import signal
import sys

import click

from . import __version__
from .collect.platform import ProfilerError
from .terminal import echo

RECORD_EPILOG = """\b
Examples:
  sudo pyoffcpu -p 4242                  # wall-clock profile until Ctrl-C -> SVG
  sudo pyoffcpu -p 4242 -d 30 -o train.json      # 30 s, speedscope file
  sudo pyoffcpu -p 4242 -d 30 -o train.pb.gz     # pprof, for Pyroscope, Parca, go tool pprof
  sudo pyoffcpu -o boot.svg -- python3 app.py    # launch and profile to the end
  sudo pyoffcpu -p 4242 --mode off -o wait.folded  # blocked time only, folded text
  sudo pyoffcpu -p 4242 --mode off --reasons lock,gil   # only waits for locks and the GIL
  sudo pyoffcpu -p 4242 --mode off --min-block-us 10000  # only waits of 10 ms or more
  sudo pyoffcpu -p 4242 --wakers -d 10   # and who ended each thread's waits
  sudo pyoffcpu -p 4242 --off-cpu exact  # a stack at every switch (default: sampled at -F)
  sudo pyoffcpu -p 4242 -d 10 --timeline t.json  # each wait in time, for ui.perfetto.dev
  sudo pyoffcpu -p 4242 --async -d 10    # asyncio: each task's time, running and awaiting
  sudo pyoffcpu -p 4242 --mode cpu -F 499 --kernel # on-CPU only, with kernel frames
  sudo pyoffcpu -a -d 10                 # every process on the machine, on-CPU
  sudo pyoffcpu -a --match 'train|serve' --mode wall -d 10   # wall-clock, selected ones
  sudo pyoffcpu --subprocesses -- python3 train.py   # and the processes it starts
  sudo pyoffcpu snapshot --gpu          # for cron (see `pyoffcpu snapshot --help`)
  pyoffcpu report DIR; pyoffcpu diff A.folded B.folded   # a page of snapshots; what changed

\b
Output format follows the extension: .svg flame graph, .json speedscope,
.folded/.txt collapsed stacks (weights in microseconds), .pb.gz/.pprof pprof
(for Grafana Pyroscope, Parca, go tool pprof); --format overrides.
Ctrl-C, SIGTERM, -d running out and the target exiting all write the profile.
"""


class DefaultToRecord(click.Group):
    """`pyoffcpu -p 1` means `pyoffcpu record -p 1`; and the one place a
    ProfilerError (an error the user can act on) becomes its line and exit 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except ProfilerError as e:
            echo(e.line(), err=True)
            sys.exit(1)

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = ["record"] + list(args)
        elif not args and not ctx.resilient_parsing:
            # (completing the first word: the commands are its choices, not record's options)
            args = ["record"]
        return super().parse_args(ctx, args)


@click.group(cls=DefaultToRecord, epilog=RECORD_EPILOG + "\nSee `pyoffcpu record --help` for every option.",
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pyoffcpu")
def main():
    """pyoffcpu: wall-clock profiles of Python processes from eBPF.

    On-CPU time is sampled with a perf event, off-CPU time is measured exactly at
    every context switch; Python frames are walked in BPF and interleaved with
    the native frames. Without a command, `record` is assumed:

    \b
      sudo pyoffcpu -p PID [-d SECONDS] [-o OUT.svg]
      sudo pyoffcpu [-o OUT.svg] -- python3 app.py
    """


def fail(msg: str, todo: str = "", code: int = 1):
    echo(ProfilerError(msg, todo).line(), err=True)
    sys.exit(code)


def _writable_or_fail(path: str, todo: str, what: str = "") -> None:
    from .export import check_writable
    try:
        check_writable(path)
    except OSError as e:
        fail(f"cannot write {what or path}: {e.strerror or e}", todo)


@main.command(epilog=RECORD_EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-p", "--pid", "pids", type=int, multiple=True, metavar="PID",
              help="Process to profile (all its threads). Repeat for several.")
@click.option("-a", "--all", "all_", is_flag=True,
              help="Every process on the machine, each under its own root, Python frames "
                   "wherever Python runs (default --mode cpu; wall and off need a filter).")
@click.option("--match", metavar="REGEX", default=None,
              help="With -a: the processes whose command line matches REGEX.")
@click.option("--uid", type=int, default=None, metavar="UID", help="With -a: the processes of this user id.")
@click.option("--python-only", is_flag=True, help="With -a: Python processes only.")
@click.option("--subprocesses", is_flag=True,
              help="Follow the processes the target starts (fork, exec), each under its own "
                   "root: multiprocessing pools, DataLoader and gunicorn workers.")
@click.option("-d", "--duration", type=click.FloatRange(min=0.01), default=None,
              help="Seconds to record (default: until Ctrl-C or the target exits).")
@click.option("-F", "--frequency", type=click.IntRange(1, 10000), default=99, show_default=True,
              help="On-CPU samples per second per CPU.")
@click.option("--mode", type=click.Choice(["wall", "cpu", "off"]), default=None,
              help="wall: on- and off-CPU time; cpu: on-CPU only; off: blocked time only "
                   "[default: wall; with -a: cpu].")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Output file [default: pyoffcpu-<pid>-<YYYYmmdd-HHMMSS>.svg].")
@click.option("--format", "fmt", type=click.Choice(["svg", "speedscope", "folded", "pprof"]), default=None,
              help="Output format (default: from the extension).")
@click.option("--reasons", "only_reasons", metavar="LIST", default=None,
              help="Keep only the off-CPU time of these reasons, comma-separated (runqueue, "
                   "sleep, lock, gil, io, poll, disk, page-fault, gpu, other); on-CPU time stays.")
@click.option("--off-cpu", "offcpu", type=click.Choice(["sampled", "exact"]), default=None,
              help="Where a wait's stack is taken (wall and off mode; every wait's time is exact "
                   "either way). sampled: only as often as a wall-clock sampler at -F would see it: "
                   "every wait of 1/F or more, exactly; a shorter one with probability d*F, its time "
                   "split over the stacks sampled (docs/offcpu-sampling.md). exact: at every "
                   "switch, at a cost per switch. [default: sampled]")
@click.option("--timeline", type=click.Path(dir_okay=False), default=None, metavar="FILE.json",
              help="Also write a Perfetto trace (ui.perfetto.dev): a track per thread, each wait of "
                   "--timeline-min-us or more at its real begin and end, its reason, stack and waker "
                   "(--wakers), each on-CPU sample (docs/timeline.md). Sets --off-cpu exact.")
@click.option("--timeline-min-us", type=click.IntRange(min=1), default=100, show_default=True, metavar="US",
              help="With --timeline: the shortest wait drawn (raised, and said, past 250,000 waits).")
@click.option("--min-block-us", type=click.IntRange(min=0), default=0, metavar="US",
              help="Leave out waits shorter than US microseconds (their count and time are printed).")
@click.option("--max-block-us", type=click.IntRange(min=1), default=None, metavar="US",
              help="Leave out waits longer than US microseconds.")
@click.option("--wakers", is_flag=True,
              help="Record who ended each wait (a thread and its stacks, a timer, an "
                   "interrupt): each off-CPU stack goes on with `--` and the waker's frames, "
                   "leaf first, suffixed _[w] (offwaketime's format), and the summary names "
                   "the main waker of each thread's main wait (wall and off mode).")
@click.option("--async", "async_tasks", is_flag=True,
              help="asyncio tasks (CPython 3.11+): a loop thread's time while a task runs goes "
                   "under `task NAME` (tasks that ended fold as `tasks in CORO`), and every "
                   "suspended task gets its time at its await chain, ending [await: KIND] "
                   "(sleep, queue, socket read, lock, task NAME, ...) or [ready]: sampled "
                   "--async-hz times a second; that time is the task's, beside its thread's.")
@click.option("--async-hz", type=click.IntRange(1, 1000), default=100, show_default=True,
              metavar="HZ", help="With --async: snapshots of the tasks per second (their "
                                 "reader keeps itself under 5% of a core).")
@click.option("--kernel", is_flag=True, help="Include kernel frames (suffix _[k]).")
@click.option("--no-threads", is_flag=True, help="Merge all threads (no `thread` root frames).")
@click.option("--full-paths", is_flag=True, help="Full source paths instead of sys.path-relative ones.")
@click.option("--keep-tids", is_flag=True,
              help="Keep every thread that ended under its own root (default: ended threads "
                   "that started in the same function fold into one `threads N ended` root, "
                   "in the kernel for those born during the recording).")
@click.option("--tables-first", is_flag=True,
              help="Make the native unwind tables and verify the unwinder before recording (complete "
                   "native stacks from the first sample; a slower start). Default: tables are made while "
                   "it runs, the unwinder comes in ~0.2 s in, frame-pointer stacks until then "
                   "(env PYOFFCPU_TABLES_FIRST=1 sets it for every command).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def record(pids, all_, match, uid, python_only, subprocesses, duration, frequency, mode, output, fmt,
           only_reasons, offcpu, timeline, timeline_min_us, min_block_us, max_block_us, wakers,
           async_tasks, async_hz, kernel, no_threads, full_paths, keep_tids, tables_first, command):
    """Record a wall-clock profile of a process (-p), a command (-- CMD) or the machine (-a)."""
    from .export import format_for_path
    from .profile.reasons import REASONS
    if wakers and (mode or ("cpu" if all_ else "wall")) == "cpu":
        raise click.UsageError("--wakers needs --mode wall or --mode off (waits are only seen there)")
    if async_tasks and all_:
        raise click.UsageError("--async is for -p and commands")
    if async_tasks and mode == "cpu":
        raise click.UsageError("--async needs --mode wall or off (a task's wait is not on a CPU)")
    if timeline is not None:
        if (mode or ("cpu" if all_ else "wall")) == "cpu" or all_ or offcpu == "sampled":
            raise click.UsageError("--timeline needs --mode wall or off, -p or a command, and every "
                                   "wait's stack (--off-cpu exact, which it sets)")
        _writable_or_fail(timeline, "choose another --timeline path")
    offcpu = offcpu or ("exact" if timeline else "sampled")
    if max_block_us is not None and max_block_us < min_block_us:
        raise click.UsageError(f"--max-block-us {max_block_us} is below --min-block-us {min_block_us}")
    if only_reasons is not None:
        only_reasons = {r.strip() for r in only_reasons.split(",") if r.strip()}
        unknown = sorted(only_reasons - set(REASONS))
        if unknown or not only_reasons:
            raise click.UsageError(f"--reasons: not a reason: {', '.join(unknown) or '(none given)'} "
                                   f"(the reasons: {', '.join(REASONS)})")

    if sum((bool(pids), bool(command), all_)) != 1:
        raise click.UsageError("give one of -p PID, -a, or a command after --")
    if match is not None:
        import re
        try:
            re.compile(match)
        except re.error as e:
            raise click.UsageError(f"--match: not a regular expression: {e}")
    from .targets.selection import Select
    filtered = Select(match, uid, python_only).filtered
    if filtered and not all_:
        raise click.UsageError("--match, --uid and --python-only select processes for -a")
    if subprocesses and all_:
        raise click.UsageError("--subprocesses is for -p and commands (-a takes every process)")
    mode = mode or ("cpu" if all_ else "wall")
    if all_ and mode != "cpu" and not filtered:
        raise click.UsageError(f"--mode {mode} -a needs a filter (--match, --uid or --python-only): a "
                               "capture at every switch of every thread costs too much; or use --mode cpu")
    for pid in pids:
        if pid <= 0 or not os.path.exists(f"/proc/{pid}"):
            fail(f"no such process: {pid}", "check the PID with `ps`")
    if output is not None:
        if fmt is None:
            try:
                fmt = format_for_path(output)
            except ValueError as e:
                raise click.UsageError(str(e))
        _writable_or_fail(output, "choose another -o path")
    else:
        fmt = fmt or "svg"
        _writable_or_fail(os.path.join(os.getcwd(), "pyoffcpu-probe.svg"), "give -o PATH",
                          "to the current directory")

    from .collect.recording import Options, tables_first_env
    opts = Options(pids=list(pids), command=list(command), duration=duration,
                   frequency=frequency, mode=mode, kernel=kernel, fold_threads=not keep_tids,
                   system_wide=all_, match=match, uid=uid, python_only=python_only,
                   follow=subprocesses, min_block_ns=min_block_us * 1000,
                   max_block_ns=(max_block_us or 0) * 1000, wakers=wakers,
                   async_tasks=async_tasks, async_hz=async_hz,
                   tables_first=tables_first or tables_first_env(), timeline=timeline,
                   timeline_min_ns=timeline_min_us * 1000)
    if offcpu == "exact" or os.environ.get("PYOFFCPU_OFFCPU") != "shadow":
        opts.offcpu = offcpu        # (tests: PYOFFCPU_OFFCPU=shadow stands in for the default)
    from .commands.record import record as run_record
    run_record(opts, output, fmt, not no_threads, full_paths, only_reasons)


SNAPSHOT_EPILOG = """\b
Examples:
  sudo pyoffcpu snapshot                        # every Python process, 10 s
  sudo pyoffcpu snapshot --gpu -d 20            # the processes using a GPU
  sudo pyoffcpu snapshot --match 'train|serve' --dir /data/profiles --keep-days 3
  sudo pyoffcpu snapshot --pid 4242 --pid 4343 --format svg,pprof,folded
  pyoffcpu snapshot --gpu --print-cron          # a crontab line and systemd units for this

\b
Files: DIR/<host>/<YYYY-mm-dd>/<HHMMSS>-<pid>-<name>.<ext>, one per process
and format, and one entry per process in DIR/index.json (command line,
Python, GPU facts, on/off-CPU totals, top functions); `pyoffcpu report DIR`
makes a page of them. Retention deletes only files the index lists.
Quiet on success; each error is one line on stderr. Exit status: 0 done,
1 nothing recorded (an error), 2 recorded but something could not be
written, 3 another snapshot holds DIR's lock (this run did nothing).
"""


@main.command(epilog=SNAPSHOT_EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--dir", "directory", default="/var/lib/pyoffcpu/snapshots", show_default=True,
              metavar="DIR", help="Where snapshots and their index go.")
@click.option("-p", "--pid", "pids", type=int, multiple=True, metavar="PID",
              help="A process to record (repeat for several).")
@click.option("--match", metavar="REGEX", default=None,
              help="The Python processes whose command line matches REGEX.")
@click.option("--gpu", is_flag=True,
              help="The Python processes with a /dev/nvidia* device open or libcuda mapped "
                   "(with nvidia-ml-py installed, NVML adds GPU indices, memory and utilisation).")
@click.option("-d", "--duration", type=float, default=10.0, show_default=True, metavar="SECONDS",
              help="How long to record (all targets at once).")
@click.option("-F", "--frequency", type=click.IntRange(1, 10000), default=99, show_default=True,
              help="On-CPU samples per second.")
@click.option("--mode", type=click.Choice(["wall", "cpu", "off"]), default="wall", show_default=True)
@click.option("--format", "formats", default="svg,pprof", show_default=True, metavar="LIST",
              help="Comma-separated: svg, pprof, folded, speedscope.")
@click.option("--keep-days", type=float, default=7.0, show_default=True,
              help="Delete the snapshots (listed in the index) older than this.")
@click.option("--max-total-mb", type=float, default=None,
              help="Then delete the oldest until the listed files fit in this many MiB.")
@click.option("--print-cron", is_flag=True,
              help="Print a crontab line and a systemd service + timer for this command, and exit.")
@click.option("--every", type=click.IntRange(1, 59), default=15, show_default=True, metavar="MIN",
              help="With --print-cron: minutes between snapshots.")
def snapshot(directory, pids, match, gpu, duration, frequency, mode, formats, keep_days,
             max_total_mb, print_cron, every):
    """Short wall-clock profiles of the processes that matter, for cron."""
    from .commands import snapshot as S
    fmts = tuple(f.strip() for f in formats.split(",") if f.strip())
    bad = [f for f in fmts if f not in S.SNAPSHOT_FORMATS]
    if bad or not fmts:
        raise click.BadParameter(f"unknown format {', '.join(bad) or '(none)'}; "
                                 f"use {', '.join(S.SNAPSHOT_FORMATS)}", param_hint="--format")
    if match is not None:
        import re
        try:
            re.compile(match)
        except re.error as e:
            raise click.BadParameter(f"not a regular expression: {e}", param_hint="--match")
    if print_cron:
        argv = [_own_executable(), "snapshot", "--dir", os.path.abspath(directory)]
        argv += sum((["--pid", str(p)] for p in pids), [])
        argv += (["--match", match] if match else []) + (["--gpu"] if gpu else [])
        argv += ["-d", f"{duration:g}", "-F", str(frequency), "--mode", mode, "--format", ",".join(fmts),
                 "--keep-days", f"{keep_days:g}"]
        argv += ["--max-total-mb", f"{max_total_mb:g}"] if max_total_mb is not None else []
        echo(S.schedule_text(argv, every), nl=False)
        return
    opts = S.SnapshotOptions(os.path.abspath(directory), list(pids), match, gpu, duration, frequency,
                             mode, fmts, keep_days, max_total_mb)
    errors: list = []
    try:
        code = S.run(opts, errors)
    except S.Locked as e:
        echo(e.line(), err=True)
        sys.exit(S.EXIT_LOCKED)
    except ProfilerError as e:
        for line in errors:
            echo(f"pyoffcpu: error: {line}", err=True)
        echo(e.line(), err=True)
        sys.exit(1)
    except OSError as e:
        fail(f"cannot use {directory}: {e.strerror or e}")
    for line in errors:
        echo(f"pyoffcpu: error: {line}", err=True)
    sys.exit(code)


DOCTOR_EPILOG = """\b
Examples:
  sudo pyoffcpu doctor          # every check, one line each
  sudo pyoffcpu doctor --quiet  # only what is not ok (nothing, exit 0: a recording works)

\b
Checks: root or CAP_BPF + CAP_PERFMON, kernel BTF, tracefs (mounted if it is
not, as a recording does), the tracepoints, kernel lockdown, a BPF program's
load and attach, the cpu-clock perf event, bcc and the kernel headers it
compiles against (or a warm program cache), the cache directory's owner and
mode, kernel.bpf_stats_enabled. FAIL: a recording would not work; warn: it
works with less. Exit status: 0 when nothing FAILed, 1 otherwise.
"""


@main.command(epilog=DOCTOR_EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-q", "--quiet", is_flag=True, help="Only the checks that are not ok.")
def doctor(quiet):
    """Check what a recording needs from this machine, and what to do about what is missing."""
    from .commands.doctor import FAIL, OK, run_checks
    checks = run_checks()
    for c in checks:
        if not (quiet and c.status == OK):
            echo(c.line())
    failed = [c for c in checks if c.status == FAIL]
    if failed:
        echo(f"pyoffcpu doctor: {len(failed)} of {len(checks)} checks failed: a recording would not work",
             err=True)
        sys.exit(1)
    if not quiet:
        echo("pyoffcpu doctor: a recording would work")


CRASHES_EPILOG = """\b
Examples:
  sudo pyoffcpu crashes                          # every Python process, until Ctrl-C
  sudo pyoffcpu crashes -a                       # every process (native stacks if not Python)
  sudo pyoffcpu crashes --match 'train|serve' --dir /data/crashes
  sudo pyoffcpu crashes --print-service          # a systemd unit that keeps it on
  pyoffcpu crashes --list                        # the crashes recorded in DIR

\b
At each fatal signal (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) to a watched
process, BPF copies the receiving thread's registers, the top of its
stack, its kernel stack and its Python frames, before the process is gone:
the report names its native frames (under its exact Python lines) as
`dump --core` does. Files: DIR/<host>/<YYYY-mm-dd>/<HHMMSS>-<pid>-<name>
.crash.txt and .crash.json, one entry each in DIR/index.json, retention as
snapshot's (only files the index lists are deleted); one line per crash
on stdout (the journal's, under systemd). Costs nothing until a signal:
BPF runs at signal deliveries only. Exit status: 0, 1 an error, 3
another watcher holds DIR's lock.
"""


@main.command(epilog=CRASHES_EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--dir", "directory", default="/var/lib/pyoffcpu/crashes", show_default=True,
              metavar="DIR", help="Where the reports and their index go.")
@click.option("-a", "--all", "all_", is_flag=True,
              help="Every process, not only Python ones (native and kernel stacks for the others).")
@click.option("--match", metavar="REGEX", default=None,
              help="Only the processes whose name or command line matches REGEX.")
@click.option("--uid", type=int, default=None, metavar="UID", help="Only the processes of this user id.")
@click.option("--keep-days", type=float, default=30.0, show_default=True,
              help="Delete the reports (listed in the index) older than this.")
@click.option("--max-total-mb", type=float, default=512.0, show_default=True,
              help="Then delete the oldest until the listed files fit in this many MiB.")
@click.option("--rescan", type=click.FloatRange(0.1, 3600), default=2.0, show_default=True,
              metavar="SECONDS", help="How often /proc is scanned: the backstop for processes not read at "
              "their exec (each new one is read then).")
@click.option("--count", type=click.IntRange(1), default=None, metavar="N",
              help="Stop after N crashes.")
@click.option("-d", "--duration", type=float, default=None, metavar="SECONDS",
              help="Stop after this long (default: until Ctrl-C or SIGTERM).")
@click.option("-v", "--verbose", count=True,
              help="Say which processes are watched (stderr); -vv: and each scan, and how soon after "
              "its exec each new process was read.")
@click.option("--print-service", is_flag=True, help="Print a systemd unit for this command, and exit.")
@click.option("--list", "list_", is_flag=True, help="List the crashes recorded in DIR, and exit.")
def crashes(directory, all_, match, uid, keep_days, max_total_mb, rescan, count, duration,
            verbose, print_service, list_):
    """Catch crashing processes: every thread's Python and native stacks at the fatal signal."""
    from .commands import crashes as K
    from .commands.snapshot import Locked, EXIT_LOCKED
    if match is not None:
        import re
        try:
            re.compile(match)
        except re.error as e:
            raise click.BadParameter(f"not a regular expression: {e}", param_hint="--match")
    if list_:
        rows = K.entries(directory)
        for path, e in rows:
            import time as _t
            f = e.get("signal") or {}
            echo(f"{_t.strftime('%Y-%m-%d %H:%M:%S', _t.localtime(e['time']))}  pid {e.get('pid')} "
                 f"{e.get('name', '')}: {f.get('signal', '?') if isinstance(f, dict) else '?'}  {path}")
        for line in K.not_reported(directory):
            echo(line)
        if not rows:
            echo(f"no crash recorded in {directory}", err=True)
        return
    if print_service:
        argv = [_own_executable(), "crashes", "--dir", os.path.abspath(directory)]
        argv += (["-a"] if all_ else []) + (["--match", match] if match else [])
        argv += (["--uid", str(uid)] if uid is not None else [])
        argv += ["--keep-days", f"{keep_days:g}", "--max-total-mb", f"{max_total_mb:g}"]
        echo(K.service_text(argv), nl=False)
        return
    from .collect.platform import check_privileges
    check_privileges()
    opts = K.CrashOptions(os.path.abspath(directory), all_, match, uid, keep_days, max_total_mb,
                          rescan, count, duration, verbose)

    def say(line):
        echo(line)
        sys.stdout.flush()

    def log(line, level=1):
        if verbose >= level:
            echo(f"pyoffcpu: {line}", err=True)
    try:
        K.run(opts, say, log, lambda line: echo(f"pyoffcpu: {line}", err=True))
    except Locked as e:
        echo(e.line().replace("another snapshot", "another watcher"), err=True)
        sys.exit(EXIT_LOCKED)
    except OSError as e:
        fail(f"cannot use {directory}: {e.strerror or e}")


@main.command(context_settings={"help_option_names": ["-h", "--help"]},
              epilog="\b\nExample:\n  pyoffcpu report /var/lib/pyoffcpu/snapshots   # -> .../report.html")
@click.argument("directory", type=click.Path(file_okay=False), metavar="DIR")
@click.option("-o", "--output", default=None, metavar="FILE.html",
              help="The page (default: DIR/report.html).")
def report(directory, output):
    """One HTML page over the snapshots in DIR: a timeline per host and
    process, top functions and off-CPU reasons, links to each file."""
    from .export import check_writable, write_bytes_atomic
    from .commands.report import render_report
    from .commands.snapshot import INDEX
    if not os.path.isfile(os.path.join(directory, INDEX)):
        fail(f"no snapshot index in {directory} ({INDEX})", "run `pyoffcpu snapshot --dir DIR` first")
    output = output or os.path.join(directory, "report.html")
    try:
        check_writable(output)
        base = os.path.relpath(os.path.abspath(directory), os.path.dirname(os.path.abspath(output)))
        page = render_report(directory, "" if base == "." else base)
        write_bytes_atomic(output, page.encode("utf-8"))
    except OSError as e:
        fail(f"cannot write {output}: {e.strerror or e}")
    echo(f"pyoffcpu: wrote {output}", err=True)


def _own_executable() -> str:
    """The pyoffcpu command that runs this code (the venv's entry point)."""
    exe = os.path.join(os.path.dirname(sys.executable), "pyoffcpu")
    return exe if os.access(exe, os.X_OK) else "pyoffcpu"


DUMP_EPILOG = """\b
Examples:
  sudo pyoffcpu dump -p 4242                # every thread's Python stack, state, the GIL
  sudo pyoffcpu dump -p 4242 --native       # with native frames (threads blocked in the kernel)
  sudo pyoffcpu dump -p 4242 --locals       # each Python frame's arguments, locals, source line
  sudo pyoffcpu dump -p 4242 --json | jq .  # for scripts
  sudo pyoffcpu dump -p 4242 --subprocesses # and the processes it started
  sudo pyoffcpu dump -p 4242 --async        # its asyncio tasks: who awaits whom, and where
  pyoffcpu dump --core core.4242            # a crashed process, from its core file
  pyoffcpu dump --core /var/lib/systemd/coredump/core.python3.0.<boot>.4242.<time>.zst
  coredumpctl dump 4242 -o core && pyoffcpu dump --core core

\b
Nothing is stopped: stacks are read from /proc and the process's memory,
so a deadlocked process can be dumped (and stays as it was).
A core file gives every thread's Python and native frames, the faulting
thread first with its signal and address; its files are read from this
machine (or --root), and only where their build-id is the core's.
"""


@main.command(epilog=DUMP_EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-p", "--pid", "pid", type=int, metavar="PID", help="The process.")
@click.option("--core", "core", metavar="FILE",
              help="A core file instead of a live process (plain, or systemd-coredump's "
                   ".zst/.lz4/.xz); native frames are always shown.")
@click.option("--exe", "exe", metavar="PATH",
              help="With --core: the executable, where it is not at the path the core names.")
@click.option("--root", "root", metavar="DIR",
              help="With --core: the directory the process saw as / (a container's or a "
                   "chroot's tree); its files are read from there.")
@click.option("--native", is_flag=True,
              help="Native frames too (unwound from .eh_frame; a thread running on a CPU has none).")
@click.option("--locals", "with_locals", is_flag=True, help="Each Python frame's arguments, local "
              "variables (read from its memory, never by running its code) and source line.")
@click.option("--json", "as_json", is_flag=True, help="JSON on stdout instead of text.")
@click.option("--subprocesses", is_flag=True, help="The processes it started too.")
@click.option("--async", "async_tasks", is_flag=True,
              help="Its asyncio tasks instead (CPython 3.11+): a tree of who awaits whom, "
                   "where each is suspended and on what; tasks awaiting each other are named "
                   "as a CYCLE.")
def dump(pid, core, exe, root, native, with_locals, as_json, subprocesses, async_tasks):
    """Every thread's current stack, its state, the GIL holder, lock owners."""
    from .commands import dump as D
    from .collect.platform import check_privileges
    if core is not None:
        from .commands.coredump import dump_core
        from .targets.corefile import CoreError
        if pid is not None or subprocesses or async_tasks:
            fail("--core reads one dead process: -p, --subprocesses and --async are for live ones")
        if root is not None and not os.path.isdir(root):
            fail(f"--root {root}: not a directory")
        try:
            _print_dumps([dump_core(core, root=root, exe=exe, with_locals=with_locals)], as_json, False)
        except CoreError as e:
            fail(str(e))
        return
    if pid is None:
        fail("dump needs -p PID or --core FILE", "see pyoffcpu dump --help")
    if exe or root:
        fail("--exe and --root go with --core")
    check_privileges()
    if not os.path.isdir(f"/proc/{pid}"):
        fail(f"no such process: {pid}", "check the PID with `ps`")
    if async_tasks:
        _dump_async(pid, as_json)
        return
    dumps = []
    for p in [pid] + (D.children(pid) if subprocesses else []):
        try:
            dumps.append(D.dump_process(p, native=native, with_locals=with_locals))
        except OSError as e:
            if p == pid:
                fail(f"cannot read process {pid}: {e.strerror or e}")
    _print_dumps(dumps, as_json, subprocesses)


def _print_dumps(dumps, as_json: bool, several: bool) -> None:
    from .commands import dump as D
    if as_json:
        import json
        echo(json.dumps([d.as_dict() for d in dumps] if several else dumps[0].as_dict(), indent=1))
    else:
        echo("\n\n".join(D.render_text(d) for d in dumps))


def _dump_async(pid: int, as_json: bool) -> None:
    from .commands import tasks as T
    from .cpython import asyncio_tasks as A
    from .cpython import detect
    try:
        d = T.dump_tasks(pid)
    except (detect.NotPython, detect.Unsupported, A.AsyncioUnavailable) as e:
        fail(f"process {pid}: {e}")
    except OSError as e:
        fail(f"cannot read process {pid}: {e.strerror or e}")
    if as_json:
        import json
        echo(json.dumps(d, indent=1))
    else:
        echo(T.render_tasks(d))


TOP_EPILOG = """\b
Examples:
  sudo pyoffcpu top -p 4242            # wall-clock view of one process, every second
  sudo pyoffcpu top -a                 # every process, on-CPU
  sudo pyoffcpu top -p 4242 --once     # one refresh as text, for scripts

\b
Keys: o on-CPU, f off-CPU (with the reason), w wall, s sort (time / name),
q quit. Ctrl-C quits too; when the target exits the last refresh stays on
the terminal.
"""


@main.command(epilog=TOP_EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-p", "--pid", "pids", type=int, multiple=True, metavar="PID",
              help="Process to watch (repeat for several).")
@click.option("-a", "--all", "all_", is_flag=True, help="Every process on the machine.")
@click.option("--mode", type=click.Choice(["wall", "cpu", "off"]), default=None,
              help="What is recorded (default: wall with -p, cpu with -a).")
@click.option("-F", "--frequency", type=click.IntRange(1, 10000), default=99, show_default=True)
@click.option("--once", is_flag=True, help="Print one refresh (about a second) as text and exit.")
def top(pids, all_, mode, frequency, once):
    """A live view: functions by on-CPU, off-CPU or wall time, threads' states."""
    from .collect import platform as plat
    from .commands import top as T
    from .collect.recording import Options
    from .collect.session import Session
    if bool(pids) == bool(all_):
        raise click.UsageError("give -p PID or -a")
    mode = mode or ("cpu" if all_ else "wall")
    if all_ and mode != "cpu":
        raise click.UsageError("-a watches on-CPU time only (--mode cpu)")
    for pid in pids:
        if not os.path.isdir(f"/proc/{pid}"):
            fail(f"no such process: {pid}", "check the PID with `ps`")
    session = Session(Options(pids=list(pids), system_wide=all_, mode=mode, frequency=frequency),
                      plat.probe())
    if all_:
        title = "pyoffcpu top: every process"
    else:
        from .kernel.procfs import comm
        names = ", ".join(f"{p} {comm(p)}" for p in pids)
        title = f"pyoffcpu top: pid {names}"

    def on_signal(signum, frame):
        session.request_stop(signal.Signals(signum).name)
    signal.signal(signal.SIGTERM, on_signal)
    if once:
        signal.signal(signal.SIGINT, on_signal)
        why, screen = T.run(session, title, once=True, multi=all_ or len(pids) > 1)
        echo("\n".join(screen))
        return
    import curses

    def main_loop(stdscr):
        curses.curs_set(0)
        stdscr.nodelay(True)
        signal.signal(signal.SIGINT, on_signal)
        return T.run(session, title, stdscr=stdscr, multi=all_ or len(pids) > 1)
    why, screen = curses.wrapper(main_loop)
    if why not in ("quit", "SIGINT", "SIGTERM"):
        echo("\n".join(screen))
        echo(f"pyoffcpu top: {why}", err=True)


DIFF_EPILOG = """\b
Examples:
  pyoffcpu diff monday.folded tuesday.folded -o diff.svg
  pyoffcpu diff before.pb.gz after.pb.gz -o diff.svg --shape a

\b
A and B are folded (.folded, .txt) or pprof (.pb.gz, .pprof) files, as
`record` writes them. Frames are merged by name across processes and
threads; each is coloured by the change of its share of its profile's
total (red: more of B, blue: less), and its tooltip gives both times.
"""


@main.command(epilog=DIFF_EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("a", type=click.Path(dir_okay=False))
@click.argument("b", type=click.Path(dir_okay=False))
@click.option("-o", "--output", default="diff.svg", show_default=True, metavar="FILE.svg",
              help="The differential flame graph (SVG).")
@click.option("--shape", type=click.Choice(["a", "b"]), default="b", show_default=True,
              help="Whose widths the frames have (b: what is there now; a: what was there).")
@click.option("--full-paths", is_flag=True, help="Full source paths in Python frames.")
def diff(a, b, output, shape, full_paths):
    """A differential flame graph of B against A."""
    from .export import check_writable, write_bytes_atomic
    from .export.diff import largest_changes, read_profile, render_diff
    profiles = []
    for path in (a, b):
        try:
            profiles.append(read_profile(path))
        except OSError as e:
            fail(f"cannot read {path}: {e.strerror or e}")
        except ValueError as e:
            fail(str(e))
    if not profiles[0].weights or not profiles[1].weights:
        fail(f"{a if not profiles[0].weights else b} holds no stacks")
    try:
        check_writable(output)
        title = f"pyoffcpu diff: {os.path.basename(b)} against {os.path.basename(a)}"
        write_bytes_atomic(output, render_diff(*profiles, title, shape, full_paths).encode(
            "utf-8", "surrogateescape"))
    except OSError as e:
        fail(f"cannot write {output}: {e.strerror or e}")
    for points, where in largest_changes(*profiles, full_paths=full_paths):
        echo(f"  {points:+6.1f} points  {where}", err=True)
    echo(f"pyoffcpu: wrote {output} (differential flame graph, {shape.upper()}'s widths)", err=True)


if __name__ == "__main__":
    main()
