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
    and where it is found."""

    def __init__(self, label, minor, find):
        self.label, self.minor, self._find = label, minor, find

    def path(self):
        return self._find()

    def __repr__(self):
        return "Interpreter(%r)" % self.label


# The supported CPython matrix (DESIGN.md "Testing"), named here and never
# discovered: a missing interpreter fails CI (PYOFFCPU_REQUIRE_BPF=1) instead of
# shrinking the matrix. pyenv builds are shared (libpython3.X.so), Debian's is
# static. 3.14 is covered without an interpreter (test_cpython_314.py).
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

# The interpreters issue 2 names: pyenv's (shared libpython) and Debian's (static).
PYTHONS = {label: INTERPRETERS[label].path for label in ("pyenv-3.11", "debian-3.11")}


def python_or_skip(label):
    """The path of a matrix interpreter. Missing: a skip, or under
    PYOFFCPU_REQUIRE_BPF=1 a failure (the matrix never shrinks silently)."""
    interp = INTERPRETERS[label]
    path = interp.path()
    if not path:
        msg = f"{label} not installed (the CPython matrix in tests/conftest.py needs it)"
        if REQUIRE_BPF:
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def pyoffcpu_cmd(*args):
    return [sys.executable, "-m", "pyoffcpu", *args]


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = os.path.join(ROOT, "pytool") + os.pathsep + e.get("PYTHONPATH", "")
    return e


class Workload:
    """A workload process that prints `ready` once set up."""

    def __init__(self, python, script, *args):
        self.proc = subprocess.Popen([python, os.path.join(WORKLOADS, script), *map(str, args)],
                                     stdout=subprocess.PIPE, text=True)
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

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def run_pyoffcpu(*args, timeout=120):
    return subprocess.run(pyoffcpu_cmd(*args), env=env(), capture_output=True, text=True,
                          timeout=timeout)


def record_folded(tmp_path, *args, name="out.folded"):
    """Run pyoffcpu to a folded file; returns (CompletedProcess, Profile)."""
    from pyoffcpu.profile import from_folded
    out = tmp_path / name
    res = run_pyoffcpu("-o", str(out), *args)
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
