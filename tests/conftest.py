"""Shared fixtures: real BPF recordings of real processes.

With PYOFFCPU_REQUIRE_BPF=1 (CI) every skip is turned into a failure: the BPF
tests must run for real there, and so must everything they depend on.
"""
import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = os.path.join(ROOT, "tests", "workloads")
REQUIRE_BPF = os.environ.get("PYOFFCPU_REQUIRE_BPF") == "1"


def source_line(script, marker):
    """The number of the first line of tests/workloads/`script` holding `marker`."""
    with open(os.path.join(WORKLOADS, script)) as f:
        for n, line in enumerate(f, 1):
            if marker in line:
                return n
    raise AssertionError(f"{marker!r} not in {script}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_BPF and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped under PYOFFCPU_REQUIRE_BPF=1: {reason}"


def bpf_unavailable_reason():
    if os.geteuid() != 0:
        return "needs root"
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc (python3-bpfcc) not importable"
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        return "no kernel BTF"
    return None


@pytest.fixture(scope="session")
def bpf():
    reason = bpf_unavailable_reason()
    if reason:
        pytest.skip(reason)


def pyenv_python(minor: str):
    """The newest pyenv CPython X.Y.Z release (no 3.13t, no rc) on this machine, or None."""
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    best = None
    for d in glob.glob(os.path.join(root, "versions", minor + ".*")):
        m = re.fullmatch(re.escape(minor) + r"\.(\d+)", os.path.basename(d))
        exe = os.path.join(d, "bin", "python" + minor)
        if m and os.access(exe, os.X_OK) and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), exe)
    return best[1] if best else None


def debian_python(minor: str):
    """Debian's /usr/bin/pythonX.Y (the real file, not a symlink), or None."""
    exe = "/usr/bin/python" + minor
    return exe if os.path.isfile(exe) and not os.path.islink(exe) and os.access(exe, os.X_OK) else None


class Interpreter:
    """One entry of the CPython matrix: a label, the minor version it must be,
    and where it is found. `chroot` is the root it runs in (None: the host);
    `inner` is then its path as seen inside that root, and path() the path the
    host sees (for reading its ELF file, not for running it)."""

    def __init__(self, label, minor, find, chroot=None, inner=None):
        self.label, self.minor, self._find = label, minor, find
        self.chroot, self.inner = chroot, inner

    def path(self):
        return self._find()

    def __repr__(self):
        return "Interpreter(%r)" % self.label


# The supported CPython matrix (DESIGN.md "Testing"), named here and never
# discovered: a missing interpreter fails CI (PYOFFCPU_REQUIRE_BPF=1) instead of
# shrinking the matrix. pyenv builds are shared (libpython3.X.so), Debian's is
# static. 3.14 and 3.15 run in the chroot (CHROOT_MATRIX below).
CPYTHON_MATRIX = [
    Interpreter("pyenv-3.7", (3, 7), lambda: pyenv_python("3.7")),
    Interpreter("pyenv-3.8", (3, 8), lambda: pyenv_python("3.8")),
    Interpreter("pyenv-3.9", (3, 9), lambda: pyenv_python("3.9")),
    Interpreter("pyenv-3.10", (3, 10), lambda: pyenv_python("3.10")),
    Interpreter("pyenv-3.11", (3, 11), lambda: pyenv_python("3.11")),
    Interpreter("pyenv-3.12", (3, 12), lambda: pyenv_python("3.12")),
    Interpreter("pyenv-3.13", (3, 13), lambda: pyenv_python("3.13")),
    Interpreter("debian-3.11", (3, 11), lambda: debian_python("3.11")),
]
INTERPRETERS = {i.label: i for i in CPYTHON_MATRIX}
MATRIX_LABELS = [i.label for i in CPYTHON_MATRIX]

# The interpreters that run only inside the Debian testing root that
# tools/build-chroot.sh builds (`make test` runs it): their glibc (2.43) is newer
# than the host's. They are kept out of CPYTHON_MATRIX / INTERPRETERS /
# MATRIX_LABELS, whose tests launch the interpreter directly on the host and
# assume labels ending in "-X.Y"; python_or_skip() knows both lists.
CHROOT = os.path.realpath(os.environ.get("PYOFFCPU_CHROOT", "/var/cache/pyoffcpu/chroot/forky"))
CHROOT_WORKLOADS = "/work/pyoffcpu-workloads"     # tests/workloads, copied there (chroot_workloads)


def chroot_python(inner):
    """The host-visible path of the interpreter `inner` (a path inside CHROOT), or None."""
    exe = CHROOT + inner
    return exe if os.path.isfile(exe) and os.access(exe, os.X_OK) else None


def _in_chroot(label, minor, inner):
    return Interpreter(label, minor, lambda: chroot_python(inner), chroot=CHROOT, inner=inner)


CHROOT_MATRIX = [
    _in_chroot("debian-3.14", (3, 14), "/usr/bin/python3.14"),     # static, non-PIE, stripped
    _in_chroot("debian-3.14d", (3, 14), "/usr/bin/python3.14d"),   # python3.14-dbg: static too
    _in_chroot("ft-3.13t", (3, 13), "/opt/python3.13t/bin/python3.13t"),  # --disable-gil, shared
    _in_chroot("debian-3.15", (3, 15), "/usr/bin/python3.15"),     # static, frame pointers
    _in_chroot("debian-3.15d", (3, 15), "/usr/bin/python3.15d"),   # python3.15-dbg
    # Debian's libpython3.15.so, run by an embedding launcher (build-chroot.sh)
    _in_chroot("debian-3.15-shared", (3, 15), "/opt/python3.15-shared/bin/python3.15"),
]
CHROOT_INTERPRETERS = {i.label: i for i in CHROOT_MATRIX}
CHROOT_LABELS = [i.label for i in CHROOT_MATRIX]


def chroot_cmd(label, *args, proc=False):
    """argv running the chroot interpreter `label` inside its root with `args`.
    The interpreters start without /proc in the root; proc=True mounts it, in a
    private mount namespace that vanishes with the process (nothing to unmount).
    Either way unshare/sh/chroot exec each other: Popen(...).pid is the
    interpreter's host PID."""
    interp = CHROOT_INTERPRETERS[label]
    if not proc:
        return ["chroot", interp.chroot, interp.inner, *map(str, args)]
    return ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
            'mount -t proc proc "$0/proc" && exec chroot "$0" "$@"',
            interp.chroot, interp.inner, *map(str, args)]


def chroot_ns_cmd(label, *args):
    """argv running the chroot interpreter `label` as PID 1 of a PID namespace
    of its own, with its own /proc (a container as the host sees one):
    unshare forks, so the interpreter is the child of Popen(...).pid;
    NsWorkload finds it."""
    interp = CHROOT_INTERPRETERS[label]
    return ["unshare", "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private",
            "/bin/sh", "-c",
            'mount -t proc proc "$0/proc" && exec chroot "$0" "$@"',
            interp.chroot, interp.inner, *map(str, args)]


def ns_to_host_tids(pid):
    """{id inside its PID namespace: host id} of every thread of host process `pid`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    out[int(line.split()[-1])] = int(tid)
    return out


_chroot_workloads_copied = set()


def chroot_workloads(root=CHROOT):
    """Copies tests/workloads to ROOT/work/pyoffcpu-workloads (once per test
    session, replacing an older copy) and returns that directory as seen inside
    the root, CHROOT_WORKLOADS. A copy, not a bind mount: nothing is left
    mounted when a session dies, and the directory is small."""
    import shutil
    if root not in _chroot_workloads_copied:
        dest = root + CHROOT_WORKLOADS
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(WORKLOADS, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        _chroot_workloads_copied.add(root)
    return CHROOT_WORKLOADS

# The interpreters issue 2 names: pyenv's (shared libpython) and Debian's (static).
PYTHONS = {label: INTERPRETERS[label].path for label in ("pyenv-3.11", "debian-3.11")}


def python_or_skip(label):
    """The path of a matrix interpreter. Missing: a skip, or under
    PYOFFCPU_REQUIRE_BPF=1 a failure (the matrix never shrinks silently).
    For a CHROOT_LABELS one, the path the host sees: read its ELF file from
    there, run it with chroot_cmd()."""
    interp = INTERPRETERS[label] if label in INTERPRETERS else CHROOT_INTERPRETERS[label]
    path = interp.path()
    if not path:
        msg = f"{label} not installed (the CPython matrix in tests/conftest.py needs it)"
        if interp.chroot:
            msg += f"; tools/build-chroot.sh builds it in {interp.chroot}"
        if REQUIRE_BPF:
            pytest.fail(msg)
        pytest.skip(msg)
    return path


CHROMIUM = "/usr/bin/chromium"


def chromium_or_skip():
    """The browser the browser tests drive (`make test` installs it): a skip
    without it, or under PYOFFCPU_REQUIRE_BPF=1 a failure."""
    if not os.path.exists(CHROMIUM):
        if REQUIRE_BPF:
            pytest.fail(f"{CHROMIUM} is missing: `make test` installs it")
        pytest.skip(f"{CHROMIUM} not installed")
    return CHROMIUM


def pyoffcpu_cmd(*args):
    return [sys.executable, "-m", "pyoffcpu", *args]


# The sessions the tests run in their own process (Session(Options(...)))
# take --tables-first from here, as the pyoffcpu processes do from env()
os.environ.setdefault("PYOFFCPU_TABLES_FIRST", "1")


def env():
    """pyoffcpu's environment in the tests: with --tables-first
    (PYOFFCPU_TABLES_FIRST=1), so that what a test checks of native stacks
    is not cut by a table still being made, or the unwinder's programs
    still being verified, when its short recording starts (the default,
    both while the recording runs, is what test_torch_bpf.py's cold start
    and test_unwind_bpf.py's check)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.path.join(ROOT, "pytool") + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("PYOFFCPU_TABLES_FIRST", "1")
    return e


class Workload:
    """A workload process that prints `ready` once set up."""

    def __init__(self, python, script, *args, argv=None, env=None):
        """Runs `python WORKLOADS/script args`, or `argv` as given (a chroot
        interpreter: chroot_cmd / chroot_ns_cmd); env: variables added to ours."""
        if argv is None:
            argv = [python, os.path.join(WORKLOADS, script), *map(str, args)]
        self.script = script
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, **env) if env else None)
        self.lines = []
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{script} exited before it was ready")
            line = line.strip()
            if line == "ready":
                break
            self.lines.append(line)

    @property
    def pid(self):
        return self.proc.pid

    def host_ids(self):
        """Identity, for a workload in the host's PID namespace."""
        return lambda tid: tid

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


class NsWorkload(Workload):
    """A Workload started by chroot_ns_cmd: `pid` is the interpreter's host
    PID (unshare's child) and host_ids() maps the ids it prints (its
    namespace's) to the host's."""

    @property
    def pid(self):
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            return int(f.read().split()[0])

    def host_ids(self):
        table = ns_to_host_tids(self.pid)
        return lambda tid: table[tid]


def run_pyoffcpu(*args, timeout=120, env_extra=None):
    return subprocess.run(pyoffcpu_cmd(*args), env=dict(env(), **(env_extra or {})), capture_output=True,
                          text=True, timeout=timeout)


def steal_s() -> float:
    """The machine's CPU time stolen by its hypervisor so far (s, all CPUs,
    from /proc/stat).  A thread's time on a CPU by the clock (pyoffcpu's
    on-CPU time) includes what was stolen while it was current; its own
    CPU clock (thread_time) does not."""
    from pyoffcpu.kernel.procfs import cpu_times
    now = cpu_times()
    return now.steal_s if now else 0.0


def record_folded(tmp_path, *args, name="out.folded", env_extra=None, timeout=120):
    """Run pyoffcpu to a folded file; returns (CompletedProcess, Profile)."""
    from pyoffcpu.profile.model import from_folded
    out = tmp_path / name
    res = run_pyoffcpu("-o", str(out), *args, env_extra=env_extra, timeout=timeout)
    assert res.returncode == 0, res.stderr
    return res, from_folded(out.read_text())


def wait_for_recording(proc, timeout=60):
    """Read pyoffcpu's stderr until it says it is recording (BPF attached)."""
    import select
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        r, _, _ = select.select([proc.stderr], [], [], 0.5)
        if r:
            line = proc.stderr.readline()
            if not line:
                break
            seen.append(line)
            if line.startswith("pyoffcpu: recording"):
                return
    raise AssertionError("pyoffcpu did not start recording: " + "".join(seen))


def cached_venv(name, base_python, packages):
    """venvs.cached_venv, skipped (a failure under CI) when pip cannot
    install the packages."""
    import venvs
    try:
        return venvs.cached_venv(name, base_python, packages)
    except venvs.VenvError as e:
        pytest.skip(str(e))


def torch_python():
    """pyenv 3.11 with PyTorch from PyPI, cached across runs (cached_venv)."""
    import venvs
    return cached_venv("torch", python_or_skip("pyenv-3.11"), [venvs.TORCH])


class TwoCallers:
    """A recording of tests/workloads/two_callers.py (one helper called
    from two lines, 30/70 of the caller's blocked time by construction)
    against the workload's own clock of the same window (SIGUSR1 when
    pyoffcpu says it records, SIGUSR2 as the window ends): line A's share
    of the caller's off-CPU time in the profile and by that clock."""

    def __init__(self, label, prof, pid, truth_a, stderr):
        from pyoffcpu.profile.model import FrameKind
        line_a = source_line("two_callers.py", "# LINE A")
        line_b = source_line("two_callers.py", "# LINE B")
        self.label, self.prof, self.truth_a, self.stderr = label, prof, truth_a, stderr
        by_line, in_helper = {}, 0
        for k, ns in prof.weights.items():
            if k.tid != pid or k.off_cpu is None:
                continue
            py = [f for f in k.frames if f.kind is FrameKind.PYTHON]
            line = next((f.line for f in py if f.name == "caller" and f.file.endswith("two_callers.py")),
                        None)
            by_line[line] = by_line.get(line, 0) + ns
            if line in (line_a, line_b) and py and py[-1].name == "wait_on":
                in_helper += ns
        self.a, self.b = by_line.get(line_a, 0), by_line.get(line_b, 0)
        self.blocked, self.in_helper = sum(by_line.values()), in_helper
        self.shares = {line: round(100.0 * ns / max(self.blocked, 1), 2) for line, ns in by_line.items()}
        self.share_a = 100.0 * self.a / max(self.a + self.b, 1)
        print(f"\n{label}: caller's off-CPU time by line (A={line_a}, B={line_b}): {self.shares}; "
              f"line A {self.share_a:.2f}% (the workload's own clock: {truth_a:.2f}%)")

    @classmethod
    def record(cls, label, tmp_path, seconds, *args, block_s=None, env_extra=None, workload_env=None):
        """Record the workload (blocks of block_s, default its 1 ms) for
        `seconds` with pyoffcpu's extra `args`."""
        from pyoffcpu.profile.model import from_folded
        python = python_or_skip(label)
        extra = [] if block_s is None else [str(block_s)]
        if label in CHROOT_LABELS:
            w = Workload(None, "two_callers.py", argv=chroot_cmd(
                label, os.path.join(chroot_workloads(), "two_callers.py"), 60, *extra))
        else:
            w = Workload(python, "two_callers.py", 60, *extra, env=workload_env)
        out = tmp_path / "out.folded"
        p = None
        try:
            p = subprocess.Popen(pyoffcpu_cmd("-o", str(out), "-p", str(w.pid), *args),
                                 env=dict(env(), **(env_extra or {})), stderr=subprocess.PIPE, text=True)
            wait_for_recording(p)
            os.kill(w.pid, signal.SIGUSR1)          # the workload's own clock starts with the window
            time.sleep(seconds)
            # ... and ends with it: the workload's split, then Ctrl-C (the window
            # must not take in pyoffcpu's merge and export, whose CPU moves the split)
            os.kill(w.pid, signal.SIGUSR2)
            p.send_signal(signal.SIGINT)
            stderr = p.stderr.read()
            truth = w.proc.stdout.readline()
            assert p.wait(timeout=60) == 0, stderr
        finally:
            if p is not None and p.poll() is None:
                p.kill()
            w.stop()
        m = re.search(r"split A=([\d.]+) B=([\d.]+) blocks=(\d+)", truth)
        assert m, truth
        return cls(label, from_folded(out.read_text()), w.pid, float(m.group(1)), stderr)

    def check_whole(self, seconds):
        """The caller blocks most of the time, nearly all of it in wait_on
        from line A or B."""
        assert self.blocked > 0.8 * seconds * 1e9, (self.blocked, self.stderr)
        assert self.a + self.b >= 0.98 * self.blocked, self.shares
        assert self.in_helper >= 0.98 * (self.a + self.b), (self.in_helper, self.a + self.b)

    def explain(self):
        return (f"line A {self.share_a:.2f}% / line B {100 - self.share_a:.2f}% of the blocked time; "
                f"the workload's own clock says {self.truth_a:.2f}%, built as 30/70", self.shares)
