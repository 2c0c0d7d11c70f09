"""Case 13: pyoffcpu dump's latency."""
from __future__ import annotations

import re
import statistics
import subprocess
import time
from typing import List

from harness import markdown_table, verdict

from common import Results, Tools, log


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
