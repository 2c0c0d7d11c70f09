"""LEB128, the variable-length integers of DWARF (.eh_frame, symindex's
FDE ranges) and of protobuf (a varint is an unsigned LEB128: pprof): one
decoder for all of them, a leaf module every stage may import."""
from __future__ import annotations

from typing import Tuple


def read_uleb(data: bytes, pos: int) -> Tuple[int, int]:
    """(the unsigned LEB128 at data[pos], the index after it): DWARF's, and
    protobuf's varint.  Exact at any length (the helper's C reads the same
    values), in time linear in it: a file can hold one of megabytes, and
    shifting a growing int per byte would take hours."""
    result = 0
    shift = 0
    start = pos
    while True:
        if pos >= len(data):
            raise ValueError("truncated LEB128")
        b = data[pos]
        pos += 1
        if pos - start > _LEB_SHORT:
            return _long_leb(data, start, False)
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def read_sleb(data: bytes, pos: int) -> Tuple[int, int]:
    result = 0
    shift = 0
    start = pos
    while True:
        b = data[pos]
        pos += 1
        if pos - start > _LEB_SHORT:
            return _long_leb(data, start, True)
        result |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            if b & 0x40:
                result -= 1 << shift
            return result, pos


_LEB_SHORT = 20             # bytes read by shifting; longer ones by _long_leb


def _long_leb(data: bytes, start: int, signed: bool) -> Tuple[int, int]:
    """A LEB128 of over _LEB_SHORT bytes, read as read_uleb / read_sleb do
    (IndexError or ValueError where they would raise), in linear time: its
    7-bit groups as one binary string, most significant first."""
    end = start
    n = len(data)
    while end < n and data[end] >= 0x80:
        end += 1
    if end >= n:
        if signed:
            raise IndexError("index out of range")
        raise ValueError("truncated LEB128")
    groups = data[start:end + 1]
    value = int("".join(format(b & 0x7F, "07b") for b in reversed(groups)), 2)
    if signed and groups[-1] & 0x40:
        value -= 1 << (7 * len(groups))
    return value, end + 1
