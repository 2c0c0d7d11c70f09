#!/usr/bin/env python3
"""make bench: pyoffcpu's overhead, scale and accuracy, side by side with py-spy.

Run as root from the repository root (make bench does): prints Markdown tables
on stdout (progress on stderr) and writes them to tools/bench/results.md.

Cases (numbers as in issue #5):
  1 CPU-bound Python, one thread          slowdown, 4 profilers
  2 one busy thread + 150 blocked threads  slowdown, 4 profilers
  3 two threads ping-ponging over pipes    slowdown, pyoffcpu wall (and with --wakers) vs
                                           py-spy --idle
  4 bystander: 3's workload unprofiled while pyoffcpu -p profiles an idle process
  5 accuracy against a built-in wall-time split
  6 startup, warm (program cache filled) and cold (emptied): to the first sample in
    the kernel map, to the `recording` line, peak RSS with children; py-spy's attach;
    where a warm start goes; teardown (SIGINT to file)
  7 exporters on a synthetic 1,000,000-sample / 50,000-stack profile
  8 BPF run time per event, from the B runs of 1-4 (kernel.bpf_stats_enabled)
  9 long run (issue 8): a server that starts a thread per request, ~2,000
    requests/s from a client process; pyoffcpu's RSS, maps and drops each minute
 10 throughput (issue 10): the same server, a client as fast as it goes; requests/s
    alone, under pyoffcpu --mode wall / --mode cpu and py-spy --idle, in rounds;
    the profiler's CPU, and its BPF programs' run times in one more run per mode
 11 memory of one session over 1, 10 and 100 idle target processes: peak RSS,
    the kernel memory of its BPF maps, time to `recording`
 13 dump latency (issue 14): `pyoffcpu dump -p` (and with --native) of a 50-thread
    process, start to printed stacks, beside `py-spy dump` (which pauses it)
 14 code without CFI (issue 15): numpy's OpenBLAS in a venv of the bench's; the table
    of its largest library built cold and read warm, and the BPF cost per on-CPU sample,
    with prologue analysis and without (PYOFFCPU_PROLOGUE=0)
 15 PyTorch as it is run (issue 23, tools/bench/case_torch.py): a training loop with
    DataLoader workers, ~90 executable files; cold and warm starts (first sample, tables
    ready, each library's build, peak RSS with children, end of recording to profile),
    training steps/s under --mode wall / --mode cpu / py-spy --idle against alone windows
 16 CPython 3.15 (issue 26, tools/bench/case_py315.py): cases 2, 3 and 5 on Debian's
    python3.15 in the chroot, with its own sampler (`python3.15 -m profiling.sampling`,
    1 kHz and 100 Hz) beside pyoffcpu and py-spy
 17 asyncio (issue 27, tools/bench/case_async.py): an asyncio loop on 3.15 (a worker
    task beside a ticker, a queue and 200 waiting tasks), its slowdown under pyoffcpu
    --async and under 3.15's sampler in its async-aware mode (--async-mode all)
 18 the crash watcher (issue 29, tools/bench/case_crashes.py): a CPU-bound process beside
    `pyoffcpu crashes -a` (A/B and A/A pairs), BPF ns per signal delivered and per
    fatal one (the whole capture), its maps' memory
 19 the first recording of a 2,000-thread process (issue 43, tools/bench/case_threads.py):
    cold and warm, the share of the native-stack time without a table yet
 12 system-wide: `pyoffcpu -a --mode cpu -F 99` beside 50 Python processes of 5
    interpreters (tools/bench/fleet.py: idle, busy, short-lived): its own CPU
    over a 10 s window, peak RSS, time to `recording`, how many it found with
    Python frames; A/B pairs of a CPU-bound process beside it, and A/A pairs

Each slowdown is measured in pairs: one fresh target process does the fixed
work once alone (A) and once profiled (B), in the order AB or BA alternating
from pair to pair, after a warm-up; the pair's ratio is B/A. The profiler is
attached before B starts and gone before A starts, so its start-up and
teardown are not in either time.

Case 6 and 11 run pyoffcpu with PYOFFCPU_CACHE_DIR in the bench's temporary
folder: a cold start empties that folder's `bpf` cache, never the user's.

Knobs (environment or options): BENCH_PAIRS (7), BENCH_WORK_S (1.0 s of work
per run), BENCH_LONG_S (long teardown recording, 60 s; case 9 records
max(120 s, BENCH_LONG_S): BENCH_LONG_S=600 is the 10-minute run),
BENCH_THREADSERVER_S (case 9's recording, overriding that), BENCH_THREADSERVER_RATE
(its requests/s, 2000), BENCH_THREADSERVER_CLIENTS (its client threads, 8), BENCH_CASES (all),
BENCH_SWITCH_RATE (ping-pong switches/s, 40000; 0 = as fast as it goes),
BENCH_ACC_RUNS (case 5's runs per profiler, 2), BENCH_ACC_S (their seconds, 8),
BENCH_STARTUP_RUNS (case 6's warm, cold and py-spy starts, 5 each),
BENCH_SERVER_S (case 10's window per measurement, 10 s), BENCH_SERVER_ROUNDS
(its rounds, 3), BENCH_SERVER_CLIENTS (its client threads, 8), BENCH_TARGETS
(case 11's numbers of targets, 1,10,100), BENCH_TARGETS_S (its recording, 5 s),
BENCH_ALL_PROCS (case 12's Python processes, 50), BENCH_ALL_S (its recording, 20 s),
BENCH_ALL_PAIRS (its A/B pairs, 10), BENCH_ALL_SHORT_EVERY (a short-lived process
started every 0.5 s; 0: none), BENCH_ALL_PYTHONS (its interpreters: paths or
pyenv:VERSION, comma-separated; pyenv's 3.9.18, 3.11.7, 3.12.1, 3.13.0 and
/usr/bin/python3.11),
BENCH_PYTHON (/usr/bin/python3: the interpreter of the targets), BENCH_REV
(benchmark a commit, e.g. HEAD, exported with git archive, instead of the
working tree), BENCH_REFERENCES=0 (leave out case 4's reference programs).
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from harness import (fmt_bytes, fmt_clock, fmt_num, fmt_pct, fmt_ratio_range, markdown_table, median,
                     prog_label, verdict)

from common import (EMPTY_PAIR, EXACT, RESULTS, TIMELINE, ROOT, Results, T0, Tools, _procs, bpfstats, log, profilers, setup_pyspy,
                    starts)
from case_accuracy import accuracy_case, render_accuracy
from shadow import record_both, render_shadow, while_running
from case_allprocs import (ALL_CPU_MAX, ALL_LABEL, ALL_PYTHONS, ALL_SLOWDOWN_MAX, allprocs_case,
                           render_allprocs)
from case_dump import DUMP_THREADS, dump_case, render_dump
from case_exporters import exporters_case
from case_longrun import LONGRUN_GROWTH_MIB, longrun_case, render_longrun
from case_multi import multi_case, render_multi
from case_server import (OWN_US_MAX, PER_REQUEST_US_MAX, per_request_rows, render_server, server_case,
                         server_summary)
from case_slowdown import calibrate, pingpong_kind, slowdown_case
from case_startup import (COLD_RECORDING_S, STARTUP_RSS_MIB, STARTUP_TARGETS, TEARDOWN_S, render_startup,
                          startup_case)
from case_unwind import render_unwind, unwind_case


# -- the report ---------------------------------------------------------------------------------------------
def machine_info(tools: Tools) -> Dict[str, str]:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    virt = ""
    try:
        r = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10)
        m = re.search(r"Hypervisor vendor:\s*(\S+)", r.stdout)
        if m:
            virt = f", {m.group(1)} guest"
    except OSError:
        pass
    try:
        tpy = subprocess.run([tools.python, "-c", "import sys; print(sys.version.split()[0])"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        tpy = "?"
    rev = ""
    try:
        r = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, timeout=10)
        rev = r.stdout.strip()
        if subprocess.run(["git", "-C", ROOT, "diff", "--quiet", "HEAD"], timeout=10).returncode:
            rev += " + uncommitted changes"
    except OSError:
        pass
    return {"cpu": model + virt, "cores": str(os.cpu_count()), "kernel": platform.release(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "target python": f"{tools.python} ({tpy})",
            "py-spy": tools.pyspy_version or "not available", "pyoffcpu": rev or "?"}


def cpu_times() -> List[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def per_switch_ns(b: dict) -> Optional[float]:
    """BPF ns per sched_switch event of one stats run (case 8's summary of
    it): every program that runs once per switch, over the switches."""
    progs = b["progs"]
    sw = progs.get("sched_switch") or progs.get("raw_tracepoint_")
    if not sw or not sw.get("rate"):
        return None
    cpu = sw["cpu"] + (progs.get("rseq_capture") or {}).get("cpu", 0.0)
    return cpu * 1e9 / sw["rate"]


def targets_summary(res: Results) -> List[List[str]]:
    """One row per target of issue #5: what, limit, measured, PASS/MISS."""
    rows = []
    for r in res.overhead:
        if r["target"]:
            rows.append([f"case {r['case']}: {r['profiler']}, median B/A", f"<= {r['target']:.2f}",
                         fmt_num(r["ratio_median"]), verdict(r["ratio_median"], r["target"])])
    # issues 28, 37: BPF ns per switch, case 3 (the target's own) and 4 (another process's):
    # sched_switch's run time (with the programs it tail-calls) and rseq_capture's (a thread's
    # return to user space after each switch), over the switches
    for b in res.bpf or []:
        limit = {"3": 500, "4": 80}.get(str(b["case"]))
        ns = per_switch_ns(b)
        if limit and b["profiler"] == "pyoffcpu --mode wall" and ns is not None:
            what = "a target's switch" if str(b["case"]) == "3" else "another process's switch"
            rows.append([f"case {b['case']}: BPF ns per switch, {what} (sched_switch + rseq_capture)",
                         f"<= {limit}", fmt_num(ns, 0), verdict(ns, limit)])
        if str(b["case"]) == "4" and b["profiler"] == EMPTY_PAIR and ns is not None:
            # the floor: two attached programs that return at once (each run's entry, and the
            # two clock reads kernel.bpf_stats_enabled adds to every run)
            rows.append(["case 4: the same sum for empty programs on both tracepoints (the floor)",
                         "—", fmt_num(ns, 0), "—"])
    if res.accuracy:
        for lb, d in res.accuracy["per"].items():
            if lb.startswith("pyoffcpu"):
                m = median(d["errors"])
                rows.append(["case 5: max error per function (pp)", "<= 1.5",
                             fmt_num(m, 2), verdict(m, 1.5)])
    if res.startup:
        for kind in ("warm", "cold"):
            rs = res.startup.get(kind) or []
            if rs:
                m = median([r["first"] for r in rs])
                lim = STARTUP_TARGETS[kind]
                rows.append([f"case 6: {kind} start to first sample (s)", f"<= {lim:g}", fmt_num(m, 3),
                             verdict(m, lim)])
        for kind, what, lim in (("cold", "cold start, no bcc (the package's programs)", COLD_RECORDING_S),
                                ("cold_bcc", "cold start compiled by bcc (the fallback)", None)):
            rs = res.startup.get(kind) or []
            if rs:
                m = median([r["recording"] for r in rs])
                rows.append([f"case 6: {what}, to `recording` line (s)", f"<= {lim:g}" if lim else "—",
                             fmt_num(m, 3), verdict(m, lim) if lim else ""])
        for kind in ("warm", "cold"):
            rs = res.startup.get(kind) or []
            if rs:
                m = median([r["maxrss_mib"] for r in rs])
                rows.append([f"case 6: peak RSS with children, {kind} start (MiB)", f"<= {STARTUP_RSS_MIB:g}",
                             fmt_num(m, 0), verdict(m, STARTUP_RSS_MIB)])
        for secs in sorted({t["seconds"] for t in res.startup["teardown"] if t["who"] == "pyoffcpu"}):
            m = median([t["file"] for t in res.startup["teardown"] if t["who"] == "pyoffcpu"
                        and t["seconds"] == secs])
            rows.append([f"case 6: teardown after {secs:g} s, SIGINT to SVG written (s)", f"<= {TEARDOWN_S:g}",
                         fmt_num(m, 2), verdict(m, TEARDOWN_S)])
    for d in res.exporters:
        if d["format"] == "svg":
            rows.append(["case 7: SVG export of 1M samples / 50k stacks (s)", "<= 10",
                         fmt_num(d["export_s"], 2), verdict(d["export_s"], 10.0)])
    if res.longrun:
        g = res.longrun.get("growth_mib")
        rows.append([f"case 9: pyoffcpu RSS growth after the first minute, {fmt_clock(res.longrun['seconds'])} "
                     "of a thread-per-request server (MiB)", f"<= {LONGRUN_GROWTH_MIB:g}", fmt_num(g, 0),
                     verdict(g, LONGRUN_GROWTH_MIB)])
    if res.server:
        for r in server_summary(res.server):
            if r["target"]:
                rows.append([f"case 10: {r['label']}, loss of a thread-per-request server's requests/s",
                             f"<= {100 * r['target']:g}%", fmt_pct(r["loss"]), verdict(r["loss"], r["target"])])
        for r in per_request_rows(res.server):
            if r["label"] == "pyoffcpu --mode wall":
                rows.append(["case 10: pyoffcpu --mode wall, profiler CPU per request of a thread-per-request "
                             "server, BPF + own (µs)", f"<= {PER_REQUEST_US_MAX:g}", fmt_num(r["total_us"], 1),
                             verdict(r["total_us"], PER_REQUEST_US_MAX)])
                rows.append(["case 10: pyoffcpu --mode wall, ... its own processes' CPU per request, steady "
                             "state (µs)", f"<= {OWN_US_MAX:g}", fmt_num(r["own_us"], 1),
                             verdict(r["own_us"], OWN_US_MAX)])
    if res.allprocs:
        d = res.allprocs
        rec = d.get("recording")
        if rec:
            ws = rec.get("window_share")
            rows.append([f"case 12: {ALL_LABEL} beside {d['procs']} Python processes, its own CPU "
                         "(% of one core)", f"<= {100 * ALL_CPU_MAX:g}%",
                         f"{100 * ws:.2f}%" if ws is not None else "n/a", verdict(ws, ALL_CPU_MAX)])
        ab = d.get("ab")
        if ab:
            rows.append([f"case 12: {ALL_LABEL}, a CPU-bound process beside it, median B/A",
                         f"<= {ALL_SLOWDOWN_MAX:.2f}", fmt_num(ab["ratio_median"]),
                         verdict(ab["ratio_median"], ALL_SLOWDOWN_MAX)])
    if res.crashes and res.crashes.get("ab"):
        import case_crashes
        ab = res.crashes["ab"]
        rows.append([f"case 18: {case_crashes.CRASH_LABEL}, a CPU-bound process beside it, median B/A",
                     f"<= {case_crashes.CRASH_SLOWDOWN_MAX:.2f}", fmt_num(ab["ratio_median"]),
                     verdict(ab["ratio_median"], case_crashes.CRASH_SLOWDOWN_MAX)])
    if res.threads and res.threads.get("cold"):
        import case_threads
        cold = case_threads.cold_median(res.threads)
        rows.append([f"case 19: {case_threads.LABEL}, cold caches: native-stack time without a table",
                     f"<= {case_threads.NOT_READY_MAX:g}%", f"{cold:.1f}%",
                     verdict(cold, case_threads.NOT_READY_MAX)])
    return rows


def render(res: Results, machine: Dict[str, str], args, wall_s: float, steal: Optional[float]) -> str:
    out = []
    out.append("## Machine\n")
    for k, v in machine.items():
        out.append(f"- {k}: {v}")
    out.append(f"- load average at the end: {' '.join(open('/proc/loadavg').read().split()[:3])}"
               + (f"; CPU time stolen by the hypervisor during the bench: {steal:.1f}%" if steal is not None else ""))
    out.append(f"- bench: {args.pairs} pairs per row, {args.work_s:g} s of work per run, "
               f"total {wall_s / 60:.1f} min")
    out.append("")
    summary = targets_summary(res)
    if summary:
        out.append("## Targets (issues #5, #8 and #10; reports, not test failures)\n")
        out.append(markdown_table(["target", "limit", "measured", ""], summary, "lrrl"))
        out.append("")
    if res.overhead:
        out.append("## Slowdown (cases 1-4): B/A per pair, A = target alone, B = profiled\n")
        rows = []
        for r in res.overhead:
            name = {"1": "1 CPU-bound, 1 thread", "2": "2 busy + 150 blocked threads",
                    "3": "3 switch-heavy ping-pong", "4": "4 bystander: ping-pong beside"}[r["case"]]
            if r.get("switch_rate"):
                name += f" ({r['switch_rate'] / 1000:.0f}k switches/s)"
            tgt = r["target"]
            wait = ("n/a" if r["wait_a"] is None else
                    f"{100 * r['wait_a']:.0f}% / {100 * r['wait_b']:.0f}%")
            rows.append([name, r["profiler"], f"{r['n']}" + (f" ({r['failures']} failed)" if r["failures"] else ""),
                         fmt_num(r["a_median"]), fmt_num(r["b_median"]), fmt_num(r["ratio_median"]),
                         fmt_ratio_range(r["ratio_min"], r["ratio_max"]),
                         f"<= {tgt:.2f}" if tgt else "—", verdict(r["ratio_median"], tgt),
                         fmt_num(r["cpu_ratio_median"]), fmt_ratio_range(r["cpu_ratio_min"], r["cpu_ratio_max"]),
                         wait])
        out.append(markdown_table(["case", "profiler", "pairs", "alone s (median)", "profiled s (median)",
                                   "ratio median", "ratio min–max", "target", "",
                                   "CPU-time ratio median", "CPU-time ratio min–max",
                                   "waiting for a CPU A / B"],
                                  rows, "llrrrrrrlrrr"))
        out.append("")
        out.append("Each pair: one fresh target process, a warm-up, then the fixed work once alone (A) and "
                   "once with the profiler attached (B), AB and BA alternating; the profiler is started "
                   "before B and has exited before A, so neither time holds its start-up or teardown. "
                   "Case 4 profiles a second, idle process; the ping-pong process is not profiled. "
                   "The verdict is on wall time. The CPU-time ratio (the target's user+system time, "
                   "which includes BPF run in its context) and the share of the run the target spent "
                   "runnable but waiting for a CPU (medians, A / B; summed over the target's threads, so "
                   "it can pass 100%) show how much of the spread is the machine's other load. The "
                   "ping-pong threads are pinned to one CPU, so for them waiting for a CPU is part of "
                   "the design.")
        out.append("")
    if res.bpf:
        out.append("## BPF cost (case 8): run time per event of the programs, kernel.bpf_stats_enabled\n")
        rows = []
        for b in res.bpf:
            for name, d in sorted(b["progs"].items()):
                rows.append([b["case"], b["profiler"], prog_label(name),
                             fmt_num(d["per_event"], 0) if d["per_event"] is not None else "no runs",
                             f"{d['rate']:.0f}" if d["rate"] is not None else "n/a",
                             f"{100 * d['cpu']:.2f}%" if d["cpu"] is not None else "n/a"])
        out.append(markdown_table(["case", "profiler", "program", "ns per event", "events/s",
                                   "CPU (share of one core)"], rows, "lllrrr"))
        out.append("")
        out.append("From one more profiled run per row, the only runs with kernel.bpf_stats_enabled=1 (it "
                   "adds two clock reads to every program run, so the slowdown pairs run without it). "
                   "Events are every run of the program, filtered out or not: sched_switch runs for every "
                   "switch on the machine, on_cpu_sample for every tick of every CPU that is not idle.")
        out.append("")
    if res.shadow:
        out.extend(render_shadow(res.shadow))
    if res.accuracy:
        out.extend(render_accuracy(res.accuracy))
    if res.startup:
        out.extend(render_startup(res.startup, args))
    if res.exporters:
        out.append("## Exporters (case 7): synthetic profile, 1,000,000 samples over 50,000 stacks\n")
        rows = []
        for d in res.exporters:
            tgt = 10.0 if d["format"] == "svg" else None
            rows.append([d["format"], f"{d['build_s']:.2f}", f"{d['export_s']:.2f}",
                         fmt_bytes(d["rss_after_build"]), fmt_bytes(d["maxrss"]), fmt_bytes(d["bytes"]),
                         f"<= {tgt:g} s" if tgt else "—", verdict(d["export_s"], tgt)])
        out.append(markdown_table(["format", "build Profile s", "export s", "RSS after build",
                                   "peak RSS", "output", "target", ""], rows, "lrrrrrrl"))
        out.append("")
        out.append("Each format in its own process; peak RSS is its ru_maxrss (Profile included).")
        out.append("")
    if res.longrun:
        out.extend(render_longrun(res.longrun, args))
    if res.server:
        out.extend(render_server(res.server))
    if res.multi:
        out.extend(render_multi(res.multi))
    if res.allprocs:
        out.extend(render_allprocs(res.allprocs))
    if res.dump:
        out.extend(render_dump(res.dump))
    if res.unwind:
        out.extend(render_unwind(res.unwind))
    if res.torch:
        import case_torch
        out.extend(case_torch.render_torch(res.torch, markdown_table, median))
    if res.py315:
        import case_py315
        out.extend(case_py315.render_py315(res.py315))
    if res.asyncio:
        import case_async
        out.extend(case_async.render_async(res.asyncio))
    if res.crashes:
        import case_crashes
        out.extend(case_crashes.render_crashes(res.crashes))
    if res.threads:
        import case_threads
        out.extend(case_threads.render_threads(res.threads))
    if res.notes:
        out.append("## Notes\n")
        out.extend(f"- {n}" for n in res.notes)
        out.append("")
    if res.errors:
        out.append("## Failed measurements\n")
        out.extend(f"- {e}" for e in res.errors)
        out.append("")
    return "\n".join(out)


def chroot_case(res, case: str, what: str, available, run):
    """A case that needs the chroot's interpreters: left out with the reason
    when they are not there, its failure kept as an error; its result or None."""
    why = available()
    if why:
        res.errors.append(f"case {case}: {why}")
        log(f"case {case}: left out: {why}")
        return None
    log(f"case {case}: {what}")
    try:
        return run()
    except Exception as e:                              # noqa: BLE001
        res.errors.append(f"case {case}: {e}")
        log(f"case {case}: FAILED: {e}")
        return None


def build_helper(tree: str) -> None:
    """The compiled helper (pyoffcpu-elf: the only builder of unwind tables
    and symbol indexes) is a build output, not in a `git archive`: built in
    the tree as `make helper` builds it, against this venv's capstone."""
    if os.access(os.path.join(tree, "pytool", "pyoffcpu", "native", "helper", "pyoffcpu-elf"), os.X_OK):
        return
    venv = sys.prefix if os.path.exists(os.path.join(sys.prefix, ".installed")) else os.path.join(ROOT, ".venv")
    # -o: the venv counts as made (its recipe would install the tree into it)
    installed = os.path.join(venv, ".installed")
    try:
        subprocess.run(["make", "-s", "-C", tree, "-o", installed, "helper", f"VENV={venv}"], check=True,
                       stdout=subprocess.DEVNULL)
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"bench: cannot build the helper in {tree}: {e}")


# -- main ----------------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=int(os.environ.get("BENCH_PAIRS", 7)))
    ap.add_argument("--work-s", type=float, default=float(os.environ.get("BENCH_WORK_S", 1.0)))
    ap.add_argument("--long-s", type=float, default=float(os.environ.get("BENCH_LONG_S", 60)))
    ap.add_argument("--cases", default=os.environ.get("BENCH_CASES", "1,2,3,4,5,6,7,9,10,11,12,13,14,15,16,17,18,19"),
                    help="comma-separated subset of 1-7 and 9-12 (8 comes with 1-4)")
    ap.add_argument("--threadserver-s", type=float,
                    default=float(os.environ["BENCH_THREADSERVER_S"]) if os.environ.get("BENCH_THREADSERVER_S")
                    else None,
                    help="case 9's recording in seconds (default: max(120, --long-s))")
    ap.add_argument("--threadserver-rate", type=float,
                    default=float(os.environ.get("BENCH_THREADSERVER_RATE", 2000)),
                    help="case 9's requests/s (each a new connection and a new server thread)")
    ap.add_argument("--threadserver-clients", type=int,
                    default=int(os.environ.get("BENCH_THREADSERVER_CLIENTS", 8)),
                    help="case 9's client threads (in a process of their own)")
    ap.add_argument("--server-s", type=float, default=float(os.environ.get("BENCH_SERVER_S", 10)),
                    help="case 10's window in seconds, per measurement")
    ap.add_argument("--server-rounds", type=int, default=int(os.environ.get("BENCH_SERVER_ROUNDS", 3)),
                    help="case 10's rounds (each: every configuration once, a fresh server each)")
    ap.add_argument("--server-clients", type=int, default=int(os.environ.get("BENCH_SERVER_CLIENTS", 8)),
                    help="case 10's client threads (in a process of their own, as fast as they go)")
    ap.add_argument("--targets", default=os.environ.get("BENCH_TARGETS", "1,10,100"),
                    help="case 11's numbers of target processes, comma-separated")
    ap.add_argument("--targets-s", type=float, default=float(os.environ.get("BENCH_TARGETS_S", 5)),
                    help="case 11's recording (-d) in seconds")
    ap.add_argument("--all-procs", type=int, default=int(os.environ.get("BENCH_ALL_PROCS", 50)),
                    help="case 12's Python processes alive at a time (the short-lived ones included)")
    ap.add_argument("--all-s", type=float, default=float(os.environ.get("BENCH_ALL_S", 20)),
                    help="case 12's recording (-d) in seconds; its CPU window: 2 s to 12 s into it")
    ap.add_argument("--all-pairs", type=int, default=int(os.environ.get("BENCH_ALL_PAIRS", 10)),
                    help="case 12's A/B pairs (each with an A/A pair)")
    ap.add_argument("--all-short-every", type=float, default=float(os.environ.get("BENCH_ALL_SHORT_EVERY", 0.5)),
                    help="case 12: a short-lived process started every this many seconds (0: none)")
    ap.add_argument("--all-pythons", default=os.environ.get("BENCH_ALL_PYTHONS", ALL_PYTHONS),
                    help="case 12's interpreters, comma-separated: paths or pyenv:VERSION")
    ap.add_argument("--python", default=os.environ.get("BENCH_PYTHON", "/usr/bin/python3"))
    ap.add_argument("--accuracy-runs", type=int, default=int(os.environ.get("BENCH_ACC_RUNS", 2)))
    ap.add_argument("--accuracy-s", type=float, default=float(os.environ.get("BENCH_ACC_S", 8)))
    ap.add_argument("--startup-runs", type=int, default=int(os.environ.get("BENCH_STARTUP_RUNS", 5)))
    ap.add_argument("--rev", default=os.environ.get("BENCH_REV"),
                    help="benchmark this commit (git archive into a temporary folder) instead of "
                         "the working tree, e.g. HEAD while others have uncommitted edits")
    ap.add_argument("--tree", default=os.environ.get("BENCH_TREE"),
                    help="run pyoffcpu from this source tree (e.g. a `git archive` of a commit) "
                         "instead of the installed one")
    ap.add_argument("--switch-rate", type=float, default=float(os.environ.get("BENCH_SWITCH_RATE", 40000)),
                    help="context switches/s of the ping-pong in cases 3 and 4 (the issue: tens of "
                         "thousands); 0: no work between round trips, as fast as the machine switches")
    ap.add_argument("--no-references", dest="references", action="store_false",
                    default=os.environ.get("BENCH_REFERENCES", "1") != "0",
                    help="leave out case 4's reference programs (empty tracepoint, raw tracepoint, empty pair)")
    ap.add_argument("--results", default=RESULTS, help="Markdown file to write (- for none)")
    ap.add_argument("--keep", action="store_true", help="keep the profiles written (their folder is printed)")
    args = ap.parse_args()
    cases = {c.strip() for c in args.cases.split(",") if c.strip()}

    if os.geteuid() != 0:
        sys.exit("bench: needs root (BPF, pidfd_getfd, the bpf_stats sysctl): run 'sudo make bench'")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    pyoffcpu_exe = os.path.join(os.path.dirname(sys.executable), "pyoffcpu")
    po = [pyoffcpu_exe] if os.path.exists(pyoffcpu_exe) else [sys.executable, "-m", "pyoffcpu"]
    env = None
    label = ""
    if args.rev:
        args.tree = tempfile.mkdtemp(prefix="pyoffcpu-bench-src-")
        try:
            rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", args.rev], check=True,
                                 capture_output=True, text=True).stdout.strip()
            archive = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", rev], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", args.tree], input=archive, check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            sys.exit(f"bench: cannot export {args.rev}: {e}")
        label = f"{rev} ({args.rev}, exported with git archive; uncommitted edits not included)"
    elif args.tree:
        label = f"source tree {os.path.abspath(args.tree)}"
    if args.tree:
        tree = os.path.abspath(args.tree)
        if not os.path.isfile(os.path.join(tree, "pytool", "pyoffcpu", "cli.py")):
            sys.exit(f"bench: {tree} is not a pyoffcpu source tree")
        build_helper(tree)
        env = dict(os.environ, PYTHONPATH=os.path.join(tree, "pytool"))
        po = [sys.executable, "-m", "pyoffcpu"]
    pyspy, pyspy_version = setup_pyspy() if cases & {"1", "2", "3", "5", "6", "10", "13", "15", "16"} else (None, "")
    tools = Tools(args.python, po, pyspy, pyspy_version, tempfile.mkdtemp(prefix="pyoffcpu-bench-"), env)
    tools.cache_dir = os.path.join(tools.outdir, "cache")
    tools.profs = profilers(tools)
    res = Results()
    machine = machine_info(tools)
    if label:
        machine["pyoffcpu"] = label
    cpu0 = cpu_times()
    sysctl = tools.sysctl = bpfstats.StatsSysctl()
    try:
        if not sysctl.available:
            res.notes.append("kernel.bpf_stats_enabled cannot be read: no BPF run times")
        elif sysctl.original != "0":
            res.notes.append(f"kernel.bpf_stats_enabled was {sysctl.original} when the bench started "
                             "and stayed so: the slowdown pairs include its cost")
        P = tools.profs
        four = [P[k] for k in ("pyoffcpu --mode cpu -F 99", "pyoffcpu --mode wall", "py-spy record -r 100",
                               "py-spy record --native -r 100") if k in P]
        t12 = {"pyoffcpu --mode cpu -F 99": 1.02, "pyoffcpu --mode wall": 1.03}
        if cases & {"1", "2"}:
            n_cpu = calibrate(tools, "cpu", 2000, args.work_s)
        if "1" in cases:
            log("case 1: CPU-bound, one thread")
            slowdown_case(tools, res, "1", "cpu", n_cpu, four, args.pairs, t12)
        if "2" in cases:
            log("case 2: one busy thread + 150 blocked")
            slowdown_case(tools, res, "2", "threads", n_cpu, four, args.pairs, t12)
        if cases & {"3", "4"}:
            pp = pingpong_kind(tools, args.switch_rate)
            n_pp = calibrate(tools, pp, 20000, args.work_s)
        if "3" in cases:
            log("case 3: switch-heavy ping-pong")
            three = [P[k] for k in ("pyoffcpu --mode wall", EXACT, TIMELINE, "pyoffcpu --mode wall --wakers",
                                    "py-spy record --idle -r 100") if k in P]
            slowdown_case(tools, res, "3", pp, n_pp, three, args.pairs,
                          {"pyoffcpu --mode wall": 1.03, "pyoffcpu --mode wall --wakers": 1.10})  # issues 37, 12
            w = tools.worker(pp)
            try:
                got = while_running(lambda: w.start_run(n_pp * 100), w.close,
                                    lambda: record_both(tools, "3", ["-p", str(w.pid), "--mode", "wall"], 10.0,
                                                        "c3-shadow"))
                if got:
                    res.shadow.append(got)
            except Exception as e:                              # noqa: BLE001
                res.errors.append(f"case 3 sampled against exact: {e}")
        if "4" in cases:
            log("case 4: bystander")
            refs = [v for k, v in P.items() if k.startswith("reference:")] if args.references else []
            slowdown_case(tools, res, "4", pp, n_pp, [P["pyoffcpu --mode wall"]] + refs, args.pairs,
                          {"pyoffcpu --mode wall": 1.01}, bystander=True)   # issue 10
        if "5" in cases:
            log("case 5: accuracy")
            accuracy_case(tools, res, args.accuracy_runs, args.accuracy_s)
        if "6" in cases:
            log("case 6: startup and teardown")
            startup_case(tools, res, args.startup_runs, 10.0, args.long_s)
        if "7" in cases:
            log("case 7: exporters")
            exporters_case(tools, res)
        if "9" in cases:
            secs = args.threadserver_s if args.threadserver_s else max(120.0, args.long_s)
            log(f"case 9: thread-per-request server, {secs:g} s recording")
            longrun_case(tools, res, secs, args.threadserver_rate, args.threadserver_clients, keep=args.keep)
        if "10" in cases:
            log(f"case 10: thread-per-request server throughput, {args.server_rounds} rounds x "
                f"{args.server_s:g} s")
            server_case(tools, res, args.server_s, args.server_rounds, args.server_clients)
        if "11" in cases:
            counts = sorted({int(c) for c in args.targets.split(",") if c.strip()})
            log(f"case 11: one session over {', '.join(map(str, counts))} target processes")
            multi_case(tools, res, counts, args.targets_s)
        if "12" in cases:
            log(f"case 12: {ALL_LABEL} beside {args.all_procs} Python processes, {args.all_s:g} s recording, "
                f"{args.all_pairs} pairs")
            allprocs_case(tools, res, args.all_procs, args.all_s, args.all_pairs, args.work_s, args.all_pythons,
                          short_every=args.all_short_every, keep=args.keep)
        if "13" in cases:
            log(f"case 13: dump of a {DUMP_THREADS}-thread process")
            dump_case(tools, res)
        if "14" in cases:
            log("case 14: code without CFI: numpy's OpenBLAS")
            unwind_case(tools, res)
        if "16" in cases:
            import case_py315
            res.py315 = chroot_case(res, "16", "CPython 3.15 beside its own sampler", case_py315.available,
                                    lambda: case_py315.py315_case(tools, args.pairs, args.work_s,
                                                                  args.accuracy_runs, args.accuracy_s,
                                                                  args.switch_rate))
        if "17" in cases:
            import case_async
            res.asyncio = chroot_case(res, "17", "asyncio on 3.15, --async beside its sampler",
                                      case_async.available,
                                      lambda: case_async.async_case(tools, args.pairs, args.work_s))
        if "18" in cases:
            log(f"case 18: the crash watcher, {args.pairs} pairs")
            import case_crashes
            case_crashes.crashes_case(tools, res, args.pairs, args.work_s)
        if "19" in cases:
            log("case 19: the first recording of a 2,000-thread process")
            import case_threads
            try:
                case_threads.threads_case(tools, res)
            except Exception as e:                              # noqa: BLE001
                res.errors.append(f"case 19: {e}")
                log(f"case 19: FAILED: {e}")
        if "15" in cases:
            log("case 15: PyTorch as it is run")
            import case_torch
            try:
                res.torch = case_torch.torch_case(tools, starts, log)
                if res.torch.get("shadow"):
                    res.shadow.append(res.torch["shadow"])
            except Exception as e:                              # noqa: BLE001
                res.errors.append(f"case 15: {e}")
                log(f"case 15: FAILED: {e}")
    except KeyboardInterrupt:
        res.errors.append("interrupted: the tables hold what was measured before")
    finally:
        sysctl.off()
        for p in _procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    cpu1 = cpu_times()
    steal = None
    if len(cpu1) > 7:
        d = [b - a for a, b in zip(cpu0, cpu1)]
        steal = 100 * d[7] / max(1, sum(d[:8]))
    wall = time.monotonic() - T0
    report = render(res, machine, args, wall, steal)
    print(report)
    if args.results != "-":
        knobs = " ".join(f"{k}={os.environ[k]}" for k in sorted(os.environ) if k.startswith("BENCH_"))
        cmd = (knobs + " " if knobs else "") + ("make bench" if os.environ.get("MAKELEVEL") else " ".join(
            [os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT) else sys.executable,
             os.path.relpath(os.path.abspath(__file__), ROOT)] + sys.argv[1:]))
        with open(args.results, "w") as f:
            f.write(f"# pyoffcpu bench results\n\n{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, "
                    f"`{cmd}` (tools/bench/run.py)\n\n{report}\n")
        log(f"wrote {os.path.relpath(args.results, ROOT)}")
    if args.keep:
        log(f"profiles kept in {tools.outdir}")
    else:
        shutil.rmtree(tools.outdir, ignore_errors=True)
    if args.rev:
        shutil.rmtree(args.tree, ignore_errors=True)


if __name__ == "__main__":
    main()
