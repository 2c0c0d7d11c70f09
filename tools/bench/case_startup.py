"""Case 6: start-up (warm and cold) and teardown."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

from harness import fmt_num, fmt_range, markdown_table, spread, verdict

from common import ROOT, Proc, Results, Tools, Worker, log, starts


# -- case 6: startup and teardown ---------------------------------------------------------------------
def cache_env(tools: Tools) -> Dict[str, str]:
    """pyoffcpu's environment with the bench's own program cache
    (PYOFFCPU_CACHE_DIR in the bench's temporary folder): cold starts empty
    it, never the user's."""
    return dict(tools.env if tools.env is not None else os.environ, PYOFFCPU_CACHE_DIR=tools.cache_dir)


def _start_row(r: dict) -> dict:
    return {k: r[k] for k in ("first", "recording", "hwm_mib", "maxrss_mib", "cpu_s", "total_s")}


def startup_case(tools: Tools, res: Results, runs: int, short_s: float, long_s: float):
    """Warm and cold starts of `pyoffcpu -p PID --mode wall -d 1` (tools/startup.py
    measures each: first sample, `recording` line, peak RSS with and without
    children), py-spy's attach, where a warm start goes, and teardown."""
    out = {"warm": [], "cold": [], "cold_bcc": [], "pyspy": [], "teardown": [], "runs": runs}
    env = cache_env(tools)
    env_bcc = dict(env, PYOFFCPU_BPF_DIR=stale_bpf_copy(tools))
    folded = os.path.join(tools.outdir, "c6-start.folded")
    w = Worker(tools.python, "split")
    try:
        w.start_run(3600)
        time.sleep(0.3)
        try:                                            # untimed: fills the bench's cache
            r = starts.start_run(tools.pyoffcpu, w.pid, folded, tools.cache_dir, False, env=env)
            # the programs come from the package: the cache holds the BTF offsets
            # (and, for a tree whose bpf/ differs from its bpfobj/, bcc's compile)
            entries = os.listdir(os.path.join(tools.cache_dir, "bpf"))
            log(f"case 6: cache filled ({', '.join(sorted(entries))} in {tools.cache_dir}/bpf) by a "
                f"{r['total_s']:.1f} s run")
            if not entries:
                res.errors.append("case 6: the fill run left nothing in the cache: the warm starts are cold")
        except Exception as e:                          # noqa: BLE001
            res.errors.append(f"case 6 cache fill: {e}")
            log(f"case 6 cache fill: FAILED: {e}")
        for i in range(runs):
            # warm and cold alternate (a cold run fills the cache again for the next warm one);
            # cold_bcc: cold, with the package's programs not for the source (bcc compiles)
            for kind in (("warm", "cold", "cold_bcc") if i % 2 == 0 else ("cold_bcc", "cold", "warm")):
                cold = kind != "warm"
                try:
                    r = starts.start_run(tools.pyoffcpu, w.pid, folded, tools.cache_dir, cold,
                                         env=env_bcc if kind == "cold_bcc" else env)
                    out[kind].append(_start_row(r))
                    log(f"case 6 {kind} start {i + 1}/{runs}: first sample {fmt_num(r['first'], 3)} s, "
                        f"recording line {fmt_num(r['recording'], 3)} s, VmHWM {r['hwm_mib']:.0f} MiB, "
                        f"with children {r['maxrss_mib']:.0f} MiB, CPU {r['cpu_s']:.2f} s")
                    for line in starts.notices(r["stderr"]):
                        log(f"  {line}")
                except Exception as e:                  # noqa: BLE001
                    res.errors.append(f"case 6 {kind} start {i + 1}: {e}")
                    log(f"case 6 {kind} start {i + 1}: FAILED: {e}")
        if tools.pyspy:
            for i in range(runs):
                p = None
                try:
                    t0 = time.monotonic()
                    p = Proc(tools.pyspy + ["record", "-p", str(w.pid), "-r", "100", "--idle", "-f", "raw",
                                            "-o", os.path.join(tools.outdir, f"c6-pyspy-{i}.txt")], merge=True)
                    t = p.wait_err(r"py-spy> Sampling process", 60)
                    out["pyspy"].append({"recording": t - t0})
                    log(f"case 6 py-spy start {i + 1}/{runs}: `Sampling process` after {t - t0:.3f} s")
                    p.interrupt()
                    p.wait(60)
                except Exception as e:                  # noqa: BLE001
                    res.errors.append(f"case 6 py-spy startup run {i + 1}: {e}")
                    log(f"case 6 py-spy start {i + 1}: FAILED: {e}")
                finally:
                    if p:
                        p.kill()
    finally:
        w.close()
    out["breakdown"] = startup_breakdown(tools, env)
    plan = [("pyoffcpu", short_s), ("pyoffcpu", short_s), ("pyoffcpu", long_s)]
    if tools.pyspy:
        plan.insert(2, ("py-spy", short_s))
    for i, (who, secs) in enumerate(plan):
        w = Worker(tools.python, "split")
        p = None
        try:
            w.start_run(secs + 3600)
            svg = os.path.join(tools.outdir, f"c6-teardown-{i}.svg")
            if who == "pyoffcpu":
                p = Proc(tools.pyoffcpu + ["-p", str(w.pid), "--mode", "wall", "-o", svg], env=env)
                ready = p.wait_err(r"^pyoffcpu: recording", 120)
            else:
                p = Proc(tools.pyspy + ["record", "-p", str(w.pid), "-r", "100", "--idle", "-o", svg], merge=True)
                ready = p.wait_err(r"py-spy> Sampling process", 60)
            log(f"case 6 teardown: {who} recording {secs:g} s")
            time.sleep(max(0.0, ready + secs - time.monotonic()))
            t_sig = time.monotonic()
            p.interrupt()
            t_file = None
            while p.p.poll() is None and time.monotonic() - t_sig < 600:
                if t_file is None and os.path.exists(svg):
                    t_file = time.monotonic()
                time.sleep(0.01)
            t_exit = time.monotonic()
            if t_file is None and os.path.exists(svg):
                t_file = t_exit
            if p.p.poll() != 0 or t_file is None:
                raise RuntimeError(f"{who} exited {p.p.poll()} without the SVG: {p.stderr_tail()}")
            out["teardown"].append({"who": who, "seconds": secs, "file": t_file - t_sig,
                                    "exit": t_exit - t_sig, "bytes": os.path.getsize(svg)})
            log(f"case 6 teardown {who} {secs:g} s: file after {t_file - t_sig:.2f}s, exit {t_exit - t_sig:.2f}s")
        except Exception as e:                                  # noqa: BLE001
            res.errors.append(f"case 6 teardown {who} {secs:g}s: {e}")
            log(f"case 6 teardown {who} {secs:g}s: FAILED: {e}")
        finally:
            if p:
                p.kill()
            w.close()
    res.startup = out


BREAKDOWN = [   # (file suffix, function, what it is); a step that did not run is left out
    ("pyoffcpu/collect/session.py", "<module>", "import pyoffcpu.collect.session (and all it imports)"),
    ("pyoffcpu/collect/platform.py", "probe", "platform.probe: privileges, BTF offsets of task_struct, tracefs"),
    ("pyoffcpu/collect/session.py", "_compile", "Session._compile: bpfload.load and its cflags"),
    ("pyoffcpu/collect/bpfload.py", "load", "bpfload.load: cache lookup, maps, verifier, raw tracepoints attached"),
    ("pyoffcpu/collect/progcache.py", "cache_key", "progcache.cache_key: sha256 of the text, headers, BTF, bcc"),
    ("pyoffcpu/collect/progcache.py", "read_entry", "progcache.read_entry: read and check the cache entry"),
    ("pyoffcpu/collect/progcache.py", "compile_in_child", "progcache.compile_in_child: bcc/clang (a cache miss only)"),
    ("pyoffcpu/collect/bpfload.py", "load_funcs_parallel", "bpfload.load_funcs_parallel: the kernel verifier, "
                                                   "all programs"),
    ("pyoffcpu/collect/session.py", "_attach", "Session._attach: perf events, perf buffer, the unwinder's tail-call slots"),
    ("pyoffcpu/collect/bpfload.py", "attach_perf_event", "Program.attach_perf_event: cpu-clock on every CPU"),
    ("pyoffcpu/collect/session.py", "_add_target", "Session._add_target: find the target's CPython, register it"),
]


def startup_breakdown(tools: Tools, env: Optional[Dict[str, str]] = None) -> List[Tuple[str, float]]:
    """One warm `pyoffcpu -p` start (env: the bench's filled cache) under
    cProfile: the cumulative seconds of the known big steps (C work, as the
    verifier, is not slowed down by the profiler; Python work is, a little)."""
    import pstats
    w = Worker(tools.python, "split")
    path = os.path.join(tools.outdir, "c6-startup.pstats")
    try:
        w.start_run(3600)
        time.sleep(0.3)
        r = subprocess.run([sys.executable, "-m", "cProfile", "-o", path, "-m", "pyoffcpu", "-p", str(w.pid),
                            "-d", "0.5", "-o", os.path.join(tools.outdir, "c6-breakdown.folded")],
                           capture_output=True, text=True, timeout=180, env=env if env is not None else tools.env)
        if r.returncode != 0 or not os.path.exists(path):
            log(f"case 6 startup breakdown: pyoffcpu exited {r.returncode}")
            return []
        st = pstats.Stats(path).stats
        out = []
        for suffix, fn, what in BREAKDOWN:
            cts = [v[3] for (f, _, name), v in st.items() if f.endswith(suffix) and name == fn]
            if cts:
                out.append((what, max(cts)))
        log("case 6 where a warm start goes: " + ", ".join(f"{what.split(':')[0]} {t:.2f}s" for what, t in out))
        return out
    except Exception as e:                                      # noqa: BLE001
        log(f"case 6 startup breakdown: {e}")
        return []
    finally:
        w.close()


STARTUP_TARGETS = {"warm": 0.5, "cold": 3.0}    # issue 10: start to first sample, s
COLD_RECORDING_S = 0.5                          # issue 45: cold start without bcc to `recording`


def stale_bpf_copy(tools: Tools) -> str:
    """A copy of the measured tree's bpf/ with a comment added: no shipped
    program is for its source, so a start from it compiles with bcc (the
    fallback; the cold start before issue 45)."""
    import shutil
    pythonpath = (tools.env or {}).get("PYTHONPATH")          # --tree / --rev: <tree>/pytool
    src = os.path.join(os.path.dirname(pythonpath) if pythonpath else ROOT, "bpf")
    d = os.path.join(tools.outdir, "bpf-stale")
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(src, d)
    with open(os.path.join(d, "pyoffcpu.h"), "a") as f:
        f.write("\n/* the bench's copy: compiled with bcc */\n")
    return d
STARTUP_RSS_MIB = 120.0                         # issue 10: peak RSS with children, warm and cold
TEARDOWN_S = 0.2                                # issue 10: SIGINT to file written


def _spread_row(what: str, measured: str, values, digits: int, target: Optional[float] = None,
                unit: str = "") -> list:
    s = spread(values)
    return [what, measured, s["n"], fmt_num(s["median"], digits), fmt_range(s["min"], s["max"], digits),
            f"<= {target:g}{unit}" if target is not None else "—", verdict(s["median"], target)]


def render_startup(s: dict, args) -> List[str]:
    out = ["## Startup and teardown (case 6)\n"]
    rows = []
    for kind in ("warm", "cold", "cold_bcc"):
        rs = s.get(kind) or []
        if not rs:
            continue
        who = f"pyoffcpu -p PID --mode wall, {kind.replace('_', ', compiled by ')}"
        rows.append(_spread_row(who, "start to first sample in the kernel map (s)", [r["first"] for r in rs], 3,
                                STARTUP_TARGETS.get(kind), " s"))
        rows.append(_spread_row(who, "start to `recording` line (s)", [r["recording"] for r in rs], 3,
                                COLD_RECORDING_S if kind == "cold" else None, " s"))
        rows.append(_spread_row(who, "peak RSS of pyoffcpu (VmHWM, MiB)", [r["hwm_mib"] for r in rs], 0))
        rows.append(_spread_row(who, "peak RSS with its children (ru_maxrss, MiB)", [r["maxrss_mib"] for r in rs],
                                0, STARTUP_RSS_MIB if kind != "cold_bcc" else None, " MiB"))
        rows.append(_spread_row(who, "CPU time of the whole 1 s run, children included (s)",
                                [r["cpu_s"] for r in rs], 2))
    if s.get("pyspy"):
        rows.append(_spread_row("py-spy record -p PID --idle", "start to `Sampling process` line (s)",
                                [r["recording"] for r in s["pyspy"]], 3))
    for who in ("pyoffcpu", "py-spy"):
        for secs in sorted({t["seconds"] for t in s["teardown"] if t["who"] == who}):
            ts = [t for t in s["teardown"] if t["who"] == who and t["seconds"] == secs]
            rows.append(_spread_row(f"{who} → SVG, {secs:g} s recording", "SIGINT to file written (s)",
                                    [t["file"] for t in ts], 2, TEARDOWN_S if who == "pyoffcpu" else None, " s"))
    out.append(markdown_table(["what", "measured", "runs", "median", "min–max", "target", ""], rows,
                              "llrrrrl"))
    out.append("")
    out.append("Each start: `pyoffcpu -p PID --mode wall -d 1` on the split workload (two busy-ish Python "
               "threads), measured by tools/startup.py from the spawn. First sample: the bench polls a copy "
               "of pyoffcpu's `agg` map fd (pidfd_getfd) until it holds an entry. pyoffcpu runs with "
               "PYOFFCPU_CACHE_DIR in the bench's temporary folder: warm, with it filled by one untimed "
               "run first; cold, with its `bpf` folder (programs, BTF offsets) removed before each run. "
               "Both load the programs the package ships (no bcc). cold, compiled by bcc: cold, with the "
               "BPF sources a marked copy of bpf/ (PYOFFCPU_BPF_DIR), for which the package ships "
               "nothing: bcc compiles in a child, whose peak counts in ru_maxrss (every cold start "
               "before issue 45). The kinds alternate.")
    if s.get("breakdown"):
        out.append("")
        out.append("Where a warm start goes (one `pyoffcpu -p` start under cProfile, the cache filled; "
                   "cumulative seconds, steps nest):\n")
        out.append(markdown_table(["step", "s"], [[w, f"{t:.3f}"] for w, t in s["breakdown"]], "lr"))
        out.append("")
    if args is not None and args.long_s < 600:
        out.append(f"The long teardown recording is {args.long_s:g} s, not the issue's 10 min, to keep "
                   f"`make bench` short; BENCH_LONG_S=600 make bench for the full one.")
    out.append("")
    return out
