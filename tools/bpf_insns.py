#!/usr/bin/env python3
"""Verifier cost of each of pyoffcpu's BPF programs ("processed N insns" of
the 1M limit, and the kernel's verification time), as the session builds them
(the same load-time constants).

    sudo .venv/bin/python tools/bpf_insns.py        # PYOFFCPU_NATIVE_UNWIND=0 for the FP build

The programs are loaded through pytool/pyoffcpu/collect/bpfload.py with the
verifier's statistics log (BPF_LOG_STATS): the raw tracepoint programs
(sched_switch, fork, exec), on_cpu_sample, and the tail-called finishing
programs unwind_perf / unwind_tp / memo_tp (bpf/unwind.c, bpf/memo.c).
"""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "pytool"))
LOG_STATS = 4


def main() -> int:
    if os.geteuid() != 0:
        sys.exit("bpf_insns: run as root")
    from pyoffcpu.collect import bpfload
    from pyoffcpu.kernel import bpfsys
    from pyoffcpu.collect import platform as plat
    from pyoffcpu.collect.recording import Options
    from pyoffcpu.collect.session import Session

    load = bpfload.load
    bpfload.load = lambda *a, **kw: load(*a, **dict(kw, log_level=LOG_STATS))
    try:
        s = Session(Options(pids=[os.getpid()]), plat.probe())
        s._compile()
    finally:
        bpfload.load = load
    for name, kind in (("on_cpu_sample", bpfsys.PERF_EVENT), ("unwind_perf", bpfsys.PERF_EVENT),
                       ("unwind_tp", bpfsys.RAW_TRACEPOINT), ("memo_tp", bpfsys.RAW_TRACEPOINT)):
        s.bpf.load_func(name.encode(), kind)
    for name, fn in s.bpf.funcs.items():
        insns = re.search(r"processed (\d+) insns", fn.log)
        usec = re.search(r"verification time (\d+) usec", fn.log)
        depth = re.search(r"stack depth ([\d+]+)", fn.log)
        if insns:
            c = int(insns.group(1))
            took = f"  {int(usec.group(1)) / 1000:7.1f} ms" if usec else ""
            stack = f"  stack {depth.group(1)}" if depth else ""
            print(f"  {name.decode():34s} {c:8d} insns  ({100 * c / 1e6:.0f}% of the 1M limit){took}{stack}")
    s.bpf.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
