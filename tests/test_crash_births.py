"""Processes born after the watcher started (issue 39): BPF tells the
watcher of each exec and fork at once (births), and it reads the process
then, instead of at its next scan of /proc.  Every watcher here scans once,
at its start (--rescan 60): a report with Python frames can only come from
the birth.  Known truth: the line each workload (tests/workloads/early_crash.py)
dies at, 0.1-0.2 s after its start or while it imports a module."""
import os
import resource
import signal
import subprocess

import pytest

from conftest import CHROOT_INTERPRETERS, WORKLOADS, chroot_cmd, chroot_workloads, python_or_skip, source_line
from test_crashes import LABEL_RE, Watcher, report_of

LABELS = ["debian-3.11", "pyenv-3.12", "debian-3.14"]   # static, shared libpython, the chroot's


def line(marker, script="early_crash.py"):
    return source_line(script, marker)


def py_frames(d, script="early_crash.py"):
    """[(function, line)] of the crashed thread's Python frames in `script`."""
    out = []
    for f in d["threads"][0]["frames"]:
        m = LABEL_RE.match(f)
        if m and os.path.basename(m.group(2)) == script:
            out.append((m.group(1), int(m.group(3))))
    return out


def argv_for(label, *args):
    interp = CHROOT_INTERPRETERS.get(label)
    if interp is None:
        return [python_or_skip(label), os.path.join(WORKLOADS, "early_crash.py"), *args]
    python_or_skip(label)
    inner = chroot_workloads(interp.chroot)
    return chroot_cmd(label, inner + "/early_crash.py", *args)


def run_to_crash(w, argv, out_at):
    """Runs argv without a core; (its pid, the report of its crash)."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
    out, _ = p.communicate(timeout=60)
    return p, out, report_of(w.wait_for(w.out, f"crash: process {p.pid} ", after=out_at))


@pytest.fixture(scope="module")
def watcher(tmp_path_factory, bpf):
    w = Watcher(str(tmp_path_factory.mktemp("births") / "reports"), "--rescan", "60")
    yield w
    assert w.stop() == 0, "\n".join(w.err[-20:])
    # the reports came from births: one scan in all, the one at the start
    assert sum("scanned /proc" in ln for ln in w.err) == 1, w.err


@pytest.mark.parametrize("label", LABELS)
def test_a_crash_soon_after_the_start_has_its_python_line(watcher, label):
    p, _, d = run_to_crash(watcher, argv_for(label, "soon", "0.2"), len(watcher.out))
    assert p.returncode == -11
    assert d["fatal"]["signal"] == "SIGSEGV" and d["fatal"]["address"] == 8, d["fatal"]
    assert py_frames(d) == [("soon", line("SOON_LINE")), ("main", line("SOON_CALL")),
                            ("<module>", line("MAIN_LINE"))], (d["threads"][0]["frames"], d["notes"])


@pytest.mark.parametrize("label", LABELS)
def test_a_crash_at_import_has_its_python_line(watcher, label):
    """Its interpreter seen before (the test above, or a first run here):
    the crash while the second module is imported, ~30 ms after the
    start, has the module's line and the import's."""
    run_to_crash(watcher, argv_for(label, "soon", "0"), len(watcher.out))
    p, _, d = run_to_crash(watcher, argv_for(label, "import"), len(watcher.out))
    assert p.returncode == -11
    assert py_frames(d, "early_crash_mod.py") == [("<module>", line("MOD_LINE", "early_crash_mod.py"))], \
        d["threads"][0]["frames"]
    assert py_frames(d) == [("main", line("IMPORT_LINE")), ("<module>", line("MAIN_LINE"))], \
        d["threads"][0]["frames"]


@pytest.mark.parametrize("before, after", [(0, 0.1), (0.5, 0)])
def test_a_forked_child_has_its_python_line(watcher, before, after):
    """A child forked `before` s after its parent's start crashes `after` s
    after the fork.  At once (0 s): only BPF can have registered it, from
    its parent's registration at the fork (the parent, 0.5 s old, was read
    at its birth); 0.1 s after its parent's start and its own, either way."""
    p, out, d = run_to_crash_child(watcher, argv_for("pyenv-3.12", "fork", str(after), str(before)))
    assert py_frames(d) == [("child", line("CHILD_LINE")), ("main", line("FORK_LINE")),
                            ("<module>", line("MAIN_LINE"))], (d["threads"][0]["frames"], d["notes"])


def run_to_crash_child(w, argv):
    out_at = len(w.out)
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
    out, _ = p.communicate(timeout=60)
    child = int(out.split()[0])
    return p, out, report_of(w.wait_for(w.out, f"crash: process {child} ", after=out_at))


@pytest.fixture(scope="module")
def native_wait(tmp_path_factory):
    exe = tmp_path_factory.mktemp("native") / "native_wait"
    subprocess.run(["gcc", "-O2", "-o", str(exe), os.path.join(WORKLOADS, "native_wait.c")], check=True)
    return str(exe)


def test_a_native_program_read_at_its_birth_is_not_reported_without_all(watcher, native_wait):
    """Without -a, a C program read at its birth is not Python: not
    watched, and its crash gets no report."""
    out_at, err_at = len(watcher.out), len(watcher.err)
    p = subprocess.Popen([native_wait], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
    assert p.stdout.readline().strip() == "ready"
    watcher.wait_for(watcher.err, f"process {p.pid}: read ", after=err_at)
    p.communicate("go\n", timeout=30)
    assert p.returncode == -11
    # a Python crash after it: its line comes, and none before it for the C program
    run_to_crash(watcher, argv_for("debian-3.11", "soon", "0"), out_at)
    assert not [ln for ln in watcher.out[out_at:] if f"process {p.pid} " in ln], watcher.out[out_at:]


def test_a_crash_before_the_watcher_read_the_process_is_reported_as_such(watcher, native_wait):
    """A program that crashes while the watcher is busy (stopped here) is
    gone before the watcher reads its birth: what BPF captured is reported
    (the signal, the registers, the kernel stack), with a note that says
    why no more; never dropped without a word."""
    out_at = len(watcher.out)
    os.kill(watcher.proc.pid, signal.SIGSTOP)
    try:
        p = subprocess.Popen([native_wait, "now"],
                             preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
        assert p.wait(timeout=30) == -11
    finally:
        os.kill(watcher.proc.pid, signal.SIGCONT)
    d = report_of(watcher.wait_for(watcher.out, f"crash: process {p.pid} ", after=out_at))
    assert d["fatal"]["signal"] == "SIGSEGV" and d["fatal"]["address"] == 0, d["fatal"]
    assert d["threads"][0]["kernel"][-1] == "asm_exc_page_fault", d["threads"][0]
    assert any("not read by the watcher before it crashed" in n for n in d["notes"]), d["notes"]
