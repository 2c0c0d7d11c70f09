"""Case 18: the crash watcher (`pyoffcpu crashes -a`, issue 29): what it costs
while nothing crashes, and its BPF time per signal.

- A/B pairs of a CPU-bound process (workloads.py cpu) alone (A) and beside
  the watcher (B), each followed by an A/A pair of the same process: the
  verdict is the median B/A (>= 0.99 of its speed alone: B/A <= 1.01).
- BPF ns per signal (kernel.bpf_stats_enabled, the watcher's programs):
  a process that sends itself SIGUSR1 SIGNALS times (caught: the program
  runs and returns at its first test), then CRASHES crashes of the crash
  fixture (tests/workloads/crash_fixture.c from crashes.py: the whole
  capture, its tail calls included), and the watcher's map memory.
- Per exec (issue 39: every exec and fork is a birth the watcher is told
  of): a shell loop of EXECS `/bin/true` (a fork and an exec each), timed
  alone and beside the watcher, interleaved (alone, beside, ... alone);
  the BPF ns of the fork and exec programs per exec, and the watcher's own
  CPU per exec (it reads each new image once: not Python, ignored).
"""
from __future__ import annotations

import os
import re
import subprocess
import time
from typing import List

from harness import fmt_ratio_range, markdown_table, prog_delta, verdict

import bpfstats
from common import HERE, Profiler, Proc, Results, Tools, log
from case_allprocs import allprocs_pairs

CRASH_LABEL = "pyoffcpu crashes -a"
CRASH_SLOWDOWN_MAX = 1.01
SIGNALS = 100_000
CRASHES = 5
EXECS = 2000
EXEC_ROUNDS = 3
EXEC_LOOP = ["sh", "-c", 'i=0; while [ "$i" -lt "$0" ]; do /bin/true; i=$((i+1)); done', str(EXECS)]
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKLOADS = os.path.join(ROOT, "tests", "workloads")
READY = r"^pyoffcpu: watching \d+ processes"
SIGNAL_STORM = r"""
import os, signal, sys
signal.signal(signal.SIGUSR1, lambda *a: None)
n = int(sys.argv[1])
me = os.getpid()
for _ in range(n):
    os.kill(me, signal.SIGUSR1)
"""


def crashes_case(tools: Tools, res: Results, pairs: int, work_s: float):
    out = {"pairs": pairs}
    try:
        per_signal(tools, out)
    except Exception as e:                              # noqa: BLE001
        res.errors.append(f"case 18 per signal: {e}")
        log(f"case 18 per signal: FAILED: {e}")
    try:
        per_exec(tools, out)
    except Exception as e:                              # noqa: BLE001
        res.errors.append(f"case 18 per exec: {e}")
        log(f"case 18 per exec: FAILED: {e}")
    if pairs > 0:
        try:
            watcher_pairs(tools, res, out, pairs, work_s)
        except Exception as e:                          # noqa: BLE001
            res.errors.append(f"case 18 pairs: {e}")
            log(f"case 18 pairs: FAILED: {e}")
    if out.get("ab") or out.get("signals") or out.get("execs"):
        res.crashes = out


def _watcher(tools: Tools, directory: str) -> Proc:
    p = Proc(tools.pyoffcpu + ["crashes", "-a", "--dir", directory], env=tools.env)
    p.wait_err(READY, 180)
    return p


def per_signal(tools: Tools, out: dict):
    sysctl = bpfstats.StatsSysctl()
    if not sysctl.on():
        raise RuntimeError("kernel.bpf_stats_enabled cannot be set")
    directory = os.path.join(tools.outdir, "c18-crashes")
    so = os.path.join(tools.outdir, "crash_fixture.so")
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", so, os.path.join(WORKLOADS, "crash_fixture.c")],
                   check=True)
    p = _watcher(tools, directory)
    try:
        stats = bpfstats.ProgStats(p.pid)
        before = stats.read()
        t0 = time.monotonic()
        subprocess.run([tools.python, "-c", SIGNAL_STORM, str(SIGNALS)], check=True, timeout=600)
        storm_s = time.monotonic() - t0
        mid = stats.read()
        crashed = 0
        for i in range(CRASHES):
            r = subprocess.run([tools.python, os.path.join(WORKLOADS, "crashes.py"), so,
                                "null" if i % 2 == 0 else "abort"], capture_output=True, text=True,
                               timeout=60)
            crashed += r.returncode < 0
        time.sleep(1.0)
        after = stats.read()
        maps = _map_memory(p.pid)
    finally:
        p.interrupt()
        p.wait(60)
        sysctl.off()
    storm, fatal = prog_delta(before, mid), prog_delta(mid, after)
    total = lambda d: (sum(c for c, _ in d.values()), sum(n for _, n in d.values()))  # noqa: E731
    entry = [k for k in storm if "signal" in k] or list(storm)
    s_cnt = sum(storm[k][0] for k in entry)
    s_ns = sum(storm[k][1] for k in entry)
    f_runs = sum(fatal[k][0] for k in entry)
    out["signals"] = {"sent": SIGNALS, "runs": s_cnt, "ns_per_signal": s_ns / max(s_cnt, 1),
                      "storm_s": storm_s, "crashes": crashed, "fatal_runs": f_runs,
                      "fatal_ns_total": total(fatal)[1], "programs": {k: list(v) for k, v in fatal.items()},
                      "map_bytes": maps}
    reports = len([f for _, _, fs in os.walk(directory) for f in fs if f.endswith(".crash.txt")])
    out["signals"]["reports"] = reports
    log(f"case 18: {s_cnt} runs for {SIGNALS} SIGUSR1: {s_ns / max(s_cnt, 1):.0f} ns each; "
        f"{crashed} crashes, {reports} reports, {total(fatal)[1] / max(crashed, 1):.0f} ns of BPF per crash; "
        f"maps {maps / 1024:.0f} KiB")


def _loop_s() -> float:
    t = time.monotonic()
    subprocess.run(EXEC_LOOP, check=True, timeout=600)
    return time.monotonic() - t


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def per_exec(tools: Tools, out: dict):
    """EXEC_LOOP alone and beside the watcher, EXEC_ROUNDS rounds each,
    interleaved (a watcher started for each beside round); BPF and the
    watcher's CPU per exec."""
    sysctl = bpfstats.StatsSysctl()
    if not sysctl.on():
        raise RuntimeError("kernel.bpf_stats_enabled cannot be set")
    alone: List[float] = [_loop_s()]
    beside: List[float] = []
    bpf_ns = cpu_s = 0.0
    runs = 0
    per_prog: dict = {}
    try:
        for r in range(EXEC_ROUNDS):
            p = _watcher(tools, os.path.join(tools.outdir, f"c18-execs-{r}"))
            try:
                time.sleep(1.0)             # its start's reads done
                stats = bpfstats.ProgStats(p.pid)
                before, cpu0 = stats.read(), _cpu_s(p.pid)
                beside.append(_loop_s())
                time.sleep(0.5)             # the last births read
                after, cpu1 = stats.read(), _cpu_s(p.pid)
            finally:
                p.interrupt()
                p.wait(60)
            d = prog_delta(before, after)
            for k in d:
                if "fork" in k or "exec" in k or "exit" in k:
                    per_prog[k] = [a + b for a, b in zip(per_prog.get(k, (0, 0)), d[k])]
            births = [k for k in d if "fork" in k or "exec" in k]
            bpf_ns += sum(d[k][1] for k in births)
            runs += sum(d[k][0] for k in births)
            cpu_s += cpu1 - cpu0
            alone.append(_loop_s())
    finally:
        sysctl.off()
    n = EXECS * len(beside)
    med = lambda xs: sorted(xs)[len(xs) // 2]   # noqa: E731
    out["execs"] = {"execs": n, "alone_us": [a / EXECS * 1e6 for a in alone],
                    "beside_us": [b / EXECS * 1e6 for b in beside],
                    "added_us": (med(beside) - med(alone)) / EXECS * 1e6,
                    "bpf_ns": bpf_ns / max(n, 1), "bpf_runs": runs, "own_cpu_us": cpu_s / max(n, 1) * 1e6,
                    "programs": {k: v[1] / max(n, 1) for k, v in per_prog.items()}}
    e = out["execs"]
    log(f"case 18: {n} execs: {med(e['alone_us']):.0f} us each alone, {med(e['beside_us']):.0f} us "
        f"beside the watcher ({e['added_us']:+.1f} us); BPF {e['bpf_ns']:.0f} ns, the watcher's CPU "
        f"{e['own_cpu_us']:.0f} us per exec")


def _map_memory(pid: int) -> int:
    n = 0
    for fd in bpfstats._bpf_fds(pid, "bpf-map"):
        try:
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                m = re.search(r"^memlock:\s+(\d+)", f.read(), re.M)
        except OSError:
            continue
        n += int(m.group(1)) if m else 0
    return n


def watcher_pairs(tools: Tools, res: Results, out: dict, pairs: int, work_s: float):
    """Case 12's pairs (case_allprocs.allprocs_pairs), the watcher as B's profiler."""
    directory = os.path.join(tools.outdir, "c18-pairs")
    prof = Profiler(CRASH_LABEL, lambda _pid, o: tools.pyoffcpu + ["crashes", "-a", "--dir", directory],
                    READY, True)
    allprocs_pairs(tools, res, out, pairs, work_s, prof=prof, case="18")


def render_crashes(d: dict) -> List[str]:
    out = ["## The crash watcher (case 18): `pyoffcpu crashes -a`\n"]
    rows = []
    ab = d.get("ab")
    if ab:
        rows.append(["a CPU-bound process beside it, median B/A", f"<= {CRASH_SLOWDOWN_MAX:.2f}",
                     f"{ab['ratio_median']:.3f} ({fmt_ratio_range(ab['ratio_min'], ab['ratio_max'])}; "
                     f"A/A {d['aa']['ratio_median']:.3f})",
                     verdict(ab["ratio_median"], CRASH_SLOWDOWN_MAX)])
    s = d.get("signals")
    if s:
        rows.append([f"BPF ns per signal delivered (SIGUSR1 x {s['sent']:,})", "—",
                     f"{s['ns_per_signal']:.0f} ({s['runs']:,} runs)", ""])
        rows.append([f"BPF ns per fatal signal, the whole capture ({s['crashes']} crashes, "
                     f"{s['reports']} reports)", "—",
                     f"{s['fatal_ns_total'] / max(s['crashes'], 1):,.0f}", ""])
        rows.append(["its BPF maps (memlock)", "—", f"{s['map_bytes'] / 1024:,.0f} KiB", ""])
    e = d.get("execs")
    if e:
        med = lambda xs: sorted(xs)[len(xs) // 2]   # noqa: E731
        rows.append([f"an exec (`/bin/true` in a shell loop, {e['execs']:,}): its time alone, beside it",
                     "—", f"{med(e['alone_us']):.0f} µs, {med(e['beside_us']):.0f} µs "
                     f"({e['added_us']:+.1f} µs; rounds {', '.join('%.0f' % x for x in e['beside_us'])})", ""])
        rows.append(["an exec's time added by the watcher (median beside - median alone)", "<= 1 µs",
                     f"{e['added_us']:+.1f} µs", verdict(e["added_us"], 1.0)])
        progs = ", ".join(f"{k.rsplit('_', 1)[-1]} {v:,.0f}" for k, v in sorted(e.get("programs", {}).items()))
        rows.append(["BPF per exec: its fork and exec programs (each program's ns)", "—",
                     f"{e['bpf_ns']:,.0f} ns ({progs})", ""])
        rows.append(["the watcher's own CPU per exec (each new image read once)", "—",
                     f"{e['own_cpu_us']:,.0f} µs", ""])
    out.append(markdown_table(["what", "target", "measured", ""], rows, "lrrl"))
    return out
