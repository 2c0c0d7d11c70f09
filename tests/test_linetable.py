"""Line-table decoders vs. the real CPython interpreters on this machine.

For each interpreter (pyenv 3.6-3.13 and Debian's /usr/bin/python3.11; absent ones
are skipped) a subprocess compiles a set of code objects -- a snippet with nested
functions, a generator, coroutines, a lambda, class/static methods, a non-ASCII
function name, huge line jumps, a very long single line, far-away first lines,
plus every code object of a few stdlib modules -- and dumps, for each, the raw
table bytes, ``co_firstlineno`` and the expected line at every byte offset of
the bytecode:

* <= 3.9: from ``dis.findlinestarts`` (the line of the last line start at or
  before the offset, which is what ``frame.f_lineno`` reports);
* 3.10+: from ``co_lines()`` (``None`` -> -1, uncovered offsets -> -1);
* 3.11+: also from ``co_positions()`` (one entry per code unit);
* all: also ``PyCode_Addr2Line`` called through ctypes, when available.

The decoders must match every one of these at every offset.
"""

import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from pyoffcpu.cpython import linetable
from pyoffcpu.cpython.linetable import LineTable, decode_ranges, line_for_offset, table_kind


# ---------------------------------------------------------------------------
# Interpreters
# ---------------------------------------------------------------------------
PYENV_MINORS = (6, 7, 8, 9, 10, 11, 12, 13)
SYSTEM_PY311 = "/usr/bin/python3.11"


def _pyenv_root():
    exe = shutil.which("pyenv")
    if exe:
        try:
            return subprocess.run([exe, "root"], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, universal_newlines=True,
                                  check=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")


def _pyenv_python(minor):
    """bin/python3 of the newest pyenv 3.<minor>.N release, or None."""
    exe = shutil.which("pyenv")
    if exe:
        try:
            prefix = subprocess.run([exe, "prefix", "3.%d" % minor],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    universal_newlines=True, timeout=30).stdout.strip()
            cand = os.path.join(prefix, "bin", "python3")
            if prefix and os.access(cand, os.X_OK):
                return cand
        except (OSError, subprocess.SubprocessError):
            pass
    best = None
    for path in glob.glob(os.path.join(_pyenv_root(), "versions", "3.%d.*" % minor)):
        m = re.fullmatch(r"3\.%d\.(\d+)" % minor, os.path.basename(path))
        cand = os.path.join(path, "bin", "python3")
        if m and os.access(cand, os.X_OK):
            if best is None or int(m.group(1)) > best[0]:
                best = (int(m.group(1)), cand)
    return best[1] if best else None


INTERPRETERS = [("pyenv-3.%d" % m, functools.partial(_pyenv_python, m))
                for m in PYENV_MINORS]
INTERPRETERS.append(("system-3.11",
                     lambda: SYSTEM_PY311 if os.access(SYSTEM_PY311, os.X_OK) else None))


# ---------------------------------------------------------------------------
# The dumper, run under the target interpreter (must stay 3.6-compatible)
# ---------------------------------------------------------------------------
DUMPER = r'''
import dis, importlib, json, sys, tokenize, types

VER = sys.version_info[:2]

PAD_FAR = "\n" * 300
SNIPPET = """
import asyncio

def outer(a, b):
    x = a + b
    def inner(c):
        y = c * 2
        return [i for i in range(y)
                if i % 3]
    return inner(x)

def gen(n):
    for i in range(n):
        if i % 2:
            yield i
        else:
            yield -i
    yield from range(3)

async def coro(n):
    await asyncio.sleep(0)
    async with ctx() as c:
        async for v in agen():
            pass
    return n

async def agen():
    yield 1

square = lambda v: (v *
                    v)

class Klass:
    attr = 1

    def method(self, x):
        try:
            return x / 0
        except ZeroDivisionError as e:
            return None
        finally:
            self.done = True

    @staticmethod
    @decorate
    def smethod(
            a,
            b):
        with open(a) as f:
            return f.read()

    class Nested:
        def deep(self):
            while True:
                if self:
                    break
            return {k: v for k, v in self.items()}

def \u00fcn\u00efcode_\u0444\u0443\u043d\u043a\u0446\u0438\u044f_\u51fd\u6570(x):
    return x + 1

def big_line():
    return [BIG]

def wide_columns():
    return                                                                                                                                                                                                                 (a.b.c.d + e)

def far_jump():
    a = 1
PAD1    b = 2
    c = (a,
PAD2         b)
    while a < 10:
        a += 1
PAD3    return c
PAD4
def far_first_line(q):
    return (q,
PAD5            q)
"""
SNIPPET = (SNIPPET.replace("BIG", ", ".join("x%d" % i for i in range(400)))
           .replace("PAD1", PAD_FAR).replace("PAD2", "\n" * 200)
           .replace("PAD3", "\n" * 150).replace("PAD4", "\n" * 2000)
           .replace("PAD5", "\n" * 129))

MATCH_SNIPPET = """
def matcher(cmd):
    match cmd.split():
        case [action]:
            return action
        case [action, obj] if obj:
            return obj
        case _:
            return None
"""

MODULES = ("json.decoder", "argparse", "dis", "asyncio.base_events")

try:
    import ctypes
    _a2l = ctypes.pythonapi.PyCode_Addr2Line
    _a2l.argtypes = [ctypes.py_object, ctypes.c_int]
    _a2l.restype = ctypes.c_int
except Exception:
    _a2l = None


def walk(co, out):
    out.append(co)
    for const in co.co_consts:
        if isinstance(const, types.CodeType):
            walk(const, out)


def expected_lines(co):
    n = len(co.co_code)
    if VER < (3, 10):
        starts = list(dis.findlinestarts(co))
        exp = [None] * n
        idx, line = -1, None
        for off in range(n):
            while idx + 1 < len(starts) and starts[idx + 1][0] <= off:
                idx += 1
                line = starts[idx][1]
            exp[off] = line
        return exp
    exp = [-1] * n
    for start, end, line in co.co_lines():
        for off in range(start, min(end, n)):
            exp[off] = -1 if line is None else line
    return exp


def positions_lines(co):
    if VER < (3, 11):
        return None
    exp = []
    for pos in co.co_positions():
        line = -1 if pos[0] is None else pos[0]
        exp.extend((line, line))
    return exp[:len(co.co_code)]


def main():
    codes = []
    walk(compile(SNIPPET, "<snippet>", "exec"), codes)
    if VER >= (3, 10):
        walk(compile(MATCH_SNIPPET, "<match>", "exec"), codes)
    for name in MODULES:
        mod = importlib.import_module(name)
        with tokenize.open(mod.__file__) as fh:
            src = fh.read()
        walk(compile(src, mod.__file__, "exec"), codes)
    records = []
    for co in codes:
        table = co.co_lnotab if VER < (3, 10) else co.co_linetable
        rec = {
            "name": getattr(co, "co_qualname", co.co_name),
            "file": co.co_filename,
            "first": co.co_firstlineno,
            "table": table.hex(),
            "n": len(co.co_code),
            "lines": expected_lines(co),
            "positions": positions_lines(co),
            "addr2line": None,
        }
        if _a2l is not None:
            rec["addr2line"] = [_a2l(co, off) for off in range(len(co.co_code))]
        records.append(rec)
    json.dump({"version": list(sys.version_info[:3]), "records": records},
              sys.stdout, separators=(",", ":"))


main()
'''


@functools.lru_cache(maxsize=None)
def _dump(python):
    res = subprocess.run([python, "-I", "-c", DUMPER], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, universal_newlines=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _check_record(version, rec):
    """Return a list of mismatch descriptions for one code object."""
    table = bytes.fromhex(rec["table"])
    first = rec["first"]
    n = rec["n"]
    lt = LineTable(version, table, first)
    got_ranges = [lt.line_for_offset(off) for off in range(n)]
    problems = []
    for oracle in ("lines", "positions", "addr2line"):
        exp = rec[oracle]
        if exp is None:
            continue
        assert len(exp) == n, (rec["name"], oracle, len(exp), n)
        if got_ranges != exp:
            bad = [off for off in range(n) if got_ranges[off] != exp[off]]
            problems.append("%s %s first=%d: %d offsets differ from %s, e.g. off %d: "
                            "decoded %r expected %r"
                            % (rec["file"], rec["name"], first, len(bad), oracle,
                               bad[0], got_ranges[bad[0]], exp[bad[0]]))
    # The one-shot scanner must agree with the range decoder (instruction
    # offsets; every byte offset for small code objects).
    step = 1 if n * max(len(table), 1) < 400000 else 2
    for off in range(0, n, step):
        scan = line_for_offset(version, table, first, off)
        if scan != got_ranges[off]:
            problems.append("%s %s: line_for_offset(%d) = %r, LineTable says %r"
                            % (rec["file"], rec["name"], off, scan, got_ranges[off]))
            break
    return problems


@pytest.mark.parametrize("label,finder", INTERPRETERS, ids=[i[0] for i in INTERPRETERS])
def test_decoders_match_interpreter(label, finder):
    python = finder()
    if python is None:
        pytest.skip("%s is not installed" % label)
    data = _dump(python)
    version = tuple(data["version"])
    records = data["records"]
    assert len(records) > 200, "too few code objects dumped"
    names = {r["name"] for r in records}
    for needed in ("outer", "gen", "coro", "<lambda>", "big_line", "far_jump",
                   "far_first_line", "wide_columns"):
        assert any(n == needed or n.endswith("." + needed) or n.endswith(needed)
                   for n in names), needed
    assert any("\u51fd\u6570" in n for n in names)
    if version >= (3, 10):
        assert any(n.endswith("matcher") for n in names)
    problems = []
    offsets = 0
    for rec in records:
        problems.extend(_check_record(version, rec))
        offsets += rec["n"]
    assert not problems, "%d problems on %s (%d offsets):\n%s" % (
        len(problems), label, offsets, "\n".join(problems[:20]))


# ---------------------------------------------------------------------------
# Hand-made tables
# ---------------------------------------------------------------------------
def _sv(v):
    """Encode a signed varint (location table)."""
    u = (-v << 1) | 1 if v < 0 else v << 1
    return _uv(u)


def _uv(u):
    out = bytearray()
    while True:
        chunk = u & 63
        u >>= 6
        if u:
            out.append(chunk | 64)
        else:
            out.append(chunk)
            return bytes(out)


def _entry(code, units):
    return bytes([0x80 | (code << 3) | (units - 1)])


def test_table_kind():
    assert table_kind((3, 7)) == "lnotab"
    assert table_kind((3, 9, 18)) == "lnotab"
    assert table_kind((3, 10)) == "linetable310"
    for minor in (11, 12, 13, 14):
        assert table_kind((3, minor)) == "location"
    with pytest.raises(ValueError):
        table_kind((2, 7))


def test_lnotab_signed_increments():
    # Pairs (addr_incr, line_incr): 0-5 line 100; at 6: +2; at 10: -3 then
    # +127 (a zero-width pair adds to the same address); at 14: +3.
    table = bytes([6, 2, 4, 0xFD, 0, 127, 4, 3])
    first = 100
    exp = {0: 100, 5: 100, 6: 102, 9: 102, 10: 226, 13: 226, 14: 229, 17: 229,
           18: 229, 1000: 229, -2: 100}
    lt = LineTable((3, 8), table, first)
    for off, line in exp.items():
        assert line_for_offset((3, 8), table, first, off) == line, off
        assert lt.line_for_offset(off) == line, off
    assert line_for_offset((3, 9), b"", 7, 0) == 7
    assert line_for_offset((3, 9), b"", 7, 50) == 7


def test_linetable310_no_line_and_splits():
    # [0,4): +1; [4,8): no line; [8,8+254): +3; [262, 270): +0 (split of a long
    # range); [270, 272): +127+127+1 via two empty entries.
    table = bytes([4, 1, 4, 0x80, 254, 3, 8, 0, 0, 127, 0, 127, 2, 1])
    first = 10
    exp = {0: 11, 3: 11, 4: -1, 7: -1, 8: 14, 261: 14, 262: 14, 269: 14,
           270: 269, 271: 269, 272: -1, -1: 10}
    lt = LineTable((3, 10), table, first)
    for off, line in exp.items():
        assert line_for_offset((3, 10), table, first, off) == line, off
        assert lt.line_for_offset(off) == line, off
    assert decode_ranges((3, 10), table, first) == [
        (0, 4, 11), (4, 8, -1), (8, 270, 14), (270, 272, 269)]


def test_location_table_forms():
    table = b"".join([
        _entry(13, 1) + _sv(0),                      # [0,2)   line 50 (no columns)
        _entry(5, 2) + bytes([7]),                   # [2,6)   short form, same line
        _entry(12, 1) + bytes([3, 9]),               # [6,8)   one-line form, +2 -> 52
        _entry(15, 3),                               # [8,14)  no location
        _entry(14, 8) + _sv(-300) + _uv(2) + _uv(200) + _uv(5),  # [14,30) -> -248
        _entry(13, 1) + _sv(1000),                   # [30,32) -> 752
        _entry(10, 1) + bytes([1, 2]),               # [32,34) one-line +0 -> 752
    ])
    first = 50
    exp = {0: 50, 1: 50, 2: 50, 5: 50, 6: 52, 8: -1, 13: -1, 14: -248, 29: -248,
           30: 752, 32: 752, 33: 752, 34: -1, 500: -1, -4: 50}
    lt = LineTable((3, 12), table, first)
    for ver in ((3, 11), (3, 12), (3, 13), (3, 14)):
        for off, line in exp.items():
            assert line_for_offset(ver, table, first, off) == line, (ver, off)
    for off, line in exp.items():
        assert lt.line_for_offset(off) == line, off
    assert lt.ranges == [(0, 6, 50), (6, 8, 52), (8, 14, -1), (14, 30, -248),
                         (30, 34, 752)]


def test_location_table_truncated_or_corrupt():
    good = _entry(13, 1) + _sv(1) + _entry(13, 2) + _sv(1)
    # Truncated in the middle of an entry: earlier entries still decode.
    trunc = good + _entry(14, 1) + bytes([0x41])
    assert line_for_offset((3, 12), trunc, 1, 0) == 2
    assert line_for_offset((3, 12), trunc, 1, 4) == 3
    assert line_for_offset((3, 12), trunc, 1, 6) == -1
    assert LineTable((3, 12), trunc, 1).ranges == [(0, 2, 2), (2, 6, 3)]
    # A byte without the entry-start bit.
    bad = good + b"\x05" + good
    assert line_for_offset((3, 11), bad, 1, 7) == -1
    assert LineTable((3, 11), bad, 1).line_for_offset(2) == 3


def test_ranges_sorted_and_disjoint():
    co = _check_record.__code__  # any real code object will do
    ver = sys.version_info[:2]
    table = co.co_lnotab if ver < (3, 10) else co.co_linetable
    ranges = decode_ranges(ver, table, co.co_firstlineno)
    assert ranges
    for (s1, e1, l1), (s2, e2, l2) in zip(ranges, ranges[1:]):
        assert s1 < e1 <= s2 < e2
        assert not (e1 == s2 and l1 == l2)


def test_current_interpreter_frame_line():
    """The running frame's own line, decoded from its table."""
    frame = sys._getframe()
    co = frame.f_code
    ver = sys.version_info[:2]
    table = co.co_lnotab if ver < (3, 10) else co.co_linetable
    assert line_for_offset(ver, table, co.co_firstlineno, frame.f_lasti) == frame.f_lineno
    assert linetable.NO_LINE == -1
