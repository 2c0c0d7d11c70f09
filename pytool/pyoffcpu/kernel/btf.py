"""Minimal reader of raw kernel BTF (e.g. /sys/kernel/btf/vmlinux).

Only what the profiler needs: walk the type section once to know where each
type record lives, then resolve ``struct.member.sub`` paths to byte offsets.
Struct names are indexed lazily on the first lookup.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass

__all__ = ["Btf", "BtfError", "MemberInfo", "member_offsets"]

VMLINUX_BTF = "/sys/kernel/btf/vmlinux"

BTF_MAGIC = 0xEB9F

# BTF kinds (include/uapi/linux/btf.h).
KIND_INT = 1
KIND_PTR = 2
KIND_ARRAY = 3
KIND_STRUCT = 4
KIND_UNION = 5
KIND_ENUM = 6
KIND_FWD = 7
KIND_TYPEDEF = 8
KIND_VOLATILE = 9
KIND_CONST = 10
KIND_RESTRICT = 11
KIND_FUNC = 12
KIND_FUNC_PROTO = 13
KIND_VAR = 14
KIND_DATASEC = 15
KIND_FLOAT = 16
KIND_DECL_TAG = 17
KIND_TYPE_TAG = 18
KIND_ENUM64 = 19

# Kinds that only wrap another type and are looked through.
_MODIFIERS = frozenset(
    {KIND_TYPEDEF, KIND_VOLATILE, KIND_CONST, KIND_RESTRICT, KIND_TYPE_TAG}
)
_COMPOSITES = frozenset({KIND_STRUCT, KIND_UNION})
# Kinds whose third header word is a byte size.
_SIZED = frozenset({KIND_INT, KIND_STRUCT, KIND_UNION, KIND_ENUM,
                    KIND_FLOAT, KIND_ENUM64, KIND_DATASEC})

_TYPE_HDR = 12      # name_off, info, size/type
_MEMBER_SIZE = 12   # name_off, type, offset


def _words(kind: int):
    """(words after the 3-word header, words per vlen entry) of a kind; (-1, 0): unknown."""
    try:
        return _extra_bytes(kind, 0) // 4, _extra_bytes(kind, 1) // 4 - _extra_bytes(kind, 0) // 4
    except BtfError:
        return -1, 0


def _extra_bytes(kind: int, vlen: int) -> int:
    """Bytes following the 12-byte common header for one type record."""
    if kind in (KIND_INT, KIND_VAR, KIND_DECL_TAG):
        return 4
    if kind == KIND_ARRAY:
        return 12
    if kind in (KIND_STRUCT, KIND_UNION, KIND_DATASEC, KIND_ENUM64):
        return 12 * vlen
    if kind in (KIND_ENUM, KIND_FUNC_PROTO):
        return 8 * vlen
    if kind in (KIND_PTR, KIND_FWD, KIND_TYPEDEF, KIND_VOLATILE, KIND_CONST,
                KIND_RESTRICT, KIND_FUNC, KIND_FLOAT, KIND_TYPE_TAG):
        return 0
    raise BtfError(f"unknown BTF kind {kind}")


class BtfError(Exception):
    """Malformed BTF, or a struct / member that is not there."""


# per kind (0-31): words after a record's 3-word header, and per vlen entry
_FIXED_WORDS, _WORDS_PER_VLEN = (list(t) for t in zip(*(_words(k) for k in range(32))))


@dataclass(frozen=True)
class MemberInfo:
    """Where a (possibly nested) member lives inside its outer struct."""

    bit_offset: int
    bitfield_size: int  # 0 when not a bitfield
    type_id: int

    @property
    def byte_offset(self) -> int:
        return self.bit_offset // 8


class Btf:
    """Parsed view of one raw BTF blob."""

    def __init__(self, data: bytes):
        self._raw = bytes(data)
        self._data = self._raw
        if len(data) < 24:
            raise BtfError("BTF blob too short")
        magic_le = struct.unpack_from("<H", data, 0)[0]
        if magic_le == BTF_MAGIC:
            endian = "<"
        elif struct.unpack_from(">H", data, 0)[0] == BTF_MAGIC:
            endian = ">"
        else:
            raise BtfError(f"bad BTF magic 0x{magic_le:04x}")
        self._e = endian
        (_magic, version, _flags, hdr_len, type_off, type_len, str_off,
         str_len) = struct.unpack_from(endian + "HBBIIIII", data, 0)
        if version != 1:
            raise BtfError(f"unsupported BTF version {version}")
        self._types_start = hdr_len + type_off
        self._types_end = self._types_start + type_len
        self._str_start = hdr_len + str_off
        self._str_end = self._str_start + str_len
        if self._types_end > len(data) or self._str_end > len(data):
            raise BtfError("BTF sections run past the end of the blob")
        # _offsets[type_id] -> position of that record; id 0 is void.
        self._offsets: list[int] = [0]
        self._kinds: list[int] = [0]
        self._index_types()
        self._by_name: dict[str, list[int]] | None = None
        self._ptr_size = 8

    # -- construction ---------------------------------------------------
    @classmethod
    def load(cls, path: str = VMLINUX_BTF) -> "Btf":
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise BtfError(f"cannot read BTF from {path}: {e}") from e
        return cls(data)

    def _index_types(self) -> None:
        """Every type record's position and kind, in id order: one pass over
        vmlinux's ~125k records, on each cold start.  Records are whole
        4-byte words, read as such where the blob is in this machine's byte
        order (twice as fast as a struct call each)."""
        if self._e == ("<" if sys.byteorder == "little" else ">") and \
                not (self._types_end - self._types_start) % 4:
            return self._index_words()
        data = self._data
        unpack_info = struct.Struct(self._e + "I").unpack_from
        pos = self._types_start
        end = self._types_end
        offsets = self._offsets
        kinds = self._kinds
        while pos < end:
            info = unpack_info(data, pos + 4)[0]
            kind = (info >> 24) & 0x1F
            vlen = info & 0xFFFF
            offsets.append(pos)
            kinds.append(kind)
            # inline the common cases of _extra_bytes for speed
            if kind in (KIND_STRUCT, KIND_UNION, KIND_ENUM64, KIND_DATASEC):
                pos += _TYPE_HDR + 12 * vlen
            elif kind in (KIND_ENUM, KIND_FUNC_PROTO):
                pos += _TYPE_HDR + 8 * vlen
            else:
                pos += _TYPE_HDR + _extra_bytes(kind, vlen)
        if pos != end:
            raise BtfError("type section does not end on a record boundary")

    def _index_words(self) -> None:
        start = self._types_start
        words = memoryview(self._data)[start:self._types_end].cast("I")
        n = len(words)
        fixed, per = _FIXED_WORDS, _WORDS_PER_VLEN
        offsets, kinds = self._offsets, self._kinds
        i = 0
        while i < n - 2:
            info = words[i + 1]
            kind = (info >> 24) & 0x1F
            offsets.append(start + 4 * i)
            kinds.append(kind)
            f = fixed[kind]
            if f < 0:
                raise BtfError(f"unknown BTF kind {kind}")
            i += 3 + f + per[kind] * (info & 0xFFFF)
        if i != n:
            raise BtfError("type section does not end on a record boundary")

    # -- raw accessors --------------------------------------------------
    @property
    def type_count(self) -> int:
        """Number of types, not counting void (id 0)."""
        return len(self._offsets) - 1

    def _string(self, off: int) -> str:
        if off == 0:
            return ""
        start = self._str_start + off
        end = self._raw.find(b"\0", start, self._str_end)
        if end < 0:
            end = self._str_end
        return self._raw[start:end].decode("utf-8", "replace")

    def _header(self, type_id: int) -> tuple[int, int, int, int, int]:
        """(name_off, kind, vlen, kind_flag, size_or_type) of a type."""
        if not 0 < type_id < len(self._offsets):
            raise BtfError(f"type id {type_id} out of range")
        name_off, info, size_or_type = struct.unpack_from(
            self._e + "III", self._data, self._offsets[type_id])
        return (name_off, (info >> 24) & 0x1F, info & 0xFFFF,
                info >> 31, size_or_type)

    def type_name(self, type_id: int) -> str:
        if type_id == 0:
            return "void"
        return self._string(self._header(type_id)[0])

    def type_kind(self, type_id: int) -> int:
        return self._kinds[type_id]

    def resolve(self, type_id: int) -> int:
        """Follow typedef / cv-qualifier / type-tag chains."""
        seen = 0
        while type_id and self._kinds[type_id] in _MODIFIERS:
            type_id = self._header(type_id)[4]
            seen += 1
            if seen > 64:
                raise BtfError("modifier chain too long (loop?)")
        return type_id

    def type_size(self, type_id: int) -> int:
        """Size in bytes of a type (after resolving modifiers)."""
        tid = self.resolve(type_id)
        if tid == 0:
            raise BtfError("void has no size")
        _n, kind, _v, _kf, size_or_type = self._header(tid)
        if kind in _SIZED:
            return size_or_type
        if kind == KIND_PTR:
            return self._ptr_size
        if kind == KIND_ARRAY:
            elem, _index, nelems = self._array(tid)
            return nelems * self.type_size(elem)
        raise BtfError(f"type {tid} (kind {kind}) has no size")

    def _array(self, type_id: int) -> tuple[int, int, int]:
        """(elem_type, index_type, nelems) of an ARRAY."""
        return struct.unpack_from(self._e + "III", self._data,
                                  self._offsets[type_id] + _TYPE_HDR)

    def _members(self, type_id: int):
        """Yield (name, type_id, bit_offset, bitfield_size) of a struct/union."""
        _n, kind, vlen, kind_flag, _size = self._header(type_id)
        if kind not in _COMPOSITES:
            raise BtfError(f"type {type_id} is not a struct or union")
        pos = self._offsets[type_id] + _TYPE_HDR
        unpack = struct.Struct(self._e + "III").unpack_from
        for _ in range(vlen):
            name_off, mtype, offset = unpack(self._data, pos)
            pos += _MEMBER_SIZE
            if kind_flag:
                bit_off, bf_size = offset & 0xFFFFFF, offset >> 24
            else:
                bit_off, bf_size = offset, 0
            yield self._string(name_off), mtype, bit_off, bf_size

    # -- name lookup ----------------------------------------------------
    def _build_name_index(self) -> dict[str, list[int]]:
        index: dict[str, list[int]] = {}
        unpack = struct.Struct(self._e + "I").unpack_from
        data = self._data
        raw = self._raw
        str_start, str_end = self._str_start, self._str_end
        for tid, kind in enumerate(self._kinds):
            if kind not in _COMPOSITES:
                continue
            name_off = unpack(data, self._offsets[tid])[0]
            if not name_off:
                continue
            s = str_start + name_off
            e = raw.find(b"\0", s, str_end)
            name = raw[s:e if e >= 0 else str_end].decode("utf-8",
                                                                  "replace")
            index.setdefault(name, []).append(tid)
        return index

    def _first_named(self, want_kind: int, name: str) -> int:
        """The first type of kind want_kind called name; 0 if there is none."""
        want = name.encode() + b"\0"
        raw, start, end = self._raw, self._str_start, self._str_end
        unpack = struct.Struct(self._e + "I").unpack_from
        for tid, kind in enumerate(self._kinds):
            if kind != want_kind:
                continue
            off = start + unpack(self._data, self._offsets[tid])[0]
            if off < end and raw[off:off + len(want)] == want:
                return tid
        return 0

    def tracepoint_args(self, tp: str) -> int:
        """How many arguments a raw tracepoint passes (ctx->args[]), from
        the prototype of its `btf_trace_<tp>` typedef; -1 if there is none.
        Arguments are added across kernels (sched_process_exit's group_dead)."""
        tid = self._first_named(KIND_TYPEDEF, "btf_trace_" + tp)
        if not tid:
            return -1
        proto = self.resolve(self._header(tid)[4])
        if self._kinds[proto] == KIND_PTR:
            proto = self.resolve(self._header(proto)[4])
        if self._kinds[proto] != KIND_FUNC_PROTO:
            return -1
        return self._header(proto)[2] - 1       # less the context pointer

    def func_id(self, name: str) -> int:
        """The type id of the function ``name`` (a kfunc, for a BPF call
        of it), 0 if there is none."""
        return self._first_named(KIND_FUNC, name)

    def find_struct(self, name: str) -> list[int]:
        """Type ids of all struct/union definitions called ``name``."""
        if self._by_name is None:
            self._by_name = self._build_name_index()
        return list(self._by_name.get(name, ()))

    # -- member resolution ----------------------------------------------
    def _find_member(self, type_id: int, name: str, depth: int = 0):
        """Locate ``name`` in a composite, looking through anonymous members.

        Returns (type_id, bit_offset, bitfield_size) relative to ``type_id``.
        """
        if depth > 32:
            return None
        anonymous = []
        for mname, mtype, bit_off, bf_size in self._members(type_id):
            if mname == name:
                return mtype, bit_off, bf_size
            if not mname:
                anonymous.append((mtype, bit_off))
        for mtype, bit_off in anonymous:
            inner = self.resolve(mtype)
            if inner and self._kinds[inner] in _COMPOSITES:
                found = self._find_member(inner, name, depth + 1)
                if found is not None:
                    return found[0], bit_off + found[1], found[2]
        return None

    def _walk(self, struct_id: int, parts: list[str], struct_name: str,
              dotted: str) -> MemberInfo:
        cur = struct_id
        bit_total = 0
        bf_size = 0
        walked: list[str] = []
        for part in parts:
            name, indices = _split_indices(part, dotted)
            cur = self.resolve(cur)
            if bf_size:
                raise BtfError(f"{struct_name}.{'.'.join(walked)} is a "
                               f"bitfield and has no members")
            if not cur or self._kinds[cur] not in _COMPOSITES:
                where = f"{struct_name}.{'.'.join(walked)}" if walked \
                    else struct_name
                raise BtfError(f"{where} is not a struct or union "
                               f"(cannot look up {name!r})")
            found = self._find_member(cur, name)
            if found is None:
                where = ".".join([struct_name] + walked)
                raise BtfError(f"{where} has no member {name!r}")
            cur, bit_off, bf_size = found
            bit_total += bit_off
            walked.append(name)
            for idx in indices:
                arr = self.resolve(cur)
                if not arr or self._kinds[arr] != KIND_ARRAY:
                    raise BtfError(f"{struct_name}.{'.'.join(walked)} is "
                                   f"not an array")
                elem, _it, nelems = self._array(arr)
                if idx >= nelems and nelems:
                    raise BtfError(f"index {idx} out of range for "
                                   f"{struct_name}.{'.'.join(walked)}"
                                   f"[{nelems}]")
                bit_total += 8 * idx * self.type_size(elem)
                cur = elem
        return MemberInfo(bit_total, bf_size, cur)

    def member_info(self, struct_name: str, dotted_path: str) -> MemberInfo:
        """Resolve ``a.b[2].c`` inside ``struct_name`` to a MemberInfo."""
        candidates = self.find_struct(struct_name)
        if not candidates:
            raise BtfError(f"no struct or union named {struct_name!r} in BTF")
        parts = [p for p in dotted_path.split(".")]
        if not dotted_path or any(not p for p in parts):
            raise BtfError(f"bad member path {dotted_path!r}")
        first_error: BtfError | None = None
        for tid in candidates:
            try:
                return self._walk(tid, parts, struct_name, dotted_path)
            except BtfError as e:  # duplicate names: try the next one
                first_error = first_error or e
        assert first_error is not None
        raise first_error

    def member_offset(self, struct_name: str, dotted_path: str) -> int:
        """Byte offset of ``dotted_path`` inside ``struct struct_name``."""
        info = self.member_info(struct_name, dotted_path)
        if info.bit_offset % 8:
            raise BtfError(f"{struct_name}.{dotted_path} is a bitfield at "
                           f"bit {info.bit_offset}, not byte aligned")
        return info.bit_offset // 8

    def struct_size(self, struct_name: str) -> int:
        candidates = self.find_struct(struct_name)
        if not candidates:
            raise BtfError(f"no struct or union named {struct_name!r} in BTF")
        return self.type_size(candidates[0])


def _split_indices(part: str, dotted: str) -> tuple[str, list[int]]:
    """'foo[1][2]' -> ('foo', [1, 2])."""
    if "[" not in part:
        return part, []
    name, rest = part.split("[", 1)
    indices = []
    for chunk in ("[" + rest).split("[")[1:]:
        if not chunk.endswith("]"):
            raise BtfError(f"bad member path {dotted!r}")
        try:
            indices.append(int(chunk[:-1], 0))
        except ValueError:
            raise BtfError(f"bad array index in {dotted!r}") from None
    if not name:
        raise BtfError(f"bad member path {dotted!r}")
    return name, indices


_OFFSETS: dict = {}         # BTF sha256 -> {"struct:member": byte offset}, this process
_PARSED: dict = {}          # BTF sha256 -> its Btf: the last one parsed (0.2 s), for the next miss


TRACEPOINT_ARGS = "(tracepoint args)"   # member_offsets: (TRACEPOINT_ARGS, tp) -> its argument count
TYPE_ID = "(type id)"       # member_offsets: (TYPE_ID, "func NAME" / "struct NAME") -> its type id, 0: none


def _type_id(btf: Btf, what: str) -> int:
    kind, _, name = what.partition(" ")
    if kind == "func":
        return btf.func_id(name)
    if kind == "struct":
        ids = btf.find_struct(name)
        return ids[0] if len(ids) == 1 else 0       # (two of one name: which one is not known)
    raise BtfError(f"no such kind of type: {what}")


def member_offsets(path: str, members, cache_dir: str | None = "default") -> list[int]:
    """Byte offsets of each (struct, dotted member path) in the BTF at path,
    as Btf.member_offset gives them, remembered by the blob's sha256 in this
    process and in `<cache_dir>/btf-<sha256>.json` (default: the BPF program
    cache's directory): parsing vmlinux's BTF takes ~0.2 s of every start,
    hashing it 10 ms.  Raises BtfError / OSError as Btf.load and
    member_offset do."""
    import json
    import os
    from .. import cachedir
    try:
        digest = cachedir.file_sha256(path)
    except OSError as e:
        raise BtfError(f"cannot read BTF from {path}: {e}") from e
    known = _OFFSETS.setdefault(digest, {})
    names = [f"{st}:{m}" for st, m in members]
    directory = cachedir.cache_dir("bpf") if cache_dir == "default" else cache_dir
    file = os.path.join(directory, f"btf-{digest}.json") if directory else None
    if file and not cachedir.safe_dir(directory):
        file = None                         # offsets steer BPF's reads: only from our own directory
    if file and not all(n in known for n in names):
        try:
            with open(file, "rb") as f:     # offsets of a few members: a few KiB
                disk = json.loads(f.read(1 << 20))
            known.update({k: v for k, v in disk.items() if isinstance(k, str) and type(v) is int})
        except (OSError, ValueError, AttributeError, RecursionError):
            pass                            # absent, unreadable or not ours: parsed below
    missing = [(n, st, m) for n, (st, m) in zip(names, members) if n not in known]
    if missing:
        btf = _PARSED.get(digest)
        if btf is None:
            btf = Btf.load(path)
            _PARSED.clear()                 # one blob kept: a start asks several times
            _PARSED[digest] = btf
        for n, st, m in missing:
            known[n] = (btf.tracepoint_args(m) if st == TRACEPOINT_ARGS
                        else _type_id(btf, m) if st == TYPE_ID
                        else btf.member_offset(st, m))
        if file:
            tmp = f"{file}.{os.getpid()}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(known, f)
                os.replace(tmp, file)
            except OSError:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
    return [known[n] for n in names]
