"""Crashed processes: `pyoffcpu dump --core` on real cores of known crashes
(tests/workloads/crash_fixture.c called from crashes.py), on every
interpreter issue 29 names.

Known truth: the faulting native chain (cf_inner <- cf_middle <- cf_outer,
ab_inner <- ab_middle <- ab_outer under abort()), the Python lines above it,
the thread blocked at its line, the signal and the faulting address.
"""
import contextlib
import json
import os
import re
import resource
import shutil
import subprocess

import pytest

from conftest import (CHROOT_INTERPRETERS, WORKLOADS, chroot_cmd, chroot_workloads, python_or_skip,
                      run_pyoffcpu, source_line)

LABELS = ["pyenv-3.9", "pyenv-3.11", "pyenv-3.13", "debian-3.11", "debian-3.14"]
CORE_DIR = "/tmp/pyoffcpu-test-cores"       # the same path inside the chroot
LABEL_RE = re.compile(r"^(\S+) \((.*):(\d+)\)$")


def build_fixture(out, extra=()):
    subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-shared", "-fPIC", *extra, "-o", str(out),
                    os.path.join(WORKLOADS, "crash_fixture.c")], check=True)
    return str(out)


@pytest.fixture(scope="module")
def fixture_so(tmp_path_factory):
    return build_fixture(tmp_path_factory.mktemp("crash") / "crash_fixture.so")


@pytest.fixture(scope="module")
def core_pattern():
    """kernel.core_pattern set to CORE_DIR/core.%p for the module, restored after."""
    if os.geteuid() != 0:
        pytest.skip("needs root (kernel.core_pattern)")
    path = "/proc/sys/kernel/core_pattern"
    with open(path) as f:
        old = f.read().rstrip("\n")
    with open(path, "w") as f:
        f.write(CORE_DIR + "/core.%p")
    try:
        yield CORE_DIR
    finally:
        with open(path, "w") as f:
            f.write(old)


def _unlimited_core():
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def make_core(label, so, case, core_dir):
    """Runs crashes.py on `label` until it crashes; (the core's path as we
    read it, {"main": tid, "blocked": tid}, the root to pass to --root)."""
    interp = CHROOT_INTERPRETERS.get(label)
    root = interp.chroot if interp else None
    prefix = root or ""
    os.makedirs(prefix + core_dir, exist_ok=True)
    if interp:
        inner = chroot_workloads(root)
        shutil.copy(so, root + inner + "/crash_fixture.so")
        argv = chroot_cmd(label, inner + "/crashes.py", inner + "/crash_fixture.so", case, proc=True)
    else:
        argv = [python_or_skip(label), os.path.join(WORKLOADS, "crashes.py"), so, case]
    python_or_skip(label)
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60, preexec_fn=_unlimited_core)
    assert res.returncode < 0, (res.returncode, res.stdout, res.stderr)
    tids = {w[1]: int(w[2]) for w in (ln.split() for ln in res.stdout.splitlines()) if w[0] == "tid"}
    core = f"{prefix}{core_dir}/core.{tids['main']}"
    assert os.path.exists(core), f"no core at {core}"
    return core, tids, root


def dump_core(core, *extra):
    res = run_pyoffcpu("dump", "--core", core, "--json", *extra)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def python_frames(frames):
    """[(function, line)] of a thread's labels that are Python frames of crashes.py."""
    out = []
    for f in frames:
        m = LABEL_RE.match(f)
        if m and m.group(2).endswith("crashes.py"):
            out.append((m.group(1), int(m.group(3))))
    return out


def thread(d, tid):
    return next(t for t in d["threads"] if t["tid"] == tid)


def line(marker):
    return source_line("crashes.py", marker)


def check_blocked(d, tids, core=True):
    """The thread blocked in acquire(), at its line (and in futex, where its
    registers are known: a core)."""
    if not any(t["tid"] == tids["blocked"] for t in d["threads"]):
        return False
    t = thread(d, tids["blocked"])
    assert t["syscall"] == "futex" or not core
    assert python_frames(t["frames"])[0] == ("blocked_wait", line("BLOCKED_LINE")), t["frames"]
    return True


def check_null(d, tids, core=True):
    f = d["fatal"]
    assert (f["signal"], f["address"], f["tid"], f["code"]) == ("SIGSEGV", 0, tids["main"], 1), f
    assert d["threads"][0]["tid"] == tids["main"]       # the faulting thread first
    frames = thread(d, tids["main"])["frames"]
    assert frames[:3] == ["cf_inner", "cf_middle", "cf_outer"], frames
    assert python_frames(frames) == [("crash_in_native", line("NULL_LINE")),
                                     ("run_case", line("RUN_NULL_LINE")),
                                     ("main", line("MAIN_LINE")),
                                     ("<module>", line("MODULE_LINE"))], frames
    # the native chain lies under the Python frame that called it
    assert frames.index("cf_outer") < frames.index(next(x for x in frames if x.startswith("crash_in_native")))
    assert check_blocked(d, tids, core)


def check_abort(d, tids, core=True):
    f = d["fatal"]
    assert f["signal"] == "SIGABRT" and f["tid"] not in tids.values(), f
    assert d["threads"][0]["tid"] == f["tid"]
    frames = d["threads"][0]["frames"]
    i = frames.index("abort")
    assert frames[i + 1:i + 4] == ["ab_inner", "ab_middle", "ab_outer"], frames
    assert python_frames(frames) == [("abort_thread", line("ABORT_LINE"))], frames
    if core or any(t["tid"] == tids["main"] for t in d["threads"]):
        main = python_frames(thread(d, tids["main"])["frames"])
        assert main[-3:-1] == [("run_case", line("RUN_JOIN_LINE")), ("main", line("MAIN_LINE"))], main
    assert check_blocked(d, tids, core)


@pytest.mark.parametrize("case", ["null", "abort"])
@pytest.mark.parametrize("label", LABELS)
def test_core_gives_the_exact_faulting_chain(label, case, fixture_so, core_pattern):
    core, tids, root = make_core(label, fixture_so, case, core_pattern)
    try:
        d = dump_core(core, *(["--root", root] if root else []))
        assert d["python"].startswith("%d.%d." % (CHROOT_INTERPRETERS[label].minor if root else
                                                 tuple(int(x) for x in label.split("-")[1].split("."))))
        (check_null if case == "null" else check_abort)(d, tids)
    finally:
        os.unlink(core)


def _strip_source(d):
    d = dict(d)
    d["notes"] = [n for n in d["notes"] if not n.startswith("from core file")]
    return d


def test_systemd_coredump_compressed_cores_read_as_the_plain_one(tmp_path, fixture_so, core_pattern):
    """systemd-coredump keeps cores zstd- (or lz4-) compressed under names
    like core.python3.0.<boot id>.<pid>.<usec>.zst: the same dump as the
    plain core."""
    core, tids, _ = make_core("pyenv-3.11", fixture_so, "null", core_pattern)
    try:
        plain = dump_core(core)
        check_null(plain, tids)
        for tool, ext in (("zstd", "zst"), ("lz4", "lz4")):
            name = tmp_path / f"core.python3\\x2e11.0.0123456789abcdef0123456789abcdef.{tids['main']}.1764770000000000.{ext}"
            with open(core, "rb") as src, open(name, "wb") as dst:
                subprocess.run([tool, "-c"], stdin=src, stdout=dst, check=True)
            d = dump_core(str(name))
            assert any(f"({tool})" in n for n in d["notes"]), d["notes"]
            assert _strip_source(d) == _strip_source(plain)
    finally:
        os.unlink(core)


def test_a_library_rebuilt_since_the_crash_names_no_frame(tmp_path, core_pattern):
    """The fixture rebuilt (other code at the same path) after the crash: its
    build-id is not the core's, so its frames are not named (not named
    wrong), and the note says which file changed."""
    so = build_fixture(tmp_path / "crash_fixture.so")
    core, tids, _ = make_core("pyenv-3.11", so, "null", core_pattern)
    try:
        build_fixture(so, ["-DCHANGED=1", "-O1"])
        d = dump_core(core)
        assert any("changed since the crash" in n and so in n for n in d["notes"]), d["notes"]
        frames = thread(d, tids["main"])["frames"]
        assert not any(x.startswith(("cf_", "ab_")) for x in frames), frames
        # everything else is still there
        assert python_frames(frames)[0] == ("crash_in_native", line("NULL_LINE")), frames
    finally:
        os.unlink(core)


def test_a_crashed_native_program_gets_its_native_stack(tmp_path, core_pattern):
    src = tmp_path / "native_crash.c"
    src.write_text("#include <stdlib.h>\n"
                   "__attribute__((noipa)) int nc_leaf(volatile int *p) { return *p; }\n"
                   "__attribute__((noipa)) int nc_caller(volatile int *p) { int r = nc_leaf(p); "
                   "__asm__ volatile(\"\"); return r; }\n"
                   "int main(void) { int r = nc_caller(0); __asm__ volatile(\"\"); return r; }\n")
    exe = tmp_path / "native_crash"
    subprocess.run(["gcc", "-O2", "-o", str(exe), str(src)], check=True)
    os.makedirs(core_pattern, exist_ok=True)
    p = subprocess.Popen([str(exe)], preexec_fn=_unlimited_core)
    assert p.wait() == -11
    core = f"{core_pattern}/core.{p.pid}"
    try:
        d = dump_core(core)
        assert d["python"] == "" and any("not a CPython process" in n for n in d["notes"])
        assert d["threads"][0]["frames"][:3] == ["nc_leaf", "nc_caller", "main"], d["threads"]
        text = run_pyoffcpu("dump", "--core", core).stdout
        assert "killed by SIGSEGV (SEGV_MAPERR: address not mapped) at address 0x0" in text
    finally:
        os.unlink(core)


def test_what_is_not_a_core_is_one_line_and_exit_1(tmp_path):
    (tmp_path / "text").write_text("hello")
    os.mkfifo(tmp_path / "fifo")
    for path, why in ((tmp_path / "missing", "cannot open"), (tmp_path / "text", "not an ELF core"),
                      (tmp_path / "fifo", "not a regular file"), ("/bin/true", "not a core")):
        res = run_pyoffcpu("dump", "--core", str(path), timeout=20)
        assert res.returncode == 1 and why in res.stderr and "Traceback" not in res.stderr, res.stderr


# -- the watcher: `pyoffcpu crashes` ---------------------------------------------------------------
class Watcher:
    """`pyoffcpu crashes -v` running for the module: its stdout (one line per
    crash) and stderr (what it watches) read by threads into lists."""

    def __init__(self, directory, *args):
        import threading
        from conftest import env, pyoffcpu_cmd
        self.dir = directory
        self.proc = subprocess.Popen(pyoffcpu_cmd("crashes", "--dir", directory, "-vv", "--rescan", "0.3",
                                                  *args),
                                     env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out, self.err = [], []
        for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, i=into: [i.append(ln.rstrip("\n")) for ln in s],
                             daemon=True).start()
        self.wait_for(self.err, "for crashes; reports in", 120)

    def wait_for(self, lines, text, timeout=30, after=0):
        """The first line (from index `after` on) holding text."""
        import time
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = next((ln for ln in list(lines)[after:] if text in ln), None)
            if hit is not None:
                return hit
            assert self.proc.poll() is None, "\n".join(self.err[-20:])
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} in:\n" + "\n".join(lines[-20:]))

    def crash(self, argv, watched_as=""):
        """Runs argv (a program that prints `ready`, then crashes once a line
        comes on stdin) without a core; lets it crash once the watcher
        watches it and a whole scan has passed since `ready` (the mappings
        it has are the ones it crashes with).  {"before": its lines before
        `ready`, "returncode", "stderr", "line": the journal line, "report":
        the JSON report, "text": the text one}."""
        # only what the watcher says from now on: a PID is reused in a long run
        err_at, out_at = len(self.err), len(self.out)
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
        try:
            before = []
            for ln in p.stdout:
                if ln.strip() == "ready":
                    break
                before.append(ln.strip())
            ready_at = len(self.err)
            watching = f"watching process {p.pid} ({watched_as}"
            self.wait_for(self.err, watching, after=err_at)
            seen = next(i for i in range(err_at, len(self.err)) if watching in self.err[i])
            self.wait_for(self.err, "scanned /proc", after=max(ready_at, seen + 1))
            p.stdin.write("go\n")
            p.stdin.flush()
            rc = p.wait(timeout=30)
            line = self.wait_for(self.out, f"crash: process {p.pid} ", after=out_at)
            stderr = p.stderr.read()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        path = line.rsplit(" -> ", 1)[1]
        with open(path[:-len(".txt")] + ".json") as f:
            report = json.load(f)
        with open(path) as f:
            text = f.read()
        return {"before": before, "returncode": rc, "stderr": stderr, "line": line, "report": report,
                "text": text}

    def stop(self):
        self.proc.send_signal(2)
        try:
            return self.proc.wait(timeout=20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def watcher(tmp_path_factory, bpf):
    w = Watcher(str(tmp_path_factory.mktemp("crashes") / "reports"))
    yield w
    assert w.stop() == 0, "\n".join(w.err[-20:])


def crash_under_watcher(w, label, so, case):
    """crashes.py --wait under the watcher: (the report as JSON, its text,
    the tids, the journal line)."""
    interp = CHROOT_INTERPRETERS.get(label)
    if interp:
        inner = chroot_workloads(interp.chroot)
        shutil.copy(so, interp.chroot + inner + "/crash_fixture.so")
        argv = chroot_cmd(label, inner + "/crashes.py", inner + "/crash_fixture.so", case, "--wait",
                          proc=True)
    else:
        argv = [python_or_skip(label), os.path.join(WORKLOADS, "crashes.py"), so, case, "--wait"]
    python_or_skip(label)
    r = w.crash(argv)
    assert r["returncode"] < 0, r
    tids = {ln.split()[1]: int(ln.split()[2]) for ln in r["before"] if ln.startswith("tid ")}
    return r["report"], r["text"], tids, r["line"]


@pytest.mark.parametrize("case", ["null", "abort"])
@pytest.mark.parametrize("label", LABELS)
def test_watcher_catches_the_exact_faulting_chain(watcher, label, case, fixture_so):
    d, text, tids, line_ = crash_under_watcher(watcher, label, fixture_so, case)
    (check_null if case == "null" else check_abort)(d, tids, core=False)
    f = d["fatal"]
    assert f["signal"] in line_ and (f"at {f['address']:#x}" in line_ if case == "null" else True)
    # the kernel stack of the signalled thread: where it entered the kernel
    kernel = d["threads"][0]["kernel"]
    assert "get_signal" in kernel and not any(k.startswith("bpf_prog") for k in kernel), kernel
    if case == "null":
        assert kernel[-1] == "asm_exc_page_fault", kernel


def test_watcher_reports_the_fault_not_faulthandler(watcher, fixture_so):
    """With faulthandler on, SIGSEGV goes to its handler, which prints and
    raises it again: the report is the fault's moment (cf_inner), not the
    handler's raise, and says a handler ran."""
    r = watcher.crash([python_or_skip("pyenv-3.11"), "-X", "faulthandler",
                       os.path.join(WORKLOADS, "crashes.py"), fixture_so, "null", "--wait"])
    assert r["returncode"] < 0 and "Fatal Python error: Segmentation fault" in r["stderr"], r
    tids = {ln.split()[1]: int(ln.split()[2]) for ln in r["before"]}
    check_null(r["report"], tids, core=False)
    assert any("a handler of its own ran first" in n for n in r["report"]["notes"]), r["report"]["notes"]
    # one crash, one report: not a second one of the handler's raise
    import time
    time.sleep(3.0)
    pid = int(r["line"].split()[2])
    after = watcher.out[watcher.out.index(r["line"]) + 1:]
    assert not [ln for ln in after if ln.startswith(f"crash: process {pid} ")], watcher.out


@pytest.fixture(scope="module")
def native_wait(tmp_path_factory):
    exe = tmp_path_factory.mktemp("native") / "native_wait"
    subprocess.run(["gcc", "-O2", "-o", str(exe), os.path.join(WORKLOADS, "native_wait.c")], check=True)
    return str(exe)


def test_watcher_all_gives_a_native_crash_its_native_stack(tmp_path, bpf, native_wait):
    """`crashes -a`: a C program (no Python) that crashes gets its native
    chain, its kernel stack, and no Python part."""
    w = Watcher(str(tmp_path / "reports"), "-a")
    try:
        r = w.crash([native_wait], watched_as="native_wait, native")
    finally:
        assert w.stop() == 0
    assert r["returncode"] == -11
    d = r["report"]
    assert d["python"] == "" and any("not a CPython process" in n for n in d["notes"]), d["notes"]
    assert len(d["threads"]) == 1 and d["fatal"]["address"] == 0
    frames = d["threads"][0]["frames"]
    assert frames[:3] == ["nw_leaf", "nw_caller", "main"], frames
    assert not python_frames(frames)
    assert d["threads"][0]["kernel"][-1] == "asm_exc_page_fault"


def test_a_library_gone_since_the_crash_is_named_in_a_note(tmp_path, core_pattern):
    so = build_fixture(tmp_path / "crash_fixture.so")
    core, tids, _ = make_core("pyenv-3.11", so, "null", core_pattern)
    try:
        os.unlink(so)
        d = dump_core(core)
        assert any(n.startswith("not on this machine") and so in n for n in d["notes"]), d["notes"]
        frames = thread(d, tids["main"])["frames"]
        assert not any(x.startswith("cf_") for x in frames), frames
        assert python_frames(frames)[0] == ("crash_in_native", line("NULL_LINE")), frames
    finally:
        os.unlink(core)


def report_of(line):
    """The JSON report a journal line points to."""
    with open(line.rsplit(" -> ", 1)[1][:-len(".txt")] + ".json") as f:
        return json.load(f)


@contextlib.contextmanager
def python_then_watcher(tmp_path, code, *watcher_args):
    """A pyenv 3.11 process running `code` (it prints `ready`, then waits
    for a line on stdin), and a watcher started after it that scans at its
    start and not again for a minute, once it watches the process:
    (the process, the watcher); both ended after."""
    py = subprocess.Popen([python_or_skip("pyenv-3.11"), "-c", code], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
    w = None
    try:
        assert py.stdout.readline().strip() == "ready"
        w = Watcher(str(tmp_path / "reports"), "--rescan", "60", *watcher_args)
        w.wait_for(w.err, f"watching process {py.pid} (python3.11, CPython")
        yield py, w
    finally:
        if py.poll() is None:
            py.kill()
            py.wait()
        if w is not None:
            assert w.stop() == 0


def test_an_image_replaced_by_exec_is_not_read_with_the_old_ones_layouts(tmp_path, bpf, native_wait):
    """A Python process the watcher registered execs a C program, which
    crashes at once (-a: a native program is watched too).  BPF dropped the
    registration at the exec, so no Python frames of the old image.  The
    watcher reads the new image at its exec: the report is the C program's
    (its chain named from its own mappings), or, when it crashed before
    that read, names nothing from the old image's mappings and says why."""
    code = ("import os, sys; print('ready', flush=True); sys.stdin.readline(); "
            f"os.execv({native_wait!r}, [{native_wait!r}, 'now'])")
    with python_then_watcher(tmp_path, code, "-a") as (py, w):
        py.stdin.write("go\n")
        py.stdin.flush()
        assert py.wait(timeout=30) == -11
        line = w.wait_for(w.out, f"crash: process {py.pid} ")
    d = report_of(line)
    assert len(d["threads"]) == 1
    assert d["python"] == "" and not python_frames(d["threads"][0]["frames"]), d
    frames = d["threads"][0]["frames"]
    if any("exec'd, or its PID was reused" in n for n in d["notes"]):
        # nothing named from the old image (python3.11, libpython, its libraries)
        assert all(f.startswith("[unknown]") or f.startswith("0x") or "@0x" in f
                   or f in ("[jit]", "[unmapped]") for f in frames), frames
    else:
        assert frames[:3] == ["nw_leaf", "nw_caller", "main"], (frames, d["notes"])


def test_a_pid_reused_before_the_next_scan_is_not_read_as_the_old_process(tmp_path, bpf, native_wait):
    """A registered Python process ends; a C program gets its PID (set with
    ns_last_pid) and crashes before the next scan: the report is not the old
    process's (no Python frames, none of its names), whether the watcher read
    the new one at its birth or not."""
    code = "import sys; print('ready', flush=True); sys.stdin.readline()"
    with python_then_watcher(tmp_path, code, "-a") as (py, w):
        pid = py.pid
        py.stdin.write("\n")
        py.stdin.flush()
        assert py.wait(timeout=30) == 0
        for _ in range(50):             # another process may take the PID first: try again
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
            c = subprocess.Popen([native_wait, "now"],
                                 preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
            c.wait(timeout=30)
            if c.pid == pid:
                break
        else:
            pytest.skip(f"PID {pid} could not be had again")
        line = w.wait_for(w.out, f"crash: process {pid} ")
    d = report_of(line)
    # read at its birth (exec) as the new image, or, when it crashed before
    # that, known to be another one than the last scan saw
    assert d["python"] == "" and not python_frames(d["threads"][0]["frames"]), d
    assert any(n.startswith(("it exec'd, or its PID was reused", "not a CPython process",
                             "not read by the watcher")) for n in d["notes"]), d["notes"]
    assert d["name"] == "native_wait"
