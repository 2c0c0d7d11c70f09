"""Values of named symbols in an ELF file, read straight from its symbol
tables (pyelftools' per-symbol objects are too slow for libc's thousands)."""
from __future__ import annotations

import struct
from typing import Dict

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile


def defined_symbols(path: str, names) -> Dict[str, int]:
    """st_value of the defined symbols among `names` in .dynsym, then (for the
    ones not exported) .symtab."""
    want = {name.encode(): name for name in names}
    out: Dict[str, int] = {}
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            fmt = ("<" if elf.little_endian else ">") + (
                "IBBHQQ" if elf.elfclass == 64 else "IIIBBH")
            size = struct.calcsize(fmt)
            for secname in (".dynsym", ".symtab"):
                if len(out) == len(want):
                    break
                sec = elf.get_section_by_name(secname)
                if sec is None or sec["sh_type"] not in ("SHT_DYNSYM", "SHT_SYMTAB"):
                    continue
                strtab = elf.get_section(sec["sh_link"]).data()
                data = sec.data()
                for fields in struct.iter_unpack(fmt, data[:len(data) - len(data) % size]):
                    if elf.elfclass == 64:
                        name_off, _info, _other, shndx, value, _size = fields
                    else:
                        name_off, value, _size, _info, _other, shndx = fields
                    if not value or not shndx or not name_off:
                        continue            # undefined or nameless
                    name = want.get(strtab[name_off:strtab.find(b"\0", name_off)])
                    if name is not None and name not in out:
                        out[name] = value
    except (OSError, ELFError, ValueError, struct.error, AssertionError):
        return {}
    return out
