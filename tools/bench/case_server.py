"""Case 10: a thread-per-request server's throughput under each profiler."""
from __future__ import annotations

import json
import os
import time
from typing import Dict, List, Optional

from harness import (fmt_num, fmt_pct, fmt_range, loss, markdown_table, median, per_round_losses, prog_delta,
                     prog_label, rotated, spread, verdict)

from common import (EXACT, TIMELINE, Proc, Profiler, Results, THREADSERVER, Tools, bpfstats, end_server, log,
                    server_stats, tree_cpu_s)


# -- case 10: throughput of a thread-per-request server under each profiler ---------------------------
SERVER_LOSS_MAX = 0.03          # issue 10: pyoffcpu --mode wall costs the server at most 3% of its requests/s
PER_REQUEST_US_MAX = 12.0       # issue 37: profiler CPU (BPF + its own) per request under --mode wall
OWN_US_MAX = 5.0                # ... of which its own processes' (steady state)
SERVER_WARMUP_S = 2.0           # the client's load settles before a profiler comes or the window starts
SERVER_SETTLE_S = 3.0           # after the profiler's ready line: its start's background work (the
                                # kernel fold program's verification, ~1 s of CPU from the first
                                # drain that sees a thread born, a second in) is done
SERVER_PROFILERS = ("pyoffcpu --mode wall", EXACT, TIMELINE, "pyoffcpu --mode cpu -F 99",
                    "py-spy record --idle -r 100")
ALONE = "alone"


PINNED = " (server and client pinned to a CPU each)"


def server_measure(tools: Tools, prof: Optional[Profiler], seconds: float, clients: int, tag: str,
                   with_stats: bool = False, pinned: bool = False) -> dict:
    """A fresh ThreadingHTTPServer, a client in another process as fast as it
    goes, `prof` attached (None: alone) before a window of `seconds`: the
    requests/s the server answered in the window, the profiler's CPU seconds
    in it (and its BPF programs' run counts and times with_stats), then the
    profiler stopped (SIGINT, its file written).  pinned: the server on one
    CPU and the client on another (taskset), so that no request's thread is
    woken across CPUs: on a 2-vCPU KVM guest each such wake-up makes the
    programs that run after it cost 2-4 times as much (docs/overhead.md)."""
    cpus = sorted(os.sched_getaffinity(0))
    pin = (lambda i: ["taskset", "-c", str(cpus[i])]) if pinned else (lambda i: [])
    srv = Proc(pin(0) + [tools.python, THREADSERVER, "server"], stdin=True)
    cli = p = stats = None
    out_base = os.path.join(tools.outdir, tag)
    try:
        port = int(srv.expect("ready ", 30).split()[1])
        cli = Proc(pin(1) + [tools.python, THREADSERVER, "client", str(port), "--rate", "0",
                             "--seconds", f"{seconds + 900:g}", "--threads", str(clients)])
        time.sleep(SERVER_WARMUP_S)
        if not server_stats(srv)["served"]:
            raise RuntimeError(f"the server answered nothing in {SERVER_WARMUP_S:g} s "
                               f"(client: {cli.stderr_tail()})")
        m = {"profiler": (prof.label if prof else ALONE) + (PINNED if pinned else "")}
        if prof:
            p = Proc(prof.argv(srv.pid, out_base), merge=prof.merge, env=tools.env if prof.pyoffcpu else None)
            t_ready = p.wait_err(prof.ready, 120)
            m["start_s"] = t_ready - p.started
            time.sleep(SERVER_SETTLE_S)
            if with_stats:
                stats = bpfstats.ProgStats(p.pid)
                before = stats.read()
            cpu0 = tree_cpu_s(p.pid)
            m["start_cpu_s"] = cpu0     # its start and what follows it, once (tables, symbols)
        s0 = server_stats(srv)
        time.sleep(seconds)
        s1 = server_stats(srv)
        if prof:
            cpu1 = tree_cpu_s(p.pid)
            if with_stats:
                m["progs"] = prog_delta(before, stats.read())
            if p.p.poll() is not None or cpu0 is None or cpu1 is None:
                raise RuntimeError(f"{prof.label} exited during the window: {p.stderr_tail()}")
            m["profiler_cpu_s"] = cpu1 - cpu0
        m["window_s"] = s1["t"] - s0["t"]
        m["served"] = s1["served"] - s0["served"]
        if "switches" in s1:
            m["switches"] = s1["switches"] - s0["switches"]
        m["rate"] = m["served"] / max(1e-6, m["window_s"])
        if prof:
            t_sig = time.monotonic()
            p.interrupt()
            rc = p.wait(600)
            m["stop_s"] = time.monotonic() - t_sig
            if rc != 0:
                raise RuntimeError(f"{prof.label} exited {rc}: {p.stderr_tail()}")
        cli.interrupt()
        try:
            c = json.loads(cli.expect("done ", 30).split(" ", 1)[1])
            m["client_errors"] = c.get("errors", 0)
        except RuntimeError as e:
            log(f"case 10 client: {e}")
        return m
    finally:
        if stats:
            stats.close()
        if p:
            p.kill()
        end_server(srv, cli)
        for ext in (".folded", ".txt", ".timeline.json"):
            if os.path.exists(out_base + ext):
                os.unlink(out_base + ext)


def server_shadow(tools: Tools, seconds: float, clients: int) -> Optional[dict]:
    """The server under its client, recorded both ways at once (shadow.py)."""
    from shadow import record_both
    srv = Proc([tools.python, THREADSERVER, "server"], stdin=True)
    cli = None
    try:
        port = int(srv.expect("ready ", 30).split()[1])
        cli = Proc([tools.python, THREADSERVER, "client", str(port), "--rate", "0",
                    "--seconds", f"{seconds + 900:g}", "--threads", str(clients)])
        time.sleep(SERVER_WARMUP_S)
        return record_both(tools, "10", ["-p", str(srv.pid), "--mode", "wall"], seconds, "c10-shadow")
    finally:
        end_server(srv, cli)


def server_case(tools: Tools, res: Results, seconds: float, rounds: int, clients: int):
    """`rounds` rounds, each every configuration once (alone and under each
    profiler) in a rotating order, a fresh server per measurement; then one
    more run per pyoffcpu mode with kernel.bpf_stats_enabled=1."""
    P = tools.profs
    configs = [ALONE] + [k for k in SERVER_PROFILERS if k in P]
    out = {"seconds": seconds, "rounds": rounds, "clients": clients, "configs": configs,
           "runs": {c: [] for c in configs}, "per_round": [], "stats": []}
    for i in range(rounds):
        this: Dict[str, float] = {}
        for label in rotated(configs, i):
            tag = f"c10-{i}-{'alone' if label == ALONE else label.split()[0] + '-' + label.split()[2]}"
            try:
                m = server_measure(tools, P.get(label), seconds, clients, tag)
                out["runs"][label].append(m)
                this[label] = m["rate"]
                log(f"case 10 round {i + 1}/{rounds} {label}: {m['rate']:.0f} requests/s over "
                    f"{m['window_s']:.1f} s" + (f", profiler CPU {m['profiler_cpu_s']:.2f} s, stopped in "
                                                f"{m['stop_s']:.1f} s" if label != ALONE else "")
                    + (f", {m['client_errors']} failed requests" if m.get("client_errors") else ""))
            except Exception as e:                              # noqa: BLE001
                res.errors.append(f"case 10 round {i + 1} {label}: {e}")
                log(f"case 10 round {i + 1} {label}: FAILED: {e}")
        out["per_round"].append(this)
    if tools.sysctl is not None and tools.sysctl.available:
        # each pyoffcpu mode once; wall mode once more with the server and
        # its client pinned apart (where there are two CPUs)
        pin_too = "pyoffcpu --mode wall" if len(os.sched_getaffinity(0)) >= 2 else None
        for label, pinned in [(c, False) for c in configs] + [(pin_too, True)]:
            prof = P.get(label)
            if not prof or not prof.stats:
                continue
            try:
                tools.sysctl.on()
                try:
                    m = server_measure(tools, prof, seconds, clients, "c10-stats", with_stats=True,
                                       pinned=pinned)
                finally:
                    tools.sysctl.off()
                out["stats"].append(m)
                log(f"case 10 BPF run times under {m['profiler']} ({m['rate']:.0f} requests/s): "
                    + ", ".join(f"{prog_label(k)} {c} runs {ns / max(1, c):.0f} ns"
                                for k, (c, ns) in sorted(m["progs"].items()) if c))
            except Exception as e:                              # noqa: BLE001
                res.errors.append(f"case 10 {label} BPF stats run: {e}")
                log(f"case 10 {label} BPF stats run: FAILED: {e}")
    try:
        got = server_shadow(tools, seconds, clients)
        if got:
            res.shadow.append(got)
    except Exception as e:                                      # noqa: BLE001
        res.errors.append(f"case 10 sampled against exact: {e}")
    res.server = out


def server_summary(d: dict) -> List[dict]:
    """Per configuration: its requests/s (median, min, max), the loss against
    the alone median and the median of its per-round losses against the alone
    run of the same round, the profiler's CPU seconds in the window."""
    alone = spread([m["rate"] for m in d["runs"].get(ALONE, [])])["median"]
    rows = []
    for label in d["configs"]:
        runs = d["runs"][label]
        s = spread([m["rate"] for m in runs])
        cpu = spread([m.get("profiler_cpu_s") for m in runs])
        per_round = per_round_losses(d["per_round"], ALONE, label) if label != ALONE else []
        rows.append({"label": label, "n": s["n"], "median": s["median"], "min": s["min"], "max": s["max"],
                     "loss": loss(s["median"], alone) if label != ALONE else None,
                     "round_loss": median(per_round), "rounds_paired": len(per_round),
                     "cpu_s": cpu["median"], "start_s": median([m.get("start_s") for m in runs]),
                     "stop_s": median([m.get("stop_s") for m in runs]),
                     "errors": sum(m.get("client_errors", 0) for m in runs),
                     "target": SERVER_LOSS_MAX if label == "pyoffcpu --mode wall" else None})
    return rows


def per_request(m: dict) -> Optional[dict]:
    """A stats run's profiler CPU per request, in µs: its BPF programs' run
    time, its own process's CPU, their sum; and the server's context switches
    per request (each one a switch-out and a switch-in its programs see)."""
    n = m.get("served")
    if not n or "progs" not in m or m.get("profiler_cpu_s") is None:
        return None
    bpf_ns = sum(ns for _, ns in m["progs"].values())
    own_us = m["profiler_cpu_s"] * 1e6 / n
    return {"bpf_us": bpf_ns / 1e3 / n, "own_us": own_us, "total_us": bpf_ns / 1e3 / n + own_us,
            "switches": m["switches"] / n if m.get("switches") is not None else None,
            "start_cpu_s": m.get("start_cpu_s")}


def per_request_rows(d: dict) -> List[dict]:
    return [dict(per_request(m), label=m["profiler"]) for m in d.get("stats", []) if per_request(m)]


def render_server(d: dict) -> List[str]:
    out = [f"## Thread-per-request server throughput (case 10): {d['rounds']} rounds x {d['seconds']:g} s "
           "per configuration\n"]
    out.append(f"An `http.server.ThreadingHTTPServer` (127.0.0.1, HTTP/1.0: one connection and one new thread "
               f"per request) under the target Python, and a client of {d['clients']} threads in a process "
               "of their own sending as fast as the answers come. Requests/s answered by the server over "
               f"a {d['seconds']:g} s window; the profiler attached before it (its ready line, then "
               f"{SERVER_SETTLE_S:g} s: the start's work in the background, such as the verification of "
               "the kernel's thread-fold program, is not in the window) and stopped after it; a fresh server and client for every measurement, "
               "each round every configuration once, in an order rotating from round to round.\n")
    rows = []
    for r in server_summary(d):
        tgt = r["target"]
        window = d["seconds"]
        rows.append([r["label"], r["n"], fmt_num(r["median"], 0), fmt_range(r["min"], r["max"], 0),
                     fmt_pct(r["loss"]) if r["label"] != ALONE else "—",
                     (fmt_pct(r["round_loss"]) + f" ({r['rounds_paired']})") if r["label"] != ALONE else "—",
                     fmt_num(r["cpu_s"], 2) if r["label"] != ALONE else "—",
                     f"{100 * r['cpu_s'] / window:.0f}%" if r["cpu_s"] is not None else "—",
                     f"<= {100 * tgt:g}%" if tgt else "—",
                     verdict(r["loss"], tgt) if tgt else "—"])
    out.append(markdown_table(["configuration", "runs", "requests/s median", "min–max",
                               "loss vs alone median", "loss vs alone, same round (median; rounds)",
                               "profiler CPU s in window", "of one core", "target", ""], rows, "lrrrrrrrrl"))
    out.append("")
    errs = {r["label"]: r["errors"] for r in server_summary(d) if r["errors"]}
    out.append("Loss: 1 - requests/s under the profiler / requests/s alone (negative: more requests "
               "than alone; the spread of the alone runs is the noise). The verdict is on the loss "
               "against the alone median. Profiler CPU: the profiler process's user+system time during "
               "the window (/proc/PID/stat); BPF programs run in the context of the threads they "
               "observe and are not in it."
               + (" Failed requests: " + ", ".join(f"{k} {v}" for k, v in errs.items()) + "." if errs else ""))
    out.append("")
    if d.get("stats"):
        rows = []
        for m in d["stats"]:
            w = m["window_s"]
            for name, (cnt, ns) in sorted(m.get("progs", {}).items()):
                lb = prog_label(name)
                if not cnt and not lb.startswith(("sched_switch", "on_cpu_sample")):
                    continue
                rows.append([m["profiler"], lb, cnt, f"{cnt / w:.0f}", fmt_num(ns / cnt, 0) if cnt else "no runs",
                             f"{100 * ns / w / 1e9:.2f}%", f"{m['rate']:.0f}"])
        out.append("BPF programs over the window of one more run per pyoffcpu mode, with "
                   "kernel.bpf_stats_enabled=1 (restored after):\n")
        out.append(markdown_table(["profiler", "program", "runs", "runs/s", "average ns", "CPU (share of one core)",
                                   "requests/s in that run"], rows, "llrrrrr"))
        out.append("")
        def wall(r):
            return r["label"] == "pyoffcpu --mode wall"
        rows = [[r["label"], fmt_num(r["bpf_us"], 1), fmt_num(r["own_us"], 1), fmt_num(r["total_us"], 1),
                 fmt_num(r["switches"], 1) if r["switches"] is not None else "—",
                 fmt_num(r["start_cpu_s"], 2) if r.get("start_cpu_s") is not None else "—",
                 f"<= {PER_REQUEST_US_MAX:g} (own <= {OWN_US_MAX:g})" if wall(r) else "—",
                 verdict(max(r["total_us"] / PER_REQUEST_US_MAX, r["own_us"] / OWN_US_MAX), 1.0)
                 if wall(r) else "—"]
                for r in per_request_rows(d)]
        out.append("Profiler CPU per request, from the same runs: its BPF programs' run time plus the "
                   "user+system time of its process and every process it started (the helpers that make "
                   "tables and symbol indexes), over the window, which begins "
                   f"{SERVER_SETTLE_S:g} s after its ready line, divided by the requests answered in it "
                   "(stable on a noisy machine, where requests/s are not); what it spent before the window "
                   "(its start, the tables and indexes of the server's files: once per recording); the "
                   "server's context switches per request (getrusage of the server: every thread's, the "
                   "ended ones' too), each a switch-out and a switch-in the programs see:\n")
        out.append(markdown_table(["profiler", "BPF µs/request", "own µs/request", "total µs/request",
                                   "server switches/request", "CPU s before the window (once)", "target", ""],
                                  rows, "lrrrrrrl"))
        out.append("")
    return out
