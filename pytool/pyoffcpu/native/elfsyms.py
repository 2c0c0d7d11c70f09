"""Values of named symbols in an ELF file (kept for its callers: the one
symbol reader is ``elffile.ElfFile``, and the file is parsed once per session
by the session's ``ElfCache``)."""
from __future__ import annotations

from typing import Dict, Iterable, Optional

from .elffile import ElfCache, default_cache


def defined_symbols(path: str, names: Iterable[str],
                    cache: Optional[ElfCache] = None) -> Dict[str, int]:
    """st_value of the defined symbols among `names` in .dynsym, then (for the
    ones not exported) .symtab; {} when the file cannot be read."""
    return (cache or default_cache()).defined_symbols(path, names)
