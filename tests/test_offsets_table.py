"""The generated CPython offsets table (pyoffcpu.cpython.offsets_table).

* every version has exactly the expected keys, all ints;
* the committed file equals a fresh ``tools/gen_offsets.py`` run (skipped when
  gcc, one of the pyenv 3.7-3.13 header sets or the chroot's 3.15 headers is missing);
* the committed values equal the reference document's table (as transcribed in
  tools/gen_offsets.py);
* live: under each installed interpreter, the offsets are used to read the
  interpreter's own structures through ctypes (runtime -> interpreter -> thread
  list, the autoTSSkey pthread key, the current frame chain and its line, code
  object fields, str/bytes layouts) and compared with what the C API and Python
  itself report.
"""

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from pyoffcpu.cpython import offsets_table
from pyoffcpu.cpython.linetable import line_for_offset
from pyoffcpu.cpython.offsets_table import OFFSETS, OFFSETS_FROM_SOURCE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEN = os.path.join(REPO, "tools", "gen_offsets.py")
COMPILED_VERSIONS = [(3, m) for m in range(7, 14)] + [(3, 15)]


@functools.lru_cache(maxsize=None)
def _gen():
    spec = importlib.util.spec_from_file_location("gen_offsets", GEN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_version_has_every_key():
    keys = _gen().KEYS
    assert tuple(offsets_table.KEYS) == tuple(keys)
    assert sorted(OFFSETS) == COMPILED_VERSIONS
    assert sorted(OFFSETS_FROM_SOURCE) == [(3, 14)]
    for table in (OFFSETS, OFFSETS_FROM_SOURCE):
        for ver, fields in table.items():
            assert set(fields) == set(keys), ver
            for key, val in fields.items():
                assert isinstance(val, int) and val >= -1, (ver, key, val)
    for ver, fields in OFFSETS.items():
        absent = {k for k, v in fields.items() if v == -1}
        assert absent == _gen().expected_absent(ver[1]), ver


def test_matches_reference_doc():
    gen = _gen()
    # The probe-only extra values (x_*) are not in the table; the generator
    # itself checks those.
    mismatches = [line for line in gen.cross_check(OFFSETS, {})
                  if not line.split()[1].startswith("x_")]
    assert mismatches == []
    assert OFFSETS_FROM_SOURCE[(3, 14)] == gen.from_source_314()
    src = OFFSETS_FROM_SOURCE[(3, 14)]
    assert src["iframe_owner"] == 74 and src["code_code_adaptive"] == 208
    assert src["owner_cstack"] == 4 and src["runtime_interpreters_head"] == 808


def test_matches_fresh_generation():
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found")
    installs = {**_gen().find_installs(), **_gen().find_chroot_installs()}
    missing = [v for v in COMPILED_VERSIONS if v not in installs]
    if missing:
        pytest.skip("headers missing for %s (pyenv; 3.15: tools/build-chroot.sh's root)" % missing)
    res = subprocess.run([sys.executable, GEN, "--check"], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         universal_newlines=True, timeout=600)
    assert res.returncode == 0, res.stdout


# ---------------------------------------------------------------------------
# Live check inside each interpreter (script must stay 3.7-compatible)
# ---------------------------------------------------------------------------
LIVE = r'''
import ctypes, json, sys, threading, types

O = json.loads(sys.argv[1])
V = sys.version_info[:2]
api = ctypes.pythonapi
libc = ctypes.CDLL(None)
C64 = ctypes.c_uint64.from_address
C32 = ctypes.c_int32.from_address
U32 = ctypes.c_uint32.from_address
C8 = ctypes.c_uint8.from_address
VP = ctypes.c_void_p
for fn, res, args in (("PyThreadState_Get", VP, []),
                      ("PyInterpreterState_Head", VP, []),
                      ("PyInterpreterState_Next", VP, [VP]),
                      ("PyInterpreterState_ThreadHead", VP, [VP]),
                      ("PyThreadState_Next", VP, [VP]),
                      ("PyUnicode_AsUTF8", VP, [ctypes.py_object])):
    getattr(api, fn).restype = res
    getattr(api, fn).argtypes = args
libc.pthread_getspecific.restype = VP
libc.pthread_getspecific.argtypes = [ctypes.c_uint]

OUT = {"eq": {}, "lines": []}


def eq(name, got, want):
    OUT["eq"][name] = [got, want]


def z(p):
    return p or 0


rt = ctypes.addressof(ctypes.c_char.in_dll(api, "_PyRuntime"))
tss = rt + O["runtime_autotss"]
key = U32(tss + O["tss_key"]).value


def helper(info, ready, stop):
    info["ident"] = threading.get_ident()
    if V >= (3, 8):
        info["native"] = threading.get_native_id()
    info["tstate"] = api.PyThreadState_Get()
    info["tss"] = z(libc.pthread_getspecific(key))
    ready.set()
    stop.wait()


def read_line_info(code_addr, table_off, offset, lineno):
    tbl = C64(code_addr + table_off).value
    size = C64(tbl + O["bytes_size"]).value
    data = ctypes.string_at(tbl + O["bytes_data"], size)
    first = C32(code_addr + O["code_firstlineno"]).value
    OUT["lines"].append([data.hex(), first, offset, lineno])
    return data, first


def frames_check():
    me = sys._getframe()
    co = me.f_code
    ts = api.PyThreadState_Get()
    if V < (3, 11):
        f = C64(ts + O["tstate_frame"]).value
        eq("tstate->frame", f, id(me))
        eq("frame->f_back", C64(f + O["frame_back"]).value, id(me.f_back))
        eq("frame->f_code", C64(f + O["frame_code"]).value, id(co))
        lasti, lineno = C32(f + O["frame_lasti"]).value, me.f_lineno
        off = lasti if V < (3, 10) else 2 * lasti
        data, first = read_line_info(id(co), O["code_linetable"], off, lineno)
        eq("code->linetable", data, co.co_lnotab if V < (3, 10) else co.co_linetable)
        eq("code->co_code", C64(id(co) + O["code_code"]).value, id(co.co_code))
    else:
        if V < (3, 13):
            cf = C64(ts + O["tstate_cframe"]).value
            fr = C64(cf + O["cframe_current_frame"]).value
        else:
            fr = C64(ts + O["tstate_current_frame"]).value
        eq("iframe->code", C64(fr + O["iframe_code"]).value, id(co))
        eq("iframe->owner", C8(fr + O["iframe_owner"]).value, 0)
        instr, lineno = C64(fr + O["iframe_instr"]).value, me.f_lineno
        off = instr - (id(co) + O["code_code_adaptive"])
        data, first = read_line_info(id(co), O["code_linetable"], off, lineno)
        eq("code->linetable", data, co.co_linetable)
        ft = C32(id(co) + O["code_firsttraceable"]).value
        eq("frame is complete", 0 <= ft and 2 * ft <= off < len(co.co_code), True)
        prev = C64(fr + O["iframe_previous"]).value
        eq("iframe->previous->code", C64(prev + O["iframe_code"]).value,
           id(me.f_back.f_code))
        chain = [fr]
        while C64(chain[-1] + O["iframe_previous"]).value and len(chain) < 100:
            chain.append(C64(chain[-1] + O["iframe_previous"]).value)
        last = chain[-1]
        if V == (3, 11):
            eq("is_entry(me)", C8(fr + O["iframe_is_entry"]).value, 0)
            eq("is_entry(outermost)", C8(last + O["iframe_is_entry"]).value, 1)
        else:
            eq("owner(outermost) == CSTACK", C8(last + O["iframe_owner"]).value,
               O["owner_cstack"])
        eq("PyCode_Type.tp_basicsize == co_code_adaptive",
           C64(id(types.CodeType) + O["type_basicsize"]).value,
           O["code_code_adaptive"])
        eq("code->qualname", C64(id(co) + O["code_qualname"]).value, id(co.co_qualname))
    eq("code->firstlineno", first, co.co_firstlineno)
    eq("code->filename", C64(id(co) + O["code_filename"]).value, id(co.co_filename))
    eq("code->name", C64(id(co) + O["code_name"]).value, id(co.co_name))


def gen_owner():
    ts = api.PyThreadState_Get()
    if V < (3, 13):
        fr = C64(C64(ts + O["tstate_cframe"]).value + O["cframe_current_frame"]).value
    else:
        fr = C64(ts + O["tstate_current_frame"]).value
    yield C8(fr + O["iframe_owner"]).value


def check_str(label, s):
    addr = id(s)
    state = U32(addr + O["unicode_state"]).value
    length = ctypes.c_int64.from_address(addr + O["unicode_length"]).value
    eq(label + ".length", length, len(s))
    kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
    eq(label + ".compact", compact, 1)
    if ascii_:
        data = ctypes.string_at(addr + O["ascii_data"], length).decode("ascii")
    else:
        raw = ctypes.string_at(addr + O["compact_data"], length * kind)
        data = raw.decode({1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind])
    eq(label + ".data", data, s)
    if not ascii_:
        p = api.PyUnicode_AsUTF8(s)
        eq(label + ".utf8", z(C64(addr + O["compact_utf8"]).value), p)
        eq(label + ".utf8_length",
           ctypes.c_int64.from_address(addr + O["compact_utf8_length"]).value,
           len(s.encode("utf-8")))


def main():
    ts = api.PyThreadState_Get()
    interp = C64(rt + O["runtime_interpreters_head"]).value
    eq("runtime.interpreters.head", interp, api.PyInterpreterState_Head())
    eq("interp->next", C64(interp + O["interp_next"]).value,
       z(api.PyInterpreterState_Next(interp)))
    eq("autoTSSkey._is_initialized", C32(tss + O["tss_is_initialized"]).value, 1)
    eq("pthread_getspecific(autoTSSkey) == tstate", z(libc.pthread_getspecific(key)), ts)

    info, ready, stop = {}, threading.Event(), threading.Event()
    th = threading.Thread(target=helper, args=(info, ready, stop))
    th.start()
    ready.wait()
    try:
        eq("helper: pthread_getspecific(autoTSSkey)", info["tss"], info["tstate"])
        head = C64(interp + O["interp_threads_head"]).value
        eq("interp->threads.head", head, api.PyInterpreterState_ThreadHead(interp))
        walk, capi = [], []
        p = head
        while p and len(walk) < 64:
            walk.append(p)
            p = C64(p + O["tstate_next"]).value
        p = api.PyInterpreterState_ThreadHead(interp)
        while p and len(capi) < 64:
            capi.append(p)
            p = api.PyThreadState_Next(p)
        eq("thread list via tstate->next", walk, capi)
        eq("helper tstate listed", info["tstate"] in walk, True)
        eq("tstate->interp", sorted({C64(t + O["tstate_interp"]).value for t in walk}),
           [interp])
        idents = {C64(t + O["tstate_thread_id"]).value for t in walk}
        eq("tstate->thread_id", sorted(idents),
           sorted({threading.get_ident(), info["ident"]}))
        if V >= (3, 11):
            natives = {C64(t + O["tstate_native_thread_id"]).value for t in walk}
            eq("tstate->native_thread_id", sorted(natives),
               sorted({threading.get_native_id(), info["native"]}))
    finally:
        stop.set()
        th.join()

    frames_check()
    if V >= (3, 11):
        eq("generator frame owner", next(gen_owner()), O["owner_generator"])

    co = frames_check.__code__
    eq("ob_type", C64(id(co) + O["object_type"]).value, id(types.CodeType))
    eq("tp_name", ctypes.string_at(C64(id(types.CodeType) + O["type_name"]).value),
       b"code")
    b = b"offsets-table bytes"
    eq("bytes.ob_size", C64(id(b) + O["bytes_size"]).value, len(b))
    eq("bytes.ob_sval", ctypes.string_at(id(b) + O["bytes_data"], len(b)), b)
    check_str("ascii", "frames_check_" + str(len(b)))
    check_str("latin1", "caf\u00e9_" + str(len(b)))
    check_str("ucs2", "\u0444\u0443\u043d\u043a\u0446\u0438\u044f_" + str(len(b)))
    check_str("ucs4", "\U00020000_name_" + str(len(b)))

    for k, (got, want) in list(OUT["eq"].items()):
        if isinstance(got, bytes):
            OUT["eq"][k] = [got.hex(), want.hex()]
    OUT["version"] = list(sys.version_info[:3])
    print(json.dumps(OUT))


main()
'''


def _pythons():
    out = []
    gen = _gen()
    installs = gen.find_installs()
    # pyenv's: 3.15 (Debian's, in the chroot) is checked live by the BPF tests
    for ver in [v for v in COMPILED_VERSIONS if v <= (3, 13)]:
        path = None
        if ver in installs:
            name, inc = installs[ver][-1]
            prefix = os.path.dirname(os.path.dirname(inc))
            cand = os.path.join(prefix, "bin", "python3")
            if os.access(cand, os.X_OK):
                path = cand
        out.append(("pyenv-3.%d" % ver[1], ver, path))
    sysp = "/usr/bin/python3.11"
    out.append(("system-3.11", (3, 11), sysp if os.access(sysp, os.X_OK) else None))
    return out


PYTHONS = _pythons()


@pytest.mark.parametrize("label,ver,python", PYTHONS, ids=[p[0] for p in PYTHONS])
def test_live_offsets(label, ver, python):
    if python is None:
        pytest.skip("%s is not installed" % label)
    res = subprocess.run([python, "-I", "-c", LIVE, json.dumps(OFFSETS[ver])],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         universal_newlines=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert tuple(out["version"][:2]) == ver
    bad = {k: v for k, v in out["eq"].items() if v[0] != v[1]}
    assert not bad, "%s: %s" % (label, json.dumps(bad, indent=1))
    assert len(out["eq"]) >= 25
    assert out["lines"]
    for table_hex, first, offset, lineno in out["lines"]:
        got = line_for_offset(ver, bytes.fromhex(table_hex), first, offset)
        assert got == lineno, (label, offset, got, lineno)
