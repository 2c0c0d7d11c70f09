"""Case 5: how exactly each profiler splits a workload's built-in wall time."""
from __future__ import annotations

import os
import re
from typing import List, Optional

from harness import (fmt_num, fmt_ratio_range, function_shares, markdown_table, max_error_pp, median,
                     parse_folded, verdict)

from common import Profiler, Results, Tools, log
from case_slowdown import profiled_run


# -- case 5: accuracy --------------------------------------------------------------------------------
def accuracy_case(tools: Tools, res: Results, runs: int, seconds: float,
                  profs: Optional[List[Profiler]] = None):
    """`profs`: the profilers compared (default pyoffcpu --mode wall and py-spy --idle)."""
    from workloads import FUNCTIONS, SPLIT
    if profs is None:
        profs = [p for p in (tools.profs.get("pyoffcpu --mode wall"),
                             tools.profs.get("py-spy record --idle -r 100")) if p]
    per = {p.label: {"shares": [], "errors": []} for p in profs}
    truths = []
    for i in range(runs):
        for prof in (profs if i % 2 == 0 else profs[::-1]):
            tag = f"c5-{i}-{re.sub(r'[^a-z0-9]+', '-', prof.label.lower()).strip('-')}"
            w = tools.worker("split")
            try:
                holder = {}

                def work():
                    dt, extra = w.run(seconds, timeout=seconds + 60)
                    holder["truth"] = extra
                    return dt, extra
                profiled_run(tools, prof, w.pid, work, tag)
                path = os.path.join(tools.outdir, tag)
                stacks = parse_folded(prof.read_folded(path))
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
