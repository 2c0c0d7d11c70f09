"""Reading and emptying the BPF maps: a generation of the aggregation maps
taken in a few batched syscalls and unpacked without a ctypes object per
entry (one entry at a time where the kernel has no batch ops), the sizes
each session gives its maps, a program's fdinfo counters, and the BPF
source with its inline headers pasted in (bcc rewrites map calls only in
the main file)."""
from __future__ import annotations

import ctypes
import os
import re
import struct
from typing import Dict, List, Optional, Tuple

from ..kernel import bpfdefs
from ..kernel.procfs import read_text
from .recording import Options


AGG_KEY_FIELDS = ("tgid", "tid", "ustack", "kstack", "pystack", "kind", "gen", "nstack")
AGG_VALUE_FIELDS = ("count", "ns")
GROUP_KEY_FIELDS = ("id", "gen", "cpu", "pad")
GROUP_VALUE_FIELDS = ("threads", "on_ns", "samples", "first_ts", "last_ts", "first_tid")
WAKE_KEY_FIELDS = ("tgid", "tid", "ustack", "kstack", "pystack", "kind", "gen", "nstack",
                   "waker_kind", "waker_tgid", "waker_tid", "waker_ustack", "waker_kstack", "waker_pad",
                   "waker_pystack", "waker_nstack", "waker_comm0", "waker_comm1")
_CHARS = {ctypes.c_uint32: "I", ctypes.c_int32: "i", ctypes.c_uint64: "Q", ctypes.c_int64: "q",
          ctypes.c_uint16: "H", ctypes.c_int16: "h", ctypes.c_uint8: "B", ctypes.c_int8: "b"}
_FORMATS: Dict[type, Optional[str]] = {}


def take_generation(table, key_fields: Tuple[str, ...], value_fields: Tuple[str, ...],
                     final: bool, old: Optional[int]) -> List[Tuple[tuple, tuple]]:
    """(key, value) field tuples of a map's entries of generation `old`
    (key field `gen`; every entry when final), deleted from the map: a few
    batched syscalls, unpacked without a ctypes object per entry; one entry
    at a time where the kernel has no batch ops."""
    kfmt = unpack_format(table.Key, key_fields)
    vfmt = unpack_format(table.Leaf, value_fields)
    g = key_fields.index("gen")
    out, stale = [], []
    try:
        if kfmt is None or vfmt is None:
            raise ValueError("not the layout of " + ", ".join(key_fields))
        ks = struct.calcsize(kfmt)
        for kb, vb, n in table.raw_lookup_batch(delete=final):
            for i, (k, v) in enumerate(zip(struct.iter_unpack(kfmt, kb), struct.iter_unpack(vfmt, vb))):
                if final or k[g] == old:
                    out.append((k, v))
                    if not final:
                        stale.append(kb[i * ks:(i + 1) * ks])
        if stale:
            delete_all(table, (table.Key * len(stale)).from_buffer_copy(b"".join(stale)))
        return out
    except Exception:                       # noqa: BLE001 (kernels without batch ops)
        if not final:
            out = []                        # nothing deleted yet: all read again below
    # one entry at a time; at the end, what a failed batch took is in out
    items = list(table.items())
    if not final:
        items = [(k, v) for k, v in items if k.gen == old]
    delete_all(table, [k for k, _ in items])
    return out + [(tuple(getattr(k, f) for f in key_fields), tuple(getattr(v, f) for f in value_fields))
                  for k, v in items]


def unpack_format(ctype, names: Tuple[str, ...]) -> Optional[str]:
    """The struct format that unpacks one ctype, its fields in the order of
    names (padding skipped); None when its fields are not exactly those, of
    plain integer types."""
    if ctype not in _FORMATS:
        fmt, at = "<", 0
        fields = getattr(ctype, "_fields_", ())
        ok = tuple(f[0] for f in fields) == names
        for name, t in fields if ok else ():
            off = getattr(ctype, name).offset
            ch = _CHARS.get(t)
            if ch is None or off < at:
                ok = False
                break
            fmt += "x" * (off - at) + ch
            at = off + ctypes.sizeof(t)
        fmt += "x" * (ctypes.sizeof(ctype) - at)
        _FORMATS[ctype] = fmt if ok and struct.calcsize(fmt) == ctypes.sizeof(ctype) else None
    return _FORMATS[ctype]


def items(table) -> list:
    """A BPF map's entries: a few batched syscalls (one or two per entry
    otherwise, which a server that starts thousands of threads a second
    pays at every drain)."""
    try:
        return list(table.items_lookup_batch())
    except Exception:                   # noqa: BLE001 (kernels without batch ops)
        return list(table.items())


def held_times(table) -> List[tuple]:
    """The keys and times held for the kernel's fold by the threads still
    there (held_keys, bpf/fold.c), as _take_agg's tuples (tgid, tid,
    ustack, kstack, pystack, kind, nstack, count, ns)."""
    out = []
    for _, h in items(table):
        for i in range(min(h.n, len(h.keys))):
            k, v = h.keys[i], h.vals[i]
            if v.count or v.ns:
                out.append((k.tgid, k.tid, k.ustack, k.kstack, k.pystack, k.kind, k.nstack, v.count, v.ns))
    return out


def delete_all(table, keys) -> None:
    """Delete keys (a list of keys, or a ctypes array of them) from a BPF
    map, batched; one already gone is no error."""
    if not len(keys):
        return
    try:
        table.items_delete_batch(keys if isinstance(keys, ctypes.Array) else (table.Key * len(keys))(*keys))
    except Exception:                   # noqa: BLE001 (an entry gone meanwhile fails the batch)
        delete_each(table, keys)


def map_sizes(o: Options, tables: bool, features: Dict[str, int]) -> Dict[str, int]:
    """Entries of the big BPF maps this session needs, below what the source
    gives (its sizes are for -a): the kernel reserves a preallocated map
    whole, ~100 MiB for all of them.  A map that fills counts a drop, named
    in the drops line.  features: the programs' (sessionsetup.features);
    the maps of one that is off are never written, and made 1 entry."""
    sizes = {}
    if not features["KERNEL_STACKS"]:
        sizes["kstacks"] = 1
    if tables:
        sizes["ustacks"] = 4096         # frame-pointer stacks: only where a process has no tables
    if not o.system_wide:
        # the targets' threads, live or ended since the last drain (a second),
        # and those of them blocked now
        sizes["threads"] = sizes["offcpu_start"] = 16384
        sizes["pystack_seen"] = 32768   # full: a stack is sent again, not lost
    if not features["WAKERS"]:
        sizes["last_waker"] = sizes["wake_agg"] = sizes["wake_memo"] = 1
    return sizes


def delete_each(table, keys) -> None:
    """Delete keys from a BPF map one by one; one already gone is no error."""
    for k in keys:
        try:
            del table[k]
        except KeyError:
            pass


def fdinfo(fd: int) -> Dict[str, int]:
    out = {}
    for line in (read_text(f"/proc/self/fdinfo/{fd}") or "").splitlines():
        k, _, v = line.partition(":")
        v = v.strip()
        if v.isdigit():
            out[k.strip()] = int(v)
    return out


_INCLUDE = re.compile(r'^#include "([^"]+)" /\* inline \*/$')


def bpf_source(path: str) -> str:
    """The main BPF file, with each `#include "x.h" /* inline */` replaced by
    that file's text: bcc rewrites map calls (table.lookup()) only in the
    main file, so headers that use maps are pasted into it."""
    out = []
    with open(path) as f:
        for line in f:
            m = _INCLUDE.match(line.strip())
            if m:
                name = m.group(1)
                out.append(f'#line 1 "{name}"\n')
                with open(os.path.join(os.path.dirname(path), name)) as h:
                    out.append(h.read())
                out.append("\n")
            else:
                out.append(line)
    return "".join(out)


def pystack_type():
    """ctypes of struct pystack (bpf/pyoffcpu.h), for the perf events."""
    return bpfdefs.struct_type("pystack")


def walk_stack(table, stack_id: int) -> List[int]:
    try:
        return list(table.walk(stack_id))
    except KeyError:
        return []
