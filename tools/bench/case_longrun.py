"""Case 9: a long run beside a server that starts a thread per request."""
from __future__ import annotations

import json
import os
import time
from typing import List

from harness import (checkpoints, counts_by_checkpoint, fmt_bytes, fmt_clock, fmt_num, folded_summary,
                     latest_before, linear_slope, markdown_table, parse_drop_defines, parse_drops_line,
                     parse_stats_lines, rss_growth, verdict)

from common import (Proc, ROOT, Results, THREADSERVER, Tools, bpfstats, end_server, log,
                    proc_reading, read_file, server_stats)


# -- case 9: a long run of a server that starts a thread per request ---------------------------------
LONGRUN_GROWTH_MIB = 150.0      # issue 8: RSS flat after the first minute, within this much
LONGRUN_SAMPLE_S = 5.0          # RSS between the checkpoints (for the slope)


def longrun_case(tools: Tools, res: Results, seconds: float, rate: float, client_threads: int,
                 keep: bool = False):
    """pyoffcpu -p on a ThreadingHTTPServer kept at `rate` requests/s (each a new
    connection and a new thread) by a client in another process, for `seconds`;
    pyoffcpu's RSS every few seconds, and at each checkpoint (10 s, every minute)
    its maps and drops: from PYOFFCPU_STATS_FILE when pyoffcpu writes it, else
    counted here on copies of its map fds."""
    out = {"seconds": seconds, "rate_target": rate, "client_threads": client_threads,
           "readings": [], "samples": [], "maps_source": None, "capacity": {}}
    stats_path = os.path.join(tools.outdir, "c9-stats.jsonl")
    folded = os.path.join(tools.outdir, "c9.folded")
    tree = os.path.dirname(tools.env["PYTHONPATH"]) if tools.env and tools.env.get("PYTHONPATH") else ROOT
    drop_names = parse_drop_defines(read_file(os.path.join(tree, "bpf", "pyoffcpu.h")) or "")
    srv = Proc([tools.python, THREADSERVER, "server"], stdin=True)
    cli = p = counter = None
    try:
        port = int(srv.expect("ready ", 30).split()[1])
        cli = Proc([tools.python, THREADSERVER, "client", str(port), "--rate", f"{rate:g}",
                    "--seconds", f"{seconds + 900:g}", "--threads", str(client_threads)])
        time.sleep(3.0)                                         # the load settles before pyoffcpu comes
        warm = server_stats(srv)
        if not warm["served"]:
            raise RuntimeError(f"the server answered nothing in 3 s (client: {cli.stderr_tail()})")
        log(f"case 9: server {srv.pid} on 127.0.0.1:{port}, {warm['served'] / warm['t']:.0f} requests/s "
            f"before pyoffcpu; recording {seconds:g} s")
        if os.path.exists(stats_path):
            os.unlink(stats_path)
        env = dict(tools.env if tools.env is not None else os.environ, PYOFFCPU_STATS_FILE=stats_path)
        p = Proc(tools.pyoffcpu + ["-p", str(srv.pid), "--mode", "wall", "-d", f"{seconds:g}", "-o", folded],
                 env=env)
        t0 = p.wait_err(r"^pyoffcpu: recording", 120)
        served0 = server_stats(srv)
        try:
            counter = bpfstats.MapCounter(p.pid)
        except OSError as e:
            log(f"case 9: cannot read pyoffcpu's maps from outside ({e}): RSS only without the stats file")
        cps = checkpoints(seconds)
        ci = 0
        next_sample = 0.0
        last = {"t": 0.0, "ticks": None, "served": served0["served"], "st": served0["t"]}
        deadline = t0 + seconds + 900                           # a teardown of 15 min is a failure
        hwm = 0
        while p.p.poll() is None:
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(f"pyoffcpu still running {now - t0 - seconds:.0f} s after its -d ran out")
            t = now - t0
            r = proc_reading(p.pid)
            if r is None:
                break
            hwm = max(hwm, r["hwm_kib"] or 0)
            if ci < len(cps) and t >= cps[ci]:
                ci += 1
                reading = {"t": t, "rss_kib": r["rss_kib"], "hwm_kib": r["hwm_kib"]}
                if last["ticks"] is not None:
                    reading["cpu_pct"] = 100 * (r["ticks"] - last["ticks"]) / os.sysconf("SC_CLK_TCK") / \
                        max(1e-6, t - last["t"])
                else:
                    reading["cpu_pct"] = 100 * r["ticks"] / os.sysconf("SC_CLK_TCK") / max(1e-6, now - p.started)
                st = server_stats(srv)
                reading["served_rate"] = (st["served"] - last["served"]) / max(1e-6, st["t"] - last["st"])
                sr = proc_reading(srv.pid) or {}
                reading["server_threads"] = sr.get("threads")
                reading["server_rss_kib"] = sr.get("rss_kib")
                if counter is not None:
                    c0 = time.monotonic()
                    try:
                        entries, drops = counter.read()
                        reading["bench_maps"] = {k: v[0] for k, v in entries.items()}
                        reading["bench_drops"] = {drop_names.get(i, f"drop {i}"): v for i, v in drops.items()}
                        out["capacity"].update({k: v[1] for k, v in entries.items()})
                    except OSError as e:
                        log(f"case 9: reading the maps failed: {e}")
                    reading["count_s"] = time.monotonic() - c0
                    log(f"case 9: counting pyoffcpu's map entries took {reading['count_s']:.2f} s")
                out["readings"].append(reading)
                last.update(t=t, ticks=r["ticks"], served=st["served"], st=st["t"])
                log(f"case 9 {fmt_clock(t)}: pyoffcpu RSS {r['rss_kib'] / 1024:.0f} MiB, CPU "
                    f"{reading['cpu_pct']:.0f}%, {reading['served_rate']:.0f} requests/s, server threads "
                    f"{reading['server_threads']}"
                    + (", maps " + ", ".join(f"{k} {v}" for k, v in sorted(reading.get("bench_maps", {}).items()))
                       if reading.get("bench_maps") else ""))
                if ci == len(cps) and counter is not None:
                    counter.close()                             # our fd copies would keep its maps alive
                    counter = None
            if t < seconds:
                if t >= next_sample:
                    out["samples"].append((t, r["rss_kib"]))
                    next_sample += LONGRUN_SAMPLE_S
                wake = min([next_sample] + ([cps[ci]] if ci < len(cps) else []))
                time.sleep(min(1.0, max(0.05, wake - (time.monotonic() - t0))))
            else:
                time.sleep(0.1)                                 # teardown: the peak while it writes
        t_exit = time.monotonic()
        rc = p.wait(60)
        out["teardown_s"] = t_exit - (t0 + seconds)
        out["hwm_kib"] = hwm
        final = server_stats(srv)
        out["served_rate"] = (last["served"] - served0["served"]) / max(1e-6, last["st"] - served0["t"])
        out["served_total"] = final["served"]
        if rc != 0:
            raise RuntimeError(f"pyoffcpu exited {rc}: {p.stderr_tail()}")
        for _, line in reversed(p.err):
            d = parse_drops_line(line or "")
            if d is not None:
                out["final_drops"] = d
                break
        cli.interrupt()
        try:
            out["client"] = json.loads(cli.expect("done ", 30).split(" ", 1)[1])
        except RuntimeError as e:
            log(f"case 9: client: {e}")
        records = parse_stats_lines(read_file(stats_path) or "")
        out["hook_lines"] = len(records)
        if records:
            out["maps_source"] = "PYOFFCPU_STATS_FILE"
            for reading in out["readings"]:
                rec = latest_before(records, reading["t"])
                if rec is not None:
                    reading["hook"] = {k: rec.get(k) for k in ("t", "rss_kib", "maps", "drops", "stacks", "threads")}
        elif any("bench_maps" in r for r in out["readings"]):
            out["maps_source"] = "bench"
        if os.path.exists(folded):
            out["folded_bytes"] = os.path.getsize(folded)
            with open(folded, errors="replace") as f:
                out["folded"] = folded_summary(f)
            if not keep:
                os.unlink(folded)
        samples = out["samples"] + [(r["t"], r["rss_kib"]) for r in out["readings"]]
        samples.sort()
        out["samples"] = samples
        g = rss_growth(samples)
        out["growth_mib"] = g / 1024 if g is not None else None
        slope = linear_slope([(t, v) for t, v in samples if t >= 10])
        out["slope_mib_min"] = slope * 60 / 1024 if slope is not None else None
        late = [(t, v) for t, v in samples if t >= 60]
        slope = linear_slope(late)
        out["late_slope_mib_min"] = slope * 60 / 1024 if slope is not None else None
        out["late_s"] = late[-1][0] - late[0][0] if len(late) > 1 else 0.0
        try:
            out["pid_max"] = int((read_file("/proc/sys/kernel/pid_max") or "").strip())
        except ValueError:
            pass
        log(f"case 9: served {out['served_rate']:.0f} requests/s while recording; RSS growth after the first "
            f"minute {fmt_num(out['growth_mib'], 0)} MiB, slope {fmt_num(out['slope_mib_min'], 1)} MiB/min; "
            f"folded {out.get('folded', {}).get('lines')} lines; teardown {out['teardown_s']:.1f} s")
    except Exception as e:                                      # noqa: BLE001
        res.errors.append(f"case 9: {e}")
        log(f"case 9: FAILED: {e}")
    finally:
        if counter is not None:
            counter.close()
        if p:
            p.kill()
        end_server(srv, cli)
    if out["readings"]:
        res.longrun = out


def render_longrun(d: dict, args) -> List[str]:
    out = [f"## Long run: a server that starts a thread per request (case 9), {fmt_clock(d['seconds'])} "
           "recording\n"]
    cl = d.get("client") or {}
    out.append(f"`pyoffcpu -p SERVER --mode wall -d {d['seconds']:g}` on an `http.server.ThreadingHTTPServer` "
               f"(127.0.0.1, HTTP/1.0: one connection and one thread per request) kept at "
               f"{d.get('served_rate', 0):.0f} requests/s while recording (asked: {d['rate_target']:g}; "
               f"{d['client_threads']} client threads in a process of their own"
               + (f", {cl.get('errors', 0)} failed requests" if cl else "") + ").\n")
    src = d.get("maps_source")
    rows = []
    for r in d["readings"]:
        h = r.get("hook") or {}
        drops = h.get("drops") if src == "PYOFFCPU_STATS_FILE" else r.get("bench_drops")
        rows.append([fmt_clock(r["t"]), fmt_num(r["rss_kib"] / 1024, 0), fmt_num(r["hwm_kib"] / 1024, 0),
                     fmt_num(r.get("cpu_pct"), 0), fmt_num(r.get("served_rate"), 0),
                     r.get("server_threads") if r.get("server_threads") is not None else "n/a",
                     h.get("stacks", "n/a") if h else "n/a", h.get("threads", "n/a") if h else "n/a",
                     sum(drops.values()) if drops else (0 if drops is not None else "n/a")])
    out.append(markdown_table(["t (m:ss)", "pyoffcpu RSS MiB", "peak RSS MiB", "pyoffcpu CPU %",
                               "requests/s", "server threads", "stacks held", "threads held", "drops"],
                              rows, "lrrrrrrrr"))
    out.append("")
    out.append("pyoffcpu's RSS and peak (VmRSS, VmHWM) from /proc; CPU: its user+system time since the "
               "reading before (the first row: since it started, start-up included), in % of one core; "
               "requests/s: answered by the server since the reading before. Stacks and threads held in "
               "user space come from PYOFFCPU_STATS_FILE.")
    out.append("")
    if src:
        key_maps = "maps" if src == "PYOFFCPU_STATS_FILE" else "bench_maps"
        readings = [((r.get("hook") or {}).get("maps") or {}) if src == "PYOFFCPU_STATS_FILE"
                    else r.get(key_maps, {}) for r in d["readings"]]
        rows = [[name, d["capacity"].get(name, "n/a")] + [v if v is not None else "n/a" for v in vals]
                for name, vals in counts_by_checkpoint(readings)]
        if rows:
            out.append("Map entries" + (" (from PYOFFCPU_STATS_FILE)" if src == "PYOFFCPU_STATS_FILE" else
                                        " (counted by the bench with BPF_MAP_GET_NEXT_KEY on copies of "
                                        "pyoffcpu's map fds; hash and stack-trace maps)") + ":\n")
            out.append(markdown_table(["map", "capacity"] + [fmt_clock(r["t"]) for r in d["readings"]], rows,
                                      "l" + "r" * (1 + len(d["readings"]))))
            out.append("")
        dr = [((r.get("hook") or {}).get("drops") or {}) if src == "PYOFFCPU_STATS_FILE"
              else r.get("bench_drops", {}) for r in d["readings"]]
        rows = [[name] + [v if v is not None else "n/a" for v in vals]
                for name, vals in counts_by_checkpoint(dr) if any(vals)]
        if rows:
            out.append("Drops (cumulative):\n")
            out.append(markdown_table(["drop"] + [fmt_clock(r["t"]) for r in d["readings"]], rows,
                                      "l" + "r" * len(d["readings"])))
            out.append("")
    else:
        out.append("No PYOFFCPU_STATS_FILE lines and no map readings: RSS only.")
        out.append("")
    fo = d.get("folded") or {}
    g = d.get("growth_mib")
    lines = [
        f"folded file: {fo.get('lines', 'n/a')} lines, {fmt_bytes(d.get('folded_bytes'))}, "
        f"{fo.get('threads', 'n/a')} thread roots",
        f"requests/s served while recording: {d.get('served_rate', 0):.0f} "
        f"({d.get('served_total', 0)} answered in all, warm-up included)",
        f"pyoffcpu RSS slope after 10 s: {fmt_num(d.get('slope_mib_min'), 1)} MiB/min; peak RSS "
        f"{fmt_bytes(d['hwm_kib'] * 1024) if d.get('hwm_kib') else 'n/a'} (teardown included); the file "
        f"written and pyoffcpu gone {fmt_num(d.get('teardown_s'), 1)} s after the recording ended",
        f"drops at the end (pyoffcpu's summary line): "
        + (", ".join(f"{k} {v}" for k, v in sorted(d["final_drops"].items())) or "none"
           if d.get("final_drops") is not None else "n/a"),
        f"RSS growth after the first minute: {fmt_num(g, 0)} MiB"
        + (f" (over the {fmt_clock(d.get('late_s', 0))} after it)" if g is not None else "")
        + f", limit <= {LONGRUN_GROWTH_MIB:g} MiB: **{verdict(g, LONGRUN_GROWTH_MIB)}**"
        + (" (the recording is shorter than 2 minutes)" if g is None else ""),
    ]
    ls = d.get("late_slope_mib_min")
    if d["seconds"] < 600 and ls is not None:
        lines.append(f"after the first minute RSS grew {ls:.1f} MiB/min: at that rate the issue's 10-minute "
                     f"run would grow {9 * ls:.0f} MiB after its first minute "
                     f"({verdict(9 * ls, LONGRUN_GROWTH_MIB)} projected)")
    pm = d.get("pid_max")
    rate = d.get("served_rate")
    if pm and rate:
        lines.append(f"kernel.pid_max is {pm}: at {rate:.0f} new threads/s TIDs come round every "
                     f"{pm / rate:.0f} s, so maps and roots keyed by TID stop growing near {pm} here "
                     "(a host with a larger pid_max, systemd's 4194304, keeps finding new TIDs)")
    out.extend(f"- {x}" for x in lines)
    out.append("")
    if d["seconds"] < 600:
        out.append(f"The recording is {d['seconds']:g} s, not the issue's 10 min, to keep `make bench` short; "
                   "BENCH_LONG_S=600 (or BENCH_THREADSERVER_S=600) for the full one.")
        out.append("")
    return out
