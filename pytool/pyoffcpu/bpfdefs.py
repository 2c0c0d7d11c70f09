"""The constants BPF and user space share, read from the BPF headers.

bpf/pyoffcpu.h and bpf/unwind_defs.h are the one source: every
`#define NAME value  /* comment */` there is read here, so Python never keeps
a second copy in step by hand.  Struct layouts come from bcc's ctypes of the
maps (session, unwind/loader), or are checked against the headers by tests.
"""
from __future__ import annotations

import os
import re
from typing import Dict, Tuple

# bpf/ sits at the top of the source tree (the package is installed editable).
BPF_DIR = os.environ.get("PYOFFCPU_BPF_DIR") or os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bpf"))

_DEFINE = re.compile(r"^#define\s+([A-Z][A-Z0-9_]*)\s+(\(?-?(?:0x[0-9a-fA-F]+|\d+)\)?)(?:ULL|U|L)?\s*"
                     r"(?:/\*\s*(.*?)\s*(?:\*/)?)?$")


def read_defines(name: str) -> Dict[str, Tuple[int, str]]:
    """NAME -> (value, comment) of the plain integer #defines of bpf/<name>."""
    out: Dict[str, Tuple[int, str]] = {}
    with open(os.path.join(BPF_DIR, name)) as f:
        for line in f:
            m = _DEFINE.match(line.strip())
            if m:
                out[m.group(1)] = (int(m.group(2).strip("()"), 0), m.group(3) or "")
    return out


_DEFS: Dict[str, Tuple[int, str]] = {}
for _h in ("pyoffcpu.h", "unwind_defs.h"):
    _DEFS.update(read_defines(_h))


def value(name: str) -> int:
    return _DEFS[name][0]


def with_prefix(prefix: str) -> Dict[str, int]:
    """NAME (without the prefix) -> value, e.g. with_prefix("DROP_")."""
    return {k[len(prefix):]: v for k, (v, _) in _DEFS.items() if k.startswith(prefix)}


# Python stacks (bpf/pyoffcpu.h)
MAX_PY_DEPTH = value("MAX_PY_DEPTH")
PYF_ENTRY = value("PYF_ENTRY")
PYS_TRUNCATED = value("PYS_TRUNCATED")
PYS_READ_FAILED = value("PYS_READ_FAILED")
WALK_NONE = value("WALK_NONE")

# What the time is for
KIND_ONCPU = value("KIND_ONCPU")
KIND_SLEEP = value("KIND_SLEEP")
KIND_RUNQUEUE = value("KIND_RUNQUEUE")
KIND_UNINTERRUPTIBLE = value("KIND_UNINTERRUPTIBLE")
KIND_OTHER = value("KIND_OTHER")

# Threads
TH = with_prefix("TH_")
MAX_INLINE_TARGETS = value("MAX_INLINE_TARGETS")
TARGETS_IN_MAP = value("TARGETS_IN_MAP")

# Native stacks (bpf/unwind_defs.h)
MAX_NATIVE_DEPTH = value("MAX_NATIVE_DEPTH")
MAX_UNWIND_MAPS = value("MAX_UNWIND_MAPS")
NST_TRUNCATED = value("NST_TRUNCATED")
NST_INCOMPLETE = value("NST_INCOMPLETE")
NST_FRAMEPOINTER = value("NST_FRAMEPOINTER")
NST_UNMAPPED = value("NST_UNMAPPED")


def drop_names() -> Dict[int, str]:
    """Index in the drops arrays -> the name the summary prints (the
    header's comment up to its colon: `/* offcpu_start full: ... */`)."""
    out = {}
    for name, (idx, comment) in _DEFS.items():
        if name.startswith("DROP_"):
            out[idx] = (comment.split(":")[0].strip() or name[5:].lower().replace("_", " "))
    return out


N_DROPS = value("N_DROPS")
