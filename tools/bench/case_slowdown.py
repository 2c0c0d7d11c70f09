"""Cases 1-4 and 8: the slowdown of a workload under each profiler, in A/B
pairs, and the BPF run time per event of its B runs."""
from __future__ import annotations

import os
import time
from typing import Callable, Dict, List, Tuple

from harness import Pairs, median, prog_delta, prog_label

from common import Proc, Profiler, Results, SETTLE_S, Tools, bpfstats, cpu_s, log


# -- slowdown pairs -------------------------------------------------------------------------------
def profiled_run(tools: Tools, prof: Profiler, target_pid: int, work: Callable[[], Tuple[float, dict]],
                 tag: str, with_stats: bool = False) -> Tuple[float, dict, Dict[str, Tuple[int, int]]]:
    """Attach `prof` to target_pid, do `work`, stop the profiler (SIGINT, its
    file written). Returns (work seconds, work extra, BPF program run-time
    deltas over the work when with_stats); the extra gains profiler_cpu_s,
    the profiler process's own CPU seconds over the work (not its BPF, which
    runs in the target's context, nor its children)."""
    out = os.path.join(tools.outdir, tag)
    p = Proc(prof.argv(target_pid, out), merge=prof.merge, env=tools.env if prof.pyoffcpu else None)
    stats = None
    try:
        if prof.ready:
            p.wait_err(prof.ready, 120)
            time.sleep(SETTLE_S)
        else:                       # it says nothing when it samples: give it a moment
            time.sleep(prof.start_s)
        if with_stats:
            stats = bpfstats.ProgStats(p.pid)
            before = stats.read()
        cpu0 = cpu_s(p.pid)
        dt, extra = work()
        cpu1 = cpu_s(p.pid)
        if cpu0 is not None and cpu1 is not None:
            extra = dict(extra, profiler_cpu_s=cpu1 - cpu0)
        delta = prog_delta(before, stats.read()) if stats else {}
        p.interrupt()
        rc = p.wait(180)
        if rc != 0:
            raise RuntimeError(f"{prof.label} exited {rc}: {p.stderr_tail()}")
        return dt, extra, delta
    finally:
        if stats:
            stats.close()
        p.kill()


def slowdown_case(tools: Tools, res: Results, case: str, kind: str, n: int, profs: List[Profiler],
                  pairs: int, targets: Dict[str, float], bystander: bool = False):
    """`pairs` A/B pairs for each profiler, profilers rotated round by round."""
    acc = {p.label: Pairs() for p in profs}
    extra_a: Dict[str, list] = {p.label: [] for p in profs}
    own_cpu: Dict[str, list] = {p.label: [] for p in profs}   # profiler CPU s per s of B
    for i in range(pairs):
        for j in range(len(profs)):
            k = (i + j) % len(profs)
            prof = profs[k]
            order = "AB" if (i + k) % 2 == 0 else "BA"      # alternates pair to pair for each profiler
            tag = f"c{case}-{kind.split()[0]}-{i}-{j}"
            w = tools.worker(kind)
            idle = tools.worker("idle") if bystander else None
            try:
                w.run(max(1, n // 5))                           # warm-up
                target = idle.pid if bystander else w.pid

                def a():
                    return w.run(n)

                def b():
                    return profiled_run(tools, prof, target, lambda: w.run(n), tag)
                if order == "AB":
                    ta, xa = a()
                    tb, xb, _ = b()
                else:
                    tb, xb, _ = b()
                    ta, xa = a()
                acc[prof.label].add(ta, tb, cpu=(xa.get("cpu_s", 0), xb.get("cpu_s", 0)),
                                    wait=(xa.get("rq_s", 0), xb.get("rq_s", 0)))
                extra_a[prof.label].append(xa)
                if "profiler_cpu_s" in xb:
                    own_cpu[prof.label].append(xb["profiler_cpu_s"] / tb)
                log(f"case {case} pair {i + 1}/{pairs} {order} {prof.label}: "
                    f"A {ta:.3f}s B {tb:.3f}s ratio {tb / ta:.3f} "
                    f"(CPU {xa.get('cpu_s', 0):.3f}s/{xb.get('cpu_s', 0):.3f}s, "
                    f"waiting for a CPU {xa.get('rq_s', 0):.3f}s/{xb.get('rq_s', 0):.3f}s)")
            except Exception as e:                              # noqa: BLE001 - reported, bench goes on
                acc[prof.label].failures.append(str(e))
                res.errors.append(f"case {case} {prof.label} pair {i + 1}: {e}")
                log(f"case {case} pair {i + 1} {prof.label}: FAILED: {e}")
            finally:
                w.close()
                if idle:
                    idle.close()
    for prof in profs:
        s = acc[prof.label].summary()
        row = {"case": case, "kind": kind, "profiler": prof.label, **s,
               "failures": len(acc[prof.label].failures), "target": targets.get(prof.label)}
        if own_cpu[prof.label]:
            row["profiler_cpu"] = median(own_cpu[prof.label])
        sw = [x["switches"] / x["seconds"] for x in extra_a[prof.label] if x.get("switches")]
        if sw:
            row["switch_rate"] = median(sw)
        res.overhead.append(row)
    for prof in profs:
        if prof.stats and tools.sysctl is not None and tools.sysctl.available:
            stats_run(tools, res, case, kind, n, prof, bystander)


def stats_run(tools: Tools, res: Results, case: str, kind: str, n: int, prof: Profiler, bystander: bool):
    """One more profiled run, with kernel.bpf_stats_enabled on, for the BPF table."""
    w = tools.worker(kind)
    idle = tools.worker("idle") if bystander else None
    try:
        w.run(max(1, n // 5))
        tools.sysctl.on()
        try:
            tb, _, delta = profiled_run(tools, prof, idle.pid if bystander else w.pid, lambda: w.run(n),
                                        f"c{case}-{kind.split()[0]}-stats", with_stats=True)
        finally:
            tools.sysctl.off()
        res.bpf.append(bpf_summary(case, prof.label, [(tb, delta)]))
        log(f"case {case} BPF run times under {prof.label}: "
            + ", ".join(f"{prog_label(k)} {c} runs {ns / max(1, c):.0f} ns" for k, (c, ns) in delta.items()))
    except Exception as e:                                      # noqa: BLE001
        res.errors.append(f"case {case} {prof.label} BPF stats run: {e}")
        log(f"case {case} {prof.label} BPF stats run: FAILED: {e}")
    finally:
        w.close()
        if idle:
            idle.close()


def bpf_summary(case: str, label: str, runs: list) -> dict:
    progs: Dict[str, Dict[str, list]] = {}
    for seconds, delta in runs:
        for name, (cnt, ns) in delta.items():
            d = progs.setdefault(name, {"per_event": [], "rate": [], "cpu": []})
            if cnt > 0:
                d["per_event"].append(ns / cnt)
            d["rate"].append(cnt / seconds)
            d["cpu"].append(ns / seconds / 1e9)
    return {"case": case, "profiler": label,
            "progs": {n: {k: median(v) for k, v in d.items()} for n, d in progs.items()}}


def pingpong_kind(tools: Tools, rate: float) -> str:
    """The ping-pong workload with enough Python work per round trip for about
    `rate` context switches a second (two per round trip); 0: no work, as fast
    as the machine switches."""
    if rate <= 0:
        return "pingpong 0"
    probe = 2000

    def per_round_trip(k: int) -> float:
        w = tools.worker(f"pingpong {k}")
        try:
            w.run(2000)
            return min(w.run(20000)[0] for _ in range(2)) / 20000
        finally:
            w.close()
    bare = per_round_trip(0)
    per_iter = max(1e-9, (per_round_trip(probe) - bare) / probe)
    k = max(0, int((2.0 / rate - bare) / per_iter))
    log(f"ping-pong: {bare * 1e6:.1f} us per bare round trip, {k} iterations of work per round trip "
        f"for ~{rate:g} switches/s")
    return f"pingpong {k}"


def calibrate(tools: Tools, kind: str, n0: int, work_s: float) -> int:
    w = tools.worker(kind)
    try:
        w.run(max(1, n0 // 4))
        times = [w.run(n0)[0] for _ in range(2)]
    finally:
        w.close()
    n = max(1, int(n0 * work_s / min(times)))
    log(f"calibrated {kind}: {n} per run (~{work_s:g} s)")
    return n
