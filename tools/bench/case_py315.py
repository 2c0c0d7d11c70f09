"""Case 16 (issue 26): CPython 3.15 targets, and the sampler 3.15 ships
(`python3.15 -m profiling.sampling`, "Tachyon") beside pyoffcpu and py-spy.

The targets are Debian testing's python3.15 in the chroot tools/build-chroot.sh
builds (`make test` makes it), each started in a mount namespace of its own
with /proc mounted in the root (workloads.py reads /proc/self).  Tachyon runs
in the same root and the target's mount namespace (nsenter -m), where the
paths of the target's mappings resolve as it expects; it reads the target
with process_vm_readv from user space, at its default 1 kHz and at 100 Hz,
in its wall mode, every thread (-a).  pyoffcpu and py-spy attach from the
host as for any target.

Three of the 3.11 cases again, on 3.15: the busy thread beside 150 blocked
ones (case 2), the switch-heavy ping-pong (case 3), and the wall-share
accuracy (case 5), from the same code (case_slowdown, case_accuracy) with the
targets and the peers swapped.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
from typing import Dict, List

from common import HERE, Profiler, Results, Tools, Worker, log

CHROOT = os.path.realpath(os.environ.get("PYOFFCPU_CHROOT", "/var/cache/pyoffcpu/chroot/forky"))
PYTHON = "/usr/bin/python3.15"                      # inside the root
INNER = "/tmp/pyoffcpu-bench"                       # the root's copy of workloads.py, Tachyon's outputs
# sh in a new mount namespace mounts the root's /proc and execs chroot, which execs
# the interpreter: the process spawned is the interpreter
IN_ROOT = ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
           'mount -t proc proc "$0/proc" && exec chroot "$0" "$@"', CHROOT]
TACHYON = "python3.15 -m profiling.sampling"


class Worker315(Worker):
    """workloads.py under the chroot's python3.15, as Worker runs it on the host."""

    @staticmethod
    def command(python: str, kind: str) -> List[str]:
        return IN_ROOT + [PYTHON, INNER + "/workloads.py", *kind.split()]


def _collapsed_to_folded(text: str) -> str:
    """Tachyon's --collapsed lines (`tid:N;file:qualname:line;... COUNT`) as
    folded stacks of `qualname (file:line)` frames, weights in samples."""
    out = []
    for raw in text.splitlines():
        stack, sep, count = raw.strip().rpartition(" ")
        if not sep or not count.isdigit():
            continue
        frames = []
        for fr in stack.split(";"):
            m = re.fullmatch(r"(.*):([^:]*):(\d+)", fr)
            frames.append(f"{m.group(2)} ({m.group(1)}:{m.group(3)})" if m else fr)
        out.append(";".join(frames) + " " + count)
    return "\n".join(out) + "\n"


def _tachyon(rate: str) -> Profiler:
    label = f"{TACHYON} attach -a --mode wall" + (f" -r {rate}" if rate else " (1 kHz)")

    def inner(o: str) -> str:
        return f"{INNER}/{os.path.basename(o)}.collapsed"

    def argv(pid: int, o: str) -> List[str]:
        return (["nsenter", "-t", str(pid), "-m", "chroot", CHROOT, PYTHON, "-m", "profiling.sampling",
                 "attach", "-a", "--mode", "wall"] + (["-r", rate] if rate else [])
                + ["--collapsed", "-o", inner(o), str(pid)])

    def folded(o: str) -> str:
        with open(CHROOT + inner(o), errors="replace") as f:
            return _collapsed_to_folded(f.read())
    return Profiler(label, argv, "", False, merge=True, start_s=1.0, folded=folded)


def available() -> str:
    """'' when the chroot's python3.15 is there, else why not."""
    if not os.access(CHROOT + PYTHON, os.X_OK):
        return f"no {PYTHON} in {CHROOT} (tools/build-chroot.sh, which `make test` runs, makes it)"
    if not shutil.which("nsenter") or not shutil.which("unshare"):
        return "nsenter or unshare missing (util-linux)"
    return ""


def py315_case(tools: Tools, pairs: int, work_s: float, acc_runs: int, acc_s: float,
               switch_rate: float) -> Dict:
    """Cases 2, 3 and 5 on 3.15 with pyoffcpu, py-spy and Tachyon; the rows
    and the accuracy in their own Results."""
    from case_accuracy import accuracy_case
    from case_slowdown import calibrate, pingpong_kind, slowdown_case
    os.makedirs(CHROOT + INNER, exist_ok=True)
    shutil.copy(os.path.join(HERE, "workloads.py"), CHROOT + INNER + "/workloads.py")
    res = Results()
    # no BPF stats runs here: case 8 has them
    t = dataclasses.replace(tools, workers=Worker315, sysctl=None,
                            profs=dict(tools.profs, **{p.label: p for p in (_tachyon(""), _tachyon("100"))}))
    P = t.profs
    peers = [P[k] for k in ("pyoffcpu --mode wall", "py-spy record --idle -r 100") if k in P]
    tach = [P[f"{TACHYON} attach -a --mode wall (1 kHz)"], P[f"{TACHYON} attach -a --mode wall -r 100"]]
    try:
        n_cpu = calibrate(t, "cpu", 2000, work_s)
        log("case 16: 3.15, one busy thread + 150 blocked")
        slowdown_case(t, res, "2", "threads", n_cpu, peers + tach, pairs, {})
        pp = pingpong_kind(t, switch_rate)
        n_pp = calibrate(t, pp, 20000, work_s)
        log("case 16: 3.15, switch-heavy ping-pong")
        slowdown_case(t, res, "3", pp, n_pp, peers + tach, pairs, {})
        log("case 16: 3.15, accuracy")
        accuracy_case(t, res, acc_runs, acc_s, profs=peers + tach)
    finally:
        shutil.rmtree(CHROOT + INNER, ignore_errors=True)
    return {"overhead": res.overhead, "accuracy": res.accuracy, "errors": res.errors}


def render_py315(d: Dict) -> List[str]:
    from case_accuracy import render_accuracy
    from harness import fmt_num, fmt_ratio_range, markdown_table
    out = ["## CPython 3.15 beside its own sampler (case 16): Debian testing's python3.15 in the chroot\n"]
    rows = []
    for r in d["overhead"]:
        name = {"2": "2 busy + 150 blocked threads", "3": "3 switch-heavy ping-pong"}[r["case"]]
        if r.get("switch_rate"):
            name += f" ({r['switch_rate'] / 1000:.0f}k switches/s)"
        rows.append([name, r["profiler"], f"{r['n']}" + (f" ({r['failures']} failed)" if r["failures"] else ""),
                     fmt_num(r["a_median"]), fmt_num(r["b_median"]), fmt_num(r["ratio_median"]),
                     fmt_ratio_range(r["ratio_min"], r["ratio_max"]),
                     fmt_num(r["cpu_ratio_median"]), fmt_ratio_range(r["cpu_ratio_min"], r["cpu_ratio_max"]),
                     f"{100 * r['profiler_cpu']:.0f}%" if r.get("profiler_cpu") is not None else "n/a"])
    if rows:
        out.append(markdown_table(["case", "profiler", "pairs", "alone s (median)", "profiled s (median)",
                                   "ratio median", "ratio min–max", "CPU-time ratio median",
                                   "CPU-time ratio min–max", "profiler's own CPU (of a core)"],
                                  rows, "llrrrrrrrr"))
        out.append("")
        out.append("Pairs as in cases 1-4 (A alone, B profiled, AB/BA alternating), the target Debian's "
                   "python3.15. Tachyon reads the target's memory from another process at its rate "
                   "without stopping it; its CPU is its own process's, not the target's: the last "
                   "column is each profiler's process's CPU over the profiled run (median), pyoffcpu's "
                   "without its BPF, which runs in the target's context and is in the target's "
                   "CPU-time ratio.")
        out.append("")
    if d.get("accuracy"):
        acc = render_accuracy(d["accuracy"])
        acc[0] = acc[0].replace("## Accuracy (case 5)", "### Accuracy on 3.15 (case 16, as case 5)")
        out += acc
        out.append("Tachyon's weights are samples at its rate (1 kHz by default), in its wall mode.")
        out.append("")
    for e in d.get("errors", []):
        out.append(f"- error: {e}")
    return out
