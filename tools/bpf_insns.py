#!/usr/bin/env python3
"""Verifier cost of each of pyoffcpu's BPF programs ("processed N insns" of
the 1M limit), as the session compiles them (same -D flags).

    sudo .venv/bin/python tools/bpf_insns.py        # PYOFFCPU_NATIVE_UNWIND=0 for the FP build

bcc prints the verifier's statistics on stderr with debug=2; they are read
back from a pipe.  Programs: the sched_switch tracepoint program (loaded by
BPF() itself), on_cpu_sample, and the tail-called finishing programs
unwind_perf / unwind_tp (bpf/unwind.h).
"""
from __future__ import annotations

import os
import re
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "pytool"))


def main() -> int:
    if os.geteuid() != 0:
        sys.exit("bpf_insns: run as root")
    import bcc
    from pyoffcpu import platform as plat
    from pyoffcpu.session import Options, Session

    r, w = os.pipe()
    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(r, 65536), b"")))
    reader.start()
    saved = os.dup(2)
    os.dup2(w, 2)
    os.close(w)
    order = []
    try:
        init = bcc.BPF.__init__

        def debug_init(self, *a, **kw):
            kw["debug"] = 2
            init(self, *a, **kw)
        bcc.BPF.__init__ = debug_init
        s = Session(Options(pids=[os.getpid()]), plat.probe())
        s._compile()
        order.append("tracepoint__sched__sched_switch")
        for name, kind in (("on_cpu_sample", bcc.BPF.PERF_EVENT), ("unwind_perf", bcc.BPF.PERF_EVENT),
                           ("unwind_tp", bcc.BPF.TRACEPOINT)):
            s.bpf.load_func(name.encode(), kind)
            order.append(name)
        s.bpf.cleanup()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        reader.join()
    text = b"".join(chunks).decode(errors="replace")
    counts = [int(m.group(1)) for m in re.finditer(r"processed (\d+) insns", text)]
    # bcc prints each program's statistics once or twice: keep one per program
    uniq = []
    for c in counts:
        if not uniq or uniq[-1] != c:
            uniq.append(c)
    for name, c in zip(order, uniq):
        print(f"  {name:34s} {c:8d} insns  ({100 * c / 1e6:.0f}% of the 1M limit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
