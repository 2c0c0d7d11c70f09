"""Exporters: folded text, speedscope JSON, SVG flame graph, atomic writes."""
import json
import os
import re
import stat
import time
import xml.etree.ElementTree as ET

import pytest

from pyoffcpu import export
from pyoffcpu.export import FORMATS, check_writable, format_for_path, write_profile
from pyoffcpu.export.folded import render_folded
from pyoffcpu.export.speedscope import render_speedscope
from pyoffcpu.export.svg import render_svg
from pyoffcpu.profile.model import (OFF_RUNQUEUE, OFF_SLEEP, OFF_DISK, TRUNCATED, Profile,
                                    StackKey, from_folded, kernel_frame, native_frame, python_frame)

SVG_NS = "{http://www.w3.org/2000/svg}"
SITE = "/usr/lib/python3.11/site-packages/app/cli.py"
MAIN = python_frame("main", SITE, 10)
WORK = python_frame("work", SITE, 20)
NANOSLEEP = native_frame("clock_nanosleep", module="/lib/x86_64-linux-gnu/libc.so.6")
KSLEEP = kernel_frame("do_nanosleep")


def known_profile() -> Profile:
    p = Profile()
    p.processes = {100: "python3", 200: "worker-proc"}
    p.threads = {100: "MainThread", 101: "worker"}
    p.add(StackKey(100, 100, (MAIN, WORK)), 1_500_000)
    p.add(StackKey(100, 101, (MAIN, WORK)), 2_500)                       # 2.5 us -> 3 (half up)
    p.add(StackKey(100, 100, (MAIN, NANOSLEEP, KSLEEP), OFF_SLEEP), 1_499)   # -> 1
    p.add(StackKey(100, 101, (MAIN, NANOSLEEP, KSLEEP), OFF_SLEEP), 400)     # -> 1 (never 0)
    p.add(StackKey(100, 101, (TRUNCATED, WORK), OFF_RUNQUEUE), 400)
    p.add(StackKey(100, 100, (TRUNCATED, WORK), OFF_RUNQUEUE), 400)
    p.add(StackKey(100, 100, (MAIN,), OFF_DISK), 999_499)
    p.add(StackKey(200, 201, (native_frame("start_thread"),)), 7_000)     # thread without a name
    return p


EXPECTED_FOLDED = """\
process 100 python3;thread 100 MainThread;[truncated];work (app/cli.py:20);[off-cpu: runqueue] 1
process 100 python3;thread 100 MainThread;main (app/cli.py:10);[off-cpu: disk] 999
process 100 python3;thread 100 MainThread;main (app/cli.py:10);clock_nanosleep;do_nanosleep_[k];[off-cpu: sleep] 1
process 100 python3;thread 100 MainThread;main (app/cli.py:10);work (app/cli.py:20) 1500
process 100 python3;thread 101 worker;[truncated];work (app/cli.py:20);[off-cpu: runqueue] 1
process 100 python3;thread 101 worker;main (app/cli.py:10);clock_nanosleep;do_nanosleep_[k];[off-cpu: sleep] 1
process 100 python3;thread 101 worker;main (app/cli.py:10);work (app/cli.py:20) 3
process 200 worker-proc;thread 201 ?;start_thread 7
"""

# Threads merged *before* rounding: 1_502_500 ns -> 1503, 1_899 -> 2, 800 -> 1.
EXPECTED_FOLDED_NO_THREADS = """\
process 100 python3;[truncated];work (app/cli.py:20);[off-cpu: runqueue] 1
process 100 python3;main (app/cli.py:10);[off-cpu: disk] 999
process 100 python3;main (app/cli.py:10);clock_nanosleep;do_nanosleep_[k];[off-cpu: sleep] 2
process 100 python3;main (app/cli.py:10);work (app/cli.py:20) 1503
process 200 worker-proc;start_thread 7
"""


# -- folded -------------------------------------------------------------------
def test_folded_exact():
    assert render_folded(known_profile()) == EXPECTED_FOLDED


def test_folded_no_threads_merges_before_rounding():
    assert render_folded(known_profile(), threads=False) == EXPECTED_FOLDED_NO_THREADS


def test_folded_full_paths():
    out = render_folded(known_profile(), full_paths=True)
    assert (f"process 100 python3;thread 100 MainThread;main ({SITE}:10);work ({SITE}:20) 1500\n"
            in out.splitlines(keepends=True))
    assert "(app/cli.py:" not in out


def test_folded_round_trip():
    for threads in (True, False):
        first = render_folded(known_profile(), threads=threads)
        again = render_folded(from_folded(first), threads=threads)
        assert again == first


def test_folded_labels_never_break_a_line_for_any_reader():
    """A target names its functions: every line boundary str.splitlines
    knows (not only \\n) becomes a space, so one stack stays one line."""
    p = Profile()
    p.processes, p.threads = {7: "app\u2028x"}, {7: "T\x1cy"}
    breaks = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"
    p.add(StackKey(7, 7, (python_frame("f" + breaks + "g", "/a.py", 1),)), 5_000)
    out = render_folded(p)
    assert len(out.splitlines()) == 1 and out.count("\n") == 1, repr(out)
    assert [k.frames[-1].name for k in from_folded(out).weights] == ["f" + " " * len(breaks) + "g"]


def test_folded_empty_profile():
    assert render_folded(Profile()) == ""


def test_folded_from_text_identity():
    text = ("process 7 app;thread 7 MainThread;a (x.py:1);b (x.py:2) 10\n"
            "process 7 app;thread 8 T-1;a (x.py:1);[off-cpu: lock] 5\n")
    assert render_folded(from_folded(text)) == text
    assert render_folded(from_folded(text), threads=False) == (
        "process 7 app;a (x.py:1);[off-cpu: lock] 5\n"
        "process 7 app;a (x.py:1);b (x.py:2) 10\n")
    # files of versions before reasons: a plain `[off-cpu]` reads as other
    old = from_folded("process 7 app;thread 8 T-1;a (x.py:1);[off-cpu] 5\n")
    assert [k.off_cpu for k in old.weights] == ["other"]


# -- speedscope ---------------------------------------------------------------
FRAMES = [
    {"name": "main", "file": "app/cli.py", "line": 10},
    {"name": "work", "file": "app/cli.py", "line": 20},
    {"name": "[off-cpu: disk]"},
    {"name": "[truncated]"},
    {"name": "[off-cpu: runqueue]"},
    {"name": "clock_nanosleep"},
    {"name": "do_nanosleep_[k]"},
    {"name": "[off-cpu: sleep]"},
    {"name": "start_thread"},
]


def test_speedscope_per_thread():
    doc = json.loads(render_speedscope(known_profile()))
    assert doc["$schema"] == "https://www.speedscope.app/file-format-schema.json"
    assert doc["exporter"] == "pyoffcpu"
    assert doc["shared"]["frames"] == FRAMES
    profs = doc["profiles"]
    assert [p["name"] for p in profs] == [
        "MainThread (tid 100) in python3 (pid 100)",
        "worker (tid 101) in python3 (pid 100)",
        "? (tid 201) in worker-proc (pid 200)",
    ]
    for p in profs:
        assert p["type"] == "sampled"
        assert p["unit"] == "nanoseconds"
        assert p["startValue"] == 0
        assert p["endValue"] == sum(p["weights"])
        assert len(p["samples"]) == len(p["weights"])
    assert profs[0]["samples"] == [[0, 1], [0, 2], [3, 1, 4], [0, 5, 6, 7]]
    assert profs[0]["weights"] == [1_500_000, 999_499, 400, 1_499]
    assert profs[1]["samples"] == [[0, 1], [3, 1, 4], [0, 5, 6, 7]]
    assert profs[1]["weights"] == [2_500, 400, 400]
    assert profs[2]["samples"] == [[8]]
    assert profs[2]["weights"] == [7_000]
    assert profs[0]["endValue"] == 1_500_000 + 400 + 1_499 + 999_499


def test_speedscope_per_process():
    doc = json.loads(render_speedscope(known_profile(), threads=False))
    assert doc["shared"]["frames"] == FRAMES
    profs = doc["profiles"]
    assert [p["name"] for p in profs] == ["python3 (pid 100)", "worker-proc (pid 200)"]
    assert profs[0]["samples"] == [[0, 1], [0, 2], [3, 1, 4], [0, 5, 6, 7]]
    assert profs[0]["weights"] == [1_502_500, 999_499, 800, 1_899]
    assert profs[0]["endValue"] == 1_502_500 + 800 + 1_899 + 999_499
    assert profs[1]["weights"] == [7_000]


def test_speedscope_full_paths_and_unknown_line():
    p = Profile()
    p.processes = {1: "x"}
    p.add(StackKey(1, 1, (python_frame("f", "/abs/dir/m.py", None),)), 10)
    doc = json.loads(render_speedscope(p, full_paths=True))
    assert doc["shared"]["frames"] == [{"name": "f", "file": "/abs/dir/m.py"}]


# -- SVG ----------------------------------------------------------------------
def _frames(svg_text):
    """{label: (data-w, width, fill)} for each drawn frame."""
    root = ET.fromstring(svg_text.encode("utf-8"))
    out = {}
    for g in root.iter(SVG_NS + "g"):
        if g.get("class") != "f":
            continue
        tip = g.find(SVG_NS + "title").text
        label = tip[:tip.rindex(" \u2014 ")]
        rect = g.find(SVG_NS + "rect")
        assert label not in out, label
        out[label] = (int(g.get("data-w")), float(rect.get("width")), rect.get("fill"), tip,
                      float(rect.get("x")), float(rect.get("y")))
    return root, out


def _rgb(fill):
    m = re.fullmatch(r"rgb\((\d+),(\d+),(\d+)\)", fill)
    assert m, fill
    return tuple(int(v) for v in m.groups())


def _is_blue(fill):
    r, g, b = _rgb(fill)
    return b >= 200 and b > r + 60 and b > g + 20


def _is_warm(fill):
    r, g, b = _rgb(fill)
    return r >= 160 and r > b + 80


def test_svg_well_formed_with_all_labels():
    p = known_profile()
    weird = python_frame("<lambda> & \"q\" 'x' \u00fcn\u00efc\u00f6de \u2603", "a<b>.py", 3)
    ctrl = native_frame("bad\x01name\ud800")
    p.add(StackKey(100, 100, (MAIN, weird, ctrl)), 1_000_000)
    text = render_svg(p)
    root, frames = _frames(text)
    assert root.tag == SVG_NS + "svg"
    expected = {"all", "process 100 python3", "process 200 worker-proc",
                "thread 100 MainThread", "thread 201 ?",
                "main (app/cli.py:10)", "work (app/cli.py:20)",
                "[off-cpu: disk]",
                "<lambda> & \"q\" 'x' \u00fcn\u00efc\u00f6de \u2603 (a<b>.py:3)",
                "bad\ufffdname\ufffd", "start_thread"}
    assert expected <= set(frames)
    # tiny frames (below 0.1%) are not drawn
    assert "[truncated]" not in frames and "do_nanosleep_[k]" not in frames
    assert "thread 101 worker" not in frames             # 3.3 us of 3.5 ms
    assert "<script" in text and "]]></script>" in text


def test_svg_widths_proportional_and_tiny_frames_keep_weight():
    text = ("process 1 app;thread 1 T;main (a.py:1);cpu_work (a.py:2) 250000\n"
            "process 1 app;thread 1 T;main (a.py:1);other (a.py:3) 749000\n"
            "process 1 app;thread 1 T;main (a.py:1);tiny (a.py:4) 999\n"
            "process 1 app;thread 1 T;main (a.py:1);tinier (a.py:5) 1\n")
    _, frames = _frames(render_svg(from_folded(text)))
    all_w = frames["all"][1]
    assert abs(frames["cpu_work (a.py:2)"][1] / all_w - 0.25) < 0.0005
    assert abs(frames["other (a.py:3)"][1] / all_w - 0.749) < 0.0005
    assert "tiny (a.py:4)" not in frames                 # 0.0999% < 0.1%
    assert "tinier (a.py:5)" not in frames
    assert frames["main (a.py:1)"][0] == 1_000_000_000   # but main keeps their weight
    assert frames["main (a.py:1)"][1] == pytest.approx(all_w, abs=0.01)
    assert frames["cpu_work (a.py:2)"][3].startswith("cpu_work (a.py:2) \u2014 250.0 ms (25.0%), ")
    # root at the bottom: deeper frames are higher up
    assert frames["cpu_work (a.py:2)"][5] < frames["main (a.py:1)"][5] < frames["all"][5]
    # siblings are laid side by side in label order
    assert frames["cpu_work (a.py:2)"][4] < frames["other (a.py:3)"][4]


def test_svg_tooltip_numbers():
    text = ("process 1 app;thread 1 T;f (a.py:1) 1230000\n"
            "process 1 app;thread 1 T;f (a.py:1);[off-cpu] 1470000\n")
    _, frames = _frames(render_svg(from_folded(text)))
    assert frames["f (a.py:1)"][3] == (
        "f (a.py:1) \u2014 2.70 s (100.0%), on-CPU 1.23 s / off-CPU 1.47 s")


def test_svg_colours():
    text = ("process 1 app;thread 1 T;main (a.py:1);wait (a.py:2);[off-cpu: lock] 400000\n"
            "process 1 app;thread 1 T;main (a.py:1);spin (a.py:3) 300000\n"
            "process 1 app;thread 1 T;main (a.py:1);memcpy 100000\n"
            "process 1 app;thread 1 T;main (a.py:1);read;sys_read_[k] 100000\n"
            "process 1 app;thread 1 T;main (a.py:1);read;sys_read_[k];[off-cpu: disk] 100000\n")
    _, f = _frames(render_svg(from_folded(text)))
    fill = {k: v[2] for k, v in f.items()}
    # off-CPU only frames and markers are blue
    for label in ("wait (a.py:2)", "[off-cpu: lock]", "[off-cpu: disk]"):
        assert _is_blue(fill[label]), (label, fill[label])
    # on-CPU and mixed frames are warm
    for label in ("main (a.py:1)", "spin (a.py:3)", "memcpy", "read", "sys_read_[k]"):
        assert _is_warm(fill[label]), (label, fill[label])
    # Python yellow/orange, native red, kernel brown: different hue families
    r, g, b = _rgb(fill["spin (a.py:3)"])
    assert r >= 235 and 150 <= g <= 230 and b <= 70
    r, g, b = _rgb(fill["memcpy"])
    assert r >= 200 and g <= 110
    r, g, b = _rgb(fill["sys_read_[k]"])
    assert 160 <= r <= 205 and 95 <= g <= 140
    # roots grey
    for label in ("all", "process 1 app", "thread 1 T"):
        r, g, b = _rgb(fill[label])
        assert abs(r - g) <= 1 and abs(b - r) <= 5, (label, fill[label])
    # deterministic per function, independent of the line
    text2 = ("process 1 app;thread 1 T;main (a.py:99);spin (a.py:77) 300000\n"
             "process 1 app;thread 1 T;other (b.py:1) 300000\n")
    _, f2 = _frames(render_svg(from_folded(text2)))
    assert f2["main (a.py:99)"][2] == fill["main (a.py:1)"]
    assert f2["spin (a.py:77)"][2] == fill["spin (a.py:3)"]


def test_svg_titles():
    p = from_folded("process 4242 python3;thread 4242 MainThread;f (a.py:1) 10\n")
    text = render_svg(p, title="pyoffcpu: pid 4242 python3 \u2014 wall mode, 10.0 s, 99 Hz & <more>")
    root = ET.fromstring(text.encode())
    title = [t for t in root.iter(SVG_NS + "text") if t.get("id") == "title"][0]
    assert title.text == "pyoffcpu: pid 4242 python3 \u2014 wall mode, 10.0 s, 99 Hz & <more>"
    p.meta.target = "pid 4242"
    p.meta.duration_s = 10.0
    p.meta.frequency_hz = 99
    root = ET.fromstring(render_svg(p).encode())
    title = [t for t in root.iter(SVG_NS + "text") if t.get("id") == "title"][0]
    assert title.text == "pyoffcpu: pid 4242 python3 \u2014 wall mode, 10.0 s, 99 Hz"


def test_svg_no_threads_and_empty():
    _, frames = _frames(render_svg(known_profile(), threads=False))
    assert not any(k.startswith("thread ") for k in frames)
    assert frames["main (app/cli.py:10)"][0] == 1_502_500 + 1_899 + 999_499
    root = ET.fromstring(render_svg(Profile()).encode())
    assert "No samples" in "".join(root.itertext())


def test_svg_many_stacks_fast():
    p = Profile()
    p.processes = {1: "app"}
    p.threads = {1: "MainThread", 2: "worker"}
    mods = [f"/srv/app/mod{i}.py" for i in range(50)]
    for i in range(50_000):
        frames = tuple(python_frame(f"fn{(i >> s) % 7}_{s}", mods[(i + s) % 50], s)
                       for s in range(0, 30, 2))
        p.add(StackKey(1, 1 + i % 2, frames, OFF_SLEEP if i % 3 == 0 else None), 1000 + i)
    t0 = time.monotonic()
    text = render_svg(p)
    elapsed = time.monotonic() - t0
    ET.fromstring(text.encode())
    assert elapsed < 20, elapsed
    assert len(text) < 5_000_000


# -- writing ------------------------------------------------------------------
def test_formats_and_extensions():
    assert FORMATS == {"svg", "speedscope", "folded", "pprof"}
    assert format_for_path("out.svg") == "svg"
    assert format_for_path("/tmp/x/OUT.SVG") == "svg"
    assert format_for_path("a.json") == "speedscope"
    assert format_for_path("a.folded") == "folded"
    assert format_for_path("a.txt") == "folded"
    assert format_for_path("a.pb.gz") == "pprof"
    for bad in ("a.pdf", "noext", "a.svg.bak", "a.gz"):
        with pytest.raises(ValueError) as e:
            format_for_path(bad)
        for ext in (".svg", ".json", ".folded", ".txt", ".pb.gz", ".pprof"):
            assert ext in str(e.value)


@pytest.mark.parametrize("name,fmt", [("p.svg", "svg"), ("p.json", "speedscope"),
                                      ("p.folded", "folded"), ("p.txt", "folded")])
def test_write_profile_atomic(tmp_path, name, fmt):
    out = tmp_path / name
    out.write_text("old contents")
    os.chmod(out, 0o600)
    write_profile(known_profile(), str(out), fmt)
    assert os.listdir(tmp_path) == [name]
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o644
    data = out.read_text(encoding="utf-8")
    if fmt == "folded":
        assert data == EXPECTED_FOLDED
    elif fmt == "speedscope":
        assert json.loads(data)["exporter"] == "pyoffcpu"
    else:
        ET.fromstring(data.encode())


def test_write_profile_threads_and_title(tmp_path):
    out = tmp_path / "p.folded"
    write_profile(known_profile(), str(out), "folded", threads=False)
    assert out.read_text() == EXPECTED_FOLDED_NO_THREADS
    svg = tmp_path / "p.svg"
    write_profile(known_profile(), str(svg), None, title="My title")
    assert ">My title</text>" in svg.read_text()


def test_write_profile_failure_leaves_no_temp(tmp_path, monkeypatch):
    out = tmp_path / "p.svg"

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(export.os, "replace", broken_replace)
    with pytest.raises(OSError):
        write_profile(known_profile(), str(out), "svg")
    assert os.listdir(tmp_path) == []


def test_write_profile_render_failure_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "render", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(RuntimeError):
        write_profile(known_profile(), str(tmp_path / "p.svg"), "svg")
    assert os.listdir(tmp_path) == []


def test_write_profile_unknown_format(tmp_path):
    with pytest.raises(ValueError):
        write_profile(known_profile(), str(tmp_path / "p.svg"), "pdf")
    assert os.listdir(tmp_path) == []


def test_check_writable(tmp_path):
    check_writable(str(tmp_path / "ok.svg"))
    assert os.listdir(tmp_path) == []
    missing = tmp_path / "nope" / "p.svg"
    with pytest.raises(FileNotFoundError) as e:
        check_writable(str(missing))
    assert "does not exist" in str(e.value) and str(tmp_path / "nope") in str(e.value)
    with pytest.raises(OSError):
        write_profile(known_profile(), str(missing), "svg")
    afile = tmp_path / "file"
    afile.write_text("")
    with pytest.raises(NotADirectoryError):
        check_writable(str(afile / "p.svg"))
    with pytest.raises(IsADirectoryError):
        check_writable(str(tmp_path))


def test_unwritable_directory(tmp_path):
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        os.chmod(ro, 0o555)
        try:
            with pytest.raises(PermissionError) as e:
                check_writable(str(ro / "p.svg"))
            assert "cannot write to output directory" in str(e.value)
            with pytest.raises(PermissionError):
                write_profile(known_profile(), str(ro / "p.svg"), "svg")
            assert os.listdir(ro) == []
        finally:
            os.chmod(ro, 0o755)
    else:
        # root writes anywhere a mode allows; /proc takes no new files at all
        with pytest.raises(OSError) as e:
            check_writable("/proc/pyoffcpu-test.svg")
        assert "cannot write to output directory /proc" in str(e.value)
        with pytest.raises(OSError):
            write_profile(known_profile(), "/proc/pyoffcpu-test.svg", "svg")
    assert not os.path.exists("/proc/pyoffcpu-test.svg")


def test_container_ids_are_shown_next_to_the_host_ids_and_read_back():
    """A process in another PID namespace keeps its host PID/TID first (what
    -p takes) and its own id after it: `process 4242 (ns 1) python3`."""
    p = Profile()
    p.processes = {4242: "python3"}
    p.threads = {4242: "python3", 4243: "worker"}
    p.ns_ids = {4242: 1, 4243: 7}
    p.add(StackKey(4242, 4242, (MAIN,)), 2_000)
    p.add(StackKey(4242, 4243, (WORK,)), 3_000)
    text = render_folded(p)
    assert text == ("process 4242 (ns 1) python3;thread 4242 (ns 1) python3;main (app/cli.py:10) 2\n"
                    "process 4242 (ns 1) python3;thread 4243 (ns 7) worker;work (app/cli.py:20) 3\n")
    back = from_folded(text)
    assert back.processes == {4242: "python3"} and back.threads == {4242: "python3", 4243: "worker"}
    assert back.ns_ids == {4242: 1, 4243: 7}
    assert render_folded(back) == text
    doc = json.loads(render_speedscope(p))
    assert doc["pyoffcpu"]["ns_pids"] == {"4242": 1}


WAKER_FOLDED = """\
process 1 app;thread 2 consumer;get (q.py:5);[off-cpu: lock];--;[woken by timer]_[w] 300
process 1 app;thread 2 consumer;get (q.py:5);[off-cpu: lock];--;sem_post_[w];put (q.py:9)_[w];\
thread 3 producer_[w] 700
process 1 app;thread 2 consumer;get (q.py:5);[off-cpu: lock];--;futex_wake_[k]_[w];\
thread 77 other_[w];process 76 other_[w] 50
process 1 app;thread 2 consumer;get (q.py:5);[off-cpu: lock] 100
"""


def test_folded_waker_chains_read_back_and_are_written_alike():
    """--wakers' folded contract (offwaketime's): the wait, `--`, the waker
    leaf first with `_[w]` on every frame; a wait whose waker is not known
    has no `--`.  Read back, each part is where it belongs."""
    prof = from_folded(WAKER_FOLDED)
    by_chain = {tuple(f.label() for f in k.waker): (k, ns) for k, ns in prof.weights.items()}
    assert set(by_chain) == {("[woken by timer]",), ("sem_post", "put (q.py:9)", "thread 3 producer"),
                             ("futex_wake_[k]", "thread 77 other", "process 76 other"), ()}
    k, ns = by_chain[("sem_post", "put (q.py:9)", "thread 3 producer")]
    assert (k.off_cpu, [f.label() for f in k.frames], ns) == ("lock", ["get (q.py:5)"], 700_000)
    assert [f.kind.value for f in k.waker] == ["native", "python", "marker"]
    assert by_chain[("futex_wake_[k]", "thread 77 other", "process 76 other")][0].waker[0].kind.value == "kernel"
    assert sorted(render_folded(prof).splitlines()) == sorted(WAKER_FOLDED.splitlines())
    # the wait's own totals do not change with its wakers
    assert prof.off_cpu_by_reason() == {2: {"lock": 1_150_000}}


def test_svg_colours_a_wakers_part_apart():
    _, f = _frames(render_svg(from_folded(WAKER_FOLDED)))
    fill = {k: v[2] for k, v in f.items()}
    for label in ("--", "sem_post_[w]", "put (q.py:9)_[w]", "thread 3 producer_[w]", "[woken by timer]_[w]"):
        r, g, b = _rgb(fill[label])
        assert b >= 205 and r >= 150 and g <= 150, (label, fill[label])      # violet
    assert _is_blue(fill["[off-cpu: lock]"]) and _is_blue(fill["get (q.py:5)"])
    assert not _is_blue(fill["sem_post_[w]"])
