"""pprof export: our own protobuf encoder, read back by our reader and by a
real one (`go tool pprof`, Debian's golang-go, which `make test` installs),
with totals equal to the folded totals; and a real recording written as
pprof."""
import os
import re
import shutil
import subprocess

import pytest

from conftest import Workload, python_or_skip, run_pyoffcpu
from pyoffcpu.export import format_for_path, render, write_profile
from pyoffcpu.export.folded import render_folded
from pyoffcpu.export.pprof import Message, fields, from_pprof, render_pprof, varint
from pyoffcpu.profile.model import from_folded
from test_export import WAKER_FOLDED, known_profile


def go_or_skip():
    go = shutil.which("go") or ("/usr/lib/go/bin/go" if os.path.exists("/usr/lib/go/bin/go") else None)
    if go is None:
        if os.environ.get("PYOFFCPU_REQUIRE_BPF") == "1":
            pytest.fail("go (Debian's golang-go) is missing: `make test` installs it")
        pytest.skip("no go tool (apt install golang-go)")
    return go


def go_pprof(go, path, *args):
    env = dict(os.environ, HOME=os.environ.get("HOME", "/root"), GOCACHE="/tmp/pyoffcpu-gocache",
               PPROF_TMPDIR="/tmp")
    res = subprocess.run([go, "tool", "pprof", *args, str(path)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def raw_samples(text):
    """(samples, cpu ns, wall ns) of each sample in `go tool pprof -raw`'s
    output, and their labels."""
    out = []
    lines = text.split("Samples:", 1)[1].split("Locations", 1)[0].splitlines()
    for ln in lines:
        m = re.match(r"^\s+(\d+)\s+(\d+)\s+(\d+):", ln)
        if m:
            out.append([tuple(int(g) for g in m.groups()), {}])
        elif out and ":[" in ln:
            out[-1][1].update(re.findall(r"(\w+):\[([^\]]*)\]", ln))
    return out


def test_varints_and_messages_are_protobufs():
    assert varint(0) == b"\x00" and varint(1) == b"\x01" and varint(300) == b"\xac\x02"
    assert varint(-1) == b"\xff" * 9 + b"\x01"                   # int64 -1: ten bytes
    m = Message().int(1, 150).bytes(2, b"testing").packed(4, [3, 270]).int(5, 0)
    assert bytes(m.buf) == b"\x08\x96\x01\x12\x07testing\x22\x03\x03\x8e\x02"
    assert fields(bytes(m.buf)) == {1: [150], 2: [b"testing"], 4: [b"\x03\x8e\x02"]}


def test_a_profile_comes_back_from_pprof_ns_for_ns():
    p = known_profile()
    q = from_pprof(render_pprof(p, full_paths=True))
    assert q.weights == p.weights and q.sample_counts == p.sample_counts
    assert {t: q.threads[t] for t in p.threads} == p.threads
    # waker chains are a label, not frames: the waits' times stay as they are
    w = from_folded(WAKER_FOLDED)
    assert from_pprof(render_pprof(w)).off_cpu_by_reason() == w.off_cpu_by_reason()


def test_pprof_is_chosen_by_its_extensions(tmp_path):
    assert format_for_path("a.pb.gz") == "pprof" and format_for_path("B.PPROF") == "pprof"
    assert format_for_path("a.gz.folded") == "folded"
    out = tmp_path / "x.pb.gz"
    write_profile(known_profile(), str(out))
    assert out.read_bytes()[:2] == b"\x1f\x8b"
    assert isinstance(render(known_profile(), "pprof"), bytes)


def test_go_tool_pprof_reads_it_with_the_folded_totals(tmp_path):
    go = go_or_skip()
    p = from_folded(WAKER_FOLDED + render_folded(known_profile()))
    path = tmp_path / "k.pb.gz"
    path.write_bytes(render_pprof(p))
    samples = raw_samples(go_pprof(go, path, "-raw"))
    folded_us = sum(int(ln.rsplit(" ", 1)[1]) for ln in render_folded(p).splitlines())
    wall = sum(v[2] for v, _ in samples)
    cpu = sum(v[1] for v, _ in samples)
    assert wall == p.total_ns() == folded_us * 1000             # from_folded: whole us
    assert cpu == p.total_ns(on_cpu=True)
    reasons = {}
    for v, labels in samples:
        if "off_cpu_reason" in labels:
            reasons[labels["off_cpu_reason"]] = reasons.get(labels["off_cpu_reason"], 0) + v[2]
    assert reasons == {r: ns for by in [{}] for r, ns in _all_reasons(p).items()}
    assert all({"pid", "thread_id", "thread_name"} <= set(lb) for _, lb in samples)
    top = go_pprof(go, path, "-top", "-sample_index=wall")
    assert "[off-cpu: disk]" in top and "Type: wall" in top, top


def _all_reasons(p):
    out = {}
    for k, ns in p.weights.items():
        if k.off_cpu is not None:
            out[k.off_cpu] = out.get(k.off_cpu, 0) + ns
    return out


def test_a_recording_written_as_pprof(tmp_path, bpf):
    """split.py (its time split built in) recorded straight to .pb.gz: go
    reads it, and its totals are the recording's, stack for stack."""
    go = go_or_skip()
    python = python_or_skip("pyenv-3.11")
    w = Workload(python, "split.py", 60)
    out = tmp_path / "rec.pb.gz"
    try:
        res = run_pyoffcpu("-p", str(w.pid), "-d", "2", "-o", str(out))
    finally:
        w.stop()
    assert res.returncode == 0, res.stderr
    prof = from_pprof(out.read_bytes())
    samples = raw_samples(go_pprof(go, out, "-raw"))
    assert sum(v[2] for v, _ in samples) == prof.total_ns()
    assert sum(v[1] for v, _ in samples) == prof.total_ns(on_cpu=True)
    # the main thread's wall time is the recording's (2 s): half in cpu_work,
    # a quarter each asleep and waiting for the lock (split.py)
    main = prof.total_ns(tid=w.pid)
    assert 1.9e9 <= main <= 2.2e9, main
    why = prof.off_cpu_by_reason()[w.pid]
    assert abs(why.get("sleep", 0) - 0.25 * main) <= 0.05 * main, why
    assert abs(why.get("lock", 0) - 0.25 * main) <= 0.05 * main, why
    names = {f.name for k in prof.weights for f in k.frames}
    assert "cpu_work" in names
    text = go_pprof(go, out, "-raw")
    assert re.search(r"Comment: pyoffcpu: pid \d+, wall mode, 99 Hz", text), text[:500]
    assert "CPython 3.11" in text
