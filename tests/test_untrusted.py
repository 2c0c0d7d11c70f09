"""Every target and every file we did not write is untrusted (issue 25):
what a process or a file controls may not block, exhaust or redirect root's
profiler.  Each test is one attack, made as an unprivileged user (nobody)
where it needs one, with what must hold instead."""
import os
import pathlib
import pwd
import shutil
import subprocess
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
    from pyoffcpu.native.elffile import ElfCache, open_regular_file
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(OSError, match="not a regular file"):
        open_regular_file(str(fifo))
    assert ElfCache().get(str(fifo)) is None and ElfCache().identity(str(fifo)) is None
    assert time.monotonic() - start < 1


@pytest.mark.parametrize("command", [["dump", "-p", "{pid}"], ["-p", "{pid}", "-d", "1", "-o", "{out}"]],
                         ids=["dump", "record"])
def test_a_planted_fifo_does_not_hang_root(tmp_path, bpf, fifo_trap, command):
    out = tmp_path / "out.folded"
    args = [a.format(pid=fifo_trap.pid, out=out) for a in command]
    start = time.monotonic()
    res = subprocess.run(pyoffcpu_cmd(*args), env=env(), capture_output=True, text=True, timeout=30)
    took = time.monotonic() - start
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


@pytest.mark.parametrize("command", [["dump", "-p", "{pid}"], ["-p", "{pid}", "-d", "1", "-o", "{out}"]],
                         ids=["dump", "record"])
def test_a_cycle_in_the_interpreter_list_ends(tmp_path, bpf, interpreter_cycle, command):
    out = tmp_path / "out.folded"
    args = [a.format(pid=interpreter_cycle.pid, out=out) for a in command]
    start = time.monotonic()
    res = subprocess.run(pyoffcpu_cmd(*args), env=env(), capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert time.monotonic() - start < 5, res.stderr
    if command[0] == "dump":
        assert "spinner" in res.stdout, res.stdout          # its threads are all there, once
    else:
        assert "spinner" in out.read_text()


# -- files handed over: diff, report, caches ------------------------------------------------------
def run_cli(*args, timeout=60):
    return subprocess.run(pyoffcpu_cmd(*args), env=env(), capture_output=True, timeout=timeout)


def test_a_pprof_that_inflates_to_gigabytes_is_one_line_and_bounded(tmp_path):
    """A 300 KiB .pb.gz of 300 MiB of zeros (over the 256 MiB default):
    diff says so in one line, exit 1, without inflating it whole."""
    import gzip
    import resource
    bomb = tmp_path / "bomb.pb.gz"
    bomb.write_bytes(gzip.compress(b"\0" * (300 << 20), compresslevel=1))
    good = tmp_path / "a.folded"
    good.write_text("process 1 x;thread 1 x;main (a.py:1) 100\n")
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    res = run_cli("diff", str(good), str(bomb), "-o", str(tmp_path / "d.svg"))
    err = res.stderr.decode()
    assert res.returncode == 1 and err.count("\n") == 1 and "PYOFFCPU_MAX_INPUT_MB" in err, err
    assert "Traceback" not in err
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert max(peak, before) < 600 << 10, peak        # KiB: well under the 4 GB the bomb took


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
    from pyoffcpu.native.elffile import ElfCache
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
    with open(libc, "rb") as f:
        want = T.table_from_elf(f, libc)
    assert first is not None and got is not None
    assert T.serialize(got) == T.serialize(want), (got.nrows, want.nrows, first.nrows)
