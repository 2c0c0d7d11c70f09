"""cpython/objects.py on objects that lie: every value a target can plant
(sizes, lengths, digit counts, type names, loops) gives a bounded result or
`<unreadable>`, never an exception, a hang or a huge read.  The objects are
built by hand in 3.12's layout (object_table.py) in a fake memory that
counts what is read."""
import struct

import pytest

from pyoffcpu.cpython.object_table import LAYOUTS
from pyoffcpu.cpython.objects import ObjectReader
from pyoffcpu.cpython.offsets_table import OFFSETS
from pyoffcpu.cpython.threadnames import MAX_NAME, clean_name
from pyoffcpu.kernel.memory import MemoryError_, WordReads

MINOR = (3, 12)
L = LAYOUTS[MINOR]
BASE = 0x10000


class FakeMemory(WordReads):
    """A region of bytes at BASE; reads outside it fail, and are counted."""

    def __init__(self, size=1 << 16):
        self.buf = bytearray(size)
        self.read_bytes = 0
        self.next = BASE + 64

    def read(self, addr, size):
        self.read_bytes += size
        if addr < BASE or addr + size > BASE + len(self.buf) or size < 0:
            raise MemoryError_(f"outside: {addr:#x}+{size}")
        return bytes(self.buf[addr - BASE:addr - BASE + size])

    def alloc(self, size):
        addr, self.next = self.next, self.next + (size + 15) // 16 * 16
        return addr

    def put(self, addr, fmt, *values):
        struct.pack_into(fmt, self.buf, addr - BASE, *values)


class Objects:
    """Types and objects in the fake memory."""

    def __init__(self):
        self.m = FakeMemory()
        self.types = {}

    def type(self, name):
        if name not in self.types:
            raw = name.encode() + b"\0"
            s = self.m.alloc(len(raw))
            self.m.buf[s - BASE:s - BASE + len(raw)] = raw
            tp = self.m.alloc(400)
            self.m.put(tp + L["type_name"], "<Q", s)
            self.types[name] = tp
        return self.types[name]

    def obj(self, name, size=64):
        a = self.m.alloc(size)
        self.m.put(a + L["object_type"], "<Q", self.type(name))
        return a

    def str_(self, text, length=None):
        raw = text.encode("ascii")
        a = self.obj("str", 48 + len(raw))
        o = OFFSETS[MINOR]
        self.m.put(a + o["unicode_length"], "<q", len(raw) if length is None else length)
        self.m.put(a + o["unicode_state"], "<I", (1 << 2) | (1 << 5) | (1 << 6))   # compact ASCII
        self.m.buf[a + o["ascii_data"] - BASE:a + o["ascii_data"] - BASE + len(raw)] = raw
        return a

    def reader(self):
        return ObjectReader(self.m, MINOR, OFFSETS[MINOR])


def test_well_formed_values_read_back():
    ob = Objects()
    n = ob.obj("int")
    ob.m.put(n + L["var_size"], "<Q", 1 << 3)           # one digit, positive
    ob.m.put(n + L["long_digits"], "<I", 42)
    lst = ob.obj("list")
    items = ob.m.alloc(16)
    ob.m.put(items, "<QQ", n, ob.str_("hi"))
    ob.m.put(lst + L["var_size"], "<q", 2)
    ob.m.put(lst + L["list_items"], "<Q", items)
    r = ob.reader()
    assert r.repr(n) == "42" and r.repr(lst) == "[42, 'hi']"
    assert r.data(lst) == {"type": "list", "length": 2,
                           "items": [{"type": "int", "value": 42},
                                     {"type": "str", "value": "hi", "length": 2}]}


@pytest.mark.parametrize("case", ["huge str", "huge int", "huge list", "self list", "bad type name",
                                  "huge dict", "bad int digit", "null"])
def test_lying_objects_are_bounded(case):
    ob = Objects()
    if case == "huge str":
        a = ob.str_("abc", length=1 << 40)
    elif case == "huge int":
        a = ob.obj("int")
        ob.m.put(a + L["var_size"], "<Q", (10 ** 9) << 3)
    elif case == "bad int digit":
        a = ob.obj("int")
        ob.m.put(a + L["var_size"], "<Q", 1 << 3)
        ob.m.put(a + L["long_digits"], "<I", 0xffffffff)
    elif case in ("huge list", "self list"):
        a = ob.obj("list")
        items = ob.m.alloc(64)
        ob.m.put(a + L["var_size"], "<q", (1 << 62) if case == "huge list" else 4)
        ob.m.put(a + L["list_items"], "<Q", items)
        for i in range(4):
            ob.m.put(items + 8 * i, "<Q", a)
    elif case == "bad type name":
        a = ob.obj("x")
        ob.m.put(ob.type("x") + L["type_name"], "<Q", 0xdead0000)
    elif case == "huge dict":
        a = ob.obj("dict")
        keys = ob.m.alloc(64)
        ob.m.put(a + L["dict_used"], "<q", 5)
        ob.m.put(a + L["dict_keys"], "<Q", keys)
        ob.m.buf[keys + 9 - BASE] = 3
        ob.m.put(keys + L["dict_keys_nentries"], "<q", 1 << 50)
    else:
        a = 0
    r = ob.reader()
    text, data = r.repr(a), r.data(a)
    assert ob.m.read_bytes < 64 << 10, ob.m.read_bytes
    assert isinstance(text, str) and len(text) < 300 and isinstance(data, dict)
    expect = {"huge int": "<int of 1000000000 30-bit digits>",
              "bad int digit": "<unreadable>", "bad type name": "<unreadable>",
              "huge dict": "<unreadable>", "null": "<NULL>"}
    if case in expect:
        assert text == expect[case]
    elif case == "huge str":                # the first characters of what is there
        assert text.startswith("'abc\\x00") and text.endswith("'..."), text
    elif case == "huge list":
        assert text == f"[<list of {1 << 62}>, <list of {1 << 62}>, <list of {1 << 62}>, " \
                       f"<list of {1 << 62}>, ...] ({1 << 62} items)", text
    else:
        assert text == "[<list of 4>, <list of 4>, <list of 4>, <list of 4>]", text


def test_a_name_of_a_megabyte_is_cut_and_escaped():
    assert len(clean_name("n" * (1 << 20))) == MAX_NAME
    assert clean_name("a;b\nc\x00") == "a\\x3bb\\x0ac\\x00"


@pytest.mark.parametrize("generator", ["gen_object_layouts.py", "gen_asyncio_offsets.py"])
def test_layout_tables_are_generated_from_the_interpreters(bpf, generator):
    """The committed layouts are what tools/objects_probe.py and
    tools/asyncio_probe.py measure on every interpreter here now (pyenv
    3.7-3.13, Debian's 3.11, the chroot's 3.14, 3.14d, 3.15, 3.15d)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, os.path.join(root, "tools", generator), "--check"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert set(LAYOUTS) >= {(3, v) for v in range(7, 16)}
