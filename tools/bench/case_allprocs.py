"""Case 12: pyoffcpu -a on a machine of many Python processes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from typing import Dict, Iterable, List, Optional, Tuple

from harness import Pairs, fmt_num, fmt_ratio_range, markdown_table, verdict

from common import HERE, Proc, Profiler, Results, Tools, Worker, cpu_s, log, starts
from case_slowdown import calibrate, profiled_run


# -- case 12: pyoffcpu -a on a machine of many Python processes --------------------------------------------
ALL_ARGS = ["-a", "--mode", "cpu", "-F", "99"]
ALL_LABEL = "pyoffcpu -a --mode cpu -F 99"
ALL_CPU_MAX = 0.01              # pyoffcpu -a's own CPU while recording, share of one core
ALL_SLOWDOWN_MAX = 1.01         # a CPU-bound process beside it, median B/A
ALL_SETTLE_S = 2.0              # its CPU window starts this long after the `recording` line ...
ALL_WINDOW_S = 10.0             # ... and lasts this long (less when the recording is too short)
ALL_REPEATS = 5                 # each A and B of a pair: the work in this many runs
ALL_PYTHONS = "pyenv:3.9.18,pyenv:3.11.7,pyenv:3.12.1,pyenv:3.13.0,/usr/bin/python3.11"
FLEET = os.path.join(HERE, "fleet.py")

_SW_FOUND = re.compile(r"-a: (\d+) processes, (\d+) Python interpreters found \((\d+) processes without one\)")
_SW_LATE = re.compile(r"(\d+) samples of (\d+) Python processes came before they were registered")
_SW_RECORDED = re.compile(r"recorded [\d.]+ s of system-wide \((\d+) processes(?:, CPython ([^)]*))?\)")
_ROOT_PID = re.compile(r"^process (\d+)(?: |$)")
_PY_FRAME = re.compile(r" \([^()]*:(?:\d+|\?)\)$")


def parse_system_wide(stderr: str) -> Dict[str, object]:
    """What `pyoffcpu -a` said about the machine on stderr: `processes`,
    `pythons` (interpreters found) and `without` (processes without one) from
    its `-a: N processes, M Python interpreters found (K processes without
    one)` notice; `late_samples` and `late_processes` (Python processes
    sampled before they were registered; 0 without that notice); from its
    `recorded ... of system-wide (N processes, CPython X, Y)` line
    `recorded_processes` and `versions`. None where a line is missing."""
    out: Dict[str, object] = {"processes": None, "pythons": None, "without": None, "late_samples": 0,
                              "late_processes": 0, "recorded_processes": None, "versions": []}
    m = _SW_FOUND.search(stderr)
    if m:
        out["processes"], out["pythons"], out["without"] = (int(x) for x in m.groups())
    m = _SW_LATE.search(stderr)
    if m:
        out["late_samples"], out["late_processes"] = int(m.group(1)), int(m.group(2))
    m = _SW_RECORDED.search(stderr)
    if m:
        out["recorded_processes"] = int(m.group(1))
        out["versions"] = [v.strip() for v in (m.group(2) or "").split(",") if v.strip()]
    return out


def process_roots(lines: Iterable[str]) -> Dict[int, Dict[str, int]]:
    """Per `process PID ...` root of folded lines (pyoffcpu -a's): `stacks`
    and `weight` of all its lines, `python_stacks` and `python_weight` of
    those with at least one Python frame (`name (file:line)`, below the
    process and thread roots). Lines without a process root are skipped."""
    out: Dict[int, Dict[str, int]] = {}
    for line in lines:
        line = line.strip()
        stack, sep, weight = line.rpartition(" ")
        if not sep or not weight.isdigit():
            continue
        frames = stack.split(";")
        m = _ROOT_PID.match(frames[0])
        if not m:
            continue
        d = out.setdefault(int(m.group(1)), {"stacks": 0, "weight": 0, "python_stacks": 0, "python_weight": 0})
        d["stacks"] += 1
        d["weight"] += int(weight)
        rest = frames[1:]
        if rest and rest[0].startswith(("thread ", "threads ")):
            rest = rest[1:]
        if any(_PY_FRAME.search(f) for f in rest):
            d["python_stacks"] += 1
            d["python_weight"] += int(weight)
    return out


def all_pythons(specs: str) -> Tuple[List[str], List[str]]:
    """The interpreters of case 12's processes, in order: each spec a path or
    `pyenv:VERSION` (`pyenv prefix VERSION`/bin/pythonX.Y, else
    $PYENV_ROOT or ~/.pyenv's versions/VERSION). Returns (found, missing)."""
    found, missing = [], []
    for spec in (s.strip() for s in specs.split(",")):
        if not spec:
            continue
        cands = [spec]
        if spec.startswith("pyenv:"):
            v = spec[len("pyenv:"):]
            prefixes = []
            try:
                r = subprocess.run(["pyenv", "prefix", v], capture_output=True, text=True, timeout=30)
                if r.returncode == 0 and r.stdout.strip():
                    prefixes.append(r.stdout.strip().splitlines()[0])
            except (OSError, subprocess.TimeoutExpired):
                pass
            for root in (os.environ.get("PYENV_ROOT"), os.path.expanduser("~/.pyenv"), "/root/.pyenv"):
                if root:
                    prefixes.append(os.path.join(root, "versions", v))
            xy = ".".join(v.split(".")[:2])
            cands = [os.path.join(p, "bin", n) for p in prefixes for n in (f"python{xy}", "python3")]
        exe = next((c for c in cands if os.path.isfile(c) and os.access(c, os.X_OK)), None)
        (found if exe else missing).append(exe or spec)
    return found, missing


def _share(a: Optional[Tuple[float, float]], b: Optional[Tuple[float, float]]) -> Optional[float]:
    """CPU share of one core between two (seconds since, CPU seconds) readings."""
    if not a or not b or b[0] <= a[0]:
        return None
    return (b[1] - a[1]) / (b[0] - a[0])


def allprocs_case(tools: Tools, res: Results, procs: int, seconds: float, pairs: int, work_s: float,
                  pythons: str, short_every: float = 0.5, keep: bool = False):
    """`pyoffcpu -a --mode cpu -F 99` beside tools/bench/fleet.py's `procs`
    Python processes (mixed interpreters; idle, busy, short-lived): one
    `-d seconds` recording (its start, its own CPU over a window, its peak
    RSS, what it found) and `pairs` A/B pairs of a CPU-bound process beside
    it, each with an A/A pair of the same process for reference."""
    pys, missing = all_pythons(pythons)
    out = {"procs": procs, "seconds": seconds, "pairs": pairs, "pythons": pys, "missing": missing,
           "settle_s": ALL_SETTLE_S, "window_s": min(ALL_WINDOW_S, seconds - ALL_SETTLE_S - 1)}
    if missing:
        res.notes.append(f"case 12: interpreters not found, left out: {', '.join(missing)}")
    if not pys:
        res.errors.append(f"case 12: none of the interpreters found ({pythons})")
        return
    env = tools.env             # pyoffcpu's own program cache, as in cases 1-4 (nothing here empties it)
    folded = os.path.join(tools.outdir, "c12.folded")
    fleet = Proc([tools.python, FLEET, "--procs", str(procs), "--short-every", f"{short_every:g}", *pys],
                 stdin=True)
    try:
        info = json.loads(fleet.expect("ready ", 180).split(" ", 1)[1])
        out["fleet"] = info
        roles: Dict[str, int] = {}
        for c in info["long"]:
            roles[c["role"]] = roles.get(c["role"], 0) + 1
        log(f"case 12: {len(info['long'])} long-lived Python processes ("
            + ", ".join(f"{n} {r}" for r, n in sorted(roles.items())) + f") under {len(pys)} interpreters, "
            f"a short-lived one every {info['short_every']:g} s living {info['short_life']:g} s")
        time.sleep(1.0)                                 # the short-lived ones come and go
        try:                            # untimed: the program cache filled, files in the page cache
            starts.measure(tools.pyoffcpu + ALL_ARGS + ["-d", "0.5", "-o", folded], env=env,
                           first_sample=False, timeout=300)
        except RuntimeError as e:
            log(f"case 12: warm-up run: {e}")
        try:
            allprocs_recording(tools, env, fleet, info, out, seconds, folded)
        except Exception as e:                          # noqa: BLE001
            res.errors.append(f"case 12 recording: {e}")
            log(f"case 12 recording: FAILED: {e}")
        if pairs > 0:
            allprocs_pairs(tools, res, out, pairs, work_s)
    except Exception as e:                              # noqa: BLE001
        res.errors.append(f"case 12: {e}")
        log(f"case 12: FAILED: {e}")
    finally:
        fleet.close(10)
        if os.path.exists(folded) and not keep:
            os.unlink(folded)
    if out.get("recording") or out.get("ab"):
        res.allprocs = out


def allprocs_recording(tools: Tools, env: Optional[Dict[str, str]], fleet: Proc, info: dict, out: dict, seconds: float,
                       folded: str):
    window = out["window_s"]
    marks = (("rec", 0.0), ("settle", ALL_SETTLE_S), ("end", ALL_SETTLE_S + window))
    readings: Dict[str, Tuple[float, float]] = {}

    def during(pid: int, since: float):
        for key, at in marks:
            if key not in readings and since >= at and (key != "end" or window > 0):
                c = cpu_s(pid)
                if c is not None:
                    readings[key] = (since, c)
    log(f"case 12: {ALL_LABEL} -d {seconds:g}, its CPU read {ALL_SETTLE_S:g}–{ALL_SETTLE_S + window:g} s "
        "after its `recording` line")
    t_call = time.monotonic()
    r = starts.measure(tools.pyoffcpu + ALL_ARGS + ["-d", f"{seconds:g}", "-o", folded], env=env,
                       timeout=seconds + 300, during=during)
    if r["rc"] != 0:
        raise RuntimeError(f"pyoffcpu exited {r['rc']}: " + " | ".join(r["stderr"].strip().splitlines()[-3:]))
    if r["recording"] is None:
        raise RuntimeError("no `recording` line")
    t_rec = t_call + r["recording"]
    rec = {k: r[k] for k in ("first", "recording", "hwm_mib", "maxrss_mib", "cpu_s", "total_s")}
    rec["stop_s"] = r["total_s"] - r["recording"] - seconds      # -d ran out to its exit (the file written)
    rec["startup_cpu_s"] = readings["rec"][1] if "rec" in readings else None
    rec["first_share"] = _share(readings.get("rec"), readings.get("settle"))
    rec["window_share"] = _share(readings.get("settle"), readings.get("end"))
    if "settle" in readings and "end" in readings:
        rec["window_measured_s"] = readings["end"][0] - readings["settle"][0]
    rec.update(parse_system_wide(r["stderr"]))
    fleet.send("shorts")
    shorts = json.loads(fleet.expect("shorts ", 10).split(" ", 1)[1])
    with open(folded, errors="replace") as f:
        roots = process_roots(f)
    empty = {"stacks": 0, "python_stacks": 0}
    per: Dict[str, dict] = {}
    for c in info["long"]:
        key = f"{c['python']} ({c['version']})"
        d = per.setdefault(key, {"n": 0, "sampled": 0, "python": 0, "busy": 0})
        root = roots.get(c["pid"], empty)
        d["n"] += 1
        d["busy"] += c["role"] == "busy"
        d["sampled"] += root["stacks"] > 0
        d["python"] += root["python_stacks"] > 0
    rec["per_python"] = per
    inside = [s for s in shorts if s["start"] >= t_rec and s["end"] is not None and s["end"] <= t_rec + seconds]
    rec["shorts"] = {"n": len(inside),
                     "sampled": sum(roots.get(s["pid"], empty)["stacks"] > 0 for s in inside),
                     "python": sum(roots.get(s["pid"], empty)["python_stacks"] > 0 for s in inside)}
    ours = {c["pid"] for c in info["long"]} | {s["pid"] for s in shorts} | {info["parent"]}
    rec["roots"] = len(roots)
    rec["other_roots"] = len(set(roots) - ours)
    out["recording"] = rec
    n_long = len(info["long"])
    found = sum(d["python"] for d in per.values())
    ws = rec["window_share"]
    log(f"case 12: `recording` after {r['recording']:.2f} s, own CPU "
        f"{fmt_num(100 * ws if ws is not None else None, 2)}% of a core over {window:g} s, "
        f"VmHWM {r['hwm_mib']:.0f} MiB; {found}/{n_long} long-lived and "
        f"{rec['shorts']['python']}/{rec['shorts']['n']} short-lived with Python frames; notice: "
        f"{rec['processes']} processes, {rec['pythons']} Python interpreters, versions {', '.join(rec['versions'])}")


def _repeats(w: Worker, n: int, k: int) -> Tuple[float, dict]:
    """k runs of n units on w: (their total seconds, {fastest, cpu_s, rq_s})."""
    ts, cpu, rq = [], 0.0, 0.0
    for _ in range(k):
        t, x = w.run(n)
        ts.append(t)
        cpu += x.get("cpu_s", 0)
        rq += x.get("rq_s", 0)
    return sum(ts), {"fastest": min(ts), "cpu_s": cpu, "rq_s": rq}


def allprocs_pairs(tools: Tools, res: Results, out: dict, pairs: int, work_s: float,
                   prof: Optional[Profiler] = None, case: str = "12"):
    """A/B pairs of a CPU-bound process (workloads.py cpu) beside `pyoffcpu -a`
    (or `prof`: case 18's crash watcher), each followed by an A/A pair of the
    same process (both alone). Each A or B is ALL_REPEATS runs of a fifth of
    the work: its time is their total (the verdict's), and the fastest of
    them is kept too."""
    n = calibrate(tools, "cpu", 2000, work_s)
    k = ALL_REPEATS
    n_rep = max(1, n // k)
    if prof is None:
        prof = Profiler(ALL_LABEL, lambda _pid, o: tools.pyoffcpu + ALL_ARGS + ["-o", o + ".folded"],
                        r"^pyoffcpu: recording", True)
    ab, aa, ab_fast, aa_fast = Pairs(), Pairs(), Pairs(), Pairs()
    for i in range(pairs):
        tag = f"c{case}-pair-{i}"
        order = "AB" if i % 2 == 0 else "BA"
        w = Worker(tools.python, "cpu")
        try:
            w.run(max(1, n // 5))                               # warm-up

            def a():
                return _repeats(w, n_rep, k)

            def b():
                tb, xb, _ = profiled_run(tools, prof, 0, a, tag)
                return tb, xb
            if order == "AB":
                ta, xa = a()
                tb, xb = b()
            else:
                tb, xb = b()
                ta, xa = a()
            ab.add(ta, tb, cpu=(xa["cpu_s"], xb["cpu_s"]), wait=(xa["rq_s"], xb["rq_s"]))
            ab_fast.add(xa["fastest"], xb["fastest"])
            (t1, x1), (t2, x2) = a(), a()
            if i % 2:
                (t1, x1), (t2, x2) = (t2, x2), (t1, x1)
            aa.add(t1, t2, cpu=(x1["cpu_s"], x2["cpu_s"]), wait=(x1["rq_s"], x2["rq_s"]))
            aa_fast.add(x1["fastest"], x2["fastest"])
            log(f"case {case} pair {i + 1}/{pairs} {order}: A {ta:.3f}s B {tb:.3f}s ratio {tb / ta:.3f} (fastest "
                f"of {k}: {xb['fastest'] / xa['fastest']:.3f}); A/A {t2 / t1:.3f} "
                f"({x2['fastest'] / x1['fastest']:.3f}); waiting for a CPU A {xa['rq_s']:.3f}s B {xb['rq_s']:.3f}s; "
                f"its own CPU {xb.get('profiler_cpu_s', 0):.3f}s")
            out.setdefault("own_cpu_s", []).append(xb.get("profiler_cpu_s", 0))
        except Exception as e:                                  # noqa: BLE001
            ab.failures.append(str(e))
            res.errors.append(f"case {case} pair {i + 1}: {e}")
            log(f"case {case} pair {i + 1}: FAILED: {e}")
        finally:
            w.close()
            if os.path.exists(os.path.join(tools.outdir, tag + ".folded")):
                os.unlink(os.path.join(tools.outdir, tag + ".folded"))
    out["n_work"], out["repeats"] = n_rep * k, k
    out["ab"] = {**ab.summary(), "failures": len(ab.failures)}
    out["aa"] = aa.summary()
    out["ab_fast"] = ab_fast.summary()
    out["aa_fast"] = aa_fast.summary()


def render_allprocs(d: dict) -> List[str]:
    fl = d.get("fleet") or {}
    longs = fl.get("long", [])
    roles: Dict[str, int] = {}
    for c in longs:
        roles[c["role"]] = roles.get(c["role"], 0) + 1
    out = [f"## System-wide (case 12): `{ALL_LABEL}` beside {d['procs']} Python processes\n"]
    out.append(f"tools/bench/fleet.py keeps {d['procs']} Python processes alive: {len(longs)} long-lived "
               f"({roles.get('idle-sleep', 0)} idle in time.sleep, {roles.get('idle-lock', 0)} idle in a lock's "
               f"acquire(timeout), each waking every 100 ms for 0.2 ms of Python work; {roles.get('busy', 0)} busy, "
               f"spinning 2% of every 50 ms) and "
               + (f"about {fl.get('short_alive', 0)} short-lived ones (one started every {fl['short_every']:g} s, "
                  f"living {fl.get('short_life', 0):g} s: 0.2 s asleep, 30 ms of work)" if fl.get("short_every")
                  else "no short-lived ones")
               + ", round-robin over "
               + ", ".join(f"`{p}`" for p in d["pythons"])
               + (f" (not found, left out: {', '.join(d['missing'])})" if d.get("missing") else "")
               + ". The rest of the machine runs what it runs (the bench, a neighbour's tests).\n")
    rows = []
    rec = d.get("recording")
    if rec:
        ws = rec.get("window_share")
        rows.append([f"own CPU, {d['settle_s']:g}–{d['settle_s'] + d['window_s']:g} s after `recording` "
                     "(% of one core)", f"{100 * ws:.2f}" if ws is not None else "n/a",
                     f"<= {100 * ALL_CPU_MAX:g}", verdict(ws, ALL_CPU_MAX)])
        fs = rec.get("first_share")
        rows.append([f"own CPU, first {d['settle_s']:g} s after `recording` (% of one core)",
                     f"{100 * fs:.2f}" if fs is not None else "n/a", "—", ""])
        rows.append(["CPU from start to `recording` (s)", fmt_num(rec.get("startup_cpu_s"), 2), "—", ""])
        rows.append([f"CPU of the whole -d {d['seconds']:g} run, children included (s)",
                     fmt_num(rec.get("cpu_s"), 2), "—", ""])
        rows.append(["start to `recording` line (s)", fmt_num(rec.get("recording"), 2), "—", ""])
        rows.append(["start to first sample in the kernel map (s)", fmt_num(rec.get("first"), 2), "—", ""])
        rows.append(["-d ran out to exit, file written (s)", fmt_num(rec.get("stop_s"), 2), "—", ""])
        rows.append(["peak RSS (VmHWM, MiB)", fmt_num(rec.get("hwm_mib"), 0), "—", ""])
        rows.append(["peak RSS with children (ru_maxrss, MiB)", fmt_num(rec.get("maxrss_mib"), 0), "—", ""])
    ab, aa = d.get("ab"), d.get("aa")
    if ab:
        rows.append([f"CPU-bound process beside it: B/A, median of {ab['n']} pairs"
                     + (f" ({ab['failures']} failed)" if ab.get("failures") else ""),
                     fmt_num(ab["ratio_median"]), f"<= {ALL_SLOWDOWN_MAX:.2f}",
                     verdict(ab["ratio_median"], ALL_SLOWDOWN_MAX)])
        rows.append(["... B/A min–max", fmt_ratio_range(ab["ratio_min"], ab["ratio_max"]), "—", ""])
        rows.append(["... CPU-time ratio B/A, median (min–max)",
                     f"{fmt_num(ab['cpu_ratio_median'])} ({fmt_ratio_range(ab['cpu_ratio_min'], ab['cpu_ratio_max'])})",
                     "—", ""])
        rows.append(["... waiting for a CPU, A / B (median share of the run)",
                     "n/a" if ab["wait_a"] is None else f"{100 * ab['wait_a']:.1f}% / {100 * ab['wait_b']:.1f}%",
                     "—", ""])
    if aa and aa.get("n"):
        rows.append([f"reference: A/A of the same processes, median of {aa['n']} (min–max)",
                     f"{fmt_num(aa['ratio_median'])} ({fmt_ratio_range(aa['ratio_min'], aa['ratio_max'])})",
                     "—", ""])
    k = d.get("repeats")
    for label, x in ((f"B/A of the fastest of the {k} runs, median (min–max)", d.get("ab_fast")),
                     (f"reference: A/A of the fastest of the {k} runs, median (min–max)", d.get("aa_fast"))):
        if x and x.get("n"):
            rows.append([label, f"{fmt_num(x['ratio_median'])} ({fmt_ratio_range(x['ratio_min'], x['ratio_max'])})",
                         "—", ""])
    out.append(markdown_table(["measured", "value", "target", ""], rows, "lrrl"))
    out.append("")
    if rec:
        n_long = len(longs)
        found = sum(x["python"] for x in rec["per_python"].values())
        sampled = sum(x["sampled"] for x in rec["per_python"].values())
        lines = [
            f"pyoffcpu's notice: -a: {rec.get('processes', 'n/a')} processes, {rec.get('pythons', 'n/a')} Python "
            f"interpreters found ({rec.get('without', 'n/a')} processes without one)"
            + (f"; {rec['late_samples']} samples of {rec['late_processes']} Python processes came before they "
               "were registered (native frames only)" if rec.get("late_samples") else ""),
            f"its summary: {rec.get('recorded_processes', 'n/a')} processes recorded, CPython "
            + (", ".join(rec.get("versions") or []) or "n/a"),
            f"the folded file: {rec['roots']} process roots, {rec['other_roots']} of them not the fleet's; "
            f"of the {n_long} long-lived processes {sampled} sampled, {found} with Python frames; of the "
            f"{rec['shorts']['n']} short-lived ones that lived and died inside the recording "
            f"{rec['shorts']['sampled']} sampled, {rec['shorts']['python']} with Python frames",
        ]
        out.extend(f"- {x}" for x in lines)
        out.append("")
        rows = [[k, v["n"], v["busy"], v["sampled"], v["python"]] for k, v in rec["per_python"].items()]
        rows.append(["short-lived (all interpreters)", rec["shorts"]["n"], "—", rec["shorts"]["sampled"],
                     rec["shorts"]["python"]])
        out.append(markdown_table(["interpreter", "processes", "of them busy", "with samples",
                                   "with Python frames"], rows, "lrrrr"))
        out.append("")
    out.append(f"One `{ALL_LABEL} -d {d['seconds']:g}` recording (an untimed run first, for the program cache and "
               "the page cache), followed from its spawn by tools/startup.py: its own CPU is its user+system time "
               f"(/proc/PID/stat, all threads) read {d['settle_s']:g} s and {d['settle_s'] + d['window_s']:g} s "
               "after its `recording` line; BPF runs in the context of the processes it samples and is not in "
               "it. With samples / with Python frames: the `process PID` roots of the folded file, and those "
               "with a `name (file:line)` frame. An idle process is on a CPU about 0.2% of the time, about "
               f"{0.002 * 99 * d['seconds']:.0f} samples expected in {d['seconds']:g} s. "
               + (f"Slowdown: {d['pairs']} pairs of a fresh `workloads.py cpu` process, each A and B "
                  f"{d.get('n_work')} units of work in {d.get('repeats')} runs ({fmt_num(ab['a_median'], 2)} s "
                  f"alone, median), AB and BA alternating, `{ALL_LABEL}` started before B and gone before A "
                  "(SIGINT, its file of the whole machine written); each pair followed by an A/A pair of the same "
                  "process, both alone, for the noise. The verdict is on the total time; the fastest of the runs "
                  "of each A and B is the least disturbed by the machine's other load (its neighbour's too, which "
                  "shows as CPU time of ours). " if ab else "")
               + "Informational except the two targets.")
    out.append("")
    return out
