"""The maps of a loaded Program as bcc shows them: `program["name"]` is a
Table with bcc's Key/Leaf ctypes (made from bcc's type descriptions, kept
in the cache), items, lookup, update, delete and batch reads, per-CPU
values summed the way bcc's callers expect, stack traces, and perf event
arrays read through per-CPU ring buffers (kernel/perfring.py)."""
from __future__ import annotations


import ctypes as ct
import json
import struct
from typing import Callable, List, Optional

from ..kernel.bpfsys import (BPF_ANY, BPF_MAP_TYPE_ARRAY, BPF_MAP_TYPE_ARRAY_OF_MAPS, BPF_MAP_TYPE_HASH,
                     BPF_MAP_TYPE_LRU_HASH, BPF_MAP_TYPE_LRU_PERCPU_HASH, BPF_MAP_TYPE_PERCPU_ARRAY,
                     BPF_MAP_TYPE_PERCPU_HASH, BPF_MAP_TYPE_PERF_EVENT_ARRAY, BPF_MAP_TYPE_PROG_ARRAY,
                     BPF_MAP_TYPE_STACK_TRACE, Function, MAP_DELETE_BATCH, MAP_DELETE_ELEM, MAP_GET_NEXT_KEY,
                     MAP_LOOKUP_AND_DELETE_BATCH, MAP_LOOKUP_BATCH, MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM,
                     bpf_call, map_elem, new_attr, possible_cpus)
from .progcache import CacheError


# -- bcc's type descriptions as ctypes --------------------------------------------------------------
_C_TYPES = {
    "_Bool": ct.c_bool, "char": ct.c_char, "signed char": ct.c_byte, "unsigned char": ct.c_ubyte,
    "short": ct.c_short, "unsigned short": ct.c_ushort, "int": ct.c_int, "unsigned int": ct.c_uint,
    "long": ct.c_long, "unsigned long": ct.c_ulong, "long long": ct.c_longlong,
    "unsigned long long": ct.c_ulonglong, "float": ct.c_float, "double": ct.c_double,
    "long double": ct.c_longdouble, "wchar_t": ct.c_wchar,
    "__int128": ct.c_int64 * 2, "unsigned __int128": ct.c_uint64 * 2,
}
_KINDS = ("struct", "union", "struct_packed")


def ctype_of(desc):
    """The ctypes type of one of bcc's JSON type descriptions (the format
    bpf_table_key_desc / bpf_table_leaf_desc return): a C type name, or
    [name, [[member, type] | [member, type, [dims]] | [member, type, bits]
    | nested [name, members, kind] ...], kind]."""
    if isinstance(desc, str):
        if desc not in _C_TYPES:
            raise CacheError(f"unknown C type {desc!r}")
        return _C_TYPES[desc]
    if not isinstance(desc, list) or len(desc) < 2 or not isinstance(desc[1], list):
        raise CacheError(f"bad type description {str(desc)[:60]}")
    kind = desc[2] if len(desc) > 2 else "struct"
    fields: list = []
    anon: List[str] = []
    for m in desc[1]:
        if not isinstance(m, list) or len(m) not in (2, 3):
            raise CacheError(f"bad member {str(m)[:60]}")
        if len(m) == 3 and m[2] in _KINDS:          # a nested struct/union, maybe anonymous
            name = m[0] or f"__anon{len(anon)}"
            if not m[0]:
                anon.append(name)
            fields.append((name, ctype_of(m)))
        elif len(m) == 3 and isinstance(m[2], list):    # an array
            t = ctype_of(m[1])
            for n in reversed(m[2]):
                t = t * int(n)
            fields.append((m[0], t))
        elif len(m) == 3 and isinstance(m[2], int):     # a bit field
            fields.append((m[0], ctype_of(m[1]), m[2]))
        elif len(m) == 2:
            fields.append((m[0], ctype_of(m[1])))
        else:
            raise CacheError(f"bad member {str(m)[:60]}")
    ns: dict = {}
    if kind == "struct_packed":
        ns["_pack_"] = 1
    if anon:
        ns["_anonymous_"] = anon
    ns["_fields_"] = fields
    return type(str(desc[0]) or "anon", (ct.Union if kind == "union" else ct.Structure,), ns)


# -- tables -----------------------------------------------------------------------------------------
def check_sizes(name: str, key_t, leaf_t, spec: dict) -> None:
    if ct.sizeof(key_t) != spec["key_size"] or ct.sizeof(leaf_t) != spec["value_size"]:
        raise CacheError(f"map {name}: types of {ct.sizeof(key_t)}/{ct.sizeof(leaf_t)} bytes for "
                         f"keys/values of {spec['key_size']}/{spec['value_size']}")


class Table:
    """A map, as bcc.table's classes present it: Key, Leaf, map_fd, and a
    mapping interface (KeyError for a missing key)."""

    def __init__(self, bpf, name: str, spec: dict, fd: int):       # bpf: bpfload.Program
        self.bpf = bpf
        self.name = name
        self.map_fd = fd
        self.ttype = spec["type"]
        self.flags = spec["flags"]
        self.max_entries = spec["max_entries"]
        self.key_size = spec["key_size"]
        self.value_size = spec["value_size"]
        self.Key = ctype_of(json.loads(spec["key_desc"]))
        self.Leaf = ctype_of(json.loads(spec["leaf_desc"]))
        check_sizes(name, self.Key, self.Leaf, spec)

    def _key(self, key):
        if isinstance(key, int):
            return self.Key(key)
        if ct.sizeof(key) != self.key_size:
            raise TypeError(f"{self.name}: a key of {ct.sizeof(key)} bytes, the map's are {self.key_size}")
        return key

    def __getitem__(self, key):
        key = self._key(key)
        leaf = self.Leaf()
        try:
            map_elem(MAP_LOOKUP_ELEM, self.map_fd, key, leaf)
        except OSError:
            raise KeyError(key) from None
        return leaf

    def __setitem__(self, key, leaf):
        try:
            map_elem(MAP_UPDATE_ELEM, self.map_fd, self._key(key), leaf, BPF_ANY)
        except OSError as e:
            raise Exception(f"Could not update table: {e.strerror}") from None

    def __delitem__(self, key):
        try:
            map_elem(MAP_DELETE_ELEM, self.map_fd, self._key(key))
        except OSError:
            raise KeyError(key) from None

    def __contains__(self, key):
        try:
            self[key]
            return True
        except KeyError:
            return False

    def __iter__(self):
        prev = None
        while True:
            nxt = self.Key()
            try:
                map_elem(MAP_GET_NEXT_KEY, self.map_fd, prev, nxt)
            except OSError:
                return
            yield nxt
            prev = nxt

    def keys(self):
        return iter(self)

    def items(self):
        out = []
        for k in self:
            try:
                out.append((k, self[k]))
            except KeyError:            # deleted meanwhile
                pass
        return out

    def values(self):
        return [v for _, v in self.items()]

    def __len__(self):
        return sum(1 for _ in self)

    def _batch(self, delete: bool):
        """Every entry as (key, value) ctypes objects, as items() gives them."""
        key_int, leaf_int = (issubclass(t, ct._SimpleCData) for t in (self.Key, self.Leaf))
        for kb, vb, n in self.raw_lookup_batch(delete=delete):
            keys, values = (self.Key * n).from_buffer_copy(kb), (self.Leaf * n).from_buffer_copy(vb)
            for i in range(n):          # indexing an array of a simple type makes ints
                k, v = keys[i], values[i]
                yield (self.Key(k) if key_int else k), (self.Leaf(v) if leaf_int else v)

    def items_lookup_batch(self):
        return self._batch(delete=False)

    def raw_lookup_batch(self, delete: bool = False, chunk: int = 4096):
        """Every entry as raw bytes, `chunk` at a time: (keys, values, n) per
        chunk, n keys of key_size bytes one after the other, and their values
        (for struct.iter_unpack: a ctypes object per entry costs more than
        the rest of a drain)."""
        cmd = MAP_LOOKUP_AND_DELETE_BATCH if delete else MAP_LOOKUP_BATCH
        n = min(self.max_entries, chunk)
        ks, vs = ct.sizeof(self.Key), ct.sizeof(self.Leaf)
        tok_in = ct.create_string_buffer(max(8, self.key_size))
        tok_out = ct.create_string_buffer(max(8, self.key_size))
        keys, values = ct.create_string_buffer(n * ks), ct.create_string_buffer(n * vs)
        first = True
        while True:
            a = new_attr()
            struct.pack_into("<QQQQIIQQ", a, 0, 0 if first else ct.addressof(tok_in),
                             ct.addressof(tok_out), ct.addressof(keys), ct.addressof(values), n,
                             self.map_fd, 0, 0)
            try:
                bpf_call(cmd, a)
                done = False
            except OSError as e:
                if e.errno != 2:                        # ENOENT: the end of the map
                    raise Exception(f"BPF batch lookup failed: {e.strerror}") from None
                done = True
            got = struct.unpack_from("<I", a, 32)[0]
            if got:
                yield keys.raw[:got * ks], values.raw[:got * vs], got
            if done or got == 0:
                return
            ct.memmove(tok_in, tok_out, len(tok_in))
            first = False

    def items_lookup_and_delete_batch(self):
        return self._batch(delete=True)

    def items_delete_batch(self, ct_keys):
        if not isinstance(ct_keys, ct.Array) or not 0 < len(ct_keys) <= self.max_entries:
            raise ValueError("a ctypes array of 1 to max_entries keys")
        a = new_attr()
        struct.pack_into("<QQQQII", a, 0, 0, 0, ct.addressof(ct_keys), 0, len(ct_keys), self.map_fd)
        try:
            bpf_call(MAP_DELETE_BATCH, a)
        except OSError as e:
            raise Exception(f"BPF_MAP_DELETE_BATCH has failed: {e.strerror}") from None


class HashTable(Table):
    pass


class Array(Table):
    def _key(self, key):
        if isinstance(key, int):
            if key < 0:
                key += self.max_entries
            key = self.Key(key)
        elif not isinstance(key, ct._SimpleCData):
            raise IndexError("Array index must be an integer type")
        if not 0 <= key.value < self.max_entries:
            raise IndexError("Array index out of range")
        return key

    def __len__(self):
        return self.max_entries

    def __iter__(self):
        return (self.Key(i) for i in range(self.max_entries))

    def __delitem__(self, key):
        # an array element cannot go: zeroed, as bcc does
        self[key] = self.Leaf()


class MapArray(Table):
    """An array of maps: a slot holds a map (set it from the map's fd; a
    lookup gives the map's id), and a slot can be cleared (del)."""

    def __setitem__(self, key, fd):
        super().__setitem__(key, ct.c_uint32(fd.value if isinstance(fd, ct._SimpleCData) else fd))


class ProgArray(Array):
    def __setitem__(self, key, leaf):
        if isinstance(leaf, Function):
            leaf = leaf.fd
        if isinstance(leaf, ct._SimpleCData):
            leaf = leaf.value
        super().__setitem__(key, self.Leaf(leaf))


class _PerCpu:
    """Leaf: one value per possible CPU (each padded to 8 bytes), as bcc builds it."""

    def _per_cpu_leaf(self):
        self.sLeaf = self.Leaf
        self.total_cpu = len(possible_cpus())
        if ct.sizeof(self.sLeaf) % 8 == 0:
            self.Leaf = self.sLeaf * self.total_cpu
        elif self.sLeaf is ct.c_uint:
            self.Leaf = ct.c_uint64 * self.total_cpu
        elif self.sLeaf is ct.c_int:
            self.Leaf = ct.c_int64 * self.total_cpu
        else:
            raise IndexError("Leaf must be aligned to 8 bytes")

    def sum(self, key):
        return self.sLeaf(sum(self[key]))


class PerCpuArray(_PerCpu, Array):
    def __init__(self, *a):
        super().__init__(*a)
        self._per_cpu_leaf()


class PerCpuHash(_PerCpu, HashTable):
    def __init__(self, *a):
        super().__init__(*a)
        self._per_cpu_leaf()


class StackTrace(HashTable):
    MAX_DEPTH = 127

    def walk(self, stack_id: int):
        """The stack's addresses, innermost first (KeyError: no such stack)."""
        ips = self[self.Key(stack_id)].ip

        def addresses():
            for i in range(min(self.MAX_DEPTH, len(ips))):
                if not ips[i]:
                    return
                yield ips[i]
        return addresses()


class PerfEventArray(Array):
    def open_perf_buffer(self, callback: Callable, page_cnt: int = 8,
                         lost_cb: Optional[Callable] = None, wakeup_events: int = 1, wakes: bool = True):
        """Per-CPU ring buffers of this map (kernel/perfring.py); callback(cpu,
        data: bytes) and lost_cb(count) are called from perf_buffer_poll.
        wakes=False (with other buffers): a record here does not end
        perf_buffer_poll's wait, it is read at the next poll (a buffer that
        fills at tens of thousands of records a second would turn the loop
        that often)."""
        if page_cnt <= 0 or page_cnt & (page_cnt - 1):
            raise Exception("Perf buffer page_cnt must be a power of two")
        if wakeup_events != 1:
            raise Exception("only wakeup_events=1")
        try:
            self.bpf.perf_buffers().open(self.map_fd, callback, page_cnt, lost_cb, wakes,
                                         self.max_entries)
        except OSError as e:
            raise Exception(f"Could not open perf buffer: {e.strerror or e}") from None


TABLE_TYPES = {BPF_MAP_TYPE_HASH: HashTable, BPF_MAP_TYPE_LRU_HASH: HashTable, BPF_MAP_TYPE_ARRAY: Array, BPF_MAP_TYPE_PROG_ARRAY: ProgArray,
                BPF_MAP_TYPE_PERF_EVENT_ARRAY: PerfEventArray, BPF_MAP_TYPE_PERCPU_ARRAY: PerCpuArray,
                BPF_MAP_TYPE_PERCPU_HASH: PerCpuHash, BPF_MAP_TYPE_LRU_PERCPU_HASH: PerCpuHash, BPF_MAP_TYPE_STACK_TRACE: StackTrace,
                BPF_MAP_TYPE_ARRAY_OF_MAPS: MapArray}
