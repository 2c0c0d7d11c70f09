"""Every target and every file we did not write is untrusted (issue 25):
what a process or a file controls may not block, exhaust or redirect root's
profiler.  Each test is one attack, made as an unprivileged user (nobody)
where it needs one, with what must hold instead."""
import os
import pathlib
import pwd
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import WORKLOADS, env, pyoffcpu_cmd, python_or_skip

LIBZ = "/usr/lib/x86_64-linux-gnu/libz.so.1"


def as_nobody(argv, cwd=None):
    """argv run as nobody (setpriv from util-linux), its stdout a pipe."""
    nobody = pwd.getpwnam("nobody")
    return subprocess.Popen(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}",
                             "--clear-groups", "--"] + argv, stdout=subprocess.PIPE, text=True, cwd=cwd)


@pytest.fixture
def nobody_dir():
    """A directory of nobody's, that nobody can reach (pytest's tmp_path is
    in root's 0700 directory)."""
    d = tempfile.mkdtemp(prefix="pyoffcpu-untrusted-")
    os.chmod(d, 0o755)
    os.chown(d, pwd.getpwnam("nobody").pw_uid, -1)
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def fifo_trap(nobody_dir):
    """A process of nobody's whose maps name a FIFO (a deleted library's
    path).  Not a Python process: pyoffcpu looks through all its files for
    an interpreter."""
    d = nobody_dir
    exe = str(d / "fifo_trap")
    subprocess.run(["gcc", "-O2", "-o", exe, os.path.join(WORKLOADS, "fifo_trap.c"), "-ldl"], check=True)
    p = as_nobody([exe, str(d), LIBZ])
    try:
        assert p.stdout.readline().strip() == "ready"
        assert os.path.exists(d / "libtrap.so") and not os.path.isfile(d / "libtrap.so")
        yield p
    finally:
        p.kill()
        p.wait()


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    from pyoffcpu.native.elfcache import ElfCache, open_regular_file
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(OSError, match="not a regular file"):
        open_regular_file(str(fifo))
    assert ElfCache().get(str(fifo)) is None and ElfCache().identity(str(fifo)) is None
    assert time.monotonic() - start < 1


# dump, and a one-second recording, of one process
ON_ONE = pytest.mark.parametrize("command", [["dump", "-p", "{pid}"], ["-p", "{pid}", "-d", "1", "-o", "{out}"]],
                                 ids=["dump", "record"])


def run_on(command, pid, out):
    """(CompletedProcess, seconds it took) of pyoffcpu `command` on pid."""
    args = [a.format(pid=pid, out=out) for a in command]
    start = time.monotonic()
    res = subprocess.run(pyoffcpu_cmd(*args), env=env(), capture_output=True, text=True, timeout=30)
    return res, time.monotonic() - start


@ON_ONE
def test_a_planted_fifo_does_not_hang_root(tmp_path, bpf, fifo_trap, command):
    out = tmp_path / "out.folded"
    res, took = run_on(command, fifo_trap.pid, out)
    assert res.returncode == 0, res.stderr
    assert took < (5 if command[0] == "dump" else 6), took
    if command[0] != "dump":
        assert out.exists()                 # the profile is written


def test_a_debuglink_names_only_a_file_in_the_debug_directories():
    """`.gnu_debuglink` is a file name the file chooses: an absolute path or
    `../` would make root open any path (a FIFO, a device), outside the
    target's root too."""
    from pyoffcpu.native import symbols
    for bad in ("/etc/shadow", "../../../../dev/zero", "..", ".", "", None, "a\x1bb", "x/y.debug"):
        assert not symbols.safe_debuglink(bad), bad
    assert symbols.safe_debuglink("libc.so.6.debug")

    class Image:
        build_id = None
        debuglink = "/dev/zero"
    assert symbols._debug_candidates("/usr/lib/libx.so", Image(), ["/usr/lib/debug"]) == []
    Image.debuglink = "../../../../dev/zero"
    assert symbols._debug_candidates("/usr/lib/libx.so", Image(), ["/usr/lib/debug"]) == []
    Image.debuglink = "libx.so.debug"
    assert all(c.endswith("/libx.so.debug") and ".." not in c
               for c in symbols._debug_candidates("/usr/lib/libx.so", Image(), ["/usr/lib/debug"]))


CYCLE_TARGET = r"""
import ctypes, threading, time
fake = ctypes.create_string_buffer(4096)            # a zeroed "interpreter": no threads
print("fake", ctypes.addressof(fake), flush=True)
def spinner():
    while True:
        pass
threading.Thread(target=spinner, name="spinner", daemon=True).start()
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def interpreter_cycle():
    """A Python process whose interpreter list ends in a cycle through an
    interpreter with no threads (any process can write its own memory;
    CPython walks the list only at fork and at exit): root writes the real
    head's `next` to a zeroed buffer of the process, whose `next` is itself."""
    from pyoffcpu.cpython import detect
    from conftest import Workload
    python = python_or_skip("pyenv-3.11")
    w = Workload(python, None, argv=[python, "-c", CYCLE_TARGET])
    try:
        fake = int(next(ln for ln in w.lines if ln.startswith("fake")).split()[1])
        pp = detect.find_python(w.pid)
        o = pp.offsets
        fd = os.open(f"/proc/{w.pid}/mem", os.O_RDWR)
        try:
            head = int.from_bytes(os.pread(fd, 8, pp.runtime + o["runtime_interpreters_head"]), "little")
            assert head
            os.pwrite(fd, fake.to_bytes(8, "little"), fake + o["interp_next"])
            os.pwrite(fd, fake.to_bytes(8, "little"), head + o["interp_next"])
        finally:
            os.close(fd)
        yield w
    finally:
        w.stop()


@ON_ONE
def test_a_cycle_in_the_interpreter_list_ends(tmp_path, bpf, interpreter_cycle, command):
    out = tmp_path / "out.folded"
    res, took = run_on(command, interpreter_cycle.pid, out)
    assert res.returncode == 0, res.stderr
    assert took < 5, res.stderr
    if command[0] == "dump":
        assert "spinner" in res.stdout, res.stdout          # its threads are all there, once
    else:
        assert "spinner" in out.read_text()


# -- files handed over: diff, report, caches ------------------------------------------------------
def run_cli(*args, timeout=60):
    return subprocess.run(pyoffcpu_cmd(*args), env=env(), capture_output=True, timeout=timeout)


PEAK_OF_CHILD = """
import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], stderr=subprocess.PIPE)
sys.stdout.write(f"{r.returncode} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}\\n")
sys.stdout.write(r.stderr.decode())
"""


def run_cli_peak(*args, timeout=60):
    """(exit status, peak RSS in KiB, stderr) of pyoffcpu run alone under a
    fresh parent: the peak of no other child of the test process."""
    res = subprocess.run([sys.executable, "-c", PEAK_OF_CHILD, *pyoffcpu_cmd(*args)], env=env(),
                         capture_output=True, text=True, timeout=timeout)
    head, _, err = res.stdout.partition("\n")
    rc, peak = map(int, head.split())
    return rc, peak, err


def test_a_pprof_that_inflates_to_gigabytes_is_one_line_and_bounded(tmp_path):
    """A 300 KiB .pb.gz of 300 MiB of zeros (over the 256 MiB default):
    diff says so in one line, exit 1, without inflating it whole."""
    import gzip
    bomb = tmp_path / "bomb.pb.gz"
    bomb.write_bytes(gzip.compress(b"\0" * (300 << 20), compresslevel=1))
    good = tmp_path / "a.folded"
    good.write_text("process 1 x;thread 1 x;main (a.py:1) 100\n")
    rc, peak, err = run_cli_peak("diff", str(good), str(bomb), "-o", str(tmp_path / "d.svg"))
    assert rc == 1 and err.count("\n") == 1 and "PYOFFCPU_MAX_INPUT_MB" in err, err
    assert "Traceback" not in err
    assert peak < 600 << 10, peak                     # KiB: well under the 4 GB the bomb took


def pprof_of(profile_fields):
    """A gzipped protobuf of (field, wire type, value) triples: a Profile
    message a hostile tool could write."""
    import gzip
    from pyoffcpu.export.pprof import varint
    out = b""
    for field, wire, value in profile_fields:
        out += varint(field << 3 | wire)
        out += varint(value) if wire == 0 else varint(len(value)) + value
    return gzip.compress(out)


@pytest.mark.parametrize("damage", ["number for a message", "message for a number", "broken deflate",
                                    "varint past 64 bits", "negative value"])
def test_a_damaged_pprof_is_one_line_never_a_traceback(tmp_path, damage):
    """diff reads pprof written by anyone: a field of the wrong wire type, a
    corrupt deflate stream (zlib.error), an endless varint."""
    import gzip
    from pyoffcpu.export.pprof import Message
    strings = [b"", b"samples", b"count", b"main"]
    sample_type = Message().int(1, 1).int(2, 2)
    if damage == "number for a message":
        data = pprof_of([(1, 0, 7)])                        # sample_type as a varint
    elif damage == "message for a number":
        data = pprof_of([(1, 2, bytes(Message().bytes(1, b"\x01").int(2, 2).buf))]   # a type's name as bytes
                        + [(6, 2, s) for s in strings])
    elif damage == "broken deflate":
        data = gzip.compress(b"\x0a\x04\x08\x01\x10\x02" * 1000)
        data = data[:20] + bytes(b ^ 0x5A for b in data[20:60]) + data[60:]
    elif damage == "varint past 64 bits":
        data = gzip.compress(b"\x08" + b"\xff" * 30 + b"\x01")
    else:
        data = pprof_of([(1, 2, bytes(sample_type.buf))] + [(6, 2, s) for s in strings]
                        + [(2, 2, bytes(Message().packed(1, [1]).int(2, (1 << 64) - 5).buf))])
    bad = tmp_path / "bad.pb.gz"
    bad.write_bytes(data)
    good = tmp_path / "a.folded"
    good.write_text("process 1 x;thread 1 x;main (a.py:1) 100\n")
    res = run_cli("diff", str(good), str(bad), "-o", str(tmp_path / "d.svg"))
    err = res.stderr.decode()
    assert res.returncode == 1 and err.count("\n") == 1 and "bad.pb.gz" in err, err
    assert "Traceback" not in err


def test_a_deeply_nested_btf_cache_file_is_ignored(tmp_path):
    """btf-*.json in the cache directory: deep nesting (RecursionError) or a
    wrong shape is a file not ours, and the offsets come from vmlinux."""
    from pyoffcpu import cachedir
    from pyoffcpu.kernel import btf
    if not os.path.exists(btf.VMLINUX_BTF):
        pytest.skip("no /sys/kernel/btf/vmlinux")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    members = [("task_struct", "pid"), ("task_struct", "tgid")]
    btf._OFFSETS.clear()        # an earlier test's offsets in memory: none written to this cache
    want = btf.member_offsets(btf.VMLINUX_BTF, members, cache_dir=str(cache))
    (file,) = cache.glob("btf-*.json")
    for junk in ("[" * 100000, "{" * 100000, '{"task_struct:pid": [1]}', "[1, 2]", "\xff\xfe"):
        file.write_text(junk, errors="surrogateescape")
        btf._OFFSETS.clear()
        assert btf.member_offsets(btf.VMLINUX_BTF, members, cache_dir=str(cache)) == want, junk
    assert cachedir.file_sha256(btf.VMLINUX_BTF) in file.name


def test_control_characters_in_names_reach_the_terminal_escaped(tmp_path):
    from pyoffcpu.terminal import safe
    assert safe("a\x1b]2;pwned\x07b\x9bc\n\td") == "a\\x1b]2;pwned\\x07b\\x9bc\n\td"
    a, b = tmp_path / "a.folded", tmp_path / "b.folded"
    a.write_text("process 1 x;thread 1 x;evil\x1b]2;pwned\x07 (a.py:1) 100\nprocess 1 x;thread 1 x;other 900\n")
    b.write_text("process 1 x;thread 1 x;evil\x1b]2;pwned\x07 (a.py:1) 900\nprocess 1 x;thread 1 x;other 100\n")
    res = run_cli("diff", str(a), str(b), "-o", str(tmp_path / "d.svg"))
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    assert b"\x1b" not in out and b"\x07" not in out and b"\\x1b]2;pwned\\x07" in out, out


def snapshot_dir(tmp_path, entries):
    d = tmp_path / "snaps"
    d.mkdir(mode=0o755)
    (d / "index.json").write_text(entries if isinstance(entries, str) else __import__("json").dumps(
        {"version": 1, "entries": entries, "runs": []}))
    return d


GOOD_ENTRY = {"time": 1.7e9, "host": "h", "pid": 5, "name": "train", "cmdline": "python train.py",
              "on_cpu_ns": 10, "off_cpu_ns": 20, "top": [], "files": {"svg": {"path": "h/2026-01-01/a.svg",
                                                                              "bytes": 3, "inode": 1}}}


def test_report_links_only_relative_paths(tmp_path):
    bad = [dict(GOOD_ENTRY, pid=6, files={"svg": {"path": "javascript:alert(document.domain)", "bytes": 1}}),
           dict(GOOD_ENTRY, pid=7, files={"svg": {"path": "/etc/passwd", "bytes": 1}}),
           dict(GOOD_ENTRY, pid=8, files={"svg": {"path": "../../etc/passwd", "bytes": 1}})]
    d = snapshot_dir(tmp_path, [GOOD_ENTRY] + bad)
    res = run_cli("report", str(d), "-o", str(tmp_path / "r.html"))
    assert res.returncode == 0, res.stderr
    page = (tmp_path / "r.html").read_text()
    hrefs = __import__("re").findall(r'href="([^"]*)"', page)
    assert hrefs == ["snaps/h/2026-01-01/a.svg"], hrefs


@pytest.mark.parametrize("index", [
    '{"entries": [{"time": "x", "files": {}}]}', '{"entries": [{"time": 1}], "runs": 3}',
    '{"entries": [{"time": 1, "files": []}]}', '{"entries": [{"time": 1, "top": [{"ns": "a"}]}]}',
    '{"entries": [{"time": 1, "files": {"svg": {"bytes": 1}}}]}', "[" * 100000, '"entries"', "{}",
    '{"entries": [{"time": 1e400}]}'])
def test_a_damaged_index_gives_a_line_never_a_traceback(tmp_path, index):
    d = snapshot_dir(tmp_path, index)
    res = run_cli("report", str(d), "-o", str(tmp_path / "r.html"))
    err = res.stderr.decode()
    assert res.returncode in (0, 1) and "Traceback" not in err and err.count("\n") <= 1, err
    res = run_cli("snapshot", "--dir", str(d), "-p", "1", "-d", "0.2", timeout=120)
    err = res.stderr.decode()
    assert "Traceback" not in err, err


# -- what root writes and deletes: snapshot's directory -----------------------------------------------
def snapshot(d, timeout=120):
    return subprocess.run(pyoffcpu_cmd("snapshot", "--dir", str(d), "-p", "1", "-d", "0.2"), env=env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("how", ["nobody's", "world-writable", "a symlink"])
def test_snapshot_refuses_a_directory_others_can_change(tmp_path, nobody_dir, how):
    if how == "nobody's":
        d = nobody_dir
    elif how == "world-writable":
        d = tmp_path / "open"
        d.mkdir()
        os.chmod(d, 0o777)
    else:
        real = tmp_path / "real"
        real.mkdir()
        d = tmp_path / "link"
        d.symlink_to(real)
    res = snapshot(d)
    assert res.returncode == 1 and res.stderr.count("\n") == 1 and "cannot use" in res.stderr, res.stderr
    assert not (pathlib.Path(d) / "index.json").exists() and not (pathlib.Path(d) / ".lock").exists()


def test_the_lock_is_never_followed(tmp_path):
    d = tmp_path / "snaps"
    d.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (d / ".lock").symlink_to(victim)
    res = snapshot(d)
    assert res.returncode != 0 and "a symbolic link" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert victim.read_text() == "precious\n"


def test_retention_deletes_only_the_files_it_wrote(tmp_path):
    """An old entry that names a file of the same path but another inode (or
    size), or a path of another shape: nothing is deleted.  An entry that
    matches what was written: deleted."""
    import json
    d = tmp_path / "snaps"
    day = d / "h" / "2020-01-01"
    day.mkdir(parents=True)
    mine, other, swapped = day / "mine.svg", day / "other.svg", day / "swapped.svg"
    for f in (mine, other, swapped):
        f.write_text("<svg/>")
    st = mine.stat()
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    entries = [dict(GOOD_ENTRY, time=1.0, files={"svg": {"path": "h/2020-01-01/mine.svg", "bytes": st.st_size,
                                                          "inode": st.st_ino}}),
               dict(GOOD_ENTRY, time=1.0, pid=6, files={"svg": {"path": "h/2020-01-01/other.svg",
                                                                "bytes": st.st_size, "inode": st.st_ino}}),
               dict(GOOD_ENTRY, time=1.0, pid=7, files={"svg": {"path": "h/2020-01-01/swapped.svg",
                                                                "bytes": 999, "inode": swapped.stat().st_ino}}),
               dict(GOOD_ENTRY, time=1.0, pid=8, files={"svg": {"path": "../outside.txt", "bytes": 4,
                                                                "inode": outside.stat().st_ino}})]
    (d / "index.json").write_text(json.dumps({"version": 1, "entries": entries, "runs": []}))
    res = snapshot(d)
    assert "Traceback" not in res.stderr, res.stderr
    assert not mine.exists()
    assert other.exists() and swapped.exists() and outside.read_text() == "keep"


# -- caches keyed by what they were built from ---------------------------------------------------
def test_a_library_that_claims_libcs_build_id_never_gives_libc_its_table(tmp_path):
    """A user's small library whose build-id note says libc's: its table is
    built first into the cache; libc's table must still be libc's."""
    from pyoffcpu.native.elfcache import ElfCache
    from pyoffcpu.native.unwind import table as T
    libc = "/usr/lib/x86_64-linux-gnu/libc.so.6"
    cache = ElfCache()
    bid_libc, bid_z = cache.get(libc).build_id, cache.get(LIBZ).build_id
    assert bid_libc and bid_z and len(bid_libc) == len(bid_z)
    data = open(LIBZ, "rb").read()
    assert data.count(bytes.fromhex(bid_z)) == 1
    fake = tmp_path / "libfake.so"
    fake.write_bytes(data.replace(bytes.fromhex(bid_z), bytes.fromhex(bid_libc)))
    assert ElfCache().get(str(fake)).build_id == bid_libc
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    first = T.TableCache(str(d)).get(str(fake), bid_libc)
    got = T.TableCache(str(d)).get(libc, bid_libc)          # a new session, the same disk cache
    want = T.build_now(libc)                                # libc's own, built afresh
    assert first is not None and got is not None
    assert T.serialize(got) == T.serialize(want), (got.nrows, want.nrows, first.nrows)


def test_a_library_that_claims_libcs_build_id_never_gives_libc_its_names(tmp_path):
    """A user's copy of libc with one name changed in .dynstr, far from the
    first and last 4 KiB: the same build-id, size and headers.  Its
    identity (what parses and symbol indexes are shared and cached by) must
    differ, so that neither file is named from the other's symbols, in one
    session or through the identities kept on disk."""
    from pyoffcpu.native.elfcache import ElfCache, IdentityMemo
    from pyoffcpu.native.symbols import Symbolizer
    libc = "/usr/lib/x86_64-linux-gnu/libc.so.6"
    data = open(libc, "rb").read()
    assert data.count(b"\0qsort_r\0") == 1
    fake = tmp_path / "libfake.so"
    fake.write_bytes(data.replace(b"\0qsort_r\0", b"\0qsort_x\0"))
    os.chown(fake, pwd.getpwnam("nobody").pw_uid, -1)      # a user's file: root did not write it
    memo_dir = tmp_path / "memo"
    for memo in (None, IdentityMemo(str(memo_dir)), IdentityMemo(str(memo_dir))):
        cache = ElfCache(memo)
        sym = Symbolizer(debug_dirs=[], elf_cache=cache)
        ef, el = sym.elf_for_path(str(fake)), sym.elf_for_path(libc)
        assert ef.image.build_id == el.image.build_id
        assert ef.image.identity != el.image.identity and cache.parses == 2
        names_f = {n for _s, _e, n in ef.symbols()}
        names_l = {n for _s, _e, n in el.symbols()}
        assert "qsort_x" in names_f and "qsort_r" not in names_f
        assert "qsort_r" in names_l and "qsort_x" not in names_l
        if memo is not None:
            memo.save()


def test_the_identities_kept_on_disk_are_read_only_when_ours_and_sound(tmp_path):
    """IdentityMemo's file: a damaged, deep, huge or linked one is read as
    empty (every file hashed again); a directory others can write is not
    used."""
    from pyoffcpu.native.elfcache import ElfCache, IdentityMemo
    libc = "/usr/lib/x86_64-linux-gnu/libc.so.6"
    d = tmp_path / "memo"
    want = ElfCache().identity(libc)
    memo = IdentityMemo(str(d))
    assert ElfCache(memo).identity(libc) == want
    memo.save()
    cache = ElfCache(IdentityMemo(str(d)))
    assert cache.identity(libc) == want and cache.identifies == 0        # from the disk
    file = d / IdentityMemo.FILE
    for junk in ("[" * 100000, "{}", '[[1, 2, 3, 4, 5, "x", 1, "y"]]', "\x00" * 100, " " * (9 << 20)):
        file.write_text(junk)
        cache = ElfCache(IdentityMemo(str(d)))
        assert cache.identity(libc) == want and cache.identifies == 1, junk[:20]
    file.unlink()
    os.symlink("/etc/passwd", file)
    cache = ElfCache(IdentityMemo(str(d)))
    assert cache.identity(libc) == want and cache.identifies == 1
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    assert IdentityMemo(str(open_dir)).path is None


def test_a_file_changed_within_a_clock_tick_is_not_cached_on_disk(tmp_path):
    """The stat identity (device, inode, size, mtime, ctime) tells files
    apart only once their ctime is settled: a file written again in the tick
    of its last change keeps its ctime.  A fresh file's table is kept for
    this session, never on disk; a settled one's is."""
    from pyoffcpu.native.elfcache import STAT_SETTLED_NS
    from pyoffcpu.native.unwind import table as T
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    lib = tmp_path / "libfresh.so"
    shutil.copyfile(LIBZ, lib)
    cache = T.TableCache(str(d))
    key = cache.key_of(str(lib), None)
    assert key.startswith(T.UNSETTLED_KEY) and cache.path_of(key) is None
    assert cache.get(str(lib), None) is not None and cache.built == 1
    assert not list(d.glob("*.tbl"))
    os.utime(lib, ns=(0, 0))                    # ctime: now again
    time.sleep(STAT_SETTLED_NS / 1e9 + 0.1)
    cache = T.TableCache(str(d))
    key = cache.key_of(str(lib), None)
    assert not key.startswith(T.UNSETTLED_KEY)
    assert cache.get(str(lib), None) is not None and [p.name for p in d.glob("*.tbl")] == [key + ".tbl"]
    assert T.TableCache(str(d)).get(str(lib), None).nrows == cache.get(str(lib), None).nrows


# -- allocations sized by what a file holds -------------------------------------------------------
HIGH_SPIN = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
lib.high.argtypes = [ctypes.c_long]
def spin():
    while True:
        lib.high(2000000)
print("ready", flush=True)
spin()
"""


@pytest.fixture
def high_library(tmp_path):
    so = tmp_path / "libhigh.so"
    subprocess.run(["gcc", "-O1", "-fomit-frame-pointer", "-shared", "-fPIC", "-o", str(so),
                    os.path.join(WORKLOADS, "high_section.c"),
                    "-Wl,--section-start=.hightext=0x40000000"], check=True)
    return str(so)


def test_a_library_spanning_a_gigabyte_gets_an_index_sized_by_its_rows(high_library):
    """Its page index: at most max_pages(rows) entries, not one per 4 KiB of
    the 1 GiB span; the helper writes the same table; every address of both
    functions finds the row a 4 KiB index would."""
    from pyoffcpu.native import helper
    from pyoffcpu.native.unwind import table as T
    from reference import unwind_table as RT
    if not helper.available():
        pytest.skip(f"{helper.BINARY} is not built (make helper)")
    data = helper.run(["table"], high_library)
    t = T.deserialize(data)
    assert 0 < t.npages < 1000, (t.npages, t.nrows)          # was 262,145
    assert t.npages <= T.max_pages(t.nrows)
    with open(high_library, "rb") as f:
        assert data == RT.table_bytes(f, high_library)
    plain = T.UnwindTable(t.base, t.rows, RT._page_index(
        [t.row(i)[0] for i in range(t.nrows)], T.PAGE_SHIFT), None, 0, T.PAGE_SHIFT)
    assert plain.npages > 200000                        # what it was
    for start in (0x1000, 0x40000000):
        for a in range(start, start + 0x200):
            assert t.lookup(a) == plain.lookup(a), hex(a)
    T.deserialize(T.serialize(t))                       # and it reads back


def test_bpf_walks_through_both_ends_of_the_span(tmp_path, bpf, high_library):
    """low() at the bottom of the span called from high() at 0x40000000,
    called from Python: the stacks through low are Python's spin, high, low."""
    from conftest import Workload, record_folded
    python = python_or_skip("pyenv-3.11")
    w = Workload(python, None, argv=[python, "-c", HIGH_SPIN, high_library])
    try:
        _, prof = record_folded(tmp_path, "-p", str(w.pid), "-d", "2", "-F", "499", "--mode", "cpu")
    finally:
        w.proc.kill()
        w.proc.wait()
    through = {tuple(f.name for f in k.frames): n for k, n in prof.weights.items()
               if any(f.name == "low" for f in k.frames)}
    good = sum(n for names, n in through.items() if names[-2:] == ("high", "low") and "spin" in names)
    total = sum(through.values())
    assert total > 0 and good >= 0.95 * total, sorted(through.items(), key=lambda x: -x[1])[:5]


# a process's own peak RSS: VmHWM (ru_maxrss would carry the test process's
# over the exec of a vfork)
HWM = """
def hwm_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) >> 10
"""

SPARSE_READER = HWM + """
import sys, time
t0 = time.monotonic()
from pyoffcpu.native.elfcache import ElfCache
from pyoffcpu.native.elffile import identify
from pyoffcpu.native.unwind import table as T
path = sys.argv[1]
cache = ElfCache()
named = cache.get(path, symbols=True)
elf = cache.get(path)
ident = identify(open(path, "rb"))
try:
    T.build_now(path)
    table = "built"
except Exception as e:
    table = type(e).__name__
print(named is None and elf is not None and elf.symbols_failed, ident is not None, table,
      hwm_mib(), round(time.monotonic() - t0, 1))
"""


def test_a_sparse_file_claiming_gigabyte_sections_is_read_bounded(tmp_path):
    """A library whose .dynsym, .dynstr and .eh_frame claim 4 GiB each,
    in a file made 9 GiB by a hole (which costs its maker nothing): its
    symbols and table are refused, not read (the table by the helper, which
    exits with its reason); under 250 MiB and 30 s."""
    from elftools.elf.elffile import ELFFile
    data = bytearray(open(LIBZ, "rb").read())
    with open(LIBZ, "rb") as f:
        elf = ELFFile(f)
        shoff, entsize = elf["e_shoff"], elf["e_shentsize"]
        patched = [i for i, s in enumerate(elf.iter_sections())
                   if s.name in (".dynsym", ".dynstr", ".eh_frame")]
    assert len(patched) == 3
    for i in patched:           # Elf64_Shdr: sh_size at byte 32
        data[shoff + i * entsize + 32:shoff + i * entsize + 40] = ((4 << 30) // 24 * 24).to_bytes(8, "little")
    lib = tmp_path / "libsparse.so"
    lib.write_bytes(bytes(data))
    os.truncate(lib, 9 << 30)
    res = subprocess.run([sys.executable, "-c", SPARSE_READER, str(lib)],
                         capture_output=True, text=True, timeout=120, env=env())
    assert res.returncode == 0, res.stderr
    failed, identified, table, rss_mib, seconds = res.stdout.split()
    assert (failed, identified, table) == ("True", "True", "HelperError"), res.stdout
    assert int(rss_mib) < 250 and float(seconds) < 30, res.stdout


# -- every reader of a file we did not write ------------------------------------------------------
def test_diff_and_report_survive_random_and_mutated_files(tmp_path):
    """tests/fuzz_inputs.py for PYOFFCPU_FUZZ_SECONDS (default 30): folded,
    pprof and index files, random and mutated from real ones, through diff
    and report in one process.  Every run exits 0 or 1 without a
    traceback, and the process stays under 400 MiB.  The seed changes per
    run and is in the message: `python tests/fuzz_inputs.py 30 SEED DIR`
    replays it."""
    seconds = float(os.environ.get("PYOFFCPU_FUZZ_SECONDS", "30"))
    seed = int(time.time() * 1000) % 1_000_000
    e = env()
    e["PYOFFCPU_MAX_INPUT_MB"] = "16"           # the bound itself is tested above, at 16 MiB
    res = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "fuzz_inputs.py"),
                          str(seconds), str(seed), str(tmp_path)],
                         capture_output=True, text=True, timeout=seconds + 120, env=e)
    assert res.returncode == 0, f"seed {seed}:\n{res.stdout[-6000:]}\n{res.stderr[-2000:]}"
    _, runs, _, rss = res.stdout.split()
    assert int(runs) > 100 and int(rss) < 400, res.stdout


def test_all_processes_beside_a_fifo_trap(tmp_path, bpf, fifo_trap):
    """-a beside the trap and three Python processes, ended by SIGTERM:
    it ends within 5 s of it, the three are profiled in full, and the trap
    too (its library is read through /proc/PID/map_files, the file it
    really maps, never through the FIFO at its path): a native process,
    asleep the whole time."""
    import signal
    from conftest import wait_for_recording
    from pyoffcpu.profile.model import FrameKind, from_folded
    python = python_or_skip("pyenv-3.12")
    spinners = [subprocess.Popen([python, os.path.join(WORKLOADS, "execs.py"), "after", "120"])
                for _ in range(3)]
    out = tmp_path / "all.folded"
    try:
        rec = subprocess.Popen(pyoffcpu_cmd("-a", "--mode", "wall", "--match", "execs.py|fifo_trap",
                                            "-d", "60", "-o", str(out)),
                               env=env(), stderr=subprocess.PIPE, text=True)
        wait_for_recording(rec, timeout=30)
        time.sleep(3)
        sent = time.monotonic()
        rec.send_signal(signal.SIGTERM)
        _, err = rec.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert rec.returncode == 0 and "Traceback" not in err, err
    assert took < 5, took
    prof = from_folded(out.read_text())
    for p in spinners:
        on = sum(ns for k, ns in prof.weights.items() if k.pid == p.pid and k.off_cpu is None)
        py = sum(ns for k, ns in prof.weights.items() if k.pid == p.pid and k.off_cpu is None
                 and any(f.kind is FrameKind.PYTHON and f.name == "spin" for f in k.frames))
        assert on > 0.5e9 and py >= 0.95 * on, (p.pid, on, py, err[-800:])
    trap = sum(ns for k, ns in prof.weights.items() if k.pid == fifo_trap.pid)
    assert trap >= 2.5e9, (trap, err[-800:])
