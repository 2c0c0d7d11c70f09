"""The bench harness's pure parts (tools/bench/harness.py): statistics, verdicts,
Markdown tables, folded parsing of pyoffcpu's and py-spy's output. No root,
no BPF, no profiler; well under a second."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "bench"))

import harness  # noqa: E402
from harness import (Pairs, function_name, function_shares, markdown_table, max_error_pp,  # noqa: E402
                     median, parse_fdinfo, parse_folded, prog_delta, verdict)


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
