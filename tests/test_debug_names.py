"""Names for stripped binaries: the summary says which package or debug file
would name an object whose `[unknown]` frames hold a noticeable share of the
time (pyoffcpu.summary.UNNAMED_SHARE), found from its GNU build-id.

The unit tests build Profiles by hand; the BPF test profiles Debian's
stripped /usr/bin/python3.11 with its debug file hidden (PYOFFCPU_DEBUG_DIRS
at an empty directory) and present (a directory holding only that file)."""
import os
import re
import shutil
import subprocess

import pytest

from conftest import REQUIRE_BPF, Workload, python_or_skip, record_folded
from pyoffcpu.profile import summary
from pyoffcpu.profile.model import FrameKind, Profile, StackKey, native_frame, python_frame
from pyoffcpu.native.symbols import DEBUG_DIRS_ENV, ModuleSymbols

BID = "ab" + "cd" * 19
DBG_PATH = f"/usr/lib/debug/.build-id/ab/{'cd' * 19}.debug"


def _profile(weights, modules):
    """weights: [(frames, ns)], pid 1; modules: {path: ModuleSymbols}."""
    prof = Profile()
    for frames, ns in weights:
        prof.add(StackKey(1, 1, tuple(frames)), ns)
    prof.meta.native_modules = {(1, path): info for path, info in modules.items()}
    return prof


def _stripped(path, build_id=BID, **kw):
    return ModuleSymbols(path, 1, file=path, build_id=build_id, **kw)


def _unknown(path, off=0x10):
    return native_frame(f"[unknown] {os.path.basename(path)}+0x{off:x}", path)


PY = python_frame("work", "/app/x.py", 3)
EXE = "/usr/bin/python3.11"


def test_threshold_is_a_share_of_all_the_time():
    below = int(1e9 * summary.UNNAMED_SHARE) - 1
    for unnamed, shown in ((below, False), (below + 1, True)):
        prof = _profile([([PY, _unknown(EXE)], unnamed), ([PY], int(1e9) - unnamed)],
                        {EXE: _stripped(EXE)})
        rows = summary.unnamed_modules(prof)
        assert bool(rows) is shown, (unnamed, rows)
        if shown:
            assert rows[0][1] == unnamed and rows[0][0].path == EXE


def test_a_stack_counts_once_and_named_objects_never():
    lib = "/usr/lib/libfoo.so.1"
    prof = _profile([
        ([_unknown(EXE, 1), PY, _unknown(EXE, 2), _unknown(lib)], 300),   # EXE twice: once
        ([native_frame("main", EXE), PY], 700),
    ], {EXE: _stripped(EXE), lib: _stripped(lib, build_id="ef" * 20, has_symtab=True)})
    rows = summary.unnamed_modules(prof)
    assert [(r[0].path, r[1]) for r in rows] == [(EXE, 300)]
    # a debug file found: named, no line
    prof.meta.native_modules[(1, EXE)] = _stripped(EXE, debug_file="/usr/lib/debug/x.debug")
    assert summary.unnamed_modules(prof) == []
    # no record of the object (e.g. a profile read back from folded text): no line
    prof.meta.native_modules = {}
    assert summary.symbol_hints(prof) == []


def test_one_line_per_object_with_the_package_and_build_id_path():
    lib = "/usr/lib/x86_64-linux-gnu/libzstd.so.1.5.4"
    prof = _profile([([_unknown(EXE)], 230), ([_unknown(lib)], 100), ([PY], 670)],
                    {EXE: _stripped(EXE), lib: _stripped(lib, build_id="12" * 20)})
    owners = {EXE: "python3.11-minimal", lib: "libzstd1"}
    lines = summary.symbol_hints(prof, owner=lambda path, root: owners.get(path))
    assert lines == [
        f"pyoffcpu: 23% of the time is in python3.11 without symbols: install python3.11-dbg "
        f"(debug file {DBG_PATH})",
        "pyoffcpu: 10% of the time is in libzstd.so.1.5.4 without symbols: install "
        "libzstd1-dbgsym from Debian's debug archive (debug file "
        f"/usr/lib/debug/.build-id/12/{'12' * 19}.debug)",
    ]
    # no package: the debug file alone; no build-id either: what would help
    nobid = _stripped(EXE, build_id=None)
    assert summary.debug_hint(_stripped(EXE), 1, 4, owner=lambda p, r: None) == (
        f"pyoffcpu: 25% of the time is in python3.11 without symbols: its debug file would be "
        f"{DBG_PATH} (build-id {BID})")
    assert "has no build-id" in summary.debug_hint(nobid, 1, 4, owner=lambda p, r: None)
    # a process in another root: the package goes there
    inside = ModuleSymbols(EXE, 1, root="/proc/1/root", file="/proc/1/root" + EXE, build_id=BID)
    assert "install python3.11-dbg in the target's root (debug file " in \
        summary.debug_hint(inside, 1, 2, owner=lambda p, r: "python3.11-minimal")


def test_a_library_a_wheel_bundles_points_at_no_debug_file():
    """torch's bundled, stripped libgomp (issue 23): no package ships its
    debug file, so the line names the wheel and says how its frames read."""
    gomp = "/venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1"
    line = summary.debug_hint(_stripped(gomp), 1, 4, owner=lambda p, r: None)
    assert line == ("pyoffcpu: 25% of the time is in libgomp.so.1 without symbols: it is the copy the "
                    "torch package bundles, stripped, and no package ships its debug file; its functions "
                    "are named by where their code starts (libgomp.so.1@0x...)")
    assert "/usr/lib/debug" not in line
    blas = "/v/lib/python3.12/site-packages/numpy.libs/libscipy_openblas64_-ff651d7f.so"
    assert "the copy the numpy package bundles" in summary.debug_hint(_stripped(blas), 1, 4,
                                                                        owner=lambda p, r: None)
    assert summary.wheel_of("/usr/lib/x86_64-linux-gnu/libgomp.so.1") is None


def test_debug_package_names():
    assert summary.debug_package("python3.11-minimal") == ("python3.11-dbg", False)
    assert summary.debug_package("python3.11") == ("python3.11-dbg", False)
    assert summary.debug_package("libpython3.11-stdlib") == ("python3.11-dbg", False)
    assert summary.debug_package("libpython3.14") == ("python3.14-dbg", False)
    assert summary.debug_package("libc6") == ("libc6-dbg", False)
    assert summary.debug_package("libssl3") == ("libssl3-dbgsym", True)
    assert summary.debug_package("python3-numpy") == ("python3-numpy-dbgsym", True)


@pytest.mark.skipif(not shutil.which("dpkg-query"), reason="not a Debian system")
def test_dpkg_owner_on_this_machine(tmp_path):
    assert summary._dpkg_owner(os.path.realpath("/usr/bin/dpkg-query"), None) == "dpkg"
    # merged /usr: the maps say /usr/lib/..., dpkg lists /lib/...
    libc = "/usr/lib/x86_64-linux-gnu/libc.so.6"
    if os.path.exists(libc):
        assert summary._dpkg_owner(libc, None) == "libc6"
    assert summary._dpkg_owner("/nonexistent/libx.so", None) is None
    # another root without a package database: nothing, and no error
    assert summary._dpkg_owner("/usr/bin/dpkg-query", str(tmp_path)) is None


# ---------------------------------------------------------------------------
# Real BPF: Debian's stripped python3.11, its debug file hidden and present.
# ---------------------------------------------------------------------------
EXE_RE = r"python3\.11"
LINE = re.compile(r"^pyoffcpu: (\d+)% of the time is in python3\.11 without symbols: "
                  r"install python3\.11-dbg \(debug file (\S+)\)$", re.M)


def _build_id(path):
    out = subprocess.run(["readelf", "-n", path], check=True, capture_output=True,
                         text=True).stdout
    m = re.search(r"Build ID: ([0-9a-f]+)", out)
    assert m, out
    return m.group(1)


def _symbols(path, dynamic):
    """Defined function names of an ELF file (nm)."""
    out = subprocess.run(["nm", "--defined-only"] + (["-D"] if dynamic else []) + [path],
                         check=True, capture_output=True, text=True).stdout
    return {p[2] for p in (line.split() for line in out.splitlines())
            if len(p) == 3 and p[1] in "tTwWiI"}


def _unknown_share(prof):
    """Share of the time in stacks with a python3.11 frame that no symbol
    names: `[unknown] python3.11+0x...`, or `python3.11@0x...` (code only
    its FDE covers, named by the FDE's start)."""
    total = sum(prof.weights.values())
    unnamed = re.compile(r"\[unknown\] " + EXE_RE + r"\+0x|" + EXE_RE + r"@0x")
    hit = sum(ns for k, ns in prof.weights.items()
              if any(unnamed.match(f.name) for f in k.frames))
    return hit / total


def _named_share(prof, names):
    """Share of the time in stacks with a native frame called one of names."""
    total = sum(prof.weights.values())
    return sum(ns for k, ns in prof.weights.items()
               if any(f.kind is FrameKind.NATIVE and f.name in names for f in k.frames)) / total


def test_stripped_python_names_come_from_its_debug_file(tmp_path, monkeypatch, bpf):
    python = os.path.realpath(python_or_skip("debian-3.11"))
    if not all(shutil.which(t) for t in ("readelf", "nm")):
        pytest.skip("needs binutils")
    bid = _build_id(python)
    installed = f"/usr/lib/debug/.build-id/{bid[:2]}/{bid[2:]}.debug"
    if not os.path.exists(installed):
        msg = f"no {installed}: needs python3.11-dbg (make test installs it)"
        pytest.fail(msg) if REQUIRE_BPF else pytest.skip(msg)
    # functions only the debug file names (static ones): 'run_mod.lto_priv.0', ...
    static = _symbols(installed, dynamic=False) - _symbols(python, dynamic=True)
    assert len(static) > 1000, len(static)

    empty = tmp_path / "empty"
    empty.mkdir()
    present = tmp_path / "present"
    (present / ".build-id" / bid[:2]).mkdir(parents=True)
    os.symlink(installed, present / ".build-id" / bid[:2] / (bid[2:] + ".debug"))

    runs = {}
    for label, dirs in (("hidden", empty), ("present", present)):
        monkeypatch.setenv(DEBUG_DIRS_ENV, str(dirs))
        w = Workload(python, "split.py", 60)
        try:
            res, prof = record_folded(tmp_path, "-p", str(w.pid), "-d", "3",
                                      name=f"{label}.folded")
        finally:
            w.stop()
        runs[label] = (res, prof)

    res, prof = runs["hidden"]
    share = _unknown_share(prof)
    assert share >= summary.UNNAMED_SHARE, (share, res.stderr)
    assert _named_share(prof, static) == 0, res.stderr
    lines = LINE.findall(res.stderr)
    assert len(lines) == 1, res.stderr
    pct, path = lines[0]
    assert path == f"{empty}/.build-id/{bid[:2]}/{bid[2:]}.debug", res.stderr
    # the summary's share is the folded file's (whole percent, µs rounding)
    assert abs(int(pct) - 100 * share) <= 1, (pct, share)

    res, prof = runs["present"]
    assert not LINE.search(res.stderr), res.stderr
    assert "python3.11 without symbols" not in res.stderr, res.stderr
    assert _unknown_share(prof) < summary.UNNAMED_SHARE, res.stderr
    named = _named_share(prof, static)
    print(f"[unknown] python3.11 share: hidden {share:.3f}, present {_unknown_share(prof):.3f}; "
          f"static names present {named:.3f}")
    assert named >= 0.5, (named, res.stderr)
    # a static function by name, against the workload's built-in split: both
    # threads sleep in time.sleep a quarter of their time (split.py)
    sleep = _named_share(prof, {n for n in static if n.startswith("time_sleep")})
    assert abs(sleep - 0.25) <= 0.03, (sleep, res.stderr)
