"""A CPython newer than any tested one, on the day it ships: a copy of
Debian's python3.15 (the chroot's) whose version is patched to 3.16, in
`_Py_DebugOffsets` and in `Py_Version`.  Nothing else differs, so the
layout pyoffcpu reads from it (3.15's reading of its _Py_DebugOffsets) is
right, and its checks on the live process (cpython/livecheck.py) pass: it
is profiled with Python frames and a one-line notice.

Then the same copy with its _Py_DebugOffsets values moved: rotated over
every published field, or only the code object's filename and line table
swapped (a str and a bytes, both plausible offsets).  Read as they are, they
would name garbage; they must be refused, native stacks only, saying which
check failed.  Real BPF, real processes.
"""
import os
import shutil
import struct

import pytest
from elftools.elf.elffile import ELFFile

from conftest import CHROOT, Workload, python_or_skip, record_folded
from pyoffcpu.cpython.offsets_table import DEBUG_POSITIONS
from pyoffcpu.profile.model import FrameKind

HEX_315 = 0x030F00F0             # 3.15.0 final, as Debian ships it
HEX_316 = 0x031000F0
LEAF_LINES = (5, 6)             # the loop in leaf()

SCRIPT = '''import sys, time
print("ready", flush=True)
def leaf():
    t = time.time()
    while time.time() - t < 60:
        pass
leaf()
'''


def _file_offset(elf, vaddr):
    for seg in elf.iter_segments():
        if seg["p_type"] == "PT_LOAD" and seg["p_vaddr"] <= vaddr < seg["p_vaddr"] + seg["p_filesz"]:
            return vaddr - seg["p_vaddr"] + seg["p_offset"]
    raise AssertionError("address %#x is in no loaded segment" % vaddr)


def _copy_as_316(where, mutate=None):
    """A copy of the chroot's python3.15 under CHROOT/`where` that says it is
    3.16; `mutate(blob)` then edits its _Py_DebugOffsets (a bytearray view
    of the struct in the file).  Returns the path as seen inside the root."""
    src = python_or_skip("debian-3.15")
    data = bytearray(open(src, "rb").read())
    cookie = b"xdebugpy" + struct.pack("<Q", HEX_315)
    at = data.find(cookie)
    assert at >= 0 and data.find(cookie, at + 1) < 0, "one _Py_DebugOffsets initializer"
    struct.pack_into("<Q", data, at + 8, HEX_316)
    with open(src, "rb") as f:
        elf = ELFFile(f)
        sym = elf.get_section_by_name(".dynsym").get_symbol_by_name("Py_Version")[0]
        off = _file_offset(elf, sym["st_value"])
    assert struct.unpack_from("<I", data, off)[0] == HEX_315
    struct.pack_into("<I", data, off, HEX_316)
    if mutate is not None:
        size = DEBUG_POSITIONS[(3, 15)]["sizeof"]
        blob = memoryview(data)[at:at + size]
        mutate(blob)
    os.makedirs(CHROOT + where, exist_ok=True)
    inner = where + "/python3.16"
    with open(CHROOT + inner, "wb") as f:
        f.write(data)
    os.chmod(CHROOT + inner, 0o755)
    with open(CHROOT + where + "/leaf.py", "w") as f:
        f.write(SCRIPT)
    return inner


PUBLISHED = [k for k in DEBUG_POSITIONS[(3, 15)] if k not in ("version", "free_threaded", "sizeof")]


def _rotate_all(blob):
    pos = DEBUG_POSITIONS[(3, 15)]
    vals = [struct.unpack_from("<Q", blob, pos[k])[0] for k in PUBLISHED]
    for k, v in zip(PUBLISHED, vals[1:] + vals[:1]):
        struct.pack_into("<Q", blob, pos[k], v)


def _swap_filename_and_linetable(blob):
    pos = DEBUG_POSITIONS[(3, 15)]
    a, b = pos["code_filename"], pos["code_linetable"]
    va, vb = struct.unpack_from("<Q", blob, a)[0], struct.unpack_from("<Q", blob, b)[0]
    struct.pack_into("<Q", blob, a, vb)
    struct.pack_into("<Q", blob, b, va)


@pytest.fixture
def where(request):
    d = "/tmp/pyoffcpu-newer-%s" % request.node.name.replace("[", "-").replace("]", "")
    yield d
    shutil.rmtree(CHROOT + d, ignore_errors=True)


def _record(tmp_path, inner, where):
    w = Workload(None, "leaf.py", argv=["chroot", CHROOT, inner, where + "/leaf.py"])
    try:
        res, prof = record_folded(tmp_path, "-p", str(w.pid), "-d", "2", "-F", "499")
    finally:
        w.stop()
    return w.pid, res.stderr, prof


def test_a_316_with_315s_layout_is_profiled_with_a_notice(tmp_path, bpf, where):
    pid, stderr, prof = _record(tmp_path, _copy_as_316(where), where)
    assert "CPython 3.16 is newer than tested; layout read from the interpreter" in stderr, stderr
    assert "native stacks only" not in stderr, stderr
    on = prof.total_ns(tid=pid, on_cpu=True)
    in_leaf = sum(ns for key, ns in prof.weights.items()
                  if key.tid == pid and key.off_cpu is None and any(
                      f.kind is FrameKind.PYTHON and f.name == "leaf" and f.line in LEAF_LINES
                      and f.file.endswith("leaf.py") for f in key.frames))
    assert on > 0.5e9, stderr
    assert in_leaf >= 0.95 * on, (in_leaf, on)


@pytest.mark.parametrize("mutate", [_rotate_all, _swap_filename_and_linetable],
                         ids=["rotated", "filename-linetable-swapped"])
def test_a_316_whose_offsets_are_moved_is_refused(tmp_path, bpf, where, mutate):
    pid, stderr, prof = _record(tmp_path, _copy_as_316(where, mutate), where)
    line = [ln for ln in stderr.splitlines() if "newer than tested" in ln]
    assert len(line) == 1, stderr
    assert "does not hold on the live process" in line[0] or "cannot be read" in line[0], line
    assert line[0].endswith("profiling native stacks only"), line
    if mutate is _swap_filename_and_linetable:
        assert "filename is not a str" in line[0] or "line table is not bytes" in line[0], line
    python = [key for key in prof.weights if any(f.kind is FrameKind.PYTHON for f in key.frames)]
    assert not python, python[:3]
    assert prof.total_ns(tid=pid) > 1e9         # profiled all the same, natively
