"""The cache of compiled BPF programs (pytool/pyoffcpu/collect/bpfload.py): what is
compiled for one source, flags and kernel is never served for another; a
damaged entry is compiled again with a one-line notice; a recording from the
cache and one from a fresh compile have the same profile; a start from the
cache maps no LLVM.  The cache is pointed at a temporary directory
(PYOFFCPU_CACHE_DIR) throughout, and the BPF sources at a copy of bpf/
(PYOFFCPU_BPF_DIR) taken once: bpf/ is edited while tests run, and an edit
between two starts is rightly a miss.  The copy is marked as one (a
comment): the package's compiled programs (bpfobj/, test_shipped_bpf.py)
are not for its source, so the starts here meet the cache."""
import base64
import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, Workload, env, python_or_skip
from pyoffcpu.collect import bpfload, progcache, tables
from pyoffcpu.kernel import bpfsys
from pyoffcpu.profile.model import FrameKind

DURATION = 4.0
BPF_DIR = os.path.join(ROOT, "bpf")
_SNAPSHOT = []


def bpf_snapshot():
    """A copy of bpf/ made once per test session: the sources every start here compiles."""
    if not _SNAPSHOT:
        import atexit
        import tempfile
        top = tempfile.mkdtemp(prefix="pyoffcpu-bpf-")
        atexit.register(shutil.rmtree, top, True)
        d = os.path.join(top, "bpf")
        shutil.copytree(BPF_DIR, d)
        with open(os.path.join(d, "pyoffcpu.h"), "a") as f:
            f.write("\n/* test_bpf_cache's copy: not the package's source */\n")
        _SNAPSHOT.append(d)
    return _SNAPSHOT[0]


@pytest.fixture
def frozen_sources(monkeypatch):
    """In-process sessions compile the snapshot of bpf/."""
    from pyoffcpu.collect import sessionsetup as setup
    monkeypatch.setattr(setup, "BPF_DIR", bpf_snapshot())


@pytest.fixture
def compiles(monkeypatch):
    """The cflags of every bcc compile from here on (each still compiles)."""
    seen = []
    real = progcache.compile_in_child
    monkeypatch.setattr(bpfload, "compile_in_child",
                        lambda text, cflags: seen.append(cflags) or real(text, cflags))
    return seen


@contextlib.contextmanager
def compiled(p, **opts):
    """An in-process session of this process with its programs loaded (not
    attached), cleaned up after."""
    from pyoffcpu.collect import recording, session
    s = session.Session(recording.Options(pids=[os.getpid()], **opts), p)
    s._compile()
    try:
        yield s
    finally:
        s.bpf.cleanup()


def cache_env(d):
    e = env()
    e["PYOFFCPU_CACHE_DIR"] = str(d)
    e["PYOFFCPU_BPF_DIR"] = bpf_snapshot()
    return e


def entries(d):
    bpf = os.path.join(str(d), "bpf")
    return sorted(os.path.join(bpf, n) for n in os.listdir(bpf) if n.endswith(".bpf")) \
        if os.path.isdir(bpf) else []


def record(tmp_path, cache, pid, name):
    """A -d DURATION recording of pid with the cache in `cache`; (result, profile)."""
    from pyoffcpu.profile.model import from_folded
    out = tmp_path / name
    res = subprocess.run([sys.executable, "-m", "pyoffcpu", "-o", str(out), "-p", str(pid),
                          "-d", str(DURATION)], env=cache_env(cache), capture_output=True,
                         text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    return res, from_folded(out.read_text())


def python_shares(prof, tid):
    """Share (%) of the thread's time per stack of Python frames (name, line),
    on- and off-CPU together (a loaded machine moves time between running and
    waiting for a CPU, not between stacks)."""
    out, total = {}, 0
    for k, ns in prof.weights.items():
        if k.tid != tid:
            continue
        total += ns
        stack = tuple((f.name, f.line) for f in k.frames if f.kind is FrameKind.PYTHON)
        out[stack] = out.get(stack, 0) + ns
    return {s: 100.0 * ns / total for s, ns in out.items()}, total


def notice_lines(stderr):
    return [ln for ln in stderr.splitlines() if ln.startswith("pyoffcpu: notice:") and "cache" in ln]


# -- one workload, recorded from a fresh compile, then from the cache --------------------------------
@pytest.fixture(scope="module")
def recordings(tmp_path_factory, bpf):
    python = python_or_skip("debian-3.11")
    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("out")
    w = Workload(python, "split.py", 4 * DURATION + 120)
    try:
        assert entries(cache) == []
        fresh = record(out, cache, w.pid, "fresh.folded")
        made = entries(cache)
        assert len(made) == 1, made
        st = os.stat(made[0])
        cached = record(out, cache, w.pid, "cached.folded")
        st2 = os.stat(made[0])
    finally:
        w.stop()
    return {"w": w, "cache": cache, "fresh": fresh, "cached": cached, "entry": made[0],
            "stat": (st, st2)}


def test_a_fresh_compile_writes_one_private_entry_that_the_next_start_uses(recordings):
    st, st2 = recordings["stat"]
    assert entries(recordings["cache"]) == [recordings["entry"]]
    # a hit reads the file (and marks it used); a miss would have replaced it
    assert st2.st_ino == st.st_ino and st2.st_mtime_ns >= st.st_mtime_ns
    assert st.st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(recordings["entry"])).st_mode & 0o777 == 0o700
    for which in ("fresh", "cached"):
        assert notice_lines(recordings[which][0].stderr) == [], recordings[which][0].stderr


def test_cache_hit_and_fresh_compile_record_the_same_profile(recordings):
    tid = recordings["w"].pid
    a, total_a = python_shares(recordings["fresh"][1], tid)
    b, total_b = python_shares(recordings["cached"][1], tid)
    assert abs(total_a - total_b) <= 0.03 * DURATION * 1e9, (total_a, total_b)
    main = {s for s, pct in list(a.items()) + list(b.items()) if pct >= 2}
    # the built-in split is there in both (cpu_work, sleep, lock): not an empty match
    assert len(main) >= 3 and {f for s in main for f, _ in s} >= {"main", "cpu_work"}, main
    for s in main:
        assert s in a and s in b, (s, a, b)
    for s in set(a) | set(b):
        assert abs(a.get(s, 0) - b.get(s, 0)) <= 2, (s, a.get(s), b.get(s))


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "garbage", "empty"])
def test_a_damaged_entry_is_compiled_again_with_a_one_line_notice(recordings, tmp_path, damage):
    cache = tmp_path / "cache"
    shutil.copytree(recordings["cache"], cache)
    (path,) = entries(cache)
    data = bytearray(open(path, "rb").read())
    if damage == "truncated":
        data = data[:len(data) // 2]
    elif damage == "corrupt":
        data[len(data) - 100] ^= 0x20          # one byte of the instructions' text
    elif damage == "garbage":
        data = bytearray(os.urandom(4096))
    else:
        data = bytearray()
    with open(path, "wb") as f:
        f.write(data)
    python = python_or_skip("debian-3.11")
    w = Workload(python, "split.py", DURATION + 120)
    try:
        res, prof = record(tmp_path, cache, w.pid, "out.folded")
    finally:
        w.stop()
    lines = notice_lines(res.stderr)
    assert len(lines) == 1, res.stderr
    reason = {"truncated": "truncated", "corrupt": "checksum", "garbage": "not a pyoffcpu",
              "empty": "empty"}[damage]
    assert reason in lines[0] and "compiled again" in lines[0], lines[0]
    # the recording works: the workload's functions, for the whole time
    names = {f.name for k in prof.weights for f in k.frames if f.kind is FrameKind.PYTHON}
    assert {"main", "cpu_work"} <= names, names
    assert prof.total_ns(tid=w.pid) >= 0.9 * DURATION * 1e9
    # and the entry is whole again
    (again,) = entries(cache)
    progcache.parse(open(again, "rb").read(), os.path.basename(again)[:-4])


# -- what a key covers -----------------------------------------------------------------------------
def test_a_changed_source_or_flag_misses(tmp_path, monkeypatch, bpf, frozen_sources, compiles):
    """In-process, with the real programs: one compile per distinct source
    and flags; the same ones again are served from the cache."""
    from pyoffcpu.collect import platform as plat
    from pyoffcpu.collect import sessionsetup as setup
    monkeypatch.setenv("PYOFFCPU_CACHE_DIR", str(tmp_path))
    p = plat.probe()

    def start(**opts):
        with compiled(p, **opts) as s:
            return s.bpf.from_cache
    assert start() is False and len(compiles) == 1
    assert start() is True and len(compiles) == 1
    source = setup.bpf_source
    monkeypatch.setattr(setup, "bpf_source", lambda path: source(path) + "\n/* changed */\n")
    assert start() is False and len(compiles) == 2
    monkeypatch.setattr(setup, "bpf_source", source)
    assert start() is True and len(compiles) == 2
    # the sampling period and what the options turn on are set at load time
    # (bpf/loadconst.h): no compile
    assert start(frequency=97) is True and len(compiles) == 2
    assert start(kernel=True, wakers=True, async_tasks=True) is True and len(compiles) == 2
    monkeypatch.setenv("PYOFFCPU_MEMO_VERIFY", "1")                  # a flag: compiled
    assert start() is False and len(compiles) == 3
    assert compiles[-1][-1] == "-DMEMO_VERIFY=1"
    assert len(entries(tmp_path)) == 3


def test_the_key_covers_headers_and_bcc_not_the_kernel_or_where_the_headers_are(tmp_path, monkeypatch):
    inc = tmp_path / "bpf"
    shutil.copytree(BPF_DIR, inc)
    text = open(os.path.join(BPF_DIR, "pyoffcpu.bpf.c")).read()
    flags = [f"-I{inc}", "-DX=1"]
    base = progcache.cache_key(text, flags)
    assert base and base == progcache.cache_key(text, flags)
    assert progcache.cache_key(text + " ", flags) != base
    assert progcache.cache_key(text, flags + ["-DY=2"]) != base
    assert progcache.cache_key(text, [f"-I{inc}", "-DX=2"]) != base
    with open(inc / "pyoffcpu.h", "a") as f:           # a header the text includes
        f.write("\n")
    changed = progcache.cache_key(text, flags)
    assert changed != base
    # another kernel is the same entry: its values are set at load time
    monkeypatch.setattr(os, "uname", lambda: os.uname_result(("Linux", "h", "9.9.9", "#1", "x86_64")))
    assert progcache.cache_key(text, flags) == changed
    # the same headers elsewhere (the package installed in another place)
    moved = tmp_path / "elsewhere"
    shutil.copytree(inc, moved)
    assert progcache.cache_key(text, [f"-I{moved}", "-DX=1"]) == changed
    # bcc's library: this machine's cache, not the package's source key
    source = progcache.source_key(text, flags)
    monkeypatch.setattr(progcache, "_bcc_identity", lambda: "bcc 9.9")
    assert progcache.cache_key(text, flags) != changed
    assert progcache.source_key(text, flags) == source


# -- entries ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def entry(recordings):
    path = recordings["entry"]
    return progcache.parse(open(path, "rb").read(), os.path.basename(path)[:-4])


def test_every_cut_or_flipped_byte_is_refused(entry):
    data = progcache.serialize(entry)
    assert progcache.parse(data, entry["key"])["programs"] == entry["programs"]
    step = max(1, len(data) // 400)
    for n in list(range(0, len(data), step)) + [len(data) - 1]:
        with pytest.raises(progcache.CacheError):
            progcache.parse(data[:n], entry["key"])
    for n in range(0, len(data), step * 3):
        bad = bytearray(data)
        bad[n] ^= 0x01
        with pytest.raises(progcache.CacheError):
            progcache.parse(bytes(bad), entry["key"])
    with pytest.raises(progcache.CacheError, match="another key"):
        progcache.parse(data, "0" * 64)


def test_a_map_reference_must_point_at_a_map_load(entry):
    prog = dict(entry["programs"][0])
    idx, name = prog["maps"][0]
    prog["maps"] = [[idx + 1, name]] + prog["maps"][1:]       # the second half of the ld_imm64
    bad = dict(entry, programs=[prog] + entry["programs"][1:])
    with pytest.raises(progcache.CacheError, match="map reference"):
        progcache.parse(progcache.serialize(bad), entry["key"])


def test_load_time_constants_are_recorded_and_must_be_given(entry):
    """Every load of LOADCONST_MAGIC + an index is recorded by its name, a
    reference anywhere else is refused, and a program is not loaded with
    one of its constants missing."""
    named = {name for p in entry["programs"] for _, name in p["consts"]}
    assert {"TASK_PID_OFF", "TASK_TGID_OFF", "SAMPLE_PERIOD_NS", "SYS_REGS_CS_OFF"} <= named, named
    for p in entry["programs"]:
        code = bytearray(base64.b64decode(p["insns"]))
        magic = progcache.LOADCONST_MAGIC
        # no load of the magic is left unrecorded (it would reach the verifier as an offset)
        loads = {j for j in range(len(code) // 8 - 1)
                 if code[j * 8] == 0x18 and not code[j * 8 + 1] >> 4
                 and (int.from_bytes(code[j * 8 + 12:j * 8 + 16], "little") << 32) & ~0xffff == magic}
        assert loads == {j for j, _ in p["consts"]}, p["name"]
        progcache.patch_consts(code, p["consts"], {n: 7 for n in named})
        assert all(progcache.load_const_at(code, j) is None for j, _ in p["consts"])
        if p["consts"]:
            with pytest.raises(progcache.CacheError, match="not given"):
                progcache.patch_consts(bytearray(base64.b64decode(p["insns"])), p["consts"], {})
    prog = next(p for p in entry["programs"] if p["consts"])
    idx, name = prog["consts"][0]
    bad_prog = dict(prog, consts=[[idx + 1, name]] + prog["consts"][1:])
    bad = dict(entry, programs=[bad_prog if p is prog else p for p in entry["programs"]])
    with pytest.raises(progcache.CacheError, match="load-time constant"):
        progcache.parse(progcache.serialize(bad), entry["key"])


def test_map_types_are_the_ones_bcc_builds(entry, bpf):
    """The ctypes made from bcc's type descriptions match bcc's own, member by
    member (names, offsets, sizes), for every map of the real programs."""
    import bcc

    def layout(t):
        if isinstance(t, type) and issubclass(t, (ctypes.Structure, ctypes.Union)):
            return (t.__name__, ctypes.sizeof(t), [
                (f[0], getattr(t, f[0]).offset, getattr(t, f[0]).size, layout(f[1]))
                for f in t._fields_])
        if isinstance(t, type) and issubclass(t, ctypes.Array):
            return ("array", t._length_, layout(t._type_))
        return (t.__name__, ctypes.sizeof(t))
    checked = 0
    for m in entry["maps"]:
        for desc in (m["key_desc"], m["leaf_desc"]):
            d = json.loads(desc)
            assert layout(tables.ctype_of(d)) == layout(bcc.BPF._decode_table_type(d)), m["name"]
            checked += 1
    assert checked == 2 * len(entry["maps"]) >= 40


def test_header_structs_are_the_ones_bpf_was_compiled_with(entry, bpf):
    """Python's ctypes of the structs in bpf/*.h (bpfdefs.struct_type, read
    from the headers) lay out every member where the compiled program has it:
    one source for both sides, and this fails when they part."""
    from pyoffcpu.kernel import bpfdefs

    def layout(t):
        if isinstance(t, type) and issubclass(t, ctypes.Structure):
            return (ctypes.sizeof(t), [(f[0], getattr(t, f[0]).offset, layout(f[1])) for f in t._fields_])
        if isinstance(t, type) and issubclass(t, ctypes.Array):
            return ("array", t._length_, layout(t._type_))
        return ctypes.sizeof(t)
    seen = set()
    for m in entry["maps"]:
        for desc in (m["key_desc"], m["leaf_desc"]):
            t = tables.ctype_of(json.loads(desc))
            if isinstance(t, type) and issubclass(t, ctypes.Structure):
                try:
                    mine = bpfdefs.struct_type(t.__name__)
                except KeyError:
                    continue                # a struct of the .bpf.c itself
                assert layout(mine) == layout(t), (m["name"], t.__name__)
                seen.add(t.__name__)
    # the perf event's pystack is the scratch map's value
    assert {"pystack", "proc_info", "stack_key", "stack_value", "thread_t", "offcpu_start",
            "control_t", "proc_unwind", "unwind_row"} <= seen, seen


# -- a start from the cache ---------------------------------------------------------------------------
def test_a_start_from_the_cache_maps_no_llvm(recordings):
    code = """
import os, sys
from pyoffcpu.collect import platform as plat, recording, session
s = session.Session(recording.Options(pids=[os.getpid()]), plat.probe())
s._compile()
s._attach()
s._unwinder_ready(wait=True)
maps = open("/proc/self/maps").read()
print(s.bpf.from_cache, "bcc" in sys.modules, "libLLVM" in maps, "libbcc" in maps)
s.bpf.cleanup()
"""
    res = subprocess.run([sys.executable, "-c", code], env=cache_env(recordings["cache"]),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "False", "False", "False"], res.stdout + res.stderr


def test_a_finishing_program_the_verifier_refuses_is_not_fatal(recordings, tmp_path, monkeypatch,
                                                               frozen_sources):
    """The unwinder's programs are verified with the main ones, at once; one
    that fails leaves frame-pointer stacks and a notice, as before."""
    from pyoffcpu.collect import platform as plat
    from pyoffcpu.collect import recording, session
    shutil.copytree(recordings["cache"], tmp_path / "cache")
    monkeypatch.setenv("PYOFFCPU_CACHE_DIR", str(tmp_path / "cache"))
    real = bpfload.prog_load

    def refuse(ptype, insns, license, kv, name, *a, **kw):
        if name == "unwind_tp":
            raise OSError(13, "Permission denied")
        return real(ptype, insns, license, kv, name, *a, **kw)
    monkeypatch.setattr(bpfload, "prog_load", refuse)
    s = session.Session(recording.Options(pids=[os.getpid()]), plat.probe())
    s._compile()
    try:
        assert s.bpf.from_cache
        s._attach()
        s._unwinder_ready(wait=True)    # verified after the start without --tables-first
        assert s.unwinder is None
        assert [n for n in s.rec.notices if "native unwinding off" in n and "unwind_tp" in n], \
            s.rec.notices
        assert {b"raw_tracepoint__sched_switch", b"on_cpu_sample"} <= set(s.bpf.funcs)
    finally:
        s.bpf.cleanup()


def test_maps_are_sized_to_the_session_and_one_cached_program_serves_every_size(
        recordings, tmp_path, monkeypatch, frozen_sources, compiles):
    """The big maps get the entries the session needs (the kernel's own
    account of each map: BPF_OBJ_GET_INFO_BY_FD), from one cached entry: a
    map's size is not part of the programs.  Kernel stacks are kept only
    with --kernel."""
    from pyoffcpu.collect import platform as plat
    from pyoffcpu.collect import sessionsetup as setup
    shutil.copytree(recordings["cache"], tmp_path / "cache")
    monkeypatch.setenv("PYOFFCPU_CACHE_DIR", str(tmp_path / "cache"))
    p = plat.probe()

    def sizes(**opts):
        with compiled(p, **opts) as s:
            got = {}
            for name in ("kstacks", "ustacks", "threads", "offcpu_start", "pystack_seen", "agg"):
                info = bpfsys.map_info(s.bpf[name].map_fd)
                assert s.bpf[name].max_entries == info[3]
                got[name] = info[3]
            return got
    tables = setup.unwind_loader.load_consts(plat.BTF_PATH)["NATIVE_UNWIND"]
    assert sizes() == {"kstacks": 1, "ustacks": 4096 if tables else 32768, "threads": 16384,
                       "offcpu_start": 16384, "pystack_seen": 32768, "agg": 65536}
    assert compiles == []               # the recordings' entry, with other map sizes
    assert sizes(kernel=True)["kstacks"] == 16384
    # hash and stack maps only smaller; an array only larger (the source
    # indexes what it declares; a per-CPU buffer is sized to the CPUs)
    with pytest.raises(ValueError):
        bpfload._resized({"maps": [{"name": "control", "type": 2, "max_entries": 2}]}, {"control": 1})
    with pytest.raises(ValueError):
        bpfload._resized({"maps": [{"name": "agg", "type": 1, "max_entries": 2}]}, {"agg": 3})
    assert bpfload._resized({"maps": [{"name": "big", "type": 2, "max_entries": 1}]},
                            {"big": 8})["maps"][0]["max_entries"] == 8


def test_btf_offsets_are_remembered_and_a_bad_record_is_ignored(tmp_path):
    from pyoffcpu.kernel.btf import VMLINUX_BTF, Btf, member_offsets
    want = [("task_struct", "pid"), ("task_struct", "se.sum_exec_runtime"), ("pt_regs", "ip")]
    btf = Btf.load(VMLINUX_BTF)
    truth = [btf.member_offset(s, m) for s, m in want]
    from pyoffcpu.kernel import btf as btf_mod
    btf_mod._OFFSETS.clear()
    assert member_offsets(VMLINUX_BTF, want, cache_dir=str(tmp_path)) == truth
    (rec,) = [p for p in os.listdir(tmp_path) if p.startswith("btf-")]
    btf_mod._OFFSETS.clear()
    assert member_offsets(VMLINUX_BTF, want, cache_dir=str(tmp_path)) == truth
    (tmp_path / rec).write_text("{not json")
    btf_mod._OFFSETS.clear()
    assert member_offsets(VMLINUX_BTF, want, cache_dir=str(tmp_path)) == truth


def test_a_verification_a_signal_cut_short_is_made_again(monkeypatch):
    """The verifier gives up with EAGAIN when a signal is pending for the
    loading thread (a helper's SIGCHLD during the unwinder's background
    verification did it): the load is made again, a bounded number of
    times, with those signals blocked in a thread that is not the main one."""
    import errno
    import signal
    import threading
    calls, masks = [], []

    def flaky(*args):
        calls.append(args)
        masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))
        if len(calls) < 3:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        return 7, ""
    monkeypatch.setattr(bpfload, "prog_load", flaky)
    got = []
    t = threading.Thread(target=lambda: got.append(bpfload._verified(17, b"", b"GPL", 0, "x", 0, 1)))
    t.start()
    t.join()
    assert got == [(7, "")] and len(calls) == 3
    assert all(signal.SIGCHLD in m and signal.SIGTERM in m for m in masks)
    assert signal.SIGCHLD not in signal.pthread_sigmask(signal.SIG_BLOCK, [])   # the main thread's
    calls.clear()
    monkeypatch.setattr(bpfload, "prog_load", lambda *a: calls.append(a) or (_ for _ in ()).throw(
        OSError(errno.EAGAIN, "again")))
    with pytest.raises(OSError):
        bpfload._verified(17, b"", b"GPL", 0, "x", 0, 1)
    assert len(calls) == bpfload.VERIFY_TRIES
