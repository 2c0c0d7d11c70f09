"""Case 11: one session, many target processes."""
from __future__ import annotations

import os
import subprocess
from typing import Dict, List, Tuple

from harness import fmt_bytes, fmt_num, maps_memlock, markdown_table

from common import Results, Tools, _procs, bpfstats, log, read_file, starts
from case_startup import _start_row, cache_env


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
        t = read_file(f"/proc/{pid}/fdinfo/{fd}")
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
