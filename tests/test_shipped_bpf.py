"""The BPF programs the package ships (pytool/pyoffcpu/bpfobj/, made by
`make bpf-objects`): they are what bcc makes of bpf/ now, byte for byte; a
recording loads them with every option, without bcc; a damaged or stale
one is not used (bcc compiles instead, with a notice for a damaged one);
their perf event arrays are sized to this machine's CPUs, not the
builder's."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from pyoffcpu.collect import bpfload, progcache
from pyoffcpu.kernel import bpfsys


def test_the_shipped_programs_are_a_rebuild_of_bpf(bpf):
    """CI's check: a change to bpf/ without `make bpf-objects` fails here."""
    res = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "build_bpf_objects.py"), "--check"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr


def _session(monkeypatch, tmp_path, **opts):
    from pyoffcpu.collect import platform as plat
    from pyoffcpu.collect import recording, session
    monkeypatch.setenv("PYOFFCPU_CACHE_DIR", str(tmp_path / "cache"))
    s = session.Session(recording.Options(**dict({"pids": [os.getpid()]}, **opts)), plat.probe())
    s._compile()
    return s


@pytest.mark.parametrize("opts", [{}, {"kernel": True, "wakers": True, "async_tasks": True},
                                  {"mode": "cpu", "frequency": 97}, {"mode": "off", "timeline": "t.json"},
                                  {"system_wide": True, "pids": []}])
def test_every_recording_loads_the_shipped_programs_without_a_compile(monkeypatch, tmp_path, bpf, opts):
    compiles = []
    monkeypatch.setattr(bpfload, "compile_in_child", lambda *a: compiles.append(a))
    s = _session(monkeypatch, tmp_path, **opts)
    try:
        assert s.bpf.origin == "package" and not compiles
        assert s.rec.notices == [] or not [n for n in s.rec.notices if "BPF" in n], s.rec.notices
        assert s.bpf["pystack_events"].max_entries == max(bpfsys.possible_cpus()) + 1
    finally:
        s.bpf.cleanup()


def test_a_damaged_shipped_entry_is_not_used(monkeypatch, tmp_path, bpf):
    """A byte changed in the shipped file: its checksum fails, a notice says
    so, and bcc compiles (into the cache) instead."""
    d = tmp_path / "bpfobj"
    shutil.copytree(progcache.SHIPPED_DIR, d)
    victim = max(d.glob("*.bpf"), key=lambda p: p.stat().st_size)      # the recording's
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x20
    victim.write_bytes(bytes(data))
    monkeypatch.setattr(progcache, "SHIPPED_DIR", str(d))
    s = _session(monkeypatch, tmp_path)
    try:
        assert s.bpf.origin == "compiled"
        assert [n for n in s.rec.notices if "shipped in the package" in n and "checksum" in n], s.rec.notices
    finally:
        s.bpf.cleanup()


def test_a_stale_source_finds_no_shipped_entry():
    from pyoffcpu.collect import sessionsetup
    text, cflags = sessionsetup.program_source()
    assert progcache.shipped_entry(text, cflags) is not None
    assert progcache.shipped_entry(text + "\n/* changed */\n", cflags) is None
    assert progcache.shipped_entry(text, cflags + ["-DMEMO_VERIFY=1"]) is None


def test_perf_event_arrays_get_one_entry_per_possible_cpu():
    ncpus = max(bpfsys.possible_cpus()) + 1
    entry = {"maps": [{"name": "out", "type": bpfsys.BPF_MAP_TYPE_PERF_EVENT_ARRAY, "max_entries": 512},
                      {"name": "h", "type": bpfsys.BPF_MAP_TYPE_HASH, "max_entries": 100}]}
    got = {m["name"]: m["max_entries"] for m in bpfload._resized(entry, {"h": 10})["maps"]}
    assert got == {"out": ncpus, "h": 10}
    assert entry["maps"][0]["max_entries"] == 512          # the entry itself is left as it was
