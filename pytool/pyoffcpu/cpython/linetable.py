"""Pure-Python decoders for CPython code-object line tables.

Maps a byte offset of an instruction inside a code object's bytecode to a source
line number, from the raw table bytes read out of the target process:

* 3.6-3.9: ``co_lnotab`` -- ``(addr_incr u8, line_incr s8)`` pairs.
* 3.10:    ``co_linetable`` -- ``(sdelta u8, ldelta s8)`` pairs, ``ldelta == -128``
  meaning "no line".
* 3.11+:   the location table (PEP 657): entries led by a ``1cccclll`` byte, each
  covering ``lll + 1`` code units; code 15 = no location, 14 = long form,
  13 = line only, 10-12 = one-line form, 0-9 = short form (same line).

Offsets are in **bytes** from the start of the bytecode (``2 * f_lasti`` on 3.10,
``instr_ptr - co_code_adaptive`` on 3.11+).  The "no line" result is ``-1``
(what ``PyCode_Addr2Line`` returns), and a negative offset gives ``co_firstlineno``
(a frame that has not started yet).  An offset past the end of the table gives
``-1`` on 3.10+ and the last line on <= 3.9, as CPython does.

Two ways to use it:

* :func:`line_for_offset` -- one-shot, a linear scan of the table, no state.
* :func:`decode_ranges` / :class:`LineTable` -- decode the table once into sorted
  ``(start, end, line)`` ranges, then look offsets up with a binary search.  Cache
  the :class:`LineTable` per code object (e.g. by code address + table bytes).
"""

from bisect import bisect_right

__all__ = [
    "NO_LINE",
    "line_for_offset",
    "lnotab_line",
    "linetable310_line",
    "location_table_line",
    "decode_ranges",
    "decode_lnotab",
    "decode_linetable310",
    "decode_location_table",
    "LineTable",
    "table_kind",
]

NO_LINE = -1

# End of the last lnotab range: the last line extends past the end of the code.
_OPEN_END = 1 << 62


def table_kind(version):
    """Return "lnotab", "linetable310" or "location" for a (major, minor[, ...]) tuple."""
    ver = tuple(version[:2])
    if ver < (3, 6):
        raise ValueError("unsupported CPython version %r (need 3.6+)" % (version,))
    if ver < (3, 10):
        return "lnotab"
    if ver == (3, 10):
        return "linetable310"
    return "location"


# ---------------------------------------------------------------------------
# One-shot scans
# ---------------------------------------------------------------------------
def lnotab_line(table, firstlineno, offset):
    """``co_lnotab`` (3.6-3.9): line of the instruction at byte ``offset``."""
    if offset < 0:
        return firstlineno
    line = firstlineno
    addr = 0
    n = len(table) - 1
    i = 0
    while i < n:
        addr += table[i]
        if addr > offset:
            break
        incr = table[i + 1]
        line += incr - 256 if incr >= 128 else incr
        i += 2
    return line


def linetable310_line(table, firstlineno, offset):
    """3.10 ``co_linetable``: line at byte ``offset``, or -1."""
    if offset < 0:
        return firstlineno
    line = firstlineno
    end = 0
    n = len(table) - 1
    i = 0
    while i < n:
        start = end
        end += table[i]
        ldelta = table[i + 1]
        i += 2
        if ldelta == 128:  # -128: no line number for this range
            if start <= offset < end:
                return NO_LINE
            continue
        line += ldelta - 256 if ldelta > 128 else ldelta
        if start <= offset < end:
            return line
    return NO_LINE


def _varint(table, i):
    """Read an unsigned varint (6-bit chunks, LSB first, 0x40 = more); -> (value, i)."""
    b = table[i]
    i += 1
    val = b & 63
    shift = 0
    while b & 64:
        b = table[i]
        i += 1
        shift += 6
        val |= (b & 63) << shift
    return val, i


def _svarint(table, i):
    val, i = _varint(table, i)
    return (-(val >> 1) if val & 1 else val >> 1), i


def _iter_location_entries(table, firstlineno):
    """Yield ``(start, end, line)`` per location-table entry, line -1 when none."""
    line = firstlineno
    addr = 0
    n = len(table)
    i = 0
    while i < n:
        first = table[i]
        i += 1
        if not first & 0x80:
            # Not at an entry start: corrupt/truncated table (or a racy read).
            raise ValueError("bad location table byte 0x%02x at %d" % (first, i - 1))
        code = (first >> 3) & 15
        end = addr + ((first & 7) + 1) * 2
        if code == 15:  # no location
            yield addr, end, NO_LINE
        else:
            if code == 14:  # long form: line delta, end line, col, end col
                delta, i = _svarint(table, i)
                line += delta
                for _ in range(3):
                    _, i = _varint(table, i)
            elif code == 13:  # no column info
                delta, i = _svarint(table, i)
                line += delta
            elif code >= 10:  # one-line form: line += code - 10, col, end col
                line += code - 10
                i += 2
            else:  # short form: same line, one column byte
                i += 1
            yield addr, end, line
        addr = end


def location_table_line(table, firstlineno, offset):
    """3.11+ location table: line at byte ``offset``, or -1."""
    if offset < 0:
        return firstlineno
    try:
        for start, end, line in _iter_location_entries(table, firstlineno):
            if offset < end:
                return line if offset >= start else NO_LINE
    except (IndexError, ValueError):
        pass
    return NO_LINE


_SCANNERS = {
    "lnotab": lnotab_line,
    "linetable310": linetable310_line,
    "location": location_table_line,
}


def line_for_offset(version, table, firstlineno, offset):
    """Line number for the instruction at byte ``offset`` of a code object.

    ``version``: the target's ``(major, minor[, micro])``; ``table``: the raw
    ``co_lnotab`` (<= 3.9) or ``co_linetable`` (3.10+) bytes; ``firstlineno``:
    ``co_firstlineno``.  Returns -1 when the instruction has no line.
    """
    return _SCANNERS[table_kind(version)](bytes(table), firstlineno, offset)


# ---------------------------------------------------------------------------
# Decode once, look up many times
# ---------------------------------------------------------------------------
def _merge(ranges):
    """Drop empty ranges and merge neighbours with the same line."""
    out = []
    for start, end, line in ranges:
        if end <= start:
            continue
        if out and out[-1][2] == line and out[-1][1] == start:
            out[-1] = (out[-1][0], end, line)
        else:
            out.append((start, end, line))
    return out


def decode_lnotab(table, firstlineno):
    """``co_lnotab`` -> sorted ``(start, end, line)``; the last range is open-ended."""
    ranges = []
    line = firstlineno
    addr = 0
    for i in range(0, len(table) - 1, 2):
        incr = table[i]
        if incr:
            # Bytes [addr, addr + incr) keep the line accumulated so far.
            ranges.append((addr, addr + incr, line))
            addr += incr
        ldelta = table[i + 1]
        line += ldelta - 256 if ldelta >= 128 else ldelta
    ranges.append((addr, _OPEN_END, line))
    return _merge(ranges)


def decode_linetable310(table, firstlineno):
    """3.10 ``co_linetable`` -> sorted ``(start, end, line)`` with -1 for no line."""
    ranges = []
    line = firstlineno
    end = 0
    for i in range(0, len(table) - 1, 2):
        start = end
        end += table[i]
        ldelta = table[i + 1]
        if ldelta == 128:
            ranges.append((start, end, NO_LINE))
        else:
            line += ldelta - 256 if ldelta > 128 else ldelta
            ranges.append((start, end, line))
    return _merge(ranges)


def decode_location_table(table, firstlineno):
    """3.11+ location table -> sorted ``(start, end, line)`` with -1 for no line.

    A truncated or corrupt table yields the ranges decoded before the damage.
    """
    ranges = []
    try:
        for entry in _iter_location_entries(table, firstlineno):
            ranges.append(entry)
    except (IndexError, ValueError):
        pass
    return _merge(ranges)


_DECODERS = {
    "lnotab": decode_lnotab,
    "linetable310": decode_linetable310,
    "location": decode_location_table,
}


def decode_ranges(version, table, firstlineno):
    """Decode a whole line table into sorted, non-overlapping ``(start, end, line)``
    byte ranges (``line`` -1 for "no line"; empty ranges dropped, equal neighbours
    merged).  Offsets not covered by any range have no line (3.10+)."""
    return _DECODERS[table_kind(version)](bytes(table), firstlineno)


class LineTable(object):
    """A decoded line table with O(log n) lookups.

    >>> lt = LineTable((3, 12), code.co_linetable, code.co_firstlineno)
    >>> lt.line_for_offset(2 * instr_index)
    """

    __slots__ = ("firstlineno", "ranges", "_starts")

    def __init__(self, version, table, firstlineno):
        self.firstlineno = firstlineno
        self.ranges = decode_ranges(version, table, firstlineno)
        self._starts = [r[0] for r in self.ranges]

    def line_for_offset(self, offset):
        if offset < 0:
            return self.firstlineno
        idx = bisect_right(self._starts, offset) - 1
        if idx < 0:
            return NO_LINE
        start, end, line = self.ranges[idx]
        return line if offset < end else NO_LINE

    __call__ = line_for_offset

    def __repr__(self):
        return "LineTable(firstlineno=%d, %d ranges)" % (self.firstlineno, len(self.ranges))
