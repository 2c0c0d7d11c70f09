"""Case 14: native stacks through code without CFI (numpy's OpenBLAS)."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from typing import List

from harness import markdown_table, median, prog_delta

from common import Proc, ROOT, Results, SETTLE_S, Tools, bpfstats, log


# -- case 14: native stacks through code without CFI (issue 15) ------------------------------------
UNWIND_NUMPY = "numpy==2.4.6"           # the test's pin (tests/test_numpy_bpf.py)
UNWIND_RUNS = 3
UNWIND_SAMPLE_S = 5.0
UNWIND_HZ = 499
TABLE_SNIPPET = r"""
import json, sys, time
from pyoffcpu.native.unwind import table as T
c = T.TableCache(sys.argv[2])
t0 = time.perf_counter()
t = c.get(sys.argv[1], None)
print(json.dumps({"s": time.perf_counter() - t0, "built": c.built, "loaded": c.loaded,
                  "rows": t.nrows if t else 0}))
"""


def unwind_case(tools: Tools, res: Results, runs: int = UNWIND_RUNS):
    """numpy's OpenBLAS in a venv of the bench's: the unwind table of its
    largest library built cold (an empty cache) and read warm, with and
    without prologue analysis; then the BPF cost per on-CPU sample of the
    numpy workload (tests/workloads/numpy_mix.py, OpenBLAS's Haswell kernels),
    with and without it, beside what it buys (the matmul thread's stacks
    with >= 3 native frames under matmul_loop)."""
    venv = os.path.join(tools.outdir, "numpy-venv")
    try:
        subprocess.run([tools.python, "-m", "venv", venv], check=True)
        python = os.path.join(venv, "bin", "python")
        subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", UNWIND_NUMPY],
                       check=True)
        libs = glob.glob(os.path.join(venv, "lib", "python*", "site-packages", "numpy*", "**", "*.so*"),
                         recursive=True)
        lib = max(libs, key=os.path.getsize)
        out = {"library": os.path.basename(lib), "mib": os.path.getsize(lib) / 2 ** 20, "tables": {},
               "samples": {}}
        py = [sys.executable]                   # imports pyoffcpu (tools.env: --tree)
        for prologue in ("1", "0"):
            env = dict(tools.env or os.environ, PYOFFCPU_PROLOGUE=prologue)
            cold, warm = [], []
            for i in range(runs):
                cache = os.path.join(tools.outdir, f"tables-{prologue}-{i}")
                for times in (cold, warm):          # empty cache, then the same cache again
                    r = subprocess.run(py + ["-c", TABLE_SNIPPET, lib, cache], env=env, check=True,
                                       capture_output=True, text=True, timeout=600)
                    got = json.loads(r.stdout)
                    times.append(got["s"])
            out["tables"][prologue] = {"cold_s": median(cold), "warm_s": median(warm), "rows": got["rows"],
                                       "cold_range": (min(cold), max(cold))}
            log(f"case 14 table of {out['library']} (prologue analysis {'on' if prologue == '1' else 'off'}): "
                f"cold {median(cold):.2f} s, warm {median(warm):.3f} s, {got['rows']} rows")
        for prologue in ("1", "0"):
            out["samples"][prologue] = unwind_sample_cost(tools, python, prologue)
        res.unwind = out
    except Exception as e:                                      # noqa: BLE001
        res.errors.append(f"case 14: {e}")
        log(f"case 14: FAILED: {e}")


def unwind_sample_cost(tools: Tools, python: str, prologue: str) -> dict:
    """BPF run time per on-CPU sample (on_cpu_sample and its unwind_perf tail
    calls) over UNWIND_SAMPLE_S of the numpy workload, and the matmul share."""
    w = subprocess.Popen([python, os.path.join(ROOT, "tests", "workloads", "numpy_mix.py"), "600"],
                         stdout=subprocess.PIPE, text=True, env=dict(os.environ, OPENBLAS_CORETYPE="Haswell"))
    out = os.path.join(tools.outdir, f"numpy-{prologue}.folded")
    env = dict(tools.env or os.environ, PYOFFCPU_PROLOGUE=prologue,
               PYOFFCPU_CACHE_DIR=os.path.join(tools.outdir, f"session-cache-{prologue}"))
    p = None
    stats = None
    try:
        assert w.stdout.readline().strip() == "ready"
        p = Proc(tools.pyoffcpu + ["-p", str(w.pid), "--mode", "cpu", "-F", str(UNWIND_HZ), "-o", out], env=env)
        p.wait_err(r"^pyoffcpu: recording", 300)
        time.sleep(SETTLE_S)
        tools.sysctl.on()
        try:
            stats = bpfstats.ProgStats(p.pid)
            before = stats.read()
            time.sleep(UNWIND_SAMPLE_S)
            delta = prog_delta(before, stats.read())
        finally:
            tools.sysctl.off()
        p.interrupt()
        if p.wait(180) != 0:
            raise RuntimeError(f"pyoffcpu exited: {p.stderr_tail()}")
        samples = sum(c for k, (c, _) in delta.items() if k.startswith("on_cpu_sample"))
        ns = sum(n for k, (_, n) in delta.items() if k.startswith(("on_cpu_sample", "unwind_perf")))
        kept = total = 0
        with open(out) as f:
            for line in f:
                stack, _, v = line.rstrip().rpartition(" ")
                frames = stack.split(";")
                at = next((i for i, x in enumerate(frames) if x.startswith("matmul_loop (")), None)
                if at is None:
                    continue
                total += int(v)
                kept += int(v) if sum(1 for x in frames[at + 1:] if " (" not in x) >= 3 else 0
        row = {"samples": samples, "ns_per_sample": ns / max(1, samples), "matmul_share": kept / max(1, total)}
        log(f"case 14 per sample (prologue analysis {'on' if prologue == '1' else 'off'}): "
            f"{row['ns_per_sample']:.0f} ns over {samples} samples; matmul chains {row['matmul_share']:.3f}")
        return row
    finally:
        if stats:
            stats.close()
        if p:
            p.kill()
        w.kill()
        w.wait()


def render_unwind(d: dict) -> List[str]:
    out = [f"## Code without CFI (case 14): numpy's OpenBLAS ({d['library']}, {d['mib']:.1f} MiB)\n"]
    rows = []
    for prologue, t in d["tables"].items():
        rows.append(["on" if prologue == "1" else "off (PYOFFCPU_PROLOGUE=0)", f"{t['cold_s']:.2f}",
                     f"{t['cold_range'][0]:.2f}–{t['cold_range'][1]:.2f}", f"{t['warm_s']:.3f}", str(t["rows"])])
    out.append(markdown_table(["prologue analysis", "cold build s (median)", "min–max s", "warm (cached) s",
                               "rows"], rows, "lrrrr"))
    out.append("")
    rows = []
    for prologue, r in d["samples"].items():
        rows.append(["on" if prologue == "1" else "off (PYOFFCPU_PROLOGUE=0)", f"{r['ns_per_sample']:.0f}",
                     str(r["samples"]), f"{100 * r['matmul_share']:.1f}%"])
    out.append(markdown_table(["prologue analysis", "BPF ns per on-CPU sample", "samples",
                               "matmul stacks with >= 3 native frames"], rows, "lrrr"))
    out.append("")
    out.append(f"Cold: a process builds the table into an empty cache (symbols, .eh_frame, and the "
               f"control-flow analysis of every function no FDE covers); warm: a new process reads it "
               f"from that cache. Per sample: on_cpu_sample and its unwind_perf tail calls, "
               f"{UNWIND_SAMPLE_S:g} s of the numpy workload at {UNWIND_HZ} Hz with OpenBLAS's Haswell "
               f"kernels (kernel.bpf_stats_enabled).")
    out.append("")
    return out
