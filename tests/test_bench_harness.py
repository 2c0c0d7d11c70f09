"""The bench harness's pure parts (tools/bench/harness.py): statistics, verdicts,
Markdown tables, folded parsing of pyoffcpu's and py-spy's output. No root,
no BPF, no profiler; well under a second."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "bench"))

import harness  # noqa: E402
from harness import (Pairs, checkpoints, counts_by_checkpoint, fmt_clock, folded_summary,  # noqa: E402
                     function_name, function_shares, latest_before, linear_slope, markdown_table,
                     max_error_pp, median, parse_drop_defines, parse_drops_line, parse_fdinfo,
                     parse_folded, parse_stats_lines, proc_stat_cpu_ticks, proc_status_kib, prog_delta,
                     rss_growth, verdict)


def test_median_odd_even_and_empty():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert median([]) is None
    assert median([None, 5.0]) == 5.0


def test_pairs_ratio_median_min_max():
    p = Pairs()
    for a, b in [(1.0, 1.02), (2.0, 2.0), (1.0, 1.10), (1.0, 0.98), (0.5, 0.51)]:
        p.add(a, b)
    assert p.ratios == pytest.approx([1.02, 1.0, 1.10, 0.98, 1.02])
    s = p.summary()
    assert s["n"] == 5
    assert s["ratio_median"] == pytest.approx(1.02)
    assert s["ratio_min"] == pytest.approx(0.98)
    assert s["ratio_max"] == pytest.approx(1.10)
    assert s["a_median"] == 1.0 and s["b_median"] == 1.02
    # the median of the ratios, not the ratio of the medians
    q = Pairs()
    for a, b in [(1.0, 2.0), (10.0, 10.0), (10.0, 10.0)]:
        q.add(a, b)
    assert q.summary()["ratio_median"] == 1.0


def test_pairs_cpu_time_and_wait_companions():
    p = Pairs()
    p.add(1.0, 1.5, cpu=(0.8, 0.84), wait=(0.2, 0.6))
    p.add(2.0, 2.0, cpu=(1.6, 1.6), wait=(0.0, 0.2))
    p.add(1.0, 1.0)                                 # no companions: ratios only
    s = p.summary()
    assert s["n"] == 3
    assert p.cpu_ratios == pytest.approx([1.05, 1.0])
    assert s["cpu_ratio_median"] == pytest.approx(1.025)
    assert (s["cpu_ratio_min"], s["cpu_ratio_max"]) == pytest.approx((1.0, 1.05))
    assert s["wait_a"] == pytest.approx(0.1)        # median of 20% and 0%
    assert s["wait_b"] == pytest.approx(0.25)       # median of 40% and 10%


def test_pairs_reject_non_positive_and_empty_summary():
    with pytest.raises(ValueError):
        Pairs().add(0.0, 1.0)
    s = Pairs().summary()
    assert s["n"] == 0 and s["ratio_median"] is None and s["ratio_min"] is None


def test_verdict():
    assert verdict(1.019, 1.02) == "PASS"
    assert verdict(1.02, 1.02) == "PASS"
    assert verdict(1.021, 1.02) == "MISS"
    assert verdict(None, 1.02) == "n/a"
    assert verdict(1.5, None) == "—"


def test_markdown_table_padding_and_alignment():
    t = markdown_table(["case", "ratio"], [["cpu", "1.010"], ["many threads", "0.9"]])
    lines = t.splitlines()
    assert lines[0] == "| case         | ratio |"
    assert lines[1] == "|--------------|------:|"
    assert lines[2] == "| cpu          | 1.010 |"
    assert lines[3] == "| many threads |   0.9 |"
    assert len({len(x) for x in lines}) == 1
    t2 = markdown_table(["a", "b"], [[None, 1]], align="ll")
    assert t2.splitlines()[1] == "|-----|-----|"
    assert t2.splitlines()[2] == "|     | 1   |"
    with pytest.raises(ValueError):
        markdown_table(["a", "b"], [["only one"]])


PYSPY_RAW = """\
thread (21114): MainThread;<module> (w.py:12);sl (w.py:5) 181
thread (21114): MainThread;<module> (w.py:12);cpu_work (w.py:4) 174
thread (21116): wrk;Thread._bootstrap (threading.py:995);Thread.run (threading.py:975);worker (w.py:8);sl (w.py:5) 253

Thread._bootstrap (threading.py:995);worker (w.py:8);cpu_work (w.py:4) 102
"""

PYOFFCPU_FOLDED = """\
process 7 python3;thread 7 main;main_loop (bench/workloads.py:170);_loop (bench/workloads.py:160);cpu_work (bench/workloads.py:137) 400000
process 7 python3;thread 7 main;main_loop (bench/workloads.py:170);_loop (bench/workloads.py:160);do_sleep (bench/workloads.py:143);clock_nanosleep;[off-cpu] 300000
process 7 python3;thread 7 main;main_loop (bench/workloads.py:170);_loop (bench/workloads.py:160);do_io (bench/workloads.py:153);[unknown] libc.so.6+0x1234;[off-cpu: runqueue] 300000
process 7 python3;thread 8 worker;worker_loop (bench/workloads.py:174);_loop (bench/workloads.py:160);cpu_work (bench/workloads.py:137) 5000
process 7 python3;thread 7 main;main (bench/workloads.py:210) 999999
"""


def test_parse_pyspy_raw():
    stacks = parse_folded(PYSPY_RAW)
    assert len(stacks) == 4
    frames, w = stacks[0]
    assert frames == ["thread (21114): MainThread", "<module> (w.py:12)", "sl (w.py:5)"]
    assert w == 181
    assert stacks[3][1] == 102
    assert [function_name(f) for f in stacks[2][0]] == [
        "thread (21116): wrk", "Thread._bootstrap", "Thread.run", "worker", "sl"]


def test_parse_folded_rejects_garbage():
    with pytest.raises(ValueError):
        parse_folded("a;b;c\n")
    with pytest.raises(ValueError):
        parse_folded("a;b 12.5\n")


def test_function_name():
    assert function_name("cpu_work (bench/workloads.py:137)") == "cpu_work"
    assert function_name("Thread.run (threading.py:975)") == "Thread.run"
    assert function_name("<module> (w.py:?)") == "<module>"
    assert function_name("clock_nanosleep") == "clock_nanosleep"
    assert function_name("[off-cpu: runqueue]") == "[off-cpu: runqueue]"
    assert function_name("thread (21114): MainThread") == "thread (21114): MainThread"


def test_function_shares_inclusive_in_scope():
    fns = ("cpu_work", "do_sleep", "do_io", "wait_lock")
    shares, total = function_shares(parse_folded(PYOFFCPU_FOLDED), "main_loop", fns)
    assert total == 1_000_000           # the stack outside main_loop is left out
    assert shares == pytest.approx({"cpu_work": 0.4, "do_sleep": 0.3, "do_io": 0.3, "wait_lock": 0.0})
    shares, total = function_shares(parse_folded(PYSPY_RAW), "worker", ("sl", "cpu_work"))
    assert total == 355
    assert shares["sl"] == pytest.approx(253 / 355)
    assert function_shares([], "nowhere", fns) == ({f: 0.0 for f in fns}, 0)


def test_max_error_pp():
    truth = {"a": 0.40, "b": 0.60}
    assert max_error_pp({"a": 0.41, "b": 0.585}, truth) == pytest.approx(1.5)
    assert max_error_pp({"a": 0.40}, truth) == pytest.approx(60.0)


def test_fdinfo_and_prog_delta():
    info = parse_fdinfo("pos:\t0\nflags:\t02000002\nprog_type:\t5\nrun_time_ns:\t12345\nrun_cnt:\t17\n")
    assert info["prog_type"] == "5" and info["run_time_ns"] == "12345" and info["run_cnt"] == "17"
    d = prog_delta({"sched": (10, 1000)}, {"sched": (30, 5000), "sample": (2, 100)})
    assert d == {"sched": (20, 4000), "sample": (2, 100)}


def test_formatters():
    assert harness.fmt_num(None) == "n/a"
    assert harness.fmt_num(1.23456) == "1.235"
    assert harness.fmt_ratio_range(0.98, 1.1) == "0.980–1.100"
    assert harness.fmt_bytes(3 << 20) == "3 MiB"


def test_prog_label():
    assert harness.prog_label("sched__sched_sw") == "sched_switch (tracepoint)"
    assert harness.prog_label("sched_switch") == "sched_switch (raw tracepoint)"
    assert harness.prog_label("on_cpu_sample") == "on_cpu_sample (perf_event)"
    assert harness.prog_label("other") == "other"


# -- case 9: long runs ------------------------------------------------------------------------
STATUS = """Name:\tpyoffcpu
Umask:\t0022
State:\tS (sleeping)
VmHWM:\t  208000 kB
VmRSS:\t  203456 kB
Threads:\t3
"""


def test_proc_status_and_stat():
    assert proc_status_kib(STATUS, "VmRSS") == 203456
    assert proc_status_kib(STATUS, "VmHWM") == 208000
    assert proc_status_kib(STATUS, "Threads") == 3
    assert proc_status_kib(STATUS, "VmSwap") is None
    # the command name may hold spaces and parentheses; utime, stime are fields 14, 15
    stat = "4242 (py (x) y) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 3 0 123 456 789"
    assert proc_stat_cpu_ticks(stat) == 325


def test_parse_stats_lines_skips_partial_and_junk():
    text = ('{"t": 1.0, "rss_kib": 200000, "maps": {"agg": 10}, "drops": {}, "stacks": 5, "threads": 2}\n'
            '\n'
            'not json\n'
            '[1, 2]\n'
            '{"rss_kib": 1}\n'
            '{"t": 2.0, "rss_kib": 201000, "maps": {"agg": 12}, "drops": {"agg full": 1}}\n'
            '{"t": 3.0, "rss_k')                                    # half written
    recs = parse_stats_lines(text)
    assert [r["t"] for r in recs] == [1.0, 2.0]
    assert recs[1]["drops"] == {"agg full": 1}
    assert latest_before(recs, 1.5)["t"] == 1.0
    assert latest_before(recs, 2.0)["t"] == 2.0
    assert latest_before(recs, 0.5) is None


def test_checkpoints():
    assert checkpoints(600) == [10, 60, 120, 180, 240, 300, 360, 420, 480, 540, 598]
    assert checkpoints(120) == [10, 60, 118]
    assert checkpoints(60) == [10, 58]
    assert checkpoints(61) == [10, 59]          # 60 would race the stop
    assert checkpoints(5) == [3]
    assert checkpoints(1) == []
    for d in (30, 62.5, 119, 121, 200):
        pts = checkpoints(d)
        assert pts == sorted(pts) and pts[-1] <= d - 2
        assert all(b - a >= 2 for a, b in zip(pts, pts[1:]))


def test_rss_growth_after_the_first_minute():
    flat = [(10, 150.0), (60, 200.0), (120, 230.0), (180, 210.0)]
    assert rss_growth(flat) == 30.0                 # the largest later value, not the last
    assert rss_growth([(10, 150.0), (62, 200.0), (118, 380.0)]) == 180.0
    assert rss_growth([(10, 150.0), (58, 200.0)]) is None        # no minute mark
    assert rss_growth([(10, 150.0), (60, 200.0)]) is None        # nothing after it
    assert rss_growth([(10, 150.0), (90, 200.0), (150, 250.0)]) is None   # too far from 60 s
    assert rss_growth([(60, 300.0), (120, 250.0)]) == -50.0


def test_linear_slope():
    assert linear_slope([(0, 1.0), (1, 3.0), (2, 5.0)]) == pytest.approx(2.0)
    assert linear_slope([(10, 5.0), (20, 5.0)]) == pytest.approx(0.0)
    assert linear_slope([(1, 1.0)]) is None
    assert linear_slope([(1, 1.0), (1, 2.0)]) is None


def test_folded_summary():
    lines = [
        "process 7 python3;thread 7 main;serve_forever (socketserver.py:1) 100\n",
        "process 7 python3;thread 8 python3;process_request_thread (socketserver.py:2);[off-cpu] 5\n",
        "process 7 python3;thread 8 python3;do_GET (w.py:3) 7\n",
        "\n",
        "process 7 python3;threads 1200 ended python3;do_GET (w.py:3) 9\n",
        "process 9 python3;[truncated] 1\n",
    ]
    assert folded_summary(lines) == {"lines": 5, "threads": 2, "processes": 2}
    assert folded_summary([]) == {"lines": 0, "threads": 0, "processes": 0}


def test_parse_drops_line():
    assert parse_drops_line("pyoffcpu: drops: none") == {}
    assert parse_drops_line("pyoffcpu: drops: agg full 12, user stack 3") == {"agg full": 12, "user stack": 3}
    assert parse_drops_line("pyoffcpu: recorded 1.0 s") is None


def test_parse_drop_defines():
    header = """#define MAX_PY_DEPTH 64
#define DROP_USTACK        0        /* bpf_get_stackid(user) failed */
#define DROP_AGG_FULL      4        /* the aggregation map was full: time lost */
#define N_DROPS            9
"""
    assert parse_drop_defines(header) == {0: "ustack", 4: "agg full"}


def test_fmt_clock_and_counts_by_checkpoint():
    assert fmt_clock(10) == "0:10"
    assert fmt_clock(598.4) == "9:58"
    assert fmt_clock(60) == "1:00"
    rows = counts_by_checkpoint([{"agg": 10, "ustacks": 5}, {"agg": 12, "thread_names": 7}])
    assert rows == [("agg", [10, 12]), ("ustacks", [5, None]), ("thread_names", [None, 7])]
    assert counts_by_checkpoint([]) == []


def _longrun(hook: bool) -> dict:
    readings = []
    for t, rss in ((10.2, 210), (60.1, 348), (88.0, 397)):
        r = {"t": t, "rss_kib": rss * 1024, "hwm_kib": rss * 1024, "cpu_pct": 5.0, "served_rate": 1900.0,
             "server_threads": 4, "bench_maps": {"agg": 100, "thread_names": int(t * 300)},
             "bench_drops": {"nstack incomplete": int(t)}}
        if hook:
            r["hook"] = {"t": t - 0.5, "rss_kib": rss * 1024, "maps": {"agg": 90, "thread_names": 5},
                         "drops": {"native stack incomplete": 3}, "stacks": 1000, "threads": 12}
        readings.append(r)
    return {"seconds": 90.0, "rate_target": 2000.0, "client_threads": 8, "readings": readings,
            "samples": [(r["t"], r["rss_kib"]) for r in readings],
            "maps_source": "PYOFFCPU_STATS_FILE" if hook else "bench",
            "capacity": {"agg": 65536, "thread_names": 65536}, "served_rate": 1865.0, "served_total": 248480,
            "hwm_kib": 1495 * 1024, "teardown_s": 44.5, "final_drops": {"python read": 1},
            "folded": {"lines": 518014, "threads": 32314, "processes": 1}, "folded_bytes": 303735086,
            "growth_mib": 49.0, "slope_mib_min": 152.8, "late_slope_mib_min": 105.0, "late_s": 27.9,
            "pid_max": 32768, "client": {"ok": 1, "errors": 0}}


def test_render_longrun_with_and_without_the_stats_file():
    import case_allprocs  # noqa: F401
    import case_longrun  # noqa: F401
    import common  # noqa: F401
    import run  # noqa: F401
    text = "\n".join(case_longrun.render_longrun(_longrun(hook=False), None))
    assert "counted by the bench" in text
    assert "| thread_names |    65536 | 3060 | 18030 | 26400 |" in text
    assert "nstack incomplete" in text and "**PASS**" in text
    assert "518014 lines, 290 MiB, 32314 thread roots" in text
    assert "would grow 945 MiB after its first minute (MISS projected)" in text
    assert "TIDs come round every 18 s" in text
    text = "\n".join(case_longrun.render_longrun(_longrun(hook=True), None))
    assert "(from PYOFFCPU_STATS_FILE)" in text
    assert "| thread_names |    65536 |    5 |    5 |    5 |" in text
    assert "native stack incomplete" in text and "nstack incomplete" not in text
    assert "|        1000 |           12 |     3 |" in text
    rows = run.targets_summary(common.Results(longrun=_longrun(hook=True)))
    assert rows[-1][1:] == ["<= 150", "49", "PASS"]


# -- case 6, 10 and 11 helpers -------------------------------------------------------------------
def test_spread_loss_and_rounds():
    assert harness.spread([3.0, None, 1.0, 2.0]) == {"n": 3, "median": 2.0, "min": 1.0, "max": 3.0}
    assert harness.spread([None]) == {"n": 0, "median": None, "min": None, "max": None}
    assert harness.loss(97.0, 100.0) == pytest.approx(0.03)
    assert harness.loss(110.0, 100.0) == pytest.approx(-0.10)
    assert harness.loss(None, 100.0) is None and harness.loss(1.0, 0.0) is None
    rounds = [{"alone": 100.0, "wall": 90.0}, {"alone": 200.0}, {"alone": 50.0, "wall": 49.0}]
    assert harness.per_round_losses(rounds, "alone", "wall") == pytest.approx([0.10, 0.02])
    assert harness.rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert harness.rotated([], 3) == []
    assert harness.fmt_pct(0.031) == "+3.1%" and harness.fmt_pct(-0.1) == "-10.0%"
    assert harness.fmt_pct(None) == "n/a"
    assert harness.fmt_range(0.4271, 0.7869) == "0.43–0.79" and harness.fmt_range(None, 1) == "n/a"


def test_maps_memlock_counts_each_map_once():
    m1 = "pos:\t0\nflags:\t02000002\nmap_type:\t1\nmemlock:\t4096\nmap_id:\t7\n"
    m2 = "pos:\t0\nmap_type:\t2\nmemlock:\t100\nmap_id:\t9\n"
    prog = "pos:\t0\nprog_type:\t17\nprog_id:\t3\n"
    assert harness.maps_memlock([m1, m2, m1, prog]) == (2, 4196)
    assert harness.maps_memlock([]) == (0, 0)


# -- case 12 helpers (tools/bench/case_allprocs.py) ----------------------------------------------------------
SYSTEM_WIDE_STDERR = """pyoffcpu: recording every process (cpu mode, 99 Hz, 20 s)
pyoffcpu: notice: -a: 186 processes, 105 Python interpreters found (84 processes without one)
pyoffcpu: notice: 51 samples of 16 Python processes came before they were registered: native frames only
pyoffcpu: recorded 20.0 s of system-wide (181 processes, CPython 3.11.2, 3.11.7, 3.9.18): 403 samples, 0.00 s off-CPU
pyoffcpu: drops: none
"""


def test_parse_system_wide():
    import case_allprocs  # noqa: F401
    import case_longrun  # noqa: F401
    import common  # noqa: F401
    import run  # noqa: F401
    d = case_allprocs.parse_system_wide(SYSTEM_WIDE_STDERR)
    assert (d["processes"], d["pythons"], d["without"]) == (186, 105, 84)
    assert (d["late_samples"], d["late_processes"]) == (51, 16)
    assert d["recorded_processes"] == 181
    assert d["versions"] == ["3.11.2", "3.11.7", "3.9.18"]
    d = case_allprocs.parse_system_wide("pyoffcpu: recorded 1.0 s of system-wide (3 processes): 0 samples\n")
    assert d["processes"] is None and d["late_samples"] == 0
    assert d["recorded_processes"] == 3 and d["versions"] == []
    assert case_allprocs.parse_system_wide("")["recorded_processes"] is None


def test_process_roots_python_frames():
    import case_allprocs  # noqa: F401
    import case_longrun  # noqa: F401
    import common  # noqa: F401
    import run  # noqa: F401
    folded = [
        "process 10 python3.11;thread 10 python3.11;_start;idle_sleep_loop (fleet.py:77);blip (fleet.py:70) 3000",
        "process 10 python3.11;thread 10 python3.11;_start;clock_nanosleep;hrtimer_nanosleep_[k] 1000",
        "process 11 (ns 4) python3.9;thread 11 (ns 4) python3.9;[unknown] python3.9+0x1234 500",
        # a comm with parentheses, no Python frame: the roots are not frames
        "process 12 (sd-pam);thread 12 (sd-pam);epoll_wait 10",
        "process 13 python;threads 4 ended in worker;run (<frozen runpy>:?) 20",
        "process 14 python;thread 14 x;f (a.py:1) 7",
        "process 14 python;thread 14 x;f (a.py:1) 8",
        "thread 15 x;f (a.py:1) 9",                     # no process root: skipped
        "garbage",
        "",
    ]
    roots = case_allprocs.process_roots(folded)
    assert set(roots) == {10, 11, 12, 13, 14}
    assert roots[10] == {"stacks": 2, "weight": 4000, "python_stacks": 1, "python_weight": 3000}
    assert roots[11]["stacks"] == 1 and roots[11]["python_stacks"] == 0
    assert roots[12]["python_stacks"] == 0
    assert roots[13]["python_stacks"] == 1
    assert roots[14] == {"stacks": 2, "weight": 15, "python_stacks": 2, "python_weight": 15}


def test_all_pythons_paths_and_pyenv(tmp_path, monkeypatch):
    import case_allprocs  # noqa: F401
    import case_longrun  # noqa: F401
    import common  # noqa: F401
    import run  # noqa: F401
    exe = tmp_path / "versions" / "3.12.1" / "bin" / "python3.12"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    monkeypatch.setenv("PATH", "/nonexistent")            # no pyenv to ask: $PYENV_ROOT's versions
    found, missing = case_allprocs.all_pythons(f"pyenv:3.12.1, {exe}, /nonexistent/python9, pyenv:2.1.0,")
    assert found == [str(exe), str(exe)]
    assert missing == ["/nonexistent/python9", "pyenv:2.1.0"]


def _allprocs(with_pairs=True):
    pairs = {"n": 10, "a_median": 1.0, "b_median": 1.004, "ratio_median": 1.004, "ratio_min": 0.97,
             "ratio_max": 1.08, "cpu_ratio_median": 1.0, "cpu_ratio_min": 0.9, "cpu_ratio_max": 1.1,
             "wait_a": 0.01, "wait_b": 0.02}
    d = {"procs": 50, "seconds": 20.0, "pairs": 10, "pythons": ["/py/3.9", "/usr/bin/python3.11"],
         "missing": ["pyenv:3.13.0"], "settle_s": 2.0, "window_s": 10.0,
         "fleet": {"parent": 1, "long": [{"pid": 2, "python": "/py/3.9", "version": "3.9.18", "role": "busy"},
                                         {"pid": 3, "python": "/usr/bin/python3.11", "version": "3.11.2",
                                          "role": "idle-sleep"}],
                   "short_alive": 2, "short_every": 0.5, "short_life": 1.0},
         "recording": {"first": 0.9, "recording": 0.95, "hwm_mib": 76.4, "maxrss_mib": 76.0, "cpu_s": 5.1,
                       "total_s": 22.0, "stop_s": 1.05, "startup_cpu_s": 0.97, "first_share": 0.2,
                       "window_share": 0.1371, "processes": 186, "pythons": 105, "without": 84,
                       "late_samples": 0, "late_processes": 0, "recorded_processes": 181,
                       "versions": ["3.11.2", "3.9.18"],
                       "per_python": {"/py/3.9 (3.9.18)": {"n": 1, "sampled": 1, "python": 1, "busy": 1},
                                      "/usr/bin/python3.11 (3.11.2)": {"n": 1, "sampled": 0, "python": 0,
                                                                       "busy": 0}},
                       "shorts": {"n": 38, "sampled": 37, "python": 36}, "roots": 60, "other_roots": 20}}
    if with_pairs:
        d.update(n_work=6000, repeats=5, ab={**pairs, "failures": 0}, aa={**pairs, "ratio_median": 0.998},
                 ab_fast=dict(pairs), aa_fast=dict(pairs))
    return d


def test_render_allprocs_and_targets():
    import case_allprocs  # noqa: F401
    import case_longrun  # noqa: F401
    import common  # noqa: F401
    import run  # noqa: F401
    text = "\n".join(case_allprocs.render_allprocs(_allprocs()))
    assert "beside 50 Python processes" in text
    assert "| own CPU, 2–12 s after `recording` (% of one core) " in text
    assert "|               13.71 |    <= 1 | MISS |" in text
    assert "(not found, left out: pyenv:3.13.0)" in text
    assert "-a: 186 processes, 105 Python interpreters found (84 processes without one)" in text
    assert "of the 2 long-lived processes 1 sampled, 1 with Python frames" in text
    assert "| /usr/bin/python3.11 (3.11.2)   |         1 |            0 |            0 |" in text
    assert "0.998 (0.970–1.080)" in text
    rows = run.targets_summary(common.Results(allprocs=_allprocs()))
    assert rows[0][1:] == ["<= 1%", "13.71%", "MISS"]
    assert rows[1][1:] == ["<= 1.01", "1.004", "PASS"]
    rows = run.targets_summary(common.Results(allprocs=_allprocs(with_pairs=False)))
    assert len(rows) == 1
    assert "Slowdown" not in "\n".join(case_allprocs.render_allprocs(_allprocs(with_pairs=False)))


# -- case 16 (tools/bench/case_py315.py): Tachyon's collapsed stacks ------------------------------------
def test_tachyon_collapsed_stacks_read_as_folded_frames():
    """`python3.15 -m profiling.sampling --collapsed` writes `tid:N;file:qualname:line;...
    COUNT`; the accuracy case reads them as `qualname (file:line)` frames, so that
    function_shares finds its loops and functions in them as in pyoffcpu's."""
    import case_py315
    text = ("tid:7;workloads.py:main_loop:218;workloads.py:cpu_work:170 30\n"
            "tid:7;workloads.py:main_loop:218;workloads.py:do_sleep:177 10\n"
            "tid:8;threading.py:Thread.run:1012;workloads.py:worker_loop:224 5\n")
    stacks = harness.parse_folded(case_py315._collapsed_to_folded(text))
    assert stacks[0] == (["tid:7", "main_loop (workloads.py:218)", "cpu_work (workloads.py:170)"], 30)
    assert stacks[2][0][1] == "Thread.run (threading.py:1012)"
    shares, total = harness.function_shares(stacks, "main_loop", ["cpu_work", "do_sleep"])
    assert total == 40 and shares == {"cpu_work": 0.75, "do_sleep": 0.25}
