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
 15 PyTorch as it is run (issue 23, tools/bench/torch_case.py): a training loop with
    DataLoader workers, ~90 executable files; cold and warm starts (first sample, tables
    ready, each library's build, peak RSS with children, end of recording to profile),
    training steps/s under --mode wall / --mode cpu / py-spy --idle against alone windows
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
import glob
import json
import os
import platform
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

sys.path.insert(0, os.path.join(ROOT, "tools"))

import bpfstats  # noqa: E402
import startup as starts  # noqa: E402  (tools/startup.py: one start of pyoffcpu, measured)
from harness import (Pairs, checkpoints, counts_by_checkpoint, fmt_bytes, fmt_clock,  # noqa: E402
                     fmt_num, fmt_pct, fmt_range, fmt_ratio_range, folded_summary, function_shares,
                     latest_before, linear_slope, loss, maps_memlock, markdown_table, max_error_pp, median,
                     parse_drop_defines, parse_drops_line, parse_folded, parse_stats_lines,
                     per_round_losses, proc_stat_cpu_ticks, proc_status_kib, prog_delta, prog_label,
                     rotated, rss_growth, spread, verdict)

WORKLOADS = os.path.join(HERE, "workloads.py")
EXPORTERS = os.path.join(HERE, "exporters.py")
FLOOR = os.path.join(HERE, "floor.py")
THREADSERVER = os.path.join(HERE, "threadserver.py")
RESULTS = os.path.join(HERE, "results.md")
BENCH_VENV = os.path.join(HERE, ".venv")
PYSPY_VERSION = "0.4.3"
SETTLE_S = 0.3              # after a profiler says it is sampling, before the work starts

T0 = time.monotonic()
_procs: List[subprocess.Popen] = []      # everything started here, to end on the way out


def log(msg: str):
    sys.stderr.write(f"[bench {time.monotonic() - T0:6.1f}s] {msg}\n")
    sys.stderr.flush()


# -- processes -----------------------------------------------------------------------
class Proc:
    """A child with its stdout lines in a queue and its stderr lines timestamped."""

    def __init__(self, argv: List[str], stdin: bool = False, merge: bool = False,
                 env: Optional[Dict[str, str]] = None):
        """merge: stdout and stderr both into the timestamped lines (py-spy
        says `Sampling process` on stdout)."""
        self.argv = argv
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                  stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True,
                                  bufsize=1, errors="replace", env=env)
        self.started = time.monotonic()
        _procs.append(self.p)
        self.pid = self.p.pid
        self.out: "queue.Queue[str]" = queue.Queue()
        self.err: List[Tuple[float, str]] = []
        self._err_cv = threading.Condition()
        if merge:
            threading.Thread(target=self._read_err, args=(self.p.stdout,), daemon=True).start()
        else:
            threading.Thread(target=self._read_out, daemon=True).start()
            threading.Thread(target=self._read_err, args=(self.p.stderr,), daemon=True).start()

    def _read_out(self):
        for line in self.p.stdout:
            self.out.put(line.rstrip("\n"))
        self.out.put(None)

    def _read_err(self, stream):
        for line in stream:
            with self._err_cv:
                self.err.append((time.monotonic(), line.rstrip("\n")))
                self._err_cv.notify_all()
        with self._err_cv:
            self.err.append((time.monotonic(), None))
            self._err_cv.notify_all()

    def err_line(self, pattern: str) -> Optional[float]:
        """When a stderr line matching `pattern` came, or None (not yet)."""
        rx = re.compile(pattern)
        with self._err_cv:
            for t, line in self.err:
                if line is not None and rx.search(line):
                    return t
        return None

    def wait_err(self, pattern: str, timeout: float) -> float:
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        seen = 0
        with self._err_cv:
            while True:
                for t, line in self.err[seen:]:
                    if line is None:
                        raise RuntimeError(f"{self.argv[0]} exited before {pattern!r}: {self.stderr_tail()}")
                    if rx.search(line):
                        return t
                seen = len(self.err)
                left = end - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{os.path.basename(self.argv[0])}: no {pattern!r} after {timeout:.0f}s: "
                                       f"{self.stderr_tail()}")
                self._err_cv.wait(min(left, 0.5))

    def stderr_tail(self, n: int = 3) -> str:
        with self._err_cv:
            lines = [line for _, line in self.err if line]
        return " | ".join(lines[-n:])

    def send(self, line: str):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def expect(self, prefix: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no {prefix!r} from {self.argv[1:3]} after {timeout:.0f}s")
            try:
                line = self.out.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"{self.argv[1:3]} exited before {prefix!r}: {self.stderr_tail()}")
            if line.startswith(prefix):
                return line

    def interrupt(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)

    def wait(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"{os.path.basename(self.argv[0])} did not exit within {timeout:.0f}s")

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()

    def close(self, timeout: float = 5):
        """A process that reads commands on stdin: `exit`, then killed if it
        has not gone within timeout."""
        if self.p.poll() is None:
            try:
                self.send("exit")
                self.p.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


class Worker(Proc):
    def __init__(self, python: str, kind: str):
        """kind: a workload of workloads.py, with its argument if any ("pingpong 40")."""
        super().__init__([python, WORKLOADS, *kind.split()], stdin=True)
        self.expect("ready", 30)

    def run(self, n, timeout: float = 300) -> Tuple[float, dict]:
        self.send(f"run {n}")
        _, dt, extra = self.expect("done ", timeout).split(" ", 2)
        return float(dt), json.loads(extra)

    def start_run(self, n):
        """Start work without waiting for it (startup/teardown targets)."""
        self.send(f"run {n}")


# -- profilers ---------------------------------------------------------------------------
@dataclass
class Profiler:
    label: str
    argv: Callable[[int, str], List[str]]     # (pid, output path without extension)
    ready: str                                # stderr line that says it samples
    pyoffcpu: bool
    stats: bool = False                       # read its BPF programs' run times
    merge: bool = False                       # its ready line comes on stdout (py-spy)


def profilers(tools: "Tools") -> Dict[str, Profiler]:
    po, ps = tools.pyoffcpu, tools.pyspy
    out = {
        "pyoffcpu --mode cpu -F 99": Profiler(
            "pyoffcpu --mode cpu -F 99",
            lambda pid, o: po + ["-p", str(pid), "--mode", "cpu", "-F", "99", "-o", o + ".folded"],
            r"^pyoffcpu: recording", True, stats=True),
        "pyoffcpu --mode wall": Profiler(
            "pyoffcpu --mode wall",
            lambda pid, o: po + ["-p", str(pid), "--mode", "wall", "-F", "99", "-o", o + ".folded"],
            r"^pyoffcpu: recording", True, stats=True),
        "pyoffcpu --mode wall --wakers": Profiler(
            "pyoffcpu --mode wall --wakers",
            lambda pid, o: po + ["-p", str(pid), "--mode", "wall", "-F", "99", "--wakers",
                                 "-o", o + ".folded"],
            r"^pyoffcpu: recording", True, stats=True),
    }
    for kind, label in (("tp-empty", "reference: empty program on the sched_switch tracepoint"),
                        ("raw-filter", "reference: raw tracepoint, 2 hash lookups")):
        out[label] = Profiler(label, (lambda kind: lambda pid, o: [sys.executable, FLOOR, kind])(kind),
                              r"^floor: attached", False, stats=True)
    if ps:
        for label, extra in (("py-spy record -r 100", []), ("py-spy record --native -r 100", ["--native"]),
                             ("py-spy record --idle -r 100", ["--idle"])):
            out[label] = Profiler(
                label,
                (lambda extra: lambda pid, o: ps + ["record", "-p", str(pid), "-r", "100", *extra,
                                                    "-f", "raw", "-o", o + ".txt"])(extra),
                r"py-spy> Sampling process", False, merge=True)
    return out


@dataclass
class Tools:
    python: str
    pyoffcpu: List[str]
    pyspy: Optional[List[str]]
    pyspy_version: str = ""
    outdir: str = ""
    env: Optional[Dict[str, str]] = None       # for pyoffcpu and the exporters (--tree)
    sysctl: Optional[bpfstats.StatsSysctl] = None
    profs: Dict[str, "Profiler"] = field(default_factory=dict)
    cache_dir: str = ""                         # the bench's PYOFFCPU_CACHE_DIR (cases 6 and 11)


def setup_pyspy() -> Tuple[Optional[List[str]], str]:
    """py-spy from PyPI in tools/bench/.venv (made once, idempotent)."""
    exe = os.path.join(BENCH_VENV, "bin", "py-spy")

    def version():
        try:
            return subprocess.run([exe, "--version"], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except OSError:
            return ""
    v = version()
    if v != f"py-spy {PYSPY_VERSION}":
        log(f"installing py-spy {PYSPY_VERSION} into {os.path.relpath(BENCH_VENV, ROOT)}")
        try:
            if not os.path.exists(os.path.join(BENCH_VENV, "bin", "pip")):
                subprocess.run(["/usr/bin/python3", "-m", "venv", BENCH_VENV], check=True)
            subprocess.run([os.path.join(BENCH_VENV, "bin", "pip"), "install", "-q",
                            "--disable-pip-version-check", f"py-spy=={PYSPY_VERSION}"], check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            log(f"py-spy unavailable ({e}): its rows are left out")
            return None, ""
        v = version()
    return [exe], v


# -- results ---------------------------------------------------------------------------------
@dataclass
class Results:
    overhead: List[dict] = field(default_factory=list)
    bpf: List[dict] = field(default_factory=list)
    accuracy: Optional[dict] = None
    startup: Optional[dict] = None
    exporters: List[dict] = field(default_factory=list)
    longrun: Optional[dict] = None
    server: Optional[dict] = None               # case 10
    multi: Optional[dict] = None                # case 11
    allprocs: Optional[dict] = None             # case 12
    dump: Optional[dict] = None                 # case 13
    unwind: Optional[dict] = None               # case 14
    torch: Optional[dict] = None                # case 15
    notes: List[str] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)


# -- slowdown pairs -------------------------------------------------------------------------------
def profiled_run(tools: Tools, prof: Profiler, target_pid: int, work: Callable[[], Tuple[float, dict]],
                 tag: str, with_stats: bool = False) -> Tuple[float, dict, Dict[str, Tuple[int, int]]]:
    """Attach `prof` to target_pid, do `work`, stop the profiler (SIGINT, its
    file written). Returns (work seconds, work extra, BPF program run-time
    deltas over the work when with_stats)."""
    out = os.path.join(tools.outdir, tag)
    p = Proc(prof.argv(target_pid, out), merge=prof.merge, env=tools.env if prof.pyoffcpu else None)
    stats = None
    try:
        p.wait_err(prof.ready, 120)
        time.sleep(SETTLE_S)
        if with_stats:
            stats = bpfstats.ProgStats(p.pid)
            before = stats.read()
        dt, extra = work()
        delta = prog_delta(before, stats.read()) if stats else {}
        p.interrupt()
        rc = p.wait(180)
        if rc != 0:
            raise RuntimeError(f"{prof.label} exited {rc}: {p.stderr_tail()}")
        return dt, extra, delta
    finally:
        if stats:
            stats.close()
        p.kill()


def slowdown_case(tools: Tools, res: Results, case: str, kind: str, n: int, profs: List[Profiler],
                  pairs: int, targets: Dict[str, float], bystander: bool = False):
    """`pairs` A/B pairs for each profiler, profilers rotated round by round."""
    acc = {p.label: Pairs() for p in profs}
    extra_a: Dict[str, list] = {p.label: [] for p in profs}
    for i in range(pairs):
        for j in range(len(profs)):
            k = (i + j) % len(profs)
            prof = profs[k]
            order = "AB" if (i + k) % 2 == 0 else "BA"      # alternates pair to pair for each profiler
            tag = f"c{case}-{kind.split()[0]}-{i}-{j}"
            w = Worker(tools.python, kind)
            idle = Worker(tools.python, "idle") if bystander else None
            try:
                w.run(max(1, n // 5))                           # warm-up
                target = idle.pid if bystander else w.pid

                def a():
                    return w.run(n)

                def b():
                    return profiled_run(tools, prof, target, lambda: w.run(n), tag)
                if order == "AB":
                    ta, xa = a()
                    tb, xb, _ = b()
                else:
                    tb, xb, _ = b()
                    ta, xa = a()
                acc[prof.label].add(ta, tb, cpu=(xa.get("cpu_s", 0), xb.get("cpu_s", 0)),
                                    wait=(xa.get("rq_s", 0), xb.get("rq_s", 0)))
                extra_a[prof.label].append(xa)
                log(f"case {case} pair {i + 1}/{pairs} {order} {prof.label}: "
                    f"A {ta:.3f}s B {tb:.3f}s ratio {tb / ta:.3f} "
                    f"(CPU {xa.get('cpu_s', 0):.3f}s/{xb.get('cpu_s', 0):.3f}s, "
                    f"waiting for a CPU {xa.get('rq_s', 0):.3f}s/{xb.get('rq_s', 0):.3f}s)")
            except Exception as e:                              # noqa: BLE001 - reported, bench goes on
                acc[prof.label].failures.append(str(e))
                res.errors.append(f"case {case} {prof.label} pair {i + 1}: {e}")
                log(f"case {case} pair {i + 1} {prof.label}: FAILED: {e}")
            finally:
                w.close()
                if idle:
                    idle.close()
    for prof in profs:
        s = acc[prof.label].summary()
        row = {"case": case, "kind": kind, "profiler": prof.label, **s,
               "failures": len(acc[prof.label].failures), "target": targets.get(prof.label)}
        sw = [x["switches"] / x["seconds"] for x in extra_a[prof.label] if x.get("switches")]
        if sw:
            row["switch_rate"] = median(sw)
        res.overhead.append(row)
    for prof in profs:
        if prof.stats and tools.sysctl is not None and tools.sysctl.available:
            stats_run(tools, res, case, kind, n, prof, bystander)


def stats_run(tools: Tools, res: Results, case: str, kind: str, n: int, prof: Profiler, bystander: bool):
    """One more profiled run, with kernel.bpf_stats_enabled on, for the BPF table."""
    w = Worker(tools.python, kind)
    idle = Worker(tools.python, "idle") if bystander else None
    try:
        w.run(max(1, n // 5))
        tools.sysctl.on()
        try:
            tb, _, delta = profiled_run(tools, prof, idle.pid if bystander else w.pid, lambda: w.run(n),
                                        f"c{case}-{kind.split()[0]}-stats", with_stats=True)
        finally:
            tools.sysctl.off()
        res.bpf.append(bpf_summary(case, prof.label, [(tb, delta)]))
        log(f"case {case} BPF run times under {prof.label}: "
            + ", ".join(f"{prog_label(k)} {c} runs {ns / max(1, c):.0f} ns" for k, (c, ns) in delta.items()))
    except Exception as e:                                      # noqa: BLE001
        res.errors.append(f"case {case} {prof.label} BPF stats run: {e}")
        log(f"case {case} {prof.label} BPF stats run: FAILED: {e}")
    finally:
        w.close()
        if idle:
            idle.close()


def bpf_summary(case: str, label: str, runs: list) -> dict:
    progs: Dict[str, Dict[str, list]] = {}
    for seconds, delta in runs:
        for name, (cnt, ns) in delta.items():
            d = progs.setdefault(name, {"per_event": [], "rate": [], "cpu": []})
            if cnt > 0:
                d["per_event"].append(ns / cnt)
            d["rate"].append(cnt / seconds)
            d["cpu"].append(ns / seconds / 1e9)
    return {"case": case, "profiler": label,
            "progs": {n: {k: median(v) for k, v in d.items()} for n, d in progs.items()}}


def pingpong_kind(tools: Tools, rate: float) -> str:
    """The ping-pong workload with enough Python work per round trip for about
    `rate` context switches a second (two per round trip); 0: no work, as fast
    as the machine switches."""
    if rate <= 0:
        return "pingpong 0"
    probe = 2000

    def per_round_trip(k: int) -> float:
        w = Worker(tools.python, f"pingpong {k}")
        try:
            w.run(2000)
            return min(w.run(20000)[0] for _ in range(2)) / 20000
        finally:
            w.close()
    bare = per_round_trip(0)
    per_iter = max(1e-9, (per_round_trip(probe) - bare) / probe)
    k = max(0, int((2.0 / rate - bare) / per_iter))
    log(f"ping-pong: {bare * 1e6:.1f} us per bare round trip, {k} iterations of work per round trip "
        f"for ~{rate:g} switches/s")
    return f"pingpong {k}"


def calibrate(tools: Tools, kind: str, n0: int, work_s: float) -> int:
    w = Worker(tools.python, kind)
    try:
        w.run(max(1, n0 // 4))
        times = [w.run(n0)[0] for _ in range(2)]
    finally:
        w.close()
    n = max(1, int(n0 * work_s / min(times)))
    log(f"calibrated {kind}: {n} per run (~{work_s:g} s)")
    return n


# -- case 5: accuracy --------------------------------------------------------------------------------
def accuracy_case(tools: Tools, res: Results, runs: int, seconds: float):
    from workloads import FUNCTIONS, SPLIT
    profs = [p for p in (tools.profs.get("pyoffcpu --mode wall"), tools.profs.get("py-spy record --idle -r 100"))
             if p]
    per = {p.label: {"shares": [], "errors": []} for p in profs}
    truths = []
    for i in range(runs):
        for prof in (profs if i % 2 == 0 else profs[::-1]):
            tag = f"c5-{i}-{'pyoffcpu' if prof.pyoffcpu else 'pyspy'}"
            w = Worker(tools.python, "split")
            try:
                holder = {}

                def work():
                    dt, extra = w.run(seconds, timeout=seconds + 60)
                    holder["truth"] = extra
                    return dt, extra
                profiled_run(tools, prof, w.pid, work, tag)
                path = os.path.join(tools.outdir, tag + (".folded" if prof.pyoffcpu else ".txt"))
                with open(path, errors="replace") as f:
                    stacks = parse_folded(f.read())
                truth = {loop: {fn: holder["truth"][loop]["spent"][fn] / holder["truth"][loop]["total"]
                                for fn in FUNCTIONS} for loop in SPLIT}
                truths.append(truth)
                shares, worst = {}, 0.0
                for loop in SPLIT:
                    s, total = function_shares(stacks, loop, FUNCTIONS)
                    if not total:
                        raise RuntimeError(f"no stacks under {loop} in {os.path.basename(path)}")
                    shares[loop] = s
                    worst = max(worst, max_error_pp(s, truth[loop]))
                per[prof.label]["shares"].append(shares)
                per[prof.label]["errors"].append(worst)
                log(f"case 5 run {i + 1}/{runs} {prof.label}: max error {worst:.2f} pp")
            except Exception as e:                              # noqa: BLE001
                res.errors.append(f"case 5 {prof.label} run {i + 1}: {e}")
                log(f"case 5 {prof.label} run {i + 1}: FAILED: {e}")
            finally:
                w.close()
    res.accuracy = {"per": per, "truths": truths, "design": SPLIT, "functions": FUNCTIONS,
                    "runs": runs, "seconds": seconds}


# -- case 6: startup and teardown ---------------------------------------------------------------------
def cache_env(tools: Tools) -> Dict[str, str]:
    """pyoffcpu's environment with the bench's own program cache
    (PYOFFCPU_CACHE_DIR in the bench's temporary folder): cold starts empty
    it, never the user's."""
    return dict(tools.env if tools.env is not None else os.environ, PYOFFCPU_CACHE_DIR=tools.cache_dir)


def _start_row(r: dict) -> dict:
    return {k: r[k] for k in ("first", "recording", "hwm_mib", "maxrss_mib", "cpu_s", "total_s")}


def startup_case(tools: Tools, res: Results, runs: int, short_s: float, long_s: float):
    """Warm and cold starts of `pyoffcpu -p PID --mode wall -d 1` (tools/startup.py
    measures each: first sample, `recording` line, peak RSS with and without
    children), py-spy's attach, where a warm start goes, and teardown."""
    out = {"warm": [], "cold": [], "pyspy": [], "teardown": [], "runs": runs}
    env = cache_env(tools)
    folded = os.path.join(tools.outdir, "c6-start.folded")
    w = Worker(tools.python, "split")
    try:
        w.start_run(3600)
        time.sleep(0.3)
        try:                                            # untimed: fills the bench's cache
            r = starts.start_run(tools.pyoffcpu, w.pid, folded, tools.cache_dir, False, env=env)
            entries = [n for n in os.listdir(os.path.join(tools.cache_dir, "bpf")) if n.endswith(".bpf")]
            log(f"case 6: cache filled ({len(entries)} program entries in {tools.cache_dir}/bpf) by a "
                f"{r['total_s']:.1f} s run")
            if not entries:
                res.errors.append("case 6: the fill run left no program entry in the cache: "
                                  "the warm starts are cold")
        except Exception as e:                          # noqa: BLE001
            res.errors.append(f"case 6 cache fill: {e}")
            log(f"case 6 cache fill: FAILED: {e}")
        for i in range(runs):
            # warm and cold alternate (a cold run fills the cache again for the next warm one)
            for cold in ((False, True) if i % 2 == 0 else (True, False)):
                kind = "cold" if cold else "warm"
                try:
                    r = starts.start_run(tools.pyoffcpu, w.pid, folded, tools.cache_dir, cold, env=env)
                    out[kind].append(_start_row(r))
                    log(f"case 6 {kind} start {i + 1}/{runs}: first sample {fmt_num(r['first'], 3)} s, "
                        f"recording line {fmt_num(r['recording'], 3)} s, VmHWM {r['hwm_mib']:.0f} MiB, "
                        f"with children {r['maxrss_mib']:.0f} MiB, CPU {r['cpu_s']:.2f} s")
                    for line in starts.notices(r["stderr"]):
                        log(f"  {line}")
                except Exception as e:                  # noqa: BLE001
                    res.errors.append(f"case 6 {kind} start {i + 1}: {e}")
                    log(f"case 6 {kind} start {i + 1}: FAILED: {e}")
        if tools.pyspy:
            for i in range(runs):
                p = None
                try:
                    t0 = time.monotonic()
                    p = Proc(tools.pyspy + ["record", "-p", str(w.pid), "-r", "100", "--idle", "-f", "raw",
                                            "-o", os.path.join(tools.outdir, f"c6-pyspy-{i}.txt")], merge=True)
                    t = p.wait_err(r"py-spy> Sampling process", 60)
                    out["pyspy"].append({"recording": t - t0})
                    log(f"case 6 py-spy start {i + 1}/{runs}: `Sampling process` after {t - t0:.3f} s")
                    p.interrupt()
                    p.wait(60)
                except Exception as e:                  # noqa: BLE001
                    res.errors.append(f"case 6 py-spy startup run {i + 1}: {e}")
                    log(f"case 6 py-spy start {i + 1}: FAILED: {e}")
                finally:
                    if p:
                        p.kill()
    finally:
        w.close()
    out["breakdown"] = startup_breakdown(tools, env)
    plan = [("pyoffcpu", short_s), ("pyoffcpu", short_s), ("pyoffcpu", long_s)]
    if tools.pyspy:
        plan.insert(2, ("py-spy", short_s))
    for i, (who, secs) in enumerate(plan):
        w = Worker(tools.python, "split")
        p = None
        try:
            w.start_run(secs + 3600)
            svg = os.path.join(tools.outdir, f"c6-teardown-{i}.svg")
            if who == "pyoffcpu":
                p = Proc(tools.pyoffcpu + ["-p", str(w.pid), "--mode", "wall", "-o", svg], env=env)
                ready = p.wait_err(r"^pyoffcpu: recording", 120)
            else:
                p = Proc(tools.pyspy + ["record", "-p", str(w.pid), "-r", "100", "--idle", "-o", svg], merge=True)
                ready = p.wait_err(r"py-spy> Sampling process", 60)
            log(f"case 6 teardown: {who} recording {secs:g} s")
            time.sleep(max(0.0, ready + secs - time.monotonic()))
            t_sig = time.monotonic()
            p.interrupt()
            t_file = None
            while p.p.poll() is None and time.monotonic() - t_sig < 600:
                if t_file is None and os.path.exists(svg):
                    t_file = time.monotonic()
                time.sleep(0.01)
            t_exit = time.monotonic()
            if t_file is None and os.path.exists(svg):
                t_file = t_exit
            if p.p.poll() != 0 or t_file is None:
                raise RuntimeError(f"{who} exited {p.p.poll()} without the SVG: {p.stderr_tail()}")
            out["teardown"].append({"who": who, "seconds": secs, "file": t_file - t_sig,
                                    "exit": t_exit - t_sig, "bytes": os.path.getsize(svg)})
            log(f"case 6 teardown {who} {secs:g} s: file after {t_file - t_sig:.2f}s, exit {t_exit - t_sig:.2f}s")
        except Exception as e:                                  # noqa: BLE001
            res.errors.append(f"case 6 teardown {who} {secs:g}s: {e}")
            log(f"case 6 teardown {who} {secs:g}s: FAILED: {e}")
        finally:
            if p:
                p.kill()
            w.close()
    res.startup = out


BREAKDOWN = [   # (file suffix, function, what it is); a step that did not run is left out
    ("pyoffcpu/collect/session.py", "<module>", "import pyoffcpu.collect.session (and all it imports)"),
    ("pyoffcpu/collect/platform.py", "probe", "platform.probe: privileges, BTF offsets of task_struct, tracefs"),
    ("pyoffcpu/collect/session.py", "_compile", "Session._compile: bpfload.load and its cflags"),
    ("pyoffcpu/collect/bpfload.py", "load", "bpfload.load: cache lookup, maps, verifier, raw tracepoints attached"),
    ("pyoffcpu/collect/bpfload.py", "cache_key", "bpfload.cache_key: sha256 of the text, headers, BTF, bcc"),
    ("pyoffcpu/collect/bpfload.py", "_read_entry", "bpfload._read_entry: read and check the cache entry"),
    ("pyoffcpu/collect/bpfload.py", "compile_in_child", "bpfload.compile_in_child: bcc/clang (a cache miss only)"),
    ("pyoffcpu/collect/bpfload.py", "load_funcs_parallel", "bpfload.load_funcs_parallel: the kernel verifier, "
                                                   "all programs"),
    ("pyoffcpu/collect/session.py", "_attach", "Session._attach: perf events, perf buffer, the unwinder's tail-call slots"),
    ("pyoffcpu/collect/bpfload.py", "attach_perf_event", "Program.attach_perf_event: cpu-clock on every CPU"),
    ("pyoffcpu/collect/session.py", "_add_target", "Session._add_target: find the target's CPython, register it"),
]


def startup_breakdown(tools: Tools, env: Optional[Dict[str, str]] = None) -> List[Tuple[str, float]]:
    """One warm `pyoffcpu -p` start (env: the bench's filled cache) under
    cProfile: the cumulative seconds of the known big steps (C work, as the
    verifier, is not slowed down by the profiler; Python work is, a little)."""
    import pstats
    w = Worker(tools.python, "split")
    path = os.path.join(tools.outdir, "c6-startup.pstats")
    try:
        w.start_run(3600)
        time.sleep(0.3)
        r = subprocess.run([sys.executable, "-m", "cProfile", "-o", path, "-m", "pyoffcpu", "-p", str(w.pid),
                            "-d", "0.5", "-o", os.path.join(tools.outdir, "c6-breakdown.folded")],
                           capture_output=True, text=True, timeout=180, env=env if env is not None else tools.env)
        if r.returncode != 0 or not os.path.exists(path):
            log(f"case 6 startup breakdown: pyoffcpu exited {r.returncode}")
            return []
        st = pstats.Stats(path).stats
        out = []
        for suffix, fn, what in BREAKDOWN:
            cts = [v[3] for (f, _, name), v in st.items() if f.endswith(suffix) and name == fn]
            if cts:
                out.append((what, max(cts)))
        log("case 6 where a warm start goes: " + ", ".join(f"{what.split(':')[0]} {t:.2f}s" for what, t in out))
        return out
    except Exception as e:                                      # noqa: BLE001
        log(f"case 6 startup breakdown: {e}")
        return []
    finally:
        w.close()


# -- case 7: exporters -----------------------------------------------------------------------------------
def exporters_case(tools: Tools, res: Results):
    for fmt, ext in (("folded", "folded"), ("svg", "svg"), ("speedscope", "json")):
        path = os.path.join(tools.outdir, f"c7.{ext}")
        try:
            r = subprocess.run([sys.executable, EXPORTERS, fmt, path], capture_output=True, text=True,
                               timeout=600, env=tools.env)
            if r.returncode != 0:
                raise RuntimeError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}")
            d = json.loads(r.stdout.strip().splitlines()[-1])
            res.exporters.append(d)
            log(f"case 7 {fmt}: export {d['export_s']:.2f}s, peak RSS {fmt_bytes(d['maxrss'])}")
            os.unlink(path)
        except Exception as e:                                  # noqa: BLE001
            res.errors.append(f"case 7 {fmt}: {e}")
            log(f"case 7 {fmt}: FAILED: {e}")


# -- case 13: dump latency -------------------------------------------------------------------------
DUMP_THREADS = 50
DUMP_TARGET_S = 0.5             # issue 14: start to printed stacks
DUMP_RUNS = 7
DUMP_WORKLOAD = r"""
import sys, threading, time
n = int(sys.argv[1])
lock = threading.Lock()
def idle(i):
    if i % 2:
        time.sleep(3600)
    with lock:
        pass
with lock:
    for i in range(n - 1):
        threading.Thread(target=idle, args=(i,), daemon=True).start()
    print("ready", flush=True)
    time.sleep(3600)
"""


def dump_case(tools: Tools, res: Results, runs: int = DUMP_RUNS):
    """Median wall time of a dump of a 50-thread process: pyoffcpu dump,
    with --native, and py-spy dump (native too)."""
    p = subprocess.Popen([tools.python, "-c", DUMP_WORKLOAD, str(DUMP_THREADS)], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        rows = {}
        cmds = {"pyoffcpu dump": tools.pyoffcpu + ["dump", "-p", str(p.pid)],
                "pyoffcpu dump --native": tools.pyoffcpu + ["dump", "-p", str(p.pid), "--native"]}
        if tools.pyspy:
            cmds["py-spy dump"] = tools.pyspy + ["dump", "--pid", str(p.pid)]
            cmds["py-spy dump --native"] = tools.pyspy + ["dump", "--native", "--pid", str(p.pid)]
        for label, argv in cmds.items():
            times = []
            for _ in range(runs):
                t0 = time.monotonic()
                r = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                                   env=tools.env if label.startswith("pyoffcpu") else None)
                times.append(time.monotonic() - t0)
                if r.returncode != 0:
                    raise RuntimeError(f"{label}: {r.stderr.strip()[-300:]}")
            threads = len(re.findall(r"^(?:thread|Thread) ", r.stdout, re.M))
            rows[label] = {"median_s": statistics.median(times), "min_s": min(times),
                           "max_s": max(times), "threads": threads}
            log(f"case 13 {label}: median {rows[label]['median_s']:.3f}s over {runs} ({threads} threads)")
        res.dump = {"threads": DUMP_THREADS, "runs": runs, "rows": rows}
    except Exception as e:                                      # noqa: BLE001
        res.errors.append(f"case 13: {e}")
        log(f"case 13: FAILED: {e}")
    finally:
        p.kill()
        p.wait()


def render_dump(d: dict) -> List[str]:
    out = [f"## Dump latency (case 13): a {d['threads']}-thread process, {d['runs']} runs each\n"]
    rows = []
    for label, r in d["rows"].items():
        tgt = DUMP_TARGET_S if label.startswith("pyoffcpu") else None
        rows.append([label, f"{r['median_s']:.3f}", f"{r['min_s']:.3f}–{r['max_s']:.3f}", str(r["threads"]),
                     f"<= {tgt:g} s" if tgt else "—", verdict(r["median_s"], tgt)])
    out.append(markdown_table(["command", "median s", "min–max s", "threads shown", "target", ""], rows,
                              "lrrrrl"))
    out.append("")
    out.append("Start of the command to its exit, stacks printed. pyoffcpu reads /proc and the target's "
               "memory and never stops it; py-spy dump pauses the process while it reads.")
    out.append("")
    return out


# -- case 14: native stacks through code without CFI (issue 15) ------------------------------------
UNWIND_NUMPY = "numpy==2.4.6"           # the test's pin (tests/test_numpy_bpf.py)
UNWIND_RUNS = 3
UNWIND_SAMPLE_S = 5.0
UNWIND_HZ = 499
TABLE_SNIPPET = r"""
import json, sys, time
from pyoffcpu.native.unwind import table as T
c = T.TableCache(sys.argv[2])
t0 = time.perf_counter()
t = c.get(sys.argv[1], None)
print(json.dumps({"s": time.perf_counter() - t0, "built": c.built, "loaded": c.loaded,
                  "rows": t.nrows if t else 0}))
"""


def unwind_case(tools: Tools, res: Results, runs: int = UNWIND_RUNS):
    """numpy's OpenBLAS in a venv of the bench's: the unwind table of its
    largest library built cold (an empty cache) and read warm, with and
    without prologue analysis; then the BPF cost per on-CPU sample of the
    numpy workload (tests/workloads/numpy_mix.py, OpenBLAS's Haswell kernels),
    with and without it, beside what it buys (the matmul thread's stacks
    with >= 3 native frames under matmul_loop)."""
    venv = os.path.join(tools.outdir, "numpy-venv")
    try:
        subprocess.run([tools.python, "-m", "venv", venv], check=True)
        python = os.path.join(venv, "bin", "python")
        subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", UNWIND_NUMPY],
                       check=True)
        libs = glob.glob(os.path.join(venv, "lib", "python*", "site-packages", "numpy*", "**", "*.so*"),
                         recursive=True)
        lib = max(libs, key=os.path.getsize)
        out = {"library": os.path.basename(lib), "mib": os.path.getsize(lib) / 2 ** 20, "tables": {},
               "samples": {}}
        py = [sys.executable]                   # imports pyoffcpu (tools.env: --tree)
        for prologue in ("1", "0"):
            env = dict(tools.env or os.environ, PYOFFCPU_PROLOGUE=prologue)
            cold, warm = [], []
            for i in range(runs):
                cache = os.path.join(tools.outdir, f"tables-{prologue}-{i}")
                for times in (cold, warm):          # empty cache, then the same cache again
                    r = subprocess.run(py + ["-c", TABLE_SNIPPET, lib, cache], env=env, check=True,
                                       capture_output=True, text=True, timeout=600)
                    got = json.loads(r.stdout)
                    times.append(got["s"])
            out["tables"][prologue] = {"cold_s": median(cold), "warm_s": median(warm), "rows": got["rows"],
                                       "cold_range": (min(cold), max(cold))}
            log(f"case 14 table of {out['library']} (prologue analysis {'on' if prologue == '1' else 'off'}): "
                f"cold {median(cold):.2f} s, warm {median(warm):.3f} s, {got['rows']} rows")
        for prologue in ("1", "0"):
            out["samples"][prologue] = unwind_sample_cost(tools, python, prologue)
        res.unwind = out
    except Exception as e:                                      # noqa: BLE001
        res.errors.append(f"case 14: {e}")
        log(f"case 14: FAILED: {e}")


def unwind_sample_cost(tools: Tools, python: str, prologue: str) -> dict:
    """BPF run time per on-CPU sample (on_cpu_sample and its unwind_perf tail
    calls) over UNWIND_SAMPLE_S of the numpy workload, and the matmul share."""
    w = subprocess.Popen([python, os.path.join(ROOT, "tests", "workloads", "numpy_mix.py"), "600"],
                         stdout=subprocess.PIPE, text=True, env=dict(os.environ, OPENBLAS_CORETYPE="Haswell"))
    out = os.path.join(tools.outdir, f"numpy-{prologue}.folded")
    env = dict(tools.env or os.environ, PYOFFCPU_PROLOGUE=prologue,
               PYOFFCPU_CACHE_DIR=os.path.join(tools.outdir, f"session-cache-{prologue}"))
    p = None
    stats = None
    try:
        assert w.stdout.readline().strip() == "ready"
        p = Proc(tools.pyoffcpu + ["-p", str(w.pid), "--mode", "cpu", "-F", str(UNWIND_HZ), "-o", out], env=env)
        p.wait_err(r"^pyoffcpu: recording", 300)
        time.sleep(SETTLE_S)
        tools.sysctl.on()
        try:
            stats = bpfstats.ProgStats(p.pid)
            before = stats.read()
            time.sleep(UNWIND_SAMPLE_S)
            delta = prog_delta(before, stats.read())
        finally:
            tools.sysctl.off()
        p.interrupt()
        if p.wait(180) != 0:
            raise RuntimeError(f"pyoffcpu exited: {p.stderr_tail()}")
        samples = sum(c for k, (c, _) in delta.items() if k.startswith("on_cpu_sample"))
        ns = sum(n for k, (_, n) in delta.items() if k.startswith(("on_cpu_sample", "unwind_perf")))
        kept = total = 0
        with open(out) as f:
            for line in f:
                stack, _, v = line.rstrip().rpartition(" ")
                frames = stack.split(";")
                at = next((i for i, x in enumerate(frames) if x.startswith("matmul_loop (")), None)
                if at is None:
                    continue
                total += int(v)
                kept += int(v) if sum(1 for x in frames[at + 1:] if " (" not in x) >= 3 else 0
        row = {"samples": samples, "ns_per_sample": ns / max(1, samples), "matmul_share": kept / max(1, total)}
        log(f"case 14 per sample (prologue analysis {'on' if prologue == '1' else 'off'}): "
            f"{row['ns_per_sample']:.0f} ns over {samples} samples; matmul chains {row['matmul_share']:.3f}")
        return row
    finally:
        if stats:
            stats.close()
        if p:
            p.kill()
        w.kill()
        w.wait()


def render_unwind(d: dict) -> List[str]:
    out = [f"## Code without CFI (case 14): numpy's OpenBLAS ({d['library']}, {d['mib']:.1f} MiB)\n"]
    rows = []
    for prologue, t in d["tables"].items():
        rows.append(["on" if prologue == "1" else "off (PYOFFCPU_PROLOGUE=0)", f"{t['cold_s']:.2f}",
                     f"{t['cold_range'][0]:.2f}–{t['cold_range'][1]:.2f}", f"{t['warm_s']:.3f}", str(t["rows"])])
    out.append(markdown_table(["prologue analysis", "cold build s (median)", "min–max s", "warm (cached) s",
                               "rows"], rows, "lrrrr"))
    out.append("")
    rows = []
    for prologue, r in d["samples"].items():
        rows.append(["on" if prologue == "1" else "off (PYOFFCPU_PROLOGUE=0)", f"{r['ns_per_sample']:.0f}",
                     str(r["samples"]), f"{100 * r['matmul_share']:.1f}%"])
    out.append(markdown_table(["prologue analysis", "BPF ns per on-CPU sample", "samples",
                               "matmul stacks with >= 3 native frames"], rows, "lrrr"))
    out.append("")
    out.append(f"Cold: a process builds the table into an empty cache (symbols, .eh_frame, and the "
               f"control-flow analysis of every function no FDE covers); warm: a new process reads it "
               f"from that cache. Per sample: on_cpu_sample and its unwind_perf tail calls, "
               f"{UNWIND_SAMPLE_S:g} s of the numpy workload at {UNWIND_HZ} Hz with OpenBLAS's Haswell "
               f"kernels (kernel.bpf_stats_enabled).")
    out.append("")
    return out


# -- case 9: a long run of a server that starts a thread per request ---------------------------------
LONGRUN_GROWTH_MIB = 150.0      # issue 8: RSS flat after the first minute, within this much
LONGRUN_SAMPLE_S = 5.0          # RSS between the checkpoints (for the slope)


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _proc_reading(pid: int) -> Optional[dict]:
    """RSS, peak RSS (KiB), threads and CPU ticks of a live process; None once it is gone."""
    st, stat = _read(f"/proc/{pid}/status"), _read(f"/proc/{pid}/stat")
    if st is None or stat is None:
        return None
    try:
        ticks = proc_stat_cpu_ticks(stat)
    except (ValueError, IndexError):
        return None
    return {"rss_kib": proc_status_kib(st, "VmRSS"), "hwm_kib": proc_status_kib(st, "VmHWM"),
            "threads": proc_status_kib(st, "Threads"), "ticks": ticks}


def _end_server(srv: Proc, cli: Optional[Proc]):
    """Stop the load client (SIGINT, then kill), then the server ("exit", then kill)."""
    if cli:
        cli.interrupt()
        try:
            cli.p.wait(20)
        except subprocess.TimeoutExpired:
            pass
        cli.kill()
    srv.close(10)


def _server_stats(srv: Proc) -> dict:
    srv.send("stats")
    return json.loads(srv.expect("stats ", 10).split(" ", 1)[1])


def longrun_case(tools: Tools, res: Results, seconds: float, rate: float, client_threads: int,
                 keep: bool = False):
    """pyoffcpu -p on a ThreadingHTTPServer kept at `rate` requests/s (each a new
    connection and a new thread) by a client in another process, for `seconds`;
    pyoffcpu's RSS every few seconds, and at each checkpoint (10 s, every minute)
    its maps and drops: from PYOFFCPU_STATS_FILE when pyoffcpu writes it, else
    counted here on copies of its map fds."""
    out = {"seconds": seconds, "rate_target": rate, "client_threads": client_threads,
           "readings": [], "samples": [], "maps_source": None, "capacity": {}}
    stats_path = os.path.join(tools.outdir, "c9-stats.jsonl")
    folded = os.path.join(tools.outdir, "c9.folded")
    tree = os.path.dirname(tools.env["PYTHONPATH"]) if tools.env and tools.env.get("PYTHONPATH") else ROOT
    drop_names = parse_drop_defines(_read(os.path.join(tree, "bpf", "pyoffcpu.h")) or "")
    srv = Proc([tools.python, THREADSERVER, "server"], stdin=True)
    cli = p = counter = None
    try:
        port = int(srv.expect("ready ", 30).split()[1])
        cli = Proc([tools.python, THREADSERVER, "client", str(port), "--rate", f"{rate:g}",
                    "--seconds", f"{seconds + 900:g}", "--threads", str(client_threads)])
        time.sleep(3.0)                                         # the load settles before pyoffcpu comes
        warm = _server_stats(srv)
        if not warm["served"]:
            raise RuntimeError(f"the server answered nothing in 3 s (client: {cli.stderr_tail()})")
        log(f"case 9: server {srv.pid} on 127.0.0.1:{port}, {warm['served'] / warm['t']:.0f} requests/s "
            f"before pyoffcpu; recording {seconds:g} s")
        if os.path.exists(stats_path):
            os.unlink(stats_path)
        env = dict(tools.env if tools.env is not None else os.environ, PYOFFCPU_STATS_FILE=stats_path)
        p = Proc(tools.pyoffcpu + ["-p", str(srv.pid), "--mode", "wall", "-d", f"{seconds:g}", "-o", folded],
                 env=env)
        t0 = p.wait_err(r"^pyoffcpu: recording", 120)
        served0 = _server_stats(srv)
        try:
            counter = bpfstats.MapCounter(p.pid)
        except OSError as e:
            log(f"case 9: cannot read pyoffcpu's maps from outside ({e}): RSS only without the stats file")
        cps = checkpoints(seconds)
        ci = 0
        next_sample = 0.0
        last = {"t": 0.0, "ticks": None, "served": served0["served"], "st": served0["t"]}
        deadline = t0 + seconds + 900                           # a teardown of 15 min is a failure
        hwm = 0
        while p.p.poll() is None:
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(f"pyoffcpu still running {now - t0 - seconds:.0f} s after its -d ran out")
            t = now - t0
            r = _proc_reading(p.pid)
            if r is None:
                break
            hwm = max(hwm, r["hwm_kib"] or 0)
            if ci < len(cps) and t >= cps[ci]:
                ci += 1
                reading = {"t": t, "rss_kib": r["rss_kib"], "hwm_kib": r["hwm_kib"]}
                if last["ticks"] is not None:
                    reading["cpu_pct"] = 100 * (r["ticks"] - last["ticks"]) / os.sysconf("SC_CLK_TCK") / \
                        max(1e-6, t - last["t"])
                else:
                    reading["cpu_pct"] = 100 * r["ticks"] / os.sysconf("SC_CLK_TCK") / max(1e-6, now - p.started)
                st = _server_stats(srv)
                reading["served_rate"] = (st["served"] - last["served"]) / max(1e-6, st["t"] - last["st"])
                sr = _proc_reading(srv.pid) or {}
                reading["server_threads"] = sr.get("threads")
                reading["server_rss_kib"] = sr.get("rss_kib")
                if counter is not None:
                    c0 = time.monotonic()
                    try:
                        entries, drops = counter.read()
                        reading["bench_maps"] = {k: v[0] for k, v in entries.items()}
                        reading["bench_drops"] = {drop_names.get(i, f"drop {i}"): v for i, v in drops.items()}
                        out["capacity"].update({k: v[1] for k, v in entries.items()})
                    except OSError as e:
                        log(f"case 9: reading the maps failed: {e}")
                    reading["count_s"] = time.monotonic() - c0
                    log(f"case 9: counting pyoffcpu's map entries took {reading['count_s']:.2f} s")
                out["readings"].append(reading)
                last.update(t=t, ticks=r["ticks"], served=st["served"], st=st["t"])
                log(f"case 9 {fmt_clock(t)}: pyoffcpu RSS {r['rss_kib'] / 1024:.0f} MiB, CPU "
                    f"{reading['cpu_pct']:.0f}%, {reading['served_rate']:.0f} requests/s, server threads "
                    f"{reading['server_threads']}"
                    + (", maps " + ", ".join(f"{k} {v}" for k, v in sorted(reading.get("bench_maps", {}).items()))
                       if reading.get("bench_maps") else ""))
                if ci == len(cps) and counter is not None:
                    counter.close()                             # our fd copies would keep its maps alive
                    counter = None
            if t < seconds:
                if t >= next_sample:
                    out["samples"].append((t, r["rss_kib"]))
                    next_sample += LONGRUN_SAMPLE_S
                wake = min([next_sample] + ([cps[ci]] if ci < len(cps) else []))
                time.sleep(min(1.0, max(0.05, wake - (time.monotonic() - t0))))
            else:
                time.sleep(0.1)                                 # teardown: the peak while it writes
        t_exit = time.monotonic()
        rc = p.wait(60)
        out["teardown_s"] = t_exit - (t0 + seconds)
        out["hwm_kib"] = hwm
        final = _server_stats(srv)
        out["served_rate"] = (last["served"] - served0["served"]) / max(1e-6, last["st"] - served0["t"])
        out["served_total"] = final["served"]
        if rc != 0:
            raise RuntimeError(f"pyoffcpu exited {rc}: {p.stderr_tail()}")
        for _, line in reversed(p.err):
            d = parse_drops_line(line or "")
            if d is not None:
                out["final_drops"] = d
                break
        cli.interrupt()
        try:
            out["client"] = json.loads(cli.expect("done ", 30).split(" ", 1)[1])
        except RuntimeError as e:
            log(f"case 9: client: {e}")
        records = parse_stats_lines(_read(stats_path) or "")
        out["hook_lines"] = len(records)
        if records:
            out["maps_source"] = "PYOFFCPU_STATS_FILE"
            for reading in out["readings"]:
                rec = latest_before(records, reading["t"])
                if rec is not None:
                    reading["hook"] = {k: rec.get(k) for k in ("t", "rss_kib", "maps", "drops", "stacks", "threads")}
        elif any("bench_maps" in r for r in out["readings"]):
            out["maps_source"] = "bench"
        if os.path.exists(folded):
            out["folded_bytes"] = os.path.getsize(folded)
            with open(folded, errors="replace") as f:
                out["folded"] = folded_summary(f)
            if not keep:
                os.unlink(folded)
        samples = out["samples"] + [(r["t"], r["rss_kib"]) for r in out["readings"]]
        samples.sort()
        out["samples"] = samples
        g = rss_growth(samples)
        out["growth_mib"] = g / 1024 if g is not None else None
        slope = linear_slope([(t, v) for t, v in samples if t >= 10])
        out["slope_mib_min"] = slope * 60 / 1024 if slope is not None else None
        late = [(t, v) for t, v in samples if t >= 60]
        slope = linear_slope(late)
        out["late_slope_mib_min"] = slope * 60 / 1024 if slope is not None else None
        out["late_s"] = late[-1][0] - late[0][0] if len(late) > 1 else 0.0
        try:
            out["pid_max"] = int((_read("/proc/sys/kernel/pid_max") or "").strip())
        except ValueError:
            pass
        log(f"case 9: served {out['served_rate']:.0f} requests/s while recording; RSS growth after the first "
            f"minute {fmt_num(out['growth_mib'], 0)} MiB, slope {fmt_num(out['slope_mib_min'], 1)} MiB/min; "
            f"folded {out.get('folded', {}).get('lines')} lines; teardown {out['teardown_s']:.1f} s")
    except Exception as e:                                      # noqa: BLE001
        res.errors.append(f"case 9: {e}")
        log(f"case 9: FAILED: {e}")
    finally:
        if counter is not None:
            counter.close()
        if p:
            p.kill()
        _end_server(srv, cli)
    if out["readings"]:
        res.longrun = out


def render_longrun(d: dict, args) -> List[str]:
    out = [f"## Long run: a server that starts a thread per request (case 9), {fmt_clock(d['seconds'])} "
           "recording\n"]
    cl = d.get("client") or {}
    out.append(f"`pyoffcpu -p SERVER --mode wall -d {d['seconds']:g}` on an `http.server.ThreadingHTTPServer` "
               f"(127.0.0.1, HTTP/1.0: one connection and one thread per request) kept at "
               f"{d.get('served_rate', 0):.0f} requests/s while recording (asked: {d['rate_target']:g}; "
               f"{d['client_threads']} client threads in a process of their own"
               + (f", {cl.get('errors', 0)} failed requests" if cl else "") + ").\n")
    src = d.get("maps_source")
    rows = []
    for r in d["readings"]:
        h = r.get("hook") or {}
        drops = h.get("drops") if src == "PYOFFCPU_STATS_FILE" else r.get("bench_drops")
        rows.append([fmt_clock(r["t"]), fmt_num(r["rss_kib"] / 1024, 0), fmt_num(r["hwm_kib"] / 1024, 0),
                     fmt_num(r.get("cpu_pct"), 0), fmt_num(r.get("served_rate"), 0),
                     r.get("server_threads") if r.get("server_threads") is not None else "n/a",
                     h.get("stacks", "n/a") if h else "n/a", h.get("threads", "n/a") if h else "n/a",
                     sum(drops.values()) if drops else (0 if drops is not None else "n/a")])
    out.append(markdown_table(["t (m:ss)", "pyoffcpu RSS MiB", "peak RSS MiB", "pyoffcpu CPU %",
                               "requests/s", "server threads", "stacks held", "threads held", "drops"],
                              rows, "lrrrrrrrr"))
    out.append("")
    out.append("pyoffcpu's RSS and peak (VmRSS, VmHWM) from /proc; CPU: its user+system time since the "
               "reading before (the first row: since it started, start-up included), in % of one core; "
               "requests/s: answered by the server since the reading before. Stacks and threads held in "
               "user space come from PYOFFCPU_STATS_FILE.")
    out.append("")
    if src:
        key_maps = "maps" if src == "PYOFFCPU_STATS_FILE" else "bench_maps"
        readings = [((r.get("hook") or {}).get("maps") or {}) if src == "PYOFFCPU_STATS_FILE"
                    else r.get(key_maps, {}) for r in d["readings"]]
        rows = [[name, d["capacity"].get(name, "n/a")] + [v if v is not None else "n/a" for v in vals]
                for name, vals in counts_by_checkpoint(readings)]
        if rows:
            out.append("Map entries" + (" (from PYOFFCPU_STATS_FILE)" if src == "PYOFFCPU_STATS_FILE" else
                                        " (counted by the bench with BPF_MAP_GET_NEXT_KEY on copies of "
                                        "pyoffcpu's map fds; hash and stack-trace maps)") + ":\n")
            out.append(markdown_table(["map", "capacity"] + [fmt_clock(r["t"]) for r in d["readings"]], rows,
                                      "l" + "r" * (1 + len(d["readings"]))))
            out.append("")
        dr = [((r.get("hook") or {}).get("drops") or {}) if src == "PYOFFCPU_STATS_FILE"
              else r.get("bench_drops", {}) for r in d["readings"]]
        rows = [[name] + [v if v is not None else "n/a" for v in vals]
                for name, vals in counts_by_checkpoint(dr) if any(vals)]
        if rows:
            out.append("Drops (cumulative):\n")
            out.append(markdown_table(["drop"] + [fmt_clock(r["t"]) for r in d["readings"]], rows,
                                      "l" + "r" * len(d["readings"])))
            out.append("")
    else:
        out.append("No PYOFFCPU_STATS_FILE lines and no map readings: RSS only.")
        out.append("")
    fo = d.get("folded") or {}
    g = d.get("growth_mib")
    lines = [
        f"folded file: {fo.get('lines', 'n/a')} lines, {fmt_bytes(d.get('folded_bytes'))}, "
        f"{fo.get('threads', 'n/a')} thread roots",
        f"requests/s served while recording: {d.get('served_rate', 0):.0f} "
        f"({d.get('served_total', 0)} answered in all, warm-up included)",
        f"pyoffcpu RSS slope after 10 s: {fmt_num(d.get('slope_mib_min'), 1)} MiB/min; peak RSS "
        f"{fmt_bytes(d['hwm_kib'] * 1024) if d.get('hwm_kib') else 'n/a'} (teardown included); the file "
        f"written and pyoffcpu gone {fmt_num(d.get('teardown_s'), 1)} s after the recording ended",
        f"drops at the end (pyoffcpu's summary line): "
        + (", ".join(f"{k} {v}" for k, v in sorted(d["final_drops"].items())) or "none"
           if d.get("final_drops") is not None else "n/a"),
        f"RSS growth after the first minute: {fmt_num(g, 0)} MiB"
        + (f" (over the {fmt_clock(d.get('late_s', 0))} after it)" if g is not None else "")
        + f", limit <= {LONGRUN_GROWTH_MIB:g} MiB: **{verdict(g, LONGRUN_GROWTH_MIB)}**"
        + (" (the recording is shorter than 2 minutes)" if g is None else ""),
    ]
    ls = d.get("late_slope_mib_min")
    if d["seconds"] < 600 and ls is not None:
        lines.append(f"after the first minute RSS grew {ls:.1f} MiB/min: at that rate the issue's 10-minute "
                     f"run would grow {9 * ls:.0f} MiB after its first minute "
                     f"({verdict(9 * ls, LONGRUN_GROWTH_MIB)} projected)")
    pm = d.get("pid_max")
    rate = d.get("served_rate")
    if pm and rate:
        lines.append(f"kernel.pid_max is {pm}: at {rate:.0f} new threads/s TIDs come round every "
                     f"{pm / rate:.0f} s, so maps and roots keyed by TID stop growing near {pm} here "
                     "(a host with a larger pid_max, systemd's 4194304, keeps finding new TIDs)")
    out.extend(f"- {x}" for x in lines)
    out.append("")
    if d["seconds"] < 600:
        out.append(f"The recording is {d['seconds']:g} s, not the issue's 10 min, to keep `make bench` short; "
                   "BENCH_LONG_S=600 (or BENCH_THREADSERVER_S=600) for the full one.")
        out.append("")
    return out


# -- case 10: throughput of a thread-per-request server under each profiler ---------------------------
SERVER_LOSS_MAX = 0.03          # issue 10: pyoffcpu --mode wall costs the server at most 3% of its requests/s
SERVER_WARMUP_S = 2.0           # the client's load settles before a profiler comes or the window starts
SERVER_PROFILERS = ("pyoffcpu --mode wall", "pyoffcpu --mode cpu -F 99", "py-spy record --idle -r 100")
ALONE = "alone"


def _cpu_s(pid: int) -> Optional[float]:
    """User+system seconds of a live process (all its threads), None once it is gone."""
    st = _read(f"/proc/{pid}/stat")
    if st is None:
        return None
    try:
        return proc_stat_cpu_ticks(st) / os.sysconf("SC_CLK_TCK")
    except (ValueError, IndexError):
        return None


def server_measure(tools: Tools, prof: Optional[Profiler], seconds: float, clients: int, tag: str,
                   with_stats: bool = False) -> dict:
    """A fresh ThreadingHTTPServer, a client in another process as fast as it
    goes, `prof` attached (None: alone) before a window of `seconds`: the
    requests/s the server answered in the window, the profiler's CPU seconds
    in it (and its BPF programs' run counts and times with_stats), then the
    profiler stopped (SIGINT, its file written)."""
    srv = Proc([tools.python, THREADSERVER, "server"], stdin=True)
    cli = p = stats = None
    out_base = os.path.join(tools.outdir, tag)
    try:
        port = int(srv.expect("ready ", 30).split()[1])
        cli = Proc([tools.python, THREADSERVER, "client", str(port), "--rate", "0",
                    "--seconds", f"{seconds + 900:g}", "--threads", str(clients)])
        time.sleep(SERVER_WARMUP_S)
        if not _server_stats(srv)["served"]:
            raise RuntimeError(f"the server answered nothing in {SERVER_WARMUP_S:g} s "
                               f"(client: {cli.stderr_tail()})")
        m = {"profiler": prof.label if prof else ALONE}
        if prof:
            p = Proc(prof.argv(srv.pid, out_base), merge=prof.merge, env=tools.env if prof.pyoffcpu else None)
            t_ready = p.wait_err(prof.ready, 120)
            m["start_s"] = t_ready - p.started
            time.sleep(SETTLE_S)
            if with_stats:
                stats = bpfstats.ProgStats(p.pid)
                before = stats.read()
            cpu0 = _cpu_s(p.pid)
        s0 = _server_stats(srv)
        time.sleep(seconds)
        s1 = _server_stats(srv)
        if prof:
            cpu1 = _cpu_s(p.pid)
            if with_stats:
                m["progs"] = prog_delta(before, stats.read())
            if p.p.poll() is not None or cpu0 is None or cpu1 is None:
                raise RuntimeError(f"{prof.label} exited during the window: {p.stderr_tail()}")
            m["profiler_cpu_s"] = cpu1 - cpu0
        m["window_s"] = s1["t"] - s0["t"]
        m["served"] = s1["served"] - s0["served"]
        m["rate"] = m["served"] / max(1e-6, m["window_s"])
        if prof:
            t_sig = time.monotonic()
            p.interrupt()
            rc = p.wait(600)
            m["stop_s"] = time.monotonic() - t_sig
            if rc != 0:
                raise RuntimeError(f"{prof.label} exited {rc}: {p.stderr_tail()}")
        cli.interrupt()
        try:
            c = json.loads(cli.expect("done ", 30).split(" ", 1)[1])
            m["client_errors"] = c.get("errors", 0)
        except RuntimeError as e:
            log(f"case 10 client: {e}")
        return m
    finally:
        if stats:
            stats.close()
        if p:
            p.kill()
        _end_server(srv, cli)
        for ext in (".folded", ".txt"):
            if os.path.exists(out_base + ext):
                os.unlink(out_base + ext)


def server_case(tools: Tools, res: Results, seconds: float, rounds: int, clients: int):
    """`rounds` rounds, each every configuration once (alone and under each
    profiler) in a rotating order, a fresh server per measurement; then one
    more run per pyoffcpu mode with kernel.bpf_stats_enabled=1."""
    P = tools.profs
    configs = [ALONE] + [k for k in SERVER_PROFILERS if k in P]
    out = {"seconds": seconds, "rounds": rounds, "clients": clients, "configs": configs,
           "runs": {c: [] for c in configs}, "per_round": [], "stats": []}
    for i in range(rounds):
        this: Dict[str, float] = {}
        for label in rotated(configs, i):
            tag = f"c10-{i}-{'alone' if label == ALONE else label.split()[0] + '-' + label.split()[2]}"
            try:
                m = server_measure(tools, P.get(label), seconds, clients, tag)
                out["runs"][label].append(m)
                this[label] = m["rate"]
                log(f"case 10 round {i + 1}/{rounds} {label}: {m['rate']:.0f} requests/s over "
                    f"{m['window_s']:.1f} s" + (f", profiler CPU {m['profiler_cpu_s']:.2f} s, stopped in "
                                                f"{m['stop_s']:.1f} s" if label != ALONE else "")
                    + (f", {m['client_errors']} failed requests" if m.get("client_errors") else ""))
            except Exception as e:                              # noqa: BLE001
                res.errors.append(f"case 10 round {i + 1} {label}: {e}")
                log(f"case 10 round {i + 1} {label}: FAILED: {e}")
        out["per_round"].append(this)
    if tools.sysctl is not None and tools.sysctl.available:
        for label in configs:
            prof = P.get(label)
            if not prof or not prof.stats:
                continue
            try:
                tools.sysctl.on()
                try:
                    m = server_measure(tools, prof, seconds, clients, "c10-stats", with_stats=True)
                finally:
                    tools.sysctl.off()
                out["stats"].append(m)
                log(f"case 10 BPF run times under {label} ({m['rate']:.0f} requests/s): "
                    + ", ".join(f"{prog_label(k)} {c} runs {ns / max(1, c):.0f} ns"
                                for k, (c, ns) in sorted(m["progs"].items()) if c))
            except Exception as e:                              # noqa: BLE001
                res.errors.append(f"case 10 {label} BPF stats run: {e}")
                log(f"case 10 {label} BPF stats run: FAILED: {e}")
    res.server = out


def server_summary(d: dict) -> List[dict]:
    """Per configuration: its requests/s (median, min, max), the loss against
    the alone median and the median of its per-round losses against the alone
    run of the same round, the profiler's CPU seconds in the window."""
    alone = spread([m["rate"] for m in d["runs"].get(ALONE, [])])["median"]
    rows = []
    for label in d["configs"]:
        runs = d["runs"][label]
        s = spread([m["rate"] for m in runs])
        cpu = spread([m.get("profiler_cpu_s") for m in runs])
        per_round = per_round_losses(d["per_round"], ALONE, label) if label != ALONE else []
        rows.append({"label": label, "n": s["n"], "median": s["median"], "min": s["min"], "max": s["max"],
                     "loss": loss(s["median"], alone) if label != ALONE else None,
                     "round_loss": median(per_round), "rounds_paired": len(per_round),
                     "cpu_s": cpu["median"], "start_s": median([m.get("start_s") for m in runs]),
                     "stop_s": median([m.get("stop_s") for m in runs]),
                     "errors": sum(m.get("client_errors", 0) for m in runs),
                     "target": SERVER_LOSS_MAX if label == "pyoffcpu --mode wall" else None})
    return rows


def render_server(d: dict) -> List[str]:
    out = [f"## Thread-per-request server throughput (case 10): {d['rounds']} rounds x {d['seconds']:g} s "
           "per configuration\n"]
    out.append(f"An `http.server.ThreadingHTTPServer` (127.0.0.1, HTTP/1.0: one connection and one new thread "
               f"per request) under the target Python, and a client of {d['clients']} threads in a process "
               "of their own sending as fast as the answers come. Requests/s answered by the server over "
               f"a {d['seconds']:g} s window; the profiler attached before it (its ready line, then "
               f"{SETTLE_S:g} s) and stopped after it; a fresh server and client for every measurement, "
               "each round every configuration once, in an order rotating from round to round.\n")
    rows = []
    for r in server_summary(d):
        tgt = r["target"]
        window = d["seconds"]
        rows.append([r["label"], r["n"], fmt_num(r["median"], 0), fmt_range(r["min"], r["max"], 0),
                     fmt_pct(r["loss"]) if r["label"] != ALONE else "—",
                     (fmt_pct(r["round_loss"]) + f" ({r['rounds_paired']})") if r["label"] != ALONE else "—",
                     fmt_num(r["cpu_s"], 2) if r["label"] != ALONE else "—",
                     f"{100 * r['cpu_s'] / window:.0f}%" if r["cpu_s"] is not None else "—",
                     f"<= {100 * tgt:g}%" if tgt else "—",
                     verdict(r["loss"], tgt) if tgt else "—"])
    out.append(markdown_table(["configuration", "runs", "requests/s median", "min–max",
                               "loss vs alone median", "loss vs alone, same round (median; rounds)",
                               "profiler CPU s in window", "of one core", "target", ""], rows, "lrrrrrrrrl"))
    out.append("")
    errs = {r["label"]: r["errors"] for r in server_summary(d) if r["errors"]}
    out.append("Loss: 1 - requests/s under the profiler / requests/s alone (negative: more requests "
               "than alone; the spread of the alone runs is the noise). The verdict is on the loss "
               "against the alone median. Profiler CPU: the profiler process's user+system time during "
               "the window (/proc/PID/stat); BPF programs run in the context of the threads they "
               "observe and are not in it."
               + (" Failed requests: " + ", ".join(f"{k} {v}" for k, v in errs.items()) + "." if errs else ""))
    out.append("")
    if d.get("stats"):
        rows = []
        for m in d["stats"]:
            w = m["window_s"]
            for name, (cnt, ns) in sorted(m.get("progs", {}).items()):
                lb = prog_label(name)
                if not cnt and not lb.startswith(("sched_switch", "on_cpu_sample")):
                    continue
                rows.append([m["profiler"], lb, cnt, f"{cnt / w:.0f}", fmt_num(ns / cnt, 0) if cnt else "no runs",
                             f"{100 * ns / w / 1e9:.2f}%", f"{m['rate']:.0f}"])
        out.append("BPF programs over the window of one more run per pyoffcpu mode, with "
                   "kernel.bpf_stats_enabled=1 (restored after):\n")
        out.append(markdown_table(["profiler", "program", "runs", "runs/s", "average ns", "CPU (share of one core)",
                                   "requests/s in that run"], rows, "llrrrrr"))
        out.append("")
    return out


# -- case 11: one session, many target processes --------------------------------------------------------
# An idle target with several threads: a ticker and three blocked ones, the
# main thread reading stdin (its end, when the bench goes, ends the target).
IDLE_TARGET = r"""
import sys, threading, time
ev = threading.Event()
lock = threading.Lock()
lock.acquire()
def ticker():
    while True:
        time.sleep(0.1)
def waiter():
    ev.wait()
def locked():
    lock.acquire()
for f in (ticker, waiter, waiter, locked):
    threading.Thread(target=f, name=f.__name__, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""
IDLE_TARGET_THREADS = 5
MAPS_AFTER_S = 1.0              # the maps' memory is read this long after the `recording` line


def bpf_maps_memory(pid: int) -> Tuple[int, int]:
    """(maps, bytes): the kernel memory of a process's BPF maps, the sum of the
    `memlock` lines of /proc/PID/fdinfo over its bpf-map fds."""
    texts = []
    for fd in bpfstats._bpf_fds(pid, "bpf-map"):
        t = _read(f"/proc/{pid}/fdinfo/{fd}")
        if t:
            texts.append(t)
    return maps_memlock(texts)


def multi_case(tools: Tools, res: Results, counts: List[int], seconds: float):
    """For each N in counts: one `pyoffcpu -p P1 ... -p PN --mode wall -d seconds`
    over N idle Python processes of IDLE_TARGET_THREADS threads each: its
    peak RSS, the kernel memory of its maps, its time to `recording`."""
    out = {"seconds": seconds, "threads_each": IDLE_TARGET_THREADS, "rows": []}
    targets: List[subprocess.Popen] = []
    env = cache_env(tools)
    folded = os.path.join(tools.outdir, "c11.folded")
    try:
        for _ in range(max(counts)):
            t = subprocess.Popen([tools.python, "-c", IDLE_TARGET], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
            _procs.append(t)
            targets.append(t)
        for t in targets:
            if t.stdout.readline().strip() != "ready":
                raise RuntimeError(f"target {t.pid} did not start")
        log(f"case 11: {len(targets)} idle targets of {IDLE_TARGET_THREADS} threads each")
        try:                            # untimed: the bench's program cache filled, files in the page cache
            starts.measure(tools.pyoffcpu + ["-p", str(targets[0].pid), "--mode", "wall", "-d", "0.5",
                                             "-o", folded], env=env, first_sample=False)
        except RuntimeError as e:
            log(f"case 11: warm-up run: {e}")
        for n in counts:
            pids = [t.pid for t in targets[:n]]
            maps: Dict[str, object] = {}

            def during(pid: int, since: float):
                if "bytes" not in maps and since >= MAPS_AFTER_S:
                    maps["count"], maps["bytes"] = bpf_maps_memory(pid)
            try:
                argv = tools.pyoffcpu + [a for pid in pids for a in ("-p", str(pid))] + [
                    "--mode", "wall", "-d", f"{seconds:g}", "-o", folded]
                r = starts.measure(argv, env=env, timeout=seconds + 300, during=during)
                if r["rc"] != 0:
                    raise RuntimeError(f"pyoffcpu exited {r['rc']}: "
                                       + " | ".join(r["stderr"].strip().splitlines()[-3:]))
                row = {"n": n, "threads": n * IDLE_TARGET_THREADS, **_start_row(r),
                       "maps": maps.get("count"), "maps_bytes": maps.get("bytes")}
                out["rows"].append(row)
                log(f"case 11: {n} targets: recording line {fmt_num(r['recording'], 2)} s, VmHWM "
                    f"{r['hwm_mib']:.0f} MiB, with children {r['maxrss_mib']:.0f} MiB, {row['maps']} maps "
                    f"{fmt_bytes(row['maps_bytes'])}, CPU {r['cpu_s']:.2f} s")
            except Exception as e:                              # noqa: BLE001
                res.errors.append(f"case 11 {n} targets: {e}")
                log(f"case 11 {n} targets: FAILED: {e}")
    except Exception as e:                                      # noqa: BLE001
        res.errors.append(f"case 11: {e}")
        log(f"case 11: FAILED: {e}")
    finally:
        for t in targets:
            try:
                t.stdin.close()
            except OSError:
                pass
        for t in targets:
            try:
                t.wait(5)
            except subprocess.TimeoutExpired:
                t.kill()
                t.wait()
        if os.path.exists(folded):
            os.unlink(folded)
    if out["rows"]:
        res.multi = out


def render_multi(d: dict) -> List[str]:
    out = [f"## One session, many targets (case 11): `pyoffcpu -p P1 ... -p PN --mode wall -d {d['seconds']:g}`\n"]
    rows = [[r["n"], r["threads"], fmt_num(r["recording"], 2), fmt_num(r["first"], 2), fmt_num(r["hwm_mib"], 0),
             fmt_num(r["maxrss_mib"], 0), r["maps"] if r["maps"] is not None else "n/a",
             fmt_num(r["maps_bytes"] / (1 << 20), 1) if r["maps_bytes"] is not None else "n/a",
             fmt_num(r["cpu_s"], 2)] for r in d["rows"]]
    out.append(markdown_table(["targets", "their threads", "start to `recording` s", "start to first sample s",
                               "peak RSS MiB (VmHWM)", "peak RSS with children MiB", "BPF maps",
                               "BPF map memory MiB", "CPU s (whole run)"], rows, "rrrrrrrrr"))
    out.append("")
    out.append(f"Targets: idle Python processes of {d['threads_each']} threads each (one waking every 100 ms, "
               "the others blocked). Peak RSS: pyoffcpu's VmHWM (polled until it exits) and ru_maxrss of it "
               "with its children (wait4). BPF map memory: the sum of `memlock` in /proc/PID/fdinfo over "
               f"pyoffcpu's bpf-map fds, {MAPS_AFTER_S:g} s into the recording (perf ring buffers are not "
               "in it). Informational: no target. The program cache is the bench's own, filled first.")
    out.append("")
    return out


# -- case 12: pyoffcpu -a on a machine of many Python processes --------------------------------------------
ALL_ARGS = ["-a", "--mode", "cpu", "-F", "99"]
ALL_LABEL = "pyoffcpu -a --mode cpu -F 99"
ALL_CPU_MAX = 0.01              # pyoffcpu -a's own CPU while recording, share of one core
ALL_SLOWDOWN_MAX = 1.01         # a CPU-bound process beside it, median B/A
ALL_SETTLE_S = 2.0              # its CPU window starts this long after the `recording` line ...
ALL_WINDOW_S = 10.0             # ... and lasts this long (less when the recording is too short)
ALL_REPEATS = 5                 # each A and B of a pair: the work in this many runs
ALL_PYTHONS = "pyenv:3.9.18,pyenv:3.11.7,pyenv:3.12.1,pyenv:3.13.0,/usr/bin/python3.11"
FLEET = os.path.join(HERE, "fleet.py")

_SW_FOUND = re.compile(r"-a: (\d+) processes, (\d+) Python interpreters found \((\d+) processes without one\)")
_SW_LATE = re.compile(r"(\d+) samples of (\d+) Python processes came before they were registered")
_SW_RECORDED = re.compile(r"recorded [\d.]+ s of system-wide \((\d+) processes(?:, CPython ([^)]*))?\)")
_ROOT_PID = re.compile(r"^process (\d+)(?: |$)")
_PY_FRAME = re.compile(r" \([^()]*:(?:\d+|\?)\)$")


def parse_system_wide(stderr: str) -> Dict[str, object]:
    """What `pyoffcpu -a` said about the machine on stderr: `processes`,
    `pythons` (interpreters found) and `without` (processes without one) from
    its `-a: N processes, M Python interpreters found (K processes without
    one)` notice; `late_samples` and `late_processes` (Python processes
    sampled before they were registered; 0 without that notice); from its
    `recorded ... of system-wide (N processes, CPython X, Y)` line
    `recorded_processes` and `versions`. None where a line is missing."""
    out: Dict[str, object] = {"processes": None, "pythons": None, "without": None, "late_samples": 0,
                              "late_processes": 0, "recorded_processes": None, "versions": []}
    m = _SW_FOUND.search(stderr)
    if m:
        out["processes"], out["pythons"], out["without"] = (int(x) for x in m.groups())
    m = _SW_LATE.search(stderr)
    if m:
        out["late_samples"], out["late_processes"] = int(m.group(1)), int(m.group(2))
    m = _SW_RECORDED.search(stderr)
    if m:
        out["recorded_processes"] = int(m.group(1))
        out["versions"] = [v.strip() for v in (m.group(2) or "").split(",") if v.strip()]
    return out


def process_roots(lines: Iterable[str]) -> Dict[int, Dict[str, int]]:
    """Per `process PID ...` root of folded lines (pyoffcpu -a's): `stacks`
    and `weight` of all its lines, `python_stacks` and `python_weight` of
    those with at least one Python frame (`name (file:line)`, below the
    process and thread roots). Lines without a process root are skipped."""
    out: Dict[int, Dict[str, int]] = {}
    for line in lines:
        line = line.strip()
        stack, sep, weight = line.rpartition(" ")
        if not sep or not weight.isdigit():
            continue
        frames = stack.split(";")
        m = _ROOT_PID.match(frames[0])
        if not m:
            continue
        d = out.setdefault(int(m.group(1)), {"stacks": 0, "weight": 0, "python_stacks": 0, "python_weight": 0})
        d["stacks"] += 1
        d["weight"] += int(weight)
        rest = frames[1:]
        if rest and rest[0].startswith(("thread ", "threads ")):
            rest = rest[1:]
        if any(_PY_FRAME.search(f) for f in rest):
            d["python_stacks"] += 1
            d["python_weight"] += int(weight)
    return out


def all_pythons(specs: str) -> Tuple[List[str], List[str]]:
    """The interpreters of case 12's processes, in order: each spec a path or
    `pyenv:VERSION` (`pyenv prefix VERSION`/bin/pythonX.Y, else
    $PYENV_ROOT or ~/.pyenv's versions/VERSION). Returns (found, missing)."""
    found, missing = [], []
    for spec in (s.strip() for s in specs.split(",")):
        if not spec:
            continue
        cands = [spec]
        if spec.startswith("pyenv:"):
            v = spec[len("pyenv:"):]
            prefixes = []
            try:
                r = subprocess.run(["pyenv", "prefix", v], capture_output=True, text=True, timeout=30)
                if r.returncode == 0 and r.stdout.strip():
                    prefixes.append(r.stdout.strip().splitlines()[0])
            except (OSError, subprocess.TimeoutExpired):
                pass
            for root in (os.environ.get("PYENV_ROOT"), os.path.expanduser("~/.pyenv"), "/root/.pyenv"):
                if root:
                    prefixes.append(os.path.join(root, "versions", v))
            xy = ".".join(v.split(".")[:2])
            cands = [os.path.join(p, "bin", n) for p in prefixes for n in (f"python{xy}", "python3")]
        exe = next((c for c in cands if os.path.isfile(c) and os.access(c, os.X_OK)), None)
        (found if exe else missing).append(exe or spec)
    return found, missing


def _share(a: Optional[Tuple[float, float]], b: Optional[Tuple[float, float]]) -> Optional[float]:
    """CPU share of one core between two (seconds since, CPU seconds) readings."""
    if not a or not b or b[0] <= a[0]:
        return None
    return (b[1] - a[1]) / (b[0] - a[0])


def allprocs_case(tools: Tools, res: Results, procs: int, seconds: float, pairs: int, work_s: float,
                  pythons: str, short_every: float = 0.5, keep: bool = False):
    """`pyoffcpu -a --mode cpu -F 99` beside tools/bench/fleet.py's `procs`
    Python processes (mixed interpreters; idle, busy, short-lived): one
    `-d seconds` recording (its start, its own CPU over a window, its peak
    RSS, what it found) and `pairs` A/B pairs of a CPU-bound process beside
    it, each with an A/A pair of the same process for reference."""
    pys, missing = all_pythons(pythons)
    out = {"procs": procs, "seconds": seconds, "pairs": pairs, "pythons": pys, "missing": missing,
           "settle_s": ALL_SETTLE_S, "window_s": min(ALL_WINDOW_S, seconds - ALL_SETTLE_S - 1)}
    if missing:
        res.notes.append(f"case 12: interpreters not found, left out: {', '.join(missing)}")
    if not pys:
        res.errors.append(f"case 12: none of the interpreters found ({pythons})")
        return
    env = tools.env             # pyoffcpu's own program cache, as in cases 1-4 (nothing here empties it)
    folded = os.path.join(tools.outdir, "c12.folded")
    fleet = Proc([tools.python, FLEET, "--procs", str(procs), "--short-every", f"{short_every:g}", *pys],
                 stdin=True)
    try:
        info = json.loads(fleet.expect("ready ", 180).split(" ", 1)[1])
        out["fleet"] = info
        roles: Dict[str, int] = {}
        for c in info["long"]:
            roles[c["role"]] = roles.get(c["role"], 0) + 1
        log(f"case 12: {len(info['long'])} long-lived Python processes ("
            + ", ".join(f"{n} {r}" for r, n in sorted(roles.items())) + f") under {len(pys)} interpreters, "
            f"a short-lived one every {info['short_every']:g} s living {info['short_life']:g} s")
        time.sleep(1.0)                                 # the short-lived ones come and go
        try:                            # untimed: the program cache filled, files in the page cache
            starts.measure(tools.pyoffcpu + ALL_ARGS + ["-d", "0.5", "-o", folded], env=env,
                           first_sample=False, timeout=300)
        except RuntimeError as e:
            log(f"case 12: warm-up run: {e}")
        try:
            allprocs_recording(tools, env, fleet, info, out, seconds, folded)
        except Exception as e:                          # noqa: BLE001
            res.errors.append(f"case 12 recording: {e}")
            log(f"case 12 recording: FAILED: {e}")
        if pairs > 0:
            allprocs_pairs(tools, res, out, pairs, work_s)
    except Exception as e:                              # noqa: BLE001
        res.errors.append(f"case 12: {e}")
        log(f"case 12: FAILED: {e}")
    finally:
        fleet.close(10)
        if os.path.exists(folded) and not keep:
            os.unlink(folded)
    if out.get("recording") or out.get("ab"):
        res.allprocs = out


def allprocs_recording(tools: Tools, env: Optional[Dict[str, str]], fleet: Proc, info: dict, out: dict, seconds: float,
                       folded: str):
    window = out["window_s"]
    marks = (("rec", 0.0), ("settle", ALL_SETTLE_S), ("end", ALL_SETTLE_S + window))
    readings: Dict[str, Tuple[float, float]] = {}

    def during(pid: int, since: float):
        for key, at in marks:
            if key not in readings and since >= at and (key != "end" or window > 0):
                c = _cpu_s(pid)
                if c is not None:
                    readings[key] = (since, c)
    log(f"case 12: {ALL_LABEL} -d {seconds:g}, its CPU read {ALL_SETTLE_S:g}–{ALL_SETTLE_S + window:g} s "
        "after its `recording` line")
    t_call = time.monotonic()
    r = starts.measure(tools.pyoffcpu + ALL_ARGS + ["-d", f"{seconds:g}", "-o", folded], env=env,
                       timeout=seconds + 300, during=during)
    if r["rc"] != 0:
        raise RuntimeError(f"pyoffcpu exited {r['rc']}: " + " | ".join(r["stderr"].strip().splitlines()[-3:]))
    if r["recording"] is None:
        raise RuntimeError("no `recording` line")
    t_rec = t_call + r["recording"]
    rec = {k: r[k] for k in ("first", "recording", "hwm_mib", "maxrss_mib", "cpu_s", "total_s")}
    rec["stop_s"] = r["total_s"] - r["recording"] - seconds      # -d ran out to its exit (the file written)
    rec["startup_cpu_s"] = readings["rec"][1] if "rec" in readings else None
    rec["first_share"] = _share(readings.get("rec"), readings.get("settle"))
    rec["window_share"] = _share(readings.get("settle"), readings.get("end"))
    if "settle" in readings and "end" in readings:
        rec["window_measured_s"] = readings["end"][0] - readings["settle"][0]
    rec.update(parse_system_wide(r["stderr"]))
    fleet.send("shorts")
    shorts = json.loads(fleet.expect("shorts ", 10).split(" ", 1)[1])
    with open(folded, errors="replace") as f:
        roots = process_roots(f)
    empty = {"stacks": 0, "python_stacks": 0}
    per: Dict[str, dict] = {}
    for c in info["long"]:
        key = f"{c['python']} ({c['version']})"
        d = per.setdefault(key, {"n": 0, "sampled": 0, "python": 0, "busy": 0})
        root = roots.get(c["pid"], empty)
        d["n"] += 1
        d["busy"] += c["role"] == "busy"
        d["sampled"] += root["stacks"] > 0
        d["python"] += root["python_stacks"] > 0
    rec["per_python"] = per
    inside = [s for s in shorts if s["start"] >= t_rec and s["end"] is not None and s["end"] <= t_rec + seconds]
    rec["shorts"] = {"n": len(inside),
                     "sampled": sum(roots.get(s["pid"], empty)["stacks"] > 0 for s in inside),
                     "python": sum(roots.get(s["pid"], empty)["python_stacks"] > 0 for s in inside)}
    ours = {c["pid"] for c in info["long"]} | {s["pid"] for s in shorts} | {info["parent"]}
    rec["roots"] = len(roots)
    rec["other_roots"] = len(set(roots) - ours)
    out["recording"] = rec
    n_long = len(info["long"])
    found = sum(d["python"] for d in per.values())
    ws = rec["window_share"]
    log(f"case 12: `recording` after {r['recording']:.2f} s, own CPU "
        f"{fmt_num(100 * ws if ws is not None else None, 2)}% of a core over {window:g} s, "
        f"VmHWM {r['hwm_mib']:.0f} MiB; {found}/{n_long} long-lived and "
        f"{rec['shorts']['python']}/{rec['shorts']['n']} short-lived with Python frames; notice: "
        f"{rec['processes']} processes, {rec['pythons']} Python interpreters, versions {', '.join(rec['versions'])}")


def _repeats(w: Worker, n: int, k: int) -> Tuple[float, dict]:
    """k runs of n units on w: (their total seconds, {fastest, cpu_s, rq_s})."""
    ts, cpu, rq = [], 0.0, 0.0
    for _ in range(k):
        t, x = w.run(n)
        ts.append(t)
        cpu += x.get("cpu_s", 0)
        rq += x.get("rq_s", 0)
    return sum(ts), {"fastest": min(ts), "cpu_s": cpu, "rq_s": rq}


def allprocs_pairs(tools: Tools, res: Results, out: dict, pairs: int, work_s: float):
    """A/B pairs of a CPU-bound process (workloads.py cpu) beside `pyoffcpu -a`,
    each followed by an A/A pair of the same process (both alone). Each A or
    B is ALL_REPEATS runs of a fifth of the work: its time is their total
    (the verdict's), and the fastest of them is kept too."""
    n = calibrate(tools, "cpu", 2000, work_s)
    k = ALL_REPEATS
    n_rep = max(1, n // k)
    prof = Profiler(ALL_LABEL, lambda _pid, o: tools.pyoffcpu + ALL_ARGS + ["-o", o + ".folded"],
                    r"^pyoffcpu: recording", True)
    ab, aa, ab_fast, aa_fast = Pairs(), Pairs(), Pairs(), Pairs()
    for i in range(pairs):
        tag = f"c12-pair-{i}"
        order = "AB" if i % 2 == 0 else "BA"
        w = Worker(tools.python, "cpu")
        try:
            w.run(max(1, n // 5))                               # warm-up

            def a():
                return _repeats(w, n_rep, k)

            def b():
                tb, xb, _ = profiled_run(tools, prof, 0, a, tag)
                return tb, xb
            if order == "AB":
                ta, xa = a()
                tb, xb = b()
            else:
                tb, xb = b()
                ta, xa = a()
            ab.add(ta, tb, cpu=(xa["cpu_s"], xb["cpu_s"]), wait=(xa["rq_s"], xb["rq_s"]))
            ab_fast.add(xa["fastest"], xb["fastest"])
            (t1, x1), (t2, x2) = a(), a()
            if i % 2:
                (t1, x1), (t2, x2) = (t2, x2), (t1, x1)
            aa.add(t1, t2, cpu=(x1["cpu_s"], x2["cpu_s"]), wait=(x1["rq_s"], x2["rq_s"]))
            aa_fast.add(x1["fastest"], x2["fastest"])
            log(f"case 12 pair {i + 1}/{pairs} {order}: A {ta:.3f}s B {tb:.3f}s ratio {tb / ta:.3f} (fastest of "
                f"{k}: {xb['fastest'] / xa['fastest']:.3f}); A/A {t2 / t1:.3f} ({x2['fastest'] / x1['fastest']:.3f}); "
                f"waiting for a CPU A {xa['rq_s']:.3f}s B {xb['rq_s']:.3f}s")
        except Exception as e:                                  # noqa: BLE001
            ab.failures.append(str(e))
            res.errors.append(f"case 12 pair {i + 1}: {e}")
            log(f"case 12 pair {i + 1}: FAILED: {e}")
        finally:
            w.close()
            if os.path.exists(os.path.join(tools.outdir, tag + ".folded")):
                os.unlink(os.path.join(tools.outdir, tag + ".folded"))
    out["n_work"], out["repeats"] = n_rep * k, k
    out["ab"] = {**ab.summary(), "failures": len(ab.failures)}
    out["aa"] = aa.summary()
    out["ab_fast"] = ab_fast.summary()
    out["aa_fast"] = aa_fast.summary()


def render_allprocs(d: dict) -> List[str]:
    fl = d.get("fleet") or {}
    longs = fl.get("long", [])
    roles: Dict[str, int] = {}
    for c in longs:
        roles[c["role"]] = roles.get(c["role"], 0) + 1
    out = [f"## System-wide (case 12): `{ALL_LABEL}` beside {d['procs']} Python processes\n"]
    out.append(f"tools/bench/fleet.py keeps {d['procs']} Python processes alive: {len(longs)} long-lived "
               f"({roles.get('idle-sleep', 0)} idle in time.sleep, {roles.get('idle-lock', 0)} idle in a lock's "
               f"acquire(timeout), each waking every 100 ms for 0.2 ms of Python work; {roles.get('busy', 0)} busy, "
               f"spinning 2% of every 50 ms) and "
               + (f"about {fl.get('short_alive', 0)} short-lived ones (one started every {fl['short_every']:g} s, "
                  f"living {fl.get('short_life', 0):g} s: 0.2 s asleep, 30 ms of work)" if fl.get("short_every")
                  else "no short-lived ones")
               + ", round-robin over "
               + ", ".join(f"`{p}`" for p in d["pythons"])
               + (f" (not found, left out: {', '.join(d['missing'])})" if d.get("missing") else "")
               + ". The rest of the machine runs what it runs (the bench, a neighbour's tests).\n")
    rows = []
    rec = d.get("recording")
    if rec:
        ws = rec.get("window_share")
        rows.append([f"own CPU, {d['settle_s']:g}–{d['settle_s'] + d['window_s']:g} s after `recording` "
                     "(% of one core)", f"{100 * ws:.2f}" if ws is not None else "n/a",
                     f"<= {100 * ALL_CPU_MAX:g}", verdict(ws, ALL_CPU_MAX)])
        fs = rec.get("first_share")
        rows.append([f"own CPU, first {d['settle_s']:g} s after `recording` (% of one core)",
                     f"{100 * fs:.2f}" if fs is not None else "n/a", "—", ""])
        rows.append(["CPU from start to `recording` (s)", fmt_num(rec.get("startup_cpu_s"), 2), "—", ""])
        rows.append([f"CPU of the whole -d {d['seconds']:g} run, children included (s)",
                     fmt_num(rec.get("cpu_s"), 2), "—", ""])
        rows.append(["start to `recording` line (s)", fmt_num(rec.get("recording"), 2), "—", ""])
        rows.append(["start to first sample in the kernel map (s)", fmt_num(rec.get("first"), 2), "—", ""])
        rows.append(["-d ran out to exit, file written (s)", fmt_num(rec.get("stop_s"), 2), "—", ""])
        rows.append(["peak RSS (VmHWM, MiB)", fmt_num(rec.get("hwm_mib"), 0), "—", ""])
        rows.append(["peak RSS with children (ru_maxrss, MiB)", fmt_num(rec.get("maxrss_mib"), 0), "—", ""])
    ab, aa = d.get("ab"), d.get("aa")
    if ab:
        rows.append([f"CPU-bound process beside it: B/A, median of {ab['n']} pairs"
                     + (f" ({ab['failures']} failed)" if ab.get("failures") else ""),
                     fmt_num(ab["ratio_median"]), f"<= {ALL_SLOWDOWN_MAX:.2f}",
                     verdict(ab["ratio_median"], ALL_SLOWDOWN_MAX)])
        rows.append(["... B/A min–max", fmt_ratio_range(ab["ratio_min"], ab["ratio_max"]), "—", ""])
        rows.append(["... CPU-time ratio B/A, median (min–max)",
                     f"{fmt_num(ab['cpu_ratio_median'])} ({fmt_ratio_range(ab['cpu_ratio_min'], ab['cpu_ratio_max'])})",
                     "—", ""])
        rows.append(["... waiting for a CPU, A / B (median share of the run)",
                     "n/a" if ab["wait_a"] is None else f"{100 * ab['wait_a']:.1f}% / {100 * ab['wait_b']:.1f}%",
                     "—", ""])
    if aa and aa.get("n"):
        rows.append([f"reference: A/A of the same processes, median of {aa['n']} (min–max)",
                     f"{fmt_num(aa['ratio_median'])} ({fmt_ratio_range(aa['ratio_min'], aa['ratio_max'])})",
                     "—", ""])
    k = d.get("repeats")
    for label, x in ((f"B/A of the fastest of the {k} runs, median (min–max)", d.get("ab_fast")),
                     (f"reference: A/A of the fastest of the {k} runs, median (min–max)", d.get("aa_fast"))):
        if x and x.get("n"):
            rows.append([label, f"{fmt_num(x['ratio_median'])} ({fmt_ratio_range(x['ratio_min'], x['ratio_max'])})",
                         "—", ""])
    out.append(markdown_table(["measured", "value", "target", ""], rows, "lrrl"))
    out.append("")
    if rec:
        n_long = len(longs)
        found = sum(x["python"] for x in rec["per_python"].values())
        sampled = sum(x["sampled"] for x in rec["per_python"].values())
        lines = [
            f"pyoffcpu's notice: -a: {rec.get('processes', 'n/a')} processes, {rec.get('pythons', 'n/a')} Python "
            f"interpreters found ({rec.get('without', 'n/a')} processes without one)"
            + (f"; {rec['late_samples']} samples of {rec['late_processes']} Python processes came before they "
               "were registered (native frames only)" if rec.get("late_samples") else ""),
            f"its summary: {rec.get('recorded_processes', 'n/a')} processes recorded, CPython "
            + (", ".join(rec.get("versions") or []) or "n/a"),
            f"the folded file: {rec['roots']} process roots, {rec['other_roots']} of them not the fleet's; "
            f"of the {n_long} long-lived processes {sampled} sampled, {found} with Python frames; of the "
            f"{rec['shorts']['n']} short-lived ones that lived and died inside the recording "
            f"{rec['shorts']['sampled']} sampled, {rec['shorts']['python']} with Python frames",
        ]
        out.extend(f"- {x}" for x in lines)
        out.append("")
        rows = [[k, v["n"], v["busy"], v["sampled"], v["python"]] for k, v in rec["per_python"].items()]
        rows.append(["short-lived (all interpreters)", rec["shorts"]["n"], "—", rec["shorts"]["sampled"],
                     rec["shorts"]["python"]])
        out.append(markdown_table(["interpreter", "processes", "of them busy", "with samples",
                                   "with Python frames"], rows, "lrrrr"))
        out.append("")
    out.append(f"One `{ALL_LABEL} -d {d['seconds']:g}` recording (an untimed run first, for the program cache and "
               "the page cache), followed from its spawn by tools/startup.py: its own CPU is its user+system time "
               f"(/proc/PID/stat, all threads) read {d['settle_s']:g} s and {d['settle_s'] + d['window_s']:g} s "
               "after its `recording` line; BPF runs in the context of the processes it samples and is not in "
               "it. With samples / with Python frames: the `process PID` roots of the folded file, and those "
               "with a `name (file:line)` frame. An idle process is on a CPU about 0.2% of the time, about "
               f"{0.002 * 99 * d['seconds']:.0f} samples expected in {d['seconds']:g} s. "
               + (f"Slowdown: {d['pairs']} pairs of a fresh `workloads.py cpu` process, each A and B "
                  f"{d.get('n_work')} units of work in {d.get('repeats')} runs ({fmt_num(ab['a_median'], 2)} s "
                  f"alone, median), AB and BA alternating, `{ALL_LABEL}` started before B and gone before A "
                  "(SIGINT, its file of the whole machine written); each pair followed by an A/A pair of the same "
                  "process, both alone, for the noise. The verdict is on the total time; the fastest of the runs "
                  "of each A and B is the least disturbed by the machine's other load (its neighbour's too, which "
                  "shows as CPU time of ours). " if ab else "")
               + "Informational except the two targets.")
    out.append("")
    return out


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


def targets_summary(res: Results) -> List[List[str]]:
    """One row per target of issue #5: what, limit, measured, PASS/MISS."""
    rows = []
    for r in res.overhead:
        if r["target"]:
            rows.append([f"case {r['case']}: {r['profiler']}, median B/A", f"<= {r['target']:.2f}",
                         fmt_num(r["ratio_median"]), verdict(r["ratio_median"], r["target"])])
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
        import torch_case
        out.extend(torch_case.render_torch(res.torch, markdown_table, median))
    if res.notes:
        out.append("## Notes\n")
        out.extend(f"- {n}" for n in res.notes)
        out.append("")
    if res.errors:
        out.append("## Failed measurements\n")
        out.extend(f"- {e}" for e in res.errors)
        out.append("")
    return "\n".join(out)


def render_accuracy(a: dict) -> List[str]:
    out = [f"## Accuracy (case 5): wall-time split, 2 threads, {a['runs']} x {a['seconds']:g} s per profiler\n"]
    labels = list(a["per"])
    rows = []
    for loop, plan in a["design"].items():
        cycle = sum(plan.values())
        for fn in a["functions"]:
            truth = median([t[loop][fn] for t in a["truths"]])
            row = [loop.replace("_loop", ""), fn, f"{100 * plan[fn] / cycle:.1f}",
                   f"{100 * truth:.1f}" if truth is not None else "n/a"]
            for lb in labels:
                v = median([s[loop][fn] for s in a["per"][lb]["shares"]])
                row.append(f"{100 * v:.1f}" if v is not None else "n/a")
            rows.append(row)
    out.append(markdown_table(["thread", "function", "designed %", "measured by the target %"]
                              + [f"{lb} %" for lb in labels], rows, "ll" + "r" * (2 + len(labels))))
    out.append("")
    rows = []
    for lb in labels:
        errs = a["per"][lb]["errors"]
        tgt = 1.5 if lb.startswith("pyoffcpu") else None
        rows.append([lb, fmt_num(median(errs), 2), fmt_ratio_range(min(errs), max(errs)) if errs else "n/a",
                     f"<= {tgt:g}" if tgt else "—", verdict(median(errs), tgt)])
    out.append(markdown_table(["profiler", "max error pp (median of runs)", "min–max over runs", "target", ""],
                              rows, "lrrrl"))
    out.append("")
    out.append("Shares are inclusive, of each thread's time in its loop; the truth is what the target "
               "timed itself (perf_counter around each call). pyoffcpu's weights are microseconds, "
               "py-spy's are samples at 100 Hz (with --idle).")
    out.append("")
    return out


STARTUP_TARGETS = {"warm": 0.5, "cold": 3.0}    # issue 10: start to first sample, s
STARTUP_RSS_MIB = 120.0                         # issue 10: peak RSS with children, warm and cold
TEARDOWN_S = 0.2                                # issue 10: SIGINT to file written


def _spread_row(what: str, measured: str, values, digits: int, target: Optional[float] = None,
                unit: str = "") -> list:
    s = spread(values)
    return [what, measured, s["n"], fmt_num(s["median"], digits), fmt_range(s["min"], s["max"], digits),
            f"<= {target:g}{unit}" if target is not None else "—", verdict(s["median"], target)]


def render_startup(s: dict, args) -> List[str]:
    out = ["## Startup and teardown (case 6)\n"]
    rows = []
    for kind in ("warm", "cold"):
        rs = s.get(kind) or []
        if not rs:
            continue
        who = f"pyoffcpu -p PID --mode wall, {kind}"
        rows.append(_spread_row(who, "start to first sample in the kernel map (s)", [r["first"] for r in rs], 3,
                                STARTUP_TARGETS[kind], " s"))
        rows.append(_spread_row(who, "start to `recording` line (s)", [r["recording"] for r in rs], 3))
        rows.append(_spread_row(who, "peak RSS of pyoffcpu (VmHWM, MiB)", [r["hwm_mib"] for r in rs], 0))
        rows.append(_spread_row(who, "peak RSS with its children (ru_maxrss, MiB)", [r["maxrss_mib"] for r in rs],
                                0, STARTUP_RSS_MIB, " MiB"))
        rows.append(_spread_row(who, "CPU time of the whole 1 s run, children included (s)",
                                [r["cpu_s"] for r in rs], 2))
    if s.get("pyspy"):
        rows.append(_spread_row("py-spy record -p PID --idle", "start to `Sampling process` line (s)",
                                [r["recording"] for r in s["pyspy"]], 3))
    for who in ("pyoffcpu", "py-spy"):
        for secs in sorted({t["seconds"] for t in s["teardown"] if t["who"] == who}):
            ts = [t for t in s["teardown"] if t["who"] == who and t["seconds"] == secs]
            rows.append(_spread_row(f"{who} → SVG, {secs:g} s recording", "SIGINT to file written (s)",
                                    [t["file"] for t in ts], 2, TEARDOWN_S if who == "pyoffcpu" else None, " s"))
    out.append(markdown_table(["what", "measured", "runs", "median", "min–max", "target", ""], rows,
                              "llrrrrl"))
    out.append("")
    out.append("Each start: `pyoffcpu -p PID --mode wall -d 1` on the split workload (two busy-ish Python "
               "threads), measured by tools/startup.py from the spawn. First sample: the bench polls a copy "
               "of pyoffcpu's `agg` map fd (pidfd_getfd) until it holds an entry. pyoffcpu runs with "
               "PYOFFCPU_CACHE_DIR in the bench's temporary folder: warm, with the compiled programs in it "
               "(filled by one untimed run first); cold, with its `bpf` folder (programs, BTF offsets) "
               "removed before each run, so bcc compiles in a child, whose peak counts in ru_maxrss. Warm "
               "and cold runs alternate.")
    if s.get("breakdown"):
        out.append("")
        out.append("Where a warm start goes (one `pyoffcpu -p` start under cProfile, the cache filled; "
                   "cumulative seconds, steps nest):\n")
        out.append(markdown_table(["step", "s"], [[w, f"{t:.3f}"] for w, t in s["breakdown"]], "lr"))
        out.append("")
    if args is not None and args.long_s < 600:
        out.append(f"The long teardown recording is {args.long_s:g} s, not the issue's 10 min, to keep "
                   f"`make bench` short; BENCH_LONG_S=600 make bench for the full one.")
    out.append("")
    return out


# -- main ----------------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=int(os.environ.get("BENCH_PAIRS", 7)))
    ap.add_argument("--work-s", type=float, default=float(os.environ.get("BENCH_WORK_S", 1.0)))
    ap.add_argument("--long-s", type=float, default=float(os.environ.get("BENCH_LONG_S", 60)))
    ap.add_argument("--cases", default=os.environ.get("BENCH_CASES", "1,2,3,4,5,6,7,9,10,11,12,13,14,15"),
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
                    help="leave out case 4's reference programs (empty tracepoint, raw tracepoint)")
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
        env = dict(os.environ, PYTHONPATH=os.path.join(tree, "pytool"))
        po = [sys.executable, "-m", "pyoffcpu"]
    pyspy, pyspy_version = setup_pyspy() if cases & {"1", "2", "3", "5", "6", "10", "13", "15"} else (None, "")
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
            three = [P[k] for k in ("pyoffcpu --mode wall", "pyoffcpu --mode wall --wakers",
                                    "py-spy record --idle -r 100") if k in P]
            slowdown_case(tools, res, "3", pp, n_pp, three, args.pairs,
                          {"pyoffcpu --mode wall": 1.05, "pyoffcpu --mode wall --wakers": 1.10})  # issue 12
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
        if "15" in cases:
            log("case 15: PyTorch as it is run")
            import torch_case
            try:
                res.torch = torch_case.torch_case(tools, starts, log)
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
