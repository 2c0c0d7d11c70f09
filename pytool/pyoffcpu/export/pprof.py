"""pprof: a Profile as a gzipped profile.proto, for Grafana Pyroscope, Parca
and `go tool pprof`.

Written by the small protobuf encoder below (varints and length-delimited
fields are all profile.proto needs): no generated `_pb2` module, which
breaks across protobuf runtime versions, and no dependency.

What goes where (the conventions Pyroscope's and Parca's agents use):
- sample types `samples`/`count`, `cpu`/`nanoseconds` (on-CPU time) and
  `wall`/`nanoseconds` (on + off, the default); period type `cpu`/
  `nanoseconds`, period 1e9 / F;
- one sample per stack of each thread, its locations leaf first, with the
  labels `pid`, `thread_id`, `thread_name` and, off the CPU, `off_cpu_reason`
  (and `waker` with --wakers); the process and thread roots of the folded
  format are these labels, not frames; an off-CPU stack keeps its
  `[off-cpu: REASON]` leaf so that a flame graph shows the wait;
- a function per frame: Python ones with their file and line (the line on
  the location), native ones under a mapping of their object file, kernel
  ones under `[kernel.kallsyms]`; addresses are not kept in a Profile, so
  locations have none;
- `comment`: the command, the target, the interpreters and the mode.
"""
from __future__ import annotations

import gzip
import os
import zlib
from typing import Dict, List, Optional, Tuple

from ..profile.model import FrameKind, Profile, off_cpu_marker
from ..leb128 import read_uleb    # a protobuf varint is an unsigned LEB128

KERNEL_MAPPING = "[kernel.kallsyms]"


def doc_url() -> str:
    """The user's guide of this installation (README.md beside the package's
    source tree, or the Debian package's copy), as a file: URL; "" where it
    is not there."""
    for readme in (os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "README.md")),
                   "/usr/share/doc/pyoffcpu/README.md"):
        if os.path.isfile(readme):
            return "file://" + readme + "#reading-the-flame-graph"
    return ""


# -- the wire format -----------------------------------------------------------------
def varint(n: int) -> bytes:
    """A base-128 varint; negative int64s as their two's complement."""
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class Message:
    """One protobuf message being built: fields appended in order."""

    def __init__(self):
        self.buf = bytearray()

    def int(self, field: int, value: int) -> "Message":
        """A varint field (int64/uint64/bool); zero is the default, left out."""
        if value:
            self.buf += varint(field << 3) + varint(value)
        return self

    def bytes(self, field: int, data: bytes) -> "Message":
        """A length-delimited field: a string, bytes or an embedded message."""
        self.buf += varint(field << 3 | 2) + varint(len(data)) + data
        return self

    def message(self, field: int, msg: "Message") -> "Message":
        return self.bytes(field, bytes(msg.buf))

    def packed(self, field: int, values: List[int]) -> "Message":
        """A packed repeated varint field."""
        if values:
            self.bytes(field, b"".join(varint(v) for v in values))
        return self


# -- profile.proto -------------------------------------------------------------------
class _Builder:
    def __init__(self):
        self.strings: Dict[str, int] = {"": 0}
        self.functions: Dict[Tuple[int, int, int], int] = {}
        self.locations: Dict[Tuple[int, int, int], int] = {}
        self.mappings: Dict[str, int] = {}
        self.out = Message()
        self._tail = Message()          # functions, locations, mappings: after the samples

    def s(self, text: str) -> int:
        i = self.strings.get(text)
        if i is None:
            i = self.strings[text] = len(self.strings)
        return i

    def mapping(self, path: str) -> int:
        i = self.mappings.get(path)
        if i is None:
            i = self.mappings[path] = len(self.mappings) + 1
            self._tail.message(3, Message().int(1, i).int(5, self.s(path))
                               .int(7, 1).int(8, 1).int(9, int(path != KERNEL_MAPPING)))
        return i

    def function(self, name: str, filename: str = "", start_line: int = 0) -> int:
        key = (self.s(name), self.s(filename), start_line)
        i = self.functions.get(key)
        if i is None:
            i = self.functions[key] = len(self.functions) + 1
            self._tail.message(5, Message().int(1, i).int(2, key[0]).int(3, key[0])
                               .int(4, key[1]).int(5, start_line))
        return i

    def location(self, function: int, line: int, mapping: int) -> int:
        key = (function, line, mapping)
        i = self.locations.get(key)
        if i is None:
            i = self.locations[key] = len(self.locations) + 1
            loc = Message().int(1, i).int(2, mapping)
            loc.message(4, Message().int(1, function).int(2, line))
            self._tail.message(4, loc)
        return i

    def frame(self, frame, full_paths: bool, short) -> int:
        """The location of one Profile frame."""
        if frame.kind is FrameKind.PYTHON:
            f = frame.file or "?"
            if not full_paths and short is not None:
                f = short(f)
            line = frame.line if frame.line is not None and frame.line >= 0 else 0
            return self.location(self.function(frame.name, f), line, 0)
        if frame.kind is FrameKind.KERNEL:
            return self.location(self.function(frame.label()), 0, self.mapping(KERNEL_MAPPING))
        if frame.kind is FrameKind.NATIVE and frame.module:
            return self.location(self.function(frame.name), 0, self.mapping(frame.module))
        return self.location(self.function(frame.label()), 0, 0)

    def finish(self) -> bytes:
        self.out.buf += self._tail.buf
        for text in self.strings:                   # dicts keep insertion order: index order
            self.out.bytes(6, text.encode("utf-8", "surrogateescape"))
        return bytes(self.out.buf)


def profile_proto(profile: Profile, full_paths: bool = False) -> bytes:
    """The profile as an uncompressed profile.proto message."""
    from ..profile.model import PathShortener
    b = _Builder()
    meta = profile.meta
    for name, unit in (("samples", "count"), ("cpu", "nanoseconds"), ("wall", "nanoseconds")):
        b.out.message(1, Message().int(1, b.s(name)).int(2, b.s(unit)))
    short = None if full_paths else PathShortener()
    # the heaviest stack's object files first (a reader calls the first
    # mapping the profile's "File"), the kernel's last
    kernel = False
    for key, _ in sorted(profile.weights.items(), key=lambda kv: -kv[1]):
        for f in key.frames:
            if f.kind is FrameKind.NATIVE and f.module:
                b.mapping(f.module)
            kernel = kernel or f.kind is FrameKind.KERNEL
    if kernel:
        b.mapping(KERNEL_MAPPING)
    markers: Dict[str, int] = {}
    for key, ns in sorted(profile.weights.items(), key=lambda kv: (kv[0].pid, kv[0].tid, -kv[1])):
        locs = [b.frame(f, full_paths, short) for f in reversed(key.frames)]
        if key.off_cpu is not None:
            m = markers.get(key.off_cpu)
            if m is None:
                m = markers[key.off_cpu] = b.location(b.function(off_cpu_marker(key.off_cpu).name), 0, 0)
            locs.insert(0, m)
        count = profile.sample_counts.get(key, 1)
        sample = Message().packed(1, locs).packed(2, [count, ns if key.off_cpu is None else 0, ns])
        labels = [("pid", str(key.pid)), ("thread_id", str(key.tid)),
                  ("thread_name", profile.threads.get(key.tid, "?"))]
        if key.off_cpu is not None:
            labels.append(("off_cpu_reason", key.off_cpu))
        if key.waker:
            labels.append(("waker", _waker_label(key.waker, full_paths, short)))
        for k, v in labels:
            sample.message(3, Message().int(1, b.s(k)).int(2, b.s(v)))
        b.out.message(2, sample)
    b.out.int(9, int(meta.start_time * 1e9))
    b.out.int(10, meta.duration_ns or int(meta.duration_s * 1e9))
    b.out.message(11, Message().int(1, b.s("cpu")).int(2, b.s("nanoseconds")))
    b.out.int(12, int(1e9 // max(1, meta.frequency_hz)))
    for text in _comments(profile):
        b.out.int(13, b.s(text))
    b.out.int(14, b.s("wall"))
    url = doc_url()
    if url:
        b.out.int(15, b.s(url))
    return b.finish()


def _waker_label(frames, full_paths: bool, short) -> str:
    """`thread 123 name in producer (app.py:41)`, `[woken by timer]`."""
    thread = next((f.name for f in frames if f.name.startswith("thread ")), None)
    where = next((f.label(full_paths, short) for f in frames if f.kind is FrameKind.PYTHON), None)
    if thread is None:
        return frames[0].name
    return f"{thread} in {where}" if where else thread


def _comments(profile: Profile) -> List[str]:
    meta = profile.meta
    out = [f"pyoffcpu: {meta.target or 'a profile'}, {meta.mode} mode, {meta.frequency_hz} Hz"]
    if meta.command_line:
        out.append("command: " + meta.command_line)
    if meta.python_version:
        out.append("CPython " + meta.python_version)
    return out


def render_pprof(profile: Profile, threads: bool = True, full_paths: bool = False) -> bytes:
    """The gzipped profile.proto (threads: the thread labels are always
    there; a pprof reader groups by them when asked)."""
    return gzip.compress(profile_proto(profile, full_paths), compresslevel=6, mtime=0)


# -- reading ----------------------------------------------------------------------------
def _signed(v: int) -> int:
    return v - (1 << 64) if v >> 63 else v


# fields one message may hold: a Python object each (a 2-byte field is ~40
# bytes here), so a file made of tiny fields cannot take gigabytes
MAX_FIELDS = 4_000_000


def fields(data: bytes) -> Dict[int, list]:
    """One message's fields: number -> values in order (ints for varints,
    bytes for length-delimited ones); fixed32/64 are skipped."""
    out: Dict[int, list] = {}
    i, n = 0, len(data)
    count = 0
    while i < n:
        count += 1
        if count > MAX_FIELDS:
            raise ValueError(f"a message of over {MAX_FIELDS:,} fields")
        tag, i = _varint(data, i)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            v, i = _varint(data, i)
            out.setdefault(field, []).append(_signed(v))
        elif wire == 2:
            ln, i = _varint(data, i)
            if i + ln > n:
                raise ValueError("truncated field")
            out.setdefault(field, []).append(data[i:i + ln])
            i += ln
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"wire type {wire}")
    return out


def _varint(data: bytes, i: int) -> Tuple[int, int]:
    """A protobuf varint: at most 10 bytes, a 64-bit value."""
    v, j = read_uleb(data[i:i + 11], 0)
    if j > 10 or v >> 64:
        raise ValueError("a varint over 64 bits")
    return v, i + j


def _messages(f: Dict[int, list], n: int) -> List[bytes]:
    """Field n of a decoded message, each a length-delimited value (a
    message, a string or packed numbers); a varint there is a bad file."""
    out = f.get(n, [])
    if not all(isinstance(v, bytes) for v in out):
        raise ValueError(f"field {n}: a number where a message belongs")
    return out


def _first(f: Dict[int, list], n: int) -> int:
    """The first value of varint field n (0 when absent)."""
    v = f.get(n)
    if not v:
        return 0
    if not isinstance(v[0], int):
        raise ValueError(f"field {n}: bytes where a number belongs")
    return v[0]


def _label_id(text: str) -> int:
    """A pid or tid label: ASCII digits of a plausible id, else 0."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 10 else 0


def _ints(values: list) -> List[int]:
    """A repeated varint field, packed (bytes) or not."""
    out: List[int] = []
    for v in values:
        if isinstance(v, bytes):
            j = 0
            while j < len(v):
                x, j = _varint(v, j)
                out.append(_signed(x))
        else:
            out.append(v)
    return out


def max_input_bytes() -> int:
    """What a file handed to diff or report may take in memory, read or
    inflated (PYOFFCPU_MAX_INPUT_MB, default 256): a 1 MB .pb.gz can say it
    inflates to gigabytes."""
    try:
        return max(1, int(os.environ.get("PYOFFCPU_MAX_INPUT_MB", "256"))) << 20
    except ValueError:
        return 256 << 20


def inflate(data: bytes, limit: Optional[int] = None) -> bytes:
    """gzip data inflated, at most `limit` bytes (max_input_bytes()); raises
    ValueError past it, or on a damaged stream."""
    limit = max_input_bytes() if limit is None else limit
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(data, limit)
        if d.unconsumed_tail:
            raise ValueError(f"it inflates to more than {limit >> 20} MiB (PYOFFCPU_MAX_INPUT_MB)")
        out += d.flush()
    except zlib.error as e:
        raise ValueError(f"damaged gzip data ({e})") from None
    if len(out) > limit:
        raise ValueError(f"it inflates to more than {limit >> 20} MiB (PYOFFCPU_MAX_INPUT_MB)")
    return out


def from_pprof(data: bytes) -> Profile:
    """A Profile from a pprof file (gzipped or not) we or another tool wrote:
    the `wall` values (else the last sample type) as weights in ns, frames
    from each location's lines (a function with a file is a Python frame,
    one under the kernel mapping a kernel frame), our labels back as
    processes and threads, an `[off-cpu: REASON]` leaf as the reason."""
    import re
    from ..profile.model import TRUNCATED, StackKey, kernel_frame, native_frame, python_frame
    if data[:2] == b"\x1f\x8b":
        data = inflate(data)
    top = fields(data)
    strings = [b.decode("utf-8", "surrogateescape") for b in _messages(top, 6)]

    def s(i: int) -> str:
        return strings[i] if 0 <= i < len(strings) else ""
    types = [s(_first(fields(m), 1)) for m in _messages(top, 1)]
    unit_ns = 1
    vi = types.index("wall") if "wall" in types else len(types) - 1
    if vi >= 0:
        unit = s(_first(fields(_messages(top, 1)[vi]), 2))
        unit_ns = {"nanoseconds": 1, "microseconds": 1000, "milliseconds": 1_000_000,
                   "seconds": 1_000_000_000}.get(unit, 1)
    mappings = {}
    for m in _messages(top, 3):
        f = fields(m)
        mappings[_first(f, 1)] = s(_first(f, 5))
    functions = {}
    for m in _messages(top, 5):
        f = fields(m)
        functions[_first(f, 1)] = (s(_first(f, 2)), s(_first(f, 4)))
    locations: Dict[int, list] = {}
    for m in _messages(top, 4):
        f = fields(m)
        mod = mappings.get(_first(f, 2), "")
        frames = []
        for ln in _messages(f, 4):          # inlined first, the caller last
            lf = fields(ln)
            name, filename = functions.get(_first(lf, 1), ("?", ""))
            line = _first(lf, 2)
            if mod == KERNEL_MAPPING:
                frames.append(kernel_frame(name[:-4] if name.endswith("_[k]") else name))
            elif filename:
                frames.append(python_frame(name, filename, line or None))
            elif name == TRUNCATED.name:
                frames.append(TRUNCATED)
            else:
                frames.append(native_frame(name, module=mod or None))
        locations[_first(f, 1)] = frames
    prof = Profile()
    off = re.compile(r"^\[off-cpu(?:: ([^\]]+))?\]$")
    for m in _messages(top, 2):
        f = fields(m)
        values = _ints(f.get(2, []))
        if not values:
            continue
        ns = values[vi if vi < len(values) else -1] * unit_ns
        if ns < 0 or values[0] < 0:
            raise ValueError("a negative sample value")
        labels = {}
        for lb in _messages(f, 3):
            lf = fields(lb)
            labels[s(_first(lf, 1))] = s(_first(lf, 2)) if lf.get(2) else str(_first(lf, 3))
        leaf_first = [fr for loc in _ints(f.get(1, [])) for fr in locations.get(loc, [])]
        reason = None
        if leaf_first and leaf_first[0].kind is FrameKind.NATIVE:
            mo = off.match(leaf_first[0].name)
            if mo:
                reason = mo.group(1) or "other"
                leaf_first = leaf_first[1:]
        pid = _label_id(labels.get("pid", ""))
        tid = _label_id(labels.get("thread_id", "")) or pid
        if pid:
            prof.processes.setdefault(pid, "?")
        if "thread_name" in labels:
            prof.threads.setdefault(tid, labels["thread_name"])
        count = values[0] if types and types[0] == "samples" else 1
        prof.add(StackKey(pid, tid, tuple(reversed(leaf_first)), reason), ns, count)
    return prof
