"""Finding CPython in a process from its ELF files and memory, never from a name.

Live processes of every interpreter on the machine (see test_cpython_versions)
and of derived ones: renamed copies with misleading names, a venv, a C program
embedding libpython (shared and static, built here with gcc), CPythons we do not
support (a one-line notice and a native-only profile, never garbage frames).
"""
import glob
import os
import re
import shutil
import subprocess

import pytest

from conftest import record_folded
from pyoffcpu.cpython import detect
from pyoffcpu.kernel.memory import ProcessMemory
from pyoffcpu.profile.model import FrameKind
from conftest import INTERPRETERS as MATRIX

# label -> path of the matrix interpreters installed here (test_cpython_versions
# fails CI for a missing one)
INTERPRETERS = {label: i.path() for label, i in MATRIX.items() if i.path()}

SLEEPER = "import sys, time; sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(60)"


class Proc:
    """A process that prints `ready` once it runs Python."""

    def __init__(self, argv, env=None):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.stop()
            raise RuntimeError(f"{argv[0]} did not start: {line!r}")

    @property
    def pid(self):
        return self.proc.pid

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def real_version(python):
    out = subprocess.run([python, "-c", "import sys; print('%d %d %d' % sys.version_info[:3])"],
                         capture_output=True, text=True, check=True).stdout
    return tuple(int(x) for x in out.split())


def detect_running(argv, env=None):
    p = Proc(argv, env)
    try:
        pp = detect.find_python(p.pid)
        mem = ProcessMemory(p.pid)
        try:
            keys = detect.key_from_runtime(pp, mem), detect.key_from_threads(pp, mem)
        finally:
            mem.close()
        return pp, keys
    finally:
        p.stop()


@pytest.mark.parametrize("label", sorted(INTERPRETERS))
def test_every_interpreter(label):
    python = INTERPRETERS[label]
    pp, (stored, live) = detect_running([python, "-c", SLEEPER])
    assert pp.version == real_version(python)
    # the runtime is in libpython for pyenv's shared builds, in the executable for Debian's
    lib = os.path.basename(pp.binary)
    assert lib.startswith("libpython%d.%d" % pp.minor) or lib == os.path.basename(python), pp.binary
    # autoTSSkey: where the table says it is, and what the thread itself holds
    assert pp.tss_key >= 0 and stored == live == pp.tss_key, (stored, live)
    assert pp.code_type
    assert pp.debug_offsets == (pp.minor >= (3, 13))
    assert pp.notices == []


def _one_of(prefix, shared=None):
    """An interpreter of INTERPRETERS whose label starts with prefix."""
    for label in sorted(INTERPRETERS, reverse=True):
        if label.startswith(prefix):
            return INTERPRETERS[label]
    pytest.skip(f"no {prefix} interpreter here")


def test_renamed_interpreters_with_misleading_names(tmp_path):
    for python, name in ((_one_of("pyenv-"), "python3.9"), (_one_of("debian-"), "python3.8")):
        copy = tmp_path / name
        shutil.copy2(python, copy)
        pp, _ = detect_running([str(copy), "-c", SLEEPER])
        assert pp.version == real_version(python), (python, name)
        assert pp.tss_key >= 0


def test_venv_with_copied_executable(tmp_path):
    python = _one_of("debian-")            # static: _PyRuntime is in the copied executable
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", "--without-pip", "--copies", str(venv)], check=True)
    exe = venv / "bin" / "python"
    pp, _ = detect_running([str(exe), "-c", SLEEPER])
    assert pp.version == real_version(python)
    assert os.path.realpath(pp.binary) == os.path.realpath(exe)


EMBED_C = r"""
#include <Python.h>
int main(void) {
    Py_Initialize();
    int rc = PyRun_SimpleString(
        "def embedded_work():\n"
        "    n = 0\n"
        "    while True: n += 1\n"
        "print('ready', flush=True)\n"
        "embedded_work()\n");
    Py_Finalize();
    return rc;
}
"""


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """{'shared': path, 'static': path} of a C program embedding the newest
    pyenv CPython that ships python3.X-config (the static one links
    libpython3.X.a without -rdynamic: _PyRuntime is only in .symtab)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found")
    for label in sorted(INTERPRETERS, key=lambda l: tuple(map(int, l.split("-")[1].split("."))),
                        reverse=True):
        python = INTERPRETERS[label]
        config = python + "-config"
        if label.startswith("pyenv-") and os.access(config, os.X_OK):
            break
    else:
        pytest.skip("no pyenv CPython with python3.X-config")
    d = tmp_path_factory.mktemp("embed")
    src = d / "embed.c"
    src.write_text(EMBED_C)

    def cfg(*args):
        return subprocess.run([config, *args], capture_output=True, text=True,
                              check=True).stdout.split()
    out = {"python": python}
    cflags = cfg("--cflags")
    subprocess.run(["gcc", str(src), *cflags, *cfg("--ldflags", "--embed"),
                    "-o", str(d / "app-shared")], check=True)
    out["shared"] = str(d / "app-shared")
    prefix = os.path.dirname(os.path.dirname(python))
    archive = glob.glob(os.path.join(prefix, "lib", "python3.*", "config-*", "libpython3.*.a"))
    if archive:
        libs = [x for x in cfg("--libs", "--embed") if not x.startswith("-lpython")]
        subprocess.run(["gcc", str(src), *cflags, archive[0], *libs, "-o", str(d / "app-static")],
                       check=True)
        out["static"] = str(d / "app-static")
    return out


@pytest.mark.parametrize("kind", ["shared", "static"])
def test_embedded_interpreter(embedded, kind):
    if kind not in embedded:
        pytest.skip("no libpython3.X.a to link statically")
    pp, (stored, live) = detect_running([embedded[kind]])
    assert pp.version == real_version(embedded["python"])
    assert stored == live == pp.tss_key >= 0
    if kind == "static":
        assert pp.binary == embedded["static"]
    else:
        assert os.path.basename(pp.binary).startswith("libpython")


def test_embedded_static_interpreter_profile(embedded, tmp_path, bpf):
    if "static" not in embedded:
        pytest.skip("no libpython3.X.a to link statically")
    p = Proc([embedded["static"]])
    try:
        res, prof = record_folded(tmp_path, "-p", str(p.pid), "-d", "1")
    finally:
        p.stop()
    total = prof.total_ns()
    hot = sum(ns for k, ns in prof.weights.items()
              if [f.name for f in k.frames if f.kind is FrameKind.PYTHON][-1:] == ["embedded_work"])
    assert hot >= 0.9 * total, (hot, total, res.stderr)


def _unsupported():
    """pyenv CPythons older than the oldest supported one (2.7, 3.6...)."""
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    out = []
    for d in sorted(glob.glob(os.path.join(root, "versions", "*"))):
        m = re.fullmatch(r"(\d+)\.(\d+)\.\d+", os.path.basename(d))
        if m and (int(m.group(1)), int(m.group(2))) < detect.SUPPORTED[0]:
            exe = os.path.join(d, "bin", "python%s.%s" % m.groups())
            if os.access(exe, os.X_OK):
                out.append(exe)
    return out


def test_unsupported_versions_are_named():
    for python in _unsupported():
        p = Proc([python, "-c", SLEEPER])
        try:
            with pytest.raises(detect.Unsupported) as e:
                detect.find_python(p.pid)
        finally:
            p.stop()
        want = "CPython %d.%d is not supported" % real_version(python)[:2]
        assert str(e.value).startswith(want), e.value


def test_unsupported_version_profiles_native_only(tmp_path, bpf):
    """A CPython older than 3.7 where there is one, else a non-Python process:
    one notice, native stacks only."""
    olds = _unsupported()
    argv = [olds[-1], "-c", SLEEPER] if olds else ["sh", "-c", "echo ready; exec sleep 60"]
    p = Proc(argv)
    try:
        res, prof = record_folded(tmp_path, "-p", str(p.pid), "-d", "0.5")
    finally:
        p.stop()
    what = "not supported" if olds else "not a Python process"
    notices = [line for line in res.stderr.splitlines() if what in line]
    assert len(notices) == 1 and "native stacks only" in notices[0], res.stderr
    assert prof.weights
    assert not any(f.kind is FrameKind.PYTHON for k in prof.weights for f in k.frames)


def test_not_python():
    p = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(detect.NotPython):
            detect.find_python(p.pid)
    finally:
        p.kill()
        p.wait()
