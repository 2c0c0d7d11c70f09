"""Plain Python objects read from a target's memory, never by running its
code: what `dump --locals` shows and where threading keeps thread names.

Every read is bounded (string bytes, container items, nesting, dict
entries) and every value is checked against its type before it is used: a
corrupt or changing object gives `<unreadable>` (ObjectError inside), never a
hang, a huge read or a traceback.  Layouts per minor version are measured on
live interpreters (object_table.py, tools/gen_object_layouts.py).
"""
from __future__ import annotations

import math
import struct
from typing import Dict, Iterator, List, Optional, Tuple

from ..kernel.memory import MemoryError_
from .code import CodeReader
from .object_table import LAYOUTS

MAX_TYPE_NAME = 128
MAX_DICT_ENTRIES = 1 << 16      # entries of one dict's table looked at
MAX_DICT_SLOTS_LOG2 = 30
MAX_ITEMS_SHOWN = 4             # a container's first items in a repr
MAX_STR_SHOWN = 64              # characters of a str / bytes in a repr
MAX_DEPTH = 1                   # containers inside a container: by their length
MAX_REPR = 240                  # characters of one value's text
MAX_INT_DIGITS = 64             # 30-bit digits of an int read (bigger: by its size)
MAX_LOCALS = 256


class ObjectError(ValueError):
    """An object that cannot be read as what it claims to be."""


class IntTooBig(ObjectError):
    """An int of more than MAX_INT_DIGITS digits: shown by its size."""

    def __init__(self, digits: int):
        super().__init__(f"an int of {digits} digits")
        self.digits = digits


def layout_for(minor: Tuple[int, int]) -> Optional[Dict]:
    """The table's layout of a minor version (None: not measured: 3.6, a
    free-threaded build, or one newer than the table)."""
    return LAYOUTS.get(tuple(minor))


class ObjectReader:
    """Reads the objects of one process (cache: type names by address)."""

    def __init__(self, mem, minor: Tuple[int, int], offsets: Dict[str, int],
                 codes: Optional[CodeReader] = None):
        L = layout_for(minor)
        if L is None:
            raise ObjectError(f"objects of CPython {minor[0]}.{minor[1]} are not read")
        self.mem, self.minor, self.L, self.o = mem, tuple(minor), L, offsets
        self.codes = codes or CodeReader(mem, minor, offsets)
        self._type_names: Dict[int, str] = {}

    # -- types -------------------------------------------------------------------------
    def type_of(self, obj: int) -> int:
        return self.mem.u64(obj + self.L["object_type"])

    def type_name(self, obj: int) -> str:
        tp = self.type_of(obj)
        name = self._type_names.get(tp)
        if name is None:
            ptr = self.mem.u64(tp + self.L["type_name"])
            raw = self._read_upto(ptr, MAX_TYPE_NAME)
            name = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
            if not name:
                raise ObjectError(f"a type without a name at {tp:#x}")
            self._type_names[tp] = name
        return name

    def _read_upto(self, addr: int, n: int) -> bytes:
        while n >= 8:                   # a C string near the end of a mapping
            try:
                return self.mem.read(addr, n)
            except MemoryError_:
                n //= 2
        raise ObjectError(f"unreadable string at {addr:#x}")

    def _expect(self, obj: int, name: str):
        got = self.type_name(obj)
        if got != name:
            raise ObjectError(f"{name} expected, {got} found")

    # -- numbers and strings -------------------------------------------------------------
    def size(self, obj: int) -> int:
        n = self.mem.i64(obj + self.L["var_size"])
        if n < 0:
            raise ObjectError("a negative size")
        return n

    def str_value(self, obj: int, limit: int = 1024) -> str:
        self._expect(obj, "str")
        return self.codes.read_str(obj)[:limit]

    def int_value(self, obj: int) -> int:
        """An int (or bool) of up to MAX_INT_DIGITS digits; ObjectError beyond."""
        L, m = self.L, self.mem
        word = m.u64(obj + L["var_size"])
        if L["long_tagged"]:
            ndigits, sign = word >> 3, 1 - (word & 3)
            if word & 3 == 3:
                raise ObjectError("a bad int sign")
        else:
            n = struct.unpack("<q", struct.pack("<Q", word))[0]
            ndigits, sign = abs(n), (1 if n > 0 else -1 if n < 0 else 0)
        if ndigits > MAX_INT_DIGITS:
            raise IntTooBig(ndigits)
        raw = m.read(obj + L["long_digits"], 4 * ndigits) if ndigits else b""
        value = 0
        for i in range(ndigits):
            d = struct.unpack_from("<I", raw, 4 * i)[0]
            if d >> 30:
                raise ObjectError("an int digit over 30 bits")
            value |= d << (30 * i)
        return sign * value if ndigits else 0

    def float_value(self, obj: int) -> float:
        return struct.unpack("<d", self.mem.read(obj + self.L["float_value"], 8))[0]

    def bytes_value(self, obj: int, limit: int) -> Tuple[bytes, int]:
        """(its first `limit` bytes, its length)."""
        n = self.mem.i64(obj + self.L["bytes_size"])
        if n < 0:
            raise ObjectError("a negative bytes size")
        return (self.mem.read(obj + self.L["bytes_data"], min(n, limit)) if n else b""), n

    # -- containers ----------------------------------------------------------------------
    def sequence_items(self, obj: int, kind: str, limit: int) -> Tuple[List[int], int]:
        """(the first `limit` item addresses, the length) of a tuple or list."""
        n = self.size(obj)
        k = min(n, limit)
        if kind == "tuple":
            base = obj + self.L["tuple_items"]
        else:
            base = self.mem.u64(obj + self.L["list_items"])
        raw = self.mem.read(base, 8 * k) if k else b""
        return list(struct.unpack(f"<{k}Q", raw)), n

    def set_items(self, obj: int, limit: int) -> Tuple[List[int], int]:
        L, m = self.L, self.mem
        used, mask = m.i64(obj + L["set_used"]), m.i64(obj + L["set_mask"])
        if used < 0 or mask < 0 or mask + 1 > MAX_DICT_ENTRIES or used > mask + 1:
            raise ObjectError("an implausible set")
        table = m.u64(obj + L["set_table"])
        out = []
        for i in range(mask + 1):
            if len(out) >= limit:
                break
            key = m.u64(table + 16 * i)
            if key and not self._is_dummy(key):
                out.append(key)
        return out, used

    def _is_dummy(self, key: int) -> bool:
        """A removed entry's key: the set's `dummy` sentinel."""
        try:
            return self.type_name(key).startswith("<dummy")
        except (MemoryError_, ObjectError):
            return True

    def dict_items(self, d: int, limit: int = MAX_DICT_ENTRIES) -> Tuple[List[Tuple[int, int]], int]:
        """([(key, value)] in insertion order, up to `limit`, the dict's size)."""
        L, m = self.L, self.mem
        used = m.i64(d + L["dict_used"])
        keys = m.u64(d + L["dict_keys"])
        values = m.u64(d + L["dict_values"])
        if used < 0 or not keys:
            raise ObjectError("an implausible dict")
        return self._entries(keys, values, limit), used

    def _entries(self, keys: int, values: int, limit: int) -> List[Tuple[int, int]]:
        """The entries of a keys object, the values from the split values at
        `values` (their array values_items bytes in) when it is not 0."""
        L, m = self.L, self.mem
        if self.minor < (3, 11):
            size = m.i64(keys + L["dict_keys_size"])
            nentries = m.i64(keys + L["dict_keys_nentries"])
            if size <= 0 or size & (size - 1) or size > 1 << MAX_DICT_SLOTS_LOG2:
                raise ObjectError("implausible dict keys")
            ix = 1 if size <= 0xff else 2 if size <= 0xffff else 4 if size <= 0xffffffff else 8
            entries, esize = keys + L["dict_keys_indices"] + size * ix, 24
        else:
            hdr = m.read(keys, 16)
            log2_index_bytes, kind = hdr[9], hdr[10]
            nentries = m.i64(keys + L["dict_keys_nentries"])
            if log2_index_bytes > MAX_DICT_SLOTS_LOG2 + 3 or kind > 2:
                raise ObjectError("implausible dict keys")
            entries = keys + L["dict_keys_indices"] + (1 << log2_index_bytes)
            esize = 24 if kind == 0 else 16
        if nentries < 0 or nentries > MAX_DICT_ENTRIES:
            raise ObjectError("implausible dict entries")
        n = min(nentries, MAX_DICT_ENTRIES)
        raw = m.read(entries, n * esize) if n else b""
        vals = m.read(values + L.get("values_items", 0), 8 * n) if values and n else b""
        out = []
        for i in range(n):
            if esize == 24:
                _h, k, v = struct.unpack_from("<qQQ", raw, i * esize)
            else:
                k, v = struct.unpack_from("<QQ", raw, i * esize)
            if values:
                v = struct.unpack_from("<Q", vals, 8 * i)[0]
            if k and v:
                out.append((k, v))
                if len(out) >= limit:
                    break
        return out

    def dict_get(self, d: int, key: str) -> int:
        """The value under the str `key` (0: none)."""
        items, _ = self.dict_items(d)
        return self._find_key(items, key)

    def _find_key(self, items: List[Tuple[int, int]], key: str) -> int:
        for k, v in items:
            try:
                if self.mem.i64(k + self.L["str_length"]) == len(key) and self.str_value(k) == key:
                    return v
            except (MemoryError_, ObjectError, UnicodeDecodeError, ValueError):
                continue
        return 0

    def attr(self, obj: int, name: str) -> int:
        """An instance attribute kept in the instance's dict or values (0:
        none; a slot or a property is not read)."""
        L, m = self.L, self.mem
        kind = L["inst_kind"]
        tp = self.type_of(obj)
        if kind == "dictoffset":
            off = m.i64(tp + L["type_dictoffset"])
            if off <= 0 or off > 1 << 16:
                return 0
            d = m.u64(obj + off)
            return self.dict_get(d, name) if d else 0
        d = m.u64(obj + L["inst_dict"])
        if d and not (kind == "pointer" and L["inst_tag"] and d & 1):
            return self.dict_get(d, name)
        keys = m.u64(tp + L["heaptype_cached_keys"])
        if not keys:
            return 0
        if kind == "pointer":
            values = m.u64(obj + L["inst_values"])
            if L["inst_tag"]:
                if not values & 1:
                    return 0
                values += 1
            if not values:
                return 0
        else:
            values = obj + m.i64(tp + L["type_basicsize"])
        return self._find_key(self._entries(keys, values, MAX_DICT_ENTRIES), name)

    # -- modules ----------------------------------------------------------------------
    def module_global(self, interp: int, module: str, name: str) -> int:
        """sys.modules[module].name of the interpreter at interp (0: none)."""
        modules = self.mem.u64(interp + self.L["interp_modules"])
        if not modules:
            return 0
        mod = self.dict_get(modules, module)
        if not mod:
            return 0
        md = self.mem.u64(mod + self.L["module_dict"])
        return self.dict_get(md, name) if md else 0

    # -- values as text and as data -----------------------------------------------------
    def repr(self, obj: int, depth: int = 0) -> str:
        """A value as py-spy and pystack show one, bounded and escaped."""
        try:
            text = self._repr(obj, depth)
        except (MemoryError_, ObjectError, struct.error, UnicodeDecodeError, ValueError):
            return "<unreadable>"
        return text if len(text) <= MAX_REPR else text[:MAX_REPR] + "..."

    def _repr(self, obj: int, depth: int) -> str:
        if not obj:
            return "<NULL>"
        t = self.type_name(obj)
        if t == "NoneType":
            return "None"
        if t == "bool":
            return "True" if self.int_value(obj) else "False"
        if t == "int":
            try:
                return str(self.int_value(obj))
            except IntTooBig as e:
                return f"<int of {e.digits} 30-bit digits>"
        if t == "float":
            return _float_text(self.float_value(obj))
        if t == "str":
            n = self.mem.i64(obj + self.L["str_length"])
            s = self.codes.read_str(obj)
            return _cut(repr(s[:MAX_STR_SHOWN]), n > MAX_STR_SHOWN)
        if t == "bytes":
            raw, n = self.bytes_value(obj, MAX_STR_SHOWN)
            return _cut(repr(raw), n > MAX_STR_SHOWN)
        if t in ("tuple", "list", "set", "frozenset", "dict"):
            return self._container(obj, t, depth)
        return f"<{_printable(t)} at {obj:#x}>"

    def _container(self, obj: int, t: str, depth: int) -> str:
        if t == "dict":
            items, n = self.dict_items(obj, MAX_ITEMS_SHOWN)
            if depth >= MAX_DEPTH:
                return f"<dict of {n}>"
            body = ", ".join(f"{self.repr(k, depth + 1)}: {self.repr(v, depth + 1)}" for k, v in items)
            return "{" + body + (", ..." if n > len(items) else "") + "}" + _of(n)
        if t in ("set", "frozenset"):
            addrs, n = self.set_items(obj, MAX_ITEMS_SHOWN)
        else:
            addrs, n = self.sequence_items(obj, t, MAX_ITEMS_SHOWN)
        if depth >= MAX_DEPTH:
            return f"<{t} of {n}>"
        body = ", ".join(self.repr(a, depth + 1) for a in addrs) + (", ..." if n > len(addrs) else "")
        if t == "tuple":
            return "(" + body + ("," if n == 1 else "") + ")" + _of(n)
        if t == "list":
            return "[" + body + "]" + _of(n)
        return (t + "({" + body + "})" if n else t + "()") + _of(n)

    def data(self, obj: int, depth: int = 0):
        """A value as JSON data: {"type", "value"} or {"type", "address"},
        containers with "length" and their first "items"."""
        try:
            return self._data(obj, depth)
        except (MemoryError_, ObjectError, struct.error, UnicodeDecodeError, ValueError):
            return {"type": None, "unreadable": True, "address": obj}

    def _data(self, obj: int, depth: int):
        t = self.type_name(obj)
        if t == "NoneType":
            return {"type": t, "value": None}
        if t in ("bool", "int"):
            try:
                v = self.int_value(obj)
            except IntTooBig as e:
                return {"type": t, "address": obj, "digits": e.digits}
            return {"type": t, "value": bool(v) if t == "bool" else v}
        if t == "float":
            v = self.float_value(obj)
            return {"type": t, "value": v if math.isfinite(v) else _float_text(v)}
        if t == "str":
            n = self.mem.i64(obj + self.L["str_length"])
            return {"type": t, "value": self.codes.read_str(obj)[:MAX_STR_SHOWN], "length": n}
        if t == "bytes":
            raw, n = self.bytes_value(obj, MAX_STR_SHOWN)
            return {"type": t, "value": raw.decode("latin-1"), "length": n}
        if t in ("tuple", "list", "set", "frozenset"):
            addrs, n = (self.set_items(obj, MAX_ITEMS_SHOWN) if t.endswith("set")
                        else self.sequence_items(obj, t, MAX_ITEMS_SHOWN))
            out = {"type": t, "length": n}
            if depth < MAX_DEPTH:
                out["items"] = [self.data(a, depth + 1) for a in addrs]
            return out
        if t == "dict":
            items, n = self.dict_items(obj, MAX_ITEMS_SHOWN)
            out = {"type": t, "length": n}
            if depth < MAX_DEPTH:
                out["items"] = [[self.data(k, depth + 1), self.data(v, depth + 1)] for k, v in items]
            return out
        return {"type": t, "address": obj}

    # -- a frame's locals ----------------------------------------------------------------
    def local_names(self, code: int) -> Tuple[List[str], int, List[bool]]:
        """(the names of the frame's local slots, how many are arguments,
        which slots hold cells: a cell or free variable)."""
        L, m = self.L, self.mem
        nargs = m.i32(code + L["code_argcount"]) + m.i32(code + L["code_kwonlyargcount"])
        flags = m.i32(code + L["code_flags"])
        nargs += bool(flags & 0x4) + bool(flags & 0x8)          # *args, **kwargs
        if L["code_localsplusnames"] >= 0:
            names = self._name_tuple(m.u64(code + L["code_localsplusnames"]))
            # co_localspluskinds follows: CO_FAST_CELL 0x40, CO_FAST_FREE 0x80
            kinds, _ = self.bytes_value(m.u64(code + L["code_localsplusnames"] + 8), len(names))
            cells = [bool(kinds[i] & 0xc0) if i < len(kinds) else False for i in range(len(names))]
            return names, nargs, cells
        varnames = self._name_tuple(m.u64(code + L["code_varnames"]))
        cellnames = self._name_tuple(m.u64(code + L["code_cellvars"]))
        frees = self._name_tuple(m.u64(code + L["code_freevars"]))
        cells = [False] * len(varnames) + [True] * (len(cellnames) + len(frees))
        return varnames + cellnames + frees, nargs, cells

    def _name_tuple(self, tup: int) -> List[str]:
        self._expect(tup, "tuple")
        addrs, n = self.sequence_items(tup, "tuple", MAX_LOCALS)
        return [self.str_value(a, 256) for a in addrs]

    def frame_locals(self, frame: int, code: int) -> Iterator[Tuple[str, bool, int]]:
        """(name, is an argument, value address) of each local a frame (its
        PyFrameObject before 3.11, its interpreter frame after) has set; a
        cell's content in place of the cell."""
        names, nargs, cells = self.local_names(code)
        raw = self.mem.read(frame + self.L["frame_localsplus"], 8 * len(names)) if names else b""
        # 3.14+: each slot is a _PyStackRef, its low bits tags (Py_TAG_REFCNT)
        untag = ~3 if self.minor >= (3, 14) else ~0
        for i, name in enumerate(names):
            v = struct.unpack_from("<Q", raw, 8 * i)[0] & untag
            if v and cells[i]:
                try:
                    if self.type_name(v) == "cell":
                        v = self.mem.u64(v + self.L["cell_ref"])
                except (MemoryError_, ObjectError):
                    pass
            if v:
                yield name, i < nargs, v


def _of(n: int) -> str:
    return "" if n <= MAX_ITEMS_SHOWN else f" ({n} items)"


def _cut(text: str, cut: bool) -> str:
    return text + "..." if cut else text


def _float_text(v: float) -> str:
    return repr(v)


def _printable(s: str) -> str:
    return "".join(c if c.isprintable() else f"\\x{ord(c) & 0xff:02x}" for c in s)
