"""Sampled against exact, beside the cost (issue 37): one recording of a
case's target made both ways at once (PYOFFCPU_OFFCPU=shadow: every
switch-out takes its stack as --off-cpu exact does, and the sampled path
runs beside it; PYOFFCPU_SAMPLED_VIEW names the file of the sampled view),
and how far the sampled view's off-CPU stack shares are from the exact
view's: the largest stack's, and the largest difference among the ten
largest.  The error to expect is in docs/offcpu-sampling.md."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Dict, List, Optional

from harness import fmt_num, markdown_table

from common import Tools, log


def off_cpu_shares(text: str) -> Dict[str, float]:
    """Folded stack (its frames, the marker of the wait included) -> its
    share of the profile's off-CPU time."""
    weights: Dict[str, int] = {}
    for line in text.splitlines():
        stack, _, w = line.rpartition(" ")
        if not stack or "[off-cpu" not in stack:
            continue
        try:
            weights[stack] = weights.get(stack, 0) + int(w)
        except ValueError:
            continue
    total = sum(weights.values()) or 1
    return {k: v / total for k, v in weights.items()}


def share_error(exact_text: str, sampled_text: str) -> Optional[dict]:
    """The largest off-CPU stack of the exact view, its share in both views
    and their difference (pp); the largest difference over its ten largest."""
    ex, sa = off_cpu_shares(exact_text), off_cpu_shares(sampled_text)
    if not ex:
        return None
    top = sorted(ex, key=lambda k: -ex[k])[:10]
    errs = [abs(sa.get(k, 0.0) - ex[k]) * 100 for k in top]
    return {"stack": top[0].split(";")[-2] if ";" in top[0] else top[0], "exact": 100 * ex[top[0]],
            "sampled": 100 * sa.get(top[0], 0.0), "error_pp": errs[0], "max_error_pp": max(errs),
            "stacks": len(ex)}


def record_both(tools: Tools, case: str, args: List[str], seconds: float, tag: str,
                env: Optional[Dict[str, str]] = None) -> Optional[dict]:
    """pyoffcpu `args` (its target) for `seconds`, both ways at once; the
    share errors, None (and a log line) when it fails."""
    exact = os.path.join(tools.outdir, tag + "-exact.folded")
    sampled = os.path.join(tools.outdir, tag + "-sampled.folded")
    e = dict(env or tools.env or os.environ, PYOFFCPU_OFFCPU="shadow", PYOFFCPU_SAMPLED_VIEW=sampled)
    p = subprocess.Popen(tools.pyoffcpu + args + ["-d", f"{seconds:g}", "-o", exact], env=e,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = p.communicate(timeout=seconds + 300)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGKILL)
        p.wait()
        log(f"case {case} sampled against exact: pyoffcpu did not finish")
        return None
    try:
        with open(exact) as f1, open(sampled) as f2:
            got = share_error(f1.read(), f2.read())
    except OSError as ex:
        log(f"case {case} sampled against exact: {ex}; {err[-300:]}")
        return None
    finally:
        for path in (exact, sampled):
            if os.path.exists(path):
                os.unlink(path)
    if got is not None:
        got.update(case=case, seconds=seconds)
        log(f"case {case} sampled against exact: largest off-CPU stack {got['exact']:.2f}% exact, "
            f"{got['sampled']:.2f}% sampled ({got['error_pp']:.2f} pp; largest of the top ten "
            f"{got['max_error_pp']:.2f} pp)")
    return got


def while_running(start, stop, record):
    """record() while the workload start() started runs; stop() after."""
    start()
    try:
        time.sleep(1.0)
        return record()
    finally:
        stop()


def render_shadow(rows: List[dict]) -> List[str]:
    out = ["## Sampled against exact (issue 37): one recording both ways\n",
           "Each row: one recording of the case's target with PYOFFCPU_OFFCPU=shadow (every switch-out "
           "takes its stack, as --off-cpu exact does, and the default sampled path runs beside it, so "
           "both views hold the same waits): the off-CPU share of the exact view's largest stack in each "
           "view, their difference, and the largest difference among the exact view's ten largest "
           "stacks. The error to expect: docs/offcpu-sampling.md.\n"]
    out.append(markdown_table(
        ["case", "recording s", "largest off-CPU stack (leaf frame)", "exact %", "sampled %", "error pp",
         "largest error, top 10 (pp)", "off-CPU stacks"],
        [[r["case"], f"{r['seconds']:g}", r["stack"][:60], fmt_num(r["exact"], 2), fmt_num(r["sampled"], 2),
          fmt_num(r["error_pp"], 2), fmt_num(r["max_error_pp"], 2), r["stacks"]] for r in rows],
        "lrlrrrrr"))
    out.append("")
    return out
