"""Case 19: the first recording of a 2,000-thread process (issue 43).

A pyenv 3.11 process (the bench's target Python where pyenv has none) with
THREADS threads that each sleep 50-110 ms and wake, recorded RECORD_S s
with `pyoffcpu -p PID --mode wall`: cold (an empty PYOFFCPU_CACHE_DIR of
its own: no compiled programs, no unwind tables, no symbol indexes) and
warm (the same directory again), RUNS times each.  Measured: the share of
the native-stack time that ended in [native table not ready] (the summary's
line; none: 0%), the seconds the recording held, and pyoffcpu's wall time
from spawn to exit.  The target: cold <= 5%.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from typing import List, Optional

from harness import markdown_table
from common import Results, Tools, log

THREADS = 2000
RECORD_S = 10
RUNS = 2
NOT_READY_MAX = 5.0                 # % of the native-stack time, cold
LABEL = f"pyoffcpu --mode wall, a {THREADS}-thread process"
TARGET = r"""
import random, sys, threading, time
def worker(i):
    r = random.Random(i)
    while True:
        time.sleep(r.uniform(0.05, 0.11))
        sum(range(200))
for i in range(int(sys.argv[1])):
    threading.Thread(target=worker, args=(i,), daemon=True).start()
print("ready", flush=True)
time.sleep(3600)
"""
NOT_READY = re.compile(r"native table not ready: [\d.]+ s \(([\d.]+)% of the native-stack time\)")
RECORDED = re.compile(r"recorded ([\d.]+) s of")


def target_python(tools: Tools) -> str:
    try:
        prefix = subprocess.run(["pyenv", "prefix", "3.11"], capture_output=True, text=True,
                                timeout=20).stdout.strip()
    except OSError:
        prefix = ""
    exe = os.path.join(prefix, "bin", "python") if prefix else ""
    return exe if exe and os.access(exe, os.X_OK) else tools.python


def one_recording(tools: Tools, pid: int, cache: str) -> Optional[dict]:
    env = dict(tools.env or os.environ, PYOFFCPU_CACHE_DIR=cache)
    env.pop("PYOFFCPU_TABLES_FIRST", None)          # the default: tables made while it records
    out = os.path.join(tempfile.gettempdir(), f"bench19-{os.getpid()}.folded")
    t0 = time.monotonic()
    p = subprocess.run(tools.pyoffcpu + ["-p", str(pid), "-d", str(RECORD_S), "-o", out],
                       capture_output=True, text=True, env=env, timeout=RECORD_S * 12)
    took = time.monotonic() - t0
    if os.path.exists(out):
        os.unlink(out)
    if p.returncode != 0:
        log(f"case 19: pyoffcpu exited {p.returncode}: {p.stderr.strip()[-300:]}")
        return None
    m, r = NOT_READY.search(p.stderr), RECORDED.search(p.stderr)
    return {"not_ready_pct": float(m.group(1)) if m else 0.0,
            "recorded_s": float(r.group(1)) if r else None, "wall_s": took}


def threads_case(tools: Tools, res: Results):
    py = target_python(tools)
    out = {"python": py, "cold": [], "warm": []}
    for i in range(RUNS):
        cache = tempfile.mkdtemp(prefix="bench19-")
        t = subprocess.Popen([py, "-c", TARGET, str(THREADS)], stdout=subprocess.PIPE, text=True)
        try:
            if t.stdout.readline().strip() != "ready":
                raise RuntimeError("the target did not start")
            time.sleep(2)
            for kind in ("cold", "warm"):
                log(f"case 19: run {i + 1}/{RUNS}, {kind}")
                got = one_recording(tools, t.pid, cache)
                if got is not None:
                    out[kind].append(got)
        finally:
            t.kill()
            t.wait()
            shutil.rmtree(cache, ignore_errors=True)
    if out["cold"] or out["warm"]:
        res.threads = out


def median(xs: List[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def cold_median(t: dict) -> Optional[float]:
    return median([r["not_ready_pct"] for r in t["cold"]]) if t.get("cold") else None


def render_threads(t: dict) -> List[str]:
    rows = []
    for kind in ("cold", "warm"):
        runs = t.get(kind) or []
        if not runs:
            continue
        pct = [r["not_ready_pct"] for r in runs]
        rows.append([kind, str(len(runs)), f"{median(pct):.1f}%", f"{min(pct):.1f}-{max(pct):.1f}%",
                     f"{median([r['recorded_s'] or 0 for r in runs]):.1f}",
                     f"{median([r['wall_s'] for r in runs]):.1f}"])
    out = [f"## The first recording of a {THREADS}-thread process (case 19)", "",
           f"{LABEL} ({t['python']}), {RECORD_S} s: cold (an empty cache directory) and then "
           "warm (the same directory again), in each run a fresh target whose threads sleep "
           "50-110 ms and wake. Not ready: the share of the native-stack time that ended in "
           "[native table not ready] (a table still being made when BPF walked the stack).", ""]
    out.append(markdown_table(["start", "runs", "not ready, median", "min-max", "recorded s (median)",
                               "pyoffcpu wall s (median)"], rows))
    return out + [""]
