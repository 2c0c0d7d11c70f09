"""CPython 3.14 without a 3.14 interpreter: a target process built in memory.

No 3.14 runs here, so its path is exercised against a fake address space laid
out from the reference document (cpython-frames.md: section 1 for the struct
layouts, section 3 for where _Py_DebugOffsets keeps each value, section 4 for
tagged f_executable and the renumbered frame owners):

* detection: version from Py_Version and the _Py_DebugOffsets header, the
  run-time offsets read from the blob and cross-checked against the table,
  the free-threaded flag, versions we do not know;
* the thread-state key, from _PyRuntime.autoTSSkey and from the thread's own
  pthread_getspecific slot;
* the frame walk (cpython/walker.py: the same records BPF makes), code objects,
  strings (ASCII and UCS-2), the location table, and the merger's Python groups:
  tagged code pointers, FRAME_OWNED_BY_INTERPRETER (3) entry frames with
  f_executable = None|1, a generator frame, a 3.13-style _Py_InitCleanup frame.

The positions and values are transcribed here on purpose, not taken from the
generated table: the test checks the table against the reference.
"""
import struct

import pytest

from pyoffcpu.cpython import debug_offsets, detect, walker
from pyoffcpu.cpython.code import CodeReader
from pyoffcpu.cpython.offsets_table import OFFSETS_FROM_SOURCE
from pyoffcpu.kernel.memory import MemoryError_
from pyoffcpu.profile.merge import Merger
from pyoffcpu.collect.recording import Options, PyStack, Recording

# -- the reference, transcribed ---------------------------------------------------
# cpython-frames.md section 3: positions inside the 3.14 _Py_DebugOffsets (760 bytes).
POS = {
    "runtime_interpreters_head": 40,
    "interp_next": 64, "interp_threads_head": 72,
    "tstate_next": 192, "tstate_current_frame": 208, "tstate_thread_id": 216,
    "tstate_native_thread_id": 224,
    "iframe_previous": 256, "iframe_code": 264, "iframe_instr": 272, "iframe_owner": 288,
    "code_filename": 320, "code_name": 328, "code_qualname": 336, "code_linetable": 344,
    "code_firstlineno": 352, "code_code_adaptive": 384,
    "bytes_size": 600, "bytes_data": 608,
    "unicode_state": 624, "unicode_length": 632, "ascii_data": 640,
    # not listed in the reference; summed from py-spy's bindgen of the 3.14.0 headers
    "tstate_interp": 200, "object_type": 408, "type_name": 424,
    # read from Debian's 3.14.8 (gen_offsets.py)
    "interp_ceval_gil": 120,
}
DEBUG_SIZE = 760
# cpython-frames.md section 1, column 3.14: the values at those positions.
VAL = {
    "runtime_interpreters_head": 808,
    "interp_next": 7272, "interp_threads_head": 7344,
    "tstate_next": 8, "tstate_current_frame": 72, "tstate_thread_id": 152,
    "tstate_native_thread_id": 160,
    "iframe_previous": 8, "iframe_code": 0, "iframe_instr": 56, "iframe_owner": 74,
    "code_filename": 112, "code_name": 120, "code_qualname": 128, "code_linetable": 136,
    "code_firstlineno": 68, "code_code_adaptive": 208,
    "bytes_size": 16, "bytes_data": 32,
    "unicode_state": 32, "unicode_length": 16, "ascii_data": 40,
    "tstate_interp": 16, "object_type": 8, "type_name": 24,
    "interp_ceval_gil": 16,
}
FIRSTTRACEABLE = 192            # _co_firsttraceable, section 4
COMPACT_DATA = 56               # sizeof(PyCompactUnicodeObject) from 3.12 on
OB_TYPE = 8
AUTOTSS = 2336                  # _PyRuntime.autoTSSkey (not in the reference: see gen_offsets.py)
PTHREAD_SPECIFIC = 0x310        # glibc 2.36 x86_64 specific_1stblock
OWNER_THREAD, OWNER_GENERATOR, OWNER_INTERPRETER = 0, 1, 3
VERSION_HEX = 0x030E00F0        # 3.14.0 final
TSS_KEY = 3


class FakeMemory:
    """A sparse address space with ProcessMemory's interface."""

    def __init__(self):
        self.regions = []           # (start, bytearray)

    def map(self, start, size):
        buf = bytearray(size)
        self.regions.append((start, buf))
        return buf

    def _find(self, addr, size):
        for start, buf in self.regions:
            if start <= addr and addr + size <= start + len(buf):
                return buf, addr - start
        raise MemoryError_("unmapped %#x" % addr)

    def write(self, addr, data):
        buf, off = self._find(addr, len(data))
        buf[off:off + len(data)] = data

    def put(self, addr, fmt, *vals):
        self.write(addr, struct.pack("<" + fmt, *vals))

    def read(self, addr, size):
        if addr <= 0 or size < 0:
            raise MemoryError_("bad read")
        buf, off = self._find(addr, size)
        return bytes(buf[off:off + size])

    def u64(self, a): return struct.unpack("<Q", self.read(a, 8))[0]
    def i64(self, a): return struct.unpack("<q", self.read(a, 8))[0]
    def u32(self, a): return struct.unpack("<I", self.read(a, 4))[0]
    def i32(self, a): return struct.unpack("<i", self.read(a, 4))[0]
    def close(self): pass


RUNTIME = 0x10000
PY_VERSION = 0x20000
CODE_TYPE = 0x20100             # &PyCode_Type
NONE = 0x20200                  # &_Py_NoneStruct
INTERP = 0x30000
TSTATE = 0x40000
PTHREAD = 0x50000
FRAMES = 0x60000
HEAP = 0x70000


class Target:
    """A 3.14 process with one thread whose stack is, innermost first:
        leaf           (owner THREAD, f_executable tagged |1)
        init_cleanup   (owner THREAD, not started: hidden like 3.13's _Py_InitCleanup)
        gen            (owner GENERATOR, tagged |3)
        <entry>        (owner INTERPRETER, f_executable None|1)
        outer
        <entry>        (owner INTERPRETER, previous NULL)
    """

    def __init__(self, **blob_changes):
        self.mem = m = FakeMemory()
        m.map(RUNTIME, 0x4000)
        m.map(PY_VERSION, 0x1000)
        for base in (INTERP, TSTATE, PTHREAD, FRAMES):
            m.map(base, 0x10000)
        m.map(HEAP, 0x10000)
        self.heap = HEAP
        m.put(PY_VERSION, "I", VERSION_HEX)
        # _Py_DebugOffsets at the start of _PyRuntime
        m.write(RUNTIME, b"xdebugpy")
        m.put(RUNTIME + 8, "QQ", blob_changes.pop("version", VERSION_HEX),
              blob_changes.pop("free_threaded", 0))
        for key, pos in POS.items():
            m.put(RUNTIME + pos, "Q", blob_changes.get(key, VAL[key]))
        # autoTSSkey: Py_tss_t {int _is_initialized; pthread_key_t _key;}
        m.put(RUNTIME + AUTOTSS, "iI", 1, TSS_KEY)
        # one interpreter, one thread
        m.put(RUNTIME + VAL["runtime_interpreters_head"], "Q", INTERP)
        m.put(INTERP + VAL["interp_next"], "Q", 0)
        m.put(INTERP + VAL["interp_threads_head"], "Q", TSTATE)
        m.put(TSTATE + VAL["tstate_next"], "Q", 0)
        m.put(TSTATE + VAL["tstate_thread_id"], "Q", PTHREAD)
        m.put(TSTATE + VAL["tstate_native_thread_id"], "Q", 4242)
        # pthread_getspecific(TSS_KEY) == tstate; another key holds something else
        m.put(PTHREAD + PTHREAD_SPECIFIC + 16 * TSS_KEY, "QQ", 1, TSTATE)
        m.put(PTHREAD + PTHREAD_SPECIFIC + 16 * 1, "QQ", 1, 0xdead0)

        table = bytes(self.location_table())
        self.leaf = self.code("leaf", "Mod.leaf", "/app/mod.py", 10, table, 1)
        self.gen = self.code("gen", "Mod.gen", "/app/mod.py", 20, table, 1)
        self.outer = self.code("outer", "outer_ü", "/app/ürl.py", 30, table, 0)
        self.shim = self.code("__init__", "__init__", "__init__", 0, b"\xf8", 4)
        f = [FRAMES + 0x100 * i for i in range(6)]
        self.frame(f[0], self.leaf | 1, f[1], self.leaf, 6, OWNER_THREAD)
        self.frame(f[1], self.shim, f[2], self.shim, 0, OWNER_THREAD)
        self.frame(f[2], self.gen | 3, f[3], self.gen, 2, OWNER_GENERATOR)
        self.frame(f[3], NONE | 1, f[4], 0, 0, OWNER_INTERPRETER)
        self.frame(f[4], self.outer, f[5], self.outer, 0, OWNER_THREAD)
        self.frame(f[5], NONE | 1, 0, 0, 0, OWNER_INTERPRETER)
        m.put(TSTATE + VAL["tstate_current_frame"], "Q", f[0])

    @staticmethod
    def location_table():
        """3.11+ location table: firstlineno+1 for code unit 0, +2 more for units 1-3."""
        return [0x80 | (13 << 3) | 0, 0x02,        # 1 unit, line delta +1
                0x80 | (13 << 3) | 2, 0x04]        # 3 units, line delta +2

    def alloc(self, size):
        addr = self.heap
        self.heap += (size + 15) & ~15
        return addr

    def string(self, text):
        m = self.mem
        if all(ord(c) < 128 for c in text):
            addr = self.alloc(VAL["ascii_data"] + len(text) + 1)
            m.put(addr + VAL["unicode_length"], "q", len(text))
            m.put(addr + VAL["unicode_state"], "I", (1 << 2) | (1 << 5) | (1 << 6))
            m.write(addr + VAL["ascii_data"], text.encode("ascii"))
        else:
            data = text.encode("utf-16-le")
            addr = self.alloc(COMPACT_DATA + len(data) + 2)
            m.put(addr + VAL["unicode_length"], "q", len(text))
            m.put(addr + VAL["unicode_state"], "I", (2 << 2) | (1 << 5))
            m.write(addr + COMPACT_DATA, data)
        return addr

    def code(self, name, qualname, filename, firstlineno, table, firsttraceable):
        m = self.mem
        tab = self.alloc(VAL["bytes_data"] + len(table) + 1)
        m.put(tab + VAL["bytes_size"], "q", len(table))
        m.write(tab + VAL["bytes_data"], table)
        co = self.alloc(VAL["code_code_adaptive"] + 64)
        m.put(co + OB_TYPE, "Q", CODE_TYPE)
        m.put(co + VAL["code_firstlineno"], "i", firstlineno)
        m.put(co + VAL["code_filename"], "Q", self.string(filename))
        m.put(co + VAL["code_name"], "Q", self.string(name))
        m.put(co + VAL["code_qualname"], "Q", self.string(qualname))
        m.put(co + VAL["code_linetable"], "Q", tab)
        m.put(co + FIRSTTRACEABLE, "i", firsttraceable)
        return co

    def frame(self, addr, executable, previous, code, offset, owner):
        m = self.mem
        m.put(addr + VAL["iframe_code"], "Q", executable)
        m.put(addr + VAL["iframe_previous"], "Q", previous)
        m.put(addr + VAL["iframe_instr"], "Q", (code + VAL["code_code_adaptive"] + offset) if code else 0)
        m.write(addr + VAL["iframe_owner"], bytes([owner]))

    def describe(self):
        return detect.describe(self.mem, 4242, "/usr/lib/libpython3.14.so.1.0", RUNTIME,
                               {"Py_Version": PY_VERSION, "PyCode_Type": CODE_TYPE})


# -- the table and the blob ---------------------------------------------------------
def test_table_matches_the_reference():
    src = OFFSETS_FROM_SOURCE[(3, 14)]
    for key, val in VAL.items():
        assert src[key] in (val, -1), key           # -1: the run-time value fills it in
        assert key == "type_name" or src[key] == val, key
    assert src["runtime_autotss"] == AUTOTSS
    assert src["code_firsttraceable"] == FIRSTTRACEABLE
    assert src["compact_data"] == COMPACT_DATA
    assert src["owner_cstack"] == 4 and src["owner_generator"] == OWNER_GENERATOR
    assert debug_offsets.positions((3, 14))["sizeof"] == DEBUG_SIZE
    for key, pos in POS.items():
        assert debug_offsets.positions((3, 14))[key] == pos, key


def test_blob_parses_to_the_reference_values():
    t = Target()
    dbg = debug_offsets.read(t.mem, RUNTIME)
    assert dbg.version == (3, 14, 0) and not dbg.free_threaded
    for key, val in VAL.items():
        assert dbg.values[key] == val, key


def test_bad_blobs_are_refused():
    with pytest.raises(debug_offsets.BadDebugOffsets):
        debug_offsets.parse(b"xdebugpz" + bytes(800))
    with pytest.raises(debug_offsets.BadDebugOffsets):          # truncated
        debug_offsets.parse(Target().mem.read(RUNTIME, 100))
    t = Target(code_name=1 << 40)                                # not an offset
    with pytest.raises(debug_offsets.BadDebugOffsets):
        debug_offsets.read(t.mem, RUNTIME)


# -- detection -----------------------------------------------------------------------
def test_detects_314_from_the_debug_offsets():
    pp = Target().describe()
    assert pp.version == (3, 14, 0) and pp.minor == (3, 14)
    assert pp.debug_offsets and pp.from_source
    assert pp.notices == []
    assert pp.tss_key == TSS_KEY
    assert pp.code_type == CODE_TYPE
    assert detect.walker_kind(pp.minor) == 3            # WALK_OWNER: owner-byte boundaries
    # what the loader hands to BPF (session._register) is all there
    for key in ("tstate_current_frame", "iframe_code", "iframe_previous", "iframe_instr",
                "iframe_owner", "code_code_adaptive"):
        assert pp.offsets[key] >= 0, key
    assert pp.offsets["tstate_cframe"] == -1 and pp.offsets["iframe_is_entry"] == -1


def test_runtime_offsets_win_over_the_table_with_a_notice():
    pp = Target(tstate_current_frame=80, iframe_owner=78).describe()
    assert pp.offsets["tstate_current_frame"] == 80 and pp.offsets["iframe_owner"] == 78
    assert len(pp.notices) == 1
    assert "iframe_owner, tstate_current_frame" in pp.notices[0]
    assert "using the run-time values" in pp.notices[0]


def test_free_threaded_314_is_refused_and_its_offsets_read_as_they_are():
    """A free-threaded build publishes the free_threaded flag and its larger
    object header (32 bytes: ob_type at 24) in _Py_DebugOffsets.  From 3.14
    its threads run per-thread copies of the bytecode, whose lines the walk
    does not read: refused, native stacks only, rather than wrong lines.
    Its values are read as they are all the same (3.13t is walked so); the
    unpublished ones move with their anchors; the table's
    _PyRuntime.autoTSSkey position is not trusted."""
    ft = dict(object_type=24, type_name=40, ascii_data=56, code_code_adaptive=224,
              unicode_length=32, unicode_state=48, bytes_size=32, bytes_data=48)
    t = Target(free_threaded=1, **ft)
    with pytest.raises(detect.Unsupported, match="3.14 free-threaded build: its threads run their "
                                                 "own copies of the bytecode"):
        t.describe()
    table = OFFSETS_FROM_SOURCE[(3, 14)]
    offsets, differ = debug_offsets.merge(table, debug_offsets.read(t.mem, RUNTIME))
    for key, val in ft.items():
        assert offsets[key] == val, key
    for key in ("compact_data", "compact_utf8", "code_firsttraceable"):
        assert table[key] >= 0 and offsets[key] == table[key] + 16, key
    assert offsets["runtime_autotss"] == -1


def test_gil_build_keeps_the_table_where_nothing_moved():
    pp = Target().describe()
    assert not pp.free_threaded and pp.version_str == "3.14.0"
    for key in ("compact_data", "type_basicsize", "code_firsttraceable", "runtime_autotss"):
        assert pp.offsets[key] == OFFSETS_FROM_SOURCE[(3, 14)][key], key


def test_a_newer_version_whose_layout_does_not_hold_is_refused():
    """3.16, read as 3.15: this target is laid out as 3.14, so the live
    checks fail (tests/test_cpython_newer.py has a real 3.16 that passes)."""
    t = Target(version=0x031000A1)                      # 3.16.0a1 debug offsets
    t.mem.put(PY_VERSION, "I", 0x031000A1)
    with pytest.raises(detect.Unsupported, match="CPython 3.16 is newer than tested"):
        t.describe()


def test_py_version_and_debug_offsets_must_agree():
    t = Target()
    t.mem.put(PY_VERSION, "I", 0x030D00F0)
    with pytest.raises(detect.Unsupported, match="version unclear"):
        t.describe()


def test_313_without_the_cookie_is_refused():
    t = Target()
    t.mem.write(RUNTIME, b"\0" * 8)
    t.mem.put(PY_VERSION, "I", 0x030D00F0)
    with pytest.raises(detect.Unsupported, match="no _Py_DebugOffsets"):
        t.describe()


def test_tss_key_from_the_thread_when_the_runtime_disagrees():
    t = Target()
    t.mem.put(RUNTIME + AUTOTSS, "iI", 1, 7)            # a wrong position would read garbage
    pp = t.describe()
    assert pp.tss_key == TSS_KEY
    assert any("autoTSSkey is 3 in the threads but 7" in n for n in pp.notices)


def test_tss_key_from_the_runtime_when_no_thread_is_bound_yet():
    t = Target()
    t.mem.put(PTHREAD + PTHREAD_SPECIFIC + 16 * TSS_KEY, "QQ", 0, 0)
    assert t.describe().tss_key == TSS_KEY
    t.mem.put(RUNTIME + AUTOTSS, "iI", 0, 0)            # not created yet: ask again later
    assert t.describe().tss_key == -1


# -- frames, code objects, merge ---------------------------------------------------------
def _groups(t, pp, frames, flags=0):
    rec = Recording(Options())
    rec.pythons[4242] = pp
    reader = CodeReader(t.mem, pp.minor, pp.offsets, pp.code_type)
    for code, _, _ in frames:
        rec.code[(4242, code)] = reader.code(code)
    rec.pystacks[1] = PyStack(4242, flags, frames)
    return Merger(rec, symbolizer=None).python_groups(1)


def test_walk_untags_code_and_records_owners():
    t = Target()
    pp = t.describe()
    frames, truncated = walker.walk_frames(t.mem, pp, TSTATE)
    assert not truncated
    assert [c for c, _, _ in frames] == [t.leaf, t.shim, t.gen, NONE, t.outer, NONE]
    assert [fl & 0xff for _, _, fl in frames] == [0, 0, 1, 3, 0, 3]
    assert [off for _, off, _ in frames[:3]] == [6, 0, 2]


def test_groups_names_files_lines():
    t = Target()
    pp = t.describe()
    frames, _ = walker.walk_frames(t.mem, pp, TSTATE)
    groups, truncated = _groups(t, pp, frames)
    assert not truncated
    got = [[(f.name, f.file, f.line) for f in g] for g in groups]
    # the _Py_InitCleanup-like frame (offset 0 < 2 * firsttraceable) is hidden; the
    # generator frame is kept; each owner-3 entry frame closes one eval group
    assert got == [[("Mod.leaf", "/app/mod.py", 13), ("Mod.gen", "/app/mod.py", 23)],
                   [("outer_ü", "/app/ürl.py", 31)]]


def test_torn_stack_is_cut_not_printed():
    t = Target()
    pp = t.describe()
    frames, _ = walker.walk_frames(t.mem, pp, TSTATE)
    garbage = t.alloc(64)                                 # not a code object
    torn = frames[:3] + [(garbage, 0, 0)] + frames[3:]
    groups, truncated = _groups(t, pp, torn)
    assert truncated
    assert [[f.name for f in g] for g in groups] == [["Mod.leaf", "Mod.gen"]]
    # nothing readable at all: no Python frames, no marker
    groups, truncated = _groups(t, pp, [(garbage, 0, 0)] + frames)
    assert groups == [] and not truncated


def test_empty_group_still_counts_for_the_native_match():
    """An eval call whose frames have not started yet still has its native
    _PyEval_EvalFrameDefault: its (empty) group keeps the count right."""
    t = Target()
    pp = t.describe()
    frames, _ = walker.walk_frames(t.mem, pp, TSTATE)
    shim_first = [frames[1], frames[3]] + frames[4:]     # hidden frame, entry, outer, entry
    groups, _ = _groups(t, pp, shim_first)
    assert [[f.name for f in g] for g in groups] == [[], ["outer_ü"]]


def test_314_release_build_exporting_forget_reference_is_not_a_debug_build():
    """Debian's release 3.14 exports _Py_ForgetReference: that names no debug
    build from 3.13 on (it once made pyoffcpu refuse Python frames)."""
    t = Target()
    pp = detect.describe(t.mem, 4242, "/usr/bin/python3.14", RUNTIME,
                         {"Py_Version": PY_VERSION, "PyCode_Type": CODE_TYPE},
                         debug_build=["_Py_ForgetReference"])
    assert not pp.debug_build and pp.tss_key == TSS_KEY and pp.version_str == "3.14.0"


def test_314_debug_build_is_walked_and_named():
    t = Target()
    pp = detect.describe(t.mem, 4242, "/usr/lib/libpython3.14d.so", RUNTIME,
                         {"Py_Version": PY_VERSION, "PyCode_Type": CODE_TYPE},
                         debug_build=["_Py_GetGlobalRefTotal", "_Py_ForgetReference"])
    assert pp.debug_build and pp.version_str == "3.14.0 debug" and pp.tss_key == TSS_KEY


def test_debug_build_before_313_is_refused():
    """Before 3.13 nothing in the target describes a debug build's layout:
    native stacks only (fails safe)."""
    t = Target()
    t.mem.write(RUNTIME, b"\0" * 8)                     # no _Py_DebugOffsets
    t.mem.put(PY_VERSION, "I", 0x030C01F0)              # 3.12.1
    with pytest.raises(detect.Unsupported, match="CPython 3.12 is a debug build"):
        detect.describe(t.mem, 4242, "/usr/lib/libpython3.12d.so", RUNTIME,
                        {"Py_Version": PY_VERSION, "PyCode_Type": CODE_TYPE},
                        debug_build=["_Py_GetGlobalRefTotal"])
