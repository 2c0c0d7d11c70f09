"""The interpreters tools/build-chroot.sh builds in its Debian testing root
(conftest.CHROOT_LABELS) run there and are what their labels say: Debian's
3.14 and 3.15 release builds, their debug builds, 3.15 from Debian's
libpython3.15.so, and a free-threaded 3.13t.

Here: they run, and the free-threaded build's parallel threads each get
their own stacks (test_parallel_threads_keep_their_own_stacks). Their known
stacks are in test_cpython_versions.py, a split on 3.14 in test_record.py.
A missing interpreter
is a skip here, and a failure under PYOFFCPU_REQUIRE_BPF=1 (`make test` builds
the root first).
"""
import json
import os
import re
import subprocess

import pytest

from conftest import (CHROOT_INTERPRETERS, CHROOT_LABELS, CHROOT_WORKLOADS, Workload,
                      chroot_cmd, chroot_workloads, python_or_skip, record_folded, source_line)
from pyoffcpu.profile.model import FrameKind

REPORT = r"""
import json, sys, sysconfig
print(json.dumps({
    "version": list(sys.version_info[:3]),
    "executable": sys.executable,
    "gil_disabled_build": sysconfig.get_config_var("Py_GIL_DISABLED"),
    "gil_enabled": sys._is_gil_enabled(),
    "debug": hasattr(sys, "gettotalrefcount"),
}))
"""

# label -> (free-threaded build, debug build)
EXPECTED = {
    "debian-3.14": (False, False),
    "debian-3.14d": (False, True),
    "ft-3.13t": (True, False),
    "debian-3.15": (False, False),
    "debian-3.15d": (False, True),
    "debian-3.15-shared": (False, False),
}


def test_every_chroot_label_has_an_expectation():
    assert sorted(EXPECTED) == sorted(CHROOT_LABELS)


@pytest.mark.parametrize("label", CHROOT_LABELS)
def test_runs_in_its_root(label):
    host_path = python_or_skip(label)
    interp = CHROOT_INTERPRETERS[label]
    assert host_path == interp.chroot + interp.inner
    res = subprocess.run(chroot_cmd(label, "-c", REPORT), capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    free_threaded, debug = EXPECTED[label]
    assert tuple(got["version"][:2]) == interp.minor, got
    assert got["executable"] == interp.inner, got
    assert got["gil_disabled_build"] == (1 if free_threaded else 0), got
    assert got["gil_enabled"] is (not free_threaded), got
    assert got["debug"] is debug, got


@pytest.mark.parametrize("label", CHROOT_LABELS)
def test_runs_a_workload_with_proc(label):
    """With /proc mounted (a private mount namespace) and tests/workloads
    copied in, the PID the host spawned is the interpreter's."""
    python_or_skip(label)
    inner = chroot_workloads()
    assert os.path.isfile(os.path.join(CHROOT_INTERPRETERS[label].chroot + inner,
                                       "known_stacks.py"))
    script = ("import os, sys; sys.path.insert(0, %r); "
              "print(os.getpid(), len(os.listdir('/proc/self/fd')) > 0)" % CHROOT_WORKLOADS)
    proc = subprocess.Popen(chroot_cmd(label, "-c", script, proc=True), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.split() == [str(proc.pid), "True"]


SPIN_LINES = {i: source_line("parallel_spinners.py", "# S:%d" % i) for i in range(4)}


def test_parallel_threads_keep_their_own_stacks(tmp_path, bpf):
    """Free-threaded 3.13t: four threads run Python at the same time, each in
    a function of its own.  Every on-CPU stack of spinner n ends in spin_n at
    its line (a walker that read another thread's state, or a torn frame,
    would put one thread's function under another).  That they can run at
    once is the build's (test_runs_in_its_root: GIL disabled); how much they
    overlapped depends on the machine's other load, so it is not asserted."""
    python_or_skip("ft-3.13t")
    script = os.path.join(chroot_workloads(), "parallel_spinners.py")
    duration = 3
    w = Workload(None, "parallel_spinners.py",
                 argv=chroot_cmd("ft-3.13t", script, duration + 60))
    try:
        tids = {int(line.split()[1]): int(line.split()[2])
                for line in w.lines if line.startswith("tid ")}
        res, prof = record_folded(tmp_path, "-p", str(w.pid), "-d", str(duration), "-F", "199")
    finally:
        w.stop()
    assert re.search(r"CPython 3\.13\.\d+ free-threaded", res.stderr), res.stderr
    for n, tid in tids.items():
        exact = other = 0
        for key, ns in prof.weights.items():
            if key.tid != tid or key.off_cpu is not None:
                continue
            py = [(f.name, f.line) for f in key.frames if f.kind is FrameKind.PYTHON]
            if py and py[-1] == ("spin_%d" % n, SPIN_LINES[n]):
                exact += ns
            else:
                other += ns
            assert not any(name.startswith("spin_") and name != "spin_%d" % n
                           for name, _ in py), (n, py)
        assert exact >= 0.99 * (exact + other), (n, exact, other)
        assert exact > 0.3e9, (n, exact, res.stderr)
