"""The Python reference of the compiled helper's `symbols` command
(pytool/pyoffcpu/native/helper/symbols.c): the same index bytes, from the
functions functable.function_table names and the FDE ranges of
fderanges.fde_ranges.  The product runs the helper alone; the tests hold it
to these bytes (test_symbol_index.py)."""
from __future__ import annotations

import array
import sys
from typing import Sequence, Tuple

from pyoffcpu.native.elffile import MAX_SECTION_BYTES
from pyoffcpu.native.symindex import HEADER, MAGIC, FORMAT_VERSION, U64_MAX

from .fderanges import fde_ranges
from .functable import function_table


def serialize(starts: Sequence[int], ends: Sequence[int], names: Sequence[bytes],
              fdes: Sequence[Tuple[int, int]]) -> bytes:
    """The index of these functions (sorted, distinct starts) and FDEs."""
    n = len(starts)
    offs = [0] * (n + 1)
    total = 0
    for i, nm in enumerate(names):
        offs[i] = total
        total += len(nm)
    offs[n] = total
    words = array.array("Q")
    words.extend(min(s, U64_MAX) for s in starts)
    words.extend(min(e, U64_MAX) for e in ends)
    words.extend(offs)
    words.extend(s for s, _e in fdes)
    words.extend(e for _s, e in fdes)
    if sys.byteorder != "little":
        words.byteswap()
    return (HEADER.pack(MAGIC, FORMAT_VERSION, 0, n, len(fdes), total)
            + words.tobytes() + b"".join(names))


def eh_frame_of(image, read) -> Tuple[bytes, int]:
    """(bytes, address) of the first section called .eh_frame of an
    ElfFile, as the helper reads it: none when it has no bytes in the file
    (SHT_NOBITS, compressed) or does not lie wholly inside it.  ``read``:
    (offset, size) -> bytes of the file."""
    sec = next((s for s in image.sections if s.name == ".eh_frame"), None)
    if sec is None or sec.type == "SHT_NOBITS" or sec.flags & 0x800:
        return b"", 0
    if sec.offset > image.identity.size or sec.size > image.identity.size - sec.offset:
        return b"", 0
    if sec.size > MAX_SECTION_BYTES:
        return b"", 0
    data = read(sec.offset, sec.size)
    return (data, sec.addr) if len(data) == sec.size else (b"", 0)


def build_bytes(sources: Sequence, eh_frame: bytes = b"", eh_frame_addr: int = 0) -> bytes:
    """The index the helper makes, in Python: the functions of
    ``sources`` (ElfFiles with their symbols loaded: the file, then its
    debug file) by ``functable.function_table``, and the FDEs of the file's
    .eh_frame."""
    starts, ends, names = function_table(sources)
    raw = [n.encode("utf-8", "surrogateescape") for n in names]
    return serialize(starts, ends, raw, fde_ranges(eh_frame, eh_frame_addr) if eh_frame else [])
