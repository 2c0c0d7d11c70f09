"""`_Py_DebugOffsets`: the offsets CPython 3.13+ publishes at the start of
`_PyRuntime` for out-of-process tools (cpython-frames.md section 3).

The struct starts with the cookie "xdebugpy", PY_VERSION_HEX and the
free-threaded flag; every other member is a u64 offset.  Its own layout changes
between minor versions, so where each member sits is generated data
(DEBUG_POSITIONS in offsets_table.py: compiled for 3.13, from source for 3.14).
The values read from a live target are then preferred to the offsets table,
and a disagreement is reported (`merge`).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .offsets_table import DEBUG_POSITIONS, DEBUG_POSITIONS_FROM_SOURCE

COOKIE = b"xdebugpy"
HEADER_SIZE = 24                 # cookie, version, free_threaded: the same in 3.13 and 3.14
MAX_OFFSET = 1 << 20             # anything larger is not a struct offset: a torn or foreign blob
# Values that are positions of the header itself, not offsets of other structs.
_HEADER_KEYS = ("version", "free_threaded", "sizeof")


class BadDebugOffsets(ValueError):
    """The blob is not a _Py_DebugOffsets we can read."""


def positions(minor: Tuple[int, int]) -> Optional[Dict[str, int]]:
    """Where each value sits in this minor version's struct, or None."""
    return DEBUG_POSITIONS.get(minor) or DEBUG_POSITIONS_FROM_SOURCE.get(minor)


def split_version(hexversion: int) -> Tuple[int, int, int]:
    return (hexversion >> 24) & 0xff, (hexversion >> 16) & 0xff, (hexversion >> 8) & 0xff


@dataclass
class DebugOffsets:
    version_hex: int
    free_threaded: bool
    values: Dict[str, int] = field(default_factory=dict)   # offsets-table keys -> offsets

    @property
    def version(self) -> Tuple[int, int, int]:
        return split_version(self.version_hex)


def parse_header(blob: bytes) -> Tuple[int, bool]:
    """(PY_VERSION_HEX, free_threaded) from the first HEADER_SIZE bytes."""
    if len(blob) < HEADER_SIZE or blob[:8] != COOKIE:
        raise BadDebugOffsets("no _Py_DebugOffsets cookie")
    version, free_threaded = struct.unpack_from("<QQ", blob, 8)
    if version >> 32 or (version >> 24) != 3:
        raise BadDebugOffsets("implausible version %#x" % version)
    return version, bool(free_threaded)


def parse(blob: bytes, as_minor: Optional[Tuple[int, int]] = None) -> DebugOffsets:
    """A whole _Py_DebugOffsets blob of a minor version we know the layout of;
    `as_minor`: read it with that version's layout instead (a newer minor
    version, whose values the caller then checks on the live process)."""
    version, free_threaded = parse_header(blob)
    pos = positions(as_minor or split_version(version)[:2])
    if pos is None:
        raise BadDebugOffsets("no known _Py_DebugOffsets layout for %d.%d"
                              % split_version(version)[:2])
    if len(blob) < pos["sizeof"]:
        raise BadDebugOffsets("short _Py_DebugOffsets: %d bytes" % len(blob))
    values = {}
    for key, at in pos.items():
        if key in _HEADER_KEYS:
            continue
        val = struct.unpack_from("<Q", blob, at)[0]
        if val >= MAX_OFFSET:
            raise BadDebugOffsets("implausible offset %s=%#x" % (key, val))
        values[key] = val
    return DebugOffsets(version, free_threaded, values)


def read(mem, runtime: int, as_minor: Optional[Tuple[int, int]] = None) -> DebugOffsets:
    """Read and parse the struct at `runtime` (&_PyRuntime) of a live target
    (`as_minor`: see parse)."""
    version, _ = parse_header(mem.read(runtime, HEADER_SIZE))
    pos = positions(as_minor or split_version(version)[:2])
    size = pos["sizeof"] if pos else HEADER_SIZE
    return parse(mem.read(runtime, size), as_minor)


# Values the struct does not publish, each kept at its distance from a value
# it does publish in the same struct: a build whose object header is larger
# (free-threaded: 32 bytes; Py_TRACE_REFS: 32) moves both by the same amount.
# The fields in between are pointers and ints that no build option changes.
DERIVED = {
    "compact_data": "ascii_data",           # sizeof(PyCompactUnicodeObject)
    "compact_utf8": "ascii_data",
    "compact_utf8_length": "ascii_data",
    "type_basicsize": "type_name",          # tp_basicsize right after tp_name
    "code_firsttraceable": "code_code_adaptive",    # two pointers before the bytecode
}
# Positions inside _PyRuntime that no anchor vouches for: unknown (-1) unless
# the published runtime values match the table's build.
RUNTIME_UNPUBLISHED = ("runtime_autotss",)


def merge(table: Dict[str, int], dbg: DebugOffsets) -> Tuple[Dict[str, int], List[str]]:
    """The table with the run-time values put in; the keys whose table value
    (where the table has one: -1 is none) disagreed.  Unpublished values move
    with their anchors (DERIVED); on a build other than the table's
    (free-threaded, or any published value differs) the unpublished
    _PyRuntime positions become unknown, and the callers find them otherwise
    (autoTSSkey: from the live threads)."""
    out = dict(table)
    differ = []
    for key, val in sorted(dbg.values.items()):
        if out.get(key, -1) not in (-1, val):
            differ.append(key)
        out[key] = val
    for key, anchor in DERIVED.items():
        if table.get(key, -1) >= 0 and table.get(anchor, -1) >= 0 and anchor in dbg.values:
            out[key] = table[key] + dbg.values[anchor] - table[anchor]
    if dbg.free_threaded or differ:
        for key in RUNTIME_UNPUBLISHED:
            out[key] = -1
    return out, differ
