"""Loads the BPF programs, from a cache of what bcc compiled when it can.

bcc compiles the BPF C with clang at every start (seconds of CPU, and libbcc
maps LLVM: ~65 MiB of RSS before anything is compiled).  What it produces is
plain data: the instructions of each function after bcc's rewriting, whose
only references to this process are the maps' fds in `ld_imm64
src_reg=BPF_PSEUDO_MAP_FD imm=<fd>`, and the maps' attributes and key/leaf
type descriptions.  That is what the cache holds; on a hit nothing of bcc is
imported: the maps are created, their fds patched into the instructions, the
programs loaded (the kernel's verifier still runs) and attached with bpf(2)
and perf_event_open(2) directly.

On a miss bcc compiles the text, exactly as it did before the cache, in a
child process (the compiler's memory leaves with it) that hands back the same
data; the entry is written and the programs are loaded from it the same way.

`load()` returns a `Program`: the part of bcc.BPF's interface the session and
the unwinder use (`[name]` tables with bcc's Key/Leaf ctypes, `load_func`,
`attach_perf_event`, `attach_raw_tracepoint` / `detach_raw_tracepoint`,
`perf_buffer_poll`, `funcs`, `cleanup`).  Functions named
`raw_tracepoint__<tp>` are loaded and attached by `load()`, as bcc does.

The cache: `$PYOFFCPU_CACHE_DIR/bpf` (`PYOFFCPU_CACHE_DIR=""`: no cache), else
`/var/cache/pyoffcpu/bpf` as root.  One file per key, written atomically
(mode 0600, directory 0700, both ours or not used: these programs run in the
kernel).  The key is the sha256 of everything the compile depends on: the
text, every cflag, the files of the -I directories, the kernel (sha256 of its
BTF, uname), the kernel headers bcc compiles against, bcc's version and
library, the possible CPUs, and FORMAT.  A file that is truncated, corrupt or
for another key is compiled again, with a one-line notice.
"""
from __future__ import annotations

import base64
import ctypes as ct
import fcntl
import hashlib
import importlib.util
import json
import os
import struct
import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .. import cachedir

FORMAT = 1
MAGIC = b"pyoffcpu-bpf-cache\n"
MAX_FILES = 32                          # entries kept (least recently used go first)
BTF_VMLINUX = "/sys/kernel/btf/vmlinux"

# program types (uapi/linux/bpf.h), under bcc.BPF's names
KPROBE, TRACEPOINT, PERF_EVENT, RAW_TRACEPOINT = 2, 5, 7, 17
# perf_event_open(2)
PERF_TYPE_SOFTWARE = 1
PERF_COUNT_SW_CPU_CLOCK = 0
BPF_ANY, BPF_NOEXIST, BPF_EXIST = 0, 1, 2

_NR_BPF, _NR_PERF_EVENT_OPEN = 321, 298          # x86_64
(_MAP_CREATE, _MAP_LOOKUP_ELEM, _MAP_UPDATE_ELEM, _MAP_DELETE_ELEM, _MAP_GET_NEXT_KEY,
 _PROG_LOAD) = range(6)
_OBJ_GET_INFO_BY_FD, _RAW_TRACEPOINT_OPEN = 15, 17
_MAP_LOOKUP_BATCH, _MAP_LOOKUP_AND_DELETE_BATCH, _MAP_DELETE_BATCH = 24, 25, 27
_LD_IMM64 = 0x18
_PSEUDO_MAP_FD, _PSEUDO_MAP_VALUE = 1, 2
_PERF_EVENT_IOC_ENABLE, _PERF_EVENT_IOC_DISABLE, _PERF_EVENT_IOC_SET_BPF = 0x2400, 0x2401, 0x40042408
_PERF_FLAG_FD_CLOEXEC = 8
_ATTR_SIZE = 128                        # bytes of union bpf_attr passed (the rest is zero)

_HASH, _ARRAY, _PROG_ARRAY, _PERF_EVENT_ARRAY, _PERCPU_HASH, _PERCPU_ARRAY, _STACK_TRACE = range(1, 8)
_LRU_HASH, _LRU_PERCPU_HASH, _ARRAY_OF_MAPS = 9, 10, 12
BPF_F_MMAPABLE, BPF_F_INNER_MAP = 1 << 10, 1 << 12
INNER_SUFFIX = "_inner"                 # an array of maps X takes the maps of X_inner's kind
# bcc names programs without these prefixes (and at most 15 characters)
_NAME_PREFIXES = ("kprobe__", "kretprobe__", "tracepoint__", "raw_tracepoint__")
AUTOLOAD_PREFIX = "raw_tracepoint__"


class BpfError(Exception):
    """A load failed; the message is one line."""


class CacheError(Exception):
    """A cache entry that cannot be used."""


# -- system calls ---------------------------------------------------------------------------------
_libc = ct.CDLL(None, use_errno=True)
_libc.syscall.restype = ct.c_long


def _sys(nr: int, *args) -> int:
    r = _libc.syscall(ct.c_long(nr), *args)
    if r < 0:
        e = ct.get_errno()
        raise OSError(e, os.strerror(e))
    return r


def _bpf(cmd: int, attr) -> int:
    return _sys(_NR_BPF, ct.c_long(cmd), attr, ct.c_long(ct.sizeof(attr)))


def _attr() -> ct.Array:
    return ct.create_string_buffer(_ATTR_SIZE)


def _addr(obj) -> int:
    return ct.addressof(obj) if obj is not None else 0


def _map_create(mtype: int, key_size: int, value_size: int, max_entries: int, flags: int,
                name: str, inner_fd: int = 0) -> int:
    a = _attr()
    struct.pack_into("<IIIIII", a, 0, mtype, key_size, value_size, max_entries, flags, inner_fd)
    struct.pack_into("16s", a, 28, name.encode()[:15])
    return _bpf(_MAP_CREATE, a)


def create_array(name: str, value_size: int, max_entries: int, flags: int = 0) -> int:
    """A new BPF array map (u32 keys); its fd.  Raises OSError."""
    return _map_create(_ARRAY, 4, value_size, max_entries, flags, name)


_MAP_UPDATE_BATCH = 26


def update_batch(fd: int, keys: List[int], values: List[int]) -> None:
    """u32 keys -> u32 values in one BPF_MAP_UPDATE_BATCH: for an array of
    maps, one wait for the programs that may hold an old slot (~9 ms here)
    instead of one per slot.  Raises OSError (then update one by one)."""
    n = len(keys)
    if not n:
        return
    ka = (ct.c_uint32 * n)(*keys)
    va = (ct.c_uint32 * n)(*values)
    a = _attr()
    # in_batch, out_batch, keys, values, count, map_fd, elem_flags, flags
    struct.pack_into("<QQQQIIQQ", a, 0, 0, 0, ct.addressof(ka), ct.addressof(va), n, fd, 0, 0)
    _bpf(_MAP_UPDATE_BATCH, a)


def _map_elem(cmd: int, fd: int, key, value=None, flags: int = 0) -> int:
    a = _attr()
    struct.pack_into("<I4xQQQ", a, 0, fd, _addr(key), _addr(value), flags)
    return _bpf(cmd, a)


def update_elem(fd: int, key, value, flags: int = BPF_ANY) -> bool:
    """bpf_map_update_elem; False when the kernel refuses (BPF_NOEXIST: the key is there)."""
    try:
        _map_elem(_MAP_UPDATE_ELEM, fd, key, value, flags)
        return True
    except OSError:
        return False


def lookup_elem(fd: int, key, value) -> bool:
    """bpf_map_lookup_elem into value; False when the key is not there."""
    try:
        _map_elem(_MAP_LOOKUP_ELEM, fd, key, value)
        return True
    except OSError:
        return False


def map_info(fd: int) -> Tuple[int, int, int, int, int, str]:
    """(type, key_size, value_size, max_entries, flags, name) of a map fd."""
    info = ct.create_string_buffer(88)
    a = _attr()
    struct.pack_into("<IIQ", a, 0, fd, len(info), ct.addressof(info))
    _bpf(_OBJ_GET_INFO_BY_FD, a)
    mtype, _id, ks, vs, me, flags = struct.unpack_from("<6I", info, 0)
    return mtype, ks, vs, me, flags, info.raw[24:40].split(b"\0", 1)[0].decode(errors="replace")


def _kernel_name(func: str) -> str:
    for p in _NAME_PREFIXES:
        if func.startswith(p):
            func = func[len(p):]
            break
    return func[:15]


def _prog_load(ptype: int, insns: bytes, license: bytes, kern_version: int, name: str,
               log_level: int = 0, log_size: int = 0) -> Tuple[int, str]:
    """(fd, verifier log); raises OSError with the log in .log."""
    code = ct.create_string_buffer(insns, len(insns))
    lic = ct.create_string_buffer(license)
    log = ct.create_string_buffer(log_size) if log_level else None
    a = _attr()
    struct.pack_into("<IIQQIIQII16s", a, 0, ptype, len(insns) // 8, ct.addressof(code),
                     ct.addressof(lic), log_level, log_size if log else 0, _addr(log),
                     kern_version, 0, _kernel_name(name).encode())
    try:
        fd = _bpf(_PROG_LOAD, a)
    except OSError as e:
        e.log = log.value.decode(errors="replace") if log else ""
        raise
    return fd, (log.value.decode(errors="replace") if log else "")


def _raw_tracepoint_open(tp: str, prog_fd: int) -> int:
    name = ct.create_string_buffer(tp.encode())
    a = _attr()
    struct.pack_into("<QI", a, 0, ct.addressof(name), prog_fd)
    return _bpf(_RAW_TRACEPOINT_OPEN, a)


def _perf_event_open(ev_type: int, config: int, period: int, freq: int, pid: int, cpu: int,
                     group_fd: int) -> int:
    attr = ct.create_string_buffer(112)          # PERF_ATTR_SIZE_VER5
    flags = 1                                    # disabled, until the program is set
    if freq:
        flags |= 1 << 10                         # freq: sample_freq in the period's place
    if pid > 0:
        flags |= 1 << 1                          # inherit (as bcc does for one process)
    struct.pack_into("<IIQQ", attr, 0, ev_type, len(attr), config, freq or period)
    struct.pack_into("<Q", attr, 40, flags)
    return _sys(_NR_PERF_EVENT_OPEN, attr, ct.c_long(pid), ct.c_long(cpu), ct.c_long(group_fd),
                ct.c_long(_PERF_FLAG_FD_CLOEXEC))


def _cpu_list(path: str) -> List[int]:
    with open(path) as f:
        text = f.read().strip()
    out: List[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def online_cpus() -> List[int]:
    return _cpu_list("/sys/devices/system/cpu/online")


def possible_cpus() -> List[int]:
    return _cpu_list("/sys/devices/system/cpu/possible")


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
def _check_sizes(name: str, key_t, leaf_t, spec: dict) -> None:
    if ct.sizeof(key_t) != spec["key_size"] or ct.sizeof(leaf_t) != spec["value_size"]:
        raise CacheError(f"map {name}: types of {ct.sizeof(key_t)}/{ct.sizeof(leaf_t)} bytes for "
                         f"keys/values of {spec['key_size']}/{spec['value_size']}")


class Table:
    """A map, as bcc.table's classes present it: Key, Leaf, map_fd, and a
    mapping interface (KeyError for a missing key)."""

    def __init__(self, bpf: "Program", name: str, spec: dict, fd: int):
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
        _check_sizes(name, self.Key, self.Leaf, spec)

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
            _map_elem(_MAP_LOOKUP_ELEM, self.map_fd, key, leaf)
        except OSError:
            raise KeyError(key) from None
        return leaf

    def __setitem__(self, key, leaf):
        try:
            _map_elem(_MAP_UPDATE_ELEM, self.map_fd, self._key(key), leaf, BPF_ANY)
        except OSError as e:
            raise Exception(f"Could not update table: {e.strerror}") from None

    def __delitem__(self, key):
        try:
            _map_elem(_MAP_DELETE_ELEM, self.map_fd, self._key(key))
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
                _map_elem(_MAP_GET_NEXT_KEY, self.map_fd, prev, nxt)
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
        cmd = _MAP_LOOKUP_AND_DELETE_BATCH if delete else _MAP_LOOKUP_BATCH
        n = min(self.max_entries, chunk)
        ks, vs = ct.sizeof(self.Key), ct.sizeof(self.Leaf)
        tok_in = ct.create_string_buffer(max(8, self.key_size))
        tok_out = ct.create_string_buffer(max(8, self.key_size))
        keys, values = ct.create_string_buffer(n * ks), ct.create_string_buffer(n * vs)
        first = True
        while True:
            a = _attr()
            struct.pack_into("<QQQQIIQQ", a, 0, 0 if first else ct.addressof(tok_in),
                             ct.addressof(tok_out), ct.addressof(keys), ct.addressof(values), n,
                             self.map_fd, 0, 0)
            try:
                _bpf(cmd, a)
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
        a = _attr()
        struct.pack_into("<QQQQII", a, 0, 0, 0, ct.addressof(ct_keys), 0, len(ct_keys), self.map_fd)
        try:
            _bpf(_MAP_DELETE_BATCH, a)
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


_SAMPLE_CB = ct.CFUNCTYPE(None, ct.c_void_p, ct.c_int, ct.c_void_p, ct.c_uint32)
_LOST_CB = ct.CFUNCTYPE(None, ct.c_void_p, ct.c_int, ct.c_uint64)
_libbpf = None


def _lib_bpf():
    """Debian's libbpf1 (libbcc links it; small, no LLVM): only its perf buffer reader."""
    global _libbpf
    if _libbpf is None:
        lib = ct.CDLL("libbpf.so.1", use_errno=True)
        lib.perf_buffer__new.restype = ct.c_void_p
        lib.perf_buffer__new.argtypes = [ct.c_int, ct.c_size_t, _SAMPLE_CB, _LOST_CB, ct.c_void_p,
                                         ct.c_void_p]
        lib.perf_buffer__poll.restype = ct.c_int
        lib.perf_buffer__poll.argtypes = [ct.c_void_p, ct.c_int]
        lib.perf_buffer__free.restype = None
        lib.perf_buffer__free.argtypes = [ct.c_void_p]
        _libbpf = lib
    return _libbpf


class PerfEventArray(Array):
    def open_perf_buffer(self, callback: Callable, page_cnt: int = 8,
                         lost_cb: Optional[Callable] = None, wakeup_events: int = 1):
        """Per-CPU ring buffers of this map; callback(cpu, data, size) and
        lost_cb(count) are called from perf_buffer_poll."""
        if page_cnt & (page_cnt - 1):
            raise Exception("Perf buffer page_cnt must be a power of two")
        if wakeup_events != 1:
            raise Exception("only wakeup_events=1")
        lib = _lib_bpf()
        sample = _SAMPLE_CB(lambda _ctx, cpu, data, size: callback(cpu, data, size))
        lost = _LOST_CB(lambda _ctx, cpu, n: lost_cb(n)) if lost_cb else ct.cast(None, _LOST_CB)
        pb = lib.perf_buffer__new(self.map_fd, page_cnt, sample, lost, None, None)
        if not pb:
            raise Exception(f"Could not open perf buffer: {os.strerror(ct.get_errno())}")
        self.bpf._perf_buffers.append((pb, sample, lost))


_TABLE_TYPES = {_HASH: HashTable, _LRU_HASH: HashTable, _ARRAY: Array, _PROG_ARRAY: ProgArray,
                _PERF_EVENT_ARRAY: PerfEventArray, _PERCPU_ARRAY: PerCpuArray,
                _PERCPU_HASH: PerCpuHash, _LRU_PERCPU_HASH: PerCpuHash, _STACK_TRACE: StackTrace,
                _ARRAY_OF_MAPS: MapArray}


# -- the loaded programs ----------------------------------------------------------------------------
class Function:
    def __init__(self, bpf: "Program", name: bytes, fd: int, log: str = ""):
        self.bpf = bpf
        self.name = name
        self.fd = fd
        self.log = log                  # the verifier's log, with log_level


def _b(name) -> bytes:
    return name if isinstance(name, bytes) else str(name).encode()


class Program:
    """What bcc.BPF offered the session, over one compiled entry."""

    KPROBE, TRACEPOINT, PERF_EVENT, RAW_TRACEPOINT = KPROBE, TRACEPOINT, PERF_EVENT, RAW_TRACEPOINT
    Function = Function

    def __init__(self, entry: dict, log_level: int = 0):
        self.entry = entry
        self.log_level = log_level
        self.from_cache = False
        self.funcs: Dict[bytes, Function] = {}
        self.tables: Dict[bytes, Table] = {}
        self.raw_tracepoint_fds: Dict[bytes, int] = {}
        self.open_perf_events: Dict[tuple, Dict[int, int]] = {}
        self._perf_buffers: list = []
        self._specs = {m["name"]: m for m in entry["maps"]}
        self._progs = {p["name"]: p for p in entry["programs"]}
        self._map_fds: Dict[str, int] = {}
        self.load_errors: Dict[bytes, Exception] = {}   # optional programs that did not load
        self._lock = threading.Lock()
        try:        # an array of maps after the template of its maps
            for m in sorted(entry["maps"], key=lambda m: m.get("inner") is not None):
                inner = self._map_fds[m["inner"]] if m.get("inner") else 0
                self._map_fds[m["name"]] = _map_create(m["type"], m["key_size"], m["value_size"],
                                                       m["max_entries"], m["flags"], m["name"],
                                                       inner)
        except OSError as e:
            self.cleanup()
            raise BpfError(f"cannot create BPF map {m['name']}: {e.strerror}") from None

    # -- programs
    def _insns(self, name: str) -> bytes:
        p = self._progs[name]
        code = bytearray(base64.b64decode(p["insns"]))
        for idx, mname in p["maps"]:
            struct.pack_into("<i", code, idx * 8 + 4, self._map_fds[mname])
        return bytes(code)

    def load_func(self, func_name, prog_type: int, device=None, attach_type: int = -1) -> Function:
        key = _b(func_name)
        with self._lock:
            if key in self.funcs:
                return self.funcs[key]
            if key in self.load_errors:         # verified once already, and refused
                raise self.load_errors[key]
        name = key.decode()
        if name not in self._progs:
            raise Exception(f"Unknown program {name}")
        insns = self._insns(name)
        license = self.entry["license"].encode()
        kv = self.entry.get("kern_version", 0)
        level = self.log_level
        try:
            fd, log = _prog_load(prog_type, insns, license, kv, name, level,
                                 (16 << 20) if level & 3 else (1 << 16))
        except OSError as e:
            log = getattr(e, "log", "")
            if not log and e.errno not in (1,):         # the verifier's reason, for the message
                try:
                    _prog_load(prog_type, insns, license, kv, name, 1, 16 << 20)
                except OSError as e2:
                    log = getattr(e2, "log", "")
            lines = [ln for ln in log.strip().splitlines() if ln.strip()]
            why = f" (verifier: {lines[-1].strip()})" if lines else ""
            if e.errno == 1:
                raise Exception("Need super-user privileges to run") from None
            raise Exception(f"Failed to load BPF program {name}: {e.strerror}{why}") from None
        fn = Function(self, key, fd, log)
        with self._lock:
            if key in self.funcs:               # loaded by another thread meanwhile
                os.close(fd)
                return self.funcs[key]
            self.funcs[key] = fn
        return fn

    def load_funcs_parallel(self, specs: Sequence[Tuple[str, int]], optional: Iterable[str] = (),
                            meanwhile: Optional[Callable[["Program"], None]] = None) -> None:
        """Load several programs at once (the verifier runs in the calling
        thread, and ctypes lets go of the GIL meanwhile).  A program named in
        optional that fails is kept in load_errors (load_func raises it)
        instead of failing the call.  meanwhile(self): work of the caller's
        done in this thread while the verifier runs in the others (the maps
        exist; no program runs yet).  What it raises is raised after the
        programs are loaded."""
        errors: List[BaseException] = []
        optional = {_b(n) for n in optional}

        def one(name, ptype):
            try:
                self.load_func(name, ptype)
            except Exception as e:               # noqa: BLE001 (kept or re-raised below)
                if _b(name) in optional:
                    with self._lock:
                        self.load_errors[_b(name)] = e
                else:
                    errors.append(e)
            except BaseException as e:           # noqa: BLE001 (re-raised below)
                errors.append(e)
        mine = specs[:0] if meanwhile is not None else specs[:1]
        threads = [threading.Thread(target=one, args=s) for s in specs[len(mine):]]
        for t in threads:
            t.start()
        for s in mine:
            one(*s)
        failed = None
        if meanwhile is not None:
            try:
                meanwhile(self)
            except BaseException as e:      # noqa: BLE001 (raised once the threads are done)
                failed = e
        for t in threads:
            t.join()
        if failed is not None:
            raise failed
        if errors:
            raise errors[0]

    def function_names(self) -> List[str]:
        return list(self._progs)

    def attach_raw_tracepoint(self, tp=b"", fn_name=b""):
        tp = _b(tp)
        if tp in self.raw_tracepoint_fds:
            raise Exception(f"Raw tracepoint {tp.decode()} has been attached")
        fn = self.load_func(fn_name, RAW_TRACEPOINT)
        try:
            self.raw_tracepoint_fds[tp] = _raw_tracepoint_open(tp.decode(), fn.fd)
        except OSError as e:
            raise Exception(f"Failed to attach BPF to raw tracepoint {tp.decode()}: {e.strerror}") from None
        return self

    def detach_raw_tracepoint(self, tp=b""):
        tp = _b(tp)
        if tp not in self.raw_tracepoint_fds:
            raise Exception(f"Raw tracepoint {tp.decode()} is not attached")
        os.close(self.raw_tracepoint_fds.pop(tp))

    def attach_perf_event(self, ev_type=-1, ev_config=-1, fn_name=b"", sample_period=0,
                          sample_freq=0, pid=-1, cpu=-1, group_fd=-1):
        if (sample_period > 0) == (sample_freq > 0):
            raise Exception("exactly one of sample_period and sample_freq")
        fn = self.load_func(fn_name, PERF_EVENT)
        fds = self.open_perf_events.setdefault((ev_type, ev_config), {})
        for c in ([cpu] if cpu >= 0 else online_cpus()):
            try:
                fd = _perf_event_open(ev_type, ev_config, sample_period, sample_freq, pid, c, group_fd)
            except OSError as e:
                raise Exception(f"Failed to open perf event on CPU {c}: {e.strerror}") from None
            fds[c] = fd
            try:
                fcntl.ioctl(fd, _PERF_EVENT_IOC_SET_BPF, fn.fd)
                fcntl.ioctl(fd, _PERF_EVENT_IOC_ENABLE, 0)
            except OSError as e:
                raise Exception(f"Failed to attach BPF to perf event: {e.strerror}") from None

    def detach_perf_event(self, ev_type=-1, ev_config=-1):
        for fd in self.open_perf_events.pop((ev_type, ev_config), {}).values():
            try:
                fcntl.ioctl(fd, _PERF_EVENT_IOC_DISABLE, 0)
            except OSError:
                pass
            os.close(fd)

    def perf_buffer_poll(self, timeout: int = -1):
        if not self._perf_buffers:
            if timeout > 0:
                time.sleep(timeout / 1000)
            return
        lib = _lib_bpf()
        for i, (pb, _, _) in enumerate(self._perf_buffers):
            lib.perf_buffer__poll(pb, timeout if i == 0 else 0)

    # -- maps
    def __getitem__(self, name):
        key = _b(name)
        t = self.tables.get(key)
        if t is None:
            sname = key.decode()
            if sname not in self._specs:
                raise KeyError(name)
            spec = self._specs[sname]
            cls = _TABLE_TYPES.get(spec["type"])
            if cls is None:
                raise Exception(f"map {sname}: type {spec['type']} not supported")
            t = self.tables[key] = cls(self, sname, spec, self._map_fds[sname])
        return t

    def __contains__(self, name):
        return _b(name).decode() in self._specs

    def cleanup(self):
        """Detach everything and close every fd (idempotent)."""
        for tp in list(self.raw_tracepoint_fds):
            os.close(self.raw_tracepoint_fds.pop(tp))
        for ev in list(self.open_perf_events):
            self.detach_perf_event(*ev)
        if self._perf_buffers:
            lib = _lib_bpf()
            for pb, _, _ in self._perf_buffers:
                lib.perf_buffer__free(pb)
            self._perf_buffers = []
        for name in list(self.funcs):
            os.close(self.funcs.pop(name).fd)
        for name in list(self._map_fds):
            os.close(self._map_fds.pop(name))
        self.tables.clear()


# -- the cache key ------------------------------------------------------------------------------------
_SHA256: Dict[tuple, str] = {}


def file_sha256(path: str) -> str:
    """sha256 of a file's bytes, remembered in this process while its
    identity (device, inode, size, mtime) stays."""
    st = os.stat(path)
    ident = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if ident not in _SHA256:
        with open(path, "rb") as f:
            _SHA256[ident] = hashlib.sha256(f.read()).hexdigest()
    return _SHA256[ident]


def _stat_id(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return f"{path}:-"
    return f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def _bcc_identity() -> str:
    """bcc's version and library, found without importing bcc (which maps LLVM)."""
    out = []
    try:
        spec = importlib.util.find_spec("bcc")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        d = list(spec.submodule_search_locations)[0]
        for name in ("version.py", "__init__.py", "libbcc.py"):
            out.append(_stat_id(os.path.join(d, name)))
        try:
            with open(os.path.join(d, "version.py")) as f:
                out.append(f.read().strip())
        except OSError:
            pass
    for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib",
              "/usr/local/lib", "/usr/local/lib64"):
        lib = os.path.join(d, "libbcc.so.0")
        if os.path.exists(lib):
            out.append(_stat_id(lib))
            break
    return "\n".join(out)


def _kernel_headers_identity(release: str) -> str:
    """Where bcc finds the kernel headers, and which ones they are."""
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("BCC_"))
    dirs = [os.environ.get("BCC_KERNEL_SOURCE", "")] + [
        f"/lib/modules/{release}/{d}" for d in ("build", "source")]
    out = [repr(env)]
    for d in dirs:
        if not d:
            continue
        out.append(os.path.realpath(d))
        for f in ("Makefile", "include/generated/autoconf.h", "include/generated/uapi/linux/version.h",
                  "include/generated/utsrelease.h", "include/uapi/linux/bpf.h",
                  "include/uapi/linux/ptrace.h"):
            out.append(_stat_id(os.path.join(d, f)))
    return "\n".join(out)


def cache_key(text: str, cflags: Sequence[str], btf_path: str = BTF_VMLINUX) -> Optional[str]:
    """The sha256 of everything bcc's compile of text with cflags depends
    on; None when the kernel's BTF (its identity) cannot be read."""
    h = hashlib.sha256()

    def part(tag: str, data) -> None:
        data = data if isinstance(data, bytes) else str(data).encode()
        h.update(tag.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    part("format", FORMAT)
    part("text", text)
    for f in cflags:
        part("cflag", f)
    for f in cflags:
        if f.startswith("-I") and os.path.isdir(f[2:]):
            d = f[2:]
            for name in sorted(os.listdir(d)):
                p = os.path.join(d, name)
                if name.endswith((".h", ".c")) and os.path.isfile(p):
                    with open(p, "rb") as fh:
                        part("include " + name, fh.read())
    try:
        part("btf", file_sha256(btf_path))
    except OSError:
        return None
    u = os.uname()
    part("uname", f"{u.sysname}\n{u.release}\n{u.version}\n{u.machine}")
    part("headers", _kernel_headers_identity(u.release))
    part("bcc", _bcc_identity())
    try:
        with open("/sys/devices/system/cpu/possible") as f:
            part("cpus", f.read().strip())
    except OSError:
        part("cpus", "?")
    return h.hexdigest()


# -- cache files --------------------------------------------------------------------------------------
def default_cache_dir() -> Optional[str]:
    return cachedir.cache_dir("bpf")


_safe_dir = cachedir.safe_dir


def serialize(entry: dict) -> bytes:
    body = json.dumps(entry, separators=(",", ":"), sort_keys=True).encode()
    head = f"{FORMAT} {hashlib.sha256(body).hexdigest()} {len(body)}\n".encode()
    return MAGIC + head + body


def parse(data: bytes, key: Optional[str] = None) -> dict:
    """The entry in data, checked whole (raises CacheError)."""
    if not data.startswith(MAGIC):
        raise CacheError("not a pyoffcpu BPF cache file" if data else "empty")
    head, sep, body = data[len(MAGIC):].partition(b"\n")
    fields = head.split()
    if not sep or len(fields) != 3:
        raise CacheError("truncated header")
    if fields[0] != str(FORMAT).encode():
        raise CacheError(f"format {fields[0].decode(errors='replace')}, not {FORMAT}")
    try:
        size = int(fields[2])
    except ValueError:
        raise CacheError("corrupt header") from None
    if len(body) != size:
        raise CacheError(f"truncated ({len(body)} of {size} bytes)" if len(body) < size
                         else "longer than its header says")
    if hashlib.sha256(body).hexdigest().encode() != fields[1]:
        raise CacheError("checksum mismatch")
    try:
        entry = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise CacheError(f"corrupt ({e})") from None
    _check(entry, key)
    return entry


def _check(entry, key: Optional[str]) -> None:
    """The entry's shape, every map reference included (a program is only
    ever patched where bcc put a map's fd)."""
    try:
        if key is not None and entry["key"] != key:
            raise CacheError("made for another key")
        maps = {}
        for m in entry["maps"]:
            for f in ("type", "key_size", "value_size", "max_entries", "flags"):
                if not isinstance(m[f], int) or m[f] < 0:
                    raise CacheError(f"map {m.get('name')}: bad {f}")
            if not isinstance(m["name"], str) or not isinstance(m["key_desc"], str) \
                    or not isinstance(m["leaf_desc"], str):
                raise CacheError("bad map")
            maps[m["name"]] = m
        for m in entry["maps"]:
            inner = m.get("inner")
            if (m["type"] == _ARRAY_OF_MAPS) != (inner is not None) or (
                    inner is not None and (inner not in maps or maps[inner].get("inner"))):
                raise CacheError(f"map {m['name']}: bad inner map")
        if not isinstance(entry["license"], str) or not isinstance(entry.get("kern_version", 0), int):
            raise CacheError("bad license")
        for p in entry["programs"]:
            code = base64.b64decode(p["insns"], validate=True)
            if not code or len(code) % 8:
                raise CacheError(f"program {p['name']}: {len(code)} bytes of instructions")
            n = len(code) // 8
            for idx, mname in p["maps"]:
                if mname not in maps or not isinstance(idx, int) or not 0 <= idx < n - 1:
                    raise CacheError(f"program {p['name']}: bad map reference")
                op, regs = code[idx * 8], code[idx * 8 + 1]
                if op != _LD_IMM64 or regs >> 4 not in (_PSEUDO_MAP_FD, _PSEUDO_MAP_VALUE):
                    raise CacheError(f"program {p['name']}: map reference at no map load")
    except CacheError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CacheError(f"malformed ({type(e).__name__}: {e})") from None


def _read_entry(path: str, key: str) -> Optional[dict]:
    """None: no entry.  Raises CacheError for one that cannot be used."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CacheError(f"unreadable ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise CacheError("not ours, or writable by others")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read()
    except OSError as e:
        raise CacheError(f"unreadable ({e.strerror})") from None
    finally:
        if fd >= 0:
            os.close(fd)
    entry = parse(data, key)
    try:
        os.utime(path)                  # recently used: kept by _prune
    except OSError:
        pass
    return entry


def _write_entry(directory: str, path: str, entry: dict) -> None:
    if not cachedir.write_private(path, serialize(entry)):
        return
    try:
        names = [n for n in os.listdir(directory) if n.endswith(".bpf")]
        if len(names) > MAX_FILES:
            names.sort(key=lambda n: os.stat(os.path.join(directory, n)).st_mtime)
            for n in names[:len(names) - MAX_FILES]:
                os.unlink(os.path.join(directory, n))
    except OSError:
        pass


# -- compiling with bcc ---------------------------------------------------------------------------------
def compile_entry(text: str, cflags: Sequence[str]) -> dict:
    """bcc's compile of text (clang), as an entry: every function's
    instructions with its map references named, every map's attributes and
    type descriptions.  Imports bcc (LLVM): run it in a child process."""
    import bcc
    from bcc import libbcc
    lib = libbcc.lib
    for fn, res, args in (("bpf_num_tables", ct.c_size_t, [ct.c_void_p]),
                          ("bpf_table_name", ct.c_char_p, [ct.c_void_p, ct.c_size_t]),
                          ("bpf_table_fd_id", ct.c_int, [ct.c_void_p, ct.c_size_t]),
                          ("bpf_table_key_desc_id", ct.c_char_p, [ct.c_void_p, ct.c_size_t]),
                          ("bpf_table_leaf_desc_id", ct.c_char_p, [ct.c_void_p, ct.c_size_t])):
        getattr(lib, fn).restype = res
        getattr(lib, fn).argtypes = args
    class CompileOnly(bcc.BPF):
        def _trace_autoload(self):
            """Compile only: the caller loads and attaches (bcc.BPF would load
            and attach the raw_tracepoint__ functions here)."""
    b = CompileOnly(text=text.encode(), cflags=list(cflags))
    try:
        return _dump(b, lib)
    finally:
        b.cleanup()


def _dump(b, lib) -> dict:
    mod = b.module
    maps, by_fd = [], {}
    for i in range(lib.bpf_num_tables(mod)):
        name = lib.bpf_table_name(mod, i).decode()
        fd = lib.bpf_table_fd_id(mod, i)
        mtype, ks, vs, me, flags, _ = map_info(fd)
        maps.append({"name": name, "type": mtype, "key_size": ks, "value_size": vs,
                     "max_entries": me, "flags": flags,
                     "key_desc": (lib.bpf_table_key_desc_id(mod, i) or b"").decode(),
                     "leaf_desc": (lib.bpf_table_leaf_desc_id(mod, i) or b"").decode()})
        by_fd[fd] = name
    names = {m["name"] for m in maps}
    for m in maps:                      # bcc gives no name of an array of maps' template
        if m["type"] == _ARRAY_OF_MAPS:
            m["inner"] = m["name"] + INNER_SUFFIX
            if m["inner"] not in names:
                raise BpfError(f"array of maps {m['name']}: its template must be named {m['inner']}")
    progs = []
    for i in range(lib.bpf_num_functions(mod)):
        fname = lib.bpf_function_name(mod, i)
        code = b.dump_func(fname)
        refs = []
        for j in range(len(code) // 8):
            op, regs = code[j * 8], code[j * 8 + 1]
            if op == _LD_IMM64 and regs >> 4:
                imm = struct.unpack_from("<i", code, j * 8 + 4)[0]
                if regs >> 4 not in (_PSEUDO_MAP_FD, _PSEUDO_MAP_VALUE) or imm not in by_fd:
                    raise BpfError(f"{fname.decode()}: an ld_imm64 (src_reg {regs >> 4}) that is "
                                   "no map of this module")
                refs.append([j, by_fd[imm]])
        progs.append({"name": fname.decode(), "insns": base64.b64encode(code).decode(),
                      "maps": refs})
    return {"format": FORMAT, "license": lib.bpf_module_license(mod).decode(),
            "kern_version": int(lib.bpf_module_kern_version(mod)), "maps": maps,
            "programs": progs}


def _one_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(e).__name__


def compile_in_child(text: str, cflags: Sequence[str]) -> dict:
    """compile_entry in a forked child: clang's hundred-odd MiB never enter
    this process.  bcc's own diagnostics go to stderr as before."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return compile_entry(text, cflags)
    if pid == 0:                                        # the child
        status = 1
        try:
            os.close(r)
            try:
                out = b"K" + json.dumps(compile_entry(text, cflags)).encode()
            except BaseException as e:                  # noqa: BLE001 (reported to the parent)
                out = b"E" + (_one_line(e) if not isinstance(e, ImportError)
                              else "bcc (python3-bpfcc) is not installed").encode()
            view = memoryview(out)
            while view:
                view = view[os.write(w, view):]
            status = 0
        finally:
            os._exit(status)
    os.close(w)
    chunks = []
    try:
        while True:
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        _, st = os.waitpid(pid, 0)
    data = b"".join(chunks)
    if data[:1] == b"E":
        raise BpfError(data[1:].decode(errors="replace"))
    if data[:1] != b"K":
        why = (f"signal {os.WTERMSIG(st)}" if os.WIFSIGNALED(st)
               else f"status {os.waitstatus_to_exitcode(st)}")
        raise BpfError(f"the BPF compiler (bcc) ended with {why}")
    return json.loads(data[1:])


# -- load -------------------------------------------------------------------------------------------------
def load(text: str, cflags: Sequence[str], *, skip: Iterable[str] = (),
         preload: Sequence[Tuple[str, int]] = (), optional: Sequence[Tuple[str, int]] = (),
         notices: Optional[List[str]] = None, cache_dir: Optional[str] = "default",
         log_level: int = 0, sizes: Optional[Dict[str, int]] = None,
         meanwhile: Optional[Callable[["Program"], None]] = None) -> Program:
    """The programs of text compiled with cflags, from the cache or from bcc,
    with every raw_tracepoint__<tp> function attached except the tps in
    skip, and the (function, program type) pairs of preload and optional
    loaded too, all at once (the verifier takes most of a start: in parallel
    they take the time of the slowest where there are cores enough).  A
    failure of an optional program is kept for load_func to raise.  sizes
    (map name -> entries) makes hash and stack maps smaller than the source
    says, for what this session needs: the kernel reserves a preallocated
    map's memory whole.  A map's size is not in the instructions, so the
    cached programs serve every size.  meanwhile: the caller's work, done
    while the verifier runs (load_funcs_parallel).  Raises BpfError (one
    line) or what bcc raises on a miss."""
    notices = notices if notices is not None else []
    directory = default_cache_dir() if cache_dir == "default" else cache_dir
    key = cache_key(text, cflags) if directory else None
    path = os.path.join(directory, key + ".bpf") if key else None
    if path and not _safe_dir(directory):
        path = None
    entry = None
    if path:
        try:
            entry = _read_entry(path, key)
        except CacheError as e:
            notices.append(f"BPF program cache {path}: {e}; compiled again")
    if entry is not None:
        try:
            prog = _start(entry, skip, preload, optional, log_level, sizes, meanwhile)
            prog.from_cache = True
            return prog
        except Exception as e:                          # noqa: BLE001 (compiled again below)
            notices.append(f"BPF programs from the cache {path} did not load ({_one_line(e)}); "
                           "compiled again")
    entry = compile_in_child(text, cflags)
    entry["key"] = key
    _check(entry, key)
    prog = _start(entry, skip, preload, optional, log_level, sizes, meanwhile)
    if path:
        _write_entry(directory, path, entry)
    return prog


RESIZABLE = (_HASH, _STACK_TRACE)


def _resized(entry: dict, sizes: Optional[Dict[str, int]]) -> dict:
    """entry with the maps of sizes made that many entries (the cached entry
    itself is left as it is)."""
    if not sizes:
        return entry
    maps = []
    for m in entry["maps"]:
        n = sizes.get(m["name"])
        if n is not None:
            if m["type"] not in RESIZABLE or not 0 < n <= m["max_entries"]:
                raise ValueError(f"map {m['name']}: cannot be given {n} entries")
            m = dict(m, max_entries=n)
        maps.append(m)
    return dict(entry, maps=maps)


def _start(entry: dict, skip: Iterable[str], preload: Sequence[Tuple[str, int]],
           optional: Sequence[Tuple[str, int]], log_level: int,
           sizes: Optional[Dict[str, int]] = None,
           meanwhile: Optional[Callable[["Program"], None]] = None) -> Program:
    entry = _resized(entry, sizes)
    for m in entry["maps"]:                     # every type decodes, before anything is made
        try:
            _check_sizes(m["name"], ctype_of(json.loads(m["key_desc"])),
                         ctype_of(json.loads(m["leaf_desc"])), m)
        except ValueError as e:
            raise CacheError(f"map {m['name']}: {e}") from None
    prog = Program(entry, log_level)
    try:
        skip = set(skip)
        auto = [n for n in prog.function_names()
                if n.startswith(AUTOLOAD_PREFIX) and n[len(AUTOLOAD_PREFIX):] not in skip]
        specs = [(n, RAW_TRACEPOINT) for n in auto] + list(preload) + list(optional)
        prog.load_funcs_parallel(specs, optional=[n for n, _ in optional], meanwhile=meanwhile)
        for n in auto:
            prog.attach_raw_tracepoint(tp=n[len(AUTOLOAD_PREFIX):], fn_name=n)
    except BaseException:
        prog.cleanup()
        raise
    return prog
