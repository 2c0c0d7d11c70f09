"""Case 17 (issue 27): an asyncio loop under pyoffcpu --async, beside the
sampler CPython 3.15 ships in its async-aware mode
(`python3.15 -m profiling.sampling attach --async-aware --async-mode all`),
which reads every task's await chain from user space as pyoffcpu's
snapshots do.

The target is workloads.py's `async` kind on Debian's python3.15 in the
chroot (as case 16 runs it): one task doing the work, one unit per step,
beside a ticker, a producer and consumer on a Queue, and 200 tasks waiting on
an event.  A/B pairs as in cases 1-4: the time of a run alone and profiled,
for pyoffcpu --mode wall (no --async, for reference), pyoffcpu --async (100
snapshots/s), and Tachyon's async-aware mode at its default 1 kHz and at
100 Hz.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Dict, List

import case_py315
from case_py315 import CHROOT, INNER, PYTHON, TACHYON, Worker315
from common import HERE, Profiler, Results, Tools

PYOFFCPU_ASYNC = "pyoffcpu --mode wall --async"


def _tachyon_async(rate: str) -> Profiler:
    label = f"{TACHYON} attach --async-aware --async-mode all" + (f" -r {rate}" if rate else " (1 kHz)")

    def argv(pid: int, o: str) -> List[str]:
        inner = f"{INNER}/{os.path.basename(o)}.collapsed"
        return (["nsenter", "-t", str(pid), "-m", "chroot", CHROOT, PYTHON, "-m", "profiling.sampling",
                 "attach", "--async-aware", "--async-mode", "all"] + (["-r", rate] if rate else [])
                + ["--collapsed", "-o", inner, str(pid)])
    return Profiler(label, argv, "", False, merge=True, start_s=1.0)


def _pyoffcpu_async(tools: Tools) -> Profiler:
    return Profiler(PYOFFCPU_ASYNC,
                    lambda pid, o: tools.pyoffcpu + ["-p", str(pid), "--mode", "wall", "-F", "99",
                                                     "--async", "-o", o + ".folded"],
                    r"^pyoffcpu: recording", True, stats=True)


def available() -> str:
    """'' when the chroot's python3.15 is there (case 16's), else why not."""
    return case_py315.available()


def async_case(tools: Tools, pairs: int, work_s: float) -> Dict:
    from case_slowdown import calibrate, slowdown_case
    os.makedirs(CHROOT + INNER, exist_ok=True)
    shutil.copy(os.path.join(HERE, "workloads.py"), CHROOT + INNER + "/workloads.py")
    res = Results()
    extra = [_pyoffcpu_async(tools), _tachyon_async(""), _tachyon_async("100")]
    t = dataclasses.replace(tools, workers=Worker315, sysctl=None,
                            profs=dict(tools.profs, **{p.label: p for p in extra}))
    profs = [p for p in [t.profs.get("pyoffcpu --mode wall")] + extra if p is not None]
    try:
        n = calibrate(t, "async", 2000, work_s)
        slowdown_case(t, res, "17", "async", n, profs, pairs, {})
    finally:
        shutil.rmtree(CHROOT + INNER, ignore_errors=True)
    return {"overhead": res.overhead, "errors": res.errors}


def render_async(d: Dict) -> List[str]:
    from harness import fmt_num, fmt_ratio_range, markdown_table
    out = ["## asyncio (case 17): --async beside CPython 3.15's sampler in its async-aware mode\n"]
    rows = []
    for r in d["overhead"]:
        rows.append([r["profiler"], f"{r['n']}" + (f" ({r['failures']} failed)" if r["failures"] else ""),
                     fmt_num(r["a_median"]), fmt_num(r["b_median"]), fmt_num(r["ratio_median"]),
                     fmt_ratio_range(r["ratio_min"], r["ratio_max"]),
                     fmt_num(r["cpu_ratio_median"]), fmt_ratio_range(r["cpu_ratio_min"], r["cpu_ratio_max"]),
                     f"{100 * r['profiler_cpu']:.0f}%" if r.get("profiler_cpu") is not None else "n/a"])
    if rows:
        out.append(markdown_table(["profiler", "pairs", "alone s (median)", "profiled s (median)",
                                   "ratio median", "ratio min–max", "CPU-time ratio median",
                                   "CPU-time ratio min–max", "profiler's own CPU (of a core)"],
                                  rows, "lrrrrrrrr"))
        out.append("")
        out.append("workloads.py `async` on Debian's python3.15 (chroot): a worker task doing the "
                   "work one unit per step beside a ticker, a queue and 200 waiting tasks. Pairs as "
                   "in cases 1-4. Tachyon reads every task's await chain from its own process at its "
                   "rate (--async-mode all); pyoffcpu --async takes the running task from BPF and "
                   "snapshots the task graph 100 times a second from its own process. The last "
                   "column: each profiler's process's CPU over the profiled run (median), pyoffcpu's "
                   "without its BPF, which is in the target's CPU-time ratio.")
        out.append("")
    for e in d.get("errors", []):
        out.append(f"- error: {e}")
    return out
