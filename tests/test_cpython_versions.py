"""Every CPython on this machine, real BPF: one ~3 s recording per interpreter of
tests/workloads/known_stacks.py, whose threads each sit in a stack the test
knows frame by frame (qualified name -- plain name before 3.11 -- file, line).

For each interpreter:
* the known stacks (nested functions, a method, a generator, a lambda,
  Latin-1/UCS-2/UCS-4 names, a coroutine run by asyncio, a class __init__, a
  thread started during the recording, a sub-interpreter on 3.12+) are exact in
  >= 99% of the time sampled inside them (on- and off-CPU);
* a thread blocked in lock.acquire (GIL released) has its Python stack in its
  off-CPU time;
* a 300-deep recursion keeps its innermost frames under a `[truncated]` marker;
* no garbage: no unreadable code objects, the right version is reported.

Interpreters: the named matrix in conftest.py (CPYTHON_MATRIX: the newest
pyenv release of 3.7 .. 3.13 under $PYENV_ROOT or ~/.pyenv, and Debian's
/usr/bin/python3.11). A missing one is a skip here and a failure in CI
(PYOFFCPU_REQUIRE_BPF=1); the matrix is checked against SUPPORTED.
"""
import os
import re
import signal
import subprocess

import pytest

from conftest import (CHROOT_INTERPRETERS, CHROOT_LABELS, CPYTHON_MATRIX, INTERPRETERS,
                      MATRIX_LABELS, WORKLOADS, NsWorkload, Workload, chroot_cmd, chroot_ns_cmd,
                      chroot_workloads, env, pyoffcpu_cmd, python_or_skip, wait_for_recording)
from pyoffcpu.cpython.detect import SUPPORTED
from pyoffcpu.profile.model import TRUNCATED, FrameKind, from_folded

DURATION = 3
FREQUENCY = 499
THRESHOLD = 0.99
WORKLOAD = os.path.join(WORKLOADS, "known_stacks.py")
SUBCASE = os.path.join(WORKLOADS, "subinterp_case.py")




def _markers(path):
    with open(path, encoding="utf-8") as f:
        return {m.group(1): n for n, line in enumerate(f, 1)
                for m in [re.search(r"# L:(\w+)", line)] if m}


L = _markers(WORKLOAD)
LS = _markers(SUBCASE)


def _expected(minor, wdir=WORKLOADS):
    """case -> (entry frame, frames from the entry down to the leaf or None,
    innermost frames when the middle varies (asyncio's loop)); `wdir`: the
    workloads directory as the target sees it (another inside a chroot)."""
    workload, subcase = os.path.join(wdir, "known_stacks.py"), os.path.join(wdir, "subinterp_case.py")

    def fr(qualname, tag, file=workload, lines=L):
        name = qualname if minor >= (3, 11) else qualname.rsplit(".", 1)[-1]
        return (name, file, lines[tag])
    burn = fr("burn", "burn")
    return {
        "nested": [fr("case_nested", "case_nested"), fr("outer", "outer"),
                   fr("outer.<locals>.inner", "inner"), fr("Wörker.méthode", "method"),
                   fr("Wörker.gen", "gen"), fr("Wörker.gen.<locals>.<lambda>", "gen"),
                   fr("计算", "cjk"), fr("𠀀", "astral"), burn],
        "async": ([fr("case_async", "case_async")],
                  [fr("main_coro", "main_coro"), fr("child_coro", "child_coro"), burn]),
        "init": [fr("case_init", "case_init"), fr("Klass.__init__", "init"), burn],
        "lock": [fr("case_lock", "case_lock"), fr("wait_lock", "acquire")],
        "late": [fr("case_late", "case_late"), burn],
        "subinterp": [("<module>", "<script>" if minor >= (3, 14) else "<string>", 1),
                      fr("sub_case", "sub_case", subcase, LS),
                      fr("sub_burn", "sub_burn", subcase, LS)],
    }


def _py(key):
    return [(f.name, f.file, f.line) for f in key.frames if f.kind is FrameKind.PYTHON]


def _matches(frames, want):
    """Do the Python frames, from the entry frame on, equal `want`?"""
    if isinstance(want, tuple):                 # (head, tail): anything in between
        head, tail = want
        entry = frames.index(head[0])
        return (frames[entry:entry + len(head)] == head and frames[-len(tail):] == tail
                and entry + len(head) <= len(frames) - len(tail))
    entry = frames.index(want[0])
    return frames[entry:] == want


def _share(prof, tid, want, off_cpu=None):
    """(exact ns, inside ns): time of thread `tid` inside the stack (its entry
    frame present) and how much of it has exactly the expected frames."""
    entry = (want[0] if isinstance(want, tuple) else want)[0]
    inside = exact = 0
    for key, ns in prof.weights.items():
        if key.tid != tid or (off_cpu is not None and (key.off_cpu is not None) != off_cpu):
            continue
        frames = _py(key)
        if entry not in frames:
            continue
        inside += ns
        if _matches(frames, want):
            exact += ns
    return exact, inside


class Run:
    def __init__(self, label, python, minor, version, workload, tids, prof, stderr,
                 wdir=WORKLOADS, root=""):
        self.label, self.python, self.minor, self.version = label, python, minor, version
        self.workload, self.tids, self.prof, self.stderr = workload, tids, prof, stderr
        self.wdir, self.root = wdir, root           # as the target sees them; root "" = the host

    def expected(self, case):
        return _expected(self.minor, self.wdir)[case]


# Every interpreter of the matrix, the chroot's (Debian testing's 3.14, 3.14d,
# 3.15, 3.15d, 3.15 from libpython3.15.so, a free-threaded 3.13t:
# tools/build-chroot.sh), and Debian's 3.14 and 3.15 once more as containers:
# in PID and mount namespaces of their own, where the ids they see are not the
# host's.
NS_LABELS = {"debian-3.14-ns": "debian-3.14", "debian-3.15-ns": "debian-3.15"}
RUN_LABELS = MATRIX_LABELS + CHROOT_LABELS + sorted(NS_LABELS)


def test_matrix_names_every_supported_minor():
    """The named matrix covers every minor in SUPPORTED: pyenv's shared
    builds for 3.7-3.13, Debian's static 3.11, and Debian testing's 3.14 and
    3.15 in the chroot (static, debug and, for 3.15, shared); no label twice."""
    assert len(set(MATRIX_LABELS)) == len(MATRIX_LABELS), MATRIX_LABELS
    pyenv = {i.minor for i in CPYTHON_MATRIX if i.label.startswith("pyenv-")}
    assert pyenv == set(SUPPORTED) - {(3, 14), (3, 15)}, (sorted(pyenv), SUPPORTED)
    for minor in ((3, 14), (3, 15)):
        for suffix in ("", "d"):
            label = "debian-%d.%d%s" % (minor + (suffix,))
            assert CHROOT_INTERPRETERS[label].minor == minor, label
    assert CHROOT_INTERPRETERS["debian-3.15-shared"].minor == (3, 15)
    assert "debian-3.11" in INTERPRETERS and INTERPRETERS["debian-3.11"].minor == (3, 11)
    for i in CPYTHON_MATRIX:
        assert i.label.endswith("-%d.%d" % i.minor), i.label


@pytest.fixture(scope="module", params=RUN_LABELS)
def run(request, tmp_path_factory, bpf):
    label = request.param
    base = NS_LABELS.get(label, label)
    python = python_or_skip(base)
    probe = ["-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"]
    interp = CHROOT_INTERPRETERS.get(base)
    if interp is None:
        wdir, root = WORKLOADS, ""
        version_argv = [python, *probe]
        start = lambda: Workload(python, "known_stacks.py", 60)      # noqa: E731
    else:
        wdir, root = chroot_workloads(), interp.chroot
        version_argv = chroot_cmd(base, *probe)
        script = os.path.join(wdir, "known_stacks.py")
        if label in NS_LABELS:
            start = lambda: NsWorkload(None, "known_stacks.py",           # noqa: E731
                                       argv=chroot_ns_cmd(base, script, 60))
        else:
            start = lambda: Workload(None, "known_stacks.py",             # noqa: E731
                                     argv=chroot_cmd(base, script, 60))
    version = subprocess.run(version_argv, capture_output=True, text=True,
                             check=True).stdout.strip()
    minor = tuple(int(x) for x in version.split(".")[:2])
    want_minor = (interp or INTERPRETERS[base]).minor
    assert minor == want_minor, (label, python, version)
    out = tmp_path_factory.mktemp("versions") / (label + ".folded")
    w = start()
    try:
        pid = w.pid
        host = w.host_ids()
        tids = {line.split()[1]: host(int(line.split()[2]))
                for line in w.lines if line.startswith("tid ")}
        proc = subprocess.Popen(pyoffcpu_cmd("-o", str(out), "-p", str(pid), "-d", str(DURATION),
                                             "-F", str(FREQUENCY), "--full-paths"),
                                env=env(), stderr=subprocess.PIPE, text=True)
        try:
            wait_for_recording(proc)
            os.kill(pid, signal.SIGUSR1)              # the late thread starts now
            line = w.proc.stdout.readline().split()
            tids[line[1]] = w.host_ids()(int(line[2]))
            stderr = proc.stderr.read()
            assert proc.wait(timeout=60) == 0, stderr
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        w.stop()
    r = Run(label, python, minor, version, w, tids, from_folded(out.read_text()), stderr,
            wdir, root)
    r.pid = pid
    return r


CASES = ["nested", "async", "init", "late"]


def _check_exact(run, case):
    want = run.expected(case)
    exact, inside = _share(run.prof, run.tids[case], want)
    assert inside > (0.3e9 if case == "late" else 0.5e9), (case, inside, run.stderr)
    share = exact / inside
    print("\n%s %s: %.2f%% of %.2f s exact" % (run.label, case, 100 * share, inside / 1e9))
    assert share >= THRESHOLD, (case, share, _worst(run.prof, run.tids[case], want))


@pytest.mark.parametrize("case", CASES)
def test_known_stack_is_exact(run, case):
    _check_exact(run, case)


def test_subinterpreter_frames(run):
    """3.12+: a thread running a sub-interpreter shows that interpreter's frames
    (the thread's gilstate binding follows the thread state it switches to).
    Before 3.12 the binding stays on the main interpreter's thread state, so
    the workload does not run the case (a known limitation)."""
    if run.minor < (3, 12):
        assert "subinterp" not in run.tids
        return
    _check_exact(run, "subinterp")


def _worst(prof, tid, want):
    """The heaviest stacks of a thread that are not exact, for the message."""
    bad = sorted(((ns, _py(k)) for k, ns in prof.weights.items()
                  if k.tid == tid and not _safe_match(_py(k), want)), reverse=True)
    return bad[:3]


def _outside(prof, tid, want):
    """The heaviest off-CPU stacks of a thread without the entry frame, whole."""
    entry = (want[0] if isinstance(want, tuple) else want)[0]
    bad = sorted(((ns, [f.name for f in k.frames]) for k, ns in prof.weights.items()
                  if k.tid == tid and k.off_cpu is not None and entry not in _py(k)),
                 reverse=True)
    return bad[:3]


def _notes(stderr):
    """The recording's notes on what it lost (drops, unseen switches), for a message."""
    return [line for line in stderr.splitlines()
            if any(w in line for w in ("not seen", "drop", "lost", "skipped", "unknown"))][:8]


def _safe_match(frames, want):
    try:
        return _matches(frames, want)
    except ValueError:
        return False


def test_blocked_thread_has_its_python_stack_off_cpu(run):
    """lock.acquire releases the GIL: the stack comes from the thread's gilstate
    binding, which outlives the GIL (3.12+ clear _Py_tss_tstate then)."""
    tid = run.tids["lock"]
    want = run.expected("lock")
    exact, inside = _share(run.prof, tid, want, off_cpu=True)
    off = run.prof.total_ns(tid=tid, on_cpu=False)
    print("\n%s lock: %.2f%% of %.2f s off-CPU exact" % (run.label, 100 * exact / max(inside, 1),
                                                          inside / 1e9))
    assert off > 0.8 * DURATION * 1e9, off
    assert inside >= THRESHOLD * off, (inside, off, _outside(run.prof, tid, want),
                                       _notes(run.stderr))
    assert exact >= THRESHOLD * inside, _worst(run.prof, tid, want)


def test_deep_recursion_is_truncated_not_lost(run):
    tid = run.tids["recurse"]
    total = run.prof.total_ns(tid=tid)
    kept, misses = 0, []
    for key, ns in run.prof.weights.items():
        if key.tid != tid:
            continue
        frames = _py(key)
        workload = os.path.join(run.wdir, "known_stacks.py")
        leaf = [("burn", workload, L["burn"]), ("recurse", workload, L["recurse_leaf"])]
        if (key.frames and key.frames[0] == TRUNCATED and len(frames) >= 100
                and frames[::-1][:2] == leaf
                and all(f == ("recurse", workload, L["recurse"]) for f in frames[:-2])):
            kept += ns
        else:           # for the message: what the stack was instead
            misses.append((ns, key.frames[0].name if key.frames else None, len(frames), len(key.frames),
                           key.off_cpu, [f.label(True) for f in key.frames[:4]],
                           [f.label(True) for f in key.frames[-6:]]))
    print("\n%s recurse: %.2f%% truncated and exact" % (run.label, 100 * kept / total))
    assert kept >= THRESHOLD * total, sorted(misses, reverse=True)[:5]


def test_no_garbage_frames(run):
    for key in run.prof.weights:
        for f in key.frames:
            if f.kind is not FrameKind.PYTHON:
                continue
            assert not f.name.startswith("[unknown code"), key
            assert f.file.startswith("<") or os.path.isfile(run.root + f.file), f
            # 3.13's _Py_InitCleanup shim is hidden (incomplete frame), 3.12's
            # trampoline (a real code object) too
            assert (f.name, f.file) != ("__init__", "__init__"), key
            assert f.file != "<shim>" and f.name != "<interpreter trampoline>", key


BUILD_KIND = {"debian-3.14d": " debug", "debian-3.15d": " debug", "ft-3.13t": " free-threaded"}


def test_version_and_no_layout_notice(run):
    """The version and the build kind come from the binary and the target's
    _Py_DebugOffsets: Debian's release 3.14 is not taken for a debug build."""
    kind = BUILD_KIND.get(run.label, "")
    assert "CPython %s%s" % (run.version, kind) in run.stderr, run.stderr
    if not kind:
        assert "CPython %s debug" % run.version not in run.stderr, run.stderr
        assert "CPython %s free-threaded" % run.version not in run.stderr, run.stderr
    assert "native stacks only" not in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert "differ from the offsets table" not in run.stderr, run.stderr
    assert "autoTSSkey is" not in run.stderr, run.stderr


def test_container_ids_next_to_the_host_ids(run):
    """In its own PID namespace the interpreter is PID 1 there: the roots
    keep the host's ids (what -p takes) and show the namespace's beside them."""
    pid = run.pid
    if run.label not in NS_LABELS:
        assert run.prof.ns_ids == {}, run.prof.ns_ids
        return
    assert run.prof.ns_ids.get(pid) == 1, run.prof.ns_ids
    for case, tid in run.tids.items():
        assert tid in run.prof.threads, (case, tid)
        assert run.prof.ns_ids.get(tid, 0) not in (0, tid), (case, tid, run.prof.ns_ids)
