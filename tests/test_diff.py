"""pyoffcpu diff: a differential flame graph between two profiles, from
folded or pprof files; shares normalised by each profile's total."""
import subprocess

from conftest import env, pyoffcpu_cmd
from pyoffcpu.export.diff import diff_colour, largest_changes, read_profile, render_diff
from pyoffcpu.export.pprof import render_pprof
from pyoffcpu.profile.model import from_folded
from test_export import _frames, _rgb

# A: 1 s of work, 1 s waiting; B (another process, twice as long a recording):
# 3 s of work, 1 s waiting, 0.5 s in a new function
A = """\
process 1 app;thread 1 main;main (a.py:1);work (a.py:2) 1000000
process 1 app;thread 7 w;main (a.py:1);wait (a.py:3);[off-cpu: lock] 1000000
"""
B = """\
process 2 app;thread 2 main;main (a.py:1);work (a.py:2) 3000000
process 2 app;thread 3 w;main (a.py:1);wait (a.py:3);[off-cpu: lock] 1000000
process 2 app;thread 3 w;main (a.py:1);new (a.py:9) 500000
"""


def test_frames_are_coloured_by_the_change_of_their_share():
    _, f = _frames(render_diff(from_folded(A), from_folded(B), "t"))
    # merged across processes and threads: one tree of frames
    assert set(f) == {"all", "main (a.py:1)", "work (a.py:2)", "wait (a.py:3)", "[off-cpu: lock]",
                      "new (a.py:9)"}
    # B's widths (4.5 s in all)
    assert f["work (a.py:2)"][0] == 3_000_000_000 and f["all"][0] == 4_500_000_000
    # work: 50% of A, 66.7% of B: more, red; wait 50% -> 22.2%: less, blue;
    # new 0 -> 11.1%; main and all: 100% of both, white
    r, g, b = _rgb(f["work (a.py:2)"][2])
    assert r == 250 and g == b < 250
    r, g, b = _rgb(f["wait (a.py:3)"][2])
    assert b == 250 and r == g < 250
    assert _rgb(f["wait (a.py:3)"][2])[0] == 50           # the largest change: full colour
    assert f["main (a.py:1)"][2] == f["all"][2] == "rgb(250,250,250)"
    assert _rgb(f["new (a.py:9)"][2])[1] > _rgb(f["work (a.py:2)"][2])[1]   # a smaller rise: paler
    tip = f["work (a.py:2)"][3]
    assert "A 1.00 s (50.0%)" in tip and "B 3.00 s (66.7%)" in tip and "+16.7 points" in tip, tip


def test_the_shape_can_be_as_it_was():
    _, f = _frames(render_diff(from_folded(A), from_folded(B), "t", shape="a"))
    assert f["work (a.py:2)"][0] == 1_000_000_000
    assert "new (a.py:9)" not in f                          # not in A: no width


def test_colours_and_the_largest_changes():
    assert diff_colour(0.0, 0.3) == "rgb(250,250,250)"
    assert diff_colour(0.3, 0.3) == "rgb(250,50,50)" and diff_colour(-0.3, 0.3) == "rgb(50,50,250)"
    rows = largest_changes(from_folded(A), from_folded(B))
    assert [w for _, w in rows[:3]] == ["wait (a.py:3);[off-cpu: lock]", "main (a.py:1);work (a.py:2)",
                                        "main (a.py:1);new (a.py:9)"]
    assert round(rows[0][0], 1) == -27.8


def test_the_command_reads_folded_and_pprof_and_fails_in_one_line(tmp_path):
    a, b = tmp_path / "a.folded", tmp_path / "b.pb.gz"
    a.write_text(A)
    b.write_bytes(render_pprof(from_folded(B)))
    assert read_profile(str(b)).total_ns() == 4_500_000_000
    out = tmp_path / "d.svg"
    res = subprocess.run(pyoffcpu_cmd("diff", str(a), str(b), "-o", str(out)), env=env(),
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    _, f = _frames(out.read_text())
    assert f["work (a.py:2)"][0] == 3_000_000_000
    assert "+16.7 points  main (a.py:1);work (a.py:2)" in res.stderr, res.stderr
    for args, says in (([str(tmp_path / "none.folded"), str(b)], "cannot read"),
                       ([str(out), str(b)], "cannot be read back"),
                       ([str(a), str(b), "-o", str(tmp_path / "no" / "d.svg")], "cannot write")):
        (tmp_path / "empty.folded").write_text("")
        res = subprocess.run(pyoffcpu_cmd("diff", *args), env=env(), capture_output=True, text=True)
        assert res.returncode == 1 and says in res.stderr, res.stderr
        assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    res = subprocess.run(pyoffcpu_cmd("diff", str(tmp_path / "empty.folded"), str(a)), env=env(),
                         capture_output=True, text=True)
    assert res.returncode == 1 and "holds no stacks" in res.stderr, res.stderr
