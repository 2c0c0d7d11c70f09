"""Case 15 (issue 23): PyTorch as it is run.

tests/workloads/torch_train.py (a DataLoader with 2 worker processes feeding
an MLP, a logger thread) under pyenv 3.11 with torch from PyPI (the default
CUDA wheel, on the CPU: ~90 executable files, 3.6 GB), from the venv the
tests keep (tests/venvs.py).  From one run:

- `pyoffcpu -p PID --subprocesses -d 10` cold (no unwind tables or symbol
  indexes cached; the compiled BPF programs are) and warm (the same cache
  again): seconds from the spawn to the first sample in the kernel map and
  to the `recording` line; when the last table was ready (the stats file);
  each library's build; peak RSS of pyoffcpu and of it with its children
  (the sum of their RSS at once, sampled: the helpers count); from the end of the recording to the
  written profile;
- training steps/s under `--mode wall`, `--mode cpu` and `py-spy record
  --idle`, each window against the alone windows next to it (the workload
  prints its step count every second).
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import threading
import time
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

RECORD_S = 10.0
WINDOW_S = 10.0                 # a steps/s window
ROUNDS = int(os.environ.get("BENCH_TORCH_ROUNDS", 3))   # of alone, wall, alone, cpu, alone, py-spy, alone
LIMITS = {"first_s": 1.0, "tables_s": 15.0, "rss_mib": 250.0, "end_s": 1.0, "steps": 0.97}


def torch_python() -> str:
    import sys
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import venvs
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    bases = sorted(glob.glob(os.path.join(root, "versions", "3.11.*", "bin", "python3.11")))
    if not bases:
        raise RuntimeError("no pyenv 3.11")
    return venvs.cached_venv("torch", bases[-1], [venvs.TORCH])


class Steps:
    """The workload's `steps N T` lines, as (monotonic T, N)."""

    def __init__(self, proc: subprocess.Popen):
        self.points: List[Tuple[float, int]] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc):
        for line in proc.stdout:
            parts = line.split()
            if parts[:1] == ["ready"]:
                self.ready.set()
            elif parts[:1] == ["steps"] and len(parts) == 3:
                self.points.append((float(parts[2]), int(parts[1])))

    def rate(self, t0: float, t1: float) -> Optional[float]:
        inside = [p for p in self.points if t0 <= p[0] <= t1]
        if len(inside) < 2:
            return None
        (a, na), (b, nb) = inside[0], inside[-1]
        return (nb - na) / (b - a) if b > a else None


def _stats_lines(path: str) -> List[dict]:
    try:
        with open(path) as f:
            return [json.loads(ln) for ln in f if ln.strip()]
    except (OSError, ValueError):
        return []


def one_start(starts, tools, pid: int, cache: str, tag: str, log) -> dict:
    """One `-p PID --subprocesses -d RECORD_S` run, measured."""
    out = os.path.join(tools.outdir, f"torch-{tag}.folded")
    stats = os.path.join(tools.outdir, f"torch-{tag}.stats")
    env = dict(tools.env or os.environ, PYOFFCPU_CACHE_DIR=cache, PYOFFCPU_STATS_FILE=stats)
    r = starts.measure(tools.pyoffcpu + ["-p", str(pid), "--subprocesses", "--mode", "wall",
                                         "-d", f"{RECORD_S:g}", "-o", out], env=env, timeout=600)
    if r["rc"] != 0:
        raise RuntimeError(f"pyoffcpu exited {r['rc']}: " + " | ".join(r["stderr"].strip().splitlines()[-3:]))
    lines = _stats_lines(stats)
    ready = next((ln["t"] for ln in lines if ln.get("tables", {}).get("waiting") == 0), None)
    built = lines[-1].get("tables", {}).get("built", {}) if lines else {}
    m = re.search(r"native table not ready: ([\d.]+) s \(([\d.]+)%", r["stderr"])
    row = {"first_s": r["first"], "recording_s": r["recording"], "tables_s": ready,
           "built": built, "hwm_mib": r["hwm_mib"], "maxrss_mib": r["maxrss_mib"], "tree_mib": r["tree_mib"],
           "cpu_s": r["cpu_s"],
           "end_s": r["total_s"] - (r["recording"] or 0) - RECORD_S,
           "not_ready_s": float(m.group(1)) if m else 0.0, "not_ready_pct": float(m.group(2)) if m else 0.0,
           "out": out}
    log(f"case 15 {tag}: first sample {_f(row['first_s'])} s, recording {_f(row['recording_s'])} s, "
        f"tables ready {_f(ready)} s into the recording, peak RSS {row['hwm_mib']:.0f} MiB "
        f"(with its helpers at once {row['tree_mib']:.0f}), end to profile {row['end_s']:.2f} s, "
        f"not ready {row['not_ready_s']:.2f} s")
    return row


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def steps_windows(tools, pid: int, steps: Steps, log, cache: str) -> Dict[str, List[float]]:
    """Alone and profiled windows in turn; each profiled window's steps/s
    over the mean of the alone windows on either side of it.  pyoffcpu runs
    with the warm cache (`cache`): the steady cost, not the first start's."""
    env = dict(tools.env or os.environ, PYOFFCPU_CACHE_DIR=cache)
    profs = [("pyoffcpu --mode wall", tools.pyoffcpu + ["-p", str(pid), "--subprocesses", "--mode", "wall",
                                                         "-o", os.path.join(tools.outdir, "tw.folded")],
              r"^pyoffcpu: recording"),
             ("pyoffcpu --mode cpu", tools.pyoffcpu + ["-p", str(pid), "--subprocesses", "--mode", "cpu",
                                                        "-o", os.path.join(tools.outdir, "tc.folded")],
              r"^pyoffcpu: recording")]
    if tools.pyspy:
        profs.append(("py-spy record --idle", tools.pyspy + ["record", "-p", str(pid), "--subprocesses",
                                                             "--idle", "-r", "100", "-f", "raw", "-o",
                                                             os.path.join(tools.outdir, "ts.txt")],
                      r"Sampling process"))
    ratios: Dict[str, List[float]] = {label: [] for label, _, _ in profs}

    def alone() -> Optional[float]:
        t0 = time.monotonic()
        time.sleep(WINDOW_S)
        return steps.rate(t0, time.monotonic())
    before = alone()
    for _ in range(ROUNDS):
        for label, argv, ready in profs:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True,
                                 env=env if label.startswith("pyoffcpu") else None)
            seen = threading.Event()

            def watch(p=p, ready=ready, seen=seen):
                for line in p.stdout:
                    if re.search(ready, line):
                        seen.set()
            threading.Thread(target=watch, daemon=True).start()
            seen.wait(300)
            time.sleep(1.0)             # settled: the cold parts of its start are behind it
            t0 = time.monotonic()
            time.sleep(WINDOW_S)
            profiled = steps.rate(t0, time.monotonic())
            p.send_signal(2)
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            after = alone()
            if profiled and before and after:
                ratios[label].append(profiled / ((before + after) / 2))
                log(f"case 15 steps/s: {label} {profiled:.1f} against alone {before:.1f}/{after:.1f}: "
                    f"{ratios[label][-1]:.3f}")
            before = after
    return ratios


def torch_case(tools, starts, log) -> dict:
    python = torch_python()
    w = subprocess.Popen([python, os.path.join(ROOT, "tests", "workloads", "torch_train.py"), "100000", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        steps = Steps(w)
        if not steps.ready.wait(300):
            raise RuntimeError("the torch workload did not start")
        time.sleep(3.0)
        maps = set()
        for line in open(f"/proc/{w.pid}/maps"):
            parts = line.split()
            if len(parts) >= 6 and "x" in parts[1] and parts[5].startswith("/"):
                maps.add(parts[5])
        mapped_mb = sum(os.path.getsize(m) for m in maps if os.path.exists(m)) / 1e6
        # the compiled programs cached, nothing of torch's libraries
        prime = os.path.join(tools.outdir, "torch-prime")
        one_start(starts, tools, w.pid, prime, "prime", log)
        cache = os.path.join(tools.outdir, "torch-cache")
        os.makedirs(cache, mode=0o700, exist_ok=True)
        shutil.copytree(os.path.join(prime, "bpf"), os.path.join(cache, "bpf"))
        cold = one_start(starts, tools, w.pid, cache, "cold", log)
        warm = one_start(starts, tools, w.pid, cache, "warm", log)
        ratios = steps_windows(tools, w.pid, steps, log, cache)
        from shadow import record_both
        shadow = record_both(tools, "15", ["-p", str(w.pid), "--subprocesses", "--mode", "wall"], 10.0,
                             "torch-shadow", env=dict(tools.env or os.environ, PYOFFCPU_CACHE_DIR=cache))
        return {"files": len(maps), "mapped_mb": mapped_mb, "cold": cold, "warm": warm, "steps": ratios,
                "shadow": shadow}
    finally:
        w.kill()
        w.wait()


def render_torch(d: dict, markdown_table, median) -> List[str]:
    out = [f"## PyTorch as it is run (case 15): torch_train.py, {d['files']} executable files, "
           f"{d['mapped_mb'] / 1000:.1f} GB mapped\n"]
    rows = []
    for tag in ("cold", "warm"):
        r = d[tag]
        rows.append([tag, _f(r["first_s"]), _f(r["recording_s"]), _f(r["tables_s"]),
                     f"{r['hwm_mib']:.0f}", f"{r['tree_mib']:.0f}", f"{r['end_s']:.2f}",
                     f"{r['not_ready_s']:.2f} s ({r['not_ready_pct']:.1f}%)"])
    out.append(markdown_table(["start", "first sample s", "`recording` s", "tables ready s (into the recording)",
                               "peak RSS MiB", "with its helpers at once MiB", "end to profile s", "native table not ready"],
                              rows, "lrrrrrrr"))
    out.append("")
    built = sorted(d["cold"]["built"].items(), key=lambda kv: -kv[1])
    out.append("Table builds of the cold start (the ten longest; helpers run up to "
               f"{min(4, os.cpu_count() or 1)} at once within 160 MB, tables before symbol indexes): " +
               ", ".join(f"{os.path.basename(n)} {s:.2f} s" for n, s in built[:10]) + ".")
    out.append("")
    rows = [[label, ", ".join(f"{x:.3f}" for x in rs), f"{median(rs):.3f}" if rs else "-"]
            for label, rs in d["steps"].items()]
    out.append(markdown_table(["profiler", "steps/s against the alone windows beside it", "median"], rows, "lrr"))
    out.append("")
    cold, warm = d["cold"], d["warm"]
    checks = [("first sample, cold (s)", cold["first_s"], LIMITS["first_s"], True),
              ("first sample, warm (s)", warm["first_s"], LIMITS["first_s"], True),
              ("tables ready, cold (s)", cold["tables_s"], LIMITS["tables_s"], True),
              ("peak RSS with its helpers, cold (MiB)", cold["tree_mib"], LIMITS["rss_mib"], True),
              ("peak RSS with its helpers, warm (MiB)", warm["tree_mib"], LIMITS["rss_mib"], True),
              ("end of recording to profile, warm (s)", warm["end_s"], LIMITS["end_s"], True),
              ("steps/s under --mode wall", median(d["steps"].get("pyoffcpu --mode wall") or [0]),
               LIMITS["steps"], False),
              ("steps/s under --mode cpu", median(d["steps"].get("pyoffcpu --mode cpu") or [0]),
               LIMITS["steps"], False)]
    rows = []
    for label, v, limit, upper in checks:
        ok = v is not None and (v <= limit if upper else v >= limit)
        rows.append([label, f"{'<=' if upper else '>='} {limit:g}", _f(v), "PASS" if ok else "MISS"])
    out.append(markdown_table(["case 15", "limit", "measured", ""], rows, "lrrl"))
    out.append("")
    return out
